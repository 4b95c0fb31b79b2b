// The whole GPU model (coat/model.cuh, BF16) against the FP32 CPU reference on a tiny shape:
// loss, every parameter gradient, determinism, and a few AdamW steps. When the PyTorch
// reference's debug state exists (build/debug_state.bin, written by scripts/train_llama.py
// --debug-state on a machine with torch), also logits, loss, gradients and 10 training losses
// against PyTorch, in bf16 and in every FP8 mode (FP8 GEMMs alone, fp8, coat, coat with fast
// accumulation). Tolerances are relative error norms per tensor: llm.c-style for BF16, from
// TransformerEngine's FP8 tolerances for the FP8 modes (see PrecisionCase).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/optimizer.cuh"
#include "../coat/zero.cuh"
#include "check.h"
#include "gpu_test_util.cuh"
#include "reference_llama.h"

#define GRAD_REL_TOL 0.05    // ||g_gpu - g_ref|| / ||g_ref|| per tensor: BF16 activations and grads
#define LOSS_REL_TOL 0.01

// Tolerances against PyTorch (FP32) per precision. FP8 rounds each GEMM operand by up to 2^-4
// (E4M3) or 2^-3 (E5M2, the gradients) relative; a product's relative error norm is about the
// operands' RMS rounding error (3.6% E4M3, 7.2% E5M2 for uniform rounding), and two layers
// compound it. So the gradient tolerance is TransformerEngine's E5M2 rtol (0.25), logits get
// twice E4M3's RMS error plus BF16's, and the loss, dominated by the BF16 classifier, 2%.
typedef struct {
    const char *name;
    ModelPrecision precision;
    double loss, logits, grads, steps;
} PrecisionCase;

static double relative_error_norm(const float *got, const float *expected, size_t n) {
    double diff = 0.0, ref = 0.0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)got[i] - expected[i];
        diff += d * d;
        ref += (double)expected[i] * expected[i];
    }
    return sqrt(diff) / (sqrt(ref) + 1e-30);
}

static const char *tensor_name(ParamKind kind, int layer, char *buf, size_t size) {
    if (param_kind_is_per_layer(kind)) snprintf(buf, size, "layer %d %s", layer, param_kind_name(kind));
    else snprintf(buf, size, "%s", param_kind_name(kind));
    return buf;
}

// Per tensor: relative error of the GPU gradient against the expected one.
static void compare_grads(const char *against, const ParamLayout *layout, const float *got, const float *expected, double tol) {
    for (int l = -1; l <= layout->shape.n_layers; l++)
        for (int k = 0; k < PARAM_KINDS; k++) {
            int per_layer = param_kind_is_per_layer((ParamKind)k);
            if ((l >= 0 && l < layout->shape.n_layers) != per_layer) continue;
            if (l == -1 && k != PARAM_EMBEDDING) continue;
            if (l == layout->shape.n_layers && k == PARAM_EMBEDDING) continue;
            size_t off = param_offset(layout, (ParamKind)k, l < 0 ? 0 : l), n = param_numel(layout, (ParamKind)k);
            double err = relative_error_norm(got + off, expected + off, n);
            char name[96];
            check(err < tol, "gradient of %s vs %s: relative error %.4f (tolerance %.2f)",
                  tensor_name((ParamKind)k, l, name, sizeof(name)), against, err, tol);
        }
}

static float gpu_loss(GpuContext *gpu, LlamaModel *model) {
    float loss;
    classifier_mean_loss(gpu, model->mean_loss, model->losses, model->B * model->T);
    cudaCheck(cudaMemcpyAsync(&loss, model->mean_loss, sizeof(float), cudaMemcpyDeviceToHost, gpu->stream));
    cudaCheck(cudaStreamSynchronize(gpu->stream));
    return loss;
}

static float gpu_forward_backward(GpuContext *gpu, LlamaModel *model) {
    int N = model->B * model->T;
    cudaCheck(cudaMemsetAsync(model->grads, 0, 2 * model->layout.total_padded, gpu->stream));
    model_forward(gpu, model, 1, 1.0f / N);
    model_backward(gpu, model);
    return gpu_loss(gpu, model);
}

// The model the tests build: vocabulary 1000, dim 128, 2 heads sharing 1 kv head (head_dim 64),
// ffn 352, at most 64 positions.
static ModelShape small_shape(int n_layers) {
    ModelShape shape = {1000, 128, 2, 2, 1, 352, 64, 10000.0f, 1e-5f, 0, 1, 4, 8192};
    shape.n_layers = n_layers;
    return shape;
}

static void test_against_cpu_reference(GpuContext *gpu) {
    ModelShape shape = small_shape(2);
    int B = 2, T = 37, N = B * T;
    ParamLayout layout;
    param_layout_init(&layout, &shape);
    size_t P = layout.total_padded;
    float *weights = host_floats(P);
    param_init_weights(&layout, weights, 42);
    for (size_t i = 0; i < P; i++) weights[i] = round_to_bf16(weights[i]);  // what the GPU sees
    int *tokens = (int *)host_alloc(N * sizeof(int)), *targets = (int *)host_alloc(N * sizeof(int));
    Random rng;
    random_seed(&rng, 5);
    for (int i = 0; i < N; i++) { tokens[i] = (int)random_below(&rng, 1000); targets[i] = (int)random_below(&rng, 1000); }

    RefModel ref;
    ref_model_create(&ref, &shape, B, T);
    memcpy(ref.params, weights, P * sizeof(float));
    float ref_loss = ref_model_forward(&ref, tokens, targets);
    ref_model_backward(&ref);

    LlamaModel model;
    model_create(&model, &shape, B, T, model_precision_bf16());
    copy_bf16_to_device(model.params, weights, P);
    cudaCheck(cudaMemcpy(model.tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model.targets, targets, N * sizeof(int), cudaMemcpyHostToDevice));
    float loss = gpu_forward_backward(gpu, &model);
    check(fabsf(loss - ref_loss) < LOSS_REL_TOL * ref_loss, "loss: expected %.6f got %.6f", ref_loss, loss);
    float *grads = host_floats(P), *grads_again = host_floats(P);
    copy_bf16_to_host(grads, model.grads, P);
    compare_grads("the CPU reference", &layout, grads, ref.grads, GRAD_REL_TOL);
    int padding_zero = 1;
    for (int l = 0; l < shape.n_layers; l++)
        for (int k = PARAM_ATTN_NORM; k <= PARAM_W_DOWN; k++) {
            size_t off = param_offset(&layout, (ParamKind)k, l);
            for (size_t i = param_numel(&layout, (ParamKind)k); i < layout.padded[k]; i++) padding_zero &= grads[off + i] == 0.0f;
        }
    check(padding_zero, "padding gradients stay zero");
    float loss_again = gpu_forward_backward(gpu, &model);
    copy_bf16_to_host(grads_again, model.grads, P);
    check(loss_again == loss && memcmp(grads, grads_again, P * sizeof(float)) == 0,
          "forward and backward are deterministic (bitwise equal on a second run)");

    // AdamW steps on the same batch: GPU (BF16 compute, FP32 master) vs the FP32 reference.
    AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
    AdamW opt;
    adamw_create(&opt, OPT_STATES_FP32, &ac, &layout, 0, P, gpu->stream);
    adamw_set_master_from_host(&opt, weights, gpu->stream);
    float ref_losses[8], gpu_losses[8];
    for (int step = 0; step < 8; step++) {
        ref_losses[step] = ref_model_forward(&ref, tokens, targets);
        ref_model_backward(&ref);
        ref_model_adamw(&ref, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step + 1);
        gpu_losses[step] = gpu_forward_backward(gpu, &model);
        adamw_step(&opt, model.params, model.grads, 1e-3f, 1.0f, gpu->stream);
    }
    int close = 1;
    for (int step = 0; step < 8; step++) close &= fabsf(gpu_losses[step] - ref_losses[step]) < 0.02f * ref_losses[step];
    check(close && gpu_losses[7] < gpu_losses[0] - 0.1f,
          "8 AdamW steps track the reference (loss %.4f -> %.4f, reference %.4f -> %.4f)", gpu_losses[0], gpu_losses[7],
          ref_losses[0], ref_losses[7]);
    adamw_free(&opt);
    model_free(&model);
    ref_model_free(&ref);
    free(weights); free(tokens); free(targets); free(grads); free(grads_again);
}

// The debug state of scripts/train_llama.py: see its --debug-state for the layout.
static void test_against_pytorch(GpuContext *gpu, const char *path, const PrecisionCase *pc) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        check(0, "PyTorch debug state %s is missing (make test-gpu writes it with scripts/train_llama.py)", path);
        return;
    }
    int32_t header[256];
    if (fread(header, sizeof(header), 1, f) != 1 || header[0] != 20241129 || header[1] != 1) {
        check(0, "%s: not a debug state (bad header)", path);
        fclose(f);
        return;
    }
    ModelShape shape;
    memset(&shape, 0, sizeof(shape));
    shape.vocab_size = header[2]; shape.dim = header[3]; shape.n_layers = header[4]; shape.n_heads = header[5];
    shape.n_kv_heads = header[6]; shape.ffn_dim = header[7]; shape.max_seq_len = header[8];
    shape.rope_original_max_seq_len = header[12];
    float hf[16];
    memcpy(hf, header + 16, sizeof(hf));
    shape.rope_theta = hf[0]; shape.norm_eps = hf[1]; shape.rope_scaling_factor = hf[2];
    shape.rope_low_freq_factor = hf[3]; shape.rope_high_freq_factor = hf[4];
    float lr = hf[5], beta1 = hf[6], beta2 = hf[7], eps = hf[8], wd = hf[9], clip = hf[10];
    int B = header[9], T = header[10], steps = header[11], N = B * T, V = shape.vocab_size;
    ParamLayout layout;
    param_layout_init(&layout, &shape);
    size_t P = layout.total_padded;
    float *weights = host_floats(P), *logits = host_floats((size_t)N * V), *grads = host_floats(P);
    float *losses = host_floats(steps), loss;
    int *tokens = (int *)host_alloc(N * 4), *targets = (int *)host_alloc(N * 4);
    int ok = fread(weights, 4, P, f) == P && fread(tokens, 4, N, f) == (size_t)N && fread(targets, 4, N, f) == (size_t)N &&
             fread(logits, 4, (size_t)N * V, f) == (size_t)N * V && fread(&loss, 4, 1, f) == 1 &&
             fread(grads, 4, P, f) == P && fread(losses, 4, steps, f) == (size_t)steps;
    fclose(f);
    check(ok, "%s holds every section", path);
    if (!ok) return;

    LlamaModel model;
    model_create(&model, &shape, B, T, pc->precision);
    copy_bf16_to_device(model.params, weights, P);
    cudaCheck(cudaMemcpy(model.tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    cudaCheck(cudaMemcpy(model.targets, targets, N * sizeof(int), cudaMemcpyHostToDevice));
    float got_loss = gpu_forward_backward(gpu, &model);
    check(fabsf(got_loss - loss) < pc->loss * loss, "%s: loss vs PyTorch: expected %.6f got %.6f (tolerance %.2f relative)",
          pc->name, loss, got_loss, pc->loss);
    int stride = classifier_logits_stride(V);
    float *device_logits, *got_logits = host_floats((size_t)N * stride);
    cudaCheck(cudaMalloc(&device_logits, (size_t)N * stride * 4));
    classifier_logits(gpu, device_logits, model.final_norm_out, model_param(&model, PARAM_LM_HEAD, 0), 0, 1, N, shape.dim, V);
    cudaCheck(cudaMemcpy(got_logits, device_logits, (size_t)N * stride * 4, cudaMemcpyDeviceToHost));
    double diff = 0.0, ref = 0.0, max_abs = 0.0;
    for (int i = 0; i < N; i++)
        for (int v = 0; v < V; v++) {
            double d = (double)got_logits[(size_t)i * stride + v] - logits[(size_t)i * V + v];
            diff += d * d;
            ref += (double)logits[(size_t)i * V + v] * logits[(size_t)i * V + v];
            if (fabs(d) > max_abs) max_abs = fabs(d);
        }
    check(sqrt(diff / (ref + 1e-30)) < pc->logits, "%s: logits vs PyTorch: relative error %.4f (tolerance %.2f), max abs diff %.4f",
          pc->name, sqrt(diff / (ref + 1e-30)), pc->logits, max_abs);
    float *got_grads = host_floats(P);
    copy_bf16_to_host(got_grads, model.grads, P);
    char against[64];
    snprintf(against, sizeof(against), "PyTorch (%s)", pc->name);
    compare_grads(against, &layout, got_grads, grads, pc->grads);

    AdamWConfig ac = {beta1, beta2, eps, wd, 0, 0};
    AdamW opt;
    adamw_create(&opt, OPT_STATES_FP32, &ac, &layout, 0, P, gpu->stream);
    adamw_set_master_from_host(&opt, weights, gpu->stream);
    double worst = 0.0;
    for (int step = 0; step < steps; step++) {
        float step_loss = gpu_forward_backward(gpu, &model);
        grad_norm_squared(model.grad_norm_squared, model.grads, P, (double *)model.kernel_scratch, gpu->stream);
        float norm2;
        cudaCheck(cudaMemcpy(&norm2, model.grad_norm_squared, 4, cudaMemcpyDeviceToHost));
        adamw_step(&opt, model.params, model.grads, lr, grad_clip_factor(sqrtf(norm2), clip), gpu->stream);
        model_weights_changed(&model);
        double rel = fabs(step_loss - losses[step]) / losses[step];
        if (rel > worst) worst = rel;
    }
    check(worst < pc->steps, "%s: %d AdamW steps vs PyTorch: worst relative loss difference %.4f (tolerance %.2f)", pc->name,
          steps, worst, pc->steps);
    adamw_free(&opt);
    model_free(&model);
    cudaCheck(cudaFree(device_logits));
    free(weights); free(logits); free(grads); free(losses); free(tokens); free(targets); free(got_logits); free(got_grads);
}

// A step's gradients without their memset (grads_unwritten: each gradient's first writer of the
// step writes rather than adds) against the memset and the adds, over two micro-batches, in bf16
// and with FP8 GEMMs and COAT's activations: every value equal (zeros of either sign alike) with
// every tensor's gradient poisoned with NaN beforehand (their padding stays zero, as no one writes it).
static void test_gradients_written_first(GpuContext *gpu) {
    ModelShape shape = small_shape(2);
    int B = 2, T = 64, N = B * T;
    ParamLayout layout;
    param_layout_init(&layout, &shape);
    size_t P = layout.total_padded;
    const struct { const char *name; ModelPrecision precision; } cases[] = {
        {"bf16", model_precision_bf16()}, {"fp8 GEMMs, coat activations", {1, ACTS_COAT, 0, 0}}};
    int *tokens = (int *)host_alloc(2 * N * sizeof(int));
    Random rng;
    random_seed(&rng, 13);
    for (int i = 0; i < 2 * N; i++) tokens[i] = (int)random_below(&rng, 1000);
    bf16 *grads[2] = {host_bf16s(P), host_bf16s(P)};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        LlamaModel model;
        model_create(&model, &shape, B, T, cases[c].precision);
        AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
        AdamW opt;
        adamw_create(&opt, OPT_STATES_FP32, &ac, &layout, 0, P, gpu->stream);
        adamw_init_master(&opt, &layout, 3, gpu->stream);
        adamw_write_params(&opt, model.params, gpu->stream);
        model_weights_changed(&model);
        for (int k = 0; k < 2; k++) {
            if (k == 0) {
                cudaCheck(cudaMemsetAsync(model.grads, 0, 2 * P, gpu->stream));
            } else {
                for (int kind = 0; kind < PARAM_KINDS; kind++)
                    for (int l = 0; l < (param_kind_is_per_layer((ParamKind)kind) ? shape.n_layers : 1); l++)
                        cudaCheck(cudaMemsetAsync(model_grad(&model, (ParamKind)kind, l), 0xff,
                                                  2 * param_numel(&layout, (ParamKind)kind), gpu->stream));
                model.grads_unwritten = 1;
            }
            for (int micro = 0; micro < 2; micro++) {
                cudaCheck(cudaMemcpy(model.tokens, tokens + micro * N, N * sizeof(int), cudaMemcpyHostToDevice));
                cudaCheck(cudaMemcpy(model.targets, tokens + micro * N, N * sizeof(int), cudaMemcpyHostToDevice));
                model_forward(gpu, &model, 1, 0.5f / N);
                model_backward(gpu, &model);
            }
            cudaCheck(cudaMemcpy(grads[k], model.grads, 2 * P, cudaMemcpyDeviceToHost));
        }
        size_t differ = 0;
        for (size_t i = 0; i < P; i++) differ += __bfloat162float(grads[0][i]) != __bfloat162float(grads[1][i]);
        check(differ == 0 && model.grads_unwritten == 0,
              "%s: two micro-batches' gradients written first equal those added to a zeroed buffer (%zu of %zu "
              "differ)", cases[c].name, differ, P);
        adamw_free(&opt);
        model_free(&model);
    }
    free(grads[0]), free(grads[1]), free(tokens);
}

// Whether every layer's W^T codes, where the model reads them, are the transpose of its W codes.
static int weight_transposes_match(const LlamaModel *model) {
    int match = 1;
    for (int l = 0; l < model->shape.n_layers; l++)
        for (int i = 0; i < LINEARS; i++) {
            LinearShape shape = linear_shape(model, (Linear)i);
            size_t n = (size_t)shape.out * shape.in;
            uint8_t *w = (uint8_t *)host_alloc(n), *w_t = (uint8_t *)host_alloc(n);
            cudaCheck(cudaMemcpy(w, linear_fp8_weight(model, l, (Linear)i, 0), n, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(w_t, linear_fp8_weight(model, l, (Linear)i, 1), n, cudaMemcpyDeviceToHost));
            for (int r = 0; r < shape.out; r++)
                for (int c = 0; c < shape.in; c++) match &= w[(size_t)r * shape.in + c] == w_t[(size_t)c * shape.out + r];
            free(w), free(w_t);
        }
    return match;
}

// An optional buffer kept (model_create_sized's `optional`) against the model without it: the
// same losses and gradients over 3 AdamW steps, bit for bit. Every layer's W^T kept (the cast
// writes them once per step, the backward remakes none; each is the transpose of its W), and the
// attention output's transposes kept (the forward's cast writes them, the backward remakes none),
// in fp8 (BF16 activations: the forward's cast writes codes and transposes of every linear input
// but the attention output's) and in coat.
static void test_transposes_kept(GpuContext *gpu, OptionalBuffers optional, ActivationsChoice activations,
                                 const char *label) {
    ModelShape shape = small_shape(3);
    int B = 2, T = 64, N = B * T;
    ParamLayout layout;
    param_layout_init(&layout, &shape);
    size_t P = layout.total_padded;
    ModelPrecision fp8 = {1, activations, 0, 0};
    LlamaModel remade, kept;
    model_create(&remade, &shape, B, T, fp8);
    model_create_sized(&kept, &shape, B, T, fp8, NULL, 0, 0, optional);
    if (optional.weight_transposes)
        check(kept.fp8_weight_transposes != NULL &&
                  kept.fp8_weight_transposes_bytes == weight_transposes_plan_bytes(&shape, 1, 0) &&
                  kept.fp8_weight_transposes_bytes == 2 * linear_layer_weight_elems(&shape),
              "%s: the W^T of every layer but the last allocated as planned (%zu bytes)", label,
              kept.fp8_weight_transposes_bytes);
    if (optional.attention_out_t)
        check(kept.attention_out_t != NULL && kept.attention_out_t_bytes == attention_out_t_plan_bytes(&shape, 1, N) &&
                  kept.attention_out_t_bytes == (size_t)3 * N * shape.dim,
              "%s: every layer's transpose of the attention output allocated as planned (%zu bytes)", label,
              kept.attention_out_t_bytes);
    AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
    AdamW opts[2];
    LlamaModel *models[2] = {&remade, &kept};
    int *tokens = (int *)host_alloc(N * sizeof(int));
    Random rng;
    random_seed(&rng, 11);
    for (int i = 0; i < N; i++) tokens[i] = (int)random_below(&rng, 1000);
    for (int k = 0; k < 2; k++) {
        adamw_create(&opts[k], OPT_STATES_FP32, &ac, &layout, 0, P, gpu->stream);
        adamw_init_master(&opts[k], &layout, 5, gpu->stream);
        adamw_write_params(&opts[k], models[k]->params, gpu->stream);
        model_weights_changed(models[k]);
        cudaCheck(cudaMemcpy(models[k]->tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(models[k]->targets, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    }
    bf16 *grads[2] = {host_bf16s(P), host_bf16s(P)};
    int same_losses = 1, same_grads = 1, transposed = 1;
    for (int step = 0; step < 3; step++) {
        float losses[2];
        for (int k = 0; k < 2; k++) {
            losses[k] = gpu_forward_backward(gpu, models[k]);
            cudaCheck(cudaMemcpy(grads[k], models[k]->grads, 2 * P, cudaMemcpyDeviceToHost));
        }
        same_losses &= losses[0] == losses[1];
        same_grads &= memcmp(grads[0], grads[1], 2 * P) == 0;
        if (optional.weight_transposes) transposed &= weight_transposes_match(&kept);
        for (int k = 0; k < 2; k++) {
            adamw_step(&opts[k], models[k]->params, models[k]->grads, 1e-3f, 1.0f, gpu->stream);
            model_weights_changed(models[k]);
        }
    }
    check(same_losses && same_grads, "%s: 3 AdamW steps give the same losses and gradients bit for bit (losses %s, "
          "gradients %s)", label, same_losses ? "equal" : "differ", same_grads ? "equal" : "differ");
    if (optional.weight_transposes)
        check(transposed, "%s: every layer's W^T is the transpose of its W after each step's cast", label);
    for (int k = 0; k < 2; k++) {
        adamw_free(&opts[k]);
        model_free(models[k]);
        free(grads[k]);
    }
    free(tokens);
}

// Without BF16 block weights (weights_from_master) one rank casts the E4M3 weights and writes the
// layers' norms from its FP32 master weights (coat/zero.cuh): the same codes, scales, norms,
// losses and gradients, over AdamW steps, as the model that keeps BF16 weights and casts those
// (model_cast_weights), bit for bit; and the step writes no BF16 block weight. The mastered model
// keeps every layer's W^T (the cast from the master writes them).
static void test_weights_from_master(GpuContext *gpu) {
    ModelShape shape = small_shape(2);
    int B = 2, T = 64, N = B * T, L = shape.n_layers;
    ParamLayout layout, buffers;
    param_layout_init(&layout, &shape);
    size_t P = layout.total_padded;
    ZeroPlan *plan = (ZeroPlan *)host_alloc(sizeof(ZeroPlan));
    zero_plan_init(plan, &layout, 1, 0, 1u << 25);
    zero_model_layout(plan, &shape, &buffers);
    ModelPrecision with_bf16 = {1, ACTS_COAT, 0, 0}, from_master = {1, ACTS_COAT, 0, 1};
    LlamaModel cast, mastered;
    model_create(&cast, &shape, B, T, with_bf16);
    model_create_sized(&mastered, &shape, B, T, from_master, &buffers, zero_grads_elems(plan), 0, OptionalBuffers{0, 0, 1});
    Comm comm;
    memset(&comm, 0, sizeof(comm));
    comm.world = 1;
    Zero zero;
    char error[256];
    check(zero_attach(&zero, plan, &comm, &mastered, gpu->stream, COLLECTIVES_MPI, 60.0, error, sizeof(error)) == 0,
          "zero_attach on one rank");
    ParamShardRange *ranges = (ParamShardRange *)host_alloc(plan->buckets * sizeof(ParamShardRange));
    zero_optimizer_ranges(&zero, ranges);
    AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
    AdamW cast_opt, master_opt;
    adamw_create(&cast_opt, OPT_STATES_FP8_DRE, &ac, &layout, 0, P, gpu->stream);
    adamw_create_ranges(&master_opt, OPT_STATES_FP8_DRE, &ac, &layout, ranges, plan->buckets, 0, gpu->stream);
    adamw_init_master(&cast_opt, &layout, 7, gpu->stream);
    adamw_init_master(&master_opt, &layout, 7, gpu->stream);
    adamw_write_params(&cast_opt, cast.params, gpu->stream);
    model_weights_changed(&cast);
    adamw_write_params(&master_opt, mastered.params, gpu->stream);
    zero_gather_params(&zero, master_opt.master, 0);
    AdamWAmaxParts *amax_parts = (AdamWAmaxParts *)host_alloc(sizeof(AdamWAmaxParts));
    check(zero_weights_amax_parts(&zero, amax_parts) && amax_parts->count == L * LINEARS,
          "weights from the master: the optimizer's step gathers the amax of the %d weights (%d parts)", L * LINEARS,
          amax_parts->count);
    adamw_set_amax_parts(&master_opt, amax_parts);
    int *tokens = (int *)host_alloc(N * sizeof(int));
    Random rng;
    random_seed(&rng, 9);
    for (int i = 0; i < N; i++) tokens[i] = (int)random_below(&rng, 1000);
    for (int k = 0; k < 2; k++) {
        cudaCheck(cudaMemcpy(k ? mastered.tokens : cast.tokens, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
        cudaCheck(cudaMemcpy(k ? mastered.targets : cast.targets, tokens, N * sizeof(int), cudaMemcpyHostToDevice));
    }
    // The W codes of every layer (the room after them holds one layer's W^T, a different one in each).
    size_t code_bytes = (size_t)L * linear_layer_weight_elems(&shape), scale_count = (size_t)L * FP8_SCALES_PER_LAYER;
    uint8_t *codes[2] = {(uint8_t *)host_alloc(code_bytes), (uint8_t *)host_alloc(code_bytes)};
    Fp8Scale *scales[2] = {(Fp8Scale *)host_alloc(scale_count * sizeof(Fp8Scale)),
                           (Fp8Scale *)host_alloc(scale_count * sizeof(Fp8Scale))};
    bf16 *grads[2] = {host_bf16s(P), host_bf16s(P)}, *norms[2] = {host_bf16s(shape.dim), host_bf16s(shape.dim)};
    int same_codes = 1, same_scales = 1, same_norms = 1, same_losses = 1, same_grads = 1;
    for (int step = 0; step < 3; step++) {
        float cast_loss = gpu_forward_backward(gpu, &cast), master_loss = gpu_forward_backward(gpu, &mastered);
        same_losses &= cast_loss == master_loss;
        LlamaModel *models[2] = {&cast, &mastered};
        for (int k = 0; k < 2; k++) {
            cudaCheck(cudaMemcpy(codes[k], models[k]->fp8_weights, code_bytes, cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(scales[k], models[k]->fp8_scales, scale_count * sizeof(Fp8Scale), cudaMemcpyDeviceToHost));
            cudaCheck(cudaMemcpy(grads[k], models[k]->grads, 2 * P, cudaMemcpyDeviceToHost));
        }
        same_codes &= memcmp(codes[0], codes[1], code_bytes) == 0 && weight_transposes_match(&mastered);
        for (int l = 0; l < L; l++)
            for (int i = 0; i < LINEARS; i++) {
                size_t at = (size_t)l * FP8_SCALES_PER_LAYER + FP8_SLOT_WEIGHT + i;
                same_scales &= memcmp(&scales[0][at], &scales[1][at], sizeof(Fp8Scale)) == 0;
            }
        for (int l = 0; l < L; l++)
            for (int n = 0; n < 2; n++) {
                ParamKind kind = n ? PARAM_MLP_NORM : PARAM_ATTN_NORM;
                for (int k = 0; k < 2; k++)
                    cudaCheck(cudaMemcpy(norms[k], model_param(models[k], kind, l), 2 * shape.dim, cudaMemcpyDeviceToHost));
                same_norms &= memcmp(norms[0], norms[1], 2 * shape.dim) == 0;
            }
        same_grads &= memcmp(grads[0], grads[1], 2 * P) == 0;
        adamw_step(&cast_opt, cast.params, cast.grads, 1e-3f, 1.0f, gpu->stream);
        model_weights_changed(&cast);
        zero_weights_amax_reset(&zero);
        adamw_step(&master_opt, mastered.params, zero_gradient_shard(&zero), 1e-3f, 1.0f, gpu->stream);
        zero_gather_params(&zero, master_opt.master, 1);
    }
    check(same_codes && same_scales, "weights from the master: the E4M3 weights and their scales equal model_cast_weights' "
          "and the kept W^T their transposes (codes %s, scales %s)", same_codes ? "equal" : "differ",
          same_scales ? "equal" : "differ");
    check(same_norms, "weights from the master: the layers' norms equal the BF16 parameters'");
    check(same_losses && same_grads, "weights from the master: 3 AdamW steps give the same losses and gradients bit for bit "
          "(losses %s, gradients %s)", same_losses ? "equal" : "differ", same_grads ? "equal" : "differ");
    check(model_param(&mastered, PARAM_WQ, 0) == NULL && mastered.params_elems == layout.first_layer_offset +
          layout.padded[PARAM_FINAL_NORM] + layout.padded[PARAM_LM_HEAD],
          "weights from the master: the BF16 parameters hold the embedding, the final norm and the lm_head only (%zu elements)",
          mastered.params_elems);
    zero_free(&zero);
    adamw_free(&cast_opt);
    adamw_free(&master_opt);
    model_free(&cast);
    model_free(&mastered);
    for (int k = 0; k < 2; k++) { free(codes[k]); free(scales[k]); free(grads[k]); free(norms[k]); }
    free(tokens);
    free(amax_parts);
    free(ranges);
    free(plan);
}

// The memory plan (dry_run's, and the trainer's check that a micro-batch fits) equals what
// model_create and adamw_create allocate, byte for byte, in every precision.
static void test_memory_plan_matches_allocation(GpuContext *gpu) {
    ConfigParser *parser = (ConfigParser *)host_alloc(sizeof(ConfigParser));
    config_defaults(parser);
    TrainConfig *c = &parser->values;
    ModelShape shape = small_shape(2);
    c->model = shape;
    c->micro_batch_size = 4;
    c->seq_len = 64;
    const struct { const char *name; int precision, activations, states; } cases[] = {
        {"bf16", PRECISION_BF16, ACTS_AUTO, STATES_AUTO},
        {"bf16, fp8_dre states", PRECISION_BF16, ACTS_AUTO, STATES_FP8_DRE},
        {"fp8 GEMMs, bf16 activations", PRECISION_FP8, ACTS_BF16, STATES_AUTO},
        {"fp8", PRECISION_FP8, ACTS_AUTO, STATES_AUTO},
        {"coat", PRECISION_COAT, ACTS_AUTO, STATES_AUTO},
        {"coat, fp32 states", PRECISION_COAT, ACTS_AUTO, STATES_FP32},
        {"coat GEMMs, fp8 activations", PRECISION_COAT, ACTS_FP8, STATES_AUTO},
        {"bf16 GEMMs, coat activations", PRECISION_BF16, ACTS_COAT, STATES_FP8_DRE},
        {"bf16 GEMMs, fp8 activations", PRECISION_BF16, ACTS_FP8, STATES_AUTO},
        {"coat, 1x16 copies of the residual stream only", PRECISION_COAT, ACTS_COAT_RESIDUAL, STATES_AUTO},
        {"coat, 1x16 copies of gate_up only", PRECISION_COAT, ACTS_COAT_GATE_UP, STATES_AUTO},
        {"bf16 GEMMs, 1x16 copies of gate_up only", PRECISION_BF16, ACTS_COAT_GATE_UP, STATES_AUTO},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        c->precision = cases[i].precision;
        c->activations = cases[i].activations;
        c->optimizer_states = cases[i].states;
        MemoryPlan plan;
        memory_plan_compute(&plan, c, 1, c->micro_batch_size);
        LlamaModel model;
        model_create(&model, &c->model, c->micro_batch_size, c->seq_len, model_precision_from_config(c));
        AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
        AdamW opt;
        adamw_create(&opt, adamw_kind_from_config(config_optimizer_states(c)), &ac, &model.layout, 0,
                     model.layout.total_padded, gpu->stream);
        size_t planned_model = plan.params_bytes + plan.grads_bytes + plan.activations_bytes + plan.working_bytes -
                               CUBLASLT_WORKSPACE_BYTES;
        size_t planned_optimizer = plan.master_bytes + plan.states_bytes;
        size_t optimizer = adamw_allocated_bytes(&opt);
        check(planned_model == model_allocated_bytes(&model) && planned_optimizer == optimizer &&
                  gpu->cublaslt_workspace_bytes == CUBLASLT_WORKSPACE_BYTES,
              "%s: the memory plan equals the allocation byte for byte (model %zu planned, %zu allocated; optimizer %zu "
              "planned, %zu allocated)", cases[i].name, planned_model, model_allocated_bytes(&model), planned_optimizer, optimizer);
        adamw_free(&opt);
        model_free(&model);
    }
    // One head of 128 in coat: the attention backward's optional dS buffer, the attention output's
    // transposes and the W^T of every layer but the last, as planned, beside the plan.
    {
        c->model.n_heads = c->model.n_kv_heads = 1;
        c->precision = PRECISION_COAT;
        c->activations = ACTS_AUTO;
        c->optimizer_states = STATES_AUTO;
        MemoryPlan plan;
        memory_plan_compute(&plan, c, 1, c->micro_batch_size);
        LlamaModel model;
        OptionalBuffers all = {1, 1, 1};
        model_create_sized(&model, &c->model, c->micro_batch_size, c->seq_len, model_precision_from_config(c), NULL, 0, 0, all);
        size_t planned_model = plan.params_bytes + plan.grads_bytes + plan.activations_bytes + plan.working_bytes -
                               CUBLASLT_WORKSPACE_BYTES + memory_plan_optional_bytes(&plan, all);
        size_t tokens = (size_t)c->micro_batch_size * c->seq_len;
        check(plan.attention_ds_bytes == (size_t)c->micro_batch_size * 1 * 8192 && model.attention_ds != NULL &&
                  plan.attention_out_t_bytes == 2 * tokens * 128 && model.attention_out_t != NULL &&
                  plan.weight_transposes_bytes == linear_layer_weight_elems(&c->model) &&
                  model.fp8_weight_transposes != NULL && planned_model == model_allocated_bytes(&model),
              "head_dim 128, coat: the plan's dS buffer (%zu bytes, one 64 x 64 tile a sequence at T = 64), the "
              "attention output's transposes (%zu bytes) and one layer's W^T (%zu bytes) allocated as planned (%zu "
              "planned, %zu allocated)", plan.attention_ds_bytes, plan.attention_out_t_bytes, plan.weight_transposes_bytes,
              planned_model, model_allocated_bytes(&model));
        model_free(&model);
        c->model = shape;
    }
    // ZeRO over 3 ranks: each rank's padded parameters, its gradients (stage 1: padded, and
    // coat/zero.cuh's BF16 gradient shard; stages 2 and 3: two bucket buffers and the FP32 shard
    // sum, at stage 3 with one micro-batch a BF16 shard), the E4M3 gather's buffers (stage 3: the
    // gather slots and the transposes' room; in bf16 BF16 slots), and its parts of the optimizer
    // (the last one's end in padding).
    c->activations = ACTS_AUTO;
    c->optimizer_states = STATES_AUTO;
    const struct { int stage, precision; long long total_batch_tokens; } zero_cases[] = {
        {1, PRECISION_COAT, 0}, {2, PRECISION_COAT, 0}, {3, PRECISION_COAT, 0}, {3, PRECISION_COAT, 4 * 3 * 4 * 64},
        {3, PRECISION_BF16, 0}, {3, PRECISION_BF16, 2 * 3 * 4 * 64},
    };
    for (int run = 0; run < 2 * (int)(sizeof(zero_cases) / sizeof(zero_cases[0])); run++) {
        int rank = run % 2 ? 2 : 0, stage = zero_cases[run / 2].stage;
        c->zero_stage = stage;
        c->precision = zero_cases[run / 2].precision;
        c->total_batch_tokens = zero_cases[run / 2].total_batch_tokens;
        MemoryPlan plan;
        memory_plan_compute(&plan, c, 3, c->micro_batch_size);
        LlamaModel model;
        ParamLayout layout, buffers;
        param_layout_init(&layout, &c->model);
        ZeroPlan *z = (ZeroPlan *)malloc(sizeof(ZeroPlan));
        zero_plan_init(z, &layout, 3, stage, (size_t)c->bucket_min_elems);
        zero_plan_micro_batches(z, memory_plan_micro_batches(c, 3, c->micro_batch_size));
        zero_model_layout(z, &c->model, &buffers);
        model_create_sized(&model, &c->model, c->micro_batch_size, c->seq_len, model_precision_from_config(c), &buffers,
                           zero_grads_elems(z), zero_layers_gathered(z));
        int fp8 = config_fp8_gemms(c), e4m3 = fp8 && config_param_gather(c) == GATHER_E4M3;
        size_t zero_bytes = zero_grad_shard_bytes(z) + (e4m3 ? zero_e4m3_gather_bytes(z) : 0) +
                            zero_layer_gather_bytes(z, &c->model, fp8);
        AdamWConfig ac = {0.9f, 0.95f, 1e-8f, 0.1f, 0, 0};
        AdamW opt;
        adamw_create_ranges(&opt, adamw_kind_from_config(config_optimizer_states(c)), &ac, &model.layout, z->bucket, z->buckets,
                            rank, gpu->stream);
        size_t planned_model = plan.params_bytes + plan.grads_bytes + plan.activations_bytes + plan.working_bytes +
                               plan.gather_bytes - CUBLASLT_WORKSPACE_BYTES - ZERO_SCALAR_BYTES;
        size_t planned_optimizer = plan.master_bytes + plan.states_bytes, optimizer = adamw_allocated_bytes(&opt);
        check(planned_model == model_allocated_bytes(&model) + zero_bytes && planned_optimizer == optimizer &&
                  z->buffer_elems > layout.total_padded && opt.n == z->shard_elems && (stage == 3) == (plan.gather_bytes > 0),
              "ZeRO stage %d, %s, %s micro-batch(es), rank %d of 3: the plan equals the allocation byte for byte (model and "
              "ZeRO's buffers %zu planned, %zu allocated; optimizer %zu planned, %zu allocated)", stage,
              fp8 ? "coat" : "bf16", zero_cases[run / 2].total_batch_tokens ? "several" : "one", rank, planned_model,
              model_allocated_bytes(&model) + zero_bytes, planned_optimizer, optimizer);
        free(z);
        adamw_free(&opt);
        model_free(&model);
    }
    free(parser);
}

int main(int argc, char **argv) {
    GpuContext gpu;
    gpu_context_create(&gpu, 0);
    test_against_cpu_reference(&gpu);
    test_memory_plan_matches_allocation(&gpu);
    test_weights_from_master(&gpu);
    test_transposes_kept(&gpu, OptionalBuffers{0, 0, 1}, ACTS_BF16, "kept weight transposes");
    test_transposes_kept(&gpu, OptionalBuffers{0, 1, 0}, ACTS_BF16, "kept attention output transposes, fp8 GEMMs, bf16 activations");
    test_transposes_kept(&gpu, OptionalBuffers{0, 1, 0}, ACTS_COAT, "kept attention output transposes, coat");
    test_gradients_written_first(&gpu);
    const PrecisionCase cases[] = {
        {"bf16", model_precision_bf16(), LOSS_REL_TOL, 0.02, GRAD_REL_TOL, 0.02},
        {"fp8 GEMMs, bf16 activations", {1, ACTS_BF16, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"fp8", {1, ACTS_FP8, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"coat", {1, ACTS_COAT, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"coat, fast accumulation", {1, ACTS_COAT, 1, 0}, 0.02, 0.10, 0.25, 0.03},
        {"bf16 GEMMs, fp8 activations", {0, ACTS_FP8, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"bf16 GEMMs, coat activations", {0, ACTS_COAT, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"coat, 1x16 copies of the residual stream only", {1, ACTS_COAT_RESIDUAL, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"coat, 1x16 copies of gate_up only", {1, ACTS_COAT_GATE_UP, 0, 0}, 0.02, 0.10, 0.25, 0.03},
        {"bf16 GEMMs, 1x16 copies of the residual stream only", {0, ACTS_COAT_RESIDUAL, 0, 0}, 0.02, 0.10, 0.25, 0.03},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        test_against_pytorch(&gpu, argc > 1 ? argv[1] : "build/debug_state.bin", &cases[i]);
    gpu_context_destroy(&gpu);
    return check_summary("test_model");
}
