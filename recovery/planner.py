"""Checkpoint-interval planning from a failure rate and a target PLS (pure functions).

Model (CPR's, with repeats): shard failures arrive at rate ``1 / mtbf`` (per step, across the
whole job), each hitting one of ``S`` shards that hold equal shares of the updates, so each shard
fails at rate ``mu = 1 / (S * mtbf)``. A partial recovery restores the shard to its last
checkpoint; updates already lost at an earlier failure of the same shard are not lost again. A
failure strikes at a step boundary, so the steps completed since the checkpoint are 0 .. T - 1.
So a failure loses the shard's updates since the later of its checkpoint (``U`` steps ago,
uniform on ``[0, T - 1]``) and its previous failure (``X`` steps ago, exponential of rate ``mu``):

    E[loss] = E[min(U, X)] = (1 / mu) * (1 - (1 - exp(-mu L)) / (mu L)),  L = T - 1   (~ L / 2 for mu L << 1)

in steps, each worth ``B / S`` samples. Over ``N`` steps there are ``N / mtbf`` failures, so

    expected PLS(T) = (N / mtbf) * E[loss] * (B / S) / (N * B) = E[loss] / (S * mtbf)

(``(T - 1) / (2 S mtbf)`` when failures are rare against the interval). Checkpoint overhead is
``cost / T`` (``cost`` = one checkpoint's pause, in steps), falling with T; PLS rises with T. The
planner therefore picks the LARGEST interval whose expected PLS meets the target. For comparison,
full recovery's classic optimum (Young) is ``sqrt(2 * cost * mtbf)``: it balances overhead
against recomputation instead.
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


def expected_loss_steps(interval: float, mtbf_steps: float, num_shards: int) -> float:
    """Expected steps of a shard's updates one failure loses (see the module doc)."""
    mu = 1.0 / (num_shards * mtbf_steps)
    span = max(0.0, interval - 1.0)  # steps completed since the checkpoint: 0 .. T - 1
    x = mu * span
    if x < 1e-6:
        return span / 2.0
    return (1.0 - (1.0 - math.exp(-x)) / x) / mu


def expected_pls(interval: float, mtbf_steps: float, num_shards: int) -> float:
    return expected_loss_steps(interval, mtbf_steps, num_shards) / (num_shards * mtbf_steps)


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
    # the largest T meeting the target: PLS rises with T; (T - 1) / 2 bounds the loss, so
    # 2 S target mtbf is a lower bound on the answer
    lo = max(1, math.floor(2.0 * num_shards * target_pls * mtbf_steps))
    if expected_pls(lo, mtbf_steps, num_shards) > target_pls:
        interval = 1 if lo == 1 else lo - 1
    else:
        hi = lo * 2
        while expected_pls(hi, mtbf_steps, num_shards) <= target_pls:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # expected_pls(lo) <= target < expected_pls(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if expected_pls(mid, mtbf_steps, num_shards) <= target_pls else (lo, mid)
        interval = lo
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
