// The table of activations that one Llama block saves for its backward pass: name, size per
// token and storage for each precision mode (coat/README.md, Saved activations). Storing a tensor in
// FP8 is a change to this table and to the kernel that produces it. Plain C: the memory plan
// (dry_run) and the GPU model both size their buffers from it.
// Storage: BF16; FP32; E4M3 with one scale per tensor (linear-layer inputs, stored as the
// transpose [features, tokens] that the FP8 weight-gradient GEMM reads; the scale sits in the
// model's table of FP8 scales); E4M3 with one BF16 scale per 1x16 group (inputs of non-linear
// ops: the codes [tokens, features], then the scales [tokens, features / 16]).
#pragma once
#include <stddef.h>
#include "model_shape.h"
#include "precision.h"

typedef enum { STORE_BF16, STORE_FP32, STORE_E4M3_TENSOR, STORE_E4M3_GROUP16 } ActivationStorage;

typedef enum {
    ACT_RESIDUAL_IN,   // block input, the attention RMSNorm's input          [H]
    ACT_ATTN_RSTD,     // 1/rms per token                                      [1]
    ACT_ATTN_NORM_OUT, // input of the QKV GEMM                                [H]
    ACT_QKV,           // q, k (after RoPE) and v, packed                      [(NH + 2 NKV) hd]
    ACT_ATTN_OUT,      // attention output O, input of the out-projection     [NH hd]
    ACT_ATTN_LSE,      // softmax logsumexp per head                           [NH]
    ACT_RESIDUAL_MID,  // residual after attention, the MLP RMSNorm's input    [H]
    ACT_MLP_RSTD,      //                                                      [1]
    ACT_MLP_NORM_OUT,  // input of the gate/up GEMM                            [H]
    ACT_GATE_UP,       // gate and up outputs, packed per row                  [2 I]
    ACT_SWIGLU_OUT,    // silu(gate) * up, input of the down GEMM              [I]
    ACT_LAYER_KINDS
} LayerActivation;

// COAT keeps two kinds of non-linear inputs as 1x16-group copies: the residual stream (the
// RMSNorms' inputs) and gate|up (SwiGLU's); coat_residual and coat_gate_up keep one kind each.
static inline int activations_group_residual(ActivationsChoice mode) { return mode == ACTS_COAT || mode == ACTS_COAT_RESIDUAL; }
static inline int activations_group_gate_up(ActivationsChoice mode) { return mode == ACTS_COAT || mode == ACTS_COAT_GATE_UP; }

typedef struct {
    const char *name;
    size_t per_token;          // elements per token
    ActivationStorage storage;
} ActivationInfo;

static inline void activation_table(ActivationInfo table[ACT_LAYER_KINDS], const ModelShape *m, ActivationsChoice mode) {
    size_t H = (size_t)m->dim, I = (size_t)m->ffn_dim, hd = (size_t)model_head_dim(m);
    size_t NH = (size_t)m->n_heads, NKV = (size_t)m->n_kv_heads;
    // Linear-layer inputs go FP8 per tensor in fp8 and coat; non-linear inputs 1x16 in coat (one
    // kind of them in coat_residual and coat_gate_up).
    // The attention output stays BF16 (its backward reads it); its FP8 transpose is remade there.
    ActivationStorage linear = mode == ACTS_BF16 ? STORE_BF16 : STORE_E4M3_TENSOR;
    ActivationStorage residual = activations_group_residual(mode) ? STORE_E4M3_GROUP16 : STORE_BF16;
    ActivationStorage gate_up = activations_group_gate_up(mode) ? STORE_E4M3_GROUP16 : STORE_BF16;
    const ActivationInfo rows[ACT_LAYER_KINDS] = {
        {"residual_in", H, residual},
        {"attn_rstd", 1, STORE_FP32},
        {"attn_norm_out", H, linear},
        {"qkv", (NH + 2 * NKV) * hd, STORE_BF16},
        {"attn_out", NH * hd, STORE_BF16},
        {"attn_lse", NH, STORE_FP32},
        {"residual_mid", H, residual},
        {"mlp_rstd", 1, STORE_FP32},
        {"mlp_norm_out", H, linear},
        {"gate_up", 2 * I, gate_up},
        {"swiglu_out", I, linear},
    };
    for (int i = 0; i < ACT_LAYER_KINDS; i++) table[i] = rows[i];
}

// Every saved tensor starts on a 256-byte boundary (vector loads, cuBLASLt alignment).
static inline size_t align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Bytes to store `elems` values (one tensor) including its scales.
static inline size_t activation_bytes(ActivationStorage storage, size_t elems) {
    switch (storage) {
    case STORE_BF16: return 2 * elems;
    case STORE_FP32: return 4 * elems;
    case STORE_E4M3_TENSOR: return elems;
    case STORE_E4M3_GROUP16: return elems + 2 * ((elems + 15) / 16);
    }
    return 0;
}

static inline const char *activation_storage_name(ActivationStorage storage) {
    static const char *names[] = {"bf16", "fp32", "e4m3/tensor", "e4m3/1x16"};
    return names[storage];
}

// Saved bytes of one layer for `tokens` tokens.
static inline size_t activation_layer_bytes(const ModelShape *m, ActivationsChoice mode, size_t tokens) {
    ActivationInfo table[ACT_LAYER_KINDS];
    activation_table(table, m, mode);
    size_t bytes = 0;
    for (int i = 0; i < ACT_LAYER_KINDS; i++) bytes += align256(activation_bytes(table[i].storage, table[i].per_token * tokens));
    return bytes;
}
