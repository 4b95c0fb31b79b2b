// Checkpoint files: everything needed to continue a run bit-exactly. Little-endian layout:
//   "LLAMACK1", int64 fields[63] (CheckpointField), then three sections: FP32 master weights
//   [total_padded] (the layout of coat/params.h), the optimizer state and the trainer state
//   (opaque blobs).
// Version 2 carries a CRC-32 (zlib's) of each section, taken as the section is written (nothing
// is read back), and of the header itself (computed with its own field zero): a flipped bit or a
// zero-filled stretch anywhere is refused on load, naming the section. Version 1 (no checksums; what scripts/convert_hf.py wrote before version 2) is still
// read, its weights unchecked, with a warning; it holds no trainer state this build resumes from.
// Written atomically: DIR/ckpt_<step>.bin.tmp, fsync, rename, then DIR/ckpt_<step>.done; a
// checkpoint without its .done marker is ignored. scripts/convert_hf.py reads both versions and
// writes version 2 (scripts/llama_layout.py: the same bytes as a weights-only checkpoint here).
// The trainer's plumbing (its file format), not model code: it stores coat/params.h's layout.
#pragma once
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include "model_shape.h"

#define CHECKPOINT_MAGIC "LLAMACK1"
#define CHECKPOINT_VERSION 2
#define CHECKPOINT_VERSION_UNCHECKED 1  // the version before checksums
#define CHECKPOINT_FIELDS 63
#define CHECKPOINT_HEADER_BYTES (8 + 8 * CHECKPOINT_FIELDS)
#define CHECKPOINT_SECTIONS 3  // weights, optimizer state, trainer state

// Fields 1 to 13 hold the model shape, coat/model_shape.h's keys in their order (CK_SHAPE_<key>):
// an int as int64, a float as the bits of the double it widens to.
#define CHECKPOINT_SHAPE_FIELD(name, type, default_value, min, max, help) CK_SHAPE_##name,
typedef enum {
    CK_VERSION,
    MODEL_SHAPE_KEYS(CHECKPOINT_SHAPE_FIELD)
    CK_STEP, CK_TOTAL_PADDED, CK_HAS_OPTIMIZER, CK_OPTIMIZER_BYTES, CK_TRAINER_BYTES,
    CK_CRC_WEIGHTS, CK_CRC_OPTIMIZER, CK_CRC_TRAINER, CK_CRC_HEADER  // version 2
} CheckpointField;
#undef CHECKPOINT_SHAPE_FIELD
typedef char checkpoint_step_is_field_14[CK_STEP == 14 ? 1 : -1];  // the file's layout

static const char *const checkpoint_section_names[CHECKPOINT_SECTIONS] = {"weights", "optimizer state", "trainer state"};

typedef struct {
    ModelShape shape;
    long long step;
    size_t total_padded;
    int has_optimizer_state;
    size_t optimizer_state_bytes;
    size_t trainer_state_bytes;
    int version;                        // as read; a written header is CHECKPOINT_VERSION
    uint32_t crc[CHECKPOINT_SECTIONS];  // zlib crc32 of each section (version 2)
} CheckpointHeader;

static inline size_t checkpoint_section_bytes(const CheckpointHeader *h, int section) {
    return section == 0 ? 4 * h->total_padded : section == 1 ? h->optimizer_state_bytes : h->trainer_state_bytes;
}

static inline unsigned long long checkpoint_file_bytes(const CheckpointHeader *h) {
    return CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded + h->optimizer_state_bytes + h->trainer_state_bytes;
}

// The header's own checksum: the magic and the fields with CK_CRC_HEADER zero.
static inline uint32_t checkpoint_header_crc(const char header[CHECKPOINT_HEADER_BYTES]) {
    char copy[CHECKPOINT_HEADER_BYTES];
    memcpy(copy, header, sizeof(copy));
    memset(copy + 8 + 8 * CK_CRC_HEADER, 0, 8);
    return (uint32_t)crc32(0L, (const Bytef *)copy, sizeof(copy));
}

static inline int64_t checkpoint_double_bits(double x) { int64_t bits; memcpy(&bits, &x, 8); return bits; }
static inline double checkpoint_bits_double(int64_t bits) { double x; memcpy(&x, &bits, 8); return x; }

#define CHECKPOINT_ENCODE_int(value) (value)
#define CHECKPOINT_ENCODE_float(value) checkpoint_double_bits(value)
#define CHECKPOINT_ENCODE_SHAPE(name, type, default_value, min, max, help) f[CK_SHAPE_##name] = CHECKPOINT_ENCODE_##type(m->name);
static inline void checkpoint_encode_header(const CheckpointHeader *h, char out[CHECKPOINT_HEADER_BYTES]) {
    int64_t f[CHECKPOINT_FIELDS] = {0};
    const ModelShape *m = &h->shape;
    f[CK_VERSION] = CHECKPOINT_VERSION;
    MODEL_SHAPE_KEYS(CHECKPOINT_ENCODE_SHAPE)
    f[CK_STEP] = h->step; f[CK_TOTAL_PADDED] = (int64_t)h->total_padded;
    f[CK_HAS_OPTIMIZER] = h->has_optimizer_state;
    f[CK_OPTIMIZER_BYTES] = (int64_t)h->optimizer_state_bytes;
    f[CK_TRAINER_BYTES] = (int64_t)h->trainer_state_bytes;
    for (int i = 0; i < CHECKPOINT_SECTIONS; i++) f[CK_CRC_WEIGHTS + i] = h->crc[i];
    memcpy(out, CHECKPOINT_MAGIC, 8);
    memcpy(out + 8, f, sizeof(f));
    f[CK_CRC_HEADER] = checkpoint_header_crc(out);
    memcpy(out + 8 + 8 * CK_CRC_HEADER, &f[CK_CRC_HEADER], 8);
}
#undef CHECKPOINT_ENCODE_int
#undef CHECKPOINT_ENCODE_float
#undef CHECKPOINT_ENCODE_SHAPE

// Refuses a model-shape field that an int cannot hold: a damaged header would otherwise be cut to
// another, plausible value. Returns 0, or -1 with the field in `error`.
#define CHECKPOINT_INT_FIELD_int(name) {CK_SHAPE_##name, #name},
#define CHECKPOINT_INT_FIELD_float(name)
#define CHECKPOINT_INT_FIELD(name, type, default_value, min, max, help) CHECKPOINT_INT_FIELD_##type(name)
static inline int checkpoint_check_int_fields(const int64_t f[CHECKPOINT_FIELDS], char *error, size_t error_size) {
    static const struct { CheckpointField field; const char *name; } ints[] = {MODEL_SHAPE_KEYS(CHECKPOINT_INT_FIELD)};
    for (size_t i = 0; i < sizeof(ints) / sizeof(ints[0]); i++) {
        int64_t value = f[ints[i].field];
        if (value < 0 || value > INT_MAX) {
            snprintf(error, error_size, "corrupt header (%s %lld is outside 0..%d)", ints[i].name, (long long)value, INT_MAX);
            return -1;
        }
    }
    if (f[CK_HAS_OPTIMIZER] != 0 && f[CK_HAS_OPTIMIZER] != 1) {
        snprintf(error, error_size, "corrupt header (has_optimizer_state %lld is neither 0 nor 1)", (long long)f[CK_HAS_OPTIMIZER]);
        return -1;
    }
    return 0;
}
#undef CHECKPOINT_INT_FIELD_int
#undef CHECKPOINT_INT_FIELD_float
#undef CHECKPOINT_INT_FIELD

#define CHECKPOINT_DECODE_int(bits) (int)(bits)
#define CHECKPOINT_DECODE_float(bits) (float)checkpoint_bits_double(bits)
#define CHECKPOINT_DECODE_SHAPE(name, type, default_value, min, max, help) m->name = CHECKPOINT_DECODE_##type(f[CK_SHAPE_##name]);
// Returns 0, or -1 with "what is wrong" in error.
static inline int checkpoint_decode_header(const char in[CHECKPOINT_HEADER_BYTES], CheckpointHeader *h, char *error,
                                           size_t error_size) {
    int64_t f[CHECKPOINT_FIELDS];
    if (memcmp(in, CHECKPOINT_MAGIC, 8) != 0) { snprintf(error, error_size, "not a train_llama checkpoint (bad magic)"); return -1; }
    memcpy(f, in + 8, sizeof(f));
    if (f[CK_VERSION] != CHECKPOINT_VERSION && f[CK_VERSION] != CHECKPOINT_VERSION_UNCHECKED) {
        snprintf(error, error_size, "checkpoint version %lld, this build reads %d and %d", (long long)f[CK_VERSION],
                 CHECKPOINT_VERSION_UNCHECKED, CHECKPOINT_VERSION);
        return -1;
    }
    h->version = (int)f[CK_VERSION];
    if (h->version == CHECKPOINT_VERSION && (uint64_t)f[CK_CRC_HEADER] != checkpoint_header_crc(in)) {
        snprintf(error, error_size, "the header fails its checksum (crc32 %08x, the header says %08llx): the file is damaged",
                 (unsigned)checkpoint_header_crc(in), (unsigned long long)f[CK_CRC_HEADER]);
        return -1;
    }
    if (checkpoint_check_int_fields(f, error, error_size) != 0) return -1;
    ModelShape *m = &h->shape;
    MODEL_SHAPE_KEYS(CHECKPOINT_DECODE_SHAPE)
    h->step = f[CK_STEP];
    h->total_padded = (size_t)f[CK_TOTAL_PADDED];
    h->has_optimizer_state = (int)f[CK_HAS_OPTIMIZER];
    h->optimizer_state_bytes = (size_t)f[CK_OPTIMIZER_BYTES];
    h->trainer_state_bytes = (size_t)f[CK_TRAINER_BYTES];
    for (int i = 0; i < CHECKPOINT_SECTIONS; i++) h->crc[i] = (uint32_t)f[CK_CRC_WEIGHTS + i];
    if (f[CK_STEP] < 0 || f[CK_TOTAL_PADDED] <= 0 || f[CK_OPTIMIZER_BYTES] < 0 || f[CK_TRAINER_BYTES] < 0) {
        snprintf(error, error_size, "corrupt header (negative sizes)");
        return -1;
    }
    // Bounds far past any model (2^40 parameters, 2^50-byte sections) keep the size sums from wrapping.
    if (f[CK_TOTAL_PADDED] > (int64_t)1 << 40 || f[CK_OPTIMIZER_BYTES] > (int64_t)1 << 50 || f[CK_TRAINER_BYTES] > (int64_t)1 << 50) {
        snprintf(error, error_size, "corrupt header (sizes past 2^40 parameters or 2^50 bytes)");
        return -1;
    }
    return 0;
}
#undef CHECKPOINT_DECODE_int
#undef CHECKPOINT_DECODE_float
#undef CHECKPOINT_DECODE_SHAPE

// Names the first model-shape key where the checkpoint and the config disagree, or returns NULL.
// max_seq_len is left out: a checkpoint may continue at another sequence length.
static inline const char *checkpoint_shape_mismatch(const ModelShape *a, const ModelShape *b) {
    if (a->vocab_size != b->vocab_size) return "vocab_size";
    if (a->dim != b->dim) return "dim";
    if (a->n_layers != b->n_layers) return "n_layers";
    if (a->n_heads != b->n_heads) return "n_heads";
    if (a->n_kv_heads != b->n_kv_heads) return "n_kv_heads";
    if (a->ffn_dim != b->ffn_dim) return "ffn_dim";
    // The weights were trained with these: another RoPE or norm would silently change the model.
    if (a->rope_theta != b->rope_theta) return "rope_theta";
    if (a->norm_eps != b->norm_eps) return "norm_eps";
    if (a->rope_scaling_factor != b->rope_scaling_factor) return "rope_scaling_factor";
    if (a->rope_scaling_factor > 0) {  // the other scaling keys matter only with scaling on
        if (a->rope_low_freq_factor != b->rope_low_freq_factor) return "rope_low_freq_factor";
        if (a->rope_high_freq_factor != b->rope_high_freq_factor) return "rope_high_freq_factor";
        if (a->rope_original_max_seq_len != b->rope_original_max_seq_len) return "rope_original_max_seq_len";
    }
    return NULL;
}

static inline void checkpoint_path(char *out, size_t size, const char *dir, long long step, const char *suffix) {
    snprintf(out, size, "%s/ckpt_%08lld%s", dir, step, suffix);
}

// Newest step in `dir` with a .done marker, or -1 when there is none.
static inline long long checkpoint_find_newest(const char *dir) {
    DIR *d = opendir(dir);
    long long newest = -1;
    if (!d) return -1;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        long long step;
        char tail[8];
        if (sscanf(entry->d_name, "ckpt_%lld.%7s", &step, tail) == 2 && strcmp(tail, "done") == 0 && step > newest)
            newest = step;
    }
    closedir(d);
    return newest;
}

// Removes checkpoints older than the newest `keep` (marker first, so a half-removed one is ignored).
static inline void checkpoint_prune(const char *dir, int keep) {
    for (;;) {
        DIR *d = opendir(dir);
        if (!d) return;
        long long oldest = -1;
        int count = 0;
        struct dirent *entry;
        while ((entry = readdir(d)) != NULL) {
            long long step;
            char tail[8];
            if (sscanf(entry->d_name, "ckpt_%lld.%7s", &step, tail) == 2 && strcmp(tail, "done") == 0) {
                count++;
                if (oldest < 0 || step < oldest) oldest = step;
            }
        }
        closedir(d);
        if (count <= keep) return;
        char path[4096];
        checkpoint_path(path, sizeof(path), dir, oldest, ".done");
        remove(path);
        checkpoint_path(path, sizeof(path), dir, oldest, ".bin");
        remove(path);
    }
}

static inline int checkpoint_is_run_file(const char *name) {
    return strncmp(name, "ckpt_", 5) == 0 || strcmp(name, "log.jsonl") == 0;
}

// What DIR holds of an earlier run (checkpoints, finished or not, and the log), as "N
// checkpoint file(s), the newest ckpt_<step>.bin, log.jsonl" in `what`; 0 when nothing.
static inline int run_dir_describe(const char *dir, char *what, size_t size) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int files = 0, log = 0;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        if (!checkpoint_is_run_file(entry->d_name)) continue;
        if (strcmp(entry->d_name, "log.jsonl") == 0) log = 1;
        else files++;
    }
    closedir(d);
    long long newest = checkpoint_find_newest(dir);
    char newest_text[64] = "";
    if (newest >= 0) snprintf(newest_text, sizeof(newest_text), ", the newest ckpt_%08lld.bin", newest);
    snprintf(what, size, "%d checkpoint file(s)%s%s", files, newest_text, log ? ", log.jsonl" : "");
    return files > 0 || log;
}

// Removes an earlier run's checkpoints and log from DIR (nothing else); 0, or -1 with `error`.
static inline int run_dir_clear(const char *dir, char *error, size_t size) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *entry;
    int status = 0;
    while ((entry = readdir(d)) != NULL && status == 0) {
        if (!checkpoint_is_run_file(entry->d_name)) continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, entry->d_name);
        if (remove(path) != 0) {
            snprintf(error, size, "%s: cannot remove: %s", path, strerror(errno));
            status = -1;
        }
    }
    closedir(d);
    return status;
}

// Removes what an interrupted write left in DIR (ckpt_<step>.bin.tmp, log.jsonl.tmp): a killed
// run's partial checkpoint would otherwise stay, filling the disk. Returns the files removed, or
// -1 with `error` naming the file that could not be.
static inline int run_dir_remove_temporaries(const char *dir, char *error, size_t size) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *entry;
    int removed = 0;
    while ((entry = readdir(d)) != NULL && removed >= 0) {
        size_t length = strlen(entry->d_name);
        int temporary = length > 4 && strcmp(entry->d_name + length - 4, ".tmp") == 0 &&
                        (strncmp(entry->d_name, "ckpt_", 5) == 0 || strcmp(entry->d_name, "log.jsonl.tmp") == 0);
        if (!temporary) continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, entry->d_name);
        if (remove(path) == 0) {
            removed++;
        } else {
            snprintf(error, size, "%s: cannot remove this stale temporary file: %s", path, strerror(errno));
            removed = -1;
        }
    }
    closedir(d);
    return removed;
}

// CRC-32 (zlib's) of n bytes after `crc`, whatever n (zlib takes at most 4 GiB at a time).
static inline uLong checkpoint_crc32(uLong crc, const void *data, size_t n) {
    const Bytef *bytes = (const Bytef *)data;
    while (n > 0) {
        uInt chunk = n > ((size_t)1 << 30) ? (uInt)1 << 30 : (uInt)n;
        crc = crc32(crc, bytes, chunk);
        bytes += chunk;
        n -= chunk;
    }
    return crc;
}

// CRC-32 of each section as the file holds them (read from just after the header). Returns 0, or
// -1 with `error` naming the file.
static inline int checkpoint_section_crcs(FILE *f, const char *path, const CheckpointHeader *h,
                                          uint32_t crc[CHECKPOINT_SECTIONS], char *error, size_t error_size) {
    const size_t CHUNK = (size_t)1 << 20;
    unsigned char *buffer = (unsigned char *)malloc(CHUNK);
    if (!buffer) { snprintf(error, error_size, "%s: out of host memory for the checksums", path); return -1; }
    int status = fseeko(f, CHECKPOINT_HEADER_BYTES, SEEK_SET) == 0 ? 0 : -1;
    for (int section = 0; section < CHECKPOINT_SECTIONS && status == 0; section++) {
        uLong sum = crc32(0L, Z_NULL, 0);
        for (size_t left = checkpoint_section_bytes(h, section); left > 0 && status == 0;) {
            size_t n = left < CHUNK ? left : CHUNK;
            if (fread(buffer, 1, n, f) != n) status = -1;
            else sum = crc32(sum, buffer, (uInt)n);
            left -= n;
        }
        crc[section] = (uint32_t)sum;
    }
    if (status != 0)
        snprintf(error, error_size, "%s: read failed while checksumming: %s", path, ferror(f) ? strerror(errno) : "truncated");
    free(buffer);
    return status;
}

// Checks each section against its checksum (version 2; version 1 has none). Returns 0, or -1 with
// `error` naming the file and the first damaged section.
static inline int checkpoint_verify(FILE *f, const char *path, const CheckpointHeader *h, char *error,
                                    size_t error_size) {
    if (h->version != CHECKPOINT_VERSION) return 0;
    uint32_t crc[CHECKPOINT_SECTIONS];
    if (checkpoint_section_crcs(f, path, h, crc, error, error_size) != 0) return -1;
    for (int section = 0; section < CHECKPOINT_SECTIONS; section++) {
        if (crc[section] == h->crc[section]) continue;
        snprintf(error, error_size, "%s: the %s section fails its checksum (crc32 %08x, the header says %08x): the file is damaged",
                 path, checkpoint_section_names[section], (unsigned)crc[section], (unsigned)h->crc[section]);
        return -1;
    }
    return 0;
}

// ---- writing ----------------------------------------------------------------------------
// Every byte of a checkpoint goes to its file through a sink, which keeps the CRC-32 of the
// section under way: the checksums come from the bytes on their way to the disk, none is read back.

typedef struct {
    FILE *file;
    uLong crc;                 // of the bytes written since the section began
    unsigned long long bytes;  // written through the sink in all
    int error;                 // errno of the first failed write; the writes after it are skipped
} CheckpointSink;

static inline void checkpoint_sink_init(CheckpointSink *sink, FILE *file) {
    sink->file = file;
    sink->crc = crc32(0L, Z_NULL, 0);
    sink->bytes = 0;
    sink->error = 0;
}

static inline void checkpoint_sink_write(CheckpointSink *sink, const void *data, size_t n) {
    if (sink->error || n == 0) return;
    errno = 0;
    if (fwrite(data, 1, n, sink->file) != n) {
        sink->error = errno ? errno : EIO;
        return;
    }
    sink->crc = checkpoint_crc32(sink->crc, data, n);
    sink->bytes += n;
}

// The CRC-32 of the section written since the last call; the next section starts.
static inline uint32_t checkpoint_sink_section(CheckpointSink *sink) {
    uint32_t crc = (uint32_t)sink->crc;
    sink->crc = crc32(0L, Z_NULL, 0);
    return crc;
}

// Flushes a folder's entries (a rename, a new file) to disk. A file system that cannot sync a
// folder (EINVAL) keeps them as it does. Returns 0, or -1 with `error`.
static inline int checkpoint_sync_dir(const char *dir, char *error, size_t error_size) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY);
    if (fd < 0) {
        snprintf(error, error_size, "%s: cannot open the folder to flush it: %s", dir, strerror(errno));
        return -1;
    }
    int status = fsync(fd) == 0 || errno == EINVAL ? 0 : -1;
    if (status != 0) snprintf(error, error_size, "%s: cannot flush the folder: %s", dir, strerror(errno));
    close(fd);
    return status;
}

// Starts DIR/ckpt_<step>.bin.tmp with a placeholder header and `sink` on it. The caller writes
// the sections in order through the sink (master weights, optimizer state, trainer state), each
// one's checksum taken with checkpoint_sink_section into h->crc, then calls checkpoint_commit,
// which also reports a failed write. Returns 0, or -1 with `error`.
static inline int checkpoint_begin(const char *dir, const CheckpointHeader *h, CheckpointSink *sink, char *error,
                                   size_t error_size) {
    char tmp[4096], header[CHECKPOINT_HEADER_BYTES];
    checkpoint_path(tmp, sizeof(tmp), dir, h->step, ".bin.tmp");
    FILE *f = fopen(tmp, "wb");
    if (!f) { snprintf(error, error_size, "%s: cannot create: %s", tmp, strerror(errno)); return -1; }
    checkpoint_encode_header(h, header);
    if (fwrite(header, 1, sizeof(header), f) != sizeof(header)) {
        snprintf(error, error_size, "%s: write failed: %s", tmp, strerror(errno));
        fclose(f);
        remove(tmp);
        return -1;
    }
    checkpoint_sink_init(sink, f);
    return 0;
}

// The header with the sections' checksums (h->crc) at the start of the file, then everything to
// disk. Returns 0, the errno of the failed call, or -1 with `error`.
static inline int checkpoint_seal(CheckpointSink *sink, const char *tmp, const CheckpointHeader *h, char *error,
                                  size_t error_size) {
    char header[CHECKPOINT_HEADER_BYTES];
    unsigned long long expected = checkpoint_file_bytes(h) - CHECKPOINT_HEADER_BYTES;
    if (sink->error) return sink->error;
    if (sink->bytes != expected) {
        snprintf(error, error_size, "%s: %llu bytes of sections written, the header announces %llu", tmp, sink->bytes, expected);
        return -1;
    }
    checkpoint_encode_header(h, header);
    errno = 0;
    if (fseeko(sink->file, 0, SEEK_SET) != 0 || fwrite(header, 1, sizeof(header), sink->file) != sizeof(header) ||
        fflush(sink->file) != 0 || fsync(fileno(sink->file)) != 0)
        return errno ? errno : EIO;
    return 0;
}

// Closes the written temporary file `tmp` (status: 0, an errno, or -1 with `error` set) and
// renames it to `final_path`. On a failure the temporary file is removed and `error` names it
// with the reason. Returns 0 or -1.
static inline int checkpoint_close_and_rename(FILE *f, int status, const char *tmp, const char *final_path, char *error,
                                              size_t error_size) {
    errno = 0;
    if (status == 0 && fclose(f) != 0) status = errno ? errno : EIO;
    else if (status != 0) fclose(f);
    if (status != 0) {
        if (status > 0) snprintf(error, error_size, "%s: write failed: %s", tmp, strerror(status));
        remove(tmp);
        return -1;
    }
    if (rename(tmp, final_path) != 0) {
        snprintf(error, error_size, "%s: rename failed: %s", final_path, strerror(errno));
        remove(tmp);
        return -1;
    }
    return 0;
}

// DIR/ckpt_<step>.done, once the checkpoint's renamed files are on disk: from now on it counts.
static inline int checkpoint_mark_done(const char *dir, long long step, char *error, size_t error_size) {
    char done[4096];
    checkpoint_path(done, sizeof(done), dir, step, ".done");
    if (checkpoint_sync_dir(dir, error, error_size) != 0) return -1;
    FILE *marker = fopen(done, "w");
    if (!marker || fclose(marker) != 0) {
        snprintf(error, error_size, "%s: cannot create the marker: %s", done, strerror(errno));
        return -1;
    }
    return checkpoint_sync_dir(dir, error, error_size);
}

// Seals the file with the sections' checksums (h->crc, from the sink), flushes it to disk,
// renames it into place and marks it done. On a failure (a write through the sink too) the
// temporary file, which would only fill the disk, is removed and `error` names it with the reason.
static inline int checkpoint_commit(CheckpointSink *sink, const char *dir, const CheckpointHeader *h, char *error,
                                    size_t error_size) {
    char tmp[4096], final_path[4096];
    checkpoint_path(tmp, sizeof(tmp), dir, h->step, ".bin.tmp");
    checkpoint_path(final_path, sizeof(final_path), dir, h->step, ".bin");
    int status = checkpoint_seal(sink, tmp, h, error, error_size);
    if (checkpoint_close_and_rename(sink->file, status, tmp, final_path, error, error_size) != 0) return -1;
    return checkpoint_mark_done(dir, h->step, error, error_size);
}

// Opens a checkpoint and reads its header, checking that the file holds every section it
// announces. A path that is no regular file (a folder, a FIFO that would block) is refused
// before it is opened.
static inline FILE *checkpoint_open(const char *path, CheckpointHeader *h, char *error, size_t error_size) {
    char header[CHECKPOINT_HEADER_BYTES], what[256];
    struct stat st;
    if (stat(path, &st) != 0) { snprintf(error, error_size, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    if (!S_ISREG(st.st_mode)) {
        snprintf(error, error_size, "%s: is %s, not a checkpoint file", path, S_ISDIR(st.st_mode) ? "a directory" : "no regular file");
        return NULL;
    }
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(error, error_size, "%s: cannot open: %s", path, strerror(errno)); return NULL; }
    if (fread(header, 1, sizeof(header), f) != sizeof(header)) {
        snprintf(error, error_size, "%s: truncated header", path);
        fclose(f);
        return NULL;
    }
    if (checkpoint_decode_header(header, h, what, sizeof(what)) != 0) {
        snprintf(error, error_size, "%s: %s", path, what);
        fclose(f);
        return NULL;
    }
    unsigned long long expected = checkpoint_file_bytes(h);
    if (fstat(fileno(f), &st) != 0 || (unsigned long long)st.st_size != expected) {
        snprintf(error, error_size, "%s: size %lld bytes, header announces %llu (truncated or corrupt)", path,
                 (long long)st.st_size, expected);
        fclose(f);
        return NULL;
    }
    return f;
}
