#!/usr/bin/env bash
# Runs each test program given, echoes its output, adds up every closing
# "<program>: N passed, N failed" line and prints the total as the last line, followed by
# ", N skipped" when some program printed "SKIP ..." lines (checks it could not run here).
# A program that crashes, prints no closing line or runs past TEST_TIMEOUT seconds (default 600)
# counts as one failure.
passed=0; failed=0; skipped=0
for prog in "$@"; do
    out=$(timeout "${TEST_TIMEOUT:-600}" "$prog" 2>&1); rc=$?
    printf '%s\n' "$out"
    skipped=$((skipped + $(printf '%s\n' "$out" | grep -c '^SKIP ')))
    if [ "$rc" -eq 124 ]; then
        echo "FAIL $prog ran past ${TEST_TIMEOUT:-600} seconds"
        failed=$((failed + 1)); continue
    fi
    line=$(printf '%s\n' "$out" | grep -E '^[A-Za-z0-9_./-]+: [0-9]+ passed, [0-9]+ failed$' | tail -n 1)
    if [ -z "$line" ]; then
        echo "FAIL $prog exited with status $rc before its closing line"
        failed=$((failed + 1)); continue
    fi
    p=$(printf '%s' "$line" | sed -E 's/.*: ([0-9]+) passed.*/\1/')
    f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed$/\1/')
    passed=$((passed + p)); failed=$((failed + f))
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
        echo "FAIL $prog exited with status $rc"
        failed=$((failed + 1))
    fi
done
echo "$passed passed, $failed failed$([ "$skipped" -eq 0 ] || echo ", $skipped skipped")"
[ "$failed" -eq 0 ]
