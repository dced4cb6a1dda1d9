"""One packing of (table index, row id) into one int64 key, for numpy arrays and torch tensors.

A row id fits in ``ROW_BITS`` bits (10^12 rows per table); the table index sits above it. Keys sort
by table, then row, so a sorted key array groups each table's rows together.
"""

from __future__ import annotations

import numpy as np

ROW_BITS = 40
ROW_MASK = (1 << ROW_BITS) - 1


def pack(table: int, ids):
    """Keys of rows ``ids`` (numpy int array or torch int64 tensor) of table ``table``."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False) | (int(table) << ROW_BITS)
    return ids | (int(table) << ROW_BITS)


def unpack(keys):
    """-> (table indices, row ids), each the type of ``keys``."""
    return keys >> ROW_BITS, keys & ROW_MASK


def table_slices(keys: np.ndarray) -> list[tuple[int, int, int]]:
    """(table, lo, hi) of each table present in sorted ``keys``: ``keys[lo:hi]`` are that table's."""
    if not len(keys):
        return []
    tables = keys >> ROW_BITS
    first, last = int(tables[0]), int(tables[-1])
    if first == last:
        return [(first, 0, len(keys))]
    bounds = np.searchsorted(tables, np.arange(first, last + 2), side="left")
    return [(first + i, int(lo), int(hi)) for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])) if hi > lo]


def table_groups(keys: np.ndarray) -> dict[int, tuple[np.ndarray, int, int]]:
    """Sorted ``keys`` per table: table -> (row ids, lo, hi), ``keys[lo:hi]`` being that table's."""
    ids = keys & ROW_MASK
    return {t: (ids[lo:hi], lo, hi) for t, lo, hi in table_slices(keys)}


def by_table(keys: np.ndarray, *columns) -> dict[int, tuple]:
    """Sorted ``keys`` (and row-aligned ``columns``) cut per table: table -> (ids, *column slices)."""
    return {t: (ids, *(c[lo:hi] for c in columns)) for t, (ids, lo, hi) in table_groups(keys).items()}


def from_tables(ids_by_table: dict[int, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Table -> ids as one key array: -> (keys, order), ``keys`` sorted and ``order`` the position of
    each key in the concatenation of the tables' ids (tables in ascending order)."""
    parts = [pack(t, np.asarray(ids, np.int64)) for t, ids in sorted(ids_by_table.items())]
    keys = np.concatenate(parts) if parts else np.empty(0, np.int64)
    order = np.argsort(keys, kind="stable")
    return keys[order], order
