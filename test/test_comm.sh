#!/usr/bin/env bash
# coat/comm.h as several processes on the CPU (build/comm_ranks): under mpirun with 1 to 4 ranks
# every collective ZeRO needs gives the exact sums; ranks, world size and node-local rank come
# from MPI; a launcher's RANK / WORLD_SIZE ranks meet through a rendezvous file; a build without
# MPI launched by mpirun refuses, as does WORLD_SIZE without RANK.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if command -v mpirun > /dev/null && grep -qa MPI_Init build/comm_ranks; then
    mpi=(timeout 60 mpirun --oversubscribe -np)
    [ "$(id -u)" -eq 0 ] && mpi=(timeout 60 mpirun --allow-run-as-root --oversubscribe -np)
    for ranks in 1 2 3 4; do
        out=$("${mpi[@]}" $ranks build/comm_ranks collectives 2>&1); rc=$?
        check "mpirun -np $ranks: every rank's all-reduce, reduce to each owner, sums, max, broadcast and all-gather are exact" \
            "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c "of $ranks: collectives ok")" -eq $ranks ]; echo $?)" "$out"
    done
    out=$("${mpi[@]}" 3 build/comm_ranks init 2>&1 | sort); rc=$?
    check "mpirun -np 3: ranks 0, 1, 2 of 3, node-local ranks 0, 1, 2 on this one node" \
        "$([ $rc -eq 0 ] && [ "$out" = "$(printf 'rank 0 of 3, local 0\nrank 1 of 3, local 1\nrank 2 of 3, local 2')" ]; echo $?)" "$out"
else
    echo "SKIP the MPI collectives (no mpirun, or build/comm_ranks built without MPI)"
fi

out=$(build/comm_ranks_single ids 2>&1); rc=$?
check "the first pair of ranks with equal ids (two ranks on one GPU): the one with the lowest second rank" \
    "$([ $rc -eq 0 ] && [ "$out" = "ids ok" ]; echo $?)" "$out"
out=$(OMPI_COMM_WORLD_SIZE=2 build/comm_ranks_single init 2>&1); rc=$?
check "a build without MPI launched by mpirun as 2 processes refuses, naming why" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'launched by MPI as one of 2 processes (OMPI_COMM_WORLD_SIZE=2), but this build has no MPI'; echo $?)" "$out"
out=$(WORLD_SIZE=3 build/comm_ranks_single init 2>&1); rc=$?
check "WORLD_SIZE without RANK is refused" "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'needs RANK set to 0..2'; echo $?)" "$out"
out=$(WORLD_SIZE='4 ' RANK=0 build/comm_ranks_single init 2>&1); rc=$?
check "a world size that is no number is refused, not taken for one process" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q "WORLD_SIZE='4 ' is not a number of processes"; echo $?)" "$out"
out=$(WORLD_SIZE=1 build/comm_ranks_single init 2>&1); rc=$?
check "WORLD_SIZE=1 is one process" "$([ $rc -eq 0 ] && [ "$out" = "rank 0 of 1, local 0" ]; echo $?)" "$out"

# Three ranks started by hand (the readers first): each reads what rank 0 wrote.
for rank in 2 1 0; do
    WORLD_SIZE=3 RANK=$rank LOCAL_RANK=$rank timeout 30 build/comm_ranks_single rendezvous "$tmp" run-1 > "$tmp/rank$rank.out" 2>&1 &
    [ $rank -ne 0 ] && sleep 0.3
done
wait
first=$(cut -d: -f2 "$tmp/rank0.out")
same=0
for rank in 1 2; do [ "$(cut -d: -f2 "$tmp/rank$rank.out")" = "$first" ] || same=1; done
check "a file rendezvous gives ranks 1 and 2 the 64 bytes rank 0 wrote" \
    "$([ ${#first} -eq 128 ] && [ $same -eq 0 ] && [ ! -e "$tmp/run-1.tmp" ]; echo $?)" "$(cat "$tmp"/rank*.out)"
# A file an earlier run left (older than this launch) is not read: the rank waits for a new one.
printf 'stale' > "$tmp/run-3" && touch -d '-10 minutes' "$tmp/run-3"
out=$(WORLD_SIZE=2 RANK=1 timeout 30 build/comm_ranks_single rendezvous "$tmp" run-3 1 2>&1); rc=$?
check "a rendezvous file from before the launch is ignored" \
    "$([ $rc -eq 1 ] && printf '%s' "$out" | grep -q 'rank 0 wrote nothing in 1 s'; echo $?)" "$out"
out=$(WORLD_SIZE=2 RANK=1 timeout 30 build/comm_ranks_single rendezvous "$tmp/nobody" run-2 1 2>&1); rc=$?
check "a rank whose rank 0 never writes gives up, naming the folder" \
    "$([ $rc -eq 1 ] && printf '%s' "$out" | grep -q 'rank 0 wrote nothing in 1 s (is .*/nobody shared by every rank?)'; echo $?)" "$out"

check_summary test_comm
