"""Aggregation of per-row embedding gradients across trainers (sync semantics).

Each trainer's loss is the mean over its B samples, so the global loss over the W*B samples is
the mean of the trainers' losses and its gradient for a row is ``(1/W) * sum_r grad_r``. Every
trainer all-gathers (table, row, grad) of all trainers, sums per row in a fixed order (rank 0's
rows first), divides by W, and applies only the rows of the shards it owns: shard ``s`` is
written by trainer ``s % W`` alone (one writer per shard per step). Every trainer also learns the
full set of rows updated this step, which keeps its prefetched rows coherent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from embeddings import rowkeys
from embeddings.shard_map import ShardMap


@dataclass
class StepUpdate:
    owned: dict[str, tuple[np.ndarray, torch.Tensor]]
    """Rows this trainer writes: table -> (ids, global gradient [n, dim])."""
    updated: dict[str, np.ndarray]
    """Every row updated this step by any trainer: table -> ids."""


def pack(
    grads: dict[str, tuple[np.ndarray, torch.Tensor]], names: list[str], dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    keys, blocks = [], []
    for t, name in enumerate(names):
        if name in grads:
            ids, g = grads[name]
            keys.append(torch.from_numpy(rowkeys.pack(t, np.asarray(ids, np.int64))))
            blocks.append(g.detach().to(torch.float32).reshape(-1, dim))
    if not keys:
        return torch.empty(0, dtype=torch.int64), torch.empty((0, dim), dtype=torch.float32)
    return torch.cat(keys), torch.cat(blocks)


def all_gather_rows(keys: torch.Tensor, grads: torch.Tensor, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length all-gather of (keys [n], grads [n, dim]); rank order preserved."""
    if world_size == 1:
        return keys, grads
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(keys)], dtype=torch.int64))
    counts = [int(s.item()) for s in sizes]
    most = max(counts)
    pad_k = torch.full((most,), -1, dtype=torch.int64)
    pad_k[: len(keys)] = keys
    pad_g = torch.zeros((most, grads.shape[1]), dtype=torch.float32)
    pad_g[: len(grads)] = grads
    all_k = [torch.empty_like(pad_k) for _ in range(world_size)]
    all_g = [torch.empty_like(pad_g) for _ in range(world_size)]
    dist.all_gather(all_k, pad_k)
    dist.all_gather(all_g, pad_g)
    return (
        torch.cat([k[:c] for k, c in zip(all_k, counts)]),
        torch.cat([g[:c] for g, c in zip(all_g, counts)]),
    )


def aggregate(
    grads: dict[str, tuple[np.ndarray, torch.Tensor]],
    names: list[str],
    dim: int,
    shard_map: ShardMap,
    world_size: int,
    rank: int,
) -> StepUpdate:
    keys, g = all_gather_rows(*pack(grads, names, dim), world_size)
    uniq, inverse = torch.unique(keys, return_inverse=True)
    summed = torch.zeros((len(uniq), dim), dtype=torch.float32)
    summed.index_add_(0, inverse, g)
    if world_size > 1:
        summed /= world_size
    tables, rows = (x.numpy() for x in rowkeys.unpack(uniq))
    owned, updated = {}, {}
    for t in np.unique(tables).tolist():
        sel = np.flatnonzero(tables == t)
        ids = rows[sel]
        updated[names[t]] = ids
        mine = (shard_map.shard_of(t, ids) % world_size) == rank
        if mine.any():
            owned[names[t]] = (ids[mine], summed[torch.from_numpy(sel[mine])])
    return StepUpdate(owned=owned, updated=updated)
