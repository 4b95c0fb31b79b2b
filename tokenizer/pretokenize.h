// The Llama 3 pre-tokenizer: the Split regex of its tokenizer.json, matched by hand.
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// with Oniguruma's semantics (what Hugging Face tokenizers runs): at each position the first
// alternative that matches wins, quantifiers are greedy and backtrack. Every character is a
// letter, a number, a space or something else, so some alternative always matches and the
// pieces tile the text ("Isolated" split behaviour leaves no gaps).
#pragma once
#include <stddef.h>

// The pattern string as it appears in the tokenizer.json (JSON-decoded).
extern const char llama3_split_pattern[];

// End of the piece that starts at pos in valid UTF-8 text[0..len); requires pos < len.
size_t llama3_split_next(const unsigned char *text, size_t len, size_t pos);
