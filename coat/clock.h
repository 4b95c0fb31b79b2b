// Seconds on the monotonic clock, for durations and deadlines (the wall clock can jump).
#pragma once
#include <time.h>

static inline double monotonic_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + now.tv_nsec / 1e9;
}
