// The speed of light of each op the trainer times (profile = 1, coat/op_timer.cuh): the least
// GPU time the op's work of one optimizer step could take at the H200's limits.
//   GEMMs, attention:  time = tensor-core FLOPs / peak   (dense: 989 TFLOP/s BF16, 1979 FP8)
//   everything else:   time = bytes read + written / 4.23 TB/s
// The bandwidth is the measured device-to-device copy rate counting read + write, which is what a
// streaming kernel can reach; the HBM datasheet's 4.8 TB/s is not reachable by a copy.
// Each op's work is what its kernels read and write, each byte once (a row a kernel reads again
// from its cache is not counted again), summed over the op's calls in one step of
// micro_batches micro-batches of B x T tokens, in the run's precision (coat/activations.h for
// which activations are stored how, coat/optimizer_states.h for AdamW's states). A GEMM's cast
// to FP8 is an op of its own (the trainer marks it apart). Ops whose time is set by waiting or by
// the data (the batch upload, the gathers and reduces, the embedding's sorted backward) get none.
// Plain C: the trainer prints the table; test/test_speed_of_light.c checks it by hand.
#pragma once
#include <stddef.h>
#include <string.h>
#include "activations.h"
#include "linears.h"
#include "optimizer_states.h"
#include "params.h"

#define SOL_BF16_FLOP_PER_S 989e12   // H200 dense BF16 tensor cores
#define SOL_FP8_FLOP_PER_S 1979e12   // H200 dense FP8 tensor cores
#define SOL_BYTES_PER_S 4.23e12      // H200 device copy, read + write counted
#define SOL_MAX_OPS 64  // distinct op names

// What one step of the run does, as the trainer knows it.
typedef struct {
    ModelShape shape;
    int B, T, micro_batches;
    int fp8_gemms;                // FP8 GEMMs for the block's linear layers
    ActivationsChoice activations;  // resolved (not ACTS_AUTO)
    OptimizerStateKind states;
    size_t zeroed_grad_bytes;     // the gradient buffer the step zeroes at its start (0: the first writers write)
    size_t optimizer_elems;       // elements the gradient norm and AdamW cover on this GPU
    int fp32_grads;               // they read FP32 gradient sums (ZeRO stage 2), not BF16
    int casts_weights;            // this GPU casts the FP8 weights once per step (not gathered as codes)
    int casts_from_master;        // ... from the FP32 master weights (no BF16 block weights), not BF16 ones
    int weights_amax_in_step;     // ... with their amax gathered by AdamW's step (no pass of its own)
    int casts_weight_transposes;  // ... writing every layer's W^T beside its W (kept for every backward)
    int transposes_weights;       // backward remakes each layer's W^T from its codes (FP8 GEMMs, not ZeRO stage 3)
    int keeps_attention_out_t;    // the forward's cast saves the attention output's transpose (FP8 GEMMs)
    size_t params_written_elems;  // BF16 parameters AdamW writes on this GPU (none of the block weights without them)
} SolRun;

typedef struct {
    const char *op;         // the name the trainer marks it with
    double calls;           // per step
    double flops;           // tensor-core FLOPs per step
    int fp8;                // at the FP8 peak
    double bytes;           // read + written per step
    const char *unbounded;  // why it has no speed of light; NULL when it has one
} SolOp;

typedef struct {
    SolOp ops[SOL_MAX_OPS];
    int n;
} SolTable;

// One GPU, no sharding: the whole BF16 gradient buffer zeroed, normed and stepped.
static inline SolRun sol_run_one_gpu(const ModelShape *shape, int B, int T, int micro_batches, int fp8_gemms,
                                     ActivationsChoice activations, OptimizerStateKind states) {
    ParamLayout layout;
    param_layout_init(&layout, shape);
    SolRun run = {*shape, B, T, micro_batches, fp8_gemms, activations, states,
                  0, layout.total_padded, 0, fp8_gemms, 0, 0, 0, fp8_gemms, 0, layout.total_padded};
    return run;
}

static inline SolOp *sol_find(SolTable *table, const char *op) {
    for (int i = 0; i < table->n; i++)
        if (strcmp(table->ops[i].op, op) == 0) return &table->ops[i];
    return NULL;
}

// Adds `calls` calls of `op`, each of the given work (an op called with several shapes is
// added once per shape). The entry exists from the first add, with zero calls where the run
// never does the op.
static inline void sol_add(SolTable *table, const char *op, double calls, double flops_each, int fp8, double bytes_each) {
    SolOp *entry = sol_find(table, op);
    if (entry == NULL && table->n < SOL_MAX_OPS) {
        entry = &table->ops[table->n++];
        memset(entry, 0, sizeof(*entry));
        entry->op = op;
    }
    if (entry == NULL) return;
    entry->calls += calls;
    entry->flops += calls * flops_each;
    entry->fp8 = fp8;
    entry->bytes += calls * bytes_each;
}

static inline void sol_unbounded(SolTable *table, const char *op, const char *why) {
    sol_add(table, op, 0, 0, 0, 0);
    sol_find(table, op)->unbounded = why;
}

// Milliseconds per step at the speed of light; -1 for an op without one.
static inline double sol_ms(const SolOp *op) {
    if (op == NULL || op->unbounded != NULL) return -1.0;
    double peak = op->fp8 ? SOL_FP8_FLOP_PER_S : SOL_BF16_FLOP_PER_S;
    double compute = op->flops / peak, memory = op->bytes / SOL_BYTES_PER_S;
    return 1e3 * (compute > memory ? compute : memory);
}

// Bytes of n values in 1x16 E4M3 groups (codes and BF16 scales).
static inline double sol_group16_bytes(double n) { return (double)activation_bytes(STORE_E4M3_GROUP16, (size_t)n); }

// The four linear layers: forward GEMM, backward's two GEMMs, and the FP8 casts around them
// (coat/model.cuh, linear_forward and linear_backward), per micro-batch.
static inline void sol_add_linears(SolTable *t, const SolRun *r, double per_layer) {
    static const char *forward[LINEARS] = {"matmul qkv forward", "matmul attention output forward",
                                           "matmul gate_up forward", "matmul down forward"};
    static const char *backward[LINEARS] = {"matmul qkv backward", "matmul attention output backward",
                                            "matmul gate_up backward", "matmul down backward"};
    size_t in[LINEARS], out[LINEARS];
    linear_shapes(&r->shape, in, out);
    double N = (double)r->B * r->T;
    int fp8 = r->fp8_gemms, acts_bf16 = r->activations == ACTS_BF16;
    for (int i = 0; i < LINEARS; i++) {
        double x = N * in[i], dy = N * out[i];
        int saved_fp8 = !acts_bf16 && i != LINEAR_OUT;  // the attention output is saved in BF16
        int kept_t = fp8 && i == LINEAR_OUT && r->keeps_attention_out_t;  // ... and its transpose where it fits
        sol_add(t, forward[i], per_layer, 2 * x * out[i], fp8, 0);
        sol_add(t, backward[i], per_layer, 4 * x * out[i], fp8, 0);
        // BF16 GEMMs: an FP8-saved input is cast to its transpose in forward, back to BF16 in backward.
        sol_add(t, "fp8 cast of a linear input (saved transpose)", !fp8 && saved_fp8 ? per_layer : 0, 0, 0, 3 * x);
        sol_add(t, "fp8 saved input back to BF16", !fp8 && saved_fp8 ? per_layer : 0, 0, 0, 3 * x);
        // FP8 GEMMs: every BF16 input is cast (the norm outputs and the SwiGLU output saved in FP8
        // are cast by the norms' and swiglu's own ops), with its saved transpose where the table
        // stores one; a BF16-saved input is cast to its transpose in backward; output gradients to
        // E5M2 and their transposes (gate_up's by swiglu's backward cast).
        int input_cast = fp8 && (!saved_fp8 || acts_bf16);
        sol_add(t, "fp8 cast of a linear input (+ saved transpose)", input_cast ? per_layer : 0, 0, 0,
                2 * x + x + (saved_fp8 || kept_t ? x : 0));
        sol_add(t, "fp8 transpose of a BF16-saved input", fp8 && !saved_fp8 && !kept_t ? per_layer : 0, 0, 0, 3 * x);
        sol_add(t, "fp8 cast of an output gradient (+ transpose)", fp8 && i != LINEAR_GATE_UP ? per_layer : 0, 0, 0,
                2 * dy + 2 * dy);
    }
    // Once per step: each weight's amax pass (read; none when the step gathers it), then its cast
    // (read, codes written, and where kept their transposes), reading BF16 weights or FP32 master
    // weights. Otherwise each layer's backward reads the codes and writes their transposes.
    double weights = 0, weight_bytes = r->casts_from_master ? 4 : 2, reads = r->weights_amax_in_step ? 1 : 2;
    for (int i = 0; i < LINEARS; i++) weights += (double)in[i] * out[i];
    sol_add(t, "fp8 cast of the weights (once per step)", fp8 && r->casts_weights ? 1 : 0, 0, 0,
            r->shape.n_layers * (reads * weight_bytes + 1 + (r->casts_weight_transposes ? 1 : 0)) * weights);
    sol_add(t, "fp8 transposes of the layer's weights", fp8 && r->transposes_weights ? per_layer : 0, 0, 0, 2 * weights);
}

// The norms (coat/rmsnorm.cuh), per micro-batch: BF16 rows in and out, rstd, weights; the
// residual stream's 1x16 copy where the table keeps one; backward's FP32 dw partials written
// and reduced. With FP8 GEMMs and the block's norm outputs saved in FP8, those norms write no
// output: their cast recomputes it from the norm's input (the copy where kept), rstd and weight.
static inline void sol_add_norms(SolTable *t, const SolRun *r) {
    double N = (double)r->B * r->T, H = r->shape.dim, L = r->shape.n_layers, NH = N * H;
    int grouped = activations_group_residual(r->activations);
    int output_cast = r->fp8_gemms && r->activations != ACTS_BF16;
    double copy = grouped ? sol_group16_bytes(NH) : 0;
    double rstd_weight = 4 * N + 2 * H, output = 2 * NH;
    double block = rstd_weight + (output_cast ? 0 : output) + copy;  // a norm that feeds a block
    sol_add(t, "rmsnorm forward", 1, 0, 0, 2 * NH + block);
    // 2L - 1 adds feed a block (with the copy), the last the final norm (BF16 only).
    sol_add(t, "residual + rmsnorm forward", 2 * L - 1, 0, 0, 3 * 2 * NH + block);
    sol_add(t, "residual + rmsnorm forward", 1, 0, 0, 3 * 2 * NH + rstd_weight + output);
    sol_add(t, "rmsnorm output: fp8 cast (+ saved transpose)", output_cast ? 2 * L : 0, 0, 0,
            (grouped ? copy : 2 * NH) + rstd_weight + 2 * NH);  // codes and their transposes
    double partials = 2 * 4 * H * (double)((r->B * r->T + 63) / 64);
    double backward = 2 * NH + 2 * 2 * NH + 4 * N + 2 * H + partials + 2 * 2 * H;  // dy, din +=, rstd, w, dw
    sol_add(t, "rmsnorm backward", 2 * L, 0, 0, backward + (grouped ? sol_group16_bytes(NH) : 2 * NH));
    sol_add(t, "rmsnorm backward", 1, 0, 0, backward + 2 * NH);  // the final norm's input is BF16
}

// SwiGLU (coat/swiglu.cuh), per layer and micro-batch. gate_up is written by its GEMM in BF16
// and read so by the forward, which writes its 1x16 copy where the table keeps one; the backward
// and the recomputing FP8 casts read the copy then.
static inline void sol_add_swiglu(SolTable *t, const SolRun *r) {
    double N = (double)r->B * r->T, I = r->shape.ffn_dim, L = r->shape.n_layers;
    int grouped = activations_group_gate_up(r->activations), fp8 = r->fp8_gemms;
    double gate_up_saved = grouped ? sol_group16_bytes(2 * N * I) : 2 * 2 * N * I;
    int out_cast = fp8 && r->activations != ACTS_BF16;  // the output is cast from gate_up, never stored in BF16
    sol_add(t, "swiglu forward", L, 0, 0, 2 * 2 * N * I + (grouped ? gate_up_saved : 0) + (out_cast ? 0 : 2 * N * I));
    sol_add(t, "swiglu forward: fp8 cast (+ saved transpose)", out_cast ? L : 0, 0, 0, gate_up_saved + 2 * N * I);
    sol_add(t, "swiglu backward", L, 0, 0, gate_up_saved + 2 * N * I + (fp8 ? 0 : 2 * 2 * N * I));
    sol_add(t, "swiglu backward: fp8 cast (+ transpose)", fp8 ? L : 0, 0, 0, gate_up_saved + 2 * N * I + 2 * 2 * N * I);
}

// Causal attention (coat/attention.cuh) as tensor-core work: T (T + 1) / 2 query-key pairs per
// head, forward 2 GEMMs (Q K^T, P V) of 2 hd FLOPs a pair, backward 5 (S again, dP, dV, dQ, dK;
// RoPE's backward rides on its stores). RoPE's forward rotates q and k in place.
static inline void sol_add_attention(SolTable *t, const SolRun *r) {
    const ModelShape *m = &r->shape;
    double N = (double)r->B * r->T, L = m->n_layers, hd = model_head_dim(m);
    double pairs = (double)r->B * m->n_heads * ((double)r->T * (r->T + 1) / 2);
    sol_add(t, "attention forward", L, 2 * 2 * hd * pairs, 0, 0);
    sol_add(t, "attention backward (+ rope backward)", L, 5 * 2 * hd * pairs, 0, 0);
    double rotated = 2 * 2 * N * (m->n_heads + m->n_kv_heads) * hd, tables = 2 * 4 * (double)r->T * hd / 2;
    sol_add(t, "rope forward", L, 0, 0, rotated + tables);
}

// The whole table for one step of `run`.
static inline void speed_of_light_table(SolTable *t, const SolRun *r) {
    memset(t, 0, sizeof(*t));
    double M = r->micro_batches, N = (double)r->B * r->T, H = r->shape.dim, V = r->shape.vocab_size;
    SolTable micro;  // one micro-batch's ops, then scaled
    memset(&micro, 0, sizeof(micro));
    sol_add(&micro, "embedding forward", 1, 0, 0, 4 * N + 2 * 2 * N * H);
    sol_add_norms(&micro, r);
    sol_add_linears(&micro, r, r->shape.n_layers);
    sol_add_attention(&micro, r);
    sol_add_swiglu(&micro, r);
    // lm_head forward and its two backward GEMMs; the chunked logits' traffic is far below them.
    sol_add(&micro, "classifier (lm_head + cross-entropy)", 1, 3 * 2 * N * H * V, 0, 0);
    sol_add(&micro, "zero d_residual", 1, 0, 0, 2 * N * H);
    sol_add(&micro, "mean loss", 1, 0, 0, 4 * N + 4);
    for (int i = 0; i < micro.n; i++) {
        SolOp *op = &micro.ops[i];
        double scale = strcmp(op->op, "fp8 cast of the weights (once per step)") == 0 ? 1 : M;
        sol_add(t, op->op, scale * op->calls, 0, op->fp8, 0);
        SolOp *entry = sol_find(t, op->op);
        entry->flops += scale * op->flops;
        entry->bytes += scale * op->bytes;
    }
    double n = (double)r->optimizer_elems, grad = r->fp32_grads ? 4 : 2;
    sol_add(t, "zero gradients", 1, 0, 0, (double)r->zeroed_grad_bytes);
    sol_add(t, "gradient norm", 1, 0, 0, grad * n);
    // AdamW: gradient read; FP32 master and both moments read and written; BF16 parameters
    // written where they are kept; the FP8 kinds' group scalars read and written; one decay byte
    // per group.
    double moments = 2 * 2 * (double)adamw_moment_elem_bytes(r->states) * n;
    double scalars = 2 * 2 * 4 * (double)adamw_group_scalars(r->states) * (n / ADAMW_GROUP);
    sol_add(t, "adamw (after the host's wait)", 1, 0, 0,
            grad * n + 2 * 4 * n + 2 * (double)r->params_written_elems + moments + scalars + n / ADAMW_GROUP);
    sol_unbounded(t, "embedding backward", "its weight-gradient rows depend on the batch's distinct tokens (a radix sort first)");
    sol_unbounded(t, "batch upload (after the host's wait)", "the host's wait for the loader");
    sol_unbounded(t, "wait for the gradient reduces", "a wait for the network");
    sol_unbounded(t, "parameter gather (its transfer overlaps the next forward)", "a wait for the network");
    sol_unbounded(t, "parameter gather: waiting for a bucket", "a wait for the network");
    sol_unbounded(t, "parameter gather: waiting for a bucket of layers", "a wait for the network (ZeRO stage 3)");
    sol_unbounded(t, "parameter gather: waiting for a bucket of layers (+ its E4M3 transposes)",
                  "a wait for the network (ZeRO stage 3, backward)");
}
