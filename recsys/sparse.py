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

from embeddings.shard_map import ShardMap


@dataclass
class StepUpdate:
    """One step's sparse update, in packed row keys (``embeddings.rowkeys``), sorted."""

    keys: np.ndarray
    """Rows this trainer writes: [n] int64 keys."""
    grads: torch.Tensor
    """Their global gradients, [n, dim] float32."""
    shards: np.ndarray
    """Shard of each of ``keys``, [n] int64."""
    updated_keys: np.ndarray
    """Every row updated this step by any trainer, [m] int64 keys."""
    updated_shards: np.ndarray
    """Shard of each of ``updated_keys``."""


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


def aggregate(keys: np.ndarray, grads: torch.Tensor, shard_map: ShardMap, world_size: int, rank: int) -> StepUpdate:
    """This trainer's per-row gradients (packed keys [n], grads [n, dim]) summed over trainers."""
    k, g = all_gather_rows(torch.from_numpy(keys), grads.detach().to(torch.float32), world_size)
    if world_size == 1 and (len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1]))):
        uniq, summed = k, g  # one forward's rows: already sorted and unique
    else:
        uniq, inverse = torch.unique(k, return_inverse=True)
        summed = torch.zeros((len(uniq), g.shape[1]), dtype=torch.float32)
        summed.index_add_(0, inverse, g)
        if world_size > 1:
            summed /= world_size
    keys_all = uniq.numpy()
    shards = shard_map.shard_of_keys(keys_all)
    if world_size == 1:
        return StepUpdate(keys_all, summed, shards, keys_all, shards)
    mine = np.flatnonzero(shards % world_size == rank)
    return StepUpdate(keys_all[mine], summed[torch.from_numpy(mine)], shards[mine], keys_all, shards)
