#!/usr/bin/env bash
# The command line of ./train_llama as a user meets it: --help, config errors (one line naming
# file:line, exit code 2) and dry_run's memory plan. Needs no GPU.
cd "$(dirname "$0")/.." || exit 1
passed=0; failed=0
check() {  # check NAME CONDITION-EXIT-CODE [DETAIL]
    if [ "$2" -eq 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1${3:+: $3}"; failed=$((failed + 1)); fi
}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

help=$(./train_llama --help); rc=$?
check "--help exits 0" $rc
missing_keys=""
for key in $(sed -n 's/^    {"\([a-z0-9_]*\)", KEY_.*/\1/p' coat/config.h); do
    printf '%s\n' "$help" | grep -q "^  $key " || missing_keys="$missing_keys $key"
done
check "--help lists every key with its default" "$([ -z "$missing_keys" ]; echo $?)" "missing:$missing_keys"

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

for precision in bf16 coat; do
    out=$(./train_llama configs/models/llama-1b.conf --dry_run=1 --micro_batch_size=16 --precision=$precision 2>&1); rc=$?
    check "dry_run llama-1b $precision exits 0" $rc "$out"
    check "dry_run llama-1b $precision prints the memory plan" \
        "$(printf '%s\n' "$out" | grep -q "memory plan per rank: precision $precision" &&
           printf '%s\n' "$out" | grep -q '^  optimizer states' && printf '%s\n' "$out" | grep -q '^  total'; echo $?)"
done
out=$(./train_llama configs/models/llama2-7b.conf --dry_run=1 --micro_batch_size=64 --gpu_memory_gib=141 2>&1); rc=$?
check "dry_run refuses a micro-batch that does not fit, naming the largest that does" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'the largest that fits is [0-9]'; echo $?)" "$out"

echo "test_cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
