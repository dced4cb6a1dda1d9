"""The recovery manager and its commit protocol: every store call of a run goes through it.

Every trainer holds one. A phase of a step (stage rows, write the sparse update, checkpoint,
evaluate, final digest, restart rollback) runs its store calls under ``guard``, and so do a
writer's priority saves and flushes (a failure they meet is seen at the next commit point):
a shard that fails is recorded, not raised. At the phase's commit point (``commit``, a MAX
all-reduce of per-shard flags) every trainer sees the same failed set and they recover together;
rank 0 does the work (replacement process, restore, log replay, priority overlay) and then tells
everyone one ``Outcome``: continue, retry the phase (on these shards), or roll back to step N.
A shard that fails while another is being recovered is recovered in the same commit.

Strategies (``recovery.strategy.Strategy``):
- ``partial`` (CPR): a replacement for the failed shard loads that shard's snapshot from the newest
  verified checkpoint; other shards and the dense model keep their state. Updates to the shard since
  that checkpoint are lost and counted.
- ``partial-mfu`` / ``partial-ssu``: as ``partial``, then the newest priority save is overlaid.
- ``incremental``: as ``partial``, then every flush since the checkpoint, in order: the shard is as
  of the last flush. Before rank 0 reads any of these files (or a log), every trainer's background
  writes are waited for (``settle``).
- ``log``: as ``partial``, then the shard's update log is replayed up to the failure: nothing lost.
- ``full``: every shard is restored from the checkpoint, and the trainers roll the dense state and
  the readers back to it (``Outcome.to_step``) and recompute from there.

With one trainer the step's write goes behind (``commit_behind`` is its commit point), and with
``write_every`` K in windows of K steps (``recovery.window``): a window's rows reach the shards in
one write when it closes, a failure seen anywhere closes it at once, and a shard that failed under a
write redoes that write's steps once recovered.

Also here: what a trainer restart needs (``resume``: logs cut back, shards rolled back one write by
their undo records, dead shards recovered), fresh-start cleanup, log retention and failure records.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from embeddings import RedisStore, ShardDataError, ShardUnavailableError, rowkeys
from embeddings.launcher import ShardSpec, kill_and_wait, shard_servers, spawn_shard
from embeddings.module import sum_by_key
from recovery import incremental, priority
from recovery.accounting import UpdateCounter, lost_samples
from recovery.checkpoint import Checkpoint, Checkpointer
from recovery.errors import CorruptCheckpointError, NoCheckpointError, RecoveryError, ShardLostError
from recovery.files import FAILURES, TRAINER_FAILURES, append_line, read_lines, write_atomic
from recovery.inject import Injector
from recovery.log import ShardLog
from recovery.strategy import Strategy
from recovery.window import Window

STRATEGIES = tuple(s.value for s in Strategy)
MAX_ATTEMPTS = 8  # retries of one phase before the run gives up (shards that keep failing)
RECENT = 512  # steps of update totals kept for replica-loss accounting
IN_RECOVERY = "recovery_in_progress.json"  # shards whose restore a dead trainer may have left half-done


@dataclass
class Collective:
    """The few collectives the manager needs; identity functions with one trainer."""

    world_size: int = 1
    barrier: Callable[[], None] = lambda: None
    max_flags: Callable[[np.ndarray], np.ndarray] = lambda a: a
    broadcast_int: Callable[[int], int] = lambda v: v
    sum_floats: Callable[[np.ndarray], np.ndarray] = lambda a: a


class Action(Enum):
    CONTINUE = "continue"
    RETRY = "retry"
    ROLLBACK = "rollback"


@dataclass(frozen=True)
class Outcome:
    """What every trainer does after a commit point."""

    action: Action = Action.CONTINUE
    recovered: tuple[int, ...] = ()
    """Shards restored at this commit point."""
    redo: tuple[int, ...] = ()
    """Of those, the shards whose part of the phase must run again (their state is older than it)."""
    to_step: int | None = None
    """ROLLBACK: the checkpoint step the trainers return to."""

    @property
    def rolled_back(self) -> bool:
        return self.action is Action.ROLLBACK


CONTINUE = Outcome()


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` (replaced) with ``src``'s bytes: a hard link where both are on one file system
    (instant), else a copy. The checkpoint's file stays intact as long as nothing writes ``dst`` in
    place: redis-server never does (it writes a temporary file and renames it over the old name),
    and whatever puts a file there goes through this function, which unlinks first."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


class Laps:
    """Seconds spent in each part of a restore, kept in the failure record (``phases_s``)."""

    def __init__(self, rec: dict) -> None:
        self.rec, self.t = rec, time.perf_counter()
        rec.setdefault("phases_s", {})

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        phases = self.rec["phases_s"]
        phases[name] = round(phases.get(name, 0.0) + now - self.t, 4)
        self.t = now


def _wait_all(pending: list, durable: Callable[[], None] | None = None) -> None:
    """On the write-behind thread, before a write moves: each log's records handed over before
    (``ShardLog.pending``) are written, then ``durable`` has returned (a dense state becomes the
    restart point only once the logs hold its steps)."""
    for log, future in pending:
        log.wait_for(future, behind=True)
    if durable is not None:
        durable()


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
    failures: list[dict] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    counter: UpdateCounter | None = None
    priority: object | None = None  # PrioritySaver of this writer's shards (partial-mfu / partial-ssu)
    flusher: object | None = None  # incremental.Flusher of this writer's shards (incremental)
    run_dir: Path | None = None  # where restart markers live
    log_dir: Path | None = None  # every shard's logs (rank 0 replays and trims them)
    restart_timeout_s: float = 60.0  # how long a remote shard's supervisor has to bring it back
    replica_wait: bool = False  # writers wait until replicas acknowledged each step's writes
    write_behind: bool = False  # a step's write runs on the store's write-behind thread (one trainer)
    write_every: int = 1  # with write_behind and every table held: rows reach the shards once per window
    # step -> a wait that makes the dense state saved at ``step`` the restart point (or None): a
    # window's write runs it before its rows move (``DenseSaver.committer``)
    committer_of: Callable[[int], Callable[[], None] | None] = lambda step: None

    def __post_init__(self) -> None:
        try:
            self.strategy = Strategy(self.strategy)
        except ValueError:
            raise ValueError(f"recovery strategy {self.strategy!r} must be one of {STRATEGIES}") from None
        n = self.store.num_shards
        self.counter = self.counter or UpdateCounter(n)
        self._flags = np.zeros(n, dtype=np.int64)
        self._detected: dict[int, float] = {}
        self._call_began: dict[int, float] = {}  # shard -> start of the call that saw it fail
        self._guarded = threading.local()  # .since: start of this thread's guarded call in progress
        self._lost_since: dict[int, tuple[int, list[int]]] = {}  # shard -> (step, all totals) at last failure
        self._local = {spec.index: spec for spec in self.shards}
        self._started_empty: set[int] = set()  # local shards a --resume started anew (empty): restored, not failed
        self._recent: dict[int, np.ndarray] = {}  # step -> update totals, the last RECENT steps (replica losses)
        self._promoted: set[int] = set()
        # write-behind: ([(update, step)], step, keys, rows, shards) of the write in flight (one step's,
        # or a window's); shard -> the (update, step)s of a write-behind that failed there, redone in
        # order once the shard is recovered
        self._behind: tuple | None = None
        self._redo: dict[int, list[tuple[object, int]]] = {}
        held = getattr(self.store, "held", None)
        self._window = (
            Window(held, self.write_every)
            if self.write_behind and self.write_every > 1 and held is not None and held.holds_all()
            else None
        )
        self._written_to = 0  # the step the last window written (or the restart's dense state) is as of
        self._last_logged: dict[int, int] = {}  # shard -> the last step this writer handed to its log
        self._restore_steps: dict[int, tuple[int, int]] = {}  # shard -> (restored from step, newest step restored)
        self._redone: set[int] = set()
        self._as_of: dict[int, int] = {}  # the step each shard's last restore brought it to
        self._seen_at: int | None = None  # commit_behind's step: failure records name it
        self._newest_usable = 0  # the newest checkpoint step a restore in progress may use
        self._last_update = np.zeros(n, dtype=np.int64)  # per shard: the last step that updated rows on it
        self._rebuild = False  # resume from a checkpoint's dense state: every shard restored from it
        if self.log_dir is None and self.logs:
            self.log_dir = next(iter(self.logs.values())).dir.parent

    def close(self) -> None:
        for w in (self.priority, self.flusher):
            if w is not None:
                w.close()
        for log in self.logs.values():
            log.close()

    def settle(self) -> None:
        """Every trainer's background writes (logs, priority saves, flushes) are on disk: rank 0 reads
        them next. All trainers call it together."""
        for w in (self.priority, self.flusher, *self.logs.values()):
            if w is not None:
                w.wait()
        if self.logs or self.log_dir is not None or self.strategy.priority_saves or self.strategy.flushes:
            self.collective.barrier()

    def note(self, what: str) -> None:
        """One line of the run's recovery journal (``{run}/recovery.log``): what was done, when."""
        if self.run_dir is None:
            return
        with open(self.run_dir / "recovery.log", "a") as f:
            f.write(f"{time.time():.3f} pid={os.getpid()} rank={self.rank} {what}\n")

    # -- the commit protocol --------------------------------------------------------------------
    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """Run a store call; a failed shard is recorded (not raised) for the next commit point."""
        here = self._guarded
        outer, here.since = getattr(here, "since", None), time.time()
        try:
            return True, fn()
        except ShardUnavailableError as e:
            self._fail(e.shard)
            return False, None
        finally:
            here.since = outer

    def _fail(self, shard: int) -> None:
        """Record a shard as failed for the next commit point (as ``guard`` does on an error), and
        when the guarded call that saw it began (its time until then is lost: it is redone)."""
        self._flags[shard] = 1
        now = time.time()
        self._detected.setdefault(shard, now)
        since = getattr(self._guarded, "since", None)
        self._call_began.setdefault(shard, since if since is not None else now)

    def detected(self, shard: int, at: float) -> None:
        """A failure of ``shard`` seen at ``at`` (``time.time()``) by a caller outside the protocol
        (the recovery benchmark kills a shard and recovers it directly): its record times from there."""
        self._detected[shard] = at

    def sync(self) -> list[int]:
        """Failed shards seen by any trainer since the last commit point (a collective)."""
        flags = self.collective.max_flags(self._flags.copy())
        self._flags[:] = 0
        return [int(s) for s in np.flatnonzero(flags)]

    def commit(self, step: int, phase: str) -> Outcome:
        """A commit point: all trainers agree on the failed shards; if any, they are recovered. A
        write-behind in flight is joined first when anything failed: its failed shards are recovered
        with the others, and its part on them is redone before the phase's."""
        if self._behind is not None and self._flags.any():
            self._settle_behind()
        if self._window is not None and self._window.open and self._flags.any():
            # the open window's rows go now, to the shards that did not fail: the failed ones redo
            # its steps once recovered (nothing may reach them before, or their marker would pass
            # a failed write's steps)
            self._write_window(skip=np.flatnonzero(self._flags).tolist())
            self._settle_behind()
        failed = self.sync()
        for s in self._redone - set(failed):
            self._redo.pop(s, None)
        self._redone.clear()
        if not failed:
            return CONTINUE
        self.note(f"step {step} {phase}: shards {failed} failed")
        return self.recover_outcome(failed, step, phase)

    def run_phase(self, step: int, phase: str, fn: Callable[[tuple[int, ...] | None], object]) -> Outcome:
        """Run ``fn(only)`` under the protocol until it commits: ``only`` is None on the first attempt,
        then the shards whose part must run again. Returns CONTINUE or a ROLLBACK outcome."""
        only = None
        for _ in range(MAX_ATTEMPTS):
            if only is not None:
                self._redo_behind(only)
            self.guard(lambda only=only: fn(only))
            out = self.commit(step, phase)
            if out.action is not Action.RETRY:
                return out
            for s in set(out.recovered) - set(out.redo):
                self._redo.pop(s, None)  # restored as of this step or later: the write-behind's rows are there
            only = out.redo
        raise RecoveryError(f"{phase} at step {step}: shards kept failing after {MAX_ATTEMPTS} recoveries")

    # -- write-behind ----------------------------------------------------------------------------
    @property
    def window_steps(self) -> int:
        """Steps per write-behind window (1: every step's rows are written after it)."""
        return self._window.every if self._window is not None else 1

    def commit_behind(self, now: int, reads: bool = False) -> Outcome:
        """The commit point of the write-behind in flight (if any): the trainer calls it before the
        next step's update, and with ``reads`` before anything that reads the shards (saves,
        evaluation, the end), which first writes an open window. A shard that failed under it is
        recovered and the write's steps redone there, as a failure during a synchronous update
        would be. With windows, before an update that does not close a window the write in flight
        is left to run. ``now``: the step the trainer is in. A failure record names the step an
        injected failure fired at (else the write's), and ``write_step``, the step whose write saw
        it, where they differ."""
        if self._window is not None and not reads and not self._window.closes_at(now):
            return CONTINUE
        out = self._join_behind(now)
        if not reads or out.rolled_back or self._window is None or not self._window.open:
            return out
        self._write_window()
        return self._join_behind(now)

    def _join_behind(self, now: int) -> Outcome:
        if self._behind is None:
            return CONTINUE
        self._seen_at = now
        try:
            return self.run_phase(self._behind[1], "update", lambda only: self._settle_behind())
        finally:
            self._seen_at = None

    def _settle_behind(self) -> None:
        """Join the write-behind: failed shards are recorded (their part is redone after their
        recovery, unless the recovery brought them to its step). Its rows went to the shards' logs
        when it was handed over (``apply``): a failed shard's log then holds the step, and a log
        replay restores it as of the step (no redo); a trainer restart cuts the logs back to its
        dense state's step. Replicas are waited for here, as after a synchronous write."""
        if self._behind is None:
            return
        updates, step, keys, rows, shards = self._behind
        self._behind = None
        failed = self.store.join_behind()
        if failed and self._window is not None:
            self._written_to = -1  # not every shard took it: its dense state never becomes the restart point
        for s in failed:
            self._fail(s)
            self._redo.setdefault(s, []).extend(updates)
        if self.replica_wait:
            for s in np.unique(shards).tolist():
                if s not in failed and self.store.has_replica(s):
                    self._replicated(s)

    def _redo_behind(self, only: tuple[int, ...]) -> None:
        """Recovered shards that a write-behind had failed on: its steps' updates again, in order,
        synchronously (the steps its log or its replica already brought it to are not redone)."""
        for s in sorted(set(only) & set(self._redo)):
            todo = [(u, step) for u, step in self._redo[s] if self._as_of.get(s, -1) < step]
            if not todo:
                del self._redo[s]
                continue
            self._redone.add(s)
            for update, step in todo:
                ok, _ = self.guard(lambda s=s, update=update, step=step: self.apply(update, step, (s,)))
                if not ok:
                    break

    # -- accounting ------------------------------------------------------------------------------
    def count_updates(self, updated, step: int | None = None) -> None:
        """The rows a step updated: sorted packed keys and their shards (``StepUpdate.updated_keys``,
        ``updated_shards``) as a pair, or a dict table name -> ids."""
        keys, shards = updated if isinstance(updated, tuple) else self._keys_of(updated)
        counts = np.bincount(shards, minlength=self.store.num_shards).astype(np.int64)
        self.counter.add(counts)
        if step is not None:
            self._last_update[counts > 0] = step
        for w in (self.priority, self.flusher):
            if w is not None:
                w.observe(keys, shards)
        if step is not None and (self.strategy.promotes or self._window is not None):
            self._recent[step] = self.counter.total.copy()
            self._recent.pop(step - RECENT, None)

    def _keys_of(self, ids_by_name: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        keys, _ = rowkeys.from_tables({self.store.tables.index(n): ids for n, ids in ids_by_name.items()})
        return keys, self.store.shard_map.shard_of_keys(keys)

    def on_checkpoint(self, step: int) -> None:
        self.counter.mark(step)
        if self.priority is not None:
            self.priority.on_checkpoint(step)
        if self.flusher is not None:
            self.flusher.on_checkpoint(step)
        for log in self.logs.values():
            log.open_segment(step + 1)

    def flush(self, step: int) -> int:
        """incremental: this writer's rows dirtied since its last flush go to disk (off the path);
        the update totals as of ``step`` are kept for the loss accounting of a restore to it."""
        self.counter.mark(step)
        return self.flusher.flush(step) if self.flusher is not None else 0

    def on_checkpoint_saved(self, ckpt: Checkpoint) -> None:
        """Rank 0, after a manifest: log segments that every kept checkpoint covers can go. (Not just
        those before the newest: if the newest turns out corrupt, log recovery falls back to an older
        checkpoint and must still replay exactly.)"""
        if self.checkpointer is None:
            return
        oldest = min(k.step for k in self.checkpointer.candidates())
        if self.flusher is not None:
            incremental.drop_before(self.flusher.dir, self.store.num_shards, oldest)
        if self.log_dir is None:
            return
        for s in range(self.store.num_shards):
            ShardLog(self.log_dir, s).drop_before(oldest)

    def log_step(self, step: int, shard: int, keys: np.ndarray, rows: np.ndarray, wait: bool = True) -> int:
        """Group-commit this step's rows written to ``shard`` (sorted packed keys) to its log."""
        log = self.logs.get(shard)
        if log is None:
            return 0
        groups = [(t, ids, rows[lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(keys).items()]
        self._logged(shard, step)
        return log.append_step(step, groups, wait)

    def _logged(self, shard: int, step: int) -> None:
        self._last_logged[shard] = max(step, self._last_logged.get(shard, step))

    def apply(
        self, owned, step: int, only=None, behind: bool = False, durable: Callable[[], None] | None = None
    ) -> None:
        """Write this step's rows of the shards this trainer owns, then group-commit them to the
        shards' logs. ``owned``: a ``StepUpdate`` (sorted packed keys, gradients, shards) or a dict
        table name -> (ids, grads). The optimizer runs once over every shard's rows and the shards
        are written in parallel; a failed shard is recorded and does not stop the others.
        ``behind`` (with ``write_behind``, first attempt only): the write goes to the write-behind
        thread; ``commit_behind`` is its commit point. Its records are handed to the logs first
        (after the last step's are written): the step's rows move only once the step before is in
        the logs, as for a synchronous write. ``durable``: a wait for what must be written before
        the step's rows move (the dense state of the step before), run on the thread that moves them."""
        behind = behind and self.write_behind and only is None
        if not behind:
            self._wait_logs()  # the logs hold the steps before, then their dense state is the restart point
            if durable is not None:
                durable()
        if isinstance(owned, dict):
            owned = self._update_of(owned)
        keys, grads, shards = owned.keys, owned.grads, owned.shards
        if only is not None:
            at = np.flatnonzero(np.isin(shards, list(only)))
            keys, grads, shards = keys[at], grads[torch.from_numpy(at)], shards[at]
        if self.logs:  # a shard of this writer's with no row in the step still logs the step (complete, empty)
            rows_of = np.bincount(shards, minlength=self.store.num_shards)
            for s in self.logs if only is None else sorted(set(only) & set(self.logs)):
                if not rows_of[s]:
                    self.log_step(step, s, keys[:0], np.zeros((0, 0), np.float32), wait=not behind)
        if not len(keys):
            return
        try:
            current = self.store.read_keys(keys)  # held rows: no I/O
        except ShardUnavailableError as e:  # some rows had to come from a shard that is down: shard by shard
            if self._window is not None and self._window.open:  # its rows first, as of the step before
                self._settle_behind()
                self._write_window(skip=sorted({e.shard, *np.flatnonzero(self._flags).tolist()}))
                self._settle_behind()
            elif behind and durable is not None:
                durable()
            self._apply_by_shard(keys, grads, shards, step)
            return
        new = self.store.optimizer.apply(torch.from_numpy(current), grads).numpy()
        if behind:
            if self._behind is not None and self._window is None:
                raise RecoveryError(f"step {step}: the write-behind of step {self._behind[1]} was not committed")
            # the step's records go to the logs now, beside its write (see ``_settle_behind``); the
            # write-behind thread waits for the last step's before this step's rows move
            before = [(log, log.pending()) for log in self.logs.values()]
            if self.logs:
                for s in np.flatnonzero(np.bincount(shards, minlength=self.store.num_shards)).tolist():
                    log = self.logs.get(s)
                    if log is not None:  # its rows picked and grouped on the log's thread
                        self._logged(s, step)
                        log.append_keys(step, keys, new, shards)
            if self._window is not None:  # held now, written when the window closes
                self.store.hold_written(keys, new, shards, step)
                self._window.add(owned, step, keys, current)
                if self._window.closes_at(step):
                    self._write_window(before)
                return
            self.store.write_behind(keys, new, shards, step, undo=current, before=lambda: _wait_all(before, durable))
            self._behind = ([(owned, step)], step, keys, new, shards)
            return
        failed = self.store.write_step(keys, new, shards, step, undo=current)
        for s in failed:
            self._fail(s)
        if self.logs or self.replica_wait:
            for s in np.unique(shards).tolist():
                if s not in failed:
                    at = np.flatnonzero(shards == s)
                    self._written(s, step, keys[at], new[at])

    def _write_window(self, before: list | None = None, skip: list[int] = ()) -> None:
        """The open window's rows to the write-behind thread (the write before it is committed).
        They move once the dense state as of the last window written is the restart point and the
        logs hold the steps before (``before``: the log records pending then; default: all).
        ``skip``: failed shards, which get none of it: they redo its steps once recovered."""
        if self._behind is not None:
            raise RecoveryError(f"the write-behind of step {self._behind[1]} was not committed")
        keys, rows, undo, updates = self._window.take()
        step = updates[-1][1]
        shards = self.store.shard_map.shard_of_keys(keys)
        if len(skip):
            for s in skip:
                self._redo.setdefault(s, []).extend(updates)
            keep = ~np.isin(shards, skip)
            keys, rows, undo, shards = keys[keep], rows[keep], undo[keep], shards[keep]
        if before is None:
            before = [(log, log.pending()) for log in self.logs.values()]
        durable = self.committer_of(self._written_to)

        def written() -> None:
            """Every shard took the window: the dense state saved at its step (if handed over by
            now) becomes the restart point at once, not when the next window moves."""
            commit = self.committer_of(step)
            if commit is not None:
                commit()

        self.store.write_behind(
            keys,
            rows,
            shards,
            step,
            undo=undo,
            before=lambda: _wait_all(before, durable),
            window=True,
            after=None if len(skip) else written,  # a skipped shard has not got the window yet
        )
        self._behind = (updates, step, keys, rows, shards)
        self._written_to = step

    def _wait_logs(self) -> None:
        """The previous step's records are written before this step's rows move."""
        for log in self.logs.values():
            log.wait()

    def _written(self, s: int, step: int, keys: np.ndarray, rows: np.ndarray) -> None:
        self.log_step(step, s, keys, rows)
        if self.replica_wait and self.store.has_replica(s):
            self._replicated(s)

    def _replicated(self, s: int) -> None:
        self.guard(lambda: self.store.wait_replicated(s, int(1000 * self.store.timeout_s)))

    def _apply_by_shard(self, keys: np.ndarray, grads, shards: np.ndarray, step: int) -> None:
        for s in np.unique(shards).tolist():
            at = np.flatnonzero(shards == s)
            ok, written = self.guard(lambda at=at: self.store.apply_keys(keys[at], grads[torch.from_numpy(at)], step))
            if ok:
                self._written(s, step, keys[at], written)

    def _update_of(self, grads_by_name: dict) -> SimpleNamespace:
        """table name -> (ids, grads [n, dim]) as sorted unique keys, summed gradients and shards."""
        index = {n: self.store.tables.index(n) for n in grads_by_name}
        keys, order = rowkeys.from_tables({index[n]: ids for n, (ids, _) in grads_by_name.items()})
        blocks = [torch.as_tensor(np.asarray(grads_by_name[n][1], np.float32)) for n in sorted(index, key=index.get)]
        keys, grads = sum_by_key(keys, torch.cat(blocks)[torch.from_numpy(order)])
        return SimpleNamespace(keys=keys, grads=grads, shards=self.store.shard_map.shard_of_keys(keys))

    # -- recovery -------------------------------------------------------------------------------
    def recover(self, failed: list[int], step: int, phase: str) -> int | None:
        """Restore ``failed`` shards (all trainers call this together). ``full``: returns the step
        the trainers must roll back to; otherwise None (the interrupted phase resumes)."""
        return self.recover_outcome(failed, step, phase).to_step

    def recover_outcome(self, failed: list[int], step: int, phase: str) -> Outcome:
        n = self.store.num_shards
        self.settle()
        # [fatal, rollback + 1, recovered as of step + 1 [n], redo[n], restored from step + 2 [n],
        # newest step restored + 2 [n]]: rank 0 fills it, the others learn it by a MAX
        verdict = np.zeros(2 + 4 * n, dtype=np.int64)
        error: Exception | None = None
        if self.rank == 0:
            try:
                self._restore_steps = {}
                rollback, restored_to = self._recover_on_rank0(failed, step, phase)
                verdict[1] = rollback + 1
                for s, at in restored_to.items():
                    verdict[2 + s] = at + 1
                    # redone: the phase, and the steps of a failed write-behind past the restore (a
                    # window written at this commit may hold steps after the phase's)
                    top = max((st for _, st in self._redo.get(s, [])), default=step)
                    verdict[2 + n + s] = int(at < max(step, top))
                for s, (base, newest) in self._restore_steps.items():
                    verdict[2 + 2 * n + s], verdict[2 + 3 * n + s] = base + 2, newest + 2
            except Exception as e:  # noqa: BLE001 - every trainer must learn that recovery failed
                verdict[0], error = 1, e
        verdict = self.collective.max_flags(verdict)
        if verdict[0]:
            if error is not None:
                raise error
            raise RecoveryError(f"recovery of shards {failed} at step {step} failed on rank 0 (its error ends the run)")
        recovered = [int(s) for s in np.flatnonzero(verdict[2 : 2 + n])]
        self._restore_steps = {
            s: (int(verdict[2 + 2 * n + s]) - 2, int(verdict[2 + 3 * n + s]) - 2)
            for s in recovered
            if verdict[2 + 2 * n + s] > 0
        }
        for s in recovered:  # a write-behind's step the restore already covers is not redone
            self._as_of[s] = int(verdict[2 + s]) - 1
        rebuilt = verdict[1] > 0  # every shard restored from a checkpoint: no replica promoted
        for s in range(n) if rebuilt else recovered:
            if self.strategy.promotes and not rebuilt:
                self.store.failover(s)  # every trainer serves the shard from its promoted replica
            else:
                self.store.reconnect(s)  # connections to the old processes are dead
        for s in recovered:  # the rows this trainer held on them: held again, or read back in one bulk read
            self._rehold(s)
        self.drain()
        for s in recovered:
            self._detected.pop(s, None)
            self._call_began.pop(s, None)
        if verdict[1] > 0:
            to = int(verdict[1]) - 1
            self.counter.total = self.counter.at_step.get(to, np.zeros_like(self.counter.total)).copy()
            return Outcome(Action.ROLLBACK, tuple(recovered), tuple(recovered), to)
        return Outcome(Action.RETRY, tuple(recovered), tuple(int(s) for s in np.flatnonzero(verdict[2 + n :])))

    def _rehold(self, s: int) -> None:
        """After shard ``s`` was recovered: a log replay up to the last step this writer logged for
        it left exactly the rows it holds (a failed write-behind's too: they were held when handed
        over, and logged): they are held again without a read. Any other restore took the shard
        back to the step it was restored from (plus rows of later steps up to the newest it
        restored): the rows this writer last wrote before that step are held again, the rows it
        first wrote after the newest are known never written, and the rest are read back."""
        last = self._last_logged.get(s)
        if self.strategy.replays_log and last is not None and self._as_of.get(s, -1) >= last:
            self.store.reinstate_held(s)
            return
        base, newest = self._restore_steps.get(s, (None, None))
        overlay = None
        if base is not None and newest > base and self.priority is not None and not self.strategy.replays_log:
            keys = self.priority.exact_rows(s, newest)  # the save overlaid is this writer's newest
            overlay = (keys, newest) if keys is not None else None
        self.guard(lambda: self.store.reload_held(s, base, newest, overlay))

    def _finish_record(self, rec: dict, phase: str) -> None:
        rec["recovery_s"] = round(time.time() - rec.pop("_detected_at"), 4)
        rec["phase"] = phase
        if rec.pop("transient", False):  # not a failure: noted, not counted
            self.note(
                f"step {rec['step']}: shard {rec['target']} refused by the cluster for {rec['recovery_s']}s, not lost"
            )
            return
        self._record(rec)  # durable now: a trainer that dies before the next commit point does not lose it

    def _recover_on_rank0(self, failed: list[int], step: int, phase: str) -> tuple[int, dict[int, int]]:
        """-> (rollback step or -1, shard -> the step its state is now as of); each failure record is
        journaled as its shard comes back. A shard that fails during the recovery of another is
        recovered in the same round."""
        self._mark_in_recovery(failed)
        # a resume uses no checkpoint newer than its dense state (the phase is the step after it); at
        # any other phase one of the phase's step is whole: its manifest exists only once it completed
        self._newest_usable = step - 1 if phase == "resume" else step
        if self.strategy.rolls_back or self._rebuild:
            rollback, rec = self._recover_full(failed, step)
            self._finish_record(rec, phase)
            self._mark_in_recovery([])
            return rollback, dict.fromkeys(range(self.store.num_shards), rollback)
        pending, restored_to, retries = list(failed), {}, 0
        self._promoted = set()  # replicas promoted in this round (a retry waits for them)
        for _ in range(MAX_ATTEMPTS * self.store.num_shards):
            if not pending:
                break
            s = pending.pop(0)
            try:
                recover = self._recover_by_replica if self.strategy.promotes else self._recover_one
                rec, restored_to[s] = recover(s, step)
                self._finish_record(rec, phase)
                self.note(
                    f"step {step}: shard {s} restored from step {rec['restored_from_step']}, now as of {restored_to[s]}"
                )
            except ShardUnavailableError as e:  # a shard died while we restored (this one or another)
                self.note(f"step {step}: shard {e.shard} failed while shard {s} was being recovered")
                self._detected.setdefault(e.shard, time.time())
                self._mark_in_recovery(sorted({*pending, s, e.shard}))
                pending += [x for x in (e.shard, s) if x not in pending]
                retries += 1
                time.sleep(min(0.05 * retries, 1.0))  # a server still starting or loading: give it time
        if pending:
            raise RecoveryError(f"shards {pending} kept failing while being recovered at step {step}")
        self._mark_in_recovery([])
        return -1, restored_to

    def _record(self, rec: dict) -> None:
        """A failure record, durable at once (a restart that follows must not lose it)."""
        self.failures.append(rec)
        if self.run_dir is not None and self.rank == 0:
            append_line(self.run_dir / FAILURES, rec)

    def summary_failures(self) -> list[dict]:
        return [{k: v for k, v in f.items() if not k.startswith("_")} for f in self.failures]

    def _mark_in_recovery(self, shards: list[int]) -> None:
        """Durable note of the shards being restored: a trainer restart redoes a restore cut short."""
        if self.run_dir is not None:
            write_atomic(self.run_dir / IN_RECOVERY, json.dumps(shards))

    def _kill(self, spec: ShardSpec) -> None:
        for pid in shard_servers(spec):  # its pidfile's, and one a dead trainer started unrecorded
            kill_and_wait(pid)

    def _checkpoint_for(
        self, shards: list[int], record: dict, lap: Callable[[str], None] = lambda _: None, whole=False
    ) -> Checkpoint | None:
        """The newest checkpoint the restore in progress may use (``_newest_usable``) whose files a
        restore of ``shards`` needs verify: their snapshots, and with ``whole`` every file (the dense
        state a rollback loads too). Corrupt ones are noted in ``record`` and passed over."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()  # a checkpoint in flight finishes (or is abandoned) before a restore
        lap("checkpoint_wait")
        if self.injector is not None:
            self.injector.before_restore(lambda: self.latest_shard_file(shards[0]))

        def report(e: CorruptCheckpointError) -> None:
            record.setdefault("corrupt_checkpoints", []).append(str(e))

        try:
            return self.checkpointer.latest_verified(
                lambda c: None if whole else [c.shard_file(s).name for s in shards],
                report,
                max_step=self._newest_usable,
            )
        except NoCheckpointError:
            return None

    def latest_shard_file(self, shard: int) -> Path | None:
        if self.checkpointer is None:
            return None
        cands = self.checkpointer.candidates()
        return cands[0].shard_file(shard) if cands else None

    def _restore_shard(self, shard: int, ckpt: Checkpoint | None, lap: Callable[[str], None] = lambda _: None) -> int:
        """The shard back as of ``ckpt`` (empty without one); -> bytes restored. A local shard: kill
        whatever runs for it, start a replacement that loads the checkpoint's file. A remote one:
        wait for its supervisor to bring it back, then load the rows through the protocol."""
        spec = self._local.get(shard)
        if spec is None:
            self._await_server(shard)
            self.store.clear_shard(shard)  # a stalled server comes back with its rows: they go
            restored = self.store.load_snapshot(shard, ckpt.shard_file(shard)) if ckpt is not None else 0
            if self.injector is not None:
                self.injector.during("recovery", exclude=shard)
            return restored
        self._kill(spec)
        lap("kill")
        restored = 0
        if ckpt is not None:
            src = ckpt.shard_file(spec.index)
            link_or_copy(src, spec.rdb_path)
            restored = src.stat().st_size
        else:
            spec.rdb_path.unlink(missing_ok=True)  # the replacement starts empty
        lap("copy")
        spawn_shard(spec, die_with_parent=False)
        lap("start")
        self.store.reconnect(spec.index)
        if self.injector is not None:
            self.injector.during("recovery", exclude=spec.index)
        return restored

    def _await_server(self, shard: int) -> None:
        """Until the shard's server answers again (its supervisor restarts it), within the timeout."""
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            self.store.reconnect(shard)
            try:
                self.store.call(shard, lambda c: c.ping())
                return
            except ShardUnavailableError as e:
                if time.monotonic() > deadline:
                    where = f"; resume the run with --resume {self.run_dir}" if self.run_dir is not None else ""
                    raise ShardLostError(
                        f"shard {shard} at {self.store.endpoint(shard)} did not come back within "
                        f"{self.restart_timeout_s:g}s (--shard-restart-timeout): {e.reason}{where} once it is up"
                    ) from None
            time.sleep(0.1)

    def _base_record(self, kind_target: tuple[str, int], step: int) -> dict:
        kind, target = kind_target
        detected = self._detected.get(target, time.time())
        fired = self.injector.fired_at(target) if self.injector is not None else None
        began = self._call_began.get(target)
        if began is None:  # another trainer saw it; this one waited at the commit point meanwhile
            began = fired if fired is not None else detected
        elif fired is not None:
            began = max(began, fired)  # a call that began before the failure lost only what came after it
        seen = step
        if self._seen_at is not None:  # a write-behind's failure: it happened in steps step .. _seen_at
            at = self.injector.fired_step(target) if self.injector is not None else None
            seen = at if at is not None and step <= at <= self._seen_at else step
        return {
            "kind": kind,
            "target": target,
            "step": seen,
            **({"write_step": step} if seen != step else {}),
            "strategy": str(self.strategy),
            # seconds from the failure to the moment a call saw it (the trainer went on working
            # meanwhile), and of those, how long the call that saw it ran (its work is redone; all of
            # them where another trainer saw it and this one waited for it at the commit point)
            "detected_after_s": round(max(0.0, detected - fired), 4) if fired is not None else 0.0,
            "failed_call_s": round(max(0.0, detected - began), 4),
            "_detected_at": detected,
        }

    def _kind(self, shard: int) -> str:
        if shard in self._started_empty:
            return "resume"  # the run's local servers ended with it: the resume restores the new ones
        return self.injector.kind_of(shard) if self.injector is not None else "shard"

    def _recover_one(self, shard: int, step: int) -> tuple[dict, int]:
        """-> (failure record, the step the shard's rows are now as of)."""
        rec = self._base_record((self._kind(shard), shard), step)
        lap = Laps(rec)
        ckpt = self._checkpoint_for([shard], rec, lap)
        lap("checkpoint")
        base_step = ckpt.step if ckpt is not None else 0
        rec["restored_from_step"] = base_step if ckpt is not None else None
        replay = None
        if self.strategy.replays_log:
            # the shard must come back as of every step before the phase's (and before the first
            # step of a failed write-behind, which is redone): the log proves it reaches that far
            # before anything on the shard is touched
            need = min([step, *(st for _, st in self._redo.get(shard, []))]) - 1
            replay = self._read_log(shard, base_step, need, lap)
        rec["restored_bytes"] = self._restore_shard(shard, ckpt, lap)
        as_of = newest = base_step if ckpt is not None else -1
        if replay is not None:
            groups, replayed, as_of = replay
            if groups:
                self.store.write_shard(shard, groups, step=as_of)
            lap("replay_write")
            newest = max(newest, as_of)
            rec["restored_bytes"] += replayed
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        else:
            saved = 0

            def note_corrupt(e: Exception) -> None:  # not used: what it held is counted lost below
                rec.setdefault("corrupt_saves", []).append(str(e))
                self.note(f"step {step}: shard {shard}: {e}")

            if self.priority is not None:  # partial-mfu / partial-ssu: overlay the newest priority save
                nbytes, saved, at = priority.overlay(
                    self.priority.dir, self.store, shard, base_step, step - 1, on_corrupt=note_corrupt
                )
                newest = max(newest, at)
                rec["restored_bytes"] += nbytes
                rec["saved_updates"] = saved
                lap("overlay")
            if self.flusher is not None and ckpt is None:
                # no checkpoint to lay flushes on: those before the oldest checkpoint kept are gone,
                # so the later ones alone would leave rows dirtied only in those as fresh values.
                # The shard restarts empty and every update since step 0 is counted lost.
                rec["flushed_to_step"] = None
            elif self.flusher is not None:  # incremental: the flushes since the checkpoint, in order
                nbytes, as_of = incremental.replay(
                    self.flusher.dir, self.store, shard, base_step, step - 1, on_corrupt=note_corrupt
                )
                newest = max(newest, as_of)
                rec["restored_bytes"] += nbytes
                rec["flushed_to_step"] = as_of
                lap("replay")
            completed = step - 1  # the interrupted step resumes on the restored shard
            # updates already counted as lost at an earlier failure of this shard are not lost again
            since_step, since_totals = as_of, self.counter.at_step.get(as_of, np.zeros_like(self.counter.total))
            earlier = self._lost_since.get(shard)
            if earlier is not None and earlier[0] > as_of:
                since_step, since_totals = earlier[0], np.asarray(earlier[1], dtype=np.int64)
            end, end_totals = self._lost_until(shard, completed)
            since = end_totals - since_totals if end > since_step else np.zeros_like(since_totals)
            rec["lost_updates"] = max(int(since[shard]) - saved, 0)
            samples_since = max(0, end - since_step) * self.batch_size
            rec["lost_samples"] = round(lost_samples(samples_since, rec["lost_updates"], int(since.sum())), 3)
            self.lost.append(rec["lost_samples"])
            self._lost_since[shard] = (completed, self.counter.total.tolist())
            rec["_since"] = [completed, self.counter.total.tolist()]
        self._restore_steps[shard] = (base_step if ckpt is not None else -1, newest)
        return rec, as_of

    def _lost_until(self, shard: int, completed: int) -> tuple[int, np.ndarray]:
        """The last step whose updates to ``shard`` a restore loses, and the update totals as of it:
        ``completed``, or with windows the step before the failed write's first step (that write's
        steps are redone on the restored shard, so they are not lost)."""
        steps = [st for _, st in self._redo.get(shard, [])]
        if self._window is None or not steps:
            return completed, self.counter.total
        end = min(steps) - 1
        totals = self._recent.get(end, self.counter.at_step.get(end))
        if end <= 0:
            totals = np.zeros_like(self.counter.total)
        if end >= completed or totals is None:
            return completed, self.counter.total
        return end, totals

    def _recover_by_replica(self, shard: int, step: int) -> tuple[dict, int]:
        """Promote the shard's replica; nothing is loaded. The steps it had not received are lost:
        -> (failure record, the step its rows are as of)."""
        rec = self._base_record((self._kind(shard), shard), step)
        failed_endpoint = self.store.endpoint(shard)
        if self.store.cluster is not None or shard in self._promoted:
            self._await_server(shard)  # the cluster promotes a replica itself; or promoted, not ready yet
        else:
            self.store.promote(shard)
            self._promoted.add(shard)
        at = self.store.applied_step(shard) or 0
        rec.update(promoted=self.store.endpoint(shard), failed_endpoint=failed_endpoint)
        rec["restored_from_step"], rec["restored_bytes"] = at, 0
        self._restore_steps[shard] = (at, at)  # the replica holds every write up to its applied step
        completed = step - 1
        if self.store.cluster is not None and rec["promoted"] == failed_endpoint and at >= completed:
            # the same primary, every write on it: the cluster refused the shard for a while
            # (CLUSTERDOWN while another shard's primary failed over), but it did not fail
            rec["transient"] = True
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
            return rec, at
        end, end_totals = self._lost_until(shard, completed)
        if at >= end:
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        else:
            known = [k for k in self._recent if k <= at] or [k for k in self.counter.at_step if k <= at]
            base = max(known)  # the replica's step, or the newest step before it we hold totals of
            totals = self._recent.get(base, self.counter.at_step.get(base))
            since = end_totals - totals
            rec["lost_updates"] = int(since[shard])
            rec["lost_samples"] = round(
                lost_samples((end - at) * self.batch_size, rec["lost_updates"], int(since.sum())), 3
            )
        self.lost.append(rec["lost_samples"])
        return rec, at

    def _read_log(
        self, shard: int, after_step: int, need: int, lap: Callable[[str], None] = lambda _: None
    ) -> tuple[list, int, int]:
        """The shard's logged rows of the complete steps after ``after_step``, each row's newest;
        the log must reach ``need`` (``LogGapError`` otherwise). -> ((table, ids, rows) groups to
        write, bytes read, the last step they hold or ``after_step``)."""
        if self.log_dir is None:
            raise RecoveryError("log recovery needs --log-dir")
        log = ShardLog(self.log_dir, shard)
        records, last = log.replay(after_step, need)
        replayed = 0
        by_table: dict[int, tuple[list, list]] = {}
        for r in records:
            if not len(r.ids):
                continue
            ids, rows = by_table.setdefault(r.table, ([], []))
            ids.append(r.ids)
            rows.append(r.rows)
            replayed += r.ids.nbytes + r.rows.nbytes
        # every record holds whole rows (weights and state) as written: the newest record of a row is
        # its value at the failure, so one write of each row's newest record replays the log exactly
        groups = []
        for t, (ids, rows) in sorted(by_table.items()):
            ids, rows = np.concatenate(ids), np.concatenate(rows)
            uniq, first_from_end = np.unique(ids[::-1], return_index=True)
            groups.append((t, uniq, rows[len(ids) - 1 - first_from_end]))
        lap("replay_read")
        return groups, replayed, last

    def _recover_full(self, failed: list[int], step: int) -> tuple[int, dict]:
        rec = self._base_record(("shard", failed[0]), step)
        rec["kind"] = "dense-state" if self._rebuild else self._kind(failed[0])
        rec["failed_shards"] = failed
        ckpt = self._checkpoint_for(list(range(self.store.num_shards)), rec, whole=True)
        if ckpt is None:
            corrupt = "; ".join(rec.get("corrupt_checkpoints", [])) or "none was taken"
            where = self.checkpointer.dir if self.checkpointer is not None else "(checkpoints off)"
            raise RecoveryError(
                f"full recovery of shards {failed} at step {step}: no verified checkpoint in {where} ({corrupt})"
            )
        rec["restored_from_step"] = ckpt.step
        rec["restored_bytes"] = sum(self._restore_shard(s, ckpt) for s in range(self.store.num_shards))
        self._restore_steps = dict.fromkeys(range(self.store.num_shards), (ckpt.step, ckpt.step))
        rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        rec["recomputed_steps"] = step - 1 - ckpt.step
        return ckpt.step, rec

    # -- starts and restarts ----------------------------------------------------------------------
    def on_rollback(self, to_step: int) -> None:
        """Full recovery rolled the run back to checkpoint ``to_step``: its logs follow."""
        self._behind = None  # joined at the commit point that rolled back
        self._redo.clear()
        if self._window is not None:
            self._window.clear()
        self._written_to = to_step
        self._last_logged = {s: min(at, to_step) for s, at in self._last_logged.items()}
        for log in self.logs.values():
            log.truncate_after(to_step)
            log.open_segment(to_step + 1)

    def _drop_saves_after(self, step: int) -> None:
        """Rank 0: priority saves and flushes of steps after ``step`` are an earlier run's (or of steps
        a restart took back): a restore must never overlay them."""
        if self.priority is not None:
            priority.drop_after(self.priority.dir, step)
        if self.flusher is not None:
            incremental.drop_after(self.flusher.dir, self.store.num_shards, step)

    def fresh_start(self) -> None:
        """A new run (rank 0): log segments, saves and markers in the folders are an earlier run's."""
        if self.rank == 0:
            self._drop_saves_after(0)
            if self.log_dir is not None:
                for seg in Path(self.log_dir).glob("shard*/seg_*.log"):
                    seg.unlink()
            if self.run_dir is not None:
                (self.run_dir / TRAINER_FAILURES).unlink(missing_ok=True)
                (self.run_dir / FAILURES).unlink(missing_ok=True)
                (self.run_dir / IN_RECOVERY).unlink(missing_ok=True)
        self.collective.barrier()
        for log in self.logs.values():
            log.open_segment(1)

    def resume(self, step: int, t_restart: float, restored_bytes: int, rebuild: bool = False) -> Outcome:
        """After a trainer restart, with the dense state at ``step``: every shard back to ``step``.

        Logs lose records after ``step``; shards that applied ``step + 1`` undo it; shards that are
        dead (a node failure takes its shards too) or whose restore was cut short are recovered
        under the run's strategy. Returns the protocol's outcome (``full`` may roll back further).
        ``rebuild``: the dense state is checkpoint ``step``'s (the per-step one was damaged): every
        shard is restored from that checkpoint, whatever the strategy (a replica or a log is ahead
        of it), and the outcome rolls back to it."""
        rolled: list[int] = []
        self._written_to = step
        if self.strategy.promotes or self._window is not None:  # the totals a loss is measured from
            self._recent[step] = self.counter.total.copy()
        self._load_journal()
        if self.rank == 0:
            self._drop_saves_after(step)
            if self.log_dir is not None:
                for s in range(self.store.num_shards):
                    ShardLog(self.log_dir, s).truncate_after(step)
            for s in self._interrupted_restores():
                self._fail(s)

        done: set[int] = set()

        def roll_back(only) -> None:
            """Each shard on its own to ``step``: undo ``step + 1``; a shard that cannot get there (dead,
            empty, ahead by more than one write, or behind ``step``, as a restore that its trainers
            never acted on or a server restarted from an old dump leaves it) is failed here and
            recovered under the run's strategy, which counts what a partial one loses. A shard
            recovered here is as of its restore (a log replay proves it reached ``step``)."""
            if self.rank != 0:
                return
            if rebuild:
                if only is None:
                    for s in range(self.store.num_shards):
                        self._fail(s)
                return
            for s in range(self.store.num_shards):
                recovered = only is not None and s in only
                if s in done and not recovered:
                    continue
                ok, applied = self.guard(lambda s=s: self.store.applied_step(s))
                if not ok:
                    self.note(f"resume at step {step}: shard {s} unavailable")
                    continue
                empty = applied is None and step > 0  # a server that came back empty (--resume): any strategy
                # behind: a write that updated rows on it after its marker's step is not there (a
                # shard with no row in a step keeps its marker: that is not behind)
                behind = applied is not None and applied < min(step, int(self._last_update[s]))
                if not recovered and (empty or behind):
                    self.note(f"resume at step {step}: shard {s} is at step {applied}, behind; recovering it")
                    if empty and s in self._local and not self._flags[s]:  # --resume started it: nothing failed
                        self._started_empty.add(s)
                    self._fail(s)
                    continue
                try:
                    ok, n = self.guard(lambda s=s: self.store.rollback(s, step))
                except ShardDataError as e:  # no undo record that fits: its rows cannot be trusted
                    self.note(f"resume at step {step}: shard {s}: {e}; recovering it")
                    self._fail(s)
                    continue
                if ok:
                    done.add(s)
                    rolled.append(n)
                    self.note(f"resume at step {step}: shard {s} at step {applied}, rolled back {n} rows")

        if self.injector is not None:
            self.injector.during("resume")
        self._rebuild = rebuild
        try:
            out = self.run_phase(step + 1, "resume", roll_back)
        finally:
            self._rebuild = False
        self._started_empty.clear()  # from here on an empty shard is a failure
        last_checkpoint = max(c for c in self.counter.at_step if c <= step) if self.checkpointer is not None else step
        for log in self.logs.values():
            log.open_segment((out.to_step if out.rolled_back else last_checkpoint) + 1)
        self._record_trainer_failure(step, t_restart, restored_bytes, sum(rolled))
        return out

    def _interrupted_restores(self) -> list[int]:
        if self.run_dir is None:
            return []
        try:
            return [int(s) for s in json.loads((self.run_dir / IN_RECOVERY).read_text())]
        except (OSError, ValueError):
            return []

    def _load_journal(self) -> None:
        """Rank 0 after a restart: the failures so far are the journal's (the dense state may be
        older than the last of them); the loss accounting follows them."""
        if self.rank != 0 or self.run_dir is None:
            return
        self.failures = read_lines(self.run_dir / FAILURES)
        self.lost = [f["lost_samples"] for f in self.failures if "_since" in f]
        for f in self.failures:
            if "_since" in f:
                self._lost_since[int(f["target"])] = (int(f["_since"][0]), list(f["_since"][1]))

    def _record_trainer_failure(self, step: int, t_restart: float, restored_bytes: int, rolled: int) -> None:
        """Rank 0: one record per trainer death not yet recorded (injected, or seen by the launcher)."""
        if self.rank != 0 or self.run_dir is None:
            return
        seen = {f.get("_death") for f in self.failures}
        for info in read_lines(self.run_dir / TRAINER_FAILURES):
            death = f"{info['rank']}@{info['time']}"
            if death in seen:
                continue
            died_at = info.get("step")
            self._record(
                {
                    "kind": info.get("kind", "trainer"),
                    "target": info["rank"],
                    "step": died_at if died_at is not None else step + 1,
                    "strategy": "restart",
                    **({"shards": info["shards"]} if info.get("shards") else {}),
                    "detected_after_s": round(max(0.0, t_restart - info["time"]), 4),
                    "recovery_s": round(time.time() - t_restart, 4),
                    "restored_bytes": restored_bytes,
                    "rolled_back_rows": rolled,
                    "lost_updates": 0,
                    "lost_samples": 0.0,
                    "replayed_steps": max(0, died_at - step) if died_at else 0,
                    "_death": death,
                }
            )
            rolled = 0  # counted once, on the first

    # -- persistence across trainer restarts ------------------------------------------------------
    def state(self) -> dict:
        return {
            "counter": self.counter.state(),
            "lost": list(self.lost),
            "lost_since": {str(s): [st, tot] for s, (st, tot) in self._lost_since.items()},
            "failures": [dict(f) for f in self.failures],
            "last_update": self._last_update.tolist(),
        }

    def load_state(self, state: dict) -> None:
        self.counter.load(state["counter"])
        self.lost = list(state["lost"])
        self._lost_since = {int(s): (int(v[0]), list(v[1])) for s, v in state.get("lost_since", {}).items()}
        self.failures = [dict(f) for f in state["failures"]]
        if "last_update" in state:
            self._last_update = np.asarray(state["last_update"], dtype=np.int64)


class NoRecovery:
    """The local baseline has no shards: store calls cannot fail, and nothing is recovered."""

    failures: list[dict] = []
    lost: list[float] = []
    logs: dict = {}
    checkpointer = None
    priority = None
    flusher = None
    strategy = None

    def summary_failures(self) -> list[dict]:
        return []

    def guard(self, fn):
        return True, fn()

    def sync(self) -> list[int]:
        return []

    def commit(self, step: int, phase: str) -> Outcome:
        return CONTINUE

    def run_phase(self, step: int, phase: str, fn) -> Outcome:
        fn(None)
        return CONTINUE

    window_steps = 1

    def commit_behind(self, now: int, reads: bool = False) -> Outcome:
        return CONTINUE

    def count_updates(self, updated, step=None) -> None:
        pass

    def on_checkpoint(self, step: int) -> None:
        pass

    def fresh_start(self) -> None:
        pass

    def resume(self, step: int, t_restart: float, restored_bytes: int, rebuild: bool = False) -> Outcome:
        return CONTINUE

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
