#!/usr/bin/env bash
# Tokenizer speed, MB/s of UTF-8 text, on the same text:
#   ours       ./tokenize encode, one thread (the text's time minus the time for empty input,
#              so the tokenizer.json load is not counted)
#   HF 1       Hugging Face tokenizers encode(), one thread (RAYON_NUM_THREADS=1), line by line
#   HF batch   tokenizers encode_batch() over the lines on all cores
#   tiktoken   encode_ordinary(), one thread, line by line (Llama 3 only: an Encoding built from
#              the tokenizer.json's vocab, its special tokens and its Split regex)
#   shards 1 / shards N   ./tokenize shards on the text split into 64 documents, with 1 thread and
#              with all cores (whole command, writing the shards)
# Usage: scripts/bench_tokenizer.sh TEXT NAME=TOKENIZER.json [NAME=...]
# Needs python3 with tokenizers and tiktoken (the GPU machine has them). Best of 3 runs each.
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: scripts/bench_tokenizer.sh TEXT NAME=TOKENIZER.json [NAME=...]" >&2; exit 2; }
[ $# -ge 2 ] || usage
# Every input a regular file before anything runs: a FIFO would block its first read.
for path in "$1" "${@:2}"; do
    [ "$path" = "$1" ] || [[ $path == ?*=?* ]] || usage
    [ "$path" = "$1" ] || path=${path#*=}
    [ -f "$path" ] || { echo "error: $path: not a regular file" >&2; exit 2; }
done
text=$1
shift
make -s tokenize >/dev/null

seconds() { # best wall time of 3 runs of: ./tokenize encode -t $1 < $2
    local best=
    for _ in 1 2 3; do
        local start end
        start=$(date +%s.%N)
        ./tokenize encode -t "$1" < "$2" > /dev/null
        end=$(date +%s.%N)
        best=$(python3 -c "print(min(float('${best:-1e9}'), $end - $start))")
    done
    echo "$best"
}

python_engines() { # python_engines TEXT NAME TOKENIZER.json ENGINES: MB/s of each engine named
    python3 - "$@" <<'EOF'
import json, sys, time
from tokenizers import Tokenizer
text_path, name, path, engines = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split(",")
lines = open(text_path, "rb").read().decode("utf-8", errors="replace").splitlines(keepends=True)
mb = sum(len(l.encode("utf-8")) for l in lines) / 1e6
tok = Tokenizer.from_file(path)
def best(f):
    times = []
    for _ in range(3):
        start = time.perf_counter(); f(); times.append(time.perf_counter() - start)
    return min(times)
def report(engine, f):
    print("%-8s %-10s %10.2f" % (name, engine, mb / best(f)))
if "HF 1" in engines:
    report("HF 1", lambda: [tok.encode(l, add_special_tokens=False) for l in lines])
if "HF batch" in engines:
    report("HF batch", lambda: tok.encode_batch(lines, add_special_tokens=False))
config = json.load(open(path, encoding="utf-8"))
pre = config.get("pre_tokenizer") or {}
split = [p for p in pre.get("pretokenizers", []) if p.get("type") == "Split"]
if "tiktoken" in engines and split:
    import tiktoken
    # Invert the GPT-2 byte-to-character map to get each token's bytes.
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or b >= 174]
    char_of = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in char_of:
            char_of[b] = chr(256 + extra); extra += 1
    byte_of = {c: b for b, c in char_of.items()}
    ranks = {bytes(byte_of[c] for c in token): rank for token, rank in config["model"]["vocab"].items()}
    special = {t["content"]: t["id"] for t in config["added_tokens"]}
    enc = tiktoken.Encoding(name=name, pat_str=split[0]["pattern"]["Regex"], mergeable_ranks=ranks, special_tokens=special)
    report("tiktoken", lambda: [enc.encode_ordinary(l) for l in lines])
EOF
}

bytes=$(stat -c %s "$text")
echo "text: $text, $bytes bytes, $(nproc) cores"
printf '%-8s %-10s %10s\n' tokenizer engine MB/s
for spec in "$@"; do
    name=${spec%%=*}
    path=${spec#*=}
    load=$(seconds "$path" /dev/null)
    total=$(seconds "$path" "$text")
    python3 -c "print('%-8s %-10s %10.2f' % ('$name', 'ours', $bytes / 1e6 / ($total - $load)))"
    RAYON_NUM_THREADS=1 python_engines "$text" "$name" "$path" "HF 1"
    python_engines "$text" "$name" "$path" "HF batch,tiktoken"
    # ./tokenize shards: the text cut into 64 documents, 1 thread and all cores.
    docs=$(mktemp -d)
    split -n l/64 -d -a 2 "$text" "$docs/doc_"
    for threads in 1 "$(nproc)"; do
        start=$(date +%s.%N)
        ./tokenize shards -t "$path" -o "$docs/out_$threads" --threads "$threads" "$docs"/doc_* > /dev/null 2>&1
        end=$(date +%s.%N)
        python3 -c "print('%-8s %-10s %10.2f' % ('$name', 'shards $threads', $bytes / 1e6 / ($end - $start)))"
    done
    cmp -s "$docs/out_1/train_000000.bin" "$docs/out_$(nproc)/train_000000.bin" || echo "error: shards differ between thread counts" >&2
    rm -rf "$docs"
done
