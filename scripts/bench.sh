#!/usr/bin/env bash
# Benchmarks beside PyTorch, measured in the same call on the same GPU:
#  1. training throughput of train_llama in bf16, fp8 and coat against the PyTorch reference
#     (torch.compile, BF16 autocast, fused AdamW) and its FP8 recipe (the block's linear layers on
#     torch._scaled_mm, E4M3 forward, E5M2 gradients) on random tokens: tokens/s, MFU and peak memory
#     for llama-125m and llama-1b at the micro-batches of coat/README.md's model shapes (64 x 1024,
#     16 x 2048); llama2-7b and llama3-8b at the largest micro-batch each precision fits; then
#     llama-1b 4x2048's peak memory beside PyTorch (eager) with SDPA and with attention written out
#     (what storing the probabilities costs);
#  2. our flash attention (build/test_attention's timings) against PyTorch SDPA's flash and cuDNN
#     backends (scripts/bench_attention.py) at the shapes of coat/README.md's attention peers.
#  3. with --profile, where the time of a llama-1b step goes: train_llama's per-op GPU times
#     (profile = 1) and PyTorch's kernels by total time (torch.profiler), one after the other.
# Usage: scripts/bench.sh [--profile] [--training-only | --attention-only] [STEPS]   (writes
#        build/bench/results.md, and profile.txt with --profile; into $OUT too when set).
#        --training-only stops after 1, --attention-only runs 2 alone.
set -euo pipefail
cd "$(dirname "$0")/.."
profile=0 training_only=0 attention_only=0
usage() { echo "usage: scripts/bench.sh [--profile] [--training-only | --attention-only] [STEPS]   (STEPS: at least 6)" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
    --profile) profile=1; shift ;;
    --training-only) training_only=1; shift ;;
    --attention-only) attention_only=1; shift ;;
    -*) usage ;;
    *) break ;;
    esac
done
[ $# -le 1 ] || usage
steps=${1:-30}
[[ $steps =~ ^[0-9]+$ ]] && [ "$steps" -ge 6 ] || usage  # the medians skip the first 5 steps
dir=build/bench
mkdir -p "$dir"
python3 scripts/random_shard.py "$dir/train_000000.bin"  # 8M random tokens (throughput only)

# Median tokens/s and MFU over the steps after the first five, and what it allocates (the memory
# plan's total, and the attention's dS buffer where it took it).
ours() {  # ours NAME CONFIG B T [PRECISION]
    local precision=${5:-bf16} out="$dir/$1-${5:-bf16}"
    rm -rf "$out"
    ./train_llama "configs/models/$2.conf" --train_data="$dir/train_*.bin" --micro_batch_size="$3" --seq_len="$4" \
        --precision="$precision" --max_steps="$steps" --warmup_steps=1 --val_every=0 --checkpoint_final=0 \
        --checkpoints_keep=1 --out_dir="$out" > "$out.log" 2>&1 ||
        { tail -5 "$out.log" >&2; echo "{\"impl\": \"train_llama $precision\", \"error\": \"failed\"}"; return; }
    python3 - "$out/log.jsonl" "$out.log" "$precision" <<'PY'
import json, re, statistics, sys
records = [json.loads(line) for line in open(sys.argv[1]) if '"train_loss"' in line][5:]
plan = re.search(r"^GPU memory allocated: ([0-9.]+) GiB", open(sys.argv[2]).read(), re.M)
print(json.dumps({"impl": "train_llama " + sys.argv[3], "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
                  "mfu": statistics.median(r["mfu"] for r in records), "peak_gib": float(plan.group(1)),
                  "used_gib": max(r["gpu_mem_gib"] for r in records)}))
PY
}

# MODEL (seq 2048) at the largest micro-batch that each precision fits in the free memory (the
# trainer keeps 2% of it), 10 steps each, against bf16 at its own largest. nvidia-smi's free memory
# includes what the trainer's CUDA context then takes: when the trainer refuses the dry run's
# batch, it names the largest that fits, which runs instead.
largest_fit_table() {  # largest_fit_table MODEL
    local model=$1 free_gib b r fit precision rows=()
    echo "| $model | micro-batch | implementation | tokens/s | MFU | peak GiB | GiB in use | tokens/s vs bf16 |"
    echo "|---|---|---|---|---|---|---|---|"
    free_gib=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1 | awk '{printf "%.2f", $1 / 1024 * 0.98}')
    for precision in bf16 fp8 coat; do
        b=$(./train_llama "configs/models/$model.conf" --dry_run=1 --train_data="$dir/train_*.bin" --precision=$precision \
            --micro_batch_size=1 --seq_len=2048 --gpu_memory_gib="$free_gib" 2>/dev/null |
            sed -n 's/.*largest micro-batch that fits: \([0-9]*\)[;)].*/\1/p')
        r=$(steps=10 ours "$model" "$model" "${b:-1}" 2048 $precision)
        fit=$(sed -n 's/.*the largest that fits is \([0-9]*\).*/\1/p' "$dir/$model-$precision.log" | head -1)
        if [ -n "$fit" ] && [ "$fit" -gt 0 ] && [ "$fit" -lt "${b:-1}" ]; then
            b=$fit
            r=$(steps=10 ours "$model" "$model" "$b" 2048 $precision)
        fi
        rows+=("${b:-0}" "$r")
    done
    python3 - "$model" "${rows[@]}" <<'PY'
import json, sys
model = sys.argv[1]
runs = [(sys.argv[i], json.loads(sys.argv[i + 1])) for i in range(2, len(sys.argv), 2)]
base = runs[0][1].get("tokens_per_s")
for batch, r in runs:
    if "error" in r:
        print(f"| {model} | {batch}x2048 | {r.get('impl')} | {r['error']} | | | | |")
        continue
    ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else ""
    print(f"| {model} | {batch}x2048 | {r['impl']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
          f"{r['peak_gib']:.1f} | {r['used_gib']:.1f} | {ratio} |")
PY
}
pytorch() {  # pytorch CONFIG B T [--fp8]
    python3 scripts/train_llama.py --bench --compile ${4:-} --config "configs/models/$1.conf" --batch "$2" --seq "$3" \
        --steps "$steps" 2>"$dir/pytorch-$1${4:-}.err" | tail -1 || echo "{\"impl\": \"pytorch-compile${4:+-fp8}\", \"error\": \"failed\"}"
}

{
  if [ "$attention_only" = 0 ]; then
    echo "| model | micro-batch | implementation | tokens/s | MFU | peak GiB | GiB in use | tokens/s vs PyTorch | vs PyTorch FP8 |"
    echo "|---|---|---|---|---|---|---|---|---|"
    for spec in "llama-125m 64 1024" "llama-1b 16 2048"; do
        set -- $spec
        a=$(ours "$1" "$1" "$2" "$3" bf16); a8=$(ours "$1" "$1" "$2" "$3" fp8); ac=$(ours "$1" "$1" "$2" "$3" coat)
        b=$(pytorch "$1" "$2" "$3"); b8=$(pytorch "$1" "$2" "$3" --fp8)
        python3 - "$1" "$2x$3" "$b" "$b8" "$a" "$a8" "$ac" <<'PY'
import json, sys
name, batch, ref, ref8 = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
def ratio(r, base):
    return f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if "error" not in r and "error" not in base else ""
def row(r):
    if "error" in r:
        return f"| {name} | {batch} | {r.get('impl')} | {r['error']} | | | | | |"
    used = f"{r['used_gib']:.1f}" if "used_gib" in r else ""
    return (f"| {name} | {batch} | {r['impl']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
            f"{r['peak_gib']:.1f} | {used} | {ratio(r, ref)} | {ratio(r, ref8)} |")
for arg in sys.argv[5:]:
    print(row(json.loads(arg)))
print(row(ref))
print(row(ref8))
PY
    done
    echo
    echo "train_llama peak = its memory plan (all it allocates); in use = the GPU's used memory during the run (cudaMemGetInfo: the plan, the CUDA context and the allocator's rounding); PyTorch peak = torch.cuda.max_memory_allocated()."
    echo
    largest_fit_table llama2-7b
    echo
    largest_fit_table llama3-8b
    echo
    [ "$training_only" = 1 ] && exit 0
    # What flash attention saves: the same model in PyTorch (eager) with SDPA and with attention written
    # out, which stores the T x T probabilities of every layer for the backward.
    echo "| llama-1b 4x2048 | tokens/s | peak GiB |"
    echo "|---|---|---|"
    python3 - "$(ours llama-1b-4x2048 llama-1b 4 2048)" \
        "$(python3 scripts/train_llama.py --bench --config configs/models/llama-1b.conf --batch 4 --seq 2048 \
            --steps "$steps" 2>/dev/null | tail -1)" \
        "$(python3 scripts/train_llama.py --bench --exact-attention --config configs/models/llama-1b.conf \
            --batch 4 --seq 2048 --steps "$steps" 2>/dev/null | tail -1)" <<'PY'
import json, sys
for arg in sys.argv[1:]:
    r = json.loads(arg) if arg.startswith("{") else {"error": "failed"}
    if "error" in r:
        print(f"| {r.get('impl', 'pytorch')} | {r['error']} | |")
    else:
        print(f"| {r['impl']} | {r['tokens_per_s']:,.0f} | {r['peak_gib']:.1f} |")
PY
    echo
  fi
    make -s build/test_attention > /dev/null
    { build/test_attention || true; } | grep '^attention B=' > "$dir/attention-ours.txt"  # timings, whatever its checks say
    python3 scripts/bench_attention.py > "$dir/attention-sdpa.txt" 2>&1 || true
    python3 - "$dir/attention-ours.txt" "$dir/attention-sdpa.txt" <<'PY'
import re, sys
pattern = r"B=(\d+) NH=(\d+) NKV=(\d+) T=(\d+) hd=(\d+): forward [0-9.]+ ms (\d+) TFLOP/s, forward\+backward [0-9.]+ ms (\d+)"
text = open(sys.argv[1]).read()
ours = {m.groups()[:5]: m.groups()[5:] for m in re.finditer(pattern, text)}
# head_dim 128 with the dS buffer the program takes where it fits (coat/attention.cuh)
stored = r"B=(\d+) NH=(\d+) NKV=(\d+) T=(\d+) hd=(\d+): forward\+backward with the stored dS [0-9.]+ ms (\d+)"
ours_stored = {m.groups()[:5]: m.group(6) for m in re.finditer(stored, text)}
sdpa = {}
for line in open(sys.argv[2]):
    m = re.match(r"sdpa (\w+) " + pattern, line)
    if m:
        sdpa[(m.group(1),) + m.groups()[1:6]] = m.groups()[6:]
print("| B, heads, kv heads, T, head_dim | ours fwd / fwd+bwd TFLOP/s | ours fwd+bwd, stored dS | SDPA flash | SDPA cuDNN |")
print("|---|---|---|---|---|")
for shape, (fwd, both) in ours.items():
    cells = [" / ".join(sdpa.get((backend,) + shape, ("-", "-"))) for backend in ("flash", "cudnn")]
    print(f"| {', '.join(shape)} | {fwd} / {both} | {ours_stored.get(shape, '-')} | {cells[0]} | {cells[1]} |")
PY
} | tee "$dir/results.md.partial"
mv "$dir/results.md.partial" "$dir/results.md"  # a bench that fails keeps the last complete results
if [ -n "${OUT:-}" ]; then cp "$dir/results.md" "$OUT/bench.md"; fi

if [ "$profile" = 1 ]; then
    {
        echo "== train_llama llama-1b 16x2048 =="
        rm -rf "$dir/profile-run"
        ./train_llama configs/models/llama-1b.conf --train_data="$dir/train_*.bin" --micro_batch_size=16 --seq_len=2048 \
            --max_steps=8 --warmup_steps=1 --val_every=0 --checkpoint_final=0 --out_dir="$dir/profile-run" --profile=1 2>&1 |
            sed -n '/^profile:/,$p'
        echo "== PyTorch (torch.compile) llama-1b 16x2048 =="
        python3 scripts/train_llama.py --bench --compile --config configs/models/llama-1b.conf --batch 16 --seq 2048 \
            --steps 3 --profile 2>&1 | sed -n '/^profile of/,$p'
    } > "$dir/profile.txt.partial" 2>&1
    mv "$dir/profile.txt.partial" "$dir/profile.txt"
    cat "$dir/profile.txt"
    if [ -n "${OUT:-}" ]; then cp "$dir/profile.txt" "$OUT/profile.txt"; fi
fi
