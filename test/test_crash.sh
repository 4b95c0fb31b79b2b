#!/usr/bin/env bash
# Crash consistency on the GPU: a coat run killed with SIGKILL again and again (at random moments,
# and while a checkpoint is being written), resumed each time, ends with the same log (every
# loss, learning rate and gradient norm) and the same final checkpoint, byte for byte, as the same
# run left alone, and its stdout, redirected to a file, keeps the step lines printed before each
# kill. llama-125m at 2 x 128 tokens a step: its checkpoints (about 0.8 GB) take long enough to
# write that a kill can be aimed inside one. The same with per-rank checkpoints (a part file and a
# manifest). Then preemption: SIGTERM stops a run with a checkpoint (exit 75) that resumes to the
# same log and final checkpoint; a second signal ends it at once.
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

# While the run $pid lives, waits for a file of $dir named like $1 and newer than $tmp/started (a
# checkpoint write this attempt began); leaves its path in $writing, empty when the run ended first.
# A function, not a command substitution: no subshell between finding the file and the kill.
wait_for_write() {
    writing=""
    while kill -0 $pid 2>/dev/null; do
        writing=$(find "$dir" -name "$1" -newer "$tmp/started" 2>/dev/null | head -1)
        [ -n "$writing" ] && return
        sleep 0.01
    done
}

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
            wait_for_write '*.bin.tmp'
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


# Per-rank checkpoints (checkpoint_writes = per_rank; one rank writes one part file and the
# manifest): killed again and again, while a part file is being written and at random, a step
# being written never gets its marker, the next start removes what the kill left, and the run
# ends with the undisturbed log, and a final checkpoint that merges to its file byte for byte.
dir=$tmp/parts_crashed
mkdir -p "$dir"
kills_in_write=0 marked_early=0 attempts=0 finished=1
for attempt in 1 2 3 4 5 6 7 8; do
    attempts=$attempt
    continue=(--overwrite=1)
    ls "$dir"/ckpt_*.done > /dev/null 2>&1 && continue=(--resume=1)
    touch "$tmp/started"
    ./train_llama "${common[@]}" --checkpoint_writes=per_rank --out_dir="$dir" "${continue[@]}" > "$tmp/parts$attempt.out" 2>&1 &
    pid=$!
    if [ "$attempt" -lt 8 ]; then
        if [ $((attempt % 2)) -eq 1 ]; then
            wait_for_write '*.rank0.bin.tmp'
            if [ -n "$writing" ] && kill -9 $pid 2>/dev/null; then
                kills_in_write=$((kills_in_write + 1))
                step=$(basename "$writing" | sed 's/^ckpt_\([0-9]*\)\.rank0\.bin\.tmp$/\1/')
                { wait $pid; } 2> /dev/null
                [ -e "$dir/ckpt_$step.done" ] && marked_early=$((marked_early + 1))
            fi
        else
            lines=$((RANDOM % 6 + 1))
            while kill -0 $pid 2>/dev/null && [ "$(grep -c '^step ' "$tmp/parts$attempt.out")" -lt "$lines" ]; do sleep 0.01; done
            sleep "0.0$((RANDOM % 5))"
            kill -0 $pid 2>/dev/null && kill -9 $pid 2>/dev/null
        fi
    fi
    { wait $pid; } 2> /dev/null
    finished=$?
    [ "$finished" -eq 0 ] && break
done
check "per-rank checkpoints: the killed run resumes to its end ($attempts attempts, $kills_in_write kills while a part file was written)" \
    "$([ "$finished" -eq 0 ] && [ "$kills_in_write" -ge 2 ]; echo $?)" "$(tail -3 "$tmp/parts$attempts.out")"
check "per-rank checkpoints: a step killed while its part file was written never has its marker ($marked_early of $kills_in_write)" \
    "$([ "$marked_early" -eq 0 ]; echo $?)"
check "per-rank checkpoints: the log equals the undisturbed run's" \
    "$(diff <(numbers "$tmp/alone/log.jsonl") <(numbers "$dir/log.jsonl") > "$tmp/diff"; echo $?)" "$(head -6 "$tmp/diff")"
out=$(python3 scripts/convert_hf.py merge "$dir/$final.bin" "$tmp/parts_final.bin" 2>&1)
check "per-rank checkpoints: the final checkpoint merges to the undisturbed run's file, byte for byte" \
    "$(cmp -s "$tmp/parts_final.bin" "$tmp/alone/$final.bin"; echo $?)" "$out"
orphans=$(for part in "$dir"/ckpt_*.rank*.bin; do
    [ -e "${part%.rank*.bin}.done" ] || echo "$part"
done)
check "per-rank checkpoints: no temporary or unmarked part file is left" \
    "$([ -z "$orphans" ] && ! ls "$dir"/*.tmp > /dev/null 2>&1; echo $?)" "$orphans $(ls "$dir")"

# Preemption: SIGTERM in the middle of the run stops it at the next step boundary with a
# checkpoint of that step and exit code 75; resumed, it ends with the log and the final checkpoint
# of the run left alone, byte for byte. The step lines and the log carry the time and tokens.
dir=$tmp/preempted
./train_llama "${common[@]}" --out_dir="$dir" > "$tmp/preempted.out" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null && [ "$(grep -c '^step  *[0-9]*/' "$tmp/preempted.out")" -lt 6 ]; do sleep 0.01; done
kill -TERM $pid
{ wait $pid; } 2> /dev/null
rc=$?
stopped=$(sed -n 's/^step \([0-9]*\): stopped by .* with its checkpoint written (exit 75).*/\1/p' "$tmp/preempted.out")
check "SIGTERM stops the run at a step boundary with that step's checkpoint and exit code 75 (step ${stopped:-none})" \
    "$([ $rc -eq 75 ] && [ -n "$stopped" ] && [ "$stopped" -lt $steps ] && [ -e "$dir/$(printf 'ckpt_%08d' "$stopped").done" ] &&
       ! ls "$dir"/*.bin.tmp > /dev/null 2>&1; echo $?)" "exit $rc: $(tail -3 "$tmp/preempted.out")"
./train_llama "${common[@]}" --out_dir="$dir" --resume=1 > "$tmp/preempted-resumed.out" 2>&1
check "the stopped run resumes to its end" $? "$(tail -3 "$tmp/preempted-resumed.out")"
check "stopped by SIGTERM and resumed, its log equals the undisturbed run's" \
    "$(diff <(numbers "$tmp/alone/log.jsonl") <(numbers "$dir/log.jsonl") > "$tmp/diff"; echo $?)" "$(head -6 "$tmp/diff")"
check "stopped by SIGTERM and resumed, its final checkpoint equals the undisturbed run's, byte for byte" \
    "$(cmp -s "$tmp/alone/$final.bin" "$dir/$final.bin"; echo $?)"
check "the step lines give the time elapsed, the time left and the tokens seen" \
    "$(grep -Eq "^step +$steps/$steps .* \| [0-9hms]+ elapsed, 0s left \| 0\.006144M tokens$" "$tmp/preempted-resumed.out"; echo $?)" \
    "$(grep "^step +$steps/" "$tmp/preempted-resumed.out")"
check "the log's training records carry elapsed_s, growing over the resume, and remaining_s" \
    "$(python3 - "$dir/log.jsonl" <<'PY'
import json, sys
records = [r for r in map(json.loads, open(sys.argv[1])) if "train_loss" in r]
elapsed = [r["elapsed_s"] for r in records]
ok = len(records) == 24 and elapsed == sorted(elapsed) and elapsed[-1] > elapsed[0] >= 0 and records[-1]["remaining_s"] == 0 and \
     records[-1]["tokens"] == 24 * 2 * 128
sys.exit(0 if ok else 1)
PY
echo $?)" "$(tail -2 "$dir/log.jsonl")"
# A second signal ends the run at once (the default action: killed by SIGTERM, status 143).
./train_llama "${common[@]}" --out_dir="$tmp/twice" > "$tmp/twice.out" 2>&1 &
pid=$!
while kill -0 $pid 2>/dev/null && [ "$(grep -c '^step  *[0-9]*/' "$tmp/twice.out")" -lt 2 ]; do sleep 0.01; done
kill -TERM $pid; sleep 0.05; kill -TERM $pid
{ wait $pid; } 2> /dev/null
rc=$?
check "a second SIGTERM ends the run at once (status 143)" "$([ $rc -eq 143 ]; echo $?)" "got $rc: $(tail -2 "$tmp/twice.out")"
# A stale temporary from a killed run is removed when the next run starts.
touch "$dir/ckpt_00000099.bin.tmp"
./train_llama "${common[@]}" --out_dir="$dir" --resume=1 > "$tmp/stale.out" 2>&1
check "a resumed run removes a killed run's stale .bin.tmp" \
    "$([ ! -e "$dir/ckpt_00000099.bin.tmp" ] && grep -q 'removed 1 unfinished temporary file' "$tmp/stale.out"; echo $?)" "$(head -3 "$tmp/stale.out")"

check_summary test_crash
