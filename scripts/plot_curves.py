#!/usr/bin/env python3
"""Plots the loss curves of training runs: train loss (thin line) and validation loss (markers)
of every run against the step, with a tokens axis on top when the logs count tokens.

  plot_curves.py [--reference LABEL [--spread LABEL]] OUT.png RUN_DIR[:label] [RUN_DIR[:label] ...]

With --reference, a second panel shows each other run's validation loss relative to the
reference run's at the same steps (in %), and with --spread the difference of that run (the
reference's recipe from another seed) as a grey band of +-its size: the seed-to-seed spread.

Reads RUN_DIR/log.jsonl, one JSON object a line: training records {"step", "train_loss", "lr",
"grad_norm", "ms", "tokens_per_s", "mfu", "gpu_mem_gib"[, "tokens"]} and validation records
{"step", "val_loss"}. Lines that are not complete JSON (a run still writing) are skipped.
"""
import json
import math
import os
import sys
from typing import List, NamedTuple, Optional, Tuple

from llama_layout import open_regular

try:
    import matplotlib
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
except ImportError as e:  # a missing or broken install: one line, not a traceback
    raise SystemExit(f"error: scripts/plot_curves.py needs matplotlib ({e}; apt-get install python3-matplotlib, "
                     "or pip install matplotlib)")


class Run(NamedTuple):
    label: str
    train: List[Tuple[int, float]]  # (step, train_loss)
    val: List[Tuple[int, float]]    # (step, val_loss)
    tokens_per_step: float          # 0 when the log does not count tokens


def parse_run_argument(argument: str) -> Tuple[str, str]:
    """RUN_DIR[:label] -> (directory, label); a colon belongs to the path when the rest is not a directory."""
    directory, colon, label = argument.rpartition(":")
    if colon and directory and os.path.isdir(directory):
        return directory, label
    return argument, os.path.basename(os.path.normpath(argument))


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_run(directory: str, label: str) -> Run:
    path = os.path.join(directory, "log.jsonl")
    try:
        with open_regular(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as e:
        raise SystemExit(f"error: {path}: cannot open: {e.strerror}")
    train, val, tokens_per_step = [], [], 0.0
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict) or not is_finite_number(record.get("step")):
            continue
        if is_finite_number(record.get("train_loss")):
            train.append((record["step"], record["train_loss"]))
            if is_finite_number(record.get("tokens")) and record["step"] > 0:
                tokens_per_step = record["tokens"] / record["step"]
        if is_finite_number(record.get("val_loss")):
            val.append((record["step"], record["val_loss"]))
    if not train and not val:
        raise SystemExit(f"error: {path}: no train_loss or val_loss records")
    return Run(label, train, val, tokens_per_step)


def loss_axis_top(runs: List[Run]) -> float:
    """Leaves out the first 5% of each run, whose high initial losses would flatten the rest."""
    tops = []
    for run in runs:
        losses = [loss for _, loss in run.train[len(run.train) // 20:]] + [loss for _, loss in run.val]
        if losses:
            tops.append(max(losses))
    return max(tops)


def relative_val(run: Run, reference: Run) -> List[Tuple[int, float]]:
    """(step, 100 (val / reference val - 1)) at the steps both runs validated."""
    reference_val = dict(reference.val)
    return [(step, 100.0 * (loss / reference_val[step] - 1.0)) for step, loss in run.val if reference_val.get(step)]


def plot_relative(axis, runs: List[Run], reference: Run, spread: Optional[Run]) -> None:
    if spread is not None:
        band = relative_val(spread, reference)
        if band:
            steps, values = zip(*band)
            size = [abs(v) for v in values]
            axis.fill_between(steps, [-v for v in size], size, color="0.85",
                              label=f"seed spread (|{spread.label} - {reference.label}|)")
    for index, run in enumerate(runs):
        if run is reference or run is spread:
            continue
        points = relative_val(run, reference)
        if points:
            axis.plot(*zip(*points), color=f"C{index % 10}", marker="o", markersize=3, linewidth=1.2,
                      label=f"{run.label} vs {reference.label}")
    axis.axhline(0.0, color="0.4", linewidth=0.8)
    axis.set_xlabel("step")
    axis.set_ylabel("val loss vs reference (%)")
    axis.grid(True, alpha=0.3)
    axis.legend()


def plot(out_path: str, runs: List[Run], reference: Optional[Run] = None, spread: Optional[Run] = None) -> None:
    if reference is None:
        figure, axis = plt.subplots(figsize=(10, 6))
    else:
        figure, (axis, relative_axis) = plt.subplots(2, 1, figsize=(10, 9), sharex=True,
                                                     gridspec_kw={"height_ratios": [2, 1]})
        plot_relative(relative_axis, runs, reference, spread)
    for index, run in enumerate(runs):
        color = f"C{index % 10}"
        if run.train:
            axis.plot(*zip(*run.train), color=color, linewidth=0.7, alpha=0.8, label=f"{run.label} train")
        if run.val:
            axis.plot(*zip(*run.val), color=color, marker="o", markersize=4, linewidth=1.5, label=f"{run.label} val")
    all_losses = [loss for run in runs for _, loss in run.train + run.val]
    bottom, top = min(all_losses), loss_axis_top(runs)
    margin = 0.02 * (top - bottom) or 0.1
    axis.set_ylim(bottom - margin, top + margin)
    if reference is None:
        axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.grid(True, alpha=0.3)
    axis.legend()
    rates = {round(run.tokens_per_step) for run in runs if run.tokens_per_step > 0}
    if len(rates) == 1 and all(run.tokens_per_step > 0 for run in runs):
        rate = rates.pop()
        tokens_axis = axis.secondary_xaxis("top", functions=(lambda step: step * rate, lambda tokens: tokens / rate))
        tokens_axis.set_xlabel(f"tokens ({rate:,} per step)")
    elif rates:
        axis.set_title("tokens per step: " + ", ".join(
            f"{run.label} {run.tokens_per_step:,.0f}" for run in runs if run.tokens_per_step > 0))
    figure.tight_layout()
    try:
        figure.savefig(out_path, dpi=120)
    except OSError as e:
        raise SystemExit(f"error: {out_path}: cannot write: {e.strerror}")


def find_run(runs: List[Run], label: Optional[str], option: str) -> Optional[Run]:
    if label is None:
        return None
    for run in runs:
        if run.label == label:
            return run
    raise SystemExit(f"error: {option} {label}: no run has that label ({', '.join(run.label for run in runs)})")


def main() -> int:
    arguments = sys.argv[1:]
    options = {"--reference": None, "--spread": None}
    while arguments and arguments[0] in options:
        if len(arguments) < 2:
            raise SystemExit(f"error: {arguments[0]} needs a run label")
        options[arguments[0]] = arguments[1]
        arguments = arguments[2:]
    if len(arguments) < 2 or (options["--spread"] and not options["--reference"]):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    out_path = arguments[0]
    runs = [read_run(*parse_run_argument(argument)) for argument in arguments[1:]]
    plot(out_path, runs, find_run(runs, options["--reference"], "--reference"), find_run(runs, options["--spread"], "--spread"))
    for run in runs:
        last_train = f"train {run.train[-1][1]:.4f} at step {run.train[-1][0]}" if run.train else "no train records"
        last_val = f", val {run.val[-1][1]:.4f} at step {run.val[-1][0]}" if run.val else ""
        print(f"{run.label}: {last_train}{last_val}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
