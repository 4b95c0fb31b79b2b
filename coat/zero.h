// ZeRO sharding over W ranks (one process per GPU): which part of the parameter buffer each rank
// owns, the gradient buckets of stage 2 and what each rank sends per optimizer step. Host
// arithmetic only (the memory plan, dry_run and the tests use it).
//   stage 0: every rank holds everything; the BF16 gradients are all-reduced once per step.
//   stage 1: rank r owns elements [r S, (r + 1) S) of the parameter buffer padded to W S, S a
//            multiple of 128 (FP8 groups never straddle shards, as they never straddle tensors):
//            its FP32 master weights and optimizer states; in the step's last micro-batch each
//            gradient bucket is reduced to the ranks that own its parts as backward finishes it
//            (the bytes of a reduce-scatter), and after the step each bucket's parameters are
//            broadcast from the owners of its parts (the bytes of an all-gather) while the next
//            forward runs.
//   stage 2: no rank holds the whole gradient either: during backward each bucket (the lm_head
//            with the final norm, then each layer from the last, then the embedding: the order in
//            which backward completes them) is reduced as soon as it is done, straight to the
//            ranks that own its parts (one reduce per owner segment, grouped), and each owner adds
//            its part into an FP32 accumulator of its shard. Every micro-batch sends its gradient.
// Buckets go to their owners, rather than each rank taking a slice of every bucket: the optimizer
// keeps one contiguous shard (coat/optimizer.cuh's step as it is), the shards of a checkpoint
// concatenate into the one buffer, and a bucket costs each rank the bytes of a reduce-scatter of it.
// Bytes sent per rank follow the ring algorithms (NCCL's for large messages): all-reduce of n bytes
// 2 (W - 1) / W n, reduce-scatter and all-gather (W - 1) / W n.
#pragma once
#include <stddef.h>
#include <stdio.h>
#include "linears.h"
#include "params.h"

#define ZERO_SCALARS 16  // the most values one zero_all_reduce_sum_f64 (coat/zero.cuh) sums
#define ZERO_SCALAR_BYTES (ZERO_SCALARS * sizeof(double))  // their device room, on every rank of W > 1

typedef struct {
    size_t begin, end;  // elements [begin, end) of the parameter buffer
} ZeroRange;

typedef struct {
    int ranks, stage;
    size_t shard_elems;           // S: a multiple of 128
    size_t padded_elems;          // W S >= the layout's total_padded (the tail is zeros)
    int buckets;                  // stage 2's gradient buckets: n_layers + 2
    size_t largest_bucket_elems;  // the bucket buffer's size
} ZeroPlan;

static inline size_t zero_shard_elems(size_t total_padded, int ranks) {
    return round_up_size((total_padded + (size_t)ranks - 1) / (size_t)ranks, PARAM_ALIGN_ELEMS);
}

static inline ZeroRange zero_shard(const ZeroPlan *z, int rank) {
    ZeroRange r = {(size_t)rank * z->shard_elems, (size_t)(rank + 1) * z->shard_elems};
    return r;
}

// Bucket b (0 first) in the order backward completes them: the tail (final norm, lm_head), the
// layers from the last to the first, the embedding.
static inline ZeroRange zero_bucket(const ParamLayout *layout, int b) {
    int layers = layout->shape.n_layers;
    ZeroRange r;
    if (b == 0) {
        r.begin = layout->tail_offset[PARAM_FINAL_NORM];
        r.end = layout->total_padded;
    } else if (b <= layers) {
        r.begin = layout->first_layer_offset + (size_t)(layers - b) * layout->layer_stride;
        r.end = r.begin + layout->layer_stride;
    } else {
        r.begin = 0;
        r.end = layout->first_layer_offset;
    }
    return r;
}

// The bucket that holds tensor `kind` of `layer` (the inverse of zero_bucket).
static inline int zero_bucket_of(const ParamLayout *layout, ParamKind kind, int layer) {
    if (kind == PARAM_EMBEDDING) return layout->shape.n_layers + 1;
    if (!param_kind_is_per_layer(kind)) return 0;
    return layout->shape.n_layers - layer;
}

static inline void zero_plan_init(ZeroPlan *z, const ParamLayout *layout, int ranks, int stage) {
    z->ranks = ranks;
    z->stage = stage;
    z->shard_elems = stage >= 1 ? zero_shard_elems(layout->total_padded, ranks) : layout->total_padded;
    z->padded_elems = stage >= 1 ? (size_t)ranks * z->shard_elems : layout->total_padded;
    z->buckets = layout->shape.n_layers + 2;
    z->largest_bucket_elems = 0;
    for (int b = 0; b < z->buckets; b++) {
        ZeroRange r = zero_bucket(layout, b);
        if (r.end - r.begin > z->largest_bucket_elems) z->largest_bucket_elems = r.end - r.begin;
    }
}

// The elements of tensor `kind` of `layer` in the parameter buffer.
static inline ZeroRange zero_tensor_range(const ParamLayout *layout, ParamKind kind, int layer) {
    size_t begin = param_offset(layout, kind, layer);
    ZeroRange r = {begin, begin + param_numel(layout, kind)};
    return r;
}

// Linear layer `which`'s weights in `layer`: its weights lie back to back (coat/linears.h), so
// wq|wk|wv and w_gate|w_up are each one range, what the fused GEMM reads and the E4M3 gather sends.
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

// The part of `range` that rank `rank` owns.
static inline ZeroRange zero_owned_part(const ZeroPlan *z, ZeroRange range, int rank) {
    return zero_intersection(range, zero_shard(z, rank));
}

// Bytes one rank sends in one optimizer step of `accum_steps` micro-batches. Parameters travel as
// BF16, or with fp8_weights the block linears' weights as E4M3 (a scale per tensor beside them,
// not counted) and the embedding, norms and lm_head as BF16.
typedef struct {
    double gradient_bytes;   // all-reduce (stage 0), per-bucket reduces once (1) or per micro-batch (2)
    double parameter_bytes;  // the gather after the step (stages 1 and 2), the bytes of an all-gather
} ZeroTraffic;

static inline size_t zero_block_linear_elems(const ParamLayout *layout) {
    size_t per_layer = 0;
    for (int i = 0; i < LINEARS; i++)
        for (int k = linear_info((Linear)i).first_weight; k <= (int)linear_info((Linear)i).last_weight; k++)
            per_layer += layout->padded[k];
    return per_layer * (size_t)layout->shape.n_layers;
}

static inline ZeroTraffic zero_traffic(const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int fp8_weights) {
    ZeroTraffic t = {0.0, 0.0};
    if (z->ranks <= 1) return t;
    double share = (double)(z->ranks - 1) / z->ranks, gradient = 2.0 * (double)z->padded_elems;
    if (z->stage == 0) {
        t.gradient_bytes = 2.0 * share * gradient;
        return t;
    }
    t.gradient_bytes = share * gradient * (z->stage == 2 ? accum_steps : 1);
    double fp8_elems = fp8_weights ? (double)zero_block_linear_elems(layout) : 0.0;
    t.parameter_bytes = share * (2.0 * ((double)z->padded_elems - fp8_elems) + fp8_elems);
    return t;
}

// dry_run's summary of the sharding and of what each rank sends per step (GB = 1e9 bytes).
static inline void zero_print(FILE *out, const ZeroPlan *z, const ParamLayout *layout, int accum_steps, int fp8_gemms,
                              int e4m3_gather) {
    if (z->ranks <= 1) return;
    {   // The collective calls of one step as train_llama.cu issues them: zero_reduce_bucket makes one
        // reduce per bucket and owner segment (every micro-batch at stage 2), zero_broadcast_parts one
        // broadcast per owner segment of each range gather_bucket sends (a bucket; with the E4M3
        // gather a layer's linear weights, zero_linear_range, and its 2 norms); the all-reduces:
        // stage 0's one per bucket, the loss and norm's, the E4M3 scale table's max.
        int L = layout->shape.n_layers, e4m3 = z->stage >= 1 && fp8_gemms && e4m3_gather;
        long reduces = 0, broadcasts = 0;
        for (int b = 0; z->stage >= 1 && b < z->buckets; b++) {
            ZeroRange ranges[LINEARS + 2] = {zero_bucket(layout, b)};
            int n = e4m3 && b >= 1 && b <= L ? LINEARS + 2 : 1;
            for (int i = 0; n > 1 && i < LINEARS; i++) ranges[i] = zero_linear_range(layout, (Linear)i, L - b);
            if (n > 1) {
                ranges[LINEARS] = zero_tensor_range(layout, PARAM_ATTN_NORM, L - b);
                ranges[LINEARS + 1] = zero_tensor_range(layout, PARAM_MLP_NORM, L - b);
            }
            for (int r = 0; r < z->ranks; r++) {
                ZeroRange part = zero_owned_part(z, zero_bucket(layout, b), r);
                if (part.end > part.begin) reduces += z->stage == 2 ? accum_steps : 1;
                for (int i = 0; i < n; i++) {
                    part = zero_owned_part(z, ranges[i], r);
                    if (part.end > part.begin) broadcasts++;
                }
            }
        }
        if (z->stage == 0)
            fprintf(out, "collective calls per step: 0 reduces, 0 broadcasts, %d all-reduces (one per gradient bucket, the "
                         "loss and gradient norm)\n", z->buckets + 1);
        else
            fprintf(out, "collective calls per step: %ld reduces (gradients: one per bucket and owner segment%s), %ld "
                         "broadcasts (parameters, %s: one per owner segment of each %s), %d all-reduces (the loss and "
                         "gradient norm%s)\n",
                    reduces, z->stage == 2 ? ", per micro-batch" : "", broadcasts, e4m3 ? "e4m3" : "bf16",
                    e4m3 ? "bucket or, in the layers, each linear weight and norm" : "bucket", 1 + e4m3,
                    e4m3 ? ", the E4M3 scale table's max" : "");
    }
    ZeroTraffic bf16 = zero_traffic(z, layout, accum_steps, 0), fp8 = zero_traffic(z, layout, accum_steps, 1);
    if (z->stage == 0) {
        fprintf(out, "ZeRO stage 0 over %d ranks: every rank holds all %zu elements\n", z->ranks, z->padded_elems);
        fprintf(out, "sent per rank and step (%d accumulation step(s)): gradients %.3f GB (all-reduce)\n", accum_steps,
                bf16.gradient_bytes / 1e9);
        return;
    }
    fprintf(out, "ZeRO stage %d over %d ranks: %zu elements per rank's optimizer (the buffer padded to %zu); "
                 "%d gradient buckets, the largest %zu elements\n",
            z->stage, z->ranks, z->shard_elems, z->padded_elems, z->buckets, z->largest_bucket_elems);
    fprintf(out, "sent per rank and step (%d accumulation step(s)): gradients %.3f GB (%s), parameters %.3f GB "
                 "(all-gather, bf16)",
            accum_steps, bf16.gradient_bytes / 1e9, z->stage == 1 ? "reduces to the owners, per bucket" : "reduces to the owners, per bucket and micro-batch",
            bf16.parameter_bytes / 1e9);
    if (fp8_gemms) fprintf(out, "; %.3f GB with the block weights gathered in e4m3", fp8.parameter_bytes / 1e9);
    fprintf(out, "; this run gathers %s\n", e4m3_gather ? "e4m3" : "bf16");
}
