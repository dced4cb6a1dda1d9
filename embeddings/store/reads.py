"""The store's row reads: rows of shards away (``--train-through``) from their outage's rows, rows
this trainer holds by one gather, rows known never written by the lazy init, and the rest read
from their shards in parallel (one thread per shard). One ``RowReads`` per ``RedisStore``
(``store.reads``)."""

from __future__ import annotations

import contextlib

import numpy as np

from embeddings import rowkeys
from embeddings.optim import initial_state
from embeddings.rowinit import init_rows_keys
from embeddings.store.base import IdsByTable, StoreBase


class RowReads:
    def __init__(self, store) -> None:
        self.store = store
        self.links = store.links
        self._last_held_read: tuple[int, np.ndarray, np.ndarray] | None = None  # (held version, keys, rows)
        self._from_redis = 0  # > 0: reads skip held rows (evaluation, digest: what the tier holds)
        self._scales = np.array([spec.scale for spec in store.tables], np.float32)  # lazy init per table

    def fetch(self, requests: IdsByTable):
        """``StoreBase._fetch``: table -> (rows, missing) of the requested ids; rows of held shards
        read from their shards are held from now on."""
        st = self.store
        held = st.held if not self._from_redis else None
        out = {}
        generation = st.held.generation if st.held is not None else 0
        for t, ids in requests.items():
            out[t] = (np.empty((len(ids), st.width(t)), np.float32), np.zeros(len(ids), bool))
        # shard -> list of (table, positions into the request's ids); rows this trainer holds are not read
        plan: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, ids in requests.items():
            idx = None
            got = held.lookup(t, ids) if held is not None else None
            if got is not None and (len(got[0]) or len(got[2])):
                out[t][0][got[0]] = got[1]
                out[t][1][got[2]] = True  # never written: the lazy init fills it
                rest = np.ones(len(ids), bool)
                rest[got[0]] = False
                rest[got[2]] = False
                idx = np.flatnonzero(rest)
            if idx is not None and not len(idx):
                continue  # every row held (or known never written): nothing to read
            for s, pos in enumerate(st.shard_map.split(t, ids if idx is None else ids[idx])):
                if len(pos):
                    plan.setdefault(s, []).append((t, pos if idx is None else idx[pos]))

        def pull_from(s: int, groups: list[tuple[int, np.ndarray]]):
            args = [(st.prefix(t, s), requests[t][pos], 4 * st.width(t)) for t, pos in groups]

            def run():
                with st.writes.bulk(s):
                    return self.links.wires[s].get_rows(args)

            return run

        replies = self.links.on_shards({s: pull_from(s, g) for s, g in plan.items()})
        for s, groups in plan.items():
            for (t, pos), (rows, missing) in zip(groups, replies[s]):
                out[t][0][pos] = rows.view("<f4").reshape(len(pos), st.width(t))
                out[t][1][pos] = missing
                if held is not None and s in held.shards:
                    if missing.any():
                        held.absent(t, requests[t][pos[missing]], generation)
                    if not missing.all():  # the writer holds them from now on
                        present = ~missing
                        held.found(t, requests[t][pos[present]], out[t][0][pos[present]], generation)
        return out

    def read_keys(self, keys: np.ndarray) -> np.ndarray:
        """Rows of sorted packed keys: rows of shards away from their outage's rows, held rows by one
        gather, never-written rows by the lazy init, the rest read from their shards."""
        outage = self.store.outage
        away = outage.split(keys) if outage is not None else None  # never read from their servers
        if away is None:
            return self._read_present(keys)
        out = np.empty((len(keys), self.store.width(int(keys[0] >> rowkeys.ROW_BITS))), np.float32)
        out[away] = outage.read(keys[away])
        if not away.all():
            out[~away] = self._read_present(keys[~away])
        return out

    def _read_present(self, keys: np.ndarray) -> np.ndarray:
        st, held = self.store, self.store.held
        if held is None or self._from_redis or not len(keys):
            return StoreBase.read_keys(st, keys)
        last = self._last_held_read
        if last is not None and last[0] == held.version and (last[1] is keys or np.array_equal(last[1], keys)):
            return last[2]  # a step's update reads the rows its stage read, unchanged since: no second gather
        version = held.version
        rows = held.read_keys(keys)  # every row held or never written (the usual step): one gather
        if rows is not None:
            self._last_held_read = (version, keys, rows)
            return rows
        t0 = int(keys[0] >> rowkeys.ROW_BITS)
        pos, rows, absent = held.lookup_keys(keys)
        if len(pos) == len(keys):  # every row held (the usual step): the gather is the answer
            self._last_held_read = (version, keys, rows)
            return rows
        out = np.empty((len(keys), st.width(t0)), np.float32)
        out[pos] = rows
        if len(absent):
            dim = st.tables.specs[t0].dim
            out[absent, :dim] = init_rows_keys(st.seed, keys[absent], dim, self._scales)
            out[absent, dim:] = initial_state(st.optimizer)
        if len(pos) + len(absent) < len(keys):
            rest = np.ones(len(keys), bool)
            rest[pos] = False
            rest[absent] = False
            idx = np.flatnonzero(rest)
            out[idx] = StoreBase.read_keys(st, keys[idx])
        else:  # every row held or known never written: current until the held rows change
            self._last_held_read = (version, keys, out)
        return out

    def initial_rows(self, keys: np.ndarray) -> np.ndarray:
        """The initial rows [n, width] of packed keys of tables of one row width (lazy-init weights,
        the optimizer's initial state)."""
        st = self.store
        t = int(keys[0] >> rowkeys.ROW_BITS) if len(keys) else 0
        dim = st.tables.specs[t].dim
        rows = np.full((len(keys), st.width(t)), initial_state(st.optimizer), np.float32)
        rows[:, :dim] = init_rows_keys(st.seed, keys, dim, self._scales)
        return rows

    @contextlib.contextmanager
    def from_redis(self):
        """Reads inside go to the shards even for held rows: an evaluation or a digest checks what the
        tier holds (and a shard that died meanwhile is seen there)."""
        self._from_redis += 1
        try:
            yield
        finally:
            self._from_redis -= 1
