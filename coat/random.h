// Seeded random numbers for initialisation and data shuffling, identical on every
// platform: SplitMix64 for the stream, Box-Muller for normals (computed in double).
#pragma once
#include <math.h>
#include <stdint.h>

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
