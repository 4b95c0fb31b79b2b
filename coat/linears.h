// The four linear layers of a Llama block, y[N, out] = x[N, in] W^T: which weights each one
// multiplies by, its shape and its FP8 scale slots. One table, read by the model
// (coat/model.cuh), the memory plan (coat/memory_plan.h), the sharding (coat/zero.h) and the
// tests. The fused layers' weights (wq|wk|wv, w_gate|w_up) lie back to back in the parameter
// buffer (coat/params.h), so each of them is one GEMM. Plain C.
#pragma once
#include <stddef.h>
#include "model_shape.h"
#include "params.h"

typedef enum { LINEAR_QKV, LINEAR_OUT, LINEAR_GATE_UP, LINEAR_DOWN, LINEARS } Linear;

typedef struct {
    const char *name;
    ParamKind first_weight, last_weight;  // its weights: first_weight to last_weight, back to back
} LinearInfo;

static inline LinearInfo linear_info(Linear which) {
    static const LinearInfo table[LINEARS] = {
        {"qkv", PARAM_WQ, PARAM_WV},
        {"attn_out", PARAM_WO, PARAM_WO},
        {"gate_up", PARAM_W_GATE, PARAM_W_UP},
        {"down", PARAM_W_DOWN, PARAM_W_DOWN},
    };
    return table[which];
}

// The parameter whose first element is the layer's W[0][0].
static inline ParamKind linear_weight_kind(Linear which) { return linear_info(which).first_weight; }

// The GEMMs' shapes: in[i] and out[i] features of linear layer i.
static inline void linear_shapes(const ModelShape *m, size_t in[LINEARS], size_t out[LINEARS]) {
    size_t H = (size_t)m->dim, I = (size_t)m->ffn_dim, hd = (size_t)model_head_dim(m);
    size_t qkv = ((size_t)m->n_heads + 2 * (size_t)m->n_kv_heads) * hd, attn = (size_t)m->n_heads * hd;
    size_t ins[LINEARS] = {H, attn, H, I}, outs[LINEARS] = {qkv, H, 2 * I, H};
    for (int i = 0; i < LINEARS; i++) { in[i] = ins[i]; out[i] = outs[i]; }
}

// A layer's linear weights, every linear layer's in x out elements (its E4M3 codes take a byte each).
static inline size_t linear_layer_weight_elems(const ModelShape *m) {
    size_t in[LINEARS], out[LINEARS], elems = 0;
    linear_shapes(m, in, out);
    for (int i = 0; i < LINEARS; i++) elems += in[i] * out[i];
    return elems;
}

// Per layer, the FP8 scale table holds the input, the output gradient and the weight of each
// linear layer, in that order.
typedef enum { FP8_SLOT_INPUT = 0, FP8_SLOT_GRAD = LINEARS, FP8_SLOT_WEIGHT = 2 * LINEARS } Fp8SlotGroup;
#define FP8_SCALES_PER_LAYER (3 * LINEARS)
