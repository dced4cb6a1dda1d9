"""A shard's snapshot loaded the way Redis loads its own file: one full synchronization.

An empty server is made a replica of this process for as long as one ``PSYNC`` takes. This
process answers the replica's handshake as a primary would (``+PONG``, ``+OK``,
``+FULLRESYNC <id> 0``) and sends the checkpoint's ``shard{S}.rdb`` as the synchronization's
payload, from the file's mapped bytes; the server loads it from the socket
(``repl-diskless-load on-empty-db`` for the load, its own setting put back after) with the same
code that loads its own file at start, then is told ``REPLICAOF NO ONE``. A shard loads this way
in 1.31-1.36x the time Redis takes to load the file from its own disk (263 MB to 4 GB files).

Before anything is sent, the whole file is checked as the ``RESTORE`` path checks it (its CRC-64,
each row bucket's framing, the first bucket of each table against the run's layout, every key's
table one of the run's): a damaged file never reaches the server. After the load the server must
hold exactly the file's keys.

Every shard goes this way first where it can (``snapshot_load.load_snapshot``): this process does
little but check the file and copy it to the socket, so the shards of a node restored at once take
little longer than one. The sync is taken only where
it cannot touch anything but the shard: the server holds no key at all, has no replica of its own
and is not a cluster node; the file holds only this namespace's keys, in the connection's database,
and no function library; the connection is not TLS (the server would connect back in plain TCP).
A server that refuses the sync (an ACL without ``REPLICAOF`` or ``CONFIG``, a server that cannot
connect back, a load it gave up) is said in one line and the keys go the next way; the refusal is
remembered for the endpoint.

The listening socket is bound to the address this process reaches the server from (loopback for a
server on loopback) and hands the snapshot only to a connection from the server's own address.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from urllib.parse import urlsplit

import redis

from embeddings.errors import ShardDataError
from embeddings.snapshots.rdb import Contents, check_mapped, mapped, scan_mapped

ACCEPT_S = 10.0  # how long the server has to connect back after REPLICAOF
POLL_S = 0.005  # between the INFO calls that watch the load
SEND_CHUNK = 16 << 20  # the most one send copies


class SyncRefused(Exception):
    """The server did not take the snapshot as a synchronization (the reason)."""


def unsuitable(store, shard: int) -> str | None:
    """Why the sync cannot be used on this shard's server (None: it can), from its INFO."""
    url = store.urls[shard]
    if urlsplit(url).scheme != "redis" or store.cluster is not None:
        return "TLS or a cluster node"
    info = store.call(shard, lambda c: c.info())
    if info.get("cluster_enabled"):
        return "a cluster node"
    if info.get("role") != "master" or info.get("connected_slaves"):
        return "a replica, or a server with replicas"
    if any(k.startswith("db") for k in info):
        return "a server that holds keys"
    try:  # a full sync empties the server's function libraries too
        libraries = store.call(shard, lambda c: c.execute_command("FUNCTION", "LIST"))
    except redis.ResponseError as e:
        return f"FUNCTION LIST refused ({e})"
    if libraries:
        return "a server with function libraries"
    return None


def load_by_sync(store, links, shard: int, path, prefix: bytes, sample, then: str = "RESTORE") -> int | None:
    """The RDB file at ``path`` onto the shard's empty server by one full synchronization; ->
    the bytes of the values loaded, or None where the sync does not apply (the keys then go by
    ``then``, said in the line of a refusal). ``sample(key, type, payload)`` checks each key as the
    ``RESTORE`` path does.
    ``ShardDataError`` for a damaged file: the server never gets its damaged part, nor the file's
    end, so it loads nothing."""
    endpoint = store.endpoints[shard]
    if endpoint in store.sync_refused or unsuitable(store, shard):
        return None
    db = int(links.pools[shard].connection_kwargs.get("db", 0) or 0)
    try:
        with mapped(path) as r:  # one mapping for both checks
            check_mapped(r)  # the whole file against its CRC-64 first: a damaged one never starts a sync
            with links.locks[shard]:
                contents = _sync(store, links, shard, path, r.buf, lambda gate: _scan(r, prefix, sample, db, gate))
    except SyncRefused as e:
        store.sync_refused[endpoint] = str(e)
        store.warn(
            f"warning: shard {shard} at {endpoint} did not load its snapshot as a sync ({e}): its keys go by {then} instead"
        )
        return None
    if contents is None:
        return None  # other keys in the file: RESTORE and HSET take only the namespace's
    held = store.call(shard, lambda c: c.dbsize())
    if held != contents.keys:
        raise ShardDataError(
            f"shard {shard} at {endpoint}: {held} keys after the sync of {path}, which holds {contents.keys}"
        )
    return contents.value_bytes


def _scan(r, prefix: bytes, sample, db: int, gate: _Gate) -> Contents | None:
    """The file checked as it is sent: the gate opens up to each checked part while the file holds
    only the namespace's keys in ``db``; -> its contents, or None where it holds anything else."""

    def progress(end: int, found: Contents) -> None:
        if found.alone and found.dbs <= {db}:
            gate.open_to(end)

    contents = scan_mapped(r, prefix, sample, progress, checksum=False)
    return contents if contents.alone and contents.dbs <= {db} else None


class _Gate:
    """How far the sender may go in the file: opened up to each checked part by the scan, to the
    end once the whole file has passed, or shut (the sender stops where it is)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.limit, self.shut = 0, False

    def open_to(self, end: int) -> None:
        with self._cond:
            self.limit = max(self.limit, end)
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self.shut = True
            self._cond.notify()

    def wait_past(self, sent: int) -> int:
        """The limit once it is past ``sent`` (-1: shut)."""
        with self._cond:
            self._cond.wait_for(lambda: self.shut or self.limit > sent)
            return -1 if self.shut else self.limit


def _sync(store, links, shard: int, path, data, scan):
    client_kwargs = links.pools[shard].connection_kwargs
    host, port = client_kwargs.get("host", "localhost"), int(client_kwargs.get("port", 6379))
    server_ip = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    with socket.create_connection((server_ip, port), timeout=store.timeout_s) as probe:
        local_ip = probe.getsockname()[0]  # the address the server can reach this process at
    mode = _ask(store, shard, lambda c: c.config_get("repl-diskless-load").get("repl-diskless-load"), "CONFIG GET")
    listener = socket.create_server((local_ip, 0))
    following = False
    try:
        _ask(store, shard, lambda c: c.config_set("repl-diskless-load", "on-empty-db"), "CONFIG SET")
        _ask(store, shard, lambda c: c.replicaof(local_ip, listener.getsockname()[1]), "REPLICAOF")
        following = True
        conn = _accept(listener, server_ip)
        with conn:
            try:
                _handshake(conn, store.timeout_s)
                contents = _send(conn, data, scan, store.timeout_s)
                if contents is not None:
                    _await_load(store, shard, conn, path)
                return contents
            except TimeoutError as e:  # it stopped reading
                raise SyncRefused(f"it stalled loading {path}: {e}") from None
            except OSError as e:  # the server dropped the link: a load it gave up (its log says why)
                raise SyncRefused(f"it gave up loading {path}: {e}") from None
    finally:
        listener.close()
        if following:
            _after_load(store, shard, lambda c: c.replicaof("NO", "ONE"))
        if mode is not None:
            _after_load(store, shard, lambda c: c.config_set("repl-diskless-load", mode))


def _after_load(store, shard: int, fn) -> None:
    """A control command once the server is done with a load it may still be giving up."""
    deadline = time.monotonic() + store.timeout_s

    def run(client):
        while True:
            try:
                return fn(client)
            except redis.BusyLoadingError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(POLL_S)

    store.call(shard, run)


def _ask(store, shard: int, fn, what: str):
    """A control command; a refusal (ACL, renamed command) is a ``SyncRefused`` naming it."""

    def run(client):
        try:
            return fn(client)
        except redis.ResponseError as e:
            raise SyncRefused(f"{what}: {e}") from None

    return store.call(shard, run)


def _accept(listener: socket.socket, server_ip: str) -> socket.socket:
    """The server's connection back (others are closed unanswered)."""
    deadline = time.monotonic() + ACCEPT_S
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise SyncRefused(f"it did not connect back to {listener.getsockname()} within {ACCEPT_S:.0f}s")
        listener.settimeout(left)
        try:
            conn, (peer, _) = listener.accept()
        except TimeoutError:
            continue
        if peer == server_ip:
            return conn
        conn.close()


def _handshake(conn: socket.socket, timeout_s: float) -> None:
    """The primary's side of the replica's handshake, up to its ``PSYNC``."""
    conn.settimeout(timeout_s)
    reader = conn.makefile("rb")
    while True:
        cmd = _command(reader)
        name = cmd[0].upper() if cmd else b""
        if name == b"PSYNC":
            return
        conn.sendall(b"+PONG\r\n" if name == b"PING" else b"+OK\r\n")


def _send(conn: socket.socket, data, scan, timeout_s: float) -> Contents | None:
    """The file (``data``: its mapped bytes) as the full synchronization's payload, each part once
    the scan has checked it (on a thread while the scan goes on), its end only once the whole file
    has passed. A file that fails, or holds other keys: the link is dropped short of the end, so
    the server loads nothing. -> the scan's contents, or None.

    Copied with ``send``, not handed over with ``sendfile``: over loopback, a payload of the file's
    own pages cost the loading server about 0.3 s of CPU a GB more than one of copied bytes, which
    cost this process about 0.15 s a GB more (1 GB files, 4 rounds)."""
    size = len(data)
    conn.sendall(b"+FULLRESYNC %s 0\r\n$%d\r\n" % (os.urandom(20).hex().encode(), size))
    gate, failed = _Gate(), []
    # a blocking send with the store's timeout as the socket's (SO_SNDTIMEO): one call copies up
    # to SEND_CHUNK bytes and waits out a full buffer in the kernel, not in a poll per partial send
    conn.settimeout(None)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(timeout_s))

    def sender() -> None:
        sent = 0
        try:
            while sent < size:
                limit = gate.wait_past(sent)
                if limit < 0:
                    return
                while sent < limit:
                    sent += conn.send(data[sent : min(limit, sent + SEND_CHUNK)]) or _closed()
        except BlockingIOError:  # SO_SNDTIMEO ran out
            failed.append(TimeoutError(f"it took no bytes for {timeout_s:g}s"))
        except OSError as e:
            failed.append(e)

    thread = threading.Thread(target=sender, name="sync-send", daemon=True)
    thread.start()
    done = False
    try:
        contents = scan(gate)
        if contents is None:
            gate.close()
        else:
            gate.open_to(size)
        thread.join()
        done = True
    finally:
        if not done:  # the sender stops (its send cut short) before the file's mapping goes
            gate.close()
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            thread.join()
        conn.settimeout(timeout_s)
    if failed:
        raise failed[0]
    return contents


def _timeval(seconds: float) -> bytes:
    """``seconds`` as a socket option's ``struct timeval`` (at least 1 µs: zero would mean never)."""
    whole = int(seconds)
    return struct.pack("ll", whole, max(int((seconds - whole) * 1e6), 0 if whole else 1))


def _closed() -> int:
    raise ConnectionError("the connection closed while the snapshot was sent")


def _command(reader) -> list[bytes]:
    line = reader.readline(1 << 16)
    if not line.endswith(b"\r\n"):
        raise SyncRefused("the connection closed in the handshake")
    if not line.startswith(b"*"):
        return line.split()
    out = []
    for _ in range(int(line[1:])):
        n = int(reader.readline(64)[1:])
        out.append(reader.read(n + 2)[:-2])
    return out


def _await_load(store, shard: int, conn: socket.socket, path) -> None:
    """Until the server serves the loaded data as a replica; a load it gave up (it closes the
    link) is a ``SyncRefused``. No progress for the store's timeout is one too."""
    deadline, last = time.monotonic() + store.timeout_s, -1
    while True:
        info = store.call(shard, lambda c: c.execute_command("INFO", "replication", "persistence"))
        if info.get("master_link_status") == "up" and not info.get("master_sync_in_progress"):
            return
        done = int(info.get("loading_loaded_bytes", 0))
        if done != last:
            deadline, last = time.monotonic() + store.timeout_s, done
        if time.monotonic() > deadline:
            raise SyncRefused(f"no progress loading {path} for {store.timeout_s}s")
        readable, _, _ = select.select([conn], [], [], POLL_S)
        if readable and not conn.recv(1 << 16):  # else its REPLCONF ACKs, dropped
            raise SyncRefused(f"it gave up loading {path}: it closed the link (its log says why)")
