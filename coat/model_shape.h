// The shape of a Llama model: what the config's model keys describe.
// Plain C, shared by the GPU trainer, the CPU reference and the tools.
#pragma once

typedef struct {
    int vocab_size;
    int dim;          // hidden size H
    int n_layers;
    int n_heads;      // query heads; head_dim = dim / n_heads
    int n_kv_heads;   // key/value heads (grouped-query attention), divides n_heads
    int ffn_dim;      // SwiGLU inner size I
    int max_seq_len;
    float rope_theta;
    float norm_eps;   // RMSNorm epsilon
    // Llama 3.1 frequency scaling; rope_scaling_factor = 0 turns it off.
    float rope_scaling_factor;
    float rope_low_freq_factor;
    float rope_high_freq_factor;
    int rope_original_max_seq_len;
} ModelShape;

static inline int model_head_dim(const ModelShape *shape) { return shape->dim / shape->n_heads; }
