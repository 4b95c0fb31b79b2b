// Token embedding lookup and its deterministic backward pass.
//   forward:  out[n, :] = wte[tokens[n], :]
//   backward: dwte[v, :] += sum over n with tokens[n] == v of dout[n, :]
// Layouts: tokens [N] int in [0, V); wte, dwte [V, C] and out, dout [N, C] row-major BF16.
// Rows move as 16-byte vectors: C must be a multiple of 8 and pointers 16-byte aligned.
//
// The backward pass is bitwise reproducible without float atomics:
//   1. a stable radix sort (CUB) of the positions by token, so each token's positions form
//      one run of the sorted list, in increasing position order;
//   2. the sorted list is cut into chunks of EMBEDDING_BACKWARD_CHUNK entries; a block sums
//      each run's piece inside its chunk in FP32, in sorted order. A run that lies inside one
//      chunk is added to dwte right there; a run that crosses a chunk boundary leaves its
//      pieces in scratch (the head piece of the chunk where it starts, a continuation piece
//      for each later chunk);
//   3. the chunk where such a run starts adds its head piece and then the continuation
//      pieces in chunk order, and adds the total to dwte.
// Every dwte row therefore has exactly one writer and a fixed summation order.
#pragma once
#include <cub/device/device_radix_sort.cuh>
#include "common.cuh"

#define EMBEDDING_FORWARD_THREADS 256
#define EMBEDDING_BACKWARD_CHUNK 32     // sorted entries per block; one per lane of a warp
#define EMBEDDING_BACKWARD_THREADS 128  // 8-column vectors per block; blockIdx.y picks the slice
#define EMBEDDING_BACKWARD_BATCH 8      // dout rows loaded before they are summed

__global__ void __launch_bounds__(EMBEDDING_FORWARD_THREADS)
    embedding_forward_kernel(bf16 *out, const int *tokens, const bf16 *wte, int N, int C) {
    size_t vec = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    size_t vecs_per_row = (size_t)C / 8;
    if (vec >= (size_t)N * vecs_per_row) return;
    size_t row = vec / vecs_per_row, column = (vec % vecs_per_row) * 8;
    store16(out + row * C + column, load16(wte + (size_t)tokens[row] * C + column));
}

__global__ void embedding_iota_kernel(int *positions, int N) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) positions[i] = i;
}

__device__ __forceinline__ void embedding_accumulate_row(float acc[8], const Vec16<bf16> &v) {
    for (int k = 0; k < 8; k++) acc[k] += __bfloat162float(v[k]);
}

__device__ __forceinline__ void embedding_accumulate_partial(float acc[8], const float *src) {
    float4 a = reinterpret_cast<const float4 *>(src)[0], b = reinterpret_cast<const float4 *>(src)[1];
    float values[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    for (int k = 0; k < 8; k++) acc[k] += values[k];
}

__device__ __forceinline__ void embedding_store_partial(float *dst, const float acc[8]) {
    reinterpret_cast<float4 *>(dst)[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    reinterpret_cast<float4 *>(dst)[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
}

__device__ __forceinline__ void embedding_add_to_table_row(bf16 *dst, const float acc[8]) {
    Vec16<bf16> v = load16(dst);
    for (int k = 0; k < 8; k++) v[k] = __float2bfloat16(__bfloat162float(v[k]) + acc[k]);
    store16(dst, v);
}

// Step 2. Block (chunk, column slice); each thread owns 8 columns. Lane k of every warp holds
// sorted entry begin + k (token and position) and hands it to the others with shuffles.
__global__ void __launch_bounds__(EMBEDDING_BACKWARD_THREADS)
    embedding_backward_chunk_kernel(bf16 *__restrict__ dwte, float *__restrict__ head_partial,
                                    float *__restrict__ continuation_partial, const bf16 *__restrict__ dout,
                                    const int *__restrict__ sorted_tokens, const int *__restrict__ sorted_positions,
                                    int N, int C) {
    static_assert(EMBEDDING_BACKWARD_CHUNK == 32, "one sorted entry per lane");
    static_assert(EMBEDDING_BACKWARD_CHUNK % EMBEDDING_BACKWARD_BATCH == 0, "batches tile a chunk");
    const unsigned all_lanes = 0xffffffffu;
    int lane = threadIdx.x % 32;
    int begin = blockIdx.x * EMBEDDING_BACKWARD_CHUNK;
    int count = min(EMBEDDING_BACKWARD_CHUNK, N - begin);
    int column = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    bool active = column < C;  // inactive threads still take part in the shuffles

    int lane_token = lane < count ? sorted_tokens[begin + lane] : -1;
    int lane_position = lane < count ? sorted_positions[begin + lane] : 0;
    int token_before = begin > 0 ? sorted_tokens[begin - 1] : -1;
    int token_after = begin + count < N ? sorted_tokens[begin + count] : -1;

    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    bool first_piece = true;
    for (int batch = 0; batch < count; batch += EMBEDDING_BACKWARD_BATCH) {
        Vec16<bf16> rows[EMBEDDING_BACKWARD_BATCH];
#pragma unroll
        for (int j = 0; j < EMBEDDING_BACKWARD_BATCH; j++) {
            int position = __shfl_sync(all_lanes, lane_position, batch + j);
            if (active && batch + j < count) rows[j] = load16(dout + (size_t)position * C + column);
        }
#pragma unroll
        for (int j = 0; j < EMBEDDING_BACKWARD_BATCH; j++) {
            int k = batch + j;
            int token = __shfl_sync(all_lanes, lane_token, k);
            int shuffled_next = __shfl_sync(all_lanes, lane_token, (k + 1) % 32);
            if (k >= count) break;  // the same for the whole warp
            if (active) embedding_accumulate_row(acc, rows[j]);
            bool chunk_ends = k + 1 == count;
            bool run_ends = (chunk_ends ? token_after : shuffled_next) != token;
            if (!run_ends && !chunk_ends) continue;
            bool run_started_before = first_piece && token == token_before;
            if (active) {
                if (run_started_before)
                    embedding_store_partial(continuation_partial + (size_t)blockIdx.x * C + column, acc);
                else if (!run_ends)
                    embedding_store_partial(head_partial + (size_t)blockIdx.x * C + column, acc);
                else
                    embedding_add_to_table_row(dwte + (size_t)token * C + column, acc);
            }
            for (int c = 0; c < 8; c++) acc[c] = 0.0f;
            first_piece = false;
        }
    }
}

// Step 3. Block (chunk, column slice): only the chunk where a crossing run starts works.
__global__ void __launch_bounds__(EMBEDDING_BACKWARD_THREADS)
    embedding_backward_span_kernel(bf16 *__restrict__ dwte, const float *__restrict__ head_partial,
                                   const float *__restrict__ continuation_partial,
                                   const int *__restrict__ sorted_tokens, int N, int C) {
    int begin = blockIdx.x * EMBEDDING_BACKWARD_CHUNK;
    int end = begin + EMBEDDING_BACKWARD_CHUNK;
    int column = (blockIdx.y * blockDim.x + threadIdx.x) * 8;
    if (column >= C || end >= N) return;  // the last chunk has no run crossing its end
    int token = sorted_tokens[end - 1];
    if (sorted_tokens[end] != token) return;  // the chunk's last run ends inside it
    // Sorted order: the first entry equals the last only when the whole chunk is one run;
    // if that run also came from the previous chunk, an earlier chunk owns it.
    if (sorted_tokens[begin] == token && begin > 0 && sorted_tokens[begin - 1] == token) return;

    int low = end, high = N;  // first sorted index past the run: binary search in [end, N]
    while (low < high) {
        int mid = low + (high - low) / 2;
        if (sorted_tokens[mid] <= token) low = mid + 1;
        else high = mid;
    }
    int last_chunk = (low - 1) / EMBEDDING_BACKWARD_CHUNK;

    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    embedding_accumulate_partial(acc, head_partial + (size_t)blockIdx.x * C + column);
    for (int chunk = blockIdx.x + 1; chunk <= last_chunk; chunk++)
        embedding_accumulate_partial(acc, continuation_partial + (size_t)chunk * C + column);
    embedding_add_to_table_row(dwte + (size_t)token * C + column, acc);
}

// Byte offsets of the pieces of the backward scratch buffer, each 256-byte aligned.
typedef struct {
    size_t sorted_tokens, positions, sorted_positions, sort_temp, head_partial, continuation_partial;
    size_t sort_temp_bytes, total_bytes;
    int sort_end_bit;  // the radix sort looks only at the bits that a token below V can set
} EmbeddingBackwardScratch;

static inline size_t embedding_align_bytes(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Needs the CUDA device that will run the backward pass to be current: CUB sizes its
// temporary storage for it.
static inline EmbeddingBackwardScratch embedding_backward_scratch_layout(int N, int C, int V) {
    EmbeddingBackwardScratch layout;
    layout.sort_end_bit = 1;
    while (layout.sort_end_bit < 31 && (1u << layout.sort_end_bit) < (unsigned)V) layout.sort_end_bit++;
    layout.sort_temp_bytes = 0;
    cudaCheck(cub::DeviceRadixSort::SortPairs(nullptr, layout.sort_temp_bytes, (const unsigned *)nullptr,
                                              (unsigned *)nullptr, (const int *)nullptr, (int *)nullptr, N, 0,
                                              layout.sort_end_bit));
    size_t chunks = (size_t)ceil_div(N, EMBEDDING_BACKWARD_CHUNK);
    size_t index_bytes = embedding_align_bytes((size_t)N * sizeof(int));
    size_t partial_bytes = embedding_align_bytes(chunks * (size_t)C * sizeof(float));
    layout.sorted_tokens = 0;
    layout.positions = layout.sorted_tokens + index_bytes;
    layout.sorted_positions = layout.positions + index_bytes;
    layout.sort_temp = layout.sorted_positions + index_bytes;
    layout.head_partial = layout.sort_temp + embedding_align_bytes(layout.sort_temp_bytes);
    layout.continuation_partial = layout.head_partial + partial_bytes;
    layout.total_bytes = layout.continuation_partial + partial_bytes;
    return layout;
}

static inline size_t embedding_backward_scratch_bytes(int N, int C, int V) {
    return embedding_backward_scratch_layout(N, C, V).total_bytes;
}

// out[N, C] = wte[tokens[n]]; tokens must lie in [0, V).
static inline void embedding_forward(bf16 *out, const int *tokens, const bf16 *wte, int N, int C,
                                     cudaStream_t stream) {
    require_vector_rows("embedding_forward", "C", C);
    size_t vecs = (size_t)N * (size_t)(C / 8);
    unsigned blocks = (unsigned)ceil_div_size(vecs, EMBEDDING_FORWARD_THREADS);
    embedding_forward_kernel<<<blocks, EMBEDDING_FORWARD_THREADS, 0, stream>>>(out, tokens, wte, N, C);
    cudaCheckLaunch();
}

// dwte[V, C] += the sum of dout rows per token. scratch holds embedding_backward_scratch_bytes(N, C, V).
static inline void embedding_backward(bf16 *dwte, const bf16 *dout, const int *tokens, int N, int C, int V,
                                      void *scratch, cudaStream_t stream) {
    require_vector_rows("embedding_backward", "C", C);
    EmbeddingBackwardScratch layout = embedding_backward_scratch_layout(N, C, V);
    char *base = (char *)scratch;
    int *sorted_tokens = (int *)(base + layout.sorted_tokens);
    int *positions = (int *)(base + layout.positions);
    int *sorted_positions = (int *)(base + layout.sorted_positions);
    float *head_partial = (float *)(base + layout.head_partial);
    float *continuation_partial = (float *)(base + layout.continuation_partial);

    embedding_iota_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(positions, N);
    cudaCheckLaunch();
    // Tokens are non-negative, so sorting their bits as unsigned keeps their order.
    cudaCheck(cub::DeviceRadixSort::SortPairs(base + layout.sort_temp, layout.sort_temp_bytes,
                                              reinterpret_cast<const unsigned *>(tokens),
                                              reinterpret_cast<unsigned *>(sorted_tokens), positions,
                                              sorted_positions, N, 0, layout.sort_end_bit, stream));
    dim3 grid(ceil_div(N, EMBEDDING_BACKWARD_CHUNK), ceil_div(C / 8, EMBEDDING_BACKWARD_THREADS));
    embedding_backward_chunk_kernel<<<grid, EMBEDDING_BACKWARD_THREADS, 0, stream>>>(
        dwte, head_partial, continuation_partial, dout, sorted_tokens, sorted_positions, N, C);
    cudaCheckLaunch();
    embedding_backward_span_kernel<<<grid, EMBEDDING_BACKWARD_THREADS, 0, stream>>>(
        dwte, head_partial, continuation_partial, sorted_tokens, N, C);
    cudaCheckLaunch();
}
