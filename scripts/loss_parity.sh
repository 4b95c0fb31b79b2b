#!/usr/bin/env bash
# Loss parity of the three precisions: llama-125m trained in bf16, fp8 and coat from the same seed
# (same initialisation, same data order) for 300 steps of 64 x 1024 tokens on the local corpus
# (configs/llama-125m-parity.conf), then a Markdown table of each run's final validation loss, its
# difference relative to bf16, its largest gradient norm from step 10 (the warmup's spikes, which
# decide where a run ends), the median tokens/s and the peak GPU memory, printed and written to
# OUT_DIR/parity.md. When the bf16 run (FP32 AdamW moments) left a checkpoint, the COAT paper's
# Table 1 on its optimizer states (scripts/optimizer_state_mse.py) is appended to parity.md.
# Usage: [SEED=N | SEEDS="N ..."] [RUNS="..."] [ARGS="..."] scripts/loss_parity.sh [DATA_DIR [OUT_DIR]]
#        [SEEDS="N ..."] [RUNS="..."] scripts/loss_parity.sh --table [OUT_DIR]   (the table again
#        from the runs' logs in OUT_DIR, nothing trained); SEED: another initialisation and data
#        order than the config's; SEEDS: every run at each of these seeds, into OUT_DIR/seed-N, then
#        the table over the seeds (scripts/parity_seeds.py: each run's gap to bf16 of the same seed,
#        the mean gap and its standard error) in OUT_DIR/parity.md: one seed's gap mixes the
#        precision's effect with what any perturbation does to a run, the mean separates them;
#        ARGS: trainer arguments added to every run, e.g. "--learning_rate=6e-4"; RUNS: the
#        runs, default "bf16 fp8 coat", or also the ablations coat-fp32-states (coat with FP32
#        optimizer states), coat-fp8-activations (coat with TE-like activations),
#        coat-stochastic (coat with stochastically rounded states), coat-fast-accum (coat with
#        fast accumulation in its FP8 GEMMs), fp8-gemms (FP8 GEMMs alone, activations and states
#        as in bf16), coat-activations (COAT's activation storage alone, BF16 GEMMs),
#        bf16-residual-1x16 and bf16-gate-up-1x16 (bf16 but for COAT's 1x16 copies of the residual
#        stream, or of gate|up: which of the two costs the loss); and the pair
#        bf16-accum2 (bf16 in two micro-batches of 32 a step) and bf16-2ranks (one micro-batch of
#        32 on each of two ranks sharing the GPU: mpirun, comm_backend = mpi): the same seed,
#        batches and math in another reduction order,
#        so bf16-2ranks against bf16-accum2 is what rounding alone does to a same-seed comparison)
#   DATA_DIR (default data/parity): train_*.bin and val_*.bin shards; *.bin.xz files without their
#            .bin are decompressed there first (xz -dk). When it holds no shards, it is made from
#            the corpus in CORPUS (default data/corpus/llama2, scripts/fetch_corpus.sh): 366
#            batches of 64 rows of 1025 tokens, the 23,424 rows spread evenly over the training
#            tokens and each batch's rows from all over them, and the whole validation shard;
#            `xz -6` of them is what a GPU machine without the corpus is sent.
#   OUT_DIR  (default out/parity): one folder per run (log.jsonl, train.log, the final
#            checkpoint) and parity.md; a run trains into NAME.partial, which replaces NAME only
#            when it ends well.
# Each run is bounded by RUN_TIMEOUT_S seconds (default 155) and the Table 1 script by MSE_TIMEOUT_S
# (default 45), so the whole script ends within 9 minutes; an H200 trains the 300 steps in about
# 30 s. Needs ./train_llama built (make train_llama), python3, timeout, stdbuf and xz. A run that
# fails shows its last lines and "failed" in the table; the exit status is 1 when any run failed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CONFIG=$ROOT/configs/llama-125m-parity.conf
read -r -a RUN_NAMES <<< "${RUNS:-bf16 fp8 coat}"
read -r -a EXTRA_ARGS <<< "${ARGS:-}"
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-155}
MSE_TIMEOUT_S=${MSE_TIMEOUT_S:-45}
KILL_AFTER_S=5

usage() { echo "usage: scripts/loss_parity.sh [DATA_DIR [OUT_DIR]] | --table [OUT_DIR]" >&2; exit 2; }
TABLE_ONLY=0
case ${1:-} in
-h | --help) usage ;;
--table) [ $# -le 2 ] || usage; TABLE_ONLY=1; set -- "" "${2:-}" ;;
esac
[ $# -le 2 ] || usage
# Anything else that looks like an option is refused before a folder is made under its name.
for argument in "$@"; do case $argument in -*) usage ;; esac; done
DATA=${1:-$ROOT/data/parity}
OUT=${2:-$ROOT/out/parity}
DATA=${DATA%/}
OUT=${OUT%/}
for dir in "$DATA" "$OUT"; do
    if [ -e "$dir" ] && [ ! -d "$dir" ]; then echo "error: $dir: not a directory" >&2; exit 2; fi
done

# Every seed of SEEDS in its own OUT_DIR/seed-N (this script again, one seed each), then the table
# over the seeds; --table only prints it again.
if [ -n "${SEEDS:-}" ]; then
    read -r -a SEED_LIST <<< "$SEEDS"
    for seed in "${SEED_LIST[@]}"; do
        [[ $seed =~ ^[0-9]+$ ]] || { echo "error: SEEDS: '$seed' is not a seed (a whole number)" >&2; exit 2; }
    done
    seeds_status=0 folders=()
    for seed in "${SEED_LIST[@]}"; do
        if [ "$TABLE_ONLY" -eq 0 ]; then
            echo "loss_parity: seed $seed into $OUT/seed-$seed"
            SEEDS="" SEED=$seed "$0" "$DATA" "$OUT/seed-$seed" || seeds_status=1
        fi
        [ -d "$OUT/seed-$seed" ] || { echo "error: $OUT/seed-$seed: no runs of seed $seed" >&2; exit 1; }
        folders+=("$seed=$OUT/seed-$seed")
    done
    table=$(python3 "$ROOT/scripts/parity_seeds.py" "${folders[@]}")
    echo "$table"
    if [ "$TABLE_ONLY" -eq 0 ]; then
        { echo "# Loss parity over seeds ${SEED_LIST[*]}: llama-125m, $(basename "$CONFIG")"; echo; echo "$table"; } > "$OUT/parity.md"
        echo "loss_parity: wrote $OUT/parity.md"
    fi
    exit "$seeds_status"
fi

if [ "$TABLE_ONLY" -eq 0 ] && [ ! -x "$ROOT/train_llama" ]; then
    echo "error: $ROOT/train_llama is not built (make train_llama)" >&2
    exit 1
fi

# Decompresses every shard that is present only as .bin.xz.
decompress_shards() {
    local packed
    for packed in "$DATA"/train_*.bin.xz "$DATA"/val_*.bin.xz; do
        [ -e "$packed" ] || continue
        if [ ! -e "${packed%.xz}" ]; then
            echo "loss_parity: xz -dk $packed"
            xz -dk -T0 "$packed"
        fi
    done
}

# The subset of the local corpus described at the top, in llm.c's shard format.
make_parity_data() {
    local corpus=${CORPUS:-$ROOT/data/corpus/llama2}
    if [ ! -e "$corpus/val_000000.bin" ]; then
        echo "error: $DATA holds no shards and $corpus no corpus to make them from (run scripts/fetch_corpus.sh)" >&2
        exit 1
    fi
    echo "loss_parity: making $DATA from $corpus"
    python3 - "$corpus" "$DATA" <<'PYTHON'
import glob, os, shutil, struct, sys
corpus, out = sys.argv[1], sys.argv[2]
BATCHES, ROWS, ROW = 366, 64, 1025  # batches of 64 sequences of 1024 tokens + 1
tokens = memoryview(b"".join(open(path, "rb").read()[1024:] for path in sorted(glob.glob(f"{corpus}/train_*.bin"))))
count, rows = len(tokens) // 2, BATCHES * ROWS
def row(i):  # the i-th of the rows spread evenly over the tokens
    start = 2 * (i * (count - ROW) // (rows - 1))
    return tokens[start:start + 2 * ROW]
# Batch k holds the rows k, k + 366, ...: 64 places all over the corpus, as a shuffled corpus
# would give, instead of 64 consecutive sequences of one package's text.
picked = b"".join(row(j * BATCHES + k) for k in range(BATCHES) for j in range(ROWS))
os.makedirs(out, exist_ok=True)
# Written as NAME.partial and renamed: a killed run never leaves a short shard that looks whole.
with open(f"{out}/train_000000.bin.partial", "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, rows * ROW, *([0] * 253)))
    f.write(picked)
shutil.copyfile(f"{corpus}/val_000000.bin", f"{out}/val_000000.bin.partial")
for name in ("train_000000.bin", "val_000000.bin"):
    os.replace(f"{out}/{name}.partial", f"{out}/{name}")
PYTHON
}

# The precision, extra flags and launcher of run NAME, in RUN_PRECISION, RUN_FLAGS and RUN_LAUNCH;
# status 1 for an unknown name.
run_settings() {
    RUN_FLAGS=() RUN_LAUNCH=()
    case $1 in
    bf16 | fp8 | coat) RUN_PRECISION=$1 ;;
    # Batches of 32 rows; 32 validation batches of them are the config's 16 of 64.
    bf16-accum2) RUN_PRECISION=bf16 RUN_FLAGS=(--micro_batch_size=32 --val_batches=32) ;;
    bf16-2ranks)  # bf16-accum2's batches, a rank each
        RUN_PRECISION=bf16 RUN_FLAGS=(--micro_batch_size=32 --val_batches=32 --comm_backend=mpi)
        RUN_LAUNCH=(mpirun --oversubscribe -np 2)
        [ "$(id -u)" -eq 0 ] && RUN_LAUNCH+=(--allow-run-as-root) ;;
    coat-fp32-states) RUN_PRECISION=coat RUN_FLAGS=(--optimizer_states=fp32) ;;
    coat-fp8-activations) RUN_PRECISION=coat RUN_FLAGS=(--activations=fp8) ;;
    coat-stochastic) RUN_PRECISION=coat RUN_FLAGS=(--optimizer_rounding=stochastic) ;;
    coat-fast-accum) RUN_PRECISION=coat RUN_FLAGS=(--fp8_fast_accum=1) ;;
    fp8-gemms) RUN_PRECISION=fp8 RUN_FLAGS=(--activations=bf16) ;;
    coat-activations) RUN_PRECISION=bf16 RUN_FLAGS=(--activations=coat) ;;
    bf16-residual-1x16) RUN_PRECISION=bf16 RUN_FLAGS=(--activations=coat_residual) ;;
    bf16-gate-up-1x16) RUN_PRECISION=bf16 RUN_FLAGS=(--activations=coat_gate_up) ;;
    *) return 1 ;;
    esac
}

# Trains run NAME into $OUT/NAME; returns train_llama's exit status (124: timed out).
run_precision() {
    local name=$1
    run_settings "$name"
    # Trained into NAME.partial, which replaces NAME only when the run ends well: a failed or
    # killed run keeps the previous run's results (and leaves its own in NAME.partial).
    local dir=$OUT/$name.partial
    local start=$SECONDS
    local status=0
    rm -rf "$dir"
    mkdir -p "$dir"
    echo "loss_parity: $name: training (at most ${RUN_TIMEOUT_S} s), output in $dir/train.log"
    # stdbuf: line-buffered output, so that a run killed by the timeout keeps its last step lines.
    timeout --kill-after="$KILL_AFTER_S" "$RUN_TIMEOUT_S" "${RUN_LAUNCH[@]}" stdbuf -oL "$ROOT/train_llama" "$CONFIG" \
        --precision="$RUN_PRECISION" "${RUN_FLAGS[@]}" "${EXTRA_ARGS[@]}" --out_dir="$dir" \
        --train_data="$DATA/train_*.bin" --val_data="$DATA/val_*.bin" ${SEED:+--seed="$SEED"} >"$dir/train.log" 2>&1 ||
        status=$?
    if [ "$status" -eq 0 ]; then
        rm -rf "${dir%.partial}"
        mv "$dir" "${dir%.partial}"
        echo "loss_parity: $name: done in $((SECONDS - start)) s"
    else
        local why=""
        if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then why=" (timed out after ${RUN_TIMEOUT_S} s)"; fi
        echo "loss_parity: $name: FAILED with exit status $status$why after $((SECONDS - start)) s; last lines of $dir/train.log:"
        tail -n 15 "$dir/train.log" | sed 's/^/    /'
    fi
    return "$status"
}

# Prints the Markdown table from each run's log.jsonl; arguments OUT_DIR and PRECISION:STATUS
# pairs. Exits 1 when a run failed or its log lacks a validation loss at its last step.
summarize() {
    python3 - "$@" <<'PYTHON'
import json, statistics, sys

out, runs = sys.argv[1], [arg.split(":") for arg in sys.argv[2:]]
def records(precision):
    try:
        lines = open(f"{out}/{precision}/log.jsonl", encoding="utf-8").readlines()
    except OSError:
        return []
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))  # a non-finite loss ("nan") is not JSON: left out
        except ValueError:
            pass
    return [r for r in parsed if isinstance(r, dict)]

rows, failed = {}, False
for precision, status in runs:
    log = records(precision)
    train = [r for r in log if "train_loss" in r]
    val = [r for r in log if "val_loss" in r]
    speeds = [r["tokens_per_s"] for r in train[5:]]
    memory = [r["gpu_mem_gib"] for r in train]
    loss = None
    if status != "0":
        note = "timed out" if status in ("124", "137") else f"exit {status}"
        loss_text = f"failed ({note})"
    elif not val or not train or val[-1]["step"] != train[-1]["step"]:
        loss_text = "failed (no final val_loss)"
    else:
        loss = val[-1]["val_loss"]
        loss_text = f"{loss:.4f}"
    failed |= loss is None
    # The warmup's gradient-norm spikes, which decide where a run ends (steps 1-9 are the
    # initialisation's large norms, alike in every run).
    norms = [(r["grad_norm"], r["step"]) for r in train if r["step"] >= 10 and isinstance(r.get("grad_norm"), (int, float))]
    spike = "{:.1f} (step {})".format(*max(norms)) if norms else "-"
    rows[precision] = (loss, loss_text, spike, f"{statistics.median(speeds):,.0f}" if speeds else "-",
                       f"{max(memory):.2f}" if memory else "-")

print("| run | final val loss | relative difference to bf16 (bf16-2ranks: to bf16-accum2) | "
      "largest gradient norm from step 10 | median tokens/s | peak GPU memory (GiB) |")
print("|---|---|---|---|---|---|")
for precision, (loss, loss_text, spike, speed, memory) in rows.items():
    reference = rows.get("bf16-accum2" if precision == "bf16-2ranks" else "bf16", (None,))[0]
    if precision == "bf16":
        relative = "reference"
    elif loss is None or reference is None:
        relative = "-"
    else:
        relative = f"{(loss - reference) / reference:+.2%}"
    print(f"| {precision} | {loss_text} | {relative} | {spike} | {speed} | {memory} |")
sys.exit(1 if failed else 0)
PYTHON
}

if [ "$TABLE_ONLY" -eq 1 ]; then  # the runs' table from the logs already in OUT_DIR
    results=()
    for name in "${RUN_NAMES[@]}"; do results+=("$name:0"); done
    summarize "$OUT" "${results[@]}"
    exit
fi
for name in "${RUN_NAMES[@]}"; do
    run_settings "$name" || { echo "error: RUNS: unknown run '$name' (bf16, fp8, coat, coat-fp32-states, coat-fp8-activations, coat-stochastic, coat-fast-accum, fp8-gemms, coat-activations, bf16-residual-1x16, bf16-gate-up-1x16, bf16-accum2, bf16-2ranks)" >&2; exit 2; }
    if [ ${#RUN_LAUNCH[@]} -gt 0 ] && ! command -v mpirun > /dev/null; then
        echo "error: RUNS: $name needs mpirun (apt-get install openmpi-bin)" >&2
        exit 2
    fi
done
mkdir -p "$OUT"
decompress_shards
compgen -G "$DATA/train_*.bin" > /dev/null || make_parity_data
results=()
for name in "${RUN_NAMES[@]}"; do
    status=0
    run_precision "$name" || status=$?
    results+=("$name:$status")
done

table_status=0
table=$(summarize "$OUT" "${results[@]}") || table_status=$?
{
    echo "# Loss parity: llama-125m, 300 steps of 64 x 1024 tokens ($(basename "$CONFIG"))"
    echo
    echo "Data: $DATA. Final val loss: the mean over the $(sed -n 's/^val_batches *= *//p' "$CONFIG") fixed validation"
    echo "batches after the last step; tokens/s: the median over the steps after the first 5."
    [ ${#EXTRA_ARGS[@]} -eq 0 ] || echo "Every run also takes: ${EXTRA_ARGS[*]}"
    echo
    echo "$table"
} >"$OUT/parity.md"
echo
echo "$table"

checkpoint=$(find "$OUT/bf16" -maxdepth 1 -name 'ckpt_*.bin' ! -name 'ckpt_*.rank*.bin' 2>/dev/null | sort | tail -n 1) || checkpoint=""
if [ ! -f "$ROOT/scripts/optimizer_state_mse.py" ]; then
    echo "loss_parity: scripts/optimizer_state_mse.py not found: optimizer-state table skipped"
elif [ -z "$checkpoint" ]; then
    echo "loss_parity: the bf16 run left no checkpoint: optimizer-state table skipped"
else
    echo
    echo "loss_parity: optimizer states of $checkpoint (at most ${MSE_TIMEOUT_S} s)"
    mse_status=0
    mse=$(timeout --kill-after="$KILL_AFTER_S" "$MSE_TIMEOUT_S" \
          python3 "$ROOT/scripts/optimizer_state_mse.py" "$checkpoint" 2>&1) || mse_status=$?
    echo "$mse"
    {
        echo
        echo "## Optimizer-state round trips (COAT Table 1) on $(basename "$checkpoint") of the bf16 run"
        echo
        echo "$mse"
        if [ "$mse_status" -ne 0 ]; then echo; echo "(optimizer_state_mse.py failed with exit status $mse_status)"; fi
    } >>"$OUT/parity.md"
    if [ "$mse_status" -ne 0 ]; then echo "loss_parity: optimizer_state_mse.py failed with exit status $mse_status"; fi
fi
echo "loss_parity: wrote $OUT/parity.md"
exit "$table_status"
