"""Training through a shard's failure with two trainers (a trainer kill, a node failure, kept
updates lost with a restart) and on servers the project did not start (a replacement dying during
its restore); the rest, and what the tests assert, in ``test_train_through.py``."""

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from recsys.testing import RedisServers
from tests import procs
from tests.conftest import train_cli
from tests.test_train_through import ONE, outage, verify

TWO = [*ONE, "--trainers", "2", "--max-restarts", "2", "--eval-every", "15", "--eval-samples", "2048"]
HELD_3S = ["--inject", "shard:1@step=25", "--inject", "slow-restore:1:3"]


def aucs(run: Path) -> list[tuple[int, float]]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["auc"]) for r in lines if "auc" in r]


@pytest.fixture(scope="module")
def base2(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("through-base2") / "run"
    return out, train_cli(out, *TWO, "--recovery", "log")


def test_two_trainers_train_and_evaluate_through_an_outage_and_a_trainer_kill(tmp_path, base2):
    out = tmp_path / "run"
    held = ["--inject", "shard:1@step=25", "--inject", "slow-restore:1:4"]  # still away at step 35
    kill = ["--trainer-recovery", "restart", "--inject", "trainer:0@step=35"]  # the group restarts
    s = train_cli(out, *TWO, "--recovery", "log", "--train-through", *held, *kill)
    kinds = sorted(f["kind"] for f in s["failures"])
    assert kinds == ["shard", "shard", "trainer"], json.dumps(s["failures"])
    # the outage the trainer's death cut short keeps its record: its own step, the steps trained
    # through up to the state the group went on from (step 34), the rows read meanwhile; the resume's
    # restore has its own (phase resume)
    (cut,) = [f for f in s["failures"] if "cut_short" in f]
    assert (cut["target"], cut["step"], cut["strategy"]) == (1, 25, "log"), json.dumps(cut)
    assert cut["trained_through_steps"] == 10 and cut["rows_read_exact"] > 0, json.dumps(cut)
    assert "the run went on from step 34" in cut["cut_short"], json.dumps(cut)
    (resumed,) = [f for f in s["failures"] if f["kind"] == "shard" and "cut_short" not in f]
    assert resumed["phase"] == "resume" and resumed["target"] == 1, json.dumps(resumed)
    assert not list(out.glob("outage_shard*")), "the notes go once the records are made"
    # the trainer's death: what it cost every trainer, where the group trained again, nothing skipped
    (death,) = [f for f in s["failures"] if f["kind"] == "trainer"]
    assert death["rejoin_step"] == 35 and death["samples_lost"] == 0, json.dumps(death)
    assert death["waited_s"] == pytest.approx(death["detected_after_s"] + death["heal_s"], abs=2e-4), json.dumps(death)
    assert death["waited_s"] > 0
    # the run's figures cover the whole run, the restart included
    assert s["wall_seconds"] > s["wall_seconds_before_restart"] > 0
    assert s["throughput_samples_per_s"] == pytest.approx(s["samples_trained"] / s["wall_seconds"], rel=1e-3)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records if "elapsed_s" in r]
    assert elapsed == sorted(elapsed) and elapsed[-1] == s["wall_seconds"]
    # every trainer read the same rows: the evaluation at step 30 ran while shard 1 was away (every
    # trainer served its rows), and the restart at step 35 restored it from its log as a waiting restore
    assert aucs(out) == aucs(base2[0]) and 30 in dict(aucs(out))
    assert s["embedding_digest"] == base2[1]["embedding_digest"]
    assert verify(out)[0] == 0


def test_under_replace_a_trainer_dies_while_a_shard_is_away_and_the_run_ends_bit_identical(tmp_path, base2):
    """--trainer-recovery replace (the default with two trainers): the survivor goes on at a new
    quorum while shard 1 is still away; the outage the death cut short keeps its record, the shard
    is restored at the regroup, and the run ends as the run of no failure."""
    out = tmp_path / "run"
    held = ["--inject", "shard:1@step=25", "--inject", "slow-restore:1:4"]  # still away at step 35
    s = train_cli(out, *TWO, "--recovery", "log", "--train-through", *held, "--inject", "trainer:0@step=35")
    (death,) = [f for f in s["failures"] if f["kind"] == "trainer"]
    assert death["strategy"] == "replace" and death["samples_lost"] == 0, json.dumps(death)
    (cut,) = [f for f in s["failures"] if "cut_short" in f]
    assert (cut["target"], cut["step"]) == (1, 25), json.dumps(cut)
    assert aucs(out) == aucs(base2[0])
    assert s["embedding_digest"] == base2[1]["embedding_digest"]
    assert verify(out)[0] == 0


def test_a_node_failure_during_an_outage(tmp_path, base2):
    out = tmp_path / "run"
    flags = ["--inject", "shard:0@step=25", "--inject", "slow-restore:0:3", "--inject", "node:1@step=30"]
    s = train_cli(out, *TWO, "--recovery", "log", "--train-through", *flags)
    assert {f["kind"] for f in s["failures"]} >= {"shard", "node"}, json.dumps(s["failures"])
    assert s["embedding_digest"] == base2[1]["embedding_digest"]
    assert verify(out)[0] == 0


def test_log_through_a_1_mb_cache_and_a_trainer_restart_ends_bit_identical(tmp_path, base2):
    """Under log a row no trainer holds is never read from a fallback, so nothing is kept for a
    restart to lose: a 1 MB cache (a third of the rows), a shard away from step 25, a trainer killed
    at step 27 (the restart's cache is cold) end as the run of no failure, and verify."""
    out = tmp_path / "run"
    flags = [*TWO, "--recovery", "log", "--train-through", "--held-rows-mb", "1", *HELD_3S]
    proc = procs.run(["-m", "recsys", "train", *flags, "--inject", "trainer:0@step=27", "--out", str(out)], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert {f["kind"] for f in s["failures"]} == {"shard", "trainer"}, json.dumps(s["failures"])
    assert s["rows_read_stale"] == 0 and s["updates_applied_late"] == 0, json.dumps(s["failures"])
    assert s["embedding_digest"] == base2[1]["embedding_digest"]
    assert aucs(out) == aucs(base2[0])  # the evaluations too: every row they read was exact
    assert verify(out)[0] == 0


def test_the_replacement_dying_during_its_restore_on_remote_servers(tmp_path, redis_servers):
    servers: RedisServers = redis_servers(3, supervised=True)
    out = tmp_path / "run"

    def kill_during_restore() -> None:
        journal, deadline = out / "recovery.log", time.monotonic() + 120
        while time.monotonic() < deadline and not (journal.exists() and "shard 1 away" in journal.read_text()):
            time.sleep(0.02)
        time.sleep(1.0)  # the replacement is up and loaded, its restore held 3 s (slow-restore)
        servers.kill(1)

    killer = threading.Thread(target=kill_during_restore, daemon=True)
    killer.start()
    flags = [*ONE, "--redis", ",".join(servers.urls), "--recovery", "log", "--train-through", "--timeout", "1"]
    s = train_cli(out, *flags, *HELD_3S)
    killer.join()
    assert servers.restarts[1] >= 2  # the injected shutdown, then the kill during the restore
    f = outage(s)
    assert f["trained_through_steps"] >= 1 and f["lost_updates"] == 0, json.dumps(f)
    code, line = verify(out)  # rebuilt from the files, equal to the rows read back from the servers
    assert code == 0 and "its shards" in line, line

    from recsys.backends import open_store
    from recsys.config import RunConfig

    cfg = RunConfig.from_toml(out / "config.toml")
    ns = json.loads((out / "run.json").read_text())["namespace"]
    store = open_store(cfg, servers.urls, ns, replicas=False)
    try:
        row = store.read_rows("t_cat_5", np.array([40]))
        row[0, 0] += 1.0
        store.write_rows("t_cat_5", np.array([40]), row)
        shard = int(store.shard_map.shard_of(5, np.array([40]))[0])
    finally:
        store.close()
    code, line = verify(out)
    assert code == 1 and f"shard {shard}, table t_cat_5, row 40:" in line, line


def test_a_trainer_slowed_while_a_shard_is_away(tmp_path, base2):
    """A slowdown (trainer 1 at 3x from step 10: 10 log records, of which 5 in a row name it, however
    noisy one record is on a busy host) while shard 1 is restored in the background (from step 25,
    3 s): the outage is recorded, the run ends on the healthy run's digest and verifies."""
    out = tmp_path / "run"
    s = train_cli(out, *TWO, "--recovery", "log", "--train-through", *HELD_3S, "--inject", "slow-trainer:1:3@step=10")
    assert outage(s)["trained_through_steps"] > 0, json.dumps(s["failures"])
    assert [r["trainer"] for r in s["slow_trainers"]] == [1], s["slow_trainers"]
    assert s["embedding_digest"] == base2[1]["embedding_digest"]
    assert verify(out)[0] == 0
