// Test harness shared by every test program: one line per check, then a
// closing "<program>: N passed, N failed". test/run_tests.sh adds them up.
#pragma once
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

static int checks_passed, checks_failed;

// Records one check; the message names what was checked.
static inline void check(int ok, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    printf(ok ? "PASS " : "FAIL ");
    vprintf(fmt, args);
    printf("\n");
    va_end(args);
    if (ok) checks_passed++; else checks_failed++;
    fflush(stdout);
}

// Compares two float arrays element-wise with |got - expected| <= atol + rtol * |expected|.
// On failure prints the worst element as expected vs got. Returns 1 when all are close.
static inline int check_close(const char *name, const float *got, const float *expected, size_t n,
                       double atol, double rtol) {
    size_t worst = 0, bad = 0;
    double worst_excess = -1.0, max_abs_err = 0.0;
    for (size_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - (double)expected[i]);
        double allowed = atol + rtol * fabs((double)expected[i]);
        if (!(err <= allowed)) bad++;  // also catches NaN
        if (err > max_abs_err || isnan(err)) max_abs_err = err;
        double excess = isnan(err) ? INFINITY : err - allowed;
        if (excess > worst_excess) { worst_excess = excess; worst = i; }
    }
    if (bad == 0) {
        check(1, "%s (n=%zu, max abs err %.3g)", name, n, max_abs_err);
        return 1;
    }
    check(0, "%s: %zu of %zu elements off; element %zu expected %.8g got %.8g (atol %.3g rtol %.3g)",
          name, bad, n, worst, (double)expected[worst], (double)got[worst], atol, rtol);
    return 0;
}

// Prints the closing line and returns the process exit code.
static inline int check_summary(const char *program) {
    printf("%s: %d passed, %d failed\n", program, checks_passed, checks_failed);
    return checks_failed ? 1 : 0;
}
