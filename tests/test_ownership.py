"""A run owns its namespace (a claim on every shard) and its folder (a lock while it writes there);
``--resume`` continues the same run and nothing else. Real processes: the CLI, real redis-servers,
real files."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from embeddings import LocalShards
from recsys.config import ConfigError
from tests import procs
from tests.conftest import track, train_cli
from tests.test_errors import SMALL, one_error_line

ROOT = Path(__file__).resolve().parents[1]
FAST = [*SMALL, "--max-restarts", "0"]  # one trainer in the command's process: the quickest run


def cli(out: Path, *flags: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=timeout)


def popen(out: Path, *flags: str) -> procs.Proc:
    return procs.start(["-m", "recsys", "train", *flags, "--out", str(out)], stdout=subprocess.DEVNULL)


def wait_for(what, proc: procs.Proc, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the first run ended early: {proc.stderr.read()[-2000:]}"
        assert time.monotonic() < deadline, "the first run did not get going"
        time.sleep(0.05)


def stop(proc: procs.Proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def shards():
    with LocalShards(2) as sh:
        track(sh)
        yield sh


def owner(sh: LocalShards, namespace: str, shard: int = 0) -> dict | None:
    raw = redis.Redis.from_url(sh.urls[shard]).get(f"{namespace}:meta:owner")
    return json.loads(raw) if raw is not None else None


def test_a_namespace_reused_by_the_next_run_is_refused_until_taken_over(tmp_path, shards, namespace):
    flags = [*FAST, "--redis", ",".join(shards.urls), "--namespace", namespace]
    first = train_cli(tmp_path / "a", *flags)
    claim = owner(shards, namespace, 1)
    assert (
        claim["out"] == str(tmp_path / "a")
        and claim["run_id"] == json.loads((tmp_path / "a/run.json").read_text())["run_id"]
    )

    line = one_error_line(cli(tmp_path / "b", *flags))
    assert f"namespace {namespace!r} on shard 0 at {shards.urls[0]}" in line, line
    assert f"out {tmp_path / 'a'}" in line and f"this run (out {tmp_path / 'b'})" in line, line
    assert "--take-over-namespace" in line
    assert not {"run.json", "config.toml", "metrics.jsonl"} & {p.name for p in (tmp_path / "b").iterdir()}

    # taken over: the old rows are gone, the run ends as one on a clean namespace does
    second = train_cli(tmp_path / "b", *flags, "--take-over-namespace")
    assert second["embedding_digest"] == first["embedding_digest"]
    assert owner(shards, namespace)["out"] == str(tmp_path / "b")


def test_two_runs_at_once_over_one_namespace_the_second_is_refused(tmp_path, shards, namespace):
    flags = [*SMALL, "--max-restarts", "0", "--redis", ",".join(shards.urls), "--namespace", namespace]
    first = popen(tmp_path / "a", *flags, "--steps", "100000", "--threads", "1")  # a core left for the others
    try:
        wait_for(lambda: owner(shards, namespace, 1) is not None, first)
        line = one_error_line(cli(tmp_path / "b", *flags))
        assert f"namespace {namespace!r} on shard 0" in line and f"out {tmp_path / 'a'}, pid {first.pid}" in line
        assert first.poll() is None  # the first run trains on
    finally:
        stop(first)
    assert owner(shards, namespace)["pid"] == first.pid


def test_a_take_over_leaves_a_namespace_alone_while_its_run_writes_its_folder(tmp_path, shards, namespace):
    """In this process: a run that holds its folder's lock owns the namespace; once it let go, a
    take-over deletes every key of the namespace and claims it."""
    from embeddings.net.ownership import NamespaceClaimError
    from recsys.config import RunConfig
    from recsys.results.rundir import OutLock, claim_namespace

    def cfg(out: Path) -> RunConfig:
        return RunConfig.from_dict({"data": {"rows_per_table": 100}, "train": {"out": str(out)}})

    client = redis.Redis.from_url(shards.urls[1])
    with OutLock(tmp_path / "a"):
        claim_namespace(cfg(tmp_path / "a"), shards.urls, namespace, "run-a", take_over=False, fresh=True)
        client.set(f"{namespace}:0:row", b"x")  # a row of run a's
        with pytest.raises(NamespaceClaimError, match=rf"still running \(pid {os.getpid()}\)"):
            claim_namespace(cfg(tmp_path / "b"), shards.urls, namespace, "run-b", take_over=True, fresh=True)
        assert owner(shards, namespace)["run_id"] == "run-a" and client.exists(f"{namespace}:0:row")
        # the owning run itself (a resume, a restarted group) takes its claim back
        assert claim_namespace(cfg(tmp_path / "a"), shards.urls, namespace, "run-a", take_over=False, fresh=False) == []
    taken = claim_namespace(cfg(tmp_path / "b"), shards.urls, namespace, "run-b", take_over=True, fresh=True)
    assert taken == [0, 1] and not client.exists(f"{namespace}:0:row")
    assert owner(shards, namespace, 1)["run_id"] == "run-b" and owner(shards, namespace, 1)["out"] == str(
        tmp_path / "b"
    )


def test_a_refused_claim_takes_back_what_it_wrote(tmp_path, shards, namespace):
    from embeddings.net.ownership import NamespaceClaimError
    from recsys.config import RunConfig
    from recsys.results.rundir import claim_namespace

    cfg = RunConfig.from_dict({"data": {"rows_per_table": 100}, "train": {"out": str(tmp_path / "b")}})
    redis.Redis.from_url(shards.urls[1]).set(f"{namespace}:meta:applied", b"7")  # rows, no claim: an old run's
    with pytest.raises(NamespaceClaimError, match="holds the rows of an earlier run that recorded no owner"):
        claim_namespace(cfg, shards.urls, namespace, "run-b", take_over=False, fresh=True)
    assert owner(shards, namespace, 0) is None and owner(shards, namespace, 1) is None
    # a resume expects rows there: its claim stands
    claim_namespace(cfg, shards.urls, namespace, "run-b", take_over=False, fresh=False)
    assert owner(shards, namespace, 1)["run_id"] == "run-b"


def test_two_runs_into_one_out_folder_at_once_the_second_is_refused(tmp_path):
    out = tmp_path / "run"
    first = popen(out, *FAST, "--steps", "100000", "--threads", "1")
    try:
        wait_for(lambda: (out / "metrics.jsonl").exists(), first)
        proc = cli(out, *FAST)
        assert one_error_line(proc).endswith(f": --out {out}: another run (pid {first.pid}) is writing there")
        assert first.poll() is None
    finally:
        stop(first)


@pytest.fixture(scope="module")
def crashed(tmp_path_factory) -> Path:
    """A run stopped by its second trainer death (one restart allowed): resumable from its dense state."""
    out = tmp_path_factory.mktemp("crashed") / "run"
    flags = [*SMALL, "--steps", "12", "--recovery", "log", "--checkpoint-every", "4", "--max-restarts", "1"]
    proc = cli(out, *flags, "--inject", "trainer:0@step=3", "--inject", "trainer:0@step=7")
    assert proc.returncode == 1 and "after 1 restart(s) of 1" in proc.stderr, proc.stderr[-2000:]
    assert not (out / "summary.json").exists()
    return out


def snapshot(folder: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, p.read_bytes()) for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--rows-per-table", "1000"], "--rows-per-table 1000 differs from the run's 500"),
        (["--seed", "3"], "--seed 3 differs from the run's 0"),
        (["--namespace", "someone-else"], "--namespace someone-else differs from the run's run-"),
        (["--shards", "2"], "--shards 2 differs from the run's 3"),
        (["--embedding-dim", "4"], "--embedding-dim 4 differs from the run's 8"),
    ],
)
def test_a_resume_that_changes_the_run_is_refused_by_name(crashed, flags, named):
    before = snapshot(crashed)
    line = one_error_line(cli(crashed, "--resume", str(crashed), *flags))
    assert line.startswith(f"error: config: --resume {crashed}: {named}"), line
    assert "a resumed run keeps its model, tables, data, sharding, strategy and namespace" in line
    assert snapshot(crashed) == before


def test_the_python_api_resume_keeps_the_same_rule(crashed):
    import recsys

    with pytest.raises(ConfigError, match=r"rows_per_table 1000 differs from the run's 500"):
        recsys.resume(crashed, rows_per_table=1000)


def test_a_crashed_run_resumes_to_the_end_and_is_then_finished_for_good(crashed, tmp_path):
    flags = [*SMALL, "--steps", "12", "--recovery", "log", "--checkpoint-every", "4", "--max-restarts", "1"]
    baseline = train_cli(tmp_path / "baseline", *flags)
    s = train_cli(crashed, "--resume", str(crashed), "--timeout", "4", "--eval-every", "6")  # these may change
    assert s["steps_completed"] == 12 and s["embedding_digest"] == baseline["embedding_digest"]
    # the two trainer deaths; the resume's new local servers (empty) restored, not counted as failed shards
    assert sorted(f["kind"] for f in s["failures"]) == ["resume"] * 3 + ["trainer"] * 2, s["failures"]
    assert sorted(f["target"] for f in s["failures"] if f["kind"] == "resume") == [0, 1, 2]
    assert all(f["lost_updates"] == 0 for f in s["failures"])  # the log replays them

    # finished: a resume is refused and the folder stays as it was
    before = snapshot(crashed)
    line = one_error_line(cli(crashed, "--resume", str(crashed)))
    assert line == (
        f"error: config: --resume {crashed}: the run finished at step 12; results kept (a finished run is not "
        "extended: start a new run with another --out)"
    )
    assert snapshot(crashed) == before
    assert (crashed / "run.lock").exists() and os.path.getsize(crashed / "summary.json") > 0


def test_torchrun_launches_without_an_id_each_get_a_namespace_all_ranks_share(tmp_path):
    """torchrun's run id is "none" for every launch without --rdzv-id: each launch still gets its own
    namespace (rank 0 picks it), and both trainers write under it."""
    from embeddings.servers.launcher import free_port

    with LocalShards(2) as sh:
        track(sh)
        seen = []
        for name in ("a", "b"):
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "1",
                    "--nproc-per-node",
                    "2",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{free_port()}",
                    "-m",
                    "recsys",
                    "train",
                    *SMALL,
                    "--trainers",
                    "2",
                    "--redis",
                    ",".join(sh.urls),
                    "--out",
                    str(tmp_path / name),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
            )
            assert proc.returncode == 0, proc.stderr[-2000:]
            ns = json.loads((tmp_path / name / "run.json").read_text())["namespace"]
            seen.append(ns)
            assert owner(sh, ns, 1)["out"] == str(tmp_path / name)
            # shard 1 is written by rank 1: its keys are under rank 0's namespace too
            keys = {k.split(b":", 1)[0] for s in (0, 1) for k in redis.Redis.from_url(sh.urls[s]).scan_iter()}
            assert keys == {x.encode() for x in seen}, (keys, seen)
        assert seen[0] != seen[1] and "none" not in seen[0]
