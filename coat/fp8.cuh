// FP8 casts and quantizers (coat/README.md, FP8 formats; Scaling), shared by the activations,
// the FP8 linear layers and the optimizer.
//   cast:        q = fp8_satfinite(x / s), round to nearest even, +-max on overflow, NaN stays NaN
//   per tensor:  s = (amax + 1e-10) / 448 (E4M3) or / 57344 (E5M2), amax = max |x| of the tensor
//   1x16 groups: the same rule per 16 consecutive values of a row, E4M3, one BF16 scale each
// Scales are dequantization factors (x ~ q * s), computed in FP32, rounded to their storage
// type (FP32 per tensor, BF16 per group: half the bytes of FP32 scales, 1/8 byte per value),
// and the data is divided by the rounded scale, so quantize and dequantize use one number.
// Per-tensor scaling is just in time and in two passes ("Group Scaling"): the kernel that
// produces a tensor folds the maxima of its rows into Fp8Scale.amax (one atomic max per block:
// the result does not depend on the order), and the cast pass reads it, stores the scale and
// writes the FP8 tensor and, where a weight gradient needs it, its transpose.
// Layouts: a tensor [R, C] row-major; its transpose [C, R] row-major; 1x16 scales [R, C/16].
// The cast pass reads its values from a source: a BF16 tensor, or a kernel's math recomputed
// from that kernel's inputs (coat/swiglu.cuh), so that no BF16 copy has to be written and read.
// BF16 inputs move as 16-byte vectors: C a multiple of 8 (16 for 1x16 groups), pointers
// 16-byte aligned; a transpose needs R a multiple of 16.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <stdint.h>
#include "common.cuh"

#define FP8_E4M3_MAX 448.0f
#define FP8_E5M2_MAX 57344.0f
#define FP8_SCALE_EPS 1e-10f
#define FP8_GROUP 16                 // 1x16 groups of the non-linear inputs
#define FP8_TILE 64                  // transpose tile of the cast pass: 64 x 64 values
#define FP8_TILE_PITCH (FP8_TILE + 4)  // bytes per staged row: 4-byte aligned, few bank conflicts
#define FP8_THREADS 256

typedef enum { FP8_E4M3, FP8_E5M2 } Fp8Format;

// One per-tensor FP8 scale. 16 bytes so that an array keeps every scale 16-byte aligned, which
// cuBLASLt requires of its scale pointers.
typedef struct __align__(16) {
    float scale;  // dequantization factor of the FP8 tensor
    float amax;   // max |x| of its source, gathered by the producer (starts at 0)
    float unused[2];
} Fp8Scale;

static __host__ __device__ __forceinline__ float fp8_format_max(Fp8Format format) {
    return format == FP8_E4M3 ? FP8_E4M3_MAX : FP8_E5M2_MAX;
}

static __host__ __device__ __forceinline__ float fp8_scale_from_amax(float amax, Fp8Format format) {
    return (amax + FP8_SCALE_EPS) / fp8_format_max(format);
}

static __host__ __device__ __forceinline__ uint8_t fp8_encode(float x, Fp8Format format) {
    return (uint8_t)__nv_cvt_float_to_fp8(x, __NV_SATFINITE, format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}

static __host__ __device__ __forceinline__ float fp8_decode(uint8_t code, Fp8Format format) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)code, format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2)));
}

// Two values per conversion instruction (one does two anyway; the same rounding as fp8_encode
// and fp8_decode): the low byte holds the first value.
static __host__ __device__ __forceinline__ uint32_t fp8_encode2(float first, float second, Fp8Format format) {
    return __nv_cvt_float2_to_fp8x2(make_float2(first, second), __NV_SATFINITE, format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
}

static __device__ __forceinline__ float2 fp8_decode2(uint32_t two_codes, Fp8Format format) {
    __half2_raw pair = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)two_codes, format == FP8_E4M3 ? __NV_E4M3 : __NV_E5M2);
    return __half22float2(__half2(pair));
}

// a * b rounded on its own: nvcc would otherwise fuse it into a following add (an FMA rounds
// once), which a host compiler for baseline x86-64 never does.
static __host__ __device__ __forceinline__ float mul_unfused(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

// x / s for s > 0 from inverse = 1 / s: a product and one FMA correction, the division's own
// fast path without its range checks. Equal to the correctly rounded quotient whenever x and
// the quotient are normal; a tiny x (below 2^-100) may differ in the last bit, but in the casts
// its quotient is under 2^-51 (every scale is at least 1e-10 / 57344) and encodes as 0 either
// way. As the division: zeros keep their sign, an overflow is infinite (and saturates), an
// infinite s gives +-0 and NaN from an infinite x, a NaN stays NaN.
static __host__ __device__ __forceinline__ float fp8_divide(float x, float s, float inverse) {
    float q = mul_unfused(x, inverse);
    float corrected = fmaf(fmaf(-q, s, x), inverse, q);
    return fabsf(q) <= 3.40282347e38f && inverse != 0.0f ? copysignf(corrected, x) : q;
}

// Codes of x[0..7] / s (inverse = 1 / s), two per conversion, in memory order (value j in byte
// j % 4 of word j / 4).
static __device__ __forceinline__ uint2 fp8_encode8(const float x[8], float s, float inverse, Fp8Format format) {
    uint32_t words[2];
    for (int w = 0; w < 2; w++) {
        const float *v = x + 4 * w;
        words[w] = fp8_encode2(fp8_divide(v[0], s, inverse), fp8_divide(v[1], s, inverse), format) |
                   fp8_encode2(fp8_divide(v[2], s, inverse), fp8_divide(v[3], s, inverse), format) << 16;
    }
    return make_uint2(words[0], words[1]);
}

// Folds max |x| of one value per thread into slot->amax: a block reduction, then one atomic.
// Non-negative floats order like their bit patterns as ints, and a NaN's bits (sign cleared)
// exceed every other value's, so a NaN anywhere makes the amax, and the scale, NaN: the loss
// turns NaN and the step is skipped. The order of the maxima does not matter: deterministic.
// Every thread of the block must call it.
__device__ __forceinline__ void fp8_block_amax(Fp8Scale *slot, float value) {
    __shared__ unsigned warp_max_bits[32];
    unsigned bits = __reduce_max_sync(0xffffffffu, (unsigned)__float_as_int(fabsf(value)));
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    if (lane == 0) warp_max_bits[warp] = bits;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < warps; w++) bits = max(bits, warp_max_bits[w]);
        bits = max(bits, warp_max_bits[0]);
        if (bits > 0) atomicMax((unsigned *)&slot->amax, bits);
    }
}

// max(a, |b|) that keeps a NaN of either.
__device__ __forceinline__ float fp8_abs_max(float a, float b) {
    return __int_as_float(max(__float_as_int(a), __float_as_int(fabsf(b))));
}

// A tensor [R, C] stored as 1x16 E4M3 groups: codes [R, C] and one BF16 scale per group
// [R, C/16]. codes == NULL: not stored so (the tensor is BF16).
typedef struct {
    uint8_t *codes;
    bf16 *scales;
} Fp8Groups;

// ---- 1x16 groups: a group in one thread, or 8 values per thread and the other half in lane ^ 1

// The stored BF16 scale of a group whose max |x| is group_max (NaN when the group holds one):
// the data is divided by this rounded value.
__device__ __forceinline__ bf16 fp8_group_scale(float group_max) {
    return __float2bfloat16_rn(fp8_scale_from_amax(group_max, FP8_E4M3));
}

// Codes of this thread's 8 values and the group's scale (the same in both lanes). Both lanes of
// every pair must call it (inactive pairs pass zeros).
__device__ __forceinline__ uint2 fp8_quantize_half_group(const float x[8], bf16 *group_scale) {
    float m = 0.0f;
    for (int j = 0; j < 8; j++) m = fp8_abs_max(m, x[j]);
    m = fp8_abs_max(m, __shfl_xor_sync(0xffffffffu, m, 1));
    *group_scale = fp8_group_scale(m);
    float scale = __bfloat162float(*group_scale);
    return fp8_encode8(x, scale, 1.0f / scale, FP8_E4M3);
}

// Codes of a whole group x[0..15], in memory order, and its scale: half the scale arithmetic of
// two lanes each computing it, and no shuffle.
__device__ __forceinline__ uint4 fp8_quantize_group(const float x[16], bf16 *group_scale) {
    float m = 0.0f;
    for (int j = 0; j < 16; j++) m = fp8_abs_max(m, x[j]);
    *group_scale = fp8_group_scale(m);
    float scale = __bfloat162float(*group_scale), inverse = 1.0f / scale;
    uint2 low = fp8_encode8(x, scale, inverse, FP8_E4M3), high = fp8_encode8(x + 8, scale, inverse, FP8_E4M3);
    return make_uint4(low.x, low.y, high.x, high.y);
}

// decode(code) * scale for 8 codes in memory order, two per conversion.
__device__ __forceinline__ void fp8_dequantize8(float out[8], uint2 codes, float scale, Fp8Format format) {
    for (int j = 0; j < 8; j += 2) {
        float2 pair = fp8_decode2((j < 4 ? codes.x : codes.y) >> (8 * (j % 4)), format);
        out[j] = pair.x * scale;
        out[j + 1] = pair.y * scale;
    }
}

// 8 values at column c of a row of a 1x16-quantized tensor (codes row, scales row).
__device__ __forceinline__ void fp8_load_group16(float out[8], const uint8_t *codes_row, const bf16 *scales_row, int c) {
    fp8_dequantize8(out, *reinterpret_cast<const uint2 *>(codes_row + c), __bfloat162float(scales_row[c / FP8_GROUP]), FP8_E4M3);
}

// A whole group: 16 E4M3 codes in memory order.
__device__ __forceinline__ void fp8_dequantize16(float out[16], uint4 codes, float scale) {
    fp8_dequantize8(out, make_uint2(codes.x, codes.y), scale, FP8_E4M3);
    fp8_dequantize8(out + 8, make_uint2(codes.z, codes.w), scale, FP8_E4M3);
}

// The 16 values of the group at column c (a multiple of 16) of such a row: one 16-byte load.
__device__ __forceinline__ void fp8_load_group(float out[16], const uint8_t *codes_row, const bf16 *scales_row, int c) {
    fp8_dequantize16(out, *reinterpret_cast<const uint4 *>(codes_row + c), __bfloat162float(scales_row[c / FP8_GROUP]));
}

// ---- per-tensor passes ------------------------------------------------------------------

// 8 values from 16-byte aligned memory: BF16 as they are, FP32 rounded to BF16 first (the FP32
// master weights cast as the BF16 weights they round to, which nothing has to store).
__device__ __forceinline__ void fp8_load8(const bf16 *in, float v[8]) {
    Vec16<bf16> x = load16_stream(in);
    for (int j = 0; j < 8; j++) v[j] = __bfloat162float(x[j]);
}
__device__ __forceinline__ void fp8_load8(const float *in, float v[8]) {
    Vec16<float> a = load16_stream(in), b = load16_stream(in + 4);
    for (int j = 0; j < 4; j++) {
        v[j] = __bfloat162float(__float2bfloat16_rn(a[j]));
        v[j + 4] = __bfloat162float(__float2bfloat16_rn(b[j]));
    }
}

template <typename T>
__global__ void __launch_bounds__(FP8_THREADS) fp8_amax_kernel(Fp8Scale *slot, const T *in, size_t n_vecs) {
    float m = 0.0f;
    for (size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x; v < n_vecs; v += (size_t)gridDim.x * blockDim.x) {
        float x[8];
        fp8_load8(in + v * 8, x);
        for (int j = 0; j < 8; j++) {
            m = fp8_abs_max(m, x[j]);
        }
    }
    fp8_block_amax(slot, m);
}

// The plain source: a tensor [R, C] in BF16, or in FP32 read as its BF16 rounding.
template <typename T>
struct Fp8SourcePlain {
    static constexpr int PLANES = 1;
    const T *in;
    int C;
    __device__ __forceinline__ void load(int r, int c, float v[1][8]) const { fp8_load8(in + (size_t)r * C + c, v[0]); }
};

// One block per tile of 64 rows x 64 columns of each of the source's PLANES planes (plane p is
// columns [p C, (p + 1) C) of the output, which is [R, PLANES C]): each thread casts two 8-value
// row vectors per plane; the transpose goes through shared memory and leaves as 16-byte rows of
// out_t [PLANES C, R].
template <Fp8Format FORMAT, class Source>
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_quantize_kernel(uint8_t *out, uint8_t *out_t, Fp8Scale *slot, Source source, int R, int C) {
    constexpr int PLANES = Source::PLANES;
    __shared__ __align__(16) uint8_t tile_t[PLANES][FP8_TILE][FP8_TILE_PITCH];  // [plane][column][row] of the tile
    float scale = fp8_scale_from_amax(slot->amax, FORMAT), inverse = 1.0f / scale;
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) slot->scale = scale;
    int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE, out_columns = PLANES * C;
    int tile_row = threadIdx.x / 8, tile_col = (threadIdx.x % 8) * 8;
    for (int k = 0; k < 2; k++) {
        int tr = tile_row + 32 * k, r = r0 + tr, c = c0 + tile_col;
        if (r >= R || c >= C) continue;
        float v[PLANES][8];
        source.load(r, c, v);
        for (int p = 0; p < PLANES; p++) {
            uint2 codes = fp8_encode8(v[p], scale, inverse, FORMAT);
            if (out != NULL) *reinterpret_cast<uint2 *>(out + (size_t)r * out_columns + p * C + c) = codes;
            if (out_t != NULL)
                for (int j = 0; j < 8; j++) tile_t[p][tile_col + j][tr] = (uint8_t)((j < 4 ? codes.x : codes.y) >> (8 * (j % 4)));
        }
    }
    if (out_t == NULL) return;  // the same for the whole block
    __syncthreads();
    int column = threadIdx.x / 4, row_part = (threadIdx.x % 4) * 16;
    int c = c0 + column, r = r0 + row_part;
    if (c >= C || r >= R) return;
    for (int p = 0; p < PLANES; p++) {
        const uint32_t *staged = reinterpret_cast<const uint32_t *>(&tile_t[p][column][row_part]);
        *reinterpret_cast<uint4 *>(out_t + (size_t)(p * C + c) * R + r) = make_uint4(staged[0], staged[1], staged[2], staged[3]);
    }
}

// One block per 128 x 128 tile of codes, 256 threads. Each thread loads four 16-byte row pieces
// into shared memory, then reads the 4-column word of 16 rows (one 32-bit load per row, no byte
// loads), transposes the four 4 x 4 byte blocks with byte permutes and stores 16 bytes into each
// of 4 output rows. A warp reads 8 words of 4 row groups: row group g's words are XORed with
// 8 (g % 4), so those reads fall in 32 distinct banks.
#define FP8_TRANSPOSE_TILE 128
__device__ __forceinline__ int fp8_transpose_swizzle(int row) { return ((row >> 4) & 3) << 3; }

__global__ void __launch_bounds__(FP8_THREADS)
    fp8_transpose_codes_kernel(uint8_t *out_t, const uint8_t *in, int R, int C) {
    constexpr int WORDS = FP8_TRANSPOSE_TILE / 4;  // 32-bit words per staged row
    __shared__ __align__(16) uint32_t tile[FP8_TRANSPOSE_TILE * WORDS];  // [row][word ^ swizzle(row)]
    int r0 = blockIdx.y * FP8_TRANSPOSE_TILE, c0 = blockIdx.x * FP8_TRANSPOSE_TILE;
    int piece = threadIdx.x % 8;  // 16 bytes = words 4 piece .. 4 piece + 3
    for (int k = 0; k < 4; k++) {
        int row = threadIdx.x / 8 + 32 * k;
        if (r0 + row < R && c0 + 16 * piece < C)
            *reinterpret_cast<uint4 *>(&tile[row * WORDS + ((4 * piece) ^ fp8_transpose_swizzle(row))]) =
                *reinterpret_cast<const uint4 *>(in + (size_t)(r0 + row) * C + c0 + 16 * piece);
    }
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int group = 4 * (warp % 2) + lane / 8;   // rows 16 group .. 16 group + 15
    int word = 8 * (warp / 2) + lane % 8;    // columns 4 word .. 4 word + 3
    if (r0 + 16 * group >= R || c0 + 4 * word >= C) return;  // R and C are multiples of 16
    uint32_t column[4][4];  // [column j][rows 4q .. 4q + 3 of the group]
    for (int q = 0; q < 4; q++) {
        uint32_t w[4];
        for (int i = 0; i < 4; i++) {
            int row = 16 * group + 4 * q + i;
            w[i] = tile[row * WORDS + (word ^ fp8_transpose_swizzle(row))];
        }
        uint32_t low01 = __byte_perm(w[0], w[1], 0x5140), high01 = __byte_perm(w[0], w[1], 0x7362);
        uint32_t low23 = __byte_perm(w[2], w[3], 0x5140), high23 = __byte_perm(w[2], w[3], 0x7362);
        column[0][q] = __byte_perm(low01, low23, 0x5410);
        column[1][q] = __byte_perm(low01, low23, 0x7632);
        column[2][q] = __byte_perm(high01, high23, 0x5410);
        column[3][q] = __byte_perm(high01, high23, 0x7632);
    }
    for (int j = 0; j < 4; j++)
        *reinterpret_cast<uint4 *>(out_t + (size_t)(c0 + 4 * word + j) * R + r0 + 16 * group) =
            make_uint4(column[j][0], column[j][1], column[j][2], column[j][3]);
}

// out = code * slot->scale, 8 values per thread.
__global__ void __launch_bounds__(FP8_THREADS)
    fp8_dequantize_kernel(bf16 *out, const uint8_t *in, const Fp8Scale *slot, Fp8Format format, size_t n_vecs) {
    size_t v = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (v >= n_vecs) return;
    float x[8];
    fp8_dequantize8(x, *reinterpret_cast<const uint2 *>(in + v * 8), slot->scale, format);
    Vec16<bf16> o;
    for (int j = 0; j < 8; j++) o[j] = __float2bfloat16(x[j]);
    store16(out + v * 8, o);
}

static inline void fp8_check(const char *launcher, bool ok, const char *what) {
    if (!ok) fail_with(launcher, what);
}

// slot->amax = max(slot->amax, max |in|) over n values (n a multiple of 8), BF16 or FP32 rounded
// to BF16: for tensors whose producer does not gather it (the weights, once per step).
template <typename T>
static inline void fp8_amax(Fp8Scale *slot, const T *in, size_t n, cudaStream_t stream) {
    fp8_check("fp8_amax", n % 8 == 0 && ((uintptr_t)in & 15u) == 0, "n must be a multiple of 8 and in 16-byte aligned");
    size_t vecs = n / 8, blocks = ceil_div_size(vecs, FP8_THREADS);  // a grid-stride loop past 1024 blocks
    if (blocks > 1024) blocks = 1024;
    if (blocks == 0) blocks = 1;
    fp8_amax_kernel<<<(unsigned)blocks, FP8_THREADS, 0, stream>>>(slot, in, vecs);
    cudaCheckLaunch();
}

// out [R, PLANES C] and/or out_t [PLANES C, R] (either may be NULL) = fp8(x / s) for the
// source's values x, s from slot->amax (gathered by whoever produced or first computed them);
// stores s in slot->scale.
template <class Source>
static inline void fp8_quantize_source(uint8_t *out, uint8_t *out_t, Fp8Scale *slot, Source source, int R, int C,
                                       Fp8Format format, cudaStream_t stream) {
    fp8_check("fp8_quantize", R > 0 && C > 0 && C % 8 == 0, "C must be a positive multiple of 8");
    fp8_check("fp8_quantize", out_t == NULL || R % 16 == 0, "a transposed copy needs R a multiple of 16");
    fp8_check("fp8_quantize", ((uintptr_t)out & 7u) == 0 && ((uintptr_t)out_t & 15u) == 0,
              "out must be 8-byte aligned, out_t 16-byte aligned");
    dim3 grid(ceil_div(C, FP8_TILE), ceil_div(R, FP8_TILE));
    if (format == FP8_E4M3) fp8_quantize_kernel<FP8_E4M3><<<grid, FP8_THREADS, 0, stream>>>(out, out_t, slot, source, R, C);
    else fp8_quantize_kernel<FP8_E5M2><<<grid, FP8_THREADS, 0, stream>>>(out, out_t, slot, source, R, C);
    cudaCheckLaunch();
}

// out [n] BF16 = in [n] FP8 * slot->scale (n a multiple of 8; out 16-byte, in 8-byte aligned).
static inline void fp8_dequantize(bf16 *out, const uint8_t *in, const Fp8Scale *slot, size_t n, Fp8Format format,
                                  cudaStream_t stream) {
    fp8_check("fp8_dequantize", n % 8 == 0 && ((uintptr_t)out & 15u) == 0 && ((uintptr_t)in & 7u) == 0,
              "n must be a multiple of 8, out 16-byte and in 8-byte aligned");
    size_t vecs = n / 8;
    fp8_dequantize_kernel<<<(unsigned)ceil_div_size(vecs, FP8_THREADS), FP8_THREADS, 0, stream>>>(out, in, slot, format, vecs);
    cudaCheckLaunch();
}

// out_t [C, R] = the transpose of the FP8 codes in [R, C] (R and C multiples of 16, both
// 16-byte aligned), for codes cast earlier (the weights' W^T, remade layer by layer in backward);
// their scale is the cast's.
static inline void fp8_transpose_codes(uint8_t *out_t, const uint8_t *in, int R, int C, cudaStream_t stream) {
    fp8_check("fp8_transpose_codes", R > 0 && C > 0 && R % 16 == 0 && C % 16 == 0, "R and C must be positive multiples of 16");
    fp8_check("fp8_transpose_codes", (((uintptr_t)in | (uintptr_t)out_t) & 15u) == 0, "in and out_t must be 16-byte aligned");
    dim3 grid(ceil_div(C, FP8_TRANSPOSE_TILE), ceil_div(R, FP8_TRANSPOSE_TILE));
    fp8_transpose_codes_kernel<<<grid, FP8_THREADS, 0, stream>>>(out_t, in, R, C);
    cudaCheckLaunch();
}

// The cast of a tensor in [R, C] (16-byte aligned): BF16, or FP32 cast as its BF16 rounding
// (the same codes as the cast of that BF16 tensor).
template <typename T>
static inline void fp8_quantize(uint8_t *out, uint8_t *out_t, Fp8Scale *slot, const T *in, int R, int C,
                                Fp8Format format, cudaStream_t stream) {
    fp8_check("fp8_quantize", ((uintptr_t)in & 15u) == 0, "in must be 16-byte aligned");
    fp8_quantize_source(out, out_t, slot, Fp8SourcePlain<T>{in, C}, R, C, format, stream);
}
