"""When a trainer checkpoints, takes priority saves and flushes (``--checkpoint-every``, or ``auto``:
the interval the planner picks from the measured step time)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from recovery.planner import parse_mtbf, plan_interval
from recovery.strategy import Strategy
from recsys.clock import WARMUP_STEPS

if TYPE_CHECKING:
    from recovery.protocol import Collective
    from recsys.config import RunConfig


class Schedule:
    """When to checkpoint and take priority saves. ``auto``: after ``WARMUP_STEPS`` the planner picks
    the interval from the measured step time and checkpoint pause (rank 0 decides, all follow)."""

    def __init__(self, cfg: RunConfig, num_shards: int, coll: Collective, rank: int) -> None:
        rc = cfg.recovery
        self.rc, self.num_shards, self.coll, self.rank = rc, num_shards, coll, rank
        self.auto = rc.checkpoint_every == "auto"
        self.every = 0 if self.auto else int(rc.checkpoint_every)
        self.priority_on = Strategy(rc.recovery).priority_saves
        self.flush_on = Strategy(rc.recovery).flushes
        self.plan: dict | None = None
        self._step_times: list[float] = []
        self.checkpoint_pause_s = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.rc.checkpoint_every)

    @property
    def priority_every(self) -> int:
        return self.rc.priority_every or max(1, self.every // 4)

    @property
    def flush_every(self) -> int:
        return self.rc.flush_every or max(1, self.every // 10)

    def observe(self, step: int, seconds: float) -> None:
        if not self.auto or self.every:
            return
        if step > 1:
            self._step_times.append(seconds)
        if step == WARMUP_STEPS:
            interval = -1
            if self.rank == 0:
                step_s = float(np.median(self._step_times))
                mtbf = parse_mtbf(self.rc.mtbf, step_seconds=step_s)
                plan = plan_interval(mtbf, self.rc.target_pls, self.num_shards, self.checkpoint_pause_s / step_s)
                interval = plan.interval
                self.plan = {
                    "interval": plan.interval,
                    "expected_pls": plan.expected_pls,
                    "overhead": plan.overhead,
                    "young_interval": plan.young_interval,
                    "mtbf_steps": mtbf,
                    "step_s": step_s,
                    "checkpoint_pause_s": self.checkpoint_pause_s,
                    "target_pls": self.rc.target_pls,
                }
            self.every = self.coll.broadcast_int(interval)

    def checkpoint_due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def priority_due(self, step: int) -> bool:
        return (
            self.priority_on and bool(self.every) and step % self.priority_every == 0 and not self.checkpoint_due(step)
        )

    def flush_due(self, step: int) -> bool:
        return self.flush_on and bool(self.every) and step % self.flush_every == 0 and not self.checkpoint_due(step)

    def state(self) -> dict:
        return {"every": self.every}

    def load(self, state: dict) -> None:
        self.every = int(state["every"])
