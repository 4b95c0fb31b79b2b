// Batches of token sequences for the trainer, read from the shards (dataloader/shard.h) that a
// glob(3) pattern names, in path order.
//   A batch is B rows of T+1 consecutive tokens, B*(T+1) tokens contiguous in one shard:
//   inputs[b*T + t] = row_b[t], targets[b*T + t] = row_b[t + 1], both int32, B*T each.
//   A shard of N tokens holds floor(N / (B*(T+1))) batches; the tokens after the last are unused.
// Order: step k of a shard gives rank r (of W) batch order[k*W + r], so the ranks read disjoint
// batches; a shard gives floor(batches / W) steps and its last batches % W are left out that epoch.
// Training (shuffle = 1): each epoch permutes the shard order, and each shard's batch order, from
// (seed, epoch, shard): only the seed, the epoch, the shards' sizes, B, T and W decide the order.
// Validation (shuffle = 0): shards in path order, batches in file order, the same on every run.
// The position (epoch, shard index in the epoch's order, step within the shard) is the same on
// every rank; a checkpoint saves it and dataloader_set_position continues exactly from it.
// Functions that can fail return 0 or -1 and write "error: <path>: <what is wrong>" into the
// caller's buffer; shard_exit_on_error(status, error) is the thin wrapper that exits instead.
#pragma once
#include "shard.h"  // first: it selects the POSIX interfaces before any system header
#include <glob.h>
#include "../coat/random.h"

typedef struct {
    int64_t epoch;
    int64_t shard_index;  // index into this epoch's shard order
    int64_t step;         // steps already taken in that shard
} DataloaderPosition;

typedef struct {
    const char *pattern;  // glob(3) pattern, e.g. "data/corpus/llama2/train_*.bin"
    int batch_size;       // B
    int seq_len;          // T
    int rank;             // r in [0, W)
    int world_size;       // W
    int shuffle;          // 1 for training order, 0 for validation order
    uint64_t seed;        // decides the training order
} DataloaderConfig;

typedef struct {
    DataloaderConfig config;
    char *pattern;                 // a copy of config.pattern
    int64_t tokens_per_batch;      // B * (T + 1)
    int64_t shard_count;           // usable shards: those holding at least W batches
    int64_t skipped_shard_count;   // shards matched by the pattern but too small
    char **shard_paths;            // [shard_count], in path order
    int64_t *shard_token_counts;   // [shard_count], as validated at open
    int64_t *shard_steps;          // [shard_count] floor(batches / W)
    int64_t *shard_order;          // [shard_count] this epoch's order of shard ids
    int64_t shard_order_epoch;     // the epoch shard_order belongs to, -1 for none
    int64_t *batch_order;          // batch ids of the current shard in reading order
    int64_t batch_order_epoch;     // the (epoch, shard id) batch_order belongs to
    int64_t batch_order_shard;
    Shard open_shard;              // the shard being read; open_shard.file is NULL when none
    int64_t open_shard_id;
    int32_t *rows;                 // [B * (T + 1)] tokens of one batch
    DataloaderPosition position;
} Dataloader;

// Derives an independent random stream for (seed, epoch, shard) by chaining SplitMix64 steps.
static inline uint64_t dataloader_stream_seed(uint64_t seed, int64_t epoch, int64_t shard) {
    Random mixer;
    random_seed(&mixer, seed);
    random_seed(&mixer, random_u64(&mixer) ^ (uint64_t)epoch);
    random_seed(&mixer, random_u64(&mixer) ^ (uint64_t)(shard + 1));  // shard -1 is the shard order
    return random_u64(&mixer);
}

// Fills order with 0..n-1, shuffled by Fisher-Yates from stream_seed when shuffle is set.
static inline void dataloader_permutation(int64_t *order, int64_t n, int shuffle, uint64_t stream_seed) {
    for (int64_t i = 0; i < n; i++) order[i] = i;
    if (!shuffle) return;
    Random rng;
    random_seed(&rng, stream_seed);
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)random_below(&rng, (uint64_t)i + 1);
        int64_t swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
}

static inline void dataloader_prepare_shard_order(Dataloader *loader, int64_t epoch) {
    if (loader->shard_order_epoch == epoch) return;
    dataloader_permutation(loader->shard_order, loader->shard_count, loader->config.shuffle,
                           dataloader_stream_seed(loader->config.seed, epoch, -1));
    loader->shard_order_epoch = epoch;
}

static inline void dataloader_prepare_batch_order(Dataloader *loader, int64_t epoch, int64_t shard) {
    if (loader->batch_order_epoch == epoch && loader->batch_order_shard == shard) return;
    int64_t batches = loader->shard_token_counts[shard] / loader->tokens_per_batch;
    dataloader_permutation(loader->batch_order, batches, loader->config.shuffle,
                           dataloader_stream_seed(loader->config.seed, epoch, shard));
    loader->batch_order_epoch = epoch;
    loader->batch_order_shard = shard;
}

static inline void dataloader_close(Dataloader *loader) {
    shard_close(&loader->open_shard);
    for (int64_t i = 0; loader->shard_paths && i < loader->shard_count; i++) free(loader->shard_paths[i]);
    free(loader->shard_paths);
    free(loader->shard_token_counts);
    free(loader->shard_steps);
    free(loader->shard_order);
    free(loader->batch_order);
    free(loader->rows);
    free(loader->pattern);
    memset(loader, 0, sizeof(*loader));
}

// Keeps a validated shard when it holds at least one step (W batches); warns about it otherwise.
static inline int dataloader_add_shard(Dataloader *loader, const Shard *shard, int64_t *max_batches) {
    int64_t batches = shard->token_count / loader->tokens_per_batch;
    int world_size = loader->config.world_size;
    if (batches < world_size) {
        if (loader->config.rank == 0)
            fprintf(stderr, "warning: %s: skipped: %lld tokens hold %lld batches of %d x %d tokens, fewer than "
                    "the %d ranks need\n", shard->path, (long long)shard->token_count, (long long)batches,
                    loader->config.batch_size, loader->config.seq_len + 1, world_size);
        loader->skipped_shard_count++;
        return 0;
    }
    int64_t id = loader->shard_count;
    loader->shard_paths[id] = shard_copy_string(shard->path);
    if (!loader->shard_paths[id]) return -1;
    loader->shard_token_counts[id] = shard->token_count;
    loader->shard_steps[id] = batches / world_size;
    if (batches > *max_batches) *max_batches = batches;
    loader->shard_count++;
    return 0;
}

// Finds the shards, validates each header and size, and positions the loader at the start.
static inline int dataloader_open(Dataloader *loader, const DataloaderConfig *config, char *error,
                                  size_t error_size) {
    memset(loader, 0, sizeof(*loader));
    loader->config = *config;
    loader->shard_order_epoch = loader->batch_order_epoch = loader->open_shard_id = -1;
    const char *pattern = config->pattern;
    if (config->batch_size <= 0 || config->seq_len <= 0 || config->world_size <= 0 || config->rank < 0 ||
        config->rank >= config->world_size)
        return shard_fail(error, error_size, pattern, "invalid loader settings: B %d, T %d, rank %d of %d",
                          config->batch_size, config->seq_len, config->rank, config->world_size);
    loader->tokens_per_batch = (int64_t)config->batch_size * ((int64_t)config->seq_len + 1);
    glob_t matches;
    int glob_status = glob(pattern, GLOB_ERR, NULL, &matches);
    if (glob_status == GLOB_NOMATCH) return shard_fail(error, error_size, pattern, "no file matches");
    if (glob_status != 0) return shard_fail(error, error_size, pattern, "cannot list the matching files");
    size_t count = matches.gl_pathc;
    loader->pattern = shard_copy_string(pattern);
    loader->shard_paths = (char **)calloc(count, sizeof(char *));
    loader->shard_token_counts = (int64_t *)calloc(count, sizeof(int64_t));
    loader->shard_steps = (int64_t *)calloc(count, sizeof(int64_t));
    loader->shard_order = (int64_t *)calloc(count, sizeof(int64_t));
    loader->rows = (int32_t *)malloc((size_t)loader->tokens_per_batch * sizeof(int32_t));
    int status = 0;
    if (!loader->pattern || !loader->shard_paths || !loader->shard_token_counts || !loader->shard_steps ||
        !loader->shard_order || !loader->rows)
        status = shard_fail(error, error_size, pattern, "out of memory");
    int64_t max_batches = 0, max_tokens = 0;
    for (size_t i = 0; i < count && status == 0; i++) {
        Shard shard;
        status = shard_open(matches.gl_pathv[i], &shard, error, error_size);
        if (status != 0) break;
        if (shard.token_count > max_tokens) max_tokens = shard.token_count;
        if (dataloader_add_shard(loader, &shard, &max_batches) != 0)
            status = shard_fail(error, error_size, shard.path, "out of memory");
        shard_close(&shard);
    }
    globfree(&matches);
    if (status == 0 && loader->shard_count == 0)
        status = shard_fail(error, error_size, pattern,
                            "no shard holds %d batches of %d x %d tokens (the largest has %lld tokens)",
                            config->world_size, config->batch_size, config->seq_len + 1, (long long)max_tokens);
    if (status == 0) {
        loader->batch_order = (int64_t *)malloc((size_t)max_batches * sizeof(int64_t));
        if (!loader->batch_order) status = shard_fail(error, error_size, pattern, "out of memory");
    }
    if (status != 0) dataloader_close(loader);
    return status;
}

// Steps (batches per rank) in one epoch.
static inline int64_t dataloader_steps_per_epoch(const Dataloader *loader) {
    int64_t steps = 0;
    for (int64_t i = 0; i < loader->shard_count; i++) steps += loader->shard_steps[i];
    return steps;
}

static inline DataloaderPosition dataloader_position(const Dataloader *loader) { return loader->position; }

// Continues from a saved position; an error when it lies outside this data.
static inline int dataloader_set_position(Dataloader *loader, DataloaderPosition position, char *error,
                                          size_t error_size) {
    if (position.epoch < 0 || position.shard_index < 0 || position.shard_index >= loader->shard_count ||
        position.step < 0)
        return shard_fail(error, error_size, loader->pattern,
                          "position (epoch %lld, shard %lld, step %lld) is outside these %lld shards",
                          (long long)position.epoch, (long long)position.shard_index, (long long)position.step,
                          (long long)loader->shard_count);
    dataloader_prepare_shard_order(loader, position.epoch);
    int64_t shard = loader->shard_order[position.shard_index];
    if (position.step >= loader->shard_steps[shard])
        return shard_fail(error, error_size, loader->shard_paths[shard],
                          "position step %lld is past the %lld steps of this shard", (long long)position.step,
                          (long long)loader->shard_steps[shard]);
    loader->position = position;
    return 0;
}

// Back to the first batch of epoch 0 (validation runs call this before each evaluation).
static inline void dataloader_reset(Dataloader *loader) {
    DataloaderPosition start = {0, 0, 0};
    loader->position = start;
}

// Opens shard id for reading unless it is open; checks that it still has the size seen at open.
static inline int dataloader_open_shard(Dataloader *loader, int64_t shard, char *error, size_t error_size) {
    if (loader->open_shard_id == shard) return 0;
    shard_close(&loader->open_shard);
    loader->open_shard_id = -1;
    if (shard_open(loader->shard_paths[shard], &loader->open_shard, error, error_size) != 0) return -1;
    if (loader->open_shard.token_count != loader->shard_token_counts[shard]) {
        int status = shard_fail(error, error_size, loader->shard_paths[shard],
                                "changed while in use: %lld tokens, %lld when the loader opened it",
                                (long long)loader->open_shard.token_count,
                                (long long)loader->shard_token_counts[shard]);
        shard_close(&loader->open_shard);
        return status;
    }
    loader->open_shard_id = shard;
    return 0;
}

// Reads this rank's next batch into inputs and targets (B*T int32 each) and advances the position.
static inline int dataloader_next_batch(Dataloader *loader, int *inputs, int *targets, char *error,
                                        size_t error_size) {
    DataloaderPosition *position = &loader->position;
    dataloader_prepare_shard_order(loader, position->epoch);
    int64_t shard = loader->shard_order[position->shard_index];
    dataloader_prepare_batch_order(loader, position->epoch, shard);
    int64_t batch = loader->batch_order[position->step * loader->config.world_size + loader->config.rank];
    if (dataloader_open_shard(loader, shard, error, error_size) != 0) return -1;
    if (shard_read_tokens(&loader->open_shard, batch * loader->tokens_per_batch, loader->tokens_per_batch,
                          loader->rows, error, error_size) != 0)
        return -1;
    int batch_size = loader->config.batch_size, seq_len = loader->config.seq_len;
    for (int b = 0; b < batch_size; b++) {
        const int32_t *row = loader->rows + (int64_t)b * (seq_len + 1);
        memcpy(inputs + (int64_t)b * seq_len, row, (size_t)seq_len * sizeof(int));
        memcpy(targets + (int64_t)b * seq_len, row + 1, (size_t)seq_len * sizeof(int));
    }
    if (++position->step == loader->shard_steps[shard]) {
        position->step = 0;
        if (++position->shard_index == loader->shard_count) {
            position->shard_index = 0;
            position->epoch++;
        }
    }
    return 0;
}

// Checks every token of every usable shard against the vocabulary (a full read: the trainer's
// dry run calls it).
static inline int dataloader_validate_tokens(Dataloader *loader, int64_t vocab_size, char *error,
                                             size_t error_size) {
    for (int64_t shard = 0; shard < loader->shard_count; shard++) {
        if (dataloader_open_shard(loader, shard, error, error_size) != 0) return -1;
        if (shard_validate_tokens(&loader->open_shard, vocab_size, error, error_size) != 0) return -1;
    }
    return 0;
}
