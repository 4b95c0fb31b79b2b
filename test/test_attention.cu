// Tests of coat/attention.cuh on the GPU: the causal GQA flash attention forward (out, lse) and
// backward (dq, dk, dv in the packed dqkv) against the FP32 CPU reference on BF16-rounded inputs,
// for T in {1, 17, 64, 100, 257} (one partial tile, several, and the tile edges), head_dim 64 and
// 128, NH/NKV 4/4, 8/2, 12/4, B 1 or 2. Outputs are poisoned with NaN (0xFF bytes) before every
// run, with poisoned guards on both sides, so an element left unwritten or a write out of bounds
// shows. The backward runs twice and must be bitwise equal. Then random shapes against PyTorch SDPA
// (build/attention_sdpa.bin, written by scripts/attention_sdpa.py on a machine with torch): our
// out, dq, dk, dv against SDPA in float64 must be within twice the error of SDPA in BF16. Prints
// forward and forward+backward TFLOP/s at the four shapes of the attention peers (coat/README.md,
// Peers and hardware figures; information, not a check),
// and checks there that two backward runs from poisoned outputs agree bitwise and leave no element
// unwritten. First, on the host, the block orders of the passes (test_block_order).
//
// Tolerances. out: atol = rtol = 2e-2; P is rounded to BF16 before P V (relative 2^-9) and out
// itself is BF16 (2^-9), against values of order 1. lse: atol 1e-3, rtol 1e-4; it is FP32 all the
// way. dq, dk, dv: each is a sum of products of BF16-rounded factors (P, or dS = P (dP - D) whose
// dP = dO.v is of order sqrt(head_dim)), so the error follows the size of the terms, not of the
// sum, and a sum that cancels keeps the absolute error of its terms. So atol = 5e-2 * rms of the
// expected tensor (floor 1e-4 for the all-zero gradients at T = 1, where dP - D cancels exactly)
// and rtol = 3e-2. A wrong mask or tile gives errors of the order of the rms itself.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/attention.cuh"
#include "../coat/random.h"
#include "check.h"
#include "gpu_test_util.cuh"
extern "C" {
#include "reference_llama.h"
}

// Poisoned elements kept on each side of every output buffer (a multiple of 16 bytes for any type).
#define GUARD_ELEMS 64

typedef struct {
    int B, T, NH, NKV, head_dim;
} AttnShape;

// ---- host helpers ------------------------------------------------------------------------------

static double rms(const float *x, size_t n) {
    double sum = 0.0;
    for (size_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    return n ? sqrt(sum / (double)n) : 0.0;
}

// ---- device buffers with poisoned guards -------------------------------------------------------

// n elements of elem_size bytes, with GUARD_ELEMS poisoned elements before and after.
typedef struct {
    unsigned char *base;  // start of the front guard
    void *data;           // what the kernels see
    size_t n, elem_size;
} GuardedBuffer;

static GuardedBuffer guarded_alloc(size_t n, size_t elem_size) {
    GuardedBuffer buf;
    buf.n = n;
    buf.elem_size = elem_size;
    cudaCheck(cudaMalloc(&buf.base, (n + 2 * GUARD_ELEMS) * elem_size));
    buf.data = buf.base + GUARD_ELEMS * elem_size;
    return buf;
}

static void guarded_poison(GuardedBuffer *buf) { poison_nan(buf->base, (buf->n + 2 * GUARD_ELEMS) * buf->elem_size); }

// Copies the data to host (n elements) and returns 1 when both guards still hold 0xFF bytes.
static int guarded_fetch(const GuardedBuffer *buf, void *host_data) {
    size_t guard_bytes = GUARD_ELEMS * buf->elem_size;
    unsigned char *all = (unsigned char *)host_alloc(buf->n * buf->elem_size + 2 * guard_bytes);
    cudaCheck(cudaMemcpy(all, buf->base, buf->n * buf->elem_size + 2 * guard_bytes, cudaMemcpyDeviceToHost));
    memcpy(host_data, all + guard_bytes, buf->n * buf->elem_size);
    int intact = 1;
    for (size_t i = 0; i < guard_bytes; i++)
        if (all[i] != 0xFF || all[guard_bytes + buf->n * buf->elem_size + i] != 0xFF) intact = 0;
    free(all);
    return intact;
}

static void guarded_free(GuardedBuffer *buf) { cudaCheck(cudaFree(buf->base)); }

static size_t count_nan_bf16(const bf16 *x, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += isnan(__bfloat162float(x[i])) ? 1 : 0;
    return count;
}
static size_t count_nan_float(const float *x, size_t n) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += isnan(x[i]) ? 1 : 0;
    return count;
}

static void check_grad(const char *label, const char *name, const float *got, const float *expected, size_t n) {
    char what[160];
    snprintf(what, sizeof what, "%s: %s", label, name);
    double atol = fmax(5e-2 * rms(expected, n), 1e-4);
    check_close(what, got, expected, n, atol, 3e-2);
}

// RoPE's backward and the amax done by the backward's stores (AttentionRopeBackward), with and
// (at head_dim 128) without the stored dS: every bit of dqkv must be rope_rotate's, by minus each
// row's angles, over the unrotated backward's BF16 dQ and dK (plain, of the same inputs), v as
// there, and the amax max |dqkv| as stored.
static void check_rope_backward(const char *label, const bf16 *plain, GuardedBuffer *dqkv_buf, float *d_scratch,
                                const bf16 *d_dout, const bf16 *d_qkv, const bf16 *d_out, const float *d_lse,
                                bf16 *d_ds, AttnShape s) {
    const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, hd = s.head_dim, half = hd / 2;
    const size_t width = (size_t)(NH + 2 * NKV) * hd, n_qkv = (size_t)B * T * width, n_table = (size_t)T * half;
    float *cos_h = host_floats(n_table), *sin_h = host_floats(n_table);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            const double angle = t * pow(10000.0, -2.0 * i / hd);
            cos_h[(size_t)t * half + i] = (float)cos(angle);
            sin_h[(size_t)t * half + i] = (float)sin(angle);
        }
    bf16 *expected = host_bf16s(n_qkv), *got = host_bf16s(n_qkv);
    memcpy(expected, plain, n_qkv * sizeof(bf16));
    for (size_t bt = 0; bt < (size_t)B * T; bt++) {
        const size_t t = bt % T;
        for (size_t at = bt * width; at < bt * width + (size_t)(NH + NKV) * hd; at += hd)
            for (int i = 0; i < half; i++) {
                const float2 r = rope_rotate(__bfloat162float(plain[at + i]), __bfloat162float(plain[at + i + half]),
                                             cos_h[t * half + i], -sin_h[t * half + i]);
                expected[at + i] = __float2bfloat16(r.x);
                expected[at + i + half] = __float2bfloat16(r.y);
            }
    }
    float expected_amax = 0.0f;
    for (size_t i = 0; i < n_qkv; i++) expected_amax = fmaxf(expected_amax, fabsf(__bfloat162float(expected[i])));

    float *d_tables, *d_amax;
    cudaCheck(cudaMalloc(&d_tables, 2 * n_table * sizeof(float)));
    cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
    cudaCheck(cudaMemcpy(d_tables, cos_h, n_table * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_tables + n_table, sin_h, n_table * sizeof(float), cudaMemcpyHostToDevice));
    const AttentionRopeBackward rope = {d_tables, d_tables + n_table, d_amax};
    for (int stored = 0; stored <= (d_ds != NULL); stored++) {
        float amax;
        cudaCheck(cudaMemset(d_amax, 0, sizeof(float)));
        guarded_poison(dqkv_buf);
        attention_backward((bf16 *)dqkv_buf->data, d_scratch, d_dout, d_qkv, d_out, d_lse, B, T, NH, NKV, hd, 0,
                           stored ? d_ds : NULL, rope);
        cudaCheck(cudaDeviceSynchronize());
        cudaCheck(cudaMemcpy(&amax, d_amax, sizeof(float), cudaMemcpyDeviceToHost));
        const int intact = guarded_fetch(dqkv_buf, got);
        check(intact && memcmp(got, expected, n_qkv * sizeof(bf16)) == 0,
              "%s: backward%s with RoPE's backward the same bits as rope_rotate after it, guards %s", label,
              stored ? " (stored dS)" : "", intact ? "intact" : "overwritten");
        check(amax == expected_amax, "%s: backward%s amax %g = max |dqkv| %g as stored", label,
              stored ? " (stored dS)" : "", (double)amax, (double)expected_amax);
    }
    cudaCheck(cudaFree(d_tables));
    cudaCheck(cudaFree(d_amax));
    free(cos_h), free(sin_h), free(expected), free(got);
}

// ---- one shape against the reference -----------------------------------------------------------

static void test_shape(AttnShape s, Random *rng) {
    const int B = s.B, T = s.T, NH = s.NH, NKV = s.NKV, hd = s.head_dim;
    char label[96];
    snprintf(label, sizeof label, "B=%d T=%d NH=%d NKV=%d hd=%d", B, T, NH, NKV, hd);
    const size_t width = (size_t)(NH + 2 * NKV) * hd;
    const size_t n_qkv = (size_t)B * T * width, n_q = (size_t)B * T * NH * hd, n_kv = (size_t)B * T * NKV * hd;
    const size_t n_lse = (size_t)B * NH * T;

    // Inputs: q wider than k so that the softmax is peaked (score std 1.5), all BF16-exact.
    float *q = host_floats(n_q), *k = host_floats(n_kv), *v = host_floats(n_kv), *dout = host_floats(n_q);
    fill_normal_bf16_values(rng, q, n_q, 0.0, 1.5);
    fill_normal_bf16_values(rng, k, n_kv, 0.0, 1.0);
    fill_normal_bf16_values(rng, v, n_kv, 0.0, 1.0);
    fill_normal_bf16_values(rng, dout, n_q, 0.0, 1.0);
    float *qkv = host_floats(n_qkv);
    for (size_t bt = 0; bt < (size_t)B * T; bt++) {
        memcpy(qkv + bt * width, q + bt * NH * hd, (size_t)NH * hd * sizeof(float));
        memcpy(qkv + bt * width + (size_t)NH * hd, k + bt * NKV * hd, (size_t)NKV * hd * sizeof(float));
        memcpy(qkv + bt * width + (size_t)(NH + NKV) * hd, v + bt * NKV * hd, (size_t)NKV * hd * sizeof(float));
    }

    // Reference forward; the backward (CPU and GPU alike) then runs on the reference's out rounded
    // to BF16 and its lse, so that it is tested on its own.
    float *ref_out = host_floats(n_q), *ref_lse = host_floats(n_lse);
    ref_attention_forward(ref_out, ref_lse, q, k, v, B, T, NH, NKV, hd);
    float *out_in = host_floats(n_q);
    for (size_t i = 0; i < n_q; i++) out_in[i] = round_to_bf16(ref_out[i]);
    float *ref_dq = host_floats(n_q), *ref_dk = host_floats(n_kv), *ref_dv = host_floats(n_kv);
    ref_attention_backward(ref_dq, ref_dk, ref_dv, dout, q, k, v, out_in, ref_lse, B, T, NH, NKV, hd);

    bf16 *d_qkv = device_bf16_from(qkv, n_qkv), *d_dout = device_bf16_from(dout, n_q);
    bf16 *d_out_in = device_bf16_from(out_in, n_q);
    float *d_lse_in, *d_scratch;
    cudaCheck(cudaMalloc(&d_lse_in, n_lse * sizeof(float)));
    cudaCheck(cudaMalloc(&d_scratch, attention_backward_scratch_bytes(B, T, NH)));
    cudaCheck(cudaMemcpy(d_lse_in, ref_lse, n_lse * sizeof(float), cudaMemcpyHostToDevice));
    GuardedBuffer out_buf = guarded_alloc(n_q, sizeof(bf16)), lse_buf = guarded_alloc(n_lse, sizeof(float));
    GuardedBuffer dqkv_buf = guarded_alloc(n_qkv, sizeof(bf16));

    // Forward.
    guarded_poison(&out_buf);
    guarded_poison(&lse_buf);
    float *d_amax, out_amax;
    cudaCheck(cudaMalloc(&d_amax, sizeof(float)));
    cudaCheck(cudaMemset(d_amax, 0, sizeof(float)));
    attention_forward((bf16 *)out_buf.data, (float *)lse_buf.data, d_qkv, B, T, NH, NKV, hd, 0, d_amax);
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(&out_amax, d_amax, sizeof(float), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(d_amax));
    bf16 *out_h = host_bf16s(n_q);
    float *lse_h = host_floats(n_lse);
    int guards_intact = guarded_fetch(&out_buf, out_h);
    guards_intact &= guarded_fetch(&lse_buf, lse_h);
    size_t unwritten = count_nan_bf16(out_h, n_q) + count_nan_float(lse_h, n_lse);
    float *out_f = host_floats(n_q);
    convert_bf16_to_floats(out_f, out_h, n_q);
    char what[160];
    snprintf(what, sizeof what, "%s: forward out", label);
    check_close(what, out_f, ref_out, n_q, 2e-2, 2e-2);
    float expected_amax = 0.0f;
    for (size_t i = 0; i < n_q; i++) expected_amax = fmaxf(expected_amax, fabsf(out_f[i]));
    check(out_amax == expected_amax, "%s: forward amax %g = max |out| %g as stored", label, (double)out_amax,
          (double)expected_amax);
    snprintf(what, sizeof what, "%s: forward lse", label);
    check_close(what, lse_h, ref_lse, n_lse, 1e-3, 1e-4);

    // Backward, twice, with the scratch poisoned too: it must not depend on what was there.
    bf16 *dqkv_h[2];
    for (int run = 0; run < 2; run++) {
        guarded_poison(&dqkv_buf);
        poison_nan(d_scratch, attention_backward_scratch_bytes(B, T, NH));
        attention_backward((bf16 *)dqkv_buf.data, d_scratch, d_dout, d_qkv, d_out_in, d_lse_in, B, T, NH, NKV, hd,
                           0);
        cudaCheck(cudaDeviceSynchronize());
        dqkv_h[run] = host_bf16s(n_qkv);
        guards_intact &= guarded_fetch(&dqkv_buf, dqkv_h[run]);
    }
    unwritten += count_nan_bf16(dqkv_h[0], n_qkv);
    float *dq = host_floats(n_q), *dk = host_floats(n_kv), *dv = host_floats(n_kv);
    for (size_t bt = 0; bt < (size_t)B * T; bt++) {
        const bf16 *row = dqkv_h[0] + bt * width;
        for (size_t i = 0; i < (size_t)NH * hd; i++) dq[bt * NH * hd + i] = __bfloat162float(row[i]);
        for (size_t i = 0; i < (size_t)NKV * hd; i++) {
            dk[bt * NKV * hd + i] = __bfloat162float(row[(size_t)NH * hd + i]);
            dv[bt * NKV * hd + i] = __bfloat162float(row[(size_t)(NH + NKV) * hd + i]);
        }
    }
    check_grad(label, "backward dq", dq, ref_dq, n_q);
    check_grad(label, "backward dk", dk, ref_dk, n_kv);
    check_grad(label, "backward dv", dv, ref_dv, n_kv);
    check(unwritten == 0 && guards_intact, "%s: every element of out, lse, dqkv written (%zu NaN left), guards %s",
          label, unwritten, guards_intact ? "intact" : "overwritten");
    check(memcmp(dqkv_h[0], dqkv_h[1], n_qkv * sizeof(bf16)) == 0, "%s: backward bitwise deterministic", label);

    // With a (poisoned) dS buffer, used at head_dim 128: the dQ pass multiplies the stored dS^T by K,
    // and every bit of dqkv must be the one the two passes give without it.
    const size_t ds_bytes = attention_backward_ds_bytes(B, T, NH, hd);
    bf16 *d_ds = NULL;
    if (ds_bytes > 0) {
        cudaCheck(cudaMalloc(&d_ds, ds_bytes));
        poison_nan(d_ds, ds_bytes);
        guarded_poison(&dqkv_buf);
        attention_backward((bf16 *)dqkv_buf.data, d_scratch, d_dout, d_qkv, d_out_in, d_lse_in, B, T, NH, NKV, hd, 0,
                           d_ds);
        cudaCheck(cudaDeviceSynchronize());
        bf16 *stored_h = host_bf16s(n_qkv);
        int intact = guarded_fetch(&dqkv_buf, stored_h);
        check(intact && memcmp(stored_h, dqkv_h[0], n_qkv * sizeof(bf16)) == 0,
              "%s: backward with the stored dS the same bits as without, guards %s", label,
              intact ? "intact" : "overwritten");
        free(stored_h);
    }
    check_rope_backward(label, dqkv_h[0], &dqkv_buf, d_scratch, d_dout, d_qkv, d_out_in, d_lse_in, d_ds, s);
    if (d_ds != NULL) cudaCheck(cudaFree(d_ds));

    guarded_free(&out_buf);
    guarded_free(&lse_buf);
    guarded_free(&dqkv_buf);
    cudaCheck(cudaFree(d_qkv));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out_in));
    cudaCheck(cudaFree(d_lse_in));
    cudaCheck(cudaFree(d_scratch));
    float *host_buffers[] = {q, k, v, dout, qkv, ref_out, ref_lse, out_in, ref_dq, ref_dk, ref_dv, lse_h, out_f,
                             dq, dk, dv};
    for (size_t i = 0; i < sizeof host_buffers / sizeof host_buffers[0]; i++) free(host_buffers[i]);
    free(out_h);
    free(dqkv_h[0]);
    free(dqkv_h[1]);
}

// ---- against PyTorch SDPA -----------------------------------------------------------------------

// Relative RMS distance ||got - ref|| / ||ref|| over columns col0 .. col0 + cols of rows `width` wide.
static double relative_error(const float *got, const float *ref, size_t rows, size_t width, size_t col0,
                             size_t cols) {
    double diff = 0.0, norm = 0.0;
    for (size_t r = 0; r < rows; r++)
        for (size_t c = col0; c < col0 + cols; c++) {
            double d = (double)got[r * width + c] - ref[r * width + c];
            diff += d * d;
            norm += (double)ref[r * width + c] * ref[r * width + c];
        }
    return sqrt(diff / (norm + 1e-30));
}

// Ours against the float64 reference must be within twice PyTorch's BF16 SDPA's distance to it
// (plus 1e-3 for the smallest cases): ours runs the same BF16 math, and a wrong mask, tile edge or
// head mapping gives errors of order 1.
static void check_like_sdpa(const char *label, const char *name, double ours, double sdpa) {
    check(ours <= 2.0 * sdpa + 1e-3, "%s: %s vs float64 SDPA: relative error %.2e (PyTorch BF16 SDPA %.2e)", label,
          name, ours, sdpa);
}

// One case of scripts/attention_sdpa.py: our forward, then our backward on our out and lse (as in
// training), against SDPA in float64 and beside SDPA in BF16.
static int test_sdpa_case(FILE *f) {
    int32_t shape[8];
    if (fread(shape, sizeof shape, 1, f) != 1) return 0;
    const int B = shape[0], T = shape[1], NH = shape[2], NKV = shape[3], hd = shape[4];
    if (B < 1 || T < 1 || NKV < 1 || NH < NKV || NH % NKV || (hd != 64 && hd != 128)) return 0;
    const size_t rows = (size_t)B * T, width = (size_t)(NH + 2 * NKV) * hd, n_qkv = rows * width;
    const size_t n_q = rows * NH * hd, n_lse = (size_t)B * NH * T;
    bf16 *qkv = host_bf16s(n_qkv), *dout = host_bf16s(n_q);
    float *out_ref = host_floats(n_q), *dqkv_ref = host_floats(n_qkv), *out_sdpa = host_floats(n_q);
    float *dqkv_sdpa = host_floats(n_qkv);
    int ok = fread(qkv, sizeof(bf16), n_qkv, f) == n_qkv && fread(dout, sizeof(bf16), n_q, f) == n_q &&
             fread(out_ref, 4, n_q, f) == n_q && fread(dqkv_ref, 4, n_qkv, f) == n_qkv &&
             fread(out_sdpa, 4, n_q, f) == n_q && fread(dqkv_sdpa, 4, n_qkv, f) == n_qkv;
    if (ok) {
        char label[96];
        snprintf(label, sizeof label, "SDPA case B=%d T=%d NH=%d NKV=%d hd=%d", B, T, NH, NKV, hd);
        bf16 *d_qkv, *d_dout;
        float *d_scratch;
        cudaCheck(cudaMalloc(&d_qkv, n_qkv * sizeof(bf16)));
        cudaCheck(cudaMalloc(&d_dout, n_q * sizeof(bf16)));
        cudaCheck(cudaMalloc(&d_scratch, attention_backward_scratch_bytes(B, T, NH)));
        cudaCheck(cudaMemcpy(d_qkv, qkv, n_qkv * sizeof(bf16), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(d_dout, dout, n_q * sizeof(bf16), cudaMemcpyHostToDevice));
        GuardedBuffer out_buf = guarded_alloc(n_q, sizeof(bf16)), lse_buf = guarded_alloc(n_lse, sizeof(float));
        GuardedBuffer dqkv_buf = guarded_alloc(n_qkv, sizeof(bf16));
        guarded_poison(&out_buf);
        guarded_poison(&lse_buf);
        guarded_poison(&dqkv_buf);
        poison_nan(d_scratch, attention_backward_scratch_bytes(B, T, NH));
        attention_forward((bf16 *)out_buf.data, (float *)lse_buf.data, d_qkv, B, T, NH, NKV, hd, 0);
        attention_backward((bf16 *)dqkv_buf.data, d_scratch, d_dout, d_qkv, (bf16 *)out_buf.data,
                           (float *)lse_buf.data, B, T, NH, NKV, hd, 0);
        cudaCheck(cudaDeviceSynchronize());
        bf16 *out_h = host_bf16s(n_q), *dqkv_h = host_bf16s(n_qkv);
        float *lse_h = host_floats(n_lse), *out_f = host_floats(n_q), *dqkv_f = host_floats(n_qkv);
        int guards_intact = guarded_fetch(&out_buf, out_h) & guarded_fetch(&lse_buf, lse_h) &
                            guarded_fetch(&dqkv_buf, dqkv_h);
        size_t unwritten = count_nan_bf16(out_h, n_q) + count_nan_float(lse_h, n_lse) + count_nan_bf16(dqkv_h, n_qkv);
        convert_bf16_to_floats(out_f, out_h, n_q);
        convert_bf16_to_floats(dqkv_f, dqkv_h, n_qkv);
        const size_t q_cols = (size_t)NH * hd, kv_cols = (size_t)NKV * hd;
        check_like_sdpa(label, "out", relative_error(out_f, out_ref, rows, q_cols, 0, q_cols),
                        relative_error(out_sdpa, out_ref, rows, q_cols, 0, q_cols));
        const char *names[3] = {"dq", "dk", "dv"};
        const size_t col0[3] = {0, q_cols, q_cols + kv_cols}, cols[3] = {q_cols, kv_cols, kv_cols};
        for (int i = 0; i < 3; i++)
            check_like_sdpa(label, names[i], relative_error(dqkv_f, dqkv_ref, rows, width, col0[i], cols[i]),
                            relative_error(dqkv_sdpa, dqkv_ref, rows, width, col0[i], cols[i]));
        check(unwritten == 0 && guards_intact, "%s: every element of out, lse, dqkv written (%zu NaN left), guards %s",
              label, unwritten, guards_intact ? "intact" : "overwritten");
        guarded_free(&out_buf);
        guarded_free(&lse_buf);
        guarded_free(&dqkv_buf);
        cudaCheck(cudaFree(d_qkv));
        cudaCheck(cudaFree(d_dout));
        cudaCheck(cudaFree(d_scratch));
        free(out_h); free(dqkv_h); free(lse_h); free(out_f); free(dqkv_f);
    }
    free(qkv); free(dout); free(out_ref); free(dqkv_ref); free(out_sdpa); free(dqkv_sdpa);
    return ok;
}

static void test_against_sdpa(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        check(0, "SDPA cases %s are missing (make test-gpu writes them with scripts/attention_sdpa.py)", path);
        return;
    }
    int32_t header[16];
    if (fread(header, sizeof header, 1, f) != 1 || header[0] != 20261129 || header[1] != 1 || header[2] < 1) {
        check(0, "%s: not a file of scripts/attention_sdpa.py (bad header)", path);
        fclose(f);
        return;
    }
    for (int i = 0; i < header[2]; i++)
        if (!test_sdpa_case(f)) {
            check(0, "%s: case %d has a bad shape or is truncated", path, i);
            break;
        }
    fclose(f);
}

// ---- timing at the attention peers' shapes (coat/README.md) -----------------------------------

// counts[0] += elements where a and b differ bitwise, counts[1] += elements of a that are NaN.
__global__ void count_mismatches_kernel(unsigned long long *counts, const bf16 *a, const bf16 *b, size_t n) {
    unsigned long long differ = 0, nan = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        differ += __bfloat16_as_ushort(a[i]) != __bfloat16_as_ushort(b[i]);
        nan += __hisnan(a[i]);
    }
    if (differ) atomicAdd(&counts[0], differ);
    if (nan) atomicAdd(&counts[1], nan);
}

#define TIMED_RUNS 10

// Median milliseconds of TIMED_RUNS runs of forward (with_backward = 0) or forward + backward.
static float time_attention(int with_backward, bf16 *out, float *lse, const bf16 *qkv, bf16 *dqkv, float *scratch,
                            const bf16 *dout, AttnShape s, cudaStream_t stream, bf16 *ds = NULL) {
    return median_event_ms(2, TIMED_RUNS, [&] {
        attention_forward(out, lse, qkv, s.B, s.T, s.NH, s.NKV, s.head_dim, stream);
        if (with_backward)
            attention_backward(dqkv, scratch, dout, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.head_dim, stream, ds);
    }, stream);
}

static void benchmark(AttnShape s) {
    const size_t n_qkv = (size_t)s.B * s.T * (s.NH + 2 * s.NKV) * s.head_dim, n_q = (size_t)s.B * s.T * s.NH * s.head_dim;
    bf16 *qkv, *dqkv, *out, *dout;
    float *lse, *scratch;
    cudaStream_t stream;
    cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    cudaCheck(cudaMalloc(&qkv, n_qkv * sizeof(bf16)));
    cudaCheck(cudaMalloc(&dqkv, n_qkv * sizeof(bf16)));
    cudaCheck(cudaMalloc(&out, n_q * sizeof(bf16)));
    cudaCheck(cudaMalloc(&dout, n_q * sizeof(bf16)));
    cudaCheck(cudaMalloc(&lse, (size_t)s.B * s.NH * s.T * sizeof(float)));
    cudaCheck(cudaMalloc(&scratch, attention_backward_scratch_bytes(s.B, s.T, s.NH)));
    fill_uniform_bf16_kernel<<<1024, 256, 0, stream>>>(qkv, n_qkv, 1);
    cudaCheckLaunch();
    fill_uniform_bf16_kernel<<<1024, 256, 0, stream>>>(dout, n_q, 2);
    cudaCheckLaunch();

    float forward_ms = time_attention(0, out, lse, qkv, dqkv, scratch, dout, s, stream);
    float both_ms = time_attention(1, out, lse, qkv, dqkv, scratch, dout, s, stream);
    double forward_flops = 4.0 * s.B * s.NH * (double)s.T * s.T * s.head_dim / 2.0;  // causal: half of S
    printf("attention B=%d NH=%d NKV=%d T=%d hd=%d: forward %.3f ms %.0f TFLOP/s, forward+backward %.3f ms %.0f "
           "TFLOP/s\n",
           s.B, s.NH, s.NKV, s.T, s.head_dim, forward_ms, forward_flops / (forward_ms * 1e-3) / 1e12, both_ms,
           3.5 * forward_flops / (both_ms * 1e-3) / 1e12);

    // At this size the backward runs many waves of blocks (for head_dim 128 the kv blocks then
    // really take turns on the dQ slots): two runs from poisoned outputs must agree bitwise.
    bf16 *dqkv_first;
    unsigned long long *counts, counts_h[2];
    cudaCheck(cudaMalloc(&dqkv_first, n_qkv * sizeof(bf16)));
    cudaCheck(cudaMalloc(&counts, 2 * sizeof(unsigned long long)));
    cudaCheck(cudaMemsetAsync(dqkv_first, 0xFF, n_qkv * sizeof(bf16), stream));
    attention_backward(dqkv_first, scratch, dout, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.head_dim, stream);
    // Another backward (with the stored dS ds, or without) from poisoned dqkv, against the first:
    // counts_h gets the elements that differ and the NaN.
    auto backward_against_first = [&](bf16 *ds) {
        cudaCheck(cudaMemsetAsync(counts, 0, 2 * sizeof(unsigned long long), stream));
        cudaCheck(cudaMemsetAsync(dqkv, 0xFF, n_qkv * sizeof(bf16), stream));
        attention_backward(dqkv, scratch, dout, qkv, out, lse, s.B, s.T, s.NH, s.NKV, s.head_dim, stream, ds);
        count_mismatches_kernel<<<1024, 256, 0, stream>>>(counts, dqkv, dqkv_first, n_qkv);
        cudaCheckLaunch();
        cudaCheck(cudaMemcpyAsync(counts_h, counts, sizeof counts_h, cudaMemcpyDeviceToHost, stream));
        cudaCheck(cudaStreamSynchronize(stream));
    };
    backward_against_first(NULL);
    check(counts_h[0] == 0 && counts_h[1] == 0,
          "attention B=%d NH=%d NKV=%d T=%d hd=%d: backward bitwise deterministic (%llu elements differ), every "
          "element written (%llu NaN)",
          s.B, s.NH, s.NKV, s.T, s.head_dim, counts_h[0], counts_h[1]);

    // The same with the stored dS (head_dim 128), timed beside it.
    const size_t ds_bytes = attention_backward_ds_bytes(s.B, s.T, s.NH, s.head_dim);
    if (ds_bytes > 0) {
        bf16 *ds;
        cudaCheck(cudaMalloc(&ds, ds_bytes));
        backward_against_first(ds);
        check(counts_h[0] == 0 && counts_h[1] == 0,
              "attention B=%d NH=%d NKV=%d T=%d hd=%d: backward with the stored dS the same bits as without (%llu "
              "elements differ, %llu NaN)",
              s.B, s.NH, s.NKV, s.T, s.head_dim, counts_h[0], counts_h[1]);
        const float stored_ms = time_attention(1, out, lse, qkv, dqkv, scratch, dout, s, stream, ds);
        printf("attention B=%d NH=%d NKV=%d T=%d hd=%d: forward+backward with the stored dS %.3f ms %.0f TFLOP/s "
               "(%.2fx without)\n",
               s.B, s.NH, s.NKV, s.T, s.head_dim, stored_ms, 3.5 * forward_flops / (stored_ms * 1e-3) / 1e12,
               both_ms / stored_ms);
        cudaCheck(cudaFree(ds));
    }
    cudaCheck(cudaFree(dqkv_first));
    cudaCheck(cudaFree(counts));

    cudaCheck(cudaFree(qkv));
    cudaCheck(cudaFree(dqkv));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(dout));
    cudaCheck(cudaFree(lse));
    cudaCheck(cudaFree(scratch));
    cudaCheck(cudaStreamDestroy(stream));
}

// The block orders (attention_block_in_order, the code the kernels run): every (tile, pair) exactly
// once; in any chunk size a pair's tiles in order, longest (0) first, and no block of a chunk before
// one of an earlier chunk; chunks of one pair give the grid's order (pair after pair), one chunk of
// all pairs goes tile by tile. Partial last chunks included (pairs not a multiple of the chunk).
static void test_block_order(void) {
    const int shapes[][2] = {{1, 1}, {11, 128}, {16, 416}, {3, 7}, {32, 80}, {7, 5}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        const int tiles = shapes[si][0], pairs = shapes[si][1];
        const int chunks[] = {1, 2, 3, 5, 25, pairs > 1 ? pairs - 1 : 1, pairs};
        for (size_t ci = 0; ci < sizeof chunks / sizeof chunks[0]; ci++) {
            const int chunk = chunks[ci], n = tiles * pairs;
            int *seen = (int *)calloc((size_t)n, sizeof(int)), *next_tile = (int *)calloc((size_t)pairs, sizeof(int));
            int bad_range = 0, repeated = 0, out_of_order = 0, grid_order = 1, tile_by_tile = 1, last_chunk = 0;
            for (int linear = 0; linear < n; linear++) {
                const AttentionBlock b = attention_block_in_order(linear, tiles, pairs, chunk);
                if (b.x < 0 || b.x >= tiles || b.pair < 0 || b.pair >= pairs) {
                    bad_range++;
                    continue;
                }
                repeated += seen[b.pair * tiles + b.x]++ > 0;
                out_of_order += b.x != next_tile[b.pair]++;
                out_of_order += b.pair / chunk < last_chunk;
                last_chunk = b.pair / chunk;
                grid_order &= b.pair == linear / tiles && b.x == linear % tiles;
                tile_by_tile &= b.x == linear / pairs && b.pair == linear % pairs;
            }
            check(bad_range == 0 && repeated == 0 && out_of_order == 0,
                  "block order of %d tiles x %d pairs in chunks of %d: each block once (%d out of range, %d "
                  "repeated), in order (%d not)",
                  tiles, pairs, chunk, bad_range, repeated, out_of_order);
            if (chunk == 1) check(grid_order, "block order of %d x %d in chunks of 1: the grid's order", tiles, pairs);
            if (chunk == pairs) check(tile_by_tile, "block order of %d x %d in one chunk: tile by tile", tiles, pairs);
            free(seen);
            free(next_tile);
        }
    }
}

int main(int argc, char **argv) {
    test_block_order();
    Random rng;
    random_seed(&rng, 20261101);
    const int seq_lens[] = {1, 17, 64, 100, 257};
    const int head_dims[] = {64, 128};
    const int heads[][2] = {{4, 4}, {8, 2}, {12, 4}};
    for (size_t ti = 0; ti < sizeof seq_lens / sizeof seq_lens[0]; ti++)
        for (size_t di = 0; di < sizeof head_dims / sizeof head_dims[0]; di++)
            for (size_t hi = 0; hi < sizeof heads / sizeof heads[0]; hi++) {
                AttnShape s = {1 + (int)random_below(&rng, 2), seq_lens[ti], heads[hi][0], heads[hi][1],
                               head_dims[di]};
                test_shape(s, &rng);
            }

    test_against_sdpa(argc > 1 ? argv[1] : "build/attention_sdpa.bin");

    const AttnShape anchors[] = {
        {64, 1024, 12, 4, 64}, {16, 2048, 32, 8, 64}, {4, 2048, 32, 32, 128}, {8, 4096, 16, 16, 128}};
    for (size_t i = 0; i < sizeof anchors / sizeof anchors[0]; i++) benchmark(anchors[i]);
    return check_summary("test_attention");
}
