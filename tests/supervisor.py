"""Redis servers that the project did not start, kept alive as ``Restart=always`` would.

``Supervised(n, folder)`` runs ``n`` plain ``redis-server`` processes on fixed loopback ports; a
watcher thread restarts any that exits, empty (its snapshot file removed), on the same port, after
``delay_s``. ``hold(i)`` stops restarting server ``i`` (a machine that does not come back) and
``release(i)`` lets it come back. ``kill(i)`` SIGKILLs it from outside, as an operator or the OOM
killer would. Every process is stopped on ``close()``.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import redis

from embeddings.launcher import free_port


def _cluster_safe_port() -> int:
    """A free port a cluster node can use (its bus port, +10000, must exist too)."""
    while (port := free_port()) > 55_000:
        pass
    return port


class Supervised:
    def __init__(self, n: int, folder: Path, delay_s: float = 0.3, extra: tuple[str, ...] = ()) -> None:
        self.folder = Path(folder)
        self.delay_s = delay_s
        self.extra = extra
        self.binary = shutil.which("redis-server")
        self.ports = [_cluster_safe_port() for _ in range(n)]
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.held: set[int] = set()
        self.restarts = [0] * n
        self._lock = threading.Lock()
        self._stop = threading.Event()
        for i in range(n):
            self._start(i)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    @property
    def urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{p}" for p in self.ports]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def _start(self, i: int) -> None:
        d = self.folder / f"server{i}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "dump.rdb").unlink(missing_ok=True)  # it comes back empty
        cmd = [self.binary, "--port", str(self.ports[i]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        cmd += ["--dir", str(d), "--logfile", str(d / "redis.log"), *self.extra]
        self.procs[i] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.ports[i], socket_timeout=1)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                client.ping()
                return
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.ports[i]} did not start")

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            for i, p in enumerate(self.procs):
                with self._lock:
                    if p is not None and p.poll() is not None and i not in self.held and not self._stop.is_set():
                        time.sleep(self.delay_s)
                        self.restarts[i] += 1
                        self._start(i)

    def kill(self, i: int) -> None:
        p = self.procs[i]
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def hold(self, i: int) -> None:
        with self._lock:
            self.held.add(i)

    def release(self, i: int) -> None:
        with self._lock:
            self.held.discard(i)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for p in self.procs:
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()

    def __enter__(self) -> Supervised:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
