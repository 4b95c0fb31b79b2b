// Rotary position embedding (RoPE), Hugging Face "half split" form, applied in place to the
// q and k heads of the packed QKV projection output.
//   forward:  for i < D/2, with c = cos[t, i], s = sin[t, i]:
//             x'[i] = x[i] * c - x[i + D/2] * s,   x'[i + D/2] = x[i + D/2] * c + x[i] * s
//   backward: the inverse (transposed) rotation, the same with s -> -s. The attention backward
//             applies it to dQ and dK as it stores them (AttentionRopeBackward, coat/attention.cuh).
// Layouts: qkv [B, T, (n_heads + 2 * n_kv_heads) * D] BF16: per row the q heads, then the k heads,
// then the v heads (left untouched). Tables cos, sin [T, D/2] FP32 on the device.
// Tables: angle(t, i) = t * inv_freq(i), inv_freq(i) = theta^(-2i/D), optionally rescaled the
// Llama 3.1 way; computed in double on the host.
// Each thread rotates 8 pairs with 16-byte loads: D must be a multiple of 16.
#pragma once
#include <math.h>
#include "common.cuh"
#include "model_shape.h"

// (x c - y s, y c + x s), each an FMA onto the other product rounded on its own, written out so that
// the compiler contracts nothing and every kernel that rotates (and the tests' host code) gets the
// same bits.
static __host__ __device__ __forceinline__ float2 rope_rotate(float x, float y, float c, float s) {
#ifdef __CUDA_ARCH__
    return make_float2(__fmaf_rn(x, c, -__fmul_rn(y, s)), __fmaf_rn(y, c, __fmul_rn(x, s)));
#else
    const float ys = y * s, xs = x * s;
    return make_float2(fmaf(x, c, -ys), fmaf(y, c, xs));
#endif
}

#define ROPE_THREADS 256

// One thread per (row, head, group of 8 pairs) of the rotated heads (q, k).
__global__ void __launch_bounds__(ROPE_THREADS)
    rope_forward_kernel(bf16 *qkv, const float *cos_table, const float *sin_table, int T, int rotated_heads,
                        int row_width, int head_dim, size_t total_groups) {
    size_t group = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (group >= total_groups) return;
    int half = head_dim / 2;
    int groups_per_head = half / 8;
    int pair = (int)(group % groups_per_head) * 8;
    size_t head_row = group / groups_per_head;
    int head = (int)(head_row % rotated_heads);
    size_t row = head_row / rotated_heads;  // b * T + t
    int t = (int)(row % T);
    bf16 *x = qkv + row * row_width + (size_t)head * head_dim + pair;
    Vec16<bf16> lo = load16(x), hi = load16(x + half);
    const float4 *cos4 = reinterpret_cast<const float4 *>(cos_table + (size_t)t * half + pair);
    const float4 *sin4 = reinterpret_cast<const float4 *>(sin_table + (size_t)t * half + pair);
    float4 cos_a = cos4[0], cos_b = cos4[1], sin_a = sin4[0], sin_b = sin4[1];
    float c[8] = {cos_a.x, cos_a.y, cos_a.z, cos_a.w, cos_b.x, cos_b.y, cos_b.z, cos_b.w};
    float s[8] = {sin_a.x, sin_a.y, sin_a.z, sin_a.w, sin_b.x, sin_b.y, sin_b.z, sin_b.w};
    for (int k = 0; k < 8; k++) {
        float2 r = rope_rotate(__bfloat162float(lo[k]), __bfloat162float(hi[k]), c[k], s[k]);
        lo[k] = __float2bfloat16(r.x);
        hi[k] = __float2bfloat16(r.y);
    }
    store16(x, lo);
    store16(x + half, hi);
}

// inv_freq(i) for i < head_dim/2, in double; Llama 3.1 scaling (Hugging Face's
// _compute_llama3_parameters) when shape->rope_scaling_factor > 0: wavelengths shorter than
// original_len / high_freq_factor are kept, longer than original_len / low_freq_factor are
// divided by the factor, and the band between is interpolated.
static inline double rope_inverse_frequency(int i, const ModelShape *shape) {
    int head_dim = model_head_dim(shape);
    double inv_freq = pow((double)shape->rope_theta, -2.0 * i / head_dim);
    if (shape->rope_scaling_factor <= 0.0f) return inv_freq;
    double factor = shape->rope_scaling_factor;
    double low_freq_factor = shape->rope_low_freq_factor, high_freq_factor = shape->rope_high_freq_factor;
    double original_len = shape->rope_original_max_seq_len;
    double wavelength = 6.283185307179586 / inv_freq;  // 2 pi / inv_freq
    if (wavelength < original_len / high_freq_factor) return inv_freq;
    if (wavelength > original_len / low_freq_factor) return inv_freq / factor;
    double smooth = (original_len / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor);
    return (1.0 - smooth) * inv_freq / factor + smooth * inv_freq;
}

// cos_host, sin_host [T, head_dim/2]: angle t * inv_freq(i), evaluated in double, stored as FP32.
static inline void rope_table_init(float *cos_host, float *sin_host, int T, const ModelShape *shape) {
    int half = model_head_dim(shape) / 2;
    for (int i = 0; i < half; i++) {
        double inv_freq = rope_inverse_frequency(i, shape);
        for (int t = 0; t < T; t++) {
            double angle = (double)t * inv_freq;
            cos_host[(size_t)t * half + i] = (float)cos(angle);
            sin_host[(size_t)t * half + i] = (float)sin(angle);
        }
    }
}

// Rotates the q and k heads of qkv in place by position t of each row.
static inline void rope_forward(bf16 *qkv, const float *cos_table, const float *sin_table, int B, int T, int n_heads,
                                int n_kv_heads, int head_dim, cudaStream_t stream) {
    if (head_dim <= 0 || head_dim % 16 != 0) {
        fprintf(stderr, "error: rope_forward: head_dim = %d must be a positive multiple of 16 (16-byte vectors)\n",
                head_dim);
        exit(EXIT_FAILURE);
    }
    int rotated_heads = n_heads + n_kv_heads, row_width = (n_heads + 2 * n_kv_heads) * head_dim;
    size_t total_groups = (size_t)B * T * rotated_heads * (head_dim / 16);
    unsigned blocks = (unsigned)ceil_div_size(total_groups, ROPE_THREADS);
    rope_forward_kernel<<<blocks, ROPE_THREADS, 0, stream>>>(qkv, cos_table, sin_table, T, rotated_heads, row_width,
                                                             head_dim, total_groups);
    cudaCheckLaunch();
}
