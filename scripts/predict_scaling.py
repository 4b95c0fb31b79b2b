#!/usr/bin/env python3
"""Predicted tokens/s per GPU of coat training with ZeRO-1 at 8, 64 and 512 GPUs, on paper.

Per step each rank computes one micro-batch (no gradient accumulation: the global batch grows
with the GPUs, the regime where communication weighs most) and sends what `./train_llama
--dry_run=1 --world_size=W` prints (the gradients' reduces to their owners, the parameters' all-gather in
BF16 or with the block weights in E4M3). Compute time comes from the one-GPU throughput measured
by scripts/bench.sh on an H200 (command-line options to change it), minus the optimizer work
that ZeRO-1 divides by W. A collective over W ranks takes (W - 1) x latency + bytes / bandwidth,
at NVLink's bandwidth within one node of 8 GPUs and at InfiniBand's (one NIC per GPU) beyond.
A step is the forward (a third of the model's FLOPs), the backward (two thirds), the optimizer
and the two collectives, overlapped three ways: none; the gradient reduces under the backward
pass only; and as the trainer runs them, also the parameter gather under the next forward.
Prints a Markdown table. Usage: scripts/predict_scaling.py [--help for the assumptions]
"""
import argparse
import os
import re
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One-GPU coat measurements (scripts/bench.sh on an H200): model -> (micro-batch, seq, tokens/s).
# llama2-13b has no measurement: its throughput is extrapolated at llama2-7b's MFU.
MEASURED = {"llama-1b": (16, 2048, 130763.0), "llama2-7b": (10, 2048, 20108.0)}
ADAMW_FP8_DRE_MS_PER_BILLION = 13.6  # test_optimizer's timing of the FP8+DRE step on an H200


def dry_run(config, shard, args, may_fail=False):
    out = subprocess.run([os.path.join(ROOT, "train_llama"), config, "--dry_run=1", f"--train_data={shard}"] + args,
                         capture_output=True, text=True)
    if out.returncode != 0 and may_fail:
        return None
    if out.returncode != 0:
        sys.exit(f"error: dry_run of {config} {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def parse(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        sys.exit(f"error: dry_run printed no {what}")
    return m.groups()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvlink-gb-s", type=float, default=360.0,
                    help="bus bandwidth per GPU within a node (H100/H200 NVLink 4: 450 GB/s a direction; "
                         "NCCL reaches about 360)")
    ap.add_argument("--ib-gb-s", type=float, default=45.0,
                    help="bus bandwidth per GPU across nodes (one 400 Gb/s InfiniBand NIC per GPU: 50 GB/s)")
    ap.add_argument("--latency-us", type=float, default=8.0, help="per ring step of a collective")
    ap.add_argument("--gpu-memory-gib", type=float, default=136.0, help="memory per GPU for the micro-batch search")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    args = ap.parse_args()

    tmp = tempfile.mkdtemp()
    shard = os.path.join(tmp, "train_000000.bin")
    count = 64 * 4097
    with open(shard, "wb") as f:  # dry_run reads shards: one of small token ids serves every model
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *(i % 1000 for i in range(count))))

    measured_7b = None
    print("| model | GPUs | micro-batch | compute ms | sent per GPU, GB (bf16 / e4m3 gather) | gradients / parameters ms "
          "(bf16 / e4m3) | tokens/s per GPU: no overlap (bf16 / e4m3) | reduces overlapped (bf16 / e4m3) | as built: the "
          "gather overlapped too (bf16 / e4m3) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in ("llama-1b", "llama2-7b", "llama2-13b"):
        config = os.path.join(ROOT, "configs", "models", model + ".conf")
        one = dry_run(config, shard, ["--micro_batch_size=1", "--seq_len=2048", "--precision=coat"])
        params = int(parse(r"^parameters: (\d+)", one, "parameter count")[0])
        if model == "llama2-7b":
            measured_7b = (MEASURED[model][2], params)
        for gpus in (1, 8, 64, 512):
            common = [f"--world_size={gpus}", "--zero_stage=1", "--precision=coat", "--seq_len=2048"]
            if model in MEASURED:
                b = MEASURED[model][0]
            else:
                fit = dry_run(config, shard, common + ["--micro_batch_size=1", f"--gpu_memory_gib={args.gpu_memory_gib}"],
                              may_fail=True)
                if fit is None:
                    print(f"| {model} | {gpus} | does not fit in {args.gpu_memory_gib:.0f} GiB | | | | | | |")
                    continue
                b = int(parse(r"largest micro-batch that fits: (\d+)", fit, "largest micro-batch")[0])
            text = dry_run(config, shard, common + [f"--micro_batch_size={b}", f"--total_batch_tokens={b * 2048 * gpus}"])
            tokens = b * 2048
            if model in MEASURED:
                step_s = tokens / MEASURED[model][2]
            else:  # llama2-7b's throughput scaled by the ratio of parameters (FLOPs per token)
                step_s = tokens / (measured_7b[0] * measured_7b[1] / params)
            adamw_s = ADAMW_FP8_DRE_MS_PER_BILLION * 1e-3 * params / 1e9
            model_s = step_s - adamw_s  # forward and backward
            forward_s, backward_s, optimizer_s = model_s / 3, 2 * model_s / 3, adamw_s / gpus  # ZeRO-1: 1/W of the states
            compute_s = model_s + optimizer_s
            if gpus == 1:
                print(f"| {model} | 1 | {b} x 2048 | {compute_s * 1e3:.0f} | - | - | {tokens / compute_s:,.0f} | | |")
                continue
            gradients, parameters, fp8_parameters = (float(x) for x in parse(
                r"gradients ([0-9.]+) GB \(reduces to the owners, per bucket\), parameters ([0-9.]+) GB \(all-gather, bf16\); ([0-9.]+) GB",
                text, "per-rank traffic"))
            bandwidth = (args.nvlink_gb_s if gpus <= args.gpus_per_node else args.ib_gb_s) * 1e9
            latency = (gpus - 1) * args.latency_us * 1e-6
            reduce_s = latency + gradients * 1e9 / bandwidth
            gathers = [latency + p * 1e9 / bandwidth for p in (parameters, fp8_parameters)]
            none = [tokens / (compute_s + reduce_s + g) for g in gathers]
            reduces = [tokens / (forward_s + max(backward_s, reduce_s) + optimizer_s + g) for g in gathers]
            built = [tokens / (max(forward_s, g) + max(backward_s, reduce_s) + optimizer_s) for g in gathers]
            print(f"| {model} | {gpus} | {b} x 2048 | {compute_s * 1e3:.0f} | {gradients + parameters:.2f} / "
                  f"{gradients + fp8_parameters:.2f} | {reduce_s * 1e3:.0f} / {gathers[0] * 1e3:.0f} / {gathers[1] * 1e3:.0f} | "
                  f"{none[0]:,.0f} / {none[1]:,.0f} | {reduces[0]:,.0f} / {reduces[1]:,.0f} | {built[0]:,.0f} / {built[1]:,.0f} |")
    print()
    print(f"Assumptions: NVLink {args.nvlink_gb_s:.0f} GB/s within {args.gpus_per_node} GPUs, InfiniBand "
          f"{args.ib_gb_s:.0f} GB/s per GPU beyond, {args.latency_us:.0f} us per ring step; ZeRO-1, one micro-batch per "
          f"step; llama2-13b extrapolated from llama2-7b's measured tokens/s by parameter count, its micro-batch the "
          f"largest that fits {args.gpu_memory_gib:.0f} GiB per GPU.")


if __name__ == "__main__":
    main()
