"""Per-step dense state, saved off the training path, for trainer restarts.

After each step rank 0 copies the dense model and optimizer state (the copy is the snapshot
point: every tensor of a dtype is copied into one flat tensor, ``pack``) and a thread writes it to
a temp file of its step (fsync), while the step's rows may still be on their way to the shards.
Once they are all there, the thread that moves the next step's rows first renames it to
``dense_latest.pt`` (``committer``): the write-behind thread, or the training thread before a
synchronous write; the training thread never waits for the file. On a restart the dense state is
at step d and every shard is at d or d + 1 (the latter rolled back by its undo record).

The file is ``magic "RDS1" | crc32c u32 | length u64`` and the ``torch.save`` bytes: a file whose
checksum or length does not match raises ``CorruptCheckpointError`` on load, and the trainer
resumes from the newest verified checkpoint instead (``Trainer.resume``).
"""

from __future__ import annotations

import io
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import crc32c
import torch

from recovery.durable.files import name_path
from recovery.durable.layout import dense_latest
from recovery.errors import CorruptCheckpointError

MAGIC = b"RDS1"
_HEADER = struct.Struct("<4sIQ")


def _map(obj, leaf: Callable[[object], bool], fn: Callable):
    """``obj`` (nested dicts, lists and tuples) with each ``leaf`` replaced by ``fn(leaf)``."""
    if leaf(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map(v, leaf, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(v, leaf, fn) for v in obj)
    return obj


def _is_tensor(obj) -> bool:
    return isinstance(obj, torch.Tensor)


def clone_state(obj):
    """A copy of a (nested) state dict's tensors, detached from training."""
    return _map(obj, _is_tensor, lambda t: t.detach().clone())


_TENSOR = "__tensor__"  # a packed tensor's place in the layout: (_TENSOR, dtype name, offset, shape)


def layout_of(obj) -> tuple[object, dict[str, list[torch.Tensor]]]:
    """``obj`` (a nested state) with each tensor replaced by its place in its dtype's flat tensor,
    and the tensors of each dtype in that order."""
    parts: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def place(t: torch.Tensor) -> tuple:
        name = str(t.dtype).removeprefix("torch.")
        at = sizes.get(name, 0)
        parts.setdefault(name, []).append(t.detach())  # a copy of values, never of autograd
        sizes[name] = at + t.numel()
        return (_TENSOR, name, at, tuple(t.shape))

    return _map(obj, _is_tensor, place), parts


def flatten(parts: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A copy of each dtype's tensors (detached, from ``layout_of``) as one flat tensor (the snapshot
    point)."""
    return {
        name: torch.cat(ts if all(t.dim() == 1 for t in ts) else [t.reshape(-1) for t in ts])
        for name, ts in parts.items()
    }


def flat_views(parts: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    """``parts`` with each contiguous tensor as a flat view of itself (later in-place updates show
    through): ``flatten`` of them is then one call per dtype."""
    return {name: [t.view(-1) if t.is_contiguous() else t for t in ts] for name, ts in parts.items()}


def pack(obj) -> dict:
    """A copy of a (nested) state: the tensors of each dtype copied into one flat tensor, and the
    state's layout with each tensor replaced by its place there. One copy and one tensor to write
    per dtype, where a state of many small tensors costs ``torch.save`` a record per tensor."""
    layout, parts = layout_of(obj)
    return {"layout": layout, "flat": flatten(parts)}


def unpack(packed: dict):
    """The state ``pack`` copied: each tensor a view of its flat tensor."""
    flat = packed["flat"]

    def placed(o) -> bool:
        return isinstance(o, tuple) and len(o) == 4 and o[0] == _TENSOR

    def view(o: tuple) -> torch.Tensor:
        _, name, at, shape = o
        return flat[name][at : at + math.prod(shape)].view(shape)

    return _map(packed["layout"], placed, view)


class DenseSaver:
    def __init__(self, directory: str | os.PathLike, namespace: str, writer: bool = True) -> None:
        self.writer = writer  # rank 0 writes; every trainer reads it back after a restart
        self.path = dense_latest(directory)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        if writer:  # what a killed writer left half-way: never the state of any step
            for stale in self.path.parent.glob(self.path.name + ".*.tmp"):
                stale.unlink(missing_ok=True)
        # one long-lived thread: starting a thread per step waits for it to be scheduled (~2 ms a
        # step on 2 busy cores)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-save")
        self._saved: dict[int, Future] = {}  # step -> the write of its temp file, not committed yet
        self._lock = threading.Lock()  # ``_saved``: saves on the training thread, commits on another
        self._error: BaseException | None = None
        self.num_saves = 0
        self.seconds = 0.0
        self._memo: tuple | None = None  # (the dense state's items, its layout, its tensors per dtype)

    def _tmp(self, step: int) -> Path:
        return self.path.with_name(f"{self.path.name}.{step}.tmp")

    def save(self, step: int, state: Callable[[], dict]) -> None:
        """Copy the state of ``step`` now (``state()`` is called only here, on the writer: trainers
        that do not save pay nothing) and write it to a temp file of its own on the save thread,
        without waiting for the saves before it (an error of one is raised here). It becomes the
        dense state only when ``committed``: once every row of ``step`` is on its shard."""
        self._raise()
        if not self.writer:
            return
        state = state()
        rest = {k: v for k, v in state.items() if k != "dense"}
        snapshot = {"namespace": self.namespace, "step": step, "packed": pack(rest)}
        if "dense" in state:
            snapshot["dense_packed"] = self._pack_dense(state["dense"])
        with self._lock:
            self._saved[step] = self._pool.submit(self._write, snapshot, self._tmp(step))

    def _pack_dense(self, dense: dict) -> dict:
        """``pack(dense)``. Its layout is walked again only when the dicts in ``dense`` are not the ones
        of the last call: the trainer hands the same live model and optimizer state each step until
        the optimizer gains state or loads one, so a step's copy is one ``cat`` per dtype (walking
        the layout on the training thread cost about as much again, and more on a busy host)."""
        refs = tuple(dense.items())
        memo = self._memo
        if (
            memo is None
            or len(memo[0]) != len(refs)
            or any(a[0] != b[0] or a[1] is not b[1] for a, b in zip(memo[0], refs))
        ):
            layout, parts = layout_of(dense)
            memo = self._memo = (refs, layout, flat_views(parts))
        return {"layout": memo[1], "flat": flatten(memo[2])}

    def committer(self, step: int) -> Callable[[], None] | None:
        """Every row of ``step`` is on its shard: a call, for the thread that moves the next step's
        rows and before it moves them, that waits for the save of ``step`` to be written and makes
        it the dense state (a rename), dropping older saves never committed (their steps' rows did
        not all reach their shards, or a rollback passed them). None: no save of ``step`` (not the
        writer, or a rollback went back past it)."""
        with self._lock:
            future = self._saved.get(step)
        if future is None:
            return None

        def commit() -> None:
            future.result()
            if self._error is not None:
                raise self._error
            with self._lock:
                if self._saved.get(step) is not future:  # committed already (a redone write's commit)
                    return
                older = [s for s in self._saved if s <= step]
                for s in older:
                    del self._saved[s]
            os.replace(self._tmp(step), self.path)
            self.num_saves += 1
            for s in older:
                if s != step:
                    self._tmp(s).unlink(missing_ok=True)

        return commit

    def _write(self, snapshot: dict, tmp: Path) -> None:
        t0 = time.perf_counter()
        try:
            # serialized in memory, then one write: ``torch.save`` into a file writes record by record
            # through Python (about 2 ms a step, holding the GIL, against 0.2 ms into memory)
            data = to_bytes(snapshot)
            with open(tmp, "wb") as f:  # written while the step's rows may still be on their way
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as e:  # noqa: BLE001 - surfaced by the next save, commit or wait
            self._error = name_path(e, tmp) if isinstance(e, OSError) else e  # ENOSPC names no file
        self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Until every save handed over is written (committed or not); raises what a write raised."""
        with self._lock:
            pending = list(self._saved.values())
        for f in pending:
            f.result()
        self._raise()

    def discard(self) -> None:
        """Drop the saves never committed (the run ends): their temp files go."""
        self.wait()
        with self._lock:
            steps, self._saved = list(self._saved), {}
        for s in steps:
            self._tmp(s).unlink(missing_ok=True)

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def identity(self) -> tuple | None:
        """The saved state's file as it is now (inode, size, modification time: a save replaces it
        whole, by a rename), None where there is none."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def load(self) -> dict | None:
        """The saved state of this run (same namespace), or None."""
        if not self.path.exists():
            return None
        return from_bytes(self.path.read_bytes(), self.namespace, str(self.path))

    def close(self) -> None:
        """The save thread ends (after the writes handed to it)."""
        self._pool.shutdown(wait=True)

    def snapshot(self, step: int, state: dict) -> dict:
        """What ``save`` writes of ``state`` (the state of ``step``), copied now."""
        rest = {k: v for k, v in state.items() if k != "dense"}
        snap = {"namespace": self.namespace, "step": step, "packed": pack(rest)}
        if "dense" in state:
            snap["dense_packed"] = pack(state["dense"])
        return snap


def to_bytes(snapshot: dict) -> memoryview:
    """A saved state as its file's bytes: header (magic, CRC-32C, length), then ``torch.save``'s."""
    buf = io.BytesIO()
    buf.write(bytes(_HEADER.size))
    torch.save(snapshot, buf)
    data = buf.getbuffer()
    payload = data[_HEADER.size :]
    _HEADER.pack_into(data, 0, MAGIC, crc32c.crc32c(payload), len(payload))
    del payload
    return data


def from_bytes(data: bytes, namespace: str, where: str) -> dict | None:
    """The state in a dense state's bytes (a file's, or a peer's: ``recsys.regroup``); None when it
    is another namespace's. ``CorruptCheckpointError`` (naming ``where``) when they fail the check."""
    magic, crc, length = _HEADER.unpack_from(data) if len(data) >= _HEADER.size else (b"", 0, -1)
    payload = memoryview(data)[_HEADER.size :]
    if magic != MAGIC or length != len(payload) or crc32c.crc32c(payload) != crc:
        raise CorruptCheckpointError(f"{where} fails its checksum (damaged or cut short)")
    state = torch.load(io.BytesIO(payload), weights_only=True)
    if state.get("namespace") != namespace:
        return None
    if "packed" in state:
        dense = state.pop("dense_packed", None)
        state = {"namespace": state["namespace"], "step": state["step"], **unpack(state.pop("packed"))}
        if dense is not None:
            state["dense"] = unpack(dense)
    return state


class NoDenseSaver:
    """Trainer restarts off: saves nothing, restores nothing."""

    num_saves = 0
    seconds = 0.0

    def save(self, step: int, state: Callable[[], dict]) -> None:
        pass

    def committer(self, step: int) -> None:
        return None

    def discard(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass

    def load(self) -> dict | None:
        return None

    def identity(self) -> None:
        return None
