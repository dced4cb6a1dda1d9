#!/usr/bin/env python
"""The embedding kernels alone: fbgemm's TBE against the tier's own, on one batch shape, on the host.

fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` (the fused engine's kernels: pooling, backward
and the row-wise Adagrad update fused) over host tables, against what the tier computes for the same
batch: the batch's unique rows gathered from a row table, pooled and differentiated by TBE's host
forward and dense backward (``embeddings.bags.kernels``, the tier's default ``--kernels fbgemm``) or by
``index_select`` (one id a bag, as Criteo's features) or ``embedding_bag`` (``--bag-sizes``:
multi-hot bags, as the mlperf-v2 preset's) (``--kernels torch``), then row-wise Adagrad on the
unique rows and their scatter back.
Both see the same ids (Zipf, per table); each runs ``--steps`` steps after 10 warm-up steps, with
``--threads`` torch threads. What it answers: whether moving the tier's step into TBE's kernels
would make its compute faster on this host.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tables", type=int, default=26, help="tables")
    ap.add_argument("--rows-per-table", type=int, default=100_000, help="rows of each table")
    ap.add_argument("--embedding-dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--batch-size", type=int, default=1024, help="batch size (one id a bag)")
    ap.add_argument("--zipf", type=float, default=1.2, help="Zipf exponent of the ids")
    ap.add_argument("--steps", type=int, default=50, help="timed steps")
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument(
        "--bag-sizes",
        default="1",
        help="ids in each table's bags: one size for every table, a comma-separated list of one per "
        "table, or mlperf-v2 (that preset's multi-hot sizes, 26 tables)",
    )
    return ap


def main() -> None:
    args = parser().parse_args()
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        EmbeddingLocation,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    from embeddings.bags.kernels import pool

    t, r, d, b = args.tables, args.rows_per_table, args.embedding_dim, args.batch_size
    sizes = bag_sizes(args.bag_sizes, t)
    rng = np.random.default_rng(0)
    per_table = [b * k for k in sizes]  # ids of each table in a batch (table-major, as TBE takes them)
    batches = [
        torch.from_numpy(np.concatenate([(rng.zipf(args.zipf, size=n) - 1) % r for n in per_table]).astype(np.int64))
        for _ in range(args.steps + 10)
    ]
    base = torch.repeat_interleave(torch.arange(t) * r, torch.tensor(per_table))
    unique = np.mean([len(torch.unique(x + base)) for x in batches])
    lengths = torch.repeat_interleave(torch.tensor(sizes), b)  # ids of each bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    single = all(k == 1 for k in sizes)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(r, d, EmbeddingLocation.HOST, ComputeDevice.CPU)] * t,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=0.01,
        eps=1e-8,
    )
    table = torch.zeros(t * r, d + 1)  # the tier's rows: weights and the row-wise accumulator

    def fused(ids: torch.Tensor) -> None:
        out = tbe(ids, offsets)
        out.backward(torch.full_like(out, 1e-3))

    def tier(ids: torch.Tensor, kernels: str = "torch") -> None:
        keys, inverse = torch.unique(ids + base, return_inverse=True)
        rows = table.index_select(0, keys)
        w = rows[:, :d].clone().requires_grad_()
        if kernels == "fbgemm":  # TBE's host forward and dense backward over the unique rows
            out = pool(w, inverse, offsets, t, "sum")
        elif single:
            out = w.index_select(0, inverse)
        else:
            out = F.embedding_bag(inverse, w, offsets, mode="sum", include_last_offset=True)
        out.backward(torch.full_like(out, 1e-3))
        g = w.grad
        acc = rows[:, d] + g.pow(2).mean(1)
        table[keys, :d] = rows[:, :d] - 0.01 * g / (acc.sqrt() + 1e-8)[:, None]
        table[keys, d] = acc

    bags = "one id a bag" if single else f"bags of {args.bag_sizes} ids ({sum(per_table):,} ids a batch)"
    print(f"{t} tables x {r} rows x {d}, batch {b}, {bags}, Zipf {args.zipf}: {unique:,.0f} unique rows a step")
    print("| kernels | threads | ms/step |\n|---|---|---|")
    for threads in [int(x) for x in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, step in (
            ("fbgemm TBE: pool, backward, row-wise Adagrad fused", fused),
            ("the tier's, --kernels torch: index_select or embedding_bag, then the row update", tier),
            (
                "the tier's, --kernels fbgemm (default): TBE's forward and dense backward, then the row update",
                lambda ids: tier(ids, "fbgemm"),
            ),
        ):
            for ids in batches[:10]:
                step(ids)
            t0 = time.perf_counter()
            for ids in batches[10:]:
                step(ids)
            print(f"| {name} | {threads} | {(time.perf_counter() - t0) / args.steps * 1e3:.2f} |")


def bag_sizes(text: str, tables: int) -> list[int]:
    """``--bag-sizes`` as one size per table (SystemExit with one line for a bad value)."""
    if text == "mlperf-v2":
        from recsys.config import MLPERF_V2_MULTI_HOT

        sizes = list(MLPERF_V2_MULTI_HOT)
    else:
        try:
            sizes = [int(x) for x in text.split(",")]
        except ValueError:
            raise SystemExit(f"--bag-sizes {text!r}: sizes (integers), comma-separated, or mlperf-v2") from None
        if len(sizes) == 1:
            sizes *= tables
    if len(sizes) != tables or min(sizes) < 1:
        raise SystemExit(f"--bag-sizes {text!r}: {tables} sizes of at least 1 (one per table of --tables)")
    return sizes


if __name__ == "__main__":
    main()
