"""Snapshots of a shard reachable only by URL: a fork-time RDB fetched over the replication
protocol, and a reader that loads one back through the protocol.

``NetworkSnapshot`` speaks to the server as a replica would (``REPLCONF rdb-only 1``, ``SYNC``).
Without the ``eof`` capability the server answers with a disk-based full sync: it forks at once
(no ``repl-diskless-sync-delay``), writes the snapshot, then streams it as ``$<len>\\r\\n<bytes>``.
``start`` returns as soon as the server has forked: that is the snapshot point, so training
pauses for the fork alone, as with a local ``BGSAVE``. ``finish`` streams the file to disk
(SHA-256 on the way, fsync). No access to the server's filesystem is needed.

``read_keys`` parses an RDB file (version 9-10, Redis 6-7) and yields its keys with a given
prefix: strings (the bookkeeping keys) and hashes (the row buckets of ``embeddings.store.buckets``, as a
listpack or, past the server's listpack limits, as a hash table; a Redis 6 server's ziplist-encoded
hash is refused with one line); other value types are skipped,
LZF-compressed strings are decompressed. ``group_rows`` turns a shard's buckets back into rows per
table; ``RedisStore.load_snapshot`` writes them back over the protocol.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import redis

from embeddings.errors import EmbeddingStoreError, ShardDataError, ShardUnavailableError
from embeddings.snapshots.crc64 import CRC64, crc64
from embeddings.store.buckets import KEY_ID_BYTES, BucketLayout

# a failed write of the snapshot file (not of the socket): the disk's fault, raised as is
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG, errno.EACCES, errno.EPERM}


class SnapshotRefusedError(EmbeddingStoreError):
    """The server answered the snapshot request with an error (an ACL without SYNC: NOPERM): it
    runs, and will refuse every snapshot."""


class _Refused(Exception):
    pass


class NetworkSnapshot:
    """One shard's snapshot over the replication protocol: ``start`` (returns once forked), ``finish``."""

    def __init__(
        self,
        pool: redis.ConnectionPool,
        info: Callable[[], dict],
        dest: Path,
        shard: int,
        endpoint: str,
        timeout_s: float = 600.0,
    ) -> None:
        self.pool, self.info, self.dest = pool, info, Path(dest)
        self.shard, self.endpoint, self.timeout_s = shard, endpoint, timeout_s
        self._conn = None
        self._header = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.result: tuple[str, int] | None = None  # (sha256, bytes)

    def _unavailable(self, why: str) -> ShardUnavailableError:
        return ShardUnavailableError(self.shard, self.endpoint, f"snapshot over the network: {why}")

    def start(self) -> None:
        """Ask for a full sync; return once the server forked its snapshot."""
        deadline = time.monotonic() + self.timeout_s
        while int(self.info()["rdb_bgsave_in_progress"]):  # another save runs: SYNC would wait for the next
            if time.monotonic() > deadline:
                raise self._unavailable(f"a background save still runs after {self.timeout_s}s")
            time.sleep(0.005)
        conn = self.pool.make_connection()
        try:
            conn.connect()
            conn.send_command("REPLCONF", "rdb-only", "1")  # Redis 7: close after the snapshot
            try:
                conn.read_response()
            except redis.ResponseError:
                pass  # older servers: the stream that follows the snapshot is cut off by close()
            conn._sock.sendall(b"*1\r\n$4\r\nSYNC\r\n")  # type: ignore[attr-defined]
        except (redis.RedisError, OSError) as e:
            conn.disconnect()
            raise self._unavailable(str(e) or type(e).__name__) from None
        self._conn = conn
        self._thread = threading.Thread(target=self._stream, name=f"snapshot-{self.shard}", daemon=True)
        self._thread.start()
        while not self._header.is_set():  # the fork: the server reports a save, or the stream already began
            if self._error is not None:
                self.close()
                raise self._unavailable(str(self._error))
            try:
                if int(self.info()["rdb_bgsave_in_progress"]):
                    return
            except ShardUnavailableError:
                self.close()
                raise
            if time.monotonic() > deadline:
                self.close()
                raise self._unavailable(f"no fork within {self.timeout_s}s")
            time.sleep(0.001)

    def _stream(self) -> None:
        sock = self._conn._sock  # type: ignore[union-attr]
        sock.settimeout(self.timeout_s)
        buf = bytearray()
        try:
            while True:  # keep-alive newlines, then $<len>\r\n
                while b"\r\n" not in buf:
                    chunk = sock.recv(1 << 16)
                    if not chunk:
                        raise ConnectionError("connection closed before the snapshot")
                    buf += chunk
                    while buf[:1] == b"\n":
                        del buf[:1]
                line, _, rest = bytes(buf).partition(b"\r\n")
                buf = bytearray(rest)
                if line.startswith(b"-"):
                    raise _Refused(line[1:].decode(errors="replace"))
                if line.startswith(b"$"):
                    break
            if line.startswith(b"$EOF:"):
                raise ConnectionError("the server sent a diskless stream, which was not asked for")
            size = int(line[1:])
            self._header.set()
            h = hashlib.sha256()
            tmp = self.dest.with_name(self.dest.name + ".part")
            with open(tmp, "wb") as f:
                got = 0
                while got < size:
                    block = bytes(buf[: size - got]) if buf else sock.recv(min(1 << 20, size - got))
                    buf.clear()
                    if not block:
                        raise ConnectionError(f"connection closed after {got} of {size} snapshot bytes")
                    h.update(block)
                    f.write(block)
                    got += len(block)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.dest)
            self.result = (h.hexdigest(), size)
        except BaseException as e:  # noqa: BLE001 - surfaced by start()/finish()
            if isinstance(e, OSError) and e.errno in _DISK_ERRNOS and e.filename is None:
                e.filename = str(self.dest.with_name(self.dest.name + ".part"))  # a failed write names none
            self._error = e
        finally:
            self._header.set()

    def finish(self) -> tuple[str, int]:
        """Wait for the whole snapshot on disk; -> (sha256, bytes)."""
        if self._thread is not None:
            self._thread.join()
        self.close()
        if isinstance(self._error, _Refused):
            raise SnapshotRefusedError(
                f"shard {self.shard} at {self.endpoint} refused the snapshot over the network (SYNC): {self._error}"
            )
        if isinstance(self._error, OSError) and self._error.errno in _DISK_ERRNOS:
            raise self._error
        if self._error is not None or self.result is None:
            raise self._unavailable(str(self._error or "no snapshot"))
        return self.result

    def close(self) -> None:
        if self._conn is not None:
            self._conn.disconnect()
            self._conn = None


# -- reading an RDB file ------------------------------------------------------------------------
_EOF, _SELECTDB, _EXPIRE_S, _EXPIRE_MS, _RESIZEDB, _AUX, _FREQ, _IDLE, _FUNCTION2 = (
    0xFF,
    0xFE,
    0xFD,
    0xFC,
    0xFB,
    0xFA,
    0xF9,
    0xF8,
    0xF5,
)
_SLOT_INFO, _MODULE_AUX = 0xF4, 0xF7  # Redis 7.4+ cluster nodes: slot sizes before a slot's keys


class _Reader:
    def __init__(self, buf, source: str, raw=None) -> None:
        self.buf, self.pos, self.source = buf, 0, source
        # the same bytes as an object whose slices are bytes (a file's mmap), for ``_buckets``
        self.raw = raw
        self.db, self.functions = 0, 0  # the database its keys are in now; function libraries seen

    def fail(self, why: str):
        raise ShardDataError(f"snapshot {self.source}: {why} at byte {self.pos}")

    def byte(self) -> int:
        if self.pos >= len(self.buf):
            self.fail("truncated")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            self.fail("truncated")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def length(self) -> tuple[int, bool]:
        """-> (length or special-encoding id, is_special)."""
        b = self.byte()
        kind = b >> 6
        if kind == 0:
            return b & 0x3F, False
        if kind == 1:
            return ((b & 0x3F) << 8) | self.byte(), False
        if kind == 3:
            return b & 0x3F, True
        if b == 0x80:
            return struct.unpack(">I", self.take(4))[0], False
        if b == 0x81:
            return struct.unpack(">Q", self.take(8))[0], False
        self.fail(f"bad length byte {b:#x}")

    def string(self) -> bytes:
        n, special = self.length()
        if not special:
            return bytes(self.take(n))
        if n == 0:
            return str(struct.unpack("b", self.take(1))[0]).encode()
        if n == 1:
            return str(struct.unpack("<h", self.take(2))[0]).encode()
        if n == 2:
            return str(struct.unpack("<i", self.take(4))[0]).encode()
        if n == 3:
            clen, _ = self.length()
            ulen, _ = self.length()
            return lzf_decompress(bytes(self.take(clen)), ulen)  # a copy: no view of the mapping outlives an error
        self.fail(f"unknown string encoding {n}")

    def skip_string(self) -> None:
        """Past one string, without decoding it (an LZF-compressed one stays compressed)."""
        n, special = self.length()
        if not special:
            self.take(n)
        elif n <= 2:
            self.take(1 << n)
        elif n == 3:
            clen, _ = self.length()
            self.length()
            self.take(clen)
        else:
            self.fail(f"unknown string encoding {n}")

    def skip_value(self, kind: int) -> None:
        if kind == 0:
            self.skip_string()
        elif kind in (1, 2, 14):  # list, set, quicklist: n strings
            for _ in range(self.length()[0]):
                self.skip_string()
        elif kind == 4:  # hash: n pairs
            for _ in range(2 * self.length()[0]):
                self.skip_string()
        elif kind == 3:  # zset with string scores
            for _ in range(self.length()[0]):
                self.skip_string()
                n = self.byte()
                if n < 253:
                    self.take(n)
        elif kind == 5:  # zset with binary scores
            for _ in range(self.length()[0]):
                self.skip_string()
                self.take(8)
        elif kind in (9, 10, 11, 12, 13, 16, 17, 20):  # one encoded blob (20: a listpack set, Redis 7.2+)
            self.skip_string()
        elif kind == 18:  # quicklist 2: n (container, blob)
            for _ in range(self.length()[0]):
                self.length()
                self.skip_string()
        else:
            self.fail(f"value type {kind} (a stream, a module's, or one newer than Redis 7.4's) cannot be skipped")


_HASH, _HASH_ZIPLIST, _HASH_LISTPACK = 4, 13, 16

Value = bytes | list[tuple[bytes, bytes]]  # a string's bytes, or a hash's (field, value) pairs


def read_strings(path: str | os.PathLike, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) of every string key that starts with ``prefix`` in the RDB file at ``path``."""
    for key, value in read_keys(path, prefix):
        if isinstance(value, bytes):
            yield key, value


def read_keys(path: str | os.PathLike, prefix: bytes) -> Iterator[tuple[bytes, Value]]:
    """(key, value) of every string and hash key that starts with ``prefix`` in the RDB file at
    ``path``: a string's bytes, a hash's (field, value) pairs (in the order the server keeps them)."""
    with _mapped(path) as r:
        for op, key in _walk(r):
            if not key.startswith(prefix):
                r.skip_value(op)
            elif op == 0:
                yield key, r.string()
            elif op == _HASH_LISTPACK:
                yield key, _pairs(listpack_entries(r.string(), r), r, key)
            elif op == _HASH:
                n = r.length()[0]
                yield key, [(r.string(), r.string()) for _ in range(n)]
            elif op == _HASH_ZIPLIST:
                r.fail(f"hash {key!r} is ziplist-encoded (a Redis 6 server): not read here, use Redis 7")
            else:
                r.skip_value(op)


@contextlib.contextmanager
def _mapped(path: str | os.PathLike, populate: bool = False) -> Iterator[_Reader]:
    """A reader over the file at ``path``, mapped (``ShardDataError`` for an empty file);
    ``populate``: its pages mapped at once (the reads that follow touch all of it: one call
    instead of a fault every few pages)."""
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ShardDataError(f"snapshot {path}: empty file")
        with mmap.mmap(f.fileno(), 0, flags=flags, prot=mmap.PROT_READ) as mm:
            r = _Reader(memoryview(mm), str(path), raw=mm)
            try:
                yield r
            finally:
                r.buf.release()


def _walk(r: _Reader) -> Iterator[tuple[int, bytes]]:
    """(value type, key) of every key of the file, the reader at its value each time: the consumer
    reads or skips it before the next."""
    magic = bytes(r.take(9))
    if not magic.startswith(b"REDIS"):
        r.fail(f"not an RDB file (starts with {magic[:5]!r})")
    while True:
        op = r.byte()
        if op == _EOF:
            return
        if op == _AUX:
            r.string()
            r.string()
        elif op == _SELECTDB:
            r.db = r.length()[0]
        elif op == _RESIZEDB:
            r.length()
            r.length()
        elif op == _EXPIRE_MS:
            r.take(8)
        elif op == _EXPIRE_S:
            r.take(4)
        elif op == _FREQ:
            r.byte()
        elif op == _IDLE:
            r.length()
        elif op == _FUNCTION2:
            r.string()
            r.functions += 1
        elif op == _SLOT_INFO:
            r.length()
            r.length()
            r.length()
        elif op == _MODULE_AUX:
            r.fail("module data (opcode 0xf7) cannot be read here")
        elif op <= 25:
            yield op, r.string()
        else:
            r.fail(f"unknown opcode {op:#x}")


# -- serialized values, as RESTORE takes them ----------------------------------------------------


def _check_sum(r: _Reader) -> bool:
    """The file's own checksum (its last 8 bytes: CRC-64 of everything before them) against its
    bytes; -> False where the server wrote none (``rdbchecksum no``). ``ShardDataError`` if they differ."""
    n = len(r.buf)
    if n < 18 or r.buf[n - 9] != _EOF:
        r.fail(f"{n} bytes: no end marker and checksum where an RDB file ends")
    stored = struct.unpack_from("<Q", r.buf, n - 8)[0]
    if stored == 0:
        return False
    got = crc64(r.buf[: n - 8])  # on every core, without the GIL
    if got != stored:
        raise ShardDataError(
            f"snapshot {r.source}: its bytes do not match its checksum ({got:#018x}, the file says {stored:#018x}): "
            "the file is damaged"
        )
    return True


def check_file(path: str | os.PathLike) -> bool:
    """The whole file at ``path`` against the CRC-64 it ends with (``ShardDataError`` if they
    differ); -> False where it has none."""
    with _mapped(path) as r:
        return _check_sum(r)


def mapped(path: str | os.PathLike) -> contextlib.AbstractContextManager[_Reader]:
    """The file at ``path`` open for ``check_mapped`` and ``scan_mapped`` (one mapping, its pages
    mapped at once, for both)."""
    return _mapped(path, populate=True)


def check_mapped(r: _Reader) -> bool:
    """``check_file`` of a file already open (``mapped``)."""
    return _check_sum(r)


def restore_payloads(path: str | os.PathLike, prefix: bytes) -> Iterator[tuple[bytes, int, bytearray]]:
    """(key, value type, payload) of every key that starts with ``prefix`` in the RDB file at
    ``path``, the payload as ``RESTORE`` takes it (and ``DUMP`` gives it): the value's type byte and
    its encoding as the file holds it (a listpack stays one blob, a compressed string stays
    compressed), then the file's RDB version (2 bytes) and a CRC-64 of all that (8 bytes).

    Nothing is given before the whole file has matched its own checksum (where the server wrote
    one); a row bucket's listpack must frame (its length and end byte). A damaged file is a
    ``ShardDataError`` naming it, before any payload reaches a server. Expiry times are not kept
    (the store sets none)."""
    with _mapped(path) as r:
        footer = _footer(r)
        for key, op, start, end in _spans(r, prefix, None):
            yield key, op, _payload(op, r.buf, start, end, footer)


class Contents:
    """What ``scan_snapshot`` found in a file: its keys of the prefix (how many, the databases they
    are in, their values' bytes), and anything else it holds (keys of another prefix, function
    libraries)."""

    def __init__(self) -> None:
        self.keys, self.value_bytes, self.others, self.dbs = 0, 0, [], set()

    @property
    def alone(self) -> bool:
        return not self.others

    def note_functions(self, n: int) -> Contents:
        if n and b"(function libraries)" not in self.others:
            self.others.append(b"(function libraries)")
        return self


def scan_snapshot(path: str | os.PathLike, prefix: bytes, sample, progress=None, checksum: bool = True) -> Contents:
    """The checks ``restore_payloads`` makes (the file's checksum, each row bucket's framing) over
    the whole file without building payloads; ``sample(key, type, payload)`` sees each key of the
    prefix (the payload built only when it is called for: ``payload()``); ``progress(end, found)``
    hears every few MB how far the file has been read and checked. ``checksum=False``: the caller
    has checked the file's CRC-64 (``check_file``)."""
    with _mapped(path) as r:
        return scan_mapped(r, prefix, sample, progress, checksum)


def scan_mapped(r: _Reader, prefix: bytes, sample, progress=None, checksum: bool = True) -> Contents:
    """``scan_snapshot`` of a file already open (``mapped``), from its start.

    ``sample`` may answer True for a row bucket: every later key of the same head (the key less its
    last 8 bytes: its namespace and table) passes the same check, and is not shown to it."""
    out = Contents()
    r.pos = 0
    footer = _footer(r, checksum)
    buf, same, since, lp = r.buf, set(), 0, _HASH_LISTPACK
    for key, op, start, end in _spans(r, prefix, out.others, runs=False):
        out.keys += 1
        out.value_bytes += end - start
        out.dbs.add(r.db)
        if sample(key, op, lambda op=op, start=start, end=end: _payload(op, buf, start, end, footer)):
            same.add(key[:-8])
        run: list = [None]
        while run:  # the row buckets that follow, a few MB at a time
            if progress is not None and r.pos - since >= 4 << 20:  # all up to here is checked
                since = r.pos
                progress(since, out.note_functions(r.functions))
            values, run = 0, _buckets(r, prefix)
            for key, at, e in run:
                if key[:-8] not in same and sample(key, lp, lambda at=at, e=e: _payload(lp, buf, at, e, footer)):
                    same.add(key[:-8])
                values += e - at
            out.keys += len(run)
            out.value_bytes += values
    return out.note_functions(r.functions)


def _footer(r: _Reader, checksum: bool = True) -> bytes:
    """The file's RDB version as a payload ends with it, once the file has matched its checksum."""
    version = bytes(r.buf[5:9])
    if bytes(r.buf[:5]) != b"REDIS":
        r.fail(f"not an RDB file (starts with {bytes(r.buf[:5])!r})")
    if not version.isdigit():
        r.fail(f"RDB version {version!r} is not a number")
    if checksum:
        _check_sum(r)
    return struct.pack("<H", int(version))


def _spans(r: _Reader, prefix: bytes, others: list | None, runs: bool = True) -> Iterator[tuple[bytes, int, int, int]]:
    """(key, value type, start, end) of each key of ``prefix``, its value ``r.buf[start:end]``; any
    other key is skipped (and added to ``others``). ``runs=False``: the row buckets that follow a
    key are left to the caller (``_buckets``) before the next."""
    for op, key in _walk(r):
        start = r.pos
        if not key.startswith(prefix):
            r.skip_value(op)
            if others is not None:
                others.append(key)
            continue
        n, special = r.length() if op == _HASH_LISTPACK else (0, True)
        r.pos = start
        r.skip_value(op)
        if not special:  # an uncompressed listpack: its header's length and its end byte
            _frame(r, key, r.pos - n, n)
        yield key, op, start, r.pos
        while runs and (run := _buckets(r, prefix)):
            for key, at, end in run:
                yield key, _HASH_LISTPACK, at, end


def _frame(r: _Reader, key: bytes, at: int, n: int) -> None:
    if n < 7 or struct.unpack_from("<I", r.buf, at)[0] != n or r.buf[at + n - 1] != 0xFF:
        r.fail(f"hash {key!r}: {n} bytes do not frame a listpack")


def _payload(op: int, buf, start: int, end: int, footer: bytes) -> bytearray:
    out = bytearray(end - start + 11)
    out[0] = op
    out[1 : end - start + 1] = buf[start:end]
    out[-10:-8] = footer
    struct.pack_into("<Q", out, len(out) - 8, CRC64.calc(memoryview(out)[:-8]))
    return out


def _buckets(r: _Reader, prefix: bytes, most: int = 4 << 20) -> list[tuple[bytes, int, int]]:
    """``_spans``' common case, read inline: (key, start, end) of the keys that follow while they
    are uncompressed listpack hashes of ``prefix`` with short keys (a row bucket, its length in 14
    or 32 bits), for about ``most`` bytes of the file; anything else is left to the generic reader."""
    # the file's mmap itself where the reader has it: its slices are bytes at once, and cost half a
    # view's (any other reader's bytes are copied once a call)
    buf = r.raw if r.raw is not None else r.buf.tobytes()
    size, out, p = len(buf), [], r.pos
    stop = min(size, p + most)
    while p < stop:
        if p + 2 > size or buf[p] != _HASH_LISTPACK or buf[p + 1] >= 64:
            break
        at = p + 2 + buf[p + 1]  # the value's length
        if at + 5 > size:
            break
        head = buf[at]
        if head >> 6 == 1:
            n, start = ((head & 0x3F) << 8) | buf[at + 1], at + 2
        elif head == 0x80:
            n, start = int.from_bytes(buf[at + 1 : at + 5], "big"), at + 5
        else:
            break
        end = start + n
        key = buf[p + 2 : at]
        if end > size or not key.startswith(prefix):
            break
        if n < 7 or buf[end - 1] != 0xFF or int.from_bytes(buf[start : start + 4], "little") != n:
            r.pos = p  # the error names this bucket's place
            _frame(r, key, start, n)  # says which, in one line
        out.append((key, at, end))
        p = end
    r.pos = p
    return out


def decode_value(kind: int, payload: bytes | bytearray, source: str) -> Value:
    """A string's bytes or a hash's pairs, from a ``restore_payloads`` payload (to check a sample)."""
    r = _Reader(memoryview(payload)[1:-10], source)
    if kind == 0:
        return r.string()
    if kind == _HASH_LISTPACK:
        return _pairs(listpack_entries(r.string(), r), r, b"")
    if kind == _HASH:
        return [(r.string(), r.string()) for _ in range(r.length()[0])]
    r.fail(f"value type {kind} is not a string or a hash")


def _pairs(entries: list[bytes], r: _Reader, key: bytes) -> list[tuple[bytes, bytes]]:
    if len(entries) % 2:
        r.fail(f"hash {key!r}: an odd number of listpack entries ({len(entries)})")
    return list(zip(entries[0::2], entries[1::2]))


def listpack_entries(blob: bytes, r: _Reader | None = None) -> list[bytes]:
    """The entries of a listpack (Redis 7's compact encoding), integers as their decimal text (as
    Redis gives them back). ``ShardDataError`` (through ``r``, which names the file) if it is damaged."""

    def fail(why: str):
        if r is not None:
            r.fail(f"listpack: {why}")
        raise ShardDataError(f"listpack: {why}")

    if len(blob) < 7 or struct.unpack_from("<I", blob)[0] != len(blob) or blob[-1] != 0xFF:
        fail(f"{len(blob)} bytes do not frame a listpack")
    count = struct.unpack_from("<H", blob, 4)[0]
    out: list[bytes] = []
    at, end = 6, len(blob) - 1
    while at < end:
        b = blob[at]
        if b < 0x80:  # 7-bit unsigned integer
            value, size = str(b).encode(), 1
        elif b < 0xC0:  # string of up to 63 bytes
            n = b & 0x3F
            value, size = blob[at + 1 : at + 1 + n], 1 + n
        elif b < 0xE0:  # 13-bit signed integer
            v = ((b & 0x1F) << 8) | blob[at + 1]
            value, size = str(v - (1 << 13) if v >= 1 << 12 else v).encode(), 2
        elif b < 0xF0:  # string of up to 4095 bytes
            n = ((b & 0x0F) << 8) | blob[at + 1]
            value, size = blob[at + 2 : at + 2 + n], 2 + n
        elif b == 0xF0:  # 32-bit string length
            n = struct.unpack_from("<I", blob, at + 1)[0]
            value, size = blob[at + 5 : at + 5 + n], 5 + n
        elif b in _LP_INTS:
            width = _LP_INTS[b]
            v = int.from_bytes(blob[at + 1 : at + 1 + width], "little", signed=True)
            value, size = str(v).encode(), 1 + width
        else:
            fail(f"unknown entry encoding {b:#x} at byte {at}")
        at += size + _backlen_size(size)
        if at > end:
            fail("an entry runs past the end")
        out.append(bytes(value))
    if count != 0xFFFF and count != len(out):
        fail(f"{len(out)} entries, its header says {count}")
    return out


_LP_INTS = {0xF1: 2, 0xF2: 3, 0xF3: 4, 0xF4: 8}


def _backlen_size(n: int) -> int:
    """Bytes of the back-length of an entry of ``n`` bytes (listpack.c ``lpEncodeBacklen``)."""
    return 1 if n <= 127 else 2 if n < 16383 else 3 if n < 2097151 else 4 if n < 268435455 else 5


def lzf_decompress(data, ulen: int) -> bytes:
    """LZF, as Redis writes compressed strings."""
    src = bytes(data)
    out = bytearray()
    i, n = 0, len(src)
    while i < n:
        ctrl = src[i]
        i += 1
        if ctrl < 32:
            out += src[i : i + ctrl + 1]
            i += ctrl + 1
            continue
        length = ctrl >> 5
        if length == 7:
            length += src[i]
            i += 1
        ref = len(out) - ((ctrl & 0x1F) << 8) - src[i] - 1
        i += 1
        length += 2
        if ref < 0:
            raise ShardDataError("corrupt LZF block in snapshot")
        if ref + length <= len(out):
            out += out[ref : ref + length]
        else:
            for k in range(length):
                out.append(out[ref + k])
    if len(out) != ulen:
        raise ShardDataError(f"LZF block decompressed to {len(out)} bytes, expected {ulen}")
    return bytes(out)


def group_rows(items: Iterator[tuple[bytes, Value]], namespace: str, layout: BucketLayout, widths: list[int]):
    """Split a shard's keys into rows per table and the rest: the row buckets (hashes
    ``{namespace}:{table}:`` + 8-byte bucket index, ``embeddings.store.buckets``) of tables whose rows are
    ``widths[table]`` bytes -> ({table: (ids sorted [n] int64, rows' bytes in that order)}, [(key, value)]).
    ``ShardDataError`` for a bucket that is not one of ``layout`` (a field or a row of another size)."""
    head = namespace.encode() + b":"
    rows: dict[int, tuple[list[np.ndarray], list[bytes]]] = {}
    other: list[tuple[bytes, Value]] = []
    for key, value in items:
        t, sep, bucket = key[len(head) :].partition(b":")
        if isinstance(value, bytes) and sep and t.isdigit() and len(bucket) == KEY_ID_BYTES:
            raise ShardDataError(
                f"snapshot: {key!r} is a row as one string (the layout before hash buckets): "
                "this version reads row buckets only"
            )
        if not (isinstance(value, list) and sep and t.isdigit() and len(bucket) == KEY_ID_BYTES):
            other.append((key, value))
            continue
        table = int(t)
        if table >= len(widths):
            raise ShardDataError(f"snapshot: bucket {key!r} of table {table}, which the run does not have")
        width = widths[table]
        fields = [f for f, _ in value]
        if any(len(v) != width for _, v in value):
            bad = next(len(v) for _, v in value if len(v) != width)
            raise ShardDataError(f"snapshot: bucket {key!r} holds a row of {bad} bytes, expected {width}")
        try:
            ids = layout.row_ids(int.from_bytes(bucket, "big"), fields, width)
        except ValueError as e:
            raise ShardDataError(f"snapshot: bucket {key!r}: {e}") from None
        got = rows.setdefault(table, ([], []))
        got[0].append(ids)
        got[1].append(b"".join(v for _, v in value))
    out = {}
    for t, (ids_parts, vals) in rows.items():
        ids = np.concatenate(ids_parts)
        order = np.argsort(ids, kind="stable")
        width = widths[t]
        values = np.frombuffer(b"".join(vals), np.uint8).reshape(len(ids), width)[order]
        out[t] = (ids[order], values.tobytes())
    return out, other
