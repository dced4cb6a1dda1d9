"""Processes and disks never fail silently. Real processes (the CLI, redis-servers), real files, a
real full disk (a small tmpfs; root only):

- every redis-server a run starts, the replacements its trainers start included, dies with the
  process that owns the shards, even when that process is SIGKILLed (``embeddings.servers.supervisor``);
- the shard folders of dead runs are removed at the next start, never one of a live run;
- an abandoned checkpoint is one warning line naming the file and the cause; N in a row stop the
  run with one line, its traceback in ``errors/*.log``; a full disk's error line names the file.
"""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from embeddings.servers.launcher import (
    FOLDER_PREFIX,
    OWNER_FILE,
    LocalShards,
    ShardSpec,
    find_redis_server,
    folder_servers,
    free_port,
    process_state,
    read_owner,
    record_owner,
    spawn_shard,
)
from recsys.errors import RESERVE, report_error, reserve_space
from tests import procs

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--rows-per-table", "500", "--batch-size", "64", "--embedding-dim", "8"]
SMALL += ["--eval-every", "0", "--eval-samples", "512", "--trainers", "1"]
SMALL += ["--write-every", "1"]  # each step's rows on their shards: a fault is met at its own step


def _shard_folder_of(pid: int, timeout_s: float = 60.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for d in Path(tempfile.gettempdir()).glob(FOLDER_PREFIX + "*"):
            owner = read_owner(d)
            if owner is not None and owner[0] == pid:
                return d
        time.sleep(0.1)
    raise AssertionError(f"no {FOLDER_PREFIX}* folder owned by pid {pid}")


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cleanup(proc: subprocess.Popen, folder: Path | None) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # its own group (start_new_session): trainers left over
    proc.wait(timeout=10)
    if folder is not None:
        for pid in folder_servers(folder):
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)


# -- servers die with the run -----------------------------------------------------------------
@pytest.mark.parametrize("restarts", ["3", "0"], ids=["trainer-process", "trainer-in-launcher"])
def test_a_sigkilled_launcher_leaves_no_server_replacements_included(tmp_path, restarts):
    out = tmp_path / "run"
    flags = [*SMALL, "--steps", "100000", "--log-every", "100000", "--recovery", "log", "--checkpoint-every", "4"]
    flags += ["--inject", "shard:0@step=3", "--max-restarts", restarts, "--out", str(out)]
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "recsys", "train", *flags],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,  # the test's own cleanup kills the group; the test kills the pid alone
        )
    folder = None
    try:
        folder = _shard_folder_of(proc.pid)
        deadline = time.monotonic() + 90
        while not (out / "failures.jsonl").exists() or not (out / "failures.jsonl").read_text().strip():
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the injected shard failure was never recovered"
            time.sleep(0.1)
        # a server's own fork (a snapshot for a checkpoint) runs in its folder too: not a server
        servers = [p for p in folder_servers(folder) if _ppid(p) not in folder_servers(folder)]
        replacement = int((folder / "shard0" / "redis.pid").read_text())
        assert replacement in servers and len(servers) == 3
        assert _ppid(replacement) != proc.pid  # a replacement: not the launcher's child, nor a trainer's
        os.kill(proc.pid, signal.SIGKILL)  # as the OOM killer would: no cleanup code runs
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while folder_servers(folder) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert folder_servers(folder) == [], [(p, process_state(p)) for p in folder_servers(folder)]
    finally:
        _cleanup(proc, folder)


def test_a_killed_trainer_leaves_the_replacement_to_the_run(tmp_path):
    """The replacement's parent is the shard supervisor: a trainer's death does not touch it."""
    with LocalShards(1) as sh:
        spec = sh.spec(0)
        script = (
            "import sys, time\n"
            "from embeddings.servers.launcher import ShardSpec, kill_and_wait, shard_servers, spawn_shard\n"
            f"spec = ShardSpec(**{spec.__dict__!r})\n"
            "for pid in shard_servers(spec): kill_and_wait(pid)\n"
            "print(spawn_shard(spec, die_with_parent=False).pid, flush=True)\n"
            "time.sleep(60)\n"
        )
        trainer = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            pid = int(trainer.stdout.readline())
            trainer.kill()
            trainer.wait(timeout=10)
            time.sleep(0.3)
            assert process_state(pid) not in (None, "Z") and pid in folder_servers(Path(spec.workdir).parent)
        finally:
            trainer.kill()
            trainer.wait()
    assert process_state(pid) in (None, "Z")  # the owner's stop ends it


# -- stale shard folders ------------------------------------------------------------------------
def test_stale_shard_folders_are_removed_at_start_and_live_ones_kept():
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    live = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
    unowned = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))  # being created by another run: too young to judge
    elsewhere = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))  # a run in another pid namespace (container)
    orphan = None
    try:
        (dead / "shard0").mkdir()
        spec = ShardSpec(index=0, port=free_port(), workdir=str(dead / "shard0"), binary=find_redis_server())
        orphan = spawn_shard(spec, die_with_parent=False)  # a server the dead run left behind
        # its owner gone only now: a test beside this one (the suite runs two at once) that starts
        # shards removes a dead run's folder too, and must not while its server starts
        (dead / OWNER_FILE).write_text(f"{gone.pid} 1\n")
        record_owner(live)
        (elsewhere / OWNER_FILE).write_text(f"{gone.pid} 1 pid:[1]\n")
        with LocalShards(1) as sh:
            assert sh.is_alive(0)
            assert not dead.exists() and process_state(orphan.pid) in (None, "Z")
            assert live.exists() and unowned.exists() and elsewhere.exists()
            assert read_owner(sh._root)[0] == os.getpid()
    finally:
        if orphan is not None:
            orphan.kill()
            orphan.wait()
        for d in (dead, live, unowned, elsewhere):
            shutil.rmtree(d, ignore_errors=True)


def test_a_server_refusing_the_network_snapshot_is_named_and_counts_as_a_repeating_cause(tmp_path):
    """An ACL without SYNC: the checkpoint of a shard given by URL is abandoned for that reason, not
    mistaken for a dead shard (which would never stop the run)."""
    import redis

    from embeddings.snapshots.rdb import NetworkSnapshot, SnapshotRefusedError
    from recovery.durable.manifest import abandon_cause

    with LocalShards(1) as sh:
        redis.Redis.from_url(sh.url(0)).execute_command(
            "ACL", "SETUSER", "nosync", "on", ">pw", "~*", "+@all", "-sync", "-psync"
        )
        pool = redis.ConnectionPool(host="127.0.0.1", port=sh.ports[0], username="nosync", password="pw")
        client = redis.Redis(connection_pool=pool)
        snap = NetworkSnapshot(pool, lambda: client.info("persistence"), tmp_path / "shard0.rdb", 0, "redis://x")
        with pytest.raises(SnapshotRefusedError) as e:
            snap.start()
            snap.finish()
        client.close()
    cause, repeats = abandon_cause(e.value, tmp_path)
    assert "refused the snapshot over the network (SYNC): NOPERM" in cause and repeats


# -- full disks ---------------------------------------------------------------------------------
@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _lines(stderr: str) -> list[str]:
    return [x for x in stderr.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("train:")]


def _train(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    return procs.run(["-m", "recsys", "train", *SMALL, "--out", str(tmp_path / "run"), *flags], timeout=120)


def test_abandoned_checkpoints_warn_with_the_file_and_three_in_a_row_stop_the_run(tmp_path):
    with tmpfs(tmp_path / "ckpt", "32k") as ckpt:
        proc = _train(
            tmp_path, "--steps", "40", "--checkpoint-every", "2", "--checkpoint-dir", str(ckpt), "--max-restarts", "0"
        )
    lines = _lines(proc.stderr)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [x for x in lines if x.startswith("warning: ")]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(warnings) == 3 and len(errors) == 1 and len(lines) == 4, lines
    assert warnings[0].startswith(f"warning: checkpoint at step 0 abandoned: No space left on device: {ckpt}/")
    assert "3 checkpoints in a row were abandoned (steps 0, 2, 4" in errors[0]
    assert f"No space left on device: {ckpt}/step_0000000004/" in errors[0]
    log = (tmp_path / "run" / "errors" / "main.log").read_text()
    assert "Traceback" in log and "CheckpointsAbandonedError" in log


def test_a_full_disk_under_the_dense_state_names_the_file_and_keeps_the_traceback(tmp_path):
    with tmpfs(tmp_path / "ckpt", "32k") as ckpt:
        proc = _train(tmp_path, "--steps", "40", "--checkpoint-dir", str(ckpt), "--max-restarts", "1")
    lines = _lines(proc.stderr)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and f"No space left on device: '{ckpt}/dense_latest.pt" in errors[0], lines
    log = (tmp_path / "run" / "errors" / "trainer0.log").read_text()
    assert "Traceback" in log and "dense_latest.pt" in log


def test_a_traceback_is_written_on_a_full_disk(tmp_path):
    with tmpfs(tmp_path / "run", "1m") as run:
        reserve_space(run)
        with contextlib.suppress(OSError), open(run / "filler", "wb") as f:
            while True:
                f.write(bytes(1 << 16))
                f.flush()
        try:
            raise OSError(28, "No space left on device", str(run / "metrics.jsonl"))
        except OSError as e:
            line = report_error(run, "main", e)
        assert f"No space left on device: '{run}/metrics.jsonl'" in line
        assert "Traceback" in (run / "errors" / "main.log").read_text()
        assert not (run / RESERVE).exists()
