// GPU time per op of a training step, from CUDA events recorded on the compute stream between
// consecutive ops: the time from one mark to the next is charged to the op named by the later
// mark, so any idle time of the GPU before an op (a launch gap, the host waiting) is charged to
// it too, and the ops of a step add up to the step. A NULL timer makes every call a no-op, which
// is how the trainer runs when it is not profiling.
//
//   op_timer_mark(timer, NULL, stream)        a baseline: the start of a step
//   op_timer_mark(timer, "rope forward", s)   after the op has been issued
//   op_timer_end_step(timer)                  waits for the step's last event and adds it up
// The printout sets each op beside its speed of light (coat/speed_of_light.h).
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "common.cuh"
#include "speed_of_light.h"

#define OP_TIMER_MARKS 4096  // events between two collections; a longer step is collected in parts
#define OP_TIMER_OPS 128     // distinct op names

typedef struct {
    cudaEvent_t events[OP_TIMER_MARKS];
    const char *mark_ops[OP_TIMER_MARKS];  // the op that ends at each mark; NULL for a baseline
    int marks;
    const char *op_names[OP_TIMER_OPS];   // string literals, compared by content
    double op_ms[OP_TIMER_OPS];
    long long op_calls[OP_TIMER_OPS];
    int ops;
    int steps;
} OpTimer;

static inline OpTimer *op_timer_create(void) {
    OpTimer *timer = (OpTimer *)calloc(1, sizeof(OpTimer));
    if (timer == NULL) {
        fprintf(stderr, "error: out of host memory (op timer)\n");
        exit(EXIT_FAILURE);
    }
    for (int i = 0; i < OP_TIMER_MARKS; i++) cudaCheck(cudaEventCreate(&timer->events[i]));
    return timer;
}

static inline void op_timer_destroy(OpTimer *timer) {
    if (timer == NULL) return;
    for (int i = 0; i < OP_TIMER_MARKS; i++) cudaCheck(cudaEventDestroy(timer->events[i]));
    free(timer);
}

static inline int op_timer_slot(OpTimer *timer, const char *op) {
    for (int i = 0; i < timer->ops; i++)
        if (strcmp(timer->op_names[i], op) == 0) return i;
    if (timer->ops == OP_TIMER_OPS) {
        fprintf(stderr, "error: op timer: more than %d op names\n", OP_TIMER_OPS);
        exit(EXIT_FAILURE);
    }
    timer->op_names[timer->ops] = op;
    timer->op_ms[timer->ops] = 0.0;
    timer->op_calls[timer->ops] = 0;
    return timer->ops++;
}

// Waits for the last mark and adds every interval to its op; the last mark stays as the
// baseline of what follows.
static inline void op_timer_collect(OpTimer *timer) {
    if (timer->marks == 0) return;
    cudaCheck(cudaEventSynchronize(timer->events[timer->marks - 1]));
    for (int i = 1; i < timer->marks; i++) {
        if (timer->mark_ops[i] == NULL) continue;
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, timer->events[i - 1], timer->events[i]));
        int slot = op_timer_slot(timer, timer->mark_ops[i]);
        timer->op_ms[slot] += ms;
        timer->op_calls[slot]++;
    }
    cudaEvent_t last = timer->events[timer->marks - 1];
    timer->events[timer->marks - 1] = timer->events[0];
    timer->events[0] = last;
    timer->mark_ops[0] = NULL;
    timer->marks = 1;
}

static inline void op_timer_mark(OpTimer *timer, const char *op, cudaStream_t stream) {
    if (timer == NULL) return;
    if (timer->marks == OP_TIMER_MARKS) op_timer_collect(timer);
    cudaCheck(cudaEventRecord(timer->events[timer->marks], stream));
    timer->mark_ops[timer->marks++] = op;
}

// Ends a step: what happens on the GPU until the next baseline (validation, checkpoints) is
// charged to no op.
static inline void op_timer_end_step(OpTimer *timer) {
    if (timer == NULL) return;
    op_timer_collect(timer);
    timer->marks = 0;
    timer->steps++;
}

// Forgets the steps so far (the first step chooses GEMM algorithms and warms caches).
static inline void op_timer_clear(OpTimer *timer) {
    if (timer == NULL) return;
    timer->marks = 0;
    timer->ops = 0;
    timer->steps = 0;
}

// One line per op, the slowest first: calls and milliseconds per step, share of the step, and
// from `sol` (NULL: none) the op's speed of light per step and how many times slower it ran
// ('-' where the op has none).
static inline void op_timer_print(FILE *out, const OpTimer *timer, SolTable *sol) {
    if (timer->steps == 0) {
        fprintf(out, "profile: no step was timed after the first (it includes the GEMM algorithm choice)\n");
        return;
    }
    int order[OP_TIMER_OPS];
    double total_ms = 0.0, total_sol_ms = 0.0;
    for (int i = 0; i < timer->ops; i++) {
        order[i] = i;
        total_ms += timer->op_ms[i];
    }
    for (int i = 1; i < timer->ops; i++)  // insertion sort by time, descending
        for (int j = i; j > 0 && timer->op_ms[order[j]] > timer->op_ms[order[j - 1]]; j--) {
            int swap = order[j];
            order[j] = order[j - 1];
            order[j - 1] = swap;
        }
    fprintf(out, "profile: GPU time per step, mean of %d steps (an op's time includes any GPU idle time before it); "
                 "SoL: at the H200's %.0f/%.0f TFLOP/s BF16/FP8 dense or %.2f TB/s copy bandwidth (read + write)\n",
            timer->steps, SOL_BF16_FLOP_PER_S / 1e12, SOL_FP8_FLOP_PER_S / 1e12, SOL_BYTES_PER_S / 1e12);
    fprintf(out, "  %-36s %10s %10s %8s %11s %7s\n", "op", "calls/step", "ms/step", "share", "SoL ms/step", "x SoL");
    for (int k = 0; k < timer->ops; k++) {
        int i = order[k];
        double ms = timer->op_ms[i] / timer->steps, sol_step_ms = sol ? sol_ms(sol_find(sol, timer->op_names[i])) : -1.0;
        fprintf(out, "  %-36s %10.1f %10.3f %7.1f%%", timer->op_names[i], (double)timer->op_calls[i] / timer->steps, ms,
                total_ms > 0 ? 100.0 * timer->op_ms[i] / total_ms : 0.0);
        if (sol_step_ms > 0) {
            fprintf(out, " %11.3f %7.1f\n", sol_step_ms, ms / sol_step_ms);
            total_sol_ms += sol_step_ms;
        } else {
            fprintf(out, " %11s %7s\n", "-", "-");
        }
    }
    fprintf(out, "  %-36s %10s %10.3f %8s %11.3f\n", "total", "", total_ms / timer->steps, "", total_sol_ms);
}
