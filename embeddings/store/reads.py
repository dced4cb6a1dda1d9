"""The store's row reads: rows of shards away (``--train-through``) from their outage's rows, rows
this trainer holds by one gather, rows known never written by the lazy init, and the rest read
from their shards in parallel (one thread per shard). One ``RowReads`` per ``RedisStore``, given the
shards' links, key names, shard map, row cache and the write path's per-shard gate; the rows of
shards away are an outage's (``attach_outage``), which recovery owns."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np

from embeddings import rowkeys
from embeddings.net.links import ShardLinks
from embeddings.optim import initial_state
from embeddings.rowinit import init_rows_keys
from embeddings.shard_map import ShardMap
from embeddings.store.base import IdsByTable
from embeddings.store.outage import OutageRows
from embeddings.store.row_cache import RowCache
from embeddings.store.row_space import RowSpace


class RowReads:
    def __init__(
        self,
        links: ShardLinks,
        space: RowSpace,
        shard_map: ShardMap,
        cache: RowCache,
        bulk: Callable[[int], AbstractContextManager],
        read_filled: Callable[[np.ndarray], np.ndarray],
    ) -> None:
        """``bulk(shard)``: the write path's gate around a row call on a shard (``RowWrites.bulk``);
        ``read_filled(keys)``: rows of packed keys read from their shards, never-written ones filled
        by the lazy init (``StoreBase.read_keys``)."""
        self.links, self.space, self.shard_map, self.cache = links, space, shard_map, cache
        self.bulk, self.read_filled = bulk, read_filled
        self.outage: OutageRows | None = None  # the shards away, while recovery restores them (``attach_outage``)
        self._last_held_read: tuple[int, np.ndarray, np.ndarray] | None = None  # (held version, keys, rows)
        self._from_redis = 0  # > 0: reads skip held rows (evaluation, digest: what the tier holds)
        self._scales = np.array([spec.scale for spec in space.tables], np.float32)  # lazy init per table

    def attach_outage(self, outage: OutageRows | None) -> None:
        """Reads of the shards ``outage`` has away are answered by it from now on (None: none)."""
        self.outage = outage

    def fetch(self, requests: IdsByTable):
        """``StoreBase._fetch``: table -> (rows, missing) of the requested ids; rows of held shards
        read from their shards are held from now on."""
        sp, cached = self.space, self.cache.held
        held = cached if not self._from_redis else None
        out = {}
        generation = cached.generation if cached is not None else 0
        for t, ids in requests.items():
            out[t] = (np.empty((len(ids), sp.width(t)), np.float32), np.zeros(len(ids), bool))
        # shard -> list of (table, positions into the request's ids); rows this trainer holds are not read
        plan: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, ids in requests.items():
            idx = None
            got = held.lookup(t, ids) if held is not None else None
            if got is not None and (len(got[0]) or len(got[2])):
                out[t][0][got[0]] = got[1]
                out[t][1][got[2]] = True  # never written: the lazy init fills it
                idx = _unfound(len(ids), got[0], got[2])
            if idx is not None and not len(idx):
                continue  # every row held (or known never written): nothing to read
            for s, pos in enumerate(self.shard_map.split(t, ids if idx is None else ids[idx])):
                if len(pos):
                    plan.setdefault(s, []).append((t, pos if idx is None else idx[pos]))

        def pull_from(s: int, groups: list[tuple[int, np.ndarray]]):
            args = [(sp.prefix(t, s), requests[t][pos], 4 * sp.width(t)) for t, pos in groups]

            def run():
                with self.bulk(s):
                    return self.links.wires[s].get_rows(args)

            return run

        replies = self.links.on_shards({s: pull_from(s, g) for s, g in plan.items()})
        for s, groups in plan.items():
            for (t, pos), (rows, missing) in zip(groups, replies[s]):
                out[t][0][pos] = rows.view("<f4").reshape(len(pos), sp.width(t))
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
        outage = self.outage
        away = outage.split(keys) if outage is not None else None  # never read from their servers
        if away is None:
            return self._read_present(keys)
        out = np.empty((len(keys), self.space.width(int(keys[0] >> rowkeys.ROW_BITS))), np.float32)
        out[away] = outage.read(keys[away])
        if not away.all():
            out[~away] = self._read_present(keys[~away])
        return out

    def _read_present(self, keys: np.ndarray) -> np.ndarray:
        sp, held = self.space, self.cache.held
        if held is None or self._from_redis or not len(keys):
            return self.read_filled(keys)
        if not held.capacity:  # a trainer that writes no shard: only the peer rows are held
            return self._read_peers(keys)
        last = self._last_held_read
        if last is not None and last[0] == held.version and (last[1] is keys or np.array_equal(last[1], keys)):
            return last[2]  # a step's update reads the rows its stage read, unchanged since: no second gather
        peers = self.cache.peers
        if peers is not None:  # several trainers: this trainer's rows and the peer rows (the usual step)
            rows = held.read_split(keys, peers)
            if rows is not None:
                return rows
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
        out = np.empty((len(keys), sp.width(t0)), np.float32)
        out[pos] = rows
        if peers is not None and peers.capacity:  # rows of the other trainers' shards kept here
            idx = _unfound(len(keys), pos, absent)
            ppos, prows, pabsent = peers.lookup_keys(keys[idx])
            out[idx[ppos]] = prows
            pos = np.concatenate([pos, idx[ppos]])
            absent = np.concatenate([absent, idx[pabsent]])
        if not self._fill_rest(keys, out, pos, absent) and peers is None:
            # every row held or known never written: current until the held rows change
            self._last_held_read = (version, keys, out)
        return out

    def _fill_rest(self, keys: np.ndarray, out: np.ndarray, pos: np.ndarray, absent: np.ndarray) -> bool:
        """``out`` [n, width] already holds the rows at ``pos``: the rows known never written
        (``absent``) by the lazy init, the rest read from their shards. -> whether any was read."""
        sp = self.space
        if len(absent):
            dim = sp.tables.specs[int(keys[0] >> rowkeys.ROW_BITS)].dim
            out[absent, :dim] = init_rows_keys(sp.seed, keys[absent], dim, self._scales)
            out[absent, dim:] = initial_state(sp.optimizer)
        if len(pos) + len(absent) == len(keys):
            return False
        idx = _unfound(len(keys), pos, absent)
        out[idx] = self.read_filled(keys[idx])
        return True

    def _read_peers(self, keys: np.ndarray) -> np.ndarray:
        """Rows of sorted packed keys where this trainer holds no shard's rows of its own: the peer
        rows kept here, the lazy init of those known never written, the rest from their shards."""
        peers = self.cache.peers
        if peers is None or not peers.capacity:
            return self.read_filled(keys)
        pos, rows, absent = peers.lookup_keys(keys)
        if len(pos) == len(keys):
            return rows
        out = np.empty((len(keys), self.space.width(int(keys[0] >> rowkeys.ROW_BITS))), np.float32)
        out[pos] = rows
        self._fill_rest(keys, out, pos, absent)
        return out

    @contextlib.contextmanager
    def from_redis(self):
        """Reads inside go to the shards even for held rows: an evaluation or a digest checks what the
        tier holds (and a shard that died meanwhile is seen there)."""
        self._from_redis += 1
        try:
            yield
        finally:
            self._from_redis -= 1


def _unfound(n: int, pos: np.ndarray, absent: np.ndarray) -> np.ndarray:
    """The positions of ``n`` keys neither at ``pos`` (rows found) nor at ``absent`` (known never written)."""
    rest = np.ones(n, bool)
    rest[pos] = False
    rest[absent] = False
    return np.flatnonzero(rest)
