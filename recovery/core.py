"""What every recovery path of one trainer shares (``RecoveryCore``): built once by the recovery
manager and handed whole to the trainer restarts and to training through a failure."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from embeddings import RedisStore
    from recovery.accounting import Ledger
    from recovery.journal import Journal
    from recovery.protocol import Collective, Detector
    from recovery.restore.shard_restore import ShardRestore
    from recovery.writer import SparseWriter


class RecoveryCore(NamedTuple):
    store: RedisStore
    rank: int
    collective: Collective  # the trainers' group as recovery sees it
    detector: Detector  # failures seen, as state, until a commit point decides on them
    writer: SparseWriter  # the sparse write path: rows, logs, replicas, write-behind
    ledger: Ledger  # lost updates and samples
    journal: Journal  # failure records and the recovery log
    shard_restore: ShardRestore  # what every shard restore needs (checkpoint, logs, servers)
