"""Starts and restarts: a fresh run's cleanup, a trainer restart's way back to its dense state, and
which logs, saves and flushes a run keeps.

After a restart with the dense state at step S every shard goes back to S: logs lose their records
after S; shards that applied S + 1 undo it (their undo records); shards that are dead (a node failure
takes its shards too), behind, or whose restore was cut short are recovered under the run's strategy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from embeddings import ShardDataError
from recovery.core import RecoveryCore
from recovery.durable import layout
from recovery.durable.checkpoint import Checkpointer
from recovery.durable.log import ShardLog
from recovery.inject import Injector
from recovery.protocol import Outcome
from recovery.restore.through import TrainThrough
from recovery.saves import incremental, priority


class Restarts:
    def __init__(
        self,
        core: RecoveryCore,
        log_dir: Path | None = None,
        priority_saver=None,
        flusher=None,
        checkpointer: Checkpointer | None = None,
        injector: Injector | None = None,
    ) -> None:
        self.store, self.rank, self.collective, self.detector = core.store, core.rank, core.collective, core.detector
        self.writer, self.ledger, self.journal, self.shard_restore = (
            core.writer,
            core.ledger,
            core.journal,
            core.shard_restore,
        )
        self.log_dir, self.priority, self.flusher = log_dir, priority_saver, flusher
        self.checkpointer, self.injector = checkpointer, injector

    def drop_saves_after(self, step: int) -> None:
        """Rank 0: priority saves and flushes of steps after ``step`` are an earlier run's (or of steps
        a restart took back): a restore must never overlay them."""
        if self.priority is not None:
            priority.drop_after(self.priority.dir, step)
        if self.flusher is not None:
            incremental.drop_after(self.flusher.dir, self.store.num_shards, step)

    def fresh_start(self, t_restart: float | None = None) -> None:
        """A new run (rank 0): log segments, saves and markers in the folders are an earlier run's.
        And every shard back to step 0: a trainer restarted before the first dense state became
        the restart point starts afresh, while the first write (step 1's rows, or the first
        window's) may be on the shards, or cut short there; its undo record takes it back, as a
        restart with the dense state at step 0 would (a shard that never applied one, or one further
        on, is left). The same run started again (``Journal.clear``) records its trainers' deaths
        with step 0 as the restart point (every step before them redone; ``t_restart``: when the
        group learned of the death, else now)."""
        if self.rank == 0:
            t_restart = time.time() if t_restart is None else t_restart
            self.drop_saves_after(0)
            if self.log_dir is not None:
                for seg in layout.log_segments(self.log_dir):
                    seg.unlink()
            again = self.journal.clear()
            for s in range(self.store.num_shards):
                # a shard that does not answer is failed here and met by the protocol at its first use
                self.detector.guard(lambda s=s: self._undo_first_write(s))
            if again:
                self.journal.record_trainer_failures(0, t_restart, 0, 0)
        self.collective.barrier()
        for log in self.writer.logs.values():
            log.open_segment(1)

    def _undo_first_write(self, shard: int) -> None:
        """Shard back to step 0 where it holds the first write alone (its marker at most 1); a shard
        further on is another run's (a fresh start in its namespace) and is left as it is."""
        applied = self.store.applied_step(shard)
        if applied is None or applied <= 1:
            self.store.rollback(shard, 0)

    def resume(
        self,
        step: int,
        t_restart: float,
        restored_bytes: int,
        rebuild: bool,
        run_phase: Callable[[int, str, Callable], Outcome],
    ) -> Outcome:
        """Every shard back to ``step`` (the dense state's) under ``run_phase`` (the protocol, whose
        recoveries restore every shard from a checkpoint with ``rebuild``). Returns its outcome
        (``full`` or ``rebuild`` roll back further)."""
        rolled: list[int] = []
        shards = range(self.store.num_shards)
        truncating: list[Future] = []
        pool = ThreadPoolExecutor(max(1, min(16, 2 * self.store.num_shards)), thread_name_prefix="resume")
        self.writer.written_to = step
        if self.ledger.keep_recent:  # the totals a loss is measured from
            self.ledger.recent[step] = self.ledger.counter.total.copy()
        if self.journal.load():
            # an outage cut short by the restart keeps its record (``recovery.restore.through``)
            TrainThrough.record_interrupted(self.journal, step, self.store.num_shards)
            self.ledger.from_journal(self.journal.failures)
        if self.rank == 0:
            TrainThrough.check_restart(
                self.journal.run_dir, self.store.num_shards, self.shard_restore.strategy.replays_log
            )
            self.drop_saves_after(step)
            for s in self.journal.interrupted_restores():
                self.detector.fail(s)
        # each shard's writer cuts its log after ``step`` (a log is its writer's), each on a thread of
        # its own beside rank 0's rollback; a cut in the process that wrote the records needs no framing
        truncating = [pool.submit(log.truncate_after, step) for log in self.writer.logs.values()]
        done: set[int] = set()

        def roll_back(only) -> None:
            try:
                if self.rank != 0:
                    return
                if rebuild:
                    if only is None:
                        for s in shards:
                            self.detector.fail(s)
                    return
                todo = [s for s in shards if s not in done or (only is not None and s in only)]
                # side by side: each shard's round trips and undo write are its own
                got = pool.map(lambda s: self._roll_back_shard(s, step, only is not None and s in only), todo)
                for s, n in zip(todo, got):
                    if n is not None:
                        done.add(s)
                        rolled.append(n)
            finally:
                # every log is cut before the commit point (every trainer's), whose recoveries replay them
                while truncating:
                    truncating.pop().result()

        if self.injector is not None:
            self.injector.during("resume")
        try:
            out = run_phase(step + 1, "resume", roll_back)
        finally:
            for f in truncating:  # a failure before the phase ran them: no cut left half done behind
                f.result()
            pool.shutdown()
        self.shard_restore.started_empty.clear()  # from here on an empty shard is a failure
        counter = self.ledger.counter
        last_checkpoint = max(c for c in counter.at_step if c <= step) if self.checkpointer is not None else step
        # this trainer cut its logs after ``step`` above (torn tails too), unless it rolled back further
        cut = not out.rolled_back
        for log in self.writer.logs.values():
            log.open_segment((out.to_step if out.rolled_back else last_checkpoint) + 1, cut=cut)
        self.journal.record_trainer_failures(step, t_restart, restored_bytes, sum(rolled))
        return out

    def _roll_back_shard(self, s: int, step: int, recovered: bool) -> int | None:
        """Shard ``s`` on its own to ``step``: undo ``step + 1``; -> rows rolled back, or None. A shard
        that cannot get there (dead, empty, ahead by more than one write, or behind ``step``, as a
        restore that its trainers never acted on or a server restarted from an old dump leaves it)
        is failed here and recovered under the run's strategy, which counts what a partial one
        loses. A shard recovered here is as of its restore (a log replay proves it reached ``step``)."""
        d, note = self.detector, self.journal.note
        ok, applied = d.guard(lambda: self.store.applied_step(s))
        if not ok:
            note(f"resume at step {step}: shard {s} unavailable")
            return None
        empty = applied is None and step > 0  # a server that came back empty (--resume): any strategy
        # behind: a write that updated rows on it after its marker's step is not there (a shard with
        # no row in a step keeps its marker: that is not behind)
        behind = applied is not None and applied < min(step, int(self.ledger.last_update[s]))
        if not recovered and (empty or behind):
            note(f"resume at step {step}: shard {s} is at step {applied}, behind; recovering it")
            if empty and s in self.shard_restore.local and not d.flags[s]:  # --resume started it: nothing failed
                self.shard_restore.started_empty.add(s)
            d.fail(s)
            return None
        try:
            ok, n = d.guard(lambda: self.store.rollback(s, step))
        except ShardDataError as e:  # no undo record that fits: its rows cannot be trusted
            note(f"resume at step {step}: shard {s}: {e}; recovering it")
            d.fail(s)
            return None
        if not ok:
            return None
        note(f"resume at step {step}: shard {s} at step {applied}, rolled back {n} rows")
        return n


def trim_kept(checkpointer: Checkpointer | None, log_dir: Path | None, flusher, num_shards: int) -> None:
    """Rank 0, after a manifest: log segments and flushes that every kept checkpoint covers can go.
    (Not just those before the newest: if the newest turns out corrupt, log recovery falls back to
    an older checkpoint and must still replay exactly.)"""
    if checkpointer is None:
        return
    oldest = min(k.step for k in checkpointer.candidates())
    if flusher is not None:
        incremental.drop_before(flusher.dir, num_shards, oldest)
    if log_dir is None:
        return
    for s in range(num_shards):
        ShardLog(log_dir, s).drop_before(oldest)
