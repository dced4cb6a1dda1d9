#!/usr/bin/env python
"""How soon faults are answered, measured rather than asserted in tests (a loaded machine moves these).

Each figure is taken --repeats times in one invocation, on real processes, and printed beside the
bound the project claims for it:
  - store, unreachable endpoint: seconds from a pull to ShardUnavailableError (timeout 1.0 s);
  - store, stalled shard (SIGSTOP): seconds from a pull to ShardTimeoutError (timeout 0.5 s);
  - training, stalled shard: ``detected_after_s`` of a 2-trainer run with ``--timeout 1`` and a
    90 s stall at step 15 (``--recovery log``);
  - training, priority saves: each held-row save's pause over the run's mean step (``partial-mfu``,
    ``--priority-every 4``), before the injected failure at step 27;
  - training, replica promotion: ``recovery_s`` of ``--recovery replica --replicas local
    --replica-wait`` with shard 1 killed at step 60.

    python scripts/bench_fault_timing.py [--repeats 3] [--only store,stall,priority,promotion]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from embeddings import SGD, LocalShards, RedisStore, TableSet, TableSpec  # noqa: E402
from embeddings.errors import ShardTimeoutError, ShardUnavailableError  # noqa: E402
from embeddings.servers.launcher import free_port  # noqa: E402

TRAIN = ["--rows-per-table", "2000", "--batch-size", "256", "--embedding-dim", "8", "--eval-every", "0"]
TRAIN += ["--eval-samples", "2048", "--log-every", "5"]
TWO = [*TRAIN, "--steps", "40", "--trainers", "2", "--shards", "3"]
KINDS = ("store", "stall", "priority", "promotion")


def train(out: Path, *flags: str) -> tuple[dict, list[dict]]:
    proc = subprocess.run(
        [sys.executable, "-m", "recsys", "train", *flags, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SystemExit(f"bench_fault_timing: recsys train {' '.join(flags)} failed: {last}")
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "summary.json").read_text()), metrics


def store_unreachable() -> float:
    port = free_port()  # nothing listens there
    tables = TableSet([TableSpec("t", 100, 8)])
    with RedisStore([f"redis://127.0.0.1:{port}/0"], tables, SGD(), timeout_s=1.0) as st:
        t0 = time.monotonic()
        try:
            st.pull("t", np.arange(3))
        except ShardUnavailableError:
            return time.monotonic() - t0
    raise SystemExit("bench_fault_timing: a pull from an unreachable endpoint did not fail")


def store_stalled() -> float:
    tables = TableSet([TableSpec("t", 1000, 8)])
    with LocalShards(1) as sh, RedisStore(sh.urls, tables, SGD(), namespace="bench", timeout_s=0.5) as st:
        st.pull("t", np.arange(200))
        sh.stall(0)
        t0 = time.monotonic()
        try:
            st.pull("t", np.arange(200))
        except ShardTimeoutError:
            return time.monotonic() - t0
        finally:
            sh.resume(0)
    raise SystemExit("bench_fault_timing: a pull from a stalled shard did not time out")


def stall_detection(out: Path) -> float:
    flags = [*TWO, "--recovery", "log", "--checkpoint-every", "10", "--timeout", "1"]
    s, _ = train(out, *flags, "--inject", "stall:2@step=15:90")
    (f,) = s["failures"]
    return f["detected_after_s"]


def priority_pauses(out: Path) -> list[float]:
    flags = [*TWO, "--recovery", "partial-mfu", "--checkpoint-every", "20", "--priority-every", "4"]
    _, metrics = train(out, *flags, "--priority-budget", "500", "--inject", "shard:0@step=27")
    return [r["priority_pause_s"] / r["step_s"] for r in metrics if "priority_pause_s" in r and r["step"] < 27]


def promotion(out: Path) -> float:
    flags = [*TRAIN, "--steps", "120", "--timeout", "1", "--max-restarts", "0", "--recovery", "replica"]
    flags += ["--checkpoint-every", "0", "--replicas", "local", "--replica-wait", "--inject", "shard:1@step=60"]
    s, _ = train(out, *flags)
    (f,) = [f for f in s["failures"] if f["strategy"] == "replica"]
    if f["restored_bytes"] != 0:
        raise SystemExit(f"bench_fault_timing: the replica run restored {f['restored_bytes']} bytes: not a promotion")
    return f["recovery_s"]


def row(what: str, values: list[float], unit: str, bound: float, claim: str, low: float = 0.0) -> None:
    med, worst = statistics.median(values), max(values)
    verdict = "holds" if low <= min(values) and worst < bound else "BROKEN"
    span = f"{min(values):.3f}-{worst:.3f} {unit}"
    print(f"| {what} | {med:.3f} {unit} | {span} | {len(values)} | {claim} | {verdict} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="measurements of each figure (default: 3)")
    ap.add_argument("--only", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats}: must be at least 1")
    kinds = [k for k in args.only.split(",") if k]
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise SystemExit(f"--only {args.only!r}: choose from {','.join(KINDS)}")

    print("| figure | median | range | n | claimed bound | verdict |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-fault-timing-") as tmp:
        runs = (Path(tmp) / f"run{i}" for i in itertools.count())
        # (kind, figure, one measurement -> values, unit, low, high, claim)
        figures = [
            ("store", "store: unreachable endpoint -> typed error (timeout 1.0 s)",
             lambda: [store_unreachable()], "s", 0.0, 1.5, "< 1.5 s"),
            ("store", "store: stalled shard -> ShardTimeoutError (timeout 0.5 s)",
             lambda: [store_stalled()], "s", 0.0, 1.2, "< 1.2 s"),
            ("stall", "training: stalled shard detected after (--timeout 1)",
             lambda: [stall_detection(next(runs))], "s", 0.9, 2.0, "0.9-2.0 s"),
            ("priority", "training: priority-save pause / mean step",
             lambda: priority_pauses(next(runs)), "x", 0.0, 0.25, "< 0.25x"),
            ("promotion", "training: replica promotion, recovery_s",
             lambda: [promotion(next(runs))], "s", 0.0, 1.0, "< 1.0 s"),
        ]  # fmt: skip
        for kind, what, measure, unit, low, high, claim in figures:
            if kind in kinds:
                values = [v for _ in range(args.repeats) for v in measure()]
                row(what, values, unit, high, claim, low=low)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
