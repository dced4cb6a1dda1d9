#!/usr/bin/env python
"""Pull/update throughput of the Redis embedding tier beside redis-benchmark, in one invocation.

For 64-dim float32 rows (256 bytes, SGD: no optimizer state) over 1, 2 and 4 local shards,
with uniform and Zipf-skewed ids, it measures:
  - pull: rows/s and MB/s of ``RedisStore.pull`` (unique ids of a request, all shards in parallel)
  - update: rows/s of ``RedisStore.update`` (read rows, apply SGD, write back)
and runs ``redis-benchmark -P 64 -d 256 -t get,set`` against a fresh local shard in the same run,
printing each pull/update rate as a ratio of redis-benchmark's GET/SET rate.

    python scripts/bench_store.py [--rows-per-request 32768] [--seconds 2] [--shards 1,2,4]
"""

from __future__ import annotations

import argparse
import csv
import io
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embeddings import SGD, LocalShards, RedisStore, TableSet, TableSpec  # noqa: E402

DIM = 64
ROW_BYTES = 4 * DIM


def redis_benchmark(requests: int) -> dict[str, float]:
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise SystemExit("redis-benchmark not found on PATH (Debian: apt-get install redis-tools)")
    with LocalShards(1) as sh:
        out = subprocess.run(
            [exe, "-h", "127.0.0.1", "-p", str(sh.ports[0]), "-P", "64", "-d", "256", "-t", "get,set"]
            + ["-n", str(requests), "-q", "--csv"],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        ).stdout
    rates = {}
    for row in csv.reader(io.StringIO(out)):
        if row and row[0] in ("GET", "SET"):
            rates[row[0]] = float(row[1])
    return rates


def id_stream(kind: str, n: int, universe: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "uniform":
        return rng.integers(0, universe, n)
    # Zipf(1.05) over the universe; hot ids scattered by a fixed permutation of the low ranks
    ranks = np.minimum(rng.zipf(1.05, n) - 1, universe - 1)
    return (ranks * 2654435761) % universe


def timed(fn, seconds: float) -> float:
    """Run fn() repeatedly for ~seconds (at least 5 times); returns the median seconds per call."""
    times, t_end = [], time.perf_counter() + seconds
    while len(times) < 5 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def naive_hget(store: RedisStore, ids: np.ndarray):
    """The plain way: redis-py pipelined HGET (hiredis parser), one Python bytes object per row."""
    client = store.client(0)
    where = [store.location(0, i) for i in ids.tolist()]

    def run():
        pipe = client.pipeline(transaction=False)
        for key, field in where:
            pipe.hget(key, field)
        return np.frombuffer(b"".join(pipe.execute()), "<f4").reshape(len(where), -1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows-per-request", type=int, default=32768, help="ids per pull/update request (before dedup)")
    ap.add_argument("--universe", type=int, default=1_000_000, help="distinct row ids the requests draw from")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per measurement")
    ap.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    ap.add_argument("--benchmark-requests", type=int, default=1_000_000, help="redis-benchmark -n")
    args = ap.parse_args()
    shard_counts = [int(s) for s in args.shards.split(",")]
    if any(s <= 0 for s in shard_counts):
        raise SystemExit(f"--shards {args.shards!r}: every count must be > 0")

    print(f"redis-benchmark -P 64 -d 256 -t get,set -n {args.benchmark_requests} ...", flush=True)
    rb = redis_benchmark(args.benchmark_requests)
    print(f"  GET {rb['GET']:,.0f} req/s   SET {rb['SET']:,.0f} req/s\n")

    tables = TableSet([TableSpec("t", args.universe, DIM)])
    rng = np.random.default_rng(0)
    header = f"{'shards':>6} {'ids':>8} {'uniq/req':>8} {'op':>6} {'rows/s':>12} {'MB/s':>8} {'x redis-benchmark':>18}"
    print(header)
    print("-" * len(header))
    for s in shard_counts:
        with LocalShards(s) as sh, RedisStore(sh.urls, tables, SGD(lr=0.01), namespace="bench") as store:
            for kind in ("uniform", "zipf"):
                ids = np.unique(id_stream(kind, args.rows_per_request, args.universe, rng))
                store.write_rows("t", ids, np.ones((len(ids), DIM), np.float32))  # rows exist: steady state
                grads = np.full((len(ids), DIM), 1e-3, np.float32)
                for op, fn, ref in (
                    ("pull", lambda ids=ids: store.pull("t", ids), rb["GET"]),
                    ("update", lambda ids=ids, grads=grads: store.update("t", ids, grads), rb["SET"]),
                ):
                    sec = timed(fn, args.seconds)
                    rate = len(ids) / sec
                    print(
                        f"{s:>6} {kind:>8} {len(ids):>8} {op:>6} {rate:>12,.0f} {rate * ROW_BYTES / 1e6:>8.1f} "
                        f"{rate / ref:>17.2f}x",
                        flush=True,
                    )
                if s == 1:
                    rate = len(ids) / timed(naive_hget(store, ids), args.seconds)
                    print(
                        f"{s:>6} {kind:>8} {len(ids):>8} {'naive':>6} {rate:>12,.0f} {rate * ROW_BYTES / 1e6:>8.1f} "
                        f"{rate / rb['GET']:>17.2f}x   (redis-py pipelined HGET, for reference)",
                        flush=True,
                    )
    print(
        "\nrows/s counts unique rows per request; 'update' is a read, an SGD step and a write per row,"
        "\ncompared with redis-benchmark's SET rate. Median of repeated calls; the machine is shared."
    )


if __name__ == "__main__":
    main()
