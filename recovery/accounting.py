"""Lost-update and lost-sample accounting (pure functions).

PLS, the portion of lost samples: for each partial recovery of shard K restored to checkpoint c,
the samples trained since c weighted by the share of the embedding updates since c that shard K
held; summed over failures and divided by all samples trained.
"""

from __future__ import annotations

import numpy as np


class UpdateCounter:
    """Cumulative (row, step) updates per shard, with snapshots at checkpoint steps."""

    def __init__(self, num_shards: int) -> None:
        self.total = np.zeros(num_shards, dtype=np.int64)
        self.at_step: dict[int, np.ndarray] = {0: self.total.copy()}

    def add(self, per_shard: np.ndarray) -> None:
        self.total += per_shard

    def mark(self, step: int) -> None:
        self.at_step[step] = self.total.copy()

    def since(self, step: int) -> np.ndarray:
        return self.total - self.at_step.get(step, np.zeros_like(self.total))

    def state(self) -> dict:
        return {"total": self.total.tolist(), "at_step": {str(k): v.tolist() for k, v in self.at_step.items()}}

    def load(self, state: dict) -> None:
        self.total = np.array(state["total"], dtype=np.int64)
        self.at_step = {int(k): np.array(v, dtype=np.int64) for k, v in state["at_step"].items()}


def lost_samples(samples_since_checkpoint: int, shard_updates_since: int, all_updates_since: int) -> float:
    """Samples trained since the restored checkpoint, weighted by the failed shard's share of updates."""
    if all_updates_since <= 0:
        return 0.0
    return samples_since_checkpoint * shard_updates_since / all_updates_since


def pls(lost: list[float], samples_trained: int) -> float:
    return float(sum(lost) / samples_trained) if samples_trained > 0 else 0.0
