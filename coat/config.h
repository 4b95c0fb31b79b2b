// Run configuration: every key with its type, default, range and meaning in one table.
// Files are `key = value` lines with `#` comments and `include = other.conf` (relative to the
// including file); `--key=value` arguments override them. Errors name file:line.
// Plain C; the trainer, dry_run and the tests share it.
// The trainer's plumbing, not model code: it stays in coat/ because the model side reads the
// config too (the memory plan, the model's precision).
#pragma once
#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include "model_shape.h"
#include "precision.h"

#define CONFIG_STRING_MAX 512
#define CONFIG_INCLUDE_DEPTH_MAX 16
#define CONFIG_MAX_ACCUMULATION_STEPS (1 << 20)  // micro-batches per optimizer step
#define CONFIG_ERROR_MAX 1024

typedef enum { SCHEDULE_COSINE, SCHEDULE_LINEAR, SCHEDULE_WSD, SCHEDULE_CONSTANT } Schedule;
typedef enum { COMM_NCCL, COMM_MPI } CommBackendChoice;
typedef enum { SHUFFLE_BATCHES, SHUFFLE_ROWS } ShuffleChoice;
typedef enum { CHECKPOINT_WRITES_RANK0, CHECKPOINT_WRITES_PER_RANK } CheckpointWrites;

typedef struct {
    ModelShape model;
    // precision
    int precision;            // Precision
    int optimizer_states;     // StatesChoice
    int activations;          // ActivationsChoice
    int fp8_fast_accum;
    int optimizer_rounding;   // 0 nearest, 1 stochastic (FP8 states)
    // data and files
    char train_data[CONFIG_STRING_MAX];
    char val_data[CONFIG_STRING_MAX];
    int shuffle;  // ShuffleChoice
    char tokenizer[CONFIG_STRING_MAX];
    char out_dir[CONFIG_STRING_MAX];
    int resume;
    int overwrite;
    char init_from[CONFIG_STRING_MAX];
    int generate;
    char logits_out[CONFIG_STRING_MAX];
    int checkpoint_every;
    int checkpoint_final;
    int checkpoints_keep;
    int checkpoint_writes;  // CheckpointWrites
    // batch and schedule
    int micro_batch_size;
    int seq_len;
    long long total_batch_tokens;
    int max_steps;
    float learning_rate;
    float min_lr_ratio;
    int warmup_steps;
    int lr_schedule;          // Schedule
    float wsd_decay_fraction;
    float weight_decay;
    int weight_decay_all;
    float beta1, beta2, adam_eps;
    float grad_clip;
    int max_nonfinite_steps;
    // evaluation, sampling, logging
    int val_every;
    int val_batches;
    int sample_every;
    int sample_tokens;
    float top_p;
    float temperature;
    char sample_prompt[CONFIG_STRING_MAX];
    // distribution and planning
    int zero_stage;
    int shard_group;
    int bucket_min_elems;
    int world_size;
    int comm_backend;  // CommBackendChoice
    float collective_timeout_s;
    int param_gather;  // ParamGatherChoice
    float gpu_memory_gib;
    unsigned long long seed;
    int dry_run;
    int profile;
} TrainConfig;

typedef enum { KEY_INT, KEY_INT64, KEY_FLOAT, KEY_STRING, KEY_CHOICE } ConfigKeyType;

typedef struct {
    const char *name;
    ConfigKeyType type;
    size_t offset;
    const char *default_value;
    double min, max;          // inclusive range for numbers
    const char *choices;      // "a|b|c" for KEY_CHOICE, in enum order
    const char *help;
} ConfigKey;

#define CFG(field) offsetof(TrainConfig, field)
#define CFG_MODEL(field) (offsetof(TrainConfig, model) + offsetof(ModelShape, field))
#define CONFIG_KEY_TYPE_int KEY_INT
#define CONFIG_KEY_TYPE_float KEY_FLOAT
#define CONFIG_MODEL_KEY(name, type, load, default_value, min, max, help) \
    {#name, CONFIG_KEY_TYPE_##type, CFG_MODEL(name), default_value, min, max, NULL, help},
static const ConfigKey config_keys[] = {
    // model shape (coat/model_shape.h)
    MODEL_SHAPE_KEYS(CONFIG_MODEL_KEY)
    // precision
    {"precision", KEY_CHOICE, CFG(precision), "bf16", 0, 0, "bf16|fp8|coat",
     "GEMMs, activations and optimizer states: bf16, TransformerEngine-like fp8, or COAT"},
    {"optimizer_states", KEY_CHOICE, CFG(optimizer_states), "auto", 0, 0, "auto|fp32|bf16|fp8|fp8_dre",
     "AdamW moment storage (auto: fp8_dre for coat, else fp32)"},
    {"activations", KEY_CHOICE, CFG(activations), "auto", 0, 0, "auto|bf16|fp8|coat|coat_residual|coat_gate_up",
     "storage of activations saved for backward (auto: follows precision; coat_residual, coat_gate_up: "
     "coat's 1x16 copies of the residual stream only, or of gate|up only)"},
    {"fp8_fast_accum", KEY_INT, CFG(fp8_fast_accum), "0", 0, 1, NULL, "Hopper fast accumulation in the FP8 GEMMs (precision fp8 or coat)"},
    {"optimizer_rounding", KEY_CHOICE, CFG(optimizer_rounding), "nearest", 0, 0, "nearest|stochastic",
     "how FP8 optimizer states are stored: nearest even (COAT) or stochastic rounding (unbiased)"},
    // data and files
    {"train_data", KEY_STRING, CFG(train_data), "", 0, 0, NULL, "glob of training token shards"},
    {"val_data", KEY_STRING, CFG(val_data), "", 0, 0, NULL, "glob of validation token shards"},
    {"shuffle", KEY_CHOICE, CFG(shuffle), "batches", 0, 0, "batches|rows",
     "training order: a permutation of whole batches (B consecutive rows of a shard), or of single rows, so that a "
     "batch's rows come from all over the data (for shards whose neighbouring text is alike)"},
    {"tokenizer", KEY_STRING, CFG(tokenizer), "", 0, 0, NULL, "HF tokenizer.json (for sampling)"},
    {"out_dir", KEY_STRING, CFG(out_dir), "out", 0, 0, NULL, "logs and checkpoints go here"},
    {"resume", KEY_INT, CFG(resume), "0", 0, 1, NULL, "continue from the newest checkpoint in out_dir"},
    {"overwrite", KEY_INT, CFG(overwrite), "0", 0, 1, NULL,
     "with resume = 0: remove an earlier run's checkpoints and log from out_dir and start over"},
    {"init_from", KEY_STRING, CFG(init_from), "", 0, 0, NULL, "checkpoint file whose weights start the run (fresh optimizer)"},
    {"generate", KEY_INT, CFG(generate), "0", 0, 1, NULL,
     "sample sample_tokens after sample_prompt from the newest checkpoint in out_dir (or init_from), then exit"},
    {"logits_out", KEY_STRING, CFG(logits_out), "", 0, 0, NULL,
     "with generate: also write the prompt's logits here (int32 count, vocab, ids; float32 [count, vocab])"},
    {"checkpoint_every", KEY_INT, CFG(checkpoint_every), "0", 0, INT_MAX, NULL, "steps between checkpoints (0: only at the end)"},
    {"checkpoint_final", KEY_INT, CFG(checkpoint_final), "1", 0, 1, NULL,
     "write a checkpoint after the last step (0: none, for benchmarks: a 7B model's is 42-81 GB)"},
    {"checkpoints_keep", KEY_INT, CFG(checkpoints_keep), "2", 1, 1000, NULL, "newest checkpoints kept"},
    {"checkpoint_writes", KEY_CHOICE, CFG(checkpoint_writes), "rank0", 0, 0, "rank0|per_rank",
     "rank0: one file, ckpt_<step>.bin, written by rank 0 (sharded states pass through it); per_rank, for large "
     "states: every rank writes its parts to ckpt_<step>.rank<r>.bin in parallel and rank 0 a manifest, "
     "ckpt_<step>.bin. Either resumes on any world size and stage; scripts/convert_hf.py merge makes one file"},
    // batch and schedule
    {"micro_batch_size", KEY_INT, CFG(micro_batch_size), "16", 1, 1 << 20, NULL, "sequences per GPU per forward"},
    {"seq_len", KEY_INT, CFG(seq_len), "0", 0, 1 << 20, NULL, "tokens per sequence (0: max_seq_len)"},
    {"total_batch_tokens", KEY_INT64, CFG(total_batch_tokens), "0", 0, 1e15, NULL,
     "tokens per optimizer step over all ranks (0: one micro-batch per rank); a multiple of micro_batch_size * seq_len * ranks"},
    {"max_steps", KEY_INT, CFG(max_steps), "1000", 1, INT_MAX, NULL, "optimizer steps"},
    {"learning_rate", KEY_FLOAT, CFG(learning_rate), "6e-4", 0, 10, NULL, "peak learning rate"},
    {"min_lr_ratio", KEY_FLOAT, CFG(min_lr_ratio), "0.1", 0, 1, NULL, "final learning rate / peak"},
    {"warmup_steps", KEY_INT, CFG(warmup_steps), "100", 0, INT_MAX, NULL, "linear warmup steps"},
    {"lr_schedule", KEY_CHOICE, CFG(lr_schedule), "cosine", 0, 0, "cosine|linear|wsd|constant", "decay after warmup"},
    {"wsd_decay_fraction", KEY_FLOAT, CFG(wsd_decay_fraction), "0.2", 0, 1, NULL, "wsd: fraction of steps spent decaying"},
    {"weight_decay", KEY_FLOAT, CFG(weight_decay), "0.1", 0, 10, NULL, "decoupled AdamW weight decay"},
    {"weight_decay_all", KEY_INT, CFG(weight_decay_all), "0", 0, 1, NULL, "decay norms too (0: 2-D weights only)"},
    {"beta1", KEY_FLOAT, CFG(beta1), "0.9", 0, 0.999999, NULL, "AdamW beta1"},
    {"beta2", KEY_FLOAT, CFG(beta2), "0.95", 0, 0.999999, NULL, "AdamW beta2"},
    {"adam_eps", KEY_FLOAT, CFG(adam_eps), "1e-8", 0, 1, NULL, "AdamW epsilon"},
    {"grad_clip", KEY_FLOAT, CFG(grad_clip), "1.0", 0, 1e9, NULL, "global gradient norm clip (0: off)"},
    {"max_nonfinite_steps", KEY_INT, CFG(max_nonfinite_steps), "3", 1, 1 << 20, NULL,
     "steps in a row whose loss or gradient norm is NaN or inf (each skipped) before the run stops"},
    // evaluation, sampling
    {"val_every", KEY_INT, CFG(val_every), "100", 0, INT_MAX, NULL, "steps between validation passes (0: never)"},
    {"val_batches", KEY_INT, CFG(val_batches), "20", 1, INT_MAX, NULL, "micro-batches per validation pass"},
    {"sample_every", KEY_INT, CFG(sample_every), "0", 0, INT_MAX, NULL, "steps between text samples (0: never)"},
    {"sample_tokens", KEY_INT, CFG(sample_tokens), "64", 1, 1 << 20, NULL, "tokens generated per sample"},
    {"top_p", KEY_FLOAT, CFG(top_p), "0.9", 0, 1, NULL, "nucleus sampling mass (0: greedy)"},
    {"temperature", KEY_FLOAT, CFG(temperature), "1.0", 0, 100, NULL, "sampling temperature"},
    {"sample_prompt", KEY_STRING, CFG(sample_prompt), "", 0, 0, NULL, "text the samples continue"},
    // distribution and planning
    {"zero_stage", KEY_INT, CFG(zero_stage), "1", 0, 3, NULL,
     "ZeRO: 0 replicate, 1 shard optimizer states, 2 also gradients, 3 also the layers' working weights"},
    {"shard_group", KEY_INT, CFG(shard_group), "0", 0, 1 << 20, NULL,
     "hybrid sharding at ZeRO stages 1 to 3: the ranks form groups of this many consecutive ranks (a node), each "
     "sharding the states as ZeRO over all ranks would, the groups replicas of each other whose gradients are summed "
     "across them (0 or the world size: one group of every rank; it must divide the world size, and 1 is zero_stage = 0)"},
    {"bucket_min_elems", KEY_INT, CFG(bucket_min_elems), "33554432", 1, INT_MAX, NULL,
     "data parallelism merges neighbouring layers into one gradient bucket (one reduce-scatter and one all-gather a "
     "step) until it holds this many parameters; the tail and the embedding stand alone"},
    {"comm_backend", KEY_CHOICE, CFG(comm_backend), "nccl", 0, 0, "nccl|mpi",
     "collectives between ranks: nccl (a GPU per rank) or mpi (through host memory: ranks may share a GPU)"},
    {"param_gather", KEY_CHOICE, CFG(param_gather), "auto", 0, 0, "auto|bf16|e4m3",
     "how ZeRO stages 1 and 2 gather the parameters after the step: all bf16, or the block weights as the E4M3 "
     "copies the FP8 GEMMs read (auto: e4m3 with FP8 GEMMs); e4m3 casts them from the FP32 master weights and keeps "
     "no BF16 copy of them, at any stage and world size"},
    {"collective_timeout_s", KEY_FLOAT, CFG(collective_timeout_s), "600", 1, 1e6, NULL,
     "seconds a rank launched without MPI waits for the others at the rendezvous before it gives up, naming the missing rank; "
     "with NCCL and several ranks, also the longest a rank waits for work that includes collectives (a micro-batch, a "
     "step's reduces): past it, or on an NCCL error, the rank aborts the communicator and exits with status 3, naming "
     "the wait"},
    {"world_size", KEY_INT, CFG(world_size), "0", 0, 1 << 20, NULL, "ranks to plan for in dry_run (0: the launched ranks)"},
    {"gpu_memory_gib", KEY_FLOAT, CFG(gpu_memory_gib), "0", 0, 1e6, NULL,
     "GPU memory to plan against (0: ask the GPU; dry_run without a GPU skips the fit check)"},
    {"seed", KEY_INT64, CFG(seed), "1337", 0, 9.2e18, NULL, "initialisation and data order"},
    {"dry_run", KEY_INT, CFG(dry_run), "0", 0, 1, NULL, "validate config, data and plan memory, then exit; needs no GPU"},
    {"profile", KEY_INT, CFG(profile), "0", 0, 1, NULL,
     "time every op of the training steps on the GPU and print the table at the end (the first step is left out)"},
};
#undef CFG
#undef CFG_MODEL
#undef CONFIG_KEY_TYPE_int
#undef CONFIG_KEY_TYPE_float
#undef CONFIG_MODEL_KEY
#define CONFIG_KEY_COUNT (sizeof(config_keys) / sizeof(config_keys[0]))

// Where each key got its value, for error messages that point at the line.
typedef struct {
    TrainConfig values;
    char source[CONFIG_KEY_COUNT][CONFIG_STRING_MAX];  // "file:line", "command line" or "default"
    char include_stack[CONFIG_INCLUDE_DEPTH_MAX][PATH_MAX];
    int include_depth;
} ConfigParser;

static inline const ConfigKey *config_find_key(const char *name) {
    for (size_t i = 0; i < CONFIG_KEY_COUNT; i++)
        if (strcmp(config_keys[i].name, name) == 0) return &config_keys[i];
    return NULL;
}

// Index of `value` among "a|b|c", or -1.
static inline int config_choice_index(const char *choices, const char *value) {
    size_t len = strlen(value);
    int index = 0;
    for (const char *p = choices; *p; index++) {
        const char *end = strchr(p, '|');
        size_t n = end ? (size_t)(end - p) : strlen(p);
        if (n == len && strncmp(p, value, n) == 0) return index;
        if (!end) break;
        p = end + 1;
    }
    return -1;
}

// The text of choice `index` in "a|b|c" (into a static-free caller buffer).
static inline const char *config_choice_name(const char *choices, int index, char *buf, size_t size) {
    const char *p = choices;
    for (int i = 0; i < index && p; i++) { p = strchr(p, '|'); if (p) p++; }
    if (!p) { snprintf(buf, size, "?"); return buf; }
    const char *end = strchr(p, '|');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    snprintf(buf, size, "%.*s", (int)n, p);
    return buf;
}

// Parses `text` into the key's field. Returns 0, or -1 with a message (no location).
static inline int config_set_value(TrainConfig *cfg, const ConfigKey *key, const char *text, char *error, size_t error_size) {
    char *field = (char *)cfg + key->offset;
    char *end = NULL;
    errno = 0;
    switch (key->type) {
    case KEY_INT:
    case KEY_INT64: {
        double scaled;
        long long v = strtoll(text, &end, 10);
        if (*text == '\0' || *end != '\0' || errno) {
            // Accept exact numbers written in float notation (1e6, 2.5e5) for large counts.
            scaled = strtod(text, &end);
            if (*text == '\0' || *end != '\0' || errno || scaled != floor(scaled) || fabs(scaled) > 9.2e18) {
                snprintf(error, error_size, "%s: '%s' is not an integer", key->name, text);
                return -1;
            }
            v = (long long)scaled;
        }
        if ((double)v < key->min || (double)v > key->max) {
            snprintf(error, error_size, "%s: %lld is outside [%.15g, %.15g]", key->name, v, key->min, key->max);
            return -1;
        }
        if (key->type == KEY_INT) *(int *)field = (int)v;
        else *(long long *)field = v;
        return 0;
    }
    case KEY_FLOAT: {
        double v = strtod(text, &end);
        if (*text == '\0' || *end != '\0' || errno || !isfinite(v)) {
            snprintf(error, error_size, "%s: '%s' is not a number", key->name, text);
            return -1;
        }
        if (v < key->min || v > key->max) {
            snprintf(error, error_size, "%s: %g is outside [%g, %g]", key->name, v, key->min, key->max);
            return -1;
        }
        *(float *)field = (float)v;
        return 0;
    }
    case KEY_STRING:
        if (strlen(text) >= CONFIG_STRING_MAX) {
            snprintf(error, error_size, "%s: value longer than %d characters", key->name, CONFIG_STRING_MAX - 1);
            return -1;
        }
        strcpy(field, text);
        return 0;
    case KEY_CHOICE: {
        int index = config_choice_index(key->choices, text);
        if (index < 0) {
            snprintf(error, error_size, "%s: '%s' is not one of %s", key->name, text, key->choices);
            return -1;
        }
        *(int *)field = index;
        return 0;
    }
    }
    return -1;
}

static inline void config_defaults(ConfigParser *parser) {
    char error[CONFIG_ERROR_MAX];
    memset(parser, 0, sizeof(*parser));
    for (size_t i = 0; i < CONFIG_KEY_COUNT; i++) {
        if (config_set_value(&parser->values, &config_keys[i], config_keys[i].default_value, error, sizeof(error)) != 0) {
            fprintf(stderr, "error: bad built-in default: %s\n", error);
            exit(EXIT_FAILURE);
        }
        snprintf(parser->source[i], CONFIG_STRING_MAX, "default");
    }
}

static inline char *config_trim(char *s) {
    while (isspace((unsigned char)*s)) s++;
    char *end = s + strlen(s);
    while (end > s && isspace((unsigned char)end[-1])) *--end = '\0';
    return s;
}

// Sets one key from "name" and "value", recording `where` as its source.
static inline int config_assign(ConfigParser *parser, const char *name, const char *value, const char *where,
                                char *error, size_t error_size) {
    const ConfigKey *key = config_find_key(name);
    char message[CONFIG_ERROR_MAX];
    if (!key) {
        snprintf(error, error_size, "%s: unknown key '%s' (./train_llama --help lists the keys)", where, name);
        return -1;
    }
    if (config_set_value(&parser->values, key, value, message, sizeof(message)) != 0) {
        snprintf(error, error_size, "%s: %s", where, message);
        return -1;
    }
    snprintf(parser->source[key - config_keys], CONFIG_STRING_MAX, "%s", where);
    return 0;
}

static inline int config_load_file(ConfigParser *parser, const char *path, char *error, size_t error_size);

// One line of a config file: blank, comment, `include = path` or `key = value`. A comment starts
// at a '#' at the start of the line or after a blank; a '#' glued to text would silently cut a
// value (`out_dir = runs/a#2`), so it is refused. first_line[key] is the line of this file that
// set the key (0: none): a key set twice in one file is refused, later files may override it.
static inline int config_parse_line(ConfigParser *parser, const char *path, int line_number, char *line,
                                    int first_line[CONFIG_KEY_COUNT], char *error, size_t error_size) {
    char where[CONFIG_STRING_MAX];
    snprintf(where, sizeof(where), "%s:%d", path, line_number);
    char *hash = strchr(line, '#');
    if (hash && hash > line && !isspace((unsigned char)hash[-1])) {
        snprintf(error, error_size, "%s: '#' inside a value starts a comment and would cut it; put a blank before a comment",
                 where);
        return -1;
    }
    if (hash) *hash = '\0';
    char *text = config_trim(line);
    if (*text == '\0') return 0;
    char *equals = strchr(text, '=');
    if (!equals) {
        snprintf(error, error_size, "%s: expected 'key = value', got '%s'", where, text);
        return -1;
    }
    *equals = '\0';
    char *name = config_trim(text), *value = config_trim(equals + 1);
    if (*name == '\0') {
        snprintf(error, error_size, "%s: missing key before '='", where);
        return -1;
    }
    if (strcmp(name, "include") != 0) {
        const ConfigKey *key = config_find_key(name);
        if (key != NULL && first_line[key - config_keys] != 0) {
            snprintf(error, error_size, "%s: %s is set twice in this file (first at line %d)", where, name,
                     first_line[key - config_keys]);
            return -1;
        }
        if (key != NULL) first_line[key - config_keys] = line_number;
        return config_assign(parser, name, value, where, error, error_size);
    }
    if (*value == '\0') {
        snprintf(error, error_size, "%s: include names no file", where);
        return -1;
    }
    // Includes are relative to the including file's directory.
    char include_path[PATH_MAX];
    const char *slash = strrchr(path, '/');
    if (value[0] == '/' || !slash) snprintf(include_path, sizeof(include_path), "%s", value);
    else snprintf(include_path, sizeof(include_path), "%.*s/%s", (int)(slash - path), path, value);
    char message[CONFIG_ERROR_MAX];
    if (config_load_file(parser, include_path, message, sizeof(message)) != 0) {
        snprintf(error, error_size, "%s: %s", where, message);
        return -1;
    }
    return 0;
}

static inline int config_load_file(ConfigParser *parser, const char *path, char *error, size_t error_size) {
    char resolved[PATH_MAX];
    if (!realpath(path, resolved)) {
        snprintf(error, error_size, "%s: cannot open config: %s", path, strerror(errno));
        return -1;
    }
    for (int i = 0; i < parser->include_depth; i++) {
        if (strcmp(parser->include_stack[i], resolved) == 0) {
            snprintf(error, error_size, "%s: include cycle", path);
            return -1;
        }
    }
    if (parser->include_depth == CONFIG_INCLUDE_DEPTH_MAX) {
        snprintf(error, error_size, "%s: includes nested deeper than %d", path, CONFIG_INCLUDE_DEPTH_MAX);
        return -1;
    }
    // A folder would read as an error, a FIFO would block: only a regular file is a config.
    struct stat info;
    if (stat(resolved, &info) == 0 && !S_ISREG(info.st_mode)) {
        snprintf(error, error_size, "%s: is %s, not a config file", path, S_ISDIR(info.st_mode) ? "a directory" : "no regular file");
        return -1;
    }
    FILE *file = fopen(path, "r");
    if (!file) {
        snprintf(error, error_size, "%s: cannot open config: %s", path, strerror(errno));
        return -1;
    }
    snprintf(parser->include_stack[parser->include_depth++], PATH_MAX, "%s", resolved);
    char line[4096];
    int line_number = 0, status = 0, at_end = 0;
    int first_line[CONFIG_KEY_COUNT] = {0};
    // A UTF-8 byte order mark (some editors write one) is no part of the first key.
    unsigned char mark[3];
    if (fread(mark, 1, sizeof(mark), file) != sizeof(mark) || memcmp(mark, "\xEF\xBB\xBF", sizeof(mark)) != 0) rewind(file);
    while (status == 0 && !at_end) {
        // A line at a time by hand: fgets cannot tell a NUL byte (a binary file) from the line's end.
        size_t length = 0;
        int ch = 0;
        while ((ch = getc(file)) != EOF && ch != '\n' && ch != '\0' && length < sizeof(line) - 1) line[length++] = (char)ch;
        line[length] = '\0';
        at_end = ch == EOF;
        if (at_end && length == 0) break;
        line_number++;
        if (ch == '\0') {
            snprintf(error, error_size, "%s:%d: a NUL byte: not a text config file", path, line_number);
            status = -1;
        } else if (ch != '\n' && ch != EOF) {
            snprintf(error, error_size, "%s:%d: line longer than %zu characters", path, line_number, sizeof(line) - 1);
            status = -1;
        } else {
            status = config_parse_line(parser, path, line_number, line, first_line, error, error_size);
        }
    }
    if (status == 0 && ferror(file)) {
        snprintf(error, error_size, "%s: read error: %s", path, strerror(errno));
        status = -1;
    }
    fclose(file);
    parser->include_depth--;
    return status;
}

// One `--key=value` argument.
static inline int config_parse_argument(ConfigParser *parser, const char *argument, char *error, size_t error_size) {
    char buf[CONFIG_STRING_MAX + 256];
    if (strncmp(argument, "--", 2) != 0 || !strchr(argument, '=') || strlen(argument) >= sizeof(buf)) {
        snprintf(error, error_size, "command line: expected --key=value, got '%s'", argument);
        return -1;
    }
    snprintf(buf, sizeof(buf), "%s", argument + 2);
    char *equals = strchr(buf, '=');
    *equals = '\0';
    return config_assign(parser, buf, equals + 1, "command line", error, error_size);
}

static inline const char *config_source(const ConfigParser *parser, const char *name) {
    const ConfigKey *key = config_find_key(name);
    return key ? parser->source[key - config_keys] : "?";
}

static inline int config_is_default(const ConfigParser *parser, const char *name) {
    return strcmp(config_source(parser, name), "default") == 0;
}

// Where a check of two keys points: the later key's line, or the other's when the later one is
// a default (a check must not point at "default" when a file set the other key).
static inline const char *config_source_of_pair(const ConfigParser *parser, const char *first, const char *later) {
    return config_is_default(parser, later) ? config_source(parser, first) : config_source(parser, later);
}

// Checks that involve several keys; the message names where the offending key was set.
static inline int config_validate(ConfigParser *parser, char *error, size_t error_size) {
    TrainConfig *c = &parser->values;
    ModelShape *m = &c->model;
    if (c->seq_len == 0) c->seq_len = m->max_seq_len;
    if (m->dim % m->n_heads != 0) {
        snprintf(error, error_size, "%s: dim %d is not a multiple of n_heads %d%s", config_source_of_pair(parser, "dim", "n_heads"),
                 m->dim, m->n_heads, config_is_default(parser, "n_heads") ? " (default)" : "");
        return -1;
    }
    if (m->n_heads % m->n_kv_heads != 0) {
        snprintf(error, error_size, "%s: n_heads %d is not a multiple of n_kv_heads %d%s",
                 config_source_of_pair(parser, "n_heads", "n_kv_heads"), m->n_heads, m->n_kv_heads,
                 config_is_default(parser, "n_kv_heads") ? " (default)" : "");
        return -1;
    }
    if (model_head_dim(m) != 64 && model_head_dim(m) != 128) {
        snprintf(error, error_size, "%s: head_dim = dim / n_heads = %d; the attention kernels support 64 and 128",
                 config_source(parser, "n_heads"), model_head_dim(m));
        return -1;
    }
    // cuBLASLt wants 16-byte aligned rows (FP8: 16 elements), and the fused QKV and gate/up GEMMs
    // need those weights back to back, which the 128-element padding preserves when these hold.
    if (m->dim % 16 != 0 || m->ffn_dim % 16 != 0) {
        snprintf(error, error_size, "%s: dim %d and ffn_dim %d must be multiples of 16",
                 config_source(parser, m->dim % 16 ? "dim" : "ffn_dim"), m->dim, m->ffn_dim);
        return -1;
    }
    if (((long long)m->dim * m->dim) % 128 != 0 || ((long long)m->n_kv_heads * model_head_dim(m) * m->dim) % 128 != 0 ||
        ((long long)m->ffn_dim * m->dim) % 128 != 0) {
        snprintf(error, error_size, "%s: weight matrices must hold a multiple of 128 elements", config_source(parser, "dim"));
        return -1;
    }
    if (c->shard_group == 1) {
        snprintf(error, error_size, "%s: shard_group = 1 would replicate every state on every rank: that is zero_stage = 0",
                 config_source(parser, "shard_group"));
        return -1;
    }
    if (c->shard_group > 0 && c->zero_stage == 0) {
        snprintf(error, error_size, "%s: shard_group = %d groups the ranks that shard the states, but zero_stage = 0 shards "
                 "nothing", config_source_of_pair(parser, "zero_stage", "shard_group"), c->shard_group);
        return -1;
    }
    if (c->seq_len > m->max_seq_len) {
        snprintf(error, error_size, "%s: seq_len %d exceeds max_seq_len %d", config_source(parser, "seq_len"), c->seq_len, m->max_seq_len);
        return -1;
    }
    if (m->rope_scaling_factor > 0 && m->rope_high_freq_factor <= m->rope_low_freq_factor) {
        snprintf(error, error_size, "%s: rope_high_freq_factor must exceed rope_low_freq_factor",
                 config_source(parser, "rope_high_freq_factor"));
        return -1;
    }
    if (c->warmup_steps > c->max_steps) {
        snprintf(error, error_size, "%s: warmup_steps %d exceeds max_steps %d", config_source(parser, "warmup_steps"),
                 c->warmup_steps, c->max_steps);
        return -1;
    }
    return 0;
}

// Steps of gradient accumulation for a world of `ranks`; -1 with a message when the batch does not divide.
static inline int config_grad_accum_steps(const ConfigParser *parser, int ranks, char *error, size_t error_size) {
    const TrainConfig *c = &parser->values;
    long long per_micro_step = (long long)c->micro_batch_size * c->seq_len * ranks;
    if (c->total_batch_tokens == 0) return 1;
    if (c->total_batch_tokens % per_micro_step != 0) {
        snprintf(error, error_size, "%s: total_batch_tokens %lld is not a multiple of micro_batch_size * seq_len * ranks = %lld",
                 config_source(parser, "total_batch_tokens"), c->total_batch_tokens, per_micro_step);
        return -1;
    }
    long long steps = c->total_batch_tokens / per_micro_step;
    if (steps > CONFIG_MAX_ACCUMULATION_STEPS) {
        snprintf(error, error_size, "%s: total_batch_tokens %lld means %lld micro-batches per optimizer step, more than %d",
                 config_source(parser, "total_batch_tokens"), c->total_batch_tokens, steps, CONFIG_MAX_ACCUMULATION_STEPS);
        return -1;
    }
    return (int)steps;
}

// Whether the block's linear layers run FP8 GEMMs (precision fp8 and coat).
static inline int config_fp8_gemms(const TrainConfig *c) { return c->precision != PRECISION_BF16; }

// The resolved storage choices (auto follows precision).
static inline StatesChoice config_optimizer_states(const TrainConfig *c) {
    if (c->optimizer_states != STATES_AUTO) return (StatesChoice)c->optimizer_states;
    return c->precision == PRECISION_COAT ? STATES_FP8_DRE : STATES_FP32;
}
static inline ActivationsChoice config_activations(const TrainConfig *c) {
    if (c->activations != ACTS_AUTO) return (ActivationsChoice)c->activations;
    return c->precision == PRECISION_BF16 ? ACTS_BF16 : c->precision == PRECISION_FP8 ? ACTS_FP8 : ACTS_COAT;
}

static inline ParamGatherChoice config_param_gather(const TrainConfig *c) {
    if (c->param_gather != GATHER_AUTO) return (ParamGatherChoice)c->param_gather;
    return config_fp8_gemms(c) ? GATHER_E4M3 : GATHER_BF16;
}

// Whether the block's linear weights live only as E4M3 codes, cast from the FP32 master weights
// (coat/zero.cuh): FP8 GEMMs with param_gather e4m3 (auto), at any stage and world size; bf16
// keeps their BF16 copy, which it gathers.
static inline int config_weights_from_master(const TrainConfig *c) {
    return config_fp8_gemms(c) && config_param_gather(c) == GATHER_E4M3;
}

static inline void config_print_help(FILE *out) {
    fprintf(out, "usage: train_llama CONFIG [--key=value ...]\n"
                 "       train_llama --help\n\n"
                 "CONFIG holds `key = value` lines, `#` comments and `include = other.conf`.\n"
                 "Command-line --key=value arguments override the files. Keys, defaults and meaning:\n\n");
    for (size_t i = 0; i < CONFIG_KEY_COUNT; i++) {
        const ConfigKey *k = &config_keys[i];
        char value[64];
        snprintf(value, sizeof(value), "%s", k->default_value[0] ? k->default_value : "\"\"");
        fprintf(out, "  %-26s %-10s %s", k->name, value, k->help);
        if (k->type == KEY_CHOICE) fprintf(out, " [%s]", k->choices);
        fprintf(out, "\n");
    }
}
