"""A slow trainer, injected (``--inject slow-trainer:R:F@step=N``) and measured: each trainer's compute
a step in every log record (``trainer_compute_ms``), a trainer persistently slower than the others
named in one terminal line and in ``summary.json`` (``slow_trainers``), and the bits untouched (a
slowdown moves no value). Real trainers over gloo, real redis-servers."""

import json
import statistics

import pytest

from recovery.errors import InjectionSpecError
from recovery.inject import parse_injection
from tests import procs
from tests.conftest import train_cli

FLAGS = [
    "--steps", "36", "--batch-size", "192", "--shards", "2", "--rows-per-table", "1000", "--eval-every", "0",
    "--embedding-dim", "8", "--no-keep-model", "--log-every", "3", "--trainers", "2",
]  # fmt: skip


def run_cli(out, *flags: str) -> tuple[object, dict]:
    """``python -m recsys train`` with its stderr kept (the lines a test reads): -> (process, summary)."""
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc, json.loads((out / "summary.json").read_text())


def test_a_trainer_slowed_3x_is_named_measured_and_trains_the_same_bits(tmp_path):
    # 13 log records from the slowdown on: a record under 1.5x on a loaded host restarts the streak of
    # 5 that names a trainer (10 records held no such streak once, another test file running beside)
    flags = [*FLAGS, "--steps", "45"]
    healthy = train_cli(tmp_path / "healthy", *flags)
    out = tmp_path / "slow"
    proc, slow = run_cli(out, *flags, "--inject", "slow-trainer:1:3@step=7")
    assert slow["embedding_digest"] == healthy["embedding_digest"]
    assert healthy["slow_trainers"] == []
    (named,) = slow["slow_trainers"]
    assert named["trainer"] == 1 and named["compute_ms"] > 1.5 * named["others_ms"], named  # the naming rule
    assert proc.stderr.count("trainer 1 is slow:") == 1, proc.stderr[-2000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    speeds = {r["step"]: r["trainer_compute_ms"] for r in records if "trainer_compute_ms" in r}
    assert sorted(speeds) == list(range(3, 46, 3))
    # two processes' compute on 2 shared cores (beside another test file): one record may cross,
    # the median of a record's ratio may not
    ratio = {step: s["1"] / s["0"] for step, s in speeds.items()}
    assert statistics.median(r for step, r in ratio.items() if step >= 9) > 2, speeds  # from step 7 on
    assert min(ratio[3], ratio[6]) < 2, speeds  # before it
    fired = [json.loads(x) for x in (out / "injections.jsonl").read_text().splitlines() if "spec" in x]
    assert [f["spec"] for f in fired] == ["slow-trainer:1:3@step=7"] and fired[0]["step"] == 7


@pytest.mark.parametrize(
    "spec, message",
    [("slow-trainer:1:0.5", "the factor must be >= 1"), ("slow-trainer:1:2@step=0", "the step >= 1")],
)
def test_a_bad_slowdown_is_refused_in_one_line(spec, message):
    with pytest.raises(InjectionSpecError, match=message):
        parse_injection(spec)
    assert parse_injection("slow-trainer:2:1.5").step == 1


def test_chunks_follow_speed_and_the_bits_stay(tmp_path):
    """2 trainers, 6 chunks: trainer 1 slowed 3x from step 5 trains fewer chunks from the first plan
    on (step 10), the plan in one line, ``metrics.jsonl`` and ``summary.json``; the digest is the
    healthy run's."""
    flags = [*FLAGS, "--chunks", "6", "--balance-every", "10"]
    healthy = train_cli(tmp_path / "healthy", *flags)
    out = tmp_path / "slow"
    proc, slow = run_cli(out, *flags, "--inject", "slow-trainer:1:3@step=5")
    assert slow["embedding_digest"] == healthy["embedding_digest"]
    plans = slow["chunk_plans"]
    assert plans and plans[0]["step"] == 10, plans
    assert plans[-1]["chunks"][1] < plans[-1]["chunks"][0] and sum(plans[-1]["chunks"]) == 6, plans
    assert proc.stderr.count("chunks follow speed") == len(plans), proc.stderr[-2000:]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["chunks"] for r in records if "chunks" in r] == [p["chunks"] for p in plans]


def test_the_chunk_plan_gives_the_slow_fewer_and_moves_nothing_on_noise():
    from recsys.clock import plan_chunks
    from recsys.group import TrainerGroup

    assert plan_chunks([30.0, 60.0], [3, 3], 6) == [4, 2]  # 10 ms a chunk against 20
    assert plan_chunks([30.0, 36.0], [3, 3], 6) is None  # 1.2x: not worth a move
    assert plan_chunks([40.0, 20.0], [4, 2], 6) == [3, 3]  # the slow one healed: back to even
    assert plan_chunks([10.0, 10.0, 100.0], [2, 2, 2], 6) == [3, 2, 1]  # at least one each; ties: the lower rank
    assert plan_chunks([10.0, 20.0], [1, 1], 2) is None  # a chunk a trainer: nothing to move
    group = TrainerGroup(world_size=2, rank=1, num_chunks=6)
    assert group.balances and group.chunks == [1, 3, 5]
    group.assign([4, 2])
    assert group.chunks == [4, 5] and group.chunks_of(0) == [0, 1, 2, 3] and group.counts() == [4, 2]
    with pytest.raises(ValueError, match="summing to 6"):
        group.assign([4, 1])


def test_a_trainer_stopped_past_the_timeout_is_left_out_replaced_and_the_bits_stay(tmp_path):
    """Trainer 1 SIGSTOPs itself at step 20 for 6 s, past ``--trainer-timeout 3``: the other goes on
    at a new quorum; the launcher kills the stopped process before any shard moves (it never
    resumes to write with its old state), records a ``left-out`` failure and starts a replacement,
    which heals from the live peer. Digest equal to the run without the stop; ``verify`` exits 0."""
    flags = [*FLAGS[:-2], "--trainers", "2", "--steps", "60", "--recovery", "log", "--trainer-recovery", "replace"]
    healthy = train_cli(tmp_path / "healthy", *flags)
    out = tmp_path / "stopped"
    stop = ["--trainer-timeout", "3", "--inject", "stop-trainer:1@step=20:6"]
    proc, s = run_cli(out, *flags, *stop)
    assert s["embedding_digest"] == healthy["embedding_digest"]
    (rec,) = s["failures"]
    assert rec["kind"] == "left-out" and rec["target"] == 1 and rec["step"] == 20, rec
    assert rec["healed_from"] == "peer" and rec["dense_equal_at_rejoin"] is True, rec
    assert rec["detected_after_s"] >= 3, rec  # silent for --trainer-timeout before the quorum broke
    assert "left out: no answer within --trainer-timeout 3 s" in proc.stderr, proc.stderr[-2000:]
    fired = [json.loads(x) for x in (out / "injections.jsonl").read_text().splitlines() if "spec" in x]
    assert [f["spec"] for f in fired] == ["stop-trainer:1@step=20:6"]
    check = procs.run(["-m", "recsys", "verify", str(out)], timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
