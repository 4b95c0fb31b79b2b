// The kinds of AdamW moment storage and what each costs (coat/optimizer.cuh keeps the states;
// the memory plan counts them): m and v as FP32, BF16, E4M3 per 128-group with one FP32 scale, or
// E4M3 with Dynamic Range Expansion (scale, k, c per group); and the state's layout in bytes:
// master FP32 [n] | m [n] | v [n] | m group scalars | v group scalars, then one decay byte per
// group. Host C (C11 and C++17).
#pragma once
#include <stddef.h>
#include "params.h"
#include "precision.h"

#define ADAMW_GROUP PARAM_ALIGN_ELEMS  // quantization group

typedef enum {
    OPT_STATES_FP32,     // 8 bytes per parameter
    OPT_STATES_BF16,     // 4
    OPT_STATES_FP8,      // 2 + 8/128
    OPT_STATES_FP8_DRE,  // 2 + 24/128
} OptimizerStateKind;

static inline OptimizerStateKind adamw_kind_from_config(StatesChoice states) {
    switch (states) {
    case STATES_BF16: return OPT_STATES_BF16;
    case STATES_FP8: return OPT_STATES_FP8;
    case STATES_FP8_DRE: return OPT_STATES_FP8_DRE;
    case STATES_FP32: case STATES_AUTO: break;
    }
    return OPT_STATES_FP32;
}

static inline const char *optimizer_state_kind_name(OptimizerStateKind kind) {
    switch (kind) {
    case OPT_STATES_FP32: return "fp32";
    case OPT_STATES_BF16: return "bf16";
    case OPT_STATES_FP8: return "fp8";
    case OPT_STATES_FP8_DRE: return "fp8_dre";
    }
    return "unknown";
}

static inline size_t adamw_moment_elem_bytes(OptimizerStateKind kind) {
    switch (kind) {
    case OPT_STATES_FP32: return 4;
    case OPT_STATES_BF16: return 2;
    case OPT_STATES_FP8: case OPT_STATES_FP8_DRE: return 1;
    }
    return 0;
}

// FP32 scalars each 128-group keeps per moment.
static inline size_t adamw_group_scalars(OptimizerStateKind kind) {
    switch (kind) {
    case OPT_STATES_FP32: case OPT_STATES_BF16: return 0;
    case OPT_STATES_FP8: return 1;
    case OPT_STATES_FP8_DRE: return 3;
    }
    return 0;
}

// Bytes of the saved state (master, m, v, group scalars) for a shard of n elements.
static inline size_t adamw_payload_bytes(OptimizerStateKind kind, size_t n) {
    size_t groups = n / ADAMW_GROUP;
    return 4 * n + 2 * (adamw_moment_elem_bytes(kind) * n + 4 * adamw_group_scalars(kind) * groups);
}

#define ADAMW_SECTIONS 5  // master, m, v, m's group scalars, v's: the order of the state and of a checkpoint

// Bytes per 128-group of section `section` of the state.
static inline size_t adamw_section_group_bytes(OptimizerStateKind kind, int section) {
    if (section == 0) return 4 * ADAMW_GROUP;
    if (section <= 2) return adamw_moment_elem_bytes(kind) * ADAMW_GROUP;
    return 4 * adamw_group_scalars(kind);
}

// Device memory the optimizer allocates for a shard of n elements: the state and the decay table.
static inline size_t adamw_state_bytes(OptimizerStateKind kind, size_t n) {
    return adamw_payload_bytes(kind, n) + n / ADAMW_GROUP;
}
