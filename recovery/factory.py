"""One trainer's recovery, assembled from the run's config: the manager and its parts, the
checkpointer, the injector. Nothing is wired after construction."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from embeddings import RedisStore
from embeddings.servers.launcher import ShardSpec
from recovery.durable import layout
from recovery.durable.checkpoint import Checkpointer, CheckpointHooks
from recovery.durable.log import ShardLog
from recovery.inject import Injector
from recovery.interface import NoRecovery, Recovery
from recovery.manager import RecoveryManager
from recovery.protocol import Collective
from recovery.restore.trainer_restart import trim_kept
from recovery.saves.incremental import Flusher
from recovery.saves.priority import MFUTracker, PrioritySaver, SSUTracker
from recovery.strategy import Strategy

if TYPE_CHECKING:
    from recsys.config import RunConfig  # the user's config, read whole: recovery imports nothing of recsys


class RecoveryParts(NamedTuple):
    recovery: Recovery
    checkpointer: Checkpointer | None
    injector: Injector | None


def build_recovery(
    cfg: RunConfig,
    store: RedisStore | None,
    specs: list[ShardSpec],
    collective: Collective,
    rank: int,
    *,
    drain: Callable[[], None] = lambda: None,
    committer_of: Callable[[int], Callable[[], None] | None] = lambda step: None,
    warn: Callable[[str], None] | None = None,
    trainer_index: int | None = None,
) -> RecoveryParts:
    """The recovery of one trainer over ``store`` (None: the local baseline) from the run's config,
    read where it is declared. ``drain``: drops prefetched rows after a restore; ``committer_of``:
    the dense state saver's commit; ``warn``: where an abandoned checkpoint's line goes;
    ``trainer_index``: the trainer ``trainer:R`` names under ``--trainer-recovery replace``."""
    if store is None:
        return RecoveryParts(NoRecovery(), None, None)
    rc, world, n = cfg.recovery, collective.world_size, store.num_shards
    strategy = Strategy(rc.recovery)
    log_dir = Path(cfg.log_dir) if cfg.log_dir else None
    injector = _injector(cfg, rank, world, store, specs, trainer_index)
    mine = {s for s in range(n) if s % world == rank}  # the shards this trainer writes
    logs = {s: ShardLog(log_dir, s, rc.log_fsync) for s in sorted(mine)} if log_dir else {}
    priority, flusher = row_savers(cfg, store, strategy, mine)
    ckpt = None
    if rc.checkpoint_every:
        hooks = CheckpointHooks(
            collective.barrier,
            on_saved=lambda c: trim_kept(ckpt, log_dir, flusher, n),
            on_fork=lambda shard: injector.during("checkpoint"),
            warn=warn,
        )
        # after a failover a shard is served by its replica: its snapshot over the network
        shards = [] if strategy.promotes else specs
        ckpt = Checkpointer(
            cfg.checkpoint_dir,
            rc.keep_checkpoints,
            shards,
            store,
            rank,
            hooks,
            store.namespace,
            rc.max_abandoned_checkpoints,
        )
    behind = cfg.embeddings.write_behind and writes_behind(cfg, store, collective, mine)
    manager = RecoveryManager(
        priority=priority,
        flusher=flusher,
        strategy=strategy,
        store=store,
        shards=specs,
        rank=rank,
        batch_size=cfg.train.batch_size,
        collective=collective,
        checkpointer=ckpt,
        logs=logs,
        injector=injector,
        drain=drain,
        run_dir=Path(cfg.train.out),
        log_dir=log_dir,
        restart_timeout_s=rc.shard_restart_timeout,
        replica_wait=cfg.embeddings.replica_wait,
        write_behind=behind,
        lockstep=world > 1 and behind,
        write_every=cfg.window_steps,
        committer_of=committer_of,
        train_through=rc.train_through,
        through_budget_bytes=int(rc.through_budget_mb * (1 << 20)),
        warn=warn or print,
    )
    manager.journal.trainer_recovery = "replace" if trainer_index is not None else "restart"
    if trainer_index is not None and cfg.train.dense_reduce == "allreduce":  # a dead trainer's chunk waits for it
        manager.journal.chunk_skipped = cfg.train.batch_size // (cfg.train.chunks or cfg.train.trainers)
    return RecoveryParts(manager, ckpt, injector)


def writes_behind(cfg: RunConfig, store: RedisStore, collective: Collective, mine: set[int]) -> bool:
    """Whether the trainers write behind. One trainer: where it holds rows. Several: only in windows
    (``--write-every`` > 1), without ``--prefetch``, and where every trainer holds its own shards'
    rows and every row of the others' (peer rows, ``embeddings.peer_rows``): no step reads another
    trainer's shard, so a window still open elsewhere is never read behind its writer's back. The
    trainers agree (one collective): their windows close together (``CommitPoints.commit_behind``)."""
    held = store.row_cache
    if cfg.train.trainers == 1:
        return held is not None
    if collective.world_size == 1:  # a quorum down to one writes every step until the others are back
        return False
    peers = store.peer_rows
    ok = (
        cfg.window_steps > 1
        and not cfg.embeddings.prefetch
        and (not mine or (held is not None and held.holds_all()))
        and peers is not None
        and peers.holds_everything()
    )
    return not collective.max_flags(np.array([0 if ok else 1], np.int64))[0]


def _injector(cfg: RunConfig, rank: int, world: int, store: RedisStore, specs, trainer_index: int | None) -> Injector:
    """The injector of this trainer's ``--inject`` failures (``trainer_index``: see ``build_recovery``)."""
    injector = Injector(
        list(cfg.recovery.injections),
        rank,
        [s.pidfile for s in specs] if specs else [None] * store.num_shards,
        Path(cfg.train.out),
        cfg.train.trainers if trainer_index is not None else world,
        urls=store.urls,
        log_dir=cfg.log_dir or None,
        dense_path=layout.dense_latest(cfg.checkpoint_dir),
    )
    injector.index = rank if trainer_index is None else trainer_index
    return injector


def row_savers(
    cfg: RunConfig, store: RedisStore, strategy: Strategy, mine: set[int]
) -> tuple[PrioritySaver | None, Flusher | None]:
    """The saves between checkpoints of this trainer's shards (``mine``) its strategy takes: CPR's
    priority saves (``partial-mfu``, ``partial-ssu``), or incremental flushes."""
    rc = cfg.recovery
    priority = flusher = None
    if strategy.priority_saves:
        tracker = (
            MFUTracker(store, rc.mfu_capacity, mine)
            if strategy is Strategy.PARTIAL_MFU
            else SSUTracker(store, rc.ssu_fraction, rc.ssu_capacity, cfg.train.seed, mine)
        )
        priority = PrioritySaver(
            layout.priority_dir(cfg.checkpoint_dir),
            store,
            tracker,
            rc.priority_budget,
            shards=mine,
            half=rc.priority_half,
        )
    if strategy.flushes:
        flusher = Flusher(layout.flush_dir(cfg.checkpoint_dir), store, mine, half=rc.priority_half)
    return priority, flusher
