"""One trainer process under ``--trainer-recovery replace``: its trainer, built again in the same
process each time the quorum changes (``recsys.quorum.replica`` says why and when).

Each quorum begins an epoch: the trainers of the quorum agree (one collective, ``agree``) which
trainers left and joined since the last, and where to go on from:
- a trainer left, a step was cut short, or a member holds no state (a newcomer that healed from no
  one, the run's first quorum): every member resumes from the per-step dense state, as a group
  restart does (every shard back to its step; the steps since are trained again);
- trainers only joined: every member goes on from the step it holds, each survivor from its own
  state and each newcomer from the state it healed from a peer at the quorum; nothing is trained
  again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from recovery.durable.files import write_atomic
from recsys.group import TrainerGroup
from recsys.quorum.epoch import Epoch, same_everywhere
from recsys.quorum.replica import PeerLost, Quorum, Regroup, Replica

MAX_QUORUM_TRIES = 20  # quorums in a row that fail (a member died in the middle of forming one)


def agree(
    group: TrainerGroup, cfg, index: int, prev: tuple[int, ...] | None, q: Quorum, has_state: bool, replacement: bool
) -> np.ndarray:
    """One collective of the new quorum: -> [left flags, joined flags, heal ms] per trainer index,
    whether any member holds no state to go on from, then each member's process id (by index, 0
    for none). ``prev``: the members of this process's last quorum (None at its first);
    ``replacement``: it started after the run began."""
    n = max(cfg.train.trainers, 1 + max(q.members))
    v = np.zeros(4 * n + 5, dtype=np.int64)
    v[3 * n + 5 + index] = os.getpid()
    if prev is not None:
        for i in set(prev) - set(q.members):
            v[i] = 1
    elif replacement:  # a replacement's first quorum: it joined (2: healed from a peer)
        v[n + index] = 2 if q.healed is not None else 1
        v[2 * n + index] = int(q.seconds * 1000)
    v[3 * n] = 0 if has_state else 1
    k = cfg.recovery.quorum_every  # trainers launched as separate commands could differ: each meets on its own steps
    x = int(group.scatters)  # the rows' exchange: its collectives differ, so every member must take the same
    v[3 * n + 1 : 3 * n + 5] = (k, -k, x, -x)
    v = group.max_flags(v)
    if v[3 * n + 1] != -v[3 * n + 2]:
        raise RuntimeError(
            f"the trainers of quorum {q.quorum_id} disagree on --quorum-every ({k} here; from "
            f"{-int(v[3 * n + 2])} to {int(v[3 * n + 1])}): run every trainer with the same value"
        )
    if v[3 * n + 3] != -v[3 * n + 4]:
        raise RuntimeError(
            f"the trainers of quorum {q.quorum_id} disagree on --row-exchange (here the rows are "
            f"{'scattered' if x else 'gathered'}): run every trainer with the same value"
        )
    return np.concatenate([v[: 3 * n + 1], v[3 * n + 5 :]])


def meeting(group: TrainerGroup, cfg, index: int, prev, q: Quorum, state: dict | None, replacement: bool) -> dict:
    """What the members of quorum ``q`` agree on (``agree``; ``state``: what this trainer holds to
    go on from, its own or healed from a peer, None: nothing), as the ``Epoch`` fields it sets:
    where to go on from (``start_state``: None, the dense state), who left and who joined."""
    v = agree(group, cfg, index, prev, q, state is not None, replacement)
    n = (len(v) - 1) // 4
    left = [i for i in range(n) if v[i]]
    # trainers writing in windows (``recovery.factory.writes_behind``): a trainer built again for the
    # new quorum lets its open window go unwritten (``SparseWriter.close``), and a newcomer would read
    # rows of windows open on the others, so every new quorum goes back to the dense state
    windows = cfg.train.trainers > 1 and cfg.embeddings.write_behind and cfg.window_steps > 1
    fresh = bool(left) or bool(v[3 * n]) or windows
    if not fresh:  # every member holds a state: of one step, or everyone goes back to the dense state
        fresh = not same_everywhere(group, int(state["run"]["step"]) + 1 if state is not None else 0)
    return {
        "quorum_id": q.quorum_id,
        "start_state": None if fresh else state,
        "left": left,
        "joined": {i: bool(v[n + i] == 2) for i in range(n) if v[n + i]},
        "heal_s": float(v[2 * n : 3 * n].max()) / 1000,
        "pids": {i: int(v[3 * n + 1 + i]) for i in range(n) if v[3 * n + 1 + i]},
    }


def quorum_group(cfg, members: int, rank: int, index: int, comm) -> TrainerGroup:
    """The group of trainer ``index`` at ``rank`` of a quorum of ``members`` trainers: the chunks of
    the run's trainers shared by the quorum's (chunk order), or, under ``--dense-reduce allreduce``,
    its own chunk alone (the chunks of trainers outside the quorum skipped, the gradients averaged
    over those trained)."""
    chunks = cfg.train.chunks or cfg.train.trainers
    if cfg.train.dense_reduce == "allreduce":
        return TrainerGroup(
            members, rank, chunks, exact=False, comm=comm, own_chunk=index, row_exchange=cfg.train.row_exchange
        )
    return TrainerGroup(members, rank, chunks, comm=comm, row_exchange=cfg.train.row_exchange)


class Prebuilt:
    """A trainer built while its quorum forms, for the members it expects (those of its last quorum
    after a peer was lost: a replacement takes the dead one's place; every trainer of the run at a
    first quorum): the detection of a death (the Lighthouse's heartbeat lapse) is time the survivors
    wait anyway. Taken at the quorum if it came out as expected (the same members, the same rank),
    else closed unused and the trainer built for the quorum there is."""

    def __init__(self, cfg, urls, namespace, specs, replica: Replica, members: tuple[int, ...], finishing) -> None:
        from recsys.trainer import Trainer

        t0 = time.perf_counter()
        self.members, self.rank = members, members.index(replica.index)
        group = quorum_group(cfg, len(members), self.rank, replica.index, replica.comm)
        epoch = Epoch(group, replica, replica.index, -1, members=members, finishing=finishing)
        self.trainer: Trainer | None = Trainer(cfg, urls, namespace, len(members), self.rank, specs, epoch=epoch)
        try:
            self._preload(self.trainer)
        except BaseException:
            self.trainer.close()
            raise
        self.build_s = time.perf_counter() - t0

    @staticmethod
    def _preload(trainer) -> None:
        """The per-step dense state read and loaded now, and the first batch from there read ahead;
        the resume takes them if the file is still the same one then (``Trainer.preloaded``), else
        reads it as it would (a position loaded again drops the batch read ahead)."""
        from recovery.errors import CorruptCheckpointError

        key = trainer.dense_saver.identity()
        if key is None:
            return
        try:
            state = trainer.dense_saver.load()
        except CorruptCheckpointError:
            return  # the resume reads it again and says so
        if state is not None:
            trainer.load_state_dict(state)
            trainer.preloaded = (key, state)
            trainer.reader.read_ahead()

    @classmethod
    def maybe(cls, *args) -> Prebuilt | None:
        """None where the build fails: the build at the quorum then says why (or succeeds there)."""
        try:
            return cls(*args)
        except Exception:  # noqa: BLE001 - a guess: the real build follows at the quorum
            return None

    def take(self, q: Quorum):
        """The trainer, if ``q`` came out as expected (else None: it is closed unused)."""
        trainer, self.trainer = self.trainer, None
        if trainer is None:
            return None
        if tuple(q.members) != self.members or q.rank != self.rank:
            trainer.close()
            return None
        trainer.t_setup = time.perf_counter() - self.build_s  # its set-up: the build, not the wait for the quorum
        return trainer

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()
            self.trainer = None


def train_replica(cfg, urls: list[str], namespace: str, specs, index: int, lighthouse: str) -> dict | None:
    """Train as trainer ``index`` of the quorum until the run ends; -> rank 0's summary at the end
    (None elsewhere, and for a replacement that came after the others finished)."""
    from embeddings.store.row_slots import keep_released
    from recsys.trainer import Trainer

    keep_released()  # each trainer built here takes the arrays of the last one's held rows, touched already

    marks = RunMarks(Path(cfg.train.out), cfg.train.trainers)
    replacement = marks.started()  # the run began before this trainer: it replaces one
    if replacement:  # before its manager heartbeats: no quorum waits for a member that cannot ask yet
        prewarm(cfg, urls, namespace)
    replica = Replica(index, lighthouse, cfg.recovery.trainer_timeout)
    pre: Prebuilt | None = None
    try:
        prev: tuple[int, ...] | None = None
        live: dict | None = None
        pids: dict[int, int] = {}  # the last quorum's members' processes
        at, detected = 0, 0.0  # the step this process's trainer was in when its quorum broke, and when
        if not replacement:
            marks.ready(index)
        # every trainer of the run expected at the first quorum (a replacement: in the dead one's place)
        everyone = tuple(sorted({*range(cfg.train.trainers), index}))
        pre = Prebuilt.maybe(cfg, urls, namespace, specs, replica, everyone, marks.finishing)
        q = _quorum(replica, 0)
        marks.mark_started()
        trained_at: int | None = None  # the quorum id of this process's last trainer
        while True:
            trainer = pre.take(q) if pre is not None else None
            pre = None
            # the last trainer's row cache only for the quorum right after its own: with one between,
            # other trainers may have written its shards (``RowCache.hold_rows`` takes it whole)
            if trained_at is None or q.quorum_id != trained_at + 1:
                trainer = _without_carried_cache(trainer)
            try:
                if prev is None and len(q.members) == 1 and marks.has_ended():
                    if trainer is not None:
                        trainer.close()
                    return None  # a replacement alone at a run that ended meanwhile
                group = (
                    trainer.group
                    if trainer is not None
                    else quorum_group(cfg, len(q.members), q.rank, index, replica.comm)
                )
                healed = _healed(q, namespace)
                how = meeting(group, cfg, index, prev, q, live if live is not None else healed, replacement)
                pids = fence_left(marks, how, pids, q.quorum_id, (at, detected, cfg.recovery.trainer_timeout))
            except PeerLost:
                if trainer is not None:
                    trainer.close()
                prev, live, detected = tuple(sorted({*(prev or ()), *q.members})), None, time.time()  # still left
                q = _quorum(replica, 0)
                continue
            except BaseException:
                if trainer is not None:
                    trainer.close()
                raise
            how["detected_at"] = detected
            if trainer is None:
                epoch = Epoch(group, replica, index, members=tuple(q.members), finishing=marks.finishing, **how)
                trainer = Trainer(cfg, urls, namespace, len(q.members), q.rank, specs, epoch=epoch)
            else:
                for k, val in how.items():
                    setattr(trainer.epoch, k, val)
            prev, trained_at = q.members, q.quorum_id
            try:
                return trainer.train()
            except Regroup as r:
                q, live, detected = r.quorum, r.live, time.time()
            except PeerLost as e:
                trainer.recovery.journal.note(f"trainer {index}: {e}; the step is discarded, the quorum forms again")
                live, detected, at = None, time.time(), trainer.step
                # the same members expected (a dead trainer's replacement asks meanwhile): built while the quorum forms
                pre = Prebuilt.maybe(cfg, urls, namespace, specs, replica, tuple(prev), marks.finishing)
                q = _quorum(replica, 0)
    finally:
        if pre is not None:
            pre.close()
        replica.close()
        keep_released(False)  # the last trainer's cache goes (an in-process run: nothing of it outlives the run)


SUPERVISOR_ENV = "RECSYS_REPLICA_SUPERVISOR"  # set by the launcher's supervisor for the trainers it starts
FENCE_S = 60.0  # the longest the members wait for the supervisor to stop a trainer left out


def fence_left(marks: RunMarks, how: dict, pids: dict[int, int], quorum_id: int, when: tuple) -> dict[int, int]:
    """Trainers left out of quorum ``quorum_id`` (``how``: ``meeting``'s; their processes as of this
    member's last quorum: ``pids``; -> this quorum's, taken out of ``how``) whose process stands
    stopped (SIGSTOP, a debugger, a frozen container) past ``--trainer-timeout`` are killed before any
    member touches a shard: such a one must never resume to write a shard or commit a step with the
    state it had. ``when``: the step the quorum broke in, when, and ``--trainer-timeout``. Every member
    that knows the process asks the launcher's supervisor (the same record, whoever writes it) and
    every such member waits until the supervisor has judged it; the supervisor starts a replacement
    as after a death, and that one joins at a quorum, healed from a peer. A left-out trainer that
    runs (late to see a death) is let be. Trainers launched as separate commands (``--trainer-index``)
    have no supervisor: nothing fences a paused one there."""
    now = how.pop("pids")
    if not os.environ.get(SUPERVISOR_ENV):
        return now
    for i in how["left"]:
        pid = pids.get(i)
        if pid is None or pid == os.getpid():
            continue
        marks.leave_out(i, pid, quorum_id, *when)
        marks.wait_gone(i, pid, quorum_id, FENCE_S)
    return now


def _healed(q: Quorum, namespace: str) -> dict | None:
    """The state this trainer healed from a peer at quorum ``q``, decoded (None: it healed none)."""
    from recovery.durable.dense import from_bytes

    if q.healed is None:
        return None
    return from_bytes(q.healed, namespace, f"the state healed from a peer at quorum {q.quorum_id}")


def _without_carried_cache(trainer):
    """No row cache of an earlier trainer of this process for the next one: the one ``trainer`` (built
    ahead) took is closed with it (-> None: the trainer is built at the quorum), and none is left
    for the next build to take."""
    from embeddings.store import row_slots

    store = getattr(trainer.backend, "store", None) if trainer is not None else None
    if store is not None and store.cache.taken_over:
        trainer.close()
        trainer = None
    row_slots.carried.clear()
    return trainer


def prewarm(cfg, urls: list[str], namespace: str) -> None:
    """A replacement, before its manager starts (it heartbeats only once it can ask, so no quorum
    waits for it meanwhile): what its first trainer's build computes once per process done now
    (the data's sources, with the synthetic teacher's AUC, kept per process), and the arrays of its
    held rows allocated and touched (``row_slots.keep_released``), so that the build at the quorum,
    which the others wait for, finds them ready. A store that cannot be opened
    now is left to the build, which says why."""
    from embeddings.errors import EmbeddingStoreError
    from recsys.backends import open_store
    from recsys.datasets import sources

    sources(cfg)
    if not cfg.embeddings.held_rows_mb:
        return
    try:
        store = open_store(cfg, urls, namespace)
    except EmbeddingStoreError:
        return
    try:
        store.hold_rows(set(), int(cfg.embeddings.held_rows_mb * (1 << 20)))
    finally:
        store.close()


def _quorum(replica: Replica, step: int) -> Quorum:
    """A quorum, tried again while forming one fails (a member died while it formed)."""
    for _ in range(MAX_QUORUM_TRIES - 1):
        try:
            return replica.quorum(step)
        except PeerLost as e:
            print(f"trainer {replica.index}: {e}; trying again", file=sys.stderr)
            time.sleep(0.2)
    return replica.quorum(step)


def replica_main(
    cfg_dict: dict, urls: list[str], namespace: str, specs: list[dict], index: int, lighthouse: str, results
) -> None:
    """Entry point of one trainer process under ``--trainer-recovery replace`` (started by
    ``recsys.quorum.supervisor``): an error ends it with exit status 3, its line and traceback in
    the run folder's ``errors/`` (the launcher prints the line). ``results``: a queue for rank 0's
    summary."""
    from embeddings.servers.launcher import ShardSpec
    from recsys.clock import pin_trainer
    from recsys.config import RunConfig
    from recsys.errors import default_signals, report_error

    default_signals()
    cfg = RunConfig.from_dict(cfg_dict)
    pin_trainer(
        index, cfg.train.trainers, cfg.train.pin_trainers, cfg.train.threads
    )  # this supervisor's trainers: cores of their own
    try:
        summary = train_replica(cfg, urls, namespace, [ShardSpec(**s) for s in specs], index, lighthouse)
        if summary is not None:
            results.put(summary)
    except Exception as e:  # noqa: BLE001 - reported in one line, traceback to the run folder
        report_error(Path(cfg.train.out), f"trainer{index}", e)
        raise SystemExit(3) from None


class RunMarks:
    """The marks the trainers of a run meet by, in its folder (``{out}/trainers/``): each first
    trainer's ``ready.I`` (the first quorum waits for them all), ``started`` (a trainer that comes
    later replaces one: it joins) and ``ended`` (the trainers finish: one that comes later has
    nothing to do). Files, so that trainers launched as separate commands meet by them too."""

    def __init__(self, out: Path, trainers: int) -> None:
        self.dir, self.trainers = Path(out) / "trainers", trainers

    def clear(self) -> None:
        """A launch begins (the launcher, or trainer 0 of separate commands)."""
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _touch(self, name: str) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / name).touch()

    def started(self) -> bool:
        return (self.dir / "started").exists()

    def mark_started(self) -> None:
        self._touch("started")

    def finishing(self) -> None:
        self._touch("ended")

    def has_ended(self) -> bool:
        return (self.dir / "ended").exists()

    def leave_out(self, index: int, pid: int, quorum_id: int, step: int, broke: float, timeout_s: float) -> None:
        """Trainer ``index`` (process ``pid``) was left out of quorum ``quorum_id``, which broke in
        ``step`` at ``broke`` (its last answer ``timeout_s`` before): the supervisor judges it."""
        self.dir.mkdir(parents=True, exist_ok=True)
        silent = broke - timeout_s if broke else time.time()
        rec = {"index": index, "pid": pid, "quorum_id": quorum_id, "step": step or None, "silent_since": silent}
        write_atomic(self.dir / f"left.{quorum_id}.{pid}", json.dumps({**rec, "timeout_s": timeout_s}).encode())

    def left_out(self) -> list[dict]:
        """The trainers left out and not judged yet (``leave_out``, no ``gone``)."""
        out = []
        for path in self.dir.glob("left.*"):
            if not path.name.endswith(".tmp") and not (self.dir / f"gone.{path.name[5:]}").exists():
                try:
                    out.append(json.loads(path.read_text()))
                except (OSError, ValueError):
                    continue  # being written: the next poll reads it
        return out

    def gone(self, quorum_id: int, pid: int) -> None:
        self._touch(f"gone.{quorum_id}.{pid}")

    def wait_gone(self, index: int, pid: int, quorum_id: int, timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        while not (self.dir / f"gone.{quorum_id}.{pid}").exists():
            if time.time() > deadline:
                raise RuntimeError(
                    f"trainer {index} (pid {pid}) was left out of quorum {quorum_id} and the launcher did not judge "
                    f"it within {timeout_s:g} s: no member goes on while it may still write a shard"
                )
            time.sleep(0.05)

    def wait_for(self, index: int, timeout_s: float = 600) -> None:
        """Until trainer ``index`` is up (the others of separate commands wait for trainer 0's folder)."""
        deadline = time.time() + timeout_s
        while not (self.dir / f"ready.{index}").exists():
            if time.time() > deadline:
                raise RuntimeError(f"trainer {index} did not start within {timeout_s:g} s ({self.dir})")
            time.sleep(0.05)

    def ready(self, index: int, timeout_s: float = 600) -> None:
        """Trainer ``index`` is up; returns once every first trainer is (its first quorum has them all)."""
        self._touch(f"ready.{index}")
        deadline = time.time() + timeout_s
        while not all((self.dir / f"ready.{i}").exists() for i in range(self.trainers)):
            if time.time() > deadline:
                missing = [i for i in range(self.trainers) if not (self.dir / f"ready.{i}").exists()]
                raise RuntimeError(f"trainers {missing} did not start within {timeout_s:g} s ({self.dir})")
            time.sleep(0.05)
