#!/usr/bin/env bash
# `./tokenize shards` end to end with a byte-level tokenizer.json made here (byte b has id b, BOS
# 256, EOS 257), so that the shards can be decoded back and compared with the documents: the
# llm.c header, the document split (separator, blank lines, JSONL "text"), BOS/EOS, the evenly
# spread validation split, identical output for 1, 2 and 4 threads, uint32 shards for a
# vocabulary over 65536 ids, errors naming file:line, no temporary file left behind, and an output
# folder that is never overwritten silently nor left half-written.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# tokenizer.json: GPT-2's byte-to-character map, no merges; an optional extra special token at a
# high id makes the vocabulary larger than 65536.
make_tokenizer() {  # make_tokenizer OUT [HIGH_ID]
    python3 - "$@" <<'PYTHON'
import json, sys
visible = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
chars, extra = {}, 0
for b in range(256):
    if b in visible:
        chars[b] = chr(b)
    else:
        chars[b] = chr(256 + extra)
        extra += 1
added = [(256, '<|begin_of_text|>'), (257, '<|end_of_text|>')]
if len(sys.argv) > 2:
    added.append((int(sys.argv[2]), '<|high|>'))
vocab = {chars[b]: b for b in range(256)}
vocab.update({content: i for i, content in added})
spec = {
    'version': '1.0', 'truncation': None, 'padding': None,
    'added_tokens': [{'id': i, 'content': c, 'single_word': False, 'lstrip': False, 'rstrip': False,
                      'normalized': False, 'special': True} for i, c in added],
    'normalizer': None,
    'pre_tokenizer': {'type': 'ByteLevel', 'add_prefix_space': False, 'trim_offsets': True, 'use_regex': False},
    'post_processor': None,
    'decoder': {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True},
    'model': {'type': 'BPE', 'dropout': None, 'unk_token': None, 'continuing_subword_prefix': None,
              'end_of_word_suffix': None, 'fuse_unk': False, 'byte_fallback': False, 'ignore_merges': False,
              'vocab': vocab, 'merges': []},
}
json.dump(spec, open(sys.argv[1], 'w'), ensure_ascii=False)
PYTHON
}
make_tokenizer "$tmp/tokenizer.json"
make_tokenizer "$tmp/tokenizer_large.json" 70000

# Inputs: several files, a sub-directory, a JSONL file, a hidden file that the walk skips, and
# enough text (about 3 MB) for several chunks, so that the threads really share the work.
mkdir -p "$tmp/in/sub" "$tmp/in/.hidden"
python3 - "$tmp/in" <<'PYTHON'
import json, random, sys
root = sys.argv[1]
rng = random.Random(5)
words = ['shard', 'token', 'loader', 'épée', 'naïve', '数据', 'x', '', 'line\nbreak', 'tab\there']
def document():
    return ' '.join(rng.choice(words) for _ in range(rng.randint(1, 4000)))
open(root + '/a.txt', 'w').write('<|sep|>'.join(document() for _ in range(300)) + '<|sep|>')
open(root + '/sub/b.txt', 'w').write('<|sep|>first<|sep|><|sep|>second')
lines = [json.dumps({'id': i, 'meta': {'text': 'nested'}, 'text': document() + ' \u00e9 \ud83d\ude00 "q"\n'})
         for i in range(50)]
open(root + '/sub/c.jsonl', 'w').write('\n'.join(lines[:25]) + '\n\n' + '\n'.join(lines[25:]) + '\n')
open(root + '/.hidden/skip.txt', 'w').write('never read')
PYTHON

run_shards() {  # run_shards OUTDIR ARGS...
    local out=$1; shift
    ./tokenize shards -t "$tmp/tokenizer.json" -o "$out" "$@" > "$out.log" 2>&1
}
options=(--separator '<|sep|>' --eos --val-fraction 0.02 --shard-tokens 400000)
for threads in 1 2 4; do
    run_shards "$tmp/out$threads" "${options[@]}" --threads $threads "$tmp/in"
    check "tokenize shards --threads $threads exits 0" $? "$(cat "$tmp/out$threads.log")"
done
identical=0
for threads in 2 4; do
    [ "$(ls "$tmp/out1")" = "$(ls "$tmp/out$threads")" ] || identical=1
    for file in "$tmp"/out1/*; do cmp -s "$file" "$tmp/out$threads/$(basename "$file")" || identical=1; done
done
check "shards are byte-identical with 1, 2 and 4 threads ($(ls "$tmp/out1" | wc -l) files)" $identical
check "the summary counts the documents" \
    "$(grep -q '^documents: 352 (train 345, val 7)' "$tmp/out1.log"; echo $?)" "$(head -1 "$tmp/out1.log")"

# Decode the shards and compare with the documents, split and assigned as documented.
verify() {  # verify OUTDIR MAGIC SHARD_TOKENS
    python3 - "$tmp/in" "$@" <<'PYTHON'
import glob, json, math, os, struct, sys
root, out, magic, shard_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
documents = []  # in walk order: a.txt, sub/b.txt, sub/c.jsonl
for path in [root + '/a.txt', root + '/sub/b.txt']:
    documents += [d.encode() for d in open(path, encoding='utf-8').read().split('<|sep|>') if d]
documents += [json.loads(line)['text'].encode() for line in open(root + '/sub/c.jsonl') if line.strip()]
is_val = [math.floor((i + 1) * 0.02) > math.floor(i * 0.02) for i in range(len(documents))]
problems = []
def read(prefix):
    tokens = []
    paths = sorted(glob.glob('%s/%s_*.bin' % (out, prefix)))
    for n, path in enumerate(paths):
        data = open(path, 'rb').read()
        header = struct.unpack('<256i', data[:1024])
        width = 2 if magic == 20240520 else 4
        if header[0] != magic or header[1] != (1 if width == 2 else 2) or any(header[3:]):
            problems.append('%s: header %s' % (path, header[:4]))
        if len(data) != 1024 + header[2] * width:
            problems.append('%s: %d bytes for %d tokens' % (path, len(data), header[2]))
        if n < len(paths) - 1 and header[2] != shard_tokens:
            problems.append('%s: %d tokens, not %d' % (path, header[2], shard_tokens))
        tokens += struct.unpack('<%d%s' % (header[2], 'H' if width == 2 else 'I'), data[1024:])
    return tokens
for prefix, wanted in (('train', False), ('val', True)):
    expected = []
    for document, val in zip(documents, is_val):
        if val == wanted:
            expected += [256] + list(document) + [257]
    got = read(prefix)
    if got != expected:
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        problems.append('%s: %d tokens, expected %d; first difference at %d' % (prefix, len(got), len(expected), first))
print('; '.join(problems))
sys.exit(1 if problems else 0)
PYTHON
}
detail=$(verify "$tmp/out1" 20240520 400000); rc=$?
check "uint16 shards decode to BOS + document + EOS in input order (files sorted, JSONL text, hidden skipped), val every 50th" $rc "$detail"

./tokenize shards -t "$tmp/tokenizer_large.json" -o "$tmp/large" "${options[@]}" "$tmp/in" > "$tmp/large.log" 2>&1
check "a vocabulary of 70001 ids exits 0" $? "$(cat "$tmp/large.log")"
check "a vocabulary with a gap (ids 258 to 69999) is warned about" \
    "$(grep -q "warning: $tmp/tokenizer_large.json: 69742 of the 70001 ids have no token (the first: 258)" "$tmp/large.log"; echo $?)" \
    "$(head -3 "$tmp/large.log")"
check "a vocabulary without gaps is not" "$(! grep -q 'have no token' "$tmp/out1.log"; echo $?)" "$(head -3 "$tmp/out1.log")"
detail=$(verify "$tmp/large" 20240801 400000); rc=$?
check "vocabulary over 65536 ids gives uint32 shards (magic 20240801, version 2)" $rc "$detail"

# Blank-line split and --val-docs on a small file.
printf 'one\n\n\n two\nthree\n \t\nfour' > "$tmp/blank.txt"
run_shards "$tmp/blank" --blank-lines --val-docs 1 "$tmp/blank.txt"
got=$(python3 -c "
import struct, sys
for name in ('train', 'val'):
    d = open('$tmp/blank/%s_000000.bin' % name, 'rb').read()
    print(name, bytes(t if t < 256 else 124 for t in struct.unpack('<%dH' % ((len(d) - 1024) // 2), d[1024:])).decode())
")
check "--blank-lines splits at blank lines, --val-docs 1 takes the last of 3" \
    "$([ "$got" = "$(printf 'train |one| two\nthree\nval |four')" ]; echo $?)" "got: $got"

# An output folder that holds shards is never overwritten silently; --overwrite replaces them all
# (fewer shards than before: none of the earlier run's stay). The run writes DIR.partial and
# renames it at the end, so a run that fails halfway leaves the earlier shards as they were.
cp -r "$tmp/out1" "$tmp/out1.before"
run_shards "$tmp/out1" "${options[@]:0:5}" --shard-tokens 100000000 "$tmp/in"; rc=$?
check "a rerun into a folder of shards is refused without --overwrite, naming the folder" \
    "$([ $rc -ne 0 ] && grep -q "error: $tmp/out1: the output directory is not empty (12 entries" "$tmp/out1.log" &&
       diff -r "$tmp/out1" "$tmp/out1.before" > /dev/null; echo $?)" "$(cat "$tmp/out1.log")"
printf '{"text": "ok"}\n{"txt": "no"}\n' > "$tmp/late_error.jsonl"
run_shards "$tmp/out1" --overwrite --shard-tokens 1000 "$tmp/in" "$tmp/late_error.jsonl"; rc=$?
check "a run that fails after writing shards leaves the earlier ones as they were, and no partial folder" \
    "$([ $rc -ne 0 ] && diff -r "$tmp/out1" "$tmp/out1.before" > /dev/null && [ ! -e "$tmp/out1.partial" ]; echo $?)" \
    "$(tail -1 "$tmp/out1.log"; ls "$tmp" | tr '\n' ' ')"
run_shards "$tmp/out1" "${options[@]:0:5}" --shard-tokens 100000000 --overwrite "$tmp/in"
check "--overwrite replaces the shards, the earlier run's extra ones included" \
    "$([ "$(ls "$tmp/out1")" = "$(printf 'train_000000.bin\nval_000000.bin')" ] && [ ! -e "$tmp/out1.partial" ] &&
       [ ! -e "$tmp/out1.replaced" ]; echo $?)" "$(ls "$tmp/out1" | tr '\n' ' ')"
mkdir -p "$tmp/one"; cp "$tmp/out1/val_000000.bin" "$tmp/one/"
run_shards "$tmp/one" "$tmp/in"; rc=$?
check "a folder holding a single shard is refused too" \
    "$([ $rc -ne 0 ] && grep -q "the output directory is not empty (1 entries, e.g. val_000000.bin)" "$tmp/one.log"; echo $?)" \
    "$(cat "$tmp/one.log")"
mkdir -p "$tmp/mixed"; cp "$tmp/out1/train_000000.bin" "$tmp/mixed/"; echo notes > "$tmp/mixed/README"
run_shards "$tmp/mixed" --overwrite "$tmp/in"; rc=$?
check "--overwrite refuses a folder that holds more than shards" \
    "$([ $rc -ne 0 ] && grep -q "holds README, which is not a shard" "$tmp/mixed.log" && [ -e "$tmp/mixed/README" ]; echo $?)" \
    "$(cat "$tmp/mixed.log")"
mkdir -p "$tmp/self"; cp "$tmp/in/a.txt" "$tmp/self/"
run_shards "$tmp/self" --overwrite "$tmp/self"; rc=$?
check "an input inside the output folder is refused" \
    "$([ $rc -ne 0 ] && grep -q "an input inside the output directory" "$tmp/self.log"; echo $?)" "$(cat "$tmp/self.log")"

expect_error() {  # expect_error NAME EXPECTED-TEXT INPUT
    out=$(./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/bad" "$3" 2>&1); rc=$?
    check "$1: exits non-zero" "$([ $rc -ne 0 ]; echo $?)"
    check "$1: names the problem" "$(printf '%s' "$out" | grep -qF -- "$2"; echo $?)" "got: $out"
}
printf '{"text": "ok"}\n{"txt": "no"}\n' > "$tmp/bad1.jsonl"
expect_error "JSONL line without text" "error: $tmp/bad1.jsonl:2: no \"text\" field" "$tmp/bad1.jsonl"
printf '{"text": "ok"}\n{"text": "cut\n' > "$tmp/bad2.jsonl"
expect_error "JSONL line cut short" "error: $tmp/bad2.jsonl:2: the \"text\" field is not a valid string" "$tmp/bad2.jsonl"
printf '{"text": "ok"}\n{"id": 1 "text": "no comma"}\n' > "$tmp/bad3.jsonl"
expect_error "JSONL line without a comma between members" "error: $tmp/bad3.jsonl:2: malformed JSON" "$tmp/bad3.jsonl"
expect_error "missing input" "error: $tmp/none.txt: No such file or directory" "$tmp/none.txt"
check "a failed run leaves no temporary shard" "$([ -z "$(ls "$tmp/bad" 2>/dev/null | grep tmp)" ]; echo $?)"
# The long forms of -t and -o, and an output folder given with a trailing slash: DIR.partial is
# written beside DIR, not inside it.
./tokenize shards --tokenizer "$tmp/tokenizer.json" --output "$tmp/long_opts/" "$tmp/blank.txt" > "$tmp/long_opts.log" 2>&1; rc=$?
check "--tokenizer and --output DIR/ write DIR/train_000000.bin, leaving no partial folder" \
    "$([ $rc -eq 0 ] && [ -f "$tmp/long_opts/train_000000.bin" ] && [ ! -e "$tmp/long_opts.partial" ] &&
       [ ! -e "$tmp/long_opts/.partial" ]; echo $?)" "$(cat "$tmp/long_opts.log"; ls -a "$tmp/long_opts" | tr '\n' ' ')"
out=$(./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/bad" --bogus "$tmp/blank.txt" 2>&1); rc=$?
check "an unknown option is refused" \
    "$([ $rc -ne 0 ] && printf '%s' "$out" | grep -q 'error: unknown option --bogus'; echo $?)" "got: $out"
out=$(./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/bad" --val-fraction 0.5 --val-docs 0 "$tmp/blank.txt" 2>&1); rc=$?
check "--val-fraction with --val-docs 0 is refused" \
    "$([ $rc -ne 0 ] && printf '%s' "$out" | grep -q 'give --val-fraction or --val-docs, not both'; echo $?)" "got: $out"
out=$(./tokenize shards -t "$tmp/tokenizer.json" "$tmp/in" 2>&1); rc=$?
check "missing -o is an error" "$([ $rc -ne 0 ] && printf '%s' "$out" | grep -q 'give -o DIR'; echo $?)" "got: $out"

# JSONL "text" escapes at their edges: hex digits a-f and A-F, UTF-8 lengths at 0x7f/0x80,
# 0x7ff/0x800, 0xffff/0x10000 (a surrogate pair, first and last), an escaped quote and backslash.
printf '%s\n' '{"text": "\u007f\u0080\u07ff\u0800\uffff\ud800\udc00\udbff\udfff \u00aF\u00Fa\u00A9\u00e9 q\"b\\s\/e\nf\tt"}' > "$tmp/escapes.jsonl"
run_shards "$tmp/escapes" "$tmp/escapes.jsonl"
got=$(python3 - "$tmp/escapes/train_000000.bin" "$tmp/escapes.jsonl" <<'PYTHON'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
ids = list(struct.unpack("<%dH" % ((len(data) - 1024) // 2), data[1024:]))
expected = [256] + list(json.loads(open(sys.argv[2]).read())["text"].encode("utf-8"))
print("ok" if ids == expected else "got %s, expected %s" % (ids, expected))
PYTHON
)
check "JSONL escapes decode to the UTF-8 bytes of the text (hex case, UTF-8 length edges, surrogate pairs)" \
    "$([ "$got" = ok ]; echo $?)" "$got $(cat "$tmp/escapes.log")"

# Separators at the edges of the search: one cut by the end of the first 1 MiB read block (6 of
# its 7 bytes in it), and one at the end of the file right after a '<' that starts no separator.
python3 - "$tmp/separators" <<'PYTHON'
import os, sys
os.makedirs(sys.argv[1])
open(sys.argv[1] + '/a_block.txt', 'w').write('a' * ((1 << 20) - 6) + '<|sep|>' + 'b' * 10)
open(sys.argv[1] + '/b_end.txt', 'w').write('one<|sep|>two<<|sep|>')
PYTHON
run_shards "$tmp/separators_out" --separator '<|sep|>' --eos "$tmp/separators"
got=$(python3 - "$tmp/separators_out/train_000000.bin" <<'PYTHON'
import struct, sys
data = open(sys.argv[1], "rb").read()
ids = list(struct.unpack("<%dH" % ((len(data) - 1024) // 2), data[1024:]))
expected = []
for document in [b'a' * ((1 << 20) - 6), b'b' * 10, b'one', b'two<']:
    expected += [256] + list(document) + [257]
print("ok" if ids == expected else "got %d ids, expected %d; first difference at %s" % (len(ids), len(expected),
      next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))))
PYTHON
)
check "a separator across the read block's end and one at the file's end after a '<' split the documents" \
    "$([ "$got" = ok ]; echo $?)" "$got $(cat "$tmp/separators_out.log")"

# --val-docs: one document fewer than the inputs hold leaves one for training; all of them none.
run_shards "$tmp/val_all" --blank-lines --val-docs 3 "$tmp/blank.txt"; rc=$?
check "--val-docs taking every document is refused" \
    "$([ $rc -ne 0 ] && grep -q 'error: --val-docs 3 takes all 3 documents of the inputs: none is left for training' "$tmp/val_all.log" &&
       [ ! -e "$tmp/val_all" ]; echo $?)" "$(cat "$tmp/val_all.log")"
run_shards "$tmp/val_most" --blank-lines --val-docs 2 "$tmp/blank.txt"
check "--val-docs one below the document count leaves one for training" $? "$(cat "$tmp/val_most.log")"

# One document past 16 MiB is warned about (its encoding needs about 40 bytes per byte); smaller
# ones are not. One byte past it: 16777217 bytes, printed as 17 MB and 40 x 16777217 B = 0.7 GB.
python3 -c "import sys; open(sys.argv[1], 'w').write('word ' * ((16 << 20) // 5) + 'x' * ((16 << 20) % 5 + 1))" "$tmp/big.txt"
run_shards "$tmp/big_out" --threads 1 "$tmp/big.txt"
check "a document of 16 MiB + 1 byte is warned about, with the memory it takes" \
    "$(grep -q "warning: $tmp/big.txt: a document of 17 MB; encoding one takes about 0.7 GB of memory per thread" "$tmp/big_out.log"; echo $?)" \
    "$(head -2 "$tmp/big_out.log")"
check "documents below 16 MB are not" "$(! grep -q 'a document of' "$tmp/out1.log"; echo $?)"

# ./tokenize decode: ids up to the last one of the vocabulary; past it, however many digits, the
# message says so rather than "not a token id".
out=$(printf '72 105 257' | ./tokenize decode -t "$tmp/tokenizer.json" 2>&1); rc=$?
check "decode takes ids up to vocab_size - 1" "$([ $rc -eq 0 ] && [ "$(printf '%s' "$out" | head -c 2)" = "Hi" ]; echo $?)" "$out"
for id in 258 99999999999999999999999999; do
    out=$(printf '72 %s' "$id" | ./tokenize decode -t "$tmp/tokenizer.json" 2>&1); rc=$?
    check "decode refuses id $id as outside the vocabulary" \
        "$([ $rc -ne 0 ] && [ "$out" = "error: stdin: token id $id is outside the vocabulary (size 258)" ]; echo $?)" "$out"
done
out=$(printf '72 1x' | ./tokenize decode -t "$tmp/tokenizer.json" 2>&1); rc=$?
check "decode refuses text that is no number" \
    "$([ $rc -ne 0 ] && [ "$out" = "error: stdin: not a token id at byte 3" ]; echo $?)" "$out"

# Malformed input under AddressSanitizer and UBSan (tokenize built here from tokenizer/*.c): a
# release build may survive reading memory it never set, a sanitized one stops at the first read.
if ${CC:-cc} -std=c11 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -pthread -D_DEFAULT_SOURCE \
        -D_FILE_OFFSET_BITS=64 tokenizer/*.c -o "$tmp/tokenize_asan" -lm > "$tmp/asan_build.log" 2>&1; then
    printf '{"text": "\\ud800"}\n{"text": ""}\n{"text": "a"}\n' > "$tmp/edges.jsonl"
    : > "$tmp/empty.txt"
    problems=""
    for input in 'x' '72 abc' '' ' ' '1 -2' '+1'; do
        out=$(printf '%s' "$input" | ASAN_OPTIONS=detect_leaks=0 "$tmp/tokenize_asan" decode -t "$tmp/tokenizer.json" 2>&1); rc=$?
        printf '%s' "$out" | grep -qE 'runtime error|AddressSanitizer' && problems+="decode '$input': $(printf '%s' "$out" | head -3 | tr '\n' ' '); "
        [ $rc -le 1 ] || problems+="decode '$input': exit $rc; "
    done
    for args in "shards -t $tmp/tokenizer.json -o $tmp/asan_out1 $tmp/edges.jsonl" "shards -t $tmp/tokenizer.json -o $tmp/asan_out2 $tmp/empty.txt" \
                "shards -t $tmp/tokenizer.json" "shards -o" "encode -t" "decode" "shards -t $tmp/empty.txt -o $tmp/asan_out3 $tmp/blank.txt"; do
        # shellcheck disable=SC2086
        out=$(ASAN_OPTIONS=detect_leaks=0 "$tmp/tokenize_asan" $args < /dev/null 2>&1); rc=$?
        printf '%s' "$out" | grep -qE 'runtime error|AddressSanitizer' && problems+="$args: $(printf '%s' "$out" | head -3 | tr '\n' ' '); "
        [ $rc -le 2 ] || problems+="$args: exit $rc; "
    done
    check "malformed ids, JSONL edges, empty files and missing option values: no sanitizer report, exit 1 or 2" \
        "$([ -z "$problems" ]; echo $?)" "$problems"
else
    echo "SKIP the sanitizer checks (${CC:-cc} cannot build with -fsanitize=address,undefined: $(tail -1 "$tmp/asan_build.log"))"
fi
out=$(printf 'x' | ./tokenize decode -t "$tmp/tokenizer.json" 2>&1); rc=$?
check "decode refuses text that starts with no digit" \
    "$([ $rc -eq 1 ] && [ "$out" = "error: stdin: not a token id at byte 0" ]; echo $?)" "$out"

# Special files: a FIFO as an input or as the tokenizer is refused at once, naming what it is
# (opening one would block until a writer comes); an empty -o is no output folder.
mkfifo "$tmp/fifo"
out=$(timeout 10 ./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/fifo_out" "$tmp/fifo" 2>&1); rc=$?
check "a FIFO as an input is refused naming it, without blocking" \
    "$([ $rc -eq 1 ] && [ "$out" = "error: $tmp/fifo: neither a regular file nor a directory (a FIFO)" ] && [ ! -e "$tmp/fifo_out" ]; echo $?)" "exit $rc: $out"
out=$(timeout 10 ./tokenize encode -t "$tmp/fifo" < /dev/null 2>&1); rc=$?
check "a FIFO as the tokenizer is refused naming it, without blocking" \
    "$([ $rc -eq 1 ] && [ "$out" = "error: $tmp/fifo: not a regular file (a FIFO)" ]; echo $?)" "exit $rc: $out"
out=$(cd "$tmp" && "$OLDPWD/tokenize" shards -t "$tmp/tokenizer.json" -o '' "$tmp/blank.txt" 2>&1); rc=$?
check "an empty -o is refused before anything is written" \
    "$([ $rc -eq 1 ] && [ "$out" = "error: no output directory: give -o DIR" ] && [ ! -e "$tmp/.partial" ]; echo $?)" "exit $rc: $out"

# Compressed inputs: NAME.gz (zlib) and NAME.zst (libzstd) give the same shards as NAME, for text
# split at a separator and for JSONL, across several read blocks and gzip members; a cut file is
# an error. A build without the library refuses the file instead, naming the package.
mkdir -p "$tmp/packed"
cp "$tmp/in/a.txt" "$tmp/packed/a.txt"
cat "$tmp/in/sub/c.jsonl" "$tmp/in/sub/c.jsonl" > "$tmp/packed/c.jsonl"
python3 - "$tmp/packed" <<'PYTHON'
import gzip, sys
root = sys.argv[1]
for name in ("a.txt", "c.jsonl"):
    data = open(f"{root}/{name}", "rb").read()
    with open(f"{root}/{name}.gz", "wb") as f:  # two gzip members, as `cat a.gz b.gz` makes
        f.write(gzip.compress(data[:len(data) // 3]) + gzip.compress(data[len(data) // 3:]))
open(f"{root}/cut.txt.gz", "wb").write(open(f"{root}/a.txt.gz", "rb").read()[:5000])
PYTHON
formats=$(./tokenize shards --help | grep -o 'this build reads .*')
for suffix in gz zst; do
    library=$([ $suffix = gz ] && echo zlib || echo zstd)
    if [ $suffix = zst ]; then
        if ! command -v zstd > /dev/null; then echo "SKIP .zst inputs (no zstd command to make them)"; continue; fi
        for name in a.txt c.jsonl; do zstd -q -f "$tmp/packed/$name" -o "$tmp/packed/$name.zst"; done
        head -c 5000 "$tmp/packed/a.txt.zst" > "$tmp/packed/cut.txt.zst"
    fi
    if printf '%s' "$formats" | grep -q "^this build reads [^;]*(.$suffix)"; then
        same=0; detail=""
        for name in a.txt c.jsonl; do
            run_shards "$tmp/plain_${suffix}_$name" --separator '<|sep|>' --threads 2 "$tmp/packed/$name" || { same=1; detail+="$(cat "$tmp/plain_${suffix}_$name.log") "; }
            run_shards "$tmp/${suffix}_$name" --separator '<|sep|>' --threads 2 "$tmp/packed/$name.$suffix" ||
                { same=1; detail+="$(cat "$tmp/${suffix}_$name.log") "; }
            diff -r "$tmp/plain_${suffix}_$name" "$tmp/${suffix}_$name" > /dev/null || same=1
        done
        check ".$suffix text and JSONL give byte-identical shards to the plain files" $same "$detail"
        out=$(./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/cut_$suffix" "$tmp/packed/cut.txt.$suffix" 2>&1); rc=$?
        check "a cut .$suffix file is an error naming it, and leaves no output" \
            "$([ $rc -eq 1 ] && [ "$out" = "error: $tmp/packed/cut.txt.$suffix: the compressed data ends early (a truncated file?)" ] &&
               [ ! -e "$tmp/cut_$suffix" ]; echo $?)" "exit $rc: $out"
    else
        out=$(./tokenize shards -t "$tmp/tokenizer.json" -o "$tmp/no_$suffix" "$tmp/packed/a.txt.$suffix" 2>&1); rc=$?
        check "a build without $library refuses .$suffix inputs naming the package" \
            "$([ $rc -eq 1 ] && printf '%s' "$out" | grep -q "cannot read .$suffix files (install"; echo $?)" "exit $rc: $out"
    fi
done

check_summary test_shards
