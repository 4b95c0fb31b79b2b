#!/usr/bin/env bash
# Crash consistency on the GPU: a coat run killed with SIGKILL again and again (at random moments,
# and while a checkpoint is being written), resumed each time, ends with the same log (every
# loss, learning rate and gradient norm) and the same final checkpoint, byte for byte, as the same
# run left alone, and its stdout, redirected to a file, keeps the step lines printed before each
# kill. llama-125m at 2 x 128 tokens a step: its checkpoints (about 0.8 GB) take long enough to
# write that a kill can be aimed inside one.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'kill -9 $pid 2>/dev/null; rm -rf "$tmp"' EXIT

write_pattern_shards "$tmp" 2 100000 4000
steps=24
common=(configs/models/llama-125m.conf --precision=coat --train_data="$tmp/train_*.bin" --val_data="$tmp/val_*.bin"
        --micro_batch_size=2 --seq_len=128 --max_steps=$steps --warmup_steps=4 --val_every=8 --val_batches=2
        --checkpoint_every=4 --checkpoints_keep=2)
# What a run computes; timings and memory differ between runs.
numbers() { sed 's/, "ms": [^,]*, "tokens": [^,]*, "tokens_per_s": [^,]*, "mfu": [^,]*, "gpu_mem_gib": [^}]*//' "$1"; }

./train_llama "${common[@]}" --out_dir="$tmp/alone" > "$tmp/alone.out" 2>&1
check "the run left alone completes" $? "$(tail -3 "$tmp/alone.out")"

# Kill, resume, repeat: odd attempts are killed as soon as a checkpoint file is being written
# (its .bin.tmp exists), even ones at a random moment of training; the last attempt runs to the end.
dir=$tmp/crashed
mkdir -p "$dir"
RANDOM=7
# stdout goes to a file, as under a scheduler: the step lines printed before a kill must be there
# (line-buffered), among them the step whose checkpoint was being written.
kills_in_write=0 kills_elsewhere=0 attempts=0 finished=1 lines_kept=0 lines_lost=0
for attempt in 1 2 3 4 5 6 7 8 9 10 11 12; do
    attempts=$attempt
    continue=(--overwrite=1)
    ls "$dir"/ckpt_*.done > /dev/null 2>&1 && continue=(--resume=1)
    touch "$tmp/started"  # a .bin.tmp left by an earlier kill counts once this attempt writes it again
    ./train_llama "${common[@]}" --out_dir="$dir" "${continue[@]}" > "$tmp/attempt$attempt.out" 2>&1 &
    pid=$!
    if [ "$attempt" -lt 12 ]; then
        if [ $((attempt % 2)) -eq 1 ]; then
            writing=""
            while kill -0 $pid 2>/dev/null; do
                writing=$(find "$dir" -name '*.bin.tmp' -newer "$tmp/started" 2>/dev/null | head -1)
                [ -n "$writing" ] && break
                sleep 0.01
            done
            if [ -n "$writing" ] && kill -9 $pid 2>/dev/null; then
                kills_in_write=$((kills_in_write + 1))
                step=$(basename "$writing" | sed 's/^ckpt_0*\([0-9][0-9]*\)\.bin\.tmp$/\1/')
                if grep -Eq "^step +$step/$steps " "$tmp/attempt$attempt.out"; then lines_kept=$((lines_kept + 1)); else lines_lost=$((lines_lost + 1)); fi
            fi
        else
            # after 1-6 new step lines and 0-40 ms more: inside a step or a checkpoint write, however
            # fast this machine's disk writes them
            lines=$((RANDOM % 6 + 1)) pause=$((RANDOM % 5))
            while kill -0 $pid 2>/dev/null && [ "$(grep -c '^step ' "$tmp/attempt$attempt.out")" -lt "$lines" ]; do sleep 0.01; done
            sleep "0.0$pause"
            kill -0 $pid 2>/dev/null && kill -9 $pid 2>/dev/null && kills_elsewhere=$((kills_elsewhere + 1))
        fi
    fi
    { wait $pid; } 2> /dev/null  # (without the shell's "Killed" line)
    finished=$?
    cat "$tmp/attempt$attempt.out" >> "$tmp/crashed.out"
    [ "$finished" -eq 0 ] && break
done
check "the killed run resumes to its end ($attempts attempts: $kills_in_write kills while writing a checkpoint, $kills_elsewhere at random)" \
    "$([ "$finished" -eq 0 ] && [ "$kills_in_write" -ge 2 ] && [ "$kills_elsewhere" -ge 2 ]; echo $?)" "$(tail -5 "$tmp/crashed.out")"
check "stdout in a file keeps every step line printed before a kill ($lines_kept of $((lines_kept + lines_lost)) killed attempts show the step being saved)" \
    "$([ "$lines_kept" -ge 2 ] && [ "$lines_lost" -eq 0 ]; echo $?)" "$(tail -3 "$tmp/crashed.out")"
check "its log equals the undisturbed run's: every step once, the same losses, rates and norms" \
    "$(diff <(numbers "$tmp/alone/log.jsonl") <(numbers "$dir/log.jsonl") > "$tmp/diff"; echo $?)" "$(head -6 "$tmp/diff")"
final=$(printf 'ckpt_%08d' $steps)
check "its final checkpoint equals the undisturbed run's, byte for byte" \
    "$(cmp -s "$tmp/alone/$final.bin" "$dir/$final.bin" && [ -e "$dir/$final.done" ]; echo $?)"
check "no checkpoint file is left half-written" "$(! ls "$dir"/*.bin.tmp > /dev/null 2>&1; echo $?)" "$(ls "$dir")"

check_summary test_crash
