#!/usr/bin/env python3
"""PyTorch side of the attention benchmark: causal BF16 attention through
torch.nn.functional.scaled_dot_product_attention with the flash and the cuDNN backends
(torch.nn.attention.sdpa_kernel), at the four shapes of the attention peers in coat/README.md,
the shapes that test/test_attention.cu times our kernels at. Prints one line per backend and
shape, then one JSON line with every figure.

  scripts/bench_attention.py [--runs N] [--warmup W]

TFLOP/s count the causal work: forward = 4 * B * NH * T^2 * hd / 2, forward+backward = 3.5x that.
Grouped-query shapes run with enable_gqa=True (K and V stay NKV heads); a backend that refuses
it is run on K and V expanded to NH heads instead, and the line says so.
Times are CUDA-event medians of N runs after W warm-up runs.
"""
import argparse
import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [  # B, NH, NKV, T, hd
    (64, 12, 4, 1024, 64),
    (16, 32, 8, 2048, 64),
    (4, 32, 32, 2048, 128),
    (8, 16, 16, 4096, 128),
]
BACKENDS = [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def median_ms(fn, runs, warmup):
    """Median wall time of fn() on the GPU, in milliseconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def bench_shape(backend, B, NH, NKV, T, hd, runs, warmup):
    """Forward and forward+backward milliseconds, and whether K/V had to be expanded."""
    q = torch.randn(B, NH, T, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, NKV, T, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, NKV, T, hd, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, NH, T, hd, device="cuda", dtype=torch.bfloat16)

    def attention(expand):
        if expand and NKV != NH:
            group = NH // NKV
            return F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1),
                                                  v.repeat_interleave(group, dim=1), is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=NKV != NH)

    with sdpa_kernel(backend):
        expand = False
        try:
            attention(expand)
        except RuntimeError:
            expand = True
            attention(expand)

        def forward():  # with autograd on, as in training: the backend saves its logsumexp
            attention(expand)

        def forward_backward():
            q.grad = k.grad = v.grad = None
            attention(expand).backward(dout)

        return median_ms(forward, runs, warmup), median_ms(forward_backward, runs, warmup), expand


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: bench_attention.py: no CUDA device", file=sys.stderr)
        sys.exit(1)
    results = []
    for name, backend in BACKENDS:
        for B, NH, NKV, T, hd in SHAPES:
            forward_flops = 4.0 * B * NH * T * T * hd / 2
            try:
                fwd_ms, both_ms, expanded = bench_shape(backend, B, NH, NKV, T, hd, args.runs, args.warmup)
            except RuntimeError as err:
                print(f"sdpa {name} B={B} NH={NH} NKV={NKV} T={T} hd={hd}: unavailable ({str(err).splitlines()[0]})")
                continue
            fwd_tflops = forward_flops / (fwd_ms * 1e-3) / 1e12
            both_tflops = 3.5 * forward_flops / (both_ms * 1e-3) / 1e12
            note = " (K/V expanded: no enable_gqa)" if expanded else ""
            print(f"sdpa {name} B={B} NH={NH} NKV={NKV} T={T} hd={hd}: forward {fwd_ms:.3f} ms {fwd_tflops:.0f} TFLOP/s, "
                  f"forward+backward {both_ms:.3f} ms {both_tflops:.0f} TFLOP/s{note}")
            results.append({"backend": name, "B": B, "NH": NH, "NKV": NKV, "T": T, "head_dim": hd,
                            "forward_ms": fwd_ms, "forward_tflops": fwd_tflops, "forward_backward_ms": both_ms,
                            "forward_backward_tflops": both_tflops, "kv_expanded": expanded})
    print(json.dumps({"torch": torch.__version__, "results": results}))


if __name__ == "__main__":
    main()
