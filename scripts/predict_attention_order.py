#!/usr/bin/env python3
"""Predicted effect of the block order of the causal attention passes (AttentionOrder in
coat/attention.cuh), on paper: the end of a pass whose blocks do unequal work depends on the order
in which the GPU starts them.

  blocks  A pass has tiles x pairs blocks, a pair being (head, batch) for the forward and the dQ
          pass and (kv head, batch) for the dK/dV pass, with the program's tiles: at head_dim 64
          blocks of 192 rows (3 consumer warpgroups), at 128 of 128 rows (2).
  work    In steps of one K/V or query tile: a forward block walks its K/V tiles of 128 keys up to
          its last row's diagonal (query blocks end at T rounded up to 64 rows, the partial one
          first), a dQ block its K/V tiles of 64, and a dK/dV block every query
          tile of 64 rows of each query head of its kv head from its first key on. Each block also
          costs --block-overhead steps (loads before the first step, stores after the last).
  GPU     --sms SMs, one block each (every pass uses the SM's registers); a free SM starts the next
          block in index order (list scheduling), and the pass ends when its last block does.
  orders  grid: pair after pair, each pair's tiles longest first; longest first: tile by tile over
          all pairs; L2 chunks: the same within chunks of pairs whose shared reads fit half of
          --l2-mib, as the launchers size them (a forward pair's Q and its kv head's K/V shared by
          the heads of the group, a dQ pair's Q and dO beside them, a dK/dV pair's Q and dO of all
          its query heads).

The model leaves out what the order does to memory traffic: longest first makes the blocks that run
side by side belong to different pairs, so they no longer share K/V or Q/dO through L2, which is
what made it slower on the GPU at head_dim 128 (configs/results/performance.md).
Prints one row per shape and pass: the predicted speed-up of each order over the grid's, and the
bound (the grid's time over a perfectly balanced pass).
Usage: scripts/predict_attention_order.py [--sms N] [--block-overhead STEPS] [--l2-mib MIB]
"""
import argparse
import heapq
import math

SHAPES = [  # name, B, heads, kv heads, T, head_dim
    ("llama-125m 64 x 1024", 64, 12, 4, 1024, 64),
    ("llama-1b 16 x 2048", 16, 32, 8, 2048, 64),
    ("4 x 2048, 32 heads", 4, 32, 32, 2048, 128),
    ("8 x 4096, 16 heads", 8, 16, 16, 4096, 128),
    ("llama2-7b 13 x 2048", 13, 32, 32, 2048, 128),
    ("llama3-8b 10 x 2048", 10, 32, 8, 2048, 128),
]


def end_time(durations, sms):
    """When the last block ends, each started on the first SM free, in order."""
    free = [0.0] * sms
    for d in durations:
        heapq.heappush(free, heapq.heappop(free) + d)
    return max(free)


def in_order(work, tiles, pairs, chunk):
    """Block durations in launch order: chunks of pairs, tile by tile in each (chunk 1: the grid's)."""
    order = []
    for first in range(0, pairs, chunk):
        for x in range(tiles):
            order += [work[x]] * (min(first + chunk, pairs) - first)
    return order


def passes(b, nh, nkv, t, hd, overhead):
    """(name, work of tile x (longest first), pairs, bytes a pair's blocks share) of each pass."""
    rows = 192 if hd == 64 else 128
    q_blocks = math.ceil(t / rows)
    head_bytes = t * hd * 2

    def tiles_to_diagonal(x, kv):  # K/V tiles up to the last row of query block q_blocks - 1 - x
        return (min(math.ceil(t / 64) * 64 - x * rows, t) - 1) // kv + 1  # the blocks end at T

    forward = [tiles_to_diagonal(x, 128) + overhead for x in range(q_blocks)]
    dq = [tiles_to_diagonal(x, 64) + overhead for x in range(q_blocks)]
    dkdv = [nh // nkv * (math.ceil(t / 64) - x * rows // 64) + overhead for x in range(q_blocks)]
    return [("forward", forward, nh * b, head_bytes * (1 + 2 * nkv / nh)),
            ("dK/dV", dkdv, nkv * b, 2 * head_bytes * nh / nkv),
            ("dQ", dq, nh * b, head_bytes * (2 + 2 * nkv / nh))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sms", type=int, default=132, help="SMs (an H200 has 132)")
    parser.add_argument("--block-overhead", type=float, default=1.0, help="steps a block costs besides its tiles")
    parser.add_argument("--l2-mib", type=float, default=50.0, help="L2 cache in MiB (an H200 has 50)")
    args = parser.parse_args()
    if args.sms < 1 or args.block_overhead < 0 or args.l2_mib <= 0:
        parser.error("--sms must be at least 1, --block-overhead at least 0 and --l2-mib above 0")
    print("| shape | pass | blocks | longest first | L2 chunks (pairs a chunk) | bound |")
    print("|---|---|---|---|---|---|")
    for name, b, nh, nkv, t, hd in SHAPES:
        for pass_name, work, pairs, pair_bytes in passes(b, nh, nkv, t, hd, args.block_overhead):
            tiles = len(work)
            chunk = max(1, min(pairs, int(0.5 * args.l2_mib * 2**20 // pair_bytes)))
            grid = end_time(in_order(work, tiles, pairs, 1), args.sms)
            longest = end_time(in_order(work, tiles, pairs, pairs), args.sms)
            chunked = end_time(in_order(work, tiles, pairs, chunk), args.sms)
            balanced = sum(work) * pairs / args.sms
            print(f"| {name}, head_dim {hd} | {pass_name} | {tiles * pairs} | {grid / longest:.3f}x | "
                  f"{grid / chunked:.3f}x ({chunk}) | {grid / balanced:.3f}x |")


if __name__ == "__main__":
    main()
