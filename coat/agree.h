// What the ranks of a run check together at start, through comm_gather0 / comm_bcast0 (MPI, or
// the rendezvous channel), so that ranks that could not train one model refuse at once instead
// of training apart or hanging:
//   - their configs (agree_check with the parser set): rank 0 compares every rank's hash of each
//     config key with its own and names the first rank and key that differ. All keys count but
//     out_dir, whose path may differ between nodes: it is checked as a folder instead;
//   - out_dir (agree_out_dir): rank 0 writes 16 random bytes to OUT_DIR/.rank0_token and sends
//     them; every rank reads the file in its own out_dir, and another folder (or a copy of it) is
//     refused, naming it;
//   - errors at start: from agree_begin to agree_end, rank 0 alone prints an error, its own or
//     else the first failing rank's ("rank R: ..."), and every rank exits with its code. Ranks
//     other than 0 hold back their stderr meanwhile; one that exits with an error (anywhere:
//     fail_config, a missing file) joins the pending check from an on_exit handler with the
//     error it wrote. A rank that passes writes what it held back at agree_end.
// Every rank makes the same agree_check calls in the same order, the failing ones from exit.
// The trainer's plumbing (launch), not model code.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "comm.h"
#include "config.h"

#define AGREE_MESSAGE_MAX 768
#define AGREE_CONFIG_ERROR 2  // the exit code of a config error, as the trainer's

typedef struct {
    int32_t code;
    char message[AGREE_MESSAGE_MAX];
    uint64_t keys[CONFIG_KEY_COUNT];  // each config key's hash (0 for out_dir), or all 0 without a config
} AgreeReport;

typedef struct {
    int32_t code;
    unsigned char token[16];  // agree_out_dir's
    char message[AGREE_MESSAGE_MAX + 32];
} AgreeVerdict;

static struct {
    const Comm *comm;
    const ConfigParser *parser;
    int armed;       // between agree_begin and agree_end
    int saved_fd;    // a rank > 0's real stderr while it is held back
    FILE *held;      // what it wrote meanwhile
    unsigned char token[16];
} agree_state = {NULL, NULL, 0, -1, NULL, {0}};

static inline uint64_t agree_hash(const void *bytes, size_t n) {  // FNV-1a
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ ((const unsigned char *)bytes)[i]) * 0x100000001b3ull;
    return h | 1;  // never 0, which stands for "not compared"
}

static inline void agree_key_hashes(const ConfigParser *parser, uint64_t *keys) {
    for (size_t i = 0; i < CONFIG_KEY_COUNT; i++) {
        const ConfigKey *k = &config_keys[i];
        const char *field = (const char *)&parser->values + k->offset;
        size_t n = k->type == KEY_STRING ? strlen(field) : k->type == KEY_INT64 ? 8 : 4;
        keys[i] = strcmp(k->name, "out_dir") == 0 ? 0 : agree_hash(field, n);
    }
}

// The error a rank > 0 held back: its last line, without "error: ".
static inline void agree_held_message(char *message, size_t size) {
    char line[AGREE_MESSAGE_MAX];
    message[0] = '\0';
    if (!agree_state.held) return;
    fflush(agree_state.held);
    rewind(agree_state.held);
    while (fgets(line, sizeof(line), agree_state.held)) {
        line[strcspn(line, "\n")] = '\0';
        if (line[0]) snprintf(message, size, "%s", strncmp(line, "error: ", 7) == 0 ? line + 7 : line);
    }
    fseek(agree_state.held, 0, SEEK_END);
}

// Rank 0's verdict on the reports: the first failing rank's code and error, else the first key
// a rank's config differs in.
static inline void agree_judge(const AgreeReport *all, int world, const ConfigParser *parser, AgreeVerdict *v) {
    for (int r = 0; r < world && v->code == 0; r++)
        if (all[r].code != 0) {
            v->code = all[r].code;
            if (r > 0) snprintf(v->message, sizeof(v->message), "rank %d: %s", r, all[r].message);
        }
    for (int r = 1; r < world && v->code == 0 && parser; r++)
        for (size_t i = 0; i < CONFIG_KEY_COUNT && v->code == 0; i++)
            if (all[r].keys[i] != all[0].keys[i]) {
                v->code = AGREE_CONFIG_ERROR;
                snprintf(v->message, sizeof(v->message), "rank %d's %s differs from rank 0's (set at %s there): every rank "
                         "needs the same config, out_dir aside", r, config_keys[i].name, config_source(parser, config_keys[i].name));
            }
}

// Stops holding back stderr; a rank that passed writes what it held.
static inline void agree_release(int passed) {
    if (agree_state.saved_fd < 0) return;
    dup2(agree_state.saved_fd, 2);
    close(agree_state.saved_fd);
    agree_state.saved_fd = -1;
    char buffer[4096];
    size_t n;
    rewind(agree_state.held);
    while (passed && (n = fread(buffer, 1, sizeof(buffer), agree_state.held)) > 0) fwrite(buffer, 1, n, stderr);
    fclose(agree_state.held);
    agree_state.held = NULL;
}

// One check: every rank reports `code` (0: fine) with its held-back error and its config's key
// hashes; rank 0 judges. On a failing verdict rank 0 prints the error (unless it was its own,
// already printed) and every rank exits with its code: through _exit from the exit handler
// (`exiting`), else exit. Returns on a passing verdict, with rank 0's token in agree_state.
static inline void agree_round(int code, int exiting) {
    const Comm *c = agree_state.comm;
    AgreeReport mine;
    AgreeVerdict v;
    char error[AGREE_MESSAGE_MAX];
    memset(&mine, 0, sizeof(mine));
    memset(&v, 0, sizeof(v));
    mine.code = code;
    agree_held_message(mine.message, sizeof(mine.message));
    if (agree_state.parser && code == 0) agree_key_hashes(agree_state.parser, mine.keys);
    AgreeReport *all = c->rank == 0 ? (AgreeReport *)calloc((size_t)c->world, sizeof(AgreeReport)) : NULL;
    int status = c->rank == 0 && !all ? -1 : comm_gather0(c, &mine, all, sizeof(mine), error, sizeof(error));
    if (status == 0 && c->rank == 0) {
        agree_judge(all, c->world, agree_state.parser, &v);
        memcpy(v.token, agree_state.token, sizeof(v.token));
    }
    if (status == 0) status = comm_bcast0(c, &v, sizeof(v), error, sizeof(error));
    free(all);
    if (status != 0) v.code = EXIT_FAILURE, snprintf(v.message, sizeof(v.message), "%s", error);
    if (v.code == 0) {
        memcpy(agree_state.token, v.token, sizeof(v.token));
        return;
    }
    agree_state.armed = 0;
    agree_release(0);
    if ((c->rank == 0 || status != 0) && v.message[0]) fprintf(stderr, "error: %s\n", v.message);
    fflush(NULL);
    if (exiting) _exit(v.code);
    exit(v.code);
}

static inline void agree_on_exit(int status, void *unused) {
    (void)unused;
    if (agree_state.armed && status != 0) agree_round(status, 1);  // a failing verdict: it ends in _exit
}

// From here to agree_end the ranks' start-up errors go through rank 0 (several ranks joined:
// under MPI, or after comm_meet). Calling it again once armed does nothing.
static inline void agree_begin(const Comm *c) {
    static int registered = 0;
    int joined = c->world > 1 && (c->launch == LAUNCH_MPI || c->meet != NULL);
    if (!joined || agree_state.armed) return;
    agree_state.comm = c;
    agree_state.armed = 1;
    if (!registered) on_exit(agree_on_exit, NULL);
    registered = 1;
    if (c->rank == 0 || !(agree_state.held = tmpfile())) return;
    fflush(stderr);
    agree_state.saved_fd = dup(2);
    if (agree_state.saved_fd < 0 || dup2(fileno(agree_state.held), 2) < 0) agree_release(1);
}

// A check at which every rank has its config (key hashes compared from now on) and reports `code`.
static inline void agree_check(const ConfigParser *parser, int code) {
    if (!agree_state.armed) {
        if (code != 0) exit(code);
        return;
    }
    if (parser) agree_state.parser = parser;
    agree_round(code, 0);
}

// out_dir, which rank 0 has created, is one folder for every rank (see the header comment).
static inline void agree_out_dir(const char *out_dir) {
    if (!agree_state.armed) return;
    const Comm *c = agree_state.comm;
    char path[4200];
    snprintf(path, sizeof(path), "%s/.rank0_token", out_dir);
    int code = 0;
    if (c->rank == 0) {
        for (int i = 0; i < 2; i++) {
            uint64_t x = rendezvous_random();
            memcpy(agree_state.token + 8 * i, &x, 8);
        }
        FILE *f = fopen(path, "wb");
        if (!f || fwrite(agree_state.token, sizeof(agree_state.token), 1, f) != 1 || fclose(f) != 0) {
            fprintf(stderr, "error: %s: cannot write: %s\n", path, strerror(errno));
            code = EXIT_FAILURE;
        }
    }
    agree_round(code, 0);  // the token travels with the verdict
    unsigned char theirs[16];
    FILE *f = c->rank == 0 ? NULL : fopen(path, "rb");
    int found = f != NULL;
    int same = c->rank == 0 || (f && fread(theirs, sizeof(theirs), 1, f) == 1 && memcmp(theirs, agree_state.token, 16) == 0);
    if (f) fclose(f);
    if (!same)
        fprintf(stderr, "error: out_dir '%s' is not the folder rank 0 writes to (%s: %s): every rank needs one shared "
                "out_dir\n", out_dir, path, found ? "another run's token" : "missing");
    agree_round(same ? 0 : EXIT_FAILURE, 0);
    if (c->rank == 0) unlink(path);
}

// The ranks that share the start-up checks now: this rank and the world size of the joined
// ranks, whose errors reach every rank through rank 0, or 0 of 1 for a process that checks alone.
// A check of a file every rank reads (a checkpoint's checksums) may be split among them.
static inline void agree_sharing(int *rank, int *world) {
    *rank = agree_state.armed ? agree_state.comm->rank : 0;
    *world = agree_state.armed ? agree_state.comm->world : 1;
}

// The checks are over: errors print where they happen again.
static inline void agree_end(void) {
    agree_state.armed = 0;
    agree_release(1);
}
