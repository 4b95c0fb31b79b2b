// Matrix products on cuBLASLt, BF16 and FP8, described in row-major terms; and the launchers
// of a linear layer y = x W^T (forward, input gradient, weight gradient) that the model calls.
//
//   matmul_lt:  out[M,N] (+)= scale_a * scale_b * sum_k A(m,k) B(n,k)      (FP32 accumulation)
//
// Every matrix is row-major with its own row stride (elements between two rows). An operand is
// K-major when K is its contiguous dimension (A stored [M,K], B stored [N,K]), MN-major
// otherwise (A stored [K,M], B stored [K,N]). For a linear layer with W [OC,IC] and x [N,IC]:
//   forward  y[N,OC]   = x W^T   A = x [N,IC] K-major     B = W [OC,IC] K-major
//   dgrad    dx[N,IC]  = dy W    A = dy [N,OC] K-major    B = W [OC,IC] MN-major
//   wgrad    dW[OC,IC] = dy^T x  A = dy [N,OC] MN-major   B = x [N,IC] MN-major
// Hopper runs FP8 only with both operands K-major ("TN"), so the FP8 dgrad takes W^T [IC,OC]
// and the FP8 wgrad takes dy^T [OC,N] and x^T [IC,N], written by the quantize kernels.
//
// Why the mapping works: cuBLASLt is column-major, and a row-major [R,C] matrix with stride ld
// is the column-major [C,R] matrix with the same ld. So we ask cuBLASLt for out^T [N,M] =
// B * A^T: cuBLAS's A is our B and cuBLAS's B is our A, with m = N, n = M, k = K. A K-major B
// is column-major [K,N] and enters transposed; a K-major A is column-major [K,M] and enters as
// is: cuBLAS's "TN" is exactly "both operands K-major".
//
// Requirements (checked; a violation exits with an error naming the product): pointers 16-byte
// aligned and row strides multiples of 16 bytes (BF16: 8 elements, FP8: 16, FP32: 4) so that the
// tensor-core kernels load whole 16-byte vectors; operands both BF16, or both FP8 and not
// E5M2 x E5M2; output BF16 or FP32. FP8 also needs K and N multiples of 16. Scales are device
// pointers to one FP32 dequantization factor each (real value = fp8 value * scale): the GPU
// reads them, the host never waits. They exist only for FP8 operands (NULL means 1), and must
// be 16-byte aligned: cuBLASLt 13.1 refuses every algorithm ("not supported") for a scale at
// a 4-byte offset, so an array of scales keeps one per 16 bytes.
//
// The algorithm cuBLASLt's heuristic picks is cached per (shape, strides, types, layouts,
// pointer alignments, accumulation mode) in a fixed table of the GpuContext, beside the handle
// and the workspace.
#pragma once
#include <cuda_fp8.h>
#include <stdint.h>
#include <string.h>
#include "common.cuh"
#include "dtype.h"

typedef enum { MATMUL_K_MAJOR, MATMUL_MN_MAJOR } MatmulLayout;

typedef struct {
    const void *data;
    DType type;
    MatmulLayout layout;
    int row_stride;      // elements between consecutive stored rows
    const float *scale;  // FP8 only: device pointer to the dequantization scale, NULL = 1
} MatmulOperand;

typedef struct {
    void *data;
    DType type;          // DTYPE_BF16 or DTYPE_FP32
    int row_stride;
} MatmulOutput;

static inline MatmulOperand matmul_operand(const void *data, DType type, MatmulLayout layout, int row_stride,
                                           const float *scale) {
    MatmulOperand operand;
    operand.data = data;
    operand.type = type;
    operand.layout = layout;
    operand.row_stride = row_stride;
    operand.scale = scale;
    return operand;
}

static inline MatmulOutput matmul_output(void *data, DType type, int row_stride) {
    MatmulOutput output;
    output.data = data;
    output.type = type;
    output.row_stride = row_stride;
    return output;
}

static inline int matmul_is_aligned16(const void *pointer) { return ((uintptr_t)pointer & 15u) == 0; }

// Returns NULL when matmul_lt can run this product, else the reason it cannot.
static inline const char *matmul_unsupported_reason(const MatmulOutput *out, const MatmulOperand *a,
                                                    const MatmulOperand *b, int M, int N, int K) {
    if (M <= 0 || N <= 0 || K <= 0) return "M, N and K must be positive";
    if (out->data == NULL || a->data == NULL || b->data == NULL) return "a matrix pointer is NULL";
    if (out->type != DTYPE_BF16 && out->type != DTYPE_FP32) return "the output must be BF16 or FP32";
    int fp8 = dtype_is_fp8(a->type);
    if (fp8 != dtype_is_fp8(b->type)) return "operands must be both FP8 or both BF16";
    if (!fp8 && (a->type != DTYPE_BF16 || b->type != DTYPE_BF16)) return "non-FP8 operands must be BF16";
    if (a->type == DTYPE_E5M2 && b->type == DTYPE_E5M2) return "cuBLASLt has no E5M2 x E5M2 product";
    if (!fp8 && (a->scale != NULL || b->scale != NULL)) return "scales are for FP8 operands only";
    if (fp8 && (a->layout != MATMUL_K_MAJOR || b->layout != MATMUL_K_MAJOR))
        return "FP8 operands must both be K-major (Hopper runs FP8 only as \"TN\"); pass the transposed copy";
    if (fp8 && (K % 16 != 0 || N % 16 != 0)) return "FP8 needs K and N multiples of 16";
    if (a->row_stride < (a->layout == MATMUL_K_MAJOR ? K : M)) return "A's row stride is shorter than its rows";
    if (b->row_stride < (b->layout == MATMUL_K_MAJOR ? K : N)) return "B's row stride is shorter than its rows";
    if (out->row_stride < N) return "the output's row stride is shorter than N";
    if ((a->row_stride * dtype_size_bytes(a->type)) % 16 != 0 ||
        (b->row_stride * dtype_size_bytes(b->type)) % 16 != 0 ||
        (out->row_stride * dtype_size_bytes(out->type)) % 16 != 0)
        return "row strides must be multiples of 16 bytes (BF16: 8 elements, FP8: 16, FP32: 4)";
    if (!matmul_is_aligned16(a->data) || !matmul_is_aligned16(b->data) || !matmul_is_aligned16(out->data))
        return "pointers must be 16-byte aligned";
    if ((a->scale != NULL && !matmul_is_aligned16(a->scale)) || (b->scale != NULL && !matmul_is_aligned16(b->scale)))
        return "scale pointers must be 16-byte aligned";
    return NULL;
}

static inline cudaDataType matmul_cuda_type(DType type) {
    switch (type) {
    case DTYPE_FP32: return CUDA_R_32F;
    case DTYPE_BF16: return CUDA_R_16BF;
    case DTYPE_E4M3: return CUDA_R_8F_E4M3;
    case DTYPE_E5M2: return CUDA_R_8F_E5M2;
    }
    return CUDA_R_32F;
}

// The largest power of two, up to 256, that divides the address: cuBLASLt's heuristic assumes
// 256-byte aligned buffers unless told otherwise, and an algorithm chosen for 256 may fault on
// a pointer into the middle of a tensor.
static inline uint32_t matmul_pointer_alignment(const void *pointer) {
    uint32_t alignment = 256;
    while (alignment > 1 && ((uintptr_t)pointer % alignment) != 0) alignment >>= 1;
    return alignment;
}

// Everything the heuristic's choice depends on; all ints so that memcmp compares it exactly.
typedef struct {
    int M, N, K;
    int a_type, b_type, out_type;
    int a_layout, b_layout;
    int a_stride, b_stride, out_stride;
    int a_alignment, b_alignment, out_alignment;
    int fast_accumulation;
} MatmulAlgoKey;

#define MATMUL_HEURISTIC_CANDIDATES 8  // algorithms tried, in the heuristic's order, on a product's first use
#define MATMUL_ALGO_CACHE_ENTRIES 256

// When full, further shapes are looked up on every call (slower on the host, same result).
struct MatmulAlgoCache {
    int count;
    MatmulAlgoKey keys[MATMUL_ALGO_CACHE_ENTRIES];
    cublasLtMatmulAlgo_t algos[MATMUL_ALGO_CACHE_ENTRIES];
};

static inline MatmulAlgoCache *matmul_algo_cache(GpuContext *gpu) {
    if (gpu->matmul_algos == NULL) {
        gpu->matmul_algos = (MatmulAlgoCache *)calloc(1, sizeof(MatmulAlgoCache));
        if (gpu->matmul_algos == NULL) {
            fprintf(stderr, "error: out of host memory (cuBLASLt algorithm cache)\n");
            exit(EXIT_FAILURE);
        }
    }
    return gpu->matmul_algos;
}

static inline MatmulAlgoKey matmul_algo_key(const MatmulOutput *out, const MatmulOperand *a, const MatmulOperand *b,
                                            int M, int N, int K, bool fast_accumulation) {
    MatmulAlgoKey key;
    memset(&key, 0, sizeof(key));
    key.M = M;
    key.N = N;
    key.K = K;
    key.a_type = (int)a->type;
    key.b_type = (int)b->type;
    key.out_type = (int)out->type;
    key.a_layout = (int)a->layout;
    key.b_layout = (int)b->layout;
    key.a_stride = a->row_stride;
    key.b_stride = b->row_stride;
    key.out_stride = out->row_stride;
    key.a_alignment = (int)matmul_pointer_alignment(a->data);
    key.b_alignment = (int)matmul_pointer_alignment(b->data);
    key.out_alignment = (int)matmul_pointer_alignment(out->data);
    key.fast_accumulation = fast_accumulation ? 1 : 0;
    return key;
}

static inline void matmul_fail(const char *reason, const MatmulOutput *out, const MatmulOperand *a,
                               const MatmulOperand *b, int M, int N, int K) {
    fprintf(stderr, "error: matmul_lt (M=%d N=%d K=%d, A %s %s stride %d, B %s %s stride %d, out %s stride %d): %s\n",
            M, N, K, dtype_name(a->type), a->layout == MATMUL_K_MAJOR ? "K-major" : "MN-major", a->row_stride,
            dtype_name(b->type), b->layout == MATMUL_K_MAJOR ? "K-major" : "MN-major", b->row_stride,
            dtype_name(out->type), out->row_stride, reason);
    exit(EXIT_FAILURE);
}

// out[M,N] = scale_a * scale_b * sum_k A(m,k) B(n,k), plus the previous out when accumulate
// (beta = 1, for gradient accumulation). fast_accumulation selects Hopper's FP8 mode that skips
// the periodic promotion of partial sums to FP32 (ignored for BF16).
static inline void matmul_lt(GpuContext *gpu, MatmulOutput out, MatmulOperand a, MatmulOperand b, int M, int N,
                             int K, bool accumulate, bool fast_accumulation) {
    const char *reason = matmul_unsupported_reason(&out, &a, &b, M, N, K);
    if (reason != NULL) matmul_fail(reason, &out, &a, &b, M, N, K);
    int fp8 = dtype_is_fp8(a.type);
    fast_accumulation = fast_accumulation && fp8;

    // cuBLAS's A is our B and cuBLAS's B is our A (see the top of this file).
    cublasOperation_t transa = b.layout == MATMUL_K_MAJOR ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasOperation_t transb = a.layout == MATMUL_K_MAJOR ? CUBLAS_OP_N : CUBLAS_OP_T;
    cublasLtMatmulDesc_t desc;
    cublasCheck(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
    cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
    if (fp8) {
        int8_t fast = fast_accumulation ? 1 : 0;
        cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
        if (b.scale != NULL)
            cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &b.scale,
                                                       sizeof(b.scale)));
        if (a.scale != NULL)
            cublasCheck(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &a.scale,
                                                       sizeof(a.scale)));
    }

    // Column-major shapes: a K-major operand is [K, rows] with ld = its row stride.
    cublasLtMatrixLayout_t layout_a, layout_b, layout_d;
    if (b.layout == MATMUL_K_MAJOR)
        cublasCheck(cublasLtMatrixLayoutCreate(&layout_a, matmul_cuda_type(b.type), K, N, b.row_stride));
    else
        cublasCheck(cublasLtMatrixLayoutCreate(&layout_a, matmul_cuda_type(b.type), N, K, b.row_stride));
    if (a.layout == MATMUL_K_MAJOR)
        cublasCheck(cublasLtMatrixLayoutCreate(&layout_b, matmul_cuda_type(a.type), K, M, a.row_stride));
    else
        cublasCheck(cublasLtMatrixLayoutCreate(&layout_b, matmul_cuda_type(a.type), M, K, a.row_stride));
    cublasCheck(cublasLtMatrixLayoutCreate(&layout_d, matmul_cuda_type(out.type), N, M, out.row_stride));

    MatmulAlgoKey key = matmul_algo_key(&out, &a, &b, M, N, K, fast_accumulation);
    MatmulAlgoCache *cache = matmul_algo_cache(gpu);
    int slot = -1;
    for (int i = 0; i < cache->count && slot < 0; i++)
        if (memcmp(&cache->keys[i], &key, sizeof(key)) == 0) slot = i;
    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    cublasStatus_t status = CUBLAS_STATUS_NOT_SUPPORTED;
    if (slot >= 0) {
        status = cublasLtMatmul(gpu->cublaslt, desc, &alpha, b.data, layout_a, a.data, layout_b, &beta, out.data,
                                layout_d, out.data, layout_d, &cache->algos[slot], gpu->cublaslt_workspace,
                                gpu->cublaslt_workspace_bytes, gpu->stream);
    } else {
        cublasLtMatmulPreference_t preference;
        cublasCheck(cublasLtMatmulPreferenceCreate(&preference));
        uint64_t workspace_bytes = gpu->cublaslt_workspace_bytes;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                         &workspace_bytes, sizeof(workspace_bytes)));
        uint32_t alignment_a = (uint32_t)key.b_alignment, alignment_b = (uint32_t)key.a_alignment;
        uint32_t alignment_d = (uint32_t)key.out_alignment;
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                         &alignment_a, sizeof(alignment_a)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                         &alignment_b, sizeof(alignment_b)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                         &alignment_d, sizeof(alignment_d)));
        cublasCheck(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                         &alignment_d, sizeof(alignment_d)));
        cublasLtMatmulHeuristicResult_t heuristics[MATMUL_HEURISTIC_CANDIDATES];
        int found = 0;
        cublasStatus_t query = cublasLtMatmulAlgoGetHeuristic(gpu->cublaslt, desc, layout_a, layout_b, layout_d, layout_d,
                                                              preference, MATMUL_HEURISTIC_CANDIDATES, heuristics, &found);
        cublasCheck(cublasLtMatmulPreferenceDestroy(preference));
        if (query != CUBLAS_STATUS_SUCCESS || found == 0)
            matmul_fail("cublasLtMatmulAlgoGetHeuristic found no algorithm for this product", &out, &a, &b, M, N, K);
        // Candidates in the heuristic's order; the first that launches is kept for this product.
        for (int i = 0; i < found; i++) {
            if (heuristics[i].state != CUBLAS_STATUS_SUCCESS) continue;
            status = cublasLtMatmul(gpu->cublaslt, desc, &alpha, b.data, layout_a, a.data, layout_b, &beta, out.data,
                                    layout_d, out.data, layout_d, &heuristics[i].algo, gpu->cublaslt_workspace,
                                    gpu->cublaslt_workspace_bytes, gpu->stream);
            if (status != CUBLAS_STATUS_SUCCESS) continue;
            if (cache->count < MATMUL_ALGO_CACHE_ENTRIES) {
                cache->keys[cache->count] = key;
                cache->algos[cache->count] = heuristics[i].algo;
                cache->count++;
            }
            break;
        }
    }
    if (status != CUBLAS_STATUS_SUCCESS) {
        char reason[128];
        snprintf(reason, sizeof(reason), "cublasLtMatmul failed: %s%s", cublasLtGetStatusString(status),
                 accumulate ? " (accumulating)" : "");
        matmul_fail(reason, &out, &a, &b, M, N, K);
    }
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_d));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_b));
    cublasCheck(cublasLtMatrixLayoutDestroy(layout_a));
    cublasCheck(cublasLtMatmulDescDestroy(desc));
}

// ---- linear layer, BF16: x [N,IC], W [OC,IC], y [N,OC] ----------------------------------------

// out[N,OC] (+)= in[N,IC] weight[OC,IC]^T
static inline void matmul_forward(GpuContext *gpu, bf16 *out, const bf16 *in, const bf16 *weight, int N, int IC,
                                  int OC, bool accumulate) {
    matmul_lt(gpu, matmul_output(out, DTYPE_BF16, OC), matmul_operand(in, DTYPE_BF16, MATMUL_K_MAJOR, IC, NULL),
              matmul_operand(weight, DTYPE_BF16, MATMUL_K_MAJOR, IC, NULL), N, OC, IC, accumulate, false);
}

// din[N,IC] (+)= dout[N,OC] weight[OC,IC]
static inline void matmul_backward_input(GpuContext *gpu, bf16 *din, const bf16 *dout, const bf16 *weight, int N,
                                         int IC, int OC, bool accumulate) {
    matmul_lt(gpu, matmul_output(din, DTYPE_BF16, IC), matmul_operand(dout, DTYPE_BF16, MATMUL_K_MAJOR, OC, NULL),
              matmul_operand(weight, DTYPE_BF16, MATMUL_MN_MAJOR, IC, NULL), N, IC, OC, accumulate, false);
}

// dweight[OC,IC] (+)= dout[N,OC]^T in[N,IC]
static inline void matmul_backward_weight(GpuContext *gpu, bf16 *dweight, const bf16 *dout, const bf16 *in, int N,
                                          int IC, int OC, bool accumulate) {
    matmul_lt(gpu, matmul_output(dweight, DTYPE_BF16, IC),
              matmul_operand(dout, DTYPE_BF16, MATMUL_MN_MAJOR, OC, NULL),
              matmul_operand(in, DTYPE_BF16, MATMUL_MN_MAJOR, IC, NULL), OC, IC, N, accumulate, false);
}

// ---- linear layer, FP8 with per-tensor scales (device pointers) -------------------------------

// out[N,OC] (+)= in[N,IC] weight[OC,IC]^T, both E4M3.
static inline void matmul_forward_fp8(GpuContext *gpu, bf16 *out, const __nv_fp8_e4m3 *in, const float *in_scale,
                                      const __nv_fp8_e4m3 *weight, const float *weight_scale, int N, int IC, int OC,
                                      bool accumulate, bool fast_accumulation) {
    matmul_lt(gpu, matmul_output(out, DTYPE_BF16, OC),
              matmul_operand(in, DTYPE_E4M3, MATMUL_K_MAJOR, IC, in_scale),
              matmul_operand(weight, DTYPE_E4M3, MATMUL_K_MAJOR, IC, weight_scale), N, OC, IC, accumulate,
              fast_accumulation);
}

// din[N,IC] (+)= dout[N,OC] W, with dout E5M2 and the transposed weight weight_t[IC,OC] E4M3.
static inline void matmul_backward_input_fp8(GpuContext *gpu, bf16 *din, const __nv_fp8_e5m2 *dout,
                                             const float *dout_scale, const __nv_fp8_e4m3 *weight_t,
                                             const float *weight_scale, int N, int IC, int OC, bool accumulate,
                                             bool fast_accumulation) {
    matmul_lt(gpu, matmul_output(din, DTYPE_BF16, IC),
              matmul_operand(dout, DTYPE_E5M2, MATMUL_K_MAJOR, OC, dout_scale),
              matmul_operand(weight_t, DTYPE_E4M3, MATMUL_K_MAJOR, OC, weight_scale), N, IC, OC, accumulate,
              fast_accumulation);
}

// dweight[OC,IC] (+)= dout^T in, from the transposes dout_t[OC,N] (E5M2) and in_t[IC,N] (E4M3);
// dweight is BF16 or FP32 (dweight_type).
static inline void matmul_backward_weight_fp8(GpuContext *gpu, void *dweight, DType dweight_type,
                                              const __nv_fp8_e5m2 *dout_t, const float *dout_scale,
                                              const __nv_fp8_e4m3 *in_t, const float *in_scale, int N, int IC,
                                              int OC, bool accumulate, bool fast_accumulation) {
    matmul_lt(gpu, matmul_output(dweight, dweight_type, IC),
              matmul_operand(dout_t, DTYPE_E5M2, MATMUL_K_MAJOR, N, dout_scale),
              matmul_operand(in_t, DTYPE_E4M3, MATMUL_K_MAJOR, N, in_scale), OC, IC, N, accumulate,
              fast_accumulation);
}
