"""Test the recovery of your own models: Redis servers you can kill, failure schedules, assertions.

The pytest plugin (``recsys.pytest_plugin``, registered through the ``pytest11`` entry point when
the package is installed) gives these as fixtures; they work without pytest too.

- ``RedisServers(n, folder)``: ``n`` plain ``redis-server`` processes on free loopback ports,
  outside any run. ``kill(i)`` SIGKILLs one from outside (as the OOM killer would), ``stall(i, s)``
  freezes it for ``s`` seconds (SIGSTOP, then SIGCONT), ``restart(i)`` brings it back empty. With
  ``supervised=True`` a watcher restarts any server that exits, empty, on the same port, as
  systemd's ``Restart=always`` would; ``hold(i)`` keeps it down (a machine that does not come back)
  and ``release(i)`` lets it return. Pass ``servers.redis`` as a run's ``redis`` setting.
- ``FailureSchedule``: the failures to inject into a run, written out (``kill_shard(1, step=50)``)
  or drawn from a failure process (``FailureSchedule.drawn(steps, mtbf, shards, seed)``).
- ``small_config(out, **overrides)``: a run config small enough for a test (seconds).
- ``assert_same_embeddings(a, b)``, ``assert_lost_at_most(run, pls)``,
  ``assert_recovered(run, ...)``: assertions on finished runs (``recsys.Run`` or a run folder).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

SMALL = {
    "steps": 40,
    "batch_size": 256,
    "rows_per_table": 2000,
    "embedding_dim": 8,
    "eval_every": 0,
    "eval_samples": 2048,
    "log_every": 5,
    "shards": 3,
    "progress": False,
}


def small_config(out: str | Path, **overrides: Any):
    """A run config small enough for a test: 40 steps of 256 samples, 26 tables of 2000 rows x 8,
    3 local shards; ``overrides`` as for ``recsys.configure``."""
    from recsys.api import configure

    return configure(**{**SMALL, "out": str(out), **overrides})


def _free_port_below(limit: int = 55_000) -> int:
    """A free loopback port; below ``limit`` so that a cluster node's bus port (+10000) exists."""
    from embeddings.servers.launcher import free_port

    while (port := free_port()) > limit:
        pass
    return port


class RedisServers:
    """Plain ``redis-server`` processes on loopback, started outside any run (see the module doc)."""

    def __init__(
        self,
        n: int,
        folder: str | Path,
        *,
        supervised: bool = False,
        delay_s: float = 0.3,
        extra: tuple[str, ...] = (),
    ) -> None:
        self.folder = Path(folder)
        self.delay_s = delay_s
        self.extra = tuple(extra)
        self.supervised = supervised
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not on PATH (install Redis 7: apt-get install redis-server)")
        self.ports = [_free_port_below() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.held: set[int] = set()
        self.restarts = [0] * n
        self.started_pids: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for i in range(n):
            self._start(i)
        self._thread = threading.Thread(target=self._watch, daemon=True) if supervised else None
        if self._thread is not None:
            self._thread.start()

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    @property
    def redis(self) -> str:
        """The servers as a run's ``redis`` setting (``--redis``)."""
        return ",".join(self.urls)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def _start(self, i: int) -> None:
        import redis

        d = self.folder / f"server{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "dump.rdb").unlink(missing_ok=True)  # it comes back empty
        cmd = [self.binary, "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(d), "--logfile", str(d / "redis.log"), *self.extra]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.procs[i] = proc
        self.started_pids.add(proc.pid)
        client = redis.Redis(port=self.ports[i], socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    time.sleep(0.02)
        finally:
            client.close()
        raise RuntimeError(f"redis-server on port {self.ports[i]} did not start (log: {d / 'redis.log'})")

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for i, p in enumerate(self.procs):
                with self._lock:
                    if p is not None and p.poll() is not None and i not in self.held and not self._stop.is_set():
                        time.sleep(self.delay_s)
                        self.restarts[i] += 1
                        self._start(i)

    def alive(self, i: int) -> bool:
        p = self.procs[i]
        return p is not None and p.poll() is None

    def kill(self, i: int) -> None:
        """SIGKILL server ``i`` from outside (supervised: it comes back empty after ``delay_s``)."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.send_signal(signal.SIGKILL)
            p.wait()

    def stall(self, i: int, seconds: float) -> None:
        """Freeze server ``i`` for ``seconds`` (SIGSTOP now, SIGCONT later; returns at once)."""
        p = self.procs[i]
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGSTOP)

        def wake() -> None:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)

        t = threading.Timer(seconds, wake)
        t.daemon = True
        t.start()

    def restart(self, i: int) -> None:
        """Kill server ``i`` (if up) and start it again, empty, on the same port."""
        with self._lock:
            self.kill(i)
            self.restarts[i] += 1
            self._start(i)

    def hold(self, i: int) -> None:
        with self._lock:
            self.held.add(i)

    def release(self, i: int) -> None:
        with self._lock:
            self.held.discard(i)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def __enter__(self) -> RedisServers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FailureSchedule:
    """Failures to inject into a run (``recovery.inject``); chain the builders, then pass
    ``schedule.specs`` as ``inject=`` (or ``**schedule.overrides()``)."""

    def __init__(self, specs: list[str] | None = None) -> None:
        self.specs: list[str] = list(specs or [])

    @staticmethod
    def _when(step: int | None, t: float | None, during: str | None) -> str:
        given = [x for x in (step, t, during) if x is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of step=, t=, during= (got step={step}, t={t}, during={during})")
        if step is not None:
            return f"step={int(step)}"
        if t is not None:
            return f"t={float(t):g}"
        return f"during={during}"

    def kill_shard(self, shard: int, *, step: int | None = None, t: float | None = None, during: str | None = None):
        """SIGKILL shard ``shard``'s server at a step, a moment (seconds after training began) or during a
        phase (checkpoint, eval, recovery, resume)."""
        self.specs.append(f"shard:{shard}@{self._when(step, t, during)}")
        return self

    def stall_shard(self, shard: int, seconds: float, *, step: int | None = None, t: float | None = None):
        self.specs.append(f"stall:{shard}@{self._when(step, t, None)}:{seconds:g}")
        return self

    def kill_trainer(self, rank: int, *, step: int | None = None, t: float | None = None):
        """SIGKILL trainer ``rank`` (the run needs ``max_restarts >= 1``)."""
        self.specs.append(f"trainer:{rank}@{self._when(step, t, None)}")
        return self

    def corrupt_checkpoint(self, *, step: int | None = None):
        self.specs.append("corrupt-checkpoint:latest" + (f"@step={int(step)}" if step is not None else ""))
        return self

    @classmethod
    def drawn(cls, steps: int, mtbf: float, shards: int, seed: int = 0) -> FailureSchedule:
        """Shard kills at exponentially distributed gaps of mean ``mtbf`` steps, a seeded random shard
        each (the draw ``bench-recovery --sweep`` uses)."""
        from recsys.bench.recovery import mtbf_schedule

        return cls(mtbf_schedule(steps, mtbf, shards, seed))

    def overrides(self) -> dict:
        return {"inject": list(self.specs)}

    def __iter__(self):
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)

    def __repr__(self) -> str:
        return f"FailureSchedule({self.specs!r})"


def _run(run):
    from recsys.api import Run, load_run

    r = run if isinstance(run, Run) else load_run(run)
    if r.summary is None:
        raise AssertionError(f"run {r.path} has no summary.json (it did not finish)")
    return r


def assert_same_embeddings(a, b) -> None:
    """The two runs ended with bit-identical embedding tables (weights and optimizer state)."""
    ra, rb = _run(a), _run(b)
    da, db = ra.summary.embedding_digest, rb.summary.embedding_digest
    for r, d in ((ra, da), (rb, db)):
        if not d:
            raise AssertionError(f"run {r.path} has no embedding digest (its tables are over --digest-max-rows)")
    if da != db:
        raise AssertionError(
            f"embeddings differ: {ra.path} ({ra.summary.recovery}, {len(ra.failures)} failures) has digest "
            f"{da[:16]}..., {rb.path} ({rb.summary.recovery}, {len(rb.failures)} failures) has {db[:16]}..."
        )


def assert_lost_at_most(run, pls: float) -> None:
    """The run lost at most the portion ``pls`` of its samples to partial recoveries."""
    r = _run(run)
    if not r.summary.pls <= pls:
        lost = ", ".join(f"shard {f.target}@{f.step}: {f.lost_updates} updates" for f in r.failures)
        raise AssertionError(f"{r.path}: PLS {r.summary.pls:.5f} > {pls:g} ({lost})")


def assert_recovered(run, failures: int | None = None, strategy: str | None = None, within_s: float | None = None):
    """Every injected failure fired and was recovered: ``failures`` records (if given), each under
    ``strategy`` (if given) and back within ``within_s`` seconds (if given). -> the failures."""
    r = _run(run)
    s = r.summary
    missed = s.raw.get("injections_not_fired", [])
    if missed:
        raise AssertionError(f"{r.path}: injections that never fired: {missed}")
    if failures is not None and len(s.failures) != failures:
        raise AssertionError(f"{r.path}: {len(s.failures)} failures recorded, expected {failures}: {s.failures}")
    for f in s.failures:
        if strategy is not None and f.strategy != strategy and f.kind in ("shard", "stall"):
            raise AssertionError(f"{r.path}: failure of shard {f.target} at step {f.step} recovered by {f.strategy}")
        if within_s is not None and f.recovery_s > within_s:
            raise AssertionError(
                f"{r.path}: shard {f.target} at step {f.step} took {f.recovery_s:.3f}s to recover (> {within_s}s)"
            )
    return s.failures
