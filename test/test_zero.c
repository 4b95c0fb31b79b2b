// coat/zero.h: the ZeRO shard and bucket arithmetic for many shapes, world sizes and stages, the
// bytes each rank sends against a ring simulation that moves real values, and the per-rank memory
// plan of each stage. CPU only.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/linears.h"
#include "../coat/memory_plan.h"
#include "../coat/zero.h"
#include "check.h"

static ModelShape shape_of(int vocab, int dim, int layers, int heads, int kv_heads, int ffn) {
    ModelShape s;
    memset(&s, 0, sizeof(s));
    s.vocab_size = vocab, s.dim = dim, s.n_layers = layers, s.n_heads = heads, s.n_kv_heads = kv_heads, s.ffn_dim = ffn;
    s.max_seq_len = 2048, s.rope_theta = 10000.0f, s.norm_eps = 1e-5f;
    return s;
}

// Shards tile the padded buffer in multiples of 128 with the least padding; buckets tile the
// parameters at tensor boundaries in backward order; each bucket's owned parts tile the bucket.
static int check_plan(const char *name, const ParamLayout *layout, int ranks, int stage) {
    ZeroPlan z;
    zero_plan_init(&z, layout, ranks, stage);
    int ok = z.shard_elems % PARAM_ALIGN_ELEMS == 0 && z.padded_elems >= layout->total_padded;
    if (stage >= 1) ok &= z.padded_elems == (size_t)ranks * z.shard_elems && z.padded_elems - layout->total_padded < (size_t)ranks * 128;
    else ok &= z.padded_elems == layout->total_padded && z.shard_elems == layout->total_padded;
    for (int r = 0; stage >= 1 && r < ranks; r++) {
        ZeroRange s = zero_shard(&z, r);
        ok &= s.begin == (size_t)r * z.shard_elems && s.end - s.begin == z.shard_elems;
    }
    size_t covered = 0, largest = 0;
    for (int b = 0; b < z.buckets; b++) {
        ZeroRange bucket = zero_bucket(layout, b);
        ok &= bucket.begin % 128 == 0 && bucket.end % 128 == 0 && bucket.end > bucket.begin;
        covered += bucket.end - bucket.begin;
        if (bucket.end - bucket.begin > largest) largest = bucket.end - bucket.begin;
        if (b > 0) ok &= bucket.end == zero_bucket(layout, b - 1).begin;  // each ends where the one done before starts
        size_t owned = 0;
        for (int r = 0; stage >= 1 && r < ranks; r++) {
            ZeroRange part = zero_owned_part(&z, bucket, r), shard = zero_shard(&z, r);
            if (part.end == part.begin) continue;
            ok &= part.begin >= bucket.begin && part.end <= bucket.end && part.begin >= shard.begin && part.end <= shard.end;
            ok &= part.begin % 128 == 0 && part.end % 128 == 0;
            owned += part.end - part.begin;
        }
        if (stage >= 1) ok &= owned == bucket.end - bucket.begin;
    }
    for (int k = 0; k < PARAM_KINDS; k++) {  // zero_bucket_of names the bucket that holds each tensor
        for (int l = 0; l < (param_kind_is_per_layer((ParamKind)k) ? layout->shape.n_layers : 1); l++) {
            ZeroRange bucket = zero_bucket(layout, zero_bucket_of(layout, (ParamKind)k, l));
            size_t offset = param_offset(layout, (ParamKind)k, l);
            ok &= offset >= bucket.begin && offset + layout->padded[k] <= bucket.end;
        }
    }
    ok &= covered == layout->total_padded && zero_bucket(layout, 0).end == layout->total_padded &&
          zero_bucket(layout, z.buckets - 1).begin == 0 && largest == z.largest_bucket_elems;
    if (!ok) check(0, "%s, %d ranks, stage %d: shards, buckets or owned parts do not tile", name, ranks, stage);
    return ok;
}

typedef struct {
    const char *name;
    ModelShape shape;
} NamedShape;

// The shapes both the tiling and the linear-weight tests walk (dims multiples of 16, as FP8 needs).
static size_t test_shapes(NamedShape shapes[5]) {
    NamedShape all[5] = {
        {"tiny", shape_of(512, 64, 2, 4, 2, 128)},
        {"odd (no size a multiple of 128)", shape_of(1001, 192, 3, 3, 1, 208)},
        {"llama-125m", shape_of(32000, 768, 12, 12, 4, 2048)},
        {"llama-1b", shape_of(32000, 2048, 16, 32, 8, 5632)},
        {"llama2-7b", shape_of(32000, 4096, 32, 32, 32, 11008)},
    };
    memcpy(shapes, all, sizeof(all));
    return 5;
}

static void test_tiling(void) {
    NamedShape shapes[5];
    test_shapes(shapes);
    int world_sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 100, 512, 1000, 4096};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++) {
        ParamLayout layout;
        param_layout_init(&layout, &shapes[s].shape);
        int all = 1, count = (int)(sizeof(world_sizes) / sizeof(world_sizes[0]));
        for (int w = 0; w < count; w++)
            for (int stage = 0; stage <= 2; stage++) all &= check_plan(shapes[s].name, &layout, world_sizes[w], stage);
        check(all, "%s: shards, stage-2 buckets and their owned parts tile exactly for %d world sizes (1 to 4096) x 3 stages",
              shapes[s].name, count);
    }
    // More ranks than 128-groups: the last ranks own only padding, still whole groups.
    ParamLayout tiny;
    ModelShape shape = shape_of(512, 64, 2, 4, 2, 128);
    param_layout_init(&tiny, &shape);
    ZeroPlan z;
    zero_plan_init(&z, &tiny, 4096, 1);
    check(z.shard_elems == 128 && zero_shard(&z, 4095).begin >= tiny.total_padded,
          "tiny over 4096 ranks: shards of one group (%zu elements), the last ranks own only padding", z.shard_elems);
}

// The E4M3 parameter gather casts each rank's part of a linear weight as rows of 128 values: with
// the dims FP8 GEMMs need (multiples of 16) the fused weights (wq|wk|wv, w_gate|w_up) lie back to
// back, and every weight's range and every part a rank owns of it begin and end on multiples of 128.
static void test_linear_weight_parts(void) {
    NamedShape shapes[5];
    size_t count = test_shapes(shapes);
    int world_sizes[] = {2, 3, 5, 8, 17, 64, 512};
    for (size_t s = 0; s < count; s++) {
        ParamLayout layout;
        param_layout_init(&layout, &shapes[s].shape);
        int ok = 1;
        for (int l = 0; l < layout.shape.n_layers; l++)
            for (int i = 0; i < LINEARS; i++) {
                LinearInfo linear = linear_info((Linear)i);
                size_t begin = param_offset(&layout, linear.first_weight, l), elems = 0;
                for (int k = (int)linear.first_weight; k <= (int)linear.last_weight; k++) {
                    ok &= param_offset(&layout, (ParamKind)k, l) == begin + elems;  // back to back
                    elems += param_numel(&layout, (ParamKind)k);
                }
                ZeroRange range = {begin, begin + elems};
                size_t in[LINEARS], out[LINEARS];
                linear_shapes(&layout.shape, in, out);
                ZeroRange named = zero_linear_range(&layout, (Linear)i, l);  // the GEMM's in x out weights from there
                ok &= named.begin == range.begin && named.end == range.end && elems == in[i] * out[i];
                ok &= range.begin % 128 == 0 && range.end % 128 == 0;
                for (size_t w = 0; w < sizeof(world_sizes) / sizeof(world_sizes[0]); w++) {
                    ZeroPlan z;
                    zero_plan_init(&z, &layout, world_sizes[w], 1);
                    for (int r = 0; r < world_sizes[w]; r++) {
                        ZeroRange part = zero_owned_part(&z, range, r);
                        ok &= part.begin % 128 == 0 && part.end % 128 == 0;
                    }
                }
            }
        check(ok, "%s: every linear weight (fused ones back to back, zero_linear_range, in x out elements) and every "
                  "rank's part of it start and end on multiples of 128 elements, 2 to 512 ranks", shapes[s].name);
    }
}

static void test_largest_bucket(void) {
    ModelShape one = shape_of(32000, 2048, 16, 32, 8, 5632), seven = shape_of(32000, 4096, 32, 32, 32, 11008);
    ParamLayout a, b;
    param_layout_init(&a, &one);
    param_layout_init(&b, &seven);
    ZeroPlan za, zb;
    zero_plan_init(&za, &a, 8, 2);
    zero_plan_init(&zb, &b, 8, 2);
    check(za.largest_bucket_elems == a.padded[PARAM_FINAL_NORM] + a.padded[PARAM_LM_HEAD] && za.largest_bucket_elems > a.layer_stride,
          "llama-1b: the largest bucket is the lm_head with the final norm (%zu elements; a layer %zu)",
          za.largest_bucket_elems, a.layer_stride);
    check(zb.largest_bucket_elems == b.layer_stride, "llama2-7b: the largest bucket is a layer (%zu elements)", zb.largest_bucket_elems);
}

// A ring all-reduce of W ranks' vectors of n = W k values: W - 1 reduce-scatter steps, then W - 1
// all-gather steps, each rank sending one chunk to the next per step. Checks every rank ends with
// the sum and returns the values one rank sent (the same for all).
static size_t ring_all_reduce(int W, size_t k, int gather_only, int scatter_only) {
    size_t n = (size_t)W * k;
    long *data = malloc(sizeof(long) * n * W), *incoming = malloc(sizeof(long) * k * W);
    for (int r = 0; r < W; r++)
        for (size_t i = 0; i < n; i++) data[r * n + i] = (long)(r + 1) * (long)(i + 3);
    size_t sent = 0;
    if (!gather_only)
        for (int step = 0; step < W - 1; step++) {  // rank r sends chunk (r - step) mod W to r + 1, which adds it
            for (int r = 0; r < W; r++) memcpy(incoming + r * k, data + r * n + ((r - step + W) % W) * k, sizeof(long) * k);
            for (int r = 0; r < W; r++) {
                int from = (r - 1 + W) % W, chunk = (from - step + W) % W;
                for (size_t i = 0; i < k; i++) data[r * n + chunk * k + i] += incoming[from * k + i];
            }
            sent += k;
        }
    if (gather_only)  // rank r starts owning the fully reduced chunk (r + 1) mod W
        for (int r = 0; r < W; r++)
            for (size_t i = 0; i < n; i++) data[r * n + i] = r == (int)(i / k + W - 1) % W ? (long)(i + 3) * W * (W + 1) / 2 : 0;
    if (!scatter_only)
        for (int step = 0; step < W - 1; step++) {  // rank r passes on chunk (r + 1 - step) mod W
            for (int r = 0; r < W; r++) memcpy(incoming + r * k, data + r * n + ((r + 1 - step + W) % W) * k, sizeof(long) * k);
            for (int r = 0; r < W; r++) {
                int from = (r - 1 + W) % W, chunk = (from + 1 - step + W) % W;
                memcpy(data + r * n + chunk * k, incoming + from * k, sizeof(long) * k);
            }
            sent += k;
        }
    int ok = 1;
    for (int r = 0; r < W; r++)
        for (size_t i = 0; i < n; i++) {
            long sum = (long)(i + 3) * W * (W + 1) / 2;
            if (scatter_only) ok &= (int)(i / k) != (r + 1) % W || data[r * n + i] == sum;  // r holds chunk r + 1
            else ok &= data[r * n + i] == sum;
        }
    free(data);
    free(incoming);
    return ok ? sent : (size_t)-1;
}

static void test_traffic(void) {
    ModelShape shape = shape_of(1001, 192, 3, 3, 1, 208);
    ParamLayout layout;
    param_layout_init(&layout, &shape);
    for (int W = 2; W <= 8; W++) {
        ZeroPlan z0, z1, z2;
        zero_plan_init(&z0, &layout, W, 0);
        zero_plan_init(&z1, &layout, W, 1);
        zero_plan_init(&z2, &layout, W, 2);
        // The simulation moves chunks of k values; per element of the vector a rank sends sent / (W k).
        size_t k = 3, all_reduce = ring_all_reduce(W, k, 0, 0), scatter = ring_all_reduce(W, k, 0, 1),
               gather = ring_all_reduce(W, k, 1, 0);
        ZeroTraffic t0 = zero_traffic(&z0, &layout, 4, 0), t1 = zero_traffic(&z1, &layout, 4, 0),
                    t2 = zero_traffic(&z2, &layout, 4, 0), t1_fp8 = zero_traffic(&z1, &layout, 4, 1);
        double per_element_all_reduce = (double)all_reduce / (W * k), per_element_scatter = (double)scatter / (W * k),
               per_element_gather = (double)gather / (W * k);
        int ok = all_reduce != (size_t)-1 && scatter != (size_t)-1 && gather != (size_t)-1;
        ok &= fabs(t0.gradient_bytes - per_element_all_reduce * 2.0 * z0.padded_elems) < 1e-6 && t0.parameter_bytes == 0.0;
        ok &= fabs(t1.gradient_bytes - per_element_scatter * 2.0 * z1.padded_elems) < 1e-6;
        ok &= fabs(t1.parameter_bytes - per_element_gather * 2.0 * z1.padded_elems) < 1e-6;
        ok &= fabs(t2.gradient_bytes - 4 * t1.gradient_bytes) < 1e-6 && t2.parameter_bytes == t1.parameter_bytes;
        double fp8_elems = (double)zero_block_linear_elems(&layout);
        ok &= fabs(t1.parameter_bytes - t1_fp8.parameter_bytes - per_element_gather * fp8_elems) < 1e-6;
        check(ok, "%d ranks: bytes per rank = a ring simulation's (all-reduce %.3f, reduce-scatter %.3f, all-gather %.3f "
                  "values sent per element); stage 2 sends every micro-batch; e4m3 block weights save 1 byte each",
              W, per_element_all_reduce, per_element_scatter, per_element_gather);
    }
    ZeroPlan single;
    zero_plan_init(&single, &layout, 1, 2);
    ZeroTraffic none = zero_traffic(&single, &layout, 8, 1);
    check(none.gradient_bytes == 0.0 && none.parameter_bytes == 0.0, "one rank sends nothing");
}

// Per-rank memory of each stage, in bytes per parameter, for llama-1b on 4 ranks.
static void test_memory(void) {
    TrainConfig c;
    memset(&c, 0, sizeof(c));
    c.model = shape_of(32000, 2048, 16, 32, 8, 5632);
    c.seq_len = 2048;
    c.precision = PRECISION_BF16;
    c.optimizer_states = STATES_FP32;
    c.activations = ACTS_BF16;
    MemoryPlan plan;
    ParamLayout layout;
    param_layout_init(&layout, &c.model);
    double decay = 1.0 / 128;  // the weight-decay table: a byte per group
    struct { int ranks, stage; double expected; } cases[] = {
        {1, 0, 16.0 + decay},                       // 2 params + 2 gradients + 4 master + 8 states
        {4, 0, 16.0 + decay},                       // replicated
        {4, 1, 4.0 + (12.0 + decay) / 4},           // params and gradients whole, master and states sharded
        {4, 2, 2.0 + (16.0 + decay) / 4},           // + the FP32 gradient shard, and two buckets below
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        c.zero_stage = cases[i].stage;
        memory_plan_compute(&plan, &c, cases[i].ranks, 1);
        ZeroPlan z;
        zero_plan_init(&z, &layout, cases[i].ranks, cases[i].ranks > 1 ? cases[i].stage : 0);
        double buckets = cases[i].stage == 2 ? 4.0 * z.largest_bucket_elems / plan.params_padded : 0.0;
        double per_param = (double)(plan.params_bytes + plan.grads_bytes + plan.master_bytes + plan.states_bytes) / plan.params_padded;
        check(fabs(per_param - cases[i].expected - buckets) < 0.01,
              "llama-1b, %d rank(s), ZeRO stage %d: %.3f bytes/param (expected %.3f%s)", cases[i].ranks, cases[i].stage,
              per_param, cases[i].expected + buckets, cases[i].stage == 2 ? ", with two BF16 buffers of the largest bucket" : "");
    }
}

int main(void) {
    test_tiling();
    test_linear_weight_parts();
    test_largest_bucket();
    test_traffic();
    test_memory();
    return check_summary("test_zero");
}
