#!/usr/bin/env python3
"""Converts a Parquet file of documents to the JSONL that `./tokenize shards` reads: one line
{"text": ...} per row, from the column COLUMN (default "text"), in row order; rows whose value is
null are left out. Reads in batches, so a file larger than memory converts; writes OUT.partial and
renames it at the end, so a failed run leaves no half-written OUT.

  parquet_to_jsonl.py IN.parquet OUT.jsonl [--column NAME]

Needs pyarrow (pip install pyarrow).
"""
import argparse
import json
import os
import stat
import sys


def regular_file(path: str) -> str:
    """The path when it names a regular file: a FIFO would block the read, a directory fail late."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise SystemExit(f"error: {path}: cannot open: {e.strerror}")
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "a special file"
        raise SystemExit(f"error: {path}: not a regular file ({kind})")
    return path


def convert(source: str, out: str, column: str) -> int:
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise SystemExit("error: scripts/parquet_to_jsonl.py needs pyarrow (pip install pyarrow)")
    try:
        table = parquet.ParquetFile(source)
    except Exception as e:  # pyarrow raises its own error types for a file that is not Parquet
        raise SystemExit(f"error: {source}: not a Parquet file ({e})")
    if column not in table.schema_arrow.names:
        raise SystemExit(f"error: {source}: no column '{column}' (columns: {', '.join(table.schema_arrow.names)})")
    rows = 0
    partial = out + ".partial"
    try:
        with open(partial, "w", encoding="utf-8") as f:
            for batch in table.iter_batches(columns=[column]):
                for text in batch.column(0).to_pylist():
                    if text is not None:
                        f.write(json.dumps({"text": str(text)}, ensure_ascii=False) + "\n")
                        rows += 1
    except BaseException:
        if os.path.exists(partial):
            os.remove(partial)
        raise
    os.replace(partial, out)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="Parquet -> JSONL for ./tokenize shards")
    parser.add_argument("source", metavar="IN.parquet")
    parser.add_argument("out", metavar="OUT.jsonl")
    parser.add_argument("--column", default="text", help="the column of the documents' text (default: text)")
    args = parser.parse_args()
    rows = convert(regular_file(args.source), args.out, args.column)
    print(f"{args.out}: {rows} documents")


if __name__ == "__main__":
    sys.exit(main())
