// Token shards in llm.c's file format: a header of 256 little-endian int32, then the tokens.
//   header[0] magic: 20240520 for uint16 tokens, 20240801 for uint32 tokens
//   header[1] version: 1 for uint16, 2 for uint32 (as llm.c writes them)
//   header[2] token count N; the other 253 ints are zero
//   then N tokens, little-endian, 2 or 4 bytes each: file size = 1024 + N * token bytes.
// uint16 is chosen when the vocabulary has at most 65536 ids. Offsets are 64-bit throughout
// (fseeko/ftello, int64_t). Every function that can fail returns 0 or -1 and writes
// "error: <path>: <what is wrong>" into the caller's buffer, so that tests can check error
// paths; the program decides whether to exit (see shard_exit_on_error).
// C code must define _POSIX_C_SOURCE 200809L (or _GNU_SOURCE) before its first system header
// for fseeko, ftello, fileno and fsync; C++ compilers define _GNU_SOURCE already.
#pragma once
#if !defined(__cplusplus) && !defined(_POSIX_C_SOURCE) && !defined(_GNU_SOURCE)
#define _POSIX_C_SOURCE 200809L
#endif
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

enum {
    SHARD_HEADER_INTS = 256,
    SHARD_HEADER_BYTES = SHARD_HEADER_INTS * 4,
    SHARD_MAGIC_UINT16 = 20240520,
    SHARD_MAGIC_UINT32 = 20240801,
    SHARD_VERSION_UINT16 = 1,
    SHARD_VERSION_UINT32 = 2,
    SHARD_ERROR_SIZE = 2048,  // an error buffer large enough for any message here
};

// Tokens converted per fread/fwrite call: bounds the stack buffer of the conversion.
#define SHARD_TOKENS_PER_IO 4096

// A shard open for reading: validated header and size, the file positioned anywhere.
typedef struct {
    char *path;
    FILE *file;
    int token_bytes;      // 2 or 4
    int64_t token_count;
} Shard;

// A shard being written: tokens go to "<path>.tmp", renamed to <path> when complete, so a
// reader never sees a half-written shard under the final name.
typedef struct {
    char *path;
    char *temp_path;
    FILE *file;
    int token_bytes;
    int64_t token_count;
} ShardWriter;

// Formats "error: <path>: <message>" into error and returns -1.
static inline int shard_fail(char *error, size_t error_size, const char *path, const char *format, ...) {
    int used = snprintf(error, error_size, "error: %s: ", path);
    if (used >= 0 && (size_t)used < error_size) {
        va_list args;
        va_start(args, format);
        vsnprintf(error + used, error_size - (size_t)used, format, args);
        va_end(args);
    }
    return -1;
}

// For programs: prints the message and exits non-zero when status is an error.
static inline void shard_exit_on_error(int status, const char *error) {
    if (status != 0) {
        fprintf(stderr, "%s\n", error);
        exit(EXIT_FAILURE);
    }
}

static inline int shard_token_bytes_for_vocab(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

static inline char *shard_copy_string(const char *text) {
    size_t size = strlen(text) + 1;
    char *copy = (char *)malloc(size);
    if (copy) memcpy(copy, text, size);
    return copy;
}

static inline void shard_store_int32_le(unsigned char *bytes, uint32_t value) {
    bytes[0] = (unsigned char)value;
    bytes[1] = (unsigned char)(value >> 8);
    bytes[2] = (unsigned char)(value >> 16);
    bytes[3] = (unsigned char)(value >> 24);
}

static inline uint32_t shard_load_uint32_le(const unsigned char *bytes) {
    return (uint32_t)bytes[0] | (uint32_t)bytes[1] << 8 | (uint32_t)bytes[2] << 16 | (uint32_t)bytes[3] << 24;
}

static inline uint32_t shard_load_token(const unsigned char *bytes, int token_bytes) {
    return token_bytes == 2 ? ((uint32_t)bytes[0] | (uint32_t)bytes[1] << 8) : shard_load_uint32_le(bytes);
}

// ---- writing ---------------------------------------------------------------------------

static inline void shard_writer_free(ShardWriter *writer) {
    free(writer->path);
    free(writer->temp_path);
    writer->path = writer->temp_path = NULL;
    writer->file = NULL;
}

// Removes the temporary file of a writer that will not be completed.
static inline void shard_writer_abort(ShardWriter *writer) {
    if (writer->file) {
        fclose(writer->file);
        remove(writer->temp_path);
    }
    shard_writer_free(writer);
}

// Writes the header of the tokens written so far at the start of the file.
static inline int shard_writer_put_header(ShardWriter *writer, char *error, size_t error_size) {
    unsigned char header[SHARD_HEADER_BYTES];
    memset(header, 0, sizeof(header));
    int is_uint16 = writer->token_bytes == 2;
    shard_store_int32_le(header, is_uint16 ? SHARD_MAGIC_UINT16 : SHARD_MAGIC_UINT32);
    shard_store_int32_le(header + 4, is_uint16 ? SHARD_VERSION_UINT16 : SHARD_VERSION_UINT32);
    shard_store_int32_le(header + 8, (uint32_t)writer->token_count);
    if (fseeko(writer->file, 0, SEEK_SET) != 0 || fwrite(header, 1, sizeof(header), writer->file) != sizeof(header))
        return shard_fail(error, error_size, writer->temp_path, "cannot write the header: %s", strerror(errno));
    return 0;
}

// Creates <path>.tmp with a placeholder header; token_bytes is 2 or 4.
static inline int shard_writer_open(ShardWriter *writer, const char *path, int token_bytes,
                                    char *error, size_t error_size) {
    memset(writer, 0, sizeof(*writer));
    if (token_bytes != 2 && token_bytes != 4)
        return shard_fail(error, error_size, path, "token size %d bytes is neither 2 nor 4", token_bytes);
    size_t path_length = strlen(path);
    writer->path = shard_copy_string(path);
    writer->temp_path = (char *)malloc(path_length + 5);
    if (!writer->path || !writer->temp_path) {
        shard_writer_free(writer);
        return shard_fail(error, error_size, path, "out of memory");
    }
    memcpy(writer->temp_path, path, path_length);
    memcpy(writer->temp_path + path_length, ".tmp", 5);
    writer->token_bytes = token_bytes;
    writer->file = fopen(writer->temp_path, "wb");
    if (!writer->file) {
        int status = shard_fail(error, error_size, writer->temp_path, "cannot create: %s", strerror(errno));
        shard_writer_free(writer);
        return status;
    }
    if (shard_writer_put_header(writer, error, error_size) != 0) {
        shard_writer_abort(writer);
        return -1;
    }
    return 0;
}

// Appends tokens; each must fit the shard's token size, and the count its int32 header field.
static inline int shard_writer_append(ShardWriter *writer, const uint32_t *tokens, int64_t count,
                                      char *error, size_t error_size) {
    if (count > INT32_MAX - writer->token_count)
        return shard_fail(error, error_size, writer->path, "more than %d tokens do not fit the int32 header",
                          INT32_MAX);
    unsigned char bytes[SHARD_TOKENS_PER_IO * 4];
    for (int64_t done = 0; done < count;) {
        int64_t n = count - done < SHARD_TOKENS_PER_IO ? count - done : SHARD_TOKENS_PER_IO;
        for (int64_t i = 0; i < n; i++) {
            uint32_t token = tokens[done + i];
            if (writer->token_bytes == 2) {
                if (token > 65535)
                    return shard_fail(error, error_size, writer->path,
                                      "token id %u does not fit a uint16 shard", (unsigned)token);
                bytes[2 * i] = (unsigned char)token;
                bytes[2 * i + 1] = (unsigned char)(token >> 8);
            } else {
                shard_store_int32_le(bytes + 4 * i, token);
            }
        }
        size_t size = (size_t)n * (size_t)writer->token_bytes;
        if (fwrite(bytes, 1, size, writer->file) != size)
            return shard_fail(error, error_size, writer->temp_path, "cannot write tokens: %s", strerror(errno));
        done += n;
    }
    writer->token_count += count;
    return 0;
}

// Completes the header, flushes to disk and renames the temporary file to the final path.
static inline int shard_writer_close(ShardWriter *writer, char *error, size_t error_size) {
    if (shard_writer_put_header(writer, error, error_size) != 0) {
        shard_writer_abort(writer);
        return -1;
    }
    if (fflush(writer->file) != 0 || fsync(fileno(writer->file)) != 0) {
        shard_fail(error, error_size, writer->temp_path, "cannot flush: %s", strerror(errno));
        shard_writer_abort(writer);
        return -1;
    }
    int close_status = fclose(writer->file);
    writer->file = NULL;
    if (close_status != 0) {
        shard_fail(error, error_size, writer->temp_path, "cannot close: %s", strerror(errno));
        remove(writer->temp_path);
        shard_writer_free(writer);
        return -1;
    }
    if (rename(writer->temp_path, writer->path) != 0) {
        shard_fail(error, error_size, writer->path, "cannot rename from %s: %s", writer->temp_path, strerror(errno));
        remove(writer->temp_path);
        shard_writer_free(writer);
        return -1;
    }
    shard_writer_free(writer);
    return 0;
}

// Writes a whole shard at once.
static inline int shard_write(const char *path, const uint32_t *tokens, int64_t count, int token_bytes,
                              char *error, size_t error_size) {
    ShardWriter writer;
    if (shard_writer_open(&writer, path, token_bytes, error, error_size) != 0) return -1;
    if (shard_writer_append(&writer, tokens, count, error, error_size) != 0) {
        shard_writer_abort(&writer);
        return -1;
    }
    return shard_writer_close(&writer, error, error_size);
}

// ---- reading ---------------------------------------------------------------------------

static inline void shard_close(Shard *shard) {
    if (shard->file) fclose(shard->file);
    free(shard->path);
    memset(shard, 0, sizeof(*shard));
}

// Opens a shard and checks its header (magic, version, count) against the file size.
static inline int shard_open(const char *path, Shard *shard, char *error, size_t error_size) {
    memset(shard, 0, sizeof(*shard));
    // A directory, a FIFO or a device (/dev/zero) is no shard: refused before it is opened, which
    // would block on a FIFO or read without end.
    struct stat info;
    if (stat(path, &info) == 0 && !S_ISREG(info.st_mode))
        return shard_fail(error, error_size, path, "not a regular file (%s)",
                          S_ISDIR(info.st_mode) ? "a directory" : S_ISFIFO(info.st_mode) ? "a FIFO" : "a device or other special file");
    shard->path = shard_copy_string(path);
    if (!shard->path) return shard_fail(error, error_size, path, "out of memory");
    shard->file = fopen(path, "rb");
    if (!shard->file) {
        shard_fail(error, error_size, path, "cannot open: %s", strerror(errno));
        shard_close(shard);
        return -1;
    }
    unsigned char header[SHARD_HEADER_BYTES];
    off_t file_bytes = -1;
    if (fseeko(shard->file, 0, SEEK_END) == 0) file_bytes = ftello(shard->file);
    if (file_bytes < 0 || fseeko(shard->file, 0, SEEK_SET) != 0) {
        shard_fail(error, error_size, path, "cannot seek: %s", strerror(errno));
        shard_close(shard);
        return -1;
    }
    if (file_bytes < SHARD_HEADER_BYTES || fread(header, 1, sizeof(header), shard->file) != sizeof(header)) {
        shard_fail(error, error_size, path, "truncated: %lld bytes, shorter than the %d-byte header",
                   (long long)file_bytes, SHARD_HEADER_BYTES);
        shard_close(shard);
        return -1;
    }
    int32_t magic = (int32_t)shard_load_uint32_le(header);
    int32_t version = (int32_t)shard_load_uint32_le(header + 4);
    int32_t count = (int32_t)shard_load_uint32_le(header + 8);
    int status = 0;
    if (magic == SHARD_MAGIC_UINT16 || magic == SHARD_MAGIC_UINT32) {
        int expected_version = magic == SHARD_MAGIC_UINT16 ? SHARD_VERSION_UINT16 : SHARD_VERSION_UINT32;
        shard->token_bytes = magic == SHARD_MAGIC_UINT16 ? 2 : 4;
        if (version != expected_version)
            status = shard_fail(error, error_size, path, "version %d does not match magic %d (expected %d)",
                                version, magic, expected_version);
    } else {
        status = shard_fail(error, error_size, path,
                            "wrong magic %d (expected %d for uint16 tokens or %d for uint32 tokens)", magic,
                            SHARD_MAGIC_UINT16, SHARD_MAGIC_UINT32);
    }
    if (status == 0 && count < 0)
        status = shard_fail(error, error_size, path, "negative token count %d in the header", count);
    int64_t expected_bytes = SHARD_HEADER_BYTES + (int64_t)count * shard->token_bytes;
    if (status == 0 && (int64_t)file_bytes != expected_bytes)
        status = shard_fail(error, error_size, path,
                            "size mismatch: file has %lld bytes, the header promises %lld "
                            "(%d-byte header + %d tokens x %d bytes)",
                            (long long)file_bytes, (long long)expected_bytes, SHARD_HEADER_BYTES, count,
                            shard->token_bytes);
    if (status != 0) {
        shard_close(shard);
        return -1;
    }
    shard->token_count = count;
    return 0;
}

// Reads tokens [first, first + count) as int32.
static inline int shard_read_tokens(Shard *shard, int64_t first, int64_t count, int32_t *tokens,
                                    char *error, size_t error_size) {
    if (first < 0 || count < 0 || first + count > shard->token_count)
        return shard_fail(error, error_size, shard->path, "tokens [%lld, %lld) are outside the %lld tokens",
                          (long long)first, (long long)(first + count), (long long)shard->token_count);
    off_t offset = (off_t)SHARD_HEADER_BYTES + (off_t)first * shard->token_bytes;
    if (fseeko(shard->file, offset, SEEK_SET) != 0)
        return shard_fail(error, error_size, shard->path, "cannot seek to byte %lld: %s", (long long)offset,
                          strerror(errno));
    unsigned char bytes[SHARD_TOKENS_PER_IO * 4];
    for (int64_t done = 0; done < count;) {
        int64_t n = count - done < SHARD_TOKENS_PER_IO ? count - done : SHARD_TOKENS_PER_IO;
        size_t size = (size_t)n * (size_t)shard->token_bytes;
        if (fread(bytes, 1, size, shard->file) != size)
            return shard_fail(error, error_size, shard->path, "cannot read tokens at %lld: %s",
                              (long long)(first + done), ferror(shard->file) ? strerror(errno) : "end of file");
        for (int64_t i = 0; i < n; i++)
            tokens[done + i] = (int32_t)shard_load_token(bytes + i * shard->token_bytes, shard->token_bytes);
        done += n;
    }
    return 0;
}

// Checks that every token id is below vocab_size (a full pass over the file).
static inline int shard_validate_tokens(Shard *shard, int64_t vocab_size, char *error, size_t error_size) {
    if (fseeko(shard->file, SHARD_HEADER_BYTES, SEEK_SET) != 0)
        return shard_fail(error, error_size, shard->path, "cannot seek: %s", strerror(errno));
    const int64_t tokens_per_read = 65536;
    unsigned char *bytes = (unsigned char *)malloc((size_t)tokens_per_read * 4);
    if (!bytes) return shard_fail(error, error_size, shard->path, "out of memory");
    int status = 0;
    for (int64_t done = 0; done < shard->token_count && status == 0;) {
        int64_t n = shard->token_count - done < tokens_per_read ? shard->token_count - done : tokens_per_read;
        size_t size = (size_t)n * (size_t)shard->token_bytes;
        if (fread(bytes, 1, size, shard->file) != size) {
            status = shard_fail(error, error_size, shard->path, "cannot read tokens at %lld: %s", (long long)done,
                                ferror(shard->file) ? strerror(errno) : "end of file");
            break;
        }
        for (int64_t i = 0; i < n; i++) {
            uint32_t token = shard_load_token(bytes + i * shard->token_bytes, shard->token_bytes);
            if ((int64_t)token >= vocab_size) {
                status = shard_fail(error, error_size, shard->path, "token id %u >= vocab_size %lld at position %lld",
                                    (unsigned)token, (long long)vocab_size, (long long)(done + i));
                break;
            }
        }
        done += n;
    }
    free(bytes);
    return status;
}
