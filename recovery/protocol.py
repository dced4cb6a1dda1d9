"""The commit protocol: failures recorded as state, one decision per commit point.

A phase of a step (stage rows, write the sparse update, checkpoint, evaluate, final digest, restart
rollback) runs its store calls under ``Detector.guard``, and so do a writer's priority saves and
flushes: a shard that fails is recorded, not raised. At the phase's commit point (``commit``, a MAX
all-reduce of per-shard flags) every trainer sees the same failed set and they recover together;
rank 0 does the work and tells everyone one ``Verdict``, which each trainer turns into one
``Outcome``: continue, retry the phase (on these shards), or roll back to step N. A shard that fails
while another is being recovered is recovered in the same commit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from embeddings import ShardUnavailableError
from recovery.errors import RecoveryError

MAX_ATTEMPTS = 8  # retries of one phase before the run gives up (shards that keep failing)


@dataclass
class Collective:
    """The few collectives the protocol needs; identity functions with one trainer."""

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


@dataclass
class Verdict:
    """Rank 0's word after a recovery; every trainer learns the same one (``exchange``)."""

    fatal: bool = False
    rollback: int | None = None
    """full (or a rebuild): the checkpoint step every trainer returns to."""
    as_of: dict[int, int] = field(default_factory=dict)
    """Recovered shard -> the step its rows are now as of."""
    redo: set[int] = field(default_factory=set)
    """Recovered shards whose part of the phase runs again (restored to before it)."""
    restored: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Shard -> (the step it was restored from, the newest step a restore brought rows of)."""

    def encode(self, n: int) -> np.ndarray:
        """int64 [2 + 4n]: fatal, rollback + 1, as_of + 2 [n], redo [n], restored from + 2 [n], newest
        + 2 [n] (a shard restored empty is as of step -1). Every field is >= 0 and 0 means "none", so
        a MAX all-reduce of rank 0's array with the zeros of the others is rank 0's verdict."""
        a = np.zeros(2 + 4 * n, dtype=np.int64)
        a[0] = int(self.fatal)
        a[1] = 0 if self.rollback is None else self.rollback + 1
        for s, at in self.as_of.items():
            a[2 + s] = at + 2
        for s in self.redo:
            a[2 + n + s] = 1
        for s, (base, newest) in self.restored.items():
            a[2 + 2 * n + s], a[2 + 3 * n + s] = base + 2, newest + 2
        return a

    @classmethod
    def decode(cls, a: np.ndarray, n: int) -> Verdict:
        recovered = [int(s) for s in np.flatnonzero(a[2 : 2 + n])]
        return cls(
            fatal=bool(a[0]),
            rollback=int(a[1]) - 1 if a[1] > 0 else None,
            as_of={s: int(a[2 + s]) - 2 for s in recovered},
            redo={int(s) for s in np.flatnonzero(a[2 + n : 2 + 2 * n])},
            restored={
                s: (int(a[2 + 2 * n + s]) - 2, int(a[2 + 3 * n + s]) - 2) for s in recovered if a[2 + 2 * n + s] > 0
            },
        )

    @classmethod
    def exchange(cls, mine: Verdict | None, n: int, collective: Collective) -> Verdict:
        """Rank 0 passes its verdict, the others None: every trainer returns rank 0's."""
        a = mine.encode(n) if mine is not None else np.zeros(2 + 4 * n, dtype=np.int64)
        return cls.decode(collective.max_flags(a), n)

    def outcome(self) -> Outcome:
        recovered = tuple(sorted(self.as_of))
        if self.rollback is not None:
            return Outcome(Action.ROLLBACK, recovered, recovered, self.rollback)
        return Outcome(Action.RETRY, recovered, tuple(sorted(self.redo)))


class Detector:
    """The shards this trainer saw fail since the last commit point, and when."""

    def __init__(self, num_shards: int, collective: Collective) -> None:
        self.collective = collective
        self.flags = np.zeros(num_shards, dtype=np.int64)
        self.detected_at: dict[int, float] = {}
        self.call_began: dict[int, float] = {}  # shard -> start of the call that saw it fail
        self._guarded = threading.local()  # .since: start of this thread's guarded call in progress
        self.seen_at: int | None = None  # commit_behind's step: failure records name it

    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """Run a store call; a failed shard is recorded (not raised) for the next commit point."""
        here = self._guarded
        outer, here.since = getattr(here, "since", None), time.time()
        try:
            return True, fn()
        except ShardUnavailableError as e:
            self.fail(e.shard)
            return False, None
        finally:
            here.since = outer

    def fail(self, shard: int) -> None:
        """Record a shard as failed for the next commit point (as ``guard`` does on an error), and
        when the guarded call that saw it began (its time until then is lost: it is redone)."""
        self.flags[shard] = 1
        now = time.time()
        self.detected_at.setdefault(shard, now)
        since = getattr(self._guarded, "since", None)
        self.call_began.setdefault(shard, since if since is not None else now)

    def flagged(self) -> list[int]:
        return np.flatnonzero(self.flags).tolist()

    def take(self) -> np.ndarray:
        """The shards this trainer saw fail since the last commit point, as flags (then cleared)."""
        flags = self.flags.copy()
        self.flags[:] = 0
        return flags

    def sync(self, flags: np.ndarray | None = None) -> list[int]:
        """Failed shards seen by any trainer since the last commit point (a collective); ``flags``:
        this trainer's, taken already (``take``)."""
        flags = self.take() if flags is None else flags
        return [int(s) for s in np.flatnonzero(self.collective.max_flags(flags))]

    def forget(self, shard: int) -> None:
        """The shard is back: its next failure is timed from scratch."""
        self.detected_at.pop(shard, None)
        self.call_began.pop(shard, None)


class CommitPoints:
    """``commit`` and ``run_phase``: the points where trainers agree, and what they do then.

    ``writer``: the sparse write path (``recovery.writer.SparseWriter``), whose write-behind in
    flight is joined when anything failed; ``recover(failed, step, phase) -> Outcome``: the
    recovery every trainer runs together."""

    def __init__(self, detector: Detector, writer, recover: Callable[[list[int], int, str], Outcome], note) -> None:
        self.detector, self.writer, self.recover, self.note = detector, writer, recover, note
        self.failures_seen = 0  # commit points that saw a shard fail

    def commit(self, step: int, phase: str) -> Outcome:
        """All trainers agree on the failed shards; if any, they are recovered. A write-behind in
        flight is joined first when anything failed: its failed shards are recovered with the
        others, and its part on them is redone before the phase's."""
        return self.commit_agreed(step, phase, self.detector.sync(self.take_flags()))

    def take_flags(self) -> np.ndarray:
        """What this trainer saw fail since the last commit point, for the trainers to agree on (its
        write-behind joined first where anything failed): in the commit point's own collective
        (``commit``), or in another one (``stage_ahead``, then ``commit_agreed``)."""
        if self.detector.flags.any():
            self.writer.on_failure_seen()
        return self.detector.take()

    def commit_agreed(self, step: int, phase: str, failed: list[int]) -> Outcome:
        """``commit`` once the trainers agree that ``failed`` failed (in its own collective, or in
        another one: ``take_flags``)."""
        self.writer.keep_redo_of(failed)
        if not failed:
            return CONTINUE
        self.failures_seen += 1
        if self.writer.lockstep:  # every trainer's open window goes to the shards that did not fail, before any restore
            self.writer.on_failure_seen(failed)
        self.note(f"step {step} {phase}: shards {failed} failed")
        return self.recover(failed, step, phase)

    def run_phase(
        self, step: int, phase: str, fn: Callable[[tuple[int, ...] | None], object], after: Outcome | None = None
    ) -> Outcome:
        """Run ``fn(only)`` under the protocol until it commits: ``only`` is None on the first attempt,
        then the shards whose part must run again. Returns CONTINUE or a ROLLBACK outcome. ``after``:
        a first attempt's outcome agreed elsewhere (``stage_ahead``); RETRY runs its shards again,
        anything else the whole phase."""
        only = None
        if after is not None and after.action is Action.RETRY:
            self.writer.drop_redo(set(after.recovered) - set(after.redo))
            only = after.redo
        for _ in range(MAX_ATTEMPTS):
            if only is not None:
                self.writer.redo(only)
                if self.writer.lockstep:  # no trainer reads a shard before its writer redid its part
                    self.detector.collective.barrier()
            if phase == "stage":  # the shards changed behind the steps: every peer row read first
                self._complete_peers()
            self.detector.guard(lambda only=only: fn(only))
            out = self.commit(step, phase)
            if out.action is not Action.RETRY:
                return out
            # restored as of this step or later: the write-behind's rows are there
            self.writer.drop_redo(set(out.recovered) - set(out.redo))
            only = out.redo
        raise RecoveryError(f"{phase} at step {step}: shards kept failing after {MAX_ATTEMPTS} recoveries")

    def stage_ahead(self, step: int, fn: Callable[[tuple[int, ...] | None], object]) -> bool:
        """A step's stage whose commit point rides in the step's dense gather (several trainers,
        gradients reduced in chunk order): ``fn(None)`` run under the guard, no agreement here; the
        trainer hands ``take_flags()`` to that gather and ``commit_agreed`` what comes back before
        anything of the step is kept. -> whether the stage ran (False: a shard failed under it; this
        trainer computes nothing of the step)."""
        self._complete_peers()
        ok, _ = self.detector.guard(lambda: fn(None))
        return ok

    def commit_behind(self, now: int, reads: bool = False) -> Outcome:
        """The commit point of the write-behind in flight (if any): the trainer calls it before the
        next step's update, and with ``reads`` before anything that reads the shards (saves,
        evaluation, the end), which first writes an open window. A shard that failed under it is
        recovered and the write's steps redone there, as a failure during a synchronous update
        would be. With windows, before an update that does not close a window the write in flight
        is left to run. ``now``: the step the trainer is in. A failure record names the step an
        injected failure fired at (else the write's), and ``write_step``, the step whose write saw
        it, where they differ."""
        w = self.writer
        if w.lockstep:
            return self._commit_lockstep(now, reads)
        if w.window is not None and not reads and not w.window.closes_at(now):
            return CONTINUE
        out = self._join_behind(now)
        if not reads or out.rolled_back or w.window is None or not w.window.open:
            return out
        w.write_window()
        return self._join_behind(now)

    def _complete_peers(self) -> None:
        """At a step's stage, with several trainers writing in windows: the rows of the other
        trainers' shards that this trainer no longer keeps (a restore, a rollback or a resume changed
        them behind the steps, on every trainer alike) are read back, once every trainer's write in
        flight is on its shards (joined here, then a barrier). Every window was written when the
        shards changed, and no step has updated a row since but through a window joined here, so the
        shards hold every row as of the step before (``PeerFront.complete_peer_rows``)."""
        w = self.writer
        peers = w.store.peer_rows if w.lockstep else None
        if peers is None or peers.complete:
            return
        self.detector.guard(w.settle_behind)  # a failure: recorded, met at the stage's commit point
        self.detector.collective.barrier()
        self.detector.guard(w.store.complete_peer_rows)

    def _commit_lockstep(self, now: int, reads: bool) -> Outcome:
        """``commit_behind`` with several trainers writing in windows (``SparseWriter.lockstep``):
        at each window's close, and before reads, every trainer joins its write in flight at one
        commit point (a collective, whether or not it has a write in flight); where none failed,
        the last window written becomes the restart point (``SparseWriter.commit_written``)."""
        w = self.writer
        if not reads and not w.closes_at(now):
            return CONTINUE
        out = self._join_lockstep(now)
        if not reads or out.rolled_back:
            return out
        if w.window is not None and w.window.open:
            w.write_window()
        return self._join_lockstep(now)

    def _join_lockstep(self, now: int) -> Outcome:
        seen = self.failures_seen
        out = self._join_behind(now, every_trainer=True)
        if not out.rolled_back and self.failures_seen == seen:
            self.writer.commit_written()
        return out

    def _join_behind(self, now: int, every_trainer: bool = False) -> Outcome:
        """``every_trainer``: the commit point runs whether or not this trainer has a write in flight."""
        step = self.writer.behind_step
        if step is None and every_trainer:
            step = now
        if step is None:
            return CONTINUE
        self.detector.seen_at = now
        try:
            return self.run_phase(step, "update", lambda only: self.writer.settle_behind())
        finally:
            self.detector.seen_at = None
