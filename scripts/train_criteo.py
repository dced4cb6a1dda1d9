#!/usr/bin/env python
"""Train DLRM on Criteo with several trainers over the Redis embedding tier (the Python API).

    .venv/bin/python scripts/train_criteo.py --data /data/criteo/train.txt --trainers 2 --shards 4

``--data``: Kaggle's ``train.txt`` (tab-separated text, preprocessed to npy into the run folder
once) or a folder of preprocessed ``kaggle_*.npy``. The DLRM split: days 0-5 train, day 6 halves
for validation and test. Categorical ids are hashed into ``--rows-per-table`` rows per table.
Prints the run's figures; the run folder holds summary.json, metrics.jsonl, config.toml and
plots/training.png. Any further setting: ``--set key=value`` (a config key, e.g. ``--set lr=0.1``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import recsys  # noqa: E402


def parse_set(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep:
            raise recsys.ConfigError(f"--set {item!r}: expected key=value")
        for cast in (int, float):
            try:
                out[key] = cast(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="Kaggle train.txt, or a folder of its preprocessed npy files")
    ap.add_argument("--trainers", type=int, default=2, help="trainer processes (data-parallel dense layers)")
    ap.add_argument("--shards", type=int, default=4, help="local Redis shards holding the embedding tables")
    ap.add_argument("--steps", type=int, default=1000, help="training steps")
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    ap.add_argument("--rows-per-table", type=int, default=100_000, help="hashed rows of each of the 26 tables")
    ap.add_argument("--eval-samples", type=int, default=65_536, help="validation samples for AUC")
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: at the end)")
    ap.add_argument("--recovery", default="partial", help="shard failure strategy (see python -m recsys train -h)")
    ap.add_argument("--checkpoint-every", type=int, default=0, help="checkpoint interval in steps (0: none)")
    ap.add_argument("--out", default="runs/criteo", help="run folder")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any other config key")
    args = ap.parse_args(argv)
    try:
        cfg = recsys.configure(
            data=f"criteo-kaggle:{args.data}",
            trainers=args.trainers,
            shards=args.shards,
            steps=args.steps,
            batch_size=args.batch_size,
            rows_per_table=args.rows_per_table,
            eval_samples=args.eval_samples,
            eval_every=args.eval_every,
            recovery=args.recovery,
            checkpoint_every=args.checkpoint_every,
            out=args.out,
            **parse_set(args.set),
        )
        run = recsys.train(cfg)
    except recsys.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    s = run.summary
    print(
        f"{s.steps} steps x {args.batch_size} on {s.trainers} trainers and {s.shards} shards: "
        f"{s.throughput:,.0f} samples/s, final AUC {s.final_auc:.4f}, logloss {s.final_logloss:.4f}; "
        f"outputs in {run.path}/"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
