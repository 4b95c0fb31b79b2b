#!/usr/bin/env python3
"""The report of scripts/reproduce_curves.sh: a table and one figure per model size.

  curves_report.py OUT_DIR RESULTS_DIR SIZE=CONFIG [SIZE=CONFIG ...] -- NAME [NAME ...]

Reads OUT_DIR/NAME/log.jsonl (and gpu_seconds, bf16-eval/log.jsonl) of each run that has one.
A run's name says what it is: an optional size prefix ("1b-"; none is the first SIZE), the
precision or ablation, and an optional seed suffix ("-seed2"; none is the config's seed). Each run
is compared with bf16 of the same size and seed (bf16-2ranks, the same batches in another
reduction order, with bf16 too). A run counts towards the seed statistics only when it reached its
config's max_steps.

Writes RESULTS_DIR/curves.md: per seed and mode the final validation loss and its gap to bf16 of
that seed; per mode the mean gap over the seeds and its standard error (the standard deviation of
the gaps over sqrt(n)); bf16's seed-to-seed spread; then every run with its speed, memory and GPU
time. And RESULTS_DIR/curves-SIZE.png: above, the train and validation curves of the size's runs
of the three precisions; below, each mode's validation loss relative to bf16 of the same seed, one
line per seed, over the shaded band of bf16's seeds around their mean.
"""
import json
import math
import os
import re
import statistics
import sys

MODES = ("bf16", "fp8", "coat")


def config_value(path, key):
    for line in open(path, encoding="utf-8"):
        match = re.match(rf"\s*{key}\s*=\s*(\S+)", line)
        if match:
            return match.group(1)
    raise SystemExit(f"error: {path}: no {key}")


def describe(name, sizes):
    """(size, kind, seed) of a run name: kind is a mode or an ablation's name, seed an int or None."""
    size = sizes[0]
    for candidate in sizes[1:]:
        if name.startswith(candidate + "-"):
            size, name = candidate, name[len(candidate) + 1:]
    match = re.fullmatch(r"(.+)-seed(\d+)", name)
    kind, seed = (match.group(1), int(match.group(2))) if match else (name, None)
    return size, kind, seed


def read_log(path):
    records = []
    try:
        lines = open(path, encoding="utf-8").readlines()
    except OSError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line still being written, or a non-finite loss
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def read_run(out, name):
    folder = os.path.join(out, name)
    records = read_log(os.path.join(folder, "log.jsonl"))
    if not records:
        return None
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    bf16_eval = [r["val_loss"] for r in read_log(os.path.join(folder, "bf16-eval", "log.jsonl"))
                 if r["step"] == 0 and "val_loss" in r]
    seconds_path = os.path.join(folder, "gpu_seconds")
    seconds = sum(int(x) for x in open(seconds_path).read().split()) if os.path.exists(seconds_path) else 0
    return {
        "train": [(r["step"], r["train_loss"]) for r in train],
        "val": [(r["step"], r["val_loss"]) for r in val],
        "steps": train[-1]["step"] if train else 0,
        "tokens": train[-1].get("tokens", 0) if train else 0,
        "final": val[-1]["val_loss"] if val else None,
        "final_step": val[-1]["step"] if val else 0,
        "bf16_eval": bf16_eval[0] if bf16_eval else None,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[5:]) if len(train) > 5 else 0,
        "gib": max((r.get("gpu_mem_gib", 0) for r in train), default=0),
        "seconds": seconds,
    }


def mean_and_error(values):
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    return mean, statistics.stdev(values) / math.sqrt(len(values))


def percent(x):
    return f"{100 * x:+.2f}%"


class Report:
    def __init__(self, out, sizes, configs, names):
        self.sizes, self.configs, self.runs = sizes, configs, {}
        for name in names:
            run = read_run(out, name)
            if run is not None:
                size, kind, seed = describe(name, sizes)
                run.update(name=name, size=size, kind=kind, seed=seed if seed is not None else configs[size]["seed"])
                run["complete"] = run["final_step"] == configs[size]["max_steps"]
                self.runs[name] = run

    def find(self, size, kind, seed):
        for run in self.runs.values():
            if (run["size"], run["kind"], run["seed"]) == (size, kind, seed):
                return run
        return None

    def reference(self, run):
        return None if run["kind"] == "bf16" else self.find(run["size"], "bf16", run["seed"])

    def gap(self, run, key="final"):
        base = self.reference(run)
        if base is None or base["final"] is None or run[key] is None:
            return None
        return run[key] / base["final"] - 1

    def seeds(self, size):
        return sorted({r["seed"] for r in self.runs.values() if r["size"] == size and r["kind"] in MODES})

    def seed_table(self, size):
        """Lines of the per-seed table and the mean gaps, for the complete runs of one size."""
        lines = [f"| seed | " + " | ".join(MODES) + " |", "|---|" + "---|" * len(MODES)]
        gaps = {mode: [] for mode in MODES[1:]}
        for seed in self.seeds(size):
            cells = []
            for mode in MODES:
                run = self.find(size, mode, seed)
                if run is None or not run["complete"]:
                    cells.append("-" if run is None else f"step {run['final_step']} of {self.configs[size]['max_steps']}")
                    continue
                gap = self.gap(run)
                if mode != "bf16" and gap is not None and self.reference(run)["complete"]:
                    gaps[mode].append(gap)
                cells.append(f"{run['final']:.4f}" + (f" ({percent(gap)})" if mode != "bf16" and gap is not None else ""))
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        summary = []
        for mode, values in gaps.items():
            if values:
                mean, error = mean_and_error(values)
                error_text = f" +- {100 * error:.2f}% (standard error)" if error is not None else " (one seed: no standard error)"
                summary.append(f"- {mode}: mean gap to bf16 {percent(mean)}{error_text} over {len(values)} seed(s)")
        bf16 = [r["final"] for r in self.runs.values() if r["size"] == size and r["kind"] == "bf16" and r["complete"]]
        if len(bf16) > 1:
            mean = statistics.mean(bf16)
            summary.append(f"- bf16 over {len(bf16)} seeds: {mean:.4f}, standard deviation {100 * statistics.stdev(bf16) / mean:.2f}% "
                           f"of the mean, lowest to highest {100 * (max(bf16) / min(bf16) - 1):.2f}% apart")
        return lines + [""] + summary

    def run_table(self):
        lines = ["| run | seed | steps | tokens | final val loss | vs bf16 (same size and seed) | final weights, BF16 compute "
                 "(vs bf16) | median tokens/s | peak GPU memory (GiB) | GPU time |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for run in self.runs.values():
            gap, eval_gap = self.gap(run), self.gap(run, "bf16_eval")
            final = f"{run['final']:.4f} (step {run['final_step']})" if run["final"] is not None else "-"
            bf16_eval = f"{run['bf16_eval']:.4f} ({percent(eval_gap)})" if run["bf16_eval"] is not None and eval_gap is not None else ""
            minutes = f"{run['seconds'] / 60:.1f} min" if run["seconds"] else "-"
            lines.append(f"| {run['name']} | {run['seed']} | {run['steps']} | {run['tokens'] / 1e6:.1f}M | {final} | "
                         f"{percent(gap) if gap is not None else ''} | {bf16_eval} | {run['tokens_per_s']:,.0f} | "
                         f"{run['gib']:.2f} | {minutes} |")
        return lines

    def plot(self, size, path):
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 9), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
        colors = {"bf16": "C0", "fp8": "C1", "coat": "C2"}
        styles = ["-", "--", ":", "-."]
        seeds = self.seeds(size)
        for index, seed in enumerate(seeds):
            for mode in MODES:
                run = self.find(size, mode, seed)
                if run is None:
                    continue
                label = f"{mode} seed {seed}"
                style = styles[index % len(styles)]
                if run["train"]:
                    top.plot(*zip(*run["train"]), color=colors[mode], linestyle=style, linewidth=0.5, alpha=0.5)
                if run["val"]:
                    top.plot(*zip(*run["val"]), color=colors[mode], linestyle=style, marker="o", markersize=2.5,
                             linewidth=1.2, label=f"{label} val")
                base = self.reference(run)
                if base is not None:
                    reference = dict(base["val"])
                    points = [(s, 100 * (v / reference[s] - 1)) for s, v in run["val"] if s in reference and s > 0]
                    if points:
                        bottom.plot(*zip(*points), color=colors[mode], linestyle=style, marker="o", markersize=2.5,
                                    linewidth=1.2, label=f"{mode} vs bf16, seed {seed}")
        band = [self.find(size, "bf16", seed) for seed in seeds]
        band = [run for run in band if run is not None]
        if len(band) > 1:
            steps = sorted(set.intersection(*(set(s for s, _ in run["val"]) for run in band)) - {0})
            lows, highs = [], []
            for step in steps:
                losses = [dict(run["val"])[step] for run in band]
                mean = statistics.mean(losses)
                lows.append(100 * (min(losses) / mean - 1))
                highs.append(100 * (max(losses) / mean - 1))
            bottom.fill_between(steps, lows, highs, color="0.85", label=f"bf16's {len(band)} seeds around their mean")
        losses = [v for run in self.runs.values() if run["size"] == size for _, v in run["val"] if _ > 0]
        if losses:
            top.set_ylim(min(losses) - 0.1, min(max(losses), min(losses) + 4))
        top.set_ylabel("loss (thin: train)")
        top.set_title(f"llama-{size}: bf16, fp8 and coat, one line style per seed")
        top.grid(True, alpha=0.3)
        top.legend(fontsize=7, ncol=3)
        bottom.axhline(0.0, color="0.4", linewidth=0.8)
        bottom.set_xlabel("step")
        bottom.set_ylabel("val loss vs bf16, same seed (%)")
        bottom.grid(True, alpha=0.3)
        bottom.legend(fontsize=7, ncol=2)
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)


def main(args):
    if "--" not in args or args.index("--") < 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    split = args.index("--")
    out, results, names = args[0], args[1], args[split + 1:]
    sizes, configs = [], {}
    for spec in args[2:split]:
        size, _, path = spec.partition("=")
        sizes.append(size)
        configs[size] = {"path": path, "max_steps": int(config_value(path, "max_steps")), "seed": int(config_value(path, "seed"))}
    report = Report(out, sizes, configs, names)
    if not report.runs:
        raise SystemExit(f"error: no run has a log in {out} (scripts/reproduce_curves.sh run NAME)")
    lines = ["# Pretraining curves: bf16, fp8 and coat on the local corpus", "",
             "Each batch draws its rows from all over the corpus (`shuffle = rows`). A seed sets the initial weights",
             "and the data order, the same for every precision at that seed. Final val loss: the mean over the same",
             "held-out batches after the last step; the gap: relative to bf16 at the same seed.", ""]
    try:
        import matplotlib  # noqa: F401
        have_plot = True
    except ImportError:
        have_plot = False
        print("report: matplotlib is not installed: no figures (the tables are written)", file=sys.stderr)
    for size in sizes:
        if not any(run["size"] == size for run in report.runs.values()):
            continue
        config = configs[size]
        lines += [f"## llama-{size} (`{config['path']}`, {config['max_steps']} steps)", ""]
        if have_plot:
            figure = f"curves-{size}.png"
            report.plot(size, os.path.join(results, figure))
            lines += [f"![llama-{size}]({figure})", ""]
        lines += report.seed_table(size) + [""]
    lines += ["## Every run", ""] + report.run_table() + [""]
    lines += ["Commands (the corpus: `scripts/fetch_corpus.sh`; `scripts/reproduce_curves.sh status` says what is left):", "",
              "```sh"] + [f"scripts/reproduce_curves.sh run {name}   # again while it exits 3" for name in report.runs] + \
             ["scripts/reproduce_curves.sh report", "```", ""]
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "curves.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines))
    print("\n".join(line for line in lines if line.startswith(("|", "- "))))
    print(f"report: wrote {os.path.join(results, 'curves.md')}")


if __name__ == "__main__":
    main(sys.argv[1:])
