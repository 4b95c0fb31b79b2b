// AdamW with FP32 master weights over one contiguous shard of the padded parameter buffer, its
// moments m and v stored as FP32, BF16, FP8 E4M3 per 128-group, or FP8 E4M3 with COAT's Dynamic
// Range Expansion (coat/README.md, Dynamic Range Expansion); and the global gradient norm used
// for clipping.
//
// One step, all in FP32, g = grad * grad_scale, t counted from 1, decoupled weight decay:
//   m = b1 m + (1-b1) g;   v = b2 v + (1-b2) g^2
//   p = p - lr ((m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd p)
// using the new m and v before they are stored back in their kind (the bias corrections as
// products with 1 / (1-b^t), rounded from double); the master p is kept in FP32 and the BF16
// parameter is written as p rounded to nearest even. Given amax parts, the step also gathers
// max |bf16(p)| of the weights that the FP8 GEMMs cast from the master after it (AdamWAmaxParts).
//
// FP8 states, per 128-group and per moment x (the group of a new x is quantized as a whole):
//   fp8:     s = max|x| / 448,  q = e4m3(x / s);                 back: x = q s
//   fp8_dre: Mx = max|x|, Mn = min of the nonzero |x|, R = Mx / Mn,
//            k = 1 if R <= 1 + 1e-6, else floor(16 log2(448^2 / 2) / log2 R) / 16,
//            c = sqrt(Mx) sqrt(Mn),  s = (Mx / c)^k / 448,  q = e4m3(sign(x) (|x| / c)^k / s);
//            back: x = sign(q s) |q s|^(1/k) c.   An all-zero group stores q = 0, s = k = c = 1.
//   The powers are taken in the log domain:
//            q = e4m3(sign(x) 2^(k log2(|x| / Mx) + log2 448)),  x = 0 stays 0;
//            back: x = sign(q) c 2^((e - 7) / k + log2 s / k) 2^(log2 f / k) for q = 2^(e - 7) f, a
//            factor per field of the code, of which a group has 16 + 16 (dre_binade_factor).
// e4m3 rounds to nearest even and saturates to +-448. Everything but the values' codes uses log2
// and exp2 written below from correctly rounded operations only, and every product that feeds a sum
// is rounded on its own (no FMA contraction), so a plain C program reproduces the master weights,
// the parameters, every group's scalars and the decoded moments bit for bit. The codes take the
// hardware's log2 and exp2, one of each per value (dre_expanded): the value they round is within
// 1.3e-6 + 3.5e-7 k of 448 (|x| / Mx)^k (relative), so a code differs from the exact rounding's
// only for a value that close to a rounding boundary (test_optimizer checks each step's codes
// against the definition in double). Instructions, not bytes, set the step's time: the software
// log2 and exp2 took 82 of its 229 instructions per parameter, and the step runs 1.33x faster
// without them.
//
// Layouts. The optimizer steps this rank's parts of a list of ranges of the parameter order
// (ParamShardRange, coat/params.h: one per data-parallel bucket, coat/zero.h, or one range of the
// whole model), each part a multiple of 128 elements so that every 128-group lies in one tensor
// and one part. params is the whole BF16 device buffer (the layout's buffer_elems), of which it
// writes its parts, each where its range's `at` says; a range at PARAM_NOT_IN_BUFFER has no BF16
// copy (the block's linear weights with FP8 GEMMs, coat/zero.cuh) and its step writes only the
// master. n is the sum of the parts, and its state and the gradients it reads are the
// parts back to back (part i at the range's state_at): BF16 (a whole one-rank gradient buffer, or
// ZeRO-1's gradient shard) or FP32 (ZeRO-2's shard sum).
// Its device state is one allocation, whose sections a checkpoint holds (below):
//   master FP32 [n] | m [n] | v [n] | m group scalars [n/128][S] | v group scalars [n/128][S]
// with m and v FP32, BF16 or E4M3 bytes, and S FP32 scalars per group: 0 (fp32, bf16),
// 1 (fp8: scale), 3 (fp8_dre: scale, k, c). A separate table holds one byte per group:
// 1 where weight decay applies.
#pragma once
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "checkpoint_parts.h"
#include "checkpoint_reader.h"
#include "common.cuh"
#include "config.h"
#include "fp8.cuh"
#include "optimizer_states.h"
#include "params.h"
#include "random.h"

typedef struct {
    float beta1, beta2, eps;
    float weight_decay;
    int weight_decay_all;     // 0: decay the matrices (param_kind_is_matrix) only; 1: every tensor
    int stochastic_rounding;  // FP8 states: 0 round to nearest even (as COAT), 1 stochastically
} AdamWConfig;

// Weights whose per-tensor amax the step gathers as it writes their master weights (the FP8
// GEMMs' weights, cast from the master after the step): part i is the state's groups
// [first_group[i], end_group[i]) (ascending, disjoint), and max |bf16(w)| over them goes to
// slots[slot[i]].amax by atomic max of the float's bits (the slots zeroed before the step, which
// writes no other field). Passed to the kernel as a parameter: the kernel finds a group's part by
// a binary search of the table in the constant bank, once per group of a block.
#define ADAMW_AMAX_PARTS 1024
typedef struct {
    Fp8Scale *slots;
    int count;  // 0: none
    uint32_t first_group[ADAMW_AMAX_PARTS], end_group[ADAMW_AMAX_PARTS];
    uint16_t slot[ADAMW_AMAX_PARTS];
} AdamWAmaxParts;

typedef struct {
    AdamWConfig config;
    OptimizerStateKind kind;
    long long step;                 // completed steps: t of the last step taken
    int rank;                       // this rank's part of each range
    int range_count;
    ParamShardRange *ranges;        // [range_count], in the parameter order
    size_t n;                       // the parts' elements: the sum of the ranges' part
    size_t total;                   // elements a checkpoint covers: the layout's total_padded
    void *state;                    // the one allocation described above
    size_t state_bytes;
    float *master;                  // [n]
    void *m, *v;                    // [n] each, float, bf16 or E4M3 bytes
    float *m_group, *v_group;       // [n/128][S] each (NULL when S = 0)
    unsigned char *decay_group;     // [n/128]
    AdamWAmaxParts *amax;           // host copy; NULL: the step gathers no amax (adamw_set_amax_parts)
} AdamW;

#define ADAMW_VEC 8                                 // elements per thread: one 16-byte BF16 load
#define ADAMW_THREADS_PER_GROUP (ADAMW_GROUP / ADAMW_VEC)  // 16, half a warp
#define ADAMW_THREADS 256
#define DRE_E4M3_MAX 448.0f
#define DRE_K_NUMERATOR 265.83535750584331f         // 16 * log2(448 * 448 / 2)
#define DRE_LOG2_E4M3_MAX 8.80735492205760410f      // log2(448)
#define DRE_EQUAL_RATIO (1.0f + 1e-6f)              // R up to this: all magnitudes equal, k = 1
#define ADAMW_CHECKPOINT_MAGIC 0x4d41444154414f43ull  // "COATADAM" in a little-endian uint64
#define ADAMW_CHECKPOINT_VERSION 2
#define ADAMW_COPY_CHUNK_BYTES ((size_t)64 << 20)   // staging buffer for save and load

// ---- arithmetic that rounds identically on the host and the device ----------------------

static __host__ __device__ __forceinline__ uint32_t dre_float_bits(float x) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(x);
#else
    uint32_t bits;
    memcpy(&bits, &x, sizeof(bits));
    return bits;
#endif
}

static __host__ __device__ __forceinline__ float dre_bits_float(uint32_t bits) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(bits);
#else
    float x;
    memcpy(&x, &bits, sizeof(x));
    return x;
#endif
}

// log2(x) for x > 0 (infinity and NaN pass through), within a few ulp: x = 2^e f with f in [sqrt(1/2), sqrt(2)), and
// ln f = 2 atanh(s) = 2 (s + s^3/3 + ... + s^11/11) with s = (f - 1) / (f + 1), |s| < 0.172.
// f - 1 is exact, so log2 stays accurate relative to itself near x = 1, where DRE needs it.
static __host__ __device__ inline float dre_log2(float x) {
    bool subnormal = x < 1.17549435e-38f;  // scaled by 2^24 (exact)
    uint32_t bits = dre_float_bits(subnormal ? mul_unfused(x, 16777216.0f) : x);
    int exponent = (int)(bits >> 23) - 127 - (subnormal ? 24 : 0);
    float f = dre_bits_float((bits & 0x007fffffu) | 0x3f800000u);  // [1, 2)
    bool upper = f > 1.41421356f;
    f = upper ? mul_unfused(f, 0.5f) : f;
    exponent += upper;
    float s = (f - 1.0f) / (f + 1.0f);
    float s2 = mul_unfused(s, s);
    float series = fmaf(s2, 0.0909090936f, 0.111111112f);  // 1/11, 1/9
    series = fmaf(s2, series, 0.142857149f);                // 1/7
    series = fmaf(s2, series, 0.200000003f);                // 1/5
    series = fmaf(s2, series, 0.333333343f);                // 1/3
    float two_s = 2.0f * s;
    float ln_f = fmaf(mul_unfused(two_s, s2), series, two_s);
    float result = fmaf(ln_f, 1.44269502f, (float)exponent);  // log2(e)
    return x <= 3.40282347e38f ? result : x;                 // infinity and NaN pass through
}

// 2^r for |r| <= 1/2 within 2e-7 (relative): a degree-5 polynomial fitted to it, 1 at r = 0.
static __host__ __device__ __forceinline__ float dre_exp2_fraction(float r) {
    float p = fmaf(r, 1.326472266e-3f, 9.671512991e-3f);
    p = fmaf(r, p, 5.550733581e-2f);
    p = fmaf(r, p, 2.402224243e-1f);
    p = fmaf(r, p, 6.931470037e-1f);
    return fmaf(r, p, 1.0f);  // in [0.70, 1.42]
}

// 2^t for |t| <= 125: t = n + r with n = rint(t) (t + 1.5 2^23 rounds t to an integer in the low
// bits of its mantissa, with no conversion instruction) and |r| <= 1/2 exact, 2^r by the polynomial,
// then n added to its exponent (the product by 2^n, exact: the result is normal).
#define DRE_ROUNDING_SHIFTER 12582912.0f  // 1.5 2^23
static __host__ __device__ __forceinline__ float dre_exp2_near(float t) {
    float shifted = t + DRE_ROUNDING_SHIFTER;
    float r = t - (shifted - DRE_ROUNDING_SHIFTER);
    // shifted's bits end in n; shifted 23 places, the bits above them drop out.
    return dre_bits_float(dre_float_bits(dre_exp2_fraction(r)) + (dre_float_bits(shifted) << 23));
}

// 2^t within a few ulp, for any t: dre_exp2_near in the normal range (every call of the step
// kernel's loops but for extreme groups), else in two exact-or-once-rounded steps (subnormal
// results) with a select per special case.
static __host__ __device__ inline float dre_exp2(float t) {
    if (fabsf(t) <= 125.0f) return dre_exp2_near(t);
    bool special = !(t >= -151.0f && t < 128.0f);  // NaN, +infinity, 0
    float special_value = t != t ? t : t >= 128.0f ? dre_bits_float(0x7f800000u) : 0.0f;
    t = special ? 0.0f : t;
    float n = rintf(t);
    float p = dre_exp2_fraction(t - n);
    int e = (int)n;
    // 2^e as two factors, each a power of two: (2^127, 2) above the normal range, (2^(e+64), 2^-64)
    // below it; a factor of 1 changes nothing.
    uint32_t first = e > 127 ? 254u : e >= -126 ? (uint32_t)(e + 127) : (uint32_t)(e + 64 + 127);
    float second = e > 127 ? 2.0f : e >= -126 ? 1.0f : dre_bits_float(63u << 23);
    float result = mul_unfused(mul_unfused(p, dre_bits_float(first << 23)), second);
    return special ? special_value : result;
}

// y^p for y >= 0: 0 stays 0 and p = 1 returns y itself.
static __host__ __device__ inline float dre_pow(float y, float p) {
    if (p == 1.0f || y == 0.0f) return y;
    return dre_exp2(mul_unfused(p, dre_log2(y)));
}

// ---- the step kernel ----------------------------------------------------------------------

// What every element of one step shares; computed on the host.
typedef struct {
    float lr, grad_scale;
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay;
    float inverse_bias_correction1, inverse_bias_correction2;  // 1 / (1 - b^t), from double
    uint64_t rounding_key[2];  // stochastic rounding of m and v this step (adamw_rounding_key); 0: nearest
    size_t first_index;        // the shard's first element in the whole buffer
} AdamWStepScalars;

// Stochastic rounding of the FP8 states (stochastic_rounding = 1), an extension of COAT's recipe,
// whose casts round to nearest: a moment that changes by less than half an E4M3 step per update
// (v by 5% with beta2 = 0.95) is then stored back unchanged, step after step, and its rounding
// errors add up instead of averaging out. Stochastic rounding stores either neighbour of y with
// the probabilities that make the stored value unbiased, from a uniform drawn from a counter-based
// hash of (step, moment, element): the same numbers after a resume and on any number of ranks.
static inline uint64_t adamw_rounding_key(long long step, int moment) {
    return random_mix64(((uint64_t)step << 1 | (uint64_t)moment) + 0x632BE59BD9B4E019ull);
}

static __host__ __device__ __forceinline__ float adamw_rounding_uniform(uint64_t key, uint64_t index) {
    return (float)(random_mix64(key ^ random_mix64(index)) >> 40) * (1.0f / 16777216.0f);  // 24 bits: [0, 1)
}

// y to an E4M3 code: up to the neighbour above |y| when u < (|y| - below) / (above - below), else
// down; saturating at 448 and keeping NaN like the cast.
static __host__ __device__ __forceinline__ uint8_t e4m3_stochastic(float y, float u) {
    uint8_t nearest = fp8_encode(y, FP8_E4M3), sign = nearest & 0x80u, magnitude = nearest & 0x7fu;
    float a = fabsf(y);
    if (!(a < DRE_E4M3_MAX)) return nearest;  // saturated, or NaN
    uint8_t below = fp8_decode(magnitude, FP8_E4M3) > a ? (uint8_t)(magnitude - 1) : magnitude;
    float low = fp8_decode(below, FP8_E4M3), high = fp8_decode((uint8_t)(below + 1), FP8_E4M3);
    return (uint8_t)(sign | (u < (a - low) / (high - low) ? below + 1 : below));
}

// The shard as the kernel sees it; every pointer starts at the shard's first element.
typedef struct {
    bf16 *params;            // NULL: none (the kernel's WRITE_PARAMS false)
    const bf16 *grads;       // BF16 gradients, or
    const float *grads_f32;  // FP32 ones (ZeRO stage 2's accumulated shard) when not NULL
    float *master;
    void *m, *v;
    float *m_group, *v_group;
    const unsigned char *decay_group;
    size_t n;
    uint32_t first_group;  // the shard's first group in the state (the amax parts' numbering)
} AdamWShard;

__device__ __forceinline__ void adamw_load8(const float *p, float out[ADAMW_VEC]) {
    Vec16<float> a = load16(p), b = load16(p + 4);
    for (int j = 0; j < 4; j++) { out[j] = a[j]; out[j + 4] = b[j]; }
}
__device__ __forceinline__ void adamw_store8(float *p, const float in[ADAMW_VEC]) {
    Vec16<float> a, b;
    for (int j = 0; j < 4; j++) { a[j] = in[j]; b[j] = in[j + 4]; }
    store16(p, a);
    store16(p + 4, b);
}
__device__ __forceinline__ void adamw_load8(const bf16 *p, float out[ADAMW_VEC]) {
    Vec16<bf16> a = load16(p);
    for (int j = 0; j < ADAMW_VEC; j++) out[j] = __bfloat162float(a[j]);
}
__device__ __forceinline__ void adamw_store8(bf16 *p, const float in[ADAMW_VEC]) {
    Vec16<bf16> a;
    for (int j = 0; j < ADAMW_VEC; j++) a[j] = __float2bfloat16_rn(in[j]);
    store16(p, a);
}

// Max and min over the 16 threads of one 128-group (lanes 0-15 or 16-31 of the warp). Every
// lane of the warp must call them.
__device__ __forceinline__ float adamw_group_max(float x) {
    for (int offset = ADAMW_THREADS_PER_GROUP / 2; offset > 0; offset >>= 1)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset, ADAMW_THREADS_PER_GROUP));
    return x;
}
__device__ __forceinline__ float adamw_group_min(float x) {
    for (int offset = ADAMW_THREADS_PER_GROUP / 2; offset > 0; offset >>= 1)
        x = fminf(x, __shfl_xor_sync(0xffffffffu, x, offset, ADAMW_THREADS_PER_GROUP));
    return x;
}


// A DRE group's binade and mantissa factors per moment (below): 16 of each (the exponent field's
// values; the mantissa field's for normal and for subnormal codes), one of each per lane.
#define DRE_FACTORS 16
static_assert(DRE_FACTORS == ADAMW_THREADS_PER_GROUP, "a DRE group's factors are one per lane");

// The table of DRE, in shared memory, filled by the block's first threads before a barrier: the
// mantissa logs of dre_mantissa_factor.
typedef struct {
    float mantissa_log2[DRE_FACTORS];
} DreTables;
#define ADAMW_BLOCK_GROUPS (ADAMW_THREADS / ADAMW_THREADS_PER_GROUP)

// A DRE code's |value| as two factors, one per field of its E4M3 magnitude (exponent e, mantissa
// m): c (|q| s)^(1/k) = B[e] M[f], with the binade factor B[e] = c 2^((max(e, 1) - 7) / k + log2 s / k)
// and the mantissa factor M[f] = 2^(log2(1 + m/8) / k) for a normal code (f = m), 2^(log2(m/8) / k)
// for a subnormal one (f = 8 + m; M[8] = 0: the zero code). A group has 16 of each per moment:
// the kernel computes them once per group, one of each per lane, and from them the |value| of each
// of the 128 code magnitudes (dre_fill_magnitudes; the NaN code, e = 15 and m = 7, decodes to NaN).
static __host__ __device__ inline float dre_mantissa_log2(int f) {
    return f < 8 ? dre_log2(1.0f + (float)f * 0.125f) : f == 8 ? 0.0f : dre_log2((float)(f - 8) * 0.125f);
}

__device__ __forceinline__ void dre_fill_tables(DreTables *t) {
    if (threadIdx.x < DRE_FACTORS) t->mantissa_log2[threadIdx.x] = dre_mantissa_log2(threadIdx.x);
}

// A group's per-moment math (logs, a power, divisions) took 44 of the step's 229 instructions per
// parameter with each of the group's 16 lanes repeating it. One warp of the block does it instead,
// a lane for each of the block's 16 groups and 2 moments (DRE_GROUP_LANE's), and the other lanes
// read the results from shared memory after a barrier (the step 1.07x faster).
#define DRE_GROUP_LANE(group, moment) (2 * (group) + (moment))
static_assert(2 * ADAMW_BLOCK_GROUPS == 32 && ADAMW_THREADS >= 64, "a warp for the decode, another for the encode");
// What DRE's factors of a group's moment (dre_binade_factor) need: 1 / k, log2 s / k and c.
typedef struct {
    float inverse_k, log2_scale_over_k, c;
} DreDecode;

static __host__ __device__ inline DreDecode dre_decode_constants(float scale, float k, float c) {
    float inverse_k = 1.0f / k;
    DreDecode d = {inverse_k, mul_unfused(dre_log2(scale), inverse_k), c};
    return d;
}

static __host__ __device__ inline float dre_binade_factor(DreDecode d, int e) {
    return mul_unfused(dre_exp2(fmaf((float)((e > 1 ? e : 1) - 7), d.inverse_k, d.log2_scale_over_k)), d.c);
}
static __host__ __device__ inline float dre_mantissa_factor(DreDecode d, int f, float mantissa_log2) {
    return f == 8 ? 0.0f : dre_exp2_near(mul_unfused(mantissa_log2, d.inverse_k));  // |exponent| <= 3 * 16
}

// A DRE group's moment decoded once per code magnitude, a table in shared memory: lane e of the
// group writes the 8 codes of binade e, B[e] M[f], from the binade factor it holds and the
// mantissa factors of lanes 0-7 (normal codes) or 8-15 (the subnormal binade, e = 0). Every lane
// of the warp calls it; the group's lanes read the table after a __syncwarp. Each value then takes
// one load (and its code's sign bit) where the two factors took two shuffles, a product and the
// NaN and sign selects: 5% fewer instructions in the step.
#define DRE_CODES 128
__device__ __forceinline__ void dre_fill_magnitudes(float table[DRE_CODES], float binade, float mantissa) {
    int lane = threadIdx.x % ADAMW_THREADS_PER_GROUP;
    float out[8];
    for (int m = 0; m < 8; m++)
        out[m] = mul_unfused(binade, __shfl_sync(0xffffffffu, mantissa, (lane == 0 ? 8 : 0) + m, ADAMW_THREADS_PER_GROUP));
    if (lane == 15) out[7] = __int_as_float(0x7fc00000);  // 0x7f: NaN
    *(float4 *)(table + 8 * lane) = make_float4(out[0], out[1], out[2], out[3]);
    *(float4 *)(table + 8 * lane + 4) = make_float4(out[4], out[5], out[6], out[7]);
}

// This thread's 8 values of a moment from its E4M3 codes: DRE's from the group's table of
// magnitudes (the sign bit set from the code's), else times the group's scale.
template <bool DRE>
__device__ __forceinline__ void dequantize8_e4m3(float out[ADAMW_VEC], uint2 codes, const float *magnitudes, float scale) {
    for (int j = 0; j < ADAMW_VEC; j++) {
        uint32_t code = ((j < 4 ? codes.x : codes.y) >> (8 * (j % 4))) & 0xffu;
        if (DRE) out[j] = __uint_as_float(__float_as_uint(magnitudes[code & 0x7fu]) | (code & 0x80u) << 24);
        else out[j] = mul_unfused(fp8_decode((uint8_t)code, FP8_E4M3), scale);
    }
}

// What quantizing a group of one moment needs, from its largest and smallest nonzero magnitude:
// its scalars; on the device also unit and log2_max_unit (dre_encode_unit).
typedef struct {
    float scale, k, c, unit, log2_max_unit;
} DreEncode;

template <bool DRE>
static __host__ __device__ inline DreEncode dre_encode_constants(float max_abs, float min_abs) {
    DreEncode e = {1.0f, 1.0f, 1.0f, 1.0f, 0.0f};
    if (max_abs > 0.0f) {
        if (DRE) {
            float ratio = max_abs / min_abs;
            if (ratio > DRE_EQUAL_RATIO) {
                // Past FLT_MAX the ratio is taken as a difference of logs.
                float log2_ratio = isinf(ratio) ? dre_log2(max_abs) - dre_log2(min_abs) : dre_log2(ratio);
                e.k = fmaxf(floorf(DRE_K_NUMERATOR / log2_ratio), 1.0f) * 0.0625f;
            }
            e.c = mul_unfused(sqrtf(max_abs), sqrtf(min_abs));
            e.scale = dre_pow(max_abs / e.c, e.k) / DRE_E4M3_MAX;
        } else {
            e.scale = max_abs / DRE_E4M3_MAX;
        }
    }
    return e;
}

// This thread's largest magnitude and smallest nonzero one (FLT_MAX when all are zero). An
// infinite moment (v overflows past FLT_MAX when |g| > 1.8e19 without clipping) counts as
// +-FLT_MAX, here and when it is quantized: an infinity in a group would make c infinite and every
// scale of the group NaN.
__device__ __forceinline__ void adamw_local_range(const float x[ADAMW_VEC], float *max_abs, float *min_abs) {
    *max_abs = 0.0f;
    *min_abs = dre_bits_float(0x7f800000u);
    for (int j = 0; j < ADAMW_VEC; j++) {
        float a = fabsf(x[j]);
        *max_abs = fmaxf(*max_abs, a);
        if (a > 0.0f) *min_abs = fminf(*min_abs, a);
    }
    *max_abs = fminf(*max_abs, 3.40282347e38f);
    *min_abs = fminf(*min_abs, 3.40282347e38f);
}

// The hardware's log2 (within 2^-22 absolute, then rounded to float; subnormal inputs flushed to 0,
// log2 -inf) and exp2 (within 2^-22 relative; results below 2^-126, which E4M3 rounds to 0, flushed
// to 0).
__device__ __forceinline__ float dre_hardware_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float dre_hardware_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// The group's unit, a power of two that takes its values where their logs are exact enough, and
// log2(Mx unit): Mx to [1, 2), so that log2(|x| unit) is small where k is large; where that would
// take Mn below FLT_MIN (R > 2^126, so k <= 1/8), Mx to [2^126, 2^127), which keeps every value
// of a group with R < 2^252 normal (values below Mx 2^-252 fall to 0, code 0).
__device__ __forceinline__ void dre_encode_unit(DreEncode *e, float max_abs, float min_abs) {
    if (!(max_abs > 0.0f)) return;
    int exponent = (int)(dre_float_bits(max_abs) >> 23);  // 0 to 254: max_abs <= FLT_MAX
    int shift = 127 - exponent;
    if (min_abs * dre_bits_float((uint32_t)(127 + max(shift, -126)) << 23) < 1.17549435e-38f) shift = 253 - exponent;
    e->unit = dre_bits_float((uint32_t)(127 + min(max(shift, -126), 127)) << 23);
    e->log2_max_unit = dre_hardware_log2(max_abs * e->unit);
}

// 448 (|x| / Mx)^k = 2^(k (log2(|x| unit) - log2(Mx unit)) + log2 448) for a = |x| <= Mx, the
// magnitude that DRE stores in E4M3: 0 stays 0 (log2 0 = -inf), NaN stays NaN, an infinity gives
// 448 (as FLT_MAX would: the group's range counts it so). Each log carries the hardware's error and
// a rounding to float, |log2(|x| / Mx)| 6e-8 at most where the value can round to a nonzero code
// (k |log2(|x| / Mx)| <= 19), the exponent one more rounding, exp2 its error: within
// 1.3e-6 + 3.5e-7 k of the value (relative), where E4M3's steps are 6-12%, so a code differs from
// the exact rounding's only for a value that close to a rounding boundary.
__device__ __forceinline__ float dre_expanded(float a, DreEncode e) {
    float log2_ratio = dre_hardware_log2(a * e.unit) - e.log2_max_unit;
    return dre_hardware_exp2(fmaf(e.k, log2_ratio, DRE_LOG2_E4M3_MAX));
}

// The codes of this thread's 8 values of a group quantized with e. STOCHASTIC rounds with the
// uniforms of (key, index + j), else to nearest even, two values per conversion.
template <bool DRE, bool STOCHASTIC>
__device__ __forceinline__ uint2 quantize8_e4m3(const float x[ADAMW_VEC], DreEncode e, uint64_t key, uint64_t index) {
    float y[ADAMW_VEC];
    for (int j = 0; j < ADAMW_VEC; j++) {
        if (DRE) {
            y[j] = copysignf(dre_expanded(fabsf(x[j]), e), x[j]);
        } else {
            y[j] = x[j] / e.scale;
        }
    }
    uint32_t word[2] = {0u, 0u};
    for (int j = 0; j < ADAMW_VEC; j += 2) {
        uint32_t pair;  // y[j] in the low byte
        if (STOCHASTIC)
            pair = e4m3_stochastic(y[j], adamw_rounding_uniform(key, index + j)) |
                   (uint32_t)e4m3_stochastic(y[j + 1], adamw_rounding_uniform(key, index + j + 1)) << 8;
        else
            pair = __nv_cvt_float2_to_fp8x2(make_float2(y[j], y[j + 1]), __NV_SATFINITE, __NV_E4M3);
        word[j / 4] |= pair << (8 * (j % 4));
    }
    return make_uint2(word[0], word[1]);
}

// The block's DRE group constants in shared memory (DRE_GROUP_LANE's order): the decode's, the
// groups' ranges (max and smallest nonzero magnitude), then the encode's.
typedef struct {
    DreDecode decode[2 * ADAMW_BLOCK_GROUPS];
    float max_abs[2 * ADAMW_BLOCK_GROUPS], min_abs[2 * ADAMW_BLOCK_GROUPS];
    DreEncode encode[2 * ADAMW_BLOCK_GROUPS];
} DreBlockGroups;

// The part of state group g, or -1.
__device__ __forceinline__ int adamw_amax_part(const AdamWAmaxParts &amax, uint32_t g) {
    int low = 0, high = amax.count;  // the last part with first_group <= g is below high
    while (high - low > 1) {
        int mid = (low + high) / 2;
        if (amax.first_group[mid] <= g) low = mid;
        else high = mid;
    }
    return amax.count > 0 && amax.first_group[low] <= g && g < amax.end_group[low] ? low : -1;
}

// The step's amax, in three calls that every thread of the block makes: the part of each of the
// block's groups (lanes 0-15 of warp 0, a group each; at the start, so that the search's loads
// wait under the step's), each group's max |bf16(p)| into shared memory (as soon as p is
// known), and at the end, after a barrier, warp 0 combines the runs of groups in one part and
// the first lane of each run takes the atomic: a part sees about one atomic per block.
__device__ __forceinline__ int adamw_amax_block_part(const AdamWAmaxParts &amax, uint32_t block_first_group) {
    return threadIdx.x < ADAMW_BLOCK_GROUPS ? adamw_amax_part(amax, block_first_group + threadIdx.x) : -1;
}

__device__ __forceinline__ void adamw_amax_of_group(const float p[ADAMW_VEC], bool active, unsigned *group_max) {
    float m = 0.0f;
    for (int j = 0; j < ADAMW_VEC && active; j++) m = fp8_abs_max(m, __bfloat162float(__float2bfloat16_rn(p[j])));
    for (int offset = ADAMW_THREADS_PER_GROUP / 2; offset > 0; offset >>= 1)
        m = fp8_abs_max(m, __shfl_xor_sync(0xffffffffu, m, offset, ADAMW_THREADS_PER_GROUP));
    // As float bits: magnitudes order as unsigned integers, NaN above infinity.
    if (threadIdx.x % ADAMW_THREADS_PER_GROUP == 0) group_max[threadIdx.x / ADAMW_THREADS_PER_GROUP] = __float_as_uint(m);
}

__device__ __forceinline__ void adamw_amax_commit(const AdamWAmaxParts &amax, int part, const unsigned *group_max) {
    __syncthreads();
    if (threadIdx.x >= 32) return;
    int lane = threadIdx.x;
    unsigned bits = lane < ADAMW_BLOCK_GROUPS ? group_max[lane] : 0u;
    for (int offset = 1; offset < ADAMW_BLOCK_GROUPS; offset <<= 1) {  // a run's maximum to its first lane
        unsigned other = __shfl_down_sync(0xffffffffu, bits, offset);
        int other_part = __shfl_down_sync(0xffffffffu, part, offset);
        if (lane + offset < ADAMW_BLOCK_GROUPS && other_part == part) bits = max(bits, other);
    }
    int before = __shfl_up_sync(0xffffffffu, part, 1);
    if (part >= 0 && (lane == 0 || before != part) && bits > 0) atomicMax((unsigned *)&amax.slots[amax.slot[part]].amax, bits);
}

// The step's blocks an SM must hold at once (__launch_bounds__): 5 (48 registers a thread) for the
// FP8 kinds rounding to nearest, where that costs no spill (the DRE step would otherwise take up to
// 59 registers and hold 4 blocks: 1.08-1.19x slower), else what the kernel needs.
static constexpr int adamw_min_blocks(OptimizerStateKind kind, bool stochastic, bool write_params) {
    return !stochastic && (kind == OPT_STATES_FP8_DRE || (kind == OPT_STATES_FP8 && !write_params)) ? 5 : 1;
}

// One thread per 8 elements, 16 threads per 128-group; the grid covers the shard once.
// WRITE_PARAMS false: the shard has no BF16 parameters, the rest is the same arithmetic.
template <OptimizerStateKind KIND, bool STOCHASTIC, bool WRITE_PARAMS>
__global__ void __launch_bounds__(ADAMW_THREADS, adamw_min_blocks(KIND, STOCHASTIC, WRITE_PARAMS))
    adamw_step_kernel(AdamWShard shard, AdamWStepScalars sc, const __grid_constant__ AdamWAmaxParts amax) {
    constexpr bool FP8 = KIND == OPT_STATES_FP8 || KIND == OPT_STATES_FP8_DRE;
    constexpr bool DRE = KIND == OPT_STATES_FP8_DRE;
    constexpr int SCALARS = DRE ? 3 : 1;
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * ADAMW_VEC;
    bool active = i < shard.n;  // n is a multiple of 128: whole groups are in or out
    bool gather_amax = amax.count > 0;  // the same in every thread
    if (!FP8 && !active && !gather_amax) return;
    __shared__ unsigned group_max[ADAMW_BLOCK_GROUPS];
    int amax_part = gather_amax ? adamw_amax_block_part(amax, shard.first_group + blockIdx.x * ADAMW_BLOCK_GROUPS) : -1;
    size_t group = i / ADAMW_GROUP;
    __shared__ DreTables tables;
    __shared__ DreBlockGroups block_groups;
    __shared__ __align__(16) float magnitudes[DRE ? 2 * ADAMW_BLOCK_GROUPS : 1][DRE_CODES];  // dre_fill_magnitudes
    const int block_group = threadIdx.x / ADAMW_THREADS_PER_GROUP;
    if constexpr (DRE) {  // FP8 kinds keep every thread to the end (the barriers)
        dre_fill_tables(&tables);
        int lane = threadIdx.x - 32;  // warp 1 (the table is warp 0's): the decode's constants
        if (lane >= 0 && lane < 2 * ADAMW_BLOCK_GROUPS) {
            size_t lane_group = (size_t)blockIdx.x * ADAMW_BLOCK_GROUPS + lane / 2;
            const float *scalars = (lane % 2 ? shard.v_group : shard.m_group) + lane_group * SCALARS;
            block_groups.decode[lane] = lane_group * ADAMW_GROUP < shard.n
                                            ? dre_decode_constants(scalars[0], scalars[1], scalars[2])
                                            : DreDecode{0.0f, 1.0f, 1.0f};
        }
        __syncthreads();
    }

    float p[ADAMW_VEC] = {0}, g[ADAMW_VEC] = {0}, m[ADAMW_VEC] = {0}, v[ADAMW_VEC] = {0};
    // The FP8 kinds' moments, decoded by every lane of the warp (DRE's shuffles need them all),
    // inactive groups as an all-zero group's codes and constants.
    if constexpr (FP8) {
        uint2 m_codes = make_uint2(0u, 0u), v_codes = m_codes;
        if (active) {
            m_codes = *(const uint2 *)((const unsigned char *)shard.m + i);
            v_codes = *(const uint2 *)((const unsigned char *)shard.v + i);
        }
        if constexpr (DRE) {
            DreDecode of_m = block_groups.decode[DRE_GROUP_LANE(block_group, 0)];
            DreDecode of_v = block_groups.decode[DRE_GROUP_LANE(block_group, 1)];
            int lane = threadIdx.x % ADAMW_THREADS_PER_GROUP;
            float mantissa_log2 = tables.mantissa_log2[lane];
            float *m_magnitudes = magnitudes[DRE_GROUP_LANE(block_group, 0)];
            float *v_magnitudes = magnitudes[DRE_GROUP_LANE(block_group, 1)];
            dre_fill_magnitudes(m_magnitudes, dre_binade_factor(of_m, lane), dre_mantissa_factor(of_m, lane, mantissa_log2));
            dre_fill_magnitudes(v_magnitudes, dre_binade_factor(of_v, lane), dre_mantissa_factor(of_v, lane, mantissa_log2));
            __syncwarp();
            dequantize8_e4m3<true>(m, m_codes, m_magnitudes, 0.0f);
            dequantize8_e4m3<true>(v, v_codes, v_magnitudes, 0.0f);
        } else {
            float m_scale = 1.0f, v_scale = 1.0f;
            if (active) {
                m_scale = shard.m_group[group];
                v_scale = shard.v_group[group];
            }
            dequantize8_e4m3<false>(m, m_codes, NULL, m_scale);
            dequantize8_e4m3<false>(v, v_codes, NULL, v_scale);
        }
    }

    if (active) {
        adamw_load8(shard.master + i, p);
        if (shard.grads_f32) {
            adamw_load8(shard.grads_f32 + i, g);
        } else {
            Vec16<bf16> grad = load16_stream(shard.grads + i);
            for (int j = 0; j < ADAMW_VEC; j++) g[j] = __bfloat162float(grad[j]);
        }
        for (int j = 0; j < ADAMW_VEC; j++) g[j] = mul_unfused(g[j], sc.grad_scale);
        if constexpr (KIND == OPT_STATES_FP32) {
            adamw_load8((const float *)shard.m + i, m);
            adamw_load8((const float *)shard.v + i, v);
        } else if constexpr (KIND == OPT_STATES_BF16) {
            adamw_load8((const bf16 *)shard.m + i, m);
            adamw_load8((const bf16 *)shard.v + i, v);
        }
        float decay = shard.decay_group[group] ? sc.weight_decay : 0.0f;
        for (int j = 0; j < ADAMW_VEC; j++) {
            m[j] = fmaf(sc.beta1, m[j], mul_unfused(sc.one_minus_beta1, g[j]));
            v[j] = fmaf(sc.beta2, v[j], mul_unfused(mul_unfused(sc.one_minus_beta2, g[j]), g[j]));
            float m_hat = mul_unfused(m[j], sc.inverse_bias_correction1);
            float v_hat = mul_unfused(v[j], sc.inverse_bias_correction2);
            float update = fmaf(decay, p[j], m_hat / (sqrtf(v_hat) + sc.eps));
            p[j] = fmaf(-sc.lr, update, p[j]);
        }
        adamw_store8(shard.master + i, p);
        if constexpr (WRITE_PARAMS) adamw_store8(shard.params + i, p);
        if constexpr (KIND == OPT_STATES_FP32) {
            adamw_store8((float *)shard.m + i, m);
            adamw_store8((float *)shard.v + i, v);
        } else if constexpr (KIND == OPT_STATES_BF16) {
            adamw_store8((bf16 *)shard.m + i, m);
            adamw_store8((bf16 *)shard.v + i, v);
        }
    }
    if (gather_amax) adamw_amax_of_group(p, active, group_max);
    if constexpr (FP8) {  // every lane takes part in the group reductions (inactive ones with zeros)
        float m_max, m_min, v_max, v_min;
        adamw_local_range(m, &m_max, &m_min);
        adamw_local_range(v, &v_max, &v_min);
        m_max = adamw_group_max(m_max);
        m_min = adamw_group_min(m_min);
        v_max = adamw_group_max(v_max);
        v_min = adamw_group_min(v_min);
        DreEncode m_encode, v_encode;
        if constexpr (DRE) {
            if (threadIdx.x % ADAMW_THREADS_PER_GROUP == 0) {
                block_groups.max_abs[DRE_GROUP_LANE(block_group, 0)] = m_max;
                block_groups.min_abs[DRE_GROUP_LANE(block_group, 0)] = m_min;
                block_groups.max_abs[DRE_GROUP_LANE(block_group, 1)] = v_max;
                block_groups.min_abs[DRE_GROUP_LANE(block_group, 1)] = v_min;
            }
            __syncthreads();
            if (threadIdx.x < 2 * ADAMW_BLOCK_GROUPS) {
                float max_abs = block_groups.max_abs[threadIdx.x], min_abs = block_groups.min_abs[threadIdx.x];
                DreEncode e = dre_encode_constants<true>(max_abs, min_abs);
                dre_encode_unit(&e, max_abs, min_abs);
                block_groups.encode[threadIdx.x] = e;
            }
            __syncthreads();
            m_encode = block_groups.encode[DRE_GROUP_LANE(block_group, 0)];
            v_encode = block_groups.encode[DRE_GROUP_LANE(block_group, 1)];
        } else {
            m_encode = dre_encode_constants<false>(m_max, m_min);
            v_encode = dre_encode_constants<false>(v_max, v_min);
        }
        uint64_t index = sc.first_index + i;
        uint2 m_codes = quantize8_e4m3<DRE, STOCHASTIC>(m, m_encode, sc.rounding_key[0], index);
        uint2 v_codes = quantize8_e4m3<DRE, STOCHASTIC>(v, v_encode, sc.rounding_key[1], index);
        if (active) {
            *(uint2 *)((unsigned char *)shard.m + i) = m_codes;
            *(uint2 *)((unsigned char *)shard.v + i) = v_codes;
            if (threadIdx.x % ADAMW_THREADS_PER_GROUP == 0) {
                float *m_group = shard.m_group + group * SCALARS, *v_group = shard.v_group + group * SCALARS;
                m_group[0] = m_encode.scale;
                v_group[0] = v_encode.scale;
                if (DRE) {
                    m_group[1] = m_encode.k;
                    m_group[2] = m_encode.c;
                    v_group[1] = v_encode.k;
                    v_group[2] = v_encode.c;
                }
            }
        }
    }
    if (gather_amax) adamw_amax_commit(amax, amax_part, group_max);
}

__global__ void adamw_fill_kernel(float *out, float value, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = value;
}

// params[i] = bf16_rn(master[i]) over one part (both pointers start at it).
__global__ void adamw_master_to_params_kernel(bf16 *params, const float *master, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * ADAMW_VEC;
    if (i >= n) return;
    float p[ADAMW_VEC];
    adamw_load8(master + i, p);
    adamw_store8(params + i, p);
}

__global__ void adamw_params_to_master_kernel(float *master, const bf16 *params, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * ADAMW_VEC;
    if (i >= n) return;
    float p[ADAMW_VEC];
    adamw_load8(params + i, p);
    adamw_store8(master + i, p);
}

// ---- host side --------------------------------------------------------------------------

static inline void adamw_check_aligned(const void *pointer, const char *what) {
    if ((uintptr_t)pointer % 16 != 0) fail_with(what, "pointer is not 16-byte aligned");
}

// Rank `rank`'s part of range i in the parameter order: [*begin, *end).
static inline void adamw_part_of(const AdamW *opt, int i, int rank, size_t *begin, size_t *end) {
    param_shard_part(&opt->ranges[i], rank, begin, end);
}

// Where this rank's part of range i sits in the device buffers.
static inline int adamw_part_has_params(const AdamW *opt, int i) { return opt->ranges[i].at != PARAM_NOT_IN_BUFFER; }
static inline size_t adamw_part_at(const AdamW *opt, int i) {
    return opt->ranges[i].at + (size_t)opt->rank * opt->ranges[i].part;
}

// Elements of this rank's parts inside the model (the rest is padding).
static inline size_t adamw_shard_used(const AdamW *opt) {
    size_t used = 0;
    for (int i = 0; i < opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(opt, i, opt->rank, &begin, &end);
        used += end - begin;
    }
    return used;
}

// Calls visit(opt, range, part begin, part end, tensor part begin, end, kind) for every tensor's
// elements in this rank's parts, in the parameter order.
typedef void (*AdamWTensorVisit)(void *context, int range, size_t begin, size_t end, ParamKind kind);

typedef struct {
    const AdamW *opt;
    const ParamLayout *layout;
    AdamWTensorVisit visit;
    void *context;
} AdamWTensorWalk;

static inline void adamw_tensor_walk_visit(void *context, ParamKind kind, int layer) {
    const AdamWTensorWalk *w = (const AdamWTensorWalk *)context;
    size_t offset = param_offset(w->layout, kind, layer), count = param_numel(w->layout, kind);
    for (int i = 0; i < w->opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(w->opt, i, w->opt->rank, &begin, &end);
        if (offset > begin) begin = offset;
        if (offset + count < end) end = offset + count;
        if (begin < end) w->visit(w->context, i, begin, end, kind);
    }
}

static inline void adamw_for_each_tensor_part(const AdamW *opt, const ParamLayout *layout, AdamWTensorVisit visit,
                                              void *context) {
    AdamWTensorWalk walk = {opt, layout, visit, context};
    param_for_each_tensor(layout, adamw_tensor_walk_visit, &walk);
}

// The state index of element `e` of the parameter order, in this rank's part of range i.
static inline size_t adamw_state_index(const AdamW *opt, int i, size_t e) {
    const ParamShardRange *r = &opt->ranges[i];
    return r->state_at + (e - r->begin - (size_t)opt->rank * r->part);
}

typedef struct {
    const AdamW *opt;
    unsigned char *table;
    int decay_all;
} AdamWDecayTable;

static inline void adamw_decay_visit(void *context, int range, size_t begin, size_t end, ParamKind kind) {
    const AdamWDecayTable *t = (const AdamWDecayTable *)context;
    int decay = t->decay_all || param_kind_is_matrix(kind);
    for (size_t e = begin; e < end; e += ADAMW_GROUP)  // begin: a tensor's or a part's, a multiple of 128
        t->table[adamw_state_index(t->opt, range, e) / ADAMW_GROUP] = (unsigned char)decay;
}

// Allocates the state of this rank's parts of `ranges` (rank `rank`, ranges[i].state_at their
// places back to back): moments zero (FP8 groups as an all-zero group: s = k = c = 1), master
// zero until adamw_set_master_* or adamw_init_master fills it, step 0. The weight-decay table
// holds 1 for the groups of decayed tensors; groups past the model (padding) hold only zeros
// and are not decayed.
static inline void adamw_create_ranges(AdamW *opt, OptimizerStateKind kind, const AdamWConfig *config,
                                       const ParamLayout *layout, const ParamShardRange *ranges, int range_count, int rank,
                                       cudaStream_t stream) {
    size_t n = 0;
    for (int i = 0; i < range_count; i++) {
        const ParamShardRange *r = &ranges[i];
        int at_aligned = r->at == PARAM_NOT_IN_BUFFER || r->at % ADAMW_GROUP == 0;
        if (r->begin % ADAMW_GROUP != 0 || r->part % ADAMW_GROUP != 0 || !at_aligned || r->state_at != n) {
            char detail[200];
            snprintf(detail, sizeof(detail), "range %d ([%zu, %zu), parts of %zu at %zu, state at %zu) must be in multiples "
                     "of %d, its parts back to back", i, r->begin, r->end, r->part, r->at, r->state_at, ADAMW_GROUP);
            fail_with("adamw_create", detail);
        }
        n += r->part;
    }
    if (n == 0) fail_with("adamw_create", "the optimizer's parts are empty");
    size_t groups = n / ADAMW_GROUP;
    size_t scalars = adamw_group_scalars(kind), moment_bytes = adamw_moment_elem_bytes(kind) * n;
    opt->config = *config;
    opt->kind = kind;
    opt->step = 0;
    opt->amax = NULL;
    opt->rank = rank;
    opt->range_count = range_count;
    opt->ranges = (ParamShardRange *)malloc(range_count * sizeof(ParamShardRange));
    if (!opt->ranges) fail_with("adamw_create", "out of host memory for the ranges");
    memcpy(opt->ranges, ranges, range_count * sizeof(ParamShardRange));
    opt->n = n;
    opt->total = layout->total_padded;
    opt->state_bytes = adamw_payload_bytes(kind, n);
    opt->state = gpu_alloc(opt->state_bytes, "the optimizer state");
    cudaCheck(cudaMemsetAsync(opt->state, 0, opt->state_bytes, stream));
    unsigned char *base = (unsigned char *)opt->state;
    opt->master = (float *)base;
    opt->m = base + 4 * n;
    opt->v = base + 4 * n + moment_bytes;
    opt->m_group = scalars ? (float *)(base + 4 * n + 2 * moment_bytes) : NULL;
    opt->v_group = scalars ? opt->m_group + groups * scalars : NULL;
    if (scalars) {
        size_t count = 2 * groups * scalars;
        adamw_fill_kernel<<<(unsigned)ceil_div_size(count, 256), 256, 0, stream>>>(opt->m_group, 1.0f, count);
        cudaCheckLaunch();
    }
    unsigned char *table = (unsigned char *)calloc(groups, 1);
    if (!table) fail_with("adamw_create", "out of host memory for the weight-decay table");
    AdamWDecayTable context = {opt, table, config->weight_decay_all};
    adamw_for_each_tensor_part(opt, layout, adamw_decay_visit, &context);
    opt->decay_group = (unsigned char *)gpu_alloc(groups, "the weight-decay table");
    cudaCheck(cudaMemcpyAsync(opt->decay_group, table, groups, cudaMemcpyHostToDevice, stream));
    cudaCheck(cudaStreamSynchronize(stream));
    free(table);
}

// One range: the elements [shard_begin, shard_end) of the parameter order (multiples of 128; the
// part past the model is padding), at the same place in the device buffer.
static inline void adamw_create(AdamW *opt, OptimizerStateKind kind, const AdamWConfig *config,
                                const ParamLayout *layout, size_t shard_begin, size_t shard_end, cudaStream_t stream) {
    if (shard_end <= shard_begin) fail_with("adamw_create", "the shard is empty");
    ParamShardRange range = {shard_begin, layout->total_padded > shard_begin ? layout->total_padded : shard_begin,
                             shard_begin, shard_end - shard_begin, 0};
    adamw_create_ranges(opt, kind, config, layout, &range, 1, 0, stream);
}

// Device bytes adamw_create allocated: the state and the weight-decay table beside it.
static inline size_t adamw_allocated_bytes(const AdamW *opt) { return opt->state_bytes + opt->n / ADAMW_GROUP; }

static inline void adamw_free(AdamW *opt) {
    cudaCheck(cudaFree(opt->state));
    cudaCheck(cudaFree(opt->decay_group));
    free(opt->ranges);
    opt->state = NULL;
    opt->decay_group = NULL;
    opt->ranges = NULL;
    free(opt->amax);
    opt->amax = NULL;
}

// Master weights from an FP32 host buffer of the whole model, params_fp32[total]: this rank's
// parts of it (their padding stays zero).
static inline void adamw_set_master_from_host(AdamW *opt, const float *params_fp32, cudaStream_t stream) {
    for (int i = 0; i < opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(opt, i, opt->rank, &begin, &end);
        if (end > begin)
            cudaCheck(cudaMemcpyAsync(opt->master + opt->ranges[i].state_at, params_fp32 + begin, 4 * (end - begin),
                                      cudaMemcpyHostToDevice, stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
}

// master[i] = value * (normal ? random_normal_at(seed, first + i) : 1) for count elements: one
// tensor's piece of a part, element e of the parameter order at index first + i = e (params.h's rule).
__global__ void adamw_init_kernel(float *master, unsigned long long seed, size_t first, size_t count, float value,
                                  int normal) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < count) master[i] = normal ? value * random_normal_at(seed, first + i) : value;
}

typedef struct {
    const AdamW *opt;
    const ParamLayout *layout;
    unsigned long long seed;
    cudaStream_t stream;
} AdamWInit;

static inline void adamw_init_visit(void *context, int range, size_t begin, size_t end, ParamKind kind) {
    const AdamWInit *init = (const AdamWInit *)context;
    int normal = param_kind_is_matrix(kind);
    float value = normal ? param_init_std(init->layout, kind) : 1.0f;
    adamw_init_kernel<<<(unsigned)ceil_div_size(end - begin, 256), 256, 0, init->stream>>>(
        init->opt->master + adamw_state_index(init->opt, range, begin), init->seed, begin, end - begin, value, normal);
    cudaCheckLaunch();
}

// Master weights of this rank's parts from a fresh initialisation, computed on the GPU: the same
// bits as param_init_weights on the host, in a fraction of a second at any size (no host buffer).
static inline void adamw_init_master(AdamW *opt, const ParamLayout *layout, unsigned long long seed, cudaStream_t stream) {
    cudaCheck(cudaMemsetAsync(opt->master, 0, 4 * opt->n, stream));  // padding
    AdamWInit init = {opt, layout, seed, stream};
    adamw_for_each_tensor_part(opt, layout, adamw_init_visit, &init);
}

// Master weights from the BF16 parameters (the whole device buffer), exactly.
static inline void adamw_set_master_from_params(AdamW *opt, const bf16 *params, cudaStream_t stream) {
    adamw_check_aligned(params, "adamw_set_master_from_params: params");
    for (int i = 0; i < opt->range_count; i++) {
        if (!adamw_part_has_params(opt, i)) fail_with("adamw_set_master_from_params", "a range has no BF16 parameters");
        size_t n = opt->ranges[i].part;
        adamw_params_to_master_kernel<<<(unsigned)ceil_div_size(n / ADAMW_VEC, ADAMW_THREADS), ADAMW_THREADS, 0, stream>>>(
            opt->master + opt->ranges[i].state_at, params + adamw_part_at(opt, i), n);
        cudaCheckLaunch();
    }
}

// This rank's parts of the BF16 parameters (the whole device buffer) as the master rounded to
// nearest even: what a step writes, for after adamw_set_master_from_host or adamw_load.
static inline void adamw_write_params(const AdamW *opt, bf16 *params, cudaStream_t stream) {
    adamw_check_aligned(params, "adamw_write_params: params");
    for (int i = 0; i < opt->range_count; i++) {
        if (!adamw_part_has_params(opt, i)) continue;
        size_t n = opt->ranges[i].part;
        adamw_master_to_params_kernel<<<(unsigned)ceil_div_size(n / ADAMW_VEC, ADAMW_THREADS), ADAMW_THREADS, 0, stream>>>(
            params + adamw_part_at(opt, i), opt->master + opt->ranges[i].state_at, n);
        cudaCheckLaunch();
    }
}

// This rank's master weights into their places of host_params[total] (the checkpoint's FP32
// weights); waits for the copies.
static inline void adamw_copy_master_to_host(const AdamW *opt, float *host_params, cudaStream_t stream) {
    for (int i = 0; i < opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(opt, i, opt->rank, &begin, &end);
        if (end > begin)
            cudaCheck(cudaMemcpyAsync(host_params + begin, opt->master + opt->ranges[i].state_at, 4 * (end - begin),
                                      cudaMemcpyDeviceToHost, stream));
    }
    cudaCheck(cudaStreamSynchronize(stream));
}

// The step kernel over one part, with or without its BF16 parameters.
template <OptimizerStateKind KIND, bool STOCHASTIC>
static inline void adamw_launch_step(unsigned blocks, cudaStream_t stream, const AdamWShard &shard, const AdamWStepScalars &sc,
                                     const AdamWAmaxParts &amax) {
    if (shard.params) adamw_step_kernel<KIND, STOCHASTIC, true><<<blocks, ADAMW_THREADS, 0, stream>>>(shard, sc, amax);
    else adamw_step_kernel<KIND, STOCHASTIC, false><<<blocks, ADAMW_THREADS, 0, stream>>>(shard, sc, amax);
    cudaCheckLaunch();
}

// From now on each step gathers the amax of `parts` (a copy is kept); NULL: none.
static inline void adamw_set_amax_parts(AdamW *opt, const AdamWAmaxParts *parts) {
    free(opt->amax);
    opt->amax = NULL;
    if (parts == NULL) return;
    for (int i = 0; i < parts->count; i++)
        if (parts->end_group[i] <= parts->first_group[i] || (size_t)parts->end_group[i] > opt->n / ADAMW_GROUP ||
            (i > 0 && parts->first_group[i] < parts->end_group[i - 1]))
            fail_with("adamw_set_amax_parts", "the parts must be non-empty, ascending, disjoint and in the state");
    opt->amax = (AdamWAmaxParts *)malloc(sizeof(AdamWAmaxParts));
    if (opt->amax == NULL) fail_with("adamw_set_amax_parts", "out of host memory");
    *opt->amax = *parts;
}

// One AdamW step over this rank's parts (t = ++opt->step), a launch per part: params is the whole
// device buffer, the parts' n gradients back to back in BF16 (grads_shard) or FP32 (grads_f32,
// grads_shard NULL). grad_scale multiplies every gradient first (the clip factor).
static inline void adamw_step_any(AdamW *opt, bf16 *params, const bf16 *grads_shard, const float *grads_f32, float lr,
                                  float grad_scale, cudaStream_t stream) {
    adamw_check_aligned(params, "adamw_step: params");
    adamw_check_aligned(grads_shard ? (const void *)grads_shard : (const void *)grads_f32, "adamw_step: gradients");
    opt->step++;
    const AdamWConfig *c = &opt->config;
    AdamWStepScalars sc;
    sc.lr = lr;
    sc.grad_scale = grad_scale;
    sc.beta1 = c->beta1;
    sc.one_minus_beta1 = 1.0f - c->beta1;
    sc.beta2 = c->beta2;
    sc.one_minus_beta2 = 1.0f - c->beta2;
    sc.eps = c->eps;
    sc.weight_decay = c->weight_decay;
    sc.inverse_bias_correction1 = (float)(1.0 / (1.0 - pow((double)c->beta1, (double)opt->step)));
    sc.inverse_bias_correction2 = (float)(1.0 / (1.0 - pow((double)c->beta2, (double)opt->step)));
    int stochastic = c->stochastic_rounding && adamw_group_scalars(opt->kind) > 0;
    for (int moment = 0; moment < 2; moment++) sc.rounding_key[moment] = stochastic ? adamw_rounding_key(opt->step, moment) : 0;
    size_t elem_bytes = adamw_moment_elem_bytes(opt->kind), scalars = adamw_group_scalars(opt->kind);
    static const AdamWAmaxParts no_amax = {};
    const AdamWAmaxParts &amax = opt->amax ? *opt->amax : no_amax;
    for (int i = 0; i < opt->range_count; i++) {
        size_t at = opt->ranges[i].state_at, groups_at = at / ADAMW_GROUP * scalars;
        sc.first_index = opt->ranges[i].begin + (size_t)opt->rank * opt->ranges[i].part;  // the stochastic rounding's index
        AdamWShard shard;
        shard.params = adamw_part_has_params(opt, i) ? params + adamw_part_at(opt, i) : NULL;
        shard.grads = grads_shard ? grads_shard + at : NULL;
        shard.grads_f32 = grads_f32 ? grads_f32 + at : NULL;
        shard.master = opt->master + at;
        shard.m = (unsigned char *)opt->m + at * elem_bytes;
        shard.v = (unsigned char *)opt->v + at * elem_bytes;
        shard.m_group = opt->m_group ? opt->m_group + groups_at : NULL;
        shard.v_group = opt->v_group ? opt->v_group + groups_at : NULL;
        shard.decay_group = opt->decay_group + at / ADAMW_GROUP;
        shard.n = opt->ranges[i].part;
        shard.first_group = (uint32_t)(at / ADAMW_GROUP);
        unsigned blocks = (unsigned)ceil_div_size(shard.n / ADAMW_VEC, ADAMW_THREADS);
        switch (opt->kind) {
        case OPT_STATES_FP32: adamw_launch_step<OPT_STATES_FP32, false>(blocks, stream, shard, sc, amax); break;
        case OPT_STATES_BF16: adamw_launch_step<OPT_STATES_BF16, false>(blocks, stream, shard, sc, amax); break;
        case OPT_STATES_FP8:
            if (stochastic) adamw_launch_step<OPT_STATES_FP8, true>(blocks, stream, shard, sc, amax);
            else adamw_launch_step<OPT_STATES_FP8, false>(blocks, stream, shard, sc, amax);
            break;
        case OPT_STATES_FP8_DRE:
            if (stochastic) adamw_launch_step<OPT_STATES_FP8_DRE, true>(blocks, stream, shard, sc, amax);
            else adamw_launch_step<OPT_STATES_FP8_DRE, false>(blocks, stream, shard, sc, amax);
            break;
        }
    }
}

static inline void adamw_step(AdamW *opt, bf16 *params, const bf16 *grads_shard, float lr, float grad_scale,
                              cudaStream_t stream) {
    adamw_step_any(opt, params, grads_shard, NULL, lr, grad_scale, stream);
}
static inline void adamw_step_fp32_grads(AdamW *opt, bf16 *params, const float *grads_shard, float lr, float grad_scale,
                                         cudaStream_t stream) {
    adamw_step_any(opt, params, NULL, grads_shard, lr, grad_scale, stream);
}

// ---- checkpoints ------------------------------------------------------------------------
// A checkpoint holds the state of the whole buffer [0, total) as one optimizer over it would:
// the master weights (the checkpoint's weights), then a header and m, v, m's group scalars and
// v's. Each section is an array over the 128-groups of the parameter order, so the ranks' parts
// map into it section by section: a part's groups sit at (its first element / 128) x (bytes per
// group). Rank 0 writes every part in the parameter order (range by range, rank by rank), each
// fetched by the caller's `gather` a chunk at a time; or each rank writes its own parts to its
// part file (coat/checkpoint_parts.h, the arrays CHECKPOINT_ARRAYS). Every rank
// reads its own parts back through a Checkpoint, from either form, so a checkpoint resumes on any
// world size and any bucketing. The header is 7 little-endian uint64; the decay table is rebuilt
// from the config.

typedef struct {
    uint64_t magic, version, state_kind, shard_begin, shard_end, step, payload_bytes;
} AdamWCheckpointHeader;
static_assert(ADAMW_SECTIONS == CHECKPOINT_ARRAYS, "a per-rank checkpoint's arrays are the state's sections");

// Section `section` of this rank's device state.
static inline unsigned char *adamw_section(const AdamW *opt, int section) {
    size_t at = 0;
    for (int i = 0; i < section; i++) at += opt->n / ADAMW_GROUP * adamw_section_group_bytes(opt->kind, i);
    return (unsigned char *)opt->state + at;
}

// The optimizer part after the weights: header and sections 1.. over [0, total).
static inline size_t adamw_saved_bytes(const AdamW *opt) { return adamw_payload_bytes(opt->kind, opt->total) - 4 * opt->total; }
static inline size_t adamw_checkpoint_bytes(const AdamW *opt) { return sizeof(AdamWCheckpointHeader) + adamw_saved_bytes(opt); }

static inline void adamw_checkpoint_header(const AdamW *opt, AdamWCheckpointHeader *h) {
    h->magic = ADAMW_CHECKPOINT_MAGIC;
    h->version = ADAMW_CHECKPOINT_VERSION;
    h->state_kind = (uint64_t)opt->kind;
    h->shard_begin = 0;
    h->shard_end = opt->total;
    h->step = (uint64_t)opt->step;
    h->payload_bytes = adamw_saved_bytes(opt);
}

// 0 when a saved header fits this optimizer; otherwise -1 with what is wrong in `error`.
static inline int adamw_checkpoint_header_check(const AdamW *opt, const AdamWCheckpointHeader *h, char *error,
                                                size_t error_size) {
    if (h->magic != ADAMW_CHECKPOINT_MAGIC) {
        snprintf(error, error_size, "not an AdamW state (bad magic)");
        return -1;
    }
    if (h->version != ADAMW_CHECKPOINT_VERSION) {
        snprintf(error, error_size, "AdamW state version %llu, expected %d", (unsigned long long)h->version,
                 ADAMW_CHECKPOINT_VERSION);
        return -1;
    }
    if (h->state_kind != (uint64_t)opt->kind) {
        snprintf(error, error_size, "optimizer states are %s in the file, %s in the config",
                 h->state_kind <= OPT_STATES_FP8_DRE ? optimizer_state_kind_name((OptimizerStateKind)h->state_kind) : "unknown",
                 optimizer_state_kind_name(opt->kind));
        return -1;
    }
    if (h->shard_begin != 0 || h->shard_end != opt->total) {
        snprintf(error, error_size, "optimizer states cover [%llu, %llu) in the file, [0, %zu) in this model",
                 (unsigned long long)h->shard_begin, (unsigned long long)h->shard_end, opt->total);
        return -1;
    }
    if (h->payload_bytes != adamw_saved_bytes(opt)) {
        snprintf(error, error_size, "optimizer state of %llu bytes in the file, %zu expected",
                 (unsigned long long)h->payload_bytes, adamw_saved_bytes(opt));
        return -1;
    }
    if (h->step > (uint64_t)1 << 62) {
        snprintf(error, error_size, "corrupt optimizer step count %llu", (unsigned long long)h->step);
        return -1;
    }
    return 0;
}

// Moves `bytes` of rank `from`'s device memory to rank 0's host memory `host` (one rank: a copy).
typedef void (*AdamWGather)(void *context, const void *device, void *host, size_t bytes, int from);

// Section `section` of the parts of ranks [first, first + count), range by range and rank by
// rank, each fetched by `gather` through `host` (chunk_bytes of host memory) and written to `sink`
// (NULL on a rank that sends its parts but writes none). Every rank of a gather calls this in the
// same order; a failed write is kept in the sink and the gathers go on, so that every rank stays
// in step.
static inline void adamw_write_section(const AdamW *opt, int section, CheckpointSink *sink, int first, int count,
                                       AdamWGather gather, void *context, unsigned char *host, size_t chunk_bytes) {
    size_t group_bytes = adamw_section_group_bytes(opt->kind, section);
    for (int i = 0; i < opt->range_count; i++)
        for (int r = first; r < first + count; r++) {
            size_t begin, end;
            adamw_part_of(opt, i, r, &begin, &end);
            size_t bytes = (end - begin) / ADAMW_GROUP * group_bytes;
            // a part sits at the same place in every rank's state: rank r sends its own
            const unsigned char *device = adamw_section(opt, section) + opt->ranges[i].state_at / ADAMW_GROUP * group_bytes;
            for (size_t done = 0; done < bytes; done += chunk_bytes) {
                size_t chunk = bytes - done < chunk_bytes ? bytes - done : chunk_bytes;
                gather(context, device + done, host, chunk, r);
                if (sink) checkpoint_sink_write(sink, host, chunk);
            }
        }
}

// Bytes [at, at + n) of the checkpoint, or an exit with its error (naming the file).
static inline void adamw_read_or_exit(Checkpoint *ck, unsigned long long at, void *out, size_t n) {
    char error[8192];
    if (checkpoint_read(ck, at, out, n, error, sizeof(error)) == 0) return;
    fprintf(stderr, "error: %s\n", error);
    exit(EXIT_FAILURE);
}

// This rank's parts of section `section`, which starts at byte `start` of the checkpoint (the
// single file's offsets, whichever form holds it), through `host` (ADAMW_COPY_CHUNK_BYTES of
// host memory).
static inline void adamw_read_section(AdamW *opt, int section, Checkpoint *ck, unsigned long long start,
                                      unsigned char *host, cudaStream_t stream) {
    size_t group_bytes = adamw_section_group_bytes(opt->kind, section);
    for (int i = 0; i < opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(opt, i, opt->rank, &begin, &end);
        size_t bytes = (end - begin) / ADAMW_GROUP * group_bytes;
        unsigned long long at = start + (unsigned long long)(begin / ADAMW_GROUP) * group_bytes;
        unsigned char *device = adamw_section(opt, section) + opt->ranges[i].state_at / ADAMW_GROUP * group_bytes;
        for (size_t done = 0; done < bytes; done += ADAMW_COPY_CHUNK_BYTES) {
            size_t chunk = bytes - done < ADAMW_COPY_CHUNK_BYTES ? bytes - done : ADAMW_COPY_CHUNK_BYTES;
            adamw_read_or_exit(ck, at + done, host, chunk);
            cudaCheck(cudaMemcpyAsync(device + done, host, chunk, cudaMemcpyHostToDevice, stream));
            cudaCheck(cudaStreamSynchronize(stream));
        }
    }
}

// Rank `rank`'s parts in the parameter order, the non-empty ones, as adamw_write_section writes
// them for that rank alone: a part file's ranges (coat/checkpoint_parts.h). Returns their count
// (at most range_count).
static inline int adamw_part_ranges(const AdamW *opt, int rank, CheckpointRange *out) {
    int count = 0;
    for (int i = 0; i < opt->range_count; i++) {
        size_t begin, end;
        adamw_part_of(opt, i, rank, &begin, &end);
        if (end > begin) out[count].begin = begin, out[count].end = end, count++;
    }
    return count;
}

// The optimizer part of a checkpoint (the weights written before it): header and sections, of
// the parts of ranks [first, first + count), as adamw_write_section writes them (the header by
// a rank with a sink).
static inline void adamw_save(const AdamW *opt, CheckpointSink *sink, int first, int count, AdamWGather gather,
                              void *context, unsigned char *host, size_t chunk_bytes) {
    AdamWCheckpointHeader h;
    adamw_checkpoint_header(opt, &h);
    if (sink) checkpoint_sink_write(sink, &h, sizeof(h));
    for (int section = 1; section < ADAMW_SECTIONS; section++)
        adamw_write_section(opt, section, sink, first, count, gather, context, host, chunk_bytes);
}

// Reads it back from byte `start` of the checkpoint (this rank's parts).
static inline void adamw_load(AdamW *opt, Checkpoint *ck, unsigned long long start, unsigned char *host, cudaStream_t stream) {
    AdamWCheckpointHeader h;
    char error[256];
    adamw_read_or_exit(ck, start, &h, sizeof(h));
    if (adamw_checkpoint_header_check(opt, &h, error, sizeof(error)) != 0) fail_with(ck->path, error);
    start += sizeof(h);
    for (int section = 1; section < ADAMW_SECTIONS; section++) {
        adamw_read_section(opt, section, ck, start, host, stream);
        start += (unsigned long long)(opt->total / ADAMW_GROUP) * adamw_section_group_bytes(opt->kind, section);
    }
    opt->step = (long long)h.step;
}

// A gather for one rank: a device-to-host copy.
static inline void adamw_gather_copy(void *stream, const void *device, void *host, size_t bytes, int from) {
    (void)from;
    cudaCheck(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, (cudaStream_t)stream));
    cudaCheck(cudaStreamSynchronize((cudaStream_t)stream));
}

// ---- global gradient norm ---------------------------------------------------------------
// Sum of squares of n BF16 or FP32 values in two fixed-shape passes: GRAD_NORM_BLOCKS blocks each
// sum a fixed grid-stride slice in FP32 per 8 values and FP64 across them, reduce in a fixed tree,
// then one block adds the partials in a fixed tree. Same input, same bits, on any GPU.

#define GRAD_NORM_BLOCKS 1024
#define GRAD_NORM_THREADS 256

static inline size_t grad_norm_scratch_bytes(void) { return GRAD_NORM_BLOCKS * sizeof(double); }

__device__ __forceinline__ double grad_norm_warp_sum(double x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024), valid in thread 0.
__device__ __forceinline__ double grad_norm_block_sum(double x) {
    __shared__ double warp_sums[32];
    x = grad_norm_warp_sum(x);
    int warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (threadIdx.x % 32 == 0) warp_sums[warp] = x;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < warps; w++) total += warp_sums[w];
    return total;
}

__device__ __forceinline__ void grad_norm_load8(const bf16 *p, float out[8]) {
    Vec16<bf16> g = load16_stream(p);
    for (int j = 0; j < 8; j++) out[j] = __bfloat162float(g[j]);
}
__device__ __forceinline__ void grad_norm_load8(const float *p, float out[8]) { adamw_load8(p, out); }

template <typename T>
__global__ void __launch_bounds__(GRAD_NORM_THREADS) grad_norm_partial_kernel(double *partials, const T *grads, size_t n_vecs) {
    double sum = 0.0;
    for (size_t vec = (size_t)blockIdx.x * blockDim.x + threadIdx.x; vec < n_vecs; vec += (size_t)gridDim.x * blockDim.x) {
        float g[8], squares = 0.0f;
        grad_norm_load8(grads + vec * 8, g);
        for (int j = 0; j < 8; j++) squares = fmaf(g[j], g[j], squares);
        sum += (double)squares;
    }
    double block_total = grad_norm_block_sum(sum);
    if (threadIdx.x == 0) partials[blockIdx.x] = block_total;
}

__global__ void __launch_bounds__(GRAD_NORM_BLOCKS) grad_norm_final_kernel(float *out, const double *partials) {
    double total = grad_norm_block_sum(partials[threadIdx.x]);
    if (threadIdx.x == 0) *out = (float)total;
}

// *out_device = sum of grads[i]^2 over n values, BF16 or FP32 (n a multiple of 8, grads 16-byte
// aligned); scratch holds grad_norm_scratch_bytes(). Under ZeRO each rank sums its shard and the
// ranks add their sums.
template <typename T>
static inline void grad_norm_squared(float *out_device, const T *grads, size_t n, double *scratch, cudaStream_t stream) {
    if (n % 8 != 0) fail_with("grad_norm_squared", "the element count must be a multiple of 8");
    adamw_check_aligned(grads, "grad_norm_squared: grads");
    grad_norm_partial_kernel<T><<<GRAD_NORM_BLOCKS, GRAD_NORM_THREADS, 0, stream>>>(scratch, grads, n / 8);
    cudaCheckLaunch();
    grad_norm_final_kernel<<<1, GRAD_NORM_BLOCKS, 0, stream>>>(out_device, scratch);
    cudaCheckLaunch();
}

// The factor that scales the gradients to a global norm of at most max_norm (max_norm <= 0: no
// clipping). A non-finite norm must be handled by the caller: this returns 1 for NaN.
static inline float grad_clip_factor(float norm, float max_norm) {
    if (max_norm <= 0.0f) return 1.0f;
    return fminf(1.0f, max_norm / (norm + 1e-6f));
}
