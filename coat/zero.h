// ZeRO data parallelism over W ranks (one process per GPU), its host arithmetic: the gradient and
// parameter buckets, the part of each that every rank owns, where they sit in the device buffers
// and in each rank's optimizer state, the collective calls and bytes of a step. The memory plan,
// dry_run, the optimizer, checkpoints and the tests use it; coat/zero.cuh runs it.
// Buckets: runs of neighbouring segments (coat/params.h), each at least min_bucket_elems (the
// config's bucket_min_elems) where the layers allow (small layers are merged, the tail and the
// embedding stand alone), numbered in the parameter order (bucket 0 holds the embedding): bucket
// b is the elements [begin, end) of the parameter order, the order of a checkpoint and of a
// one-rank run.
// Sharding (stages 1 to 3): each bucket is padded to W parts of `part` elements, a multiple of
// 128 (FP8 optimizer groups never straddle a part), and rank r owns part r of every bucket: the
// elements [begin + r part, begin + (r + 1) part) clipped to end. In the device buffers (the BF16
// parameters, which with FP8 GEMMs casting from the master weights hold only the embedding's and
// the tail's buckets, coat/params.h; stage 1's BF16 gradients) a bucket occupies W part elements
// from `at` (zero_params_at in coat/zero.cuh for the parameters), so that one
// reduce-scatter takes a bucket's gradients to their owners and one all-gather brings its
// parameters back: calls per step are the buckets' count plus a constant at any world size. Each
// rank's optimizer state (and its gradient shard) is its parts back to back, part b at state_at.
//   stage 0: every rank holds everything (one part of W = 1); each bucket of the BF16 gradient is
//            all-reduced in the step's last micro-batch.
//   stage 1: in the last micro-batch each bucket is reduce-scattered as backward finishes it into
//            the rank's BF16 gradient shard; after the step each bucket's parameters are
//            all-gathered, overlapping the next forward.
//   stage 2: no rank holds the whole gradient: every micro-batch reduce-scatters each bucket
//            from one of two bucket buffers, and each rank adds its part into an FP32 sum of its
//            shard.
//   stage 3: stage 2, and no rank holds the working weights of every layer either. A bucket of
//            layers is cast by each rank from its FP32 master part (E4M3 codes with FP8 GEMMs,
//            else BF16) and all-gathered into one of ZERO_GATHER_SLOTS slots just before the
//            forward reads it, the next bucket into the other slot meanwhile, and again in the
//            reverse order before backward reads it: the parameters travel twice a step, but for
//            the buckets the two slots still hold (the last two of the forward are backward's
//            first two, backward's last two the next micro-batch's first two). The embedding's
//            and the tail's buckets, and with FP8 GEMMs the layers' norms (the norm table), stay
//            whole on every rank, gathered after the step as at stage 1 (70B: 0.98 GiB, read at
//            the forward's two ends and backward's start). With one micro-batch per step the
//            gradient shard is BF16, the reduce-scatter's sum, which is what stage 2 adds to its
//            FP32 zeros; with several it is stage 2's FP32 sum.
// With one rank, or at stage 0, parts are whole buckets and the buffers are the parameter order.
// Hybrid sharding (shard_group = N, a divisor of W between 2 and W - 1; 0 or W: all W ranks
// shard as above): the ranks form W / N groups of N consecutive ranks (a node, when ranks are
// numbered node by node), each sharding every bucket over its N ranks exactly as above with N in
// place of W, the groups replicas of each other. Rank r holds shard r % N ("its shard index")
// in group r / N. A bucket's gradient is reduce-scattered within the group, then its part
// all-reduced across the W / N ranks that hold the same shard index (the replicas), so that every
// replica holds the sum over all W ranks; parameters are gathered within the group. Per-rank
// memory is that of a flat run on N ranks; the loss and gradient norm are summed over all W
// (the norm over one group's shards, each counted once).
// Bytes sent per rank follow the ring algorithms (NCCL's for large messages): all-reduce of n
// bytes 2 (W - 1) / W n, reduce-scatter and all-gather (W - 1) / W n; within a group N in
// place of W, across the groups W / N.
#pragma once
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include "linears.h"
#include "params.h"

#define ZERO_SCALARS 16  // the most values one collectives_all_reduce_sum_f64 sums (the loss, norm and stop votes)
#define ZERO_SCALAR_BYTES (ZERO_SCALARS * sizeof(double))  // their device room, on every rank of W > 1
#define ZERO_GATHER_SLOTS 2  // stage 3: the bucket of layers the model reads and the next one

typedef struct {
    size_t begin, end;  // elements [begin, end) of the parameter order
} ZeroRange;

typedef struct {
    int ranks, stage;
    int shards;                            // ranks that share each bucket (a group): N at stages 1 to 3, else 1
    int groups;                            // the replicas: W / N at stages 1 to 3, else 1
    int bf16_grad_shard;                   // stage 3 with one micro-batch per step (zero_plan_micro_batches)
    int segments, buckets;
    ParamShardRange bucket[PARAM_SEGMENTS_MAX];  // in the parameter order
    int first_segment[PARAM_SEGMENTS_MAX];  // bucket b holds segments first_segment[b] ..
    int last_segment[PARAM_SEGMENTS_MAX];   // .. last_segment[b] (last_segment >= first_segment)
    int bucket_of[PARAM_SEGMENTS_MAX];      // segment -> bucket
    size_t buffer_elems;                   // the device buffers: every bucket's W parts
    size_t shard_elems;                    // each rank's parts: its optimizer state and gradient shard
    size_t largest_bucket_elems;           // W parts of the largest bucket (stage 2's bucket buffers)
    size_t largest_layer_bucket_elems;     // the same among the buckets of layers (the E4M3 gather's staging)
    int most_layers_per_bucket;            // among the buckets of layers
} ZeroPlan;

// Segment s's elements of the parameter order (coat/params.h numbers them).
static inline ZeroRange zero_segment(const ParamLayout *layout, int s) {
    ZeroRange r = {param_segment_begin(layout, s), param_segment_end(layout, s)};
    return r;
}

static inline int zero_bucket_is_layers(const ZeroPlan *z, int b) {
    return z->first_segment[b] >= 1 && z->last_segment[b] < z->segments - 1;
}

// Buckets in the parameter order: the embedding, the layers from the first (merged from the
// last, as backward reaches them, until each holds min_bucket_elems), the tail.
static inline void zero_plan_buckets(ZeroPlan *z, const ParamLayout *layout, size_t min_bucket_elems) {
    int L = layout->shape.n_layers, S = L + 2, count = 0;
    if (L < 1 || S > PARAM_SEGMENTS_MAX) {  // config.h refuses such shapes first
        fprintf(stderr, "error: zero_plan_init: %d layers, 1 to %d supported\n", L, PARAM_SEGMENTS_MAX - 2);
        exit(EXIT_FAILURE);
    }
    int first[PARAM_SEGMENTS_MAX], last[PARAM_SEGMENTS_MAX];  // in backward's order while built
    first[count] = last[count] = 0, count++;
    for (int s = 1; s <= L; s++) {
        ZeroRange open = {zero_segment(layout, last[count - 1]).begin, zero_segment(layout, first[count - 1]).end};
        int open_is_layers = first[count - 1] >= 1;
        if (open_is_layers && open.end - open.begin < min_bucket_elems) last[count - 1] = s;
        else first[count] = last[count] = s, count++;
    }
    first[count] = last[count] = S - 1, count++;
    z->segments = S;
    z->buckets = count;
    for (int b = 0; b < count; b++) {  // reversed into the parameter order
        z->first_segment[b] = first[count - 1 - b];
        z->last_segment[b] = last[count - 1 - b];
        for (int s = z->first_segment[b]; s <= z->last_segment[b]; s++) z->bucket_of[s] = b;
    }
}

// Why shard_group (0: every rank, flat) cannot group `ranks` at ZeRO stage `stage`: 0, or -1
// with a message that follows the key's name ("= 3 does not divide the 4 ranks").
static inline int zero_shard_group_check(int ranks, int shard_group, int stage, char *error, size_t error_size) {
    if (shard_group == 0 || shard_group == ranks) return 0;
    if (stage == 0)
        snprintf(error, error_size, "= %d groups the ranks that shard the states, but zero_stage = 0 shards nothing", shard_group);
    else if (shard_group > ranks)
        snprintf(error, error_size, "= %d exceeds the %d rank(s): a group is at most every rank", shard_group, ranks);
    else if (ranks % shard_group != 0)
        snprintf(error, error_size, "= %d does not divide the %d ranks into groups of equal size", shard_group, ranks);
    else if (shard_group == 1)
        snprintf(error, error_size, "= 1 would replicate every state on every rank: that is zero_stage = 0");
    else
        return 0;
    return -1;
}

// The plan over `ranks` at `stage`, sharded within groups of shard_group consecutive ranks (0 or
// ranks: one group of every rank, flat); config validation refuses a grouping that
// zero_shard_group_check refuses first.
static inline void zero_plan_init_groups(ZeroPlan *z, const ParamLayout *layout, int ranks, int shard_group, int stage,
                                         size_t min_bucket_elems) {
    char error[160];
    if (ranks > 1 && zero_shard_group_check(ranks, shard_group, stage, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: zero_plan_init: shard_group %s\n", error);
        exit(EXIT_FAILURE);
    }
    int group = shard_group > 0 ? shard_group : ranks;
    z->ranks = ranks;
    z->stage = stage;
    z->shards = stage >= 1 ? group : 1;
    z->groups = stage >= 1 ? ranks / group : 1;
    z->bf16_grad_shard = 0;
    zero_plan_buckets(z, layout, min_bucket_elems);
    size_t at = 0, state_at = 0;
    z->largest_bucket_elems = z->largest_layer_bucket_elems = 0;
    z->most_layers_per_bucket = 0;
    for (int b = 0; b < z->buckets; b++) {
        ParamShardRange *r = &z->bucket[b];
        r->begin = zero_segment(layout, z->last_segment[b]).begin;
        r->end = zero_segment(layout, z->first_segment[b]).end;
        r->part = round_up_size((r->end - r->begin + (size_t)z->shards - 1) / (size_t)z->shards, PARAM_ALIGN_ELEMS);
        r->at = at;
        r->state_at = state_at;
        size_t padded = (size_t)z->shards * r->part;
        at += padded;
        state_at += r->part;
        if (padded > z->largest_bucket_elems) z->largest_bucket_elems = padded;
        if (!zero_bucket_is_layers(z, b)) continue;
        if (padded > z->largest_layer_bucket_elems) z->largest_layer_bucket_elems = padded;
        int layers = z->last_segment[b] - z->first_segment[b] + 1;
        if (layers > z->most_layers_per_bucket) z->most_layers_per_bucket = layers;
    }
    z->buffer_elems = at;
    z->shard_elems = state_at;
}

// Flat: every rank in one group.
static inline void zero_plan_init(ZeroPlan *z, const ParamLayout *layout, int ranks, int stage, size_t min_bucket_elems) {
    zero_plan_init_groups(z, layout, ranks, 0, stage, min_bucket_elems);
}

// Hybrid: the groups replicate each other (more than one group of sharding ranks).
static inline int zero_hybrid(const ZeroPlan *z) { return z->groups > 1; }

// Rank `rank`'s shard index (the part of every bucket it owns) and its group.
static inline int zero_shard_index(const ZeroPlan *z, int rank) { return z->shards > 1 ? rank % z->shards : 0; }
static inline int zero_group_of(const ZeroPlan *z, int rank) { return z->shards > 1 ? rank / z->shards : 0; }

// The layout's device buffers as the plan pads them: each segment where its bucket puts it.
static inline void zero_place_segments(const ZeroPlan *z, ParamLayout *layout) {
    for (int s = 0; s < z->segments; s++) {
        const ParamShardRange *r = &z->bucket[z->bucket_of[s]];
        layout->segment_at[s] = r->at + (param_segment_begin(layout, s) - r->begin);
    }
    layout->buffer_elems = z->buffer_elems;
}

// The model's layout with its segments where the plan puts them in the device buffers.
static inline void zero_model_layout(const ZeroPlan *z, const ModelShape *shape, ParamLayout *layout) {
    param_layout_init(layout, shape);
    zero_place_segments(z, layout);
}

// Stage 3 over several ranks: the buckets of layers are gathered a bucket at a time (their
// working weights, BF16 or E4M3, are in no buffer of the model).
static inline int zero_layers_gathered(const ZeroPlan *z) { return z->stage == 3 && z->shards > 1; }

// The step's micro-batches per rank: stage 3 keeps its gradient shard in BF16 when there is one.
static inline void zero_plan_micro_batches(ZeroPlan *z, int micro_batches) {
    z->bf16_grad_shard = zero_layers_gathered(z) && micro_batches == 1;
}

// The model's gradient buffer: stage 2's and 3's two bucket buffers, else the whole buffers.
static inline size_t zero_grads_elems(const ZeroPlan *z) {
    return z->stage >= 2 ? 2 * z->largest_bucket_elems : z->buffer_elems;
}

// The rank's gradient shard, its parts back to back: stage 1's BF16 sum, stage 2's FP32 sum over
// the micro-batches, stage 3's either (BF16 with one micro-batch per step); none at stage 0.
static inline size_t zero_grad_shard_bytes(const ZeroPlan *z) {
    if (z->stage == 0) return 0;
    return (z->stage == 1 || z->bf16_grad_shard ? 2 : 4) * z->shard_elems;
}

// Stage 3's gather slots, each the largest bucket of layers as W parts (E4M3: a byte per element,
// the linear weights' codes at their elements' places; else BF16), and with E4M3 the room where
// backward remakes the transposes of the bucket it reads (FP8 GEMMs read W^T there): the linear
// weights of the most layers a bucket holds.
static inline size_t zero_layer_slot_bytes(const ZeroPlan *z, int e4m3) {
    return (e4m3 ? 1 : 2) * z->largest_layer_bucket_elems;
}
static inline size_t zero_layer_transposes_bytes(const ZeroPlan *z, const ModelShape *shape) {
    return (size_t)z->most_layers_per_bucket * linear_layer_weight_elems(shape);
}
static inline size_t zero_layer_gather_bytes(const ZeroPlan *z, const ModelShape *shape, int e4m3) {
    if (!zero_layers_gathered(z)) return 0;
    return ZERO_GATHER_SLOTS * zero_layer_slot_bytes(z, e4m3) + (e4m3 ? zero_layer_transposes_bytes(z, shape) : 0);
}

// Rank `rank`'s part of bucket b in the parameter order (empty where the padding begins before it).
static inline ZeroRange zero_owned(const ZeroPlan *z, int b, int rank) {
    ZeroRange owned;
    param_shard_part(&z->bucket[b], rank, &owned.begin, &owned.end);
    return owned;
}

// The elements of tensor `kind` of `layer` in the parameter order.
static inline ZeroRange zero_tensor_range(const ParamLayout *layout, ParamKind kind, int layer) {
    size_t begin = param_offset(layout, kind, layer);
    ZeroRange r = {begin, begin + param_numel(layout, kind)};
    return r;
}

// Linear layer `which`'s weights in `layer`: its weights lie back to back (coat/linears.h), so
// wq|wk|wv and w_gate|w_up are each one range, what the fused GEMM reads and the E4M3 gather casts.
static inline ZeroRange zero_linear_range(const ParamLayout *layout, Linear which, int layer) {
    LinearInfo info = linear_info(which);
    ZeroRange r = zero_tensor_range(layout, info.first_weight, layer);
    for (int k = (int)info.first_weight + 1; k <= (int)info.last_weight; k++) r.end += param_numel(layout, (ParamKind)k);
    return r;
}

// The elements in both ranges (empty: begin == end).
static inline ZeroRange zero_intersection(ZeroRange a, ZeroRange b) {
    ZeroRange r = {a.begin > b.begin ? a.begin : b.begin, a.end < b.end ? a.end : b.end};
    if (r.end < r.begin) r.end = r.begin;
    return r;
}

// The E4M3 gather (stages 1 to 3 with FP8 GEMMs): each bucket of layers travels as one byte per
// element (the linear weights' E4M3 codes, at their elements' places) through a staging buffer of
// the largest such bucket (stage 3: its gather slots), and the layers' norms, which stay BF16, in
// the model's norm table (coat/params.h) that the owners fill and one all-reduce sums (each
// element has one owner, the others add zeros).
static inline size_t zero_e4m3_gather_bytes(const ZeroPlan *z) {
    return zero_layers_gathered(z) ? 0 : z->largest_layer_bucket_elems;
}

// Stage 3's gathers of buckets of layers in a step of `accum_steps` micro-batches, as
// coat/zero.cuh issues them: every bucket before the first forward (the step changed them all),
// then each forward and each backward all but the two the slots still hold (a forward's first
// two, buckets 1 and 2, and a backward's first two, the last two): *calls gathers of `elems`
// elements (W parts each) in all.
static inline void zero_layer_gathers(const ZeroPlan *z, int accum_steps, long *calls, double *elems) {
    int last = z->buckets - 2;  // the buckets of layers are 1 .. last
    *calls = 0;
    *elems = 0.0;
    for (int b = 1; b <= last; b++) {
        long times = 1 + (b > 2 ? accum_steps - 1 : 0) + (b < last - 1 ? accum_steps : 0);
        *calls += times;
        *elems += (double)times * z->shards * z->bucket[b].part;
    }
}

// The collective calls of one step as coat/zero.cuh issues them (stages 2 and 3 reduce every
// micro-batch).
typedef struct {
    long all_reduces, reduce_scatters, all_gathers;  // over all ranks (hybrid: but the loss's, within the group)
    long replica_all_reduces;                        // hybrid: across the groups, each gradient part's sum
} ZeroCalls;

static inline ZeroCalls zero_calls(const ZeroPlan *z, int accum_steps, int e4m3_gather) {
    ZeroCalls calls = {1, 0, 0, 0};  // the loss and gradient norm
    if (z->ranks <= 1) {
        calls.all_reduces = 0;
        return calls;
    }
    if (z->stage == 0) {
        calls.all_reduces += z->buckets;
        return calls;
    }
    calls.reduce_scatters = (long)z->buckets * (z->stage >= 2 ? accum_steps : 1);
    calls.all_gathers = z->buckets;
    if (zero_layers_gathered(z)) {
        double elems;
        zero_layer_gathers(z, accum_steps, &calls.all_gathers, &elems);
        calls.all_gathers += 2;  // the embedding's and the tail's after the step
    }
    if (e4m3_gather) calls.all_reduces += 2;  // the scale table's max, the norm table's sum
    if (zero_hybrid(z)) calls.replica_all_reduces = calls.reduce_scatters;
    return calls;
}

// Bytes one rank sends in one optimizer step of `accum_steps` micro-batches. Parameters travel as
// BF16, or with the E4M3 gather the buckets of layers as a byte per element and their norms in
// the norm table's all-reduce.
typedef struct {
    double gradient_bytes;   // all-reduce (stage 0), reduce-scatters once (1) or per micro-batch (2, 3)
    double parameter_bytes;  // the gather after the step (stages 1 and 2); stage 3's gathers of the layers too
    double replica_gradient_bytes;  // hybrid, across the groups: the gradient parts' all-reduces
} ZeroTraffic;

static inline ZeroTraffic zero_traffic(const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int e4m3_gather) {
    ZeroTraffic t = {0.0, 0.0, 0.0};
    if (z->ranks <= 1) return t;
    double share = (double)(z->ranks - 1) / z->ranks, gradient = 2.0 * (double)z->buffer_elems;
    if (z->stage == 0) {
        t.gradient_bytes = 2.0 * share * gradient;
        return t;
    }
    int reduces = z->stage >= 2 ? accum_steps : 1;
    share = (double)(z->shards - 1) / z->shards;  // within the group
    t.gradient_bytes = share * gradient * reduces;
    t.replica_gradient_bytes = 2.0 * (double)(z->groups - 1) / z->groups * 2.0 * (double)z->shard_elems * reduces;
    double layers = 0.0, gathered = 0.0;  // the buckets of layers' elements, and those gathered in a step
    for (int b = 0; b < z->buckets; b++)
        if (zero_bucket_is_layers(z, b)) layers += (double)z->shards * z->bucket[b].part;
    gathered = layers;
    if (zero_layers_gathered(z)) {
        long calls;
        zero_layer_gathers(z, accum_steps, &calls, &gathered);
    }
    double others = (double)z->buffer_elems - layers;
    if (!e4m3_gather) {
        t.parameter_bytes = share * 2.0 * (others + gathered);
        return t;
    }
    t.parameter_bytes = share * (2.0 * others + gathered) + 2.0 * share * 2.0 * (double)param_norm_table_elems(layout);
    return t;
}

// Stage 3's gather slots and gradient shard, a line of dry_run's plan.
static inline void zero_print_layer_slots(FILE *out, const ZeroPlan *z) {
    if (!zero_layers_gathered(z)) return;
    fprintf(out, "ZeRO stage 3: the buckets of layers gathered into %d slots of %zu elements, the gradient shard %s\n",
            ZERO_GATHER_SLOTS, z->largest_layer_bucket_elems,
            z->bf16_grad_shard ? "bf16 (one micro-batch per step)" : "fp32 (summed over the micro-batches)");
}

// dry_run's line of the bytes one rank sends per step through the buckets' reduce-scatters and
// all-gathers (`scope`: "" flat, " within the group" hybrid); fp8: the traffic with the block
// weights gathered in E4M3 (NULL without FP8 GEMMs).
static inline void zero_print_sent(FILE *out, const ZeroPlan *z, int accum_steps, const char *scope, const ZeroTraffic *bf16,
                                   const ZeroTraffic *fp8, int e4m3) {
    fprintf(out, "sent per rank and step (%d accumulation step(s))%s: gradients %.3f GB (%s), parameters %.3f GB "
                 "(all-gather, bf16)",
            accum_steps, scope, bf16->gradient_bytes / 1e9, z->stage == 1 ? "reduce-scatters" : "reduce-scatters, per micro-batch",
            bf16->parameter_bytes / 1e9);
    if (fp8) fprintf(out, "; %.3f GB with the block weights gathered in e4m3", fp8->parameter_bytes / 1e9);
    fprintf(out, "; this run gathers %s\n", e4m3 ? "e4m3" : "bf16");
}

// dry_run's summary of the sharding and of what each rank sends per step (GB = 1e9 bytes).
static inline void zero_print_flat(FILE *out, const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int fp8_gemms,
                                   int e4m3) {
    ZeroCalls calls = zero_calls(z, accum_steps, e4m3);
    if (z->stage == 0)
        fprintf(out, "collective calls per step: 0 reduce-scatters, 0 all-gathers, %ld all-reduces (one per gradient "
                     "bucket, the loss and gradient norm)\n", calls.all_reduces);
    else
        fprintf(out, "collective calls per step: %ld reduce-scatters (gradients: one per bucket%s), %ld all-gathers "
                     "(parameters, %s: %s), %ld all-reduces (the loss and gradient norm%s)\n",
                calls.reduce_scatters, z->stage >= 2 ? " and micro-batch" : "", calls.all_gathers, e4m3 ? "e4m3" : "bf16",
                zero_layers_gathered(z) ? "the embedding and the tail after the step, the buckets of layers before each "
                                          "forward and backward but those the two slots hold"
                                        : "one per bucket",
                calls.all_reduces, e4m3 ? ", the E4M3 scale table's max, the norm table's sum" : "");
    ZeroTraffic bf16 = zero_traffic(z, layout, accum_steps, 0), fp8 = zero_traffic(z, layout, accum_steps, 1);
    if (z->stage == 0) {
        fprintf(out, "ZeRO stage 0 over %d ranks: every rank holds all %zu elements; %d gradient buckets\n", z->ranks,
                z->buffer_elems, z->buckets);
        fprintf(out, "sent per rank and step (%d accumulation step(s)): gradients %.3f GB (all-reduce)\n", accum_steps,
                bf16.gradient_bytes / 1e9);
        return;
    }
    fprintf(out, "ZeRO stage %d over %d ranks: %zu elements per rank's optimizer (1/%d of each of %d buckets, the "
                 "buffers padded to %zu); the largest bucket %zu elements\n",
            z->stage, z->ranks, z->shard_elems, z->shards, z->buckets, z->buffer_elems, z->largest_bucket_elems);
    zero_print_layer_slots(out, z);
    zero_print_sent(out, z, accum_steps, "", &bf16, fp8_gemms ? &fp8 : NULL, e4m3);
}

// Hybrid: the same within a group, then what crosses the groups.
static inline void zero_print_hybrid(FILE *out, const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int fp8_gemms,
                                     int e4m3) {
    ZeroCalls calls = zero_calls(z, accum_steps, e4m3);
    ZeroTraffic bf16 = zero_traffic(z, layout, accum_steps, 0), fp8 = zero_traffic(z, layout, accum_steps, 1);
    const char *per = z->stage >= 2 ? " and micro-batch" : "";
    fprintf(out, "ZeRO stage %d over %d ranks in %d groups of %d (shard_group %d): %zu elements per rank's optimizer (1/%d "
                 "of each of %d buckets, the buffers padded to %zu), the groups replicas; the largest bucket %zu elements\n",
            z->stage, z->ranks, z->groups, z->shards, z->shards, z->shard_elems, z->shards, z->buckets, z->buffer_elems,
            z->largest_bucket_elems);
    zero_print_layer_slots(out, z);
    fprintf(out, "collective calls per step within a group of %d: %ld reduce-scatters (gradients: one per bucket%s), %ld "
                 "all-gathers (parameters, %s: %s), %ld all-reduces%s\n",
            z->shards, calls.reduce_scatters, per, calls.all_gathers, e4m3 ? "e4m3" : "bf16",
            zero_layers_gathered(z) ? "the embedding and the tail after the step, the buckets of layers before each "
                                      "forward and backward but those the two slots hold"
                                    : "one per bucket",
            calls.all_reduces - 1, e4m3 ? " (the E4M3 scale table's max, the norm table's sum)" : "");
    fprintf(out, "collective calls per step across the %d groups: %ld all-reduces (each bucket's gradient part%s, among "
                 "the ranks of its shard index); over all %d ranks: 1 all-reduce (the loss and gradient norm)\n",
            z->groups, calls.replica_all_reduces, per, z->ranks);
    zero_print_sent(out, z, accum_steps, " within the group", &bf16, fp8_gemms ? &fp8 : NULL, e4m3);
    fprintf(out, "sent per rank and step (%d accumulation step(s)) across the groups: gradients %.3f GB (all-reduces of "
                 "the gradient parts%s)\n",
            accum_steps, bf16.replica_gradient_bytes / 1e9, z->stage == 1 ? "" : ", per micro-batch");
}

static inline void zero_print(FILE *out, const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int fp8_gemms,
                              int e4m3_gather) {
    if (z->ranks <= 1) return;
    int e4m3 = z->stage >= 1 && fp8_gemms && e4m3_gather;
    if (zero_hybrid(z)) zero_print_hybrid(out, z, layout, accum_steps, fp8_gemms, e4m3);
    else zero_print_flat(out, z, layout, accum_steps, fp8_gemms, e4m3);
}
