// Hand-written matcher of the Llama 3 pre-tokenizer regex; see pretokenize.h. Each
// alternative below is tried in the regex's order; the comments give the alternative.
#include "pretokenize.h"

#include <stdint.h>

#include "unicode.h"

const char llama3_split_pattern[] =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

// Class bits of the character at text[i] (i < len); *n gets its length in bytes.
static inline unsigned class_at(const unsigned char *text, size_t i, size_t *n) {
    if (text[i] < 0x80) { *n = 1; return unicode_class(text[i]); }
    return unicode_class(utf8_decode(text + i, n));
}

static inline int is_cr_or_lf(unsigned char c) { return c == '\r' || c == '\n'; }

// Whether the character at text[i] matches ASCII letter (lowercase) case-insensitively, as
// Oniguruma's (?i) does with Unicode case folding (U+017F LONG S matches 's').
static int folds_to(const unsigned char *text, size_t len, size_t i, char letter, size_t *n) {
    if (i >= len) return 0;
    if (text[i] < 0x80) {
        *n = 1;
        unsigned char c = text[i];
        if (c >= 'A' && c <= 'Z') c = (unsigned char)(c + ('a' - 'A'));
        return c == (unsigned char)letter;
    }
    uint32_t cp = utf8_decode(text + i, n);
    for (int k = 0; k < unicode_ascii_fold_count; k++) {
        if (unicode_ascii_folds[k].code_point == cp) return unicode_ascii_folds[k].ascii_letter == letter;
    }
    return 0;
}

// (?i:'s|'t|'re|'ve|'m|'ll|'d) after the apostrophe at pos; returns the end or 0.
static size_t match_contraction(const unsigned char *text, size_t len, size_t pos) {
    static const char *const suffixes[] = {"s", "t", "re", "ve", "m", "ll", "d"};
    for (size_t k = 0; k < sizeof(suffixes) / sizeof(suffixes[0]); k++) {
        size_t i = pos + 1, n;
        const char *suffix = suffixes[k];
        while (*suffix && folds_to(text, len, i, *suffix, &n)) { i += n; suffix++; }
        if (!*suffix) return i;
    }
    return 0;
}

static size_t letters_end(const unsigned char *text, size_t len, size_t i) {
    size_t n;
    while (i < len && (class_at(text, i, &n) & UNICODE_LETTER)) i += n;
    return i;
}

// [^\s\p{L}\p{N}]+[\r\n]* from i, where the first character is known to be in the class.
static size_t others_then_newlines(const unsigned char *text, size_t len, size_t i) {
    size_t n;
    while (i < len && class_at(text, i, &n) == 0) i += n;
    while (i < len && is_cr_or_lf(text[i])) i++;
    return i;
}

size_t llama3_split_next(const unsigned char *text, size_t len, size_t pos) {
    unsigned char c0 = text[pos];
    // (?i:'s|'t|'re|'ve|'m|'ll|'d)
    if (c0 == '\'') {
        size_t end = match_contraction(text, len, pos);
        if (end) return end;
    }
    size_t n0, n1;
    unsigned class0 = class_at(text, pos, &n0);
    // [^\r\n\p{L}\p{N}]?\p{L}+
    if (!(class0 & (UNICODE_LETTER | UNICODE_NUMBER)) && !is_cr_or_lf(c0)) {
        size_t next = pos + n0;
        if (next < len && (class_at(text, next, &n1) & UNICODE_LETTER)) return letters_end(text, len, next);
    }
    if (class0 & UNICODE_LETTER) return letters_end(text, len, pos);
    // \p{N}{1,3}
    if (class0 & UNICODE_NUMBER) {
        size_t i = pos + n0;
        for (int count = 1; count < 3 && i < len && (class_at(text, i, &n1) & UNICODE_NUMBER); count++) i += n1;
        return i;
    }
    //  ?[^\s\p{L}\p{N}]+[\r\n]*
    if (c0 == ' ' && pos + 1 < len && class_at(text, pos + 1, &n1) == 0) return others_then_newlines(text, len, pos + 1);
    if (class0 == 0) return others_then_newlines(text, len, pos);
    // The character is a space: find its run, the last CR/LF in it and its last character.
    size_t end = pos, last_newline_end = 0, last_char_start = pos, chars = 0;
    while (end < len) {
        size_t n;
        if (!(class_at(text, end, &n) & UNICODE_SPACE)) break;
        if (is_cr_or_lf(text[end])) last_newline_end = end + 1;
        last_char_start = end;
        end += n;
        chars++;
    }
    // \s*[\r\n]+
    if (last_newline_end) return last_newline_end;
    // \s+(?!\S)
    if (end == len) return end;
    if (chars >= 2) return last_char_start;
    // \s+
    return end;
}
