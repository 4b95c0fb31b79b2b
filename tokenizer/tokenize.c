// ./tokenize: the command-line front end of the tokenizer library (tokenizer.h).
//   ./tokenize encode -t TOKENIZER.json [--bos] [--eos]  UTF-8 text on stdin -> decimal ids on stdout
//   ./tokenize decode -t TOKENIZER.json                  decimal ids on stdin -> text on stdout
//   ./tokenize shards ...                                token shards for training (shards.h)
// Ids are separated by spaces, with a newline at the end. Bad arguments: usage on stderr,
// exit 2. Bad tokenizer file or input: one "error: ..." line on stderr, exit 1.
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "shards.h"
#include "tokenizer.h"

static int usage(void) {
    fprintf(stderr,
            "usage: ./tokenize encode -t TOKENIZER.json [--bos] [--eos] < text > ids\n"
            "       ./tokenize decode -t TOKENIZER.json < ids > text\n"
            "       ./tokenize shards ...   (./tokenize shards --help)\n");
    return 2;
}

static char *read_stdin(size_t *len) {
    size_t capacity = 1 << 16, used = 0;
    char *data = (char *)malloc(capacity + 1);
    while (data) {
        used += fread(data + used, 1, capacity - used, stdin);
        if (used < capacity) break;
        capacity *= 2;
        char *grown = (char *)realloc(data, capacity + 1);
        if (!grown) free(data);
        data = grown;
    }
    if (!data) { fprintf(stderr, "error: stdin: out of memory\n"); return NULL; }
    if (ferror(stdin)) { fprintf(stderr, "error: stdin: read failed: %s\n", strerror(errno)); free(data); return NULL; }
    data[used] = '\0';
    *len = used;
    return data;
}

static int finish_stdout(void) {
    if (fflush(stdout) != 0 || ferror(stdout)) {
        fprintf(stderr, "error: stdout: write failed: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

static int append_id(uint32_t **ids, size_t *count, size_t *capacity, uint32_t id) {
    if (*count == *capacity) {
        size_t grown_capacity = *capacity ? 2 * *capacity : 256;
        uint32_t *grown = (uint32_t *)realloc(*ids, grown_capacity * sizeof(uint32_t));
        if (!grown) return -1;
        *ids = grown;
        *capacity = grown_capacity;
    }
    (*ids)[(*count)++] = id;
    return 0;
}

static int write_ids(const uint32_t *ids, size_t count) {
    char buffer[1 << 16];
    size_t used = 0;
    for (size_t i = 0; i < count; i++) {
        if (used > sizeof(buffer) - 16) { fwrite(buffer, 1, used, stdout); used = 0; }
        used += (size_t)snprintf(buffer + used, sizeof(buffer) - used, i ? " %u" : "%u", ids[i]);
    }
    buffer[used++] = '\n';
    fwrite(buffer, 1, used, stdout);
    return finish_stdout();
}

static int encode_command(const Tokenizer *tok, int add_bos, int add_eos) {
    size_t len;
    char *text = read_stdin(&len);
    if (!text) return 1;
    uint32_t *ids = NULL;
    size_t count = 0, capacity = 0;
    int failed = 0;
    if (add_bos && tokenizer_bos_id(tok) < 0) { fprintf(stderr, "error: --bos: the tokenizer has no BOS token\n"); failed = 1; }
    if (add_eos && tokenizer_eos_id(tok) < 0) { fprintf(stderr, "error: --eos: the tokenizer has no EOS token\n"); failed = 1; }
    if (!failed && add_bos && append_id(&ids, &count, &capacity, (uint32_t)tokenizer_bos_id(tok))) failed = 2;
    if (!failed && tokenizer_encode(tok, text, len, &ids, &count, &capacity)) failed = 2;
    if (!failed && add_eos && append_id(&ids, &count, &capacity, (uint32_t)tokenizer_eos_id(tok))) failed = 2;
    if (failed == 2) fprintf(stderr, "error: encode: out of memory\n");
    int status = failed ? 1 : write_ids(ids, count);
    free(ids);
    free(text);
    return status;
}

static int decode_command(const Tokenizer *tok) {
    size_t len;
    char *text = read_stdin(&len);
    if (!text) return 1;
    uint32_t *ids = NULL;
    size_t count = 0, capacity = 0;
    int status = 0;
    for (char *p = text; status == 0;) {
        while (*p == ' ' || *p == '\n' || *p == '\t' || *p == '\r') p++;
        if (*p == '\0') break;
        char *end = p;  // stays at p when the text is no number: strtoull is not called then
        errno = 0;
        unsigned long long id = (*p >= '0' && *p <= '9') ? strtoull(p, &end, 10) : 0;
        int separated = !*end || *end == ' ' || *end == '\n' || *end == '\t' || *end == '\r';
        if (!(*p >= '0' && *p <= '9') || !separated || (errno && errno != ERANGE)) {
            fprintf(stderr, "error: stdin: not a token id at byte %zu\n", (size_t)(p - text));
            status = 1;
        } else if (errno == ERANGE) {  // a number of more digits than 64 bits hold is still a number
            fprintf(stderr, "error: stdin: token id %.*s is outside the vocabulary (size %d)\n", (int)(end - p), p,
                    tokenizer_vocab_size(tok));
            status = 1;
        } else if (id >= (unsigned long long)tokenizer_vocab_size(tok)) {
            fprintf(stderr, "error: stdin: token id %llu is outside the vocabulary (size %d)\n", id, tokenizer_vocab_size(tok));
            status = 1;
        } else if (append_id(&ids, &count, &capacity, (uint32_t)id)) {
            fprintf(stderr, "error: decode: out of memory\n");
            status = 1;
        }
        if (status == 0) p = end;
    }
    if (status == 0) {
        size_t out_len;
        char *out = tokenizer_decode(tok, ids, count, &out_len);
        if (!out) { fprintf(stderr, "error: decode: out of memory\n"); status = 1; }
        else {
            fwrite(out, 1, out_len, stdout);
            status = finish_stdout();
            free(out);
        }
    }
    free(ids);
    free(text);
    return status;
}

int main(int argc, char **argv) {
    if (argc < 2) return usage();
    if (strcmp(argv[1], "shards") == 0) return shards_command(argc - 1, argv + 1);
    int encode = strcmp(argv[1], "encode") == 0, decode = strcmp(argv[1], "decode") == 0;
    if (!encode && !decode) return usage();
    const char *path = NULL;
    int add_bos = 0, add_eos = 0;
    for (int i = 2; i < argc; i++) {
        if (strcmp(argv[i], "-t") == 0 && i + 1 < argc) path = argv[++i];
        else if (encode && strcmp(argv[i], "--bos") == 0) add_bos = 1;
        else if (encode && strcmp(argv[i], "--eos") == 0) add_eos = 1;
        else return usage();
    }
    if (!path) return usage();
    char error[512];
    Tokenizer *tok = tokenizer_load(path, error, sizeof(error));
    if (!tok) { fprintf(stderr, "error: %s\n", error); return 1; }
    int status = encode ? encode_command(tok, add_bos, add_eos) : decode_command(tok);
    tokenizer_free(tok);
    return status;
}
