#!/usr/bin/env bash
# coat/comm.h as several processes on the CPU (build/comm_ranks): under mpirun with 1 to 4 ranks
# every collective ZeRO needs gives the exact sums; ranks, world size and node-local rank come
# from MPI; the launchers' precedence (torchrun inside srun, mpirun inside an allocation) and the
# contradictions it refuses; a launcher's RANK / WORLD_SIZE ranks meet over TCP or files
# (coat/rendezvous.h), never through a crashed launch's files nor with another job's rank, and a
# killed rank ends the others within the timeout; a build without MPI launched by mpirun refuses,
# as does WORLD_SIZE without RANK.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

if command -v mpirun > /dev/null && grep -qa MPI_Init build/comm_ranks; then
    mpi=(timeout 60 mpirun --oversubscribe -np)
    [ "$(id -u)" -eq 0 ] && mpi=(timeout 60 mpirun --allow-run-as-root --oversubscribe -np)
    for ranks in 1 2 3 4; do
        out=$("${mpi[@]}" $ranks build/comm_ranks collectives 2>&1); rc=$?
        check "mpirun -np $ranks: every rank's all-reduce, reduce-scatter, all-gather in place, sums, max, broadcast and all-gather are exact$([ $ranks -gt 1 ] && echo "; split into groups of 2 and across them, each numbered as MPI numbers it")$([ $((ranks % 2)) = 0 ] && echo ", a reduce-scatter within and a sum across exact")" \
            "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c "of $ranks: collectives ok")" -eq $ranks ]; echo $?)" "$out"
    done
    out=$("${mpi[@]}" 3 build/comm_ranks init 2>&1 | sort); rc=$?
    check "mpirun -np 3: ranks 0, 1, 2 of 3, node-local ranks 0, 1, 2 on this one node" \
        "$([ $rc -eq 0 ] && [ "$out" = "$(printf 'rank 0 of 3, local 0\nrank 1 of 3, local 1\nrank 2 of 3, local 2')" ]; echo $?)" "$out"
else
    mpi=()
    echo "SKIP the MPI collectives (no mpirun, or build/comm_ranks built without MPI)"
fi

out=$(build/comm_ranks_single ids 2>&1); rc=$?
check "the first pair of ranks with equal ids (two ranks on one GPU): the one with the lowest second rank" \
    "$([ $rc -eq 0 ] && [ "$out" = "ids ok" ]; echo $?)" "$out"
out=$(OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=0 build/comm_ranks_single init 2>&1); rc=$?
check "a build without MPI launched by mpirun as 2 processes refuses, naming why" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'launched by MPI as one of 2 processes (OMPI_COMM_WORLD_SIZE=2), but this build has no MPI'; echo $?)" "$out"
out=$(WORLD_SIZE=3 build/comm_ranks_single init 2>&1); rc=$?
check "WORLD_SIZE without RANK is refused" "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q 'needs RANK set to 0..2'; echo $?)" "$out"
out=$(WORLD_SIZE='4 ' RANK=0 build/comm_ranks_single init 2>&1); rc=$?
check "a world size that is no number is refused, not taken for one process" \
    "$([ $rc -eq 2 ] && printf '%s' "$out" | grep -q "WORLD_SIZE='4 ' is not a number of processes"; echo $?)" "$out"
out=$(WORLD_SIZE=1 build/comm_ranks_single init 2>&1); rc=$?
check "WORLD_SIZE=1 is one process" "$([ $rc -eq 0 ] && [ "$out" = "rank 0 of 1, local 0" ]; echo $?)" "$out"

# One precedence: torchrun's variables, then mpirun's, then srun's, then PMI's; contradictions refused.
init() { env -u MASTER_ADDR -u MASTER_PORT "$@" build/comm_ranks_single init 2>&1; }
out=$(init SLURM_NTASKS=1 SLURM_PROCID=0 SLURM_LOCALID=0 WORLD_SIZE=8 RANK=3 LOCAL_RANK=3); rc=$?
check "torchrun inside a one-task srun runs as torchrun's rank" "$([ $rc -eq 0 ] && [ "$out" = "rank 3 of 8, local 3" ]; echo $?)" "$out"
out=$(init SLURM_NTASKS=2 SLURM_PROCID=1 WORLD_SIZE=16 RANK=9 LOCAL_RANK=1); rc=$?
check "torchrun with 8 ranks in each of 2 srun tasks runs as torchrun's rank" "$([ $rc -eq 0 ] && [ "$out" = "rank 9 of 16, local 1" ]; echo $?)" "$out"
refused() {  # refused NAME EXPECTED-TEXT VARIABLES...
    local name=$1 text=$2; shift 2
    out=$(init "$@"); rc=$?
    check "$name" "$([ $rc -eq 2 ] && [ "$(printf '%s\n' "$out" | wc -l)" -eq 1 ] && printf '%s' "$out" | grep -qF -- "$text"; echo $?)" "$out"
}
refused "WORLD_SIZE=1 with RANK=1 is refused" "RANK=1 is not below WORLD_SIZE=1" WORLD_SIZE=1 RANK=1
refused "RANK without WORLD_SIZE is refused" "RANK=1 is set but WORLD_SIZE is not" RANK=1
refused "RANK >= WORLD_SIZE inside srun is refused" "RANK=2 is not below WORLD_SIZE=2" SLURM_NTASKS=1 SLURM_PROCID=0 WORLD_SIZE=2 RANK=2
refused "torchrun's WORLD_SIZE no multiple of the srun tasks it runs in is refused, naming both" \
    "WORLD_SIZE=6 is no multiple of SLURM_NTASKS=4" WORLD_SIZE=6 RANK=0 SLURM_NTASKS=4 SLURM_PROCID=0
refused "srun and PMI disagreeing about the process are refused, naming both" \
    "SLURM_NTASKS=2, SLURM_PROCID=1 but PMI_SIZE=2, PMI_RANK=0" SLURM_NTASKS=2 SLURM_PROCID=1 PMI_SIZE=2 PMI_RANK=0
if [ -n "${mpi[*]}" ]; then
    out=$(SLURM_NTASKS=8 SLURM_PROCID=0 "${mpi[@]}" 2 build/comm_ranks init 2>&1 | sort); rc=$?
    check "mpirun inside an allocation (an sbatch script's SLURM_NTASKS=8, SLURM_PROCID=0) runs as mpirun's ranks" \
        "$([ $rc -eq 0 ] && [ "$out" = "$(printf 'rank 0 of 2, local 0\nrank 1 of 2, local 1')" ]; echo $?)" "$out"
fi

# Ranks started by hand meet (the readers first), over TCP and over files: each gets rank 0's 64
# bytes, rank 0 each one's sum of them, and no file stays behind.
port=$((20000 + RANDOM % 20000))
for transport in tcp file; do
    where=(env -u MASTER_ADDR -u MASTER_PORT)
    [ $transport = tcp ] && where=(env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port)
    mkdir -p "$tmp/$transport"
    for rank in 2 1 0; do
        "${where[@]}" WORLD_SIZE=3 RANK=$rank timeout 30 build/comm_ranks_single meet "$tmp/$transport" 10 > "$tmp/$transport/rank$rank.out" 2>&1 &
        [ $rank -ne 0 ] && sleep 0.3
    done
    wait
    first=$(head -1 "$tmp/$transport/rank0.out" | cut -d: -f2)
    same=0
    for rank in 1 2; do [ "$(cut -d: -f2 "$tmp/$transport/rank$rank.out")" = "$first" ] || same=1; done
    check "$transport rendezvous: ranks 1 and 2 get rank 0's 64 bytes, rank 0 their sums, no file left" \
        "$([ ${#first} -eq 128 ] && [ $same -eq 0 ] && grep -q 'sums ok' "$tmp/$transport/rank0.out" &&
           [ -z "$(ls "$tmp/$transport" | grep -v '\.out$')" ]; echo $?)" "$(cat "$tmp/$transport"/rank*.out; ls "$tmp/$transport")"
done

# A crash leaves rank 0's reply behind (rank 1 stopped before taking it, both killed): a later
# launch of the same job never takes it, however recent; with its rank 0 it meets as usual.
stale=$tmp/stale; mkdir -p "$stale"
job=(env -u MASTER_ADDR -u MASTER_PORT TORCHELASTIC_RUN_ID=j1 WORLD_SIZE=2)
wait_for() { for i in $(seq 200); do [ -e "$1" ] && return; sleep 0.05; done; }
"${job[@]}" RANK=0 build/comm_ranks_single meet "$stale" 20 > /dev/null 2>&1 & writer=$!
wait_for "$stale/rendezvous-j1.0"; kill -STOP $writer
"${job[@]}" RANK=1 build/comm_ranks_single meet "$stale" 20 > /dev/null 2>&1 & reader=$!
wait_for "$stale/rendezvous-j1.0-0-rank1"; kill -STOP $reader; kill -CONT $writer
wait_for "$stale/rendezvous-j1.0-0"
kill -9 $writer $reader; wait $writer $reader 2> /dev/null
left=$(ls "$stale")
out=$("${job[@]}" RANK=1 timeout 30 build/comm_ranks_single meet "$stale" 1 2>&1); rc=$?
check "a rendezvous reply a crashed launch left is not taken: the rank waits for its rank 0 and gives up, naming it" \
    "$(printf '%s\n' "$left" | grep -qx 'rendezvous-j1.0-0' && [ $rc -eq 1 ] &&
       printf '%s' "$out" | grep -q 'rank 1: rank 0 of job j1.0 did not answer in .* within 1 s'; echo $?)" "left: $left; $out"
"${job[@]}" RANK=1 timeout 30 build/comm_ranks_single meet "$stale" 10 > "$stale/rank1.out" 2>&1 &
sleep 0.3
"${job[@]}" RANK=0 timeout 30 build/comm_ranks_single meet "$stale" 10 > "$stale/rank0.out" 2>&1
wait
check "the same job launched again meets past the crashed launch's files, and removes them" \
    "$([ "$(head -1 "$stale/rank0.out" | cut -d: -f2)" = "$(cut -d: -f2 "$stale/rank1.out")" ] &&
       [ -z "$(ls "$stale" | grep -v '\.out$')" ]; echo $?)" "$(cat "$stale"/rank*.out; ls "$stale")"
# Over TCP a rank of another job (an earlier launch still retrying) is not let in.
out=$(env MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 2)) TORCHELASTIC_RUN_ID=new WORLD_SIZE=2 RANK=0 \
      timeout 30 build/comm_ranks_single meet "$tmp" 2 2>&1 &
      env MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 2)) TORCHELASTIC_RUN_ID=old WORLD_SIZE=2 RANK=1 \
      timeout 30 build/comm_ranks_single meet "$tmp" 2 > /dev/null 2>&1; wait); rc=$?
check "tcp: rank 0 lets no rank of another job in (TORCHELASTIC_RUN_ID), and names the missing rank" \
    "$(printf '%s' "$out" | grep -q 'rank 1 of job new.0 did not connect to rank 0 (port [0-9]*) within 2 s'; echo $?)" "$out"

# A rank killed after the first exchange ends the others within the timeout (4 s): at once over
# TCP (its connection closes), at the timeout over files; every rank names the one it missed.
for transport in tcp file; do
    where=(env -u MASTER_ADDR -u MASTER_PORT)
    [ $transport = tcp ] && where=(env MASTER_ADDR=127.0.0.1 MASTER_PORT=$((port + 1)))
    dir=$tmp/killed_$transport; mkdir -p "$dir"
    start=$(date +%s.%N)
    for rank in 0 1; do
        "${where[@]}" WORLD_SIZE=3 RANK=$rank timeout 30 build/comm_ranks_single meet "$dir" 4 60 > "$dir/rank$rank.out" 2>&1 &
        pids[$rank]=$!
    done
    "${where[@]}" WORLD_SIZE=3 RANK=2 build/comm_ranks_single meet "$dir" 4 60 > "$dir/rank2.out" 2>&1 & victim=$!
    for i in $(seq 200); do grep -q '^rank 2:' "$dir/rank2.out" && break; sleep 0.05; done
    kill -9 $victim; wait $victim 2> /dev/null
    wait ${pids[0]}; rc0=$?; wait ${pids[1]}; rc1=$?
    took=$(echo "$(date +%s.%N) - $start" | bc)
    check "$transport: rank 2 killed, ranks 0 and 1 fail within the 4 s timeout (took ${took} s), rank 0 naming rank 2" \
        "$([ $rc0 -eq 1 ] && [ $rc1 -eq 1 ] && awk -v t="$took" 'BEGIN { exit !(t < 6) }' &&
           grep -q 'error: .*rank 2 ' "$dir/rank0.out" && grep -q 'error: rank 1: rank 0 ' "$dir/rank1.out"; echo $?)" \
        "$(cat "$dir"/rank*.out)"
done

check_summary test_comm
