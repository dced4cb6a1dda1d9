"""The shard supervisor of one ``LocalShards``: the parent of every replacement ``redis-server``.

A shard that fails during a run is replaced by a trainer (``recovery.manager``), a process that may
itself die and be restarted while the shard must live on, so the replacement cannot be the
trainer's child. It is this supervisor's instead: ``LocalShards.start`` starts it with
``PR_SET_PDEATHSIG=SIGKILL`` tied to the process that owns the shards, and it starts each
replacement with ``PR_SET_PDEATHSIG=SIGKILL`` tied to itself. Both links are kept by the kernel:
when the owner dies, however it dies (SIGKILL, the OOM killer), the supervisor gets SIGKILL, and
with it every server it started. A trainer's death touches neither.

Protocol (a Unix socket in the abstract namespace, its name in ``{shard folder}/supervisor.addr``):
one JSON line ``{"argv": [...], "env": {...}, "pidfile": PATH}`` in, one line ``{"pid": N}`` or
``{"error": "..."}`` back. The pidfile is written here, before the answer: a trainer killed
meanwhile leaves no server nobody knows of. Only the standard library is imported (the run's
start waits for this process to listen, ~20 ms).

Run as a script: ``python -I -S supervisor.py ADDRESS OWNER_PID`` (prints ``ready`` once it listens).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int):
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def preexec() -> None:  # in the child between fork and exec
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl: nobody would kill us
            os._exit(1)

    return preexec


def _read_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


def serve(address: str, owner: int) -> int:
    if os.getppid() != owner:  # the owner died before our PDEATHSIG was set
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the owner stops us (or its death does)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0" + address)
    srv.listen(64)
    srv.settimeout(0.5)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the owner reads no more; a closed pipe must not end us
    children: dict[int, subprocess.Popen] = {}
    preexec = _die_with(os.getpid())
    while os.getppid() == owner:  # belt and braces: PDEATHSIG already ends us with the owner
        for pid, proc in list(children.items()):  # reap the servers that ended (killed by a trainer)
            if proc.poll() is not None:
                del children[pid]
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        with conn:
            conn.settimeout(10.0)
            try:
                req = json.loads(_read_line(conn))
                proc = subprocess.Popen(
                    req["argv"],
                    env={**os.environ, **req.get("env", {})},
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    preexec_fn=preexec,
                )
                children[proc.pid] = proc
                if req.get("pidfile"):
                    with open(req["pidfile"], "w") as f:
                        f.write(str(proc.pid))
                reply = {"pid": proc.pid}
            except Exception as e:  # noqa: BLE001 - the asking trainer reports it
                reply = {"error": f"{type(e).__name__}: {e}"}
            try:
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except OSError:
                pass  # the trainer died meanwhile: its server is in the pidfile
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1], int(sys.argv[2])))
