// Causal flash attention with grouped-query heads, forward and backward, on Hopper (sm_90a): TMA
// loads and warpgroup MMA (wgmma) on BF16 with FP32 accumulation. No T x T matrix is stored, but for
// dS at head_dim 128 where the caller gives it room (attention_backward_ds_bytes).
//
//   forward:  S = scale Q K^T (keys s <= query t), P = softmax(S), O = P V, lse = log sum_s exp(S)
//   backward: D = rowsum(dO * O), dP = dO V^T, dS = P (dP - D),
//             dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO;      scale = 1 / sqrt(head_dim)
//
// Layouts (row-major): qkv and dqkv [B, T, (NH + 2 NKV) * head_dim] BF16, each row holding NH query
// heads, then NKV key heads, then NKV value heads (q and k already rotated by RoPE); out and dout
// [B, T, NH, head_dim] BF16; lse (natural log) [B, NH, T] FP32.
// Query head h reads kv head h / (NH / NKV) where it lies: K and V are never copied per query head.
// head_dim is 64 or 128; any T >= 1: tile rows past T are read as zeros and masked.
//
// The kernels are in attention_wgmma.cuh (included below); this file holds what they share, the
// kernel for D, the tile shapes the program uses (AttentionDefaults) and the launchers
// attention_forward and attention_backward. Other designs (mma.sync kernels, a one-pass backward, a
// cp.async-fed wgmma backward) live in test/attention_variants.cuh, and
// test/bench_attention_variants.cu checks and times them against these.
#pragma once
#include <math.h>
#include <stdint.h>

#include "common.cuh"
#include "rope.cuh"

static constexpr float ATTENTION_LOG2E = 1.4426950408889634f;
static constexpr float ATTENTION_LN2 = 0.6931471805599453f;

// ---- building blocks ------------------------------------------------------------------------------

// 2^x in one instruction; 2^-inf = 0, which is how masked scores vanish.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats as BF16 (round to nearest even) in one register, the first in the low half.
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    return (uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((uint32_t)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// A dQ pass's statistics of rows row_lo and row_lo + 8 of head h of batch b: lse in log2 units and D,
// from lse and delta [B, NH, T]. Rows past T (or before 0) get lse = +inf, so that their P is exactly
// 0, and D = 0.
__device__ __forceinline__ void attention_dq_row_statistics(float (&row_lse_log2)[2], float (&row_delta)[2],
                                                            const float *lse, const float *delta, int b, int h, int NH,
                                                            int T, int row_lo) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row_lo + 8 * r;
        const size_t index = ((size_t)b * NH + h) * T + row;
        const bool valid = row >= 0 && row < T;  // rows before 0: a TMA query block's first warpgroups
        row_lse_log2[r] = valid ? lse[index] * ATTENTION_LOG2E : INFINITY;
        row_delta[r] = valid ? delta[index] : 0.f;
    }
}

// Max of bits and the float bits of |x| for both BF16 halves of pair (a BF16's bits, shifted, are
// its float's).
__device__ __forceinline__ uint32_t bf16x2_abs_bits_max(uint32_t bits, __nv_bfloat162 pair) {
    const uint32_t p = *reinterpret_cast<const uint32_t *>(&pair);
    return max(bits, max((p & 0x7fffu) << 16, p & 0x7fff0000u));
}

// Folds a warp's maxima, as float bits of |x| (a NaN's exceed every other), into *amax: one atomic
// max per warp, so the result does not depend on the order (the FP8 amax of the output or of
// dqkv). Every lane of the warp must call it.
__device__ __forceinline__ void attention_fold_amax(float *amax, uint32_t bits, int lane) {
    bits = __reduce_max_sync(0xffffffffu, bits);
    if (lane == 0 && bits > 0) atomicMax(reinterpret_cast<unsigned *>(amax), bits);
}

// RoPE's backward and the FP8 cast's amax, done by the backward as it stores dqkv: dQ and dK
// rotated by minus their rows' angles after their rounding to BF16 and rounded again, as
// rope_rotate would in a pass of its own over the stored dqkv (the same bits), and max |dqkv| as
// stored, v heads included, folded into *amax.
typedef struct {
    const float *cos, *sin;  // [T, head_dim / 2]: the forward's tables (coat/rope.cuh); NULL: no rotation
    float *amax;             // NULL: none gathered
} AttentionRopeBackward;

// ---- block order ----------------------------------------------------------------------------------

// The order in which a causal pass starts its blocks. Each block computes tile x of one (head,
// batch) pair, and its work grows or falls with x (a forward or dQ block's rows see more keys the
// later they lie; a dK/dV block's keys are seen by fewer queries). The GPU starts blocks in the
// order of their index, one per SM here, so the pass ends with whatever ran last:
//   ATTENTION_ORDER_GRID           pair after pair, each pair's tiles longest first (the last pair's
//                                  longest block can start just before the end);
//   ATTENTION_ORDER_LONGEST_FIRST  tile by tile, longest first, over all pairs (the end holds only
//                                  the shortest blocks; blocks of one pair seldom run side by side,
//                                  so each reads its K/V or Q/dO from memory, not from L2);
//   ATTENTION_ORDER_L2_CHUNKS      the same within chunks of pairs, chunk after chunk, a chunk's pairs
//                                  reading about half the L2.
enum AttentionOrder { ATTENTION_ORDER_GRID, ATTENTION_ORDER_LONGEST_FIRST, ATTENTION_ORDER_L2_CHUNKS };

struct AttentionBlock {
    int x, pair;  // x: 0 is the longest tile
};

// Block `linear` of tiles x pairs blocks, pairs taken chunk_pairs at a time, in each chunk tile by tile.
__host__ __device__ __forceinline__ AttentionBlock attention_block_in_order(int linear, int tiles, int pairs,
                                                                            int chunk_pairs) {
    const int chunk = linear / (chunk_pairs * tiles), first_pair = chunk * chunk_pairs;
    const int in_chunk = pairs - first_pair < chunk_pairs ? pairs - first_pair : chunk_pairs;
    const int r = linear - first_pair * tiles;
    return AttentionBlock{r / in_chunk, first_pair + r % in_chunk};
}

// ---- backward: D ---------------------------------------------------------------------------------

// D[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d] in FP32; HEAD_DIM / 8 lanes per row.
template <int HEAD_DIM>
__global__ void attention_backward_delta_kernel(float *delta, const bf16 *dout, const bf16 *out, int B, int T, int NH) {
    constexpr int LANES_PER_ROW = HEAD_DIM / 8;
    size_t thread = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t row = thread / LANES_PER_ROW;  // over (b, t, h), the order of out
    int col = (int)(thread % LANES_PER_ROW) * 8;
    bool valid = row < (size_t)B * T * NH;
    float sum = 0.f;
    if (valid) {
        Vec16<bf16> d = load16(dout + row * HEAD_DIM + col), o = load16(out + row * HEAD_DIM + col);
#pragma unroll
        for (int i = 0; i < 8; i++) sum += __bfloat162float(d[i]) * __bfloat162float(o[i]);
    }
#pragma unroll
    for (int offset = LANES_PER_ROW / 2; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (valid && col == 0) {
        int h = (int)(row % NH);
        size_t bt = row / NH;
        delta[(bt / T * NH + h) * T + bt % T] = sum;
    }
}

// ---- launchers ----------------------------------------------------------------------------------

static inline void attention_check_args(const char *who, const void *const *pointers, int n_pointers, int B, int T,
                                        int NH, int NKV, int head_dim) {
    if (B < 1 || B > 65535 || T < 1 || NH < 1 || NH > 65535 || NKV < 1 || NH % NKV != 0 ||
        (head_dim != 64 && head_dim != 128)) {
        fprintf(stderr,
                "error: %s: unsupported shape B=%d T=%d NH=%d NKV=%d head_dim=%d "
                "(need NKV dividing NH, head_dim 64 or 128)\n",
                who, B, T, NH, NKV, head_dim);
        exit(EXIT_FAILURE);
    }
    for (int i = 0; i < n_pointers; i++)
        if ((uintptr_t)pointers[i] % 16 != 0) {
            fprintf(stderr, "error: %s: tensor argument %d is not 16-byte aligned\n", who, i + 1);
            exit(EXIT_FAILURE);
        }
}

static inline float attention_softmax_scale(int head_dim) { return (float)(1.0 / sqrt((double)head_dim)); }

// Kernels with more than 48 KiB of shared memory must opt in, per kernel.
template <class Kernel>
static void attention_launch_setup(Kernel kernel, size_t smem_bytes) {
    cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
}

// Pairs per chunk of an order, for pairs whose blocks read pair_bytes that blocks of the same pair share.
static int attention_chunk_pairs(AttentionOrder order, int pairs, double pair_bytes) {
    if (order == ATTENTION_ORDER_GRID) return 1;
    if (order == ATTENTION_ORDER_LONGEST_FIRST) return pairs;
    static int l2_bytes = 0;
    if (l2_bytes == 0) {
        int device;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device));
    }
    const double chunk = floor(0.5 * l2_bytes / pair_bytes);
    return chunk < 1.0 ? 1 : chunk > pairs ? pairs : (int)chunk;
}

// A pass of tiles x pairs blocks as a 1-D grid.
static inline unsigned attention_grid_blocks(int tiles, int pairs) {
    if ((long long)tiles * pairs > 0x7fffffffLL) {
        fprintf(stderr, "error: attention: %d x %d blocks exceed the grid's limit\n", tiles, pairs);
        exit(EXIT_FAILURE);
    }
    return (unsigned)(tiles * pairs);
}

// The blocks of a kernel that run at once on the device, at most `blocks`: a persistent grid. The runtime
// is asked once per kernel (a pass's threads and shared memory are fixed at compile time); the table is
// keyed by the kernel's address since every kernel of one signature shares this function.
template <typename Kernel>
static unsigned attention_resident_blocks(Kernel kernel, int threads, size_t smem_bytes, unsigned blocks) {
    enum { KNOWN_KERNELS = 32 };  // past these the runtime is asked every time
    static struct { const void *kernel; unsigned resident; } known[KNOWN_KERNELS];
    static int count = 0;
    unsigned resident = 0;
    for (int i = 0; i < count && resident == 0; i++)
        if (known[i].kernel == (const void *)kernel) resident = known[i].resident;
    if (resident == 0) {
        int device, sms, per_sm;
        cudaCheck(cudaGetDevice(&device));
        cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        cudaCheck(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem_bytes));
        resident = (unsigned)(sms * (per_sm > 0 ? per_sm : 1));
        if (count < KNOWN_KERNELS) known[count++] = {(const void *)kernel, resident};
    }
    return resident < blocks ? resident : blocks;
}

// Dynamic shared memory one block may opt in to on sm_90.
#define ATTENTION_MAX_SMEM_BYTES (227 * 1024)

#include "attention_wgmma.cuh"

// The kernels the program uses: on Hopper, the TMA forward and two-pass backward of
// attention_wgmma.cuh (producer warpgroup, mbarriers, wgmma from 128B-swizzled tiles), measured on
// the H200 at the llama shapes against every variant of test/bench_attention_variants.cu. Forward:
// K/V tiles of 128 keys in 2 stages, 3 consumer warpgroups at head_dim 64 (192 query rows per K/V
// tile) and 2 at 128 (O takes 64 registers a thread), 1.07-1.13x the same kernel on tiles of 64 keys
// and 1.09-1.68x the mma.sync kernels. Backward: at head_dim 64, 3 consumer warpgroups of 160
// registers in both passes (192 key rows a dK/dV block; dQ on K/V tiles of 64), 1.09-1.10x the same
// passes with 2 consumers of 232 (whose tensor cores sat idle 60% of the time: each consumer runs its
// products and its exponentials one after the other); at 128, 2 consumers (dK and dV take 128
// registers a thread), 1.5-1.7x the cp.async-fed wgmma two passes. The backward's blocks start
// longest first at head_dim 64 (1.02-1.05x the grid's order) and in L2-sized chunks at 128 (1.01-1.07x;
// longest first reads from memory there). Persistent (one block per SM taking the pass's blocks in
// turn, the same bits): the forward, in L2-sized chunks of pairs, 1.16-1.23x the launched forward at
// head_dim 64 and 1.06-1.14x at 128; the backward 1.02-1.13x at 64, and at 128 no faster (0.95-1.00x
// for the two passes, 0.95-1.01x the stored-dS launched), so it stays launched a block each there.
template <int HEAD_DIM>
struct AttentionDefaults;
template <>
struct AttentionDefaults<64> {
    typedef AttentionTmaForwardConfig<128, 3, 2, false, ATTENTION_ORDER_L2_CHUNKS, true> forward;
    typedef AttentionTmaTwoPassConfig<4, 64, 4, 3, 3, ATTENTION_ORDER_LONGEST_FIRST, false, true> backward;
};
template <>
struct AttentionDefaults<128> {
    typedef AttentionTmaForwardConfig<128, 2, 2, false, ATTENTION_ORDER_L2_CHUNKS, true> forward;
    typedef AttentionTmaTwoPassConfig<3, 64, 4, 2, 2, ATTENTION_ORDER_L2_CHUNKS> backward;
    // Given a buffer for dS (attention_ds_bytes): the dK/dV pass stores dS^T and the dQ pass only
    // multiplies it by K (4 consumers of 64 query rows): 1.10-1.21x the backward above at the
    // llama shapes, the same bits. At head_dim 64 it measured 0.98-1.00x (twice dS's bytes per FLOP).
    typedef AttentionTmaTwoPassConfig<3, 64, 4, 2, 4, ATTENTION_ORDER_L2_CHUNKS, true> backward_stored_ds;
};

template <int HEAD_DIM>
static void attention_backward_delta_launch(float *delta, const bf16 *dout, const bf16 *out, int B, int T, int NH,
                                            cudaStream_t stream) {
    size_t threads = (size_t)B * T * NH * (HEAD_DIM / 8);
    attention_backward_delta_kernel<HEAD_DIM>
        <<<(unsigned)ceil_div_size(threads, 256), 256, 0, stream>>>(delta, dout, out, B, T, NH);
    cudaCheckLaunch();
}

// out [B, T, NH, head_dim] and lse [B, NH, T] from the packed qkv [B, T, (NH + 2 NKV) head_dim].
// out_amax (optional): max |out| as stored is folded into it (the FP8 cast of the output reads it).
static inline void attention_forward(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                     int head_dim, cudaStream_t stream, float *out_amax = NULL) {
    const void *pointers[] = {out, lse, qkv};
    attention_check_args("attention_forward", pointers, 3, B, T, NH, NKV, head_dim);
    if (head_dim == 64)
        attention_forward_tma_launch<64, AttentionDefaults<64>::forward>(out, lse, qkv, B, T, NH, NKV, stream, out_amax);
    else
        attention_forward_tma_launch<128, AttentionDefaults<128>::forward>(out, lse, qkv, B, T, NH, NKV, stream,
                                                                           out_amax);
}

// Bytes of device scratch attention_backward needs: D, one float per (batch, head, position).
static inline size_t attention_backward_scratch_bytes(int B, int T, int NH) {
    return (size_t)B * NH * T * sizeof(float);
}

// Bytes of the optional dS buffer of attention_backward: BF16 dS^T on and below the diagonal in 64 x 64
// tiles, at head_dim 128 (0 at 64, which does not use it). coat/memory_plan.h counts the same.
static inline size_t attention_backward_ds_bytes(int B, int T, int NH, int head_dim) {
    return head_dim == 128 ? attention_ds_bytes(B, T, NH) : 0;
}

// Writes all of dqkv (packed like qkv) from dout and the forward's qkv, out and lse: D into scratch,
// then the dK/dV pass and the dQ pass. scratch: attention_backward_scratch_bytes(B, T, NH) bytes of
// device memory. ds (optional, used at head_dim 128): attention_backward_ds_bytes(B, T, NH,
// head_dim) bytes, for the faster dQ pass. rope (optional): RoPE's backward and the amax of dqkv,
// done as dqkv is stored; its tables hold at least T rows.
static inline void attention_backward(bf16 *dqkv, float *scratch, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                                      const float *lse, int B, int T, int NH, int NKV, int head_dim,
                                      cudaStream_t stream, bf16 *ds = NULL,
                                      AttentionRopeBackward rope = AttentionRopeBackward{}) {
    const void *pointers[] = {dqkv, scratch, dout, qkv, out, lse};
    attention_check_args("attention_backward", pointers, 6, B, T, NH, NKV, head_dim);
    if ((rope.cos == NULL) != (rope.sin == NULL)) {
        fprintf(stderr, "error: attention_backward: RoPE needs both its cos and its sin table\n");
        exit(EXIT_FAILURE);
    }
    if (head_dim == 128) {
        attention_backward_delta_launch<128>(scratch, dout, out, B, T, NH, stream);
        if (ds != NULL)
            attention_backward_tma_launch<128, AttentionDefaults<128>::backward_stored_ds>(
                dqkv, scratch, dout, qkv, lse, B, T, NH, NKV, stream, ds, rope);
        else
            attention_backward_tma_launch<128, AttentionDefaults<128>::backward>(dqkv, scratch, dout, qkv, lse, B, T,
                                                                                 NH, NKV, stream, NULL, rope);
    } else {
        attention_backward_delta_launch<64>(scratch, dout, out, B, T, NH, stream);
        attention_backward_tma_launch<64, AttentionDefaults<64>::backward>(dqkv, scratch, dout, qkv, lse, B, T, NH,
                                                                           NKV, stream, NULL, rope);
    }
}
