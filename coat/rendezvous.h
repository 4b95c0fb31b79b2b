// The channel through which ranks launched without MPI (RANK / WORLD_SIZE, as torchrun sets
// them) meet: each rank's bytes gathered to rank 0, and rank 0's bytes to every rank (the NCCL
// unique id, the start-up checks of coat/agree.h). Every call waits for its peers at most
// timeout_s seconds; a peer that never comes or dies ends the others within it, naming the rank.
//   tcp:  with MASTER_ADDR and MASTER_PORT set. Rank 0 listens on MASTER_PORT (on MASTER_PORT + 1
//         when TORCHELASTIC_USE_AGENT_STORE=True: torchrun's agent then serves its own store on
//         MASTER_PORT), the others connect, retrying until the timeout. Each side first sends a
//         hello (magic, world size, rank, job id): rank 0 drops a connection from another job (a
//         rank of an earlier launch still retrying), a rank drops a rank 0 of another job, and a
//         world size or rank that cannot be this job's is refused. A closed connection is a dead
//         peer at once.
//   file: otherwise, files in a folder every rank sees (out_dir), named by the job id. Every
//         process draws a random nonce. Rank 0 publishes its own in DIR/rendezvous-JOB; for
//         exchange K each other rank writes DIR/rendezvous-JOB-K-rankR holding rank 0's nonce,
//         its own and its bytes, and rank 0 answers in DIR/rendezvous-JOB-K with every rank's
//         nonce: a rank takes only a reply that carries its own nonce, and rank 0 only requests
//         that carry its, so a file an earlier launch left (after a crash) is never taken, however
//         recent. A rank acknowledges the reply by removing its request; rank 0 then removes the
//         reply (and, after the first exchange, its hello): no file outlives the exchange.
// The job id: TORCHELASTIC_RUN_ID (with TORCHELASTIC_RESTART_COUNT), else SLURM_JOB_ID (with
// SLURM_STEP_ID), else "run".
// The trainer's plumbing (launch), not model code: coat/comm.h's channel without MPI.
#pragma once
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>
#include "clock.h"

#define RENDEZVOUS_MAGIC 0x31765A44524C4F43ull  // "COLRDZv1"
#define RENDEZVOUS_JOB_MAX 96

typedef struct {
    int rank, world;
    double timeout_s;
    char job[RENDEZVOUS_JOB_MAX];
    int tcp;            // 1: sockets, 0: files
    int *fds;           // tcp: rank 0 holds fds[1..world-1], the others fds[0] (to rank 0)
    char dir[4096];     // file: the shared folder
    uint64_t nonce;     // file: this process's
    uint64_t nonce0;    // file: rank 0's
    unsigned exchange;  // file: exchanges done, which names the next one's files
} Rendezvous;

typedef struct {
    uint64_t magic;
    int32_t world, rank;
    char job[RENDEZVOUS_JOB_MAX];
} RendezvousHello;

static inline void rendezvous_pause(void) {
    struct timespec pause = {0, 10 * 1000 * 1000};
    nanosleep(&pause, NULL);
}

// The job id that names this launch (see the header comment).
static inline void rendezvous_job(char *job, size_t size) {
    const char *run = getenv("TORCHELASTIC_RUN_ID"), *restart = getenv("TORCHELASTIC_RESTART_COUNT");
    const char *slurm = getenv("SLURM_JOB_ID"), *step = getenv("SLURM_STEP_ID");
    if (run && *run) snprintf(job, size, "%s.%s", run, restart ? restart : "0");
    else if (slurm && *slurm) snprintf(job, size, "%s.%s", slurm, step ? step : "batch");
    else snprintf(job, size, "run");
    for (char *p = job; *p; p++)  // a file name
        if (*p == '/') *p = '_';
}

// 64 random bits: the kernel's, else time and process id (still new for each launch).
static inline uint64_t rendezvous_random(void) {
    uint64_t x = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, &x, sizeof(x)) != (ssize_t)sizeof(x)) {
        struct timespec t;
        clock_gettime(CLOCK_REALTIME, &t);
        x = ((uint64_t)t.tv_nsec << 32) ^ (uint64_t)t.tv_sec ^ ((uint64_t)getpid() << 16);
    }
    if (fd >= 0) close(fd);
    return x;
}

// ---- tcp ----------------------------------------------------------------------------------------

// Waits until fd is ready for `events` or `deadline` passes. Returns 0, or -1 at the deadline.
static inline int rendezvous_wait_fd(int fd, short events, double deadline) {
    for (;;) {
        double left = deadline - monotonic_seconds();
        if (left <= 0) return -1;
        struct pollfd p = {fd, events, 0};
        int ready = poll(&p, 1, (int)(left * 1000) + 1);
        if (ready > 0) return 0;
        if (ready < 0 && errno != EINTR) return -1;
    }
}

// n bytes through fd by `deadline`. Returns 0, or -1: 1 when the peer closed, 2 at the deadline.
static inline int rendezvous_recv(int fd, void *bytes, size_t n, double deadline) {
    for (size_t done = 0; done < n;) {
        if (rendezvous_wait_fd(fd, POLLIN, deadline) != 0) return 2;
        ssize_t got = recv(fd, (char *)bytes + done, n - done, 0);
        if (got == 0 || (got < 0 && errno != EINTR && errno != EAGAIN)) return 1;
        if (got > 0) done += (size_t)got;
    }
    return 0;
}

static inline int rendezvous_send(int fd, const void *bytes, size_t n, double deadline) {
    for (size_t done = 0; done < n;) {
        if (rendezvous_wait_fd(fd, POLLOUT, deadline) != 0) return 2;
        ssize_t sent = send(fd, (const char *)bytes + done, n - done, MSG_NOSIGNAL);  // a dead peer: an error, no SIGPIPE
        if (sent < 0 && errno != EINTR && errno != EAGAIN) return 1;
        if (sent > 0) done += (size_t)sent;
    }
    return 0;
}

// The port rank 0 listens on (see the header comment), or -1 with a message.
static inline int rendezvous_port(char *error, size_t error_size) {
    const char *text = getenv("MASTER_PORT"), *agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    char *end;
    long port = strtol(text, &end, 10);
    if (*text == '\0' || *end != '\0' || port < 1 || port > 65534) {
        snprintf(error, error_size, "MASTER_PORT='%s' is not a port", text);
        return -1;
    }
    return (int)port + (agent && strcmp(agent, "True") == 0);
}

static inline int rendezvous_listen(int port, char *error, size_t error_size) {
    int fd = socket(AF_INET6, SOCK_STREAM, 0), one = 1, zero = 0;
    struct sockaddr_in6 address;
    memset(&address, 0, sizeof(address));
    address.sin6_family = AF_INET6;
    address.sin6_addr = in6addr_any;
    address.sin6_port = htons((uint16_t)port);
    if (fd >= 0) {
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // IPv4 peers too
    }
    if (fd < 0 || bind(fd, (struct sockaddr *)&address, sizeof(address)) != 0 || listen(fd, 128) != 0) {
        snprintf(error, error_size, "rank 0 cannot listen on port %d (MASTER_PORT): %s", port, strerror(errno));
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

// One connection attempt to host:port, given at most `wait` seconds. Returns the socket or -1.
static inline int rendezvous_try_connect(const char *host, int port, double wait) {
    char service[16];
    snprintf(service, sizeof(service), "%d", port);
    struct addrinfo hints, *found = NULL;
    memset(&hints, 0, sizeof(hints));
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, service, &hints, &found) != 0) return -1;
    int fd = -1;
    for (struct addrinfo *a = found; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0) continue;
        int status = connect(fd, a->ai_addr, a->ai_addrlen), failure = 0;
        socklen_t length = sizeof(failure);
        if (status != 0 && (errno != EINPROGRESS || rendezvous_wait_fd(fd, POLLOUT, monotonic_seconds() + wait) != 0 ||
                            getsockopt(fd, SOL_SOCKET, SO_ERROR, &failure, &length) != 0 || failure != 0)) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(found);
    return fd;
}

static inline void rendezvous_hello(const Rendezvous *r, RendezvousHello *h) {
    memset(h, 0, sizeof(*h));
    h->magic = RENDEZVOUS_MAGIC;
    h->world = r->world;
    h->rank = r->rank;
    snprintf(h->job, sizeof(h->job), "%s", r->job);
}

// A rank other than 0: connects to rank 0 and trades hellos with it, retrying until the deadline.
static inline int rendezvous_connect(Rendezvous *r, const char *host, int port, char *error, size_t error_size) {
    double deadline = monotonic_seconds() + r->timeout_s;
    RendezvousHello mine, theirs;
    rendezvous_hello(r, &mine);
    while (monotonic_seconds() < deadline) {
        int fd = rendezvous_try_connect(host, port, 1.0);
        if (fd >= 0 && rendezvous_send(fd, &mine, sizeof(mine), deadline) == 0 &&
            rendezvous_recv(fd, &theirs, sizeof(theirs), deadline) == 0 && theirs.magic == RENDEZVOUS_MAGIC &&
            strncmp(theirs.job, r->job, sizeof(theirs.job)) == 0) {
            r->fds[0] = fd;
            return 0;
        }
        if (fd >= 0) close(fd);  // refused, or another job's rank 0: try again
        rendezvous_pause();
        rendezvous_pause();
    }
    snprintf(error, error_size, "rank %d: no rank 0 of job %s answered at %s:%d (MASTER_ADDR:MASTER_PORT) within %.0f s",
             r->rank, r->job, host, port, r->timeout_s);
    return -1;
}

// Rank 0: accepts a connection and its hello. Returns the rank it announces (0: dropped, another
// job's or none), or -1 with a message (a world size or rank that cannot be this job's).
static inline int rendezvous_accept_one(Rendezvous *r, int listener, double deadline, char *error, size_t error_size) {
    int fd = accept(listener, NULL, NULL);
    if (fd < 0) return 0;
    RendezvousHello theirs, mine;
    rendezvous_hello(r, &mine);
    double hello_by = monotonic_seconds() + 5.0 < deadline ? monotonic_seconds() + 5.0 : deadline;  // a silent stranger
    if (rendezvous_recv(fd, &theirs, sizeof(theirs), hello_by) != 0 || theirs.magic != RENDEZVOUS_MAGIC ||
        strncmp(theirs.job, r->job, sizeof(theirs.job)) != 0) {
        close(fd);
        return 0;
    }
    if (theirs.world != r->world || theirs.rank < 1 || theirs.rank >= r->world || r->fds[theirs.rank] >= 0) {
        snprintf(error, error_size, "a process of job %s announces rank %d of %d (WORLD_SIZE) to rank 0 of %d%s", r->job,
                 theirs.rank, theirs.world, r->world,
                 theirs.world == r->world && theirs.rank >= 1 && theirs.rank < r->world ? ", a rank already there" : "");
        close(fd);
        return -1;
    }
    if (rendezvous_send(fd, &mine, sizeof(mine), deadline) != 0) {
        close(fd);
        return 0;
    }
    r->fds[theirs.rank] = fd;
    return theirs.rank;
}

// The first rank in 1..world-1 without a connection (world when all are there).
static inline int rendezvous_first_missing(const Rendezvous *r) {
    int missing = 1;
    while (missing < r->world && r->fds[missing] >= 0) missing++;
    return missing;
}

static inline int rendezvous_accept_all(Rendezvous *r, int port, char *error, size_t error_size) {
    int listener = rendezvous_listen(port, error, error_size);
    if (listener < 0) return -1;
    double deadline = monotonic_seconds() + r->timeout_s;
    int joined = 1;
    while (joined < r->world && rendezvous_wait_fd(listener, POLLIN, deadline) == 0) {
        int rank = rendezvous_accept_one(r, listener, deadline, error, error_size);
        if (rank < 0) {
            close(listener);
            return -1;
        }
        joined += rank > 0;
    }
    close(listener);
    if (joined == r->world) return 0;
    snprintf(error, error_size, "rank %d of job %s did not connect to rank 0 (port %d) within %.0f s", rendezvous_first_missing(r),
             r->job, port, r->timeout_s);
    return -1;
}

static inline int rendezvous_open_tcp(Rendezvous *r, char *error, size_t error_size) {
    r->tcp = 1;
    r->fds = (int *)malloc((size_t)r->world * sizeof(int));
    if (!r->fds) {
        snprintf(error, error_size, "out of host memory for the rendezvous");
        return -1;
    }
    for (int i = 0; i < r->world; i++) r->fds[i] = -1;
    int port = rendezvous_port(error, error_size);
    if (port < 0) return -1;
    if (r->rank == 0) return rendezvous_accept_all(r, port, error, error_size);
    return rendezvous_connect(r, getenv("MASTER_ADDR"), port, error, error_size);
}

// A transfer's failure as a message: `peer` closed (exited) or was silent past the timeout.
static inline int rendezvous_lost(const Rendezvous *r, int peer, int why, const char *what, char *error, size_t error_size) {
    if (why == 1) snprintf(error, error_size, "rank %d: rank %d left the rendezvous (%s): did it exit?", r->rank, peer, what);
    else snprintf(error, error_size, "rank %d: rank %d sent nothing within %.0f s (%s)", r->rank, peer, r->timeout_s, what);
    return -1;
}

static inline int rendezvous_exchange_tcp(Rendezvous *r, const void *mine, size_t n, void *all, void *out, size_t m,
                                          char *error, size_t error_size) {
    double deadline = monotonic_seconds() + r->timeout_s;
    unsigned char done = 1;  // rank 0's answer starts with it, so that every exchange waits for all ranks
    int why;
    if (r->rank != 0) {
        if ((why = rendezvous_send(r->fds[0], mine, n, deadline)) != 0) return rendezvous_lost(r, 0, why, "sending", error, error_size);
        if ((why = rendezvous_recv(r->fds[0], &done, 1, deadline)) != 0 || (why = rendezvous_recv(r->fds[0], out, m, deadline)) != 0)
            return rendezvous_lost(r, 0, why, "its answer", error, error_size);
        return 0;
    }
    for (int peer = 1; peer < r->world; peer++)
        if ((why = rendezvous_recv(r->fds[peer], (char *)all + (size_t)peer * n, n, deadline)) != 0)
            return rendezvous_lost(r, peer, why, "its part", error, error_size);
    for (int peer = 1; peer < r->world; peer++)
        if ((why = rendezvous_send(r->fds[peer], &done, 1, deadline)) != 0 || (why = rendezvous_send(r->fds[peer], out, m, deadline)) != 0)
            return rendezvous_lost(r, peer, why, "rank 0's answer", error, error_size);
    return 0;
}

// ---- files --------------------------------------------------------------------------------------

typedef struct {
    uint64_t magic, nonce0, nonce;  // rank 0's nonce and the writer's
    int32_t rank, world;
    uint64_t bytes;                 // that follow
} RendezvousFileHeader;

static inline void rendezvous_path(const Rendezvous *r, int exchange, int rank, char *path, size_t size) {
    if (exchange < 0) snprintf(path, size, "%s/rendezvous-%s", r->dir, r->job);
    else if (rank < 0) snprintf(path, size, "%s/rendezvous-%s-%d", r->dir, r->job, exchange);
    else snprintf(path, size, "%s/rendezvous-%s-%d-rank%d", r->dir, r->job, exchange, rank);
}

// Writes header and bytes to path through path.tmp and a rename: a reader never sees half a file.
static inline int rendezvous_write_file(const char *path, const RendezvousFileHeader *h, const void *head, size_t head_bytes,
                                        const void *bytes, size_t n, char *error, size_t error_size) {
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "wb");
    int ok = f && fwrite(h, sizeof(*h), 1, f) == 1 && (head_bytes == 0 || fwrite(head, head_bytes, 1, f) == 1) &&
             (n == 0 || fwrite(bytes, n, 1, f) == 1);
    if (f && fclose(f) != 0) ok = 0;
    if (ok && rename(tmp, path) == 0) return 0;
    snprintf(error, error_size, "%s: cannot write the rendezvous file: %s", path, strerror(errno));
    return -1;
}

// Reads path's header and then exactly n bytes into out (head_bytes into head first). Returns
// 0, or -1 when the file is missing or not that long (being replaced, or someone else's).
static inline int rendezvous_read_file(const char *path, RendezvousFileHeader *h, void *head, size_t head_bytes, void *out,
                                       size_t n) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    int ok = fread(h, sizeof(*h), 1, f) == 1 && h->magic == RENDEZVOUS_MAGIC && h->bytes == head_bytes + n &&
             (head_bytes == 0 || fread(head, head_bytes, 1, f) == 1) && (n == 0 || fread(out, n, 1, f) == 1);
    fclose(f);
    return ok ? 0 : -1;
}

static inline RendezvousFileHeader rendezvous_header(const Rendezvous *r, size_t bytes) {
    RendezvousFileHeader h = {RENDEZVOUS_MAGIC, r->nonce0, r->nonce, r->rank, r->world, bytes};
    return h;
}

// Rank 0: reads the requests of this exchange into all (and their writers' nonces), dropping
// those of an earlier launch. Returns the first rank still missing (world when none), or -1 with
// a message (a request of this launch from a process with another world size).
static inline int rendezvous_collect(Rendezvous *r, uint64_t *nonces, unsigned char *have, void *all, size_t n,
                                     char *error, size_t error_size) {
    for (int peer = 1; peer < r->world; peer++) {
        char path[4200];
        RendezvousFileHeader h;
        rendezvous_path(r, (int)r->exchange, peer, path, sizeof(path));
        if (have[peer] || rendezvous_read_file(path, &h, NULL, 0, (char *)all + (size_t)peer * n, n) != 0) continue;
        if (h.nonce0 != r->nonce0) {
            unlink(path);  // a stale request (or one written for a stale hello: its writer writes again)
            continue;
        }
        if (h.world != r->world || h.rank != peer) {
            snprintf(error, error_size, "%s: a rank of job %s announces rank %d of %d to rank 0 of %d", path, r->job, h.rank,
                     h.world, r->world);
            return -1;
        }
        nonces[peer] = h.nonce;
        have[peer] = 1;
    }
    int missing = 1;
    while (missing < r->world && have[missing]) missing++;
    return missing;
}

// Rank 0 waits until every rank removed its request: they have the reply.
static inline int rendezvous_wait_taken(Rendezvous *r, double deadline, char *error, size_t error_size) {
    for (int peer = 1; peer < r->world; peer++) {
        char path[4200];
        struct stat info;
        rendezvous_path(r, (int)r->exchange, peer, path, sizeof(path));
        while (stat(path, &info) == 0) {
            if (monotonic_seconds() > deadline) {
                snprintf(error, error_size, "rank %d did not take rank 0's rendezvous reply in %s within %.0f s", peer, r->dir,
                         r->timeout_s);
                return -1;
            }
            rendezvous_pause();
        }
    }
    return 0;
}

static inline int rendezvous_serve(Rendezvous *r, void *all, const void *out, size_t n, size_t m, char *error,
                                   size_t error_size) {
    double deadline = monotonic_seconds() + r->timeout_s;
    uint64_t *nonces = (uint64_t *)calloc((size_t)r->world, sizeof(uint64_t));
    unsigned char *have = (unsigned char *)calloc((size_t)r->world, 1);
    char path[4200];
    int status = nonces && have ? 0 : -1, missing = 1;
    if (status != 0) snprintf(error, error_size, "out of host memory for the rendezvous");
    while (status == 0 && (missing = rendezvous_collect(r, nonces, have, all, n, error, error_size)) < r->world) {
        if (missing < 0) status = -1;
        else if (monotonic_seconds() > deadline) {
            snprintf(error, error_size, "rank %d of job %s did not join the rendezvous in %s within %.0f s (is %s shared by "
                     "every rank?)", missing, r->job, r->dir, r->timeout_s, r->dir);
            status = -1;
        } else rendezvous_pause();
    }
    rendezvous_path(r, (int)r->exchange, -1, path, sizeof(path));
    if (status == 0) {
        nonces[0] = r->nonce;
        RendezvousFileHeader h = rendezvous_header(r, (size_t)r->world * sizeof(uint64_t) + m);
        status = rendezvous_write_file(path, &h, nonces, (size_t)r->world * sizeof(uint64_t), out, m, error, error_size);
    }
    if (status == 0) status = rendezvous_wait_taken(r, deadline, error, error_size);
    unlink(path);
    free(nonces);
    free(have);
    return status;
}

// A rank other than 0: (re)writes its request whenever rank 0's hello names a nonce its request
// does not carry, and takes the reply that carries its own nonce.
static inline int rendezvous_ask(Rendezvous *r, const void *mine, size_t n, void *out, size_t m, char *error,
                                 size_t error_size) {
    double deadline = monotonic_seconds() + r->timeout_s;
    char hello[4200], request[4200], reply[4200];
    rendezvous_path(r, -1, -1, hello, sizeof(hello));
    rendezvous_path(r, (int)r->exchange, r->rank, request, sizeof(request));
    rendezvous_path(r, (int)r->exchange, -1, reply, sizeof(reply));
    uint64_t *nonces = (uint64_t *)malloc((size_t)r->world * sizeof(uint64_t)), written = 0;
    if (!nonces) {
        snprintf(error, error_size, "out of host memory for the rendezvous");
        return -1;
    }
    int status = -1;
    for (; status != 0 && monotonic_seconds() < deadline; rendezvous_pause()) {
        RendezvousFileHeader h;
        if (r->exchange == 0 && rendezvous_read_file(hello, &h, NULL, 0, NULL, 0) == 0) r->nonce0 = h.nonce0;
        if (r->nonce0 != 0 && r->nonce0 != written) {
            RendezvousFileHeader mine_h = rendezvous_header(r, n);
            if (rendezvous_write_file(request, &mine_h, NULL, 0, mine, n, error, error_size) != 0) break;
            written = r->nonce0;
        }
        if (written != 0 && rendezvous_read_file(reply, &h, nonces, (size_t)r->world * sizeof(uint64_t), out, m) == 0 &&
            h.nonce0 == written && h.world == r->world && nonces[r->rank] == r->nonce) {
            unlink(request);  // the acknowledgement
            status = 0;
        }
    }
    free(nonces);
    if (status != 0) unlink(request);
    if (status != 0 && monotonic_seconds() >= deadline)
        snprintf(error, error_size, "rank %d: rank 0 of job %s did not answer in %s within %.0f s (is %s shared by every "
                 "rank?)", r->rank, r->job, r->dir, r->timeout_s, r->dir);
    return status;
}

static inline int rendezvous_exchange_file(Rendezvous *r, const void *mine, size_t n, void *all, void *out, size_t m,
                                           char *error, size_t error_size) {
    int status = r->rank == 0 ? rendezvous_serve(r, all, out, n, m, error, error_size)
                              : rendezvous_ask(r, mine, n, out, m, error, error_size);
    if (r->rank == 0 && r->exchange == 0) {  // every rank has rank 0's nonce now
        char hello[4200];
        rendezvous_path(r, -1, -1, hello, sizeof(hello));
        unlink(hello);
    }
    r->exchange++;
    return status;
}

// DIR and its missing parents (rank 0 creates out_dir before the trainer would: it meets there).
static inline void rendezvous_make_dir(const char *dir) {
    char partial[4096];
    snprintf(partial, sizeof(partial), "%s", dir);
    for (char *p = partial + 1; *p; p++)
        if (*p == '/') {
            *p = '\0';
            mkdir(partial, 0777);
            *p = '/';
        }
    mkdir(partial, 0777);
}

static inline int rendezvous_open_file(Rendezvous *r, const char *dir, char *error, size_t error_size) {
    if (dir[0] == '\0') {
        snprintf(error, error_size, "ranks without MPI meet through MASTER_ADDR and MASTER_PORT, or a folder (out_dir): "
                 "set either");
        return -1;
    }
    snprintf(r->dir, sizeof(r->dir), "%s", dir);
    r->nonce = rendezvous_random() | 1;  // never 0, which means "none yet"
    if (r->rank != 0) return 0;
    rendezvous_make_dir(dir);
    r->nonce0 = r->nonce;
    char hello[4200];
    rendezvous_path(r, -1, -1, hello, sizeof(hello));
    RendezvousFileHeader h = rendezvous_header(r, 0);
    return rendezvous_write_file(hello, &h, NULL, 0, NULL, 0, error, error_size);
}

// ---- the channel --------------------------------------------------------------------------------

// Opens the channel of rank `rank` of `world` (tcp with MASTER_ADDR and MASTER_PORT set, else
// files in dir, which must exist). Returns 0, or -1 with a message.
static inline int rendezvous_open(Rendezvous *r, int rank, int world, const char *dir, double timeout_s, char *error,
                                  size_t error_size) {
    memset(r, 0, sizeof(*r));
    r->rank = rank;
    r->world = world;
    r->timeout_s = timeout_s;
    rendezvous_job(r->job, sizeof(r->job));
    const char *addr = getenv("MASTER_ADDR"), *port = getenv("MASTER_PORT");
    if (addr && *addr && port && *port) return rendezvous_open_tcp(r, error, error_size);
    return rendezvous_open_file(r, dir, error, error_size);
}

// Every rank's n bytes of `mine` into all[world * n] on rank 0 (its own at 0), then rank 0's m
// bytes of `out` into every rank's `out`. Returns 0, or -1 with a message.
static inline int rendezvous_exchange(Rendezvous *r, const void *mine, size_t n, void *all, void *out, size_t m, char *error,
                                      size_t error_size) {
    if (r->rank == 0 && n) memcpy(all, mine, n);
    return r->tcp ? rendezvous_exchange_tcp(r, mine, n, all, out, m, error, error_size)
                  : rendezvous_exchange_file(r, mine, n, all, out, m, error, error_size);
}

static inline int rendezvous_gather(Rendezvous *r, const void *mine, void *all, size_t n, char *error, size_t error_size) {
    return rendezvous_exchange(r, mine, n, all, NULL, 0, error, error_size);
}

static inline int rendezvous_broadcast(Rendezvous *r, void *bytes, size_t n, char *error, size_t error_size) {
    return rendezvous_exchange(r, NULL, 0, NULL, bytes, n, error, error_size);
}

static inline void rendezvous_close(Rendezvous *r) {
    for (int i = 0; r->fds && i < r->world; i++)
        if (r->fds[i] >= 0) close(r->fds[i]);
    free(r->fds);
    r->fds = NULL;
}
