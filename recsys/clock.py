"""Step timing: where a training step's time goes, how the training thread spent it, and each
trainer's speed (the trainers found slow, and the chunks that follow speed: ``plan_chunks``); the
cores each trainer runs on (``pin_trainer``)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable

import numpy as np
from tqdm import tqdm

WARMUP_STEPS = 10  # steps before the step time is steady: throughput counts after them, the auto planner measures them


class Collectives:
    """Seconds this process spent in the trainers' collectives (the transfer, and the wait for the
    slowest trainer to arrive), and how many: ``summary.json``'s ``collectives_ms`` (rank 0's)."""

    seconds = 0.0
    calls = 0

    @classmethod
    def timed(cls, fn):
        t = time.perf_counter()
        try:
            return fn()
        finally:
            cls.seconds += time.perf_counter() - t
            cls.calls += 1

    @classmethod
    def per_step(cls, steps: int) -> dict[str, float]:
        """ms and calls a step, over the run's steps."""
        n = max(1, steps)
        return {"ms": round(1000 * cls.seconds / n, 2), "calls": round(cls.calls / n, 2)}


def thread_sched() -> tuple[float, float, float] | None:
    """(wall clock, seconds on a CPU, seconds runnable but waiting for a CPU) of the calling thread,
    from Linux's ``/proc/thread-self/schedstat``; None where there is none."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runnable = f.read().split()[:2]
        return time.perf_counter(), int(on_cpu) / 1e9, int(runnable) / 1e9
    except (OSError, ValueError):
        return None


CPU_KINDS = ("training", "helpers", "gloo", "torchft", "servers")


def _on_cpu(path: str) -> float:
    with open(path) as f:
        return int(f.read().split()[0]) / 1e9


def _kind(comm: str) -> str:
    if comm.startswith(("gloo", "pt_gloo")):
        return "gloo"
    return "torchft" if comm.startswith("torchft") else "helpers"


def process_cpu(servers: Iterable[int] = ()) -> dict[tuple[int, int], tuple[str, float]] | None:
    """Seconds on a CPU so far of this process's threads alive now and of the processes ``servers``
    (the local shards' servers, every thread), by (pid, thread id): (kind, seconds). Kinds:
    ``training``, this process's main thread; ``gloo``, gloo's transport threads; ``torchft``,
    torchft's manager threads; ``helpers``, its every other thread (the read-ahead, the write-behind,
    the logs, torch's own); ``servers``. From Linux's ``/proc/*/task/*/schedstat``; None where there
    is none."""
    me, out = os.getpid(), {}
    for pid in (me, *servers):
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:  # gone (a killed shard): what it ran is not counted
            if pid == me:
                return None
            continue
        for tid in tids:
            try:
                if pid != me:
                    kind = "servers"
                elif tid == me:
                    kind = "training"
                else:
                    with open(f"/proc/{pid}/task/{tid}/comm") as f:
                        kind = _kind(f.read().strip())
                out[(pid, tid)] = (kind, _on_cpu(f"/proc/{pid}/task/{tid}/schedstat"))
            except (OSError, ValueError):  # the thread ended meanwhile
                continue
    return out


def cpu_between(first, last, steps: int) -> dict[str, float | None] | None:
    """ms on a CPU a step by kind between two ``process_cpu`` snapshots ``steps`` steps apart, of
    the threads alive at the last (a thread that ended meanwhile is not counted); ``servers`` None
    where none was counted. None without both snapshots."""
    if first is None or last is None or steps <= 0:
        return None
    out = dict.fromkeys(CPU_KINDS, 0.0)
    for key, (kind, seconds) in last.items():
        out[kind] += seconds - first.get(key, (kind, 0.0))[1]
    ms: dict[str, float | None] = {k: round(v * 1000 / steps, 2) for k, v in out.items()}
    if not any(kind == "servers" for kind, _ in last.values()):
        ms["servers"] = None
    return ms


class StepClock:
    """Where a step's time goes: seconds per part (rows in, data, compute, rows out, waiting), summed.
    And how the training thread spent the steps after the warm-up (``marks``): on a CPU, runnable but
    waiting for one (the host's other threads and processes had the cores), or neither (waiting
    for a write, a lock, the GIL)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._t = 0.0
        self.marks: list[tuple[int, tuple[float, float, float] | None]] = []  # (step, thread_sched())
        self.cpu: list[dict[tuple[int, int], tuple[str, float]] | None] = []  # process_cpu() a mark

    def start(self, t: float) -> None:
        self._t = t

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._t
        self._t = now

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {k: round(1000 * v / max(1, steps), 2) for k, v in self.parts.items()}

    def mark(self, step: int, servers: Iterable[int] = ()) -> None:
        """The training thread's scheduler times as of the end of ``step``, and this process's
        threads' and the processes ``servers``' CPU (``process_cpu``)."""
        self.marks.append((step, thread_sched()))
        self.cpu.append(process_cpu(servers))

    def cpu_ms(self) -> dict[str, float | None] | None:
        """Per step between the first and the last mark: ms on a CPU by kind (``cpu_between``). None
        without two marks (or schedstat)."""
        if len(self.cpu) < 2:
            return None
        (s0, _), (s1, _) = self.marks[0], self.marks[-1]
        return cpu_between(self.cpu[0], self.cpu[-1], s1 - s0)

    def thread_ms(self) -> dict[str, float] | None:
        """Per step between the first and the last mark: the training thread's wall time, time on a
        CPU, runnable but off one, and the rest (blocked). None without two marks (or schedstat)."""
        if len(self.marks) < 2 or self.marks[0][1] is None or self.marks[-1][1] is None:
            return None
        (s0, a), (s1, b) = self.marks[0], self.marks[-1]
        if s1 <= s0:
            return None
        wall, cpu, runq = ((y - x) * 1000 / (s1 - s0) for x, y in zip(a, b))
        return {
            "wall": round(wall, 2),
            "on_cpu": round(cpu, 2),
            "runnable": round(runq, 2),
            "blocked": round(max(0.0, wall - cpu - runq), 2),
        }


SLOW_RATIO = 1.5  # a trainer's compute a step over the others' median that counts as slow
SLOW_RECORDS = 5  # in this many log records in a row: persistently slow, named once
BALANCE_GAIN = 0.2  # chunks move only where the planned step is this much shorter than today's


def plan_chunks(step_ms: list[float], counts: list[int], num_chunks: int) -> list[int] | None:
    """How many of the ``num_chunks`` chunks each trainer trains next, from each trainer's compute a
    step (``step_ms``) over the chunks it trained (``counts``): every trainer at least one, each next
    chunk to the trainer that would finish it first (the lowest index on a tie), so the slowest
    trainer's planned step is as short as it can be. None where that is not ``BALANCE_GAIN`` shorter
    than with ``counts`` (noise moves nothing). Every trainer computes it from the same numbers alike."""
    per = [m / max(1, n) for m, n in zip(step_ms, counts)]
    if len(per) < 2 or min(per) <= 0 or num_chunks <= len(per):
        return None
    plan = [1] * len(per)
    for _ in range(num_chunks - len(per)):
        r = min(range(len(per)), key=lambda i: ((plan[i] + 1) * per[i], i))
        plan[r] += 1
    now = max(n * p for n, p in zip(counts, per))
    then = max(n * p for n, p in zip(plan, per))
    return plan if plan != list(counts) and then < (1 - BALANCE_GAIN) * now else None


class TrainerSpeeds:
    """Each trainer's compute a step (forward and backward of its chunks, an injected slowdown
    included), summed since the last log record. At each record every trainer gives its mean
    (``exchange``, a collective): the record's ``trainer_compute_ms``, by trainer index. A trainer
    slower than ``SLOW_RATIO`` times the median of the others in ``SLOW_RECORDS`` records in a row is
    named once (one line, and ``slow`` for the summary)."""

    def __init__(self) -> None:
        self._s = 0.0
        self._n = 0
        self._streak: dict[int, int] = {}
        self.slow: list[dict] = []
        self._since = [0.0, 0]  # compute and steps since the chunks were last planned

    def add(self, seconds: float) -> None:
        self._s += seconds
        self._n += 1
        self._since[0] += seconds
        self._since[1] += 1

    def exchange_since(self, group) -> list[float]:
        """Each trainer's mean compute a step (ms, by rank) since the last call (a collective: each
        trainer's own figure added to zeros, so every trainer holds the same bits)."""
        vec = np.zeros(group.world_size)
        vec[group.rank] = 1000 * self._since[0] / max(1, self._since[1])
        self._since = [0.0, 0]
        return group.sum_floats(vec).tolist()

    def exchange(self, group, index: int, step: int, says: bool) -> dict[str, float]:
        """This trainer's mean since the last call, everyone's by index (``group.sum_floats``); a
        trainer found slow (by its compute a chunk: chunks follow speed) is named on the terminal
        where ``says`` (rank 0)."""
        mine = 1000 * self._s / max(1, self._n)
        self._s, self._n = 0.0, 0
        vec = np.zeros(3 * group.world_size)
        vec[3 * group.rank : 3 * group.rank + 3] = (mine, index, mine / max(1, len(group.chunks)))
        got = group.sum_floats(vec).reshape(-1, 3)
        per_chunk = {int(i): float(c) for _, i, c in got}
        self._judge(per_chunk, step, (lambda line: tqdm.write(line, file=sys.stderr)) if says else (lambda line: None))
        return {str(int(i)): round(float(m), 2) for m, i, _ in sorted(got.tolist(), key=lambda x: x[1])}

    def _judge(self, ms: dict[int, float], step: int, warn) -> None:
        named = {r["trainer"] for r in self.slow}
        for i, m in ms.items():
            others = [v for j, v in ms.items() if j != i]
            if not others or m <= SLOW_RATIO * float(np.median(others)):
                self._streak[i] = 0
                continue
            self._streak[i] = self._streak.get(i, 0) + 1
            if self._streak[i] >= SLOW_RECORDS and i not in named:
                rec = {
                    "trainer": i,
                    "step": step,
                    "compute_ms": round(m, 2),
                    "others_ms": round(float(np.median(others)), 2),
                }
                self.slow.append(rec)
                warn(
                    f"trainer {i} is slow: its compute takes {m:.1f} ms a chunk against {rec['others_ms']:.1f} ms for the "
                    f"others ({m / rec['others_ms']:.1f}x, {SLOW_RECORDS} log records in a row to step {step})"
                )


class ChunkBalance:
    """Chunks follow speed (``--balance-every N``, where ``TrainerGroup.balances``): every N steps each
    trainer's compute a step since the last plan is exchanged (a collective at the same step on every
    trainer) and ``plan_chunks`` decides, alike everywhere; a new plan is taken from the next step
    (``take``: that step's batch read again, of the new chunks). Chunks are reduced in chunk order,
    so no plan moves a bit. ``plans``: every plan taken (step, chunks by rank, compute a chunk)."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.next: list[int] | None = None
        self.plans: list[dict] = []

    def due(self, group, step: int, last: int) -> bool:
        return bool(self.every) and group.balances and step % self.every == 0 and step < last

    def plan(self, speeds: TrainerSpeeds, group, step: int, says: bool, log) -> None:
        ms = speeds.exchange_since(group)
        now = group.counts()
        counts = plan_chunks(ms, now, group.num_chunks)
        if counts is None:
            return
        self.next = counts
        per = [round(m / n, 2) for m, n in zip(ms, now)]
        rec = {"step": step, "chunks": counts, "chunk_ms": per}
        self.plans.append(rec)
        log(rec)
        if says:
            tqdm.write(
                f"step {step}: chunks follow speed: trainers (by rank) train {counts} of the {group.num_chunks} chunks "
                f"from step {step + 1} (their compute {per} ms a chunk)",
                file=sys.stderr,
            )

    def take(self, reader, group, batch, build):
        """-> (the reader of the planned chunks, the step's batch of them): ``batch``, read with the
        old chunks, is read again from the same position. ``build()``: a reader of ``group.chunks``."""
        counts, self.next = self.next, None
        if batch is None:  # no step after this one
            return reader, batch
        state = reader.state_dict()
        state["position"] -= state["global_batch_size"]  # the batch handed out for this step
        reader.close()
        group.assign(counts)
        reader = build()
        reader.load_state_dict(state)
        return reader, next(reader)


# -- cores of their own for the trainers one launcher starts on one host (--no-pin-trainers: off) --
#
# On the benchmark's 2-core host, 2 trainers left to the scheduler share their cores with 2 local
# Redis servers and the trainers' helper threads: the scheduler often ran both training threads on
# one core while the other sat idle in a wait, and one trainer then waited about 10 ms a step in the
# step's collectives for the other (``docs/benchmarks.md``). Trainer ``i`` of ``W`` gets cores
# ``i*k .. i*k + k - 1`` of the ``n`` this process may use (``k = n // W``; none with one trainer or
# more trainers than cores): its training thread and its own helper threads stay there, while the
# servers, the Lighthouse and the launcher go where there is room.


_HOST_CORES: list[int] = []  # the cores this process could use before ``pin_trainer`` took its share


def usable_cores() -> list[int]:
    """The cores this process may run on, in order."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def host_cores() -> list[int]:
    """The cores the trainers of this host share (the torch threads' split, ``Trainer``): those this
    process could use before it was pinned to its own."""
    return list(_HOST_CORES) or usable_cores()


def trainer_cores(index: int, trainers: int, cores: list[int] | None = None) -> list[int] | None:
    """The cores of trainer ``index`` of ``trainers``; None where the trainers do not each get one
    (one trainer, more trainers than cores, an index out of range): the scheduler places them."""
    cores = usable_cores() if cores is None else cores
    k = len(cores) // trainers if trainers > 0 else 0
    if trainers < 2 or k < 1 or not 0 <= index < trainers:
        return None
    return cores[index * k : (index + 1) * k]


def pin_process(cores: list[int]) -> int:
    """Every thread of this process (and so every thread one of them starts later) on ``cores``.
    -> threads pinned (a thread that ended meanwhile is skipped)."""
    pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
            pinned += 1
        except OSError:  # a thread that ended, or cores the host no longer lets it have: left as it was
            pass
    return pinned


def pin_trainer(index: int, trainers: int, enabled: bool = True, threads: int = 0) -> list[int] | None:
    """Trainer ``index``'s process onto its cores (``trainer_cores``). -> the cores, or None (left
    to the scheduler: ``enabled`` off, no cores of its own, or ``threads``, torch threads asked for
    with ``--threads``, more than its cores: they would spin on one another)."""
    cores = trainer_cores(index, trainers) if enabled and hasattr(os, "sched_setaffinity") else None
    if cores is not None and threads > len(cores):
        cores = None
    if cores is not None:
        before = host_cores()
        if not pin_process(cores):
            return None
        _HOST_CORES[:] = before
    return cores
