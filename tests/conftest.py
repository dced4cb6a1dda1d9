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
