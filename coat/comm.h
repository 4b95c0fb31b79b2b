// The ranks of a run, one process per GPU, and the collectives between them on host memory.
// Launch: under mpirun (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE or SLURM_NTASKS set) MPI gives
// rank, world size and the node-local rank (the GPU a rank drives); under a launcher that sets
// RANK, WORLD_SIZE and LOCAL_RANK instead (a shell loop, torchrun-like tools), the ranks meet
// through a file in a shared folder (comm_rendezvous: rank 0 writes, the others read), which is
// how they share what NCCL needs to connect. A build without MPI that finds itself launched by
// mpirun as several processes refuses: N copies of one job must never run.
// Collectives (MPI only; the GPU path is NCCL): sums of FP64 and of BF16, the latter rounded to
// nearest even after every addition as NCCL's reductions are, in the order MPI picks (so a
// multi-rank sum differs from a one-rank run by BF16 rounding noise); a max of ints; broadcast;
// the reduce-to-owner of BF16 buffers that ZeRO needs (coat/zero.h); a send and a receive of bytes;
// an all-gather of bytes (the ranks compare their GPUs).
#pragma once
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#ifdef USE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only, also when compiled as C++ (nvcc)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

typedef enum { LAUNCH_SINGLE, LAUNCH_MPI, LAUNCH_ENV, LAUNCH_INVALID } LaunchKind;

typedef struct {
    LaunchKind launch;
    int rank, world;  // this process, of world
    int local_rank;   // among the ranks of its node: the GPU it drives
    int mpi_started;  // MPI_Init was called here (comm_finish finalizes)
    time_t started;   // when comm_init ran: rendezvous files older than a launch are stale
} Comm;

// The integer value of environment variable `name` (-1 when unset; -2 when not a number >= 0).
static inline int comm_env_int(const char *name) {
    const char *value = getenv(name);
    if (value == NULL || *value == '\0') return -1;
    char *end;
    errno = 0;
    long n = strtol(value, &end, 10);
    if (errno != 0 || *end != '\0' || n < 0 || n > 1 << 24) return -2;
    return (int)n;
}

// This process's rank as its launcher announces it (0 when none does), before any MPI call.
static inline int comm_env_rank(void) {
    const char *variables[] = {"OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID", "RANK"};
    for (size_t i = 0; i < sizeof(variables) / sizeof(variables[0]); i++) {
        int rank = comm_env_int(variables[i]);
        if (rank >= 0) return rank;
    }
    return 0;
}

// The launcher that started this process and the world size it announces (1 for none).
// LAUNCH_INVALID: `variable` is set but is no count (N copies must not start because of a typo).
static inline LaunchKind comm_detect_launch(int *world, const char **variable) {
    const char *variables[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS", "WORLD_SIZE"};
    *world = 1;
    for (size_t i = 0; i < sizeof(variables) / sizeof(variables[0]); i++) {
        int n = comm_env_int(variables[i]);
        *variable = variables[i];
        if (n == -2 || n == 0) return LAUNCH_INVALID;
        if (n < 0) continue;
        *world = n;
        if (n == 1) return LAUNCH_SINGLE;
        return i + 1 < sizeof(variables) / sizeof(variables[0]) ? LAUNCH_MPI : LAUNCH_ENV;
    }
    *variable = "";
    return LAUNCH_SINGLE;
}

// Fills `c` for this process. Returns 0, or -1 with a message (a launch this build cannot serve,
// inconsistent launcher variables).
static inline int comm_init(Comm *c, int *argc, char ***argv, char *error, size_t error_size) {
    memset(c, 0, sizeof(*c));
    c->world = 1;
    c->started = time(NULL);
    int announced = 1;
    const char *variable = "";
    c->launch = comm_detect_launch(&announced, &variable);
    if (c->launch == LAUNCH_INVALID) {
        snprintf(error, error_size, "%s='%s' is not a number of processes", variable, getenv(variable));
        return -1;
    }
    if (c->launch == LAUNCH_SINGLE) return 0;
    if (c->launch == LAUNCH_ENV) {
        int rank = comm_env_int("RANK"), local = comm_env_int("LOCAL_RANK");
        if (rank < 0 || rank >= announced) {
            snprintf(error, error_size, "WORLD_SIZE=%d needs RANK set to 0..%d (got %s)", announced, announced - 1,
                     getenv("RANK") ? getenv("RANK") : "nothing");
            return -1;
        }
        c->rank = rank;
        c->world = announced;
        c->local_rank = local >= 0 ? local : rank;
        return 0;
    }
#ifdef USE_MPI
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
        if (MPI_Init(argc, argv) != MPI_SUCCESS) {
            snprintf(error, error_size, "MPI_Init failed (launched by mpirun as %d processes)", announced);
            return -1;
        }
        c->mpi_started = 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &c->rank);
    MPI_Comm_size(MPI_COMM_WORLD, &c->world);
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &c->local_rank);
    MPI_Comm_free(&node);
    return 0;
#else
    (void)argc;
    (void)argv;
    snprintf(error, error_size, "launched by MPI as one of %d processes (%s=%d), but this build has no MPI: rebuild with "
             "MPI (libopenmpi-dev) or start one process", announced, variable, announced);
    return -1;
#endif
}

static inline void comm_finish(Comm *c) {
#ifdef USE_MPI
    if (c->mpi_started) MPI_Finalize();
#endif
    c->mpi_started = 0;
}

// ---- rendezvous through a shared folder (no MPI) ------------------------------------------------

#define COMM_LAUNCH_SPREAD_S 30  // how far apart a launcher may start the ranks of one run

// Rank 0 writes `bytes` (n of them) to DIR/NAME (through DIR/NAME.tmp and a rename, so that a
// reader never sees a partial file); the other ranks wait for it up to timeout_s seconds and read
// it, ignoring a file from before their launch (more than COMM_LAUNCH_SPREAD_S seconds older than
// their comm_init: an earlier run's). Returns 0, or -1 with a message.
static inline int comm_rendezvous(const Comm *c, const char *dir, const char *name, void *bytes, size_t n,
                                  double timeout_s, char *error, size_t error_size) {
    char path[4096], tmp[4200];
    snprintf(path, sizeof(path), "%s/%s", dir, name);
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    if (c->rank == 0) {
        FILE *f = fopen(tmp, "wb");
        if (!f || fwrite(bytes, 1, n, f) != n || fclose(f) != 0 || rename(tmp, path) != 0) {
            snprintf(error, error_size, "%s: cannot write the rendezvous file: %s", path, strerror(errno));
            return -1;
        }
        return 0;
    }
    struct timespec pause = {0, 10 * 1000 * 1000};
    for (double waited = 0.0; waited < timeout_s; waited += 0.01) {
        struct stat info;
        FILE *f = stat(path, &info) == 0 && info.st_mtime + COMM_LAUNCH_SPREAD_S >= c->started ? fopen(path, "rb") : NULL;
        if (f) {
            size_t got = fread(bytes, 1, n, f);
            fclose(f);
            if (got == n) return 0;
            snprintf(error, error_size, "%s: %zu bytes, expected %zu", path, got, n);
            return -1;
        }
        nanosleep(&pause, NULL);
    }
    snprintf(error, error_size, "%s: rank 0 wrote nothing in %.0f s (is %s shared by every rank?)", path, timeout_s, dir);
    return -1;
}

// The pair of ranks a < b with equal ids and the lowest b (its a is then the only one), the ids
// id_bytes each in rank order in ids[world * id_bytes]: two ranks on one GPU when the ids are GPU
// UUIDs. Returns 0, or -1 (a = b = -1) when every id differs.
static inline int comm_first_equal_ids(const void *ids, size_t id_bytes, int world, int *a, int *b) {
    const unsigned char *bytes = (const unsigned char *)ids;
    for (*b = 1; *b < world; (*b)++)
        for (*a = 0; *a < *b; (*a)++)
            if (memcmp(bytes + (size_t)*a * id_bytes, bytes + (size_t)*b * id_bytes, id_bytes) == 0) return 0;
    *a = *b = -1;
    return -1;
}

// ---- collectives over MPI ---------------------------------------------------------------------
#ifdef USE_MPI

static inline void mpiCheck(int status, const char *call, const char *file, int line) {
    if (status == MPI_SUCCESS) return;
    char message[MPI_MAX_ERROR_STRING];
    int length = 0;
    MPI_Error_string(status, message, &length);
    fprintf(stderr, "error: %s failed at %s:%d: %s\n", call, file, line, message);
    MPI_Abort(MPI_COMM_WORLD, 1);
}
#define MPI_CHECK(call) mpiCheck((call), #call, __FILE__, __LINE__)

static inline float comm_bf16_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, sizeof(x));
    return x;
}

static inline uint16_t comm_float_to_bf16(float x) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    memcpy(&u, &x, sizeof(u));
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static void comm_bf16_sum(void *in, void *inout, int *count, MPI_Datatype *type) {
    (void)type;
    const uint16_t *a = (const uint16_t *)in;
    uint16_t *b = (uint16_t *)inout;
    for (int i = 0; i < *count; i++) b[i] = comm_float_to_bf16(comm_bf16_to_float(a[i]) + comm_bf16_to_float(b[i]));
}

static inline MPI_Op comm_bf16_sum_op(void) {
    static MPI_Op op = MPI_OP_NULL;
    if (op == MPI_OP_NULL) MPI_CHECK(MPI_Op_create(comm_bf16_sum, 1, &op));
    return op;
}

// MPI counts are ints: large buffers go in pieces of at most 2^30 elements.
#define COMM_PIECE ((size_t)1 << 30)

static inline void comm_all_reduce_sum_f64(const Comm *c, double *values, int n) {
    if (c->world > 1) MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD));
}

static inline void comm_all_reduce_max_int(const Comm *c, int *values, int n) {
    if (c->world > 1) MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_INT, MPI_MAX, MPI_COMM_WORLD));
}

static inline void comm_broadcast(const Comm *c, void *bytes, size_t n, int root) {
    for (size_t done = 0; c->world > 1 && done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Bcast((char *)bytes + done, (int)piece, MPI_BYTE, root, MPI_COMM_WORLD));
    }
}

// n as the int count MPI takes; a shard too large for one is an error (MPI_Abort) naming `what`.
static inline int comm_int_count(size_t n, const char *what) {
    if (n <= (size_t)INT32_MAX) return (int)n;
    fprintf(stderr, "error: %s: a shard of %zu elements exceeds MPI's int counts\n", what, n);
    MPI_Abort(MPI_COMM_WORLD, 1);
    return 0;
}

// data[n] BF16 summed over the ranks, in place on every rank (ZeRO stage 0).
static inline void comm_all_reduce_sum_bf16(const Comm *c, uint16_t *data, size_t n) {
    for (size_t done = 0; c->world > 1 && done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + done, (int)piece, MPI_UINT16_T, comm_bf16_sum_op(), MPI_COMM_WORLD));
    }
}

// data[n] BF16 summed over the ranks into out[n] on rank `root` (ZeRO stage 2: a bucket's part
// to its owner); out is only written on root.
static inline void comm_reduce_sum_bf16(const Comm *c, const uint16_t *data, uint16_t *out, size_t n, int root) {
    if (c->world == 1) {
        if (out != data) memmove(out, data, 2 * n);
        return;
    }
    for (size_t done = 0; done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        const void *send = c->rank == root && data == out ? MPI_IN_PLACE : (const void *)(data + done);
        MPI_CHECK(MPI_Reduce(send, c->rank == root ? out + done : NULL, (int)piece, MPI_UINT16_T, comm_bf16_sum_op(),
                             root, MPI_COMM_WORLD));
    }
}

// n bytes from this rank to rank `to`, and their receipt on `to` (checkpoints: rank 0 gathers
// the shards).
static inline void comm_send(const Comm *c, const void *bytes, size_t n, int to) {
    (void)c;
    for (size_t done = 0; done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Send((const char *)bytes + done, (int)piece, MPI_BYTE, to, 0, MPI_COMM_WORLD));
    }
}
static inline void comm_recv(const Comm *c, void *bytes, size_t n, int from) {
    (void)c;
    for (size_t done = 0; done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Recv((char *)bytes + done, (int)piece, MPI_BYTE, from, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE));
    }
}

// Every rank's n bytes of `mine`, in rank order, into all[world * n] on every rank.
static inline void comm_all_gather(const Comm *c, const void *mine, void *all, size_t n) {
    if (c->world == 1) {
        memcpy(all, mine, n);
        return;
    }
    int count = comm_int_count(n, "comm_all_gather");
    MPI_CHECK(MPI_Allgather(mine, count, MPI_BYTE, all, count, MPI_BYTE, MPI_COMM_WORLD));
}

static inline void comm_barrier(const Comm *c) {
    if (c->world > 1) MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
}

#endif  // USE_MPI
