"""Checkpoint-interval planning from a failure rate and a target PLS (pure functions).

Model (CPR's): shard failures arrive at rate ``1 / mtbf`` (per step, across the whole job), each
hits one of ``S`` shards that hold equal shares of the updates, at a uniformly random point of the
current checkpoint interval ``T``. A partial recovery restores the shard to the last checkpoint, so
it loses on average ``T / 2`` steps of that shard's updates: ``(T / 2) * B / S`` samples' worth.
Over ``N`` steps there are ``N / mtbf`` failures, so

    expected PLS(T) = (N / mtbf) * (T / 2) * (B / S) / (N * B) = T / (2 * S * mtbf)

Checkpoint overhead is ``cost / T`` (``cost`` = one checkpoint's pause, in steps), falling with T;
PLS rises with T. The planner therefore picks the LARGEST interval whose expected PLS meets the
target: ``T* = floor(2 * S * target * mtbf)`` (at least 1). For comparison, full recovery's classic
optimum (Young) is ``sqrt(2 * cost * mtbf)``: it balances overhead against recomputation instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    interval: int
    """Checkpoint every this many steps."""
    expected_pls: float
    overhead: float
    """Checkpoint pause as a fraction of training time: cost / interval."""
    young_interval: float
    """Full recovery's optimum, for reference."""


def expected_pls(interval: float, mtbf_steps: float, num_shards: int) -> float:
    return interval / (2.0 * num_shards * mtbf_steps)


def plan_interval(
    mtbf_steps: float, target_pls: float, num_shards: int, checkpoint_cost_steps: float, max_interval: int | None = None
) -> Plan:
    if not mtbf_steps > 0:
        raise ValueError(f"mtbf={mtbf_steps} steps must be > 0")
    if not 0 < target_pls < 1:
        raise ValueError(f"target_pls={target_pls} must be in (0, 1)")
    if num_shards <= 0:
        raise ValueError(f"num_shards={num_shards} must be > 0")
    if checkpoint_cost_steps < 0:
        raise ValueError(f"checkpoint cost {checkpoint_cost_steps} steps must be >= 0")
    interval = max(1, math.floor(2.0 * num_shards * target_pls * mtbf_steps))
    if max_interval is not None:
        interval = min(interval, max(1, max_interval))
    return Plan(
        interval=interval,
        expected_pls=expected_pls(interval, mtbf_steps, num_shards),
        overhead=checkpoint_cost_steps / interval,
        young_interval=math.sqrt(2.0 * checkpoint_cost_steps * mtbf_steps),
    )


def parse_mtbf(value: str, step_seconds: float | None = None) -> float:
    """``'500'`` (steps) or ``'120s'`` (seconds, converted with the measured step time) -> steps."""
    v = value.strip()
    try:
        if v.endswith("s"):
            seconds = float(v[:-1])
            if step_seconds is None:
                return float("nan")  # known once a step time is measured
            if not step_seconds > 0:
                raise ValueError
            out = seconds / step_seconds
        else:
            out = float(v)
    except ValueError:
        raise ValueError(f"mtbf {value!r} must be a number of steps (e.g. 500) or seconds (e.g. 120s)") from None
    if not out > 0:
        raise ValueError(f"mtbf {value!r} must be > 0")
    return out
