"""Files of rows written off the training path: priority saves and incremental flushes.

A writer copies the rows it wants to keep at a step boundary (from the rows it holds: no Redis
read, no barrier) and hands them to ``RowFileWriter``, whose one background thread encodes,
writes, fsyncs and renames each file in order while training goes on. The training path pays
for the copy alone.

File::

    crc     u32  CRC32C of the rest
    magic   4s   b"ROW3"
    step    u64  the rows are as of the end of this step
    updates u64  (row, step) updates since the shard's last checkpoint that these rows hold
    groups       ``embeddings.groups``; ``half``: a row's weights (its first ``dim`` columns) are
                 float16, the optimizer state stays float32

Everything needed to use a file is in it, so rank 0 can overlay a file another trainer wrote.
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from embeddings import groups as codec
from recovery.durable.files import write_atomic
from recovery.errors import CorruptCheckpointError

MAGIC = b"ROW3"
_HEAD = struct.Struct("<4sQQ")


@dataclass
class RowFile:
    step: int
    updates: int
    groups: list[tuple[int, np.ndarray, np.ndarray]]  # (table, ids, rows [n, width] float32)


def encode(step: int, updates: int, groups, dims: list[int], half: bool = False) -> bytes:
    blob = codec.encode(groups, dims if half else None, prefix=_HEAD.pack(MAGIC, step, updates))
    return struct.pack("<I", crc32c.crc32c(blob)) + blob


def decode(data: bytes, where: str) -> RowFile:
    if len(data) < 4 + _HEAD.size:
        raise CorruptCheckpointError(f"{where}: {len(data)} bytes, too short for a rows file; not loaded")
    (crc,) = struct.unpack_from("<I", data)
    if crc32c.crc32c(data[4:]) != crc:
        raise CorruptCheckpointError(f"{where}: CRC32C mismatch; not loaded")
    magic, step, updates = _HEAD.unpack_from(data, 4)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{where}: magic {magic!r} is not {MAGIC!r}; not loaded")
    try:
        groups = codec.decode(data, 4 + _HEAD.size, copy=True)
    except codec.GroupsError as e:
        raise CorruptCheckpointError(f"{where}: {e}; not loaded") from e
    return RowFile(int(step), int(updates), groups)


def read(path: Path) -> RowFile:
    return decode(Path(path).read_bytes(), str(path))


class RowFileWriter:
    """One background thread that writes rows files durably, in the order they were handed over."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: list[Future] = []
        self._lock = threading.Lock()
        self.bytes_written = 0
        self.files = 0
        self.seconds = 0.0  # background time: encoding, writing, fsync

    def run(self, work) -> Future:
        """Run ``work()`` on the writer's thread (after what was handed over before it); -> its future."""
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(work))
        return self._pending[-1]

    def write(self, path: Path, step: int, updates: int, groups, dims: list[int], half: bool = False) -> None:
        """Encode and write one rows file durably (on the writer's thread: call it from ``run``)."""
        t0 = time.perf_counter()
        data = encode(step, updates, groups, dims, half)
        write_atomic(path, data)
        with self._lock:
            self.bytes_written += len(data)
            self.files += 1
            self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Every file handed over so far is on disk (errors surface here)."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


class ShardRowsSaver:
    """What a writer's off-path savers share: the shards it writes, a background writer, byte counts."""

    def __init__(self, directory, store, shards: set[int] | None, name: str) -> None:
        self.dir = Path(directory)
        self.store = store
        self.shards = set(range(store.num_shards)) if shards is None else set(shards)
        self.writer = RowFileWriter(name)

    @property
    def bytes_written(self) -> int:
        return self.writer.bytes_written

    def mine_keys(self, keys: np.ndarray, shards: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of packed row keys and their shards, those of this writer's shards."""
        if len(self.shards) < self.store.num_shards:
            at = np.isin(shards, list(self.shards))
            keys, shards = keys[at], shards[at]
        return keys, shards

    def wait(self) -> None:
        self.writer.wait()

    def close(self) -> None:
        self.writer.close()
