// GPU tests of the embedding, RMSNorm (+ fused residual add), RoPE and SwiGLU kernels against the
// FP32 CPU reference (test/reference_llama.c): random inputs from a fixed seed, rounded to BF16,
// the same rounded values given to both sides. Outputs are poisoned with NaN bytes first, so an
// element a kernel forgets to write fails the comparison; backward passes run twice and must agree
// bit for bit. Ends with informational timings at llama-1b sizes (achieved GB/s, not checked).
#include <stdint.h>
#include <string.h>
#include "../coat/embedding.cuh"
#include "../coat/random.h"
#include "../coat/rmsnorm.cuh"
#include "../coat/rope.cuh"
#include "../coat/swiglu.cuh"
#include "check.h"
#include "gpu_test_util.cuh"
extern "C" {
#include "reference_llama.h"
}

// Outputs are BF16: rounding the result costs up to 2^-9 (0.2%) of its value, and the two sides
// see identical BF16 inputs and compute in FP32 (GPU) or double (CPU), so what remains is FP32
// rounding and summation order, far below that. rtol 1e-2 is a few BF16 roundings; atol 1e-2
// covers results near zero that come out of cancelling O(1) terms (RMSNorm's g - xhat * mean,
// SwiGLU's derivative), where the BF16 rounding of the inputs of the cancelling terms dominates.
// An indexing error moves values by O(1) and still fails.
#define BF16_ATOL 1e-2
#define BF16_RTOL 1e-2
#define RSTD_RTOL 1e-5  // FP32 sum of at most ~10^4 squares against a double sum
#define RMS_EPS 1e-5f

// ---- host helpers ----------------------------------------------------------------------

static void *device_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static void download_bf16(bf16 *host, const bf16 *device, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(host, device, n * sizeof(bf16), cudaMemcpyDeviceToHost));
}

static void download_floats(float *host, const float *device, size_t n) {
    cudaCheck(cudaDeviceSynchronize());
    cudaCheck(cudaMemcpy(host, device, n * sizeof(float), cudaMemcpyDeviceToHost));
}

// [rows, total_heads * head_dim] -> [rows, heads * head_dim], heads first_head.. of each row.
static void gather_heads(float *out, const float *packed, size_t rows, int total_heads, int first_head, int heads,
                         int head_dim) {
    size_t width = (size_t)heads * head_dim, packed_width = (size_t)total_heads * head_dim;
    for (size_t r = 0; r < rows; r++)
        memcpy(out + r * width, packed + r * packed_width + (size_t)first_head * head_dim, width * sizeof(float));
}

// ---- embedding -------------------------------------------------------------------------

// Tokens: each position is `hot_token` with probability hot_percent / 100, else uniform in [0, V).
// A hot token makes one long run of the sorted list that crosses many chunk boundaries.
static void random_tokens(Random *rng, int *tokens, int N, int V, int hot_percent, int hot_token) {
    for (int n = 0; n < N; n++)
        tokens[n] = (int)random_below(rng, 100) < hot_percent ? hot_token : (int)random_below(rng, (uint64_t)V);
}

static void test_embedding_forward(int N, int C, int V) {
    Random rng;
    random_seed(&rng, 1000 + N);
    size_t table = (size_t)V * C, acts = (size_t)N * C;
    int *tokens = (int *)host_alloc(N * sizeof(int));
    float *wte = host_floats(table), *expected = host_floats(acts), *got = host_floats(acts);
    random_tokens(&rng, tokens, N, V, 0, 0);
    fill_normal_bf16_values(&rng, wte, table, 0.0, 1.0);

    int *d_tokens = (int *)device_alloc(N * sizeof(int));
    cudaCheck(cudaMemcpy(d_tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    bf16 *d_wte = device_bf16_from(wte, table);
    bf16 *d_out = (bf16 *)device_alloc(acts * sizeof(bf16));
    poison_nan(d_out, acts * sizeof(bf16));
    embedding_forward(d_out, d_tokens, d_wte, N, C, 0);
    copy_bf16_to_host(got, d_out, acts);
    ref_embedding_forward(expected, tokens, wte, N, C);
    char name[128];
    snprintf(name, sizeof name, "embedding_forward N=%d C=%d V=%d copies rows exactly", N, C, V);
    check_close(name, got, expected, acts, 0.0, 0.0);

    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_wte));
    cudaCheck(cudaFree(d_out));
    free(tokens), free(wte), free(expected), free(got);
}

static void test_embedding_backward(int N, int C, int V, int hot_percent) {
    Random rng;
    random_seed(&rng, 2000 + N + hot_percent);
    size_t table = (size_t)V * C, acts = (size_t)N * C;
    int *tokens = (int *)host_alloc(N * sizeof(int));
    bf16 *dwte_bits = host_bf16s(table), *first_bits = host_bf16s(table), *second_bits = host_bf16s(table);
    float *dwte = host_floats(table), *dout = host_floats(acts), *got = host_floats(table);
    random_tokens(&rng, tokens, N, V, hot_percent, V / 2);
    fill_normal_bf16_values(&rng, dwte, table, 0.0, 1.0);
    fill_normal_bf16_values(&rng, dout, acts, 0.0, 1.0);
    convert_floats_to_bf16(dwte_bits, dwte, table);

    int *d_tokens = (int *)device_alloc(N * sizeof(int));
    cudaCheck(cudaMemcpy(d_tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    bf16 *d_dout = device_bf16_from(dout, acts);
    bf16 *d_dwte = (bf16 *)device_alloc(table * sizeof(bf16));
    size_t scratch_bytes = embedding_backward_scratch_bytes(N, C, V);
    void *d_scratch = device_alloc(scratch_bytes);
    bf16 *runs[2] = {first_bits, second_bits};
    for (int run = 0; run < 2; run++) {
        cudaCheck(cudaMemcpy(d_dwte, dwte_bits, table * sizeof(bf16), cudaMemcpyHostToDevice));
        poison_nan(d_scratch, scratch_bytes);
        embedding_backward(d_dwte, d_dout, d_tokens, N, C, V, d_scratch, 0);
        download_bf16(runs[run], d_dwte, table);
    }
    convert_bf16_to_floats(got, first_bits, table);
    ref_embedding_backward(dwte, dout, tokens, N, C);  // dwte now holds the expected result

    char name[160];
    snprintf(name, sizeof name, "embedding_backward N=%d C=%d V=%d hot=%d%% matches the reference", N, C, V,
             hot_percent);
    check_close(name, got, dwte, table, BF16_ATOL, BF16_RTOL);
    char *used = (char *)host_alloc((size_t)V);
    memset(used, 0, (size_t)V);
    for (int n = 0; n < N; n++) used[tokens[n]] = 1;
    int untouched_kept = 1;
    for (int v = 0; v < V; v++)
        if (!used[v])
            untouched_kept &= !memcmp(first_bits + (size_t)v * C, dwte_bits + (size_t)v * C, C * sizeof(bf16));
    check(untouched_kept, "embedding_backward N=%d C=%d V=%d hot=%d%%: rows of absent tokens are unchanged", N, C, V,
          hot_percent);
    check(!memcmp(first_bits, second_bits, table * sizeof(bf16)),
          "embedding_backward N=%d C=%d V=%d hot=%d%%: two runs are bitwise equal", N, C, V, hot_percent);

    cudaCheck(cudaFree(d_tokens));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_dwte));
    cudaCheck(cudaFree(d_scratch));
    free(tokens), free(dwte_bits), free(first_bits), free(second_bits);
    free(dwte), free(dout), free(got), free(used);
}

// ---- RMSNorm ---------------------------------------------------------------------------

static void test_rmsnorm_forward(int N, int C) {
    Random rng;
    random_seed(&rng, 3000 + N);
    size_t acts = (size_t)N * C;
    float *in = host_floats(acts), *weight = host_floats(C);
    float *expected = host_floats(acts), *got = host_floats(acts), *rstd = host_floats(N), *got_rstd = host_floats(N);
    fill_normal_bf16_values(&rng, in, acts, 0.3, 2.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);

    bf16 *d_in = device_bf16_from(in, acts), *d_weight = device_bf16_from(weight, C);
    bf16 *d_out = (bf16 *)device_alloc(acts * sizeof(bf16));
    float *d_rstd = (float *)device_alloc(N * sizeof(float));
    poison_nan(d_out, acts * sizeof(bf16));
    poison_nan(d_rstd, N * sizeof(float));
    rmsnorm_forward(d_out, d_rstd, d_in, d_weight, N, C, RMS_EPS, 0);
    copy_bf16_to_host(got, d_out, acts);
    download_floats(got_rstd, d_rstd, N);
    ref_rmsnorm_forward(expected, rstd, in, weight, N, C, RMS_EPS);

    char name[128];
    snprintf(name, sizeof name, "rmsnorm_forward N=%d C=%d output", N, C);
    check_close(name, got, expected, acts, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "rmsnorm_forward N=%d C=%d rstd", N, C);
    check_close(name, got_rstd, rstd, N, 0.0, RSTD_RTOL);

    cudaCheck(cudaFree(d_in));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_rstd));
    free(in), free(weight), free(expected), free(got), free(rstd), free(got_rstd);
}

// in_place: residual_out is the residual_in buffer, as a trainer may call it.
static void test_residual_rmsnorm_forward(int N, int C, int in_place) {
    Random rng;
    random_seed(&rng, 4000 + N + in_place);
    size_t acts = (size_t)N * C;
    float *residual = host_floats(acts), *branch = host_floats(acts), *weight = host_floats(C);
    float *sum = host_floats(acts), *expected = host_floats(acts), *rstd = host_floats(N);
    float *got_sum = host_floats(acts), *got = host_floats(acts), *got_rstd = host_floats(N);
    fill_normal_bf16_values(&rng, residual, acts, 0.0, 3.0);
    fill_normal_bf16_values(&rng, branch, acts, 0.0, 1.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);
    // The GPU adds in FP32 and rounds once to BF16: the same operations here give the same bits.
    for (size_t i = 0; i < acts; i++) sum[i] = round_to_bf16(residual[i] + branch[i]);

    bf16 *d_residual = device_bf16_from(residual, acts), *d_branch = device_bf16_from(branch, acts);
    bf16 *d_weight = device_bf16_from(weight, C);
    bf16 *d_residual_out = in_place ? d_residual : (bf16 *)device_alloc(acts * sizeof(bf16));
    bf16 *d_norm = (bf16 *)device_alloc(acts * sizeof(bf16));
    float *d_rstd = (float *)device_alloc(N * sizeof(float));
    if (!in_place) poison_nan(d_residual_out, acts * sizeof(bf16));
    poison_nan(d_norm, acts * sizeof(bf16));
    poison_nan(d_rstd, N * sizeof(float));
    residual_rmsnorm_forward(d_residual_out, d_norm, d_rstd, d_residual, d_branch, d_weight, N, C, RMS_EPS, 0);
    copy_bf16_to_host(got_sum, d_residual_out, acts);
    copy_bf16_to_host(got, d_norm, acts);
    download_floats(got_rstd, d_rstd, N);
    ref_rmsnorm_forward(expected, rstd, sum, weight, N, C, RMS_EPS);

    const char *mode = in_place ? " in place" : "";
    char name[128];
    snprintf(name, sizeof name, "residual_rmsnorm_forward%s N=%d C=%d residual sum is exact", mode, N, C);
    check_close(name, got_sum, sum, acts, 0.0, 0.0);
    snprintf(name, sizeof name, "residual_rmsnorm_forward%s N=%d C=%d norm of the rounded sum", mode, N, C);
    check_close(name, got, expected, acts, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "residual_rmsnorm_forward%s N=%d C=%d rstd", mode, N, C);
    check_close(name, got_rstd, rstd, N, 0.0, RSTD_RTOL);

    cudaCheck(cudaFree(d_residual));
    cudaCheck(cudaFree(d_branch));
    cudaCheck(cudaFree(d_weight));
    if (!in_place) cudaCheck(cudaFree(d_residual_out));
    cudaCheck(cudaFree(d_norm));
    cudaCheck(cudaFree(d_rstd));
    free(residual), free(branch), free(weight);
    free(sum), free(expected), free(rstd), free(got_sum), free(got), free(got_rstd);
}

static void test_rmsnorm_backward(int N, int C) {
    Random rng;
    random_seed(&rng, 5000 + N);
    size_t acts = (size_t)N * C;
    float *in = host_floats(acts), *dout = host_floats(acts), *din = host_floats(acts), *weight = host_floats(C);
    float *dweight = host_floats(C), *normed = host_floats(acts), *rstd = host_floats(N);
    float *got_din = host_floats(acts), *got_dweight = host_floats(C);
    bf16 *din_runs[2] = {host_bf16s(acts), host_bf16s(acts)}, *dweight_runs[2] = {host_bf16s(C), host_bf16s(C)};
    fill_normal_bf16_values(&rng, in, acts, 0.3, 2.0);
    fill_normal_bf16_values(&rng, dout, acts, 0.0, 1.0);
    fill_normal_bf16_values(&rng, din, acts, 0.0, 1.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);
    fill_normal_bf16_values(&rng, dweight, C, 0.0, 1.0);
    ref_rmsnorm_forward(normed, rstd, in, weight, N, C, RMS_EPS);  // both sides use these rstd

    bf16 *d_in = device_bf16_from(in, acts), *d_dout = device_bf16_from(dout, acts);
    bf16 *d_weight = device_bf16_from(weight, C);
    bf16 *d_din = (bf16 *)device_alloc(acts * sizeof(bf16)), *d_dweight = (bf16 *)device_alloc(C * sizeof(bf16));
    float *d_rstd = (float *)device_alloc(N * sizeof(float));
    cudaCheck(cudaMemcpy(d_rstd, rstd, N * sizeof(float), cudaMemcpyHostToDevice));
    size_t scratch_bytes = rmsnorm_backward_scratch_bytes(N, C);
    float *d_scratch = (float *)device_alloc(scratch_bytes);
    for (int run = 0; run < 2; run++) {
        copy_bf16_to_device(d_din, din, acts);
        copy_bf16_to_device(d_dweight, dweight, C);
        poison_nan(d_scratch, scratch_bytes);
        rmsnorm_backward(d_din, d_dweight, d_scratch, d_dout, d_in, d_weight, d_rstd, N, C, 0);
        download_bf16(din_runs[run], d_din, acts);
        download_bf16(dweight_runs[run], d_dweight, C);
    }
    convert_bf16_to_floats(got_din, din_runs[0], acts);
    convert_bf16_to_floats(got_dweight, dweight_runs[0], C);
    ref_rmsnorm_backward(din, dweight, dout, in, weight, rstd, N, C);  // accumulates: din, dweight now expected

    char name[128];
    snprintf(name, sizeof name, "rmsnorm_backward N=%d C=%d din (accumulated)", N, C);
    check_close(name, got_din, din, acts, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "rmsnorm_backward N=%d C=%d dweight (accumulated)", N, C);
    check_close(name, got_dweight, dweight, C, BF16_ATOL, BF16_RTOL);
    check(!memcmp(din_runs[0], din_runs[1], acts * sizeof(bf16)) &&
              !memcmp(dweight_runs[0], dweight_runs[1], C * sizeof(bf16)),
          "rmsnorm_backward N=%d C=%d: two runs are bitwise equal", N, C);

    cudaCheck(cudaFree(d_in));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_din));
    cudaCheck(cudaFree(d_dweight));
    cudaCheck(cudaFree(d_rstd));
    cudaCheck(cudaFree(d_scratch));
    free(in), free(dout), free(din), free(weight), free(dweight), free(normed), free(rstd);
    free(got_din), free(got_dweight);
    for (int run = 0; run < 2; run++) free(din_runs[run]), free(dweight_runs[run]);
}

// ---- RoPE ------------------------------------------------------------------------------

static ModelShape rope_shape(int n_heads, int n_kv_heads, int head_dim, int llama31_scaling) {
    ModelShape shape;
    memset(&shape, 0, sizeof shape);
    shape.dim = n_heads * head_dim;
    shape.n_heads = n_heads;
    shape.n_kv_heads = n_kv_heads;
    shape.rope_theta = llama31_scaling ? 500000.0f : 10000.0f;
    if (llama31_scaling) {  // Llama 3.1's published values
        shape.rope_scaling_factor = 8.0f;
        shape.rope_low_freq_factor = 1.0f;
        shape.rope_high_freq_factor = 4.0f;
        shape.rope_original_max_seq_len = 8192;
    }
    return shape;
}

static void test_rope_table(int T, int head_dim, int llama31_scaling) {
    ModelShape shape = rope_shape(4, 4, head_dim, llama31_scaling);
    size_t n = (size_t)T * head_dim / 2;
    float *cos_got = host_floats(n), *sin_got = host_floats(n), *cos_ref = host_floats(n), *sin_ref = host_floats(n);
    rope_table_init(cos_got, sin_got, T, &shape);
    ref_rope_table(cos_ref, sin_ref, T, &shape);
    char name[128];
    snprintf(name, sizeof name, "rope_table_init T=%d head_dim=%d scaling=%d cos", T, head_dim, llama31_scaling);
    check_close(name, cos_got, cos_ref, n, 1e-6, 0.0);
    snprintf(name, sizeof name, "rope_table_init T=%d head_dim=%d scaling=%d sin", T, head_dim, llama31_scaling);
    check_close(name, sin_got, sin_ref, n, 1e-6, 0.0);
    free(cos_got), free(sin_got), free(cos_ref), free(sin_ref);
}

// The forward on a random packed qkv: q and k against the reference and bitwise against rope_rotate
// on the host (what the attention backward's rotation is checked against too), v untouched.
static void test_rope(int B, int T, int n_heads, int n_kv_heads, int head_dim, int llama31_scaling) {
    Random rng;
    random_seed(&rng, 6000 + T);
    ModelShape shape = rope_shape(n_heads, n_kv_heads, head_dim, llama31_scaling);
    int total_heads = n_heads + 2 * n_kv_heads, half = head_dim / 2;
    size_t rows = (size_t)B * T, packed = rows * total_heads * head_dim, half_table = (size_t)T * half;
    size_t q_size = rows * n_heads * head_dim, kv_size = rows * n_kv_heads * head_dim;
    float *cos_table = host_floats(half_table), *sin_table = host_floats(half_table);
    rope_table_init(cos_table, sin_table, T, &shape);
    bf16 *qkv_bits = host_bf16s(packed), *result_bits = host_bf16s(packed);
    float *qkv = host_floats(packed), *got = host_floats(packed);
    float *q = host_floats(q_size), *q_ref = host_floats(q_size), *q_got = host_floats(q_size);
    float *k = host_floats(kv_size), *k_ref = host_floats(kv_size), *k_got = host_floats(kv_size);
    fill_normal_bf16_values(&rng, qkv, packed, 0.0, 1.0);
    convert_floats_to_bf16(qkv_bits, qkv, packed);

    float *d_cos = (float *)device_alloc(half_table * sizeof(float));
    float *d_sin = (float *)device_alloc(half_table * sizeof(float));
    cudaCheck(cudaMemcpy(d_cos, cos_table, half_table * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d_sin, sin_table, half_table * sizeof(float), cudaMemcpyHostToDevice));
    bf16 *d_qkv = (bf16 *)device_alloc(packed * sizeof(bf16));
    cudaCheck(cudaMemcpy(d_qkv, qkv_bits, packed * sizeof(bf16), cudaMemcpyHostToDevice));
    rope_forward(d_qkv, d_cos, d_sin, B, T, n_heads, n_kv_heads, head_dim, 0);
    download_bf16(result_bits, d_qkv, packed);
    convert_bf16_to_floats(got, result_bits, packed);

    gather_heads(q, qkv, rows, total_heads, 0, n_heads, head_dim);
    gather_heads(k, qkv, rows, total_heads, n_heads, n_kv_heads, head_dim);
    ref_rope_forward(q_ref, q, cos_table, sin_table, B, T, n_heads, head_dim);
    ref_rope_forward(k_ref, k, cos_table, sin_table, B, T, n_kv_heads, head_dim);
    gather_heads(q_got, got, rows, total_heads, 0, n_heads, head_dim);
    gather_heads(k_got, got, rows, total_heads, n_heads, n_kv_heads, head_dim);

    char name[160];
    snprintf(name, sizeof name, "rope_forward B=%d T=%d heads=%d/%d head_dim=%d scaling=%d q", B, T, n_heads,
             n_kv_heads, head_dim, llama31_scaling);
    check_close(name, q_got, q_ref, q_size, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "rope_forward B=%d T=%d heads=%d/%d head_dim=%d scaling=%d k", B, T, n_heads,
             n_kv_heads, head_dim, llama31_scaling);
    check_close(name, k_got, k_ref, kv_size, BF16_ATOL, BF16_RTOL);
    size_t row_width = (size_t)total_heads * head_dim, v_begin = (size_t)(n_heads + n_kv_heads) * head_dim;
    int v_kept = 1, same_bits = 1;
    for (size_t r = 0; r < rows; r++) {
        v_kept &= !memcmp(result_bits + r * row_width + v_begin, qkv_bits + r * row_width + v_begin,
                          (row_width - v_begin) * sizeof(bf16));
        const float *c = cos_table + (r % T) * half, *sn = sin_table + (r % T) * half;
        for (size_t at = 0; at < v_begin; at += head_dim)
            for (int i = 0; i < half; i++) {
                const size_t x = r * row_width + at + i;
                const float2 rotated = rope_rotate(qkv[x], qkv[x + half], c[i], sn[i]);
                same_bits &= __bfloat16_as_ushort(result_bits[x]) == __bfloat16_as_ushort(__float2bfloat16(rotated.x)) &&
                             __bfloat16_as_ushort(result_bits[x + half]) == __bfloat16_as_ushort(__float2bfloat16(rotated.y));
            }
    }
    check(v_kept, "rope_forward B=%d T=%d heads=%d/%d head_dim=%d: v heads are untouched", B, T, n_heads, n_kv_heads,
          head_dim);
    check(same_bits, "rope_forward B=%d T=%d heads=%d/%d head_dim=%d: every bit as rope_rotate on the host", B, T,
          n_heads, n_kv_heads, head_dim);

    cudaCheck(cudaFree(d_cos));
    cudaCheck(cudaFree(d_sin));
    cudaCheck(cudaFree(d_qkv));
    free(cos_table), free(sin_table), free(qkv_bits), free(result_bits), free(qkv), free(got);
    free(q), free(k), free(q_ref), free(k_ref), free(q_got), free(k_got);
}

// ---- SwiGLU ----------------------------------------------------------------------------

static void test_swiglu(int N, int I) {
    Random rng;
    random_seed(&rng, 7000 + N);
    size_t n = (size_t)N * I;
    bf16 *dgate_up_runs[2] = {host_bf16s(2 * n), host_bf16s(2 * n)};
    float *gate_up = host_floats(2 * n), *dout = host_floats(n), *gate = host_floats(n), *up = host_floats(n);
    float *expected = host_floats(n), *got = host_floats(n), *dgate = host_floats(n), *dup = host_floats(n);
    float *expected_dgate_up = host_floats(2 * n), *got_dgate_up = host_floats(2 * n);
    // Gate values out to +-9 reach both flat ends of the sigmoid.
    fill_normal_bf16_values(&rng, gate_up, 2 * n, 0.0, 3.0);
    fill_normal_bf16_values(&rng, dout, n, 0.0, 1.0);
    for (int r = 0; r < N; r++) {
        memcpy(gate + (size_t)r * I, gate_up + (size_t)r * 2 * I, I * sizeof(float));
        memcpy(up + (size_t)r * I, gate_up + (size_t)r * 2 * I + I, I * sizeof(float));
    }

    bf16 *d_gate_up = device_bf16_from(gate_up, 2 * n), *d_dout = device_bf16_from(dout, n);
    bf16 *d_out = (bf16 *)device_alloc(n * sizeof(bf16)), *d_dgate_up = (bf16 *)device_alloc(2 * n * sizeof(bf16));
    poison_nan(d_out, n * sizeof(bf16));
    swiglu_forward(d_out, d_gate_up, N, I, 0);
    copy_bf16_to_host(got, d_out, n);
    for (int run = 0; run < 2; run++) {
        poison_nan(d_dgate_up, 2 * n * sizeof(bf16));
        swiglu_backward(d_dgate_up, d_dout, d_gate_up, N, I, 0);
        download_bf16(dgate_up_runs[run], d_dgate_up, 2 * n);
    }
    convert_bf16_to_floats(got_dgate_up, dgate_up_runs[0], 2 * n);

    ref_swiglu_forward(expected, gate, up, n);
    memset(dgate, 0, n * sizeof(float));
    memset(dup, 0, n * sizeof(float));
    ref_swiglu_backward(dgate, dup, dout, gate, up, n);
    for (int r = 0; r < N; r++) {
        memcpy(expected_dgate_up + (size_t)r * 2 * I, dgate + (size_t)r * I, I * sizeof(float));
        memcpy(expected_dgate_up + (size_t)r * 2 * I + I, dup + (size_t)r * I, I * sizeof(float));
    }

    char name[128];
    snprintf(name, sizeof name, "swiglu_forward N=%d I=%d", N, I);
    check_close(name, got, expected, n, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "swiglu_backward N=%d I=%d dgate and dup", N, I);
    check_close(name, got_dgate_up, expected_dgate_up, 2 * n, BF16_ATOL, BF16_RTOL);
    check(!memcmp(dgate_up_runs[0], dgate_up_runs[1], 2 * n * sizeof(bf16)),
          "swiglu_backward N=%d I=%d: two runs are bitwise equal", N, I);

    cudaCheck(cudaFree(d_gate_up));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_dgate_up));
    free(dgate_up_runs[0]), free(dgate_up_runs[1]);
    free(gate_up), free(dout), free(gate), free(up), free(expected), free(got), free(dgate), free(dup);
    free(expected_dgate_up), free(got_dgate_up);
}

// ---- timings at llama-1b sizes (informational) -------------------------------------------

#define BENCH_WARMUP 3
#define BENCH_REPEATS 21

static bf16 *device_random_bf16(size_t n, uint64_t seed) {
    bf16 *x = (bf16 *)device_alloc(n * sizeof(bf16));
    fill_uniform_bf16_kernel<<<1024, 256>>>(x, n, seed);
    cudaCheckLaunch();
    return x;
}

typedef struct {
    int B, T, N, C, I, V, n_heads, n_kv_heads, head_dim;
    int *tokens;
    bf16 *wte, *dwte, *weight, *dweight, *act_a, *act_b, *act_c, *act_d, *qkv, *gate_up, *dgate_up, *mlp_out;
    float *rstd, *cos_table, *sin_table, *rmsnorm_scratch;
    void *embedding_scratch;
    // COAT: the 1x16 copies of gate_up and of the norm input, the amax slots, FP8 cast outputs
    Fp8Groups gate_up_copy, norm_in_copy;
    Fp8Scale *out_slot, *grad_slot, *norm_slot;
    uint8_t *fp8_codes, *fp8_codes_t;  // [N, 2I] each
} Bench;

static void bench_embedding_forward(const Bench *b) { embedding_forward(b->act_a, b->tokens, b->wte, b->N, b->C, 0); }
static void bench_embedding_backward(const Bench *b) {
    embedding_backward(b->dwte, b->act_a, b->tokens, b->N, b->C, b->V, b->embedding_scratch, 0);
}
static void bench_rmsnorm_forward(const Bench *b) {
    rmsnorm_forward(b->act_b, b->rstd, b->act_a, b->weight, b->N, b->C, RMS_EPS, 0);
}
static void bench_residual_rmsnorm_forward(const Bench *b) {
    residual_rmsnorm_forward(b->act_c, b->act_b, b->rstd, b->act_a, b->act_d, b->weight, b->N, b->C, RMS_EPS, 0);
}
static void bench_rmsnorm_backward(const Bench *b) {
    rmsnorm_backward(b->act_c, b->dweight, b->rmsnorm_scratch, b->act_b, b->act_a, b->weight, b->rstd, b->N, b->C, 0);
}
static void bench_rope_forward(const Bench *b) {
    rope_forward(b->qkv, b->cos_table, b->sin_table, b->B, b->T, b->n_heads, b->n_kv_heads, b->head_dim, 0);
}
static void bench_swiglu_forward(const Bench *b) { swiglu_forward(b->mlp_out, b->gate_up, b->N, b->I, 0); }
static void bench_swiglu_backward(const Bench *b) {
    swiglu_backward(b->dgate_up, b->mlp_out, b->gate_up, b->N, b->I, 0);
}

// The COAT forms that the llama-1b coat step runs: from and into the 1x16 copies, gathering amax,
// no BF16 output where an FP8 cast recomputes it.
static void bench_coat_swiglu_forward(const Bench *b) {
    swiglu_forward(NULL, b->gate_up, b->N, b->I, 0, b->gate_up_copy, b->out_slot);
}
static void bench_coat_swiglu_forward_cast(const Bench *b) {
    swiglu_forward_cast(b->fp8_codes, b->fp8_codes_t, b->out_slot, b->gate_up, b->gate_up_copy, b->N, b->I, 0);
}
static void bench_coat_swiglu_backward(const Bench *b) {
    swiglu_backward(NULL, b->mlp_out, b->gate_up, b->N, b->I, 0, b->gate_up_copy, b->grad_slot);
}
static void bench_coat_swiglu_backward_cast(const Bench *b) {
    swiglu_backward_cast(b->fp8_codes, b->fp8_codes_t, b->grad_slot, b->mlp_out, b->gate_up, b->gate_up_copy, b->N, b->I, 0);
}
static void bench_coat_rmsnorm_backward(const Bench *b) {
    rmsnorm_backward(b->act_c, b->dweight, b->rmsnorm_scratch, b->act_b, b->act_a, b->weight, b->rstd, b->N, b->C, 0,
                     b->norm_in_copy, b->norm_slot);
}

// Median time over BENCH_REPEATS launches after a warm-up; GB/s counts each byte the kernel
// must read or write once.
static void bench_kernel(const char *name, void (*launch)(const Bench *), const Bench *b, double bytes) {
    float median_ms = median_event_ms(BENCH_WARMUP, BENCH_REPEATS, [&] { launch(b); });
    printf("time %-26s %9.1f us %8.0f GB/s\n", name, median_ms * 1e3, bytes / (median_ms * 1e-3) / 1e9);
}

static void benchmark_llama_1b(void) {
    Bench b;
    b.B = 16, b.T = 2048, b.N = b.B * b.T, b.C = 2048, b.I = 5632, b.V = 32000;
    b.n_heads = 32, b.n_kv_heads = 8, b.head_dim = 64;
    size_t N = (size_t)b.N, C = (size_t)b.C, I = (size_t)b.I, V = (size_t)b.V;
    size_t qkv_width = (size_t)(b.n_heads + 2 * b.n_kv_heads) * b.head_dim;

    Random rng;
    random_seed(&rng, 8000);
    int *tokens = (int *)host_alloc(N * sizeof(int));
    random_tokens(&rng, tokens, b.N, b.V, 0, 0);
    char *used = (char *)host_alloc(V);
    memset(used, 0, V);
    size_t distinct_tokens = 0;
    for (size_t n = 0; n < N; n++) {
        if (!used[tokens[n]]) distinct_tokens++;
        used[tokens[n]] = 1;
    }
    b.tokens = (int *)device_alloc(N * sizeof(int));
    cudaCheck(cudaMemcpy(b.tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));

    b.wte = device_random_bf16(V * C, 1), b.dwte = device_random_bf16(V * C, 2);
    b.weight = device_random_bf16(C, 3), b.dweight = device_random_bf16(C, 4);
    b.act_a = device_random_bf16(N * C, 5), b.act_b = device_random_bf16(N * C, 6);
    b.act_c = device_random_bf16(N * C, 7), b.act_d = device_random_bf16(N * C, 8);
    b.qkv = device_random_bf16(N * qkv_width, 9);
    b.gate_up = device_random_bf16(N * 2 * I, 10), b.dgate_up = device_random_bf16(N * 2 * I, 11);
    b.mlp_out = device_random_bf16(N * I, 12);
    b.rstd = (float *)device_alloc(N * sizeof(float));
    rmsnorm_forward(b.act_b, b.rstd, b.act_a, b.weight, b.N, b.C, RMS_EPS, 0);  // realistic rstd for backward
    ModelShape shape = rope_shape(b.n_heads, b.n_kv_heads, b.head_dim, 0);
    size_t half_table = (size_t)b.T * b.head_dim / 2;
    float *cos_host = host_floats(half_table), *sin_host = host_floats(half_table);
    rope_table_init(cos_host, sin_host, b.T, &shape);
    b.cos_table = (float *)device_alloc(half_table * sizeof(float));
    b.sin_table = (float *)device_alloc(half_table * sizeof(float));
    cudaCheck(cudaMemcpy(b.cos_table, cos_host, half_table * sizeof(float), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(b.sin_table, sin_host, half_table * sizeof(float), cudaMemcpyHostToDevice));
    b.rmsnorm_scratch = (float *)device_alloc(rmsnorm_backward_scratch_bytes(b.N, b.C));
    b.embedding_scratch = device_alloc(embedding_backward_scratch_bytes(b.N, b.C, b.V));
    b.gate_up_copy = Fp8Groups{(uint8_t *)device_alloc(N * 2 * I), (bf16 *)device_alloc(N * 2 * I / FP8_GROUP * sizeof(bf16))};
    b.norm_in_copy = Fp8Groups{(uint8_t *)device_alloc(N * C), (bf16 *)device_alloc(N * C / FP8_GROUP * sizeof(bf16))};
    b.out_slot = (Fp8Scale *)device_alloc(3 * sizeof(Fp8Scale)), b.grad_slot = b.out_slot + 1, b.norm_slot = b.out_slot + 2;
    cudaCheck(cudaMemset(b.out_slot, 0, 3 * sizeof(Fp8Scale)));
    b.fp8_codes = (uint8_t *)device_alloc(N * 2 * I), b.fp8_codes_t = (uint8_t *)device_alloc(N * 2 * I);
    // The copies and amax slots as the step has them when the casts run.
    bench_coat_swiglu_forward(&b);
    bench_coat_swiglu_backward(&b);
    residual_rmsnorm_forward(NULL, b.act_d, b.rstd, b.act_a, NULL, b.weight, b.N, b.C, RMS_EPS, 0, b.norm_in_copy);
    cudaCheck(cudaDeviceSynchronize());

    double act = (double)N * C * 2, rotated = (double)N * (b.n_heads + b.n_kv_heads) * b.head_dim * 2;
    double mlp = (double)N * I * 2;
    printf("timings at llama-1b sizes: N=%d C=%d I=%d V=%d heads=%d/%d head_dim=%d (%zu distinct tokens)\n", b.N,
           b.C, b.I, b.V, b.n_heads, b.n_kv_heads, b.head_dim, distinct_tokens);
    bench_kernel("embedding_forward", bench_embedding_forward, &b, 2 * act);
    bench_kernel("embedding_backward", bench_embedding_backward, &b, act + 2.0 * distinct_tokens * C * 2);
    bench_kernel("rmsnorm_forward", bench_rmsnorm_forward, &b, 2 * act);
    bench_kernel("residual_rmsnorm_forward", bench_residual_rmsnorm_forward, &b, 4 * act);
    bench_kernel("rmsnorm_backward", bench_rmsnorm_backward, &b, 4 * act);
    bench_kernel("rope_forward", bench_rope_forward, &b, 2 * rotated);
    bench_kernel("swiglu_forward", bench_swiglu_forward, &b, 3 * mlp);
    bench_kernel("swiglu_backward", bench_swiglu_backward, &b, 5 * mlp);
    // COAT: E4M3 codes 1 byte and BF16 scales 1/8 byte per value; FP8 outputs 1 byte
    double codes = 1.125 * mlp;  // the 1x16 copy of gate_up [N, 2I]
    bench_kernel("coat swiglu_forward", bench_coat_swiglu_forward, &b, 2 * mlp + codes);
    bench_kernel("coat swiglu_forward_cast", bench_coat_swiglu_forward_cast, &b, codes + mlp);
    bench_kernel("coat swiglu_backward", bench_coat_swiglu_backward, &b, codes + mlp);
    bench_kernel("coat swiglu_backward_cast", bench_coat_swiglu_backward_cast, &b, codes + mlp + 2 * mlp);
    bench_kernel("coat rmsnorm_backward", bench_coat_rmsnorm_backward, &b, act / 2 * 1.125 + 3 * act);

    void *buffers[] = {b.tokens, b.wte, b.dwte, b.weight, b.dweight, b.act_a, b.act_b, b.act_c, b.act_d, b.qkv,
                       b.gate_up, b.dgate_up, b.mlp_out, b.rstd, b.cos_table, b.sin_table, b.rmsnorm_scratch,
                       b.embedding_scratch, b.gate_up_copy.codes, b.gate_up_copy.scales, b.norm_in_copy.codes,
                       b.norm_in_copy.scales, b.out_slot, b.fp8_codes, b.fp8_codes_t};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) cudaCheck(cudaFree(buffers[i]));
    free(tokens), free(used), free(cos_host), free(sin_host);
}

int main(void) {
    cudaCheck(cudaSetDevice(0));

    test_embedding_forward(1001, 1000, 97);
    test_embedding_forward(5, 24, 4);
    // Runs inside one chunk and across chunk boundaries, mostly single tokens, one run across
    // dozens of chunks, and a single token everywhere (one run over all chunks).
    test_embedding_backward(1001, 1000, 97, 0);
    test_embedding_backward(777, 768, 8000, 0);
    test_embedding_backward(2049, 64, 50, 60);
    test_embedding_backward(300, 2056, 3, 100);
    test_embedding_backward(5, 24, 4, 0);

    test_rmsnorm_forward(257, 768);
    test_rmsnorm_forward(33, 1000);
    test_rmsnorm_forward(1, 8);
    test_residual_rmsnorm_forward(257, 768, 0);
    test_residual_rmsnorm_forward(33, 1000, 1);
    test_rmsnorm_backward(257, 768);
    test_rmsnorm_backward(33, 1000);
    test_rmsnorm_backward(130, 8000);  // two vectors per thread
    test_rmsnorm_backward(66, 4096);   // 512 threads a block (llama2-7b's dim)
    test_rmsnorm_backward(1, 8);

    test_rope_table(37, 64, 0);
    test_rope_table(1000, 128, 1);
    test_rope(2, 37, 12, 4, 64, 0);
    test_rope(1, 129, 8, 2, 128, 1);
    test_rope(3, 5, 4, 4, 16, 0);

    test_swiglu(257, 1000);
    test_swiglu(3, 2048);
    test_swiglu(31, 5632);

    benchmark_llama_1b();
    return check_summary("test_kernels");
}
