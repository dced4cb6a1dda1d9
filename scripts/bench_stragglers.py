#!/usr/bin/env python
"""A slow trainer, with and without chunks that follow speed (``--balance-every``), side by side.

For each trainer count W of ``--trainers``: the global batch in ``--chunks-per-trainer`` x W fixed
chunks, and four runs of ``python -m recsys train`` as a user runs it (real trainer processes, real
redis-servers): healthy and with trainer 1 slowed ``--factor`` times from step ``--slow-step``
(``--inject slow-trainer:1:F@step=N``: a sleep of F - 1 times its measured compute), each with the
chunks following speed (``--balance-every``) and with them fixed (``--balance-every 0``).

Columns: samples/s from the slow step to the end (``metrics.jsonl``'s ``elapsed_s`` at both), the
ideal for the capacity left (the healthy run's figure x (W - 1 + 1/F) / W: every trainer busy all
step), the ratio to it, the steps from the slowdown to the first plan that moved chunks, the last
plan's chunks by rank, the compute skew (the slowest trainer's compute a step over the fastest's,
median of the log records from 2 plans after the slowdown; the healthy run's beside it: 1.0 is every
trainer busy as long), and whether the run ended on the healthy run's digest. ``--rounds N`` makes
the healthy runs N times each, the order alternating, for what the plans cost without a straggler
(the median ratio of balance on to off, and how many plans moved chunks there). One plot: samples/s (over 20 steps) against wall seconds for every run.

    python scripts/bench_stragglers.py [--trainers 2,3] [--steps 200] [--slow-step 60] [--factor 2]
        [--chunks-per-trainer 3] [--balance-every 10] [--rounds 3] [--plot docs/bench-stragglers.png]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SMOOTH = 4  # the plot's rates are over this many log records (of 5 steps)


def train(out: Path, args, trainers: int, balance: bool, slow: bool) -> dict:
    cmd = [
        sys.executable, "-m", "recsys", "train", "--out", str(out), "--steps", str(args.steps),
        "--batch-size", str(args.batch_size), "--trainers", str(trainers), "--shards", "2",
        "--chunks", str(args.chunks_per_trainer * trainers), "--rows-per-table", str(args.rows_per_table),
        "--embedding-dim", "16", "--eval-every", "0", "--log-every", "5", "--no-keep-model",
        "--balance-every", str(args.balance_every if balance else 0),
    ]  # fmt: skip
    if slow:
        cmd += ["--inject", f"slow-trainer:1:{args.factor:g}@step={args.slow_step}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_stragglers: {' '.join(cmd[1:])} exited {proc.returncode}: {proc.stderr.strip()[-800:]}")
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    summary["elapsed"] = {r["step"]: r["elapsed_s"] for r in records if "elapsed_s" in r and "loss" in r}
    summary["compute"] = {r["step"]: r["trainer_compute_ms"] for r in records if "trainer_compute_ms" in r}
    return summary


def skew(summary: dict, start: int) -> float:
    """The slowest trainer's compute a step over the fastest's, the median of the log records after
    ``start`` (1.0: every trainer busy as long; the others wait for the slowest the rest)."""
    ratios = [max(ms.values()) / min(ms.values()) for step, ms in summary["compute"].items() if step > start]
    return float(np.median(ratios)) if ratios else float("nan")


def rate(summary: dict, args, start: int) -> float:
    """Samples/s from step ``start`` to the last step (the log records' wall seconds)."""
    el = summary["elapsed"]
    return (args.steps - start) * args.batch_size / (el[args.steps] - el[start])


def measure(args, tmp: Path) -> list[dict]:
    rows = []
    for w in [int(x) for x in args.trainers.split(",")]:
        healthy_on, healthy_off = [], []
        for i in range(args.rounds):
            order = (True, False) if i % 2 == 0 else (False, True)
            for on in order:
                s = train(tmp / f"w{w}-healthy-{on}-{i}", args, w, on, False)
                (healthy_on if on else healthy_off).append(s)
        slow = {on: train(tmp / f"w{w}-slow-{on}", args, w, on, True) for on in (True, False)}
        base = float(np.median([rate(s, args, args.slow_step) for s in healthy_off]))
        ideal = base * (w - 1 + 1 / args.factor) / w
        cost = [rate(a, args, args.slow_step) / rate(b, args, args.slow_step) for a, b in zip(healthy_on, healthy_off)]
        digest = healthy_off[0]["embedding_digest"]
        for on in (True, False):
            s = slow[on]
            moved = [p for p in s.get("chunk_plans", []) if p["step"] >= args.slow_step]
            rows.append(
                {
                    "trainers": w,
                    "balance": on,
                    "healthy_samples_per_s": base,
                    "samples_per_s": rate(s, args, args.slow_step),
                    "ideal_samples_per_s": ideal,
                    "to_ideal": rate(s, args, args.slow_step) / ideal,
                    "to_healthy": rate(s, args, args.slow_step) / base,
                    "steps_to_rebalance": (moved[0]["step"] - args.slow_step) if moved else None,
                    "last_chunks": s["chunk_plans"][-1]["chunks"] if s.get("chunk_plans") else None,
                    "skew": skew(s, args.slow_step + 2 * args.balance_every),
                    "healthy_skew": skew(healthy_off[0], args.slow_step + 2 * args.balance_every),
                    "digest_equal": s["embedding_digest"] == digest,
                    "healthy_on_over_off": cost,
                    "healthy_plans": [len(h.get("chunk_plans", [])) for h in healthy_on],
                    "curve": s["elapsed"],
                }
            )
        rows[-1]["healthy_curve"] = healthy_off[0]["elapsed"]
    return rows


def plot(rows: list[dict], args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        curves = [
            (r["curve"], f"{r['trainers']} trainers, slowed, chunks {'follow speed' if r['balance'] else 'fixed'}")
        ]
        if "healthy_curve" in r:
            curves.append((r["healthy_curve"], f"{r['trainers']} trainers, healthy"))
        for el, label in curves:  # over 20 steps (4 log records), at each record
            steps = sorted(el)
            pairs = list(zip(steps, steps[SMOOTH:]))
            t = [el[b] for _, b in pairs]
            sps = [(b - a) * args.batch_size / (el[b] - el[a]) for a, b in pairs]
            ax.plot(t, sps, label=label)
    ax.set_xlabel("wall seconds")
    ax.set_ylabel("samples/s (over the last 20 steps)")
    ax.set_title(f"trainer 1 slowed {args.factor:g}x from step {args.slow_step}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainers", default="2,3", help="trainer counts, comma-separated")
    ap.add_argument("--steps", type=int, default=200, help="training steps per run")
    ap.add_argument("--slow-step", type=int, default=60, help="trainer 1 is slowed from this step")
    ap.add_argument("--factor", type=float, default=2.0, help="trainer 1's compute takes this many times as long")
    ap.add_argument("--chunks-per-trainer", type=int, default=3, help="--chunks is this x the trainers")
    ap.add_argument("--balance-every", type=int, default=10, help="--balance-every of the runs with plans")
    ap.add_argument("--batch-size", type=int, default=1008, help="global batch (a multiple of every --chunks)")
    ap.add_argument("--rows-per-table", type=int, default=100_000, help="rows of each of the 26 tables")
    ap.add_argument("--rounds", type=int, default=3, help="healthy runs of each kind, alternating")
    ap.add_argument("--plot", default="", help="write the plot here (PNG)")
    args = ap.parse_args()
    for w in [int(x) for x in args.trainers.split(",")]:
        if args.batch_size % (args.chunks_per_trainer * w):
            ap.error(f"--batch-size {args.batch_size} is not a multiple of --chunks {args.chunks_per_trainer * w}")
    if not 0 < args.slow_step < args.steps or args.steps % 5:
        ap.error(f"--slow-step {args.slow_step} must lie inside --steps {args.steps} (a multiple of 5)")
    with tempfile.TemporaryDirectory(prefix="bench-stragglers-") as tmp:
        rows = measure(args, Path(tmp))
    print(f"\nsteps={args.steps} batch={args.batch_size} slowed {args.factor:g}x from step {args.slow_step}\n")
    print("| trainers | chunks | samples/s from the slowdown | ideal | to ideal | to healthy | steps to rebalance "
          "| last plan | compute skew (healthy) | digest = healthy |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['trainers']} | {'follow speed' if r['balance'] else 'fixed'} | {r['samples_per_s']:,.0f} "
            f"| {r['ideal_samples_per_s']:,.0f} | {r['to_ideal']:.2f}x | {r['to_healthy']:.2f}x "
            f"| {r['steps_to_rebalance'] if r['steps_to_rebalance'] is not None else '-'} "
            f"| {r['last_chunks'] or '-'} | {r['skew']:.2f} ({r['healthy_skew']:.2f}) "
            f"| {'yes' if r['digest_equal'] else 'NO'} |"
        )
    for r in rows[::2]:
        cost = r["healthy_on_over_off"]
        print(
            f"{r['trainers']} trainers, healthy: balance on / off per round {', '.join(f'{c:.3f}' for c in cost)}, "
            f"median {float(np.median(cost)):.3f}; plans that moved chunks in those runs: {r['healthy_plans']}"
        )
    if args.plot:
        plot(rows, args)
        print(f"plot: {args.plot}")
    if not all(r["digest_equal"] for r in rows):
        sys.exit("bench_stragglers: a slowed run ended on another digest than the healthy run")


if __name__ == "__main__":
    main()
