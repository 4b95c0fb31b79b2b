// The MPI backend of coat/collectives.cuh: each collective copies its GPU data out to pinned host
// memory, runs MPI's host collective (coat/comm.h), and copies the result back, the host thread
// waiting in between. Slow, but several ranks may share one GPU (the tests), with the same call
// sites and numerics contract as NCCL. Needs the ranks launched by mpirun.
#pragma once
#include "collectives.cuh"

typedef struct {
    uint16_t *host;  // pinned staging: a whole bucket, then room for one rank's part of it
    size_t host_elems;
    size_t max_elems;  // the largest bucket
} MpiCollectives;

#ifdef USE_MPI
static inline MpiCollectives *mpi_collectives(Collectives *c) { return (MpiCollectives *)c->backend; }

static inline void mpi_collectives_check_staging(Collectives *c, size_t elems, const char *what) {
    if (elems <= mpi_collectives(c)->host_elems) return;
    fprintf(stderr, "error: %s: %zu elements exceed the MPI backend's staging of %zu\n", what, elems,
            mpi_collectives(c)->host_elems);
    exit(EXIT_FAILURE);
}

// Device bytes into the staging at element `offset`, the host waiting for them; and back.
static inline void mpi_collectives_out(Collectives *c, const void *data, size_t bytes, size_t offset) {
    cudaCheck(cudaMemcpyAsync(mpi_collectives(c)->host + offset, data, bytes, cudaMemcpyDeviceToHost, c->stream));
    cudaCheck(cudaStreamSynchronize(c->stream));
}
static inline void mpi_collectives_in(Collectives *c, void *data, size_t bytes, size_t offset) {
    cudaCheck(cudaMemcpyAsync(data, mpi_collectives(c)->host + offset, bytes, cudaMemcpyHostToDevice, c->stream));
}

static inline void mpi_all_reduce_sum_bf16(Collectives *c, bf16 *data, size_t n) {
    mpi_collectives_check_staging(c, n, "all-reduce");
    mpi_collectives_out(c, data, 2 * n, 0);
    comm_all_reduce_sum_bf16(c->comm, mpi_collectives(c)->host, n);
    mpi_collectives_in(c, data, 2 * n, 0);
}

// The part lands after the whole bucket in the staging, then on the GPU.
static inline void mpi_reduce_scatter_sum_bf16(Collectives *c, const bf16 *data, bf16 *part, size_t part_n) {
    size_t n = (size_t)c->comm->world * part_n;
    mpi_collectives_check_staging(c, n + part_n, "reduce-scatter");
    mpi_collectives_out(c, data, 2 * n, 0);
    uint16_t *host = mpi_collectives(c)->host;
    comm_reduce_scatter_sum_bf16(c->comm, host, host + n, part_n);
    mpi_collectives_in(c, part, 2 * part_n, n);
}

static inline void mpi_all_gather(Collectives *c, void *data, size_t part_bytes) {
    size_t bytes = (size_t)c->comm->world * part_bytes, mine = (size_t)c->comm->rank * part_bytes;
    mpi_collectives_check_staging(c, (bytes + 1) / 2, "all-gather");
    unsigned char *host = (unsigned char *)mpi_collectives(c)->host;
    cudaCheck(cudaMemcpyAsync(host + mine, (unsigned char *)data + mine, part_bytes, cudaMemcpyDeviceToHost, c->stream));
    cudaCheck(cudaStreamSynchronize(c->stream));  // also: the previous copy out of the staging is done
    comm_all_gather(c->comm, host + mine, host, part_bytes);
    cudaCheck(cudaMemcpyAsync(data, host, bytes, cudaMemcpyHostToDevice, c->stream));
}

// As ints: the bits of non-negative floats order as the floats do.
static inline void mpi_all_reduce_max_f32(Collectives *c, float *data, size_t n) {
    mpi_collectives_check_staging(c, 2 * n, "max all-reduce");
    mpi_collectives_out(c, data, 4 * n, 0);
    comm_all_reduce_max_int(c->comm, (int *)mpi_collectives(c)->host, comm_int_count(n, "max all-reduce"));
    mpi_collectives_in(c, data, 4 * n, 0);
}

static inline void mpi_all_reduce_sum_f64(Collectives *c, double *values, int n) {
    cudaCheck(cudaStreamSynchronize(c->stream));
    comm_all_reduce_sum_f64(c->comm, values, n);
}

static inline void mpi_send_to_root(Collectives *c, const void *device, void *host, size_t bytes, int from, void *staging,
                                    void *device_staging) {
    (void)device_staging;
    collectives_send_to_root_over_mpi(c, device, host, bytes, from, staging);
}

// Staging for buckets of at most max_elems BF16 elements and one part of them over c's ranks.
static inline int mpi_collectives_staging(Collectives *c, size_t max_elems, char *error, size_t error_size) {
    MpiCollectives *m = (MpiCollectives *)calloc(1, sizeof(MpiCollectives));
    if (!m) {
        snprintf(error, error_size, "out of host memory for the MPI backend");
        return -1;
    }
    m->max_elems = max_elems;
    m->host_elems = max_elems + (max_elems + c->comm->world - 1) / c->comm->world;
    cudaCheck(cudaMallocHost((void **)&m->host, 2 * m->host_elems));
    c->backend = m;
    return 0;
}

// sub->comm's MPI communicator is MPI_Comm_split's (comm_split); its own staging, a part being
// larger among fewer ranks.
static inline int mpi_split(Collectives *c, Collectives *sub, int color, int key, char *error, size_t error_size) {
    (void)color;
    (void)key;
    return mpi_collectives_staging(sub, mpi_collectives(c)->max_elems, error, error_size);
}

static inline void mpi_collectives_close(Collectives *c) {
    cudaCheck(cudaFreeHost(mpi_collectives(c)->host));
    free(c->backend);
}

static const CollectiveOps mpi_collective_ops = {
    mpi_all_reduce_sum_bf16, mpi_reduce_scatter_sum_bf16, mpi_all_gather, mpi_all_reduce_max_f32,
    mpi_all_reduce_sum_f64,  mpi_send_to_root,            mpi_split,      mpi_collectives_close,
};
#endif

// Opens the backend for collectives of at most max_elems BF16 elements (a bucket; the staging
// holds it and one rank's part). Returns 0, or -1 with a message.
static inline int collectives_open_mpi(Collectives *c, size_t max_elems, char *error, size_t error_size) {
#ifdef USE_MPI
    if (c->comm->world > 1 && c->comm->launch != LAUNCH_MPI) {
        snprintf(error, error_size, "comm_backend = mpi needs the ranks launched by mpirun");
        return -1;
    }
    if (mpi_collectives_staging(c, max_elems, error, error_size) != 0) return -1;
    c->ops = &mpi_collective_ops;
    return 0;
#else
    (void)c;
    (void)max_elems;
    snprintf(error, error_size, "comm_backend = mpi needs a build with MPI (libopenmpi-dev)");
    return -1;
#endif
}
