// Batches of token sequences for the trainer, read from the shards (dataloader/shard.h) that a
// glob(3) pattern names, in path order.
//   A batch is B rows of T+1 consecutive tokens of one shard:
//   inputs[b*T + t] = row_b[t], targets[b*T + t] = row_b[t + 1], both int32, B*T each.
// The loader orders units: a unit is a whole batch, B*(T+1) contiguous tokens (a shard of N
// tokens holds floor(N / (B*(T+1))) of them), or under DATALOADER_SHUFFLE_ROWS a single row
// (floor(N / (T+1)) per shard), and a batch is then B consecutive units of the order; the tokens
// after a shard's last unit are unused. Units have global ids: shard s holds ids
// [first_unit[s], first_unit[s+1]), in path order. Step k of an epoch gives rank r (of W) the
// batch k*W + r of the order, so the ranks read disjoint batches; an epoch has
// floor(total units / (W * units per batch)) steps and the order's last units are left out that
// epoch.
// Training (DATALOADER_SHUFFLE_BATCHES or _ROWS): order is a uniform permutation of ALL units of
// ALL shards, drawn per epoch from (seed, epoch): consecutive batches come from anywhere in the
// corpus, so shards of different content (code, prose) mix evenly instead of shifting the loss at
// each shard switch; with rows, so do the rows of one batch, which matters where neighbouring text
// is alike (a corpus not shuffled by document). Only the seed, the epoch, the shards' sizes, B, T,
// W and the unit decide the order. The permutation costs 8 bytes per unit and is drawn once per
// epoch.
// Validation (DATALOADER_IN_ORDER): order is the identity over whole batches, shards in path order
// and batches in file order, the same on every run.
// Shards are opened when first read; at most DATALOADER_MAX_OPEN_SHARDS stay open, the least
// recently read is closed first (with rows, one batch reads up to B shards: over more shards than
// that, its rows reopen files).
// The position (epoch, step within the epoch) is the same on every rank; a checkpoint saves it
// and dataloader_set_position continues exactly from it.
// Functions that can fail return 0 or -1 and write "error: <path>: <what is wrong>" into the
// caller's buffer; shard_exit_on_error(status, error) is the thin wrapper that exits instead.
#pragma once
#include "shard.h"  // first: it selects the POSIX interfaces before any system header
#include <glob.h>
#include "../coat/random.h"

enum { DATALOADER_MAX_OPEN_SHARDS = 16 };
enum { DATALOADER_IN_ORDER, DATALOADER_SHUFFLE_BATCHES, DATALOADER_SHUFFLE_ROWS };  // DataloaderConfig.shuffle

typedef struct {
    int64_t epoch;
    int64_t step;  // steps already taken in this epoch
} DataloaderPosition;

typedef struct {
    const char *pattern;  // glob(3) pattern, e.g. "data/corpus/llama2/train_*.bin"
    int batch_size;       // B
    int seq_len;          // T
    int rank;             // r in [0, W)
    int world_size;       // W
    int shuffle;          // DATALOADER_SHUFFLE_BATCHES or _ROWS for training, DATALOADER_IN_ORDER for validation
    uint64_t seed;        // decides the training order
    int64_t vocab_size;   // every token of a batch read must be below it (0: not checked)
} DataloaderConfig;

// One entry of the cache of open shard files.
typedef struct {
    Shard shard;        // shard.file is NULL when the entry is free
    int64_t shard_id;
    uint64_t last_use;  // the loader's use counter at the last read; 0 when free, so free entries go first
} DataloaderOpenShard;

typedef struct {
    DataloaderConfig config;
    char *pattern;                 // a copy of config.pattern
    int64_t tokens_per_batch;      // B * (T + 1)
    int64_t unit_tokens;           // tokens of one unit: B * (T + 1), or T + 1 when shuffling rows
    int64_t units_per_batch;       // 1, or B when shuffling rows
    int64_t shard_count;           // usable shards: those holding at least one unit
    int64_t skipped_shard_count;   // shards matched by the pattern but too small
    char **shard_paths;            // [shard_count], in path order
    int64_t *shard_token_counts;   // [shard_count], as validated at open
    int64_t *shard_first_unit;     // [shard_count + 1] global id of each shard's first unit; last = unit_count
    int64_t unit_count;            // units in all usable shards
    int64_t steps_per_epoch;       // floor(unit_count / (W * units_per_batch))
    int64_t *order;                // [unit_count] training: this epoch's order of global ids; NULL in validation
    int64_t order_epoch;           // the epoch order belongs to, -1 for none
    DataloaderOpenShard open_shards[DATALOADER_MAX_OPEN_SHARDS];
    uint64_t use_counter;
    int32_t *rows;                 // [B * (T + 1)] tokens of one batch
    DataloaderPosition position;
} Dataloader;

// Derives an independent random stream for (seed, epoch) by chaining SplitMix64 steps.
static inline uint64_t dataloader_stream_seed(uint64_t seed, int64_t epoch) {
    Random mixer;
    random_seed(&mixer, seed);
    random_seed(&mixer, random_u64(&mixer) ^ (uint64_t)epoch);
    return random_u64(&mixer);
}

// Draws the training order of an epoch (Fisher-Yates over all global unit ids) unless it is drawn.
static inline void dataloader_prepare_order(Dataloader *loader, int64_t epoch) {
    if (!loader->order || loader->order_epoch == epoch) return;
    int64_t *order = loader->order, n = loader->unit_count;
    for (int64_t i = 0; i < n; i++) order[i] = i;
    Random rng;
    random_seed(&rng, dataloader_stream_seed(loader->config.seed, epoch));
    for (int64_t i = n - 1; i > 0; i--) {
        int64_t j = (int64_t)random_below(&rng, (uint64_t)i + 1);
        int64_t swap = order[i];
        order[i] = order[j];
        order[j] = swap;
    }
    loader->order_epoch = epoch;
}

// The shard holding global unit id `unit`: the last shard whose first id is <= unit.
static inline int64_t dataloader_shard_of_unit(const Dataloader *loader, int64_t unit) {
    int64_t low = 0, high = loader->shard_count - 1;
    while (low < high) {
        int64_t middle = low + (high - low + 1) / 2;
        if (loader->shard_first_unit[middle] <= unit) low = middle;
        else high = middle - 1;
    }
    return low;
}

static inline void dataloader_close(Dataloader *loader) {
    for (int i = 0; i < DATALOADER_MAX_OPEN_SHARDS; i++) shard_close(&loader->open_shards[i].shard);
    for (int64_t i = 0; loader->shard_paths && i < loader->shard_count; i++) free(loader->shard_paths[i]);
    free(loader->shard_paths);
    free(loader->shard_token_counts);
    free(loader->shard_first_unit);
    free(loader->order);
    free(loader->rows);
    free(loader->pattern);
    memset(loader, 0, sizeof(*loader));
}

// Keeps a validated shard when it holds at least one unit; warns about it otherwise.
static inline int dataloader_add_shard(Dataloader *loader, const Shard *shard) {
    int64_t units = shard->token_count / loader->unit_tokens;
    if (units == 0) {
        if (loader->config.rank == 0)
            fprintf(stderr, "warning: %s: skipped: %lld tokens hold no %s of %d x %d tokens\n", shard->path,
                    (long long)shard->token_count, loader->units_per_batch == 1 ? "batch" : "row",
                    loader->units_per_batch == 1 ? loader->config.batch_size : 1, loader->config.seq_len + 1);
        loader->skipped_shard_count++;
        return 0;
    }
    int64_t id = loader->shard_count;
    loader->shard_paths[id] = shard_copy_string(shard->path);
    if (!loader->shard_paths[id]) return -1;
    loader->shard_token_counts[id] = shard->token_count;
    loader->shard_first_unit[id] = loader->unit_count;
    loader->unit_count += units;
    loader->shard_first_unit[id + 1] = loader->unit_count;
    loader->shard_count++;
    return 0;
}

// Finds the shards, validates each header and size, and positions the loader at the start.
static inline int dataloader_open(Dataloader *loader, const DataloaderConfig *config, char *error,
                                  size_t error_size) {
    memset(loader, 0, sizeof(*loader));
    loader->config = *config;
    loader->order_epoch = -1;
    const char *pattern = config->pattern;
    if (config->batch_size <= 0 || config->seq_len <= 0 || config->world_size <= 0 || config->rank < 0 ||
        config->rank >= config->world_size || config->shuffle < DATALOADER_IN_ORDER ||
        config->shuffle > DATALOADER_SHUFFLE_ROWS)
        return shard_fail(error, error_size, pattern, "invalid loader settings: B %d, T %d, rank %d of %d, shuffle %d",
                          config->batch_size, config->seq_len, config->rank, config->world_size, config->shuffle);
    loader->tokens_per_batch = (int64_t)config->batch_size * ((int64_t)config->seq_len + 1);
    loader->units_per_batch = config->shuffle == DATALOADER_SHUFFLE_ROWS ? config->batch_size : 1;
    loader->unit_tokens = loader->tokens_per_batch / loader->units_per_batch;
    glob_t matches;
    int glob_status = glob(pattern, GLOB_ERR, NULL, &matches);
    if (glob_status == GLOB_NOMATCH) return shard_fail(error, error_size, pattern, "no file matches");
    if (glob_status != 0) return shard_fail(error, error_size, pattern, "cannot list the matching files");
    size_t count = matches.gl_pathc;
    loader->pattern = shard_copy_string(pattern);
    loader->shard_paths = (char **)calloc(count, sizeof(char *));
    loader->shard_token_counts = (int64_t *)calloc(count, sizeof(int64_t));
    loader->shard_first_unit = (int64_t *)calloc(count + 1, sizeof(int64_t));
    loader->rows = (int32_t *)malloc((size_t)loader->tokens_per_batch * sizeof(int32_t));
    int status = 0;
    if (!loader->pattern || !loader->shard_paths || !loader->shard_token_counts || !loader->shard_first_unit ||
        !loader->rows)
        status = shard_fail(error, error_size, pattern, "out of memory");
    int64_t max_tokens = 0;
    for (size_t i = 0; i < count && status == 0; i++) {
        Shard shard;
        status = shard_open(matches.gl_pathv[i], &shard, error, error_size);
        if (status != 0) break;
        if (shard.token_count > max_tokens) max_tokens = shard.token_count;
        if (dataloader_add_shard(loader, &shard) != 0)
            status = shard_fail(error, error_size, shard.path, "out of memory");
        shard_close(&shard);
    }
    globfree(&matches);
    int rows = loader->units_per_batch > 1;
    if (status == 0 && loader->shard_count == 0)
        status = shard_fail(error, error_size, pattern,
                            "no shard holds a %s of %d x %d tokens (the largest has %lld tokens)", rows ? "row" : "batch",
                            rows ? 1 : config->batch_size, config->seq_len + 1, (long long)max_tokens);
    int64_t batches = loader->unit_count / loader->units_per_batch;
    if (status == 0 && batches < config->world_size)
        status = shard_fail(error, error_size, pattern,
                            "%lld shard(s) hold %lld batches of %d x %d tokens, fewer than the %d ranks need",
                            (long long)loader->shard_count, (long long)batches, config->batch_size,
                            config->seq_len + 1, config->world_size);
    loader->steps_per_epoch = batches / config->world_size;
    if (status == 0 && config->shuffle != DATALOADER_IN_ORDER) {
        loader->order = (int64_t *)malloc((size_t)loader->unit_count * sizeof(int64_t));
        if (!loader->order) status = shard_fail(error, error_size, pattern, "out of memory");
    }
    if (status != 0) dataloader_close(loader);
    return status;
}

// Steps (batches per rank) in one epoch.
static inline int64_t dataloader_steps_per_epoch(const Dataloader *loader) { return loader->steps_per_epoch; }

static inline DataloaderPosition dataloader_position(const Dataloader *loader) { return loader->position; }

// Continues from a saved position; an error when it lies outside this data.
static inline int dataloader_set_position(Dataloader *loader, DataloaderPosition position, char *error,
                                          size_t error_size) {
    if (position.epoch < 0 || position.step < 0 || position.step >= loader->steps_per_epoch)
        return shard_fail(error, error_size, loader->pattern,
                          "position (epoch %lld, step %lld) is outside these shards' %lld steps per epoch",
                          (long long)position.epoch, (long long)position.step,
                          (long long)loader->steps_per_epoch);
    loader->position = position;
    return 0;
}

// Returns shard id open for reading, from the cache or opened in place of the least recently read;
// checks that the file still has the size seen at open. NULL on an error.
static inline Shard *dataloader_open_shard(Dataloader *loader, int64_t shard, char *error, size_t error_size) {
    DataloaderOpenShard *slot = &loader->open_shards[0];
    for (int i = 0; i < DATALOADER_MAX_OPEN_SHARDS; i++) {
        DataloaderOpenShard *entry = &loader->open_shards[i];
        if (entry->shard.file && entry->shard_id == shard) {
            entry->last_use = ++loader->use_counter;
            return &entry->shard;
        }
        if (entry->last_use < slot->last_use) slot = entry;
    }
    shard_close(&slot->shard);
    slot->last_use = 0;
    if (shard_open(loader->shard_paths[shard], &slot->shard, error, error_size) != 0) return NULL;
    if (slot->shard.token_count != loader->shard_token_counts[shard]) {
        shard_fail(error, error_size, loader->shard_paths[shard],
                   "changed while in use: %lld tokens, %lld when the loader opened it",
                   (long long)slot->shard.token_count, (long long)loader->shard_token_counts[shard]);
        shard_close(&slot->shard);
        return NULL;
    }
    slot->shard_id = shard;
    slot->last_use = ++loader->use_counter;
    return &slot->shard;
}

// Reads this rank's next batch into inputs and targets (B*T int32 each) and advances the position;
// with config.vocab_size, a token at or past it is an error naming the shard and its position.
static inline int dataloader_next_batch(Dataloader *loader, int *inputs, int *targets, char *error,
                                        size_t error_size) {
    DataloaderPosition *position = &loader->position;
    dataloader_prepare_order(loader, position->epoch);
    int64_t first_index = (position->step * loader->config.world_size + loader->config.rank) * loader->units_per_batch;
    int64_t unit_tokens = loader->unit_tokens, vocab_size = loader->config.vocab_size;
    for (int64_t u = 0; u < loader->units_per_batch; u++) {
        int64_t index = first_index + u;
        int64_t unit = loader->order ? loader->order[index] : index;
        int64_t shard_id = dataloader_shard_of_unit(loader, unit);
        Shard *shard = dataloader_open_shard(loader, shard_id, error, error_size);
        if (!shard) return -1;
        int64_t first_token = (unit - loader->shard_first_unit[shard_id]) * unit_tokens;
        int32_t *tokens = loader->rows + u * unit_tokens;
        if (shard_read_tokens(shard, first_token, unit_tokens, tokens, error, error_size) != 0) return -1;
        // A damaged shard's id past the vocabulary would index the embedding out of bounds on the GPU.
        for (int64_t i = 0; vocab_size > 0 && i < unit_tokens; i++)
            if (tokens[i] < 0 || tokens[i] >= vocab_size)
                return shard_fail(error, error_size, shard->path, "token id %lld >= vocab_size %lld at position %lld",
                                  (long long)(uint32_t)tokens[i], (long long)vocab_size, (long long)(first_token + i));
    }
    int batch_size = loader->config.batch_size, seq_len = loader->config.seq_len;
    for (int b = 0; b < batch_size; b++) {
        const int32_t *row = loader->rows + (int64_t)b * (seq_len + 1);
        memcpy(inputs + (int64_t)b * seq_len, row, (size_t)seq_len * sizeof(int));
        memcpy(targets + (int64_t)b * seq_len, row + 1, (size_t)seq_len * sizeof(int));
    }
    if (++position->step == loader->steps_per_epoch) {
        position->step = 0;
        position->epoch++;
    }
    return 0;
}

// Checks every token of every usable shard against the vocabulary (a full read: the trainer's
// dry run calls it).
static inline int dataloader_validate_tokens(Dataloader *loader, int64_t vocab_size, char *error,
                                             size_t error_size) {
    for (int64_t shard_id = 0; shard_id < loader->shard_count; shard_id++) {
        Shard *shard = dataloader_open_shard(loader, shard_id, error, error_size);
        if (!shard) return -1;
        if (shard_validate_tokens(shard, vocab_size, error, error_size) != 0) return -1;
    }
    return 0;
}
