// Learning rate at each step: linear warmup from lr/warmup_steps to lr, then one of
//   cosine:   min + (lr - min) (1 + cos(pi p)) / 2
//   linear:   lr - (lr - min) p
//   wsd:      lr until the last wsd_decay_fraction of the steps, then linear down to min
//   constant: lr
// with p the progress in [0, 1] after warmup and min = lr * min_lr_ratio. Steps count from 0.
#pragma once
#include <math.h>
#include "config.h"

static inline float learning_rate_at(const TrainConfig *c, int step) {
    double lr = c->learning_rate, min_lr = c->learning_rate * (double)c->min_lr_ratio;
    if (step < c->warmup_steps) return (float)(lr * (step + 1) / c->warmup_steps);
    int decay_steps = c->max_steps - c->warmup_steps;
    double p = decay_steps > 1 ? (double)(step - c->warmup_steps) / (decay_steps - 1) : 1.0;
    if (p > 1.0) p = 1.0;
    switch ((Schedule)c->lr_schedule) {
    case SCHEDULE_COSINE: return (float)(min_lr + (lr - min_lr) * 0.5 * (1.0 + cos(M_PI * p)));
    case SCHEDULE_LINEAR: return (float)(lr - (lr - min_lr) * p);
    case SCHEDULE_WSD: {
        double start = 1.0 - c->wsd_decay_fraction;
        if (p <= start || c->wsd_decay_fraction <= 0) return (float)lr;
        return (float)(lr - (lr - min_lr) * (p - start) / c->wsd_decay_fraction);
    }
    case SCHEDULE_CONSTANT: return (float)lr;
    }
    return (float)lr;
}
