// The program test/test_scripts.sh and test/test_cli.sh use to make per-rank checkpoints on the
// CPU: the one file IN (coat/checkpoint_file.h) written again as the ranks of a ZeRO plan write it with
// checkpoint_writes = per_rank, through the same calls:
//   checkpoint_split IN DIR RANKS BUCKET_MIN_ELEMS
// writes DIR/ckpt_<step>.rank<r>.bin for every rank r that owns a part of the buckets (stage 1
// over RANKS ranks, bucket_min_elems BUCKET_MIN_ELEMS), then the manifest DIR/ckpt_<step>.bin and
// DIR/ckpt_<step>.done. The optimizer's arrays take the bytes per group of the state kind its
// header names (uint64 magic, version, kind: coat/optimizer.cuh); a weights-only file has none.
// IN's checksums are verified first. Exit 0, or 1 with the error.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../coat/checkpoint_parts.h"
#include "../coat/checkpoint_reader.h"
#include "../coat/optimizer_states.h"
#include "../coat/zero.h"

#define COPY_BYTES ((size_t)1 << 20)

static ZeroPlan plan;

// The bytes per group of every array: the weights' FP32, the optimizer's by its state kind.
static int array_group_bytes(Checkpoint *in, size_t group_bytes[CHECKPOINT_ARRAYS], size_t *optimizer_header_bytes,
                             char *error, size_t size) {
    const CheckpointHeader *h = &in->header;
    uint64_t kind = 0;
    *optimizer_header_bytes = h->has_optimizer_state ? 56 : 0;
    if (h->has_optimizer_state &&
        checkpoint_read(in, CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded + 16, &kind, 8, error, size) != 0)
        return -1;
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++)
        group_bytes[a] = a == 0 || h->has_optimizer_state ? adamw_section_group_bytes((OptimizerStateKind)kind, a) : 0;
    if (kind > OPT_STATES_FP8_DRE) {
        snprintf(error, size, "%s: optimizer state kind %llu is none this build knows", in->path, (unsigned long long)kind);
        return -1;
    }
    return 0;
}

// Where array a starts in the one file.
static unsigned long long array_at(const CheckpointHeader *h, const size_t group_bytes[], size_t optimizer_header_bytes, int a) {
    unsigned long long at = CHECKPOINT_HEADER_BYTES;
    for (int before = 0; before < a; before++) at += (unsigned long long)(h->total_padded / 128) * group_bytes[before];
    return a > 0 ? at + optimizer_header_bytes : at;
}

// Part r: every array's bytes of its ranges, copied from IN through the sink.
static int write_part(Checkpoint *in, const char *dir, CheckpointManifest *m, int r, unsigned char *buffer, char *error,
                      size_t size) {
    CheckpointPart *part = &m->part[r];
    CheckpointSink sink;
    if (checkpoint_part_begin(dir, m->header.step, r, m->parts, &sink, error, size) != 0) return -1;
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++)
        for (int i = 0; i < part->range_count; i++) {
            unsigned long long at = array_at(&m->header, m->group_bytes, m->optimizer_header_bytes, a) +
                                    part->ranges[i].begin / 128 * m->group_bytes[a];
            unsigned long long left = (part->ranges[i].end - part->ranges[i].begin) / 128 * m->group_bytes[a];
            for (size_t n; left > 0; at += n, left -= n) {
                n = left < COPY_BYTES ? (size_t)left : COPY_BYTES;
                if (checkpoint_read(in, at, buffer, n, error, size) != 0) return -1;
                checkpoint_sink_write(&sink, buffer, n);
            }
        }
    return checkpoint_part_commit(&sink, dir, m->header.step, r, part->file_bytes, &part->crc, error, size);
}

// The manifest of IN's parts under the plan, its blobs read from IN.
static int make_manifest(Checkpoint *in, CheckpointManifest *m, char *error, size_t size) {
    const CheckpointHeader *h = &in->header;
    m->header = *h;
    if (array_group_bytes(in, m->group_bytes, &m->optimizer_header_bytes, error, size) != 0) return -1;
    m->optimizer_header = (unsigned char *)malloc(m->optimizer_header_bytes + 1);
    m->trainer_state = (unsigned char *)malloc(h->trainer_state_bytes + 1);
    m->part = (CheckpointPart *)calloc((size_t)plan.shards, sizeof(CheckpointPart));
    if (!m->optimizer_header || !m->trainer_state || !m->part) { snprintf(error, size, "out of host memory"); return -1; }
    m->parts = plan.shards;
    unsigned long long optimizer_at = CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded;
    if (checkpoint_read(in, optimizer_at, m->optimizer_header, m->optimizer_header_bytes, error, size) != 0 ||
        checkpoint_read(in, optimizer_at + h->optimizer_state_bytes, m->trainer_state, h->trainer_state_bytes, error, size) != 0)
        return -1;
    for (int r = 0; r < plan.shards; r++) {
        CheckpointPart *part = &m->part[r];
        part->ranges = (CheckpointRange *)malloc((size_t)plan.buckets * sizeof(CheckpointRange));
        if (!part->ranges) { snprintf(error, size, "out of host memory"); return -1; }
        for (int b = 0; b < plan.buckets; b++) {
            size_t begin, end;
            param_shard_part(&plan.bucket[b], r, &begin, &end);
            if (end > begin) part->ranges[part->range_count].begin = begin, part->ranges[part->range_count++].end = end;
        }
        part->file_bytes = checkpoint_part_file_bytes(part->ranges, part->range_count, m->group_bytes);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 5 || atoi(argv[3]) < 1 || atol(argv[4]) < 1) {
        fprintf(stderr, "usage: checkpoint_split IN DIR RANKS BUCKET_MIN_ELEMS\n");
        return 2;
    }
    char error[8192];
    Checkpoint in;
    CheckpointManifest m;
    memset(&m, 0, sizeof(m));
    if (checkpoint_open(&in, argv[1], error, sizeof(error)) != 0 || checkpoint_verify(&in, 0, 1, error, sizeof(error)) != 0) {
        fprintf(stderr, "error: %s\n", error);
        return 1;
    }
    ParamLayout layout;
    param_layout_init(&layout, &in.header.shape);
    zero_plan_init(&plan, &layout, atoi(argv[3]), 1, (size_t)atol(argv[4]));
    unsigned char *buffer = (unsigned char *)malloc(COPY_BYTES);
    int status = buffer && make_manifest(&in, &m, error, sizeof(error)) == 0 ? 0 : -1;
    for (int r = 0; r < m.parts && status == 0; r++) status = write_part(&in, argv[2], &m, r, buffer, error, sizeof(error));
    if (status == 0) status = checkpoint_manifest_commit(argv[2], &m, error, sizeof(error));
    if (status != 0) fprintf(stderr, "error: %s\n", buffer ? error : "out of host memory");
    else printf("%s: %d part files of step %lld in %s\n", argv[1], m.parts, m.header.step, argv[2]);
    checkpoint_manifest_free(&m);
    checkpoint_close(&in);
    free(buffer);
    return status == 0 ? 0 : 1;
}
