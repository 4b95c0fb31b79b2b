// GPU tests of the FP8 (COAT) forms of the RMSNorm and SwiGLU kernels (coat/README.md, Scaling)
// against host references written here in plain C from the kernels' header comments:
//   1x16 copy:  per 16 consecutive values of a row, scale = bf16((max |x| + 1e-10f) / 448) and
//               code = e4m3_satfinite(x / scale); the kernel then computes from decode(code) * scale
//   amax slot:  max |y| over the BF16 values y that the kernel stores (or would store), bit for bit
//   cast pass:  slot->scale = (amax + 1e-10f) / max, codes fp8_satfinite(x / scale)
// Checks:
//   1. residual_rmsnorm_forward, N = 37 rows, C = 128, 352, 2048, with a branch and with NULL: with
//      the 1x16 copy and norm_amax, the BF16 sum exact, codes and scales bit for bit, rstd and
//      norm_out against the norm of the dequantized sum, amax = max |norm_out|; with norm_amax
//      only, the same against the norm of the BF16 sum.
//   2. rmsnorm_backward reading the 1x16 input, with din_amax: din (accumulated onto non-zero
//      values) and dweight against the reference from the dequantized x, amax = max |din|.
//   3. swiglu_forward with gate_up_copy and out_amax: the copy bit for bit (the gate half's groups,
//      then the up half's), out = silu(g) * u of the dequantized g, u, amax = max |out|; with
//      out == NULL the same copy and amax.
//   4. swiglu_backward from the 1x16 copy with dgate_up_amax: dgate_up, amax = max |dgate_up|; with
//      dgate_up == NULL the same amax.
//   5. swiglu_forward_cast and swiglu_backward_cast, from BF16 gate_up and from its copy, equal
//      fp8_quantize of the BF16 tensor that swiglu_forward / swiglu_backward stored, with that run's
//      amax: codes and transposed codes bit for bit, and the transposed codes are the transpose.
//   6. After those casts, slot->scale = (amax + 1e-10f) / max bit for bit, the amax untouched.
//   7. residual_rmsnorm_forward with no output gathers the same amax and rstd as with one, and
//      rmsnorm_output_cast from the BF16 sum or its 1x16 copy equals fp8_quantize of the stored
//      norm_out as in 5 and 6.
// Outputs are poisoned first (NaN bytes; the fused casts 0xAB, the casts they are compared with
// 0x54), so an element left unwritten fails; the 1x16 paths get a NaN-filled BF16 input in place
// of the one they must not read.
#include <stdint.h>
#include <string.h>
#include "../coat/fp8.cuh"
#include "../coat/random.h"
#include "../coat/rmsnorm.cuh"
#include "../coat/swiglu.cuh"
#include "check.h"
#include "gpu_test_util.cuh"
extern "C" {
#include "reference_llama.h"
}

#define SEED 20241029ull
#define RMS_EPS 1e-5f
// The kernels round their FP32 result once to BF16 (at most 2^-8 of it); their FP32 rstd, product
// and exponential differ from the double reference by ~1e-6 of it: one BF16 ulp, 2^-7, covers both.
#define ONE_BF16_ULP 0x1p-7
#define TINY_ATOL 1e-30
#define RSTD_RTOL 1e-5  // FP32 sum of at most ~10^4 squares against a double sum
// Backward passes, as in test_kernels.cu: a few BF16 roundings, and atol for results near zero
// that come out of cancelling O(1) terms.
#define BF16_ATOL 1e-2
#define BF16_RTOL 1e-2
#define POISON_FUSED 0xAB   // the outputs of the fused casts
#define POISON_STORED 0x54  // the outputs of fp8_quantize of the stored BF16 tensor

// ---- host reference of E4M3 and of the 1x16 copy -------------------------------------------

// Finite x: round to nearest even, saturate to +-448. Above the smallest normal exponent -6 the
// value is n steps of 2^(binade - 3), n in [8, 16] (16 carries into the next exponent); below, n
// steps of 2^-9 (subnormals, code n). The code is ((binade + 6) << 3) + n.
static uint8_t e4m3_encode(float x) {
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7e;
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e);  // a in [2^(e-1), 2^e)
    int binade = e - 1 > -6 ? e - 1 : -6;
    int n = (int)rintf(ldexpf(a, 3 - binade));
    return sign | (uint8_t)(((binade + 6) << 3) + n);
}

// Finite codes (not S.1111.111): exponent bias 7, 3 mantissa bits, subnormals at exponent 0.
static float e4m3_decode(uint8_t code) {
    int exponent = (code >> 3) & 15, mantissa = code & 7;
    float magnitude = exponent == 0 ? ldexpf((float)mantissa, -9) : ldexpf((float)(8 + mantissa), exponent - 10);
    return code & 0x80 ? -magnitude : magnitude;
}

typedef struct {
    uint8_t *codes;  // [n]
    bf16 *scales;    // [n / 16], as stored
    float *values;   // [n], decode(code) * scale: what the kernels compute from
} HostGroups;

// The 1x16 copy of x [n], n a multiple of 16: groups are 16 consecutive values.
static HostGroups host_quantize_groups(const float *x, size_t n) {
    HostGroups g = {(uint8_t *)host_alloc(n), host_bf16s(n / FP8_GROUP), host_floats(n)};
    for (size_t group = 0; group < n / FP8_GROUP; group++) {
        const float *v = x + group * FP8_GROUP;
        float group_max = 0.0f;
        for (int j = 0; j < FP8_GROUP; j++) group_max = fmaxf(group_max, fabsf(v[j]));
        g.scales[group] = __float2bfloat16((group_max + 1e-10f) / 448.0f);
        float scale = __bfloat162float(g.scales[group]);
        for (int j = 0; j < FP8_GROUP; j++) {
            size_t i = group * FP8_GROUP + j;
            g.codes[i] = e4m3_encode(v[j] / scale);
            g.values[i] = e4m3_decode(g.codes[i]) * scale;
        }
    }
    return g;
}

static void free_host_groups(HostGroups *g) { free(g->codes), free(g->scales), free(g->values); }

// gate_up [N, 2I] (each row the I gate values, then the I up values) <-> gate, up [N, I].
static void split_gate_up(float *gate, float *up, const float *gate_up, int N, int I) {
    for (size_t r = 0; r < (size_t)N; r++) {
        memcpy(gate + r * I, gate_up + r * 2 * I, I * sizeof(float));
        memcpy(up + r * I, gate_up + r * 2 * I + I, I * sizeof(float));
    }
}
static void join_gate_up(float *gate_up, const float *gate, const float *up, int N, int I) {
    for (size_t r = 0; r < (size_t)N; r++) {
        memcpy(gate_up + r * 2 * I, gate + r * I, I * sizeof(float));
        memcpy(gate_up + r * 2 * I + I, up + r * I, I * sizeof(float));
    }
}

// ---- device buffers ---------------------------------------------------------------------

static void *device_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}
static void *device_poisoned(size_t bytes, int poison) {
    void *p = device_alloc(bytes);
    cudaCheck(cudaMemset(p, poison, bytes));
    return p;
}
static void *device_nan(size_t bytes) { return device_poisoned(bytes, 0xFF); }  // NaN in BF16, FP32 and E4M3
static void *host_copy_of(const void *device, size_t bytes) {
    void *p = host_alloc(bytes);
    cudaCheck(cudaMemcpy(p, device, bytes, cudaMemcpyDeviceToHost));  // also waits for the kernels before it
    return p;
}

static Fp8Scale *device_zero_slot(void) { return (Fp8Scale *)device_poisoned(sizeof(Fp8Scale), 0); }
static Fp8Scale download_slot(const Fp8Scale *d_slot) {
    Fp8Scale slot;
    cudaCheck(cudaMemcpy(&slot, d_slot, sizeof slot, cudaMemcpyDeviceToHost));
    return slot;
}

// A 1x16 copy of n values for a kernel to write, NaN codes and scales.
static Fp8Groups device_groups_nan(size_t n) {
    return Fp8Groups{(uint8_t *)device_nan(n), (bf16 *)device_nan(n / FP8_GROUP * sizeof(bf16))};
}
static Fp8Groups device_groups_from(const HostGroups *g, size_t n) {
    Fp8Groups d = device_groups_nan(n);
    cudaCheck(cudaMemcpy(d.codes, g->codes, n, cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(d.scales, g->scales, n / FP8_GROUP * sizeof(bf16), cudaMemcpyHostToDevice));
    return d;
}
static void free_device_groups(Fp8Groups g) {
    cudaCheck(cudaFree(g.codes));
    cudaCheck(cudaFree(g.scales));
}

static float *download_bf16_values(const bf16 *device, size_t n) {
    float *host = host_floats(n);
    copy_bf16_to_host(host, device, n);
    return host;
}

// ---- comparisons ------------------------------------------------------------------------

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

// got against expected, n elements of `width` bytes (1 or 2) each, bit for bit.
static void check_bits_equal(const char *name, const void *got, const void *expected, size_t n, size_t width) {
    if (memcmp(got, expected, n * width) == 0) {
        check(1, "%s (n=%zu, bit for bit)", name, n);
        return;
    }
    const uint8_t *g = (const uint8_t *)got, *e = (const uint8_t *)expected;
    size_t differ = 0, first = 0;
    for (size_t i = 0; i < n; i++)
        if (memcmp(g + i * width, e + i * width, width) != 0 && differ++ == 0) first = i;
    uint32_t expected_bits = 0, got_bits = 0;
    memcpy(&expected_bits, e + first * width, width);
    memcpy(&got_bits, g + first * width, width);
    check(0, "%s: %zu of %zu differ; first at %zu: expected 0x%0*x got 0x%0*x", name, differ, n, first,
          (int)(2 * width), expected_bits, (int)(2 * width), got_bits);
}

// The device's 1x16 copy of n values against the host's: codes and BF16 scales bit for bit.
static void check_groups(const char *label, Fp8Groups got, const HostGroups *expected, size_t n) {
    size_t groups = n / FP8_GROUP;
    uint8_t *codes = (uint8_t *)host_copy_of(got.codes, n);
    bf16 *scales = (bf16 *)host_copy_of(got.scales, groups * sizeof(bf16));
    char name[256];
    snprintf(name, sizeof name, "%s: 1x16 codes e4m3(x / scale)", label);
    check_bits_equal(name, codes, expected->codes, n, 1);
    snprintf(name, sizeof name, "%s: 1x16 scales bf16((max |x| + 1e-10) / 448)", label);
    check_bits_equal(name, scales, expected->scales, groups, sizeof(bf16));
    free(codes), free(scales);
}

// The slot's amax against max |values| of the n values the device stored, bit for bit.
static void check_amax(const char *label, const char *of, const Fp8Scale *d_slot, const float *values, size_t n) {
    float expected = max_abs(values, n), got = download_slot(d_slot).amax;
    check(bits_of(got) == bits_of(expected), "%s: amax = %s = %.9g bit for bit (got %.9g)", label, of,
          (double)expected, (double)got);
}

// ---- 1. residual_rmsnorm_forward ----------------------------------------------------------

// [N, C] with a branch to add or none (the residual itself is normalized), with the 1x16 copy
// (group16) or without it; always with norm_amax.
static void test_residual_rmsnorm_forward(int N, int C, bool with_branch, bool group16) {
    Random rng;
    random_seed(&rng, SEED + 4 * (uint64_t)C + 2 * with_branch + group16);
    size_t n = (size_t)N * C;
    float *residual = host_floats(n), *branch = host_floats(n), *weight = host_floats(C), *sum = host_floats(n);
    fill_normal_bf16_values(&rng, residual, n, 0.0, 3.0);
    fill_normal_bf16_values(&rng, branch, n, 0.0, 1.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);
    for (int j = 0; j < FP8_GROUP; j++) residual[j] = branch[j] = 0.0f;  // an all-zero group: scale bf16(1e-10 / 448), codes 0
    // The GPU adds in FP32 and rounds once to BF16: the same operations here give the same bits.
    for (size_t i = 0; i < n; i++) sum[i] = with_branch ? round_to_bf16(residual[i] + branch[i]) : residual[i];

    bf16 *d_residual = device_bf16_from(residual, n), *d_weight = device_bf16_from(weight, C);
    bf16 *d_branch = with_branch ? device_bf16_from(branch, n) : NULL;
    bf16 *d_sum = with_branch ? (bf16 *)device_nan(n * sizeof(bf16)) : NULL;
    bf16 *d_norm = (bf16 *)device_nan(n * sizeof(bf16));
    float *d_rstd = (float *)device_nan(N * sizeof(float));
    Fp8Groups d_copy = group16 ? device_groups_nan(n) : Fp8Groups{NULL, NULL};
    Fp8Scale *d_slot = device_zero_slot();
    residual_rmsnorm_forward(d_sum, d_norm, d_rstd, d_residual, d_branch, d_weight, N, C, RMS_EPS, 0, d_copy, d_slot);

    HostGroups copy = {};
    if (group16) copy = host_quantize_groups(sum, n);
    float *expected_norm = host_floats(n), *expected_rstd = host_floats(N);
    ref_rmsnorm_forward(expected_norm, expected_rstd, group16 ? copy.values : sum, weight, N, C, RMS_EPS);
    float *got_norm = download_bf16_values(d_norm, n), *got_rstd = (float *)host_copy_of(d_rstd, N * sizeof(float));

    char label[128], name[256];
    snprintf(label, sizeof label, "residual_rmsnorm_forward N=%d C=%d %s, %s", N, C,
             with_branch ? "with branch" : "branch NULL", group16 ? "1x16 copy + norm_amax" : "norm_amax only");
    if (with_branch) {
        float *got_sum = download_bf16_values(d_sum, n);
        snprintf(name, sizeof name, "%s: residual_out = bf16(residual + branch) exactly", label);
        check_close(name, got_sum, sum, n, 0.0, 0.0);
        free(got_sum);
    }
    if (group16) check_groups(label, d_copy, &copy, n);
    const char *input = group16 ? "the dequantized copy" : "the BF16 sum";
    snprintf(name, sizeof name, "%s: rstd of %s", label, input);
    check_close(name, got_rstd, expected_rstd, N, 0.0, RSTD_RTOL);
    snprintf(name, sizeof name, "%s: norm_out of %s within one BF16 ulp", label, input);
    check_close(name, got_norm, expected_norm, n, TINY_ATOL, ONE_BF16_ULP);
    check_amax(label, "max |norm_out|", d_slot, got_norm, n);

    cudaCheck(cudaFree(d_residual));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_branch));
    cudaCheck(cudaFree(d_sum));
    cudaCheck(cudaFree(d_norm));
    cudaCheck(cudaFree(d_rstd));
    cudaCheck(cudaFree(d_slot));
    if (group16) free_device_groups(d_copy);
    free_host_groups(&copy);
    free(residual), free(branch), free(weight), free(sum);
    free(expected_norm), free(expected_rstd), free(got_norm), free(got_rstd);
}

// ---- 2. rmsnorm_backward from the 1x16 input --------------------------------------------

static void test_rmsnorm_backward(int N, int C) {
    Random rng;
    random_seed(&rng, SEED + 1000 + N + (uint64_t)C);
    size_t n = (size_t)N * C;
    float *x = host_floats(n), *dout = host_floats(n), *din = host_floats(n);
    float *weight = host_floats(C), *dweight = host_floats(C), *normed = host_floats(n), *rstd = host_floats(N);
    fill_normal_bf16_values(&rng, x, n, 0.3, 2.0);
    fill_normal_bf16_values(&rng, dout, n, 0.0, 1.0);
    fill_normal_bf16_values(&rng, din, n, 0.0, 1.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);
    fill_normal_bf16_values(&rng, dweight, C, 0.0, 1.0);
    HostGroups groups = host_quantize_groups(x, n);
    ref_rmsnorm_forward(normed, rstd, groups.values, weight, N, C, RMS_EPS);  // both sides use these rstd

    Fp8Groups d_groups = device_groups_from(&groups, n);
    bf16 *d_unread = (bf16 *)device_nan(n * sizeof(bf16));  // the BF16 input, which the 1x16 path must not read
    bf16 *d_dout = device_bf16_from(dout, n), *d_din = device_bf16_from(din, n);
    bf16 *d_weight = device_bf16_from(weight, C), *d_dweight = device_bf16_from(dweight, C);
    float *d_rstd = (float *)device_alloc(N * sizeof(float));
    cudaCheck(cudaMemcpy(d_rstd, rstd, N * sizeof(float), cudaMemcpyHostToDevice));
    size_t scratch_bytes = rmsnorm_backward_scratch_bytes(N, C);
    float *d_scratch = (float *)device_nan(scratch_bytes);
    Fp8Scale *d_slot = device_zero_slot();
    rmsnorm_backward(d_din, d_dweight, d_scratch, d_dout, d_unread, d_weight, d_rstd, N, C, 0, d_groups, d_slot);
    float *got_din = download_bf16_values(d_din, n), *got_dweight = download_bf16_values(d_dweight, C);
    ref_rmsnorm_backward(din, dweight, dout, groups.values, weight, rstd, N, C);  // accumulates: now expected

    char label[128], name[256];
    snprintf(label, sizeof label, "rmsnorm_backward N=%d C=%d from the 1x16 input, din_amax", N, C);
    snprintf(name, sizeof name, "%s: din (accumulated) of the dequantized x", label);
    check_close(name, got_din, din, n, BF16_ATOL, BF16_RTOL);
    snprintf(name, sizeof name, "%s: dweight (accumulated) of the dequantized x", label);
    check_close(name, got_dweight, dweight, C, BF16_ATOL, BF16_RTOL);
    check_amax(label, "max |din| after the add", d_slot, got_din, n);

    free_device_groups(d_groups);
    cudaCheck(cudaFree(d_unread));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_din));
    cudaCheck(cudaFree(d_weight));
    cudaCheck(cudaFree(d_dweight));
    cudaCheck(cudaFree(d_rstd));
    cudaCheck(cudaFree(d_scratch));
    cudaCheck(cudaFree(d_slot));
    free_host_groups(&groups);
    free(x), free(dout), free(din), free(weight), free(dweight), free(normed), free(rstd);
    free(got_din), free(got_dweight);
}

// ---- 3. and 4. swiglu_forward and swiglu_backward with the 1x16 copy ------------------------

// gate_up [N, 2I] Normal(0, 3) rounded to BF16 (gate values out to +-9 reach both flat ends of
// the sigmoid), its first group all zero.
static float *random_gate_up(Random *rng, int N, int I) {
    size_t n = 2 * (size_t)N * I;
    float *gate_up = host_floats(n);
    fill_normal_bf16_values(rng, gate_up, n, 0.0, 3.0);
    for (int j = 0; j < FP8_GROUP; j++) gate_up[j] = 0.0f;
    return gate_up;
}

static void test_swiglu_forward(int N, int I) {
    Random rng;
    random_seed(&rng, SEED + 2000 + N + (uint64_t)I);
    size_t n = (size_t)N * I;
    float *gate_up = random_gate_up(&rng, N, I);
    HostGroups copy = host_quantize_groups(gate_up, 2 * n);  // 16 consecutive columns: gate groups, then up
    float *gate = host_floats(n), *up = host_floats(n), *expected = host_floats(n);
    split_gate_up(gate, up, copy.values, N, I);
    ref_swiglu_forward(expected, gate, up, n);

    bf16 *d_gate_up = device_bf16_from(gate_up, 2 * n), *d_out = (bf16 *)device_nan(n * sizeof(bf16));
    Fp8Groups d_copy = device_groups_nan(2 * n), d_copy_no_out = device_groups_nan(2 * n);
    Fp8Scale *d_slot = device_zero_slot(), *d_slot_no_out = device_zero_slot();
    swiglu_forward(d_out, d_gate_up, N, I, 0, d_copy, d_slot);
    swiglu_forward(NULL, d_gate_up, N, I, 0, d_copy_no_out, d_slot_no_out);
    float *got = download_bf16_values(d_out, n);

    char label[128], name[256];
    snprintf(label, sizeof label, "swiglu_forward N=%d I=%d with gate_up_copy and out_amax", N, I);
    check_groups(label, d_copy, &copy, 2 * n);
    snprintf(name, sizeof name, "%s: out = silu(g) * u of the dequantized g, u within one BF16 ulp", label);
    check_close(name, got, expected, n, TINY_ATOL, ONE_BF16_ULP);
    check_amax(label, "max |out|", d_slot, got, n);
    snprintf(label, sizeof label, "swiglu_forward N=%d I=%d with out NULL", N, I);
    check_groups(label, d_copy_no_out, &copy, 2 * n);
    check_amax(label, "max |out| of the run that stored out", d_slot_no_out, got, n);

    cudaCheck(cudaFree(d_gate_up));
    cudaCheck(cudaFree(d_out));
    cudaCheck(cudaFree(d_slot));
    cudaCheck(cudaFree(d_slot_no_out));
    free_device_groups(d_copy);
    free_device_groups(d_copy_no_out);
    free_host_groups(&copy);
    free(gate_up), free(gate), free(up), free(expected), free(got);
}

static void test_swiglu_backward(int N, int I) {
    Random rng;
    random_seed(&rng, SEED + 3000 + N + (uint64_t)I);
    size_t n = (size_t)N * I;
    float *gate_up = random_gate_up(&rng, N, I), *dout = host_floats(n);
    fill_normal_bf16_values(&rng, dout, n, 0.0, 1.0);
    HostGroups groups = host_quantize_groups(gate_up, 2 * n);
    float *gate = host_floats(n), *up = host_floats(n), *dgate = host_floats(n), *dup = host_floats(n);
    float *expected = host_floats(2 * n);
    split_gate_up(gate, up, groups.values, N, I);
    ref_swiglu_backward(dgate, dup, dout, gate, up, n);  // accumulates onto the zeroed dgate, dup
    join_gate_up(expected, dgate, dup, N, I);

    Fp8Groups d_groups = device_groups_from(&groups, 2 * n);
    bf16 *d_unread = (bf16 *)device_nan(2 * n * sizeof(bf16));  // BF16 gate_up: the 1x16 path must not read it
    bf16 *d_dout = device_bf16_from(dout, n), *d_dgate_up = (bf16 *)device_nan(2 * n * sizeof(bf16));
    Fp8Scale *d_slot = device_zero_slot(), *d_slot_no_out = device_zero_slot();
    swiglu_backward(d_dgate_up, d_dout, d_unread, N, I, 0, d_groups, d_slot);
    swiglu_backward(NULL, d_dout, d_unread, N, I, 0, d_groups, d_slot_no_out);
    float *got = download_bf16_values(d_dgate_up, 2 * n);

    char label[128], name[256];
    snprintf(label, sizeof label, "swiglu_backward N=%d I=%d from gate_up_groups with dgate_up_amax", N, I);
    snprintf(name, sizeof name, "%s: dgate and dup of the dequantized g, u", label);
    check_close(name, got, expected, 2 * n, BF16_ATOL, BF16_RTOL);
    check_amax(label, "max |dgate_up|", d_slot, got, 2 * n);
    snprintf(label, sizeof label, "swiglu_backward N=%d I=%d with dgate_up NULL", N, I);
    check_amax(label, "max |dgate_up| of the run that stored it", d_slot_no_out, got, 2 * n);

    free_device_groups(d_groups);
    cudaCheck(cudaFree(d_unread));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_dgate_up));
    cudaCheck(cudaFree(d_slot));
    cudaCheck(cudaFree(d_slot_no_out));
    free_host_groups(&groups);
    free(gate_up), free(dout), free(gate), free(up), free(dgate), free(dup), free(expected), free(got);
}

// ---- 5. and 6. the fused FP8 casts of the SwiGLU output and gradients ------------------------

typedef struct {
    uint8_t *codes, *codes_t;  // device [R, C] and [C, R]
    Fp8Scale *slot;
} CastOutputs;

static CastOutputs cast_outputs(size_t n, int poison) {
    CastOutputs c = {(uint8_t *)device_poisoned(n, poison), (uint8_t *)device_poisoned(n, poison), device_zero_slot()};
    return c;
}
static void free_cast_outputs(CastOutputs c) {
    cudaCheck(cudaFree(c.codes));
    cudaCheck(cudaFree(c.codes_t));
    cudaCheck(cudaFree(c.slot));
}

static uint8_t *host_transpose(const uint8_t *x, int R, int C) {
    uint8_t *t = (uint8_t *)host_alloc((size_t)R * C);
    for (size_t r = 0; r < (size_t)R; r++)
        for (size_t c = 0; c < (size_t)C; c++) t[c * R + r] = x[r * C + c];
    return t;
}

// The fused cast against fp8_quantize of d_stored [R, C], the BF16 tensor the plain kernel wrote
// in the same run (whose amax both slots hold): the slot's amax against that tensor, codes and
// transposed codes bit for bit, the transpose, and the scales both casts stored.
static void check_cast(const char *label, CastOutputs fused, CastOutputs stored, const bf16 *d_stored, int R, int C,
                       float format_max) {
    size_t n = (size_t)R * C;
    float *values = download_bf16_values(d_stored, n);
    check_amax(label, "max |stored BF16 tensor|", fused.slot, values, n);
    uint8_t *codes = (uint8_t *)host_copy_of(fused.codes, n), *codes_t = (uint8_t *)host_copy_of(fused.codes_t, n);
    uint8_t *expected = (uint8_t *)host_copy_of(stored.codes, n);
    uint8_t *expected_t = (uint8_t *)host_copy_of(stored.codes_t, n);
    uint8_t *transposed = host_transpose(codes, R, C);
    char name[256];
    snprintf(name, sizeof name, "%s: codes [%d, %d] = fp8_quantize of the stored BF16 tensor", label, R, C);
    check_bits_equal(name, codes, expected, n, 1);
    snprintf(name, sizeof name, "%s: transposed codes [%d, %d] = fp8_quantize's", label, C, R);
    check_bits_equal(name, codes_t, expected_t, n, 1);
    snprintf(name, sizeof name, "%s: transposed codes are the transpose of the codes", label);
    check_bits_equal(name, codes_t, transposed, n, 1);

    Fp8Scale f = download_slot(fused.slot), s = download_slot(stored.slot);
    float expected_scale = (f.amax + 1e-10f) / format_max;
    check(bits_of(f.scale) == bits_of(expected_scale) && bits_of(s.scale) == bits_of(expected_scale) &&
              bits_of(f.amax) == bits_of(s.amax),
          "%s: slot scale = (amax + 1e-10) / %g = %.9g bit for bit (fused cast %.9g, fp8_quantize %.9g), amax kept "
          "(fused cast %.9g, fp8_quantize %.9g)",
          label, (double)format_max, (double)expected_scale, (double)f.scale, (double)s.scale, (double)f.amax,
          (double)s.amax);
    free(values), free(codes), free(codes_t), free(expected), free(expected_t), free(transposed);
}

// swiglu_forward (storing BF16 out, gathering its amax), then swiglu_forward_cast and
// fp8_quantize of that out, E4M3. `copy` (codes NULL: none) is written by the forward from the
// BF16 gate_up and read by the cast, which gets `cast_gate_up` as its BF16 input.
static void check_forward_cast(int N, int I, const bf16 *d_gate_up, const bf16 *cast_gate_up, Fp8Groups copy) {
    size_t n = (size_t)N * I;
    CastOutputs fused = cast_outputs(n, POISON_FUSED), stored = cast_outputs(n, POISON_STORED);
    bf16 *d_out = (bf16 *)device_nan(n * sizeof(bf16));
    swiglu_forward(d_out, d_gate_up, N, I, 0, copy, fused.slot);
    cudaCheck(cudaMemcpy(stored.slot, fused.slot, sizeof(Fp8Scale), cudaMemcpyDeviceToDevice));
    swiglu_forward_cast(fused.codes, fused.codes_t, fused.slot, cast_gate_up, copy, N, I, 0);
    fp8_quantize(stored.codes, stored.codes_t, stored.slot, d_out, N, I, FP8_E4M3, 0);
    char label[128];
    snprintf(label, sizeof label, "swiglu_forward_cast N=%d I=%d from %s", N, I,
             copy.codes ? "the 1x16 copy" : "BF16 gate_up");
    check_cast(label, fused, stored, d_out, N, I, FP8_E4M3_MAX);
    free_cast_outputs(fused);
    free_cast_outputs(stored);
    cudaCheck(cudaFree(d_out));
}

// swiglu_backward (storing BF16 dgate_up, gathering its amax), then swiglu_backward_cast and
// fp8_quantize of that dgate_up [N, 2I], E5M2; gate_up is BF16 or its copy (codes set).
static void check_backward_cast(int N, int I, const bf16 *d_dout, const bf16 *d_gate_up, Fp8Groups copy) {
    size_t n = 2 * (size_t)N * I;
    CastOutputs fused = cast_outputs(n, POISON_FUSED), stored = cast_outputs(n, POISON_STORED);
    bf16 *d_dgate_up = (bf16 *)device_nan(n * sizeof(bf16));
    swiglu_backward(d_dgate_up, d_dout, d_gate_up, N, I, 0, copy, fused.slot);
    cudaCheck(cudaMemcpy(stored.slot, fused.slot, sizeof(Fp8Scale), cudaMemcpyDeviceToDevice));
    swiglu_backward_cast(fused.codes, fused.codes_t, fused.slot, d_dout, d_gate_up, copy, N, I, 0);
    fp8_quantize(stored.codes, stored.codes_t, stored.slot, d_dgate_up, N, 2 * I, FP8_E5M2, 0);
    char label[128];
    snprintf(label, sizeof label, "swiglu_backward_cast N=%d I=%d from %s", N, I,
             copy.codes ? "the 1x16 copy" : "BF16 gate_up");
    check_cast(label, fused, stored, d_dgate_up, N, 2 * I, FP8_E5M2_MAX);
    free_cast_outputs(fused);
    free_cast_outputs(stored);
    cudaCheck(cudaFree(d_dgate_up));
}

// Both casts from BF16 gate_up, then from the 1x16 copy that the forward makes (the casts and the
// backward then get a NaN-filled BF16 gate_up). N must be a multiple of 16 (the transposes).
static void test_swiglu_casts(int N, int I) {
    Random rng;
    random_seed(&rng, SEED + 4000 + N + (uint64_t)I);
    size_t n = (size_t)N * I;
    float *gate_up = random_gate_up(&rng, N, I), *dout = host_floats(n);
    fill_normal_bf16_values(&rng, dout, n, 0.0, 1.0);
    bf16 *d_gate_up = device_bf16_from(gate_up, 2 * n), *d_dout = device_bf16_from(dout, n);
    bf16 *d_unread = (bf16 *)device_nan(2 * n * sizeof(bf16));

    check_forward_cast(N, I, d_gate_up, d_gate_up, Fp8Groups{NULL, NULL});
    check_backward_cast(N, I, d_dout, d_gate_up, Fp8Groups{NULL, NULL});
    Fp8Groups d_copy = device_groups_nan(2 * n);
    check_forward_cast(N, I, d_gate_up, d_unread, d_copy);
    check_backward_cast(N, I, d_dout, d_unread, d_copy);

    free_device_groups(d_copy);
    cudaCheck(cudaFree(d_gate_up));
    cudaCheck(cudaFree(d_dout));
    cudaCheck(cudaFree(d_unread));
    free(gate_up), free(dout);
}

// residual_rmsnorm_forward storing BF16 norm_out and gathering its amax, then again with no
// output (the same amax and rstd), then rmsnorm_output_cast and fp8_quantize of the stored output,
// E4M3: from the BF16 sum, and from the 1x16 copy (the cast then gets a NaN-filled BF16 input).
// N must be a multiple of 16 (the transposes).
static void test_rmsnorm_output_cast(int N, int C, bool group16) {
    Random rng;
    random_seed(&rng, SEED + 6000 + N + 2 * (uint64_t)C + group16);
    size_t n = (size_t)N * C;
    float *residual = host_floats(n), *branch = host_floats(n), *weight = host_floats(C);
    fill_normal_bf16_values(&rng, residual, n, 0.0, 3.0);
    fill_normal_bf16_values(&rng, branch, n, 0.0, 1.0);
    fill_normal_bf16_values(&rng, weight, C, 1.0, 0.1);
    bf16 *d_residual = device_bf16_from(residual, n), *d_branch = device_bf16_from(branch, n), *d_weight = device_bf16_from(weight, C);
    bf16 *d_sum = (bf16 *)device_nan(n * sizeof(bf16)), *d_norm = (bf16 *)device_nan(n * sizeof(bf16));
    bf16 *d_unread = (bf16 *)device_nan(n * sizeof(bf16));
    float *d_rstd = (float *)device_nan(N * sizeof(float)), *d_rstd_unstored = (float *)device_nan(N * sizeof(float));
    Fp8Groups d_copy = group16 ? device_groups_nan(n) : Fp8Groups{NULL, NULL};
    CastOutputs fused = cast_outputs(n, POISON_FUSED), stored = cast_outputs(n, POISON_STORED);

    residual_rmsnorm_forward(d_sum, d_norm, d_rstd, d_residual, d_branch, d_weight, N, C, RMS_EPS, 0, d_copy, stored.slot);
    residual_rmsnorm_forward(d_sum, NULL, d_rstd_unstored, d_residual, d_branch, d_weight, N, C, RMS_EPS, 0, d_copy, fused.slot);
    char label[128], name[256];
    snprintf(label, sizeof label, "rmsnorm_output_cast N=%d C=%d from %s", N, C, group16 ? "the 1x16 copy" : "the BF16 sum");
    Fp8Scale f = download_slot(fused.slot), s = download_slot(stored.slot);
    check(bits_of(f.amax) == bits_of(s.amax), "%s: the norm with no output gathers the same amax (%.9g, stored %.9g)",
          label, (double)f.amax, (double)s.amax);
    float *rstd = (float *)host_copy_of(d_rstd, N * sizeof(float)), *rstd_unstored = (float *)host_copy_of(d_rstd_unstored, N * sizeof(float));
    snprintf(name, sizeof name, "%s: the norm with no output writes the same rstd", label);
    check_close(name, rstd_unstored, rstd, N, 0.0, 0.0);

    rmsnorm_output_cast(fused.codes, fused.codes_t, fused.slot, group16 ? d_unread : d_sum, d_copy, d_rstd_unstored,
                        d_weight, N, C, 0);
    fp8_quantize(stored.codes, stored.codes_t, stored.slot, d_norm, N, C, FP8_E4M3, 0);
    check_cast(label, fused, stored, d_norm, N, C, FP8_E4M3_MAX);

    free_cast_outputs(fused);
    free_cast_outputs(stored);
    if (group16) free_device_groups(d_copy);
    bf16 *device_buffers[] = {d_residual, d_branch, d_weight, d_sum, d_norm, d_unread};
    for (size_t i = 0; i < sizeof device_buffers / sizeof device_buffers[0]; i++) cudaCheck(cudaFree(device_buffers[i]));
    cudaCheck(cudaFree(d_rstd));
    cudaCheck(cudaFree(d_rstd_unstored));
    free(residual), free(branch), free(weight), free(rstd), free(rstd_unstored);
}

int main(void) {
    cudaCheck(cudaSetDevice(0));

    // 37 rows: the last block of 8 rows is partial; C = 352 is not a multiple of 256, so part of
    // the warp idles in the second pass over a row.
    static const int widths[] = {128, 352, 2048};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++)
        for (int with_branch = 0; with_branch < 2; with_branch++)
            for (int group16 = 0; group16 < 2; group16++)
                test_residual_rmsnorm_forward(37, widths[w], with_branch, group16);

    test_rmsnorm_backward(37, 352);
    test_rmsnorm_backward(130, 2048);  // three blocks of rows, the last partial
    test_rmsnorm_backward(71, 368);    // an odd number of groups a row, and in all: scales mid-word, the last alone
    test_rmsnorm_backward(66, 4096);   // 512 threads a block (llama2-7b's dim)
    test_rmsnorm_backward(64, 8000);   // two vectors per thread

    test_swiglu_forward(37, 352);
    test_swiglu_forward(256, 5632);
    test_swiglu_backward(37, 352);
    test_swiglu_backward(256, 5632);

    test_swiglu_casts(80, 352);     // partial 64 x 64 tiles in both directions
    test_swiglu_casts(2048, 5632);  // many tiles
    for (int group16 = 0; group16 < 2; group16++) {
        test_rmsnorm_output_cast(80, 352, group16);    // partial tiles
        test_rmsnorm_output_cast(2048, 2048, group16);
    }
    return check_summary("test_fp8_kernels");
}
