#!/usr/bin/env bash
# Pretraining curves of bf16, fp8 and coat on the whole local corpus, each batch's rows drawn from
# all over it (shuffle = rows): llama-125m (configs/llama-125m-curves.conf: 300M tokens, 0.5M
# tokens per step) from three seeds per precision, and a llama-1b pair, bf16 and coat
# (configs/llama-1b-curves.conf: 131M tokens, one pass over the corpus, 0.5M tokens per step).
# A seed sets the initial weights and the data order, the same for every precision at that seed.
# One stage per command, so that a GPU machine without the corpus, whose jobs last minutes, can be
# fed and run job by job:
#   pack         where the corpus is (scripts/fetch_corpus.sh): its shards cut into pieces of at most
#                40M tokens, xz-compressed, in transport parts of at most 44 MiB each
#                (data/curves-pack/part_N/, each with the MANIFEST of all pieces)
#   unpack       decompresses the pieces present under data/curves-pack into data/curves/, checking
#                each against the MANIFEST (parts may arrive one per job: it says which are missing)
#   run NAME     trains NAME into out/curves/NAME, resuming from its last checkpoint when one is
#                there; at most RUN_TIMEOUT_S seconds (default 560) per call: exit 0 when the run is
#                complete, 3 when the time ran out first (call again to continue). NAME: bf16, fp8,
#                coat (seed 1337), the same with -seed2 or -seed3; 1b-bf16 and 1b-coat; the ablations
#                at seed 1337: coat-fp32-states (FP32 optimizer states), coat-stochastic (FP8 states
#                rounded stochastically), fp8-gemms (FP8 GEMMs alone), coat-activations (COAT's
#                activation storage alone, BF16 GEMMs), bf16-residual-1x16 and bf16-gate-up-1x16
#                (bf16 but for COAT's 1x16 copies of the residual stream, or of gate|up),
#                coat-fast-accum (fast accumulation in the FP8 GEMMs), bf16-2ranks (bf16 on two
#                ranks sharing the GPU: the same batches in another reduction order, what rounding
#                alone does). A complete run with FP8 somewhere also validates its final weights
#                with BF16 compute (out/curves/NAME/bf16-eval/). Each call's seconds are added to
#                out/curves/NAME/gpu_seconds.
#   status       each run's progress: complete, or the step it resumes from and the GPU time it
#                has taken and will still take at its pace so far, or not started (with the mean
#                GPU time of the complete runs of its length); then the GPU time still to go
#   report       configs/results/curves.md (per seed and precision the final validation loss and
#                its gap to bf16; each precision's mean gap and its standard error; bf16's seed
#                spread; every run's speed, memory and GPU time), configs/results/curves-125m.png and
#                curves-1b.png (scripts/curves_report.py), the logs in configs/results/curves/
#   all          pack (when the corpus is here), unpack, every run, report
# Needs: ./train_llama (make) for run; python3 for pack, unpack and report, matplotlib for the figures.
set -euo pipefail
cd "$(dirname "$0")/.."

# The folders and sizes can be moved (the tests do): CORPUS, PACK, DATA, OUT, RESULTS, PIECE_TOKENS, PART_BYTES.
CONFIG=configs/llama-125m-curves.conf
CONFIG_1B=configs/llama-1b-curves.conf
CORPUS=${CORPUS:-data/corpus/llama2}
PACK=${PACK:-data/curves-pack}
DATA=${DATA:-data/curves}
OUT=${OUT:-out/curves}
RESULTS=${RESULTS:-configs/results}
PIECE_TOKENS=${PIECE_TOKENS:-40000000}
PART_BYTES=${PART_BYTES:-$((44 * 1024 * 1024))}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-560}
RUNS=(bf16 fp8 coat bf16-seed2 fp8-seed2 coat-seed2 bf16-seed3 fp8-seed3 coat-seed3 1b-bf16 1b-coat
      bf16-2ranks coat-fp32-states coat-stochastic fp8-gemms coat-activations bf16-residual-1x16 bf16-gate-up-1x16
      coat-fast-accum)

# The config of run NAME: the 1b pair's, or llama-125m's.
config_of() { [[ $1 == 1b-* ]] && echo "$CONFIG_1B" || echo "$CONFIG"; }
max_steps_of() { sed -n 's/^max_steps *= *\([0-9]*\).*/\1/p' "$(config_of "$1")"; }

usage() {
    echo "usage: scripts/reproduce_curves.sh pack|unpack|run NAME|status|report|all   (NAME: ${RUNS[*]})" >&2
    exit 2
}

pack() {
    ls "$CORPUS"/train_*.bin "$CORPUS"/val_*.bin > /dev/null 2>&1 ||
        { echo "error: $CORPUS holds no train_*.bin and val_*.bin shards (scripts/fetch_corpus.sh builds them)" >&2; exit 1; }
    # Built as PACK.partial and renamed over the old pack at the end: a failed or killed pack keeps
    # the previous one, and a half-built one never passes for a pack.
    local build=$PACK.partial
    rm -rf "$build"
    mkdir -p "$build/pieces"
    python3 - "$CORPUS" "$build/pieces" "$PIECE_TOKENS" <<'PY'
import glob, hashlib, os, struct, sys
# Cuts every shard into pieces of at most 40M tokens, in order: the same tokens in the same
# order, in more files (the loader reads whole batches inside one shard, so a cut drops at most
# the last partial batch of a piece).
corpus, out, PIECE = sys.argv[1], sys.argv[2], int(sys.argv[3])
manifest = []
for split in ("train", "val"):
    index = 0
    for path in sorted(glob.glob(os.path.join(corpus, f"{split}_*.bin"))):
        with open(path, "rb") as f:
            header = struct.unpack("<256i", f.read(1024))
            if header[0] != 20240520 or header[1] not in (1, 2):
                sys.exit(f"error: {path}: not a token shard (magic {header[0]}, version {header[1]})")
            width = 2 if header[1] == 1 else 4
            left = header[2]
            while left > 0:
                count = min(PIECE, left)
                data = f.read(count * width)
                if len(data) != count * width:
                    sys.exit(f"error: {path}: truncated")
                name = f"{split}_{index:06d}.bin"
                body = struct.pack("<256i", header[0], header[1], count, *([0] * 253)) + data
                with open(os.path.join(out, name), "wb") as piece:
                    piece.write(body)
                manifest.append(f"{name} {count} {hashlib.sha256(body).hexdigest()}")
                index += 1
                left -= count
with open(os.path.join(out, "MANIFEST"), "w") as f:
    f.write("\n".join(manifest) + "\n")
print(f"pack: {len(manifest)} pieces")
PY
    xz -6 -T0 "$build"/pieces/*.bin
    # Parts of at most 60 MiB, each piece whole, in order; every part carries the MANIFEST.
    local part=1 size=0 limit=$PART_BYTES
    mkdir -p "$build/part_$part"
    for piece in "$build"/pieces/*.bin.xz; do
        local bytes
        bytes=$(stat -c %s "$piece")
        if [ $((size + bytes)) -gt "$limit" ] && [ "$size" -gt 0 ]; then
            part=$((part + 1)) size=0
            mkdir -p "$build/part_$part"
        fi
        mv "$piece" "$build/part_$part/"
        size=$((size + bytes))
    done
    for dir in "$build"/part_*; do cp "$build/pieces/MANIFEST" "$dir/"; done
    rm -rf "$build/pieces"
    rm -rf "$PACK"
    mv "$build" "$PACK"
    du -sh "$PACK"/part_* | sed 's/^/pack: /'
}

unpack() {
    local manifest
    manifest=$(ls "$PACK"/part_*/MANIFEST 2>/dev/null | head -1)
    [ -n "$manifest" ] || { echo "error: $PACK holds no part_*/MANIFEST (scripts/reproduce_curves.sh pack makes them)" >&2; exit 1; }
    mkdir -p "$DATA"
    for piece in "$PACK"/part_*/*.bin.xz; do
        [ -e "$piece" ] || continue
        local name
        name=$(basename "$piece" .xz)
        if [ ! -e "$DATA/$name" ]; then
            xz -dc "$piece" > "$DATA/$name.partial"
            mv "$DATA/$name.partial" "$DATA/$name"
        fi
    done
    python3 - "$manifest" "$DATA" <<'PY'
import hashlib, os, sys
manifest, data = sys.argv[1], sys.argv[2]
missing, bad = [], []
for line in open(manifest):
    name, count, digest = line.split()
    path = os.path.join(data, name)
    if not os.path.exists(path):
        missing.append(name)
    elif hashlib.sha256(open(path, "rb").read()).hexdigest() != digest:
        bad.append(name)
        os.remove(path)
if bad:
    sys.exit(f"error: {data}: {', '.join(bad)} differ from the MANIFEST (removed): unpack their part again")
if missing:
    sys.exit(f"unpack: {len(missing)} piece(s) not here yet: {', '.join(missing)} (send their part_N, then unpack)")
print(f"unpack: every piece of the MANIFEST is in {data}")
PY
}

run() {
    local name=$1 precision seed states=() launch=()
    case $name in
    bf16 | fp8 | coat) precision=$name seed=1337 ;;
    bf16-seed[23] | fp8-seed[23] | coat-seed[23]) precision=${name%-seed?} seed=${name##*-seed} ;;
    1b-bf16 | 1b-coat) precision=${name#1b-} seed=1337 ;;
    bf16-2ranks)
        precision=bf16 seed=1337 states=(--comm_backend=mpi) launch=(mpirun --oversubscribe -np 2)
        [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
        command -v mpirun > /dev/null || { echo "error: $name needs mpirun (apt-get install openmpi-bin)" >&2; return 1; } ;;
    coat-fp32-states) precision=coat seed=1337 states=(--optimizer_states=fp32) ;;
    coat-stochastic) precision=coat seed=1337 states=(--optimizer_rounding=stochastic) ;;
    fp8-gemms) precision=fp8 seed=1337 states=(--activations=bf16) ;;
    coat-activations) precision=bf16 seed=1337 states=(--activations=coat) ;;
    bf16-residual-1x16) precision=bf16 seed=1337 states=(--activations=coat_residual) ;;
    bf16-gate-up-1x16) precision=bf16 seed=1337 states=(--activations=coat_gate_up) ;;
    coat-fast-accum) precision=coat seed=1337 states=(--fp8_fast_accum=1) ;;
    *) usage ;;
    esac
    [ -x ./train_llama ] || { echo "error: ./train_llama is not built (make)" >&2; return 1; }
    local config max_steps dir=$OUT/$name start=$SECONDS status=0 continue=(--overwrite=1)
    config=$(config_of "$name")
    max_steps=$(max_steps_of "$name")
    if ls "$dir"/ckpt_*.bin > /dev/null 2>&1; then continue=(--resume=1); fi
    mkdir -p "$dir"
    echo "run $name: precision $precision, seed $seed, ${continue[0]#--}, at most $RUN_TIMEOUT_S s, log in $dir/train.log"
    timeout --kill-after=10 "$RUN_TIMEOUT_S" "${launch[@]}" stdbuf -oL ./train_llama "$config" --precision="$precision" --seed="$seed" \
        --train_data="$DATA/train_*.bin" --val_data="$DATA/val_*.bin" --out_dir="$dir" "${states[@]}" "${continue[@]}" \
        >> "$dir/train.log" 2>&1 || status=$?
    echo $((SECONDS - start)) >> "$dir/gpu_seconds"
    if grep -q "^{\"step\": $max_steps, \"val_loss\"" "$dir/log.jsonl" 2>/dev/null; then
        echo "run $name: complete ($max_steps steps)"
        # Only runs with FP8 somewhere (FP8 GEMMs, or FP8 activations under BF16 GEMMs) validate again in BF16.
        [ "$precision" = bf16 ] && [[ " ${states[*]} " != *" --activations="* ]] && return 0
        evaluate_in_bf16 "$config" "$dir" "$max_steps" || return 1
        return 0
    fi
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "run $name: stopped after $RUN_TIMEOUT_S s at step $(grep -c train_loss "$dir/log.jsonl" 2>/dev/null || echo 0): call again to resume"
        return 3
    fi
    echo "run $name: failed (exit status $status); last lines of $dir/train.log:" >&2
    tail -n 5 "$dir/train.log" | sed 's/^/    /' >&2
    return 1
}

# The final weights of a run that trained with FP8 somewhere, validated with BF16 compute (the
# same batches): how much of its loss is the FP8 forward's, and how much is in the weights. The
# step-0 validation of a 1-step run from those weights (CONFIG's batches), into DIR/bf16-eval/log.jsonl.
evaluate_in_bf16() {
    local config=$1 dir=$2 steps=$3 start=$SECONDS status=0
    [ -s "$dir/bf16-eval/log.jsonl" ] && return 0
    ./train_llama "$config" --precision=bf16 --init_from="$(printf '%s/ckpt_%08d.bin' "$dir" "$steps")" \
        --train_data="$DATA/train_*.bin" --val_data="$DATA/val_*.bin" --out_dir="$dir/bf16-eval" --overwrite=1 \
        --max_steps=1 --warmup_steps=0 --val_every=1 --checkpoint_final=0 > "$dir/bf16-eval.log" 2>&1 || status=$?
    echo $((SECONDS - start)) >> "$dir/gpu_seconds"
    if [ "$status" -ne 0 ]; then
        echo "run: the BF16 validation of $dir's final weights failed (exit status $status); last lines:" >&2
        tail -n 5 "$dir/bf16-eval.log" | sed 's/^/    /' >&2
        rm -rf "$dir/bf16-eval"
        return 1
    fi
    echo "run: $dir's final weights with BF16 compute: $(grep -o '"step": 0, "val_loss": [0-9.]*' "$dir/bf16-eval/log.jsonl")"
}

report() {
    local name found=0
    mkdir -p "$RESULTS/curves"
    for name in "${RUNS[@]}"; do
        [ -s "$OUT/$name/log.jsonl" ] || continue
        found=1
        cp "$OUT/$name/log.jsonl" "$RESULTS/curves/$name.log.jsonl"
        [ -s "$OUT/$name/gpu_seconds" ] && cp "$OUT/$name/gpu_seconds" "$RESULTS/curves/$name.gpu_seconds"
        [ -s "$OUT/$name/bf16-eval/log.jsonl" ] && cp "$OUT/$name/bf16-eval/log.jsonl" "$RESULTS/curves/$name.bf16-eval.log.jsonl"
    done
    [ $found -eq 1 ] || { echo "error: no run has a log in $OUT (scripts/reproduce_curves.sh run NAME)" >&2; exit 1; }
    python3 scripts/curves_report.py "$OUT" "$RESULTS" 125m="$CONFIG" 1b="$CONFIG_1B" -- "${RUNS[@]}"
}

status() {
    local name runs=()
    for name in "${RUNS[@]}"; do runs+=("$name=$(max_steps_of "$name")"); done
    python3 - "$OUT" "${runs[@]}" <<'PY'
import glob, json, os, re, sys
out = sys.argv[1]
lines, left_minutes, finished, unknown = [], 0.0, {}, []  # finished: steps -> GPU minutes of complete runs
for name, steps in (arg.split("=") for arg in sys.argv[2:]):
    steps = int(steps)
    folder = os.path.join(out, name)
    log = os.path.join(folder, "log.jsonl")
    if not os.path.exists(log):
        lines.append((name, steps, None))
        continue
    records = []
    for line in open(log):
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    seconds_path = os.path.join(folder, "gpu_seconds")
    seconds = sum(int(x) for x in open(seconds_path).read().split()) if os.path.exists(seconds_path) else 0
    if any(r.get("step") == steps and "val_loss" in r for r in records):
        finished.setdefault(steps, []).append(seconds / 60)
        lines.append((name, steps, f"{name}: complete, {seconds / 60:.1f} GPU-min"))
        continue
    checkpoints = [int(m.group(1)) for m in (re.search(r"ckpt_(\d+)\.bin$", p) for p in glob.glob(f"{folder}/ckpt_*.bin")) if m]
    at = max(checkpoints, default=0)
    done = max((r["step"] for r in records if "train_loss" in r), default=0)
    left = ""
    if done and seconds:
        left_minutes += seconds / done * (steps - at) / 60
        left = f", about {seconds / done * (steps - at) / 60:.1f} GPU-min left"
    else:
        unknown.append(name)
    where = f"resumes from step {at}" if checkpoints else "starts over (no checkpoint)"
    lines.append((name, steps, f"{name}: {where} of {steps}, logged up to step {done}, {seconds / 60:.1f} GPU-min so far{left}"))
for name, steps, text in lines:
    if text is None:  # not started: as long as the complete runs of the same length took on average
        if steps in finished:
            estimate = sum(finished[steps]) / len(finished[steps])
            left_minutes += estimate
            text = f"{name}: not started ({steps} steps, about {estimate:.1f} GPU-min as the complete runs of {steps} steps)"
        else:
            unknown.append(name)
            text = f"{name}: not started ({steps} steps)"
    print(text)
print(f"GPU time still to go: about {left_minutes:.0f} min" + (f", and {len(unknown)} run(s) with no estimate yet" if unknown else ""))
PY
}

case ${1:-} in
pack | status | unpack | report | all) [ $# -eq 1 ] || usage ;;
esac
case ${1:-} in
pack) pack ;;
status) status ;;
unpack) unpack ;;
run) [ $# -eq 2 ] || usage; run "$2" ;;
report) report ;;
all)
    [ -d "$PACK" ] || pack
    unpack
    for name in "${RUNS[@]}"; do
        until run "$name"; do [ $? -eq 3 ] || exit 1; done
    done
    report
    ;;
*) usage ;;
esac
