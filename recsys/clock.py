"""Step timing: where a training step's time goes, and how the training thread spent it."""

from __future__ import annotations

import sys
import time

import numpy as np
from tqdm import tqdm

WARMUP_STEPS = 10  # steps before the step time is steady: throughput counts after them, the auto planner measures them


def thread_sched() -> tuple[float, float, float] | None:
    """(wall clock, seconds on a CPU, seconds runnable but waiting for a CPU) of the calling thread,
    from Linux's ``/proc/thread-self/schedstat``; None where there is none."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, runnable = f.read().split()[:2]
        return time.perf_counter(), int(on_cpu) / 1e9, int(runnable) / 1e9
    except (OSError, ValueError):
        return None


class StepClock:
    """Where a step's time goes: seconds per part (rows in, data, compute, rows out, waiting), summed.
    And how the training thread spent the steps after the warm-up (``marks``): on a CPU, runnable but
    waiting for one (the host's other threads and processes had the cores), or neither (waiting
    for a write, a lock, the GIL)."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self._t = 0.0
        self.marks: list[tuple[int, tuple[float, float, float] | None]] = []  # (step, thread_sched())

    def start(self, t: float) -> None:
        self._t = t

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._t
        self._t = now

    def per_step_ms(self, steps: int) -> dict[str, float]:
        return {k: round(1000 * v / max(1, steps), 2) for k, v in self.parts.items()}

    def mark(self, step: int) -> None:
        """The training thread's scheduler times as of the end of ``step``."""
        self.marks.append((step, thread_sched()))

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
SLOW_RECORDS = 3  # in this many log records in a row: persistently slow, named once


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

    def add(self, seconds: float) -> None:
        self._s += seconds
        self._n += 1

    def exchange(self, group, index: int, step: int, says: bool) -> dict[str, float]:
        """This trainer's mean since the last call, everyone's by index (``group.sum_floats``); a
        trainer found slow is named on the terminal where ``says`` (rank 0)."""
        mine = 1000 * self._s / max(1, self._n)
        self._s, self._n = 0.0, 0
        vec = np.zeros(2 * group.world_size)
        vec[2 * group.rank : 2 * group.rank + 2] = (mine, index)
        got = group.sum_floats(vec).reshape(-1, 2)
        ms = {int(i): float(m) for m, i in got}
        self._judge(ms, step, (lambda line: tqdm.write(line, file=sys.stderr)) if says else (lambda line: None))
        return {str(i): round(m, 2) for i, m in sorted(ms.items())}

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
                    f"trainer {i} is slow: its compute takes {m:.1f} ms a step against {rec['others_ms']:.1f} ms for the "
                    f"others ({m / rec['others_ms']:.1f}x, {SLOW_RECORDS} log records in a row to step {step})"
                )
