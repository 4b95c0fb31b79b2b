#!/usr/bin/env python3
"""Predicted tokens/s per GPU of coat training at ZeRO-1 on 8, 64 and 512 GPUs, and of llama2-70b at
ZeRO-3 (stage3 below), on paper, modelling the collectives as train_llama issues them.

Per step each rank computes one micro-batch (no gradient accumulation: the global batch grows with
the GPUs, the regime where communication weighs most). The step starts from the one-GPU step that
scripts/bench.sh measured on an H200 (MEASURED below) and adds what communication exposes:

  calls   `./train_llama --dry_run=1 --world_size=W --zero_stage=1` prints the collective calls of a
          step: one ncclReduceScatter per gradient bucket, one ncclAllGather per bucket for the
          parameters (with the E4M3 gather a bucket of layers travels as a byte per element), the
          loss-and-norm all-reduce and, with the E4M3 gather, the scale table's and the norm table's.
          Buckets are the layers, the tail and the embedding (coat/zero.h merges layers smaller than
          the config's bucket_min_elems, 32M by default), the same at any W. The script derives the same buckets from the
          parameter layout and stops if its count differs from what dry_run prints.
  a call  A ReduceScatter or AllGather on a ring: W - 1 steps, each a hop, so it takes base + (W -
          nodes) x NVLink hop + (nodes - 1) x network hop latency, plus (W - 1) / W of the bucket's
          bytes over the ring's bus bandwidth. A small all-reduce (loss, norm, the tables) takes the
          latency of a tree.
  links   Within one node the ring runs over NVLink. Across nodes each node has --nics-per-node NICs, one
          per GPU, and NCCL lays its rings over all of them, so a ring's inter-node bus bandwidth is the
          node's aggregate NIC bandwidth, capped by NVLink's.
  overlap What the code overlaps, and only that: each bucket's reduce starts when backward has finished
          that bucket and runs beside the rest of backward (the embedding's bucket, finished last, runs
          after it); the gather, issued after the optimizer step, runs beside the next forward, which
          waits for each bucket just before it reads it (the embedding and layer 0 before it starts).
          The loss-and-norm all-reduce, the scale-table all-reduce and the optimizer overlap nothing.
          Compute running beside a collective is slowed by NCCL's kernels taking SMs (--sm-slowdown).
  compute The forward pass is a third of the one-GPU step less its optimizer, backward two thirds,
          shared among the buckets by their FLOPs (matmul parameters and causal attention); the
          optimizer is counted as on one GPU (see the assumptions), so no prediction exceeds the
          measured one-GPU rate.

  hybrid  With --shard-group N (shard_group = N above N GPUs) ZeRO-1, and llama2-70b's stage 3, run
          within groups of N GPUs and each bucket's reduce-scatter is followed by the all-reduce of its
          part across the groups on the same stream (dry_run prints both levels; the script checks its
          bytes against them).

Prints a Markdown table and its assumptions. Usage: scripts/predict_scaling.py [options]
"""
import argparse
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from llama_layout import PARAM_ALIGN_ELEMS, ParamLayout, model_shape_from_config, round_up  # noqa: E402

# One-GPU coat measurements on an H200 (configs/results/performance.md: llama-1b beside PyTorch,
# llama2-7b and llama3-8b at the largest micro-batch that fits): model -> (micro-batch, seq, tokens/s).
MEASURED = {"llama-1b": (16, 2048, 133848.0), "llama2-7b": (13, 2048, 21586.0), "llama3-8b": (10, 2048, 18289.0)}
MODELS = ("llama-1b", "llama2-7b", "llama3-8b")
GPU_COUNTS = (1, 8, 64, 512)
ADAMW_FP8_DRE_MS_PER_BILLION = 8.7  # test_optimizer's timing of the FP8+DRE step on an H200

# coat/params.h's kinds, by index (scripts/llama_layout.py's PARAM_KINDS)
EMBEDDING, ATTN_NORM, WQ, WK, WV, WO, MLP_NORM, W_GATE, W_UP, W_DOWN, FINAL_NORM, LM_HEAD = range(12)


def dry_run(config, shard, args):
    out = subprocess.run([os.path.join(ROOT, "train_llama"), config, "--dry_run=1", f"--train_data={shard}"] + args,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"error: dry_run of {config} {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def parse(pattern, text, what):
    m = re.search(pattern, text, re.M)
    if not m:
        sys.exit(f"error: dry_run printed no {what}")
    return m.groups()


BUCKET_MIN_ELEMS = 33554432  # the config's default bucket_min_elems (coat/config.h)


def segment_range(layout, s):
    """Segment s (coat/params.h: 0 the tail, 1 .. L the layers from the last, L + 1 the embedding)."""
    L = layout.shape.n_layers
    if s == 0:
        return layout.tail_offset[FINAL_NORM], layout.total_padded
    if s <= L:
        begin = layout.first_layer_offset + (L - s) * layout.layer_stride
        return begin, begin + layout.layer_stride
    return 0, layout.first_layer_offset


def bucket_plan(layout, ranks, e4m3):
    """The buckets as coat/zero.h's zero_plan_buckets merges the segments, in backward's order:
    (first segment, last segment, reduce-scatter bytes, all-gather bytes) per bucket, the bytes one
    rank sends (a ring's (W - 1) / W of the bucket padded to W parts of a multiple of 128)."""
    L = layout.shape.n_layers
    runs = [[0, 0]]
    for s in range(1, L + 1):
        first, last = runs[-1]
        if first >= 1 and segment_range(layout, first)[1] - segment_range(layout, last)[0] < BUCKET_MIN_ELEMS:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    runs.append([L + 1, L + 1])
    plan = []
    for first, last in runs:
        n = segment_range(layout, first)[1] - segment_range(layout, last)[0]
        padded = ranks * round_up(-(-n // ranks), PARAM_ALIGN_ELEMS)
        share = (ranks - 1) / ranks
        layers = first >= 1 and last <= L
        plan.append((first, last, 2 * padded * share, (1 if e4m3 and layers else 2) * padded * share))
    return plan


def bucket_flops(layout, seq):
    """Forward FLOPs per token of each bucket, in backward's order: the lm_head, the layers, the
    embedding (a lookup: none)."""
    shape = layout.shape
    numel = [r * c for r, c in zip(layout.rows, layout.cols)]
    layer = 2 * sum(numel[k] for k in (WQ, WK, WV, WO, W_GATE, W_UP, W_DOWN))
    layer += 2 * seq * shape.n_heads * shape.head_dim  # causal attention: QK^T and PV over half the keys
    return [2 * numel[LM_HEAD]] + [layer] * shape.n_layers + [0]


def overlap(a, b):
    """Length of time both sets of intervals cover (each set disjoint)."""
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nvlink-gb-s", type=float, default=360.0,
                    help="ring bus bandwidth per GPU within a node (H200 NVLink 4: 450 GB/s a direction; NCCL reaches "
                         "about 360)")
    ap.add_argument("--nics-per-node", type=int, default=8, help="NICs per node, one per GPU")
    ap.add_argument("--nic-gb-s", type=float, default=45.0,
                    help="what one NIC carries (400 Gb/s InfiniBand: 50 GB/s, about 45 reached)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--latency-us", type=float, default=8.4,
                    help="base latency of a collective call (NCCL's tuning model, ring, Simple protocol)")
    ap.add_argument("--nvlink-hop-us", type=float, default=3.4,
                    help="latency of one ring hop over NVLink (NCCL's tuning model, ring, Simple)")
    ap.add_argument("--net-hop-us", type=float, default=14.0,
                    help="latency of one ring hop across nodes (NCCL's tuning model, ring, Simple, network)")
    ap.add_argument("--sm-slowdown", type=float, default=0.075,
                    help="slowdown of compute that runs beside a collective (NCCL's kernels take SMs: 5-10%%)")
    ap.add_argument("--param-gather", choices=("auto", "bf16", "e4m3"), default="auto",
                    help="param_gather of the runs (auto: E4M3 with coat's FP8 GEMMs)")
    ap.add_argument("--calibrate", metavar="FILE", nargs="+",
                    help="build/bench_collectives' JSON lines, from runs within one node (scripts/bench_scaling.sh "
                         "writes them): fit --latency-us, --nvlink-hop-us and --nvlink-gb-s to them and use the fit")
    ap.add_argument("--shard-group", type=int, default=0,
                    help="shard_group of the ZeRO-1 table's runs above that many GPUs (0: ZeRO over every GPU; N: within groups of N "
                         "GPUs, a node each at N = --gpus-per-node, each gradient part all-reduced across the groups)")
    args = ap.parse_args()
    if args.shard_group == 1 or args.shard_group < 0 or any(
            args.shard_group < g and g % args.shard_group for g in GPU_COUNTS if args.shard_group > 1):
        sys.exit(f"error: --shard-group {args.shard_group}: a group of 2 or more GPUs that divides each of "
                 f"{', '.join(map(str, GPU_COUNTS[1:]))} above it (0: none)")
    if args.calibrate:
        calibrate(args)

    tmp = tempfile.mkdtemp()
    shard = os.path.join(tmp, "train_000000.bin")
    count = 64 * 4097
    with open(shard, "wb") as f:  # dry_run reads shards: one of small token ids serves every model
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *(i % 1000 for i in range(count))))

    print("| model | GPUs | micro-batch | collective calls per step (reduce-scatters / all-gathers / all-reduces) | sent per GPU, GB "
          "| communication ms | exposed ms | tokens/s per GPU | vs one GPU |")
    print("|---|---|---|---|---|---|---|---|---|")
    notes = {}
    for model in MODELS:
        config = os.path.join(ROOT, "configs", "models", model + ".conf")
        layout = ParamLayout(model_shape_from_config(config))
        b, seq, rate = MEASURED[model]
        tokens = b * seq
        step_s = tokens / rate  # the measured one-GPU step: forward, backward, optimizer (and the FP8 cast)
        adamw_s = ADAMW_FP8_DRE_MS_PER_BILLION * 1e-3 * layout.total_params / 1e9
        model_s = step_s - adamw_s
        flops = bucket_flops(layout, seq)
        forward = [model_s / 3 * f / sum(flops) for f in flops]  # per bucket, backward's order
        backward = [2 * x for x in forward]
        for gpus in GPU_COUNTS:
            if gpus == 1:
                print(f"| {model} | 1 | {b} x {seq} | - | - | 0 | 0 | {rate:,.0f} | 100.0% |")
                continue
            group = args.shard_group if 1 < args.shard_group < gpus else gpus  # the ranks that shard the states
            groups = gpus // group
            common = [f"--world_size={gpus}", "--zero_stage=1", "--precision=coat", f"--seq_len={seq}",
                      f"--micro_batch_size={b}", f"--total_batch_tokens={tokens * gpus}", f"--param_gather={args.param_gather}"]
            text = dry_run(config, shard, common + ([f"--shard_group={group}"] if groups > 1 else []))
            e4m3 = parse(r"this run gathers (e4m3|bf16)", text, "gather precision")[0] == "e4m3"
            across_reduces, across_gb = 0, 0.0
            if groups > 1:  # hybrid: the calls and bytes within a group, then across the groups
                reduces, gathers, all_reduces, across_reduces, across_gb = hybrid_calls(text, f"{model} at {gpus} GPUs")
                traffic = r"within the group: gradients ([0-9.]+) GB \(reduce-scatters\), parameters ([0-9.]+) GB \(all-gather, bf16\)"
            else:
                reduces, gathers, all_reduces = (int(x) for x in parse(
                    r"^collective calls per step: (\d+) reduce-scatters .*?, (\d+) all-gathers .*?, (\d+) all-reduces", text,
                    "collective calls"))
                traffic = r"gradients ([0-9.]+) GB \(reduce-scatters\), parameters ([0-9.]+) GB \(all-gather, bf16\)"
            gradients, parameters, fp8_parameters = (float(x) if x else None for x in parse(
                traffic + r"(?:; ([0-9.]+) GB)?", text, "per-rank traffic"))
            sent = gradients + (fp8_parameters if e4m3 else parameters) + across_gb
            plan = bucket_plan(layout, group, e4m3)
            if (len(plan), len(plan)) != (reduces, gathers) or (groups > 1 and across_reduces != len(plan)):
                sys.exit(f"error: {model} at {gpus} GPUs: dry_run counts {reduces} reduce-scatters, {gathers} "
                         f"all-gathers and {across_reduces} all-reduces across groups, this script's plan {len(plan)} buckets")

            call, bus, all_reduce, across_call, across_bus = links(args, gpus, group)
            across_bytes = across_bytes_of(plan, group, groups, across_gb, f"{model} at {gpus} GPUs")
            # Per segment: a bucket's calls at its last segment, where backward finishes it and the
            # forward first reads it; its other segments wait for it there. Across the groups the
            # bucket's all-reduce follows its reduce-scatter on the same stream.
            L = layout.shape.n_layers
            reduce_s, gather_s, holder = [0.0] * (L + 2), [0.0] * (L + 2), list(range(L + 2))
            for (first, last, reduce_bytes, gather_bytes), across in zip(plan, across_bytes):
                reduce_s[last] = call + reduce_bytes / bus + (across_call + across / across_bus if groups > 1 else 0.0)
                gather_s[last] = call + gather_bytes / bus
                for s in range(first, last + 1):
                    holder[s] = last

            # Forward: the gather, issued in the order the forward reads the buckets (the embedding,
            # layer 0, ..., the tail), runs on its own stream; the forward waits for the embedding and
            # layer 0, then before each next layer, and before the classifier for the tail.
            order = list(range(L + 1, -1, -1))
            arrival, t, gather_busy = {}, 0.0, []
            for bucket in order:
                if holder[bucket] == bucket:
                    gather_busy.append((t, t + gather_s[bucket]))
                    t += gather_s[bucket]
                arrival[bucket] = t
            arrival = {s: arrival[holder[s]] for s in arrival}
            t = max(arrival[L + 1], arrival[L])
            forward_busy = []
            for layer in range(L):
                bucket = L - layer
                forward_busy.append((t, t + forward[bucket]))
                t += forward[bucket]
                t = max(t, arrival[bucket - 1])  # the next layer's bucket, or the tail's
            forward_busy.append((t, t + forward[0]))  # the classifier
            t += forward[0]
            forward_stall = t - sum(forward)
            # Backward: bucket b's reduce starts when backward has finished it and the previous one is sent.
            t, done, reduce_busy = 0.0, 0.0, []
            for bucket in range(L + 2):
                t += backward[bucket]
                start = max(t, done)
                done = start + reduce_s[bucket]
                reduce_busy.append((start, done))
            reduce_tail = max(0.0, done - t)
            overlapped = overlap(gather_busy, forward_busy) + overlap(reduce_busy, [(0.0, t)])
            comm_s = sum(reduce_s) + sum(gather_s) + all_reduces * all_reduce
            exposed_s = forward_stall + reduce_tail + all_reduces * all_reduce + args.sm_slowdown * overlapped
            per_gpu = tokens / (step_s + exposed_s)
            across_text = f" + {across_reduces} across {groups} groups" if groups > 1 else ""
            print(f"| {model} | {gpus} | {b} x {seq} | {reduces} / {gathers} / {all_reduces}{across_text} | {sent:.2f} | "
                  f"{comm_s * 1e3:,.0f} | {exposed_s * 1e3:,.0f} | {per_gpu:,.0f} | {100 * per_gpu / rate:.1f}% |")
            notes[(model, gpus)] = (call, bus, adamw_s * (1 - 1 / group))
    call512, bus512, saving = notes[("llama2-7b", 512)]
    print()
    print("Assumptions:")
    print(f"- One micro-batch per GPU and step at the measured one-GPU micro-batch, ZeRO-1, precision coat, "
          f"param_gather {args.param_gather}; one-GPU tokens/s measured on an H200: "
          + ", ".join(f"{m} {MEASURED[m][2]:,.0f} at {MEASURED[m][0]} x {MEASURED[m][1]}" for m in MODELS) + ".")
    print("- Calls per step as dry_run prints them, from the plan as the code issues them: one ncclReduceScatter and one "
          "ncclAllGather per bucket (a layer, the tail, the embedding), the loss-and-norm all-reduce and, with the E4M3 "
          "gather, the scale table's and the norm table's.")
    print(f"- A ReduceScatter or AllGather call runs on a ring: {args.latency_us:g} us + {args.nvlink_hop_us:g} us per "
          f"NVLink hop + {args.net_hop_us:g} us per hop across nodes along its W - 1 steps ({call512 * 1e3:.2f} ms at "
          f"512 GPUs), then (W - 1) / W of its bytes over the ring's bus bandwidth; calls are charged one after the "
          f"other (NCCL's own tuning model charges every hop of a multi-node ring at the network's latency, more than "
          f"here).")
    print(f"- Bus bandwidth per GPU: {args.nvlink_gb_s:g} GB/s over NVLink within a node of {args.gpus_per_node} GPUs; "
          f"across nodes, {args.nics_per_node} NICs per node at {args.nic_gb_s:g} GB/s each, one per GPU, NCCL's rings "
          f"spread over all of them: min(NVLink, {args.nics_per_node} x {args.nic_gb_s:g}) = {bus512 / 1e9:g} GB/s.")
    print("- Small all-reduces (loss and norm, the scale and norm tables) take a tree's latency, 2 x (NVLink hops within the node + "
          "log2(nodes) network hops), exposed.")
    print("- Overlap as built: each bucket's reduce beside the rest of backward (the embedding's after it), the "
          "parameter gather beside the next forward, which waits for each bucket before reading it; the all-reduces and "
          "the optimizer overlap nothing.")
    if args.shard_group > 1:
        print(f"- shard_group {args.shard_group} above {args.shard_group} GPUs: ZeRO-1 within each group of "
              f"{args.shard_group} (its rings' hops and bandwidth as above for {args.shard_group} GPUs), then each "
              f"bucket's part all-reduced across the groups right after its reduce-scatter: a ring of the groups, "
              f"2 (G - 1) hops, a network hop each when they span nodes, the node's GPUs sharing its NICs "
              f"({args.nics_per_node} x {args.nic_gb_s:g} / {args.gpus_per_node} GB/s each); the ring bytes per rank as "
              f"dry_run prints them.")
    print(f"- Compute beside a collective runs {100 * args.sm_slowdown:g}% slower (NCCL's kernels take SMs); that cost "
          f"counts as exposed.")
    print(f"- Forward a third of the one-GPU step less its optimizer ({ADAMW_FP8_DRE_MS_PER_BILLION:g} ms per billion "
          f"parameters), backward two thirds, shared among buckets by FLOPs. The optimizer counts as on one GPU: ZeRO-1 "
          f"steps 1/W of the states, a saving not credited (llama2-7b at 512 GPUs: {saving * 1e3:.0f} ms a step), so "
          f"no prediction exceeds the measured one-GPU rate.")

    stage3(args, shard)


def solve(rows, values):
    """Least squares: x minimising |rows x - values|, by the normal equations (a few unknowns)."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * v for r, v in zip(rows, values))] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda i: abs(a[i][col]))
        a[col], a[pivot] = a[pivot], a[col]
        if abs(a[col][col]) < 1e-300:
            return None
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def calibrate(args):
    """Fits a collective call's time within a node, t = latency + (W - 1) hop + sent / bus bandwidth,
    to bench_collectives' measurements (each weighed by 1 / t, so that the small calls, which set
    the latencies, count as much as the large ones), and puts the fit in args. With one world size
    the hop keeps its value and the latency takes up the rest."""
    points = []
    for path in args.calibrate:
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            sys.exit(f"error: {path}: cannot read: {e.strerror}")
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
                w, sent, ms = int(r["world"]), float(r["sent_bytes"]), float(r["ms"])
            except (ValueError, KeyError, TypeError):
                sys.exit(f"error: {path}:{number}: not a bench_collectives line (JSON with world, sent_bytes and ms)")
            if w < 2 or w > args.gpus_per_node or sent <= 0 or ms <= 0:
                sys.exit(f"error: {path}:{number}: world {w}, sent_bytes {sent:g}, ms {ms:g}: a measurement within one node "
                         f"of {args.gpus_per_node} GPUs takes 2 to {args.gpus_per_node} ranks, bytes and a time above 0")
            points.append((w, sent, ms * 1e-3))
    if len(points) < 3:
        sys.exit(f"error: {' '.join(args.calibrate)}: {len(points)} measurements, the fit needs at least 3")
    worlds = sorted({w for w, _, _ in points})
    hop_s = args.nvlink_hop_us * 1e-6
    if len(worlds) > 1:
        fit = solve([[1 / t, (w - 1) / t, s / t] for w, s, t in points], [1.0] * len(points))
        latency_s, hop_s, inverse_bus = fit if fit else (0, 0, 0)
    else:
        fit = solve([[1 / t, s / t] for w, s, t in points], [1 - (w - 1) * hop_s / t for w, s, t in points])
        latency_s, inverse_bus = fit if fit else (0, 0)
    if not fit or latency_s <= 0 or hop_s < 0 or inverse_bus <= 0:
        sys.exit(f"error: {' '.join(args.calibrate)}: the measurements do not fit latency + (W - 1) hop + bytes / bandwidth "
                 f"with positive terms (at W = {', '.join(map(str, worlds))})")
    worst = max(abs(latency_s + (w - 1) * hop_s + s * inverse_bus - t) / t for w, s, t in points)
    args.latency_us, args.nvlink_hop_us, args.nvlink_gb_s = latency_s * 1e6, hop_s * 1e6, 1e-9 / inverse_bus
    print(f"Calibrated from {len(points)} measured calls at W = {', '.join(map(str, worlds))} GPUs: "
          f"{args.latency_us:.2f} us a call + {args.nvlink_hop_us:.2f} us per NVLink hop, {args.nvlink_gb_s:.1f} GB/s "
          f"NVLink bus bandwidth (largest deviation of a call from the fit: {100 * worst:.1f}%).")
    print()


def links(args, gpus, group):
    """What the collectives of `gpus` GPUs sharding within groups of `group` cost: a reduce-scatter's
    or all-gather's fixed time on the group's ring and its bus bandwidth (bytes/s), a small
    all-reduce over every GPU, and across the groups (hybrid) an all-reduce's fixed time and bus
    bandwidth."""
    nodes, world_nodes = -(-group // args.gpus_per_node), -(-gpus // args.gpus_per_node)
    bus = 1e9 * (args.nvlink_gb_s if nodes == 1 else min(args.nvlink_gb_s, args.nics_per_node * args.nic_gb_s))
    call = (args.latency_us + (group - nodes) * args.nvlink_hop_us + (nodes - 1) * args.net_hop_us) * 1e-6
    local = min(gpus, args.gpus_per_node)  # a tree: up and down within the node, log2(nodes) across
    all_reduce = (args.latency_us + 2 * ((local - 1) * args.nvlink_hop_us +
                                         math.ceil(math.log2(world_nodes)) * args.net_hop_us)) * 1e-6
    # Across the groups: each bucket's part all-reduced on a ring of the groups' ranks of one shard
    # index, 2 (G - 1) steps, each a network hop when the groups span nodes; the node's GPUs run
    # their rings at once, sharing its NICs.
    groups = gpus // group
    across_hop = args.net_hop_us if world_nodes > 1 else args.nvlink_hop_us
    across_call = (args.latency_us + 2 * (groups - 1) * across_hop) * 1e-6
    across_bus = 1e9 * (args.nvlink_gb_s if world_nodes == 1 else
                        min(args.nvlink_gb_s, args.nics_per_node * args.nic_gb_s / min(gpus, args.gpus_per_node)))
    return call, bus, all_reduce, across_call, across_bus


def hybrid_calls(text, what):
    """dry_run's collective calls within a group (plus the loss-and-norm all-reduce over every rank)
    and across the groups, and the gradient GB sent across them."""
    reduces, gathers, all_reduces = (int(x) for x in parse(
        r"^collective calls per step within a group of \d+: (\d+) reduce-scatters .*?, (\d+) all-gathers .*?, "
        r"(\d+) all-reduces", text, f"{what}: collective calls within a group"))
    across_reduces = int(parse(r"^collective calls per step across the \d+ groups: (\d+) all-reduces", text,
                               f"{what}: collective calls across the groups")[0])
    across_gb = float(parse(r"across the groups: gradients ([0-9.]+) GB", text, f"{what}: traffic across the groups")[0])
    return reduces, gathers, all_reduces + 1, across_reduces, across_gb


def across_bytes_of(plan, group, groups, across_gb, what):
    """Each bucket's bytes sent across the groups: its part (the reduce-scatter's bytes over group - 1)
    on a ring of G, 2 (G - 1) / G of it; checked against dry_run's total."""
    across = [2 * (groups - 1) / groups * reduce_bytes / (group - 1) for _, _, reduce_bytes, _ in plan]
    if groups > 1 and abs(sum(across) / 1e9 - across_gb) > 0.002 * max(1.0, across_gb):
        sys.exit(f"error: {what}: dry_run sends {across_gb} GB across the groups, this script's plan {sum(across) / 1e9:.3f}")
    return across


def layer_gather_timeline(compute, gather, reduce, held, start, comm_free):
    """One pass (forward or backward) of stage 3 over the buckets of layers as coat/zero.cuh runs it:
    `compute[i]` the time of the i-th bucket the pass reads, `gather[i]` its all-gather (none for the
    first `held`, which the slots still hold from the pass before), `reduce[i]` its reduce-scatter
    (backward), issued once its compute is done. Both run one after the other on the collectives'
    stream, free from `comm_free`. Reading bucket i gathers it unless a slot holds it and prefetches
    i + 1 into the other slot; a gather waits for every kernel queued before (i - 1's compute, the
    last to read that slot), and i's compute waits for its gather. The pass starts at `start`.
    Returns (compute end, collectives' end, collective intervals, compute intervals)."""
    n = len(compute)
    gather_end, busy, work = [start] * n, [], []

    def enqueue(duration, after):
        nonlocal comm_free
        begin = max(comm_free, after)
        comm_free = begin + duration
        busy.append((begin, comm_free))
        return comm_free

    t = start
    for i in range(n):
        queued = t  # every kernel queued before this read: compute up to i - 1
        if i == 0 and held == 0:
            gather_end[0] = enqueue(gather[0], queued)
        if i + 1 < n and i + 1 >= held:
            gather_end[i + 1] = enqueue(gather[i + 1], queued)
        begin = max(t, gather_end[i])
        t = begin + compute[i]
        work.append((begin, t))
        if reduce[i]:
            enqueue(reduce[i], t)
    return t, comm_free, busy, work


def stage3(args, shard):
    """llama2-70b in coat at ZeRO stage 3, micro-batch 1 x 4096, on 8, 64 and 512 GPUs."""
    model, b, seq = "llama2-70b", 1, 4096
    config = os.path.join(ROOT, "configs", "models", model + ".conf")
    layout = ParamLayout(model_shape_from_config(config))
    # No GPU holds it alone: its compute runs at llama2-7b's measured rate of model FLOPs.
    ref = ParamLayout(model_shape_from_config(os.path.join(ROOT, "configs", "models", "llama2-7b.conf")))
    rb, rseq, rrate = MEASURED["llama2-7b"]
    ref_tokens = rb * rseq
    ref_model_s = ref_tokens / rrate - ADAMW_FP8_DRE_MS_PER_BILLION * 1e-3 * ref.total_params / 1e9
    flop_rate = 3 * sum(bucket_flops(ref, rseq)) * ref_tokens / ref_model_s
    tokens = b * seq
    flops = bucket_flops(layout, seq)  # backward's order: the lm_head, the layers from the last, the embedding
    forward = [tokens * f / flop_rate for f in flops]
    L = layout.shape.n_layers
    one_gpu_s = 3 * sum(forward) + ADAMW_FP8_DRE_MS_PER_BILLION * 1e-3 * layout.total_params / 1e9
    print()
    print(f"ZeRO stage 3: {model} in coat at micro-batch {b} x {seq}, one micro-batch per GPU and step:")
    print()
    print("| model | GPUs | collective calls per step (reduce-scatters / all-gathers / all-reduces) | sent per GPU, GB "
          "| communication ms | exposed ms | step ms | tokens/s per GPU | vs compute alone |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gpus in GPU_COUNTS[1:]:
        group = args.shard_group if 1 < args.shard_group < gpus else gpus  # the ranks that shard the model
        groups = gpus // group
        text = dry_run(config, shard, [f"--world_size={gpus}", "--zero_stage=3", "--precision=coat", f"--seq_len={seq}",
                                       f"--micro_batch_size={b}", f"--total_batch_tokens={tokens * gpus}"] +
                       ([f"--shard_group={group}"] if groups > 1 else []))
        across_reduces, across_gb = 0, 0.0
        if groups > 1:
            reduces, gathers, all_reduces, across_reduces, across_gb = hybrid_calls(text, f"{model} at {gpus} GPUs")
        else:
            reduces, gathers, all_reduces = (int(x) for x in parse(
                r"^collective calls per step: (\d+) reduce-scatters .*?, (\d+) all-gathers .*?, (\d+) all-reduces", text,
                "collective calls"))
        plan = bucket_plan(layout, group, True)
        if any(first != last for first, last, _, _ in plan[1:-1]):
            sys.exit(f"error: {model}: a bucket holds several layers; this model takes one layer per bucket")
        if (reduces, gathers) != (len(plan), 2 + 2 * L - 2) or (groups > 1 and across_reduces != len(plan)):
            sys.exit(f"error: {model} at {gpus} GPUs: dry_run counts {reduces} reduce-scatters, {gathers} all-gathers and "
                     f"{across_reduces} all-reduces across groups, this script's plan {len(plan)} and {2 * L}")
        call, bus, all_reduce, across_call, across_bus = links(args, gpus, group)
        across_bytes = across_bytes_of(plan, group, groups, across_gb, f"{model} at {gpus} GPUs")
        # a bucket's all-reduce across the groups follows its reduce-scatter on the same stream
        reduce_s = [call + r / bus + (across_call + a / across_bus if groups > 1 else 0.0)
                    for (_, _, r, _), a in zip(plan, across_bytes)]
        gather_s = [call + g / bus for _, _, _, g in plan]
        # After the step the embedding's and the tail's buckets are gathered first, then the forward
        # reads the layers (layer 0 first), the classifier; backward the classifier (its reduce-scatter
        # first), the layers from the last, and the embedding's reduce-scatter last.
        head = gather_s[-1] + gather_s[0]
        layers = range(1, L + 1)  # segments: the last layer first
        t, comm, busy_f, work_f = layer_gather_timeline([forward[s] for s in reversed(layers)],
                                                        [gather_s[s] for s in reversed(layers)], [0.0] * L, 0, gather_s[-1], head)
        t += 3 * forward[0]  # the classifier's forward and backward
        comm = max(comm, t) + reduce_s[0]
        end, comm, busy_b, work_b = layer_gather_timeline([2 * forward[s] for s in layers], [gather_s[s] for s in layers],
                                                          [reduce_s[s] for s in layers], 2, t, comm)
        passes_s = max(end, comm + reduce_s[-1])
        overlapped = overlap(busy_f, work_f) + overlap(busy_b, work_b)
        optimizer_s = ADAMW_FP8_DRE_MS_PER_BILLION * 1e-3 * layout.total_params / 1e9 / gpus
        compute_s = 3 * sum(forward) + optimizer_s
        exposed_s = passes_s - 3 * sum(forward) + all_reduces * all_reduce + args.sm_slowdown * overlapped
        step_s = compute_s + exposed_s
        backward_gathers = [gather_s[s] for s in layers][2:]
        comm_s = sum(reduce_s) + sum(gather_s) + sum(backward_gathers) + all_reduces * all_reduce
        comm_s += (sum(across_bytes) / across_bus + len(plan) * across_call) if groups > 1 else 0.0
        sent = sum(r + g for _, _, r, g in plan) + sum(g for _, _, _, g in plan[1:-1][2:]) + sum(across_bytes)
        across_text = f" + {across_reduces} across {groups} groups" if groups > 1 else ""
        print(f"| {model} | {gpus} | {reduces} / {gathers} / {all_reduces}{across_text} | {sent / 1e9:.1f} | {comm_s * 1e3:,.0f} | "
              f"{exposed_s * 1e3:,.0f} | {step_s * 1e3:,.0f} | {tokens / step_s:,.0f} | {100 * compute_s / step_s:.1f}% |")
    print()
    print(f"- No GPU holds {model} alone: its compute is counted at llama2-7b's measured rate of model FLOPs "
          f"({flop_rate / 1e12:,.0f} TFLOP/s: 6 x parameters + causal attention per token, at {rb} x {rseq}), "
          f"{one_gpu_s * 1e3:,.0f} ms a step with its optimizer on one GPU; the optimizer steps 1/W of the states.")
    print("- Each layer's E4M3 codes are all-gathered before its forward, the next layer's beside it, and again in "
          "reverse order before backward (the last two layers stay from the forward); backward's reduce-scatters share "
          "the collectives' stream with those gathers; a gather into a slot waits for the compute that read the slot.")
    print("- Links, latencies, the all-reduces and NCCL's cost to compute beside it as in the ZeRO-1 table above; "
          "'vs compute alone' is the step without communication over the step with it.")


if __name__ == "__main__":
    main()
