// The shape of a Llama model: what the config's model keys describe.
// Plain C, shared by the GPU trainer, the CPU reference and the tools.
// MODEL_SHAPE_KEYS is the one list of these keys, in this order: ModelShape's fields, the config's
// rows (coat/config.h), the checkpoint header's fields 1 to 13 and the check that a checkpoint
// fits the config (coat/checkpoint_file.h) come from it.
//   X(name, type, load, default, min, max, help): type int or float; load, what a checkpoint's
//   value must be to load under the config's: same, any (a checkpoint may continue at another
//   sequence length) or same_when_scaled (the same while rope_scaling_factor > 0, unused
//   otherwise); default, range and help as the config table takes them (H = dim, I = ffn_dim).
#pragma once
#include <limits.h>

#define MODEL_SHAPE_KEYS(X) \
    X(vocab_size, int, same, "32000", 2, INT_MAX, "tokens in the vocabulary") \
    X(dim, int, same, "768", 8, 65536, "hidden size") \
    X(n_layers, int, same, "12", 1, 1024, "transformer blocks") \
    X(n_heads, int, same, "12", 1, 1024, "query heads (head_dim = dim / n_heads)") \
    X(n_kv_heads, int, same, "4", 1, 1024, "key/value heads; divides n_heads") \
    X(ffn_dim, int, same, "2048", 8, 1 << 20, "SwiGLU inner size") \
    X(max_seq_len, int, any, "1024", 1, 1 << 20, "longest sequence the model is built for") \
    X(rope_theta, float, same, "10000", 1, 1e9, "RoPE base frequency") \
    X(norm_eps, float, same, "1e-5", 0, 1, "RMSNorm epsilon") \
    X(rope_scaling_factor, float, same, "0", 0, 1e6, "Llama 3.1 RoPE frequency scaling factor (0: off)") \
    X(rope_low_freq_factor, float, same_when_scaled, "1", 0, 1e6, "Llama 3.1 RoPE low_freq_factor") \
    X(rope_high_freq_factor, float, same_when_scaled, "4", 0, 1e6, "Llama 3.1 RoPE high_freq_factor") \
    X(rope_original_max_seq_len, int, same_when_scaled, "8192", 1, 1 << 24, "Llama 3.1 RoPE original context length")

#define MODEL_SHAPE_FIELD(name, type, load, default_value, min, max, help) type name;
typedef struct {
    MODEL_SHAPE_KEYS(MODEL_SHAPE_FIELD)
} ModelShape;
#undef MODEL_SHAPE_FIELD

static inline int model_head_dim(const ModelShape *shape) { return shape->dim / shape->n_heads; }
