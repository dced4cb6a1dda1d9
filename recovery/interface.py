"""What a trainer needs of recovery: one ``typing.Protocol``, met by ``RecoveryManager`` (the Redis
tier) and by ``NoRecovery`` (the local baseline, whose store calls cannot fail). A type checker
verifies both (the assignments at the end; ``make test`` runs mypy as ``pyproject.toml`` sets it),
and ``tests/test_protocol.py`` compares their signatures."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from recovery.accounting import UpdateCounter
from recovery.manager import BackgroundWrites, RecoveryManager
from recovery.protocol import CONTINUE, Outcome
from recovery.saves.row_saves import RowSaves


class Recovery(Protocol):
    @property
    def failures(self) -> list[dict]: ...
    @property
    def lost(self) -> list[float]: ...
    @property
    def window_steps(self) -> int: ...

    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]: ...
    def run_phase(
        self, step: int, phase: str, fn: Callable[[tuple[int, ...] | None], object], after: Outcome | None = None
    ) -> Outcome: ...
    def commit_behind(self, now: int, reads: bool = False) -> Outcome: ...
    def apply(self, owned, step: int, only=None, behind: bool = False, durable=None) -> None: ...
    def count_updates(self, updated, step: int | None = None) -> None: ...

    saves: RowSaves  # priority saves, flushes, what a checkpoint closes

    def latest_shard_file(self, shard: int) -> Path | None: ...
    def wait_background(self) -> BackgroundWrites: ...
    def summary_failures(self, last_step: int) -> list[dict]: ...
    def on_rollback(self, to_step: int) -> None: ...
    def fresh_start(self, t_restart: float | None = None) -> None: ...
    def resume(self, step: int, t_restart: float, restored_bytes: int, rebuild: bool = False) -> Outcome: ...
    def state(self) -> dict: ...
    def load_state(self, state: dict) -> None: ...
    def close(self, settle: bool = False) -> None: ...
    def poll_outage(self, step: int) -> None: ...
    @property
    def outage_active(self) -> bool: ...
    def end_outage(self, step: int, why: str | None = None) -> None: ...


class NoRecovery:
    """The local baseline has no shards: store calls cannot fail, and nothing is recovered."""

    def __init__(self) -> None:
        self.saves = RowSaves(UpdateCounter(0), None, None, {})  # nothing to save: each call a no-op

    @property
    def failures(self) -> list[dict]:
        return []

    @property
    def lost(self) -> list[float]:
        return []

    @property
    def window_steps(self) -> int:
        return 1

    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]:
        return True, fn()

    def run_phase(
        self, step: int, phase: str, fn: Callable[[tuple[int, ...] | None], object], after: Outcome | None = None
    ) -> Outcome:
        fn(None)
        return CONTINUE

    def commit_behind(self, now: int, reads: bool = False) -> Outcome:
        return CONTINUE

    def apply(self, owned, step: int, only=None, behind: bool = False, durable=None) -> None:
        raise TypeError("the local baseline has no tier to write rows to")

    def count_updates(self, updated, step: int | None = None) -> None:
        pass

    def latest_shard_file(self, shard: int) -> Path | None:
        return None

    def wait_background(self) -> BackgroundWrites:
        return BackgroundWrites()

    def summary_failures(self, last_step: int) -> list[dict]:
        return []

    def on_rollback(self, to_step: int) -> None:
        pass

    def fresh_start(self, t_restart: float | None = None) -> None:
        pass

    def resume(self, step: int, t_restart: float, restored_bytes: int, rebuild: bool = False) -> Outcome:
        return CONTINUE

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def close(self, settle: bool = False) -> None:
        pass

    def poll_outage(self, step: int) -> None:
        pass

    @property
    def outage_active(self) -> bool:
        return False

    def end_outage(self, step: int, why: str | None = None) -> None:
        pass


# checked by a type checker: both meet the protocol
_MANAGER: type[Recovery] = RecoveryManager
_NONE: type[Recovery] = NoRecovery
