// Data parallelism's one home: the ZeRO plan of coat/zero.h run on the GPU over the collectives
// of coat/collectives.cuh, behind a few calls that the trainer makes and the model's hooks.
//   zero_model_layout / zero_grads_elems   the device buffers the model allocates for the plan
//   zero_attach                            the collectives, the hooks on the model, this rank's buffers
//   zero_step_begin, zero_micro_batch      the gradient accumulators zeroed; which micro-batch reduces
//   zero_gradients_done                    the compute stream waits for the gradients' reduces
//   zero_optimizer_ranges                  the buckets as the optimizer steps them (where their BF16 is)
//   zero_gather_params                     after the optimizer stepped this rank's parts of the parameters
// Backward (the hooks): as backward finishes the last segment of a bucket, the bucket's gradient
// is all-reduced (stage 0) or reduce-scattered (stages 1, 2) on the collectives' stream while
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
// norm table's all-reduce sums the owners' norms, and each layer's transposes are written once its
// bucket is here; otherwise the rank owns everything and casts each weight and its transpose in
// one pass. Every rank ends with the codes and scales that model_cast_weights gives from the BF16
// weights, bit for bit.
#pragma once
#include "collectives_mpi.cuh"
#include "collectives_nccl.cuh"
#include "model.cuh"
#include "zero.h"

typedef struct {
    ZeroPlan plan;
    const Comm *comm;
    Collectives collectives;        // world > 1
    LlamaModel *model;
    cudaStream_t compute;           // the model's stream
    BucketHooks hooks;
    int e4m3_gather;
    int last_micro_batch;           // stages 0 and 1 reduce in the last micro-batch of a step only
    bf16 *grad_shard;               // stage 1: this rank's parts of the gradient, summed over the ranks
    float *grad_sum;                // stage 2: their FP32 sum over the micro-batches
    cudaEvent_t bucket_free[2];     // stage 2: a bucket buffer's reduce is done with it
    cudaEvent_t *params_gathered;   // stages 1, 2: per bucket, its gather after the step is done
    unsigned char *gathering;       // per bucket: the forward has yet to wait for its gather
    uint8_t *e4m3_staging;          // the E4M3 gather: a bucket of layers' codes
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

// The rank whose part of each bucket this rank's optimizer steps: its own when sharded, else
// part 0 of 1, the whole bucket.
static inline int zero_optimizer_rank(const Zero *z) { return z->plan.shards > 1 ? z->comm->rank : 0; }

static inline bf16 *zero_bucket_buffer(Zero *z, int b) {
    return z->model->grads + (size_t)(b % 2) * z->plan.largest_bucket_elems;
}

__global__ void zero_accumulate_kernel(float *sum, const bf16 *part, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) sum[i] += __bfloat162float(part[i]);
}

// Bucket b's gradient to the ranks, as the stage says.
static inline void zero_reduce_bucket(Zero *z, int b) {
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = &z->collectives;
    if (z->plan.stage == 0) {
        collectives_all_reduce_sum_bf16(c, z->model->grads + r->at, r->part, z->compute);
    } else if (z->plan.stage == 1) {
        collectives_reduce_scatter_sum_bf16(c, z->model->grads + r->at, z->grad_shard + r->state_at, r->part, z->compute);
    } else {
        bf16 *data = zero_bucket_buffer(z, b), *mine = data + (size_t)z->comm->rank * r->part;
        collectives_reduce_scatter_sum_bf16(c, data, mine, r->part, z->compute);
        zero_accumulate_kernel<<<(unsigned)ceil_div_size(r->part, 256), 256, 0, c->stream>>>(z->grad_sum + r->state_at, mine,
                                                                                              r->part);
        cudaCheckLaunch();
        cudaCheck(cudaEventRecord(z->bucket_free[b % 2], c->stream));
    }
}

// ---- the model's hooks ----------------------------------------------------------------------

// Stage 2: a bucket's buffer, once free, zeroed before backward adds its first gradient.
static void zero_segment_begin(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (z->plan.stage != 2 || segment != z->plan.first_segment[b]) return;
    cudaCheck(cudaStreamWaitEvent(z->compute, z->bucket_free[b % 2], 0));
    cudaCheck(cudaMemsetAsync(zero_bucket_buffer(z, b), 0, 2 * (size_t)z->plan.shards * z->plan.bucket[b].part, z->compute));
}

static void zero_segment_end(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (segment != z->plan.last_segment[b]) return;
    if (z->plan.stage == 2 || z->last_micro_batch) zero_reduce_bucket(z, b);
}

static bf16 *zero_stage2_gradient(void *context, int segment, size_t buffer_offset) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    return zero_bucket_buffer(z, b) + (buffer_offset - z->plan.bucket[b].at);
}

// The forward's wait for a bucket's gather (once per gather); with the E4M3 gather its layers'
// transposes follow.
static void zero_params_ready(void *context, int segment) {
    Zero *z = (Zero *)context;
    int b = z->plan.bucket_of[segment];
    if (!z->gathering[b]) return;
    z->gathering[b] = 0;
    cudaCheck(cudaStreamWaitEvent(z->compute, z->params_gathered[b], 0));
    int L = z->model->shape.n_layers, layers = z->e4m3_gather && zero_bucket_is_layers(&z->plan, b);
    for (int s = z->plan.first_segment[b]; layers && s <= z->plan.last_segment[b]; s++)
        model_transpose_layer_weights(z->model, L - s, z->compute);
    op_timer_mark(z->model->timer, "parameter gather: waiting for a bucket (+ its E4M3 transposes)", z->compute);
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
    if (comm->world <= 1) return 0;
    z->e4m3_gather = model->precision.weights_from_master && plan->shards > 1;
    if (zero_open_collectives(&z->collectives, comm, backend, plan->largest_bucket_elems, timeout_s, error, error_size) != 0)
        return -1;
    z->allocated_bytes = ZERO_SCALAR_BYTES;  // the collectives' scalars
    z->hooks.begin = zero_segment_begin;
    z->hooks.end = zero_segment_end;
    z->hooks.gradient = plan->stage == 2 ? zero_stage2_gradient : NULL;
    z->hooks.ready = plan->stage >= 1 ? zero_params_ready : NULL;
    z->hooks.context = z;
    model->buckets = &z->hooks;
    if (plan->stage == 1) z->grad_shard = (bf16 *)zero_alloc(z, 2 * plan->shard_elems, "the gradient shard (bf16)");
    if (plan->stage == 2) {
        z->grad_sum = (float *)zero_alloc(z, 4 * plan->shard_elems, "the gradient shard (fp32)");
        for (int i = 0; i < 2; i++) cudaCheck(cudaEventCreateWithFlags(&z->bucket_free[i], cudaEventDisableTiming));
    }
    if (plan->stage >= 1) {
        z->params_gathered = (cudaEvent_t *)malloc(plan->buckets * sizeof(cudaEvent_t));
        z->gathering = (unsigned char *)calloc(plan->buckets, 1);
        if (!z->params_gathered || !z->gathering) fail_with("zero_attach", "out of host memory for the gather's events");
        for (int b = 0; b < plan->buckets; b++)
            cudaCheck(cudaEventCreateWithFlags(&z->params_gathered[b], cudaEventDisableTiming));
    }
    if (z->e4m3_gather) z->e4m3_staging = (uint8_t *)zero_alloc(z, zero_e4m3_gather_bytes(plan), "the E4M3 gather's staging");
    return 0;
}

static inline void zero_free(Zero *z) {
    if (z->comm->world <= 1) return;
    collectives_close(&z->collectives);
    if (z->grad_shard) cudaCheck(cudaFree(z->grad_shard));
    if (z->grad_sum) {
        cudaCheck(cudaFree(z->grad_sum));
        for (int i = 0; i < 2; i++) cudaCheck(cudaEventDestroy(z->bucket_free[i]));
    }
    if (z->params_gathered) {
        for (int b = 0; b < z->plan.buckets; b++) cudaCheck(cudaEventDestroy(z->params_gathered[b]));
        free(z->params_gathered);
        free(z->gathering);
    }
    if (z->e4m3_staging) cudaCheck(cudaFree(z->e4m3_staging));
    z->model->buckets = NULL;
}

// ---- a step ------------------------------------------------------------------------------------

// The gradients that accumulate over a step's micro-batches start from zero.
static inline void zero_step_begin(Zero *z) {
    if (z->grad_sum) cudaCheck(cudaMemsetAsync(z->grad_sum, 0, 4 * z->plan.shard_elems, z->compute));
    else cudaCheck(cudaMemsetAsync(z->model->grads, 0, 2 * z->model->grads_elems, z->compute));
}

static inline void zero_micro_batch(Zero *z, int last) { z->last_micro_batch = last; }

// The compute stream waits for the reduces of the step's gradients: then the BF16 gradients this
// rank's optimizer steps are zero_gradient_shard (stage 2: the FP32 zero_gradient_sum instead),
// its parts back to back (with one rank or at stage 0, the whole buffer).
static inline void zero_gradients_done(Zero *z) {
    if (z->comm->world > 1) collectives_join(&z->collectives, z->compute);
}
static inline bf16 *zero_gradient_shard(const Zero *z) { return z->grad_shard ? z->grad_shard : z->model->grads; }
static inline const float *zero_gradient_sum(const Zero *z) { return z->grad_sum; }

// Where bucket b sits in the model's BF16 parameter buffer (PARAM_NOT_IN_BUFFER: a bucket of
// layers whose linear weights are E4M3 only; its norms are in the norm table).
static inline size_t zero_params_at(const Zero *z, int b) {
    const LlamaModel *m = z->model;
    if (m->precision.weights_from_master && zero_bucket_is_layers(&z->plan, b)) return PARAM_NOT_IN_BUFFER;
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

// Every weight's amax slot = max |w| over its elements in this rank's master weights, rounded to
// BF16 (0 where it has none).
static inline void zero_weights_amax_mine(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    int L = m->shape.n_layers;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < LINEARS; i++) {
            Fp8Scale *slot = model_fp8_scale(m, l, FP8_SLOT_WEIGHT, (Linear)i);
            ZeroRange mine = zero_mine_of_linear(z, l, (Linear)i);
            cudaCheck(cudaMemsetAsync(slot, 0, sizeof(Fp8Scale), z->compute));
            if (mine.end > mine.begin)
                fp8_amax(slot, master + zero_master_index(z, z->plan.bucket_of[L - l], mine.begin), mine.end - mine.begin,
                         z->compute);
        }
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

// Unsharded: every weight and its transpose cast from the master in one pass, as
// model_cast_weights casts them from the BF16 weights.
static inline void zero_cast_weights_from_master(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    int L = m->shape.n_layers;
    for (int l = 0; l < L; l++)
        for (int i = 0; i < LINEARS; i++) {
            Linear which = (Linear)i;
            LinearShape shape = linear_shape(m, which);
            size_t first = zero_linear_range(&m->layout, which, l).begin;
            const float *weight = master + zero_master_index(z, z->plan.bucket_of[L - l], first);
            fp8_quantize(linear_fp8_weight(m, l, which, 0), linear_fp8_weight(m, l, which, 1),
                         model_fp8_scale(m, l, FP8_SLOT_WEIGHT, which), weight, shape.out, shape.in, FP8_E4M3, z->compute);
        }
}

// A bucket of layers in E4M3, on the collectives' stream: this rank's codes, cast from its master
// weights, into its part of the staging, the all-gather, each weight's codes out to where the FP8
// GEMMs read them.
static inline void zero_gather_layers_e4m3(Zero *z, int b, const float *master) {
    LlamaModel *m = z->model;
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = &z->collectives;
    int L = m->shape.n_layers;
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            ZeroRange mine = zero_mine_of_linear(z, L - s, (Linear)i);
            if (mine.end > mine.begin)
                fp8_quantize(z->e4m3_staging + (mine.begin - r->begin), NULL,
                             model_fp8_scale(m, L - s, FP8_SLOT_WEIGHT, (Linear)i), master + zero_master_index(z, b, mine.begin),
                             (int)((mine.end - mine.begin) / PARAM_ALIGN_ELEMS), PARAM_ALIGN_ELEMS, FP8_E4M3, c->stream);
        }
    collectives_all_gather(c, z->e4m3_staging, r->part, c->stream);
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            ZeroRange weight = zero_linear_range(&m->layout, (Linear)i, L - s);
            cudaCheck(cudaMemcpyAsync(linear_fp8_weight(m, L - s, (Linear)i, 0), z->e4m3_staging + (weight.begin - r->begin),
                                      weight.end - weight.begin, cudaMemcpyDeviceToDevice, c->stream));
        }
}

// Sharded: the scale table's max and the norm table's sum, then each bucket in the forward's
// order, the buckets of layers in E4M3, the others in BF16.
static inline void zero_gather_from_master(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    Collectives *c = &z->collectives;
    // The whole scale table: the activations' and gradients' entries, reset by every forward, ride along.
    collectives_all_reduce_max_f32(c, (float *)m->fp8_scales, m->working_layout.fp8_scales_bytes / sizeof(float), z->compute);
    collectives_join(c, z->compute);  // the next forward resets the activations' entries after it
    collectives_all_reduce_sum_bf16(c, m->norms, m->norms_elems, c->stream);
    for (int b = 0; b < z->plan.buckets; b++) {
        const ParamShardRange *r = &z->plan.bucket[b];
        if (zero_bucket_is_layers(&z->plan, b)) zero_gather_layers_e4m3(z, b, master);
        else collectives_all_gather(c, m->params + zero_params_at(z, b), 2 * r->part, z->compute);
        cudaCheck(cudaEventRecord(z->params_gathered[b], c->stream));
        z->gathering[b] = 1;
    }
}

// After the optimizer stepped this rank's parts of the parameters (on the compute stream; its
// FP32 master weights `master`, the parts back to back): every rank gets all of the weights the
// model reads, a bucket at a time in the forward's order (the parameter order).
static inline void zero_gather_params(Zero *z, const float *master) {
    LlamaModel *m = z->model;
    if (m->precision.weights_from_master) {
        int sharded = z->plan.shards > 1;
        if (sharded) cudaCheck(cudaMemsetAsync(m->norms, 0, 2 * m->norms_elems, z->compute));
        zero_norms_from_master(z, master);
        zero_weights_amax_mine(z, master);
        if (sharded) zero_gather_from_master(z, master);
        else zero_cast_weights_from_master(z, master);
        m->fp8_weights_current = 1;  // the codes, once zero_params_ready has waited for them
        return;
    }
    model_weights_changed(m);
    if (z->plan.stage == 0 || z->comm->world == 1) return;
    Collectives *c = &z->collectives;
    for (int b = 0; b < z->plan.buckets; b++) {
        collectives_all_gather(c, m->params + zero_params_at(z, b), 2 * z->plan.bucket[b].part, z->compute);
        cudaCheck(cudaEventRecord(z->params_gathered[b], c->stream));
        z->gathering[b] = 1;
    }
}
