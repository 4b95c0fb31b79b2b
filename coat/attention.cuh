// Causal flash attention with grouped-query heads, forward and backward, on BF16 tensor cores
// (mma.sync m16n8k16, FP32 accumulation). No T x T matrix is ever stored.
//
//   forward:  S = scale Q K^T (keys s <= query t), P = softmax(S), O = P V, lse = log sum_s exp(S)
//   backward: D = rowsum(dO * O), dP = dO V^T, dS = P (dP - D),
//             dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO;      scale = 1 / sqrt(head_dim)
//
// Layouts (row-major): qkv and dqkv [B, T, (NH + 2 NKV) * head_dim] BF16, each row holding NH query
// heads, then NKV key heads, then NKV value heads (q and k already rotated by RoPE); out and dout
// [B, T, NH, head_dim] BF16; lse (natural log) and the backward's D [B, NH, T] FP32.
// Query head h reads kv head h / (NH / NKV) where it lies: K and V are never copied per query head.
// head_dim is 64 or 128; any T >= 1: tile rows past T are zero-filled in shared memory and masked.
//
// Work split: each warp owns 16 rows of the tile its block produces and keeps them in mma
// accumulators. Forward and dQ: a block owns 128 query rows of one head and walks the K/V tiles up
// to the diagonal. dK and dV: a block owns 128 key rows of one kv head and walks the query tiles of
// every query head of its group, summing in registers in a fixed order. The backward is therefore
// deterministic without atomics, at the price of computing S and dP twice (once per pass).
#pragma once
#include <math.h>
#include <stdint.h>
#include "common.cuh"

#define ATTENTION_WARPS 8
#define ATTENTION_THREADS (ATTENTION_WARPS * 32)
// Query rows (forward, dQ) or key rows (dK, dV) one block owns: 16 per warp.
#define ATTENTION_BLOCK_ROWS (ATTENTION_WARPS * 16)
// Shared-memory rows are padded by 16 bytes so that the 8 row addresses of one ldmatrix fall in
// 8 different 4-bank groups (row strides of 144 or 272 bytes), with no swizzle to reason about.
#define ATTENTION_SMEM_PAD 8

static constexpr float ATTENTION_LOG2E = 1.4426950408889634f;
static constexpr float ATTENTION_LN2 = 0.6931471805599453f;

// Tile sizes per head dimension, chosen so that the accumulators fit in registers without spills:
// the dK/dV pass holds dK, dV (head_dim / 2 floats each per thread) plus S^T and dP^T (q_tile / 2 each).
template <int HEAD_DIM> struct AttentionTiles;
template <> struct AttentionTiles<64> {
    static constexpr int forward_kv = 64, forward_min_blocks = 2;
    static constexpr int dkdv_q = 64, dkdv_min_blocks = 1;
    static constexpr int dq_kv = 32, dq_min_blocks = 2;
};
template <> struct AttentionTiles<128> {
    static constexpr int forward_kv = 64, forward_min_blocks = 1;
    static constexpr int dkdv_q = 32, dkdv_min_blocks = 1;
    static constexpr int dq_kv = 64, dq_min_blocks = 1;
};

// ---- warp-level building blocks -------------------------------------------------------------------

__device__ __forceinline__ uint32_t shared_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory without a trip through registers; when valid is false
// nothing is read and the 16 bytes are zero-filled.
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)),
                 "l"(__cvta_generic_to_global(gmem)), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

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

// The A operand of rows [row0, row0 + 16) and columns [col0, col0 + 16) of a row-major tile.
__device__ __forceinline__ void load_a_operand(uint32_t (&a)[4], const bf16 *tile, int ld, int row0, int col0,
                                               int lane) {
    ldmatrix_x4(a, tile + (row0 + (lane & 7) + (lane & 8)) * ld + col0 + (lane >> 4) * 8);
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

// Rows [row0, row0 + ROWS) of one head (head_dim elements each, row_stride apart in global memory)
// into a padded shared tile, asynchronously, spread over the whole block; rows >= T become zeros
// so that no stale value (possibly NaN) can reach an mma.
template <int ROWS, int HEAD_DIM>
__device__ __forceinline__ void load_tile_async(bf16 *tile, const bf16 *head, size_t row_stride, int row0, int T) {
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
    constexpr int CHUNKS = ROWS * CHUNKS_PER_ROW;
    static_assert(CHUNKS % ATTENTION_THREADS == 0, "tile must split evenly over the block");
#pragma unroll
    for (int i = 0; i < CHUNKS / ATTENTION_THREADS; i++) {
        int chunk = i * ATTENTION_THREADS + (int)threadIdx.x;
        int r = chunk / CHUNKS_PER_ROW, col = (chunk % CHUNKS_PER_ROW) * 8;
        bool valid = row0 + r < T;
        cp_async_16(tile + r * LD + col, head + (size_t)(valid ? row0 + r : 0) * row_stride + col, valid);
    }
}

// Writes a warp's 16 x HEAD_DIM accumulators as BF16 into its 16 shared rows, row g scaled by
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

// Copies a warp's 16 staged shared rows to global rows first_row.. of one head, skipping rows >= T.
template <int HEAD_DIM>
__device__ __forceinline__ void store_warp_rows(bf16 *head, size_t row_stride, int first_row, int T,
                                                const bf16 *rows, int ld, int lane) {
    constexpr int CHUNKS_PER_ROW = HEAD_DIM / 8;
#pragma unroll
    for (int chunk = lane; chunk < 16 * CHUNKS_PER_ROW; chunk += 32) {
        int r = chunk / CHUNKS_PER_ROW, col = (chunk % CHUNKS_PER_ROW) * 8;
        if (first_row + r < T) store16(head + (size_t)(first_row + r) * row_stride + col, load16(rows + r * ld + col));
    }
}

// ---- forward ------------------------------------------------------------------------------------

// Block: 128 query rows of head h of batch b; warp w: rows 16w..16w+15 of them. Each K/V tile is
// prefetched (cp.async, two stages) while the previous one is used. Online softmax in base 2:
// m = running max of S log2(e), l = running sum of 2^(S log2(e) - m), O rescaled when m grows.
template <int HEAD_DIM, int KV_TILE, int MIN_BLOCKS>
__global__ void __launch_bounds__(ATTENTION_THREADS, MIN_BLOCKS)
    attention_forward_kernel(bf16 *out, float *lse, const bf16 *qkv, int T, int NH, int NKV, float softmax_scale) {
    constexpr int Q_TILE = ATTENTION_BLOCK_ROWS;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int K_STEPS = HEAD_DIM / 16, S_TILES = KV_TILE / 8, O_TILES = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *k_tiles = q_tile + Q_TILE * LD;           // two stages
    bf16 *v_tiles = k_tiles + 2 * KV_TILE * LD;     // two stages

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

    load_tile_async<Q_TILE, HEAD_DIM>(q_tile, q_head, qkv_row, q0, T);
    load_tile_async<KV_TILE, HEAD_DIM>(k_tiles, k_head, qkv_row, 0, T);
    load_tile_async<KV_TILE, HEAD_DIM>(v_tiles, v_head, qkv_row, 0, T);
    cp_async_commit();

    const int warp_row0 = q0 + warp * 16;       // this thread's rows: warp_row0 + g and + g + 8
    const int g = lane / 4, c = (lane % 4) * 2;  // ... and columns c, c + 1 of every 8-wide tile
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    uint32_t q_frag[K_STEPS][4];
    float o_acc[O_TILES][4];
#pragma unroll
    for (int dt = 0; dt < O_TILES; dt++) o_acc[dt][0] = o_acc[dt][1] = o_acc[dt][2] = o_acc[dt][3] = 0.f;
    // Tile 0 holds key 0, which every row sees, so the running max is finite after it and
    // 2^(m_old - m_new) never meets -inf - -inf.
    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};

    for (int j = 0; j < num_kv_tiles; j++) {
        cp_async_wait_all();
        __syncthreads();  // tile j visible to all; everyone is done with the stage refilled below
        if (j == 0) {
#pragma unroll
            for (int kk = 0; kk < K_STEPS; kk++) load_a_operand(q_frag[kk], q_tile, LD, warp * 16, kk * 16, lane);
        }
        if (j + 1 < num_kv_tiles) {
            int next = (j + 1) & 1;
            load_tile_async<KV_TILE, HEAD_DIM>(k_tiles + next * KV_TILE * LD, k_head, qkv_row, (j + 1) * KV_TILE, T);
            load_tile_async<KV_TILE, HEAD_DIM>(v_tiles + next * KV_TILE * LD, v_head, qkv_row, (j + 1) * KV_TILE, T);
            cp_async_commit();
        }
        const int kv0 = j * KV_TILE;
        if (kv0 > warp_row0 + 15) continue;  // the whole tile lies right of this warp's diagonal
        const bf16 *k_cur = k_tiles + (j & 1) * KV_TILE * LD;
        const bf16 *v_cur = v_tiles + (j & 1) * KV_TILE * LD;

        float s[S_TILES][4];
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K_STEPS; kk++) {
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt += 2) {
                uint32_t kb[4];
                load_b_operands_nk(kb, k_cur, LD, nt * 8, kk * 16, lane);
                mma_16x8x16(s[nt], q_frag[kk], kb[0], kb[1]);
                mma_16x8x16(s[nt + 1], q_frag[kk], kb[2], kb[3]);
            }
        }
        if (kv0 + KV_TILE - 1 > warp_row0) {  // the tile crosses this warp's diagonal
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (kv0 + nt * 8 + c + (e & 1) > warp_row0 + g + (e >> 1) * 8) s[nt][e] = -INFINITY;
        }
#pragma unroll
        for (int r = 0; r < 2; r++) {  // r = 0: row g, r = 1: row g + 8
            float tile_max = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++) tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * r], s[nt][2 * r + 1]));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));  // the 4 threads of a row
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
            float new_max = fmaxf(row_max[r], tile_max * scale_log2);
            float correction = exp2_approx(row_max[r] - new_max);
            row_max[r] = new_max;
            row_sum[r] *= correction;  // a per-thread partial sum: the 4 partials are added at the end
#pragma unroll
            for (int dt = 0; dt < O_TILES; dt++) {
                o_acc[dt][2 * r] *= correction;
                o_acc[dt][2 * r + 1] *= correction;
            }
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                for (int e = 2 * r; e < 2 * r + 2; e++) {
                    float p = exp2_approx(fmaf(s[nt][e], scale_log2, -new_max));
                    s[nt][e] = p;
                    row_sum[r] += p;
                }
        }
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) {
            uint32_t p_frag[4];
            accumulators_to_a_operand(p_frag, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
            for (int dt = 0; dt < O_TILES; dt += 2) {
                uint32_t vb[4];
                load_b_operands_kn(vb, v_cur, LD, kk * 16, dt * 8, lane);
                mma_16x8x16(o_acc[dt], p_frag, vb[0], vb[1]);
                mma_16x8x16(o_acc[dt + 1], p_frag, vb[2], vb[3]);
            }
        }
    }

    float inv_sum[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        float sum = row_sum[r];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        inv_sum[r] = 1.f / sum;
        int row = warp_row0 + g + 8 * r;
        // lse = ln(2^m l) = (m + log2 l) ln 2
        if (lane % 4 == 0 && row < T) lse[((size_t)b * NH + h) * T + row] = (row_max[r] + log2f(sum)) * ATTENTION_LN2;
    }
    // The warp's own Q rows are free (Q lives in registers since tile 0) and no other warp reads them.
    bf16 *rows = q_tile + warp * 16 * LD;
    stage_accumulator_rows<HEAD_DIM>(rows, LD, o_acc, inv_sum[0], inv_sum[1], lane);
    __syncwarp();
    store_warp_rows<HEAD_DIM>(out + ((size_t)b * T * NH + h) * HEAD_DIM, (size_t)NH * HEAD_DIM, warp_row0, T, rows,
                              LD, lane);
}

// ---- backward -----------------------------------------------------------------------------------

// D[b, h, t] = sum_d dout[b, t, h, d] * out[b, t, h, d] in FP32; HEAD_DIM / 8 lanes per row.
template <int HEAD_DIM>
__global__ void attention_backward_delta_kernel(float *delta, const bf16 *dout, const bf16 *out, int B, int T,
                                                int NH) {
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

// Issues the loads of one step of the dK/dV pass (a query tile of one query head) into a stage,
// and returns this thread's row statistics for row q0 + threadIdx.x, stored by the caller: lse in
// log2 units and D. Rows past T get lse = +inf, so that their P is exactly 0, and D = 0.
template <int HEAD_DIM, int Q_TILE>
__device__ __forceinline__ void dkdv_load_step(bf16 *q_dst, bf16 *dout_dst, float *lse_log2, float *delta_value,
                                               const bf16 *q_head, size_t qkv_row, const bf16 *dout_head,
                                               size_t dout_row, const float *lse_head, const float *delta_head,
                                               int q0, int T) {
    load_tile_async<Q_TILE, HEAD_DIM>(q_dst, q_head, qkv_row, q0, T);
    load_tile_async<Q_TILE, HEAD_DIM>(dout_dst, dout_head, dout_row, q0, T);
    cp_async_commit();
    int q = q0 + (int)threadIdx.x;
    bool valid = (int)threadIdx.x < Q_TILE && q < T;
    *lse_log2 = valid ? lse_head[q] * ATTENTION_LOG2E : INFINITY;
    *delta_value = valid ? delta_head[q] : 0.f;
}

// Block: 128 key rows of kv head kv_head of batch b; warp w: rows 16w..16w+15. For every query
// head of the group and every query tile from the diagonal on (Q, dO, lse, D double-buffered):
//   S^T = K Q^T, P^T = 2^(S^T scale log2 e - lse log2 e), dV += P^T dO,
//   dP^T = V dO^T, dS^T = P^T (dP^T - D), dK += dS^T Q.
// Computing the transposes keeps key rows in the accumulators' rows, so P^T and dS^T feed the
// dV and dK products straight from registers.
template <int HEAD_DIM, int Q_TILE, int MIN_BLOCKS>
__global__ void __launch_bounds__(ATTENTION_THREADS, MIN_BLOCKS)
    attention_backward_dkdv_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                                   const float *delta, int T, int NH, int NKV, float softmax_scale) {
    constexpr int KV_TILE = ATTENTION_BLOCK_ROWS;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int K_STEPS = HEAD_DIM / 16, S_TILES = Q_TILE / 8, D_TILES = HEAD_DIM / 8;
    static_assert(KV_TILE % Q_TILE == 0, "a key block must start on a query tile boundary");
    static_assert(Q_TILE <= ATTENTION_THREADS, "one thread loads each row's lse and D");
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *k_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *v_tile = k_tile + KV_TILE * LD;
    bf16 *q_tiles = v_tile + KV_TILE * LD;         // two stages
    bf16 *dout_tiles = q_tiles + 2 * Q_TILE * LD;  // two stages
    float *lse_tiles = reinterpret_cast<float *>(dout_tiles + 2 * Q_TILE * LD);  // two stages, log2 units
    float *delta_tiles = lse_tiles + 2 * Q_TILE;                                  // two stages

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

    load_tile_async<KV_TILE, HEAD_DIM>(k_tile, qkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row, kv0, T);
    load_tile_async<KV_TILE, HEAD_DIM>(v_tile, qkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row,
                                       kv0, T);
    {
        int head = kv_head * group, q0 = first_q_tile * Q_TILE;
        float lse_log2, delta_value;
        dkdv_load_step<HEAD_DIM, Q_TILE>(q_tiles, dout_tiles, &lse_log2, &delta_value,
                                         qkv_batch + (size_t)head * HEAD_DIM, qkv_row,
                                         dout_batch + (size_t)head * HEAD_DIM, dout_row,
                                         lse_batch + (size_t)head * T, delta_batch + (size_t)head * T, q0, T);
        if ((int)threadIdx.x < Q_TILE) {
            lse_tiles[threadIdx.x] = lse_log2;
            delta_tiles[threadIdx.x] = delta_value;
        }
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
        cp_async_wait_all();
        __syncthreads();  // this step's tiles visible to all; everyone is done with the stage refilled below
        const int stage = step & 1;
        float next_lse_log2 = INFINITY, next_delta = 0.f;
        if (step + 1 < steps) {
            int head = kv_head * group + (step + 1) / q_tiles_per_head;
            int q0 = (first_q_tile + (step + 1) % q_tiles_per_head) * Q_TILE;
            dkdv_load_step<HEAD_DIM, Q_TILE>(q_tiles + (stage ^ 1) * Q_TILE * LD, dout_tiles + (stage ^ 1) * Q_TILE * LD,
                                             &next_lse_log2, &next_delta, qkv_batch + (size_t)head * HEAD_DIM,
                                             qkv_row, dout_batch + (size_t)head * HEAD_DIM, dout_row,
                                             lse_batch + (size_t)head * T, delta_batch + (size_t)head * T, q0, T);
        }
        const int q0 = (first_q_tile + step % q_tiles_per_head) * Q_TILE;
        // Skip when all of the warp's keys lie past T or after the tile's last query.
        if (warp_kv0 < T && warp_kv0 <= q0 + Q_TILE - 1) {
            const bf16 *q_cur = q_tiles + stage * Q_TILE * LD;
            const bf16 *dout_cur = dout_tiles + stage * Q_TILE * LD;
            const float *lse_cur = lse_tiles + stage * Q_TILE;
            const float *delta_cur = delta_tiles + stage * Q_TILE;

            float pt[S_TILES][4];  // S^T, then P^T: key rows x query columns
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++) pt[nt][0] = pt[nt][1] = pt[nt][2] = pt[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < K_STEPS; kk++) {
                uint32_t ka[4];
                load_a_operand(ka, k_tile, LD, warp * 16, kk * 16, lane);
#pragma unroll
                for (int nt = 0; nt < S_TILES; nt += 2) {
                    uint32_t qb[4];
                    load_b_operands_nk(qb, q_cur, LD, nt * 8, kk * 16, lane);
                    mma_16x8x16(pt[nt], ka, qb[0], qb[1]);
                    mma_16x8x16(pt[nt + 1], ka, qb[2], qb[3]);
                }
            }
            const bool crosses_diagonal = warp_kv0 + 15 > q0;
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int q_local = nt * 8 + c + (e & 1);
                    float p = exp2_approx(fmaf(pt[nt][e], scale_log2, -lse_cur[q_local]));
                    pt[nt][e] = crosses_diagonal && warp_kv0 + g + (e >> 1) * 8 > q0 + q_local ? 0.f : p;
                }
#pragma unroll
            for (int kq = 0; kq < Q_TILE / 16; kq++) {  // dV += P^T dO
                uint32_t pa[4];
                accumulators_to_a_operand(pa, pt[2 * kq], pt[2 * kq + 1]);
#pragma unroll
                for (int dt = 0; dt < D_TILES; dt += 2) {
                    uint32_t db[4];
                    load_b_operands_kn(db, dout_cur, LD, kq * 16, dt * 8, lane);
                    mma_16x8x16(dv_acc[dt], pa, db[0], db[1]);
                    mma_16x8x16(dv_acc[dt + 1], pa, db[2], db[3]);
                }
            }
            float dst[S_TILES][4];  // dP^T, then dS^T
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++) dst[nt][0] = dst[nt][1] = dst[nt][2] = dst[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < K_STEPS; kk++) {
                uint32_t va[4];
                load_a_operand(va, v_tile, LD, warp * 16, kk * 16, lane);
#pragma unroll
                for (int nt = 0; nt < S_TILES; nt += 2) {
                    uint32_t db[4];
                    load_b_operands_nk(db, dout_cur, LD, nt * 8, kk * 16, lane);
                    mma_16x8x16(dst[nt], va, db[0], db[1]);
                    mma_16x8x16(dst[nt + 1], va, db[2], db[3]);
                }
            }
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
                for (int e = 0; e < 4; e++) dst[nt][e] = pt[nt][e] * (dst[nt][e] - delta_cur[nt * 8 + c + (e & 1)]);
#pragma unroll
            for (int kq = 0; kq < Q_TILE / 16; kq++) {  // dK += dS^T Q (scaled at the end)
                uint32_t dsa[4];
                accumulators_to_a_operand(dsa, dst[2 * kq], dst[2 * kq + 1]);
#pragma unroll
                for (int dt = 0; dt < D_TILES; dt += 2) {
                    uint32_t qb[4];
                    load_b_operands_kn(qb, q_cur, LD, kq * 16, dt * 8, lane);
                    mma_16x8x16(dk_acc[dt], dsa, qb[0], qb[1]);
                    mma_16x8x16(dk_acc[dt + 1], dsa, qb[2], qb[3]);
                }
            }
        }
        if (step + 1 < steps && (int)threadIdx.x < Q_TILE) {
            lse_tiles[(stage ^ 1) * Q_TILE + threadIdx.x] = next_lse_log2;
            delta_tiles[(stage ^ 1) * Q_TILE + threadIdx.x] = next_delta;
        }
    }

    // The warp's own K and V rows are free now, and no other warp ever reads them.
    bf16 *k_rows = k_tile + warp * 16 * LD, *v_rows = v_tile + warp * 16 * LD;
    stage_accumulator_rows<HEAD_DIM>(k_rows, LD, dk_acc, softmax_scale, softmax_scale, lane);
    stage_accumulator_rows<HEAD_DIM>(v_rows, LD, dv_acc, 1.f, 1.f, lane);
    __syncwarp();
    store_warp_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + kv_head) * HEAD_DIM, qkv_row, warp_kv0, T, k_rows, LD, lane);
    store_warp_rows<HEAD_DIM>(dqkv_batch + (size_t)(NH + NKV + kv_head) * HEAD_DIM, qkv_row, warp_kv0, T, v_rows, LD,
                              lane);
}

// Block: 128 query rows of head h of batch b (Q and dO resident), walking the K/V tiles up to the
// diagonal like the forward pass: S = Q K^T, P = 2^(S scale log2 e - lse log2 e), dP = dO V^T,
// dS = P (dP - D), dQ += dS K.
template <int HEAD_DIM, int KV_TILE, int MIN_BLOCKS>
__global__ void __launch_bounds__(ATTENTION_THREADS, MIN_BLOCKS)
    attention_backward_dq_kernel(bf16 *dqkv, const bf16 *qkv, const bf16 *dout, const float *lse,
                                 const float *delta, int T, int NH, int NKV, float softmax_scale) {
    constexpr int Q_TILE = ATTENTION_BLOCK_ROWS;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    constexpr int K_STEPS = HEAD_DIM / 16, S_TILES = KV_TILE / 8, D_TILES = HEAD_DIM / 8;
    extern __shared__ __align__(16) unsigned char attention_smem[];
    bf16 *q_tile = reinterpret_cast<bf16 *>(attention_smem);
    bf16 *dout_tile = q_tile + Q_TILE * LD;
    bf16 *k_tiles = dout_tile + Q_TILE * LD;     // two stages
    bf16 *v_tiles = k_tiles + 2 * KV_TILE * LD;  // two stages

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

    load_tile_async<Q_TILE, HEAD_DIM>(q_tile, qkv_batch + (size_t)h * HEAD_DIM, qkv_row, q0, T);
    load_tile_async<Q_TILE, HEAD_DIM>(dout_tile, dout + (size_t)b * T * dout_row + (size_t)h * HEAD_DIM, dout_row,
                                      q0, T);
    load_tile_async<KV_TILE, HEAD_DIM>(k_tiles, k_head, qkv_row, 0, T);
    load_tile_async<KV_TILE, HEAD_DIM>(v_tiles, v_head, qkv_row, 0, T);
    cp_async_commit();

    const int warp_row0 = q0 + warp * 16;
    const int g = lane / 4, c = (lane % 4) * 2;
    const float scale_log2 = softmax_scale * ATTENTION_LOG2E;
    float row_lse_log2[2], row_delta[2];  // rows g and g + 8; rows past T: P = 0
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = warp_row0 + g + 8 * r;
        size_t index = ((size_t)b * NH + h) * T + row;
        row_lse_log2[r] = row < T ? lse[index] * ATTENTION_LOG2E : INFINITY;
        row_delta[r] = row < T ? delta[index] : 0.f;
    }
    float dq_acc[D_TILES][4];
#pragma unroll
    for (int dt = 0; dt < D_TILES; dt++) dq_acc[dt][0] = dq_acc[dt][1] = dq_acc[dt][2] = dq_acc[dt][3] = 0.f;

    for (int j = 0; j < num_kv_tiles; j++) {
        cp_async_wait_all();
        __syncthreads();  // tile j visible to all; everyone is done with the stage refilled below
        if (j + 1 < num_kv_tiles) {
            int next = (j + 1) & 1;
            load_tile_async<KV_TILE, HEAD_DIM>(k_tiles + next * KV_TILE * LD, k_head, qkv_row, (j + 1) * KV_TILE, T);
            load_tile_async<KV_TILE, HEAD_DIM>(v_tiles + next * KV_TILE * LD, v_head, qkv_row, (j + 1) * KV_TILE, T);
            cp_async_commit();
        }
        const int kv0 = j * KV_TILE;
        if (kv0 > warp_row0 + 15) continue;  // the whole tile lies right of this warp's diagonal
        const bf16 *k_cur = k_tiles + (j & 1) * KV_TILE * LD;
        const bf16 *v_cur = v_tiles + (j & 1) * KV_TILE * LD;

        float p[S_TILES][4];  // S, then P
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++) p[nt][0] = p[nt][1] = p[nt][2] = p[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K_STEPS; kk++) {
            uint32_t qa[4];
            load_a_operand(qa, q_tile, LD, warp * 16, kk * 16, lane);
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt += 2) {
                uint32_t kb[4];
                load_b_operands_nk(kb, k_cur, LD, nt * 8, kk * 16, lane);
                mma_16x8x16(p[nt], qa, kb[0], kb[1]);
                mma_16x8x16(p[nt + 1], qa, kb[2], kb[3]);
            }
        }
        const bool crosses_diagonal = kv0 + KV_TILE - 1 > warp_row0;
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float prob = exp2_approx(fmaf(p[nt][e], scale_log2, -row_lse_log2[e >> 1]));
                p[nt][e] = crosses_diagonal && kv0 + nt * 8 + c + (e & 1) > warp_row0 + g + (e >> 1) * 8 ? 0.f : prob;
            }
        float ds[S_TILES][4];  // dP, then dS
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++) ds[nt][0] = ds[nt][1] = ds[nt][2] = ds[nt][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < K_STEPS; kk++) {
            uint32_t da[4];
            load_a_operand(da, dout_tile, LD, warp * 16, kk * 16, lane);
#pragma unroll
            for (int nt = 0; nt < S_TILES; nt += 2) {
                uint32_t vb[4];
                load_b_operands_nk(vb, v_cur, LD, nt * 8, kk * 16, lane);
                mma_16x8x16(ds[nt], da, vb[0], vb[1]);
                mma_16x8x16(ds[nt + 1], da, vb[2], vb[3]);
            }
        }
#pragma unroll
        for (int nt = 0; nt < S_TILES; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) ds[nt][e] = p[nt][e] * (ds[nt][e] - row_delta[e >> 1]);
#pragma unroll
        for (int kk = 0; kk < KV_TILE / 16; kk++) {  // dQ += dS K (scaled at the end)
            uint32_t dsa[4];
            accumulators_to_a_operand(dsa, ds[2 * kk], ds[2 * kk + 1]);
#pragma unroll
            for (int dt = 0; dt < D_TILES; dt += 2) {
                uint32_t kb[4];
                load_b_operands_kn(kb, k_cur, LD, kk * 16, dt * 8, lane);
                mma_16x8x16(dq_acc[dt], dsa, kb[0], kb[1]);
                mma_16x8x16(dq_acc[dt + 1], dsa, kb[2], kb[3]);
            }
        }
    }

    // The warp's own Q rows are free now, and no other warp ever reads them.
    bf16 *rows = q_tile + warp * 16 * LD;
    stage_accumulator_rows<HEAD_DIM>(rows, LD, dq_acc, softmax_scale, softmax_scale, lane);
    __syncwarp();
    store_warp_rows<HEAD_DIM>(dqkv + (size_t)b * T * qkv_row + (size_t)h * HEAD_DIM, qkv_row, warp_row0, T, rows, LD,
                              lane);
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

template <int HEAD_DIM>
static void attention_forward_launch(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                     cudaStream_t stream) {
    typedef AttentionTiles<HEAD_DIM> Tiles;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    size_t smem = (size_t)(ATTENTION_BLOCK_ROWS + 4 * Tiles::forward_kv) * LD * sizeof(bf16);
    auto kernel = attention_forward_kernel<HEAD_DIM, Tiles::forward_kv, Tiles::forward_min_blocks>;
    attention_launch_setup(kernel, smem);
    dim3 grid(ceil_div(T, ATTENTION_BLOCK_ROWS), NH, B);
    kernel<<<grid, ATTENTION_THREADS, smem, stream>>>(out, lse, qkv, T, NH, NKV, attention_softmax_scale(HEAD_DIM));
    cudaCheckLaunch();
}

template <int HEAD_DIM>
static void attention_backward_launch(bf16 *dqkv, float *delta, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                                      const float *lse, int B, int T, int NH, int NKV, cudaStream_t stream) {
    typedef AttentionTiles<HEAD_DIM> Tiles;
    constexpr int LD = HEAD_DIM + ATTENTION_SMEM_PAD;
    const float scale = attention_softmax_scale(HEAD_DIM);

    size_t delta_threads = (size_t)B * T * NH * (HEAD_DIM / 8);
    attention_backward_delta_kernel<HEAD_DIM><<<(unsigned)ceil_div_size(delta_threads, 256), 256, 0, stream>>>(
        delta, dout, out, B, T, NH);
    cudaCheckLaunch();

    size_t dkdv_smem = (size_t)(2 * ATTENTION_BLOCK_ROWS + 4 * Tiles::dkdv_q) * LD * sizeof(bf16) +
                       4 * Tiles::dkdv_q * sizeof(float);
    auto dkdv = attention_backward_dkdv_kernel<HEAD_DIM, Tiles::dkdv_q, Tiles::dkdv_min_blocks>;
    attention_launch_setup(dkdv, dkdv_smem);
    dkdv<<<dim3(ceil_div(T, ATTENTION_BLOCK_ROWS), NKV, B), ATTENTION_THREADS, dkdv_smem, stream>>>(
        dqkv, qkv, dout, lse, delta, T, NH, NKV, scale);
    cudaCheckLaunch();

    size_t dq_smem = (size_t)(2 * ATTENTION_BLOCK_ROWS + 4 * Tiles::dq_kv) * LD * sizeof(bf16);
    auto dq = attention_backward_dq_kernel<HEAD_DIM, Tiles::dq_kv, Tiles::dq_min_blocks>;
    attention_launch_setup(dq, dq_smem);
    dq<<<dim3(ceil_div(T, ATTENTION_BLOCK_ROWS), NH, B), ATTENTION_THREADS, dq_smem, stream>>>(
        dqkv, qkv, dout, lse, delta, T, NH, NKV, scale);
    cudaCheckLaunch();
}

// out [B, T, NH, head_dim] and lse [B, NH, T] from the packed qkv [B, T, (NH + 2 NKV) head_dim].
static inline void attention_forward(bf16 *out, float *lse, const bf16 *qkv, int B, int T, int NH, int NKV,
                                     int head_dim, cudaStream_t stream) {
    const void *pointers[] = {out, lse, qkv};
    attention_check_args("attention_forward", pointers, 3, B, T, NH, NKV, head_dim);
    if (head_dim == 64) attention_forward_launch<64>(out, lse, qkv, B, T, NH, NKV, stream);
    else attention_forward_launch<128>(out, lse, qkv, B, T, NH, NKV, stream);
}

// Bytes of device scratch attention_backward needs: D, one float per (batch, head, position).
static inline size_t attention_backward_scratch_bytes(int B, int T, int NH) {
    return (size_t)B * NH * T * sizeof(float);
}

// Writes all of dqkv (packed like qkv) from dout and the forward's qkv, out and lse.
// scratch: attention_backward_scratch_bytes(B, T, NH) bytes of device memory.
static inline void attention_backward(bf16 *dqkv, float *scratch, const bf16 *dout, const bf16 *qkv, const bf16 *out,
                                      const float *lse, int B, int T, int NH, int NKV, int head_dim,
                                      cudaStream_t stream) {
    const void *pointers[] = {dqkv, scratch, dout, qkv, out, lse};
    attention_check_args("attention_backward", pointers, 6, B, T, NH, NKV, head_dim);
    if (head_dim == 64) attention_backward_launch<64>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, stream);
    else attention_backward_launch<128>(dqkv, scratch, dout, qkv, out, lse, B, T, NH, NKV, stream);
}
