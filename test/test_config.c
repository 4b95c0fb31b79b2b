// Config files, overrides and their errors; the parameter table; the memory plan's arithmetic.
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "../coat/config.h"
#include "../coat/memory_plan.h"
#include "../coat/params.h"
#include "../coat/schedule.h"
#include "check.h"

static char temp_dir[] = "/tmp/test_config_XXXXXX";

static const char *write_file(const char *name, const char *text) {
    static char path[8][PATH_MAX];
    static int next;
    char *p = path[next++ % 8];
    snprintf(p, PATH_MAX, "%s/%s", temp_dir, name);
    FILE *f = fopen(p, "w");
    if (!f) { perror(p); exit(1); }
    fputs(text, f);
    fclose(f);
    return p;
}

// Loads `path` into a fresh parser; returns the status and leaves the message in `error`.
static int load(ConfigParser *parser, const char *path, char *error) {
    config_defaults(parser);
    error[0] = '\0';
    int status = config_load_file(parser, path, error, CONFIG_ERROR_MAX);
    return status == 0 ? config_validate(parser, error, CONFIG_ERROR_MAX) : status;
}

static void test_parsing(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    write_file("shape.conf", "# a shape\ndim = 256   # trailing comment\nn_heads = 4\nn_kv_heads = 2\n\n");
    const char *run = write_file("run.conf", "include = shape.conf\nprecision = coat\nlearning_rate = 3e-4\n"
                                             "total_batch_tokens = 1e6\ntrain_data = data/train_*.bin\n");
    check(load(p, run, error) == 0, "a run file with an include loads (%s)", error);
    check(p->values.model.dim == 256 && p->values.model.n_heads == 4, "the included shape is applied");
    check(p->values.precision == PRECISION_COAT, "a choice key is parsed");
    check(fabsf(p->values.learning_rate - 3e-4f) < 1e-9f, "a float key is parsed");
    check(p->values.total_batch_tokens == 1000000, "an integer written as 1e6 is accepted");
    check(strcmp(p->values.train_data, "data/train_*.bin") == 0, "a string key keeps its value");
    check(p->values.model.vocab_size == 32000, "an unset key keeps its default");
    check(strstr(config_source(p, "dim"), "shape.conf:2") != NULL, "the source of a key is file:line (%s)", config_source(p, "dim"));
    check(config_parse_argument(p, "--dim=512", error, sizeof(error)) == 0 && p->values.model.dim == 512,
          "--key=value overrides the file");
    check(config_optimizer_states(&p->values) == STATES_FP8_DRE && config_activations(&p->values) == ACTS_COAT,
          "auto storage follows precision coat");
    check(p->values.seq_len == p->values.model.max_seq_len, "seq_len 0 means max_seq_len");
}

static void test_errors(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    const char *unknown = write_file("unknown.conf", "dim = 64\nlearning_rat = 1e-3\n");
    check(load(p, unknown, error) != 0 && strstr(error, "unknown.conf:2: unknown key 'learning_rat'"),
          "an unknown key names file:line (%s)", error);
    const char *bad = write_file("bad.conf", "n_layers = twelve\n");
    check(load(p, bad, error) != 0 && strstr(error, "bad.conf:1: n_layers: 'twelve' is not an integer"),
          "a bad value names file:line (%s)", error);
    const char *range = write_file("range.conf", "zero_stage = 4\n");
    check(load(p, range, error) != 0 && strstr(error, "range.conf:1: zero_stage: 4 is outside"),
          "a value out of range is refused (%s)", error);
    const char *choice = write_file("choice.conf", "precision = fp16\n");
    check(load(p, choice, error) != 0 && strstr(error, "'fp16' is not one of bf16|fp8|coat"),
          "an unknown choice lists the choices (%s)", error);
    const char *missing = write_file("missing.conf", "include = nowhere.conf\n");
    check(load(p, missing, error) != 0 && strstr(error, "missing.conf:1:") && strstr(error, "nowhere.conf: cannot open config"),
          "a missing include names the including line and the file (%s)", error);
    check(load(p, "/nonexistent/x.conf", error) != 0 && strstr(error, "/nonexistent/x.conf: cannot open config"),
          "a missing config file is named (%s)", error);
    write_file("a.conf", "include = b.conf\n");
    const char *cycle = write_file("b.conf", "include = a.conf\n");
    check(load(p, cycle, error) != 0 && strstr(error, "include cycle"), "an include cycle is refused (%s)", error);
    const char *syntax = write_file("syntax.conf", "dim 64\n");
    check(load(p, syntax, error) != 0 && strstr(error, "syntax.conf:1: expected 'key = value'"),
          "a line without '=' is refused (%s)", error);
    const char *heads = write_file("heads.conf", "dim = 256\nn_heads = 4\nn_kv_heads = 3\n");
    check(load(p, heads, error) != 0 && strstr(error, "heads.conf:3: n_heads 4 is not a multiple of n_kv_heads 3"),
          "a shape that does not divide names the offending line (%s)", error);
    const char *head_dim = write_file("head_dim.conf", "dim = 256\nn_heads = 8\nn_kv_heads = 2\n");
    check(load(p, head_dim, error) != 0 && strstr(error, "head_dim.conf:2: head_dim = dim / n_heads = 32"),
          "a head_dim the attention kernels do not support is refused (%s)", error);
    config_defaults(p);
    check(config_parse_argument(p, "--dim", error, sizeof(error)) != 0 && strstr(error, "expected --key=value"),
          "an argument without '=' is refused (%s)", error);
    // Micro-batches per optimizer step: 2^20 is the most (16 tokens each), one more is refused.
    const char *many = write_file("many.conf", "micro_batch_size = 1\nseq_len = 16\nmax_seq_len = 16\ntotal_batch_tokens = 16777216\n");
    check(load(p, many, error) == 0 && config_grad_accum_steps(p, 1, error, sizeof(error)) == 1 << 20,
          "2^20 micro-batches per step are accepted (%s)", error);
    const char *too_many = write_file("too_many.conf", "micro_batch_size = 1\nseq_len = 16\nmax_seq_len = 16\ntotal_batch_tokens = 16777232\n");
    check(load(p, too_many, error) == 0 && config_grad_accum_steps(p, 1, error, sizeof(error)) < 0 &&
              strstr(error, "too_many.conf:4: total_batch_tokens 16777232 means 1048577 micro-batches per optimizer step"),
          "2^20 + 1 micro-batches per step are refused, not wrapped (%s)", error);
    const char *huge = write_file("huge.conf", "micro_batch_size = 1\nseq_len = 16\nmax_seq_len = 16\ntotal_batch_tokens = 1e15\n");
    check(load(p, huge, error) == 0 && config_grad_accum_steps(p, 1, error, sizeof(error)) < 0,
          "total_batch_tokens 1e15 is refused (%s)", error);
    const char *batch = write_file("batch.conf", "micro_batch_size = 3\nseq_len = 100\nmax_seq_len = 100\ntotal_batch_tokens = 1000\n");
    check(load(p, batch, error) == 0 && config_grad_accum_steps(p, 1, error, sizeof(error)) < 0 &&
          strstr(error, "batch.conf:4: total_batch_tokens 1000 is not a multiple"), "a batch that does not divide is refused (%s)", error);
}

// Every numeric key takes its range's bounds (inclusive) and refuses the next value past them.
static void test_key_bounds(void) {
    int bounds_taken = 1, past_refused = 1;
    char first_failure[256] = "";
    for (size_t i = 0; i < CONFIG_KEY_COUNT; i++) {
        const ConfigKey *key = &config_keys[i];
        if (key->type != KEY_INT && key->type != KEY_INT64 && key->type != KEY_FLOAT) continue;
        double ends[2] = {key->min, key->max};
        for (int e = 0; e < 2; e++) {
            if (key->type != KEY_FLOAT && fabs(ends[e]) >= 9007199254740992.0) continue;  // past 2^53: no integer neighbour
            char text[64], error[CONFIG_ERROR_MAX];
            TrainConfig values;
            memset(&values, 0, sizeof(values));
            double past = key->type == KEY_FLOAT ? (e ? ends[e] * (1 + 1e-6) + 1e-30 : ends[e] - fabs(ends[e]) * 1e-6 - 1e-30)
                                                 : ends[e] + (e ? 1 : -1);
            snprintf(text, sizeof(text), key->type == KEY_FLOAT ? "%.17g" : "%.0f", ends[e]);
            if (config_set_value(&values, key, text, error, sizeof(error)) != 0) {
                if (bounds_taken) snprintf(first_failure, sizeof(first_failure), "%s = %s refused: %s", key->name, text, error);
                bounds_taken = 0;
            }
            snprintf(text, sizeof(text), key->type == KEY_FLOAT ? "%.17g" : "%.0f", past);
            if (config_set_value(&values, key, text, error, sizeof(error)) == 0) {
                if (past_refused) snprintf(first_failure, sizeof(first_failure), "%s = %s accepted", key->name, text);
                past_refused = 0;
            }
        }
    }
    check(bounds_taken, "every numeric key takes the bounds of its range %s", first_failure);
    check(past_refused, "every numeric key refuses the value just past its range %s", first_failure);
}

// Edges of the parser that a flipped comparison would break: values that are empty, as long as a
// string may be, 64-bit, on the last line without a newline; choices by index; ranges whose ends
// meet (warmup = max_steps, RoPE high = low frequency factor).
static void test_parser_edges(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    check(load(p, write_file("empty_value.conf", "n_layers =\n"), error) != 0 && strstr(error, "'' is not an integer"),
          "an empty integer value is refused (%s)", error);
    check(load(p, write_file("last_line.conf", "learning_rate = 2e-3"), error) == 0 && fabsf(p->values.learning_rate - 2e-3f) < 1e-9f,
          "the last line is read without a newline after it (%s)", error);
    check(load(p, write_file("big_seed.conf", "seed = 4611686018427387905\n"), error) == 0 &&
              p->values.seed == 4611686018427387905ll,
          "a 64-bit key keeps all 64 bits (%lld)", (long long)p->values.seed);
    char longest[CONFIG_STRING_MAX + 64];
    config_defaults(p);
    snprintf(longest, sizeof(longest), "--out_dir=%0*d", CONFIG_STRING_MAX - 1, 0);
    check(config_parse_argument(p, longest, error, sizeof(error)) == 0 && strlen(p->values.out_dir) == CONFIG_STRING_MAX - 1,
          "a string of %d characters is taken", CONFIG_STRING_MAX - 1);
    snprintf(longest, sizeof(longest), "--out_dir=%0*d", CONFIG_STRING_MAX, 0);
    check(config_parse_argument(p, longest, error, sizeof(error)) != 0 && strstr(error, "value longer than"),
          "a string of %d characters is refused (%s)", CONFIG_STRING_MAX, error);
    char name[32];
    check(strcmp(config_choice_name("bf16|fp8|coat", 0, name, sizeof(name)), "bf16") == 0 &&
              strcmp(config_choice_name("bf16|fp8|coat", 2, name, sizeof(name)), "coat") == 0,
          "choices are named by index (2: %s)", config_choice_name("bf16|fp8|coat", 2, name, sizeof(name)));
    check(load(p, write_file("warmup.conf", "max_steps = 50\nwarmup_steps = 50\n"), error) == 0,
          "warmup_steps equal to max_steps is taken (%s)", error);
    check(load(p, write_file("warmup_past.conf", "max_steps = 50\nwarmup_steps = 51\n"), error) != 0,
          "warmup_steps past max_steps is refused");
    check(load(p, write_file("rope_equal.conf", "rope_scaling_factor = 8\nrope_low_freq_factor = 2\nrope_high_freq_factor = 2\n"), error) != 0,
          "RoPE scaling with high = low frequency factor is refused");
    check(load(p, write_file("rope_off.conf", "rope_scaling_factor = 0\nrope_low_freq_factor = 2\nrope_high_freq_factor = 2\n"), error) == 0,
          "without RoPE scaling the frequency factors are not checked (%s)", error);
}

// Limits that the table-driven bound test cannot reach: the float-notation end of the 64-bit
// range, the exact message of a string too long, a diamond of includes (no cycle), the last
// line of one character, a directory as a config file, an argument too long for the parser's
// buffer (refused, never cut), RoPE scaling from the smallest factor, and total_batch_tokens 0.
static void test_parser_limits(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    check(load(p, write_file("seed_max.conf", "seed = 9.2e18\n"), error) == 0 && p->values.seed == 9200000000000000000ull,
          "seed = 9.2e18, the end of its range in float notation, is taken (%s)", error);
    check(load(p, write_file("seed_past.conf", "seed = 9.3e18\n"), error) != 0 && strstr(error, "'9.3e18' is not an integer"),
          "seed = 9.3e18 is refused (%s)", error);
    char longest[CONFIG_STRING_MAX + 64];
    config_defaults(p);
    snprintf(longest, sizeof(longest), "--out_dir=%0*d", CONFIG_STRING_MAX, 0);
    char limit[64];
    snprintf(limit, sizeof(limit), "out_dir: value longer than %d characters", CONFIG_STRING_MAX - 1);
    check(config_parse_argument(p, longest, error, sizeof(error)) != 0 && strstr(error, limit),
          "a string of %d characters is refused naming the limit (%s)", CONFIG_STRING_MAX, error);

    // top includes left and right, which both include base: base is read twice, no cycle.
    write_file("diamond_base.conf", "dim = 256\n");
    write_file("diamond_left.conf", "include = diamond_base.conf\nn_heads = 4\n");
    write_file("diamond_right.conf", "include = diamond_base.conf\nn_kv_heads = 2\n");
    const char *top = write_file("diamond_top.conf", "include = diamond_left.conf\ninclude = diamond_right.conf\n");
    check(load(p, top, error) == 0 && p->values.model.dim == 256 && p->values.model.n_kv_heads == 2,
          "two includes of one file (a diamond) are no cycle (%s)", error);
    write_file("twice_base.conf", "learning_rate = 1e-3\n");
    const char *twice = write_file("twice_include.conf", "include = twice_base.conf\ninclude = twice_base.conf\n");
    check(load(p, twice, error) == 0, "one file included twice in a row is no cycle (%s)", error);

    check(load(p, write_file("last_char.conf", "learning_rate = 1e-3\nx"), error) != 0 &&
              strstr(error, "last_char.conf:2: expected 'key = value', got 'x'"),
          "a last line of one character without a newline is read (%s)", error);
    check(load(p, temp_dir, error) != 0 && strstr(error, "is a directory, not a config file"),
          "a directory as a config file is named a directory (%s)", error);
    check(load(p, write_file("empty_include.conf", "include =\n"), error) != 0 &&
              strstr(error, "empty_include.conf:1: include names no file"),
          "an empty include names the line and what is missing, not a read error (%s)", error);
    check(load(p, write_file("bom.conf", "\xEF\xBB\xBFlearning_rate = 2e-3\n"), error) == 0 &&
              fabsf(p->values.learning_rate - 2e-3f) < 1e-9f,
          "a UTF-8 byte order mark before the first key is accepted (%s)", error);
    check(load(p, write_file("bom_only.conf", "\xEF\xBB\xBF"), error) == 0, "a file holding only a byte order mark is empty (%s)",
          error);
    check(load(p, write_file("not_bom.conf", "\xEF\xBBlearning_rate = 2e-3\n"), error) != 0 && strstr(error, "not_bom.conf:1"),
          "two bytes of a byte order mark are no mark: refused at line 1 (%s)", error);
    char fifo[PATH_MAX];
    snprintf(fifo, sizeof(fifo), "%s/fifo.conf", temp_dir);
    check(mkfifo(fifo, 0600) == 0 && load(p, fifo, error) != 0 && strstr(error, "fifo.conf: is no regular file, not a config file"),
          "a FIFO as a config file is refused before it is opened, which would block (%s)", error);

    // --max_steps=000...012 of every length up to past the parser's buffer: read whole as 12 or
    // refused as too long, never cut to 1.
    char argument[2 * CONFIG_STRING_MAX];
    int whole = 0, refused = 0, cut = 0;
    for (size_t length = CONFIG_STRING_MAX; length < sizeof(argument) - 1; length++) {
        snprintf(argument, sizeof(argument), "--max_steps=%0*d", (int)(length - strlen("--max_steps=")), 12);
        config_defaults(p);
        int status = config_parse_argument(p, argument, error, sizeof(error));
        if (status == 0 && p->values.max_steps == 12) whole++;
        else if (status != 0 && strstr(error, "expected --key=value")) refused++;
        else cut++;
    }
    check(whole > 0 && refused > 0 && cut == 0,
          "arguments of %d to %zu characters are read whole (%d) or refused (%d), none cut (%d)", CONFIG_STRING_MAX,
          sizeof(argument) - 2, whole, refused, cut);

    check(load(p, write_file("rope_one.conf", "rope_scaling_factor = 1\nrope_low_freq_factor = 2\nrope_high_freq_factor = 2\n"), error) != 0 &&
              strstr(error, "rope_high_freq_factor must exceed rope_low_freq_factor"),
          "RoPE scaling factor 1 checks the frequency factors too (%s)", error);
    check(load(p, write_file("one_micro.conf", "total_batch_tokens = 0\n"), error) == 0 &&
              config_grad_accum_steps(p, 4, error, sizeof(error)) == 1,
          "total_batch_tokens 0 means one micro-batch per rank: 1 accumulation step (%s)", error);
}

// Optimizer states per setting, exactly: m and v, their scalars per 128-group, the decay table
// (what the memory plan counts beside the FP32 master weights).
static size_t states_beside_master(StatesChoice states, size_t n) {
    return adamw_state_bytes(adamw_kind_from_config(states), n) - 4 * n;
}

static void test_state_bytes(void) {
    size_t n = 128 * 1000, groups = n / 128;
    const struct { StatesChoice states; size_t bytes; const char *name; } cases[] = {
        {STATES_FP32, 8 * n + groups, "fp32"}, {STATES_BF16, 4 * n + groups, "bf16"},
        {STATES_FP8, 2 * n + 2 * 4 * groups + groups, "fp8"}, {STATES_FP8_DRE, 2 * n + 2 * 12 * groups + groups, "fp8_dre"}};
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++)
        check(states_beside_master(cases[i].states, n) == cases[i].bytes, "%s states of %zu elements: %zu bytes (got %zu)",
              cases[i].name, n, cases[i].bytes, states_beside_master(cases[i].states, n));
}

// Input that is almost certainly a mistake, and the parser's limits at their bounds.
static void test_suspicious_input(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    const char *nul = write_file("nul.conf", "dim = 256\n");
    FILE *f = fopen(nul, "ab");
    fputs("n_heads = 4", f);
    fputc('\0', f);
    fputs("junk\n", f);
    fclose(f);
    check(load(p, nul, error) != 0 && strstr(error, "nul.conf:2: a NUL byte: not a text config file"),
          "a NUL byte is named as such, not as a long line (%s)", error);
    const char *twice = write_file("twice.conf", "learning_rate = 1e-3\ndim = 256\nlearning_rate = 3e-4\n");
    check(load(p, twice, error) != 0 && strstr(error, "twice.conf:3: learning_rate is set twice in this file (first at line 1)"),
          "a key set twice in one file is refused (%s)", error);
    write_file("base.conf", "learning_rate = 1e-3\n");
    const char *over = write_file("over.conf", "include = base.conf\nlearning_rate = 3e-4\n");
    check(load(p, over, error) == 0 && fabsf(p->values.learning_rate - 3e-4f) < 1e-9f,
          "a file may override a key its include set (%s)", error);
    const char *glued = write_file("glued.conf", "out_dir = runs/a#2\n");
    check(load(p, glued, error) != 0 && strstr(error, "glued.conf:1: '#' inside a value"),
          "a '#' glued to a value is refused rather than cutting it (%s)", error);
    const char *second = write_file("second.conf", "x#y = 1\n");
    check(load(p, second, error) != 0 && strstr(error, "second.conf:1: '#' inside a value"),
          "a '#' glued to the first character is refused too (%s)", error);
    const char *spaced = write_file("spaced.conf", "out_dir = runs/a #2\n#whole line\n");
    check(load(p, spaced, error) == 0 && strcmp(p->values.out_dir, "runs/a") == 0,
          "a comment after a blank and a comment line are comments (%s)", error);
    const char *dim_only = write_file("dim_only.conf", "learning_rate = 1e-3\ndim = 200\n");
    check(load(p, dim_only, error) != 0 && strstr(error, "dim_only.conf:2: dim 200 is not a multiple of n_heads 12 (default)"),
          "a check of two keys names the line that set one, not 'default' (%s)", error);
    char long_line[4200];
    memset(long_line, ' ', sizeof(long_line));
    memcpy(long_line, "learning_rate = 1e-3", 20);
    long_line[4095] = '\n';
    long_line[4096] = '\0';
    check(load(p, write_file("long_ok.conf", long_line), error) == 0, "a line of 4095 characters is read (%s)", error);
    long_line[4095] = ' ';
    long_line[4096] = '\n';
    long_line[4097] = '\0';
    check(load(p, write_file("long.conf", long_line), error) != 0 && strstr(error, "long.conf:1: line longer than 4095"),
          "a line of 4096 characters is refused (%s)", error);
    // Includes nested CONFIG_INCLUDE_DEPTH_MAX deep are read; one more is refused.
    char name[32], text[64];
    for (int depth = CONFIG_INCLUDE_DEPTH_MAX + 1; depth >= 1; depth--) {
        snprintf(name, sizeof(name), "depth%d.conf", depth);
        if (depth == CONFIG_INCLUDE_DEPTH_MAX + 1) snprintf(text, sizeof(text), "learning_rate = 1e-3\n");
        else snprintf(text, sizeof(text), "include = depth%d.conf\n", depth + 1);
        write_file(name, text);
    }
    char path[PATH_MAX];
    snprintf(path, sizeof(path), "%s/depth2.conf", temp_dir);
    check(load(p, path, error) == 0, "includes nested %d files deep are read (%s)", CONFIG_INCLUDE_DEPTH_MAX, error);
    snprintf(path, sizeof(path), "%s/depth1.conf", temp_dir);
    check(load(p, path, error) != 0 && strstr(error, "includes nested deeper than"),
          "includes nested %d files deep are refused (%s)", CONFIG_INCLUDE_DEPTH_MAX + 1, error);
}

static void test_params(ConfigParser *p) {
    struct { const char *file; double params; } shapes[] = {
        {"configs/models/llama-125m.conf", 125e6}, {"configs/models/llama-1b.conf", 853e6},
        {"configs/models/llama2-7b.conf", 6.74e9}, {"configs/models/llama3-8b.conf", 8.03e9}};
    char error[CONFIG_ERROR_MAX];
    for (int i = 0; i < 4; i++) {
        ParamLayout layout;
        int ok = load(p, shapes[i].file, error) == 0;
        param_layout_init(&layout, &p->values.model);
        double rel = fabs((double)layout.total_params - shapes[i].params) / shapes[i].params;
        check(ok && rel < 0.01, "%s has %.4gB parameters (expected %.4gB) %s", shapes[i].file,
              layout.total_params / 1e9, shapes[i].params / 1e9, error);
    }
    ModelShape tiny = {37, 20, 3, 4, 2, 24, 16, 10000.0f, 1e-5f, 0, 1, 4, 8192};
    ParamLayout layout;
    param_layout_init(&layout, &tiny);
    int aligned = 1, disjoint = 1;
    size_t end_prev = 0;
    for (int l = -1; l <= tiny.n_layers; l++) {
        for (int k = 0; k < PARAM_KINDS; k++) {
            int per_layer = param_kind_is_per_layer((ParamKind)k);
            if ((l == -1 && k != PARAM_EMBEDDING) || (l == tiny.n_layers && (k != PARAM_FINAL_NORM && k != PARAM_LM_HEAD)) ||
                (l >= 0 && l < tiny.n_layers && !per_layer))
                continue;
            size_t off = param_offset(&layout, (ParamKind)k, l < 0 ? 0 : l);
            aligned &= off % PARAM_ALIGN_ELEMS == 0;
            disjoint &= off >= end_prev;
            end_prev = off + param_numel(&layout, (ParamKind)k);
        }
    }
    check(aligned, "every tensor starts on a 128-element boundary");
    check(disjoint && end_prev <= layout.total_padded, "tensors are in buffer order and do not overlap");
    float *a = (float *)malloc(layout.total_padded * sizeof(float)), *b = (float *)malloc(layout.total_padded * sizeof(float));
    param_init_weights(&layout, a, 7);
    param_init_weights(&layout, b, 7);
    check(memcmp(a, b, layout.total_padded * sizeof(float)) == 0, "initialisation depends only on the seed");
    // The counter-based normal: moments of a standard normal (Irwin-Hall 12: kurtosis 2.9), within
    // +-6, no correlation between neighbours, another seed another stream.
    enum { SAMPLES = 1000000 };
    double moments[3] = {0, 0, 0}, neighbours = 0, seeds = 0, largest = 0;
    for (uint64_t i = 0; i < SAMPLES; i++) {
        double z = random_normal_at(7, i), next = random_normal_at(7, i + 1), other = random_normal_at(8, i);
        moments[0] += z; moments[1] += z * z; moments[2] += z * z * z * z; neighbours += z * next; seeds += z * other;
        if (fabs(z) > largest) largest = fabs(z);
    }
    double mean = moments[0] / SAMPLES, variance = moments[1] / SAMPLES - mean * mean;
    double kurtosis = moments[2] / SAMPLES / (variance * variance);
    check(fabs(mean) < 0.005 && fabs(variance - 1.0) < 0.01 && fabs(kurtosis - 2.9) < 0.03 && largest <= 6.0,
          "random_normal_at: mean %.4f, variance %.4f, kurtosis %.3f, max |z| %.2f", mean, variance, kurtosis, largest);
    check(fabs(neighbours / SAMPLES) < 0.005 && fabs(seeds / SAMPLES) < 0.005,
          "random_normal_at: correlation %.4f with the next index, %.4f with another seed", neighbours / SAMPLES, seeds / SAMPLES);
    double sum2 = 0;
    const float *wq = a + param_offset(&layout, PARAM_WQ, 1);
    for (size_t i = 0; i < param_numel(&layout, PARAM_WQ); i++) sum2 += (double)wq[i] * wq[i];
    double std = sqrt(sum2 / param_numel(&layout, PARAM_WQ));
    check(std > 0.014 && std < 0.026, "matrices are drawn with std 0.02 (got %.4f)", std);
    check(a[param_offset(&layout, PARAM_ATTN_NORM, 2)] == 1.0f && a[param_offset(&layout, PARAM_FINAL_NORM, 0)] == 1.0f,
          "norm weights start at 1");
    free(a);
    free(b);
}

static void test_memory_plan(ConfigParser *p) {
    char error[CONFIG_ERROR_MAX];
    load(p, "configs/models/llama-1b.conf", error);
    MemoryPlan plan;
    p->values.zero_stage = 0;
    memory_plan_compute(&plan, &p->values, 1, 1);
    double per_param = (double)(plan.params_bytes + plan.grads_bytes + plan.master_bytes + plan.states_bytes) / plan.params_padded;
    check(fabs(per_param - (16.0 + 1.0 / 128)) < 1e-9,
          "mixed-precision AdamW costs 16 bytes/param and its 1/128-byte decay table (got %.6f)", per_param);
    // (the plan of each ZeRO stage: test_zero)
    p->values.optimizer_states = STATES_FP8_DRE;
    memory_plan_compute(&plan, &p->values, 1, 1);
    check(fabs((double)plan.states_bytes / plan.params_padded - (2.1875 + 1.0 / 128)) < 1e-9,
          "FP8 DRE states cost 2 + 24/128 bytes/param and the 1/128-byte decay table (got %.6f)",
          (double)plan.states_bytes / plan.params_padded);
    MemoryPlan bf16, coat;
    p->values.precision = PRECISION_BF16; p->values.optimizer_states = STATES_AUTO;
    memory_plan_compute(&bf16, &p->values, 1, 16);
    p->values.precision = PRECISION_COAT;
    memory_plan_compute(&coat, &p->values, 1, 16);
    check(coat.activations_bytes < bf16.activations_bytes && coat.total_bytes < bf16.total_bytes,
          "coat plans less memory than bf16 (%.1f vs %.1f GiB)", gib(coat.total_bytes), gib(bf16.total_bytes));
    // The ablations keep COAT's 1x16 copies of one kind of non-linear input only, and the BF16
    // residual working buffer exactly when the residual stream is kept as copies.
    const ModelShape *m = &p->values.model;
    const struct { const char *name; ActivationsChoice mode; ActivationStorage residual, gate_up; int working_residual; } ablations[] = {
        {"coat", ACTS_COAT, STORE_E4M3_GROUP16, STORE_E4M3_GROUP16, 1},
        {"coat_residual", ACTS_COAT_RESIDUAL, STORE_E4M3_GROUP16, STORE_BF16, 1},
        {"coat_gate_up", ACTS_COAT_GATE_UP, STORE_BF16, STORE_E4M3_GROUP16, 0},
    };
    for (size_t i = 0; i < sizeof(ablations) / sizeof(ablations[0]); i++) {
        ActivationInfo table[ACT_LAYER_KINDS];
        activation_table(table, m, ablations[i].mode);
        WorkingLayout w;
        working_layout_init(&w, m, 16, 2048, 1, ablations[i].mode, 0);
        check(table[ACT_RESIDUAL_IN].storage == ablations[i].residual && table[ACT_RESIDUAL_MID].storage == ablations[i].residual &&
              table[ACT_GATE_UP].storage == ablations[i].gate_up && table[ACT_SWIGLU_OUT].storage == STORE_E4M3_TENSOR &&
              (w.residual_bytes > 0) == ablations[i].working_residual,
              "activations = %s: residual stream %s, gate_up %s, linear inputs e4m3/tensor, residual working buffer %zu bytes",
              ablations[i].name, activation_storage_name(table[ACT_RESIDUAL_IN].storage),
              activation_storage_name(table[ACT_GATE_UP].storage), w.residual_bytes);
    }
    MemoryPlan b8, b16;
    memory_plan_compute(&b8, &p->values, 1, 8);
    memory_plan_compute(&b16, &p->values, 1, 16);
    double growth = (double)b16.activations_bytes / (double)b8.activations_bytes;
    check(fabs(growth - 2.0) < 1e-4, "saved activations grow linearly with the micro-batch (x%.6f; alignment aside)", growth);
    int largest = memory_plan_largest_micro_batch(&p->values, 1, b16.total_bytes);
    check(largest == 16, "the largest micro-batch within a 16-sequence budget is 16 (got %d)", largest);
    // The attention backward's optional dS buffer: head_dim 128 only, 528 tiles of 64 x 64 BF16 per
    // sequence and query head at T = 2048, not in the total (the largest micro-batch ignores it).
    check(b16.attention_ds_bytes == 0, "llama-1b (head_dim 64) plans no dS buffer (got %zu bytes)", b16.attention_ds_bytes);
    load(p, "configs/models/llama2-7b.conf", error);
    p->values.seq_len = 2048;
    memory_plan_compute(&b8, &p->values, 1, 8);
    check(b8.attention_ds_bytes == (size_t)8 * 32 * 528 * 8192,
          "llama2-7b at 8 x 2048 plans a dS buffer of 8 x 32 heads x 528 tiles x 8 KiB (got %zu bytes)",
          b8.attention_ds_bytes);
    // And, with FP8 GEMMs, the E4M3 W^T of 31 of its 32 layers (the working buffers hold one layer's);
    // the optional buffers are taken dS first, each only where it fits beside what is taken.
    check(b8.weight_transposes_bytes == 0, "llama2-7b in bf16 plans no weight transposes (got %zu bytes)",
          b8.weight_transposes_bytes);
    p->values.precision = PRECISION_COAT;
    memory_plan_compute(&b8, &p->values, 1, 8);
    size_t layer = (size_t)4096 * (3 * 4096 + 4096 + 2 * 11008 + 11008);
    check(b8.weight_transposes_bytes == 31 * layer,
          "llama2-7b in coat plans the W^T of 31 layers of %zu bytes each (got %zu bytes)", layer,
          b8.weight_transposes_bytes);
    // The attention output's E4M3 transposes: 32 layers x 8 x 2048 tokens x 4096 bytes, taken after dS.
    check(b8.attention_out_t_bytes == (size_t)32 * 8 * 2048 * 4096,
          "llama2-7b in coat plans the attention output's transposes, 32 layers of 8 x 2048 x 4096 codes (got %zu bytes)",
          b8.attention_out_t_bytes);
    size_t ds = b8.attention_ds_bytes, out_t = b8.attention_out_t_bytes, w_t = b8.weight_transposes_bytes;
    const struct { size_t extra; int ds, out_t, w_t; } budgets[] = {
        {0, 0, 0, 0},
        {ds, 1, 0, 0},
        {w_t, 1, 1, 0},  // dS first, then the attention output's: what is left no longer holds the W^T
        {ds + out_t - 1, 1, 0, 0},
        {ds + out_t, 1, 1, 0},
        {ds + out_t + w_t - 1, 1, 1, 0},
        {ds + out_t + w_t, 1, 1, 1},
    };
    for (size_t i = 0; i < sizeof budgets / sizeof budgets[0]; i++) {
        OptionalBuffers o = memory_plan_optional(&b8, b8.total_bytes + budgets[i].extra);
        size_t expected = (budgets[i].ds ? ds : 0) + (budgets[i].out_t ? out_t : 0) + (budgets[i].w_t ? w_t : 0);
        check(o.attention_ds == budgets[i].ds && o.attention_out_t == budgets[i].out_t &&
                  o.weight_transposes == budgets[i].w_t && memory_plan_optional_bytes(&b8, o) == expected,
              "llama2-7b coat with %zu bytes beside the plan takes the dS buffer %d (expected %d), the attention "
              "output's transposes %d (expected %d), the weight transposes %d (expected %d)", budgets[i].extra,
              o.attention_ds, budgets[i].ds, o.attention_out_t, budgets[i].out_t, o.weight_transposes, budgets[i].w_t);
    }
}

static void test_schedule(ConfigParser *p) {
    TrainConfig *c = &p->values;
    config_defaults(p);
    c->learning_rate = 1.0f; c->min_lr_ratio = 0.1f; c->warmup_steps = 10; c->max_steps = 110;
    check(fabsf(learning_rate_at(c, 0) - 0.1f) < 1e-6f && fabsf(learning_rate_at(c, 9) - 1.0f) < 1e-6f,
          "warmup rises linearly to the peak");
    c->lr_schedule = SCHEDULE_COSINE;
    check(fabsf(learning_rate_at(c, 10) - 1.0f) < 1e-6f && fabsf(learning_rate_at(c, 109) - 0.1f) < 1e-6f &&
          fabsf(learning_rate_at(c, 60) - 0.55f) < 0.01f, "cosine goes from the peak to min_lr_ratio");
    c->lr_schedule = SCHEDULE_LINEAR;
    check(fabsf(learning_rate_at(c, 109) - 0.1f) < 1e-6f && learning_rate_at(c, 50) > learning_rate_at(c, 51),
          "linear decays to min_lr_ratio");
    c->lr_schedule = SCHEDULE_WSD; c->wsd_decay_fraction = 0.2f;
    check(learning_rate_at(c, 80) == 1.0f && learning_rate_at(c, 100) < 1.0f && fabsf(learning_rate_at(c, 109) - 0.1f) < 1e-6f,
          "wsd holds the peak, then decays in the last 20%% of the steps");
    c->lr_schedule = SCHEDULE_CONSTANT;
    check(learning_rate_at(c, 109) == 1.0f, "constant stays at the peak after warmup");
}

int main(void) {
    if (!mkdtemp(temp_dir)) { perror("mkdtemp"); return 1; }
    ConfigParser *parser = (ConfigParser *)malloc(sizeof(ConfigParser));
    test_parsing(parser);
    test_errors(parser);
    test_params(parser);
    test_memory_plan(parser);
    test_suspicious_input(parser);
    test_key_bounds();
    test_parser_edges(parser);
    test_parser_limits(parser);
    test_state_bytes();
    test_schedule(parser);
    free(parser);
    char command[PATH_MAX + 16];
    snprintf(command, sizeof(command), "rm -rf %s", temp_dir);
    if (system(command) != 0) fprintf(stderr, "could not remove %s\n", temp_dir);
    return check_summary("test_config");
}
