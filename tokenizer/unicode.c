// UTF-8 validation and U+FFFD replacement (maximal subparts); see unicode.h.
// Well-formed sequences (Unicode Table 3-7): the second byte's range depends on the first,
// which rules out overlong forms, surrogates (ED A0..BF) and code points above U+10FFFF.
#include "unicode.h"

#include <string.h>

size_t utf8_sequence_length(const unsigned char *s, size_t len, size_t *valid_prefix) {
    unsigned char b = s[0];
    *valid_prefix = 1;
    if (b < 0x80) return 1;
    size_t need;
    unsigned char low = 0x80, high = 0xBF; // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) need = 2;
    else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        if (b == 0xE0) low = 0xA0;
        if (b == 0xED) high = 0x9F;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        if (b == 0xF0) low = 0x90;
        if (b == 0xF4) high = 0x8F;
    } else {
        return 0;
    }
    for (size_t i = 1; i < need; i++) {
        if (i >= len) return 0;
        unsigned char c = s[i];
        if (i == 1 ? (c < low || c > high) : (c < 0x80 || c > 0xBF)) return 0;
        *valid_prefix = i + 1;
    }
    return need;
}

size_t utf8_valid_prefix(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        if (s[i] < 0x80) { i++; continue; }
        size_t prefix, n = utf8_sequence_length(s + i, len - i, &prefix);
        if (n == 0) return i;
        i += n;
    }
    return len;
}

size_t utf8_replace_invalid(const unsigned char *s, size_t len, unsigned char *out) {
    static const unsigned char replacement[3] = {0xEF, 0xBF, 0xBD};
    size_t i = 0, n = 0;
    while (i < len) {
        size_t prefix, length = utf8_sequence_length(s + i, len - i, &prefix);
        if (length) {
            memcpy(out + n, s + i, length);
            n += length;
            i += length;
        } else {
            memcpy(out + n, replacement, 3);
            n += 3;
            i += prefix;
        }
    }
    return n;
}
