// The ranks of a run, one process per GPU, and the collectives between them on host memory.
// Launch: the rank, world size and node-local rank (the GPU a rank drives) come from the first
// launcher whose world-size variable is set, in this order:
//   1. torchrun (or any tool that sets them): WORLD_SIZE, RANK, LOCAL_RANK. The ranks meet
//      without MPI (coat/rendezvous.h: TCP through MASTER_ADDR / MASTER_PORT, else files in
//      out_dir).
//   2. mpirun: OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_LOCAL_RANK.
//   3. srun: SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID.
//   4. PMI / PMIx: PMI_SIZE, PMI_RANK; PMIX_SIZE, PMIX_RANK.
// 2 to 4 run under MPI, whose MPI_Comm_rank and _size must then equal the variables'.
// torchrun comes first because it runs inside the others (srun --ntasks-per-node=1 torchrun
// --nproc_per_node=8: SLURM_NTASKS=1, SLURM_PROCID=0 describe the srun task, not the 8 ranks);
// mpirun comes before srun because it only ever runs inside an allocation, whose SLURM
// variables (an sbatch script's SLURM_NTASKS, SLURM_PROCID=0) describe the allocation, not the
// processes mpirun started. Refused, naming the variables and values: a size that is no count,
// RANK without WORLD_SIZE, a size > 1 without its rank, a rank >= its size (WORLD_SIZE=1 with
// RANK=1), torchrun's WORLD_SIZE no multiple of an enclosing launcher's size (torchrun starts as
// many ranks in each of its tasks), and an MPI-family source that disagrees with a lower one
// about the same processes (PMI_SIZE or PMI_RANK against mpirun's or srun's).
// A build without MPI that finds itself launched by mpirun as several processes refuses: N
// copies of one job must never run.
// Collectives (MPI only; the GPU path is NCCL): sums of FP64 and of BF16, the latter rounded to
// nearest even after every addition as NCCL's reductions are, in the order MPI picks (so a
// multi-rank sum differs from a one-rank run by BF16 rounding noise); a max of ints; broadcast;
// the reduce-scatter of BF16 buffers that ZeRO needs (coat/zero.h); a send and a receive of bytes;
// an all-gather of bytes (the ranks compare their GPUs). Under either launch: a gather of bytes
// to rank 0 and a broadcast from it (comm_gather0, comm_bcast0: MPI, or the rendezvous channel),
// on which the ranks' start-up checks run (coat/agree.h).
// The trainer's plumbing (launch), not model code; coat/zero.cuh runs its collectives over it.
#pragma once
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include "rendezvous.h"
#ifdef USE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only, also when compiled as C++ (nvcc)
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

typedef enum { LAUNCH_SINGLE, LAUNCH_MPI, LAUNCH_ENV } LaunchKind;

typedef struct {
    LaunchKind launch;
    int rank, world;          // this process, of world
    int local_rank;           // among the ranks of its node: the GPU it drives
    int mpi_started;          // MPI_Init was called here (comm_finish finalizes)
    const char *size_var;     // the variable the world size came from ("" for one process)
    const char *rank_var;
    Rendezvous *meet;         // LAUNCH_ENV after comm_meet: the channel to the other ranks
    int split;                // a part of the world's ranks (comm_split): rank and world count within it
#ifdef USE_MPI
    MPI_Comm split_mpi;       // its MPI communicator, under an MPI launch
#endif
} Comm;

// One launcher's variables, in the order of precedence.
typedef struct {
    const char *size, *rank, *local;  // local: NULL where MPI tells it
    LaunchKind kind;
} LaunchSource;

static const LaunchSource comm_sources[] = {
    {"WORLD_SIZE", "RANK", "LOCAL_RANK", LAUNCH_ENV},
    {"OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", NULL, LAUNCH_MPI},
    {"SLURM_NTASKS", "SLURM_PROCID", NULL, LAUNCH_MPI},
    {"PMI_SIZE", "PMI_RANK", NULL, LAUNCH_MPI},
    {"PMIX_SIZE", "PMIX_RANK", NULL, LAUNCH_MPI},
};
#define COMM_SOURCES (sizeof(comm_sources) / sizeof(comm_sources[0]))

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

// One source's size and rank (-1 when unset), checked on their own. Returns 0, or -1 with a message.
static inline int comm_source_read(const LaunchSource *s, int *size, int *rank, char *error, size_t error_size) {
    *size = comm_env_int(s->size);
    *rank = comm_env_int(s->rank);
    if (*size == -2 || *size == 0) {
        snprintf(error, error_size, "%s='%s' is not a number of processes", s->size, getenv(s->size));
        return -1;
    }
    if (*rank == -2) {
        snprintf(error, error_size, "%s='%s' is not a rank", s->rank, getenv(s->rank));
        return -1;
    }
    if (*size < 0 && *rank >= 0 && s->kind == LAUNCH_ENV) {  // (mpirun sets PMIX_RANK alone: PMIx tells the size)
        snprintf(error, error_size, "%s=%d is set but %s is not: which world is it a rank of?", s->rank, *rank, s->size);
        return -1;
    }
    if (*size < 0) return 0;
    if (*size > 1 && *rank < 0) {
        snprintf(error, error_size, "%s=%d needs %s set to 0..%d (got nothing)", s->size, *size, s->rank, *size - 1);
        return -1;
    }
    if (*rank >= 0 && *rank >= *size) {
        snprintf(error, error_size, "%s=%d is not below %s=%d", s->rank, *rank, s->size, *size);
        return -1;
    }
    if (*rank < 0) *rank = 0;
    return 0;
}

// Whether `outer`, a source of lower precedence also set, can describe the same launch as the
// chosen source `in` (size n, rank r). Returns 0, or -1 with a message naming both.
static inline int comm_source_agrees(const LaunchSource *in, int n, int r, const LaunchSource *outer, int on, int orank,
                                     char *error, size_t error_size) {
    if (in->kind == LAUNCH_ENV) {  // torchrun inside srun or mpirun: the same ranks in each of their tasks
        if (n % on == 0) return 0;
        snprintf(error, error_size, "%s=%d is no multiple of %s=%d: torchrun starts as many ranks in each task of the "
                 "launcher it runs in", in->size, n, outer->size, on);
        return -1;
    }
    if (strcmp(outer->size, "SLURM_NTASKS") == 0) return 0;  // the allocation mpirun runs in
    if (n == on && r == orank) return 0;
    snprintf(error, error_size, "%s=%d, %s=%d but %s=%d, %s=%d: two launchers disagree about this process", in->size, n,
             in->rank, r, outer->size, on, outer->rank, orank);
    return -1;
}

// Fills c's launch, rank, world and local rank (MPI's local rank comes in comm_init) from the
// environment. Returns 0, or -1 with a message.
static inline int comm_resolve(Comm *c, char *error, size_t error_size) {
    memset(c, 0, sizeof(*c));
    c->world = 1;
    c->size_var = c->rank_var = "";
    int chosen = -1, n = 1, r = 0;
    for (size_t i = 0; i < COMM_SOURCES; i++) {
        int size, rank;
        if (comm_source_read(&comm_sources[i], &size, &rank, error, error_size) != 0) return -1;
        if (size < 0) continue;
        if (chosen < 0) {
            chosen = (int)i, n = size, r = rank;
        } else if (comm_source_agrees(&comm_sources[chosen], n, r, &comm_sources[i], size, rank, error, error_size) != 0) {
            return -1;
        }
    }
    if (chosen < 0) return 0;
    const LaunchSource *s = &comm_sources[chosen];
    c->size_var = s->size, c->rank_var = s->rank;
    c->world = n, c->rank = r, c->local_rank = r;
    if (s->local && comm_env_int(s->local) >= 0) c->local_rank = comm_env_int(s->local);
    c->launch = n == 1 ? LAUNCH_SINGLE : s->kind;
    return 0;
}

// This process's rank as its launcher announces it (0 for none, or a launch comm_resolve refuses).
static inline int comm_env_rank(void) {
    Comm c;
    char error[256];
    return comm_resolve(&c, error, sizeof(error)) == 0 ? c.rank : 0;
}

#ifdef USE_MPI
// MPI's own numbering must be the launcher's: the ranks' data, checkpoints and silence follow it.
static inline int comm_mpi_join(Comm *c, int *argc, char ***argv, char *error, size_t error_size) {
    int initialized = 0, rank = 0, world = 1;
    MPI_Initialized(&initialized);
    if (!initialized) {
        if (MPI_Init(argc, argv) != MPI_SUCCESS) {
            snprintf(error, error_size, "MPI_Init failed (launched by mpirun as %d processes)", c->world);
            return -1;
        }
        c->mpi_started = 1;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    if (rank != c->rank || world != c->world) {
        snprintf(error, error_size, "MPI numbers this process rank %d of %d, but %s=%d, %s=%d", rank, world, c->rank_var,
                 c->rank, c->size_var, c->world);
        return -1;
    }
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &c->local_rank);
    MPI_Comm_free(&node);
    return 0;
}
#endif

// Fills `c` for this process (MPI_Init under an MPI launch). Returns 0, or -1 with a message (a
// launch this build cannot serve, launcher variables that contradict each other or MPI).
static inline int comm_init(Comm *c, int *argc, char ***argv, char *error, size_t error_size) {
    if (comm_resolve(c, error, error_size) != 0) return -1;
    if (c->launch != LAUNCH_MPI) return 0;
#ifdef USE_MPI
    return comm_mpi_join(c, argc, argv, error, error_size);
#else
    (void)argc;
    (void)argv;
    snprintf(error, error_size, "launched by MPI as one of %d processes (%s=%d), but this build has no MPI: rebuild with "
             "MPI (libopenmpi-dev) or start one process", c->world, c->size_var, c->world);
    return -1;
#endif
}

// Ranks launched without MPI meet through the rendezvous channel (coat/rendezvous.h), its files
// (without MASTER_ADDR) in `dir`; every later wait on a peer gives up after timeout_s.
// Returns 0, or -1 with a message.
static inline int comm_meet(Comm *c, const char *dir, double timeout_s, char *error, size_t error_size) {
    if (c->launch != LAUNCH_ENV || c->meet) return 0;
    c->meet = (Rendezvous *)calloc(1, sizeof(Rendezvous));
    if (!c->meet) {
        snprintf(error, error_size, "out of host memory for the rendezvous");
        return -1;
    }
    return rendezvous_open(c->meet, c->rank, c->world, dir, timeout_s, error, error_size);
}

static inline void comm_finish(Comm *c) {
#ifdef USE_MPI
    if (c->mpi_started) MPI_Finalize();
#endif
    c->mpi_started = 0;
    if (c->meet) rendezvous_close(c->meet);
    free(c->meet);
    c->meet = NULL;
}

// Every rank's n bytes of `mine`, in rank order, into all[world * n] on rank 0 (others: unused).
// Returns 0, or -1 with a message (a rank that left or never answered: the channel's).
static inline int comm_gather0(const Comm *c, const void *mine, void *all, size_t n, char *error, size_t error_size) {
    if (c->world == 1) {
        memcpy(all, mine, n);
        return 0;
    }
    if (c->launch == LAUNCH_ENV) return rendezvous_gather(c->meet, mine, all, n, error, error_size);
#ifdef USE_MPI
    if (MPI_Gather(mine, (int)n, MPI_BYTE, all, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS) return 0;
#endif
    snprintf(error, error_size, "rank %d: the gather to rank 0 failed", c->rank);
    return -1;
}

// Rank 0's n bytes to every rank. Returns 0, or -1 with a message.
static inline int comm_bcast0(const Comm *c, void *bytes, size_t n, char *error, size_t error_size) {
    if (c->world == 1) return 0;
    if (c->launch == LAUNCH_ENV) return rendezvous_broadcast(c->meet, bytes, n, error, error_size);
#ifdef USE_MPI
    if (MPI_Bcast(bytes, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD) == MPI_SUCCESS) return 0;
#endif
    snprintf(error, error_size, "rank %d: the broadcast from rank 0 failed", c->rank);
    return -1;
}

// The ranks of `world` (every rank's Comm, not a split; every rank calls this, in the same order)
// that pass the same `color`, numbered by `key` (ties: by world rank), as `part`: its rank and
// world count within them and, under an MPI launch, an MPI communicator of them that the
// collectives below then run on. The gather and broadcast above stay the world's. Returns 0, or
// -1 with a message.
static inline int comm_split(const Comm *world, int color, int key, Comm *part, char *error, size_t error_size) {
    *part = *world;
    part->mpi_started = 0;
    part->meet = NULL;
    part->split = 1;
    int mine[3] = {color, key, world->rank}, *all = (int *)malloc((size_t)world->world * sizeof(mine));
    if (!all) {
        snprintf(error, error_size, "out of host memory for a split of the ranks");
        return -1;
    }
    int failed = comm_gather0(world, mine, all, sizeof(mine), error, error_size) != 0 ||
                 comm_bcast0(world, all, (size_t)world->world * sizeof(mine), error, error_size) != 0;
    part->rank = part->world = 0;
    for (int r = 0; !failed && r < world->world; r++) {
        const int *other = all + 3 * r;
        if (other[0] != color) continue;
        part->world++;
        if (other[1] < key || (other[1] == key && r < world->rank)) part->rank++;
    }
    free(all);
    if (failed) return -1;
#ifdef USE_MPI
    if (world->launch == LAUNCH_MPI &&
        MPI_Comm_split(MPI_COMM_WORLD, color, key, &part->split_mpi) != MPI_SUCCESS) {
        snprintf(error, error_size, "rank %d: MPI_Comm_split failed", world->rank);
        return -1;
    }
#endif
    return 0;
}

static inline void comm_split_free(Comm *part) {
#ifdef USE_MPI
    if (part->split && part->launch == LAUNCH_MPI) MPI_Comm_free(&part->split_mpi);
#endif
    part->split = 0;
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

// The MPI communicator of c's ranks: the world's, or a split's (comm_split).
static inline MPI_Comm comm_mpi(const Comm *c) { return c->split ? c->split_mpi : MPI_COMM_WORLD; }

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
    if (c->world > 1) MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, MPI_SUM, comm_mpi(c)));
}

static inline void comm_all_reduce_max_int(const Comm *c, int *values, int n) {
    if (c->world > 1) MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_INT, MPI_MAX, comm_mpi(c)));
}

static inline void comm_broadcast(const Comm *c, void *bytes, size_t n, int root) {
    for (size_t done = 0; c->world > 1 && done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Bcast((char *)bytes + done, (int)piece, MPI_BYTE, root, comm_mpi(c)));
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
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, data + done, (int)piece, MPI_UINT16_T, comm_bf16_sum_op(), comm_mpi(c)));
    }
}

// data[world * part_n] BF16 summed over the ranks, rank r receiving the sum of elements
// [r part_n, (r + 1) part_n) in part[part_n] (a gradient bucket's reduce-scatter, coat/zero.h).
static inline void comm_reduce_scatter_sum_bf16(const Comm *c, const uint16_t *data, uint16_t *part, size_t part_n) {
    if (c->world == 1) {
        if (part != data) memmove(part, data, 2 * part_n);
        return;
    }
    int count = comm_int_count(part_n, "comm_reduce_scatter_sum_bf16");
    MPI_CHECK(MPI_Reduce_scatter_block(data, part, count, MPI_UINT16_T, comm_bf16_sum_op(), comm_mpi(c)));
}

// n bytes from this rank to rank `to`, and their receipt on `to` (checkpoints: rank 0 gathers
// the shards).
static inline void comm_send(const Comm *c, const void *bytes, size_t n, int to) {
    for (size_t done = 0; done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Send((const char *)bytes + done, (int)piece, MPI_BYTE, to, 0, comm_mpi(c)));
    }
}
static inline void comm_recv(const Comm *c, void *bytes, size_t n, int from) {
    for (size_t done = 0; done < n; done += COMM_PIECE) {
        size_t piece = n - done < COMM_PIECE ? n - done : COMM_PIECE;
        MPI_CHECK(MPI_Recv((char *)bytes + done, (int)piece, MPI_BYTE, from, 0, comm_mpi(c), MPI_STATUS_IGNORE));
    }
}

// Every rank's n bytes of `mine`, in rank order, into all[world * n] on every rank; mine may be
// this rank's place in all (all + rank n: in place, as the parameter gather runs).
static inline void comm_all_gather(const Comm *c, const void *mine, void *all, size_t n) {
    int in_place = mine == (const char *)all + (size_t)c->rank * n;
    if (c->world == 1) {
        if (!in_place) memcpy(all, mine, n);
        return;
    }
    int count = comm_int_count(n, "comm_all_gather");
    MPI_CHECK(MPI_Allgather(in_place ? MPI_IN_PLACE : mine, count, MPI_BYTE, all, count, MPI_BYTE, comm_mpi(c)));
}

static inline void comm_barrier(const Comm *c) {
    if (c->world > 1) MPI_CHECK(MPI_Barrier(comm_mpi(c)));
}

#endif  // USE_MPI
