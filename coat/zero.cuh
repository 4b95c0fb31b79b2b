// The collectives ZeRO runs on GPU buffers (coat/zero.h says which), on their own stream, ordered
// with the compute stream by events in both directions: a collective waits for the work its
// producer stream had queued, and a consumer stream waits for the collectives (zero_comm_join).
// Backends:
//   nccl: NCCL on the GPUs (one rank per GPU: NCCL refuses two ranks on one device). Rank 0 makes
//         the unique id; MPI broadcasts it, or, for ranks started without MPI, the rendezvous
//         channel (coat/rendezvous.h).
//   mpi:  through pinned host memory: copy out, MPI's host collective (coat/comm.h), copy back,
//         the host thread waiting in between; slow, but several ranks may share one GPU (tests),
//         with the same call sites and the same numerics contract (BF16 sums rounded after each
//         addition, in an order the library picks).
// Besides the all-reduce, reduce and broadcast: a bucket's reduce to the owners of its parts
// (ZeRO stages 1 and 2, the latter with the owner's FP32 accumulation), its inverse (the owners'
// parts of a range to every rank: the parameter gather, in BF16 or E4M3), a max of FP32 maxima,
// and the gather of checkpoint chunks to rank 0.
// BF16 buffers are uint16-sized elements; n counts elements. Every rank calls every collective
// in the same order with the same sizes.
// With NCCL and several ranks a watchdog thread (coat/watchdog.h) ends a rank whose collectives
// fail (NCCL's asynchronous error) or hang: the host waits that include collectives go through
// zero_wait_stream / zero_wait_event, named, and one that lasts longer than collective_timeout_s
// aborts the communicator and exits with EXIT_COLLECTIVE_FAILED, naming the rank and the wait.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "comm.h"
#include "common.cuh"
#include "watchdog.h"
#include "zero.h"
#ifdef USE_NCCL
#include <nccl.h>
#endif

typedef enum { ZERO_BACKEND_NCCL, ZERO_BACKEND_MPI } ZeroBackend;

typedef struct {
    const Comm *comm;
    ZeroBackend backend;
    cudaStream_t stream;
    cudaEvent_t produced, finished;  // producer -> collectives, collectives -> consumer
    uint16_t *host;                  // the MPI backend's pinned staging, host_elems elements
    size_t host_elems;
    double *scalars;                 // device room for zero_all_reduce_sum_f64 over NCCL
    Watchdog *watchdog;              // NCCL with world > 1, else NULL
#ifdef USE_NCCL
    ncclComm_t nccl;
#endif
} ZeroComm;

#ifdef USE_NCCL
static inline void nccl_check(ncclResult_t result, const char *call, const char *file, int line) {
    if (result == ncclSuccess) return;
    fprintf(stderr, "error: %s failed at %s:%d: %s\n", call, file, line, ncclGetErrorString(result));
    exit(EXIT_FAILURE);
}
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)

// The watchdog's backend: the communicator's asynchronous error, and the abort.
static inline const char *zero_nccl_async_error(void *backend, char *text, size_t size) {
    ZeroComm *z = (ZeroComm *)backend;
    ncclResult_t state = ncclSuccess, asked = ncclCommGetAsyncError(z->nccl, &state);
    if (asked != ncclSuccess) state = asked;
    if (state == ncclSuccess || state == ncclInProgress) return NULL;
    snprintf(text, size, "%s (%s)", ncclGetErrorString(state), ncclGetLastError(z->nccl));
    return text;
}

static inline void zero_nccl_abort(void *backend, const char *message) {
    fprintf(stderr, "%s\n", message);
    alarm(60);  // should the abort itself hang, SIGALRM ends the process
    ncclCommAbort(((ZeroComm *)backend)->nccl);
    _exit(EXIT_COLLECTIVE_FAILED);
}
#endif

// The host waits for `stream` (or `event`), whose work includes collectives, named by `what`
// for the watchdog's message: "the gradient reduces of step 12".
static inline void zero_wait_begin(ZeroComm *z, const char *what) {
    if (z->watchdog) watchdog_wait_begin(z->watchdog, what);
}
static inline void zero_wait_end(ZeroComm *z) {
    if (z->watchdog) watchdog_wait_end(z->watchdog);
}
static inline void zero_wait_stream(ZeroComm *z, cudaStream_t stream, const char *what) {
    zero_wait_begin(z, what);
    cudaCheck(cudaStreamSynchronize(stream));
    zero_wait_end(z);
}
static inline void zero_wait_event(ZeroComm *z, cudaEvent_t event, const char *what) {
    zero_wait_begin(z, what);
    cudaCheck(cudaEventSynchronize(event));
    zero_wait_end(z);
}

// Sets up the backend on the current device for collectives of at most max_elems BF16 elements
// (the MPI backend's staging holds max_elems and a shard of them to reduce into). For NCCL ranks
// started without MPI the unique id travels through the rendezvous channel (comm_meet); with
// several, the watchdog starts, timeout_s its limit on one wait (MPI itself ends a job whose rank
// dies). Returns 0, or -1 with a message.
static inline int zero_comm_init(ZeroComm *z, const Comm *comm, ZeroBackend backend, size_t max_elems, double timeout_s,
                                 char *error, size_t error_size) {
    memset(z, 0, sizeof(*z));
    z->comm = comm;
    z->backend = backend;
    cudaCheck(cudaStreamCreateWithFlags(&z->stream, cudaStreamNonBlocking));
    cudaCheck(cudaEventCreateWithFlags(&z->produced, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&z->finished, cudaEventDisableTiming));
    z->scalars = (double *)gpu_alloc(ZERO_SCALAR_BYTES, "the collectives' scalars");  // planned with either backend
    if (backend == ZERO_BACKEND_MPI) {
#ifdef USE_MPI
        if (comm->world > 1 && comm->launch != LAUNCH_MPI) {
            snprintf(error, error_size, "comm_backend = mpi needs the ranks launched by mpirun");
            return -1;
        }
        z->host_elems = max_elems + (max_elems + comm->world - 1) / comm->world;
        cudaCheck(cudaMallocHost((void **)&z->host, 2 * z->host_elems));
        return 0;
#else
        (void)max_elems;
        snprintf(error, error_size, "comm_backend = mpi needs a build with MPI (libopenmpi-dev)");
        return -1;
#endif
    }
#ifdef USE_NCCL
    ncclUniqueId id;
    if (comm->rank == 0) ncclCheck(ncclGetUniqueId(&id));
    if (comm->launch == LAUNCH_MPI) {
#ifdef USE_MPI
        comm_broadcast(comm, &id, sizeof(id), 0);
#endif
    } else if (comm->world > 1) {
        if (comm_bcast0(comm, &id, sizeof(id), error, error_size) != 0) return -1;
    }
    ncclResult_t joined = ncclCommInitRank(&z->nccl, comm->world, id, comm->rank);
    if (joined != ncclSuccess) {
        snprintf(error, error_size, "ncclCommInitRank on rank %d of %d: %s (one cause: two ranks on one GPU, which NCCL "
                 "refuses; comm_backend = mpi lets ranks share one)", comm->rank, comm->world, ncclGetErrorString(joined));
        return -1;
    }
    if (comm->world == 1) return 0;
    Watchdog *w = (Watchdog *)malloc(sizeof(Watchdog));
    if (!w || watchdog_start(w, comm->rank, timeout_s, WATCHDOG_POLL_S, zero_nccl_async_error, zero_nccl_abort, z) != 0) {
        free(w);
        snprintf(error, error_size, "cannot start the collectives' watchdog thread");
        return -1;
    }
    z->watchdog = w;
    return 0;
#else
    (void)max_elems;
    (void)timeout_s;
    snprintf(error, error_size, "comm_backend = nccl needs a build with NCCL (nccl.h)");
    return -1;
#endif
}

static inline void zero_comm_free(ZeroComm *z) {
    zero_wait_stream(z, z->stream, "the last collectives");
    if (z->watchdog) {
        watchdog_stop(z->watchdog);
        free(z->watchdog);
    }
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) ncclCheck(ncclCommDestroy(z->nccl));
#endif
    if (z->host) cudaCheck(cudaFreeHost(z->host));
    if (z->scalars) cudaCheck(cudaFree(z->scalars));
    cudaCheck(cudaEventDestroy(z->produced));
    cudaCheck(cudaEventDestroy(z->finished));
    cudaCheck(cudaStreamDestroy(z->stream));
    memset(z, 0, sizeof(*z));
}

// The collectives' stream waits for what `producer` had queued.
static inline void zero_comm_after(ZeroComm *z, cudaStream_t producer) {
    cudaCheck(cudaEventRecord(z->produced, producer));
    cudaCheck(cudaStreamWaitEvent(z->stream, z->produced, 0));
}

// `consumer` waits for every collective queued so far.
static inline void zero_comm_join(ZeroComm *z, cudaStream_t consumer) {
    cudaCheck(cudaEventRecord(z->finished, z->stream));
    cudaCheck(cudaStreamWaitEvent(consumer, z->finished, 0));
}

#ifdef USE_MPI
static inline void zero_check_staging(const ZeroComm *z, size_t elems, const char *what) {
    if (elems <= z->host_elems) return;
    fprintf(stderr, "error: %s: %zu elements exceed the MPI backend's staging of %zu\n", what, elems, z->host_elems);
    exit(EXIT_FAILURE);
}

// Device data[n] into the staging buffer at `offset`, the host waiting for it.
static inline void zero_stage_out(ZeroComm *z, const void *data, size_t n, size_t offset) {
    cudaCheck(cudaMemcpyAsync(z->host + offset, data, 2 * n, cudaMemcpyDeviceToHost, z->stream));
    cudaCheck(cudaStreamSynchronize(z->stream));
}
static inline void zero_stage_in(ZeroComm *z, void *data, size_t n, size_t offset) {
    cudaCheck(cudaMemcpyAsync(data, z->host + offset, 2 * n, cudaMemcpyHostToDevice, z->stream));
}
#endif

// data[n] BF16 summed over the ranks, in place (ZeRO stage 0's gradients).
// (In a build with neither backend zero_comm_init refuses, so the collectives never run: the
// (void) lines below only keep such a build free of unused-parameter warnings.)
static inline void zero_all_reduce_bf16(ZeroComm *z, bf16 *data, size_t n, cudaStream_t producer) {
    (void)data;
    (void)n;
    zero_comm_after(z, producer);
    if (z->comm->world == 1) return;
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) {
        ncclCheck(ncclAllReduce(data, data, n, ncclBfloat16, ncclSum, z->nccl, z->stream));
        return;
    }
#endif
#ifdef USE_MPI
    zero_check_staging(z, n, "zero_all_reduce_bf16");
    zero_stage_out(z, data, n, 0);
    comm_all_reduce_sum_bf16(z->comm, z->host, n);
    zero_stage_in(z, data, n, 0);
#endif
}

// data[n] BF16 summed over the ranks into out[n] on rank `root` only (a bucket's part to its
// owner); out may be data.
static inline void zero_reduce_bf16(ZeroComm *z, const bf16 *data, bf16 *out, size_t n, int root, cudaStream_t producer) {
    (void)root;
    zero_comm_after(z, producer);
    const Comm *c = z->comm;
    if (c->world == 1) {
        if (out != data) cudaCheck(cudaMemcpyAsync(out, data, 2 * n, cudaMemcpyDeviceToDevice, z->stream));
        return;
    }
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) {
        ncclCheck(ncclReduce(data, out, n, ncclBfloat16, ncclSum, root, z->nccl, z->stream));
        return;
    }
#endif
#ifdef USE_MPI
    zero_check_staging(z, n, "zero_reduce_bf16");
    zero_stage_out(z, data, n, 0);
    comm_reduce_sum_bf16(c, z->host, z->host, n, root);
    if (c->rank == root) zero_stage_in(z, out, n, 0);
#endif
}

// bytes of data from rank `root` to every rank, in place.
static inline void zero_broadcast(ZeroComm *z, void *data, size_t bytes, int root, cudaStream_t producer) {
    (void)data;
    (void)bytes;
    (void)root;
    zero_comm_after(z, producer);
    const Comm *c = z->comm;
    if (c->world == 1) return;
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) {
        ncclCheck(ncclBroadcast(data, data, bytes, ncclUint8, root, z->nccl, z->stream));
        return;
    }
#endif
#ifdef USE_MPI
    size_t elems = (bytes + 1) / 2;
    zero_check_staging(z, elems, "zero_broadcast");
    if (c->rank == root) cudaCheck(cudaMemcpyAsync(z->host, data, bytes, cudaMemcpyDeviceToHost, z->stream));
    cudaCheck(cudaStreamSynchronize(z->stream));  // also: the previous copy out of the staging is done
    comm_broadcast(c, z->host, bytes, root);
    if (c->rank != root) cudaCheck(cudaMemcpyAsync(data, z->host, bytes, cudaMemcpyHostToDevice, z->stream));
#endif
}

// data[n] FP32, all >= 0 (maxima of magnitudes), replaced on every rank by its maximum over the
// ranks. Over MPI as ints: the bits of non-negative floats order as the floats do.
static inline void zero_all_reduce_max_f32(ZeroComm *z, float *data, size_t n, cudaStream_t producer) {
    (void)data;
    (void)n;
    zero_comm_after(z, producer);
    const Comm *c = z->comm;
    if (c->world == 1) return;
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) {
        ncclCheck(ncclAllReduce(data, data, n, ncclFloat32, ncclMax, z->nccl, z->stream));
        return;
    }
#endif
#ifdef USE_MPI
    zero_check_staging(z, 2 * n, "zero_all_reduce_max_f32");
    zero_stage_out(z, data, 2 * n, 0);
    comm_all_reduce_max_int(c, (int *)z->host, comm_int_count(n, "zero_all_reduce_max_f32"));
    zero_stage_in(z, data, 2 * n, 0);
#endif
}

__global__ void zero_accumulate_kernel(float *sum, const bf16 *part, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) sum[i] += __bfloat162float(part[i]);
}

// One bucket of the gradient, `range` of the parameter buffer in data, summed over the ranks
// straight to the ranks that own its parts (one reduce per owner, grouped), in place. Stage 2:
// this rank then adds its own part, in FP32, into shard_sum (its shard's accumulator) and `done`
// is recorded: data may be written again once a stream waits for it. Stage 1 (shard_sum NULL):
// the owned parts stay in data, where a reduce-scatter would have put them.
static inline void zero_reduce_bucket(ZeroComm *z, const ZeroPlan *plan, bf16 *data, ZeroRange range, float *shard_sum,
                                      cudaEvent_t done, cudaStream_t producer) {
    const Comm *c = z->comm;
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) ncclCheck(ncclGroupStart());
#endif
    for (int r = 0; r < c->world; r++) {
        ZeroRange part = zero_owned_part(plan, range, r);
        bf16 *at = data + (part.begin - range.begin);
        if (part.end > part.begin) zero_reduce_bf16(z, at, at, part.end - part.begin, r, producer);
    }
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) ncclCheck(ncclGroupEnd());
#endif
    if (!shard_sum) return;
    ZeroRange mine = zero_owned_part(plan, range, c->rank);
    size_t n = mine.end - mine.begin;
    if (n > 0) {
        zero_accumulate_kernel<<<(unsigned)ceil_div_size(n, 256), 256, 0, z->stream>>>(
            shard_sum + (mine.begin - zero_shard(plan, c->rank).begin), data + (mine.begin - range.begin), n);
        cudaCheckLaunch();
    }
    cudaCheck(cudaEventRecord(done, z->stream));
}

// The inverse of a stage-1 bucket reduce: `range` of the parameter buffer, laid out in data at
// elem_bytes per element (BF16 parameters, or E4M3 codes), sent from the ranks that own its
// parts to every rank (one broadcast per owner, grouped), in place.
static inline void zero_broadcast_parts(ZeroComm *z, const ZeroPlan *plan, void *data, size_t elem_bytes, ZeroRange range,
                                        cudaStream_t producer) {
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) ncclCheck(ncclGroupStart());
#endif
    for (int r = 0; r < z->comm->world; r++) {
        ZeroRange part = zero_owned_part(plan, range, r);
        if (part.end > part.begin)
            zero_broadcast(z, (char *)data + (part.begin - range.begin) * elem_bytes, (part.end - part.begin) * elem_bytes, r,
                           producer);
    }
#ifdef USE_NCCL
    if (z->backend == ZERO_BACKEND_NCCL) ncclCheck(ncclGroupEnd());
#endif
}

// values[n] (n <= ZERO_SCALARS) FP64 on the host, summed over the ranks in place on every rank:
// losses and squared norms. Over MPI when the run was launched by it, else NCCL on a device
// copy. Waits for the result (and for `producer`'s queued work): the wait the watchdog names `what`.
static inline void zero_all_reduce_sum_f64(ZeroComm *z, double *values, int n, cudaStream_t producer, const char *what) {
    (void)values;
    (void)n;
    const Comm *c = z->comm;
    if (c->world == 1) return;
    zero_comm_after(z, producer);
    zero_wait_begin(z, what);
#ifdef USE_MPI
    if (c->launch == LAUNCH_MPI) {
        cudaCheck(cudaStreamSynchronize(z->stream));
        comm_all_reduce_sum_f64(c, values, n);
        zero_wait_end(z);
        return;
    }
#endif
#ifdef USE_NCCL
    if (n > ZERO_SCALARS) {
        fprintf(stderr, "error: zero_all_reduce_sum_f64: %d values, at most %d\n", n, ZERO_SCALARS);
        exit(EXIT_FAILURE);
    }
    cudaCheck(cudaMemcpyAsync(z->scalars, values, n * sizeof(double), cudaMemcpyHostToDevice, z->stream));
    ncclCheck(ncclAllReduce(z->scalars, z->scalars, n, ncclFloat64, ncclSum, z->nccl, z->stream));
    cudaCheck(cudaMemcpyAsync(values, z->scalars, n * sizeof(double), cudaMemcpyDeviceToHost, z->stream));
    cudaCheck(cudaStreamSynchronize(z->stream));
#endif
    zero_wait_end(z);
}

// `bytes` of rank `from`'s device memory into rank 0's host memory `host` (a checkpoint's
// shards reach the rank that writes it, a chunk at a time); ranks other than 0 and `from` return
// at once. Under mpirun the chunk travels over MPI through `from`'s host buffer `staging`; NCCL
// ranks started without MPI send it into rank 0's device buffer `device_staging`. Waits for it.
static inline void zero_gather_to_root(ZeroComm *z, const void *device, void *host, size_t bytes, int from, void *staging,
                                       void *device_staging) {
    (void)staging;
    (void)device_staging;
    const Comm *c = z->comm;
    if (c->rank != 0 && c->rank != from) return;
    if (from == 0) {
        cudaCheck(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, z->stream));
        cudaCheck(cudaStreamSynchronize(z->stream));
        return;
    }
#ifdef USE_MPI
    if (c->launch == LAUNCH_MPI) {
        if (c->rank == from) {
            cudaCheck(cudaMemcpyAsync(staging, device, bytes, cudaMemcpyDeviceToHost, z->stream));
            cudaCheck(cudaStreamSynchronize(z->stream));
            comm_send(c, staging, bytes, 0);
        } else {
            comm_recv(c, host, bytes, from);
        }
        return;
    }
#endif
#ifdef USE_NCCL
    if (c->rank == from) {
        ncclCheck(ncclSend(device, bytes, ncclUint8, 0, z->nccl, z->stream));
    } else {
        ncclCheck(ncclRecv(device_staging, bytes, ncclUint8, from, z->nccl, z->stream));
        cudaCheck(cudaMemcpyAsync(host, device_staging, bytes, cudaMemcpyDeviceToHost, z->stream));
    }
    char what[64];
    snprintf(what, sizeof(what), "the checkpoint chunk from rank %d to rank 0", from);
    zero_wait_stream(z, z->stream, what);
#endif
}
