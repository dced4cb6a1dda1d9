#!/usr/bin/env python
"""Training throughput of the Redis tier beside torchrec's engines, in one invocation.

Same model, data and steps for every row: torchrec's ``FusedEmbeddingBagCollection`` (fbgemm TBE on
the host, row-wise Adagrad fused into backward; a plain loop over pre-built batches: the strongest
peer, and the reference of the ratios), the project's local baseline (torchrec's
``EmbeddingBagCollection``, one process), and the Redis tier with 1, 2 and 4 local shards, with and
without prefetch, each with ``--trainers`` trainer processes (default 1) and the run's defaults
(trainer restarts on). samples/s counts training steps only (no setup, no evaluation).

    python scripts/bench_throughput.py [--steps 200] [--batch-size 1024] [--shards 1,2,4] [--trainers 1]
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recsys.config import DataConfig, EmbeddingConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from recsys.launch import run  # noqa: E402


def config(args, out: Path, embeddings: str, shards: int, prefetch: bool, trainers: int) -> RunConfig:
    return RunConfig(
        data=DataConfig(rows_per_table=args.rows_per_table, eval_samples=4096),
        model=ModelConfig(embedding_dim=args.embedding_dim),
        embeddings=EmbeddingConfig(embeddings=embeddings, shards=shards, prefetch=prefetch),
        optim=OptimConfig(optimizer=args.optimizer),
        train=TrainConfig(
            steps=args.steps,
            batch_size=args.batch_size,
            trainers=trainers,
            eval_every=0,
            log_every=args.steps,
            out=str(out),
            progress=False,
        ),
    )


def fused_samples_per_s(args) -> float:
    """torchrec's fused engine under the same DLRM, data and dense optimizer; 10 warm-up steps."""
    import time

    import torch
    import torch.nn.functional as F
    import torchrec
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    from data.batches import BatchReader
    from recsys.datasets import sources
    from recsys.model import build_dlrm, dense_optimizer, dense_params, table_configs

    cfg = config(args, Path("unused"), "local", 1, False, 1)
    kind = torchrec.optim.RowWiseAdagrad if cfg.optim.optimizer == "adagrad" else torchrec.optim.SGD
    kwargs = {"lr": cfg.optim.lr, "eps": cfg.optim.eps} if cfg.optim.optimizer == "adagrad" else {"lr": cfg.optim.lr}
    ebc = FusedEmbeddingBagCollection(
        tables=table_configs(cfg), optimizer_type=kind, optimizer_kwargs=kwargs, device=torch.device("cpu")
    )
    model = build_dlrm(cfg, ebc)
    opt = dense_optimizer(cfg, dense_params(model))
    reader = BatchReader(sources(cfg).train, args.batch_size, world_size=1, rank=0, epochs=1 << 30)
    batches = [next(reader) for _ in range(args.steps + 10)]

    def step(b) -> None:
        loss = F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features).squeeze(1), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for b in batches[:10]:
        step(b)
    t0 = time.perf_counter()
    for b in batches[10:]:
        step(b)
    return args.steps * args.batch_size / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps per configuration")
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    ap.add_argument("--rows-per-table", type=int, default=100_000, help="rows of each of the 26 tables")
    ap.add_argument("--embedding-dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad"], help="optimizer")
    ap.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    ap.add_argument("--trainers", type=int, default=1, help="trainer processes for the Redis tier")
    args = ap.parse_args()
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    shard_counts = [int(s) for s in args.shards.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        rows.append(("torchrec fused EBC", 1, "-", fused_samples_per_s(args)))
        base = run(config(args, Path(tmp) / "local", "local", 1, False, 1))
        rows.append(("local torchrec EBC", 1, "-", base["throughput_samples_per_s"]))
        for s in shard_counts:
            for prefetch in (True, False):
                out = Path(tmp) / f"redis-{s}-{prefetch}"
                summary = run(config(args, out, "redis", s, prefetch, args.trainers))
                rows.append(
                    (
                        f"redis x{args.trainers} trainer(s)",
                        s,
                        "on" if prefetch else "off",
                        summary["throughput_samples_per_s"],
                    )
                )
    ref = rows[0][3]
    print(
        f"\nsteps={args.steps} batch={args.batch_size} tables=26x{args.rows_per_table}x{args.embedding_dim} "
        f"optimizer={args.optimizer}"
    )
    print(f"{'embeddings':<24} {'shards':>6} {'prefetch':>8} {'samples/s':>11} {'x fused':>8}")
    for name, s, p, tput in rows:
        print(f"{name:<24} {s:>6} {p:>8} {tput:>11,.0f} {tput / ref:>7.2f}x")


if __name__ == "__main__":
    main()
