// Not a test: times the two collectives ZeRO issues per bucket, the BF16 reduce-scatter of the
// gradients and the all-gather of the parameters' bytes, on the ranks of this launch, one per GPU:
// bench_collectives [nccl|mpi]. Buckets from 64 KiB to 1 GiB; rank 0 prints one JSON line per
// collective and size, the median of 10 timed calls after 3 untimed ones:
//   {"op": "reduce_scatter", "world": 8, "bucket_bytes": B, "sent_bytes": S, "ms": T, "bus_gb_s": G}
// where S = (W - 1) / W x B is what each rank sends on a ring and G = S / T.
// scripts/bench_scaling.sh runs it on 2, 4, ... GPUs and scripts/predict_scaling.py --calibrate
// fits a call's latency, its latency per hop and the bus bandwidth to those lines.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/zero.cuh"

#define BENCH_REPS 10
#define BENCH_WARMUP 3

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// The median time of one collective on `bucket_bytes`, in ms (every rank takes part).
static float time_collective(Collectives *c, int reduce_scatter, void *data, size_t bucket_bytes, cudaStream_t compute) {
    size_t part_bytes = bucket_bytes / (size_t)c->comm->world;
    bf16 *elements = (bf16 *)data;
    cudaEvent_t start[BENCH_REPS], stop[BENCH_REPS];
    for (int i = 0; i < BENCH_REPS; i++) {
        cudaCheck(cudaEventCreate(&start[i]));
        cudaCheck(cudaEventCreate(&stop[i]));
    }
    for (int i = -BENCH_WARMUP; i < BENCH_REPS; i++) {
        if (i >= 0) cudaCheck(cudaEventRecord(start[i], c->stream));
        if (reduce_scatter)  // in place, as stage 2 reduces a bucket: this rank's part of the sum
            collectives_reduce_scatter_sum_bf16(c, elements, elements + (size_t)c->comm->rank * part_bytes / 2, part_bytes / 2,
                                                compute);
        else
            collectives_all_gather(c, data, part_bytes, compute);
        if (i >= 0) cudaCheck(cudaEventRecord(stop[i], c->stream));
    }
    collectives_wait_stream(c, c->stream, "the timed collectives");
    float ms[BENCH_REPS];
    for (int i = 0; i < BENCH_REPS; i++) {
        cudaCheck(cudaEventElapsedTime(&ms[i], start[i], stop[i]));
        cudaCheck(cudaEventDestroy(start[i]));
        cudaCheck(cudaEventDestroy(stop[i]));
    }
    qsort(ms, BENCH_REPS, sizeof(float), compare_floats);
    return 0.5f * (ms[BENCH_REPS / 2 - 1] + ms[BENCH_REPS / 2]);
}

int main(int argc, char **argv) {
    char error[512];
    Comm comm;
    if (argc > 2 || (argc == 2 && strcmp(argv[1], "nccl") != 0 && strcmp(argv[1], "mpi") != 0)) {
        fprintf(stderr, "usage: bench_collectives [nccl|mpi]   (one rank per GPU: mpirun -np N, srun or torchrun)\n");
        return 2;
    }
    if (comm_init(&comm, &argc, &argv, error, sizeof(error)) != 0 || comm_meet(&comm, ".", 120.0, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    if (comm.world < 2) {
        fprintf(stderr, "error: bench_collectives times collectives between ranks: launch 2 or more (mpirun -np N)\n");
        return 2;
    }
    int devices = 0;
    cudaCheck(cudaGetDeviceCount(&devices));
    cudaCheck(cudaSetDevice(comm.local_rank % devices));
    const size_t smallest = (size_t)64 << 10, largest = (size_t)1 << 30;
    size_t unit = 2 * (size_t)comm.world * 128;  // every bucket a whole number of BF16 parts of 128
    Collectives c;
    CollectivesBackend backend = argc == 2 && strcmp(argv[1], "mpi") == 0 ? COLLECTIVES_MPI : COLLECTIVES_NCCL;
    if (zero_open_collectives(&c, &comm, backend, largest / 2, 120.0, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    void *data = gpu_alloc(largest, "the collectives' bucket");
    cudaCheck(cudaMemset(data, 0, largest));  // zeros: sums of BF16 zeros, whose time is any sum's
    cudaStream_t compute;
    cudaCheck(cudaStreamCreate(&compute));
    for (size_t size = smallest; size <= largest; size *= 4) {
        size_t bucket = size / unit * unit;
        for (int reduce_scatter = 1; reduce_scatter >= 0; reduce_scatter--) {
            float ms = time_collective(&c, reduce_scatter, data, bucket, compute);
            double sent = (double)bucket * (comm.world - 1) / comm.world;
            if (comm.rank == 0)
                printf("{\"op\": \"%s\", \"world\": %d, \"bucket_bytes\": %zu, \"sent_bytes\": %.0f, \"ms\": %.4f, "
                       "\"bus_gb_s\": %.1f}\n",
                       reduce_scatter ? "reduce_scatter" : "all_gather", comm.world, bucket, sent, ms, sent / (ms * 1e-3) / 1e9);
        }
    }
    fflush(stdout);
    cudaCheck(cudaStreamDestroy(compute));
    cudaCheck(cudaFree(data));
    collectives_close(&c);
    comm_finish(&comm);
    return 0;
}
