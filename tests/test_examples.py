"""The README's Python example, the example scripts and ``recsys compare``, run as a user runs them."""

import json
import logging
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests import procs

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "criteo_kaggle_sample.tsv"


def run(args: list[str], cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = procs.run(args, cwd=cwd, timeout=timeout)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(r"<!-- readme-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md lost its marked Python example"
    return m.group(1)


def test_the_readme_example_runs_as_written(tmp_path):
    (tmp_path / "example.py").write_text(readme_example())
    proc = run(["example.py"], cwd=tmp_path)
    summary = json.loads((tmp_path / "runs" / "example-mfu" / "summary.json").read_text())
    (f,) = summary["failures"]
    assert f["target"] == 1 and f["step"] == 60 and f["strategy"] == "partial-mfu"
    assert "shard 1 failed at step 60" in proc.stdout and "AUC" in proc.stdout
    assert (tmp_path / "runs" / "example-compare" / "compare.png").stat().st_size > 0
    md = (tmp_path / "runs" / "example-compare" / "compare.md").read_text()
    assert "example-reference" in md and "example-mfu" in md


def test_train_criteo_script_on_the_kaggle_sample_with_two_trainers(tmp_path):
    out = tmp_path / "criteo"
    proc = run(
        [
            str(ROOT / "scripts" / "train_criteo.py"),
            "--data",
            str(SAMPLE),
            "--trainers",
            "2",
            "--shards",
            "2",
            "--steps",
            "6",
            "--batch-size",
            "16",
            "--rows-per-table",
            "500",
            "--eval-samples",
            "14",
            "--set",
            "embedding_dim=8",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    s = json.loads((out / "summary.json").read_text())
    assert s["trainers"] == 2 and s["shards"] == 2 and s["steps_completed"] == 6
    assert 0.0 <= s["final_auc"] <= 1.0 and (out / "criteo-npy" / "kaggle_labels.npy").exists()
    assert "6 steps x 16 on 2 trainers and 2 shards" in proc.stdout


def test_failure_drill_prints_what_each_strategy_cost(tmp_path):
    out = tmp_path / "drill"
    proc = run(
        [
            str(ROOT / "scripts" / "failure_drill.py"),
            "--fail",
            "shard:1@step=30",
            "--strategies",
            "partial,log",
            "--steps",
            "40",
            "--batch-size",
            "256",
            "--shards",
            "3",
            "--rows-per-table",
            "2000",
            "--embedding-dim",
            "8",
            "--eval-samples",
            "2048",
            "--checkpoint-every",
            "20",
            "--out",
            str(out),
        ],
        cwd=tmp_path,
    )
    table = (out / "drill.md").read_text()
    assert table in proc.stdout.replace("\r", "") or "| partial |" in proc.stdout
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table.splitlines()[4:]}
    assert set(rows) == {"partial", "log"}
    # columns: failures, failure_s, lost_updates, pls, auc_change, wall_vs_reference_pct, exact
    assert rows["log"][0] == "1" and rows["log"][2] == "0" and rows["log"][6] == "True"
    assert rows["partial"][0] == "1" and int(rows["partial"][2]) > 0 and rows["partial"][6] == "False"
    assert (out / "compare.png").stat().st_size > 0


def test_compare_two_runs_writes_its_table_and_plot(tmp_path):
    import recsys
    from recsys.testing import small_config

    env, level = dict(os.environ), logging.getLogger("torch.distributed.elastic").level
    a = recsys.train(small_config(tmp_path / "a"))
    # the launch's settings do not stay in the user's process
    assert dict(os.environ) == env and logging.getLogger("torch.distributed.elastic").level == level
    # killed after the window that closed at step 32 reached it: met when the end closes the next one,
    # and restored to checkpoint 20, it loses steps 21-32 (the open window's steps are redone)
    b = recsys.train(small_config(tmp_path / "b", recovery="partial", checkpoint_every=20, inject=["shard:2@step=35"]))
    proc = run(["-m", "recsys", "compare", str(a.path), str(b.path), "--out", str(tmp_path / "cmp")], cwd=ROOT)
    md = (tmp_path / "cmp" / "compare.md").read_text()
    assert "wrote" in proc.stdout and (tmp_path / "cmp" / "compare.png").stat().st_size > 0
    lines = [x for x in md.splitlines() if x.startswith("| a ") or x.startswith("| b ")]
    assert len(lines) == 2
    cells = dict(zip(["a", "b"], ([c.strip() for c in x.split("|")[1:-1]] for x in lines)))
    # run, recovery, steps, wall_s, samples_per_s, final_auc, auc_change, final_logloss, pls, failures, ...
    assert cells["a"][9] == "0" and cells["b"][9] == "1" and float(cells["b"][8]) > 0
    assert cells["a"][-1] == "True" and cells["b"][-1] == "False"
    # ..., lost_updates, rows_read_stale, recovery_s, waited_s (every trainer waited for the restore), trained_through
    assert cells["b"][11] == "0"  # a waiting restore reads no row stale
    assert float(cells["b"][13]) > 0 and cells["b"][14] == "0" and float(cells["a"][13]) == 0
    f = recsys.load_run(b.path).summary.failures[0]
    assert f.target == 2 and f.phases_s["start"] > 0 and 0 <= f.failed_call_s <= f.detected_after_s
    # a folder that is not a run is named
    bad = procs.run(["-m", "recsys", "compare", str(a.path), str(tmp_path)])
    assert bad.returncode == 2 and "not a run folder" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("bad", [{"stepz": 3}, {"steps": 0}])
def test_configure_names_a_bad_key_or_value(bad):
    import recsys

    with pytest.raises(recsys.ConfigError, match="stepz|steps"):
        recsys.configure(**bad)
