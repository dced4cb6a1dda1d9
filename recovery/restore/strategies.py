"""One restorer per strategy behind one interface (rank 0): ``recover(failed, step, phase)`` brings
the failed shards back, journals a record per failure, and returns the ``Verdict`` every trainer
acts on. Adding a strategy is one class here and its line in ``RESTORERS``.

- ``partial`` (CPR, ``FromCheckpoint``): a replacement for the failed shard loads that shard's
  snapshot from the newest verified checkpoint; other shards and the dense model keep their state.
  Updates to the shard since that checkpoint are lost and counted.
- ``partial-mfu`` / ``partial-ssu`` (``WithPriority``): as ``partial``, then the newest priority
  save is overlaid.
- ``incremental`` (``WithFlushes``): as ``partial``, then every flush since the checkpoint, in
  order: the shard is as of the last flush.
- ``log`` (``WithLog``): as ``partial``, then the shard's update log is replayed up to the
  failure: nothing lost. The log must prove it reaches that far before the shard is touched.
- ``replica`` (``ByReplica``): the shard's replica is promoted; the writes it had not received
  are lost and counted.
- ``full`` (``Full``): every shard is restored from the checkpoint, and the trainers roll the dense
  state and the readers back to it and recompute from there.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embeddings import ShardUnavailableError
from recovery.accounting import Ledger
from recovery.durable.log import ShardLog
from recovery.durable.manifest import Checkpoint
from recovery.errors import RecoveryError
from recovery.journal import Journal
from recovery.protocol import MAX_ATTEMPTS, Verdict
from recovery.restore.shard_restore import Laps, ShardRestore, no_lap
from recovery.saves import incremental, priority
from recovery.strategy import Strategy


@dataclass
class Restored:
    rec: dict
    as_of: int  # the step the shard's rows are now as of
    base: int  # the step it was restored from (-1: started empty)
    newest: int  # the newest step whose rows a restore brought (an overlay, a flush, a log)


class Restorer:
    """Brings failed shards back under one strategy (rank 0); with ``through_upto``, on a background
    thread while the steps go on (``recovery.restore.through``)."""

    through_upto: int | None = None  # (on that thread) the step of the failure: the log replay stops there

    def __init__(
        self,
        shard_restore: ShardRestore,
        ledger: Ledger,
        writer,
        journal: Journal,
        priority_saver=None,
        flusher=None,
        log_dir: Path | None = None,
    ) -> None:
        self.shard_restore, self.ledger, self.writer, self.journal = shard_restore, ledger, writer, journal
        self.store = shard_restore.store
        self.priority, self.flusher, self.log_dir = priority_saver, flusher, log_dir

    def recover(self, failed: list[int], step: int, phase: str) -> Verdict:
        raise NotImplementedError


class ShardByShard(Restorer):
    """Each failed shard on its own; one that fails while another is restored joins the round. With
    ``parallel``, the shards that failed together (a node's) are restored at once, one thread each."""

    parallel = False

    def restore(self, shard: int, step: int) -> Restored:
        raise NotImplementedError

    def recover(self, failed: list[int], step: int, phase: str) -> Verdict:
        pending, done, retries = list(failed), {}, 0
        self.shard_restore.promoted = set()
        for _ in range(MAX_ATTEMPTS * self.store.num_shards):
            if not pending:
                break
            batch = list(pending) if self.parallel else pending[:1]
            pending = [s for s in pending if s not in batch]
            again = False
            for s, r in self._restore_all(batch, step):
                if isinstance(r, Restored):
                    done[s] = r
                    self.journal.finish(r.rec, phase)
                    self.journal.note(
                        f"step {step}: shard {s} restored from step {r.rec['restored_from_step']}, now as of {r.as_of}"
                    )
                    continue
                e = r  # a shard died while we restored (this one or another)
                self.journal.note(f"step {step}: shard {e.shard} failed while shard {s} was being recovered")
                self.shard_restore.detector.detected_at.setdefault(e.shard, time.time())
                self.journal.mark_in_recovery(sorted({*pending, s, e.shard}))
                pending += [x for x in dict.fromkeys((e.shard, s)) if x not in pending]  # each once
                again = True
            if again:
                retries += 1
                time.sleep(min(0.05 * retries, 1.0))  # a server still starting or loading: give it time
        if pending:
            raise RecoveryError(f"shards {pending} kept failing while being recovered at step {step}")
        verdict = Verdict(as_of={s: r.as_of for s, r in done.items()})
        verdict.restored = {s: (r.base, r.newest) for s, r in done.items()}
        for s, r in done.items():
            # redone: the phase, and the steps of a failed write-behind past the restore (a window
            # written at this commit may hold steps after the phase's)
            if r.as_of < max([step, *self.writer.redo_steps(s)]):
                verdict.redo.add(s)
        return verdict

    def _restore_all(self, shards: list[int], step: int) -> list[tuple[int, Restored | ShardUnavailableError]]:
        """Each shard's restore (on its own thread where there are several): its result or the
        failure that cut it short. Any other error is raised once every restore has ended."""

        def one(s: int) -> Restored | ShardUnavailableError:
            try:
                r = self.restore(s, step)
            except ShardUnavailableError as e:
                return e
            r.rec["_ended_at"] = time.time()
            return r

        if len(shards) == 1:
            return [(shards[0], one(shards[0]))]
        with ThreadPoolExecutor(max_workers=len(shards), thread_name_prefix="restore") as pool:
            futures = [(s, pool.submit(one, s)) for s in shards]
            wait([f for _, f in futures])
        return [(s, f.result()) for s, f in futures]


class FromCheckpoint(ShardByShard):
    """partial: the shard from its newest verified snapshot; what it had since is counted lost."""

    parallel = True

    def restore(self, shard: int, step: int) -> Restored:
        tools = self.shard_restore
        rec = tools.base_record(tools.kind(shard), shard, step)
        lap = Laps(rec)
        # the newest checkpoint is loaded while its snapshot is verified; a corrupt one is undone by
        # the next one's load (nothing reads the shard before this returns)
        for ckpt, check in tools.candidates_for(shard, rec, lap):
            base = ckpt.step if ckpt is not None else 0
            rec["restored_from_step"] = base if ckpt is not None else None
            ahead = self.read_ahead(shard, base, step, lap)
            try:
                rec["restored_bytes"] = tools.restore_shard(shard, ckpt, lap)
            except ShardUnavailableError:
                raise  # a server that went away, not its file: the round retries it
            except Exception:
                if tools.confirm(check, rec, lap, failed=True):
                    raise
                continue  # a load that failed on a file that does not verify: the next checkpoint
            if tools.confirm(check, rec, lap):
                break
        as_of = base if ckpt is not None else -1
        as_of, newest = self.lay_on(shard, ckpt, step, rec, lap, ahead, as_of)
        return Restored(rec, as_of, base if ckpt is not None else -1, newest)

    def read_ahead(self, shard: int, base: int, step: int, lap) -> object:
        """What must be read (and proven) before the shard is touched."""
        return None

    def lay_on(self, shard: int, ckpt: Checkpoint | None, step: int, rec: dict, lap, ahead, as_of: int):
        """What goes on the restored snapshot; -> (as of, newest step brought)."""
        self.count_lost(shard, step, rec, as_of)
        return as_of, as_of

    def count_lost(self, shard: int, step: int, rec: dict, as_of: int, saved: int = 0) -> None:
        """The interrupted step resumes on the restored shard: the updates since ``as_of`` are lost."""
        self.ledger.partial(rec, shard, as_of, step - 1, saved, self.writer.redo_steps(shard))

    def note_corrupt(self, rec: dict, shard: int, step: int):
        def note(e: Exception) -> None:  # not used: what it held is counted lost
            rec.setdefault("corrupt_saves", []).append(str(e))
            self.journal.note(f"step {step}: shard {shard}: {e}")

        return note


class WithPriority(FromCheckpoint):
    """partial-mfu / partial-ssu: the newest priority save overlaid on the snapshot."""

    def lay_on(self, shard, ckpt, step, rec, lap, ahead, as_of):
        if self.priority is None:
            return super().lay_on(shard, ckpt, step, rec, lap, ahead, as_of)
        base = ckpt.step if ckpt is not None else 0
        nbytes, saved, at = priority.overlay(
            self.priority.dir, self.store, shard, base, step - 1, on_corrupt=self.note_corrupt(rec, shard, step)
        )
        rec["restored_bytes"] += nbytes
        rec["saved_updates"] = saved
        lap("overlay")
        self.count_lost(shard, step, rec, as_of, saved)
        return as_of, max(as_of, at)


class WithFlushes(FromCheckpoint):
    """incremental: every flush since the snapshot, in order: the shard is as of the last flush."""

    def lay_on(self, shard, ckpt, step, rec, lap, ahead, as_of):
        if self.flusher is None:
            return super().lay_on(shard, ckpt, step, rec, lap, ahead, as_of)
        newest = as_of
        if ckpt is None:
            # no checkpoint to lay flushes on: those before the oldest checkpoint kept are gone,
            # so the later ones alone would leave rows dirtied only in those as fresh values.
            # The shard restarts empty and every update since step 0 is counted lost.
            rec["flushed_to_step"] = None
        else:
            nbytes, as_of = incremental.replay(
                self.flusher.dir, self.store, shard, ckpt.step, step - 1, on_corrupt=self.note_corrupt(rec, shard, step)
            )
            newest = max(newest, as_of)
            rec["restored_bytes"] += nbytes
            rec["flushed_to_step"] = as_of
            lap("replay")
        self.count_lost(shard, step, rec, as_of)
        return as_of, newest


class WithLog(FromCheckpoint):
    """log: the shard's log replayed on the snapshot up to the failure: nothing lost."""

    def read_ahead(self, shard, base, step, lap):
        # the shard must come back as of every step before the phase's (and before the first step
        # of a failed write-behind, which is redone): the log proves it reaches that far before
        # anything on the shard is touched
        need = min([step, *self.writer.redo_steps(shard)]) - 1
        return self.read_log(shard, base, need, lap)

    def lay_on(self, shard, ckpt, step, rec, lap, ahead, as_of):
        groups, replayed, as_of_log = ahead
        if groups:
            self.store.lay_rows(shard, groups, step=as_of_log)
        lap("replay_write")
        rec["restored_bytes"] += replayed
        rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        return as_of_log, max(as_of, as_of_log)

    def read_log(self, shard: int, after_step: int, need: int, lap=no_lap) -> tuple[list, int, int]:
        """The shard's logged rows of the complete steps after ``after_step``, each row's newest;
        the log must reach ``need`` (``LogGapError`` otherwise). -> ((table, ids, rows) groups to
        write, bytes read, the last step they hold or ``after_step``)."""
        if self.log_dir is None:
            raise RecoveryError("log recovery needs --log-dir")
        out = log_groups(self.log_dir, shard, after_step, need, self.through_upto)
        lap("replay_read")
        return out


def log_groups(log_dir: Path, shard: int, after_step: int, need: int, upto: int | None = None) -> tuple[list, int, int]:
    """``WithLog.read_log``'s work (``upto``: no step after it, ``through_upto``): each logged row's
    newest value, grouped per table, to be written in one ``lay_rows`` (one HSET per bucket
    where the rows are dense, else one per row, pipelined). -> (groups, bytes read, last step)."""
    records, last = ShardLog(log_dir, shard).replay(after_step, need)
    if upto is not None:  # its writer appends the outage's steps meanwhile: back as of the failure
        records, last = [r for r in records if r.step <= upto], min(last, upto)
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
    return groups, replayed, last


class ByReplica(ShardByShard):
    """replica: the shard's replica promoted; nothing is loaded. The steps it had not received are lost."""

    def restore(self, shard: int, step: int) -> Restored:
        tools, store = self.shard_restore, self.store
        rec = tools.base_record(tools.kind(shard), shard, step)
        failed_endpoint = store.endpoint(shard)
        if store.cluster is not None or shard in tools.promoted:
            tools.await_server(shard)  # the cluster promotes a replica itself; or promoted, not ready yet
        else:
            store.promote(shard)
            tools.promoted.add(shard)
        at = store.applied_step(shard) or 0
        rec.update(promoted=store.endpoint(shard), failed_endpoint=failed_endpoint)
        rec["restored_from_step"], rec["restored_bytes"] = at, 0
        completed = step - 1
        if store.cluster is not None and rec["promoted"] == failed_endpoint and at >= completed:
            # the same primary, every write on it: the cluster refused the shard for a while
            # (CLUSTERDOWN while another shard's primary failed over), but it did not fail
            rec["transient"] = True
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        else:
            self.ledger.replica(rec, shard, at, completed, self.writer.redo_steps(shard))
        return Restored(rec, at, at, at)  # the replica holds every write up to its applied step


class Full(Restorer):
    """full: every shard back to one checkpoint whose files all verify; the trainers roll back to it.
    ``rebuild``: the dense state was damaged, whatever the strategy (the record's kind says so)."""

    rebuild = False

    def recover(self, failed: list[int], step: int, phase: str) -> Verdict:
        tools, n = self.shard_restore, self.store.num_shards
        rec = tools.base_record("dense-state" if self.rebuild else tools.kind(failed[0]), failed[0], step)
        rec["failed_shards"] = failed
        ckpt = tools.checkpoint_for(list(range(n)), rec, whole=True)
        if ckpt is None:
            corrupt = "; ".join(rec.get("corrupt_checkpoints", [])) or "none was taken"
            where = tools.checkpointer.dir if tools.checkpointer is not None else "(checkpoints off)"
            raise RecoveryError(
                f"full recovery of shards {failed} at step {step}: no verified checkpoint in {where} ({corrupt})"
            )
        rec["restored_from_step"] = ckpt.step
        with ThreadPoolExecutor(max_workers=n, thread_name_prefix="restore") as pool:  # every shard at once
            rec["restored_bytes"] = sum(pool.map(lambda s: tools.restore_shard(s, ckpt), range(n)))
        rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        rec["recomputed_steps"] = step - 1 - ckpt.step
        self.journal.finish(rec, phase)
        every = range(n)
        return Verdict(
            rollback=ckpt.step,
            as_of=dict.fromkeys(every, ckpt.step),
            redo=set(every) if ckpt.step < step else set(),
            restored=dict.fromkeys(every, (ckpt.step, ckpt.step)),
        )


RESTORERS: dict[Strategy, type[Restorer]] = {
    Strategy.FULL: Full,
    Strategy.PARTIAL: FromCheckpoint,
    Strategy.PARTIAL_MFU: WithPriority,
    Strategy.PARTIAL_SSU: WithPriority,
    Strategy.INCREMENTAL: WithFlushes,
    Strategy.LOG: WithLog,
    Strategy.REPLICA: ByReplica,
}
