// GPU memory per rank, planned from the config before anything is allocated: parameters,
// gradients, master weights, optimizer states, saved activations and working buffers.
// dry_run prints it; the trainer allocates exactly these buffers and refuses a micro-batch
// that does not fit. Bytes per parameter with FP32 states (coat/README.md, Memory per parameter):
// ZeRO-1 4P + 14P/N, ZeRO-2 2P + 16P/N plus two BF16 bucket buffers (coat/zero.h pads each bucket
// to N equal parts, a few elements more); with FP8 GEMMs casting from the master weights 2 bytes
// less for each block linear weight, which has no BF16 copy (its E4M3 copies are working buffers).
// ZeRO-3 16P/N (14P/N with one micro-batch per step: a BF16 gradient shard) plus the two bucket
// buffers, the embedding's and the tail's BF16 (and with FP8 GEMMs the layers' norms) on every
// rank, and two gather slots of the largest bucket of layers (with FP8 GEMMs E4M3, and the room
// for one bucket's transposes) in place of every layer's working weights. Three optional buffers
// are not in the total: the trainer takes them where they fit beside it (memory_plan_optional).
#pragma once
#include <stdio.h>
#include "activations.h"
#include "config.h"
#include "cublaslt_workspace.h"
#include "linears.h"
#include "optimizer_states.h"
#include "params.h"
#include "zero.h"

#define CLASSIFIER_CHUNK_ROWS 4096  // logits rows per lm_head + cross-entropy chunk (4096 x 32000 BF16: 250 MB)

// Buffers reused by every layer, carved from one allocation: the forward branch output (also
// the norm output before its FP8 cast, and the backward's norm gradient), the residual-stream
// gradient, the widest block intermediates and their gradients, RoPE tables, one classifier
// chunk of logits and the kernels' scratch. With FP8 GEMMs also: the E4M3 input of the current
// GEMM (in backward: the remade transpose of an input saved in BF16), the E5M2 output gradient
// and its transpose, every layer's E4M3 weights (cast once per optimizer step) and one layer's
// transposes (remade from them as its backward starts; none at ZeRO stage 3, which gathers the
// weights a bucket at a time, coat/zero.h); the table of
// per-tensor FP8 scales (also for FP8 activations with BF16 GEMMs). With
// COAT's 1x16 copies of the residual stream, the BF16 residual stream, updated in place (only
// the copies are saved); with those of gate_up, the forward's BF16 gate_up output (before its
// 1x16 cast) lives in the two output-gradient buffers, idle in forward (with BF16 GEMMs: in
// wide, idle in forward too).
typedef struct {
    size_t branch, d_residual, wide, rope_cos, rope_sin, logits, kernel_scratch, small;  // byte offsets
    size_t residual, fp8_input, fp8_grad, fp8_grad_t, fp8_weights, fp8_scales;         // 0 bytes when unused
    size_t wide_elems_per_token;
    size_t logits_chunk_rows, logits_stride;
    size_t kernel_scratch_bytes;
    size_t residual_bytes, fp8_input_bytes, fp8_grad_bytes, fp8_weights_bytes, fp8_scales_bytes;
    size_t total_bytes;
} WorkingLayout;

#define FP8_SCALE_BYTES 16           // one Fp8Scale (coat/fp8.cuh)

static inline size_t max_size(size_t a, size_t b) { return a > b ? a : b; }

static inline void working_layout_init(WorkingLayout *w, const ModelShape *m, int micro_batch_size, int seq_len,
                                       int fp8_gemms, ActivationsChoice activations, int layers_gathered) {
    size_t H = (size_t)m->dim, I = (size_t)m->ffn_dim, hd = (size_t)model_head_dim(m), NH = (size_t)m->n_heads;
    size_t qkv = (NH + 2 * (size_t)m->n_kv_heads) * hd, attn = NH * hd;
    size_t tokens = (size_t)micro_batch_size * (size_t)seq_len;
    // Backward holds d_swiglu [I] beside d_gate_up [2I] (BF16 GEMMs; FP8 GEMMs cast d_gate_up
    // straight from d_swiglu), or d_attn_out beside d_qkv. The forward does not use it.
    size_t swiglu_grads = fp8_gemms ? I : 3 * I;
    w->wide_elems_per_token = swiglu_grads > qkv + attn ? swiglu_grads : qkv + attn;
    w->logits_chunk_rows = tokens < CLASSIFIER_CHUNK_ROWS ? tokens : CLASSIFIER_CHUNK_ROWS;
    w->logits_stride = ((size_t)m->vocab_size + 7) / 8 * 8;
    // Bound on what the kernels ask for (embedding backward's sort and partial sums, RMSNorm
    // backward's partial sums, attention backward's row sums, the gradient norm's partials);
    // the model checks the real needs against it at start.
    w->kernel_scratch_bytes = tokens * (H / 4 + 4 * NH + 64) + (8u << 20);
    size_t in[LINEARS], out[LINEARS], widest_in = 0, widest_out = 0;
    linear_shapes(m, in, out);
    for (int i = 0; i < LINEARS; i++) {
        widest_in = max_size(widest_in, in[i]);
        widest_out = max_size(widest_out, out[i]);
    }
    w->residual_bytes = activations_group_residual(activations) ? 2 * tokens * H : 0;
    w->fp8_input_bytes = fp8_gemms ? tokens * widest_in : 0;
    w->fp8_grad_bytes = fp8_gemms ? tokens * widest_out : 0;
    w->fp8_weights_bytes = fp8_gemms && !layers_gathered ? linear_layer_weight_elems(m) * ((size_t)m->n_layers + 1) : 0;
    int any_fp8 = fp8_gemms || activations != ACTS_BF16;
    w->fp8_scales_bytes = any_fp8 ? FP8_SCALE_BYTES * FP8_SCALES_PER_LAYER * (size_t)m->n_layers : 0;
    size_t at = 0;
    w->branch = at;         at += align256(2 * tokens * H);
    w->d_residual = at;     at += align256(2 * tokens * H);
    w->wide = at;           at += align256(2 * tokens * w->wide_elems_per_token);
    w->rope_cos = at;       at += align256(4 * (size_t)seq_len * hd / 2);
    w->rope_sin = at;       at += align256(4 * (size_t)seq_len * hd / 2);
    w->logits = at;         at += align256(2 * w->logits_chunk_rows * w->logits_stride);
    w->kernel_scratch = at; at += align256(w->kernel_scratch_bytes);
    w->residual = at;       at += align256(w->residual_bytes);
    w->fp8_input = at;      at += align256(w->fp8_input_bytes);
    w->fp8_grad = at;       at += align256(w->fp8_grad_bytes);
    w->fp8_grad_t = at;     at += align256(w->fp8_grad_bytes);
    w->fp8_weights = at;    at += align256(w->fp8_weights_bytes);
    w->fp8_scales = at;     at += align256(w->fp8_scales_bytes);
    w->small = at;          at += 256;
    w->total_bytes = at;
}

typedef struct {
    int ranks;
    int shard_group;           // hybrid sharding's group of ranks (coat/zero.h), 0: flat
    int micro_batch_size;
    size_t params_padded;      // elements of the parameter order
    size_t shard_elems;        // elements this rank's optimizer owns: its parts of the buckets
    size_t params_bytes;       // BF16 working weights
    size_t grads_bytes;        // gradients (coat/zero.h: BF16, with ZeRO-1 a BF16 shard too, with ZeRO-2 an FP32 shard and two buckets)
    size_t master_bytes;       // FP32 master weights
    size_t states_bytes;       // AdamW m and v
    size_t activations_bytes;  // saved for backward, all layers
    size_t working_bytes;      // reused across layers (WorkingLayout), the cuBLASLt workspace, the collectives' scalars
    size_t gather_bytes;       // ZeRO-3: the gather slots of the buckets of layers (coat/zero.h)
    size_t total_bytes;
    size_t attention_ds_bytes; // not in total_bytes: taken where it fits beside them (attention_ds_plan_bytes)
    size_t attention_out_t_bytes;    // nor these: taken where they also fit (attention_out_t_plan_bytes,
    size_t weight_transposes_bytes;  // weight_transposes_plan_bytes)
} MemoryPlan;

// Which of the optional buffers a model has (memory_plan_optional).
typedef struct {
    int attention_ds, attention_out_t, weight_transposes;
} OptionalBuffers;

// The attention backward's optional buffer at head_dim 128: dS^T of one layer in BF16, in the 64 x 64
// tiles on and below the diagonal of each (sequence, query head) (coat/attention.cuh,
// attention_backward_ds_bytes). Given it, the dQ pass multiplies the stored dS by K instead of
// recomputing it, 1.1-1.2x faster; without it the results are the same bits.
static inline size_t attention_ds_plan_bytes(const ModelShape *m, int micro_batch_size, int seq_len) {
    if (model_head_dim(m) != 128) return 0;
    size_t tiles = ((size_t)seq_len + 63) / 64;
    return (size_t)micro_batch_size * (size_t)m->n_heads * tiles * (tiles + 1) / 2 * 64 * 64 * 2;
}

// With FP8 GEMMs: every layer's E4M3 transpose of the attention output [NH hd, tokens], the
// out-projection's weight-gradient operand. The output itself stays BF16 (the attention backward
// reads it); given these, the forward's cast writes the transpose beside the codes and the
// backward does not remake it from the BF16 output (the same codes either way).
static inline size_t attention_out_t_plan_bytes(const ModelShape *m, int fp8_gemms, size_t tokens) {
    return fp8_gemms ? (size_t)m->n_layers * tokens * (size_t)m->n_heads * model_head_dim(m) : 0;
}

// With FP8 GEMMs and the layers' E4M3 weights among the working buffers: the W^T codes of every
// layer but the last, which the working buffers' one layer of transposes holds. Given them, the
// weights' cast writes every W^T once per optimizer step and the backward remakes none (once per
// micro-batch and layer otherwise); the GEMMs read the same codes either way.
static inline size_t weight_transposes_plan_bytes(const ModelShape *m, int fp8_gemms, int layers_gathered) {
    return fp8_gemms && !layers_gathered ? linear_layer_weight_elems(m) * ((size_t)m->n_layers - 1) : 0;
}

// Outside the layers: final residual and norm output (BF16), the final rstd, the per-token loss,
// and the input and target ids, each 256-byte aligned.
static inline size_t final_activation_bytes(const ModelShape *m, size_t tokens) {
    return 2 * align256(2 * tokens * (size_t)m->dim) + 4 * align256(4 * tokens);
}

// Micro-batches per rank and step at this micro-batch and world size (total_batch_tokens 0: one),
// or 0 where total_batch_tokens is no multiple of a micro-step's tokens (a config the trainer
// refuses; planned as several).
static inline int memory_plan_micro_batches(const TrainConfig *c, int ranks, int micro_batch_size) {
    long long per_micro_step = (long long)micro_batch_size * c->seq_len * ranks;
    if (c->total_batch_tokens == 0) return 1;
    return c->total_batch_tokens % per_micro_step == 0 ? (int)(c->total_batch_tokens / per_micro_step) : 0;
}

static inline void memory_plan_compute(MemoryPlan *plan, const TrainConfig *c, int ranks, int micro_batch_size) {
    ParamLayout layout;
    const ModelShape *m = &c->model;
    param_layout_init(&layout, m);
    size_t tokens = (size_t)micro_batch_size * (size_t)c->seq_len;
    ActivationsChoice acts = config_activations(c);
    ZeroPlan zero;
    zero_plan_init_groups(&zero, &layout, ranks, c->shard_group, ranks > 1 ? c->zero_stage : 0, (size_t)c->bucket_min_elems);
    zero_plan_micro_batches(&zero, memory_plan_micro_batches(c, ranks, micro_batch_size));
    int layers_gathered = zero_layers_gathered(&zero);

    plan->ranks = ranks;
    plan->shard_group = zero_hybrid(&zero) ? zero.shards : 0;
    plan->micro_batch_size = micro_batch_size;
    plan->params_padded = layout.total_padded;
    plan->shard_elems = zero.shard_elems;
    // Without BF16 block weights: the embedding's and the tail's buckets, and the layers' norms;
    // at ZeRO-3 in BF16 the embedding's and the tail's buckets (the layers are in the gather slots).
    ParamLayout buffers = layout, params;
    zero_place_segments(&zero, &buffers);
    param_layout_without_layers(&params, &buffers);
    plan->params_bytes = config_weights_from_master(c) ? 2 * (params.buffer_elems + param_norm_table_elems(&layout))
                       : layers_gathered               ? 2 * params.buffer_elems
                                                       : 2 * zero.buffer_elems;
    // ZeRO-2 and 3: two BF16 buffers of the largest bucket (one fills while the other is reduced)
    // and the shard's sum (FP32, or BF16 at ZeRO-3 with one micro-batch); ZeRO-1: the whole BF16
    // gradient and the rank's BF16 shard of its sum; otherwise the whole BF16 gradient.
    plan->grads_bytes = 2 * zero_grads_elems(&zero) + zero_grad_shard_bytes(&zero);
    plan->master_bytes = 4 * plan->shard_elems;
    // beside the FP32 master weights: m, v, their group scalars and the decay table
    plan->states_bytes = adamw_state_bytes(adamw_kind_from_config(config_optimizer_states(c)), plan->shard_elems) -
                         4 * plan->shard_elems;

    plan->activations_bytes = (size_t)m->n_layers * activation_layer_bytes(m, acts, tokens) + final_activation_bytes(m, tokens);
    WorkingLayout working;
    working_layout_init(&working, m, micro_batch_size, c->seq_len, config_fp8_gemms(c), acts, layers_gathered);
    int e4m3_gather = zero.shards > 1 && config_weights_from_master(c);
    plan->working_bytes = working.total_bytes + CUBLASLT_WORKSPACE_BYTES + (ranks > 1 ? ZERO_SCALAR_BYTES : 0) +
                          (e4m3_gather ? zero_e4m3_gather_bytes(&zero) : 0);  // coat/zero.cuh's
    plan->gather_bytes = zero_layer_gather_bytes(&zero, m, config_fp8_gemms(c));
    plan->total_bytes = plan->params_bytes + plan->grads_bytes + plan->master_bytes + plan->states_bytes +
                        plan->activations_bytes + plan->working_bytes + plan->gather_bytes;
    plan->attention_ds_bytes = attention_ds_plan_bytes(m, micro_batch_size, c->seq_len);
    plan->attention_out_t_bytes = attention_out_t_plan_bytes(m, config_fp8_gemms(c), tokens);
    plan->weight_transposes_bytes = weight_transposes_plan_bytes(m, config_fp8_gemms(c), layers_gathered);
}

// Whether `bytes` (0: not planned) fit beside *used in budget_bytes; if so they are taken.
static inline int memory_plan_take(size_t bytes, size_t *used, size_t budget_bytes) {
    if (bytes == 0 || *used + bytes > budget_bytes) return 0;
    *used += bytes;
    return 1;
}

// What of the optional buffers fits beside the plan's total in budget_bytes, in the order of the
// time each saves per byte: the attention dS, the attention output's transposes, the weights'.
static inline OptionalBuffers memory_plan_optional(const MemoryPlan *plan, size_t budget_bytes) {
    size_t used = plan->total_bytes;
    OptionalBuffers o;
    o.attention_ds = memory_plan_take(plan->attention_ds_bytes, &used, budget_bytes);
    o.attention_out_t = memory_plan_take(plan->attention_out_t_bytes, &used, budget_bytes);
    o.weight_transposes = memory_plan_take(plan->weight_transposes_bytes, &used, budget_bytes);
    return o;
}

// The bytes of the optional buffers `o` takes.
static inline size_t memory_plan_optional_bytes(const MemoryPlan *plan, OptionalBuffers o) {
    return (o.attention_ds ? plan->attention_ds_bytes : 0) + (o.attention_out_t ? plan->attention_out_t_bytes : 0) +
           (o.weight_transposes ? plan->weight_transposes_bytes : 0);
}

// Largest micro-batch whose plan fits in `budget_bytes` (0 if even 1 does not).
static inline int memory_plan_largest_micro_batch(const TrainConfig *c, int ranks, size_t budget_bytes) {
    MemoryPlan plan;
    int fits = 0;
    for (int b = 1; b <= 1 << 16; b++) {
        memory_plan_compute(&plan, c, ranks, b);
        if (plan.total_bytes > budget_bytes) break;
        fits = b;
    }
    return fits;
}

// Smallest number of ranks whose per-rank plan at micro_batch_size fits in `budget_bytes`, at the
// config's ZeRO stage (1 rank: none), scanning 1 to MEMORY_PLAN_MAX_RANKS (padding makes the plan
// not quite monotone in the ranks); 0 if none does. *bytes: that plan's total, or the total at
// MEMORY_PLAN_MAX_RANKS (what every rank holds whatever their number) when none fits. With
// shard_group N > 1 only multiples of N can run, and each rank holds what a flat run on N ranks
// holds: N ranks or none.
#define MEMORY_PLAN_MAX_RANKS 65536
static inline int memory_plan_smallest_ranks(const TrainConfig *c, int micro_batch_size, size_t budget_bytes, size_t *bytes) {
    MemoryPlan plan;
    int grouped = c->zero_stage != 0 && c->shard_group > 1, first = grouped ? c->shard_group : 1;
    for (int ranks = first; ranks <= MEMORY_PLAN_MAX_RANKS; ranks++) {
        memory_plan_compute(&plan, c, ranks, micro_batch_size);
        if (plan.total_bytes <= budget_bytes) {
            *bytes = plan.total_bytes;
            return ranks;
        }
        if (c->zero_stage == 0 && ranks > 1) break;  // nothing is sharded: more ranks never fit
        if (grouped) break;                          // more groups shard no further
    }
    if (c->zero_stage != 0 && !grouped) memory_plan_compute(&plan, c, MEMORY_PLAN_MAX_RANKS, micro_batch_size);
    *bytes = plan.total_bytes;
    return 0;
}

static inline double gib(size_t bytes) { return (double)bytes / (1024.0 * 1024.0 * 1024.0); }

static inline void memory_plan_print(FILE *out, const MemoryPlan *plan, const TrainConfig *c) {
    char precision[16], states[16], acts[16];
    const ConfigKey *kp = config_find_key("precision"), *ks = config_find_key("optimizer_states"),
                    *ka = config_find_key("activations");
    config_choice_name(kp->choices, c->precision, precision, sizeof(precision));
    config_choice_name(ks->choices, config_optimizer_states(c), states, sizeof(states));
    config_choice_name(ka->choices, config_activations(c), acts, sizeof(acts));
    double p = (double)plan->params_padded;
    char group[64] = "";
    if (plan->shard_group > 1)
        snprintf(group, sizeof(group), ", sharded within groups of %d (shard_group)", plan->shard_group);
    fprintf(out, "memory plan per rank: precision %s, optimizer states %s, activations %s, "
                 "micro-batch %d x %d tokens, %d rank(s), ZeRO stage %d%s\n",
            precision, states, acts, plan->micro_batch_size, c->seq_len, plan->ranks, c->zero_stage, group);
    const char *where = config_weights_from_master(c) ? plan->gather_bytes ? "; the block's linear weights in E4M3 only, in the layer gather"
                                                                           : "; the block's linear weights in E4M3 only, among the working buffers"
                      : plan->gather_bytes ? "; the layers in the layer gather only" : "";
    fprintf(out, "  %-22s %9.3f GiB  (%5.2f bytes/param%s)\n", "parameters (bf16)", gib(plan->params_bytes), plan->params_bytes / p,
            where);
    fprintf(out, "  %-22s %9.3f GiB  (%5.2f bytes/param)\n", "gradients", gib(plan->grads_bytes), plan->grads_bytes / p);
    fprintf(out, "  %-22s %9.3f GiB  (%5.2f bytes/param)\n", "master weights (fp32)", gib(plan->master_bytes), plan->master_bytes / p);
    fprintf(out, "  %-22s %9.3f GiB  (%5.2f bytes/param)\n", "optimizer states", gib(plan->states_bytes), plan->states_bytes / p);
    fprintf(out, "  %-22s %9.3f GiB\n", "activations (saved)", gib(plan->activations_bytes));
    fprintf(out, "  %-22s %9.3f GiB\n", "working buffers", gib(plan->working_bytes));
    if (plan->gather_bytes)
        fprintf(out, "  %-22s %9.3f GiB  (ZeRO-3: %d slots of a bucket of layers%s)\n", "layer gather", gib(plan->gather_bytes),
                ZERO_GATHER_SLOTS, config_fp8_gemms(c) ? " in e4m3, one bucket's transposes" : " in bf16");
    fprintf(out, "  %-22s %9.3f GiB\n", "total", gib(plan->total_bytes));
    if (plan->attention_ds_bytes)
        fprintf(out, "  %-22s %9.3f GiB  (attention dS, for a faster backward, where it fits beside the total)\n",
                "and if free", gib(plan->attention_ds_bytes));
    if (plan->attention_out_t_bytes)
        fprintf(out, "  %-22s %9.3f GiB  (every layer's E4M3 transpose of the attention output, where it fits beside those)\n",
                "and if free", gib(plan->attention_out_t_bytes));
    if (plan->weight_transposes_bytes)
        fprintf(out, "  %-22s %9.3f GiB  (every layer's E4M3 W^T, cast once per step, where it fits beside those)\n",
                "and if free", gib(plan->weight_transposes_bytes));
}
