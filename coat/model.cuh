// The Llama model on the GPU: parameter, gradient, activation and working buffers (one
// allocation each, laid out by coat/params.h, coat/activations.h and coat/memory_plan.h) and
// the forward and backward passes of one micro-batch, in BF16 or with FP8 GEMMs and FP8
// activation storage (coat/README.md).
//   x = embed(tokens); per layer: x += Wo attn(rope(Wqkv rmsnorm(x)));
//                                 x += Wdown (silu(Wgate h) * Wup h), h = rmsnorm(x)
//   loss = mean cross-entropy(Wlm rmsnorm(x), targets)
// Activations are [N = B*T, features] row-major; qkv rows hold the q heads, then k, then v.
// The wq/wk/wv and w_gate/w_up weights sit back to back in the parameter buffer, so each pair
// of projections is one GEMM: a block has four linear layers (Linear, coat/linears.h), each run
// by linear_forward / linear_backward in the model's GEMM precision. With FP8 GEMMs every input
// is cast to E4M3 per tensor just in time (its producer gathers the amax), output gradients to
// E5M2 with their transposes, and the weights to E4M3 with their transposes once per optimizer
// step (from the FP32 master weights by coat/zero.cuh when the model keeps no BF16 copy of them,
// weights_from_master); the embedding, the norms' math, attention, the lm_head and the loss stay
// BF16/FP32.
#pragma once
#include "activations.h"
#include "attention.cuh"
#include "classifier.cuh"
#include "common.cuh"
#include "config.h"
#include "embedding.cuh"
#include "fp8.cuh"
#include "linears.h"
#include "matmul.cuh"
#include "memory_plan.h"
#include "op_timer.cuh"
#include "params.h"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "swiglu.cuh"

// The precision choices the model is built for (config.h resolves them from the config).
typedef struct {
    int fp8_gemms;              // FP8 GEMMs for the block's linear layers
    ActivationsChoice activations;
    int fast_accumulation;      // Hopper's FP8 fast accumulation
    int weights_from_master;    // FP8 GEMMs: no BF16 copy of the block's linear weights (their codes are cast
                                // from the master weights, coat/zero.cuh); the layers' norms in the norm table
} ModelPrecision;

static inline ModelPrecision model_precision_bf16(void) {
    ModelPrecision p = {0, ACTS_BF16, 0, 0};
    return p;
}

static inline ModelPrecision model_precision_from_config(const TrainConfig *c) {
    ModelPrecision p = {config_fp8_gemms(c), config_activations(c), c->fp8_fast_accum, config_weights_from_master(c)};
    return p;
}

// One saved activation as the kernels read it: BF16 or FP32 data, the FP8 transpose of a
// linear layer's input (its scale is the layer's input entry of the FP8 scale table), or 1x16
// E4M3 groups (codes and scales).
typedef struct {
    ActivationStorage storage;
    void *data;
    Fp8Groups groups;  // STORE_E4M3_GROUP16 only
} SavedTensor;

// Data parallelism's hooks (coat/zero.cuh), on the segments of coat/params.h. Backward (the
// segments in the order it completes them): `begin` runs before a segment's first gradient, `end`
// after its last, so that a bucket's reduce overlaps the rest of backward. `gradient` (NULL: the
// gradients stay in place in grads) says where a tensor's gradient goes, given its segment and
// its offset in the device buffers (ZeRO stages 2 and 3's bucket buffers). Forward: `ready` (NULL:
// none) runs before the first read of a segment's parameters, so that their gather after the
// previous step overlaps the forward; `ready_backward` (NULL: none) before backward's first read
// of a layer's parameters (ZeRO stage 3 gathers them again). Where a layer's weights are (NULL:
// in the model's buffers; ZeRO stage 3: where its bucket was gathered, once `ready` or
// `ready_backward` ran for it): `layer_param` a per-layer tensor's BF16 weights, `fp8_weight` a
// linear layer's E4M3 W or its transpose.
typedef struct {
    void (*begin)(void *context, int segment);
    void (*end)(void *context, int segment);
    bf16 *(*gradient)(void *context, int segment, size_t buffer_offset);
    void (*ready)(void *context, int segment);
    void (*ready_backward)(void *context, int segment);
    bf16 *(*layer_param)(void *context, ParamKind kind, int layer);
    uint8_t *(*fp8_weight)(void *context, int layer, Linear which, int transposed);
    void *context;
} BucketHooks;

typedef struct {
    ModelShape shape;
    ParamLayout layout;            // the gradients' buffer
    ParamLayout params_layout;     // the parameters' buffer: the same, or without the layers (weights_from_master,
                                   // or gathered a bucket at a time, ZeRO stage 3)
    ModelPrecision precision;
    int B, T;
    bf16 *params, *grads;          // params_elems (params_layout's buffer_elems) and grads_elems
    size_t params_elems, grads_elems;
    bf16 *norms;                   // weights_from_master: the layers' norms, the norm table (coat/params.h); else NULL
    size_t norms_elems;
    const BucketHooks *buckets;    // NULL: one rank (the whole gradient in grads)
    char *activations;             // saved for backward
    size_t activations_bytes;
    SavedTensor *saved;            // [n_layers][ACT_LAYER_KINDS] views into activations
    bf16 *final_residual, *final_norm_out;
    float *final_rstd, *losses;
    int *tokens, *targets;
    char *working;
    WorkingLayout working_layout;
    bf16 *attention_ds;            // the attention backward's dS buffer where it fit (NULL: not used)
    size_t attention_ds_bytes;
    uint8_t *fp8_weight_transposes;  // every layer's W^T but the last's where it fit (NULL: remade in backward)
    size_t fp8_weight_transposes_bytes;
    uint8_t *attention_out_t;      // every layer's E4M3 transpose of the attention output where it fit (NULL: remade in backward)
    size_t attention_out_t_bytes;
    bf16 *branch;                  // forward: a linear layer's output, then the next norm's output; backward: d(norm out)
    bf16 *d_residual;
    bf16 *wide;                    // backward: the block intermediates' gradients
    bf16 *logits;
    bf16 *residual;                // with 1x16 copies of the residual stream: the BF16 stream (NULL otherwise)
    uint8_t *fp8_input;            // E4M3 input of the current FP8 GEMM, or in backward a remade input transpose
    uint8_t *fp8_grad, *fp8_grad_t;  // E5M2 output gradient [N, out] and its transpose [out, N]
    bf16 *gate_up_working;         // COAT forward: gate_up before its 1x16 cast (in fp8_grad and fp8_grad_t, or wide)
    uint8_t *fp8_weights;          // E4M3 W [out, in] per layer and linear, then one layer's W^T (none: ZeRO stage 3)
    Fp8Scale *fp8_scales;          // [n_layers][FP8_SCALES_PER_LAYER]
    int fp8_weights_current;       // the FP8 weights are those of the present weights
    int grads_unwritten;           // grads hold no sum yet this step: each gradient's first writer of the next
                                   // forward + backward writes rather than adds (the padding stays zero)
    float *rope_cos, *rope_sin;
    float *mean_loss, *grad_norm_squared;  // device scalars
    void *kernel_scratch;
    OpTimer *timer;  // per-op GPU times when profiling; NULL otherwise
} LlamaModel;

// A tensor's BF16 weights; NULL for the block's linear weights when they are E4M3 only.
static inline bf16 *model_param(const LlamaModel *model, ParamKind kind, int layer) {
    if (model->norms && param_kind_is_layer_norm(kind)) return model->norms + param_norm_table_offset(&model->layout, kind, layer);
    if (model->norms && param_kind_is_per_layer(kind)) return NULL;
    if (param_kind_is_per_layer(kind) && model->buckets && model->buckets->layer_param)
        return model->buckets->layer_param(model->buckets->context, kind, layer);
    return model->params + param_buffer_offset(&model->params_layout, kind, layer);
}
static inline bf16 *model_grad(const LlamaModel *model, ParamKind kind, int layer) {
    size_t offset = param_buffer_offset(&model->layout, kind, layer);
    if (!model->buckets || !model->buckets->gradient) return model->grads + offset;
    return model->buckets->gradient(model->buckets->context, param_segment_of(&model->layout, kind, layer), offset);
}
static inline void model_segment_begin(const LlamaModel *model, int segment) {
    if (model->buckets) model->buckets->begin(model->buckets->context, segment);
}
static inline void model_segment_end(const LlamaModel *model, int segment) {
    if (model->buckets) model->buckets->end(model->buckets->context, segment);
}
static inline void model_params_ready(const LlamaModel *model, int segment) {
    if (model->buckets && model->buckets->ready) model->buckets->ready(model->buckets->context, segment);
}
static inline void model_params_ready_backward(const LlamaModel *model, int segment) {
    if (model->buckets && model->buckets->ready_backward) model->buckets->ready_backward(model->buckets->context, segment);
}
static inline const SavedTensor *model_saved_tensor(const LlamaModel *model, int layer, LayerActivation kind) {
    return &model->saved[layer * ACT_LAYER_KINDS + kind];
}
static inline bf16 *model_saved(const LlamaModel *model, int layer, LayerActivation kind) {
    return (bf16 *)model_saved_tensor(model, layer, kind)->data;
}
static inline float *model_saved_f32(const LlamaModel *model, int layer, LayerActivation kind) {
    return (float *)model_saved_tensor(model, layer, kind)->data;
}
// The 1x16 copy of a saved activation (codes NULL when it is stored otherwise).
static inline Fp8Groups model_saved_groups(const LlamaModel *model, int layer, LayerActivation kind) {
    return model_saved_tensor(model, layer, kind)->groups;
}
// The entry of the FP8 scale table, or NULL where nothing is cast to FP8: inputs are cast for
// FP8 GEMMs or for FP8 storage, gradients and weights for FP8 GEMMs only.
static inline Fp8Scale *model_fp8_scale(const LlamaModel *model, int layer, Fp8SlotGroup group, Linear which) {
    int used = model->precision.fp8_gemms || (group == FP8_SLOT_INPUT && model->precision.activations != ACTS_BF16);
    return used ? model->fp8_scales + (size_t)layer * FP8_SCALES_PER_LAYER + group + which : NULL;
}

// What the kernels ask of the scratch buffer for this shape; checked against the plan at start.
static inline size_t model_kernel_scratch_needed(const ModelShape *m, int B, int T) {
    int N = B * T;
    size_t need = embedding_backward_scratch_bytes(N, m->dim, m->vocab_size);
    size_t rms = rmsnorm_backward_scratch_bytes(N, m->dim);
    size_t attn = attention_backward_scratch_bytes(B, T, m->n_heads);
    if (rms > need) need = rms;
    if (attn > need) need = attn;
    return need;
}

// Why this shape cannot run in this precision, or NULL: FP8 GEMMs need K and N multiples of 16
// and transposes need the token count a multiple of 16; 1x16 groups need rows of whole groups.
// Every combination of GEMM precision and activation storage runs: with BF16 GEMMs an input
// saved in FP8 is turned back into BF16 for its weight gradient.
static inline const char *model_precision_unsupported(const ModelShape *shape, int B, int T, ModelPrecision p) {
    if (!p.fp8_gemms && p.activations == ACTS_BF16) return NULL;
    if (shape->dim % 16 != 0 || shape->ffn_dim % 16 != 0 || model_head_dim(shape) % 16 != 0)
        return "FP8 GEMMs and FP8 activations need dim, ffn_dim and head_dim multiples of 16";
    if (((size_t)B * T) % 16 != 0)
        return "FP8 transposes (weight gradients, saved inputs) need micro_batch_size x seq_len a multiple of 16";
    if (!p.fp8_gemms && shape->ffn_dim < shape->dim)
        return "BF16 GEMMs with FP8-saved inputs need ffn_dim >= dim (the BF16 copy for a weight gradient goes where d_swiglu was)";
    return NULL;
}

// Allocates every buffer for micro-batches of B sequences of T tokens, in `precision` (the
// caller refuses what model_precision_unsupported names), the parameters laid out by `buffers`
// (a layout of this shape whose segments data parallelism placed, coat/zero.h; NULL: the
// parameter order) and grads_elems BF16 gradients (0: as many as parameters); layers_gathered:
// no buffer holds the layers' working weights, which data parallelism gathers a bucket at a time
// (ZeRO stage 3) and the hooks find. Exactly the buffers of the memory plan, and the optional ones
// named in `optional`.
static inline void model_create_sized(LlamaModel *model, const ModelShape *shape, int B, int T, ModelPrecision precision,
                                      const ParamLayout *buffers, size_t grads_elems, int layers_gathered,
                                      OptionalBuffers optional = OptionalBuffers{0, 0, 0}) {
    memset(model, 0, sizeof(*model));
    model->shape = *shape;
    model->precision = precision;
    model->B = B;
    model->T = T;
    const char *unsupported = model_precision_unsupported(shape, B, T, precision);
    if (unsupported != NULL) fail_with("model_create", unsupported);
    if (precision.weights_from_master && !precision.fp8_gemms) fail_with("model_create", "weights_from_master needs FP8 GEMMs");
    if (buffers) model->layout = *buffers;
    else param_layout_init(&model->layout, shape);
    size_t N = (size_t)B * T, L = (size_t)shape->n_layers;
    model->params_layout = model->layout;
    if (precision.weights_from_master || layers_gathered) param_layout_without_layers(&model->params_layout, &model->layout);
    model->params_elems = model->params_layout.buffer_elems;
    model->grads_elems = grads_elems ? grads_elems : model->layout.buffer_elems;
    model->params = (bf16 *)gpu_alloc(2 * model->params_elems, "parameters");
    cudaCheck(cudaMemset(model->params, 0, 2 * model->params_elems));  // ZeRO's padding stays zero
    if (precision.weights_from_master) {
        model->norms_elems = param_norm_table_elems(&model->layout);
        model->norms = (bf16 *)gpu_alloc(2 * model->norms_elems, "the layers' norms");
        cudaCheck(cudaMemset(model->norms, 0, 2 * model->norms_elems));
    }
    model->grads = (bf16 *)gpu_alloc(2 * model->grads_elems, "gradients");
    cudaCheck(cudaMemset(model->grads, 0, 2 * model->grads_elems));

    ActivationInfo table[ACT_LAYER_KINDS];
    activation_table(table, shape, precision.activations);
    size_t per_layer = activation_layer_bytes(shape, precision.activations, N);
    model->activations_bytes = L * per_layer + final_activation_bytes(shape, N);
    model->activations = (char *)gpu_alloc(model->activations_bytes, "activations");
    model->saved = (SavedTensor *)calloc(L * ACT_LAYER_KINDS, sizeof(SavedTensor));
    if (model->saved == NULL) fail_with("model_create", "out of host memory (activation table)");
    char *at = model->activations;
    for (size_t l = 0; l < L; l++)
        for (int k = 0; k < ACT_LAYER_KINDS; k++) {
            SavedTensor *t = &model->saved[l * ACT_LAYER_KINDS + k];
            size_t elems = table[k].per_token * N;
            t->storage = table[k].storage;
            t->data = at;
            if (t->storage == STORE_E4M3_GROUP16) t->groups = Fp8Groups{(uint8_t *)at, (bf16 *)(at + elems)};
            at += align256(activation_bytes(table[k].storage, elems));
        }
    size_t H = (size_t)shape->dim;
    model->final_residual = (bf16 *)at;   at += align256(2 * N * H);
    model->final_norm_out = (bf16 *)at;   at += align256(2 * N * H);
    model->final_rstd = (float *)at;      at += align256(4 * N);
    model->losses = (float *)at;          at += align256(4 * N);
    model->tokens = (int *)at;            at += align256(4 * N);
    model->targets = (int *)at;

    WorkingLayout *w = &model->working_layout;
    working_layout_init(w, shape, B, T, precision.fp8_gemms, precision.activations, layers_gathered);
    size_t scratch_needed = model_kernel_scratch_needed(shape, B, T);
    if (scratch_needed > w->kernel_scratch_bytes) {
        char message[160];
        snprintf(message, sizeof(message), "kernels need %zu bytes of scratch, the memory plan reserves %zu", scratch_needed,
                 w->kernel_scratch_bytes);
        fail_with("model_create", message);
    }
    model->working = (char *)gpu_alloc(w->total_bytes, "working buffers");
    model->attention_ds_bytes =
        optional.attention_ds ? attention_backward_ds_bytes(B, T, shape->n_heads, model_head_dim(shape)) : 0;
    if (model->attention_ds_bytes) model->attention_ds = (bf16 *)gpu_alloc(model->attention_ds_bytes, "attention dS");
    model->attention_out_t_bytes = optional.attention_out_t ? attention_out_t_plan_bytes(shape, precision.fp8_gemms, N) : 0;
    if (model->attention_out_t_bytes)
        model->attention_out_t = (uint8_t *)gpu_alloc(model->attention_out_t_bytes, "attention output transposes");
    model->fp8_weight_transposes_bytes =
        optional.weight_transposes ? weight_transposes_plan_bytes(shape, precision.fp8_gemms, layers_gathered) : 0;
    if (model->fp8_weight_transposes_bytes)
        model->fp8_weight_transposes = (uint8_t *)gpu_alloc(model->fp8_weight_transposes_bytes, "weight transposes");
    model->branch = (bf16 *)(model->working + w->branch);
    model->d_residual = (bf16 *)(model->working + w->d_residual);
    model->wide = (bf16 *)(model->working + w->wide);
    model->rope_cos = (float *)(model->working + w->rope_cos);
    model->rope_sin = (float *)(model->working + w->rope_sin);
    model->logits = (bf16 *)(model->working + w->logits);
    model->kernel_scratch = model->working + w->kernel_scratch;
    model->residual = w->residual_bytes ? (bf16 *)(model->working + w->residual) : NULL;
    model->fp8_input = (uint8_t *)(model->working + w->fp8_input);
    model->fp8_grad = (uint8_t *)(model->working + w->fp8_grad);
    model->fp8_grad_t = (uint8_t *)(model->working + w->fp8_grad_t);
    model->fp8_weights = (uint8_t *)(model->working + w->fp8_weights);
    model->fp8_scales = (Fp8Scale *)(model->working + w->fp8_scales);
    int gate_up_grouped = activations_group_gate_up(precision.activations);
    if (gate_up_grouped && !precision.fp8_gemms) model->gate_up_working = model->wide;
    if (gate_up_grouped && precision.fp8_gemms) {
        model->gate_up_working = (bf16 *)model->fp8_grad;
        if (w->fp8_grad_t + w->fp8_grad_bytes - w->fp8_grad < sizeof(bf16) * N * 2 * (size_t)shape->ffn_dim)
            fail_with("model_create", "the output-gradient buffers cannot hold the forward's gate_up");
    }
    model->mean_loss = (float *)(model->working + w->small);
    model->grad_norm_squared = model->mean_loss + 1;
    if (w->fp8_scales_bytes) cudaCheck(cudaMemset(model->fp8_scales, 0, w->fp8_scales_bytes));

    size_t table_elems = (size_t)T * model_head_dim(shape) / 2;
    float *cos_host = (float *)malloc(table_elems * sizeof(float)), *sin_host = (float *)malloc(table_elems * sizeof(float));
    if (cos_host == NULL || sin_host == NULL) fail_with("model_create", "out of host memory (RoPE tables)");
    rope_table_init(cos_host, sin_host, T, shape);
    cudaCheck(cudaMemcpy(model->rope_cos, cos_host, table_elems * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model->rope_sin, sin_host, table_elems * sizeof(float), cudaMemcpyHostToDevice));
    free(cos_host);
    free(sin_host);
}

static inline void model_free(LlamaModel *model) {
    cudaCheck(cudaFree(model->params));
    if (model->norms) cudaCheck(cudaFree(model->norms));
    cudaCheck(cudaFree(model->grads));
    cudaCheck(cudaFree(model->activations));
    cudaCheck(cudaFree(model->working));
    if (model->attention_ds) cudaCheck(cudaFree(model->attention_ds));
    if (model->fp8_weight_transposes) cudaCheck(cudaFree(model->fp8_weight_transposes));
    if (model->attention_out_t) cudaCheck(cudaFree(model->attention_out_t));
    free(model->saved);
}

// Bytes of GPU memory the model allocates (what the memory plan counts for it).
static inline size_t model_allocated_bytes(const LlamaModel *model) {
    return 2 * (model->params_elems + model->norms_elems + model->grads_elems) + model->activations_bytes +
           model->working_layout.total_bytes + model->attention_ds_bytes + model->fp8_weight_transposes_bytes +
           model->attention_out_t_bytes;
}

static inline void model_create(LlamaModel *model, const ModelShape *shape, int B, int T, ModelPrecision precision) {
    model_create_sized(model, shape, B, T, precision, NULL, 0, 0);
}

// The BF16 weights changed (an optimizer step, a load): the FP8 copies are cast again before
// the next forward pass (with BF16 block weights; without them coat/zero.cuh casts them).
static inline void model_weights_changed(LlamaModel *model) { model->fp8_weights_current = 0; }

static inline int model_qkv_dim(const ModelShape *m) { return (m->n_heads + 2 * m->n_kv_heads) * model_head_dim(m); }

// ---- the linear layers ------------------------------------------------------------------

// The saved activation that is the linear layer's input.
static inline LayerActivation linear_input_activation(Linear which) {
    static const LayerActivation kinds[LINEARS] = {ACT_ATTN_NORM_OUT, ACT_ATTN_OUT, ACT_MLP_NORM_OUT, ACT_SWIGLU_OUT};
    return kinds[which];
}

typedef struct {
    int in, out;
} LinearShape;

static inline LinearShape linear_shape(const LlamaModel *model, Linear which) {
    size_t in[LINEARS], out[LINEARS];
    linear_shapes(&model->shape, in, out);
    LinearShape shape = {(int)in[which], (int)out[which]};
    return shape;
}

// Whether data parallelism's hooks hold the E4M3 weights (ZeRO stage 3) rather than fp8_weights.
static inline bool model_fp8_weights_in_buckets(const LlamaModel *model) {
    return model->buckets && model->buckets->fp8_weight;
}

// E4M3 copies of the weight W [out, in] and its transpose [in, out]: every layer's W, and its W^T
// either kept for every layer (fp8_weight_transposes, the last layer's in the room) or remade for
// one layer at a time in the room as that layer's backward starts (model_backward).
static inline uint8_t *linear_fp8_weight(const LlamaModel *model, int layer, Linear which, int transposed) {
    if (model_fp8_weights_in_buckets(model))
        return model->buckets->fp8_weight(model->buckets->context, layer, which, transposed);
    size_t in[LINEARS], out[LINEARS], at = 0;
    linear_shapes(&model->shape, in, out);
    for (int i = 0; i < (int)which; i++) at += in[i] * out[i];
    size_t layer_elems = linear_layer_weight_elems(&model->shape);
    if (transposed && model->fp8_weight_transposes && layer < model->shape.n_layers - 1)
        return model->fp8_weight_transposes + (size_t)layer * layer_elems + at;
    size_t place = transposed ? (size_t)model->shape.n_layers : (size_t)layer;  // the room follows the last layer
    return model->fp8_weights + place * layer_elems + at;
}

// Where the weights' cast writes a layer's W^T beside its W: NULL when the backward remakes it.
static inline uint8_t *linear_fp8_weight_cast_t(const LlamaModel *model, int layer, Linear which) {
    return model->fp8_weight_transposes ? linear_fp8_weight(model, layer, which, 1) : NULL;
}

// Where the forward pass writes a linear layer's BF16 input: the saved tensor when it is
// saved in BF16, else a working buffer that the FP8 cast reads; NULL for the inputs saved in
// FP8 with FP8 GEMMs but the attention output: the SwiGLU output is cast straight from gate_up
// (swiglu_forward_cast), the norm outputs from the norms' inputs (norm_output_cast).
static inline bf16 *linear_input_bf16(const LlamaModel *model, int layer, Linear which) {
    const SavedTensor *t = model_saved_tensor(model, layer, linear_input_activation(which));
    if (t->storage == STORE_BF16) return (bf16 *)t->data;
    if (model->precision.fp8_gemms && which != LINEAR_OUT) return NULL;
    if (which == LINEAR_DOWN)  // BF16 GEMMs: after gate_up in wide (idle in forward)
        return model->wide + (size_t)model->B * model->T * 2 * model->shape.ffn_dim;
    return model->branch;  // the norm outputs: the norm reads branch's row before writing it
}

// The slot that gathers the amax of a linear layer's input (NULL when it is never cast to FP8).
static inline Fp8Scale *linear_input_amax(const LlamaModel *model, int layer, Linear which) {
    return model_fp8_scale(model, layer, FP8_SLOT_INPUT, which);
}

// Casts every layer's weights to E4M3 (FP8 GEMMs with BF16 block weights, once per optimizer
// step).
static inline void model_cast_weights(LlamaModel *model, cudaStream_t s) {
    if (model->precision.weights_from_master)
        fail_with("model_cast_weights", "the block's linear weights have no BF16 copy: they are cast from the master weights");
    for (int l = 0; l < model->shape.n_layers; l++)
        for (int i = 0; i < LINEARS; i++) {
            Linear which = (Linear)i;
            LinearShape shape = linear_shape(model, which);
            Fp8Scale *slot = model_fp8_scale(model, l, FP8_SLOT_WEIGHT, which);
            const bf16 *weight = model_param(model, linear_weight_kind(which), l);
            cudaCheck(cudaMemsetAsync(slot, 0, sizeof(Fp8Scale), s));
            fp8_amax(slot, weight, (size_t)shape.out * shape.in, s);
            fp8_quantize(linear_fp8_weight(model, l, which, 0), linear_fp8_weight_cast_t(model, l, which), slot, weight,
                         shape.out, shape.in, FP8_E4M3, s);
        }
    model->fp8_weights_current = 1;
}

// A layer's transposed weight codes, once all its codes are here (their scales are the casts').
static inline void model_transpose_layer_weights(LlamaModel *model, int layer, cudaStream_t s) {
    for (int i = 0; i < LINEARS; i++) {
        Linear which = (Linear)i;
        LinearShape shape = linear_shape(model, which);
        fp8_transpose_codes(linear_fp8_weight(model, layer, which, 1), linear_fp8_weight(model, layer, which, 0),
                            shape.out, shape.in, s);
    }
}

// The saved FP8 transpose of a linear layer's input: the saved tensor, or for the BF16-saved
// attention output with FP8 GEMMs its transpose where attention_out_t holds them; else NULL.
static inline uint8_t *linear_saved_input_t(const LlamaModel *model, int layer, Linear which) {
    const SavedTensor *t = model_saved_tensor(model, layer, linear_input_activation(which));
    if (t->storage == STORE_E4M3_TENSOR) return (uint8_t *)t->data;
    if (which == LINEAR_OUT && model->attention_out_t)  // allocated only with FP8 GEMMs
        return model->attention_out_t + (size_t)layer * model->B * model->T * linear_shape(model, which).in;
    return NULL;
}

// out[N, out] = x W^T, x the layer's input written at linear_input_bf16 (with FP8 GEMMs its amax
// already gathered): the input is cast here, and its transpose saved when the table says so;
// with no BF16 input its producer cast it into fp8_input already.
static inline void linear_forward(GpuContext *gpu, LlamaModel *model, int layer, Linear which, bf16 *out) {
    int N = model->B * model->T;
    LinearShape shape = linear_shape(model, which);
    const bf16 *x = linear_input_bf16(model, layer, which);
    Fp8Scale *in_slot = linear_input_amax(model, layer, which);
    if (!model->precision.fp8_gemms) {
        uint8_t *saved_t = linear_saved_input_t(model, layer, which);
        if (saved_t != NULL) {
            fp8_quantize(NULL, saved_t, in_slot, x, N, shape.in, FP8_E4M3, gpu->stream);
            op_timer_mark(model->timer, "fp8 cast of a linear input (saved transpose)", gpu->stream);
        }
        matmul_forward(gpu, out, x, model_param(model, linear_weight_kind(which), layer), N, shape.in, shape.out, false);
        return;
    }
    if (x != NULL) {
        fp8_quantize(model->fp8_input, linear_saved_input_t(model, layer, which), in_slot, x, N, shape.in, FP8_E4M3, gpu->stream);
        op_timer_mark(model->timer, "fp8 cast of a linear input (+ saved transpose)", gpu->stream);
    }
    matmul_forward_fp8(gpu, out, (const __nv_fp8_e4m3 *)model->fp8_input, &in_slot->scale,
                       (const __nv_fp8_e4m3 *)linear_fp8_weight(model, layer, which, 0),
                       &model_fp8_scale(model, layer, FP8_SLOT_WEIGHT, which)->scale, N, shape.in, shape.out, false,
                       model->precision.fast_accumulation);
}

// For dy [N, out] (BF16; with FP8 GEMMs its amax gathered in the layer's gradient slot, or
// dy NULL when its producer cast it into fp8_grad and fp8_grad_t already):
// dW += dy^T x (dW = with grads_unwritten) and dx[N, in] = dy W (written, not accumulated).
static inline void linear_backward(GpuContext *gpu, LlamaModel *model, int layer, Linear which, bf16 *dx, const bf16 *dy) {
    int N = model->B * model->T;
    const bool add = !model->grads_unwritten;
    LinearShape shape = linear_shape(model, which);
    bf16 *dweight = model_grad(model, linear_weight_kind(which), layer);
    const SavedTensor *saved = model_saved_tensor(model, layer, linear_input_activation(which));
    cudaStream_t s = gpu->stream;
    if (!model->precision.fp8_gemms) {
        const bf16 *weight = model_param(model, linear_weight_kind(which), layer);
        if (saved->storage == STORE_BF16) {
            matmul_backward_weight(gpu, dweight, dy, (const bf16 *)saved->data, N, shape.in, shape.out, add);
        } else {
            // The saved E4M3 transpose back in BF16, at the start of wide: its occupant then
            // (d_swiglu before the down GEMM's dgrad writes it, or the dead d_swiglu / d_attn_out)
            // is not read before this product is done.
            bf16 *x_t = model->wide;
            fp8_dequantize(x_t, (const uint8_t *)saved->data, linear_input_amax(model, layer, which),
                           (size_t)N * shape.in, FP8_E4M3, s);
            op_timer_mark(model->timer, "fp8 saved input back to BF16", s);
            matmul_lt(gpu, matmul_output(dweight, DTYPE_BF16, shape.in), matmul_operand(dy, DTYPE_BF16, MATMUL_MN_MAJOR, shape.out, NULL),
                      matmul_operand(x_t, DTYPE_BF16, MATMUL_K_MAJOR, N, NULL), shape.out, shape.in, N, add, false);
        }
        matmul_backward_input(gpu, dx, dy, weight, N, shape.in, shape.out, false);
        return;
    }
    bool fast = model->precision.fast_accumulation;
    Fp8Scale *grad_slot = model_fp8_scale(model, layer, FP8_SLOT_GRAD, which);
    Fp8Scale *in_slot = linear_input_amax(model, layer, which);
    if (dy != NULL) {
        fp8_quantize(model->fp8_grad, model->fp8_grad_t, grad_slot, dy, N, shape.out, FP8_E5M2, s);
        op_timer_mark(model->timer, "fp8 cast of an output gradient (+ transpose)", s);
    }
    const uint8_t *x_t = linear_saved_input_t(model, layer, which);
    if (x_t == NULL) {  // remade from the saved BF16 input with the forward's amax
        fp8_quantize(NULL, model->fp8_input, in_slot, (const bf16 *)saved->data, N, shape.in, FP8_E4M3, s);
        op_timer_mark(model->timer, "fp8 transpose of a BF16-saved input", s);
        x_t = model->fp8_input;
    }
    matmul_backward_weight_fp8(gpu, dweight, DTYPE_BF16, (const __nv_fp8_e5m2 *)model->fp8_grad_t, &grad_slot->scale,
                               (const __nv_fp8_e4m3 *)x_t, &in_slot->scale, N, shape.in, shape.out, add, fast);
    matmul_backward_input_fp8(gpu, dx, (const __nv_fp8_e5m2 *)model->fp8_grad, &grad_slot->scale,
                              (const __nv_fp8_e4m3 *)linear_fp8_weight(model, layer, which, 1),
                              &model_fp8_scale(model, layer, FP8_SLOT_WEIGHT, which)->scale, N, shape.in, shape.out,
                              false, fast);
}

// ---- forward and backward ---------------------------------------------------------------

// Runs one op and charges its GPU time to `name` when profiling.
#define TIMED(name, ...)                                      \
    do {                                                      \
        __VA_ARGS__;                                          \
        op_timer_mark(model->timer, name, s);                 \
    } while (0)

// The BF16 residual stream at layer l's `kind` (RESIDUAL_IN or RESIDUAL_MID): the saved tensor,
// or with 1x16 copies of the residual stream the one working buffer, updated in place (the copies are saved).
static inline bf16 *model_residual(const LlamaModel *model, int layer, LayerActivation kind) {
    return model->residual != NULL ? model->residual : model_saved(model, layer, kind);
}

// With no BF16 norm output (linear_input_bf16 NULL), the FP8 cast of the QKV or gate_up input
// recomputes it from the norm's input (its 1x16 copy where saved so), the rstd and the weight,
// after the norm kernel gathered its amax.
static inline void norm_output_cast(LlamaModel *model, int layer, Linear which, cudaStream_t s) {
    if (linear_input_bf16(model, layer, which) != NULL) return;
    bool qkv = which == LINEAR_QKV;  // else gate_up
    LayerActivation residual_kind = qkv ? ACT_RESIDUAL_IN : ACT_RESIDUAL_MID;
    rmsnorm_output_cast(model->fp8_input, linear_saved_input_t(model, layer, which), linear_input_amax(model, layer, which),
                        model_residual(model, layer, residual_kind), model_saved_groups(model, layer, residual_kind),
                        model_saved_f32(model, layer, qkv ? ACT_ATTN_RSTD : ACT_MLP_RSTD),
                        model_param(model, qkv ? PARAM_ATTN_NORM : PARAM_MLP_NORM, layer), model->B * model->T,
                        model->shape.dim, s);
    op_timer_mark(model->timer, "rmsnorm output: fp8 cast (+ saved transpose)", s);
}

// Forward pass of one micro-batch whose tokens and targets are already in model->tokens and
// model->targets. Leaves the per-token losses in model->losses; when backward is set, the
// classifier also writes the gradient of the final norm output (into branch) and adds the
// lm_head's weight gradient, scaled by dloss.
static inline void model_forward(GpuContext *gpu, LlamaModel *model, int backward, float dloss) {
    const ModelShape *m = &model->shape;
    int B = model->B, T = model->T, N = B * T, H = m->dim, I = m->ffn_dim, hd = model_head_dim(m), L = m->n_layers;
    float eps = m->norm_eps;
    cudaStream_t s = gpu->stream;
    if (model->precision.fp8_gemms && !model->fp8_weights_current) {
        for (int b = 0; b < L + 2; b++) model_params_ready(model, b);  // the cast reads every layer
        TIMED("fp8 cast of the weights (once per step)", model_cast_weights(model, s));
    }
    if (model->working_layout.fp8_scales_bytes) {
        // Every activation and gradient amax starts from zero; the weights' entries are kept.
        for (int l = 0; l < L; l++)
            cudaCheck(cudaMemsetAsync(model->fp8_scales + (size_t)l * FP8_SCALES_PER_LAYER, 0,
                                      FP8_SLOT_WEIGHT * sizeof(Fp8Scale), s));
    }

    model_params_ready(model, L + 1);  // the segments (coat/params.h): the embedding, then layer l is segment L - l
    model_params_ready(model, L);
    TIMED("embedding forward",
          embedding_forward(model_residual(model, 0, ACT_RESIDUAL_IN), model->tokens, model_param(model, PARAM_EMBEDDING, 0), N, H, s));
    TIMED("rmsnorm forward",
          residual_rmsnorm_forward(NULL, linear_input_bf16(model, 0, LINEAR_QKV), model_saved_f32(model, 0, ACT_ATTN_RSTD),
                                   model_residual(model, 0, ACT_RESIDUAL_IN), NULL, model_param(model, PARAM_ATTN_NORM, 0),
                                   N, H, eps, s, model_saved_groups(model, 0, ACT_RESIDUAL_IN),
                                   linear_input_amax(model, 0, LINEAR_QKV)));
    norm_output_cast(model, 0, LINEAR_QKV, s);
    for (int l = 0; l < L; l++) {
        bf16 *qkv = model_saved(model, l, ACT_QKV), *attn_out = model_saved(model, l, ACT_ATTN_OUT);
        TIMED("matmul qkv forward", linear_forward(gpu, model, l, LINEAR_QKV, qkv));
        TIMED("rope forward", rope_forward(qkv, model->rope_cos, model->rope_sin, B, T, m->n_heads, m->n_kv_heads, hd, s));
        // With FP8 GEMMs the kernel also gathers the amax of its output for the out-projection's cast.
        TIMED("attention forward", attention_forward(attn_out, model_saved_f32(model, l, ACT_ATTN_LSE), qkv, B, T,
                                                     m->n_heads, m->n_kv_heads, hd, s,
                                                     model->precision.fp8_gemms ? &linear_input_amax(model, l, LINEAR_OUT)->amax : NULL));
        TIMED("matmul attention output forward", linear_forward(gpu, model, l, LINEAR_OUT, model->branch));
        TIMED("residual + rmsnorm forward",
              residual_rmsnorm_forward(model_residual(model, l, ACT_RESIDUAL_MID), linear_input_bf16(model, l, LINEAR_GATE_UP),
                                       model_saved_f32(model, l, ACT_MLP_RSTD), model_residual(model, l, ACT_RESIDUAL_IN),
                                       model->branch, model_param(model, PARAM_MLP_NORM, l), N, H, eps, s,
                                       model_saved_groups(model, l, ACT_RESIDUAL_MID), linear_input_amax(model, l, LINEAR_GATE_UP)));
        norm_output_cast(model, l, LINEAR_GATE_UP, s);
        Fp8Groups gate_up_copy = model_saved_groups(model, l, ACT_GATE_UP);
        bf16 *gate_up = gate_up_copy.codes != NULL ? model->gate_up_working : model_saved(model, l, ACT_GATE_UP);
        TIMED("matmul gate_up forward", linear_forward(gpu, model, l, LINEAR_GATE_UP, gate_up));
        bf16 *swiglu_out = linear_input_bf16(model, l, LINEAR_DOWN);
        Fp8Scale *swiglu_amax = linear_input_amax(model, l, LINEAR_DOWN);
        TIMED("swiglu forward", swiglu_forward(swiglu_out, gate_up, N, I, s, gate_up_copy, swiglu_amax));
        if (swiglu_out == NULL)  // cast straight from gate_up (or its 1x16 copy): no BF16 output
            TIMED("swiglu forward: fp8 cast (+ saved transpose)",
                  swiglu_forward_cast(model->fp8_input, linear_saved_input_t(model, l, LINEAR_DOWN), swiglu_amax, gate_up,
                                      gate_up_copy, N, I, s));
        TIMED("matmul down forward", linear_forward(gpu, model, l, LINEAR_DOWN, model->branch));
        // The next block's attention norm (or the final norm, BF16 in every mode) is fused with this residual add.
        int last = l == L - 1;
        model_params_ready(model, L - l - 1);  // the next layer's segment, or the lm_head's with the final norm (0)
        TIMED("residual + rmsnorm forward",
              residual_rmsnorm_forward(last ? model->final_residual : model_residual(model, l + 1, ACT_RESIDUAL_IN),
                                       last ? model->final_norm_out : linear_input_bf16(model, l + 1, LINEAR_QKV),
                                       last ? model->final_rstd : model_saved_f32(model, l + 1, ACT_ATTN_RSTD),
                                       model_residual(model, l, ACT_RESIDUAL_MID), model->branch,
                                       last ? model_param(model, PARAM_FINAL_NORM, 0) : model_param(model, PARAM_ATTN_NORM, l + 1),
                                       N, H, eps, s,
                                       last ? Fp8Groups{NULL, NULL} : model_saved_groups(model, l + 1, ACT_RESIDUAL_IN),
                                       last ? NULL : linear_input_amax(model, l + 1, LINEAR_QKV)));
        if (!last) norm_output_cast(model, l + 1, LINEAR_QKV, s);
    }
    if (backward) model_segment_begin(model, 0);  // the lm_head's gradient comes with the loss
    TIMED("classifier (lm_head + cross-entropy)",
          classifier_forward_backward(gpu, model->losses, backward ? model->branch : NULL,
                                      backward ? model_grad(model, PARAM_LM_HEAD, 0) : NULL, model->final_norm_out,
                                      model_param(model, PARAM_LM_HEAD, 0), model->targets, N, H, m->vocab_size, dloss,
                                      model->logits, (int)model->working_layout.logits_chunk_rows,
                                      !model->grads_unwritten));
}

// Backward pass after model_forward(backward = 1): adds every parameter's gradient into
// model->grads (zeroed by the caller at the start of a step, so micro-batches accumulate; or
// with grads_unwritten each written by its first writer, which clears it), or with data
// parallelism's `gradient` hook where it says (zeroed by `begin`).
static inline void model_backward(GpuContext *gpu, LlamaModel *model) {
    const ModelShape *m = &model->shape;
    int B = model->B, T = model->T, N = B * T, H = m->dim, I = m->ffn_dim, hd = model_head_dim(m);
    int A = m->n_heads * hd, L = m->n_layers, V = m->vocab_size;
    cudaStream_t s = gpu->stream;
    float *scratch = (float *)model->kernel_scratch;
    bf16 *d_norm = model->branch;  // the classifier left d(final norm output) here
    bf16 *d_residual = model->d_residual;

    TIMED("zero d_residual", cudaCheck(cudaMemsetAsync(d_residual, 0, (size_t)N * H * sizeof(bf16), s)));
    TIMED("rmsnorm backward",
          rmsnorm_backward(d_residual, model_grad(model, PARAM_FINAL_NORM, 0), scratch, d_norm, model->final_residual,
                           model_param(model, PARAM_FINAL_NORM, 0), model->final_rstd, N, H, s, Fp8Groups{NULL, NULL},
                           model_fp8_scale(model, L - 1, FP8_SLOT_GRAD, LINEAR_DOWN), !model->grads_unwritten));
    model_segment_end(model, 0);
    for (int l = L - 1; l >= 0; l--) {
        model_params_ready_backward(model, L - l);
        if (model->precision.fp8_gemms && !model_fp8_weights_in_buckets(model) && !model->fp8_weight_transposes)
            TIMED("fp8 transposes of the layer's weights", model_transpose_layer_weights(model, l, s));
        model_segment_begin(model, L - l);
        // MLP block: x_out = x_mid + Wdown swiglu(Wgate_up rmsnorm(x_mid))
        // With FP8 GEMMs d_gate_up goes straight to E5M2 (and its transpose), never to BF16.
        bf16 *d_swiglu = model->wide, *d_gate_up = model->precision.fp8_gemms ? NULL : model->wide + (size_t)N * I;
        const bf16 *gate_up = model_saved(model, l, ACT_GATE_UP);
        Fp8Groups gate_up_groups = model_saved_groups(model, l, ACT_GATE_UP);
        Fp8Scale *d_gate_up_amax = model_fp8_scale(model, l, FP8_SLOT_GRAD, LINEAR_GATE_UP);
        TIMED("matmul down backward", linear_backward(gpu, model, l, LINEAR_DOWN, d_swiglu, d_residual));
        TIMED("swiglu backward", swiglu_backward(d_gate_up, d_swiglu, gate_up, N, I, s, gate_up_groups, d_gate_up_amax));
        if (d_gate_up == NULL)
            TIMED("swiglu backward: fp8 cast (+ transpose)",
                  swiglu_backward_cast(model->fp8_grad, model->fp8_grad_t, d_gate_up_amax, d_swiglu, gate_up, gate_up_groups, N, I, s));
        TIMED("matmul gate_up backward", linear_backward(gpu, model, l, LINEAR_GATE_UP, d_norm, d_gate_up));
        TIMED("rmsnorm backward",
              rmsnorm_backward(d_residual, model_grad(model, PARAM_MLP_NORM, l), scratch, d_norm,
                               model_saved(model, l, ACT_RESIDUAL_MID), model_param(model, PARAM_MLP_NORM, l),
                               model_saved_f32(model, l, ACT_MLP_RSTD), N, H, s, model_saved_groups(model, l, ACT_RESIDUAL_MID),
                               model_fp8_scale(model, l, FP8_SLOT_GRAD, LINEAR_OUT), !model->grads_unwritten));
        // Attention block: x_mid = x_in + Wo attention(rope(Wqkv rmsnorm(x_in)))
        bf16 *d_attn_out = model->wide, *d_qkv = model->wide + (size_t)N * A;
        TIMED("matmul attention output backward", linear_backward(gpu, model, l, LINEAR_OUT, d_attn_out, d_residual));
        // The attention backward also rotates dQ and dK back (RoPE's backward) and, with FP8 GEMMs,
        // gathers the amax of the whole qkv gradient for its cast.
        const AttentionRopeBackward rope = {
            model->rope_cos, model->rope_sin,
            model->precision.fp8_gemms ? &model_fp8_scale(model, l, FP8_SLOT_GRAD, LINEAR_QKV)->amax : NULL};
        TIMED("attention backward (+ rope backward)",
              attention_backward(d_qkv, scratch, d_attn_out, model_saved(model, l, ACT_QKV), model_saved(model, l, ACT_ATTN_OUT),
                                 model_saved_f32(model, l, ACT_ATTN_LSE), B, T, m->n_heads, m->n_kv_heads, hd, s,
                                 model->attention_ds, rope));
        TIMED("matmul qkv backward", linear_backward(gpu, model, l, LINEAR_QKV, d_norm, d_qkv));
        TIMED("rmsnorm backward",
              rmsnorm_backward(d_residual, model_grad(model, PARAM_ATTN_NORM, l), scratch, d_norm,
                               model_saved(model, l, ACT_RESIDUAL_IN), model_param(model, PARAM_ATTN_NORM, l),
                               model_saved_f32(model, l, ACT_ATTN_RSTD), N, H, s, model_saved_groups(model, l, ACT_RESIDUAL_IN),
                               l > 0 ? model_fp8_scale(model, l - 1, FP8_SLOT_GRAD, LINEAR_DOWN) : NULL,
                               !model->grads_unwritten));
        model_segment_end(model, L - l);
    }
    model_segment_begin(model, L + 1);
    bf16 *d_embedding = model_grad(model, PARAM_EMBEDDING, 0);
    if (model->grads_unwritten)  // its scatter-add writes only the rows of the batch's tokens
        cudaCheck(cudaMemsetAsync(d_embedding, 0, (size_t)V * H * sizeof(bf16), s));
    TIMED("embedding backward", embedding_backward(d_embedding, d_residual, model->tokens, N, H, V, scratch, s));
    model->grads_unwritten = 0;
    model_segment_end(model, L + 1);
}

#undef TIMED
