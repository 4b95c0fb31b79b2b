// Checkpoint files, the run's folder and the run log on the CPU (coat/checkpoint_file.h,
// coat/checkpoint_parts.h, coat/checkpoint_reader.h, coat/run_dir.h, coat/log.h): the checksums
// taken as the sections are written are zlib's of the sections as the file holds them; every section's
// checksum catches a flipped bit and a zero-filled stretch, naming the section; header fields
// that an int cannot hold are refused; a write that fails (a full disk, here a file size limit)
// removes the unfinished file and names it with the reason; stale temporaries are removed; a log
// write that fails ends the run naming the file.
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include "../coat/checkpoint_file.h"
#include "../coat/checkpoint_parts.h"
#include "../coat/checkpoint_reader.h"
#include "../coat/log.h"
#include "../coat/optimizer_states.h"
#include "../coat/run_dir.h"
#include "../coat/zero.h"
#include "check.h"

static char dir[] = "/tmp/test_checkpoint_XXXXXX";

static CheckpointHeader tiny_header(long long step) {
    CheckpointHeader h;
    memset(&h, 0, sizeof(h));
    h.shape.vocab_size = 1000; h.shape.dim = 128; h.shape.n_layers = 2; h.shape.n_heads = 2; h.shape.n_kv_heads = 1;
    h.shape.ffn_dim = 352; h.shape.max_seq_len = 128; h.shape.rope_theta = 10000.0f; h.shape.norm_eps = 1e-5f;
    h.step = step;
    h.total_padded = 1024;
    h.has_optimizer_state = 1;
    h.optimizer_state_bytes = 3000;
    h.trainer_state_bytes = 72;
    return h;
}

// The byte at offset i of a test checkpoint's sections.
static unsigned char section_byte(unsigned long long i) { return (unsigned char)(((i * 2654435761u) >> 13) & 0xFF); }

// Writes DIR/ckpt_<step>.bin through checkpoint_begin, the sink and checkpoint_commit, sections of
// pseudo-random bytes written in pieces of 1 to 700 bytes. Returns the commit's status.
static int write_checkpoint(long long step, char *error, size_t size) {
    CheckpointHeader h = tiny_header(step);
    CheckpointSink sink;
    if (checkpoint_begin(dir, &h, &sink, error, size) != 0) return -1;
    unsigned char piece[700];
    unsigned long long at = 0;
    for (int section = 0; section < CHECKPOINT_SECTIONS; section++) {
        unsigned long long end = at + checkpoint_section_bytes(&h, section);
        while (at < end) {
            size_t n = (size_t)(at * 7 % 700) + 1;
            if (n > end - at) n = (size_t)(end - at);
            for (size_t i = 0; i < n; i++) piece[i] = section_byte(at + i);
            checkpoint_sink_write(&sink, piece, n);
            at += n;
        }
        h.crc[section] = checkpoint_sink_section(&sink);
    }
    return checkpoint_commit(&sink, dir, &h, error, size);
}

// Opens and verifies `path`: 0 when accepted, else -1 with the reason in `error`.
static int open_and_verify(const char *path, char *error, size_t size) {
    Checkpoint ck;
    if (checkpoint_open(&ck, path, error, size) != 0) return -1;
    int status = checkpoint_verify(&ck, 0, 1, error, size);
    checkpoint_close(&ck);
    return status;
}

static void copy_with_change(const char *from, const char *to, long offset, int bit, long zero_bytes) {
    FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
    if (!in || !out) { fprintf(stderr, "error: %s: cannot copy\n", from); exit(1); }
    int c;
    for (long i = 0; (c = fgetc(in)) != EOF; i++) {
        if (i == offset && bit >= 0) c ^= 1 << bit;
        if (i >= offset && i < offset + zero_bytes) c = 0;
        fputc(c, out);
    }
    fclose(in);
    fclose(out);
}

// The checksums a sink took of the sections written in pieces are zlib's crc32 of each whole
// section as the file holds it, and the bytes are where the header says.
static void test_running_checksums(void) {
    char error[1024] = "", path[4096];
    check(write_checkpoint(3, error, sizeof(error)) == 0, "a checkpoint is written through a sink (%s)", error);
    checkpoint_path(path, sizeof(path), dir, 3, ".bin");
    Checkpoint ck;
    int opened = checkpoint_open(&ck, path, error, sizeof(error)) == 0;
    check(opened, "it opens (%s)", error);
    if (!opened) return;
    const CheckpointHeader h = ck.header;
    FILE *f = ck.file;
    int equal = 0, bytes_right = 1;
    unsigned long long at = 0;
    fseeko(f, CHECKPOINT_HEADER_BYTES, SEEK_SET);
    for (int section = 0; section < CHECKPOINT_SECTIONS; section++) {
        size_t n = checkpoint_section_bytes(&h, section);
        unsigned char *bytes = (unsigned char *)malloc(n + 1);
        size_t got = fread(bytes, 1, n, f);
        for (size_t i = 0; i < got; i++) bytes_right &= bytes[i] == section_byte(at + i);
        uint32_t whole = (uint32_t)crc32(crc32(0L, Z_NULL, 0), bytes, (uInt)got);
        equal += got == n && whole == h.crc[section];
        printf("%s section: %zu bytes, crc32 %08x, the header says %08x\n", checkpoint_section_names[section], got,
               (unsigned)whole, (unsigned)h.crc[section]);
        at += n;
        free(bytes);
    }
    checkpoint_close(&ck);
    check(equal == CHECKPOINT_SECTIONS && bytes_right, "each section's running checksum is crc32 of the whole section (%d of %d), "
          "its bytes as written", equal, CHECKPOINT_SECTIONS);
}

// Every section: a flipped bit at its start, middle and end, and a zero-filled stretch, are
// refused naming it; the header's fields likewise (its own checksum).
static void test_checksums(void) {
    char error[1024] = "", path[4096], bad[4200];
    check(write_checkpoint(7, error, sizeof(error)) == 0, "a checkpoint is written (%s)", error);
    checkpoint_path(path, sizeof(path), dir, 7, ".bin");
    check(open_and_verify(path, error, sizeof(error)) == 0, "the written checkpoint passes its checksums (%s)", error);
    snprintf(bad, sizeof(bad), "%s/bad.bin", dir);
    CheckpointHeader h = tiny_header(7);
    long start = CHECKPOINT_HEADER_BYTES;
    int caught = 0, tried = 0;
    for (int section = 0; section < CHECKPOINT_SECTIONS; section++) {
        long bytes = (long)checkpoint_section_bytes(&h, section);
        long offsets[3] = {start, start + bytes / 2, start + bytes - 1};
        for (int i = 0; i < 3; i++) {
            copy_with_change(path, bad, offsets[i], i * 3, 0);
            tried++;
            caught += open_and_verify(bad, error, sizeof(error)) != 0 && strstr(error, checkpoint_section_names[section]) &&
                      strstr(error, "fails its checksum");
        }
        copy_with_change(path, bad, start, -1, bytes < 64 ? bytes : 64);
        check(open_and_verify(bad, error, sizeof(error)) != 0 && strstr(error, checkpoint_section_names[section]),
              "a zero-filled stretch of the %s is refused naming it (%s)", checkpoint_section_names[section], error);
        start += bytes;
    }
    check(caught == tried, "a flipped bit at the start, middle and end of every section is refused naming it: %d of %d", caught,
          tried);
    int header_caught = 0;
    for (int field = 0; field < CK_CRC_HEADER + 1; field++) {
        copy_with_change(path, bad, 8 + 8 * field + field % 8, field % 8, 0);
        header_caught += open_and_verify(bad, error, sizeof(error)) != 0;
    }
    check(header_caught == CK_CRC_HEADER + 1, "a flipped bit in any of the %d header fields in use is refused: %d", CK_CRC_HEADER + 1,
          header_caught);
    copy_with_change(path, bad, 8 + 8 * CK_STEP, 0, 0);
    check(open_and_verify(bad, error, sizeof(error)) != 0 && strstr(error, "the header fails its checksum"),
          "a flipped bit in the header's step is named a header checksum failure (%s)", error);
}

// A version-1 header (no checksums) whose dim does not fit an int is refused, not cut to 128.
static void test_int_fields(void) {
    char header[CHECKPOINT_HEADER_BYTES], error[256];
    CheckpointHeader h = tiny_header(0), got;
    checkpoint_encode_header(&h, header);
    int64_t version = CHECKPOINT_VERSION_UNCHECKED, dim = ((int64_t)1 << 32) + 128, has = 2;
    memcpy(header + 8 + 8 * CK_VERSION, &version, 8);
    memcpy(header + 8 + 8 * CK_SHAPE_dim, &dim, 8);
    check(checkpoint_decode_header(header, &got, error, sizeof(error)) != 0 && strstr(error, "dim 4294967424 is outside"),
          "dim 2^32 + 128 is refused, not read as 128 (%s)", error);
    memcpy(header + 8 + 8 * CK_SHAPE_dim, &(int64_t){128}, 8);
    memcpy(header + 8 + 8 * CK_HAS_OPTIMIZER, &has, 8);
    check(checkpoint_decode_header(header, &got, error, sizeof(error)) != 0 && strstr(error, "has_optimizer_state 2"),
          "has_optimizer_state 2 is refused (%s)", error);
}

// Runs `body` in a child whose files may not grow past `limit_bytes` (writes past it fail with
// EFBIG, as on a full disk); returns its exit status and leaves its stderr in `err`.
static int run_limited(void (*body)(void), long limit_bytes, char *err, size_t size) {
    int pipe_fds[2];
    if (pipe(pipe_fds) != 0) return -1;
    pid_t pid = fork();
    if (pid == 0) {
        dup2(pipe_fds[1], 2);
        close(pipe_fds[0]);
        signal(SIGXFSZ, SIG_IGN);
        struct rlimit limit = {(rlim_t)limit_bytes, (rlim_t)limit_bytes};
        setrlimit(RLIMIT_FSIZE, &limit);
        body();
        exit(0);
    }
    close(pipe_fds[1]);
    ssize_t n = read(pipe_fds[0], err, size - 1);
    err[n > 0 ? n : 0] = '\0';
    close(pipe_fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

static void write_checkpoint_or_report(void) {
    char error[1024];
    if (write_checkpoint(9, error, sizeof(error)) == 0) exit(0);
    fprintf(stderr, "%s\n", error);
    exit(1);
}

static void write_log_records(void) {
    RunLog log;
    char error[256];
    double elapsed;
    if (run_log_open(&log, dir, 0, 0, &elapsed, error, sizeof(error)) != 0) { fprintf(stderr, "%s\n", error); exit(3); }
    for (int step = 1; step <= 100; step++) run_log_train(&log, step, 2.5f, 1e-3f, 0.5f, 10.0, step * 1000, 1e5, 0.4, 1.0, step, 100 - step);
    run_log_close(&log);
}

// A checkpoint or log write past a size limit: the unfinished file is removed and the error
// names it with strerror's reason; a log write failure ends the process.
static void test_write_failures(void) {
    char err[2048], tmp[4096], done[4096];
    checkpoint_path(tmp, sizeof(tmp), dir, 9, ".bin.tmp");
    checkpoint_path(done, sizeof(done), dir, 9, ".done");
    int status = run_limited(write_checkpoint_or_report, 4096, err, sizeof(err));
    check(status == 1 && strstr(err, tmp) && strstr(err, "File too large"),
          "a checkpoint write that fails names the file and the reason (exit %d: %s)", status, err);
    check(access(tmp, F_OK) != 0 && access(done, F_OK) != 0, "the unfinished %s is removed, no marker written", tmp);
    char log_path[4096];
    snprintf(log_path, sizeof(log_path), "%s/log.jsonl", dir);
    status = run_limited(write_log_records, 2048, err, sizeof(err));
    check(status == 1 && strstr(err, log_path) && strstr(err, "write failed: File too large"),
          "a log write that fails ends the run naming the file and the reason (exit %d: %s)", status, err);
    double elapsed = -1.0;
    char error[256];
    RunLog log;
    remove(log_path);
    if (run_log_open(&log, dir, 0, 0, &elapsed, error, sizeof(error)) == 0) {
        for (int step = 1; step <= 3; step++) run_log_train(&log, step, 2.5f, 1e-3f, 0.5f, 10.0, step, 1e5, 0.4, 1.0, 10.0 * step, 0);
        run_log_close(&log);
    }
    int opened = run_log_open(&log, dir, 2, 1, &elapsed, error, sizeof(error)) == 0;
    check(opened && elapsed == 20.0, "a resumed log's clock goes on from the last kept record's elapsed_s (%g)", elapsed);
    run_log_close(&log);
}

// What killed runs leave (ckpt_*.bin.tmp, log.jsonl.tmp) is removed; other files are not.
static void test_temporaries(void) {
    char path[4096], error[256];
    const char *names[4] = {"ckpt_00000004.bin.tmp", "log.jsonl.tmp", "notes.tmp", "ckpt_00000004.bin"};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        fclose(fopen(path, "w"));
    }
    int removed = run_dir_remove_temporaries(dir, error, sizeof(error));
    int kept = 0;
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof(path), "%s/%s", dir, names[i]);
        kept += access(path, F_OK) == 0;
    }
    check(removed == 2 && kept == 2, "the 2 stale temporaries are removed, notes.tmp and the checkpoint kept (%d removed, %d kept)",
          removed, kept);
}

// ---- per-rank checkpoints ------------------------------------------------------------------
// A made-up state of tiny.conf's model with FP8+DRE optimizer states, written as rank 0 writes
// the single file and as the ranks of ZeRO plans write part files: array a's byte x is
// state_byte(a, x) wherever it goes.

typedef struct {
    ParamLayout layout;
    CheckpointHeader header;
    size_t group_bytes[CHECKPOINT_ARRAYS];
    unsigned char optimizer_header[56], trainer_state[72];
} MadeUpState;

static unsigned char state_byte(int a, unsigned long long x) {
    return (unsigned char)(((x + 977ull * (unsigned long long)a) * 2654435761ull) >> 11);
}

static void made_up_state(MadeUpState *s, long long step) {
    memset(s, 0, sizeof(*s));
    CheckpointHeader tiny = tiny_header(step);
    param_layout_init(&s->layout, &tiny.shape);
    s->header = tiny;
    s->header.total_padded = s->layout.total_padded;
    s->header.optimizer_state_bytes = sizeof(s->optimizer_header);
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++) {
        s->group_bytes[a] = adamw_section_group_bytes(OPT_STATES_FP8_DRE, a);
        if (a > 0) s->header.optimizer_state_bytes += s->layout.total_padded / 128 * s->group_bytes[a];
    }
    s->header.trainer_state_bytes = sizeof(s->trainer_state);
    for (size_t i = 0; i < sizeof(s->optimizer_header); i++) s->optimizer_header[i] = (unsigned char)(i * 37 + 1);
    for (size_t i = 0; i < sizeof(s->trainer_state); i++) s->trainer_state[i] = (unsigned char)(i * 91 + 7);
}

static unsigned long long made_up_array_bytes(const MadeUpState *s, int a) {
    return (unsigned long long)(s->layout.total_padded / 128) * s->group_bytes[a];
}

// Array a's bytes [from, to) through the sink, in pieces of up to 3000 bytes (no group's multiple).
static void write_array_bytes(CheckpointSink *sink, int a, unsigned long long from, unsigned long long to) {
    unsigned char piece[3000];
    while (from < to) {
        size_t n = to - from < sizeof(piece) ? (size_t)(to - from) : sizeof(piece);
        for (size_t i = 0; i < n; i++) piece[i] = state_byte(a, from + i);
        checkpoint_sink_write(sink, piece, n);
        from += n;
    }
}

// FOLDER/ckpt_<step>.bin as rank 0 writes it. Returns the commit's status.
static int write_single(const char *folder, const MadeUpState *s, char *error, size_t size) {
    CheckpointHeader h = s->header;
    CheckpointSink sink;
    if (checkpoint_begin(folder, &h, &sink, error, size) != 0) return -1;
    write_array_bytes(&sink, 0, 0, made_up_array_bytes(s, 0));
    h.crc[0] = checkpoint_sink_section(&sink);
    checkpoint_sink_write(&sink, s->optimizer_header, sizeof(s->optimizer_header));
    for (int a = 1; a < CHECKPOINT_ARRAYS; a++) write_array_bytes(&sink, a, 0, made_up_array_bytes(s, a));
    h.crc[1] = checkpoint_sink_section(&sink);
    checkpoint_sink_write(&sink, s->trainer_state, sizeof(s->trainer_state));
    h.crc[2] = checkpoint_sink_section(&sink);
    return checkpoint_commit(&sink, folder, &h, error, size);
}

// Rank r's non-empty parts of the plan's buckets, in order (the optimizer's adamw_part_ranges).
static int plan_ranges(const ZeroPlan *plan, int r, CheckpointRange *out) {
    int count = 0;
    for (int b = 0; b < plan->buckets; b++) {
        size_t begin, end;
        param_shard_part(&plan->bucket[b], r, &begin, &end);
        if (end > begin) out[count].begin = begin, out[count].end = end, count++;
    }
    return count;
}

// The manifest of the state's parts under `plan` (its ranges, sizes; the checksums 0), in `m`.
static void made_up_manifest(const MadeUpState *s, const ZeroPlan *plan, CheckpointManifest *m) {
    memset(m, 0, sizeof(*m));
    m->header = s->header;
    memcpy(m->group_bytes, s->group_bytes, sizeof(m->group_bytes));
    m->optimizer_header_bytes = sizeof(s->optimizer_header);
    m->optimizer_header = (unsigned char *)malloc(sizeof(s->optimizer_header));
    m->trainer_state = (unsigned char *)malloc(sizeof(s->trainer_state));
    memcpy(m->optimizer_header, s->optimizer_header, sizeof(s->optimizer_header));
    memcpy(m->trainer_state, s->trainer_state, sizeof(s->trainer_state));
    m->parts = plan->shards;
    m->part = (CheckpointPart *)calloc((size_t)m->parts, sizeof(CheckpointPart));
    for (int r = 0; r < m->parts; r++) {
        CheckpointPart *part = &m->part[r];
        part->ranges = (CheckpointRange *)malloc((size_t)plan->buckets * sizeof(CheckpointRange));
        part->range_count = plan_ranges(plan, r, part->ranges);
        part->file_bytes = checkpoint_part_file_bytes(part->ranges, part->range_count, s->group_bytes);
    }
}

// Part file r of the manifest, through the sink as the trainer writes it; its CRC-32 into m.
static int write_part(const char *folder, const MadeUpState *s, CheckpointManifest *m, int r, char *error, size_t size) {
    CheckpointPart *part = &m->part[r];
    CheckpointSink sink;
    if (checkpoint_part_begin(folder, s->header.step, r, m->parts, &sink, error, size) != 0) return -1;
    for (int a = 0; a < CHECKPOINT_ARRAYS; a++)
        for (int i = 0; i < part->range_count; i++)
            write_array_bytes(&sink, a, part->ranges[i].begin / 128 * s->group_bytes[a], part->ranges[i].end / 128 * s->group_bytes[a]);
    return checkpoint_part_commit(&sink, folder, s->header.step, r, part->file_bytes, &part->crc, error, size);
}

// A per-rank checkpoint in FOLDER as the plan's ranks write it: each part file, then the
// manifest and its marker. Returns 0, or -1 with `error`.
static int write_parts(const char *folder, const MadeUpState *s, const ZeroPlan *plan, char *error, size_t size) {
    CheckpointManifest m;
    made_up_manifest(s, plan, &m);
    int status = 0;
    for (int r = 0; r < m.parts && status == 0; r++) status = write_part(folder, s, &m, r, error, size);
    if (status == 0) status = checkpoint_manifest_commit(folder, &m, error, size);
    checkpoint_manifest_free(&m);
    return status;
}

static void make_folder(char *out, size_t size, const char *name) {
    snprintf(out, size, "%s/%s", dir, name);
    if (mkdir(out, 0755) != 0 && errno != EEXIST) { fprintf(stderr, "error: %s: cannot create: %s\n", out, strerror(errno)); exit(1); }
}

static unsigned char *read_whole(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f || fseeko(f, 0, SEEK_END) != 0) { fprintf(stderr, "error: %s: cannot read\n", path); exit(1); }
    *n = (size_t)ftello(f);
    unsigned char *bytes = (unsigned char *)malloc(*n + 1);
    rewind(f);
    if (fread(bytes, 1, *n, f) != *n) { fprintf(stderr, "error: %s: cannot read\n", path); exit(1); }
    fclose(f);
    return bytes;
}

// Bytes [offset, offset + n) of the checkpoint against the single file's; 1 when equal.
static int read_matches(Checkpoint *ck, const unsigned char *single, unsigned long long offset, size_t n, char *error, size_t size) {
    unsigned char *got = (unsigned char *)malloc(n + 1);
    int ok = checkpoint_read(ck, offset, got, n, error, size) == 0 && memcmp(got, single + offset, n) == 0;
    free(got);
    return ok;
}

// Every rank's parts under a plan of `ranks` ranks (bucket_min_elems `min`), each array's,
// read from the checkpoint: 1 when all are the single file's bytes; *bytes counts them.
static int plan_reads_match(Checkpoint *ck, const MadeUpState *s, const unsigned char *single, int ranks, size_t min,
                            unsigned long long *bytes, char *error, size_t size) {
    static ZeroPlan plan;
    zero_plan_init(&plan, &s->layout, ranks, 1, min);
    CheckpointRange ranges[PARAM_SEGMENTS_MAX];
    unsigned long long start[CHECKPOINT_ARRAYS] = {CHECKPOINT_HEADER_BYTES, 0, 0, 0, 0};
    start[1] = start[0] + made_up_array_bytes(s, 0) + sizeof(s->optimizer_header);
    for (int a = 2; a < CHECKPOINT_ARRAYS; a++) start[a] = start[a - 1] + made_up_array_bytes(s, a - 1);
    int ok = 1;
    for (int r = 0; r < ranks; r++) {
        int count = plan_ranges(&plan, r, ranges);
        for (int a = 0; a < CHECKPOINT_ARRAYS; a++)
            for (int i = 0; i < count; i++) {
                unsigned long long from = start[a] + ranges[i].begin / 128 * s->group_bytes[a];
                size_t n = (ranges[i].end - ranges[i].begin) / 128 * s->group_bytes[a];
                ok &= read_matches(ck, single, from, n, error, size);
                *bytes += n;
            }
    }
    return ok;
}

// The per-rank checkpoints of 3 ranks (a bucket per layer) and of 2 (the default buckets) read
// as the single file: the header's fields, random stretches anywhere past the header, and every
// rank's parts of every array under plans of 1 to 4 ranks and both bucketings.
static void test_parts_read_as_single(void) {
    char error[8192] = "", single_dir[4200], path[4300];
    MadeUpState s;
    made_up_state(&s, 20);
    make_folder(single_dir, sizeof(single_dir), "single");
    check(write_single(single_dir, &s, error, sizeof(error)) == 0, "the single file is written (%s)", error);
    checkpoint_path(path, sizeof(path), single_dir, 20, ".bin");
    size_t single_bytes;
    unsigned char *single = read_whole(path, &single_bytes);
    static ZeroPlan plan;
    struct { int ranks; size_t min; const char *folder; } forms[2] = {{3, 1, "parts3"}, {2, 33554432, "parts2"}};
    for (int f = 0; f < 2; f++) {
        char folder[4200], manifest[4300];
        make_folder(folder, sizeof(folder), forms[f].folder);
        zero_plan_init(&plan, &s.layout, forms[f].ranks, 1, forms[f].min);
        int written = write_parts(folder, &s, &plan, error, sizeof(error)) == 0;
        check(written, "%d ranks (%d buckets) write their part files and rank 0 the manifest (%s)", forms[f].ranks, plan.buckets, error);
        checkpoint_path(manifest, sizeof(manifest), folder, 20, ".bin");
        Checkpoint ck;
        if (!written || checkpoint_open(&ck, manifest, error, sizeof(error)) != 0) {
            check(0, "the per-rank checkpoint opens (%s)", error);
            continue;
        }
        const CheckpointHeader *h = &ck.header;
        check(!ck.file && ck.manifest.parts == forms[f].ranks && h->step == 20 && h->total_padded == s.header.total_padded &&
                  h->optimizer_state_bytes == s.header.optimizer_state_bytes && checkpoint_file_bytes(h) == single_bytes,
              "it opens as the single file: step %lld, %zu elements, %zu optimizer bytes, %llu bytes in all", h->step,
              h->total_padded, h->optimizer_state_bytes, checkpoint_file_bytes(h));
        srand(7);
        int random_ok = 1;
        for (int i = 0; i < 3000; i++) {
            unsigned long long offset = CHECKPOINT_HEADER_BYTES + (unsigned long long)rand() * rand() % (single_bytes - CHECKPOINT_HEADER_BYTES);
            size_t n = (size_t)(rand() % 5000) + 1;
            if (n > single_bytes - offset) n = (size_t)(single_bytes - offset);
            random_ok &= read_matches(&ck, single, offset, n, error, sizeof(error));
        }
        check(random_ok, "3000 stretches of 1 to 5000 bytes anywhere past the header read as the single file's (%s)", error);
        unsigned long long bytes = 0;
        int plans_ok = 1;
        for (int ranks = 1; ranks <= 4; ranks++)
            for (int m = 0; m < 2; m++) plans_ok &= plan_reads_match(&ck, &s, single, ranks, m ? 33554432 : 1, &bytes, error, sizeof(error));
        check(plans_ok, "every rank's parts of every array under 1 to 4 ranks, a bucket per layer or merged, read as the single "
              "file's: %llu bytes (%s)", bytes, error);
        int verified = 1;
        for (int r = 0; r < forms[f].ranks; r++) verified &= checkpoint_verify(&ck, r, forms[f].ranks, error, sizeof(error)) == 0;
        check(verified && checkpoint_verify(&ck, 0, 1, error, sizeof(error)) == 0,
              "its part files pass their checksums, checked by one rank or shared by %d (%s)", forms[f].ranks, error);
        checkpoint_close(&ck);
    }
    free(single);
}

// Encodes `m` (its checksum right) and decodes it: 1 when refused with `expect` in the error.
static int manifest_refused(const CheckpointManifest *m, const char *expect, char *error, size_t size) {
    error[0] = '\0';
    size_t n;
    unsigned char *bytes = checkpoint_manifest_encode(m, &n);
    CheckpointManifest got;
    int status = checkpoint_manifest_decode(bytes, n, &got, error, size);
    if (status == 0) checkpoint_manifest_free(&got);
    free(bytes);
    return status != 0 && strstr(error, expect) != NULL;
}

// Decodes bytes[n] (the last 8 rewritten as the CRC-32 of the rest when `fix_crc`): 1 when
// refused with `expect` in the error.
static int bytes_refused(unsigned char *bytes, size_t n, int fix_crc, const char *expect, char *error, size_t size) {
    error[0] = '\0';
    if (fix_crc) {
        uint64_t crc = (uint32_t)crc32(crc32(0L, Z_NULL, 0), bytes, (uInt)(n - 8));
        memcpy(bytes + n - 8, &crc, 8);
    }
    CheckpointManifest got;
    int status = checkpoint_manifest_decode(bytes, n, &got, error, size);
    if (status == 0) checkpoint_manifest_free(&got);
    return status != 0 && strstr(error, expect) != NULL;
}

// A manifest decodes and encodes back to its bytes; every inconsistency a crafted one could hold
// with its checksum right is refused naming it, and so are a flipped bit, a cut, another magic
// and another version.
static void test_manifest_refusals(void) {
    char error[1024] = "";
    MadeUpState s;
    made_up_state(&s, 20);
    static ZeroPlan plan;
    zero_plan_init(&plan, &s.layout, 3, 1, 1);
    CheckpointManifest m, got;
    made_up_manifest(&s, &plan, &m);
    for (int r = 0; r < m.parts; r++) m.part[r].crc = 0xC0DE0000u + (uint32_t)r;
    size_t n, again_n = 0;
    unsigned char *bytes = checkpoint_manifest_encode(&m, &n), *again = NULL;
    int decoded = checkpoint_manifest_decode(bytes, n, &got, error, sizeof(error)) == 0;
    if (decoded) again = checkpoint_manifest_encode(&got, &again_n);
    check(decoded && again_n == n && memcmp(again, bytes, n) == 0 && got.parts == 3 && got.part[2].crc == 0xC0DE0002u &&
              got.part[1].range_count == m.part[1].range_count && got.header.step == 20 && got.group_bytes[3] == 12,
          "a manifest of 3 parts (%d, %d and %d ranges) decodes and encodes back to its %zu bytes (%s)", m.part[0].range_count,
          m.part[1].range_count, m.part[2].range_count, n, error);
    if (decoded) checkpoint_manifest_free(&got);
    free(again);

    CheckpointRange *r1 = &m.part[1].ranges[0];
    r1->begin += 128;
    check(manifest_refused(&m, "the parts' ranges leave out elements", error, sizeof(error)), "a gap between parts is refused (%s)", error);
    r1->begin -= 256;
    check(manifest_refused(&m, "the parts' ranges hold twice elements", error, sizeof(error)), "an overlap is refused (%s)", error);
    r1->begin += 128;
    r1->end += 64;
    check(manifest_refused(&m, "is not a non-empty multiple of 128 elements", error, sizeof(error)), "a range cut inside a group is "
          "refused (%s)", error);
    r1->end -= 64;
    m.part[0].file_bytes++;
    check(manifest_refused(&m, "part 0 is said to be", error, sizeof(error)), "a part size that its ranges do not make is refused "
          "(%s)", error);
    m.part[0].file_bytes--;
    m.group_bytes[0] = 256;
    check(manifest_refused(&m, "the weights are FP32 groups of 128", error, sizeof(error)), "weights that are no FP32 groups are "
          "refused (%s)", error);
    m.group_bytes[0] = 512;
    m.header.optimizer_state_bytes += 8;
    check(manifest_refused(&m, "its optimizer state adds up to", error, sizeof(error)), "arrays that do not add up to the "
          "optimizer state are refused (%s)", error);
    m.header.optimizer_state_bytes -= 8;
    check(!manifest_refused(&m, "", error, sizeof(error)), "the manifest put back is accepted again (%s)", error);

    unsigned char *copy = (unsigned char *)malloc(n);
    size_t part0 = 8 + 8 + CHECKPOINT_HEADER_BYTES + 8 + 8 * CHECKPOINT_ARRAYS + 8 + sizeof(s.optimizer_header) + sizeof(s.trainer_state);
    memcpy(copy, bytes, n);
    copy[part0 + 16]++;  // part 0's range count
    check(bytes_refused(copy, n, 1, "corrupt manifest", error, sizeof(error)), "a range count past the ranges there is refused (%s)", error);
    memcpy(copy, bytes, n);
    copy[part0 + 30] ^= 4;
    check(bytes_refused(copy, n, 0, "the manifest fails its checksum", error, sizeof(error)), "a flipped bit is refused (%s)", error);
    memcpy(copy, bytes, n);
    check(bytes_refused(copy, n - 16, 0, "the manifest fails its checksum", error, sizeof(error)) &&
              bytes_refused(copy, 100, 0, "truncated manifest", error, sizeof(error)), "a cut manifest is refused (%s)", error);
    copy[8] = 2;
    check(bytes_refused(copy, n, 1, "manifest version 2, this build reads 1", error, sizeof(error)), "another version is refused (%s)", error);
    memcpy(copy, CHECKPOINT_PART_MAGIC, 8);
    check(bytes_refused(copy, n, 1, "bad magic", error, sizeof(error)), "another magic is refused (%s)", error);
    free(copy);
    free(bytes);
    checkpoint_manifest_free(&m);
}

// The error of opening the per-rank checkpoint FOLDER/ckpt_00000020.bin, and of checking part
// `part` with the work shared by `world` ranks when it opens; 1 when it names `file` and says `expect`.
static int parts_refused(const char *folder, int rank, int world, const char *file, const char *expect, char *error, size_t size) {
    error[0] = '\0';
    char manifest[4300];
    Checkpoint ck;
    checkpoint_path(manifest, sizeof(manifest), folder, 20, ".bin");
    int status = checkpoint_open(&ck, manifest, error, size);
    if (status == 0) {
        status = checkpoint_verify(&ck, rank, world, error, size);
        checkpoint_close(&ck);
    }
    return status != 0 && strstr(error, file) && strstr(error, expect);
}

// A missing, truncated, damaged or misplaced part file, and a damaged manifest, are refused in
// one line naming the file, what is wrong and the checkpoint it belongs to. Shared among ranks,
// the checksum of a part is checked by its own rank.
static void test_part_refusals(void) {
    char error[8192] = "", folder[4200], manifest[4300], part[4400], backup[4400];
    snprintf(folder, sizeof(folder), "%s/parts3", dir);
    checkpoint_path(manifest, sizeof(manifest), folder, 20, ".bin");
    snprintf(backup, sizeof(backup), "%s/backup.bin", dir);
    char context[4400];
    snprintf(context, sizeof(context), "(part 1 of 3 of %s)", manifest);

    checkpoint_part_path(part, sizeof(part), manifest, 1);
    rename(part, backup);
    check(parts_refused(folder, 0, 1, part, "missing (part 1 of 3 of", error, sizeof(error)) && strstr(error, context),
          "a missing part file is refused naming it and its checkpoint (%s)", error);
    rename(backup, part);

    checkpoint_part_path(part, sizeof(part), manifest, 2);
    copy_with_change(part, backup, -1, -1, 0);
    struct stat st;
    stat(part, &st);
    if (truncate(part, st.st_size - 1) != 0) perror("truncate");
    check(parts_refused(folder, 0, 1, part, "bytes, the manifest says", error, sizeof(error)) && strstr(error, "truncated or damaged"),
          "a part file one byte short is refused naming it (%s)", error);
    rename(backup, part);

    copy_with_change(part, backup, -1, -1, 0);
    copy_with_change(backup, part, 16, 0, 0);  // the step in its header
    check(parts_refused(folder, 0, 1, part, "holds part 2 of 3 of step 21, the manifest expects part 2 of 3 of step 20", error, sizeof(error)),
          "a part file of another checkpoint is refused naming it (%s)", error);
    rename(backup, part);

    checkpoint_part_path(part, sizeof(part), manifest, 0);
    stat(part, &st);
    copy_with_change(part, backup, -1, -1, 0);
    copy_with_change(backup, part, (long)(st.st_size / 2), 3, 0);
    int refused = parts_refused(folder, 0, 1, part, "fails its checksum", error, sizeof(error)) && strstr(error, "the file is damaged");
    check(refused, "a flipped bit in a part file is refused naming it (%s)", error);
    check(parts_refused(folder, 0, 3, part, "fails its checksum", error, sizeof(error)) &&
              !parts_refused(folder, 1, 3, part, "fails its checksum", error, sizeof(error)),
          "shared among 3 ranks, rank 0 checks part 0 and finds it damaged, rank 1 does not read it");
    rename(backup, part);

    copy_with_change(manifest, backup, -1, -1, 0);
    copy_with_change(backup, manifest, 600, 5, 0);
    check(parts_refused(folder, 0, 1, manifest, "the manifest fails its checksum", error, sizeof(error)),
          "a flipped bit in the manifest is refused naming it (%s)", error);
    rename(backup, manifest);
    check(!parts_refused(folder, 0, 1, "", "", error, sizeof(error)), "the files put back are accepted again (%s)", error);
}

static int count_files(const char *folder) {
    DIR *d = opendir(folder);
    int count = 0;
    struct dirent *entry;
    while (d && (entry = readdir(d)) != NULL) count += entry->d_name[0] != '.';
    if (d) closedir(d);
    return count;
}

// What a killed per-rank write leaves (a part file whose step has neither manifest nor marker, a
// part's .tmp) is removed at start, finished checkpoints' parts are kept, and one whose manifest
// was written but not its marker too; the newest is found by its marker; pruning removes a
// checkpoint's part files with it.
static void test_parts_in_run_dir(void) {
    char error[8192] = "", folder[4200], path[4300];
    make_folder(folder, sizeof(folder), "run");
    static ZeroPlan plan;
    MadeUpState s;
    int written = 1;
    long long steps[3] = {10, 30, 40};
    for (int i = 0; i < 3; i++) {
        made_up_state(&s, steps[i]);
        zero_plan_init(&plan, &s.layout, i == 1 ? 2 : 3, 1, 1);
        written &= write_parts(folder, &s, &plan, error, sizeof(error)) == 0;
    }
    checkpoint_path(path, sizeof(path), folder, 40, ".done");
    remove(path);  // step 40: its manifest written, not its marker
    made_up_state(&s, 20);
    zero_plan_init(&plan, &s.layout, 2, 1, 1);
    CheckpointManifest m;
    made_up_manifest(&s, &plan, &m);
    written &= write_part(folder, &s, &m, 0, error, sizeof(error)) == 0;  // step 20: killed before rank 1's part and the manifest
    checkpoint_manifest_free(&m);
    checkpoint_path(path, sizeof(path), folder, 20, ".rank1.bin.tmp");
    fclose(fopen(path, "w"));
    check(written && count_files(folder) == 5 + 4 + 4 + 2, "per-rank checkpoints of steps 10, 30, 40 and a killed one of step 20 are "
          "there (%d files; %s)", count_files(folder), error);
    int removed = run_dir_remove_temporaries(folder, error, sizeof(error));
    checkpoint_path(path, sizeof(path), folder, 40, ".rank2.bin");
    check(removed == 2 && count_files(folder) == 13 && access(path, F_OK) == 0,
          "the start removes step 20's part file and .tmp, nothing else (%d removed, %d files left)", removed, count_files(folder));
    check(checkpoint_find_newest(folder) == 30, "the newest checkpoint is step 30's, the newest with a marker (%lld)",
          checkpoint_find_newest(folder));
    checkpoint_prune(folder, 1);
    checkpoint_path(path, sizeof(path), folder, 30, ".rank1.bin");
    check(count_files(folder) == 4 + 4 && access(path, F_OK) == 0, "keeping 1 checkpoint removes step 10's manifest, marker and "
          "3 part files; step 30's and step 40's files stay (%d files)", count_files(folder));
}

static void write_parts_or_report(void) {
    char error[8192], folder[4200];
    MadeUpState s;
    static ZeroPlan plan;
    made_up_state(&s, 9);
    make_folder(folder, sizeof(folder), "limited");
    zero_plan_init(&plan, &s.layout, 3, 1, 1);
    if (write_parts(folder, &s, &plan, error, sizeof(error)) == 0) exit(0);
    fprintf(stderr, "%s\n", error);
    exit(1);
}

// A part file write past a size limit: its temporary file is removed, the error names it with
// the reason, and there is neither manifest nor marker.
static void test_part_write_failure(void) {
    char err[2048], folder[4200], tmp[4300], path[4300];
    snprintf(folder, sizeof(folder), "%s/limited", dir);
    checkpoint_path(tmp, sizeof(tmp), folder, 9, ".rank0.bin.tmp");
    int status = run_limited(write_parts_or_report, 100000, err, sizeof(err));
    check(status == 1 && strstr(err, tmp) && strstr(err, "File too large"),
          "a part file write that fails names the file and the reason (exit %d: %s)", status, err);
    checkpoint_path(path, sizeof(path), folder, 9, ".bin");
    check(access(tmp, F_OK) != 0 && count_files(folder) == 0, "its temporary file is removed, no manifest or marker written (%d files)",
          count_files(folder));
}

int main(void) {
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_running_checksums();
    test_checksums();
    test_int_fields();
    test_write_failures();
    test_temporaries();
    test_parts_read_as_single();
    test_manifest_refusals();
    test_part_refusals();
    test_parts_in_run_dir();
    test_part_write_failure();
    char command[4200];
    snprintf(command, sizeof(command), "rm -rf '%s'", dir);
    if (system(command) != 0) fprintf(stderr, "warning: %s: not removed\n", dir);
    return check_summary("test_checkpoint");
}
