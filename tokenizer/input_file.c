// Input files, plain or decompressed on the fly; see input_file.h. USE_ZLIB and USE_ZSTD come
// from the Makefile when the headers are found.
#include "input_file.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef USE_ZLIB
#include <zlib.h>
#endif
#ifdef USE_ZSTD
#include <zstd.h>
#endif

enum { RAW_BLOCK_BYTES = 1 << 18 };

typedef enum { INPUT_PLAIN, INPUT_GZIP, INPUT_ZSTD } InputKind;

struct InputFile {
    const char *path;
    FILE *file;
    InputKind kind;
    unsigned char *raw;     // compressed bytes read from the file, [raw_pos, raw_size) not yet used
    size_t raw_size, raw_pos;
    int raw_at_end;
    int stream_complete;    // the last gzip member or zstd frame ended (nothing is cut short)
    uint64_t file_bytes;
#ifdef USE_ZLIB
    z_stream gzip;
    int gzip_ready;
#endif
#ifdef USE_ZSTD
    ZSTD_DStream *zstd;
#endif
};

static int input_fail(char *error, size_t error_size, const char *format, ...) {
    va_list args;
    va_start(args, format);
    vsnprintf(error, error_size, format, args);
    va_end(args);
    return -1;
}

static int has_suffix(const char *text, const char *suffix) {
    size_t text_length = strlen(text), suffix_length = strlen(suffix);
    return text_length > suffix_length && strcmp(text + text_length - suffix_length, suffix) == 0;
}

static InputKind kind_of(const char *path) {
    if (has_suffix(path, ".gz")) return INPUT_GZIP;
    if (has_suffix(path, ".zst")) return INPUT_ZSTD;
    return INPUT_PLAIN;
}

void input_plain_name(const char *path, char *name, size_t name_size) {
    size_t length = strlen(path);
    InputKind kind = kind_of(path);
    if (kind == INPUT_GZIP) length -= 3;
    if (kind == INPUT_ZSTD) length -= 4;
    snprintf(name, name_size, "%.*s", (int)length, path);
}

const char *input_compressions(void) {
#if defined(USE_ZLIB) && defined(USE_ZSTD)
    return "gzip (.gz) and zstd (.zst)";
#elif defined(USE_ZLIB)
    return "gzip (.gz); not zstd (.zst): this build has no libzstd";
#elif defined(USE_ZSTD)
    return "zstd (.zst); not gzip (.gz): this build has no zlib";
#else
    return "none: this build has neither zlib (.gz) nor libzstd (.zst)";
#endif
}

// Sets up the decompressor of in->kind; refuses a kind this build cannot read.
static int decoder_start(InputFile *in, char *error, size_t error_size) {
    if (in->kind == INPUT_GZIP) {
#ifdef USE_ZLIB
        if (inflateInit2(&in->gzip, 15 + 32) != Z_OK)  // 15 + 32: a zlib or gzip header, found by itself
            return input_fail(error, error_size, "error: %s: cannot start zlib", in->path);
        in->gzip_ready = 1;
#else
        return input_fail(error, error_size, "error: %s: this build cannot read .gz files (install zlib1g-dev and rebuild)",
                          in->path);
#endif
    }
    if (in->kind == INPUT_ZSTD) {
#ifdef USE_ZSTD
        in->zstd = ZSTD_createDStream();
        if (!in->zstd || ZSTD_isError(ZSTD_initDStream(in->zstd)))
            return input_fail(error, error_size, "error: %s: cannot start libzstd", in->path);
#else
        return input_fail(error, error_size, "error: %s: this build cannot read .zst files (install libzstd-dev and rebuild)",
                          in->path);
#endif
    }
    in->stream_complete = in->kind == INPUT_PLAIN;
    return 0;
}

InputFile *input_open(const char *path, char *error, size_t error_size) {
    InputFile *in = (InputFile *)calloc(1, sizeof(InputFile));
    if (!in) { input_fail(error, error_size, "error: out of memory"); return NULL; }
    in->path = path;
    in->kind = kind_of(path);
    if (in->kind != INPUT_PLAIN && !(in->raw = (unsigned char *)malloc(RAW_BLOCK_BYTES))) {
        input_fail(error, error_size, "error: out of memory");
        input_close(in);
        return NULL;
    }
    if (decoder_start(in, error, error_size) != 0) { input_close(in); return NULL; }
    in->file = fopen(path, "rb");
    if (!in->file) {
        input_fail(error, error_size, "error: %s: cannot open: %s", path, strerror(errno));
        input_close(in);
        return NULL;
    }
    return in;
}

#if defined(USE_ZLIB) || defined(USE_ZSTD)
// Refills the compressed bytes when all were used.
static int raw_fill(InputFile *in, char *error, size_t error_size) {
    if (in->raw_pos < in->raw_size || in->raw_at_end) return 0;
    in->raw_size = fread(in->raw, 1, RAW_BLOCK_BYTES, in->file);
    in->raw_pos = 0;
    in->file_bytes += in->raw_size;
    if (ferror(in->file)) return input_fail(error, error_size, "error: %s: cannot read: %s", in->path, strerror(errno));
    if (in->raw_size == 0) in->raw_at_end = 1;
    return 0;
}
#endif

#ifdef USE_ZLIB
static long gzip_read(InputFile *in, char *out, size_t size, char *error, size_t error_size) {
    size_t produced = 0;
    while (produced < size) {
        if (raw_fill(in, error, error_size) != 0) return -1;
        if (in->raw_pos == in->raw_size && in->stream_complete) break;  // the file ended after a whole member
        if (in->stream_complete) {  // another gzip member follows the one that ended
            if (inflateReset(&in->gzip) != Z_OK) return input_fail(error, error_size, "error: %s: cannot restart zlib", in->path);
            in->stream_complete = 0;
        }
        size_t used_before = in->raw_pos, produced_before = produced;
        in->gzip.next_in = in->raw + in->raw_pos;
        in->gzip.avail_in = (uInt)(in->raw_size - in->raw_pos);
        in->gzip.next_out = (Bytef *)out + produced;
        in->gzip.avail_out = (uInt)(size - produced);
        int status = inflate(&in->gzip, Z_NO_FLUSH);  // also at the file's end: zlib may hold output still
        in->raw_pos = in->raw_size - in->gzip.avail_in;
        produced = size - in->gzip.avail_out;
        if (status == Z_STREAM_END) in->stream_complete = 1;
        else if (status != Z_OK && status != Z_BUF_ERROR)
            return input_fail(error, error_size, "error: %s: not valid gzip data (%s)", in->path,
                              in->gzip.msg ? in->gzip.msg : "zlib error");
        if (in->raw_at_end && in->raw_pos == used_before && produced == produced_before) break;
    }
    return (long)produced;
}
#endif

#ifdef USE_ZSTD
static long zstd_read(InputFile *in, char *out, size_t size, char *error, size_t error_size) {
    ZSTD_outBuffer output = {out, size, 0};
    while (output.pos < output.size) {
        if (raw_fill(in, error, error_size) != 0) return -1;
        if (in->raw_pos == in->raw_size && in->stream_complete) break;  // the file ended after a whole frame
        size_t used_before = in->raw_pos, produced_before = output.pos;
        ZSTD_inBuffer input = {in->raw, in->raw_size, in->raw_pos};
        size_t status = ZSTD_decompressStream(in->zstd, &output, &input);  // at the end too: it may hold output
        in->raw_pos = input.pos;
        if (ZSTD_isError(status))
            return input_fail(error, error_size, "error: %s: not valid zstd data (%s)", in->path, ZSTD_getErrorName(status));
        in->stream_complete = status == 0;  // 0: a frame ended and all of it was written out
        if (in->raw_at_end && in->raw_pos == used_before && output.pos == produced_before) break;
    }
    return (long)output.pos;
}
#endif

long input_read(InputFile *in, char *out, size_t size, char *error, size_t error_size) {
    long got = 0;
    if (in->kind == INPUT_PLAIN) {
        got = (long)fread(out, 1, size, in->file);
        in->file_bytes += (uint64_t)got;
        if (ferror(in->file)) return input_fail(error, error_size, "error: %s: cannot read: %s", in->path, strerror(errno));
        return got;
    }
#ifdef USE_ZLIB
    if (in->kind == INPUT_GZIP) got = gzip_read(in, out, size, error, error_size);
#endif
#ifdef USE_ZSTD
    if (in->kind == INPUT_ZSTD) got = zstd_read(in, out, size, error, error_size);
#endif
    if (got == 0 && !in->stream_complete)
        return input_fail(error, error_size, "error: %s: the compressed data ends early (a truncated file?)", in->path);
    return got;
}

uint64_t input_file_bytes(const InputFile *in) { return in->file_bytes; }

void input_close(InputFile *in) {
    if (!in) return;
    if (in->file) fclose(in->file);
#ifdef USE_ZLIB
    if (in->gzip_ready) inflateEnd(&in->gzip);
#endif
#ifdef USE_ZSTD
    ZSTD_freeDStream(in->zstd);
#endif
    free(in->raw);
    free(in);
}
