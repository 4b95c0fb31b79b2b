// The parameter table of a Llama model: every tensor's name, shape and offset in the one
// parameter buffer. Layout is layer-major (embedding, then each layer's nine tensors,
// then the final norm and lm_head), each tensor padded to a multiple of 128 elements so
// that FP8 quantization groups and ZeRO shards never straddle two tensors.
// Weight matrices are stored [out_features, in_features], row-major (y = x W^T), as in HF.
#pragma once
#include <stddef.h>
#include "model_shape.h"
#include "random.h"

#define PARAM_ALIGN_ELEMS 128
#define PARAM_SEGMENTS_MAX 1026  // n_layers + 2 at the largest n_layers (coat/model_shape.h)
#define PARAM_NOT_IN_BUFFER ((size_t)-1)  // a segment or range with no place in the BF16 parameter buffer

typedef enum {
    PARAM_EMBEDDING,   // [vocab, dim]
    PARAM_ATTN_NORM,   // [dim]
    PARAM_WQ,          // [n_heads * head_dim, dim]
    PARAM_WK,          // [n_kv_heads * head_dim, dim]
    PARAM_WV,          // [n_kv_heads * head_dim, dim]
    PARAM_WO,          // [dim, n_heads * head_dim]
    PARAM_MLP_NORM,    // [dim]
    PARAM_W_GATE,      // [ffn, dim]
    PARAM_W_UP,        // [ffn, dim]
    PARAM_W_DOWN,      // [dim, ffn]
    PARAM_FINAL_NORM,  // [dim]
    PARAM_LM_HEAD,     // [vocab, dim]
    PARAM_KINDS
} ParamKind;

static inline int param_kind_is_per_layer(ParamKind kind) {
    return kind != PARAM_EMBEDDING && kind != PARAM_FINAL_NORM && kind != PARAM_LM_HEAD;
}

// Hugging Face names: "model.layers.%d." is prefixed for per-layer tensors.
static inline const char *param_kind_name(ParamKind kind) {
    static const char *names[PARAM_KINDS] = {
        "model.embed_tokens.weight", "input_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
        "mlp.down_proj.weight", "model.norm.weight", "lm_head.weight"};
    return names[kind];
}

typedef struct {
    ModelShape shape;
    size_t rows[PARAM_KINDS], cols[PARAM_KINDS];  // cols = 1 for vectors
    size_t padded[PARAM_KINDS];                   // elements reserved per tensor
    size_t first_layer_offset;                    // where layer 0 starts
    size_t layer_stride;                          // padded elements per layer
    size_t within_layer[PARAM_KINDS];             // offset inside a layer (per-layer kinds)
    size_t tail_offset[PARAM_KINDS];              // offset of the final norm and lm_head
    size_t total_padded;                          // elements of the parameter order
    size_t total_params;                          // real parameters (no padding)
    // The device buffers: segment s (param_segment) starts at segment_at[s], which data
    // parallelism moves apart to pad its buckets (coat/zero.h); else the parameter order.
    size_t segment_at[PARAM_SEGMENTS_MAX];
    size_t buffer_elems;
} ParamLayout;

// 1/ranks of a range of the parameter order, as data parallelism shards a bucket (coat/zero.h):
// rank r owns [begin + r part, begin + (r + 1) part) clipped to end, part a multiple of 128; the
// range occupies ranks x part elements from `at` in the device buffers, and each rank's part sits
// at state_at in its optimizer state.
typedef struct {
    size_t begin, end, at, part, state_at;
} ParamShardRange;

// Rank `rank`'s part of `range` in the parameter order: [*begin, *end), empty (equal) where the
// range's padding begins before it.
static inline void param_shard_part(const ParamShardRange *range, int rank, size_t *begin, size_t *end) {
    size_t b = range->begin + (size_t)rank * range->part, e = b + range->part;
    *begin = b < range->end ? b : range->end;
    *end = e < range->end ? e : range->end;
}

static inline size_t round_up_size(size_t n, size_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Segments: the parts of the parameter order in which backward finishes the gradient, numbered in
// that order: 0 the tail (final norm, lm_head), 1 .. L the layers from the last (segment L - l is
// layer l), L + 1 the embedding. Where segment s begins in the parameter order:
static inline size_t param_segment_begin(const ParamLayout *layout, int s) {
    int layers = layout->shape.n_layers;
    if (s == 0) return layout->tail_offset[PARAM_FINAL_NORM];
    if (s <= layers) return layout->first_layer_offset + (size_t)(layers - s) * layout->layer_stride;
    return 0;
}
static inline size_t param_segment_end(const ParamLayout *layout, int s) {
    int layers = layout->shape.n_layers;
    if (s == 0) return layout->total_padded;
    if (s <= layers) return param_segment_begin(layout, s) + layout->layer_stride;
    return layout->first_layer_offset;
}

static inline void param_layout_init(ParamLayout *layout, const ModelShape *shape) {
    size_t hd = (size_t)model_head_dim(shape), H = (size_t)shape->dim, I = (size_t)shape->ffn_dim;
    size_t V = (size_t)shape->vocab_size;
    size_t rows[PARAM_KINDS] = {V, H, shape->n_heads * hd, shape->n_kv_heads * hd, shape->n_kv_heads * hd,
                                H, H, I, I, H, H, V};
    size_t cols[PARAM_KINDS] = {H, 1, H, H, H, shape->n_heads * hd, 1, H, H, I, 1, H};
    layout->shape = *shape;
    layout->total_params = 0;
    for (int k = 0; k < PARAM_KINDS; k++) {
        layout->rows[k] = rows[k];
        layout->cols[k] = cols[k];
        layout->padded[k] = round_up_size(rows[k] * cols[k], PARAM_ALIGN_ELEMS);
        size_t copies = param_kind_is_per_layer((ParamKind)k) ? (size_t)shape->n_layers : 1;
        layout->total_params += copies * rows[k] * cols[k];
    }
    layout->first_layer_offset = layout->padded[PARAM_EMBEDDING];
    layout->layer_stride = 0;
    for (int k = PARAM_ATTN_NORM; k <= PARAM_W_DOWN; k++) {
        layout->within_layer[k] = layout->layer_stride;
        layout->layer_stride += layout->padded[k];
    }
    size_t tail = layout->first_layer_offset + (size_t)shape->n_layers * layout->layer_stride;
    layout->tail_offset[PARAM_FINAL_NORM] = tail;
    layout->tail_offset[PARAM_LM_HEAD] = tail + layout->padded[PARAM_FINAL_NORM];
    layout->total_padded = layout->tail_offset[PARAM_LM_HEAD] + layout->padded[PARAM_LM_HEAD];
    for (int s = 0; s < shape->n_layers + 2; s++) layout->segment_at[s] = param_segment_begin(layout, s);
    layout->buffer_elems = layout->total_padded;
}

// Element offset of tensor `kind` of layer `layer` (layer ignored for the others).
static inline size_t param_offset(const ParamLayout *layout, ParamKind kind, int layer) {
    if (kind == PARAM_EMBEDDING) return 0;
    if (!param_kind_is_per_layer(kind)) return layout->tail_offset[kind];
    return layout->first_layer_offset + (size_t)layer * layout->layer_stride + layout->within_layer[kind];
}

// The segment that holds tensor `kind` of `layer`.
static inline int param_segment_of(const ParamLayout *layout, ParamKind kind, int layer) {
    if (kind == PARAM_EMBEDDING) return layout->shape.n_layers + 1;
    if (!param_kind_is_per_layer(kind)) return 0;
    return layout->shape.n_layers - layer;
}

// Where element `offset` of the parameter order, in segment s, sits in the device buffers.
static inline size_t param_buffer_at(const ParamLayout *layout, int s, size_t offset) {
    return layout->segment_at[s] + (offset - param_segment_begin(layout, s));
}

// `buffers` without the layers, for a BF16 parameter buffer that holds no layer (FP8 GEMMs cast
// the block's linear weights from the FP32 master weights, coat/zero.cuh, and the layers' norms
// sit in the norm table below): the embedding's room where it was (up to the first layer), the
// tail's room right after it, the layers nowhere.
static inline void param_layout_without_layers(ParamLayout *params, const ParamLayout *buffers) {
    int L = buffers->shape.n_layers;
    size_t embedding_elems = buffers->segment_at[L], tail_elems = buffers->buffer_elems - buffers->segment_at[0];
    *params = *buffers;
    params->segment_at[0] = embedding_elems;
    for (int s = 1; s <= L; s++) params->segment_at[s] = PARAM_NOT_IN_BUFFER;
    params->buffer_elems = embedding_elems + tail_elems;
}

// The norm table: every layer's two norms (attention, then MLP, each padded), layer by layer. The
// layers' norms live there when the parameter buffer holds no layer, and ZeRO's E4M3 gather
// all-reduces it (coat/zero.h).
static inline size_t param_norm_table_elems(const ParamLayout *layout) {
    return (size_t)layout->shape.n_layers * (layout->padded[PARAM_ATTN_NORM] + layout->padded[PARAM_MLP_NORM]);
}
static inline size_t param_norm_table_offset(const ParamLayout *layout, ParamKind norm, int layer) {
    size_t at = (size_t)layer * (layout->padded[PARAM_ATTN_NORM] + layout->padded[PARAM_MLP_NORM]);
    return norm == PARAM_MLP_NORM ? at + layout->padded[PARAM_ATTN_NORM] : at;
}
static inline int param_kind_is_layer_norm(ParamKind kind) { return kind == PARAM_ATTN_NORM || kind == PARAM_MLP_NORM; }

// Where tensor `kind` of `layer` starts in the device buffers.
static inline size_t param_buffer_offset(const ParamLayout *layout, ParamKind kind, int layer) {
    return param_buffer_at(layout, param_segment_of(layout, kind, layer), param_offset(layout, kind, layer));
}

static inline size_t param_numel(const ParamLayout *layout, ParamKind kind) {
    return layout->rows[kind] * layout->cols[kind];
}

// Parameters that are not embeddings (the MFU convention counts these).
static inline size_t param_count_non_embedding(const ParamLayout *layout) {
    return layout->total_params - param_numel(layout, PARAM_EMBEDDING);
}

static inline int param_kind_is_matrix(ParamKind kind) { return kind != PARAM_ATTN_NORM && kind != PARAM_MLP_NORM && kind != PARAM_FINAL_NORM; }

// Initialisation from scratch, in FP32: norms = 1, matrices std * random_normal_at(seed, e) for
// element e of the padded buffer, std = 0.02, output projections (wo, w_down) scaled by
// 1/sqrt(2 * n_layers); padding = 0. Each element depends only on the seed and its offset, so
// the GPU (adamw_init_master) computes the same bits in parallel; this is the host's copy.
static inline float param_init_std(const ParamLayout *layout, ParamKind kind) {
    double std = 0.02;
    if (kind == PARAM_WO || kind == PARAM_W_DOWN) std /= sqrt(2.0 * layout->shape.n_layers);
    return (float)std;
}

static inline void param_init_tensor(const ParamLayout *layout, float *params, ParamKind kind, int layer,
                                     unsigned long long seed) {
    size_t offset = param_offset(layout, kind, layer), n = param_numel(layout, kind);
    float *t = params + offset;
    if (!param_kind_is_matrix(kind)) {
        for (size_t i = 0; i < n; i++) t[i] = 1.0f;
        return;
    }
    float std = param_init_std(layout, kind);
    for (size_t i = 0; i < n; i++) t[i] = std * random_normal_at(seed, offset + i);
}

// Calls visit(context, kind, layer) for every tensor, in buffer order (layer 0 for the others).
static inline void param_for_each_tensor(const ParamLayout *layout, void (*visit)(void *, ParamKind, int), void *context) {
    visit(context, PARAM_EMBEDDING, 0);
    for (int l = 0; l < layout->shape.n_layers; l++)
        for (int k = PARAM_ATTN_NORM; k <= PARAM_W_DOWN; k++) visit(context, (ParamKind)k, l);
    visit(context, PARAM_FINAL_NORM, 0);
    visit(context, PARAM_LM_HEAD, 0);
}

typedef struct {
    const ParamLayout *layout;
    float *params;
    unsigned long long seed;
} ParamInit;

static inline void param_init_visit(void *context, ParamKind kind, int layer) {
    const ParamInit *init = (const ParamInit *)context;
    param_init_tensor(init->layout, init->params, kind, layer, init->seed);
}

static inline void param_init_weights(const ParamLayout *layout, float *params, unsigned long long seed) {
    for (size_t i = 0; i < layout->total_padded; i++) params[i] = 0.0f;
    ParamInit init = {layout, params, seed};
    param_for_each_tensor(layout, param_init_visit, &init);
}
