#!/usr/bin/env python
"""Data-path throughput: Criteo TSV parsing and preprocessed binary batches.

Writes ``--rows`` synthetic samples as Criteo TSV into a temp folder, then measures on this machine:
  - TSV parse (``CriteoTsvReader``): samples/s
  - preprocess TSV -> npy (parse + write, two passes): samples/s
  - binary batches of ``--batch-size`` (``BatchReader`` over memory-mapped npy, torchrec ``Batch`` out)
  - synthetic batches of the same size, generated on the fly (teacher labels included)

    python scripts/bench_data.py [--rows 200000] [--batch-size 2048]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from data.batches import BatchReader, BinarySource  # noqa: E402
from data.criteo import NUM_SPARSE, BinaryCriteo, CriteoTsvReader, preprocess  # noqa: E402
from data.synthetic import SyntheticConfig, SyntheticSource, write_tsv  # noqa: E402


def rate(n: int, seconds: float) -> str:
    return f"{n / seconds:>12,.0f} samples/s  ({n:,} in {seconds:.2f} s)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="samples to write and read")
    ap.add_argument("--batch-size", type=int, default=2048, help="global batch size for the batch readers")
    args = ap.parse_args()
    if args.rows < args.batch_size:
        raise SystemExit(f"--rows {args.rows} must be at least --batch-size {args.batch_size}")
    cfg = SyntheticConfig.uniform(1_000_000, seed=0)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        tsv = Path(tmp) / "train.txt"
        t0 = time.perf_counter()
        write_tsv(cfg, tsv, args.rows)
        print(
            f"write synthetic TSV      {rate(args.rows, time.perf_counter() - t0)}  {tsv.stat().st_size / 1e6:.0f} MB"
        )

        t0 = time.perf_counter()
        n = sum(len(c.labels) for c in CriteoTsvReader([tsv]))
        print(f"TSV parse                {rate(n, time.perf_counter() - t0)}")

        t0 = time.perf_counter()
        preprocess(tsv, tmp, "train", progress=False)
        print(f"preprocess TSV -> npy    {rate(n, time.perf_counter() - t0)}")

        src = BinarySource(BinaryCriteo.open(tmp, "train"), [1_000_000] * NUM_SPARSE)
        t0 = time.perf_counter()
        m = sum(len(b.labels) for b in BatchReader(src, args.batch_size, epochs=10))
        print(f"binary batches of {args.batch_size:<5} {rate(m, time.perf_counter() - t0)}")

        reader = BatchReader(SyntheticSource(cfg), args.batch_size)
        t0 = time.perf_counter()
        m = sum(len(next(reader).labels) for _ in range(args.rows // args.batch_size))
        print(f"synthetic batches        {rate(m, time.perf_counter() - t0)}")


if __name__ == "__main__":
    main()
