// mkdir -p for the programs' output folders: the shard folders of ./tokenize and the trainer's
// out_dir. Returns 0, or -1 with "error: <path>: <what is wrong>" in the caller's buffer (the
// messages of dataloader/shard.h). Plain C.
#pragma once
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

// The directory `path` and any missing parents; an existing directory is accepted, a path that
// is a file, or lies under one, is refused.
static inline int make_directories(const char *path, char *error, size_t error_size) {
    size_t size = strlen(path) + 1;
    char *partial = (char *)malloc(size);
    if (!partial) {
        snprintf(error, error_size, "error: %s: out of memory", path);
        return -1;
    }
    memcpy(partial, path, size);
    int status = 0;
    for (char *p = partial + (partial[0] != '\0');; p++) {
        if (*p != '/' && *p != '\0') continue;
        char saved = *p;
        *p = '\0';
        if (mkdir(partial, 0777) != 0 && errno != EEXIST) {
            snprintf(error, error_size, "error: %s: cannot create the directory: %s", partial, strerror(errno));
            status = -1;
            break;
        }
        *p = saved;
        if (saved == '\0') break;
    }
    free(partial);
    struct stat info;
    if (status == 0 && (stat(path, &info) != 0 || !S_ISDIR(info.st_mode))) {
        snprintf(error, error_size, "error: %s: not a directory", path);
        status = -1;
    }
    return status;
}
