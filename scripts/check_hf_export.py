#!/usr/bin/env python3
"""Checks an exported HF folder against logits computed by our trainer (or by train_llama.py --logits).

  check_hf_export.py HF_DIR LOGITS_FILE --tolerance TOL [--seq-len T] [--device cuda]

Loads HF_DIR with transformers' LlamaForCausalLM in float32 (eager attention, no TF32), runs the
tokens of LOGITS_FILE (int32 [n_tokens, vocab], int32 tokens, float32 logits [n_tokens, vocab]) as
sequences of T tokens (default: one sequence of all of them), and compares the logits: prints the
max abs difference and PASS or FAIL against TOL; exit status 0 on PASS, 1 otherwise.
"""
import argparse
import json
import os
import sys

import torch
from transformers import LlamaForCausalLM

from llama_layout import FormatError, open_regular, read_logits_file


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("logits_file")
    parser.add_argument("--tolerance", type=float, required=True, help="largest max abs logit difference that passes")
    parser.add_argument("--seq-len", type=int, default=0, help="tokens per sequence (default: all in one)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    try:
        tokens, vocab, logits_bytes = read_logits_file(args.logits_file)
    except FormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    seq_len = args.seq_len or len(tokens)
    if len(tokens) % seq_len != 0:
        print(f"error: {args.logits_file}: {len(tokens)} tokens do not split into sequences of {seq_len}",
              file=sys.stderr)
        return 1
    config_path = os.path.join(args.hf_dir, "config.json")
    try:
        with open_regular(config_path, encoding="utf-8") as f:
            hf_vocab = json.load(f)["vocab_size"]
    except (OSError, ValueError, KeyError):
        print(f"error: {config_path}: cannot read vocab_size", file=sys.stderr)
        return 1
    if hf_vocab != vocab:
        print(f"error: {config_path}: vocab_size {hf_vocab}, {args.logits_file} has {vocab}", file=sys.stderr)
        return 1

    torch.set_float32_matmul_precision("highest")
    model = LlamaForCausalLM.from_pretrained(args.hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.to(args.device).eval()
    input_ids = torch.tensor(tokens, dtype=torch.long, device=args.device).view(-1, seq_len)
    with torch.no_grad():
        hf_logits = model(input_ids=input_ids, use_cache=False).logits.float().reshape(-1, vocab).cpu()
    our_logits = torch.frombuffer(bytearray(logits_bytes), dtype=torch.float32).view(-1, vocab)

    max_abs_diff = (hf_logits - our_logits).abs().max().item()
    argmax_agreement = (hf_logits.argmax(-1) == our_logits.argmax(-1)).float().mean().item()
    passed = max_abs_diff <= args.tolerance
    print(json.dumps({"hf_dir": args.hf_dir, "n_tokens": len(tokens), "vocab": vocab,
                      "max_abs_diff": max_abs_diff, "max_abs_logit": our_logits.abs().max().item(),
                      "argmax_agreement": argmax_agreement, "tolerance": args.tolerance}))
    print(f"{'PASS' if passed else 'FAIL'} HF logits vs ours: max abs diff {max_abs_diff:.3g} "
          f"(tolerance {args.tolerance:g}), argmax agreement {100 * argmax_agreement:.1f}%")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
