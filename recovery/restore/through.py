"""Training through a shard's failure (``--train-through``): nobody waits for a restore.

When a shard fails in a step's stage or update (the phases every step runs), the trainers agree on
it at the commit point as usual, but instead of waiting for rank 0 to restore it:

1. the shard goes **away** on every trainer: its writer seeds the shard's outage rows
   (``embeddings.store.outage.OutageRows``) with the rows it held, exact under ``log`` (its log brings
   the shard back to exactly what it wrote), a fallback under the partial strategies (the restore
   takes the shard back to an older state); a row known never written is exact under any;
2. rank 0 runs the strategy's restorer on a background thread (replacement server, checkpoint,
   then the overlay: priority save, flushes or log replay), with the update counts as of the failure;
3. the phase runs again on the shard, and the steps go on: reads of its rows are answered from the
   outage rows (with several trainers, handed to all: every trainer reads the same value), exact
   updates land there, and the other rows keep their summed gradients in step order;
4. at the start of every step the trainers agree (one collective) whether the restore is done; once
   it is, the shard **rejoins** there: every trainer reconnects, its writer applies the kept
   gradients to the restored rows, writes those and the exact rows it updated (logging the late
   ones under ``log``: the log holds what the shard holds), and the failure's record is written
   with what the outage cost (``trained_through_steps``, ``waited_s``, rows read exactly and from
   the fallback, updates applied late).

The run waits for the restore instead (``end``, one line where it is not a save's) before anything
that reads every shard (a checkpoint, a priority save, a flush, an evaluation, the end), when
another shard fails, and when the outage rows and kept gradients of a trainer pass the budget
(``--through-budget-mb``).
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from embeddings import ShardUnavailableError, rowkeys
from embeddings.store.outage import OutageRows
from embeddings.store.row_cache import ABSENT
from recovery.accounting import Ledger
from recovery.core import RecoveryCore
from recovery.durable import layout
from recovery.durable.files import write_atomic
from recovery.errors import PeerError, RecoveryError
from recovery.journal import Journal
from recovery.protocol import Action, Outcome, Verdict
from recovery.restore.strategies import Restorer
from recovery.strategy import Strategy

THROUGH = (Strategy.PARTIAL, Strategy.PARTIAL_MFU, Strategy.PARTIAL_SSU, Strategy.INCREMENTAL, Strategy.LOG)
THROUGH_PHASES = ("stage", "update")  # a failure seen in any other phase is waited for


class DeferredJournal:
    """The background restore's journal: notes go through at once; its records wait for the rejoin,
    where what the outage cost is added to them."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal
        self.finished: list[tuple[dict, str]] = []

    def note(self, what: str) -> None:
        self.journal.note(what)

    def mark_in_recovery(self, shards: list[int]) -> None:
        self.journal.mark_in_recovery(shards)

    def finish(self, rec: dict, phase: str) -> None:
        ended = rec.pop("_ended_at", None) or time.time()  # recovery_s runs on to the rejoin
        rec["restore_s"] = round(ended - rec["_detected_at"], 4)
        self.finished.append((rec, phase))


class TrainThrough:
    """The outages of one trainer's run: begun at a commit point, polled at every step's start,
    ended at a rejoin every trainer agrees on. It owns the outage rows (``outage``, made at the
    first outage): the store's reads are given them (``RedisStore.attach_outage``), and whether a
    shard is away is theirs to say (``active``)."""

    outage: OutageRows | None = None  # the rows of the shards away, this run's (made at the first outage)

    def __init__(
        self,
        core: RecoveryCore,
        strategy: Strategy,
        make_restorer: Callable[[Ledger, DeferredJournal], Restorer],
        budget_bytes: int,
        warn: Callable[[str], None] = print,
        drain: Callable[[], None] = lambda: None,
    ) -> None:
        store, rank, collective = core.store, core.rank, core.collective
        if strategy not in THROUGH:
            raise RecoveryError(
                f"--train-through with --recovery {strategy}: it needs one of {[str(s) for s in THROUGH]}"
            )
        widths = {store.width(t) for t in range(len(store.tables.specs))}
        if len(widths) > 1:
            raise RecoveryError(
                f"--train-through: the tables' rows have {len(widths)} widths ({sorted(widths)} floats); "
                "it needs one embedding dim for every table"
            )
        self.store, self.strategy, self.rank, self.collective = store, strategy, rank, collective
        self.detector, self.writer, self.ledger, self.journal = core.detector, core.writer, core.ledger, core.journal
        self.make_restorer, self.shard_restore, self.budget_bytes = make_restorer, core.shard_restore, budget_bytes
        self.warn, self.drain = warn, drain
        n = store.num_shards
        self.mine = {s for s in range(n) if s % collective.world_size == rank}
        self.away: dict[int, int] = {}  # shard -> the step whose phase saw it fail
        self._thread: threading.Thread | None = None
        self._result: tuple[Verdict | None, BaseException | None, Ledger | None, DeferredJournal | None] = (
            None,
            None,
            None,
            None,
        )
        self._lost_before = 0
        self._phases: dict[int, str] = {}  # shard -> the phase that saw it fail

    @property
    def active(self) -> bool:
        """A shard is away: the outage rows' own fact, which the store's reads go by too."""
        return self.outage is not None and self.outage.active

    @staticmethod
    def check_restart(run_dir, num_shards: int, exact: bool) -> None:
        """Rank 0 at a trainer restart: an outage whose writer kept updates for rows it did not cache
        lost them with its process. Under ``log`` (which promises nothing lost) that ends the run in
        one line; under the partial strategies the shard's restore counts them (every update since
        its checkpoint), and the notes go."""
        if run_dir is None:
            return
        notes = [s for s in range(num_shards) if layout.kept_updates_file(run_dir, s).exists()]
        if notes and exact:
            steps = {s: layout.kept_updates_file(run_dir, s).read_text().strip() for s in notes}
            where = ", ".join(f"shard {s} (away since step {st})" for s, st in steps.items())
            raise RecoveryError(
                f"a trainer restart during the outage of {where} lost the updates its writer kept for rows it "
                "did not cache (--train-through under log): the run cannot end exact; a larger --held-rows-mb "
                "keeps every row it updates exact"
            )
        for s in notes:
            layout.kept_updates_file(run_dir, s).unlink(missing_ok=True)

    # -- an outage begins -------------------------------------------------------------------------
    def begin(self, failed: list[int], step: int, phase: str) -> Outcome:
        """Every trainer, at the commit point that saw ``failed`` (background writes on disk): the
        shards go away, rank 0 starts their restore, and the phase runs again on them."""
        store = self.store
        if self.outage is None:
            held = store.row_cache
            outage = OutageRows(store.initial_rows, store.shard_map.shard_of_keys, self.mine, self.budget_bytes)
            if held is not None:
                outage.absent = lambda keys: held.state_of(keys) == ABSENT
            outage.on_kept = self._note_kept
            # log promises the run of no failure bit for bit: no fallback, a row no one holds is waited for
            outage.exact_only = self.strategy.replays_log
            self.outage = outage
            store.attach_outage(outage)  # the reads of the shards away are its from now on
        outage = self.outage
        exact = self.strategy.replays_log
        for s in failed:
            keys, rows = (
                store.held_shard_rows(s)
                if s in self.mine
                else (np.empty(0, np.int64), np.empty((0, store.width(0)), np.float32))
            )
            outage.begin(s, keys, rows, np.full(len(keys), exact))
            self.away[s] = step
            self._phases[s] = phase
            self.journal.note(
                f"step {step} {phase}: shard {s} away, restored in the background ({len(keys)} rows held)"
            )
        if exact:
            # the rows a write-behind that failed there handed over are held (and logged): they are in
            # the outage rows and the restore brings them, so its steps are not redone; under the
            # partial strategies they are, through the outage rows, and their gradients kept
            self.writer.drop_redo(failed)
        self.drain()
        self.note_outages(step)
        if self.rank == 0:
            self.journal.mark_in_recovery(sorted(self.away))
            self.shard_restore.newest_usable = step
            self.shard_restore.seen_at = self.detector.seen_at  # the thread's records name the step it fired at
            ledger = copy.deepcopy(self.ledger)  # the update counts as of the failure
            self._lost_before = len(ledger.lost)
            journal = DeferredJournal(self.journal)
            restorer = self.make_restorer(ledger, journal)
            # the log holds every step up to the phase's (a failed write-behind's too: its records went
            # with it); the writer appends the outage's steps meanwhile: the replay stops there
            restorer.through_upto = step

            def run() -> None:
                try:
                    self._result = (restorer.recover(list(failed), step, phase), None, ledger, journal)
                except BaseException as e:  # noqa: BLE001 - every trainer learns it at the rejoin
                    self._result = (None, e, ledger, journal)

            self._thread = threading.Thread(target=run, name="restore-through", daemon=True)
            self._thread.start()
        return Outcome(Action.RETRY, (), tuple(sorted(failed)))

    def note_outages(self, step: int) -> None:
        """The writer of each shard away, at its outage's begin and every step's start (``step``: the
        one about to run): the outage so far in ``layout.outage_file``, so that a trainer's death
        or a stop inside it loses not its record (``record_interrupted`` makes it at the restart).
        Written and renamed, not synced: it must outlive a process, as the page cache does."""
        run = self.journal.run_dir
        outage = self.outage
        if run is None or outage is None:
            return
        for s, at in self.away.items():
            if s not in self.mine:
                continue
            c = outage.counts.get(s)
            note = {
                "target": s,
                "step": at,
                "phase": self._phases.get(s, "stage"),
                "strategy": str(self.strategy),
                "trained_through_steps": step - at,
                "rows_read_exact": c.exact_reads if c else 0,
                "rows_read_fallback": c.fallback_reads if c else 0,
                "updates_applied_exact": c.exact_updates if c else 0,
                "updates_applied_late": c.late_updates if c else 0,
                "time": time.time(),
            }
            path = layout.outage_file(run, s)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(note))
            os.replace(tmp, path)

    @staticmethod
    def record_interrupted(journal: Journal, step: int, num_shards: int) -> None:
        """Rank 0 at a restart (or ``--resume``) with the dense state at ``step``: an outage a trainer's
        death (or a stop) cut short keeps its record: its step, the steps trained through up to the
        state the run goes on from, the rows read and updates applied meanwhile, and what the restart
        did to it (the shard is restored at the resume as a waiting restore: that restore has a
        record of its own, phase ``resume``; updates kept for a partial strategy's fallback rows are
        lost with the process, and counted there)."""
        run = journal.run_dir
        if run is None:
            return
        for s in range(num_shards):
            path = layout.outage_file(run, s)
            try:
                note = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # none, or torn by the death: the resume's restore record stands alone
            at = int(note["step"])
            through = max(0, step + 1 - at)
            ended = time.time()
            rec = {
                "kind": "shard",
                **{k: v for k, v in note.items() if k != "time"},
                "trained_through_steps": through,
                "detected_after_s": 0.0,
                "recovery_s": round(max(0.0, ended - float(note.get("time", ended))), 4),
                "waited_s": 0.0,
                "lost_updates": 0,
                "lost_samples": 0.0,
                "cut_short": (
                    f"a trainer restart: the run went on from step {step}, {through} step(s) of the outage "
                    f"trained through kept; the shard was restored at the resume as a waiting restore (its "
                    "own record, phase resume)"
                ),
            }
            if at >= step + 1:  # the steps of the outage were all taken back
                rec["cut_short"] = f"a trainer restart: the run went on from step {step}, before the outage's step"
            journal.record(rec)
            path.unlink(missing_ok=True)

    def _note_kept(self, shard: int) -> None:
        """The writer of ``shard`` is about to keep its first update for a row it did not cache: a
        durable note, so that a trainer restart before the rejoin (which loses what was kept) knows."""
        run = self.journal.run_dir
        if run is not None:
            write_atomic(layout.kept_updates_file(run, shard), str(self.away.get(shard, 0)))

    # -- each step: done yet? -----------------------------------------------------------------------
    def poll(self, step: int) -> None:
        """Every trainer at the start of ``step`` while shards are away: they agree whether the
        restore is done (then the shards rejoin here) or a trainer's outage rows passed the budget
        (then the run waits for the restore, with one line)."""
        if not self.away:
            return
        self.note_outages(step)
        n = self.store.num_shards
        flags = np.zeros(n + 1, np.int64)
        if self.rank == 0 and self._thread is not None and not self._thread.is_alive():
            flags[sorted(self.away)] = 1
        outage = self.outage
        if outage is not None and outage.over_budget():
            flags[n] = 1
        flags = self.collective.max_flags(flags)
        if flags[n]:
            used = outage.used_bytes() if outage is not None else 0
            self.end(
                step,
                f"the rows and kept updates of shards {sorted(self.away)} away passed --through-budget-mb "
                f"{self.budget_bytes / (1 << 20):g} ({used / (1 << 20):.1f} MB here)",
            )
        elif flags[:n].any():
            self.rejoin(step, 0.0)

    def end(self, step: int, why: str | None = None) -> None:
        """Every trainer: wait for the restore in flight (rank 0 joins it), then the shards rejoin.
        ``why``: said in one line (None: a save or an evaluation, which reads every shard)."""
        if not self.away:
            return
        t0 = time.perf_counter()
        if self.rank == 0 and self._thread is not None:
            if why is not None:
                self.warn(f"step {step}: waiting for the restore of shards {sorted(self.away)}: {why}")
            self._thread.join()
        self.rejoin(step, time.perf_counter() - t0)

    def settle(self) -> None:
        """The restore in flight ends here (rank 0 joins it) and nothing rejoins: this trainer is
        about to be built again in its process (``--trainer-recovery replace``), whose resume meets
        the outage as a group restart's does."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    # -- the rejoin ---------------------------------------------------------------------------------
    def rejoin(self, step: int, waited_s: float) -> None:
        """Every trainer at the start of ``step``: the restored shards take their outage rows and
        serve their reads again."""
        t0 = time.perf_counter()
        n = self.store.num_shards
        verdict, error, ledger, journal = self._result if self.rank == 0 else (None, None, None, None)
        mine = None
        if self.rank == 0:
            mine = Verdict(fatal=True) if error is not None or verdict is None else verdict
        verdict = Verdict.exchange(mine, n, self.collective)
        shards = sorted(self.away)
        if verdict.fatal:
            if error is not None:
                raise error
            raise PeerError(f"the background restore of shards {shards} failed on rank 0 (its error ends the run)")
        outage = self.outage
        counts = np.zeros(4 * n, np.float64)
        for s in shards:
            self.store.reconnect(s)  # the replacement's connections (this trainer's rows of it forgotten)
            c = outage.counts.get(s)
            if c is not None:
                counts[[s, n + s, 2 * n + s, 3 * n + s]] = (
                    c.exact_reads,
                    c.fallback_reads,
                    c.exact_updates,
                    c.late_updates,
                )
            back = outage.end(s)
            if back is not None:
                self._write_back(s, *back, step)
                if self.journal.run_dir is not None:
                    layout.kept_updates_file(self.journal.run_dir, s).unlink(missing_ok=True)
        counts = self.collective.sum_floats(counts)  # every writer's write-back is done
        rejoin_s = time.perf_counter() - t0  # every trainer waited for the write-back too
        failed_at = dict(self.away)
        self.away.clear()
        for s in shards:
            self.writer.as_of[s] = step - 1
            self.detector.forget(s)
        self.drain()
        self._thread, self._result = None, (None, None, None, None)
        self.shard_restore.seen_at = None
        if self.rank != 0:
            return
        self.ledger.lost.extend(ledger.lost[self._lost_before :])
        for s in shards:
            if s in ledger.counted:
                self.ledger.counted[s] = ledger.counted[s]
        for rec, phase in journal.finished:
            s = int(rec["target"])
            rec["trained_through_steps"] = step - failed_at.get(s, step)
            rec["rejoin_s"] = round(rejoin_s, 4)
            rec["waited_s"] = round(waited_s + rejoin_s, 4)
            rec["rows_read_exact"] = int(counts[s])
            rec["rows_read_fallback"] = int(counts[n + s])
            rec["updates_applied_exact"] = int(counts[2 * n + s])
            rec["updates_applied_late"] = int(counts[3 * n + s])
            self.journal.finish(rec, phase)
            self.journal.note(
                f"step {step}: shard {s} rejoined after {rec['trained_through_steps']} steps trained through "
                f"(waited {rec['waited_s']}s; {rec['rows_read_fallback']} rows read from the fallback, "
                f"{rec['updates_applied_late']} updates applied late)"
            )
        if (
            self.journal.run_dir is not None
        ):  # every writer's last note is written (the sum above): the records replace them
            for s in shards:
                layout.outage_file(self.journal.run_dir, s).unlink(missing_ok=True)
        self.journal.mark_in_recovery([])

    def _write_back(self, s: int, keys: np.ndarray, rows: np.ndarray, kept: list, step: int) -> None:
        """The writer of ``s`` at its rejoin: the kept gradients applied in step order to the restored
        rows, then those and the exact rows updated during the outage written to the shard (as of the
        last completed step), held again, and (``log``) the late ones logged."""
        store = self.store
        late = np.unique(np.concatenate([k for _, k, _ in kept])) if kept else np.empty(0, np.int64)
        try:
            vals = np.empty((0, rows.shape[1] if rows.ndim == 2 else store.width(0)), np.float32)
            if len(late):
                with store.from_redis():
                    vals = store.read_keys(late)
                for t, k, g in kept:
                    pos = np.searchsorted(late, k)
                    vals[pos] = store.optimizer.apply(torch.from_numpy(vals[pos]), torch.from_numpy(g), t).numpy()
            every = np.concatenate([keys, late])
            order = np.argsort(every, kind="stable")
            every, values = every[order], np.concatenate([rows, vals])[order]
            groups = [(t, ids, values[lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(every).items()]
            store.write_shard(s, groups, step=step - 1)
        except ShardUnavailableError as e:
            raise RecoveryError(
                f"shard {s} at {store.endpoint(s)} failed again as it rejoined at step {step} ({e.reason}): "
                "its outage rows cannot reach it"
            ) from None
        held = store.row_cache
        if held is not None and s in held.shards:
            if self.strategy.replays_log:
                store.reinstate_held(s)  # exactly what this writer wrote before the failure
            else:
                store.drop_held_restore(s)
            if len(every):
                held.put_keys(every, values, step - 1)
        if len(late) and s in self.writer.logs:
            self.writer.log_step(step - 1, s, late, vals)
