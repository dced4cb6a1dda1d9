"""``python -m recsys ...`` and the project's scripts as the tests run them: real processes, started
by this worker's fork server (``tests/zygote.py``) so that each skips the import of torch and
torchrec. ``run`` is ``subprocess.run(..., capture_output=True, text=True)``; ``start`` a
``subprocess.Popen`` with the few methods the tests use. A request with its own ``env``, or any
with ``RECSYS_TEST_EXEC=1`` set, runs in a fresh interpreter instead."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from tests.zygote import _HEADER, IMPORT_TIME_ENV

ROOT = Path(__file__).resolve().parents[1]
_server: subprocess.Popen | None = None
_socket_path: str | None = None
_server_env: dict[str, str] = {}


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV)}


def _fresh() -> bool:
    """A fresh interpreter for this request: asked for, or the environment the server started with
    differs where an interpreter or a native library reads it only as it starts."""
    if os.environ.get("RECSYS_TEST_EXEC") == "1":
        return True
    return _server is not None and _import_time_env(dict(os.environ)) != _server_env


def _server_path() -> str:
    global _server, _socket_path
    if _server is not None and _server.poll() is None:
        assert _socket_path is not None
        return _socket_path
    if _server is None:
        atexit.register(_stop_server)
    else:  # it died: a new one, in a new folder
        _stop_server()
    global _server_env
    _server_env = _import_time_env(dict(os.environ))
    folder = tempfile.mkdtemp(prefix="recsys-zygote-")
    _socket_path = os.path.join(folder, "s")
    _server = subprocess.Popen(
        [sys.executable, "-m", "tests.zygote", _socket_path, str(os.getpid())],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = _server.stdout.readline() if _server.stdout else ""
    assert line.strip() == "ready", f"the fork server did not start: {line!r}"
    return _socket_path


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        _server.kill()
        _server.wait()
    if _socket_path is not None:
        shutil.rmtree(os.path.dirname(_socket_path), ignore_errors=True)


class Proc:
    """A child of the fork server: its pid, and its exit status as the server reports it."""

    def __init__(self, args: list[str], cwd: Path, stdout: IO, stderr: IO) -> None:
        self.args = args
        self.stdout = stdout
        self.stderr = stderr
        self.returncode: int | None = None
        request = json.dumps({"args": args, "cwd": str(cwd), "env": dict(os.environ)}).encode()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_path())
        with open(os.devnull, "rb") as stdin:
            fds = [stdin.fileno(), stdout.fileno(), stderr.fileno()]
            socket.send_fds(self._conn, [_HEADER.pack(len(request))], fds)
        self._conn.sendall(request)
        self._buf = b""
        line = self._line(60)
        assert line is not None, f"the fork server did not start {args} within 60 s"
        self.pid = int(line)

    def _line(self, timeout: float | None) -> str | None:
        """The server's next line, None if none came within ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._conn], [], [], left)[0]:
                return None
            chunk = self._conn.recv(64)
            assert chunk, f"the fork server went away while running {self.args}"
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def poll(self) -> int | None:
        if self.returncode is None:
            line = self._line(0)
            if line is not None:
                self._finish(line)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._line(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._finish(line)
        assert self.returncode is not None
        return self.returncode

    def _finish(self, line: str) -> None:
        self.returncode = int(line)
        self._conn.close()
        for stream in (self.stdout, self.stderr):
            stream.seek(0)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet: the pid is still the child's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _stream(kind: Any) -> IO:
    if kind == subprocess.DEVNULL:
        return open(os.devnull, "w+")
    if kind != subprocess.PIPE:
        raise ValueError(f"procs.start: stdout/stderr {kind!r}: PIPE or DEVNULL (a file: use subprocess.Popen)")
    return tempfile.TemporaryFile("w+")


def start(args: list[str], cwd: Path = ROOT, stdout: Any = subprocess.PIPE, stderr: Any = subprocess.PIPE) -> Any:
    """``python ARGS`` started: a ``Proc`` (``subprocess.Popen`` with ``RECSYS_TEST_EXEC=1``) whose
    ``stdout`` and ``stderr`` read what it wrote once it ended."""
    if _fresh():
        return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=stdout, stderr=stderr, text=True)
    return Proc(args, cwd, _stream(stdout), _stream(stderr))


def _python_tree(pid: int) -> list[int]:
    """``pid`` and its descendants that run Python (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            if b"python" in Path(f"/proc/{p}/cmdline").read_bytes():
                out.append(p)
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return out


def _dump_stacks(pid: int) -> list[int]:
    """A run that outlived its test's timeout: each of its Python processes writes every thread's
    stack to its stderr (``kill -USR1``, which the CLI and the trainers answer), read below; -> those
    processes, for ``_kill_all``."""
    tree = _python_tree(pid)
    for p in tree:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGUSR1)
    time.sleep(2.0)
    return tree


def _kill_all(pids: list[int]) -> None:
    """The run's processes killed, its trainers too: killed alone, the CLI would leave them running."""
    for p in pids:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def _report(args: list[str], err: str) -> None:
    tail = "\n".join(err.splitlines()[-300:])
    print(f"{' '.join(args)} outlived its timeout; its stderr ends:\n{tail}", file=sys.stderr)


def run(
    args: list[str], cwd: Path = ROOT, timeout: float | None = None, env: dict | None = None
) -> subprocess.CompletedProcess:
    """``python ARGS`` run to its end, its output captured as text. One that outlives ``timeout``
    has every thread's stack of its Python processes printed (with its stderr) before it is killed."""
    if env is not None or _fresh():
        with subprocess.Popen(
            [sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        ) as p:
            try:
                out, err = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_all(_dump_stacks(p.pid))
                p.kill()
                out, err = p.communicate()
                _report(args, err)
                raise
            return subprocess.CompletedProcess(p.args, p.returncode, out, err)
    proc = start(args, cwd)
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        tree = _dump_stacks(proc.pid)
        proc.kill()
        _kill_all(tree)
        proc.wait()
        _report(args, proc.stderr.read())
        raise
    return subprocess.CompletedProcess([sys.executable, *args], proc.returncode, proc.stdout.read(), proc.stderr.read())
