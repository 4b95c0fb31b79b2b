// train_llama: pretrains a Llama 2/3 model from scratch in BF16, TransformerEngine-like FP8
// or COAT (FP8 GEMMs, FP8 activations, FP8 optimizer states). One process per GPU.
//   ./train_llama CONFIG [--key=value ...]      (./train_llama --help lists the keys)
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "coat/config.h"
#include "coat/memory_plan.h"
#include "coat/params.h"

#define EXIT_CONFIG_ERROR 2

// Reads CONFIG and the --key=value overrides; any problem is one line naming file:line, exit 2.
static void load_config_or_exit(ConfigParser *parser, int argc, char **argv) {
    char error[CONFIG_ERROR_MAX];
    config_defaults(parser);
    int status = config_load_file(parser, argv[1], error, sizeof(error));
    for (int i = 2; status == 0 && i < argc; i++) status = config_parse_argument(parser, argv[i], error, sizeof(error));
    if (status == 0) status = config_validate(parser, error, sizeof(error));
    if (status != 0) {
        fprintf(stderr, "error: %s\n", error);
        exit(EXIT_CONFIG_ERROR);
    }
}

static void print_model_summary(const TrainConfig *c) {
    ParamLayout layout;
    param_layout_init(&layout, &c->model);
    const ModelShape *m = &c->model;
    printf("model: vocab %d, dim %d, %d layers, %d heads (%d kv, head_dim %d), ffn %d, seq %d\n", m->vocab_size,
           m->dim, m->n_layers, m->n_heads, m->n_kv_heads, model_head_dim(m), m->ffn_dim, c->seq_len);
    printf("parameters: %zu (%.1fM; %.1fM without the embedding)\n", layout.total_params, layout.total_params / 1e6,
           param_count_non_embedding(&layout) / 1e6);
}

// Saved activations of one layer, by tensor, in the paper's unit U = tokens * dim * 2 bytes.
static void print_activation_table(const TrainConfig *c) {
    ActivationInfo table[ACT_LAYER_KINDS];
    activation_table(table, &c->model, config_activations(c));
    double unit = 2.0 * c->model.dim;
    printf("saved per layer and token:");
    for (int i = 0; i < ACT_LAYER_KINDS; i++)
        printf(" %s %s %.2fU%s", table[i].name, activation_storage_name(table[i].storage),
               activation_bytes(table[i].storage, table[i].per_token * 16) / 16.0 / unit, i + 1 < ACT_LAYER_KINDS ? "," : "\n");
    printf("saved per layer: %.2fU (U = tokens x dim x 2 bytes)\n",
           activation_layer_bytes(&c->model, config_activations(c), 1 << 16) / (double)(1 << 16) / unit);
}

// dry_run: validates everything that needs no GPU and prints the plan; exit 0 when it holds.
static int dry_run(const ConfigParser *parser, int ranks) {
    const TrainConfig *c = &parser->values;
    char error[CONFIG_ERROR_MAX];
    int grad_accum = config_grad_accum_steps(parser, ranks, error, sizeof(error));
    if (grad_accum < 0) {
        fprintf(stderr, "error: %s\n", error);
        return EXIT_CONFIG_ERROR;
    }
    print_model_summary(c);
    printf("batch: %d x %d tokens per micro-step x %d rank(s) x %d accumulation step(s) = %lld tokens per step\n",
           c->micro_batch_size, c->seq_len, ranks, grad_accum,
           (long long)c->micro_batch_size * c->seq_len * ranks * grad_accum);
    MemoryPlan plan;
    memory_plan_compute(&plan, c, ranks, c->micro_batch_size);
    memory_plan_print(stdout, &plan, c);
    print_activation_table(c);
    if (c->gpu_memory_gib > 0) {
        size_t budget = (size_t)(c->gpu_memory_gib * 1024.0 * 1024.0 * 1024.0);
        if (plan.total_bytes > budget) {
            fprintf(stderr, "error: %s: micro_batch_size %d needs %.2f GiB, more than gpu_memory_gib %.2f; the largest that fits is %d\n",
                    config_source(parser, "micro_batch_size"), c->micro_batch_size, gib(plan.total_bytes),
                    (double)c->gpu_memory_gib, memory_plan_largest_micro_batch(c, ranks, budget));
            return EXIT_CONFIG_ERROR;
        }
        printf("fits in %.1f GiB (largest micro-batch that fits: %d)\n", (double)c->gpu_memory_gib,
               memory_plan_largest_micro_batch(c, ranks, budget));
    }
    printf("dry run: configuration is valid\n");
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        config_print_help(stdout);
        return 0;
    }
    if (argc < 2 || strncmp(argv[1], "--", 2) == 0) {
        fprintf(stderr, "usage: train_llama CONFIG [--key=value ...]   (train_llama --help lists the keys)\n");
        return EXIT_CONFIG_ERROR;
    }
    ConfigParser *parser = (ConfigParser *)malloc(sizeof(ConfigParser));
    if (!parser) { fprintf(stderr, "error: out of host memory\n"); return 1; }
    load_config_or_exit(parser, argc, argv);
    int ranks = parser->values.world_size > 0 ? parser->values.world_size : 1;
    int status = parser->values.dry_run ? dry_run(parser, ranks) : EXIT_CONFIG_ERROR;
    free(parser);
    return status;
}
