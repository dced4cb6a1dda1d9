"""Rows of shards that are away: served from memory while their servers are restored in the background.

While a failed shard is restored (``--train-through``), nothing reads or writes its server. Its
writer keeps its rows here instead (``OutageRows``), seeded with the rows it held when the shard
failed:

- an **exact** row has the value the restored shard will hold (a row the writer held, where the
  restore brings the shard back to what its writer wrote; a row known never written): it is read
  and updated as usual, and the value it ends with is written to the shard when it rejoins;
- any other row is read from a **fallback** value (the writer's last value where it held one,
  else the row's initial value) and counted; its updates keep their summed gradients, in step
  order, and are applied to the row's restored value when the shard rejoins (``kept``). Until then
  the fallback row trains on with those updates applied to it (a shadow of the row), so that the
  steps of the outage read what they wrote.

Where every read must be exact (``exact_only``: ``--recovery log``, which promises the run of no
failure bit for bit), there is no fallback: a step that reads a row no writer holds, and that is not
known never written, raises ``ColdRows`` on every trainer before anything is read or kept, and the
run waits for the restore (the rows then come from the restored shard).

Every trainer must read the same value for a row in a step. The writer answers for its shards; with
several trainers the step's keys of shards that are away are gathered from every trainer and the
writers' rows handed to all (``serve``: an all-reduce of their bit patterns, exact), before anything
reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from embeddings.keyindex import KeyIndex


class ColdRows(Exception):
    """A step reads ``count`` rows of the shards away that no writer holds and that are not known
    never written, where every read must be exact (``OutageRows.exact_only``). Raised on every
    trainer alike (the count is summed over them), before anything was read, counted or kept."""

    def __init__(self, count: int, shards: list[int]) -> None:
        self.count, self.shards = count, shards
        super().__init__(f"{count:,} rows of shards {shards} away that no trainer holds")


class _Shard:
    """One shard's outage rows in slots (a row keeps its slot), found by key through a vectorised
    hash index (``embeddings.keyindex``); the slots grow by doubling."""

    def __init__(self, keys: np.ndarray, rows: np.ndarray, exact: np.ndarray) -> None:
        n, width = len(keys), rows.shape[1]
        cap = max(1024, n + n // 4)
        self.keys = np.full(cap, -1, np.int64)
        self.rows = np.empty((cap, width), np.float32)
        self.exact = np.zeros(cap, bool)
        self.dirty = np.zeros(cap, bool)  # an exact row written during the outage
        self.keys[:n], self.rows[:n], self.exact[:n] = keys, rows, exact
        self.n = n
        self.index = KeyIndex(cap, self.keys)
        self.index.insert(self.keys[:n], np.arange(n, dtype=np.int32))
        self.kept: list[tuple[int, np.ndarray, np.ndarray]] = []  # (step, keys, grads) in step order
        self.kept_bytes = 0

    def slots(self, keys: np.ndarray) -> np.ndarray:
        return self.index.lookup(keys)

    def add(self, keys: np.ndarray, rows: np.ndarray, exact: np.ndarray) -> np.ndarray:
        """New unique keys into the next slots (growing them); -> their slots."""
        m = len(keys)
        if self.n + m > len(self.keys):
            cap = max(2 * len(self.keys), self.n + m)
            grown = np.full(cap, -1, np.int64)
            grown[: self.n] = self.keys[: self.n]
            self.keys = grown
            self.rows = np.concatenate([self.rows[: self.n], np.empty((cap - self.n, self.rows.shape[1]), np.float32)])
            self.exact = np.concatenate([self.exact[: self.n], np.zeros(cap - self.n, bool)])
            self.dirty = np.concatenate([self.dirty[: self.n], np.zeros(cap - self.n, bool)])
            self.index = KeyIndex(cap, self.keys)
            self.index.insert(self.keys[: self.n], np.arange(self.n, dtype=np.int32))
        at = np.arange(self.n, self.n + m, dtype=np.int32)
        self.keys[at], self.rows[at], self.exact[at] = keys, rows, exact
        self.index.insert(keys, at)
        self.n += m
        return at

    @property
    def nbytes(self) -> int:
        """The rows in use, their keys and flags, and the kept gradients."""
        return self.n * (self.rows.shape[1] * 4 + 8 + 2) + self.kept_bytes


@dataclass
class OutageCounts:
    """What an outage cost in rows, per shard: reads answered exactly, reads from the fallback,
    (row, step) updates applied exactly and those kept for the restored rows."""

    exact_reads: int = 0
    fallback_reads: int = 0
    exact_updates: int = 0
    late_updates: int = 0


class OutageRows:
    """The rows of the shards that are away, on every trainer; the writer of a shard answers for it.

    ``init(keys)``: the rows' initial values [n, width] (lazy-init weights, zero state);
    ``shard_of(keys)``: the shard of each packed key; ``mine``: the shards this trainer writes;
    ``budget_bytes``: what the rows and kept gradients of this trainer's shards away may take."""

    def __init__(
        self,
        init: Callable[[np.ndarray], np.ndarray],
        shard_of: Callable[[np.ndarray], np.ndarray],
        mine: set[int],
        budget_bytes: int,
    ) -> None:
        self.init, self.shard_of, self.mine, self.budget_bytes = init, shard_of, set(mine), budget_bytes
        self._shards: dict[int, _Shard] = {}
        self.away: set[int] = set()  # every trainer's view: the shards whose reads are answered here
        self.counts: dict[int, OutageCounts] = {}
        self._served: tuple[np.ndarray, np.ndarray] | None = None  # rows handed to all this step
        # keys -> which are known never written (their initial value is exact), on the writer
        self.absent: Callable[[np.ndarray], np.ndarray] | None = None
        # called once per outage of a shard, before its first kept update is kept (a durable note)
        self.on_kept: Callable[[int], None] | None = None
        # every read exact (``log``): a row neither held nor known never written raises ColdRows
        self.exact_only = False

    # -- an outage begins and ends ----------------------------------------------------------------
    def begin(self, shard: int, keys: np.ndarray, rows: np.ndarray, exact: np.ndarray) -> None:
        """Shard ``shard`` is away from now on; its writer passes the rows it held (unique keys)."""
        self.away.add(shard)
        self.counts[shard] = OutageCounts()
        if shard in self.mine:
            self._shards[shard] = _Shard(np.asarray(keys, np.int64), np.asarray(rows, np.float32), exact)

    def end(self, shard: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, np.ndarray, np.ndarray]]] | None:
        """The shard rejoins: -> (keys, rows) of the exact rows written during the outage and the
        kept updates (step, keys, grads) in step order, on its writer; None elsewhere."""
        self.away.discard(shard)
        self._served = None
        sh = self._shards.pop(shard, None)
        if sh is None:
            return None
        dirty = np.flatnonzero(sh.dirty[: sh.n])
        return sh.keys[dirty], sh.rows[dirty], sh.kept

    @property
    def active(self) -> bool:
        return bool(self.away)

    def used_bytes(self) -> int:
        return sum(sh.nbytes for sh in self._shards.values())

    def over_budget(self) -> bool:
        return self.used_bytes() > self.budget_bytes

    # -- reads ------------------------------------------------------------------------------------
    def split(self, keys: np.ndarray) -> np.ndarray | None:
        """A mask of ``keys`` whose shards are away (None: none is)."""
        if not self.away or not len(keys):
            return None
        mask = np.isin(self.shard_of(keys), list(self.away))
        return mask if mask.any() else None

    def _find(self, shard: int, keys: np.ndarray) -> np.ndarray:
        """Slots of ``keys`` (unique) in the shard's rows, adding fallback rows for keys not there."""
        sh = self._shards[shard]
        slots = sh.slots(keys)
        new = slots < 0
        if new.any():
            k = keys[new]
            known = self.absent(k) if self.absent is not None else np.zeros(len(k), bool)
            slots[new] = sh.add(k, self.init(k), known)
        return slots

    def own_rows(self, keys: np.ndarray, count: bool = False, keep: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` (sorted, all of shards this trainer writes that are away) and which are
        exact. ``count``: a training read (counted exact or fallback); ``keep``: a row not there yet
        stays from now on with its fallback value (an evaluation's reads leave nothing)."""
        shards = self.shard_of(keys)
        rows = np.empty((len(keys), self._width(keys)), np.float32)
        exact = np.zeros(len(keys), bool)
        for s in np.unique(shards).tolist():
            at = np.flatnonzero(shards == s)
            if keep:
                pos = self._find(s, keys[at])
                sh = self._shards[s]
                rows[at], exact[at] = sh.rows[pos], sh.exact[pos]
            else:
                rows[at], exact[at] = self._peek(s, keys[at])
            if count:
                c = self.counts[s]
                n_exact = int(exact[at].sum())
                c.exact_reads += n_exact
                c.fallback_reads += len(at) - n_exact
        return rows, exact

    def _peek(self, shard: int, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """As ``_find``, adding nothing: a key not there reads its fallback value."""
        sh = self._shards[shard]
        slots = sh.slots(keys)
        found = slots >= 0
        rows = np.empty((len(keys), sh.rows.shape[1]), np.float32)
        exact = np.zeros(len(keys), bool)
        rows[found], exact[found] = sh.rows[slots[found]], sh.exact[slots[found]]
        if not found.all():
            rows[~found] = self.init(keys[~found])
            if self.absent is not None:
                exact[~found] = self.absent(keys[~found])
        return rows, exact

    def cold(self, keys: np.ndarray) -> int:
        """How many of ``keys`` (sorted, of shards this trainer writes that are away) are neither exact
        in the outage rows nor known never written: rows whose exact value only the restore has (a
        row an update kept a gradient for, where the shard failed between a step's stage and its
        update, is one: its value here is a shadow)."""
        shards = self.shard_of(keys)
        n = 0
        for s in np.unique(shards).tolist():
            k = keys[shards == s]
            sh = self._shards[s]
            slots = sh.slots(k)
            found = slots >= 0
            n += int((~sh.exact[slots[found]]).sum())
            new = ~found
            if new.any():
                known = self.absent(k[new]) if self.absent is not None else np.zeros(int(new.sum()), bool)
                n += int((~known).sum())
        return n

    def _width(self, keys: np.ndarray) -> int:
        for sh in self._shards.values():
            return sh.rows.shape[1]
        return self.init(keys[:1]).shape[1]

    def serve(self, keys: np.ndarray, all_gather_keys=None, all_reduce_sum=None, training: bool = True) -> None:
        """The step's rows of shards away, the same on every trainer: ``keys`` (sorted) are this
        trainer's; with collectives (several trainers), every trainer's keys are gathered and each
        writer's rows summed into one table (bit patterns as int64: a sum with zeros is exact).
        ``training``: a step's reads (counted, kept); else an evaluation's (neither)."""
        if all_gather_keys is None:
            mine = keys[np.isin(self.shard_of(keys), list(self.mine & self.away))]
            self._served = None
            if self.exact_only and len(mine) and (n := self.cold(mine)):
                raise ColdRows(n, sorted(self.away))
            if len(mine) and training:
                self.own_rows(mine, count=True)
            elif len(mine):
                self._served = (mine, self.own_rows(mine, keep=False)[0])
            return
        union = all_gather_keys(keys)
        if not len(union):
            self._served = (union, np.empty((0, 0), np.float32))
            return
        width = self._width(union)
        bits = np.zeros((len(union) + 1, width), np.int64)  # the last row: the cold rows, summed
        at = np.flatnonzero(np.isin(self.shard_of(union), list(self.mine & self.away)))
        # where every read must be exact, nothing is kept or counted before every trainer knows none is cold
        settle = self.exact_only and training and len(at) > 0
        if len(at):
            if self.exact_only:
                bits[-1, 0] = self.cold(union[at])
            rows, _ = self.own_rows(union[at], count=training and not settle, keep=training and not settle)
            bits[at] = rows.view(np.int32).astype(np.int64)
        total = all_reduce_sum(bits)
        if total[-1, 0]:
            raise ColdRows(int(total[-1, 0]), sorted(self.away))
        if settle:  # the same values: now kept and counted
            self.own_rows(union[at], count=True, keep=True)
        self._served = (union, total[:-1].astype(np.int32).view(np.float32).reshape(len(union), width))

    def read(self, keys: np.ndarray) -> np.ndarray:
        """Rows of ``keys`` (sorted, every one of a shard away) as this step reads them."""
        own = np.isin(self.shard_of(keys), list(self.mine))
        if own.all() and self._served is None:
            return self.own_rows(keys)[0]
        if self._served is None:
            raise RuntimeError("rows of a shard that is away were read before the step's rows were served")
        union, rows = self._served
        pos = np.searchsorted(union, keys)
        if (pos >= len(union)).any() or not np.array_equal(union[np.minimum(pos, len(union) - 1)], keys):
            raise RuntimeError("rows of a shard that is away were read outside the step's served rows")
        return rows[pos]

    # -- writes -----------------------------------------------------------------------------------
    def update(self, keys: np.ndarray, new: np.ndarray, grads, step: int) -> np.ndarray:
        """A step's updated rows of shards away (sorted keys, new values, the summed gradients that
        made them): exact rows take their value; fallback rows keep their gradients for the restored
        value (and train on from the shadow). -> the mask of exact rows (logged as usual)."""
        shards = self.shard_of(keys)
        exact = np.zeros(len(keys), bool)
        g = np.asarray(grads, np.float32)
        for s in np.unique(shards).tolist():
            at = np.flatnonzero(shards == s)
            pos = self._find(s, keys[at])
            sh = self._shards[s]
            sh.rows[pos] = new[at]
            ex = sh.exact[pos]
            sh.dirty[pos[ex]] = True
            exact[at] = ex
            self.counts[s].exact_updates += int(ex.sum())
            if (~ex).any():
                if not sh.kept and self.on_kept is not None:
                    self.on_kept(s)
                kk, gg = keys[at][~ex].copy(), g[at][~ex].copy()
                sh.kept.append((step, kk, gg))
                sh.kept_bytes += kk.nbytes + gg.nbytes
                self.counts[s].late_updates += len(kk)
        self._served = None
        return exact
