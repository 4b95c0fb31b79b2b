// Data parallelism's one home: the ZeRO plan of coat/zero.h run on the GPU over the collectives
// of coat/collectives.cuh, behind a few calls that the trainer makes and the model's hooks.
//   zero_model_layout / zero_grads_elems   the device buffers the model allocates for the plan
//   / zero_layers_gathered                 (stage 3: none for the layers' working weights)
//   zero_attach                            the collectives, the hooks on the model, this rank's buffers
//   zero_step_begin, zero_micro_batch      the gradient accumulators zeroed; which micro-batch reduces
//   zero_gradients_done                    the compute stream waits for the gradients' reduces
//   zero_optimizer_ranges                  the buckets as the optimizer steps them (where their BF16 is)
//   zero_weights_amax_parts / _reset       where the optimizer's step gathers the FP8 weights' amax
//   zero_gather_params                     after the optimizer stepped this rank's parts of the parameters
// Backward (the hooks): as backward finishes the last segment of a bucket, the bucket's gradient
// is all-reduced (stage 0) or reduce-scattered (stages 1 to 3) on the collectives' stream while
// backward goes on. Stage 0 and 1 reduce in the step's last micro-batch (the others accumulate in
// BF16, as on one rank); stage 1 into this rank's BF16 gradient shard, its parts back to back;
// stage 2 in every micro-batch, from one of two bucket buffers (backward writes bucket b into
// buffer b % 2, once the reduce of bucket b + 2 is done with it), each rank adding its part into
// the FP32 sum of its shard.
// Forward: after the step each bucket's parameters are all-gathered, in the order the forward
// reads them; the forward waits for each bucket just before its first read (`ready`), so the gather
// overlaps it. Weights from the master (FP8 GEMMs with param_gather e4m3, at any stage and world
// size): no rank holds the block's linear weights in BF16. After the step each rank casts its
// parts of them from its FP32 master weights, rounded to BF16 in registers, to the codes the FP8
// GEMMs read, with each weight's amax over all ranks, and writes its parts of the layers' norms
// (BF16) into the model's norm table. Sharded (stages 1, 2 over several ranks): one max
// all-reduce of the scale table, then each bucket of layers travels as one byte per element
// through a staging buffer, from which every rank copies each weight's codes into its place, the
// norm table's all-reduce sums the owners' norms; otherwise the rank owns everything and casts
// each weight in one pass. Every rank ends with the codes and scales that model_cast_weights
// gives from the BF16 weights, bit for bit; backward remakes each layer's transposes from them.
// Stage 3 (coat/zero.h): after the step only the embedding's and the tail's buckets (and with
// E4M3 the scale table's max and the norm table) are gathered. A bucket of layers is gathered
// when the forward's `ready` reaches it, into one of two slots, the next bucket into the other
// slot meanwhile, and again when backward's `ready_backward` reaches it, the bucket before it
// meanwhile (the hooks `layer_param` and `fp8_weight` tell the model where its weights are): each
// rank casts its part from its master weights on the collectives' stream, as above (E4M3 codes,
// or BF16 rounded as a step writes them), and one all-gather fills the slot, from which the
// forward's FP8 GEMMs read W and in which backward remakes the bucket's transposes into one room
// (BF16: every layer tensor is read in the slot). A slot is overwritten only by a gather that
// waits for every kernel queued on the compute stream so far, so never before the kernels that
// read its bucket are done; the compute stream waits for a slot's gather before it reads it. The
// slots keep what they hold until the step changes the weights: the buckets the forward ends with
// are backward's first, and those backward ends with the next micro-batch's first.
// Hybrid sharding (coat/zero.h, shard_group): all of the above runs on the group's collectives
// (a split of every rank's, numbered by shard index, on the same stream), and each reduce-scatter
// of a gradient bucket is followed on that stream by the all-reduce of this rank's part across the
// groups (the replicas' split), before anything reads or reuses the part; the loss, the norm and
// the checkpoints' transfers stay on every rank's collectives.
#pragma once
#include "collectives_mpi.cuh"
#include "collectives_nccl.cuh"
#include "model.cuh"
#include "optimizer.cuh"
#include "zero.h"

typedef struct {
    ZeroPlan plan;
    const Comm *comm;
    Collectives collectives;        // world > 1: every rank's (the loss, norm and checkpoints; flat: the buckets too)
    Comm group_comm, replica_comm;  // hybrid: this rank's group, the ranks of its shard index
    Collectives group, replicas;    // hybrid: the buckets' collectives, the gradient parts' sums across the groups
    Collectives *buckets;           // where the buckets travel: the group's (hybrid), else every rank's
    LlamaModel *model;
    cudaStream_t compute;           // the model's stream
    BucketHooks hooks;
    int e4m3_gather;
    int last_micro_batch;           // stages 0 and 1 reduce in the last micro-batch of a step only
    bf16 *grad_shard;               // stage 1: this rank's parts of the gradient, summed over the ranks
    float *grad_sum;                // stage 2: their FP32 sum over the micro-batches
    cudaEvent_t bucket_free[2];     // stage 2: a bucket buffer's reduce is done with it
    cudaEvent_t *params_gathered;   // stages 1 to 3: per bucket, its gather after the step is done
    unsigned char *gathering;       // per bucket: the forward has yet to wait for its gather
    uint8_t *e4m3_staging;          // the E4M3 gather at stages 1, 2: a bucket of layers' codes
    const float *master;            // stage 3: the optimizer's master weights (this rank's parts), gathers cast from them
    char *layer_slots;              // stage 3: ZERO_GATHER_SLOTS slots of slot_bytes, each a bucket of layers
    size_t slot_bytes;
    int slot_bucket[ZERO_GATHER_SLOTS];            // the bucket a slot holds for the present weights, -1: none
    cudaEvent_t slot_gathered[ZERO_GATHER_SLOTS];  // a slot's last gather is done
    uint8_t *layer_transposes;      // stage 3 with E4M3: the W^T of the bucket backward reads, layer by layer
    size_t allocated_bytes;         // device memory allocated here (the memory plan's)
} Zero;

// The one place that picks a backend.
static inline int zero_open_collectives(Collectives *c, const Comm *comm, CollectivesBackend backend, size_t max_elems,
                                        double timeout_s, char *error, size_t error_size) {
    collectives_common_init(c, comm, ZERO_SCALARS);
    switch (backend) {
    case COLLECTIVES_NCCL: return collectives_open_nccl(c, timeout_s, error, error_size);
    case COLLECTIVES_MPI: return collectives_open_mpi(c, max_elems, error, error_size);
    }
    snprintf(error, error_size, "unknown collectives backend %d", (int)backend);
    return -1;
}

// Hybrid: the group's collectives (its ranks numbered by their shard index) and the replicas'
// (the ranks of this shard index, one per group), split from every rank's. Returns 0, or -1.
static inline int zero_split_collectives(Zero *z, char *error, size_t error_size) {
    if (!zero_hybrid(&z->plan)) return 0;
    int rank = z->comm->rank, group = zero_group_of(&z->plan, rank), shard = zero_shard_index(&z->plan, rank);
    if (collectives_split(&z->collectives, group, shard, &z->group_comm, &z->group, error, error_size) != 0) return -1;
    if (collectives_split(&z->collectives, shard, group, &z->replica_comm, &z->replicas, error, error_size) != 0) return -1;
    z->buckets = &z->group;
    return 0;
}

// The rank whose part of each bucket this rank's optimizer steps: its shard index when sharded,
// else part 0 of 1, the whole bucket.
static inline int zero_optimizer_rank(const Zero *z) { return zero_shard_index(&z->plan, z->comm->rank); }

// Whether this rank's sum of squares enters the gradient norm: the shards of one group, each
// counted once (flat: every rank's).
static inline int zero_counts_in_norm(const Zero *z) { return zero_group_of(&z->plan, z->comm->rank) == 0; }

// Hybrid: this rank's part of a bucket's gradient (the group's sum) summed across the groups, on
// the collectives' stream after the reduce-scatter that wrote it.
static inline void zero_sum_across_groups(Zero *z, bf16 *part, size_t n) {
    if (zero_hybrid(&z->plan)) collectives_all_reduce_sum_bf16(&z->replicas, part, n, z->buckets->stream);
}

static inline bf16 *zero_bucket_buffer(Zero *z, int b) {
    return z->model->grads + (size_t)(b % 2) * z->plan.largest_bucket_elems;
}

__global__ void zero_accumulate_kernel(float *sum, const bf16 *part, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) sum[i] += __bfloat162float(part[i]);
}

// Bucket b's gradient to the ranks, as the stage says (stage 3 as stage 2, or with one
// micro-batch per step straight into its BF16 shard: the same sum, without the FP32 zeros).
static inline void zero_reduce_bucket(Zero *z, int b) {
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = z->buckets;
    if (z->plan.stage == 0) {
        collectives_all_reduce_sum_bf16(c, z->model->grads + r->at, r->part, z->compute);
    } else if (z->plan.stage == 1) {
        collectives_reduce_scatter_sum_bf16(c, z->model->grads + r->at, z->grad_shard + r->state_at, r->part, z->compute);
        zero_sum_across_groups(z, z->grad_shard + r->state_at, r->part);
    } else if (z->grad_shard) {
        collectives_reduce_scatter_sum_bf16(c, zero_bucket_buffer(z, b), z->grad_shard + r->state_at, r->part, z->compute);
        zero_sum_across_groups(z, z->grad_shard + r->state_at, r->part);
        cudaCheck(cudaEventRecord(z->bucket_free[b % 2], c->stream));
    } else {
        bf16 *data = zero_bucket_buffer(z, b), *mine = data + (size_t)zero_optimizer_rank(z) * r->part;
        collectives_reduce_scatter_sum_bf16(c, data, mine, r->part, z->compute);
        zero_sum_across_groups(z, mine, r->part);
        zero_accumulate_kernel<<<(unsigned)ceil_div_size(r->part, 256), 256, 0, c->stream>>>(z->grad_sum + r->state_at, mine,
                                                                                              r->part);
        cudaCheckLaunch();
        cudaCheck(cudaEventRecord(z->bucket_free[b % 2], c->stream));
    }
}

// ---- weights from the master -------------------------------------------------------------

// This rank's part of bucket b (its optimizer's: the whole bucket when not sharded) and where
// element e of it sits in the rank's master weights (its parts back to back).
static inline ZeroRange zero_mine(const Zero *z, int b) { return zero_owned(&z->plan, b, zero_optimizer_rank(z)); }
static inline size_t zero_master_index(const Zero *z, int b, size_t e) {
    const ParamShardRange *r = &z->plan.bucket[b];
    return r->state_at + (e - r->begin - (size_t)zero_optimizer_rank(z) * r->part);
}

// The linear weight `which` of `layer` as far as it lies in this rank's part of its bucket, in
// the parameter order (empty: begin == end).
static inline ZeroRange zero_mine_of_linear(const Zero *z, int layer, Linear which) {
    const ParamLayout *layout = &z->model->layout;
    int b = z->plan.bucket_of[layout->shape.n_layers - layer];
    return zero_intersection(zero_linear_range(layout, which, layer), zero_mine(z, b));
}

__global__ void zero_weight_slots_kernel(Fp8Scale *scales) {
    Fp8Scale zero = {};
    scales[blockIdx.x * FP8_SCALES_PER_LAYER + FP8_SLOT_WEIGHT + threadIdx.x] = zero;
}

// Before the weights' amax is gathered (by the step or the pass below): every weight's slot
// zeroed (those of weights this rank holds no part of too: the sharded path's max all-reduce
// reads them), on the compute stream, after the last reader of the scales there. At stage 3 a
// gather on the collectives' stream may still read them: it is waited for first.
static inline void zero_weights_amax_reset(Zero *z) {
    if (zero_layers_gathered(&z->plan)) collectives_join(&z->collectives, z->compute);
    zero_weight_slots_kernel<<<z->model->shape.n_layers, LINEARS, 0, z->compute>>>(z->model->fp8_scales);
    cudaCheckLaunch();
}

// Every weight's amax slot = max |w| over its elements in this rank's master weights, rounded to
// BF16 (0 where it has none).
static inline void zero_weights_amax_mine(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    int L = m->shape.n_layers;
    zero_weights_amax_reset(z);
    for (int l = 0; l < L; l++)
        for (int i = 0; i < LINEARS; i++) {
            Fp8Scale *slot = model_fp8_scale(m, l, FP8_SLOT_WEIGHT, (Linear)i);
            ZeroRange mine = zero_mine_of_linear(z, l, (Linear)i);
            if (mine.end > mine.begin)
                fp8_amax(slot, master + zero_master_index(z, z->plan.bucket_of[L - l], mine.begin), mine.end - mine.begin,
                         z->compute);
        }
}

// The same amax gathered by the optimizer's step instead, as it writes the master weights (one
// pass less over them): the weights' parts in this rank's optimizer state, ascending, and their
// slots. Returns 0 (and the separate pass stays) past ADAMW_AMAX_PARTS parts.
static inline int zero_weights_amax_parts(const Zero *z, AdamWAmaxParts *parts) {
    LlamaModel *m = z->model;
    int L = m->shape.n_layers;
    parts->slots = m->fp8_scales;
    parts->count = 0;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < LINEARS; i++) {
            ZeroRange mine = zero_mine_of_linear(z, l, (Linear)i);
            if (mine.end == mine.begin) continue;
            if (parts->count == ADAMW_AMAX_PARTS) return 0;
            size_t first = zero_master_index(z, z->plan.bucket_of[L - l], mine.begin);
            int c = parts->count++, k = c;  // inserted in order of first group
            for (; k > 0 && parts->first_group[k - 1] > first / ADAMW_GROUP; k--) {
                parts->first_group[k] = parts->first_group[k - 1];
                parts->end_group[k] = parts->end_group[k - 1];
                parts->slot[k] = parts->slot[k - 1];
            }
            parts->first_group[k] = (uint32_t)(first / ADAMW_GROUP);
            parts->end_group[k] = (uint32_t)ceil_div_size(first + (mine.end - mine.begin), ADAMW_GROUP);
            parts->slot[k] = (uint16_t)(model_fp8_scale(m, l, FP8_SLOT_WEIGHT, (Linear)i) - m->fp8_scales);
        }
    return 1;
}

__global__ void zero_master_to_bf16_kernel(bf16 *out, const float *master, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16_rn(master[i]);
}

// This rank's parts of every layer's norms (their padding too), rounded to BF16 as a step rounds
// the parameters, into their places in the norm table.
static inline void zero_norms_from_master(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    const ParamLayout *layout = &m->layout;
    ParamKind norms[2] = {PARAM_ATTN_NORM, PARAM_MLP_NORM};
    int L = m->shape.n_layers;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) {
            int b = z->plan.bucket_of[L - l];
            size_t begin = param_offset(layout, norms[k], l);
            ZeroRange norm = {begin, begin + layout->padded[norms[k]]}, mine = zero_intersection(norm, zero_mine(z, b));
            if (mine.end == mine.begin) continue;
            size_t n = mine.end - mine.begin;
            zero_master_to_bf16_kernel<<<(unsigned)ceil_div_size(n, 256), 256, 0, z->compute>>>(
                m->norms + param_norm_table_offset(layout, norms[k], l) + (mine.begin - norm.begin),
                master + zero_master_index(z, b, mine.begin), n);
            cudaCheckLaunch();
        }
}

// Unsharded: every weight cast from the master in one pass, as model_cast_weights casts them
// from the BF16 weights.
static inline void zero_cast_weights_from_master(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    int L = m->shape.n_layers;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < LINEARS; i++) {
            Linear which = (Linear)i;
            LinearShape shape = linear_shape(m, which);
            size_t first = zero_linear_range(&m->layout, which, l).begin;
            const float *weight = master + zero_master_index(z, z->plan.bucket_of[L - l], first);
            fp8_quantize(linear_fp8_weight(m, l, which, 0), linear_fp8_weight_cast_t(m, l, which),
                         model_fp8_scale(m, l, FP8_SLOT_WEIGHT, which), weight, shape.out, shape.in, FP8_E4M3,
                         z->compute);
        }
}

// A bucket of layers in E4M3 into `codes` (W parts of a byte per element), on the collectives'
// stream: this rank's codes of its parts of the linear weights, cast from its master weights with
// each weight's scale, into its part, then the all-gather (the norms' bytes stay as they were).
static inline void zero_cast_and_gather_e4m3(Zero *z, int b, const float *master, uint8_t *codes) {
    LlamaModel *m = z->model;
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = z->buckets;
    int L = m->shape.n_layers;
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            ZeroRange mine = zero_mine_of_linear(z, L - s, (Linear)i);
            if (mine.end > mine.begin)
                fp8_quantize(codes + (mine.begin - r->begin), NULL, model_fp8_scale(m, L - s, FP8_SLOT_WEIGHT, (Linear)i),
                             master + zero_master_index(z, b, mine.begin), (int)((mine.end - mine.begin) / PARAM_ALIGN_ELEMS),
                             PARAM_ALIGN_ELEMS, FP8_E4M3, c->stream);
        }
    collectives_all_gather(c, codes, r->part, c->stream);
}

// Stages 1, 2: a bucket of layers in E4M3 through the staging, then each weight's codes out to
// where the FP8 GEMMs read them (and their W^T where the model keeps every layer's).
static inline void zero_gather_layers_e4m3(Zero *z, int b, const float *master) {
    LlamaModel *m = z->model;
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = z->buckets;
    int L = m->shape.n_layers;
    zero_cast_and_gather_e4m3(z, b, master, z->e4m3_staging);
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            ZeroRange weight = zero_linear_range(&m->layout, (Linear)i, L - s);
            const uint8_t *codes = z->e4m3_staging + (weight.begin - r->begin);
            cudaCheck(cudaMemcpyAsync(linear_fp8_weight(m, L - s, (Linear)i, 0), codes, weight.end - weight.begin,
                                      cudaMemcpyDeviceToDevice, c->stream));
            uint8_t *codes_t = linear_fp8_weight_cast_t(m, L - s, (Linear)i);
            LinearShape shape = linear_shape(m, (Linear)i);
            if (codes_t) fp8_transpose_codes(codes_t, codes, shape.out, shape.in, c->stream);
        }
}

// ---- stage 3: the buckets of layers, gathered where they are read -----------------------------

static inline int zero_slot_holding(const Zero *z, int b) {
    for (int k = 0; k < ZERO_GATHER_SLOTS; k++)
        if (z->slot_bucket[k] == b) return k;
    return -1;
}

static inline char *zero_slot(const Zero *z, int k) { return z->layer_slots + (size_t)k * z->slot_bytes; }

// Bucket b of layers into slot k, on the collectives' stream once every kernel the compute stream
// has queued is done (those that read the slot's bucket before, the step that wrote the master
// weights): this rank's part cast from its master weights (E4M3, or BF16 rounded to nearest even
// as a step writes the parameters), then one all-gather.
static inline void zero_gather_layers_into(Zero *z, int b, int k) {
    Collectives *c = z->buckets;
    const ParamShardRange *r = &z->plan.bucket[b];
    collectives_after(c, z->compute);
    if (z->e4m3_gather) {
        zero_cast_and_gather_e4m3(z, b, z->master, (uint8_t *)zero_slot(z, k));
    } else {
        bf16 *slot = (bf16 *)zero_slot(z, k);
        zero_master_to_bf16_kernel<<<(unsigned)ceil_div_size(r->part, 256), 256, 0, c->stream>>>(
            slot + (size_t)zero_optimizer_rank(z) * r->part, z->master + r->state_at, r->part);
        cudaCheckLaunch();
        collectives_all_gather(c, slot, 2 * r->part, c->stream);
    }
    cudaCheck(cudaEventRecord(z->slot_gathered[k], c->stream));
    z->slot_bucket[k] = b;
}

// Bucket b of layers made readable on the compute stream: gathered unless a slot holds it (into
// the slot that does not hold `next`), the compute stream waits for it; then the bucket `next`
// (-1: none), which the model reads after it, is gathered into the other slot unless it is there.
// Returns b's slot.
static inline int zero_layers_acquire(Zero *z, int b, int next) {
    int k = zero_slot_holding(z, b);
    if (k < 0) {
        k = z->slot_bucket[0] == next && next >= 0 ? 1 : 0;
        zero_gather_layers_into(z, b, k);
    }
    cudaCheck(cudaStreamWaitEvent(z->compute, z->slot_gathered[k], 0));
    if (next >= 0 && zero_slot_holding(z, next) < 0) zero_gather_layers_into(z, next, (k + 1) % ZERO_GATHER_SLOTS);
    return k;
}

// Whether a forward pass runs collectives (stage 3's gathers of the layers): then every rank runs
// each one, the same number of times.
static inline int zero_forward_is_collective(const Zero *z) { return zero_layers_gathered(&z->plan); }

// The step changed the master weights: no slot holds a bucket of the present weights.
static inline void zero_layers_stale(Zero *z) {
    for (int k = 0; k < ZERO_GATHER_SLOTS; k++) z->slot_bucket[k] = -1;
}

// The neighbour of bucket b that the model reads next (forward: b + 1, backward: b - 1) when it is
// a bucket of layers, else -1.
static inline int zero_next_layers(const Zero *z, int b, int step) {
    return zero_bucket_is_layers(&z->plan, b + step) ? b + step : -1;
}

// Where `layer`'s bucket lies now (its slot), and the element of the parameter order `e` in it.
static inline size_t zero_slot_offset(const Zero *z, int layer, size_t e, int *slot) {
    int b = z->plan.bucket_of[z->model->shape.n_layers - layer];
    *slot = zero_slot_holding(z, b);
    if (*slot < 0) fail_with("zero_slot_offset", "a layer's weights are read before their bucket's gather");
    return e - z->plan.bucket[b].begin;
}

// ---- the model's hooks ----------------------------------------------------------------------

// Stages 2 and 3: a bucket's buffer, once free, zeroed before backward adds its first gradient.
static void zero_segment_begin(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (z->plan.stage < 2 || segment != z->plan.first_segment[b]) return;
    cudaCheck(cudaStreamWaitEvent(z->compute, z->bucket_free[b % 2], 0));
    cudaCheck(cudaMemsetAsync(zero_bucket_buffer(z, b), 0, 2 * (size_t)z->plan.shards * z->plan.bucket[b].part, z->compute));
}

static void zero_segment_end(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (segment != z->plan.last_segment[b]) return;
    if (z->plan.stage >= 2 || z->last_micro_batch) zero_reduce_bucket(z, b);
}

static bf16 *zero_bucket_gradient(void *context, int segment, size_t buffer_offset) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    return zero_bucket_buffer(z, b) + (buffer_offset - z->plan.bucket[b].at);
}

// The forward's wait for a bucket's gather (once per gather). Stage 3: a bucket of layers, at its
// first layer, gathered (the next one meanwhile).
static void zero_params_ready(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (zero_layers_gathered(&z->plan) && zero_bucket_is_layers(&z->plan, b)) {
        if (segment != z->plan.last_segment[b]) return;
        zero_layers_acquire(z, b, zero_next_layers(z, b, 1));
        op_timer_mark(z->model->timer, "parameter gather: waiting for a bucket of layers", z->compute);
        return;
    }
    if (!z->gathering[b]) return;
    z->gathering[b] = 0;
    cudaCheck(cudaStreamWaitEvent(z->compute, z->params_gathered[b], 0));
    op_timer_mark(z->model->timer, "parameter gather: waiting for a bucket", z->compute);
}

// Stage 3, backward: a bucket of layers, at its last layer (backward's first), gathered unless a
// slot holds it (the bucket before it meanwhile); with E4M3 its transposes remade for backward's
// FP8 GEMMs, after the previous bucket's backward is done with the room (the same stream).
static void zero_params_ready_backward(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (!zero_bucket_is_layers(&z->plan, b) || segment != z->plan.first_segment[b]) return;
    zero_layers_acquire(z, b, zero_next_layers(z, b, -1));
    int L = z->model->shape.n_layers;
    for (int s = z->plan.first_segment[b]; z->e4m3_gather && s <= z->plan.last_segment[b]; s++)
        model_transpose_layer_weights(z->model, L - s, z->compute);
    op_timer_mark(z->model->timer, "parameter gather: waiting for a bucket of layers (+ its E4M3 transposes)", z->compute);
}

// Stage 3 in BF16: a layer's tensor in its bucket's slot.
static bf16 *zero_layer_param(void *context, ParamKind kind, int layer) {
    Zero *z = (Zero *)context;
    int slot;
    size_t at = zero_slot_offset(z, layer, param_offset(&z->model->layout, kind, layer), &slot);
    return (bf16 *)zero_slot(z, slot) + at;
}

// Stage 3 in E4M3: a linear layer's W codes in its bucket's slot (at their elements' places), or
// its W^T in the transposes' room (the layer's place in its bucket, then linear_fp8_weight's
// order of the linear layers).
static uint8_t *zero_layer_fp8_weight(void *context, int layer, Linear which, int transposed) {
    Zero *z = (Zero *)context;
    const LlamaModel *m = z->model;
    if (!transposed) {
        int slot;
        size_t at = zero_slot_offset(z, layer, zero_linear_range(&m->layout, which, layer).begin, &slot);
        return (uint8_t *)zero_slot(z, slot) + at;
    }
    int first_layer = m->shape.n_layers - z->plan.last_segment[z->plan.bucket_of[m->shape.n_layers - layer]];
    size_t in[LINEARS], out[LINEARS], at = 0;
    linear_shapes(&m->shape, in, out);
    for (int i = 0; i < (int)which; i++) at += in[i] * out[i];
    return z->layer_transposes + (size_t)(layer - first_layer) * linear_layer_weight_elems(&m->shape) + at;
}

// ---- set-up ------------------------------------------------------------------------------------

static inline void *zero_alloc(Zero *z, size_t bytes, const char *what) {
    z->allocated_bytes += bytes;
    return gpu_alloc(bytes, what);
}

// Runs `plan` (set with zero_plan_init, the model created with zero_model_layout and
// zero_grads_elems) for `model`, whose forward and backward run on `compute`: with several ranks
// the collectives (`backend`, collective_timeout_s timeout_s), the hooks and this rank's buffers.
// Returns 0, or -1 with a message.
static inline int zero_attach(Zero *z, const ZeroPlan *plan, const Comm *comm, LlamaModel *model, cudaStream_t compute,
                              CollectivesBackend backend, double timeout_s, char *error, size_t error_size) {
    memset(z, 0, sizeof(*z));
    z->plan = *plan;
    z->comm = comm;
    z->model = model;
    z->compute = compute;
    z->collectives.comm = comm;  // one rank: the waits and the one-rank shortcuts only
    z->buckets = &z->collectives;
    if (comm->world <= 1) return 0;
    z->e4m3_gather = model->precision.weights_from_master && plan->shards > 1;
    int layers_gathered = zero_layers_gathered(plan);
    if (layers_gathered && model->precision.fp8_gemms && !z->e4m3_gather) {
        snprintf(error, error_size, "ZeRO stage 3 with FP8 GEMMs gathers the layers' E4M3 codes: param_gather = e4m3 (auto)");
        return -1;
    }
    if (zero_open_collectives(&z->collectives, comm, backend, plan->largest_bucket_elems, timeout_s, error, error_size) != 0 ||
        zero_split_collectives(z, error, error_size) != 0)
        return -1;
    z->allocated_bytes = ZERO_SCALAR_BYTES;  // the collectives' scalars
    z->hooks.begin = zero_segment_begin;
    z->hooks.end = zero_segment_end;
    z->hooks.gradient = plan->stage >= 2 ? zero_bucket_gradient : NULL;
    z->hooks.ready = plan->stage >= 1 ? zero_params_ready : NULL;
    z->hooks.ready_backward = layers_gathered ? zero_params_ready_backward : NULL;
    z->hooks.layer_param = layers_gathered && !z->e4m3_gather ? zero_layer_param : NULL;
    z->hooks.fp8_weight = layers_gathered && z->e4m3_gather ? zero_layer_fp8_weight : NULL;
    z->hooks.context = z;
    model->buckets = &z->hooks;
    size_t shard_bytes = zero_grad_shard_bytes(plan);
    if (plan->stage == 1 || plan->bf16_grad_shard) z->grad_shard = (bf16 *)zero_alloc(z, shard_bytes, "the gradient shard (bf16)");
    else if (plan->stage >= 2) z->grad_sum = (float *)zero_alloc(z, shard_bytes, "the gradient shard (fp32)");
    if (plan->stage >= 2)
        for (int i = 0; i < 2; i++) cudaCheck(cudaEventCreateWithFlags(&z->bucket_free[i], cudaEventDisableTiming));
    if (plan->stage >= 1) {
        z->params_gathered = (cudaEvent_t *)malloc(plan->buckets * sizeof(cudaEvent_t));
        z->gathering = (unsigned char *)calloc(plan->buckets, 1);
        if (!z->params_gathered || !z->gathering) fail_with("zero_attach", "out of host memory for the gather's events");
        for (int b = 0; b < plan->buckets; b++)
            cudaCheck(cudaEventCreateWithFlags(&z->params_gathered[b], cudaEventDisableTiming));
    }
    if (z->e4m3_gather && !layers_gathered)
        z->e4m3_staging = (uint8_t *)zero_alloc(z, zero_e4m3_gather_bytes(plan), "the E4M3 gather's staging");
    if (layers_gathered) {
        z->slot_bytes = zero_layer_slot_bytes(plan, z->e4m3_gather);
        z->layer_slots = (char *)zero_alloc(z, ZERO_GATHER_SLOTS * z->slot_bytes, "the gather slots of the buckets of layers");
        for (int k = 0; k < ZERO_GATHER_SLOTS; k++) cudaCheck(cudaEventCreateWithFlags(&z->slot_gathered[k], cudaEventDisableTiming));
        if (z->e4m3_gather)
            z->layer_transposes = (uint8_t *)zero_alloc(z, zero_layer_transposes_bytes(plan, &model->shape),
                                                        "the transposes of a bucket of layers");
        zero_layers_stale(z);
    }
    return 0;
}

static inline void zero_free(Zero *z) {
    if (z->comm->world <= 1) return;
    if (zero_hybrid(&z->plan)) {
        collectives_close_split(&z->replicas, &z->replica_comm);
        collectives_close_split(&z->group, &z->group_comm);
    }
    collectives_close(&z->collectives);
    if (z->grad_shard) cudaCheck(cudaFree(z->grad_shard));
    if (z->grad_sum) cudaCheck(cudaFree(z->grad_sum));
    if (z->plan.stage >= 2)
        for (int i = 0; i < 2; i++) cudaCheck(cudaEventDestroy(z->bucket_free[i]));
    if (z->params_gathered) {
        for (int b = 0; b < z->plan.buckets; b++) cudaCheck(cudaEventDestroy(z->params_gathered[b]));
        free(z->params_gathered);
        free(z->gathering);
    }
    if (z->e4m3_staging) cudaCheck(cudaFree(z->e4m3_staging));
    if (z->layer_slots) {
        cudaCheck(cudaFree(z->layer_slots));
        for (int k = 0; k < ZERO_GATHER_SLOTS; k++) cudaCheck(cudaEventDestroy(z->slot_gathered[k]));
    }
    if (z->layer_transposes) cudaCheck(cudaFree(z->layer_transposes));
    z->model->buckets = NULL;
}

// ---- a step ------------------------------------------------------------------------------------

// The gradients that accumulate over a step's micro-batches start from zero (stage 3's BF16 shard
// is written whole by the step's one reduce-scatter of each bucket).
static inline void zero_step_begin(Zero *z) {
    if (z->grad_sum) cudaCheck(cudaMemsetAsync(z->grad_sum, 0, 4 * z->plan.shard_elems, z->compute));
    else if (z->plan.stage <= 1) z->model->grads_unwritten = 1;  // the first micro-batch writes them (no memset)
}

static inline void zero_micro_batch(Zero *z, int last) { z->last_micro_batch = last; }

// The compute stream waits for the reduces of the step's gradients: then the BF16 gradients this
// rank's optimizer steps are zero_gradient_shard (stage 2, and 3 with several micro-batches: the
// FP32 zero_gradient_sum instead),
// its parts back to back (with one rank or at stage 0, the whole buffer).
static inline void zero_gradients_done(Zero *z) {
    if (z->comm->world > 1) collectives_join(&z->collectives, z->compute);
}
static inline bf16 *zero_gradient_shard(const Zero *z) { return z->grad_shard ? z->grad_shard : z->model->grads; }
static inline const float *zero_gradient_sum(const Zero *z) { return z->grad_sum; }

// Where bucket b sits in the model's BF16 parameter buffer (PARAM_NOT_IN_BUFFER: a bucket of
// layers whose linear weights are E4M3 only, its norms in the norm table, or that stage 3
// gathers from the master weights where it is read).
static inline size_t zero_params_at(const Zero *z, int b) {
    const LlamaModel *m = z->model;
    int layers_elsewhere = m->precision.weights_from_master || zero_layers_gathered(&z->plan);
    if (layers_elsewhere && zero_bucket_is_layers(&z->plan, b)) return PARAM_NOT_IN_BUFFER;
    return param_buffer_at(&m->params_layout, z->plan.last_segment[b], z->plan.bucket[b].begin);
}

// The plan's buckets as this rank's optimizer steps them: at where each sits in the BF16
// parameter buffer (zero_params_at), ranges[plan.buckets].
static inline void zero_optimizer_ranges(const Zero *z, ParamShardRange *ranges) {
    for (int b = 0; b < z->plan.buckets; b++) {
        ranges[b] = z->plan.bucket[b];
        ranges[b].at = zero_params_at(z, b);
    }
}

// Sharded: every weight's scale from its amax (the max over the ranks by now), on every rank: the
// FP8 GEMMs read it, and a rank that owns none of a weight casts none of it. The casts write the
// same value.
__global__ void zero_weight_scales_kernel(Fp8Scale *table, int layers) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= layers * LINEARS) return;
    Fp8Scale *slot = table + (size_t)(i / LINEARS) * FP8_SCALES_PER_LAYER + FP8_SLOT_WEIGHT + i % LINEARS;
    slot->scale = fp8_scale_from_amax(slot->amax, FP8_E4M3);
}

// Sharded: the scale table's max and the norm table's sum, then each bucket in the forward's
// order, the buckets of layers in E4M3 (stage 3: none, they are gathered where they are read),
// the others in BF16.
static inline void zero_gather_from_master(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    Collectives *c = z->buckets;
    // The whole scale table: the activations' and gradients' entries, reset by every forward, ride along.
    collectives_all_reduce_max_f32(c, (float *)m->fp8_scales, m->working_layout.fp8_scales_bytes / sizeof(float), z->compute);
    collectives_join(c, z->compute);  // the next forward resets the activations' entries after it
    int weights = m->shape.n_layers * LINEARS;
    zero_weight_scales_kernel<<<(unsigned)ceil_div_size((size_t)weights, 256), 256, 0, z->compute>>>(m->fp8_scales,
                                                                                                      m->shape.n_layers);
    cudaCheckLaunch();
    collectives_all_reduce_sum_bf16(c, m->norms, m->norms_elems, c->stream);
    for (int b = 0; b < z->plan.buckets; b++) {
        const ParamShardRange *r = &z->plan.bucket[b];
        int layers = zero_bucket_is_layers(&z->plan, b);
        if (layers && zero_layers_gathered(&z->plan)) continue;
        if (layers) zero_gather_layers_e4m3(z, b, master);
        else collectives_all_gather(c, m->params + zero_params_at(z, b), 2 * r->part, z->compute);
        cudaCheck(cudaEventRecord(z->params_gathered[b], c->stream));
        z->gathering[b] = 1;
    }
}

// After the optimizer stepped this rank's parts of the parameters (on the compute stream; its
// FP32 master weights `master`, the parts back to back; amax_gathered: it gathered the weights'
// amax too, zero_weights_amax_parts): every rank gets all of the weights the
// model reads, a bucket at a time in the forward's order (the parameter order); at stage 3 the
// buckets of layers only when the model reads them (the slots' buckets are stale now).
static inline void zero_gather_params(Zero *z, const float *master, int amax_gathered) {
    LlamaModel *m = z->model;
    if (zero_layers_gathered(&z->plan)) {
        collectives_join(&z->collectives, z->compute);  // no earlier gather still reads the scales or the master
        z->master = master;
        zero_layers_stale(z);
    }
    if (m->precision.weights_from_master) {
        int sharded = z->plan.shards > 1;
        if (sharded) cudaCheck(cudaMemsetAsync(m->norms, 0, 2 * m->norms_elems, z->compute));
        zero_norms_from_master(z, master);
        if (!amax_gathered) zero_weights_amax_mine(z, master);
        if (sharded) zero_gather_from_master(z, master);
        else zero_cast_weights_from_master(z, master);
        m->fp8_weights_current = 1;  // the codes, once zero_params_ready has waited for them
        return;
    }
    model_weights_changed(m);
    if (z->plan.stage == 0 || z->comm->world == 1) return;
    Collectives *c = z->buckets;
    for (int b = 0; b < z->plan.buckets; b++) {
        if (zero_params_at(z, b) == PARAM_NOT_IN_BUFFER) continue;  // stage 3's layers
        collectives_all_gather(c, m->params + zero_params_at(z, b), 2 * z->plan.bucket[b].part, z->compute);
        cudaCheck(cudaEventRecord(z->params_gathered[b], c->stream));
        z->gathering[b] = 1;
    }
}
