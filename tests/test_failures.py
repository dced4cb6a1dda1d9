"""End-to-end failures on real processes: 2 trainers (torch elastic, gloo), 3 redis-server shards."""

import json
import time
from pathlib import Path

import pytest

from tests.conftest import train_cli

ROOT = Path(__file__).resolve().parents[1]
BASE = [
    "--steps",
    "40",
    "--trainers",
    "2",
    "--shards",
    "3",
    "--rows-per-table",
    "2000",
    "--batch-size",
    "256",
    "--embedding-dim",
    "8",
    "--eval-every",
    "0",
    "--eval-samples",
    "2048",
    "--log-every",
    "5",
    # the per-step contract: a shard's failure is met at the step it happens (2 trainers writing in
    # windows, the default, meet it at the window's close: tests/test_windows_groups.py)
    "--write-every",
    "1",
]
LOG = ("--recovery", "log", "--checkpoint-every", "10")  # exact recovery from the shard's log


def train(out: Path, *flags: str) -> dict:
    return train_cli(out, *BASE, *flags)


def logged_rows(logs: Path, shard: int, after: int, upto: int) -> int:
    """Rows the update log of ``shard`` holds for steps ``after``+1..``upto``."""
    from recovery.durable.log import ShardLog

    return sum(len(r.ids) for r in ShardLog(logs, shard).records(after_step=after, up_to_step=upto))


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("base"))


def test_log_recovery_of_a_killed_shard_ends_bit_for_bit(tmp_path, baseline):
    s = train(tmp_path, "--recovery", "log", "--checkpoint-every", "10", "--inject", "shard:1@step=25")
    (f,) = s["failures"]
    assert (f["kind"], f["target"], f["step"], f["strategy"]) == ("shard", 1, 25, "log")
    assert f["restored_from_step"] == 20 and f["lost_updates"] == 0 and f["restored_bytes"] > 0
    # the restore's parts are timed, and they make up (most of) it; the call that saw the failure ran
    # no longer than the time since the kill
    assert {"checkpoint", "kill", "copy", "start", "replay_read", "replay_write"} <= set(f["phases_s"])
    # each figure rounded to 0.1 ms: their sum may pass the rounded whole by half of that each
    assert 0 < sum(f["phases_s"].values()) <= f["recovery_s"] + 5e-5 * (len(f["phases_s"]) + 1)
    assert 0 <= f["failed_call_s"] <= f["detected_after_s"]
    assert s["embedding_digest"] == baseline["embedding_digest"]
    assert s["pls"] == 0.0 and s["log_bytes"] > 0 and s["log_fsync"] == "always"
    assert all(c["pause_s"] < c["total_s"] or c["total_s"] == 0 for c in s["checkpoints"])


def test_a_stage_failure_agreed_in_the_dense_gather_runs_the_step_again_bit_for_bit(tmp_path, baseline):
    """2 trainers reducing in chunk order agree on a stage's failure in the step's dense gather, not
    in a collective of the stage's own (``CommitPoints.stage_ahead``). A cache holding a sixth of the
    rows makes every stage read rows from the shards: the one after shard 1's kill fails, the trainer
    whose stage failed computes nothing, every trainer drops the step's compute, the shard is restored
    from its log, and the stage and the compute run again: the digest of no failure."""
    s = train(
        tmp_path,
        *LOG,
        "--held-rows-mb",
        "0.3",
        "--inject",
        "shard:1@step=25",
    )
    (f,) = s["failures"]
    assert (f["phase"], f["step"], f["target"], f["lost_updates"]) == ("stage", 25, 1, 0)
    assert s["embedding_digest"] == baseline["embedding_digest"]


def test_full_recovery_replays_from_the_checkpoint_to_the_same_digest(tmp_path, baseline):
    s = train(tmp_path, "--recovery", "full", "--checkpoint-every", "10", "--inject", "shard:2@step=27")
    (f,) = s["failures"]
    assert f["strategy"] == "full" and f["restored_from_step"] == 20 and f["recomputed_steps"] == 6
    assert s["embedding_digest"] == baseline["embedding_digest"]


def test_partial_recovery_counts_the_updates_it_lost(tmp_path, baseline):
    # logs are written (not replayed) so the updates actually lost can be counted independently
    s = train(
        tmp_path,
        "--steps",
        "35",
        "--recovery",
        "partial",
        "--checkpoint-every",
        "20",
        "--log-dir",
        str(tmp_path / "logs"),
        "--inject",
        "shard:0@step=28",
    )
    (f,) = s["failures"]
    assert f["strategy"] == "partial" and f["restored_from_step"] == 20
    from recovery.durable.log import ShardLog

    actual = sum(len(r.ids) for r in ShardLog(tmp_path / "logs", 0).records(after_step=20, up_to_step=27))
    assert f["lost_updates"] == actual > 0
    assert 0 < s["pls"] < 1 and f["lost_samples"] > 0
    assert s["embedding_digest"] != baseline["embedding_digest"]  # CPR trades exactness for speed


def test_a_trainer_killed_mid_step_loses_nothing(tmp_path, baseline):
    s = train(tmp_path, "--max-restarts", "2", "--inject", "trainer:1@step=22")
    (f,) = s["failures"]
    assert (f["kind"], f["target"], f["step"]) == ("trainer", 1, 22)
    assert f["lost_updates"] == 0 and f["replayed_steps"] >= 1
    assert s["embedding_digest"] == baseline["embedding_digest"]
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 5 and steps[-1] == 40  # the restarted group continued the run's metrics


def test_a_stalled_shard_is_detected_within_the_timeout_and_recovered(tmp_path, baseline):
    t0 = time.monotonic()
    s = train(
        tmp_path, "--recovery", "log", "--checkpoint-every", "10", "--timeout", "1", "--inject", "stall:2@step=15:90"
    )
    (f,) = s["failures"]
    # not before the 1 s timeout, and long before the 90 s stall ended (how soon after the timeout:
    # scripts/bench_fault_timing.py; a bound here would be one a loaded machine can break)
    assert f["kind"] == "stall" and 0.9 <= f["detected_after_s"] < 30
    assert 0.9 <= f["failed_call_s"] <= f["detected_after_s"]  # the call waited out the timeout: lost time
    assert s["steps_completed"] == 40 and s["embedding_digest"] == baseline["embedding_digest"]
    assert time.monotonic() - t0 < 90  # did not wait for the stall to end (90 s: a loaded machine takes 30)


def test_a_corrupted_checkpoint_is_never_loaded(tmp_path, baseline):
    s = train(
        tmp_path,
        *LOG,
        "--keep-checkpoints",
        "3",
        "--inject",
        "corrupt-checkpoint:latest",
        "--inject",
        "shard:1@step=25",
    )
    (f,) = s["failures"]
    assert f["restored_from_step"] == 10  # step 20's shard file was corrupt: fell back
    assert "step 20" in f["corrupt_checkpoints"][0] and "shard1.rdb" in f["corrupt_checkpoints"][0]
    # the logs reach back to the oldest kept checkpoint, so the fallback still replays exactly
    assert f["lost_updates"] == 0 and s["embedding_digest"] == baseline["embedding_digest"]


@pytest.mark.parametrize(
    ("phase", "flags"),
    [
        ("checkpoint", ["--inject", "shard:1@during=checkpoint"]),
        ("eval", ["--eval-every", "10", "--inject", "shard:2@during=eval"]),
        ("resume", ["--max-restarts", "2", "--inject", "trainer:1@step=22", "--inject", "shard:0@during=resume"]),
        ("recovery", ["--inject", "shard:1@step=25", "--inject", "shard:2@during=recovery"]),
    ],
)
def test_a_shard_dying_during_a_phase_is_recovered_there_and_loses_nothing(tmp_path, baseline, phase, flags):
    s = train(tmp_path, "--recovery", "log", "--checkpoint-every", "10", *flags)
    shard_records = [f for f in s["failures"] if f["strategy"] == "log"]
    target = int(flags[-1].split(":")[1].split("@")[0])
    assert any(f["target"] == target for f in shard_records), s["failures"]
    if phase == "recovery":  # shard 2 died while shard 1 was restored; recovered where a call first met it:
        # the retried phase, or the next step's first read (the rows kept of other trainers' shards were
        # forgotten with the restore and are read again)
        assert {f["target"] for f in shard_records} == {1, 2}
        steps = [f["step"] for f in shard_records]
        assert steps[0] == 25 and steps[1] in (25, 26), steps
    else:
        (f,) = [f for f in shard_records if f["target"] == target]
        assert f["phase"] == phase
    assert s["injections_not_fired"] == []
    assert s["embedding_digest"] == baseline["embedding_digest"]
    if phase == "eval":  # the evaluation was retried on the recovered shard, not skipped
        evals = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in evals if "auc" in r] == [10, 20, 30, 40]
    if phase == "checkpoint":  # the checkpoint of that step was taken after the recovery, not dropped
        assert [c["step"] for c in s["checkpoints"] if not c.get("abandoned")] == [0, 10, 20, 30, 40]


def test_repeated_partial_failures_of_one_shard_count_each_loss_once(tmp_path):
    """Shard 1 fails at step 25, then again at step 32, within one checkpoint interval: the second
    loss is what was trained since the first failure, in updates and in samples alike."""
    logs = tmp_path / "logs"
    s = train(
        tmp_path,
        "--recovery",
        "partial",
        "--checkpoint-every",
        "20",
        "--log-dir",
        str(logs),
        "--inject",
        "shard:1@step=25",
        "--inject",
        "shard:1@step=32",
    )
    first, second = s["failures"]
    assert (first["step"], second["step"]) == (25, 32) and first["restored_from_step"] == 20 == second[
        "restored_from_step"
    ]

    def rows(shard: int, after: int, upto: int) -> int:
        return logged_rows(logs, shard, after, upto)

    assert first["lost_updates"] == rows(1, 20, 24) > 0
    assert second["lost_updates"] == rows(1, 24, 31) > 0  # not steps 21-24 again
    everything = sum(rows(s, 24, 31) for s in range(3))
    assert second["lost_samples"] == pytest.approx(7 * 256 * second["lost_updates"] / everything, abs=1e-3)
    everything = sum(rows(s, 20, 24) for s in range(3))
    assert first["lost_samples"] == pytest.approx(4 * 256 * first["lost_updates"] / everything, abs=1e-3)
    assert s["pls"] == pytest.approx((first["lost_samples"] + second["lost_samples"]) / (40 * 256), rel=1e-6)


def test_a_second_restore_to_an_older_base_counts_the_steps_between_the_bases(tmp_path):
    """Shard 0 fails at step 25 (restored as of 20: steps 21-24 lost); checkpoint 20's shard 0 file is
    corrupted at step 27, and the node of trainer 0 and shards 0 and 2 dies at step 28: shard 0 comes
    back as of checkpoint 10. Lost then: steps 11-20, which the first restore had kept, and those
    trained since it; 21-24 not twice. Both trainers restart with the node, so the intervals already
    counted come back from the run's state."""
    logs = tmp_path / "logs"
    s = train(
        tmp_path,
        "--recovery",
        "partial",
        "--checkpoint-every",
        "10",
        "--keep-checkpoints",
        "5",  # every checkpoint kept, so is every log segment (the expected counts)
        "--log-dir",
        str(logs),
        "--inject",
        "shard:0@step=25",
        "--inject",
        "corrupt-checkpoint:latest@step=27",
        "--inject",
        "node:0@step=28",
    )
    first, second = [f for f in s["failures"] if f["target"] == 0 and f.get("restored_from_step") is not None]
    assert (first["kind"], first["step"], first["restored_from_step"]) == ("shard", 25, 20)
    assert second["restored_from_step"] == 10 and "step 20" in second["corrupt_checkpoints"][0]

    def rows(shard: int, after: int, upto: int) -> int:
        return logged_rows(logs, shard, after, upto)

    end = second["step"] - 1
    assert first["lost_updates"] == rows(0, 20, 24) > 0
    assert second["lost_updates"] == rows(0, 10, 20) + rows(0, 24, end) > rows(0, 24, end) > 0
    everything = sum(rows(k, 10, 20) + rows(k, 24, end) for k in range(3))
    steps = 10 + end - 24
    assert second["lost_samples"] == pytest.approx(steps * 256 * second["lost_updates"] / everything, abs=1e-3)


def test_incremental_recovery_restores_to_the_last_flush_and_loses_only_what_came_after(tmp_path):
    # 2 trainers: each flushes the shards it writes; logs are written (not replayed) to count
    s = train(
        tmp_path,
        "--steps",
        "35",
        "--recovery",
        "incremental",
        "--checkpoint-every",
        "20",
        "--flush-every",
        "5",
        "--log-dir",
        str(tmp_path / "logs"),
        "--inject",
        "shard:1@step=28",
    )
    (f,) = s["failures"]
    assert f["strategy"] == "incremental" and f["restored_from_step"] == 20 and f["flushed_to_step"] == 25
    from recovery.durable.log import ShardLog

    # lost: shard 1's updates of steps 26-27 only (the flush holds those of 21-25)
    actual = sum(len(r.ids) for r in ShardLog(tmp_path / "logs", 1).records(after_step=25, up_to_step=27))
    assert f["lost_updates"] == actual > 0
    assert s["flushes"] == 6 and s["flush_bytes"] > 0  # steps 5, 10, 15, 25, 30, 35 (20 is a checkpoint)
    # a flush writes each dirty row once: fewer bytes than the log of the same steps
    assert s["flush_bytes"] < s["log_bytes"]


def test_priority_saves_pause_only_for_the_copy(tmp_path):
    s = train(
        tmp_path,
        "--recovery",
        "partial-mfu",
        "--checkpoint-every",
        "20",
        "--priority-every",
        "4",
        "--priority-budget",
        "500",
        "--inject",
        "shard:0@step=27",
    )
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saves = [r for r in records if "priority_pause_s" in r]
    assert len(saves) == s["priority_saves"] >= 8 and all(r["priority_rows"] > 0 for r in saves)
    # a save of held rows copies them: it reads nothing from Redis (no barrier, no file I/O). The
    # restore makes the writers forget what they held on shard 0 and read it back at once: the saves
    # after it read nothing from Redis either. How long the copy pauses a step is a figure of
    # scripts/bench_fault_timing.py (under a quarter of a mean step there), not a bound here
    held = [r for r in saves if r["step"] < 27]
    assert len(held) == 5 and all(r["priority_rows_from_redis"] == 0 for r in held)  # 4, 8, 12, 16, 24
    assert all(r["priority_pause_s"] >= 0 for r in held), saves
    after = [r for r in saves if r["step"] > 27]
    assert len(after) == 3 and all(r["priority_rows_from_redis"] == 0 for r in after)  # 28, 32, 36
    assert s["held_reload_s"] > 0
    (f,) = s["failures"]
    assert f["saved_updates"] > 0 and s["priority_bytes"] > 0


@pytest.fixture(scope="module")
def baseline_adam(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("base-adam"), "--optimizer", "adam")


@pytest.mark.parametrize(
    "flags",
    [
        ("--recovery", "log", "--checkpoint-every", "10", "--inject", "shard:1@step=25"),
        ("--max-restarts", "2", "--inject", "trainer:1@step=22"),
    ],
    ids=["log", "trainer-kill"],
)
def test_adam_rows_and_dense_layers_end_bit_for_bit(tmp_path, baseline_adam, flags):
    """``--optimizer adam``: lazy Adam on the rows (two moments a weight in the row), Adam on the
    dense layers. Its bias correction counts steps: the checkpoint of step 0, taken before any step,
    must not count one (torch's ``get_state_dict`` makes the state by a step at lr 0)."""
    s = train(tmp_path, "--optimizer", "adam", *flags)
    (f,) = s["failures"]
    assert f["lost_updates"] == 0 and s["embedding_digest"] == baseline_adam["embedding_digest"] is not None


ONE = [("1" if i and BASE[i - 1] == "--trainers" else x) for i, x in enumerate(BASE)]  # one trainer
ONE += ["--write-every", "1"]  # each step's rows written behind the next (a window's tests add theirs)


@pytest.fixture(scope="module")
def baseline_one(tmp_path_factory) -> dict:
    return train_cli(tmp_path_factory.mktemp("base1"), *ONE)


@pytest.mark.parametrize(
    "flags",
    [
        ("--no-write-behind",),
        ("--recovery", "log", "--checkpoint-every", "10", "--inject", "shard:1@step=25"),
        ("--recovery", "full", "--checkpoint-every", "10", "--inject", "shard:2@step=27"),
        ("--max-restarts", "2", "--inject", "trainer:0@step=22"),
        # a 1 MB row cache holds a quarter of the rows and no prefetch reads the next batch ahead:
        # each stage reads the rest from the shards, behind the write in flight, and sees the kill
        # there; the killed shard's log already holds that write
        (
            "--held-rows-mb",
            "1",
            "--no-prefetch",
            "--recovery",
            "log",
            "--checkpoint-every",
            "10",
            "--inject",
            "shard:1@step=25",
        ),
    ],
    ids=["write-through", "log", "full", "trainer-kill", "log-seen-in-stage"],
)
def test_one_trainer_writes_behind_and_its_failures_end_bit_for_bit(tmp_path, baseline_one, flags):
    """One trainer writes each step's rows while the next step computes. A shard killed while a
    write is in flight is failed at that write's commit point and the write redone after the
    restore; a trainer killed right after handing a write over resumes from a dense state whose rows
    reached the shards. Either way the run ends where a run without failures ends."""
    s = train_cli(tmp_path, *ONE, *flags)
    assert s["trainers"] == 1 and s["torch_threads"] >= 1
    assert s["embedding_digest"] == baseline_one["embedding_digest"]
    if "--inject" in flags:
        (f,) = s["failures"]
        assert f["lost_updates"] == 0
        if f["kind"] == "shard":
            injected = int(flags[-1].split("@step=")[1])
            # seen at the commit point of the write it broke (that write's step or the one before), or
            # by the next stage's read, which waits for that write
            assert f["phase"] == ("stage" if "--held-rows-mb" in flags else "update") and f["step"] == injected
            assert f.get("write_step", injected) in (injected - 1, injected)


WINDOW = ("--write-every", "6")


@pytest.mark.parametrize(
    "flags",
    [
        (),
        ("--recovery", "log", "--checkpoint-every", "10", "--inject", "shard:1@step=15"),
        ("--recovery", "full", "--checkpoint-every", "10", "--inject", "shard:2@step=27"),
        ("--max-restarts", "2", "--inject", "trainer:0@step=22"),
        # the replica has every window written before the failed one, which is redone: nothing lost
        ("--recovery", "replica", "--replicas", "local", "--replica-wait", "--inject", "shard:0@step=15"),
    ],
    ids=["no-failure", "log", "full", "trainer-kill", "replica"],
)
def test_write_behind_windows_end_bit_for_bit(tmp_path, baseline_one, flags):
    """With ``--write-every 6`` a row reaches its shard once per window of 6 steps (a checkpoint
    closes one early). The shards end with exactly the rows of a run that writes every step, with
    fewer rows written; a shard killed inside a window is seen when the window is written and the
    window's steps are redone on the restored shard; a trainer killed inside a window resumes from
    the dense state of a window whose rows reached the shards."""
    s = train_cli(tmp_path, *ONE, *WINDOW, *flags)
    assert s["write_every"] == 6
    assert s["embedding_digest"] == baseline_one["embedding_digest"]
    assert 0 < s["rows_written"] < baseline_one["rows_written"]
    if "--inject" not in flags:
        # 40 steps: windows end at 1 (a restart point from the first step on), 6, 12, ..., 36 and
        # 40 (the end); a dense save at each
        assert s["dense_saves"] == 8 and s["failures"] == []
        return
    (f,) = s["failures"]
    assert f["lost_updates"] == 0
    injected = int(flags[-1].split("@step=")[1])
    if f["kind"] == "shard":
        # seen at the commit point of the window it broke: the window's end, or a checkpoint's
        assert f["phase"] == "update" and injected <= f["step"] < injected + 6 + 1, f
    else:
        # resumed from the last window written before the one in flight: at most two windows again
        assert 0 < f["replayed_steps"] <= 2 * 6, f


def test_the_terminal_shows_each_failure_its_cost_and_the_runs_losses(tmp_path):
    """What a user sees: the bar's last known loss (never nan: a priority save's record has no loss),
    one line per failure as it is handled (shard, step, strategy, seconds, updates lost), the closing
    lines with the failures and PLS beside AUC, and a finished folder without recovery notes."""
    import re

    from tests import procs

    flags = [*BASE, "--inject", "shard:1@step=25", "--checkpoint-every", "10", "--recovery", "partial-mfu"]
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(tmp_path)], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((tmp_path / "summary.json").read_text())
    (f,) = s["failures"]
    err = proc.stderr.replace("\r", "\n")
    lines = [x for x in err.splitlines() if x.startswith("failure:")]
    want = rf"failure: shard 1 at step 25: partial-mfu from step 20, [0-9.]+ s, {f['lost_updates']:,} updates lost"
    assert len(lines) == 1 and re.match(want, lines[0]), lines
    assert f["lost_updates"] > 0 and "loss nan" not in err and ", loss 0." in err  # progress lines (no terminal)
    closing = proc.stdout.strip().splitlines()[-1]
    assert closing == (
        f"failures: 1 (1 shard), {f['lost_updates']:,} updates lost, PLS {s['pls']:.6f} ({100 * s['pls']:.4f}% of samples)"
    )
    assert "final AUC" in proc.stdout and not (tmp_path / "recovery_in_progress.json").exists()
