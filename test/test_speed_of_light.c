// The speed-of-light table of the profile (coat/speed_of_light.h): llama-1b at 16 x 2048 by
// hand for a few ops in each precision, the GEMMs' FLOPs against 6 x tokens x weights, and every
// op name the trainer marks (coat/model.cuh, train_llama.cu) in the table and no other.
#include <stdlib.h>
#include <string.h>
#include "../coat/speed_of_light.h"
#include "check.h"

static ModelShape llama_1b(void) {
    ModelShape m;
    memset(&m, 0, sizeof(m));
    m.vocab_size = 32000;
    m.dim = 2048;
    m.n_layers = 16;
    m.n_heads = 32;
    m.n_kv_heads = 8;
    m.ffn_dim = 5632;
    m.max_seq_len = 2048;
    return m;
}

static void check_value(const char *what, double got, double expected) {
    double err = got - expected;
    check(err <= 1e-9 * expected && err >= -1e-9 * expected, "%s: expected %.6g got %.6g", what, expected, got);
}

static SolOp *op(SolTable *table, const char *name) {
    SolOp *entry = sol_find(table, name);
    if (entry == NULL) {
        check(0, "the table has \"%s\"", name);
        exit(EXIT_FAILURE);
    }
    return entry;
}

static void print_table(const char *title, SolTable *table) {
    printf("%s\n", title);
    for (int i = 0; i < table->n; i++)
        if (table->ops[i].calls > 0 && sol_ms(&table->ops[i]) > 0)
            printf("  %-50s %6.0f calls %9.3f ms\n", table->ops[i].op, table->ops[i].calls, sol_ms(&table->ops[i]));
}

static const double B = 16, T = 2048, N = 16 * 2048, H = 2048, KV = 512, I = 5632, L = 16, V = 32000;

// The padded parameter count, every tensor of llama-1b a multiple of 128 elements already.
static double llama_1b_params(void) {
    return 2 * V * H + L * (2 * H + H * H + 2 * KV * H + H * H + 3 * I * H) + H;
}

static void check_bf16(void) {
    ModelShape m = llama_1b();
    SolRun run = sol_run_one_gpu(&m, 16, 2048, 1, 0, ACTS_BF16, OPT_STATES_FP32);
    SolTable t;
    speed_of_light_table(&t, &run);
    print_table("bf16, fp32 states, one micro-batch:", &t);
    SolOp *qkv = op(&t, "matmul qkv forward");
    check_value("bf16 qkv forward: calls", qkv->calls, L);
    check_value("bf16 qkv forward: FLOPs = L 2 B T dim (dim + 2 kv_dim)", qkv->flops, L * 2 * B * T * H * (H + 2 * KV));
    check_value("bf16 qkv forward: SoL ms at the BF16 peak", sol_ms(qkv), 1e3 * qkv->flops / 989e12);
    check_value("bf16 qkv backward: twice the forward", op(&t, "matmul qkv backward")->flops, 2 * qkv->flops);
    double gemm_flops = 0;
    for (int i = 0; i < t.n; i++)
        if (strncmp(t.ops[i].op, "matmul ", 7) == 0 || strcmp(t.ops[i].op, "classifier (lm_head + cross-entropy)") == 0)
            gemm_flops += t.ops[i].flops;
    double weights = L * (H * (H + 2 * KV) + H * H + H * 2 * I + I * H) + V * H;
    check_value("bf16: the GEMMs' FLOPs = 6 x tokens x weights (embedding aside)", gemm_flops, 6 * N * weights);
    SolOp *norm = op(&t, "rmsnorm forward");
    check_value("bf16 rmsnorm forward: x read, y written (BF16), rstd, weight",
                norm->bytes, 2 * N * H + 2 * N * H + 4 * N + 2 * H);
    check_value("bf16 rmsnorm forward: SoL ms at 4.23 TB/s", sol_ms(norm), 1e3 * norm->bytes / 4.23e12);
    check_value("bf16 residual + rmsnorm forward: 2L calls", op(&t, "residual + rmsnorm forward")->calls, 2 * L);
    check_value("bf16 attention forward: causal FLOPs 4 B NH hd T (T + 1) / 2", op(&t, "attention forward")->flops,
                L * 4 * B * 32 * 64 * T * (T + 1) / 2);
    double n = llama_1b_params();
    check_value("bf16: the optimizer covers the whole padded buffer", (double)run.optimizer_elems, n);
    check_value("adamw, fp32 states: 2 (grad) + 8 (master) + 2 (param) + 16 (m, v) bytes per element + decay",
                op(&t, "adamw (after the host's wait)")->bytes, 28 * n + n / 128);
    check_value("gradient norm: BF16 gradients read once", op(&t, "gradient norm")->bytes, 2 * n);
    check(op(&t, "fp8 cast of a linear input (+ saved transpose)")->calls == 0 &&
              op(&t, "fp8 cast of the weights (once per step)")->calls == 0,
          "bf16: no FP8 cast runs");
    check(sol_ms(op(&t, "batch upload (after the host's wait)")) < 0 && sol_ms(op(&t, "embedding backward")) < 0,
          "the upload and the embedding's backward have no speed of light");
}

static void check_coat(void) {
    ModelShape m = llama_1b();
    SolRun run = sol_run_one_gpu(&m, 16, 2048, 2, 1, ACTS_COAT, OPT_STATES_FP8_DRE);
    SolTable t;
    speed_of_light_table(&t, &run);
    print_table("coat, fp8_dre states, two micro-batches:", &t);
    SolOp *qkv = op(&t, "matmul qkv forward");
    check_value("coat qkv forward: FLOPs of two micro-batches", qkv->flops, 2 * L * 2 * B * T * H * (H + 2 * KV));
    check_value("coat qkv forward: SoL ms at the FP8 peak", sol_ms(qkv), 1e3 * qkv->flops / 1979e12);
    check_value("coat classifier stays at the BF16 peak", sol_ms(op(&t, "classifier (lm_head + cross-entropy)")),
                1e3 * 2 * 3 * 2 * N * H * V / 989e12);
    // The first norm reads the BF16 residual, writes its 1x16 copy (codes and a BF16 scale per 16)
    // and rstd; no y: the cast recomputes it from the copy.
    double copy = N * H + 2 * N * H / 16;
    check_value("coat rmsnorm forward: x, its 1x16 copy, rstd, weight per micro-batch", op(&t, "rmsnorm forward")->bytes,
                2 * (2 * N * H + copy + 4 * N + 2 * H));
    check_value("coat residual + rmsnorm forward: x, branch, sum, the sum's copy, rstd, weight; the final norm's y",
                op(&t, "residual + rmsnorm forward")->bytes,
                2 * (2 * L * (3 * 2 * N * H + 4 * N + 2 * H) + (2 * L - 1) * copy + 2 * N * H));
    check_value("coat norm output casts: qkv and gate_up inputs per layer and micro-batch",
                op(&t, "rmsnorm output: fp8 cast (+ saved transpose)")->calls, 2 * 2 * L);
    check_value("coat norm output casts' bytes: the copy, rstd, weight read, codes and transposes written",
                op(&t, "rmsnorm output: fp8 cast (+ saved transpose)")->bytes, 2 * 2 * L * (copy + 4 * N + 2 * H + 2 * N * H));
    check_value("coat input casts: the attention output per layer and micro-batch",
                op(&t, "fp8 cast of a linear input (+ saved transpose)")->calls, 2 * L);
    check_value("coat input casts' bytes (no transpose saved for the attention output)",
                op(&t, "fp8 cast of a linear input (+ saved transpose)")->bytes, 2 * L * N * 3 * H);
    check_value("coat swiglu forward cast: once per layer and micro-batch",
                op(&t, "swiglu forward: fp8 cast (+ saved transpose)")->calls, 2 * L);
    check_value("coat weights cast once per step, not per micro-batch",
                op(&t, "fp8 cast of the weights (once per step)")->calls, 1);
    double n = llama_1b_params();
    check_value("adamw, fp8_dre states: 2 + 8 + 2 + 4 bytes per element, 3 scalars per group and moment",
                op(&t, "adamw (after the host's wait)")->bytes, 16 * n + 2 * 2 * 4 * 3 * n / 128 + n / 128);
    // Without BF16 block weights: the cast reads the FP32 master weights, AdamW writes BF16 only
    // outside the layers (here the embedding, final norm and lm_head, 2 V H + H elements).
    double weights = L * ((H + 2 * KV) * H + H * H + 2 * I * H + I * H);
    check_value("coat weights cast: amax pass and codes from BF16 weights",
                op(&t, "fp8 cast of the weights (once per step)")->bytes, (2 + 2 + 1) * weights);
    check_value("coat weights' transposes: remade per layer and micro-batch",
                op(&t, "fp8 transposes of the layer's weights")->calls, 2 * L);
    check_value("coat weights' transposes: codes read, transposes written",
                op(&t, "fp8 transposes of the layer's weights")->bytes, 2 * (1 + 1) * weights);
    run.casts_from_master = 1;
    run.params_written_elems = (size_t)(2 * V * H + H);
    speed_of_light_table(&t, &run);
    check_value("coat weights cast from the FP32 master weights: 4 + 4 bytes read, codes written",
                op(&t, "fp8 cast of the weights (once per step)")->bytes, (4 + 4 + 1) * weights);
    run.weights_amax_in_step = 1;
    speed_of_light_table(&t, &run);
    check_value("coat weights cast with the amax from the step: the master read once",
                op(&t, "fp8 cast of the weights (once per step)")->bytes, (4 + 1) * weights);
    run.keeps_attention_out_t = 1;
    speed_of_light_table(&t, &run);
    check_value("coat with the attention output's transposes kept: the backward remakes none",
                op(&t, "fp8 transpose of a BF16-saved input")->calls, 0);
    check_value("coat with the attention output's transposes kept: the forward's cast writes codes and transposes",
                op(&t, "fp8 cast of a linear input (+ saved transpose)")->bytes, 2 * L * N * 4 * H);
    check_value("adamw without BF16 block weights: the BF16 parameters written outside the layers only",
                op(&t, "adamw (after the host's wait)")->bytes, 14 * n + 2 * (2 * V * H + H) + 2 * 2 * 4 * 3 * n / 128 + n / 128);
}

// Every string literal passed to op_timer_mark or TIMED in `path`, appended to names.
static int marked_names(const char *path, char names[][128], int count, int capacity) {
    FILE *f = fopen(path, "r");
    if (f == NULL) {
        check(0, "open %s", path);
        return count;
    }
    char line[4096];
    while (fgets(line, sizeof(line), f)) {
        const char *at = strstr(line, "op_timer_mark(");
        if (at == NULL) at = strstr(line, "TIMED(");
        if (at == NULL) continue;
        const char *open = strchr(at, '"'), *close = open ? strchr(open + 1, '"') : NULL;
        if (close == NULL || count == capacity) continue;
        snprintf(names[count], 128, "%.*s", (int)(close - open - 1), open + 1);
        int seen = 0;
        for (int i = 0; i < count; i++) seen |= strcmp(names[i], names[count]) == 0;
        if (!seen) count++;
    }
    fclose(f);
    return count;
}

static void check_names(void) {
    static char names[SOL_MAX_OPS * 2][128];
    int count = marked_names("coat/model.cuh", names, 0, SOL_MAX_OPS * 2);
    count = marked_names("coat/zero.cuh", names, count, SOL_MAX_OPS * 2);
    count = marked_names("train_llama.cu", names, count, SOL_MAX_OPS * 2);
    check(count >= 30, "the trainer marks %d op names (coat/model.cuh, coat/zero.cuh, train_llama.cu)", count);
    ModelShape m = llama_1b();
    SolRun run = sol_run_one_gpu(&m, 16, 2048, 1, 0, ACTS_BF16, OPT_STATES_FP32);
    SolTable t;
    speed_of_light_table(&t, &run);
    int missing = 0, stale = 0;
    for (int i = 0; i < count; i++)
        if (sol_find(&t, names[i]) == NULL) {
            printf("  marked but not in the table: \"%s\"\n", names[i]);
            missing++;
        }
    for (int i = 0; i < t.n; i++) {
        int marked = 0;
        for (int j = 0; j < count; j++) marked |= strcmp(t.ops[i].op, names[j]) == 0;
        if (!marked) {
            printf("  in the table but never marked: \"%s\"\n", t.ops[i].op);
            stale++;
        }
    }
    check(missing == 0, "every marked op has an entry or a reason for none (%d missing)", missing);
    check(stale == 0, "every entry is an op the trainer marks (%d stale)", stale);
}

int main(void) {
    check_bf16();
    check_coat();
    check_names();
    return check_summary("test_speed_of_light");
}
