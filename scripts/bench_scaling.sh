#!/usr/bin/env bash
# Data-parallel scaling on the GPUs of one machine: MODEL (default llama-1b) in PRECISION (default
# coat) at 16 x 2048 tokens per GPU and step, one rank per GPU over NCCL (mpirun), ZeRO stages 1
# to 3, on 1, 2, 4, ... GPUs up to all of them: tokens/s per GPU, the efficiency against one GPU,
# MFU, the memory in use on rank 0's GPU and the plan of each rank (and whether every rank
# allocated it byte for byte). The global batch grows with the GPUs (one micro-batch per GPU and
# step), the regime where communication weighs most. First, on 2, 4, ... GPUs, build/bench_collectives
# times the reduce-scatter and the all-gather from 64 KiB to 1 GiB (build/bench/collectives.jsonl),
# and scripts/predict_scaling.py --calibrate fits its latencies and bus bandwidth to them and
# predicts the runs on paper with that fit. There is no PyTorch run beside it:
# scripts/train_llama.py trains on one GPU.
# Usage: scripts/bench_scaling.sh [--model NAME] [--precision bf16|fp8|coat] [--steps N]
#        (writes build/bench/scaling.md, and $OUT/scaling.md when OUT is set)
set -euo pipefail
cd "$(dirname "$0")/.."
model=llama-1b precision=coat steps=20
usage() { echo "usage: scripts/bench_scaling.sh [--model NAME] [--precision bf16|fp8|coat] [--steps N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
    --model) [ $# -ge 2 ] || usage; model=$2; shift 2 ;;
    --precision) [ $# -ge 2 ] || usage; precision=$2; shift 2 ;;
    --steps) [ $# -ge 2 ] || usage; steps=$2; shift 2 ;;
    *) usage ;;
    esac
done
config=configs/models/$model.conf
[ -f "$config" ] || { echo "error: $config: no such model config" >&2; exit 2; }
case $precision in bf16 | fp8 | coat) ;; *) usage ;; esac
[[ $steps =~ ^[0-9]+$ ]] && [ "$steps" -ge 8 ] || { echo "error: --steps $steps: at least 8 (the median skips the first 5)" >&2; exit 2; }
[ -x ./train_llama ] || { echo "error: ./train_llama is not built (make)" >&2; exit 1; }
[ -x build/bench_collectives ] || { echo "error: build/bench_collectives is not built (make build/bench_collectives)" >&2; exit 1; }
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
[ "$gpus" -ge 1 ] || { echo "error: no GPU found (nvidia-smi -L)" >&2; exit 1; }
mpi=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
dir=build/bench
mkdir -p "$dir"
python3 scripts/random_shard.py "$dir/train_000000.bin"

run() {  # run RANKS STAGE: one JSON line (or an error line) about the run
    local ranks=$1 stage=$2 out="$dir/scaling-$model-$precision-n$1-s$2" launch=()
    [ "$ranks" -gt 1 ] && launch=("${mpi[@]}" -np "$ranks")
    rm -rf "$out"
    timeout 600 "${launch[@]}" ./train_llama "$config" --train_data="$dir/train_*.bin" --precision="$precision" \
        --micro_batch_size=16 --seq_len=2048 --total_batch_tokens=$((16 * 2048 * ranks)) --zero_stage="$stage" \
        --max_steps="$steps" --warmup_steps=1 --val_every=0 --checkpoint_final=0 --out_dir="$out" > "$out.log" 2>&1 ||
        { tail -3 "$out.log" | sed 's/^/    /' >&2; echo "{\"error\": \"failed (see $out.log)\"}"; return; }
    python3 - "$out/log.jsonl" "$out.log" "$ranks" <<'PY'
import json, re, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1]) if '"train_loss"' in line][5:]
text = open(sys.argv[2]).read()
plan = re.search(r"^  total\s+([0-9.]+) GiB", text, re.M)
allocated = re.search(r"^GPU memory allocated: .*", text, re.M)
print(json.dumps({"tokens_per_s": statistics.median(r["tokens_per_s"] for r in records) / int(sys.argv[3]),
                  "mfu": statistics.median(r["mfu"] for r in records), "used_gib": max(r["gpu_mem_gib"] for r in records),
                  "plan_gib": float(plan.group(1)), "exact": bool(allocated and "byte for byte" in allocated.group(0))}))
PY
}

{
    if [ "$gpus" -ge 2 ]; then
        : > "$dir/collectives.jsonl"
        for ((ranks = 2; ranks <= gpus; ranks *= 2)); do
            timeout 300 "${mpi[@]}" -np "$ranks" build/bench_collectives nccl >> "$dir/collectives.jsonl" ||
                echo "bench_collectives on $ranks GPUs failed"
        done
        echo "| GPUs | collective | 64 KiB bucket, ms | 1 GiB bucket, ms | bus GB/s at 1 GiB |"
        echo "|---|---|---|---|---|"
        python3 - "$dir/collectives.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
for w in sorted({r["world"] for r in rows}):
    for op in ("reduce_scatter", "all_gather"):
        mine = sorted((r for r in rows if r["world"] == w and r["op"] == op), key=lambda r: r["bucket_bytes"])
        if mine:
            print(f"| {w} | {op.replace('_', '-')} | {mine[0]['ms']:.3f} | {mine[-1]['ms']:.3f} | {mine[-1]['bus_gb_s']:.0f} |")
PY
        echo
        python3 scripts/predict_scaling.py --calibrate "$dir/collectives.jsonl" || echo "the calibration failed"
        echo
    fi
    echo "$model, $precision, 16 x 2048 tokens per GPU and step, one rank per GPU (NCCL), $gpus GPU(s) here:"
    echo
    echo "| GPUs | ZeRO stage | tokens/s per GPU | vs 1 GPU | MFU | GiB in use (rank 0's GPU) | plan per rank, GiB | every rank allocated its plan |"
    echo "|---|---|---|---|---|---|---|---|"
    one=""
    for ((ranks = 1; ranks <= gpus; ranks *= 2)); do
        for stage in 1 2 3; do
            [ "$ranks" -eq 1 ] && [ "$stage" -gt 1 ] && continue  # one rank runs unsharded either way
            r=$(run "$ranks" "$stage")
            [ "$ranks" -eq 1 ] && one=$r
            python3 - "$ranks" "$stage" "$r" "$one" <<'PY'
import json, sys
ranks, stage, r, one = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4] or "{}")
if "error" in r:
    print(f"| {ranks} | {stage} | {r['error']} | | | | | |")
else:
    ratio = f"{r['tokens_per_s'] / one['tokens_per_s']:.2f}x" if "tokens_per_s" in one else ""
    print(f"| {ranks} | {stage if ranks != '1' else '-'} | {r['tokens_per_s']:,.0f} | {ratio} | {100 * r['mfu']:.1f}% | "
          f"{r['used_gib']:.1f} | {r['plan_gib']:.2f} | {'yes' if r['exact'] else 'no'} |")
PY
        done
    done
    [ "$gpus" -eq 1 ] && echo && echo "One GPU here: nothing to scale; the row is the one-GPU reference."
} | tee "$dir/scaling.md.partial"
mv "$dir/scaling.md.partial" "$dir/scaling.md"  # a bench that fails keeps the last complete table
if [ -n "${OUT:-}" ]; then cp "$dir/scaling.md" "$OUT/scaling.md"; fi
