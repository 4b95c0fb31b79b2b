// Attention kernel variants beside the program's (coat/attention.cuh, attention_wgmma.cuh): other
// designs and tile shapes that test/bench_attention_variants.cu checks against the program's kernels
// and times, with the same math, layouts and results. Not part of the program.
//
// mma.sync (m16n8k16) kernels, the portable design:
//   forward: a block of WARPS warps owns query rows of one head, M_TILES m16 tiles per warp (so that
//     every K or V fragment read from shared memory feeds M_TILES mma), and walks the K/V tiles up to
//     the diagonal with an online softmax in base 2; K/V tiles through a cp.async pipeline.
//   backward: a dK/dV block owns 16 key rows per warp with dK and dV in its registers and walks the
//     query tiles of every query head of its group, S^T and dP^T computed transposed so that P^T and
//     dS^T feed dV and dK straight from registers; dQ in one of two designs:
//     two passes: a second kernel owns the query rows and computes S and dP again for dQ;
//     one pass: the dK/dV block also writes dS^T to shared memory and computes its share of
//       dQ = dS K over its 128 keys. Shares go, in FP32, to a slot per (head, 64-row query tile) in
//       scratch through the copy engine (cp.reduce.async.bulk), the kv blocks taking turns in a fixed
//       order counted by a flag per slot; a last small kernel scales the slots into dQ as BF16.
// The wgmma two-pass backward of attention_wgmma.cuh fed by cp.async into no-swizzle tiles: every
// thread loads, with block-wide barriers between steps (the program's TMA kernels replaced it).
// The TMA forward in FlashAttention-3's order (OVERLAP of AttentionTmaForwardConfig): each consumer's
// softmax of one tile beside its own O += P V of the last, 0.84-0.99x the program's forward.
// All are deterministic, without atomics.
#pragma once
#include <math.h>
#include <stdint.h>

#include "../coat/attention.cuh"

// Shared-memory rows are padded by 16 bytes so that the 8 row addresses of one ldmatrix fall in
// 8 different 4-bank groups (row strides of 144 or 272 bytes), with no swizzle to reason about.
#define ATTENTION_SMEM_PAD 8

// The one-pass backward's shape is fixed: 8 warps own 128 key rows, 16 each, and walk query tiles
// of 64 rows; its dQ share, and so the layout of the dQ slots, splits 64 x head_dim over 2 x 4 warps.
#define ATTENTION_ONE_PASS_WARPS 8
#define ATTENTION_ONE_PASS_THREADS (ATTENTION_ONE_PASS_WARPS * 32)
#define ATTENTION_ONE_PASS_KV_TILE (ATTENTION_ONE_PASS_WARPS * 16)
#define ATTENTION_ONE_PASS_Q_TILE 64

// ---- mma.sync building blocks -----------------------------------------------------------------------

// Four 8x8 BF16 matrices from shared memory: lane l gives the address of row l % 8 of matrix l / 8
// and receives, in r[i], elements (l / 4, 2 (l % 4) + {0, 1}) of matrix i (transposed: the
// elements (2 (l % 4) + {0, 1}, l / 4)), which is the mma fragment layout.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16 *smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16 *smem_row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(smem_row)));
}

// d (16x8 FP32) += a (16x16 BF16, row-major) * b (16x8 BF16). With g = lane / 4, c = 2 (lane % 4):
// a[0] = A(g, c..c+1), a[1] = A(g+8, c..), a[2] = A(g, c+8..), a[3] = A(g+8, c+8..);
// b0 = B(c..c+1, g), b1 = B(c+8..c+9, g); d[0..1] = D(g, c..c+1), d[2..3] = D(g+8, c..c+1).
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The A operand of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a row-major tile.
__device__ __forceinline__ void load_a_operand(uint32_t (&a)[4], const bf16 *tile, int ld, int row0, int col0,
                                               int lane) {
    ldmatrix_x4(a, tile + (row0 + (lane & 7) + (lane & 8)) * ld + col0 + (lane >> 4) * 8);
}

// The A operand of rows [m0, m0 + 16) and columns [k0, k0 + 16) of A = M^T, for a row-major [k][m]
// tile M (dS^T stored by key rows, read as dS).
__device__ __forceinline__ void load_a_operand_transposed(uint32_t (&a)[4], const bf16 *tile, int ld, int m0, int k0,
                                                          int lane) {
    ldmatrix_x4_trans(a, tile + (k0 + (lane & 7) + (lane >> 4) * 8) * ld + m0 + (lane & 8));
}

// B operands of two n8 tiles when B = M^T for a row-major [n][k] tile M (keys or queries by
// head_dim): n in [n0, n0 + 16), k in [k0, k0 + 16). b[0], b[1] serve n-tile n0; b[2], b[3] n0 + 8.
__device__ __forceinline__ void load_b_operands_nk(uint32_t (&b)[4], const bf16 *tile, int ld, int n0, int k0,
                                                   int lane) {
    ldmatrix_x4(b, tile + (n0 + (lane & 7) + (lane >> 4) * 8) * ld + k0 + (lane & 8));
}

// B operands of two n8 tiles when B is a row-major [k][n] tile itself (V, dO, Q or K with k
// running over sequence positions): k in [k0, k0 + 16), n in [n0, n0 + 16).
__device__ __forceinline__ void load_b_operands_kn(uint32_t (&b)[4], const bf16 *tile, int ld, int k0, int n0,
                                                   int lane) {
    ldmatrix_x4_trans(b, tile + (k0 + (lane & 7) + (lane & 8)) * ld + n0 + (lane >> 4) * 8);
}

// The accumulators of two adjacent 16x8 tiles (columns 0-7 and 8-15) hold exactly the elements
// of the 16x16 A operand that this thread must supply: S or dS feeds the next product directly.
__device__ __forceinline__ void accumulators_to_a_operand(uint32_t (&a)[4], const float (&left)[4],
                                                          const float (&right)[4]) {
    a[0] = pack_bf16x2(left[0], left[1]);
    a[1] = pack_bf16x2(left[2], left[3]);
    a[2] = pack_bf16x2(right[0], right[1]);
    a[3] = pack_bf16x2(right[2], right[3]);
}

// acc = A B^T for one warp: A is rows [a_row0, a_row0 + 16) of a row-major tile, B the first
// 8 N_TILES rows of another, both K_DIM wide and ld apart (S = Q K^T, dP = dO V^T, or transposed).
template <int K_DIM, int N_TILES>
__device__ __forceinline__ void warp_matmul_a_bt(float (&acc)[N_TILES][4], const bf16 *a_tile, int a_row0,
                                                 const bf16 *b_tile, int ld, int lane) {
#pragma unroll
    for (int nt = 0; nt < N_TILES; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < K_DIM / 16; kk++) {
        uint32_t a[4];
        load_a_operand(a, a_tile, ld, a_row0, kk * 16, lane);
#pragma unroll
        for (int nt = 0; nt < N_TILES; nt += 2) {
            uint32_t b[4];
            load_b_operands_nk(b, b_tile, ld, nt * 8, kk * 16, lane);
            mma_16x8x16(acc[nt], a, b[0], b[1]);
            mma_16x8x16(acc[nt + 1], a, b[2], b[3]);
        }
    }
}

// acc += X B for one warp: X (16 x 8 X_TILES) is held in FP32 accumulators, as P, dS and their
// transposes are, and rounded to BF16 on the way; B is the first 8 X_TILES rows of a row-major tile
// N_DIM wide, ld apart. With COPY_X, the BF16 X also goes to 16 shared rows x_copy_ld apart, x_copy
// pointing at this thread's element (lane / 4, 2 (lane % 4)) of them.
template <int N_DIM, int X_TILES, bool COPY_X = false>
__device__ __forceinline__ void warp_matmul_add_x_b(float (&acc)[N_DIM / 8][4], const float (&x)[X_TILES][4],
                                                    const bf16 *b_tile, int ld, int lane, bf16 *x_copy = nullptr,
                                                    int x_copy_ld = 0) {
#pragma unroll
    for (int kx = 0; kx < X_TILES / 2; kx++) {
        uint32_t xa[4];
        accumulators_to_a_operand(xa, x[2 * kx], x[2 * kx + 1]);
        if constexpr (COPY_X) {
            *reinterpret_cast<uint32_t *>(x_copy + kx * 16) = xa[0];
            *reinterpret_cast<uint32_t *>(x_copy + 8 * x_copy_ld + kx * 16) = xa[1];
            *reinterpret_cast<uint32_t *>(x_copy + kx * 16 + 8) = xa[2];
            *reinterpret_cast<uint32_t *>(x_copy + 8 * x_copy_ld + kx * 16 + 8) = xa[3];
        }
#pragma unroll
        for (int nt = 0; nt < N_DIM / 8; nt += 2) {
            uint32_t b[4];
            load_b_operands_kn(b, b_tile, ld, kx * 16, nt * 8, lane);
            mma_16x8x16(acc[nt], xa, b[0], b[1]);
            mma_16x8x16(acc[nt + 1], xa, b[2], b[3]);
        }
    }
}

// Rows [row0, row0 + ROWS) of one head (head_dim elements each, row_stride apart in global memory)
// into a padded shared tile, asynchronously, spread over the THREADS threads of the block; rows >= T
// become zeros so that no stale value (possibly NaN) can reach an mma.
template <int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void load_tile_async(bf16 *tile, const bf16 *head, size_t row_stride, int row0, int T) {
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % THREADS == 0, "tile must split evenly over the block");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; i++) {
        int chunk = i * THREADS + (int)threadIdx.x;
        int r = chunk / CHUNKS_PER_ROW, col = (chunk % CHUNKS_PER_ROW) * 8;
        bool valid = row0 + r < T;
        cp_async_16(tile + r * LD + col, head + (size_t)(valid ? row0 + r : 0) * row_stride + col, valid);
    }
}

// Rows [row0, row0 + KV_TILE) of one kv head's keys and values into two padded shared tiles,
// asynchronously, as one commit group.
template <int KV_TILE, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void load_kv_tiles_async(bf16 *k_tile, bf16 *v_tile, const bf16 *k_head, const bf16 *v_head,
                                                    size_t row_stride, int row0, int T) {
    load_tile_async<KV_TILE, HEAD_DIM, THREADS>(k_tile, k_head, row_stride, row0, T);
    load_tile_async<KV_TILE, HEAD_DIM, THREADS>(v_tile, v_head, row_stride, row0, T);
    cp_async_commit();
}

// Writes 16 x HEAD_DIM accumulators of a warp as BF16 into 16 shared rows, row g scaled by
// scale_lo and row g + 8 by scale_hi, ready for coalesced 16-byte stores.
template <int HEAD_DIM>
__device__ __forceinline__ void stage_accumulator_rows(bf16 *rows, int ld, const float (&acc)[HEAD_DIM / 8][4],
                                                       float scale_lo, float scale_hi, int lane) {
    int r = lane / 4, c = (lane % 4) * 2;
#pragma unroll
    for (int dt = 0; dt < HEAD_DIM / 8; dt++) {
        *reinterpret_cast<__nv_bfloat162 *>(rows + r * ld + dt * 8 + c) =
            __floats2bfloat162_rn(acc[dt][0] * scale_lo, acc[dt][1] * scale_lo);
        *reinterpret_cast<__nv_bfloat162 *>(rows + (r + 8) * ld + dt * 8 + c) =
            __floats2bfloat162_rn(acc[dt][2] * scale_hi, acc[dt][3] * scale_hi);
    }
}

// Copies ROWS staged shared rows of a warp to global rows first_row.. of one head, skipping rows >= T.
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void store_warp_rows(bf16 *head, size_t row_stride, int first_row, int T, const bf16 *rows,
                                                int ld, int lane) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
#pragma unroll
    for (int chunk = lane; chunk < ROWS * CHUNKS_PER_ROW; chunk += 32) {
        int r = chunk / CHUNKS_PER_ROW, col = (chunk % CHUNKS_PER_ROW) * 8;
        if (first_row + r < T) store16(head + (size_t)(first_row + r) * row_stride + col, load16(rows + r * ld + col));
    }
}

// ---- forward ------------------------------------------------------------------------------------

// A forward variant. WARPS warps per block, each owning M_TILES m16 tiles of query rows (so that
// every K or V fragment read from shared memory feeds M_TILES mma); K/V tiles of KV_TILE keys; the
// Q fragments kept in registers, or read from shared memory again for every K/V tile; MIN_BLOCKS
// per SM for __launch_bounds__, which caps registers per thread at 64K / (32 WARPS MIN_BLOCKS);
// STAGES K/V tiles in shared memory, the loads of STAGES - 1 of them in flight while one is used.
template <int WARPS, int M_TILES, int KV_TILE, bool Q_IN_REGISTERS, int MIN_BLOCKS, int STAGES = 2>
struct AttentionForwardConfig {
    static constexpr bool tma = false;  // the mma.sync kernel below; AttentionTmaForwardConfig: attention_wgmma.cuh
    static constexpr int warps = WARPS, m_tiles = M_TILES, kv_tile = KV_TILE, min_blocks = MIN_BLOCKS;
    static constexpr int stages = STAGES;
    static constexpr bool q_in_registers = Q_IN_REGISTERS;
    static constexpr int threads = WARPS * 32, q_tile = WARPS * M_TILES * 16;  // q_tile: query rows per block
};

// Block: WARPS * M_TILES * 16 query rows of head h of batch b; warp w: M_TILES * 16 consecutive rows
// of them. K/V tiles are prefetched (cp.async, STAGES stages) STAGES - 1 tiles ahead.
// Online softmax in base 2: m = running max of S log2(e), l = running sum of 2^(S log2(e) - m), O
// rescaled when m grows.
template <int HEAD_DIM, int WARPS, int M_TILES, int KV_TILE, bool Q_IN_REGISTERS, int MIN_BLOCKS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    attention_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, int T, int NH, int NKV, float softmax_scale) {
    constexpr int THREADS = WARPS * 32, WARP_ROWS = M_TILES * 16, Q_TILE = WARPS * WARP_ROWS;
    static_assert(KV_TILE % 16 == 0 && HEAD_DIM % 16 == 0, "S and P are built from 16-wide pairs of n8 tiles");
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int K_STEPS = HEAD_DIM / 16, S_TILES = KV_TILE / 8, O_TILES = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *k_tiles = q_tile + Q_TILE * LD;             // STAGES stages
    bf16 *v_tiles = k_tiles + STAGES * KV_TILE * LD;  // STAGES stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q_block = gridDim.x - 1 - blockIdx.x;  // longest causal rows first: fewer idle SMs at the end
    const int h = blockIdx.y, b = blockIdx.z;
    const int kv_head = h / (NH / NKV);
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *q_head = qkv_batch + (size_t)h * HEAD_DIM;
    const bf16 *k_head = qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM;
    const bf16 *v_head = qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM;
    const int q0 = q_block * Q_TILE;
    const int num_kv_tiles = (min(q0 + Q_TILE, T) - 1) / KV_TILE + 1;  // up to the last valid row's diagonal

    // One commit group per tile (empty past the last), so that group counts name tiles.
    auto load_kv_tile = [&](int tile) {
        if (tile < num_kv_tiles)
            load_kv_tiles_async<KV_TILE, HEAD_DIM, THREADS>(k_tiles + tile % STAGES * KV_TILE * LD,
                                                            v_tiles + tile % STAGES * KV_TILE * LD, k_head, v_head,
                                                            qkv_row, tile * KV_TILE, T);
        else
            cp_async_commit();
    };
    load_tile_async<Q_TILE, HEAD_DIM, THREADS>(q_tile, q_head, qkv_row, q0, T);  // in tile 0's group
#pragma unroll
    for (int tile = 0; tile < STAGES - 1; tile++) load_kv_tile(tile);

    const int warp_row0 = q0 + warp * WARP_ROWS;  // this thread's rows: warp_row0 + 16 mt + g (+ 8)
    const int g = lane / 4, c = (lane % 4) * 2;   // ... and columns c, c + 1 of every 8-wide tile
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    uint32_t q_frag[M_TILES][Q_IN_REGISTERS ? K_STEPS : 1][4];
    float o_acc[M_TILES][O_TILES][4];
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int dt = 0; dt < O_TILES; dt++)
            o_acc[mt][dt][0] = o_acc[mt][dt][1] = o_acc[mt][dt][2] = o_acc[mt][dt][3] = 0.f;
    // Tile 0 holds key 0, which every row sees, so the running max is finite after it and
    // 2^(m_old - m_new) never meets -inf - -inf. [mt][r]: row 16 mt + g + 8 r of the warp.
    float row_max[M_TILES][2], row_sum[M_TILES][2];
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
        for (int r = 0; r < 2; r++) {
            row_max[mt][r] = -INFINITY;
            row_sum[mt][r] = 0.f;
        }

    for (int j = 0; j < num_kv_tiles; j++) {
        cp_async_wait_pending<STAGES - 2>();
        __syncthreads();  // tile j visible to all; everyone is done with tile j - 1, whose stage is refilled below
        if constexpr (Q_IN_REGISTERS) {
            if (j == 0) {
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
                    for (int kk = 0; kk < K_STEPS; kk++)
                        load_a_operand(q_frag[mt][kk], q_tile, LD, warp * WARP_ROWS + mt * 16, kk * 16, lane);
            }
        }
        load_kv_tile(j + STAGES - 1);
        const int kv0 = j * KV_TILE;
        if (kv0 > warp_row0 + WARP_ROWS - 1) continue;  // the whole tile lies right of this warp's diagonal
        const bf16 *k_cur = k_tiles + j % STAGES * KV_TILE * LD;
        const bf16 *v_cur = v_tiles + j % STAGES * KV_TILE * LD;

        float s[M_TILES][S_TILES][4];
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K_STEPS; kk++) {
            uint32_t qa[M_TILES][4];
#pragma unroll
            for (int mt = 0; mt < M_TILES; mt++) {
                if constexpr (Q_IN_REGISTERS) {
#pragma unroll
                    for (int i = 0; i < 4; i++) qa[mt][i] = q_frag[mt][kk][i];
                } else {
                    load_a_operand(qa[mt], q_tile, LD, warp * WARP_ROWS + mt * 16, kk * 16, lane);
                }
            }
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt += 2) {
                uint32_t kb[4];
                load_b_operands_nk(kb, k_cur, LD, nt * 8, kk * 16, lane);
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++) {
                    mma_16x8x16(s[mt][nt], qa[mt], kb[0], kb[1]);
                    mma_16x8x16(s[mt][nt + 1], qa[mt], kb[2], kb[3]);
                }
            }
        }
        if (kv0 + KV_TILE - 1 > warp_row0) {  // the tile crosses this warp's diagonal
#pragma unroll
            for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
                for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        if (kv0 + nt * 8 + c + (e & 1) > warp_row0 + mt * 16 + g + (e >> 1) * 8)
                            s[mt][nt][e] = -INFINITY;
        }
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
            for (int r = 0; r < 2; r++) {  // r = 0: row g, r = 1: row g + 8
                float tile_max = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < S_TILES; nt++)
                    tile_max = fmaxf(tile_max, fmaxf(s[mt][nt][2 * r], s[mt][nt][2 * r + 1]));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));  // the 4 threads of a row
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
                float new_max = fmaxf(row_max[mt][r], tile_max * scale_log2);
                float correction = exp2_approx(row_max[mt][r] - new_max);
                row_max[mt][r] = new_max;
                row_sum[mt][r] *= correction;  // a per-thread partial sum: the 4 partials are added at the end
#pragma unroll
                for (int dt = 0; dt < O_TILES; dt++) {
                    o_acc[mt][dt][2 * r] *= correction;
                    o_acc[mt][dt][2 * r + 1] *= correction;
                }
#pragma unroll
                for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; e++) {
                        float p = exp2_approx(fmaf(s[mt][nt][e], scale_log2, -new_max));
                        s[mt][nt][e] = p;
                        row_sum[mt][r] += p;
                    }
            }
        uint32_t p_frag[M_TILES][KV_TILE / 16][4];  // P as BF16 A operands: half the registers of S
#pragma unroll
        for (int mt = 0; mt < M_TILES; mt++)
#pragma unroll
            for (int kk = 0; kk < KV_TILE / 16; kk++)
                accumulators_to_a_operand(p_frag[mt][kk], s[mt][2 * kk], s[mt][2 * kk + 1]);
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) {
#pragma unroll
            for (int dt = 0; dt < O_TILES; dt += 2) {
                uint32_t vb[4];
                load_b_operands_kn(vb, v_cur, LD, kk * 16, dt * 8, lane);
#pragma unroll
                for (int mt = 0; mt < M_TILES; mt++) {
                    mma_16x8x16(o_acc[mt][dt], p_frag[mt][kk], vb[0], vb[1]);
                    mma_16x8x16(o_acc[mt][dt + 1], p_frag[mt][kk], vb[2], vb[3]);
                }
            }
        }
    }

    // The warp's own Q rows are free now (only this warp ever read them) and take its output.
#pragma unroll
    for (int mt = 0; mt < M_TILES; mt++) {
        float inv_sum[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            float sum = row_sum[mt][r];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            inv_sum[r] = 1.f / sum;
            int row = warp_row0 + mt * 16 + g + 8 * r;
            // lse = ln(2^m l) = (m + log2 l) ln 2
            if (lane % 4 == 0 && row < T)
                lse[((size_t)b * NH + h) * T + row] = (row_max[mt][r] + log2f(sum)) * ATTENTION_LN2;
        }
        stage_accumulator_rows<HEAD_DIM>(q_tile + (warp * WARP_ROWS + mt * 16) * LD, LD, o_acc[mt], inv_sum[0],
                                         inv_sum[1], lane);
    }
    __syncwarp();
    store_warp_rows<WARP_ROWS, HEAD_DIM>(out + ((size_t)b * T * NH + h) * HEAD_DIM, (size_t)NH * HEAD_DIM, warp_row0, T,
                                         q_tile + warp * WARP_ROWS * LD, LD, lane);
}

// ---- backward -----------------------------------------------------------------------------------

// Issues the loads of one step (a query tile of Q_TILE rows of one query head) into a stage, spread
// over the THREADS threads of the block, and returns this thread's row statistics for row
// q0 + threadIdx.x, stored by the caller: lse in log2 units and D. Rows past T get lse = +inf, so
// that their P is exactly 0, and D = 0.
template <int HEAD_DIM, int Q_TILE, int THREADS>
__device__ __forceinline__ void backward_load_step(bf16 *q_dst, bf16 *dout_dst, float *lse_log2, float *delta_value,
                                                   const bf16 *q_head, size_t qkv_row, const bf16 *dout_head,
                                                   size_t dout_row, const float *lse_head, const float *delta_head,
                                                   int q0, int T) {
    load_tile_async<Q_TILE, HEAD_DIM, THREADS>(q_dst, q_head, qkv_row, q0, T);
    load_tile_async<Q_TILE, HEAD_DIM, THREADS>(dout_dst, dout_head, dout_row, q0, T);
    cp_async_commit();
    int q = q0 + (int)threadIdx.x;
    bool valid = (int)threadIdx.x < Q_TILE && q < T;
    *lse_log2 = valid ? lse_head[q] * ATTENTION_LOG2E : INFINITY;
    *delta_value = valid ? delta_head[q] : 0.f;
}

// The query-tile steps of a kv block of the backward (attention_backward_dkdv_kernel and the one-pass
// kernel): step t is query tile first_q_tile + t % q_tiles_per_head of query head
// kv_head * group + t / q_tiles_per_head, its Q, dO, lse and D in stage t % STAGES.
template <int HEAD_DIM, int Q_TILE, int THREADS, int STAGES>
struct BackwardSteps {
    static constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    bf16 *q_tiles, *dout_tiles;
    float *lse_tiles, *delta_tiles;  // lse in log2 units
    const bf16 *qkv_batch, *dout_batch;
    const float *lse_batch, *delta_batch;
    size_t qkv_row, dout_row;
    int T, kv_head, group, first_q_tile, q_tiles_per_head, steps;

    // Issues the loads of step t into its stage (one commit group, empty past the last step) and
    // returns the step's lse and D of row threadIdx.x, stored once the stage's previous step is done.
    __device__ __forceinline__ void load(int t, float *lse_log2, float *delta_value) const {
        *lse_log2 = INFINITY;
        *delta_value = 0.f;
        if (t >= steps) {
            cp_async_commit();
            return;
        }
        int head = kv_head * group + t / q_tiles_per_head, q0 = (first_q_tile + t % q_tiles_per_head) * Q_TILE;
        backward_load_step<HEAD_DIM, Q_TILE, THREADS>(
            q_tiles + t % STAGES * Q_TILE * LD, dout_tiles + t % STAGES * Q_TILE * LD, lse_log2, delta_value,
            qkv_batch + (size_t)head * HEAD_DIM, qkv_row, dout_batch + (size_t)head * HEAD_DIM, dout_row,
            lse_batch + (size_t)head * T, delta_batch + (size_t)head * T, q0, T);
    }
    __device__ __forceinline__ void store_stats(int t, float lse_log2, float delta_value) const {
        if ((int)threadIdx.x < Q_TILE) {
            lse_tiles[t % STAGES * Q_TILE + threadIdx.x] = lse_log2;
            delta_tiles[t % STAGES * Q_TILE + threadIdx.x] = delta_value;
        }
    }
};

// P^T for the 16 keys warp_kv0.. of a warp (rows 16 warp.. of k_tile) and the queries q0.. of the
// step (columns): S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse log2 e), 0 where the key comes after
// the query. lse_log2: the step's lse per query, in log2 units. g = lane / 4 and c = 2 (lane % 4)
// place this thread in each accumulator tile: keys g, g + 8, queries c, c + 1.
template <int HEAD_DIM, int Q_TILE>
__device__ __forceinline__ void backward_probabilities_transposed(float (&pt)[Q_TILE / 8][4], const bf16 *k_tile,
                                                                  const bf16 *q_tile, const float *lse_log2,
                                                                  float scale_log2, int warp, int warp_kv0, int q0,
                                                                  int lane, int g, int c) {
    constexpr int S_TILES = Q_TILE / 8;
    warp_matmul_a_bt<HEAD_DIM>(pt, k_tile, warp * 16, q_tile, HEAD_DIM + ATTENTION_SMEM_PAD, lane);
    const bool crosses_diagonal = warp_kv0 + 15 > q0;
#pragma unroll
    for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int q_local = nt * 8 + c + (e & 1);
            float p = exp2_approx(fmaf(pt[nt][e], scale_log2, -lse_log2[q_local]));
            pt[nt][e] = crosses_diagonal && warp_kv0 + g + (e >> 1) * 8 > q0 + q_local ? 0.f : p;
        }
}

// dS^T = P^T (dP^T - D) for the same keys and queries, with dP^T = V dO^T (rows 16 warp.. of
// v_tile); delta: the step's D per query.
template <int HEAD_DIM, int Q_TILE>
__device__ __forceinline__ void backward_ds_transposed(float (&dst)[Q_TILE / 8][4], const float (&pt)[Q_TILE / 8][4],
                                                       const bf16 *v_tile, const bf16 *dout_tile, const float *delta,
                                                       int warp, int lane, int c) {
    constexpr int S_TILES = Q_TILE / 8;
    warp_matmul_a_bt<HEAD_DIM>(dst, v_tile, warp * 16, dout_tile, HEAD_DIM + ATTENTION_SMEM_PAD, lane);
#pragma unroll
    for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dst[nt][e] = pt[nt][e] * (dst[nt][e] - delta[nt * 8 + c + (e & 1)]);
}

// Writes a warp's 16 rows of dK (times softmax_scale) and dV, key rows warp_kv0.. (rows >= T
// skipped), staged as BF16 in k_rows and v_rows: its own rows of the K and V tiles, read by no one now.
template <int HEAD_DIM>
__device__ __forceinline__ void backward_store_dk_dv(bf16 *dk_head, bf16 *dv_head, size_t row_stride, int warp_kv0,
                                                     int T, bf16 *k_rows, bf16 *v_rows,
                                                     const float (&dk_acc)[HEAD_DIM / 8][4],
                                                     const float (&dv_acc)[HEAD_DIM / 8][4], float softmax_scale,
                                                     int lane) {
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    stage_accumulator_rows<HEAD_DIM>(k_rows, LD, dk_acc, softmax_scale, softmax_scale, lane);
    stage_accumulator_rows<HEAD_DIM>(v_rows, LD, dv_acc, 1.f, 1.f, lane);
    __syncwarp();
    store_warp_rows<16, HEAD_DIM>(dk_head, row_stride, warp_kv0, T, k_rows, LD, lane);
    store_warp_rows<16, HEAD_DIM>(dv_head, row_stride, warp_kv0, T, v_rows, LD, lane);
}

// ---- backward in two passes: dK/dV pass, then dQ pass -------------------------------------------

// A dK/dV pass variant: WARPS warps own 16 WARPS key rows, walking query tiles of Q_TILE rows;
// MIN_BLOCKS per SM for __launch_bounds__; STAGES query tiles (Q, dO, lse, D) in shared memory.
template <int WARPS, int Q_TILE, int MIN_BLOCKS, int STAGES = 2>
struct AttentionDkDvConfig {
    static constexpr int warps = WARPS, q_tile = Q_TILE, min_blocks = MIN_BLOCKS, stages = STAGES;
};

// Block: 16 WARPS key rows of kv head kv_head of batch b; warp w: rows 16w..16w+15. For every query
// head of the group and every query tile of Q_TILE rows from the diagonal on (Q, dO, lse, D in
// STAGES stages, loaded STAGES - 1 steps ahead):
//   S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse log2 e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
// Computing the transposes keeps key rows in the accumulators' rows, so P^T and dS^T feed the
// dV and dK products straight from registers.
template <int HEAD_DIM, int WARPS, int Q_TILE, int MIN_BLOCKS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    attention_backward_dkdv_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse, const float *delta,
                                   int T, int NH, int NKV, float softmax_scale) {
    constexpr int THREADS = WARPS * 32, KV_TILE = WARPS * 16;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int S_TILES = Q_TILE / 8, D_TILES = HEAD_DIM / 8;
    static_assert(KV_TILE % Q_TILE == 0, "a key block must start on a query tile boundary");
    static_assert(Q_TILE % 16 == 0 && Q_TILE <= THREADS,
                  "16-wide pairs of n8 tiles; one thread loads each row's lse and D");
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *k_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *v_tile = k_tile + KV_TILE * LD;
    bf16 *q_tiles = v_tile + KV_TILE * LD;                                            // STAGES stages
    bf16 *dout_tiles = q_tiles + STAGES * Q_TILE * LD;                                // STAGES stages
    float *lse_tiles = reinterpret_cast<float *>(dout_tiles + STAGES * Q_TILE * LD);  // log2 units
    float *delta_tiles = lse_tiles + STAGES * Q_TILE;

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv0 = blockIdx.x * KV_TILE, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = NH / NKV;
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM, dout_row = (size_t)NH * HEAD_DIM;
    bf16 *dqkv_batch = dqkv + (size_t)b * T * qkv_row;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *dout_batch = dout + (size_t)b * T * dout_row;
    const float *lse_batch = lse + (size_t)b * NH * T, *delta_batch = delta + (size_t)b * NH * T;
    const int first_q_tile = kv0 / Q_TILE;  // earlier queries see none of these keys
    const int q_tiles_per_head = ceil_div(T, Q_TILE) - first_q_tile;
    const int steps = group * q_tiles_per_head;  // step i: head kv_head * group + i / q_tiles_per_head

    const BackwardSteps<HEAD_DIM, Q_TILE, THREADS, STAGES> query_steps = {
        q_tiles, dout_tiles, lse_tiles, delta_tiles, qkv_batch, dout_batch, lse_batch, delta_batch,
        qkv_row, dout_row, T, kv_head, group, first_q_tile, q_tiles_per_head, steps};
    load_tile_async<KV_TILE, HEAD_DIM, THREADS>(k_tile, qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row, kv0, T);
    load_tile_async<KV_TILE, HEAD_DIM, THREADS>(v_tile, qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row,
                                                kv0, T);  // K and V in step 0's group
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) {
        float lse_log2, delta_value;
        query_steps.load(t, &lse_log2, &delta_value);
        query_steps.store_stats(t, lse_log2, delta_value);
    }

    const int warp_kv0 = kv0 + warp * 16;        // this thread's keys: warp_kv0 + g and + g + 8
    const int g = lane / 4, c = (lane % 4) * 2;  // ... and queries c, c + 1 of every 8-wide tile
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float dk_acc[D_TILES][4], dv_acc[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;

    for (int step = 0; step < steps; step++) {
        cp_async_wait_pending<STAGES - 2>();
        __syncthreads();  // this step's tiles visible to all; everyone is done with the previous step,
                          // whose stage is refilled below
        const int stage = step % STAGES;
        float next_lse_log2, next_delta;
        query_steps.load(step + STAGES - 1, &next_lse_log2, &next_delta);
        const int q0 = (first_q_tile + step % q_tiles_per_head) * Q_TILE;
        // Skip when all of the warp's keys lie past T or after the tile's last query.
        if (warp_kv0 < T && warp_kv0 <= q0 + Q_TILE - 1) {
            const bf16 *q_cur = q_tiles + stage * Q_TILE * LD;
            const bf16 *dout_cur = dout_tiles + stage * Q_TILE * LD;
            const float *lse_cur = lse_tiles + stage * Q_TILE;
            const float *delta_cur = delta_tiles + stage * Q_TILE;

            float pt[S_TILES][4], dst[S_TILES][4];  // P^T and dS^T: key rows x query columns
            backward_probabilities_transposed<HEAD_DIM, Q_TILE>(pt, k_tile, q_cur, lse_cur, scale_log2, warp, warp_kv0,
                                                                q0, lane, g, c);
            warp_matmul_add_x_b<HEAD_DIM>(dv_acc, pt, dout_cur, LD, lane);  // dV += P^T dO
            backward_ds_transposed<HEAD_DIM, Q_TILE>(dst, pt, v_tile, dout_cur, delta_cur, warp, lane, c);
            warp_matmul_add_x_b<HEAD_DIM>(dk_acc, dst, q_cur, LD, lane);  // dK += dS^T Q (scaled at the end)
        }
        query_steps.store_stats(step + STAGES - 1, next_lse_log2, next_delta);
    }

    // The warp's own K and V rows are free now, and no other warp ever reads them.
    backward_store_dk_dv<HEAD_DIM>(
        dqkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, dqkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row,
        warp_kv0, T, k_tile + warp * 16 * LD, v_tile + warp * 16 * LD, dk_acc, dv_acc, softmax_scale, lane);
}

// A dQ pass variant: WARPS warps own 16 WARPS query rows, walking K/V tiles of KV_TILE keys;
// MIN_BLOCKS per SM for __launch_bounds__; STAGES K/V tiles in shared memory.
template <int WARPS, int KV_TILE, int MIN_BLOCKS, int STAGES = 2>
struct AttentionDqConfig {
    static constexpr int warps = WARPS, kv_tile = KV_TILE, min_blocks = MIN_BLOCKS, stages = STAGES;
};

// Block: 16 WARPS query rows of head h of batch b (Q and dO resident), walking the K/V tiles up to
// the diagonal like the forward pass: S = Q K^T, P = 2^(S scale log2 e - lse log2 e), dP = dO V^T,
// dS = P (dP - D), dQ += dS K.
template <int HEAD_DIM, int WARPS, int KV_TILE, int MIN_BLOCKS, int STAGES>
__global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS)
    attention_backward_dq_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse, const float *delta,
                                 int T, int NH, int NKV, float softmax_scale) {
    constexpr int THREADS = WARPS * 32, Q_TILE = WARPS * 16;
    static_assert(KV_TILE % 16 == 0, "S and P are built from 16-wide pairs of n8 tiles");
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int S_TILES = KV_TILE / 8, D_TILES = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *dout_tile = q_tile + Q_TILE * LD;
    bf16 *k_tiles = dout_tile + Q_TILE * LD;          // STAGES stages
    bf16 *v_tiles = k_tiles + STAGES * KV_TILE * LD;  // STAGES stages

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int q_block = gridDim.x - 1 - blockIdx.x;  // longest causal rows first
    const int h = blockIdx.y, b = blockIdx.z;
    const int kv_head = h / (NH / NKV);
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM, dout_row = (size_t)NH * HEAD_DIM;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *k_head = qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM;
    const bf16 *v_head = qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM;
    const int q0 = q_block * Q_TILE;
    const int num_kv_tiles = (min(q0 + Q_TILE, T) - 1) / KV_TILE + 1;

    auto load_kv_tile = [&](int tile) {  // one commit group per tile, empty past the last
        if (tile < num_kv_tiles)
            load_kv_tiles_async<KV_TILE, HEAD_DIM, THREADS>(k_tiles + tile % STAGES * KV_TILE * LD,
                                                            v_tiles + tile % STAGES * KV_TILE * LD, k_head, v_head,
                                                            qkv_row, tile * KV_TILE, T);
        else
            cp_async_commit();
    };
    load_tile_async<Q_TILE, HEAD_DIM, THREADS>(q_tile, qkv_batch + (size_t)h * HEAD_DIM, qkv_row, q0, T);
    load_tile_async<Q_TILE, HEAD_DIM, THREADS>(dout_tile, dout + (size_t)b * T * dout_row + (size_t)h * HEAD_DIM,
                                               dout_row, q0, T);  // Q and dO in tile 0's group
#pragma unroll
    for (int tile = 0; tile < STAGES - 1; tile++) load_kv_tile(tile);

    const int warp_row0 = q0 + warp * 16;
    const int g = lane / 4, c = (lane % 4) * 2;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float row_lse_log2[2], row_delta[2];  // rows g and g + 8
    attention_dq_row_statistics(row_lse_log2, row_delta, lse, delta, b, h, NH, T, warp_row0 + g);
    float dq_acc[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; dt++) dq_acc[dt][0] = dq_acc[dt][1] = dq_acc[dt][2] = dq_acc[dt][3] = 0.f;

    for (int j = 0; j < num_kv_tiles; j++) {
        cp_async_wait_pending<STAGES - 2>();
        __syncthreads();  // tile j visible to all; everyone is done with tile j - 1, whose stage is refilled below
        load_kv_tile(j + STAGES - 1);
        const int kv0 = j * KV_TILE;
        if (kv0 > warp_row0 + 15) continue;  // the whole tile lies right of this warp's diagonal
        const bf16 *k_cur = k_tiles + j % STAGES * KV_TILE * LD;
        const bf16 *v_cur = v_tiles + j % STAGES * KV_TILE * LD;

        float p[S_TILES][4];  // S, then P
        warp_matmul_a_bt<HEAD_DIM>(p, q_tile, warp * 16, k_cur, LD, lane);
        const bool crosses_diagonal = kv0 + KV_TILE - 1 > warp_row0;
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float prob = exp2_approx(fmaf(p[nt][e], scale_log2, -row_lse_log2[e >> 1]));
                p[nt][e] = crosses_diagonal && kv0 + nt * 8 + c + (e & 1) > warp_row0 + g + (e >> 1) * 8 ? 0.f : prob;
            }
        float ds[S_TILES][4];  // dP, then dS
        warp_matmul_a_bt<HEAD_DIM>(ds, dout_tile, warp * 16, v_cur, LD, lane);
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) ds[nt][e] = p[nt][e] * (ds[nt][e] - row_delta[e >> 1]);
        warp_matmul_add_x_b<HEAD_DIM>(dq_acc, ds, k_cur, LD, lane);  // dQ += dS K (scaled at the end)
    }

    // The warp's own Q rows are free now, and no other warp ever reads them.
    bf16 *rows = q_tile + warp * 16 * LD;
    stage_accumulator_rows<HEAD_DIM>(rows, LD, dq_acc, softmax_scale, softmax_scale, lane);
    __syncwarp();
    store_warp_rows<16, HEAD_DIM>(dqkv + (size_t)b * T * qkv_row + (size_t)h * HEAD_DIM, qkv_row, warp_row0, T, rows,
                                  LD, lane);
}

// ---- backward in one pass ------------------------------------------------------------------------

// Flags between blocks (GPU scope) and the copy engine's bulk copies from shared to global memory.
__device__ __forceinline__ int load_acquire_gpu(const int *p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n" : "=r"(v) : "l"(__cvta_generic_to_global(p)) : "memory");
    return v;
}
__device__ __forceinline__ void store_release_gpu(int *p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;\n" ::"l"(__cvta_generic_to_global(p)), "r"(v) : "memory");
}
// Orders this thread's ordinary shared-memory writes (and completed cp.async) before later reads of
// them through the async proxy: the copy engine's bulk copies, and wgmma.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Orders global-memory accesses of the copy engine and of ordinary loads and stores of this thread.
__device__ __forceinline__ void fence_global_for_copy_engine() {
    asm volatile("fence.proxy.async.global;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_copy_to_global(float *dst, const float *src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n" ::"l"(__cvta_generic_to_global(dst)),
                 "r"(shared_address(src)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_add_to_global(float *dst, const float *src, uint32_t bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(
                     __cvta_generic_to_global(dst)),
                 "r"(shared_address(src)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }

// Thread 0 only. Once `turn` kv blocks have added their shares to the dQ slot (done == turn), hands
// this block's share, staged in shared memory, to the copy engine: the first share is written, the
// later ones added in FP32. The fixed turns make the sums bitwise reproducible.
__device__ __forceinline__ void dq_share_issue(float *slot, const float *staged, uint32_t bytes, const int *done,
                                               int turn) {
    while (load_acquire_gpu(done) != turn) __nanosleep(100);
    fence_global_for_copy_engine();
    if (turn == 0)
        bulk_copy_to_global(slot, staged, bytes);
    else
        bulk_add_to_global(slot, staged, bytes);
    bulk_commit();
}
// Thread 0 only: waits until the copy engine has finished with the share (the staging buffer is
// free again and the slot updated), then gives the slot to the next kv block.
__device__ __forceinline__ void dq_share_release(int *done, int turn) {
    bulk_wait_all();
    fence_global_for_copy_engine();
    store_release_gpu(done, turn + 1);
}

// Shared memory of the one-pass backward kernel, in bytes from the start (each offset a multiple of 16).
template <int HEAD_DIM, int STAGES>
struct AttentionBackwardSmem {
    static constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;                      // K, V, Q, dO rows
    static constexpr int DS_LD = ATTENTION_ONE_PASS_Q_TILE + ATTENTION_SMEM_PAD;  // dS^T rows
    static constexpr size_t kv_bytes = (size_t)ATTENTION_ONE_PASS_KV_TILE * LD * sizeof(bf16);
    static constexpr size_t q_bytes = (size_t)ATTENTION_ONE_PASS_Q_TILE * LD * sizeof(bf16);
    static constexpr size_t k_tile = 0, v_tile = k_tile + kv_bytes;
    static constexpr size_t q_tiles = v_tile + kv_bytes;              // STAGES stages
    static constexpr size_t dout_tiles = q_tiles + STAGES * q_bytes;  // STAGES stages
    static constexpr size_t ds_tile = dout_tiles + STAGES * q_bytes;
    static constexpr size_t dq_staged = ds_tile + (size_t)ATTENTION_ONE_PASS_KV_TILE * DS_LD * sizeof(bf16);
    static constexpr size_t lse_tiles = dq_staged + (size_t)ATTENTION_ONE_PASS_Q_TILE * HEAD_DIM * sizeof(float);
    static constexpr size_t delta_tiles = lse_tiles + STAGES * ATTENTION_ONE_PASS_Q_TILE * sizeof(float);
    static constexpr size_t ticket = delta_tiles + STAGES * ATTENTION_ONE_PASS_Q_TILE * sizeof(float);
    static constexpr size_t bytes = ticket + 16;
};

// The dQ slot of (batch b, query head h, query tile): Q_TILE x HEAD_DIM floats in the order the
// warps hold them (see attention_backward_dq_from_slots_kernel), so that staging and adding are
// plain copies.
template <int HEAD_DIM>
__host__ __device__ __forceinline__ size_t attention_dq_slot(int b, int h, int tile, int NH, int num_q_tiles) {
    return (((size_t)b * NH + h) * num_q_tiles + tile) * ATTENTION_ONE_PASS_Q_TILE * HEAD_DIM;
}

// Block: 128 key rows kv0.. of kv head kv_head of batch b; warp w: rows 16w..16w+15 (dK, dV in its
// registers). For every query head of the group (outer) and every query tile from the diagonal on
// (inner; Q, dO, lse, D in STAGES stages, loaded STAGES - 1 steps ahead):
//   S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse log2 e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q,
//   dS^T to shared memory, then this block's share of the tile's dQ: dS K over its 128 keys.
// The share goes to its slot through the copy engine after the shares of all higher kv blocks
// (the slot's flag counts them), one step late so that the wait overlaps the next step's work.
// Blocks take their kv block from a counter, one head group after another and inside a group from
// the last kv block down: a block only ever waits on blocks that started before it, and those
// are ahead by two query tiles per head (the diagonal moves by a kv block), so it rarely waits.
template <int HEAD_DIM, int MIN_BLOCKS, int STAGES>
__global__ void __launch_bounds__(ATTENTION_ONE_PASS_THREADS, MIN_BLOCKS)
    attention_backward_one_pass_kernel(bf16 *dqkv, float *dq_slots, int *dq_done, int *block_counter, const bf16 *qkv,
                                       const bf16 *dout, const float *lse, const float *delta, int T, int NH, int NKV,
                                       float softmax_scale) {
    typedef AttentionBackwardSmem<HEAD_DIM, STAGES> Smem;
    constexpr int KV_TILE = ATTENTION_ONE_PASS_KV_TILE, Q_TILE = ATTENTION_ONE_PASS_Q_TILE;
    constexpr int LD = Smem::LD, DS_LD = Smem::DS_LD;
    constexpr int S_TILES = Q_TILE / 8, D_TILES = HEAD_DIM / 8;
    // dQ share: warp w computes query rows 32 (w % 2).. + 31 and columns (w / 2) DQ_COLS.. of the tile.
    constexpr int DQ_COLS = HEAD_DIM / 4, DQ_N_TILES = DQ_COLS / 8;
    constexpr uint32_t DQ_SLOT_BYTES = Q_TILE * HEAD_DIM * sizeof(float);
    static_assert(ATTENTION_ONE_PASS_WARPS == 8 && Q_TILE == 64, "the dQ share splits 64 x HEAD_DIM over 2 x 4 warps");
    static_assert(DQ_N_TILES % 2 == 0, "a warp's dQ columns are 16-wide pairs of n8 tiles");
    static_assert(KV_TILE % Q_TILE == 0, "a key block must start on a query tile boundary");
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *k_tile = reinterpret_cast<bf16 *>(attention_smem + Smem::k_tile);
    bf16 *v_tile = reinterpret_cast<bf16 *>(attention_smem + Smem::v_tile);
    bf16 *q_tiles = reinterpret_cast<bf16 *>(attention_smem + Smem::q_tiles);
    bf16 *dout_tiles = reinterpret_cast<bf16 *>(attention_smem + Smem::dout_tiles);
    bf16 *ds_tile = reinterpret_cast<bf16 *>(attention_smem + Smem::ds_tile);
    float *dq_staged = reinterpret_cast<float *>(attention_smem + Smem::dq_staged);
    float *lse_tiles = reinterpret_cast<float *>(attention_smem + Smem::lse_tiles);  // log2 units
    float *delta_tiles = reinterpret_cast<float *>(attention_smem + Smem::delta_tiles);
    int *ticket_slot = reinterpret_cast<int *>(attention_smem + Smem::ticket);

    if (threadIdx.x == 0) *ticket_slot = atomicAdd(block_counter, 1);
    __syncthreads();
    const int ticket = *ticket_slot;
    const int num_kv_blocks = ceil_div(T, KV_TILE), num_q_tiles = ceil_div(T, Q_TILE);
    const int kv_block = num_kv_blocks - 1 - ticket % num_kv_blocks;
    const int kv_head = (ticket / num_kv_blocks) % NKV, b = ticket / num_kv_blocks / NKV;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int kv0 = kv_block * KV_TILE;
    const int group = NH / NKV;
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM, dout_row = (size_t)NH * HEAD_DIM;
    bf16 *dqkv_batch = dqkv + (size_t)b * T * qkv_row;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *dout_batch = dout + (size_t)b * T * dout_row;
    const float *lse_batch = lse + (size_t)b * NH * T, *delta_batch = delta + (size_t)b * NH * T;
    const int first_q_tile = kv0 / Q_TILE;  // earlier queries see none of these keys
    const int q_tiles_per_head = num_q_tiles - first_q_tile;
    const int steps = group * q_tiles_per_head;  // step i: head kv_head * group + i / q_tiles_per_head

    const BackwardSteps<HEAD_DIM, Q_TILE, ATTENTION_ONE_PASS_THREADS, STAGES> query_steps = {
        q_tiles, dout_tiles, lse_tiles, delta_tiles, qkv_batch, dout_batch, lse_batch, delta_batch,
        qkv_row, dout_row, T, kv_head, group, first_q_tile, q_tiles_per_head, steps};
    load_tile_async<KV_TILE, HEAD_DIM, ATTENTION_ONE_PASS_THREADS>(
        k_tile, qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row, kv0, T);
    load_tile_async<KV_TILE, HEAD_DIM, ATTENTION_ONE_PASS_THREADS>(
        v_tile, qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row, kv0, T);  // in step 0's group
#pragma unroll
    for (int t = 0; t < STAGES - 1; t++) {
        float lse_log2, delta_value;
        query_steps.load(t, &lse_log2, &delta_value);
        query_steps.store_stats(t, lse_log2, delta_value);
    }

    const int warp_kv0 = kv0 + warp * 16;        // this thread's keys: warp_kv0 + g and + g + 8
    const int g = lane / 4, c = (lane % 4) * 2;  // ... and queries c, c + 1 of every 8-wide tile
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float dk_acc[D_TILES][4], dv_acc[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; dt++)
#pragma unroll
        for (int e = 0; e < 4; e++) dk_acc[dt][e] = dv_acc[dt][e] = 0.f;
    // The tile's dQ slot and flag, and this block's turn there (thread 0 uses them one step late).
    float *slot = nullptr;
    int *done = nullptr;
    int turn = 0;

    for (int step = 0; step < steps; step++) {
        cp_async_wait_pending<STAGES - 2>();
        __syncthreads();  // this step's tiles visible to all; everyone is done with the previous step, whose
                          // stage is refilled below, and its dQ share is staged
        if (threadIdx.x == 0 && step > 0) dq_share_issue(slot, dq_staged, DQ_SLOT_BYTES, done, turn);
        const int stage = step % STAGES;
        float next_lse_log2, next_delta;
        query_steps.load(step + STAGES - 1, &next_lse_log2, &next_delta);
        const int head = kv_head * group + step / q_tiles_per_head;
        const int q_tile_index = first_q_tile + step % q_tiles_per_head;
        const int q0 = q_tile_index * Q_TILE;
        const bf16 *q_cur = q_tiles + stage * Q_TILE * LD;
        // Warps whose keys all lie past T or after the tile's last query have nothing to add; they
        // are the last ones, so the active warps' keys are rows 0 .. 16 active_warps - 1.
        const int active_warps = min(min(ATTENTION_ONE_PASS_WARPS, ceil_div(T - kv0, 16)), (q0 + Q_TILE - kv0) / 16);
        if (warp < active_warps) {
            const bf16 *dout_cur = dout_tiles + stage * Q_TILE * LD;
            const float *lse_cur = lse_tiles + stage * Q_TILE;
            const float *delta_cur = delta_tiles + stage * Q_TILE;

            float pt[S_TILES][4], dst[S_TILES][4];  // P^T and dS^T: key rows x query columns
            backward_probabilities_transposed<HEAD_DIM, Q_TILE>(pt, k_tile, q_cur, lse_cur, scale_log2, warp, warp_kv0,
                                                                q0, lane, g, c);
            warp_matmul_add_x_b<HEAD_DIM>(dv_acc, pt, dout_cur, LD, lane);  // dV += P^T dO
            backward_ds_transposed<HEAD_DIM, Q_TILE>(dst, pt, v_tile, dout_cur, delta_cur, warp, lane, c);
            // dK += dS^T Q (scaled at the end), and dS^T to shared memory for the dQ share
            warp_matmul_add_x_b<HEAD_DIM, S_TILES, true>(dk_acc, dst, q_cur, LD, lane,
                                                         ds_tile + (warp * 16 + g) * DS_LD + c, DS_LD);
        }
        if (threadIdx.x == 0 && step > 0) dq_share_release(done, turn);
        __syncthreads();  // dS^T complete; the copy engine is done with the staging buffer

        // This block's share of dQ for the tile: dS (queries x its active keys) times K.
        float dq[2][DQ_N_TILES][4];
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < DQ_N_TILES; nt++) dq[mt][nt][0] = dq[mt][nt][1] = dq[mt][nt][2] = dq[mt][nt][3] = 0.f;
        const int dq_row0 = (warp % 2) * 32, dq_col0 = (warp / 2) * DQ_COLS;
        for (int kk = 0; kk < active_warps; kk++) {
            uint32_t dsa[2][4];
            load_a_operand_transposed(dsa[0], ds_tile, DS_LD, dq_row0, kk * 16, lane);
            load_a_operand_transposed(dsa[1], ds_tile, DS_LD, dq_row0 + 16, kk * 16, lane);
#pragma unroll
            for (int nt = 0; nt < DQ_N_TILES; nt += 2) {
                uint32_t kb[4];
                load_b_operands_kn(kb, k_tile, LD, kk * 16, dq_col0 + nt * 8, lane);
#pragma unroll
                for (int mt = 0; mt < 2; mt++) {
                    mma_16x8x16(dq[mt][nt], dsa[mt], kb[0], kb[1]);
                    mma_16x8x16(dq[mt][nt + 1], dsa[mt], kb[2], kb[3]);
                }
            }
        }
        float4 *staged = reinterpret_cast<float4 *>(dq_staged);
#pragma unroll
        for (int mt = 0; mt < 2; mt++)
#pragma unroll
            for (int nt = 0; nt < DQ_N_TILES; nt++)
                staged[((warp * 2 + mt) * DQ_N_TILES + nt) * 32 + lane] =
                    make_float4(dq[mt][nt][0], dq[mt][nt][1], dq[mt][nt][2], dq[mt][nt][3]);
        fence_proxy_async_shared();
        slot = dq_slots + attention_dq_slot<HEAD_DIM>(b, head, q_tile_index, NH, num_q_tiles);
        done = dq_done + ((size_t)b * NH + head) * num_q_tiles + q_tile_index;
        turn = q_tile_index * Q_TILE / KV_TILE - kv_block;  // the kv blocks above this one that see the tile
        query_steps.store_stats(step + STAGES - 1, next_lse_log2, next_delta);
    }
    __syncthreads();  // the last share is staged; every warp is done reading K (dQ share)
    if (threadIdx.x == 0) {
        dq_share_issue(slot, dq_staged, DQ_SLOT_BYTES, done, turn);
        dq_share_release(done, turn);
    }

    // K and V rows are free now; each warp stages its own 16 rows of dK and dV there.
    backward_store_dk_dv<HEAD_DIM>(
        dqkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, dqkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row,
        warp_kv0, T, k_tile + warp * 16 * LD, v_tile + warp * 16 * LD, dk_acc, dv_acc, softmax_scale, lane);
}

// dQ = scale * (sum of the shares in each slot), as BF16 into dqkv. One thread per float4 of a slot:
// float4 i of a slot is accumulator tile (i / 32) % DQ_FRAGS of lane i % 32 of warp i / (32 DQ_FRAGS).
template <int HEAD_DIM>
__global__ void attention_backward_dq_from_slots_kernel(bf16 *dqkv, const float *dq_slots, int B, int T, int NH,
                                                        int NKV, float softmax_scale) {
    constexpr int Q_TILE = ATTENTION_ONE_PASS_Q_TILE, DQ_COLS = HEAD_DIM / 4, DQ_N_TILES = DQ_COLS / 8;
    constexpr int DQ_FRAGS = 2 * DQ_N_TILES, SLOT_VECS = Q_TILE * HEAD_DIM / 4;
    const int num_q_tiles = ceil_div(T, Q_TILE);
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)B * NH * num_q_tiles * SLOT_VECS) return;
    int within = (int)(i % SLOT_VECS);
    size_t slot = i / SLOT_VECS;
    int tile = (int)(slot % num_q_tiles), h = (int)(slot / num_q_tiles % NH), b = (int)(slot / num_q_tiles / NH);
    int lane = within % 32, frag = within / 32 % DQ_FRAGS, warp = within / (32 * DQ_FRAGS);
    int mt = frag / DQ_N_TILES, nt = frag % DQ_N_TILES;
    int row = tile * Q_TILE + (warp % 2) * 32 + mt * 16 + lane / 4;
    int col = (warp / 2) * DQ_COLS + nt * 8 + (lane % 4) * 2;
    float4 v = reinterpret_cast<const float4 *>(dq_slots)[i];
    size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM;
    bf16 *dq = dqkv + (size_t)b * T * qkv_row + (size_t)h * HEAD_DIM + col;
    if (row < T)
        *reinterpret_cast<__nv_bfloat162 *>(dq + (size_t)row * qkv_row) =
            __floats2bfloat162_rn(v.x * softmax_scale, v.y * softmax_scale);
    if (row + 8 < T)
        *reinterpret_cast<__nv_bfloat162 *>(dq + (size_t)(row + 8) * qkv_row) =
            __floats2bfloat162_rn(v.z * softmax_scale, v.w * softmax_scale);
}

// ---- wgmma backward on cp.async loads and no-swizzle tiles -----------------------------------------
//
// Shared tiles use the no-swizzle core-matrix layout wgmma reads: a core matrix is 8 rows x 8 BF16
// (16 bytes a row, 128 contiguous bytes); in a tile of rows x head_dim, core matrix (row / 8, col / 8)
// lies at byte 128 (row / 8 * head_dim / 8 + col / 8), so each 8-row group is one contiguous block.
// The same bytes serve as a K-major operand (K = head_dim: Q, K, V, dO in S, dP) and as an MN-major
// one (K = sequence positions: Q, dO, K in dK, dV, dQ); only the descriptor's strides swap roles.

#define WGMMA_BLOCK_THREADS (2 * WGMMA_WARPGROUP_THREADS)
#define WGMMA_CORE_MATRIX_BYTES 128

// Element offset of (row, col) in a core-matrix tile HEAD_DIM wide.
template <int HEAD_DIM>
__device__ __forceinline__ int wgmma_tile_offset(int row, int col) {
    return ((row / 8) * (HEAD_DIM / 8) + col / 8) * 64 + (row % 8) * 8 + col % 8;
}

// The row and first column of 16-byte chunk i of a core-matrix tile, numbered so that chunk i lies at
// byte 16 i: 8 consecutive threads fill one core matrix (128 contiguous bytes, no bank conflict)
// from 8 rows, and a warp reads 64 contiguous bytes of each of 8 global rows.
template <int HEAD_DIM>
__device__ __forceinline__ void wgmma_chunk_position(int chunk, int &row, int &col) {
    constexpr int COL_GROUPS = HEAD_DIM / 8;
    row = chunk / (8 * COL_GROUPS) * 8 + chunk % 8;
    col = chunk / 8 % COL_GROUPS * 8;
}

// Rows [row0, row0 + ROWS) of one head (HEAD_DIM elements each, row_stride apart in global memory)
// into a core-matrix tile, asynchronously, spread over the THREADS threads of the block; rows >= T
// become zeros so that no stale value (possibly NaN) reaches a wgmma.
template <int ROWS, int HEAD_DIM, int THREADS>
__device__ __forceinline__ void wgmma_load_tile_async(bf16 *tile, const bf16 *head, size_t row_stride, int row0,
                                                      int T) {
    constexpr int CHUNKS = ROWS * HEAD_DIM / 8;
    static_assert(ROWS % 8 == 0 && CHUNKS % THREADS == 0, "tile must split evenly over the block");
#pragma unroll
    for (int i = 0; i < CHUNKS / THREADS; i++) {
        int chunk = i * THREADS + (int)threadIdx.x, row, col;
        wgmma_chunk_position<HEAD_DIM>(chunk, row, col);
        bool valid = row0 + row < T;
        cp_async_16(tile + 8 * chunk, head + (size_t)(valid ? row0 + row : 0) * row_stride + col, valid);
    }
}

// Shared-memory matrix descriptor without swizzle: start address, then the leading byte offset (LBO)
// = the stride between core matrices adjacent along K, and the stride byte offset (SBO) = the stride
// along M or N, all in 16-byte units; base offset 0 and swizzle mode 0. This is the PTX ISA's
// canonical no-swizzle layout for both K-major ((8,m),(T,2k)):((1T,SBO),(1,LBO)) and MN-major
// ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)) operands, confirmed on H200 by a probe of every assignment.
__device__ __forceinline__ uint64_t wgmma_descriptor(const bf16 *tile, uint32_t k_adjacent_bytes,
                                                     uint32_t mn_adjacent_bytes) {
    return (uint64_t)((shared_address(tile) >> 4) & 0x3FFF) | (uint64_t)((k_adjacent_bytes >> 4) & 0x3FFF) << 16 |
           (uint64_t)((mn_adjacent_bytes >> 4) & 0x3FFF) << 32;
}

// Issues acc (64 x N, accumulator layout) = A B^T for one warpgroup as one commit group and returns
// at once: a_rows its 64 rows and b_rows N rows, both core-matrix tiles HEAD_DIM wide read K-major
// (K = head_dim); HEAD_DIM / 16 k-steps, the first overwriting acc. acc is only complete after a
// wgmma_wait_pending that covers the group, and must then be pinned (wgmma_pin_registers) before use.
template <int HEAD_DIM, int N>
__device__ __forceinline__ void wgmma_issue_a_bt(float (&acc)[N / 2], const bf16 *a_rows, const bf16 *b_rows) {
    constexpr uint32_t K_STEP_BYTES = 2 * WGMMA_CORE_MATRIX_BYTES;  // 16 columns: two core matrices
    constexpr uint32_t ROW_GROUP_BYTES = HEAD_DIM * 16;             // 8 rows
    const uint64_t a_descriptor = wgmma_descriptor(a_rows, WGMMA_CORE_MATRIX_BYTES, ROW_GROUP_BYTES);
    const uint64_t b_descriptor = wgmma_descriptor(b_rows, WGMMA_CORE_MATRIX_BYTES, ROW_GROUP_BYTES);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < HEAD_DIM / 16; kk++)
        wgmma_m64k16_smem_a<N>(acc, wgmma_descriptor_advance(a_descriptor, kk * K_STEP_BYTES),
                               wgmma_descriptor_advance(b_descriptor, kk * K_STEP_BYTES), kk > 0);
    wgmma_commit_group();
}

// Issues acc (64 x N) += X B for one warpgroup as one commit group and returns at once: x the A
// fragments of X (64 x K, from wgmma_scores_to_a_operand), b_rows K rows of a core-matrix tile N wide
// read MN-major (K = sequence positions, 8-row groups apart; N = head_dim, core matrices 128 bytes
// apart); K / 16 k-steps. acc and x must stay untouched until a wgmma_wait_pending covers the group.
template <int N, int K>
__device__ __forceinline__ void wgmma_issue_add_x_b(float (&acc)[N / 2], uint32_t (&x)[K / 16][4], const bf16 *b_rows) {
    constexpr uint32_t ROW_GROUP_BYTES = N * 16;
    const uint64_t b_descriptor = wgmma_descriptor(b_rows, ROW_GROUP_BYTES, WGMMA_CORE_MATRIX_BYTES);
    wgmma_pin_registers(acc);
    wgmma_pin_registers(x);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++)
        wgmma_m64k16_register_a_mn_b<N>(acc, x[kk], wgmma_descriptor_advance(b_descriptor, kk * 2 * ROW_GROUP_BYTES));
    wgmma_commit_group();
}

// The shared-memory operands of a warpgroup's dK/dV step in the no-swizzle core-matrix layout: its 64
// key rows of K and V, and the stage's Q and dO tiles. Each issue is one commit group (see
// wgmma_issue_a_bt and wgmma_issue_add_x_b).
template <int HEAD_DIM, int Q_TILE>
struct CoreMatrixDkDvOperands {
    const bf16 *k_rows, *v_rows, *q_tile, *dout_tile;
    __device__ __forceinline__ void issue_scores_t(float (&st)[Q_TILE / 2]) const {  // S^T = K Q^T
        wgmma_issue_a_bt<HEAD_DIM, Q_TILE>(st, k_rows, q_tile);
    }
    __device__ __forceinline__ void issue_dp_t(float (&dpt)[Q_TILE / 2]) const {  // dP^T = V dO^T
        wgmma_issue_a_bt<HEAD_DIM, Q_TILE>(dpt, v_rows, dout_tile);
    }
    __device__ __forceinline__ void issue_dv(float (&dv)[HEAD_DIM / 2], uint32_t (&pt)[Q_TILE / 16][4]) const {
        wgmma_issue_add_x_b<HEAD_DIM, Q_TILE>(dv, pt, dout_tile);  // dV += P^T dO
    }
    __device__ __forceinline__ void issue_dk(float (&dk)[HEAD_DIM / 2], uint32_t (&dst)[Q_TILE / 16][4]) const {
        wgmma_issue_add_x_b<HEAD_DIM, Q_TILE>(dk, dst, q_tile);  // dK += dS^T Q
    }
};

// The shared-memory operands of a warpgroup's dQ step in the no-swizzle core-matrix layout: its 64
// rows of Q and dO, and the stage's K and V tiles.
template <int HEAD_DIM, int KV_TILE>
struct CoreMatrixDqOperands {
    const bf16 *q_rows, *dout_rows, *k_tile, *v_tile;
    __device__ __forceinline__ void issue_scores(float (&s)[KV_TILE / 2]) const {  // S = Q K^T
        wgmma_issue_a_bt<HEAD_DIM, KV_TILE>(s, q_rows, k_tile);
    }
    __device__ __forceinline__ void issue_dp(float (&dp)[KV_TILE / 2]) const {  // dP = dO V^T
        wgmma_issue_a_bt<HEAD_DIM, KV_TILE>(dp, dout_rows, v_tile);
    }
    __device__ __forceinline__ void issue_dq(float (&dq)[HEAD_DIM / 2], uint32_t (&ds)[KV_TILE / 16][4]) const {
        wgmma_issue_add_x_b<HEAD_DIM, KV_TILE>(dq, ds, k_tile);  // dQ += dS K
    }
};

// ---- loads and stores -------------------------------------------------------------------------------

// Issues the loads of one dK/dV step (Q_TILE query rows q0.. of one query head) into a stage, as one
// commit group, and returns this thread's row statistics for row q0 + threadIdx.x, stored by the
// caller: lse in log2 units and D. Rows past T get lse = +inf, so that their P is exactly 0, and D = 0.
template <int HEAD_DIM, int Q_TILE, int THREADS>
__device__ __forceinline__ void wgmma_backward_load_step(bf16 *q_dst, bf16 *dout_dst, float *lse_log2,
                                                         float *delta_value, const bf16 *q_head, size_t qkv_row,
                                                         const bf16 *dout_head, size_t dout_row, const float *lse_head,
                                                         const float *delta_head, int q0, int T) {
    wgmma_load_tile_async<Q_TILE, HEAD_DIM, THREADS>(q_dst, q_head, qkv_row, q0, T);
    wgmma_load_tile_async<Q_TILE, HEAD_DIM, THREADS>(dout_dst, dout_head, dout_row, q0, T);
    cp_async_commit();
    const int q = q0 + (int)threadIdx.x;
    const bool valid = (int)threadIdx.x < Q_TILE && q < T;
    *lse_log2 = valid ? lse_head[q] * ATTENTION_LOG2E : INFINITY;
    *delta_value = valid ? delta_head[q] : 0.f;
}

// Writes the 16 rows of a warp's accumulators (rows g and g + 8 of the warp, times scale) as BF16 to
// global rows first_row.. of one head (row_stride apart; rows >= T skipped), staged in rows: the
// warp's own 16 rows of a core-matrix tile HEAD_DIM wide, which no wgmma reads any more. A warp's
// stores fill whole core matrices (no bank conflict); the copy-out moves 16-byte chunks.
template <int HEAD_DIM>
__device__ __forceinline__ void wgmma_store_warp_rows(bf16 *head, size_t row_stride, int first_row, int T, bf16 *rows,
                                                      const float (&acc)[HEAD_DIM / 2], float scale, int lane) {
    const int g = lane / 4, c = (lane % 4) * 2;
#pragma unroll
    for (int n8 = 0; n8 < HEAD_DIM / 8; n8++) {
        *reinterpret_cast<__nv_bfloat162 *>(rows + wgmma_tile_offset<HEAD_DIM>(g, 8 * n8 + c)) =
            __floats2bfloat162_rn(acc[4 * n8] * scale, acc[4 * n8 + 1] * scale);
        *reinterpret_cast<__nv_bfloat162 *>(rows + wgmma_tile_offset<HEAD_DIM>(g + 8, 8 * n8 + c)) =
            __floats2bfloat162_rn(acc[4 * n8 + 2] * scale, acc[4 * n8 + 3] * scale);
    }
    __syncwarp();
#pragma unroll
    for (int chunk = lane; chunk < 16 * HEAD_DIM / 8; chunk += 32) {
        int row, col;
        wgmma_chunk_position<HEAD_DIM>(chunk, row, col);
        if (first_row + row < T) store16(head + (size_t)(first_row + row) * row_stride + col, load16(rows + 8 * chunk));
    }
}

// ---- wgmma dK/dV pass ---------------------------------------------------------------------------

// A dK/dV pass variant: query tiles of Q_TILE rows (64 or 128), MIN_BLOCKS per SM for
// __launch_bounds__ (registers per thread capped at 64K / (256 MIN_BLOCKS)).
template <int Q_TILE, int MIN_BLOCKS>
struct AttentionWgmmaDkDvConfig {
    static constexpr int q_tile = Q_TILE, min_blocks = MIN_BLOCKS;
};

// Shared memory of the dK/dV pass, in bytes from the start (each offset a multiple of 128).
template <int HEAD_DIM, int Q_TILE>
struct AttentionWgmmaDkDvSmem {
    static constexpr size_t kv_bytes = (size_t)WGMMA_BLOCK_ROWS * HEAD_DIM * sizeof(bf16);
    static constexpr size_t q_bytes = (size_t)Q_TILE * HEAD_DIM * sizeof(bf16);
    static constexpr size_t k_tile = 0, v_tile = kv_bytes;
    static constexpr size_t q_tiles = 2 * kv_bytes;              // two stages
    static constexpr size_t dout_tiles = q_tiles + 2 * q_bytes;  // two stages
    static constexpr size_t lse_tiles = dout_tiles + 2 * q_bytes;
    static constexpr size_t delta_tiles = lse_tiles + 2 * Q_TILE * sizeof(float);
    static constexpr size_t bytes = delta_tiles + 2 * Q_TILE * sizeof(float);
};

// Block: key rows kv0 = 128 blockIdx.x.. of kv head blockIdx.y of batch blockIdx.z; warpgroup wg:
// keys kv0 + 64 wg.., warp w of it the 16 keys from kv0 + 64 wg + 16 w. Steps: every query head of
// the group (outer) and its query tiles from the one holding kv0 on (inner); the next step's tiles
// load while this one runs. A warpgroup skips the steps where all its keys lie past T or after the
// tile's last query (warpgroup-uniform: a whole warpgroup takes part in each wgmma or none does).
// Blocks with low blockIdx.x (most steps) are dispatched first within each kv head.
template <int HEAD_DIM, int Q_TILE, int MIN_BLOCKS>
__global__ void __launch_bounds__(WGMMA_BLOCK_THREADS, MIN_BLOCKS)
    attention_backward_dkdv_wgmma_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                                         const float *delta, int T, int NH, int NKV, float softmax_scale) {
    typedef AttentionWgmmaDkDvSmem<HEAD_DIM, Q_TILE> Smem;
    constexpr int THREADS = WGMMA_BLOCK_THREADS, KV_ROWS = WGMMA_BLOCK_ROWS, GROUP_ROWS = WGMMA_WARPGROUP_ROWS;
    static_assert((Q_TILE == 64 || Q_TILE == 128) && (HEAD_DIM == 64 || HEAD_DIM == 128), "wgmma n64 or n128");
    static_assert(KV_ROWS % Q_TILE == 0 && Q_TILE <= THREADS,
                  "a key block starts on a query tile boundary; one thread loads each row's lse and D");
    extern __shared__ __align__(128) unsigned char attention_wgmma_smem[];
    bf16 *k_tile = reinterpret_cast<bf16 *>(attention_wgmma_smem + Smem::k_tile);
    bf16 *v_tile = reinterpret_cast<bf16 *>(attention_wgmma_smem + Smem::v_tile);
    bf16 *q_tiles = reinterpret_cast<bf16 *>(attention_wgmma_smem + Smem::q_tiles);
    bf16 *dout_tiles = reinterpret_cast<bf16 *>(attention_wgmma_smem + Smem::dout_tiles);
    float *lse_tiles = reinterpret_cast<float *>(attention_wgmma_smem + Smem::lse_tiles);  // log2 units
    float *delta_tiles = reinterpret_cast<float *>(attention_wgmma_smem + Smem::delta_tiles);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int kv0 = blockIdx.x * KV_ROWS, kv_head = blockIdx.y, b = blockIdx.z;
    const int group = NH / NKV;
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM, dout_row = (size_t)NH * HEAD_DIM;
    bf16 *dqkv_batch = dqkv + (size_t)b * T * qkv_row;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *dout_batch = dout + (size_t)b * T * dout_row;
    const float *lse_batch = lse + (size_t)b * NH * T, *delta_batch = delta + (size_t)b * NH * T;
    const int first_q_tile = kv0 / Q_TILE;  // earlier queries see none of these keys
    const int q_tiles_per_head = ceil_div(T, Q_TILE) - first_q_tile;
    const int steps = group * q_tiles_per_head;  // step i: head kv_head * group + i / q_tiles_per_head

    wgmma_load_tile_async<KV_ROWS, HEAD_DIM, THREADS>(k_tile, qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row,
                                                      kv0, T);
    wgmma_load_tile_async<KV_ROWS, HEAD_DIM, THREADS>(v_tile, qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM,
                                                      qkv_row, kv0, T);
    {
        const int head = kv_head * group, q0 = first_q_tile * Q_TILE;
        float lse_log2, delta_value;
        wgmma_backward_load_step<HEAD_DIM, Q_TILE, THREADS>(
            q_tiles, dout_tiles, &lse_log2, &delta_value, qkv_batch + (size_t)head * HEAD_DIM, qkv_row,
            dout_batch + (size_t)head * HEAD_DIM, dout_row, lse_batch + (size_t)head * T,
            delta_batch + (size_t)head * T, q0, T);
        if ((int)threadIdx.x < Q_TILE) {
            lse_tiles[threadIdx.x] = lse_log2;
            delta_tiles[threadIdx.x] = delta_value;
        }
    }

    const int key_first = kv0 + warpgroup * GROUP_ROWS;  // this warpgroup's first key
    const bf16 *k_rows = k_tile + warpgroup * GROUP_ROWS * HEAD_DIM;
    const bf16 *v_rows = v_tile + warpgroup * GROUP_ROWS * HEAD_DIM;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float dk_acc[HEAD_DIM / 2], dv_acc[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; i++) dk_acc[i] = dv_acc[i] = 0.f;

    for (int step = 0; step < steps; step++) {
        cp_async_wait_pending<0>();
        fence_proxy_async_shared();
        __syncthreads();  // this step's tiles visible to every wgmma; every warpgroup is done with the
                          // stage refilled below (its last reader of it completed before it got here)
        const int stage = step & 1, next_stage = stage ^ 1;
        float next_delta = 0.f, next_lse_log2 = INFINITY;
        if (step + 1 < steps) {
            const int head = kv_head * group + (step + 1) / q_tiles_per_head;
            const int q0 = (first_q_tile + (step + 1) % q_tiles_per_head) * Q_TILE;
            wgmma_backward_load_step<HEAD_DIM, Q_TILE, THREADS>(
                q_tiles + next_stage * Q_TILE * HEAD_DIM, dout_tiles + next_stage * Q_TILE * HEAD_DIM, &next_lse_log2,
                &next_delta, qkv_batch + (size_t)head * HEAD_DIM, qkv_row, dout_batch + (size_t)head * HEAD_DIM,
                dout_row, lse_batch + (size_t)head * T, delta_batch + (size_t)head * T, q0, T);
        }
        const int q0 = (first_q_tile + step % q_tiles_per_head) * Q_TILE;
        if (key_first < T && key_first <= q0 + Q_TILE - 1)
            wgmma_backward_dkdv_step<HEAD_DIM, Q_TILE>(
                dk_acc, dv_acc,
                CoreMatrixDkDvOperands<HEAD_DIM, Q_TILE>{k_rows, v_rows, q_tiles + stage * Q_TILE * HEAD_DIM,
                                                         dout_tiles + stage * Q_TILE * HEAD_DIM},
                lse_tiles + stage * Q_TILE, delta_tiles + stage * Q_TILE, scale_log2, key_first, q0, warp, lane);
        if (step + 1 < steps && (int)threadIdx.x < Q_TILE) {
            lse_tiles[next_stage * Q_TILE + threadIdx.x] = next_lse_log2;
            delta_tiles[next_stage * Q_TILE + threadIdx.x] = next_delta;
        }
    }

    // Every wgmma of the block has completed; each warp stages its own 16 rows of dK and dV in its
    // rows of the K and V tiles.
    __syncthreads();
    const int warp_key0 = key_first + warp * 16, warp_offset = (warpgroup * GROUP_ROWS + warp * 16) * HEAD_DIM;
    wgmma_store_warp_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row, warp_key0, T,
                                    k_tile + warp_offset, dk_acc, softmax_scale, lane);
    wgmma_store_warp_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row, warp_key0, T,
                                    v_tile + warp_offset, dv_acc, 1.f, lane);
}

// ---- wgmma dQ pass ------------------------------------------------------------------------------

// A dQ pass variant: K/V tiles of KV_TILE keys (64 or 128), MIN_BLOCKS per SM.
template <int KV_TILE, int MIN_BLOCKS>
struct AttentionWgmmaDqConfig {
    static constexpr int kv_tile = KV_TILE, min_blocks = MIN_BLOCKS;
};

// Block: query rows q0 = 128 q_block.. of head h of batch b; warpgroup wg: rows q0 + 64 wg.., warp w
// of it the 16 rows from q0 + 64 wg + 16 w, thread rows g and g + 8 of those. Every thread helps load
// each K/V tile (prefetched while the previous one is used); a warpgroup skips the tiles right of
// its diagonal, as the forward does.
template <int HEAD_DIM, int KV_TILE, int MIN_BLOCKS>
__global__ void __launch_bounds__(WGMMA_BLOCK_THREADS, MIN_BLOCKS)
    attention_backward_dq_wgmma_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                                       const float *delta, int T, int NH, int NKV, float softmax_scale) {
    constexpr int THREADS = WGMMA_BLOCK_THREADS, Q_ROWS = WGMMA_BLOCK_ROWS, GROUP_ROWS = WGMMA_WARPGROUP_ROWS;
    static_assert((KV_TILE == 64 || KV_TILE == 128) && (HEAD_DIM == 64 || HEAD_DIM == 128), "wgmma n64 or n128");
    extern __shared__ __align__(128) unsigned char attention_wgmma_smem[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(attention_wgmma_smem);
    bf16 *dout_tile = q_tile + Q_ROWS * HEAD_DIM;
    bf16 *k_tiles = dout_tile + Q_ROWS * HEAD_DIM;     // two stages
    bf16 *v_tiles = k_tiles + 2 * KV_TILE * HEAD_DIM;  // two stages

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int q_block = gridDim.x - 1 - blockIdx.x;  // longest causal rows first: fewer idle SMs at the end
    const int h = blockIdx.y, b = blockIdx.z;
    const int kv_head = h / (NH / NKV);
    const size_t qkv_row = (size_t)(NH + 2 * NKV) * HEAD_DIM, dout_row = (size_t)NH * HEAD_DIM;
    const bf16 *qkv_batch = qkv + (size_t)b * T * qkv_row;
    const bf16 *k_head = qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM;
    const bf16 *v_head = qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM;
    const int q0 = q_block * Q_ROWS;
    const int num_kv_tiles = (min(q0 + Q_ROWS, T) - 1) / KV_TILE + 1;  // up to the last valid row's diagonal

    wgmma_load_tile_async<Q_ROWS, HEAD_DIM, THREADS>(q_tile, qkv_batch + (size_t)h * HEAD_DIM, qkv_row, q0, T);
    wgmma_load_tile_async<Q_ROWS, HEAD_DIM, THREADS>(dout_tile, dout + (size_t)b * T * dout_row + (size_t)h * HEAD_DIM,
                                                     dout_row, q0, T);
    wgmma_load_tile_async<KV_TILE, HEAD_DIM, THREADS>(k_tiles, k_head, qkv_row, 0, T);
    wgmma_load_tile_async<KV_TILE, HEAD_DIM, THREADS>(v_tiles, v_head, qkv_row, 0, T);
    cp_async_commit();

    const int group_row0 = q0 + warpgroup * GROUP_ROWS;
    const int row_lo = group_row0 + warp * 16 + lane / 4;  // this thread's rows: row_lo and row_lo + 8
    const bf16 *q_rows = q_tile + warpgroup * GROUP_ROWS * HEAD_DIM;
    const bf16 *dout_rows = dout_tile + warpgroup * GROUP_ROWS * HEAD_DIM;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float row_lse_log2[2], row_delta[2];
    attention_dq_row_statistics(row_lse_log2, row_delta, lse, delta, b, h, NH, T, row_lo);
    float dq_acc[HEAD_DIM / 2];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 2; i++) dq_acc[i] = 0.f;

    for (int j = 0; j < num_kv_tiles; j++) {
        cp_async_wait_pending<0>();
        fence_proxy_async_shared();
        __syncthreads();  // tile j visible to every wgmma; every warpgroup is done with the stage refilled below
        if (j + 1 < num_kv_tiles) {
            const int next = (j + 1) & 1;
            wgmma_load_tile_async<KV_TILE, HEAD_DIM, THREADS>(k_tiles + next * KV_TILE * HEAD_DIM, k_head, qkv_row,
                                                              (j + 1) * KV_TILE, T);
            wgmma_load_tile_async<KV_TILE, HEAD_DIM, THREADS>(v_tiles + next * KV_TILE * HEAD_DIM, v_head, qkv_row,
                                                              (j + 1) * KV_TILE, T);
            cp_async_commit();
        }
        const int kv0 = j * KV_TILE;
        // Rows are multiples of 64 and tiles of KV_TILE >= 64 apart, so a tile left of row
        // group_row0 + 64 starts at or before group_row0 and shows every row at least key kv0.
        if (group_row0 >= T || kv0 >= group_row0 + GROUP_ROWS) continue;
        wgmma_backward_dq_step<HEAD_DIM, KV_TILE>(
            dq_acc,
            CoreMatrixDqOperands<HEAD_DIM, KV_TILE>{q_rows, dout_rows, k_tiles + (j & 1) * KV_TILE * HEAD_DIM,
                                                    v_tiles + (j & 1) * KV_TILE * HEAD_DIM},
            row_lse_log2, row_delta, scale_log2, row_lo, kv0, kv0 + KV_TILE - 1 > group_row0, lane);
    }

    // Every wgmma of the block has completed, so the Q tile is free: each warp stages its 16 rows of
    // dQ there.
    __syncthreads();
    const int warp_row0 = group_row0 + warp * 16;
    wgmma_store_warp_rows<HEAD_DIM>(dqkv + (size_t)b * T * qkv_row + (size_t)h * HEAD_DIM, qkv_row, warp_row0, T,
                                    q_tile + (warpgroup * GROUP_ROWS + warp * 16) * HEAD_DIM, dq_acc, softmax_scale,
                                    lane);
}

// ---- wgmma launchers ----------------------------------------------------------------------------

template <int HEAD_DIM, class DkDv>
static void attention_backward_dkdv_wgmma_launch(bf16 *dqkv, const float *delta, const bf16 *dout, const bf16 *qkv,
                                                 const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
    constexpr size_t smem = AttentionWgmmaDkDvSmem<HEAD_DIM, DkDv::q_tile>::bytes;
    static_assert(smem <= ATTENTION_MAX_SMEM_BYTES, "dK/dV tiles exceed shared memory");
    auto kernel = attention_backward_dkdv_wgmma_kernel<HEAD_DIM, DkDv::q_tile, DkDv::min_blocks>;
    attention_launch_setup(kernel, smem);
    dim3 grid(ceil_div(T, WGMMA_BLOCK_ROWS), NKV, B);
    kernel<<<grid, WGMMA_BLOCK_THREADS, smem, stream>>>(dqkv, qkv, dout, lse, delta, T, NH, NKV,
                                                        attention_softmax_scale(HEAD_DIM));
    cudaCheckLaunch();
}

template <int HEAD_DIM, class Dq>
static void attention_backward_dq_wgmma_launch(bf16 *dqkv, const float *delta, const bf16 *dout, const bf16 *qkv,
                                               const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
    constexpr size_t smem = (size_t)(2 * WGMMA_BLOCK_ROWS + 4 * Dq::kv_tile) * HEAD_DIM * sizeof(bf16);
    static_assert(smem <= ATTENTION_MAX_SMEM_BYTES, "dQ tiles exceed shared memory");
    auto kernel = attention_backward_dq_wgmma_kernel<HEAD_DIM, Dq::kv_tile, Dq::min_blocks>;
    attention_launch_setup(kernel, smem);
    dim3 grid(ceil_div(T, WGMMA_BLOCK_ROWS), NH, B);
    kernel<<<grid, WGMMA_BLOCK_THREADS, smem, stream>>>(dqkv, qkv, dout, lse, delta, T, NH, NKV,
                                                        attention_softmax_scale(HEAD_DIM));
    cudaCheckLaunch();
}

// The dK/dV pass, then the dQ pass (D already in delta).
template <int HEAD_DIM, class DkDv, class Dq>
static void attention_backward_wgmma_launch(bf16 *dqkv, const float *delta, const bf16 *dout, const bf16 *qkv,
                                            const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
    attention_backward_dkdv_wgmma_launch<HEAD_DIM, DkDv>(dqkv, delta, dout, qkv, lse, B, T, NH, NKV, stream);
    attention_backward_dq_wgmma_launch<HEAD_DIM, Dq>(dqkv, delta, dout, qkv, lse, B, T, NH, NKV, stream);
}

// ---- TMA forward in FlashAttention-3's order -------------------------------------------------------

// The forward in FlashAttention-3's order within each consumer, K and V on barriers of their own (ring
// 0 K, ring 1 V). Per tile j of a consumer, P_j already in BF16 A fragments:
//   issue S_{j+1} = Q K_{j+1}^T | issue O += P_j V_j | wait for S_{j+1}, release K_{j+1} |
//   softmax of S_{j+1} while O += P_j V_j runs | wait for it, release V_j | rescale O, P_{j+1} to BF16
// so that the exponentials of one tile run beside the consumer's own product of the last. A consumer
// holds S_{j+1} in FP32, P_j in BF16 and O (the producer's registers claimed for them). K and V stages
// are released apart, so that K_{j+2} can load while V_j is still read.
template <int HEAD_DIM, int KV, int CONSUMERS, int STAGES, bool PERSISTENT>
__global__ void __launch_bounds__((CONSUMERS + 1) * WGMMA_WARPGROUP_THREADS, 1)
    attention_forward_overlap_kernel(const __grid_constant__ CUtensorMap qkv_map, bf16 *out, float *lse, int T, int NH,
                                     int NKV, float softmax_scale, float *out_amax, int pairs, int chunk_pairs) {
    typedef AttentionTmaForwardSmem<HEAD_DIM, KV, CONSUMERS, STAGES, PERSISTENT, 2> Smem;
    typedef AttentionForwardRegisters<HEAD_DIM, KV, CONSUMERS, true> Registers;
    constexpr int Q_ROWS = Smem::q_rows, SLOTS = Smem::slots, S_REGS = KV / 2, O_REGS = HEAD_DIM / 2;
    static_assert(HEAD_DIM % 64 == 0 && KV % 64 == 0 && (KV == 64 || KV == 128), "whole 64 x 64 boxes; wgmma n64/n128");
    extern __shared__ __align__(1024) unsigned char attention_tma_smem[];
    char *smem = shared_aligned_1024(attention_tma_smem);
    uint64_t *k_full = reinterpret_cast<uint64_t *>(smem + Smem::bars), *k_empty = k_full + STAGES;
    uint64_t *v_full = k_empty + STAGES, *v_empty = v_full + STAGES;
    AttentionBlockSlots *slots = reinterpret_cast<AttentionBlockSlots *>(smem + Smem::block_slots);

    const int warpgroup = threadIdx.x / WGMMA_WARPGROUP_THREADS;
    const int q_blocks = ceil_div(T, Q_ROWS), blocks = q_blocks * pairs;

    attention_pipeline_init<STAGES, 2>(slots, k_full, CONSUMERS);
    if (warpgroup == 0) {
        if constexpr (Registers::claim) warpgroup_registers_release<24>();
        if (threadIdx.x == 0)
            attention_query_blocks_produce<HEAD_DIM, KV, STAGES, Q_ROWS, PERSISTENT, SLOTS>(
                slots, &qkv_map, NULL, smem + Smem::q, NULL, Smem::q_bytes, smem + Smem::k, smem + Smem::v, k_full,
                k_empty, pairs, chunk_pairs, T, NH, NKV, v_full, v_empty);
        return;
    }

    if constexpr (Registers::claim) warpgroup_registers_claim<Registers::consumer>();
    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int g = lane / 4, c = (lane % 4) * 2;
    const bool leader = threadIdx.x % WGMMA_WARPGROUP_THREADS == 0;
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
        float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
        float o_acc[O_REGS];
        uint32_t p_frag[KV / 16][4];
        attention_forward_start(o_acc, p_frag);
        float s[S_REGS];
        if (group_tiles > 0) {  // S_0 and its softmax (O is still 0: no correction)
            mbarrier_wait(&k_full[ring % STAGES], (ring / STAGES) & 1);
            wgmma_issue_a_bt_sw128<HEAD_DIM, KV>(s, q_tile, Q_ROWS, q_row0,
                                                 smem + Smem::k + (ring % STAGES) * Smem::kv_bytes);
            wgmma_wait_pending<0>();
            wgmma_pin_registers(s);
            if (leader) mbarrier_arrive(&k_empty[ring % STAGES]);
            float correction[2];
            attention_softmax_tile<KV>(s, row_max, row_sum, correction, 0, group_row0, row_lo, c, scale_log2);
            wgmma_scores_to_a_operand<KV>(p_frag, s);
        }
        for (int j = 0; j < f.num_kv_tiles; j++) {
            const int at = ring + j, stage = at % STAGES, next = (at + 1) % STAGES;
            if (j + 1 < group_tiles) {
                mbarrier_wait(&k_full[next], ((at + 1) / STAGES) & 1);
                wgmma_issue_a_bt_sw128<HEAD_DIM, KV>(s, q_tile, Q_ROWS, q_row0, smem + Smem::k + next * Smem::kv_bytes);
                mbarrier_wait(&v_full[stage], (at / STAGES) & 1);
                wgmma_issue_add_x_b_sw128<HEAD_DIM, KV>(o_acc, p_frag, smem + Smem::v + stage * Smem::kv_bytes);
                wgmma_wait_pending<1>();  // S_{j+1}; O += P_j V_j may still run
                wgmma_pin_registers(s);
                if (leader) mbarrier_arrive(&k_empty[next]);
                float correction[2];
                attention_softmax_tile<KV>(s, row_max, row_sum, correction, (j + 1) * KV, group_row0, row_lo, c,
                                           scale_log2);
                wgmma_wait_pending<0>();
                wgmma_pin_registers(o_acc);
                wgmma_pin_registers(p_frag);
                attention_rescale_o<HEAD_DIM>(o_acc, correction);
                wgmma_scores_to_a_operand<KV>(p_frag, s);
            } else if (j + 1 == group_tiles) {  // the last tile: O += P_j V_j alone
                mbarrier_wait(&v_full[stage], (at / STAGES) & 1);
                wgmma_issue_add_x_b_sw128<HEAD_DIM, KV>(o_acc, p_frag, smem + Smem::v + stage * Smem::kv_bytes);
                wgmma_wait_pending<0>();
                wgmma_pin_registers(o_acc);
                wgmma_pin_registers(p_frag);
            } else {
                // A tile right of this warpgroup's diagonal: its K and V released once loaded (an early
                // arrival would count towards the stage's previous phase).
                mbarrier_wait(&k_full[stage], (at / STAGES) & 1);
                if (leader) mbarrier_arrive(&k_empty[stage]);
                mbarrier_wait(&v_full[stage], (at / STAGES) & 1);
            }
            if (leader) mbarrier_arrive(&v_empty[stage]);
        }
        attention_release_block<PERSISTENT, SLOTS>(slots, k);  // no product reads its Q any more
        ring += f.num_kv_tiles;
        if (rows.valid)  // warpgroup-uniform
            attention_forward_store<HEAD_DIM>(o_acc, row_max, row_sum, f, out, lse, out_amax, T, NH, row_lo, lane, c);
    }
}

template <int HEAD_DIM, class Config>
static void attention_forward_overlap_launch(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                             cudaStream_t stream) {
    attention_forward_tma_run<HEAD_DIM, Config, 2>(
        attention_forward_overlap_kernel<HEAD_DIM, Config::kv_tile, Config::consumers, Config::stages,
                                         Config::persistent>,
        out, lse, qkv, B, T, NH, NKV, stream, NULL);
}

// ---- configs and launchers --------------------------------------------------------------------------

// The backward variants: two passes (a dK/dV pass, then a dQ pass) on mma.sync or on cp.async-fed
// wgmma, or one pass of fixed shape on mma.sync; the program's TMA configs (attention_wgmma.cuh) run
// here too.
template <class DkDv, class Dq>
struct AttentionTwoPassConfig {
    static constexpr bool one_pass = false, wgmma = false, tma = false;
    typedef DkDv dkdv;
    typedef Dq dq;
};
template <class DkDv, class Dq>
struct AttentionWgmmaTwoPassConfig {
    static constexpr bool one_pass = false, wgmma = true, tma = false;
    typedef DkDv dkdv;
    typedef Dq dq;
};
template <int MIN_BLOCKS, int STAGES = 2>
struct AttentionOnePassConfig {
    static constexpr bool one_pass = true, wgmma = false, tma = false;
    static constexpr int min_blocks = MIN_BLOCKS, stages = STAGES;
};

// A forward variant: the program's TMA kernel, the one in FlashAttention-3's order, or the mma.sync
// kernel.
template <int HEAD_DIM, class Config>
static void attention_variant_forward_launch(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                             cudaStream_t stream) {
    if constexpr (Config::tma) {
        if constexpr (Config::overlap)
            attention_forward_overlap_launch<HEAD_DIM, Config>(out, lse, qkv, B, T, NH, NKV, stream);
        else
            attention_forward_tma_launch<HEAD_DIM, Config>(out, lse, qkv, B, T, NH, NKV, stream);
    } else {
        constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
        constexpr size_t smem = (size_t)(Config::q_tile + 2 * Config::stages * Config::kv_tile) * LD * sizeof(bf16);
        static_assert(smem <= ATTENTION_MAX_SMEM_BYTES, "forward tiles exceed shared memory");
        auto kernel = attention_forward_kernel<HEAD_DIM, Config::warps, Config::m_tiles, Config::kv_tile,
                                               Config::q_in_registers, Config::min_blocks, Config::stages>;
        attention_launch_setup(kernel, smem);
        dim3 grid(ceil_div(T, Config::q_tile), NH, B);
        kernel<<<grid, Config::threads, smem, stream>>>(out, lse, qkv, T, NH, NKV, attention_softmax_scale(HEAD_DIM));
        cudaCheckLaunch();
    }
}

// Byte offsets of the pieces of the backward scratch, each 256-byte aligned: D [B, NH, T]; for the
// one-pass backward also the dQ slots' flags [B, NH, query tiles] followed by the counter that
// hands out kv blocks (all zeroed per call), and the FP32 dQ slots [B, NH, query tiles][64 x head_dim].
typedef struct {
    size_t delta, dq_done, dq_slots, total_bytes;
    size_t flag_count;  // flags plus the counter
} AttentionBackwardScratch;

static inline size_t attention_align256(size_t bytes) { return (bytes + 255) / 256 * 256; }

static inline AttentionBackwardScratch attention_variant_scratch_layout(int B, int T, int NH, int head_dim,
                                                                        bool one_pass) {
    AttentionBackwardScratch s;
    size_t slots = (size_t)B * NH * ceil_div(T, ATTENTION_ONE_PASS_Q_TILE);
    s.delta = 0;
    s.dq_done = s.delta + attention_align256((size_t)B * NH * T * sizeof(float));
    if (!one_pass) {
        s.flag_count = 0;
        s.dq_slots = s.total_bytes = s.dq_done;
        return s;
    }
    s.flag_count = slots + 1;
    s.dq_slots = s.dq_done + attention_align256(s.flag_count * sizeof(int));
    s.total_bytes = s.dq_slots + slots * ATTENTION_ONE_PASS_Q_TILE * head_dim * sizeof(float);
    return s;
}

// The stored dS^T of the variants that keep it: one buffer, grown to the largest shape asked for.
static bf16 *attention_variant_ds(int B, int T, int NH) {
    static bf16 *ds = NULL;
    static size_t bytes = 0;
    const size_t need = attention_ds_bytes(B, T, NH);
    if (need > bytes) {
        if (ds != NULL) cudaCheck(cudaFree(ds));
        cudaCheck(cudaMalloc(&ds, need));
        bytes = need;
    }
    return ds;
}

// Two passes: dK and dV per 16 DkDv::warps key rows, then dQ per 16 Dq::warps query rows.
template <int HEAD_DIM, class DkDv, class Dq>
static void attention_backward_two_pass_launch(bf16 *dqkv, const float *delta, const bf16 *dout, const bf16 *qkv,
                                               const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD, DKDV_ROWS = DkDv::warps * 16, DQ_ROWS = Dq::warps * 16;
    const float scale = attention_softmax_scale(HEAD_DIM);

    constexpr size_t dkdv_smem = (size_t)(2 * DKDV_ROWS + 2 * DkDv::stages * DkDv::q_tile) * LD * sizeof(bf16) +
                                 2 * DkDv::stages * DkDv::q_tile * sizeof(float);
    static_assert(dkdv_smem <= ATTENTION_MAX_SMEM_BYTES, "dK/dV tiles exceed shared memory");
    auto dkdv = attention_backward_dkdv_kernel<HEAD_DIM, DkDv::warps, DkDv::q_tile, DkDv::min_blocks, DkDv::stages>;
    attention_launch_setup(dkdv, dkdv_smem);
    dkdv<<<dim3(ceil_div(T, DKDV_ROWS), NKV, B), DkDv::warps * 32, dkdv_smem, stream>>>(dqkv, qkv, dout, lse, delta, T,
                                                                                        NH, NKV, scale);
    cudaCheckLaunch();

    constexpr size_t dq_smem = (size_t)(2 * DQ_ROWS + 2 * Dq::stages * Dq::kv_tile) * LD * sizeof(bf16);
    static_assert(dq_smem <= ATTENTION_MAX_SMEM_BYTES, "dQ tiles exceed shared memory");
    auto dq = attention_backward_dq_kernel<HEAD_DIM, Dq::warps, Dq::kv_tile, Dq::min_blocks, Dq::stages>;
    attention_launch_setup(dq, dq_smem);
    dq<<<dim3(ceil_div(T, DQ_ROWS), NH, B), Dq::warps * 32, dq_smem, stream>>>(dqkv, qkv, dout, lse, delta, T, NH, NKV,
                                                                               scale);
    cudaCheckLaunch();
}

// One pass: the flags and the block counter are zeroed, the dK/dV/dQ-share kernel runs with one
// block per (batch, kv head, 128 key rows), then the slots become dQ.
template <int HEAD_DIM, int MIN_BLOCKS, int STAGES>
static void attention_backward_one_pass_launch(bf16 *dqkv, char *scratch, const AttentionBackwardScratch &layout,
                                               const bf16 *dout, const bf16 *qkv, const float *lse, int B, int T,
                                               int NH, int NKV, cudaStream_t stream) {
    const float scale = attention_softmax_scale(HEAD_DIM);
    const float *delta = reinterpret_cast<const float *>(scratch + layout.delta);
    int *dq_done = reinterpret_cast<int *>(scratch + layout.dq_done);
    float *dq_slots = reinterpret_cast<float *>(scratch + layout.dq_slots);
    cudaCheck(cudaMemsetAsync(dq_done, 0, layout.flag_count * sizeof(int), stream));

    constexpr size_t smem = AttentionBackwardSmem<HEAD_DIM, STAGES>::bytes;
    static_assert(smem <= ATTENTION_MAX_SMEM_BYTES, "one-pass tiles exceed shared memory");
    auto kernel = attention_backward_one_pass_kernel<HEAD_DIM, MIN_BLOCKS, STAGES>;
    attention_launch_setup(kernel, smem);
    unsigned blocks = (unsigned)((size_t)ceil_div(T, ATTENTION_ONE_PASS_KV_TILE) * NKV * B);
    kernel<<<blocks, ATTENTION_ONE_PASS_THREADS, smem, stream>>>(
        dqkv, dq_slots, dq_done, dq_done + layout.flag_count - 1, qkv, dout, lse, delta, T, NH, NKV, scale);
    cudaCheckLaunch();

    size_t threads = (size_t)B * NH * ceil_div(T, ATTENTION_ONE_PASS_Q_TILE) * ATTENTION_ONE_PASS_Q_TILE * HEAD_DIM / 4;
    attention_backward_dq_from_slots_kernel<HEAD_DIM>
        <<<(unsigned)ceil_div_size(threads, 256), 256, 0, stream>>>(dqkv, dq_slots, B, T, NH, NKV, scale);
    cudaCheckLaunch();
}

// D, then the passes of the backward variant Config (AttentionTwoPassConfig, AttentionWgmmaTwoPassConfig,
// AttentionOnePassConfig or the program's AttentionTmaTwoPassConfig); scratch holds
// attention_variant_scratch_layout(B, T, NH, HEAD_DIM, Config::one_pass).total_bytes.
template <int HEAD_DIM, class Config>
static void attention_variant_backward_launch(bf16 *dqkv, float *scratch, const bf16 *dout, const bf16 *qkv,
                                              const bf16 *out, const float *lse, int B, int T, int NH, int NKV,
                                              cudaStream_t stream) {
    AttentionBackwardScratch layout = attention_variant_scratch_layout(B, T, NH, HEAD_DIM, Config::one_pass);
    char *base = reinterpret_cast<char *>(scratch);
    float *delta = reinterpret_cast<float *>(base + layout.delta);
    attention_backward_delta_launch<HEAD_DIM>(delta, dout, out, B, T, NH, stream);
    if constexpr (Config::one_pass)
        attention_backward_one_pass_launch<HEAD_DIM, Config::min_blocks, Config::stages>(dqkv, base, layout, dout, qkv,
                                                                                         lse, B, T, NH, NKV, stream);
    else if constexpr (Config::wgmma)
        attention_backward_wgmma_launch<HEAD_DIM, typename Config::dkdv, typename Config::dq>(
            dqkv, delta, dout, qkv, lse, B, T, NH, NKV, stream);
    else if constexpr (Config::tma)
        attention_backward_tma_launch<HEAD_DIM, Config>(dqkv, delta, dout, qkv, lse, B, T, NH, NKV, stream,
                                                        Config::store_ds ? attention_variant_ds(B, T, NH) : NULL);
    else
        attention_backward_two_pass_launch<HEAD_DIM, typename Config::dkdv, typename Config::dq>(
            dqkv, delta, dout, qkv, lse, B, T, NH, NKV, stream);
}
