"""Training through a shard's failure against waiting for it: the experiment of "Training Through
Failure" (Cao et al., 2024) on DLRM, with the recovery strategies of CPR.

One run per strategy, the same data, model and seed, and the same failure: shard 1 is killed at step
``--fail-at`` and its restore is held ``--restore-s`` seconds longer (``--inject slow-restore``: a
shard of a realistic size, or a slow network). Strategies: ``none`` (no failure: the reference),
``full`` (checkpoint restart: every shard back to the checkpoint, the steps since recomputed),
``replica`` (chain replication: the replica promoted, nothing loaded), ``partial`` (CPR) and
``log``, each waiting for the restore, and ``partial`` and ``log`` again with ``--train-through``.

Outputs in ``--out``: ``through.csv`` and ``through.md`` (per strategy: seconds every trainer
waited, AUC at the end and at equal wall time (the time the fastest run ended), PLS, rows read from
the fallback, updates applied late, wall seconds) and ``through.png`` (AUC against wall-clock
seconds, a curve per strategy). ``--trainers 1,2`` repeats it per trainer count.

    python scripts/bench_through.py --out runs/bench-through
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = (
    ("none", "none", False),
    ("full", "full", False),
    ("replica", "replica", False),
    ("partial", "partial", False),
    ("log", "log", False),
    ("partial --train-through", "partial", True),
    ("log --train-through", "log", True),
)


def run_flags(args, trainers: int, strategy: str, through: bool) -> list[str]:
    flags = ["--steps", str(args.steps), "--trainers", str(trainers), "--shards", "3"]
    flags += ["--rows-per-table", str(args.rows_per_table), "--batch-size", str(args.batch_size)]
    flags += ["--eval-every", str(args.eval_every), "--eval-samples", str(args.eval_samples)]
    flags += ["--log-every", str(args.eval_every), "--seed", str(args.seed)]
    flags += ["--write-every", "1"]  # every run writes each step, as --train-through does: one contract
    if strategy == "none":
        return [*flags, "--recovery", "log"]  # no failure: the strategy does nothing but log
    flags += ["--recovery", strategy, "--checkpoint-every", str(args.checkpoint_every)]
    flags += ["--inject", f"shard:1@step={args.fail_at}", "--inject", f"slow-restore:1:{args.restore_s:g}"]
    if strategy == "replica":
        flags += ["--replicas", "local"]
    if through:
        flags += ["--train-through"]
    return flags


def curve(out: Path) -> list[tuple[float, float]]:
    """(elapsed seconds, AUC) of every evaluation of a run, in order."""
    pts = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "auc" in r and "elapsed_s" in r:
            pts.append((float(r["elapsed_s"]), float(r["auc"])))
    return pts


def auc_at(pts: list[tuple[float, float]], t: float) -> float | None:
    """The AUC of the last evaluation at or before ``t`` seconds."""
    before = [a for s, a in pts if s <= t + 1e-9]
    return before[-1] if before else None


def waited(s: dict) -> float:
    """Seconds every trainer waited for the failure: a blocking strategy waits for the whole
    recovery; training through waits only where something made it (``waited_s``)."""
    return sum(f.get("waited_s", f.get("recovery_s", 0.0)) for f in s["failures"] if f.get("kind") != "trainer")


def one(args, trainers: int, name: str, strategy: str, through: bool) -> dict:
    out = Path(args.out) / f"w{trainers}" / name.replace(" --", "-").replace(" ", "-")
    cmd = [sys.executable, "-m", "recsys", "train", *run_flags(args, trainers, strategy, through), "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"bench_through: {name} with {trainers} trainer(s) failed: {tail[0]}")
    s = json.loads((out / "summary.json").read_text())
    fails = [f for f in s["failures"] if f.get("kind") != "trainer"]
    return {
        "trainers": trainers,
        "strategy": name,
        "wall_s": round(time.perf_counter() - t0, 2),
        "train_s": s["wall_seconds"],
        "waited_s": round(waited(s), 3),
        "trained_through_steps": sum(f.get("trained_through_steps", 0) for f in fails),
        "final_auc": round(s["final_auc"], 5),
        "pls": s.get("pls", 0.0),
        "lost_updates": sum(f.get("lost_updates", 0) for f in fails),
        "rows_read_fallback": sum(f.get("rows_read_fallback", 0) for f in fails),
        "updates_applied_late": sum(f.get("updates_applied_late", 0) for f in fails),
        "curve": curve(out),
    }


def table(rows: list[dict], equal_t: float) -> str:
    head = (
        "| strategy | seconds waited | steps trained through | final AUC | AUC at "
        f"{equal_t:.1f} s | PLS | lost updates | rows from the fallback | updates applied late | train s |"
    )
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for r in rows:
        at = r["auc_at_equal_t"]
        lines.append(
            f"| {r['strategy']} | {r['waited_s']:.2f} | {r['trained_through_steps']} | {r['final_auc']:.4f} | "
            f"{'-' if at is None else f'{at:.4f}'} | {r['pls']:.5f} | {r['lost_updates']} | "
            f"{r['rows_read_fallback']} | {r['updates_applied_late']} | {r['train_s']:.1f} |"
        )
    return "\n".join(lines)


def plot(groups: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4.5), squeeze=False)
    for ax, (w, rows) in zip(axes[0], sorted(groups.items()), strict=True):
        for r in rows:
            xs, ys = zip(*r["curve"], strict=True) if r["curve"] else ((), ())
            style = "-" if "through" in r["strategy"] else "--" if r["strategy"] != "none" else ":"
            ax.plot(xs, ys, style, marker=".", label=r["strategy"])
        ax.set_xlabel("wall-clock seconds")
        ax.set_ylabel("eval AUC")
        ax.set_title(f"{w} trainer{'s' if w > 1 else ''}: shard 1 killed, restore held")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.12, top=0.92, wspace=0.2)
    fig.savefig(path, dpi=110)
    plt.close(fig)


LARGE = ["--embedding-dim", "64", "--zipf", "0", "--batch-size", "8192", "--eval-every", "0", "--eval-samples", "8192"]


def large(args) -> list[dict]:
    """A shard of over a gigabyte restored over the protocol: three servers the run did not start
    (restarted empty by a supervisor, as systemd would), shard 1 shut down right after the checkpoint
    that holds it; ``partial`` waiting for its restore, then the same with ``--train-through``."""
    from recsys.testing import RedisServers

    out = Path(args.out) / "large"
    rows = []
    servers = RedisServers(3, out / "servers", supervised=True)
    try:
        k = args.large_checkpoint_at
        for name, through in (("partial", False), ("partial --train-through", True)):
            for c in servers.urls:  # every run starts from empty servers
                import redis

                redis.Redis.from_url(c).flushall()
            run = out / name.replace(" --", "-")
            flags = ["--steps", str(k + args.large_after), "--trainers", "1", "--rows-per-table", str(args.large_rows)]
            flags += [
                "--write-every",
                "1",
                *LARGE,
                "--redis",
                servers.redis,
                "--recovery",
                "partial",
                "--checkpoint-every",
                str(k),
            ]
            flags += ["--inject", f"shard:1@step={k + 1}", "--shard-restart-timeout", "120", "--timeout", "30"]
            flags += ["--train-through"] if through else []
            print(f"bench_through: large shard, {name} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "recsys", "train", *flags, "--out", str(run)],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if proc.returncode != 0:
                tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
                raise SystemExit(f"bench_through: the large shard under {name} failed: {tail[0]}")
            s = json.loads((run / "summary.json").read_text())
            f = [x for x in s["failures"] if x["target"] == 1][0]
            rows.append(
                {
                    "strategy": name,
                    "restored_gb": round(f["restored_bytes"] / 1e9, 3),
                    "restore_s": f.get("restore_s", f["recovery_s"]),
                    "waited_s": round(waited(s), 3),
                    "trained_through_steps": f.get("trained_through_steps", 0),
                    "step_s": round(s["wall_seconds"] / s["steps_completed"], 3),
                    "wall_s": round(time.perf_counter() - t0, 1),
                }
            )
    finally:
        servers.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/bench-through", help="where the runs and the results go")
    ap.add_argument("--trainers", default="1,2", help="trainer counts, comma-separated (default 1,2)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--fail-at", type=int, default=150, help="the step at which shard 1 is killed")
    ap.add_argument("--restore-s", type=float, default=10.0, help="seconds the restore is held longer")
    ap.add_argument("--checkpoint-every", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-samples", type=int, default=8192)
    ap.add_argument("--rows-per-table", type=int, default=20000)
    ap.add_argument("--batch-size", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--large",
        action="store_true",
        help="only the large shard: over 1 GB restored over the protocol from servers the run did not start",
    )
    ap.add_argument("--large-rows", type=int, default=550_000, help="--large: rows per table (26 tables, dim 64)")
    ap.add_argument("--large-checkpoint-at", type=int, default=200, help="--large: the checkpoint before the kill")
    ap.add_argument("--large-after", type=int, default=40, help="--large: steps after the kill")
    args = ap.parse_args(argv)
    if args.large:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        rows = large(args)
        head = "| strategy | restored GB | restore s | seconds waited | steps trained through | s per step |"
        md = [head, "| --- | --- | --- | --- | --- | --- |"]
        for r in rows:
            md.append(
                f"| {r['strategy']} | {r['restored_gb']} | {r['restore_s']} | {r['waited_s']} | "
                f"{r['trained_through_steps']} | {r['step_s']} |"
            )
        (Path(args.out) / "large.md").write_text("\n".join(md) + "\n")
        print("\n".join(md))
        return 0
    try:
        counts = [int(x) for x in args.trainers.split(",") if x.strip()]
    except ValueError:
        print(f"error: --trainers {args.trainers!r}: expected trainer counts such as 1,2", file=sys.stderr)
        return 2
    if not 1 < args.fail_at < args.steps:
        print(f"error: --fail-at {args.fail_at}: must be within (1, --steps {args.steps})", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[int, list[dict]] = {}
    for w in counts:
        rows = []
        for name, strategy, through in RUNS:
            print(f"bench_through: {w} trainer(s), {name} ...", file=sys.stderr, flush=True)
            rows.append(one(args, w, name, strategy, through))
        equal_t = min(r["curve"][-1][0] for r in rows if r["curve"])
        for r in rows:
            r["auc_at_equal_t"] = auc_at(r["curve"], equal_t)
            r["equal_t"] = equal_t
        groups[w] = rows
    fields = [k for k in groups[counts[0]][0] if k != "curve"]
    with open(out / "through.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for rows in groups.values():
            for r in rows:
                writer.writerow({k: r[k] for k in fields})
    md = [
        f"# Training through a held restore ({time.strftime('%Y-%m-%d')})",
        "",
        f"`python scripts/bench_through.py {' '.join(argv if argv is not None else sys.argv[1:])}`: shard 1 killed "
        f"at step {args.fail_at}, its restore held {args.restore_s:g} s longer; {args.steps} steps of "
        f"{args.batch_size}, a checkpoint every {args.checkpoint_every}, evaluation every {args.eval_every}.",
    ]
    for w, rows in groups.items():
        md += ["", f"## {w} trainer{'s' if w > 1 else ''}", "", table(rows, rows[0]["equal_t"])]
    (out / "through.md").write_text("\n".join(md) + "\n")
    plot(groups, out / "through.png")
    print("\n".join(md))
    print(f"wrote {out}/through.md, through.csv, through.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
