"""The recovery manager: the one object a trainer talks to; every store call of a run goes through it.

A façade over the parts of ``recovery``, each in its own module:
- ``protocol``: failures recorded as state (``Detector.guard``), commit points (``CommitPoints``)
  where all trainers agree on the failed shards, and rank 0's ``Verdict`` turned into one
  ``Outcome``: continue, retry the phase on these shards, or roll back to step N;
- ``writer``: the sparse write path (row optimizer, shards, logs, replicas; write-behind, windows);
- ``restorers``: one restorer per strategy (rank 0), on the tools of ``restore``;
- ``accounting``: what each restore loses (``Ledger``); ``journal``: the failure records;
- ``restart``: fresh starts, trainer restarts, and which logs, saves and flushes are kept.

A step's data flows trainer -> ``SparseWriter`` -> store; the protocol sits above it. A recovery
runs on every trainer at once: all wait for background writes (``settle``), rank 0 restores, every
trainer learns its verdict, reconnects (or fails over) to the recovered shards, and holds their rows
again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from embeddings import RedisStore, rowkeys
from embeddings.servers.launcher import ShardSpec
from recovery.accounting import Ledger, UpdateCounter
from recovery.core import RecoveryCore
from recovery.durable.checkpoint import Checkpointer
from recovery.durable.log import ShardLog
from recovery.errors import PeerError
from recovery.inject import Injector
from recovery.journal import Journal
from recovery.protocol import Collective, CommitPoints, Detector, Outcome, Verdict
from recovery.restore.shard_restore import ShardRestore
from recovery.restore.strategies import RESTORERS, Full
from recovery.restore.through import THROUGH_PHASES, TrainThrough
from recovery.restore.trainer_restart import Restarts
from recovery.saves.incremental import Flusher
from recovery.saves.priority import PrioritySaver
from recovery.saves.row_saves import RowSaves
from recovery.strategy import Strategy
from recovery.writer import SparseWriter

STRATEGIES = tuple(s.value for s in Strategy)


class BackgroundWrites(NamedTuple):
    """What one trainer's background writers wrote (logs, priority saves, flushes)."""

    log_bytes: int = 0
    log_s: float = 0.0
    log_behind_s: float = 0.0
    log_background_s: float = 0.0
    priority_bytes: int = 0
    flush_bytes: int = 0


@dataclass
class RecoveryManager:
    strategy: Strategy | str
    store: RedisStore
    shards: list[ShardSpec]
    rank: int
    batch_size: int
    collective: Collective
    checkpointer: Checkpointer | None = None
    logs: dict[int, ShardLog] = field(default_factory=dict)  # shards this trainer writes
    injector: Injector | None = None
    drain: Callable[[], None] = lambda: None  # drop prefetched rows after a restore
    counter: UpdateCounter | None = None
    priority: PrioritySaver | None = None  # of this writer's shards (partial-mfu / partial-ssu)
    flusher: Flusher | None = None  # of this writer's shards (incremental)
    run_dir: Path | None = None  # where restart markers live
    log_dir: Path | None = None  # every shard's logs (rank 0 replays and trims them)
    restart_timeout_s: float = 60.0  # how long a remote shard's supervisor has to bring it back
    replica_wait: bool = False  # writers wait until replicas acknowledged each step's writes
    write_behind: bool = False  # a step's write runs on the store's write-behind thread (one trainer)
    write_every: int = 1  # with write_behind and every table held: rows reach the shards once per window
    lockstep: bool = False  # several trainers write behind: their windows close together (``SparseWriter``)
    # step -> a wait that makes the dense state saved at ``step`` the restart point (or None): a
    # window's write runs it before its rows move (``DenseSaver.committer``)
    committer_of: Callable[[int], Callable[[], None] | None] = lambda step: None
    train_through: bool = False  # a failed shard is restored in the background (``recovery.restore.through``)
    through_budget_bytes: int = 1 << 30  # what one trainer's outage rows and kept gradients may take
    warn: Callable[[str], None] = print  # where a line for the person at the terminal goes

    def __post_init__(self) -> None:
        try:
            self.strategy = Strategy(self.strategy)
        except ValueError:
            raise ValueError(f"recovery strategy {self.strategy!r} must be one of {STRATEGIES}") from None
        n = self.store.num_shards
        if self.log_dir is None and self.logs:
            self.log_dir = next(iter(self.logs.values())).dir.parent
        self.detector = Detector(n, self.collective)
        self.journal = Journal(self.run_dir, self.rank)
        self.writer = SparseWriter(
            self.store,
            self.detector,
            self.logs,
            self.replica_wait,
            self.write_behind,
            self.write_every,
            self.committer_of,
            self.lockstep,
        )
        windowed = self.writer.window is not None
        self.ledger = Ledger(n, self.batch_size, self.counter, recent=self.strategy.promotes, windowed=windowed)
        self.counter = self.ledger.counter
        # priority saves, flushes and what a checkpoint closes: ``mgr.saves.on_checkpoint(step)``, ...
        self.saves = RowSaves(self.counter, self.priority, self.flusher, self.logs)
        self.shard_restore = ShardRestore(
            self.store,
            self.strategy,
            self.detector,
            self.shards,
            self.checkpointer,
            self.injector,
            self.run_dir,
            self.restart_timeout_s,
        )
        parts = (self.shard_restore, self.ledger, self.writer, self.journal, self.priority, self.flusher, self.log_dir)
        self.restorer = RESTORERS[self.strategy](*parts)
        self.rebuilder = Full(*parts)
        self.rebuilder.rebuild = True
        self.points = CommitPoints(self.detector, self.writer, self.recover_outcome, self.journal.note)
        core = RecoveryCore(
            self.store,
            self.rank,
            self.collective,
            self.detector,
            self.writer,
            self.ledger,
            self.journal,
            self.shard_restore,
        )
        self.restarts = Restarts(core, self.log_dir, self.priority, self.flusher, self.checkpointer, self.injector)
        self.through = (
            TrainThrough(
                core,
                self.strategy,
                lambda ledger, journal: RESTORERS[self.strategy](
                    self.shard_restore, ledger, self.writer, journal, self.priority, self.flusher, self.log_dir
                ),
                self.through_budget_bytes,
                self.warn,
                self.drain,
            )
            if self.train_through
            else None
        )
        self._restored: dict[int, tuple[int, int]] = {}  # shard -> (restored from, newest step restored)
        self._rebuild = False  # resume from a checkpoint's dense state: every shard restored from it

    @property
    def failures(self) -> list[dict]:
        return self.journal.failures

    @property
    def lost(self) -> list[float]:
        return self.ledger.lost

    def close(self, settle: bool = False) -> None:
        """``settle``: background work that writes the shards (a checkpoint's copy, a restore trained
        through) ends first: this trainer's process builds another (``--trainer-recovery replace``)."""
        if settle and self.checkpointer is not None:
            self.checkpointer.settle()
        if settle and self.through is not None:
            self.through.settle()
        self.writer.close()
        for w in (self.priority, self.flusher, *self.logs.values()):
            if w is not None:
                w.close()

    def wait_background(self) -> BackgroundWrites:
        """This trainer's background writes are on disk; -> what they wrote."""
        for w in (self.priority, self.flusher, *self.logs.values()):
            if w is not None:
                w.wait()
        logs = self.logs.values()
        return BackgroundWrites(
            sum(x.bytes_written for x in logs),
            sum(x.seconds for x in logs),
            sum(x.behind_seconds for x in logs),
            sum(x.background_seconds for x in logs),
            self.priority.bytes_written if self.priority is not None else 0,
            self.flusher.bytes_written if self.flusher is not None else 0,
        )

    # -- the commit protocol (``recovery.protocol``) -------------------------------------------
    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]:
        return self.detector.guard(fn)

    def detected(self, shard: int, at: float) -> None:
        """A failure of ``shard`` seen at ``at`` (``time.time()``) by a caller outside the protocol
        (the recovery benchmark kills a shard and recovers it directly): its record times from there."""
        self.detector.detected_at[shard] = at

    def commit(self, step: int, phase: str) -> Outcome:
        return self.points.commit(step, phase)

    def run_phase(
        self, step: int, phase: str, fn: Callable[[tuple[int, ...] | None], object], after: Outcome | None = None
    ) -> Outcome:
        """``CommitPoints.run_phase``; a stage whose commit point rode in the dense gather:
        ``points.stage_ahead``, ``take_flags``, ``commit_agreed``."""
        return self.points.run_phase(step, phase, fn, after)

    def commit_behind(self, now: int, reads: bool = False) -> Outcome:
        return self.points.commit_behind(now, reads)

    @property
    def window_steps(self) -> int:
        return self.writer.window_steps

    # -- the write path (``recovery.writer``) and what it feeds ------------------------------------
    def apply(self, owned, step: int, only=None, behind: bool = False, durable=None) -> None:
        self.writer.apply(owned, step, only, behind, durable)

    def count_updates(self, updated, step: int | None = None) -> None:
        """The rows a step updated: sorted packed keys and their shards (``StepUpdate.updated_keys``,
        ``updated_shards``) as a pair, or a dict table name -> ids."""
        if isinstance(updated, tuple):
            keys, shards = updated
        else:
            index = self.store.tables.index
            keys, _ = rowkeys.from_tables({index(n): ids for n, ids in updated.items()})
            shards = self.store.shard_map.shard_of_keys(keys)
        self.ledger.count(shards, step)
        for w in (self.priority, self.flusher):
            if w is not None:
                w.observe(keys, shards)

    def latest_shard_file(self, shard: int) -> Path | None:
        return self.shard_restore.latest_shard_file(shard)

    # -- recovery ----------------------------------------------------------------------------------
    def recover_outcome(self, failed: list[int], step: int, phase: str) -> Outcome:
        """Restore ``failed`` shards (all trainers call this together); the outcome's ``to_step``:
        under ``full`` the step the trainers roll back to, otherwise None (the interrupted phase
        resumes). Every trainer: background writes settle, rank 0 restores (its restorer), all learn its
        verdict, then reconnect to (or fail over to) the recovered shards and hold their rows again.
        With ``--train-through`` a failure in a step's stage or update is restored in the background
        instead (``recovery.restore.through``); an outage in progress ends first (the run waits for it)."""
        n = self.store.num_shards
        self.store.stop_learning()  # rank 0 may restore a shard this trainer's listing reads (embeddings.store.present)
        if self.through is not None:
            self.through.end(step, f"shards {failed} failed meanwhile")
        # every trainer's background writes (logs, priority saves, flushes) are on disk: rank 0 reads them;
        # and every trainer's listing of its shards is void before rank 0 restores any (``stop_learning``)
        self.wait_background()
        self.collective.barrier()
        if self.writer.lockstep:  # rank 0 counts what a restore loses: the steps each shard's writer redoes
            self.writer.redo_seen = redo_everywhere(self.writer, self.collective, self.store.num_shards, failed)
        if self.through is not None and phase in THROUGH_PHASES:
            return self.through.begin(failed, step, phase)
        mine, error = None, None
        if self.rank == 0:
            try:
                mine = self._restore_on_rank0(failed, step, phase)
            except Exception as e:  # noqa: BLE001 - every trainer must learn that recovery failed
                mine, error = Verdict(fatal=True), e
        verdict = Verdict.exchange(mine, n, self.collective)
        if verdict.fatal:
            if error is not None:
                raise error
            raise PeerError(f"recovery of shards {failed} at step {step} failed on rank 0 (its error ends the run)")
        self._restored = verdict.restored
        recovered = sorted(verdict.as_of)
        self.writer.as_of.update(verdict.as_of)  # a write-behind's step the restore already covers is not redone
        rebuilt = verdict.rollback is not None  # every shard restored from a checkpoint: no replica promoted
        for s in range(n) if rebuilt else recovered:
            if self.strategy.promotes and not rebuilt:
                self.store.failover(s)  # every trainer serves the shard from its promoted replica
            else:
                self.store.reconnect(s)  # connections to the old processes are dead
        for s in recovered:  # the rows this trainer held on them: held again, or read back in one bulk read
            self.writer.rehold(s, self._restored.get(s), self.strategy.replays_log, self.priority)
        self.drain()
        for s in recovered:
            self.detector.forget(s)
        if rebuilt:
            self.ledger.rolled_back(verdict.rollback)
        return verdict.outcome()

    def _restore_on_rank0(self, failed: list[int], step: int, phase: str) -> Verdict:
        self.journal.mark_in_recovery(failed)
        # a resume uses no checkpoint newer than its dense state (the phase is the step after it); at
        # any other phase one of the phase's step is whole: its manifest exists only once it completed
        self.shard_restore.newest_usable = step - 1 if phase == "resume" else step
        restorer = self.rebuilder if self._rebuild else self.restorer
        verdict = restorer.recover(failed, step, phase)
        self.journal.mark_in_recovery([])
        return verdict

    # -- training through a failure (``recovery.restore.through``) ---------------------------------------
    def poll_outage(self, step: int) -> None:
        """At the start of every step (every trainer): shards whose background restore is done rejoin."""
        if self.through is not None:
            self.through.poll(step)

    @property
    def outage_active(self) -> bool:
        """A shard is away (restored in the background): saves are put off until it rejoins."""
        return self.through is not None and self.through.active

    def end_outage(self, step: int, why: str | None = None) -> None:
        """Before anything that reads every shard: the run waits for a background restore in flight."""
        if self.through is not None:
            self.through.end(step, why)

    def summary_failures(self, last_step: int) -> list[dict]:
        """The run's failure records as it ends at ``last_step`` (a dead trainer that never rejoined:
        its chunk skipped to the end, where it was, ``Journal.close_absences``)."""
        self.journal.close_absences(last_step)
        return self.journal.summary()

    # -- starts and restarts (``recovery.restore.trainer_restart``) ------------------------------------------------
    def on_rollback(self, to_step: int) -> None:
        """Full recovery rolled the run back to checkpoint ``to_step``: its logs follow."""
        self.writer.on_rollback(to_step)

    def fresh_start(self, t_restart: float | None = None) -> None:
        self.restarts.fresh_start(t_restart)

    def resume(self, step: int, t_restart: float, restored_bytes: int, rebuild: bool = False) -> Outcome:
        """After a trainer restart, with the dense state at ``step``: every shard back to ``step``
        (``recovery.restore.trainer_restart``). ``rebuild``: the dense state is checkpoint ``step``'s (the per-step
        one was damaged): every shard is restored from that checkpoint, whatever the strategy (a
        replica or a log is ahead of it), and the outcome rolls back to it."""
        self._rebuild = rebuild
        try:
            return self.restarts.resume(step, t_restart, restored_bytes, rebuild, self.run_phase)
        finally:
            self._rebuild = False

    # -- persistence across trainer restarts ------------------------------------------------------
    def state(self) -> dict:
        return {**self.ledger.state(), "failures": [dict(f) for f in self.failures]}

    def load_state(self, state: dict) -> None:
        self.ledger.load_state(state)
        self.journal.failures = [dict(f) for f in state["failures"]]


def redo_everywhere(writer: SparseWriter, collective: Collective, n: int, failed: list[int]) -> dict[int, list[int]]:
    """Several trainers, before a restore: the first and last step each failed shard's writer redoes
    once it is restored (one collective): every trainer learns them, rank 0 counts by them."""
    top = np.iinfo(np.int64).max // 2
    v = np.zeros(2 * n, np.int64)
    writer.redo_seen = {}  # what the last restore learned: this trainer's own redo steps only now
    for s in failed:
        steps = writer.redo_steps(s)
        if steps:
            v[s], v[n + s] = max(steps), top - min(steps)
    v = collective.max_flags(v)
    return {s: [int(top - v[n + s]), int(v[s])] for s in failed if v[s]}
