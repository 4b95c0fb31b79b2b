#!/usr/bin/env python3
"""Writes the expected ids of the tokenizer test texts with Hugging Face `tokenizers` (the
definition of correct), for test/test_tokenizer.c.

  python3 scripts/tokenizer_vectors.py TEXTS_DIR NAME=TOKENIZER.json [NAME=...] [--out DIR]
        [--decode-cases N] [--classes FILE]

For every TEXTS_DIR/<text>.txt and tokenizer NAME it writes DIR/<text>.<NAME>.ids: the ids of
tokenizer.encode(text, add_special_tokens=False), space-separated decimals. Texts are read as
bytes and decoded with errors="replace": an invalid UTF-8 sequence becomes U+FFFD exactly as
the C tokenizer does it (tokenizer/tokenizer.h), since HF only takes valid strings.

--decode-cases N writes DIR/decode_cases.<NAME>.tsv: N seeded random id sequences (biased
towards byte tokens and special tokens) and HF's decode(ids, skip_special_tokens=False) as
hex UTF-8 bytes, one "ids<TAB>hex" line each.

--classes FILE (test/data/tokenizer/hf_unicode_classes.ranges) writes, as "first last class" ranges over all code points except surrogates,
how HF's pre-tokenizer regex (the first NAME's Split) classifies each code point: L letter,
N number, S space, O other; it probes the regex with "a"+c, "1"+c and c+"!".
Needs: pip tokenizers (run where it is installed; the GPU machine has it).
"""
import argparse
import json
import os
import random
import sys

from tokenizers import Regex, Tokenizer, pre_tokenizers


def write_ids(path, ids):
    with open(path, "w") as f:
        f.write(" ".join(str(i) for i in ids) + "\n")


def decode_cases(tokenizer, count, seed):
    rng = random.Random(seed)
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    byte_ids = [tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256)]
    byte_ids = [i for i in byte_ids if i is not None]
    special_ids = sorted(tokenizer.get_added_tokens_decoder().keys())
    lines = []
    for _ in range(count):
        ids = []
        for _ in range(rng.randint(1, 12)):
            pick = rng.random()
            if pick < 0.3 and byte_ids:
                ids.append(rng.choice(byte_ids))
            elif pick < 0.4:
                ids.append(rng.choice(special_ids))
            elif pick < 0.6:
                ids.append(rng.randrange(0, min(vocab_size, 600)))
            else:
                ids.append(rng.randrange(0, vocab_size))
        text = tokenizer.decode(ids, skip_special_tokens=False)
        lines.append(" ".join(map(str, ids)) + "\t" + text.encode("utf-8").hex())
    return lines


def split_pattern(tokenizer_path):
    config = json.load(open(tokenizer_path, encoding="utf-8"))["pre_tokenizer"]
    for step in config.get("pretokenizers", [config]):
        if step.get("type") == "Split":
            return step["pattern"]["Regex"]
    sys.exit(f"error: {tokenizer_path}: no Split pre-tokenizer to probe")


def probe_classes(pattern, out_path):
    split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    pieces = lambda s: len(split.pre_tokenize_str(s))
    ranges, folds = [], []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        c = chr(cp)
        if pieces("a" + c) == 1:
            cls = "L"
            # Case-insensitive contractions: a letter c for which "'c" + "x" splits as "'c".
            if cp >= 0x80 and split.pre_tokenize_str("'" + c + "x")[0][0] == "'" + c:
                folds.append(f"U+{cp:04X}")
        elif pieces("1" + c) == 1:
            cls = "N"
        elif c == " " or pieces(c + "!") == 2:
            cls = "S"
        else:
            cls = "O"
        if ranges and ranges[-1][2] == cls and ranges[-1][1] == cp - 1:
            ranges[-1][1] = cp
        elif ranges and ranges[-1][2] == cls and ranges[-1][1] == 0xD7FF and cp == 0xE000:
            ranges[-1][1] = cp
        else:
            ranges.append([cp, cp, cls])
    with open(out_path, "w") as f:
        f.write("# How Hugging Face tokenizers' pre-tokenizer regex classifies code points "
                "(scripts/tokenizer_vectors.py --classes); surrogates D800-DFFF skipped.\n")
        for first, last, cls in ranges:
            f.write(f"{first:04X} {last:04X} {cls}\n")
    print("non-ASCII letters that the contraction alternative accepts:", " ".join(folds))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("texts_dir")
    parser.add_argument("tokenizers", nargs="+", help="NAME=TOKENIZER.json")
    parser.add_argument("--out", help="output directory (default: TEXTS_DIR)")
    parser.add_argument("--decode-cases", type=int, default=0)
    parser.add_argument("--classes")
    args = parser.parse_args()
    out_dir = args.out or args.texts_dir
    os.makedirs(out_dir, exist_ok=True)
    texts = sorted(n for n in os.listdir(args.texts_dir) if n.endswith(".txt"))
    for spec in args.tokenizers:
        name, _, path = spec.partition("=")
        tokenizer = Tokenizer.from_file(path)
        for text_name in texts:
            with open(os.path.join(args.texts_dir, text_name), "rb") as f:
                text = f.read().decode("utf-8", errors="replace")
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            write_ids(os.path.join(out_dir, f"{text_name[:-4]}.{name}.ids"), ids)
        if args.decode_cases:
            with open(os.path.join(out_dir, f"decode_cases.{name}.tsv"), "w") as f:
                f.write("\n".join(decode_cases(tokenizer, args.decode_cases, seed=1234)) + "\n")
        print(f"{name}: {len(texts)} texts")
    if args.classes:
        probe_classes(split_pattern(args.tokenizers[0].partition("=")[2]), args.classes)


if __name__ == "__main__":
    main()
