#!/usr/bin/env bash
# Pretraining curves of bf16, fp8 and coat: llama-125m on the whole local corpus
# (configs/llama-125m-curves.conf: 300M tokens, 0.5M tokens per step, AdamW 0.9/0.95, cosine with
# warmup, weight decay 0.1, clip 1.0), the three precisions from seed 1337 and bf16 from seed 2 for
# the seed-to-seed spread. One stage per command, so that a GPU machine without the corpus, whose
# jobs last minutes, can be fed and run job by job:
#   pack         where the corpus is (scripts/fetch_corpus.sh): its shards cut into pieces of at most
#                40M tokens, xz-compressed, in transport parts of at most 60 MiB each
#                (data/curves-pack/part_N/, each with the MANIFEST of all pieces)
#   unpack       decompresses the pieces present under data/curves-pack into data/curves/, checking
#                each against the MANIFEST (parts may arrive one per job: it says which are missing)
#   run NAME     trains NAME (bf16, fp8, coat, bf16-seed2; the ablations: coat-fp32-states, coat
#                with FP32 optimizer states; coat-stochastic, coat with its FP8 states rounded
#                stochastically; fp8-gemms, FP8 GEMMs alone, activations and states as in bf16;
#                coat-activations, COAT's activation storage alone, with BF16 GEMMs; bf16-residual-1x16
#                and bf16-gate-up-1x16, bf16 but for COAT's 1x16 copies of the residual stream, or
#                of gate|up; coat-fast-accum,
#                coat with Hopper's fast accumulation in its FP8 GEMMs; bf16-2ranks, bf16 on two
#                ranks sharing the GPU (mpirun, comm_backend = mpi): the same seed, batches and math
#                in another reduction order, what rounding alone does to a same-seed comparison;
#                coat-seed2, coat from seed 2, against bf16-seed2: the gap on a second seed) into
#                out/curves/NAME, resuming from its last checkpoint (every 50 steps) when one is
#                there; at most RUN_TIMEOUT_S seconds (default 560) per call: exit 0 when the run
#                is complete, 3 when the time ran out first (call again to continue). A complete
#                run that is not plain bf16 also validates its final weights with BF16 compute
#                (out/curves/NAME/bf16-eval/). Each call's seconds are added to out/curves/NAME/gpu_seconds.
#   status       each run's progress: complete, or the step it resumes from and the GPU time it
#                has taken and will still take at its pace so far, or not started
#   report       configs/results/curves.png (train and validation curves; each mode's validation loss
#                relative to bf16 beside the seed spread) and configs/results/curves.md (final losses,
#                gaps, tokens/s, peak memory, GPU time, the commands), the logs in configs/results/curves/
#                bf16-1epoch and coat-1epoch train 240 steps, one pass over the data with the whole
#                schedule in it: the learning-rate decay without repeated data.
#   all          pack (when the corpus is here), unpack, every run, report
# Needs: ./train_llama (make) for run; python3 for pack, unpack and report, matplotlib for the figure.
set -euo pipefail
cd "$(dirname "$0")/.."

# The folders and sizes can be moved (the tests do): CORPUS, PACK, DATA, OUT, RESULTS, PIECE_TOKENS, PART_BYTES.
CONFIG=configs/llama-125m-curves.conf
CORPUS=${CORPUS:-data/corpus/llama2}
PACK=${PACK:-data/curves-pack}
DATA=${DATA:-data/curves}
OUT=${OUT:-out/curves}
RESULTS=${RESULTS:-configs/results}
PIECE_TOKENS=${PIECE_TOKENS:-40000000}
PART_BYTES=${PART_BYTES:-$((60 * 1024 * 1024))}
RUN_TIMEOUT_S=${RUN_TIMEOUT_S:-560}
RUNS=(bf16 fp8 coat bf16-seed2 fp8-seed2 coat-seed2 bf16-seed3 fp8-seed3 coat-seed3 bf16-2ranks coat-fp32-states coat-stochastic fp8-gemms coat-activations
      bf16-residual-1x16 bf16-gate-up-1x16 coat-fast-accum bf16-1epoch coat-1epoch)
ONE_EPOCH_STEPS=240  # 125.8M tokens: one pass over the corpus's 127M training tokens

usage() {
    echo "usage: scripts/reproduce_curves.sh pack|unpack|run NAME|status|report|all   (NAME: ${RUNS[*]})" >&2
    exit 2
}

pack() {
    ls "$CORPUS"/train_*.bin "$CORPUS"/val_*.bin > /dev/null 2>&1 ||
        { echo "error: $CORPUS holds no train_*.bin and val_*.bin shards (scripts/fetch_corpus.sh builds them)" >&2; exit 1; }
    rm -rf "$PACK"
    mkdir -p "$PACK/pieces"
    python3 - "$CORPUS" "$PACK/pieces" "$PIECE_TOKENS" <<'PY'
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
    xz -6 -T0 "$PACK"/pieces/*.bin
    # Parts of at most 60 MiB, each piece whole, in order; every part carries the MANIFEST.
    local part=1 size=0 limit=$PART_BYTES
    mkdir -p "$PACK/part_$part"
    for piece in "$PACK"/pieces/*.bin.xz; do
        local bytes
        bytes=$(stat -c %s "$piece")
        if [ $((size + bytes)) -gt "$limit" ] && [ "$size" -gt 0 ]; then
            part=$((part + 1)) size=0
            mkdir -p "$PACK/part_$part"
        fi
        mv "$piece" "$PACK/part_$part/"
        size=$((size + bytes))
    done
    for dir in "$PACK"/part_*; do cp "$PACK/pieces/MANIFEST" "$dir/"; done
    rm -rf "$PACK/pieces"
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
    bf16-1epoch | coat-1epoch) precision=${name%-1epoch} seed=1337 states=(--max_steps=$ONE_EPOCH_STEPS) ;;
    *) usage ;;
    esac
    [ -x ./train_llama ] || { echo "error: ./train_llama is not built (make)" >&2; return 1; }
    local max_steps dir=$OUT/$name start=$SECONDS status=0 continue=(--overwrite=1)
    max_steps=$(sed -n 's/^max_steps *= *\([0-9]*\).*/\1/p' "$CONFIG")
    [[ $name == *-1epoch ]] && max_steps=$ONE_EPOCH_STEPS
    if ls "$dir"/ckpt_*.bin > /dev/null 2>&1; then continue=(--resume=1); fi
    mkdir -p "$dir"
    echo "run $name: precision $precision, seed $seed, ${continue[0]#--}, at most $RUN_TIMEOUT_S s, log in $dir/train.log"
    timeout --kill-after=10 "$RUN_TIMEOUT_S" "${launch[@]}" stdbuf -oL ./train_llama "$CONFIG" --precision="$precision" --seed="$seed" \
        --train_data="$DATA/train_*.bin" --val_data="$DATA/val_*.bin" --out_dir="$dir" "${states[@]}" "${continue[@]}" \
        >> "$dir/train.log" 2>&1 || status=$?
    echo $((SECONDS - start)) >> "$dir/gpu_seconds"
    if grep -q "^{\"step\": $max_steps, \"val_loss\"" "$dir/log.jsonl" 2>/dev/null; then
        echo "run $name: complete ($max_steps steps)"
        # Only runs with FP8 somewhere (FP8 GEMMs, or FP8 activations under BF16 GEMMs) validate again in BF16.
        [ "$precision" = bf16 ] && [[ " ${states[*]} " != *" --activations="* ]] && return 0
        evaluate_in_bf16 "$dir" "$max_steps" || return 1
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
# step-0 validation of a 1-step run from those weights, into DIR/bf16-eval/log.jsonl.
evaluate_in_bf16() {
    local dir=$1 steps=$2 start=$SECONDS status=0
    [ -s "$dir/bf16-eval/log.jsonl" ] && return 0
    ./train_llama "$CONFIG" --precision=bf16 --init_from="$(printf '%s/ckpt_%08d.bin' "$dir" "$steps")" \
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
    local present=()
    for name in "${RUNS[@]}"; do  # the figure: the runs of the full schedule that compare with bf16 of seed 1337
        [[ $name == *-1epoch || $name == coat-seed2 ]] || { [ -s "$OUT/$name/log.jsonl" ] && present+=("$OUT/$name:$name"); } || true
    done
    [ ${#present[@]} -gt 0 ] || { echo "error: no run has a log in $OUT (scripts/reproduce_curves.sh run NAME)" >&2; exit 1; }
    mkdir -p "$RESULTS/curves"
    for name in "${RUNS[@]}"; do
        [ -s "$OUT/$name/log.jsonl" ] || continue
        cp "$OUT/$name/log.jsonl" "$RESULTS/curves/$name.log.jsonl"
        [ -s "$OUT/$name/gpu_seconds" ] && cp "$OUT/$name/gpu_seconds" "$RESULTS/curves/$name.gpu_seconds"
        [ -s "$OUT/$name/bf16-eval/log.jsonl" ] && cp "$OUT/$name/bf16-eval/log.jsonl" "$RESULTS/curves/$name.bf16-eval.log.jsonl"
    done
    local spread=()
    [ -s "$OUT/bf16-seed2/log.jsonl" ] && spread=(--spread bf16-seed2)
    if python3 -c 'import matplotlib' 2>/dev/null; then
        python3 scripts/plot_curves.py --reference bf16 "${spread[@]}" "$RESULTS/curves.png" "${present[@]}"
    else
        echo "report: matplotlib is not installed: no figure (the table is written)" >&2
    fi
    python3 - "$OUT" "$RESULTS/curves.md" "$CONFIG" "${RUNS[@]}" <<'PY'
import json, os, statistics, sys
out, md, config, names = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
rows = {}
for name in names:
    path = os.path.join(out, name, "log.jsonl")
    if not os.path.exists(path):
        continue
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    train = [r for r in records if "train_loss" in r]
    val = [r for r in records if "val_loss" in r]
    bf16_val = float("nan")
    eval_path = os.path.join(out, name, "bf16-eval", "log.jsonl")
    if os.path.exists(eval_path):
        for line in open(eval_path):
            r = json.loads(line)
            if r.get("step") == 0 and "val_loss" in r:
                bf16_val = r["val_loss"]
    seconds_path = os.path.join(out, name, "gpu_seconds")
    seconds = sum(int(x) for x in open(seconds_path).read().split()) if os.path.exists(seconds_path) else 0
    rows[name] = {
        "steps": train[-1]["step"] if train else 0,
        "tokens": train[-1].get("tokens", 0) if train else 0,
        "train": {r["step"]: r["train_loss"] for r in train},
        "val": val[-1]["val_loss"] if val else float("nan"),
        "val_step": val[-1]["step"] if val else 0,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train[5:]) if len(train) > 5 else 0,
        "gib": max((r["gpu_mem_gib"] for r in train), default=0),
        "seconds": seconds,
        "bf16_val": bf16_val,
    }
def reference(name):  # the one-epoch runs against the one-epoch bf16 run, coat-seed2 against bf16-seed2
    if name.endswith("-1epoch"):
        return "bf16-1epoch"
    return "bf16-seed2" if name == "coat-seed2" else "bf16"
def time_cell(seconds):
    return f"{seconds / 60:.1f} min" if seconds else "-"
def gap(name, key="val"):
    base = rows.get(reference(name))
    if not base or name == reference(name) or name not in rows or rows[name][key] != rows[name][key]:
        return ""
    return f"{100 * (rows[name][key] / base['val'] - 1):+.2f}%"
def bf16_cell(name):
    v = rows[name]["bf16_val"]
    return "" if v != v else f"{v:.4f} ({gap(name, 'bf16_val')})"
HEADER = ("| run | steps | tokens | final val loss | vs bf16 | final weights, BF16 compute (vs bf16) | median tokens/s | "
          "peak GPU memory (GiB) | GPU time |")
lines = ["# Pretraining curves: llama-125m on the local corpus, bf16 vs fp8 vs coat", "",
         f"Config `{config}` (300M tokens, 524,288 per step); bf16, fp8 and coat from seed 1337 and the same",
         "data order, bf16-seed2 from seed 2 (another initialisation and data order) for the seed-to-seed",
         "spread, bf16-2ranks (bf16 on two ranks: the same batches in another reduction order) for what rounding",
         "alone does, coat-seed2 against bf16-seed2 for coat's gap on a second seed (not in the figure); the",
         "ablations coat-fp32-states (coat with FP32 optimizer states), coat-stochastic (its FP8 states",
         "rounded stochastically), fp8-gemms (FP8 GEMMs alone), coat-activations (COAT's activation",
         "storage alone, BF16 GEMMs), bf16-residual-1x16 and bf16-gate-up-1x16 (bf16 but for COAT's 1x16",
         "copies of the residual stream, or of gate|up) and coat-fast-accum (fast accumulation in the FP8",
         "GEMMs); bf16-1epoch and coat-1epoch: 240 steps (one pass over the data, the whole cosine",
         "schedule in it), against each other: the learning-rate decay without repeated data (not in the",
         "figure). Final val loss:",
         "the mean over 16 fixed validation batches after the last step; with BF16 compute: the same",
         "final weights and batches through the bf16 forward (what the FP8 forward itself costs at the end).", "",
         "![curves](curves.png)", "",
         HEADER,
         "|---|---|---|---|---|---|---|---|---|"]
for name in names:
    if name in rows:
        r = rows[name]
        lines.append(f"| {name} | {r['steps']} | {r['tokens'] / 1e6:.1f}M | {r['val']:.4f} (step {r['val_step']}) | "
                     f"{gap(name)} | {bf16_cell(name)} | {r['tokens_per_s']:,.0f} | {r['gib']:.2f} | {time_cell(r['seconds'])} |")
# Where in the run a gap opens: the mean train loss over each quarter of the reference's steps
# (those both runs logged), relative to the reference's.
quarters = []
for name in names:
    base = rows.get(reference(name))
    if name not in rows or not base or name == reference(name):
        continue
    steps = sorted(set(base["train"]) & set(rows[name]["train"]))
    if len(steps) < 8:
        continue
    last = max(base["train"])
    cells = []
    for q in range(4):
        part = [s for s in steps if q * last / 4 < s <= (q + 1) * last / 4]
        mean = lambda run: sum(rows[run]["train"][s] for s in part) / len(part)
        cells.append(f"{100 * (mean(name) / mean(reference(name)) - 1):+.2f}%" if part else "-")
    quarters.append(f"| {name} | {reference(name)} | " + " | ".join(cells) + " |")
if quarters:
    lines += ["", "Train loss by quarter of the run (the mean over the steps of each quarter), relative to the reference:", "",
              "| run | reference | 1st quarter | 2nd | 3rd | 4th |", "|---|---|---|---|---|---|"] + quarters
lines += ["", "Commands (the corpus: `scripts/fetch_corpus.sh`; a GPU machine without it gets the parts of", "`pack` one per job and unpacks them):", "",
          "```sh", "scripts/reproduce_curves.sh pack", "scripts/reproduce_curves.sh unpack"]
lines += [f"scripts/reproduce_curves.sh run {name}   # again while it exits 3" for name in names]
lines += ["scripts/reproduce_curves.sh report", "```", ""]
with open(md, "w") as f:
    f.write("\n".join(lines))
table = lines.index(HEADER)
print("\n".join(lines[table:table + 2 + len(rows)]))
print(f"report: wrote {md}")
PY
}

status() {
    local max_steps
    max_steps=$(sed -n 's/^max_steps *= *\([0-9]*\).*/\1/p' "$CONFIG")
    python3 - "$OUT" "$max_steps" "$ONE_EPOCH_STEPS" "${RUNS[@]}" <<'PY'
import glob, json, os, re, sys
out, full, one_epoch, names = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
for name in names:
    steps = one_epoch if name.endswith("-1epoch") else full
    folder = os.path.join(out, name)
    log = os.path.join(folder, "log.jsonl")
    if not os.path.exists(log):
        print(f"{name}: not started ({steps} steps)")
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
        print(f"{name}: complete, {seconds / 60:.1f} GPU-min")
        continue
    checkpoints = [int(m.group(1)) for m in (re.search(r"ckpt_(\d+)\.bin$", p) for p in glob.glob(f"{folder}/ckpt_*.bin")) if m]
    at = max(checkpoints, default=0)
    done = max((r["step"] for r in records if "train_loss" in r), default=0)
    left = f", about {seconds / done * (steps - at) / 60:.1f} GPU-min left" if done and seconds else ""
    where = f"resumes from step {at}" if checkpoints else "starts over (no checkpoint)"
    print(f"{name}: {where} of {steps}, logged up to step {done}, {seconds / 60:.1f} GPU-min so far{left}")
PY
}

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
