#!/usr/bin/env python
"""A failure drill: one schedule of failures, every strategy asked for, what each one cost.

    .venv/bin/python scripts/failure_drill.py --fail shard:1@step=150 --fail stall:0@step=80:2 \
        --strategies partial,partial-mfu,incremental,log,full --steps 300 --checkpoint-every 50

or failures drawn from a failure process: ``--mtbf 120`` (mean steps between shard kills, seeded).
Runs a failure-free reference, then the same training under each strategy with the same
failures, and prints (and writes to ``OUT/drill.md``) a table: failures recovered, time they cost
(detection + recovery), updates lost, PLS, AUC change against the reference, wall time against
the reference, and whether the embeddings ended equal to the reference's. ``OUT/compare.png``
puts the runs' curves on one plot with the failures marked.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import recsys  # noqa: E402
from recsys.testing import FailureSchedule  # noqa: E402

COLUMNS = ["strategy", "failures", "failure_s", "lost_updates", "pls", "auc_change", "wall_vs_reference_pct", "exact"]


def drill_rows(reference: recsys.Run, runs: dict[str, recsys.Run]) -> list[dict]:
    ref = reference.summary
    rows = []
    for strategy, run in runs.items():
        s = run.summary
        rows.append(
            {
                "strategy": strategy,
                "failures": len(s.failures),
                "failure_s": round(sum(f.detected_after_s + f.recovery_s for f in s.failures), 3),
                "lost_updates": s.lost_updates,
                "pls": round(s.pls, 5),
                "auc_change": round(s.final_auc - ref.final_auc, 5),
                "wall_vs_reference_pct": round(100 * (s.wall_seconds / ref.wall_seconds - 1), 1),
                "exact": s.embedding_digest is not None and s.embedding_digest == ref.embedding_digest,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fail", action="append", default=[], metavar="SPEC", help="a failure (see --inject of train)")
    ap.add_argument("--mtbf", type=float, default=0, help="instead of --fail: mean steps between drawn shard kills")
    ap.add_argument("--seed", type=int, default=0, help="seed of data, model and the drawn failures")
    ap.add_argument("--strategies", default="partial,partial-mfu,incremental,log,full", help="comma-separated")
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--batch-size", type=int, default=512, help="global batch size")
    ap.add_argument("--shards", type=int, default=4, help="local Redis shards")
    ap.add_argument("--trainers", type=int, default=1, help="trainer processes per run")
    ap.add_argument("--rows-per-table", type=int, default=20_000, help="rows of each of the 26 tables")
    ap.add_argument("--embedding-dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--eval-samples", type=int, default=32_768, help="held-out samples for the final AUC")
    ap.add_argument("--checkpoint-every", type=int, default=50, help="checkpoint interval in steps")
    ap.add_argument("--out", default="runs/drill", help="folder of the runs and the table")
    args = ap.parse_args(argv)
    schedule = FailureSchedule(args.fail)
    if args.mtbf:
        schedule = FailureSchedule.drawn(args.steps, args.mtbf, args.shards, args.seed)
    if not len(schedule):
        print("error: no failures: give --fail SPEC (repeatable) or --mtbf STEPS", file=sys.stderr)
        return 2
    out = Path(args.out)
    common = {
        "steps": args.steps,
        "batch_size": args.batch_size,
        "shards": args.shards,
        "trainers": args.trainers,
        "rows_per_table": args.rows_per_table,
        "embedding_dim": args.embedding_dim,
        "eval_samples": args.eval_samples,
        "eval_every": 0,
        "seed": args.seed,
        "progress": False,
        "write_every": 1,  # every step's rows on their shards: each strategy's loss shows at its failure
    }
    try:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        configs = {
            s: recsys.configure(
                **common,
                recovery=s,
                checkpoint_every=args.checkpoint_every,
                max_restarts=1 if any(x.startswith(("trainer:", "node:")) for x in schedule) else 0,
                inject=schedule.specs,
                out=str(out / s),
                **({"replicas": "local"} if s == "replica" else {}),
            )
            for s in strategies
        }
        print(f"failures: {', '.join(schedule.specs)}")
        reference = recsys.train(recsys.configure(**common, out=str(out / "reference")))
        runs = {}
        for s, cfg in configs.items():
            print(f"running {s} ...", flush=True)
            runs[s] = recsys.train(cfg)
    except recsys.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from recsys.bench import markdown

    table = markdown(drill_rows(reference, runs), COLUMNS)
    text = f"Failure drill: {', '.join(schedule.specs)}; reference AUC {reference.summary.final_auc:.5f}\n\n{table}\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "drill.md").write_text(text)
    recsys.compare([reference, *runs.values()], out=out)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
