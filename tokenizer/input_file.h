// The input files of `./tokenize shards`, read as a stream of bytes: plain files, and files
// compressed with gzip (NAME.gz, through zlib) or Zstandard (NAME.zst, through libzstd),
// decompressed on the fly. The suffix decides; a build without the library refuses such a file
// with a message naming the missing package. Concatenated gzip members and zstd frames are read
// one after the other, as gzip -d and zstd -d do; a stream cut short is an error.
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct InputFile InputFile;

// Opens path (the caller keeps it alive until input_close). NULL with "error: ..." on failure.
InputFile *input_open(const char *path, char *error, size_t error_size);
// Reads up to size decompressed bytes into out: the count, 0 at the end, -1 with an error.
long input_read(InputFile *in, char *out, size_t size, char *error, size_t error_size);
// Bytes of the file itself read so far (compressed bytes for a compressed file).
uint64_t input_file_bytes(const InputFile *in);
void input_close(InputFile *in);
// The name without its compression suffix ("a.jsonl.gz" -> "a.jsonl"), in name_size bytes.
void input_plain_name(const char *path, char *name, size_t name_size);
// What this build reads, for the usage text: "gzip (.gz) and zstd (.zst)", or what is missing.
const char *input_compressions(void);
