// The program test/test_zero_gpu.sh launches as several ranks to test coat/zero.cuh on GPU
// buffers: zero_ranks BACKEND (nccl or mpi). Each rank drives GPU local_rank % GPUs (the MPI
// backend lets several ranks share one); every collective on inputs each rank can compute for all
// the others, checked exactly (sums of multiples of 1/8 below 32 are exact in BF16).
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

int main(int argc, char **argv) {
    char error[512];
    Comm comm;
    if (argc != 2 || (strcmp(argv[1], "nccl") != 0 && strcmp(argv[1], "mpi") != 0)) {
        fprintf(stderr, "usage: zero_ranks nccl|mpi\n");
        return 2;
    }
    if (comm_init(&comm, &argc, &argv, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    int devices = 0;
    cudaCheck(cudaGetDeviceCount(&devices));
    cudaCheck(cudaSetDevice(comm.local_rank % devices));
    size_t shard = 4096 + 8, n = (size_t)comm.world * shard;
    ZeroComm z;
    ZeroBackend backend = strcmp(argv[1], "nccl") == 0 ? ZERO_BACKEND_NCCL : ZERO_BACKEND_MPI;
    if (zero_comm_init(&z, &comm, backend, n, ".", error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
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

    // reduce-scatter in place (the shard's own place in the buffer), then the all-gather in place
    cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
    zero_reduce_scatter_bf16(&z, data, data + place, shard, compute);
    zero_comm_join(&z, compute);
    cudaCheck(cudaMemcpyAsync(got, data + place, 2 * shard, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    if (memcmp(got, expected + place, 2 * shard) != 0) { failures++; printf("rank %d: reduce-scatter wrong\n", comm.rank); }
    zero_all_gather_bf16(&z, data + place, data, shard, compute);
    zero_comm_join(&z, compute);
    cudaCheck(cudaMemcpyAsync(got, data, 2 * n, cudaMemcpyDeviceToHost, compute));
    cudaCheck(cudaStreamSynchronize(compute));
    if (memcmp(got, expected, 2 * n) != 0) { failures++; printf("rank %d: all-gather wrong\n", comm.rank); }

    for (int root = 0; root < comm.world; root++) {  // a bucket's part to each owner in turn
        cudaCheck(cudaMemcpyAsync(data, mine, 2 * n, cudaMemcpyHostToDevice, compute));
        cudaCheck(cudaMemsetAsync(out, 0, 2 * n, compute));
        zero_reduce_bf16(&z, data + 8, out, 1000, root, compute);
        zero_comm_join(&z, compute);
        cudaCheck(cudaMemcpyAsync(got, out, 2 * 1000, cudaMemcpyDeviceToHost, compute));
        cudaCheck(cudaStreamSynchronize(compute));
        if (comm.rank == root && memcmp(got, expected + 8, 2 * 1000) != 0) { failures++; printf("rank %d: reduce to %d wrong\n", comm.rank, root); }
    }
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
