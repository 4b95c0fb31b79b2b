// Recursive-descent JSON reader (RFC 8259) into an arena; see json.h.
// Children of an array or object are collected on one shared stack and copied into the arena
// when the container closes, so every container's items are contiguous and allocation is
// a bump of a pointer.
#include "json.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { JSON_MAX_DEPTH = 256, ARENA_BLOCK_BYTES = 1 << 20, NUMBER_MAX_CHARS = 64 };

typedef struct ArenaBlock {
    struct ArenaBlock *next;
    size_t used, size;
    _Alignas(max_align_t) unsigned char data[];
} ArenaBlock;

struct JsonDocument {
    ArenaBlock *blocks;
    JsonValue root;
};

typedef struct {
    const char *text;
    size_t len, pos;
    JsonDocument *doc;
    JsonMember *stack; // children of the containers being parsed
    size_t stack_count, stack_capacity;
    char *error;
    size_t error_size;
    int failed;
} Parser;

static void *arena_alloc(Parser *p, size_t bytes) {
    bytes = (bytes + 15) & ~(size_t)15;
    ArenaBlock *block = p->doc->blocks;
    if (!block || block->size - block->used < bytes) {
        size_t size = bytes > ARENA_BLOCK_BYTES ? bytes : ARENA_BLOCK_BYTES;
        block = (ArenaBlock *)malloc(sizeof(ArenaBlock) + size);
        if (!block) return NULL;
        block->next = p->doc->blocks;
        block->used = 0;
        block->size = size;
        p->doc->blocks = block;
    }
    void *out = block->data + block->used;
    block->used += bytes;
    return out;
}

// Records the first error with its line and column; later errors are consequences of it.
static int fail(Parser *p, const char *what) {
    if (p->failed) return 0;
    p->failed = 1;
    size_t line = 1, column = 1;
    for (size_t i = 0; i < p->pos && i < p->len; i++) {
        if (p->text[i] == '\n') { line++; column = 1; } else column++;
    }
    snprintf(p->error, p->error_size, "line %zu column %zu: %s", line, column, what);
    return 0;
}

static void skip_whitespace(Parser *p) {
    while (p->pos < p->len) {
        char c = p->text[p->pos];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
        p->pos++;
    }
}

static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

// Reads the 4 hex digits of a \u escape at p->pos (just after "\u").
static int read_hex4(Parser *p, uint32_t *out) {
    if (p->len - p->pos < 4) return fail(p, "truncated \\u escape");
    uint32_t value = 0;
    for (int i = 0; i < 4; i++) {
        int digit = hex_digit(p->text[p->pos + i]);
        if (digit < 0) return fail(p, "bad hex digit in \\u escape");
        value = value << 4 | (uint32_t)digit;
    }
    p->pos += 4;
    *out = value;
    return 1;
}

static size_t put_utf8(char *out, uint32_t cp) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) { out[0] = (char)(0xC0 | cp >> 6); out[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (char)(0xE0 | cp >> 12);
        out[1] = (char)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (char)(0xF0 | cp >> 18);
    out[1] = (char)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (char)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

// Decodes the escape after a backslash; a lone surrogate becomes U+FFFD as in most readers.
static int decode_escape(Parser *p, char *out, size_t *out_len) {
    if (p->pos >= p->len) return fail(p, "unterminated string");
    char c = p->text[p->pos++];
    switch (c) {
    case '"': case '\\': case '/': out[(*out_len)++] = c; return 1;
    case 'b': out[(*out_len)++] = '\b'; return 1;
    case 'f': out[(*out_len)++] = '\f'; return 1;
    case 'n': out[(*out_len)++] = '\n'; return 1;
    case 'r': out[(*out_len)++] = '\r'; return 1;
    case 't': out[(*out_len)++] = '\t'; return 1;
    case 'u': break;
    default: p->pos--; return fail(p, "unknown escape in string");
    }
    uint32_t cp;
    if (!read_hex4(p, &cp)) return 0;
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        uint32_t low = 0;
        if (p->len - p->pos >= 6 && p->text[p->pos] == '\\' && p->text[p->pos + 1] == 'u') {
            size_t saved = p->pos;
            p->pos += 2;
            if (!read_hex4(p, &low)) return 0;
            if (low >= 0xDC00 && low <= 0xDFFF) cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            else { p->pos = saved; cp = 0xFFFD; }
        } else {
            cp = 0xFFFD;
        }
    } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
        cp = 0xFFFD;
    }
    *out_len += put_utf8(out + *out_len, cp);
    return 1;
}

// Parses a string at p->pos (on the opening quote) into the arena. A first pass finds the
// closing quote, so the copy needs at most the raw length: no escape decodes to more bytes.
static int parse_string(Parser *p, const char **out, size_t *out_len) {
    size_t start = ++p->pos, end = start;
    int has_escape = 0;
    for (;; end++) {
        if (end >= p->len) { p->pos = p->len; return fail(p, "unterminated string"); }
        unsigned char c = (unsigned char)p->text[end];
        if (c == '"') break;
        if (c < 0x20) { p->pos = end; return fail(p, "control character in string"); }
        if (c == '\\') { has_escape = 1; end++; }
    }
    char *s = (char *)arena_alloc(p, end - start + 1);
    if (!s) return fail(p, "out of memory");
    size_t n = 0;
    if (!has_escape) {
        n = end - start;
        memcpy(s, p->text + start, n);
    } else {
        while (p->pos < end) {
            char c = p->text[p->pos++];
            if (c != '\\') s[n++] = c;
            else if (!decode_escape(p, s, &n)) return 0;
        }
    }
    s[n] = '\0';
    *out = s;
    *out_len = n;
    p->pos = end + 1;
    return 1;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }

static int parse_number(Parser *p, JsonValue *out) {
    size_t start = p->pos;
    if (p->pos < p->len && p->text[p->pos] == '-') p->pos++;
    if (p->pos >= p->len || !is_digit(p->text[p->pos])) return fail(p, "invalid number");
    if (p->text[p->pos] == '0') p->pos++;
    else while (p->pos < p->len && is_digit(p->text[p->pos])) p->pos++;
    if (p->pos < p->len && p->text[p->pos] == '.') {
        p->pos++;
        if (p->pos >= p->len || !is_digit(p->text[p->pos])) return fail(p, "invalid number");
        while (p->pos < p->len && is_digit(p->text[p->pos])) p->pos++;
    }
    if (p->pos < p->len && (p->text[p->pos] == 'e' || p->text[p->pos] == 'E')) {
        p->pos++;
        if (p->pos < p->len && (p->text[p->pos] == '+' || p->text[p->pos] == '-')) p->pos++;
        if (p->pos >= p->len || !is_digit(p->text[p->pos])) return fail(p, "invalid number");
        while (p->pos < p->len && is_digit(p->text[p->pos])) p->pos++;
    }
    size_t n = p->pos - start;
    if (n >= NUMBER_MAX_CHARS) return fail(p, "number too long");
    char buffer[NUMBER_MAX_CHARS];
    memcpy(buffer, p->text + start, n);
    buffer[n] = '\0';
    out->type = JSON_NUMBER;
    out->number = strtod(buffer, NULL);
    return 1;
}

static int parse_literal(Parser *p, const char *word, JsonType type, JsonValue *out) {
    size_t n = strlen(word);
    if (p->len - p->pos < n || memcmp(p->text + p->pos, word, n) != 0) return fail(p, "invalid literal");
    p->pos += n;
    out->type = type;
    return 1;
}

static int stack_push(Parser *p, JsonMember **slot) {
    if (p->stack_count == p->stack_capacity) {
        size_t capacity = p->stack_capacity ? 2 * p->stack_capacity : 1024;
        JsonMember *grown = (JsonMember *)realloc(p->stack, capacity * sizeof(JsonMember));
        if (!grown) return fail(p, "out of memory");
        p->stack = grown;
        p->stack_capacity = capacity;
    }
    *slot = &p->stack[p->stack_count++];
    memset(*slot, 0, sizeof(**slot));
    return 1;
}

static int parse_value(Parser *p, JsonValue *out, int depth);

// Parses '[' ... ']' or '{' ... '}' at p->pos; is_object selects which.
static int parse_container(Parser *p, JsonValue *out, int depth, int is_object) {
    if (depth >= JSON_MAX_DEPTH) return fail(p, "nesting too deep");
    char close = is_object ? '}' : ']';
    size_t first = p->stack_count;
    p->pos++;
    skip_whitespace(p);
    if (p->pos < p->len && p->text[p->pos] == close) {
        p->pos++;
    } else {
        for (;;) {
            JsonMember member;
            memset(&member, 0, sizeof(member));
            skip_whitespace(p);
            if (is_object) {
                if (p->pos >= p->len || p->text[p->pos] != '"') return fail(p, "expected a string key");
                if (!parse_string(p, &member.key, &member.key_len)) return 0;
                skip_whitespace(p);
                if (p->pos >= p->len || p->text[p->pos] != ':') return fail(p, "expected ':'");
                p->pos++;
            }
            if (!parse_value(p, &member.value, depth + 1)) return 0;
            JsonMember *slot;
            if (!stack_push(p, &slot)) return 0;
            *slot = member;
            skip_whitespace(p);
            if (p->pos >= p->len) return fail(p, is_object ? "unterminated object" : "unterminated array");
            char c = p->text[p->pos++];
            if (c == close) break;
            if (c != ',') { p->pos--; return fail(p, is_object ? "expected ',' or '}'" : "expected ',' or ']'"); }
        }
    }
    size_t count = p->stack_count - first;
    out->type = is_object ? JSON_OBJECT : JSON_ARRAY;
    out->count = count;
    if (count > 0) {
        if (is_object) {
            JsonMember *members = (JsonMember *)arena_alloc(p, count * sizeof(JsonMember));
            if (!members) return fail(p, "out of memory");
            memcpy(members, p->stack + first, count * sizeof(JsonMember));
            out->members = members;
        } else {
            JsonValue *items = (JsonValue *)arena_alloc(p, count * sizeof(JsonValue));
            if (!items) return fail(p, "out of memory");
            for (size_t i = 0; i < count; i++) items[i] = p->stack[first + i].value;
            out->items = items;
        }
    }
    p->stack_count = first;
    return 1;
}

static int parse_value(Parser *p, JsonValue *out, int depth) {
    memset(out, 0, sizeof(*out));
    skip_whitespace(p);
    if (p->pos >= p->len) return fail(p, "unexpected end of input");
    switch (p->text[p->pos]) {
    case '{': return parse_container(p, out, depth, 1);
    case '[': return parse_container(p, out, depth, 0);
    case '"':
        out->type = JSON_STRING;
        return parse_string(p, &out->string, &out->count);
    case 't': return parse_literal(p, "true", JSON_TRUE, out);
    case 'f': return parse_literal(p, "false", JSON_FALSE, out);
    case 'n': return parse_literal(p, "null", JSON_NULL, out);
    default: return parse_number(p, out);
    }
}

JsonDocument *json_parse(const char *text, size_t len, char *error, size_t error_size) {
    JsonDocument *doc = (JsonDocument *)calloc(1, sizeof(JsonDocument));
    if (!doc) { snprintf(error, error_size, "out of memory"); return NULL; }
    Parser p;
    memset(&p, 0, sizeof(p));
    p.text = text;
    p.len = len;
    p.doc = doc;
    p.error = error;
    p.error_size = error_size;
    if (parse_value(&p, &doc->root, 0)) {
        skip_whitespace(&p);
        if (p.pos != p.len) fail(&p, "unexpected text after the value");
    }
    free(p.stack);
    if (p.failed) { json_free(doc); return NULL; }
    return doc;
}

void json_free(JsonDocument *doc) {
    if (!doc) return;
    ArenaBlock *block = doc->blocks;
    while (block) {
        ArenaBlock *next = block->next;
        free(block);
        block = next;
    }
    free(doc);
}

const JsonValue *json_root(const JsonDocument *doc) { return &doc->root; }

const JsonValue *json_get(const JsonValue *object, const char *key) {
    if (!object || object->type != JSON_OBJECT) return NULL;
    size_t key_len = strlen(key);
    for (size_t i = 0; i < object->count; i++) {
        const JsonMember *m = &object->members[i];
        if (m->key_len == key_len && memcmp(m->key, key, key_len) == 0) return &m->value;
    }
    return NULL;
}

int json_is_string(const JsonValue *value, const char *text) {
    return value && value->type == JSON_STRING && value->count == strlen(text) &&
           memcmp(value->string, text, value->count) == 0;
}
