"""Several trainers: the rows of the shards other trainers write, kept by this trainer (peer rows).

Every trainer receives every row's summed gradient of a step (``recsys.group.TrainerGroup.aggregate``)
and writes only its own shards. A row of another trainer's shard that this trainer read once is kept
here, and each step's update is applied to it here too, with the same rows, gradients and step as its
writer: the writer's bits, so it is never read back from Redis. Rows enter only at a stage, on the
training thread (``learn``): every writer's write of the step before is on its shard then, and no
write of this step has begun (it needs this trainer's gradients). A read on any other thread (the
prefetcher) may cross a writer's write, so nothing it reads enters. In a fresh run a row no step
updated is known never written (``HeldRows.assume_fresh``). Anything that changes a shard behind the
steps (a restore, a rollback, a reconnect, a shard away) forgets every peer row and what was known
never written (``RowCache.drop_peers``); rows are read again as steps need them.

``PeerFront`` is mixed into ``RedisStore`` (its ``cache`` holds the ``PeerRows``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from embeddings import rowkeys
from embeddings.optim import RowOptimizer
from embeddings.store.row_cache import ABSENT, UNKNOWN, HeldRows, RowCache
from embeddings.store.row_space import RowSpace


class PeerRows(HeldRows):
    """A ``HeldRows`` of the shards other trainers write (its ``shards``): what it holds and knows
    never written changes only by ``learn``, ``update`` and ``RowCache.drop_peers``."""

    complete = False
    """Every row of its shards is kept or known never written (a fresh run's start, ``PeerFront.complete_peer_rows``)."""

    def forget_fresh(self) -> None:
        """Nothing is known never written from now on (rows changed where this cache did not see it)."""
        with self.lock:
            self.version += 1
            self._fresh = set()
            self._written = None
            self.complete = False
            # the rows held as never written (a fresh run's prefill) too: their writer may have
            # written them where no update reached this cache
            self.state[self.state == ABSENT] = UNKNOWN

    def assume_fresh(self, shards: set[int]) -> None:
        super().assume_fresh(shards)
        self.complete = set(shards) >= self.shards

    def mark_updated(self, keys: np.ndarray) -> None:
        """Rows a step updated, whether held here or not: none of them is never written any more."""
        keys = np.asarray(keys, np.int64)
        if self._written is None or not len(keys):
            return
        with self.lock:
            self._mark_written(keys[self._held[keys >> rowkeys.ROW_BITS]])


class PeerFront:
    """Mixed into ``RedisStore``: the parts below are its own."""

    space: RowSpace
    cache: RowCache
    optimizer: RowOptimizer
    read_keys: Callable[[np.ndarray], np.ndarray]
    from_redis: Callable[[], AbstractContextManager]

    @property
    def peer_rows(self) -> PeerRows | None:
        """Rows of the other trainers' shards kept here; None: none (one trainer, no held rows)."""
        return self.cache.peers

    def hold_peer_rows(self, shards: set[int], budget_bytes: int) -> PeerRows:
        """Keep rows of ``shards`` (written by other trainers) here, within ``budget_bytes``."""
        sp, shard_map = self.space, self.cache.shard_map
        self.cache.peers = PeerRows(
            sp.tables,
            [sp.width(t) for t in range(len(sp.tables.specs))],
            shards,
            budget_bytes,
            owner_of=shard_map.shard_of,
            init=sp.initial_rows,
            owner_of_keys=shard_map.shard_of_keys,
            num_shards=self.cache.num_shards,
        )
        return self.cache.peers

    def drop_peer_rows(self) -> None:
        """Every peer row forgotten (``RowCache.drop_peers``)."""
        self.cache.drop_peers()

    def learn_peer_rows(self, keys: np.ndarray) -> int:
        """At a step's stage, on the training thread: the rows of ``keys`` (sorted packed keys) of
        peer shards that are neither kept here nor known never written, read from their shards and
        kept. -> rows read. Their shards are looked up only where some may be missing."""
        peers = self.cache.peers
        if peers is None or not peers.capacity or not len(keys):
            return 0
        if peers.complete and peers.direct:  # every row of theirs kept or known never written, for good
            return 0
        theirs = np.isin(self.cache.shard_map.shard_of_keys(keys), list(peers.shards))
        k = keys[theirs] if not theirs.all() else keys
        if not len(k):
            return 0
        unknown = k[peers.state_of(k) == UNKNOWN]
        if not len(unknown):
            return 0
        with self.from_redis():
            rows = self.read_keys(unknown)
        peers.put_keys(unknown, rows)
        return len(unknown)

    def complete_peer_rows(self, block: int = 1 << 16) -> int:
        """Several trainers writing in windows (``recovery.writer``): every row of the peer shards
        that is neither kept here nor known never written, read from its shard now and kept, a block
        at a time. Where the shards changed behind the steps (a restore, a rollback, a resume), at a
        point where every trainer's window is on its shards: a row read later could come from a shard
        whose writer holds it newer in a window still open. -> rows read."""
        peers = self.cache.peers
        if peers is None or peers.complete or not peers.capacity:
            return 0
        specs, theirs, read = self.space.tables.specs, list(peers.shards), 0
        for t, spec in enumerate(specs):
            for lo in range(0, spec.num_rows, block):
                keys = rowkeys.pack(t, np.arange(lo, min(lo + block, spec.num_rows), dtype=np.int64))
                keys = keys[np.isin(self.cache.shard_map.shard_of_keys(keys), theirs)]
                unknown = keys[peers.state_of(keys) == UNKNOWN] if len(keys) else keys
                if len(unknown):
                    with self.from_redis():
                        peers.put_keys(unknown, self.read_keys(unknown))
                    read += len(unknown)
        peers.complete = True
        return read

    def update_peer_rows(self, keys: np.ndarray, grads: torch.Tensor, step: int) -> None:
        """A committed step's update of peer rows (sorted packed keys of peer shards, their summed
        row gradients): the row optimizer applied here to those kept or known never written, as their
        writer applied it; the others are known written from now on."""
        peers = self.cache.peers
        if peers is None or not peers.capacity or not len(keys):
            return
        current = peers.read_keys(keys)
        if current is not None:  # every row kept or known never written (the usual step): one gather, one write
            peers.put_keys(keys, self.optimizer.apply(torch.from_numpy(current), grads, step).numpy(), step)
            return
        pos, rows, absent = peers.lookup_keys(keys)
        if len(absent):
            sel = np.sort(np.concatenate([pos, absent]))
            current = np.empty((len(sel), self.space.width(int(keys[0] >> rowkeys.ROW_BITS))), np.float32)
            current[np.searchsorted(sel, pos)] = rows
            current[np.searchsorted(sel, absent)] = self.space.initial_rows(keys[absent])
        else:
            sel, current = pos, rows
        if len(sel):
            g = grads if len(sel) == len(keys) else grads[torch.from_numpy(sel)]
            new = self.optimizer.apply(torch.from_numpy(current), g, step).numpy()
            peers.put_keys(keys[sel], new, step)
        peers.mark_updated(keys)
