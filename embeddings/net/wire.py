"""Bulk row I/O on the Redis wire protocol, encoded and decoded with numpy.

Rows sit in hash buckets (``embeddings.store.buckets``): a row is the field ``row % span`` of the hash
``prefix + (row // span)``. Every argument of a row's command has a fixed length per table (key
``prefix`` + 8 bytes, field 1 or 2 bytes, value ``width`` bytes), so the commands for thousands of
rows are built as one ``[n, stride]`` uint8 array, and a reply whose rows are all present is cut
into rows with one reshape instead of one Python object per row.

- Reads: one ``HGET`` per row, pipelined in one send, each batch of equal-width rows followed by a
  ``PING <token>`` whose echo marks where its replies end. All present (the usual case): one
  reshape; some never written (``$-1``): located with numpy, a Python walk only if the bytes are
  ambiguous.
- Writes: one ``HSET key f1 r1 f2 r2 ...`` per bucket, the buckets of one row count encoded as one
  array, answered by the number of new fields (integers checked with numpy).

The connection itself (TCP or TLS, AUTH with password or ACL user, SELECT) is set up by
redis-py; this module then speaks on its socket directly, with a deadline on every call.
"""

from __future__ import annotations

import os
import queue
import socket
import threading
import time

import numpy as np
import redis

from embeddings.store.buckets import KEY_ID_BYTES, BucketLayout

_NIL = b"$-1\r\n"


class WireError(Exception):
    """The server answered something other than the expected reply (its text is the message)."""


def _items(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Columns ``lo:hi`` of a C-contiguous ``[n, stride]`` uint8 array as ``n`` items of ``hi - lo`` bytes."""
    return a[:, lo:hi].view(f"V{hi - lo}").reshape(-1)


def encode_command(args: list[bytes]) -> bytes:
    """A RESP command from a few byte-string arguments."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


def key_commands(verb: bytes, keys: list[bytes]) -> bytes:
    """``verb key`` for each of ``keys``, as RESP commands in one byte string."""
    if keys and all(len(k) == len(keys[0]) for k in keys):  # one header for all: one join
        head = b"*2\r\n$%d\r\n%s\r\n$%d\r\n" % (len(verb), verb, len(keys[0]))
        return head + (b"\r\n" + head).join(keys) + b"\r\n"
    return b"".join(encode_command([verb, k]) for k in keys)


def _records(n: int, parts: list) -> np.ndarray:
    """[n, stride] uint8, each row the concatenation of ``parts``: constant bytes, an [n, k] uint8
    array, or [n] void items; each part is moved as one item per row, not byte by byte."""
    widths = [
        len(p) if isinstance(p, bytes) else p.dtype.itemsize if p.dtype.kind == "V" else p.shape[1] for p in parts
    ]
    out = np.empty((n, sum(widths)), np.uint8)
    at = 0
    for p, w in zip(parts, widths):
        if w:
            if isinstance(p, bytes):
                _items(out, at, at + w)[:] = np.frombuffer(p, f"V{w}")[0]
            elif p.dtype.kind == "V":
                _items(out, at, at + w)[:] = p
            else:
                _items(out, at, at + w)[:] = np.ascontiguousarray(p).view(f"V{w}").reshape(-1)
        at += w
    return out


def _raw_rows(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype="<f4").view(np.uint8).reshape(len(rows), -1)


def _error(msg: str) -> Exception:
    if "NOAUTH" in msg or "WRONGPASS" in msg or "NOPERM" in msg:
        return redis.AuthenticationError(msg)
    return WireError(msg)


class _Sender:
    """A thread that writes batches to a connection's socket while the caller builds the next ones
    (``sendall`` lets go of the GIL). Its error is raised by ``put`` or ``close``."""

    def __init__(self, conn: RowConnection, depth: int = 3) -> None:
        self.conn, self.error, self.cancelled = conn, None, False
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._run, name="restore-send", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (batch := self.queue.get()) is not None:
            if self.error is not None or self.cancelled:
                continue  # drained: the caller learns of the error at its next put, or stopped
            try:
                self.conn._deadline = time.monotonic() + self.conn.timeout_s
                self.conn._send(batch)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self.error = e

    def put(self, batch: bytes) -> None:
        if self.error is not None:
            raise self.error
        self.queue.put(batch)

    def close(self, quiet: bool = False) -> None:
        """Once the queued batches are written; ``quiet`` (the caller's own error): none more is
        written, and the sender's error is not raised."""
        self.cancelled = self.cancelled or quiet
        self.queue.put(None)
        self.thread.join()
        if self.error is not None and not quiet:
            raise self.error


def _restore_command(key: bytes, payload: bytes | bytearray) -> tuple[bytes, bytes | bytearray, bytes]:
    """``RESTORE key 0 payload REPLACE`` in three pieces (the payload is not copied)."""
    head = b"*5\r\n$7\r\nRESTORE\r\n$%d\r\n%s\r\n$1\r\n0\r\n$%d\r\n" % (len(key), key, len(payload))
    return head, payload, b"\r\n$7\r\nREPLACE\r\n"


def _bulk_rows(block: np.ndarray, head: bytes) -> bool:
    """Is every row of ``block`` ([n, stride]) one bulk reply ``head + value + CRLF``?"""
    if not len(block):
        return True
    hl = len(head)
    return bool(
        (_items(block, 0, hl) == np.frombuffer(head, f"V{hl}")[0]).all()
        and (_items(block, block.shape[1] - 2, block.shape[1]) == np.frombuffer(b"\r\n", "V2")[0]).all()
    )


def split_nils(body: np.ndarray, n: int, stride: int) -> tuple[np.ndarray, np.ndarray] | None:
    """``n`` replies, each nil (``$-1\r\n``) or ``stride`` bytes, in ``body`` (uint8): -> (the
    positions of the nils, the other replies' bytes), or None where the bytes do not split that way
    unambiguously (a row holding ``$-1\r\n``, an error reply)."""
    dollars = np.flatnonzero(body[:-4] == 36)
    cand = dollars[
        (body[dollars + 1] == 45) & (body[dollars + 2] == 49) & (body[dollars + 3] == 13) & (body[dollars + 4] == 10)
    ]
    k = len(cand)
    if k > n or len(body) != (n - k) * stride + 5 * k:
        return None
    gaps = np.concatenate((cand, [len(body)])) - np.concatenate(([0], cand + 5))
    if (gaps < 0).any() or (gaps % stride).any():
        return None
    runs = gaps // stride  # replies before each nil (and after the last)
    nils = np.cumsum(runs[:-1]) + np.arange(k)
    keep = np.ones(len(body), bool)
    keep[(cand[:, None] + np.arange(5)).ravel()] = False
    return nils, body[keep]


# -- the row commands and replies, encoded and decoded (no socket) ------------------------------
def row_shapes(groups, width_of) -> dict[tuple[int, int], list[int]]:
    """Indices of the non-empty groups per (prefix length, row width): each shape is encoded as one array."""
    out: dict[tuple[int, int], list[int]] = {}
    for i, g in enumerate(groups):
        if len(g[1]):
            out.setdefault((len(g[0]), width_of(g)), []).append(i)
    return out


def keyed_records(layout: BucketLayout, verb: bytes, nargs: int, groups, idx: list[int], width: int) -> list:
    """The parts of ``verb key field ...`` records for the rows of groups ``idx`` (one prefix length)."""
    plen = len(groups[idx[0]][0])
    heads = np.stack(
        [
            np.frombuffer(
                b"*%d\r\n$%d\r\n%s\r\n$%d\r\n" % (nargs, len(verb), verb, plen + KEY_ID_BYTES) + groups[i][0],
                np.uint8,
            )
            for i in idx
        ]
    )
    head = heads.view(f"V{heads.shape[1]}").reshape(-1)
    if len(idx) > 1:
        head = head[np.repeat(np.arange(len(idx)), [len(groups[i][1]) for i in idx])]
    ids = np.concatenate([groups[i][1] for i in idx]) if len(idx) > 1 else np.asarray(groups[idx[0]][1])
    buckets = np.ascontiguousarray(layout.buckets(ids, width), dtype=">u8").view("V8").reshape(-1)
    return [head, buckets, b"\r\n$%d\r\n" % layout.field_bytes, layout.fields(ids, width), b"\r\n"]


def parse_rows(body: bytes, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` HGET replies: rows of ``width`` bytes or nil. -> (rows [n, width] uint8, missing [n])."""
    head = b"$%d\r\n" % width
    hl, stride = len(head), len(head) + width + 2
    arr = np.frombuffer(body, np.uint8)
    missing = np.zeros(n, bool)
    if len(body) == n * stride:  # every row present: one reshape
        block = arr.reshape(n, stride)
        if _bulk_rows(block, head):
            return block[:, hl : hl + width].copy(), missing
    elif len(body) == 5 * n and body == _NIL * n:  # none written
        return np.zeros((n, width), np.uint8), ~missing
    else:
        split = split_nils(arr, n, stride)
        if split is not None and _bulk_rows(block := split[1].reshape(-1, stride), head):
            rows = np.zeros((n, width), np.uint8)
            missing[split[0]] = True
            rows[~missing] = block[:, hl : hl + width]
            return rows, missing
    return walk_rows(body, n, width)


def walk_rows(body: bytes, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """The replies one by one: exact where numpy could not split them, and names what the server said."""
    head = b"$%d\r\n" % width
    hl, stride = len(head), len(head) + width + 2
    rows, missing = np.zeros((n, width), np.uint8), np.zeros(n, bool)
    at = 0
    for i in range(n):
        if body.startswith(_NIL, at):
            missing[i] = True
            at += 5
        elif body.startswith(head, at) and body[at + stride - 2 : at + stride] == b"\r\n":
            rows[i] = np.frombuffer(body, np.uint8, width, at + hl)
            at += stride
        else:
            line = body[at : body.find(b"\r\n", at)]
            if line.startswith(b"-"):
                raise _error(line[1:].decode(errors="replace"))
            if line.startswith(b"$") and line[1:].isdigit():
                raise WireError(f"a stored row holds {int(line[1:])} bytes, expected {width}")
            raise WireError(f"unexpected reply to a row read: {line[:80]!r}")
    if at != len(body):
        raise WireError(f"{len(body) - at} bytes past the replies of a row read")
    return rows, missing


def row_commands(layout: BucketLayout, groups) -> tuple[list[memoryview], list]:
    """The HSET commands of every group (key prefix, ids, rows) and the replies they get: one
    ``HSET key field row field row ...`` per bucket, answered with its number of new fields. The
    groups whose prefixes have one length and whose rows one width are encoded together, a few
    numpy calls per distinct count of rows in a bucket, so that a write of many tables costs a few
    numpy calls rather than a Python step per bucket or per table."""
    parts: list[memoryview] = []
    replies: list = []
    for (_, width), idx in row_shapes(groups, lambda g: 4 * g[2].shape[1]).items():
        # two groups with one prefix could name one row: each keeps its own commands, in order
        sets = [idx] if len({groups[i][0] for i in idx}) == len(idx) else [[i] for i in idx]
        for part in sets:
            data, n = bucket_commands(layout, groups, part, width)
            parts += data
            replies.append(("ints", n))
    return parts, replies


def bucket_commands(layout: BucketLayout, groups, idx: list[int], width: int) -> tuple[list[memoryview], int]:
    """One ``HSET key field row ...`` per bucket of the rows of groups ``idx`` (one prefix length,
    distinct prefixes, rows of ``width`` bytes), a bucket's rows in their order in the group (a row
    given twice: the later value stays, as in one command per row). -> (the commands, how many)."""
    counts = [len(groups[i][1]) for i in idx]
    ids = np.concatenate([np.asarray(groups[i][1], np.int64) for i in idx])
    raw = np.concatenate([_raw_rows(groups[i][2]) for i in idx]) if len(idx) > 1 else _raw_rows(groups[idx[0]][2])
    n = len(ids)
    member = np.repeat(np.arange(len(idx)), counts)
    buckets = layout.buckets(ids, width)
    perm = None  # the rows' order in the commands, where not their order here: applied once, at the end
    same = member[1:] == member[:-1]
    if (same & (buckets[1:] < buckets[:-1])).any():  # a group's rows not in bucket order
        perm = np.lexsort((buckets, member))  # stable: a bucket's rows keep their order
        member, buckets = member[perm], buckets[perm]
        same = member[1:] == member[:-1]
    starts = np.flatnonzero(np.r_[True, ~same | (buckets[1:] != buckets[:-1])])
    sizes = np.diff(np.r_[starts, n])
    tally = np.bincount(sizes)
    counts_of = np.flatnonzero(tally).tolist()
    if len(counts_of) > 1:  # the buckets in order of their row counts (stable), rows with them
        by_size = np.argsort(sizes.astype(np.int16 if sizes.max() < 1 << 15 else np.int64), kind="stable")
        sizes = sizes[by_size]
        moved = np.r_[0, np.cumsum(sizes)[:-1]]  # each bucket's first row, in the new order
        by_row = np.repeat(starts[by_size] - moved, sizes) + np.arange(n)
        member, buckets, starts = member[by_row], buckets[by_row], moved
        perm = by_row if perm is None else perm[by_row]
    if perm is not None:
        ids = ids[perm]
        raw = np.take(raw, perm, axis=0)  # whole rows (a fancy index copies them byte by byte)
    fb = layout.field_bytes
    pairs = _records(n, [b"$%d\r\n" % fb, layout.fields(ids, width), b"\r\n$%d\r\n" % width, raw, b"\r\n"])
    plen = len(groups[idx[0]][0])
    prefixes = np.frombuffer(b"".join(groups[i][0] for i in idx), f"V{plen}")
    keys = np.ascontiguousarray(buckets[starts], dtype=">u8").view("V8").reshape(-1)
    named = _records(len(starts), [prefixes[member[starts]], keys, b"\r\n"]).view(f"V{plen + KEY_ID_BYTES + 2}")
    parts, at, row = [], 0, 0
    for k in counts_of:  # the buckets holding k rows each (consecutive now): one array
        m = int(tally[k])
        head = b"*%d\r\n$4\r\nHSET\r\n$%d\r\n" % (2 + 2 * k, plen + KEY_ID_BYTES)
        block = np.empty((m, len(head) + named.itemsize + k * pairs.shape[1]), np.uint8)
        h = block.shape[1] - k * pairs.shape[1]
        block[:, :h] = _records(m, [head, named[at : at + m, 0]])
        block[:, h:] = pairs[row : row + m * k].reshape(m, -1)
        parts.append(block)
        at, row = at + m, row + m * k
    return [memoryview(p.reshape(-1)) for p in parts], len(starts)


class RowConnection:
    """One socket to one shard, opened lazily through redis-py and dropped on any error."""

    def __init__(self, pool: redis.ConnectionPool, timeout_s: float, layout: BucketLayout | None = None) -> None:
        self._pool = pool
        self.timeout_s = timeout_s
        self.layout = layout or BucketLayout()
        self._conn: redis.connection.AbstractConnection | None = None
        self._buf = bytearray()
        self._deadline = 0.0

    # -- socket plumbing -----------------------------------------------------------------
    def _sock(self) -> socket.socket:
        if self._conn is None:
            conn = self._pool.make_connection()
            try:
                conn.connect()  # TCP/TLS, AUTH, SELECT; raises redis errors
            except BaseException:
                conn.disconnect()
                raise
            self._conn = conn
            self._buf.clear()
        return self._conn._sock  # type: ignore[attr-defined,return-value]

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None
        self._buf.clear()

    def _remaining(self) -> float:
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise redis.TimeoutError("deadline passed")
        return left

    def _send(self, data: bytes) -> None:
        sock = self._sock()
        sock.settimeout(self._remaining())
        sock.sendall(data)

    def _fill(self, n: int, reply: bool = False) -> None:
        """Read until the buffer holds at least n bytes. ``reply``: the buffer starts with a reply,
        so fail at once if that is an error (a server that answers every command with one, e.g.
        -LOADING, may send fewer bytes than the replies expected)."""
        sock = self._sock()
        while len(self._buf) < n:
            if reply and self._buf[:1] == b"-" and b"\r\n" in self._buf:
                self._fail(b"")
            sock.settimeout(self._remaining())
            chunk = sock.recv(min(max(n - len(self._buf), 1 << 16), 1 << 22))
            if not chunk:
                raise redis.ConnectionError("connection closed by server")
            self._buf += chunk

    def _take(self, n: int, reply: bool = False) -> bytes:
        self._fill(n, reply)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self._buf[:i])
                del self._buf[: i + 2]
                return line
            self._fill(len(self._buf) + 1, reply=True)

    def _expect(self, want: bytes) -> None:
        got = self._take(len(want), reply=True)
        if got != want:
            self._fail(got)

    def _fail(self, got: bytes):
        # an error reply breaks the framing; read what is there for the message, then drop the socket
        try:
            self._fill(len(got) + 1)
        except (redis.RedisError, OSError):
            pass
        text = (got + bytes(self._buf)).split(b"\r\n")
        msg = next((t[1:].decode(errors="replace") for t in text if t.startswith(b"-")), repr(got[:80]))
        self.close()
        raise _error(msg)

    def _run(self, fn):
        self._deadline = time.monotonic() + self.timeout_s
        try:
            return fn()
        except TimeoutError as e:  # socket.timeout
            self.close()
            raise redis.TimeoutError(str(e) or "timed out") from None
        except OSError as e:
            self.close()
            raise redis.ConnectionError(str(e)) from None
        except BaseException:
            self.close()
            raise

    # -- bulk operations ---------------------------------------------------------------------
    def get_rows(self, groups: list[tuple[bytes, np.ndarray, int]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """groups: (key prefix, ids [n], row width in bytes). -> per group (rows [n, width] uint8, missing [n] bool);
        a missing row (never written) reads as zeros here."""
        return self._run(lambda: self._get_rows(groups))

    def _get_rows(self, groups):
        shapes = row_shapes(groups, lambda g: g[2])
        out = [(np.zeros((len(g[1]), g[2]), np.uint8), np.zeros(len(g[1]), bool)) for g in groups]
        if not shapes:
            return out
        token = os.urandom(12)
        parts, ends, least = [], [], 0
        for j, ((_, width), idx) in enumerate(shapes.items()):
            n = sum(len(groups[i][1]) for i in idx)
            parts.append(_records(n, keyed_records(self.layout, b"HGET", 3, groups, idx, width)).tobytes())
            mark = token + j.to_bytes(4, "big")
            parts.append(encode_command([b"PING", mark]))
            ends.append(b"$16\r\n" + mark + b"\r\n")
            least += 5 * n + len(ends[-1])
        self._send(b"".join(parts))
        self._fill(least, reply=True)
        while not self._buf.endswith(ends[-1]):
            self._fill(len(self._buf) + 1, reply=True)
        body = bytes(self._buf)
        self._buf.clear()
        at = 0
        for ((_, width), idx), end in zip(shapes.items(), ends):
            stop = body.find(end, at)
            if stop < 0:
                raise WireError("a reply to a row read is cut short")
            n = sum(len(groups[i][1]) for i in idx)
            rows, missing = parse_rows(body[at:stop], n, width)
            at = stop + len(end)
            lo = 0
            for i in idx:
                m = len(groups[i][1])
                out[i] = (rows[lo : lo + m], missing[lo : lo + m])
                lo += m
        return out

    def set_rows(self, groups: list[tuple[bytes, np.ndarray, np.ndarray]], extra: list[list[bytes]] = ()) -> int:
        """groups: (key prefix, ids [n], rows [n, dim] float32). Returns rows written.

        With ``extra`` (commands answering +OK, e.g. ``[b"SET", key, value]``) everything runs in
        one MULTI/EXEC transaction: the rows and the extra keys change together or not at all.
        """
        return self._run(lambda: self._set_rows(groups, list(extra)))

    def replies(self, commands: bytes, n: int) -> list:
        """``n`` RESP commands (``encode_command``, ``key_commands``) sent in one write; -> each
        one's reply, parsed by hiredis (a bulk string as bytes, an array as a list): no Python
        object per command beyond its reply. An error reply raises, naming it."""
        return self._run(lambda: self._replies(commands, n))

    def _replies(self, commands: bytes, n: int) -> list:
        import hiredis

        self._send(commands)
        reader = hiredis.Reader()
        if self._buf:
            reader.feed(bytes(self._buf))
            self._buf.clear()
        sock, out = self._sock(), []
        while len(out) < n:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as e:  # not RESP (``_run`` closes the socket)
                raise WireError(f"the server's replies are not RESP: {e}") from None
            if reply is False:
                sock.settimeout(self._remaining())
                chunk = sock.recv(1 << 20)
                if not chunk:
                    raise redis.ConnectionError("connection closed by server")
                reader.feed(chunk)
            elif isinstance(reply, hiredis.ReplyError):
                self.close()  # the replies after it are not read: the socket goes
                raise _error(str(reply))
            else:
                out.append(reply)
        return out

    def get(self, key: bytes) -> bytes | None:
        return self._run(lambda: self._get(key))

    def send_commands(self, commands: list[list[bytes]]) -> None:
        """A few commands answering +OK or an integer (SET, HSET), in one MULTI/EXEC transaction."""

        def run():
            n = len(commands)
            self._send(
                b"*1\r\n$5\r\nMULTI\r\n" + b"".join(encode_command(c) for c in commands) + b"*1\r\n$4\r\nEXEC\r\n"
            )
            self._expect(b"+OK\r\n" + b"+QUEUED\r\n" * n + b"*%d\r\n" % n)
            for _ in range(n):
                line = self._line()
                if not line.startswith((b"+OK", b":")):
                    self._fail(line + b"\r\n")

        self._run(run)

    def _get(self, key: bytes) -> bytes | None:
        self._send(encode_command([b"GET", key]))
        line = self._line()
        if line == b"$-1":
            return None
        if not line.startswith(b"$"):
            self._fail(line + b"\r\n")
        n = int(line[1:])
        body = self._take(n + 2)
        return body[:n]

    def send_rows(
        self, groups: list[tuple[bytes, np.ndarray, np.ndarray]], first: list[list[bytes]], last: list[list[bytes]]
    ) -> list:
        """Send ``first`` commands, the rows, then ``last`` commands (each answering +OK), pipelined
        and in that order but not as one transaction: a sender that dies part way leaves a prefix
        of them applied. -> the replies to expect, for ``finish``; between the two the server works
        while the caller sends to other shards."""
        return self._run(lambda: self._send_rows(groups, list(first), list(last)))

    def finish(self, reply: list) -> None:
        """The receiving half of ``send_rows``: read the server's acknowledgement of every command."""
        self._run(lambda: self._receive(reply))

    def _set_rows(self, groups, extra):
        if extra:
            self._receive(self._send_tx(groups, extra))
        else:
            self._receive(self._send_rows(groups, [], []))
        return sum(len(ids) for _, ids, _ in groups)

    def _send_rows(self, groups, first, last) -> list:
        rows, replies = row_commands(self.layout, groups)
        self._send(b"".join([encode_command(c) for c in first] + rows + [encode_command(c) for c in last]))
        return [("ok", len(first)), *replies, ("ok", len(last))]

    def _send_tx(self, groups, extra) -> list:
        rows, replies = row_commands(self.layout, groups)
        num_cmds = sum(n for _, n in replies) + len(extra)
        self._send(
            b"*1\r\n$5\r\nMULTI\r\n" + b"".join(rows + [encode_command(c) for c in extra]) + b"*1\r\n$4\r\nEXEC\r\n"
        )
        return [("raw", b"+OK\r\n" + b"+QUEUED\r\n" * num_cmds + b"*%d\r\n" % num_cmds), *replies, ("ok", len(extra))]

    def _receive(self, replies: list) -> None:
        for kind, n in replies:
            if kind == "raw":
                self._expect(n)
            elif kind == "ok":
                self._expect(b"+OK\r\n" * n)
            else:  # "ints": one HSET per bucket, answered with its number of new fields
                _read_ints(self, n)


def _read_ints(conn: RowConnection, n: int) -> None:
    """Read ``n`` integer replies from ``conn`` (``:<digits>\\r\\n``), checked with numpy; any other reply fails."""
    if not n:
        return
    conn._fill(4 * n, reply=True)  # ":0\\r\\n", the shortest
    while (ends := np.flatnonzero(np.frombuffer(conn._buf, np.uint8) == 10)).size < n:
        # the replies not read in full, each 4 bytes at least, from the end of the last whole one; and
        # one byte more than held (a reply cut part way is longer than 4 bytes): never more than is sent
        done = int(ends[-1]) + 1 if ends.size else 0
        conn._fill(max(len(conn._buf) + 1, done + 4 * (n - ends.size)), reply=True)
    ends = ends[:n]
    a = np.frombuffer(conn._buf, np.uint8, int(ends[-1]) + 1)
    begins = np.r_[0, ends[:-1] + 1]
    digits = np.ones(len(a), bool)  # every byte between the colon and the CR a digit
    digits[begins] = digits[ends - 1] = digits[ends] = False
    ok = (ends - begins >= 3) & (a[begins] == 58) & (a[ends - 1] == 13)
    if ok.all() and ((a[digits] >= 48) & (a[digits] <= 57)).all():
        del a
        del conn._buf[: int(ends[-1]) + 1]
        return
    wrong = digits & ((a < 48) | (a > 57))
    bad = int(np.argmin(ok)) if not ok.all() else int(np.searchsorted(ends, np.flatnonzero(wrong)[0]))
    line = bytes(a[begins[bad] : ends[bad] + 1]).rstrip(b"\r\n")
    del a
    conn.close()
    if line.startswith(b"-"):
        raise _error(line[1:].decode(errors="replace"))
    raise WireError(f"unexpected reply to a row write: {line[:80]!r}")


# -- RESTORE of serialized values (embeddings.snapshots.restore_load) --------------------------------
def restore_one(conn: RowConnection, key: bytes, payload: bytes | bytearray) -> str | None:
    """``RESTORE key 0 payload REPLACE`` alone: -> None when the server took it, else its error
    text (a server that refuses the command: an ACL, a renamed command, an older RDB version)."""

    def run():
        conn._send(b"".join(_restore_command(key, payload)))
        line = conn._line()
        if line == b"+OK":
            return None
        if line.startswith(b"-"):
            return line[1:].decode(errors="replace")
        conn._fail(line + b"\r\n")

    return conn._run(run)


def restore_many(conn: RowConnection, payloads, batch_bytes: int = 4 << 20) -> int:
    """``RESTORE key 0 payload REPLACE`` for each (key, payload), pipelined: batches of about
    ``batch_bytes`` are built here while a sender thread writes the ones before to the socket,
    so that the server is never left without work; the replies (5 bytes each) are read at the
    end, the first error among them raised. Each send, and the reading, gets the connection's
    timeout. -> keys restored."""

    def run():
        sent = _Sender(conn)
        count, parts, size = 0, [], 0
        try:
            for key, payload in payloads:
                parts += _restore_command(key, payload)
                size += len(payload)
                count += 1
                if size >= batch_bytes:
                    sent.put(b"".join(parts))
                    parts, size = [], 0
            if parts:
                sent.put(b"".join(parts))
        except BaseException:
            sent.close(quiet=True)  # the error that stopped the batches is the one raised
            raise
        sent.close()
        conn._deadline = time.monotonic() + conn.timeout_s
        conn._expect(b"+OK\r\n" * count)
        return count

    return conn._run(run)
