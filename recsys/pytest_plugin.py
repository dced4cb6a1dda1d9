"""pytest plugin: fixtures to test the recovery of your own models (registered as ``recsys``
through the ``pytest11`` entry point; nothing to import).

- ``redis_servers``: factory, ``redis_servers(n, supervised=False, extra=())`` -> a started
  ``recsys.testing.RedisServers`` (kill, stall, restart, hold, release); stopped after the test,
  and the test fails if one of its processes is still alive then.
- ``failure_schedule``: an empty ``recsys.testing.FailureSchedule`` to fill
  (``failure_schedule.kill_shard(1, step=20)``), or draw one with ``FailureSchedule.drawn``.
- ``recsys_train``: ``recsys_train(name="run", **overrides)`` trains a small run (see
  ``recsys.testing.small_config``) in the test's temporary folder -> ``recsys.Run``.
- ``recsys_checks``: the assertions: ``same_embeddings(a, b)``, ``lost_at_most(run, pls)``,
  ``recovered(run, failures=, strategy=, within_s=)``.
"""

from __future__ import annotations

import types

import pytest


@pytest.fixture
def redis_servers(tmp_path):
    from recsys.testing import RedisServers

    started: list[RedisServers] = []

    def start(n: int = 3, *, supervised: bool = False, extra: tuple[str, ...] = (), delay_s: float = 0.3):
        servers = RedisServers(
            n, tmp_path / f"redis-servers-{len(started)}", supervised=supervised, extra=extra, delay_s=delay_s
        )
        started.append(servers)
        return servers

    yield start
    from embeddings.servers.launcher import process_state

    for s in started:
        s.close()
    leaked = [p for s in started for p in s.started_pids if process_state(p) not in (None, "Z")]
    assert not leaked, f"redis-server processes still running after the test: {leaked}"


@pytest.fixture
def failure_schedule():
    from recsys.testing import FailureSchedule

    return FailureSchedule()


@pytest.fixture
def recsys_train(tmp_path):
    from recsys.api import train
    from recsys.testing import small_config

    def run(name: str = "run", **overrides):
        return train(small_config(tmp_path / name, **overrides))

    return run


@pytest.fixture
def recsys_checks():
    from recsys import testing

    return types.SimpleNamespace(
        same_embeddings=testing.assert_same_embeddings,
        lost_at_most=testing.assert_lost_at_most,
        recovered=testing.assert_recovered,
    )
