// Tokenizer: loads a Hugging Face tokenizer.json and encodes/decodes as HF does; see
// tokenizer.h for the pipeline and the supported features.
//
// Internally every string the BPE model sees is in "model space": raw bytes when the
// pre-tokenizer is ByteLevel (the file's vocab spells byte b as the GPT-2 character
// byte_level_char(b); the loader maps it back), the file's UTF-8 otherwise. Decoding uses one
// precomputed byte string per id.
#include "tokenizer.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "bpe.h"
#include "json.h"
#include "pretokenize.h"
#include "unicode.h"

#define METASPACE "\xE2\x96\x81" // U+2581 "▁", SentencePiece's space
enum { METASPACE_LEN = 3, MAX_ID = 1 << 30, DIRECT_CHAR_IDS = 0x800 };

typedef enum { NORMALIZE_PREPEND, NORMALIZE_REPLACE } NormalizerKind;

typedef struct {
    NormalizerKind kind;
    char *pattern, *content; // Prepend uses content only
    size_t pattern_len, content_len;
} NormalizerStep;

typedef struct {
    char *pattern, *content;
    size_t pattern_len, content_len;
} ReplaceStep;

// A token's text as written in the file (borrowed from the JSON document while loading).
typedef struct {
    const char *text;
    size_t len;
} TokenText;

struct Tokenizer {
    // model
    StringMap vocab;  // model-space bytes -> id
    MergeMap merges;
    int byte_level;   // ByteLevel pre-tokenizer: the model's alphabet is bytes
    int split_llama3; // Split with the Llama 3 regex before ByteLevel
    int byte_fallback, fuse_unk, ignore_merges;
    uint32_t unk_id;
    uint32_t byte_ids[256];   // byte-level: the token of each byte; byte fallback: <0xNN>
    uint32_t *char_ids;       // non-byte-level: token of each code point < DIRECT_CHAR_IDS
    int split_at_metaspace;   // no merge joins "x" and "▁...": BPE may run word by word
    NormalizerStep *normalizers;
    size_t normalizer_count;
    // added tokens, split out of the text before anything else
    StringMap added;
    size_t *added_lengths; // distinct content lengths, longest first
    size_t added_length_count;
    uint8_t added_first_byte[256];
    // decoding
    int decoder_byte_level;
    int decoder_byte_fallback;
    char strip_char[4];
    size_t strip_char_len, strip_start, strip_stop;
    unsigned char *decode_bytes; // pieces back to back
    size_t *decode_offsets;      // piece of id i: [decode_offsets[i], decode_offsets[i + 1])
    int16_t *decode_byte_value;  // byte of a <0xNN> token, -1 otherwise
    uint8_t *id_present;
    uint32_t vocab_size;
    int bos_id, eos_id;
};

// ---- loading helpers -------------------------------------------------------------------

typedef struct {
    const char *path;
    char *error;
    size_t error_size;
} LoadContext;

static int load_error(LoadContext *ctx, const char *fmt, ...) {
    int n = snprintf(ctx->error, ctx->error_size, "%s: ", ctx->path);
    if (n >= 0 && (size_t)n < ctx->error_size) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(ctx->error + n, ctx->error_size - (size_t)n, fmt, args);
        va_end(args);
    }
    return -1;
}

// The whole file, a regular one only (a FIFO would block and /dev/zero never end).
static char *read_file(LoadContext *ctx, size_t *len) {
    struct stat info;
    if (stat(ctx->path, &info) == 0 && !S_ISREG(info.st_mode)) {
        load_error(ctx, "not a regular file (%s)", S_ISDIR(info.st_mode) ? "a directory" : S_ISFIFO(info.st_mode) ? "a FIFO" : "a device or other special file");
        return NULL;
    }
    FILE *f = fopen(ctx->path, "rb");
    if (!f) { load_error(ctx, "cannot open: %s", strerror(errno)); return NULL; }
    size_t capacity = 1 << 20, used = 0;
    char *data = (char *)malloc(capacity);
    while (data) {
        used += fread(data + used, 1, capacity - used, f);
        if (used < capacity) break;
        capacity *= 2;
        char *grown = (char *)realloc(data, capacity);
        if (!grown) { free(data); data = NULL; }
        else data = grown;
    }
    if (!data) { load_error(ctx, "out of memory"); fclose(f); return NULL; }
    if (ferror(f)) { load_error(ctx, "read failed: %s", strerror(errno)); free(data); fclose(f); return NULL; }
    fclose(f);
    *len = used;
    return data;
}

static char *copy_bytes(const char *s, size_t n) {
    char *out = (char *)malloc(n + 1);
    if (out) { memcpy(out, s, n); out[n] = '\0'; }
    return out;
}

// "type" of a config object, or "" when missing.
static const char *type_of(const JsonValue *config) {
    const JsonValue *type = json_get(config, "type");
    return type && type->type == JSON_STRING ? type->string : "";
}

static int is_null(const JsonValue *v) { return !v || v->type == JSON_NULL; }
static int is_true(const JsonValue *v) { return v && v->type == JSON_TRUE; }

// The GPT-2 byte-to-character map: printable Latin-1 bytes stand for themselves, the others
// (controls, space, DEL, NBSP, soft hyphen) for U+0100 onwards in byte order.
static int byte_level_printable(unsigned b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE; }

static uint32_t byte_level_char(unsigned b) {
    if (byte_level_printable(b)) return b;
    uint32_t rank = 0;
    for (unsigned i = 0; i < b; i++) rank += !byte_level_printable(i);
    return 256 + rank;
}

// Inverse of byte_level_char: the byte of a code point, or -1.
static int byte_level_byte(uint32_t cp, const int16_t *inverse) { return cp < 324 ? inverse[cp] : -1; }

static void byte_level_inverse(int16_t inverse[324]) {
    for (int i = 0; i < 324; i++) inverse[i] = -1;
    for (unsigned b = 0; b < 256; b++) inverse[byte_level_char(b)] = (int16_t)b;
}

// Maps a byte-level string to the bytes it spells; returns the length or -1 when some
// character is outside the byte-level alphabet. out needs room for len bytes.
static long byte_level_decode(const char *s, size_t len, const int16_t *inverse, unsigned char *out) {
    size_t i = 0, n = 0;
    const unsigned char *u = (const unsigned char *)s;
    while (i < len) {
        size_t prefix, length = utf8_sequence_length(u + i, len - i, &prefix);
        if (!length) return -1;
        size_t char_len;
        int b = byte_level_byte(utf8_decode(u + i, &char_len), inverse);
        if (b < 0) return -1;
        out[n++] = (unsigned char)b;
        i += length;
    }
    return (long)n;
}

// ---- configuration ---------------------------------------------------------------------

static int load_normalizer_step(LoadContext *ctx, Tokenizer *tok, const JsonValue *config) {
    const char *type = type_of(config);
    NormalizerStep *step = &tok->normalizers[tok->normalizer_count];
    memset(step, 0, sizeof(*step));
    if (strcmp(type, "Prepend") == 0) {
        const JsonValue *prepend = json_get(config, "prepend");
        if (!prepend || prepend->type != JSON_STRING) return load_error(ctx, "normalizer Prepend: missing 'prepend'");
        step->kind = NORMALIZE_PREPEND;
        step->content = copy_bytes(prepend->string, prepend->count);
        step->content_len = prepend->count;
    } else if (strcmp(type, "Replace") == 0) {
        const JsonValue *pattern = json_get(json_get(config, "pattern"), "String");
        const JsonValue *content = json_get(config, "content");
        if (!pattern || pattern->type != JSON_STRING || pattern->count == 0)
            return load_error(ctx, "unsupported: normalizer Replace without a non-empty String pattern");
        if (!content || content->type != JSON_STRING) return load_error(ctx, "normalizer Replace: missing 'content'");
        step->kind = NORMALIZE_REPLACE;
        step->pattern = copy_bytes(pattern->string, pattern->count);
        step->pattern_len = pattern->count;
        step->content = copy_bytes(content->string, content->count);
        step->content_len = content->count;
        if (!step->pattern) return load_error(ctx, "out of memory");
    } else {
        return load_error(ctx, "unsupported: normalizer %s", type[0] ? type : "without a type");
    }
    if (!step->content) return load_error(ctx, "out of memory");
    tok->normalizer_count++;
    return 0;
}

static int load_normalizer(LoadContext *ctx, Tokenizer *tok, const JsonValue *config) {
    if (is_null(config)) return 0;
    const JsonValue *steps = config;
    size_t count = 1;
    if (strcmp(type_of(config), "Sequence") == 0) {
        steps = json_get(config, "normalizers");
        if (!steps || steps->type != JSON_ARRAY) return load_error(ctx, "normalizer Sequence: missing 'normalizers'");
        count = steps->count;
    }
    tok->normalizers = (NormalizerStep *)calloc(count ? count : 1, sizeof(NormalizerStep));
    if (!tok->normalizers) return load_error(ctx, "out of memory");
    for (size_t i = 0; i < count; i++) {
        if (load_normalizer_step(ctx, tok, steps == config ? config : &steps->items[i])) return -1;
    }
    return 0;
}

static int load_byte_level(LoadContext *ctx, Tokenizer *tok, const JsonValue *config) {
    if (is_true(json_get(config, "add_prefix_space"))) return load_error(ctx, "unsupported: ByteLevel add_prefix_space");
    const JsonValue *use_regex = json_get(config, "use_regex");
    if (!use_regex || is_true(use_regex)) return load_error(ctx, "unsupported: ByteLevel pre-tokenizer with use_regex");
    tok->byte_level = 1;
    return 0;
}

static int load_split(LoadContext *ctx, Tokenizer *tok, const JsonValue *config) {
    const JsonValue *regex = json_get(json_get(config, "pattern"), "Regex");
    if (!json_is_string(regex, llama3_split_pattern))
        return load_error(ctx, "unsupported: pre_tokenizer Split pattern other than Llama 3's");
    if (!json_is_string(json_get(config, "behavior"), "Isolated"))
        return load_error(ctx, "unsupported: pre_tokenizer Split behavior other than Isolated");
    if (is_true(json_get(config, "invert"))) return load_error(ctx, "unsupported: pre_tokenizer Split invert");
    tok->split_llama3 = 1;
    return 0;
}

static int load_pre_tokenizer(LoadContext *ctx, Tokenizer *tok, const JsonValue *config) {
    if (is_null(config)) return 0;
    const char *type = type_of(config);
    if (strcmp(type, "ByteLevel") == 0) return load_byte_level(ctx, tok, config);
    if (strcmp(type, "Sequence") == 0) {
        const JsonValue *steps = json_get(config, "pretokenizers");
        if (steps && steps->type == JSON_ARRAY && steps->count == 2 &&
            strcmp(type_of(&steps->items[0]), "Split") == 0 && strcmp(type_of(&steps->items[1]), "ByteLevel") == 0) {
            if (load_split(ctx, tok, &steps->items[0])) return -1;
            return load_byte_level(ctx, tok, &steps->items[1]);
        }
        return load_error(ctx, "unsupported: pre_tokenizer Sequence other than [Split, ByteLevel]");
    }
    return load_error(ctx, "unsupported: pre_tokenizer %s", type[0] ? type : "without a type");
}

// decoder: ByteLevel, or Sequence of Replace*, ByteFallback?, Fuse?, Strip? (Strip after Fuse).
static int load_decoder(LoadContext *ctx, Tokenizer *tok, const JsonValue *config, ReplaceStep **replaces,
                        size_t *replace_count) {
    if (is_null(config)) return load_error(ctx, "unsupported: decoder null");
    const char *type = type_of(config);
    if (strcmp(type, "ByteLevel") == 0) { tok->decoder_byte_level = 1; return 0; }
    if (strcmp(type, "Sequence") != 0) return load_error(ctx, "unsupported: decoder %s", type[0] ? type : "without a type");
    const JsonValue *steps = json_get(config, "decoders");
    if (!steps || steps->type != JSON_ARRAY) return load_error(ctx, "decoder Sequence: missing 'decoders'");
    *replaces = (ReplaceStep *)calloc(steps->count ? steps->count : 1, sizeof(ReplaceStep));
    if (!*replaces) return load_error(ctx, "out of memory");
    int stage = 0; // 0 Replace, 1 after ByteFallback, 2 after Fuse, 3 after Strip
    for (size_t i = 0; i < steps->count; i++) {
        const JsonValue *step = &steps->items[i];
        const char *step_type = type_of(step);
        if (strcmp(step_type, "Replace") == 0 && stage == 0) {
            const JsonValue *pattern = json_get(json_get(step, "pattern"), "String");
            const JsonValue *content = json_get(step, "content");
            if (!pattern || pattern->type != JSON_STRING || pattern->count == 0 || !content || content->type != JSON_STRING)
                return load_error(ctx, "unsupported: decoder Replace without a non-empty String pattern");
            ReplaceStep *r = &(*replaces)[(*replace_count)++];
            r->pattern = copy_bytes(pattern->string, pattern->count);
            r->content = copy_bytes(content->string, content->count);
            r->pattern_len = pattern->count;
            r->content_len = content->count;
            if (!r->pattern || !r->content) return load_error(ctx, "out of memory");
        } else if (strcmp(step_type, "ByteFallback") == 0 && stage < 1) {
            tok->decoder_byte_fallback = 1;
            stage = 1;
        } else if (strcmp(step_type, "Fuse") == 0 && stage < 2) {
            stage = 2;
        } else if (strcmp(step_type, "Strip") == 0 && stage == 2) {
            const JsonValue *content = json_get(step, "content");
            const JsonValue *start = json_get(step, "start"), *stop = json_get(step, "stop");
            size_t prefix;
            if (!content || content->type != JSON_STRING || content->count == 0 || content->count > 4 ||
                utf8_sequence_length((const unsigned char *)content->string, content->count, &prefix) != content->count ||
                !start || start->type != JSON_NUMBER || start->number < 0 || !stop || stop->type != JSON_NUMBER ||
                stop->number < 0)
                return load_error(ctx, "decoder Strip: needs one character 'content' and counts 'start', 'stop'");
            memcpy(tok->strip_char, content->string, content->count);
            tok->strip_char_len = content->count;
            tok->strip_start = (size_t)start->number;
            tok->strip_stop = (size_t)stop->number;
            stage = 3;
        } else {
            return load_error(ctx, "unsupported: decoder Sequence step %s at position %zu", step_type[0] ? step_type : "without a type", i);
        }
    }
    return 0;
}

// ---- vocabulary, merges, added tokens --------------------------------------------------

// The model-space key of a vocab string: its bytes when byte-level, itself otherwise.
// scratch needs room for len bytes. Returns the key length or -1.
static long model_key(const Tokenizer *tok, const int16_t *inverse, const char *s, size_t len, unsigned char *scratch,
                      const unsigned char **key) {
    if (!tok->byte_level) { *key = (const unsigned char *)s; return (long)len; }
    *key = scratch;
    return byte_level_decode(s, len, inverse, scratch);
}

static int load_vocab(LoadContext *ctx, Tokenizer *tok, const JsonValue *vocab, const int16_t *inverse,
                      TokenText **strings_by_id, uint32_t *model_size) {
    if (!vocab || vocab->type != JSON_OBJECT) return load_error(ctx, "model: missing 'vocab' object");
    uint32_t max_id = 0;
    for (size_t i = 0; i < vocab->count; i++) {
        const JsonValue *id = &vocab->members[i].value;
        if (id->type != JSON_NUMBER || id->number < 0 || id->number >= MAX_ID || id->number != (double)(uint32_t)id->number)
            return load_error(ctx, "model vocab: id of token %zu is not an integer in [0, %d)", i, MAX_ID);
        if ((uint32_t)id->number > max_id) max_id = (uint32_t)id->number;
    }
    *model_size = vocab->count ? max_id + 1 : 0;
    *strings_by_id = (TokenText *)calloc(*model_size ? *model_size : 1, sizeof(TokenText));
    unsigned char *scratch = (unsigned char *)malloc(4096);
    if (!*strings_by_id || !scratch || string_map_init(&tok->vocab, vocab->count)) {
        free(scratch);
        return load_error(ctx, "out of memory");
    }
    for (size_t i = 0; i < vocab->count; i++) {
        const JsonMember *m = &vocab->members[i];
        uint32_t id = (uint32_t)m->value.number;
        if ((*strings_by_id)[id].text) { free(scratch); return load_error(ctx, "model vocab: id %u appears twice", id); }
        const unsigned char *key;
        if (m->key_len > 4096) { free(scratch); return load_error(ctx, "model vocab: token %u longer than 4096 bytes", id); }
        long key_len = model_key(tok, inverse, m->key, m->key_len, scratch, &key);
        if (key_len < 0) { free(scratch); return load_error(ctx, "unsupported: vocab token %u is not in the byte-level alphabet", id); }
        if (string_map_get(&tok->vocab, key, (size_t)key_len) != BPE_NO_ID) {
            free(scratch);
            return load_error(ctx, "model vocab: token %u repeats an earlier token", id);
        }
        if (string_map_put(&tok->vocab, key, (size_t)key_len, id)) { free(scratch); return load_error(ctx, "out of memory"); }
        (*strings_by_id)[id].text = m->key;
        (*strings_by_id)[id].len = m->key_len;
    }
    free(scratch);
    return 0;
}

// Splits merge i into its two halves.
static int merge_halves(LoadContext *ctx, const JsonValue *merge, size_t i, const char **a, size_t *a_len, const char **b,
                        size_t *b_len) {
    if (merge->type == JSON_STRING) {
        const char *space = (const char *)memchr(merge->string, ' ', merge->count);
        if (!space || memchr(space + 1, ' ', merge->count - (size_t)(space - merge->string) - 1))
            return load_error(ctx, "model merges: merge %zu is not two tokens separated by one space", i);
        *a = merge->string;
        *a_len = (size_t)(space - merge->string);
        *b = space + 1;
        *b_len = merge->count - *a_len - 1;
        return 0;
    }
    if (merge->type == JSON_ARRAY && merge->count == 2 && merge->items[0].type == JSON_STRING &&
        merge->items[1].type == JSON_STRING) {
        *a = merge->items[0].string;
        *a_len = merge->items[0].count;
        *b = merge->items[1].string;
        *b_len = merge->items[1].count;
        return 0;
    }
    return load_error(ctx, "model merges: merge %zu is neither \"a b\" nor [\"a\", \"b\"]", i);
}

static int ends_with_metaspace(const unsigned char *s, size_t n) {
    return n >= METASPACE_LEN && memcmp(s + n - METASPACE_LEN, METASPACE, METASPACE_LEN) == 0;
}

static int load_merges(LoadContext *ctx, Tokenizer *tok, const JsonValue *merges, const int16_t *inverse) {
    if (!merges || merges->type != JSON_ARRAY) return load_error(ctx, "model: missing 'merges' array");
    if (merges->count >= UINT32_MAX) return load_error(ctx, "model merges: too many");
    if (merge_map_init(&tok->merges, merges->count)) return load_error(ctx, "out of memory");
    unsigned char *scratch = (unsigned char *)malloc(8192);
    if (!scratch) return load_error(ctx, "out of memory");
    tok->split_at_metaspace = !tok->byte_level && !tok->split_llama3;
    int result = 0;
    for (size_t i = 0; i < merges->count && result == 0; i++) {
        const char *a = NULL, *b = NULL;
        size_t a_len = 0, b_len = 0;
        if (merge_halves(ctx, &merges->items[i], i, &a, &a_len, &b, &b_len)) { result = -1; break; }
        if (a_len > 4096 || b_len > 4096) { result = load_error(ctx, "model merges: merge %zu too long", i); break; }
        const unsigned char *ka, *kb;
        long ka_len = model_key(tok, inverse, a, a_len, scratch, &ka);
        long kb_len = ka_len < 0 ? -1 : model_key(tok, inverse, b, b_len, scratch + 4096, &kb);
        if (ka_len < 0 || kb_len < 0) { result = load_error(ctx, "unsupported: merge %zu is not in the byte-level alphabet", i); break; }
        uint32_t left = string_map_get(&tok->vocab, ka, (size_t)ka_len);
        uint32_t right = string_map_get(&tok->vocab, kb, (size_t)kb_len);
        if (left == BPE_NO_ID || right == BPE_NO_ID) {
            result = load_error(ctx, "model merges: merge %zu uses a token that is not in the vocab", i);
            break;
        }
        // The merged token's key is the two keys back to back.
        unsigned char *joined = (unsigned char *)malloc((size_t)(ka_len + kb_len));
        if (!joined) { result = load_error(ctx, "out of memory"); break; }
        memcpy(joined, ka, (size_t)ka_len);
        memcpy(joined + ka_len, kb, (size_t)kb_len);
        uint32_t merged = string_map_get(&tok->vocab, joined, (size_t)(ka_len + kb_len));
        free(joined);
        if (merged == BPE_NO_ID) { result = load_error(ctx, "model merges: the result of merge %zu is not in the vocab", i); break; }
        merge_map_put(&tok->merges, left, right, (uint32_t)i, merged);
        if (!ends_with_metaspace(ka, (size_t)ka_len) && kb_len >= METASPACE_LEN && memcmp(kb, METASPACE, METASPACE_LEN) == 0)
            tok->split_at_metaspace = 0;
    }
    free(scratch);
    return result;
}

static int load_model(LoadContext *ctx, Tokenizer *tok, const JsonValue *model, const int16_t *inverse,
                      TokenText **strings_by_id, uint32_t *model_size) {
    if (!model || model->type != JSON_OBJECT) return load_error(ctx, "missing 'model' object");
    const char *type = type_of(model);
    if (strcmp(type, "BPE") != 0) return load_error(ctx, "unsupported: model %s", type[0] ? type : "without a type");
    if (!is_null(json_get(model, "dropout"))) return load_error(ctx, "unsupported: BPE dropout");
    const JsonValue *prefix = json_get(model, "continuing_subword_prefix");
    const JsonValue *suffix = json_get(model, "end_of_word_suffix");
    if (!is_null(prefix) && !json_is_string(prefix, "")) return load_error(ctx, "unsupported: BPE continuing_subword_prefix");
    if (!is_null(suffix) && !json_is_string(suffix, "")) return load_error(ctx, "unsupported: BPE end_of_word_suffix");
    tok->fuse_unk = is_true(json_get(model, "fuse_unk"));
    tok->byte_fallback = is_true(json_get(model, "byte_fallback"));
    tok->ignore_merges = is_true(json_get(model, "ignore_merges"));
    if (load_vocab(ctx, tok, json_get(model, "vocab"), inverse, strings_by_id, model_size)) return -1;
    if (load_merges(ctx, tok, json_get(model, "merges"), inverse)) return -1;

    tok->unk_id = BPE_NO_ID;
    const JsonValue *unk = json_get(model, "unk_token");
    if (!is_null(unk)) {
        if (unk->type != JSON_STRING) return load_error(ctx, "model: 'unk_token' is not a string");
        const unsigned char *key;
        unsigned char scratch[256];
        long key_len = unk->count <= sizeof(scratch) ? model_key(tok, inverse, unk->string, unk->count, scratch, &key) : -1;
        if (key_len >= 0) tok->unk_id = string_map_get(&tok->vocab, key, (size_t)key_len);
        if (tok->unk_id == BPE_NO_ID) return load_error(ctx, "model: unk_token is not in the vocab");
    }
    int bytes_complete = 1;
    for (unsigned b = 0; b < 256; b++) {
        char name[8];
        unsigned char one = (unsigned char)b;
        if (tok->byte_level) tok->byte_ids[b] = string_map_get(&tok->vocab, &one, 1);
        else if (tok->byte_fallback) {
            snprintf(name, sizeof(name), "<0x%02X>", b);
            tok->byte_ids[b] = string_map_get(&tok->vocab, (const unsigned char *)name, strlen(name));
        } else tok->byte_ids[b] = BPE_NO_ID;
        if (tok->byte_ids[b] == BPE_NO_ID) bytes_complete = 0;
    }
    if (tok->byte_level && !bytes_complete) return load_error(ctx, "unsupported: byte-level vocab without a token for every byte");
    // HF fails at encode time on a character it cannot represent; refuse such a model up front.
    if (!tok->byte_level && !bytes_complete && tok->unk_id == BPE_NO_ID)
        return load_error(ctx, "unsupported: BPE without unk_token or complete byte_fallback");
    if (!tok->byte_level) {
        tok->char_ids = (uint32_t *)malloc(DIRECT_CHAR_IDS * sizeof(uint32_t));
        if (!tok->char_ids) return load_error(ctx, "out of memory");
        for (uint32_t cp = 0; cp < DIRECT_CHAR_IDS; cp++) {
            unsigned char utf8[2];
            size_t n = 1;
            if (cp < 0x80) utf8[0] = (unsigned char)cp;
            else { utf8[0] = (unsigned char)(0xC0 | cp >> 6); utf8[1] = (unsigned char)(0x80 | (cp & 0x3F)); n = 2; }
            tok->char_ids[cp] = string_map_get(&tok->vocab, utf8, n);
        }
    }
    if (tok->split_at_metaspace)
        tok->split_at_metaspace = string_map_get(&tok->vocab, (const unsigned char *)METASPACE, METASPACE_LEN) != BPE_NO_ID;
    return 0;
}

static int load_added_tokens(LoadContext *ctx, Tokenizer *tok, const JsonValue *added, const int16_t *inverse,
                             TokenText **added_by_id, uint32_t *added_size) {
    *added_size = 0;
    if (string_map_init(&tok->added, added && added->type == JSON_ARRAY ? added->count : 0)) return load_error(ctx, "out of memory");
    if (is_null(added)) return 0;
    if (added->type != JSON_ARRAY) return load_error(ctx, "'added_tokens' is not an array");
    tok->added_lengths = (size_t *)calloc(added->count ? added->count : 1, sizeof(size_t));
    if (!tok->added_lengths) return load_error(ctx, "out of memory");
    for (size_t i = 0; i < added->count; i++) {
        const JsonValue *token = &added->items[i];
        const JsonValue *id = json_get(token, "id"), *content = json_get(token, "content");
        if (!id || id->type != JSON_NUMBER || id->number < 0 || id->number >= MAX_ID || id->number != (double)(uint32_t)id->number ||
            !content || content->type != JSON_STRING)
            return load_error(ctx, "added_tokens[%zu]: needs an integer 'id' and a string 'content'", i);
        if (content->count == 0) return load_error(ctx, "added_tokens[%zu]: empty content", i);
        static const char *const options[] = {"single_word", "lstrip", "rstrip"};
        for (int k = 0; k < 3; k++) {
            if (is_true(json_get(token, options[k]))) return load_error(ctx, "unsupported: added token %s", options[k]);
        }
        if (is_true(json_get(token, "normalized")) && tok->normalizer_count)
            return load_error(ctx, "unsupported: normalized added token with a normalizer");
        uint32_t token_id = (uint32_t)id->number;
        // An added token that is also in the model vocab keeps the model's id in HF.
        const unsigned char *key;
        unsigned char scratch[1024];
        long key_len = content->count <= sizeof(scratch) ? model_key(tok, inverse, content->string, content->count, scratch, &key) : -1;
        uint32_t model_id = key_len >= 0 ? string_map_get(&tok->vocab, key, (size_t)key_len) : BPE_NO_ID;
        if (model_id != BPE_NO_ID && model_id != token_id)
            return load_error(ctx, "unsupported: added token %u has model id %u", token_id, model_id);
        if (string_map_put(&tok->added, (const unsigned char *)content->string, content->count, token_id))
            return load_error(ctx, "out of memory");
        tok->added_first_byte[(unsigned char)content->string[0]] = 1;
        size_t k = 0;
        while (k < tok->added_length_count && tok->added_lengths[k] != content->count) k++;
        if (k == tok->added_length_count) tok->added_lengths[tok->added_length_count++] = content->count;
        if (token_id + 1 > *added_size) *added_size = token_id + 1;
    }
    // Longest first, so the first hit at a position is the longest match there.
    for (size_t i = 1; i < tok->added_length_count; i++) {
        for (size_t j = i; j > 0 && tok->added_lengths[j - 1] < tok->added_lengths[j]; j--) {
            size_t t = tok->added_lengths[j];
            tok->added_lengths[j] = tok->added_lengths[j - 1];
            tok->added_lengths[j - 1] = t;
        }
    }
    *added_by_id = (TokenText *)calloc(*added_size ? *added_size : 1, sizeof(TokenText));
    if (!*added_by_id) return load_error(ctx, "out of memory");
    for (size_t i = 0; i < added->count; i++) {
        const JsonValue *content = json_get(&added->items[i], "content");
        TokenText *slot = &(*added_by_id)[(uint32_t)json_get(&added->items[i], "id")->number];
        slot->text = content->string;
        slot->len = content->count;
    }
    return 0;
}

// ---- decode pieces ---------------------------------------------------------------------

// Replaces every pattern in s[0..len) by content into a new malloc'd string.
static char *replace_all(const char *s, size_t len, const ReplaceStep *step, size_t *out_len) {
    size_t capacity = len + 1, n = 0;
    if (step->content_len > step->pattern_len) capacity += (len / step->pattern_len) * (step->content_len - step->pattern_len);
    char *out = (char *)malloc(capacity);
    if (!out) return NULL;
    for (size_t i = 0; i < len;) {
        if (len - i >= step->pattern_len && memcmp(s + i, step->pattern, step->pattern_len) == 0) {
            memcpy(out + n, step->content, step->content_len);
            n += step->content_len;
            i += step->pattern_len;
        } else {
            out[n++] = s[i++];
        }
    }
    *out_len = n;
    return out;
}

static int hex_value(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// The decoded bytes of one token string, per the decoder; *byte_value gets the byte of a
// "<0xNN>" token under ByteFallback, else -1. Returns a malloc'd string or NULL.
static char *decode_piece(const Tokenizer *tok, const TokenText *token, const ReplaceStep *replaces, size_t replace_count,
                          const int16_t *inverse, size_t *len, int *byte_value) {
    *byte_value = -1;
    if (tok->decoder_byte_level) {
        char *out = (char *)malloc(token->len + 1);
        if (!out) return NULL;
        long n = byte_level_decode(token->text, token->len, inverse, (unsigned char *)out);
        if (n < 0) { memcpy(out, token->text, token->len); n = (long)token->len; }
        *len = (size_t)n;
        return out;
    }
    char *s = copy_bytes(token->text, token->len);
    size_t n = token->len;
    for (size_t i = 0; s && i < replace_count; i++) {
        size_t replaced_len;
        char *replaced = replace_all(s, n, &replaces[i], &replaced_len);
        free(s);
        s = replaced;
        n = replaced_len;
    }
    if (s && tok->decoder_byte_fallback && n == 6 && memcmp(s, "<0x", 3) == 0 && s[5] == '>' && hex_value(s[3]) >= 0 &&
        hex_value(s[4]) >= 0)
        *byte_value = hex_value(s[3]) * 16 + hex_value(s[4]);
    *len = n;
    return s;
}

static int build_decode_table(LoadContext *ctx, Tokenizer *tok, const TokenText *model_strings, uint32_t model_size,
                              const TokenText *added_strings, uint32_t added_size, const ReplaceStep *replaces,
                              size_t replace_count, const int16_t *inverse) {
    uint32_t n = tok->vocab_size;
    tok->decode_offsets = (size_t *)calloc((size_t)n + 1, sizeof(size_t));
    tok->decode_byte_value = (int16_t *)malloc(((size_t)n + 1) * sizeof(int16_t));
    tok->id_present = (uint8_t *)calloc((size_t)n + 1, 1);
    if (!tok->decode_offsets || !tok->decode_byte_value || !tok->id_present) return load_error(ctx, "out of memory");
    size_t used = 0, capacity = 1 << 20;
    tok->decode_bytes = (unsigned char *)malloc(capacity);
    if (!tok->decode_bytes) return load_error(ctx, "out of memory");
    for (uint32_t id = 0; id < n; id++) {
        const TokenText *token = id < added_size && added_strings[id].text ? &added_strings[id]
                                 : id < model_size && model_strings[id].text ? &model_strings[id]
                                                                             : NULL;
        tok->decode_offsets[id] = used;
        tok->decode_byte_value[id] = -1;
        if (!token) continue;
        size_t len;
        int byte_value;
        char *piece = decode_piece(tok, token, replaces, replace_count, inverse, &len, &byte_value);
        if (!piece) return load_error(ctx, "out of memory");
        while (used + len > capacity) {
            capacity *= 2;
            unsigned char *grown = (unsigned char *)realloc(tok->decode_bytes, capacity);
            if (!grown) { free(piece); return load_error(ctx, "out of memory"); }
            tok->decode_bytes = grown;
        }
        memcpy(tok->decode_bytes + used, piece, len);
        free(piece);
        used += len;
        tok->decode_byte_value[id] = (int16_t)byte_value;
        tok->id_present[id] = 1;
    }
    tok->decode_offsets[n] = used;
    return 0;
}

static int find_special(const Tokenizer *tok, const char *const *names, int count) {
    for (int i = 0; i < count; i++) {
        uint32_t id = string_map_get(&tok->added, (const unsigned char *)names[i], strlen(names[i]));
        if (id != BPE_NO_ID) return (int)id;
    }
    return -1;
}

static int load_document(LoadContext *ctx, Tokenizer *tok, const JsonValue *root) {
    if (root->type != JSON_OBJECT) return load_error(ctx, "not a tokenizer.json: the top level is not an object");
    if (!is_null(json_get(root, "truncation"))) return load_error(ctx, "unsupported: truncation");
    if (!is_null(json_get(root, "padding"))) return load_error(ctx, "unsupported: padding");
    int16_t inverse[324];
    byte_level_inverse(inverse);
    TokenText *model_strings = NULL, *added_strings = NULL;
    ReplaceStep *replaces = NULL;
    size_t replace_count = 0;
    uint32_t model_size = 0, added_size = 0;
    int result = -1;
    if (load_normalizer(ctx, tok, json_get(root, "normalizer")) == 0 &&
        load_pre_tokenizer(ctx, tok, json_get(root, "pre_tokenizer")) == 0 &&
        load_decoder(ctx, tok, json_get(root, "decoder"), &replaces, &replace_count) == 0 &&
        load_model(ctx, tok, json_get(root, "model"), inverse, &model_strings, &model_size) == 0 &&
        load_added_tokens(ctx, tok, json_get(root, "added_tokens"), inverse, &added_strings, &added_size) == 0) {
        tok->vocab_size = model_size > added_size ? model_size : added_size;
        result = build_decode_table(ctx, tok, model_strings, model_size, added_strings, added_size, replaces, replace_count,
                                    inverse);
        static const char *const bos_names[] = {"<|begin_of_text|>", "<s>"};
        static const char *const eos_names[] = {"<|end_of_text|>", "</s>"};
        tok->bos_id = find_special(tok, bos_names, 2);
        tok->eos_id = find_special(tok, eos_names, 2);
    }
    for (size_t i = 0; replaces && i < replace_count; i++) { free(replaces[i].pattern); free(replaces[i].content); }
    free(replaces);
    free(model_strings);
    free(added_strings);
    return result;
}

Tokenizer *tokenizer_load(const char *path, char *error, size_t error_size) {
    LoadContext ctx = {path, error, error_size};
    size_t len;
    char *text = read_file(&ctx, &len);
    if (!text) return NULL;
    char json_error[256];
    // A UTF-8 byte order mark (some editors write one) is not JSON; it is skipped, not taken for a number.
    size_t bom = len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
    JsonDocument *doc = json_parse(text + bom, len - bom, json_error, sizeof(json_error));
    free(text);
    if (!doc) { load_error(&ctx, "invalid JSON: %s", json_error); return NULL; }
    Tokenizer *tok = (Tokenizer *)calloc(1, sizeof(Tokenizer));
    if (!tok) { json_free(doc); load_error(&ctx, "out of memory"); return NULL; }
    int result = load_document(&ctx, tok, json_root(doc));
    json_free(doc);
    if (result) { tokenizer_free(tok); return NULL; }
    return tok;
}

void tokenizer_free(Tokenizer *tok) {
    if (!tok) return;
    string_map_free(&tok->vocab);
    merge_map_free(&tok->merges);
    string_map_free(&tok->added);
    for (size_t i = 0; i < tok->normalizer_count; i++) {
        free(tok->normalizers[i].pattern);
        free(tok->normalizers[i].content);
    }
    free(tok->normalizers);
    free(tok->char_ids);
    free(tok->added_lengths);
    free(tok->decode_bytes);
    free(tok->decode_offsets);
    free(tok->decode_byte_value);
    free(tok->id_present);
    free(tok);
}

int tokenizer_vocab_size(const Tokenizer *tok) { return (int)tok->vocab_size; }

int tokenizer_missing_ids(const Tokenizer *tok, int *first_missing) {
    int missing = 0;
    *first_missing = -1;
    for (uint32_t id = 0; id < tok->vocab_size; id++)
        if (!tok->id_present[id] && missing++ == 0) *first_missing = (int)id;
    return missing;
}
int tokenizer_bos_id(const Tokenizer *tok) { return tok->bos_id; }
int tokenizer_eos_id(const Tokenizer *tok) { return tok->eos_id; }

// ---- encoding --------------------------------------------------------------------------

// Per-call working memory: one per thread by construction.
typedef struct {
    unsigned char *normalized[2];
    size_t normalized_capacity[2];
    uint32_t *symbols;
    size_t symbol_capacity;
    BpeScratch bpe;
    uint32_t **ids;
    size_t *count, *capacity;
} Encoder;

static int reserve(void **array, size_t *capacity, size_t needed, size_t element_size) {
    if (needed <= *capacity) return 0;
    size_t capacity_new = *capacity ? *capacity : 256;
    while (capacity_new < needed) capacity_new *= 2;
    void *grown = realloc(*array, capacity_new * element_size);
    if (!grown) return -1;
    *array = grown;
    *capacity = capacity_new;
    return 0;
}

static int emit(Encoder *e, const uint32_t *ids, size_t n) {
    if (reserve((void **)e->ids, e->capacity, *e->count + n, sizeof(uint32_t))) return -1;
    memcpy(*e->ids + *e->count, ids, n * sizeof(uint32_t));
    *e->count += n;
    return 0;
}

// The initial symbols of a non-byte-level word: one token per character, else its <0xNN>
// tokens, else unk (consecutive unknown characters fused into one unk when fuse_unk).
static size_t char_symbols(const Tokenizer *tok, const unsigned char *w, size_t n, uint32_t *symbols) {
    size_t count = 0;
    int unk_pending = 0;
    for (size_t i = 0; i < n;) {
        size_t char_len;
        uint32_t cp = utf8_decode(w + i, &char_len);
        uint32_t id = cp < DIRECT_CHAR_IDS ? tok->char_ids[cp] : string_map_get(&tok->vocab, w + i, char_len);
        int bytes_known = tok->byte_fallback;
        for (size_t k = 0; id == BPE_NO_ID && bytes_known && k < char_len; k++) bytes_known = tok->byte_ids[w[i + k]] != BPE_NO_ID;
        if (id != BPE_NO_ID || bytes_known) {
            if (unk_pending) { symbols[count++] = tok->unk_id; unk_pending = 0; }
            if (id != BPE_NO_ID) symbols[count++] = id;
            else for (size_t k = 0; k < char_len; k++) symbols[count++] = tok->byte_ids[w[i + k]];
        } else if (!(unk_pending && tok->fuse_unk)) {
            if (unk_pending) symbols[count++] = tok->unk_id;
            unk_pending = 1;
        }
        i += char_len;
    }
    if (unk_pending) symbols[count++] = tok->unk_id;
    return count;
}

// BPE of one pre-token w[0..n) in model space.
static int encode_word(const Tokenizer *tok, const unsigned char *w, size_t n, Encoder *e) {
    if (n == 0) return 0;
    if (tok->ignore_merges) { // a pre-token that is a whole vocab entry stays whole
        uint32_t id = string_map_get(&tok->vocab, w, n);
        if (id != BPE_NO_ID) return emit(e, &id, 1);
    }
    if (reserve((void **)&e->symbols, &e->symbol_capacity, n, sizeof(uint32_t))) return -1;
    size_t count;
    if (tok->byte_level) {
        for (size_t i = 0; i < n; i++) e->symbols[i] = tok->byte_ids[w[i]];
        count = n;
    } else {
        count = char_symbols(tok, w, n, e->symbols);
    }
    if (bpe_merge(&tok->merges, e->symbols, &count, &e->bpe)) return -1;
    return emit(e, e->symbols, count);
}

// Applies the normalizer steps to s[0..n); returns the result (in an encoder buffer) or NULL.
static const unsigned char *normalize(const Tokenizer *tok, const unsigned char *s, size_t *n, Encoder *e) {
    const unsigned char *current = s;
    size_t len = *n;
    for (size_t k = 0; k < tok->normalizer_count; k++) {
        const NormalizerStep *step = &tok->normalizers[k];
        int b = (int)(k & 1);
        size_t bound = len + step->content_len;
        if (step->kind == NORMALIZE_REPLACE && step->content_len > step->pattern_len)
            bound = len + (len / step->pattern_len) * (step->content_len - step->pattern_len);
        if (reserve((void **)&e->normalized[b], &e->normalized_capacity[b], bound + 1, 1)) return NULL;
        unsigned char *out = e->normalized[b];
        size_t m = 0;
        if (step->kind == NORMALIZE_PREPEND) {
            if (len) { memcpy(out, step->content, step->content_len); m = step->content_len; }
            memcpy(out + m, current, len);
            m += len;
        } else {
            for (size_t i = 0; i < len;) {
                if (current[i] == (unsigned char)step->pattern[0] && len - i >= step->pattern_len &&
                    memcmp(current + i, step->pattern, step->pattern_len) == 0) {
                    memcpy(out + m, step->content, step->content_len);
                    m += step->content_len;
                    i += step->pattern_len;
                } else {
                    out[m++] = current[i++];
                }
            }
        }
        current = out;
        len = m;
    }
    *n = len;
    return current;
}

static int is_metaspace_at(const unsigned char *s, size_t n, size_t i) {
    return n - i >= METASPACE_LEN && memcmp(s + i, METASPACE, METASPACE_LEN) == 0;
}

// Encodes a piece of text that holds no added token.
static int encode_piece(const Tokenizer *tok, const unsigned char *text, size_t len, Encoder *e) {
    if (len == 0) return 0;
    const unsigned char *s = text;
    size_t n = len;
    if (tok->normalizer_count && !(s = normalize(tok, text, &n, e))) return -1;
    if (tok->split_llama3) {
        for (size_t pos = 0; pos < n;) {
            size_t end = llama3_split_next(s, n, pos);
            if (encode_word(tok, s + pos, end - pos, e)) return -1;
            pos = end;
        }
        return 0;
    }
    if (!tok->split_at_metaspace) return encode_word(tok, s, n, e);
    // Words start at each "▁" that follows something else: no merge crosses such a point.
    size_t start = 0;
    for (size_t i = 0; i < n;) {
        if (i > start && is_metaspace_at(s, n, i) && !(i >= METASPACE_LEN && is_metaspace_at(s, n, i - METASPACE_LEN))) {
            if (encode_word(tok, s + start, i - start, e)) return -1;
            start = i;
        }
        i += is_metaspace_at(s, n, i) ? METASPACE_LEN : 1;
    }
    return encode_word(tok, s + start, n - start, e);
}

// Finds the leftmost, then longest, added token in text[from..len); returns its start or len.
static size_t find_added(const Tokenizer *tok, const unsigned char *text, size_t len, size_t from, size_t *match_len,
                         uint32_t *id) {
    if (!tok->added_length_count) return len;
    for (size_t i = from; i < len; i++) {
        if (!tok->added_first_byte[text[i]]) continue;
        for (size_t k = 0; k < tok->added_length_count; k++) {
            size_t l = tok->added_lengths[k];
            if (l > len - i) continue;
            uint32_t found = string_map_get(&tok->added, text + i, l);
            if (found != BPE_NO_ID) { *match_len = l; *id = found; return i; }
        }
    }
    return len;
}

int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, uint32_t **ids, size_t *count,
                     size_t *capacity) {
    const unsigned char *s = (const unsigned char *)text;
    unsigned char *replaced = NULL;
    if (utf8_valid_prefix(s, len) != len) {
        if (len > SIZE_MAX / 3 || !(replaced = (unsigned char *)malloc(3 * len))) return -1;
        len = utf8_replace_invalid(s, len, replaced);
        s = replaced;
    }
    Encoder e;
    memset(&e, 0, sizeof(e));
    e.ids = ids;
    e.count = count;
    e.capacity = capacity;
    size_t count_before = *count;
    int result = 0;
    for (size_t pos = 0; pos < len && result == 0;) {
        size_t match_len = 0;
        uint32_t id = 0;
        size_t start = find_added(tok, s, len, pos, &match_len, &id);
        result = encode_piece(tok, s + pos, start - pos, &e);
        if (start == len || result) break;
        result = emit(&e, &id, 1);
        pos = start + match_len;
    }
    free(e.normalized[0]);
    free(e.normalized[1]);
    free(e.symbols);
    bpe_scratch_free(&e.bpe);
    free(replaced);
    if (result) *count = count_before;
    return result;
}

// ---- decoding --------------------------------------------------------------------------

char *tokenizer_decode(const Tokenizer *tok, const uint32_t *ids, size_t count, size_t *out_len) {
    size_t raw_len = 0;
    for (size_t i = 0; i < count; i++) {
        if (ids[i] < tok->vocab_size) raw_len += tok->decode_offsets[ids[i] + 1] - tok->decode_offsets[ids[i]];
    }
    // Invalid UTF-8 grows to at most 3 bytes (U+FFFD) per byte.
    unsigned char *raw = (unsigned char *)malloc(raw_len + 1);
    unsigned char *out = (unsigned char *)malloc(3 * raw_len + 1);
    if (!raw || !out) { free(raw); free(out); return NULL; }
    size_t n = 0;
    if (tok->decoder_byte_level) {
        for (size_t i = 0; i < count; i++) {
            if (ids[i] >= tok->vocab_size) continue;
            size_t a = tok->decode_offsets[ids[i]], b = tok->decode_offsets[ids[i] + 1];
            memcpy(raw + n, tok->decode_bytes + a, b - a);
            n += b - a;
        }
        n = utf8_replace_invalid(raw, n, out);
    } else {
        // ByteFallback: a run of <0xNN> tokens is its bytes when they are valid UTF-8, else
        // one U+FFFD per token.
        size_t run_len = 0; // the run's bytes collect in raw
        for (size_t i = 0; i <= count; i++) {
            int in_range = i < count && ids[i] < tok->vocab_size && tok->id_present[ids[i]];
            if (i < count && !in_range) continue;
            int byte_value = i < count ? tok->decode_byte_value[ids[i]] : -1;
            if (byte_value >= 0) {
                raw[run_len++] = (unsigned char)byte_value;
                continue;
            }
            if (run_len) {
                if (utf8_valid_prefix(raw, run_len) == run_len) {
                    memcpy(out + n, raw, run_len);
                    n += run_len;
                } else {
                    for (size_t k = 0; k < run_len; k++, n += 3) memcpy(out + n, "\xEF\xBF\xBD", 3);
                }
                run_len = 0;
            }
            if (i == count) break;
            size_t a = tok->decode_offsets[ids[i]], b = tok->decode_offsets[ids[i] + 1];
            memcpy(out + n, tok->decode_bytes + a, b - a);
            n += b - a;
        }
        // Strip: up to strip_start copies of the character at the start, strip_stop at the end.
        size_t start = 0, end = n;
        for (size_t k = 0; k < tok->strip_start && end - start >= tok->strip_char_len &&
                           memcmp(out + start, tok->strip_char, tok->strip_char_len) == 0; k++)
            start += tok->strip_char_len;
        for (size_t k = 0; k < tok->strip_stop && end - start >= tok->strip_char_len &&
                           memcmp(out + end - tok->strip_char_len, tok->strip_char, tok->strip_char_len) == 0; k++)
            end -= tok->strip_char_len;
        memmove(out, out + start, end - start);
        n = end - start;
    }
    free(raw);
    out[n] = '\0';
    *out_len = n;
    return (char *)out;
}
