// Data parallelism's one home: the ZeRO plan of coat/zero.h run on the GPU over the collectives
// of coat/collectives.cuh, behind a few calls that the trainer makes and the model's hooks.
//   zero_model_layout / zero_grads_elems   the device buffers the model allocates for the plan
//   zero_attach                            the collectives, the hooks on the model, this rank's buffers
//   zero_step_begin, zero_micro_batch      the gradient accumulators zeroed; which micro-batch reduces
//   zero_gradients_done                    the compute stream waits for the gradients' reduces
//   zero_gather_params                     after the optimizer wrote this rank's parts of the parameters
// Backward (the hooks): as backward finishes the last segment of a bucket, the bucket's gradient
// is all-reduced (stage 0) or reduce-scattered (stages 1, 2) on the collectives' stream while
// backward goes on. Stage 0 and 1 reduce in the step's last micro-batch (the others accumulate in
// BF16, as on one rank); stage 1 into this rank's BF16 gradient shard, its parts back to back;
// stage 2 in every micro-batch, from one of two bucket buffers (backward writes bucket b into
// buffer b % 2, once the reduce of bucket b + 2 is done with it), each rank adding its part into
// the FP32 sum of its shard.
// Forward: after the step each bucket's parameters are all-gathered, in the order the forward
// reads them; the forward waits for each bucket just before its first read (`ready`), so the gather
// overlaps it. The E4M3 gather (param_gather, with FP8 GEMMs): the owners cast their parts of the
// block's linear weights to the codes the FP8 GEMMs read, with each weight's amax over all ranks
// (one max all-reduce of the scale table), and each bucket of layers travels as one byte per
// element through a staging buffer, from which every rank copies each weight's codes into its
// place; the layers' norms travel in one table that the owners fill and one all-reduce sums, and
// each layer's transposes are written once its bucket is here. Every rank ends with the codes and
// scales of model_cast_weights, bit for bit. The BF16 copies of the block weights then go stale on
// the ranks that do not own them: with FP8 GEMMs nothing reads them (checkpoints come from the
// master weights).
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
    bf16 *norm_table;               // the E4M3 gather: every layer's two norms
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
                              CollectivesBackend backend, int e4m3_gather, double timeout_s, char *error, size_t error_size) {
    memset(z, 0, sizeof(*z));
    z->plan = *plan;
    z->comm = comm;
    z->model = model;
    z->compute = compute;
    z->collectives.comm = comm;  // one rank: the waits and the one-rank shortcuts only
    if (comm->world <= 1) return 0;
    z->e4m3_gather = e4m3_gather && plan->stage >= 1;
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
    if (z->e4m3_gather) {
        z->e4m3_staging = (uint8_t *)zero_alloc(z, plan->largest_layer_bucket_elems, "the E4M3 gather's staging");
        z->norm_table = (bf16 *)zero_alloc(z, 2 * zero_norm_table_elems(&model->layout), "the E4M3 gather's norm table");
    }
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
    if (z->norm_table) cudaCheck(cudaFree(z->norm_table));
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

// The linear weight `which` of `layer` as far as it lies in this rank's part of bucket b, in the
// device buffers: [*begin, *end) (empty: equal), and where the weight starts there.
static inline size_t zero_owned_linear(const Zero *z, int b, int layer, Linear which, size_t *begin, size_t *end) {
    const ParamLayout *layout = &z->model->layout;
    ZeroRange weight = zero_linear_range(layout, which, layer);
    ZeroRange mine = zero_intersection(weight, zero_owned(&z->plan, b, z->comm->rank));
    int segment = layout->shape.n_layers - layer;
    *begin = param_buffer_at(layout, segment, mine.begin);
    *end = *begin + (mine.end - mine.begin);
    return param_buffer_at(layout, segment, weight.begin);
}

// Every weight's amax slot = max |w| over its elements in this rank's parts (0 where it has none).
static inline void zero_weights_amax_mine(Zero *z) {
    LlamaModel *m = z->model;
    for (int l = 0; l < m->shape.n_layers; l++)
        for (int i = 0; i < LINEARS; i++) {
            Fp8Scale *slot = model_fp8_scale(m, l, FP8_SLOT_WEIGHT, (Linear)i);
            size_t begin, end;
            zero_owned_linear(z, z->plan.bucket_of[m->shape.n_layers - l], l, (Linear)i, &begin, &end);
            cudaCheck(cudaMemsetAsync(slot, 0, sizeof(Fp8Scale), z->compute));
            if (end > begin) fp8_amax(slot, m->params + begin, end - begin, z->compute);
        }
}

// The norm table: this rank's parts of every layer's norms into their places (the rest zero)
// before the sum, and every norm from it after.
static inline void zero_norm_table_copy(Zero *z, int into_table, cudaStream_t s) {
    LlamaModel *m = z->model;
    const ParamLayout *layout = &m->layout;
    ParamKind norms[2] = {PARAM_ATTN_NORM, PARAM_MLP_NORM};
    size_t at = 0;
    int L = m->shape.n_layers;
    for (int l = 0; l < L; l++)
        for (int k = 0; k < 2; k++) {
            ZeroRange norm = zero_tensor_range(layout, norms[k], l), copy = norm;
            if (into_table) copy = zero_intersection(norm, zero_owned(&z->plan, z->plan.bucket_of[L - l], z->comm->rank));
            if (copy.end > copy.begin) {
                bf16 *param = m->params + param_buffer_at(layout, L - l, copy.begin);
                bf16 *entry = z->norm_table + at + (copy.begin - norm.begin);
                cudaCheck(cudaMemcpyAsync(into_table ? entry : param, into_table ? param : entry, 2 * (copy.end - copy.begin),
                                          cudaMemcpyDeviceToDevice, s));
            }
            at += layout->padded[norms[k]];
        }
}

// A bucket of layers in E4M3, on the collectives' stream: this rank's codes into its part of the
// staging, the all-gather, each weight's codes out to where the FP8 GEMMs read them.
static inline void zero_gather_layers_e4m3(Zero *z, int b) {
    LlamaModel *m = z->model;
    const ParamShardRange *r = &z->plan.bucket[b];
    Collectives *c = &z->collectives;
    int L = m->shape.n_layers;
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            size_t begin, end;
            zero_owned_linear(z, b, L - s, (Linear)i, &begin, &end);
            if (end > begin)
                fp8_quantize(z->e4m3_staging + (begin - r->at), NULL, model_fp8_scale(m, L - s, FP8_SLOT_WEIGHT, (Linear)i),
                             m->params + begin, (int)((end - begin) / PARAM_ALIGN_ELEMS), PARAM_ALIGN_ELEMS, FP8_E4M3, c->stream);
        }
    collectives_all_gather(c, z->e4m3_staging, r->part, c->stream);
    for (int s = z->plan.first_segment[b]; s <= z->plan.last_segment[b]; s++)
        for (int i = 0; i < LINEARS; i++) {
            size_t begin, end, weight_at = zero_owned_linear(z, b, L - s, (Linear)i, &begin, &end);
            LinearShape shape = linear_shape(m, (Linear)i);
            cudaCheck(cudaMemcpyAsync(linear_fp8_weight(m, L - s, (Linear)i, 0), z->e4m3_staging + (weight_at - r->at),
                                      (size_t)shape.in * shape.out, cudaMemcpyDeviceToDevice, c->stream));
        }
}

// After the optimizer wrote this rank's parts of the BF16 parameters (on the compute stream):
// every rank gets all of them, a bucket at a time in the forward's order (the parameter order).
static inline void zero_gather_params(Zero *z) {
    LlamaModel *m = z->model;
    if (z->plan.stage == 0 || z->comm->world == 1) {
        model_weights_changed(m);
        return;
    }
    Collectives *c = &z->collectives;
    if (z->e4m3_gather) {
        zero_weights_amax_mine(z);
        cudaCheck(cudaMemsetAsync(z->norm_table, 0, 2 * zero_norm_table_elems(&m->layout), z->compute));
        zero_norm_table_copy(z, 1, z->compute);
        // The whole scale table: the activations' and gradients' entries, reset by every forward, ride along.
        collectives_all_reduce_max_f32(c, (float *)m->fp8_scales, m->working_layout.fp8_scales_bytes / sizeof(float), z->compute);
        collectives_join(c, z->compute);  // the next forward resets the activations' entries after it
        collectives_all_reduce_sum_bf16(c, z->norm_table, zero_norm_table_elems(&m->layout), c->stream);
        zero_norm_table_copy(z, 0, c->stream);
    }
    for (int b = 0; b < z->plan.buckets; b++) {
        const ParamShardRange *r = &z->plan.bucket[b];
        if (z->e4m3_gather && zero_bucket_is_layers(&z->plan, b)) zero_gather_layers_e4m3(z, b);
        else collectives_all_gather(c, m->params + r->at, 2 * r->part, z->compute);
        cudaCheck(cudaEventRecord(z->params_gathered[b], c->stream));
        z->gathering[b] = 1;
    }
    if (z->e4m3_gather) m->fp8_weights_current = 1;  // the codes, once zero_params_ready has waited for them
    else model_weights_changed(m);
}
