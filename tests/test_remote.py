"""Shards on servers the project did not start (other machines): snapshots and restores over the
protocol. The servers are kept alive by a supervisor in the test (the pytest plugin's ``redis_servers``)
that restarts a killed server empty on the same port; the test kills one from outside at a random
moment mid-run (``REMOTE_SEED=N`` replays a draw)."""

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from recsys.testing import RedisServers
from tests import procs
from tests.conftest import _STARTED_PIDS, train_cli

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--steps", "120", "--rows-per-table", "2000", "--batch-size", "256", "--embedding-dim", "8"]
BASE += ["--eval-every", "0", "--eval-samples", "2048", "--log-every", "5", "--checkpoint-every", "20"]
BASE += ["--timeout", "1", "--max-restarts", "0"]
BASE += ["--write-every", "1"]  # a kill is met at the step it lands in (in windows: at the window's close)
SEED = int(os.environ.get("REMOTE_SEED", time.time_ns() % 100_000))


@pytest.fixture
def servers(redis_servers):
    """Three servers kept alive by the plugin's supervisor (it checks they are gone afterwards)."""
    return redis_servers(3, supervised=True)


def kill_mid_run(
    servers: RedisServers, out: Path, shard: int, rng: random.Random, hold: bool = False
) -> threading.Thread:
    """From outside: once training logged its first steps, wait a random moment, SIGKILL the server."""

    def run():
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count("loss") >= 2):
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 1.0))
        if hold:
            servers.hold(shard)
        servers.kill(shard)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The failure-free run, on local shards: embeddings do not depend on where shards run."""
    return train_cli(tmp_path_factory.mktemp("remote-ref"), *BASE, "--shards", "3", "--recovery", "log")


def remote_run(out: Path, servers: RedisServers, strategy: str, shard: int, *flags: str) -> dict:
    rng = random.Random(SEED)
    killer = kill_mid_run(servers, out, shard, rng)
    s = train_cli(out, *BASE, "--redis", ",".join(servers.urls), "--recovery", strategy, *flags)
    killer.join()
    assert servers.restarts[shard] >= 1, f"seed {SEED}: the server was not killed mid-run"
    return s


def test_log_recovery_of_a_remote_shard_is_exact(tmp_path, servers, reference):
    shard = SEED % 3
    s = remote_run(tmp_path / "run", servers, "log", shard)
    msg = f"seed {SEED}: {json.dumps(s['failures'])}"
    recs = [f for f in s["failures"] if f["strategy"] == "log"]
    assert [f["target"] for f in recs] == [shard], msg
    assert recs[0]["restored_bytes"] > 0 and recs[0]["lost_updates"] == 0, msg
    assert s["embedding_digest"] == reference["embedding_digest"], msg
    # checkpoints came over the network: each holds an RDB per shard
    ckpts = sorted((tmp_path / "run" / "checkpoints").glob("step_*/shard*.rdb"))
    assert ckpts and all(p.stat().st_size > 0 for p in ckpts)


def test_partial_recovery_restores_only_the_failed_remote_shard(tmp_path, servers, reference):
    shard = SEED % 3
    s = remote_run(tmp_path / "run", servers, "partial", shard)
    recs = [f for f in s["failures"] if f["strategy"] == "partial"]
    msg = f"seed {SEED}: {json.dumps(recs)}"
    assert [f["target"] for f in recs] == [shard], msg
    f = recs[0]
    # updates are lost exactly when steps ran between the checkpoint and the failing step (a kill
    # landing in the step right after a checkpoint loses nothing: that step is retried)
    lost = f["step"] - 1 > f["restored_from_step"]
    assert (f["lost_updates"] > 0 and f["lost_samples"] > 0) == lost, msg
    assert f["lost_samples"] <= (f["step"] - 1 - f["restored_from_step"]) * 256 + 1e-6, msg
    assert s["pls"] == pytest.approx(f["lost_samples"] / s["samples_trained"], rel=1e-6)
    # the other servers kept running: only the failed one was restarted
    assert [servers.restarts[i] for i in range(3) if i != shard] == [0, 0]


def test_a_server_that_never_comes_back_ends_clearly_and_resume_finishes(tmp_path, servers, reference):
    shard = SEED % 3
    out = tmp_path / "run"
    killer = kill_mid_run(servers, out, shard, random.Random(SEED), hold=True)
    flags = [*BASE, "--redis", ",".join(servers.urls), "--recovery", "log", "--shard-restart-timeout", "2"]
    flags += ["--max-restarts", "1"]  # per-step dense saves: what --resume starts from
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=300)
    killer.join()
    err = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"shard {shard} at {servers.urls[shard]}" in err[-1] and "--resume" in err[-1], err[-1]
    assert not (out / "summary.json").exists()
    servers.release(shard)  # the machine is back (empty)
    deadline = time.monotonic() + 20
    while servers.restarts[shard] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    s = train_cli(out, "--resume", str(out))
    assert s["steps_completed"] == 120 and s["embedding_digest"] == reference["embedding_digest"]
    assert any(f["target"] == shard and f["strategy"] == "log" for f in s["failures"]), s["failures"]


REPLICA = [*BASE, "--recovery", "replica", "--checkpoint-every", "0"]


def test_replica_promoted_with_replica_wait_loses_nothing(tmp_path, reference):
    s = train_cli(tmp_path, *REPLICA, "--replicas", "local", "--replica-wait", "--inject", "shard:1@step=60")
    (f,) = [f for f in s["failures"] if f["strategy"] == "replica"]
    assert f["target"] == 1 and f["promoted"] != f["failed_endpoint"], f
    assert f["lost_updates"] == 0 and f["lost_samples"] == 0.0 and s["pls"] == 0.0, f
    # nothing loaded: a promotion (its time is scripts/bench_fault_timing.py's figure)
    assert f["restored_bytes"] == 0 and f["recovery_s"] >= 0, f
    assert s["steps_completed"] == 120 and s["embedding_digest"] == reference["embedding_digest"]


def test_a_lagging_replica_promoted_counts_the_updates_it_missed(tmp_path):
    """The replica is stopped (SIGSTOP) for a while, so the primary's stream to it backs up; then the
    primary is killed and held down, the replica resumes and is promoted: what it missed is lost."""
    import signal

    with RedisServers(3, tmp_path / "primaries", supervised=True) as prim:
        extra = [("--replicaof", "127.0.0.1", str(p)) for p in prim.ports]
        reps = [RedisServers(1, tmp_path / f"replica{i}", extra=e, supervised=True) for i, e in enumerate(extra)]
        _STARTED_PIDS.update(prim.pids + [p for r in reps for p in r.pids])
        try:
            for r in reps:  # each replica has synced before the run
                c = redis.Redis(port=r.ports[0])
                while c.info("replication").get("master_link_status") != "up":
                    time.sleep(0.02)
            out = tmp_path / "run"
            ended, backed_up = threading.Event(), threading.Event()

            def lag_then_kill():
                metrics = out / "metrics.jsonl"
                while not (metrics.exists() and metrics.read_text().count("loss") >= 2):
                    if ended.wait(0.02):
                        return
                rep = reps[2].procs[0]
                rep.send_signal(signal.SIGSTOP)
                # the run goes on until the stream to the replica backs up past the kernel's socket
                # buffers (which the replica still reads once it runs again) into the primary's own:
                # watched, not timed, as a loaded machine trains slowly
                primary = redis.Redis(port=prim.ports[2])
                while primary.info("memory")["mem_clients_slaves"] < 2**20:
                    if ended.wait(0.02):
                        rep.send_signal(signal.SIGCONT)
                        return
                backed_up.set()
                prim.hold(2)
                prim.kill(2)
                time.sleep(0.2)
                rep.send_signal(signal.SIGCONT)

            t = threading.Thread(target=lag_then_kill, daemon=True)
            t.start()
            flags = [*REPLICA, "--steps", "200", "--timeout", "2"]  # backed up by step 90 or so here
            flags += ["--redis", ",".join(prim.urls), "--replicas", ",".join(r.urls[0] for r in reps)]
            try:
                s = train_cli(out, *flags)
            finally:
                ended.set()
                t.join()
            assert backed_up.is_set(), "the run ended before the stream to the stopped replica backed up"
        finally:
            for r in reps:
                r.close()
    (f,) = [f for f in s["failures"] if f["strategy"] == "replica"]
    assert f["target"] == 2 and f["promoted"] == reps[2].urls[0], f
    assert f["restored_from_step"] < f["step"] - 1 and f["lost_updates"] > 0, f
    assert 0 < f["lost_samples"] <= (f["step"] - 1 - f["restored_from_step"]) * 256, f
    assert s["pls"] == pytest.approx(f["lost_samples"] / s["samples_trained"], rel=1e-6)


@pytest.fixture
def cluster(tmp_path):
    """A Redis Cluster of 3 primaries with a replica each, built with ``redis-cli --cluster create``."""
    args = ("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "1000")
    with RedisServers(6, tmp_path / "cluster", extra=args, supervised=True) as nodes:
        _STARTED_PIDS.update(nodes.pids)
        for i in range(6):
            nodes.hold(i)  # a killed node stays down: its replica takes over
        create = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{p}" for p in nodes.ports]]
        subprocess.run(
            [*create, "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60
        )
        deadline = time.monotonic() + 30
        for p in nodes.ports:
            c = redis.Redis(port=p)
            while c.cluster("info")["cluster_state"] != "ok" and time.monotonic() < deadline:
                time.sleep(0.05)
        yield nodes


def cluster_url(nodes: RedisServers) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in nodes.ports[:2])


@pytest.mark.parametrize("strategy", ["replica", "log"])
def test_a_cluster_primary_killed_mid_run(tmp_path, cluster, reference, strategy):
    flags = [*BASE, "--redis", cluster_url(cluster), "--shards", "3", "--recovery", strategy]
    s = train_cli(tmp_path, *flags, "--inject", "shard:1@step=60", "--shard-restart-timeout", "30")
    recs = [f for f in s["failures"] if f["strategy"] == strategy]
    assert [f["target"] for f in recs] == [1], s["failures"]
    assert s["steps_completed"] == 120
    if strategy == "log":  # restored from the checkpoint over the network, log replayed: exact
        assert recs[0]["restored_bytes"] > 0 and s["embedding_digest"] == reference["embedding_digest"]
    else:  # the cluster promoted the replica; what it had not received is counted
        f = recs[0]
        assert f["promoted"] != f["failed_endpoint"] and f["restored_bytes"] == 0, f
        assert 0 <= f["lost_samples"] <= (f["step"] - 1 - f["restored_from_step"]) * 256, f
        assert s["pls"] == pytest.approx(f["lost_samples"] / s["samples_trained"], rel=1e-6)
