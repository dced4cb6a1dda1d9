"""The sparse write path: a step's rows from the trainer to the shards, their logs and replicas.

``apply`` runs the row optimizer once over every shard's rows this trainer writes, writes the shards
in parallel and group-commits the rows to the shards' logs; a failed shard is recorded with the
``Detector`` and does not stop the others. With one trainer the write goes behind (the store's
write-behind thread; ``CommitPoints.commit_behind`` is its commit point), and with ``write_every`` K
in windows of K steps (``recovery.window``): a window's rows reach the shards in one write when it
closes, a failure seen anywhere closes it at once, and a shard that failed under a write redoes
that write's steps once recovered (``redo``).

Several trainers write behind in windows only (``lockstep``: ``recovery.factory.writes_behind`` says
where): every trainer's window closes at the same steps, and its write is joined at the next close
at one commit point of them all (``CommitPoints.commit_behind``). Only then is it known that every
shard took the window, so the dense state saved at its step becomes the restart point there
(``commit_written``, on the trainer that saves it), and a barrier keeps every trainer's next window
from moving before that: the restart point is never more than one window behind any shard, whose
undo record takes it back (``Markers.rollback``).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from embeddings import RedisStore, ShardUnavailableError, rowkeys
from embeddings.bags.module import sum_by_key
from recovery.durable.log import ShardLog
from recovery.errors import RecoveryError
from recovery.protocol import Detector
from recovery.window import Window, closes_window


def _wait_all(pending: list, durable: Callable[[], None] | None = None) -> None:
    """On the write-behind thread, before a write moves: each log's records handed over before
    (``ShardLog.pending``) are written, then ``durable`` has returned (a dense state becomes the
    restart point only once the logs hold its steps)."""
    for log, future in pending:
        log.wait_for(future, behind=True)
    if durable is not None:
        durable()


class SparseWriter:
    def __init__(
        self,
        store: RedisStore,
        detector: Detector,
        logs: dict[int, ShardLog],
        replica_wait: bool = False,
        write_behind: bool = False,
        write_every: int = 1,
        committer_of: Callable[[int], Callable[[], None] | None] = lambda step: None,
        lockstep: bool = False,
    ) -> None:
        self.store, self.detector, self.logs = store, detector, logs
        self.replica_wait, self.write_behind = replica_wait, write_behind
        # step -> a wait that makes the dense state saved at ``step`` the restart point (or None): a
        # window's write runs it before its rows move (``DenseSaver.committer``)
        self.committer_of = committer_of
        held = store.row_cache
        self.lockstep, self._every = lockstep, write_every  # several trainers: windows closed together
        self.window = (
            Window(held, write_every)
            if write_behind and write_every > 1 and held is not None and held.holds_all()
            else None
        )
        # ([(update, step)], step, keys, rows, shards) of the write in flight (one step's, or a
        # window's); shard -> the (update, step)s of a write-behind that failed there, redone in
        # order once the shard is recovered
        self._behind: tuple | None = None
        self.redo_of: dict[int, list[tuple[object, int]]] = {}
        self.redo_seen: dict[int, list[int]] = {}  # several trainers: shard -> its writer's redo steps (first, last)
        self._redone: set[int] = set()
        self.as_of: dict[int, int] = {}  # the step each shard's last restore brought it to
        self.last_logged: dict[int, int] = {}  # shard -> the last step this writer handed to its log
        self.written_to = 0  # the step the last window written (or the restart's dense state) is as of

    @property
    def window_steps(self) -> int:
        """Steps per write-behind window (1: every step's rows are written after it)."""
        return self.window.every if self.window is not None else self._every if self.lockstep else 1

    def closes_at(self, step: int) -> bool:
        """Whether a window closes at ``step`` (every step without windows)."""
        return closes_window(step, self.window_steps)

    def commit_written(self) -> None:
        """Several trainers, at a commit point that joined every trainer's write behind and saw no
        failure: the dense state saved at the step the last window written is as of becomes the
        restart point (on the trainer that saves it), then a barrier: no trainer's next window moves
        before it is."""
        commit = self.committer_of(self.written_to) if self.written_to >= 0 else None
        if commit is not None:
            commit()
        self.detector.collective.barrier()

    def close(self) -> None:
        """The trainer closes: an open window is let go unwritten (its pins with it), as a process
        that died would leave it; the trainer built next resumes from the dense state."""
        if self.window is not None:
            self.window.clear()

    @property
    def behind_step(self) -> int | None:
        """The step of the write-behind in flight, if any."""
        return self._behind[1] if self._behind is not None else None

    def redo_steps(self, shard: int) -> list[int]:
        """The steps of failed write-behinds that ``shard`` redoes once recovered (several trainers:
        its writer's, the first and last, as every trainer learned them before a restore: ``redo_seen``)."""
        return [st for _, st in self.redo_of.get(shard, [])] or self.redo_seen.get(shard, [])

    # -- one step's write -------------------------------------------------------------------------
    def apply(
        self, owned, step: int, only=None, behind: bool = False, durable: Callable[[], None] | None = None
    ) -> None:
        """Write this step's rows of the shards this trainer owns, then group-commit them to the
        shards' logs. ``owned``: a ``StepUpdate`` (sorted packed keys, gradients, shards) or a dict
        table name -> (ids, grads). ``behind`` (with ``write_behind``, first attempt only): the write
        goes to the write-behind thread. Its records are handed to the logs first (after the last
        step's are written): the step's rows move only once the step before is in the logs, as for a
        synchronous write. ``durable``: a wait for what must be written before the step's rows move
        (the dense state of the step before), run on the thread that moves them."""
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
        away = self.store.away_mask(keys)
        if away is not None:  # rows of shards restored in the background (--train-through)
            self._apply_away(keys[away], grads[torch.from_numpy(np.flatnonzero(away))], shards[away], step)
            here = np.flatnonzero(~away)
            keys, grads, shards = keys[here], grads[torch.from_numpy(here)], shards[here]
        if not len(keys):
            if behind and self.window is not None and self.window.open and self.window.closes_at(step):
                self.write_window()  # closed with the other trainers' (lockstep), rows of this step or not
            return
        try:
            current = self.store.read_keys(keys)  # held rows: no I/O
        except ShardUnavailableError as e:  # some rows had to come from a shard that is down: shard by shard
            if self.window is not None and self.window.open:  # its rows first, as of the step before
                self.settle_behind()
                self.write_window(skip=sorted({e.shard, *self.detector.flagged()}))
                self.settle_behind()
            elif behind and durable is not None:
                durable()
            self._apply_by_shard(keys, grads, shards, step)
            return
        new = self.store.optimizer.apply(torch.from_numpy(current), grads, step).numpy()  # t: steps count from 1
        if behind:
            self._hand_behind(owned, step, keys, current, new, shards, durable)
            return
        failed = self.store.write_step(keys, new, shards, step, undo=current)
        for s in failed:
            self.detector.fail(s)
        if self.logs or self.replica_wait:
            for s in np.unique(shards).tolist():
                if s not in failed:
                    at = np.flatnonzero(shards == s)
                    self._written(s, step, keys[at], new[at])

    def _apply_away(self, keys: np.ndarray, grads, shards: np.ndarray, step: int) -> None:
        """A step's rows of shards that are away: updated in their outage's rows (``embeddings.store.outage``);
        the exact ones go to the logs as usual (a step with none logs an empty record: the log stays
        whole), the others keep their gradients for the restored rows."""
        current = self.store.read_keys(keys)
        new = self.store.optimizer.apply(torch.from_numpy(current), grads, step).numpy()
        g = grads.detach().numpy() if isinstance(grads, torch.Tensor) else np.asarray(grads, np.float32)
        exact = self.store.update_away(keys, new, g, step)
        for s in np.unique(shards).tolist():
            at = np.flatnonzero((shards == s) & exact)
            self.log_step(step, s, keys[at], new[at] if len(at) else np.zeros((0, 0), np.float32))

    def _hand_behind(self, owned, step, keys, current, new, shards, durable) -> None:
        if self._behind is not None and self.window is None:
            raise RecoveryError(f"step {step}: the write-behind of step {self._behind[1]} was not committed")
        # the step's records go to the logs now, beside its write (see ``settle_behind``); the
        # write-behind thread waits for the last step's before this step's rows move
        before = [(log, log.pending()) for log in self.logs.values()]
        if self.logs:
            for s in np.flatnonzero(np.bincount(shards, minlength=self.store.num_shards)).tolist():
                log = self.logs.get(s)
                if log is not None:  # its rows picked and grouped on the log's thread
                    self._logged(s, step)
                    log.append_keys(step, keys, new, shards)
        if self.window is not None:  # held now, written when the window closes
            self.window.add(owned, step, keys, current)  # before the rows are pinned: it finds the new ones by that
            self.store.hold_written(keys, new, shards, step, pin=True)
            if self.window.closes_at(step):
                self.write_window(before)
            return
        self.store.write_behind(keys, new, shards, step, undo=current, before=lambda: _wait_all(before, durable))
        self._behind = ([(owned, step)], step, keys, new, shards)

    def log_step(self, step: int, shard: int, keys: np.ndarray, rows: np.ndarray, wait: bool = True) -> int:
        """Group-commit this step's rows written to ``shard`` (sorted packed keys) to its log."""
        log = self.logs.get(shard)
        if log is None:
            return 0
        groups = [(t, ids, rows[lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(keys).items()]
        self._logged(shard, step)
        return log.append_step(step, groups, wait)

    def _logged(self, shard: int, step: int) -> None:
        self.last_logged[shard] = max(step, self.last_logged.get(shard, step))

    def _wait_logs(self) -> None:
        """The previous step's records are written before this step's rows move."""
        for log in self.logs.values():
            log.wait()

    def _written(self, s: int, step: int, keys: np.ndarray, rows: np.ndarray) -> None:
        self.log_step(step, s, keys, rows)
        if self.replica_wait and self.store.has_replica(s):
            self._replicated(s)

    def _replicated(self, s: int) -> None:
        self.detector.guard(lambda: self.store.wait_replicated(s, int(1000 * self.store.timeout_s)))

    def _apply_by_shard(self, keys: np.ndarray, grads, shards: np.ndarray, step: int) -> None:
        for s in np.unique(shards).tolist():
            at = np.flatnonzero(shards == s)
            ok, written = self.detector.guard(
                lambda at=at: self.store.apply_keys(keys[at], grads[torch.from_numpy(at)], step)
            )
            if ok:
                self._written(s, step, keys[at], written)

    def _update_of(self, grads_by_name: dict) -> SimpleNamespace:
        """table name -> (ids, grads [n, dim]) as sorted unique keys, summed gradients and shards."""
        index = {n: self.store.tables.index(n) for n in grads_by_name}
        keys, order = rowkeys.from_tables({index[n]: ids for n, (ids, _) in grads_by_name.items()})
        blocks = [torch.as_tensor(np.asarray(grads_by_name[n][1], np.float32)) for n in sorted(index, key=index.get)]
        keys, grads = sum_by_key(keys, torch.cat(blocks)[torch.from_numpy(order)])
        return SimpleNamespace(keys=keys, grads=grads, shards=self.store.shard_map.shard_of_keys(keys))

    # -- write-behind and windows -----------------------------------------------------------------
    def write_window(self, before: list | None = None, skip: list[int] = ()) -> None:
        """The open window's rows to the write-behind thread (the write before it is committed).
        They move once the dense state as of the last window written is the restart point and the
        logs hold the steps before (``before``: the log records pending then; default: all).
        ``skip``: failed shards, which get none of it: they redo its steps once recovered."""
        if self._behind is not None:
            raise RecoveryError(f"the write-behind of step {self._behind[1]} was not committed")
        keys, rows, undo, updates = self.window.take()
        step = updates[-1][1]
        shards = self.store.shard_map.shard_of_keys(keys)
        if len(skip):
            mine = set(np.unique(shards).tolist()) if self.lockstep else set(skip)  # several trainers: its own
            for s in skip:
                if s in mine:
                    self.redo_of.setdefault(s, []).extend(updates)
            keep = ~np.isin(shards, skip)
            keys, rows, undo, shards = keys[keep], rows[keep], undo[keep], shards[keep]
        if before is None:
            before = [(log, log.pending()) for log in self.logs.values()]
        # several trainers: the restart point moves at a commit point of them all (``commit_written``)
        durable = None if self.lockstep else self.committer_of(self.written_to)

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
            after=None if len(skip) or self.lockstep else written,  # a skipped shard has not got the window yet
        )
        self._behind = (updates, step, keys, rows, shards)
        self.written_to = step

    def settle_behind(self) -> None:
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
        if failed and self.window is not None:
            self.written_to = -1  # not every shard took it: its dense state never becomes the restart point
        for s in failed:
            self.detector.fail(s)
            self.redo_of.setdefault(s, []).extend(updates)
        if self.replica_wait:
            for s in np.unique(shards).tolist():
                if s not in failed and self.store.has_replica(s):
                    self._replicated(s)

    def on_failure_seen(self, failed: list[int] | None = None) -> None:
        """At a commit point where a shard failed (``failed``; default: those this trainer saw): the
        write-behind in flight is joined, and the open window's rows go now, to the shards that did
        not fail: the failed ones redo its steps once recovered (nothing may reach them before, or
        their marker would pass a failed write's steps)."""
        self.settle_behind()
        if self.window is not None and self.window.open:
            self.write_window(skip=self.detector.flagged() if failed is None else sorted(set(failed)))
            self.settle_behind()

    def redo(self, only: tuple[int, ...]) -> None:
        """Recovered shards that a write-behind had failed on: its steps' updates again, in order,
        synchronously (the steps its log or its replica already brought it to are not redone)."""
        for s in sorted(set(only) & set(self.redo_of)):
            todo = [(u, step) for u, step in self.redo_of[s] if self.as_of.get(s, -1) < step]
            if not todo:
                del self.redo_of[s]
                continue
            self._redone.add(s)
            for update, step in todo:
                ok, _ = self.detector.guard(lambda s=s, update=update, step=step: self.apply(update, step, (s,)))
                if not ok:
                    break

    def keep_redo_of(self, failed: list[int]) -> None:
        """At a commit point: shards redone since the last one that did not fail again are done."""
        for s in self._redone - set(failed):
            self.redo_of.pop(s, None)
        self._redone.clear()

    def drop_redo(self, shards) -> None:
        for s in shards:
            self.redo_of.pop(s, None)

    def on_rollback(self, to_step: int) -> None:
        """Full recovery rolled the run back to checkpoint ``to_step``: nothing in flight, nothing
        to redo, the logs cut back to it."""
        self._behind = None  # joined at the commit point that rolled back
        self.redo_of.clear()
        if self.window is not None:
            self.window.clear()
        self.written_to = to_step
        self.last_logged = {s: min(at, to_step) for s, at in self.last_logged.items()}
        for log in self.logs.values():
            log.truncate_after(to_step)
            log.open_segment(to_step + 1)

    def rehold(self, s: int, restored: tuple[int, int] | None, replays_log: bool, priority_saver=None) -> None:
        """After shard ``s`` was recovered: a log replay up to the last step this writer logged for
        it left exactly the rows it holds (a failed write-behind's too: they were held when handed
        over, and logged): they are held again without a read. Any other restore took the shard
        back to the step it was restored from (plus rows of later steps up to the newest it
        restored, ``restored``): the rows this writer last wrote before that step are held again,
        the rows it first wrote after the newest are known never written, and the rest are read back."""
        last = self.last_logged.get(s)
        if replays_log and last is not None and self.as_of.get(s, -1) >= last:
            self.store.reinstate_held(s)
            return
        base, newest = restored if restored is not None else (None, None)
        overlay = None
        if base is not None and newest > base and priority_saver is not None and not replays_log:
            keys = priority_saver.exact_rows(s, newest)  # the save overlaid is this writer's newest
            overlay = (keys, newest) if keys is not None else None
        self.detector.guard(lambda: self.store.reload_held(s, base, newest, overlay))
