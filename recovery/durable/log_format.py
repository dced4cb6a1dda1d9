"""The per-shard update log's format (``recovery.durable.log``): records framed by a header
(magic, payload length, CRC32C of the payload) around a step and one group of
``embeddings.groups``, each step's records followed by an end record; and a segment's bytes read
back: its framing alone (``frames``, ``file_frames``), its records checked (``entries``, ``scan``),
a torn tail cut (``repair``)."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from embeddings import groups as codec

MAGIC = 0x52454332  # "REC2": the payload is a group of embeddings.groups
_HEADER = struct.Struct("<III")
_STEP = struct.Struct("<Q")
_NO_IDS = np.zeros(0, np.int64)
END = 0xFFFFFFFF  # table of a step's end record: ``width`` counts the step's records before it


@dataclass
class LogRecord:
    step: int
    table: int
    ids: np.ndarray  # [n] int64
    rows: np.ndarray  # [n, width] float32


def _record(step: int, table: int, ids: np.ndarray, rows: np.ndarray) -> list[bytes]:
    """One framed record: its header and its payload."""
    payload = b"".join([_STEP.pack(step), *codec.parts(table, ids, rows)])
    return [_HEADER.pack(MAGIC, len(payload), crc32c.crc32c(payload)), payload]


def encode_record(step: int, table: int, ids: np.ndarray, rows: np.ndarray) -> bytes:
    return b"".join(_record(step, table, ids, rows))


def encode_group(step: int, groups) -> bytes:
    """One step's records of (table, ids, rows) groups and their end record (a group of no rows whose
    width counts them): one write."""
    out = [part for t, ids, rows in groups for part in _record(step, t, ids, rows)]
    return b"".join(out + _record(step, END, _NO_IDS, np.zeros((0, len(groups)), np.float32)))


def step_bytes(groups) -> int:
    """Bytes of the records of (table, ids, rows) groups, their end record included."""
    data = sum(codec.size(ids, rows) for _, ids, rows in groups) + codec.HEAD.size  # the end record's group
    return data + (len(groups) + 1) * (_HEADER.size + _STEP.size)


@dataclass
class Entry:
    """One framed record of a segment as read back: a data record, an end record (``record.table ==
    END``) or, ``record`` None, a record whose payload fails its CRC (the framing held)."""

    offset: int
    record: LogRecord | None


def frames(data: bytes | memoryview | mmap.mmap) -> tuple[list[tuple[int, int]], int]:
    """The framing of a segment's bytes alone (no CRC checked, nothing decoded): -> ([(offset, its
    step field, unverified)] per framed record, where the framing ends: ``entries``' end)."""
    out, pos, size = [], 0, len(data)
    while pos + _HEADER.size <= size:
        magic, length, _ = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if magic != MAGIC or length < _STEP.size + codec.HEAD.size or end > size:
            break
        out.append((pos, _STEP.unpack_from(data, pos + _HEADER.size)[0]))
        pos = end
    return out, pos


def file_frames(path: Path) -> tuple[list[tuple[int, int]], int, int]:
    """``frames`` of a segment's file through a read-only map (its headers read, no copy of its
    rows: a regroup frames every shard's open segment); -> (framed records, where the framing ends,
    the file's size)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if not size:
            return [], 0, 0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            framed, end = frames(m)
    return framed, end, size


def entries(path: Path, data: bytes | None = None) -> tuple[list[Entry], int, str]:
    """Every framed record of a segment, damaged ones included (the framing goes on past a bad CRC),
    -> (entries, where they end, why they end there: "" at the end of the file). ``data``: the
    segment's bytes, read already."""
    data = memoryview(path.read_bytes() if data is None else data)  # records are views of one read, not copies
    out, pos, why = [], 0, ""
    while pos < len(data):
        if pos + _HEADER.size > len(data):
            why = f"a torn record header at byte {pos}"
            break
        magic, length, crc = _HEADER.unpack_from(data, pos)
        end = pos + _HEADER.size + length
        if magic != MAGIC or length < _STEP.size + codec.HEAD.size:
            why = f"no record boundary at byte {pos} (damaged framing)"
            break
        if end > len(data):
            why = f"a torn record at byte {pos}"
            break
        payload = data[pos + _HEADER.size : end]
        record = None
        if crc32c.crc32c(payload) == crc:
            try:
                (table, ids, rows), stop = codec.decode_one(payload, _STEP.size)
            except codec.GroupsError:
                stop = -1
            if stop == length and (table != END or len(ids) == 0):
                record = LogRecord(_STEP.unpack_from(payload)[0], table, ids, rows)
        out.append(Entry(pos, record))
        pos = end
    return out, pos, why


def scan(path: Path) -> tuple[list[LogRecord], int]:
    """Every whole, verified data record of a segment up to the first damaged one, and the byte
    offset where the whole records end."""
    out, end, _ = entries(path)
    records = []
    for e in out:
        if e.record is None:
            return records, e.offset
        if e.record.table != END:
            records.append(e.record)
    return records, end


def repair(path: Path) -> int:
    """Cut a torn tail (a record whose framing or length runs past the end) at the last whole
    record; returns bytes cut. A whole record failing its CRC stays: a replay that needs its step
    names it."""
    _, end, size = file_frames(path)
    if end < size:
        cut_file(path, end)
    return size - end


def cut_file(path: Path, size: int) -> None:
    """The file cut to its first ``size`` bytes, durably (a crash before leaves the longer file,
    which the next cut finds again)."""
    with open(path, "r+b") as f:
        f.truncate(size)
        f.flush()
        os.fsync(f.fileno())
