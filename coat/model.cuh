// The Llama model on the GPU: parameter, gradient, activation and working buffers (one
// allocation each, laid out by coat/params.h, coat/activations.h and coat/memory_plan.h) and
// the forward and backward passes of one micro-batch.
//   x = embed(tokens); per layer: x += Wo attn(rope(Wqkv rmsnorm(x)));
//                                 x += Wdown (silu(Wgate h) * Wup h), h = rmsnorm(x)
//   loss = mean cross-entropy(Wlm rmsnorm(x), targets)
// Activations are [N = B*T, features] row-major; qkv rows hold the q heads, then k, then v.
// The wq/wk/wv and w_gate/w_up weights sit back to back in the parameter buffer, so each pair
// of projections is one GEMM.
#pragma once
#include "activations.h"
#include "attention.cuh"
#include "classifier.cuh"
#include "common.cuh"
#include "config.h"
#include "embedding.cuh"
#include "matmul.cuh"
#include "memory_plan.h"
#include "op_timer.cuh"
#include "params.h"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "swiglu.cuh"

typedef struct {
    ModelShape shape;
    ParamLayout layout;
    int B, T;
    bf16 *params, *grads;          // layout.total_padded each
    char *activations;             // saved for backward
    size_t activations_bytes;
    void **saved;                  // [n_layers][ACT_LAYER_KINDS] pointers into activations
    bf16 *final_residual, *final_norm_out;
    float *final_rstd, *losses;
    int *tokens, *targets;
    char *working;
    WorkingLayout working_layout;
    bf16 *branch, *d_residual, *wide, *logits;
    float *rope_cos, *rope_sin;
    float *mean_loss, *grad_norm_squared;  // device scalars
    void *kernel_scratch;
    OpTimer *timer;  // per-op GPU times when profiling; NULL otherwise
} LlamaModel;

static inline bf16 *model_param(const LlamaModel *model, ParamKind kind, int layer) {
    return model->params + param_offset(&model->layout, kind, layer);
}
static inline bf16 *model_grad(const LlamaModel *model, ParamKind kind, int layer) {
    return model->grads + param_offset(&model->layout, kind, layer);
}
static inline bf16 *model_saved(const LlamaModel *model, int layer, LayerActivation kind) {
    return (bf16 *)model->saved[layer * ACT_LAYER_KINDS + kind];
}
static inline float *model_saved_f32(const LlamaModel *model, int layer, LayerActivation kind) {
    return (float *)model->saved[layer * ACT_LAYER_KINDS + kind];
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

static inline void *model_alloc(size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        fprintf(stderr, "error: cannot allocate %.3f GiB for %s on the GPU: %s\n", gib(bytes), what, cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
    return p;
}

// Allocates every buffer for micro-batches of B sequences of T tokens. Only BF16 activation
// storage is built here; the caller refuses other modes before.
static inline void model_create(LlamaModel *model, const ModelShape *shape, int B, int T) {
    memset(model, 0, sizeof(*model));
    model->shape = *shape;
    model->B = B;
    model->T = T;
    param_layout_init(&model->layout, shape);
    size_t N = (size_t)B * T, L = (size_t)shape->n_layers;
    model->params = (bf16 *)model_alloc(2 * model->layout.total_padded, "parameters");
    model->grads = (bf16 *)model_alloc(2 * model->layout.total_padded, "gradients");
    cudaCheck(cudaMemset(model->grads, 0, 2 * model->layout.total_padded));

    ActivationInfo table[ACT_LAYER_KINDS];
    activation_table(table, shape, ACTS_BF16);
    size_t per_layer = activation_layer_bytes(shape, ACTS_BF16, N);
    model->activations_bytes = L * per_layer + final_activation_bytes(shape, N);
    model->activations = (char *)model_alloc(model->activations_bytes, "activations");
    model->saved = (void **)malloc(L * ACT_LAYER_KINDS * sizeof(void *));
    char *at = model->activations;
    for (size_t l = 0; l < L; l++)
        for (int k = 0; k < ACT_LAYER_KINDS; k++) {
            model->saved[l * ACT_LAYER_KINDS + k] = at;
            at += align256(activation_bytes(table[k].storage, table[k].per_token * N));
        }
    size_t H = (size_t)shape->dim;
    model->final_residual = (bf16 *)at;   at += align256(2 * N * H);
    model->final_norm_out = (bf16 *)at;   at += align256(2 * N * H);
    model->final_rstd = (float *)at;      at += align256(4 * N);
    model->losses = (float *)at;          at += align256(4 * N);
    model->tokens = (int *)at;            at += align256(4 * N);
    model->targets = (int *)at;

    WorkingLayout *w = &model->working_layout;
    working_layout_init(w, shape, B, T, 0);
    size_t scratch_needed = model_kernel_scratch_needed(shape, B, T);
    if (scratch_needed > w->kernel_scratch_bytes) {
        fprintf(stderr, "error: kernels need %zu bytes of scratch, the memory plan reserves %zu\n", scratch_needed,
                w->kernel_scratch_bytes);
        exit(EXIT_FAILURE);
    }
    model->working = (char *)model_alloc(w->total_bytes, "working buffers");
    model->branch = (bf16 *)(model->working + w->branch);
    model->d_residual = (bf16 *)(model->working + w->d_residual);
    model->wide = (bf16 *)(model->working + w->wide);
    model->rope_cos = (float *)(model->working + w->rope_cos);
    model->rope_sin = (float *)(model->working + w->rope_sin);
    model->logits = (bf16 *)(model->working + w->logits);
    model->kernel_scratch = model->working + w->kernel_scratch;
    model->mean_loss = (float *)(model->working + w->small);
    model->grad_norm_squared = model->mean_loss + 1;

    size_t table_elems = (size_t)T * model_head_dim(shape) / 2;
    float *cos_host = (float *)malloc(table_elems * sizeof(float)), *sin_host = (float *)malloc(table_elems * sizeof(float));
    rope_table_init(cos_host, sin_host, T, shape);
    cudaCheck(cudaMemcpy(model->rope_cos, cos_host, table_elems * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model->rope_sin, sin_host, table_elems * sizeof(float), cudaMemcpyHostToDevice));
    free(cos_host);
    free(sin_host);
}

static inline void model_free(LlamaModel *model) {
    cudaCheck(cudaFree(model->params));
    cudaCheck(cudaFree(model->grads));
    cudaCheck(cudaFree(model->activations));
    cudaCheck(cudaFree(model->working));
    free(model->saved);
}

static inline int model_qkv_dim(const ModelShape *m) { return (m->n_heads + 2 * m->n_kv_heads) * model_head_dim(m); }

// Forward pass of one micro-batch whose tokens and targets are already in model->tokens and
// model->targets. Leaves the per-token losses in model->losses; when backward is set, the
// classifier also writes the gradient of the final norm output (into branch) and adds the
// lm_head's weight gradient, scaled by dloss.
static inline void model_forward(GpuContext *gpu, LlamaModel *model, int backward, float dloss) {
    const ModelShape *m = &model->shape;
    int B = model->B, T = model->T, N = B * T, H = m->dim, I = m->ffn_dim, hd = model_head_dim(m);
    int QKV = model_qkv_dim(m), A = m->n_heads * hd, L = m->n_layers;
    cudaStream_t s = gpu->stream;

    embedding_forward(model_saved(model, 0, ACT_RESIDUAL_IN), model->tokens, model_param(model, PARAM_EMBEDDING, 0), N, H, s);
    op_timer_mark(model->timer, "embedding forward", s);
    rmsnorm_forward(model_saved(model, 0, ACT_ATTN_NORM_OUT), model_saved_f32(model, 0, ACT_ATTN_RSTD),
                    model_saved(model, 0, ACT_RESIDUAL_IN), model_param(model, PARAM_ATTN_NORM, 0), N, H, m->norm_eps, s);
    op_timer_mark(model->timer, "rmsnorm forward", s);
    for (int l = 0; l < L; l++) {
        bf16 *qkv = model_saved(model, l, ACT_QKV), *attn_out = model_saved(model, l, ACT_ATTN_OUT);
        matmul_forward(gpu, qkv, model_saved(model, l, ACT_ATTN_NORM_OUT), model_param(model, PARAM_WQ, l), N, H, QKV, false);
        op_timer_mark(model->timer, "matmul qkv forward", s);
        rope_forward(qkv, model->rope_cos, model->rope_sin, B, T, m->n_heads, m->n_kv_heads, hd, s);
        op_timer_mark(model->timer, "rope forward", s);
        attention_forward(attn_out, model_saved_f32(model, l, ACT_ATTN_LSE), qkv, B, T, m->n_heads, m->n_kv_heads, hd, s);
        op_timer_mark(model->timer, "attention forward", s);
        matmul_forward(gpu, model->branch, attn_out, model_param(model, PARAM_WO, l), N, A, H, false);
        op_timer_mark(model->timer, "matmul attention output forward", s);
        residual_rmsnorm_forward(model_saved(model, l, ACT_RESIDUAL_MID), model_saved(model, l, ACT_MLP_NORM_OUT),
                                 model_saved_f32(model, l, ACT_MLP_RSTD), model_saved(model, l, ACT_RESIDUAL_IN),
                                 model->branch, model_param(model, PARAM_MLP_NORM, l), N, H, m->norm_eps, s);
        op_timer_mark(model->timer, "residual + rmsnorm forward", s);
        bf16 *gate_up = model_saved(model, l, ACT_GATE_UP), *swiglu_out = model_saved(model, l, ACT_SWIGLU_OUT);
        matmul_forward(gpu, gate_up, model_saved(model, l, ACT_MLP_NORM_OUT), model_param(model, PARAM_W_GATE, l), N, H, 2 * I, false);
        op_timer_mark(model->timer, "matmul gate_up forward", s);
        swiglu_forward(swiglu_out, gate_up, N, I, s);
        op_timer_mark(model->timer, "swiglu forward", s);
        matmul_forward(gpu, model->branch, swiglu_out, model_param(model, PARAM_W_DOWN, l), N, I, H, false);
        op_timer_mark(model->timer, "matmul down forward", s);
        // The next block's attention norm (or the final norm) is fused with this residual add.
        int last = l == L - 1;
        residual_rmsnorm_forward(last ? model->final_residual : model_saved(model, l + 1, ACT_RESIDUAL_IN),
                                 last ? model->final_norm_out : model_saved(model, l + 1, ACT_ATTN_NORM_OUT),
                                 last ? model->final_rstd : model_saved_f32(model, l + 1, ACT_ATTN_RSTD),
                                 model_saved(model, l, ACT_RESIDUAL_MID), model->branch,
                                 last ? model_param(model, PARAM_FINAL_NORM, 0) : model_param(model, PARAM_ATTN_NORM, l + 1),
                                 N, H, m->norm_eps, s);
        op_timer_mark(model->timer, "residual + rmsnorm forward", s);
    }
    classifier_forward_backward(gpu, model->losses, backward ? model->branch : NULL,
                                backward ? model_grad(model, PARAM_LM_HEAD, 0) : NULL, model->final_norm_out,
                                model_param(model, PARAM_LM_HEAD, 0), model->targets, N, H, m->vocab_size, dloss,
                                model->logits, (int)model->working_layout.logits_chunk_rows);
    op_timer_mark(model->timer, "classifier (lm_head + cross-entropy)", s);
}

// Backward pass after model_forward(backward = 1): adds every parameter's gradient into
// model->grads (zeroed by the caller at the start of a step, so micro-batches accumulate).
static inline void model_backward(GpuContext *gpu, LlamaModel *model) {
    const ModelShape *m = &model->shape;
    int B = model->B, T = model->T, N = B * T, H = m->dim, I = m->ffn_dim, hd = model_head_dim(m);
    int QKV = model_qkv_dim(m), A = m->n_heads * hd, L = m->n_layers, V = m->vocab_size;
    cudaStream_t s = gpu->stream;
    float *scratch = (float *)model->kernel_scratch;
    bf16 *d_norm = model->branch;  // the classifier left d(final norm output) here
    bf16 *d_residual = model->d_residual;

    cudaCheck(cudaMemsetAsync(d_residual, 0, (size_t)N * H * sizeof(bf16), s));
    op_timer_mark(model->timer, "zero d_residual", s);
    rmsnorm_backward(d_residual, model_grad(model, PARAM_FINAL_NORM, 0), scratch, d_norm, model->final_residual,
                     model_param(model, PARAM_FINAL_NORM, 0), model->final_rstd, N, H, s);
    op_timer_mark(model->timer, "rmsnorm backward", s);
    for (int l = L - 1; l >= 0; l--) {
        // MLP block: x_out = x_mid + Wdown swiglu(Wgate_up rmsnorm(x_mid))
        bf16 *d_swiglu = model->wide, *d_gate_up = model->wide + (size_t)N * I;
        matmul_backward_weight(gpu, model_grad(model, PARAM_W_DOWN, l), d_residual, model_saved(model, l, ACT_SWIGLU_OUT), N, I, H, true);
        op_timer_mark(model->timer, "matmul down wgrad", s);
        matmul_backward_input(gpu, d_swiglu, d_residual, model_param(model, PARAM_W_DOWN, l), N, I, H, false);
        op_timer_mark(model->timer, "matmul down dgrad", s);
        swiglu_backward(d_gate_up, d_swiglu, model_saved(model, l, ACT_GATE_UP), N, I, s);
        op_timer_mark(model->timer, "swiglu backward", s);
        matmul_backward_weight(gpu, model_grad(model, PARAM_W_GATE, l), d_gate_up, model_saved(model, l, ACT_MLP_NORM_OUT), N, H, 2 * I, true);
        op_timer_mark(model->timer, "matmul gate_up wgrad", s);
        matmul_backward_input(gpu, d_norm, d_gate_up, model_param(model, PARAM_W_GATE, l), N, H, 2 * I, false);
        op_timer_mark(model->timer, "matmul gate_up dgrad", s);
        rmsnorm_backward(d_residual, model_grad(model, PARAM_MLP_NORM, l), scratch, d_norm, model_saved(model, l, ACT_RESIDUAL_MID),
                         model_param(model, PARAM_MLP_NORM, l), model_saved_f32(model, l, ACT_MLP_RSTD), N, H, s);
        op_timer_mark(model->timer, "rmsnorm backward", s);
        // Attention block: x_mid = x_in + Wo attention(rope(Wqkv rmsnorm(x_in)))
        bf16 *d_attn_out = model->wide, *d_qkv = model->wide + (size_t)N * A;
        matmul_backward_weight(gpu, model_grad(model, PARAM_WO, l), d_residual, model_saved(model, l, ACT_ATTN_OUT), N, A, H, true);
        op_timer_mark(model->timer, "matmul attention output wgrad", s);
        matmul_backward_input(gpu, d_attn_out, d_residual, model_param(model, PARAM_WO, l), N, A, H, false);
        op_timer_mark(model->timer, "matmul attention output dgrad", s);
        attention_backward(d_qkv, scratch, d_attn_out, model_saved(model, l, ACT_QKV), model_saved(model, l, ACT_ATTN_OUT),
                           model_saved_f32(model, l, ACT_ATTN_LSE), B, T, m->n_heads, m->n_kv_heads, hd, s);
        op_timer_mark(model->timer, "attention backward", s);
        rope_backward(d_qkv, model->rope_cos, model->rope_sin, B, T, m->n_heads, m->n_kv_heads, hd, s);
        op_timer_mark(model->timer, "rope backward", s);
        matmul_backward_weight(gpu, model_grad(model, PARAM_WQ, l), d_qkv, model_saved(model, l, ACT_ATTN_NORM_OUT), N, H, QKV, true);
        op_timer_mark(model->timer, "matmul qkv wgrad", s);
        matmul_backward_input(gpu, d_norm, d_qkv, model_param(model, PARAM_WQ, l), N, H, QKV, false);
        op_timer_mark(model->timer, "matmul qkv dgrad", s);
        rmsnorm_backward(d_residual, model_grad(model, PARAM_ATTN_NORM, l), scratch, d_norm, model_saved(model, l, ACT_RESIDUAL_IN),
                         model_param(model, PARAM_ATTN_NORM, l), model_saved_f32(model, l, ACT_ATTN_RSTD), N, H, s);
        op_timer_mark(model->timer, "rmsnorm backward", s);
    }
    embedding_backward(model_grad(model, PARAM_EMBEDDING, 0), d_residual, model->tokens, N, H, V, scratch, s);
    op_timer_mark(model->timer, "embedding backward", s);
}
