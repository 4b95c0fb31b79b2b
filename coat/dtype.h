// Element types of the GEMM wrapper's operands and outputs (coat/matmul.cuh); the quantizers
// (coat/fp8.cuh) name their two formats with Fp8Format. Plain C: it compiles as C11 and as C++17.
// E4M3 is the "fn" variant (max 448, no infinity); E5M2 has infinity (max 57344).
#pragma once
#include <stddef.h>

typedef enum {
    DTYPE_FP32,
    DTYPE_BF16,
    DTYPE_E4M3,
    DTYPE_E5M2,
} DType;

static inline size_t dtype_size_bytes(DType type) {
    switch (type) {
    case DTYPE_FP32: return 4;
    case DTYPE_BF16: return 2;
    case DTYPE_E4M3: return 1;
    case DTYPE_E5M2: return 1;
    }
    return 0;
}

static inline int dtype_is_fp8(DType type) { return type == DTYPE_E4M3 || type == DTYPE_E5M2; }

static inline const char *dtype_name(DType type) {
    switch (type) {
    case DTYPE_FP32: return "fp32";
    case DTYPE_BF16: return "bf16";
    case DTYPE_E4M3: return "e4m3";
    case DTYPE_E5M2: return "e5m2";
    }
    return "unknown";
}
