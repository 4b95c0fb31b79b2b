// The NCCL backend of coat/collectives.cuh: NCCL on the GPUs, one rank per GPU (NCCL refuses two
// ranks on one device). Rank 0 makes the unique id; MPI broadcasts it, or, for ranks started
// without MPI, the rendezvous channel (coat/rendezvous.h). Under mpirun the host-side calls (the
// FP64 sums, a checkpoint chunk to rank 0) go over MPI; otherwise over NCCL too. With several
// ranks a watchdog thread polls the communicator's asynchronous error and aborts it on a hang.
#pragma once
#include <unistd.h>
#include "collectives.cuh"
#ifdef USE_NCCL
#include <nccl.h>

static inline void nccl_check(ncclResult_t result, const char *call, const char *file, int line) {
    if (result == ncclSuccess) return;
    fprintf(stderr, "error: %s failed at %s:%d: %s\n", call, file, line, ncclGetErrorString(result));
    exit(EXIT_FAILURE);
}
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)

static inline ncclComm_t nccl_of(Collectives *c) { return (ncclComm_t)c->backend; }

// The watchdog's backend: the asynchronous error of the communicator or of one of its splits,
// and the abort of them all.
static inline const char *nccl_async_error_of(ncclComm_t nccl, char *text, size_t size) {
    ncclResult_t state = ncclSuccess, asked = ncclCommGetAsyncError(nccl, &state);
    if (asked != ncclSuccess) state = asked;
    if (state == ncclSuccess || state == ncclInProgress) return NULL;
    snprintf(text, size, "%s (%s)", ncclGetErrorString(state), ncclGetLastError(nccl));
    return text;
}

static inline const char *nccl_async_error(void *backend, char *text, size_t size) {
    Collectives *c = (Collectives *)backend;
    const char *error = nccl_async_error_of(nccl_of(c), text, size);
    for (int i = 0, n = __atomic_load_n(&c->split_count, __ATOMIC_ACQUIRE); !error && i < n; i++)
        error = nccl_async_error_of(nccl_of(c->splits[i]), text, size);
    return error;
}

static inline void nccl_abort(void *backend, const char *message) {
    Collectives *c = (Collectives *)backend;
    fprintf(stderr, "%s\n", message);
    alarm(60);  // should the abort itself hang, SIGALRM ends the process
    for (int i = __atomic_load_n(&c->split_count, __ATOMIC_ACQUIRE) - 1; i >= 0; i--) ncclCommAbort(nccl_of(c->splits[i]));
    ncclCommAbort(nccl_of(c));
    _exit(EXIT_COLLECTIVE_FAILED);
}

static inline void nccl_all_reduce_sum_bf16(Collectives *c, bf16 *data, size_t n) {
    ncclCheck(ncclAllReduce(data, data, n, ncclBfloat16, ncclSum, nccl_of(c), c->stream));
}

static inline void nccl_reduce_scatter_sum_bf16(Collectives *c, const bf16 *data, bf16 *part, size_t part_n) {
    ncclCheck(ncclReduceScatter(data, part, part_n, ncclBfloat16, ncclSum, nccl_of(c), c->stream));
}

static inline void nccl_all_gather(Collectives *c, void *data, size_t part_bytes) {
    const char *mine = (const char *)data + (size_t)c->comm->rank * part_bytes;
    ncclCheck(ncclAllGather(mine, data, part_bytes, ncclUint8, nccl_of(c), c->stream));
}

static inline void nccl_all_reduce_max_f32(Collectives *c, float *data, size_t n) {
    ncclCheck(ncclAllReduce(data, data, n, ncclFloat32, ncclMax, nccl_of(c), c->stream));
}

static inline void nccl_all_reduce_sum_f64(Collectives *c, double *values, int n) {
#ifdef USE_MPI
    if (c->comm->launch == LAUNCH_MPI) {
        cudaCheck(cudaStreamSynchronize(c->stream));
        comm_all_reduce_sum_f64(c->comm, values, n);
        return;
    }
#endif
    cudaCheck(cudaMemcpyAsync(c->scalars, values, n * sizeof(double), cudaMemcpyHostToDevice, c->stream));
    ncclCheck(ncclAllReduce(c->scalars, c->scalars, n, ncclFloat64, ncclSum, nccl_of(c), c->stream));
    cudaCheck(cudaMemcpyAsync(values, c->scalars, n * sizeof(double), cudaMemcpyDeviceToHost, c->stream));
    cudaCheck(cudaStreamSynchronize(c->stream));
}

// Ranks started without MPI send the chunk into rank 0's device buffer `device_staging`.
static inline void nccl_send_to_root(Collectives *c, const void *device, void *host, size_t bytes, int from, void *staging,
                                     void *device_staging) {
#ifdef USE_MPI
    if (c->comm->launch == LAUNCH_MPI) {
        collectives_send_to_root_over_mpi(c, device, host, bytes, from, staging);
        return;
    }
#endif
    (void)staging;
    if (c->comm->rank == from) {
        ncclCheck(ncclSend(device, bytes, ncclUint8, 0, nccl_of(c), c->stream));
    } else {
        ncclCheck(ncclRecv(device_staging, bytes, ncclUint8, from, nccl_of(c), c->stream));
        cudaCheck(cudaMemcpyAsync(host, device_staging, bytes, cudaMemcpyDeviceToHost, c->stream));
    }
    char what[64];
    snprintf(what, sizeof(what), "the checkpoint chunk from rank %d to rank 0", from);
    collectives_wait_stream(c, c->stream, what);
}

// ncclCommSplit: blocking, every rank of c calls it. The whole's watchdog polls the split's
// asynchronous errors and aborts it with the whole.
static inline int nccl_split(Collectives *c, Collectives *sub, int color, int key, char *error, size_t error_size) {
    ncclComm_t nccl;
    ncclResult_t split = ncclCommSplit(nccl_of(c), color, key, &nccl, NULL);
    if (split != ncclSuccess) {
        snprintf(error, error_size, "ncclCommSplit on rank %d of %d (color %d): %s", c->comm->rank, c->comm->world, color,
                 ncclGetErrorString(split));
        return -1;
    }
    sub->backend = nccl;
    return 0;
}

static inline void nccl_collectives_close(Collectives *c) { ncclCheck(ncclCommDestroy(nccl_of(c))); }

static const CollectiveOps nccl_collective_ops = {
    nccl_all_reduce_sum_bf16, nccl_reduce_scatter_sum_bf16, nccl_all_gather, nccl_all_reduce_max_f32,
    nccl_all_reduce_sum_f64,  nccl_send_to_root,            nccl_split,      nccl_collectives_close,
};
#endif

// Joins the ranks' communicator on the current device; with several ranks the watchdog starts,
// timeout_s its limit on one wait (MPI itself ends a job whose rank dies). Returns 0, or -1 with
// a message.
static inline int collectives_open_nccl(Collectives *c, double timeout_s, char *error, size_t error_size) {
#ifdef USE_NCCL
    const Comm *comm = c->comm;
    ncclUniqueId id;
    if (comm->rank == 0) ncclCheck(ncclGetUniqueId(&id));
    if (comm->launch == LAUNCH_MPI) {
#ifdef USE_MPI
        comm_broadcast(comm, &id, sizeof(id), 0);
#endif
    } else if (comm->world > 1) {
        if (comm_bcast0(comm, &id, sizeof(id), error, error_size) != 0) return -1;
    }
    ncclComm_t nccl;
    ncclResult_t joined = ncclCommInitRank(&nccl, comm->world, id, comm->rank);
    if (joined != ncclSuccess) {
        snprintf(error, error_size, "ncclCommInitRank on rank %d of %d: %s (one cause: two ranks on one GPU, which NCCL "
                 "refuses; comm_backend = mpi lets ranks share one)", comm->rank, comm->world, ncclGetErrorString(joined));
        return -1;
    }
    c->backend = nccl;
    c->ops = &nccl_collective_ops;
    if (comm->world == 1) return 0;
    Watchdog *w = (Watchdog *)malloc(sizeof(Watchdog));
    if (!w || watchdog_start(w, comm->rank, timeout_s, WATCHDOG_POLL_S, nccl_async_error, nccl_abort, c) != 0) {
        free(w);
        snprintf(error, error_size, "cannot start the collectives' watchdog thread");
        return -1;
    }
    c->watchdog = w;
    return 0;
#else
    (void)c;
    (void)timeout_s;
    snprintf(error, error_size, "comm_backend = nccl needs a build with NCCL (nccl.h)");
    return -1;
#endif
}
