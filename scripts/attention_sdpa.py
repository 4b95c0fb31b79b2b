#!/usr/bin/env python3
"""Random causal GQA attention cases with PyTorch SDPA's answers, for test/test_attention.cu.

  scripts/attention_sdpa.py OUT.bin [--cases N] [--seed S]

Each case draws B, T (any length, mostly not a multiple of 64), head_dim 64 or 128 and a
(query heads, kv heads) pair, then BF16 inputs in our packed layout: qkv [B, T, (NH + 2 NKV) hd]
(q with std 1.5 so that the softmax is peaked, k and v std 1) and dout [B, T, NH hd] (std 1).
It runs torch.nn.functional.scaled_dot_product_attention (is_causal, enable_gqa) twice on them:
in float64 (the math backend), the reference, and in BF16 with the backend PyTorch picks (flash or
cuDNN), whose distance to the reference is the error a BF16 attention is allowed.

File (little-endian): int32 header[16] = {20261129, 1, cases, 0...}; per case int32 shape[8] =
{B, T, NH, NKV, hd, 0, 0, 0}, then uint16 qkv bits (BF16), uint16 dout bits, and float32
out_ref [B, T, NH hd], dqkv_ref [B, T, (NH + 2 NKV) hd], out_bf16, dqkv_bf16 (the BF16 run).
"""
import argparse
import random
import struct

import torch
import torch.nn.functional as F

MAGIC, VERSION = 20261129, 1
HEAD_PAIRS = [(4, 4), (8, 2), (12, 4), (16, 8), (32, 8), (6, 1)]
MAX_QKV_ELEMENTS = 3 << 20  # keeps the file (12 cases) under about 0.5 GB


def sdpa(qkv, dout, B, T, NH, NKV, hd, dtype):
    """out [B, T, NH hd] and dqkv [B, T, (NH + 2 NKV) hd] of causal GQA attention in dtype."""
    x = qkv.to(dtype).requires_grad_()
    q, k, v = x.view(B, T, NH + 2 * NKV, hd).split([NH, NKV, NKV], dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                         enable_gqa=True)
    out = out.transpose(1, 2).reshape(B, T, NH * hd)
    out.backward(dout.to(dtype))
    return out.detach(), x.grad


def draw_case(rng):
    """B, T, NH, NKV, hd with at most MAX_QKV_ELEMENTS elements in qkv."""
    NH, NKV = rng.choice(HEAD_PAIRS)
    hd = rng.choice([64, 128])
    width = (NH + 2 * NKV) * hd
    T = min(rng.choice([rng.randint(1, 200), rng.randint(200, 1500)]), MAX_QKV_ELEMENTS // width)
    B = min(rng.randint(1, 3), MAX_QKV_ELEMENTS // (T * width))
    return B, T, NH, NKV, hd


def bits(t):
    return t.contiguous().view(torch.int16).cpu().numpy().tobytes()


def floats(t):
    return t.to(torch.float32).contiguous().cpu().numpy().tobytes()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--cases", type=int, default=12)
    parser.add_argument("--seed", type=int, default=20261129)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    with open(args.out, "wb") as f:
        f.write(struct.pack("<16i", MAGIC, VERSION, args.cases, *([0] * 13)))
        for _ in range(args.cases):
            B, T, NH, NKV, hd = draw_case(rng)
            scale = torch.tensor([1.5] * NH + [1.0] * (2 * NKV), device="cuda").repeat_interleave(hd)
            qkv = (torch.randn(B, T, (NH + 2 * NKV) * hd, device="cuda") * scale).to(torch.bfloat16)
            dout = torch.randn(B, T, NH * hd, device="cuda").to(torch.bfloat16)
            out_ref, dqkv_ref = sdpa(qkv, dout, B, T, NH, NKV, hd, torch.float64)
            out_bf16, dqkv_bf16 = sdpa(qkv, dout, B, T, NH, NKV, hd, torch.bfloat16)
            f.write(struct.pack("<8i", B, T, NH, NKV, hd, 0, 0, 0))
            for t in (bits(qkv), bits(dout), floats(out_ref), floats(dqkv_ref), floats(out_bf16), floats(dqkv_bf16)):
                f.write(t)
            print(f"case B={B} T={T} NH={NH} NKV={NKV} hd={hd}")


if __name__ == "__main__":
    main()
