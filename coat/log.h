// The run's machine-readable log: out_dir/log.jsonl, one JSON object per line, training
// records {"step", "train_loss", "lr", "grad_norm", "ms", "tokens", "tokens_per_s", "mfu",
// "gpu_mem_gib", "elapsed_s", "remaining_s"} ("tokens": seen since step 0; "elapsed_s": training
// time since step 0, over every resume; "remaining_s": the estimate to max_steps at this run's
// pace) and validation records {"step", "val_loss"}. A resumed run first drops the records past
// the step it resumes from, so the log reads as one uninterrupted run. A log that was never
// opened (file NULL: every rank but 0 of a multi-process run) takes records and drops them.
// Every write is checked and flushed: a full disk or a write error ends the run (exit 1) with one
// line naming the file and the reason, rather than a log that silently stops.
// The trainer's plumbing, not model code.
#pragma once
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { FILE *file; char path[4096]; } RunLog;

// Ends the run when a write to `path` failed (ok == 0); errno holds the reason.
static inline void run_log_check(const char *path, int ok) {
    if (ok) return;
    fprintf(stderr, "error: %s: write failed: %s\n", path, strerror(errno ? errno : EIO));
    exit(EXIT_FAILURE);
}

// Keeps the lines whose "step" is at most keep_through_step (all of them when it is negative:
// nothing to drop), then opens for appending; *elapsed_s is the last kept "elapsed_s" (0 for
// none), where the resumed run's clock goes on. Returns 0, or -1 with a message.
static inline int run_log_open(RunLog *log, const char *out_dir, long long keep_through_step, int resume, double *elapsed_s,
                               char *error, size_t error_size) {
    snprintf(log->path, sizeof(log->path), "%s/log.jsonl", out_dir);
    *elapsed_s = 0.0;
    if (resume) {
        char tmp_path[4200];
        snprintf(tmp_path, sizeof(tmp_path), "%s.tmp", log->path);
        FILE *in = fopen(log->path, "r");
        if (in) {
            FILE *out = fopen(tmp_path, "w");
            if (!out) { fclose(in); snprintf(error, error_size, "%s: cannot create: %s", tmp_path, strerror(errno)); return -1; }
            char line[4096];
            int ok = 1;
            while (ok && fgets(line, sizeof(line), in)) {
                const char *field = strstr(line, "\"step\":");
                if (!field || !strchr(line, '\n') || atoll(field + 7) > keep_through_step) continue;
                ok = fputs(line, out) != EOF;
                const char *elapsed = strstr(line, "\"elapsed_s\":");
                if (elapsed) *elapsed_s = atof(elapsed + 12);
            }
            ok = ok && !ferror(in);
            fclose(in);
            if (fclose(out) != 0) ok = 0;
            if (!ok || rename(tmp_path, log->path) != 0) {
                snprintf(error, error_size, "%s: cannot rewrite for resume: %s", log->path, strerror(errno ? errno : EIO));
                remove(tmp_path);
                return -1;
            }
        }
    }
    log->file = fopen(log->path, resume ? "a" : "w");
    if (!log->file) { snprintf(error, error_size, "%s: cannot open: %s", log->path, strerror(errno)); return -1; }
    return 0;
}

static inline void run_log_train(RunLog *log, long long step, float loss, float lr, float grad_norm, double ms,
                                 long long tokens, double tokens_per_s, double mfu, double gpu_mem_gib, double elapsed_s,
                                 double remaining_s) {
    if (!log->file) return;
    int written = fprintf(log->file,
                          "{\"step\": %lld, \"train_loss\": %.6f, \"lr\": %.6g, \"grad_norm\": %.6f, \"ms\": %.3f, \"tokens\": %lld, "
                          "\"tokens_per_s\": %.1f, \"mfu\": %.4f, \"gpu_mem_gib\": %.3f, \"elapsed_s\": %.1f, \"remaining_s\": %.1f}\n",
                          step, loss, lr, grad_norm, ms, tokens, tokens_per_s, mfu, gpu_mem_gib, elapsed_s, remaining_s);
    run_log_check(log->path, written >= 0 && fflush(log->file) == 0);
}

// A step whose loss or gradient norm was not finite: the optimizer skipped it.
static inline void run_log_skipped(RunLog *log, long long step, float loss, float grad_norm) {
    if (!log->file) return;
    int written = fprintf(log->file, "{\"step\": %lld, \"skipped\": \"non-finite\", \"loss\": \"%g\", \"grad_norm\": \"%g\"}\n",
                          step, loss, grad_norm);
    run_log_check(log->path, written >= 0 && fflush(log->file) == 0);
}

static inline void run_log_val(RunLog *log, long long step, float val_loss) {
    if (!log->file) return;
    int written = fprintf(log->file, "{\"step\": %lld, \"val_loss\": %.6f}\n", step, val_loss);
    run_log_check(log->path, written >= 0 && fflush(log->file) == 0);
}

static inline void run_log_close(RunLog *log) {
    if (log->file) run_log_check(log->path, fclose(log->file) == 0);
    log->file = NULL;
}
