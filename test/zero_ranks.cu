// The program test/test_zero_gpu.sh launches as several ranks to test coat/zero.cuh on GPU
// buffers: zero_ranks BACKEND (nccl or mpi). Each rank drives GPU local_rank % GPUs (the MPI
// backend lets several ranks share one); every collective (all-reduce, reduce, a bucket's reduce
// to its owners, the owners' parts broadcast, the max) on inputs each rank can
// compute for all the others, checked exactly (sums of multiples of 1/8 below 32 are exact in
// BF16, and in FP32). zero_ranks nccl hang: the last rank skips an all-reduce and sleeps; the
// others' watchdog (2 s) ends them, exit status EXIT_COLLECTIVE_FAILED.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/zero.cuh"

static float input_value(int rank, size_t i) { return (float)((rank * 5 + (int)(i % 17)) % 16) / 8.0f; }

static uint16_t bf16_bits(float x) {  // exact for the values here
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    return (uint16_t)(u >> 16);
}

static float bits_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static int skip_a_collective(ZeroComm *z, size_t n) {
    if (z->comm->rank == z->comm->world - 1) {
        sleep(30);
        return 0;
    }
    bf16 *data;
    cudaCheck(cudaMalloc(&data, 2 * n));
    cudaCheck(cudaMemset(data, 0, 2 * n));
    zero_all_reduce_bf16(z, data, n, 0);
    zero_wait_stream(z, z->stream, "the all-reduce the last rank skips");
    printf("rank %d: the all-reduce the last rank skipped finished\n", z->comm->rank);
    return 1;
}

int main(int argc, char **argv) {
    char error[512];
    Comm comm;
    int hang = argc == 3 && strcmp(argv[2], "hang") == 0;
    if ((argc != 2 && !hang) || (strcmp(argv[1], "nccl") != 0 && strcmp(argv[1], "mpi") != 0)) {
        fprintf(stderr, "usage: zero_ranks nccl|mpi [hang]\n");
        return 2;
    }
    if (comm_init(&comm, &argc, &argv, error, sizeof(error)) != 0 || comm_meet(&comm, ".", 120.0, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    int devices = 0;
    cudaCheck(cudaGetDeviceCount(&devices));
    cudaCheck(cudaSetDevice(comm.local_rank % devices));
    size_t shard = 4096 + 8, n = (size_t)comm.world * shard;
    ZeroComm z;
    ZeroBackend backend = strcmp(argv[1], "nccl") == 0 ? ZERO_BACKEND_NCCL : ZERO_BACKEND_MPI;
    if (zero_comm_init(&z, &comm, backend, n, hang ? 2.0 : 120.0, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    if (hang) return skip_a_collective(&z, n);
    uint16_t *mine = (uint16_t *)malloc(2 * n), *expected = (uint16_t *)malloc(2 * n), *got = (uint16_t *)malloc(2 * n);
    for (size_t i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int r = 0; r < comm.world; r++) sum += input_value(r, i);
        expected[i] = bf16_bits(sum);
        mine[i] = bf16_bits(input_value(comm.rank, i));
    }
    bf16 *data, *out;
    cudaCheck(cudaMalloc(&data, 2 * n));
    cudaCheck(cudaMalloc(&out, 2 * n));
    cudaStream_t compute;
    cudaCheck(cudaStreamCreate(&compute));
    int failures = 0;
    size_t place = (size_t)comm.rank * shard;

    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    zero_all_reduce_bf16(&z, data, n, compute);
    zero_comm_join(&z, compute);
    cudaCheck(cudaMemcpyAsync(got, data, 2 * n, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    if (memcmp(got, expected, 2 * n) != 0) { failures++; printf("rank %d: all-reduce wrong\n", comm.rank); }

    for (int root = 0; root < comm.world; root++) {  // a part to each owner in turn
        cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
        cudaCheck(cudaMemsetAsync(out, 0, 2 * n, compute));
        zero_reduce_bf16(&z, data + 8, out, 1000, root, compute);
        zero_comm_join(&z, compute);
        cudaCheck(cudaMemcpyAsync(got, out, 2 * 1000, cudaMemcpyDeviceToHost, compute));
        cudaCheck(cudaStreamSynchronize(compute));
        if (comm.rank == root && memcmp(got, expected + 8, 2 * 1000) != 0) { failures++; printf("rank %d: reduce to %d wrong\n", comm.rank, root); }
    }

    // A bucket [128, n - 128) reduced to the owners of its parts (shards of `shard` elements),
    // twice into FP32 sums of each rank's shard (ZeRO stage 2): the owned part in data is the
    // BF16 sum, the FP32 sums hold twice it (exact here), the rest of the shard's sums stay 0.
    ZeroPlan plan;
    memset(&plan, 0, sizeof(plan));
    plan.ranks = comm.world;
    plan.stage = 2;
    plan.shard_elems = shard;
    plan.padded_elems = n;
    ZeroRange bucket = {128, n - 128}, owned = zero_owned_part(&plan, bucket, comm.rank);
    float *sums;
    cudaEvent_t done;
    cudaCheck(cudaMalloc(&sums, 4 * shard));
    cudaCheck(cudaMemsetAsync(sums, 0, 4 * shard, compute));
    cudaCheck(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    for (int pass = 0; pass < 2; pass++) {
        cudaCheck(cudaStreamWaitEvent(compute, done, 0));
        cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
        zero_reduce_bucket(&z, &plan, data + bucket.begin, bucket, sums, done, compute);
    }
    zero_comm_join(&z, compute);
    float *host_sums = (float *)malloc(4 * shard);
    cudaCheck(cudaMemcpyAsync(got, data, 2 * n, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaMemcpyAsync(host_sums, sums, 4 * shard, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    int wrong = memcmp(got + owned.begin, expected + owned.begin, 2 * (owned.end - owned.begin)) != 0;
    for (size_t i = 0; i < shard; i++) {
        size_t at = place + i;
        float want = at >= owned.begin && at < owned.end ? 2.0f * bits_float(expected[at]) : 0.0f;
        wrong |= host_sums[i] != want;
    }
    if (wrong) { failures++; printf("rank %d: bucket reduce to the owners wrong\n", comm.rank); }
    free(host_sums);
    cudaCheck(cudaFree(sums));
    cudaCheck(cudaEventDestroy(done));
    // The owners' parts of a range sent to every rank: BF16 elements, and bytes (the E4M3 weight
    // gather), each laid out from the range's start; outside the range nothing changes.
    ZeroRange range = {3 * 128, n - 5 * 128};
    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    zero_broadcast_parts(&z, &plan, data + range.begin, 2, range, compute);
    size_t codes_n = range.end - range.begin;
    uint8_t *codes, *host_codes = (uint8_t *)malloc(codes_n);
    for (size_t j = 0; j < codes_n; j++) host_codes[j] = (uint8_t)((comm.rank * 7 + j) % 251);
    cudaCheck(cudaMalloc(&codes, codes_n));
    cudaCheck(cudaMemcpyAsync(codes, host_codes, codes_n, cudaMemcpyHostToDevice, compute));
    zero_broadcast_parts(&z, &plan, codes, 1, range, compute);
    zero_comm_join(&z, compute);
    cudaCheck(cudaMemcpyAsync(got, data, 2 * n, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaMemcpyAsync(host_codes, codes, codes_n, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    wrong = 0;
    for (size_t i = 0; i < n; i++) {
        int owner = (int)(i / shard), inside = i >= range.begin && i < range.end;
        wrong |= got[i] != bf16_bits(input_value(inside ? owner : comm.rank, i));
        if (inside) wrong |= host_codes[i - range.begin] != (uint8_t)((owner * 7 + (i - range.begin)) % 251);
    }
    if (wrong) { failures++; printf("rank %d: broadcast of the owners' parts wrong\n", comm.rank); }
    free(host_codes);
    cudaCheck(cudaFree(codes));

    // The max over the ranks of non-negative FP32 values, in place.
    float *maxima, *host_maxima = (float *)malloc(4 * shard);
    for (size_t i = 0; i < shard; i++) host_maxima[i] = input_value(comm.rank, i) * 1e-3f;
    cudaCheck(cudaMalloc(&maxima, 4 * shard));
    cudaCheck(cudaMemcpyAsync(maxima, host_maxima, 4 * shard, cudaMemcpyHostToDevice, compute));
    zero_all_reduce_max_f32(&z, maxima, shard, compute);
    zero_comm_join(&z, compute);
    cudaCheck(cudaMemcpyAsync(host_maxima, maxima, 4 * shard, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    wrong = 0;
    for (size_t i = 0; i < shard; i++) {
        float want = 0.0f;
        for (int r = 0; r < comm.world; r++) want = fmaxf(want, input_value(r, i) * 1e-3f);
        wrong |= host_maxima[i] != want;
    }
    if (wrong) { failures++; printf("rank %d: max all-reduce wrong\n", comm.rank); }
    free(host_maxima);
    cudaCheck(cudaFree(maxima));

    printf("rank %d of %d: %s collectives %s\n", comm.rank, comm.world, argv[1], failures ? "WRONG" : "ok");
    zero_comm_free(&z);
    cudaCheck(cudaFree(data));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaStreamDestroy(compute));
    free(mine);
    free(expected);
    free(got);
    comm_finish(&comm);
    return failures ? 1 : 0;
}
