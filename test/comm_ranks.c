// The program test/test_comm.sh launches as several ranks to test coat/comm.h:
//   comm_ranks init         prints "rank R of W, local L" (or the error, exit 2)
//   comm_ranks collectives  (MPI) every collective on inputs each rank can compute for all the
//                           others, checked exactly: sums of multiples of 1/8 below 32 are exact in BF16;
//                           the splits into groups of 2 and across them
//   comm_ranks ids          comm_first_equal_ids on crafted ids (no MPI needed)
//   comm_ranks meet DIR TIMEOUT_S [STALL_S]   ranks launched without MPI meet (coat/rendezvous.h:
//                           tcp with MASTER_ADDR / MASTER_PORT, else files in DIR), rank 0 sends 64
//                           bytes it draws and gathers each rank's sum of them; every rank prints
//                           "rank R: HEX" and rank 0 "sums ok"; then rank 0 gathers once more, which
//                           the last rank joins only after STALL_S seconds (a rank to kill meanwhile).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/comm.h"

#ifdef USE_MPI
static float input_value(int rank, size_t i) { return (float)((rank * 5 + (int)(i % 17)) % 16) / 8.0f; }  // 0..1.875

// Byte i of rank r's 16-byte id: r's own, except that the last rank repeats the one before it.
static unsigned char id_byte(const Comm *c, int r, int i) {
    return (unsigned char)((r == c->world - 1 && r > 0 ? r - 1 : r) * 16 + i);
}

// comm_split: groups of 2 consecutive ranks (numbered by a reversed key: the last first) and the
// ranks of one index across them, numbered as MPI numbers them; with an even world a bucket of 2
// parts reduce-scattered within the group and the part summed across holds every rank's sum.
// (Several ranks: one runs without MPI.)
static int splits(const Comm *c, size_t shard) {
    if (c->launch != LAUNCH_MPI) return 0;  // one process: no MPI to split
    char error[256];
    int failures = 0, group = c->rank / 2, index = c->rank % 2, members = 2 * group + 1 < c->world ? 2 : 1;
    Comm in_group, across;
    if (comm_split(c, group, -c->rank, &in_group, error, sizeof(error)) != 0 ||
        comm_split(c, index, group, &across, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 1;
    }
    int mpi_rank[2], mpi_world[2];
    MPI_Comm_rank(in_group.split_mpi, &mpi_rank[0]);
    MPI_Comm_size(in_group.split_mpi, &mpi_world[0]);
    MPI_Comm_rank(across.split_mpi, &mpi_rank[1]);
    MPI_Comm_size(across.split_mpi, &mpi_world[1]);
    failures += in_group.rank != mpi_rank[0] || in_group.world != mpi_world[0] || in_group.world != members ||
                in_group.rank != members - 1 - index;
    failures += across.rank != mpi_rank[1] || across.world != mpi_world[1] || across.rank != group ||
                across.world != (c->world - index + 1) / 2;
    if (c->world % 2 == 0) {
        size_t n = 2 * shard;
        uint16_t *data = calloc(n, 2), *part = calloc(shard, 2);
        if (!data || !part) exit(2);
        for (size_t i = 0; i < n; i++) data[i] = comm_float_to_bf16(input_value(c->rank, i));
        comm_reduce_scatter_sum_bf16(&in_group, data, part, shard);
        comm_all_reduce_sum_bf16(&across, part, shard);
        for (size_t i = 0; i < shard; i++) {
            float sum = 0.0f;
            for (int r = 0; r < c->world; r++) sum += input_value(r, (size_t)in_group.rank * shard + i);
            failures += part[i] != comm_float_to_bf16(sum);
        }
        free(data);
        free(part);
    }
    comm_split_free(&in_group);
    comm_split_free(&across);
    if (failures) printf("rank %d of %d: the splits wrong\n", c->rank, c->world);
    return failures;
}

static int collectives(const Comm *c) {
    int failures = 0;
    size_t shard = 1000 + 3, n = (size_t)c->world * shard;
    uint16_t *data = calloc(n, 2), *expected = calloc(n, 2), *out = calloc(n, 2);
    if (!data || !expected || !out) {
        fprintf(stderr, "error: out of host memory for %zu values\n", n);
        exit(2);
    }
    for (size_t i = 0; i < n; i++) {
        float sum = 0.0f;
        for (int r = 0; r < c->world; r++) sum += input_value(r, i);
        expected[i] = comm_float_to_bf16(sum);
        data[i] = comm_float_to_bf16(input_value(c->rank, i));
    }
    comm_all_reduce_sum_bf16(c, data, n);
    failures += memcmp(data, expected, 2 * n) != 0;
    for (size_t i = 0; i < n; i++) data[i] = comm_float_to_bf16(input_value(c->rank, i));
    comm_reduce_scatter_sum_bf16(c, data, out, shard);  // each rank's part of a bucket
    failures += memcmp(out, expected + (size_t)c->rank * shard, 2 * shard) != 0;
    for (size_t i = (size_t)c->rank * shard; i < (size_t)(c->rank + 1) * shard; i++) out[i] = data[i];
    comm_all_gather(c, out + (size_t)c->rank * shard, out, 2 * shard);  // in place: every rank's part
    for (size_t i = 0; i < n; i++) failures += out[i] != comm_float_to_bf16(input_value((int)(i / shard), i));
    double values[2] = {c->rank + 0.5, 1.0};
    comm_all_reduce_sum_f64(c, values, 2);
    failures += values[0] != c->world * c->world / 2.0 || values[1] != c->world;
    int flag = c->rank == c->world - 1 ? 7 : c->rank;
    comm_all_reduce_max_int(c, &flag, 1);
    failures += flag != (c->world - 2 > 7 ? c->world - 2 : 7);
    char id[128];
    for (int i = 0; i < 128; i++) id[i] = c->rank == 0 ? (char)(i * 3 + 1) : 0;
    comm_broadcast(c, id, sizeof(id), 0);
    for (int i = 0; i < 128; i++) failures += id[i] != (char)(i * 3 + 1);
    // the all-gather of 16-byte ids (as the GPUs' UUIDs are gathered), and the pair that shares one
    unsigned char mine[16], *all = calloc((size_t)c->world, 16);
    if (!all) exit(2);
    for (int i = 0; i < 16; i++) mine[i] = id_byte(c, c->rank, i);
    comm_all_gather(c, mine, all, sizeof(mine));
    for (int r = 0; r < c->world; r++)
        for (int i = 0; i < 16; i++) failures += all[r * 16 + i] != id_byte(c, r, i);
    int a, b, found = comm_first_equal_ids(all, 16, c->world, &a, &b) == 0;
    failures += c->world == 1 ? found : !found || a != c->world - 2 || b != c->world - 1;
    free(all);
    failures += splits(c, shard);
    comm_barrier(c);
    free(data);
    free(expected);
    free(out);
    if (failures) printf("rank %d of %d: %d collective(s) wrong\n", c->rank, c->world, failures);
    else printf("rank %d of %d: collectives ok\n", c->rank, c->world);
    return failures ? 1 : 0;
}
#endif

// comm_first_equal_ids on ids of one byte: "abcb" has its first pair at (1, 3), "abab" at (0, 2)
// (the lowest second rank), "abc" none. Returns the failures.
static int equal_ids_checks(void) {
    struct { const char *ids; int a, b; } cases[] = {{"abcb", 1, 3}, {"abab", 0, 2}, {"aab", 0, 1}, {"abcc", 2, 3},
                                                     {"abca", 0, 3}, {"abc", -1, -1}, {"a", -1, -1}};
    int failures = 0;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        int a = 7, b = 7, world = (int)strlen(cases[i].ids);
        int status = comm_first_equal_ids(cases[i].ids, 1, world, &a, &b);
        if (status != (cases[i].a < 0 ? -1 : 0) || a != cases[i].a || b != cases[i].b) {
            printf("FAIL ids \"%s\": expected ranks %d and %d, got %d and %d (status %d)\n", cases[i].ids, cases[i].a,
                   cases[i].b, a, b, status);
            failures++;
        }
    }
    unsigned char wide[3 * 16] = {0};  // ids equal but for their last byte are not equal
    wide[16 + 15] = 1;
    wide[32 + 15] = 2;
    int a, b;
    if (comm_first_equal_ids(wide, 16, 3, &a, &b) != -1) {
        printf("FAIL 16-byte ids differing in their last byte taken for equal (ranks %d and %d)\n", a, b);
        failures++;
    }
    if (!failures) printf("ids ok\n");
    return failures;
}

// Each rank's sum of the 64 bytes rank 0 sent, gathered: what rank 0 computes itself.
static int meet(Comm *c, const char *dir, double timeout_s, double stall_s) {
    char error[512];
    unsigned char bytes[64];
    uint64_t x = rendezvous_random();
    for (int i = 0; i < 64; i++) bytes[i] = (unsigned char)(x >> (i % 8 * 8)) ^ (unsigned char)i;
    uint32_t sum = 0, *sums = calloc((size_t)c->world, sizeof(uint32_t));
    int failures = 0;
    if (!sums || comm_meet(c, dir, timeout_s, error, sizeof(error)) != 0 || comm_bcast0(c, bytes, 64, error, sizeof(error)) != 0)
        goto failed;
    for (int i = 0; i < 64; i++) sum += bytes[i] * (uint32_t)(i + 1);
    if (comm_gather0(c, &sum, sums, sizeof(sum), error, sizeof(error)) != 0) goto failed;
    printf("rank %d:", c->rank);
    for (int i = 0; i < 64; i++) printf("%02x", bytes[i]);
    printf("\n");
    for (int r = 0; c->rank == 0 && r < c->world; r++) failures += sums[r] != sum;
    if (c->rank == 0) printf("%s\n", failures ? "sums wrong" : "sums ok");
    fflush(stdout);
    if (c->rank == c->world - 1 && stall_s > 0) sleep((unsigned)stall_s);
    if (comm_gather0(c, &sum, sums, sizeof(sum), error, sizeof(error)) != 0) goto failed;
    free(sums);
    return failures ? 1 : 0;
failed:
    fprintf(stderr, "error: %s\n", error);
    free(sums);
    return 1;
}

int main(int argc, char **argv) {
    char error[512];
    Comm c;
    if (comm_init(&c, &argc, &argv, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 2;
    }
    int status = 0;
    if (argc >= 2 && strcmp(argv[1], "init") == 0) {
        printf("rank %d of %d, local %d\n", c.rank, c.world, c.local_rank);
    } else if (argc >= 2 && strcmp(argv[1], "collectives") == 0) {
#ifdef USE_MPI
        status = collectives(&c);
#else
        fprintf(stderr, "error: built without MPI\n");
        status = 2;
#endif
    } else if (argc >= 2 && strcmp(argv[1], "ids") == 0) {
        status = equal_ids_checks() ? 1 : 0;
    } else if ((argc == 4 || argc == 5) && strcmp(argv[1], "meet") == 0) {
        status = meet(&c, argv[2], atof(argv[3]), argc == 5 ? atof(argv[4]) : 0.0);
    } else {
        fprintf(stderr, "usage: comm_ranks init | collectives | ids | meet DIR TIMEOUT_S [STALL_S]\n");
        status = 2;
    }
    comm_finish(&c);
    return status;
}
