// Shared by every CUDA file: error checks that name the call, file and line; the BF16
// element type; 16-byte vector loads; and the process-wide GPU handles in one struct.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <cublasLt.h>
#include <stdio.h>
#include <stdlib.h>
#include <type_traits>
#include "cublaslt_workspace.h"

typedef __nv_bfloat16 bf16;

static inline void cuda_check(cudaError_t err, const char *call, const char *file, int line) {
    if (err == cudaSuccess) return;
    fprintf(stderr, "error: %s failed at %s:%d: %s\n", call, file, line, cudaGetErrorString(err));
    exit(EXIT_FAILURE);
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)

static inline void cublas_check(cublasStatus_t status, const char *call, const char *file, int line) {
    if (status == CUBLAS_STATUS_SUCCESS) return;
    fprintf(stderr, "error: %s failed at %s:%d: cuBLAS status %d\n", call, file, line, (int)status);
    exit(EXIT_FAILURE);
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)

// Every device buffer of the trainer comes from gpu_alloc (all of them at start): an allocation
// that fails names what it was for.
static inline void *gpu_alloc(size_t bytes, const char *what) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes);
    if (err != cudaSuccess) {
        fprintf(stderr, "error: cannot allocate %.3f GiB for %s on the GPU: %s\n", (double)bytes / 1073741824.0, what,
                cudaGetErrorString(err));
        exit(EXIT_FAILURE);
    }
    return p;
}

// Whether this build's code runs on the current GPU, tried on one of its kernels: a build for one
// architecture (GPU_ARCH, build_arch) fails at its first launch on another. Returns 0, or -1 with
// the GPU's name and compute capability, and what the build is for, in message.
static inline int gpu_runs_kernel(const void *kernel, const char *build_arch, char *message, size_t size) {
    cudaFuncAttributes attributes;
    if (cudaFuncGetAttributes(&attributes, kernel) == cudaSuccess) return 0;
    cudaGetLastError();  // not sticky: clear it
    int device = 0;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDevice(&device));
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    snprintf(message, size, "%s has compute capability %d.%d; this build's kernels are for %s (make GPU_ARCH=...): "
             "the attention kernels need Hopper (9.0)", prop.name, prop.major, prop.minor, build_arch);
    return -1;
}

// "error: WHERE: WHAT" and exit: how a launcher reports arguments it cannot run with.
static inline void fail_with(const char *where, const char *what) {
    fprintf(stderr, "error: %s: %s\n", where, what);
    exit(EXIT_FAILURE);
}

// Calls launch(A, B) with A and B std::bool_constant<a> and <b>: a launcher's two run-time flags
// picked once into one of a kernel's four template instances (decltype(A)::value inside).
template <class Launch>
static inline void launch_with_flags(bool a, bool b, Launch launch) {
    if (a && b) launch(std::true_type{}, std::true_type{});
    else if (a) launch(std::true_type{}, std::false_type{});
    else if (b) launch(std::false_type{}, std::true_type{});
    else launch(std::false_type{}, std::false_type{});
}

// Checks the last kernel launch (launch errors only; execution errors surface at the next sync).
#define cudaCheckLaunch() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// Kernels that move rows as 16-byte vectors of BF16 need rows of a positive multiple of 8 values.
static inline void require_vector_rows(const char *launcher, const char *name, int width) {
    if (width > 0 && width % 8 == 0) return;
    fprintf(stderr, "error: %s: %s = %d must be a positive multiple of 8 (16-byte rows)\n", launcher, name, width);
    exit(EXIT_FAILURE);
}

static inline __host__ __device__ int ceil_div(int a, int b) { return (a + b - 1) / b; }
static inline __host__ __device__ size_t ceil_div_size(size_t a, size_t b) { return (a + b - 1) / b; }

// 16 bytes of T, loaded and stored in one instruction. Pointers must be 16-byte aligned.
template <class T>
struct alignas(16) Vec16 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
    __device__ T &operator[](int i) { return v[i]; }
    __device__ const T &operator[](int i) const { return v[i]; }
};
template <class T>
__device__ __forceinline__ Vec16<T> load16(const T *p) { return *reinterpret_cast<const Vec16<T> *>(p); }
// Streaming load: data read once, do not keep it in L1.
template <class T>
__device__ __forceinline__ Vec16<T> load16_stream(const T *p) {
    Vec16<T> out;
    *reinterpret_cast<int4 *>(&out) = __ldcs(reinterpret_cast<const int4 *>(p));
    return out;
}
template <class T>
__device__ __forceinline__ void store16(T *p, const Vec16<T> &v) { *reinterpret_cast<Vec16<T> *>(p) = v; }
// Brings the line holding p into L2 without waiting for it (no register, no result).
__device__ __forceinline__ void prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

// A shared-memory pointer as the 32-bit address that PTX's shared-memory instructions take.
__device__ __forceinline__ uint32_t shared_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes from global to shared memory without a trip through registers; when valid is false
// nothing is read and the 16 bytes are zero-filled. cp_async_8 and cp_async_4 copy 8 and 4 (both
// addresses aligned to their size).
__device__ __forceinline__ void cp_async_16(void *smem, const void *gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(smem)),
                 "l"(__cvta_generic_to_global(gmem)), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_8(void *smem, const void *gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(shared_address(smem)), "l"(__cvta_generic_to_global(gmem))
                 : "memory");
}
__device__ __forceinline__ void cp_async_4(void *smem, const void *gmem) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(shared_address(smem)), "l"(__cvta_generic_to_global(gmem))
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Waits until at most PENDING of this thread's committed cp.async groups are still in flight (groups
// complete in commit order): with a pipeline of STAGES tiles, the current one has landed once the
// STAGES - 2 issued after it are all that may remain.
template <int PENDING>
__device__ __forceinline__ void cp_async_wait_pending() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

struct MatmulAlgoCache;  // coat/matmul.cuh: the cuBLASLt algorithm chosen for each product

// The process-wide handles: one stream for compute, the cuBLASLt handle, its workspace and the
// algorithms it chose.
typedef struct {
    int device;
    int sm_count;
    int compute_capability;   // 90 for Hopper
    cudaStream_t stream;
    cublasLtHandle_t cublaslt;
    void *cublaslt_workspace;
    size_t cublaslt_workspace_bytes;
    struct MatmulAlgoCache *matmul_algos;  // allocated by the first product
} GpuContext;

static inline void gpu_context_create(GpuContext *gpu, int device) {
    cudaDeviceProp prop;
    gpu->device = device;
    cudaCheck(cudaSetDevice(device));
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    gpu->sm_count = prop.multiProcessorCount;
    gpu->compute_capability = prop.major * 10 + prop.minor;
    // A blocking stream: plain cudaMemcpy and cudaMemset (the legacy default stream) stay ordered
    // with the compute work, so host code and tests cannot read a buffer before it is written.
    cudaCheck(cudaStreamCreate(&gpu->stream));
    cublasCheck(cublasLtCreate(&gpu->cublaslt));
    gpu->cublaslt_workspace_bytes = CUBLASLT_WORKSPACE_BYTES;
    gpu->cublaslt_workspace = gpu_alloc(gpu->cublaslt_workspace_bytes, "the cuBLASLt workspace");
    gpu->matmul_algos = NULL;
}

static inline void gpu_context_destroy(GpuContext *gpu) {
    free(gpu->matmul_algos);
    cudaCheck(cudaFree(gpu->cublaslt_workspace));
    cublasCheck(cublasLtDestroy(gpu->cublaslt));
    cudaCheck(cudaStreamDestroy(gpu->stream));
}
