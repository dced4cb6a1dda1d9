"""One trainer's recovery, assembled from explicit settings: the manager and its parts, the
checkpointer, the injector. Nothing is wired after construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from embeddings import RedisStore
from embeddings.servers.launcher import ShardSpec
from recovery.durable import layout
from recovery.durable.checkpoint import Checkpointer
from recovery.durable.log import ShardLog
from recovery.inject import Injector
from recovery.interface import NoRecovery, Recovery
from recovery.manager import RecoveryManager
from recovery.protocol import Collective
from recovery.restore.trainer_restart import trim_kept
from recovery.saves.incremental import Flusher
from recovery.saves.priority import MFUTracker, PrioritySaver, SSUTracker
from recovery.strategy import Strategy


@dataclass(frozen=True)
class RecoverySettings:
    """A run's recovery settings (the CLI's ``--recovery``, ``--checkpoint-every``, ... flags; the
    defaults are ``recsys.config.RecoveryConfig``'s, which fills them)."""

    strategy: Strategy | str
    run_dir: Path
    checkpoint_dir: Path
    batch_size: int
    seed: int
    log_dir: Path | None = None
    injections: tuple = ()
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_abandoned_checkpoints: int = 3
    log_fsync: str = "always"
    mfu_capacity: int = 8192
    ssu_fraction: float = 0.05
    ssu_capacity: int = 8192
    priority_budget: int = 2000
    priority_half: bool = False
    shard_restart_timeout: float = 60.0
    replica_wait: bool = False
    write_behind: bool = False
    write_every: int = 1
    train_through: bool = False
    through_budget_mb: float = 1024.0


class RecoveryParts(NamedTuple):
    recovery: Recovery
    checkpointer: Checkpointer | None
    injector: Injector | None


def build_recovery(
    settings: RecoverySettings,
    store: RedisStore | None,
    specs: list[ShardSpec],
    collective: Collective,
    rank: int,
    *,
    drain: Callable[[], None] = lambda: None,
    committer_of: Callable[[int], Callable[[], None] | None] = lambda step: None,
    warn: Callable[[str], None] | None = None,
) -> RecoveryParts:
    """The recovery of one trainer over ``store`` (None: the local baseline, nothing to recover).
    ``drain``: drops prefetched rows after a restore; ``committer_of``: the dense state saver's
    commit (``DenseSaver.committer``); ``warn``: where an abandoned checkpoint's line goes."""
    if store is None:
        return RecoveryParts(NoRecovery(), None, None)
    rc, world, n = settings, collective.world_size, store.num_shards
    strategy = Strategy(rc.strategy)
    pidfiles = [s.pidfile for s in specs] if specs else [None] * n
    injector = Injector(
        list(rc.injections),
        rank,
        pidfiles,
        rc.run_dir,
        world,
        urls=store.urls,
        log_dir=rc.log_dir,
        dense_path=layout.dense_latest(rc.checkpoint_dir),
    )
    mine = {s for s in range(n) if s % world == rank}  # the shards this trainer writes
    logs = {s: ShardLog(rc.log_dir, s, rc.log_fsync) for s in sorted(mine)} if rc.log_dir else {}
    priority = flusher = None
    if strategy.priority_saves:
        tracker = (
            MFUTracker(store, rc.mfu_capacity, mine)
            if strategy is Strategy.PARTIAL_MFU
            else SSUTracker(store, rc.ssu_fraction, rc.ssu_capacity, rc.seed, mine)
        )
        priority = PrioritySaver(
            layout.priority_dir(rc.checkpoint_dir),
            store,
            tracker,
            rc.priority_budget,
            shards=mine,
            half=rc.priority_half,
        )
    if strategy.flushes:
        flusher = Flusher(layout.flush_dir(rc.checkpoint_dir), store, mine, half=rc.priority_half)
    ckpt = None
    if rc.checkpoint_every:
        log_dir = Path(rc.log_dir) if rc.log_dir else None
        ckpt = Checkpointer(
            rc.checkpoint_dir,
            rc.keep_checkpoints,
            [] if strategy.promotes else specs,  # after a failover a shard is served by its replica: over the network
            store,
            rank,
            collective.barrier,
            on_saved=lambda c: trim_kept(ckpt, log_dir, flusher, n),
            run=store.namespace,
            on_fork=lambda shard: injector.during("checkpoint"),
            warn=warn,
            max_abandoned=rc.max_abandoned_checkpoints,
        )
    manager = RecoveryManager(
        priority=priority,
        flusher=flusher,
        strategy=strategy,
        store=store,
        shards=specs,
        rank=rank,
        batch_size=rc.batch_size,
        collective=collective,
        checkpointer=ckpt,
        logs=logs,
        injector=injector,
        drain=drain,
        run_dir=rc.run_dir,
        log_dir=Path(rc.log_dir) if rc.log_dir else None,
        restart_timeout_s=rc.shard_restart_timeout,
        replica_wait=rc.replica_wait,
        write_behind=rc.write_behind and world == 1 and store.row_cache is not None,
        write_every=rc.write_every,
        committer_of=committer_of,
        train_through=rc.train_through,
        through_budget_bytes=int(rc.through_budget_mb * (1 << 20)),
        warn=warn or print,
    )
    return RecoveryParts(manager, ckpt, injector)
