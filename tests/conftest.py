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
