// `./tokenize shards -t TOKENIZER.json -o DIR [options] INPUT...`: the corpus-to-shards tool.
// Pipeline: the main thread reads the inputs in order, splits them into documents and packs
// the documents into chunks of about CHUNK_TEXT_BYTES; worker threads tokenize whole chunks
// (BOS + document tokens [+ EOS] per document); the main thread writes finished chunks strictly
// in order, so the output depends only on the inputs and options, never on the thread count.
// Document i goes to validation when floor((i+1) * f) > floor(i * f) (f = --val-fraction, or
// --val-docs / total documents): the validation documents are spread evenly over the corpus.
// Shards: DIR/train_000000.bin, ..., DIR/val_000000.bin, ..., each --shard-tokens tokens but the
// last; documents continue across shard boundaries, as in llm.c.
#define _POSIX_C_SOURCE 200809L
#include "shards.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../dataloader/make_directories.h"
#include "../dataloader/shard.h"
#include "input_file.h"
#include "tokenizer.h"

enum {
    CHUNK_TEXT_BYTES = 1 << 20,  // documents per tokenizing task: large enough to amortise locking
    READ_BLOCK_BYTES = 1 << 20,
    SHARDS_ERROR_SIZE = 2048,
    LARGE_DOCUMENT_BYTES = 16 << 20,  // a document past it is warned about: its encoding takes ~40x its size
};
static const int64_t default_shard_tokens = 100000000;

typedef enum { SPLIT_WHOLE_FILE, SPLIT_SEPARATOR, SPLIT_BLANK_LINES } SplitMode;

typedef struct {
    const char *tokenizer_path;
    const char *output_dir;
    SplitMode split_mode;
    const char *separator;
    int append_eos;
    double val_fraction;
    int64_t val_docs;  // -1: not given
    int64_t shard_tokens;
    int threads;
    int overwrite;     // replace an output folder that holds shards
    char **inputs;
    int input_count;
} ShardsOptions;

// A growable byte buffer.
typedef struct {
    char *data;
    size_t size, capacity;
} Bytes;

// A growable token array in the layout tokenizer_encode appends to.
typedef struct {
    uint32_t *ids;
    size_t count, capacity;
} Tokens;

static int bytes_reserve(Bytes *bytes, size_t extra) {
    if (bytes->size + extra <= bytes->capacity) return 0;
    size_t capacity = bytes->capacity ? bytes->capacity : 4096;
    while (capacity < bytes->size + extra) capacity *= 2;
    char *data = (char *)realloc(bytes->data, capacity);
    if (!data) return -1;
    bytes->data = data;
    bytes->capacity = capacity;
    return 0;
}

static int bytes_append(Bytes *bytes, const char *data, size_t size) {
    if (size == 0) return 0;  // an empty buffer has no data pointer to copy to
    if (bytes_reserve(bytes, size) != 0) return -1;
    memcpy(bytes->data + bytes->size, data, size);
    bytes->size += size;
    return 0;
}

static int tokens_push(Tokens *tokens, uint32_t id) {
    if (tokens->count == tokens->capacity) {
        size_t capacity = tokens->capacity ? tokens->capacity * 2 : 4096;
        uint32_t *ids = (uint32_t *)realloc(tokens->ids, capacity * sizeof(uint32_t));
        if (!ids) return -1;
        tokens->ids = ids;
        tokens->capacity = capacity;
    }
    tokens->ids[tokens->count++] = id;
    return 0;
}

static double seconds_now(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec;
}

static int fail(char *error, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error, SHARDS_ERROR_SIZE, format, args);
    va_end(args);
    return -1;
}

// ---- inputs: files and sorted directory walks -----------------------------------------

typedef struct {
    char **paths;
    size_t count, capacity;
    uint64_t total_bytes;
} FileList;

static int file_list_add(FileList *list, const char *path, uint64_t size) {
    if (list->count == list->capacity) {
        size_t capacity = list->capacity ? list->capacity * 2 : 256;
        char **paths = (char **)realloc(list->paths, capacity * sizeof(char *));
        if (!paths) return -1;
        list->paths = paths;
        list->capacity = capacity;
    }
    list->paths[list->count] = shard_copy_string(path);
    if (!list->paths[list->count]) return -1;
    list->count++;
    list->total_bytes += size;
    return 0;
}

static void file_list_free(FileList *list) {
    for (size_t i = 0; i < list->count; i++) free(list->paths[i]);
    free(list->paths);
}

static int compare_names(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// Adds a regular file, or every regular file under a directory in sorted name order
// (names starting with '.' are skipped inside directories).
static int collect_inputs(const char *path, FileList *list, char *error) {
    struct stat info;
    if (stat(path, &info) != 0) return fail(error, "error: %s: %s", path, strerror(errno));
    if (S_ISREG(info.st_mode)) {
        if (file_list_add(list, path, (uint64_t)info.st_size) != 0) return fail(error, "error: out of memory");
        return 0;
    }
    if (!S_ISDIR(info.st_mode))  // a FIFO would block the read, a device never end
        return fail(error, "error: %s: neither a regular file nor a directory (%s)", path,
                    S_ISFIFO(info.st_mode) ? "a FIFO" : "a device, a socket or another special file");
    DIR *dir = opendir(path);
    if (!dir) return fail(error, "error: %s: cannot open the directory: %s", path, strerror(errno));
    char **names = NULL;
    size_t count = 0, capacity = 0;
    int status = 0;
    struct dirent *entry;
    while (status == 0 && (entry = readdir(dir)) != NULL) {
        if (entry->d_name[0] == '.') continue;
        if (count == capacity) {
            capacity = capacity ? capacity * 2 : 64;
            char **grown = (char **)realloc(names, capacity * sizeof(char *));
            if (!grown) {
                status = fail(error, "error: out of memory");
                break;
            }
            names = grown;
        }
        names[count] = shard_copy_string(entry->d_name);
        if (!names[count]) status = fail(error, "error: out of memory");
        else count++;
    }
    closedir(dir);
    if (status == 0 && count > 1) qsort(names, count, sizeof(char *), compare_names);
    size_t path_length = strlen(path);
    for (size_t i = 0; i < count && status == 0; i++) {
        char *child = (char *)malloc(path_length + strlen(names[i]) + 2);
        if (!child) {
            status = fail(error, "error: out of memory");
            break;
        }
        sprintf(child, "%s%s%s", path, path_length && path[path_length - 1] == '/' ? "" : "/", names[i]);
        status = collect_inputs(child, list, error);
        free(child);
    }
    for (size_t i = 0; i < count; i++) free(names[i]);
    free(names);
    return status;
}

static int ends_with(const char *text, const char *suffix) {
    size_t text_length = strlen(text), suffix_length = strlen(suffix);
    return text_length >= suffix_length && strcmp(text + text_length - suffix_length, suffix) == 0;
}

// ---- JSON: the "text" string field of a JSONL line -------------------------------------

static const char *json_skip_space(const char *p, const char *end) {
    while (p < end && (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')) p++;
    return p;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Reads the 4 hex digits after "\u"; -1 when malformed.
static long json_read_hex4(const char *p, const char *end) {
    if (end - p < 4) return -1;
    long value = 0;
    for (int i = 0; i < 4; i++) {
        int digit = hex_value(p[i]);
        if (digit < 0) return -1;
        value = value * 16 + digit;
    }
    return value;
}

static int utf8_append(Bytes *out, unsigned long code_point) {
    char encoded[4];
    size_t size;
    if (code_point < 0x80) {
        encoded[0] = (char)code_point;
        size = 1;
    } else if (code_point < 0x800) {
        encoded[0] = (char)(0xC0 | (code_point >> 6));
        encoded[1] = (char)(0x80 | (code_point & 0x3F));
        size = 2;
    } else if (code_point < 0x10000) {
        encoded[0] = (char)(0xE0 | (code_point >> 12));
        encoded[1] = (char)(0x80 | ((code_point >> 6) & 0x3F));
        encoded[2] = (char)(0x80 | (code_point & 0x3F));
        size = 3;
    } else {
        encoded[0] = (char)(0xF0 | (code_point >> 18));
        encoded[1] = (char)(0x80 | ((code_point >> 12) & 0x3F));
        encoded[2] = (char)(0x80 | ((code_point >> 6) & 0x3F));
        encoded[3] = (char)(0x80 | (code_point & 0x3F));
        size = 4;
    }
    return bytes_append(out, encoded, size);
}

// Parses the JSON string starting at p (at its opening quote); decodes it into out when out is
// not NULL. Returns the position after the closing quote, or NULL when malformed.
static const char *json_string(const char *p, const char *end, Bytes *out) {
    if (p >= end || *p != '"') return NULL;
    p++;
    while (p < end && *p != '"') {
        const char *run = p;
        while (p < end && *p != '"' && *p != '\\') p++;
        if (out && bytes_append(out, run, (size_t)(p - run)) != 0) return NULL;
        if (p >= end || *p == '"') break;
        if (++p >= end) return NULL;
        char escape = *p++;
        char plain = 0;
        switch (escape) {
            case '"': plain = '"'; break;
            case '\\': plain = '\\'; break;
            case '/': plain = '/'; break;
            case 'b': plain = '\b'; break;
            case 'f': plain = '\f'; break;
            case 'n': plain = '\n'; break;
            case 'r': plain = '\r'; break;
            case 't': plain = '\t'; break;
            case 'u': {
                long unit = json_read_hex4(p, end);
                if (unit < 0) return NULL;
                p += 4;
                unsigned long code_point = (unsigned long)unit;
                if (unit >= 0xD800 && unit <= 0xDBFF) {  // a high surrogate pairs with the next \u
                    long low = end - p >= 6 && p[0] == '\\' && p[1] == 'u' ? json_read_hex4(p + 2, end) : -1;
                    if (low >= 0xDC00 && low <= 0xDFFF) {
                        code_point = 0x10000 + (((unsigned long)unit - 0xD800) << 10) + ((unsigned long)low - 0xDC00);
                        p += 6;
                    } else {
                        code_point = 0xFFFD;
                    }
                } else if (unit >= 0xDC00 && unit <= 0xDFFF) {
                    code_point = 0xFFFD;
                }
                if (out && utf8_append(out, code_point) != 0) return NULL;
                continue;
            }
            default: return NULL;
        }
        if (out && bytes_append(out, &plain, 1) != 0) return NULL;
    }
    return p < end ? p + 1 : NULL;
}

// Skips any JSON value; NULL when malformed.
static const char *json_skip_value(const char *p, const char *end) {
    if (p >= end) return NULL;
    if (*p == '"') return json_string(p, end, NULL);
    if (*p == '{' || *p == '[') {
        int depth = 0;
        while (p < end) {
            if (*p == '"') {
                p = json_string(p, end, NULL);
                if (!p) return NULL;
                continue;
            }
            if (*p == '{' || *p == '[') depth++;
            if (*p == '}' || *p == ']') depth--;
            p++;
            if (depth == 0) return p;
        }
        return NULL;
    }
    const char *start = p;
    while (p < end && *p != ',' && *p != '}' && *p != ']' && *p != ' ' && *p != '\t' && *p != '\r') p++;
    return p > start ? p : NULL;
}

// Decodes the top-level "text" string of a JSON object into text. Returns 0, or -1 with a
// reason in problem.
static int json_text_field(const char *line, size_t length, Bytes *text, Bytes *key, const char **problem) {
    const char *p = line, *end = line + length;
    p = json_skip_space(p, end);
    if (p >= end || *p != '{') {
        *problem = "not a JSON object";
        return -1;
    }
    p = json_skip_space(p + 1, end);
    int found = 0;
    while (p < end && *p != '}') {
        key->size = 0;
        p = json_string(p, end, key);
        if (p) p = json_skip_space(p, end);
        if (!p || p >= end || *p != ':') break;
        p = json_skip_space(p + 1, end);
        if (key->size == 4 && memcmp(key->data, "text", 4) == 0) {
            text->size = 0;
            p = p < end && *p == '"' ? json_string(p, end, text) : NULL;
            if (!p) {
                *problem = "the \"text\" field is not a valid string";
                return -1;
            }
            found = 1;
        } else {
            p = json_skip_value(p, end);
            if (!p) break;
        }
        p = json_skip_space(p, end);
        if (p < end && *p == ',') p = json_skip_space(p + 1, end);
        else if (p >= end || *p != '}') break;
    }
    int closed = p && p < end && *p == '}' && json_skip_space(p + 1, end) == end;
    if (closed && found) return 0;
    *problem = closed ? "no \"text\" field" : "malformed JSON";
    return -1;
}

// ---- documents: a streaming reader that splits one input file -------------------------

typedef struct {
    const ShardsOptions *options;
    const char *path;
    InputFile *input;
    int is_jsonl;
    Bytes buffer;          // unread input in [start, buffer.size)
    size_t start;
    size_t scan_from;      // separator search resumes here
    int at_end;            // the whole file is in the buffer
    uint64_t bytes_read;   // of the file itself (compressed bytes for a compressed file)
    int64_t line_number;
    Bytes document;        // assembled or decoded document text
    Bytes key;             // scratch for JSON keys
} DocumentReader;

// Appends the next block of the file to the buffer, dropping consumed bytes first.
static int reader_fill(DocumentReader *reader, char *error) {
    if (reader->start > 0) {
        memmove(reader->buffer.data, reader->buffer.data + reader->start, reader->buffer.size - reader->start);
        reader->buffer.size -= reader->start;
        reader->scan_from -= reader->start;
        reader->start = 0;
    }
    if (bytes_reserve(&reader->buffer, READ_BLOCK_BYTES) != 0) return fail(error, "error: out of memory");
    long got = input_read(reader->input, reader->buffer.data + reader->buffer.size,
                          reader->buffer.capacity - reader->buffer.size, error, SHARDS_ERROR_SIZE);
    if (got < 0) return -1;
    reader->buffer.size += (size_t)got;
    reader->bytes_read = input_file_bytes(reader->input);
    if (got == 0) reader->at_end = 1;
    return 0;
}

static int reader_open(DocumentReader *reader, const ShardsOptions *options, const char *path, char *error) {
    reader->options = options;
    reader->path = path;
    char plain_name[4096];
    input_plain_name(path, plain_name, sizeof(plain_name));
    reader->is_jsonl = ends_with(plain_name, ".jsonl");
    reader->buffer.size = reader->start = reader->scan_from = 0;
    reader->at_end = 0;
    reader->bytes_read = 0;
    reader->line_number = 0;
    reader->input = input_open(path, error, SHARDS_ERROR_SIZE);
    return reader->input ? 0 : -1;
}

static void reader_close(DocumentReader *reader) {
    input_close(reader->input);
    reader->input = NULL;
}

static void reader_free(DocumentReader *reader) {
    reader_close(reader);
    free(reader->buffer.data);
    free(reader->document.data);
    free(reader->key.data);
}

// The next line without its '\n'; 0 at the end of the file.
static int reader_next_line(DocumentReader *reader, const char **line, size_t *length, char *error) {
    for (;;) {
        char *begin = reader->buffer.data + reader->start;
        size_t available = reader->buffer.size - reader->start;
        char *newline = available ? (char *)memchr(begin + (reader->scan_from - reader->start), '\n',
                                                   available - (reader->scan_from - reader->start))
                                  : NULL;
        if (newline || (reader->at_end && available > 0)) {
            *line = begin;
            *length = newline ? (size_t)(newline - begin) : available;
            reader->start += *length + (newline ? 1 : 0);
            reader->scan_from = reader->start;
            reader->line_number++;
            return 1;
        }
        if (reader->at_end) return 0;
        reader->scan_from = reader->buffer.size;
        if (reader_fill(reader, error) != 0) return -1;
    }
}

static int is_blank(const char *text, size_t length) {
    for (size_t i = 0; i < length; i++)
        if (text[i] != ' ' && text[i] != '\t' && text[i] != '\r' && text[i] != '\f' && text[i] != '\v') return 0;
    return 1;
}

// Finds needle in [haystack, haystack + length).
static const char *find_bytes(const char *haystack, size_t length, const char *needle, size_t needle_length) {
    if (needle_length > length) return NULL;
    const char *last = haystack + (length - needle_length);
    for (const char *p = haystack; p <= last;) {
        p = (const char *)memchr(p, needle[0], (size_t)(last - p) + 1);
        if (!p) return NULL;
        if (memcmp(p, needle, needle_length) == 0) return p;
        p++;
    }
    return NULL;
}

// The next non-empty document of the file: 1 and its text, 0 at the end, -1 on error.
static int reader_next_document(DocumentReader *reader, const char **text, size_t *length, char *error) {
    const ShardsOptions *options = reader->options;
    if (reader->is_jsonl) {
        const char *line;
        size_t line_length;
        int status;
        while ((status = reader_next_line(reader, &line, &line_length, error)) == 1) {
            if (is_blank(line, line_length)) continue;
            const char *problem;
            if (json_text_field(line, line_length, &reader->document, &reader->key, &problem) != 0)
                return fail(error, "error: %s:%lld: %s", reader->path, (long long)reader->line_number, problem);
            if (reader->document.size == 0) continue;
            *text = reader->document.data;
            *length = reader->document.size;
            return 1;
        }
        return status;
    }
    if (options->split_mode == SPLIT_BLANK_LINES) {
        reader->document.size = 0;
        const char *line;
        size_t line_length;
        int status;
        while ((status = reader_next_line(reader, &line, &line_length, error)) == 1) {
            if (is_blank(line, line_length)) {
                if (reader->document.size > 0) break;
                continue;
            }
            if ((reader->document.size > 0 && bytes_append(&reader->document, "\n", 1) != 0) ||
                bytes_append(&reader->document, line, line_length) != 0)
                return fail(error, "error: out of memory");
        }
        if (status < 0) return -1;
        if (reader->document.size == 0) return 0;
        *text = reader->document.data;
        *length = reader->document.size;
        return 1;
    }
    size_t separator_length = options->split_mode == SPLIT_SEPARATOR ? strlen(options->separator) : 0;
    for (;;) {
        const char *begin = reader->buffer.data + reader->start;
        const char *found = NULL;
        if (separator_length > 0)
            found = find_bytes(reader->buffer.data + reader->scan_from, reader->buffer.size - reader->scan_from,
                               options->separator, separator_length);
        if (found || reader->at_end) {
            size_t document_length = found ? (size_t)(found - begin) : reader->buffer.size - reader->start;
            reader->start += document_length + (found ? separator_length : 0);
            reader->scan_from = reader->start;
            if (document_length == 0) {
                if (found) continue;
                return 0;
            }
            *text = begin;
            *length = document_length;
            return 1;
        }
        // Resume the search where a separator cut by the block end could start.
        size_t keep = separator_length > 1 ? separator_length - 1 : 0;
        size_t scanned_to = reader->buffer.size > keep ? reader->buffer.size - keep : 0;
        reader->scan_from = scanned_to > reader->start ? scanned_to : reader->start;
        if (reader_fill(reader, error) != 0) return -1;
    }
}

// ---- chunks: the unit of work of the tokenizing threads --------------------------------

typedef enum { CHUNK_FREE, CHUNK_QUEUED, CHUNK_DONE, CHUNK_FAILED } ChunkState;

typedef struct {
    Bytes text;
    size_t *document_ends;        // end offset of each document in text
    unsigned char *document_is_val;
    size_t document_count, document_capacity;
    uint64_t input_bytes;         // file bytes read for this chunk, for the progress bar
    Tokens train, val;
    ChunkState state;
} Chunk;

static int chunk_add_document(Chunk *chunk, const char *text, size_t length, int is_val) {
    if (chunk->document_count == chunk->document_capacity) {
        size_t capacity = chunk->document_capacity ? chunk->document_capacity * 2 : 256;
        size_t *ends = (size_t *)realloc(chunk->document_ends, capacity * sizeof(size_t));
        if (!ends) return -1;
        chunk->document_ends = ends;
        unsigned char *is_val = (unsigned char *)realloc(chunk->document_is_val, capacity);
        if (!is_val) return -1;
        chunk->document_is_val = is_val;
        chunk->document_capacity = capacity;
    }
    if (bytes_append(&chunk->text, text, length) != 0) return -1;
    chunk->document_ends[chunk->document_count] = chunk->text.size;
    chunk->document_is_val[chunk->document_count] = (unsigned char)is_val;
    chunk->document_count++;
    return 0;
}

static void chunk_clear(Chunk *chunk) {
    chunk->text.size = 0;
    chunk->document_count = 0;
    chunk->input_bytes = 0;
    chunk->train.count = chunk->val.count = 0;
    chunk->state = CHUNK_FREE;
}

static void chunk_free(Chunk *chunk) {
    free(chunk->text.data);
    free(chunk->document_ends);
    free(chunk->document_is_val);
    free(chunk->train.ids);
    free(chunk->val.ids);
}

// BOS, the document's tokens, and EOS when asked, for every document of the chunk.
static int chunk_tokenize(Chunk *chunk, const Tokenizer *tokenizer, int bos_id, int eos_id) {
    size_t start = 0;
    for (size_t i = 0; i < chunk->document_count; i++) {
        Tokens *out = chunk->document_is_val[i] ? &chunk->val : &chunk->train;
        size_t end = chunk->document_ends[i];
        if (bos_id >= 0 && tokens_push(out, (uint32_t)bos_id) != 0) return -1;
        if (tokenizer_encode(tokenizer, chunk->text.data + start, end - start, &out->ids, &out->count,
                             &out->capacity) != 0)
            return -1;
        if (eos_id >= 0 && tokens_push(out, (uint32_t)eos_id) != 0) return -1;
        start = end;
    }
    return 0;
}

// ---- output: a numbered series of shards ------------------------------------------------

typedef struct {
    const char *dir;
    const char *prefix;       // "train" or "val"
    int token_bytes;
    int64_t shard_tokens;
    ShardWriter writer;
    int writer_open;
    int64_t shards_written;
    int64_t tokens_written;
} ShardSeries;

static void series_path(const ShardSeries *series, int64_t index, char *path, size_t size) {
    snprintf(path, size, "%s/%s_%06lld.bin", series->dir, series->prefix, (long long)index);
}

static int series_append(ShardSeries *series, const uint32_t *ids, size_t count, char *error) {
    while (count > 0) {
        if (!series->writer_open) {
            char path[4096];
            series_path(series, series->shards_written, path, sizeof(path));
            if (shard_writer_open(&series->writer, path, series->token_bytes, error, SHARDS_ERROR_SIZE) != 0)
                return -1;
            series->writer_open = 1;
        }
        int64_t room = series->shard_tokens - series->writer.token_count;
        size_t take = (uint64_t)room < count ? (size_t)room : count;
        if (shard_writer_append(&series->writer, ids, (int64_t)take, error, SHARDS_ERROR_SIZE) != 0) return -1;
        ids += take;
        count -= take;
        series->tokens_written += (int64_t)take;
        if (series->writer.token_count == series->shard_tokens) {
            series->writer_open = 0;
            if (shard_writer_close(&series->writer, error, SHARDS_ERROR_SIZE) != 0) return -1;
            series->shards_written++;
        }
    }
    return 0;
}

// Completes the last shard.
static int series_finish(ShardSeries *series, char *error) {
    if (series->writer_open) {
        series->writer_open = 0;
        if (shard_writer_close(&series->writer, error, SHARDS_ERROR_SIZE) != 0) return -1;
        series->shards_written++;
    }
    return 0;
}

static void series_abort(ShardSeries *series) {
    if (series->writer_open) shard_writer_abort(&series->writer);
    series->writer_open = 0;
}

// ---- the output folder: written beside it, renamed into place at the end -------------------
// The shards go to DIR.partial; only a complete run renames it to DIR, so a run that fails or is
// killed leaves DIR as it was (and a DIR.partial that the next run replaces). A DIR that holds
// anything is refused unless --overwrite, which replaces a folder of shards and nothing else.

static int is_shard_file_name(const char *name) {
    const char *rest = strncmp(name, "train_", 6) == 0 ? name + 6 : strncmp(name, "val_", 4) == 0 ? name + 4 : NULL;
    if (!rest || !isdigit((unsigned char)*rest)) return 0;
    while (isdigit((unsigned char)*rest)) rest++;
    return strcmp(rest, ".bin") == 0 || strcmp(rest, ".bin.tmp") == 0;
}

// The entries of DIR other than "." and "..": how many, the first name, and the first that is not
// a shard (empty when all are). 0 when DIR does not exist.
static int scan_output_dir(const char *dir, int *entries, char *first, char *stranger, char *error) {
    *entries = 0;
    first[0] = stranger[0] = '\0';
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : fail(error, "error: %s: %s", dir, strerror(errno));
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        if (strcmp(entry->d_name, ".") == 0 || strcmp(entry->d_name, "..") == 0) continue;
        if ((*entries)++ == 0) snprintf(first, 256, "%s", entry->d_name);
        if (!stranger[0] && !is_shard_file_name(entry->d_name)) snprintf(stranger, 256, "%s", entry->d_name);
    }
    closedir(d);
    return 0;
}

// Removes a folder of shards (shard files only; anything else makes the rmdir fail, named).
static int remove_shard_dir(const char *dir, char *error) {
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : fail(error, "error: %s: %s", dir, strerror(errno));
    struct dirent *entry;
    int status = 0;
    while (status == 0 && (entry = readdir(d)) != NULL) {
        if (!is_shard_file_name(entry->d_name)) continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, entry->d_name);
        if (remove(path) != 0) status = fail(error, "error: %s: cannot remove: %s", path, strerror(errno));
    }
    closedir(d);
    if (status == 0 && rmdir(dir) != 0) status = fail(error, "error: %s: cannot remove: %s", dir, strerror(errno));
    return status;
}

// The output folder may be written: empty, missing, or shards with --overwrite; no input lies in
// it or in the partial folder (the run would read its own output). Prepares an empty partial.
static int prepare_output(const ShardsOptions *options, const FileList *files, const char *partial, char *error) {
    const char *dir = options->output_dir;
    int entries;
    char first[256], stranger[256];
    struct stat info;
    if (stat(dir, &info) == 0 && !S_ISDIR(info.st_mode)) return fail(error, "error: %s: the output is not a directory", dir);
    const char *folders[2] = {dir, partial};
    for (int k = 0; k < 2; k++) {
        char resolved[PATH_MAX];
        if (!realpath(folders[k], resolved)) continue;
        size_t length = strlen(resolved);
        for (size_t i = 0; i < files->count; i++) {
            char input[PATH_MAX];
            if (realpath(files->paths[i], input) && strncmp(input, resolved, length) == 0 && input[length] == '/')
                return fail(error, "error: %s: an input inside the output directory %s (the run would read its own shards)",
                            files->paths[i], folders[k]);
        }
    }
    if (scan_output_dir(dir, &entries, first, stranger, error) != 0) return -1;
    if (entries > 0 && !options->overwrite)
        return fail(error, "error: %s: the output directory is not empty (%d entries, e.g. %s): --overwrite replaces its shards",
                    dir, entries, first);
    if (entries > 0 && stranger[0])
        return fail(error, "error: %s: holds %s, which is not a shard: --overwrite replaces a folder of shards only", dir,
                    stranger);
    if (scan_output_dir(partial, &entries, first, stranger, error) != 0) return -1;
    if (stranger[0]) return fail(error, "error: %s: holds %s, not a shard of an unfinished run: remove it", partial, stranger);
    if (remove_shard_dir(partial, error) != 0) return -1;
    return make_directories(partial, error, SHARDS_ERROR_SIZE);
}

// The complete partial folder becomes the output folder; a replaced one goes afterwards.
static int publish_output(const char *dir, const char *partial, char *error) {
    char replaced[4200];
    snprintf(replaced, sizeof(replaced), "%s.replaced", dir);
    if (remove_shard_dir(replaced, error) != 0) return -1;
    int had_output = rename(dir, replaced) == 0;
    if (!had_output && errno != ENOENT) return fail(error, "error: %s: cannot move aside: %s", dir, strerror(errno));
    if (rename(partial, dir) != 0) return fail(error, "error: %s: cannot rename to %s: %s", partial, dir, strerror(errno));
    return had_output ? remove_shard_dir(replaced, error) : 0;
}

// ---- the run: reader, workers, writer ---------------------------------------------------

typedef struct {
    const ShardsOptions *options;
    Tokenizer *tokenizer;
    int bos_id, eos_id;
    Chunk *chunks;             // ring of slot_count slots; chunk n lives in slot n % slot_count
    int slot_count;
    int64_t chunks_filled;     // chunks handed to the workers
    int64_t chunks_started;    // chunks a worker has taken
    int64_t chunks_written;
    int stopping;
    pthread_mutex_t lock;
    pthread_cond_t work_ready, work_done;
    pthread_t *workers;
    int worker_count;
    ShardSeries train, val;
    int64_t documents, val_documents, total_documents;
    int large_document_warned;
    uint64_t input_bytes_total, input_bytes_done;
    double start_seconds, last_progress_seconds;
    int show_progress, progress_shown;
} ShardsRun;

static void *tokenize_worker(void *argument) {
    ShardsRun *run = (ShardsRun *)argument;
    for (;;) {
        pthread_mutex_lock(&run->lock);
        while (!run->stopping && run->chunks_started == run->chunks_filled)
            pthread_cond_wait(&run->work_ready, &run->lock);
        if (run->chunks_started == run->chunks_filled) {
            pthread_mutex_unlock(&run->lock);
            return NULL;
        }
        Chunk *chunk = &run->chunks[run->chunks_started++ % run->slot_count];
        pthread_mutex_unlock(&run->lock);
        int status = chunk_tokenize(chunk, run->tokenizer, run->bos_id, run->eos_id);
        pthread_mutex_lock(&run->lock);
        chunk->state = status == 0 ? CHUNK_DONE : CHUNK_FAILED;
        pthread_cond_broadcast(&run->work_done);
        pthread_mutex_unlock(&run->lock);
    }
}

static void show_progress(ShardsRun *run, int final) {
    double now = seconds_now();
    if (!run->show_progress || (!final && now - run->last_progress_seconds < 0.1)) return;
    run->last_progress_seconds = now;
    double total = run->input_bytes_total ? (double)run->input_bytes_total : 1.0;
    double fraction = (double)run->input_bytes_done / total;
    if (fraction > 1.0) fraction = 1.0;
    enum { BAR_WIDTH = 30 };
    char bar[BAR_WIDTH + 1];
    int filled = (int)(fraction * BAR_WIDTH);
    for (int i = 0; i < BAR_WIDTH; i++) bar[i] = i < filled ? '#' : '.';
    bar[BAR_WIDTH] = '\0';
    double elapsed = now - run->start_seconds;
    fprintf(stderr, "\r[%s] %5.1f%% %.1f/%.1f MB %.2f MB/s %lld tokens", bar, 100.0 * fraction,
            (double)run->input_bytes_done / 1e6, total / 1e6,
            elapsed > 0 ? (double)run->input_bytes_done / 1e6 / elapsed : 0.0,
            (long long)(run->train.tokens_written + run->val.tokens_written));
    if (final) fprintf(stderr, "\n");
    run->progress_shown = 1;
}

// Waits for the oldest chunk in flight and writes its tokens.
static int write_oldest_chunk(ShardsRun *run, char *error) {
    Chunk *chunk = &run->chunks[run->chunks_written % run->slot_count];
    pthread_mutex_lock(&run->lock);
    while (chunk->state == CHUNK_QUEUED) pthread_cond_wait(&run->work_done, &run->lock);
    pthread_mutex_unlock(&run->lock);
    if (chunk->state == CHUNK_FAILED) return fail(error, "error: out of memory while tokenizing");
    if (series_append(&run->train, chunk->train.ids, chunk->train.count, error) != 0 ||
        series_append(&run->val, chunk->val.ids, chunk->val.count, error) != 0)
        return -1;
    run->input_bytes_done += chunk->input_bytes;
    chunk_clear(chunk);
    run->chunks_written++;
    show_progress(run, 0);
    return 0;
}

// The chunk to fill next, once its slot is free.
static int next_free_chunk(ShardsRun *run, Chunk **chunk, char *error) {
    while (run->chunks_filled - run->chunks_written == run->slot_count)
        if (write_oldest_chunk(run, error) != 0) return -1;
    *chunk = &run->chunks[run->chunks_filled % run->slot_count];
    return 0;
}

static void submit_chunk(ShardsRun *run, Chunk *chunk) {
    pthread_mutex_lock(&run->lock);
    chunk->state = CHUNK_QUEUED;
    run->chunks_filled++;
    pthread_cond_signal(&run->work_ready);
    pthread_mutex_unlock(&run->lock);
}

// Evenly spread: document i is validation when floor((i+1) f) > floor(i f).
static int is_validation_document(const ShardsRun *run, int64_t index) {
    const ShardsOptions *options = run->options;
    if (options->val_docs >= 0) {
        if (run->total_documents == 0) return 0;
        return (index + 1) * options->val_docs / run->total_documents > index * options->val_docs / run->total_documents;
    }
    return floor((double)(index + 1) * options->val_fraction) > floor((double)index * options->val_fraction);
}

// Counts the documents of every input (for --val-docs, which needs the total in advance).
static int count_documents(const ShardsOptions *options, const FileList *files, int64_t *total, char *error) {
    DocumentReader reader;
    memset(&reader, 0, sizeof(reader));
    int status = 0;
    *total = 0;
    for (size_t f = 0; f < files->count && status == 0; f++) {
        status = reader_open(&reader, options, files->paths[f], error);
        const char *text;
        size_t length;
        int got;
        while (status == 0 && (got = reader_next_document(&reader, &text, &length, error)) != 0) {
            if (got < 0) status = -1;
            else (*total)++;
        }
        reader_close(&reader);
    }
    reader_free(&reader);
    return status;
}

// Reads every input in order, fills and submits chunks, writes them as they finish.
static int produce_chunks(ShardsRun *run, const FileList *files, char *error) {
    DocumentReader reader;
    memset(&reader, 0, sizeof(reader));
    Chunk *chunk = NULL;
    int status = next_free_chunk(run, &chunk, error);
    for (size_t f = 0; f < files->count && status == 0; f++) {
        status = reader_open(&reader, run->options, files->paths[f], error);
        uint64_t bytes_counted = 0;
        const char *text;
        size_t length;
        int got;
        while (status == 0 && (got = reader_next_document(&reader, &text, &length, error)) != 0) {
            if (got < 0) {
                status = -1;
                break;
            }
            if (length > LARGE_DOCUMENT_BYTES && !run->large_document_warned) {
                // One document is encoded by one thread at once: about 40 bytes of memory per byte.
                fprintf(stderr, "warning: %s: a document of %.0f MB; encoding one takes about %.1f GB of memory per thread "
                                "(split such files with --separator or --blank-lines, or use fewer --threads)\n",
                        files->paths[f], length / 1e6, 40.0 * length / 1e9);
                run->large_document_warned = 1;
            }
            int is_val = is_validation_document(run, run->documents);
            run->documents++;
            run->val_documents += is_val;
            if (chunk_add_document(chunk, text, length, is_val) != 0) {
                status = fail(error, "error: out of memory");
                break;
            }
            chunk->input_bytes += reader.bytes_read - bytes_counted;
            bytes_counted = reader.bytes_read;
            if (chunk->text.size >= CHUNK_TEXT_BYTES) {
                submit_chunk(run, chunk);
                status = next_free_chunk(run, &chunk, error);
            }
        }
        if (status == 0) chunk->input_bytes += reader.bytes_read - bytes_counted;
        reader_close(&reader);
    }
    reader_free(&reader);
    if (status == 0) submit_chunk(run, chunk);
    while (status == 0 && run->chunks_written < run->chunks_filled) status = write_oldest_chunk(run, error);
    return status;
}

static int start_workers(ShardsRun *run, char *error) {
    run->workers = (pthread_t *)calloc((size_t)run->options->threads, sizeof(pthread_t));
    if (!run->workers) return fail(error, "error: out of memory");
    for (int i = 0; i < run->options->threads; i++) {
        int status = pthread_create(&run->workers[i], NULL, tokenize_worker, run);
        if (status != 0) return fail(error, "error: cannot start a thread: %s", strerror(status));
        run->worker_count++;
    }
    return 0;
}

static void stop_workers(ShardsRun *run) {
    pthread_mutex_lock(&run->lock);
    run->stopping = 1;
    pthread_cond_broadcast(&run->work_ready);
    pthread_mutex_unlock(&run->lock);
    for (int i = 0; i < run->worker_count; i++) pthread_join(run->workers[i], NULL);
    free(run->workers);
}

static void print_summary(const ShardsRun *run) {
    double elapsed = seconds_now() - run->start_seconds;
    double megabytes = (double)run->input_bytes_total / 1e6;
    printf("documents: %lld (train %lld, val %lld)\n", (long long)run->documents,
           (long long)(run->documents - run->val_documents), (long long)run->val_documents);
    printf("input: %.2f MB (%llu bytes)\n", megabytes, (unsigned long long)run->input_bytes_total);
    printf("tokens: %lld (train %lld in %lld shards, val %lld in %lld shards, uint%d)\n",
           (long long)(run->train.tokens_written + run->val.tokens_written), (long long)run->train.tokens_written,
           (long long)run->train.shards_written, (long long)run->val.tokens_written,
           (long long)run->val.shards_written, run->train.token_bytes * 8);
    printf("time: %.1f s, %.2f MB/s\n", elapsed, elapsed > 0 ? megabytes / elapsed : 0.0);
}

static int run_shards(const ShardsOptions *options, char *error) {
    FileList files;
    memset(&files, 0, sizeof(files));
    int status = 0;
    for (int i = 0; i < options->input_count && status == 0; i++)
        status = collect_inputs(options->inputs[i], &files, error);
    if (status != 0) {
        file_list_free(&files);
        return -1;
    }
    char tokenizer_error[SHARDS_ERROR_SIZE] = "";
    Tokenizer *tokenizer = tokenizer_load(options->tokenizer_path, tokenizer_error, sizeof(tokenizer_error));
    if (!tokenizer) {
        file_list_free(&files);
        return fail(error, "error: %s", tokenizer_error);
    }
    ShardsRun run;
    memset(&run, 0, sizeof(run));
    run.options = options;
    run.tokenizer = tokenizer;
    run.bos_id = tokenizer_bos_id(tokenizer);
    run.eos_id = options->append_eos ? tokenizer_eos_id(tokenizer) : -1;
    if (run.bos_id < 0)
        fprintf(stderr, "warning: %s: the tokenizer has no BOS token: documents start without one\n",
                options->tokenizer_path);
    int first_missing, missing = tokenizer_missing_ids(tokenizer, &first_missing);
    if (missing > 0)
        fprintf(stderr, "warning: %s: %d of the %d ids have no token (the first: %d): a gap in the vocabulary\n",
                options->tokenizer_path, missing, tokenizer_vocab_size(tokenizer), first_missing);
    if (options->append_eos && run.eos_id < 0)
        status = fail(error, "error: %s: --eos given but the tokenizer has no EOS token", options->tokenizer_path);
    int token_bytes = shard_token_bytes_for_vocab(tokenizer_vocab_size(tokenizer));
    char partial[4200];
    size_t dir_length = strlen(options->output_dir);
    while (dir_length > 1 && options->output_dir[dir_length - 1] == '/') dir_length--;
    snprintf(partial, sizeof(partial), "%.*s.partial", (int)dir_length, options->output_dir);
    ShardSeries train = {partial, "train", token_bytes, options->shard_tokens, {0}, 0, 0, 0};
    ShardSeries val = {partial, "val", token_bytes, options->shard_tokens, {0}, 0, 0, 0};
    run.train = train;
    run.val = val;
    run.input_bytes_total = files.total_bytes;
    run.slot_count = 2 * options->threads + 2;
    run.chunks = (Chunk *)calloc((size_t)run.slot_count, sizeof(Chunk));
    run.show_progress = isatty(fileno(stderr));
    run.start_seconds = seconds_now();
    if (status == 0 && !run.chunks) status = fail(error, "error: out of memory");
    if (status == 0 && options->val_docs >= 0) status = count_documents(options, &files, &run.total_documents, error);
    if (status == 0 && options->val_docs > 0 && options->val_docs >= run.total_documents)
        status = fail(error, "error: --val-docs %lld takes all %lld documents of the inputs: none is left for training",
                      (long long)options->val_docs, (long long)run.total_documents);
    if (status == 0) status = prepare_output(options, &files, partial, error);
    pthread_mutex_init(&run.lock, NULL);
    pthread_cond_init(&run.work_ready, NULL);
    pthread_cond_init(&run.work_done, NULL);
    if (status == 0) status = start_workers(&run, error);
    if (status == 0) status = produce_chunks(&run, &files, error);
    stop_workers(&run);
    if (status == 0) status = series_finish(&run.train, error);
    if (status == 0) status = series_finish(&run.val, error);
    if (run.progress_shown) show_progress(&run, 1);
    if (status == 0 && run.documents == 0) status = fail(error, "error: no documents in the inputs");
    series_abort(&run.train);
    series_abort(&run.val);
    char partial_error[SHARDS_ERROR_SIZE];
    if (status == 0) status = publish_output(options->output_dir, partial, error);
    else remove_shard_dir(partial, partial_error);  // the output folder stays as it was
    if (status == 0) print_summary(&run);
    pthread_cond_destroy(&run.work_done);
    pthread_cond_destroy(&run.work_ready);
    pthread_mutex_destroy(&run.lock);
    for (int i = 0; run.chunks && i < run.slot_count; i++) chunk_free(&run.chunks[i]);
    free(run.chunks);
    tokenizer_free(tokenizer);
    file_list_free(&files);
    return status;
}

// ---- command line -------------------------------------------------------------------------

static void print_usage(FILE *out) {
    fprintf(out,
            "usage: tokenize shards -t TOKENIZER.json -o DIR [options] INPUT...\n"
            "Tokenizes text into DIR/train_000000.bin ... and DIR/val_000000.bin ... (llm.c shard format).\n"
            "INPUT: text files (one document each unless split), .jsonl files (one document per line, its\n"
            "\"text\" field), or directories, walked recursively in sorted order (skipping names that start\n"
            "with '.'). NAME.gz and NAME.zst are read decompressed, as NAME; this build reads %s.\n"
            "Parquet: convert it to JSONL first (scripts/parquet_to_jsonl.py).\n"
            "  -t, --tokenizer PATH   tokenizer.json\n"
            "  -o, --output DIR       output directory: created, or empty (written as DIR.partial, renamed at the end)\n"
            "  --overwrite            replace the shards of an output directory that holds some\n"
            "  --separator STRING     split text files into documents at STRING, e.g. '<|endoftext|>'\n"
            "  --blank-lines          split text files into documents at blank lines\n"
            "  --eos                  end every document with EOS (every document starts with BOS)\n"
            "  --val-fraction F       put the fraction F of the documents, evenly spread, in validation\n"
            "  --val-docs N           put N documents, evenly spread, in validation\n"
            "  --shard-tokens N       tokens per shard (default %lld)\n"
            "  --threads N            tokenizing threads (default: the number of online processors)\n",
            input_compressions(), (long long)default_shard_tokens);
}

static int parse_integer(const char *option, const char *text, int64_t minimum, int64_t maximum, int64_t *value,
                         char *error) {
    char *end;
    errno = 0;
    long long parsed = strtoll(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || parsed < minimum || parsed > maximum)
        return fail(error, "error: %s: '%s' is not an integer in [%lld, %lld]", option, text, (long long)minimum,
                    (long long)maximum);
    *value = parsed;
    return 0;
}

static int parse_options(int argc, char **argv, ShardsOptions *options, char *error) {
    memset(options, 0, sizeof(*options));
    options->split_mode = SPLIT_WHOLE_FILE;
    options->val_docs = -1;
    options->shard_tokens = default_shard_tokens;
    long processors = sysconf(_SC_NPROCESSORS_ONLN);
    options->threads = processors > 0 ? (int)processors : 1;
    options->inputs = (char **)calloc((size_t)argc, sizeof(char *));
    if (!options->inputs) return fail(error, "error: out of memory");
    int have_fraction = 0;
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        int takes_value = strcmp(arg, "-t") == 0 || strcmp(arg, "--tokenizer") == 0 || strcmp(arg, "-o") == 0 ||
                          strcmp(arg, "--output") == 0 || strcmp(arg, "--separator") == 0 ||
                          strcmp(arg, "--val-fraction") == 0 || strcmp(arg, "--val-docs") == 0 ||
                          strcmp(arg, "--shard-tokens") == 0 || strcmp(arg, "--threads") == 0;
        if (takes_value && i + 1 >= argc) return fail(error, "error: %s needs a value", arg);
        const char *value = takes_value ? argv[++i] : NULL;
        int64_t number;
        if (strcmp(arg, "-t") == 0 || strcmp(arg, "--tokenizer") == 0) {
            options->tokenizer_path = value;
        } else if (strcmp(arg, "-o") == 0 || strcmp(arg, "--output") == 0) {
            options->output_dir = value;
        } else if (strcmp(arg, "--separator") == 0) {
            if (value[0] == '\0') return fail(error, "error: --separator: the separator is empty");
            options->split_mode = SPLIT_SEPARATOR;
            options->separator = value;
        } else if (strcmp(arg, "--blank-lines") == 0) {
            options->split_mode = SPLIT_BLANK_LINES;
        } else if (strcmp(arg, "--overwrite") == 0) {
            options->overwrite = 1;
        } else if (strcmp(arg, "--eos") == 0) {
            options->append_eos = 1;
        } else if (strcmp(arg, "--val-fraction") == 0) {
            char *end;
            double fraction = strtod(value, &end);
            if (end == value || *end != '\0' || !(fraction >= 0.0 && fraction < 1.0))
                return fail(error, "error: --val-fraction: '%s' is not a number in [0, 1)", value);
            options->val_fraction = fraction;
            have_fraction = 1;
        } else if (strcmp(arg, "--val-docs") == 0) {
            if (parse_integer(arg, value, 0, INT32_MAX, &options->val_docs, error) != 0) return -1;
        } else if (strcmp(arg, "--shard-tokens") == 0) {
            if (parse_integer(arg, value, 1, INT32_MAX, &options->shard_tokens, error) != 0) return -1;
        } else if (strcmp(arg, "--threads") == 0) {
            if (parse_integer(arg, value, 1, 1024, &number, error) != 0) return -1;
            options->threads = (int)number;
        } else if (strcmp(arg, "-h") == 0 || strcmp(arg, "--help") == 0) {
            print_usage(stdout);
            exit(EXIT_SUCCESS);
        } else if (arg[0] == '-' && arg[1] != '\0') {
            return fail(error, "error: unknown option %s (see tokenize shards --help)", arg);
        } else {
            options->inputs[options->input_count++] = argv[i];
        }
    }
    if (!options->tokenizer_path) return fail(error, "error: no tokenizer: give -t TOKENIZER.json");
    if (!options->output_dir || !options->output_dir[0]) return fail(error, "error: no output directory: give -o DIR");
    if (options->input_count == 0) return fail(error, "error: no inputs: give files or directories");
    if (have_fraction && options->val_docs >= 0) return fail(error, "error: give --val-fraction or --val-docs, not both");
    return 0;
}

int shards_command(int argc, char **argv) {
    char error[SHARDS_ERROR_SIZE] = "";
    ShardsOptions options;
    int status = parse_options(argc, argv, &options, error);
    if (status != 0) {
        fprintf(stderr, "%s\n", error);
        if (argc <= 1) print_usage(stderr);
        free(options.inputs);
        return EXIT_FAILURE;
    }
    status = run_shards(&options, error);
    free(options.inputs);
    if (status != 0) {
        fprintf(stderr, "%s\n", error);
        return EXIT_FAILURE;
    }
    return EXIT_SUCCESS;
}
