#!/usr/bin/env python3
"""The loss-parity table over several seeds (scripts/loss_parity.sh runs, one folder per seed).

  parity_seeds.py SEED=DIR [SEED=DIR ...]

Each DIR holds one seed's runs, as RUN/log.jsonl (loss_parity.sh's OUT_DIR) or RUN.log.jsonl
(configs/results/parity/), and for the runs without a log there, the table of its parity.md.
Prints a Markdown table: each run's final validation loss per seed, in brackets its difference
to bf16 of the same seed (bf16-2ranks: to bf16-accum2, the same batches on one rank), and over
the seeds that have both, the mean difference and its standard error (the standard deviation of
the differences over sqrt(n)). One seed's difference mixes the mode's effect with what any
perturbation does to a run; the mean over seeds separates them.
"""
import json
import math
import os
import sys

from llama_layout import open_regular


def final_val_loss(path):
    """The last validation loss of a JSONL log, or None."""
    loss = None
    try:
        with open_regular(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a non-finite loss is not JSON
        if isinstance(record, dict) and "val_loss" in record:
            loss = record["val_loss"]
    return loss


def table_losses(path):
    """{run: final val loss} from the table of a parity.md (runs whose logs were not kept)."""
    runs = {}
    try:
        with open_regular(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError:
        return runs
    in_table = False
    for line in lines:
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[1] == "final val loss":  # the losses' table, not Table 1's
            in_table = True
        elif in_table:
            try:
                runs[cells[0]] = float(cells[1])
            except (IndexError, ValueError):
                pass  # the rule under the header, or a failed run
    return runs


def runs_of(folder):
    """{run: final val loss} of one seed's folder: its logs, else its parity.md's table."""
    runs = table_losses(os.path.join(folder, "parity.md"))
    for entry in sorted(os.listdir(folder)):
        path = os.path.join(folder, entry)
        if entry.endswith(".log.jsonl"):
            name = entry[: -len(".log.jsonl")]
        elif os.path.isfile(os.path.join(path, "log.jsonl")):
            name, path = entry, os.path.join(path, "log.jsonl")
        else:
            continue
        loss = final_val_loss(path)
        if loss is not None:
            runs[name] = loss
    return runs


def reference(run):
    return "bf16-accum2" if run == "bf16-2ranks" else "bf16"


def main(args):
    if not args or any("=" not in a for a in args):
        sys.exit("usage: parity_seeds.py SEED=DIR [SEED=DIR ...]")
    seeds = []
    for arg in args:
        seed, folder = arg.split("=", 1)
        if not os.path.isdir(folder):
            sys.exit(f"error: {folder}: no such folder (seed {seed})")
        seeds.append((seed, runs_of(folder)))
    order = ["bf16", "fp8", "coat"]
    for _, runs in seeds:
        order += [r for r in runs if r not in order]
    print("| run | " + " | ".join(f"seed {s}" for s, _ in seeds) + " | mean difference | standard error | seeds |")
    print("|---|" + "---|" * len(seeds) + "---|---|---|")
    for run in order:
        cells, gaps = [], []
        for _, runs in seeds:
            if run not in runs:
                cells.append("")
                continue
            base = runs.get(reference(run))
            if run == reference(run) or base is None:
                cells.append(f"{runs[run]:.4f}")
            else:
                gap = runs[run] / base - 1
                gaps.append(gap)
                cells.append(f"{runs[run]:.4f} ({100 * gap:+.2f}%)")
        if not any(cells):
            continue
        mean = f"{100 * sum(gaps) / len(gaps):+.2f}%" if gaps else ""
        error = ""
        if len(gaps) > 1:
            m = sum(gaps) / len(gaps)
            deviation = math.sqrt(sum((g - m) ** 2 for g in gaps) / (len(gaps) - 1))
            error = f"{100 * deviation / math.sqrt(len(gaps)):.2f}%"
        print(f"| {run} | " + " | ".join(cells) + f" | {mean} | {error} | {len(gaps) or ''} |")


if __name__ == "__main__":
    main(sys.argv[1:])
