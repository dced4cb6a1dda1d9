"""The store Protocol and the in-process reference store.

Every store holds rows of ``[dim + state_of(optimizer, dim)]`` float32 per table. Reads of rows
that were never written return the deterministic lazy init (``embeddings.rowinit``). Updates
are applied by the store (single writer per shard): read current rows with their optimizer
state, apply the optimizer, write back.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from embeddings import rowkeys
from embeddings.errors import DimMismatchError, RowRangeError
from embeddings.optim import RowOptimizer, initial_state, state_of
from embeddings.rowinit import init_rows
from embeddings.tables import TableSet

if TYPE_CHECKING:
    from embeddings.store.row_cache import HeldRows

# table index -> [n] int64 ids
IdsByTable = dict[int, np.ndarray]


class EmbeddingStore(Protocol):
    tables: TableSet
    optimizer: RowOptimizer

    def pull(self, table: str, ids: np.ndarray) -> np.ndarray:
        """[n, dim] float32 weights of ``ids``."""
        ...

    def pull_many(self, requests: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def update(self, table: str, ids: np.ndarray, grads: np.ndarray | torch.Tensor) -> None:
        """Apply the optimizer to ``ids`` with ``grads`` [n, dim]; duplicate ids are summed."""
        ...

    def update_many(self, requests: Mapping[str, tuple[np.ndarray, np.ndarray | torch.Tensor]]) -> None: ...

    def read_rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        """[n, dim + state_width] float32: weights and optimizer state."""
        ...

    def write_rows(self, table: str, ids: np.ndarray, rows: np.ndarray) -> None:
        """Overwrite ``ids`` with ``rows`` [n, dim + state_width] (restore, tests)."""
        ...

    def close(self) -> None: ...


class StoreCounters(Protocol):
    """What a store counts of its own work, for a run's summary (every store keeps these; a store
    without held rows, write-behind or restores reports None and zeros)."""

    behind_wait_s: float  # the caller waiting at the commit point of a write-behind
    rows_written: int  # rows the training steps' writes put on the store (``apply_keys``)
    # after a shard was restored: reading held rows back (seconds), and the held rows that were
    # held again, known absent, read back
    reload_s: float
    reload_kept: int
    reload_absent: int
    reload_read: int

    def row_cache_stats(self) -> dict | None:
        """The rows the store's writer keeps in memory (``HeldRows.stats``); None: it keeps none."""
        ...


class StoreBase:
    """Validation, lazy init and the optimizer step, shared by every store.

    Subclasses implement ``_fetch`` (rows plus a mask of never-written rows) and ``_store``.
    """

    def __init__(self, tables: TableSet, optimizer: RowOptimizer, seed: int = 0) -> None:
        self.tables = tables
        self.optimizer = optimizer
        self.seed = seed

    # -- subclass hooks -------------------------------------------------------------------
    def _fetch(self, requests: IdsByTable) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """-> table index: ([n, width] float32 rows, [n] bool missing). Missing rows may hold anything."""
        raise NotImplementedError

    def _store(
        self,
        requests: dict[int, tuple[np.ndarray, np.ndarray]],
        step: int | None = None,
        undo: dict[int, np.ndarray] | None = None,
    ) -> None:
        """table index: (ids, [n, width] float32 rows) -> written.

        With ``step`` (from ``apply_keys``), the store also records that it applied ``step`` and
        keeps the rows' previous values (``undo``, table index -> [n, width]) for a rollback of that
        one step.
        """
        raise NotImplementedError

    # -- helpers ---------------------------------------------------------------------------
    def width(self, table_index: int) -> int:
        dim = self.tables.specs[table_index].dim
        return dim + state_of(self.optimizer, dim)

    def _ids(self, table: str, ids) -> tuple[int, np.ndarray]:
        t = self.tables.index(table)
        arr = np.asarray(ids.numpy() if isinstance(ids, torch.Tensor) else ids)
        if arr.ndim != 1:
            raise RowRangeError(f"table {table!r}: ids must be 1-d, got shape {tuple(arr.shape)}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise RowRangeError(f"table {table!r}: ids must be integers, got dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        num_rows = self.tables.specs[t].num_rows
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= num_rows:
                bad = lo if lo < 0 else hi
                raise RowRangeError(f"table {table!r}: row id {bad} out of range [0, {num_rows})")
        return t, arr

    def _block(self, table: str, t: int, n: int, block, width: int, what: str) -> np.ndarray:
        arr = block.detach().cpu().numpy() if isinstance(block, torch.Tensor) else np.asarray(block)
        if arr.ndim != 2 or arr.shape[1] != width:
            raise DimMismatchError(f"table {table!r}: {what} have shape {tuple(arr.shape)}, expected [n, {width}]")
        if arr.shape[0] != n:
            raise DimMismatchError(f"table {table!r}: {arr.shape[0]} {what} for {n} ids")
        return np.ascontiguousarray(arr, dtype=np.float32)

    def _fetch_filled(self, requests: IdsByTable) -> dict[int, np.ndarray]:
        out = {}
        for t, (rows, missing) in self._fetch(requests).items():
            if missing.any():
                spec = self.tables.specs[t]
                rows[missing, : spec.dim] = init_rows(self.seed, t, requests[t][missing], spec.dim, spec.scale)
                rows[missing, spec.dim :] = initial_state(self.optimizer)
            out[t] = rows
        return out

    # -- public API ------------------------------------------------------------------------
    def read_rows(self, table: str, ids) -> np.ndarray:
        t, arr = self._ids(table, ids)
        return self._fetch_filled({t: arr})[t]

    def pull(self, table: str, ids) -> np.ndarray:
        return self.pull_many({table: ids})[table]

    def pull_many(self, requests) -> dict[str, np.ndarray]:
        checked = dict(self._ids(name, ids) for name, ids in requests.items())
        rows = self._fetch_filled(checked)
        return {name: rows[self.tables.index(name)][:, : self.tables.spec(name).dim] for name in requests}

    def update(self, table: str, ids, grads, t: int | None = None) -> None:
        self.update_many({table: (ids, grads)}, t)

    def update_many(self, requests, t: int | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Apply the optimizer (``t``: its step, for ``Adam``); returns table -> (unique ids, new rows
        [n, dim + state]). (A training step's write, with its applied marker and undo record, is
        ``apply_keys(..., step)``.)"""
        uniq: IdsByTable = {}
        summed: dict[int, torch.Tensor] = {}
        for name, (ids, grads) in requests.items():
            t, arr = self._ids(name, ids)
            g = self._block(name, t, len(arr), grads, self.tables.specs[t].dim, "gradients")
            if len(arr) > 1 and bool(np.all(arr[1:] > arr[:-1])):  # already sorted and unique (aggregated)
                uniq[t], summed[t] = arr, torch.from_numpy(g)
                continue
            u, inverse = np.unique(arr, return_inverse=True)
            if len(u) != len(arr):
                acc = torch.zeros((len(u), g.shape[1]), dtype=torch.float32)
                acc.index_add_(0, torch.from_numpy(inverse.reshape(-1)), torch.from_numpy(g))
            else:  # already unique; keep the caller's order to avoid a gather
                u, acc = arr, torch.from_numpy(g)
            uniq[t], summed[t] = u, acc
        current = self._fetch_filled(uniq)
        new = {i: (uniq[i], self.optimizer.apply(torch.from_numpy(current[i]), summed[i], t).numpy()) for i in uniq}
        self._store(new)
        return {self.tables.specs[t].name: v for t, v in new.items()}

    # -- packed row keys (``embeddings.rowkeys``): a batch of every table in one array -------------
    def read_keys(self, keys: np.ndarray) -> np.ndarray:
        """Rows (weights and optimizer state) of sorted packed keys: [n, width] float32."""
        split = rowkeys.by_table(keys)
        rows = self._fetch_filled({t: ids for t, (ids,) in split.items()})
        width = self.width(int(keys[0] >> rowkeys.ROW_BITS)) if len(keys) else 0
        return np.concatenate([rows[t] for t in split]) if split else np.empty((0, width), np.float32)

    def pull_keys(self, keys: np.ndarray) -> np.ndarray:
        """[n, dim] float32 weights of sorted packed keys (one forward's rows of every table)."""
        rows = self.read_keys(keys)
        dim = self.tables.specs[int(keys[0] >> rowkeys.ROW_BITS)].dim if len(keys) else 0
        return rows[:, :dim]

    def apply_keys(
        self, keys: np.ndarray, grads: torch.Tensor, step: int | None = None, t: int | None = None
    ) -> np.ndarray:
        """The optimizer on sorted unique packed keys with ``grads`` [n, dim], in one pass over every
        table: -> the new rows [n, width], as written. With ``step``, the write also records that
        step as applied and keeps the rows' previous values for a rollback of that one step. ``t``:
        the optimizer step (1 on the first; ``step`` when not given: a run's steps count from 1), for
        ``Adam``'s bias correction."""
        current = self.read_keys(keys)
        t = step if t is None else t
        new = self.optimizer.apply(torch.from_numpy(current), grads, t).numpy()
        self._store_keys(keys, new, step=step, undo=current if step is not None else None)
        return new

    def _store_keys(self, keys, rows, step=None, undo=None) -> None:
        split = rowkeys.by_table(keys, rows, *(() if undo is None else (undo,)))
        self._store(
            {t: (v[0], v[1]) for t, v in split.items()},
            step=step,
            undo=None if undo is None else {t: v[2] for t, v in split.items()},
        )

    def write_rows(self, table: str, ids, rows) -> None:
        t, arr = self._ids(table, ids)
        block = self._block(table, t, len(arr), rows, self.width(t), "rows")
        self._store({t: (arr, block)})

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InProcessStore(StoreBase):
    """The plain reference: a dict of rows per table, in this process. Its ``StoreCounters``: no
    held rows, no write-behind, nothing restored; ``rows_written`` counts as ``RedisStore``'s does."""

    def __init__(self, tables: TableSet, optimizer: RowOptimizer, seed: int = 0) -> None:
        super().__init__(tables, optimizer, seed)
        self._rows: list[dict[int, np.ndarray]] = [{} for _ in tables]
        self.applied_step: int | None = None
        self.row_cache: HeldRows | None = None
        self.behind_wait_s = 0.0
        self.rows_written = 0
        self.reload_s = 0.0
        self.reload_kept = self.reload_absent = self.reload_read = 0

    def row_cache_stats(self) -> dict | None:
        return None if self.row_cache is None else self.row_cache.stats()

    def _fetch(self, requests):
        out = {}
        for t, ids in requests.items():
            rows = np.zeros((len(ids), self.width(t)), dtype=np.float32)
            missing = np.ones(len(ids), dtype=bool)
            held = self._rows[t]
            for i, r in enumerate(ids.tolist()):
                v = held.get(r)
                if v is not None:
                    rows[i] = v
                    missing[i] = False
            out[t] = (rows, missing)
        return out

    def _store_keys(self, keys, rows, step=None, undo=None) -> None:
        super()._store_keys(keys, rows, step=step, undo=undo)
        self.rows_written += len(keys)

    def _store(self, requests, step=None, undo=None):
        if step is not None:
            self.applied_step = step
        for t, (ids, rows) in requests.items():
            held = self._rows[t]
            for r, v in zip(ids.tolist(), rows):
                held[r] = v.copy()
