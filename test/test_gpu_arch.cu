// The refusal of a GPU this build has no code for, as a non-Hopper GPU meets the trainer: this
// test is built for sm_80 only (Makefile), so on a Hopper GPU its kernel has no code to run, and
// gpu_runs_kernel (what the trainer calls before anything else) must say so, naming the GPU, its
// compute capability and what the build is for, instead of failing at a first kernel.
#include <string.h>
#include "../coat/common.cuh"
#include "check.h"

__global__ void arch_probe_kernel(int *out) { *out = 1; }

int main(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
        check(0, "a GPU is needed");
        return check_summary("test_gpu_arch");
    }
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, 0));
    char message[512] = "", expected[128];
    int status = gpu_runs_kernel((const void *)arch_probe_kernel, "sm_80", message, sizeof(message));
    snprintf(expected, sizeof(expected), "%s has compute capability %d.%d; this build's kernels are for sm_80", prop.name,
             prop.major, prop.minor);
    if (prop.major == 8) {  // sm_80 code runs on every 8.x GPU
        check(status == 0, "on a %s (%d.%d) the sm_80 build runs", prop.name, prop.major, prop.minor);
    } else {
        check(status != 0 && strstr(message, expected) != NULL, "an sm_80 build on a %s (%d.%d) is refused: %s", prop.name,
              prop.major, prop.minor, message);
        check(cudaGetLastError() == cudaSuccess, "the refusal leaves no CUDA error behind");
    }
    return check_summary("test_gpu_arch");
}
