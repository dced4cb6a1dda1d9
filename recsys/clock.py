"""Step timing: where a training step's time goes, and how the training thread spent it."""

from __future__ import annotations

import time

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
