#!/usr/bin/env python3
"""Writes PATH: N random token ids below 32000 (default 8M) in llm.c's uint16 shard format, for
throughput benchmarks, where the content is irrelevant; an existing PATH is kept.

Usage: scripts/random_shard.py PATH [N]
"""
import os
import random
import struct
import sys

if len(sys.argv) not in (2, 3) or sys.argv[1].startswith("-"):  # --help is no path to write
    sys.exit(__doc__.strip())
path, count = sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 8 << 20
if not os.path.exists(path):
    rng = random.Random(0)
    with open(path + ".partial", "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, count, *([0] * 253)))
        f.write(struct.pack(f"<{count}H", *(rng.randrange(32000) for _ in range(count))))
    os.replace(path + ".partial", path)
