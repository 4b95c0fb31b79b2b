#!/usr/bin/env bash
# Hugging Face interop and sampling on the GPU: a checkpoint exported with scripts/convert_hf.py
# loads in transformers' LlamaForCausalLM and gives the trainer's logits; importing it back gives
# the same weights; greedy sampling is reproducible and top-p sampling runs.
# Needs python3 with torch and transformers, and the Llama 2 tokenizer (scripts/fetch_tokenizers.sh).
cd "$(dirname "$0")/.." || exit 1
source test/check.sh
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
tokenizer=data/tokenizers/llama2/tokenizer.json

python3 - "$tmp" <<'PY'
import random, struct, sys
random.seed(2)
count = 100000
tokens = [random.randrange(32000) for _ in range(count)]
with open(f"{sys.argv[1]}/train_000000.bin", "wb") as f:
    f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
    f.write(struct.pack(f"<{count}H", *tokens))
PY
run=(configs/models/tiny.conf --vocab_size=32000 --tokenizer="$tokenizer")
./train_llama "${run[@]}" --train_data="$tmp/train_*.bin" --micro_batch_size=4 --seq_len=64 --max_steps=20 \
    --warmup_steps=2 --val_every=0 --out_dir="$tmp/run" > "$tmp/train.out" 2>&1
check "a small model trains and checkpoints" $? "$(tail -2 "$tmp/train.out")"
ckpt="$tmp/run/ckpt_00000020.bin"
python3 scripts/convert_hf.py export "$ckpt" "$tmp/hf" --dtype float32 > "$tmp/export.out" 2>&1
check "convert_hf.py exports the checkpoint" $? "$(tail -2 "$tmp/export.out")"

prompt="The quick brown fox jumps over the lazy dog, and then it runs into the forest where"
generate() {  # generate CHECKPOINT OUT [extra keys]
    local ckpt=$1 out=$2; shift 2
    ./train_llama "${run[@]}" --generate=1 --init_from="$ckpt" --sample_prompt="$prompt" --sample_tokens=16 "$@" > "$out" 2>&1
}
generate "$ckpt" "$tmp/greedy1.out" --top_p=0 --logits_out="$tmp/logits.bin"
check "generate writes the prompt's logits and a greedy sample" \
    "$([ $? -eq 0 ] && grep -q '^sample (greedy' "$tmp/greedy1.out" && [ -s "$tmp/logits.bin" ]; echo $?)" "$(tail -2 "$tmp/greedy1.out")"
python3 scripts/check_hf_export.py "$tmp/hf" "$tmp/logits.bin" --tolerance 0.1 > "$tmp/check.out" 2>&1
check "transformers' LlamaForCausalLM gives our logits (BF16 compute vs FP32: max abs diff under 0.1)" $? \
    "$(tail -3 "$tmp/check.out" | tr '\n' ' ')"
grep -E "max abs|argmax" "$tmp/check.out" | sed 's/^/  /'
generate "$ckpt" "$tmp/greedy2.out" --top_p=0
check "greedy sampling is reproducible" "$(diff <(grep '^sample' "$tmp/greedy1.out") <(grep '^sample' "$tmp/greedy2.out") >/dev/null; echo $?)"
generate "$ckpt" "$tmp/topp.out" --top_p=0.9 --temperature=1.0
check "top-p sampling runs" "$([ $? -eq 0 ] && grep -q '^sample (top-p' "$tmp/topp.out"; echo $?)" "$(tail -2 "$tmp/topp.out")"

python3 scripts/convert_hf.py import "$tmp/hf" "$tmp/imported.bin" > "$tmp/import.out" 2>&1
check "convert_hf.py imports the folder back" $? "$(tail -2 "$tmp/import.out")"
generate "$tmp/imported.bin" "$tmp/greedy3.out" --top_p=0 --logits_out="$tmp/logits_imported.bin"
check "the imported checkpoint gives the same logits, to the bit" "$(cmp -s "$tmp/logits.bin" "$tmp/logits_imported.bin"; echo $?)"

check_summary test_hf
