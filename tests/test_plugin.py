"""Written as a user of the pytest plugin writes recovery tests for their own runs: only the
plugin's public fixtures (``recsys_train``, ``failure_schedule``, ``redis_servers``,
``recsys_checks``) and ``recsys``; nothing from this repository's tests."""

import threading
import time

import pytest


def test_log_recovery_keeps_every_update(recsys_train, failure_schedule, recsys_checks):
    reference = recsys_train("reference")
    failure_schedule.kill_shard(1, step=25)
    run = recsys_train("log", recovery="log", checkpoint_every=10, inject=failure_schedule.specs)
    (failure,) = recsys_checks.recovered(run, failures=1, strategy="log")
    # met where the checkpoint of step 30 closes trainer 1's window (the rows are written in windows)
    assert failure.target == 1 and failure.step == 30 and failure.lost_updates == 0
    recsys_checks.same_embeddings(reference, run)


def test_partial_recovery_loses_a_bounded_share(recsys_train, failure_schedule, recsys_checks):
    failure_schedule.stall_shard(2, 1.5, step=12).kill_shard(0, step=30)
    run = recsys_train("partial", recovery="partial", checkpoint_every=20, timeout_s=0.5, inject=failure_schedule.specs)
    failures = recsys_checks.recovered(run, failures=2, strategy="partial")
    assert [f.target for f in failures] == [2, 0]
    assert run.summary.pls > 0 and run.summary.lost_updates > 0
    recsys_checks.lost_at_most(run, 0.2)  # two failures of 1 shard in 3, each under 11 of 40 steps
    with pytest.raises(AssertionError, match="PLS"):
        recsys_checks.lost_at_most(run, 0.0)  # the check can fail
    reference = recsys_train("reference")
    with pytest.raises(AssertionError, match="embeddings differ"):
        recsys_checks.same_embeddings(reference, run)


def test_a_drawn_schedule_under_incremental_flushes(recsys_train, recsys_checks):
    from recsys.testing import FailureSchedule

    schedule = FailureSchedule.drawn(steps=40, mtbf=15, shards=3, seed=3)
    assert len(schedule) >= 1 and schedule.specs == FailureSchedule.drawn(40, 15, 3, seed=3).specs
    run = recsys_train(
        "incremental", recovery="incremental", checkpoint_every=20, flush_every=4, **schedule.overrides()
    )
    failures = recsys_checks.recovered(run, failures=len(schedule), strategy="incremental")
    assert all(f.raw["flushed_to_step"] >= f.restored_from_step for f in failures)


def test_servers_killed_from_outside_mid_run(redis_servers, recsys_train, recsys_checks, tmp_path):
    servers = redis_servers(3, supervised=True)  # restarted empty when killed, like Restart=always
    reference = recsys_train("reference", redis=servers.redis, steps=60)

    def kill_once_training_runs() -> None:
        metrics = tmp_path / "killed" / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
            time.sleep(0.02)
        servers.kill(1)

    killer = threading.Thread(target=kill_once_training_runs)
    killer.start()
    run = recsys_train("killed", redis=servers.redis, steps=60, recovery="log", checkpoint_every=10)
    killer.join()
    assert servers.restarts[1] == 1 and servers.alive(1)
    recsys_checks.recovered(run, failures=1, strategy="log")
    recsys_checks.same_embeddings(reference, run)
