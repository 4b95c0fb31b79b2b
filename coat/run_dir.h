// The run's folder (out_dir): the names of the files a run keeps there, how a checkpoint reaches it
// whole, and the clearing up around runs.
//   DIR/ckpt_<step>.bin            a checkpoint (coat/checkpoint_file.h), or the manifest of one
//                                  written per rank (coat/checkpoint_parts.h)
//   DIR/ckpt_<step>.rank<p>.bin    part p of a per-rank checkpoint
//   DIR/ckpt_<step>.done           the marker: a checkpoint without it is ignored
//   DIR/log.jsonl                  the run log (coat/log.h)
// A checkpoint's files are written as NAME.tmp, flushed to disk and renamed; the marker follows
// once the folder itself is flushed. Whatever an interrupted write leaves (a .tmp, the part files
// of a checkpoint with neither manifest nor marker) is removed when the next run starts; pruning
// keeps the newest checkpoints_keep; overwrite = 1 clears an earlier run's files.
// The trainer's plumbing, not model code: plain C, nothing of the files' contents.
#pragma once
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

// ---- names ------------------------------------------------------------------------------

// DIR/ckpt_<step><suffix>: ".bin", ".bin.tmp", ".done".
static inline void checkpoint_path(char *out, size_t size, const char *dir, long long step, const char *suffix) {
    snprintf(out, size, "%s/ckpt_%08lld%s", dir, step, suffix);
}

// DIR/ckpt_<step>.rank<part>.bin of the manifest DIR/ckpt_<step>.bin (its name without .bin).
static inline void checkpoint_part_path(char *out, size_t size, const char *manifest_path, int part) {
    size_t length = strlen(manifest_path);
    if (length >= 4 && strcmp(manifest_path + length - 4, ".bin") == 0) length -= 4;
    snprintf(out, size, "%.*s.rank%d.bin", (int)length, manifest_path, part);
}

// The step of a part file's name, ckpt_<step>.rank<p>.bin; -1 for any other name.
static inline long long checkpoint_part_name_step(const char *name) {
    long long step;
    int part, length = -1;
    if (sscanf(name, "ckpt_%lld.rank%d.bin%n", &step, &part, &length) != 2 || length != (int)strlen(name)) return -1;
    return step;
}

// ---- writing a checkpoint into place ------------------------------------------------------

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

// ---- finding and clearing up ------------------------------------------------------------

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
