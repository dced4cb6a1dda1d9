import os
import uuid

import pytest

# before any test module imports torch: an in-process run (recsys.train in a test) forks its trainers,
# as the command line does, only while torch was first imported through recsys.launch and no parallel
# tensor op has run in the process since (recsys/launch.py); spawned, each trainer imports torch and
# torchrec again (about 4 s of CPU, twice per run). Collecting the test modules imports torch.
import recsys.launch  # noqa: F401
from embeddings.servers.launcher import LocalShards, process_state

_STARTED_PIDS: set[int] = set()


def _pid_alive(pid: int) -> bool:
    return process_state(pid) not in (None, "Z")


@pytest.fixture(scope="session")
def shards3():
    with LocalShards(3) as shards:
        _STARTED_PIDS.update(shards.pids)
        yield shards
    assert not [p for p in _STARTED_PIDS if _pid_alive(p)]


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:12]


def track(shards: LocalShards) -> None:
    _STARTED_PIDS.update(shards.pids)


# the tier of each test file (pyproject.toml registers the markers): `make test-fast` runs unit and
# redis, `make test` everything
TIERS = {
    "unit": {
        "test_log_coverage",
        "test_planner",
        "test_shard_map",
        "test_module",
        "test_data",
        "test_groups",
        "test_protocol",
        "test_summary",
        "test_row_cache",
        "test_ebc_equivalence",
        "test_ebc_surface",
        "test_outage",
        "test_house",
    },
    "redis": {
        "test_ebc_equivalence_redis",
        "test_keys",
        "test_store",
        "test_recovery_parts",
        "test_launcher",
        "test_redis_misuse",
        "test_layout",
        "test_restore_wire",
    },
    "chaos": {"test_chaos"},
    "cluster": {"test_remote"},
}


# `make test` runs the suite on 2 pytest-xdist workers, a test file at a time (--dist loadfile: a
# file's module-scoped baselines are made once, on one worker). The workers take the files longest
# first, in this order (each file's seconds under `make test`, 2026-12-07: 160, 133, 95, 94, 86, 71,
# then under a minute each); the others follow. A long file left off the list runs last and
# lengthens the suite by its own time.
SLOWEST_FIRST = [
    "test_failures",
    "test_chaos",
    "test_remote",
    "test_replace",
    "test_damaged_state",
    "test_export",
    "test_windows_groups",
    "test_train_through",
    "test_train_through_groups",
    "test_stragglers",
    "test_ownership",
    "test_plugin",
    "test_examples",
    "test_bench_recovery",
    "test_trainer",
    "test_errors",
    "test_chunks",
    "test_peer_rows",
    "test_dcn",
    "test_rows_tensor",
    "test_processes_disk",
    "test_launcher",
    "test_stragglers",
]


def _module(item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1]


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = next((t for t, files in TIERS.items() if _module(item) in files), "integration")
        item.add_marker(getattr(pytest.mark, tier))
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts alike: the order the files are handed out
        rank = {m: i for i, m in enumerate(SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(_module(item), len(rank)))


def pytest_sessionfinish(session, exitstatus):
    leaked = [p for p in _STARTED_PIDS if _pid_alive(p)]
    for p in leaked:
        os.kill(p, 9)
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: its exit status is not the run's, the controller reports
        workeroutput["leaked_redis_servers"] = leaked
        return
    leaked += _LEAKED_ON_WORKERS
    if leaked:
        session.exitstatus = 1
        print(f"\nLEAKED redis-server processes: {leaked}")


_LEAKED_ON_WORKERS: list[int] = []


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """The controller of an xdist run collects what each worker found leaked."""
    _LEAKED_ON_WORKERS.extend(getattr(node, "workeroutput", {}).get("leaked_redis_servers", []))


def train_cli(out, *flags: str, timeout: float = 300) -> dict:
    """``python -m recsys train FLAGS --out OUT`` as a user runs it; asserts it ended well, no traceback
    on the terminal; returns the run's summary.json."""
    import json
    from pathlib import Path

    from tests import procs

    proc = procs.run(["-m", "recsys", "train", *flags, "--out", str(out)], timeout=timeout)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads((Path(out) / "summary.json").read_text())
