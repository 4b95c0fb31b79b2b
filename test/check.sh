# Test harness for shell tests, the twin of test/check.h: `check NAME STATUS [DETAIL]` records one
# check (status 0 passes), `check_summary PROGRAM` prints the closing line and returns non-zero on
# any failure. Source it from the test; run_tests.sh adds up the closing lines.
passed=0; failed=0
check() {
    if [ "$2" -eq 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1${3:+: $3}"; failed=$((failed + 1)); fi
}
check_summary() {
    echo "$1: $passed passed, $failed failed"
    [ "$failed" -eq 0 ]
}
# `write_pattern_shards DIR SEED TRAIN_TOKENS VAL_TOKENS`: DIR/train_000000.bin and
# DIR/val_000000.bin in llm.c's shard format (256 int32 header: magic, version, count; uint16
# tokens), a repeating pattern with noise below id 1000 so that the loss has something to learn;
# the same bytes for the same arguments.
write_pattern_shards() {
    python3 - "$@" <<'PY'
import random, struct, sys
directory, seed, train, val = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
random.seed(seed)
for name, count in (("train_000000.bin", train), ("val_000000.bin", val)):
    tokens = [(i * 7 + (i // 13)) % 1000 if random.random() < 0.8 else random.randrange(1000) for i in range(count)]
    with open(f"{directory}/{name}", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *tokens))
PY
}
