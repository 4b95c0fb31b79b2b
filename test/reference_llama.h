// CPU reference of the whole Llama model in plain C: the oracle every GPU kernel and the
// trainer are tested against. Written once over the type `real`: test programs build it
// as float (the FP32 reference) or with -DREF_REAL=double (finite-difference checks).
//
// Layouts (row-major): activations are [N = B*T, features]; q is [B, T, n_heads, head_dim],
// k and v are [B, T, n_kv_heads, head_dim]; the attention logsumexp is [B, n_heads, T].
// RoPE uses the Hugging Face "half split": element i pairs with i + head_dim/2.
// Every *_backward ACCUMULATES (+=) into all of its gradient outputs; callers zero them.
#pragma once
#include <stddef.h>
#include "../coat/model_shape.h"
#include "../coat/params.h"

#ifndef REF_REAL
#define REF_REAL float
#endif
typedef REF_REAL real;

#ifdef __cplusplus
extern "C" {
#endif

// RoPE tables [seq_len, head_dim/2], computed in double, with Llama 3.1 scaling when
// shape->rope_scaling_factor > 0.
void ref_rope_table(real *cos_table, real *sin_table, int seq_len, const ModelShape *shape);

void ref_embedding_forward(real *out, const int *tokens, const real *wte, int N, int C);
void ref_embedding_backward(real *dwte, const real *dout, const int *tokens, int N, int C);

// out = in * rstd * weight, rstd = 1 / sqrt(mean(in^2) + eps) per row.
void ref_rmsnorm_forward(real *out, real *rstd, const real *in, const real *weight, int N, int C, float eps);
void ref_rmsnorm_backward(real *din, real *dweight, const real *dout, const real *in, const real *weight,
                          const real *rstd, int N, int C);

// out[N, OC] = in[N, IC] * weight[OC, IC]^T
void ref_matmul_forward(real *out, const real *in, const real *weight, int N, int IC, int OC);
void ref_matmul_backward(real *din, real *dweight, const real *dout, const real *in, const real *weight,
                         int N, int IC, int OC);

// x is [B, T, n_heads, head_dim]; out may alias in.
void ref_rope_forward(real *out, const real *in, const real *cos_table, const real *sin_table,
                      int B, int T, int n_heads, int head_dim);
void ref_rope_backward(real *din, const real *dout, const real *cos_table, const real *sin_table,
                       int B, int T, int n_heads, int head_dim);

// Causal attention, softmax scale 1/sqrt(head_dim); query head h reads kv head h / (NH / NKV).
void ref_attention_forward(real *out, real *lse, const real *q, const real *k, const real *v,
                           int B, int T, int NH, int NKV, int head_dim);
void ref_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                            const real *v, const real *out, const real *lse, int B, int T, int NH, int NKV,
                            int head_dim);

// out = silu(gate) * up, elementwise over n values.
void ref_swiglu_forward(real *out, const real *gate, const real *up, size_t n);
void ref_swiglu_backward(real *dgate, real *dup, const real *dout, const real *gate, const real *up, size_t n);

// Mean cross-entropy of logits [N, V] against targets; losses[N] per position.
real ref_cross_entropy_forward(real *losses, const real *logits, const int *targets, int N, int V);
// dlogits += dloss * (softmax(logits) - onehot(target)) / N
void ref_cross_entropy_backward(real *dlogits, const real *logits, const int *targets, int N, int V, real dloss);

// One AdamW step over n values; t counts from 1; decoupled weight decay.
void ref_adamw_update(real *params, const real *grads, real *m, real *v, size_t n, float lr, float beta1,
                      float beta2, float eps, float weight_decay, int t);

// The whole model on one batch [B, T]: parameters and gradients in the ParamLayout of
// coat/params.h (padded), activations held for the backward pass.
typedef struct {
    ParamLayout layout;
    int B, T;
    real *params, *grads;   // layout.total_padded each
    real *m, *v;            // AdamW moments, layout.total_padded each
    real *acts;             // every activation saved for backward, one allocation
    size_t acts_size;
    real *cos_table, *sin_table;
    int *tokens, *targets;  // copies of the last forward's batch
    real loss;
} RefModel;

void ref_model_create(RefModel *model, const ModelShape *shape, int B, int T);
void ref_model_free(RefModel *model);
// Fills params with param_init_weights(seed) (converted to real).
void ref_model_init_weights(RefModel *model, unsigned long long seed);
// Returns the mean cross-entropy loss; keeps activations and the logits.
real ref_model_forward(RefModel *model, const int *tokens, const int *targets);
// Gradient of the mean loss into model->grads (zeroed first).
void ref_model_backward(RefModel *model);
// AdamW over all parameters; weight decay on matrices only (param_kind_is_matrix).
void ref_model_adamw(RefModel *model, float lr, float beta1, float beta2, float eps, float weight_decay, int t);
// Logits [B*T, vocab] of the last forward.
const real *ref_model_logits(const RefModel *model);

#ifdef __cplusplus
}
#endif
