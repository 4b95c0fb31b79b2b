// Helpers shared by the GPU tests and benchmarks (test/*.cu): zeroed host buffers that exit when
// memory runs out; BF16 rounding and the BF16 <-> float conversions between device tensors and host
// float arrays; random inputs rounded to BF16, so that the CPU reference sees exactly what the GPU
// sees; NaN poison for device outputs; max |x|; the median of timings, and of a call timed with CUDA
// events; random BF16 benchmark inputs made on the GPU. Host arrays are float (or bf16 bits) [n];
// device tensors are bf16 [n], in the layout the kernel under test takes.
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include "../coat/common.cuh"
#include "../coat/random.h"

// Zeroed; at least one byte, so that an empty tensor is not mistaken for out-of-memory.
static inline void *host_alloc(size_t bytes) {
    void *p = calloc(bytes ? bytes : 1, 1);
    if (p == NULL) {
        fprintf(stderr, "error: out of host memory (%zu bytes)\n", bytes);
        exit(EXIT_FAILURE);
    }
    return p;
}
static inline float *host_floats(size_t n) { return (float *)host_alloc(n * sizeof(float)); }
static inline bf16 *host_bf16s(size_t n) { return (bf16 *)host_alloc(n * sizeof(bf16)); }

static inline float round_to_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

static inline void convert_floats_to_bf16(bf16 *out, const float *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = __float2bfloat16(in[i]);
}
static inline void convert_bf16_to_floats(float *out, const bf16 *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = __bfloat162float(in[i]);
}

// host floats -> device BF16 (an existing buffer of n elements).
static inline void copy_bf16_to_device(bf16 *device, const float *host, size_t n) {
    bf16 *staging = host_bf16s(n);
    convert_floats_to_bf16(staging, host, n);
    cudaCheck(cudaMemcpy(device, staging, n * sizeof(bf16), cudaMemcpyHostToDevice));
    free(staging);
}

// host floats -> a new device BF16 buffer; the caller frees it with cudaFree.
static inline bf16 *device_bf16_from(const float *host, size_t n) {
    bf16 *device;
    cudaCheck(cudaMalloc(&device, n * sizeof(bf16)));
    copy_bf16_to_device(device, host, n);
    return device;
}

// device BF16 -> host floats.
static inline void copy_bf16_to_host(float *host, const bf16 *device, size_t n) {
    bf16 *staging = host_bf16s(n);
    cudaCheck(cudaMemcpy(staging, device, n * sizeof(bf16), cudaMemcpyDeviceToHost));
    convert_bf16_to_floats(host, staging, n);
    free(staging);
}

// A new array of n values uniform in [-amplitude, amplitude), rounded to BF16.
static inline float *random_uniform_bf16_values(Random *rng, size_t n, float amplitude) {
    float *x = host_floats(n);
    for (size_t i = 0; i < n; i++) x[i] = round_to_bf16((float)((2.0 * random_uniform(rng) - 1.0) * amplitude));
    return x;
}

// x[0..n) = Normal(mean, sigma) values rounded to BF16.
static inline void fill_normal_bf16_values(Random *rng, float *x, size_t n, double mean, double sigma) {
    for (size_t i = 0; i < n; i++) x[i] = round_to_bf16((float)(mean + sigma * random_normal(rng)));
}

// Every byte 0xFF, a NaN in BF16 and in FP32: an element a kernel fails to write, or reads before
// writing, shows up as NaN.
static inline void poison_nan(void *device, size_t bytes) { cudaCheck(cudaMemset(device, 0xFF, bytes)); }

static inline float max_abs(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n; i++) m = fmaxf(m, fabsf(x[i]));
    return m;
}

static inline int compare_floats_ascending(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

// Sorts the n > 0 values and returns the middle one (the upper middle for even n).
static inline float median_in_place(float *values, int n) {
    qsort(values, (size_t)n, sizeof(float), compare_floats_ascending);
    return values[n / 2];
}

// The median of `runs` (1 to 64) CUDA-event timings in ms of run() on `stream` (the default stream
// unless given), after `warmups` untimed calls.
#define MEDIAN_EVENT_RUNS_MAX 64
template <class F>
static float median_event_ms(int warmups, int runs, F run, cudaStream_t stream = 0) {
    if (runs < 1 || runs > MEDIAN_EVENT_RUNS_MAX) {
        fprintf(stderr, "error: median_event_ms: runs = %d, not in [1, %d]\n", runs, MEDIAN_EVENT_RUNS_MAX);
        exit(EXIT_FAILURE);
    }
    cudaEvent_t start, stop;
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    for (int rep = 0; rep < warmups; rep++) run();
    float ms[MEDIAN_EVENT_RUNS_MAX];
    for (int rep = 0; rep < runs; rep++) {
        cudaCheck(cudaEventRecord(start, stream));
        run();
        cudaCheck(cudaEventRecord(stop, stream));
        cudaCheck(cudaEventSynchronize(stop));
        cudaCheck(cudaEventElapsedTime(&ms[rep], start, stop));
    }
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    return median_in_place(ms, runs);
}

// Uniform values in [-1, 1) from a hash of the index, on the GPU: benchmark inputs of gigabytes
// without a host copy (any grid: the threads stride over x).
__global__ void fill_uniform_bf16_kernel(bf16 *x, size_t n, uint64_t seed) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        x[i] = __float2bfloat16((float)(z >> 40) * 0x1.0p-23f - 1.f);
    }
}
