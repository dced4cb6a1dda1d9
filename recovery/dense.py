"""Per-step dense state, saved off the training path, for trainer restarts.

After each step rank 0 copies the dense model and optimizer state (the copy is the snapshot
point: every tensor of a dtype is copied into one flat tensor, ``pack``) and a thread writes it to
``dense_latest.pt`` (temp file, fsync, rename; the temp file is written while the step's rows are
still on their way, and renamed once they are on the shards). The next step's rows move only once it is written: a synchronous write waits for it first
(``written()`` on the training thread), a write-behind on its own thread, so that the training
thread never waits for the file. On a restart the dense state is at step d and every shard is at
d or d + 1 (the latter rolled back by its undo record). Saves are written in the order they were
handed over; the next one does not wait for the one before.
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


_TENSOR = "__tensor__"  # a packed tensor's place in the layout: (_TENSOR, dtype name, offset, shape)


def pack(obj) -> dict:
    """A copy of a (nested) state: the tensors of each dtype copied into one flat tensor, and the
    state's layout with each tensor replaced by its place there. One copy and one tensor to write
    per dtype, where a state of many small tensors costs ``torch.save`` a record per tensor."""
    parts: dict[str, list[torch.Tensor]] = {}
    sizes: dict[str, int] = {}

    def walk(o):
        if isinstance(o, torch.Tensor):
            name = str(o.dtype).removeprefix("torch.")
            at = sizes.get(name, 0)
            parts.setdefault(name, []).append(o.detach().reshape(-1))
            sizes[name] = at + o.numel()
            return (_TENSOR, name, at, tuple(o.shape))
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        return o

    layout = walk(obj)
    return {"layout": layout, "flat": {name: torch.cat(ts) for name, ts in parts.items()}}


def unpack(packed: dict):
    """The state ``pack`` copied: each tensor a view of its flat tensor."""
    flat = packed["flat"]

    def walk(o):
        if isinstance(o, tuple) and len(o) == 4 and o[0] == _TENSOR:
            _, name, at, shape = o
            n = 1
            for d in shape:
                n *= d
            return flat[name][at : at + n].view(shape)
        if isinstance(o, dict):
            return {k: walk(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return type(o)(walk(v) for v in o)
        return o

    return walk(packed["layout"])


class DenseSaver:
    def __init__(self, directory: str | os.PathLike, namespace: str, writer: bool = True) -> None:
        self.writer = writer  # rank 0 writes; every trainer reads it back after a restart
        self.path = Path(directory) / "dense_latest.pt"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        # one long-lived thread: starting a thread per step waits for it to be scheduled (~2 ms a
        # step on 2 busy cores)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dense-save")
        self._pending: list[Future] = []  # saves handed over and maybe not written yet, in order
        self._error: BaseException | None = None
        self._last: tuple[int, Callable[[], bool] | None] | None = None  # the last save's step and gate
        self.num_saves = 0
        self.seconds = 0.0

    def save(self, step: int, state: Callable[[], dict], gate: Callable[[], bool] | None = None) -> None:
        """``state()`` is called only here, on the writer: trainers that do not save pay nothing.
        ``gate``: called on the save thread before writing; False skips this save (``refused``), so
        the file never holds a step whose sparse write failed (a write-behind's). Does not wait for
        the saves before it (an error of one is raised here)."""
        self._raise()
        self._pending = [f for f in self._pending if not f.done()]
        self._last = (step, gate)
        if not self.writer:
            return
        snapshot = {"namespace": self.namespace, "step": step, "packed": pack(state())}
        self._pending.append(self._pool.submit(self._write, snapshot, gate))

    def refused(self, step: int) -> bool:
        """Whether the save of ``step`` (the last one) was refused by its gate: its step's
        write-behind failed on a shard. Asked once that write-behind was joined, so the gate's
        answer is known here at once; does not wait for the file."""
        if self._last is None or self._last[0] != step or self._last[1] is None:
            return False
        return not self._last[1]()

    def written(self) -> Callable[[], None]:
        """A wait, for any thread, until the saves handed over so far are written (raises what a
        write raised): what a step's rows wait for before they move."""
        pending = list(self._pending)

        def wait() -> None:
            for f in pending:
                f.result()
            if self._error is not None:
                raise self._error

        return wait

    def _write(self, snapshot: dict, gate: Callable[[], bool] | None = None) -> None:
        t0 = time.perf_counter()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:  # written while the step's rows may still be on their way
                torch.save(snapshot, f)
                f.flush()
                os.fsync(f.fileno())
            if gate is not None and not gate():  # they did not all reach their shards: not this step
                tmp.unlink(missing_ok=True)
                return
            os.replace(tmp, self.path)
            self.num_saves += 1
        except BaseException as e:  # noqa: BLE001 - surfaced by wait()
            self._error = e
        self.seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """Until every save handed over is written; raises what a write raised."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def load(self) -> dict | None:
        """The saved state of this run (same namespace), or None."""
        if not self.path.exists():
            return None
        state = torch.load(self.path, weights_only=True)
        if state.get("namespace") != self.namespace:
            return None
        if "packed" in state:
            state = {"namespace": state["namespace"], "step": state["step"], **unpack(state.pop("packed"))}
        return state


class NoDenseSaver:
    """Trainer restarts off: saves nothing, restores nothing."""

    num_saves = 0
    seconds = 0.0

    def save(self, step: int, state: Callable[[], dict], gate=None) -> None:
        pass

    def refused(self, step: int) -> bool:
        return False

    def written(self) -> None:
        return None

    def wait(self) -> None:
        pass

    def load(self) -> dict | None:
        return None
