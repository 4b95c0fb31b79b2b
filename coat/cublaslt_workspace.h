// The cuBLASLt workspace: one buffer per process, allocated by coat/common.cuh's
// gpu_context_create and counted by the memory plan (coat/memory_plan.h). Hopper's cuBLASLt
// kernels want up to 32 MiB. Plain C.
#pragma once

#define CUBLASLT_WORKSPACE_BYTES (32u << 20)
