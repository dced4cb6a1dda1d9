"""Damaged files and stale servers never end in exit 0 with a wrong digest: each case ends bit-identical
to the run without damage, with the loss counted exactly, or in one line naming the cause.

Real processes and files: the CLI, its trainers and redis-servers; logs, checkpoints and the per-step
dense state damaged on disk between a crash and ``--resume``. A crashed run is made once per strategy
(a node failure twice with ``--max-restarts 1``: the second ends the run) and copied for each case; its
local shards come back empty on resume, so every shard is rebuilt from what is on disk."""

import io
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from embeddings import LocalShards
from recovery.durable.log import ShardLog
from recovery.durable.log_format import encode_group, entries
from tests import procs
from tests.conftest import track, train_cli
from tests.test_errors import one_error_line

ROOT = Path(__file__).resolve().parents[1]
ONE = ["--steps", "40", "--trainers", "1", "--shards", "2", "--rows-per-table", "2000", "--batch-size", "256"]
ONE += ["--embedding-dim", "8", "--eval-every", "0", "--eval-samples", "2048", "--log-every", "5"]
ONE += ["--write-every", "1"]  # each step's rows on their shards: the damage meets a known step
CRASH = ["--checkpoint-every", "10", "--keep-checkpoints", "3", "--max-restarts", "1"]
CRASH += ["--inject", "node:0@step=24", "--inject", "node:0@step=36"]


def run(out: Path, *flags: str) -> subprocess.CompletedProcess:
    return procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=300)


def resume(out: Path) -> subprocess.CompletedProcess:
    return run(out, "--resume", str(out))


def crashed(out: Path, *flags: str) -> Path:
    proc = run(out, *ONE, *CRASH, *flags)
    assert proc.returncode == 1 and "all used" in proc.stderr, proc.stderr[-3000:]
    return out


def dense_step(out: Path) -> int:
    data = (out / "checkpoints" / "dense_latest.pt").read_bytes()
    return int(torch.load(io.BytesIO(data[16:]), weights_only=True)["step"])


def flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def segment(out: Path, shard: int, first: int) -> Path:
    return out / "logs" / f"shard{shard}" / f"seg_{first:010d}.log"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    return train_cli(tmp_path_factory.mktemp("base"), *ONE)


@pytest.fixture(scope="module")
def crashed_log(tmp_path_factory) -> Path:
    out = crashed(tmp_path_factory.mktemp("crash") / "run", "--recovery", "log")
    assert dense_step(out) > 30  # the resume must replay steps after the checkpoint of step 30
    return out


@pytest.fixture
def copy(tmp_path, crashed_log) -> Path:
    out = tmp_path / "run"
    shutil.copytree(crashed_log, out)
    return out


def test_the_crashed_run_resumes_bit_for_bit(copy, baseline):
    s = train_cli(copy, "--resume", str(copy))
    assert s["embedding_digest"] == baseline["embedding_digest"] and s["pls"] == 0.0


def verify(run: Path) -> tuple[int, list[str]]:
    proc = procs.run(["-m", "recsys", "verify", str(run)], timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, (proc.stderr + proc.stdout).strip().splitlines()


def test_a_moved_run_resumes_into_its_new_folder_and_every_copy_verifies_its_own_files(tmp_path, crashed_log, baseline):
    """A run folder is self-contained: moved, it resumes into itself (nothing at the old path) and
    verifies; a copy with a damaged log fails on its own segment while the original passes; a damaged
    or missing oldest checkpoint is named, and fails the check."""
    first = tmp_path / "a" / "run"
    shutil.copytree(crashed_log, first)
    moved = tmp_path / "b" / "moved"
    moved.parent.mkdir()
    shutil.move(first, moved)
    s = train_cli(moved, "--resume", str(moved))
    assert s["embedding_digest"] == baseline["embedding_digest"] and s["pls"] == 0.0
    assert not first.exists() and not (crashed_log / "summary.json").exists()
    code, lines = verify(moved)
    assert code == 0 and len(lines) == 1 and "equal the run's final rows" in lines[0], lines
    assert str(moved) in lines[0] and "logged step(s)" in lines[0], lines

    damaged = tmp_path / "bad-log"
    shutil.copytree(moved, damaged)
    seg = ShardLog(damaged / "logs", 1).segments()[0]
    flip(seg)
    code, lines = verify(damaged)
    assert code == 1 and str(seg) in lines[-1] and "fails its CRC" in lines[-1], lines
    assert verify(moved)[0] == 0  # the original: its own files, intact

    oldest = sorted((moved / "checkpoints").glob("step_*"))[0]
    for what in ("damaged", "missing"):
        dup = tmp_path / f"{what}-base"
        shutil.copytree(moved, dup)
        base = dup / "checkpoints" / oldest.name
        if what == "damaged":
            flip(base / "shard1.rdb")
        else:
            shutil.rmtree(base)
        code, lines = verify(dup)
        skipped = [x for x in lines if x.startswith("verify: skipped")]
        assert code == 1 and len(skipped) == 1 and str(base) in skipped[0], lines
        assert ("shard1.rdb" in skipped[0]) if what == "damaged" else ("missing" in skipped[0]), lines
        assert "skipped (named above): not a full check" in lines[-1], lines


def test_a_torn_record_of_a_step_the_resume_does_not_need_is_harmless(copy, baseline):
    d = dense_step(copy)
    for shard in (0, 1):
        seg = ShardLog(copy / "logs", shard).segments()[-1]
        torn = encode_group(d + 1, [(0, np.arange(4), np.ones((4, 9), np.float32))])
        with open(seg, "ab") as f:
            f.write(torn[: len(torn) // 2])
    s = train_cli(copy, "--resume", str(copy))
    assert s["embedding_digest"] == baseline["embedding_digest"]


def test_a_log_cut_inside_a_needed_step_stops_the_resume_naming_file_and_step(copy):
    d = dense_step(copy)
    seg = segment(copy, 1, 31)
    out, _, _ = entries(seg)
    at = [e.offset for e in out if e.record is not None and e.record.step == d]
    seg.write_bytes(seg.read_bytes()[: at[1] + 20])  # one whole record of step d, then a torn one
    line = one_error_line(resume(copy))
    assert f"log of shard 1: step {d} cannot be rebuilt" in line and seg.name in line, line
    assert not (copy / "summary.json").exists()


def test_a_missing_middle_segment_stops_the_resume(copy):
    """The newest checkpoint is corrupt: the restore falls back to step 20 and its replay needs the
    segment of steps 21..30, which is gone."""
    for shard in (0, 1):
        flip(copy / "checkpoints" / f"step_{30:010d}" / f"shard{shard}.rdb")
    segment(copy, 0, 21).unlink()
    line = one_error_line(resume(copy))
    assert "log of shard 0: step 21 cannot be rebuilt" in line and "a segment is missing" in line, line
    assert "seg_0000000011.log" in line and "seg_0000000031.log" in line


def test_every_checkpoint_corrupt_under_log_is_no_rebuild_from_empty(copy):
    """No verified checkpoint: a shard could only be rebuilt from an empty one by a log chain from
    step 1, and the segments before the oldest checkpoint were removed."""
    for ckpt in (copy / "checkpoints").glob("step_*"):
        for f in ckpt.glob("shard*.rdb"):
            if f.stat().st_size:  # empty: a copy the node failure cut short (no manifest: no checkpoint)
                flip(f)
    line = one_error_line(resume(copy))
    assert "step 1 cannot be rebuilt" in line and "no segment holds it" in line, line


def test_a_corrupt_dense_latest_falls_back_to_the_newest_verified_checkpoint(copy, baseline):
    flip(copy / "checkpoints" / "dense_latest.pt")
    proc = resume(copy)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "dense_latest.pt fails its checksum" in proc.stderr and "checkpoint of step 30" in proc.stderr
    s = json.loads((copy / "summary.json").read_text())
    assert s["embedding_digest"] == baseline["embedding_digest"] and s["pls"] == 0.0


def test_a_byte_flipped_in_a_live_log_then_a_shard_kill_ends_in_one_line(tmp_path):
    flags = ["--recovery", "log", "--checkpoint-every", "20", "--max-restarts", "0"]
    flags += ["--inject", "corrupt-log:1@step=30", "--inject", "shard:1@step=35"]
    line = one_error_line(run(tmp_path / "run", *ONE, *flags))
    assert "log of shard 1: step" in line and "cannot be rebuilt" in line and "seg_0000000021.log" in line, line
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_corrupt_dense_checkpoint_under_full_falls_back_to_the_older_one(tmp_path, baseline):
    out = crashed(tmp_path / "run", "--recovery", "full")
    for f in (out / "checkpoints" / f"step_{30:010d}" / "dense").iterdir():
        if f.stat().st_size > 64:
            flip(f)
    s = train_cli(out, "--resume", str(out))
    assert s["embedding_digest"] == baseline["embedding_digest"]
    f = [f for f in s["failures"] if f["strategy"] == "full"][-1]  # the resume's (the node failures had theirs)
    assert f["restored_from_step"] == 20 and "step 30" in " ".join(f["corrupt_checkpoints"]), f


def test_a_stale_shard_under_partial_is_restored_and_its_loss_counted_exactly(tmp_path):
    """A server restarted from an old dump (its marker at step 10, the dense state past 30) is behind:
    the resume restores it from the newest checkpoint and counts the updates since, exactly (the log
    kept beside the run counts them)."""
    with LocalShards(2) as sh:
        track(sh)
        out = tmp_path / "run"
        flags = ["--redis", ",".join(sh.urls), "--recovery", "partial", "--log-dir", str(tmp_path / "logs")]
        flags += ["--checkpoint-every", "10", "--keep-checkpoints", "3", "--max-restarts", "1"]
        flags += ["--inject", "trainer:0@step=24", "--inject", "trainer:0@step=36"]
        proc = run(out, *ONE, *flags)
        assert proc.returncode == 1 and "all used" in proc.stderr, proc.stderr[-3000:]
        d = dense_step(out)
        sh.kill(1)
        shutil.copy(out / "checkpoints" / f"step_{10:010d}" / "shard1.rdb", sh.spec(1).rdb_path)
        sh.restart(1)
        track(sh)
        s = train_cli(out, "--resume", str(out))
    (f,) = [f for f in s["failures"] if f["strategy"] == "partial"]
    assert f["target"] == 1 and f["restored_from_step"] == 30, f
    logged = sum(len(r.ids) for r in ShardLog(tmp_path / "logs", 1).records(after_step=30, up_to_step=d))
    assert f["lost_updates"] == logged > 0, (f, logged)
    assert s["pls"] > 0


def test_a_corrupt_flush_ends_the_replay_at_the_last_good_one_and_a_corrupt_priority_save_is_skipped(
    tmp_path, shards3, namespace
):
    """Flushes hold only the rows dirtied since the one before: a flush that fails its CRC ends the
    replay there (the shard is as of the last good one, so the loss is counted from it); a priority
    save that fails its CRC is not overlaid. Real Redis, real files."""
    from embeddings import SGD, RedisStore, TableSet, TableSpec
    from recovery.durable import rowfiles
    from recovery.saves import incremental, priority

    tables = TableSet([TableSpec("t0", 200, 4)])
    with RedisStore(shards3.urls, tables, SGD(0.1), namespace=namespace) as st:
        ids = np.arange(200)
        ids = ids[st.shard_map.shard_of(0, ids) == 1][:10]
        folder = tmp_path / "flush" / "shard1"
        folder.mkdir(parents=True)
        for step, value in ((5, 1.0), (10, 2.0), (15, 3.0)):
            rows = np.full((len(ids), 4), value, np.float32)
            (folder / f"flush_{step:010d}.bin").write_bytes(rowfiles.encode(step, 7, [(0, ids, rows)], [4]))
        flip(folder / f"flush_{10:010d}.bin")
        seen = []
        _, as_of = incremental.replay(tmp_path / "flush", st, 1, 0, 20, on_corrupt=seen.append)
        assert as_of == 5 and len(seen) == 1 and "flush_0000000010.bin" in str(seen[0])
        assert np.all(st.read_rows("t0", ids) == 1.0)  # the flush of step 15 is not applied over a gap

        save = tmp_path / "priority" / "shard1.bin"
        save.parent.mkdir()
        save.write_bytes(rowfiles.encode(12, 9, [(0, ids, np.full((len(ids), 4), 5.0, np.float32))], [4]))
        flip(save)
        seen.clear()
        assert priority.overlay(tmp_path / "priority", st, 1, 10, 20, on_corrupt=seen.append) == (0, 0, 10)
        assert len(seen) == 1 and "CRC32C mismatch" in str(seen[0])
        assert np.all(st.read_rows("t0", ids) == 1.0)


def test_a_damaged_dense_state_under_replica_restores_every_shard_from_the_checkpoint(tmp_path, baseline):
    """The replicas hold every write up to the trainer's death, ahead of the checkpoint a damaged
    per-step dense state falls back to: promoting them would apply those steps twice. Every shard is
    restored from that checkpoint instead, and the run ends where a run without failures ends."""
    flags = ["--recovery", "replica", "--replicas", "local", "--checkpoint-every", "10", "--max-restarts", "1"]
    flags += ["--no-write-behind", "--inject", "corrupt-dense@step=25", "--inject", "trainer:0@step=25"]
    out = tmp_path / "run"
    proc = run(out, *ONE, *flags)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["embedding_digest"] == baseline["embedding_digest"]
    (f,) = [f for f in s["failures"] if f["kind"] == "dense-state"]
    # the newest checkpoint whose files all verify (the one of step 20 may still have been written
    # in the background when the trainer died)
    assert f["restored_from_step"] in (10, 20) and f["failed_shards"] == [0, 1], f
    assert "dense_latest.pt fails its checksum" in proc.stderr
    assert f"checkpoint of step {f['restored_from_step']}" in proc.stderr


def test_incremental_without_a_whole_checkpoint_counts_every_update_since_step_zero(tmp_path):
    """Every checkpoint corrupt: the flushes before the oldest one kept are gone, so laying the later
    ones on an empty shard would leave rows dirtied only in those as fresh values. The shard restarts
    empty and every update to it since step 0 is counted lost (a log kept since step 1 counts them)."""
    full_log = tmp_path / "full-log"
    counted = run(
        tmp_path / "count", *ONE, "--checkpoint-every", "0", "--log-dir", str(full_log), "--max-restarts", "1"
    )
    assert counted.returncode == 0, counted.stderr[-3000:]
    out = tmp_path / "run"  # trainer deaths (the shards live on until the launcher ends): no shard failed before
    flags = [*ONE, "--recovery", "incremental", "--flush-every", "5", *CRASH[:6]]
    proc = run(out, *flags, "--inject", "trainer:0@step=24", "--inject", "trainer:0@step=36")
    assert proc.returncode == 1 and "all used" in proc.stderr, proc.stderr[-3000:]
    d = dense_step(out)
    for f in (out / "checkpoints").glob("step_*/shard*.rdb"):
        if f.stat().st_size:  # empty: a copy the trainer's death cut short (no manifest: no checkpoint)
            flip(f)
    s = train_cli(out, "--resume", str(out))
    recs = [f for f in s["failures"] if f["strategy"] == "incremental"]
    assert sorted(f["target"] for f in recs) == [0, 1], s["failures"]
    for f in recs:
        assert f["phase"] == "resume" and f["flushed_to_step"] is None, f
        logged = sum(len(r.ids) for r in ShardLog(full_log, f["target"]).records(after_step=0, up_to_step=d))
        assert f["lost_updates"] == logged > 0, (f, logged)
