#!/usr/bin/env bash
# The command line of ./train_llama as a user meets it: --help, config errors (one line naming
# file:line, exit code 2) and dry_run's memory plan. Needs no GPU.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
# Shards for the dry runs that plan a model: dry_run refuses an empty train_data as training does.
# 140,000 tokens: one micro-batch of 64 x 2049 fits.
# write_shard PATH COUNT: a uint16 shard of COUNT tokens below 1000.
write_shard() {
    python3 - "$1" "$2" <<'PY'
import struct, sys
count = int(sys.argv[2])
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
    f.write(struct.pack(f"<{count}H", *((i * 7) % 1000 for i in range(count))))
PY
}
mkdir -p "$tmp/plan"
write_shard "$tmp/plan/train_000000.bin" 140000
plan_data="--train_data=$tmp/plan/train_*.bin"

help=$(./train_llama --help); rc=$?
check "--help exits 0" $rc
missing_keys=""
for key in $(sed -n 's/^    {"\([a-z0-9_]*\)", KEY_.*/\1/p' coat/config.h) $(sed -n 's/^    X(\([a-z0-9_]*\), .*/\1/p' coat/model_shape.h); do
    printf '%s\n' "$help" | grep -q "^  $key " || missing_keys="$missing_keys $key"
done
check "--help lists every key with its default" "$([ -z "$missing_keys" ]; echo $?)" "missing:$missing_keys"
check "--help lists a choice key's choices" "$(printf '%s\n' "$help" | grep -q '^  precision .*\[bf16|fp8|coat\]'; echo $?)" \
    "$(printf '%s\n' "$help" | grep '^  precision')"

expect_error() {  # expect_error NAME EXPECTED-TEXT ARGS...
    local name=$1 text=$2; shift 2
    out=$(./train_llama "$@" 2>&1); rc=$?
    lines=$(printf '%s\n' "$out" | wc -l)
    check "$name: exit code 2" "$([ $rc -eq 2 ]; echo $?)" "got $rc"
    check "$name: one line naming the problem" "$([ "$lines" -eq 1 ] && printf '%s' "$out" | grep -qF -- "$text"; echo $?)" "got: $out"
}
printf 'include = %s/configs/models/tiny.conf\nlearning_rat = 1e-3\n' "$PWD" > "$tmp/unknown.conf"
expect_error "unknown key" "unknown.conf:2: unknown key 'learning_rat'" "$tmp/unknown.conf" --dry_run=1
printf 'dim = 64\nmax_steps = -5\n' > "$tmp/bad.conf"
expect_error "bad value" "bad.conf:2: max_steps: -5 is outside" "$tmp/bad.conf" --dry_run=1
expect_error "missing config" "$tmp/none.conf: cannot open config" "$tmp/none.conf"
expect_error "bad override" "command line: unknown key 'bogus'" configs/models/tiny.conf --bogus=1
printf 'include = b.conf\n' > "$tmp/a.conf"; printf 'include = a.conf\n' > "$tmp/b.conf"
expect_error "include cycle" "include cycle" "$tmp/a.conf"

# A fresh run into an out_dir that holds an earlier one is refused, naming what is there and the
# keys that allow it; overwrite = 1 passes (dry_run removes nothing).
mkdir -p "$tmp/run"
touch "$tmp/run/ckpt_00000010.bin" "$tmp/run/ckpt_00000010.done" "$tmp/run/log.jsonl"
expect_error "a fresh run into an earlier run's out_dir" \
    "out_dir '$tmp/run' holds an earlier run (2 checkpoint file(s), the newest ckpt_00000010.bin, log.jsonl): resume = 1 continues it, overwrite = 1" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir="$tmp/run"
out=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir="$tmp/run" --overwrite=1 2>&1); rc=$?
check "overwrite = 1 lets dry_run pass and removes nothing" \
    "$([ $rc -eq 0 ] && [ -e "$tmp/run/ckpt_00000010.bin" ] && [ -e "$tmp/run/log.jsonl" ]; echo $?)" "$out"
# An out_dir that is a file, or under one, or empty: refused by dry_run as by training.
touch "$tmp/a_file"
expect_error "out_dir a file" "out_dir '$tmp/a_file' is not a folder" configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir="$tmp/a_file"
expect_error "out_dir under a file" "out_dir '$tmp/a_file/run' cannot be created: '$tmp/a_file' is not a folder" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir="$tmp/a_file/run"
expect_error "out_dir empty" "out_dir is empty: name the run's folder" configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir=
mkdir -p "$tmp/other"; touch "$tmp/other/notes.txt"
out=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --out_dir="$tmp/other" 2>&1); rc=$?
check "an out_dir with other files only is no earlier run" $rc "$out"

# The validation set: not part of the training data, and at least val_batches batches (2600
# tokens hold exactly 10 batches of 4 x 65).
mkdir -p "$tmp/data"
python3 - "$tmp/data" <<'PY'
import struct, sys
for name, count in (("train_000000.bin", 26000), ("val_000000.bin", 2600)):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *((i * 7) % 1000 for i in range(count))))
PY
data=(configs/models/tiny.conf --dry_run=1 "$plan_data" --micro_batch_size=4 --seq_len=64 --out_dir="$tmp/valrun"
      --train_data="$tmp/data/train_*.bin" --val_data="$tmp/data/val_*.bin")
expect_stderr() {  # expect_stderr NAME EXPECTED-TEXT ARGS...: exit code 2, one error line (stdout aside)
    local name=$1 text=$2; shift 2
    err=$(./train_llama "$@" 2>&1 > /dev/null); rc=$?
    check "$name: exit code 2 and one line naming the problem" \
        "$([ $rc -eq 2 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && printf '%s' "$err" | grep -qF -- "$text"; echo $?)" "got $rc: $err"
}
expect_stderr "validation data that is training data" "val_data matches $tmp/data/train_000000.bin, which train_data (command line) trains on" \
    "${data[@]}" --val_data="$tmp/data/*.bin"
out=$(./train_llama "${data[@]}" --val_batches=10 2>&1); rc=$?
check "val_batches equal to the batches of the validation set passes" $rc "$out"
expect_stderr "val_batches past the validation set" "command line: val_batches 11 is more than the 10 batches of 4 x 65 tokens" \
    "${data[@]}" --val_batches=11
out=$(./train_llama "${data[@]}" 2>&1); rc=$?
check "the default val_batches (20) is cut to the 10 batches the validation set holds" \
    "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q 'fewer than the default 20: a pass reads 10'; echo $?)" "$out"

# shuffle = rows orders the rows of all shards: two shards of 6 rows of 65 tokens each hold one
# batch of 4 rows apiece, but 12 rows make 3 batches of 4.
mkdir -p "$tmp/rows"
python3 - "$tmp/rows" <<'PY'
import struct, sys
for name in ("train_000000.bin", "train_000001.bin"):
    with open(f"{sys.argv[1]}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, 390, *([0] * 253)))
        f.write(struct.pack("<390H", *((i * 7) % 1000 for i in range(390))))
PY
rows=(configs/models/tiny.conf --dry_run=1 --micro_batch_size=4 --seq_len=64 --total_batch_tokens=256
      --train_data="$tmp/rows/train_*.bin" --out_dir="$tmp/rowsrun")
out=$(./train_llama "${rows[@]}" 2>&1); out_rows=$(./train_llama "${rows[@]}" --shuffle=rows 2>&1)
check "dry_run: shuffle = batches reads 2 micro-batches an epoch from these shards, shuffle = rows 3" \
    "$(printf '%s' "$out" | grep -q '2 shard(s), 2 micro-batches per epoch' &&
       printf '%s' "$out_rows" | grep -q '2 shard(s), 3 micro-batches per epoch'; echo $?)" "$out $out_rows"
expect_error "an unknown shuffle" "command line: shuffle: 'lines' is not one of batches|rows" \
    configs/models/tiny.conf --dry_run=1 --shuffle=lines

# A checkpoint whose model differs from the config in any key, or whose header announces sizes
# past any model, is refused by dry_run with the key's name (the file's sections are zeros).
make_checkpoint() {  # make_checkpoint PATH KEY=VALUE...: tiny.conf's model unless overridden
    python3 - "$@" <<'PY'
import struct, sys
fields = dict(version=1, vocab=1000, dim=128, layers=2, heads=2, kv=1, ffn=352, seq=128, theta=10000.0, eps=1e-5,
              scaling=0.0, low=1.0, high=4.0, original=8192, step=0, padded=0, hasopt=0, optimizer=0, trainer=0)
for arg in sys.argv[2:]:
    key, value = arg.split("=")
    fields[key] = float(value) if key in ("theta", "eps", "scaling", "low", "high") else int(value)
double = lambda x: struct.unpack("<q", struct.pack("<d", struct.unpack("<f", struct.pack("<f", x))[0]))[0]
values = [fields["version"], fields["vocab"], fields["dim"], fields["layers"], fields["heads"], fields["kv"], fields["ffn"],
          fields["seq"], double(fields["theta"]), double(fields["eps"]), double(fields["scaling"]), double(fields["low"]),
          double(fields["high"]), fields["original"], fields["step"], fields["padded"], fields["hasopt"], fields["optimizer"],
          fields["trainer"]]
with open(sys.argv[1], "wb") as f:
    f.write(b"LLAMACK1" + struct.pack("<63q", *(values + [0] * (63 - len(values)))))
    if fields["padded"] < 1 << 30:
        f.write(bytes(4 * fields["padded"] + fields["optimizer"] + fields["trainer"]))
PY
}
padded=$(python3 -c "
import sys; sys.path.insert(0, 'scripts')
from llama_layout import ModelShape, ParamLayout
print(ParamLayout(ModelShape(vocab_size=1000, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=352, max_seq_len=128)).total_padded)" 2>/dev/null || echo 0)
make_checkpoint "$tmp/same.bin" padded="$padded"
out=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --init_from="$tmp/same.bin" 2>&1); rc=$?
check "a checkpoint of the config's model passes dry_run" "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q 'checkpoint of step 0'; echo $?)" "$out"
for change in "theta=500000:rope_theta" "eps=1e-6:norm_eps" "scaling=8:rope_scaling_factor" "ffn=384:ffn_dim"; do
    make_checkpoint "$tmp/other.bin" padded="$padded" "${change%%:*}"
    expect_stderr "a checkpoint whose ${change##*:} differs" "$tmp/other.bin: ${change##*:} differs between the checkpoint and the config" \
        configs/models/tiny.conf --dry_run=1 "$plan_data" --init_from="$tmp/other.bin"
done
make_checkpoint "$tmp/count.bin" padded=128
expect_stderr "a checkpoint with another parameter count" "$tmp/count.bin: 128 parameters (padded), the config's model has $padded" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --init_from="$tmp/count.bin"
make_checkpoint "$tmp/huge.bin" padded=$((1 << 41))
err=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --init_from="$tmp/huge.bin" 2>&1 > /dev/null); rc=$?
check "a header announcing 2^41 parameters is refused as corrupt, not wrapped" \
    "$([ $rc -ne 0 ] && [ "$err" = "error: $tmp/huge.bin: corrupt header (sizes past 2^40 parameters or 2^50 bytes) (init_from, set at command line)" ]; echo $?)" "$err"

# A data, tokenizer or checkpoint error names the config line that named the file.
printf 'include = %s/configs/models/tiny.conf\ntrain_data = %s/nothing_*.bin\n' "$PWD" "$tmp" > "$tmp/data_line.conf"
err=$(./train_llama "$tmp/data_line.conf" --dry_run=1 2>&1 >/dev/null); rc=$?
check "a shard error names the config line that set train_data" \
    "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "no file matches.*(train_data, set at $tmp/data_line.conf:2)"; echo $?)" "$err"
printf 'include = %s/configs/models/tiny.conf\ntokenizer = %s/none.json\n' "$PWD" "$tmp" > "$tmp/tokenizer_line.conf"
err=$(./train_llama "$tmp/tokenizer_line.conf" --dry_run=1 "$plan_data" 2>&1 >/dev/null); rc=$?
check "a tokenizer error names the config line that set tokenizer" \
    "$([ $rc -ne 0 ] && [ "$err" = "error: $tmp/none.json: cannot open: No such file or directory (tokenizer, set at $tmp/tokenizer_line.conf:2)" ]; echo $?)" "$err"

# Launched as several processes (mpirun, srun, a launcher's WORLD_SIZE), training is data-parallel
# with ZeRO stage 0, 1 or 2.
err=$(WORLD_SIZE=2 ./train_llama "${data[@]}" --dry_run=0 2>&1 >/dev/null); rc=$?
check "WORLD_SIZE=2 without RANK is refused" "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q 'needs RANK set to 0..1'; echo $?)" "$err"
if command -v mpirun > /dev/null && ! nvidia-smi -L > /dev/null 2>&1 && grep -qa MPI_Init ./train_llama; then
    # Without a GPU both ranks start MPI and check everything up to the first kernel.
    for stage in 0 1 2; do
        out=$(timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 ./train_llama "${data[@]}" --dry_run=0 \
              --zero_stage=$stage --comm_backend=mpi --out_dir="$tmp/ranks_run" 2>&1)
        check "mpirun -np 2, zero_stage $stage: both ranks get as far as the GPU" \
            "$([ "$(printf '%s\n' "$out" | grep -c 'no CUDA GPU found')" = 2 ]; echo $?)" "$(printf '%s\n' "$out" | head -4)"
    done
fi
# dry_run under a launcher plans the launched ranks (world_size = 0), printed once, by rank 0.
if command -v mpirun > /dev/null; then
    out=$(timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 ./train_llama "${data[@]}" 2>&1); rc=$?
    check "mpirun -np 2 dry_run: one plan, for 2 ranks, from rank 0" \
        "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c 'configuration is valid')" = 1 ] &&
           printf '%s' "$out" | grep -q 'micro-batch 4 x 64 tokens, 2 rank(s), ZeRO stage 1'; echo $?)" "$out"
fi
out=$(WORLD_SIZE=4 RANK=0 ./train_llama "${data[@]}" 2>&1); rc=$?
out2=$(WORLD_SIZE=4 RANK=2 ./train_llama "${data[@]}" 2>&1); rc2=$?
check "WORLD_SIZE=4: rank 0's dry_run plans 4 ranks, rank 2's checks silently" \
    "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q ' 4 rank(s), ZeRO stage 1' && [ $rc2 -eq 0 ] && [ -z "$out2" ]; echo $?)" "$out2"
for value in abc 0; do
    err=$(env SLURM_NTASKS=$value ./train_llama "${data[@]}" --dry_run=0 2>&1 >/dev/null); rc=$?
    check "SLURM_NTASKS=$value: refused (no count of processes), not trained as one" \
        "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "SLURM_NTASKS='$value' is not a number of processes"; echo $?)" "$err"
done
err=$(OMPI_COMM_WORLD_SIZE=1 ./train_llama "${data[@]}" --dry_run=0 --max_steps=1 --out_dir="$tmp/one_process" 2>&1 >/dev/null)
check "OMPI_COMM_WORLD_SIZE=1 is one process" "$(! printf '%s' "$err" | grep -q 'launched as one of'; echo $?)" "$err"

# Ranks check each other at start (coat/agree.h): configs that differ in a key are refused by rank
# 0, naming the rank and the key; an error every rank hits is printed once, by rank 0.
if command -v mpirun > /dev/null && grep -qa MPI_Init ./train_llama; then
    mpmd=(timeout 60 mpirun --allow-run-as-root --oversubscribe)
    out=$("${mpmd[@]}" -np 1 ./train_llama "${data[@]}" : -np 1 ./train_llama "${data[@]}" --micro_batch_size=2 2>&1); rc=$?
    check "mpirun, one rank with another micro_batch_size: refused by rank 0 alone, naming rank 1 and the key, exit 2" \
        "$([ $rc -eq 2 ] && [ "$(printf '%s\n' "$out" | grep -c '^error')" = 1 ] &&
           printf '%s' "$out" | grep -q "^error: rank 1's micro_batch_size differs from rank 0's (set at command line there)" &&
           ! printf '%s' "$out" | grep -q 'configuration is valid'; echo $?)" "$out"
    out=$("${mpmd[@]}" -np 2 ./train_llama "${data[@]}" --learning_rat=1 2>&1); rc=$?
    check "mpirun -np 2, a config error on both ranks: printed once, exit 2" \
        "$([ $rc -eq 2 ] && [ "$(printf '%s\n' "$out" | grep -c "^error: command line: unknown key 'learning_rat'")" = 1 ]; echo $?)" "$out"
fi
# Ranks launched without MPI (TCP through MASTER_ADDR / MASTER_PORT), training (they get as far
# as the GPU): another seed, or an out_dir that is not rank 0's folder, is refused by rank 0; the
# same folder under another path is not.
port=$((20000 + RANDOM % 20000))
pair() {  # pair OUT RANK0-ARGS -- RANK1-ARGS: both ranks' output in OUT, their exit codes in OUT.rc
    local out=$1; shift
    local first=() second=()
    while [ "$1" != "--" ]; do first+=("$1"); shift; done; shift; second=("$@")
    port=$((port + 1))
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 timeout 60 ./train_llama "${second[@]}" > "$out.1" 2>&1 &
    local other=$!
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 timeout 60 ./train_llama "${first[@]}" > "$out.0" 2>&1
    local rc0=$?
    wait $other
    echo "$rc0 $?" > "$out.rc"
}
if ! nvidia-smi -L > /dev/null 2>&1; then
    mkdir -p "$tmp/shared_run" && ln -s "$tmp/shared_run" "$tmp/shared_link"
    train=("${data[@]}" --dry_run=0 --collective_timeout_s=20)
    pair "$tmp/seed" "${train[@]}" --out_dir="$tmp/shared_run" -- "${train[@]}" --out_dir="$tmp/shared_run" --seed=7
    check "torchrun-style ranks, another seed on rank 1: rank 0 alone refuses, naming the key; both exit 2" \
        "$([ "$(cat "$tmp/seed.rc")" = "2 2" ] && [ ! -s "$tmp/seed.1" ] &&
           grep -q "^error: rank 1's seed differs from rank 0's" "$tmp/seed.0"; echo $?)" "$(cat "$tmp/seed.0" "$tmp/seed.1")"
    pair "$tmp/dirs" "${train[@]}" --out_dir="$tmp/shared_run" -- "${train[@]}" --out_dir="$tmp/other_run"
    check "torchrun-style ranks with different out_dirs: refused by rank 0, naming rank 1's folder" \
        "$([ "$(cat "$tmp/dirs.rc")" = "1 1" ] && [ ! -s "$tmp/dirs.1" ] &&
           grep -q "^error: rank 1: out_dir '$tmp/other_run' is not the folder rank 0 writes to" "$tmp/dirs.0"; echo $?)" \
        "$(cat "$tmp/dirs.0" "$tmp/dirs.1")"
    pair "$tmp/link" "${train[@]}" --out_dir="$tmp/shared_run" -- "${train[@]}" --out_dir="$tmp/shared_link"
    check "torchrun-style ranks, one out_dir under two paths: both pass the checks and get as far as the GPU" \
        "$([ "$(cat "$tmp/link.0" "$tmp/link.1" | grep -c 'no CUDA GPU found')" = 2 ] && [ ! -e "$tmp/shared_run/.rank0_token" ]; echo $?)" \
        "$(cat "$tmp/link.0" "$tmp/link.1")"
fi

# The trainer's start-up refusals, made by dry_run too (one function, the same messages).
expect_error "dry_run without train_data" "default: train_data is empty: name the training shards" \
    configs/models/tiny.conf --dry_run=1
expect_error "samples without a tokenizer" "command line: tokenizer is empty: sampling needs the tokenizer" \
    "${data[@]}" --sample_every=10 --tokenizer=
err=$(./train_llama configs/models/llama-125m.conf --dry_run=1 "$plan_data" --generate=1 --out_dir="$tmp/empty_run" \
      --tokenizer=data/tokenizers/llama2/tokenizer.json 2>&1 >/dev/null); rc=$?
check "generate without a checkpoint is refused by dry_run" \
    "$([ $rc -ne 0 ] && [ "$err" = "error: $tmp/empty_run: no checkpoint to generate from (set init_from)" ]; echo $?)" "$err"
mkdir -p "$tmp/weights_only"
make_checkpoint "$tmp/weights_only/ckpt_00000005.bin" padded="$padded" && touch "$tmp/weights_only/ckpt_00000005.done"
err=$(./train_llama "${data[@]}" --out_dir="$tmp/weights_only" --resume=1 2>&1 >/dev/null); rc=$?
check "resume from a weights-only checkpoint is refused by dry_run" \
    "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "ckpt_00000005.bin: holds weights only, no optimizer state to resume from"; echo $?)" "$err"
mkdir -p "$tmp/old_state"
make_checkpoint "$tmp/old_state/ckpt_00000005.bin" padded="$padded" hasopt=1 trainer=7 && touch "$tmp/old_state/ckpt_00000005.done"
err=$(./train_llama "${data[@]}" --out_dir="$tmp/old_state" --resume=1 2>&1 >/dev/null); rc=$?
check "resume from another version's trainer state is refused by dry_run" \
    "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "ckpt_00000005.bin: trainer state of 7 bytes, this build writes"; echo $?)" "$err"

# Precision combinations: any mix of GEMMs, activation storage and optimizer states is planned;
# what cannot run is refused by dry_run with its reason, naming the key.
expect_error "fast accumulation without FP8 GEMMs" "command line: fp8_fast_accum applies to FP8 GEMMs only" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --fp8_fast_accum=1
expect_error "stochastic rounding of FP32 optimizer states" "command line: optimizer_rounding = stochastic applies to FP8 optimizer states only" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --optimizer_rounding=stochastic
out=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --precision=coat --optimizer_rounding=stochastic 2>&1)
check "dry_run accepts stochastic rounding of coat's FP8+DRE states" $? "$out"
expect_error "the E4M3 parameter gather without FP8 GEMMs" "command line: param_gather = e4m3 gathers the E4M3 weights of FP8 GEMMs" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --param_gather=e4m3
for gather in auto:e4m3 bf16:bf16 e4m3:e4m3; do
    out=$(./train_llama configs/models/tiny.conf --dry_run=1 "$plan_data" --precision=coat --world_size=8 \
          --param_gather=${gather%%:*} 2>&1); rc=$?
    check "dry_run, coat on 8 ranks, param_gather ${gather%%:*}: the plan names the ${gather#*:} gather" \
        "$([ $rc -eq 0 ] && printf '%s\n' "$out" | grep -q "with the block weights gathered in e4m3; this run gathers ${gather#*:}$"; echo $?)" "$out"
done
expect_error "FP8 with a token count that is not a multiple of 16" "command line: precision FP8 transposes" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --precision=coat --micro_batch_size=3 --seq_len=5
expect_error "BF16 GEMMs over FP8 activations with ffn_dim < dim" "command line: activations BF16 GEMMs with FP8-saved inputs" \
    configs/models/tiny.conf --dry_run=1 "$plan_data" --activations=fp8 --ffn_dim=64
out=$(./train_llama configs/models/llama-1b.conf --dry_run=1 "$plan_data" --micro_batch_size=16 --activations=coat --optimizer_states=fp8_dre 2>&1); rc=$?
check "dry_run plans BF16 GEMMs over COAT activations and FP8+DRE states" \
    "$([ $rc -eq 0 ] && printf '%s\n' "$out" | grep -q 'precision bf16, optimizer states fp8_dre, activations coat'; echo $?)" "$out"
check "dry_run prints saved activations per layer in U beside the paper's" \
    "$(printf '%s\n' "$out" | grep -q "^saved per layer: 9.13U .*COAT 13.33U"; echo $?)" "$(printf '%s\n' "$out" | tail -2)"
for precision in bf16 fp8 coat; do
    out=$(./train_llama configs/models/llama-1b.conf --dry_run=1 "$plan_data" --micro_batch_size=16 --precision=$precision 2>&1); rc=$?
    check "dry_run llama-1b $precision exits 0" $rc "$out"
    check "dry_run llama-1b $precision prints the memory plan" \
        "$(printf '%s\n' "$out" | grep -q "memory plan per rank: precision $precision" &&
           printf '%s\n' "$out" | grep -q '^  optimizer states' && printf '%s\n' "$out" | grep -q '^  total'; echo $?)"
done
out=$(./train_llama configs/models/llama2-7b.conf --dry_run=1 "$plan_data" --micro_batch_size=64 --seq_len=2048 --gpu_memory_gib=141 2>&1); rc=$?
out2=$(./train_llama configs/models/llama2-7b.conf --dry_run=1 "$plan_data" --micro_batch_size=1 --gpu_memory_gib=20 2>&1); rc2=$?
check "dry_run says that no micro-batch fits rather than 'the largest is 0'" \
    "$([ $rc2 -eq 2 ] && printf '%s' "$out2" | grep -q 'not even micro_batch_size 1 fits' && ! printf '%s' "$out2" | grep -q 'is 0'; echo $?)" "$out2"
check "dry_run refuses a micro-batch that does not fit, naming the largest that does" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'the largest that fits is [0-9]'; echo $?)" "$out"
# The fewest ranks that fit a micro-batch at the config's ZeRO stage: a plan for that many fits,
# one for a rank fewer does not; at stage 0, where nothing is sharded, none does.
fewest=(configs/models/llama2-7b.conf --dry_run=1 "$plan_data" --precision=bf16 --micro_batch_size=8 --seq_len=2048
        --zero_stage=2 --gpu_memory_gib=80)
err=$(./train_llama "${fewest[@]}" 2>&1 >/dev/null); rc=$?
ranks=$(printf '%s' "$err" | sed -n 's/.*at ZeRO stage 2 it fits from \([0-9]*\) rank(s) on.*/\1/p')
out=$(./train_llama "${fewest[@]}" --world_size="${ranks:-0}" 2>&1); rc2=$?
out3=$(./train_llama "${fewest[@]}" --world_size="$(( ${ranks:-2} - 1 ))" 2>&1); rc3=$?
check "llama2-7b bf16 8 x 2048 in 80 GiB at ZeRO stage 2: one rank is refused naming the fewest ranks that fit ($ranks), which fit, and one fewer does not" \
    "$([ $rc -eq 2 ] && [ "${ranks:-0}" -gt 1 ] && [ $rc2 -eq 0 ] && printf '%s' "$out" | grep -q "fits from $ranks rank(s) on" &&
       [ $rc3 -eq 2 ]; echo $?)" "$err / $(printf '%s' "$out" | tail -2) / $out3"
err=$(./train_llama "${fewest[@]}" --zero_stage=0 2>&1 >/dev/null); rc=$?
check "at ZeRO stage 0 no number of ranks fits it, saying what each holds" \
    "$([ $rc -eq 2 ] && printf '%s' "$err" | grep -q 'at ZeRO stage 0 no number of ranks fits it: each holds at least [0-9.]* GiB'; echo $?)" "$err"
# FP8 GEMMs keep no BF16 copy of the block's linear weights (their E4M3 copies are cast from the
# master weights): llama2-7b in coat at ZeRO-1 on 8 ranks plans 12 GiB less BF16 parameters per
# rank than with the copy that param_gather = bf16 keeps.
params_gib() { printf '%s\n' "$1" | sed -n 's/^  parameters (bf16) *\([0-9.]*\) GiB.*/\1/p'; }
seven=(configs/models/llama2-7b.conf --dry_run=1 "$plan_data" --precision=coat --world_size=8 --micro_batch_size=8 --seq_len=2048)
out=$(./train_llama "${seven[@]}" 2>&1); rc=$?
out2=$(./train_llama "${seven[@]}" --param_gather=bf16 2>&1); rc2=$?
check "llama2-7b coat, ZeRO-1, 8 ranks: BF16 parameters $(params_gib "$out") GiB without the block weights, $(params_gib "$out2") GiB with them (12 GiB more)" \
    "$([ $rc -eq 0 ] && [ $rc2 -eq 0 ] &&
       awk -v a="$(params_gib "$out")" -v b="$(params_gib "$out2")" 'BEGIN { exit !(a > 0 && b - a >= 12) }'; echo $?)" \
    "$(params_gib "$out") / $(params_gib "$out2")"

# ZeRO stage 3 shards the layers' working weights: llama2-70b in coat, 1 x 4096, plans at most
# 130 GiB per rank on 8 ranks and 70 GiB on 64 (stage 2: 203 and 132), with the layer gather's
# slots among its lines; the fewest ranks that fit 80 GiB; stage 3 with FP8 GEMMs and
# param_gather = bf16 is refused by name.
total_gib() { printf '%s\n' "$1" | sed -n 's/^  total *\([0-9.]*\) GiB.*/\1/p'; }
seventy=(configs/models/llama2-70b.conf --dry_run=1 "$plan_data" --precision=coat --micro_batch_size=1 --seq_len=4096)
out8=$(./train_llama "${seventy[@]}" --world_size=8 --zero_stage=3 2>&1); rc8=$?
out64=$(./train_llama "${seventy[@]}" --world_size=64 --zero_stage=3 2>&1); rc64=$?
out2=$(./train_llama "${seventy[@]}" --world_size=8 --zero_stage=2 2>&1)
check "llama2-70b coat 1 x 4096, ZeRO stage 3: $(total_gib "$out8") GiB per rank on 8 ranks (at most 130; stage 2 $(total_gib "$out2")), $(total_gib "$out64") on 64 (at most 70), the layer gather planned" \
    "$([ $rc8 -eq 0 ] && [ $rc64 -eq 0 ] && printf '%s\n' "$out8" | grep -q '^  layer gather  *[0-9.]* GiB' &&
       printf '%s\n' "$out8" | grep -q 'the gradient shard bf16 (one micro-batch per step)' &&
       awk -v a="$(total_gib "$out8")" -v b="$(total_gib "$out64")" -v c="$(total_gib "$out2")" \
           'BEGIN { exit !(a > 0 && a <= 130 && b > 0 && b <= 70 && c > 200) }'; echo $?)" "$(printf '%s\n' "$out8" | grep -A9 '^memory plan')"
err=$(./train_llama "${seventy[@]}" --zero_stage=3 --gpu_memory_gib=80 2>&1 >/dev/null); rc=$?
ranks=$(printf '%s' "$err" | sed -n 's/.*at ZeRO stage 3 it fits from \([0-9]*\) rank(s) on.*/\1/p')
out=$(./train_llama "${seventy[@]}" --zero_stage=3 --gpu_memory_gib=80 --world_size="${ranks:-0}" 2>&1); rc2=$?
out3=$(./train_llama "${seventy[@]}" --zero_stage=3 --gpu_memory_gib=80 --world_size="$(( ${ranks:-2} - 1 ))" 2>&1); rc3=$?
check "llama2-70b coat in 80 GiB at ZeRO stage 3: one rank is refused naming the fewest ranks that fit ($ranks), which fit, and one fewer does not" \
    "$([ $rc -eq 2 ] && [ "${ranks:-0}" -gt 8 ] && [ $rc2 -eq 0 ] && printf '%s' "$out" | grep -q "fits from $ranks rank(s) on" &&
       [ $rc3 -eq 2 ]; echo $?)" "$err / $(printf '%s' "$out" | tail -2) / $(printf '%s' "$out3" | tail -1)"
err=$(./train_llama "${seventy[@]}" --world_size=8 --zero_stage=3 --param_gather=bf16 2>&1); rc=$?
check "ZeRO stage 3 with FP8 GEMMs and param_gather = bf16 is refused, naming the key" \
    "$([ $rc -eq 2 ] && printf '%s' "$err" | grep -q '^error: command line: param_gather = bf16 .*ZeRO stage 3'; echo $?)" "$err"

# Hybrid sharding: 16 ranks in groups of 8 (shard_group = 8) plan per rank what 8 flat ranks
# plan, print the calls and bytes within a group and across the groups; a grouping that does not
# divide the ranks, exceeds them, is 1 or comes with zero_stage = 0 is refused naming the key.
seven=(configs/models/llama2-7b.conf --dry_run=1 "$plan_data" --precision=coat --micro_batch_size=1 --seq_len=4096)
for stage in 1 2 3; do
    hybrid=$(./train_llama "${seven[@]}" --zero_stage=$stage --world_size=16 --shard_group=8 2>&1); rc=$?
    flat=$(./train_llama "${seven[@]}" --zero_stage=$stage --world_size=8 2>&1); rc2=$?
    check "llama2-7b coat, ZeRO stage $stage, 16 ranks in groups of 8: $(total_gib "$hybrid") GiB per rank, 8 flat ranks' $(total_gib "$flat"), calls and bytes within the group and across the groups" \
        "$([ $rc -eq 0 ] && [ $rc2 -eq 0 ] && [ -n "$(total_gib "$hybrid")" ] && [ "$(total_gib "$hybrid")" = "$(total_gib "$flat")" ] &&
           printf '%s\n' "$hybrid" | grep -q "ZeRO stage $stage over 16 ranks in 2 groups of 8 (shard_group 8): .* (1/8 of each of" &&
           printf '%s\n' "$hybrid" | grep -q '^collective calls per step within a group of 8: [0-9]* reduce-scatters' &&
           printf '%s\n' "$hybrid" | grep -q '^collective calls per step across the 2 groups: [0-9]* all-reduces .*over all 16 ranks: 1 all-reduce' &&
           printf '%s\n' "$hybrid" | grep -q '^sent per rank and step (1 accumulation step(s)) within the group: gradients [0-9.]* GB' &&
           printf '%s\n' "$hybrid" | grep -q '^sent per rank and step (1 accumulation step(s)) across the groups: gradients [0-9.]* GB' &&
           [ "$(printf '%s\n' "$hybrid" | sed -n 's/^collective calls per step within a group of 8: \([0-9]*\) reduce-scatters.*/\1/p')" = \
             "$(printf '%s\n' "$flat" | sed -n 's/^collective calls per step: \([0-9]*\) reduce-scatters.*/\1/p')" ]; echo $?)" \
        "$(printf '%s\n' "$hybrid" | grep -E '^(ZeRO|collective|sent|  total)')"
done
expect_error "shard_group not dividing the ranks" "command line: shard_group = 3 does not divide the 16 ranks" "${seven[@]}" --world_size=16 --shard_group=3
expect_error "shard_group above the ranks" "command line: shard_group = 32 exceeds the 16 rank(s)" "${seven[@]}" --world_size=16 --shard_group=32
expect_error "shard_group = 1" "command line: shard_group = 1 would replicate every state" "${seven[@]}" --world_size=16 --shard_group=1
expect_error "shard_group at ZeRO stage 0" "command line: shard_group = 8 groups the ranks that shard the states, but zero_stage = 0" \
    "${seven[@]}" --world_size=16 --shard_group=8 --zero_stage=0
out=$(./train_llama "${seven[@]}" --world_size=16 --shard_group=16 2>&1); rc=$?
check "shard_group = the world size plans flat sharding" \
    "$([ $rc -eq 0 ] && printf '%s\n' "$out" | grep -q '^ZeRO stage 1 over 16 ranks: ' && ! printf '%s\n' "$out" | grep -q 'across the'; echo $?)" "$out"

# Bad inputs that dry_run opens: checkpoints, shards and tokenizers, each named in one line.
python3 - "$tmp" <<'PY'
import struct, sys
sys.path.insert(0, "scripts")
from llama_layout import CheckpointHeader, ParamLayout, checkpoint_bytes, model_shape_from_config
tmp = sys.argv[1]
shape = model_shape_from_config("configs/models/tiny.conf")
layout = ParamLayout(shape)
def write_checkpoint(path, shape, total, cut=0):  # version 2, weights only (zeros), its checksums right
    data = checkpoint_bytes(CheckpointHeader(shape, step=5, total_padded=total), bytes(4 * total))
    open(path, "wb").write(data[:len(data) - cut])
write_checkpoint(f"{tmp}/good.bin", shape, layout.total_padded)
write_checkpoint(f"{tmp}/cut.bin", shape, layout.total_padded, cut=1000)
open(f"{tmp}/long.bin", "wb").write(open(f"{tmp}/good.bin", "rb").read() + bytes(4))
other = model_shape_from_config("configs/models/tiny.conf")
other.dim = 256
write_checkpoint(f"{tmp}/other_dim.bin", other, ParamLayout(other).total_padded)
open(f"{tmp}/magic.bin", "wb").write(b"NOTACKPT" + bytes(600))
def write_shard(path, tokens, cut=0):
    data = struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)) + struct.pack(f"<{len(tokens)}H", *tokens)
    open(path, "wb").write(data[:len(data) - cut])
write_shard(f"{tmp}/ok_000000.bin", [i % 1000 for i in range(20000)])
write_shard(f"{tmp}/big_000000.bin", [i % 1000 for i in range(20000)] + [1500])
write_shard(f"{tmp}/cut_000000.bin", [i % 1000 for i in range(20000)], cut=10)
open(f"{tmp}/tokenizer.json", "w").write('{"model": {"type": "Unigram", "vocab": []}}')
PY
tiny=(configs/models/tiny.conf --dry_run=1 "$plan_data" --micro_batch_size=2 --seq_len=64 --warmup_steps=0 --out_dir="$tmp/none")
expect_fail() {  # expect_fail NAME EXPECTED-TEXT ARGS...
    local name=$1 text=$2; shift 2
    out=$(./train_llama "${tiny[@]}" "$@" 2>&1); rc=$?
    check "$name: refused with a message naming the file" \
        "$([ $rc -ne 0 ] && printf '%s' "$out" | tail -1 | grep -qF -- "$text"; echo $?)" "$(printf '%s' "$out" | tail -1)"
}
out=$(./train_llama "${tiny[@]}" --init_from="$tmp/good.bin" --train_data="$tmp/ok_*.bin" 2>&1)
check "dry_run accepts a good checkpoint and shard" \
    "$(printf '%s' "$out" | grep -q "checkpoint of step 5, every section's checksum right"; echo $?)" "$out"
expect_fail "truncated checkpoint" "$tmp/cut.bin: size" --init_from="$tmp/cut.bin"
good_size=$(stat -c %s "$tmp/good.bin")
expect_fail "a checkpoint 4 bytes longer than its header announces" \
    "$tmp/long.bin: size $((good_size + 4)) bytes, header announces $good_size" --init_from="$tmp/long.bin"
expect_fail "not a checkpoint" "$tmp/magic.bin: not a train_llama checkpoint" --init_from="$tmp/magic.bin"
expect_fail "checkpoint of another shape" "$tmp/other_dim.bin: dim differs" --init_from="$tmp/other_dim.bin"
expect_fail "token beyond the vocabulary" "$tmp/big_000000.bin" --train_data="$tmp/big_*.bin"
expect_fail "truncated shard" "$tmp/cut_000000.bin" --train_data="$tmp/cut_*.bin"
expect_fail "no shard matches" "$tmp/nothing_*.bin" --train_data="$tmp/nothing_*.bin"
expect_fail "unsupported tokenizer" "$tmp/tokenizer.json: unsupported" --tokenizer="$tmp/tokenizer.json"


# Resumable checkpoints (version 2, a CRC-32 per section and of the header) of tiny.conf's model
# with FP32 (bf16 runs) or FP8+DRE (coat) optimizer states and a trainer state, written here:
# dry_run checks what training would on the GPU.
make_resumable() {  # make_resumable DIR STEP KEY=VALUE... (kind=0 fp32 | 3 fp8_dre, epoch, position, seed, shuffle, batch, seq)
    python3 - "$padded" "$@" <<'PY'
import os, random, struct, sys, zlib
padded, folder, step = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
v = dict(kind=0, epoch=0, position=0, seed=1337, shuffle=1, batch=4, seq=64, tokens=0, stepfield=step)
for arg in sys.argv[4:]:
    key, value = arg.split("=")
    v[key] = int(value)
elem, scalars = {0: (4, 0), 3: (1, 3)}[v["kind"]]
payload = 2 * (elem * padded + 4 * scalars * (padded // 128))
rng = random.Random(step)
weights = bytes(rng.getrandbits(8) for _ in range(4 * padded))
optimizer = struct.pack("<7Q", 0x4d41444154414f43, 2, v["kind"], 0, padded, step, payload) + bytes(rng.getrandbits(8) for _ in range(payload))
trainer = struct.pack("<4qQQ3q", v["stepfield"], v["tokens"], v["epoch"], v["position"], 99, v["seed"], v["shuffle"], v["batch"], v["seq"])
double = lambda x: struct.unpack("<q", struct.pack("<d", struct.unpack("<f", struct.pack("<f", x))[0]))[0]
fields = [2, 1000, 128, 2, 2, 1, 352, 128, double(10000.0), double(1e-5), double(0.0), double(1.0), double(4.0), 8192, step,
          padded, 1, len(optimizer), len(trainer), zlib.crc32(weights), zlib.crc32(optimizer), zlib.crc32(trainer), 0]
fields += [0] * (63 - len(fields))
fields[22] = zlib.crc32(b"LLAMACK1" + struct.pack("<63q", *fields))
os.makedirs(folder, exist_ok=True)
with open(f"{folder}/ckpt_{step:08d}.bin", "wb") as f:
    f.write(b"LLAMACK1" + struct.pack("<63q", *fields) + weights + optimizer + trainer)
open(f"{folder}/ckpt_{step:08d}.done", "w").close()
PY
}
# 26000 tokens hold 100 batches of 4 x 65: one rank reads 100 a epoch, 2 ranks 50 each, 3 ranks 33.
resume=("${data[@]}" --resume=1)
make_resumable "$tmp/ok_run" 10 position=40
out=$(./train_llama "${resume[@]}" --out_dir="$tmp/ok_run" 2>&1); rc=$?
check "dry_run accepts a resumable checkpoint whose sections match their checksums" \
    "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q "ckpt_00000010.bin: checkpoint of step 10, every section's checksum right"; echo $?)" "$out"
# Flipped bits anywhere (header, weights, optimizer state, trainer state) and zero-filled sections
# are refused, naming the section.
size=$(stat -c %s "$tmp/ok_run/ckpt_00000010.bin")
header=512; weights=$((4 * padded)); optimizer=$((56 + 8 * padded)); trainer=72
flips_refused=0 flips=0
for spot in header:8:$((header - 8)) weights:$header:$weights "optimizer state:$((header + weights)):$optimizer" \
            "trainer state:$((header + weights + optimizer)):$trainer"; do
    name=${spot%%:*} rest=${spot#*:}; start=${rest%%:*} length=${rest#*:}
    for i in $(seq 0 13); do
        offset=$((start + (length - 1) * i / 13)) bit=$((i % 8))
        rm -rf "$tmp/flip"; cp -r "$tmp/ok_run" "$tmp/flip"
        python3 -c "
import sys; f = open(sys.argv[1], 'r+b'); f.seek($offset); b = f.read(1); f.seek($offset); f.write(bytes([b[0] ^ (1 << $bit)]))" \
            "$tmp/flip/ckpt_00000010.bin"
        err=$(./train_llama "${resume[@]}" --out_dir="$tmp/flip" 2>&1 >/dev/null)
        flips=$((flips + 1))
        # (a flipped version field is refused as an unknown version before its checksum is read)
        expected="the $name section fails its checksum"; [ "$name" = header ] && expected="ckpt_00000010.bin: "
        if printf '%s' "$err" | grep -qF "$expected"; then flips_refused=$((flips_refused + 1)); else echo "  not refused: bit $bit of byte $offset ($name): $err"; fi
    done
    if [ "$name" != header ]; then
        rm -rf "$tmp/flip"; cp -r "$tmp/ok_run" "$tmp/flip"
        dd if=/dev/zero of="$tmp/flip/ckpt_00000010.bin" bs=1 seek="$start" count="$length" conv=notrunc status=none
        err=$(./train_llama "${resume[@]}" --out_dir="$tmp/flip" 2>&1 >/dev/null); rc=$?
        check "dry_run refuses a zero-filled $name section, naming it" \
            "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -qF "the $name section fails its checksum"; echo $?)" "$err"
    fi
done
check "dry_run refuses every one of $flips single-bit flips in the header, weights, optimizer and trainer state" \
    "$([ "$flips_refused" -eq "$flips" ]; echo $?)" "$flips_refused of $flips refused"
# A per-rank checkpoint (checkpoint_writes = per_rank: a manifest and a part file per rank; here
# the resumable one above split as 3 ranks write it, build/checkpoint_split) resumes in dry_run as
# the one file does; a missing, short or damaged part file, or a damaged manifest, is refused in
# one line naming the file and the checkpoint it belongs to.
if [ -x build/checkpoint_split ]; then
    make_resumable "$tmp/coat_one" 10 position=40 kind=3
    mkdir -p "$tmp/parts_run"
    out=$(build/checkpoint_split "$tmp/coat_one/ckpt_00000010.bin" "$tmp/parts_run" 3 1 2>&1); rc=$?
    check "build/checkpoint_split writes 3 part files and a manifest" \
        "$([ $rc -eq 0 ] && [ -e "$tmp/parts_run/ckpt_00000010.rank2.bin" ] && [ -e "$tmp/parts_run/ckpt_00000010.done" ]; echo $?)" "$out"
    out=$(./train_llama "${resume[@]}" --precision=coat --out_dir="$tmp/parts_run" 2>&1); rc=$?
    check "dry_run resumes a per-rank checkpoint of 3 part files, every part's checksum right, at the one file's data position" \
        "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q "ckpt_00000010.bin: checkpoint of step 10 in 3 part file(s), every part's checksum right" &&
           printf '%s' "$out" | grep -q "data position: epoch 0, step 40 of 100 on 1 rank(s)"; echo $?)" "$out"
    part=$tmp/parts_run/ckpt_00000010.rank1.bin
    parts_refusal() {  # parts_refusal NAME EXPECTED-TEXT: the damaged copy in $tmp/parts_bad is refused in one line
        err=$(./train_llama "${resume[@]}" --precision=coat --out_dir="$tmp/parts_bad" 2>&1 > /dev/null); rc=$?
        check "dry_run refuses $1 in one line naming it" \
            "$([ $rc -ne 0 ] && [ "$(printf '%s\n' "$err" | wc -l)" -eq 1 ] && printf '%s' "$err" | grep -qF -- "$2"; echo $?)" "$err"
    }
    bad_part=$tmp/parts_bad/ckpt_00000010.rank1.bin bad_context="(part 1 of 3 of $tmp/parts_bad/ckpt_00000010.bin)"
    rm -rf "$tmp/parts_bad"; cp -r "$tmp/parts_run" "$tmp/parts_bad"; rm "$bad_part"
    parts_refusal "a missing part file" "$bad_part: missing $bad_context"
    rm -rf "$tmp/parts_bad"; cp -r "$tmp/parts_run" "$tmp/parts_bad"; truncate -s -1 "$bad_part"
    parts_refusal "a part file one byte short" "$bad_part: size $(($(stat -c %s "$part") - 1)) bytes, the manifest says $(stat -c %s "$part") (truncated or damaged) $bad_context"
    rm -rf "$tmp/parts_bad"; cp -r "$tmp/parts_run" "$tmp/parts_bad"
    printf '\x01' | dd of="$bad_part" bs=1 seek=70000 conv=notrunc status=none
    parts_refusal "a damaged part file" "$bad_part: fails its checksum"
    rm -rf "$tmp/parts_bad"; cp -r "$tmp/parts_run" "$tmp/parts_bad"
    printf '\x01' | dd of="$tmp/parts_bad/ckpt_00000010.bin" bs=1 seek=700 conv=notrunc status=none
    parts_refusal "a damaged manifest" "$tmp/parts_bad/ckpt_00000010.bin: the manifest fails its checksum"
    expect_stderr "an unknown checkpoint_writes" "command line: checkpoint_writes: 'all' is not one of rank0|per_rank" \
        "${resume[@]}" --out_dir="$tmp/parts_run" --checkpoint_writes=all
else
    check "the per-rank checkpoint checks need build/checkpoint_split (make build/checkpoint_split)" 1
fi
# Launched as 2 ranks (training without a GPU goes as far as the GPU), one rank reads the one
# file's checksums, and each rank its share of a per-rank checkpoint's part files: a damaged
# section, or a damaged part that rank 1 checks, is refused on both ranks before the GPU, printed
# once by rank 0, and both exit non-zero.
if command -v mpirun > /dev/null && ! nvidia-smi -L > /dev/null 2>&1 && grep -qa MPI_Init ./train_llama && [ -x build/checkpoint_split ]; then
    ranks2=(timeout 60 mpirun --allow-run-as-root --oversubscribe -np 2 ./train_llama "${resume[@]}" --dry_run=0 --precision=coat
            --comm_backend=mpi)
    rm -rf "$tmp/one_bad"; cp -r "$tmp/coat_one" "$tmp/one_bad"
    printf '\x01' | dd of="$tmp/one_bad/ckpt_00000010.bin" bs=1 seek=$((512 + 4 * padded + 1000)) conv=notrunc status=none
    out=$("${ranks2[@]}" --out_dir="$tmp/one_bad" 2>&1); rc=$?
    check "2 ranks: a damaged optimizer section of the one file is refused once, both ranks exit non-zero before the GPU" \
        "$([ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(printf '%s\n' "$out" | grep -c '^error')" = 1 ] &&
           printf '%s' "$out" | grep -q "^error: $tmp/one_bad/ckpt_00000010.bin: the optimizer state section fails its checksum" &&
           ! printf '%s' "$out" | grep -q 'no CUDA GPU'; echo $?)" "$(printf '%s\n' "$out" | grep -v '^ *$' | head -4)"
    rm -rf "$tmp/parts_bad"; cp -r "$tmp/parts_run" "$tmp/parts_bad"
    printf '\x01' | dd of="$bad_part" bs=1 seek=70000 conv=notrunc status=none
    out=$("${ranks2[@]}" --out_dir="$tmp/parts_bad" 2>&1); rc=$?
    check "2 ranks: a damaged part file that rank 1 checks is refused once, naming rank 1 and the file, both exit non-zero" \
        "$([ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$(printf '%s\n' "$out" | grep -c '^error')" = 1 ] &&
           printf '%s' "$out" | grep -qF "error: rank 1: $bad_part: fails its checksum" &&
           ! printf '%s' "$out" | grep -q 'no CUDA GPU'; echo $?)" "$(printf '%s\n' "$out" | grep -v '^ *$' | head -4)"
    out=$("${ranks2[@]}" --out_dir="$tmp/parts_run" 2>&1)
    check "2 ranks: the per-rank checkpoint passes, each rank checking its share, and both go on to the GPU" \
        "$(printf '%s' "$out" | grep -q "in 3 part file(s), each rank checks its share of their checksums" &&
           [ "$(printf '%s\n' "$out" | grep -c 'no CUDA GPU found')" = 2 ]; echo $?)" "$(printf '%s\n' "$out" | head -4)"
fi
make_resumable "$tmp/step_run" 10 stepfield=11
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/step_run" 2>&1 >/dev/null); rc=$?
check "a trainer state at another step than the header is refused" \
    "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "the trainer state is at step 11, the header at step 10"; echo $?)" "$err"
mv "$tmp/ok_run/ckpt_00000010.bin" "$tmp/ok_run/ckpt_00000012.bin"; mv "$tmp/ok_run/ckpt_00000010.done" "$tmp/ok_run/ckpt_00000012.done"
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/ok_run" 2>&1 >/dev/null); rc=$?
check "a checkpoint whose file name and header disagree on the step is refused" \
    "$([ $rc -ne 0 ] && printf '%s' "$err" | grep -q "ckpt_00000012.bin: the header says step 10"; echo $?)" "$err"

# The data order: a resume that changes what decides it is refused naming the key, or (rows,
# another micro_batch_size, another world size) continues at the same row of the same order.
make_resumable "$tmp/order_run" 10 position=40
for change in micro_batch_size=8 seed=7 shuffle=rows seq_len=32; do
    expect_stderr "resume with ${change%%=*} changed" "command line: ${change%%=*} differs from the checkpoint's run" \
        "${resume[@]}" --out_dir="$tmp/order_run" --"$change"
done
make_resumable "$tmp/rows_run" 10 position=40 shuffle=2
out=$(./train_llama "${resume[@]}" --out_dir="$tmp/rows_run" --shuffle=rows --micro_batch_size=8 --total_batch_tokens=512 2>&1); rc=$?
check "shuffle = rows: micro_batch_size 4 -> 8 continues at row 160 of the same order (step 20)" \
    "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q "data position: epoch 0, step 20 of 50 on 1 rank(s)"; echo $?)" "$out"
make_resumable "$tmp/rows_odd" 10 position=41 shuffle=2
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/rows_odd" --shuffle=rows --micro_batch_size=8 --total_batch_tokens=512 2>&1 >/dev/null)
check "shuffle = rows: 164 rows read are no multiple of 8: refused" "$(printf '%s' "$err" | grep -q "164 rows into epoch 0) is no multiple of 1 rank(s) x 8 rows"; echo $?)" "$err"
# An odd epoch: 25740 tokens hold 99 batches. One rank's checkpoint after 98 of them: 2 ranks
# would read batches 98 and 99, but there is no batch 99: they go on with the next epoch.
mkdir -p "$tmp/odd"
write_shard "$tmp/odd/train_000000.bin" 25740
make_resumable "$tmp/odd_epoch" 10 position=98
out=$(./train_llama "${resume[@]}" --train_data="$tmp/odd/train_*.bin" --out_dir="$tmp/odd_epoch" --world_size=2 \
      --total_batch_tokens=512 2>&1); rc=$?
check "a one-rank checkpoint at the last batch of an odd epoch resumes on 2 ranks at the next epoch" \
    "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q "data position: epoch 1, step 0 of 49 on 2 rank(s)"; echo $?)" "$out"

# dry_run refuses what training refused only after allocating the GPU.
make_resumable "$tmp/coat_run" 10 kind=3 position=40
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/coat_run" 2>&1 >/dev/null); rc=$?
check "dry_run refuses a coat checkpoint (FP8+DRE states) resumed in bf16 (FP32 states)" \
    "$([ $rc -eq 2 ] && printf '%s' "$err" | grep -q "optimizer states are fp8_dre in the file, fp32 in the config"; echo $?)" "$err"
make_resumable "$tmp/three_run" 10 position=3
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/three_run" --world_size=2 --total_batch_tokens=512 2>&1 >/dev/null); rc=$?
check "dry_run refuses a data position 2 ranks do not divide" \
    "$([ $rc -eq 1 ] && printf '%s' "$err" | grep -q "(3 batches into epoch 0) is no multiple of 2 rank(s)"; echo $?)" "$err"
make_resumable "$tmp/far_run" 10 position=500
err=$(./train_llama "${resume[@]}" --out_dir="$tmp/far_run" 2>&1 >/dev/null); rc=$?
check "dry_run refuses a data position outside the data" \
    "$([ $rc -eq 1 ] && printf '%s' "$err" | grep -q "is outside train_data's 100 batches per epoch"; echo $?)" "$err"
err=$(WORLD_SIZE=2 RANK=0 ./train_llama "${data[@]}" --comm_backend=mpi 2>&1 >/dev/null); rc=$?
check "dry_run refuses comm_backend = mpi for ranks started with WORLD_SIZE and RANK" \
    "$([ $rc -eq 2 ] && printf '%s' "$err" | grep -q "comm_backend = mpi needs the ranks launched by mpirun"; echo $?)" "$err"
make_checkpoint "$tmp/gen.bin" padded="$(python3 -c "
import sys; sys.path.insert(0, 'scripts')
from llama_layout import ModelShape, ParamLayout
print(ParamLayout(ModelShape(vocab_size=32000, dim=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=352, max_seq_len=128)).total_padded)")" vocab=32000
gen=(configs/models/tiny.conf --dry_run=1 --generate=1 --init_from="$tmp/gen.bin" --tokenizer=data/tokenizers/llama2/tokenizer.json
     --out_dir="$tmp/gen_run" --vocab_size=32000)
expect_stderr "logits_out in a missing folder" "logits_out '$tmp/missing/logits.bin': its folder '$tmp/missing' does not exist" \
    "${gen[@]}" --logits_out="$tmp/missing/logits.bin"
expect_stderr "logits_out onto the checkpoint it reads" "logits_out '$tmp/gen.bin' is the checkpoint $tmp/gen.bin, which this run reads" \
    "${gen[@]}" --logits_out="$tmp/gen.bin"
expect_stderr "logits_out without generate" "logits_out is written by generate = 1 only" "${data[@]}" --logits_out="$tmp/logits.bin"
[ -e "$tmp/parts_run/ckpt_00000010.rank2.bin" ] &&
    expect_stderr "logits_out onto a part file of the per-rank checkpoint it reads" \
        "logits_out '$tmp/parts_run/ckpt_00000010.rank2.bin' is a part file of the checkpoint $tmp/parts_run/ckpt_00000010.bin, which this run reads" \
        "${gen[@]}" --init_from="$tmp/parts_run/ckpt_00000010.bin" --logits_out="$tmp/parts_run/ckpt_00000010.rank2.bin"

# Settings that would remove the run's own inputs; inputs compared as files, not path strings.
mkdir -p "$tmp/self"; cp "$tmp/same.bin" "$tmp/self/ckpt_00000003.bin"; touch "$tmp/self/ckpt_00000003.done"
expect_stderr "overwrite that would remove init_from" "overwrite = 1 would remove $tmp/self/ckpt_00000003.bin, which this run reads (init_from's" \
    "${data[@]}" --out_dir="$tmp/self" --overwrite=1 --init_from="$tmp/self/ckpt_00000003.bin"
mkdir -p "$tmp/link"; ln -sf "$tmp/data/train_000000.bin" "$tmp/link/val_000000.bin"
expect_stderr "validation data that is the training data through a link" "val_data matches $tmp/link/val_000000.bin, which train_data" \
    "${data[@]}" --val_data="$tmp/link/val_*.bin"

# Special files and folders as inputs: refused before they are opened (a FIFO would block).
mkfifo "$tmp/fifo.bin" "$tmp/fifo.json"
err=$(timeout 10 ./train_llama "${data[@]}" --init_from="$tmp/fifo.bin" 2>&1 >/dev/null); rc=$?
check "a FIFO as init_from is refused at once" "$([ $rc -eq 1 ] && printf '%s' "$err" | grep -q "fifo.bin: is no regular file, not a checkpoint file"; echo $?)" "got $rc: $err"
err=$(timeout 10 ./train_llama "${data[@]}" --tokenizer="$tmp/fifo.json" 2>&1 >/dev/null); rc=$?
check "a FIFO as tokenizer is refused at once" "$([ $rc -eq 1 ] && printf '%s' "$err" | grep -q "fifo.json: not a regular file (a FIFO)"; echo $?)" "got $rc: $err"
err=$(./train_llama "${data[@]}" --init_from="$tmp" 2>&1 >/dev/null); rc=$?
check "a folder as init_from is named a directory, not a truncated header" \
    "$([ $rc -eq 1 ] && printf '%s' "$err" | grep -q "$tmp: is a directory, not a checkpoint file"; echo $?)" "$err"

# What was silently ignored: resume = 1 finding no checkpoint, world_size in a training run.
err=$(./train_llama "${data[@]}" --resume=1 --out_dir="$tmp/no_such_run" 2>&1 >/dev/null); rc=$?
check "resume = 1 with a folder that does not exist warns that the run starts at step 0" \
    "$([ $rc -eq 0 ] && printf '%s' "$err" | grep -q "warning: resume = 1, but $tmp/no_such_run holds no checkpoint (the folder does not exist: is its name right?)"; echo $?)" "$err"
if ! nvidia-smi -L > /dev/null 2>&1; then
    err=$(./train_llama "${data[@]}" --dry_run=0 --world_size=4 --out_dir="$tmp/ws_run" 2>&1 >/dev/null)
    check "world_size in a training run warns that it plans dry runs only" \
        "$(printf '%s' "$err" | grep -q "warning: command line: world_size 4 plans dry runs only: this run trains on the 1 rank(s) launched"; echo $?)" "$err"
fi

check_summary test_cli
