// Checkpoint files: everything needed to continue a run bit-exactly. Little-endian layout:
//   "LLAMACK1", int64 fields[63] (CheckpointField), then FP32 master weights [total_padded]
//   (the layout of coat/params.h), the optimizer state and the trainer state (opaque blobs).
// Written atomically: DIR/ckpt_<step>.bin.tmp, fsync, rename, then DIR/ckpt_<step>.done; a
// checkpoint without its .done marker is ignored. scripts/convert_hf.py reads the same format.
#pragma once
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include "model_shape.h"

#define CHECKPOINT_MAGIC "LLAMACK1"
#define CHECKPOINT_VERSION 1
#define CHECKPOINT_FIELDS 63
#define CHECKPOINT_HEADER_BYTES (8 + 8 * CHECKPOINT_FIELDS)

typedef enum {
    CK_VERSION, CK_VOCAB, CK_DIM, CK_LAYERS, CK_HEADS, CK_KV_HEADS, CK_FFN, CK_MAX_SEQ,
    CK_ROPE_THETA, CK_NORM_EPS, CK_ROPE_SCALING, CK_ROPE_LOW, CK_ROPE_HIGH, CK_ROPE_ORIGINAL,
    CK_STEP, CK_TOTAL_PADDED, CK_HAS_OPTIMIZER, CK_OPTIMIZER_BYTES, CK_TRAINER_BYTES
} CheckpointField;

typedef struct {
    ModelShape shape;
    long long step;
    size_t total_padded;
    int has_optimizer_state;
    size_t optimizer_state_bytes;
    size_t trainer_state_bytes;
} CheckpointHeader;

static inline int64_t checkpoint_double_bits(double x) { int64_t bits; memcpy(&bits, &x, 8); return bits; }
static inline double checkpoint_bits_double(int64_t bits) { double x; memcpy(&x, &bits, 8); return x; }

static inline void checkpoint_encode_header(const CheckpointHeader *h, char out[CHECKPOINT_HEADER_BYTES]) {
    int64_t f[CHECKPOINT_FIELDS] = {0};
    const ModelShape *m = &h->shape;
    f[CK_VERSION] = CHECKPOINT_VERSION;
    f[CK_VOCAB] = m->vocab_size; f[CK_DIM] = m->dim; f[CK_LAYERS] = m->n_layers; f[CK_HEADS] = m->n_heads;
    f[CK_KV_HEADS] = m->n_kv_heads; f[CK_FFN] = m->ffn_dim; f[CK_MAX_SEQ] = m->max_seq_len;
    f[CK_ROPE_THETA] = checkpoint_double_bits(m->rope_theta);
    f[CK_NORM_EPS] = checkpoint_double_bits(m->norm_eps);
    f[CK_ROPE_SCALING] = checkpoint_double_bits(m->rope_scaling_factor);
    f[CK_ROPE_LOW] = checkpoint_double_bits(m->rope_low_freq_factor);
    f[CK_ROPE_HIGH] = checkpoint_double_bits(m->rope_high_freq_factor);
    f[CK_ROPE_ORIGINAL] = m->rope_original_max_seq_len;
    f[CK_STEP] = h->step; f[CK_TOTAL_PADDED] = (int64_t)h->total_padded;
    f[CK_HAS_OPTIMIZER] = h->has_optimizer_state;
    f[CK_OPTIMIZER_BYTES] = (int64_t)h->optimizer_state_bytes;
    f[CK_TRAINER_BYTES] = (int64_t)h->trainer_state_bytes;
    memcpy(out, CHECKPOINT_MAGIC, 8);
    memcpy(out + 8, f, sizeof(f));
}

// Returns 0, or -1 with "what is wrong" in error.
static inline int checkpoint_decode_header(const char in[CHECKPOINT_HEADER_BYTES], CheckpointHeader *h, char *error,
                                           size_t error_size) {
    int64_t f[CHECKPOINT_FIELDS];
    if (memcmp(in, CHECKPOINT_MAGIC, 8) != 0) { snprintf(error, error_size, "not a train_llama checkpoint (bad magic)"); return -1; }
    memcpy(f, in + 8, sizeof(f));
    if (f[CK_VERSION] != CHECKPOINT_VERSION) {
        snprintf(error, error_size, "checkpoint version %lld, expected %d", (long long)f[CK_VERSION], CHECKPOINT_VERSION);
        return -1;
    }
    ModelShape *m = &h->shape;
    m->vocab_size = (int)f[CK_VOCAB]; m->dim = (int)f[CK_DIM]; m->n_layers = (int)f[CK_LAYERS];
    m->n_heads = (int)f[CK_HEADS]; m->n_kv_heads = (int)f[CK_KV_HEADS]; m->ffn_dim = (int)f[CK_FFN];
    m->max_seq_len = (int)f[CK_MAX_SEQ];
    m->rope_theta = (float)checkpoint_bits_double(f[CK_ROPE_THETA]);
    m->norm_eps = (float)checkpoint_bits_double(f[CK_NORM_EPS]);
    m->rope_scaling_factor = (float)checkpoint_bits_double(f[CK_ROPE_SCALING]);
    m->rope_low_freq_factor = (float)checkpoint_bits_double(f[CK_ROPE_LOW]);
    m->rope_high_freq_factor = (float)checkpoint_bits_double(f[CK_ROPE_HIGH]);
    m->rope_original_max_seq_len = (int)f[CK_ROPE_ORIGINAL];
    h->step = f[CK_STEP];
    h->total_padded = (size_t)f[CK_TOTAL_PADDED];
    h->has_optimizer_state = (int)f[CK_HAS_OPTIMIZER];
    h->optimizer_state_bytes = (size_t)f[CK_OPTIMIZER_BYTES];
    h->trainer_state_bytes = (size_t)f[CK_TRAINER_BYTES];
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

// Starts DIR/ckpt_<step>.bin.tmp and writes the header; the caller writes the sections in order
// (master weights, optimizer state, trainer state) and then calls checkpoint_commit.
static inline FILE *checkpoint_begin(const char *dir, const CheckpointHeader *h, char *error, size_t error_size) {
    char tmp[4096], header[CHECKPOINT_HEADER_BYTES];
    checkpoint_path(tmp, sizeof(tmp), dir, h->step, ".bin.tmp");
    FILE *f = fopen(tmp, "wb");
    if (!f) { snprintf(error, error_size, "%s: cannot create: %s", tmp, strerror(errno)); return NULL; }
    checkpoint_encode_header(h, header);
    if (fwrite(header, 1, sizeof(header), f) != sizeof(header)) {
        snprintf(error, error_size, "%s: write failed: %s", tmp, strerror(errno));
        fclose(f);
        remove(tmp);
        return NULL;
    }
    return f;
}

// Flushes to disk, checks the size against the header, renames into place and marks it done.
static inline int checkpoint_commit(FILE *f, const char *dir, const CheckpointHeader *h, char *error, size_t error_size) {
    char tmp[4096], final_path[4096], done[4096];
    checkpoint_path(tmp, sizeof(tmp), dir, h->step, ".bin.tmp");
    checkpoint_path(final_path, sizeof(final_path), dir, h->step, ".bin");
    checkpoint_path(done, sizeof(done), dir, h->step, ".done");
    unsigned long long expected = CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded + h->optimizer_state_bytes + h->trainer_state_bytes;
    int ok = fflush(f) == 0 && (unsigned long long)ftello(f) == expected && fsync(fileno(f)) == 0;
    if (fclose(f) != 0) ok = 0;
    if (!ok) {
        snprintf(error, error_size, "%s: write failed or wrong size: %s", tmp, strerror(errno));
        remove(tmp);
        return -1;
    }
    if (rename(tmp, final_path) != 0) {
        snprintf(error, error_size, "%s: rename failed: %s", final_path, strerror(errno));
        return -1;
    }
    FILE *marker = fopen(done, "w");
    if (!marker || fclose(marker) != 0) { snprintf(error, error_size, "%s: cannot create the marker", done); return -1; }
    return 0;
}

// Opens a checkpoint and reads its header, checking that the file holds every section it announces.
static inline FILE *checkpoint_open(const char *path, CheckpointHeader *h, char *error, size_t error_size) {
    char header[CHECKPOINT_HEADER_BYTES], what[256];
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
    struct stat st;
    unsigned long long expected = CHECKPOINT_HEADER_BYTES + 4ull * h->total_padded + h->optimizer_state_bytes + h->trainer_state_bytes;
    if (fstat(fileno(f), &st) != 0 || (unsigned long long)st.st_size != expected) {
        snprintf(error, error_size, "%s: size %lld bytes, header announces %llu (truncated or corrupt)", path,
                 (long long)st.st_size, expected);
        fclose(f);
        return NULL;
    }
    return f;
}
