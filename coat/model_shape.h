// The shape of a Llama model: what the config's model keys describe.
// Plain C, shared by the GPU trainer, the CPU reference and the tools.
// MODEL_SHAPE_KEYS is the one list of these keys, in this order: ModelShape's fields, the config's
// rows (coat/config.h) and the checkpoint header's fields 1 to 13 (coat/checkpoint.h) come from it.
//   X(name, type, default, min, max, help): type int or float; default, range and help as the
//   config table takes them (H = dim, I = ffn_dim).
#pragma once
#include <limits.h>

#define MODEL_SHAPE_KEYS(X) \
    X(vocab_size, int, "32000", 2, INT_MAX, "tokens in the vocabulary") \
    X(dim, int, "768", 8, 65536, "hidden size") \
    X(n_layers, int, "12", 1, 1024, "transformer blocks") \
    X(n_heads, int, "12", 1, 1024, "query heads (head_dim = dim / n_heads)") \
    X(n_kv_heads, int, "4", 1, 1024, "key/value heads; divides n_heads") \
    X(ffn_dim, int, "2048", 8, 1 << 20, "SwiGLU inner size") \
    X(max_seq_len, int, "1024", 1, 1 << 20, "longest sequence the model is built for") \
    X(rope_theta, float, "10000", 1, 1e9, "RoPE base frequency") \
    X(norm_eps, float, "1e-5", 0, 1, "RMSNorm epsilon") \
    X(rope_scaling_factor, float, "0", 0, 1e6, "Llama 3.1 RoPE frequency scaling factor (0: off)") \
    X(rope_low_freq_factor, float, "1", 0, 1e6, "Llama 3.1 RoPE low_freq_factor") \
    X(rope_high_freq_factor, float, "4", 0, 1e6, "Llama 3.1 RoPE high_freq_factor") \
    X(rope_original_max_seq_len, int, "8192", 1, 1 << 24, "Llama 3.1 RoPE original context length")

#define MODEL_SHAPE_FIELD(name, type, default_value, min, max, help) type name;
typedef struct {
    MODEL_SHAPE_KEYS(MODEL_SHAPE_FIELD)
} ModelShape;
#undef MODEL_SHAPE_FIELD

static inline int model_head_dim(const ModelShape *shape) { return shape->dim / shape->n_heads; }
