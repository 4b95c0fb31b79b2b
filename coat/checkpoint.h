// Checkpoint files: everything needed to continue a run bit-exactly. Little-endian layout:
//   "LLAMACK1", int64 fields[63] (CheckpointField), then three sections: FP32 master weights
//   [total_padded] (the layout of coat/params.h), the optimizer state and the trainer state
//   (opaque blobs).
// Version 2 carries a CRC-32 (zlib's) of each section, taken as the section is written (nothing
// is read back), and of the header itself (computed with its own field zero): a flipped bit or a
// zero-filled stretch anywhere is refused on load, naming the section. Version 1 (no checksums;
// what scripts/convert_hf.py wrote before version 2) is still read, its weights unchecked, with a
// warning; it holds no trainer state this build resumes from.
// A checkpoint is one such file (checkpoint_writes = rank0), or the same bytes in a manifest and
// a part file per rank (per_rank, below); a Checkpoint reads either at the one file's offsets.
// Written atomically: DIR/ckpt_<step>.bin.tmp (and each part's .tmp), fsync, rename, then
// DIR/ckpt_<step>.done; a checkpoint without its .done marker is ignored. scripts/convert_hf.py
// reads both versions and both forms, writes version 2 (scripts/llama_layout.py: the same bytes
// as a weights-only checkpoint here), and merges a per-rank checkpoint into the one file.
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
#include "params.h"

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
static inline int checkpoint_verify_sections(FILE *f, const char *path, const CheckpointHeader *h, char *error,
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

// Flushes a folder's entries (a rename, a new file) to disk, so that a marker never reaches the
// disk before the files it vouches for; EINVAL (a file system that cannot sync a folder) counts
// as done. Returns 0, or -1 with `error`.
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

// ---- per-rank checkpoints (checkpoint_writes = per_rank) ---------------------------------
// One checkpoint in several files, written in parallel, each by the rank that holds its part:
//   DIR/ckpt_<step>.rank<p>.bin, p < P: "LLAMACKP", uint64 version, step, p, P, then for each
//     array (CHECKPOINT_ARRAYS: the master weights, the optimizer's m, v, m's group scalars,
//     v's) the bytes of the part's element ranges, range after range in the manifest's order;
//   DIR/ckpt_<step>.bin, the manifest (rank 0): "LLAMACKM", uint64 version, the header of the
//     single file it stands for (its section checksums 0: the part files carry theirs), uint64 P,
//     uint64 bytes per 128-group of each array, uint64 H and the optimizer state's H header
//     bytes, the trainer state (trainer_state_bytes), then each part's uint64 file size, CRC-32,
//     range count n and n x (begin, end); last the CRC-32 of all that.
// The ranges of all parts tile [0, total_padded) in multiples of 128, so that every byte of the
// single file is in the manifest or in one part: its weights are array 0, its optimizer state
// the H header bytes then arrays 1 to 4. A reader maps the single file's offsets to the parts
// (Checkpoint, below): any world size, stage and bucketing reads its own parts from either form,
// and scripts/convert_hf.py merge writes the single file. Each rank writes DIR/ckpt_<step>.rank<p>
// .bin.tmp, flushes it to disk and renames it; rank 0 writes the manifest and the .done marker
// once every rank has reported its part on disk (the trainer's collective).

#define CHECKPOINT_PART_MAGIC "LLAMACKP"
#define CHECKPOINT_MANIFEST_MAGIC "LLAMACKM"
#define CHECKPOINT_PARTS_VERSION 1
#define CHECKPOINT_PART_HEADER_BYTES 40
#define CHECKPOINT_ARRAYS 5                                // weights, then the optimizer's four arrays
#define CHECKPOINT_PARTS_MAX 65536
#define CHECKPOINT_GROUP_BYTES_MAX 4096                    // far past any array's (FP32: 512)
#define CHECKPOINT_MANIFEST_BYTES_MAX ((size_t)1 << 30)

typedef struct {
    size_t begin, end;  // elements of the parameter order, multiples of 128
} CheckpointRange;

typedef struct {
    unsigned long long file_bytes;
    uint32_t crc;             // of the whole file
    int range_count;
    CheckpointRange *ranges;  // in the order of the file
} CheckpointPart;

typedef struct {
    CheckpointHeader header;                // of the single file it stands for
    size_t group_bytes[CHECKPOINT_ARRAYS];  // bytes per 128-group of each array
    size_t optimizer_header_bytes;
    unsigned char *optimizer_header;        // [optimizer_header_bytes]
    unsigned char *trainer_state;           // [header.trainer_state_bytes]
    int parts;
    CheckpointPart *part;                   // [parts]
} CheckpointManifest;

// DIR/ckpt_<step>.rank<part>.bin of the manifest DIR/ckpt_<step>.bin (its name without .bin).
static inline void checkpoint_part_path(char *out, size_t size, const char *manifest_path, int part) {
    size_t length = strlen(manifest_path);
    if (length >= 4 && strcmp(manifest_path + length - 4, ".bin") == 0) length -= 4;
    snprintf(out, size, "%.*s.rank%d.bin", (int)length, manifest_path, part);
}

static inline size_t checkpoint_ranges_groups(const CheckpointRange *ranges, int count) {
    size_t groups = 0;
    for (int i = 0; i < count; i++) groups += (ranges[i].end - ranges[i].begin) / PARAM_ALIGN_ELEMS;
    return groups;
}

// The size of a part file that holds `ranges` of every array.
static inline unsigned long long checkpoint_part_file_bytes(const CheckpointRange *ranges, int count,
                                                            const size_t group_bytes[CHECKPOINT_ARRAYS]) {
    unsigned long long bytes = CHECKPOINT_PART_HEADER_BYTES, groups = checkpoint_ranges_groups(ranges, count);
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) bytes += groups * group_bytes[a];
    return bytes;
}

static inline unsigned long long checkpoint_array_bytes(const CheckpointManifest *m, int a) {
    return (unsigned long long)(m->header.total_padded / PARAM_ALIGN_ELEMS) * m->group_bytes[a];
}

// The optimizer state of the single file: the header bytes and arrays 1 to 4.
static inline unsigned long long checkpoint_manifest_optimizer_bytes(const CheckpointManifest *m) {
    unsigned long long bytes = m->optimizer_header_bytes;
    for (int a = 1; a < CHECKPOINT_ARRAYS; a++) bytes += checkpoint_array_bytes(m, a);
    return bytes;
}

static inline void checkpoint_manifest_free(CheckpointManifest *m) {
    for (int p = 0; m->part && p < m->parts; p++) free(m->part[p].ranges);
    free(m->part);
    free(m->optimizer_header);
    free(m->trainer_state);
    memset(m, 0, sizeof(*m));
}

static inline int checkpoint_range_order(const void *a, const void *b) {
    size_t x = ((const CheckpointRange *)a)->begin, y = ((const CheckpointRange *)b)->begin;
    return x < y ? -1 : x > y;
}

// The parts' ranges tile [0, total): none empty or unaligned, no gap, no overlap. Returns 0, or
// -1 with what is wrong in `error`.
static inline int checkpoint_manifest_check_tiling(const CheckpointManifest *m, char *error, size_t error_size) {
    size_t count = 0, total = m->header.total_padded, at = 0;
    for (int p = 0; p < m->parts; p++) count += (size_t)m->part[p].range_count;
    CheckpointRange *all = (CheckpointRange *)malloc((count ? count : 1) * sizeof(CheckpointRange));
    if (!all) { snprintf(error, error_size, "out of host memory for the parts' ranges"); return -1; }
    count = 0;
    int status = 0;
    for (int p = 0; p < m->parts && status == 0; p++)
        for (int i = 0; i < m->part[p].range_count && status == 0; i++) {
            CheckpointRange r = m->part[p].ranges[i];
            if (r.begin >= r.end || r.end > total || r.begin % PARAM_ALIGN_ELEMS || r.end % PARAM_ALIGN_ELEMS) {
                snprintf(error, error_size, "part %d's range [%zu, %zu) is not a non-empty multiple of %d elements inside [0, %zu)",
                         p, r.begin, r.end, PARAM_ALIGN_ELEMS, total);
                status = -1;
            }
            all[count++] = r;
        }
    if (status == 0) qsort(all, count, sizeof(CheckpointRange), checkpoint_range_order);
    for (size_t i = 0; i < count && status == 0; at = all[i++].end)
        if (all[i].begin != at) {
            snprintf(error, error_size, "the parts' ranges %s elements [%zu, %zu)", all[i].begin > at ? "leave out" : "hold twice",
                     all[i].begin > at ? at : all[i].begin, all[i].begin > at ? all[i].begin : at);
            status = -1;
        }
    if (status == 0 && at != total) {
        snprintf(error, error_size, "the parts' ranges leave out elements [%zu, %zu)", at, total);
        status = -1;
    }
    free(all);
    return status;
}

// Everything a manifest's numbers must agree on. Returns 0, or -1 with what is wrong in `error`.
static inline int checkpoint_manifest_check(const CheckpointManifest *m, char *error, size_t error_size) {
    const CheckpointHeader *h = &m->header;
    if (m->parts < 1 || m->parts > CHECKPOINT_PARTS_MAX) {
        snprintf(error, error_size, "%d parts, a manifest lists 1 to %d", m->parts, CHECKPOINT_PARTS_MAX);
        return -1;
    }
    if (h->total_padded % PARAM_ALIGN_ELEMS != 0 || m->group_bytes[0] != 4 * PARAM_ALIGN_ELEMS) {
        snprintf(error, error_size, "%zu elements of %zu bytes per group: the weights are FP32 groups of %d", h->total_padded,
                 m->group_bytes[0], PARAM_ALIGN_ELEMS);
        return -1;
    }
    for (int a = 1; a < CHECKPOINT_ARRAYS; a++)
        if (m->group_bytes[a] > CHECKPOINT_GROUP_BYTES_MAX) {
            snprintf(error, error_size, "array %d has %zu bytes per group, past %d", a, m->group_bytes[a], CHECKPOINT_GROUP_BYTES_MAX);
            return -1;
        }
    if (checkpoint_manifest_optimizer_bytes(m) != h->optimizer_state_bytes) {
        snprintf(error, error_size, "its optimizer state adds up to %llu bytes, the header says %zu",
                 checkpoint_manifest_optimizer_bytes(m), h->optimizer_state_bytes);
        return -1;
    }
    if (checkpoint_manifest_check_tiling(m, error, error_size) != 0) return -1;
    for (int p = 0; p < m->parts; p++) {
        const CheckpointPart *part = &m->part[p];
        unsigned long long bytes = checkpoint_part_file_bytes(part->ranges, part->range_count, m->group_bytes);
        if (part->file_bytes != bytes) {
            snprintf(error, error_size, "part %d is said to be %llu bytes, its ranges make %llu", p, part->file_bytes, bytes);
            return -1;
        }
    }
    return 0;
}

static inline unsigned char *checkpoint_put_u64(unsigned char *out, uint64_t value) {
    memcpy(out, &value, 8);
    return out + 8;
}

static inline unsigned char *checkpoint_put_bytes(unsigned char *out, const void *bytes, size_t n) {
    if (n) memcpy(out, bytes, n);
    return out + n;
}

// The manifest's bytes in a new buffer (*bytes long), or NULL when out of host memory.
static inline unsigned char *checkpoint_manifest_encode(const CheckpointManifest *m, size_t *bytes) {
    CheckpointHeader h = m->header;
    size_t n = 8 + 8 + CHECKPOINT_HEADER_BYTES + 8 + 8 * CHECKPOINT_ARRAYS + 8 + m->optimizer_header_bytes +
               h.trainer_state_bytes + 8;
    for (int p = 0; p < m->parts; p++) n += 24 + 16 * (size_t)m->part[p].range_count;
    unsigned char *buffer = (unsigned char *)malloc(n), *out = buffer;
    if (!buffer) return NULL;
    char header[CHECKPOINT_HEADER_BYTES];
    memset(h.crc, 0, sizeof(h.crc));  // the parts carry the checksums
    h.version = CHECKPOINT_VERSION;
    checkpoint_encode_header(&h, header);
    out = checkpoint_put_bytes(out, CHECKPOINT_MANIFEST_MAGIC, 8);
    out = checkpoint_put_u64(out, CHECKPOINT_PARTS_VERSION);
    out = checkpoint_put_bytes(out, header, sizeof(header));
    out = checkpoint_put_u64(out, (uint64_t)m->parts);
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) out = checkpoint_put_u64(out, m->group_bytes[a]);
    out = checkpoint_put_u64(out, m->optimizer_header_bytes);
    out = checkpoint_put_bytes(out, m->optimizer_header, m->optimizer_header_bytes);
    out = checkpoint_put_bytes(out, m->trainer_state, h.trainer_state_bytes);
    for (int p = 0; p < m->parts; p++) {
        const CheckpointPart *part = &m->part[p];
        out = checkpoint_put_u64(out, part->file_bytes);
        out = checkpoint_put_u64(out, part->crc);
        out = checkpoint_put_u64(out, (uint64_t)part->range_count);
        for (int i = 0; i < part->range_count; i++) {
            out = checkpoint_put_u64(out, part->ranges[i].begin);
            out = checkpoint_put_u64(out, part->ranges[i].end);
        }
    }
    checkpoint_put_u64(out, (uint32_t)checkpoint_crc32(crc32(0L, Z_NULL, 0), buffer, (size_t)(out - buffer)));
    *bytes = n;
    return buffer;
}

// Reads the bytes of a manifest in order; a read past the end leaves `short_read` set.
typedef struct {
    const unsigned char *at;
    size_t left;
    int short_read;
} CheckpointCursor;

static inline uint64_t checkpoint_get_u64(CheckpointCursor *c) {
    uint64_t value = 0;
    if (c->left < 8) { c->short_read = 1; return 0; }
    memcpy(&value, c->at, 8);
    c->at += 8;
    c->left -= 8;
    return value;
}

// A new buffer with the next n bytes (NULL when they are not there, n past `limit`, or out of memory).
static inline unsigned char *checkpoint_get_bytes(CheckpointCursor *c, uint64_t n, size_t limit) {
    if (n > c->left || n > limit) { c->short_read = 1; return NULL; }
    unsigned char *bytes = (unsigned char *)malloc(n ? (size_t)n : 1);
    if (!bytes) { c->short_read = 1; return NULL; }
    if (n) memcpy(bytes, c->at, (size_t)n);
    c->at += n;
    c->left -= (size_t)n;
    return bytes;
}

static inline int checkpoint_manifest_decode_parts(CheckpointCursor *c, CheckpointManifest *m) {
    m->part = (CheckpointPart *)calloc((size_t)m->parts, sizeof(CheckpointPart));
    if (!m->part) return -1;
    for (int p = 0; p < m->parts && !c->short_read; p++) {
        CheckpointPart *part = &m->part[p];
        part->file_bytes = checkpoint_get_u64(c);
        uint64_t crc = checkpoint_get_u64(c), count = checkpoint_get_u64(c);
        if (c->short_read || crc > 0xFFFFFFFFu || count > c->left / 16 || count > m->header.total_padded / PARAM_ALIGN_ELEMS)
            return -1;
        part->crc = (uint32_t)crc;
        part->range_count = (int)count;
        part->ranges = (CheckpointRange *)malloc((count ? count : 1) * sizeof(CheckpointRange));
        if (!part->ranges) return -1;
        for (uint64_t i = 0; i < count; i++) {
            part->ranges[i].begin = (size_t)checkpoint_get_u64(c);
            part->ranges[i].end = (size_t)checkpoint_get_u64(c);
        }
    }
    return c->short_read ? -1 : 0;
}

// Reads and checks a manifest of n bytes into `m` (its buffers allocated: checkpoint_manifest_free).
// Returns 0, or -1 with what is wrong in `error` (m left empty).
static inline int checkpoint_manifest_decode(const unsigned char *in, size_t n, CheckpointManifest *m, char *error,
                                             size_t error_size) {
    memset(m, 0, sizeof(*m));
    size_t fixed = 8 + 8 + CHECKPOINT_HEADER_BYTES + 8 + 8 * CHECKPOINT_ARRAYS + 8 + 8;
    if (n < fixed || memcmp(in, CHECKPOINT_MANIFEST_MAGIC, 8) != 0) {
        snprintf(error, error_size, n < fixed ? "truncated manifest" : "not a per-rank checkpoint's manifest (bad magic)");
        return -1;
    }
    uint64_t version, stored_crc;
    memcpy(&version, in + 8, 8);
    memcpy(&stored_crc, in + n - 8, 8);
    uint32_t crc = (uint32_t)checkpoint_crc32(crc32(0L, Z_NULL, 0), in, n - 8);
    if (version != CHECKPOINT_PARTS_VERSION) {
        snprintf(error, error_size, "manifest version %llu, this build reads %d", (unsigned long long)version, CHECKPOINT_PARTS_VERSION);
        return -1;
    }
    if (stored_crc != crc) {
        snprintf(error, error_size, "the manifest fails its checksum (crc32 %08x, it says %08llx): the file is damaged", (unsigned)crc,
                 (unsigned long long)stored_crc);
        return -1;
    }
    char what[256];
    if (checkpoint_decode_header((const char *)in + 16, &m->header, what, sizeof(what)) != 0) {
        snprintf(error, error_size, "the manifest's header: %s", what);
        return -1;
    }
    CheckpointCursor c = {in + 16 + CHECKPOINT_HEADER_BYTES, n - 8 - 16 - CHECKPOINT_HEADER_BYTES, 0};
    uint64_t parts = checkpoint_get_u64(&c);
    m->parts = parts > CHECKPOINT_PARTS_MAX ? 0 : (int)parts;
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) m->group_bytes[a] = (size_t)checkpoint_get_u64(&c);
    m->optimizer_header_bytes = (size_t)checkpoint_get_u64(&c);
    m->optimizer_header = checkpoint_get_bytes(&c, m->optimizer_header_bytes, m->header.optimizer_state_bytes);
    m->trainer_state = checkpoint_get_bytes(&c, m->header.trainer_state_bytes, c.left);
    int decoded = m->parts >= 1 && !c.short_read && checkpoint_manifest_decode_parts(&c, m) == 0 && c.left == 0;
    if (!decoded || checkpoint_manifest_check(m, what, sizeof(what)) != 0) {
        if (decoded) snprintf(error, error_size, "corrupt manifest: %s", what);
        else snprintf(error, error_size, "corrupt manifest (%s)", m->parts < 1 ? "no part, or more than a manifest lists"
                                                                               : "its sizes and counts disagree with its length");
        checkpoint_manifest_free(m);
        return -1;
    }
    return 0;
}

static inline void checkpoint_encode_part_header(unsigned char out[CHECKPOINT_PART_HEADER_BYTES], long long step, int part,
                                                 int parts) {
    memcpy(out, CHECKPOINT_PART_MAGIC, 8);
    uint64_t fields[4] = {CHECKPOINT_PARTS_VERSION, (uint64_t)step, (uint64_t)part, (uint64_t)parts};
    memcpy(out + 8, fields, sizeof(fields));
}

// A part file's header against what the manifest expects of it. Returns 0, or -1 with `error`.
static inline int checkpoint_check_part_header(const unsigned char in[CHECKPOINT_PART_HEADER_BYTES], long long step, int part,
                                               int parts, char *error, size_t error_size) {
    uint64_t fields[4];
    memcpy(fields, in + 8, sizeof(fields));
    if (memcmp(in, CHECKPOINT_PART_MAGIC, 8) != 0 || fields[0] != CHECKPOINT_PARTS_VERSION) {
        snprintf(error, error_size, "not a checkpoint part of this version (bad magic or version)");
        return -1;
    }
    if (fields[1] != (uint64_t)step || fields[2] != (uint64_t)part || fields[3] != (uint64_t)parts) {
        snprintf(error, error_size, "holds part %llu of %llu of step %llu, the manifest expects part %d of %d of step %lld here",
                 (unsigned long long)fields[2], (unsigned long long)fields[3], (unsigned long long)fields[1], part, parts, step);
        return -1;
    }
    return 0;
}

// Starts part `part` of `parts` of step `step`, DIR/ckpt_<step>.rank<part>.bin.tmp: its header
// goes through `sink`, whose CRC-32 then covers the whole file. Returns 0, or -1 with `error`.
static inline int checkpoint_part_begin(const char *dir, long long step, int part, int parts, CheckpointSink *sink,
                                        char *error, size_t error_size) {
    char manifest[4096], final_path[4096], tmp[4200];
    unsigned char header[CHECKPOINT_PART_HEADER_BYTES];
    checkpoint_path(manifest, sizeof(manifest), dir, step, ".bin");
    checkpoint_part_path(final_path, sizeof(final_path), manifest, part);
    snprintf(tmp, sizeof(tmp), "%s.tmp", final_path);
    FILE *f = fopen(tmp, "wb");
    if (!f) { snprintf(error, error_size, "%s: cannot create: %s", tmp, strerror(errno)); return -1; }
    checkpoint_sink_init(sink, f);
    checkpoint_encode_part_header(header, step, part, parts);
    checkpoint_sink_write(sink, header, sizeof(header));
    return 0;
}

// Flushes the part file to disk, `bytes` long, and renames it into place; *crc: the CRC-32 of the
// whole file. On a failure (a write through the sink too) the temporary file is removed and
// `error` names it with the reason. Returns 0 or -1.
static inline int checkpoint_part_commit(CheckpointSink *sink, const char *dir, long long step, int part,
                                         unsigned long long bytes, uint32_t *crc, char *error, size_t error_size) {
    char manifest[4096], final_path[4096], tmp[4200];
    checkpoint_path(manifest, sizeof(manifest), dir, step, ".bin");
    checkpoint_part_path(final_path, sizeof(final_path), manifest, part);
    snprintf(tmp, sizeof(tmp), "%s.tmp", final_path);
    int status = sink->error;
    if (status == 0 && sink->bytes != bytes) {
        snprintf(error, error_size, "%s: %llu bytes written, the part holds %llu", tmp, sink->bytes, bytes);
        status = -1;
    }
    errno = 0;
    if (status == 0 && (fflush(sink->file) != 0 || fsync(fileno(sink->file)) != 0)) status = errno ? errno : EIO;
    *crc = (uint32_t)sink->crc;
    return checkpoint_close_and_rename(sink->file, status, tmp, final_path, error, error_size);
}

// Writes the manifest DIR/ckpt_<step>.bin (through DIR/ckpt_<step>.bin.tmp, flushed to disk and
// renamed), then the .done marker: call it once every part is on disk. Returns 0, or -1 with
// `error` (the temporary file removed).
static inline int checkpoint_manifest_commit(const char *dir, const CheckpointManifest *m, char *error, size_t error_size) {
    char tmp[4096], final_path[4096];
    long long step = m->header.step;
    checkpoint_path(tmp, sizeof(tmp), dir, step, ".bin.tmp");
    checkpoint_path(final_path, sizeof(final_path), dir, step, ".bin");
    size_t n = 0;
    unsigned char *bytes = checkpoint_manifest_encode(m, &n);
    if (!bytes) { snprintf(error, error_size, "%s: out of host memory for the manifest", tmp); return -1; }
    FILE *f = fopen(tmp, "wb");
    if (!f) {
        snprintf(error, error_size, "%s: cannot create: %s", tmp, strerror(errno));
        free(bytes);
        return -1;
    }
    errno = 0;
    int status = fwrite(bytes, 1, n, f) == n && fflush(f) == 0 && fsync(fileno(f)) == 0 ? 0 : errno ? errno : EIO;
    free(bytes);
    if (checkpoint_close_and_rename(f, status, tmp, final_path, error, error_size) != 0) return -1;
    return checkpoint_mark_done(dir, step, error, error_size);
}

// ---- reading either form ----------------------------------------------------------------
// A Checkpoint reads the bytes of the single file at its offsets, from the file itself or from
// a manifest and its parts: its readers (the trainer, the optimizer) see one layout.

typedef struct {
    size_t begin, end;     // elements of the parameter order
    int part;
    size_t groups_before;  // of the part's ranges before this one
} CheckpointPiece;

typedef struct {
    char path[4096];
    CheckpointHeader header;      // of the single file (a manifest's: of the file it stands for)
    FILE *file;                   // the single file; NULL for a manifest
    CheckpointManifest manifest;  // parts 0 for a single file
    char header_bytes[CHECKPOINT_HEADER_BYTES];  // the single file's first bytes (a manifest's: checksums 0)
    FILE **part_files;            // [parts], each opened at its first read
    size_t *part_groups;          // [parts]: the groups of every array each part holds
    CheckpointPiece *pieces;      // the parts' ranges, sorted by begin
    int piece_count;
} Checkpoint;

// A checkpoint over a file already open, whose offsets are the single file's (a stream without a
// header reads as one whose offsets start at its first byte).
static inline void checkpoint_over_file(Checkpoint *ck, FILE *f, const char *path) {
    memset(ck, 0, sizeof(*ck));
    snprintf(ck->path, sizeof(ck->path), "%s", path);
    ck->file = f;
}

static inline void checkpoint_close(Checkpoint *ck) {
    if (ck->file) fclose(ck->file);
    for (int p = 0; ck->part_files && p < ck->manifest.parts; p++)
        if (ck->part_files[p]) fclose(ck->part_files[p]);
    free(ck->part_files);
    free(ck->part_groups);
    free(ck->pieces);
    checkpoint_manifest_free(&ck->manifest);
    memset(ck, 0, sizeof(*ck));
}

static inline int checkpoint_piece_order(const void *a, const void *b) {
    size_t x = ((const CheckpointPiece *)a)->begin, y = ((const CheckpointPiece *)b)->begin;
    return x < y ? -1 : x > y;
}

// The pieces sorted by begin, each part's groups: where each range sits in its part file.
static inline int checkpoint_index_parts(Checkpoint *ck) {
    const CheckpointManifest *m = &ck->manifest;
    size_t count = 0, parts = m->parts > 0 ? (size_t)m->parts : 1;  // (a decoded manifest has parts)
    for (int p = 0; p < m->parts; p++) count += (size_t)m->part[p].range_count;
    ck->pieces = (CheckpointPiece *)malloc((count ? count : 1) * sizeof(CheckpointPiece));
    ck->part_groups = (size_t *)calloc(parts, sizeof(size_t));
    ck->part_files = (FILE **)calloc(parts, sizeof(FILE *));
    if (!ck->pieces || !ck->part_groups || !ck->part_files) return -1;
    for (int p = 0; p < m->parts; p++)
        for (int i = 0; i < m->part[p].range_count; i++) {
            CheckpointPiece piece = {m->part[p].ranges[i].begin, m->part[p].ranges[i].end, p, ck->part_groups[p]};
            ck->pieces[ck->piece_count++] = piece;
            ck->part_groups[p] += (piece.end - piece.begin) / PARAM_ALIGN_ELEMS;
        }
    qsort(ck->pieces, count, sizeof(CheckpointPiece), checkpoint_piece_order);
    return 0;
}

// "(part P of N of MANIFEST)", which follows every error about a part file.
static inline void checkpoint_part_context(const Checkpoint *ck, int part, char *out, size_t size) {
    snprintf(out, size, "(part %d of %d of %s)", part, ck->manifest.parts, ck->path);
}

// Part file `part` is there, a regular file of the size the manifest gives, and its header is
// the one expected. Returns 0, or -1 with `error` naming the file and what is wrong.
static inline int checkpoint_check_part(const Checkpoint *ck, int part, char *error, size_t error_size) {
    char path[4200], context[4400], what[256];
    unsigned char header[CHECKPOINT_PART_HEADER_BYTES];
    checkpoint_part_path(path, sizeof(path), ck->path, part);
    checkpoint_part_context(ck, part, context, sizeof(context));
    struct stat st;
    unsigned long long expected = ck->manifest.part[part].file_bytes;
    if (stat(path, &st) != 0) {
        snprintf(error, error_size, "%s: %s %s", path, errno == ENOENT ? "missing" : strerror(errno), context);
        return -1;
    }
    if (!S_ISREG(st.st_mode) || (unsigned long long)st.st_size != expected) {
        if (!S_ISREG(st.st_mode)) snprintf(error, error_size, "%s: is no regular file %s", path, context);
        else snprintf(error, error_size, "%s: size %lld bytes, the manifest says %llu (truncated or damaged) %s", path,
                      (long long)st.st_size, expected, context);
        return -1;
    }
    FILE *f = fopen(path, "rb");
    int status = f && fread(header, 1, sizeof(header), f) == sizeof(header) ? 0 : -1;
    if (status != 0) snprintf(error, error_size, "%s: cannot read: %s %s", path, f ? "truncated" : strerror(errno), context);
    if (f) fclose(f);
    if (status == 0 && checkpoint_check_part_header(header, ck->header.step, part, ck->manifest.parts, what, sizeof(what)) != 0) {
        snprintf(error, error_size, "%s: %s %s", path, what, context);
        status = -1;
    }
    return status;
}

// Reads the manifest at ck->path (n bytes, open as f) and checks every part file it lists.
static inline int checkpoint_open_manifest(Checkpoint *ck, FILE *f, unsigned long long n, char *error, size_t error_size) {
    char what[512];
    if (n > CHECKPOINT_MANIFEST_BYTES_MAX) {
        snprintf(error, error_size, "%s: a manifest of %llu bytes, past any model's", ck->path, n);
        return -1;
    }
    unsigned char *bytes = (unsigned char *)malloc((size_t)n);
    if (!bytes) { snprintf(error, error_size, "%s: out of host memory for the manifest", ck->path); return -1; }
    int status = fseeko(f, 0, SEEK_SET) == 0 && fread(bytes, 1, (size_t)n, f) == (size_t)n ? 0 : -1;
    if (status != 0) snprintf(error, error_size, "%s: cannot read the manifest: %s", ck->path, ferror(f) ? strerror(errno) : "truncated");
    else if (checkpoint_manifest_decode(bytes, (size_t)n, &ck->manifest, what, sizeof(what)) != 0) {
        snprintf(error, error_size, "%s: %s", ck->path, what);
        status = -1;
    }
    free(bytes);
    if (status != 0) return -1;
    ck->header = ck->manifest.header;
    checkpoint_encode_header(&ck->header, ck->header_bytes);
    if (checkpoint_index_parts(ck) != 0) {
        snprintf(error, error_size, "%s: out of host memory for the parts' table", ck->path);
        return -1;
    }
    for (int p = 0; p < ck->manifest.parts; p++)
        if (checkpoint_check_part(ck, p, error, error_size) != 0) return -1;
    return 0;
}

// Reads the single file's header at ck->path (n bytes, open as f), checking that the file holds
// every section it announces.
static inline int checkpoint_open_single(Checkpoint *ck, FILE *f, unsigned long long n, char *error, size_t error_size) {
    char what[256];
    if (fseeko(f, 0, SEEK_SET) != 0 || fread(ck->header_bytes, 1, CHECKPOINT_HEADER_BYTES, f) != CHECKPOINT_HEADER_BYTES) {
        snprintf(error, error_size, "%s: truncated header", ck->path);
        return -1;
    }
    if (checkpoint_decode_header(ck->header_bytes, &ck->header, what, sizeof(what)) != 0) {
        snprintf(error, error_size, "%s: %s", ck->path, what);
        return -1;
    }
    unsigned long long expected = checkpoint_file_bytes(&ck->header);
    if (n != expected) {
        snprintf(error, error_size, "%s: size %llu bytes, header announces %llu (truncated or corrupt)", ck->path, n, expected);
        return -1;
    }
    ck->file = f;
    return 0;
}

// Opens a checkpoint, one file or a manifest with its parts, and reads its header (ck->header).
// A path that is no regular file (a folder, a FIFO that would block) is refused before it is
// opened; so is a manifest whose part files are not all there, each of its size and header.
// Returns 0, or -1 with `error` naming the file and what is wrong (ck closed).
static inline int checkpoint_open(Checkpoint *ck, const char *path, char *error, size_t error_size) {
    char magic[8];
    struct stat st;
    checkpoint_over_file(ck, NULL, path);
    if (stat(path, &st) != 0) { snprintf(error, error_size, "%s: cannot open: %s", path, strerror(errno)); return -1; }
    if (!S_ISREG(st.st_mode)) {
        snprintf(error, error_size, "%s: is %s, not a checkpoint file", path, S_ISDIR(st.st_mode) ? "a directory" : "no regular file");
        return -1;
    }
    FILE *f = fopen(path, "rb");
    if (!f) { snprintf(error, error_size, "%s: cannot open: %s", path, strerror(errno)); return -1; }
    int manifest = fread(magic, 1, 8, f) == 8 && memcmp(magic, CHECKPOINT_MANIFEST_MAGIC, 8) == 0;
    int status = manifest ? checkpoint_open_manifest(ck, f, (unsigned long long)st.st_size, error, error_size)
                          : checkpoint_open_single(ck, f, (unsigned long long)st.st_size, error, error_size);
    if (manifest || status != 0) fclose(f);
    if (status != 0) checkpoint_close(ck);
    return status;
}

static inline FILE *checkpoint_part_file(Checkpoint *ck, int part, char *error, size_t error_size) {
    if (ck->part_files[part]) return ck->part_files[part];
    char path[4200], context[4400];
    checkpoint_part_path(path, sizeof(path), ck->path, part);
    ck->part_files[part] = fopen(path, "rb");
    if (!ck->part_files[part]) {
        checkpoint_part_context(ck, part, context, sizeof(context));
        snprintf(error, error_size, "%s: cannot open: %s %s", path, strerror(errno), context);
    }
    return ck->part_files[part];
}

// The piece that holds element e (the pieces tile the parameter order).
static inline const CheckpointPiece *checkpoint_piece_of(const Checkpoint *ck, size_t e) {
    int low = 0, high = ck->piece_count - 1;
    while (low < high) {
        int middle = (low + high + 1) / 2;
        if (ck->pieces[middle].begin <= e) low = middle;
        else high = middle - 1;
    }
    return &ck->pieces[low];
}

// Bytes [x, x + n) of array a (the parameter order's groups), from the parts that hold them.
static inline int checkpoint_read_array(Checkpoint *ck, int a, unsigned long long x, unsigned char *out, size_t n, char *error,
                                        size_t error_size) {
    const CheckpointManifest *m = &ck->manifest;
    size_t group_bytes = m->group_bytes[a];
    while (n > 0) {
        const CheckpointPiece *piece = checkpoint_piece_of(ck, (size_t)(x / group_bytes) * PARAM_ALIGN_ELEMS);
        unsigned long long first = (unsigned long long)(piece->begin / PARAM_ALIGN_ELEMS) * group_bytes;
        unsigned long long last = (unsigned long long)(piece->end / PARAM_ALIGN_ELEMS) * group_bytes;
        size_t take = n < last - x ? n : (size_t)(last - x);
        unsigned long long at = CHECKPOINT_PART_HEADER_BYTES + piece->groups_before * group_bytes + (x - first);
        for (int before = 0; before < a; before++) at += (unsigned long long)ck->part_groups[piece->part] * m->group_bytes[before];
        FILE *f = checkpoint_part_file(ck, piece->part, error, error_size);
        if (!f) return -1;
        if (fseeko(f, (off_t)at, SEEK_SET) != 0 || fread(out, 1, take, f) != take) {
            char path[4200], context[4400];
            checkpoint_part_path(path, sizeof(path), ck->path, piece->part);
            checkpoint_part_context(ck, piece->part, context, sizeof(context));
            snprintf(error, error_size, "%s: read failed: %s %s", path, ferror(f) ? strerror(errno) : "truncated", context);
            return -1;
        }
        x += take;
        out += take;
        n -= take;
    }
    return 0;
}

// The single file's bytes [offset, offset + n) from a manifest and its parts: its regions are
// the header, array 0, the optimizer state's header bytes, arrays 1 to 4, the trainer state.
static inline int checkpoint_read_parts(Checkpoint *ck, unsigned long long offset, unsigned char *out, size_t n, char *error,
                                        size_t error_size) {
    const CheckpointManifest *m = &ck->manifest;
    const unsigned char *blobs[8] = {(const unsigned char *)ck->header_bytes, NULL, m->optimizer_header, NULL, NULL, NULL, NULL,
                                     m->trainer_state};
    unsigned long long length[8] = {CHECKPOINT_HEADER_BYTES, checkpoint_array_bytes(m, 0), m->optimizer_header_bytes,
                                    checkpoint_array_bytes(m, 1), checkpoint_array_bytes(m, 2), checkpoint_array_bytes(m, 3),
                                    checkpoint_array_bytes(m, 4), m->header.trainer_state_bytes};
    int array_of_region[8] = {-1, 0, -1, 1, 2, 3, 4, -1};
    unsigned long long start = 0;
    for (int region = 0; region < 8 && n > 0; start += length[region++]) {
        if (offset >= start + length[region]) continue;
        size_t take = n < start + length[region] - offset ? n : (size_t)(start + length[region] - offset);
        int a = array_of_region[region];
        if (a >= 0 && checkpoint_read_array(ck, a, offset - start, out, take, error, error_size) != 0) return -1;
        if (a < 0) memcpy(out, blobs[region] + (offset - start), take);
        offset += take;
        out += take;
        n -= take;
    }
    if (n > 0) {
        snprintf(error, error_size, "%s: a read past the end of the checkpoint (at byte %llu)", ck->path, offset);
        return -1;
    }
    return 0;
}

// Bytes [offset, offset + n) of the single file, whichever form holds them. Returns 0, or -1 with
// `error` naming the file.
static inline int checkpoint_read(Checkpoint *ck, unsigned long long offset, void *out, size_t n, char *error, size_t error_size) {
    if (!ck->file) return checkpoint_read_parts(ck, offset, (unsigned char *)out, n, error, error_size);
    if (fseeko(ck->file, (off_t)offset, SEEK_SET) != 0 || fread(out, 1, n, ck->file) != n) {
        snprintf(error, error_size, "%s: read failed: %s", ck->path, ferror(ck->file) ? strerror(errno) : "truncated");
        return -1;
    }
    return 0;
}

// Part file `part` against its CRC-32 in the manifest. Returns 0, or -1 with `error`.
static inline int checkpoint_verify_part(Checkpoint *ck, int part, char *error, size_t error_size) {
    const size_t CHUNK = (size_t)1 << 20;
    char path[4200], context[4400];
    checkpoint_part_path(path, sizeof(path), ck->path, part);
    checkpoint_part_context(ck, part, context, sizeof(context));
    FILE *f = checkpoint_part_file(ck, part, error, error_size);
    unsigned char *buffer = (unsigned char *)malloc(CHUNK);
    if (!f || !buffer) {
        if (f) snprintf(error, error_size, "%s: out of host memory for the checksum", path);
        free(buffer);
        return -1;
    }
    uLong crc = crc32(0L, Z_NULL, 0);
    int status = fseeko(f, 0, SEEK_SET) == 0 ? 0 : -1;
    for (unsigned long long left = ck->manifest.part[part].file_bytes; left > 0 && status == 0;) {
        size_t n = left < CHUNK ? (size_t)left : CHUNK;
        if (fread(buffer, 1, n, f) != n) status = -1;
        else crc = crc32(crc, buffer, (uInt)n);
        left -= n;
    }
    free(buffer);
    if (status != 0) {
        snprintf(error, error_size, "%s: read failed while checksumming: %s %s", path, ferror(f) ? strerror(errno) : "truncated",
                 context);
        return -1;
    }
    if ((uint32_t)crc != ck->manifest.part[part].crc) {
        snprintf(error, error_size, "%s: fails its checksum (crc32 %08x, the manifest says %08x): the file is damaged %s", path,
                 (unsigned)crc, (unsigned)ck->manifest.part[part].crc, context);
        return -1;
    }
    return 0;
}

// Checks the checkpoint against its checksums, the work shared by `world` ranks of which this is
// `rank`: a single file's sections on rank 0 (version 1 has none), a manifest's part files p with
// p % world == rank (its own checksum was checked when it was opened). Returns 0, or -1 with
// `error` naming the file and what is damaged.
static inline int checkpoint_verify(Checkpoint *ck, int rank, int world, char *error, size_t error_size) {
    if (ck->file) return rank == 0 ? checkpoint_verify_sections(ck->file, ck->path, &ck->header, error, error_size) : 0;
    for (int p = rank; p < ck->manifest.parts; p += world)
        if (checkpoint_verify_part(ck, p, error, error_size) != 0) return -1;
    return 0;
}

// ---- the run's folder ---------------------------------------------------------------------

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

// The step of a part file's name, ckpt_<step>.rank<p>.bin; -1 for any other name.
static inline long long checkpoint_part_name_step(const char *name) {
    long long step;
    int part, length = -1;
    if (sscanf(name, "ckpt_%lld.rank%d.bin%n", &step, &part, &length) != 2 || length != (int)strlen(name)) return -1;
    return step;
}

// Removes the part files of step `step` from DIR, whatever their number.
static inline void checkpoint_remove_parts(const char *dir, long long step) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *entry;
    while ((entry = readdir(d)) != NULL) {
        if (checkpoint_part_name_step(entry->d_name) != step) continue;
        char path[4096];
        snprintf(path, sizeof(path), "%s/%s", dir, entry->d_name);
        remove(path);
    }
    closedir(d);
}

// Removes checkpoints older than the newest `keep` (marker first, so a half-removed one is
// ignored), their part files too.
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
        checkpoint_remove_parts(dir, oldest);
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

// A part file of a checkpoint that was never finished: its rank renamed it into place, but the
// run stopped before rank 0 wrote the manifest (no ckpt_<step>.bin) or its marker.
static inline int checkpoint_is_orphan_part(const char *dir, const char *name) {
    long long step = checkpoint_part_name_step(name);
    char path[4096];
    if (step < 0) return 0;
    checkpoint_path(path, sizeof(path), dir, step, ".done");
    if (access(path, F_OK) == 0) return 0;
    checkpoint_path(path, sizeof(path), dir, step, ".bin");
    return access(path, F_OK) != 0;
}

// Removes what an interrupted write left in DIR (ckpt_<step>.bin.tmp, ckpt_<step>.rank<p>.bin.tmp,
// the part files of a checkpoint that has neither manifest nor marker, log.jsonl.tmp): a killed
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
        if (!temporary && !checkpoint_is_orphan_part(dir, entry->d_name)) continue;
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
