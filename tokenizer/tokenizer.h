// BPE tokenizer with exact Hugging Face `tokenizers` parity for Llama 3 and Llama 2, loaded
// from a tokenizer.json. Plain C, no dependency beyond libc.
//
// encode(text) gives the ids of HF's `tokenizer.encode(text, add_special_tokens=False).ids`:
//   1. added/special tokens written in the text (e.g. "<|begin_of_text|>", "<s>") are split out
//      first (leftmost, then longest match) and become their ids;
//   2. each piece between them is normalized (Llama 2: prepend "▁", spaces -> "▁");
//   3. pre-tokenized (Llama 3: its Split regex, then byte-level: bytes are the alphabet);
//   4. BPE: merges by rank (Llama 3: a pre-token that is a whole vocab entry is kept whole,
//      "ignore_merges"; Llama 2: a character outside the vocab becomes its <0xNN> tokens).
// No BOS/EOS is added; callers add tokenizer_bos_id / tokenizer_eos_id themselves.
//
// Invalid UTF-8: HF accepts only valid text, so encode first replaces every invalid sequence
// by U+FFFD exactly as Python's bytes.decode("utf-8", errors="replace") does (one U+FFFD per
// maximal subpart of a sequence, or per byte that cannot start one). The ids then equal HF's
// ids for that decoded string, and decode(encode(text)) gives the replaced text back.
//
// decode(ids) gives HF's `tokenizer.decode(ids, skip_special_tokens=False)` as UTF-8 bytes:
// special tokens appear as their text; ids outside the vocabulary are skipped; byte tokens
// that do not form valid UTF-8 become U+FFFD. For Llama 2 the decoder drops the one leading
// space that encode's "▁" prefix put there, so text holding special tokens or "▁" does not
// round-trip (as in HF).
//
// Supported tokenizer.json features (anything else fails to load with "unsupported: ..."):
//   model BPE (unk_token, fuse_unk, byte_fallback, ignore_merges; merges as "a b" or ["a","b"]);
//   normalizer null, Prepend, Replace (string pattern), or a Sequence of them;
//   pre_tokenizer null, ByteLevel (use_regex false), or Sequence[Split(Llama 3 regex,
//   Isolated), ByteLevel]; decoder ByteLevel, or Sequence[Replace..., ByteFallback, Fuse, Strip];
//   added tokens without lstrip/rstrip/single_word. The post_processor is ignored.
#pragma once
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct Tokenizer Tokenizer;

// Loads a tokenizer.json. NULL on failure, with "path: what is wrong" or
// "path: unsupported: <feature>" in error.
Tokenizer *tokenizer_load(const char *path, char *error, size_t error_size);
void tokenizer_free(Tokenizer *tok);

// Number of ids, including added/special tokens (largest id + 1).
int tokenizer_vocab_size(const Tokenizer *tok);
// Ids below tokenizer_vocab_size that no token has (a gap in the vocabulary), and the first.
int tokenizer_missing_ids(const Tokenizer *tok, int *first_missing);
// Ids of the beginning/end-of-text special tokens ("<|begin_of_text|>"/"<|end_of_text|>" or
// "<s>"/"</s>"), or -1 when the tokenizer has none.
int tokenizer_bos_id(const Tokenizer *tok);
int tokenizer_eos_id(const Tokenizer *tok);

// Appends the ids of text[0..len) to the growable array *ids (*count used of *capacity;
// realloc'd as needed; *ids may start NULL with 0 capacity). Safe to call from many threads
// on one Tokenizer. 0 ok, -1 out of memory (*count then unchanged).
int tokenizer_encode(const Tokenizer *tok, const char *text, size_t len, uint32_t **ids, size_t *count,
                     size_t *capacity);

// The text of ids[0..count) (malloc'd, NUL-terminated; *out_len its length without the NUL),
// or NULL when out of memory.
char *tokenizer_decode(const Tokenizer *tok, const uint32_t *ids, size_t count, size_t *out_len);

#ifdef __cplusplus
}
#endif
