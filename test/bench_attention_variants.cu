// Checks and times the attention kernels of coat/attention.cuh and the variants of
// test/attention_variants.cuh in one GPU run, so that the fastest can become AttentionDefaults. Not a
// test of the program (test/test_attention.cu is).
//
// A variant is a forward config and a backward config (see the table below); each row changes one
// of the two from the default. Per shape, the default variant's out, lse and dqkv are the
// reference: each variant's forward runs from poisoned (NaN) out and lse, its backward from a
// poisoned dqkv and scratch on the reference's out and lse, twice. A variant passes when every
// output element is written, max |got - reference| / max |reference| stays below 2e-2 for the
// BF16 tensors out, dq, dk, dv and below 1e-4 for lse (FP32), and its two backward runs agree
// bitwise. Timing: CUDA events, median of 10 runs after 3 warm-ups, of the forward and of forward +
// backward; TFLOP/s with causal FLOPs counted as test/test_attention.cu does (forward 4 B NH T^2
// head_dim / 2, forward + backward 3.5 times that). The GPU's clocks drift over a run (a kernel timed
// late can take 5% longer than early), so the default is timed again right before each variant and
// each variant is compared with that timing ("vs default": its speed-up); the default's timings of
// a shape give its noise (their spread). Shapes: the four of the attention peers (coat/README.md,
// Peers and hardware figures; timed), llama3-8b's at micro-batch 10 (grouped-query heads at
// head_dim 128; timed) and a small odd one per head_dim, T = 100 (checked only). At the end, per
// timed shape, the default's noise and the passing variant with the largest speed-up in the
// forward, the backward (forward + backward time less forward time) and forward + backward.
//
// Run: make build/bench_attention_variants && build/bench_attention_variants [FILTER]
// (FILTER, e.g. "tma": only the default and the variants whose names contain it)
// Registers per thread (ptxas -v, sm_90a): see the comments in the tables; variants that spill are
// left out and listed below the tables.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "attention_variants.cuh"
#include "check.h"
#include "gpu_test_util.cuh"

#define WARMUP_RUNS 3
#define TIMED_RUNS 10
#define BF16_TOLERANCE 2e-2f
#define LSE_TOLERANCE 1e-4f

// Short names for the table. Fwd: warps, m16 tiles per warp, K/V tile, Q in registers, min blocks
// per SM. DkDv: warps (16 key rows each), query tile, min blocks. Dq: warps (16 query rows each),
// K/V tile, min blocks. OnePass: min blocks. Each last: pipeline stages ("st" in the names when not 2).
template <int W, int M, int KV, bool Q_REG, int MB, int ST = 2>
using Fwd = AttentionForwardConfig<W, M, KV, Q_REG, MB, ST>;
template <int W, int Q, int MB, int ST = 2>
using DkDv = AttentionDkDvConfig<W, Q, MB, ST>;
template <int W, int KV, int MB, int ST = 2>
using Dq = AttentionDqConfig<W, KV, MB, ST>;
template <class DKDV, class DQ>
using TwoPass = AttentionTwoPassConfig<DKDV, DQ>;
template <int MB, int ST = 2>
using OnePass = AttentionOnePassConfig<MB, ST>;
// TMA forward: K/V tile, consumers, stages, overlap, block order, persistent blocks
template <int KV, int CONSUMERS, int ST, bool OVERLAP = false, AttentionOrder ORDER = ATTENTION_ORDER_GRID,
          bool PERSISTENT = false>
using TmaFwd = AttentionTmaForwardConfig<KV, CONSUMERS, ST, OVERLAP, ORDER, PERSISTENT>;
// TMA two passes: dK/dV stages; dQ K/V tile and stages; consumer warpgroups of dK/dV and of dQ; block
// order; dS stored; persistent blocks
template <int DKDV_ST, int DQ_KV, int DQ_ST, int DKDV_C = 2, int DQ_C = 2, AttentionOrder ORDER = ATTENTION_ORDER_GRID,
          bool STORE_DS = false, bool PERSISTENT = false>
using TmaTwoPass = AttentionTmaTwoPassConfig<DKDV_ST, DQ_KV, DQ_ST, DKDV_C, DQ_C, ORDER, STORE_DS, PERSISTENT>;
constexpr AttentionOrder LONGEST = ATTENTION_ORDER_LONGEST_FIRST, L2_CHUNKS = ATTENTION_ORDER_L2_CHUNKS;
template <int Q, int KV>  // wgmma two passes: dK/dV query tile, dQ K/V tile, one block per SM each
using WgmmaTwoPass = AttentionWgmmaTwoPassConfig<AttentionWgmmaDkDvConfig<Q, 1>, AttentionWgmmaDqConfig<KV, 1>>;

typedef void (*ForwardLaunch)(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                              cudaStream_t stream);
typedef void (*BackwardLaunch)(bf16 *dqkv, float *scratch, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                               const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream);

typedef struct {
    char forward_name[80], backward_name[80];
    ForwardLaunch forward;
    BackwardLaunch backward;
} Variant;

// The block order's name in a variant's ("" for the grid's order).
static const char *order_suffix(AttentionOrder order) {
    if (order == ATTENTION_ORDER_LONGEST_FIRST) return " longest-first";
    return order == ATTENTION_ORDER_L2_CHUNKS ? " l2-chunks" : "";
}

// " stN" for N pipeline stages other than 2, else "".
static const char *stages_suffix(int stages) {
    static const char *names[] = {"", "", "", " st3", " st4", " st5"};
    return stages >= 0 && stages <= 5 ? names[stages] : " st?";
}

template <class C>
static void describe_forward(char *text, size_t size) {
    if constexpr (C::tma)
        snprintf(text, size, "fwd tma kv%d c%d st%d%s%s%s", C::kv_tile, C::consumers, C::stages,
                 C::overlap ? " overlap" : "", order_suffix(C::order), C::persistent ? " persistent" : "");
    else
        snprintf(text, size, "fwd w%d m%d kv%d q-%s mb%d%s", C::warps, C::m_tiles, C::kv_tile,
                 C::q_in_registers ? "reg" : "smem", C::min_blocks, stages_suffix(C::stages));
}

template <class C>
static void describe_backward(char *text, size_t size) {
    if constexpr (C::one_pass)
        snprintf(text, size, "bwd 1-pass mb%d%s", C::min_blocks, stages_suffix(C::stages));
    else if constexpr (C::wgmma)
        snprintf(text, size, "bwd wgmma dkdv q%d, dq kv%d", C::dkdv::q_tile, C::dq::kv_tile);
    else if constexpr (C::tma)
        snprintf(text, size, "bwd tma dkdv c%d st%d, dq %s%d c%d st%d%s%s", C::dkdv_consumers, C::dkdv_stages,
                 C::store_ds ? "dS-kv" : "kv", C::dq_kv_tile, C::dq_consumers, C::dq_stages,
                 order_suffix(C::order), C::persistent ? " persistent" : "");
    else
        snprintf(text, size, "bwd 2-pass dkdv w%d q%d mb%d%s, dq w%d kv%d mb%d%s", C::dkdv::warps, C::dkdv::q_tile,
                 C::dkdv::min_blocks, stages_suffix(C::dkdv::stages), C::dq::warps, C::dq::kv_tile,
                 C::dq::min_blocks, stages_suffix(C::dq::stages));
}

// tag (optional): appended to the forward's name in brackets, for a filter to pick a group of rows.
template <int HEAD_DIM, class Forward, class Backward>
static Variant variant(const char *tag = NULL) {
    Variant v;
    describe_forward<Forward>(v.forward_name, sizeof v.forward_name);
    if (tag != NULL) {
        const size_t used = strlen(v.forward_name);
        snprintf(v.forward_name + used, sizeof v.forward_name - used, " [%s]", tag);
    }
    describe_backward<Backward>(v.backward_name, sizeof v.backward_name);
    v.forward = attention_variant_forward_launch<HEAD_DIM, Forward>;
    v.backward = attention_variant_backward_launch<HEAD_DIM, Backward>;
    return v;
}

// ---- the variants: row 0 is the default, the reference ------------------------------------------
// Registers per thread from ptxas; the occupancy they allow (blocks x warps per SM, 64K registers)
// in brackets.

typedef AttentionDefaults<64>::forward Fwd64;
typedef AttentionDefaults<64>::backward Bwd64;
static const Variant variants_hd64[] = {
    variant<64, Fwd64, Bwd64>(),  // TMA: 160 registers per consumer in fwd, dkdv and dq
    // TMA forward and backward
    variant<64, TmaFwd<64, 2, 4>, Bwd64>(),
    // FlashAttention-3's order within a consumer (attention_forward_overlap_kernel)
    variant<64, TmaFwd<128, 2, 2, true, L2_CHUNKS, true>, Bwd64>("overlap"),
    variant<64, TmaFwd<64, 3, 4, true, L2_CHUNKS, true>, Bwd64>("overlap"),
    variant<64, TmaFwd<64, 3, 4>, Bwd64>(),
    variant<64, TmaFwd<128, 3, 3>, Bwd64>(),
    variant<64, TmaFwd<128, 2, 3>, Bwd64>(),
    // the program's passes launched a block each, and other orders of its persistent passes
    variant<64, TmaFwd<128, 3, 2>, Bwd64>("persistence"),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 3, LONGEST>>("persistence"),
    variant<64, TmaFwd<128, 3, 2, false, ATTENTION_ORDER_GRID, true>, Bwd64>("persistence"),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 3, L2_CHUNKS, false, true>>("persistence"),
    variant<64, Fwd64, TmaTwoPass<3, 64, 4, 2, 2, Bwd64::order>>(),
    variant<64, Fwd64, TmaTwoPass<4, 128, 3, 2, 2, Bwd64::order>>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 2, 3, Bwd64::order>>(),
    variant<64, Fwd64, TmaTwoPass<6, 64, 4, 3, 3, Bwd64::order>>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 6, 3, 3, Bwd64::order>>(),
    // dS^T stored by the dK/dV pass, dQ = dS K from it
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 3, Bwd64::order, true>>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 4, Bwd64::order, true>>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 6, 3, 2, Bwd64::order, true>>(),
    // block orders (attention.cuh, AttentionOrder)
    variant<64, TmaFwd<128, 3, 2, false, LONGEST>, Bwd64>(),
    variant<64, TmaFwd<128, 3, 2, false, L2_CHUNKS>, Bwd64>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 3>>(),
    variant<64, Fwd64, TmaTwoPass<4, 64, 4, 3, 3, L2_CHUNKS>>(),
    // forward
    variant<64, Fwd<4, 2, 64, true, 2>, Bwd64>(),   // 246 [2x4]
    variant<64, Fwd<4, 2, 32, true, 2>, Bwd64>(),   // 194 [2x4]
    variant<64, Fwd<4, 2, 32, false, 3>, Bwd64>(),  // 161 [3x4]
    variant<64, Fwd<4, 2, 16, false, 4>, Bwd64>(),  // 128 [4x4]
    variant<64, Fwd<4, 1, 64, true, 4>, Bwd64>(),   // 128 [4x4]
    variant<64, Fwd<4, 1, 128, true, 2>, Bwd64>(),  // 228 [2x4]
    variant<64, Fwd<8, 1, 64, true, 2>, Bwd64>(),   // 128 [2x8]
    variant<64, Fwd<8, 1, 64, false, 2>, Bwd64>(),  // 125 [2x8]
    variant<64, Fwd<8, 1, 32, true, 2>, Bwd64>(),   // 120 [2x8]
    variant<64, Fwd<8, 2, 64, true, 1>, Bwd64>(),   // 238 [1x8]
    // backward: dK/dV pass
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<8, 32, 2>>>(),  // dkdv 231 [1x8], dq 126 [2x8]
    variant<64, Fwd64, TwoPass<DkDv<8, 32, 1>, Dq<8, 32, 2>>>(),   // 194 [1x8]
    variant<64, Fwd64, TwoPass<DkDv<8, 64, 1>, Dq<8, 32, 2>>>(),   // 231 [1x8]
    variant<64, Fwd64, TwoPass<DkDv<4, 64, 2>, Dq<8, 32, 2>>>(),   // 234 [2x4]
    variant<64, Fwd64, TwoPass<DkDv<4, 64, 3>, Dq<8, 32, 2>>>(),   // 168 [3x4]
    variant<64, Fwd64, TwoPass<DkDv<4, 32, 3>, Dq<8, 32, 2>>>(),   // 161 [3x4]
    // backward: dQ pass
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<8, 64, 1>>>(),  // 186 [1x8]
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<4, 32, 4>>>(),  // 128 [4x4]
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<4, 64, 3>>>(),  // 168 [3x4]
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<4, 16, 4>>>(),  // 114 [4x4]
    // backward: one pass
    variant<64, Fwd64, OnePass<1>>(),  // 243 [1x8]
    // pipeline stages
    variant<64, Fwd<4, 2, 64, true, 2, 3>, Bwd64>(),
    variant<64, Fwd<4, 2, 64, true, 2, 4>, Bwd64>(),
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1, 3>, Dq<8, 32, 2>>>(),
    variant<64, Fwd64, TwoPass<DkDv<8, 128, 1>, Dq<8, 32, 2, 4>>>(),
};

typedef AttentionDefaults<128>::forward Fwd128;
typedef AttentionDefaults<128>::backward Bwd128;
static const Variant variants_hd128[] = {
    variant<128, Fwd128, Bwd128>(),  // TMA: fwd 240 registers per consumer; dkdv and dq 240
    // TMA forward and backward
    variant<128, TmaFwd<64, 2, 3>, Bwd128>(),
    // FlashAttention-3's order within a consumer (attention_forward_overlap_kernel)
    variant<128, TmaFwd<128, 2, 2, true, L2_CHUNKS, true>, Bwd128>("overlap"),  // 8 bytes of spill stores
    variant<128, TmaFwd<128, 2, 2, true, L2_CHUNKS>, Bwd128>("overlap"),
    variant<128, TmaFwd<64, 2, 4, true, L2_CHUNKS, true>, Bwd128>("overlap"),  // 4 bytes of spill stores
    variant<128, TmaFwd<64, 2, 4>, Bwd128>(),
    variant<128, TmaFwd<64, 3, 4>, Bwd128>(),
    // the forward launched a block each; the backward persistent (one block per SM taking the blocks
    // in turn) with and without the stored dS, and launched with it
    variant<128, TmaFwd<128, 2, 2>, Bwd128>("persistence"),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 2, L2_CHUNKS, false, true>>("persistence"),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 4, L2_CHUNKS, true>>("persistence"),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 4, L2_CHUNKS, true, true>>("persistence"),
    variant<128, Fwd128, TmaTwoPass<2, 64, 4, 2, 4, L2_CHUNKS, true, true>>("persistence"),
    variant<128, Fwd128, TmaTwoPass<4, 64, 3, 2, 2, Bwd128::order>>(),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 3, Bwd128::order>>(),
    // dS^T stored by the dK/dV pass, dQ = dS K from it
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 3, Bwd128::order, true>>(),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 4, Bwd128::order, true>>(),
    variant<128, Fwd128, TmaTwoPass<3, 64, 3, 2, 2, Bwd128::order, true>>(),
    // block orders (attention.cuh, AttentionOrder)
    variant<128, TmaFwd<128, 2, 2, false, LONGEST>, Bwd128>(),
    variant<128, TmaFwd<128, 2, 2, false, L2_CHUNKS>, Bwd128>(),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4, 2, 2, LONGEST>>(),
    variant<128, Fwd128, TmaTwoPass<3, 64, 4>>(),
    // forward
    variant<128, Fwd<4, 2, 32, false, 2>, Bwd128>(),   // 255 [2x4]
    variant<128, Fwd<4, 2, 16, false, 2>, Bwd128>(),   // 215 [2x4]
    variant<128, Fwd<4, 1, 32, false, 3>, Bwd128>(),   // 161 [3x4]
    variant<128, Fwd<4, 1, 64, false, 2>, Bwd128>(),   // 210 [2x4]
    variant<128, Fwd<4, 1, 64, true, 2>, Bwd128>(),    // 234 [2x4]
    variant<128, Fwd<8, 1, 16, false, 2>, Bwd128>(),   // 113 [2x8]
    variant<128, Fwd<8, 1, 32, false, 2>, Bwd128>(),   // 128 [2x8]
    variant<128, Fwd<8, 1, 64, false, 1>, Bwd128>(),   // 188 [1x8]
    variant<128, Fwd<8, 1, 128, false, 1>, Bwd128>(),  // 244 [1x8]
    variant<128, Fwd<8, 2, 32, false, 1>, Bwd128>(),   // 240 [1x8]
    // backward: wgmma two passes
    variant<128, Fwd128, WgmmaTwoPass<64, 128>>(),  // dkdv 242 [1x8], dq 255 [1x8]
    variant<128, Fwd128, WgmmaTwoPass<64, 64>>(),   // dq 187 [1x8]
    // backward: one pass
    variant<128, Fwd128, OnePass<1, 3>>(),  // 255 and 16 bytes of spills
    // backward: two passes
    variant<128, Fwd128, TwoPass<DkDv<8, 64, 1>, Dq<8, 32, 1>>>(),  // dkdv 255 [1x8], dq 192 [1x8]
    variant<128, Fwd128, TwoPass<DkDv<8, 32, 1>, Dq<8, 32, 1>>>(),  // dkdv 244 [1x8]
    variant<128, Fwd128, TwoPass<DkDv<8, 16, 1>, Dq<8, 32, 1>>>(),  // dkdv 232 [1x8]
    variant<128, Fwd128, TwoPass<DkDv<4, 64, 2>, Dq<8, 32, 1>>>(),  // dkdv 255 [2x4]
    variant<128, Fwd128, TwoPass<DkDv<4, 32, 2>, Dq<8, 32, 1>>>(),  // dkdv 248 [2x4]
    variant<128, Fwd128, TwoPass<DkDv<8, 64, 1>, Dq<8, 64, 1>>>(),  // dq 230 [1x8]
    variant<128, Fwd128, TwoPass<DkDv<8, 64, 1>, Dq<8, 16, 2>>>(),  // dq 128 [2x8]
    variant<128, Fwd128, TwoPass<DkDv<8, 64, 1>, Dq<4, 32, 2>>>(),  // dq 198 [2x4]
    variant<128, Fwd128, TwoPass<DkDv<8, 64, 1>, Dq<4, 16, 4>>>(),  // dq 128 [4x4]
    // pipeline stages
    variant<128, Fwd<4, 2, 32, false, 2, 3>, Bwd128>(),
    variant<128, Fwd<4, 2, 32, false, 2, 4>, Bwd128>(),
    variant<128, Fwd128, OnePass<1, 2>>(),
};

// Left out for register spills (ptxas -v, bytes stored / loaded): forward hd64 w4 m2 kv128 q-reg
// mb2 (188/188), w4 m2 kv64 q-reg mb3 (444/376), w4 m2 kv32 q-reg mb3 (8/8), w8 m2 kv64 q-reg mb2
// (1048/820), w8 m1 kv128 q-reg mb2 (124/120); forward hd128 w4 m2 kv64 q-smem mb2 (164/164), w4 m2
// kv32 q-reg mb2 (156/148), w4 m2 kv16 q-reg mb2 (4/4), w8 m1 kv32 q-reg mb2 (80/76), w8 m1 kv64
// q-smem mb2 (80/80), w8 m2 kv64 q-smem mb1 (84/84); dK/dV hd64 w8 q32 mb2 (8/8), w8 q64 mb2
// (176/148), w8 q128 mb2 (1072/840); dK/dV hd128 w8 q128 mb1 (188/176), w8 q32 mb2 (1024/724),
// w4 q32 mb3 (208/164); dQ hd64 w8 kv32 mb3 (116/108), w8 kv64 mb2 (32/32), w4 kv64 mb4 (24/24);
// dQ hd128 w8 kv32 mb2 (24/28), w4 kv32 mb3 (8/8); one pass hd64 mb2 (188/184). Left out because it
// hangs on a Hopper GPU at T = 1024 and 2048 (while correct at T = 100): the forward in
// FlashAttention-3's order at hd64 with tiles of 128 keys and 3 consumers (128 registers, 4/12 bytes
// of spills; its 2-consumer form and its 3-consumer form on tiles of 64 keys pass).

// ---- device helpers -----------------------------------------------------------------------------

// Per part of a tensor (dq, dk, dv of a dqkv row; one part for out and lse): max |got - expected|
// and max |expected| as float bits (non-negative floats order like their bits), and the elements
// where either is NaN.
typedef struct {
    unsigned int max_diff_bits[3], max_expected_bits[3];
    unsigned long long nan_count[3];
} CompareStats;

__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// Element i belongs to part (c >= bound1) + (c >= bound2) with c = i % width.
template <class T>
__global__ void compare_kernel(CompareStats *stats, const T *got, const T *expected, size_t n, int width, int bound1,
                               int bound2) {
    float max_diff[3] = {0.f, 0.f, 0.f}, max_expected[3] = {0.f, 0.f, 0.f};
    unsigned long long nans[3] = {0, 0, 0};
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        int col = (int)(i % (size_t)width);
        int part = (col >= bound1) + (col >= bound2);
        float e = to_float(expected[i]), diff = fabsf(to_float(got[i]) - e);
        if (isnan(diff)) {
            nans[part]++;
        } else {
            max_diff[part] = fmaxf(max_diff[part], diff);
            max_expected[part] = fmaxf(max_expected[part], fabsf(e));
        }
    }
    for (int p = 0; p < 3; p++) {
        atomicMax(&stats->max_diff_bits[p], __float_as_uint(max_diff[p]));
        atomicMax(&stats->max_expected_bits[p], __float_as_uint(max_expected[p]));
        if (nans[p]) atomicAdd(&stats->nan_count[p], nans[p]);
    }
}

// *count += elements where a and b differ bitwise.
__global__ void count_mismatches_kernel(unsigned long long *count, const bf16 *a, const bf16 *b, size_t n) {
    unsigned long long differ = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        differ += __bfloat16_as_ushort(a[i]) != __bfloat16_as_ushort(b[i]);
    if (differ) atomicAdd(count, differ);
}

// ---- one shape -----------------------------------------------------------------------------------

typedef struct {
    int B, T, NH, NKV, head_dim;
    int timed;  // 0: checked only
} BenchShape;

typedef struct {
    bf16 *qkv, *dout, *out, *out_ref, *dqkv, *dqkv_again, *dqkv_ref;
    float *lse, *lse_ref, *scratch;
    size_t n_qkv, n_q, n_lse, scratch_bytes;
    CompareStats *stats;
    unsigned long long *mismatches;
    cudaStream_t stream;
} BenchBuffers;

typedef struct {
    float error[5];  // relative: out, lse, dq, dk, dv
    unsigned long long unwritten, backward_mismatches;
    int passed;
    float forward_ms, both_ms;
    float default_forward_ms, default_both_ms;  // the default, timed right before this variant
} VariantResult;

static float relative_error(const CompareStats *stats, int part) {
    float diff, expected;
    unsigned int diff_bits = stats->max_diff_bits[part], expected_bits = stats->max_expected_bits[part];
    memcpy(&diff, &diff_bits, sizeof diff);
    memcpy(&expected, &expected_bits, sizeof expected);
    return expected > 0.f ? diff / expected : diff;
}

// Compares n elements of got with expected on the device (see compare_kernel) and returns the stats;
// width = bound1 = bound2 = 1 makes the whole tensor part 0.
template <class T>
static CompareStats compare_on_device(BenchBuffers *buf, const T *got, const T *expected, size_t n, int width,
                                      int bound1, int bound2) {
    CompareStats stats;
    cudaCheck(cudaMemsetAsync(buf->stats, 0, sizeof(CompareStats), buf->stream));
    compare_kernel<T><<<1024, 256, 0, buf->stream>>>(buf->stats, got, expected, n, width, bound1, bound2);
    cudaCheckLaunch();
    cudaCheck(cudaMemcpyAsync(&stats, buf->stats, sizeof stats, cudaMemcpyDeviceToHost, buf->stream));
    cudaCheck(cudaStreamSynchronize(buf->stream));
    return stats;
}

static void poison_async(void *device, size_t bytes, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(device, 0xFF, bytes, stream));
}

static void run_backward(const Variant *v, bf16 *dqkv, const bf16 *out, const float *lse, BenchBuffers *buf,
                         BenchShape s) {
    v->backward(dqkv, buf->scratch, buf->dout, buf->qkv, out, lse, s.B, s.T, s.NH, s.NKV, buf->stream);
}

// Runs the variant from poisoned outputs and fills the error and unwritten counts of r.
static void check_variant(const Variant *v, BenchBuffers *buf, BenchShape s, VariantResult *r) {
    const int width = (s.NH + 2 * s.NKV) * s.head_dim;
    poison_async(buf->out, buf->n_q * sizeof(bf16), buf->stream);
    poison_async(buf->lse, buf->n_lse * sizeof(float), buf->stream);
    v->forward(buf->out, buf->lse, buf->qkv, s.B, s.T, s.NH, s.NKV, buf->stream);
    CompareStats out_stats = compare_on_device(buf, buf->out, buf->out_ref, buf->n_q, 1, 1, 1);
    CompareStats lse_stats = compare_on_device(buf, buf->lse, buf->lse_ref, buf->n_lse, 1, 1, 1);

    // The backward twice, on the reference's out and lse, from poisoned dqkv and scratch.
    bf16 *targets[2] = {buf->dqkv, buf->dqkv_again};
    for (int run = 0; run < 2; run++) {
        poison_async(targets[run], buf->n_qkv * sizeof(bf16), buf->stream);
        poison_async(buf->scratch, buf->scratch_bytes, buf->stream);
        run_backward(v, targets[run], buf->out_ref, buf->lse_ref, buf, s);
    }
    CompareStats grad_stats = compare_on_device(buf, buf->dqkv, buf->dqkv_ref, buf->n_qkv, width, s.NH * s.head_dim,
                                                (s.NH + s.NKV) * s.head_dim);
    cudaCheck(cudaMemsetAsync(buf->mismatches, 0, sizeof(unsigned long long), buf->stream));
    count_mismatches_kernel<<<1024, 256, 0, buf->stream>>>(buf->mismatches, buf->dqkv, buf->dqkv_again, buf->n_qkv);
    cudaCheckLaunch();
    cudaCheck(cudaMemcpyAsync(&r->backward_mismatches, buf->mismatches, sizeof(unsigned long long),
                              cudaMemcpyDeviceToHost, buf->stream));
    cudaCheck(cudaStreamSynchronize(buf->stream));

    r->error[0] = relative_error(&out_stats, 0);
    r->error[1] = relative_error(&lse_stats, 0);
    for (int p = 0; p < 3; p++) r->error[2 + p] = relative_error(&grad_stats, p);
    r->unwritten = out_stats.nan_count[0] + lse_stats.nan_count[0] + grad_stats.nan_count[0] + grad_stats.nan_count[1] +
                   grad_stats.nan_count[2];
    r->passed = r->unwritten == 0 && r->backward_mismatches == 0 && r->error[1] < LSE_TOLERANCE;
    for (int i = 0; i < 5; i++)
        if (i != 1 && !(r->error[i] < BF16_TOLERANCE)) r->passed = 0;
}

// Median milliseconds of TIMED_RUNS runs (after WARMUP_RUNS) of the forward, or forward + backward.
static float time_variant(const Variant *v, int with_backward, BenchBuffers *buf, BenchShape s) {
    return median_event_ms(WARMUP_RUNS, TIMED_RUNS, [&] {
        v->forward(buf->out, buf->lse, buf->qkv, s.B, s.T, s.NH, s.NKV, buf->stream);
        if (with_backward) run_backward(v, buf->dqkv, buf->out, buf->lse, buf, s);
    }, buf->stream);
}

static void *device_alloc(size_t bytes) {
    void *p;
    cudaCheck(cudaMalloc(&p, bytes));
    return p;
}

static void alloc_buffers(BenchBuffers *buf, BenchShape s) {
    buf->n_qkv = (size_t)s.B * s.T * (s.NH + 2 * s.NKV) * s.head_dim;
    buf->n_q = (size_t)s.B * s.T * s.NH * s.head_dim;
    buf->n_lse = (size_t)s.B * s.NH * s.T;
    // The one-pass layout holds the two-pass one (D first) and more.
    buf->scratch_bytes = attention_variant_scratch_layout(s.B, s.T, s.NH, s.head_dim, true).total_bytes;
    bf16 **bf16_buffers[] = {&buf->out, &buf->out_ref, &buf->dout};
    for (size_t i = 0; i < sizeof bf16_buffers / sizeof bf16_buffers[0]; i++)
        *bf16_buffers[i] = (bf16 *)device_alloc(buf->n_q * sizeof(bf16));
    bf16 **qkv_buffers[] = {&buf->qkv, &buf->dqkv, &buf->dqkv_again, &buf->dqkv_ref};
    for (size_t i = 0; i < sizeof qkv_buffers / sizeof qkv_buffers[0]; i++)
        *qkv_buffers[i] = (bf16 *)device_alloc(buf->n_qkv * sizeof(bf16));
    buf->lse = (float *)device_alloc(buf->n_lse * sizeof(float));
    buf->lse_ref = (float *)device_alloc(buf->n_lse * sizeof(float));
    buf->scratch = (float *)device_alloc(buf->scratch_bytes);
    buf->stats = (CompareStats *)device_alloc(sizeof(CompareStats));
    buf->mismatches = (unsigned long long *)device_alloc(sizeof(unsigned long long));
}

static void free_buffers(BenchBuffers *buf) {
    void *buffers[] = {buf->qkv,      buf->dout, buf->out,     buf->out_ref, buf->dqkv,  buf->dqkv_again,
                       buf->dqkv_ref, buf->lse,  buf->lse_ref, buf->scratch, buf->stats, buf->mismatches};
    for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; i++) cudaCheck(cudaFree(buffers[i]));
}

static double forward_flops(BenchShape s) {
    return 4.0 * s.B * s.NH * (double)s.T * s.T * s.head_dim / 2.0;  // causal: half of S
}

static void shape_label(char *text, size_t size, BenchShape s) {
    snprintf(text, size, "hd%d B%d NH%d NKV%d T%d", s.head_dim, s.B, s.NH, s.NKV, s.T);
}

// A variant's durations, and the default's timed right before it.
static float forward_time(const VariantResult *r) { return r->forward_ms; }
static float backward_time(const VariantResult *r) { return r->both_ms - r->forward_ms; }
static float both_time(const VariantResult *r) { return r->both_ms; }
static VariantResult default_beside(const VariantResult *r) {
    VariantResult d = *r;
    d.forward_ms = r->default_forward_ms;
    d.both_ms = r->default_both_ms;
    return d;
}
// The default's duration over the variant's, both timed side by side.
static float speedup(const VariantResult *r, float (*duration)(const VariantResult *)) {
    const VariantResult d = default_beside(r);
    return duration(&d) / duration(r);
}

// Checks (and times, for timed shapes) every variant at one shape, or with a filter only row 0 and
// the variants whose names contain it; results[i] for variants[i] (not passed when left out).
static void bench_shape(BenchShape s, const Variant *variants, int n_variants, VariantResult *results,
                        const char *filter, cudaStream_t stream) {
    BenchBuffers buf;
    buf.stream = stream;
    alloc_buffers(&buf, s);
    fill_uniform_bf16_kernel<<<1024, 256, 0, stream>>>(buf.qkv, buf.n_qkv, 1);
    cudaCheckLaunch();
    fill_uniform_bf16_kernel<<<1024, 256, 0, stream>>>(buf.dout, buf.n_q, 2);
    cudaCheckLaunch();
    // The reference: the default variant (row 0); its backward runs on its own out and lse.
    variants[0].forward(buf.out_ref, buf.lse_ref, buf.qkv, s.B, s.T, s.NH, s.NKV, stream);
    run_backward(&variants[0], buf.dqkv_ref, buf.out_ref, buf.lse_ref, &buf, s);
    cudaCheck(cudaStreamSynchronize(stream));

    const double flops = forward_flops(s);
    for (int i = 0; i < n_variants; i++) {
        const Variant *v = &variants[i];
        VariantResult *r = &results[i];
        r->forward_ms = r->both_ms = r->default_forward_ms = r->default_both_ms = NAN;
        if (i > 0 && filter != NULL && strstr(v->forward_name, filter) == NULL &&
            strstr(v->backward_name, filter) == NULL) {
            r->passed = 0;
            continue;
        }
        check_variant(v, &buf, s, r);
        char timing[160] = "timing: none (checked only)";
        if (s.timed) {
            r->default_forward_ms = time_variant(&variants[0], 0, &buf, s);
            r->forward_ms = i == 0 ? r->default_forward_ms : time_variant(v, 0, &buf, s);
            r->default_both_ms = time_variant(&variants[0], 1, &buf, s);
            r->both_ms = i == 0 ? r->default_both_ms : time_variant(v, 1, &buf, s);
            snprintf(timing, sizeof timing,
                     "fwd %7.3f ms %4.0f TFLOP/s | fwd+bwd %7.3f ms %4.0f TFLOP/s | vs default fwd %.2fx bwd %.2fx",
                     r->forward_ms, flops / (r->forward_ms * 1e-3) / 1e12, r->both_ms,
                     3.5 * flops / (r->both_ms * 1e-3) / 1e12, speedup(r, forward_time), speedup(r, backward_time));
        }
        char shape_text[64];
        shape_label(shape_text, sizeof shape_text, s);
        check(r->passed,
              "%s | %2d %-26s %-44s | %s | rel err out %.1e lse %.1e dq %.1e dk %.1e dv %.1e | unwritten %llu | "
              "bwd repeat differs %llu",
              shape_text, i, v->forward_name, v->backward_name, timing, r->error[0], r->error[1], r->error[2],
              r->error[3], r->error[4], r->unwritten, r->backward_mismatches);
    }
    free_buffers(&buf);
}

// The passing variant with the largest speed-up over the default timed beside it, or -1.
static int fastest(const VariantResult *results, int n, float (*duration)(const VariantResult *)) {
    int best = -1;
    for (int i = 0; i < n; i++)
        if (results[i].passed && (best < 0 || speedup(&results[i], duration) > speedup(&results[best], duration)))
            best = i;
    return best;
}

static void print_fastest(const char *what, const Variant *variants, const VariantResult *results, int n,
                          float (*duration)(const VariantResult *)) {
    int best = fastest(results, n, duration);
    if (best < 0) {
        printf("  fastest %-8s: none passes\n", what);
        return;
    }
    const VariantResult beside = default_beside(&results[best]);
    printf("  fastest %-8s: %2d %s | %s: %.3f ms (the default beside it %.3f ms, %.2fx)\n", what, best,
           variants[best].forward_name, variants[best].backward_name, duration(&results[best]), duration(&beside),
           speedup(&results[best], duration));
}

// The spread of the default's timings at one shape (one before each timed variant): how far one
// figure moves over the run (drift and noise), as min-max and standard deviation over the median.
static void print_default_noise(const VariantResult *results, int n, float (*duration)(const VariantResult *),
                                const char *what) {
    float values[256];
    int count = 0;
    for (int i = 0; i < n && count < 256; i++)
        if (!isnan(results[i].default_forward_ms)) {
            const VariantResult d = default_beside(&results[i]);
            values[count++] = duration(&d);
        }
    if (count < 2) return;
    double mean = 0, square = 0;
    float low = values[0], high = values[0];
    for (int i = 0; i < count; i++) {
        mean += values[i] / count;
        low = fminf(low, values[i]);
        high = fmaxf(high, values[i]);
    }
    for (int i = 0; i < count; i++) square += (values[i] - mean) * (values[i] - mean) / (count - 1);
    const float median = median_in_place(values, count);
    printf("  default %-8s: timed %d times, median %.3f ms, min-max %.3f-%.3f ms, standard deviation %.1f%%\n", what,
           count, median, low, high, 100.0 * sqrt(square) / median);
}

int main(int argc, char **argv) {
    if (argc > 2) {
        fprintf(stderr, "usage: %s [FILTER]   (FILTER: run only the variants whose names contain it)\n", argv[0]);
        return EXIT_FAILURE;
    }
    const char *filter = argc == 2 ? argv[1] : NULL;
    const BenchShape shapes[] = {{2, 100, 12, 4, 64, 0},   {64, 1024, 12, 4, 64, 1},  {16, 2048, 32, 8, 64, 1},
                                 {2, 100, 12, 4, 128, 0},  {4, 2048, 32, 32, 128, 1}, {8, 4096, 16, 16, 128, 1},
                                 {10, 2048, 32, 8, 128, 1}};
    const int n_shapes = (int)(sizeof shapes / sizeof shapes[0]);
    const int n64 = (int)(sizeof variants_hd64 / sizeof variants_hd64[0]);
    const int n128 = (int)(sizeof variants_hd128 / sizeof variants_hd128[0]);
    const int most = n64 > n128 ? n64 : n128;
    VariantResult *results = (VariantResult *)host_alloc((size_t)n_shapes * most * sizeof(VariantResult));
    cudaStream_t stream;
    cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

    for (int i = 0; i < n_shapes; i++) {
        const Variant *variants = shapes[i].head_dim == 64 ? variants_hd64 : variants_hd128;
        int n = shapes[i].head_dim == 64 ? n64 : n128;
        bench_shape(shapes[i], variants, n, results + (size_t)i * most, filter, stream);
    }

    printf("fastest passing variant per shape (row number, forward config | backward config):\n");
    for (int i = 0; i < n_shapes; i++) {
        if (!shapes[i].timed) continue;
        const Variant *variants = shapes[i].head_dim == 64 ? variants_hd64 : variants_hd128;
        int n = shapes[i].head_dim == 64 ? n64 : n128;
        const VariantResult *r = results + (size_t)i * most;
        char shape_text[64];
        shape_label(shape_text, sizeof shape_text, shapes[i]);
        printf("%s:\n", shape_text);
        print_default_noise(r, n, forward_time, "forward");
        print_default_noise(r, n, backward_time, "backward");
        print_fastest("forward", variants, r, n, forward_time);
        print_fastest("backward", variants, r, n, backward_time);
        print_fastest("fwd+bwd", variants, r, n, both_time);
    }
    cudaCheck(cudaStreamDestroy(stream));
    free(results);
    return check_summary("bench_attention_variants");
}
