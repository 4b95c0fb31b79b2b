// The collectives data parallelism runs on GPU buffers, behind one interface (CollectiveOps) that
// each backend fills in its own file: coat/collectives_nccl.cuh (NCCL on the GPUs, one rank per
// GPU) and coat/collectives_mpi.cuh (MPI through pinned host memory, which lets ranks share a GPU
// for tests). A new backend is one new file and one case in collectives_open.
// Every collective runs on the collectives' own stream, ordered with the compute stream by events
// in both directions: it waits for the work its producer stream had queued, and a consumer stream
// waits for the collectives (collectives_join). The wrappers below do that ordering and the one-rank
// shortcuts, so that a backend only moves data.
// The data calls, one per gradient bucket or parameter bucket (coat/zero.h): an all-reduce of BF16
// sums (stage 0), a reduce-scatter of BF16 sums (stages 1 and 2: rank r receives the sum of
// part r), an in-place all-gather of bytes (rank r's part at r x part_bytes), a max of FP32
// maxima; and host-side: a sum of a few FP64 values, and a checkpoint chunk to rank 0.
// A split (collectives_split: ncclCommSplit, MPI_Comm_split) gives a part of the ranks their own
// collectives, queued on the same stream with the same events as the whole's, so that the
// whole's joins and waits and its watchdog (timeouts and NCCL errors) cover them: ZeRO's hybrid
// sharding runs the buckets within groups of ranks and sums their gradient parts across the groups.
// BF16 sums round after each addition, in an order the library picks. Every rank calls every
// collective in the same order with the same sizes.
// With NCCL and several ranks a watchdog thread (coat/watchdog.h) ends a rank whose collectives
// fail or hang: host waits that include collectives go through collectives_wait_stream /
// collectives_wait_event, named, and one that lasts longer than collective_timeout_s aborts the
// communicator and exits with EXIT_COLLECTIVE_FAILED, naming the rank and the wait.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "comm.h"
#include "common.cuh"
#include "watchdog.h"

typedef enum { COLLECTIVES_NCCL, COLLECTIVES_MPI } CollectivesBackend;

typedef struct Collectives Collectives;

// What a backend does, on c->stream (after the wrapper ordered it), for world > 1.
typedef struct {
    void (*all_reduce_sum_bf16)(Collectives *c, bf16 *data, size_t n);
    void (*reduce_scatter_sum_bf16)(Collectives *c, const bf16 *data, bf16 *part, size_t part_n);
    void (*all_gather)(Collectives *c, void *data, size_t part_bytes);
    void (*all_reduce_max_f32)(Collectives *c, float *data, size_t n);
    void (*all_reduce_sum_f64)(Collectives *c, double *values, int n);  // host values; returns with the result
    // rank `from`'s device bytes into rank 0's host memory (only those two ranks call it)
    void (*send_to_root)(Collectives *c, const void *device, void *host, size_t bytes, int from, void *staging,
                         void *device_staging);
    // sub's backend for the ranks of c that pass the same color (sub->comm their split, made already)
    int (*split)(Collectives *c, Collectives *sub, int color, int key, char *error, size_t error_size);
    void (*close)(Collectives *c);
} CollectiveOps;

#define COLLECTIVES_MAX_SPLITS 2  // ZeRO's hybrid sharding: the group's and the replicas'

struct Collectives {
    const CollectiveOps *ops;
    const Comm *comm;
    cudaStream_t stream;
    cudaEvent_t produced, finished;  // producer -> collectives, collectives -> consumer
    double *scalars;                 // device room for the FP64 sums (planned with either backend)
    int scalar_count;
    Watchdog *watchdog;              // NCCL with world > 1, else NULL
    void *backend;                   // the backend's own state
    Collectives *whole;              // a split's: the collectives it shares its stream, events and scalars with
    Collectives *splits[COLLECTIVES_MAX_SPLITS];  // the whole's open splits, whose errors its watchdog also polls
    int split_count;                 // published after splits[] (the watchdog thread reads both)
};

// The host waits for `stream` (or `event`), whose work includes collectives, named by `what`
// for the watchdog's message: "the gradient reduces of step 12".
static inline void collectives_wait_begin(Collectives *c, const char *what) {
    if (c->watchdog) watchdog_wait_begin(c->watchdog, what);
}
static inline void collectives_wait_end(Collectives *c) {
    if (c->watchdog) watchdog_wait_end(c->watchdog);
}
static inline void collectives_wait_stream(Collectives *c, cudaStream_t stream, const char *what) {
    collectives_wait_begin(c, what);
    cudaCheck(cudaStreamSynchronize(stream));
    collectives_wait_end(c);
}
static inline void collectives_wait_event(Collectives *c, cudaEvent_t event, const char *what) {
    collectives_wait_begin(c, what);
    cudaCheck(cudaEventSynchronize(event));
    collectives_wait_end(c);
}

// The stream, events and room for scalar_count FP64 sums that every backend uses; the backend's
// open fills in the rest.
static inline void collectives_common_init(Collectives *c, const Comm *comm, int scalar_count) {
    memset(c, 0, sizeof(*c));
    c->comm = comm;
    cudaCheck(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    cudaCheck(cudaEventCreateWithFlags(&c->produced, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&c->finished, cudaEventDisableTiming));
    c->scalar_count = scalar_count;
    c->scalars = (double *)gpu_alloc(scalar_count * sizeof(double), "the collectives' scalars");
}

// Ends the watchdog thread, if any (the waits that follow go unwatched).
static inline void collectives_stop_watchdog(Collectives *c) {
    if (!c->watchdog) return;
    watchdog_stop(c->watchdog);
    free(c->watchdog);
    c->watchdog = NULL;
}

static inline void collectives_close(Collectives *c) {
    collectives_wait_stream(c, c->stream, "the last collectives");
    collectives_stop_watchdog(c);
    if (c->ops) c->ops->close(c);
    cudaCheck(cudaFree(c->scalars));
    cudaCheck(cudaEventDestroy(c->produced));
    cudaCheck(cudaEventDestroy(c->finished));
    cudaCheck(cudaStreamDestroy(c->stream));
    memset(c, 0, sizeof(*c));
}

// The ranks of c (every one calls this, in the same order) that pass the same `color`, numbered
// by `key`, as collectives of their own: `sub`, its ranks described in `sub_comm` (the caller's,
// kept while sub is open). It shares c's stream, events and scalars, and c's watchdog polls its
// asynchronous errors too. Returns 0, or -1 with a message.
static inline int collectives_split(Collectives *c, int color, int key, Comm *sub_comm, Collectives *sub, char *error,
                                    size_t error_size) {
    if (c->split_count == COLLECTIVES_MAX_SPLITS) {
        snprintf(error, error_size, "more than %d splits of one set of collectives", COLLECTIVES_MAX_SPLITS);
        return -1;
    }
    if (comm_split(c->comm, color, key, sub_comm, error, error_size) != 0) return -1;
    *sub = *c;
    sub->comm = sub_comm;
    sub->watchdog = NULL;
    sub->backend = NULL;
    sub->whole = c;
    sub->split_count = 0;
    if (c->ops->split(c, sub, color, key, error, error_size) != 0) {
        comm_split_free(sub_comm);
        return -1;
    }
    c->splits[c->split_count] = sub;
    __atomic_store_n(&c->split_count, c->split_count + 1, __ATOMIC_RELEASE);
    return 0;
}

// A split closed (before its whole), once its last collectives are done. The whole's watchdog
// ends first: it polls every split, and no split may go while it does.
static inline void collectives_close_split(Collectives *sub, Comm *sub_comm) {
    collectives_wait_stream(sub->whole, sub->stream, "the last collectives");
    collectives_stop_watchdog(sub->whole);
    sub->ops->close(sub);
    comm_split_free(sub_comm);
    memset(sub, 0, sizeof(*sub));
}

// The collectives' stream waits for what `producer` had queued.
static inline void collectives_after(Collectives *c, cudaStream_t producer) {
    cudaCheck(cudaEventRecord(c->produced, producer));
    cudaCheck(cudaStreamWaitEvent(c->stream, c->produced, 0));
}

// `consumer` waits for every collective queued so far.
static inline void collectives_join(Collectives *c, cudaStream_t consumer) {
    cudaCheck(cudaEventRecord(c->finished, c->stream));
    cudaCheck(cudaStreamWaitEvent(consumer, c->finished, 0));
}

// data[n] BF16 summed over the ranks, in place.
static inline void collectives_all_reduce_sum_bf16(Collectives *c, bf16 *data, size_t n, cudaStream_t producer) {
    collectives_after(c, producer);
    if (c->comm->world > 1) c->ops->all_reduce_sum_bf16(c, data, n);
}

// data[world x part_n] BF16 summed over the ranks; rank r receives elements [r part_n, (r + 1)
// part_n) of the sum in part[part_n], which may be data + r part_n (in place).
static inline void collectives_reduce_scatter_sum_bf16(Collectives *c, const bf16 *data, bf16 *part, size_t part_n,
                                                       cudaStream_t producer) {
    collectives_after(c, producer);
    if (c->comm->world > 1) c->ops->reduce_scatter_sum_bf16(c, data, part, part_n);
    else if (part != data) cudaCheck(cudaMemcpyAsync(part, data, 2 * part_n, cudaMemcpyDeviceToDevice, c->stream));
}

// data[world x part_bytes]: every rank's part r (at r x part_bytes) to every rank, in place.
static inline void collectives_all_gather(Collectives *c, void *data, size_t part_bytes, cudaStream_t producer) {
    collectives_after(c, producer);
    if (c->comm->world > 1) c->ops->all_gather(c, data, part_bytes);
}

// data[n] FP32, all >= 0 (maxima of magnitudes), replaced on every rank by its maximum over the ranks.
static inline void collectives_all_reduce_max_f32(Collectives *c, float *data, size_t n, cudaStream_t producer) {
    collectives_after(c, producer);
    if (c->comm->world > 1) c->ops->all_reduce_max_f32(c, data, n);
}

// values[n] (n <= scalar_count) FP64 on the host, summed over the ranks in place on every
// rank: losses and squared norms. Waits for the result (and for `producer`'s queued work): the
// wait the watchdog names `what`.
static inline void collectives_all_reduce_sum_f64(Collectives *c, double *values, int n, cudaStream_t producer,
                                                  const char *what) {
    if (c->comm->world == 1) return;
    if (n > c->scalar_count) {
        fprintf(stderr, "error: collectives_all_reduce_sum_f64: %d values, at most %d\n", n, c->scalar_count);
        exit(EXIT_FAILURE);
    }
    collectives_after(c, producer);
    collectives_wait_begin(c, what);
    c->ops->all_reduce_sum_f64(c, values, n);
    collectives_wait_end(c);
}

// `bytes` of rank `from`'s device memory into rank 0's host memory `host` (a checkpoint's
// shards reach the rank that writes it, a chunk at a time); ranks other than 0 and `from` return
// at once. `staging` is a host buffer of `from` and `device_staging` a device buffer of rank 0
// that a backend may pass the chunk through. Waits for it.
static inline void collectives_gather_to_root(Collectives *c, const void *device, void *host, size_t bytes, int from,
                                              void *staging, void *device_staging) {
    if (c->comm->rank != 0 && c->comm->rank != from) return;
    if (from == 0) {
        cudaCheck(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, c->stream));
        cudaCheck(cudaStreamSynchronize(c->stream));
        return;
    }
    c->ops->send_to_root(c, device, host, bytes, from, staging, device_staging);
}

#ifdef USE_MPI
// A chunk to rank 0 over MPI through `from`'s host buffer (both backends, under mpirun).
static inline void collectives_send_to_root_over_mpi(Collectives *c, const void *device, void *host, size_t bytes, int from,
                                                     void *staging) {
    if (c->comm->rank == from) {
        cudaCheck(cudaMemcpyAsync(staging, device, bytes, cudaMemcpyDeviceToHost, c->stream));
        cudaCheck(cudaStreamSynchronize(c->stream));
        comm_send(c->comm, staging, bytes, 0);
    } else {
        comm_recv(c->comm, host, bytes, from);
    }
}
#endif
