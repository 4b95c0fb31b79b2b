// Tests dataloader/shard.h and dataloader/dataloader.h on small shards in a temporary directory:
// the llm.c file format (uint16 and uint32), each validation error, disjoint and complete batches
// across ranks, the seeded order, exact resume from a saved position, the fixed validation order.
// Shard tokens encode where they sit, token = shard * 2^20 + position, so that every batch read
// says which shard and offset it came from.
#define _POSIX_C_SOURCE 200809L
#include "../dataloader/dataloader.h"
#include "check.h"

enum { MAX_TEST_FILES = 64, POSITION_BITS = 20 };

static char temp_dir[64];
static char *test_files[MAX_TEST_FILES];
static int test_file_count;

// Returns "<temp_dir>/<name>" and remembers it for the clean-up.
static const char *temp_path(const char *name) {
    char path[256];
    snprintf(path, sizeof(path), "%s/%s", temp_dir, name);
    for (int i = 0; i < test_file_count; i++)
        if (strcmp(test_files[i], path) == 0) return test_files[i];
    if (test_file_count == MAX_TEST_FILES) {
        fprintf(stderr, "error: too many test files\n");
        exit(EXIT_FAILURE);
    }
    test_files[test_file_count] = shard_copy_string(path);
    return test_files[test_file_count++];
}

static void remove_test_files(void) {
    for (int i = 0; i < test_file_count; i++) {
        remove(test_files[i]);
        free(test_files[i]);
    }
    rmdir(temp_dir);
}

static void write_bytes(const char *path, const void *bytes, size_t size) {
    FILE *file = fopen(path, "wb");
    if (!file || fwrite(bytes, 1, size, file) != size || fclose(file) != 0) {
        fprintf(stderr, "error: %s: cannot write\n", path);
        exit(EXIT_FAILURE);
    }
}

// Reads a whole file into a malloc'd buffer.
static unsigned char *read_bytes(const char *path, size_t *size) {
    FILE *file = fopen(path, "rb");
    if (!file || fseeko(file, 0, SEEK_END) != 0) {
        fprintf(stderr, "error: %s: cannot open\n", path);
        exit(EXIT_FAILURE);
    }
    *size = (size_t)ftello(file);
    unsigned char *bytes = (unsigned char *)malloc(*size + 1);
    rewind(file);
    if (!bytes || fread(bytes, 1, *size, file) != *size) {
        fprintf(stderr, "error: %s: cannot read\n", path);
        exit(EXIT_FAILURE);
    }
    fclose(file);
    return bytes;
}

static void write_shard_or_exit(const char *path, const uint32_t *tokens, int64_t count, int token_bytes) {
    char error[SHARD_ERROR_SIZE];
    shard_exit_on_error(shard_write(path, tokens, count, token_bytes, error, sizeof(error)), error);
}

// A uint32 shard whose tokens record (shard, position).
static void write_position_shard(const char *path, int shard, int64_t count) {
    uint32_t *tokens = (uint32_t *)malloc((size_t)count * sizeof(uint32_t));
    for (int64_t i = 0; i < count; i++) tokens[i] = ((uint32_t)shard << POSITION_BITS) | (uint32_t)i;
    write_shard_or_exit(path, tokens, count, 4);
    free(tokens);
}

static int file_exists(const char *path) { return access(path, F_OK) == 0; }

// Expects status -1 and an error that starts with "error: <path>: " and contains what.
static void check_error(const char *name, int status, const char *error, const char *path, const char *what) {
    char prefix[512];
    snprintf(prefix, sizeof(prefix), "error: %s: ", path);
    int ok = status == -1 && strncmp(error, prefix, strlen(prefix)) == 0 && strstr(error, what) != NULL;
    check(ok, "%s: expected status -1 and \"%s...%s...\", got %d and \"%s\"", name, prefix, what, status,
          status ? error : "");
}

static void test_format(void) {
    check(shard_token_bytes_for_vocab(32000) == 2 && shard_token_bytes_for_vocab(65536) == 2 &&
              shard_token_bytes_for_vocab(65537) == 4 && shard_token_bytes_for_vocab(128256) == 4,
          "token size: uint16 for vocab <= 65536 (32000, 65536), uint32 above (65537, 128256)");
    const int64_t count = 5000;  // more than one conversion block of SHARD_TOKENS_PER_IO
    uint32_t *tokens = (uint32_t *)malloc(count * sizeof(uint32_t));
    int32_t *got = (int32_t *)malloc(count * sizeof(int32_t));
    char error[SHARD_ERROR_SIZE];
    for (int token_bytes = 2; token_bytes <= 4; token_bytes += 2) {
        uint32_t modulus = token_bytes == 2 ? 65536u : 128256u;
        for (int64_t i = 0; i < count; i++) tokens[i] = (uint32_t)((i * 7919 + 65535) % modulus);
        const char *path = temp_path(token_bytes == 2 ? "format16.bin" : "format32.bin");
        write_shard_or_exit(path, tokens, count, token_bytes);
        check(!file_exists(temp_path(token_bytes == 2 ? "format16.bin.tmp" : "format32.bin.tmp")),
              "uint%d: no temporary file is left after the write", token_bytes * 8);

        size_t size;
        unsigned char *bytes = read_bytes(path, &size);
        int expected_magic = token_bytes == 2 ? 20240520 : 20240801, expected_version = token_bytes == 2 ? 1 : 2;
        int32_t magic = (int32_t)shard_load_uint32_le(bytes), version = (int32_t)shard_load_uint32_le(bytes + 4);
        int32_t header_count = (int32_t)shard_load_uint32_le(bytes + 8);
        int rest_zero = 1;
        for (int i = 3; i < 256; i++) rest_zero &= shard_load_uint32_le(bytes + 4 * i) == 0;
        check(magic == expected_magic && version == expected_version && header_count == count && rest_zero,
              "uint%d llm.c header: expected magic %d version %d count %lld, rest zero; got %d %d %d%s",
              token_bytes * 8, expected_magic, expected_version, (long long)count, magic, version, header_count,
              rest_zero ? "" : ", rest not zero");
        check(size == (size_t)(1024 + count * token_bytes), "uint%d file size: expected %lld, got %zu",
              token_bytes * 8, (long long)(1024 + count * token_bytes), size);
        uint32_t raw_last = shard_load_token(bytes + 1024 + (count - 1) * token_bytes, token_bytes);
        check(raw_last == tokens[count - 1], "uint%d tokens are little-endian after the header: expected %u, got %u",
              token_bytes * 8, tokens[count - 1], raw_last);
        free(bytes);

        Shard shard;
        int status = shard_open(path, &shard, error, sizeof(error));
        check(status == 0 && shard.token_bytes == token_bytes && shard.token_count == count,
              "uint%d open: expected %d-byte tokens x %lld, got status %d, %d x %lld %s", token_bytes * 8,
              token_bytes, (long long)count, status, shard.token_bytes, (long long)shard.token_count,
              status ? error : "");
        if (status != 0) continue;
        int64_t first = 123, n = count - 200;
        status = shard_read_tokens(&shard, first, n, got, error, sizeof(error));
        int64_t mismatch = -1;
        for (int64_t i = 0; i < n && status == 0 && mismatch < 0; i++)
            if ((uint32_t)got[i] != tokens[first + i]) mismatch = i;
        check(status == 0 && mismatch < 0, "uint%d read tokens [123, %lld): %s (first mismatch at %lld)",
              token_bytes * 8, (long long)(first + n), status ? error : "read", (long long)mismatch);
        status = shard_read_tokens(&shard, count - 10, 11, got, error, sizeof(error));
        check_error("read past the end", status, error, path, "outside");
        status = shard_validate_tokens(&shard, modulus, error, sizeof(error));
        check(status == 0, "uint%d tokens all < vocab %u: %s", token_bytes * 8, modulus, status ? error : "ok");
        shard_close(&shard);
    }
    free(tokens);
    free(got);
}

// Every malformed shard gives its own error naming the file.
static void test_errors(void) {
    char error[SHARD_ERROR_SIZE];
    Shard shard;
    uint32_t tokens[16];
    for (int i = 0; i < 16; i++) tokens[i] = (uint32_t)(i * 100);
    const char *good = temp_path("good.bin");
    write_shard_or_exit(good, tokens, 16, 2);
    size_t size;
    unsigned char *bytes = read_bytes(good, &size);

    const char *missing = temp_path("missing.bin");
    check_error("missing file", shard_open(missing, &shard, error, sizeof(error)), error, missing, "cannot open");

    const char *truncated = temp_path("truncated.bin");
    write_bytes(truncated, bytes, 100);
    check_error("file shorter than the header", shard_open(truncated, &shard, error, sizeof(error)), error,
                truncated, "truncated: 100 bytes, shorter than the 1024-byte header");

    const char *wrong_magic = temp_path("wrong_magic.bin");
    unsigned char *copy = (unsigned char *)malloc(size);
    memcpy(copy, bytes, size);
    shard_store_int32_le(copy, 20240519);
    write_bytes(wrong_magic, copy, size);
    check_error("wrong magic", shard_open(wrong_magic, &shard, error, sizeof(error)), error, wrong_magic,
                "wrong magic 20240519");

    const char *wrong_version = temp_path("wrong_version.bin");
    memcpy(copy, bytes, size);
    shard_store_int32_le(copy + 4, 2);
    write_bytes(wrong_version, copy, size);
    check_error("version of uint32 with the uint16 magic", shard_open(wrong_version, &shard, error, sizeof(error)),
                error, wrong_version, "version 2 does not match magic 20240520");

    const char *cut = temp_path("cut.bin");
    write_bytes(cut, bytes, size - 2);
    check_error("one token missing", shard_open(cut, &shard, error, sizeof(error)), error, cut,
                "size mismatch: file has 1054 bytes, the header promises 1056");

    const char *longer = temp_path("longer.bin");
    unsigned char *extended = (unsigned char *)calloc(size + 3, 1);
    memcpy(extended, bytes, size);
    write_bytes(longer, extended, size + 3);
    check_error("trailing bytes", shard_open(longer, &shard, error, sizeof(error)), error, longer,
                "size mismatch: file has 1059 bytes");

    int status = shard_open(good, &shard, error, sizeof(error));
    if (status == 0) {
        status = shard_validate_tokens(&shard, 1000, error, sizeof(error));
        check_error("token id >= vocab", status, error, good, "token id 1000 >= vocab_size 1000 at position 10");
        shard_close(&shard);
    } else {
        check(0, "open %s: %s", good, error);
    }

    const uint32_t too_big = 70000;
    const char *overflow = temp_path("overflow.bin");
    status = shard_write(overflow, &too_big, 1, 2, error, sizeof(error));
    check_error("id 70000 in a uint16 shard", status, error, overflow, "token id 70000 does not fit");
    check(!file_exists(overflow) && !file_exists(temp_path("overflow.bin.tmp")),
          "a failed write leaves neither the shard nor its temporary file");

    ShardWriter writer;
    const char *aborted = temp_path("aborted.bin");
    status = shard_writer_open(&writer, aborted, 2, error, sizeof(error));
    if (status == 0) status = shard_writer_append(&writer, tokens, 16, error, sizeof(error));
    int temp_seen = file_exists(temp_path("aborted.bin.tmp")), final_seen_early = file_exists(aborted);
    if (status == 0) shard_writer_abort(&writer);
    check(status == 0 && temp_seen && !final_seen_early && !file_exists(aborted) &&
              !file_exists(temp_path("aborted.bin.tmp")),
          "a writer shows no shard before close, and abort removes its temporary file");
    free(bytes);
    free(copy);
    free(extended);
}

typedef struct {
    int shard;
    int64_t first_position;
} BatchId;

// Reads one batch, checks that its rows are T+1 consecutive tokens of one shard, and names it.
static int read_batch(Dataloader *loader, int *inputs, int *targets, BatchId *id, int *rows_ok) {
    char error[SHARD_ERROR_SIZE];
    if (dataloader_next_batch(loader, inputs, targets, error, sizeof(error)) != 0) {
        check(0, "next batch: %s", error);
        return -1;
    }
    int B = loader->config.batch_size, T = loader->config.seq_len;
    id->shard = inputs[0] >> POSITION_BITS;
    id->first_position = inputs[0] & ((1 << POSITION_BITS) - 1);
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            int64_t expected = ((int64_t)id->shard << POSITION_BITS) + id->first_position + (int64_t)b * (T + 1) + t;
            if (inputs[b * T + t] != expected || targets[b * T + t] != expected + 1) *rows_ok = 0;
        }
    if (id->first_position % loader->tokens_per_batch != 0) *rows_ok = 0;
    return 0;
}

static int open_loader(Dataloader *loader, const char *pattern, int B, int T, int rank, int world, int shuffle,
                       uint64_t seed) {
    DataloaderConfig config;
    config.pattern = pattern;
    config.batch_size = B;
    config.seq_len = T;
    config.rank = rank;
    config.world_size = world;
    config.shuffle = shuffle;
    config.seed = seed;
    char error[SHARD_ERROR_SIZE];
    int status = dataloader_open(loader, &config, error, sizeof(error));
    if (status != 0) check(0, "open loader %s: %s", pattern, error);
    return status;
}

// Reads n batches and records them; returns 0 when all reads succeeded.
static int read_sequence(Dataloader *loader, int n, BatchId *ids, int *rows_ok) {
    int B = loader->config.batch_size, T = loader->config.seq_len;
    int *inputs = (int *)malloc((size_t)B * T * sizeof(int)), *targets = (int *)malloc((size_t)B * T * sizeof(int));
    int status = 0;
    for (int i = 0; i < n && status == 0; i++) status = read_batch(loader, inputs, targets, &ids[i], rows_ok);
    free(inputs);
    free(targets);
    return status;
}

static int same_sequence(const BatchId *a, const BatchId *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i].shard != b[i].shard || a[i].first_position != b[i].first_position) return 0;
    return 1;
}

enum { B = 2, T = 7, WORLD = 3, BATCH_TOKENS = B * (T + 1) };
// Shard sizes in batches: 10, 7, 9 (plus some spare tokens), and one too small to hold W batches.
static const int shard_batches[] = {10, 7, 9};
#define SHARD_COUNT 3

static void write_loader_shards(void) {
    char name[64];
    for (int s = 0; s < SHARD_COUNT; s++) {
        snprintf(name, sizeof(name), "train_%06d.bin", s);
        write_position_shard(temp_path(name), s, (int64_t)shard_batches[s] * BATCH_TOKENS + 5);
    }
    write_position_shard(temp_path("train_000003.bin"), 3, 2 * BATCH_TOKENS);  // < WORLD batches
}

static void test_epoch_coverage(const char *pattern) {
    int64_t expected_steps = 0;
    for (int s = 0; s < SHARD_COUNT; s++) expected_steps += shard_batches[s] / WORLD;
    enum { MAX_STEPS = 64 };
    BatchId ids[WORLD][MAX_STEPS];
    int rows_ok = 1, status = 0;
    int64_t steps = 0, skipped = 0;
    DataloaderPosition end_position = {0, 0, 0};
    for (int rank = 0; rank < WORLD && status == 0; rank++) {
        Dataloader loader;
        if (open_loader(&loader, pattern, B, T, rank, WORLD, 1, 1234) != 0) return;
        steps = dataloader_steps_per_epoch(&loader);
        skipped = loader.skipped_shard_count;
        status = read_sequence(&loader, (int)steps, ids[rank], &rows_ok);
        end_position = dataloader_position(&loader);
        dataloader_close(&loader);
    }
    check(skipped == 1, "the shard with fewer than W batches is skipped: expected 1 skipped, got %lld",
          (long long)skipped);
    check(steps == expected_steps, "steps per epoch: expected %lld, got %lld", (long long)expected_steps,
          (long long)steps);
    if (status != 0 || steps != expected_steps) return;
    check(rows_ok, "every row is T+1 consecutive tokens, targets shifted by one, batches aligned to B*(T+1)");
    check(end_position.epoch == 1 && end_position.shard_index == 0 && end_position.step == 0,
          "after one epoch the position is (1, 0, 0): got (%lld, %lld, %lld)", (long long)end_position.epoch,
          (long long)end_position.shard_index, (long long)end_position.step);
    // Disjoint: no batch is read twice across ranks; complete: each shard gives floor(batches/W)*W.
    int seen[SHARD_COUNT + 1][16];
    memset(seen, 0, sizeof(seen));
    int duplicates = 0, per_shard[SHARD_COUNT + 1] = {0};
    for (int rank = 0; rank < WORLD; rank++)
        for (int64_t i = 0; i < steps; i++) {
            int shard = ids[rank][i].shard, batch = (int)(ids[rank][i].first_position / BATCH_TOKENS);
            if (seen[shard][batch]++) duplicates++;
            per_shard[shard]++;
        }
    check(duplicates == 0, "ranks read disjoint batches: %d batches read twice", duplicates);
    int complete = per_shard[SHARD_COUNT] == 0;
    for (int s = 0; s < SHARD_COUNT; s++) complete &= per_shard[s] == shard_batches[s] / WORLD * WORLD;
    check(complete, "the epoch covers floor(batches/W)*W batches of each shard: got %d, %d, %d (expected %d, %d, %d)",
          per_shard[0], per_shard[1], per_shard[2], shard_batches[0] / WORLD * WORLD,
          shard_batches[1] / WORLD * WORLD, shard_batches[2] / WORLD * WORLD);
    // In step k all ranks are in the same shard.
    int lock_step = 1;
    for (int64_t i = 0; i < steps; i++)
        for (int rank = 1; rank < WORLD; rank++) lock_step &= ids[rank][i].shard == ids[0][i].shard;
    check(lock_step, "at every step all ranks read from the same shard");
}

static void test_order(const char *pattern) {
    enum { STEPS = 8, LONG_RUN = 20 };
    BatchId first[LONG_RUN], again[LONG_RUN], other_seed[LONG_RUN];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 1, 42) != 0) return;
    int64_t epoch_steps = dataloader_steps_per_epoch(&loader);
    read_sequence(&loader, LONG_RUN, first, &rows_ok);
    dataloader_close(&loader);
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 1, 42) != 0) return;
    read_sequence(&loader, LONG_RUN, again, &rows_ok);
    dataloader_close(&loader);
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 1, 43) != 0) return;
    read_sequence(&loader, LONG_RUN, other_seed, &rows_ok);
    dataloader_close(&loader);
    check(same_sequence(first, again, LONG_RUN), "same seed, same order over %d steps", LONG_RUN);
    check(!same_sequence(first, other_seed, STEPS), "another seed gives another order");
    // Epoch 1 (steps epoch_steps..) is shuffled differently from epoch 0 but holds the same batches.
    int64_t shown = LONG_RUN - epoch_steps < epoch_steps ? LONG_RUN - epoch_steps : epoch_steps;
    check(shown > 0 && !same_sequence(first, first + epoch_steps, (int)shown),
          "epoch 1 starts in another order than epoch 0");

    // One shard, one rank: each epoch is a new permutation of the same 10 batches.
    char single[256];
    snprintf(single, sizeof(single), "%s/train_000000.bin", temp_dir);
    BatchId epochs[2 * 10];
    if (open_loader(&loader, single, B, T, 0, 1, 1, 42) != 0) return;
    read_sequence(&loader, 2 * 10, epochs, &rows_ok);
    dataloader_close(&loader);
    int same_set = 1;
    for (int i = 0; i < 10; i++) {
        int found = 0;
        for (int j = 10; j < 20; j++) found |= epochs[i].first_position == epochs[j].first_position;
        same_set &= found;
    }
    check(same_set && !same_sequence(epochs, epochs + 10, 10),
          "within a shard, epoch 1 reads the same batches as epoch 0 in another order");

    // Training order is not the file order: compare with the unshuffled loader of the same rank.
    BatchId plain[STEPS];
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 0, 42) != 0) return;
    read_sequence(&loader, STEPS, plain, &rows_ok);
    dataloader_close(&loader);
    check(!same_sequence(first, plain, STEPS), "shuffled order differs from the file order");
    check(rows_ok, "rows are consecutive tokens in every order");
}

// Saves the position after k batches, restores it into a fresh loader: the next batches match.
static void test_resume(const char *pattern) {
    enum { TOTAL = 40 };
    BatchId original[TOTAL];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
    int64_t epoch_steps = dataloader_steps_per_epoch(&loader);
    dataloader_close(&loader);
    const int save_points[] = {0, 1, 3, 5, (int)epoch_steps - 1, (int)epoch_steps, (int)epoch_steps + 4};
    for (size_t p = 0; p < sizeof(save_points) / sizeof(save_points[0]); p++) {
        int k = save_points[p];
        if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
        read_sequence(&loader, k, original, &rows_ok);
        DataloaderPosition saved = dataloader_position(&loader);
        read_sequence(&loader, TOTAL - k, original + k, &rows_ok);
        dataloader_close(&loader);

        Dataloader resumed;
        if (open_loader(&resumed, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
        char error[SHARD_ERROR_SIZE];
        int status = dataloader_set_position(&resumed, saved, error, sizeof(error));
        BatchId continued[TOTAL];
        if (status == 0) read_sequence(&resumed, TOTAL - k, continued, &rows_ok);
        dataloader_close(&resumed);
        check(status == 0 && same_sequence(original + k, continued, TOTAL - k),
              "resume after %d batches at (epoch %lld, shard %lld, step %lld): next %d batches equal %s", k,
              (long long)saved.epoch, (long long)saved.shard_index, (long long)saved.step, TOTAL - k,
              status ? error : "");
    }
    if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
    char error[SHARD_ERROR_SIZE];
    DataloaderPosition outside = {0, 0, 1000};
    int status = dataloader_set_position(&loader, outside, error, sizeof(error));
    check(status == -1 && strncmp(error, "error: ", 7) == 0 && strstr(error, "/train_00000") &&
              strstr(error, "step 1000 is past the"),
          "position past the shard's steps: expected an error naming the shard, got %d \"%s\"", status,
          status ? error : "");
    DataloaderPosition no_shard = {0, SHARD_COUNT, 0};
    check_error("position past the shards", dataloader_set_position(&loader, no_shard, error, sizeof(error)), error,
                pattern, "outside these 3 shards");
    dataloader_close(&loader);
}

// Validation: shards in path order, batches in file order, identical on every run and after reset.
static void test_validation(const char *pattern) {
    enum { K = 6 };
    BatchId first[K], second[K], after_reset[K];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 0, 1) != 0) return;
    read_sequence(&loader, K, first, &rows_ok);
    dataloader_reset(&loader);
    read_sequence(&loader, K, after_reset, &rows_ok);
    dataloader_close(&loader);
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 0, 999) != 0) return;
    read_sequence(&loader, K, second, &rows_ok);
    dataloader_close(&loader);
    // Rank 1 of 3 reads batches 1, 4, 7 of shard 0 (3 steps of 10 batches), then 1, 4 of shard 1 (2 of 7), ...
    const BatchId expected[K] = {{0, 1 * BATCH_TOKENS}, {0, 4 * BATCH_TOKENS}, {0, 7 * BATCH_TOKENS},
                                 {1, 1 * BATCH_TOKENS}, {1, 4 * BATCH_TOKENS}, {2, 1 * BATCH_TOKENS}};
    check(same_sequence(first, expected, K), "validation order is the file order: batch 3 expected shard 1 at %d, "
          "got shard %d at %lld", BATCH_TOKENS, first[3].shard, (long long)first[3].first_position);
    check(same_sequence(first, second, K) && same_sequence(first, after_reset, K),
          "validation batches are the same on every run (any seed) and after reset");
    check(rows_ok, "validation rows are consecutive tokens");
}

static void test_loader_errors(const char *pattern) {
    char error[SHARD_ERROR_SIZE];
    Dataloader loader;
    DataloaderConfig config = {pattern, B, T, 0, WORLD, 1, 1};
    char none[256];
    snprintf(none, sizeof(none), "%s/nothing_*.bin", temp_dir);
    config.pattern = none;
    check_error("no file matches", dataloader_open(&loader, &config, error, sizeof(error)), error, none,
                "no file matches");
    config.pattern = pattern;
    config.batch_size = 100;
    check_error("no shard holds a batch", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "no shard holds 3 batches of 100 x 8 tokens");
    config.batch_size = B;
    config.rank = WORLD;
    check_error("rank outside the world", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "invalid loader settings");

    char bad_pattern[256];
    snprintf(bad_pattern, sizeof(bad_pattern), "%s/*.bin", temp_dir);  // includes the malformed shards
    config.pattern = bad_pattern;
    config.rank = 0;
    check_error("a malformed shard among the matches", dataloader_open(&loader, &config, error, sizeof(error)),
                error, temp_path("cut.bin"), "size mismatch");

    config.pattern = pattern;
    if (dataloader_open(&loader, &config, error, sizeof(error)) != 0) {
        check(0, "open loader: %s", error);
        return;
    }
    int64_t vocab = 2 << POSITION_BITS;  // shard 2 holds ids from 2 << 20
    check_error("token range checked over all shards", dataloader_validate_tokens(&loader, vocab, error,
                sizeof(error)), error, temp_path("train_000002.bin"), "token id 2097152 >= vocab_size 2097152 at position 0");
    int status = dataloader_validate_tokens(&loader, 4 << POSITION_BITS, error, sizeof(error));
    check(status == 0, "all tokens below a large enough vocab: %s", status ? error : "ok");
    dataloader_close(&loader);
}

int main(void) {
    snprintf(temp_dir, sizeof(temp_dir), "/tmp/test_dataloader_XXXXXX");
    if (!mkdtemp(temp_dir)) {
        fprintf(stderr, "error: %s: cannot create the temporary directory\n", temp_dir);
        return EXIT_FAILURE;
    }
    test_format();
    test_errors();
    write_loader_shards();
    char pattern[256];
    snprintf(pattern, sizeof(pattern), "%s/train_*.bin", temp_dir);
    test_epoch_coverage(pattern);
    test_order(pattern);
    test_resume(pattern);
    test_validation(pattern);
    test_loader_errors(pattern);
    remove_test_files();
    return check_summary("test_dataloader");
}
