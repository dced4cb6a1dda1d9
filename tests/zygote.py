"""Run ``python -m recsys ...`` (or a script) as a real process that skips the interpreter's start.

Most of a small CLI run's time is the import of torch and torchrec (about 6 of a 40-step run's 8
seconds here). Each pytest worker starts one server, ``python -m tests.zygote SOCKET PARENT_PID``,
that imports them once, as the command line does (torch first through ``recsys.launch``, no tensor
op run) and then forks a child per request. The child takes the request's stdin, stdout, stderr
(sent as file descriptors), working folder, environment and arguments, and becomes the program: the
interpreter's top level runs it (``runpy``) and exits with its status, as ``python -m recsys`` does.
The server reports the child's pid, then its exit status, on the request's connection.

The child is a real process, the command line's real code in it; what differs from a fresh
interpreter is what was decided before the fork: the string-hash seed (every child shares the
server's), the modules already imported (a test that a path avoids importing torch needs a fresh
interpreter), and what the environment set at start (requests that set their own ``env``, or whose
``IMPORT_TIME_ENV`` variables differ from the server's, run in a fresh interpreter: ``tests/procs.py``).
``RECSYS_TEST_EXEC=1`` runs every request in a fresh interpreter.
"""

from __future__ import annotations

import gc
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("!I")
_SERVER_PID = os.getpid()
# what the interpreter read as it started (hashing, warnings, paths) or a native library reads as it
# loads (OpenMP): a request that sets these otherwise runs in a fresh interpreter (``tests/procs.py``)
IMPORT_TIME_ENV = ("PYTHON", "OMP_", "KMP_", "GOMP_", "MKL_", "TORCH_", "LD_")


def _warm() -> None:
    """What a run imports, imported before any fork (torch first, through ``recsys.launch``)."""
    import matplotlib

    import recsys.launch  # noqa: F401  (first: recsys/launch.py counts the threads torch started)

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401

    import recsys.api  # noqa: F401
    import recsys.bench.recovery  # noqa: F401
    import recsys.cli  # noqa: F401
    import recsys.results.outputs  # noqa: F401


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(conn, _HEADER.size, 3)
    (size,) = _HEADER.unpack(head)
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("request cut short")
        body += chunk
    return json.loads(body), list(fds)


def serve(path: str, parent: int) -> dict | None:
    """Serve requests until the parent goes; returns, in a forked child, the request it runs."""
    _warm()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # a child's pid -> the connection its status goes to
    while os.getppid() == parent:
        ready, _, _ = select.select([server], [], [], 0.05)
        if ready:
            conn, _ = server.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as e:  # a caller cut short (interrupted): the others go on
                print(f"fork server: a request cut short: {e}", file=sys.stderr)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                server.close()
                conn.close()
                for other in waiting.values():
                    other.close()
                _become(request, fds)
                return request
            for fd in fds:
                os.close(fd)
            conn.sendall(f"{pid}\n".encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                except OSError:  # the caller went away
                    pass
                conn.close()
    return None


def _become(request: dict, fds: list[int]) -> None:
    # Ctrl-C as a fresh interpreter started from a terminal has it, whatever the server inherited
    # (a server started while its parent ignored SIGINT would pass that on to every child)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


def main() -> None:
    try:
        request = serve(sys.argv[1], int(sys.argv[2]))
    finally:
        if os.getpid() == _SERVER_PID:  # the server's end (its parent went): its socket's folder too
            shutil.rmtree(os.path.dirname(sys.argv[1]), ignore_errors=True)
    if request is None:
        return
    args = request["args"]
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    gc.freeze()  # as recsys/__main__.py: the exit need not walk torch's heap


if __name__ == "__main__":
    main()
