import os
import uuid

import pytest

from embeddings.launcher import LocalShards, process_state

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
    },
    "redis": {
        "test_ebc_equivalence_redis",
        "test_keys",
        "test_store",
        "test_recovery_parts",
        "test_launcher",
        "test_redis_misuse",
        "test_layout",
    },
    "chaos": {"test_chaos"},
    "cluster": {"test_remote"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        tier = next((t for t, files in TIERS.items() if module in files), "integration")
        item.add_marker(getattr(pytest.mark, tier))


def pytest_sessionfinish(session, exitstatus):
    leaked = [p for p in _STARTED_PIDS if _pid_alive(p)]
    if leaked:
        session.exitstatus = 1
        print(f"\nLEAKED redis-server processes: {leaked}")
        for p in leaked:
            os.kill(p, 9)


def train_cli(out, *flags: str, timeout: float = 300) -> dict:
    """``python -m recsys train FLAGS --out OUT`` as a user runs it; asserts it ended well, no traceback
    on the terminal; returns the run's summary.json."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run(
        [sys.executable, "-m", "recsys", "train", *flags, "--out", str(out)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return json.loads((Path(out) / "summary.json").read_text())
