"""Several trainers writing rows in windows (the default where every trainer keeps every row): real
trainer processes, real redis-servers, real kills. The windows change when a failure is met (at the
window's close) and how far a trainer's death takes the group back (the last window every shard
took), never the bits: each run ends on the digest of the run without the failure."""

from pathlib import Path

import pytest

from recsys.config import AUTO_WINDOW
from recsys.results.verify import verify
from tests.conftest import train_cli

BASE = ["--steps", "40", "--trainers", "2", "--shards", "3", "--rows-per-table", "2000", "--batch-size", "256"]
BASE += ["--embedding-dim", "8", "--eval-every", "0", "--eval-samples", "2048", "--log-every", "5"]


def train(out: Path, *flags: str) -> dict:
    return train_cli(out, *BASE, *flags)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("base") / "run")


def test_two_trainers_write_in_windows_on_the_bits_of_one_trainer_and_of_every_step(tmp_path, baseline):
    assert baseline["write_every"] == AUTO_WINDOW
    peers = baseline["peer_rows"]
    assert peers["capacity_rows"] >= peers["table_rows"] and peers["evicted"] == 0
    every_step = train(tmp_path / "k1", "--write-every", "1")
    one = train(tmp_path / "one", "--trainers", "1", "--chunks", "2")
    assert every_step["write_every"] == 1 and one["write_every"] == AUTO_WINDOW
    assert baseline["embedding_digest"] == every_step["embedding_digest"] == one["embedding_digest"]


def test_a_row_cache_short_of_every_row_writes_every_step_on_the_same_bits(tmp_path, baseline):
    # 3 x 26 x 2000 rows of 8 floats and their Adagrad state: 0.5 MB does not hold them all
    s = train(tmp_path / "run", "--held-rows-mb", "0.5")
    assert s["write_every"] == 1
    for cache in ("row_cache", "peer_rows"):
        assert s[cache]["bytes"] <= 0.5 * (1 << 20) and s[cache]["capacity_rows"] < s[cache]["table_rows"]
    assert s["embedding_digest"] == baseline["embedding_digest"]


def test_a_shard_killed_inside_a_window_is_recovered_from_its_log_at_the_close_bit_for_bit(tmp_path, baseline):
    out = tmp_path / "run"
    s = train(out, "--recovery", "log", "--checkpoint-every", "20", "--inject", "shard:1@step=25")
    (f,) = s["failures"]
    # nothing reads shard 1 until trainer 1's window closes at step 32: the failure is met there
    assert (f["kind"], f["target"], f["step"], f["strategy"]) == ("shard", 1, 32, "log")
    assert f["restored_from_step"] == 20 and f["lost_updates"] == 0
    assert s["embedding_digest"] == baseline["embedding_digest"]
    code, line = verify(out)
    assert code == 0, line


def test_a_shard_killed_before_a_save_is_met_when_the_save_closes_the_window_bit_for_bit(tmp_path, baseline):
    # the checkpoint at step 30 writes every open window first; the restore there empties every
    # trainer's peer rows, read back before the next step (no window open then)
    s = train(tmp_path / "run", "--recovery", "log", "--checkpoint-every", "10", "--inject", "shard:0@step=25")
    (f,) = s["failures"]
    assert (f["target"], f["step"], f["phase"]) == (0, 30, "update")
    assert s["embedding_digest"] == baseline["embedding_digest"]


@pytest.mark.parametrize("mode", ["replace", "restart"])
def test_a_trainer_killed_inside_a_window_takes_the_group_back_to_a_window_every_shard_took(tmp_path, baseline, mode):
    out = tmp_path / "run"
    flags = ("--trainer-recovery", mode, "--max-restarts", "2", "--write-every", "16")
    s = train(out, *flags, "--inject", "trainer:1@step=22")
    (f,) = s["failures"]
    assert (f["kind"], f["target"], f["step"]) == ("trainer", 1, 22)
    # the dense state of a window's end is the restart point once the next window's close saw every
    # shard take it: step 1's at step 16, so the group goes back to step 1 and every shard with it
    assert f["lost_updates"] == 0 and f["replayed_steps"] >= 6
    log = (out / "recovery.log").read_text()
    assert "resume at step 1: shard 1 at step 16, rolled back" in log, log
    assert s["embedding_digest"] == baseline["embedding_digest"]


@pytest.mark.parametrize("mode", ["replace", "restart"])
def test_a_death_before_the_first_restart_point_starts_the_run_again_recorded_once_bit_for_bit(
    tmp_path, baseline, mode
):
    # windows of 32 (the default): step 1's dense state becomes the restart point at step 32's close,
    # so a death at step 22 takes the group back to the start; the injection does not fire again in
    # the run started anew, and the death stays on record (journal_run.json names the run: the same run again)
    out = tmp_path / "run"
    s = train(out, "--trainer-recovery", mode, "--max-restarts", "1", "--inject", "trainer:1@step=22")
    assert s["write_every"] == AUTO_WINDOW == 32 and s["injections_not_fired"] == []
    (f,) = s["failures"]
    assert (f["kind"], f["target"], f["step"], f["strategy"]) == ("trainer", 1, 22, mode)
    assert f["lost_updates"] == 0 and f["replayed_steps"] == 22
    assert s["embedding_digest"] == baseline["embedding_digest"]
    code, line = verify(out)
    assert code == 0, line


def test_three_trainers_on_two_shards_survive_a_death_and_the_quorums_after_it_bit_for_bit(tmp_path):
    # trainer 2 writes no shard; the survivors may form a quorum without the slowest to notice, then
    # another with it: every new quorum goes back to the dense state (windows open elsewhere were let go)
    # the rows scattered to their owners (the quorum's all-to-all; 2 owners after the death, then 3)
    three = ["--trainers", "3", "--shards", "2", "--batch-size", "255", "--row-exchange", "scatter"]
    ref = train(tmp_path / "ref", *three)
    s = train(tmp_path / "run", *three, "--max-restarts", "2", "--write-every", "16", "--inject", "trainer:2@step=22")
    assert ref["write_every"] == AUTO_WINDOW and s["write_every"] == 16
    assert [f["kind"] for f in s["failures"]] == ["trainer"] and s["failures"][0]["lost_updates"] == 0
    assert s["embedding_digest"] == ref["embedding_digest"]
    code, line = verify(tmp_path / "run")
    assert code == 0, line


def test_partial_recovery_counts_only_the_windows_it_cannot_redo(tmp_path, baseline):
    # killed inside the window after checkpoint 20: that window is redone on the restored shard, nothing lost
    inside = train(
        tmp_path / "inside", "--recovery", "partial", "--checkpoint-every", "20", "--inject", "shard:1@step=25"
    )
    (f,) = inside["failures"]
    assert (f["step"], f["restored_from_step"], f["lost_updates"]) == (32, 20, 0)
    assert inside["embedding_digest"] == baseline["embedding_digest"]
    # killed after the windows of steps 21-36 reached the shard (the evaluation at step 36 joins every
    # write before it, on a fast machine and a slow one): restored to 20, those steps are lost
    after = train(
        tmp_path / "after", "--recovery", "partial", "--checkpoint-every", "20", "--eval-every", "36",
        "--inject", "shard:1@step=38",
    )  # fmt: skip
    (f,) = after["failures"]
    assert f["restored_from_step"] == 20 and f["lost_updates"] > 0 and f["lost_samples"] > 0
    assert after["embedding_digest"] != baseline["embedding_digest"]
