"""Start, fail and stop local ``redis-server`` shards.

Each shard is a real ``redis-server`` on a free loopback port, with Redis's own persistence off
(the recovery layer owns durability). Cleanup is layered so that no server outlives its owner:
the context manager stops every shard (SIGCONT, SIGTERM, then SIGKILL after a grace period),
an ``atexit`` hook does the same on interpreter exit, and each server is started with
``PR_SET_PDEATHSIG=SIGKILL`` so the kernel kills it if this process dies without cleaning up.

A replacement server that a trainer starts during a recovery (``spawn_shard(die_with_parent=False)``)
must outlive that trainer but not the run: it is started by the shard supervisor of the
``LocalShards`` (``embeddings.servers.supervisor``), a child of the owner that dies with it (PDEATHSIG) and
whose servers die with it (PDEATHSIG again), so a SIGKILL of the owner leaves no server behind.

Each run's folder (``recsys-shards-*`` in the temp dir) records its owner (``owner``: pid, start
time, pid namespace); ``LocalShards.start`` removes the folders whose owner is gone, stopping any
server left there.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from embeddings.net.endpoints import one_try
from embeddings.store.buckets import LISTPACK_ENTRIES, LISTPACK_VALUE

_PR_SET_PDEATHSIG = 1
# ``--server-nice N``: a local server (its main thread, which serves every command; what it forks
# after, a checkpoint's save, inherits it) runs N nicer than the trainers that start it. Off by
# default. On a host that runs nothing else the training thread goes first on a shared core and the
# server takes the core when that thread waits: one trainer on 2 cores with 2 servers at N = 10,
# 64,370 -> 70,386 samples/s (medians of 4 alternating rounds; docs/benchmarks.md). On a busy host the
# server gets a tenth of a core against each busy process at 0, so the work behind the steps (a
# window's write, a checkpoint's save) lags by as much: a failure then finds more of it unwritten
# (redone, or lost to the older checkpoint). A user's servers (by URL) are never touched.
SERVER_NICE = 0
_LIVE: weakref.WeakSet[LocalShards] = weakref.WeakSet()


class LauncherError(RuntimeError):
    pass


def find_redis_server(explicit: str | None = None) -> str:
    path = explicit or shutil.which("redis-server")
    if not path or not os.access(path, os.X_OK):
        raise LauncherError(
            f"redis-server not found ({'--redis-server ' + explicit if explicit else 'PATH'}); "
            "install Redis 7 (Debian/Ubuntu: apt-get install -y redis-server) or run `make setup`"
        )
    return path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass
class _Shard:
    index: int
    port: int
    workdir: Path
    proc: subprocess.Popen | None = None
    stalled: bool = False


@dataclass(frozen=True)
class ShardSpec:
    """What it takes to (re)start one local shard on its port, from any process."""

    index: int
    port: int
    workdir: str
    binary: str
    host: str = "127.0.0.1"
    password: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    maxmemory: str | None = None
    replicaof: int | None = None
    """A replica's primary (its port on ``host``)."""
    huge_pages: bool = False
    """The server's memory in 2 MB pages (jemalloc ``thp:always``, ``disable-thp no``): fewer TLB
    misses in a big key space, where a write costs the server cache and TLB misses, not bytes."""
    nice: int = SERVER_NICE
    """How much nicer than its trainers the server runs (0: as they do; ``--server-nice``, ``SERVER_NICE``)."""

    @property
    def rdb_path(self) -> Path:
        """Where the shard writes BGSAVE snapshots and what it loads at start."""
        return Path(self.workdir) / "dump.rdb"

    @property
    def pidfile(self) -> Path:
        return Path(self.workdir) / "redis.pid"


def server_pids(specs: list[ShardSpec]) -> list[int]:
    """The pids of the local shards' servers now (their pidfiles); a shard being restarted has none."""
    pids = []
    for spec in specs:
        try:
            pids.append(int(spec.pidfile.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def write_shard_config(spec: ShardSpec) -> Path:
    if spec.tls_cert_file:  # TLS only: the plain port is closed
        ports = ["port 0", f"tls-port {spec.port}", f"tls-cert-file {spec.tls_cert_file}"]
        ports += [f"tls-key-file {spec.tls_key_file}", f"tls-ca-cert-file {spec.tls_cert_file}", "tls-auth-clients no"]
    else:
        ports = [f"port {spec.port}"]
    lines = ports + [
        f"bind {spec.host}",
        "protected-mode yes",
        'save ""',
        "appendonly no",
        f"dir {spec.workdir}",
        "dbfilename dump.rdb",
        "daemonize no",
        f"logfile {Path(spec.workdir) / 'redis.log'}",
        "lua-time-limit 60000",
        "stop-writes-on-bgsave-error no",
        "repl-diskless-sync-delay 0",  # a replica starts its first sync at once
        # row buckets (embeddings.store.buckets) stay listpacks, also as loaded from a snapshot
        f"hash-max-listpack-entries {LISTPACK_ENTRIES}",
        f"hash-max-listpack-value {LISTPACK_VALUE}",
    ]
    if spec.password:
        lines.append(f"requirepass {spec.password}")
        lines.append(f"masterauth {spec.password}")
    if spec.replicaof is not None:
        lines.append(f"replicaof {spec.host} {spec.replicaof}")
        if spec.tls_cert_file:
            lines.append("tls-replication yes")
    if spec.maxmemory:
        lines.append(f"maxmemory {spec.maxmemory}")
    if spec.huge_pages:
        lines.append("disable-thp no")  # else the server turns THP off for itself at start
    path = Path(spec.workdir) / "redis.conf"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the password
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def log_tail(spec: ShardSpec) -> str:
    try:
        return (Path(spec.workdir) / "redis.log").read_text().strip().splitlines()[-1]
    except (OSError, IndexError):
        return "(no log)"


def wait_ready(spec: ShardSpec, proc: subprocess.Popen, timeout_s: float) -> tuple[bool, str]:
    """Until the server answers PING (after loading any RDB), it exits, or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    tls = dict(ssl=True, ssl_ca_certs=spec.tls_cert_file) if spec.tls_cert_file else {}
    client = redis.Redis(
        host=spec.host,
        port=spec.port,
        password=spec.password,
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        retry=one_try(),  # this loop polls
        **tls,
    )
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return False, f"exited with {proc.returncode}: {log_tail(spec)}"
            try:
                if client.ping():
                    return True, ""
            except redis.RedisError:  # connection refused, or LOADING while the RDB loads
                time.sleep(0.001)  # a restore waits on this: look again soon (a PING costs ~0.1 ms)
        return False, f"no PING answer within {timeout_s}s"
    finally:
        client.close()


def spawn_shard(spec: ShardSpec, *, die_with_parent: bool, timeout_s: float = 30.0) -> subprocess.Popen:
    """Start ``redis-server`` for ``spec`` and wait until it serves; it loads ``spec.rdb_path`` if present.

    ``die_with_parent=False`` makes it outlive the calling process (a replacement started by a
    trainer) but not the run: the shard supervisor of the ``LocalShards`` that owns the folder
    starts it (it dies with that owner); a folder without one (shards started by hand) gets a
    server in its own session. Its pid goes to ``spec.pidfile`` so the owner stops it at the end.
    """
    conf = write_shard_config(spec)
    _wait_port_free(spec.host, spec.port, timeout_s)
    extra = {"MALLOC_CONF": "thp:always"} if spec.huge_pages else {}  # jemalloc asks for 2 MB pages
    address = None if die_with_parent else supervisor_address(Path(spec.workdir).parent)
    if address is not None:
        proc = _supervised_spawn(spec, address, [spec.binary, str(conf)], extra, timeout_s)
    else:
        proc = subprocess.Popen(
            [spec.binary, str(conf)],
            env={**os.environ, **extra} if extra else None,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent if die_with_parent else None,
            start_new_session=not die_with_parent,
        )
        spec.pidfile.write_text(str(proc.pid))
    ok, why = wait_ready(spec, proc, timeout_s)
    if not ok:
        _stop_process(proc)
        raise LauncherError(f"shard {spec.index} on {spec.host}:{spec.port} did not start: {why}")
    if spec.nice:
        try:  # only ever lowered: no privilege needed, and a server that is gone already is let be
            os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + spec.nice)
        except OSError:
            pass
    return proc


def _wait_port_free(host: str, port: int, timeout_s: float) -> None:
    """A replacement takes over its shard's port: wait (bounded) until nothing listens there."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
                return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise LauncherError(
                        f"port {host}:{port} is still in use ({e}); cannot start the shard there"
                    ) from None
        time.sleep(0.02)


class _Child:
    """A server the shard supervisor started: not our child, known by its pid (``poll`` as Popen's)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: str | None = None

    def poll(self) -> str | None:
        if self.returncode is None and process_state(self.pid) in (None, "Z"):
            self.returncode = "a status its supervisor saw"
        return self.returncode


SUPERVISOR_FILE = "supervisor.addr"  # in a LocalShards folder: its supervisor's socket name


def supervisor_address(root: Path) -> str | None:
    """The socket name of the shard supervisor of the ``LocalShards`` folder ``root``, or None."""
    try:
        return (root / SUPERVISOR_FILE).read_text().strip() or None
    except OSError:
        return None


def _supervised_spawn(spec: ShardSpec, address: str, argv: list[str], env: dict, timeout_s: float) -> _Child:
    req = {"argv": argv, "env": env, "pidfile": str(spec.pidfile)}
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect("\0" + address)
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(4096)
                if not chunk:
                    raise ConnectionError("it closed the connection without an answer")
                buf += chunk
        reply = json.loads(buf)
    except (OSError, ValueError) as e:
        owner = read_owner(Path(spec.workdir).parent)
        who = f" (pid {owner[0]})" if owner else ""
        raise LauncherError(
            f"shard {spec.index}: the shard supervisor of {Path(spec.workdir).parent} does not answer "
            f"({e}): the process that started the shards{who} is gone, so no replacement is started"
        ) from None
    if "pid" not in reply:
        raise LauncherError(f"shard {spec.index}: the shard supervisor could not start {argv[0]}: {reply.get('error')}")
    return _Child(int(reply["pid"]))


def _signal_stop(proc: subprocess.Popen | _Child | None) -> None:
    """SIGCONT (a stopped process would not act on TERM), then SIGTERM, to a child still running."""
    if isinstance(proc, subprocess.Popen) and proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.terminate()


def _stop_process(proc: subprocess.Popen | _Child) -> None:
    if isinstance(proc, _Child):
        kill_and_wait(proc.pid)
        return
    if proc.poll() is None:
        _signal_stop(proc)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _kill_pidfile(spec: ShardSpec, known_pid: int | None) -> None:
    """Stop a replacement that another process started for this shard (it is not our child)."""
    for pid in shard_servers(spec):
        if pid != known_pid:
            kill_and_wait(pid)


def shard_servers(spec: ShardSpec) -> list[int]:
    """Pids of the ``redis-server`` processes serving ``spec``'s address: the one in its pidfile, and
    any other (a trainer killed between starting a replacement and writing its pidfile leaves one
    nobody knows of). redis-server titles itself ``redis-server HOST:PORT``."""
    pids, recorded = set(), None
    try:
        recorded = int(spec.pidfile.read_text().strip())
        pids.add(recorded)
    except (OSError, ValueError):
        pass
    title = f"redis-server {spec.host}:{spec.port}".encode()  # argv[0] may carry a path
    pids.update(int(e.name) for e in os.scandir("/proc") if e.name.isdigit())
    # the recorded pid counts only while it is still a redis-server (not reused)
    return _live(pids, lambda pid, cmd: cmd.rstrip(b"\0").endswith(title) or (pid == recorded and b"redis" in cmd))


def _live(pids, ours: Callable[[int, bytes], bool]) -> list[int]:
    """Of ``pids``, the live (not zombie) processes whose command line ``ours(pid, cmdline)`` accepts."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ours(pid, cmd) and process_state(pid) not in (None, "Z"):
            out.append(pid)
    return sorted(out)


def kill_and_wait(pid: int, timeout_s: float = 10.0) -> None:
    """SIGKILL ``pid`` (continuing it first if stopped) and wait until it is gone or a zombie: its
    port is free once this returns."""
    try:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state = process_state(pid)
        if state is None or state == "Z":
            return
        time.sleep(0.002)


def process_state(pid: int) -> str | None:
    """The state letter of ``/proc/PID/stat`` (R, S, T, Z, ...), or None when there is no such process.

    The command name comes in parentheses and may hold spaces (redis-server renames itself
    ``redis-server 127.0.0.1:PORT``), so the state is read after the last ')'.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# -- run folders and their owners -------------------------------------------------------------
FOLDER_PREFIX = "recsys-shards-"
OWNER_FILE = "owner"  # "PID STARTTIME PIDNS" of the process that owns the folder (its LocalShards)
UNOWNED_GRACE_S = 600.0  # a folder without an owner (older code, or one being created) is left this long


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22): with the pid,
    it names one process, not whichever reuses its pid later."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return "?"


def record_owner(root: Path, pid: int | None = None) -> None:
    """Write ``root/owner``: this process (or ``pid``) owns the folder while it lives."""
    pid = os.getpid() if pid is None else pid
    (Path(root) / OWNER_FILE).write_text(f"{pid} {process_start_time(pid)} {_pid_namespace()}\n")


def read_owner(root: Path) -> tuple[int, int | None] | None:
    """(pid, start time or None) of the folder's owner; None without an owner file."""
    try:
        fields = (Path(root) / OWNER_FILE).read_text().split()
        return int(fields[0]), (int(fields[1]) if fields[1:] and fields[1] != "None" else None)
    except (OSError, ValueError, IndexError):
        return None


def owner_alive(root: Path) -> bool:
    """The folder's owner lives, or may (it is in another pid namespace: a container sharing the
    temp dir, whose processes cannot be seen from here)."""
    try:
        fields = (Path(root) / OWNER_FILE).read_text().split()
    except OSError:
        return False
    if fields[2:] and fields[2] != _pid_namespace():
        return True
    owner = read_owner(root)
    if owner is None or process_state(owner[0]) in (None, "Z"):
        return False
    return owner[1] is None or process_start_time(owner[0]) == owner[1]


def folder_servers(root: Path) -> list[int]:
    """Live ``redis-server`` processes of the shard folder ``root``: those whose working directory
    lies in it (a server chdirs to its shard's folder as it reads its config; a pidfile's pid may
    since name another process)."""
    root = Path(root).resolve()
    pids: set[int] = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry.name}/cwd")
            except OSError:  # gone, or not ours to look at
                continue
            if cwd == str(root) or cwd.startswith(str(root) + os.sep):
                pids.add(int(entry.name))
    return _live(pids, lambda pid, cmd: b"redis-server" in cmd)


def remove_stale_folders(parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the ``recsys-shards-*`` folders in ``parent`` (default: the temp dir) whose owner is
    gone, after stopping any server still running there; never one of a live owner. A folder with
    no owner file is removed only when it is older than ``UNOWNED_GRACE_S`` and no server runs in
    it. Returns the folders removed."""
    parent = Path(parent or tempfile.gettempdir())
    removed = []
    try:
        candidates = [p for p in parent.glob(FOLDER_PREFIX + "*") if p.is_dir() and not p.is_symlink()]
    except OSError:
        return removed
    for root in candidates:
        owner = read_owner(root)
        try:
            if owner is None and time.time() - root.stat().st_mtime < UNOWNED_GRACE_S:
                continue
        except OSError:
            continue
        if owner is not None and owner_alive(root):
            continue
        servers = folder_servers(root)
        if owner is None and servers:
            continue  # a live run of code that wrote no owner
        for pid in servers:
            kill_and_wait(pid)
        shutil.rmtree(root, ignore_errors=True)
        if not root.exists():
            removed.append(root)
    return removed


@dataclass(frozen=True)
class ServerOptions:
    """How each local ``redis-server`` is started: its binary (None: found on the PATH or beside
    the package, ``find_redis_server``), how long it may take to answer, its ``maxmemory``."""

    redis_server: str | None = None
    startup_timeout_s: float = 10.0
    maxmemory: str | None = None


@dataclass(frozen=True)
class TlsFiles:
    """A local server's TLS certificate and key (PEM files): it then serves ``rediss://`` only."""

    cert_file: str
    key_file: str


class LocalShards:
    """``num_shards`` local Redis servers. Use as a context manager.

    >>> with LocalShards(3) as shards:
    ...     store = RedisStore(shards.urls, ...)
    ...     shards.kill(1)        # SIGKILL shard 1
    ...     shards.restart(1)     # a fresh, empty server on the same port

    ``server``: how each server is started (``ServerOptions``); ``tls``: serve TLS (``TlsFiles``).
    """

    def __init__(
        self,
        num_shards: int,
        *,
        host: str = "127.0.0.1",
        password: str | None = None,
        server: ServerOptions | None = None,
        tls: TlsFiles | None = None,
        replicas: bool = False,
        huge_pages: bool = False,
        nice: int = SERVER_NICE,
    ) -> None:
        if num_shards <= 0:
            raise ValueError(f"num_shards={num_shards} must be > 0")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice} must be in 0..19")
        server = server or ServerOptions()
        self.num_shards = num_shards
        self.host = host
        self.password = password
        self.binary = find_redis_server(server.redis_server)
        self.startup_timeout_s = server.startup_timeout_s
        self.maxmemory = server.maxmemory
        self.tls = (tls.cert_file, tls.key_file) if tls is not None else None
        self.tls_files = self.tls or (None, None)
        self._root: Path | None = None
        self._shards: list[_Shard] = []
        self.with_replicas = replicas
        self.huge_pages = huge_pages
        self.nice = nice
        self._replicas: list[_Shard] = []  # one per shard with replicas=True: replicaof the shard
        self._supervisor: subprocess.Popen | None = None
        self._supervisor_address = ""

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> LocalShards:
        if self._shards:
            return self
        remove_stale_folders()
        self._root = Path(tempfile.mkdtemp(prefix=FOLDER_PREFIX))
        _LIVE.add(self)
        try:
            record_owner(self._root)
            self._start_supervisor()
            for i in range(self.num_shards):
                workdir = self._root / f"shard{i}"
                workdir.mkdir()
                shard = _Shard(index=i, port=0, workdir=workdir)
                self._shards.append(shard)
                self._spawn(shard, new_port=True)
            for i in range(self.num_shards if self.with_replicas else 0):
                workdir = self._root / f"replica{i}"
                workdir.mkdir()
                rep = _Shard(index=i, port=0, workdir=workdir)
                self._replicas.append(rep)
                self._spawn(rep, new_port=True)
            for i in range(len(self._replicas)):
                self.await_replica(i)
            self._await_supervisor()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_supervisor(self) -> None:
        """The parent of the replacement servers trainers start (``embeddings.servers.supervisor``): it dies
        with this process, and they with it. Started here, awaited once the shards run."""
        address = f"recsys-shard-supervisor-{os.getpid()}-{self._root.name}"
        self._supervisor = subprocess.Popen(
            [sys.executable, "-I", "-S", str(Path(__file__).with_name("supervisor.py")), address, str(os.getpid())],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            preexec_fn=_die_with_parent,
            start_new_session=True,  # Ctrl-C reaches the run, not the servers it must stop itself
        )
        self._supervisor_address = address

    def _await_supervisor(self) -> None:
        proc = self._supervisor
        line = proc.stdout.readline() if proc is not None else b""
        if proc is not None:
            proc.stdout.close()
        if line.strip() != b"ready":
            raise LauncherError(f"the shard supervisor did not start (exit status {proc and proc.poll()})")
        (self._root / SUPERVISOR_FILE).write_text(self._supervisor_address)

    def stop(self) -> None:
        shards = self._shards + self._replicas
        for shard in shards:  # every server told first, then each awaited: they shut down side by side
            _signal_stop(shard.proc)
        for shard in shards:
            self._terminate(shard)
        self._shards, self._replicas = [], []
        if self._supervisor is not None:  # its servers die with it (none is left after the above)
            _stop_process(self._supervisor)
            self._supervisor = None
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)
            self._root = None
        _LIVE.discard(self)

    def __enter__(self) -> LocalShards:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- addresses ----------------------------------------------------------------------
    def url(self, i: int, replica: bool = False) -> str:
        auth = f":{self.password}@" if self.password else ""
        scheme = "rediss" if self.tls else "redis"
        port = (self._replicas if replica else self._shards)[i].port
        return f"{scheme}://{auth}{self.host}:{port}/0"

    @property
    def urls(self) -> list[str]:
        return [self.url(i) for i in range(len(self._shards))]

    @property
    def replica_urls(self) -> list[str]:
        """One replica per shard (``replicas=True``), in shard order."""
        return [self.url(i, replica=True) for i in range(len(self._replicas))]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self._shards]

    def pid(self, i: int) -> int | None:
        proc = self._shards[i].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def pids(self) -> list[int]:
        """Every server's pid, replicas included."""
        procs = [s.proc for s in self._shards + self._replicas]
        return [p.pid for p in procs if p is not None and p.poll() is None]

    def is_alive(self, i: int) -> bool:
        return self.pid(i) is not None

    # -- failures -----------------------------------------------------------------------
    def kill(self, i: int) -> None:
        """SIGKILL shard ``i`` (whichever process serves it now, a replacement included): its rows are gone."""
        shard = self._shards[i]
        _kill_pidfile(self.spec(i), shard.proc.pid if shard.proc is not None else None)
        if shard.proc is not None and shard.proc.poll() is None:
            shard.proc.kill()
            shard.proc.wait(timeout=10)
        shard.stalled = False

    def stall(self, i: int) -> None:
        """SIGSTOP shard ``i``: it keeps its connections but answers nothing. Returns once the kernel
        shows it stopped (a signal to a process running on another core takes effect a moment later)."""
        shard = self._shards[i]
        if shard.proc is None or shard.proc.poll() is not None:
            raise LauncherError(f"shard {i} (port {shard.port}) is not running; cannot stall it")
        shard.proc.send_signal(signal.SIGSTOP)
        shard.stalled = True
        deadline = time.monotonic() + 5.0
        while process_state(shard.proc.pid) not in ("T", "t", None) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self, i: int) -> None:
        """SIGCONT a stalled shard."""
        shard = self._shards[i]
        if shard.proc is not None and shard.proc.poll() is None:
            shard.proc.send_signal(signal.SIGCONT)
        shard.stalled = False

    def restart(self, i: int) -> None:
        """Replace shard ``i`` with a fresh, empty server on the same port."""
        shard = self._shards[i]
        self._terminate(shard)
        self._spawn(shard, new_port=False)

    def spec(self, i: int, replica: bool = False) -> ShardSpec:
        shard = (self._replicas if replica else self._shards)[i]
        return ShardSpec(
            index=i,
            port=shard.port,
            replicaof=self._shards[i].port if replica else None,
            workdir=str(shard.workdir),
            binary=self.binary,
            host=self.host,
            password=self.password,
            tls_cert_file=self.tls_files[0],
            tls_key_file=self.tls_files[1],
            maxmemory=self.maxmemory,
            huge_pages=self.huge_pages,
            nice=self.nice,
        )

    @property
    def specs(self) -> list[ShardSpec]:
        return [self.spec(i) for i in range(len(self._shards))]

    # -- internals ----------------------------------------------------------------------
    def _spawn(self, shard: _Shard, new_port: bool) -> None:
        replica = shard in self._replicas
        attempts = 5 if new_port else 1
        last: Exception | None = None
        for _ in range(attempts):
            if new_port:
                shard.port = free_port(self.host)
            try:
                spec = self.spec(shard.index, replica=replica)
                shard.proc = spawn_shard(spec, die_with_parent=True, timeout_s=self.startup_timeout_s)
                shard.stalled = False
                return
            except LauncherError as e:  # e.g. the port was taken meanwhile
                last = e
        raise last  # type: ignore[misc]

    def await_replica(self, i: int, timeout_s: float | None = None) -> None:
        """Until replica ``i`` has its primary's data and follows it (link up, no sync in progress)."""
        client = redis.Redis.from_url(self.url(i, replica=True), socket_timeout=30.0, **self._tls_kwargs())
        timeout_s = timeout_s or self.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                info = client.info("replication")
                if info.get("master_link_status") == "up" and not int(info.get("master_sync_in_progress", 0)):
                    return
                if time.monotonic() > deadline:
                    raise LauncherError(f"replica of shard {i} did not sync within {timeout_s}s")
                time.sleep(0.02)
        finally:
            client.close()

    def _tls_kwargs(self) -> dict:
        return dict(ssl_ca_certs=self.tls_files[0]) if self.tls else {}

    def _terminate(self, shard: _Shard) -> None:
        spec = self.spec(shard.index, replica=shard in self._replicas)
        _kill_pidfile(spec, shard.proc.pid if shard.proc is not None else None)
        if shard.proc is not None:
            _stop_process(shard.proc)
        shard.proc = None
        shard.stalled = False


@atexit.register
def _stop_all() -> None:
    for shards in list(_LIVE):
        shards.stop()
