"""Bulk row I/O on the Redis wire protocol, encoded and decoded with numpy.

A row key is ``prefix + row id as 8 bytes big-endian`` and a row value is ``width`` bytes, so
every key argument and every present value in a reply has the same length. Commands for
thousands of rows are built as one ``[n, stride]`` uint8 array, and a reply whose rows are all
present is cut into rows with one reshape instead of one Python object per row.

Reads go in chunks of ``CHUNK`` keys, each as ``MULTI / EXISTS keys / MGET keys / EXEC``, all
chunks of a request pipelined in one send. EXISTS tells, atomically with the MGET, how many of
the chunk's rows are present, hence the exact byte length of the MGET reply: all present ->
numpy reshape; some never written -> that chunk is parsed by hiredis. Chunking also keeps the
server's reply buffers small (one MGET of 30k rows costs the server ~0.7 us/key, chunks of 2k
about half of that, measured here).

The connection itself (TCP or TLS, AUTH with password or ACL user, SELECT) is set up by
redis-py; this module then speaks on its socket directly, with a deadline on every call.
"""

from __future__ import annotations

import socket
import time

import hiredis
import numpy as np
import redis

CHUNK = 2048
_CRLF = np.frombuffer(b"\r\n", np.uint8)
_TX_ACK = b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n"


class WireError(Exception):
    """The server answered something other than the expected reply (its text is the message)."""


def key_args(prefix: bytes, ids: np.ndarray) -> np.ndarray:
    """[n, stride] uint8: each row is one RESP bulk-string argument ``$L\\r\\n<prefix><id>\\r\\n``."""
    klen = len(prefix) + 8
    head = f"${klen}\r\n".encode() + prefix
    out = np.empty((len(ids), len(head) + 8 + 2), np.uint8)
    out[:, : len(head)] = np.frombuffer(head, np.uint8)
    out[:, len(head) : len(head) + 8] = np.ascontiguousarray(ids, dtype=">u8").view(np.uint8).reshape(-1, 8)
    out[:, -2:] = _CRLF
    return out


def value_args(rows: np.ndarray) -> np.ndarray:
    """[n, stride] uint8 RESP bulk strings of each row's little-endian float32 bytes."""
    raw = np.ascontiguousarray(rows, dtype="<f4").view(np.uint8).reshape(len(rows), -1)
    head = np.frombuffer(f"${raw.shape[1]}\r\n".encode(), np.uint8)
    out = np.empty((len(rows), len(head) + raw.shape[1] + 2), np.uint8)
    out[:, : len(head)] = head
    out[:, len(head) : -2] = raw
    out[:, -2:] = _CRLF
    return out


def _items(a: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Columns ``lo:hi`` of a C-contiguous ``[n, stride]`` uint8 array as ``n`` items of ``hi - lo`` bytes."""
    return a[:, lo:hi].view(f"V{hi - lo}").reshape(-1)


def encode_command(args: list[bytes]) -> bytes:
    """A RESP command from a few byte-string arguments."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        out += [b"$%d\r\n" % len(a), a, b"\r\n"]
    return b"".join(out)


def _command(name: bytes, num_args: int, args: np.ndarray) -> bytes:
    return b"*%d\r\n$%d\r\n%s\r\n" % (num_args + 1, len(name), name) + args.tobytes()


class RowConnection:
    """One socket to one shard, opened lazily through redis-py and dropped on any error."""

    def __init__(self, pool: redis.ConnectionPool, timeout_s: float) -> None:
        self._pool = pool
        self.timeout_s = timeout_s
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

    def _fill(self, n: int) -> None:
        """Read until the buffer holds at least n bytes."""
        sock = self._sock()
        while len(self._buf) < n:
            sock.settimeout(self._remaining())
            chunk = sock.recv(max(n - len(self._buf), 1 << 16))
            if not chunk:
                raise redis.ConnectionError("connection closed by server")
            self._buf += chunk

    def _take(self, n: int) -> bytes:
        self._fill(n)
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
            self._fill(len(self._buf) + 1)

    def _expect(self, want: bytes) -> None:
        got = self._take(len(want))
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
        if "NOAUTH" in msg or "WRONGPASS" in msg or "NOPERM" in msg:
            raise redis.AuthenticationError(msg)
        raise WireError(msg)

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
        """groups: (key prefix, ids [n], row width in bytes). -> per group (rows [n, width] uint8, missing [n] bool)."""
        return self._run(lambda: self._get_rows(groups))

    def _get_rows(self, groups):
        parts = []
        for prefix, ids, _width in groups:
            keys = key_args(prefix, ids)
            for lo in range(0, len(ids), CHUNK):
                k = keys[lo : lo + CHUNK]
                parts += [
                    b"*1\r\n$5\r\nMULTI\r\n",
                    _command(b"EXISTS", len(k), k),
                    _command(b"MGET", len(k), k),
                    b"*1\r\n$4\r\nEXEC\r\n",
                ]
        self._send(b"".join(parts))
        out = []
        for _prefix, ids, width in groups:
            rows = np.zeros((len(ids), width), np.uint8)
            missing = np.zeros(len(ids), bool)
            head = b"$%d\r\n" % width
            stride = len(head) + width + 2
            for lo in range(0, len(ids), CHUNK):
                m = min(CHUNK, len(ids) - lo)
                self._expect(_TX_ACK)
                line = self._line()
                if not line.startswith(b":"):
                    self._fail(line + b"\r\n")
                present = int(line[1:])
                self._expect(b"*%d\r\n" % m)
                body = self._take(present * stride + (m - present) * 5)
                if present == m:
                    block = np.frombuffer(body, np.uint8).reshape(m, stride)
                    if not (block[:, : len(head)] == np.frombuffer(head, np.uint8)).all():
                        raise WireError(f"a stored row is not {width} bytes wide")
                    rows[lo : lo + m] = block[:, len(head) : len(head) + width]
                else:
                    reader = hiredis.Reader()
                    reader.feed(b"*%d\r\n" % m)
                    reader.feed(body)
                    values = reader.gets()
                    for i, v in enumerate(values):
                        if v is None:
                            missing[lo + i] = True
                        elif len(v) != width:
                            raise WireError(f"a stored row holds {len(v)} bytes, expected {width}")
                        else:
                            rows[lo + i] = np.frombuffer(v, np.uint8)
            out.append((rows, missing))
        return out

    def set_rows(self, groups: list[tuple[bytes, np.ndarray, np.ndarray]], extra: list[list[bytes]] = ()) -> int:
        """groups: (key prefix, ids [n], rows [n, dim] float32). Returns rows written.

        With ``extra`` (commands answering +OK, e.g. ``[b"SET", key, value]``) everything runs in
        one MULTI/EXEC transaction: the rows and the extra keys change together or not at all.
        """
        return self._run(lambda: self._set_rows(groups, list(extra)))

    def get(self, key: bytes) -> bytes | None:
        return self._run(lambda: self._get(key))

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
    ) -> bytes:
        """Send ``first`` commands, the rows, then ``last`` commands (each answering +OK), pipelined
        and in that order but not as one transaction: a sender that dies part way leaves a prefix
        of them applied. -> the reply to expect, for ``finish``; between the two the server works
        while the caller sends to other shards."""
        return self._run(lambda: self._send_rows(groups, list(first), list(last)))

    def finish(self, reply: bytes) -> None:
        """The receiving half of ``send_rows``: read the server's acknowledgement of every command."""
        self._run(lambda: self._expect(reply))

    def _set_rows(self, groups, extra):
        if extra:
            self._expect(self._send_tx(groups, extra))
        else:
            self._expect(self._send_rows(groups, [], []))
        return sum(len(ids) for _, ids, _ in groups)

    @staticmethod
    def _row_commands(groups) -> list[bytes]:
        """MSET commands of ``CHUNK`` rows for every group (key prefix, ids, rows): the groups whose
        prefixes have one length and whose rows one width are encoded together into one
        ``[n, key + value]`` array (each row's key head picked from a table of the prefixes), so a
        write of many tables costs a few numpy calls rather than a few per table."""
        parts = []
        by_shape: dict[tuple[int, int], list[tuple[bytes, np.ndarray, np.ndarray]]] = {}
        for g in groups:  # one array per (prefix length, row width)
            if len(g[1]):
                by_shape.setdefault((len(g[0]), g[2].shape[1]), []).append(g)
        for (plen, _), gs in by_shape.items():
            heads = np.stack([np.frombuffer(b"$%d\r\n" % (plen + 8) + p, np.uint8) for p, _, _ in gs])
            ids = gs[0][1] if len(gs) == 1 else np.concatenate([ids for _, ids, _ in gs])
            rows = gs[0][2] if len(gs) == 1 else np.concatenate([r for _, _, r in gs])
            raw = np.ascontiguousarray(rows, dtype="<f4").view(np.uint8).reshape(len(rows), -1)
            vhead = np.frombuffer(b"$%d\r\n" % raw.shape[1], np.uint8)
            hl, ks, vh = heads.shape[1], heads.shape[1] + 10, len(vhead)
            out = np.empty((len(ids), ks + vh + raw.shape[1] + 2), np.uint8)
            # each multi-byte part moved as one item per row (void views), not byte by byte
            head = heads.view(f"V{hl}").reshape(-1)
            if len(gs) > 1:
                head = head[np.repeat(np.arange(len(gs)), [len(i) for _, i, _ in gs])]
            _items(out, 0, hl)[:] = head
            _items(out, hl, hl + 8)[:] = np.ascontiguousarray(ids, dtype=">u8").view("V8").reshape(-1)
            between = b"\r\n" + vhead.tobytes()  # the key's end and the value's head
            _items(out, hl + 8, ks + vh)[:] = np.frombuffer(between, f"V{len(between)}")[0]
            _items(out, ks + vh, out.shape[1] - 2)[:] = raw.view(f"V{raw.shape[1]}").reshape(-1)
            _items(out, out.shape[1] - 2, out.shape[1])[:] = np.frombuffer(b"\r\n", "V2")[0]
            for lo in range(0, len(out), CHUNK):
                a = out[lo : lo + CHUNK]
                parts.append(_command(b"MSET", 2 * len(a), a))
        return parts

    def _send_rows(self, groups, first, last) -> bytes:
        parts = [encode_command(c) for c in first] + self._row_commands(groups) + [encode_command(c) for c in last]
        self._send(b"".join(parts))
        return b"+OK\r\n" * len(parts)

    def _send_tx(self, groups, extra) -> bytes:
        parts = self._row_commands(groups)
        num_cmds = len(parts)
        parts += [encode_command(c) for c in extra]
        num_cmds += len(extra)
        self._send(b"*1\r\n$5\r\nMULTI\r\n" + b"".join(parts) + b"*1\r\n$4\r\nEXEC\r\n")
        return b"+OK\r\n" + b"+QUEUED\r\n" * num_cmds + b"*%d\r\n" % num_cmds + b"+OK\r\n" * num_cmds
