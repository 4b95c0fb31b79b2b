#!/usr/bin/env bash
# coat/collectives.cuh on the GPU (build/zero_ranks): every collective ZeRO needs, on device buffers,
# exact; the MPI backend with 1 to 4 ranks sharing this machine's GPU(s), NCCL with one rank per
# GPU there is.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh

mpi=(timeout 120 mpirun --oversubscribe -np)
[ "$(id -u)" -eq 0 ] && mpi=(timeout 120 mpirun --allow-run-as-root --oversubscribe -np)
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if command -v mpirun > /dev/null && grep -qa MPI_Init build/zero_ranks; then
    for ranks in 1 2 3 4; do
        out=$("${mpi[@]}" $ranks build/zero_ranks mpi 2>&1); rc=$?
        check "comm_backend mpi, $ranks rank(s) on $gpus GPU(s): all-reduce in place, reduce-scatter out of place and in place (with the FP32 accumulation of the part), all-gather in place of BF16 and of bytes, the max of FP32 maxima, FP64 sums$([ $((ranks % 2)) = 0 ] && echo ", split into groups of 2 and across them (a reduce-scatter within, an all-reduce across)") exact" \
            "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c "of $ranks: mpi collectives ok")" -eq $ranks ]; echo $?)" "$out"
    done
    for ranks in $(seq 2 "$gpus"); do
        out=$("${mpi[@]}" $ranks build/zero_ranks nccl 2>&1); rc=$?
        check "comm_backend nccl, $ranks ranks on $ranks GPUs: every collective$([ $((ranks % 2)) = 0 ] && echo ", the splits too") exact" \
            "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c "of $ranks: nccl collectives ok")" -eq $ranks ]; echo $?)" "$out"
    done
else
    echo "SKIP the multi-rank collectives (no mpirun, or a build without MPI)"
fi
if grep -qa ncclCommInitRank build/zero_ranks; then
    out=$(build/zero_ranks nccl 2>&1); rc=$?
    check "comm_backend nccl, one rank: every collective (copies) exact" \
        "$([ $rc -eq 0 ] && printf '%s' "$out" | grep -q 'rank 0 of 1: nccl collectives ok'; echo $?)" "$out"
    if [ "$gpus" -ge 2 ]; then  # torchrun-style ranks: rank 0's own exit status
        rm -rf build/zero_hang && mkdir -p build/zero_hang
        (cd build/zero_hang && WORLD_SIZE=2 RANK=1 LOCAL_RANK=1 exec ../zero_ranks nccl hang > /dev/null 2>&1) &
        sleeper=$!
        began=$(date +%s)
        out=$(cd build/zero_hang && WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 timeout 60 ../zero_ranks nccl hang 2>&1); rc=$?
        took=$(( $(date +%s) - began ))
        kill "$sleeper" 2> /dev/null; wait "$sleeper" 2> /dev/null
        check "comm_backend nccl, 2 ranks, the second skips an all-reduce: rank 0's watchdog ends it past its 2 s timeout, naming the wait, exit 3 (exit $rc after ${took} s)" \
            "$([ $rc -eq 3 ] && [ "$took" -lt 20 ] && printf '%s\n' "$out" | grep -q '^error: rank 0: the all-reduce the last rank skips did not finish within 2 s'; echo $?)" "$out"
    fi
fi

check_summary test_zero_gpu
