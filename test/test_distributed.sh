#!/usr/bin/env bash
# Data-parallel training on the GPU: 2 and 4 ranks sharing one GPU through comm_backend = mpi
# against one rank at the same global batch (the ranks read the one-rank run's micro-batches
# between them): every logged loss within the BF16 reduction-order noise, printed; rank 0 alone
# writes the log and the checkpoints; checkpoints resume on other world sizes and stages; ZeRO
# stage 0 (every rank steps everything), 1 (sharded master weights and states, checkpoints
# gathered by rank 0), 2 (also the gradients, per bucket during backward) and 3 (also the layers'
# working weights, gathered before their forward and their backward: the same losses and norms as
# stage 2 bit for bit, with one micro-batch a step and with several, with the two gather slots in
# turn over 4 buckets of layers) in bf16 and coat, coat's E4M3 parameter gather against its BF16
# one, with a bucket per layer too; per-rank checkpoints (checkpoint_writes = per_rank) against
# rank 0's file; hybrid sharding (shard_group = 2: 2 groups of 2 ranks) against flat ranks and
# one rank, its checkpoints across world sizes and groupings; validation split over the ranks (at
# stage 3 every rank runs as many forward passes); one rank under mpirun with NCCL equals the plain run bit for bit, two NCCL ranks
# on one GPU are refused by name, and on a machine with several GPUs NCCL with one rank per GPU
# follows one rank too, also when each rank sees only its own GPU.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if ! command -v mpirun > /dev/null || ! grep -qa MPI_Init ./train_llama; then
    echo "SKIP: no mpirun, or ./train_llama built without MPI"
    check_summary test_distributed
    exit $?
fi
mpi=(timeout 300 mpirun --oversubscribe -np)
[ "$(id -u)" -eq 0 ] && mpi=(timeout 300 mpirun --allow-run-as-root --oversubscribe -np)

write_pattern_shards "$tmp" 3 200000 20000
common=(configs/models/tiny.conf --train_data="$tmp/train_*.bin" --val_data="$tmp/val_*.bin" --micro_batch_size=4
        --seq_len=64 --total_batch_tokens=512 --max_steps=20 --warmup_steps=5 --learning_rate=3e-3 --val_every=10
        --val_batches=4 --checkpoint_every=10 --checkpoints_keep=5 --zero_stage=0)
# max relative difference of the losses two logs share (steps FROM and after), and how many
compare() {
    python3 - "$1" "$2" "${3:-1}" <<'PY'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        for key in ("train_loss", "val_loss"):
            if key in r and r["step"] >= int(sys.argv[3]):
                out[(r["step"], key)] = r[key]
    return out
a, b = losses(sys.argv[1]), losses(sys.argv[2])
shared = sorted(set(a) & set(b))
worst = max(abs(a[k] - b[k]) / abs(a[k]) for k in shared) if shared else float("inf")
print(f"{worst:.2e} {len(shared)} {len(a)} {len(b)}")
PY
}

# LOG holds the losses of REFERENCE (steps FROM and after) once each, every one within 1%:
# check_close NAME REFERENCE LOG [FROM]
check_close() {
    local name=$1 reference=$2 log=$3 from=${4:-1} worst shared reference_count count
    read -r worst shared reference_count count <<< "$(compare "$reference" "$log" "$from")"
    echo "$name: largest relative loss difference $worst over $shared logged losses"
    check "$name: all $reference_count losses logged once, each within 1% (largest $worst)" \
        "$([ "$shared" -gt 0 ] && [ "$shared" = "$reference_count" ] && [ "$count" = "$reference_count" ] &&
           awk -v w="$worst" 'BEGIN { exit !(w < 0.01) }'; echo $?)" "$(tail -3 "$log")"
}
# The step-10 checkpoint of run FROM resumed in DIR on RANKS ranks with the trainer arguments that
# follow: it runs to the end and steps 11-20 follow FROM's log.
resume_on() {
    local from=$1 ranks=$2 dir=$3
    shift 3
    mkdir -p "$dir"
    cp "$tmp/$from/ckpt_00000010.bin" "$tmp/$from/ckpt_00000010.done" "$tmp/$from/log.jsonl" "$dir/"
    if [ "$ranks" = 1 ]; then
        ./train_llama "$@" --out_dir="$dir" --resume=1 > "$dir.out" 2>&1
    else
        "${mpi[@]}" "$ranks" ./train_llama "$@" --comm_backend=mpi --out_dir="$dir" --resume=1 > "$dir.out" 2>&1
    fi
    check "the $from run's step-10 checkpoint resumes on $ranks rank(s)" $? "$(tail -3 "$dir.out")"
    check_close "$from's checkpoint on $ranks rank(s), steps 11-20" "$tmp/$from/log.jsonl" "$dir/log.jsonl" 11
}

./train_llama "${common[@]}" --out_dir="$tmp/one" > "$tmp/one.out" 2>&1
check "one rank, 2 micro-batches a step: 20 steps" $? "$(tail -3 "$tmp/one.out")"
"${mpi[@]}" 2 ./train_llama "${common[@]}" --comm_backend=mpi --out_dir="$tmp/two" > "$tmp/two.out" 2>&1
check "2 ranks on one GPU (comm_backend mpi), a micro-batch each: 20 steps" $? "$(tail -5 "$tmp/two.out")"
check_close "2 ranks against 1" "$tmp/one/log.jsonl" "$tmp/two/log.jsonl"
check "rank 0 alone prints and writes: one set of step lines, one checkpoint per save" \
    "$([ "$(grep -c '^step  *20/20' "$tmp/two.out")" = 1 ] && [ "$(ls "$tmp/two"/ckpt_*.done | wc -l)" = 2 ]; echo $?)" \
    "$(grep -c '^step' "$tmp/two.out") step lines; $(ls "$tmp/two")"

# Checkpoints cross world sizes: the 2-rank run's step 10 on one rank, the 1-rank run's on two.
resume_on two 1 "$tmp/two-on-1" "${common[@]}"
resume_on one 2 "$tmp/one-on-2" "${common[@]}"

# ZeRO stages 1 to 3: 4 micro-batches a step on 1 rank, 2 on 2 ranks, 1 on 4; against stage 0; in coat.
stage1=("${common[@]}" --total_batch_tokens=1024 --zero_stage=1)
./train_llama "${stage1[@]}" --out_dir="$tmp/s1_one" > "$tmp/s1_one.out" 2>&1
check "one rank, 4 micro-batches a step: 20 steps" $? "$(tail -3 "$tmp/s1_one.out")"
for stage in 1 2 3; do
    for ranks in 2 4; do
        run=s${stage}_$ranks
        "${mpi[@]}" $ranks ./train_llama "${stage1[@]}" --zero_stage=$stage --comm_backend=mpi --out_dir="$tmp/$run" \
            > "$tmp/$run.out" 2>&1
        check "ZeRO stage $stage on $ranks ranks: 20 steps, checkpoints written by rank 0" \
            "$([ $? -eq 0 ] && [ "$(ls "$tmp/$run"/ckpt_*.done | wc -l)" = 2 ]; echo $?)" "$(tail -5 "$tmp/$run.out")"
        check_close "ZeRO stage $stage, $ranks ranks against 1" "$tmp/s1_one/log.jsonl" "$tmp/$run/log.jsonl"
    done
done
# Validation splits its batches over the ranks (rank r: r, r + W, ...) and adds their FP64 sums:
# before any step every world size gives one rank's loss bit for bit, 3 batches on 4 ranks too.
val0() { grep -o '"step": 0, "val_loss": [0-9.e+-]*' "$1"; }
./train_llama "${stage1[@]}" --val_batches=3 --max_steps=1 --warmup_steps=1 --out_dir="$tmp/val3_one" > "$tmp/val3_one.out" 2>&1
"${mpi[@]}" 4 ./train_llama "${stage1[@]}" --val_batches=3 --max_steps=1 --warmup_steps=1 --comm_backend=mpi --out_dir="$tmp/val3_4" \
    > "$tmp/val3_4.out" 2>&1
for precision in bf16 coat; do  # stage 3: rank 3 runs the first batch again (the forward gathers) and adds nothing
    "${mpi[@]}" 4 ./train_llama "${stage1[@]}" --val_batches=3 --max_steps=1 --warmup_steps=1 --zero_stage=3 --precision=$precision \
        --comm_backend=mpi --out_dir="$tmp/val3_4_s3_$precision" > "$tmp/val3_4_s3_$precision.out" 2>&1
    check "$precision, ZeRO stage 3 on 4 ranks, 3 validation batches: 1 step" $? "$(tail -3 "$tmp/val3_4_s3_$precision.out")"
done
./train_llama "${stage1[@]}" --val_batches=3 --max_steps=1 --warmup_steps=1 --precision=coat --out_dir="$tmp/val3_one_coat" \
    > "$tmp/val3_one_coat.out" 2>&1
check "the step-0 validation loss at ZeRO stage 3 on 4 ranks (3 batches) is one rank's bit for bit, in bf16 and coat" \
    "$(v=$(val0 "$tmp/val3_one/log.jsonl") && [ -n "$v" ] && [ "$(val0 "$tmp/val3_4_s3_bf16/log.jsonl")" = "$v" ] &&
       c=$(val0 "$tmp/val3_one_coat/log.jsonl") && [ -n "$c" ] && [ "$(val0 "$tmp/val3_4_s3_coat/log.jsonl")" = "$c" ]; echo $?)" \
    "$(val0 "$tmp/val3_one/log.jsonl"); $(val0 "$tmp/val3_4_s3_bf16/log.jsonl"); $(val0 "$tmp/val3_one_coat/log.jsonl"); $(val0 "$tmp/val3_4_s3_coat/log.jsonl")"
check "the step-0 validation loss on 2 and 4 ranks (4 batches) and on 4 ranks (3 batches) is one rank's, bit for bit" \
    "$(v=$(val0 "$tmp/s1_one/log.jsonl") && [ -n "$v" ] && [ "$(val0 "$tmp/s1_2/log.jsonl")" = "$v" ] &&
       [ "$(val0 "$tmp/s1_4/log.jsonl")" = "$v" ] && v3=$(val0 "$tmp/val3_one/log.jsonl") && [ -n "$v3" ] &&
       [ "$(val0 "$tmp/val3_4/log.jsonl")" = "$v3" ]; echo $?)" \
    "$(val0 "$tmp/s1_one/log.jsonl"); $(val0 "$tmp/s1_2/log.jsonl"); $(val0 "$tmp/s1_4/log.jsonl"); $(val0 "$tmp/val3_one/log.jsonl"); $(val0 "$tmp/val3_4/log.jsonl"); $(tail -2 "$tmp/val3_4.out")"
"${mpi[@]}" 2 ./train_llama "${stage1[@]}" --zero_stage=0 --comm_backend=mpi --out_dir="$tmp/s0_2" > "$tmp/s0_2.out" 2>&1
check_close "2 ranks, ZeRO stage 1 against stage 0" "$tmp/s0_2/log.jsonl" "$tmp/s1_2/log.jsonl"
check_close "2 ranks, ZeRO stage 2 against stage 1" "$tmp/s1_2/log.jsonl" "$tmp/s2_2/log.jsonl"
./train_llama "${stage1[@]}" --precision=coat --out_dir="$tmp/coat_one" > "$tmp/coat_one.out" 2>&1
check "coat, one rank: 20 steps" $? "$(tail -3 "$tmp/coat_one.out")"
for stage in 0 1 2 3; do
    for ranks in 2 4; do
        run=coat_s$stage$([ "$ranks" = 2 ] || echo "_$ranks")
        "${mpi[@]}" $ranks ./train_llama "${stage1[@]}" --precision=coat --zero_stage=$stage --comm_backend=mpi \
            --out_dir="$tmp/$run" > "$tmp/$run.out" 2>&1
        check "coat, ZeRO stage $stage on $ranks ranks: 20 steps" $? "$(tail -5 "$tmp/$run.out")"
        check_close "coat, ZeRO stage $stage, $ranks ranks against 1" "$tmp/coat_one/log.jsonl" "$tmp/$run/log.jsonl"
    done
done
# The E4M3 parameter gather (param_gather auto, with FP8 GEMMs) leaves every rank the codes a
# cast of the BF16 gather's weights makes: the same losses and gradient norms bit for bit.
numbers() { grep -o '"step": [0-9]*, "\(train\|val\)_loss": [0-9.e+-]*\(, "lr": [0-9.e+-]*, "grad_norm": [0-9.e+-]*\)\?' "$1"; }
for pair in "1 2 coat_s1" "2 4 coat_s2_4"; do
    set -- $pair
    "${mpi[@]}" "$2" ./train_llama "${stage1[@]}" --precision=coat --zero_stage="$1" --param_gather=bf16 --comm_backend=mpi \
        --out_dir="$tmp/$3_bf16" > "$tmp/$3_bf16.out" 2>&1
    check "coat, ZeRO stage $1 on $2 ranks, parameters gathered in bf16: 20 steps" $? "$(tail -5 "$tmp/$3_bf16.out")"
    check "coat, ZeRO stage $1 on $2 ranks: the e4m3 gather's losses and norms equal the bf16 gather's bit for bit" \
        "$(grep -q 'parameters gathered in e4m3' "$tmp/$3.out" && grep -q 'parameters gathered in bf16' "$tmp/$3_bf16.out" &&
           [ "$(numbers "$tmp/$3/log.jsonl" | wc -l)" -ge 22 ] &&
           cmp -s <(numbers "$tmp/$3/log.jsonl") <(numbers "$tmp/$3_bf16/log.jsonl"); echo $?)" \
        "$(diff <(numbers "$tmp/$3/log.jsonl") <(numbers "$tmp/$3_bf16/log.jsonl") | head -4; grep '^ranks' "$tmp/$3.out")"
done
# ZeRO stage 3 gathers the weights stage 2 holds, and reduce-scatters the same gradients (with one
# micro-batch a step, on 4 ranks, straight into a BF16 shard: the same sum as stage 2's FP32 one):
# the same losses and gradient norms bit for bit, in bf16 and coat, on 2 and 4 ranks; and with 4
# layers in a bucket each, which the two gather slots take in turn (each forward and backward
# gathers all but the two buckets the slots hold).
same_numbers() {  # NAME RUN REFERENCE
    check "$1: the losses and norms equal $3's bit for bit" \
        "$([ "$(numbers "$tmp/$2/log.jsonl" | wc -l)" -ge 22 ] && cmp -s <(numbers "$tmp/$2/log.jsonl") <(numbers "$tmp/$3/log.jsonl"); echo $?)" \
        "$(diff <(numbers "$tmp/$2/log.jsonl") <(numbers "$tmp/$3/log.jsonl") | head -4)"
}
for pair in "s3_2 s2_2" "s3_4 s2_4" "coat_s3 coat_s2" "coat_s3_4 coat_s2_4"; do
    set -- $pair
    same_numbers "ZeRO stage 3 ($1) against stage 2" "$1" "$2"
done
ring=("${stage1[@]}" --n_layers=4 --bucket_min_elems=1)
for precision in bf16 coat; do
    for ranks in 2 4; do
        for stage in 2 3; do
            run=ring_${precision}_s${stage}_$ranks
            "${mpi[@]}" $ranks ./train_llama "${ring[@]}" --precision=$precision --zero_stage=$stage --comm_backend=mpi \
                --out_dir="$tmp/$run" > "$tmp/$run.out" 2>&1
            check "$precision, 4 layers, a bucket each, ZeRO stage $stage on $ranks ranks: 20 steps" $? "$(tail -5 "$tmp/$run.out")"
        done
        same_numbers "$precision, 4 buckets of layers through 2 gather slots, $ranks ranks, ZeRO stage 3 against stage 2" \
            "ring_${precision}_s3_$ranks" "ring_${precision}_s2_$ranks"
    done
done
# A bucket per layer (bucket_min_elems = 1; tiny.conf's layers merge into one bucket otherwise):
# stage 2's two bucket buffers in turn over 4 buckets, and the E4M3 gather a layer at a time, which
# still equals the BF16 gather bit for bit.
for gather in e4m3 bf16; do
    "${mpi[@]}" 2 ./train_llama "${stage1[@]}" --precision=coat --zero_stage=2 --bucket_min_elems=1 --param_gather=$gather \
        --comm_backend=mpi --out_dir="$tmp/layers_$gather" > "$tmp/layers_$gather.out" 2>&1
    check "coat, ZeRO stage 2 on 2 ranks, a bucket per layer, $gather gather: 20 steps" $? "$(tail -5 "$tmp/layers_$gather.out")"
done
check_close "coat, ZeRO stage 2, 2 ranks, a bucket per layer against 1 rank" "$tmp/coat_one/log.jsonl" "$tmp/layers_e4m3/log.jsonl"
check "coat, ZeRO stage 2, 2 ranks, a bucket per layer: the e4m3 gather's losses and norms equal the bf16 gather's bit for bit" \
    "$([ "$(numbers "$tmp/layers_e4m3/log.jsonl" | wc -l)" -ge 22 ] &&
       cmp -s <(numbers "$tmp/layers_e4m3/log.jsonl") <(numbers "$tmp/layers_bf16/log.jsonl"); echo $?)" \
    "$(diff <(numbers "$tmp/layers_e4m3/log.jsonl") <(numbers "$tmp/layers_bf16/log.jsonl") | head -4)"
# Sharded checkpoints across world sizes and stages: the step-10 checkpoint of RUN resumed on
# RANKS ranks at STAGE.
for triple in "s1_4 1 1" "s1_4 2 1" "s1_one 4 1" "s2_4 2 2" "s2_2 4 1" "s3_4 1 0" "s3_4 2 0" "s3_4 2 2" "s3_2 4 1" \
              "s2_4 2 3" "s1_one 4 3" "s3_2 4 3"; do
    set -- $triple
    resume_on "$1" "$2" "$tmp/$1-on-$2-stage$3" "${stage1[@]}" --zero_stage="$3"
done
# coat's FP8+DRE states (group scales, k and c) across world sizes and stages too
resume_on coat_s2_4 2 "$tmp/coat_s2_4-on-2-stage1" "${stage1[@]}" --precision=coat --zero_stage=1
resume_on coat_s3_4 2 "$tmp/coat_s3_4-on-2-stage1" "${stage1[@]}" --precision=coat --zero_stage=1
resume_on coat_s3 1 "$tmp/coat_s3-on-1" "${stage1[@]}" --precision=coat
resume_on coat_s1 4 "$tmp/coat_s1-on-4-stage3" "${stage1[@]}" --precision=coat --zero_stage=3
resume_on coat_s1 1 "$tmp/coat_s1-on-1" "${stage1[@]}" --precision=coat
# and across bucketings: a bucket per layer's checkpoint on merged buckets
resume_on layers_e4m3 2 "$tmp/layers_e4m3-merged" "${stage1[@]}" --precision=coat --zero_stage=1

# Per-rank checkpoints (checkpoint_writes = per_rank): 2 ranks at stage 1 in bf16 and at stage 2
# in coat write their parts in parallel and rank 0 a manifest. Training is the rank0 run's bit for
# bit; merged (convert_hf.py merge) each checkpoint is the rank0 run's file byte for byte; resumed
# on 1, 2 and 4 ranks at other stages, each gives the losses of the rank0 file's resume bit for
# bit, and its step-20 checkpoint, written per rank again (1 part on one rank or at stage 0, else
# one per rank), merges to that resume's file. A damaged checkpoint file, or a damaged or missing
# part file, is refused by name before any step, once for both ranks, and both exit non-zero.
# The per-rank step-10 checkpoint of run FROM resumed in DIR on RANKS ranks with the arguments that follow.
resume_parts_on() {
    local from=$1 ranks=$2 dir=$3
    shift 3
    mkdir -p "$dir"
    cp "$tmp/$from"/ckpt_00000010.* "$tmp/$from/log.jsonl" "$dir/"
    if [ "$ranks" = 1 ]; then
        ./train_llama "$@" --out_dir="$dir" --resume=1 > "$dir.out" 2>&1
    else
        "${mpi[@]}" "$ranks" ./train_llama "$@" --comm_backend=mpi --out_dir="$dir" --resume=1 > "$dir.out" 2>&1
    fi
}
for pair in "s1_2 1 bf16" "coat_s2 2 coat"; do
    set -- $pair
    ref=$1 stage=$2 precision=$3 run=parts_$1
    "${mpi[@]}" 2 ./train_llama "${stage1[@]}" --precision="$precision" --zero_stage="$stage" --checkpoint_writes=per_rank \
        --comm_backend=mpi --out_dir="$tmp/$run" > "$tmp/$run.out" 2>&1
    check "$precision, ZeRO stage $stage on 2 ranks, checkpoint_writes = per_rank: 20 steps, each checkpoint a manifest, 2 part files and its marker" \
        "$([ $? -eq 0 ] && [ "$(ls "$tmp/$run"/ckpt_*.done | wc -l)" = 2 ] && [ "$(ls "$tmp/$run"/ckpt_*.rank[01].bin | wc -l)" = 4 ] &&
           ! ls "$tmp/$run"/*.tmp > /dev/null 2>&1; echo $?)" "$(tail -3 "$tmp/$run.out"; ls "$tmp/$run")"
    check "$precision, stage $stage, per-rank checkpoints: the log is the rank0 run's bit for bit" \
        "$([ "$(numbers "$tmp/$run/log.jsonl" | wc -l)" -ge 22 ] && cmp -s <(numbers "$tmp/$ref/log.jsonl") <(numbers "$tmp/$run/log.jsonl");
           echo $?)" "$(diff <(numbers "$tmp/$ref/log.jsonl") <(numbers "$tmp/$run/log.jsonl") | head -4)"
    for step in 10 20; do
        name=$(printf 'ckpt_%08d' $step)
        out=$(python3 scripts/convert_hf.py merge "$tmp/$run/$name.bin" "$tmp/$run-$step.merged" 2>&1)
        check "$precision, stage $stage: the per-rank step-$step checkpoint merged is the rank0 run's file byte for byte" \
            "$(cmp -s "$tmp/$run-$step.merged" "$tmp/$ref/$name.bin"; echo $?)" "$out $(cmp "$tmp/$run-$step.merged" "$tmp/$ref/$name.bin" 2>&1)"
    done
done
for triple in "s1_2 1 1 bf16" "s1_2 2 0 bf16" "s1_2 4 2 bf16" "coat_s2 1 1 coat" "coat_s2 2 1 coat" "coat_s2 4 2 coat"; do
    set -- $triple
    from=$1 ranks=$2 stage=$3 precision=$4
    args=("${stage1[@]}" --precision="$precision" --zero_stage="$stage")
    resume_on "$from" "$ranks" "$tmp/$from-one-on-$ranks-stage$stage" "${args[@]}"
    resume_parts_on "parts_$from" "$ranks" "$tmp/parts_$from-on-$ranks-stage$stage" "${args[@]}" --checkpoint_writes=per_rank
    dir=$tmp/parts_$from-on-$ranks-stage$stage one=$tmp/$from-one-on-$ranks-stage$stage
    check "the per-rank step-10 checkpoint ($precision, 2 ranks) on $ranks rank(s) at stage $stage: the losses of the one file's resume, bit for bit" \
        "$([ "$(numbers "$dir/log.jsonl" | wc -l)" -ge 22 ] && cmp -s <(numbers "$one/log.jsonl") <(numbers "$dir/log.jsonl"); echo $?)" \
        "$(tail -2 "$dir.out"; diff <(numbers "$one/log.jsonl") <(numbers "$dir/log.jsonl") | head -4)"
    parts=$([ "$ranks" = 1 ] || [ "$stage" = 0 ] && echo 1 || echo "$ranks")
    out=$(python3 scripts/convert_hf.py merge "$dir/ckpt_00000020.bin" "$dir-20.merged" 2>&1)
    check "$precision, resumed on $ranks rank(s) at stage $stage: its step-20 checkpoint in $parts part file(s) merges to the one file's resume's, byte for byte" \
        "$([ "$(ls "$dir"/ckpt_00000020.rank*.bin | wc -l)" = "$parts" ] && cmp -s "$dir-20.merged" "$one/ckpt_00000020.bin"; echo $?)" "$out"
done
# refused_once RC LOG PATTERN: a multi-rank start that failed (not by the timeout) with one error
# line, matching PATTERN, and no step.
refused_once() {
    [ "$1" -ne 0 ] && [ "$1" -ne 124 ] && [ "$(grep -c '^error' "$2")" = 1 ] && grep -q "$3" "$2" && ! grep -q '^step ' "$2"
}
mkdir -p "$tmp/one_damaged"
cp "$tmp/s1_2"/ckpt_00000010.bin "$tmp/s1_2"/ckpt_00000010.done "$tmp/s1_2/log.jsonl" "$tmp/one_damaged/"
size=$(stat -c %s "$tmp/one_damaged/ckpt_00000010.bin")
printf '\x01' | dd of="$tmp/one_damaged/ckpt_00000010.bin" bs=1 seek=$((size - 100)) conv=notrunc status=none
"${mpi[@]}" 2 ./train_llama "${stage1[@]}" --comm_backend=mpi --out_dir="$tmp/one_damaged" --resume=1 > "$tmp/one_damaged.log" 2>&1
rc=$?
check "a damaged checkpoint file (its optimizer state, checked by rank 0 alone) is refused on 2 ranks, once, before any step" \
    "$(refused_once $rc "$tmp/one_damaged.log" "^error: $tmp/one_damaged/ckpt_00000010.bin: the optimizer state section fails its checksum"; echo $?)" \
    "$(grep -v '^ *$' "$tmp/one_damaged.log" | head -3)"
mkdir -p "$tmp/parts_damaged"
cp "$tmp/parts_s1_2"/ckpt_00000010.* "$tmp/parts_s1_2/log.jsonl" "$tmp/parts_damaged/"
printf '\x01' | dd of="$tmp/parts_damaged/ckpt_00000010.rank1.bin" bs=1 seek=100000 conv=notrunc status=none
"${mpi[@]}" 2 ./train_llama "${stage1[@]}" --comm_backend=mpi --out_dir="$tmp/parts_damaged" --resume=1 > "$tmp/parts_damaged.log" 2>&1
rc=$?
check "a damaged part file is refused on 2 ranks, once, naming it, before any step" \
    "$(refused_once $rc "$tmp/parts_damaged.log" "^error: rank 1: $tmp/parts_damaged/ckpt_00000010.rank1.bin: fails its checksum"; echo $?)" \
    "$(grep -v '^ *$' "$tmp/parts_damaged.log" | head -3)"
rm "$tmp/parts_damaged/ckpt_00000010.rank1.bin"
./train_llama "${stage1[@]}" --out_dir="$tmp/parts_damaged" --resume=1 > "$tmp/parts_missing.log" 2>&1
rc=$?
check "a missing part file is refused by name before any step" \
    "$([ $rc -ne 0 ] && grep -q "^error: $tmp/parts_damaged/ckpt_00000010.rank1.bin: missing (part 1 of 2 of $tmp/parts_damaged/ckpt_00000010.bin)" \
       "$tmp/parts_missing.log" && ! grep -q '^step ' "$tmp/parts_missing.log"; echo $?)" "$(tail -2 "$tmp/parts_missing.log")"

# Hybrid sharding (shard_group = 2): 4 ranks in 2 groups of 2, each group sharding as 2 flat ranks
# would and summing each gradient part across the groups, against 4 flat ranks and 1 rank at the
# same global batch, in bf16 and coat at stages 1 to 3: losses within the BF16 reduction-order
# noise (the groups' sums are added in another order); the first step's gradient norm, taken
# before any update could let the runs drift apart, within 1e-3 of the flat run's (each shard
# counted once, not once per group); every later one within 1%, or within twice the spread that
# the reduction order alone makes between 4 flat ranks and 1 rank (coat's FP8 casts amplify it);
# stage 3 equals stage 2 bit for bit as on flat ranks. Only the first group writes checkpoints
# (rank 0 the file, or ranks 0 and 1 their part files: the rank0 run's log bit for bit, merged its
# file byte for byte); a 2 x 2 checkpoint resumes on 1 and 4 flat ranks, a flat one on 2 x 2, each
# following the run it came from.
norms() { grep -o '"step": [0-9]*, "train_loss": [0-9.e+-]*, "lr": [0-9.e+-]*, "grad_norm": [0-9.e+-]*' "$1" | sed 's/.*"grad_norm": //'; }
norm_spread() {  # RUN REFERENCE: "largest relative difference of the steps' norms, count, first step's"
    paste <(norms "$tmp/$1/log.jsonl") <(norms "$tmp/$2/log.jsonl") |
        awk 'NF == 2 { d = ($1 - $2) / $2; if (d < 0) d = -d; if (d > w) w = d; if (n == 0) f = d; n++ } END { printf "%.2e %d %.2e", w, n, f }'
}
close_norms() {  # NAME RUN FLAT ONE
    local spread floor
    read -r -a spread <<< "$(norm_spread "$2" "$3")"
    read -r -a floor <<< "$(norm_spread "$3" "$4")"
    echo "$1: gradient norms: largest relative difference ${spread[0]} over ${spread[1]} steps, first step ${spread[2]}; 4 flat against 1: ${floor[0]}"
    check "$1: the first step's gradient norm within 1e-3 (${spread[2]}), each of 20 within 1% or twice the 4-flat-against-1 spread (${spread[0]}; ${floor[0]})" \
        "$([ "${spread[1]}" = 20 ] && awk -v w="${spread[0]}" -v f="${spread[2]}" -v n="${floor[0]}" \
               'BEGIN { exit !(f < 1e-3 && (w < 0.01 || w < 2 * n)) }'; echo $?)" "${spread[*]}; ${floor[*]}"
}
for precision in bf16 coat; do
    one=$([ $precision = bf16 ] && echo s1_one || echo coat_one)
    for stage in 1 2 3; do
        run=hybrid_${precision}_s$stage flat=$([ $precision = bf16 ] && echo "s${stage}_4" || echo "coat_s${stage}_4")
        "${mpi[@]}" 4 ./train_llama "${stage1[@]}" --precision=$precision --zero_stage=$stage --shard_group=2 --comm_backend=mpi \
            --out_dir="$tmp/$run" > "$tmp/$run.out" 2>&1
        check "$precision, ZeRO stage $stage, 4 ranks in 2 groups of 2: 20 steps, checkpoints written by rank 0" \
            "$([ $? -eq 0 ] && grep -q "^ranks: 4 (comm_backend mpi, ZeRO stage $stage, sharded within 2 groups of 2 ranks" "$tmp/$run.out" &&
               [ "$(ls "$tmp/$run"/ckpt_*.done | wc -l)" = 2 ]; echo $?)" "$(tail -5 "$tmp/$run.out")"
        check_close "$precision, ZeRO stage $stage, 2 x 2 ranks against 1" "$tmp/$one/log.jsonl" "$tmp/$run/log.jsonl"
        check_close "$precision, ZeRO stage $stage, 2 x 2 ranks against 4 flat" "$tmp/$flat/log.jsonl" "$tmp/$run/log.jsonl"
        close_norms "$precision, ZeRO stage $stage, 2 x 2 ranks against 4 flat" "$run" "$flat" "$one"
    done
    same_numbers "$precision, 2 x 2 ranks, ZeRO stage 3 against stage 2" "hybrid_${precision}_s3" "hybrid_${precision}_s2"
done
"${mpi[@]}" 4 ./train_llama "${stage1[@]}" --shard_group=2 --checkpoint_writes=per_rank --comm_backend=mpi \
    --out_dir="$tmp/hybrid_parts" > "$tmp/hybrid_parts.out" 2>&1
check "bf16, ZeRO stage 1, 2 x 2 ranks, checkpoint_writes = per_rank: 20 steps, each checkpoint a manifest and the first group's 2 part files" \
    "$([ $? -eq 0 ] && [ "$(ls "$tmp/hybrid_parts"/ckpt_*.done | wc -l)" = 2 ] && [ "$(ls "$tmp/hybrid_parts"/ckpt_*.rank*.bin | wc -l)" = 4 ] &&
       [ "$(ls "$tmp/hybrid_parts"/ckpt_*.rank[01].bin | wc -l)" = 4 ]; echo $?)" "$(tail -3 "$tmp/hybrid_parts.out"; ls "$tmp/hybrid_parts")"
same_numbers "bf16, 2 x 2 ranks, per-rank checkpoints against rank 0's file" hybrid_parts hybrid_bf16_s1
out=$(python3 scripts/convert_hf.py merge "$tmp/hybrid_parts/ckpt_00000020.bin" "$tmp/hybrid_parts-20.merged" 2>&1)
check "bf16, 2 x 2 ranks: the per-rank step-20 checkpoint merged is rank 0's file byte for byte" \
    "$(cmp -s "$tmp/hybrid_parts-20.merged" "$tmp/hybrid_bf16_s1/ckpt_00000020.bin"; echo $?)" "$out"
resume_on hybrid_bf16_s1 1 "$tmp/hybrid_bf16_s1-on-1" "${stage1[@]}"
resume_on hybrid_bf16_s2 4 "$tmp/hybrid_bf16_s2-on-4-flat" "${stage1[@]}" --zero_stage=2
resume_on s1_4 4 "$tmp/s1_4-on-2x2" "${stage1[@]}" --zero_stage=1 --shard_group=2
resume_on hybrid_coat_s3 1 "$tmp/hybrid_coat_s3-on-1" "${stage1[@]}" --precision=coat
resume_on hybrid_coat_s1 4 "$tmp/hybrid_coat_s1-on-4-flat" "${stage1[@]}" --precision=coat --zero_stage=3
resume_on coat_s2_4 4 "$tmp/coat_s2_4-on-2x2" "${stage1[@]}" --precision=coat --zero_stage=2 --shard_group=2
resume_on hybrid_bf16_s2 4 "$tmp/hybrid_bf16_s2-on-2x2" "${stage1[@]}" --zero_stage=2 --shard_group=2
same_numbers "bf16, ZeRO stage 2, a 2 x 2 checkpoint resumed on 2 x 2" hybrid_bf16_s2-on-2x2 hybrid_bf16_s2
resume_on hybrid_coat_s3 4 "$tmp/hybrid_coat_s3-on-2x2" "${stage1[@]}" --precision=coat --zero_stage=3 --shard_group=2
same_numbers "coat, ZeRO stage 3, a 2 x 2 checkpoint resumed on 2 x 2" hybrid_coat_s3-on-2x2 hybrid_coat_s3

# NCCL refuses two ranks on one GPU, and so does the trainer before it: the ranks compare their
# GPUs' UUIDs. (Logs of refused runs are *.log: the allocation check below reads every *.out.)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if grep -qa ncclCommInitRank ./train_llama; then
    visible=()
    [ "$gpus" -ge 2 ] && visible=(env CUDA_VISIBLE_DEVICES=0)  # all ranks on GPU 0
    "${mpi[@]}" 2 "${visible[@]}" ./train_llama "${common[@]}" --comm_backend=nccl --out_dir="$tmp/nccl_shared" \
        > "$tmp/nccl_shared.log" 2>&1
    rc=$?
    uuid=$(grep -o 'ranks 0 and 1 drive the same GPU (GPU-[0-9a-f-]* in nvidia-smi -L)' "$tmp/nccl_shared.log" | grep -o 'GPU-[0-9a-f-]*' | head -1)
    check "two NCCL ranks on one GPU are refused, naming both ranks and the GPU's UUID (${uuid:-none})" \
        "$([ $rc -ne 0 ] && [ ${#uuid} -eq 40 ] && nvidia-smi -L | grep -q "(UUID: $uuid)" &&
           [ ! -e "$tmp/nccl_shared/log.jsonl" ]; echo $?)" "$(tail -3 "$tmp/nccl_shared.log")"
fi
# With several GPUs, one rank per GPU over NCCL against one rank: a launch that gives each rank one
# GPU through CUDA_VISIBLE_DEVICES (every rank sees its GPU as 0); stages 0 to 3 in bf16 and coat
# on 2 and 4 GPUs under mpirun, stage 3 bit for bit as stage 2; 2 ranks started as torchrun starts
# them (RANK, WORLD_SIZE, LOCAL_RANK, meeting over TCP at MASTER_ADDR:MASTER_PORT, no MPI); and on
# 4 GPUs hybrid sharding in 2 groups of 2 against 4 flat ranks.
if grep -qa ncclCommInitRank ./train_llama && [ "$gpus" -ge 2 ]; then
    "${mpi[@]}" 2 bash -c 'CUDA_VISIBLE_DEVICES=$OMPI_COMM_WORLD_LOCAL_RANK exec "$@"' rank ./train_llama "${stage1[@]}" \
        --comm_backend=nccl --out_dir="$tmp/nccl_visible" > "$tmp/nccl_visible.out" 2>&1
    check "NCCL, 2 ranks each seeing only its own GPU (CUDA_VISIBLE_DEVICES per rank): 20 steps" $? "$(tail -5 "$tmp/nccl_visible.out")"
    check_close "NCCL, 2 ranks each seeing only its own GPU, against 1" "$tmp/s1_one/log.jsonl" "$tmp/nccl_visible/log.jsonl"
    for ranks in 2 4; do
        [ "$gpus" -ge $ranks ] || continue
        for precision in bf16 coat; do
            one=$([ $precision = bf16 ] && echo s1_one || echo coat_one)
            for stage in 0 1 2 3; do
                dir=nccl_s${stage}_${precision}_$ranks
                "${mpi[@]}" $ranks ./train_llama "${stage1[@]}" --zero_stage=$stage --precision=$precision --comm_backend=nccl \
                    --out_dir="$tmp/$dir" > "$tmp/$dir.out" 2>&1
                check "NCCL, ZeRO stage $stage, $precision, $ranks ranks on $ranks GPUs: 20 steps" $? "$(tail -5 "$tmp/$dir.out")"
                check_close "NCCL, ZeRO stage $stage, $precision, $ranks ranks against 1" "$tmp/$one/log.jsonl" "$tmp/$dir/log.jsonl"
            done
            same_numbers "NCCL, $precision, $ranks ranks, ZeRO stage 3 against stage 2" "nccl_s3_${precision}_$ranks" \
                "nccl_s2_${precision}_$ranks"
        done
    done
    port=$((20000 + RANDOM % 20000)) pids=()
    for rank in 1 0; do  # rank 0's output is the run's .out (the allocation check below reads it)
        log="$tmp/nccl_torchrun.rank$rank.log"
        [ $rank -eq 0 ] && log="$tmp/nccl_torchrun.out"
        env -u OMPI_COMM_WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_LOCAL_RANK MASTER_ADDR=127.0.0.1 \
            MASTER_PORT=$port WORLD_SIZE=2 RANK=$rank LOCAL_RANK=$rank timeout 300 ./train_llama "${stage1[@]}" \
            --comm_backend=nccl --out_dir="$tmp/nccl_torchrun" > "$log" 2>&1 &
        pids+=($!)
    done
    wait "${pids[0]}"; rc1=$?
    wait "${pids[1]}"; rc0=$?
    check "NCCL, 2 ranks started as torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK; TCP rendezvous): 20 steps" \
        "$([ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && grep -q '^ranks: 2 ' "$tmp/nccl_torchrun.out"; echo $?)" \
        "rank 0 exit $rc0, rank 1 exit $rc1: $(tail -3 "$tmp/nccl_torchrun.out")"
    check_close "NCCL, 2 torchrun-style ranks against 1" "$tmp/s1_one/log.jsonl" "$tmp/nccl_torchrun/log.jsonl"
    if [ "$gpus" -ge 4 ]; then
        for stage in 1 3; do
            dir=nccl_hybrid_s$stage
            "${mpi[@]}" 4 ./train_llama "${stage1[@]}" --zero_stage=$stage --precision=coat --shard_group=2 --comm_backend=nccl \
                --out_dir="$tmp/$dir" > "$tmp/$dir.out" 2>&1
            check "NCCL, coat, ZeRO stage $stage, 4 GPUs in 2 groups of 2: 20 steps" $? "$(tail -5 "$tmp/$dir.out")"
            check_close "NCCL, coat, ZeRO stage $stage, 2 x 2 GPUs against 4 flat" "$tmp/nccl_s${stage}_coat_4/log.jsonl" \
                "$tmp/$dir/log.jsonl"
        done
    fi
fi
if grep -qa ncclCommInitRank ./train_llama; then
    "${mpi[@]}" 1 ./train_llama "${common[@]}" --comm_backend=nccl --out_dir="$tmp/nccl1" > "$tmp/nccl1.out" 2>&1
    check "one rank under mpirun (nccl) logs the plain run's losses bit for bit" \
        "$([ $? -eq 0 ] && cmp -s <(grep -o '"step": [0-9]*, "\(train\|val\)_loss": [0-9.]*' "$tmp/one/log.jsonl") \
                             <(grep -o '"step": [0-9]*, "\(train\|val\)_loss": [0-9.]*' "$tmp/nccl1/log.jsonl"); echo $?)" \
        "$(tail -3 "$tmp/nccl1.out")"
fi

# One rank's stop signal stops every rank: SIGUSR1 (a scheduler's warning) to rank 1 alone of 2
# (ZeRO stage 1). Both stop at one step boundary, rank 0 writes that step's checkpoint and says
# why, mpirun exits 75; resumed on 2 ranks, the run logs the undisturbed run's numbers bit for bit.
long=("${stage1[@]}" --max_steps=200 --checkpoint_every=0 --comm_backend=mpi)
"${mpi[@]}" 2 ./train_llama "${long[@]}" --out_dir="$tmp/stop_ref" > "$tmp/stop_ref.out" 2>&1
check "2 ranks, 200 steps undisturbed" $? "$(tail -3 "$tmp/stop_ref.out")"
"${mpi[@]}" 2 ./train_llama "${long[@]}" --out_dir="$tmp/stop" > "$tmp/stop.out" 2>&1 &
launcher=$! rank1=""
while kill -0 $launcher 2>/dev/null && [ "$(grep -c '^step  *[0-9]*/' "$tmp/stop.out")" -lt 6 ]; do sleep 0.01; done
for pid in $(pgrep -f "out_dir=$tmp/stop\$"); do  # the rank whose environment says rank 1
    tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx 'OMPI_COMM_WORLD_RANK=1' && rank1=$pid
done
[ -n "$rank1" ] && kill -USR1 "$rank1"
{ wait $launcher; } 2> /dev/null
rc=$?
stopped=$(sed -n "s/^step \([0-9]*\): stopped by another rank's signal with its checkpoint written (exit 75).*/\1/p" "$tmp/stop.out")
check "SIGUSR1 to rank 1 alone stops both ranks at step ${stopped:-none} with rank 0's checkpoint, exit 75" \
    "$([ -n "$rank1" ] && [ $rc -eq 75 ] && [ -n "$stopped" ] && [ "$stopped" -lt 200 ] &&
       [ -e "$tmp/stop/$(printf 'ckpt_%08d' "$stopped").done" ]; echo $?)" "rank 1 pid ${rank1:-not found}, exit $rc: $(tail -4 "$tmp/stop.out")"
"${mpi[@]}" 2 ./train_llama "${long[@]}" --out_dir="$tmp/stop" --resume=1 > "$tmp/stop-resumed.out" 2>&1
check "the stopped 2-rank run resumes to its end" $? "$(tail -3 "$tmp/stop-resumed.out")"
check "stopped by one rank's signal and resumed, the 2-rank log equals the undisturbed run's" \
    "$(diff <(numbers "$tmp/stop_ref/log.jsonl") <(numbers "$tmp/stop/log.jsonl") > "$tmp/stop.diff"; echo $?)" "$(head -6 "$tmp/stop.diff")"

# Every run above, 1 to 4 ranks at stages 0 to 3, bf16 and coat: each rank allocated its memory plan.
outs=("$tmp"/*.out)
matched=$(grep -lE "^GPU memory allocated: [0-9.]* GiB per rank, each rank's plan byte for byte( \(with [^)]*\))*$" "${outs[@]}" | wc -l)
check "each of the ${#outs[@]} runs allocated every rank's memory plan byte for byte" "$([ "$matched" = "${#outs[@]}" ]; echo $?)" \
    "$(grep -h 'GPU memory allocated\|allocated .* bytes on the GPU' "${outs[@]}" | sort | uniq -c | head -5)"

check_summary test_distributed
