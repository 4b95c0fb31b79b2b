// Tests of coat/matmul.cuh on the GPU: the BF16 linear-layer launchers (forward, dgrad, wgrad,
// with and without accumulation, odd shapes) against the FP32 CPU reference on BF16-rounded
// inputs; FP8 E4M3 x E4M3 and E5M2 x E4M3 products with per-tensor device scales, precise and
// fast accumulation, against the exact (double) product of the dequantized operands, both
// tightly (~1e-2 relative) and within TransformerEngine's tolerances; the argument checks.
// Prints BF16 and FP8 TFLOP/s at M16384 K2048 N5632 (information, not a check).
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/matmul.cuh"
#include "../coat/random.h"
#include "check.h"
#include "gpu_test_util.cuh"
extern "C" {
#include "reference_llama.h"
}

// ---- BF16 linear layer vs the CPU reference ----------------------------------------------------

static void test_bf16_linear(GpuContext *gpu, int N, int IC, int OC) {
    Random rng;
    random_seed(&rng, 1234);
    float *x = random_uniform_bf16_values(&rng, (size_t)N * IC, 1.0f);
    float *w = random_uniform_bf16_values(&rng, (size_t)OC * IC, 1.0f);
    float *dy = random_uniform_bf16_values(&rng, (size_t)N * OC, 1.0f);
    float *y_before = random_uniform_bf16_values(&rng, (size_t)N * OC, 2.0f);
    float *dx_before = random_uniform_bf16_values(&rng, (size_t)N * IC, 2.0f);
    float *dw_before = random_uniform_bf16_values(&rng, (size_t)OC * IC, 2.0f);
    float *y_ref = host_floats((size_t)N * OC), *dx_ref = host_floats((size_t)N * IC);
    float *dw_ref = host_floats((size_t)OC * IC);
    ref_matmul_forward(y_ref, x, w, N, IC, OC);
    ref_matmul_backward(dx_ref, dw_ref, dy, x, w, N, IC, OC);

    bf16 *d_x = device_bf16_from(x, (size_t)N * IC), *d_w = device_bf16_from(w, (size_t)OC * IC);
    bf16 *d_dy = device_bf16_from(dy, (size_t)N * OC);
    bf16 *d_y, *d_dx, *d_dw;
    cudaCheck(cudaMalloc(&d_y, (size_t)N * OC * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dx, (size_t)N * IC * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dw, (size_t)OC * IC * sizeof(bf16)));
    float *got = host_floats((size_t)N * (IC > OC ? IC : OC) + (size_t)OC * IC);
    float *expected = host_floats((size_t)N * (IC > OC ? IC : OC) + (size_t)OC * IC);
    char name[160];

    // BF16 output: one rounding of an FP32 sum (2^-9 relative), the CPU sums in another order.
    // Accumulating into BF16, cuBLASLt rounds at the scale of the terms (|before| up to ~6), not of
    // their sum, so a small sum of two large terms carries up to ~6 * 2^-9 of absolute error.
    const double rtol = 1e-2;
    for (int accumulate = 0; accumulate <= 1; accumulate++) {
        const char *mode = accumulate ? "accumulate" : "overwrite";
        const double atol = accumulate ? 1.5e-2 : 1e-3;
        if (accumulate) copy_bf16_to_device(d_y, y_before, (size_t)N * OC);
        else poison_nan(d_y, (size_t)N * OC * 2);
        matmul_forward(gpu, d_y, d_x, d_w, N, IC, OC, accumulate);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_y, (size_t)N * OC);
        for (size_t i = 0; i < (size_t)N * OC; i++) expected[i] = y_ref[i] + (accumulate ? y_before[i] : 0.0f);
        snprintf(name, sizeof(name), "bf16 forward N=%d IC=%d OC=%d %s", N, IC, OC, mode);
        check_close(name, got, expected, (size_t)N * OC, atol, rtol);

        if (accumulate) copy_bf16_to_device(d_dx, dx_before, (size_t)N * IC);
        else poison_nan(d_dx, (size_t)N * IC * 2);
        matmul_backward_input(gpu, d_dx, d_dy, d_w, N, IC, OC, accumulate);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_dx, (size_t)N * IC);
        for (size_t i = 0; i < (size_t)N * IC; i++) expected[i] = dx_ref[i] + (accumulate ? dx_before[i] : 0.0f);
        snprintf(name, sizeof(name), "bf16 dgrad N=%d IC=%d OC=%d %s", N, IC, OC, mode);
        check_close(name, got, expected, (size_t)N * IC, atol, rtol);

        if (accumulate) copy_bf16_to_device(d_dw, dw_before, (size_t)OC * IC);
        else poison_nan(d_dw, (size_t)OC * IC * 2);
        matmul_backward_weight(gpu, d_dw, d_dy, d_x, N, IC, OC, accumulate);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_dw, (size_t)OC * IC);
        for (size_t i = 0; i < (size_t)OC * IC; i++) expected[i] = dw_ref[i] + (accumulate ? dw_before[i] : 0.0f);
        snprintf(name, sizeof(name), "bf16 wgrad N=%d IC=%d OC=%d %s", N, IC, OC, mode);
        check_close(name, got, expected, (size_t)OC * IC, atol, rtol);
    }

    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_dy));
    cudaCheck(cudaFree(d_y));
    cudaCheck(cudaFree(d_dx));
    cudaCheck(cudaFree(d_dw));
    free(x); free(w); free(dy); free(y_before); free(dx_before); free(dw_before);
    free(y_ref); free(dx_ref); free(dw_ref); free(got); free(expected);
}

// ---- FP8 --------------------------------------------------------------------------------------

// A tensor quantized on the host the way the trainer's quantizers do it: scale = amax / max_fp8
// in FP32, q = saturating round-to-nearest-even of x / scale; dequantized = q * scale.
typedef struct {
    uint8_t *bytes;       // [rows, cols]
    uint8_t *bytes_t;     // the transpose [cols, rows]
    double *dequantized;  // [rows, cols], exact in double
    float scale;
} Fp8Tensor;

static Fp8Tensor quantize_fp8(const float *x, int rows, int cols, __nv_fp8_interpretation_t format) {
    size_t n = (size_t)rows * cols;
    Fp8Tensor t;
    t.bytes = (uint8_t *)host_alloc(n);
    t.bytes_t = (uint8_t *)host_alloc(n);
    t.dequantized = (double *)host_alloc(n * sizeof(double));
    t.scale = max_abs(x, n) / (format == __NV_E4M3 ? 448.0f : 57344.0f);
    for (int r = 0; r < rows; r++) {
        for (int c = 0; c < cols; c++) {
            size_t i = (size_t)r * cols + c;
            __nv_fp8_storage_t q = __nv_cvt_float_to_fp8(x[i] / t.scale, __NV_SATFINITE, format);
            __half_raw half = __nv_cvt_fp8_to_halfraw(q, format);
            t.bytes[i] = q;
            t.bytes_t[(size_t)c * rows + r] = q;
            t.dequantized[i] = (double)__half2float(__half(half)) * (double)t.scale;
        }
    }
    return t;
}

static void free_fp8(Fp8Tensor *t) {
    free(t->bytes);
    free(t->bytes_t);
    free(t->dequantized);
}

static void *device_copy(const void *host, size_t bytes) {
    void *device;
    cudaCheck(cudaMalloc(&device, bytes));
    cudaCheck(cudaMemcpy(device, host, bytes, cudaMemcpyHostToDevice));
    return device;
}

static float *random_values(Random *rng, size_t n, float amplitude) {
    float *p = host_floats(n);
    for (size_t i = 0; i < n; i++) p[i] = (float)((2.0 * random_uniform(rng) - 1.0) * amplitude);
    return p;
}

// Checks one FP8 result twice: tight (what FP32 accumulation of exact FP8 products plus one
// output rounding allows) and within TransformerEngine's tolerance for the format.
static void check_fp8_result(const char *name, const float *got, const float *expected, size_t n, int e5m2) {
    char label[320];
    float scale = max_abs(expected, n);
    snprintf(label, sizeof(label), "%s: tight (rtol 1e-2, atol 1e-3 * max|expected|)", name);
    check_close(label, got, expected, n, 1e-3 * scale, 1e-2);
    snprintf(label, sizeof(label), "%s: TransformerEngine %s tolerance", name, e5m2 ? "E5M2" : "E4M3");
    check_close(label, got, expected, n, e5m2 ? 0.125 : 0.0675, e5m2 ? 0.25 : 0.125);
}

static void test_fp8_linear(GpuContext *gpu, int N, int IC, int OC) {
    Random rng;
    random_seed(&rng, 99);
    // Magnitudes that keep the outputs of order 1, where TE's absolute tolerance means something.
    float *x = random_values(&rng, (size_t)N * IC, 2.0f);
    float *w = random_values(&rng, (size_t)OC * IC, 1.0f / sqrtf((float)IC));
    float *dy = random_values(&rng, (size_t)N * OC, 1.0f);
    Fp8Tensor qx = quantize_fp8(x, N, IC, __NV_E4M3), qw = quantize_fp8(w, OC, IC, __NV_E4M3);
    Fp8Tensor qdy = quantize_fp8(dy, N, OC, __NV_E5M2);

    float *y_ref = host_floats((size_t)N * OC), *dx_ref = host_floats((size_t)N * IC);
    float *dw_ref = host_floats((size_t)OC * IC), *dw_before = random_values(&rng, (size_t)OC * IC, 1.0f);
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            double sum = 0.0;
            for (int i = 0; i < IC; i++) sum += qx.dequantized[(size_t)n * IC + i] * qw.dequantized[(size_t)o * IC + i];
            y_ref[(size_t)n * OC + o] = (float)sum;
        }
    for (int n = 0; n < N; n++)
        for (int i = 0; i < IC; i++) {
            double sum = 0.0;
            for (int o = 0; o < OC; o++)
                sum += qdy.dequantized[(size_t)n * OC + o] * qw.dequantized[(size_t)o * IC + i];
            dx_ref[(size_t)n * IC + i] = (float)sum;
        }
    for (int o = 0; o < OC; o++)
        for (int i = 0; i < IC; i++) {
            double sum = 0.0;
            for (int n = 0; n < N; n++) sum += qdy.dequantized[(size_t)n * OC + o] * qx.dequantized[(size_t)n * IC + i];
            dw_ref[(size_t)o * IC + i] = (float)sum;
        }

    __nv_fp8_e4m3 *d_x = (__nv_fp8_e4m3 *)device_copy(qx.bytes, (size_t)N * IC);
    __nv_fp8_e4m3 *d_x_t = (__nv_fp8_e4m3 *)device_copy(qx.bytes_t, (size_t)N * IC);
    __nv_fp8_e4m3 *d_w = (__nv_fp8_e4m3 *)device_copy(qw.bytes, (size_t)OC * IC);
    __nv_fp8_e4m3 *d_w_t = (__nv_fp8_e4m3 *)device_copy(qw.bytes_t, (size_t)OC * IC);
    __nv_fp8_e5m2 *d_dy = (__nv_fp8_e5m2 *)device_copy(qdy.bytes, (size_t)N * OC);
    __nv_fp8_e5m2 *d_dy_t = (__nv_fp8_e5m2 *)device_copy(qdy.bytes_t, (size_t)N * OC);
    // One scale per 16 bytes, as matmul_lt requires.
    float scales[12] = {qx.scale, 0, 0, 0, qw.scale, 0, 0, 0, qdy.scale, 0, 0, 0};
    float *d_scales = (float *)device_copy(scales, sizeof(scales));
    const float *d_x_scale = d_scales, *d_w_scale = d_scales + 4, *d_dy_scale = d_scales + 8;
    bf16 *d_y, *d_dx, *d_dw_bf16;
    float *d_dw;
    cudaCheck(cudaMalloc(&d_y, (size_t)N * OC * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dx, (size_t)N * IC * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dw_bf16, (size_t)OC * IC * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_dw, (size_t)OC * IC * sizeof(float)));
    size_t most = (size_t)N * OC;
    if ((size_t)N * IC > most) most = (size_t)N * IC;
    if ((size_t)OC * IC > most) most = (size_t)OC * IC;
    float *got = host_floats(most), *expected = host_floats(most);
    char name[160];

    for (int fast = 0; fast <= 1; fast++) {
        const char *mode = fast ? "fast accumulation" : "precise accumulation";
        poison_nan(d_y, (size_t)N * OC * 2);
        matmul_forward_fp8(gpu, d_y, d_x, d_x_scale, d_w, d_w_scale, N, IC, OC, false, fast);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_y, (size_t)N * OC);
        snprintf(name, sizeof(name), "fp8 forward e4m3 x e4m3 -> bf16 [%d,%d] %s", N, OC, mode);
        check_fp8_result(name, got, y_ref, (size_t)N * OC, 0);

        poison_nan(d_dx, (size_t)N * IC * 2);
        matmul_backward_input_fp8(gpu, d_dx, d_dy, d_dy_scale, d_w_t, d_w_scale, N, IC, OC, false, fast);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_dx, (size_t)N * IC);
        snprintf(name, sizeof(name), "fp8 dgrad e5m2 x e4m3 -> bf16 [%d,%d] %s", N, IC, mode);
        check_fp8_result(name, got, dx_ref, (size_t)N * IC, 1);

        poison_nan(d_dw_bf16, (size_t)OC * IC * 2);
        matmul_backward_weight_fp8(gpu, d_dw_bf16, DTYPE_BF16, d_dy_t, d_dy_scale, d_x_t, d_x_scale, N, IC, OC, false,
                                   fast);
        cudaCheck(cudaDeviceSynchronize());
        copy_bf16_to_host(got, d_dw_bf16, (size_t)OC * IC);
        snprintf(name, sizeof(name), "fp8 wgrad e5m2 x e4m3 -> bf16 [%d,%d] %s", OC, IC, mode);
        check_fp8_result(name, got, dw_ref, (size_t)OC * IC, 1);

        // FP32 gradient accumulation: dW = dw_before + dy^T x.
        cudaCheck(cudaMemcpy(d_dw, dw_before, (size_t)OC * IC * sizeof(float), cudaMemcpyHostToDevice));
        matmul_backward_weight_fp8(gpu, d_dw, DTYPE_FP32, d_dy_t, d_dy_scale, d_x_t, d_x_scale, N, IC, OC, true, fast);
        cudaCheck(cudaDeviceSynchronize());
        cudaCheck(cudaMemcpy(got, d_dw, (size_t)OC * IC * sizeof(float), cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < (size_t)OC * IC; i++) expected[i] = dw_before[i] + dw_ref[i];
        snprintf(name, sizeof(name), "fp8 wgrad e5m2 x e4m3 -> fp32 accumulate [%d,%d] %s", OC, IC, mode);
        check_fp8_result(name, got, expected, (size_t)OC * IC, 1);
    }

    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_x_t));
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_w_t));
    cudaCheck(cudaFree(d_dy));
    cudaCheck(cudaFree(d_dy_t));
    cudaCheck(cudaFree(d_scales));
    cudaCheck(cudaFree(d_y));
    cudaCheck(cudaFree(d_dx));
    cudaCheck(cudaFree(d_dw_bf16));
    cudaCheck(cudaFree(d_dw));
    free_fp8(&qx); free_fp8(&qw); free_fp8(&qdy);
    free(x); free(w); free(dy); free(y_ref); free(dx_ref); free(dw_ref); free(dw_before); free(got); free(expected);
}

// ---- argument checks (no GPU work: matmul_unsupported_reason is what matmul_lt runs first) ----

static void test_argument_checks(void) {
    // Any 256-byte aligned addresses will do: nothing is dereferenced.
    void *p = (void *)(uintptr_t)4096;
    MatmulOutput out = matmul_output(p, DTYPE_BF16, 64);
    MatmulOperand bf16_k = matmul_operand(p, DTYPE_BF16, MATMUL_K_MAJOR, 64, NULL);
    MatmulOperand e4m3_k = matmul_operand(p, DTYPE_E4M3, MATMUL_K_MAJOR, 64, NULL);
    MatmulOperand e5m2_k = matmul_operand(p, DTYPE_E5M2, MATMUL_K_MAJOR, 64, NULL);
    MatmulOperand e4m3_mn = matmul_operand(p, DTYPE_E4M3, MATMUL_MN_MAJOR, 64, NULL);
    check(matmul_unsupported_reason(&out, &bf16_k, &bf16_k, 32, 64, 64) == NULL, "bf16 K-major x K-major accepted");
    check(matmul_unsupported_reason(&out, &e4m3_k, &e4m3_k, 32, 64, 64) == NULL, "fp8 TN accepted");
    check(matmul_unsupported_reason(&out, &e5m2_k, &e4m3_k, 32, 64, 64) == NULL, "e5m2 x e4m3 accepted");
    check(matmul_unsupported_reason(&out, &e4m3_mn, &e4m3_k, 32, 64, 64) != NULL, "fp8 with an MN-major A rejected");
    check(matmul_unsupported_reason(&out, &e4m3_k, &e4m3_mn, 32, 64, 64) != NULL, "fp8 with an MN-major B rejected");
    check(matmul_unsupported_reason(&out, &e5m2_k, &e5m2_k, 32, 64, 64) != NULL, "e5m2 x e5m2 rejected");
    check(matmul_unsupported_reason(&out, &bf16_k, &e4m3_k, 32, 64, 64) != NULL, "bf16 x fp8 rejected");
    check(matmul_unsupported_reason(&out, &e4m3_k, &e4m3_k, 32, 64, 56) != NULL, "fp8 with K % 16 != 0 rejected");
    MatmulOperand bf16_odd_stride = matmul_operand(p, DTYPE_BF16, MATMUL_K_MAJOR, 100, NULL);
    check(matmul_unsupported_reason(&out, &bf16_odd_stride, &bf16_k, 32, 64, 64) != NULL,
          "bf16 row stride of 100 elements (200 bytes) rejected");
    MatmulOperand misaligned = matmul_operand((char *)p + 8, DTYPE_BF16, MATMUL_K_MAJOR, 64, NULL);
    check(matmul_unsupported_reason(&out, &misaligned, &bf16_k, 32, 64, 64) != NULL, "8-byte aligned pointer rejected");
    MatmulOperand scaled_bf16 = matmul_operand(p, DTYPE_BF16, MATMUL_K_MAJOR, 64, (const float *)p);
    check(matmul_unsupported_reason(&out, &scaled_bf16, &bf16_k, 32, 64, 64) != NULL,
          "scale on a bf16 operand rejected");
    MatmulOperand misaligned_scale = matmul_operand(p, DTYPE_E4M3, MATMUL_K_MAJOR, 64, (const float *)p + 1);
    check(matmul_unsupported_reason(&out, &misaligned_scale, &e4m3_k, 32, 64, 64) != NULL,
          "fp8 scale at a 4-byte offset rejected");
    MatmulOutput fp8_out = matmul_output(p, DTYPE_E4M3, 64);
    check(matmul_unsupported_reason(&fp8_out, &e4m3_k, &e4m3_k, 32, 64, 64) != NULL, "fp8 output rejected");
}

// ---- speed (information) ------------------------------------------------------------------------

__global__ void fill_random_bf16(bf16 *out, size_t n, uint32_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 16;
    h *= 0x7feb352du;
    h ^= h >> 15;
    out[i] = __float2bfloat16((float)(h >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

__global__ void convert_bf16_to_e4m3(__nv_fp8_e4m3 *out, const bf16 *in, size_t n, float inverse_scale) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __nv_fp8_e4m3(__bfloat162float(in[i]) * inverse_scale);
}

typedef enum { SPEED_BF16, SPEED_FP8_PRECISE, SPEED_FP8_FAST } SpeedMode;

// Milliseconds per GEMM: the median over 5 batches of 10 back-to-back calls, after a warm-up
// batch. Batches hide the host's descriptor set-up behind the previous GEMM, as in training.
static float time_gemm(GpuContext *gpu, SpeedMode mode, bf16 *out, const bf16 *a, const bf16 *b,
                       const __nv_fp8_e4m3 *a8, const __nv_fp8_e4m3 *b8, const float *scale, int M, int N, int K) {
    enum { BATCHES = 5, CALLS_PER_BATCH = 10 };
    float batch_ms = median_event_ms(1, BATCHES, [&] {
        for (int call = 0; call < CALLS_PER_BATCH; call++) {
            if (mode == SPEED_BF16)
                matmul_forward(gpu, out, a, b, M, K, N, false);
            else
                matmul_forward_fp8(gpu, out, a8, scale, b8, scale, M, K, N, false, mode == SPEED_FP8_FAST);
        }
    }, gpu->stream);
    return batch_ms / CALLS_PER_BATCH;
}

static void report_gemm_speed(GpuContext *gpu) {
    const int M = 16384, K = 2048, N = 5632;
    size_t a_n = (size_t)M * K, b_n = (size_t)N * K, out_n = (size_t)M * N;
    bf16 *a, *b, *out;
    __nv_fp8_e4m3 *a8, *b8;
    float *scale;
    const float one = 1.0f;
    cudaCheck(cudaMalloc(&a, a_n * sizeof(bf16)));
    cudaCheck(cudaMalloc(&b, b_n * sizeof(bf16)));
    cudaCheck(cudaMalloc(&out, out_n * sizeof(bf16)));
    cudaCheck(cudaMalloc(&a8, a_n));
    cudaCheck(cudaMalloc(&b8, b_n));
    cudaCheck(cudaMalloc(&scale, sizeof(float)));
    cudaCheck(cudaMemcpy(scale, &one, sizeof(float), cudaMemcpyHostToDevice));
    fill_random_bf16<<<(unsigned)ceil_div_size(a_n, 256), 256, 0, gpu->stream>>>(a, a_n, 1u);
    cudaCheckLaunch();
    fill_random_bf16<<<(unsigned)ceil_div_size(b_n, 256), 256, 0, gpu->stream>>>(b, b_n, 2u);
    cudaCheckLaunch();
    convert_bf16_to_e4m3<<<(unsigned)ceil_div_size(a_n, 256), 256, 0, gpu->stream>>>(a8, a, a_n, 448.0f);
    cudaCheckLaunch();
    convert_bf16_to_e4m3<<<(unsigned)ceil_div_size(b_n, 256), 256, 0, gpu->stream>>>(b8, b, b_n, 448.0f);
    cudaCheckLaunch();
    double flop = 2.0 * M * N * K;
    const char *names[3] = {"bf16 x bf16", "e4m3 x e4m3 precise", "e4m3 x e4m3 fast accumulation"};
    for (int mode = SPEED_BF16; mode <= SPEED_FP8_FAST; mode++) {
        float ms = time_gemm(gpu, (SpeedMode)mode, out, a, b, a8, b8, scale, M, N, K);
        printf("info: GEMM M%d K%d N%d %s -> bf16: %.3f ms, %.0f TFLOP/s\n", M, K, N, names[mode], ms,
               flop / (ms * 1e-3) / 1e12);
    }
    cudaCheck(cudaFree(a));
    cudaCheck(cudaFree(b));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(a8));
    cudaCheck(cudaFree(b8));
    cudaCheck(cudaFree(scale));
}

int main(void) {
    GpuContext gpu;
    gpu_context_create(&gpu, 0);
    test_argument_checks();
    test_bf16_linear(&gpu, 100, 72, 136);
    test_bf16_linear(&gpu, 64, 128, 256);
    test_fp8_linear(&gpu, 128, 128, 256);
    test_fp8_linear(&gpu, 112, 80, 144);
    report_gemm_speed(&gpu);
    gpu_context_destroy(&gpu);
    return check_summary("test_matmul");
}
