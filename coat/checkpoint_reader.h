// The checkpoint reader: a Checkpoint reads the bytes of the single file (coat/checkpoint_file.h)
// at its offsets, from the file itself or from a per-rank checkpoint's manifest and its parts
// (coat/checkpoint_parts.h): its readers (the trainer, the optimizer) see one layout, whatever
// the world size, stage and bucketing that wrote it. checkpoint_open reads and checks the header
// (for a manifest, also each part file's size and header), checkpoint_read reads the bytes at an
// offset, checkpoint_verify checks the checksums, the work shared among the ranks.
//   A manifest's regions, in the single file's order: the header, array 0 (the weights), the
//   optimizer state's header bytes, arrays 1 to 4, the trainer state; each array's bytes in the
//   parts that hold its element ranges (CheckpointPiece: a range, its part, the groups before it).
#pragma once
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <zlib.h>
#include "checkpoint_file.h"
#include "checkpoint_parts.h"
#include "params.h"
#include "run_dir.h"

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
