// The lm_head fused with the cross-entropy loss: the loss of every position and, when asked,
// the gradients of x and of the lm_head weight, without ever storing all [N,V] logits nor
// the probabilities.
//
//   logits_i  = x_i W^T                       x [N,C], W [V,C] (HF layout), both BF16
//   loss_i    = logsumexp(logits_i) - logits_i[target_i]                        (FP32)
//   dlogits_i = dloss * (softmax(logits_i) - onehot(target_i))
//   dx = dlogits W (written),   dW += dlogits^T x
//
// Rows go in chunks of chunk_rows: a chunk's logits land in logits_scratch, BF16
// [chunk_rows, classifier_logits_stride(V)], and are overwritten in place by dlogits before the
// two backward GEMMs read them, so the memory is chunk_rows * V * 2 bytes whatever N is. The
// stride rounds V up to a multiple of 8 so that every row starts on 16 bytes, as cuBLASLt and
// the vector loads need; the padding columns are never read.
// Softmax math is FP32, one block per row; every reduction has a fixed order and cuBLASLt
// reuses its cached algorithm, so two runs give the same bits.
#pragma once
#include <math.h>
#include "common.cuh"
#include "matmul.cuh"

#define CLASSIFIER_THREADS 512

// Elements between two rows of the logits scratch (and of classifier_logits' output).
static inline int classifier_logits_stride(int V) { return (V + 7) / 8 * 8; }

// Merges two partial softmax statistics (running max, sum of exp(x - max)). Symmetric in its
// two arguments, so a butterfly reduction leaves the same bits on every lane.
__device__ __forceinline__ void cross_entropy_stats_merge(float &running_max, float &running_sum, float other_max,
                                                          float other_sum) {
    float merged_max = fmaxf(running_max, other_max);
    float own = running_max == merged_max ? running_sum : running_sum * expf(running_max - merged_max);
    float other = other_max == merged_max ? other_sum : other_sum * expf(other_max - merged_max);
    running_max = merged_max;
    running_sum = own + other;
}

// Adds values[0..count) to a thread's running statistics.
__device__ __forceinline__ void cross_entropy_stats_add(float &running_max, float &running_sum, const float *values,
                                                        int count) {
    float new_max = running_max;
    for (int i = 0; i < count; i++) new_max = fmaxf(new_max, values[i]);
    if (new_max != running_max) running_sum *= expf(running_max - new_max);
    for (int i = 0; i < count; i++) running_sum += expf(values[i] - new_max);
    running_max = new_max;
}

// Every thread of the block ends with the statistics of the whole row.
__device__ void cross_entropy_stats_block_reduce(float &running_max, float &running_sum) {
    __shared__ float warp_maxes[32], warp_sums[32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other_max = __shfl_xor_sync(0xffffffffu, running_max, offset);
        float other_sum = __shfl_xor_sync(0xffffffffu, running_sum, offset);
        cross_entropy_stats_merge(running_max, running_sum, other_max, other_sum);
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, num_warps = blockDim.x / 32;
    if (lane == 0) {
        warp_maxes[warp] = running_max;
        warp_sums[warp] = running_sum;
    }
    __syncthreads();
    running_max = lane < num_warps ? warp_maxes[lane] : -INFINITY;
    running_sum = lane < num_warps ? warp_sums[lane] : 0.0f;
    for (int offset = 16; offset > 0; offset >>= 1) {
        float other_max = __shfl_xor_sync(0xffffffffu, running_max, offset);
        float other_sum = __shfl_xor_sync(0xffffffffu, running_sum, offset);
        cross_entropy_stats_merge(running_max, running_sum, other_max, other_sum);
    }
}

// One block per row of logits [rows, stride]: losses[row] = logsumexp - logit[target]; with
// write_dlogits the row is then overwritten by dloss * (softmax - onehot). Full 16-byte vectors
// first, then a scalar tail for V not a multiple of 8.
__global__ void __launch_bounds__(CLASSIFIER_THREADS)
    cross_entropy_rows_kernel(float *losses, bf16 *logits, int stride, const int *targets, int V, float dloss,
                              int write_dlogits) {
    const int vec = Vec16<bf16>::size;
    bf16 *row_logits = logits + (size_t)blockIdx.x * stride;
    int target = targets[blockIdx.x];
    // Read before the block reduction's barrier: after it, other threads overwrite the row.
    float target_logit = threadIdx.x == 0 ? __bfloat162float(row_logits[target]) : 0.0f;
    int num_vectors = V / vec, tail_start = num_vectors * vec;

    float running_max = -INFINITY, running_sum = 0.0f;
    for (int v = threadIdx.x; v < num_vectors; v += blockDim.x) {
        Vec16<bf16> packed = load16(row_logits + (size_t)v * vec);
        float values[vec];
        for (int i = 0; i < vec; i++) values[i] = __bfloat162float(packed[i]);
        cross_entropy_stats_add(running_max, running_sum, values, vec);
    }
    for (int i = tail_start + threadIdx.x; i < V; i += blockDim.x) {
        float value = __bfloat162float(row_logits[i]);
        cross_entropy_stats_add(running_max, running_sum, &value, 1);
    }
    cross_entropy_stats_block_reduce(running_max, running_sum);
    float logsumexp = running_max + logf(running_sum);
    if (threadIdx.x == 0) losses[blockIdx.x] = logsumexp - target_logit;
    if (!write_dlogits) return;

    for (int v = threadIdx.x; v < num_vectors; v += blockDim.x) {
        Vec16<bf16> packed = load16(row_logits + (size_t)v * vec);
        for (int i = 0; i < vec; i++) {
            float prob = expf(__bfloat162float(packed[i]) - logsumexp);
            float onehot = v * vec + i == target ? 1.0f : 0.0f;
            packed[i] = __float2bfloat16(dloss * (prob - onehot));
        }
        store16(row_logits + (size_t)v * vec, packed);
    }
    for (int i = tail_start + threadIdx.x; i < V; i += blockDim.x) {
        float prob = expf(__bfloat162float(row_logits[i]) - logsumexp);
        float onehot = i == target ? 1.0f : 0.0f;
        row_logits[i] = __float2bfloat16(dloss * (prob - onehot));
    }
}

// One block; each thread sums a fixed strided subset, then a fixed tree: the same bits every run.
__global__ void __launch_bounds__(1024) loss_mean_kernel(float *mean, const float *values, int n) {
    __shared__ float warp_sums[32];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) sum += values[i];
    sum = warp_sum(sum);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x < 32) {
        sum = threadIdx.x < blockDim.x / 32 ? warp_sums[threadIdx.x] : 0.0f;
        sum = warp_sum(sum);
        if (threadIdx.x == 0) *mean = sum / (float)n;
    }
}

static inline void classifier_check_args(const char *caller, int rows, int C, int V) {
    if (rows <= 0 || C <= 0 || V <= 0 || C % 8 != 0) {
        fprintf(stderr, "error: %s: need positive sizes and C a multiple of 8 (got rows=%d C=%d V=%d)\n", caller, rows,
                C, V);
        exit(EXIT_FAILURE);
    }
}

// losses[N] (FP32, per position) for x [N,C] against targets [N] (each in [0,V)); when dx or
// dweight is not NULL, also dx [N,C] (written) and dweight [V,C] (+=; = without accumulate), the
// gradients of sum_i dloss * loss_i (dloss = d(total loss)/d(loss_i), e.g. 1 / (N * grad_accum_steps)).
// logits_scratch holds chunk_rows rows of classifier_logits_stride(V) BF16 elements.
static inline void classifier_forward_backward(GpuContext *gpu, float *losses, bf16 *dx, bf16 *dweight,
                                               const bf16 *x, const bf16 *weight, const int *targets, int N, int C,
                                               int V, float dloss, bf16 *logits_scratch, int chunk_rows,
                                               bool accumulate = true) {
    classifier_check_args("classifier_forward_backward", N, C, V);
    if (chunk_rows <= 0) {
        fprintf(stderr, "error: classifier_forward_backward: chunk_rows must be positive (got %d)\n", chunk_rows);
        exit(EXIT_FAILURE);
    }
    int stride = classifier_logits_stride(V);
    int backward = dx != NULL || dweight != NULL;
    MatmulOperand weight_k_major = matmul_operand(weight, DTYPE_BF16, MATMUL_K_MAJOR, C, NULL);
    MatmulOperand weight_v_major = matmul_operand(weight, DTYPE_BF16, MATMUL_MN_MAJOR, C, NULL);
    for (int start = 0; start < N; start += chunk_rows) {
        int rows = N - start < chunk_rows ? N - start : chunk_rows;
        const bf16 *x_chunk = x + (size_t)start * C;
        // logits [rows, V] = x_chunk W^T
        matmul_lt(gpu, matmul_output(logits_scratch, DTYPE_BF16, stride),
                  matmul_operand(x_chunk, DTYPE_BF16, MATMUL_K_MAJOR, C, NULL), weight_k_major, rows, V, C, false,
                  false);
        cross_entropy_rows_kernel<<<rows, CLASSIFIER_THREADS, 0, gpu->stream>>>(
            losses + start, logits_scratch, stride, targets + start, V, dloss, backward);
        cudaCheckLaunch();
        // dx_chunk [rows, C] = dlogits [rows, V] W [V, C]
        if (dx != NULL)
            matmul_lt(gpu, matmul_output(dx + (size_t)start * C, DTYPE_BF16, C),
                      matmul_operand(logits_scratch, DTYPE_BF16, MATMUL_K_MAJOR, stride, NULL), weight_v_major, rows,
                      C, V, false, false);
        // dW [V, C] += dlogits^T [V, rows] x_chunk [rows, C] (the first chunk writes without accumulate)
        if (dweight != NULL)
            matmul_lt(gpu, matmul_output(dweight, DTYPE_BF16, C),
                      matmul_operand(logits_scratch, DTYPE_BF16, MATMUL_MN_MAJOR, stride, NULL),
                      matmul_operand(x_chunk, DTYPE_BF16, MATMUL_MN_MAJOR, C, NULL), V, C, rows,
                      accumulate || start > 0, false);
    }
}

// FP32 logits of the rows first_row, first_row + row_step, ... (num_rows of them) of x [*, C],
// e.g. the last position of each sequence for sampling: logits [num_rows, classifier_logits_stride(V)].
static inline void classifier_logits(GpuContext *gpu, float *logits, const bf16 *x, const bf16 *weight, int first_row,
                                     int row_step, int num_rows, int C, int V) {
    classifier_check_args("classifier_logits", num_rows, C, V);
    if (first_row < 0 || row_step <= 0) {
        fprintf(stderr, "error: classifier_logits: need first_row >= 0 and row_step > 0 (got %d, %d)\n", first_row,
                row_step);
        exit(EXIT_FAILURE);
    }
    matmul_lt(gpu, matmul_output(logits, DTYPE_FP32, classifier_logits_stride(V)),
              matmul_operand(x + (size_t)first_row * C, DTYPE_BF16, MATMUL_K_MAJOR, row_step * C, NULL),
              matmul_operand(weight, DTYPE_BF16, MATMUL_K_MAJOR, C, NULL), num_rows, V, C, false, false);
}

// *mean_loss (device) = the mean of losses [N], summed in a fixed order.
static inline void classifier_mean_loss(GpuContext *gpu, float *mean_loss, const float *losses, int N) {
    if (N <= 0) {
        fprintf(stderr, "error: classifier_mean_loss: N must be positive (got %d)\n", N);
        exit(EXIT_FAILURE);
    }
    loss_mean_kernel<<<1, 1024, 0, gpu->stream>>>(mean_loss, losses, N);
    cudaCheckLaunch();
}
