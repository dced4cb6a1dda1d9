"""Failure injection on real processes and files.

Specs (``--inject``, several allowed):

- ``shard:K@step=N``        SIGKILL shard K at the start of step N
- ``stall:K@step=N:SECS``   SIGSTOP shard K at the start of step N, SIGCONT after SECS seconds
- ``trainer:R@step=N``      trainer rank R SIGKILLs itself in step N, after its own shard writes
                            (first attempt only: the restarted group replays the step)
- ``corrupt-checkpoint:latest[@step=N]``  flip bytes in a shard file of the newest checkpoint at
                            step N (default: just before the first restore reads it)
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from recovery.errors import InjectionSpecError

_PATTERNS = {
    "shard": re.compile(r"shard:(\d+)@step=(\d+)"),
    "stall": re.compile(r"stall:(\d+)@step=(\d+):(\d+(?:\.\d+)?)"),
    "trainer": re.compile(r"trainer:(\d+)@step=(\d+)"),
    "corrupt-checkpoint": re.compile(r"corrupt-checkpoint:latest(?:@step=(\d+))?"),
}


@dataclass(frozen=True)
class Injection:
    kind: str  # shard | stall | trainer | corrupt-checkpoint
    target: int | None
    step: int | None
    seconds: float = 0.0

    def __str__(self) -> str:
        return {
            "shard": f"shard:{self.target}@step={self.step}",
            "stall": f"stall:{self.target}@step={self.step}:{self.seconds:g}",
            "trainer": f"trainer:{self.target}@step={self.step}",
            "corrupt-checkpoint": "corrupt-checkpoint:latest" + (f"@step={self.step}" if self.step else ""),
        }[self.kind]


def parse_injection(spec: str) -> Injection:
    spec = spec.strip()
    for kind, pat in _PATTERNS.items():
        m = pat.fullmatch(spec)
        if m:
            g = m.groups()
            if kind == "stall":
                return Injection(kind, int(g[0]), int(g[1]), float(g[2]))
            if kind == "corrupt-checkpoint":
                return Injection(kind, None, int(g[0]) if g[0] else None)
            return Injection(kind, int(g[0]), int(g[1]))
    raise InjectionSpecError(
        f"--inject {spec!r}: expected shard:K@step=N, trainer:R@step=N, stall:K@step=N:SECONDS "
        "or corrupt-checkpoint:latest[@step=N]"
    )


def read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def corrupt_file(path: Path) -> None:
    """Flip one byte in the middle of ``path`` (in place, fsynced)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
        f.flush()
        os.fsync(f.fileno())


class Injector:
    """Fires the injections of this trainer at their steps; records when each fired."""

    def __init__(
        self, injections: list[Injection], rank: int, shard_pidfiles: list[Path], run_dir: Path, restart_count: int = 0
    ) -> None:
        self.injections = list(injections)
        self.rank = rank
        self.pidfiles = shard_pidfiles
        self.run_dir = run_dir
        self.restart_count = restart_count
        self.fired_at: dict[int, float] = {}  # shard -> time it was failed
        self._done: set[Injection] = set()
        self.corrupted: list[str] = []

    def at_step(self, step: int, latest_checkpoint_file=None) -> None:
        """Start of a step: shard kills, stalls and checkpoint corruption (rank 0 acts)."""
        for inj in self.injections:
            if inj in self._done or inj.step != step or self.rank != 0:
                continue
            if inj.kind in ("shard", "stall"):
                if inj.target >= len(self.pidfiles):
                    raise InjectionSpecError(f"--inject {inj}: no shard {inj.target} (run has {len(self.pidfiles)})")
                pid = read_pid(self.pidfiles[inj.target])
                if pid is None:
                    continue
                self.fired_at[inj.target] = time.time()
                if inj.kind == "shard":
                    os.kill(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGSTOP)
                    timer = threading.Timer(inj.seconds, _resume, args=(pid,))
                    timer.daemon = True  # a run that recovered does not wait for the stall to end
                    timer.start()
                self._done.add(inj)
            elif inj.kind == "corrupt-checkpoint" and latest_checkpoint_file is not None:
                path = latest_checkpoint_file()
                if path is not None:
                    corrupt_file(path)
                    self.corrupted.append(str(path))
                    self._done.add(inj)

    def before_restore(self, latest_checkpoint_file) -> None:
        for inj in self.injections:
            if inj.kind == "corrupt-checkpoint" and inj.step is None and inj not in self._done and self.rank == 0:
                path = latest_checkpoint_file()
                if path is not None:
                    corrupt_file(path)
                    self.corrupted.append(str(path))
                    self._done.add(inj)

    def mid_step(self, step: int) -> None:
        """After this trainer's own shard writes: a trainer kill, on the first attempt only."""
        for inj in self.injections:
            if inj.kind == "trainer" and inj.target == self.rank and inj.step == step and self.restart_count == 0:
                marker = self.run_dir / "trainer_failure.json"
                marker.write_text(json.dumps({"rank": self.rank, "step": step, "time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # recovery already replaced it
