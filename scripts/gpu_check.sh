#!/usr/bin/env bash
# Everything a GPU machine can check, in one command: build, every test (CPU and GPU), and the
# benchmarks beside PyTorch. Logs go to $OUT (or build/gpu_check); the last lines are a summary.
# When a cuBLASLt product fails, test_matmul runs again with cuBLASLt's own log to say why.
# Usage: scripts/gpu_check.sh [--no-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
case ${1:-} in "" | --no-bench) [ $# -le 1 ] ;; *) false ;; esac || { echo "usage: scripts/gpu_check.sh [--no-bench]" >&2; exit 2; }
out=${OUT:-build/gpu_check}
mkdir -p "$out"
nvidia-smi -L
make -j"$(nproc)" all > "$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 1; }
make test > "$out/test.log" 2>&1
test_status=$?
grep -E '^FAIL|: [0-9]+ passed, [0-9]+ failed$' "$out/test.log"
if grep -q 'exited with status' "$out/test.log" && grep -q 'matmul_lt' "$out/test.log"; then
    CUBLASLT_LOG_LEVEL=2 build/test_matmul > "$out/test_matmul_cublaslt.log" 2>&1
    grep -i 'cublasLt\]\[.*\(Error\|Warning\)' "$out/test_matmul_cublaslt.log" | head -5
fi
if [ "${1:-}" != "--no-bench" ]; then
    OUT=$out timeout 900 scripts/bench.sh > "$out/bench.log" 2>&1
    grep '^|' "$out/bench.log"
fi
echo "tests: $(tail -n 1 "$out/test.log")"
exit $test_status
