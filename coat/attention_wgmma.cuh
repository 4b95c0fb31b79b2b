// The attention kernels on Hopper: TMA loads by a producer warpgroup into rings of stages guarded by
// mbarriers, and consumer warpgroups computing with warpgroup MMA (wgmma) straight from 128B-swizzled
// shared tiles, with no block-wide barrier in their loops. Same math and layouts as attention.cuh,
// which includes this file after the helpers it shares (shared_address, exp2_approx, pack_bf16x2,
// attention_launch_setup); not a header of its own.
//
//   D = rowsum(dO * O), P = 2^(S scale log2 e - lse log2 e) (keys s <= query t), dP = dO V^T,
//   dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO;   scale = 1 / sqrt(head_dim)
//
// Forward: CONSUMERS warpgroups of 64 query rows share each K/V tile; online softmax in base 2.
// Backward: two passes after D, each block 2 or 3 consumer warpgroups, warpgroup wg owning 64 rows:
//   dK/dV: a block owns 128 or 192 key rows of one kv head (K and V resident) and walks the 64-row query
//     tiles of every query head of its group from the diagonal on. Per step a warpgroup computes,
//     transposed so that key rows stay in the accumulator rows:
//       S^T  = K Q^T      A = K, B = Q, both K-major            (m64 n64)
//       dP^T = V dO^T     A = V, B = dO, both K-major           (issued together with S^T)
//       P^T  = 2^(S^T scale log2 e - lse log2 e), 0 where the key comes after the query
//       dV  += P^T dO     A = P^T from registers, B = dO MN-major (runs while dS^T is computed)
//       dS^T = P^T (dP^T - D)
//       dK  += dS^T Q     A = dS^T from registers, B = Q MN-major
//     dK and dV (64 x head_dim each per warpgroup) stay in registers to the end.
//   dQ: a block owns 128 or 192 query rows of one query head (Q and dO resident) and walks the K/V tiles up
//     to the diagonal: S = Q K^T and dP = dO V^T (issued together), P, dS, dQ += dS K.
// dQ has its own pass (7 products per query-key tile instead of 5): a share per dK/dV step would need
// a fixed-order sum between blocks to stay deterministic, and its accumulators do not fit beside dK
// and dV. Or, given a buffer for it, the dK/dV pass stores dS^T (TMA, from a swizzled shared tile)
// and the dQ pass only computes dQ += dS K from it: the same products in the same order, so the same
// bits. No atomics; bitwise deterministic.
#pragma once
#include <cuda.h>
#include <stdint.h>

#include <type_traits>

#define WGMMA_WARPGROUP_THREADS 128
#define WGMMA_WARPGROUP_ROWS 64  // the M of every wgmma
#define WGMMA_BLOCK_ROWS (2 * WGMMA_WARPGROUP_ROWS)  // the rows of a block of 2 warpgroups

// ---- wgmma building blocks ------------------------------------------------------------------------

// Orders this thread's register writes (accumulators, A fragments) before the wgmma that follow.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit_group() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of accumulators or A fragments across the wgmma
// fence, commit and wait: to it the wgmma asm below finishes at once, to the hardware only at the wait.
template <int N>
__device__ __forceinline__ void wgmma_pin_registers(float (&acc)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(acc[i])::"memory");
}
template <int K_STEPS>
__device__ __forceinline__ void wgmma_pin_registers(uint32_t (&fragments)[K_STEPS][4]) {
#pragma unroll
    for (int kk = 0; kk < K_STEPS; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) asm volatile("" : "+r"(fragments[kk][i])::"memory");
}

#define WGMMA_ACC8(d, i)                                                                                        \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), \
        "+f"(d[i + 7])
#define WGMMA_ACC32(d, i) WGMMA_ACC8(d, i), WGMMA_ACC8(d, i + 8), WGMMA_ACC8(d, i + 16), WGMMA_ACC8(d, i + 24)

// d (64 x N FP32) = A B (+ d when accumulate != 0) for one warpgroup, k = 16: A (64 x 16) and B
// (16 x N, stored N x 16) K-major in shared memory, or MN-major where TRANS_A / TRANS_B is 1 (A
// stored 16 x 64, B 16 x N). Accumulators of warp w: rows 16 w + g and
// 16 w + g + 8 (g = lane / 4), d[4 j + {0, 1}] = (row 16 w + g, columns 8 j + c + {0, 1}), d[4 j + {2, 3}]
// the same columns of row 16 w + g + 8, c = 2 (lane % 4): the mma.sync m16n8 layout, n8 block by block.
template <int N, int TRANS_A = 0, int TRANS_B = 0>
__device__ __forceinline__ void wgmma_m64k16_smem_a(float (&d)[N / 2], uint64_t a_descriptor, uint64_t b_descriptor,
                                                    int accumulate) {
    static_assert(N == 64 || N == 128, "wgmma shapes used here: m64n64k16 and m64n128k16");
    if constexpr (N == 64) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
            "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
            "%31}, %32, %33, p, 1, 1, %35, %36;\n}\n"
            : WGMMA_ACC32(d, 0)
            : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
            "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
            "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
            "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, %67, %68;\n}\n"
            : WGMMA_ACC32(d, 0), WGMMA_ACC32(d, 32)
            : "l"(a_descriptor), "l"(b_descriptor), "r"(accumulate), "n"(TRANS_A), "n"(TRANS_B));
    }
}

// d (64 x N FP32) += A B for one warpgroup, k = 16: A (64 x 16 BF16) from registers, warp w holding
// rows 16 w.. in the mma.sync m16n8k16 A-fragment order (a[0] = (g, c..c+1), a[1] = (g+8, c..),
// a[2] = (g, c+8..), a[3] = (g+8, c+8..)); B (16 x N) MN-major in shared memory (transposed, trans-b 1).
template <int N>
__device__ __forceinline__ void wgmma_m64k16_register_a_mn_b(float (&d)[N / 2], const uint32_t (&a)[4],
                                                             uint64_t b_descriptor) {
    static_assert(N == 64 || N == 128, "wgmma shapes used here: m64n64k16 and m64n128k16");
    if constexpr (N == 64) {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
            "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
            "%31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
            : WGMMA_ACC32(d, 0)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor));
    } else {
        asm volatile(
            "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
            "%11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, "
            "%31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, "
            "%51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, "
            "1, 1;\n}\n"
            : WGMMA_ACC32(d, 0), WGMMA_ACC32(d, 32)
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_descriptor));
    }
}

// Waits until at most PENDING of this warpgroup's committed wgmma groups are still running (groups
// complete in the order they were committed).
template <int PENDING>
__device__ __forceinline__ void wgmma_wait_pending() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(PENDING) : "memory");
}

// The S accumulators of columns [16 kk, 16 kk + 16) are, pair by pair, the A fragment of P's k-step
// kk (two adjacent n8 blocks, as with mma.sync): p[kk][i] = BF16 pair (s[8 kk + 2 i], s[8 kk + 2 i + 1]).
template <int KV_TILE>
__device__ __forceinline__ void wgmma_scores_to_a_operand(uint32_t (&p)[KV_TILE / 16][4],
                                                          const float (&s)[KV_TILE / 2]) {
#pragma unroll
    for (int kk = 0; kk < KV_TILE / 16; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) p[kk][i] = pack_bf16x2(s[8 * kk + 2 * i], s[8 * kk + 2 * i + 1]);
}

// ---- one step of each pass, per warpgroup ---------------------------------------------------------

// A warpgroup's step of the dK/dV pass: its 64 keys (the first key_first) against the Q_TILE
// queries q0.. of the stage (operands: each issue_* one commit group of wgmma, as Sw128DkDvOperands
// below; lse_log2 and delta per query, lse in log2 units, +inf past T so that P = 0 there). dk and dv
// accumulate (dK unscaled). ds_t (or NULL): where dS^T goes in BF16, as the dK product reads it: a
// 128B-swizzled shared tile of the warpgroup's 64 keys x 64 queries (Q_TILE = 64).
template <int HEAD_DIM, int Q_TILE, class Operands>
__device__ __forceinline__ void wgmma_backward_dkdv_step(float (&dk)[HEAD_DIM / 2], float (&dv)[HEAD_DIM / 2],
                                                         const Operands &operands, const float *lse_log2,
                                                         const float *delta, float scale_log2, int key_first, int q0,
                                                         int warp, int lane, char *ds_t = NULL) {
    float pt[Q_TILE / 2], dst[Q_TILE / 2];  // S^T then P^T; dP^T then dS^T: keys x queries
    operands.issue_scores_t(pt);
    operands.issue_dp_t(dst);
    wgmma_wait_pending<1>();  // S^T complete
    wgmma_pin_registers(pt);

    // Element i: key key_lo + 8 ((i / 2) % 2), query q0 + 8 (i / 4) + c + i % 2.
    const int g = lane / 4, c = (lane % 4) * 2;
    const int key_lo = key_first + warp * 16 + g;
    const bool crosses_diagonal = key_first + WGMMA_WARPGROUP_ROWS - 1 > q0;
#pragma unroll
    for (int n8 = 0; n8 < Q_TILE / 8; n8++) {
        const float2 lse_pair = *reinterpret_cast<const float2 *>(lse_log2 + 8 * n8 + c);
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float p = exp2_approx(fmaf(pt[4 * n8 + e], scale_log2, -((e & 1) ? lse_pair.y : lse_pair.x)));
            pt[4 * n8 + e] = crosses_diagonal && key_lo + (e >> 1) * 8 > q0 + 8 * n8 + c + (e & 1) ? 0.f : p;
        }
    }
    uint32_t pt_frag[Q_TILE / 16][4];
    wgmma_scores_to_a_operand<Q_TILE>(pt_frag, pt);
    operands.issue_dv(dv, pt_frag);
    wgmma_wait_pending<1>();  // dP^T complete
    wgmma_pin_registers(dst);

#pragma unroll
    for (int n8 = 0; n8 < Q_TILE / 8; n8++) {
        const float2 delta_pair = *reinterpret_cast<const float2 *>(delta + 8 * n8 + c);
#pragma unroll
        for (int e = 0; e < 4; e++)
            dst[4 * n8 + e] = pt[4 * n8 + e] * (dst[4 * n8 + e] - ((e & 1) ? delta_pair.y : delta_pair.x));
    }
    uint32_t dst_frag[Q_TILE / 16][4];
    wgmma_scores_to_a_operand<Q_TILE>(dst_frag, dst);
    if (ds_t != NULL) {  // fragment i: key row + 8 (i % 2), the 16-byte chunk 2 kk + i / 2 of the row
        static_assert(Q_TILE == 64, "dS^T tiles of 64 queries: one 128-byte row a key");
        char *row = ds_t + (warp * 16 + g) * 128 + 2 * c;  // rows g and g + 8: chunk j lands at j ^ g
#pragma unroll
        for (int kk = 0; kk < Q_TILE / 16; kk++)
#pragma unroll
            for (int i = 0; i < 4; i++)
                *reinterpret_cast<uint32_t *>(row + (i & 1) * 8 * 128 + (((2 * kk + (i >> 1)) ^ g) * 16)) =
                    dst_frag[kk][i];
    }
    operands.issue_dk(dk, dst_frag);
    wgmma_wait_pending<0>();
    // The fragments are read by the wgmma until here: pinned, they keep their registers that long.
    wgmma_pin_registers(pt_frag);
    wgmma_pin_registers(dst_frag);
    wgmma_pin_registers(dk);
    wgmma_pin_registers(dv);
}

// A warpgroup's step of the dQ pass: its 64 query rows (this thread's rows row_lo and row_lo + 8, with
// their lse in log2 units, +inf past T, and D) against the KV_TILE keys kv0.. of the stage (operands:
// as Sw128DqOperands below). dq accumulates (unscaled).
template <int HEAD_DIM, int KV_TILE, class Operands>
__device__ __forceinline__ void wgmma_backward_dq_step(float (&dq)[HEAD_DIM / 2], const Operands &operands,
                                                       const float (&row_lse_log2)[2], const float (&row_delta)[2],
                                                       float scale_log2, int row_lo, int kv0, bool crosses_diagonal,
                                                       int lane) {
    float p[KV_TILE / 2], ds[KV_TILE / 2];  // S then P; dP then dS: queries x keys
    operands.issue_scores(p);
    operands.issue_dp(ds);
    wgmma_wait_pending<1>();  // S complete
    wgmma_pin_registers(p);

    // Element i: row row_lo + 8 ((i / 2) % 2), key kv0 + 8 (i / 4) + c + i % 2.
    const int c = (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < KV_TILE / 2; i++) {
        const int r = (i >> 1) & 1;
        float prob = exp2_approx(fmaf(p[i], scale_log2, -row_lse_log2[r]));
        p[i] = crosses_diagonal && kv0 + 8 * (i / 4) + c + (i & 1) > row_lo + 8 * r ? 0.f : prob;
    }
    wgmma_wait_pending<0>();  // dP complete
    wgmma_pin_registers(ds);
#pragma unroll
    for (int i = 0; i < KV_TILE / 2; i++) ds[i] = p[i] * (ds[i] - row_delta[(i >> 1) & 1]);
    uint32_t ds_frag[KV_TILE / 16][4];
    wgmma_scores_to_a_operand<KV_TILE>(ds_frag, ds);
    operands.issue_dq(dq, ds_frag);
    wgmma_wait_pending<0>();
    wgmma_pin_registers(ds_frag);
    wgmma_pin_registers(dq);
}

// ---- forward on TMA loads and 128B-swizzled tiles ---------------------------------------------------
//
// A producer warp loads Q and the K/V tiles with the tensor memory accelerator (TMA: 128B-swizzled
// boxes of 64 x 64, rows past T read as zeros) into STAGES stages guarded by mbarriers (full: the
// tile landed; empty: every consumer is done with it), and CONSUMERS warpgroups of 64 query rows each
// compute S = Q K^T and O += P V with wgmma straight from the swizzled tiles, with no block-wide
// barrier in the loop. The K/V loads then neither take the consumers' issue slots nor keep them in
// lockstep, and each K/V tile serves 64 CONSUMERS query rows.
// A swizzled tile of `rows` x head_dim is head_dim / 64 boxes, box b (columns 64 b..) at byte
// b * rows * 128; in a box, row r at r * 128 with its 16-byte chunks XOR-permuted by r % 8 (the
// pattern repeats every 1024 bytes of address, so tiles start 1024-byte aligned).

__device__ __forceinline__ void mbarrier_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
// Makes the initialised mbarriers visible to the async proxy (TMA) and the other threads.
__device__ __forceinline__ void mbarrier_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t *bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
// Returns once the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t *bar, uint32_t parity) {
    uint32_t done = 0;
    while (!done) {
        asm volatile(
            "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(shared_address(bar)), "r"(parity)
            : "memory");
    }
}
// The 64 x 64 box at (column c0, row c1, batch c2) of a rank-3 tensor map into shared memory; it
// completes on bar with its bytes.
__device__ __forceinline__ void tma_load_box(void *dst, const CUtensorMap *map, int c0, int c1, int c2, uint64_t *bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(shared_address(dst)),
        "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(shared_address(bar))
        : "memory");
}

// The 64 x 64 box at (c0, c1, c2) of a rank-3 tensor map from shared memory, one bulk group.
__device__ __forceinline__ void tma_store_box(const CUtensorMap *map, const void *src, int c0, int c1, int c2) {
    asm volatile(
        "cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%1, %2, %3}], [%4];\n"
        "cp.async.bulk.commit_group;\n" ::"l"((uint64_t)map),
        "r"(c0), "r"(c1), "r"(c2), "r"(shared_address(src))
        : "memory");
}
// Returns once at most PENDING of this thread's bulk stores still read shared memory.
template <int PENDING>
__device__ __forceinline__ void tma_store_wait_reads() {
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(PENDING) : "memory");
}
// Returns once every bulk store of this thread has completed (its writes done).
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Makes this thread's shared-memory writes visible to the TMA (the async proxy).
__device__ __forceinline__ void tma_fence_shared_writes() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// A barrier of consumer warpgroup `consumer`'s 128 threads (named barrier 1 + consumer).
__device__ __forceinline__ void warpgroup_barrier(int consumer) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(1 + consumer), "n"(WGMMA_WARPGROUP_THREADS) : "memory");
}

// The dynamic shared memory rounded up to 1024 bytes (the launches ask for 1024 more): swizzled tiles
// start on the swizzle pattern's 1024-byte period.
__device__ __forceinline__ char *shared_aligned_1024(unsigned char *smem) {
    return reinterpret_cast<char *>(smem) + ((1024u - (shared_address(smem) & 1023u)) & 1023u);
}

// The mbarriers of RINGS rings of STAGES stages, bars[0 .. 2 STAGES RINGS - 1], per ring full[STAGES]
// (one arrival: the producer's, with the bytes), then empty[STAGES] (one arrival per consumer
// warpgroup).
template <int STAGES, int RINGS = 1>
__device__ __forceinline__ void tma_ring_init(uint64_t *bars, int consumers) {
    for (int ring = 0; ring < RINGS; ring++)
        for (int s = 0; s < STAGES; s++) {
            mbarrier_init(&bars[2 * STAGES * ring + s], 1);
            mbarrier_init(&bars[2 * STAGES * ring + STAGES + s], consumers);
        }
}

// Rows row0 .. row0 + ROWS - 1 and columns col0 .. col0 + HEAD_DIM - 1 of batch b of a tensor map into
// a swizzled tile (box b at byte b ROWS 128, 64-row boxes stacked inside it), completing on bar.
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void tma_load_tile(char *tile, const CUtensorMap *map, int col0, int row0, int b,
                                              uint64_t *bar) {
    for (int box = 0; box < HEAD_DIM / 64; box++)
        for (int r = 0; r < ROWS; r += 64)
            tma_load_box(tile + (box * ROWS + r) * 128, map, col0 + 64 * box, row0 + r, b, bar);
}

// A producer's loop over the K/V tiles 0 .. num_kv_tiles - 1 of kv head kv_head of batch b: tile j into
// ring position at = ring_first + j, stage at % STAGES of the K and V rings (STAGES tiles of KV rows
// each, from k_ring and v_ring), once every consumer released the stage's previous tile, completing
// on full[stage]. With v_full and v_empty the V tiles have barriers of their own, so that a K tile
// can load once its stage's last K tile is read, while that stage's V tile may still be in use.
template <int KV, int HEAD_DIM, int STAGES>
__device__ __forceinline__ void tma_load_kv_tiles(char *k_ring, char *v_ring, const CUtensorMap *qkv_map, int NH,
                                                  int NKV, int kv_head, int b, int num_kv_tiles, uint64_t *full,
                                                  uint64_t *empty, int ring_first = 0, uint64_t *v_full = NULL,
                                                  uint64_t *v_empty = NULL) {
    constexpr size_t TILE_BYTES = (size_t)KV * HEAD_DIM * 2;
    const bool split = v_full != NULL;
    for (int j = 0; j < num_kv_tiles; j++) {
        const int at = ring_first + j, stage = at % STAGES;
        // Position at - STAGES, the stage's last, released by every consumer (its phase at / STAGES - 1).
        if (at >= STAGES) mbarrier_wait(&empty[stage], (at / STAGES + 1) & 1);
        mbarrier_arrive_expect_bytes(&full[stage], (uint32_t)((split ? 1 : 2) * TILE_BYTES));
        tma_load_tile<KV, HEAD_DIM>(k_ring + stage * TILE_BYTES, qkv_map, (NH + kv_head) * HEAD_DIM, j * KV, b,
                                    &full[stage]);
        uint64_t *v_bar = &full[stage];
        if (split) {
            if (at >= STAGES) mbarrier_wait(&v_empty[stage], (at / STAGES + 1) & 1);
            v_bar = &v_full[stage];
            mbarrier_arrive_expect_bytes(v_bar, (uint32_t)TILE_BYTES);
        }
        tma_load_tile<KV, HEAD_DIM>(v_ring + stage * TILE_BYTES, qkv_map, (NH + NKV + kv_head) * HEAD_DIM, j * KV, b,
                                    v_bar);
    }
}

// Descriptor of a 128B-swizzled operand (layout type 1): stride between 8-row groups 1024 bytes; LBO
// the stride between 64-column boxes of an MN-major operand (unused by K-major ones). A k-step of 16
// columns of a K-major operand is +32 bytes inside a box; of 16 rows of an MN-major one, +2048 bytes.
__device__ __forceinline__ uint64_t wgmma_sw128_descriptor(const char *start, uint32_t lbo_bytes) {
    return (uint64_t)((shared_address(start) >> 4) & 0x3FFF) | (uint64_t)((lbo_bytes >> 4) & 0x3FFF) << 16 |
           (uint64_t)(1024 >> 4) << 32 | (uint64_t)1 << 62;
}

// The descriptor of the operand start moved by bytes (a multiple of 16): one add to the start address
// field, the low 14 bits, which never carries out of it as shared addresses stay below 2^18 bytes.
// An issue's k-steps step one descriptor so, instead of building each from its address (about 6
// integer instructions before every wgmma).
__device__ __forceinline__ uint64_t wgmma_descriptor_advance(uint64_t descriptor, uint32_t bytes) {
    return descriptor + (bytes >> 4);
}

// Issues acc (64 x N) = A B^T as one commit group, A and B K-major swizzled: A the 64 rows from row
// a_row0 of a tile of a_rows rows, B a whole tile of N rows.
template <int HEAD_DIM, int N>
__device__ __forceinline__ void wgmma_issue_a_bt_sw128(float (&acc)[N / 2], const char *a_tile, int a_rows, int a_row0,
                                                       const char *b_tile) {
    const uint64_t a = wgmma_sw128_descriptor(a_tile + a_row0 * 128, 16), b = wgmma_sw128_descriptor(b_tile, 16);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++) {
        const uint32_t box = kk / 4, within = (kk % 4) * 32;
        wgmma_m64k16_smem_a<N>(acc, wgmma_descriptor_advance(a, box * a_rows * 128 + within),
                               wgmma_descriptor_advance(b, box * N * 128 + within), kk > 0);
    }
    wgmma_commit_group();
}

// Issues acc (64 x N) += X B as one commit group: x the A fragments of X (64 x K), B a swizzled tile of
// K rows and N columns read MN-major (acc and x untouched until a wait covers the group).
template <int N, int K>
__device__ __forceinline__ void wgmma_issue_add_x_b_sw128(float (&acc)[N / 2], uint32_t (&x)[K / 16][4],
                                                          const char *b_tile) {
    const uint64_t b = wgmma_sw128_descriptor(b_tile, K * 128);
    wgmma_pin_registers(acc);
    wgmma_pin_registers(x);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++)
        wgmma_m64k16_register_a_mn_b<N>(acc, x[kk], wgmma_descriptor_advance(b, kk * 2048));
    wgmma_commit_group();
}

// A producer warpgroup gives registers back and consumer warpgroups take them (setmaxnreg; the counts
// are multiples of 8, and 128 x PRODUCER + 128 x consumers x CONSUMER must stay within the SM's 64K).
// Every thread of the warpgroup executes these. ptxas then allocates up to the claimed count in the
// code that follows.
template <int REGISTERS>
__device__ __forceinline__ void warpgroup_registers_release() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGISTERS) : "memory");
}
template <int REGISTERS>
__device__ __forceinline__ void warpgroup_registers_claim() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGISTERS) : "memory");
}

// ---- persistent blocks ------------------------------------------------------------------------------
//
// A persistent pass launches one block per SM (attention_resident_blocks), and each takes the pass's
// blocks in their order from a counter. Its producer announces each block it takes in a slot
// (full: with the loads of the block's resident tiles; the block's index, or the pass's block count
// once none are left) and the consumers release the slot (empty) once no product reads those tiles,
// so the next block's loads run while they finish this one. Without PERSISTENT a launch block takes
// the one block of its index, as the hardware starts them.

// The counter, and the count of launch blocks done taking from it: the last one sets both back to 0
// for the next launch. One pass at a time per device.
static __device__ unsigned attention_next_block, attention_blocks_done;

// full[2], empty[2] and the two slots' blocks, in shared memory.
struct AttentionBlockSlots {
    uint64_t full[2], empty[2];
    int block[2];
};

__device__ __forceinline__ void attention_slots_init(AttentionBlockSlots *slots, int consumers) {
    for (int i = 0; i < 2; i++) {
        mbarrier_init(&slots->full[i], 1);
        mbarrier_init(&slots->empty[i], consumers);
    }
}

// The producer's k-th block (k from 0) into slot k % SLOTS, once the consumers released the slot's
// block before; the caller then arrives on slots->full[k % SLOTS] (with its loads' bytes, or none
// when the block is `blocks`: nothing left).
template <bool PERSISTENT, int SLOTS>
__device__ __forceinline__ int attention_take_block(AttentionBlockSlots *slots, int k, int blocks) {
    const int slot = k % SLOTS;
    if (k >= SLOTS) mbarrier_wait(&slots->empty[slot], (k / SLOTS + 1) & 1);  // its phase k / SLOTS - 1
    const int linear = PERSISTENT ? (int)atomicAdd(&attention_next_block, 1u) : k == 0 ? (int)blockIdx.x : blocks;
    slots->block[slot] = min(linear, blocks);
    return slots->block[slot];
}

// The producer has taken its last block.
template <bool PERSISTENT>
__device__ __forceinline__ void attention_blocks_taken(void) {
    if (!PERSISTENT) return;
    __threadfence();
    if (atomicAdd(&attention_blocks_done, 1u) == gridDim.x - 1) {
        atomicExch(&attention_next_block, 0u);
        atomicExch(&attention_blocks_done, 0u);
    }
}

// Thread 0 initialises the block slots and the rings' mbarriers (tma_ring_init); the whole block waits.
template <int STAGES, int RINGS = 1>
__device__ __forceinline__ void attention_pipeline_init(AttentionBlockSlots *slots, uint64_t *ring_bars,
                                                        int consumers) {
    if (threadIdx.x == 0) {
        attention_slots_init(slots, consumers);
        tma_ring_init<STAGES, RINGS>(ring_bars, consumers);
        mbarrier_fence_init();
    }
    __syncthreads();
}

// The slots a persistent pass gets: two (its next block's resident tiles load while it finishes the
// last) where a block's shared memory with a second copy of those tiles fits, else one.
static constexpr int attention_block_slots(bool persistent, size_t resident_bytes, size_t other_bytes) {
    return persistent &&
                   2 * resident_bytes + other_bytes + sizeof(AttentionBlockSlots) + 1024 <= ATTENTION_MAX_SMEM_BYTES
               ? 2
               : 1;
}

// A consumer's k-th block, once its slot's tiles landed.
template <int SLOTS>
__device__ __forceinline__ int attention_wait_block(AttentionBlockSlots *slots, int k) {
    mbarrier_wait(&slots->full[k % SLOTS], (k / SLOTS) & 1);
    return slots->block[k % SLOTS];
}

// A consumer warpgroup is done reading its k-th block's tiles (its first thread arrives).
template <bool PERSISTENT, int SLOTS>
__device__ __forceinline__ void attention_release_block(AttentionBlockSlots *slots, int k) {
    if (PERSISTENT && threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) mbarrier_arrive(&slots->empty[k % SLOTS]);
}

// A forward variant: K/V tiles of KV keys, CONSUMERS warpgroups of 64 query rows, STAGES K/V stages;
// blocks started in ORDER. PERSISTENT: one block per SM walks the query blocks in that order, taking
// the next from a counter, so that its next Q and K/V tiles load while it finishes the last.
// OVERLAP: FlashAttention-3's order within a consumer, the softmax of one tile beside the
// consumer's own O += P V of the tile before (a variant of test/attention_variants.cuh).
template <int KV, int CONSUMERS, int STAGES, bool OVERLAP = false, AttentionOrder ORDER = ATTENTION_ORDER_GRID,
          bool PERSISTENT = false>
struct AttentionTmaForwardConfig {
    static constexpr bool tma = true, overlap = OVERLAP, persistent = PERSISTENT;
    static constexpr AttentionOrder order = ORDER;
    static constexpr int kv_tile = KV, consumers = CONSUMERS, stages = STAGES;
    static constexpr int q_tile = CONSUMERS * WGMMA_WARPGROUP_ROWS;
    static constexpr int threads = (CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS;  // the producer's warpgroup too
};

// Shared memory of the TMA forward, in bytes from a 1024-byte aligned start: Q (a buffer per block
// slot: two when persistent), K stages, V stages, then the mbarriers of RINGS rings (full[STAGES],
// empty[STAGES] each: one for the K/V tiles, or one for K and one for V) and the block slots. bytes
// includes 1024 of slack for the alignment, done by hand (dynamic shared memory is only 16-byte
// aligned).
template <int HEAD_DIM, int KV, int CONSUMERS, int STAGES, bool PERSISTENT, int RINGS = 1>
struct AttentionTmaForwardSmem {
    static constexpr int q_rows = CONSUMERS * WGMMA_WARPGROUP_ROWS, slots = PERSISTENT ? 2 : 1;
    static constexpr size_t q_bytes = (size_t)q_rows * HEAD_DIM * 2, kv_bytes = (size_t)KV * HEAD_DIM * 2;
    static constexpr size_t q = 0, k = slots * q_bytes, v = k + STAGES * kv_bytes, bars = v + STAGES * kv_bytes;
    static constexpr size_t block_slots = bars + RINGS * 2 * STAGES * sizeof(uint64_t);
    static constexpr size_t bytes = block_slots + sizeof(AttentionBlockSlots) + 1024;
};


// The first row of query block q_block (of q_blocks, ROWS rows each) in the forward and the dQ pass:
// the blocks end at T rounded up to a warpgroup's 64 rows, so that a partial block is a pair's first,
// whose rows see one K/V tile or two and whose warpgroups of rows before 0 only release its stages
// (their Q rows load as zeros). Aligned from row 0 the partial block would be the last: at T = 1024
// with blocks of 192 rows, 64 rows walking every K/V tile beside two idle warpgroups.
__device__ __forceinline__ int attention_query_block_row0(int q_block, int q_blocks, int rows, int T) {
    return ceil_div(T, WGMMA_WARPGROUP_ROWS) * WGMMA_WARPGROUP_ROWS - (q_blocks - q_block) * rows;
}

// What a forward block computes: query rows q0.., head h, batch b, and the K/V tiles up to the
// diagonal of its last valid row.
struct AttentionForwardBlock {
    int q0, h, b, kv_head, num_kv_tiles;
};
__device__ __forceinline__ AttentionForwardBlock attention_forward_block(int linear, int q_blocks, int q_rows,
                                                                         int pairs, int chunk_pairs, int T, int NH,
                                                                         int NKV, int kv) {
    const AttentionBlock block = attention_block_in_order(linear, q_blocks, pairs, chunk_pairs);
    AttentionForwardBlock f;
    f.h = block.pair % NH;
    f.b = block.pair / NH;
    f.kv_head = f.h / (NH / NKV);
    f.q0 = attention_query_block_row0(q_blocks - 1 - block.x, q_blocks, q_rows, T);
    f.num_kv_tiles = (min(f.q0 + q_rows, T) - 1) / kv + 1;
    return f;
}

// The producer thread of a pass over query blocks (the forward, the dQ pass): for each block it takes,
// the block's Q (and dO, where dout_map is given) into the slot's tiles (rows_bytes each, one per
// slot from q_tiles and dout_tiles), then its K/V tiles into the ring (V on barriers of its own where
// v_full is given: tma_load_kv_tiles).
template <int HEAD_DIM, int KV, int STAGES, int Q_ROWS, bool PERSISTENT, int SLOTS>
__device__ __forceinline__ void attention_query_blocks_produce(AttentionBlockSlots *slots, const CUtensorMap *qkv_map,
                                                               const CUtensorMap *dout_map, char *q_tiles,
                                                               char *dout_tiles, size_t rows_bytes, char *k_ring,
                                                               char *v_ring, uint64_t *full, uint64_t *empty, int pairs,
                                                               int chunk_pairs, int T, int NH, int NKV,
                                                               uint64_t *v_full = NULL, uint64_t *v_empty = NULL) {
    const int q_blocks = ceil_div(T, Q_ROWS), blocks = q_blocks * pairs;
    int ring = 0;  // K/V tiles loaded so far: the ring position of the next
    for (int k = 0; PERSISTENT || k == 0; k++) {
        const int slot = k % SLOTS, linear = attention_take_block<PERSISTENT, SLOTS>(slots, k, blocks);
        if (linear == blocks) {
            mbarrier_arrive(&slots->full[slot]);
            break;
        }
        const AttentionForwardBlock f =
            attention_forward_block(linear, q_blocks, Q_ROWS, pairs, chunk_pairs, T, NH, NKV, KV);
        mbarrier_arrive_expect_bytes(&slots->full[slot], (uint32_t)((dout_map ? 2 : 1) * rows_bytes));
        tma_load_tile<Q_ROWS, HEAD_DIM>(q_tiles + slot * rows_bytes, qkv_map, f.h * HEAD_DIM, f.q0, f.b,
                                        &slots->full[slot]);
        if (dout_map)
            tma_load_tile<Q_ROWS, HEAD_DIM>(dout_tiles + slot * rows_bytes, dout_map, f.h * HEAD_DIM, f.q0, f.b,
                                            &slots->full[slot]);
        tma_load_kv_tiles<KV, HEAD_DIM, STAGES>(k_ring, v_ring, qkv_map, NH, NKV, f.kv_head, f.b, f.num_kv_tiles, full,
                                                empty, ring, v_full, v_empty);
        ring += f.num_kv_tiles;
    }
    attention_blocks_taken<PERSISTENT>();
}

// A consumer's rows of a forward block: its warpgroup's first row, its tiles (up to the diagonal of
// its last valid row; none when all lie past T or before 0) and this thread's rows row_lo and
// row_lo + 8.
struct AttentionForwardRows {
    int group_row0, group_tiles, row_lo;
    bool valid;
};
__device__ __forceinline__ AttentionForwardRows attention_forward_rows(const AttentionForwardBlock &f, int consumer,
                                                                       int warp, int g, int T, int kv) {
    AttentionForwardRows rows;
    rows.group_row0 = f.q0 + consumer * WGMMA_WARPGROUP_ROWS;
    rows.valid = rows.group_row0 >= 0 && rows.group_row0 < T;
    rows.group_tiles = rows.valid ? (min(rows.group_row0 + WGMMA_WARPGROUP_ROWS, T) - 1) / kv + 1 : 0;
    rows.row_lo = rows.group_row0 + warp * 16 + g;
    return rows;
}

// O and P zeroed at a block's start. P is defined before its first pin: an undefined one makes ptxas
// serialize every wgmma of the kernel.
template <int O_REGS, int P_STEPS>
__device__ __forceinline__ void attention_forward_start(float (&o_acc)[O_REGS], uint32_t (&p_frag)[P_STEPS][4]) {
#pragma unroll
    for (int i = 0; i < O_REGS; i++) o_acc[i] = 0.f;
#pragma unroll
    for (int kk = 0; kk < P_STEPS; kk++)
#pragma unroll
        for (int i = 0; i < 4; i++) p_frag[kk][i] = 0u;
}

// The online softmax of a consumer's S tile (keys kv0 .. kv0 + KV - 1; this thread's rows row_lo and
// row_lo + 8, column offset c; its warpgroup's first row group_row0), in base 2: masks the keys after
// each row where the tile crosses the warpgroup's diagonal, updates row_max and the per-thread partial
// row_sum (the 4 partials of a row are added at the end), turns s into P and gives each row's
// correction of O.
template <int KV>
__device__ __forceinline__ void attention_softmax_tile(float (&s)[KV / 2], float (&row_max)[2], float (&row_sum)[2],
                                                       float (&correction)[2], int kv0, int group_row0, int row_lo,
                                                       int c, float scale_log2) {
    if (kv0 + KV - 1 > group_row0) {  // the tile crosses this warpgroup's diagonal
#pragma unroll
        for (int i = 0; i < KV / 2; i++)
            if (kv0 + (i / 4) * 8 + c + (i & 1) > row_lo + ((i >> 1) & 1) * 8) s[i] = -INFINITY;
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {  // r = 0: row row_lo, r = 1: row row_lo + 8
        float tile_max = -INFINITY;
#pragma unroll
        for (int n8 = 0; n8 < KV / 8; n8++) tile_max = fmaxf(tile_max, fmaxf(s[4 * n8 + 2 * r], s[4 * n8 + 2 * r + 1]));
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));  // the 4 threads of a row
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
        const float new_max = fmaxf(row_max[r], tile_max * scale_log2);
        correction[r] = exp2_approx(row_max[r] - new_max);
        row_max[r] = new_max;
        row_sum[r] *= correction[r];
#pragma unroll
        for (int n8 = 0; n8 < KV / 8; n8++)
#pragma unroll
            for (int e = 2 * r; e < 2 * r + 2; e++) {
                const float p = exp2_approx(fmaf(s[4 * n8 + e], scale_log2, -new_max));
                s[4 * n8 + e] = p;
                row_sum[r] += p;
            }
    }
}

// O's rows row_lo and row_lo + 8 times their corrections.
template <int HEAD_DIM>
__device__ __forceinline__ void attention_rescale_o(float (&o_acc)[HEAD_DIM / 2], const float (&correction)[2]) {
#pragma unroll
    for (int n8 = 0; n8 < HEAD_DIM / 8; n8++) {
        o_acc[4 * n8] *= correction[0];
        o_acc[4 * n8 + 1] *= correction[0];
        o_acc[4 * n8 + 2] *= correction[1];
        o_acc[4 * n8 + 3] *= correction[1];
    }
}

// A consumer's rows done: lse and O / l stored for rows row_lo and row_lo + 8 below T, and max |O| as
// stored folded into out_amax (optional).
template <int HEAD_DIM>
__device__ __forceinline__ void attention_forward_store(const float (&o_acc)[HEAD_DIM / 2], const float (&row_max)[2],
                                                        const float (&row_sum)[2], const AttentionForwardBlock &f,
                                                        bf16 *out, float *lse, float *out_amax, int T, int NH,
                                                        int row_lo, int lane, int c) {
    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv_sum[r] = 1.f / sum;
        const int row = row_lo + 8 * r;
        // lse = ln(2^m l) = (m + log2 l) ln 2
        if (lane % 4 == 0 && row < T)
            lse[((size_t)f.b * NH + f.h) * T + row] = (row_max[r] + log2f(sum)) * ATTENTION_LN2;
    }
    bf16 *out_head = out + ((size_t)f.b * T * NH + f.h) * HEAD_DIM;
    uint32_t amax_bits = 0;  // of |out| as stored
#pragma unroll
    for (int n8 = 0; n8 < HEAD_DIM / 8; n8++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const int row = row_lo + 8 * r;
            const __nv_bfloat162 pair =
                __floats2bfloat162_rn(o_acc[4 * n8 + 2 * r] * inv_sum[r], o_acc[4 * n8 + 2 * r + 1] * inv_sum[r]);
            if (row < T) {
                *reinterpret_cast<__nv_bfloat162 *>(out_head + (size_t)row * NH * HEAD_DIM + 8 * n8 + c) = pair;
                amax_bits = bf16x2_abs_bits_max(amax_bits, pair);
            }
        }
    if (out_amax != NULL) attention_fold_amax(out_amax, amax_bits, lane);
}

// The consumers take registers from the producer (128 x 24 + 128 CONSUMERS x CONSUMER_REGISTERS)
// where the launch's even split is too few: at head_dim 128 (O takes 64 a thread), and with 3
// consumers for OVERLAP or K/V tiles of 128 (S takes 64). At 64 with 2 consumers, claiming makes
// ptxas serialize the wgmma.
template <int HEAD_DIM, int KV, int CONSUMERS, bool OVERLAP>
struct AttentionForwardRegisters {
    static constexpr bool claim = (OVERLAP || KV == 128 || HEAD_DIM == 128) && (HEAD_DIM == 128 || CONSUMERS > 2);
    static constexpr int consumer = CONSUMERS == 2 ? 240 : 160;
    static_assert(!claim || WGMMA_WARPGROUP_THREADS * (24 + CONSUMERS * consumer) <= 65536, "the SM's 64K registers");
};

// Block: query rows q0 = attention_query_block_row0.., head h, batch b, in the order of chunk_pairs
// (last query block of a pair first: attention_block_in_order); a persistent block takes such
// blocks one after the other. Warpgroup 0 is the producer (its thread 0 issues every load: per
// query block its Q into the next Q buffer, then its K/V tiles into the ring, whose stages carry on
// from one query block to the next); warpgroup 1 + w is consumer w: rows q0 + 64 w.., warp i of it
// rows + 16 i, thread rows g and g + 8. A consumer walks every K/V tile of the block, computing on
// those left of its diagonal (per tile: S = Q K^T, its softmax, O += P V, each product waited for),
// and releases each stage once its products from it completed, and the Q buffer once its last
// product read it.
template <int HEAD_DIM, int KV, int CONSUMERS, int STAGES, bool PERSISTENT>
__global__ void __launch_bounds__((CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS, 1)
    attention_forward_tma_kernel(const __grid_constant__ CUtensorMap qkv_map, bf16 *out, float *lse, int T, int NH,
                                 int NKV, float softmax_scale, float *out_amax, int pairs, int chunk_pairs) {
    typedef AttentionTmaForwardSmem<HEAD_DIM, KV, CONSUMERS, STAGES, PERSISTENT> Smem;
    typedef AttentionForwardRegisters<HEAD_DIM, KV, CONSUMERS, false> Registers;
    constexpr int Q_ROWS = Smem::q_rows, SLOTS = Smem::slots, S_REGS = KV / 2, O_REGS = HEAD_DIM / 2;
    static_assert(HEAD_DIM % 64 == 0 && KV % 64 == 0 && (KV == 64 || KV == 128), "whole 64 x 64 boxes; wgmma n64/n128");
    extern __shared__ __align__(1024) unsigned char attention_tma_smem[];
    char *smem = shared_aligned_1024(attention_tma_smem);
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Smem::bars), *empty = full + STAGES;
    AttentionBlockSlots *slots = reinterpret_cast<AttentionBlockSlots *>(smem + Smem::block_slots);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS;
    const int q_blocks = ceil_div(T, Q_ROWS), blocks = q_blocks * pairs;

    attention_pipeline_init<STAGES>(slots, full, CONSUMERS);
    if (warpgroup == 0) {
        if constexpr (Registers::claim) warpgroup_registers_release<24>();
        if (threadIdx.x == 0)
            attention_query_blocks_produce<HEAD_DIM, KV, STAGES, Q_ROWS, PERSISTENT, SLOTS>(
                slots, &qkv_map, NULL, smem + Smem::q, NULL, Smem::q_bytes, smem + Smem::k, smem + Smem::v, full, empty,
                pairs, chunk_pairs, T, NH, NKV);
        return;
    }

    if constexpr (Registers::claim) warpgroup_registers_claim<Registers::consumer>();
    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = (lane % 4) * 2;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    const int q_row0 = consumer * WGMMA_WARPGROUP_ROWS;
    int ring = 0;  // the ring position of this query block's K/V tile 0
    for (int k = 0; PERSISTENT || k == 0; k++) {
        const int linear = attention_wait_block<SLOTS>(slots, k);
        if (linear == blocks) break;  // warpgroup-uniform
        const AttentionForwardBlock f =
            attention_forward_block(linear, q_blocks, Q_ROWS, pairs, chunk_pairs, T, NH, NKV, KV);
        const char *q_tile = smem + Smem::q + (k % SLOTS) * Smem::q_bytes;
        const AttentionForwardRows rows = attention_forward_rows(f, consumer, warp, g, T, KV);
        const int group_row0 = rows.group_row0, group_tiles = rows.group_tiles, row_lo = rows.row_lo;
        // Tile 0 holds key 0, which every row sees, so the running max is finite after it.
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
        float o_acc[O_REGS];
        uint32_t p_frag[KV / 16][4];  // P as BF16 A fragments, read by O += P V until the next wait
        attention_forward_start(o_acc, p_frag);
        float s[S_REGS];

        // Tile j of this warpgroup, at ring position at.
        auto compute_tile = [&](int j, int at) {
            const int stage = at % STAGES;
            mbarrier_wait(&full[stage], (at / STAGES) & 1);
            wgmma_issue_a_bt_sw128<HEAD_DIM, KV>(s, q_tile, Q_ROWS, q_row0, smem + Smem::k + stage * Smem::kv_bytes);
            wgmma_wait_pending<0>();
            wgmma_pin_registers(s);
            float correction[2];
            attention_softmax_tile<KV>(s, row_max, row_sum, correction, j * KV, group_row0, row_lo, c, scale_log2);
            wgmma_wait_pending<0>();  // nothing pending: kept, with the two call sites below, as measured
            wgmma_pin_registers(o_acc);
            wgmma_pin_registers(p_frag);
            attention_rescale_o<HEAD_DIM>(o_acc, correction);
            wgmma_scores_to_a_operand<KV>(p_frag, s);
            wgmma_issue_add_x_b_sw128<HEAD_DIM, KV>(o_acc, p_frag, smem + Smem::v + stage * Smem::kv_bytes);
            wgmma_wait_pending<0>();
            wgmma_pin_registers(o_acc);
            wgmma_pin_registers(p_frag);
        };

        for (int j = 0; j < f.num_kv_tiles; j++) {
            const int at = ring + j, stage = at % STAGES;
            if (j + 1 < group_tiles) {
                compute_tile(j, at);
            } else if (j < group_tiles) {
                compute_tile(j, at);
            } else {
                // A tile right of this warpgroup's diagonal: nothing to compute, but the release must not
                // run ahead of the tile's load (an early arrival would count towards the stage's
                // previous phase).
                mbarrier_wait(&full[stage], (at / STAGES) & 1);
                wgmma_wait_pending<0>();
                wgmma_pin_registers(o_acc);
                wgmma_pin_registers(p_frag);
            }
            if (threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) mbarrier_arrive(&empty[stage]);
        }
        wgmma_wait_pending<0>();
        wgmma_pin_registers(o_acc);
        wgmma_pin_registers(p_frag);
        attention_release_block<PERSISTENT, SLOTS>(slots, k);  // no product reads its Q any more
        ring += f.num_kv_tiles;
        if (rows.valid)  // warpgroup-uniform
            attention_forward_store<HEAD_DIM>(o_acc, row_max, row_sum, f, out, lse, out_amax, T, NH, row_lo, lane, c);
    }
}

typedef CUresult (*TensorMapEncodeTiled)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *, const cuuint64_t *,
                                         const cuuint64_t *, const cuuint32_t *, const cuuint32_t *,
                                         CUtensorMapInterleave, CUtensorMapSwizzle, CUtensorMapL2promotion,
                                         CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, found once through the runtime (no link against libcuda).
static TensorMapEncodeTiled tensor_map_encode_function(void) {
    static TensorMapEncodeTiled encode = NULL;
    if (encode == NULL) {
        void *function = NULL;
        cudaDriverEntryPointQueryResult found;
        cudaCheck(
            cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess || function == NULL) {
            fprintf(stderr, "error: the CUDA driver has no cuTensorMapEncodeTiled (TMA needs CUDA 12 and sm_90)\n");
            exit(EXIT_FAILURE);
        }
        encode = (TensorMapEncodeTiled)function;
    }
    return encode;
}

// qkv [B, T, (NH + 2 NKV) head_dim] as a rank-3 BF16 tensor (column, row, batch) read in 128B-swizzled
// boxes of 64 x 64 x 1; rows past T read as zeros.
static CUtensorMap attention_qkv_tensor_map(const bf16 *qkv, int B, int T, int NH, int NKV, int head_dim) {
    CUtensorMap map;
    const cuuint64_t width = (cuuint64_t)(NH + 2 * NKV) * head_dim;
    const cuuint64_t dims[3] = {width, (cuuint64_t)T, (cuuint64_t)B};
    const cuuint64_t strides[2] = {width * sizeof(bf16), width * sizeof(bf16) * (cuuint64_t)T};
    const cuuint32_t box[3] = {64, 64, 1}, element_strides[3] = {1, 1, 1};
    CUresult result =
        tensor_map_encode_function()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16 *>(qkv), dims, strides,
                                     box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                     CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) {
        fprintf(stderr, "error: cuTensorMapEncodeTiled refused the qkv tensor (code %d)\n", (int)result);
        exit(EXIT_FAILURE);
    }
    return map;
}

// Launches a TMA forward kernel of Config's shape (its blocks in Config's order; one per SM when
// persistent) with the shared memory of RINGS barrier rings.
template <int HEAD_DIM, class Config, int RINGS = 1, class Kernel>
static void attention_forward_tma_run(Kernel kernel, bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH,
                                      int NKV, cudaStream_t stream, float *out_amax) {
    typedef AttentionTmaForwardSmem<HEAD_DIM, Config::kv_tile, Config::consumers, Config::stages, Config::persistent,
                                    RINGS>
        Smem;
    static_assert(Smem::bytes <= ATTENTION_MAX_SMEM_BYTES, "TMA forward tiles exceed shared memory");
    const CUtensorMap map = attention_qkv_tensor_map(qkv, B, T, NH, NKV, HEAD_DIM);
    attention_launch_setup(kernel, Smem::bytes);
    // A pair's blocks share K/V with the pairs of its kv head (adjacent) and read their Q once.
    const double pair_bytes = (double)T * HEAD_DIM * 2 * (1.0 + 2.0 * NKV / NH);
    const int q_blocks = ceil_div(T, Config::q_tile), chunk = attention_chunk_pairs(Config::order, NH * B, pair_bytes);
    unsigned grid = attention_grid_blocks(q_blocks, NH * B);
    if (Config::persistent) grid = attention_resident_blocks(kernel, Config::threads, Smem::bytes, grid);
    kernel<<<grid, Config::threads, Smem::bytes, stream>>>(map, out, lse, T, NH, NKV, attention_softmax_scale(HEAD_DIM),
                                                           out_amax, NH * B, chunk);
    cudaCheckLaunch();
}

template <int HEAD_DIM, class Config>
static void attention_forward_tma_launch(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                         cudaStream_t stream, float *out_amax = NULL) {
    static_assert(!Config::overlap, "the OVERLAP forward is a variant of test/attention_variants.cuh");
    attention_forward_tma_run<HEAD_DIM, Config>(
        attention_forward_tma_kernel<HEAD_DIM, Config::kv_tile, Config::consumers, Config::stages, Config::persistent>,
        out, lse, qkv, B, T, NH, NKV, stream, out_amax);
}

// ---- backward on TMA loads and 128B-swizzled tiles ----------------------------------------------------
//
// The two passes of the header's backward with the forward's loading scheme: a producer warpgroup (one
// thread issues TMA; its first warp also stages lse and D) fills STAGES stages guarded by mbarriers,
// and 2 or 3 consumer warpgroups compute from the swizzled tiles. The producer hands its registers to
// the consumers (warpgroup_registers_*, AttentionBackwardRegisters below).

// The operands of the steps above in 128B-swizzled tiles: K and V tiles of KV_ROWS key rows (the
// warpgroup's from key_row0) and a stage's Q and dO tiles of Q_TILE rows.
template <int HEAD_DIM, int Q_TILE, int KV_ROWS>
struct Sw128DkDvOperands {
    const char *k_tile, *v_tile;
    int key_row0;
    const char *q_tile, *dout_tile;
    __device__ __forceinline__ void issue_scores_t(float (&st)[Q_TILE / 2]) const {  // S^T = K Q^T
        wgmma_issue_a_bt_sw128<HEAD_DIM, Q_TILE>(st, k_tile, KV_ROWS, key_row0, q_tile);
    }
    __device__ __forceinline__ void issue_dp_t(float (&dpt)[Q_TILE / 2]) const {  // dP^T = V dO^T
        wgmma_issue_a_bt_sw128<HEAD_DIM, Q_TILE>(dpt, v_tile, KV_ROWS, key_row0, dout_tile);
    }
    __device__ __forceinline__ void issue_dv(float (&dv)[HEAD_DIM / 2], uint32_t (&pt)[Q_TILE / 16][4]) const {
        wgmma_issue_add_x_b_sw128<HEAD_DIM, Q_TILE>(dv, pt, dout_tile);  // dV += P^T dO
    }
    __device__ __forceinline__ void issue_dk(float (&dk)[HEAD_DIM / 2], uint32_t (&dst)[Q_TILE / 16][4]) const {
        wgmma_issue_add_x_b_sw128<HEAD_DIM, Q_TILE>(dk, dst, q_tile);  // dK += dS^T Q
    }
};
// Q and dO tiles of Q_ROWS query rows (the warpgroup's from row0) and a stage's K and V tiles of KV rows.
template <int HEAD_DIM, int KV, int Q_ROWS>
struct Sw128DqOperands {
    const char *q_tile, *dout_tile;
    int row0;
    const char *k_tile, *v_tile;
    __device__ __forceinline__ void issue_scores(float (&s)[KV / 2]) const {  // S = Q K^T
        wgmma_issue_a_bt_sw128<HEAD_DIM, KV>(s, q_tile, Q_ROWS, row0, k_tile);
    }
    __device__ __forceinline__ void issue_dp(float (&dp)[KV / 2]) const {  // dP = dO V^T
        wgmma_issue_a_bt_sw128<HEAD_DIM, KV>(dp, dout_tile, Q_ROWS, row0, v_tile);
    }
    __device__ __forceinline__ void issue_dq(float (&dq)[HEAD_DIM / 2], uint32_t (&ds)[KV / 16][4]) const {
        wgmma_issue_add_x_b_sw128<HEAD_DIM, KV>(dq, ds, k_tile);  // dQ += dS K
    }
};

// Writes a warpgroup thread's accumulator rows (row_lo and row_lo + 8, 64 x N per warpgroup) times
// scale as BF16 pairs into rows of one head (row_stride apart), skipping rows >= T; amax_bits
// gathers |x| as stored. With rope.cos, each row's pairs (i, i + N/2), both in this thread (columns
// 8 n8 + c and 8 (n8 + N/16) + c), are rotated back by the row's angles (AttentionRopeBackward).
template <int N>
__device__ __forceinline__ void wgmma_store_rows(bf16 *head, size_t row_stride, int row_lo, int T,
                                                 const float (&acc)[N / 2], float scale, int lane,
                                                 const AttentionRopeBackward &rope, uint32_t &amax_bits) {
    const int c = (lane % 4) * 2;
    if (rope.cos == NULL) {
#pragma unroll
        for (int n8 = 0; n8 < N / 8; n8++)
#pragma unroll
            for (int r = 0; r < 2; r++)
                if (row_lo + 8 * r < T) {
                    const __nv_bfloat162 pair =
                        __floats2bfloat162_rn(acc[4 * n8 + 2 * r] * scale, acc[4 * n8 + 2 * r + 1] * scale);
                    *reinterpret_cast<__nv_bfloat162 *>(head + (size_t)(row_lo + 8 * r) * row_stride + 8 * n8 + c) =
                        pair;
                    amax_bits = bf16x2_abs_bits_max(amax_bits, pair);
                }
        return;
    }
    constexpr int HALF = N / 2, HI = N / 16;  // the partner of column block n8 is n8 + HI
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const int row = row_lo + 8 * r;
        if (row >= T) continue;
        const float *cos_row = rope.cos + (size_t)row * HALF + c, *sin_row = rope.sin + (size_t)row * HALF + c;
        bf16 *out = head + (size_t)row * row_stride + c;
        // The row's table entries, all loaded before its first store (read-only loads, which the
        // stores cannot alias): one wait for the L2 instead of one per column block.
        float2 cos_pairs[HI], sin_pairs[HI];
#pragma unroll
        for (int n8 = 0; n8 < HI; n8++) {
            cos_pairs[n8] = __ldg(reinterpret_cast<const float2 *>(cos_row + 8 * n8));
            sin_pairs[n8] = __ldg(reinterpret_cast<const float2 *>(sin_row + 8 * n8));
        }
#pragma unroll
        for (int n8 = 0; n8 < HI; n8++) {
            const float2 cs = cos_pairs[n8], sn = sin_pairs[n8];
            const float2 x = __bfloat1622float2(
                __floats2bfloat162_rn(acc[4 * n8 + 2 * r] * scale, acc[4 * n8 + 2 * r + 1] * scale));
            const float2 y = __bfloat1622float2(__floats2bfloat162_rn(acc[4 * (n8 + HI) + 2 * r] * scale,
                                                                      acc[4 * (n8 + HI) + 2 * r + 1] * scale));
            const float2 r0 = rope_rotate(x.x, y.x, cs.x, -sn.x), r1 = rope_rotate(x.y, y.y, cs.y, -sn.y);
            const __nv_bfloat162 lo = __floats2bfloat162_rn(r0.x, r1.x), hi = __floats2bfloat162_rn(r0.y, r1.y);
            *reinterpret_cast<__nv_bfloat162 *>(out + 8 * n8) = lo;
            *reinterpret_cast<__nv_bfloat162 *>(out + 8 * n8 + HALF) = hi;
            amax_bits = bf16x2_abs_bits_max(bf16x2_abs_bits_max(amax_bits, lo), hi);
        }
    }
}

// A backward variant on TMA: dK/dV pass with query tiles of 64, DKDV_STAGES stages and DKDV_CONSUMERS
// consumer warpgroups; dQ pass with K/V tiles of DQ_KV keys, DQ_STAGES stages and DQ_CONSUMERS
// consumer warpgroups (consumers: 2 or 3, each 64 key or query rows of the block); both passes'
// blocks started in ORDER. STORE_DS: the dK/dV pass also stores dS^T and the dQ pass only multiplies
// it by K (tiles of 64 keys; DQ_KV unused), where the two-pass dQ recomputes S, P, dP and dS.
// PERSISTENT: both passes run one block per SM taking the blocks in turn (as the forward's).
template <int DKDV_STAGES, int DQ_KV, int DQ_STAGES, int DKDV_CONSUMERS = 2, int DQ_CONSUMERS = 2,
          AttentionOrder ORDER = ATTENTION_ORDER_GRID, bool STORE_DS = false, bool PERSISTENT = false>
struct AttentionTmaTwoPassConfig {
    static constexpr bool one_pass = false, wgmma = false, tma = true, store_ds = STORE_DS, persistent = PERSISTENT;
    static constexpr AttentionOrder order = ORDER;
    static constexpr int dkdv_stages = DKDV_STAGES, dq_kv_tile = DQ_KV, dq_stages = DQ_STAGES;
    static constexpr int dkdv_consumers = DKDV_CONSUMERS, dq_consumers = DQ_CONSUMERS;
};

// The registers of a backward pass's block, 128 x producer + 128 CONSUMERS x consumer within the SM's
// 64K (setmaxnreg): 2 consumers hold dK and dV (or dQ) beside the step's S^T and dP^T in 232 at
// head_dim 64 (40 left to the producer) and 240 at 128 (the producer keeps 24 and spills 8 bytes);
// 3 consumers have 160 each.
template <int HEAD_DIM, int CONSUMERS>
struct AttentionBackwardRegisters {
    static_assert(CONSUMERS == 2 || CONSUMERS == 3, "2 or 3 consumer warpgroups");
    static constexpr int producer = CONSUMERS == 3 || HEAD_DIM == 128 ? 24 : 40;
    static constexpr int consumer = CONSUMERS == 3 ? 160 : HEAD_DIM == 128 ? 240 : 232;
    static_assert(WGMMA_WARPGROUP_THREADS * (producer + CONSUMERS * consumer) <= 65536, "the SM's 64K registers");
};

#define ATTENTION_TMA_BACKWARD_Q_TILE 64

// dS^T as the dK/dV pass stores it for a dQ pass that only multiplies it by K: per (batch, query
// head) pair, the causal tiles (query tile i, key tile j <= i) of 64 x 64, tile (i, j) at index
// i (i + 1) / 2 + j, each 64 key rows of 64 queries, row-major BF16 (entries past T or past the
// diagonal are 0).
#define ATTENTION_DS_TILE 64
__host__ __device__ __forceinline__ size_t attention_ds_tiles_per_pair(int T) {
    const size_t n = (size_t)ceil_div(T, ATTENTION_DS_TILE);
    return n * (n + 1) / 2;
}
// The first row of tile (i, j) within its pair (attention_ds_tensor_map's second coordinate).
__device__ __forceinline__ int attention_ds_tile_row(int i, int j) { return (i * (i + 1) / 2 + j) * ATTENTION_DS_TILE; }

// Shared memory of the TMA dK/dV pass from a 1024-byte aligned start: K and V (64 CONSUMERS rows
// each) per block slot, then per stage Q and dO (64 rows each), with STORE_DS two dS^T tiles per
// consumer, then lse (log2 units) and D per stage, then the mbarriers full[STAGES], empty[STAGES] and
// the block slots.
template <int HEAD_DIM, int STAGES, int CONSUMERS, bool STORE_DS = false, bool PERSISTENT = false>
struct AttentionTmaDkDvSmem {
    static constexpr int Q_TILE = ATTENTION_TMA_BACKWARD_Q_TILE, kv_rows = CONSUMERS * WGMMA_WARPGROUP_ROWS;
    static constexpr size_t kv_bytes = (size_t)kv_rows * HEAD_DIM * 2, q_bytes = (size_t)Q_TILE * HEAD_DIM * 2;
    static constexpr size_t ds_tile_bytes = 64 * 64 * 2;  // filled and stored (TMA) in turn
    static constexpr size_t ring_bytes = STAGES * (2 * q_bytes + 2 * Q_TILE * sizeof(float) + 2 * sizeof(uint64_t)) +
                                         (STORE_DS ? 2 * CONSUMERS * ds_tile_bytes : 0);
    static constexpr int slots = attention_block_slots(PERSISTENT, 2 * kv_bytes, ring_bytes);
    static constexpr size_t k = 0, v = slots * kv_bytes, q = 2 * slots * kv_bytes, dout = q + STAGES * q_bytes;
    static constexpr size_t ds = dout + STAGES * q_bytes;
    static constexpr size_t lse = ds + (STORE_DS ? 2 * CONSUMERS * ds_tile_bytes : 0);
    static constexpr size_t delta = lse + STAGES * Q_TILE * sizeof(float);
    static constexpr size_t bars = delta + STAGES * Q_TILE * sizeof(float);
    static constexpr size_t block_slots = bars + 2 * STAGES * sizeof(uint64_t);
    static constexpr size_t bytes = block_slots + sizeof(AttentionBlockSlots) + 1024;
};

// What a dK/dV block computes: key rows kv0.. of kv head kv_head of batch b, against the query tiles
// from first_q_tile on of each query head of the group (steps of them in all).
struct AttentionDkDvBlock {
    int kv0, kv_head, b, first_q_tile, q_tiles_per_head, steps;
};
__device__ __forceinline__ AttentionDkDvBlock attention_dkdv_block(int linear, int kv_blocks, int kv_rows, int pairs,
                                                                   int chunk_pairs, int T, int NKV, int group,
                                                                   int q_tile) {
    const AttentionBlock block = attention_block_in_order(linear, kv_blocks, pairs, chunk_pairs);
    AttentionDkDvBlock d;
    d.kv0 = block.x * kv_rows;
    d.kv_head = block.pair % NKV;
    d.b = block.pair / NKV;
    d.first_q_tile = d.kv0 / q_tile;  // earlier queries see none of these keys
    d.q_tiles_per_head = ceil_div(T, q_tile) - d.first_q_tile;
    d.steps = group * d.q_tiles_per_head;  // step i: head kv_head * group + i / q_tiles_per_head
    return d;
}

// Block: key rows kv0 = 64 CONSUMERS x.. of kv head kv_head of batch b, in the order of chunk_pairs
// (attention_block_in_order: key block 0, the longest, first; a persistent block takes such blocks
// one after the other, its K and V in the block slot's tiles); consumer w: keys kv0 + 64 w...
// Steps: every query head of the group (outer) and its query tiles from the one holding kv0 on
// (inner), each step's Q, dO, lse and D in the ring's next stage (its position carries on from one
// block to the next).
template <int HEAD_DIM, int STAGES, int CONSUMERS, bool STORE_DS, bool PERSISTENT>
__global__ void __launch_bounds__((CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS, 1)
    attention_backward_dkdv_tma_kernel(const __grid_constant__ CUtensorMap qkv_map,
                                       const __grid_constant__ CUtensorMap dout_map, bf16 *dqkv, const float *lse,
                                       const float *delta, int T, int NH, int NKV, float softmax_scale, int pairs,
                                       int chunk_pairs, const __grid_constant__ CUtensorMap ds_map,
                                       AttentionRopeBackward rope) {
    typedef AttentionTmaDkDvSmem<HEAD_DIM, STAGES, CONSUMERS, STORE_DS, PERSISTENT> Smem;
    typedef AttentionBackwardRegisters<HEAD_DIM, CONSUMERS> Registers;
    constexpr int Q_TILE = Smem::Q_TILE, KV_ROWS = Smem::kv_rows, GROUP_ROWS = WGMMA_WARPGROUP_ROWS;
    constexpr int SLOTS = Smem::slots;
    extern __shared__ __align__(1024) unsigned char attention_tma_smem[];
    char *smem = shared_aligned_1024(attention_tma_smem);
    float *lse_tiles = reinterpret_cast<float *>(smem + Smem::lse);  // log2 units
    float *delta_tiles = reinterpret_cast<float *>(smem + Smem::delta);
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Smem::bars), *empty = full + STAGES;
    AttentionBlockSlots *slots = reinterpret_cast<AttentionBlockSlots *>(smem + Smem::block_slots);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS;
    const int kv_blocks = ceil_div(T, KV_ROWS), blocks = kv_blocks * pairs, group = NH / NKV;

    attention_pipeline_init<STAGES>(slots, full, CONSUMERS);

    if (warpgroup == 0) {
        warpgroup_registers_release<Registers::producer>();
        if (threadIdx.x >= 32) return;
        const int lane = threadIdx.x;
        int ring = 0;  // steps loaded so far: the ring position of the next
        for (int k = 0; PERSISTENT || k == 0; k++) {
            const int slot = k % SLOTS;
            int linear = lane == 0 ? attention_take_block<PERSISTENT, SLOTS>(slots, k, blocks) : 0;
            linear = __shfl_sync(0xffffffffu, linear, 0);
            if (linear == blocks) {
                if (lane == 0) mbarrier_arrive(&slots->full[slot]);
                break;
            }
            const AttentionDkDvBlock d =
                attention_dkdv_block(linear, kv_blocks, KV_ROWS, pairs, chunk_pairs, T, NKV, group, Q_TILE);
            if (lane == 0) {
                mbarrier_arrive_expect_bytes(&slots->full[slot], (uint32_t)(2 * Smem::kv_bytes));
                tma_load_tile<KV_ROWS, HEAD_DIM>(smem + Smem::k + slot * Smem::kv_bytes, &qkv_map,
                                                 (NH + d.kv_head) * HEAD_DIM, d.kv0, d.b, &slots->full[slot]);
                tma_load_tile<KV_ROWS, HEAD_DIM>(smem + Smem::v + slot * Smem::kv_bytes, &qkv_map,
                                                 (NH + NKV + d.kv_head) * HEAD_DIM, d.kv0, d.b, &slots->full[slot]);
            }
            for (int step = 0; step < d.steps; step++) {
                const int at = ring + step, stage = at % STAGES;
                if (at >= STAGES) mbarrier_wait(&empty[stage], (at / STAGES + 1) & 1);
                const int head = d.kv_head * group + step / d.q_tiles_per_head;
                const int q0 = (d.first_q_tile + step % d.q_tiles_per_head) * Q_TILE;
                const size_t stats = ((size_t)d.b * NH + head) * T;
                for (int i = lane; i < Q_TILE; i += 32) {  // rows past T: P = 0 exactly (lse = +inf), D = 0
                    const int q = q0 + i;
                    lse_tiles[stage * Q_TILE + i] = q < T ? lse[stats + q] * ATTENTION_LOG2E : INFINITY;
                    delta_tiles[stage * Q_TILE + i] = q < T ? delta[stats + q] : 0.f;
                }
                __syncwarp();
                if (lane == 0) {  // its arrival releases the warp's lse and D stores with the tiles
                    mbarrier_arrive_expect_bytes(&full[stage], (uint32_t)(2 * Smem::q_bytes));
                    tma_load_tile<Q_TILE, HEAD_DIM>(smem + Smem::q + stage * Smem::q_bytes, &qkv_map, head * HEAD_DIM,
                                                    q0, d.b, &full[stage]);
                    tma_load_tile<Q_TILE, HEAD_DIM>(smem + Smem::dout + stage * Smem::q_bytes, &dout_map,
                                                    head * HEAD_DIM, q0, d.b, &full[stage]);
                }
            }
            ring += d.steps;
        }
        if (lane == 0) attention_blocks_taken<PERSISTENT>();
        return;
    }
    warpgroup_registers_claim<Registers::consumer>();

    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    int ring = 0;     // the ring position of this block's step 0
    int ds_turn = 0;  // the warpgroup's steps so far: its two dS^T tiles take turns
    uint32_t amax_bits = 0;
    for (int k = 0; PERSISTENT || k == 0; k++) {
        const int linear = attention_wait_block<SLOTS>(slots, k);
        if (linear == blocks) break;  // warpgroup-uniform
        const AttentionDkDvBlock d =
            attention_dkdv_block(linear, kv_blocks, KV_ROWS, pairs, chunk_pairs, T, NKV, group, Q_TILE);
        const int key_first = d.kv0 + consumer * GROUP_ROWS;  // this warpgroup's first key
        const int key_lo = key_first + warp * 16 + lane / 4;  // this thread's keys: key_lo and key_lo + 8
        const char *k_tile = smem + Smem::k + (k % SLOTS) * Smem::kv_bytes;
        const char *v_tile = smem + Smem::v + (k % SLOTS) * Smem::kv_bytes;
        float dk_acc[HEAD_DIM / 2], dv_acc[HEAD_DIM / 2];
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 2; i++) dk_acc[i] = dv_acc[i] = 0.f;

        for (int step = 0; step < d.steps; step++) {
            const int at = ring + step, stage = at % STAGES;
            mbarrier_wait(&full[stage], (at / STAGES) & 1);
            const int q0 = (d.first_q_tile + step % d.q_tiles_per_head) * Q_TILE;
            char *ds_t = STORE_DS ? smem + Smem::ds + (2 * consumer + ds_turn % 2) * Smem::ds_tile_bytes : NULL;
            if (key_first < T && key_first <= q0 + Q_TILE - 1) {  // warpgroup-uniform
                ds_turn++;
                wgmma_backward_dkdv_step<HEAD_DIM, Q_TILE>(
                    dk_acc, dv_acc,
                    Sw128DkDvOperands<HEAD_DIM, Q_TILE, KV_ROWS>{k_tile, v_tile, consumer * GROUP_ROWS,
                                                                 smem + Smem::q + stage * Smem::q_bytes,
                                                                 smem + Smem::dout + stage * Smem::q_bytes},
                    lse_tiles + stage * Q_TILE, delta_tiles + stage * Q_TILE, scale_log2, key_first, q0, warp, lane,
                    ds_t);
                if (STORE_DS) {
                    // Written by this warpgroup's threads, read by the TMA store that its first thread issues
                    // once the store before (of the other tile) has read its own: then both are free again.
                    tma_fence_shared_writes();
                    const bool first = threadIdx.x % WGMMA_WARPGROUP_THREADS == 0;
                    if (first) tma_store_wait_reads<0>();
                    warpgroup_barrier(consumer);
                    if (first) {
                        const int i = q0 / ATTENTION_DS_TILE, j = key_first / ATTENTION_DS_TILE;
                        tma_store_box(&ds_map, ds_t, 0, attention_ds_tile_row(i, j),
                                      d.b * NH + d.kv_head * group + step / d.q_tiles_per_head);
                    }
                }
            }
            if (threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) mbarrier_arrive(&empty[stage]);
        }
        attention_release_block<PERSISTENT, SLOTS>(slots, k);  // no product reads its K and V any more
        ring += d.steps;

        const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM;
        bf16 *dqkv_batch = dqkv + (size_t)d.b * T * qkv_row;
        wgmma_store_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + d.kv_head) * HEAD_DIM, qkv_row, key_lo, T, dk_acc,
                                   softmax_scale, lane, rope, amax_bits);
        const AttentionRopeBackward unrotated = {NULL, NULL, rope.amax};
        wgmma_store_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + NKV + d.kv_head) * HEAD_DIM, qkv_row, key_lo, T, dv_acc,
                                   1.f, lane, unrotated, amax_bits);
    }
    if (rope.amax != NULL) attention_fold_amax(rope.amax, amax_bits, lane);
    if (STORE_DS && threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) tma_store_wait_all();
}

// Shared memory of the TMA dQ pass from a 1024-byte aligned start: Q and dO (64 CONSUMERS rows each)
// per block slot, K and V stages, then the mbarriers full[STAGES], empty[STAGES] and the block slots.
template <int HEAD_DIM, int KV, int STAGES, int CONSUMERS, bool PERSISTENT = false>
struct AttentionTmaDqSmem {
    static constexpr int q_rows = CONSUMERS * WGMMA_WARPGROUP_ROWS;
    static constexpr size_t rows_bytes = (size_t)q_rows * HEAD_DIM * 2, kv_bytes = (size_t)KV * HEAD_DIM * 2;
    static constexpr int slots =
        attention_block_slots(PERSISTENT, 2 * rows_bytes, STAGES * (2 * kv_bytes + 2 * sizeof(uint64_t)));
    static constexpr size_t q = 0, dout = slots * rows_bytes, k = 2 * slots * rows_bytes, v = k + STAGES * kv_bytes;
    static constexpr size_t bars = v + STAGES * kv_bytes, block_slots = bars + 2 * STAGES * sizeof(uint64_t);
    static constexpr size_t bytes = block_slots + sizeof(AttentionBlockSlots) + 1024;
};

// Block: query rows q0 = attention_query_block_row0.. (64 CONSUMERS of them) of head h of batch b,
// ordered and taken as the forward's (attention_forward_block); consumer w: rows q0 + 64 w.. It walks
// the K/V tiles up to the diagonal like the forward: S = Q K^T, dP = dO V^T, P, dS, dQ += dS K.
template <int HEAD_DIM, int KV, int STAGES, int CONSUMERS, bool PERSISTENT>
__global__ void __launch_bounds__((CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS, 1)
    attention_backward_dq_tma_kernel(const __grid_constant__ CUtensorMap qkv_map,
                                     const __grid_constant__ CUtensorMap dout_map, bf16 *dqkv, const float *lse,
                                     const float *delta, int T, int NH, int NKV, float softmax_scale, int pairs,
                                     int chunk_pairs, AttentionRopeBackward rope) {
    typedef AttentionTmaDqSmem<HEAD_DIM, KV, STAGES, CONSUMERS, PERSISTENT> Smem;
    constexpr int Q_ROWS = Smem::q_rows, GROUP_ROWS = WGMMA_WARPGROUP_ROWS, SLOTS = Smem::slots;
    typedef AttentionBackwardRegisters<HEAD_DIM, CONSUMERS> Registers;
    extern __shared__ __align__(1024) unsigned char attention_tma_smem[];
    char *smem = shared_aligned_1024(attention_tma_smem);
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Smem::bars), *empty = full + STAGES;
    AttentionBlockSlots *slots = reinterpret_cast<AttentionBlockSlots *>(smem + Smem::block_slots);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS;
    const int q_blocks = ceil_div(T, Q_ROWS), blocks = q_blocks * pairs;

    attention_pipeline_init<STAGES>(slots, full, CONSUMERS);

    if (warpgroup == 0) {
        warpgroup_registers_release<Registers::producer>();
        if (threadIdx.x == 0)
            attention_query_blocks_produce<HEAD_DIM, KV, STAGES, Q_ROWS, PERSISTENT, SLOTS>(
                slots, &qkv_map, &dout_map, smem + Smem::q, smem + Smem::dout, Smem::rows_bytes, smem + Smem::k,
                smem + Smem::v, full, empty, pairs, chunk_pairs, T, NH, NKV);
        return;
    }
    warpgroup_registers_claim<Registers::consumer>();

    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    int ring = 0;  // the ring position of this block's K/V tile 0
    uint32_t amax_bits = 0;
    for (int k = 0; PERSISTENT || k == 0; k++) {
        const int linear = attention_wait_block<SLOTS>(slots, k);
        if (linear == blocks) break;  // warpgroup-uniform
        const AttentionForwardBlock f =
            attention_forward_block(linear, q_blocks, Q_ROWS, pairs, chunk_pairs, T, NH, NKV, KV);
        const int group_row0 = f.q0 + consumer * GROUP_ROWS;
        const bool group_rows = group_row0 >= 0 && group_row0 < T;  // as the forward's
        const int group_tiles = group_rows ? (min(group_row0 + GROUP_ROWS, T) - 1) / KV + 1 : 0;
        const int row_lo = group_row0 + warp * 16 + lane / 4;  // this thread's rows: row_lo and row_lo + 8
        float row_lse_log2[2], row_delta[2];
        attention_dq_row_statistics(row_lse_log2, row_delta, lse, delta, f.b, f.h, NH, T, row_lo);
        float dq_acc[HEAD_DIM / 2];
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 2; i++) dq_acc[i] = 0.f;

        for (int j = 0; j < f.num_kv_tiles; j++) {
            const int at = ring + j, stage = at % STAGES;
            mbarrier_wait(&full[stage], (at / STAGES) & 1);  // also where skipped: see the forward
            if (j < group_tiles) {                           // warpgroup-uniform
                const int kv0 = j * KV;
                wgmma_backward_dq_step<HEAD_DIM, KV>(
                    dq_acc,
                    Sw128DqOperands<HEAD_DIM, KV, Q_ROWS>{smem + Smem::q + (k % SLOTS) * Smem::rows_bytes,
                                                          smem + Smem::dout + (k % SLOTS) * Smem::rows_bytes,
                                                          consumer * GROUP_ROWS,
                                                          smem + Smem::k + stage * Smem::kv_bytes,
                                                          smem + Smem::v + stage * Smem::kv_bytes},
                    row_lse_log2, row_delta, scale_log2, row_lo, kv0, kv0 + KV - 1 > group_row0, lane);
            }
            if (threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) mbarrier_arrive(&empty[stage]);
        }
        attention_release_block<PERSISTENT, SLOTS>(slots, k);  // no product reads its Q and dO any more
        ring += f.num_kv_tiles;
        if (!group_rows) continue;  // warpgroup-uniform

        const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM;
        wgmma_store_rows<HEAD_DIM>(dqkv + (size_t)f.b * T * qkv_row + (size_t)f.h * HEAD_DIM, qkv_row, row_lo, T,
                                   dq_acc, softmax_scale, lane, rope, amax_bits);
    }
    if (rope.amax != NULL) attention_fold_amax(rope.amax, amax_bits, lane);
}

// Shared memory of the dQ-from-dS pass from a 1024-byte aligned start: per stage a K tile of 64 keys and
// one dS^T tile per consumer, then the mbarriers full[STAGES], empty[STAGES] and the block slots.
template <int HEAD_DIM, int STAGES, int CONSUMERS>
struct AttentionTmaDqFromDsSmem {
    static constexpr size_t k_bytes = (size_t)ATTENTION_DS_TILE * HEAD_DIM * 2;
    static constexpr size_t ds_bytes = (size_t)ATTENTION_DS_TILE * ATTENTION_DS_TILE * 2;
    static constexpr size_t stage_bytes = k_bytes + CONSUMERS * ds_bytes, bars = STAGES * stage_bytes;
    static constexpr size_t block_slots = bars + 2 * STAGES * sizeof(uint64_t);
    static constexpr size_t bytes = block_slots + sizeof(AttentionBlockSlots) + 1024;
};

// Block: query tiles CONSUMERS x.. of 64 rows of head h of batch b (last block of a pair first; a
// persistent block takes such blocks one after the other: a block's tiles are all in the ring, whose
// position carries on, and its slot only names it), consumer w: tile CONSUMERS x + w. A stage holds K
// tile j and the dS^T tiles (i, j) of the block's tiles i >= j; a consumer computes dQ += dS K from
// those left of its diagonal (A = dS from the stored dS^T, read MN-major; B = K read MN-major), then
// releases the stage.
template <int HEAD_DIM, int STAGES, int CONSUMERS, bool PERSISTENT>
__global__ void __launch_bounds__((CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS, 1)
    attention_backward_dq_from_ds_kernel(const __grid_constant__ CUtensorMap qkv_map,
                                         const __grid_constant__ CUtensorMap ds_map, bf16 *dqkv, int T, int NH,
                                         int NKV, float softmax_scale, int pairs, int chunk_pairs,
                                         AttentionRopeBackward rope) {
    typedef AttentionTmaDqFromDsSmem<HEAD_DIM, STAGES, CONSUMERS> Smem;
    constexpr int TILE = ATTENTION_DS_TILE, SLOTS = 2;
    extern __shared__ __align__(1024) unsigned char attention_tma_smem[];
    char *smem = shared_aligned_1024(attention_tma_smem);
    uint64_t *full = reinterpret_cast<uint64_t *>(smem + Smem::bars), *empty = full + STAGES;
    AttentionBlockSlots *slots = reinterpret_cast<AttentionBlockSlots *>(smem + Smem::block_slots);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS;
    const int tiles = ceil_div(T, TILE), q_blocks = ceil_div(tiles, CONSUMERS), blocks = q_blocks * pairs;
    // The block's first query tile and its pair.
    auto block_of = [&](int linear, int *tile0, int *pair) {
        const AttentionBlock block = attention_block_in_order(linear, q_blocks, pairs, chunk_pairs);
        *tile0 = (q_blocks - 1 - block.x) * CONSUMERS;
        *pair = block.pair;
    };

    attention_pipeline_init<STAGES>(slots, full, CONSUMERS);

    if (warpgroup == 0) {
        warpgroup_registers_release<24>();
        if (threadIdx.x != 0) return;
        int ring = 0;  // stages loaded so far: the ring position of the next
        for (int k = 0; PERSISTENT || k == 0; k++) {
            const int linear = attention_take_block<PERSISTENT, SLOTS>(slots, k, blocks);
            mbarrier_arrive(&slots->full[k % SLOTS]);
            if (linear == blocks) break;
            int tile0, pair;
            block_of(linear, &tile0, &pair);
            const int h = pair % NH, b = pair / NH, kv_head = h / (NH / NKV);
            const int last_tile = min(tile0 + CONSUMERS, tiles) - 1;  // also the last K tile any consumer reads
            for (int j = 0; j <= last_tile; j++) {
                const int at = ring + j, stage = at % STAGES, first = max(tile0, j);
                if (at >= STAGES) mbarrier_wait(&empty[stage], (at / STAGES + 1) & 1);
                char *tiles_at = smem + stage * Smem::stage_bytes;
                mbarrier_arrive_expect_bytes(&full[stage],
                                             (uint32_t)(Smem::k_bytes + (last_tile - first + 1) * Smem::ds_bytes));
                tma_load_tile<TILE, HEAD_DIM>(tiles_at, &qkv_map, (NH + kv_head) * HEAD_DIM, j * TILE, b, &full[stage]);
                for (int i = first; i <= last_tile; i++)
                    tma_load_box(tiles_at + Smem::k_bytes + (i - tile0) * Smem::ds_bytes, &ds_map, 0,
                                 attention_ds_tile_row(i, j), pair, &full[stage]);
            }
            ring += last_tile + 1;
        }
        attention_blocks_taken<PERSISTENT>();
        return;
    }
    // What the producer's 24 leave of the block's launch share (65536 / threads, rounded down to 8):
    // a claim beyond it waits forever.
    warpgroup_registers_claim<CONSUMERS == 2 ? 240 : CONSUMERS == 3 ? 160 : 112>();

    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    int ring = 0;  // the ring position of this block's stage 0
    uint32_t amax_bits = 0;
    for (int k = 0; PERSISTENT || k == 0; k++) {
        const int linear = attention_wait_block<SLOTS>(slots, k);
        attention_release_block<PERSISTENT, SLOTS>(slots, k);  // the slot only names the block
        if (linear == blocks) break;  // warpgroup-uniform
        int tile0, pair;
        block_of(linear, &tile0, &pair);
        const int h = pair % NH, b = pair / NH, tile = tile0 + consumer;
        const int last_tile = min(tile0 + CONSUMERS, tiles) - 1;
        float dq_acc[HEAD_DIM / 2];
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 2; i++) dq_acc[i] = 0.f;
        for (int j = 0; j <= last_tile; j++) {
            const int at = ring + j, stage = at % STAGES;
            mbarrier_wait(&full[stage], (at / STAGES) & 1);
            if (j <= tile && tile < tiles) {  // warpgroup-uniform
                const char *tiles_at = smem + stage * Smem::stage_bytes;
                const char *ds_t = tiles_at + Smem::k_bytes + consumer * Smem::ds_bytes;
                const uint64_t a = wgmma_sw128_descriptor(ds_t, TILE * 128);
                const uint64_t b = wgmma_sw128_descriptor(tiles_at, TILE * 128);
                wgmma_pin_registers(dq_acc);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < TILE / 16; kk++)
                    wgmma_m64k16_smem_a<HEAD_DIM, 1, 1>(dq_acc, wgmma_descriptor_advance(a, kk * 2048),
                                                        wgmma_descriptor_advance(b, kk * 2048), 1);
                wgmma_commit_group();
                wgmma_wait_pending<0>();
                wgmma_pin_registers(dq_acc);
            }
            if (threadIdx.x % WGMMA_WARPGROUP_THREADS == 0) mbarrier_arrive(&empty[stage]);
        }
        ring += last_tile + 1;
        if (tile >= tiles) continue;  // warpgroup-uniform
        const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM;
        const int row_lo = tile * TILE + warp * 16 + lane / 4;
        wgmma_store_rows<HEAD_DIM>(dqkv + (size_t)b * T * qkv_row + (size_t)h * HEAD_DIM, qkv_row, row_lo, T,
                                   dq_acc, softmax_scale, lane, rope, amax_bits);
    }
    if (rope.amax != NULL) attention_fold_amax(rope.amax, amax_bits, lane);
}

// The stored dS^T [B NH pairs][tiles][64][64] as a rank-3 BF16 tensor (column, row, pair) read in
// 128B-swizzled boxes of 64 x 64 x 1.
static CUtensorMap attention_ds_tensor_map(const bf16 *ds, int B, int T, int NH) {
    CUtensorMap map;
    const cuuint64_t rows = (cuuint64_t)attention_ds_tiles_per_pair(T) * ATTENTION_DS_TILE;
    const cuuint64_t dims[3] = {ATTENTION_DS_TILE, rows, (cuuint64_t)B * NH};
    const cuuint64_t strides[2] = {ATTENTION_DS_TILE * sizeof(bf16), rows * ATTENTION_DS_TILE * sizeof(bf16)};
    const cuuint32_t box[3] = {ATTENTION_DS_TILE, ATTENTION_DS_TILE, 1}, element_strides[3] = {1, 1, 1};
    CUresult result = tensor_map_encode_function()(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<bf16 *>(ds), dims, strides, box, element_strides,
        CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (result != CUDA_SUCCESS) {
        fprintf(stderr, "error: cuTensorMapEncodeTiled refused the dS tensor (code %d)\n", (int)result);
        exit(EXIT_FAILURE);
    }
    return map;
}

// dout [B, T, NH * head_dim] as a rank-3 tensor map like qkv's.
static CUtensorMap attention_dout_tensor_map(const bf16 *dout, int B, int T, int NH, int head_dim) {
    return attention_qkv_tensor_map(dout, B, T, NH, 0, head_dim);
}

// Bytes of the stored dS^T of a STORE_DS backward.
static inline size_t attention_ds_bytes(int B, int T, int NH) {
    return (size_t)B * NH * attention_ds_tiles_per_pair(T) * ATTENTION_DS_TILE * ATTENTION_DS_TILE * sizeof(bf16);
}

// The TMA dK/dV pass, then the TMA dQ pass (D already in delta). With Config::store_ds, ds holds
// attention_ds_bytes(B, T, NH). rope: RoPE's backward and the amax, done as dqkv is stored.
template <int HEAD_DIM, class Config>
static void attention_backward_tma_launch(bf16 *dqkv, const float *delta, const bf16 *dout, const bf16 *qkv,
                                          const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream,
                                          bf16 *ds = NULL, AttentionRopeBackward rope = AttentionRopeBackward{}) {
    constexpr bool PERSISTENT = Config::persistent;
    typedef AttentionTmaDkDvSmem<HEAD_DIM, Config::dkdv_stages, Config::dkdv_consumers, Config::store_ds, PERSISTENT>
        DkDvSmem;
    static_assert(DkDvSmem::bytes <= ATTENTION_MAX_SMEM_BYTES, "TMA dK/dV tiles exceed shared memory");
    const CUtensorMap qkv_map = attention_qkv_tensor_map(qkv, B, T, NH, NKV, HEAD_DIM);
    const CUtensorMap dout_map = attention_dout_tensor_map(dout, B, T, NH, HEAD_DIM);
    const float scale = attention_softmax_scale(HEAD_DIM);
    if (Config::store_ds && ds == NULL) {
        fprintf(stderr, "error: attention backward: no buffer for dS\n");
        exit(EXIT_FAILURE);
    }
    const CUtensorMap ds_map = Config::store_ds ? attention_ds_tensor_map(ds, B, T, NH) : qkv_map;  // else unused

    // What blocks of one pair share: a dK/dV block reads the Q and dO of its kv head's query heads, a
    // dQ block the K/V of its kv head (shared with the adjacent pairs of that kv head) beside its Q and dO.
    const double head_bytes = (double)T * HEAD_DIM * 2;
    auto dkdv = attention_backward_dkdv_tma_kernel<HEAD_DIM, Config::dkdv_stages, Config::dkdv_consumers,
                                                   Config::store_ds, PERSISTENT>;
    const int dkdv_threads = (Config::dkdv_consumers + 1) * WGMMA_WARPGROUP_THREADS;
    attention_launch_setup(dkdv, DkDvSmem::bytes);
    const int kv_blocks = ceil_div(T, DkDvSmem::kv_rows);
    const int dkdv_chunk = attention_chunk_pairs(Config::order, NKV * B, 2.0 * head_bytes * NH / NKV);
    unsigned grid = attention_grid_blocks(kv_blocks, NKV * B);
    if (PERSISTENT) grid = attention_resident_blocks(dkdv, dkdv_threads, DkDvSmem::bytes, grid);
    dkdv<<<grid, dkdv_threads, DkDvSmem::bytes, stream>>>(qkv_map, dout_map, dqkv, lse, delta, T, NH, NKV, scale,
                                                          NKV * B, dkdv_chunk, ds_map, rope);
    cudaCheckLaunch();

    const int dq_threads = (Config::dq_consumers + 1) * WGMMA_WARPGROUP_THREADS;
    if constexpr (Config::store_ds) {
        typedef AttentionTmaDqFromDsSmem<HEAD_DIM, Config::dq_stages, Config::dq_consumers> Smem;
        static_assert(Smem::bytes <= ATTENTION_MAX_SMEM_BYTES, "dQ-from-dS tiles exceed shared memory");
        auto dq = attention_backward_dq_from_ds_kernel<HEAD_DIM, Config::dq_stages, Config::dq_consumers, PERSISTENT>;
        attention_launch_setup(dq, Smem::bytes);
        const int q_blocks = ceil_div(ceil_div(T, ATTENTION_DS_TILE), Config::dq_consumers);
        const int dq_chunk = attention_chunk_pairs(Config::order, NH * B, head_bytes * 2.0 * NKV / NH);
        grid = attention_grid_blocks(q_blocks, NH * B);
        if (PERSISTENT) grid = attention_resident_blocks(dq, dq_threads, Smem::bytes, grid);
        dq<<<grid, dq_threads, Smem::bytes, stream>>>(qkv_map, ds_map, dqkv, T, NH, NKV, scale, NH * B, dq_chunk,
                                                      rope);
        cudaCheckLaunch();
    } else {
        typedef AttentionTmaDqSmem<HEAD_DIM, Config::dq_kv_tile, Config::dq_stages, Config::dq_consumers, PERSISTENT>
            DqSmem;
        static_assert(DqSmem::bytes <= ATTENTION_MAX_SMEM_BYTES, "TMA dQ tiles exceed shared memory");
        auto dq = attention_backward_dq_tma_kernel<HEAD_DIM, Config::dq_kv_tile, Config::dq_stages,
                                                   Config::dq_consumers, PERSISTENT>;
        attention_launch_setup(dq, DqSmem::bytes);
        const int q_blocks = ceil_div(T, DqSmem::q_rows);
        const int dq_chunk = attention_chunk_pairs(Config::order, NH * B, head_bytes * (2.0 + 2.0 * NKV / NH));
        grid = attention_grid_blocks(q_blocks, NH * B);
        if (PERSISTENT) grid = attention_resident_blocks(dq, dq_threads, DqSmem::bytes, grid);
        dq<<<grid, dq_threads, DqSmem::bytes, stream>>>(qkv_map, dout_map, dqkv, lse, delta, T, NH, NKV, scale, NH * B,
                                                        dq_chunk, rope);
        cudaCheckLaunch();
    }
}
