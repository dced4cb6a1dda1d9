"""Lost-update and lost-sample accounting: the counters, the formulas, and the ledger of restores.

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


RECENT = 512  # steps of update totals kept for replica and window loss accounting


class Ledger:
    """What each restore loses, counted exactly: updates per shard since the state a shard came
    back as of, and the samples they stand for (``lost_samples``).

    ``counter``: update totals per shard, with snapshots at checkpoints and flushes; ``recent``: the
    totals of the last ``RECENT`` steps (a replica or a window's restore is as of any step);
    ``counted``: shard -> the intervals of steps its partial restores counted lost, each
    ``[first step before, its totals, last step, its totals]``, so that no update is counted twice; ``last_update``: per shard, the last step that updated rows on it
    (a resume finds a shard behind only against it)."""

    def __init__(
        self, num_shards: int, batch_size: int, counter: UpdateCounter | None = None, recent=False, windowed=False
    ) -> None:
        self.counter = counter or UpdateCounter(num_shards)
        self.batch_size = batch_size
        self.keep_recent = recent or windowed
        self.windowed = windowed  # write-behind windows: a failed window's steps are redone, not lost
        self.lost: list[float] = []
        self.counted: dict[int, list[list]] = {}
        self.recent: dict[int, np.ndarray] = {}
        self.last_update = np.zeros(num_shards, dtype=np.int64)

    def count(self, shards: np.ndarray, step: int | None) -> None:
        """A step's updated rows, by shard."""
        counts = np.bincount(shards, minlength=len(self.counter.total)).astype(np.int64)
        self.counter.add(counts)
        if step is None:
            return
        self.last_update[counts > 0] = step
        self.recent[step] = self.counter.total.copy()  # a restore is as of any step (a replica's, a window's,
        self.recent.pop(step - RECENT, None)  # the step before a failed write-behind's)

    def totals_at(self, step: int) -> np.ndarray | None:
        return self.recent.get(step, self.counter.at_step.get(step))

    def lost_until(self, completed: int, redo_steps: list[int]) -> tuple[int, np.ndarray]:
        """The last step whose updates to a shard a restore loses, and the update totals as of it:
        ``completed``, or with windows the step before the failed write's first step (that write's
        steps are redone on the restored shard, so they are not lost)."""
        if not self.windowed or not redo_steps:
            # the totals as of ``completed``: a write-behind's step counted since is redone, not lost
            at = self.totals_at(completed)
            return completed, at if at is not None and completed in self.recent else self.counter.total
        end = min(redo_steps) - 1
        totals = self.totals_at(end)
        if end <= 0:
            totals = np.zeros_like(self.counter.total)
        if end >= completed or totals is None:
            return completed, self.counter.total
        return end, totals

    def partial(self, rec: dict, shard: int, as_of: int, completed: int, saved: int, redo_steps: list[int]) -> None:
        """A shard restored as of step ``as_of`` (plus ``saved`` of its updates since, overlaid):
        the rest of its updates up to ``completed`` are lost. Updates counted lost at an earlier
        failure of the shard are not lost again: each restore's counted interval of steps is kept
        per shard, and a later one counts only what lies outside all of them (a restore to an older
        base than an earlier one's, its newer checkpoints corrupt, counts the steps between the two
        bases too)."""
        base = self.counter.at_step.get(as_of, np.zeros_like(self.counter.total))
        end, end_totals = self.lost_until(completed, redo_steps)
        since = end_totals - base if end > as_of else np.zeros_like(base)
        steps = max(0, end - as_of)
        for lo, lo_totals, hi, hi_totals in self.counted.get(shard, []):
            a, b = max(lo, as_of), min(hi, end)
            if b <= a:
                continue  # no step in common
            at_a = np.asarray(lo_totals if a == lo else base, dtype=np.int64)
            at_b = np.asarray(hi_totals if b == hi else end_totals, dtype=np.int64)
            since = since - (at_b - at_a)  # counted then
            steps -= b - a
        rec["lost_updates"] = max(int(since[shard]) - saved, 0)
        rec["lost_samples"] = round(lost_samples(steps * self.batch_size, rec["lost_updates"], int(since.sum())), 3)
        self.lost.append(rec["lost_samples"])
        after = self.counter.total if self.windowed else end_totals  # what a later restore counts from
        interval = [as_of, base.tolist(), completed, after.tolist()]
        self.counted.setdefault(shard, []).append(interval)
        rec["_since"] = [completed, after.tolist()]
        rec["_counted"] = interval

    def replica(self, rec: dict, shard: int, at: int, completed: int, redo_steps: list[int]) -> None:
        """A promoted replica holds every write up to its applied step ``at``: the later ones are lost."""
        end, end_totals = self.lost_until(completed, redo_steps)
        if at >= end:
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        else:
            known = [k for k in self.recent if k <= at] or [k for k in self.counter.at_step if k <= at]
            base = max(known)  # the replica's step, or the newest step before it we hold totals of
            since = end_totals - self.totals_at(base)
            rec["lost_updates"] = int(since[shard])
            rec["lost_samples"] = round(
                lost_samples((end - at) * self.batch_size, rec["lost_updates"], int(since.sum())), 3
            )
        self.lost.append(rec["lost_samples"])

    def rolled_back(self, to_step: int) -> None:
        self.counter.total = self.counter.at_step.get(to_step, np.zeros_like(self.counter.total)).copy()

    def from_journal(self, failures: list[dict]) -> None:
        """After a restart: the losses so far are the journal's (the dense state may be older)."""
        self.lost = [f["lost_samples"] for f in failures if "_since" in f]
        self.counted = {}
        for f in failures:
            if "_since" in f:
                self.counted.setdefault(int(f["target"]), []).append(_interval(f))

    def state(self) -> dict:
        return {
            "counter": self.counter.state(),
            "lost": list(self.lost),
            "lost_counted": {str(s): intervals for s, intervals in self.counted.items()},
            "last_update": self.last_update.tolist(),
        }

    def load_state(self, state: dict) -> None:
        self.counter.load(state["counter"])
        self.lost = list(state["lost"])
        if "lost_counted" in state:
            self.counted = {int(s): [list(i) for i in v] for s, v in state["lost_counted"].items()}
        else:  # a run state written before the intervals were kept: the last restore's end alone
            self.counted = {int(s): [_older(v[0], v[1])] for s, v in state.get("lost_since", {}).items()}
        if "last_update" in state:
            self.last_update = np.asarray(state["last_update"], dtype=np.int64)


def _older(completed: int, totals: list[int]) -> list:
    """An interval recorded before intervals were kept: every step up to ``completed`` counted."""
    return [-1, [0] * len(totals), int(completed), list(totals)]


def _interval(rec: dict) -> list:
    """A failure record's counted interval (``_counted``; an older journal's ``_since`` alone)."""
    if "_counted" in rec:
        lo, lo_totals, hi, hi_totals = rec["_counted"]
        return [int(lo), list(lo_totals), int(hi), list(hi_totals)]
    return _older(rec["_since"][0], rec["_since"][1])
