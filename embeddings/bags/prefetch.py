"""Prefetch of the next batch's rows, kept coherent with the updates made meanwhile.

``prefetch(keys)`` starts pulling the rows of the next batch (sorted packed row keys) in a
background thread while the current batch computes. Rows that the current step then updates are
stale in that copy: the trainer reports every updated key through ``invalidate``, and
``pull_keys`` re-pulls just those (after the step's writers are done) and patches them in. A
request that does not match the prefetched one falls through to the store. The result equals a
plain ``store.pull_keys``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from embeddings.store.base import EmbeddingStore


class Prefetcher:
    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._keys: np.ndarray | None = None
        self._future: Future | None = None
        self._stale: list[np.ndarray] = []
        self.num_hits = 0
        self.num_refreshed_rows = 0
        self.num_prefetched_rows = 0

    @property
    def tables(self):
        return self.store.tables

    def prefetch(self, keys: np.ndarray) -> None:
        """Start pulling the rows of ``keys`` (sorted unique packed keys) in the background."""
        self.drain()
        self._keys = keys
        self._stale = []
        self._future = self._pool.submit(self.store.pull_keys, keys)

    def invalidate(self, updated: np.ndarray) -> None:
        """Keys written since the pending prefetch started; they are re-pulled when served."""
        if self._keys is not None and len(updated):
            self._stale.append(updated)

    def pull_keys(self, keys: np.ndarray) -> np.ndarray:
        pending, self._keys = self._keys, None
        future, self._future = self._future, None
        stale, self._stale = self._stale, []
        if pending is None or future is None:
            return self.store.pull_keys(keys)
        rows = future.result()  # re-raises a ShardUnavailableError from the background pull
        if not (pending is keys or np.array_equal(pending, keys)):
            return self.store.pull_keys(keys)
        self.num_hits += 1
        if stale:
            pos = np.flatnonzero(np.isin(pending, np.concatenate(stale)))
            if len(pos):
                rows[pos] = self.store.pull_keys(pending[pos])
                self.num_refreshed_rows += len(pos)
        self.num_prefetched_rows += len(pending)
        return rows

    def drain(self) -> None:
        """Wait for (and drop) a pending prefetch, e.g. before recovery rewrites rows."""
        future, self._future, self._keys, self._stale = self._future, None, None, []
        if future is not None:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the data is dropped; a real pull will raise again
                pass

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
