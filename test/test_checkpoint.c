// Checkpoint files and the run log on the CPU (coat/checkpoint.h, coat/log.h): the checksums
// taken as the sections are written are zlib's of the sections as the file holds them; every section's
// checksum catches a flipped bit and a zero-filled stretch, naming the section; header fields
// that an int cannot hold are refused; a write that fails (a full disk, here a file size limit)
// removes the unfinished file and names it with the reason; stale temporaries are removed; a log
// write that fails ends the run naming the file.
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>
#include "../coat/checkpoint.h"
#include "../coat/log.h"
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
    CheckpointHeader h;
    FILE *f = checkpoint_open(path, &h, error, size);
    if (!f) return -1;
    int status = checkpoint_verify(f, path, &h, error, size);
    fclose(f);
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
    CheckpointHeader h;
    FILE *f = checkpoint_open(path, &h, error, sizeof(error));
    check(f != NULL, "it opens (%s)", error);
    if (!f) return;
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
    fclose(f);
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

int main(void) {
    if (!mkdtemp(dir)) { perror("mkdtemp"); return 1; }
    test_running_checksums();
    test_checksums();
    test_int_fields();
    test_write_failures();
    test_temporaries();
    char command[4200];
    snprintf(command, sizeof(command), "rm -rf '%s'", dir);
    if (system(command) != 0) fprintf(stderr, "warning: %s: not removed\n", dir);
    return check_summary("test_checkpoint");
}
