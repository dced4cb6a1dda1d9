"""Batches for torchrec: slicing the global batch per rank and a resumable reader.

A *source* is anything with ``read(start, count) -> Samples``-like arrays (``dense`` [n, 13]
float32, ``sparse`` [n, 26] int64, ``labels`` [n]) and ``num_rows`` (``None`` = endless):
``SyntheticSource`` or ``BinarySource`` (a row range of preprocessed Criteo files).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.criteo import SPARSE_NAMES, BinaryCriteo
from data.errors import DataError
from data.hashing import hash_uniform

READ_AHEAD = 2  # batches a lone reader (one trainer, one chunk) reads, with their keys, ahead of the step:
# a batch the read-ahead thread was late with (its core lent to the servers) is made up over two steps,
# not waited for (1.07x against one batch ahead, 6 alternating rounds). A reader of one of several
# trainers' slices reads one ahead: at 2 trainers two read 1.05, 0.78, 0.91 of one (docs/benchmarks.md)
READ_AHEAD_NICE = 10
"""The read-ahead thread runs this much nicer than the training thread beside it while its work (the
next batch, its unique row keys) is done before the step that needs it: at the same priority it took
the training thread's core and the interpreter from it (preprocessed data: one trainer 1.10x, two
1.11x; docs/benchmarks.md)."""
LATE_STEPS, LATE_S = 3, 0.001
"""Reads in a row that a step waited for longer than this (multi-hot bags, samples made on the fly):
the read-ahead's work is the step's bottleneck, and from then on it runs at the trainer's priority."""


def _nicer() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), READ_AHEAD_NICE)
    except (AttributeError, OSError):  # no per-thread priority here: the read-ahead runs as it did
        pass


class ReadAheadPool:
    """The one thread that reads batches ahead, shared by a trainer's readers: ``READ_AHEAD_NICE``
    nicer than the training thread until steps wait for it (``LATE_STEPS``), then a thread at the
    trainer's priority for the rest of the run (no thread may be made less nice again without
    privilege: the nicer one ends after its reads in flight)."""

    def __init__(self) -> None:
        self.nice, self._late = READ_AHEAD_NICE, 0
        self._pool = self._new()

    def _new(self) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(1, thread_name_prefix="read-ahead", initializer=_nicer if self.nice else None)

    def submit(self, fn, *args) -> Future:
        return self._pool.submit(fn, *args)

    def waited(self, seconds: float) -> None:
        """A step waited ``seconds`` for its batch."""
        if not self.nice:
            return
        self._late = self._late + 1 if seconds > LATE_S else 0
        if self._late >= LATE_STEPS:
            self._pool.shutdown(wait=True)  # the other readers' reads in flight end on it
            self.nice = 0
            self._pool = self._new()

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        self._pool.shutdown(wait=wait, cancel_futures=cancel_futures)


class Source(Protocol):
    num_rows: int | None

    def read(self, start: int, count: int): ...


@dataclass
class Arrays:
    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    bags: list[np.ndarray] | None = None
    """Multi-hot: per feature, [n, ids per bag] (``MultiHot``); None: one id per feature (``sparse``)."""


class MultiHot:
    """A source's one id per feature made into bags of ``sizes[t]`` ids, as MLPerf DLRM-v2 makes
    Criteo multi-hot: the bag of feature t holds the sample's id, then ``sizes[t] - 1`` ids drawn by
    a hash of (feature, id, position) over the table's ``rows[t]`` rows. A pure function of the id,
    so a hot id brings a hot bag, and every trainer and resume sees the same bags."""

    def __init__(self, source: Source, sizes: Sequence[int], rows: Sequence[int]) -> None:
        if len(sizes) != len(rows) or any(k < 1 for k in sizes):
            raise ValueError(f"multi-hot sizes {list(sizes)}: one per table (of {len(rows)}), each >= 1")
        self.source, self.sizes, self.rows = source, list(sizes), list(rows)
        self.num_rows = source.num_rows

    def read(self, start: int, count: int) -> Arrays:
        a = self.source.read(start, count)
        bags = []
        for t, (k, n) in enumerate(zip(self.sizes, self.rows, strict=True)):
            ids = a.sparse[:, t].astype(np.int64)
            if k == 1:
                bags.append(ids[:, None])
                continue
            extra = (hash_uniform(40_009 + t, ids, k - 1).astype(np.float64) * n).astype(np.int64)
            bags.append(np.concatenate([ids[:, None], np.minimum(extra, n - 1)], axis=1))
        return Arrays(dense=a.dense, sparse=a.sparse, labels=a.labels, bags=bags)


class BinarySource:
    """Rows ``[lo, hi)`` of a preprocessed Criteo file set; categorical values mod each table's rows."""

    def __init__(self, data: BinaryCriteo, rows_per_table: Sequence[int], lo: int = 0, hi: int | None = None):
        hi = len(data) if hi is None else hi
        if not 0 <= lo <= hi <= len(data):
            raise ValueError(f"row range [{lo}, {hi}) outside [0, {len(data)})")
        if len(rows_per_table) != data.sparse.shape[1]:
            raise ValueError(f"rows_per_table has {len(rows_per_table)} entries, expected {data.sparse.shape[1]}")
        self.data = data
        self.mod = np.asarray(rows_per_table, dtype=np.int64)
        self.lo = lo
        self.num_rows: int | None = hi - lo

    def read(self, start: int, count: int) -> Arrays:
        assert self.num_rows is not None
        if start < 0 or start + count > self.num_rows:
            raise ValueError(f"read [{start}, {start + count}) outside [0, {self.num_rows})")
        a, b = self.lo + start, self.lo + start + count
        return Arrays(
            dense=np.array(self.data.dense[a:b]),  # copy out of the read-only map
            sparse=self.data.sparse[a:b] % self.mod,
            labels=np.array(self.data.labels[a:b]).reshape(-1),
        )


def rank_slice(global_batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the global batch that ``rank`` trains on."""
    if world_size <= 0 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world of size {world_size}")
    if global_batch_size <= 0 or global_batch_size % world_size:
        raise ValueError(f"global batch size {global_batch_size} is not a positive multiple of world size {world_size}")
    per = global_batch_size // world_size
    return rank * per, (rank + 1) * per


def make_batch(
    dense: np.ndarray,
    sparse: np.ndarray,
    labels: np.ndarray,
    keys: Sequence[str] = SPARSE_NAMES,
    bags: list[np.ndarray] | None = None,
) -> Batch:
    """Arrays -> torchrec ``Batch``; one id per sample and feature (Criteo), keys in ``keys`` order,
    or with ``bags`` (multi-hot) each feature's bags of ids."""
    n, f = sparse.shape
    if len(keys) != f:
        raise ValueError(f"{len(keys)} feature keys for {f} sparse columns")
    if bags is None:
        values = torch.from_numpy(np.ascontiguousarray(sparse.T).reshape(-1))  # key-major
        lengths = torch.ones(n * f, dtype=torch.int32)
    else:
        values = torch.from_numpy(np.concatenate([b.reshape(-1) for b in bags]))
        lengths = torch.from_numpy(np.concatenate([np.full(n, b.shape[1], np.int32) for b in bags]))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=list(keys), values=values, lengths=lengths)
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=kjt,
        labels=torch.from_numpy(np.asarray(labels, dtype=np.float32)),
    )


class BatchReader:
    """Reads global batches from a source and hands this rank its slice, with a saveable position.

    The position is the next global row; ``state_dict()``/``load_state_dict()`` save and restore it
    exactly: reading k batches, saving, reading m more yields the same m batches as restoring the
    saved state in a fresh reader and reading m. A finite source ends after its last full batch
    (``epochs`` > 1 wraps around).

    ``read_ahead``: one background thread reads the batches after the one just handed out while the
    caller trains on it (numpy's generators and hashing release the GIL): ``READ_AHEAD`` of them for a
    reader of the whole batch (``world_size`` 1), one for a slice. Only one read runs at a time, so a
    source is never read from two threads at once; the position counts only the batches handed out,
    and a ``load_state_dict`` to a position other than the oldest read ahead drops them all.
    ``prepare(batch)``: called on the read-ahead thread after each read (work on the batch that need
    not wait for the step, e.g. its unique row keys); an error in it is ignored there, so that the
    step that needs the work does it again and raises in its own thread.
    """

    def __init__(
        self,
        source: Source,
        global_batch_size: int,
        *,
        world_size: int = 1,
        rank: int = 0,
        epochs: int = 1,
        read_ahead: bool = False,
        prepare: Callable[[Batch], object] | None = None,
        pool: ReadAheadPool | ThreadPoolExecutor | None = None,
    ):
        self.lo, self.hi = rank_slice(global_batch_size, world_size, rank)
        self.source = source
        self.global_batch_size = global_batch_size
        self.epochs = epochs
        self.position = 0  # global rows consumed, across epochs
        if source.num_rows is not None and source.num_rows < global_batch_size:
            raise DataError(f"source has {source.num_rows} rows, fewer than one global batch of {global_batch_size}")
        # ``pool``: a read-ahead thread shared with other readers of the same source (its owner closes it)
        self._owns_pool = pool is None
        self._pool = pool if pool is not None else ReadAheadPool() if read_ahead else None
        # batches read ahead, oldest first: (position, its batch or None past the end)
        self._ahead: list[tuple[int, Future]] = []
        self._depth = READ_AHEAD if world_size == 1 else 1
        self.prepare = prepare

    @property
    def batches_per_epoch(self) -> int | None:
        n = self.source.num_rows
        return None if n is None else n // self.global_batch_size

    def __iter__(self):
        return self

    def _read(self, position: int) -> Batch | None:
        """The batch at global row ``position``; None past the last epoch."""
        g = self.global_batch_size
        step = position // g
        per_epoch = self.batches_per_epoch
        if per_epoch is not None:
            if step >= per_epoch * self.epochs:
                return None
            start = (step % per_epoch) * g
        else:
            start = position
        arr = self.source.read(start + self.lo, self.hi - self.lo)
        return make_batch(arr.dense, arr.sparse, arr.labels, bags=arr.bags)

    def _take_ahead(self, position: int) -> Batch | None | bool:
        """The oldest batch read ahead, waited for, if it is for ``position``; else False, every batch
        read ahead dropped (the read in flight waited out)."""
        if not self._ahead:
            return False
        if self._ahead[0][0] != position:  # a stale read's error is not this step's
            self._drop_ahead()
            return False
        _, fut = self._ahead.pop(0)
        t0 = time.perf_counter()
        batch = fut.result()  # a read error surfaces here, in the caller's thread
        if isinstance(self._pool, ReadAheadPool):
            self._pool.waited(time.perf_counter() - t0)
        return batch

    def _drop_ahead(self) -> None:
        """Forget every batch read ahead: those not begun are cancelled, the one in flight waited out
        (one read at a time)."""
        ahead, self._ahead = self._ahead, []
        running = [fut for _, fut in reversed(ahead) if not fut.cancel()]  # the newest first: none starts
        for fut in running:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - a stale read's error: its batch is read again if wanted
                pass

    def _top_up(self) -> None:
        """Keep ``READ_AHEAD`` batches (one reader of several: one) read ahead of ``position``, in order."""
        if self._pool is None:
            return
        g = self.global_batch_size
        while len(self._ahead) < self._depth:  # in order: a rewind keeps them only from ``position`` on
            at = self.position + g * len(self._ahead)
            self._ahead.append((at, self._pool.submit(self._read_prepared, at)))

    def __next__(self) -> Batch:
        batch = self._take_ahead(self.position)
        if batch is False:
            batch = self._read(self.position)
        if batch is None:
            raise StopIteration
        self.position += self.global_batch_size
        self._top_up()
        return batch

    def read_ahead(self) -> None:
        """Start reading the batch at the current position now, on the read-ahead thread (a
        ``load_state_dict`` set it: a resumed trainer's first batch is read while it resumes);
        ``next`` takes it."""
        if self._pool is not None and not self._ahead:
            self._ahead.append((self.position, self._pool.submit(self._read_prepared, self.position)))

    def _read_prepared(self, position: int) -> Batch | None:
        batch = self._read(position)
        if batch is not None and self.prepare is not None:
            try:
                self.prepare(batch)
            except Exception:  # noqa: BLE001 - done again, and raised, by the step that needs it
                pass
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["global_batch_size"] != self.global_batch_size:
            raise DataError(
                f"reader state was saved with global batch size {state['global_batch_size']}, "
                f"this reader uses {self.global_batch_size}"
            )
        self.position = int(state["position"])
        if self._ahead and self._ahead[0][0] != self.position:
            self._drop_ahead()  # the stale reads waited out (one read at a time), then dropped

    def close(self) -> None:
        """Stop the read-ahead thread (after its read in flight)."""
        if self._pool is not None:
            if self._owns_pool:
                self._pool.shutdown(wait=True, cancel_futures=True)
            else:
                self._drop_ahead()
            self._pool = None
            self._ahead = []


class ChunkReader:
    """A trainer's chunks of each global batch: one ``BatchReader`` per chunk (``chunks`` of
    ``num_chunks``), read in step; ``next`` -> the chunks' batches, in chunk order. The position and
    its state are one ``BatchReader``'s (every chunk's reader is at the same global row). With
    ``read_ahead`` the chunks' readers share one thread: the source is read by one thread at a time."""

    def __init__(self, source: Source, global_batch_size: int, chunks: Sequence[int], num_chunks: int, **kw) -> None:
        if not chunks:
            raise ValueError("ChunkReader needs at least one chunk")
        self.chunks = list(chunks)
        self._pool = ReadAheadPool() if kw.pop("read_ahead", False) else None
        self.readers = [
            BatchReader(source, global_batch_size, world_size=num_chunks, rank=c, pool=self._pool, **kw) for c in chunks
        ]

    def __iter__(self):
        return self

    def __next__(self) -> list[Batch]:
        return [next(r) for r in self.readers]

    @property
    def position(self) -> int:
        return self.readers[0].position

    def state_dict(self) -> dict[str, int]:
        return self.readers[0].state_dict()

    def read_ahead(self) -> None:
        for r in self.readers:
            r.read_ahead()

    def load_state_dict(self, state: dict[str, int]) -> None:
        for r in self.readers:
            r.load_state_dict(state)

    def close(self) -> None:
        for r in self.readers:
            r.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class ConcatSource:
    """Several finite sources read as one (e.g. Terabyte days 0-22)."""

    def __init__(self, sources: Sequence[Source]) -> None:
        if not sources or any(s.num_rows is None for s in sources):
            raise ValueError("ConcatSource needs one or more finite sources")
        self.sources = list(sources)
        self.bounds = np.cumsum([0] + [s.num_rows for s in sources])  # type: ignore[misc]
        self.num_rows: int | None = int(self.bounds[-1])

    def read(self, start: int, count: int) -> Arrays:
        parts = []
        pos, end = start, start + count
        while pos < end:
            i = int(np.searchsorted(self.bounds, pos, side="right")) - 1
            take = min(end, int(self.bounds[i + 1])) - pos
            parts.append(self.sources[i].read(pos - int(self.bounds[i]), take))
            pos += take
        return Arrays(*(np.concatenate([getattr(p, k) for p in parts]) for k in ("dense", "sparse", "labels")))
