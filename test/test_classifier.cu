// Tests of coat/classifier.cuh on the GPU against the FP32 CPU reference (ref_matmul_forward,
// ref_cross_entropy_forward/backward, ref_matmul_backward on BF16-rounded x and W): per-row
// losses, their mean, dx (written over NaN poison) and dW (+= onto existing values), for odd
// vocabularies (V = 1001, 37: the scalar tail) and V = 32000, with chunks smaller and larger
// than N; the forward-only path; bitwise determinism of two runs; the FP32 logits of selected
// rows (classifier_logits) with a row step.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/classifier.cuh"
#include "../coat/random.h"
#include "check.h"
#include "gpu_test_util.cuh"
extern "C" {
#include "reference_llama.h"
}

// One device run's outputs, copied back as raw bytes for the bitwise comparison.
typedef struct {
    float *losses;  // [N]
    bf16 *dx;       // [N, C]
    bf16 *dweight;  // [V, C]
} ClassifierOutputs;

static void test_case(GpuContext *gpu, int N, int C, int V, int chunk_rows) {
    Random rng;
    random_seed(&rng, 7 + (uint64_t)V);
    size_t xn = (size_t)N * C, wn = (size_t)V * C;
    // Logits of order 1 (std ~0.8 at C = 64): a peaked enough softmax, small BF16 rounding.
    float *x = random_uniform_bf16_values(&rng, xn, 1.0f);
    float *w = random_uniform_bf16_values(&rng, wn, 0.3f);
    float *dw_before = random_uniform_bf16_values(&rng, wn, 0.01f);
    int *targets = (int *)host_alloc((size_t)N * sizeof(int));
    for (int i = 0; i < N; i++) targets[i] = (int)random_below(&rng, (uint64_t)V);
    targets[0] = V - 1;  // the last column: the scalar tail when V % 8 != 0
    targets[N - 1] = 0;

    float *logits_ref = host_floats((size_t)N * V);
    float *dlogits_ref = host_floats((size_t)N * V);
    float *losses_ref = host_floats((size_t)N);
    float *dx_ref = host_floats(xn);
    float *dw_ref = host_floats(wn);
    ref_matmul_forward(logits_ref, x, w, N, C, V);
    float mean_ref = ref_cross_entropy_forward(losses_ref, logits_ref, targets, N, V);
    ref_cross_entropy_backward(dlogits_ref, logits_ref, targets, N, V, 1.0f);  // (softmax - onehot) / N
    ref_matmul_backward(dx_ref, dw_ref, dlogits_ref, x, w, N, C, V);

    bf16 *d_x = device_bf16_from(x, xn), *d_w = device_bf16_from(w, wn), *d_dw = device_bf16_from(dw_before, wn);
    bf16 *d_dw_before = device_bf16_from(dw_before, wn);
    int *d_targets;
    float *d_losses, *d_mean;
    bf16 *d_dx, *d_scratch;
    int stride = classifier_logits_stride(V);
    cudaCheck(cudaMalloc(&d_targets, (size_t)N * sizeof(int)));
    cudaCheck(cudaMemcpy(d_targets, targets, (size_t)N * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMalloc(&d_losses, (size_t)N * sizeof(float)));
    cudaCheck(cudaMalloc(&d_mean, sizeof(float)));
    cudaCheck(cudaMalloc(&d_dx, xn * sizeof(bf16)));
    cudaCheck(cudaMalloc(&d_scratch, (size_t)chunk_rows * stride * sizeof(bf16)));

    ClassifierOutputs runs[2];
    for (int run = 0; run < 2; run++) {
        poison_nan(d_losses, (size_t)N * sizeof(float));
        poison_nan(d_dx, xn * sizeof(bf16));
        poison_nan(d_scratch, (size_t)chunk_rows * stride * sizeof(bf16));
        cudaCheck(cudaMemcpy(d_dw, d_dw_before, wn * sizeof(bf16), cudaMemcpyDeviceToDevice));
        classifier_forward_backward(gpu, d_losses, d_dx, d_dw, d_x, d_w, d_targets, N, C, V, 1.0f / N, d_scratch,
                                    chunk_rows);
        cudaCheck(cudaDeviceSynchronize());
        runs[run].losses = host_floats((size_t)N);
        runs[run].dx = host_bf16s(xn);
        runs[run].dweight = host_bf16s(wn);
        cudaCheck(cudaMemcpy(runs[run].losses, d_losses, (size_t)N * sizeof(float), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(runs[run].dx, d_dx, xn * sizeof(bf16), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(runs[run].dweight, d_dw, wn * sizeof(bf16), cudaMemcpyDeviceToHost));
    }

    char name[200];
    // Logits are BF16 on the GPU (2^-9 relative), so a loss may be off by about twice that of
    // the largest logit; the gradients carry about 1% of their largest term.
    snprintf(name, sizeof(name), "losses N=%d C=%d V=%d chunk_rows=%d", N, C, V, chunk_rows);
    check_close(name, runs[0].losses, losses_ref, (size_t)N, 1e-2, 2e-3);

    float *got = host_floats(xn > wn ? xn : wn);
    float *expected = host_floats(wn);
    copy_bf16_to_host(got, d_dx, xn);
    snprintf(name, sizeof(name), "dx N=%d C=%d V=%d chunk_rows=%d", N, C, V, chunk_rows);
    check_close(name, got, dx_ref, xn, 1e-2 * max_abs(dx_ref, xn), 2e-2);

    copy_bf16_to_host(got, d_dw, wn);
    for (size_t i = 0; i < wn; i++) expected[i] = dw_before[i] + dw_ref[i];
    snprintf(name, sizeof(name), "dW += N=%d C=%d V=%d chunk_rows=%d", N, C, V, chunk_rows);
    check_close(name, got, expected, wn, 1e-2 * max_abs(dw_ref, wn), 2e-2);

    check(memcmp(runs[0].losses, runs[1].losses, (size_t)N * sizeof(float)) == 0 &&
              memcmp(runs[0].dx, runs[1].dx, xn * sizeof(bf16)) == 0 &&
              memcmp(runs[0].dweight, runs[1].dweight, wn * sizeof(bf16)) == 0,
          "two runs bitwise equal (losses, dx, dW) N=%d V=%d chunk_rows=%d", N, V, chunk_rows);

    classifier_mean_loss(gpu, d_mean, d_losses, N);
    float mean_got;
    cudaCheck(cudaMemcpy(&mean_got, d_mean, sizeof(float), cudaMemcpyDeviceToHost));
    snprintf(name, sizeof(name), "mean loss N=%d V=%d", N, V);
    check_close(name, &mean_got, &mean_ref, 1, 5e-3, 2e-3);

    // Forward only: the same losses, bit for bit, and nothing else written.
    poison_nan(d_losses, (size_t)N * sizeof(float));
    classifier_forward_backward(gpu, d_losses, NULL, NULL, d_x, d_w, d_targets, N, C, V, 1.0f / N, d_scratch,
                                chunk_rows);
    cudaCheck(cudaMemcpy(got, d_losses, (size_t)N * sizeof(float), cudaMemcpyDeviceToHost));
    int first_diff = 0;
    while (first_diff < N && memcmp(&got[first_diff], &runs[0].losses[first_diff], sizeof(float)) == 0) first_diff++;
    check(first_diff == N, "forward-only losses equal the forward+backward ones N=%d V=%d chunk_rows=%d%s (row %d: %.9g vs %.9g)",
          N, V, chunk_rows, first_diff == N ? "" : ": differ", first_diff % N, (double)got[first_diff % N],
          (double)runs[0].losses[first_diff % N]);

    for (int run = 0; run < 2; run++) {
        free(runs[run].losses);
        free(runs[run].dx);
        free(runs[run].dweight);
    }
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_dw));
    cudaCheck(cudaFree(d_dw_before));
    cudaCheck(cudaFree(d_targets));
    cudaCheck(cudaFree(d_losses));
    cudaCheck(cudaFree(d_mean));
    cudaCheck(cudaFree(d_dx));
    cudaCheck(cudaFree(d_scratch));
    free(x); free(w); free(dw_before); free(targets); free(logits_ref); free(dlogits_ref); free(losses_ref);
    free(dx_ref); free(dw_ref); free(got); free(expected);
}

// FP32 logits of rows first_row, first_row + row_step, ... against the reference logits.
static void test_selected_logits(GpuContext *gpu, int N, int C, int V, int first_row, int row_step, int num_rows) {
    Random rng;
    random_seed(&rng, 11);
    float *x = random_uniform_bf16_values(&rng, (size_t)N * C, 1.0f);
    float *w = random_uniform_bf16_values(&rng, (size_t)V * C, 0.3f);
    float *logits_ref = host_floats((size_t)N * V);
    ref_matmul_forward(logits_ref, x, w, N, C, V);
    int stride = classifier_logits_stride(V);
    bf16 *d_x = device_bf16_from(x, (size_t)N * C), *d_w = device_bf16_from(w, (size_t)V * C);
    float *d_logits;
    cudaCheck(cudaMalloc(&d_logits, (size_t)num_rows * stride * sizeof(float)));
    poison_nan(d_logits, (size_t)num_rows * stride * sizeof(float));
    classifier_logits(gpu, d_logits, d_x, d_w, first_row, row_step, num_rows, C, V);
    float *logits = host_floats((size_t)num_rows * stride);
    cudaCheck(cudaMemcpy(logits, d_logits, (size_t)num_rows * stride * sizeof(float), cudaMemcpyDeviceToHost));
    float *got = host_floats((size_t)num_rows * V);
    float *expected = host_floats((size_t)num_rows * V);
    for (int r = 0; r < num_rows; r++) {
        memcpy(got + (size_t)r * V, logits + (size_t)r * stride, (size_t)V * sizeof(float));
        const float *reference_row = logits_ref + (size_t)(first_row + r * row_step) * V;
        memcpy(expected + (size_t)r * V, reference_row, (size_t)V * sizeof(float));
    }
    char name[160];
    // FP32 output of exact BF16 products summed in FP32: only the summation order differs.
    snprintf(name, sizeof(name), "classifier_logits rows %d + %d*i (i < %d) V=%d", first_row, row_step, num_rows, V);
    check_close(name, got, expected, (size_t)num_rows * V, 1e-4, 1e-4);
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_w));
    cudaCheck(cudaFree(d_logits));
    free(x); free(w); free(logits_ref); free(logits); free(got); free(expected);
}

int main(void) {
    GpuContext gpu;
    gpu_context_create(&gpu, 0);
    check(classifier_logits_stride(1001) == 1008 && classifier_logits_stride(32000) == 32000,
          "logits stride rounds V up to a multiple of 8");
    test_case(&gpu, 37, 64, 1001, 16);
    test_case(&gpu, 37, 64, 1001, 64);
    test_case(&gpu, 20, 32, 37, 8);
    test_case(&gpu, 12, 64, 32000, 5);
    test_selected_logits(&gpu, 37, 64, 1001, 2, 5, 7);
    gpu_context_destroy(&gpu);
    return check_summary("test_classifier");
}
