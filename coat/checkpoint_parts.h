// Per-rank checkpoints (checkpoint_writes = per_rank): one checkpoint (coat/checkpoint_file.h) in
// several files, written in parallel, each by the rank that holds its part:
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
// the H header bytes then arrays 1 to 4. coat/checkpoint_reader.h maps the single file's offsets
// to the parts: any world size, stage and bucketing reads its own parts from either form, and
// scripts/convert_hf.py merge writes the single file. Each rank writes DIR/ckpt_<step>.rank<p>
// .bin.tmp, flushes it to disk and renames it; rank 0 writes the manifest and the .done marker
// once every rank has reported its part on disk (the trainer's collective; coat/run_dir.h).
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>
#include "checkpoint_file.h"
#include "params.h"
#include "run_dir.h"

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
