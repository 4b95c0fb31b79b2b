// Tests of the tokenizer (tokenizer/): exact ids against Hugging Face tokenizers' vectors for
// every text in test/data/tokenizer/ with Llama 3 and Llama 2, round trips, HF's decode of
// random ids, the Unicode classes against HF's regex, encoding from several threads, the JSON
// reader, and bad tokenizer files. Run from the repository root; needs
// scripts/fetch_tokenizers.sh to have put the tokenizer.json files in data/tokenizers/.
#include <dirent.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../tokenizer/json.h"
#include "../tokenizer/tokenizer.h"
#include "../tokenizer/unicode.h"
#include "check.h"

#define VECTORS_DIR "test/data/tokenizer"
enum { MAX_TEXTS = 64 };

typedef struct {
    char *data;
    size_t len;
} Buffer;

static Buffer read_all(const char *path) {
    Buffer b = {NULL, 0};
    FILE *f = fopen(path, "rb");
    if (!f) return b;
    size_t capacity = 1 << 16;
    b.data = (char *)malloc(capacity + 1);
    while (b.data) {
        b.len += fread(b.data + b.len, 1, capacity - b.len, f);
        if (b.len < capacity) break;
        capacity *= 2;
        char *grown = (char *)realloc(b.data, capacity + 1);
        if (!grown) { free(b.data); b.data = NULL; b.len = 0; }
        else b.data = grown;
    }
    fclose(f);
    if (b.data) b.data[b.len] = '\0';
    return b;
}

static uint32_t *parse_ids(const char *text, size_t *count) {
    size_t capacity = 1024;
    uint32_t *ids = (uint32_t *)malloc(capacity * sizeof(uint32_t));
    *count = 0;
    for (const char *p = text; ids;) {
        while (*p == ' ' || *p == '\n') p++;
        if (*p < '0' || *p > '9') break;
        char *end;
        unsigned long id = strtoul(p, &end, 10);
        if (*count == capacity) {
            capacity *= 2;
            uint32_t *grown = (uint32_t *)realloc(ids, capacity * sizeof(uint32_t));
            if (!grown) { free(ids); return NULL; }
            ids = grown;
        }
        ids[(*count)++] = (uint32_t)id;
        p = end;
    }
    return ids;
}

static int compare_names(const void *a, const void *b) { return strcmp((const char *)a, (const char *)b); }

// The test texts: every VECTORS_DIR/<name>.txt, sorted.
static int list_texts(char names[][128]) {
    DIR *dir = opendir(VECTORS_DIR);
    if (!dir) return 0;
    int n = 0;
    struct dirent *entry;
    while ((entry = readdir(dir)) && n < MAX_TEXTS) {
        size_t len = strlen(entry->d_name);
        if (len > 4 && len < 128 && strcmp(entry->d_name + len - 4, ".txt") == 0) {
            memcpy(names[n], entry->d_name, len - 4);
            names[n++][len - 4] = '\0';
        }
    }
    closedir(dir);
    qsort(names, (size_t)n, 128, compare_names);
    return n;
}

static int contains(const Buffer *text, const char *needle) {
    size_t n = strlen(needle);
    for (size_t i = 0; i + n <= text->len; i++) {
        if (memcmp(text->data + i, needle, n) == 0) return 1;
    }
    return 0;
}

// Llama 2 re-adds a space after each special token and decodes "▁" as a space (HF does too),
// so texts holding those do not round-trip with it.
static int round_trips(const char *name, const Buffer *text) {
    return strcmp(name, "llama2") != 0 ||
           !(contains(text, "<s>") || contains(text, "</s>") || contains(text, "<unk>") || contains(text, "\xE2\x96\x81"));
}

// Compares ids with the expected ones; returns the first differing index or -1.
static long first_difference(const uint32_t *got, size_t got_count, const uint32_t *expected, size_t expected_count) {
    size_t n = got_count < expected_count ? got_count : expected_count;
    for (size_t i = 0; i < n; i++) {
        if (got[i] != expected[i]) return (long)i;
    }
    return got_count == expected_count ? -1 : (long)n;
}

static void check_ids(const char *what, const uint32_t *got, size_t got_count, const uint32_t *expected, size_t expected_count) {
    long i = first_difference(got, got_count, expected, expected_count);
    if (i < 0) {
        check(1, "%s: %zu ids equal HF's", what, expected_count);
        return;
    }
    check(0, "%s: ids differ at %ld (expected %zu ids, got %zu): expected %ld got %ld", what, i, expected_count, got_count,
          (size_t)i < expected_count ? (long)expected[i] : -1L, (size_t)i < got_count ? (long)got[i] : -1L);
}

static void test_vectors(const Tokenizer *tok, const char *name, char texts[][128], int text_count) {
    for (int t = 0; t < text_count; t++) {
        char path[512], what[256];
        snprintf(path, sizeof(path), VECTORS_DIR "/%s.txt", texts[t]);
        Buffer text = read_all(path);
        snprintf(path, sizeof(path), VECTORS_DIR "/%s.%s.ids", texts[t], name);
        Buffer expected_text = read_all(path);
        snprintf(what, sizeof(what), "%s %s", name, texts[t]);
        if (!text.data || !expected_text.data) {
            check(0, "%s: missing %s (make it with scripts/tokenizer_vectors.py)", what, path);
            free(text.data);
            free(expected_text.data);
            continue;
        }
        size_t expected_count;
        uint32_t *expected = parse_ids(expected_text.data, &expected_count);
        uint32_t *ids = NULL;
        size_t count = 0, capacity = 0;
        int rc = tokenizer_encode(tok, text.data, text.len, &ids, &count, &capacity);
        check(rc == 0, "%s: encode returns 0 (got %d)", what, rc);
        check_ids(what, ids, count, expected, expected_count);

        // Round trip: decode gives the text back, with invalid UTF-8 replaced by U+FFFD.
        if (round_trips(name, &text)) {
            unsigned char *replaced = (unsigned char *)malloc(3 * text.len + 1);
            size_t replaced_len = utf8_replace_invalid((const unsigned char *)text.data, text.len, replaced);
            size_t decoded_len;
            char *decoded = tokenizer_decode(tok, ids, count, &decoded_len);
            size_t at = 0;
            while (at < decoded_len && at < replaced_len && decoded[at] == (char)replaced[at]) at++;
            check(decoded_len == replaced_len && at == replaced_len,
                  "%s: decode(encode(text)) is the text (expected %zu bytes, got %zu, first difference at byte %zu)", what,
                  replaced_len, decoded_len, at);
            free(decoded);
            free(replaced);
        }
        free(ids);
        free(expected);
        free(text.data);
        free(expected_text.data);
    }
}

static int hex_byte(const char *s) {
    unsigned value;
    return sscanf(s, "%2x", &value) == 1 ? (int)value : -1;
}

// Each line: ids, a tab, HF's decode as hex bytes.
static void test_decode_cases(const Tokenizer *tok, const char *name) {
    char path[256];
    snprintf(path, sizeof(path), VECTORS_DIR "/decode_cases.%s.tsv", name);
    Buffer cases = read_all(path);
    if (!cases.data) { check(0, "%s: missing %s", name, path); return; }
    int lines = 0, failures = 0;
    char *save = NULL;
    for (char *line = strtok_r(cases.data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char *tab = strchr(line, '\t');
        if (!tab) continue;
        *tab = '\0';
        size_t count, out_len;
        uint32_t *ids = parse_ids(line, &count);
        char *out = tokenizer_decode(tok, ids, count, &out_len);
        const char *hex = tab + 1;
        size_t expected_len = strlen(hex) / 2;
        int same = out_len == expected_len;
        for (size_t i = 0; same && i < expected_len; i++) same = hex_byte(hex + 2 * i) == (unsigned char)out[i];
        if (!same && failures++ == 0) printf("  first failing decode case: ids %s expected %s\n", line, hex);
        lines++;
        free(out);
        free(ids);
    }
    check(lines > 0 && failures == 0, "%s: decode equals HF's decode on %d random id sequences (%d differ)", name, lines,
          failures);
    free(cases.data);
}

static void test_unicode_classes(void) {
    Buffer ranges = read_all(VECTORS_DIR "/hf_unicode_classes.ranges");
    if (!ranges.data) { check(0, "missing " VECTORS_DIR "/hf_unicode_classes.ranges"); return; }
    long checked = 0, wrong = 0, first_wrong = -1;
    char *save = NULL;
    for (char *line = strtok_r(ranges.data, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        unsigned first, last;
        char cls;
        if (line[0] == '#' || sscanf(line, "%x %x %c", &first, &last, &cls) != 3) continue;
        unsigned expected = cls == 'L' ? UNICODE_LETTER : cls == 'N' ? UNICODE_NUMBER : cls == 'S' ? UNICODE_SPACE : 0;
        for (unsigned cp = first; cp <= last; cp++) {
            if (cp >= 0xD800 && cp <= 0xDFFF) continue;
            checked++;
            if (unicode_class(cp) != expected && wrong++ == 0) first_wrong = cp;
        }
    }
    check(checked == 0x110000 - 0x800 && wrong == 0,
          "Unicode %s tables classify all %ld code points as HF's regex does (%ld differ, first U+%04lX)",
          unicode_tables_version, checked, wrong, first_wrong < 0 ? 0 : first_wrong);
    free(ranges.data);
}

typedef struct {
    const Tokenizer *tok;
    char (*texts)[128];
    int text_count, thread, mismatches;
} ThreadJob;

static void *encode_all(void *arg) {
    ThreadJob *job = (ThreadJob *)arg;
    for (int k = 0; k < job->text_count; k++) {
        int t = (k + job->thread) % job->text_count; // each thread in its own order
        char path[512];
        snprintf(path, sizeof(path), VECTORS_DIR "/%s.txt", job->texts[t]);
        Buffer text = read_all(path);
        snprintf(path, sizeof(path), VECTORS_DIR "/%s.llama3.ids", job->texts[t]);
        Buffer expected_text = read_all(path);
        size_t expected_count = 0, count = 0, capacity = 0;
        uint32_t *expected = expected_text.data ? parse_ids(expected_text.data, &expected_count) : NULL;
        uint32_t *ids = NULL;
        if (!text.data || !expected || tokenizer_encode(job->tok, text.data, text.len, &ids, &count, &capacity) ||
            first_difference(ids, count, expected, expected_count) >= 0)
            job->mismatches++;
        free(ids);
        free(expected);
        free(text.data);
        free(expected_text.data);
    }
    return NULL;
}

static void test_threads(const Tokenizer *tok, char texts[][128], int text_count) {
    enum { THREADS = 4 };
    pthread_t threads[THREADS];
    ThreadJob jobs[THREADS];
    int started = 0;
    for (int i = 0; i < THREADS; i++) {
        jobs[i] = (ThreadJob){tok, texts, text_count, i, 0};
        if (pthread_create(&threads[i], NULL, encode_all, &jobs[i]) == 0) started++;
    }
    int mismatches = 0;
    for (int i = 0; i < started; i++) {
        pthread_join(threads[i], NULL);
        mismatches += jobs[i].mismatches;
    }
    check(started == THREADS && mismatches == 0, "%d threads encoding on one Tokenizer match the vectors (%d mismatches)",
          started, mismatches);
}

static void test_small_cases(const Tokenizer *llama3) {
    uint32_t *ids = NULL, *replacement_ids = NULL;
    size_t count = 0, capacity = 0, replacement_count = 0, replacement_capacity = 0;
    check(tokenizer_encode(llama3, "", 0, &ids, &count, &capacity) == 0 && count == 0, "empty text gives no ids (got %zu)",
          count);
    tokenizer_encode(llama3, "a\xFF" "b", 3, &ids, &count, &capacity);
    tokenizer_encode(llama3, "a\xEF\xBF\xBD" "b", 5, &replacement_ids, &replacement_count, &replacement_capacity);
    check(count == replacement_count && memcmp(ids, replacement_ids, count * sizeof(uint32_t)) == 0,
          "an invalid byte encodes as U+FFFD (%zu vs %zu ids)", count, replacement_count);
    count = 0;
    tokenizer_encode(llama3, "<|begin_of_text|>", 17, &ids, &count, &capacity);
    check(count == 1 && ids[0] == 128000, "\"<|begin_of_text|>\" in text is the special id 128000 (got %zu ids, first %u)",
          count, count ? ids[0] : 0);
    free(ids);
    free(replacement_ids);
}

static void test_json(void) {
    const char *text = "{\"a\": \"\\u00e9\\ud83d\\ude00\\u0000x\\n\", \"b\": [1, -2.5e3, true, false, null, {}, []]}";
    char error[256];
    JsonDocument *doc = json_parse(text, strlen(text), error, sizeof(error));
    check(doc != NULL, "json: parses an object with escapes and nested values");
    if (!doc) return;
    const JsonValue *a = json_get(json_root(doc), "a"), *b = json_get(json_root(doc), "b");
    check(a && a->type == JSON_STRING && a->count == 9 && memcmp(a->string, "\xC3\xA9\xF0\x9F\x98\x80\0x\n", 9) == 0,
          "json: \\u escapes, a surrogate pair and \\u0000 decode to UTF-8 (length %zu)", a ? a->count : 0);
    check(b && b->type == JSON_ARRAY && b->count == 7 && b->items[1].number == -2500.0 && b->items[2].type == JSON_TRUE &&
              b->items[5].type == JSON_OBJECT && b->items[6].type == JSON_ARRAY,
          "json: array of numbers, literals, empty object and array");
    json_free(doc);
    // Every escape JSON has, each to its one byte; a lone surrogate becomes U+FFFD.
    const char *escapes = "[\"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u0041 \\ud800!\"]";
    doc = json_parse(escapes, strlen(escapes), error, sizeof(error));
    const JsonValue *e = doc ? &json_root(doc)->items[0] : NULL;
    const char expected[] = "\" \\ / \b \f \n \r \t A \xEF\xBF\xBD!";
    check(e && e->type == JSON_STRING && e->count == sizeof(expected) - 1 && memcmp(e->string, expected, e->count) == 0,
          "json: \\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u0041 and a lone surrogate decode exactly (%s)",
          doc ? "parsed" : error);
    json_free(doc);
    doc = json_parse("\"\\u12\"", 6, error, sizeof(error));
    check(!doc && strstr(error, "truncated \\u escape"), "json: a \\u escape cut to 3 characters is truncated (%s)", error);
    json_free(doc);
    static const char *const bad[] = {"{\"a\": }", "[1, 2", "{\"a\" 1}", "\"abc", "[01]", "{} x", "[\"\\q\"]", ""};
    int rejected = 0;
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        JsonDocument *d = json_parse(bad[i], strlen(bad[i]), error, sizeof(error));
        if (!d && strncmp(error, "line 1 column", 13) == 0) rejected++;
        json_free(d);
    }
    check(rejected == (int)(sizeof(bad) / sizeof(bad[0])), "json: %d of %zu malformed inputs rejected with line and column",
          rejected, sizeof(bad) / sizeof(bad[0]));
}

// Writes a readable form of a parsed value into out (for comparing two parses).
static void describe_json(const JsonValue *v, char *out, size_t size) {
    size_t used = strlen(out);
    if (used + 64 >= size) return;
    char *at = out + used;
    switch (v->type) {
    case JSON_NULL: snprintf(at, size - used, "null "); break;
    case JSON_FALSE: snprintf(at, size - used, "false "); break;
    case JSON_TRUE: snprintf(at, size - used, "true "); break;
    case JSON_NUMBER: snprintf(at, size - used, "%.17g ", v->number); break;
    case JSON_STRING: snprintf(at, size - used, "\"%.*s\" ", (int)v->count, v->string); break;
    case JSON_ARRAY:
    case JSON_OBJECT:
        snprintf(at, size - used, "%c", v->type == JSON_ARRAY ? '[' : '{');
        for (size_t i = 0; i < v->count; i++) {
            if (v->type == JSON_OBJECT) {
                used = strlen(out);
                snprintf(out + used, size - used, "%.*s:", (int)v->members[i].key_len, v->members[i].key);
            }
            describe_json(v->type == JSON_ARRAY ? &v->items[i] : &v->members[i].value, out, size);
        }
        used = strlen(out);
        snprintf(out + used, size - used, "%c", v->type == JSON_ARRAY ? ']' : '}');
        break;
    }
}

// The outcome of json_parse(text, len): the value described, or "error: ..." with its message.
static void parse_outcome(const char *text, size_t len, char *out, size_t size) {
    char error[256];
    JsonDocument *doc = json_parse(text, len, error, sizeof(error));
    out[0] = '\0';
    if (doc) describe_json(json_root(doc), out, size);
    else snprintf(out, size, "error: %s", error);
    json_free(doc);
}

// Parses text and compares the one string it holds with expected[0..expected_len).
static int parses_to_string(const char *text, const char *expected, size_t expected_len) {
    char error[256];
    JsonDocument *doc = json_parse(text, strlen(text), error, sizeof(error));
    const JsonValue *v = doc ? json_root(doc) : NULL;
    int same = v && v->type == JSON_STRING && v->count == expected_len && memcmp(v->string, expected, expected_len) == 0;
    json_free(doc);
    return same;
}

// The reader's edges: every hex digit case, the UTF-8 length boundaries, surrogates, exact error
// positions, literals and numbers at the end of the input, the nesting limit, and input that is
// only the first len bytes of a buffer (tokenizer_load passes a buffer with no NUL after it).
static void test_json_edges(void) {
    char error[256];
    // U+007F/0080, 07FF/0800 and FFFF/10000 are where UTF-8 takes one more byte; U+10FFFF is the
    // last code point; 'a' 'f' 'A' 'F' '9' are the ends of the hex digit ranges.
    const char *edges = "\"\\u007f\\u0080\\u07ff\\u0800\\u20ac\\uffff\\ud800\\udc00\\udbff\\udfff\\u00aF\\u00fA\\u0039\"";
    const char edges_utf8[] = "\x7f" "\xC2\x80" "\xDF\xBF" "\xE0\xA0\x80" "\xE2\x82\xAC" "\xEF\xBF\xBF" "\xF0\x90\x80\x80"
                              "\xF4\x8F\xBF\xBF" "\xC2\xAF" "\xC3\xBA" "9";
    check(parses_to_string(edges, edges_utf8, sizeof(edges_utf8) - 1),
          "json: \\u escapes at the UTF-8 length edges, U+10000 and U+10FFFF as pairs, hex digits a f A F 9 decode exactly");
    // Lone low surrogates at both ends of the range, and a high one followed by an escape that is
    // no low surrogate: each U+FFFD, the next escape kept.
    const char lone_utf8[] = "\xEF\xBF\xBD" "\xEF\xBF\xBD" "\xEF\xBF\xBD" "A";
    check(parses_to_string("\"\\udc00\\udfff\\ud800\\u0041\"", lone_utf8, sizeof(lone_utf8) - 1),
          "json: lone surrogates \\udc00 \\udfff and \\ud800 before \\u0041 become U+FFFD, the A kept");
    // The characters just outside each hex digit range.
    static const char not_hex[] = {'/', ':', '@', 'G', '`', 'g'};
    int refused = 0;
    for (size_t i = 0; i < sizeof(not_hex); i++) {
        char text[16];
        snprintf(text, sizeof(text), "\"\\u00%c0\"", not_hex[i]);
        JsonDocument *doc = json_parse(text, strlen(text), error, sizeof(error));
        refused += !doc && strstr(error, "bad hex digit in \\u escape") != NULL;
        json_free(doc);
    }
    check(refused == (int)sizeof(not_hex), "json: / : @ G ` g are no hex digits (%d of %zu refused)", refused, sizeof(not_hex));
    JsonDocument *doc = json_parse("\"\\u123\"", 7, error, sizeof(error));
    check(!doc && strstr(error, "bad hex digit in \\u escape"),
          "json: \\u123 before the closing quote has a bad 4th digit, not a truncation (%s)", doc ? "parsed" : error);
    json_free(doc);

    // Positions count from line 1, column 1, up to the offending character.
    const char *misplaced = "{\n  \"a\": 1,\n  \"b\" 2\n}";
    doc = json_parse(misplaced, strlen(misplaced), error, sizeof(error));
    check(!doc && strcmp(error, "line 3 column 7: expected ':'") == 0, "json: a missing ':' is at line 3 column 7 (%s)",
          doc ? "parsed" : error);
    json_free(doc);
    doc = json_parse("\"abc", 4, error, sizeof(error));
    check(!doc && strcmp(error, "line 1 column 5: unterminated string") == 0,
          "json: a string cut at the end of the input is unterminated at column 5 (%s)", doc ? "parsed" : error);
    json_free(doc);

    static const char *const literals[] = {"true", "false", "null"};
    int literals_read = 0;
    for (int i = 0; i < 3; i++) {
        doc = json_parse(literals[i], strlen(literals[i]), error, sizeof(error));
        literals_read += doc != NULL && (int)json_root(doc)->type == (i == 0 ? JSON_TRUE : i == 1 ? JSON_FALSE : JSON_NULL);
        json_free(doc);
    }
    check(literals_read == 3, "json: true, false and null as the whole input (%d of 3 read)", literals_read);

    // Numbers are copied into a 64-byte buffer: 63 characters fit, 64 are too long.
    char number[80];
    memset(number, '7', sizeof(number));
    doc = json_parse(number, 63, error, sizeof(error));
    check(doc && json_root(doc)->type == JSON_NUMBER && json_root(doc)->number > 7.7e62,
          "json: a number of 63 digits is read (%s)", doc ? "ok" : error);
    json_free(doc);
    doc = json_parse(number, 64, error, sizeof(error));
    check(!doc && strstr(error, "number too long"), "json: a number of 64 digits is too long (%s)", doc ? "parsed" : error);
    json_free(doc);

    // Containers nest at most 256 deep.
    enum { MAX_DEPTH = 256 };
    char nested[2 * (MAX_DEPTH + 1)];
    for (int depth = MAX_DEPTH; depth <= MAX_DEPTH + 1; depth++) {
        for (int i = 0; i < depth; i++) {
            nested[i] = '[';
            nested[depth + i] = ']';
        }
        doc = json_parse(nested, 2 * (size_t)depth, error, sizeof(error));
        int ok = depth == MAX_DEPTH ? doc != NULL : !doc && strstr(error, "nesting too deep") != NULL;
        check(ok, "json: arrays nested %d deep are %s (%s)", depth, depth == MAX_DEPTH ? "read" : "refused",
              doc ? "parsed" : error);
        json_free(doc);
    }

    // Strings are NUL-terminated in place, also one of 16 bytes that fills its arena slot.
    doc = json_parse("[\"0123456789abcdef\", \"x\"]", 25, error, sizeof(error));
    const JsonValue *strings = doc ? json_root(doc) : NULL;
    check(strings && strings->items[0].count == 16 && strings->items[0].string[16] == '\0' &&
              strcmp(strings->items[1].string, "x") == 0,
          "json: a 16-byte string keeps its NUL after the next string is stored (%s)", doc ? "parsed" : error);
    json_free(doc);

    doc = json_parse("[{}, {\"a\": 1}]", 14, error, sizeof(error));
    const JsonValue *objects = doc ? json_root(doc) : NULL;
    check(objects && json_get(&objects->items[0], "a") == NULL && json_get(&objects->items[1], "b") == NULL &&
              json_get(&objects->items[1], "a") != NULL,
          "json: json_get finds no key in {} nor a missing key, and finds a present one");
    json_free(doc);

    // Every prefix of a buffer parses as that prefix alone (NUL-terminated copy): the reader
    // looks at nothing past len, so the digit, quote or bracket that follows cannot change it.
    static const char *const documents[] = {
        "{\"a\": [1, -2.5e+3, 0.5E-2, true, false, null, {}, []], \"b\": {\"c\": \"x\\\"y\\u00e9\"}}", "-12.5e+37", "123 ",
        "[\"\\ud83d\\ude00\", 10]", "0.125"};
    int prefixes = 0, differ = 0;
    char first_difference[512] = "";
    for (size_t d = 0; d < sizeof(documents) / sizeof(documents[0]); d++) {
        size_t len = strlen(documents[d]);
        for (size_t k = 0; k <= len; k++) {
            char *alone = (char *)malloc(k + 1);
            memcpy(alone, documents[d], k);
            alone[k] = '\0';
            char in_buffer[512], by_itself[512];
            parse_outcome(documents[d], k, in_buffer, sizeof(in_buffer));
            parse_outcome(alone, k, by_itself, sizeof(by_itself));
            free(alone);
            prefixes++;
            if (strcmp(in_buffer, by_itself) != 0 && differ++ == 0)
                snprintf(first_difference, sizeof(first_difference), "; first: \"%.*s\" gave %s, alone %s", (int)k,
                         documents[d], in_buffer, by_itself);
        }
    }
    check(differ == 0, "json: %d prefixes of 5 documents parse as they do alone (%d differ%s)", prefixes, differ,
          first_difference);
}

// Writes contents to a temporary file and loads it; checks the error names the path and
// contains the expected words.
static void expect_load_error(const char *what, const char *contents, size_t len, const char *expected) {
    char path[] = "/tmp/test_tokenizer_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0 || write(fd, contents, len) != (ssize_t)len) { check(0, "%s: cannot write %s", what, path); return; }
    close(fd);
    char error[512] = "";
    Tokenizer *tok = tokenizer_load(path, error, sizeof(error));
    check(!tok && strncmp(error, path, strlen(path)) == 0 && strstr(error, expected),
          "%s: load fails with \"%s\" (got \"%s\")", what, expected, error);
    tokenizer_free(tok);
    unlink(path);
}

static void test_bad_files(const char *llama2_path) {
    char error[512] = "";
    Tokenizer *tok = tokenizer_load("test/no/such/tokenizer.json", error, sizeof(error));
    check(!tok && strcmp(error, "test/no/such/tokenizer.json: cannot open: No such file or directory") == 0,
          "missing file: \"%s\"", error);
    Buffer real = read_all(llama2_path);
    if (real.data) {
        expect_load_error("truncated tokenizer.json", real.data, real.len / 2, "invalid JSON: line");
        free(real.data);
    }
    expect_load_error("empty file", "", 0, "invalid JSON: line 1 column 1: unexpected end of input");
    expect_load_error("top level array", "[1, 2]", 6, "not a tokenizer.json");
    expect_load_error("no model", "{\"added_tokens\": []}", 20, "unsupported: decoder null");
    const char *decoder = "\"decoder\": {\"type\": \"ByteLevel\"}";
    char json[1024];
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"WordPiece\", \"vocab\": {}}}", decoder);
    expect_load_error("WordPiece model", json, strlen(json), "unsupported: model WordPiece");
    snprintf(json, sizeof(json), "{%s, \"pre_tokenizer\": {\"type\": \"Whitespace\"}, \"model\": {\"type\": \"BPE\"}}", decoder);
    expect_load_error("Whitespace pre-tokenizer", json, strlen(json), "unsupported: pre_tokenizer Whitespace");
    snprintf(json, sizeof(json),
             "{%s, \"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
             "{\"Regex\": \"\\\\w+\"}, \"behavior\": \"Isolated\"}, {\"type\": \"ByteLevel\", \"use_regex\": false}]}}",
             decoder);
    expect_load_error("other Split regex", json, strlen(json), "unsupported: pre_tokenizer Split pattern");
    snprintf(json, sizeof(json), "{%s, \"normalizer\": {\"type\": \"NFKC\"}}", decoder);
    expect_load_error("NFKC normalizer", json, strlen(json), "unsupported: normalizer NFKC");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"a b\"]}}", decoder);
    expect_load_error("merge of an unknown token", json, strlen(json), "merge 0 uses a token that is not in the vocab");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": \"x\"}, \"merges\": []}}", decoder);
    expect_load_error("non-numeric id", json, strlen(json), "model vocab: id of token 0 is not an integer");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"dropout\": 0.1, \"vocab\": {}, \"merges\": []}}",
             decoder);
    expect_load_error("BPE dropout", json, strlen(json), "unsupported: BPE dropout");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [1]}}", decoder);
    expect_load_error("a merge that is a number", json, strlen(json), "merge 0 is neither \"a b\" nor [\"a\", \"b\"]");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a b \"]}}",
             decoder);
    expect_load_error("a merge with a second space", json, strlen(json), "merge 0 is not two tokens separated by one space");
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0, \"b\": 1, \"ab\": 2}, \"merges\": [\"a  b\"]}}",
             decoder);
    expect_load_error("a merge with two spaces in a row", json, strlen(json), "merge 0 is not two tokens separated by one space");
    // Vocab tokens and merge halves are at most 4096 bytes.
    enum { LONGEST = 4096 };
    char *long_json = (char *)malloc(2 * LONGEST + 512), *token = (char *)malloc(LONGEST + 2);
    memset(token, 'x', LONGEST + 1);
    token[LONGEST + 1] = '\0';
    snprintf(long_json, 2 * LONGEST + 512, "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"%s\": 0}, \"merges\": []}}", decoder,
             token);
    expect_load_error("a vocab token of 4097 bytes", long_json, strlen(long_json), "model vocab: token 0 longer than 4096 bytes");
    snprintf(long_json, 2 * LONGEST + 512, "{%s, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [\"%s a\"]}}",
             decoder, token);
    expect_load_error("a merge half of 4097 bytes", long_json, strlen(long_json), "model merges: merge 0 too long");
    free(long_json);
    free(token);
    // A byte order mark before the JSON is skipped: the error is the document's own, not "invalid number".
    snprintf(json, sizeof(json), "\xef\xbb\xbf[1, 2]");
    expect_load_error("UTF-8 BOM", json, strlen(json), "not a tokenizer.json: the top level is not an object");
    real = read_all(llama2_path);  // the first copy was freed above
    if (real.data) {
        char path[] = "/tmp/test_tokenizer_bom_XXXXXX";
        int fd = mkstemp(path);
        int written = fd >= 0 && write(fd, "\xef\xbb\xbf", 3) == 3 && write(fd, real.data, real.len) == (ssize_t)real.len;
        if (fd >= 0) close(fd);
        Tokenizer *bom = written ? tokenizer_load(path, error, sizeof(error)) : NULL;
        check(bom != NULL, "the Llama 2 tokenizer.json behind a UTF-8 BOM loads (%s)", bom ? "ok" : error);
        tokenizer_free(bom);
        unlink(path);
        free(real.data);
    }
    snprintf(json, sizeof(json), "{%s, \"model\": {\"type\": \"BPE\", \"unk_token\": \"a\", \"vocab\": {\"a\": 0, \"b\": 3}, \"merges\": []}}",
             decoder);
    char gap_path[] = "/tmp/test_tokenizer_gap_XXXXXX";
    int gap_fd = mkstemp(gap_path);
    if (gap_fd >= 0 && write(gap_fd, json, strlen(json)) == (ssize_t)strlen(json)) {
        close(gap_fd);
        Tokenizer *gap = tokenizer_load(gap_path, error, sizeof(error));
        int first = 0, missing = gap ? tokenizer_missing_ids(gap, &first) : -1;
        check(missing == 2 && first == 1, "ids 1 and 2 without a token are counted as a gap (%d missing, first %d; %s)", missing,
              first, gap ? "loaded" : error);
        tokenizer_free(gap);
    }
    unlink(gap_path);
    tok = tokenizer_load("/dev/zero", error, sizeof(error));
    check(!tok && strstr(error, "/dev/zero: not a regular file"), "/dev/zero as a tokenizer is refused at once: \"%s\"", error);
    tok = tokenizer_load("test", error, sizeof(error));
    check(!tok && strstr(error, "test: not a regular file (a directory)"), "a directory as a tokenizer: \"%s\"", error);
}

// Encodes text and compares the ids with expected[0..n).
static int encodes_to(const Tokenizer *tok, const char *text, const uint32_t *expected, size_t n) {
    uint32_t *ids = NULL;
    size_t count = 0, capacity = 0;
    int same = tokenizer_encode(tok, text, strlen(text), &ids, &count, &capacity) == 0 && count == n &&
               memcmp(ids, expected, n * sizeof(uint32_t)) == 0;
    free(ids);
    return same;
}

// Decodes ids[0..n) and compares the text with expected.
static int decodes_to(const Tokenizer *tok, const uint32_t *ids, size_t n, const char *expected) {
    size_t len;
    char *text = tokenizer_decode(tok, ids, n, &len);
    int same = text && len == strlen(expected) && memcmp(text, expected, len) == 0;
    free(text);
    return same;
}

// A small character-level tokenizer (no pre-tokenizer, no byte fallback in the model): letters
// a..q are ids 0..16, merge i joins letters i and i+1 into id 17 + i (16 merges: a power of two,
// the most a merge table of 32 slots takes at half full), " " 33, byte tokens <0xC3> 34 and
// <0xaf> 35 (lowercase hex), <unk> 36; added tokens <x>, <x>y, <x>yz (37..39, shortest first in
// the file); decoder ByteFallback, Fuse, Strip of one trailing space.
static void test_small_tokenizer(void) {
    enum { LETTERS = 17, MERGES = LETTERS - 1, SPACE = 33, BYTE_C3 = 34, BYTE_AF = 35, UNK = 36, ADDED = 37 };
    char json[8192], vocab[4096] = "", merges[2048] = "";
    for (int i = 0; i < LETTERS; i++) {
        size_t used = strlen(vocab);
        snprintf(vocab + used, sizeof(vocab) - used, "\"%c\": %d, ", 'a' + i, i);
    }
    for (int i = 0; i < MERGES; i++) {
        size_t used = strlen(vocab);
        snprintf(vocab + used, sizeof(vocab) - used, "\"%c%c\": %d, ", 'a' + i, 'b' + i, LETTERS + i);
        used = strlen(merges);
        snprintf(merges + used, sizeof(merges) - used, "%s\"%c %c\"", i ? ", " : "", 'a' + i, 'b' + i);
    }
    snprintf(json, sizeof(json),
             "{\"decoder\": {\"type\": \"Sequence\", \"decoders\": [{\"type\": \"ByteFallback\"}, {\"type\": \"Fuse\"}, "
             "{\"type\": \"Strip\", \"content\": \" \", \"start\": 0, \"stop\": 1}]}, "
             "\"model\": {\"type\": \"BPE\", \"unk_token\": \"<unk>\", \"vocab\": {%s\" \": %d, \"<0xC3>\": %d, "
             "\"<0xaf>\": %d, \"<unk>\": %d}, \"merges\": [%s]}, "
             "\"added_tokens\": [{\"id\": %d, \"content\": \"<x>\"}, {\"id\": %d, \"content\": \"<x>y\"}, "
             "{\"id\": %d, \"content\": \"<x>yz\"}]}",
             vocab, SPACE, BYTE_C3, BYTE_AF, UNK, merges, ADDED, ADDED + 1, ADDED + 2);
    char path[] = "/tmp/test_tokenizer_small_XXXXXX";
    int fd = mkstemp(path);
    int written = fd >= 0 && write(fd, json, strlen(json)) == (ssize_t)strlen(json);
    if (fd >= 0) close(fd);
    char error[512] = "";
    Tokenizer *tok = written ? tokenizer_load(path, error, sizeof(error)) : NULL;
    unlink(path);
    check(tok != NULL, "small tokenizer: loads, Strip with start 0 included (%s)", tok ? "ok" : error);
    if (!tok) return;
    const uint32_t ab_c[] = {LETTERS + 0, 2}, q_a[] = {16, 0}, unknown[] = {UNK, UNK};
    check(encodes_to(tok, "abc", ab_c, 2), "small tokenizer: \"abc\" is the merge of a b (rank 0) and c");
    check(encodes_to(tok, "qa", q_a, 2), "small tokenizer: \"qa\", a pair no merge joins, is its two letters");
    check(encodes_to(tok, "zz", unknown, 2), "small tokenizer: characters outside the vocab are <unk> each (no fuse_unk)");
    const uint32_t longest[] = {ADDED + 2}, middle[] = {ADDED + 1}, shortest[] = {ADDED, 0};
    check(encodes_to(tok, "<x>yz", longest, 1) && encodes_to(tok, "<x>y", middle, 1) && encodes_to(tok, "<x>a", shortest, 2),
          "small tokenizer: the longest added token at a position wins (<x>yz, <x>y, then <x> before a)");
    const uint32_t i_diaeresis[] = {BYTE_C3, BYTE_AF}, b_space[] = {1, SPACE}, space[] = {SPACE}, spaces[] = {SPACE, SPACE};
    check(decodes_to(tok, i_diaeresis, 2, "\xC3\xAF"), "small tokenizer: <0xC3> <0xaf> (lowercase hex) decode to the byte pair of U+00EF");
    check(decodes_to(tok, b_space, 2, "b") && decodes_to(tok, space, 1, "") && decodes_to(tok, spaces, 2, " "),
          "small tokenizer: Strip stop 1 removes one trailing space: \"b \" -> \"b\", \" \" -> \"\", \"  \" -> \" \"");
    tokenizer_free(tok);
}

int main(void) {
    const char *llama3_path = "data/tokenizers/llama3/tokenizer.json";
    const char *llama2_path = "data/tokenizers/llama2/tokenizer.json";
    char error[512];
    Tokenizer *llama3 = tokenizer_load(llama3_path, error, sizeof(error));
    check(llama3 != NULL, "load %s%s%s", llama3_path, llama3 ? "" : ": ", llama3 ? "" : error);
    Tokenizer *llama2 = tokenizer_load(llama2_path, error, sizeof(error));
    check(llama2 != NULL, "load %s%s%s", llama2_path, llama2 ? "" : ": ", llama2 ? "" : error);
    if (!llama3 || !llama2) {
        printf("the tokenizer files are missing: run scripts/fetch_tokenizers.sh first\n");
        tokenizer_free(llama3);
        tokenizer_free(llama2);
        return check_summary("test_tokenizer");
    }
    check(tokenizer_vocab_size(llama3) == 128256 && tokenizer_bos_id(llama3) == 128000 && tokenizer_eos_id(llama3) == 128001,
          "llama3: vocab 128256, BOS 128000, EOS 128001 (got %d, %d, %d)", tokenizer_vocab_size(llama3),
          tokenizer_bos_id(llama3), tokenizer_eos_id(llama3));
    check(tokenizer_vocab_size(llama2) == 32000 && tokenizer_bos_id(llama2) == 1 && tokenizer_eos_id(llama2) == 2,
          "llama2: vocab 32000, BOS 1, EOS 2 (got %d, %d, %d)", tokenizer_vocab_size(llama2), tokenizer_bos_id(llama2),
          tokenizer_eos_id(llama2));
    int first3, first2, missing3 = tokenizer_missing_ids(llama3, &first3), missing2 = tokenizer_missing_ids(llama2, &first2);
    check(missing3 == 0 && missing2 == 0 && first3 == -1 && first2 == -1,
          "llama3 and llama2 have a token for every id (missing %d and %d)", missing3, missing2);

    static char texts[MAX_TEXTS][128];
    int text_count = list_texts(texts);
    check(text_count >= 10, "found %d test texts in " VECTORS_DIR, text_count);
    test_vectors(llama3, "llama3", texts, text_count);
    test_vectors(llama2, "llama2", texts, text_count);
    test_decode_cases(llama3, "llama3");
    test_decode_cases(llama2, "llama2");
    test_unicode_classes();
    test_threads(llama3, texts, text_count);
    test_small_cases(llama3);
    test_json();
    test_json_edges();
    test_bad_files(llama2_path);
    test_small_tokenizer();
    tokenizer_free(llama3);
    tokenizer_free(llama2);
    return check_summary("test_tokenizer");
}
