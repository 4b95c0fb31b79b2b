// RMSNorm forward and backward on BF16 rows, FP32 math, and the residual add fused into
// the forward so that the residual stream is read once per layer.
//   forward:  y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)   (one rstd per row)
//   backward: g = dy * w, xhat = x * rstd,
//             dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
// Layouts: x, y, dy, dx are [N, C] row-major BF16; w, dw are [C] BF16; rstd is [N] FP32. In
// COAT mode the saved x is its 1x16 E4M3 copy (coat/fp8.cuh), and the kernels that produce an
// FP8 GEMM's input (the norm output, the residual gradient) also gather its amax.
// Rows move as 16-byte vectors of 8 BF16 values: C must be a multiple of 8 and every pointer
// 16-byte aligned; the backward pass takes C up to 8192. Results are deterministic: no atomics,
// reductions in a fixed order.
#pragma once
#include "common.cuh"
#include "fp8.cuh"

#define RMSNORM_FORWARD_THREADS 256            // one warp per row, 8 rows per block
#define RMSNORM_BACKWARD_ROWS_PER_BLOCK 64     // rows whose dw partial one block sums
#define RMSNORM_BACKWARD_MAX_THREADS 512      // 128 registers per thread: no spills
#define RMSNORM_BACKWARD_MAX_VECS_PER_THREAD 2 // so C <= 8 * 512 * 2 = 8192
#define RMSNORM_DWEIGHT_COLUMNS 32             // dw reduction block: 32 columns x 16 slices
#define RMSNORM_DWEIGHT_SLICES 16

// One output of the norm as stored: x rstd w rounded to BF16. The forward and the FP8 cast that
// recomputes it (RmsnormOutputSource) share it, so that both give the same bits.
__device__ __forceinline__ bf16 rmsnorm_output(float x, float rstd, bf16 w) {
    return __float2bfloat16(x * rstd * __bfloat162float(w));
}

// residual_out = bf16(residual_in + branch), then RMSNorm of the ROUNDED sum: the backward
// pass only sees the stored residual, so the forward must normalize exactly that. With GROUP16
// the stored residual is its 1x16 E4M3 copy (residual_copy), and the norm reads the copy back.
// branch == NULL: no add (residual_out is not written). residual_out may alias residual_in
// (each thread reads an element before writing it). With AMAX, max |norm_out| goes to norm_amax;
// norm_out NULL: not stored (rmsnorm_output_cast recomputes it).
// The loops run every lane of the warp the same number of times: 1x16 groups span lane pairs.
template <bool GROUP16, bool AMAX>
__global__ void __launch_bounds__(RMSNORM_FORWARD_THREADS)
    residual_rmsnorm_forward_kernel(bf16 *residual_out, Fp8Groups residual_copy, bf16 *norm_out, float *rstd,
                                    Fp8Scale *norm_amax, const bf16 *residual_in, const bf16 *branch,
                                    const bf16 *weight, int N, int C, float eps) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    float out_max = 0.0f;
    if (row < N) {  // the whole warp
        size_t row_offset = (size_t)row * C;
        const bf16 *sum_row = (branch != NULL ? residual_out : residual_in) + row_offset;
        uint8_t *codes_row = GROUP16 ? residual_copy.codes + row_offset : NULL;
        bf16 *scales_row = GROUP16 ? residual_copy.scales + (size_t)row * (C / FP8_GROUP) : NULL;

        float sum_squares = 0.0f;
#pragma unroll 4
        for (int base = 0; base < C; base += 32 * 8) {
            int c = base + lane * 8;
            bool active = c < C;
            float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (active) {
                Vec16<bf16> a = load16(residual_in + row_offset + c);
                if (branch != NULL) {
                    Vec16<bf16> b = load16(branch + row_offset + c);
                    for (int k = 0; k < 8; k++) a[k] = __float2bfloat16(__bfloat162float(a[k]) + __bfloat162float(b[k]));
                    store16(residual_out + row_offset + c, a);
                }
                for (int k = 0; k < 8; k++) s[k] = __bfloat162float(a[k]);
            }
            if (GROUP16) {
                bf16 scale;
                uint2 codes = fp8_quantize_half_group(s, &scale);
                if (active) {
                    *reinterpret_cast<uint2 *>(codes_row + c) = codes;
                    if (lane % 2 == 0) scales_row[c / FP8_GROUP] = scale;
                }
                fp8_dequantize8(s, codes, __bfloat162float(scale), FP8_E4M3);
            }
            if (active)
                for (int k = 0; k < 8; k++) sum_squares += s[k] * s[k];
        }
        sum_squares = warp_sum(sum_squares);
        float row_rstd = 1.0f / sqrtf(sum_squares / (float)C + eps);
        if (lane == 0) rstd[row] = row_rstd;
        if (GROUP16) __syncwarp();  // the odd lane of a pair reads the scale its even partner wrote

        // Each lane re-reads the vectors it wrote above: its own writes are visible to it.
#pragma unroll 4
        for (int c = lane * 8; c < C && (norm_out != NULL || AMAX); c += 32 * 8) {
            float s[8];
            if (GROUP16) {
                fp8_load_group16(s, codes_row, scales_row, c);
            } else {
                Vec16<bf16> v = load16(sum_row + c);
                for (int k = 0; k < 8; k++) s[k] = __bfloat162float(v[k]);
            }
            Vec16<bf16> w = load16(weight + c);
            Vec16<bf16> o;
            for (int k = 0; k < 8; k++) {
                o[k] = rmsnorm_output(s[k], row_rstd, w[k]);
                if (AMAX) out_max = fp8_abs_max(out_max, __bfloat162float(o[k]));
            }
            if (norm_out != NULL) store16(norm_out + row_offset + c, o);
        }
    }
    if (AMAX) fp8_block_amax(norm_amax, out_max);
}

// Sum of one value per thread over the block, the same on every thread. Warps add in a fixed
// order, so the result is bitwise reproducible. `slots` holds 32 floats; callers alternate
// between two slot arrays on consecutive calls, which makes one __syncthreads enough.
__device__ __forceinline__ float block_sum_deterministic(float value, float *slots) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
    value = warp_sum(value);
    if (lane == 0) slots[warp] = value;
    __syncthreads();
    float total = 0.0f;
    for (int w = 0; w < warps; w++) total += slots[w];
    return total;
}

// Asks L2 for what this thread reads of `row` (the next row), without waiting: it arrives while
// the block reduces the current row, so the row's loads find it in L2 instead of waiting on HBM.
template <bool GROUP16>
__device__ __forceinline__ void rmsnorm_backward_prefetch(int row, const bf16 *din, const bf16 *dout, const bf16 *in,
                                                          Fp8Groups in_groups, int C) {
    size_t row_offset = (size_t)row * C;
#pragma unroll
    for (int j = 0; j < RMSNORM_BACKWARD_MAX_VECS_PER_THREAD; j++) {
        int vec = threadIdx.x + j * blockDim.x;
        if (vec >= C / 8) continue;
        prefetch_l2(dout + row_offset + vec * 8);
        prefetch_l2(din + row_offset + vec * 8);
        if (GROUP16) {
            prefetch_l2(in_groups.codes + row_offset + vec * 8);
            prefetch_l2(in_groups.scales + (size_t)row * (C / FP8_GROUP) + vec / 2);
        } else {
            prefetch_l2(in + row_offset + vec * 8);
        }
    }
}

// 8 inputs x of a row as loaded (BF16, or 1x16 E4M3 codes with their group's scale in .z), kept
// packed in 4 registers until used (rmsnorm_input8 converts them).
template <bool GROUP16>
__device__ __forceinline__ uint4 rmsnorm_load_input8(const bf16 *in, Fp8Groups in_groups, int row, int C, int vec) {
    size_t at = (size_t)row * C + vec * 8;
    if (!GROUP16) {
        Vec16<bf16> x = load16_stream(in + at);
        return *reinterpret_cast<const uint4 *>(&x);
    }
    uint2 codes = *reinterpret_cast<const uint2 *>(in_groups.codes + at);
    float scale = __bfloat162float(in_groups.scales[(size_t)row * (C / FP8_GROUP) + vec / 2]);
    return make_uint4(codes.x, codes.y, __float_as_uint(scale), 0u);
}
template <bool GROUP16>
__device__ __forceinline__ void rmsnorm_input8(float x[8], uint4 raw) {
    if (GROUP16) {
        fp8_dequantize8(x, make_uint2(raw.x, raw.y), __uint_as_float(raw.z), FP8_E4M3);
    } else {
        const bf16 *v = reinterpret_cast<const bf16 *>(&raw);
        for (int k = 0; k < 8; k++) x[k] = __bfloat162float(v[k]);
    }
}

// One block per group of RMSNORM_BACKWARD_ROWS_PER_BLOCK rows; thread t owns the 8-column
// vectors t and t + blockDim.x, keeps their weights and its dw partial sums in registers, and
// writes the block's dw partial to dweight_partial[blockIdx.x, C].
// The input x is BF16 (in) or 1x16 E4M3 (in_groups, GROUP16). With AMAX, max |din| after the
// add goes to din_amax. This form runs the rows wider than one vector a thread (C above 4096);
// each row waits on its loads and on a block barrier, and prefetches the next row into L2. The
// row's x, dy, din and the weights stay packed as loaded and are converted where used.
template <bool GROUP16, bool AMAX>
__global__ void __launch_bounds__(RMSNORM_BACKWARD_MAX_THREADS)
    rmsnorm_backward_kernel(bf16 *din, float *dweight_partial, Fp8Scale *din_amax, const bf16 *dout, const bf16 *in,
                            Fp8Groups in_groups, const bf16 *weight, const float *rstd, int N, int C) {
    constexpr int VECS = RMSNORM_BACKWARD_MAX_VECS_PER_THREAD;
    __shared__ float slots[2][32];
    int vecs_per_row = C / 8;
    int row_begin = blockIdx.x * RMSNORM_BACKWARD_ROWS_PER_BLOCK;
    int row_end = min(row_begin + RMSNORM_BACKWARD_ROWS_PER_BLOCK, N);

    Vec16<bf16> w[VECS];
    float dw[VECS][8];
    float din_max = 0.0f;
#pragma unroll
    for (int j = 0; j < VECS; j++) {
        int vec = threadIdx.x + j * blockDim.x;
        for (int k = 0; k < 8; k++) {
            w[j][k] = __float2bfloat16(0.0f);
            dw[j][k] = 0.0f;
        }
        if (vec < vecs_per_row) w[j] = load16(weight + vec * 8);
    }

    for (int row = row_begin; row < row_end; row++) {
        size_t row_offset = (size_t)row * C;
        float row_rstd = rstd[row];
        uint4 x_raw[VECS];
        Vec16<bf16> dyv[VECS], din_old[VECS];  // din loaded before the block reduction so that its latency overlaps it
        float dot = 0.0f;                      // this thread's part of sum(g * xhat)
        if (row + 1 < row_end) rmsnorm_backward_prefetch<GROUP16>(row + 1, din, dout, in, in_groups, C);
#pragma unroll
        for (int j = 0; j < VECS; j++) {
            int vec = threadIdx.x + j * blockDim.x;
            if (vec >= vecs_per_row) {  // x = 0 and dy = 0 add nothing
                x_raw[j] = make_uint4(0u, 0u, 0u, 0u);
                for (int k = 0; k < 8; k++) dyv[j][k] = din_old[j][k] = __float2bfloat16(0.0f);
                continue;
            }
            x_raw[j] = rmsnorm_load_input8<GROUP16>(in, in_groups, row, C, vec);
            dyv[j] = load16_stream(dout + row_offset + vec * 8);
            din_old[j] = load16(din + row_offset + vec * 8);
        }
#pragma unroll
        for (int j = 0; j < VECS; j++) {
            float x[8];
            rmsnorm_input8<GROUP16>(x, x_raw[j]);
            for (int k = 0; k < 8; k++)
                dot += __bfloat162float(dyv[j][k]) * __bfloat162float(w[j][k]) * (x[k] * row_rstd);
        }
        float mean_dot = block_sum_deterministic(dot, slots[row & 1]) / (float)C;
#pragma unroll
        for (int j = 0; j < VECS; j++) {
            int vec = threadIdx.x + j * blockDim.x;
            if (vec >= vecs_per_row) continue;
            float x[8];
            rmsnorm_input8<GROUP16>(x, x_raw[j]);
            Vec16<bf16> din_new;
            for (int k = 0; k < 8; k++) {
                float xhat = x[k] * row_rstd, dy = __bfloat162float(dyv[j][k]);
                float g = dy * __bfloat162float(w[j][k]);
                float grad = row_rstd * (g - xhat * mean_dot);
                din_new[k] = __float2bfloat16(__bfloat162float(din_old[j][k]) + grad);
                if (AMAX) din_max = fp8_abs_max(din_max, __bfloat162float(din_new[k]));
                dw[j][k] += dy * xhat;
            }
            store16(din + row_offset + vec * 8, din_new);
        }
    }

    float *partial = dweight_partial + (size_t)blockIdx.x * C;
#pragma unroll
    for (int j = 0; j < VECS; j++) {
        int vec = threadIdx.x + j * blockDim.x;
        if (vec >= vecs_per_row) continue;
        float4 *dst = reinterpret_cast<float4 *>(partial + vec * 8);
        dst[0] = make_float4(dw[j][0], dw[j][1], dw[j][2], dw[j][3]);
        dst[1] = make_float4(dw[j][4], dw[j][5], dw[j][6], dw[j][7]);
    }
    if (AMAX) fp8_block_amax(din_amax, din_max);
}

// The backward with one vector per thread (C up to 8 x 512), staged: each thread copies what it
// reads of a row (dy, din, and x: its 16-byte vector, or its 8 codes and the 4-byte word that
// holds its group's scale) into its own slots of RMSNORM_BACKWARD_STAGES row stages in shared
// memory with cp.async, STAGES - 1 rows ahead of the row it computes. The rows' loads no longer
// wait one after the other behind the block's reduction, and no register holds a row across it.
// A thread reads only the slots it filled: waiting on its own copies needs no barrier. Registers
// are held to 64 (two blocks of 512 threads an SM) so that four blocks of 256 threads (C = 2048)
// fit on an SM and the 512 blocks of N = 32768 rows run in one wave. 4 stages measured no faster.
#define RMSNORM_BACKWARD_STAGES 3
#define RMSNORM_BACKWARD_SLOTS 3  // a thread's slots per stage: x, dy, din

// This thread's copies of `row` into `slots` (its x, dy and din slots of one stage).
template <bool GROUP16>
__device__ __forceinline__ void rmsnorm_backward_stage(uint4 *slots, int stride, int row, const bf16 *din,
                                                       const bf16 *dout, const bf16 *in, Fp8Groups in_groups, int N,
                                                       int C) {
    size_t at = (size_t)row * C + threadIdx.x * 8;
    if (GROUP16) {
        size_t scale = (size_t)row * (C / FP8_GROUP) + threadIdx.x / 2;
        cp_async_8(&slots[0], in_groups.codes + at);
        if ((scale | 1) < (size_t)N * (C / FP8_GROUP))
            cp_async_4(&slots[0].z, in_groups.scales + (scale & ~(size_t)1));  // the pair of scales that holds it
        else  // the last scale, alone in its pair: no read past the array
            slots[0].z = __bfloat16_as_ushort(in_groups.scales[scale]);
    } else {
        cp_async_16(&slots[0], in + at, true);
    }
    cp_async_16(&slots[stride], dout + at, true);
    cp_async_16(&slots[2 * stride], din + at, true);
}

template <bool GROUP16, bool AMAX>
__global__ void __launch_bounds__(RMSNORM_BACKWARD_MAX_THREADS, 2)
    rmsnorm_backward_staged_kernel(bf16 *din, float *dweight_partial, Fp8Scale *din_amax, const bf16 *dout,
                                   const bf16 *in, Fp8Groups in_groups, const bf16 *weight, const float *rstd, int N,
                                   int C) {
    extern __shared__ uint4 staged[];  // [STAGES][SLOTS][blockDim.x]
    __shared__ float slots[2][32];
    int vec = threadIdx.x, stride = blockDim.x;
    bool has = vec < C / 8;  // past the row: x = 0 and dy = 0 add nothing
    int row_begin = blockIdx.x * RMSNORM_BACKWARD_ROWS_PER_BLOCK;
    int row_end = min(row_begin + RMSNORM_BACKWARD_ROWS_PER_BLOCK, N);
    auto stage_slots = [&](int k) { return staged + (size_t)(k % RMSNORM_BACKWARD_STAGES) * RMSNORM_BACKWARD_SLOTS * stride + vec; };

    for (int k = 0; k < RMSNORM_BACKWARD_STAGES - 1; k++) {  // a commit per stage, empty or not, keeps the count
        if (has && row_begin + k < row_end)
            rmsnorm_backward_stage<GROUP16>(stage_slots(k), stride, row_begin + k, din, dout, in, in_groups, N, C);
        cp_async_commit();
    }
    Vec16<bf16> w;
    float dw[8];
    float din_max = 0.0f;
    for (int k = 0; k < 8; k++) {
        w[k] = __float2bfloat16(0.0f);
        dw[k] = 0.0f;
    }
    if (has) w = load16(weight + vec * 8);

    for (int row = row_begin, k = 0; row < row_end; row++, k++) {
        int ahead = row + RMSNORM_BACKWARD_STAGES - 1;
        if (has && ahead < row_end)
            rmsnorm_backward_stage<GROUP16>(stage_slots(k + RMSNORM_BACKWARD_STAGES - 1), stride, ahead, din, dout, in,
                                            in_groups, N, C);
        cp_async_commit();
        cp_async_wait_pending<RMSNORM_BACKWARD_STAGES - 1>();  // this row's copies have landed
        const uint4 *mine = stage_slots(k);
        uint4 x_raw = make_uint4(0u, 0u, 0u, 0u);
        Vec16<bf16> dyv, din_old;
        for (int j = 0; j < 8; j++) dyv[j] = din_old[j] = __float2bfloat16(0.0f);
        if (has) {
            x_raw = mine[0];
            dyv = *reinterpret_cast<const Vec16<bf16> *>(&mine[stride]);
            din_old = *reinterpret_cast<const Vec16<bf16> *>(&mine[2 * stride]);
            if (GROUP16) {  // the scale's half of the word, as rmsnorm_input8 takes it
                uint32_t pair = x_raw.z;
                bool high = ((size_t)row * (C / FP8_GROUP) + vec / 2) % 2;  // the scale's place in its pair
                uint16_t bits = (uint16_t)(high ? pair >> 16 : pair & 0xffffu);
                x_raw.z = __float_as_uint(__bfloat162float(__ushort_as_bfloat16(bits)));
            }
        }
        float row_rstd = rstd[row];
        float x[8], dot = 0.0f;  // this thread's part of sum(g * xhat)
        rmsnorm_input8<GROUP16>(x, x_raw);
        for (int j = 0; j < 8; j++) dot += __bfloat162float(dyv[j]) * __bfloat162float(w[j]) * (x[j] * row_rstd);
        float mean_dot = block_sum_deterministic(dot, slots[row & 1]) / (float)C;
        if (!has) continue;
        Vec16<bf16> din_new;
        for (int j = 0; j < 8; j++) {
            float xhat = x[j] * row_rstd, dy = __bfloat162float(dyv[j]);
            float g = dy * __bfloat162float(w[j]);
            float grad = row_rstd * (g - xhat * mean_dot);
            din_new[j] = __float2bfloat16(__bfloat162float(din_old[j]) + grad);
            if (AMAX) din_max = fp8_abs_max(din_max, __bfloat162float(din_new[j]));
            dw[j] += dy * xhat;
        }
        store16(din + (size_t)row * C + vec * 8, din_new);
    }

    if (has) {
        float4 *dst = reinterpret_cast<float4 *>(dweight_partial + (size_t)blockIdx.x * C + vec * 8);
        dst[0] = make_float4(dw[0], dw[1], dw[2], dw[3]);
        dst[1] = make_float4(dw[4], dw[5], dw[6], dw[7]);
    }
    if (AMAX) fp8_block_amax(din_amax, din_max);
}

// dweight[c] += (or = without accumulate) sum over partials p of partial[p, c], always in the same
// order: slice s adds p = s, s + 16, ... and slice sums are then added in slice order.
__global__ void __launch_bounds__(RMSNORM_DWEIGHT_COLUMNS * RMSNORM_DWEIGHT_SLICES)
    rmsnorm_dweight_reduce_kernel(bf16 *dweight, const float *partial, int num_partials, int C, bool accumulate) {
    __shared__ float slice_sums[RMSNORM_DWEIGHT_SLICES][RMSNORM_DWEIGHT_COLUMNS];
    int column = blockIdx.x * RMSNORM_DWEIGHT_COLUMNS + threadIdx.x;
    float sum = 0.0f;
    if (column < C)
        for (int p = threadIdx.y; p < num_partials; p += RMSNORM_DWEIGHT_SLICES) sum += partial[(size_t)p * C + column];
    slice_sums[threadIdx.y][threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.y != 0 || column >= C) return;
    float total = 0.0f;
    for (int s = 0; s < RMSNORM_DWEIGHT_SLICES; s++) total += slice_sums[s][threadIdx.x];
    dweight[column] = __float2bfloat16(accumulate ? __bfloat162float(dweight[column]) + total : total);
}

// residual_out = residual_in + branch (rounded to BF16; branch NULL: no add, residual_out
// unused); norm_out = rmsnorm(residual) * weight (NULL: not stored). Optional: residual_copy.codes,
// the residual's 1x16 E4M3 copy (C a multiple of 16), which the norm then reads; norm_amax,
// max |norm_out|.
static inline void residual_rmsnorm_forward(bf16 *residual_out, bf16 *norm_out, float *rstd, const bf16 *residual_in,
                                            const bf16 *branch, const bf16 *weight, int N, int C, float eps,
                                            cudaStream_t stream, Fp8Groups residual_copy = Fp8Groups{NULL, NULL},
                                            Fp8Scale *norm_amax = NULL) {
    require_vector_rows("residual_rmsnorm_forward", "C", C);
    bool group16 = residual_copy.codes != NULL, amax = norm_amax != NULL;
    if (group16 && C % FP8_GROUP != 0) fail_with("residual_rmsnorm_forward", "C must be a multiple of 16 for 1x16 groups");
    int rows_per_block = RMSNORM_FORWARD_THREADS / 32;
    dim3 grid(ceil_div(N, rows_per_block));
    launch_with_flags(group16, amax, [&](auto GROUP16, auto AMAX) {
        residual_rmsnorm_forward_kernel<decltype(GROUP16)::value, decltype(AMAX)::value><<<grid, RMSNORM_FORWARD_THREADS, 0, stream>>>(
            residual_out, residual_copy, norm_out, rstd, norm_amax, residual_in, branch, weight, N, C, eps);
    });
    cudaCheckLaunch();
}

// The FP8 cast pass's source (coat/fp8.cuh) that recomputes the norm output from the norm's input
// and its rstd instead of reading a BF16 output: the BF16 input, or its 1x16 copy (GROUP16); the
// same values, bit for bit, as the forward kernel stores.
template <bool GROUP16>
struct RmsnormOutputSource {
    static constexpr int PLANES = 1;
    const bf16 *in;
    Fp8Groups groups;
    const float *rstd;
    const bf16 *weight;
    int C;
    __device__ __forceinline__ void load(int r, int c, float v[1][8]) const {
        float s[8];
        if (GROUP16) {
            fp8_load_group16(s, groups.codes + (size_t)r * C, groups.scales + (size_t)r * (C / FP8_GROUP), c);
        } else {
            Vec16<bf16> x = load16_stream(in + (size_t)r * C + c);
            for (int k = 0; k < 8; k++) s[k] = __bfloat162float(x[k]);
        }
        float row_rstd = rstd[r];
        Vec16<bf16> w = load16(weight + c);
        for (int k = 0; k < 8; k++) v[0][k] = __bfloat162float(rmsnorm_output(s[k], row_rstd, w[k]));
    }
};

// The FP8 cast that follows residual_rmsnorm_forward with an amax and no stored output (which
// gathered slot->amax and wrote rstd): out [N, C] and/or out_t [C, N] E4M3 of the norm output,
// from in (BF16) or, when its codes are set, in_copy (the 1x16 copy the norm read).
static inline void rmsnorm_output_cast(uint8_t *out, uint8_t *out_t, Fp8Scale *slot, const bf16 *in, Fp8Groups in_copy,
                                       const float *rstd, const bf16 *weight, int N, int C, cudaStream_t stream) {
    if (in_copy.codes != NULL)
        fp8_quantize_source(out, out_t, slot, RmsnormOutputSource<true>{in, in_copy, rstd, weight, C}, N, C, FP8_E4M3, stream);
    else
        fp8_quantize_source(out, out_t, slot, RmsnormOutputSource<false>{in, in_copy, rstd, weight, C}, N, C, FP8_E4M3, stream);
}

// out[N, C] = rmsnorm(in) * weight; rstd[N] is kept for the backward pass (the fused kernel, no add).
static inline void rmsnorm_forward(bf16 *out, float *rstd, const bf16 *in, const bf16 *weight, int N, int C,
                                   float eps, cudaStream_t stream) {
    residual_rmsnorm_forward(NULL, out, rstd, in, NULL, weight, N, C, eps, stream);
}

// FP32 dw partials, one row of C per block of RMSNORM_BACKWARD_ROWS_PER_BLOCK rows.
static inline size_t rmsnorm_backward_scratch_bytes(int N, int C) {
    return (size_t)ceil_div(N, RMSNORM_BACKWARD_ROWS_PER_BLOCK) * (size_t)C * sizeof(float);
}

// The staged kernel (one vector a thread) or the unstaged one (two), which take the same arguments.
static inline void rmsnorm_backward_launch(bool staged, int blocks, int threads, cudaStream_t stream, bf16 *din,
                                           float *scratch, Fp8Scale *din_amax, const bf16 *dout, const bf16 *in,
                                           Fp8Groups in_groups, const bf16 *weight, const float *rstd, int N, int C) {
    size_t smem = staged ? (size_t)RMSNORM_BACKWARD_STAGES * RMSNORM_BACKWARD_SLOTS * threads * sizeof(uint4) : 0;
    launch_with_flags(in_groups.codes != NULL, din_amax != NULL, [&](auto GROUP16, auto AMAX) {
        constexpr bool G = decltype(GROUP16)::value, A = decltype(AMAX)::value;
        auto kernel = staged ? rmsnorm_backward_staged_kernel<G, A> : rmsnorm_backward_kernel<G, A>;
        if (staged) cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        kernel<<<blocks, threads, smem, stream>>>(din, scratch, din_amax, dout, in, in_groups, weight, rstd, N, C);
    });
    cudaCheckLaunch();
}

// din += dx (read once, added in FP32, written once: din is the residual-stream gradient);
// dweight += dw (= dw without accumulate). The input x is `in` (BF16), or in_groups when its codes
// are set (1x16 E4M3, C a multiple of 16). din_amax (optional) gathers max |din| after the add.
// scratch holds rmsnorm_backward_scratch_bytes(N, C).
static inline void rmsnorm_backward(bf16 *din, bf16 *dweight, float *scratch, const bf16 *dout, const bf16 *in,
                                    const bf16 *weight, const float *rstd, int N, int C, cudaStream_t stream,
                                    Fp8Groups in_groups = Fp8Groups{NULL, NULL}, Fp8Scale *din_amax = NULL,
                                    bool accumulate = true) {
    require_vector_rows("rmsnorm_backward", "C", C);
    int vecs_per_row = C / 8;
    int max_vecs = RMSNORM_BACKWARD_MAX_THREADS * RMSNORM_BACKWARD_MAX_VECS_PER_THREAD;
    if (vecs_per_row > max_vecs) {
        fprintf(stderr, "error: rmsnorm_backward: C = %d is above the supported %d\n", C, 8 * max_vecs);
        exit(EXIT_FAILURE);
    }
    if (in_groups.codes != NULL && C % FP8_GROUP != 0) fail_with("rmsnorm_backward", "C must be a multiple of 16 for 1x16 groups");
    if (in_groups.codes != NULL && ((uintptr_t)in_groups.scales & 3u) != 0)  // the staged copies read scales in pairs
        fail_with("rmsnorm_backward", "the 1x16 scales must be 4-byte aligned");
    int blocks = ceil_div(N, RMSNORM_BACKWARD_ROWS_PER_BLOCK);
    bool staged = vecs_per_row <= RMSNORM_BACKWARD_MAX_THREADS;
    int vecs_per_thread = staged ? 1 : RMSNORM_BACKWARD_MAX_VECS_PER_THREAD;
    rmsnorm_backward_launch(staged, blocks, ceil_div(ceil_div(vecs_per_row, vecs_per_thread), 32) * 32, stream, din,
                            scratch, din_amax, dout, in, in_groups, weight, rstd, N, C);
    dim3 reduce_threads(RMSNORM_DWEIGHT_COLUMNS, RMSNORM_DWEIGHT_SLICES);
    rmsnorm_dweight_reduce_kernel<<<ceil_div(C, RMSNORM_DWEIGHT_COLUMNS), reduce_threads, 0, stream>>>(
        dweight, scratch, blocks, C, accumulate);
    cudaCheckLaunch();
}
