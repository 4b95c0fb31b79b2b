#!/usr/bin/env bash
# The trainer end to end on the GPU, on random-token shards. Bit-exact resume in bf16, fp8 and
# coat (and with shuffle = rows): 20 steps straight, against 10 steps + resume + 10 steps from the step-10 checkpoint; every
# logged loss must match to the last digit; fp8 and coat end near bf16. Also: the run's validation loss falls, a corrupt checkpoint is refused with
# its name, a micro-batch that does not fit is refused, and profile = 1 prints per-op times that
# add up to the measured step time, beside speeds of light that no op beats.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

write_pattern_shards "$tmp" 1 200000 20000
common=(configs/models/tiny.conf --train_data="$tmp/train_*.bin" --val_data="$tmp/val_*.bin" --micro_batch_size=4
        --seq_len=64 --max_steps=20 --warmup_steps=5 --learning_rate=3e-3 --val_every=5 --val_batches=4
        --checkpoint_every=10 --checkpoints_keep=5)
losses() { grep -o '"step": [0-9]*, "\(train\|val\)_loss": [0-9.]*' "$1"; }
# Every precision (and BF16 GEMMs over COAT's activations and optimizer, and bf16 with the
# training order over rows): 20 steps straight against 10 + resume + 10, bit for bit; the loss falls.
for precision in bf16 fp8 coat bf16-gemms-coat-activations bf16-shuffle-rows; do
    run=(--precision=$precision)
    [ "$precision" = bf16-gemms-coat-activations ] && run=(--precision=bf16 --activations=coat --optimizer_states=fp8_dre)
    [ "$precision" = bf16-shuffle-rows ] && run=(--precision=bf16 --shuffle=rows)
    # out_dir's parent does not exist yet: it is created like mkdir -p.
    ./train_llama "${common[@]}" "${run[@]}" --out_dir="$tmp/runs/straight-$precision" > "$tmp/straight.out" 2>&1
    check "$precision: 20 steps straight run" $? "$(tail -3 "$tmp/straight.out")"
    mkdir -p "$tmp/resumed-$precision"
    cp "$tmp/runs/straight-$precision/ckpt_00000010.bin" "$tmp/runs/straight-$precision/ckpt_00000010.done" \
        "$tmp/resumed-$precision/" 2>/dev/null
    # The whole 20-step log: resuming must drop the records past step 10 itself.
    cp "$tmp/runs/straight-$precision/log.jsonl" "$tmp/resumed-$precision/log.jsonl"
    ./train_llama "${common[@]}" "${run[@]}" --out_dir="$tmp/resumed-$precision" --resume=1 > "$tmp/resumed.out" 2>&1
    check "$precision: resume from the step-10 checkpoint runs" $? "$(tail -3 "$tmp/resumed.out")"
    check "$precision: 10 + resume + 10 steps log the same losses as 20 straight, to the bit" \
        "$(diff <(losses "$tmp/runs/straight-$precision/log.jsonl") <(losses "$tmp/resumed-$precision/log.jsonl") > "$tmp/diff"; echo $?)" \
        "$(head -4 "$tmp/diff")"
    check "$precision: the resumed run ends with the same checkpoint bytes" \
        "$(cmp -s "$tmp/runs/straight-$precision/ckpt_00000020.bin" "$tmp/resumed-$precision/ckpt_00000020.bin"; echo $?)"
    first=$(grep -o '"val_loss": [0-9.]*' "$tmp/runs/straight-$precision/log.jsonl" | head -1 | cut -d' ' -f2)
    last=$(grep -o '"val_loss": [0-9.]*' "$tmp/runs/straight-$precision/log.jsonl" | tail -1 | cut -d' ' -f2)
    check "$precision: validation loss falls ($first -> $last)" "$(awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a - 0.5) }'; echo $?)"
done
# fp8 and coat cast the E4M3 weights from the FP32 master weights and keep no BF16 copy of the
# block's linear weights; param_gather = bf16 keeps the copy and casts it: the same codes, so the
# same losses to the bit.
for precision in fp8 coat; do
    ./train_llama "${common[@]}" --precision=$precision --param_gather=bf16 --out_dir="$tmp/runs/copy-$precision" > "$tmp/copy.out" 2>&1
    check "$precision with a BF16 copy of the block weights (param_gather = bf16): 20 steps" $? "$(tail -3 "$tmp/copy.out")"
    check "$precision: the weights cast from the master weights log the same losses as those cast from the BF16 copy, to the bit" \
        "$(diff <(losses "$tmp/runs/straight-$precision/log.jsonl") <(losses "$tmp/runs/copy-$precision/log.jsonl") > "$tmp/diff"; echo $?)" \
        "$(head -4 "$tmp/diff")"
done
# The FP8 modes follow bf16 closely on this short run: final validation losses within 2%.
bf16_last=$(grep -o '"val_loss": [0-9.]*' "$tmp/runs/straight-bf16/log.jsonl" | tail -1 | cut -d' ' -f2)
for precision in fp8 coat bf16-gemms-coat-activations; do
    last=$(grep -o '"val_loss": [0-9.]*' "$tmp/runs/straight-$precision/log.jsonl" | tail -1 | cut -d' ' -f2)
    check "$precision: final validation loss $last within 2% of bf16's $bf16_last" \
        "$(awk -v a="$bf16_last" -v b="$last" 'BEGIN { d = (b - a) / a; exit !(d < 0.02 && d > -0.02) }'; echo $?)"
done

# Non-finite steps: weights with NaN in them give a NaN loss every step; each step is skipped and
# logged, and the run stops after max_nonfinite_steps of them in a row.
python3 - "$tmp/runs/straight-bf16/ckpt_00000020.bin" "$tmp/nan.bin" <<'PY'
import struct, sys, zlib
sys.path.insert(0, "scripts")
from llama_layout import CHECKPOINT_HEADER_BYTES, pack_checkpoint_header, unpack_checkpoint_header
data = bytearray(open(sys.argv[1], "rb").read())
start = CHECKPOINT_HEADER_BYTES
data[start:start + 4 * 4096] = struct.pack("<f", float("nan")) * 4096  # the first embedding rows
header = unpack_checkpoint_header(bytes(data), sys.argv[1])  # a well-formed file: the weights' checksum follows them
header.crc = (zlib.crc32(data[start:start + 4 * header.total_padded]),) + header.crc[1:]
data[:start] = pack_checkpoint_header(header)
open(sys.argv[2], "wb").write(data)
PY
out=$(./train_llama "${common[@]}" --precision=coat --out_dir="$tmp/nan" --init_from="$tmp/nan.bin" --max_nonfinite_steps=2 2>&1); rc=$?
check "NaN losses: the steps are skipped, then the run stops after max_nonfinite_steps" \
    "$([ $rc -ne 0 ] && [ "$(printf '%s' "$out" | grep -c 'optimizer step skipped')" = 2 ] &&
       printf '%s' "$out" | grep -q '2 steps in a row with a non-finite' && [ "$(grep -c '"skipped"' "$tmp/nan/log.jsonl")" = 2 ]; echo $?)" \
    "$(printf '%s' "$out" | tail -3)"

out=$(./train_llama "${common[@]}" --out_dir="$tmp/no_final" --max_steps=2 --warmup_steps=1 --val_every=0 --checkpoint_final=0 2>&1); rc=$?
check "checkpoint_final = 0 writes no checkpoint" "$([ $rc -eq 0 ] && [ -z "$(ls "$tmp/no_final" | grep ckpt_)" ]; echo $?)" "$(ls "$tmp/no_final")"

# overwrite = 1 over a finished run: its checkpoints and log go, the new run's stay.
out=$(./train_llama "${common[@]}" --out_dir="$tmp/runs/straight-fp8" --overwrite=1 --max_steps=2 --warmup_steps=1 --val_every=0 2>&1); rc=$?
check "overwrite = 1 removes the earlier run and starts over" \
    "$([ $rc -eq 0 ] && [ ! -e "$tmp/runs/straight-fp8/ckpt_00000020.bin" ] && [ -e "$tmp/runs/straight-fp8/ckpt_00000002.bin" ] &&
       [ "$(grep -c '"train_loss"' "$tmp/runs/straight-fp8/log.jsonl")" = 2 ]; echo $?)" "$(printf '%s' "$out" | tail -2)"

head -c 100000 "$tmp/runs/straight-bf16/ckpt_00000020.bin" > "$tmp/cut.bin"
out=$(./train_llama "${common[@]}" --out_dir="$tmp/cut" --init_from="$tmp/cut.bin" 2>&1); rc=$?
check "a truncated checkpoint is refused, naming the file" \
    "$([ $rc -ne 0 ] && printf '%s' "$out" | grep -q "$tmp/cut.bin: size"; echo $?)" "$(printf '%s' "$out" | tail -1)"
# llama3-8b in bf16 at 16 x 2048 (bf16 fits one row of 2048 on a free 141 GB GPU; on a GPU that
# another process shares, none may fit, and the refusal says so); the shard holds the batch.
out=$(./train_llama configs/models/llama3-8b.conf --train_data="$tmp/train_*.bin" --micro_batch_size=16 --seq_len=2048 \
      --max_steps=1 --warmup_steps=1 --val_every=0 --out_dir="$tmp/big" 2>&1); rc=$?
check "a micro-batch that does not fit is refused, naming the largest that does" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -Eq 'the largest that fits is|not even micro_batch_size 1 fits'; echo $?)" "$(printf '%s' "$out" | tail -1)"

# profile = 1: the ops' times per step add up to the logged step time (the same events bound
# both), each layer's attention runs once forward and once backward per micro-batch, and every
# op with a speed of light (the last two columns) takes at least that long.
./train_llama "${common[@]}" --out_dir="$tmp/profile" --profile=1 > "$tmp/profile.out" 2>&1
check "profile = 1 runs" $? "$(tail -3 "$tmp/profile.out")"
total=$(awk '/^profile:/ { section = 1 } section && $1 == "total" { print $2 }' "$tmp/profile.out")
mean=$(grep -o '"ms": [0-9.]*' "$tmp/profile/log.jsonl" | tail -n +2 | awk '{ sum += $2; n++ } END { if (n) print sum / n }')
check "profile: the ops add up to the mean step time ($total ms against $mean ms)" \
    "$(awk -v a="$total" -v b="$mean" 'BEGIN { exit !(a > 0 && b > 0 && a / b > 0.95 && a / b < 1.05) }'; echo $?)" \
    "$(grep -A3 '^profile:' "$tmp/profile.out")"
check "profile: attention forward and backward run once per layer and micro-batch" \
    "$(awk '/^  attention (forward|backward) / { if ($(NF - 4) != 2.0) bad = 1; n++ } END { exit !(n == 2 && !bad) }' "$tmp/profile.out"; echo $?)" \
    "$(grep '^  attention' "$tmp/profile.out")"
check "profile: every GEMM has a speed of light, and no op runs faster than its own" \
    "$(awk '/^profile:/ { section = 1 } section && /^  / && $1 != "op" && $1 != "total" && $NF != "-" { if ($NF + 0 < 1) bad = 1 }
            section && /^  matmul / { if ($NF == "-") bad = 1; n++ } END { exit !(n > 0 && !bad) }' "$tmp/profile.out"; echo $?)" \
    "$(sed -n '/^profile:/,$p' "$tmp/profile.out")"

check_summary test_train
