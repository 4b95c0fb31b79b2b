// coat/watchdog.h on the CPU: the verdict (no action while idle or within the timeout, the
// timeout's and an asynchronous error's messages, a finished wait reset), and the thread itself
// with a fake backend, polling as often as in training: it fires within a second of a 0.2 s
// timeout, at the next poll on an asynchronous error, and never on waits that end in time or
// while idle; it stops when asked.
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include "../coat/watchdog.h"
#include "check.h"

static void check_verdict(void) {
    char message[512] = "";
    WatchdogWait idle = {0, 0.0, "the gradient reduces of step 12"};
    check(!watchdog_verdict(1e9, &idle, 600.0, NULL, 1, message, sizeof(message)),
          "verdict: no action while no wait is open, however long");
    WatchdogWait open = {1, 100.0, "the gradient reduces of step 12"};
    check(!watchdog_verdict(100.0 + 599.0, &open, 600.0, NULL, 1, message, sizeof(message)),
          "verdict: no action within the timeout");
    const char *want = "error: rank 1: the gradient reduces of step 12 did not finish within 600 s (collective_timeout_s; "
                       "a rank died or hangs?): aborting";
    int fired = watchdog_verdict(100.0 + 601.0, &open, 600.0, NULL, 1, message, sizeof(message));
    check(fired && strcmp(message, want) == 0, "verdict: a wait past the timeout aborts, naming the rank and the wait "
          "(expected \"%s\", got %d \"%s\")", want, fired, message);
    want = "error: rank 3: NCCL failed in the gradient reduces of step 12: remote process exited or there was a network "
           "error (socket closed): aborting";
    fired = watchdog_verdict(100.0 + 1.0, &open, 600.0, "remote process exited or there was a network error (socket closed)", 3,
                             message, sizeof(message));
    check(fired && strcmp(message, want) == 0, "verdict: an asynchronous error aborts at once, naming the error and the wait "
          "(expected \"%s\", got %d \"%s\")", want, fired, message);
    want = "error: rank 0: NCCL failed: unhandled cuda error (fake): aborting";
    fired = watchdog_verdict(5.0, &idle, 600.0, "unhandled cuda error (fake)", 0, message, sizeof(message));
    check(fired && strcmp(message, want) == 0, "verdict: an asynchronous error aborts outside a wait too (expected \"%s\", "
          "got %d \"%s\")", want, fired, message);
    open.waiting = 0;  // the wait finished: its age no longer counts
    check(!watchdog_verdict(100.0 + 1e6, &open, 600.0, NULL, 1, message, sizeof(message)), "verdict: a finished wait resets");
}

// The fake backend: an error to report once `failing` is set, and what fire was given.
typedef struct {
    atomic_int failing, fired;
    double fired_at_s;
    char message[1024];
} FakeBackend;

static const char *fake_poll(void *backend, char *text, size_t size) {
    FakeBackend *b = (FakeBackend *)backend;
    if (!atomic_load(&b->failing)) return NULL;
    snprintf(text, size, "unhandled system error (fake)");
    return text;
}

static void fake_fire(void *backend, const char *message) {
    FakeBackend *b = (FakeBackend *)backend;
    b->fired_at_s = monotonic_seconds();
    snprintf(b->message, sizeof(b->message), "%s", message);
    atomic_store(&b->fired, 1);
}

static void sleep_s(double seconds) {
    struct timespec nap = {(time_t)seconds, (long)((seconds - (time_t)seconds) * 1e9)};
    nanosleep(&nap, NULL);
}

// Waits at most 2 s for the fake to fire; returns whether it did.
static int await_fire(FakeBackend *b) {
    for (double waited = 0.0; waited < 2.0 && !atomic_load(&b->fired); waited += 0.01) sleep_s(0.01);
    return atomic_load(&b->fired);
}

static void check_thread(void) {
    Watchdog w;
    FakeBackend b;
    memset(&b, 0, sizeof(b));
    int started = watchdog_start(&w, 2, 0.2, WATCHDOG_POLL_S, fake_poll, fake_fire, &b);
    check(started == 0, "thread: starts (pthread_create %d)", started);
    for (int i = 0; i < 10; i++) {
        watchdog_wait_begin(&w, "a short wait");
        sleep_s(0.05);
        watchdog_wait_end(&w);
    }
    sleep_s(0.5);  // idle, longer than the timeout
    check(!atomic_load(&b.fired), "thread: no action on waits within the timeout, nor while idle past it");
    double began = monotonic_seconds();
    watchdog_wait_begin(&w, "the parameter gather");
    int fired = await_fire(&b);
    double after = b.fired_at_s - began;
    watchdog_wait_end(&w);
    const char *want = "error: rank 2: the parameter gather did not finish within 0.2 s";
    check(fired && after >= 0.2 && after < 1.0 && strncmp(b.message, want, strlen(want)) == 0,
          "thread: a wait past a 0.2 s timeout fires within a second (fired %d after %.3f s: \"%s\")", fired, after, b.message);
    watchdog_stop(&w);

    memset(&b, 0, sizeof(b));
    watchdog_start(&w, 0, 600.0, WATCHDOG_POLL_S, fake_poll, fake_fire, &b);
    watchdog_wait_begin(&w, "the loss and norm all-reduce of step 3");
    began = monotonic_seconds();
    atomic_store(&b.failing, 1);
    fired = await_fire(&b);
    after = b.fired_at_s - began;
    want = "error: rank 0: NCCL failed in the loss and norm all-reduce of step 3: unhandled system error (fake): aborting";
    check(fired && after < 0.5 && strcmp(b.message, want) == 0,
          "thread: an asynchronous error fires by the next poll (fired %d after %.3f s: expected \"%s\", got \"%s\")", fired,
          after, want, b.message);
    watchdog_stop(&w);

    memset(&b, 0, sizeof(b));
    watchdog_start(&w, 0, 0.2, WATCHDOG_POLL_S, fake_poll, fake_fire, &b);
    began = monotonic_seconds();
    watchdog_stop(&w);
    double stopping = monotonic_seconds() - began;
    check(!atomic_load(&b.fired) && stopping < 0.5, "thread: stops when asked (%.3f s), without firing", stopping);
}

int main(void) {
    check_verdict();
    check_thread();
    printf("test_watchdog: %d passed, %d failed\n", checks_passed, checks_failed);
    return checks_failed ? 1 : 0;
}
