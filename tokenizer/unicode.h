// Unicode helpers for the tokenizer: the character classes of the Llama 3 pre-tokenizer regex
// (\p{L}, \p{N}, \s) from the generated tokenizer/unicode_tables.c, UTF-8 decoding, and the
// replacement of invalid UTF-8 by U+FFFD.
//
// Invalid UTF-8 follows Python's bytes.decode("utf-8", errors="replace") (the Unicode
// "maximal subpart" practice, also Rust's String::from_utf8_lossy): each maximal prefix of a
// well-formed sequence that cannot be completed, and each byte that cannot start one, becomes
// one U+FFFD.
#pragma once
#include <stddef.h>
#include <stdint.h>

enum { UNICODE_LETTER = 1, UNICODE_NUMBER = 2, UNICODE_SPACE = 4 };

typedef struct {
    uint32_t code_point;
    char ascii_letter; // its case folding
} UnicodeAsciiFold;

extern const char unicode_tables_version[];
extern const uint8_t unicode_class_stage1[0x110000 >> 8];
extern const uint8_t unicode_class_stage2[][256];
extern const UnicodeAsciiFold unicode_ascii_folds[];
extern const int unicode_ascii_fold_count;

// UNICODE_LETTER, UNICODE_NUMBER and/or UNICODE_SPACE bits of a code point (0 for other).
static inline unsigned unicode_class(uint32_t cp) {
    if (cp > 0x10FFFF) return 0;
    return unicode_class_stage2[unicode_class_stage1[cp >> 8]][cp & 0xFF];
}

// Decodes the code point at s[0..) of VALID UTF-8; *len gets its length in bytes.
static inline uint32_t utf8_decode(const unsigned char *s, size_t *len) {
    unsigned char b = s[0];
    if (b < 0x80) { *len = 1; return b; }
    if (b < 0xE0) { *len = 2; return (uint32_t)(b & 0x1F) << 6 | (s[1] & 0x3F); }
    if (b < 0xF0) { *len = 3; return (uint32_t)(b & 0x0F) << 12 | (uint32_t)(s[1] & 0x3F) << 6 | (s[2] & 0x3F); }
    *len = 4;
    return (uint32_t)(b & 0x07) << 18 | (uint32_t)(s[1] & 0x3F) << 12 | (uint32_t)(s[2] & 0x3F) << 6 | (s[3] & 0x3F);
}

// Length of the well-formed UTF-8 sequence at s[0..len), or 0 when it is not well formed;
// *valid_prefix gets how many bytes form a maximal subpart (at least 1) in that case.
size_t utf8_sequence_length(const unsigned char *s, size_t len, size_t *valid_prefix);

// Length of the longest prefix of s[0..len) that is valid UTF-8.
size_t utf8_valid_prefix(const unsigned char *s, size_t len);

// Writes s[0..len) with invalid sequences replaced by U+FFFD into out (room for 3 * len bytes:
// a replaced byte grows to at most 3); returns the bytes written.
size_t utf8_replace_invalid(const unsigned char *s, size_t len, unsigned char *out);
