"""Groups of rows as bytes: the one encoding of (table, ids, rows) groups that every format holding
them shares (update-log records, rows files, a shard's undo record); each keeps its own framing.

Group (little-endian)::

    table u32 | n u32 | width u32 | half u32 | ids [n] i64 | rows[:, :half] f16 | rows[:, half:] f32

``half``: the leading columns stored as float16 (a rows file's weights; 0 everywhere else, so the
rows come back bit for bit). A list of groups is ``count u32`` then its groups. Encoding and decoding
are numpy ``tobytes``/``frombuffer`` per group, never per row. A buffer that does not hold whole,
consistent groups raises ``GroupsError`` (its framing's CRC, where it has one, is checked first).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

Group = tuple[int, np.ndarray, np.ndarray]  # (table, ids [n] int64, rows [n, width] float32)

HEAD = struct.Struct("<IIII")  # table, n, width, half
COUNT = struct.Struct("<I")


class GroupsError(ValueError):
    """Bytes that do not decode as whole groups: truncated, or a header that contradicts them."""


def parts(table: int, ids: np.ndarray, rows: np.ndarray, half: int = 0) -> list[bytes]:
    """The bytes of one group, in pieces (a caller joins them with its own framing: one copy)."""
    width = rows.shape[1]
    half = min(half, width)
    out = [HEAD.pack(table, len(ids), width, half), np.ascontiguousarray(ids, "<i8").tobytes()]
    if half:
        out.append(np.ascontiguousarray(rows[:, :half], "<f2").tobytes())
        rows = rows[:, half:]
    out.append(np.ascontiguousarray(rows, "<f4").tobytes())
    return out


def size(ids: np.ndarray, rows: np.ndarray, half: int = 0) -> int:
    """Bytes of one group (``parts`` joined)."""
    n, width = rows.shape
    half = min(half, width)
    return HEAD.size + 8 * len(ids) + n * (2 * half + 4 * (width - half))


def encode(groups: Sequence[Group], half: Sequence[int] | None = None, prefix: bytes = b"") -> bytes:
    """``prefix`` (a format's own header), then the count and the groups. ``half``: per table, the
    leading columns to store as float16 (None: every column float32)."""
    out = [prefix, COUNT.pack(len(groups))]
    for t, ids, rows in groups:
        out += parts(t, ids, rows, half[t] if half is not None else 0)
    return b"".join(out)


def encoded_size(groups: Sequence[Group], half: Sequence[int] | None = None) -> int:
    """Bytes of ``encode(groups, half)`` without its prefix."""
    return COUNT.size + sum(size(ids, rows, half[t] if half is not None else 0) for t, ids, rows in groups)


def decode_one(buf, pos: int = 0, copy: bool = False) -> tuple[Group, int]:
    """The group at byte ``pos`` of ``buf`` (bytes, bytearray or memoryview) -> (group, where it ends).
    ``copy=False``: an all-float32 group's rows are a read-only view of ``buf``; else fresh arrays."""
    end = len(buf)
    if pos + HEAD.size > end:
        raise GroupsError(f"a group header at byte {pos} runs past the end ({end} bytes)")
    table, n, width, half = HEAD.unpack_from(buf, pos)
    if half > width:
        raise GroupsError(f"the group at byte {pos} has {half} float16 columns of {width}")
    at = pos + HEAD.size
    stop = at + 8 * n + n * (2 * half + 4 * (width - half))
    if stop > end:
        raise GroupsError(f"the group at byte {pos} ({n} rows of width {width}) runs past the end ({end} bytes)")
    ids = np.frombuffer(buf, "<i8", n, at).astype(np.int64)
    at += 8 * n
    full = np.frombuffer(buf, "<f4", n * (width - half), at + 2 * n * half).reshape(n, width - half)
    if half:
        rows = np.empty((n, width), np.float32)
        rows[:, :half] = np.frombuffer(buf, "<f2", n * half, at).reshape(n, half)
        rows[:, half:] = full
    else:
        rows = full.copy() if copy else full
    return (table, ids, rows), stop


def decode(buf, pos: int = 0, copy: bool = False) -> list[Group]:
    """The groups ``encode`` wrote from byte ``pos`` of ``buf`` to its end (nothing may follow them)."""
    if pos + COUNT.size > len(buf):
        raise GroupsError(f"no group count at byte {pos} ({len(buf)} bytes)")
    (count,) = COUNT.unpack_from(buf, pos)
    pos += COUNT.size
    out = []
    for _ in range(count):
        group, pos = decode_one(buf, pos, copy)
        out.append(group)
    if pos != len(buf):
        raise GroupsError(f"{len(buf) - pos} bytes after the {count} groups")
    return out
