// CPU reference of the Llama model: every op's forward and backward, AdamW, and the whole
// pre-norm model (embedding -> n_layers x [RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU
// MLP, residual adds] -> RMSNorm -> lm_head -> mean cross-entropy). Plain loops over `real`,
// with double accumulators, so that the same source is the FP32 oracle for the GPU kernels
// and, built with -DREF_REAL=double, the subject of the finite-difference tests.
//
// Layouts are those of reference_llama.h: activations [N = B*T, features] row-major,
// q [B, T, NH, head_dim], k and v [B, T, NKV, head_dim], logsumexp [B, NH, T], weights
// [out_features, in_features]. The model's activation buffer holds, per layer, everything
// the backward pass reads, then the final norm and logits, then the backward's scratch
// gradients; RefActLayout below is its table of offsets.
#include "reference_llama.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const double TWO_PI = 6.283185307179586476925;

static void *ref_calloc(size_t count, size_t elem_size, const char *what) {
    void *p = calloc(count ? count : 1, elem_size);  // calloc(0) may return NULL
    if (!p) {
        fprintf(stderr, "error: reference model: cannot allocate %zu bytes for %s\n", count * elem_size, what);
        exit(1);
    }
    return p;
}

static void zero_reals(real *x, size_t n) { memset(x, 0, n * sizeof(real)); }

// ---- RoPE ------------------------------------------------------------------------------

// Llama 3.1 frequency scaling (HF _compute_llama3_parameters): wavelengths shorter than
// original_len / high_freq_factor are kept, longer than original_len / low_freq_factor are
// divided by the factor, and the band between is interpolated linearly in original_len / wavelen.
static double llama3_scaled_inv_freq(double inv_freq, const ModelShape *shape) {
    double factor = shape->rope_scaling_factor;
    double low_freq_factor = shape->rope_low_freq_factor, high_freq_factor = shape->rope_high_freq_factor;
    double original_len = shape->rope_original_max_seq_len;
    double low_freq_wavelen = original_len / low_freq_factor;
    double high_freq_wavelen = original_len / high_freq_factor;
    double wavelen = TWO_PI / inv_freq;
    if (wavelen < high_freq_wavelen) return inv_freq;
    if (wavelen > low_freq_wavelen) return inv_freq / factor;
    double smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq;
}

void ref_rope_table(real *cos_table, real *sin_table, int seq_len, const ModelShape *shape) {
    int head_dim = model_head_dim(shape), half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        double inv_freq = pow((double)shape->rope_theta, -2.0 * i / head_dim);
        if (shape->rope_scaling_factor > 0.0f) inv_freq = llama3_scaled_inv_freq(inv_freq, shape);
        for (int t = 0; t < seq_len; t++) {
            double angle = (double)t * inv_freq;
            cos_table[(size_t)t * half + i] = (real)cos(angle);
            sin_table[(size_t)t * half + i] = (real)sin(angle);
        }
    }
}

// Half split: (x[i], x[i + half]) is rotated by the angle of frequency i.
void ref_rope_forward(real *out, const real *in, const real *cos_table, const real *sin_table,
                      int B, int T, int n_heads, int head_dim) {
    int half = head_dim / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const real *c = cos_table + (size_t)t * half, *s = sin_table + (size_t)t * half;
            for (int h = 0; h < n_heads; h++) {
                size_t base = (((size_t)b * T + t) * n_heads + h) * head_dim;
                for (int i = 0; i < half; i++) {
                    double x1 = in[base + i], x2 = in[base + i + half];
                    out[base + i] = (real)(x1 * c[i] - x2 * s[i]);
                    out[base + i + half] = (real)(x2 * c[i] + x1 * s[i]);
                }
            }
        }
}

// The transpose of the rotation: rotate the gradient by minus the angle.
void ref_rope_backward(real *din, const real *dout, const real *cos_table, const real *sin_table,
                       int B, int T, int n_heads, int head_dim) {
    int half = head_dim / 2;
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const real *c = cos_table + (size_t)t * half, *s = sin_table + (size_t)t * half;
            for (int h = 0; h < n_heads; h++) {
                size_t base = (((size_t)b * T + t) * n_heads + h) * head_dim;
                for (int i = 0; i < half; i++) {
                    double d1 = dout[base + i], d2 = dout[base + i + half];
                    din[base + i] += (real)(d1 * c[i] + d2 * s[i]);
                    din[base + i + half] += (real)(d2 * c[i] - d1 * s[i]);
                }
            }
        }
}

// ---- embedding, RMSNorm, matmul --------------------------------------------------------

void ref_embedding_forward(real *out, const int *tokens, const real *wte, int N, int C) {
    for (int n = 0; n < N; n++) memcpy(out + (size_t)n * C, wte + (size_t)tokens[n] * C, (size_t)C * sizeof(real));
}

void ref_embedding_backward(real *dwte, const real *dout, const int *tokens, int N, int C) {
    for (int n = 0; n < N; n++) {
        real *row = dwte + (size_t)tokens[n] * C;
        for (int i = 0; i < C; i++) row[i] += dout[(size_t)n * C + i];
    }
}

void ref_rmsnorm_forward(real *out, real *rstd, const real *in, const real *weight, int N, int C, float eps) {
    for (int n = 0; n < N; n++) {
        const real *x = in + (size_t)n * C;
        double sum_sq = 0.0;
        for (int i = 0; i < C; i++) sum_sq += (double)x[i] * x[i];
        double r = 1.0 / sqrt(sum_sq / C + (double)eps);
        rstd[n] = (real)r;
        for (int i = 0; i < C; i++) out[(size_t)n * C + i] = (real)(x[i] * r * weight[i]);
    }
}

// d rstd / d x_j = -rstd^3 x_j / C, so dx_j = rstd dy_j w_j - rstd^3 x_j / C * sum_i dy_i w_i x_i.
void ref_rmsnorm_backward(real *din, real *dweight, const real *dout, const real *in, const real *weight,
                          const real *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const real *x = in + (size_t)n * C, *dy = dout + (size_t)n * C;
        double r = rstd[n], dot = 0.0;
        for (int i = 0; i < C; i++) dot += (double)dy[i] * weight[i] * x[i];
        double coeff = r * r * r * dot / C;
        for (int i = 0; i < C; i++) {
            din[(size_t)n * C + i] += (real)(r * dy[i] * weight[i] - coeff * x[i]);
            dweight[i] += (real)((double)dy[i] * x[i] * r);
        }
    }
}

void ref_matmul_forward(real *out, const real *in, const real *weight, int N, int IC, int OC) {
    for (int n = 0; n < N; n++) {
        const real *x = in + (size_t)n * IC;
        for (int o = 0; o < OC; o++) {
            const real *w = weight + (size_t)o * IC;
            double acc = 0.0;
            for (int i = 0; i < IC; i++) acc += (double)x[i] * w[i];
            out[(size_t)n * OC + o] = (real)acc;
        }
    }
}

// din = dout W and dweight = dout^T in; rows are accumulated in double, then added once.
void ref_matmul_backward(real *din, real *dweight, const real *dout, const real *in, const real *weight,
                         int N, int IC, int OC) {
    double *acc = (double *)ref_calloc((size_t)IC, sizeof(double), "matmul backward row");
    for (int n = 0; n < N; n++) {
        memset(acc, 0, (size_t)IC * sizeof(double));
        for (int o = 0; o < OC; o++) {
            double d = dout[(size_t)n * OC + o];
            const real *w = weight + (size_t)o * IC;
            for (int i = 0; i < IC; i++) acc[i] += d * w[i];
        }
        for (int i = 0; i < IC; i++) din[(size_t)n * IC + i] += (real)acc[i];
    }
    for (int o = 0; o < OC; o++) {
        memset(acc, 0, (size_t)IC * sizeof(double));
        for (int n = 0; n < N; n++) {
            double d = dout[(size_t)n * OC + o];
            const real *x = in + (size_t)n * IC;
            for (int i = 0; i < IC; i++) acc[i] += d * x[i];
        }
        for (int i = 0; i < IC; i++) dweight[(size_t)o * IC + i] += (real)acc[i];
    }
    free(acc);
}

// ---- attention -------------------------------------------------------------------------

static double dot_reals(const real *a, const real *b, int n) {
    double acc = 0.0;
    for (int i = 0; i < n; i++) acc += (double)a[i] * b[i];
    return acc;
}

// Query t of (b, h) attends to keys s <= t of kv head h / (NH / NKV):
// p_s = exp(scale q.k_s - lse), out = sum_s p_s v_s, lse = log sum_s exp(scale q.k_s).
void ref_attention_forward(real *out, real *lse, const real *q, const real *k, const real *v,
                           int B, int T, int NH, int NKV, int head_dim) {
    double scale = 1.0 / sqrt((double)head_dim);
    int group = NH / NKV;
    double *acc = (double *)ref_calloc((size_t)head_dim, sizeof(double), "attention output row");
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const real *qt = q + (((size_t)b * T + t) * NH + h) * head_dim;
                const real *k0 = k + ((size_t)b * T * NKV + h / group) * head_dim;
                const real *v0 = v + ((size_t)b * T * NKV + h / group) * head_dim;
                size_t kv_stride = (size_t)NKV * head_dim;
                double max_score = -INFINITY;
                for (int s = 0; s <= t; s++) {
                    double score = scale * dot_reals(qt, k0 + s * kv_stride, head_dim);
                    if (score > max_score) max_score = score;
                }
                double sum = 0.0;
                memset(acc, 0, (size_t)head_dim * sizeof(double));
                for (int s = 0; s <= t; s++) {
                    double p = exp(scale * dot_reals(qt, k0 + s * kv_stride, head_dim) - max_score);
                    sum += p;
                    for (int d = 0; d < head_dim; d++) acc[d] += p * v0[s * kv_stride + d];
                }
                real *ot = out + (((size_t)b * T + t) * NH + h) * head_dim;
                for (int d = 0; d < head_dim; d++) ot[d] = (real)(acc[d] / sum);
                lse[((size_t)b * NH + h) * T + t] = (real)(max_score + log(sum));
            }
    free(acc);
}

// With dp_s = dout.v_s and D = dout.out = sum_s p_s dp_s, the score gradient is
// ds_s = p_s (dp_s - D); then dq = scale sum_s ds_s k_s, dk_s += scale ds_s q, dv_s += p_s dout.
void ref_attention_backward(real *dq, real *dk, real *dv, const real *dout, const real *q, const real *k,
                            const real *v, const real *out, const real *lse, int B, int T, int NH, int NKV,
                            int head_dim) {
    double scale = 1.0 / sqrt((double)head_dim);
    int group = NH / NKV;
    size_t kv_stride = (size_t)NKV * head_dim;
    double *dq_acc = (double *)ref_calloc((size_t)head_dim, sizeof(double), "attention dq row");
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                size_t q_index = (((size_t)b * T + t) * NH + h) * head_dim;
                size_t kv0 = ((size_t)b * T * NKV + h / group) * head_dim;
                const real *qt = q + q_index, *dout_row = dout + q_index;
                double row_lse = lse[((size_t)b * NH + h) * T + t];
                double D = dot_reals(dout_row, out + q_index, head_dim);
                memset(dq_acc, 0, (size_t)head_dim * sizeof(double));
                for (int s = 0; s <= t; s++) {
                    size_t ks = kv0 + s * kv_stride;
                    double p = exp(scale * dot_reals(qt, k + ks, head_dim) - row_lse);
                    double ds = p * (dot_reals(dout_row, v + ks, head_dim) - D);
                    for (int d = 0; d < head_dim; d++) {
                        dq_acc[d] += scale * ds * k[ks + d];
                        dk[ks + d] += (real)(scale * ds * qt[d]);
                        dv[ks + d] += (real)(p * dout_row[d]);
                    }
                }
                for (int d = 0; d < head_dim; d++) dq[q_index + d] += (real)dq_acc[d];
            }
    free(dq_acc);
}

// ---- SwiGLU, cross-entropy, AdamW ------------------------------------------------------

void ref_swiglu_forward(real *out, const real *gate, const real *up, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double g = gate[i];
        out[i] = (real)(g / (1.0 + exp(-g)) * up[i]);
    }
}

// silu'(g) = sigmoid(g) (1 + g (1 - sigmoid(g))).
void ref_swiglu_backward(real *dgate, real *dup, const real *dout, const real *gate, const real *up, size_t n) {
    for (size_t i = 0; i < n; i++) {
        double g = gate[i], sig = 1.0 / (1.0 + exp(-g));
        dgate[i] += (real)(dout[i] * (double)up[i] * sig * (1.0 + g * (1.0 - sig)));
        dup[i] += (real)(dout[i] * g * sig);
    }
}

static double row_logsumexp(const real *row, int V) {
    double max_logit = -INFINITY, sum = 0.0;
    for (int i = 0; i < V; i++)
        if (row[i] > max_logit) max_logit = row[i];
    for (int i = 0; i < V; i++) sum += exp(row[i] - max_logit);
    return max_logit + log(sum);
}

real ref_cross_entropy_forward(real *losses, const real *logits, const int *targets, int N, int V) {
    double total = 0.0;
    for (int n = 0; n < N; n++) {
        const real *row = logits + (size_t)n * V;
        double loss = row_logsumexp(row, V) - row[targets[n]];
        losses[n] = (real)loss;
        total += loss;
    }
    return (real)(total / N);
}

void ref_cross_entropy_backward(real *dlogits, const real *logits, const int *targets, int N, int V, real dloss) {
    double scale = (double)dloss / N;
    for (int n = 0; n < N; n++) {
        const real *row = logits + (size_t)n * V;
        double lse = row_logsumexp(row, V);
        for (int i = 0; i < V; i++) {
            double grad = exp(row[i] - lse) - (i == targets[n] ? 1.0 : 0.0);
            dlogits[(size_t)n * V + i] += (real)(scale * grad);
        }
    }
}

// p -= lr (m_hat / (sqrt(v_hat) + eps) + weight_decay p), with the moments updated first.
void ref_adamw_update(real *params, const real *grads, real *m, real *v, size_t n, float lr, float beta1,
                      float beta2, float eps, float weight_decay, int t) {
    double b1 = beta1, b2 = beta2;
    double bias_correction1 = 1.0 - pow(b1, t), bias_correction2 = 1.0 - pow(b2, t);
    for (size_t i = 0; i < n; i++) {
        double g = grads[i], p = params[i];
        double m_new = b1 * m[i] + (1.0 - b1) * g;
        double v_new = b2 * v[i] + (1.0 - b2) * g * g;
        m[i] = (real)m_new;
        v[i] = (real)v_new;
        double m_hat = m_new / bias_correction1, v_hat = v_new / bias_correction2;
        params[i] = (real)(p - (double)lr * (m_hat / (sqrt(v_hat) + (double)eps) + (double)weight_decay * p));
    }
}

// ---- the whole model -------------------------------------------------------------------

// Offsets into RefModel.acts. Per layer (stride layer_stride): the layer's input residual,
// the attention RMSNorm (rstd, output), q and k after RoPE, v, the attention output and its
// logsumexp, the residual after attention, the MLP RMSNorm, gate, up and SwiGLU outputs.
typedef struct {
    size_t input, attn_rstd, attn_norm_out, q, k, v, att_out, lse, attn_residual;
    size_t mlp_rstd, mlp_norm_out, gate, up, swiglu_out;
    size_t layer_stride;
    size_t final_residual, final_rstd, final_norm_out, logits, losses;
    // backward scratch: gradients of the residual stream and of one layer's intermediates
    size_t d_residual, d_norm_out, d_q_rot, d_k_rot, d_v, d_q, d_k, d_att_out, d_gate, d_up, d_swiglu_out;
    size_t d_logits;
    size_t total;
} RefActLayout;

static size_t take(size_t *cursor, size_t n) {
    size_t offset = *cursor;
    *cursor += n;
    return offset;
}

static RefActLayout ref_act_layout(const ModelShape *shape, int B, int T) {
    size_t N = (size_t)B * T, H = (size_t)shape->dim, I = (size_t)shape->ffn_dim, V = (size_t)shape->vocab_size;
    size_t head_dim = (size_t)model_head_dim(shape);
    size_t QD = (size_t)shape->n_heads * head_dim, KVD = (size_t)shape->n_kv_heads * head_dim;
    RefActLayout a;
    size_t cursor = 0;
    a.input = take(&cursor, N * H);
    a.attn_rstd = take(&cursor, N);
    a.attn_norm_out = take(&cursor, N * H);
    a.q = take(&cursor, N * QD);
    a.k = take(&cursor, N * KVD);
    a.v = take(&cursor, N * KVD);
    a.att_out = take(&cursor, N * QD);
    a.lse = take(&cursor, (size_t)B * shape->n_heads * T);
    a.attn_residual = take(&cursor, N * H);
    a.mlp_rstd = take(&cursor, N);
    a.mlp_norm_out = take(&cursor, N * H);
    a.gate = take(&cursor, N * I);
    a.up = take(&cursor, N * I);
    a.swiglu_out = take(&cursor, N * I);
    a.layer_stride = cursor;
    cursor = a.layer_stride * (size_t)shape->n_layers;
    a.final_residual = take(&cursor, N * H);
    a.final_rstd = take(&cursor, N);
    a.final_norm_out = take(&cursor, N * H);
    a.logits = take(&cursor, N * V);
    a.losses = take(&cursor, N);
    a.d_residual = take(&cursor, N * H);
    a.d_norm_out = take(&cursor, N * H);
    a.d_q_rot = take(&cursor, N * QD);
    a.d_k_rot = take(&cursor, N * KVD);
    a.d_v = take(&cursor, N * KVD);
    a.d_q = take(&cursor, N * QD);
    a.d_k = take(&cursor, N * KVD);
    a.d_att_out = take(&cursor, N * QD);
    a.d_gate = take(&cursor, N * I);
    a.d_up = take(&cursor, N * I);
    a.d_swiglu_out = take(&cursor, N * I);
    a.d_logits = take(&cursor, N * V);
    a.total = cursor;
    return a;
}

typedef struct {
    real *input, *attn_rstd, *attn_norm_out, *q, *k, *v, *att_out, *lse, *attn_residual;
    real *mlp_rstd, *mlp_norm_out, *gate, *up, *swiglu_out;
    real *output;  // the next layer's input, or the final residual
} LayerActs;

static LayerActs layer_acts(const RefModel *model, const RefActLayout *a, int layer) {
    real *base = model->acts + (size_t)layer * a->layer_stride;
    LayerActs la;
    la.input = base + a->input;
    la.attn_rstd = base + a->attn_rstd;
    la.attn_norm_out = base + a->attn_norm_out;
    la.q = base + a->q;
    la.k = base + a->k;
    la.v = base + a->v;
    la.att_out = base + a->att_out;
    la.lse = base + a->lse;
    la.attn_residual = base + a->attn_residual;
    la.mlp_rstd = base + a->mlp_rstd;
    la.mlp_norm_out = base + a->mlp_norm_out;
    la.gate = base + a->gate;
    la.up = base + a->up;
    la.swiglu_out = base + a->swiglu_out;
    int last = layer + 1 == model->layout.shape.n_layers;
    la.output = last ? model->acts + a->final_residual : base + a->layer_stride + a->input;
    return la;
}

// One layer's nine tensors inside a parameter-shaped buffer (parameters or gradients).
typedef struct { real *attn_norm, *wq, *wk, *wv, *wo, *mlp_norm, *w_gate, *w_up, *w_down; } LayerWeights;

static LayerWeights layer_weights(const ParamLayout *layout, real *buffer, int layer) {
    LayerWeights w;
    w.attn_norm = buffer + param_offset(layout, PARAM_ATTN_NORM, layer);
    w.wq = buffer + param_offset(layout, PARAM_WQ, layer);
    w.wk = buffer + param_offset(layout, PARAM_WK, layer);
    w.wv = buffer + param_offset(layout, PARAM_WV, layer);
    w.wo = buffer + param_offset(layout, PARAM_WO, layer);
    w.mlp_norm = buffer + param_offset(layout, PARAM_MLP_NORM, layer);
    w.w_gate = buffer + param_offset(layout, PARAM_W_GATE, layer);
    w.w_up = buffer + param_offset(layout, PARAM_W_UP, layer);
    w.w_down = buffer + param_offset(layout, PARAM_W_DOWN, layer);
    return w;
}

static void validate_shape(const ModelShape *shape, int B, int T) {
    const char *problem = NULL;
    if (shape->n_heads <= 0 || shape->n_kv_heads <= 0 || shape->n_layers <= 0 || B <= 0 || T <= 0)
        problem = "n_heads, n_kv_heads, n_layers, B and T must be positive";
    else if (shape->dim % shape->n_heads != 0) problem = "dim must be a multiple of n_heads";
    else if (model_head_dim(shape) % 2 != 0) problem = "head_dim must be even for RoPE";
    else if (shape->n_heads % shape->n_kv_heads != 0) problem = "n_heads must be a multiple of n_kv_heads";
    if (problem) {
        fprintf(stderr, "error: reference model: %s\n", problem);
        exit(1);
    }
}

void ref_model_create(RefModel *model, const ModelShape *shape, int B, int T) {
    validate_shape(shape, B, T);
    param_layout_init(&model->layout, shape);
    model->B = B;
    model->T = T;
    size_t n = model->layout.total_padded;
    model->params = (real *)ref_calloc(n, sizeof(real), "parameters");
    model->grads = (real *)ref_calloc(n, sizeof(real), "gradients");
    model->m = (real *)ref_calloc(n, sizeof(real), "AdamW first moments");
    model->v = (real *)ref_calloc(n, sizeof(real), "AdamW second moments");
    model->acts_size = ref_act_layout(shape, B, T).total;
    model->acts = (real *)ref_calloc(model->acts_size, sizeof(real), "activations");
    size_t table_size = (size_t)T * (size_t)(model_head_dim(shape) / 2);
    model->cos_table = (real *)ref_calloc(table_size, sizeof(real), "RoPE cos table");
    model->sin_table = (real *)ref_calloc(table_size, sizeof(real), "RoPE sin table");
    ref_rope_table(model->cos_table, model->sin_table, T, shape);
    model->tokens = (int *)ref_calloc((size_t)B * T, sizeof(int), "tokens");
    model->targets = (int *)ref_calloc((size_t)B * T, sizeof(int), "targets");
    model->loss = 0;
}

void ref_model_free(RefModel *model) {
    free(model->params);
    free(model->grads);
    free(model->m);
    free(model->v);
    free(model->acts);
    free(model->cos_table);
    free(model->sin_table);
    free(model->tokens);
    free(model->targets);
    memset(model, 0, sizeof(*model));
}

void ref_model_init_weights(RefModel *model, unsigned long long seed) {
    size_t n = model->layout.total_padded;
    float *init = (float *)ref_calloc(n, sizeof(float), "initial weights");
    param_init_weights(&model->layout, init, seed);
    for (size_t i = 0; i < n; i++) model->params[i] = (real)init[i];
    free(init);
}

static void check_token_range(const int *ids, int count, int vocab_size, const char *what) {
    for (int i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= vocab_size) {
            fprintf(stderr, "error: reference model: %s[%d] = %d is outside the vocabulary [0, %d)\n", what, i,
                    ids[i], vocab_size);
            exit(1);
        }
}

real ref_model_forward(RefModel *model, const int *tokens, const int *targets) {
    const ModelShape *shape = &model->layout.shape;
    int B = model->B, T = model->T, N = B * T, H = shape->dim, I = shape->ffn_dim, V = shape->vocab_size;
    int NH = shape->n_heads, NKV = shape->n_kv_heads, head_dim = model_head_dim(shape);
    check_token_range(tokens, N, V, "tokens");
    check_token_range(targets, N, V, "targets");
    memcpy(model->tokens, tokens, (size_t)N * sizeof(int));
    memcpy(model->targets, targets, (size_t)N * sizeof(int));
    RefActLayout a = ref_act_layout(shape, B, T);
    const ParamLayout *layout = &model->layout;

    ref_embedding_forward(model->acts + a.input, tokens, model->params + param_offset(layout, PARAM_EMBEDDING, 0),
                          N, H);
    for (int l = 0; l < shape->n_layers; l++) {
        LayerActs la = layer_acts(model, &a, l);
        LayerWeights w = layer_weights(layout, model->params, l);
        ref_rmsnorm_forward(la.attn_norm_out, la.attn_rstd, la.input, w.attn_norm, N, H, shape->norm_eps);
        ref_matmul_forward(la.q, la.attn_norm_out, w.wq, N, H, NH * head_dim);
        ref_matmul_forward(la.k, la.attn_norm_out, w.wk, N, H, NKV * head_dim);
        ref_matmul_forward(la.v, la.attn_norm_out, w.wv, N, H, NKV * head_dim);
        ref_rope_forward(la.q, la.q, model->cos_table, model->sin_table, B, T, NH, head_dim);
        ref_rope_forward(la.k, la.k, model->cos_table, model->sin_table, B, T, NKV, head_dim);
        ref_attention_forward(la.att_out, la.lse, la.q, la.k, la.v, B, T, NH, NKV, head_dim);
        ref_matmul_forward(la.attn_residual, la.att_out, w.wo, N, NH * head_dim, H);
        for (size_t i = 0; i < (size_t)N * H; i++) la.attn_residual[i] += la.input[i];

        ref_rmsnorm_forward(la.mlp_norm_out, la.mlp_rstd, la.attn_residual, w.mlp_norm, N, H, shape->norm_eps);
        ref_matmul_forward(la.gate, la.mlp_norm_out, w.w_gate, N, H, I);
        ref_matmul_forward(la.up, la.mlp_norm_out, w.w_up, N, H, I);
        ref_swiglu_forward(la.swiglu_out, la.gate, la.up, (size_t)N * I);
        ref_matmul_forward(la.output, la.swiglu_out, w.w_down, N, I, H);
        for (size_t i = 0; i < (size_t)N * H; i++) la.output[i] += la.attn_residual[i];
    }
    real *acts = model->acts;
    ref_rmsnorm_forward(acts + a.final_norm_out, acts + a.final_rstd, acts + a.final_residual,
                        model->params + param_offset(layout, PARAM_FINAL_NORM, 0), N, H, shape->norm_eps);
    ref_matmul_forward(acts + a.logits, acts + a.final_norm_out,
                       model->params + param_offset(layout, PARAM_LM_HEAD, 0), N, H, V);
    model->loss = ref_cross_entropy_forward(acts + a.losses, acts + a.logits, targets, N, V);
    return model->loss;
}

void ref_model_backward(RefModel *model) {
    const ModelShape *shape = &model->layout.shape;
    int B = model->B, T = model->T, N = B * T, H = shape->dim, I = shape->ffn_dim, V = shape->vocab_size;
    int NH = shape->n_heads, NKV = shape->n_kv_heads, head_dim = model_head_dim(shape);
    size_t QD = (size_t)NH * head_dim, KVD = (size_t)NKV * head_dim;
    RefActLayout a = ref_act_layout(shape, B, T);
    const ParamLayout *layout = &model->layout;
    real *acts = model->acts, *params = model->params, *grads = model->grads;
    real *d_residual = acts + a.d_residual, *d_norm_out = acts + a.d_norm_out;
    real *d_q_rot = acts + a.d_q_rot, *d_k_rot = acts + a.d_k_rot, *d_v = acts + a.d_v;
    real *d_q = acts + a.d_q, *d_k = acts + a.d_k, *d_att_out = acts + a.d_att_out;
    real *d_gate = acts + a.d_gate, *d_up = acts + a.d_up, *d_swiglu_out = acts + a.d_swiglu_out;
    real *d_logits = acts + a.d_logits;

    zero_reals(grads, layout->total_padded);
    zero_reals(d_logits, (size_t)N * V);
    ref_cross_entropy_backward(d_logits, acts + a.logits, model->targets, N, V, (real)1);
    zero_reals(d_norm_out, (size_t)N * H);
    ref_matmul_backward(d_norm_out, grads + param_offset(layout, PARAM_LM_HEAD, 0), d_logits,
                        acts + a.final_norm_out, params + param_offset(layout, PARAM_LM_HEAD, 0), N, H, V);
    zero_reals(d_residual, (size_t)N * H);
    ref_rmsnorm_backward(d_residual, grads + param_offset(layout, PARAM_FINAL_NORM, 0), d_norm_out,
                         acts + a.final_residual, params + param_offset(layout, PARAM_FINAL_NORM, 0),
                         acts + a.final_rstd, N, H);

    // d_residual flows through both residual adds unchanged; each branch adds its share.
    for (int l = shape->n_layers - 1; l >= 0; l--) {
        LayerActs la = layer_acts(model, &a, l);
        LayerWeights w = layer_weights(layout, params, l), dw = layer_weights(layout, grads, l);

        zero_reals(d_swiglu_out, (size_t)N * I);
        ref_matmul_backward(d_swiglu_out, dw.w_down, d_residual, la.swiglu_out, w.w_down, N, I, H);
        zero_reals(d_gate, (size_t)N * I);
        zero_reals(d_up, (size_t)N * I);
        ref_swiglu_backward(d_gate, d_up, d_swiglu_out, la.gate, la.up, (size_t)N * I);
        zero_reals(d_norm_out, (size_t)N * H);
        ref_matmul_backward(d_norm_out, dw.w_gate, d_gate, la.mlp_norm_out, w.w_gate, N, H, I);
        ref_matmul_backward(d_norm_out, dw.w_up, d_up, la.mlp_norm_out, w.w_up, N, H, I);
        ref_rmsnorm_backward(d_residual, dw.mlp_norm, d_norm_out, la.attn_residual, w.mlp_norm, la.mlp_rstd, N, H);

        zero_reals(d_att_out, (size_t)N * QD);
        ref_matmul_backward(d_att_out, dw.wo, d_residual, la.att_out, w.wo, N, (int)QD, H);
        zero_reals(d_q_rot, (size_t)N * QD);
        zero_reals(d_k_rot, (size_t)N * KVD);
        zero_reals(d_v, (size_t)N * KVD);
        ref_attention_backward(d_q_rot, d_k_rot, d_v, d_att_out, la.q, la.k, la.v, la.att_out, la.lse, B, T, NH,
                               NKV, head_dim);
        zero_reals(d_q, (size_t)N * QD);
        zero_reals(d_k, (size_t)N * KVD);
        ref_rope_backward(d_q, d_q_rot, model->cos_table, model->sin_table, B, T, NH, head_dim);
        ref_rope_backward(d_k, d_k_rot, model->cos_table, model->sin_table, B, T, NKV, head_dim);
        zero_reals(d_norm_out, (size_t)N * H);
        ref_matmul_backward(d_norm_out, dw.wq, d_q, la.attn_norm_out, w.wq, N, H, (int)QD);
        ref_matmul_backward(d_norm_out, dw.wk, d_k, la.attn_norm_out, w.wk, N, H, (int)KVD);
        ref_matmul_backward(d_norm_out, dw.wv, d_v, la.attn_norm_out, w.wv, N, H, (int)KVD);
        ref_rmsnorm_backward(d_residual, dw.attn_norm, d_norm_out, la.input, w.attn_norm, la.attn_rstd, N, H);
    }
    ref_embedding_backward(grads + param_offset(layout, PARAM_EMBEDDING, 0), d_residual, model->tokens, N, H);
}

void ref_model_adamw(RefModel *model, float lr, float beta1, float beta2, float eps, float weight_decay, int t) {
    const ParamLayout *layout = &model->layout;
    for (int kind = 0; kind < PARAM_KINDS; kind++) {
        int copies = param_kind_is_per_layer((ParamKind)kind) ? layout->shape.n_layers : 1;
        float decay = param_kind_is_matrix((ParamKind)kind) ? weight_decay : 0.0f;
        for (int l = 0; l < copies; l++) {
            size_t offset = param_offset(layout, (ParamKind)kind, l);
            ref_adamw_update(model->params + offset, model->grads + offset, model->m + offset, model->v + offset,
                             param_numel(layout, (ParamKind)kind), lr, beta1, beta2, eps, decay, t);
        }
    }
}

const real *ref_model_logits(const RefModel *model) {
    return model->acts + ref_act_layout(&model->layout.shape, model->B, model->T).logits;
}
