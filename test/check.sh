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
