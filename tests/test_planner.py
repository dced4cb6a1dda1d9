import numpy as np
import pytest

from recovery.accounting import lost_samples, pls
from recovery.planner import expected_pls, parse_mtbf, plan_interval


def test_interval_is_monotone_in_failure_rate_and_target():
    by_mtbf = [plan_interval(m, 0.01, 4, 2.0).interval for m in (50, 100, 500, 1000, 5000)]
    assert by_mtbf == sorted(by_mtbf) and by_mtbf[0] < by_mtbf[-1]  # rarer failures: longer interval
    by_target = [plan_interval(1000, p, 4, 2.0).interval for p in (0.001, 0.005, 0.01, 0.05)]
    assert by_target == sorted(by_target) and by_target[0] < by_target[-1]  # looser target: longer
    by_shards = [plan_interval(1000, 0.01, s, 2.0).interval for s in (1, 2, 8)]
    assert by_shards == sorted(by_shards)


def test_plan_numbers():
    p = plan_interval(1000, 0.01, 4, 3.0)
    # E[loss] = 4000 (1 - (1 - e^-x) / x), x = 80 / 4000: 39.735 steps at T = 81 ((T - 1) / 2 = 40 without repeats)
    assert p.interval == 81 and p.expected_pls == pytest.approx(39.7351 / 4000, rel=1e-4)
    assert expected_pls(82, 1000, 4) > 0.01 and p.overhead == pytest.approx(3 / 81)
    # frequent failures: repeats of one shard inside an interval make the loss smaller than (T - 1) / 2
    x = 99 / 200
    assert expected_pls(100, 50, 4) == pytest.approx(200 * (1 - (1 - np.exp(-x)) / x) / 200, rel=1e-9)
    assert expected_pls(1, 50, 4) == 0.0  # a checkpoint every step: a failure loses nothing
    assert plan_interval(50, 0.2, 4, 1.0).interval > 2 * 4 * 0.2 * 50
    assert p.young_interval == pytest.approx(np.sqrt(6000))
    assert plan_interval(10, 0.001, 1, 1.0).interval == 1  # never below one step
    assert plan_interval(1e6, 0.5, 8, 1.0, max_interval=200).interval == 200
    with pytest.raises(ValueError, match="target_pls=1.5"):
        plan_interval(100, 1.5, 4, 1.0)
    assert parse_mtbf("500") == 500 and parse_mtbf("120s", step_seconds=0.5) == 240
    with pytest.raises(ValueError, match="mtbf 'soon'"):
        parse_mtbf("soon")


def simulate_pls(interval, mtbf, shards, steps, batch, seed):
    """Failures at rate 1/mtbf per step, a random shard each; partial recovery loses the shard's
    share of the updates since the last checkpoint (accounting as in the recovery manager)."""
    rng = np.random.default_rng(seed)
    fail_steps = np.flatnonzero(rng.random(steps) < 1.0 / mtbf) + 1
    lost, previous = [], {}
    for s in fail_steps:
        k = int(rng.integers(shards))
        base = max(((s - 1) // interval) * interval, previous.get(k, 0))  # lost once: since the later
        since = (s - 1) - base  # completed steps since the checkpoint or the shard's previous failure
        previous[k] = s - 1
        updates = rng.multinomial(since * 1000, [1 / shards] * shards) if since else np.zeros(shards)
        lost.append(lost_samples(since * batch, int(updates[k]), int(updates.sum())))
    return pls(lost, steps * batch)


@pytest.mark.parametrize("mtbf, target, shards", [(200, 0.01, 4), (1000, 0.002, 8), (100, 0.05, 2), (20, 0.3, 4)])
def test_planned_interval_meets_the_target_in_a_simulated_schedule(mtbf, target, shards):
    plan = plan_interval(mtbf, target, shards, 1.0)
    sims = [simulate_pls(plan.interval, mtbf, shards, 200_000, 64, seed) for seed in range(5)]
    assert np.mean(sims) <= target * 1.05
    assert np.mean(sims) == pytest.approx(expected_pls(plan.interval, mtbf, shards), rel=0.1)
    # and a longer interval than planned would miss it
    longer = [simulate_pls(plan.interval * 2, mtbf, shards, 200_000, 64, seed) for seed in range(5)]
    assert np.mean(longer) > target
