"""Per-step dense state, saved off the training path, for trainer restarts.

After each step rank 0 copies the dense model and optimizer state (the copy is the snapshot
point: tensors are cloned) and a thread writes it to ``dense_latest.pt`` (temp file, fsync,
rename). ``wait()`` is called before the next step writes any shard, so on a restart the dense
state is at step d and every shard is at d or d + 1 (the latter rolled back by its undo record).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch


def clone_state(obj):
    """A copy of a (nested) state dict's tensors, detached from training."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj


class DenseSaver:
    def __init__(self, directory: str | os.PathLike, namespace: str, writer: bool = True) -> None:
        self.writer = writer  # rank 0 writes; every trainer reads it back after a restart
        self.path = Path(directory) / "dense_latest.pt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        # one long-lived thread: starting a thread per step waits for it to be scheduled (~2 ms a
        # step on 2 busy cores)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-save")
        self._pending: Future | None = None
        self._error: BaseException | None = None
        self.num_saves = 0
        self.seconds = 0.0
        self.skipped: int | None = None  # the step whose save its gate refused (its rows did not reach a shard)

    def save(self, step: int, state: Callable[[], dict], gate: Callable[[], bool] | None = None) -> None:
        """``state()`` is called only here, on the writer: trainers that do not save pay nothing.
        ``gate``: called on the save thread before writing; False skips this save (``skipped``), so
        the file never holds a step whose sparse write failed (a write-behind's)."""
        self.wait()
        self.skipped = None
        if not self.writer:
            return
        snapshot = {"namespace": self.namespace, "step": step, **clone_state(state())}
        self._pending = self._pool.submit(self._write, snapshot, gate)

    def _write(self, snapshot: dict, gate: Callable[[], bool] | None = None) -> None:
        t0 = time.perf_counter()
        try:
            if gate is not None and not gate():
                self.skipped = snapshot["step"]
                return
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "wb") as f:
                torch.save(snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self.num_saves += 1
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e
        self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def load(self) -> dict | None:
        """The saved state of this run (same namespace), or None."""
        if not self.path.exists():
            return None
        state = torch.load(self.path, weights_only=True)
        return state if state.get("namespace") == self.namespace else None


class NoDenseSaver:
    """Trainer restarts off: saves nothing, restores nothing."""

    num_saves = 0
    seconds = 0.0
    skipped = None

    def save(self, step: int, state: Callable[[], dict], gate=None) -> None:
        pass

    def wait(self) -> None:
        pass

    def load(self) -> dict | None:
        return None
