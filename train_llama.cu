// train_llama: pretrains a Llama 2/3 model from scratch in BF16, TransformerEngine-like FP8
// or COAT (FP8 GEMMs, FP8 activations, FP8 optimizer states). One process per GPU.
//   ./train_llama CONFIG [--key=value ...]      (./train_llama --help lists the keys)
#include "dataloader/dataloader.h"  // first: it selects the POSIX interfaces
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "coat/comm.h"
#include "coat/agree.h"
#include "coat/checkpoint_file.h"
#include "coat/checkpoint_parts.h"
#include "coat/checkpoint_reader.h"
#include "coat/clock.h"
#include "coat/config.h"
#include "coat/log.h"
#include "coat/memory_plan.h"
#include "coat/model.cuh"
#include "coat/optimizer.cuh"
#include "coat/params.h"
#include "coat/random.h"
#include "coat/run_dir.h"
#include "coat/schedule.h"
#include "coat/speed_of_light.h"
#include "coat/zero.cuh"
#include "dataloader/make_directories.h"
extern "C" {
#include "tokenizer/tokenizer.h"
}

#define EXIT_CONFIG_ERROR 2
// Stopped by SIGTERM, SIGINT or SIGUSR1 at a step boundary, its checkpoint written: the run is
// unfinished and resume = 1 continues it (sysexits' EX_TEMPFAIL, "try again later").
#define EXIT_PREEMPTED 75
// A rank whose collectives failed or hung past collective_timeout_s exits with
// EXIT_COLLECTIVE_FAILED (3), from coat/watchdog.h.

// The first SIGTERM, SIGINT or SIGUSR1 (what SLURM sends ahead of a job's time limit) asks the
// run to stop at the next step boundary with a checkpoint: the signal's number. A second one ends
// the process at once, as the signal's default action does. (A handler can only set a flag.)
static volatile sig_atomic_t stop_signal = 0;

static void on_stop_signal(int signum) {
    if (stop_signal != 0) {
        signal(signum, SIG_DFL);
        raise(signum);
        return;
    }
    stop_signal = signum;
}

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
    printf("saved per layer: %.2fU (U = tokens x dim x 2 bytes; bf16 %.2fU, fp8 %.2fU, coat %.2fU here; the COAT paper's "
           "Table 2: BF16 22.66U, TransformerEngine 18.33U, COAT 13.33U)\n",
           activation_layer_bytes(&c->model, config_activations(c), 1 << 16) / (double)(1 << 16) / unit,
           activation_layer_bytes(&c->model, ACTS_BF16, 1 << 16) / (double)(1 << 16) / unit,
           activation_layer_bytes(&c->model, ACTS_FP8, 1 << 16) / (double)(1 << 16) / unit,
           activation_layer_bytes(&c->model, ACTS_COAT, 1 << 16) / (double)(1 << 16) / unit);
}

// What a checkpoint adds to the weights and the optimizer to continue exactly: 8-byte fields, no
// padding (test/test_cli.sh writes them too).
typedef struct {
    long long step;               // optimizer steps done
    long long tokens_seen;
    DataloaderPosition train_position;  // in one-rank batches: a rank's steps times the ranks
    uint64_t sample_rng_state;
    // What decides the training data's order besides the shards (dataloader/dataloader.h): a
    // resume that changed it would read other rows than the run it continues.
    uint64_t data_seed;
    int64_t data_shuffle;           // DATALOADER_SHUFFLE_BATCHES or _ROWS
    int64_t data_micro_batch_size;  // B: rows per one-rank batch
    int64_t data_seq_len;           // T: a row is T + 1 tokens
} TrainerState;

typedef struct {
    ConfigParser *parser;
    const TrainConfig *c;
    const Comm *comm;             // the ranks
    Zero zero;                    // data parallelism (coat/zero.cuh): the plan, its collectives and buffers
    unsigned char *host_chunk;    // 2 x ADAMW_COPY_CHUNK_BYTES: checkpoints pass through it
    GpuContext gpu;
    LlamaModel model;
    AdamW opt;
    Dataloader train_loader, val_loader;
    int have_val, val_batches;  // batches a validation pass reads
    Tokenizer *tokenizer;
    int *host_inputs, *host_targets;  // pinned, one micro-batch
    float *host_scalar;               // pinned
    int grad_accum;
    double flops_per_token;
    int stop_requested;  // a rank received a stop signal (the same on every rank after a step)
    TrainerState state;
    Random sample_rng;
    RunLog log;
    OpTimer *timer;  // profile = 1 only
} Trainer;

static void fail(const char *message) {
    fprintf(stderr, "error: %s\n", message);
    exit(EXIT_FAILURE);
}

// An input file's error ("error: PATH: what") with the config key and line that named the file.
static void fail_input(const ConfigParser *parser, const char *key, const char *error) {
    fprintf(stderr, "%s%s (%s, set at %s)\n", strncmp(error, "error: ", 7) == 0 ? "" : "error: ", error, key,
            config_source(parser, key));
    exit(EXIT_FAILURE);
}

static void fail_config(const ConfigParser *parser, const char *key, const char *what) {
    fprintf(stderr, "error: %s: %s %s\n", config_source(parser, key), key, what);
    exit(EXIT_CONFIG_ERROR);
}

// Refuses a precision combination the model cannot run (for dry_run and training alike).
static void check_precision(const ConfigParser *parser) {
    const TrainConfig *c = &parser->values;
    if (c->fp8_fast_accum && !config_fp8_gemms(c))
        fail_config(parser, "fp8_fast_accum", "applies to FP8 GEMMs only: set precision = fp8 or coat");
    StatesChoice states = config_optimizer_states(c);
    if (c->optimizer_rounding && states != STATES_FP8 && states != STATES_FP8_DRE)
        fail_config(parser, "optimizer_rounding", "= stochastic applies to FP8 optimizer states only: set optimizer_states = fp8 or "
                    "fp8_dre (precision = coat picks fp8_dre)");
    if (c->param_gather == GATHER_E4M3 && !config_fp8_gemms(c))
        fail_config(parser, "param_gather", "= e4m3 gathers the E4M3 weights of FP8 GEMMs: set precision = fp8 or coat");
    if (c->zero_stage == 3 && config_fp8_gemms(c) && config_param_gather(c) != GATHER_E4M3)
        fail_config(parser, "param_gather", "= bf16 would hold every layer's E4M3 weights on each rank, which ZeRO stage 3 "
                    "shards: stage 3 with FP8 GEMMs gathers the E4M3 codes (param_gather = e4m3 or auto)");
    const char *reason = model_precision_unsupported(&c->model, c->micro_batch_size, c->seq_len, model_precision_from_config(c));
    if (reason != NULL) fail_config(parser, c->activations != ACTS_AUTO ? "activations" : "precision", reason);
}

// A fresh run (resume = 0) into an out_dir that holds an earlier run would prune its own first
// checkpoint in favour of the older ones, truncate their log, and a later resume would continue
// the old run: refused unless overwrite = 1, which removes them once training has checked every
// input and read its start checkpoint.
// out_dir must also be a folder this process can write, or one it can create (mkdir -p): its
// nearest existing ancestor a writable folder.
static void check_out_dir(const ConfigParser *parser) {
    const TrainConfig *c = &parser->values;
    char ancestor[4096], message[4608];
    if (c->out_dir[0] == '\0') fail_config(parser, "out_dir", "is empty: name the run's folder");
    snprintf(ancestor, sizeof(ancestor), "%s", c->out_dir);
    struct stat info;
    while (stat(ancestor, &info) != 0) {
        char *slash = strrchr(ancestor, '/');
        if (slash == NULL) snprintf(ancestor, sizeof(ancestor), ".");
        else if (slash == ancestor) ancestor[1] = '\0';
        else *slash = '\0';
    }
    int itself = strcmp(ancestor, c->out_dir) == 0;
    if (!S_ISDIR(info.st_mode) || access(ancestor, W_OK | X_OK) != 0) {
        if (itself) snprintf(message, sizeof(message), "'%s' is %s", c->out_dir, S_ISDIR(info.st_mode) ? "a folder this process cannot write" : "not a folder");
        else snprintf(message, sizeof(message), "'%s' cannot be created: '%s' is %s", c->out_dir, ancestor,
                      S_ISDIR(info.st_mode) ? "a folder this process cannot write" : "not a folder");
        fail_config(parser, "out_dir", message);
    }
    // (rank 0's check alone: the others could see its first files of this very run)
    char what[256];
    if (comm_env_rank() > 0 || c->resume || c->generate || c->overwrite || !run_dir_describe(c->out_dir, what, sizeof(what)))
        return;
    snprintf(message, sizeof(message), "'%s' holds an earlier run (%s): resume = 1 continues it, overwrite = 1 removes it "
             "and starts over", c->out_dir, what);
    fail_config(parser, "out_dir", message);
}

// Every refusal of a config that needs no file or GPU, for dry_run and training alike.
static void check_run_config(const ConfigParser *parser) {
    const TrainConfig *c = &parser->values;
    if (!c->generate && c->train_data[0] == '\0') fail_config(parser, "train_data", "is empty: name the training shards");
    if ((c->sample_every > 0 || c->generate) && c->tokenizer[0] == '\0')
        fail_config(parser, "tokenizer", "is empty: sampling needs the tokenizer");
    check_precision(parser);
    check_out_dir(parser);
}

// NCCL needs a GPU per rank. Under mpirun the ranks compare their GPUs' UUIDs, which also serves
// a launcher that gives each rank one GPU through CUDA_VISIBLE_DEVICES (every rank sees "GPU 0");
// ranks started without MPI are left to ncclCommInitRank, which refuses a shared GPU itself.
static void refuse_shared_gpu(int device, const Comm *comm, const ConfigParser *parser) {
#ifdef USE_MPI
    if (comm->launch != LAUNCH_MPI || parser->values.comm_backend != COMM_NCCL) return;
    cudaDeviceProp prop;
    cudaCheck(cudaGetDeviceProperties(&prop, device));
    unsigned char *uuids = (unsigned char *)malloc((size_t)comm->world * sizeof(prop.uuid));
    if (!uuids) fail("out of host memory for the ranks' GPU UUIDs");
    comm_all_gather(comm, &prop.uuid, uuids, sizeof(prop.uuid));
    int a, b;
    if (comm_first_equal_ids(uuids, sizeof(prop.uuid), comm->world, &a, &b) != 0) {
        free(uuids);
        return;
    }
    const unsigned char *u = uuids + (size_t)a * sizeof(prop.uuid);
    char message[320];
    snprintf(message, sizeof(message), "nccl needs a GPU per rank, and ranks %d and %d drive the same GPU "
             "(GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x in nvidia-smi -L): "
             "comm_backend = mpi lets ranks share a GPU", a, b, u[0], u[1], u[2], u[3], u[4], u[5], u[6], u[7], u[8],
             u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    fail_config(parser, "comm_backend", message);
#else
    (void)device;
    (void)comm;
    (void)parser;
#endif
}

// A GPU is there, and one that this build's kernels run on. Rank r drives GPU local_rank % GPUs:
// its own on a node whose GPUs every rank sees, the one it sees when the launcher gave it one,
// and a shared one only with comm_backend = mpi.
static void check_gpu(GpuContext *gpu, const Comm *comm, const ConfigParser *parser) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0)
        fail("no CUDA GPU found: training needs one (dry_run = 1 checks a config without a GPU)");
    int device = comm->local_rank % count;
    gpu_context_create(gpu, device);
    if (comm->world > 1) refuse_shared_gpu(device, comm, parser);
    // The kernels are built for one architecture (GPU_ARCH, Hopper by default: TMA and wgmma):
    // another GPU would fail at its first kernel, so say which GPU and what the build is for.
    char message[512];
    if (gpu_runs_kernel((const void *)embedding_iota_kernel, TRAIN_LLAMA_GPU_ARCH, message, sizeof(message)) != 0) fail(message);
}

// How many ranks the micro-batch needs at the config's ZeRO stage to fit in budget_bytes.
static void fewest_ranks_text(const TrainConfig *c, size_t budget_bytes, char *text, size_t size) {
    size_t bytes;
    int ranks = memory_plan_smallest_ranks(c, c->micro_batch_size, budget_bytes, &bytes);
    if (ranks > 0)
        snprintf(text, size, "at ZeRO stage %d it fits from %d rank(s) on, %.2f GiB each", c->zero_stage, ranks, gib(bytes));
    else
        snprintf(text, size, "at ZeRO stage %d no number of ranks fits it: each holds at least %.2f GiB", c->zero_stage,
                 gib(bytes));
}

// Refuses (exit 2) a micro-batch whose plan exceeds budget_bytes (what the budget is: "free GPU
// memory", "gpu_memory_gib"), naming the largest that fits, or saying that none does; else returns the plan.
static MemoryPlan refuse_unless_fits(const ConfigParser *parser, int ranks, size_t budget_bytes,
                                     const char *budget_name) {
    const TrainConfig *c = &parser->values;
    MemoryPlan plan;
    memory_plan_compute(&plan, c, ranks, c->micro_batch_size);
    if (plan.total_bytes <= budget_bytes) return plan;
    int largest = memory_plan_largest_micro_batch(c, ranks, budget_bytes);
    char verdict[160], fewest[160];
    fewest_ranks_text(c, budget_bytes, fewest, sizeof(fewest));
    if (largest > 0) snprintf(verdict, sizeof(verdict), "the largest that fits is %d", largest);
    else snprintf(verdict, sizeof(verdict), "not even micro_batch_size 1 fits");
    fprintf(stderr, "error: %s: micro_batch_size %d needs %.2f GiB, more than the %.2f GiB of %s; %s (%s)\n",
            config_source(parser, "micro_batch_size"), c->micro_batch_size, gib(plan.total_bytes), gib(budget_bytes),
            budget_name, verdict, fewest);
    exit(EXIT_CONFIG_ERROR);
}

// The GPU's free memory (capped by gpu_memory_gib when set), less a margin for the allocator's
// granularity and the CUDA runtime's own buffers.
static size_t gpu_memory_budget(const TrainConfig *c) {
    size_t free_bytes = 0, total_bytes = 0;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    size_t budget = c->gpu_memory_gib > 0 ? (size_t)(c->gpu_memory_gib * 1073741824.0) : free_bytes;
    if (budget > free_bytes) budget = free_bytes;
    return budget - budget / 50;
}

// Opens the shards that `key` (train_data or val_data) names in the order `shuffle` (a
// DATALOADER_ order), the batches of rank `rank` of `world` (validation: every rank reads every
// batch, as rank 0 of 1).
static void open_loader_rank(Dataloader *loader, const ConfigParser *parser, const char *key, int shuffle, int rank,
                             int world) {
    const TrainConfig *c = &parser->values;
    DataloaderConfig dc;
    char error[1024];
    dc.pattern = strcmp(key, "train_data") == 0 ? c->train_data : c->val_data;
    dc.batch_size = c->micro_batch_size;
    dc.seq_len = c->seq_len;
    dc.rank = rank;
    dc.world_size = world;
    dc.shuffle = shuffle;
    dc.seed = c->seed;
    dc.vocab_size = c->model.vocab_size;
    if (dataloader_open(loader, &dc, error, sizeof(error)) != 0) fail_input(parser, key, error);
}

static void open_loader(Dataloader *loader, const ConfigParser *parser, const char *key, int shuffle) {
    open_loader_rank(loader, parser, key, shuffle, 0, 1);
}

// The training data's order that the `shuffle` key names.
static int training_order(const TrainConfig *c) {
    return c->shuffle == SHUFFLE_ROWS ? DATALOADER_SHUFFLE_ROWS : DATALOADER_SHUFFLE_BATCHES;
}

// ---- inputs and the dry run ----------------------------------------------------------

// The checkpoint a run starts from: with resume, the newest in out_dir (optimizer and trainer
// state included: *resuming); otherwise init_from (weights only); generating without init_from
// takes the newest in out_dir. Returns 0 when the run starts from scratch.
static int start_checkpoint(const TrainConfig *c, char *path, size_t size, int *resuming) {
    long long newest = checkpoint_find_newest(c->out_dir);
    *resuming = c->resume && !c->generate && newest >= 0;
    if (*resuming || (c->generate && !c->init_from[0] && newest >= 0)) {
        checkpoint_path(path, size, c->out_dir, newest, ".bin");
        return 1;
    }
    if (!c->init_from[0]) return 0;
    snprintf(path, size, "%s", c->init_from);
    return 1;
}

// The config key that named the start checkpoint: init_from, or out_dir (its newest).
static const char *start_checkpoint_key(const TrainConfig *c, const char *path) {
    return c->init_from[0] && strcmp(path, c->init_from) == 0 ? "init_from" : "out_dir";
}

static void fail_no_checkpoint_to_generate(const TrainConfig *c) {
    fprintf(stderr, "error: %s: no checkpoint to generate from (set init_from)\n", c->out_dir);
    exit(EXIT_FAILURE);
}

// The config's tokenizer, refused when it has more tokens than the model's vocabulary.
static Tokenizer *load_tokenizer_or_exit(const ConfigParser *parser) {
    const TrainConfig *c = &parser->values;
    char error[1024];
    Tokenizer *tok = tokenizer_load(c->tokenizer, error, sizeof(error));
    if (!tok) fail_input(parser, "tokenizer", error);
    int first_missing, missing = tokenizer_missing_ids(tok, &first_missing);
    if (missing > 0)
        fprintf(stderr, "warning: %s: %d of the %d ids have no token (the first: %d): a gap in the vocabulary\n", c->tokenizer,
                missing, tokenizer_vocab_size(tok), first_missing);
    if (tokenizer_vocab_size(tok) > c->model.vocab_size) {
        fprintf(stderr, "error: %s: %d tokens, more than vocab_size %d (%s)\n", c->tokenizer, tokenizer_vocab_size(tok),
                c->model.vocab_size, config_source(parser, "vocab_size"));
        exit(EXIT_CONFIG_ERROR);
    }
    return tok;
}

// Opens a checkpoint (one file, or a manifest with its parts) whose model shape is the config's.
// `key` is the config key that led to the file: init_from, or out_dir for its newest checkpoint.
static void open_checkpoint_or_exit(const ConfigParser *parser, const char *key, const char *path, Checkpoint *ck,
                                    int resuming) {
    const TrainConfig *c = &parser->values;
    const CheckpointHeader *h = &ck->header;
    char error[8192];
    if (checkpoint_open(ck, path, error, sizeof(error)) != 0) fail_input(parser, key, error);
    const char *mismatch = checkpoint_shape_mismatch(&h->shape, &c->model);
    if (mismatch) {
        fprintf(stderr, "error: %s: %s differs between the checkpoint and the config\n", path, mismatch);
        exit(EXIT_CONFIG_ERROR);
    }
    ParamLayout layout;
    param_layout_init(&layout, &c->model);
    if (h->total_padded != layout.total_padded) {
        fprintf(stderr, "error: %s: %zu parameters (padded), the config's model has %zu\n", path, h->total_padded,
                layout.total_padded);
        exit(EXIT_CONFIG_ERROR);
    }
    if (resuming && !h->has_optimizer_state) {
        fprintf(stderr, "error: %s: holds weights only, no optimizer state to resume from (use init_from)\n", path);
        exit(EXIT_FAILURE);
    }
    if (resuming && h->trainer_state_bytes != sizeof(TrainerState)) {
        fprintf(stderr, "error: %s: trainer state of %zu bytes, this build writes %zu (another version's checkpoint: use init_from)\n",
                path, h->trainer_state_bytes, sizeof(TrainerState));
        exit(EXIT_FAILURE);
    }
}

// Two paths name the same file (a link or another spelling of it): compared as files, not strings.
static int same_file(const char *a, const char *b) {
    struct stat sa, sb;
    return stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// The validation set is no part of the training set, and holds val_batches distinct batches
// (more would repeat batches and weigh them twice): a val_batches set past it is refused, the
// default is cut to it. Returns the batches a validation pass reads. For dry_run and training.
static int validation_batches(const ConfigParser *parser, const Dataloader *train, const Dataloader *val) {
    const TrainConfig *c = &parser->values;
    char message[4400];
    for (int64_t v = 0; train != NULL && v < val->shard_count; v++)
        for (int64_t t = 0; t < train->shard_count; t++)
            if (same_file(val->shard_paths[v], train->shard_paths[t])) {
                snprintf(message, sizeof(message), "matches %s, which train_data (%s) trains on", val->shard_paths[v],
                         config_source(parser, "train_data"));
                fail_config(parser, "val_data", message);
            }
    int64_t available = dataloader_steps_per_epoch(val);
    if (c->val_batches <= available) return c->val_batches;
    if (config_is_default(parser, "val_batches")) {
        printf("val_batches: the validation set holds %lld batches, fewer than the default %d: a pass reads %lld\n",
               (long long)available, c->val_batches, (long long)available);
        return (int)available;
    }
    snprintf(message, sizeof(message), "%d is more than the %lld batches of %d x %d tokens that val_data holds",
             c->val_batches, (long long)available, c->micro_batch_size, c->seq_len + 1);
    fail_config(parser, "val_batches", message);
    return 0;
}

// The saved data position as this run's position: rank-steps into the epoch for `ranks` ranks.
// The order is a permutation of units (batches, or rows with shuffle = rows) drawn from (seed,
// epoch) over the shards: a resume continues it exactly when seed, shuffle, seq_len (and with
// whole batches, micro_batch_size) are the checkpoint's, and `ranks` x the units of a rank's
// batch divide the units read so far. The units left in an epoch that `ranks` cannot share out
// are those its epoch leaves out: the position moves on to the next epoch. Returns 0 with the
// position and the steps of an epoch on `ranks` ranks, or -1 with the reason in `error` (`key`:
// the config key at fault, "" for none).
static int resume_position(const TrainConfig *c, const TrainerState *s, const Dataloader *train, int ranks,
                           DataloaderPosition *out, int64_t *epoch_steps, const char **key, char *error, size_t size) {
    *key = "";
    const char *changed = s->data_seed != c->seed ? "seed" : s->data_shuffle != training_order(c) ? "shuffle"
                        : s->data_seq_len != c->seq_len ? "seq_len"
                        : s->data_micro_batch_size != c->micro_batch_size && training_order(c) != DATALOADER_SHUFFLE_ROWS
                            ? "micro_batch_size" : NULL;
    if (changed) {
        *key = changed;
        snprintf(error, size, "differs from the checkpoint's run (seed %llu, shuffle %s, seq_len %lld, micro_batch_size %lld), "
                 "which decides the order of the training data: the resumed run would skip rows and read others twice "
                 "(set it back, or start a new run with init_from)", (unsigned long long)s->data_seed,
                 s->data_shuffle == DATALOADER_SHUFFLE_ROWS ? "rows" : "batches", (long long)s->data_seq_len,
                 (long long)s->data_micro_batch_size);
        return -1;
    }
    if (s->data_micro_batch_size < 1 || s->data_micro_batch_size > 1 << 20) {
        snprintf(error, size, "its trainer state holds micro_batch_size %lld: no run writes that",
                 (long long)s->data_micro_batch_size);
        return -1;
    }
    int rows = training_order(c) == DATALOADER_SHUFFLE_ROWS;
    int64_t saved_units = rows ? s->data_micro_batch_size : 1, units = rows ? c->micro_batch_size : 1;
    int64_t per_step = units * ranks, steps = train->unit_count / per_step;
    // (the position bounded before it is multiplied: no overflow on a crafted file)
    int64_t done = s->train_position.step <= train->unit_count ? s->train_position.step * saved_units : INT64_MAX;
    if (s->train_position.epoch < 0 || s->train_position.step < 0 || done / per_step > steps) {
        snprintf(error, size, "its data position (epoch %lld, %lld one-rank batches read) is outside train_data's %lld %s per epoch",
                 (long long)s->train_position.epoch, (long long)s->train_position.step, (long long)train->unit_count,
                 rows ? "rows" : "batches");
        return -1;
    }
    if (done % per_step != 0) {
        snprintf(error, size, "its data position (%lld %s into epoch %lld) is no multiple of %d rank(s) x %lld %s: resume on "
                 "a world size (or a micro_batch_size) that divides it", (long long)done, rows ? "rows" : "batches",
                 (long long)s->train_position.epoch, ranks, (long long)units, rows ? "rows" : "batch");
        return -1;
    }
    out->epoch = s->train_position.epoch;
    out->step = done / per_step;
    *epoch_steps = steps;
    if (out->step == steps) {
        out->epoch++;
        out->step = 0;
    }
    return 0;
}

// The resumed trainer state against the header and this run; exits naming the file.
static void check_trainer_state(const ConfigParser *parser, const char *path, const CheckpointHeader *h,
                                const TrainerState *s, const Dataloader *train, int ranks) {
    char error[1024];
    if (s->step != h->step) {
        fprintf(stderr, "error: %s: the trainer state is at step %lld, the header at step %lld: the file is damaged\n", path,
                s->step, h->step);
        exit(EXIT_FAILURE);
    }
    DataloaderPosition position;
    int64_t epoch_steps;
    const char *key;
    if (resume_position(&parser->values, s, train, ranks, &position, &epoch_steps, &key, error, sizeof(error)) == 0) {
        printf("data position: epoch %lld, step %lld of %lld on %d rank(s)\n", (long long)position.epoch, (long long)position.step,
               (long long)epoch_steps, ranks);
        return;
    }
    if (key[0]) {
        fprintf(stderr, "error: %s: %s %s (resuming %s)\n", config_source(parser, key), key, error, path);
        exit(EXIT_CONFIG_ERROR);
    }
    fprintf(stderr, "error: %s: %s\n", path, error);
    exit(EXIT_FAILURE);
}

// Where the single file holds the optimizer state and the trainer state (either form reads so).
static unsigned long long checkpoint_optimizer_at(const CheckpointHeader *h) {
    return CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded;
}
static unsigned long long checkpoint_trainer_at(const CheckpointHeader *h) {
    return checkpoint_optimizer_at(h) + h->optimizer_state_bytes;
}

// Reads the optimizer state's header and the trainer state of an open checkpoint and checks
// them against this run: the refusals load_checkpoint would make on the GPU. A manifest's
// arrays must have the optimizer's bytes per group.
static void check_resume_state(const ConfigParser *parser, Checkpoint *ck, const Dataloader *train, int ranks) {
    const TrainConfig *c = &parser->values;
    const CheckpointHeader *h = &ck->header;
    AdamW expected;  // the fields the header check reads: the kind and the extent
    memset(&expected, 0, sizeof(expected));
    expected.kind = adamw_kind_from_config(config_optimizer_states(c));
    expected.total = h->total_padded;
    AdamWCheckpointHeader saved;
    TrainerState state;
    char error[8192];
    if (checkpoint_read(ck, checkpoint_optimizer_at(h), &saved, sizeof(saved), error, sizeof(error)) != 0 ||
        checkpoint_read(ck, checkpoint_trainer_at(h), &state, sizeof(state), error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s (the optimizer and trainer state)\n", error);
        exit(EXIT_FAILURE);
    }
    if (adamw_checkpoint_header_check(&expected, &saved, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s: %s (%s)\n", ck->path, error, config_source(parser, c->optimizer_states != STATES_AUTO ? "optimizer_states" : "precision"));
        exit(EXIT_CONFIG_ERROR);
    }
    for (int a = 0; !ck->file && a < CHECKPOINT_ARRAYS; a++)
        if (ck->manifest.group_bytes[a] != adamw_section_group_bytes(expected.kind, a)) {
            fprintf(stderr, "error: %s: array %d holds %zu bytes per group, %s states %zu: the manifest is damaged\n", ck->path, a,
                    ck->manifest.group_bytes[a], optimizer_state_kind_name(expected.kind), adamw_section_group_bytes(expected.kind, a));
            exit(EXIT_FAILURE);
        }
    check_trainer_state(parser, ck->path, h, &state, train, ranks);
}

// The checkpoint the run starts from, if any: its header, its shape, its checksums and, when
// resuming, its optimizer and trainer state against this run on `ranks` ranks. Of ranks that
// check together the checksums are read once: a single file's by rank 0, a manifest's part files
// a share by each rank. A refusal reaches every rank through the start-up check that follows
// (coat/agree.h), so that all exit and none waits.
static void validate_start_checkpoint(const ConfigParser *parser, const Dataloader *train, int ranks) {
    const TrainConfig *c = &parser->values;
    char path[4096], error[8192];
    int resuming;
    if (!start_checkpoint(c, path, sizeof(path), &resuming)) {
        if (c->generate) fail_no_checkpoint_to_generate(c);
        if (c->resume && !c->generate && comm_env_rank() == 0)
            fprintf(stderr, "warning: resume = 1, but %s holds no checkpoint%s: this run starts at step 0\n", c->out_dir,
                    access(c->out_dir, F_OK) == 0 ? "" : " (the folder does not exist: is its name right?)");
        return;
    }
    const char *key = start_checkpoint_key(c, path);
    Checkpoint ck;
    open_checkpoint_or_exit(parser, key, path, &ck, resuming);
    const CheckpointHeader *h = &ck.header;
    int sharing_rank, sharing_world;
    agree_sharing(&sharing_rank, &sharing_world);
    if (checkpoint_verify(&ck, sharing_rank, sharing_world, error, sizeof(error)) != 0) fail_input(parser, key, error);
    if (h->version != CHECKPOINT_VERSION && comm_env_rank() == 0)
        fprintf(stderr, "warning: %s: checkpoint version %d carries no checksums: its weights are read unchecked\n", path, h->version);
    long long named = -1;
    if (strcmp(key, "out_dir") == 0 && sscanf(strrchr(path, '/') + 1, "ckpt_%lld.bin", &named) == 1 && named != h->step) {
        fprintf(stderr, "error: %s: the header says step %lld: the file is damaged or renamed\n", path, h->step);
        exit(EXIT_FAILURE);
    }
    if (resuming && train) check_resume_state(parser, &ck, train, ranks);
    if (!ck.file)
        printf("%s: checkpoint of step %lld in %d part file(s), %s\n", path, h->step, ck.manifest.parts,
               sharing_world > 1 ? "each rank checks its share of their checksums" : "every part's checksum right");
    else
        printf("%s: checkpoint of step %lld%s\n", path, h->step, h->version == CHECKPOINT_VERSION ? ", every section's checksum right" : "");
    checkpoint_close(&ck);
}

// The ranks' launch against comm_backend: what zero_attach refuses once the GPU is allocated.
static void check_launch(const ConfigParser *parser, int ranks, LaunchKind launch) {
    const TrainConfig *c = &parser->values;
    char error[256];
    if (zero_shard_group_check(ranks, c->shard_group, c->zero_stage, error, sizeof(error)) != 0)
        fail_config(parser, "shard_group", error);
    if (ranks <= 1) return;
#ifndef USE_MPI
    if (c->comm_backend == COMM_MPI) fail_config(parser, "comm_backend", "= mpi needs a build with MPI (libopenmpi-dev)");
#endif
#ifndef USE_NCCL
    if (c->comm_backend == COMM_NCCL) fail_config(parser, "comm_backend", "= nccl needs a build with NCCL (nccl.h)");
#endif
    if (c->comm_backend == COMM_MPI && launch == LAUNCH_ENV)
        fail_config(parser, "comm_backend", "= mpi needs the ranks launched by mpirun (these were started with WORLD_SIZE "
                    "and RANK: use comm_backend = nccl)");
}

// The first file this run reads (init_from, the tokenizer, a shard of `loaders`) that is the file
// `path`, as "KEY's FILE" in `which`; 0 when none is. overwrite, a checkpoint prune or logits_out
// must not remove or replace any of them.
static int names_an_input(const TrainConfig *c, const Dataloader *loaders[2], const char *path, char *which, size_t size) {
    const char *files[2] = {c->init_from, c->tokenizer}, *keys[2] = {"init_from", "tokenizer"};
    for (int i = 0; i < 2; i++)
        if (files[i][0] && same_file(files[i], path)) {
            snprintf(which, size, "%s's %s", keys[i], files[i]);
            return 1;
        }
    for (int l = 0; l < 2; l++)
        for (int64_t i = 0; loaders[l] && i < loaders[l]->shard_count; i++)
            if (same_file(loaders[l]->shard_paths[i], path)) {
                snprintf(which, size, "%s's %s", l == 0 ? "train_data" : "val_data", loaders[l]->shard_paths[i]);
                return 1;
            }
    return 0;
}

// overwrite = 1 removes out_dir's ckpt_* files and log.jsonl: none may be a file this run reads.
static void check_overwrite_keeps_inputs(const ConfigParser *parser, const Dataloader *loaders[2]) {
    const TrainConfig *c = &parser->values;
    if (!c->overwrite || c->resume || c->generate) return;
    DIR *d = opendir(c->out_dir);
    if (!d) return;
    struct dirent *entry;
    char path[4096], which[4400], message[8800];
    while ((entry = readdir(d)) != NULL) {
        if (!checkpoint_is_run_file(entry->d_name)) continue;
        snprintf(path, sizeof(path), "%s/%s", c->out_dir, entry->d_name);
        if (!names_an_input(c, loaders, path, which, sizeof(which))) continue;
        closedir(d);
        snprintf(message, sizeof(message), "= 1 would remove %s, which this run reads (%s): move it out of out_dir", path, which);
        fail_config(parser, "overwrite", message);
    }
    closedir(d);
}

// logits_out: only with generate, into an existing folder, and never onto a file the run reads.
static void check_logits_out(const ConfigParser *parser, const Dataloader *loaders[2]) {
    const TrainConfig *c = &parser->values;
    if (!c->logits_out[0]) return;
    if (!c->generate) fail_config(parser, "logits_out", "is written by generate = 1 only: set generate = 1, or leave logits_out empty");
    char folder[4096], which[4400], message[8800];
    snprintf(folder, sizeof(folder), "%s", c->logits_out);
    char *slash = strrchr(folder, '/');
    if (!slash) snprintf(folder, sizeof(folder), ".");
    else if (slash == folder) folder[1] = '\0';
    else *slash = '\0';
    struct stat info;
    if (stat(folder, &info) != 0 || !S_ISDIR(info.st_mode) || access(folder, W_OK | X_OK) != 0) {
        snprintf(message, sizeof(message), "'%s': its folder '%s' %s", c->logits_out, folder,
                 stat(folder, &info) != 0 ? "does not exist" : !S_ISDIR(info.st_mode) ? "is not a folder" : "is not writable");
        fail_config(parser, "logits_out", message);
    }
    char start[4096], part[4200];
    int resuming, starts = start_checkpoint(c, start, sizeof(start), &resuming);
    int reads_start = starts && same_file(start, c->logits_out);
    if (reads_start) snprintf(which, sizeof(which), "the checkpoint %s", start);
    for (int p = 0; starts && !reads_start; p++) {  // a per-rank checkpoint's part files, .rank0.bin onwards
        checkpoint_part_path(part, sizeof(part), start, p);
        if (access(part, F_OK) != 0) break;
        reads_start = same_file(part, c->logits_out);
        if (reads_start) snprintf(which, sizeof(which), "a part file of the checkpoint %s", start);
    }
    if (reads_start || names_an_input(c, loaders, c->logits_out, which, sizeof(which))) {
        snprintf(message, sizeof(message), "'%s' is %s, which this run reads", c->logits_out, which);
        fail_config(parser, "logits_out", message);
    }
}

// Every check of a run that needs no GPU, for dry_run and training alike, so that dry_run refuses
// what training would: the config, the launch, every input (shards, tokenizer, the start
// checkpoint with its checksums and, resuming, its optimizer and trainer state on `ranks` ranks)
// and the outputs. dry_run also reads every token (scan_tokens, a full read of the data);
// training checks each batch as it reads it. Every rank of a run checks what it will read itself,
// but for the start checkpoint's checksums, which one pass over the file settles for all.
static void validate_run(const ConfigParser *parser, int ranks, LaunchKind launch, int scan_tokens) {
    const TrainConfig *c = &parser->values;
    char error[1024];
    check_run_config(parser);
    check_launch(parser, ranks, launch);
    const char *patterns[2] = {c->train_data, c->val_data};
    Dataloader loaders[2];
    const Dataloader *opened[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (patterns[i][0] == '\0' || (c->generate && i == 1)) continue;
        const char *key = i == 0 ? "train_data" : "val_data";
        open_loader(&loaders[i], parser, key, i == 0 ? training_order(c) : DATALOADER_IN_ORDER);
        opened[i] = &loaders[i];
        if (!scan_tokens) continue;
        if (dataloader_validate_tokens(&loaders[i], c->model.vocab_size, error, sizeof(error)) != 0)
            fail_input(parser, key, error);
        printf("%s: %lld shard(s), %lld micro-batches per epoch, every token below vocab_size\n", patterns[i],
               (long long)loaders[i].shard_count, (long long)dataloader_steps_per_epoch(&loaders[i]));
    }
    if (opened[1]) validation_batches(parser, opened[0], opened[1]);
    if (c->tokenizer[0]) {
        Tokenizer *tok = load_tokenizer_or_exit(parser);
        if (scan_tokens) printf("%s: %d tokens\n", c->tokenizer, tokenizer_vocab_size(tok));
        tokenizer_free(tok);
    }
    check_overwrite_keeps_inputs(parser, opened);
    check_logits_out(parser, opened);
    validate_start_checkpoint(parser, opened[0], ranks);
    for (int i = 0; i < 2; i++)
        if (opened[i]) dataloader_close(&loaders[i]);
}

// dry_run: validates everything that needs no GPU and prints the plan; exit 0 when it holds.
static int dry_run(const ConfigParser *parser, int ranks, LaunchKind launch) {
    const TrainConfig *c = &parser->values;
    char error[CONFIG_ERROR_MAX];
    int grad_accum = config_grad_accum_steps(parser, ranks, error, sizeof(error));
    if (grad_accum < 0) {
        fprintf(stderr, "error: %s\n", error);
        return EXIT_CONFIG_ERROR;
    }
    validate_run(parser, ranks, launch, 1);
    print_model_summary(c);
    printf("batch: %d x %d tokens per micro-step x %d rank(s) x %d accumulation step(s) = %lld tokens per step\n",
           c->micro_batch_size, c->seq_len, ranks, grad_accum,
           (long long)c->micro_batch_size * c->seq_len * ranks * grad_accum);
    MemoryPlan plan;
    memory_plan_compute(&plan, c, ranks, c->micro_batch_size);
    memory_plan_print(stdout, &plan, c);
    ParamLayout layout;
    param_layout_init(&layout, &c->model);
    ZeroPlan zero;
    zero_plan_init_groups(&zero, &layout, ranks, c->shard_group, c->zero_stage, (size_t)c->bucket_min_elems);
    zero_plan_micro_batches(&zero, grad_accum);
    zero_print(stdout, &zero, &layout, grad_accum, config_fp8_gemms(c), config_param_gather(c) == GATHER_E4M3);
    print_activation_table(c);
    if (c->gpu_memory_gib > 0) {
        size_t budget = (size_t)(c->gpu_memory_gib * 1024.0 * 1024.0 * 1024.0);
        refuse_unless_fits(parser, ranks, budget, "gpu_memory_gib");
        char fewest[160];
        fewest_ranks_text(c, budget, fewest, sizeof(fewest));
        printf("fits in %.1f GiB (largest micro-batch that fits: %d; %s)\n", (double)c->gpu_memory_gib,
               memory_plan_largest_micro_batch(c, ranks, budget), fewest);
    }
    printf("dry run: configuration is valid\n");
    return 0;
}

// ---- training --------------------------------------------------------------------------

// Reads a checkpoint's weights (this rank's parts of them) into the optimizer's master copy and
// the BF16 parameters; with `resume`, also the optimizer and trainer state. Every rank reads its
// own parts, from the one file or from the part files that hold them.
static void load_checkpoint(Trainer *t, const char *path, int resume) {
    Checkpoint ck;
    char error[8192];
    open_checkpoint_or_exit(t->parser, start_checkpoint_key(t->c, path), path, &ck, resume);
    adamw_read_section(&t->opt, 0, &ck, CHECKPOINT_HEADER_BYTES, t->host_chunk, t->gpu.stream);
    adamw_write_params(&t->opt, t->model.params, t->gpu.stream);
    zero_gather_params(&t->zero, t->opt.master, 0);
    if (resume) {
        adamw_load(&t->opt, &ck, checkpoint_optimizer_at(&ck.header), t->host_chunk, t->gpu.stream);
        adamw_read_or_exit(&ck, checkpoint_trainer_at(&ck.header), &t->state, sizeof(TrainerState));
        // validate_run has checked the position against this run (check_trainer_state).
        DataloaderPosition position;
        int64_t epoch_steps;
        const char *key;
        if (resume_position(t->c, &t->state, &t->train_loader, t->comm->world, &position, &epoch_steps, &key, error,
                            sizeof(error)) != 0 ||
            dataloader_set_position(&t->train_loader, position, error, sizeof(error)) != 0)
            fail_input(t->parser, "out_dir", error);
        t->sample_rng.state = t->state.sample_rng_state;
    }
    checkpoint_close(&ck);
    cudaCheck(cudaStreamSynchronize(t->gpu.stream));
}

// The optimizer's gather across ranks (a copy on one rank): the NCCL path receives into the
// gradient buffer, idle between steps.
static void gather_chunk(void *context, const void *device, void *host, size_t bytes, int from) {
    Trainer *t = (Trainer *)context;
    collectives_gather_to_root(&t->zero.collectives, device, host, bytes, from, t->host_chunk + ADAMW_COPY_CHUNK_BYTES,
                               t->model.grads);
}

// What a checkpoint holds of the trainer at this step (rank 0's, which the others share but for
// their part of the data).
static void trainer_state_at_checkpoint(Trainer *t) {
    const TrainConfig *c = t->c;
    t->state.train_position = dataloader_position(&t->train_loader);
    t->state.train_position.step *= t->comm->world;
    t->state.sample_rng_state = t->sample_rng.state;
    t->state.data_seed = c->seed;
    t->state.data_shuffle = training_order(c);
    t->state.data_micro_batch_size = c->micro_batch_size;
    t->state.data_seq_len = c->seq_len;
}

// The header of this step's checkpoint (its checksums are taken as the sections are written).
static CheckpointHeader checkpoint_header_now(const Trainer *t) {
    CheckpointHeader h;
    memset(&h, 0, sizeof(h));
    h.shape = t->c->model;
    h.step = t->state.step;
    h.total_padded = t->model.layout.total_padded;
    h.has_optimizer_state = 1;
    h.optimizer_state_bytes = adamw_checkpoint_bytes(&t->opt);
    h.trainer_state_bytes = sizeof(TrainerState);
    return h;
}

// The ranks whose states a checkpoint holds: with sharded states the first group's (ranks 0 to
// shards - 1, shard index = rank; every group holds the same states), else rank 0's.
static int checkpoint_parts(const Trainer *t) { return t->zero.plan.shards > 1 ? t->zero.plan.shards : 1; }

// checkpoint_writes = rank0: rank 0 writes the checkpoint; with sharded states every rank of the
// first group sends it its parts (streamed, a chunk at a time, in the parameter order) and the
// file is the one a single rank would write. Each section's checksum is taken as it is written.
static void save_checkpoint_file(Trainer *t) {
    const TrainConfig *c = t->c;
    int rank = t->comm->rank, sharded = t->zero.plan.shards > 1, ranks = checkpoint_parts(t);
    if (rank >= ranks) return;
    AdamWGather gather = sharded ? gather_chunk : adamw_gather_copy;
    void *context = sharded ? (void *)t : (void *)t->gpu.stream;
    size_t chunk = sharded && 2 * t->model.grads_elems < ADAMW_COPY_CHUNK_BYTES ? 2 * t->model.grads_elems : ADAMW_COPY_CHUNK_BYTES;
    cudaCheck(cudaStreamSynchronize(t->gpu.stream));
    CheckpointHeader h = checkpoint_header_now(t);
    CheckpointSink file, *sink = NULL;
    char error[8192];
    if (rank == 0) {
        if (checkpoint_begin(c->out_dir, &h, &file, error, sizeof(error)) != 0) fail(error);
        sink = &file;
    }
    adamw_write_section(&t->opt, 0, sink, 0, ranks, gather, context, t->host_chunk, chunk);
    if (sink) h.crc[0] = checkpoint_sink_section(sink);
    adamw_save(&t->opt, sink, 0, ranks, gather, context, t->host_chunk, chunk);
    if (rank != 0) return;
    h.crc[1] = checkpoint_sink_section(sink);
    trainer_state_at_checkpoint(t);
    checkpoint_sink_write(sink, &t->state, sizeof(TrainerState));
    h.crc[2] = checkpoint_sink_section(sink);
    if (checkpoint_commit(sink, c->out_dir, &h, error, sizeof(error)) != 0) fail(error);
    checkpoint_prune(c->out_dir, c->checkpoints_keep);
    printf("checkpoint: %s/ckpt_%08lld.bin\n", c->out_dir, h.step);
}

// The ranks' reports on their part files: each puts the CRC-32 of its part (-1: not written) in
// its own slot, which the others leave 0, so that one sum gives every rank every report (exact:
// whole numbers below 2^33). Fills crcs[parts]; returns the first rank whose part failed, or -1.
static int gather_part_reports(Trainer *t, int parts, int written, uint32_t crc, uint32_t *crcs) {
    double values[ZERO_SCALARS];
    char what[96];
    int failed = -1;
    snprintf(what, sizeof(what), "the part files' reports of the step-%lld checkpoint", t->state.step);
    for (int first = 0; first < parts; first += ZERO_SCALARS) {
        int n = parts - first < ZERO_SCALARS ? parts - first : ZERO_SCALARS, mine = t->comm->rank - first;
        for (int i = 0; i < n; i++) values[i] = i == mine ? (written ? (double)crc : -1.0) : 0.0;
        collectives_all_reduce_sum_f64(&t->zero.collectives, values, n, t->gpu.stream, what);
        for (int i = 0; i < n; i++) {
            if (values[i] < 0 && failed < 0) failed = first + i;
            crcs[first + i] = values[i] < 0 ? 0 : (uint32_t)values[i];
        }
    }
    return failed;
}

// This rank's part file of the step's checkpoint: its parts of the weights and of every
// optimizer array, on disk and renamed into place. Returns 1 with *crc, or 0 having printed why not.
static int write_part_file(Trainer *t, int parts, uint32_t *crc) {
    const AdamW *opt = &t->opt;
    const char *dir = t->c->out_dir;
    size_t group_bytes[CHECKPOINT_ARRAYS];
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) group_bytes[a] = adamw_section_group_bytes(opt->kind, a);
    CheckpointRange *ranges = (CheckpointRange *)malloc(opt->range_count * sizeof(CheckpointRange));
    if (!ranges) fail("out of host memory for the checkpoint's ranges");
    unsigned long long bytes = checkpoint_part_file_bytes(ranges, adamw_part_ranges(opt, opt->rank, ranges), group_bytes);
    free(ranges);
    CheckpointSink sink;
    char error[8192];
    int written = checkpoint_part_begin(dir, t->state.step, opt->rank, parts, &sink, error, sizeof(error)) == 0;
    if (written) {
        for (int a = 0; a < CHECKPOINT_ARRAYS; a++)
            adamw_write_section(opt, a, &sink, opt->rank, 1, adamw_gather_copy, t->gpu.stream, t->host_chunk, ADAMW_COPY_CHUNK_BYTES);
        written = checkpoint_part_commit(&sink, dir, t->state.step, opt->rank, bytes, crc, error, sizeof(error)) == 0;
    }
    if (!written) fprintf(stderr, "error: %s\n", error);
    return written;
}

// Rank 0's manifest of the parts (crcs[parts] their files' CRC-32) and the .done marker.
static void write_manifest(Trainer *t, int parts, const uint32_t *crcs) {
    const AdamW *opt = &t->opt;
    CheckpointManifest m;
    AdamWCheckpointHeader optimizer_header;
    char error[8192];
    memset(&m, 0, sizeof(m));
    m.header = checkpoint_header_now(t);
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) m.group_bytes[a] = adamw_section_group_bytes(opt->kind, a);
    adamw_checkpoint_header(opt, &optimizer_header);
    trainer_state_at_checkpoint(t);
    m.optimizer_header_bytes = sizeof(optimizer_header);
    m.optimizer_header = (unsigned char *)malloc(sizeof(optimizer_header));
    m.trainer_state = (unsigned char *)malloc(sizeof(TrainerState));
    m.parts = parts;
    m.part = (CheckpointPart *)calloc((size_t)parts, sizeof(CheckpointPart));
    if (!m.optimizer_header || !m.trainer_state || !m.part) fail("out of host memory for the checkpoint's manifest");
    memcpy(m.optimizer_header, &optimizer_header, sizeof(optimizer_header));
    memcpy(m.trainer_state, &t->state, sizeof(TrainerState));
    for (int p = 0; p < parts; p++) {
        CheckpointPart *part = &m.part[p];
        part->ranges = (CheckpointRange *)malloc(opt->range_count * sizeof(CheckpointRange));
        if (!part->ranges) fail("out of host memory for the checkpoint's manifest");
        part->range_count = adamw_part_ranges(opt, p, part->ranges);
        part->file_bytes = checkpoint_part_file_bytes(part->ranges, part->range_count, m.group_bytes);
        part->crc = crcs[p];
    }
    if (checkpoint_manifest_commit(t->c->out_dir, &m, error, sizeof(error)) != 0) fail(error);
    checkpoint_manifest_free(&m);
}

// checkpoint_writes = per_rank: every rank whose part of the states the checkpoint holds (the
// first group's when sharded, else rank 0) writes it to its own file, in parallel, no byte passing through another
// rank; once all have reported their files on disk, rank 0 writes the manifest and the marker.
// A rank whose part failed ends every rank, none marked done (the parts written are removed).
static void save_checkpoint_parts(Trainer *t) {
    const TrainConfig *c = t->c;
    int rank = t->comm->rank, parts = checkpoint_parts(t);
    long long step = t->state.step;
    cudaCheck(cudaStreamSynchronize(t->gpu.stream));
    uint32_t crc = 0, *crcs = (uint32_t *)malloc((size_t)parts * sizeof(uint32_t));
    if (!crcs) fail("out of host memory for the part files' reports");
    int written = rank < parts && write_part_file(t, parts, &crc);
    int failed = gather_part_reports(t, parts, written, crc, crcs);
    if (failed >= 0) {
        char manifest[4096], part[4200];
        checkpoint_path(manifest, sizeof(manifest), c->out_dir, step, ".bin");
        checkpoint_part_path(part, sizeof(part), manifest, rank);
        if (written) remove(part);  // no checkpoint will list it
        if (rank == 0)
            fprintf(stderr, "error: %s: not written: rank %d could not write its part file (its error above)\n", manifest, failed);
        exit(EXIT_FAILURE);
    }
    if (rank == 0) {
        write_manifest(t, parts, crcs);
        checkpoint_prune(c->out_dir, c->checkpoints_keep);
        printf("checkpoint: %s/ckpt_%08lld.bin (a manifest of %d part file(s))\n", c->out_dir, step, parts);
    }
    free(crcs);
}

static void save_checkpoint(Trainer *t) {
    if (t->c->checkpoint_writes == CHECKPOINT_WRITES_PER_RANK) save_checkpoint_parts(t);
    else save_checkpoint_file(t);
}

// Copies the next batch of `loader` to the GPU.
static void load_batch(Trainer *t, Dataloader *loader) {
    char error[1024];
    size_t N = (size_t)t->model.B * t->model.T;
    if (dataloader_next_batch(loader, t->host_inputs, t->host_targets, error, sizeof(error)) != 0)
        fail_input(t->parser, loader == &t->train_loader ? "train_data" : "val_data", error);
    cudaCheck(cudaMemcpyAsync(t->model.tokens, t->host_inputs, N * sizeof(int), cudaMemcpyHostToDevice, t->gpu.stream));
    cudaCheck(cudaMemcpyAsync(t->model.targets, t->host_targets, N * sizeof(int), cudaMemcpyHostToDevice, t->gpu.stream));
}

// Mean loss over the fixed validation batches. Rank r of W evaluates batches r, r + W, ... and
// the ranks' FP64 sums are added: exact for these few values, so the mean is the same for any W.
// When a forward pass is collective (ZeRO stage 3) every rank runs as many: a rank past the last
// batch runs the round's first again and adds nothing.
static float validation_loss(Trainer *t) {
    double total = 0.0;
    int N = t->model.B * t->model.T, world = t->comm->world;
    char error[1024];
    for (int round = 0; round < t->val_batches; round += world) {
        int i = round + t->comm->rank, mine = i < t->val_batches;
        if (!mine && !zero_forward_is_collective(&t->zero)) break;
        DataloaderPosition batch = {0, mine ? i : round};  // the validation order is the identity
        if (dataloader_set_position(&t->val_loader, batch, error, sizeof(error)) != 0) fail_input(t->parser, "val_data", error);
        load_batch(t, &t->val_loader);
        model_forward(&t->gpu, &t->model, 0, 0.0f);
        classifier_mean_loss(&t->gpu, t->model.mean_loss, t->model.losses, N);
        cudaCheck(cudaMemcpyAsync(t->host_scalar, t->model.mean_loss, sizeof(float), cudaMemcpyDeviceToHost, t->gpu.stream));
        collectives_wait_stream(&t->zero.collectives, t->gpu.stream, "a validation batch and the parameter gather before it");
        if (mine) total += *t->host_scalar;
    }
    if (t->comm->world > 1)
        collectives_all_reduce_sum_f64(&t->zero.collectives, &total, 1, t->gpu.stream, "the validation loss's all-reduce");
    return (float)(total / t->val_batches);
}

// Index drawn from the smallest set of most likely tokens whose mass reaches top_p (greedy when
// top_p is 0), after dividing the logits by the temperature.
static int sample_token(const float *logits, int V, float top_p, float temperature, Random *rng, int *order, float *probs) {
    int best = 0;
    for (int i = 1; i < V; i++) if (logits[i] > logits[best]) best = i;
    if (top_p <= 0.0f || temperature <= 0.0f) return best;
    double sum = 0.0;
    for (int i = 0; i < V; i++) {
        probs[i] = (float)exp((logits[i] - logits[best]) / temperature);
        sum += probs[i];
        order[i] = i;
    }
    // Partial selection sort: only the head of the distribution is needed.
    double mass = 0.0;
    int kept = 0;
    while (kept < V && mass < top_p * sum) {
        int top = kept;
        for (int i = kept + 1; i < V; i++) if (probs[order[i]] > probs[order[top]]) top = i;
        int swap = order[kept]; order[kept] = order[top]; order[top] = swap;
        mass += probs[order[kept++]];
    }
    double r = random_uniform(rng) * mass;
    for (int i = 0; i < kept; i++) {
        r -= probs[order[i]];
        if (r <= 0.0) return order[i];
    }
    return order[kept - 1];
}

// Runs the model on one sequence of `count` tokens (count <= T: the micro-batch buffers hold
// it) and copies the FP32 logits of positions first..count-1 to host_logits [count - first, stride],
// a few rows at a time through the kernels' scratch buffer (forward passes leave it free).
static void sequence_logits(Trainer *t, const uint32_t *ids, int count, int first, float *host_logits) {
    LlamaModel *m = &t->model;
    int V = m->shape.vocab_size, stride = classifier_logits_stride(V), B_saved = m->B, T_saved = m->T;
    for (int j = 0; j < count; j++) t->host_inputs[j] = (int)ids[j];
    cudaCheck(cudaMemcpyAsync(m->tokens, t->host_inputs, count * sizeof(int), cudaMemcpyHostToDevice, t->gpu.stream));
    cudaCheck(cudaMemsetAsync(m->targets, 0, count * sizeof(int), t->gpu.stream));
    m->B = 1;
    m->T = count;
    model_forward(&t->gpu, m, 0, 0.0f);
    m->B = B_saved;
    m->T = T_saved;
    int rows_per_chunk = (int)(m->working_layout.kernel_scratch_bytes / ((size_t)stride * sizeof(float)));
    for (int row = first; row < count; row += rows_per_chunk) {
        int rows = count - row < rows_per_chunk ? count - row : rows_per_chunk;
        classifier_logits(&t->gpu, (float *)m->kernel_scratch, m->final_norm_out, model_param(m, PARAM_LM_HEAD, 0), row,
                          1, rows, m->shape.dim, V);
        cudaCheck(cudaMemcpyAsync(host_logits + (size_t)(row - first) * stride, m->kernel_scratch,
                                  (size_t)rows * stride * sizeof(float), cudaMemcpyDeviceToHost, t->gpu.stream));
    }
    collectives_wait_stream(&t->zero.collectives, t->gpu.stream, "a sample's forward and the parameter gather before it");
}

// Samples are rank 0's, and so are its forward passes, unless a forward pass is collective (ZeRO
// stage 3 gathers the layers from every rank): then every rank runs them with rank 0's tokens,
// and rank 0 alone prints and writes.
static int samples_here(const Trainer *t) { return t->comm->rank == 0 || zero_forward_is_collective(&t->zero); }

// Rank 0's sampled token on every rank that samples: an FP64 sum of it and the others' zeros, exact.
static int rank0_token(Trainer *t, int token) {
    if (t->comm->world == 1 || !zero_forward_is_collective(&t->zero)) return token;
    double value = t->comm->rank == 0 ? (double)token : 0.0;
    collectives_all_reduce_sum_f64(&t->zero.collectives, &value, 1, t->gpu.stream, "a sampled token's all-reduce");
    return (int)value;
}

// logits_out: the prompt's tokens and the logits at every position, for comparisons with other
// implementations (scripts/check_hf_export.py).
static void write_prompt_logits(Trainer *t, const uint32_t *ids, int count) {
    int V = t->model.shape.vocab_size, stride = classifier_logits_stride(V);
    float *logits = (float *)malloc((size_t)count * stride * sizeof(float));
    if (!logits) fail("out of host memory for the prompt's logits");
    sequence_logits(t, ids, count, 0, logits);
    if (t->comm->rank != 0) {
        free(logits);
        return;
    }
    const char *path = t->c->logits_out;
    FILE *f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "error: %s: cannot create: %s\n", path, strerror(errno)); exit(EXIT_FAILURE); }
    int32_t header[2] = {count, V};
    int ok = fwrite(header, sizeof(header), 1, f) == 1 && fwrite(ids, sizeof(uint32_t), (size_t)count, f) == (size_t)count;
    for (int i = 0; ok && i < count; i++) ok = fwrite(logits + (size_t)i * stride, sizeof(float), (size_t)V, f) == (size_t)V;
    if (fclose(f) != 0 || !ok) { fprintf(stderr, "error: %s: write failed\n", path); exit(EXIT_FAILURE); }
    printf("logits of %d prompt tokens: %s\n", count, path);
    free(logits);
}

// Generates sample_tokens after sample_prompt, one sequence through the micro-batch buffers,
// and prints the text.
static void print_sample(Trainer *t) {
    const TrainConfig *c = t->c;
    int V = t->model.shape.vocab_size, T_max = t->model.T;
    uint32_t *ids = NULL;
    size_t count = 0, capacity = 0;
    int bos = tokenizer_bos_id(t->tokenizer);
    if (bos >= 0) {
        capacity = 16;
        ids = (uint32_t *)malloc(capacity * sizeof(uint32_t));
        if (!ids) fail("out of host memory for the sample's tokens");
        ids[count++] = (uint32_t)bos;
    }
    if (tokenizer_encode(t->tokenizer, c->sample_prompt, strlen(c->sample_prompt), &ids, &count, &capacity) != 0)
        fail("out of memory encoding the sample prompt");
    if (count == 0) fail("sample_prompt is empty and the tokenizer has no BOS token to start from");
    if (count > (size_t)T_max) fail("sample_prompt is longer than seq_len tokens");
    if (c->generate && c->logits_out[0]) write_prompt_logits(t, ids, (int)count);
    size_t prompt_count = count;
    float *logits = (float *)malloc((size_t)classifier_logits_stride(V) * sizeof(float));
    float *probs = (float *)malloc((size_t)V * sizeof(float));
    int *order = (int *)malloc((size_t)V * sizeof(int));
    if (!logits || !probs || !order) fail("out of host memory for sampling");
    for (int i = 0; i < c->sample_tokens && count < (size_t)T_max; i++) {
        sequence_logits(t, ids, (int)count, (int)count - 1, logits);
        int next = rank0_token(t, sample_token(logits, V, c->top_p, c->temperature, &t->sample_rng, order, probs));
        if (count == capacity) {
            capacity = capacity ? 2 * capacity : 16;
            uint32_t *grown = (uint32_t *)realloc(ids, capacity * sizeof(uint32_t));
            if (!grown) fail("out of host memory for the sample's tokens");
            ids = grown;
        }
        ids[count++] = (uint32_t)next;
        if (next == tokenizer_eos_id(t->tokenizer)) break;
    }
    free(logits);
    free(probs);
    free(order);
    if (t->comm->rank != 0) {
        free(ids);
        return;
    }
    size_t length = 0, skip = bos >= 0 ? 1 : 0;
    char *text = tokenizer_decode(t->tokenizer, ids + skip, count - skip, &length);
    if (!text) fail("out of host memory decoding the sample");
    printf("sample (%s, %zu prompt tokens): %.*s\n", c->top_p > 0 ? "top-p" : "greedy", prompt_count, (int)length, text);
    fflush(stdout);
    free(text);
    free(ids);
}

// Each rank's device buffers, all allocated by now (the sizes given to cudaMalloc), against its
// memory plan: a rank whose allocation differs says so, and rank 0 prints the count over all ranks.
static void report_allocation(Trainer *t) {
    MemoryPlan plan;
    memory_plan_compute(&plan, t->c, t->comm->world, t->c->micro_batch_size);
    size_t allocated = model_allocated_bytes(&t->model) + adamw_allocated_bytes(&t->opt) + t->gpu.cublaslt_workspace_bytes +
                       t->zero.allocated_bytes;
    OptionalBuffers taken = {t->model.attention_ds != NULL, t->model.attention_out_t != NULL,
                             t->model.fp8_weight_transposes != NULL};
    size_t planned = plan.total_bytes + memory_plan_optional_bytes(&plan, taken);
    double differ = allocated != planned;
    if (differ)
        fprintf(stderr, "warning: rank %d allocated %zu bytes on the GPU, its memory plan %zu\n", t->comm->rank, allocated,
                planned);
    if (t->comm->world > 1)
        collectives_all_reduce_sum_f64(&t->zero.collectives, &differ, 1, t->gpu.stream, "the memory plan check's all-reduce");
    if (t->comm->rank != 0) return;
    if (differ == 0)
        printf("GPU memory allocated: %.3f GiB per rank, each rank's plan byte for byte%s%s%s\n", gib(allocated),
               taken.attention_ds ? " (with the attention dS buffer)" : "",
               taken.attention_out_t ? " (with the attention output's transposes)" : "",
               taken.weight_transposes ? " (with every layer's W^T)" : "");
    else printf("GPU memory allocated: %.3f GiB on rank 0, %d rank(s) differ from their plan\n", gib(allocated), (int)differ);
}

static void trainer_create(Trainer *t, ConfigParser *parser, const Comm *comm) {
    char error[1024];
    int ranks = comm->world;
    memset(t, 0, sizeof(*t));
    t->parser = parser;
    t->c = &parser->values;
    t->comm = comm;
    const TrainConfig *c = t->c;
    t->grad_accum = config_grad_accum_steps(parser, ranks, error, sizeof(error));
    if (t->grad_accum < 0) { fprintf(stderr, "error: %s\n", error); exit(EXIT_CONFIG_ERROR); }
    check_gpu(&t->gpu, comm, parser);
    size_t budget = gpu_memory_budget(c);
    MemoryPlan memory = refuse_unless_fits(parser, ranks, budget, "free GPU memory");
    OptionalBuffers optional = memory_plan_optional(&memory, budget);

    ParamLayout layout;
    param_layout_init(&layout, &c->model);
    ZeroPlan *plan = (ZeroPlan *)malloc(sizeof(ZeroPlan));
    if (!plan) fail("out of host memory for the ZeRO plan");
    zero_plan_init_groups(plan, &layout, ranks, c->shard_group, ranks > 1 ? c->zero_stage : 0, (size_t)c->bucket_min_elems);
    zero_plan_micro_batches(plan, t->grad_accum);
    ParamLayout buffers;
    zero_model_layout(plan, &c->model, &buffers);
    model_create_sized(&t->model, &c->model, c->micro_batch_size, c->seq_len, model_precision_from_config(c), &buffers,
                       zero_grads_elems(plan), zero_layers_gathered(plan), optional);
    CollectivesBackend backend = c->comm_backend == COMM_MPI ? COLLECTIVES_MPI : COLLECTIVES_NCCL;
    if (zero_attach(&t->zero, plan, comm, &t->model, t->gpu.stream, backend, c->collective_timeout_s, error,
                    sizeof(error)) != 0)
        fail_config(parser, "comm_backend", error);
    free(plan);
    t->host_chunk = (unsigned char *)malloc(2 * ADAMW_COPY_CHUNK_BYTES);
    if (!t->host_chunk) fail("out of host memory for the checkpoint buffer");
    AdamWConfig ac;
    ac.beta1 = c->beta1;
    ac.beta2 = c->beta2;
    ac.eps = c->adam_eps;
    ac.weight_decay = c->weight_decay;
    ac.weight_decay_all = c->weight_decay_all;
    ac.stochastic_rounding = c->optimizer_rounding;
    ParamShardRange *ranges = (ParamShardRange *)malloc(t->zero.plan.buckets * sizeof(ParamShardRange));
    if (!ranges) fail("out of host memory for the optimizer's ranges");
    zero_optimizer_ranges(&t->zero, ranges);
    adamw_create_ranges(&t->opt, adamw_kind_from_config(config_optimizer_states(c)), &ac, &layout, ranges,
                        t->zero.plan.buckets, zero_optimizer_rank(&t->zero), t->gpu.stream);
    free(ranges);
    if (t->model.precision.weights_from_master) {  // the step gathers the FP8 weights' amax
        AdamWAmaxParts *parts = (AdamWAmaxParts *)malloc(sizeof(AdamWAmaxParts));
        if (!parts) fail("out of host memory for the optimizer's amax parts");
        if (zero_weights_amax_parts(&t->zero, parts)) adamw_set_amax_parts(&t->opt, parts);
        free(parts);
    }
    report_allocation(t);
    if (!c->generate) open_loader_rank(&t->train_loader, parser, "train_data", training_order(c), comm->rank, ranks);
    t->have_val = c->val_data[0] != '\0' && !c->generate;
    if (t->have_val) {
        open_loader(&t->val_loader, parser, "val_data", DATALOADER_IN_ORDER);
        t->val_batches = validation_batches(parser, &t->train_loader, &t->val_loader);
    }
    if (c->tokenizer[0]) t->tokenizer = load_tokenizer_or_exit(parser);
    size_t N = (size_t)c->micro_batch_size * c->seq_len;
    cudaCheck(cudaMallocHost(&t->host_inputs, N * sizeof(int)));
    cudaCheck(cudaMallocHost(&t->host_targets, N * sizeof(int)));
    cudaCheck(cudaMallocHost(&t->host_scalar, sizeof(float)));
    random_seed(&t->sample_rng, c->seed ^ 0x5A4D504C45ull);
    if (c->profile) t->timer = op_timer_create();
    t->flops_per_token = 6.0 * (double)param_count_non_embedding(&t->model.layout) +
                         6.0 * c->model.n_layers * (double)c->model.dim * c->seq_len;

    // Weights: the newest checkpoint when resuming, else init_from, else a fresh initialisation.
    char path[4096];
    int resuming;
    if (start_checkpoint(c, path, sizeof(path), &resuming)) {
        load_checkpoint(t, path, resuming);
        printf("%s %s\n", resuming ? "resumed from" : "weights from", path);
    } else if (c->generate) {
        fail_no_checkpoint_to_generate(c);
    } else {
        adamw_init_master(&t->opt, &t->model.layout, c->seed, t->gpu.stream);
        adamw_write_params(&t->opt, t->model.params, t->gpu.stream);
        zero_gather_params(&t->zero, t->opt.master, 0);
    }
}

static void trainer_free(Trainer *t) {
    cudaCheck(cudaFreeHost(t->host_inputs));
    cudaCheck(cudaFreeHost(t->host_targets));
    cudaCheck(cudaFreeHost(t->host_scalar));
    free(t->host_chunk);
    if (!t->c->generate) dataloader_close(&t->train_loader);
    if (t->have_val) dataloader_close(&t->val_loader);
    if (t->tokenizer) tokenizer_free(t->tokenizer);
    adamw_free(&t->opt);
    zero_free(&t->zero);
    op_timer_destroy(t->timer);
    model_free(&t->model);
    gpu_context_destroy(&t->gpu);
}

// One optimizer step: grad_accum micro-batches, the global norm, clipping, AdamW. Returns the
// mean training loss and leaves the gradient norm in *grad_norm. When either is NaN or inf the
// optimizer does not step (weights and moments stay as they were).
// When profiling, every op of the step is timed (validation and sampling are not: the model's
// timer is set only here).
static float train_step(Trainer *t, float lr, float *grad_norm) {
    LlamaModel *m = &t->model;
    cudaStream_t s = t->gpu.stream;
    int N = m->B * m->T;
    double loss_sum = 0.0;
    m->timer = t->timer;
    op_timer_mark(m->timer, NULL, s);
    Zero *z = &t->zero;
    long long step = t->state.step + 1;
    char what[96];  // the waits that may include collectives, named for the watchdog (coat/collectives.cuh)
    zero_step_begin(z);
    op_timer_mark(m->timer, "zero gradients", s);
    for (int micro = 0; micro < t->grad_accum; micro++) {
        load_batch(t, &t->train_loader);
        op_timer_mark(m->timer, "batch upload (after the host's wait)", s);
        zero_micro_batch(z, micro == t->grad_accum - 1);
        model_forward(&t->gpu, m, 1, 1.0f / ((float)N * t->grad_accum * t->comm->world));
        model_backward(&t->gpu, m);
        classifier_mean_loss(&t->gpu, m->mean_loss, m->losses, N);
        op_timer_mark(m->timer, "mean loss", s);
        cudaCheck(cudaMemcpyAsync(t->host_scalar, m->mean_loss, sizeof(float), cudaMemcpyDeviceToHost, s));
        snprintf(what, sizeof(what), "micro-batch %d of step %lld and its collectives", micro + 1, step);
        collectives_wait_stream(&t->zero.collectives, s, what);
        loss_sum += *t->host_scalar;
    }
    // Once the buckets' reduces are done, stage 0: every rank holds the gradient of the whole
    // global batch; stage 1: its parts of it, in its gradient shard; stage 2: their FP32 sum;
    // stage 3: the same, or with one micro-batch its BF16 shard.
    int ranks = t->comm->world, sharded = z->plan.shards > 1;
    bf16 *grads = zero_gradient_shard(z);
    const float *grad_sum = zero_gradient_sum(z);
    if (ranks > 1) {
        zero_gradients_done(z);
        op_timer_mark(m->timer, "wait for the gradient reduces", s);
    }
    if (grad_sum) grad_norm_squared(m->grad_norm_squared, grad_sum, t->opt.n, (double *)m->kernel_scratch, s);
    else grad_norm_squared(m->grad_norm_squared, grads, t->opt.n, (double *)m->kernel_scratch, s);
    op_timer_mark(m->timer, "gradient norm", s);
    cudaCheck(cudaMemcpyAsync(t->host_scalar, m->grad_norm_squared, sizeof(float), cudaMemcpyDeviceToHost, s));
    snprintf(what, sizeof(what), "the gradient reduces of step %lld", step);
    collectives_wait_stream(&t->zero.collectives, s, what);
    // The norm: of the shards' sums of squares (hybrid: one group's, each shard once). The stop votes ride along: every rank ends the
    // step with the same answer, so all stop at one step boundary or none does.
    double sums[3] = {loss_sum, stop_signal != 0 ? 1.0 : 0.0, zero_counts_in_norm(z) ? *t->host_scalar : 0.0};
    if (ranks > 1) {
        snprintf(what, sizeof(what), "the loss and norm all-reduce of step %lld", step);
        collectives_all_reduce_sum_f64(&t->zero.collectives, sums, sharded ? 3 : 2, s, what);
        sums[0] /= ranks;
    }
    t->stop_requested = sums[1] > 0;
    *grad_norm = sqrtf((float)sums[2]);
    float loss = (float)(sums[0] / t->grad_accum);
    if (isfinite(loss) && isfinite(*grad_norm)) {  // the same values on every rank: all step or none
        float scale = t->c->grad_clip > 0 ? grad_clip_factor(*grad_norm, t->c->grad_clip) : 1.0f;
        if (t->opt.amax) zero_weights_amax_reset(z);
        if (grad_sum) adamw_step_fp32_grads(&t->opt, m->params, grad_sum, lr, scale, s);
        else adamw_step(&t->opt, m->params, grads, lr, scale, s);
        op_timer_mark(m->timer, "adamw (after the host's wait)", s);
        zero_gather_params(z, t->opt.master, t->opt.amax != NULL);
        if (sharded) op_timer_mark(m->timer, "parameter gather (its transfer overlaps the next forward)", s);
        else if (m->precision.weights_from_master) op_timer_mark(m->timer, "fp8 cast of the weights (once per step)", s);
    }
    m->timer = NULL;
    return loss;
}

// The speed of light of train_step's ops on this GPU (the profile's last columns): the work of
// its micro-batches, the gradient buffer it zeroes, the part it norms and steps.
static void profile_speed_of_light(const Trainer *t, SolTable *table) {
    const LlamaModel *m = &t->model;
    const ZeroPlan *z = &t->zero.plan;
    SolRun run = sol_run_one_gpu(&m->shape, m->B, m->T, t->grad_accum, m->precision.fp8_gemms, m->precision.activations,
                                 t->opt.kind);
    run.zeroed_grad_bytes = zero_gradient_sum(&t->zero) ? 4 * z->shard_elems : 0;  // else written by the first micro-batch
    run.optimizer_elems = t->opt.n;
    run.fp32_grads = zero_gradient_sum(&t->zero) != NULL;
    run.casts_weights = m->precision.fp8_gemms && !t->zero.e4m3_gather;
    run.casts_from_master = m->precision.weights_from_master;
    run.weights_amax_in_step = t->opt.amax != NULL;
    run.casts_weight_transposes = run.casts_weights && m->fp8_weight_transposes != NULL;
    run.keeps_attention_out_t = m->attention_out_t != NULL;
    // as model_backward decides
    run.transposes_weights = m->precision.fp8_gemms && !model_fp8_weights_in_buckets(m) && !m->fp8_weight_transposes;
    run.params_written_elems = 0;
    for (int i = 0; i < t->opt.range_count; i++)
        if (adamw_part_has_params(&t->opt, i)) run.params_written_elems += t->opt.ranges[i].part;
    speed_of_light_table(table, &run);
}

static void log_validation(Trainer *t) {
    float val = validation_loss(t);
    printf("step %6lld | val loss %.4f\n", t->state.step, val);
    run_log_val(&t->log, t->state.step, val);
}

static void install_stop_handlers(void) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_handler = on_stop_signal;
    action.sa_flags = SA_RESTART;  // reads and writes under way go on
    sigemptyset(&action.sa_mask);
    int signals[3] = {SIGTERM, SIGINT, SIGUSR1};
    for (int i = 0; i < 3; i++)
        if (sigaction(signals[i], &action, NULL) != 0) fail("cannot install the handlers of SIGTERM, SIGINT and SIGUSR1");
}

// "1h02m", "3m07s", "42s": durations in the step line.
static const char *format_duration(double seconds, char *out, size_t size) {
    long long s = (long long)(seconds + 0.5);
    if (s >= 3600) snprintf(out, size, "%lldh%02lldm", s / 3600, s / 60 % 60);
    else if (s >= 60) snprintf(out, size, "%lldm%02llds", s / 60, s % 60);
    else snprintf(out, size, "%llds", s);
    return out;
}

// Rank 0, before the first step: removes what killed runs left half-written, then (overwrite)
// the earlier run, then opens the log. Returns the training time the log has recorded so far.
static double prepare_out_dir(Trainer *t) {
    const TrainConfig *c = t->c;
    char error[4400], earlier[256];
    int removed = run_dir_remove_temporaries(c->out_dir, error, sizeof(error));
    if (removed < 0) fail(error);
    if (removed > 0) printf("removed %d unfinished temporary file(s) from %s (an interrupted run's)\n", removed, c->out_dir);
    // Only now, with every input checked and the start checkpoint read, does overwrite remove anything.
    if (c->overwrite && !c->resume && run_dir_describe(c->out_dir, earlier, sizeof(earlier))) {
        if (run_dir_clear(c->out_dir, error, sizeof(error)) != 0) fail(error);
        printf("overwrite = 1: removed the earlier run in %s (%s)\n", c->out_dir, earlier);
    }
    double elapsed_s = 0.0;
    if (run_log_open(&t->log, c->out_dir, t->state.step, c->resume, &elapsed_s, error, sizeof(error)) != 0) fail(error);
    return elapsed_s;
}

// The step line and its log record: loss and rate, then time (since step 0, over resumes) and
// the estimate of what is left at this run's pace, and the tokens seen since step 0.
static void report_step(Trainer *t, float loss, float lr, float grad_norm, float ms, double elapsed_s, double remaining_s) {
    const TrainConfig *c = t->c;
    int ranks = t->comm->world;
    long long tokens_per_step = (long long)c->micro_batch_size * c->seq_len * ranks * t->grad_accum;
    double tokens_per_s = tokens_per_step / (ms / 1000.0);
    double mfu = tokens_per_s / ranks * t->flops_per_token / 989e12;
    size_t free_bytes, total_bytes;
    cudaCheck(cudaMemGetInfo(&free_bytes, &total_bytes));
    double mem = gib(total_bytes - free_bytes);
    char elapsed[32], left[32];
    printf("step %6lld/%d | loss %.4f | lr %.3e | norm %.3f | %.1f ms | %.0f tok/s | MFU %.1f%% | %.1f GiB | %s elapsed, %s "
           "left | %.4gM tokens\n", t->state.step, c->max_steps, loss, lr, grad_norm, ms, tokens_per_s, 100.0 * mfu, mem,
           format_duration(elapsed_s, elapsed, sizeof(elapsed)), format_duration(remaining_s, left, sizeof(left)),
           t->state.tokens_seen / 1e6);
    fflush(stdout);
    run_log_train(&t->log, t->state.step, loss, lr, grad_norm, ms, t->state.tokens_seen, tokens_per_s, mfu, mem, elapsed_s,
                  remaining_s);
}

// A step whose loss or norm is not finite was skipped; too many in a row end the run.
static void report_nonfinite_step(Trainer *t, float loss, float grad_norm, int in_a_row) {
    const TrainConfig *c = t->c;
    long long step = t->state.step;
    printf("step %6lld/%d | loss %g | norm %g: not finite, optimizer step skipped (%d in a row, max_nonfinite_steps %d)\n",
           step, c->max_steps, loss, grad_norm, in_a_row, c->max_nonfinite_steps);
    fflush(stdout);
    run_log_skipped(&t->log, step, loss, grad_norm);
    if (in_a_row < c->max_nonfinite_steps) return;
    fprintf(stderr, "error: step %lld: %d steps in a row with a non-finite loss or gradient norm (max_nonfinite_steps); "
                    "stopping, the newest checkpoint in %s is from before them\n", step, in_a_row, c->out_dir);
    exit(EXIT_FAILURE);
}

// The training steps from the checkpoint's (or 0) to max_steps; elapsed_s: the log's time so far.
// Returns 0, or EXIT_PREEMPTED when a stop signal ended the run early with a checkpoint.
static int train_loop(Trainer *t, double elapsed_s) {
    const TrainConfig *c = t->c;
    long long tokens_per_step = (long long)c->micro_batch_size * c->seq_len * t->comm->world * t->grad_accum;
    cudaEvent_t start, stop;
    char what[96];  // the wait for a step, named for the watchdog (coat/zero.cuh)
    cudaCheck(cudaEventCreate(&start));
    cudaCheck(cudaEventCreate(&stop));
    // Validation, samples and checkpoints come after the step they follow, so a run resumed from
    // a checkpoint repeats none of them.
    if (t->state.step == 0 && t->have_val && c->val_every > 0) log_validation(t);
    long long first_step = t->state.step + 1;
    int nonfinite_in_a_row = 0, preempted = 0;
    double started = monotonic_seconds(), clock_before = elapsed_s;
    while (t->state.step < c->max_steps && !preempted) {
        float lr = learning_rate_at(c, (int)t->state.step), grad_norm = 0.0f;
        cudaCheck(cudaEventRecord(start, t->gpu.stream));
        float loss = train_step(t, lr, &grad_norm);
        cudaCheck(cudaEventRecord(stop, t->gpu.stream));
        snprintf(what, sizeof(what), "the optimizer of step %lld and the amax all-reduce after it", t->state.step + 1);
        collectives_wait_event(&t->zero.collectives, stop, what);
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, start, stop));
        long long step = ++t->state.step;
        op_timer_end_step(t->timer);
        if (step == first_step) op_timer_clear(t->timer);  // it chooses the GEMM algorithms
        t->state.tokens_seen += tokens_per_step;
        double this_run = monotonic_seconds() - started;
        elapsed_s = clock_before + this_run;
        if (!isfinite(loss) || !isfinite(grad_norm)) {
            report_nonfinite_step(t, loss, grad_norm, ++nonfinite_in_a_row);
        } else {
            nonfinite_in_a_row = 0;
            report_step(t, loss, lr, grad_norm, ms, elapsed_s, this_run / (step - first_step + 1) * (c->max_steps - step));
        }
        int last = step == c->max_steps;
        if (t->have_val && c->val_every > 0 && (step % c->val_every == 0 || last)) log_validation(t);
        if (samples_here(t) && c->sample_every > 0 && (step % c->sample_every == 0 || last)) print_sample(t);
        int saved = (last && c->checkpoint_final) || (c->checkpoint_every > 0 && step % c->checkpoint_every == 0);
        preempted = t->stop_requested && !last;
        if (saved || preempted) save_checkpoint(t);  // every rank: with sharded states each sends rank 0 its shard
    }
    if (preempted)
        printf("step %lld: stopped by %s with its checkpoint written (exit %d): resume = 1 continues the run\n",
               t->state.step, stop_signal ? strsignal(stop_signal) : "another rank's signal", EXIT_PREEMPTED);
    cudaCheck(cudaEventDestroy(start));
    cudaCheck(cudaEventDestroy(stop));
    return preempted ? EXIT_PREEMPTED : 0;
}

// Several ranks train one model, data-parallel: each reads its part of every global batch and
// the gradients are summed over the ranks. ZeRO stage 0: every rank steps the whole optimizer
// state; stage 1: each steps its part of every bucket (coat/zero.h) and the parameters are gathered
// after the step, under the next forward (zero_gather_params); stage 2: no rank holds the whole
// gradient either (backward's buckets are reduce-scattered as they are done); stage 3: nor all of the
// layers' working weights (each bucket of layers is gathered before the forward and the backward
// read it, coat/zero.cuh). Rank 0 alone writes the log,
// the samples and the checkpoints (any world size resumes from them).
static int train(ConfigParser *parser, const Comm *comm) {
    const TrainConfig *c = &parser->values;
    char error[1024];
    int ranks = comm->world, rank0 = comm->rank == 0;
    if (rank0 && c->world_size > 0 && c->world_size != ranks)
        fprintf(stderr, "warning: %s: world_size %d plans dry runs only: this run trains on the %d rank(s) launched\n",
                config_source(parser, "world_size"), c->world_size, ranks);
    validate_run(parser, ranks, comm->launch, 0);
    agree_check(NULL, 0);  // every rank passed the checks that need no GPU (coat/agree.h)
    if (rank0 && make_directories(c->out_dir, error, sizeof(error)) != 0) {
        fprintf(stderr, "%s\n", error);
        return EXIT_FAILURE;
    }
    agree_out_dir(c->out_dir);
    agree_end();
    char groups[96] = "";
    if (c->shard_group > 0 && c->shard_group < ranks)
        snprintf(groups, sizeof(groups), ", sharded within %d groups of %d ranks", ranks / c->shard_group, c->shard_group);
    if (ranks > 1)
        printf("ranks: %d (comm_backend %s, ZeRO stage %d%s%s)\n", ranks, c->comm_backend == COMM_MPI ? "mpi" : "nccl",
               c->zero_stage, groups, c->zero_stage == 0 ? "" : config_param_gather(c) == GATHER_E4M3 ? ", parameters gathered in e4m3"
                                                                                                 : ", parameters gathered in bf16");
    print_model_summary(c);
    MemoryPlan plan;
    memory_plan_compute(&plan, c, ranks, c->micro_batch_size);
    memory_plan_print(stdout, &plan, c);
    print_activation_table(c);
    Trainer *t = (Trainer *)malloc(sizeof(Trainer));
    if (!t) fail("out of host memory");
    trainer_create(t, parser, comm);
    int status = 0;
    if (c->generate) {
        if (samples_here(t)) print_sample(t);
    } else {
        double elapsed_s = rank0 ? prepare_out_dir(t) : 0.0;
        install_stop_handlers();
        status = train_loop(t, elapsed_s);
        run_log_close(&t->log);
        if (t->timer) {
            SolTable sol;
            profile_speed_of_light(t, &sol);
            op_timer_print(stdout, t->timer, &sol);
        }
    }
    trainer_free(t);
    free(t);
    return status;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);  // progress reaches a log file line by line, as under a scheduler or nohup
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        config_print_help(stdout);
        return 0;
    }
    if (argc < 2 || strncmp(argv[1], "--", 2) == 0) {
        fprintf(stderr, "usage: train_llama CONFIG [--key=value ...]   (train_llama --help lists the keys)\n");
        return EXIT_CONFIG_ERROR;
    }
    ConfigParser *parser = (ConfigParser *)malloc(sizeof(ConfigParser));
    if (!parser) fail("out of host memory");
    // MPI ranks join before reading the config, so that an error every rank hits is printed
    // once, by rank 0; the others exit with its code (coat/agree.h). Launch errors print everywhere.
    Comm comm;
    char error[512];
    if (comm_init(&comm, &argc, &argv, error, sizeof(error)) != 0) fail(error);
    agree_begin(&comm);
    load_config_or_exit(parser, argc, argv);
    // Rank 0 alone prints: the others' progress lines would repeat its own.
    if (comm.rank > 0 && freopen("/dev/null", "w", stdout) == NULL) fail("cannot silence stdout");
    // Ranks started without MPI meet now (dry_run: each checks alone); then every rank compares its config with rank 0's.
    if (!parser->values.dry_run &&
        comm_meet(&comm, parser->values.out_dir, parser->values.collective_timeout_s, error, sizeof(error)) != 0)
        fail(error);
    agree_begin(&comm);
    agree_check(parser, 0);
    int status;
    if (parser->values.dry_run) {
        // dry_run plans world_size ranks, or those launched (mpirun -np N ... --dry_run=1: rank 0
        // prints the plan, every rank checks its inputs).
        status = dry_run(parser, parser->values.world_size > 0 ? parser->values.world_size : comm.world, comm.launch);
        agree_check(NULL, status);
        agree_end();
    } else {
        status = train(parser, &comm);
    }
    if (status == 0) comm_finish(&comm);  // a failing rank leaves MPI up: its exit reports to the others (coat/agree.h)
    free(parser);
    return status;
}
