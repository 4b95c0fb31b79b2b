// Tests of the CPU reference model (built with REF_REAL=double): every op's analytic gradient
// against central finite differences of L = sum(out * w) for a fixed random w, every parameter
// tensor of a tiny whole model likewise, the RoPE tables against their closed form (with and
// without Llama 3.1 scaling), AdamW against hand-computed values, and a loss that falls over
// 20 AdamW steps on one batch.
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "reference_llama.h"

#define FD_EPS 1e-6    // central-difference step; truncation error ~ eps^2, rounding ~ 1e-16 / eps
#define FD_RTOL 1e-6
#define FD_ATOL 1e-8

static void *test_calloc(size_t count, size_t elem_size) {
    void *p = calloc(count, elem_size);
    if (!p) {
        fprintf(stderr, "error: test_reference_grad: cannot allocate %zu bytes\n", count * elem_size);
        exit(1);
    }
    return p;
}

static real *new_reals(size_t n) { return (real *)test_calloc(n, sizeof(real)); }

static void fill_normal(real *x, size_t n, double std, Random *rng) {
    for (size_t i = 0; i < n; i++) x[i] = (real)(std * random_normal(rng));
}

static double weighted_sum(const real *out, const real *w, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)out[i] * w[i];
    return sum;
}

typedef double (*Objective)(void *context);

// Checks analytic[i] against (L(x + eps e_i) - L(x - eps e_i)) / (2 eps) for each of the n
// elements of input; one check line.
static void check_gradient(const char *name, Objective objective, void *context, real *input, const real *analytic,
                           size_t n) {
    size_t bad = 0, worst = 0;
    double worst_excess = -INFINITY, worst_numeric = 0.0, max_err = 0.0;
    for (size_t i = 0; i < n; i++) {
        real saved = input[i];
        input[i] = saved + FD_EPS;
        double loss_plus = objective(context);
        input[i] = saved - FD_EPS;
        double loss_minus = objective(context);
        input[i] = saved;
        double numeric = (loss_plus - loss_minus) / (2.0 * FD_EPS);
        double err = fabs((double)analytic[i] - numeric), allowed = FD_ATOL + FD_RTOL * fabs(numeric);
        if (!(err <= allowed)) bad++;
        if (err > max_err || isnan(err)) max_err = err;
        double excess = isnan(err) ? INFINITY : err - allowed;
        if (excess > worst_excess) {
            worst_excess = excess;
            worst = i;
            worst_numeric = numeric;
        }
    }
    if (bad == 0)
        check(1, "gradient %s vs finite differences (n=%zu, max abs err %.2g)", name, n, max_err);
    else
        check(0, "gradient %s: %zu of %zu elements off; element %zu expected %.12g got %.12g", name, bad, n, worst,
              worst_numeric, (double)analytic[worst]);
}

// ---- single ops ------------------------------------------------------------------------

typedef struct { const int *tokens; real *wte, *out; const real *w; int N, C; } EmbeddingCase;

static double embedding_objective(void *context) {
    EmbeddingCase *c = (EmbeddingCase *)context;
    ref_embedding_forward(c->out, c->tokens, c->wte, c->N, c->C);
    return weighted_sum(c->out, c->w, (size_t)c->N * c->C);
}

static void test_embedding(Random *rng) {
    enum { V = 7, N = 9, C = 5 };
    int tokens[N] = {3, 0, 6, 3, 3, 1, 6, 2, 0};  // repeats: the gradient must add up
    real *wte = new_reals(V * C), *out = new_reals(N * C), *w = new_reals(N * C), *dwte = new_reals(V * C);
    fill_normal(wte, V * C, 1.0, rng);
    fill_normal(w, N * C, 1.0, rng);
    EmbeddingCase c = {tokens, wte, out, w, N, C};
    ref_embedding_backward(dwte, w, tokens, N, C);
    check_gradient("embedding: d wte", embedding_objective, &c, wte, dwte, V * C);
    free(wte); free(out); free(w); free(dwte);
}

typedef struct { real *in, *weight, *out, *rstd; const real *w; int N, C; float eps; } RmsnormCase;

static double rmsnorm_objective(void *context) {
    RmsnormCase *c = (RmsnormCase *)context;
    ref_rmsnorm_forward(c->out, c->rstd, c->in, c->weight, c->N, c->C, c->eps);
    return weighted_sum(c->out, c->w, (size_t)c->N * c->C);
}

static void test_rmsnorm(Random *rng) {
    enum { N = 6, C = 11 };
    real *in = new_reals(N * C), *weight = new_reals(C), *out = new_reals(N * C), *rstd = new_reals(N);
    real *w = new_reals(N * C), *din = new_reals(N * C), *dweight = new_reals(C);
    fill_normal(in, N * C, 1.0, rng);
    fill_normal(w, N * C, 1.0, rng);
    for (int i = 0; i < C; i++) weight[i] = (real)(1.0 + 0.3 * random_normal(rng));
    RmsnormCase c = {in, weight, out, rstd, w, N, C, 1e-5f};
    rmsnorm_objective(&c);
    ref_rmsnorm_backward(din, dweight, w, in, weight, rstd, N, C);
    check_gradient("rmsnorm: d in", rmsnorm_objective, &c, in, din, N * C);
    check_gradient("rmsnorm: d weight", rmsnorm_objective, &c, weight, dweight, C);
    free(in); free(weight); free(out); free(rstd); free(w); free(din); free(dweight);
}

typedef struct { real *in, *weight, *out; const real *w; int N, IC, OC; } MatmulCase;

static double matmul_objective(void *context) {
    MatmulCase *c = (MatmulCase *)context;
    ref_matmul_forward(c->out, c->in, c->weight, c->N, c->IC, c->OC);
    return weighted_sum(c->out, c->w, (size_t)c->N * c->OC);
}

static void test_matmul(Random *rng) {
    enum { N = 5, IC = 7, OC = 3 };
    real *in = new_reals(N * IC), *weight = new_reals(OC * IC), *out = new_reals(N * OC), *w = new_reals(N * OC);
    real *din = new_reals(N * IC), *dweight = new_reals(OC * IC);
    fill_normal(in, N * IC, 1.0, rng);
    fill_normal(weight, OC * IC, 1.0, rng);
    fill_normal(w, N * OC, 1.0, rng);
    MatmulCase c = {in, weight, out, w, N, IC, OC};
    ref_matmul_backward(din, dweight, w, in, weight, N, IC, OC);
    check_gradient("matmul: d in", matmul_objective, &c, in, din, N * IC);
    check_gradient("matmul: d weight", matmul_objective, &c, weight, dweight, OC * IC);
    free(in); free(weight); free(out); free(w); free(din); free(dweight);
}

// head_dim 16, theta 10000, Llama 3.1 scaling with original length 64: frequency 0
// (wavelength 6.3) is kept, 1 and 2 (19.9, 62.8) are interpolated, 3..7 are divided by 8.
static ModelShape rope_test_shape(int with_scaling) {
    ModelShape s;
    memset(&s, 0, sizeof(s));
    s.vocab_size = 10;
    s.dim = 32;
    s.n_layers = 1;
    s.n_heads = 2;
    s.n_kv_heads = 2;
    s.ffn_dim = 8;
    s.max_seq_len = 16;
    s.rope_theta = 10000.0f;
    s.norm_eps = 1e-5f;
    if (with_scaling) {
        s.rope_scaling_factor = 8.0f;
        s.rope_low_freq_factor = 1.0f;
        s.rope_high_freq_factor = 4.0f;
        s.rope_original_max_seq_len = 64;
    }
    return s;
}

typedef struct { real *in, *out; const real *cos_table, *sin_table, *w; int B, T, NH, head_dim; } RopeCase;

static double rope_objective(void *context) {
    RopeCase *c = (RopeCase *)context;
    ref_rope_forward(c->out, c->in, c->cos_table, c->sin_table, c->B, c->T, c->NH, c->head_dim);
    return weighted_sum(c->out, c->w, (size_t)c->B * c->T * c->NH * c->head_dim);
}

static void test_rope_gradient(Random *rng, int with_scaling) {
    ModelShape shape = rope_test_shape(with_scaling);
    int B = 2, T = 7, NH = 3, head_dim = model_head_dim(&shape);
    size_t n = (size_t)B * T * NH * head_dim, table = (size_t)T * head_dim / 2;
    real *cos_table = new_reals(table), *sin_table = new_reals(table);
    ref_rope_table(cos_table, sin_table, T, &shape);
    real *in = new_reals(n), *out = new_reals(n), *w = new_reals(n), *din = new_reals(n);
    fill_normal(in, n, 1.0, rng);
    fill_normal(w, n, 1.0, rng);
    RopeCase c = {in, out, cos_table, sin_table, w, B, T, NH, head_dim};
    ref_rope_backward(din, w, cos_table, sin_table, B, T, NH, head_dim);
    check_gradient(with_scaling ? "rope (llama3 scaling): d in" : "rope: d in", rope_objective, &c, in, din, n);
    free(cos_table); free(sin_table); free(in); free(out); free(w); free(din);
}

// The half-split convention on one element, and that out may alias in.
static void test_rope_forward(Random *rng) {
    ModelShape shape = rope_test_shape(0);
    int B = 1, T = 4, NH = 2, head_dim = model_head_dim(&shape), half = head_dim / 2;
    size_t n = (size_t)B * T * NH * head_dim, table = (size_t)T * half;
    real *cos_table = new_reals(table), *sin_table = new_reals(table), *in = new_reals(n), *out = new_reals(n);
    ref_rope_table(cos_table, sin_table, T, &shape);
    fill_normal(in, n, 1.0, rng);
    ref_rope_forward(out, in, cos_table, sin_table, B, T, NH, head_dim);
    int t = 3, h = 1, i = 2;
    size_t base = ((size_t)t * NH + h) * head_dim;
    double angle = t * pow(10000.0, -2.0 * i / head_dim);
    double expected = in[base + i] * cos(angle) - in[base + i + half] * sin(angle);
    double expected_pair = in[base + i + half] * cos(angle) + in[base + i] * sin(angle);
    check(fabs(out[base + i] - expected) < 1e-14 && fabs(out[base + i + half] - expected_pair) < 1e-14,
          "rope forward: half split pairs element %d with %d (expected %.15g, %.15g got %.15g, %.15g)", i,
          i + half, expected, expected_pair, (double)out[base + i], (double)out[base + i + half]);
    ref_rope_forward(in, in, cos_table, sin_table, B, T, NH, head_dim);
    check(memcmp(in, out, n * sizeof(real)) == 0, "rope forward in place equals out of place");
    free(cos_table); free(sin_table); free(in); free(out);
}

typedef struct { real *q, *k, *v, *out, *lse; const real *w; int B, T, NH, NKV, head_dim; } AttentionCase;

static double attention_objective(void *context) {
    AttentionCase *c = (AttentionCase *)context;
    ref_attention_forward(c->out, c->lse, c->q, c->k, c->v, c->B, c->T, c->NH, c->NKV, c->head_dim);
    return weighted_sum(c->out, c->w, (size_t)c->B * c->T * c->NH * c->head_dim);
}

static void test_attention_gradient(Random *rng, int NH, int NKV) {
    int B = 2, T = 5, head_dim = 6;
    size_t nq = (size_t)B * T * NH * head_dim, nkv = (size_t)B * T * NKV * head_dim;
    real *q = new_reals(nq), *k = new_reals(nkv), *v = new_reals(nkv), *out = new_reals(nq), *w = new_reals(nq);
    real *lse = new_reals((size_t)B * NH * T), *dq = new_reals(nq), *dk = new_reals(nkv), *dv = new_reals(nkv);
    fill_normal(q, nq, 1.0, rng);
    fill_normal(k, nkv, 1.0, rng);
    fill_normal(v, nkv, 1.0, rng);
    fill_normal(w, nq, 1.0, rng);
    AttentionCase c = {q, k, v, out, lse, w, B, T, NH, NKV, head_dim};
    attention_objective(&c);
    ref_attention_backward(dq, dk, dv, w, q, k, v, out, lse, B, T, NH, NKV, head_dim);
    char name[64];
    snprintf(name, sizeof(name), "attention NH=%d NKV=%d: d q", NH, NKV);
    check_gradient(name, attention_objective, &c, q, dq, nq);
    snprintf(name, sizeof(name), "attention NH=%d NKV=%d: d k", NH, NKV);
    check_gradient(name, attention_objective, &c, k, dk, nkv);
    snprintf(name, sizeof(name), "attention NH=%d NKV=%d: d v", NH, NKV);
    check_gradient(name, attention_objective, &c, v, dv, nkv);
    free(q); free(k); free(v); free(out); free(w); free(lse); free(dq); free(dk); free(dv);
}

// Forward properties that gradients cannot see: causality, the GQA head mapping, the logsumexp.
static void test_attention_forward(Random *rng) {
    enum { B = 1, T = 4, NH = 4, NKV = 2, HD = 3 };
    size_t nq = B * T * NH * HD, nkv = B * T * NKV * HD;
    real *q = new_reals(nq), *k = new_reals(nkv), *v = new_reals(nkv), *out = new_reals(nq), *lse = new_reals(NH * T);
    real *out_changed = new_reals(nq);
    fill_normal(q, nq, 1.0, rng);
    fill_normal(k, nkv, 1.0, rng);
    fill_normal(v, nkv, 1.0, rng);
    ref_attention_forward(out, lse, q, k, v, B, T, NH, NKV, HD);
    // Query heads 0,1 read kv head 0 and 2,3 read kv head 1; position 0 sees only itself.
    double err = 0.0;
    for (int h = 0; h < NH; h++)
        for (int d = 0; d < HD; d++) err = fmax(err, fabs(out[h * HD + d] - v[(h / 2) * HD + d]));
    check(err < 1e-15, "attention forward: at position 0 head h outputs v of kv head h/2 (max err %.2g)", err);
    double lse_err = fabs(lse[0] - (q[0] * k[0] + q[1] * k[1] + q[2] * k[2]) / sqrt((double)HD));
    check(lse_err < 1e-15, "attention forward: logsumexp at position 0 is the scaled score (err %.2g)", lse_err);
    for (size_t i = (T - 1) * NKV * HD; i < nkv; i++) {
        k[i] += 1.0;
        v[i] -= 2.0;
    }
    ref_attention_forward(out_changed, lse, q, k, v, B, T, NH, NKV, HD);
    check(memcmp(out, out_changed, (T - 1) * NH * HD * sizeof(real)) == 0,
          "attention forward is causal: changing the last key and value leaves earlier outputs unchanged");
    free(q); free(k); free(v); free(out); free(lse); free(out_changed);
}

typedef struct { real *gate, *up, *out; const real *w; size_t n; } SwigluCase;

static double swiglu_objective(void *context) {
    SwigluCase *c = (SwigluCase *)context;
    ref_swiglu_forward(c->out, c->gate, c->up, c->n);
    return weighted_sum(c->out, c->w, c->n);
}

static void test_swiglu(Random *rng) {
    enum { n = 40 };
    real *gate = new_reals(n), *up = new_reals(n), *out = new_reals(n), *w = new_reals(n);
    real *dgate = new_reals(n), *dup = new_reals(n);
    fill_normal(gate, n, 2.0, rng);
    fill_normal(up, n, 1.0, rng);
    fill_normal(w, n, 1.0, rng);
    SwigluCase c = {gate, up, out, w, n};
    ref_swiglu_backward(dgate, dup, w, gate, up, n);
    check_gradient("swiglu: d gate", swiglu_objective, &c, gate, dgate, n);
    check_gradient("swiglu: d up", swiglu_objective, &c, up, dup, n);
    free(gate); free(up); free(out); free(w); free(dgate); free(dup);
}

typedef struct { real *logits, *losses; const int *targets; int N, V; real dloss; } CrossEntropyCase;

static double cross_entropy_objective(void *context) {
    CrossEntropyCase *c = (CrossEntropyCase *)context;
    return (double)c->dloss * ref_cross_entropy_forward(c->losses, c->logits, c->targets, c->N, c->V);
}

static void test_cross_entropy(Random *rng) {
    enum { N = 6, V = 9 };
    int targets[N] = {0, 8, 3, 3, 5, 1};
    real *logits = new_reals(N * V), *losses = new_reals(N), *dlogits = new_reals(N * V);
    fill_normal(logits, N * V, 2.0, rng);
    CrossEntropyCase c = {logits, losses, targets, N, V, (real)0.7};
    ref_cross_entropy_backward(dlogits, logits, targets, N, V, c.dloss);
    check_gradient("cross-entropy: d logits", cross_entropy_objective, &c, logits, dlogits, N * V);
    double sum_exp = 0.0;
    for (int i = 0; i < V; i++) sum_exp += exp(logits[V + i]);
    double expected = log(sum_exp) - logits[V + targets[1]];
    check(fabs(losses[1] - expected) < 1e-14, "cross-entropy forward: loss of row 1 expected %.15g got %.15g", expected,
          (double)losses[1]);
    free(logits); free(losses); free(dlogits);
}

// ---- RoPE tables and AdamW -------------------------------------------------------------

// |cos error| + |sin error| of table entry (t, i) against the angle t * inv_freq.
static double rope_entry_error(const real *cos_table, const real *sin_table, int half, int t, int i, double inv_freq) {
    size_t at = (size_t)t * half + i;
    return fabs(cos_table[at] - cos(t * inv_freq)) + fabs(sin_table[at] - sin(t * inv_freq));
}

static void test_rope_table(void) {
    ModelShape shape = rope_test_shape(0);
    int T = 16, half = model_head_dim(&shape) / 2;
    real *cos_table = new_reals((size_t)T * half), *sin_table = new_reals((size_t)T * half);
    ref_rope_table(cos_table, sin_table, T, &shape);
    const int positions[] = {0, 1, 7, 15};
    double cos_err = 0.0, sin_err = 0.0;
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < half; i++) {
            int t = positions[p];
            double angle = t * pow(10000.0, -2.0 * i / (2 * half));
            cos_err = fmax(cos_err, fabs(cos_table[t * half + i] - cos(angle)));
            sin_err = fmax(sin_err, fabs(sin_table[t * half + i] - sin(angle)));
        }
    check(cos_err < 1e-15, "rope table: cos(t theta^(-2i/d)) at t = 0, 1, 7, 15 (max err %.2g)", cos_err);
    check(sin_err < 1e-15, "rope table: sin(t theta^(-2i/d)) at t = 0, 1, 7, 15 (max err %.2g)", sin_err);

    ModelShape scaled = rope_test_shape(1);
    ref_rope_table(cos_table, sin_table, T, &scaled);
    int t = 5;
    double base_high = 1.0, base_low = pow(10000.0, -14.0 / 16.0), base_mid = pow(10000.0, -2.0 / 16.0);
    double smooth = (64.0 / (6.283185307179586 / base_mid) - 1.0) / (4.0 - 1.0);
    double expected_mid = (1.0 - smooth) * base_mid / 8.0 + smooth * base_mid;
    double high_err = rope_entry_error(cos_table, sin_table, half, t, 0, base_high);
    double low_err = rope_entry_error(cos_table, sin_table, half, t, 7, base_low / 8.0);
    double mid_err = rope_entry_error(cos_table, sin_table, half, t, 1, expected_mid);
    check(high_err < 1e-15, "rope llama3: high-frequency entry i=0 is unscaled (err %.2g)", high_err);
    check(low_err < 1e-15, "rope llama3: low-frequency entry i=7 is divided by factor 8 (err %.2g)", low_err);
    check(mid_err < 1e-15, "rope llama3: medium entry i=1 is interpolated, smooth %.4f (err %.2g)", smooth, mid_err);
    free(cos_table); free(sin_table);
}

// Hyperparameters exact in binary (eps large enough to matter), t = 2 from nonzero moments:
// m = 0.75 m0 + 0.25 g, v = 0.9375 v0 + 0.0625 g^2, bias corrections 1 - 0.75^2 and 1 - 0.9375^2,
// p -= 0.5 (m_hat / (sqrt(v_hat) + 0.0625) + 0.25 p); values computed by hand, to 17 digits.
static void test_adamw_step(void) {
    real p[3] = {1.0, -2.0, 0.5}, g[3] = {0.5, -0.25, 0.0}, m[3] = {0.25, -0.5, 0.125}, v[3] = {0.0625, 0.25, 0.015625};
    const double expected_m[3] = {0.3125, -0.4375, 0.09375}, expected_v[3] = {0.07421875, 0.23828125, 0.0146484375};
    const double expected_p[3] = {0.45253639539549984, -1.408764156835375, 0.17636968619508053};
    ref_adamw_update(p, g, m, v, 3, 0.5f, 0.75f, 0.9375f, 0.0625f, 0.25f, 2);
    double moment_err = 0.0, param_err = 0.0;
    for (int i = 0; i < 3; i++) {
        moment_err = fmax(moment_err, fabs(m[i] - expected_m[i]) + fabs(v[i] - expected_v[i]));
        param_err = fmax(param_err, fabs(p[i] - expected_p[i]));
    }
    check(moment_err == 0.0, "adamw: moments after one step (max err %.2g)", moment_err);
    check(param_err < 1e-15, "adamw: parameters after one step, e.g. p[0] expected %.17g got %.17g (max err %.2g)",
          expected_p[0], (double)p[0], param_err);
}

// ---- the whole model -------------------------------------------------------------------

static ModelShape tiny_shape(void) {
    ModelShape s;
    memset(&s, 0, sizeof(s));
    s.vocab_size = 37;
    s.dim = 16;
    s.n_layers = 2;
    s.n_heads = 4;
    s.n_kv_heads = 2;
    s.ffn_dim = 24;
    s.max_seq_len = 5;
    s.rope_theta = 10000.0f;
    s.norm_eps = 1e-5f;
    return s;
}

static void random_batch(int *tokens, int *targets, int n, int vocab_size, Random *rng) {
    for (int i = 0; i < n; i++) {
        tokens[i] = (int)random_below(rng, (uint64_t)vocab_size);
        targets[i] = (int)random_below(rng, (uint64_t)vocab_size);
    }
}

typedef struct { RefModel *model; const int *tokens, *targets; } ModelCase;

static double model_objective(void *context) {
    ModelCase *c = (ModelCase *)context;
    return ref_model_forward(c->model, c->tokens, c->targets);
}

// Weights larger than the initialisation so that attention is far from uniform and every
// path is nonlinear; norm weights away from 1 so that their gradients are not symmetric.
static void randomize_params(RefModel *model, Random *rng) {
    const ParamLayout *layout = &model->layout;
    for (int kind = 0; kind < PARAM_KINDS; kind++) {
        int copies = param_kind_is_per_layer((ParamKind)kind) ? layout->shape.n_layers : 1;
        for (int l = 0; l < copies; l++) {
            real *t = model->params + param_offset(layout, (ParamKind)kind, l);
            size_t n = param_numel(layout, (ParamKind)kind);
            for (size_t i = 0; i < n; i++)
                t[i] = (real)(param_kind_is_matrix((ParamKind)kind) ? 0.3 * random_normal(rng)
                                                                    : 1.0 + 0.2 * random_normal(rng));
        }
    }
}

static void test_model_gradients(Random *rng) {
    enum { B = 2, T = 5 };
    ModelShape shape = tiny_shape();
    RefModel model;
    ref_model_create(&model, &shape, B, T);
    randomize_params(&model, rng);
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, shape.vocab_size, rng);
    for (size_t i = 0; i < model.layout.total_padded; i++) model.grads[i] = (real)7.0;  // backward must zero them
    ref_model_forward(&model, tokens, targets);
    ref_model_backward(&model);

    ModelCase c = {&model, tokens, targets};
    const ParamLayout *layout = &model.layout;
    int padding_nonzero = 0;
    for (int kind = 0; kind < PARAM_KINDS; kind++) {
        int copies = param_kind_is_per_layer((ParamKind)kind) ? shape.n_layers : 1;
        for (int l = 0; l < copies; l++) {
            size_t offset = param_offset(layout, (ParamKind)kind, l), n = param_numel(layout, (ParamKind)kind);
            char name[96];
            if (param_kind_is_per_layer((ParamKind)kind))
                snprintf(name, sizeof(name), "model: layers.%d.%s", l, param_kind_name((ParamKind)kind));
            else
                snprintf(name, sizeof(name), "model: %s", param_kind_name((ParamKind)kind));
            check_gradient(name, model_objective, &c, model.params + offset, model.grads + offset, n);
            for (size_t i = n; i < layout->padded[kind]; i++) padding_nonzero += model.grads[offset + i] != 0;
        }
    }
    check(padding_nonzero == 0, "model: padding gradients are zero (%d nonzero)", padding_nonzero);
    ref_model_free(&model);
}

static void test_model_training(Random *rng) {
    enum { B = 2, T = 5, STEPS = 20 };
    ModelShape shape = tiny_shape();
    RefModel model;
    ref_model_create(&model, &shape, B, T);
    ref_model_init_weights(&model, 1234);
    int tokens[B * T], targets[B * T];
    random_batch(tokens, targets, B * T, shape.vocab_size, rng);
    double initial = ref_model_forward(&model, tokens, targets), final = initial;
    for (int step = 1; step <= STEPS; step++) {
        ref_model_backward(&model);
        ref_model_adamw(&model, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step);
        final = ref_model_forward(&model, tokens, targets);
    }
    double uniform = log((double)shape.vocab_size);
    check(fabs(initial - uniform) < 0.5, "model: initial loss %.4f is within 0.5 of ln(vocab) = %.4f", initial,
          uniform);
    check(final < 0.5 * initial, "model: loss falls from %.4f to %.4f after %d AdamW steps (need < %.4f)", initial,
          final, STEPS, 0.5 * initial);
    ref_model_free(&model);
}

// With zero gradients and moments the step is pure weight decay: matrices shrink by
// lr * weight_decay = 1/16, norm weights stay exactly as they are.
static void test_model_weight_decay(void) {
    ModelShape shape = tiny_shape();
    RefModel model;
    ref_model_create(&model, &shape, 1, 2);
    ref_model_init_weights(&model, 99);
    size_t n = model.layout.total_padded;
    real *before = new_reals(n);
    memcpy(before, model.params, n * sizeof(real));
    ref_model_adamw(&model, 0.125f, 0.9f, 0.95f, 1e-8f, 0.5f, 1);
    double matrix_err = 0.0;
    int norms_changed = 0;
    for (int kind = 0; kind < PARAM_KINDS; kind++) {
        int copies = param_kind_is_per_layer((ParamKind)kind) ? shape.n_layers : 1;
        for (int l = 0; l < copies; l++) {
            size_t offset = param_offset(&model.layout, (ParamKind)kind, l);
            for (size_t i = 0; i < param_numel(&model.layout, (ParamKind)kind); i++) {
                if (param_kind_is_matrix((ParamKind)kind))
                    matrix_err = fmax(matrix_err, fabs(model.params[offset + i] - 0.9375 * before[offset + i]));
                else
                    norms_changed += model.params[offset + i] != before[offset + i];
            }
        }
    }
    check(matrix_err < 1e-17, "model adamw: matrices decay by lr * weight_decay (max err %.2g)", matrix_err);
    check(norms_changed == 0, "model adamw: no weight decay on norm weights (%d changed)", norms_changed);
    free(before);
    ref_model_free(&model);
}

int main(void) {
    Random rng;
    random_seed(&rng, 20241019);
    test_embedding(&rng);
    test_rmsnorm(&rng);
    test_matmul(&rng);
    test_rope_gradient(&rng, 0);
    test_rope_gradient(&rng, 1);
    test_rope_forward(&rng);
    test_attention_gradient(&rng, 4, 2);
    test_attention_gradient(&rng, 2, 2);
    test_attention_forward(&rng);
    test_swiglu(&rng);
    test_cross_entropy(&rng);
    test_rope_table();
    test_adamw_step();
    test_model_gradients(&rng);
    test_model_training(&rng);
    test_model_weight_decay();
    return check_summary("test_reference_grad");
}
