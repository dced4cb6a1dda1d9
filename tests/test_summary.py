"""The run summary's parts that need no run: the throughput after the warm-up, and the store
counters it reads, which every store keeps (``embeddings.store.base.StoreCounters``)."""

import numpy as np
import torch

from embeddings import SGD, InProcessStore, TableSet, TableSpec, rowkeys
from recsys.backends import Backend, LocalBackend
from recsys.results.summary import after_warmup
from tests import procs


def test_throughput_after_warmup_counts_only_the_steps_after_it():
    assert after_warmup(None, 20, 128, 5.0) is None  # the run ended within its warm-up
    assert after_warmup((20, 1.0), 20, 128, 5.0) is None  # no step after it
    assert after_warmup((10, 1.0), 20, 128, 3.0) == 10 * 128 / 2.0


def test_the_in_process_store_keeps_the_counters_a_summary_reads():
    store = InProcessStore(TableSet([TableSpec("a", 100, 4), TableSpec("b", 50, 4)]), SGD(lr=0.1))
    assert store.row_cache is None and store.behind_wait_s == 0.0 and store.reload_s == 0.0
    assert (store.reload_kept, store.reload_absent, store.reload_read, store.rows_written) == (0, 0, 0, 0)
    keys = np.concatenate([rowkeys.pack(0, np.array([1, 5, 9])), rowkeys.pack(1, np.array([2, 3]))])
    store.apply_keys(keys, torch.ones((len(keys), 4)), step=1)
    assert store.rows_written == 5 and store.applied_step == 1


def test_the_local_baseline_is_a_backend_without_a_store():
    assert issubclass(LocalBackend, Backend) and LocalBackend.store is None


def test_tables_over_digest_max_rows_end_without_a_digest_and_say_so(tmp_path):
    """The digest reads every row at the end: tables over --digest-max-rows skip it, null in
    summary.json with one line, and two such runs are never called the same."""
    import json

    import pytest

    from recsys.api import load_run
    from recsys.testing import assert_same_embeddings

    flags = ["--steps", "4", "--rows-per-table", "100", "--embedding-dim", "4", "--batch-size", "64"]
    flags += ["--trainers", "1", "--shards", "1", "--eval-samples", "256", "--digest-max-rows", "2599"]
    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(tmp_path / "a")], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "embedding_digest skipped: the tables hold 2,600 rows, over --digest-max-rows 2,599" in proc.stderr
    assert json.loads((tmp_path / "a" / "summary.json").read_text())["embedding_digest"] is None
    run = load_run(tmp_path / "a")
    with pytest.raises(AssertionError, match="no embedding digest"):
        assert_same_embeddings(run, run)


def test_a_run_folder_is_read_where_it_lies_and_names_the_folders_outside_it(tmp_path):
    """``config.toml`` records the run's folders absolute; read back from another place, the folders
    that lay inside the run's are taken inside the folder given, those outside it are kept and named."""
    from recovery.durable import layout
    from recsys.config import RunConfig
    from recsys.results.outputs import recorded
    from recsys.results.rundir import outside_paths, run_config

    was, elsewhere = tmp_path / "was", tmp_path / "elsewhere-logs"
    folders = {"recovery": "log", "checkpoint_dir": str(was / "ck"), "log_dir": str(elsewhere)}
    cfg = RunConfig.from_dict({"train": {"out": str(was)}, "recovery": folders})
    was.mkdir()
    layout.config_file(was).write_text(recorded(cfg).to_toml())
    now = tmp_path / "moved"
    was.rename(now)
    got = run_config(now, "verify")
    assert got.train.out == str(now) and got.checkpoint_dir == str(now / "ck") and got.log_dir == str(elsewhere)
    (line,) = outside_paths(got, "verify")
    assert line.startswith(f"verify: reads --log-dir {elsewhere}, outside the run folder {now}"), line
    default = run_config(now)  # the default folders follow the run's folder
    assert layout.config_file(now).read_text().count(str(was)) == 2 and default.train.out == str(now)


def _burn(seconds: float) -> None:
    import time

    t = time.thread_time()
    while time.thread_time() - t < seconds:
        pass


def test_process_cpu_splits_this_process_by_thread_and_counts_a_server_by_its_pid():
    """``summary.json``'s ``cpu_ms``: the main thread as the training thread, every other thread of
    the process by kind, and other processes (the local servers) by pid, each counted on a CPU only
    between the two snapshots; a thread that ended meanwhile is not counted."""
    import subprocess
    import sys
    import threading

    from recsys.clock import cpu_between, process_cpu

    burn = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\nprint('done', flush=True)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", burn + "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    burnt, release = threading.Event(), threading.Event()

    def live() -> None:
        _burn(0.15)
        burnt.set()
        release.wait(30)

    try:
        first = process_cpu([child.pid])
        assert first is not None and any(key[0] == child.pid for key in first)
        _burn(0.2)  # the main thread: the training thread
        ended = threading.Thread(target=_burn, args=(0.2,))
        ended.start()
        ended.join()
        alive = threading.Thread(target=live)
        alive.start()
        assert burnt.wait(30) and child.stdout.readline() == "done\n"
        last = process_cpu([child.pid])
    finally:
        release.set()
        child.kill()
        child.wait()
    ms = cpu_between(first, last, steps=10)
    assert ms is not None
    assert 18 <= ms["training"] <= 40  # 0.2 s over 10 steps
    assert 13 <= ms["helpers"] <= 40  # the live thread's 0.15 s; not the ended one's
    assert 25 <= ms["servers"] <= 60  # the child's 0.3 s (and its start), all after the first snapshot
    assert ms["gloo"] < 1 and ms["torchft"] < 1
    assert cpu_between(first, process_cpu(), steps=10)["servers"] is None  # no server counted: not zero
    assert cpu_between(None, last, steps=10) is None
