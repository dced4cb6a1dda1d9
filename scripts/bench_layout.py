#!/usr/bin/env python
"""Bytes per row and row rates of candidate Redis layouts for embedding rows, side by side.

One local ``redis-server`` (``embeddings.servers.launcher.LocalShards``). For each row width (dim 16, 64,
128 with row-wise Adagrad's one float of state: 68, 260, 516 bytes) and each id set (``zipf``: the
N hottest ranks of a Zipf stream scattered over a 1M-row table as the synthetic data scatters
them, so 20% of the table at N = 200k; ``dense``: ids 0..N-1), every layout writes N rows into an
empty server and reports:

- bytes/row: ``INFO memory`` used_memory after the write minus before, over N (and / the payload);
- insert rows/s: the first write of the N rows, in batches;
- write rows/s and read rows/s of batches of ``--batch`` rows drawn Zipf-like from the written
  rows (overwrites; reads), and the server's CPU time per row (``/proc/PID/stat``), which on a
  machine whose cores the trainers share is what the tier costs the training.

Layouts:
  string         one string per row, key prefix + id (8 bytes), through the project's wire path as
                 it was before the buckets (``MULTI / EXISTS / MGET / EXEC`` per 2048 rows, ``MSET``
                 per 2048 rows; kept here as ``StringConn`` for this comparison)
  buckets        what the store does now (``embeddings.store.buckets`` through ``embeddings.net.wire``): hash
                 buckets of as many rows as fill a jemalloc size class <= 16 KiB (110 at dim 16, 61
                 at dim 64, 31 at dim 128, one shard), one pipelined HGET / HSET per row, one HSET
                 per bucket where a write holds 4 rows a bucket or more
  hashB          hash buckets of B rows: key prefix + id // B (8 bytes), field id % B (1 byte),
                 value the row; listpack-encoded (``hash-max-listpack-entries`` >= B,
                 ``hash-max-listpack-value`` >= the row, set by CONFIG SET here). Pipelined HSET /
                 HGET, one command per row
  hashB-fn       the same layout through a Redis FUNCTION: one FCALL per chunk of rows (keys, fields
                 and rows in three arguments), HSET / HMGET per bucket inside; a read answers with
                 one bulk string (presence bytes, then the rows)
  slotB          fixed-slot bucket strings: key prefix + id // B, slot id % B of 1 + row bytes (a
                 presence byte, then the row) at offset slot * (1 + row); SETRANGE / GETRANGE

Each round measures every layout in turn on one server, emptied between layouts (so memory is
exact and layouts never share a key space); rates are the median over ``--rounds``. ``slotB``
builds its commands row by row in Python (offsets of varying digits): its rows/s measure that, its
server time per row is comparable.

    python scripts/bench_layout.py [--rows 200000] [--batch 1024,8192] [--seconds 0.5] [--rounds 3]
        [--dims 16,64,128] [--ids zipf,dense] [--layouts string,buckets,hash64,...]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embeddings.net.wire import RowConnection, WireError, encode_command  # noqa: E402
from embeddings.servers.launcher import LocalShards  # noqa: E402
from embeddings.store.buckets import BucketLayout  # noqa: E402

TABLE_ROWS = 1_000_000
STATE = 1  # row-wise Adagrad: one float of state per row
PREFIX = b"bench:0:"
CHUNK = 2048  # rows per command (pipelined commands: per send)
FIELD = 1  # bytes of a field (B <= 256)

LIBRARY = r"""#!lua name=bench_rows
local function rows_get(keys, args)
  local fields, w, fw = args[1], tonumber(args[2]), tonumber(args[3])
  local n = #keys
  local flags, out = {}, {}
  local zero = string.rep('\0', w)
  local i = 1
  while i <= n do
    local k, j = keys[i], i
    while j < n and keys[j + 1] == k do j = j + 1 end
    local fs = {}
    for r = i, j do fs[r - i + 1] = string.sub(fields, (r - 1) * fw + 1, r * fw) end
    local vals = redis.call('HMGET', k, unpack(fs))
    for r = i, j do
      local v = vals[r - i + 1]
      if v then
        if #v ~= w then return redis.error_reply('a stored row holds ' .. #v .. ' bytes, expected ' .. w) end
        out[r] = v; flags[r] = '\1'
      else
        out[r] = zero; flags[r] = '\0'
      end
    end
    i = j + 1
  end
  return table.concat(flags) .. table.concat(out)
end
local function rows_set(keys, args)
  local fields, rows, w, fw = args[1], args[2], tonumber(args[3]), tonumber(args[4])
  local n = #keys
  local i = 1
  while i <= n do
    local k, j = keys[i], i
    while j < n and keys[j + 1] == k do j = j + 1 end
    local a = {}
    for r = i, j do
      a[2 * (r - i) + 1] = string.sub(fields, (r - 1) * fw + 1, r * fw)
      a[2 * (r - i) + 2] = string.sub(rows, (r - 1) * w + 1, r * w)
    end
    redis.call('HSET', k, unpack(a))
    i = j + 1
  end
  return n
end
redis.register_function{function_name='bench_rows_get', callback=rows_get, flags={'no-writes'}}
redis.register_function('bench_rows_set', rows_set)
"""


# -- numpy RESP encoding of fixed-width records ------------------------------------------------------
def records(parts: list[bytes | np.ndarray], n: int) -> np.ndarray:
    """[n, stride] uint8: each row the concatenation of ``parts`` (constant bytes, or [n, k] uint8)."""
    widths = [p.shape[1] if isinstance(p, np.ndarray) else len(p) for p in parts]
    out = np.empty((n, sum(widths)), np.uint8)
    at = 0
    for p, w in zip(parts, widths):
        out[:, at : at + w] = p if isinstance(p, np.ndarray) else np.frombuffer(p, np.uint8)
        at += w
    return out


def be8(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=">u8").view(np.uint8).reshape(-1, 8)


def field_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.uint8).reshape(-1, 1)


def row_bytes(rows: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(rows, dtype="<f4").view(np.uint8).reshape(len(rows), -1)


def bulk(n: int) -> bytes:
    return b"$%d\r\n" % n


class Conn(RowConnection):
    """The project's row connection, plus the raw pipelined commands the candidates need."""

    def pipeline(self, cmds: np.ndarray, reply_len: int | None, sentinel: bool) -> bytes:
        """Send ``cmds`` (RESP commands, one per row) in chunks, read their replies: exactly
        ``reply_len`` bytes, or (``sentinel``) up to the reply of an ECHO sent after them."""
        return self._run(lambda: self._pipeline(cmds, reply_len, sentinel))

    def _until_echo(self, tok: bytes) -> bytes:
        """The replies before the ECHO of ``tok`` that ends a pipeline, as raw bytes."""
        end = b"$16\r\n" + tok + b"\r\n"
        while not self._buf.endswith(end):
            self._fill(len(self._buf) + 1)
        body = bytes(self._buf[: -len(end)])
        self._buf.clear()
        return body

    def _pipeline(self, cmds, reply_len, sentinel):
        tok = os.urandom(16)
        parts = [cmds[lo : lo + CHUNK].tobytes() for lo in range(0, len(cmds), CHUNK)]
        if sentinel:
            parts.append(encode_command([b"ECHO", tok]))
        self._send(b"".join(parts))
        if reply_len is not None:
            return self._take(reply_len)
        return self._until_echo(tok)

    def command(self, args: list[bytes], reply_head: bytes | None = None) -> bytes:
        """One command; -> its reply (a bulk string's bytes, or the raw line)."""

        def run():
            self._send(encode_command(args))
            line = self._line()
            if line.startswith(b"-"):
                self._fail(line + b"\r\n")
            if line.startswith(b"$"):
                n = int(line[1:])
                return self._take(n + 2)[:n]
            return line

        return self._run(run)


# -- layouts ---------------------------------------------------------------------------------------
class StringConn(Conn):
    """The project's row codec before the buckets (one string per row), as it was: reads as
    ``MULTI / EXISTS / MGET / EXEC`` per 2048 keys (EXISTS gives the reply's exact length), writes
    as ``MSET`` per 2048 rows, both numpy-encoded."""

    def string_get(self, prefix: bytes, ids: np.ndarray, width: int):
        return self._run(lambda: self._string_get(prefix, ids, width))

    def _string_get(self, prefix, ids, width):
        import hiredis

        keys = records([bulk(len(prefix) + 8) + prefix, be8(ids), b"\r\n"], len(ids))
        parts = []
        for lo in range(0, len(ids), CHUNK):
            k = keys[lo : lo + CHUNK]
            parts += [b"*1\r\n$5\r\nMULTI\r\n", _cmd(b"EXISTS", k), _cmd(b"MGET", k), b"*1\r\n$4\r\nEXEC\r\n"]
        self._send(b"".join(parts))
        rows = np.zeros((len(ids), width), np.uint8)
        missing = np.zeros(len(ids), bool)
        head = bulk(width)
        stride = len(head) + width + 2
        for lo in range(0, len(ids), CHUNK):
            m = min(CHUNK, len(ids) - lo)
            self._expect(b"+OK\r\n+QUEUED\r\n+QUEUED\r\n*2\r\n")
            line = self._line()
            if not line.startswith(b":"):
                self._fail(line + b"\r\n")
            present = int(line[1:])
            self._expect(b"*%d\r\n" % m)
            body = self._take(present * stride + (m - present) * 5)
            if present == m:
                block = np.frombuffer(body, np.uint8).reshape(m, stride)
                rows[lo : lo + m] = block[:, len(head) : len(head) + width]
            else:
                reader = hiredis.Reader()
                reader.feed(b"*%d\r\n" % m)
                reader.feed(body)
                for i, v in enumerate(reader.gets()):
                    if v is None:
                        missing[lo + i] = True
                    else:
                        rows[lo + i] = np.frombuffer(v, np.uint8)
        return rows, missing

    def string_set(self, prefix: bytes, ids: np.ndarray, rows: np.ndarray) -> None:
        def run():
            raw = row_bytes(rows)
            out = records(
                [bulk(len(prefix) + 8) + prefix, be8(ids), b"\r\n" + bulk(raw.shape[1]), raw, b"\r\n"], len(ids)
            )
            parts = [_cmd(b"MSET", out[lo : lo + CHUNK], 2) for lo in range(0, len(out), CHUNK)]
            self._send(b"".join(parts))
            self._expect(b"+OK\r\n" * len(parts))

        self._run(run)


def _cmd(name: bytes, args: np.ndarray, per_row: int = 1) -> bytes:
    return b"*%d\r\n$%d\r\n%s\r\n" % (per_row * len(args) + 1, len(name), name) + args.tobytes()


class StringLayout:
    """One string per row, through the codec the project had before the buckets."""

    name = "string"
    conn_class = StringConn

    def setup(self, conn, client, width):
        pass

    def write(self, conn: StringConn, ids, rows):
        conn.string_set(PREFIX, ids, rows)

    def read(self, conn: StringConn, ids, width):
        return conn.string_get(PREFIX, ids, 4 * width)


class BucketsLayout:
    """What the store does: ``embeddings.store.buckets`` through the project's ``RowConnection``."""

    name = "buckets"

    def setup(self, conn, client, width):
        from embeddings.store.buckets import fit_listpack

        layout = BucketLayout()
        assert fit_listpack(client, layout.max_fields(4 * width), 4 * width) is None

    def write(self, conn: Conn, ids, rows):
        conn.set_rows([(PREFIX, ids, rows)])

    def read(self, conn: Conn, ids, width):
        ((raw, missing),) = conn.get_rows([(PREFIX, ids, 4 * width)])
        return raw, missing


class HashLayout:
    """Hash buckets of ``b`` rows, one pipelined HSET / HGET per row."""

    def __init__(self, b: int) -> None:
        self.b = b
        self.name = f"hash{b}"
        self._keyhead = bulk(len(PREFIX) + 8) + PREFIX

    def setup(self, conn, client, width):
        client.config_set("hash-max-listpack-entries", max(self.b, 128))
        client.config_set("hash-max-listpack-value", max(4 * width, 64))

    def _kf(self, ids):
        return [self._keyhead, be8(ids // self.b), b"\r\n" + bulk(FIELD), field_bytes(ids % self.b), b"\r\n"]

    def write(self, conn: Conn, ids, rows):
        raw = row_bytes(rows)
        cmds = records([b"*4\r\n$4\r\nHSET\r\n", *self._kf(ids), bulk(raw.shape[1]), raw, b"\r\n"], len(ids))
        reply = np.frombuffer(conn.pipeline(cmds, 4 * len(ids), False), np.uint8).reshape(-1, 4)
        if not ((reply[:, 0] == ord(":")) & (reply[:, 2] == ord("\r"))).all():
            raise WireError("HSET: unexpected reply")

    def read(self, conn: Conn, ids, width):
        cmds = records([b"*3\r\n$4\r\nHGET\r\n", *self._kf(ids)], len(ids))
        body = conn.pipeline(cmds, None, True)
        return parse_bulks(body, len(ids), 4 * width)


def parse_bulks(body: bytes, n: int, w: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` bulk replies of ``w`` bytes or nil, concatenated: -> (rows [n, w] uint8, missing [n])."""
    head = bulk(w)
    stride = len(head) + w + 2
    present = (len(body) - 5 * n) // (stride - 5)
    rows = np.zeros((n, w), np.uint8)
    missing = np.zeros(n, bool)
    if present == n:
        block = np.frombuffer(body, np.uint8).reshape(n, stride)
        rows[:] = block[:, len(head) : len(head) + w]
        return rows, missing
    at = 0
    for i in range(n):
        if body[at : at + 5] == b"$-1\r\n":
            missing[i] = True
            at += 5
        else:
            rows[i] = np.frombuffer(body, np.uint8, w, at + len(head))
            at += stride
    return rows, missing


class HashFnLayout(HashLayout):
    """Hash buckets through the library's functions: one FCALL per chunk of rows."""

    def __init__(self, b: int) -> None:
        super().__init__(b)
        self.name = f"hash{b}-fn"

    def setup(self, conn, client, width):
        super().setup(conn, client, width)
        client.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY)

    def _keys(self, ids):
        return records([self._keyhead, be8(ids // self.b), b"\r\n"], len(ids))

    def write(self, conn: Conn, ids, rows):
        raw = row_bytes(rows)
        keys = self._keys(ids)
        for lo in range(0, len(ids), CHUNK):
            hi = min(lo + CHUNK, len(ids))
            f = field_bytes(ids[lo:hi] % self.b).tobytes()
            r = raw[lo:hi].tobytes()
            head = b"*%d\r\n$5\r\nFCALL\r\n$14\r\nbench_rows_set\r\n" % (hi - lo + 7) + bulk(len(b"%d" % (hi - lo)))
            tail = encode_command([f, r, b"%d" % raw.shape[1], b"%d" % FIELD])[len(b"*4\r\n") :]
            conn.pipeline_raw(head + b"%d\r\n" % (hi - lo) + keys[lo:hi].tobytes() + tail)

    def read(self, conn: Conn, ids, width):
        w = 4 * width
        keys = self._keys(ids)
        rows = np.empty((len(ids), w), np.uint8)
        missing = np.empty(len(ids), bool)
        for lo in range(0, len(ids), CHUNK):
            hi = min(lo + CHUNK, len(ids))
            f = field_bytes(ids[lo:hi] % self.b).tobytes()
            head = b"*%d\r\n$5\r\nFCALL\r\n$14\r\nbench_rows_get\r\n" % (hi - lo + 6) + bulk(len(b"%d" % (hi - lo)))
            tail = encode_command([f, b"%d" % w, b"%d" % FIELD])[len(b"*3\r\n") :]
            body = conn.pipeline_raw(head + b"%d\r\n" % (hi - lo) + keys[lo:hi].tobytes() + tail, (hi - lo) * (w + 1))
            flags = np.frombuffer(body, np.uint8, hi - lo)
            missing[lo:hi] = flags == 0
            rows[lo:hi] = np.frombuffer(body, np.uint8, offset=hi - lo).reshape(-1, w)
        return rows, missing


def _pipeline_raw(self, data: bytes, bulk_len: int | None = None) -> bytes:
    def run():
        self._send(data)
        line = self._line()
        if line.startswith(b"-"):
            self._fail(line + b"\r\n")
        if bulk_len is None:
            return line
        if line != b"$%d" % bulk_len:
            raise WireError(f"FCALL reply {line[:40]!r}, expected {bulk_len} bytes")
        return self._take(bulk_len + 2)[:bulk_len]

    return self._run(run)


Conn.pipeline_raw = _pipeline_raw  # type: ignore[attr-defined]


class SlotLayout:
    """Fixed-slot bucket strings: SETRANGE / GETRANGE at slot * (1 + row bytes), a presence byte first.
    (Offsets have a varying number of digits, so its commands are joined row by row in Python: its
    client time is not comparable, its server time per row is.)"""

    def __init__(self, b: int) -> None:
        self.b = b
        self.name = f"slot{b}"

    def setup(self, conn, client, width):
        pass

    def write(self, conn: Conn, ids, rows):
        raw = row_bytes(rows)
        w = raw.shape[1]
        cmds = [
            encode_command(
                [
                    b"SETRANGE",
                    PREFIX + int(i // self.b).to_bytes(8, "big"),
                    b"%d" % (i % self.b * (w + 1)),
                    b"\x01" + r.tobytes(),
                ]
            )
            for i, r in zip(ids.tolist(), raw)
        ]
        conn.pipeline_raw_many(cmds)

    def read(self, conn: Conn, ids, width):
        w = 4 * width
        cmds = []
        for i in ids.tolist():
            lo = i % self.b * (w + 1)
            cmds.append(
                encode_command([b"GETRANGE", PREFIX + (i // self.b).to_bytes(8, "big"), b"%d" % lo, b"%d" % (lo + w)])
            )
        body = conn.pipeline_raw_many(cmds, sentinel=True)
        rows = np.zeros((len(ids), w), np.uint8)
        missing = np.ones(len(ids), bool)
        head = bulk(w + 1)
        stride = len(head) + w + 3
        if len(body) == stride * len(ids):
            block = np.frombuffer(body, np.uint8).reshape(len(ids), stride)
            missing[:] = block[:, len(head)] == 0
            rows[:] = block[:, len(head) + 1 : len(head) + 1 + w]
            return rows, missing
        at = 0
        for i in range(len(ids)):  # short (past the string's end) or a never-written slot
            end = body.index(b"\r\n", at)
            n = int(body[at + 1 : end])
            v = body[end + 2 : end + 2 + n]
            at = end + 4 + n
            if n == w + 1 and v[0] == 1:
                missing[i] = False
                rows[i] = np.frombuffer(v, np.uint8, w, 1)
        return rows, missing


def _pipeline_raw_many(self, cmds: list[bytes], sentinel: bool = False) -> bytes:
    """Commands answering an integer each (SETRANGE), or (``sentinel``) anything up to an ECHO."""

    def run():
        tok = os.urandom(16)
        self._send(b"".join(cmds) + (encode_command([b"ECHO", tok]) if sentinel else b""))
        if not sentinel:
            for _ in cmds:
                line = self._line()
                if not line.startswith(b":"):
                    self._fail(line + b"\r\n")
            return b""
        return self._until_echo(tok)

    return self._run(run)


Conn.pipeline_raw_many = _pipeline_raw_many  # type: ignore[attr-defined]


# -- measurement -----------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def id_set(kind: str, n: int) -> np.ndarray:
    if kind == "dense":
        return np.arange(n, dtype=np.int64)
    # the n hottest Zipf ranks, scattered over the table as data.synthetic scatters them
    return np.unique((np.arange(n, dtype=np.int64) * 2654435761) % TABLE_ROWS)


def batches(ids: np.ndarray, size: int, count: int, rng) -> list[np.ndarray]:
    """Zipf(1.2) draws over the written ids (hot first in the hottest-first order), unique, sorted."""
    hot = ids if len(ids) < 2 else ids[np.argsort((np.arange(len(ids)) * 2654435761) % TABLE_ROWS)]
    out = []
    for _ in range(count):
        draw = np.unique(hot[np.minimum(rng.zipf(1.2, 4 * size) - 1, len(hot) - 1)])
        if len(draw) < size:  # top it up with uniform draws
            draw = np.unique(np.concatenate([draw, rng.choice(ids, size, replace=False)]))
        out.append(np.sort(rng.choice(draw, size, replace=False)))
    return out


def timed(fn, work: list, seconds: float, pid: int) -> tuple[float, float]:
    """Run fn(item) over ``work`` cyclically for ``seconds`` (at least once over it): -> (rows/s, server us/row)."""
    rows, i = 0, 0
    c0, t0 = cpu_s(pid), time.perf_counter()
    while i < len(work) or time.perf_counter() - t0 < seconds:
        rows += fn(work[i % len(work)])
        i += 1
    wall, cpu = time.perf_counter() - t0, cpu_s(pid) - c0
    return rows / wall, 1e6 * cpu / rows


def used_memory(client) -> int:
    return int(client.info("memory")["used_memory"])


def measure(layout, url: str, pid: int, dim: int, kind: str, args, rng) -> dict:
    """One layout on an emptied server: bytes per row of ``args.rows`` rows, insert, write and read rates."""
    width = dim + STATE
    client = redis.Redis.from_url(url, protocol=2)
    client.flushall()
    cls = getattr(layout, "conn_class", Conn)
    conn = cls(redis.ConnectionPool.from_url(url, protocol=2), 60.0)
    layout.setup(conn, client, width)
    ids = id_set(kind, args.rows)
    values = np.random.default_rng(1).standard_normal((len(ids), width)).astype(np.float32)
    conn.command([b"PING"])
    base = used_memory(client)
    t0, c0 = time.perf_counter(), cpu_s(pid)
    step = 8192
    for lo in range(0, len(ids), step):
        layout.write(conn, ids[lo : lo + step], values[lo : lo + step])
    insert = len(ids) / (time.perf_counter() - t0)
    insert_us = 1e6 * (cpu_s(pid) - c0) / len(ids)
    conn.close()  # its buffers are not rows
    time.sleep(0.05)
    mem = used_memory(client) - base
    conn = cls(redis.ConnectionPool.from_url(url, protocol=2), 60.0)
    # a read gives back what was written, a never-written row reads as missing, also mixed
    absent = np.setdiff1d(np.arange(TABLE_ROWS - 4000, TABLE_ROWS), ids)[:256]
    probe = np.sort(np.concatenate([rng.choice(ids, 512, replace=False), absent]))
    got, missing = layout.read(conn, probe, width)
    known = np.isin(probe, ids)
    if not np.array_equal(missing, ~known):
        raise SystemExit(f"{layout.name}: rows read as missing are not the never-written ones")
    if not np.array_equal(got[known].view("<f4"), values[np.searchsorted(ids, probe[known])]):
        raise SystemExit(f"{layout.name}: rows read back differ from those written")
    out = dict(layout=layout.name, dim=dim, ids=kind, bytes=mem / len(ids), payload=4 * width)
    out.update(insert=insert, insert_us=insert_us)
    for b in args.batch:
        work = batches(ids, b, 8, rng)
        new = [values[np.searchsorted(ids, w)] + 1 for w in work]
        pairs = list(zip(work, new))

        def wr(p):
            layout.write(conn, p[0], p[1])
            return len(p[0])

        def rd(w):
            layout.read(conn, w, width)
            return len(w)

        out[f"write{b}"], out[f"write_us{b}"] = timed(wr, pairs, args.seconds, pid)
        out[f"read{b}"], out[f"read_us{b}"] = timed(rd, work, args.seconds, pid)
    conn.close()
    client.flushall()
    client.close()
    return out


def make_layout(name: str):
    if name == "string":
        return StringLayout()
    if name == "buckets":
        return BucketsLayout()
    for kind, cls in (("hash", HashLayout), ("slot", SlotLayout)):
        if name.startswith(kind):
            b = name[len(kind) :].removesuffix("-fn")
            if name.endswith("-fn"):
                return HashFnLayout(int(b))
            return cls(int(b))
    raise SystemExit(f"unknown layout {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000, help="rows written per layout, id set and dim")
    ap.add_argument("--batch", default="1024,8192", help="rows per read / write batch (comma-separated)")
    ap.add_argument("--seconds", type=float, default=0.5, help="time per rate measurement")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every layout; rates are their median")
    ap.add_argument("--dims", default="16,64,128")
    ap.add_argument("--ids", default="zipf,dense")
    ap.add_argument(
        "--layouts",
        default="string,buckets,hash64,hash128,hash256,hash64-fn,hash128-fn,hash256-fn,slot64,slot128,slot256",
    )
    args = ap.parse_args()
    args.batch = [int(b) for b in args.batch.split(",")]
    if not 0 < args.rows <= TABLE_ROWS // 2:
        raise SystemExit(f"--rows {args.rows}: must be in (0, {TABLE_ROWS // 2}]")
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    layouts = [make_layout(n) for n in args.layouts.split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    kinds = args.ids.split(",")
    runs: dict[tuple, list[dict]] = {}
    with LocalShards(1) as sh:
        url, pid = sh.urls[0], sh.pids[0]
        for rnd in range(args.rounds):
            for dim in dims:
                for kind in kinds:
                    for layout in layouts:  # every layout meets the same batches in a round
                        r = measure(layout, url, pid, dim, kind, args, np.random.default_rng([dim, rnd]))
                        runs.setdefault((dim, kind, layout.name), []).append(r)
                        rates = "  ".join(
                            f"b{b}: w {r[f'write{b}'] / 1e3:,.0f}k/s {r[f'write_us{b}']:.2f}us"
                            f"  r {r[f'read{b}'] / 1e3:,.0f}k/s {r[f'read_us{b}']:.2f}us"
                            for b in args.batch
                        )
                        print(
                            f"round {rnd + 1} dim {dim:>3} {kind:>5} {r['layout']:>11}: {r['bytes']:7.1f} B/row "
                            f"({r['bytes'] / r['payload']:.2f}x)  insert {r['insert'] / 1e3:,.0f}k/s  {rates}",
                            flush=True,
                        )
    results = []
    for rs in runs.values():  # medians over the rounds
        med = dict(rs[0])
        for k, v in rs[0].items():
            if isinstance(v, float):
                med[k] = float(np.median([r[k] for r in rs]))
        results.append(med)
    print_table(results, args.batch)


def print_table(results: list[dict], sizes: list[int]) -> None:
    cols = ["dim", "ids", "layout", "bytes/row", "x payload", "insert rows/s"]
    for b in sizes:
        cols += [f"write rows/s ({b})", f"read rows/s ({b})", f"server us/row w/r ({b})"]
    print("\n| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in results:
        cells = [str(r["dim"]), r["ids"], r["layout"], f"{r['bytes']:.1f}", f"{r['bytes'] / r['payload']:.2f}x"]
        cells.append(f"{r['insert'] / 1e3:,.0f}k")
        for b in sizes:
            cells += [f"{r[f'write{b}'] / 1e3:,.0f}k", f"{r[f'read{b}'] / 1e3:,.0f}k"]
            cells.append(f"{r[f'write_us{b}']:.2f} / {r[f'read_us{b}']:.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
