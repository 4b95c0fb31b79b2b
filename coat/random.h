// Seeded random numbers for initialisation and data shuffling, identical on every
// platform: SplitMix64 for the stream, Box-Muller for normals (computed in double); and a
// counter-based normal (the i-th value of a seed, computed alone) in integer arithmetic, so
// that the GPU initialises any model in parallel to the same bits as the host.
#pragma once
#include <math.h>
#include <stdint.h>

#ifdef __CUDACC__
#define RANDOM_HOST_DEVICE __host__ __device__
#else
#define RANDOM_HOST_DEVICE
#endif

typedef struct { uint64_t state; } Random;

static inline void random_seed(Random *rng, uint64_t seed) { rng->state = seed; }

static inline uint64_t random_u64(Random *rng) {
    uint64_t z = (rng->state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Uniform in [0, 1) with 53 random bits.
static inline double random_uniform(Random *rng) { return (double)(random_u64(rng) >> 11) * 0x1.0p-53; }

// Uniform integer in [0, n), n > 0, without modulo bias.
static inline uint64_t random_below(Random *rng, uint64_t n) {
    uint64_t limit = UINT64_MAX - UINT64_MAX % n;
    uint64_t x;
    do { x = random_u64(rng); } while (x >= limit);
    return x % n;
}

// Standard normal; each call draws two uniforms and uses one of the pair, so the
// stream position depends only on the number of calls.
static inline double random_normal(Random *rng) {
    double u1 = 1.0 - random_uniform(rng);  // (0, 1]: log is finite
    double u2 = random_uniform(rng);
    return sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2);
}

// SplitMix64's output function: a bijection of 64-bit words that mixes every bit.
RANDOM_HOST_DEVICE static inline uint64_t random_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Value `index` of the counter-based stream `seed`: the Irwin-Hall sum of 12 uniforms of 24 bits
// (two from each of six mixed words), centred: mean 0, variance 1, within +-6, a normal to 0.3%
// in the cumulative distribution. Integers up to the last step, whose conversion to float is
// exact (the sum has at most 28 bits), so every compiler and the GPU give the same float.
RANDOM_HOST_DEVICE static inline float random_normal_at(uint64_t seed, uint64_t index) {
    uint64_t key = random_mix64(seed + 0x9E3779B97F4A7C15ull), sum = 0;
    for (uint64_t k = 0; k < 6; k++) {
        uint64_t word = random_mix64(key ^ random_mix64(6 * index + k + 1));
        sum += (word >> 40) + ((word >> 8) & 0xffffffull);
    }
    return (float)((int64_t)sum - 6 * (int64_t)(1 << 24)) * (1.0f / 16777216.0f);
}
