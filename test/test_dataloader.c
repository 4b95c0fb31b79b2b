// Tests dataloader/shard.h, dataloader/dataloader.h and dataloader/make_directories.h on small
// shards in a temporary directory: the llm.c file format (uint16 and uint32), each validation
// error, disjoint and complete batches across ranks, the seeded global order over all shards,
// exact resume from a saved position, the fixed validation order, the bounded cache of open
// files, read errors that name the file.
// Shard tokens encode where they sit, token = shard * 2^20 + position, so that every batch read
// says which shard and offset it came from.
#define _POSIX_C_SOURCE 200809L
#include "../dataloader/dataloader.h"
#include "../dataloader/make_directories.h"
#include "check.h"

enum { MAX_TEST_FILES = 128, POSITION_BITS = 20 };

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

    unsigned char header_only_bytes[SHARD_HEADER_BYTES];
    const char *missing = temp_path("missing.bin");
    check_error("missing file", shard_open(missing, &shard, error, sizeof(error)), error, missing, "cannot open");
    check_error("a directory as a shard", shard_open(temp_dir, &shard, error, sizeof(error)), error, temp_dir,
                "not a regular file (a directory)");
    check_error("/dev/zero as a shard", shard_open("/dev/zero", &shard, error, sizeof(error)), error, "/dev/zero",
                "not a regular file (a device or other special file)");
    const char *fifo = temp_path("fifo.bin");
    if (mkfifo(fifo, 0600) == 0) {
        check_error("a FIFO as a shard (refused without blocking)", shard_open(fifo, &shard, error, sizeof(error)), error,
                    fifo, "not a regular file (a FIFO)");
        remove(fifo);
    }

    const char *empty_file = temp_path("empty_file.bin");
    write_bytes(empty_file, bytes, 0);
    check_error("an empty file", shard_open(empty_file, &shard, error, sizeof(error)), error, empty_file,
                "truncated: 0 bytes, shorter than the 1024-byte header");
    const char *header_only = temp_path("header_only.bin");  // a valid shard of no tokens
    memcpy(header_only_bytes, bytes, SHARD_HEADER_BYTES);
    shard_store_int32_le(header_only_bytes + 8, 0);
    write_bytes(header_only, header_only_bytes, SHARD_HEADER_BYTES);
    int empty_status = shard_open(header_only, &shard, error, sizeof(error));
    check(empty_status == 0 && shard.token_count == 0, "a shard of 0 tokens (header only) opens: %s",
          empty_status ? error : "ok");
    if (empty_status == 0) shard_close(&shard);
    remove(empty_file);
    remove(header_only);

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

    // Every magic with every version: only 20240520 v1 (uint16) and 20240801 v2 (uint32) open.
    const int32_t magics[2] = {SHARD_MAGIC_UINT16, SHARD_MAGIC_UINT32};
    for (int m = 0; m < 2; m++)
        for (int32_t version = 0; version <= 3; version++) {
            const char *combo = temp_path("combo.bin");
            memcpy(copy, bytes, size);
            shard_store_int32_le(copy, (uint32_t)magics[m]);
            shard_store_int32_le(copy + 4, (uint32_t)version);
            size_t combo_size = size;
            if (magics[m] == SHARD_MAGIC_UINT32) {  // the same 16 tokens as uint32
                int32_t count = 16;
                combo_size = SHARD_HEADER_BYTES + 4 * (size_t)count;
                unsigned char *wide = (unsigned char *)calloc(combo_size, 1);
                memcpy(wide, copy, SHARD_HEADER_BYTES);
                for (int t = 0; t < count; t++)
                    shard_store_int32_le(wide + SHARD_HEADER_BYTES + 4 * t, shard_load_token(bytes + SHARD_HEADER_BYTES + 2 * t, 2));
                write_bytes(combo, wide, combo_size);
                free(wide);
            } else {
                write_bytes(combo, copy, combo_size);
            }
            int valid = (m == 0 && version == SHARD_VERSION_UINT16) || (m == 1 && version == SHARD_VERSION_UINT32);
            int status = shard_open(combo, &shard, error, sizeof(error));
            if (status == 0) shard_close(&shard);
            check(valid ? status == 0 : status != 0 && strstr(error, "does not match magic") != NULL,
                  "magic %d with version %d: %s (%s)", magics[m], version, valid ? "opens" : "refused",
                  status ? error : "opened");
        }
    remove(temp_path("combo.bin"));  // later tests glob the folder

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

// The edges of writing and reading: the largest uint16 id, the int32 count, a negative count in
// the header, reads of zero tokens and up to the last one, and reads that write exactly the
// tokens asked for.
static void test_shard_edges(void) {
    char error[SHARD_ERROR_SIZE];
    Shard shard;
    const uint32_t largest16[2] = {65535, 65536};
    const char *edge16 = temp_path("edge16.bin");
    int status = shard_write(edge16, largest16, 1, 2, error, sizeof(error));
    int32_t got = -1;
    if (status == 0 && shard_open(edge16, &shard, error, sizeof(error)) == 0) {
        status = shard_read_tokens(&shard, 0, 1, &got, error, sizeof(error));
        shard_close(&shard);
    }
    check(status == 0 && got == 65535, "id 65535 fits a uint16 shard and reads back (got %d; %s)", got,
          status ? error : "ok");
    remove(edge16);
    status = shard_write(edge16, largest16 + 1, 1, 2, error, sizeof(error));
    check_error("id 65536 in a uint16 shard", status, error, edge16, "token id 65536 does not fit a uint16 shard");

    // A writer that holds INT32_MAX - 1 tokens (the count set directly: 4 GB are not written for a
    // test) takes one more token, and refuses the next.
    ShardWriter writer;
    const char *full = temp_path("full.bin");
    const uint32_t one = 1;
    status = shard_writer_open(&writer, full, 2, error, sizeof(error));
    int last_status = -1, past_status = 0;
    if (status == 0) {
        writer.token_count = INT32_MAX - 1;
        last_status = shard_writer_append(&writer, &one, 1, error, sizeof(error));
        past_status = shard_writer_append(&writer, &one, 1, error, sizeof(error));
        shard_writer_abort(&writer);
    }
    check(status == 0 && last_status == 0, "token %d, the last an int32 count holds, is appended", INT32_MAX);
    check_error("token INT32_MAX + 1", past_status, error, full, "more than 2147483647 tokens do not fit the int32 header");

    // A header whose count is negative (a uint32 count past INT32_MAX read as int32).
    uint32_t tokens[8] = {0, 1, 2, 3, 4, 5, 6, 7};
    const char *negative = temp_path("negative.bin");
    write_shard_or_exit(negative, tokens, 8, 2);
    size_t size;
    unsigned char *bytes = read_bytes(negative, &size);
    shard_store_int32_le(bytes + 8, (uint32_t)-1);
    write_bytes(negative, bytes, size);
    free(bytes);
    check_error("a negative count in the header", shard_open(negative, &shard, error, sizeof(error)), error, negative,
                "negative token count -1 in the header");
    remove(negative);

    // Reads inside [0, count) succeed, ending at the last token or of no token at all; a read
    // writes exactly the tokens it was asked for, over several conversion blocks too.
    enum { COUNT = SHARD_TOKENS_PER_IO + 904, SENTINEL = -7 };
    uint32_t *many = (uint32_t *)malloc(COUNT * sizeof(uint32_t));
    int32_t *read = (int32_t *)malloc((COUNT + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < COUNT; i++) many[i] = (uint32_t)(i % 60000);
    for (int token_bytes = 2; token_bytes <= 4; token_bytes += 2) {
        const char *ranges = temp_path("ranges.bin");
        write_shard_or_exit(ranges, many, COUNT, token_bytes);
        if (shard_open(ranges, &shard, error, sizeof(error)) != 0) {
            check(0, "open %s: %s", ranges, error);
            continue;
        }
        int whole_ok = 1, empty_ok, last_ok;
        for (int64_t first = 0; first <= 1; first++) {
            for (int64_t i = 0; i <= COUNT; i++) read[i] = SENTINEL;
            status = shard_read_tokens(&shard, first, COUNT - first, read, error, sizeof(error));
            for (int64_t i = 0; i < COUNT - first && status == 0; i++) whole_ok &= read[i] == (int32_t)many[first + i];
            whole_ok &= status == 0 && read[COUNT - first] == SENTINEL;
        }
        read[0] = SENTINEL;
        empty_ok = shard_read_tokens(&shard, COUNT, 0, read, error, sizeof(error)) == 0 && read[0] == SENTINEL;
        last_ok = shard_read_tokens(&shard, COUNT - 1, 1, read, error, sizeof(error)) == 0 &&
                  read[0] == (int32_t)many[COUNT - 1];
        check(whole_ok, "uint%d: reads of tokens [0, %d) and [1, %d) fill exactly those, not one past", token_bytes * 8,
              COUNT, COUNT);
        check(empty_ok && last_ok, "uint%d: a read of no token at the end and of the last token succeed", token_bytes * 8);
        check_error("a read from a negative position", shard_read_tokens(&shard, -1, 1, read, error, sizeof(error)),
                    error, ranges, "tokens [-1, 0) are outside");
        check_error("a read of a negative count", shard_read_tokens(&shard, 2, -1, read, error, sizeof(error)), error,
                    ranges, "tokens [2, 1) are outside");
        shard_close(&shard);
        remove(ranges);
    }
    free(many);
    free(read);
}

// mkdir -p: creates the missing directories of a path, exactly those, and accepts existing ones;
// a path that is a file, or lies under one, is refused.
static void test_make_directories(void) {
    char error[SHARD_ERROR_SIZE], nested[256], prefix[256], under_file[256];
    snprintf(nested, sizeof(nested), "%s/abc/def/ghi", temp_dir);
    snprintf(prefix, sizeof(prefix), "%s/a", temp_dir);  // a prefix of "abc" that is no component
    int status = make_directories(nested, error, sizeof(error));
    struct stat info;
    check(status == 0 && stat(nested, &info) == 0 && S_ISDIR(info.st_mode), "the directories of %s are made (%s)", nested,
          status ? error : "ok");
    check(!file_exists(prefix), "no directory is made for a part of a name (%s)", prefix);
    status = make_directories(nested, error, sizeof(error));
    check(status == 0, "an existing directory is accepted (%s)", status ? error : "ok");
    const char *file = temp_path("plain_file");
    write_bytes(file, "x", 1);
    check_error("a file as the directory", make_directories(file, error, sizeof(error)), error, file,
                "not a directory");
    snprintf(under_file, sizeof(under_file), "%s/sub", file);
    check_error("a directory under a file", make_directories(under_file, error, sizeof(error)), error, under_file,
                "cannot create the directory");
    remove(file);
    rmdir(prefix);
    rmdir(nested);
    snprintf(nested, sizeof(nested), "%s/abc/def", temp_dir);
    rmdir(nested);
    snprintf(nested, sizeof(nested), "%s/abc", temp_dir);
    rmdir(nested);
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
    config.vocab_size = 0;
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

// Reads up to n batches and stops at the first error: returns its status, the message in error.
static int read_until_error(Dataloader *loader, int n, char *error, size_t error_size) {
    int B = loader->config.batch_size, T = loader->config.seq_len;
    int *inputs = (int *)malloc((size_t)B * T * sizeof(int)), *targets = (int *)malloc((size_t)B * T * sizeof(int));
    int status = 0;
    for (int i = 0; i < n && status == 0; i++) status = dataloader_next_batch(loader, inputs, targets, error, error_size);
    free(inputs);
    free(targets);
    return status;
}

static int same_sequence(const BatchId *a, const BatchId *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i].shard != b[i].shard || a[i].first_position != b[i].first_position) return 0;
    return 1;
}

// Counts how often each (shard, batch) was read: counts[shard * max_batches + batch]. Returns the
// number of ids outside [0, shard_count) x [0, shard_batches[shard]).
static int count_batches(const BatchId *ids, int n, const int *shard_batches, int shard_count, int batch_tokens,
                         int max_batches, int *counts) {
    memset(counts, 0, (size_t)shard_count * max_batches * sizeof(int));
    int outside = 0;
    for (int i = 0; i < n; i++) {
        int shard = ids[i].shard;
        int64_t batch = ids[i].first_position / batch_tokens;
        if (shard < 0 || shard >= shard_count || batch >= shard_batches[shard]) outside++;
        else counts[shard * max_batches + batch]++;
    }
    return outside;
}

// The lowest file descriptor free now: a leaked descriptor would take it.
static int lowest_free_descriptor(void) {
    FILE *file = fopen("/dev/null", "rb");
    if (!file) return -1;
    int descriptor = fileno(file);
    fclose(file);
    return descriptor;
}

enum { B = 2, T = 7, WORLD = 3, BATCH_TOKENS = B * (T + 1) };
// Shard sizes in batches: 10, 7, 9, 2 (plus some spare tokens): 28 batches, 9 steps of 3 ranks, one
// batch left out each epoch. Shard 3 holds fewer than W batches and still takes part; a fifth shard
// holds less than one batch and is skipped.
static const int shard_batches[] = {10, 7, 9, 2};
#define SHARD_COUNT 4
#define TOTAL_BATCHES 28
#define MAX_SHARD_BATCHES 16

static void write_loader_shards(void) {
    char name[64];
    for (int s = 0; s < SHARD_COUNT; s++) {
        snprintf(name, sizeof(name), "train_%06d.bin", s);
        write_position_shard(temp_path(name), s, (int64_t)shard_batches[s] * BATCH_TOKENS + 5);
    }
    write_position_shard(temp_path("train_000004.bin"), 4, BATCH_TOKENS - 1);  // no whole batch
}

// Over each epoch the ranks read disjoint batches that cover all but TOTAL_BATCHES % W of them.
static void test_epoch_coverage(const char *pattern) {
    const int64_t expected_steps = TOTAL_BATCHES / WORLD;
    enum { EPOCHS = 3, MAX_STEPS = 16 };
    BatchId ids[WORLD][EPOCHS * MAX_STEPS];
    int rows_ok = 1, status = 0;
    int64_t steps = 0, skipped = 0, shards = 0;
    DataloaderPosition end_position = {-1, -1};
    for (int rank = 0; rank < WORLD && status == 0; rank++) {
        Dataloader loader;
        if (open_loader(&loader, pattern, B, T, rank, WORLD, 1, 1234) != 0) return;
        steps = dataloader_steps_per_epoch(&loader);
        skipped = loader.skipped_shard_count;
        shards = loader.shard_count;
        if (steps != expected_steps) {
            dataloader_close(&loader);
            break;
        }
        status = read_sequence(&loader, (int)steps, ids[rank], &rows_ok);
        end_position = dataloader_position(&loader);
        if (status == 0) status = read_sequence(&loader, (int)steps * (EPOCHS - 1), ids[rank] + steps, &rows_ok);
        dataloader_close(&loader);
    }
    check(skipped == 1 && shards == SHARD_COUNT,
          "only the shard without a whole batch is skipped: expected %d usable and 1 skipped, got %lld and %lld",
          SHARD_COUNT, (long long)shards, (long long)skipped);
    check(steps == expected_steps, "steps per epoch = floor(total batches / W): expected %lld, got %lld",
          (long long)expected_steps, (long long)steps);
    if (status != 0 || steps != expected_steps) return;
    check(rows_ok, "every row is T+1 consecutive tokens, targets shifted by one, batches aligned to B*(T+1)");
    check(end_position.epoch == 1 && end_position.step == 0,
          "after one epoch the position is (epoch 1, step 0): got (%lld, %lld)", (long long)end_position.epoch,
          (long long)end_position.step);
    int disjoint = 1, complete = 1, outside = 0, small_shard_read = 0;
    int counts[SHARD_COUNT * MAX_SHARD_BATCHES];
    for (int epoch = 0; epoch < EPOCHS; epoch++) {
        BatchId epoch_ids[WORLD * MAX_STEPS];
        for (int rank = 0; rank < WORLD; rank++)
            for (int64_t k = 0; k < steps; k++) epoch_ids[rank * steps + k] = ids[rank][epoch * steps + k];
        outside += count_batches(epoch_ids, (int)(WORLD * steps), shard_batches, SHARD_COUNT, BATCH_TOKENS,
                                 MAX_SHARD_BATCHES, counts);
        int read_once = 0;
        for (int s = 0; s < SHARD_COUNT; s++)
            for (int b = 0; b < shard_batches[s]; b++) {
                int n = counts[s * MAX_SHARD_BATCHES + b];
                disjoint &= n <= 1;
                read_once += n == 1;
                if (s == 3) small_shard_read |= n;
            }
        complete &= read_once == WORLD * steps;
    }
    check(outside == 0, "every batch read lies in a usable shard: %d outside", outside);
    check(disjoint, "in each epoch no batch is read twice, by any rank");
    check(complete, "each epoch reads floor(%d / %d) * %d = %lld distinct batches", TOTAL_BATCHES, WORLD, WORLD,
          (long long)(WORLD * steps));
    check(small_shard_read, "a shard with fewer than W batches is read too");
}

// Two shards of equal size (say code and prose): a training epoch mixes them from its first steps.
static void test_global_shuffle(void) {
    enum { EQUAL_BATCHES = 40, EPOCH = 2 * EQUAL_BATCHES, FIRST = 20, SEEDS = 10 };
    const int equal_batches[2] = {EQUAL_BATCHES, EQUAL_BATCHES};
    write_position_shard(temp_path("equal_000000.bin"), 0, EQUAL_BATCHES * BATCH_TOKENS);
    write_position_shard(temp_path("equal_000001.bin"), 1, EQUAL_BATCHES * BATCH_TOKENS);
    char pattern[256];
    snprintf(pattern, sizeof(pattern), "%s/equal_*.bin", temp_dir);
    int rows_ok = 1, mixed_seeds = 0;
    BatchId ids[2 * EPOCH];
    Dataloader loader;
    for (uint64_t seed = 1; seed <= SEEDS; seed++) {
        if (open_loader(&loader, pattern, B, T, 0, 1, 1, seed) != 0) return;
        int status = read_sequence(&loader, FIRST, ids, &rows_ok);
        dataloader_close(&loader);
        int from[2] = {0, 0};
        for (int i = 0; i < FIRST && status == 0; i++) from[ids[i].shard & 1]++;
        mixed_seeds += from[0] > 0 && from[1] > 0;
    }
    check(mixed_seeds == SEEDS, "seeds 1..%d: the first %d batches come from both shards: %d of %d seeds", SEEDS,
          FIRST, mixed_seeds, SEEDS);

    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 5) != 0) return;
    int64_t steps = dataloader_steps_per_epoch(&loader);
    int status = read_sequence(&loader, 2 * EPOCH, ids, &rows_ok);
    dataloader_close(&loader);
    check(steps == EPOCH, "one rank: an epoch is every batch of both shards: expected %d steps, got %lld", EPOCH,
          (long long)steps);
    if (status != 0 || steps != EPOCH) return;
    int counts[2 * EQUAL_BATCHES];
    int exactly_once = 1;
    for (int epoch = 0; epoch < 2; epoch++) {
        int outside = count_batches(ids + epoch * EPOCH, EPOCH, equal_batches, 2, BATCH_TOKENS, EQUAL_BATCHES, counts);
        for (int i = 0; i < 2 * EQUAL_BATCHES; i++) exactly_once &= counts[i] == 1;
        exactly_once &= outside == 0;
    }
    check(exactly_once, "epochs 0 and 1 each read every batch of every shard exactly once");
    check(!same_sequence(ids, ids + EPOCH, EPOCH), "epoch 1 reads them in another order than epoch 0");
    // Shard by shard reading switches once per epoch; a uniform permutation about EPOCH / 2 times.
    int switches = 0;
    for (int i = 1; i < EPOCH; i++) switches += ids[i].shard != ids[i - 1].shard;
    check(switches >= EPOCH / 4, "consecutive batches alternate between shards: %d switches in %d batches, "
          "expected at least %d", switches, EPOCH, EPOCH / 4);
    check(rows_ok, "rows are consecutive tokens in the global order");
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

// Saves the position after k batches and restores it into a fresh loader, and into one that has
// read on into later epochs: the next batches match.
static void test_resume(const char *pattern) {
    enum { TOTAL = 40 };
    BatchId original[TOTAL];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
    int epoch_steps = (int)dataloader_steps_per_epoch(&loader);
    dataloader_close(&loader);
    const int save_points[] = {0, 1, 3, 5, epoch_steps - 1, epoch_steps, epoch_steps + 4, 2 * epoch_steps - 1,
                               2 * epoch_steps, 3 * epoch_steps + 2};
    for (size_t p = 0; p < sizeof(save_points) / sizeof(save_points[0]); p++) {
        int k = save_points[p];
        if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
        read_sequence(&loader, k, original, &rows_ok);
        DataloaderPosition saved = dataloader_position(&loader);
        read_sequence(&loader, TOTAL - k, original + k, &rows_ok);

        Dataloader resumed;
        if (open_loader(&resumed, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
        char error[SHARD_ERROR_SIZE];
        int status = dataloader_set_position(&resumed, saved, error, sizeof(error));
        BatchId continued[TOTAL], rewound[TOTAL];
        if (status == 0) read_sequence(&resumed, TOTAL - k, continued, &rows_ok);
        dataloader_close(&resumed);
        check(status == 0 && same_sequence(original + k, continued, TOTAL - k),
              "resume after %d batches at (epoch %lld, step %lld): next %d batches equal %s", k,
              (long long)saved.epoch, (long long)saved.step, TOTAL - k, status ? error : "");
        int64_t expected_epoch = k / epoch_steps, expected_step = k % epoch_steps;
        check(saved.epoch == expected_epoch && saved.step == expected_step,
              "position after %d batches: expected (epoch %lld, step %lld), got (%lld, %lld)", k,
              (long long)expected_epoch, (long long)expected_step, (long long)saved.epoch, (long long)saved.step);
        status = dataloader_set_position(&loader, saved, error, sizeof(error));
        if (status == 0) read_sequence(&loader, TOTAL - k, rewound, &rows_ok);
        dataloader_close(&loader);
        check(status == 0 && same_sequence(original + k, rewound, TOTAL - k),
              "set back from epoch %d to (epoch %lld, step %lld): next %d batches equal %s",
              TOTAL / epoch_steps, (long long)saved.epoch, (long long)saved.step, TOTAL - k, status ? error : "");
    }
    check(rows_ok, "rows are consecutive tokens after every resume");
    if (open_loader(&loader, pattern, B, T, 2, WORLD, 1, 7) != 0) return;
    char error[SHARD_ERROR_SIZE];
    DataloaderPosition past_epoch = {0, epoch_steps};
    check_error("position step past the epoch's steps", dataloader_set_position(&loader, past_epoch, error,
                sizeof(error)), error, pattern, "step 9) is outside these shards' 9 steps per epoch");
    DataloaderPosition negative = {-1, 0};
    check_error("negative epoch", dataloader_set_position(&loader, negative, error, sizeof(error)), error, pattern,
                "position (epoch -1, step 0) is outside");
    dataloader_close(&loader);
}

// Validation: shards in path order, batches in file order, identical on every run and after a
// return to the first batch (the trainer seeks each validation batch by its position).
static void test_validation(const char *pattern) {
    enum { K = 7 };
    BatchId first[K], second[K], after_reset[K];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 0, 1) != 0) return;
    read_sequence(&loader, K, first, &rows_ok);
    DataloaderPosition start = {0, 0};
    char error[256] = "accepted";
    check(dataloader_set_position(&loader, start, error, sizeof(error)) == 0, "validation: back to the first batch (%s)", error);
    read_sequence(&loader, K, after_reset, &rows_ok);
    dataloader_close(&loader);
    if (open_loader(&loader, pattern, B, T, 1, WORLD, 0, 999) != 0) return;
    read_sequence(&loader, K, second, &rows_ok);
    dataloader_close(&loader);
    // Rank 1 of 3 reads global batches 1, 4, 7, ..., 19: shard 0 holds 0..9, shard 1 10..16, shard 2 17..25.
    const BatchId expected[K] = {{0, 1 * BATCH_TOKENS}, {0, 4 * BATCH_TOKENS}, {0, 7 * BATCH_TOKENS},
                                 {1, 0 * BATCH_TOKENS}, {1, 3 * BATCH_TOKENS}, {1, 6 * BATCH_TOKENS},
                                 {2, 2 * BATCH_TOKENS}};
    check(same_sequence(first, expected, K), "validation order is the file order: batch 3 expected shard 1 at 0, "
          "got shard %d at %lld; batch 6 expected shard 2 at %d, got shard %d at %lld", first[3].shard,
          (long long)first[3].first_position, 2 * BATCH_TOKENS, first[6].shard, (long long)first[6].first_position);
    check(same_sequence(first, second, K) && same_sequence(first, after_reset, K),
          "validation batches are the same on every run (any seed) and after a return to the first batch");
    check(rows_ok, "validation rows are consecutive tokens");
}

// More shards than stay open: reading evicts the least recently read, every batch still arrives
// once per epoch, and closing the loader leaves no descriptor open.
static void test_open_files(void) {
    enum { MANY = 20, MANY_BATCHES = 3, EPOCH = MANY * MANY_BATCHES };
    int many_batches[MANY];
    char name[64];
    for (int s = 0; s < MANY; s++) {
        snprintf(name, sizeof(name), "many_%06d.bin", s);
        write_position_shard(temp_path(name), s, MANY_BATCHES * BATCH_TOKENS);
        many_batches[s] = MANY_BATCHES;
    }
    char pattern[256];
    snprintf(pattern, sizeof(pattern), "%s/many_*.bin", temp_dir);
    int free_before = lowest_free_descriptor();
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 11) != 0) return;
    int *inputs = (int *)malloc(B * T * sizeof(int)), *targets = (int *)malloc(B * T * sizeof(int));
    BatchId ids[2 * EPOCH];
    int rows_ok = 1, status = 0, most_open = 0;
    for (int i = 0; i < 2 * EPOCH && status == 0; i++) {
        status = read_batch(&loader, inputs, targets, &ids[i], &rows_ok);
        int open_files = 0;
        for (int j = 0; j < DATALOADER_MAX_OPEN_SHARDS; j++) open_files += loader.open_shards[j].shard.file != NULL;
        if (open_files > most_open) most_open = open_files;
    }
    free(inputs);
    free(targets);
    char error[SHARD_ERROR_SIZE];
    int validate_status = dataloader_validate_tokens(&loader, (int64_t)MANY << POSITION_BITS, error, sizeof(error));
    dataloader_close(&loader);
    int free_after = lowest_free_descriptor();
    check(status == 0 && most_open == DATALOADER_MAX_OPEN_SHARDS,
          "%d shards: at most %d files open at once, got %d", MANY, DATALOADER_MAX_OPEN_SHARDS, most_open);
    int counts[MANY * MANY_BATCHES], exactly_once = 1;
    for (int epoch = 0; epoch < 2 && status == 0; epoch++) {
        int outside = count_batches(ids + epoch * EPOCH, EPOCH, many_batches, MANY, BATCH_TOKENS, MANY_BATCHES, counts);
        for (int i = 0; i < MANY * MANY_BATCHES; i++) exactly_once &= counts[i] == 1;
        exactly_once &= outside == 0;
    }
    check(status == 0 && exactly_once && rows_ok, "%d shards: each epoch reads every batch once, evicting files", MANY);
    check(validate_status == 0, "token check over %d shards through the file cache: %s", MANY,
          validate_status ? error : "ok");
    check(free_before >= 0 && free_after == free_before,
          "no descriptor leaks: lowest free descriptor %d before the loader, %d after closing it", free_before,
          free_after);
}

// The training order is a uniform permutation: over 600 epochs of 3 batches each of the 6 orders
// comes about 100 times (a draw that leaves out the last swap, or one of Sattolo's cycles only,
// gives some orders never).
static void test_uniform_order(void) {
    enum { EPOCHS = 600, ORDERS = 6 };
    const char *three = temp_path("three_000000.bin");
    write_position_shard(three, 0, 3 * BATCH_TOKENS);
    Dataloader loader;
    if (open_loader(&loader, three, B, T, 0, 1, 1, 2024) != 0) return;
    int counts[ORDERS] = {0}, rows_ok = 1, status = 0;
    BatchId ids[3];
    for (int epoch = 0; epoch < EPOCHS && status == 0; epoch++) {
        status = read_sequence(&loader, 3, ids, &rows_ok);
        int a = (int)(ids[0].first_position / BATCH_TOKENS), b = (int)(ids[1].first_position / BATCH_TOKENS);
        // The 6 orders of {0, 1, 2} by their first two batches.
        int order = a * 2 + (b > a ? b - 1 : b);
        if (a < 0 || a > 2 || b < 0 || b > 2 || a == b) status = -1;
        else counts[order]++;
    }
    dataloader_close(&loader);
    remove(three);
    int least = EPOCHS, most = 0;
    for (int i = 0; i < ORDERS; i++) {
        if (counts[i] < least) least = counts[i];
        if (counts[i] > most) most = counts[i];
    }
    check(status == 0 && least >= 55 && most <= 145,
          "%d epochs of 3 batches: each of the 6 orders comes 55 to 145 times (expected 100): %d %d %d %d %d %d",
          EPOCHS, counts[0], counts[1], counts[2], counts[3], counts[4], counts[5]);
}

// Rank r of W reads, at step k of epoch e, batch order_e[k*W + r], where order_e is the epoch's
// permutation of all batches: the sequence one rank alone reads.
static void test_rank_steps(const char *pattern) {
    enum { EPOCHS = 2 };
    BatchId alone[EPOCHS * TOTAL_BATCHES], ranked[WORLD][EPOCHS * TOTAL_BATCHES];
    int rows_ok = 1;
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 99) != 0) return;
    read_sequence(&loader, EPOCHS * TOTAL_BATCHES, alone, &rows_ok);
    dataloader_close(&loader);
    const int steps = TOTAL_BATCHES / WORLD;
    for (int rank = 0; rank < WORLD; rank++) {
        if (open_loader(&loader, pattern, B, T, rank, WORLD, 1, 99) != 0) return;
        read_sequence(&loader, EPOCHS * steps, ranked[rank], &rows_ok);
        dataloader_close(&loader);
    }
    int mismatches = 0, first_epoch = -1, first_step = -1, first_rank = -1;
    for (int epoch = 0; epoch < EPOCHS; epoch++)
        for (int k = 0; k < steps; k++)
            for (int rank = 0; rank < WORLD; rank++)
                if (!same_sequence(&ranked[rank][epoch * steps + k], &alone[epoch * TOTAL_BATCHES + k * WORLD + rank], 1) &&
                    mismatches++ == 0) {
                    first_epoch = epoch;
                    first_step = k;
                    first_rank = rank;
                }
    check(mismatches == 0 && rows_ok,
          "rank r of %d at step k reads batch k*%d + r of the epoch's order (%d mismatches, first epoch %d step %d rank %d)",
          WORLD, WORLD, mismatches, first_epoch, first_step, first_rank);
}

// The smallest batch, B = 1 and T = 1: one input and one target per batch.
static void test_smallest_batch(void) {
    const char *tiny = temp_path("tiny_000000.bin");
    write_position_shard(tiny, 0, 4);
    Dataloader loader;
    if (open_loader(&loader, tiny, 1, 1, 0, 1, 0, 1) != 0) return;
    int inputs[1], targets[1], got[4] = {-1, -1, -1, -1};
    char error[SHARD_ERROR_SIZE];
    int status = 0;
    for (int i = 0; i < 2 && status == 0; i++) {
        status = dataloader_next_batch(&loader, inputs, targets, error, sizeof(error));
        got[2 * i] = inputs[0];
        got[2 * i + 1] = targets[0];
    }
    int64_t steps = dataloader_steps_per_epoch(&loader);
    dataloader_close(&loader);
    remove(tiny);
    check(status == 0 && steps == 2 && got[0] == 0 && got[1] == 1 && got[2] == 2 && got[3] == 3,
          "B = 1, T = 1 over 4 tokens: 2 steps, (input, target) = (0, 1), (2, 3); got %lld steps, (%d, %d), (%d, %d) %s",
          (long long)steps, got[0], got[1], got[2], got[3], status ? error : "");
}

// Reads what the loader prints on stderr while it opens pattern as rank `rank` of WORLD.
static void stderr_of_open(const char *pattern, int rank, char *text, size_t size) {
    const char *capture = temp_path("stderr.txt");
    fflush(stderr);
    int saved = dup(STDERR_FILENO);
    FILE *file = fopen(capture, "w");
    text[0] = '\0';
    if (saved < 0 || !file) {
        if (file) fclose(file);
        if (saved >= 0) close(saved);
        return;
    }
    dup2(fileno(file), STDERR_FILENO);
    Dataloader loader;
    int status = open_loader(&loader, pattern, B, T, rank, WORLD, 1, 1);
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    fclose(file);
    if (status == 0) dataloader_close(&loader);
    size_t length;
    unsigned char *bytes = read_bytes(capture, &length);
    snprintf(text, size, "%.*s", (int)length, (const char *)bytes);
    free(bytes);
    remove(capture);
}

// A shard too small for a batch is named once, by rank 0, with its size and the batch's.
static void test_skip_warning(const char *pattern) {
    char rank0[1024], rank1[1024], expected[512];
    stderr_of_open(pattern, 0, rank0, sizeof(rank0));
    stderr_of_open(pattern, 1, rank1, sizeof(rank1));
    snprintf(expected, sizeof(expected), "warning: %s: skipped: %d tokens hold no batch of %d x %d tokens",
             temp_path("train_000004.bin"), BATCH_TOKENS - 1, B, T + 1);
    size_t length = strlen(rank0);
    if (length > 0 && rank0[length - 1] == '\n') rank0[length - 1] = '\0';  // one line
    check(strcmp(rank0, expected) == 0, "rank 0 warns about the skipped shard: expected \"%s\", got \"%s\"", expected, rank0);
    check(rank1[0] == '\0', "rank 1 prints nothing (got \"%s\")", rank1);
}

static void test_loader_errors(const char *pattern) {
    char error[SHARD_ERROR_SIZE];
    Dataloader loader;
    DataloaderConfig config = {pattern, B, T, 0, WORLD, 1, 1, 0};
    char none[256];
    snprintf(none, sizeof(none), "%s/nothing_*.bin", temp_dir);
    config.pattern = none;
    check_error("no file matches", dataloader_open(&loader, &config, error, sizeof(error)), error, none,
                "no file matches");
    config.pattern = pattern;
    config.batch_size = 100;
    check_error("no shard holds a batch", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "no shard holds a batch of 100 x 8 tokens");
    config.batch_size = B;
    config.rank = WORLD;
    check_error("rank outside the world", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "invalid loader settings");
    config.rank = -1;
    check_error("a negative rank", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "invalid loader settings");
    config.rank = 0;
    const char *zero_names[3] = {"batch_size 0", "seq_len 0", "world_size 0"};
    for (int z = 0; z < 3; z++) {
        DataloaderConfig bad = config;
        if (z == 0) bad.batch_size = 0;
        if (z == 1) bad.seq_len = 0;
        if (z == 2) bad.world_size = 0;
        check_error(zero_names[z], dataloader_open(&loader, &bad, error, sizeof(error)), error, pattern,
                    "invalid loader settings");
    }
    // As many batches as ranks: every rank reads one per epoch.
    const char *exact = temp_path("exact_000000.bin");
    write_position_shard(exact, 0, 3 * BATCH_TOKENS);
    DataloaderConfig three = config;
    three.pattern = exact;
    three.world_size = 3;
    int exact_status = dataloader_open(&loader, &three, error, sizeof(error));
    check(exact_status == 0 && dataloader_steps_per_epoch(&loader) == 1, "3 batches for 3 ranks: one step per epoch (%s)",
          exact_status ? error : "ok");
    if (exact_status == 0) dataloader_close(&loader);
    remove(exact);
    const char *small = temp_path("train_000003.bin");
    config.pattern = small;
    check_error("fewer batches than ranks", dataloader_open(&loader, &config, error, sizeof(error)), error, small,
                "1 shard(s) hold 2 batches of 2 x 8 tokens, fewer than the 3 ranks need");

    char bad_pattern[256];
    snprintf(bad_pattern, sizeof(bad_pattern), "%s/*.bin", temp_dir);  // includes the malformed shards
    config.pattern = bad_pattern;
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

    // Every batch is checked as it is read: an id at vocab_size stops the read naming shard and
    // position; one below it passes.
    // The largest id any batch holds: the last token of the last batch of the last usable shard
    // (shard s holds ids from s << POSITION_BITS). One rank: an epoch reads every batch.
    config.world_size = 1;
    int64_t largest_id = -1;
    if (dataloader_open(&loader, &config, error, sizeof(error)) == 0) {
        int64_t last = loader.shard_count - 1;
        int64_t batches = loader.shard_first_unit[last + 1] - loader.shard_first_unit[last];
        largest_id = (last << POSITION_BITS) + batches * loader.tokens_per_batch - 1;
        dataloader_close(&loader);
    }
    config.vocab_size = largest_id;  // only the largest id, in the last batch of train_000003.bin, is past it
    if (dataloader_open(&loader, &config, error, sizeof(error)) == 0) {
        char expected[96];
        snprintf(expected, sizeof(expected), "token id %lld >= vocab_size %lld at position", (long long)largest_id,
                 (long long)largest_id);
        check_error("a batch with an id equal to vocab_size", read_until_error(&loader, (int)loader.steps_per_epoch, error,
                    sizeof(error)), error, temp_path("train_000003.bin"), expected);
        dataloader_close(&loader);
    }
    config.vocab_size = largest_id + 1;
    if (dataloader_open(&loader, &config, error, sizeof(error)) == 0) {
        status = read_until_error(&loader, (int)loader.steps_per_epoch, error, sizeof(error));
        check(status == 0, "batches whose largest id is vocab_size - 1 (%lld) are read: %s", (long long)largest_id,
              status ? error : "ok");
        dataloader_close(&loader);
    }
    // The smallest vocabulary checked: only id 0 is in it. File order: the first batch is shard 0's
    // tokens 0, 1, ...
    config.vocab_size = 1;
    config.shuffle = 0;
    if (dataloader_open(&loader, &config, error, sizeof(error)) == 0) {
        check_error("vocab_size 1", read_until_error(&loader, 1, error, sizeof(error)), error, temp_path("train_000000.bin"),
                    "token id 1 >= vocab_size 1 at position 1");
        dataloader_close(&loader);
    }
}

// Under DATALOADER_SHUFFLE_ROWS each row is a unit of its own. The loader shards (T+1 = 8 tokens a
// row) hold 20, 14, 18, 4 and 1 rows: the fifth shard, too small for a batch, takes part.
enum { ROW_B = 4, ROW_TOTAL = 57 };

// Reads one batch in rows order: each row's (shard, first position), and whether every row is
// T+1 consecutive tokens starting at a multiple of T+1 of its shard.
static int read_row_batch(Dataloader *loader, BatchId *rows, int *rows_ok) {
    int b_count = loader->config.batch_size, t_count = loader->config.seq_len;
    int *inputs = (int *)malloc((size_t)b_count * t_count * sizeof(int));
    int *targets = (int *)malloc((size_t)b_count * t_count * sizeof(int));
    char error[SHARD_ERROR_SIZE];
    int status = dataloader_next_batch(loader, inputs, targets, error, sizeof(error));
    if (status != 0) check(0, "next batch (rows): %s", error);
    for (int b = 0; status == 0 && b < b_count; b++) {
        const int *row = inputs + (int64_t)b * t_count;
        rows[b].shard = row[0] >> POSITION_BITS;
        rows[b].first_position = row[0] & ((1 << POSITION_BITS) - 1);
        if (rows[b].first_position % (t_count + 1) != 0) *rows_ok = 0;
        for (int t = 0; t < t_count; t++)
            if (row[t] != row[0] + t || targets[(int64_t)b * t_count + t] != row[0] + t + 1) *rows_ok = 0;
    }
    free(inputs);
    free(targets);
    return status;
}

// Reads `steps` batches in rows order into rows[steps * B].
static int read_row_sequence(Dataloader *loader, int steps, BatchId *rows, int *rows_ok) {
    int status = 0;
    for (int k = 0; k < steps && status == 0; k++)
        status = read_row_batch(loader, rows + (int64_t)k * loader->config.batch_size, rows_ok);
    return status;
}

static void test_row_shuffle(const char *pattern) {
    enum { STEPS = ROW_TOTAL / (ROW_B * WORLD) };  // 4 steps; 9 rows left out each epoch
    BatchId rows[WORLD][STEPS * ROW_B];
    int rows_ok = 1, status = 0, mixed_batches = 0;
    int64_t steps = -1, skipped = -1;
    for (int rank = 0; rank < WORLD && status == 0; rank++) {
        Dataloader loader;
        if (open_loader(&loader, pattern, ROW_B, T, rank, WORLD, DATALOADER_SHUFFLE_ROWS, 99) != 0) return;
        steps = dataloader_steps_per_epoch(&loader);
        skipped = loader.skipped_shard_count;
        if (steps == STEPS) status = read_row_sequence(&loader, STEPS, rows[rank], &rows_ok);
        dataloader_close(&loader);
        if (steps != STEPS) break;
    }
    check(steps == STEPS && skipped == 0, "rows: floor(%d rows / (%d x %d)) = %d steps, no shard skipped: got %lld, %lld",
          ROW_TOTAL, ROW_B, WORLD, STEPS, (long long)steps, (long long)skipped);
    if (status != 0 || steps != STEPS) return;
    check(rows_ok, "rows: every row is T+1 consecutive tokens of one shard at a row boundary, targets shifted by one");
    int distinct = 1;
    for (int i = 0; i < WORLD * STEPS * ROW_B; i++)
        for (int j = 0; j < i; j++) {
            const BatchId *a = &rows[i / (STEPS * ROW_B)][i % (STEPS * ROW_B)];
            const BatchId *b = &rows[j / (STEPS * ROW_B)][j % (STEPS * ROW_B)];
            distinct &= a->shard != b->shard || a->first_position != b->first_position;
        }
    for (int rank = 0; rank < WORLD; rank++)
        for (int k = 0; k < STEPS; k++) {
            const BatchId *batch = &rows[rank][k * ROW_B];
            int consecutive = 1;
            for (int b = 1; b < ROW_B; b++)
                consecutive &= batch[b].shard == batch[0].shard &&
                               batch[b].first_position == batch[0].first_position + b * (T + 1);
            mixed_batches += !consecutive;
        }
    check(distinct, "rows: in an epoch the ranks read %d distinct rows", WORLD * STEPS * ROW_B);
    check(mixed_batches >= WORLD * STEPS / 2, "rows: a batch's rows come from anywhere: %d of %d batches are not "
          "consecutive rows", mixed_batches, WORLD * STEPS);

    // The order is over rows alone: batch k of B = 4 on one rank is what ranks 0 and 1 read at step
    // k with B = 2, and what one rank reads in batches 2k and 2k + 1 with B = 2.
    enum { SPLIT_STEPS = 10 };
    BatchId whole[SPLIT_STEPS * ROW_B], ranks[2][SPLIT_STEPS * 2], halves[SPLIT_STEPS * ROW_B];
    Dataloader loader;
    if (open_loader(&loader, pattern, ROW_B, T, 0, 1, DATALOADER_SHUFFLE_ROWS, 5) != 0) return;
    status = read_row_sequence(&loader, SPLIT_STEPS, whole, &rows_ok);
    dataloader_close(&loader);
    for (int rank = 0; rank < 2 && status == 0; rank++) {
        if (open_loader(&loader, pattern, 2, T, rank, 2, DATALOADER_SHUFFLE_ROWS, 5) != 0) return;
        status = read_row_sequence(&loader, SPLIT_STEPS, ranks[rank], &rows_ok);
        dataloader_close(&loader);
    }
    if (status != 0 || open_loader(&loader, pattern, 2, T, 0, 1, DATALOADER_SHUFFLE_ROWS, 5) != 0) return;
    status = read_row_sequence(&loader, 2 * SPLIT_STEPS, halves, &rows_ok);
    dataloader_close(&loader);
    if (status != 0) return;
    int same_split = same_sequence(whole, halves, SPLIT_STEPS * ROW_B);
    for (int k = 0; k < SPLIT_STEPS; k++)
        same_split &= same_sequence(whole + k * ROW_B, ranks[0] + k * 2, 2) &&
                      same_sequence(whole + k * ROW_B + 2, ranks[1] + k * 2, 2);
    check(same_split, "rows: a batch of 4 is the same rows as 2 ranks' or 2 micro-batches' batches of 2, over %d steps "
          "(two epochs)", SPLIT_STEPS);

    // Resume: the position after 3 steps, set on a fresh loader, gives the same next batches.
    BatchId resumed[(SPLIT_STEPS - 3) * ROW_B];
    char error[SHARD_ERROR_SIZE];
    if (open_loader(&loader, pattern, ROW_B, T, 0, 1, DATALOADER_SHUFFLE_ROWS, 5) != 0) return;
    DataloaderPosition at_three = {0, 3};
    status = dataloader_set_position(&loader, at_three, error, sizeof(error));
    if (status == 0) status = read_row_sequence(&loader, SPLIT_STEPS - 3, resumed, &rows_ok);
    dataloader_close(&loader);
    check(status == 0 && same_sequence(whole + 3 * ROW_B, resumed, (SPLIT_STEPS - 3) * ROW_B),
          "rows: resuming at step 3 continues with the same rows");
    check(rows_ok, "rows: every row read intact in every split");

    DataloaderConfig config = {pattern, ROW_B, 1000, 0, 1, DATALOADER_SHUFFLE_ROWS, 1, 0};
    check_error("rows: no shard holds a row", dataloader_open(&loader, &config, error, sizeof(error)), error, pattern,
                "no shard holds a row of 1 x 1001 tokens");
    const char *one_row = temp_path("train_000004.bin");
    config.pattern = one_row;
    config.seq_len = T;
    check_error("rows: fewer rows than a batch", dataloader_open(&loader, &config, error, sizeof(error)), error, one_row,
                "1 shard(s) hold 0 batches of 4 x 8 tokens, fewer than the 1 ranks need");
    config.shuffle = DATALOADER_SHUFFLE_ROWS + 1;
    check_error("an unknown shuffle", dataloader_open(&loader, &config, error, sizeof(error)), error, one_row,
                "invalid loader settings");
}

// A shard that changes, disappears or shrinks after the loader opened: the read fails naming it.
static void test_read_errors(void) {
    enum { BATCHES = 5, READS = 2 * BATCHES };
    const char *first = temp_path("resized_000000.bin"), *second = temp_path("resized_000001.bin");
    char pattern[256], error[SHARD_ERROR_SIZE];
    snprintf(pattern, sizeof(pattern), "%s/resized_*.bin", temp_dir);
    write_position_shard(first, 0, BATCHES * BATCH_TOKENS);
    write_position_shard(second, 1, BATCHES * BATCH_TOKENS);
    Dataloader loader;
    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 3) != 0) return;
    write_position_shard(second, 1, (BATCHES - 2) * BATCH_TOKENS);
    check_error("a shard resized after open", read_until_error(&loader, READS, error, sizeof(error)), error, second,
                "changed while in use: 48 tokens, 80 when the loader opened it");
    dataloader_close(&loader);

    write_position_shard(second, 1, BATCHES * BATCH_TOKENS);
    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 3) != 0) return;
    remove(first);
    check_error("a shard removed after open", read_until_error(&loader, READS, error, sizeof(error)), error, first,
                "cannot open");
    dataloader_close(&loader);

    // Shards larger than stdio's buffer, so that reads after the truncation reach the file.
    enum { LARGE_BATCHES = 200 };
    write_position_shard(first, 0, LARGE_BATCHES * BATCH_TOKENS);
    write_position_shard(second, 1, LARGE_BATCHES * BATCH_TOKENS);
    if (open_loader(&loader, pattern, B, T, 0, 1, 1, 3) != 0) return;
    BatchId id;
    int rows_ok = 1;
    int *inputs = (int *)malloc(B * T * sizeof(int)), *targets = (int *)malloc(B * T * sizeof(int));
    if (read_batch(&loader, inputs, targets, &id, &rows_ok) == 0) {
        const char *open_path = id.shard == 0 ? first : second;  // open in the loader's cache now
        if (truncate(open_path, SHARD_HEADER_BYTES) != 0)
            check(0, "truncate %s: %s", open_path, strerror(errno));
        else
            check_error("a shard truncated while open", read_until_error(&loader, 2 * LARGE_BATCHES, error,
                        sizeof(error)), error, open_path, "cannot read tokens at");
    }
    free(inputs);
    free(targets);
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
    test_shard_edges();
    test_make_directories();
    write_loader_shards();
    char pattern[256];
    snprintf(pattern, sizeof(pattern), "%s/train_*.bin", temp_dir);
    test_epoch_coverage(pattern);
    test_global_shuffle();
    test_order(pattern);
    test_resume(pattern);
    test_validation(pattern);
    test_open_files();
    test_uniform_order();
    test_rank_steps(pattern);
    test_smallest_batch();
    test_skip_warning(pattern);
    test_loader_errors(pattern);
    test_row_shuffle(pattern);
    test_read_errors();
    remove_test_files();
    return check_summary("test_dataloader");
}
