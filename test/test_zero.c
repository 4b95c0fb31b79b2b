// coat/zero.h: the ZeRO bucket and part arithmetic for many shapes, world sizes and stages (the
// buckets tile the parameter order, every rank owns an equal part of each, the parts map back to
// the parameter order exactly once, as checkpoints need), the collective calls of a step, the
// bytes each rank sends against a ring simulation that moves real values, and the per-rank memory
// plan of each stage. CPU only.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/linears.h"
#include "../coat/memory_plan.h"
#include "../coat/zero.h"
#include "check.h"

#define BUCKET_MIN ((size_t)33554432)  // the config's default bucket_min_elems

static ModelShape shape_of(int vocab, int dim, int layers, int heads, int kv_heads, int ffn) {
    ModelShape s;
    memset(&s, 0, sizeof(s));
    s.vocab_size = vocab, s.dim = dim, s.n_layers = layers, s.n_heads = heads, s.n_kv_heads = kv_heads, s.ffn_dim = ffn;
    s.max_seq_len = 2048, s.rope_theta = 10000.0f, s.norm_eps = 1e-5f;
    return s;
}

// A coat run's memory-plan keys (the rest zero) for `shape` at seq_len, with the default buckets.
static TrainConfig coat_plan_config(ModelShape shape, int seq_len) {
    TrainConfig c;
    memset(&c, 0, sizeof(c));
    c.model = shape;
    c.seq_len = seq_len;
    c.precision = PRECISION_COAT;
    c.bucket_min_elems = (int)BUCKET_MIN;
    return c;
}

// Buckets are runs of segments that tile the parameter order at tensor boundaries, merged only
// while smaller than `min` elements; each is padded to `shards` equal parts of a multiple of
// 128, placed back to back in the device buffers and in each rank's state; the ranks' parts of a
// bucket tile it in rank order; every tensor lies in its segment's bucket at the place
// zero_place_segments gives it.
static int check_plan(const char *name, const ParamLayout *layout, int ranks, int stage, size_t min) {
    static ZeroPlan z;
    zero_plan_init(&z, layout, ranks, stage, min);
    int shards = stage >= 1 ? ranks : 1, L = layout->shape.n_layers, ok = z.shards == shards && z.segments == L + 2;
    size_t at = 0, state_at = 0, largest = 0;
    for (int b = 0; b < z.buckets; b++) {
        const ParamShardRange *r = &z.bucket[b];
        size_t n = r->end - r->begin, padded = (size_t)shards * r->part;
        ok &= r->begin == (b == 0 ? 0 : z.bucket[b - 1].end) && r->begin % 128 == 0 && r->end % 128 == 0 && n > 0;
        ok &= r->part % 128 == 0 && padded >= n && padded < n + (size_t)shards * 128 && r->at == at && r->state_at == state_at;
        ok &= z.first_segment[b] <= z.last_segment[b] && r->begin == param_segment_begin(layout, z.last_segment[b]) &&
              r->end == param_segment_end(layout, z.first_segment[b]);
        if (z.last_segment[b] > z.first_segment[b])  // merged: layers only, and without its last segment still small
            ok &= zero_bucket_is_layers(&z, b) &&
                  param_segment_end(layout, z.first_segment[b]) - param_segment_begin(layout, z.last_segment[b] - 1) < min;
        for (int s = z.first_segment[b]; s <= z.last_segment[b]; s++) ok &= z.bucket_of[s] == b;
        size_t next = r->begin;
        for (int rank = 0; rank < shards; rank++) {
            ZeroRange part = zero_owned(&z, b, rank);
            ok &= part.begin == next && part.end - part.begin <= r->part && part.begin % 128 == 0 && part.end % 128 == 0;
            ok &= part.end - part.begin == r->part || part.end == r->end;  // equal parts; the padding at the end
            next = part.end;
        }
        ok &= next == r->end;
        at += padded;
        state_at += r->part;
        if (padded > largest) largest = padded;
    }
    ok &= z.bucket[z.buckets - 1].end == layout->total_padded && z.buffer_elems == at && z.shard_elems == state_at &&
          z.largest_bucket_elems == largest && z.first_segment[0] == L + 1 && z.last_segment[z.buckets - 1] == 0;
    ParamLayout placed = *layout;
    zero_place_segments(&z, &placed);
    for (int k = 0; k < PARAM_KINDS; k++)
        for (int l = 0; l < (param_kind_is_per_layer((ParamKind)k) ? L : 1); l++) {
            const ParamShardRange *r = &z.bucket[z.bucket_of[param_segment_of(layout, (ParamKind)k, l)]];
            size_t offset = param_offset(layout, (ParamKind)k, l);
            ok &= offset >= r->begin && offset + layout->padded[k] <= r->end &&
                  param_buffer_offset(&placed, (ParamKind)k, l) == r->at + (offset - r->begin);
        }
    ok &= placed.buffer_elems == z.buffer_elems;
    if (!ok) check(0, "%s, %d ranks, stage %d: buckets, parts or their places do not tile", name, ranks, stage);
    return ok;
}

// Element by element on small shapes: every element of the parameter order is in exactly one
// rank's part, at one place of the device buffers and of that rank's state; each rank's parts
// fill its state [0, shard_elems) exactly once (the padding included); and a checkpoint's order
// (bucket by bucket, rank by rank: what rank 0 writes) is the parameter order.
static int check_parts_exactly_once(const ParamLayout *layout, int ranks, size_t min) {
    static ZeroPlan z;
    zero_plan_init(&z, layout, ranks, 1, min);
    unsigned char *owner_count = calloc(layout->total_padded, 1), *buffer_count = calloc(z.buffer_elems, 1),
                  *state_count = calloc((size_t)ranks * z.shard_elems, 1);
    int ok = owner_count && buffer_count && state_count;
    size_t written = 0;  // the checkpoint's order so far
    for (int b = 0; ok && b < z.buckets; b++)
        for (int r = 0; r < ranks; r++) {
            const ParamShardRange *range = &z.bucket[b];
            ZeroRange part = zero_owned(&z, b, r);
            ok &= part.begin == written || part.end == part.begin;
            written = part.end > part.begin ? part.end : written;
            for (size_t e = part.begin; e < part.end; e++) owner_count[e]++;
            for (size_t i = 0; i < range->part; i++) {  // the part's room, its padding included
                buffer_count[range->at + (size_t)r * range->part + i]++;
                state_count[(size_t)r * z.shard_elems + range->state_at + i]++;
            }
        }
    for (size_t e = 0; ok && e < layout->total_padded; e++) ok &= owner_count[e] == 1;
    for (size_t e = 0; ok && e < z.buffer_elems; e++) ok &= buffer_count[e] == 1;
    for (size_t e = 0; ok && e < (size_t)ranks * z.shard_elems; e++) ok &= state_count[e] == 1;
    ok &= written == layout->total_padded;
    free(owner_count);
    free(buffer_count);
    free(state_count);
    return ok;
}

typedef struct {
    const char *name;
    ModelShape shape;
} NamedShape;

// The shapes both the tiling and the linear-weight tests walk (dims multiples of 16, as FP8 needs).
static size_t test_shapes(NamedShape shapes[6]) {
    NamedShape all[6] = {
        {"tiny", shape_of(512, 64, 2, 4, 2, 128)},
        {"odd (no size a multiple of 128)", shape_of(1001, 192, 3, 3, 1, 208)},
        {"llama-125m", shape_of(32000, 768, 12, 12, 4, 2048)},
        {"llama-1b", shape_of(32000, 2048, 16, 32, 8, 5632)},
        {"llama2-7b", shape_of(32000, 4096, 32, 32, 32, 11008)},
        {"1024 small layers", shape_of(256, 128, 1024, 2, 1, 256)},
    };
    memcpy(shapes, all, sizeof(all));
    return 6;
}

static void test_tiling(void) {
    NamedShape shapes[6];
    size_t shape_count = test_shapes(shapes);
    int world_sizes[] = {1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 64, 100, 512, 1000, 4096};
    for (size_t s = 0; s < shape_count; s++) {
        ParamLayout layout;
        param_layout_init(&layout, &shapes[s].shape);
        int all = 1, count = (int)(sizeof(world_sizes) / sizeof(world_sizes[0]));
        for (int w = 0; w < count; w++)
            for (int stage = 0; stage <= 3; stage++)
                for (int m = 0; m < 2; m++)  // a bucket per layer; the default
                    all &= check_plan(shapes[s].name, &layout, world_sizes[w], stage, m == 0 ? 1 : BUCKET_MIN);
        check(all, "%s: buckets tile the parameter order, each rank owns an equal part (a multiple of 128) of each, "
                   "placed back to back, for %d world sizes (1 to 4096) x 4 stages x a bucket per layer or merged",
              shapes[s].name, count);
    }
    for (size_t s = 0; s < 2; s++) {  // the small shapes, element by element
        ParamLayout layout;
        param_layout_init(&layout, &shapes[s].shape);
        int all = 1;
        for (int ranks = 1; ranks <= 17; ranks++)
            all &= check_parts_exactly_once(&layout, ranks, 1) && check_parts_exactly_once(&layout, ranks, BUCKET_MIN);
        check(all, "%s, 1 to 17 ranks: every element in one rank's part, every place of the buffers and the ranks' states "
                   "once, a checkpoint's order (bucket by bucket, rank by rank) the parameter order", shapes[s].name);
    }
    // More ranks than 128-groups in a bucket: the last ranks own only padding, still whole groups.
    ParamLayout tiny;
    ModelShape shape = shape_of(512, 64, 2, 4, 2, 128);
    param_layout_init(&tiny, &shape);
    static ZeroPlan z;
    zero_plan_init(&z, &tiny, 4096, 1, BUCKET_MIN);
    ZeroRange last = zero_owned(&z, 0, 4095);
    check(z.bucket[0].part == 128 && last.begin == last.end && z.shard_elems == (size_t)z.buckets * 128,
          "tiny over 4096 ranks: parts of one group (%zu elements) in each of %d buckets, the last ranks own only padding",
          z.bucket[0].part, z.buckets);
}

// The E4M3 parameter gather casts each rank's part of a linear weight as rows of 128 values: with
// the dims FP8 GEMMs need (multiples of 16) the fused weights (wq|wk|wv, w_gate|w_up) lie back to
// back, and every weight's range and every part a rank owns of it begin and end on multiples of 128.
static void test_linear_weight_parts(void) {
    NamedShape shapes[6];
    size_t count = test_shapes(shapes);
    int world_sizes[] = {2, 3, 5, 8, 17, 64, 512};
    static ZeroPlan z;
    for (size_t s = 0; s < count - 1; s++) {
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
                    zero_plan_init(&z, &layout, world_sizes[w], 1, BUCKET_MIN);
                    int b = z.bucket_of[layout.shape.n_layers - l];
                    ok &= zero_bucket_is_layers(&z, b);
                    for (int r = 0; r < world_sizes[w]; r++) {
                        ZeroRange part = zero_intersection(range, zero_owned(&z, b, r));
                        ok &= part.begin % 128 == 0 && part.end % 128 == 0;
                    }
                }
            }
        check(ok, "%s: every linear weight (fused ones back to back, zero_linear_range, in x out elements) lies in a bucket "
                  "of layers, and every rank's part of it starts and ends on multiples of 128 elements, 2 to 512 ranks",
              shapes[s].name);
    }
}

static void test_buckets(void) {
    ModelShape one = shape_of(32000, 2048, 16, 32, 8, 5632), seven = shape_of(32000, 4096, 32, 32, 32, 11008),
               small = shape_of(32000, 768, 12, 12, 4, 2048);
    ParamLayout a, b, c;
    param_layout_init(&a, &one);
    param_layout_init(&b, &seven);
    param_layout_init(&c, &small);
    static ZeroPlan za, zb, zc;
    zero_plan_init(&za, &a, 8, 2, BUCKET_MIN);
    zero_plan_init(&zb, &b, 8, 2, BUCKET_MIN);
    zero_plan_init(&zc, &c, 8, 2, BUCKET_MIN);
    const ParamShardRange *tail = &za.bucket[za.buckets - 1];
    check(za.buckets == 18 && za.largest_bucket_elems == 8 * tail->part && tail->end - tail->begin == a.padded[PARAM_FINAL_NORM] + a.padded[PARAM_LM_HEAD],
          "llama-1b: 18 buckets (a layer of %zu elements each), the largest the lm_head with the final norm (%zu elements padded)",
          a.layer_stride, za.largest_bucket_elems);
    check(zb.buckets == 34 && zb.largest_bucket_elems == 8 * zb.bucket[1].part && zb.bucket[1].end - zb.bucket[1].begin == b.layer_stride,
          "llama2-7b: 34 buckets, the largest a layer (%zu elements padded)", zb.largest_bucket_elems);
    int merged = 0;
    for (int i = 0; i < zc.buckets; i++) merged += zc.last_segment[i] > zc.first_segment[i];
    check(zc.buckets < 14 && merged > 0, "llama-125m: its small layers (%zu elements) merged, %d buckets for 12 layers",
          c.layer_stride, zc.buckets);
    zero_plan_init(&zc, &c, 8, 2, 1);
    check(zc.buckets == 14, "llama-125m, bucket_min_elems 1: a bucket per layer, the tail and the embedding (%d)", zc.buckets);
}

// The collective calls of a step: a bucket's count plus a constant, at any world size.
static void test_calls(void) {
    ModelShape seven = shape_of(32000, 4096, 32, 32, 32, 11008);
    ParamLayout layout;
    param_layout_init(&layout, &seven);
    static ZeroPlan z;
    int ok = 1;
    int world_sizes[] = {2, 8, 64, 512, 4096};
    for (size_t w = 0; w < sizeof(world_sizes) / sizeof(world_sizes[0]); w++) {
        for (int stage = 0; stage <= 2; stage++) {
            zero_plan_init(&z, &layout, world_sizes[w], stage, BUCKET_MIN);
            ZeroCalls bf16 = zero_calls(&z, 4, 0), e4m3 = zero_calls(&z, 4, 1);
            if (stage == 0) ok &= bf16.all_reduces == 35 && bf16.reduce_scatters == 0 && bf16.all_gathers == 0;
            if (stage >= 1) ok &= bf16.reduce_scatters == (stage == 2 ? 4 * 34 : 34) && bf16.all_gathers == 34 &&
                                  bf16.all_reduces == 1 && e4m3.all_gathers == 34 && e4m3.all_reduces == 3;
        }
    }
    zero_plan_init(&z, &layout, 1, 0, BUCKET_MIN);
    ZeroCalls one = zero_calls(&z, 4, 1);
    ok &= one.all_reduces == 0 && one.reduce_scatters == 0 && one.all_gathers == 0;
    check(ok, "llama2-7b, 2 to 4096 ranks: 34 reduce-scatters (x micro-batches at stage 2) and 34 all-gathers a step, 1 "
              "all-reduce (3 with the E4M3 gather); stage 0: 35 all-reduces; one rank: none");
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
        static ZeroPlan z0, z1, z2, z3;
        zero_plan_init(&z0, &layout, W, 0, BUCKET_MIN);
        zero_plan_init(&z1, &layout, W, 1, BUCKET_MIN);
        zero_plan_init(&z2, &layout, W, 2, BUCKET_MIN);
        zero_plan_init(&z3, &layout, W, 3, 1);  // a bucket per layer: 3 buckets of layers
        // The simulation moves chunks of k values; per element of the vector a rank sends sent / (W k).
        size_t k = 3, all_reduce = ring_all_reduce(W, k, 0, 0), scatter = ring_all_reduce(W, k, 0, 1),
               gather = ring_all_reduce(W, k, 1, 0);
        ZeroTraffic t0 = zero_traffic(&z0, &layout, 4, 0), t1 = zero_traffic(&z1, &layout, 4, 0),
                    t2 = zero_traffic(&z2, &layout, 4, 0), t1_fp8 = zero_traffic(&z1, &layout, 4, 1);
        double per_element_all_reduce = (double)all_reduce / (W * k), per_element_scatter = (double)scatter / (W * k),
               per_element_gather = (double)gather / (W * k);
        int ok = all_reduce != (size_t)-1 && scatter != (size_t)-1 && gather != (size_t)-1;
        ok &= fabs(t0.gradient_bytes - per_element_all_reduce * 2.0 * z0.buffer_elems) < 1e-6 && t0.parameter_bytes == 0.0;
        ok &= fabs(t1.gradient_bytes - per_element_scatter * 2.0 * z1.buffer_elems) < 1e-6;
        ok &= fabs(t1.parameter_bytes - per_element_gather * 2.0 * z1.buffer_elems) < 1e-6;
        ok &= fabs(t2.gradient_bytes - 4 * t1.gradient_bytes) < 1e-6 && t2.parameter_bytes == t1.parameter_bytes;
        double layer_elems = 0.0;  // the buckets of layers travel a byte per element, their norms in the table's all-reduce
        for (int b = 0; b < z1.buckets; b++)
            if (zero_bucket_is_layers(&z1, b)) layer_elems += (double)W * z1.bucket[b].part;
        ok &= fabs(t1.parameter_bytes - t1_fp8.parameter_bytes - per_element_gather * layer_elems +
                   per_element_all_reduce * 2.0 * param_norm_table_elems(&layout)) < 1e-6;
        // Stage 3 over 4 micro-batches, buckets of layers 1 to 3 in the forward's order: the first
        // forward gathers all three; each backward bucket 1 (the slots hold 3 and 2 from the forward);
        // each later forward bucket 3 (the slots hold 1 and 2 from the backward): 5, 1 and 4 times;
        // the embedding and the tail once.
        ZeroTraffic t3 = zero_traffic(&z3, &layout, 4, 0), t3_fp8 = zero_traffic(&z3, &layout, 4, 1);
        double layers3 = 0.0, gathered3 = 0.0, times[4] = {0, 5, 1, 4};
        for (int b = 1; b < z3.buckets - 1; b++) {
            layers3 += (double)W * z3.bucket[b].part;
            gathered3 += times[b] * W * z3.bucket[b].part;
        }
        double others3 = (double)z3.buffer_elems - layers3;
        ok &= z3.buckets == 5 && fabs(t3.gradient_bytes - 4 * per_element_scatter * 2.0 * z3.buffer_elems) < 1e-6 &&
              fabs(t3.parameter_bytes - per_element_gather * 2.0 * (others3 + gathered3)) < 1e-6 &&
              fabs(t3_fp8.parameter_bytes - per_element_gather * (2.0 * others3 + gathered3) -
                   per_element_all_reduce * 2.0 * param_norm_table_elems(&layout)) < 1e-6;
        check(ok, "%d ranks: bytes per rank = a ring simulation's (all-reduce %.3f, reduce-scatter %.3f, all-gather %.3f "
                  "values sent per element); stages 2 and 3 send every micro-batch; e4m3 layers save 1 byte each, plus the "
                  "norm table; stage 3 gathers its 3 buckets of layers 5, 1 and 4 times in 4 micro-batches",
              W, per_element_all_reduce, per_element_scatter, per_element_gather);
    }
    static ZeroPlan single;
    zero_plan_init(&single, &layout, 1, 2, BUCKET_MIN);
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
        {4, 1, 4.0 + (14.0 + decay) / 4},           // params and gradients whole; the gradient shard, master, states sharded
        {4, 2, 2.0 + (16.0 + decay) / 4},           // + the FP32 gradient shard, and two buckets below
        {4, 3, (14.0 + decay) / 4},                 // one micro-batch: a BF16 gradient shard; two buckets and the
                                                    // embedding's and tail's BF16 below
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        c.zero_stage = cases[i].stage;
        memory_plan_compute(&plan, &c, cases[i].ranks, 1);
        static ZeroPlan z;
        zero_plan_init(&z, &layout, cases[i].ranks, cases[i].ranks > 1 ? cases[i].stage : 0, BUCKET_MIN);
        double buckets = cases[i].stage >= 2 ? 4.0 * z.largest_bucket_elems / plan.params_padded : 0.0;
        if (cases[i].stage == 3)  // the embedding's and the tail's buckets stay whole, in BF16
            buckets += 2.0 * 4 * (z.bucket[0].part + z.bucket[z.buckets - 1].part) / plan.params_padded;
        double per_param = (double)(plan.params_bytes + plan.grads_bytes + plan.master_bytes + plan.states_bytes) / plan.params_padded;
        size_t gather = cases[i].stage == 3 ? 2 * 2 * z.largest_layer_bucket_elems : 0;
        check(fabs(per_param - cases[i].expected - buckets) < 0.01 && plan.gather_bytes == gather,
              "llama-1b, %d rank(s), ZeRO stage %d: %.3f bytes/param (expected %.3f%s)", cases[i].ranks, cases[i].stage,
              per_param, cases[i].expected + buckets,
              cases[i].stage == 2   ? ", with two BF16 buffers of the largest bucket"
              : cases[i].stage == 3 ? ", with two BF16 buffers of the largest bucket, the embedding and the tail; the layers "
                                      "in two BF16 slots of the largest bucket of layers"
                                    : "");
    }
}

// With FP8 GEMMs casting from the master weights (param_gather e4m3, the default) the BF16
// parameters are the embedding's and the tail's buckets and the layers' norms only, at every
// stage and world size; the rest of the plan is unchanged but for the E4M3 gather's staging.
// llama2-7b in coat at ZeRO-1 on 8 ranks (micro-batch 8 x 2048) plans at least 12 GiB less BF16
// parameters per rank than with the BF16 copy.
static void test_memory_without_bf16_block_weights(void) {
    TrainConfig c = coat_plan_config(shape_of(32000, 4096, 32, 32, 32, 11008), 2048);
    ParamLayout layout;
    param_layout_init(&layout, &c.model);
    static ZeroPlan z;
    struct { int ranks, stage; } cases[] = {{1, 0}, {8, 0}, {8, 1}, {8, 2}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        c.zero_stage = cases[i].stage;
        MemoryPlan copy, none;
        c.param_gather = GATHER_BF16;
        memory_plan_compute(&copy, &c, cases[i].ranks, 8);
        c.param_gather = GATHER_AUTO;
        memory_plan_compute(&none, &c, cases[i].ranks, 8);
        zero_plan_init(&z, &layout, cases[i].ranks, cases[i].stage, BUCKET_MIN);
        size_t outside = (size_t)z.shards * (z.bucket[0].part + z.bucket[z.buckets - 1].part);
        size_t expected = 2 * (outside + param_norm_table_elems(&layout));
        int e4m3_gather = cases[i].ranks > 1 && cases[i].stage >= 1;
        size_t others_copy = copy.total_bytes - copy.params_bytes;  // the E4M3 gather adds its staging
        size_t others_none = none.total_bytes - none.params_bytes - (e4m3_gather ? zero_e4m3_gather_bytes(&z) : 0);
        check(none.params_bytes == expected && others_none == others_copy,
              "llama2-7b coat, %d rank(s), ZeRO stage %d: BF16 parameters %zu bytes (expected %zu: the embedding's and tail's "
              "buckets, the norm table), %.3f GiB less in all than with the BF16 copy", cases[i].ranks, cases[i].stage,
              none.params_bytes, expected, gib(copy.total_bytes - none.total_bytes));
        if (cases[i].ranks == 8 && cases[i].stage == 1)
            check(copy.params_bytes - none.params_bytes >= (size_t)12 << 30, "llama2-7b coat at ZeRO-1 on 8 ranks plans at least "
                  "12 GiB less BF16 parameters per rank (%.3f GiB)", gib(copy.params_bytes - none.params_bytes));
    }
}

// ZeRO-3's plan: the buckets of layers gathered into two slots (the largest bucket of layers,
// E4M3 or BF16, and with E4M3 one bucket's transposes), stage 2's bucket buffers, the gradient
// shard BF16 with one micro-batch per step, FP32 with several; nothing gathered on one rank.
static void test_stage3_plan(void) {
    ModelShape seven = shape_of(32000, 4096, 32, 32, 32, 11008), small = shape_of(32000, 768, 12, 12, 4, 2048);
    ParamLayout a, b;
    param_layout_init(&a, &seven);
    param_layout_init(&b, &small);
    static ZeroPlan z;
    zero_plan_init(&z, &a, 8, 3, BUCKET_MIN);
    size_t layer_linear = linear_layer_weight_elems(&seven), largest = 0;
    for (int k = 1; k < z.buckets - 1; k++)
        if ((size_t)8 * z.bucket[k].part > largest) largest = (size_t)8 * z.bucket[k].part;
    int ok = zero_layers_gathered(&z) && z.largest_layer_bucket_elems == largest && z.most_layers_per_bucket == 1 &&
             zero_grads_elems(&z) == 2 * z.largest_bucket_elems && zero_grad_shard_bytes(&z) == 4 * z.shard_elems;
    ok &= zero_layer_gather_bytes(&z, &seven, 1) == 2 * largest + layer_linear &&
          zero_layer_gather_bytes(&z, &seven, 0) == 2 * 2 * largest && zero_e4m3_gather_bytes(&z) == 0;
    zero_plan_micro_batches(&z, 1);
    ok &= z.bf16_grad_shard && zero_grad_shard_bytes(&z) == 2 * z.shard_elems;
    zero_plan_micro_batches(&z, 4);
    ok &= !z.bf16_grad_shard && zero_grad_shard_bytes(&z) == 4 * z.shard_elems;
    check(ok, "llama2-7b, ZeRO-3 on 8 ranks: 2 slots of the largest bucket of layers (%zu elements; e4m3 %zu bytes with a "
              "layer's transposes, bf16 %zu), two bucket buffers, the gradient shard bf16 with one micro-batch, fp32 with 4",
          largest, zero_layer_gather_bytes(&z, &seven, 1), zero_layer_gather_bytes(&z, &seven, 0));
    zero_plan_init(&z, &b, 8, 3, BUCKET_MIN);
    check(z.most_layers_per_bucket > 1 &&
              zero_layer_transposes_bytes(&z, &small) == (size_t)z.most_layers_per_bucket * linear_layer_weight_elems(&small),
          "llama-125m, merged buckets: the transposes' room holds the %d layers of the fullest bucket", z.most_layers_per_bucket);
    zero_plan_init(&z, &a, 1, 3, BUCKET_MIN);
    zero_plan_micro_batches(&z, 1);
    check(!zero_layers_gathered(&z) && zero_layer_gather_bytes(&z, &seven, 1) == 0 && !z.bf16_grad_shard,
          "ZeRO-3 on one rank gathers nothing");
    zero_plan_init(&z, &a, 8, 2, BUCKET_MIN);
    zero_plan_micro_batches(&z, 1);
    check(!zero_layers_gathered(&z) && !z.bf16_grad_shard && zero_grad_shard_bytes(&z) == 4 * z.shard_elems,
          "ZeRO-2 keeps its FP32 gradient shard with one micro-batch too");
}

// ZeRO-3's gathers: the embedding and the tail after the step; the L buckets of layers before the
// first forward, then each forward and backward all but the two the slots hold: L + (2A - 1)(L - 2)
// for A micro-batches; a model whose layers fit in two buckets gathers them once a step.
static void test_stage3_calls(void) {
    ModelShape seven = shape_of(32000, 4096, 32, 32, 32, 11008), tiny = shape_of(512, 64, 2, 4, 2, 128);
    ParamLayout a, b;
    param_layout_init(&a, &seven);
    param_layout_init(&b, &tiny);
    static ZeroPlan z;
    int ok = 1;
    int world_sizes[] = {2, 8, 64, 4096};
    for (size_t w = 0; w < sizeof(world_sizes) / sizeof(world_sizes[0]); w++)
        for (int accum = 1; accum <= 4; accum++) {
            zero_plan_init(&z, &a, world_sizes[w], 3, BUCKET_MIN);
            ZeroCalls bf16 = zero_calls(&z, accum, 0), e4m3 = zero_calls(&z, accum, 1);
            long layer_gathers = 32 + (2L * accum - 1) * 30;
            ok &= bf16.reduce_scatters == 34L * accum && bf16.all_gathers == 2 + layer_gathers && bf16.all_reduces == 1 &&
                  e4m3.all_gathers == 2 + layer_gathers && e4m3.all_reduces == 3;
        }
    check(ok, "llama2-7b, ZeRO-3, 2 to 4096 ranks, 1 to 4 micro-batches A: 34 A reduce-scatters, 2 + 32 + (2A - 1) 30 "
              "all-gathers (64 with one micro-batch), 1 all-reduce (3 with the E4M3 gather)");
    for (int buckets = 1; buckets <= 2; buckets++) {  // tiny's two layers: merged, or a bucket each
        zero_plan_init(&z, &b, 4, 3, buckets == 1 ? BUCKET_MIN : 1);
        ZeroCalls calls = zero_calls(&z, 3, 1);
        check(z.buckets == buckets + 2 && calls.all_gathers == 2 + buckets,
              "tiny, ZeRO-3, %d bucket(s) of layers: gathered once a step (%ld all-gathers)", buckets, calls.all_gathers);
    }
}

// The goals of ZeRO-3 for llama2-70b in coat, micro-batch 1 x 4096: at most 130 GiB per rank on
// 8 ranks and 70 GiB on 64, where stage 2 plans 203 and 132 GiB (every layer's E4M3 weights and
// one layer's transposes, 64.5 GiB on every rank, are what stage 3 shards).
static void test_stage3_70b(void) {
    TrainConfig c = coat_plan_config(shape_of(32000, 8192, 80, 64, 8, 28672), 4096);
    const struct { int ranks; double most_gib; } goals[] = {{8, 130.0}, {64, 70.0}};
    for (size_t i = 0; i < sizeof(goals) / sizeof(goals[0]); i++) {
        MemoryPlan two, three;
        c.zero_stage = 2;
        memory_plan_compute(&two, &c, goals[i].ranks, 1);
        c.zero_stage = 3;
        memory_plan_compute(&three, &c, goals[i].ranks, 1);
        check(gib(three.total_bytes) <= goals[i].most_gib && gib(two.total_bytes) > goals[i].most_gib + 60.0 &&
                  three.gather_bytes > 0 && two.working_bytes - three.working_bytes > (size_t)64 << 30,
              "llama2-70b coat, 1 x 4096, %d ranks: ZeRO-3 plans %.3f GiB per rank (at most %.0f; stage 2 %.3f GiB), the layer "
              "gather %.3f GiB", goals[i].ranks, gib(three.total_bytes), goals[i].most_gib, gib(two.total_bytes),
              gib(three.gather_bytes));
    }
}

// Hybrid sharding (shard_group = N of W ranks): each group plans what a flat run on N ranks plans
// (the same buckets, parts and places; shard index r % N, group r / N), the groups replicas.
static void test_hybrid_plan(void) {
    ModelShape seven = shape_of(32000, 4096, 32, 32, 32, 11008);
    ParamLayout layout;
    param_layout_init(&layout, &seven);
    static ZeroPlan hybrid, flat;
    for (int stage = 1; stage <= 3; stage++) {
        zero_plan_init_groups(&hybrid, &layout, 16, 8, stage, BUCKET_MIN);
        zero_plan_init(&flat, &layout, 8, stage, BUCKET_MIN);
        int same = hybrid.buckets == flat.buckets && hybrid.buffer_elems == flat.buffer_elems &&
                   hybrid.shard_elems == flat.shard_elems && hybrid.largest_bucket_elems == flat.largest_bucket_elems &&
                   hybrid.largest_layer_bucket_elems == flat.largest_layer_bucket_elems;
        for (int b = 0; same && b < flat.buckets; b++)
            same = memcmp(&hybrid.bucket[b], &flat.bucket[b], sizeof(flat.bucket[b])) == 0;
        check(same && hybrid.ranks == 16 && hybrid.shards == 8 && hybrid.groups == 2 && zero_hybrid(&hybrid) &&
                  !zero_hybrid(&flat) && flat.groups == 1 && zero_layers_gathered(&hybrid) == (stage == 3),
              "llama2-7b, ZeRO stage %d, 16 ranks in groups of 8: the buckets, parts and places of a flat plan on 8 ranks "
              "(shards %d, groups %d)", stage, hybrid.shards, hybrid.groups);
    }
    zero_plan_init_groups(&hybrid, &layout, 16, 4, 2, BUCKET_MIN);
    check(zero_shard_index(&hybrid, 11) == 3 && zero_group_of(&hybrid, 11) == 2 && zero_shard_index(&hybrid, 4) == 0 &&
              zero_group_of(&hybrid, 3) == 0,
          "16 ranks in groups of 4: rank 11 holds shard 3 in group 2, rank 4 shard 0, rank 3 is in group 0");
    zero_plan_init_groups(&hybrid, &layout, 16, 16, 1, BUCKET_MIN);
    zero_plan_init(&flat, &layout, 16, 1, BUCKET_MIN);
    check(hybrid.groups == 1 && hybrid.shards == 16 && hybrid.shard_elems == flat.shard_elems,
          "shard_group = the world size is the flat plan");
    zero_plan_init_groups(&hybrid, &layout, 1, 0, 0, BUCKET_MIN);
    check(hybrid.groups == 1 && hybrid.shards == 1 && zero_shard_index(&hybrid, 0) == 0, "one rank: one group of one");
}

// The groupings refused, each with its reason; those that plan.
static void test_hybrid_refusals(void) {
    struct { int ranks, group, stage; const char *reason; } cases[] = {
        {16, 3, 1, "does not divide the 16 ranks"}, {16, 32, 2, "exceeds the 16 rank(s)"}, {4, 8, 3, "exceeds the 4 rank(s)"},
        {16, 1, 1, "= 1 would replicate"},          {16, 8, 0, "zero_stage = 0 shards nothing"},
        {16, 0, 1, NULL}, {16, 16, 1, NULL}, {16, 8, 2, NULL}, {16, 2, 3, NULL}, {16, 16, 0, NULL}, {6, 3, 1, NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char error[160] = "";
        int rc = zero_shard_group_check(cases[i].ranks, cases[i].group, cases[i].stage, error, sizeof(error));
        if (cases[i].reason)
            check(rc == -1 && strstr(error, cases[i].reason) != NULL, "shard_group %d of %d ranks at stage %d refused: "
                  "expected \"%s\", got \"%s\"", cases[i].group, cases[i].ranks, cases[i].stage, cases[i].reason, error);
        else
            check(rc == 0, "shard_group %d of %d ranks at stage %d plans (got: %s)", cases[i].group, cases[i].ranks,
                  cases[i].stage, error);
    }
}

// Hybrid calls and bytes: within the group those of a flat run on N ranks; across the W / N groups
// one all-reduce of each reduce-scatter's part, bytes per a ring simulation over W / N ranks.
static void test_hybrid_calls_and_traffic(void) {
    ModelShape seven = shape_of(32000, 4096, 32, 32, 32, 11008), small = shape_of(1001, 192, 3, 3, 1, 208);
    ParamLayout layout, small_layout;
    param_layout_init(&layout, &seven);
    param_layout_init(&small_layout, &small);
    static ZeroPlan hybrid, flat;
    for (int stage = 1; stage <= 3; stage++)
        for (int e4m3 = 0; e4m3 <= 1; e4m3++) {
            zero_plan_init_groups(&hybrid, &layout, 32, 8, stage, BUCKET_MIN);
            zero_plan_init(&flat, &layout, 8, stage, BUCKET_MIN);
            ZeroCalls h = zero_calls(&hybrid, 4, e4m3), f = zero_calls(&flat, 4, e4m3);
            check(h.reduce_scatters == f.reduce_scatters && h.all_gathers == f.all_gathers && h.all_reduces == f.all_reduces &&
                      h.replica_all_reduces == f.reduce_scatters && f.replica_all_reduces == 0,
                  "llama2-7b, stage %d%s, 32 ranks in groups of 8: %ld reduce-scatters, %ld all-gathers, %ld all-reduces "
                  "within the group (a flat run on 8: %ld, %ld, %ld), %ld all-reduces across the groups",
                  stage, e4m3 ? " e4m3" : "", h.reduce_scatters, h.all_gathers, h.all_reduces, f.reduce_scatters,
                  f.all_gathers, f.all_reduces, h.replica_all_reduces);
        }
    int groupings[][2] = {{4, 2}, {8, 2}, {8, 4}, {12, 3}, {12, 4}};
    for (size_t i = 0; i < sizeof(groupings) / sizeof(groupings[0]); i++) {
        int W = groupings[i][0], N = groupings[i][1], G = W / N;
        size_t k = 3, all_reduce = ring_all_reduce(G, k, 0, 0);
        double per_element = (double)all_reduce / (G * k);
        int ok = all_reduce != (size_t)-1;
        for (int stage = 1; stage <= 3; stage++) {
            zero_plan_init_groups(&hybrid, &small_layout, W, N, stage, 1);
            zero_plan_init(&flat, &small_layout, N, stage, 1);
            ZeroTraffic h = zero_traffic(&hybrid, &small_layout, 4, 1), f = zero_traffic(&flat, &small_layout, 4, 1),
                        none = zero_traffic(&flat, &small_layout, 4, 0);
            double reduces = stage == 1 ? 1.0 : 4.0;
            ok &= h.gradient_bytes == f.gradient_bytes && h.parameter_bytes == f.parameter_bytes &&
                  fabs(h.replica_gradient_bytes - reduces * per_element * 2.0 * hybrid.shard_elems) < 1e-6 &&
                  none.replica_gradient_bytes == 0.0;
        }
        check(ok, "%d ranks in %d groups of %d, stages 1 to 3: within the group the bytes of a flat run on %d; across the "
                  "groups each rank's gradient shard all-reduced (%.3f values sent per element, a ring of %d), per "
                  "micro-batch at stages 2 and 3", W, G, N, N, per_element, G);
    }
}

// Per-rank memory in groups of N is a flat run's on N ranks; the smallest world that fits is N.
static void test_hybrid_memory(void) {
    TrainConfig c = coat_plan_config(shape_of(32000, 4096, 32, 32, 32, 11008), 2048);
    for (int stage = 1; stage <= 3; stage++) {
        MemoryPlan hybrid, flat, wide;
        c.zero_stage = stage;
        c.shard_group = 8;
        memory_plan_compute(&hybrid, &c, 16, 4);
        c.shard_group = 0;
        memory_plan_compute(&flat, &c, 8, 4);
        memory_plan_compute(&wide, &c, 16, 4);
        check(hybrid.total_bytes == flat.total_bytes && hybrid.shard_elems == flat.shard_elems && hybrid.shard_group == 8 &&
                  flat.shard_group == 0 && wide.total_bytes < hybrid.total_bytes,
              "llama2-7b coat, stage %d, 16 ranks in groups of 8: %.3f GiB per rank, a flat run's on 8 (%.3f GiB; flat on 16: "
              "%.3f GiB)", stage, gib(hybrid.total_bytes), gib(flat.total_bytes), gib(wide.total_bytes));
        size_t bytes = 0;
        c.shard_group = 8;
        int fits_hybrid = memory_plan_smallest_ranks(&c, 4, hybrid.total_bytes, &bytes);
        int fits_none = memory_plan_smallest_ranks(&c, 4, hybrid.total_bytes - 1, &bytes);
        check(fits_hybrid == 8 && fits_none == 0, "stage %d, shard_group 8: the fewest ranks that fit are 8 (got %d), none "
              "below the group's plan (got %d)", stage, fits_hybrid, fits_none);
        c.shard_group = 0;
    }
}

int main(void) {
    test_tiling();
    test_linear_weight_parts();
    test_buckets();
    test_calls();
    test_traffic();
    test_memory();
    test_memory_without_bf16_block_weights();
    test_stage3_plan();
    test_stage3_calls();
    test_stage3_70b();
    test_hybrid_plan();
    test_hybrid_refusals();
    test_hybrid_calls_and_traffic();
    test_hybrid_memory();
    return check_summary("test_zero");
}
