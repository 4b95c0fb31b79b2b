// The program test/test_zero_gpu.sh launches as several ranks to test coat/collectives.cuh's
// backends on GPU buffers: zero_ranks BACKEND (nccl or mpi). Each rank drives GPU local_rank % GPUs
// (the MPI backend lets several ranks share one); every collective data parallelism runs (the
// all-reduce, the reduce-scatter out of place and in place, stage 2's FP32 accumulation of the
// part, the all-gather in place of BF16 elements and of bytes, the max; with an even world, the
// splits of hybrid sharding) on inputs each rank can
// compute for all the others, checked exactly (sums of multiples of 1/8 below 32 are exact in
// BF16, and in FP32, whatever order the library adds them in: the per-owner reduces of earlier
// versions gave these same bits). zero_ranks nccl hang: the last rank skips an all-reduce and
// sleeps; the others' watchdog (2 s) ends them, exit status EXIT_COLLECTIVE_FAILED.
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

static int skip_a_collective(Collectives *c, size_t n) {
    if (c->comm->rank == c->comm->world - 1) {
        sleep(30);
        return 0;
    }
    bf16 *data;
    cudaCheck(cudaMalloc(&data, 2 * n));
    cudaCheck(cudaMemset(data, 0, 2 * n));
    collectives_all_reduce_sum_bf16(c, data, n, 0);
    collectives_wait_stream(c, c->stream, "the all-reduce the last rank skips");
    printf("rank %d: the all-reduce the last rank skipped finished\n", c->comm->rank);
    return 1;
}

// Device data[n] to the host, once `compute` has waited for the collectives.
static void download(Collectives *c, void *host, const void *data, size_t bytes, cudaStream_t compute) {
    collectives_join(c, compute);
    cudaCheck(cudaMemcpyAsync(host, data, bytes, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
}

// Hybrid sharding's splits (an even world): groups of 2 consecutive ranks, and the ranks of one
// index within them across the groups. A bucket of 2 parts reduce-scattered within the group, the
// part then summed across the groups, holds the sum over every rank of that part; a sum within the
// group alone holds the group's. Returns the failures.
static int test_splits(Collectives *c, const uint16_t *mine, size_t shard, cudaStream_t compute) {
    char error[512];
    int rank = c->comm->rank, world = c->comm->world, group = rank / 2, index = rank % 2;
    Comm group_comm, across_comm;
    Collectives in_group, across;
    if (collectives_split(c, group, index, &group_comm, &in_group, error, sizeof(error)) != 0 ||
        collectives_split(c, index, group, &across_comm, &across, error, sizeof(error)) != 0) {
        printf("rank %d: split failed: %s\n", rank, error);
        return 1;
    }
    int failures = 0;
    if (group_comm.rank != index || group_comm.world != 2 || across_comm.rank != group || across_comm.world != world / 2) {
        failures++;
        printf("rank %d: the splits number it %d of %d and %d of %d\n", rank, group_comm.rank, group_comm.world,
               across_comm.rank, across_comm.world);
    }
    size_t n = 2 * shard;
    uint16_t *got = (uint16_t *)malloc(2 * n);
    bf16 *data;
    cudaCheck(cudaMalloc(&data, 2 * n));
    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    collectives_reduce_scatter_sum_bf16(&in_group, data, data + (size_t)index * shard, shard, compute);
    collectives_all_reduce_sum_bf16(&across, data + (size_t)index * shard, shard, in_group.stream);
    download(c, got, data + (size_t)index * shard, 2 * shard, compute);
    int wrong = 0;
    for (size_t i = 0; i < shard; i++) {
        float sum = 0.0f;
        for (int r = 0; r < world; r++) sum += input_value(r, (size_t)index * shard + i);
        wrong |= got[i] != bf16_bits(sum);
    }
    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    collectives_all_reduce_sum_bf16(&in_group, data, n, compute);
    download(c, got, data, 2 * n, compute);
    for (size_t i = 0; i < n; i++) wrong |= got[i] != bf16_bits(input_value(2 * group, i) + input_value(2 * group + 1, i));
    if (wrong) { failures++; printf("rank %d: a sum within the group or across the groups wrong\n", rank); }
    collectives_close_split(&across, &across_comm);
    collectives_close_split(&in_group, &group_comm);
    cudaCheck(cudaFree(data));
    free(got);
    return failures;
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
    size_t shard = 4096 + 128, n = (size_t)comm.world * shard;  // a bucket of world parts of `shard`
    Collectives c;
    CollectivesBackend backend = strcmp(argv[1], "nccl") == 0 ? COLLECTIVES_NCCL : COLLECTIVES_MPI;
    if (zero_open_collectives(&c, &comm, backend, n, hang ? 2.0 : 120.0, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    if (hang) return skip_a_collective(&c, n);
    uint16_t *mine = (uint16_t *)malloc(2 * n), *expected = (uint16_t *)malloc(2 * n), *got = (uint16_t *)malloc(2 * n);
    for (size_t i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int r = 0; r < comm.world; r++) sum += input_value(r, i);
        expected[i] = bf16_bits(sum);
        mine[i] = bf16_bits(input_value(comm.rank, i));
    }
    bf16 *data, *out;
    cudaCheck(cudaMalloc(&data, 2 * n));
    cudaCheck(cudaMalloc(&out, 2 * (n + 128)));  // the separate shard lands at out + 128
    cudaStream_t compute;
    cudaCheck(cudaStreamCreate(&compute));
    int failures = 0;
    size_t place = (size_t)comm.rank * shard;

    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    collectives_all_reduce_sum_bf16(&c, data, n, compute);
    download(&c, got, data, 2 * n, compute);
    if (memcmp(got, expected, 2 * n) != 0) { failures++; printf("rank %d: all-reduce wrong\n", comm.rank); }

    // Stage 1's reduce-scatter: a bucket's sum, this rank's part into a separate shard.
    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    cudaCheck(cudaMemsetAsync(out, 0, 2 * (n + 128), compute));
    collectives_reduce_scatter_sum_bf16(&c, data, out + 128, shard, compute);
    download(&c, got, out + 128, 2 * shard, compute);
    if (memcmp(got, expected + place, 2 * shard) != 0) { failures++; printf("rank %d: reduce-scatter wrong\n", comm.rank); }

    // Stage 2's: in place, twice into an FP32 sum of the part (exactly twice it here).
    float *sums, *host_sums = (float *)malloc(4 * shard);
    cudaCheck(cudaMalloc(&sums, 4 * shard));
    cudaCheck(cudaMemsetAsync(sums, 0, 4 * shard, compute));
    for (int pass = 0; pass < 2; pass++) {
        collectives_join(&c, compute);  // the previous pass's sum is done with data
        cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
        collectives_reduce_scatter_sum_bf16(&c, data, data + place, shard, compute);
        zero_accumulate_kernel<<<(unsigned)ceil_div_size(shard, 256), 256, 0, c.stream>>>(sums, data + place, shard);
        cudaCheckLaunch();
    }
    download(&c, host_sums, sums, 4 * shard, compute);
    int wrong = 0;
    for (size_t i = 0; i < shard; i++) wrong |= host_sums[i] != 2.0f * bits_float(expected[place + i]);
    if (wrong) { failures++; printf("rank %d: reduce-scatter in place and FP32 accumulation wrong\n", comm.rank); }
    free(host_sums);
    cudaCheck(cudaFree(sums));

    // The parameter gather: each rank's part of BF16 elements, and of bytes (the E4M3 codes), in
    // place to every rank.
    cudaCheck(cudaMemsetAsync(data, 0, 2 * n, compute));
    cudaCheck(cudaMemcpyAsync(data + place, mine + place, 2 * shard, cudaMemcpyHostToDevice, compute));
    collectives_all_gather(&c, data, 2 * shard, compute);
    download(&c, got, data, 2 * n, compute);
    wrong = 0;
    for (size_t i = 0; i < n; i++) wrong |= got[i] != bf16_bits(input_value((int)(i / shard), i));
    uint8_t *codes, *host_codes = (uint8_t *)malloc(n);
    for (size_t j = 0; j < n; j++) host_codes[j] = j / shard == (size_t)comm.rank ? (uint8_t)((comm.rank * 7 + j) % 251) : 0;
    cudaCheck(cudaMalloc(&codes, n));
    cudaCheck(cudaMemcpyAsync(codes, host_codes, n, cudaMemcpyHostToDevice, compute));
    collectives_all_gather(&c, codes, shard, compute);
    download(&c, host_codes, codes, n, compute);
    for (size_t j = 0; j < n; j++) wrong |= host_codes[j] != (uint8_t)(((j / shard) * 7 + j) % 251);
    if (wrong) { failures++; printf("rank %d: all-gather of BF16 elements or bytes wrong\n", comm.rank); }
    free(host_codes);
    cudaCheck(cudaFree(codes));

    // The max over the ranks of non-negative FP32 values, in place.
    float *maxima, *host_maxima = (float *)malloc(4 * shard);
    for (size_t i = 0; i < shard; i++) host_maxima[i] = input_value(comm.rank, i) * 1e-3f;
    cudaCheck(cudaMalloc(&maxima, 4 * shard));
    cudaCheck(cudaMemcpyAsync(maxima, host_maxima, 4 * shard, cudaMemcpyHostToDevice, compute));
    collectives_all_reduce_max_f32(&c, maxima, shard, compute);
    download(&c, host_maxima, maxima, 4 * shard, compute);
    wrong = 0;
    for (size_t i = 0; i < shard; i++) {
        float want = 0.0f;
        for (int r = 0; r < comm.world; r++) want = fmaxf(want, input_value(r, i) * 1e-3f);
        wrong |= host_maxima[i] != want;
    }
    if (wrong) { failures++; printf("rank %d: max all-reduce wrong\n", comm.rank); }
    free(host_maxima);
    cudaCheck(cudaFree(maxima));

    double sums_f64[2] = {comm.rank + 0.5, 1.0};
    collectives_all_reduce_sum_f64(&c, sums_f64, 2, compute, "the FP64 sums");
    if (comm.world > 1 && (sums_f64[0] != comm.world * comm.world / 2.0 || sums_f64[1] != comm.world)) {
        failures++;
        printf("rank %d: FP64 sums wrong\n", comm.rank);
    }

    if (comm.world % 2 == 0) failures += test_splits(&c, mine, shard, compute);

    printf("rank %d of %d: %s collectives %s\n", comm.rank, comm.world, argv[1], failures ? "WRONG" : "ok");
    collectives_close(&c);
    cudaCheck(cudaFree(data));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaStreamDestroy(compute));
    free(mine);
    free(expected);
    free(got);
    comm_finish(&comm);
    return failures ? 1 : 0;
}
