// GPU tests of coat/fp8.cuh against a C reference of the two FP8 formats written here from
// coat/README.md, FP8 formats, without cuda_fp8.h's conversions:
//   - the reference on anchors derived by hand from the formats (zeros, ties to even, subnormal
//     steps, max, saturation of overflow and infinity, NaN) and encode(decode(c)) = c;
//   - fp8_encode on the device against it for every BF16 bit pattern and the floats one ulp either
//     side (196608 values), both formats, bit for bit (NaN codes as "both NaN"); fp8_decode for
//     all 256 codes;
//   - fp8_amax + fp8_quantize on BF16 tensors [R, C] (C not a multiple of 64, R a multiple of 16
//     but not of 64, R not a multiple of 16 without out_t, one large), both formats, out only,
//     out_t only and both: slot amax and scale, codes and transposed codes bit for bit, every
//     element written (outputs poisoned with 0xAB, then 0x54) and the guard bytes after each
//     tensor untouched;
//   - special tensors: all zero, codes in the subnormal range, saturation (slot amax set by hand
//     below max |x|), a NaN (amax and every code NaN), infinities (amax inf);
//   - two fp8_amax calls into one slot give the max of both, in either order;
//   - the 1x16 group helpers in test kernels (fp8_quantize_half_group, fp8_load_group16; and a
//     group per thread, fp8_quantize_group, fp8_load_group): codes, the scale in both lanes of a
//     pair and the dequantized values bit for bit, with all-zero, NaN, infinite, tiny and
//     mixed-magnitude groups.
// Ends with fp8_quantize's GB/s on BF16 [32768, 2048] with out and out_t (informational).
// Device results are compared with the reference computed on the host from the same BF16 (or
// FP32) inputs, with the same FP32 operations: scale = (amax + 1e-10f) / max, q = encode(x / scale).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/fp8.cuh"
#include "check.h"
#include "gpu_test_util.cuh"

#define SEED 20241029ull
#define GUARD_BYTES 64        // poisoned bytes after each FP8 output, which must stay untouched
#define POISON_FIRST 0xAB     // outputs are filled with this, then (second run) with its complement
#define POISON_SECOND 0x54
#define DETAIL_CHARS 200
#define THREADS 256
#define ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))

// ---- the formats, from their definitions ---------------------------------------------------

typedef struct {
    const char *name;
    int mantissa_bits;
    int bias;          // smallest normal exponent: 1 - bias
    float max;
    uint8_t max_code;  // +max: S.1111.110 (E4M3) or S.11110.11 (E5M2)
} Fp8Spec;

static const Fp8Spec E4M3_SPEC = {"E4M3", 3, 7, 448.0f, 0x7e};
static const Fp8Spec E5M2_SPEC = {"E5M2", 2, 15, 57344.0f, 0x7b};
static const Fp8Format FORMATS[2] = {FP8_E4M3, FP8_E5M2};

static const Fp8Spec *spec_of(Fp8Format format) { return format == FP8_E4M3 ? &E4M3_SPEC : &E5M2_SPEC; }

// Round to nearest even, saturate to +-max (infinity too), NaN to the NaN code 0x7f (a NaN in
// both formats). A value a > 0 in binade [2^b, 2^(b+1)), b at least the smallest normal exponent
// emin (subnormals share emin's step), is n steps of 2^(b - mantissa_bits), n in [2^m, 2^(m+1)]
// (n < 2^m only for subnormals); its code is ((b - emin) << m) + n, which also carries n = 2^(m+1)
// into the next exponent and gives subnormals their code n.
static uint8_t host_fp8_encode(float x, Fp8Format format) {
    const Fp8Spec *f = spec_of(format);
    if (isnan(x)) return 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    float a = fabsf(x);
    if (a >= f->max) return sign | f->max_code;
    if (a == 0.0f) return sign;
    int e, emin = 1 - f->bias;
    frexpf(a, &e);  // a in [2^(e-1), 2^e)
    int binade = e - 1 > emin ? e - 1 : emin;
    int n = (int)rintf(ldexpf(a, f->mantissa_bits - binade));  // an exact scaling, then the rounding
    return sign | (uint8_t)(((binade - emin) << f->mantissa_bits) + n);
}

static float host_fp8_decode(uint8_t code, Fp8Format format) {
    const Fp8Spec *f = spec_of(format);
    int m = f->mantissa_bits, exponent = (code & 0x7f) >> m, mantissa = code & ((1 << m) - 1);
    int top_exponent = (1 << (7 - m)) - 1;
    float magnitude;
    if (format == FP8_E4M3 && exponent == top_exponent && mantissa == 7) magnitude = NAN;
    else if (format == FP8_E5M2 && exponent == top_exponent) magnitude = mantissa ? NAN : INFINITY;
    else if (exponent == 0) magnitude = ldexpf((float)mantissa, 1 - f->bias - m);
    else magnitude = ldexpf((float)((1 << m) + mantissa), exponent - f->bias - m);
    return (code & 0x80) ? -magnitude : magnitude;
}

static bool is_nan_code(uint8_t code, Fp8Format format) { return isnan(host_fp8_decode(code, format)); }
static bool same_code(uint8_t a, uint8_t b, Fp8Format format) {
    return a == b || (is_nan_code(a, format) && is_nan_code(b, format));
}

static float host_scale(float amax, Fp8Format format) { return (amax + 1e-10f) / spec_of(format)->max; }

// max |x| over n values; a NaN anywhere makes it NaN.
static float host_amax(const float *x, size_t n) {
    float m = 0.0f;
    for (size_t i = 0; i < n && !isnan(m); i++)
        if (isnan(x[i]) || fabsf(x[i]) > m) m = fabsf(x[i]);
    return m;
}

// ---- bits, mismatches and device buffers -----------------------------------------------------

static uint32_t bits_of(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    return u;
}
static float float_of(uint32_t u) {
    float x;
    memcpy(&x, &u, 4);
    return x;
}
static bool same_float(float a, float b) { return bits_of(a) == bits_of(b) || (isnan(a) && isnan(b)); }

static uint16_t bf16_bits_from_float(float x) {  // round to nearest even; a NaN keeps its sign
    uint32_t u = bits_of(x);
    if (isnan(x)) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}
static float float_of_bf16_bits(uint16_t b) { return float_of((uint32_t)b << 16); }

typedef struct {
    size_t count, first;     // how many differ, and the flat index of the first
    uint32_t expected, got;  // at the first: codes or float bits
} Mismatches;

static void note_mismatch(Mismatches *m, size_t index, uint32_t expected, uint32_t got) {
    if (m->count++ == 0) {
        m->first = index;
        m->expected = expected;
        m->got = got;
    }
}

// Where the first difference is: [row, column] of a tensor of `cols` columns, or a flat index
// (cols 0). Returns the characters written.
static int describe_where(char *buf, const Mismatches *m, size_t cols) {
    if (cols == 0) return snprintf(buf, DETAIL_CHARS, "; first at %zu", m->first);
    return snprintf(buf, DETAIL_CHARS, "; first at [%zu, %zu]", m->first / cols, m->first % cols);
}
// "" when nothing differs, else the first difference, expected vs got (codes, or float values).
static const char *describe_codes(char *buf, const Mismatches *m, size_t cols) {
    if (m->count == 0) return "";
    int used = describe_where(buf, m, cols);
    snprintf(buf + used, DETAIL_CHARS - used, ": expected 0x%02x got 0x%02x", m->expected, m->got);
    return buf;
}
static const char *describe_floats(char *buf, const Mismatches *m, size_t cols) {
    if (m->count == 0) return "";
    int used = describe_where(buf, m, cols);
    snprintf(buf + used, DETAIL_CHARS - used, ": expected %.9g (0x%08x) got %.9g (0x%08x)", (double)float_of(m->expected),
             m->expected, (double)float_of(m->got), m->got);
    return buf;
}

static void *device_alloc(size_t bytes) {
    void *p = NULL;
    cudaCheck(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}
static void *device_copy_of(const void *host, size_t bytes) {
    void *p = device_alloc(bytes);
    cudaCheck(cudaMemcpy(p, host, bytes, cudaMemcpyHostToDevice));
    return p;
}
static void *host_copy_of(const void *device, size_t bytes) {
    void *p = host_alloc(bytes);
    cudaCheck(cudaMemcpy(p, device, bytes, cudaMemcpyDeviceToHost));  // also waits for the kernels before it
    return p;
}
static uint8_t *device_poisoned(size_t bytes, uint8_t poison) {
    uint8_t *p = (uint8_t *)device_alloc(bytes);
    cudaCheck(cudaMemset(p, poison, bytes));
    return p;
}

// ---- the C reference, and the device casts against it ------------------------------------

typedef struct {
    float value;
    uint8_t code;
} CodePair;

// Derived by hand from the formats: E4M3 steps are 2^-9 below 2^-6, 1/8 of the binade above; E5M2
// steps are 2^-16 below 2^-14, 1/4 of the binade above. Ties go to the even mantissa; past max
// (its tie too: 464 for E4M3, 61440 for E5M2, whose even neighbour would be infinity) and
// infinity saturate.
static const CodePair E4M3_ENCODES[] = {
    {0.0f, 0x00},       {-0.0f, 0x80},      {1.0f, 0x38},       {-1.0f, 0xb8},      {1.0625f, 0x38},
    {1.1875f, 0x3a},    {240.0f, 0x77},     {256.0f, 0x78},     {0x1p-6f, 0x08},    {0x1.cp-7f, 0x07},
    {0x1p-9f, 0x01},    {0x1p-10f, 0x00},   {0x1.8p-10f, 0x01}, {0x1.8p-9f, 0x02},  {-0x1p-12f, 0x80},
    {448.0f, 0x7e},     {-448.0f, 0xfe},    {464.0f, 0x7e},     {480.0f, 0x7e},     {1e30f, 0x7e},
    {INFINITY, 0x7e},   {-INFINITY, 0xfe},  {NAN, 0x7f},
};
static const CodePair E4M3_DECODES[] = {
    {0.0f, 0x00}, {-0.0f, 0x80}, {1.0f, 0x38}, {0x1p-9f, 0x01}, {0x1.cp-7f, 0x07}, {0x1p-6f, 0x08},
    {448.0f, 0x7e}, {-448.0f, 0xfe}, {NAN, 0x7f}, {NAN, 0xff},
};
static const CodePair E5M2_ENCODES[] = {
    {0.0f, 0x00},       {-0.0f, 0x80},      {1.0f, 0x3c},       {-2.0f, 0xc0},      {1.125f, 0x3c},
    {1.375f, 0x3e},     {49152.0f, 0x7a},   {0x1p-14f, 0x04},   {0x1.8p-15f, 0x03}, {0x1p-16f, 0x01},
    {0x1p-17f, 0x00},   {0x1.8p-16f, 0x02}, {-0x1p-19f, 0x80},  {57344.0f, 0x7b},   {-57344.0f, 0xfb},
    {61440.0f, 0x7b},   {1e30f, 0x7b},      {INFINITY, 0x7b},   {-INFINITY, 0xfb},  {NAN, 0x7f},
};
static const CodePair E5M2_DECODES[] = {
    {0.0f, 0x00}, {-0.0f, 0x80}, {1.0f, 0x3c}, {0x1p-16f, 0x01}, {0x1.8p-15f, 0x03}, {0x1p-14f, 0x04},
    {57344.0f, 0x7b}, {INFINITY, 0x7c}, {-INFINITY, 0xfc}, {NAN, 0x7d}, {NAN, 0x7e}, {NAN, 0xff},
};

static void test_reference_anchors(Fp8Format format) {
    const CodePair *encodes = format == FP8_E4M3 ? E4M3_ENCODES : E5M2_ENCODES;
    const CodePair *decodes = format == FP8_E4M3 ? E4M3_DECODES : E5M2_DECODES;
    size_t n_encodes = format == FP8_E4M3 ? ARRAY_LEN(E4M3_ENCODES) : ARRAY_LEN(E5M2_ENCODES);
    size_t n_decodes = format == FP8_E4M3 ? ARRAY_LEN(E4M3_DECODES) : ARRAY_LEN(E5M2_DECODES);
    Mismatches encode_bad = {}, decode_bad = {};
    for (size_t i = 0; i < n_encodes; i++) {
        uint8_t got = host_fp8_encode(encodes[i].value, format);
        if (!same_code(got, encodes[i].code, format)) note_mismatch(&encode_bad, i, encodes[i].code, got);
    }
    for (size_t i = 0; i < n_decodes; i++) {
        float got = host_fp8_decode(decodes[i].code, format);
        if (!same_float(got, decodes[i].value)) note_mismatch(&decode_bad, i, bits_of(decodes[i].value), bits_of(got));
    }
    char encode_detail[DETAIL_CHARS], decode_detail[DETAIL_CHARS];
    check(encode_bad.count == 0 && decode_bad.count == 0,
          "C reference %s: %zu hand-derived encodes (ties to even, subnormals, saturation, NaN) and %zu decodes: "
          "%zu and %zu differ%s%s",
          spec_of(format)->name, n_encodes, n_decodes, encode_bad.count, decode_bad.count,
          describe_codes(encode_detail, &encode_bad, 0), describe_floats(decode_detail, &decode_bad, 0));

    Mismatches round_trip_bad = {};
    int finite = 0;
    for (int code = 0; code < 256; code++) {
        float value = host_fp8_decode((uint8_t)code, format);
        if (!isfinite(value)) continue;
        finite++;
        uint8_t again = host_fp8_encode(value, format);
        if (again != code) note_mismatch(&round_trip_bad, (size_t)code, (uint32_t)code, again);
    }
    char detail[DETAIL_CHARS];
    check(round_trip_bad.count == 0, "C reference %s: encode(decode(c)) = c for all %d finite codes%s",
          spec_of(format)->name, finite, describe_codes(detail, &round_trip_bad, 0));
}

__global__ void encode_kernel(uint8_t *codes, const float *x, size_t n, Fp8Format format) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) codes[i] = fp8_encode(x[i], format);
}

__global__ void decode_kernel(float *values, Fp8Format format) {  // one thread per code, 256
    values[threadIdx.x] = fp8_decode((uint8_t)threadIdx.x, format);
}

// Every BF16 bit pattern as a float, with the float one ulp below and one above it (bit patterns
// wrap): all signs, zeros, subnormals, every FP8 tie and its neighbours, huge values, infinities
// and NaNs.
static float *sweep_floats(size_t *n) {
    *n = 3 * 65536;
    float *x = host_floats(*n);
    for (uint32_t pattern = 0; pattern < 65536; pattern++)
        for (uint32_t k = 0; k < 3; k++) x[3 * pattern + k] = float_of((pattern << 16) + k - 1u);
    return x;
}

static void test_device_encode(Fp8Format format) {
    size_t n;
    float *x = sweep_floats(&n);
    float *d_x = (float *)device_copy_of(x, n * sizeof(float));
    uint8_t *d_codes = (uint8_t *)device_alloc(n);
    encode_kernel<<<(unsigned)ceil_div_size(n, THREADS), THREADS>>>(d_codes, d_x, n, format);
    cudaCheckLaunch();
    uint8_t *got = (uint8_t *)host_copy_of(d_codes, n);
    Mismatches bad = {};
    for (size_t i = 0; i < n; i++) {
        uint8_t expected = host_fp8_encode(x[i], format);
        if (!same_code(got[i], expected, format)) note_mismatch(&bad, i, expected, got[i]);
    }
    char detail[DETAIL_CHARS] = "";
    if (bad.count)
        snprintf(detail, sizeof(detail), "; first at x = %.9g (0x%08x): expected 0x%02x got 0x%02x", (double)x[bad.first],
                 bits_of(x[bad.first]), bad.expected, bad.got);
    check(bad.count == 0, "fp8_encode %s on the device = C reference for %zu floats (every BF16 pattern and its float "
          "neighbours; NaN codes as both NaN): %zu differ%s", spec_of(format)->name, n, bad.count, detail);
    free(x);
    free(got);
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_codes));
}

static void test_device_decode(Fp8Format format) {
    float *d_values = (float *)device_alloc(256 * sizeof(float));
    decode_kernel<<<1, 256>>>(d_values, format);
    cudaCheckLaunch();
    float *got = (float *)host_copy_of(d_values, 256 * sizeof(float));
    Mismatches bad = {};
    for (int code = 0; code < 256; code++) {
        float expected = host_fp8_decode((uint8_t)code, format);
        if (!same_float(got[code], expected)) note_mismatch(&bad, (size_t)code, bits_of(expected), bits_of(got[code]));
    }
    char detail[DETAIL_CHARS];
    check(bad.count == 0, "fp8_decode %s on the device = C reference for all 256 codes (element = code)%s",
          spec_of(format)->name, describe_floats(detail, &bad, 0));
    free(got);
    cudaCheck(cudaFree(d_values));
}

// ---- per-tensor amax and cast -----------------------------------------------------------

enum { WRITE_OUT = 1, WRITE_OUT_T = 2 };

typedef struct {
    const char *what;       // names the tensor in the messages
    int R, C;
    Fp8Format format;
    const uint16_t *x;      // host BF16 bits [R, C]
    bool amax_by_hand;      // slot->amax = hand_amax instead of fp8_amax's (to force saturation)
    float hand_amax;
    bool every_mode;        // also out only and out_t only, besides out + out_t
} QuantizeCase;

typedef struct {
    uint8_t *out, *out_t;  // host copies, each with its GUARD_BYTES; NULL where not written
    Fp8Scale slot;
} QuantizeRun;

static const char *outputs_name(int outputs) {
    return outputs == (WRITE_OUT | WRITE_OUT_T) ? "out+out_t" : outputs == WRITE_OUT ? "out" : "out_t";
}

// fp8_amax (or the hand-set amax) then fp8_quantize of the tensor d_x into fresh outputs filled
// with `poison`, guard bytes included; host copies of the outputs and the slot.
static void run_quantize(QuantizeRun *run, const QuantizeCase *qc, const bf16 *d_x, int outputs, uint8_t poison) {
    size_t n = (size_t)qc->R * qc->C, bytes = n + GUARD_BYTES;
    Fp8Scale start;
    memset(&start, 0, sizeof(start));
    start.amax = qc->amax_by_hand ? qc->hand_amax : 0.0f;
    Fp8Scale *slot = (Fp8Scale *)device_copy_of(&start, sizeof(start));
    if (!qc->amax_by_hand) fp8_amax(slot, d_x, n, 0);
    uint8_t *out = outputs & WRITE_OUT ? device_poisoned(bytes, poison) : NULL;
    uint8_t *out_t = outputs & WRITE_OUT_T ? device_poisoned(bytes, poison) : NULL;
    fp8_quantize(out, out_t, slot, d_x, qc->R, qc->C, qc->format, 0);
    run->out = out ? (uint8_t *)host_copy_of(out, bytes) : NULL;
    run->out_t = out_t ? (uint8_t *)host_copy_of(out_t, bytes) : NULL;
    cudaCheck(cudaMemcpy(&run->slot, slot, sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
    cudaCheck(cudaFree(slot));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(out_t));
}

// Codes got ([R, C], or [C, R] when transposed) against expected [R, C]; mismatches are indexed
// in the [R, C] frame. Returns the guard bytes after the tensor that are no longer `poison`.
static size_t compare_codes(Mismatches *bad, const uint8_t *got, const uint8_t *expected, int R, int C, bool transposed,
                            Fp8Format format, uint8_t poison) {
    for (size_t r = 0; r < (size_t)R; r++)
        for (size_t c = 0; c < (size_t)C; c++) {
            uint8_t g = transposed ? got[c * R + r] : got[r * C + c], e = expected[r * C + c];
            if (!same_code(g, e, format)) note_mismatch(bad, r * C + c, e, g);
        }
    size_t changed = 0;
    for (size_t i = (size_t)R * C; i < (size_t)R * C + GUARD_BYTES; i++) changed += got[i] != poison;
    return changed;
}

static void check_output(const char *label, const char *output, const Mismatches *bad, size_t guard_changed, int C) {
    char detail[DETAIL_CHARS];
    check(bad->count == 0 && guard_changed == 0,
          "%s: %s codes bit-exact and every element written (poisons 0x%02x, 0x%02x): %zu differ over both runs%s; "
          "%zu of the %d guard bytes after it changed",
          label, output, POISON_FIRST, POISON_SECOND, bad->count, describe_codes(detail, bad, (size_t)C), guard_changed,
          GUARD_BYTES);
}

// Every output mode of the case, each run twice (two poisons), against the reference; one check
// for the slot over all runs and one per output and mode. Returns the codes of out from the first
// run (out + out_t where R allows a transpose) and its slot, for the caller's own checks.
static uint8_t *check_quantize(const QuantizeCase *qc, Fp8Scale *slot) {
    const Fp8Spec *f = spec_of(qc->format);
    size_t n = (size_t)qc->R * qc->C;
    float *x = host_floats(n);
    for (size_t i = 0; i < n; i++) x[i] = float_of_bf16_bits(qc->x[i]);
    float amax = qc->amax_by_hand ? qc->hand_amax : host_amax(x, n), scale = host_scale(amax, qc->format);
    uint8_t *expected = (uint8_t *)host_alloc(n);
    for (size_t i = 0; i < n; i++) expected[i] = host_fp8_encode(x[i] / scale, qc->format);
    bf16 *d_x = (bf16 *)device_copy_of(qc->x, n * sizeof(uint16_t));

    int modes[3], n_modes = 0;
    bool transposable = qc->R % 16 == 0;
    if (transposable) modes[n_modes++] = WRITE_OUT | WRITE_OUT_T;
    if (qc->every_mode || !transposable) modes[n_modes++] = WRITE_OUT;
    if (qc->every_mode && transposable) modes[n_modes++] = WRITE_OUT_T;

    uint8_t *kept = NULL;
    int runs = 0, slots_bad = 0;
    Fp8Scale shown = {};  // the first run's slot, or the first wrong one
    for (int m = 0; m < n_modes; m++) {
        Mismatches out_bad = {}, out_t_bad = {};
        size_t out_guard = 0, out_t_guard = 0;
        for (int p = 0; p < 2; p++) {
            uint8_t poison = p == 0 ? POISON_FIRST : POISON_SECOND;
            QuantizeRun run;
            run_quantize(&run, qc, d_x, modes[m], poison);
            bool slot_ok = same_float(run.slot.amax, amax) && same_float(run.slot.scale, scale);
            if (runs++ == 0 || (!slot_ok && slots_bad == 0)) shown = run.slot;
            slots_bad += !slot_ok;
            if (run.out) out_guard += compare_codes(&out_bad, run.out, expected, qc->R, qc->C, false, qc->format, poison);
            if (run.out_t)
                out_t_guard += compare_codes(&out_t_bad, run.out_t, expected, qc->R, qc->C, true, qc->format, poison);
            if (kept == NULL) kept = run.out;
            else free(run.out);
            free(run.out_t);
        }
        char label[DETAIL_CHARS];
        snprintf(label, sizeof(label), "fp8_quantize %s [%d x %d] %s, %s", f->name, qc->R, qc->C, qc->what,
                 outputs_name(modes[m]));
        if (modes[m] & WRITE_OUT) check_output(label, "out", &out_bad, out_guard, qc->C);
        if (modes[m] & WRITE_OUT_T) check_output(label, "out_t", &out_t_bad, out_t_guard, qc->C);
    }
    check(slots_bad == 0,
          "%s %s [%d x %d] %s: slot amax %.9g and scale (amax + 1e-10)/%g = %.9g bit for bit in %d runs: "
          "%d differ (got %.9g and %.9g)",
          qc->amax_by_hand ? "fp8_quantize" : "fp8_amax + fp8_quantize", f->name, qc->R, qc->C, qc->what, (double)amax,
          (double)f->max, (double)scale, runs, slots_bad, (double)shown.amax, (double)shown.scale);
    *slot = shown;
    free(x);
    free(expected);
    cudaCheck(cudaFree(d_x));
    return kept;
}

static void fill_bf16(uint16_t *x, size_t n, Random *rng, double amplitude) {
    for (size_t i = 0; i < n; i++) x[i] = bf16_bits_from_float((float)(amplitude * random_normal(rng)));
}

// Normal values times 2^k, k uniform in [-32, 0]: after scaling, codes from zero through the
// subnormals to the largest of either format.
static uint16_t *wide_range_bf16(size_t n, uint64_t seed) {
    Random rng;
    random_seed(&rng, seed);
    uint16_t *x = (uint16_t *)host_alloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) {
        double magnitude = ldexp(1.0, -(int)random_below(&rng, 33));
        x[i] = bf16_bits_from_float((float)(magnitude * random_normal(&rng)));
    }
    return x;
}

static void test_quantize_shapes(void) {
    static const int shapes[][2] = {{64, 64}, {80, 352}, {16, 8}, {48, 200}, {4096, 2048}, {37, 200}, {1, 8}};
    for (size_t s = 0; s < ARRAY_LEN(shapes); s++) {
        int R = shapes[s][0], C = shapes[s][1];
        uint16_t *x = wide_range_bf16((size_t)R * C, SEED + s);
        for (int k = 0; k < 2; k++) {
            QuantizeCase qc = {"wide-range random", R, C, FORMATS[k], x, false, 0.0f, true};
            Fp8Scale slot;
            free(check_quantize(&qc, &slot));
        }
        free(x);
    }
}

static size_t count_codes_not(const uint8_t *codes, size_t n, uint8_t code) {
    size_t count = 0;
    for (size_t i = 0; i < n; i++) count += codes[i] != code;
    return count;
}

static void test_zero_tensor(Fp8Format format) {
    const int R = 64, C = 64;
    uint16_t *x = (uint16_t *)host_alloc((size_t)R * C * sizeof(uint16_t));
    QuantizeCase qc = {"all zero", R, C, format, x, false, 0.0f, false};
    Fp8Scale slot;
    uint8_t *codes = check_quantize(&qc, &slot);
    float max = spec_of(format)->max, expected_scale = 1e-10f / max;
    size_t nonzero = count_codes_not(codes, (size_t)R * C, 0x00);
    check(bits_of(slot.amax) == 0 && same_float(slot.scale, expected_scale) && nonzero == 0,
          "%s all-zero tensor: amax 0 (got %.9g), scale 1e-10/%g = %.9g (got %.9g), every code 0x00 (%zu are not)",
          spec_of(format)->name, (double)slot.amax, (double)max, (double)expected_scale, (double)slot.scale, nonzero);
    free(codes);
    free(x);
}

// x[0] = max, so that scale = (max + 1e-10)/max = 1 exactly (1e-10 is below half an ulp of max);
// the rest are +-j * 2^(emin - m - 1), half the subnormal step, j < 2^(m+2): code j/2 rounded to
// even (ties at odd j), through every subnormal up to the smallest normal; negative on odd rows.
static void test_subnormal_codes(Fp8Format format) {
    const Fp8Spec *f = spec_of(format);
    const int R = 16, C = 64;
    size_t n = (size_t)R * C;
    int m = f->mantissa_bits, steps = 1 << (m + 2);
    uint16_t *x = (uint16_t *)host_alloc(n * sizeof(uint16_t));
    uint8_t *expected = (uint8_t *)host_alloc(n);
    for (size_t i = 0; i < n; i++) {
        int j = (int)(i % steps), negative = (int)(i / C) % 2;
        float value = ldexpf((float)j, 1 - f->bias - m - 1);
        x[i] = bf16_bits_from_float(negative ? -value : value);
        expected[i] = (uint8_t)((negative ? 0x80 : 0x00) | ((j + ((j >> 1) & 1)) >> 1));
    }
    x[0] = bf16_bits_from_float(f->max);
    expected[0] = f->max_code;
    QuantizeCase qc = {"max and subnormal-range values", R, C, format, x, false, 0.0f, false};
    Fp8Scale slot;
    uint8_t *codes = check_quantize(&qc, &slot);
    Mismatches bad = {};
    for (size_t i = 0; i < n; i++)
        if (codes[i] != expected[i]) note_mismatch(&bad, i, expected[i], codes[i]);
    char detail[DETAIL_CHARS];
    check(bits_of(slot.scale) == bits_of(1.0f) && bad.count == 0,
          "%s subnormal codes: scale 1 (got %.9g), codes 0..%d (zero, the %d subnormals, then the normals of the "
          "same step; ties to even) as derived by hand: %zu differ%s",
          f->name, (double)slot.scale, steps / 2, (1 << m) - 1, bad.count, describe_codes(detail, &bad, (size_t)C));
    free(codes);
    free(expected);
    free(x);
}

// slot->amax set by hand to 1 while the values (normal, sigma 2) reach about 7, and the largest
// finite BF16 (whose quotient by the scale overflows to infinity): every |x| >= 1 must give +-max.
static void test_saturation(Fp8Format format) {
    const Fp8Spec *f = spec_of(format);
    const int R = 32, C = 64;
    size_t n = (size_t)R * C;
    Random rng;
    random_seed(&rng, SEED + 100);
    uint16_t *x = (uint16_t *)host_alloc(n * sizeof(uint16_t));
    fill_bf16(x, n, &rng, 2.0);
    x[1] = 0x7f7f;  // +3.39e38
    x[2] = 0xff7f;  // -3.39e38
    QuantizeCase qc = {"amax set by hand to 1", R, C, format, x, true, 1.0f, false};
    Fp8Scale slot;
    uint8_t *codes = check_quantize(&qc, &slot);
    size_t saturating = 0;
    Mismatches bad = {};
    for (size_t i = 0; i < n; i++) {
        float value = float_of_bf16_bits(x[i]);
        if (!(fabsf(value) >= 1.0f)) continue;
        saturating++;
        uint8_t want = (uint8_t)((value < 0 ? 0x80 : 0x00) | f->max_code);
        if (codes[i] != want) note_mismatch(&bad, i, want, codes[i]);
    }
    char detail[DETAIL_CHARS];
    check(saturating > n / 4 && bad.count == 0,
          "%s saturation: the %zu values with |x| >= amax = 1 (up to 3.4e38) all give +-max, code 0x%02x/0x%02x: "
          "%zu differ%s",
          f->name, saturating, f->max_code, 0x80 | f->max_code, bad.count, describe_codes(detail, &bad, (size_t)C));
    free(codes);
    free(x);
}

static void test_nan_input(Fp8Format format) {
    const int R = 32, C = 64;
    size_t n = (size_t)R * C;
    Random rng;
    random_seed(&rng, SEED + 200);
    uint16_t *x = (uint16_t *)host_alloc(n * sizeof(uint16_t));
    fill_bf16(x, n, &rng, 1.0);
    x[100] = 0xffc1;  // a negative NaN with a payload: fp8_amax clears its sign and must still see a NaN
    QuantizeCase qc = {"one NaN", R, C, format, x, false, 0.0f, false};
    Fp8Scale slot;
    uint8_t *codes = check_quantize(&qc, &slot);
    size_t not_nan = 0;
    for (size_t i = 0; i < n; i++) not_nan += !is_nan_code(codes[i], format);
    check(isnan(slot.amax) && isnan(slot.scale) && not_nan == 0,
          "%s NaN input: fp8_amax gives NaN (got %.9g), scale NaN (got %.9g), every code NaN (%zu are not)",
          spec_of(format)->name, (double)slot.amax, (double)slot.scale, not_nan);
    free(codes);
    free(x);
}

// amax = inf, scale = inf: finite x / inf is a zero of x's sign, inf / inf a NaN.
static void test_inf_input(Fp8Format format) {
    const int R = 32, C = 64;
    size_t n = (size_t)R * C;
    Random rng;
    random_seed(&rng, SEED + 300);
    uint16_t *x = (uint16_t *)host_alloc(n * sizeof(uint16_t));
    fill_bf16(x, n, &rng, 1.0);
    x[7] = 0x7f80;     // +inf
    x[1000] = 0xff80;  // -inf
    QuantizeCase qc = {"two infinities", R, C, format, x, false, 0.0f, false};
    Fp8Scale slot;
    uint8_t *codes = check_quantize(&qc, &slot);
    Mismatches bad = {};
    for (size_t i = 0; i < n; i++) {
        float value = float_of_bf16_bits(x[i]);
        bool ok = isinf(value) ? is_nan_code(codes[i], format) : codes[i] == (signbit(value) ? 0x80 : 0x00);
        if (!ok) note_mismatch(&bad, i, isinf(value) ? 0x7f : (signbit(value) ? 0x80 : 0x00), codes[i]);
    }
    char detail[DETAIL_CHARS];
    check(slot.amax == INFINITY && slot.scale == INFINITY && bad.count == 0,
          "%s infinite input: amax inf (got %.9g), scale inf (got %.9g), codes +-0 by sign and NaN at the infinities: "
          "%zu differ%s",
          spec_of(format)->name, (double)slot.amax, (double)slot.scale, bad.count, describe_codes(detail, &bad, (size_t)C));
    free(codes);
    free(x);
}

// ---- amax accumulates across calls ------------------------------------------------------

static float amax_after(Fp8Scale *d_slot) {
    Fp8Scale slot;
    cudaCheck(cudaMemcpy(&slot, d_slot, sizeof(slot), cudaMemcpyDeviceToHost));
    return slot.amax;
}

// A [8, 64] peaks at +3.5 in its last element, B [16, 64] at -7.25 in the middle, every other value
// in (-1, 1): A then B and B then A both leave 7.25.
static void test_amax_accumulates(void) {
    const size_t n_a = 8 * 64, n_b = 16 * 64;
    Random rng;
    random_seed(&rng, SEED + 400);
    float *a = random_uniform_bf16_values(&rng, n_a, 0.99f), *b = random_uniform_bf16_values(&rng, n_b, 0.99f);
    a[n_a - 1] = 3.5f;
    b[500] = -7.25f;
    bf16 *d_a = device_bf16_from(a, n_a), *d_b = device_bf16_from(b, n_b);
    Fp8Scale zero;
    memset(&zero, 0, sizeof(zero));
    Fp8Scale *d_slot = (Fp8Scale *)device_copy_of(&zero, sizeof(zero));
    fp8_amax(d_slot, d_a, n_a, 0);
    float after_a = amax_after(d_slot);
    fp8_amax(d_slot, d_b, n_b, 0);
    float after_a_b = amax_after(d_slot);
    cudaCheck(cudaMemcpy(d_slot, &zero, sizeof(zero), cudaMemcpyHostToDevice));
    fp8_amax(d_slot, d_b, n_b, 0);
    fp8_amax(d_slot, d_a, n_a, 0);
    float after_b_a = amax_after(d_slot);
    check(after_a == 3.5f && after_a_b == 7.25f && after_b_a == 7.25f,
          "fp8_amax accumulates into one slot: A alone 3.5 (got %.9g), A then B 7.25 (got %.9g), B then A 7.25 (got %.9g)",
          (double)after_a, (double)after_a_b, (double)after_b_a);
    free(a);
    free(b);
    cudaCheck(cudaFree(d_a));
    cudaCheck(cudaFree(d_b));
    cudaCheck(cudaFree(d_slot));
}

// ZeRO's E4M3 weight gather: each rank casts its parts of a weight's flat elements (split at
// multiples of 128) with the amax of the whole weight, and every rank transposes the gathered
// codes. The codes, their transpose and the scale equal one cast pass over the whole tensor,
// bit for bit; the transpose writes nothing past [C, R]. Shapes: one tile, partial tiles, tall, wide.
static void test_transpose_codes(void) {
    static const int shapes[][2] = {{16, 16}, {64, 64}, {48, 208}, {1040, 80}, {96, 2064}, {2048, 512}};
    const size_t guard = 64;
    for (size_t s = 0; s < ARRAY_LEN(shapes); s++) {
        int R = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)R * C;
        uint16_t *x = wide_range_bf16(n, SEED + 700 + s);
        bf16 *d_x = (bf16 *)device_copy_of(x, n * 2);
        Fp8Scale zero;
        memset(&zero, 0, sizeof(zero));
        Fp8Scale *d_whole = (Fp8Scale *)device_copy_of(&zero, sizeof(zero)), *d_parts = (Fp8Scale *)device_copy_of(&zero, sizeof(zero));
        uint8_t *d_codes = device_poisoned(n, 0x5a), *d_codes_t = device_poisoned(n, 0x5a);
        uint8_t *d_part_codes = device_poisoned(n, 0xa5), *d_transposed = device_poisoned(n + guard, 0xa5);
        fp8_amax(d_whole, d_x, n, 0);
        fp8_quantize(d_codes, d_codes_t, d_whole, d_x, R, C, FP8_E4M3, 0);
        size_t split = n / 2 / 128 * 128;  // a shard boundary inside the tensor (or at its start)
        fp8_amax(d_parts, d_x + split, n - split, 0);
        fp8_amax(d_parts, d_x, split, 0);  // the max over the ranks' partial maxima
        if (split > 0) fp8_quantize(d_part_codes, NULL, d_parts, d_x, (int)(split / 128), 128, FP8_E4M3, 0);
        fp8_quantize(d_part_codes + split, NULL, d_parts, d_x + split, (int)((n - split) / 128), 128, FP8_E4M3, 0);
        fp8_transpose_codes(d_transposed, d_part_codes, R, C, 0);
        uint8_t *codes = (uint8_t *)host_copy_of(d_codes, n), *codes_t = (uint8_t *)host_copy_of(d_codes_t, n);
        uint8_t *part_codes = (uint8_t *)host_copy_of(d_part_codes, n), *transposed = (uint8_t *)host_copy_of(d_transposed, n + guard);
        Fp8Scale whole, parts;
        cudaCheck(cudaMemcpy(&whole, d_whole, sizeof(whole), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(&parts, d_parts, sizeof(parts), cudaMemcpyDeviceToHost));
        size_t codes_differ = 0, transpose_differ = 0, reference_differ = 0, guard_changed = 0;
        for (size_t i = 0; i < n; i++) {
            codes_differ += part_codes[i] != codes[i];
            transpose_differ += transposed[i] != codes_t[i];
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++) reference_differ += transposed[(size_t)c * R + r] != part_codes[(size_t)r * C + c];
        for (size_t i = n; i < n + guard; i++) guard_changed += transposed[i] != 0xa5;
        check(codes_differ == 0 && transpose_differ == 0 && reference_differ == 0 && guard_changed == 0 &&
                  same_float(parts.scale, whole.scale) && same_float(parts.scale, host_scale(whole.amax, FP8_E4M3)) &&
                  same_float(parts.amax, whole.amax),
              "[%d, %d] cast in two parts split at %zu and transposed = one cast pass with its transpose: %zu codes, %zu "
              "transposed codes differ (%zu from the C transpose), %zu guard bytes changed; scale %.9g vs %.9g",
              R, C, split, codes_differ, transpose_differ, reference_differ, guard_changed, (double)parts.scale, (double)whole.scale);
        free(x);
        free(codes);
        free(codes_t);
        free(part_codes);
        free(transposed);
        cudaCheck(cudaFree(d_x));
        cudaCheck(cudaFree(d_whole));
        cudaCheck(cudaFree(d_parts));
        cudaCheck(cudaFree(d_codes));
        cudaCheck(cudaFree(d_codes_t));
        cudaCheck(cudaFree(d_part_codes));
        cudaCheck(cudaFree(d_transposed));
    }
}

// The FP32 master weights cast as the BF16 weights they round to (coat/zero.cuh casts the block's
// weights so, keeping no BF16 copy): fp8_amax and fp8_quantize from FP32 give the amax, scale,
// codes and transpose that they give from the BF16 rounding, bit for bit. Values of every
// magnitude, with ties and near-ties of the rounding to BF16.
static void test_cast_from_fp32(void) {
    static const int shapes[][2] = {{64, 64}, {48, 208}, {1040, 80}};
    for (size_t s = 0; s < ARRAY_LEN(shapes); s++) {
        int R = shapes[s][0], C = shapes[s][1];
        size_t n = (size_t)R * C;
        Random rng;
        random_seed(&rng, SEED + 800 + s);
        float *x = (float *)malloc(n * sizeof(float));
        for (size_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)random_below(&rng, 1u << 23) | (uint32_t)(100 + random_below(&rng, 60)) << 23;
            if (i % 7 == 0) bits = (bits & ~0xffffu) | 0x8000u;  // a tie: rounds to even
            if (i % 2) bits |= 0x80000000u;
            memcpy(&x[i], &bits, 4);
        }
        float *d_f = (float *)device_copy_of(x, n * sizeof(float));
        bf16 *d_b = device_bf16_from(x, n);
        Fp8Scale zero;
        memset(&zero, 0, sizeof(zero));
        Fp8Scale *d_slot_f = (Fp8Scale *)device_copy_of(&zero, sizeof(zero));
        Fp8Scale *d_slot_b = (Fp8Scale *)device_copy_of(&zero, sizeof(zero));
        uint8_t *d_codes[2] = {device_poisoned(n, 0x5a), device_poisoned(n, 0x5a)};
        uint8_t *d_codes_t[2] = {device_poisoned(n, 0x5a), device_poisoned(n, 0x5a)};
        fp8_amax(d_slot_f, d_f, n, 0);
        fp8_quantize(d_codes[0], d_codes_t[0], d_slot_f, d_f, R, C, FP8_E4M3, 0);
        fp8_amax(d_slot_b, d_b, n, 0);
        fp8_quantize(d_codes[1], d_codes_t[1], d_slot_b, d_b, R, C, FP8_E4M3, 0);
        size_t codes_differ = 0, transpose_differ = 0;
        uint8_t *codes[2], *codes_t[2];
        for (int k = 0; k < 2; k++) {
            codes[k] = (uint8_t *)host_copy_of(d_codes[k], n);
            codes_t[k] = (uint8_t *)host_copy_of(d_codes_t[k], n);
        }
        for (size_t i = 0; i < n; i++) {
            codes_differ += codes[0][i] != codes[1][i];
            transpose_differ += codes_t[0][i] != codes_t[1][i];
        }
        Fp8Scale from_f32, from_bf16;
        cudaCheck(cudaMemcpy(&from_f32, d_slot_f, sizeof(from_f32), cudaMemcpyDeviceToHost));
        cudaCheck(cudaMemcpy(&from_bf16, d_slot_b, sizeof(from_bf16), cudaMemcpyDeviceToHost));
        check(codes_differ == 0 && transpose_differ == 0 && same_float(from_f32.amax, from_bf16.amax) &&
                  same_float(from_f32.scale, from_bf16.scale),
              "[%d, %d] cast from FP32 = cast from its BF16 rounding: %zu codes, %zu transposed codes differ; amax %.9g vs "
              "%.9g, scale %.9g vs %.9g", R, C, codes_differ, transpose_differ, (double)from_f32.amax, (double)from_bf16.amax,
              (double)from_f32.scale, (double)from_bf16.scale);
        for (int k = 0; k < 2; k++) {
            free(codes[k]);
            free(codes_t[k]);
            cudaCheck(cudaFree(d_codes[k]));
            cudaCheck(cudaFree(d_codes_t[k]));
        }
        free(x);
        cudaCheck(cudaFree(d_f));
        cudaCheck(cudaFree(d_b));
        cudaCheck(cudaFree(d_slot_f));
        cudaCheck(cudaFree(d_slot_b));
    }
}

// ---- 1x16 groups ------------------------------------------------------------------------

// Half group h (8 values) of x [R, C] per thread, C a multiple of 16, so that lanes 2k and 2k+1
// hold one group and group h/2 is entry [r, c/16] of the scales [R, C/16]. Lanes past the tensor
// pass zeros: the helper's shuffle needs the whole warp. The even lane writes `scales` (as
// floats, and as stored, in BF16, into `stored_scales`), the odd one `odd_lane_scales`, which
// must hold the same.
__global__ void quantize_groups_kernel(uint8_t *codes, float *scales, float *odd_lane_scales, bf16 *stored_scales,
                                       const float *x, size_t n_halves) {
    size_t h = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    bool active = h < n_halves;
    float values[8];
    for (int j = 0; j < 8; j++) values[j] = active ? x[h * 8 + j] : 0.0f;
    bf16 scale;
    uint2 packed = fp8_quantize_half_group(values, &scale);
    if (!active) return;
    *reinterpret_cast<uint2 *>(codes + h * 8) = packed;
    (h % 2 == 0 ? scales : odd_lane_scales)[h / 2] = __bfloat162float(scale);
    if (h % 2 == 0) stored_scales[h / 2] = scale;
}

// out [R, C] = the values fp8_load_group16 reads back, 8 per thread, by row and column.
__global__ void load_groups_kernel(float *out, const uint8_t *codes, const bf16 *scales, int R, int C) {
    size_t h = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (h >= (size_t)R * C / 8) return;
    size_t r = h * 8 / C, c = h * 8 % C;
    float values[8];
    fp8_load_group16(values, codes + r * C, scales + r * (C / FP8_GROUP), (int)c);
    for (int j = 0; j < 8; j++) out[h * 8 + j] = values[j];
}

typedef struct {
    uint8_t *codes;      // [R, C]
    float *scales;       // [R, C/16], from the even lanes
    float *dequantized;  // [R, C]
} GroupResult;

static void compare_floats_bits(Mismatches *bad, const float *got, const float *expected, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!same_float(got[i], expected[i])) note_mismatch(bad, i, bits_of(expected[i]), bits_of(got[i]));
}

// The same with a whole group per thread: fp8_quantize_group into codes and stored_scales, and
// fp8_load_group of what it stored into out.
__global__ void whole_groups_kernel(uint8_t *codes, bf16 *stored_scales, float *out, const float *x, size_t groups) {
    size_t g = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    float values[FP8_GROUP];
    for (int j = 0; j < FP8_GROUP; j++) values[j] = x[g * FP8_GROUP + j];
    *reinterpret_cast<uint4 *>(codes + g * FP8_GROUP) = fp8_quantize_group(values, stored_scales + g);
    fp8_load_group(values, codes + g * FP8_GROUP, stored_scales + g, 0);
    for (int j = 0; j < FP8_GROUP; j++) out[g * FP8_GROUP + j] = values[j];
}

// Codes, scales and values of whole_groups_kernel on x [n] against the expected ones.
static void check_whole_groups(const char *what, const float *d_x, const uint8_t *expected_codes,
                               const float *expected_scales, const float *expected_values, int R, int C) {
    size_t n = (size_t)R * C, groups = n / FP8_GROUP;
    uint8_t *d_codes = device_poisoned(n, POISON_FIRST);
    bf16 *d_scales = (bf16 *)device_poisoned(groups * sizeof(bf16), POISON_FIRST);
    float *d_values = (float *)device_poisoned(n * sizeof(float), POISON_FIRST);
    whole_groups_kernel<<<(unsigned)ceil_div_size(groups, THREADS), THREADS>>>(d_codes, d_scales, d_values, d_x, groups);
    cudaCheckLaunch();
    uint8_t *codes = (uint8_t *)host_copy_of(d_codes, n);
    bf16 *stored = (bf16 *)host_copy_of(d_scales, groups * sizeof(bf16));
    float *values = (float *)host_copy_of(d_values, n * sizeof(float)), *scales = host_floats(groups);
    for (size_t g = 0; g < groups; g++) scales[g] = __bfloat162float(stored[g]);
    Mismatches codes_bad = {}, scales_bad = {}, values_bad = {};
    for (size_t i = 0; i < n; i++)
        if (!same_code(codes[i], expected_codes[i], FP8_E4M3)) note_mismatch(&codes_bad, i, expected_codes[i], codes[i]);
    compare_floats_bits(&scales_bad, scales, expected_scales, groups);
    compare_floats_bits(&values_bad, values, expected_values, n);
    char detail[DETAIL_CHARS], codes_detail[DETAIL_CHARS], values_detail[DETAIL_CHARS];
    check(scales_bad.count == 0 && codes_bad.count == 0 && values_bad.count == 0,
          "fp8_quantize_group + fp8_load_group [%d x %d] %s (a group per thread): scales, codes and dequantized values "
          "bit for bit: %zu, %zu and %zu differ%s%s%s",
          R, C, what, scales_bad.count, codes_bad.count, values_bad.count,
          describe_floats(detail, &scales_bad, (size_t)C / FP8_GROUP), describe_codes(codes_detail, &codes_bad, (size_t)C),
          describe_floats(values_detail, &values_bad, (size_t)C));
    free(codes), free(stored), free(values), free(scales);
    cudaCheck(cudaFree(d_codes));
    cudaCheck(cudaFree(d_scales));
    cudaCheck(cudaFree(d_values));
}

// The kernels on x [R, C] (a half group per thread, then a group per thread) against the
// reference: scale = bf16((max |x| of the 16 + 1e-10f)/448)
// (rounded to nearest even, as stored), code = encode_e4m3(x / scale), dequantized =
// decode(code) * scale. Returns the device results.
static GroupResult check_group_helpers(const char *what, const float *x, int R, int C) {
    size_t n = (size_t)R * C, groups = n / FP8_GROUP;
    uint8_t *expected_codes = (uint8_t *)host_alloc(n);
    float *expected_scales = host_floats(groups), *expected_values = host_floats(n);
    for (size_t g = 0; g < groups; g++) {
        const float *group = x + g * FP8_GROUP;
        float scale = round_to_bf16(host_scale(host_amax(group, FP8_GROUP), FP8_E4M3));
        expected_scales[g] = scale;
        for (int j = 0; j < FP8_GROUP; j++) {
            uint8_t code = host_fp8_encode(group[j] / scale, FP8_E4M3);
            expected_codes[g * FP8_GROUP + j] = code;
            expected_values[g * FP8_GROUP + j] = host_fp8_decode(code, FP8_E4M3) * scale;
        }
    }
    float *d_x = (float *)device_copy_of(x, n * sizeof(float));
    uint8_t *d_codes = device_poisoned(n, POISON_FIRST);
    float *d_scales = (float *)device_poisoned(groups * sizeof(float), POISON_FIRST);
    float *d_odd_scales = (float *)device_poisoned(groups * sizeof(float), POISON_FIRST);
    bf16 *d_stored_scales = (bf16 *)device_poisoned(groups * sizeof(bf16), POISON_FIRST);
    float *d_values = (float *)device_poisoned(n * sizeof(float), POISON_FIRST);
    size_t halves = n / 8;
    unsigned blocks = (unsigned)ceil_div_size(halves, THREADS);
    quantize_groups_kernel<<<blocks, THREADS>>>(d_codes, d_scales, d_odd_scales, d_stored_scales, d_x, halves);
    cudaCheckLaunch();
    load_groups_kernel<<<blocks, THREADS>>>(d_values, d_codes, d_stored_scales, R, C);
    cudaCheckLaunch();
    GroupResult got;
    got.codes = (uint8_t *)host_copy_of(d_codes, n);
    got.scales = (float *)host_copy_of(d_scales, groups * sizeof(float));
    got.dequantized = (float *)host_copy_of(d_values, n * sizeof(float));
    float *odd_scales = (float *)host_copy_of(d_odd_scales, groups * sizeof(float));

    Mismatches codes_bad = {}, scales_bad = {}, odd_bad = {}, values_bad = {};
    for (size_t i = 0; i < n; i++)
        if (!same_code(got.codes[i], expected_codes[i], FP8_E4M3))
            note_mismatch(&codes_bad, i, expected_codes[i], got.codes[i]);
    compare_floats_bits(&scales_bad, got.scales, expected_scales, groups);
    compare_floats_bits(&odd_bad, odd_scales, expected_scales, groups);
    compare_floats_bits(&values_bad, got.dequantized, expected_values, n);
    char detail[DETAIL_CHARS], odd_detail[DETAIL_CHARS];
    check(scales_bad.count == 0 && odd_bad.count == 0,
          "fp8_quantize_half_group [%d x %d] %s: group scales bf16((max|x| + 1e-10)/448) bit for bit in lane 2k and 2k+1: "
          "%zu and %zu of %zu differ%s%s",
          R, C, what, scales_bad.count, odd_bad.count, groups,
          describe_floats(detail, &scales_bad, (size_t)C / FP8_GROUP),
          describe_floats(odd_detail, &odd_bad, (size_t)C / FP8_GROUP));
    check(codes_bad.count == 0, "fp8_quantize_half_group [%d x %d] %s: codes e4m3(x / scale) bit for bit: %zu differ%s", R, C,
          what, codes_bad.count, describe_codes(detail, &codes_bad, (size_t)C));
    check(values_bad.count == 0, "fp8_load_group16 [%d x %d] %s: decode(code) * scale bit for bit: %zu differ%s", R, C, what,
          values_bad.count, describe_floats(detail, &values_bad, (size_t)C));
    check_whole_groups(what, d_x, expected_codes, expected_scales, expected_values, R, C);
    free(expected_codes);
    free(expected_scales);
    free(expected_values);
    free(odd_scales);
    cudaCheck(cudaFree(d_x));
    cudaCheck(cudaFree(d_codes));
    cudaCheck(cudaFree(d_scales));
    cudaCheck(cudaFree(d_odd_scales));
    cudaCheck(cudaFree(d_stored_scales));
    cudaCheck(cudaFree(d_values));
    return got;
}

enum {
    GROUP_ZERO, GROUP_NEGATIVE_ZERO, GROUP_NAN, GROUP_INF, GROUP_ONE_LARGE, GROUP_MAX_IN_ODD_LANE,
    GROUP_MAX_IN_EVEN_LANE, GROUP_BELOW_EPSILON, GROUP_FLOAT_SUBNORMALS, GROUP_CRAFTED_KINDS
};

// Spread of the normal values of group g: the crafted kinds above, then 2^(3g - 60), from 2^-33
// to 2^33.
static double crafted_group_amplitude(int g) {
    if (g == GROUP_ONE_LARGE) return 0.02;  // beside 1000: mostly subnormal codes
    if (g == GROUP_BELOW_EPSILON) return 1e-12;
    if (g == GROUP_FLOAT_SUBNORMALS) return 1e-40;
    if (g < GROUP_CRAFTED_KINDS) return 0.01;
    return ldexp(1.0, 3 * g - 60);
}

static void fill_crafted_group(float *v, int g, Random *rng) {
    for (int j = 0; j < FP8_GROUP; j++) v[j] = (float)(crafted_group_amplitude(g) * random_normal(rng));
    if (g == GROUP_ZERO || g == GROUP_NEGATIVE_ZERO)
        for (int j = 0; j < FP8_GROUP; j++) v[j] = g == GROUP_ZERO ? 0.0f : -0.0f;
    if (g == GROUP_NAN) v[5] = NAN;              // in the even lane: the odd one gets it by the shuffle
    if (g == GROUP_INF) v[12] = -INFINITY;       // in the odd lane
    if (g == GROUP_ONE_LARGE) v[3] = 1000.0f;
    if (g == GROUP_MAX_IN_ODD_LANE) v[13] = 50.0f;
    if (g == GROUP_MAX_IN_EVEN_LANE) v[2] = -50.0f;
}

static void test_group_helpers(void) {
    Random rng;
    random_seed(&rng, SEED + 500);
    const int R = 4, C = 128;  // 32 groups, one block of which most lanes are past the tensor
    float *x = host_floats((size_t)R * C);
    for (int g = 0; g < R * C / FP8_GROUP; g++) fill_crafted_group(x + (size_t)g * FP8_GROUP, g, &rng);
    GroupResult got = check_group_helpers("crafted groups", x, R, C);

    float zero_scale = round_to_bf16(1e-10f / 448.0f);
    size_t zero_codes = FP8_GROUP - count_codes_not(got.codes + GROUP_ZERO * FP8_GROUP, FP8_GROUP, 0x00);
    size_t nan_codes = 0;
    for (int j = 0; j < FP8_GROUP; j++) nan_codes += is_nan_code(got.codes[GROUP_NAN * FP8_GROUP + j], FP8_E4M3);
    check(same_float(got.scales[GROUP_ZERO], zero_scale) && zero_codes == FP8_GROUP,
          "1x16 all-zero group: scale bf16(1e-10/448) = %.9g (got %.9g), %d codes 0x00 (got %zu)", (double)zero_scale,
          (double)got.scales[GROUP_ZERO], FP8_GROUP, zero_codes);
    check(isnan(got.scales[GROUP_NAN]) && nan_codes == FP8_GROUP && got.scales[GROUP_INF] == INFINITY,
          "1x16 group with a NaN: scale NaN (got %.9g), %d NaN codes (got %zu); group with -inf: scale inf (got %.9g)",
          (double)got.scales[GROUP_NAN], FP8_GROUP, nan_codes, (double)got.scales[GROUP_INF]);
    free(got.codes);
    free(got.scales);
    free(got.dequantized);
    free(x);

    const int R_WIDE = 64, C_WIDE = 2048;  // many blocks; magnitudes 2^-20..2^20 drawn per group
    float *wide = host_floats((size_t)R_WIDE * C_WIDE);
    for (size_t g = 0; g < (size_t)R_WIDE * C_WIDE / FP8_GROUP; g++) {
        double amplitude = ldexp(1.0, (int)random_below(&rng, 41) - 20);
        for (int j = 0; j < FP8_GROUP; j++) wide[g * FP8_GROUP + j] = (float)(amplitude * random_normal(&rng));
    }
    got = check_group_helpers("random magnitudes per group", wide, R_WIDE, C_WIDE);
    free(got.codes);
    free(got.scales);
    free(got.dequantized);
    free(wide);
}

// ---- speed (informational) ------------------------------------------------------------

static void bench_quantize(void) {
    const int R = 32768, C = 2048, reps = 5;
    size_t n = (size_t)R * C;
    bf16 *in = (bf16 *)device_alloc(n * sizeof(bf16));
    uint8_t *out = (uint8_t *)device_alloc(n), *out_t = (uint8_t *)device_alloc(n);
    Fp8Scale zero;
    memset(&zero, 0, sizeof(zero));
    Fp8Scale *slot = (Fp8Scale *)device_copy_of(&zero, sizeof(zero));
    fill_uniform_bf16_kernel<<<1024, THREADS>>>(in, n, SEED);
    cudaCheckLaunch();
    fp8_amax(slot, in, n, 0);
    float median_ms = median_event_ms(2, reps, [&] { fp8_quantize(out, out_t, slot, in, R, C, FP8_E4M3, 0); });
    printf("bench: fp8_quantize E4M3 [%d, %d] out + out_t: %.3f ms, %.0f GB/s (2 bytes read + 2 written per element, "
           "median of %d)\n", R, C, median_ms, 4.0 * n / (median_ms * 1e-3) / 1e9, reps);
    cudaCheck(cudaFree(in));
    cudaCheck(cudaFree(out));
    cudaCheck(cudaFree(out_t));
    cudaCheck(cudaFree(slot));
}

int main(void) {
    for (int k = 0; k < 2; k++) {
        test_reference_anchors(FORMATS[k]);
        test_device_encode(FORMATS[k]);
        test_device_decode(FORMATS[k]);
    }
    test_quantize_shapes();
    for (int k = 0; k < 2; k++) {
        test_zero_tensor(FORMATS[k]);
        test_subnormal_codes(FORMATS[k]);
        test_saturation(FORMATS[k]);
        test_nan_input(FORMATS[k]);
        test_inf_input(FORMATS[k]);
    }
    test_amax_accumulates();
    test_transpose_codes();
    test_cast_from_fp32();
    test_group_helpers();
    bench_quantize();
    return check_summary("test_fp8");
}
