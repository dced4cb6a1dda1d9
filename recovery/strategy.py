"""The shard-failure strategies, one type for the config, the CLI, the manager and the benchmark."""

from __future__ import annotations

from enum import StrEnum


class Strategy(StrEnum):
    FULL = "full"
    """Every shard back to the checkpoint; dense state and readers roll back and recompute."""
    PARTIAL = "partial"
    """CPR: only the failed shard back to its checkpoint; its updates since are lost and counted."""
    PARTIAL_MFU = "partial-mfu"
    """partial, plus priority saves of each shard's most frequently updated rows."""
    PARTIAL_SSU = "partial-ssu"
    """partial, plus priority saves of sub-sampled updated rows (bounded memory)."""
    INCREMENTAL = "incremental"
    """partial, plus incremental flushes (each dirty row once per flush): only updates since the last flush are lost."""
    LOG = "log"
    """partial, then the shard's update log is replayed: nothing lost."""
    REPLICA = "replica"
    """The shard's replica is promoted; nothing is loaded. Updates it had not received are lost and counted."""

    @classmethod
    def parse(cls, value: str, where: str = "recovery") -> Strategy:
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{where}={value!r}: must be one of {', '.join(s.value for s in cls)}") from None

    @property
    def rolls_back(self) -> bool:
        return self is Strategy.FULL

    @property
    def priority_saves(self) -> bool:
        return self in (Strategy.PARTIAL_MFU, Strategy.PARTIAL_SSU)

    @property
    def flushes(self) -> bool:
        return self is Strategy.INCREMENTAL

    @property
    def replays_log(self) -> bool:
        return self is Strategy.LOG

    @property
    def promotes(self) -> bool:
        return self is Strategy.REPLICA
