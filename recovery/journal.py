"""The run's failure journal: what failed, what it cost, durable as each recovery ends.

``{run}/failures.jsonl``: one record per failure, appended by rank 0 as its recovery ends (a
trainer restart that follows must not lose it); ``{run}/trainer_failures.jsonl``: one line per
trainer death (the injector, the launcher), turned into records after the restart;
``{run}/recovery_in_progress.json``: the shards being restored (a restart redoes a restore cut
short); ``{run}/recovery.log``: one line per thing done, for people.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tqdm import tqdm

from recovery.durable import layout
from recovery.durable.files import append_line, read_lines, write_atomic


class Journal:
    def __init__(self, run_dir: Path | None, rank: int) -> None:
        self.run_dir, self.rank = run_dir, rank
        self.failures: list[dict] = []
        # what a trainer's death costs: the group restarts, or the others go on without it (``replace``)
        self.trainer_recovery = "restart"
        # replace with the gradients averaged: a dead trainer's chunk, samples a step no one trains
        # until it rejoins (``note_rejoin``, ``close_absences`` count them lost)
        self.chunk_skipped = 0

    def note(self, what: str) -> None:
        """One line of the run's recovery journal (``{run}/recovery.log``): what was done, when."""
        if self.run_dir is None:
            return
        with open(layout.journal_file(self.run_dir), "a") as f:
            f.write(f"{time.time():.3f} pid={os.getpid()} rank={self.rank} {what}\n")

    def record(self, rec: dict) -> None:
        """A failure record, durable at once (a restart that follows must not lose it), and its one
        line on the terminal (rank 0 of a run, which has a folder; a manager without a folder, as the
        benchmarks drive one, prints none). A trainer's death had a line from the launcher as it
        happened; this one says what it cost, once the group trains again."""
        self.failures.append(rec)
        if self.run_dir is not None and self.rank == 0:
            append_line(layout.failures_file(self.run_dir), rec)
            self.say(failure_line(rec))

    @staticmethod
    def say(line: str) -> None:
        """A line on the terminal, above the progress bar."""
        tqdm.write(line, file=sys.stderr)

    def finish(self, rec: dict, phase: str) -> None:
        """A restore ended: its record timed and journaled (a transient refusal is only noted)."""
        ended = rec.pop("_ended_at", None) or time.time()  # a restore run beside others: when it ended
        rec["recovery_s"] = round(ended - rec.pop("_detected_at"), 4)
        rec["phase"] = phase
        if rec.pop("transient", False):  # not a failure: noted, not counted
            self.note(
                f"step {rec['step']}: shard {rec['target']} refused by the cluster for {rec['recovery_s']}s, not lost"
            )
            return
        self.record(rec)

    def summary(self) -> list[dict]:
        """The records without their private fields (those a restart needs)."""
        return [{k: v for k, v in f.items() if not k.startswith("_")} for f in self.failures]

    def mark_in_recovery(self, shards: list[int]) -> None:
        """Durable note of the shards being restored: a trainer restart redoes a restore cut short.
        None left: the note goes (a finished run's folder holds its results only)."""
        if self.run_dir is None:
            return
        if shards:
            write_atomic(layout.in_recovery_file(self.run_dir), json.dumps(shards))
        else:
            layout.in_recovery_file(self.run_dir).unlink(missing_ok=True)

    def interrupted_restores(self) -> list[int]:
        if self.run_dir is None:
            return []
        try:
            return [int(s) for s in json.loads(layout.in_recovery_file(self.run_dir).read_text())]
        except (OSError, ValueError):
            return []

    def load(self) -> bool:
        """Rank 0 after a restart: the failures so far are the journal's (the dense state may be
        older than the last of them). -> whether it was read."""
        if self.rank != 0 or self.run_dir is None:
            return False
        self.failures = read_lines(layout.failures_file(self.run_dir))
        return True

    def clear(self) -> bool:
        """A fresh start (rank 0): an earlier run's journal files go. The same run started again
        (its id, ``run.json``'s, began these files: a group dead before its first restart point)
        keeps its trainers' deaths, for ``record_trainer_failures``; what else the attempt recorded
        went with the steps it took back (every step is redone). -> whether it is the same run."""
        if self.run_dir is None:
            return False
        run_id, again = layout.run_id(self.run_dir), layout.began_before(self.run_dir)
        kept = (layout.trainer_failures_file,) if again else ()
        for path in (layout.trainer_failures_file, layout.failures_file, layout.in_recovery_file):
            if path not in kept:
                path(self.run_dir).unlink(missing_ok=True)
        for pattern in ("kept_updates_shard*", "outage_shard*.json"):  # --train-through's notes
            for note in Path(self.run_dir).glob(pattern):
                note.unlink(missing_ok=True)
        self.failures = []
        if run_id is not None and not again:
            write_atomic(layout.journal_run_file(self.run_dir), json.dumps({"run_id": run_id}))
        return again

    def record_trainer_failures(self, step: int, t_restart: float, restored_bytes: int, rolled: int) -> None:
        """Rank 0: one record per trainer death not yet recorded (injected, or seen by the launcher)."""
        if self.rank != 0 or self.run_dir is None:
            return
        seen = {f.get("_death") for f in self.failures}
        for info in read_lines(layout.trainer_failures_file(self.run_dir)):
            death = f"{info['rank']}@{info['time']}"
            if death in seen:
                continue
            died_at = info.get("step")
            detected = max(0.0, t_restart - info["time"])  # the death to the new group's first call here
            heal = time.time() - t_restart  # every shard back to the dense state's step
            rec = {
                "kind": info.get("kind", "trainer"),
                "target": info["rank"],
                "step": died_at if died_at is not None else step + 1,
                "strategy": self.trainer_recovery,
                **({"shards": info["shards"]} if info.get("shards") else {}),
                "detected_after_s": round(detected, 4),
                "recovery_s": round(heal, 4),
                # what it cost: restart, every trainer stopped from the death until the group trains
                # again; replace, the others until they step at the new quorum (the steps after the
                # dense state's are redone: ``replayed_steps``); none skips a sample
                "waited_s": round(detected + heal, 4),
                "heal_s": round(heal, 4),
                "rejoin_step": step + 1,
                "samples_lost": 0,
                "restored_bytes": restored_bytes,
                "rolled_back_rows": rolled,
                "lost_updates": 0,
                "lost_samples": 0.0,
                "replayed_steps": max(0, died_at - step) if died_at else 0,
                "_death": death,
            }
            if self.trainer_recovery == "replace":  # the replacement's heal and rejoin: ``note_rejoin``
                rec.update(heal_s=None, rejoin_step=None, resumed_step=step + 1)
                if self.chunk_skipped:
                    rec["chunk_samples_skipped_per_step"] = self.chunk_skipped
            self.record(rec)
            rolled = 0  # counted once, on the first

    def note_rejoin(
        self, index: int, step: int, heal_s: float = 0.0, from_peer: bool = False, dense_equal: bool | None = None
    ) -> None:
        """Rank 0: trainer ``index`` trains again from ``step`` (its replacement joined, healed in
        ``heal_s`` from a live peer where ``from_peer``, else from the per-step dense state with the
        others; or it is back in a later quorum, a resumed run's first): every open record of its
        deaths says so (rewritten in place), and one line. ``dense_equal``: its dense model and
        optimizer state equal every other trainer's, bit for bit, as it joins (None: not compared).
        Where its chunk was skipped meanwhile (``chunk_skipped``), the samples from the oldest open
        record's ``resumed_step`` to ``step`` are counted lost, once (a replacement killed before it
        joined left a second record of the same absence)."""
        if self.rank != 0 or self.run_dir is None:
            return
        recs = self._open(index)
        if not recs:
            return
        for rec in recs:
            rec["rejoin_step"], rec["heal_s"] = step, round(heal_s, 4)
            rec["healed_from"] = "peer" if from_peer else "dense state"
            rec["dense_equal_at_rejoin"] = dense_equal
        self._count_skipped(recs, step)
        self._rewrite()
        how = f"healed from a live peer in {heal_s:.2f} s" if from_peer else "from the per-step dense state"
        lost = sum(int(r.get("samples_lost") or 0) for r in recs)
        skipped = f", {lost:,} samples of its chunk skipped meanwhile" if self.chunk_skipped else ""
        self.say(f"trainer {index} rejoined at step {step}: {how}{skipped}")

    def absent(self, index: int) -> bool:
        """Whether a death of trainer ``index`` is recorded and it has not trained since."""
        return bool(self._open(index))

    def close_absences(self, end_step: int) -> None:
        """Rank 0, as the run ends: a dead trainer that never rejoined (no replacement left, or the
        run ended first) had its chunk skipped to the run's end, where it is (``chunk_skipped``):
        counted lost, once per absence. With the chunks reduced in order the others trained it."""
        if self.rank != 0 or self.run_dir is None or not self.chunk_skipped:
            return
        targets = {
            r.get("target") for r in self.failures if r.get("strategy") == "replace" and r.get("rejoin_step") is None
        }
        for index in targets:
            self._count_skipped(self._open(index), end_step + 1)
        if targets:
            self._rewrite()

    def _open(self, index: int) -> list[dict]:
        """The records of trainer ``index``'s deaths it has not rejoined since, oldest first."""
        return [
            r
            for r in self.failures
            if r.get("strategy") == "replace" and r.get("target") == index and r.get("rejoin_step") is None
        ]

    def _count_skipped(self, recs: list[dict], until: int) -> None:
        """One absence's records: the oldest counts its chunk from its ``resumed_step`` to ``until``."""
        if self.chunk_skipped and recs:
            first = recs[0]
            lost = max(0, until - int(first.get("resumed_step") or until)) * self.chunk_skipped
            for rec in recs:
                n = lost if rec is first else 0
                rec["samples_lost"], rec["lost_samples"] = n, float(n)

    def _rewrite(self) -> None:
        lines = "".join(json.dumps(r) + "\n" for r in self.failures)
        write_atomic(layout.failures_file(self.run_dir), lines)


def stale_words(recs: list[dict]) -> str:
    """What training through relaxed, beside the updates lost: ", N rows read stale, M updates
    applied late" ('' where nothing was)."""
    stale = sum(int(r.get("rows_read_fallback") or 0) for r in recs)
    late = sum(int(r.get("updates_applied_late") or 0) for r in recs)
    return f", {stale:,} rows read stale, {late:,} updates applied late" if stale or late else ""


def failure_line(rec: dict) -> str:
    """A failure as the terminal says it: what failed at which step, how it came back, what it lost."""
    if rec.get("strategy") == "replace":  # a trainer's (or a node's) death; the others went on
        return (
            f"failure: {rec.get('kind', 'trainer')} {rec.get('target')} at step {rec.get('step')}: the other "
            f"trainers went on from step {rec.get('resumed_step')} after {float(rec.get('waited_s') or 0):.2f} s "
            f"({int(rec.get('replayed_steps') or 0)} steps redone), "
            + (
                f"its chunk ({rec['chunk_samples_skipped_per_step']:,} samples a step) skipped until it rejoins; "
                if rec.get("chunk_samples_skipped_per_step")
                else f"{int(rec.get('samples_lost') or 0):,} samples lost; "
            )
            + "a replacement heals from them"
        )
    if rec.get("strategy") == "restart":  # a trainer's (or a node's) death
        return (
            f"failure: {rec.get('kind', 'trainer')} {rec.get('target')} at step {rec.get('step')}: restart of the "
            f"trainer group, every trainer waited {float(rec.get('waited_s') or 0):.2f} s, trained again from step "
            f"{rec.get('rejoin_step')} ({int(rec.get('replayed_steps') or 0)} steps redone), "
            f"{int(rec.get('samples_lost') or 0):,} samples lost"
        )
    how = str(rec.get("strategy", "?"))
    if rec.get("restored_from_step") is not None:
        how += f" from step {rec['restored_from_step']}"
    lost = f"{int(rec.get('lost_updates') or 0):,} updates lost"
    if rec.get("lost_samples"):
        lost += f" ({rec['lost_samples']:,.1f} samples)"
    lost += stale_words([rec])
    through = f", trained through {rec['trained_through_steps']} steps" if rec.get("trained_through_steps") else ""
    return (
        f"failure: {rec.get('kind', 'shard')} {rec.get('target')} at step {rec.get('step')}: {how}, "
        f"{float(rec.get('recovery_s') or 0):.2f} s, {lost}{through}"
    )
