// SwiGLU activation of the Llama MLP, on the fused gate/up projection output. FP32 math.
//   forward:  out = silu(gate) * up,  silu(g) = g * sigmoid(g)
//   backward: dgate = dout * up * sigmoid(g) * (1 + g * (1 - sigmoid(g))),  dup = dout * silu(g)
// Layouts: gate_up and dgate_up [N, 2I] BF16, each row the I gate values then the I up values;
// out, dout [N, I] BF16. 16-byte vectors: I must be a multiple of 8, pointers 16-byte aligned.
// In COAT mode gate_up is saved as its 1x16 E4M3 copy (coat/fp8.cuh), made by the forward
// kernel, which computes out from the copy so that forward and backward see the same values;
// out and dgate_up, FP8 GEMM inputs, have their amax gathered by the kernels that write them.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

#define SWIGLU_THREADS 256

// The hardware exp2 and reciprocal: a few ulp of FP32, far below the BF16 rounding of every
// value computed from it, and a third of the instructions of expf and a division (the FP8
// kernels that recompute SwiGLU are bound by instructions, not memory).
__device__ __forceinline__ float sigmoid_fp32(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }

// This thread's WIDTH gate and WIDTH up values at `column` of `row` (WIDTH 8 or 16, 16 only at a
// group's start): from BF16 gate_up, or from its 1x16 copy (groups.codes set).
template <bool GROUP16, int WIDTH>
__device__ __forceinline__ void swiglu_load(float gate[WIDTH], float up[WIDTH], const bf16 *gate_up, Fp8Groups groups,
                                            size_t row, size_t column, int I) {
    if (GROUP16) {
        const uint8_t *codes = groups.codes + row * 2 * I;
        const bf16 *scales = groups.scales + row * (2 * I / FP8_GROUP);
        if (WIDTH == FP8_GROUP) {
            fp8_load_group(gate, codes, scales, (int)column);
            fp8_load_group(up, codes, scales, (int)(column + I));
        } else {
            fp8_load_group16(gate, codes, scales, (int)column);
            fp8_load_group16(up, codes, scales, (int)(column + I));
        }
    } else {
        for (int h = 0; h < WIDTH; h += 8) {
            size_t offset = row * 2 * I + column + h;
            Vec16<bf16> g = load16_stream(gate_up + offset), u = load16_stream(gate_up + offset + I);
            for (int k = 0; k < 8; k++) {
                gate[h + k] = __bfloat162float(g[k]);
                up[h + k] = __bfloat162float(u[k]);
            }
        }
    }
}

// The forward's output and the backward's two gradients in FP32, before their rounding to BF16.
// The kernels' amax takes them so and rounds the max once: rounding is monotone, so the max of the
// rounded values is the rounded max.
__device__ __forceinline__ float swiglu_value_fp32(float gate, float up) { return gate * sigmoid_fp32(gate) * up; }
__device__ __forceinline__ void swiglu_gradients_fp32(float gate, float up, float grad, float *dgate, float *dup) {
    float s = sigmoid_fp32(gate);
    *dgate = grad * up * s * (1.0f + gate * (1.0f - s));
    *dup = grad * gate * s;
}
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// The same, each rounded to BF16 as stored.
__device__ __forceinline__ float swiglu_value(float gate, float up) { return round_bf16(swiglu_value_fp32(gate, up)); }
__device__ __forceinline__ void swiglu_gradients(float gate, float up, float grad, float *dgate, float *dup) {
    swiglu_gradients_fp32(gate, up, grad, dgate, dup);
    *dgate = round_bf16(*dgate);
    *dup = round_bf16(*dup);
}

// The kernels' threads: one per WIDTH columns of a row (gate and up), WIDTH = swiglu_width(GROUP16).
// With 1x16 groups a thread holds whole groups: it finds their max alone (no shuffle), computes
// each scale once and moves 16 codes at a time. Index math in 32 bits (the launcher checks that
// the threads fit): no 64-bit division, nor the run-time test that picks its 32-bit form.
static __host__ __device__ constexpr int swiglu_width(bool group16) { return group16 ? FP8_GROUP : 8; }

__device__ __forceinline__ void swiglu_thread_position(int I, int width, unsigned *row, unsigned *column) {
    unsigned thread = blockIdx.x * SWIGLU_THREADS + threadIdx.x, threads_per_row = (unsigned)(I / width);
    *row = thread / threads_per_row;
    *column = (thread - *row * threads_per_row) * width;
}

// GROUP16: also stores the 1x16 copy of gate_up and computes out from it, as the backward will.
// AMAX: max |out| goes to out_amax (every thread reaches the block's amax). out == NULL: not
// stored (the FP8 cast recomputes it).
template <bool GROUP16, bool AMAX>
__global__ void __launch_bounds__(SWIGLU_THREADS)
    swiglu_forward_kernel(bf16 *out, Fp8Groups gate_up_copy, Fp8Scale *out_amax, const bf16 *gate_up, int I,
                          unsigned threads) {
    constexpr int WIDTH = swiglu_width(GROUP16);
    float out_max = 0.0f;
    if (blockIdx.x * SWIGLU_THREADS + threadIdx.x < threads) {
        unsigned row, column;
        swiglu_thread_position(I, WIDTH, &row, &column);
        float gate[WIDTH], up[WIDTH];
        swiglu_load<false, WIDTH>(gate, up, gate_up, gate_up_copy, row, column, I);
        if (GROUP16) {
            uint8_t *codes = gate_up_copy.codes + (size_t)row * 2 * I;
            bf16 *scales = gate_up_copy.scales + (size_t)row * (2 * I / FP8_GROUP);
            bf16 gate_scale, up_scale;
            uint4 gate_codes = fp8_quantize_group(gate, &gate_scale), up_codes = fp8_quantize_group(up, &up_scale);
            *reinterpret_cast<uint4 *>(codes + column) = gate_codes;
            *reinterpret_cast<uint4 *>(codes + column + I) = up_codes;
            scales[column / FP8_GROUP] = gate_scale;
            scales[(column + I) / FP8_GROUP] = up_scale;
            fp8_dequantize16(gate, gate_codes, __bfloat162float(gate_scale));
            fp8_dequantize16(up, up_codes, __bfloat162float(up_scale));
        }
        for (int h = 0; h < WIDTH; h += 8) {
            Vec16<bf16> o;
            for (int k = 0; k < 8; k++) {
                float value = swiglu_value_fp32(gate[h + k], up[h + k]);
                o[k] = __float2bfloat16(value);
                if (AMAX) out_max = fp8_abs_max(out_max, value);
            }
            if (out != NULL) store16(out + (size_t)row * I + column + h, o);
        }
    }
    if (AMAX) fp8_block_amax(out_amax, round_bf16(out_max));
}

// gate_up is BF16, or its 1x16 copy (GROUP16). AMAX: max |dgate_up| goes to dgate_up_amax.
// dgate_up == NULL: not stored (the FP8 cast recomputes it).
template <bool GROUP16, bool AMAX>
__global__ void __launch_bounds__(SWIGLU_THREADS)
    swiglu_backward_kernel(bf16 *dgate_up, Fp8Scale *dgate_up_amax, const bf16 *dout, const bf16 *gate_up,
                           Fp8Groups gate_up_groups, int I, unsigned threads) {
    constexpr int WIDTH = swiglu_width(GROUP16);
    float grad_max = 0.0f;
    if (blockIdx.x * SWIGLU_THREADS + threadIdx.x < threads) {
        unsigned row, column;
        swiglu_thread_position(I, WIDTH, &row, &column);
        float gate[WIDTH], up[WIDTH];
        swiglu_load<GROUP16, WIDTH>(gate, up, gate_up, gate_up_groups, row, column, I);
        for (int h = 0; h < WIDTH; h += 8) {
            size_t gate_offset = (size_t)row * 2 * I + column + h;
            Vec16<bf16> d = load16_stream(dout + (size_t)row * I + column + h);
            Vec16<bf16> dg, du;
            for (int k = 0; k < 8; k++) {
                float dgate, dup;
                swiglu_gradients_fp32(gate[h + k], up[h + k], __bfloat162float(d[k]), &dgate, &dup);
                dg[k] = __float2bfloat16(dgate);
                du[k] = __float2bfloat16(dup);
                if (AMAX) grad_max = fp8_abs_max(fp8_abs_max(grad_max, dgate), dup);
            }
            if (dgate_up != NULL) {
                store16(dgate_up + gate_offset, dg);
                store16(dgate_up + gate_offset + I, du);
            }
        }
    }
    if (AMAX) fp8_block_amax(dgate_up_amax, round_bf16(grad_max));
}

// Sources of the FP8 cast pass (coat/fp8.cuh) that recompute the SwiGLU output, or the two
// gradients, from the kernels' inputs instead of reading a BF16 copy: the same values, bit for
// bit, as the kernels above store.
template <bool GROUP16>
struct SwigluSource {
    static constexpr int PLANES = 1;
    const bf16 *gate_up;
    Fp8Groups groups;
    int I;
    __device__ __forceinline__ void load(int r, int c, float v[1][8]) const {
        float gate[8], up[8];
        swiglu_load<GROUP16, 8>(gate, up, gate_up, groups, (size_t)r, (size_t)c, I);
        for (int k = 0; k < 8; k++) v[0][k] = swiglu_value(gate[k], up[k]);
    }
};

template <bool GROUP16>
struct SwigluGradSource {
    static constexpr int PLANES = 2;  // dgate, then dup: the layout of dgate_up
    const bf16 *dout, *gate_up;
    Fp8Groups groups;
    int I;
    __device__ __forceinline__ void load(int r, int c, float v[2][8]) const {
        float gate[8], up[8];
        swiglu_load<GROUP16, 8>(gate, up, gate_up, groups, (size_t)r, (size_t)c, I);
        Vec16<bf16> d = load16_stream(dout + (size_t)r * I + c);
        for (int k = 0; k < 8; k++) swiglu_gradients(gate[k], up[k], __bfloat162float(d[k]), &v[0][k], &v[1][k]);
    }
};

// The threads of a kernel launch (one per swiglu_width columns of a row), checked to fit 32 bits.
static inline unsigned swiglu_threads(const char *launcher, int N, int I, bool group16) {
    require_vector_rows(launcher, "I", I);
    if (group16 && I % FP8_GROUP != 0) fail_with(launcher, "I must be a multiple of 16 for 1x16 groups");
    size_t threads = (size_t)N * (size_t)(I / swiglu_width(group16));
    if (threads > UINT32_MAX - SWIGLU_THREADS) fail_with(launcher, "N * I must be below 2^34 (32-bit thread indices)");
    return (unsigned)threads;
}

// out[N, I] = silu(gate) * up (out may be NULL). Optional: gate_up_copy.codes, the 1x16 E4M3
// copy of gate_up (then out is computed from it); out_amax, max |out|.
static inline void swiglu_forward(bf16 *out, const bf16 *gate_up, int N, int I, cudaStream_t stream,
                                  Fp8Groups gate_up_copy = Fp8Groups{NULL, NULL}, Fp8Scale *out_amax = NULL) {
    bool group16 = gate_up_copy.codes != NULL, amax = out_amax != NULL;
    unsigned threads = swiglu_threads("swiglu_forward", N, I, group16);
    unsigned blocks = (unsigned)ceil_div_size(threads, SWIGLU_THREADS);
    launch_with_flags(group16, amax, [&](auto GROUP16, auto AMAX) {
        swiglu_forward_kernel<decltype(GROUP16)::value, decltype(AMAX)::value>
            <<<blocks, SWIGLU_THREADS, 0, stream>>>(out, gate_up_copy, out_amax, gate_up, I, threads);
    });
    cudaCheckLaunch();
}

// dgate_up[N, 2I] is written (not accumulated; may be NULL): the gradients of gate and up.
// gate_up is BF16, or gate_up_groups when its codes are set. Optional: dgate_up_amax.
static inline void swiglu_backward(bf16 *dgate_up, const bf16 *dout, const bf16 *gate_up, int N, int I,
                                   cudaStream_t stream, Fp8Groups gate_up_groups = Fp8Groups{NULL, NULL},
                                   Fp8Scale *dgate_up_amax = NULL) {
    bool group16 = gate_up_groups.codes != NULL, amax = dgate_up_amax != NULL;
    unsigned threads = swiglu_threads("swiglu_backward", N, I, group16);
    unsigned blocks = (unsigned)ceil_div_size(threads, SWIGLU_THREADS);
    launch_with_flags(group16, amax, [&](auto GROUP16, auto AMAX) {
        swiglu_backward_kernel<decltype(GROUP16)::value, decltype(AMAX)::value>
            <<<blocks, SWIGLU_THREADS, 0, stream>>>(dgate_up, dgate_up_amax, dout, gate_up, gate_up_groups, I, threads);
    });
    cudaCheckLaunch();
}

// The FP8 casts that follow swiglu_forward / swiglu_backward with an amax (which gathered
// slot->amax): out [N, I] and/or out_t [I, N] E4M3 from the recomputed output; dq [N, 2I] and
// dq_t [2I, N] E5M2 from the recomputed gradients. gate_up as for those kernels.
static inline void swiglu_forward_cast(uint8_t *out, uint8_t *out_t, Fp8Scale *slot, const bf16 *gate_up,
                                       Fp8Groups groups, int N, int I, cudaStream_t stream) {
    if (groups.codes != NULL)
        fp8_quantize_source(out, out_t, slot, SwigluSource<true>{gate_up, groups, I}, N, I, FP8_E4M3, stream);
    else
        fp8_quantize_source(out, out_t, slot, SwigluSource<false>{gate_up, groups, I}, N, I, FP8_E4M3, stream);
}

static inline void swiglu_backward_cast(uint8_t *dq, uint8_t *dq_t, Fp8Scale *slot, const bf16 *dout,
                                        const bf16 *gate_up, Fp8Groups groups, int N, int I, cudaStream_t stream) {
    if (groups.codes != NULL)
        fp8_quantize_source(dq, dq_t, slot, SwigluGradSource<true>{dout, gate_up, groups, I}, N, I, FP8_E5M2, stream);
    else
        fp8_quantize_source(dq, dq_t, slot, SwigluGradSource<false>{dout, gate_up, groups, I}, N, I, FP8_E5M2, stream);
}
