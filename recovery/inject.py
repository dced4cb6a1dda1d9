"""Failure injection on real processes and files, at a step, at a wall-clock moment, or during a phase.

Specs (``--inject``, several allowed). ``WHEN`` is ``step=N`` (the start of step N), ``t=S`` (S
seconds after training started, fired from a timer wherever the trainers are) or, for shard kills,
``during=PHASE`` (checkpoint | eval | recovery | resume: inside that phase, the first time it runs;
``trainer:R@during=resume``: a trainer killed as it rejoins after another's death):

- ``shard:K@WHEN``          SIGKILL shard K (a shard reached only by URL: ``SHUTDOWN NOSAVE``)
- ``stall:K@WHEN:SECS``     SIGSTOP shard K, SIGCONT after SECS seconds (by URL: ``CLIENT PAUSE``)
- ``trainer:R@WHEN``        trainer rank R SIGKILLs itself (``step=N``: in step N, after its shard writes
                            and a checkpoint still being written)
- ``stop-trainer:R@WHEN:SECS``  trainer R SIGSTOPs itself (``step=N``: at the start of step N; a long GC, a swap
                            storm) and a helper process SIGCONTs it SECS seconds later
- ``node:R@WHEN``           a node failure: trainer R and the shards it writes (K % trainers == R) die together
- ``lighthouse@WHEN``        SIGKILL the run's torchft Lighthouse (``--trainer-recovery replace``): the
                            launcher stops the trainers in one line, the run resumable (``--resume``)
- ``corrupt-checkpoint:latest[@step=N]``  flip bytes in a shard file of the newest checkpoint at step N
                            (default: just before the first restore reads it)
- ``corrupt-log:K@step=N``  flip a byte in the middle of shard K's newest log segment at the start of
                            step N (a disk that damaged a record the log already holds)
- ``slow-restore:K:SECS``   the next restore of shard K takes SECS seconds longer (a large shard or a
                            slow network, in tests and benchmarks)
- ``slow-trainer:R:F[@step=N]``  from step N (default 1) trainer R's compute takes F times as long (a
                            sleep of F - 1 times its measured compute each step: the cores are not the
                            cause); not a failure: it fires once and lasts to the run's end
- ``corrupt-dense@step=N``  flip a byte of the per-step dense state (``dense_latest.pt``) in step N,
                            after the step's writes (pair it with ``trainer:0@step=N``: the restart
                            finds it damaged)

Each injection fires once per run: fired ones are appended to ``{run}/injections.jsonl`` (which also
holds the run's time origin), so a restarted trainer group neither repeats nor forgets them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recovery.durable import layout
from recovery.durable.files import append_line, read_lines, write_atomic
from recovery.errors import InjectionSpecError

PHASES = ("checkpoint", "eval", "recovery", "resume")
_WHEN = r"(?:step=(\d+)|t=(\d+(?:\.\d+)?)|during=(" + "|".join(PHASES) + r"))"
_PATTERNS = {
    "shard": re.compile(r"shard:(\d+)@" + _WHEN),
    "stall": re.compile(r"stall:(\d+)@" + _WHEN + r":(\d+(?:\.\d+)?)"),
    "trainer": re.compile(r"trainer:(\d+)@" + _WHEN),
    "stop-trainer": re.compile(r"stop-trainer:(\d+)@" + _WHEN + r":(\d+(?:\.\d+)?)"),
    "node": re.compile(r"node:(\d+)@" + _WHEN),
    "corrupt-checkpoint": re.compile(r"corrupt-checkpoint:latest(?:@step=(\d+))?"),
    "corrupt-log": re.compile(r"corrupt-log:(\d+)@step=(\d+)"),
    "corrupt-dense": re.compile(r"corrupt-dense@step=(\d+)"),
    "slow-restore": re.compile(r"slow-restore:(\d+):(\d+(?:\.\d+)?)"),
    "slow-trainer": re.compile(r"slow-trainer:(\d+):(\d+(?:\.\d+)?)(?:@step=(\d+))?"),
    "lighthouse": re.compile(r"lighthouse@(?:step=(\d+)|t=(\d+(?:\.\d+)?))"),
}
USAGE = (
    "expected shard:K@WHEN, stall:K@WHEN:SECONDS, trainer:R@WHEN, stop-trainer:R@WHEN:SECONDS, node:R@WHEN (WHEN: step=N, t=SECONDS or "
    f"during={'|'.join(PHASES)}), corrupt-checkpoint:latest[@step=N], corrupt-log:K@step=N, corrupt-dense@step=N, slow-restore:K:SECONDS, slow-trainer:R:FACTOR[@step=N] or lighthouse@WHEN"
)


@dataclass(frozen=True)
class Injection:
    kind: str  # shard | stall | trainer | node | corrupt-checkpoint | corrupt-log
    target: int | None
    step: int | None
    seconds: float = 0.0  # stall length
    t: float | None = None  # wall-clock moment, seconds after training started
    during: str | None = None  # a phase

    @property
    def when(self) -> str:
        if self.t is not None:
            return f"t={self.t:g}"
        if self.during is not None:
            return f"during={self.during}"
        return f"step={self.step}"

    def __str__(self) -> str:
        if self.kind == "corrupt-checkpoint":
            return "corrupt-checkpoint:latest" + (f"@step={self.step}" if self.step else "")
        if self.kind == "corrupt-dense":
            return f"corrupt-dense@step={self.step}"
        if self.kind == "slow-restore":
            return f"slow-restore:{self.target}:{self.seconds:g}"
        if self.kind == "lighthouse":
            return f"lighthouse@{self.when}"
        if self.kind == "slow-trainer":
            return f"slow-trainer:{self.target}:{self.seconds:g}@step={self.step}"
        tail = f":{self.seconds:g}" if self.kind in ("stall", "stop-trainer") else ""
        return f"{self.kind}:{self.target}@{self.when}{tail}"

    def shards(self, world_size: int, num_shards: int) -> list[int]:
        """The shards this injection takes down."""
        if self.kind in ("shard", "stall"):
            return [self.target]
        if self.kind == "node":
            return [s for s in range(num_shards) if s % world_size == self.target]
        return []


def parse_injection(spec: str) -> Injection:
    spec = spec.strip()
    for kind, pat in _PATTERNS.items():
        m = pat.fullmatch(spec)
        if not m:
            continue
        g = m.groups()
        if kind == "corrupt-checkpoint":
            return Injection(kind, None, int(g[0]) if g[0] else None)
        if kind == "corrupt-log":
            return Injection(kind, int(g[0]), int(g[1]))
        if kind == "corrupt-dense":
            return Injection(kind, None, int(g[0]))
        if kind == "slow-restore":
            return Injection(kind, int(g[0]), None, float(g[1]))
        if kind == "lighthouse":
            return Injection(kind, None, int(g[0]) if g[0] else None, t=float(g[1]) if g[1] else None)
        if kind == "slow-trainer":
            factor, step = float(g[1]), int(g[2]) if g[2] else 1
            if factor < 1 or step < 1:
                raise InjectionSpecError(f"--inject {spec!r}: the factor must be >= 1 and the step >= 1")
            return Injection(kind, int(g[0]), step, factor)
        target, step, t, during = int(g[0]), g[1], g[2], g[3]
        if during is not None and kind != "shard" and (kind, during) != ("trainer", "resume"):
            raise InjectionSpecError(
                f"--inject {spec!r}: during=PHASE is for shard kills (shard:K@during=...), and trainer:R@during=resume"
            )
        return Injection(
            kind,
            target,
            int(step) if step is not None else None,
            float(g[4]) if kind in ("stall", "stop-trainer") else 0.0,
            float(t) if t is not None else None,
            during,
        )
    raise InjectionSpecError(f"--inject {spec!r}: {USAGE}")


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
    """Fires this trainer's injections; records durably which fired and when.

    Rank 0 fires shard kills, stalls and checkpoint corruption; trainer R fires ``trainer:R`` and
    ``node:R``. Call ``start(fresh)`` once the trainers agree the run started (it arms the timers),
    ``at_step`` at each step's start, ``during(phase)`` inside the phases, ``close()`` at the end."""

    def __init__(
        self,
        injections: list[Injection],
        rank: int,
        shard_pidfiles: list[Path | None],
        run_dir: Path,
        world_size: int = 1,
        urls: list[str] | None = None,
        log_dir: str | os.PathLike | None = None,
        dense_path: str | os.PathLike | None = None,
    ) -> None:
        self.injections = list(injections)
        # the trainer ``trainer:R`` and ``node:R`` name: its rank, or under --trainer-recovery
        # replace (ranks follow the quorum) its index, set by ``recovery.factory``
        self.index = rank
        self.log_dir = Path(log_dir) if log_dir else None  # corrupt-log's target
        self.dense_path = Path(dense_path) if dense_path else None  # corrupt-dense's
        self.rank, self.world_size = rank, world_size
        self.pidfiles = shard_pidfiles  # None for a shard reached only by URL
        self.urls = list(urls or [])
        self.run_dir = Path(run_dir)
        self.path = layout.injections_file(self.run_dir)
        self.step = 0  # the step the trainer is in (timers record it)
        self._settle: Callable[[], None] | None = None  # the checkpointer's, from ``at_step``
        self.t0 = time.time()
        self.corrupted: list[str] = []
        self._lock = threading.Lock()
        self._timers: list[threading.Timer] = []
        self._fired: dict[str, dict] = {}

    # -- bookkeeping --------------------------------------------------------------------------
    def start(self, fresh: bool, barrier=lambda: None) -> None:
        """Fresh run: rank 0 sets the time origin (not where the same run starts again from scratch,
        ``layout.began_before``: what fired stays fired); then every trainer loads it and arms its timers."""
        if fresh and self.rank == 0 and not layout.began_before(self.run_dir):
            write_atomic(self.path, json.dumps({"t0": time.time()}) + "\n")
        barrier()
        self._load()
        for inj in self.injections:
            if inj.t is not None and self._mine(inj) and str(inj) not in self._fired:
                delay = max(0.0, self.t0 + inj.t - time.time())
                timer = threading.Timer(delay, self._fire, args=(inj,))
                timer.daemon = True
                timer.start()
                self._timers.append(timer)

    def _load(self) -> None:
        fired = {}  # built aside, then swapped in: restore threads read it meanwhile
        for rec in read_lines(self.path):
            if "t0" in rec:
                self.t0 = float(rec["t0"])
            elif "spec" in rec:
                fired[rec["spec"]] = rec
        self._fired = fired

    def _record(self, inj: Injection, shards: list[int]) -> dict:
        rec = {"spec": str(inj), "kind": inj.kind, "target": inj.target, "shards": shards}
        rec.update(step=self.step, time=time.time(), t=round(time.time() - self.t0, 3), rank=self.rank)
        append_line(self.path, rec)
        self._fired[str(inj)] = rec
        return rec

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()

    def _mine(self, inj: Injection) -> bool:
        if inj.kind in ("trainer", "node", "slow-trainer", "stop-trainer"):
            return inj.target == self.index
        return self.rank == 0

    def fired(self) -> list[dict]:
        """Every injection fired in this run so far (any trainer, any attempt)."""
        self._load()
        return sorted(self._fired.values(), key=lambda r: r["time"])

    def not_fired(self) -> list[str]:
        self._load()
        return [str(i) for i in self.injections if str(i) not in self._fired]

    def _latest_on(self, shard: int) -> dict | None:
        hits = [r for r in self.fired() if shard in r.get("shards", [])]
        return hits[-1] if hits else None

    def fired_at(self, shard: int) -> float | None:
        return (self._latest_on(shard) or {}).get("time")

    def fired_step(self, shard: int) -> int | None:
        """The step at which the latest injection on ``shard`` fired, if any."""
        return (self._latest_on(shard) or {}).get("step")

    def kind_of(self, shard: int) -> str:
        return (self._latest_on(shard) or {}).get("kind", "shard")

    # -- firing -------------------------------------------------------------------------------
    def at_step(self, step: int, latest_checkpoint_file=None, settle=None) -> None:
        """Start of a step: step-scheduled shard kills, stalls, node failures and checkpoint corruption.
        ``settle`` (the checkpointer's) is called before a kill: a checkpoint still being written in
        the background completes first, so ``shard:1@step=25`` finds the same checkpoints on a fast
        machine and a slow one (a kill during a checkpoint is ``@during=checkpoint``)."""
        self.step = step
        self._settle = settle  # a trainer's kill, later in the step, settles it as well
        for inj in self.injections:
            if inj.step != step or inj.t is not None or inj.during is not None or not self._mine(inj):
                continue
            if inj.kind == "corrupt-checkpoint":
                if latest_checkpoint_file is not None and str(inj) not in self._fired:
                    self._corrupt(inj, latest_checkpoint_file)
            elif inj.kind == "corrupt-log":
                if str(inj) not in self._fired:
                    self._corrupt(inj, lambda inj=inj: self._newest_segment(inj))
            elif inj.kind == "slow-trainer":
                continue  # ``slow_factor``: every step from its own
            elif inj.kind not in ("trainer", "corrupt-dense"):  # both fire mid-step
                if settle is not None:
                    settle()
                self._fire(inj)

    def mid_step(self, step: int) -> None:
        """After this trainer's own shard writes: ``corrupt-dense@step=N`` (rank 0), then
        ``trainer:R@step=N`` once a checkpoint still being written (by rank 0) completes, as before
        ``at_step``'s kills: the run resumes from the same checkpoint on a fast machine and a slow one."""
        for inj in self.injections:
            if inj.kind == "corrupt-dense" and inj.step == step and self.rank == 0 and str(inj) not in self._fired:
                self._corrupt(inj, lambda: self.dense_path if self.dense_path and self.dense_path.exists() else None)
        for inj in self.injections:
            if inj.kind == "trainer" and inj.step == step and inj.t is None:
                if self._settle is not None:  # rank 0's, whoever dies (R != 0: in the same step, not before)
                    self._settle()
                if self._mine(inj):
                    self._fire(inj)

    def slow_factor(self, step: int) -> float:
        """``slow-trainer:R:F@step=N`` on this trainer, from step N on: F (recorded as fired the first
        time); 1.0 otherwise."""
        factor = 1.0
        for inj in self.injections:
            if inj.kind == "slow-trainer" and inj.step is not None and step >= inj.step and self._mine(inj):
                with self._lock:
                    if str(inj) not in self._fired:
                        self._record(inj, [])
                factor *= inj.seconds
        return factor

    def during(self, phase: str, exclude: int | None = None) -> None:
        for inj in self.injections:
            if inj.during == phase and inj.target != exclude and self._mine(inj):
                self._fire(inj)

    def restore_delay(self, shard: int) -> float:
        """``slow-restore:K:SECS``: the seconds the restore of ``shard`` beginning now takes longer
        (once per injection; recorded as fired)."""
        delay = 0.0
        for inj in self.injections:
            if inj.kind == "slow-restore" and inj.target == shard and self._mine(inj):
                with self._lock:
                    if str(inj) in self._fired:
                        continue
                    self._record(inj, [])
                delay += inj.seconds
        return delay

    def before_restore(self, latest_checkpoint_file) -> None:
        for inj in self.injections:
            if inj.kind == "corrupt-checkpoint" and inj.step is None and self.rank == 0:
                with self._lock:  # a node's shards are restored at once: one corruption
                    if str(inj) not in self._fired:
                        self._corrupt(inj, latest_checkpoint_file)

    def _newest_segment(self, inj: Injection) -> Path | None:
        if self.log_dir is None:
            raise InjectionSpecError(f"--inject {inj}: the run keeps no update logs (--recovery log)")
        segs = layout.log_segments(self.log_dir, inj.target)
        return segs[-1] if segs and segs[-1].stat().st_size else None

    def _corrupt(self, inj: Injection, latest_checkpoint_file) -> None:
        path = latest_checkpoint_file()
        if path is not None:
            corrupt_file(path)
            self.corrupted.append(str(path))
            self._record(inj, [])

    def _fire(self, inj: Injection) -> None:
        with self._lock:
            if str(inj) in self._fired:
                return
            shards = inj.shards(self.world_size, len(self.pidfiles))
            for s in shards:
                if s >= len(self.pidfiles):
                    raise InjectionSpecError(f"--inject {inj}: no shard {s} (run has {len(self.pidfiles)})")
            if inj.kind in ("trainer", "node"):
                rec = self._record(inj, shards)
                marker = {
                    "kind": inj.kind,
                    "rank": self.index,
                    "step": self.step,
                    "time": rec["time"],
                    "shards": shards,
                }
                append_line(layout.trainer_failures_file(self.run_dir), marker)
                for s in shards:
                    self._kill_shard(s)
                if shards:
                    time.sleep(0.05)  # a moment later, the trainer goes down with its node
                os.kill(os.getpid(), signal.SIGKILL)
            if inj.kind == "stop-trainer":  # a helper resumes it: a stopped process resumes nothing
                self._record(inj, [])
                resume = f"sleep {inj.seconds:g}; kill -CONT {os.getpid()}"
                subprocess.Popen(
                    ["sh", "-c", resume], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            if inj.kind == "lighthouse":
                self._record(inj, [])
                pid = os.environ.get("RECSYS_LIGHTHOUSE_PID")
                if not pid:
                    raise InjectionSpecError(f"--inject {inj}: no Lighthouse of this launcher's to kill")
                os.kill(int(pid), signal.SIGKILL)
                return
            self._record(inj, shards)
            if inj.kind == "shard":
                self._kill_shard(inj.target)
            else:
                self._stall_shard(inj.target, inj.seconds)

    # a local shard gets signals; one reached only by URL gets the same through the protocol
    def _kill_shard(self, shard: int) -> None:
        if self.pidfiles[shard] is not None:
            _signal(self.pidfiles[shard], signal.SIGKILL)
        else:
            self._command(shard, "SHUTDOWN", "NOSAVE")

    def _stall_shard(self, shard: int, seconds: float) -> None:
        pid = read_pid(self.pidfiles[shard]) if self.pidfiles[shard] is not None else None
        if pid is None:  # every client waits, as with SIGSTOP; the server resumes by itself
            self._command(shard, "CLIENT", "PAUSE", str(max(1, int(seconds * 1000))), "ALL")
            return
        _signal(self.pidfiles[shard], signal.SIGSTOP)
        timer = threading.Timer(seconds, _resume, args=(pid,))
        timer.daemon = True  # a run that recovered does not wait for the stall to end
        timer.start()

    def _command(self, shard: int, *args: str) -> None:
        import redis

        from embeddings.net.endpoints import one_try

        # one try: SHUTDOWN drops the connection, and a retry would only wait to fail
        client = redis.Redis.from_url(self.urls[shard], socket_timeout=5.0, socket_connect_timeout=5.0, retry=one_try())
        try:
            client.execute_command(*args)
        except redis.ConnectionError:
            pass  # SHUTDOWN closes the connection it came on; a shard already gone is gone
        finally:
            client.close()


def _signal(pidfile: Path, sig: int) -> None:
    pid = read_pid(pidfile)
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # already gone


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # recovery already replaced it
