// The checkpoint file: everything needed to continue a run bit-exactly, in one file, and its
// writer. Little-endian layout:
//   "LLAMACK1", int64 fields[63] (CheckpointField), then three sections: FP32 master weights
//   [total_padded] (the layout of coat/params.h), the optimizer state and the trainer state
//   (opaque blobs).
// Version 2 carries a CRC-32 (zlib's) of each section, taken as the section is written (nothing
// is read back), and of the header itself (computed with its own field zero): a flipped bit or a
// zero-filled stretch anywhere is refused on load, naming the section. Version 1 (no checksums;
// what scripts/convert_hf.py wrote before version 2) is still read, its weights unchecked, with a
// warning; it holds no trainer state this build resumes from.
// Written as DIR/ckpt_<step>.bin.tmp through a CheckpointSink, sealed with the checksums, flushed,
// renamed and marked DIR/ckpt_<step>.done (coat/run_dir.h). checkpoint_writes = rank0 writes this
// file; per_rank writes the same bytes as a manifest and a part file per rank
// (coat/checkpoint_parts.h), and coat/checkpoint_reader.h reads either form at this file's
// offsets. scripts/convert_hf.py reads both versions and both forms, writes version 2
// (scripts/llama_layout.py: the same bytes as a weights-only checkpoint here), and merges a
// per-rank checkpoint into the one file.
// The trainer's plumbing (its file format), not model code: it stores coat/params.h's layout.
#pragma once
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zlib.h>
#include "model_shape.h"
#include "run_dir.h"

#define CHECKPOINT_MAGIC "LLAMACK1"
#define CHECKPOINT_VERSION 2
#define CHECKPOINT_VERSION_UNCHECKED 1  // the version before checksums
#define CHECKPOINT_FIELDS 63
#define CHECKPOINT_HEADER_BYTES (8 + 8 * CHECKPOINT_FIELDS)
#define CHECKPOINT_SECTIONS 3  // weights, optimizer state, trainer state

// Fields 1 to 13 hold the model shape, coat/model_shape.h's keys in their order (CK_SHAPE_<key>):
// an int as int64, a float as the bits of the double it widens to.
#define CHECKPOINT_SHAPE_FIELD(name, type, load, default_value, min, max, help) CK_SHAPE_##name,
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
#define CHECKPOINT_ENCODE_SHAPE(name, type, load, default_value, min, max, help) f[CK_SHAPE_##name] = CHECKPOINT_ENCODE_##type(m->name);
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
#define CHECKPOINT_INT_FIELD(name, type, load, default_value, min, max, help) CHECKPOINT_INT_FIELD_##type(name)
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
#define CHECKPOINT_DECODE_SHAPE(name, type, load, default_value, min, max, help) m->name = CHECKPOINT_DECODE_##type(f[CK_SHAPE_##name]);
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

// Names the first model-shape key where the checkpoint's shape `a` and the config's `b` disagree,
// or returns NULL. Each key's load column (coat/model_shape.h) says what must agree: max_seq_len
// need not (a checkpoint may continue at another sequence length); the weights were trained with
// the RoPE and norm keys, which another value would silently change; the other scaling keys
// matter only with scaling on.
#define CHECKPOINT_SHAPE_MISMATCH_same(name) if (a->name != b->name) return #name;
#define CHECKPOINT_SHAPE_MISMATCH_any(name)
#define CHECKPOINT_SHAPE_MISMATCH_same_when_scaled(name) if (a->rope_scaling_factor > 0 && a->name != b->name) return #name;
#define CHECKPOINT_SHAPE_MISMATCH(name, type, load, default_value, min, max, help) CHECKPOINT_SHAPE_MISMATCH_##load(name)
static inline const char *checkpoint_shape_mismatch(const ModelShape *a, const ModelShape *b) {
    MODEL_SHAPE_KEYS(CHECKPOINT_SHAPE_MISMATCH)
    return NULL;
}
#undef CHECKPOINT_SHAPE_MISMATCH_same
#undef CHECKPOINT_SHAPE_MISMATCH_any
#undef CHECKPOINT_SHAPE_MISMATCH_same_when_scaled
#undef CHECKPOINT_SHAPE_MISMATCH

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
