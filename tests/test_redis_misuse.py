"""A Redis server that can drop keys, or an ACL user without a command the run needs, is never silent:
refused before any trainer starts with one line (shard, endpoint, what, the fix), or caught at a
commit point. Real processes: the CLI, real redis-servers (the plugin's ``redis_servers``)."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from embeddings import SGD, RedisStore, TableSet, TableSpec
from embeddings.errors import EndpointError, ShardEvictedError
from embeddings.net.endpoints import check_endpoints, commands_needed, missing_commands, probe
from tests import procs
from tests.test_errors import cli, one_error_line

EVICTS = ("--maxmemory", "2mb", "--maxmemory-policy", "allkeys-lru")


def test_a_server_that_evicts_keys_is_refused_before_any_trainer_starts(tmp_path, redis_servers):
    servers = redis_servers(1, extra=EVICTS)
    port = servers.ports[0]
    line = one_error_line(cli(tmp_path, "--redis", servers.urls[0]))
    assert f"shard 0 at redis://127.0.0.1:{port}" in line, line
    assert "allkeys-lru" in line and "CONFIG SET maxmemory-policy noeviction" in line, line
    assert redis.Redis(port=port).dbsize() == 0  # nothing was written


@pytest.mark.parametrize("policy", ["noeviction", "volatile-lru"])
def test_policies_that_keep_keys_without_a_ttl_pass(redis_servers, policy):
    servers = redis_servers(1, extra=("--maxmemory", "64mb", "--maxmemory-policy", policy))
    check_endpoints(servers.urls, 2.0, needs=commands_needed("partial", 1, checkpoints=True))


@pytest.fixture
def acl_server(redis_servers):
    """One server with users: ``nosync`` (everything but SYNC/PSYNC, may run ACL DRYRUN), ``blind``
    (the same without ACL: probed), ``nopromote`` (no REPLICAOF)."""
    servers = redis_servers(1)
    admin = redis.Redis(port=servers.ports[0])
    admin.execute_command("ACL", "SETUSER", "nosync", "on", ">pw-nosync", "~*", "+@all", "-sync", "-psync")
    admin.execute_command("ACL", "SETUSER", "blind", "on", ">pw-blind", "~*", "+@all", "-sync", "-psync", "-acl")
    admin.execute_command("ACL", "SETUSER", "nopromote", "on", ">pw-np", "~*", "+@all", "-replicaof", "-slaveof")
    return servers


@pytest.mark.parametrize("user", ["nosync", "blind"])
def test_an_acl_user_without_sync_is_refused_under_network_checkpoints(tmp_path, acl_server, user):
    port = acl_server.ports[0]
    url = f"redis://{user}:pw-{user}@127.0.0.1:{port}"
    line = one_error_line(cli(tmp_path, "--redis", url, "--checkpoint-every", "2"))
    assert f"shard 0 at redis://{user}@127.0.0.1:{port}" in line, line
    assert "SYNC" in line and "+sync" in line and "checkpoints" in line, line
    assert f"pw-{user}" not in line  # the password never reaches the terminal
    info = redis.Redis(port=port).info("stats")
    assert info["sync_full"] == 0  # the probe asked, it started no sync
    # without checkpoints the run sends no SYNC: nothing to refuse
    check_endpoints([url], 2.0, needs=commands_needed("partial", 1, checkpoints=False))


def test_the_probe_and_acl_dryrun_agree_and_run_nothing(acl_server):
    port = acl_server.ports[0]
    needs = commands_needed("partial", 1, checkpoints=True, killed=[0], stalled=[0])[0]
    client = redis.Redis(port=port, username="nosync", password="pw-nosync")
    assert [n.rule for n in missing_commands(client, "nosync", needs)] == ["sync"]
    assert [n.rule for n in probe(client, needs)] == ["sync"]
    assert probe(redis.Redis(port=port), needs) == []  # the default user: everything
    admin = redis.Redis(port=port)
    assert admin.ping() and admin.info("stats")["sync_full"] == 0  # SHUTDOWN, SYNC, CLIENT PAUSE: probed only


def test_replica_promotion_needs_replicaof_on_the_replica(acl_server):
    port = acl_server.ports[0]
    url = f"redis://nopromote:pw-np@127.0.0.1:{port}"
    needs = commands_needed("replica", 1, 1, checkpoints=False)
    check_endpoints([url], 2.0, needs=needs[:1])  # as the primary: no REPLICAOF sent to it
    with pytest.raises(EndpointError, match=r"REPLICAOF \(promoting a replica\).*\+replicaof"):
        check_endpoints([url, url], 2.0, needs=needs)


STEPS = ["--steps", "150", "--log-every", "1", "--checkpoint-every", "25", "--rows-per-table", "2000"]


def _evict_once_training(out: Path, port: int) -> threading.Thread:
    """From outside, once the run logged 30 steps (past every connect check, rows written): a policy
    that evicts any key, and a memory cap that makes the server evict a fifth of its data at once (the
    rest of its memory is not evictable: a cap much lower ends in OOM instead)."""

    def run() -> None:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (metrics.exists() and metrics.read_text().count('"loss"') >= 30):
            time.sleep(0.01)
        c = redis.Redis(port=port)
        c.config_set("maxmemory-policy", "allkeys-lru")
        mem = c.info("memory")
        c.config_set("maxmemory", mem["used_memory"] - mem["used_memory_dataset"] // 5)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_evictions_during_the_run_stop_it_at_a_commit_point_and_resume_restores_the_shard(tmp_path, redis_servers):
    servers = redis_servers(1)
    port = servers.ports[0]
    out = tmp_path / "run"
    flip = _evict_once_training(out, port)
    proc = cli(tmp_path, "--redis", servers.urls[0], *STEPS)
    flip.join()
    line = one_error_line(proc)
    assert f"shard 0 at redis://127.0.0.1:{port}" in line, line
    assert "evicted" in line and "allkeys-lru" in line and "CONFIG SET maxmemory-policy noeviction" in line, line
    assert f"--resume {out}" in line, line
    assert not (out / "summary.json").exists()  # no result of a run that lost rows
    # fixed: the resumed run restores the shard under its strategy and finishes
    c = redis.Redis(port=port)
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", 0)
    resumed = procs.run(["-m", "recsys", "train", "--resume", str(out)], timeout=180)
    assert resumed.returncode == 0 and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    failures = json.loads((out / "summary.json").read_text())["failures"]
    assert [(f["target"], f["phase"]) for f in failures] == [(0, "resume")], failures
    # from the checkpoint before the one that found the evictions (that one never got a manifest)
    assert failures[0]["restored_from_step"] < failures[0]["step"] and failures[0]["lost_updates"] > 0, failures


TABLES = TableSet([TableSpec("small", 500, 8), TableSpec("wide", 4000, 64)])


def _write(store: RedisStore, n: int, step: int) -> None:
    ids = np.arange(n)
    store.write_rows("wide", ids, np.ones((n, 64 + store.optimizer.state_width), np.float32))
    store.call(0, lambda c: c.set(store.meta_key("applied", 0), step))


def test_the_store_stops_on_evictions_and_on_a_policy_switched_to_one_that_evicts(redis_servers):
    servers = redis_servers(1, extra=("--maxmemory-policy", "volatile-lru"))
    admin = redis.Redis(port=servers.ports[0])
    with RedisStore(servers.urls, TABLES, SGD(), namespace="ev") as store:
        store.evictions.watch()
        _write(store, 2000, step=7)
        # another tenant's keys with a TTL, evicted under volatile-lru: none of the run's rows
        admin.set("other:x", b"x" * 400_000, ex=3600)
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] - 100_000)
        admin.set("other:y", b"y", ex=3600)
        assert admin.info("stats")["evicted_keys"] > 0 and admin.exists("other:x") == 0
        store.check_evictions("--resume RUN")
        admin.config_set("maxmemory", 0)
        admin.config_set("maxmemory-policy", "allkeys-lru")  # nothing evicted yet: the run stops, marker kept
        with pytest.raises(ShardEvictedError, match=r"shard 0 at redis://127.0.0.1:\d+: set during the run: "):
            store.check_evictions("--resume RUN")
        assert store.applied_step(0) == 7
        admin.config_set("maxmemory", admin.info("memory")["used_memory"] - 50_000)
        admin.set("other:z", b"z")
        evicted = admin.info("stats")["evicted_keys"]
        with pytest.raises(ShardEvictedError, match=r"evicted \d+ keys during the run.*--resume RUN, which restores"):
            store.check_evictions("--resume RUN")
        assert store.applied_step(0) is None  # a resumed run finds the shard at no step: it restores it
        admin.config_set("maxmemory", 0)
        with pytest.raises(ShardEvictedError, match=r"run it again \(no state\)"):
            store.check_evictions(None, "no state")
        assert admin.info("stats")["evicted_keys"] >= evicted


def test_a_server_replaced_since_gets_a_new_baseline_and_its_policy_checked(redis_servers):
    servers = redis_servers(1)
    admin = redis.Redis(port=servers.ports[0])
    with RedisStore(servers.urls, TABLES, SGD(), namespace="ev") as store:
        store.evictions.watch()
        store.evictions.noted[0] = ("an earlier server", 0)  # as after a restore: another run_id
        admin.config_set("maxmemory-policy", "allkeys-random")
        with pytest.raises(EndpointError, match=r"maxmemory-policy allkeys-random evicts keys without a TTL"):
            store.check_evictions()


@pytest.mark.parametrize(
    "err",
    [
        redis.exceptions.ClusterDownError("The cluster is down"),
        redis.exceptions.TryAgainError("Multiple keys request during rehashing of slot"),
        redis.exceptions.MovedError("3999 127.0.0.1:6381"),
    ],
)
def test_a_cluster_node_not_serving_now_is_unavailable_not_bad_data(err):
    """redis-py's typed replies of a cluster failing over (their message without the code) are a
    shard unavailable for now, which recovery waits out, not a damaged shard that ends the run."""
    from types import SimpleNamespace

    from embeddings.errors import ShardUnavailableError
    from embeddings.net.links import ShardLinks

    def fail():
        raise err

    with pytest.raises(ShardUnavailableError) as got:
        ShardLinks.mapped(SimpleNamespace(endpoints={2: "redis://127.0.0.1:7002"}), 2, fail)
    assert got.value.shard == 2 and type(err).__name__ in str(got.value)
