#!/usr/bin/env bash
# For machines that reach the Hugging Face hub: downloads TinyStories (GPT-4 generated short
# stories, about 2.2 GB of text, stories separated by "<|endoftext|>") and tokenizes them with
# the Llama 2 tokenizer into llm.c-format shards, 0.5% of the stories, evenly spread, held out
# for validation:
#   data/tinystories/TinyStoriesV2-GPT4-train.txt
#   data/tinystories/llama2/train_000000.bin ... val_000000.bin
# Idempotent: the download and the shards are kept when already complete.
# Usage: scripts/fetch_tinystories.sh [--threads N]
set -euo pipefail
cd "$(dirname "$0")/.."

DIR=data/tinystories
TEXT=$DIR/TinyStoriesV2-GPT4-train.txt
URL=https://huggingface.co/datasets/roneneldan/TinyStories/resolve/main/TinyStoriesV2-GPT4-train.txt
TOKENIZER=data/tokenizers/llama2/tokenizer.json
SHARDS=$DIR/llama2
THREADS=()
usage() { echo "usage: scripts/fetch_tinystories.sh [--threads N]" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case $1 in
        --threads) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || usage; THREADS=(--threads "$2"); shift 2 ;;
        *) usage ;;
    esac
done

mkdir -p "$DIR"
if [ ! -f "$TEXT" ]; then
    echo "fetch_tinystories: downloading $URL"
    curl -fL --retry 3 -o "$TEXT.partial" "$URL" ||
        { echo "error: $URL: download failed (is the Hugging Face hub reachable?)" >&2; exit 1; }
    mv "$TEXT.partial" "$TEXT"
fi
if [ ! -f "$TOKENIZER" ]; then
    scripts/fetch_tokenizers.sh
fi
if [ ! -f "$SHARDS/summary.txt" ]; then
    make tokenize
    ./tokenize shards -t "$TOKENIZER" -o "$SHARDS" --overwrite --separator '<|endoftext|>' --val-fraction 0.005 \
        "${THREADS[@]}" "$TEXT" > "$SHARDS.summary.partial"
    mv "$SHARDS.summary.partial" "$SHARDS/summary.txt"
fi
cat "$SHARDS/summary.txt"
