// The collectives' watchdog: a thread that ends a rank whose collectives fail or hang, where it
// would otherwise wait forever (a rank that dies leaves the others' NCCL kernels spinning, and
// their host threads blocked in a wait on the GPU). The host brackets each wait that needs the
// other ranks (watchdog_wait_begin / watchdog_wait_end, naming it); every poll_s the thread asks
// the backend for an asynchronous error and looks at the open wait's age. An error, or a wait
// older than timeout_s, calls `fire` with one line naming the rank and the wait; fire prints it
// and ends the process (coat/zero.cuh: ncclCommAbort, then exit status EXIT_COLLECTIVE_FAILED).
// The decision is watchdog_verdict, a pure function; the thread reaches the backend only through
// the two function pointers, so test/test_watchdog.c runs both on the CPU with fakes.
// Plain C: no CUDA, no NCCL.
#pragma once
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "clock.h"

// The exit status of a rank the watchdog ends (train_llama's; see collective_timeout_s).
#define EXIT_COLLECTIVE_FAILED 3
#define WATCHDOG_POLL_S 0.2
#define WATCHDOG_WHAT_CHARS 160

typedef struct {
    int waiting;       // the host waits for work that includes collectives
    double began_s;    // since when (monotonic_seconds)
    const char *what;  // the wait, for messages: "the gradient reduces of step 12"
} WatchdogWait;

// What the watchdog does at now_s, given the wait (if any) and the backend's asynchronous error
// as text (NULL: none): returns 1 with the line to print in message (the rank ends), or 0.
static inline int watchdog_verdict(double now_s, const WatchdogWait *wait, double timeout_s, const char *async_error,
                                   int rank, char *message, size_t size) {
    if (async_error && wait->waiting) {
        snprintf(message, size, "error: rank %d: NCCL failed in %s: %s: aborting", rank, wait->what, async_error);
        return 1;
    }
    if (async_error) {
        snprintf(message, size, "error: rank %d: NCCL failed: %s: aborting", rank, async_error);
        return 1;
    }
    if (wait->waiting && now_s - wait->began_s > timeout_s) {
        snprintf(message, size, "error: rank %d: %s did not finish within %g s (collective_timeout_s; a rank died or hangs?): "
                 "aborting", rank, wait->what, timeout_s);
        return 1;
    }
    return 0;
}

// The backend: poll returns NULL, or its asynchronous error as text written into `text`; fire
// prints the message and ends the process (a test's fake returns, and the thread then ends).
typedef const char *(*WatchdogPoll)(void *backend, char *text, size_t size);
typedef void (*WatchdogFire)(void *backend, const char *message);

typedef struct {
    pthread_mutex_t lock;  // guards wait, what and stop
    WatchdogWait wait;
    char what[WATCHDOG_WHAT_CHARS];  // wait.what points here
    int stop;
    int rank;
    double timeout_s, poll_s;
    WatchdogPoll poll;
    WatchdogFire fire;
    void *backend;
    pthread_t thread;
} Watchdog;

static inline void *watchdog_run(void *arg) {
    Watchdog *w = (Watchdog *)arg;
    char what[WATCHDOG_WHAT_CHARS], error[512], message[1024];
    struct timespec nap = {(time_t)w->poll_s, (long)((w->poll_s - (time_t)w->poll_s) * 1e9)};
    for (;;) {
        pthread_mutex_lock(&w->lock);
        int stop = w->stop;
        WatchdogWait wait = w->wait;
        memcpy(what, w->what, sizeof(what));
        pthread_mutex_unlock(&w->lock);
        if (stop) return NULL;
        wait.what = what;
        const char *async_error = w->poll(w->backend, error, sizeof(error));
        if (watchdog_verdict(monotonic_seconds(), &wait, w->timeout_s, async_error, w->rank, message, sizeof(message))) {
            w->fire(w->backend, message);
            return NULL;
        }
        nanosleep(&nap, NULL);
    }
}

// Starts the thread; returns 0 or pthread_create's error number.
static inline int watchdog_start(Watchdog *w, int rank, double timeout_s, double poll_s, WatchdogPoll poll, WatchdogFire fire,
                                 void *backend) {
    memset(w, 0, sizeof(*w));
    pthread_mutex_init(&w->lock, NULL);
    w->wait.what = w->what;
    w->rank = rank;
    w->timeout_s = timeout_s;
    w->poll_s = poll_s;
    w->poll = poll;
    w->fire = fire;
    w->backend = backend;
    int started = pthread_create(&w->thread, NULL, watchdog_run, w);
    if (started != 0) pthread_mutex_destroy(&w->lock);
    return started;
}

// Ends the thread (within poll_s) and waits for it.
static inline void watchdog_stop(Watchdog *w) {
    pthread_mutex_lock(&w->lock);
    w->stop = 1;
    pthread_mutex_unlock(&w->lock);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->lock);
}

// The host starts waiting for work that includes collectives, named by `what` (copied).
static inline void watchdog_wait_begin(Watchdog *w, const char *what) {
    pthread_mutex_lock(&w->lock);
    snprintf(w->what, sizeof(w->what), "%s", what);
    w->wait.began_s = monotonic_seconds();
    w->wait.waiting = 1;
    pthread_mutex_unlock(&w->lock);
}

static inline void watchdog_wait_end(Watchdog *w) {
    pthread_mutex_lock(&w->lock);
    w->wait.waiting = 0;
    pthread_mutex_unlock(&w->lock);
}
