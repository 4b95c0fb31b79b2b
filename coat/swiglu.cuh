// SwiGLU activation of the Llama MLP, on the fused gate/up projection output. FP32 math.
//   forward:  out = silu(gate) * up,  silu(g) = g * sigmoid(g)
//   backward: dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g)
// Layouts: gate_up and dgate_up [N, 2I] BF16, each row the I gate values then the I up values;
// out, dout [N, I] BF16. 16-byte vectors: I must be a multiple of 8, pointers 16-byte aligned.
#pragma once
#include "common.cuh"

#define SWIGLU_THREADS 256

__device__ __forceinline__ float sigmoid_fp32(float x) { return 1.0f / (1.0f + expf(-x)); }

// One thread per 8 consecutive outputs of a row.
__global__ void __launch_bounds__(SWIGLU_THREADS)
    swiglu_forward_kernel(bf16 *out, const bf16 *gate_up, int I, size_t total_vecs) {
    size_t vec = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= total_vecs) return;
    size_t vecs_per_row = (size_t)I / 8;
    size_t row = vec / vecs_per_row, column = (vec % vecs_per_row) * 8;
    const bf16 *gate = gate_up + row * 2 * I + column;
    Vec16<bf16> g = load16_stream(gate), u = load16_stream(gate + I);
    Vec16<bf16> o;
    for (int k = 0; k < 8; k++) {
        float x = __bfloat162float(g[k]);
        o[k] = __float2bfloat16(x * sigmoid_fp32(x) * __bfloat162float(u[k]));
    }
    store16(out + row * I + column, o);
}

__global__ void __launch_bounds__(SWIGLU_THREADS)
    swiglu_backward_kernel(bf16 *dgate_up, const bf16 *dout, const bf16 *gate_up, int I, size_t total_vecs) {
    size_t vec = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (vec >= total_vecs) return;
    size_t vecs_per_row = (size_t)I / 8;
    size_t row = vec / vecs_per_row, column = (vec % vecs_per_row) * 8;
    size_t gate_offset = row * 2 * I + column;
    Vec16<bf16> g = load16_stream(gate_up + gate_offset), u = load16_stream(gate_up + gate_offset + I);
    Vec16<bf16> d = load16_stream(dout + row * I + column);
    Vec16<bf16> dg, du;
    for (int k = 0; k < 8; k++) {
        float x = __bfloat162float(g[k]), up = __bfloat162float(u[k]), grad = __bfloat162float(d[k]);
        float s = sigmoid_fp32(x);
        dg[k] = __float2bfloat16(grad * up * s * (1.0f + x * (1.0f - s)));
        du[k] = __float2bfloat16(grad * x * s);
    }
    store16(dgate_up + gate_offset, dg);
    store16(dgate_up + gate_offset + I, du);
}

// out[N, I] = silu(gate) * up.
static inline void swiglu_forward(bf16 *out, const bf16 *gate_up, int N, int I, cudaStream_t stream) {
    require_vector_rows("swiglu_forward", "I", I);
    size_t total_vecs = (size_t)N * (size_t)(I / 8);
    unsigned blocks = (unsigned)ceil_div_size(total_vecs, SWIGLU_THREADS);
    swiglu_forward_kernel<<<blocks, SWIGLU_THREADS, 0, stream>>>(out, gate_up, I, total_vecs);
    cudaCheckLaunch();
}

// dgate_up[N, 2I] is written (not accumulated): the gradients of gate and up.
static inline void swiglu_backward(bf16 *dgate_up, const bf16 *dout, const bf16 *gate_up, int N, int I,
                                   cudaStream_t stream) {
    require_vector_rows("swiglu_backward", "I", I);
    size_t total_vecs = (size_t)N * (size_t)(I / 8);
    unsigned blocks = (unsigned)ceil_div_size(total_vecs, SWIGLU_THREADS);
    swiglu_backward_kernel<<<blocks, SWIGLU_THREADS, 0, stream>>>(dgate_up, dout, gate_up, I, total_vecs);
    cudaCheckLaunch();
}
