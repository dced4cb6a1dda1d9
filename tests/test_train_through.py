"""Training through a shard's failure (``--train-through``) on real redis-server shards, trainer
processes and gloo: the failed shard is restored in the background (held for seconds by
``--inject slow-restore``) while the steps go on; its rows come from its writer's cache (exact) or a
fallback (counted), and the outage ends exact, with its loss counted exactly, or with one line.
``recsys verify`` rebuilds every run's rows from its checkpoint and update logs: the invariant
"nothing lost, nothing applied twice". No assertion is on a clock: the seconds are the benchmark's."""

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests import procs
from tests.conftest import train_cli

ONE = ["--steps", "60", "--trainers", "1", "--shards", "3", "--rows-per-table", "2000", "--batch-size", "256"]
ONE += ["--embedding-dim", "8", "--eval-every", "0", "--log-every", "5", "--checkpoint-every", "40"]
HELD = ["--inject", "shard:1@step=25", "--inject", "slow-restore:1:2"]  # shard 1 away from step 25, 2 s


def verify(run: Path) -> tuple[int, str]:
    proc = procs.run(["-m", "recsys", "verify", str(run)], timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def outage(s: dict, shard: int = 1) -> dict:
    recs = [f for f in s["failures"] if f["target"] == shard and "trained_through_steps" in f]
    assert len(recs) == 1, json.dumps(s["failures"])
    return recs[0]


def updates_per_step(run: Path, shard: int, steps: range) -> dict[int, int]:
    """(row, step) updates of ``shard`` in each step, worked out from the data (one trainer): the
    unique rows of the step's batch that the shard holds."""
    from data.batches import make_batch
    from recsys.backends import open_store
    from recsys.config import RunConfig
    from recsys.datasets import sources
    from recsys.model import store_model

    cfg = RunConfig.from_toml(run / "config.toml")
    store = open_store(cfg, ["redis://127.0.0.1:1"] * cfg.embeddings.shards, "count", replicas=False)
    try:
        _, ebc = store_model(cfg, store)
        src, b = sources(cfg).train, cfg.train.batch_size
        out = {}
        for t in steps:
            a = src.read((t - 1) * b, b)
            keys = ebc.unique_keys(make_batch(a.dense, a.sparse, a.labels, bags=a.bags).sparse_features)
            out[t] = int(np.count_nonzero(store.shard_map.shard_of_keys(keys) == shard))
        return out
    finally:
        store.close()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> dict:
    return train_cli(tmp_path_factory.mktemp("through-base"), *ONE, "--recovery", "log")


@pytest.fixture(scope="module")
def held(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("through-held") / "run"
    return out, train_cli(out, *ONE, "--recovery", "log", "--train-through", "--save-model", *HELD)


def test_log_through_a_held_restore_is_bit_identical_and_verifies(held, base):
    out, s = held
    f = outage(s)
    msg = json.dumps(f)
    assert f["trained_through_steps"] >= 1, msg  # steps ran while shard 1 was restored
    assert f["rows_read_fallback"] == 0 and f["updates_applied_late"] == 0, msg  # every row was held
    assert f["rows_read_exact"] > 0 and f["updates_applied_exact"] > 0, msg
    assert f["lost_updates"] == 0 and f["restored_bytes"] > 0, msg
    assert "slow_restore" in f["phases_s"], msg
    assert s["embedding_digest"] == base["embedding_digest"]
    code, line = verify(out)
    assert code == 0 and "equal the run's final rows" in line and "final_model.pt" in line, line


def test_verify_names_a_row_changed_behind_the_runs_back(held, tmp_path):
    import torch

    out = tmp_path / "run"
    shutil.copytree(held[0], out)
    model = torch.load(out / "final_model.pt", weights_only=True)
    model["embedding.t_cat_3"][17, 2] += 0.5
    torch.save(model, out / "final_model.pt")
    code, line = verify(out)
    assert code == 1 and "table t_cat_3, row 17:" in line and "1 rows of the table differ" in line, line
    assert line.count("\n") == 0
    (out / "final_model.pt").unlink()
    summary = json.loads((out / "summary.json").read_text())
    summary["embedding_digest"] = "0" * 64
    (out / "summary.json").write_text(json.dumps(summary))
    code, line = verify(out)
    assert code == 1 and "the run ended with 0000000000000000" in line, line


@pytest.mark.parametrize("cache_mb", ["1"])
def test_log_through_with_a_small_cache_waits_for_rows_no_one_holds_and_ends_bit_identical(tmp_path, base, cache_mb):
    """Under log no row is read from a fallback: a step that needs a row its writer does not cache
    waits for the restore (one line, counted in waited_s) and reads it from the restored shard."""
    out = tmp_path / "run"
    flags = [*ONE, "--recovery", "log", "--train-through", "--held-rows-mb", cache_mb, *HELD]
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    f = outage(s)
    msg = json.dumps(f)
    assert f["rows_read_fallback"] == 0 and f["updates_applied_late"] == 0 and s["rows_read_stale"] == 0, msg
    # every update of the outage steps was applied once, exactly
    first = f.get("write_step", f["step"])
    end = first + f["trained_through_steps"]
    want = sum(updates_per_step(out, 1, range(first, end)).values())
    assert f["updates_applied_exact"] == want, msg
    waits = [x for x in proc.stderr.splitlines() if "waiting for the restore of shards [1]" in x]
    assert len(waits) == 1 and "no trainer holds (--recovery log reads every row exactly)" in waits[0], proc.stderr
    assert f["waited_s"] > 0, msg  # the wait is the failure's
    assert s["embedding_digest"] == base["embedding_digest"]
    code, line = verify(out)
    assert code == 0, line


def test_partial_through_counts_its_loss_exactly_and_keeps_every_outage_update(tmp_path):
    out = tmp_path / "run"
    flags = [*ONE, "--recovery", "partial", "--log-dir", str(out / "logs"), "--train-through", *HELD]
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    f = outage(s)
    msg = json.dumps(f)
    # the terminal and the summary say what was relaxed: rows read stale beside the updates lost
    stale = f"{f['rows_read_fallback']:,} rows read stale, {f['updates_applied_late']:,} updates applied late"
    assert s["rows_read_stale"] == f["rows_read_fallback"] > 0, msg
    closing = proc.stdout.strip().splitlines()[-1]
    assert closing.startswith("failures: 1 (1 shard), ") and f"updates lost, {stale}, PLS" in closing, closing
    assert any(x.startswith("failure: shard 1 ") and stale in x for x in proc.stderr.splitlines()), proc.stderr
    base, first = f["restored_from_step"], f.get("write_step", f["step"])  # the failed write's step
    end = first + f["trained_through_steps"]
    counts = updates_per_step(out, 1, range(base + 1, end))
    assert f["lost_updates"] == sum(counts[t] for t in range(base + 1, first)) > 0, msg
    assert f["updates_applied_exact"] + f["updates_applied_late"] == sum(counts[t] for t in range(first, end)), msg
    assert f["updates_applied_late"] > 0, msg  # the writer's rows are newer than the restore: a fallback
    assert s["pls"] > 0
    # the rows are the checkpoint shard 1 was restored from plus every update logged from the failure
    # on: nothing of the outage dropped or applied twice
    code, line = verify(out)
    assert code == 0, line


def test_past_its_budget_the_run_waits_with_one_line(tmp_path, base):
    out = tmp_path / "run"
    proc = procs.run(
        ["-m", "recsys", "train", *ONE, "--recovery", "log", "--train-through", "--through-budget-mb", "0.001"]
        + [*HELD, "--out", str(out)],
        timeout=300,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [x for x in proc.stderr.splitlines() if "passed --through-budget-mb" in x]
    assert len(lines) == 1 and "waiting for the restore of shards [1]" in lines[0], proc.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    f = outage(s)
    # over budget at the first step after the commit point that saw the failure (the step after the
    # failed write with write-behind): the run waited there
    waited_at = int(re.search(r"step (\d+): waiting", lines[0]).group(1))
    failed_at = f.get("write_step", f["step"])
    assert f["trained_through_steps"] == waited_at - failed_at <= 2, json.dumps(f)
    assert s["embedding_digest"] == base["embedding_digest"]


def test_a_second_shard_failing_during_the_outage(tmp_path, base):
    out = tmp_path / "run"
    s = train_cli(out, *ONE, "--recovery", "log", "--train-through", *HELD, "--inject", "shard:2@step=30")
    first, second = outage(s, 1), outage(s, 2)
    # shard 2's failure ended the first outage where it was seen: step 30, or with write-behind the
    # step of the write that saw it (29, where that write was still in flight at the kill)
    seen = second.get("write_step", second["step"])
    assert first["trained_through_steps"] == seen - first.get("write_step", first["step"]), json.dumps(first)
    assert second["step"] == 30 and seen in (29, 30) and second["trained_through_steps"] >= 1, json.dumps(second)
    assert s["embedding_digest"] == base["embedding_digest"]
    assert verify(out)[0] == 0
