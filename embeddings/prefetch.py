"""Prefetch of the next batch's rows, kept coherent with the updates made meanwhile.

``prefetch(requests)`` starts pulling the rows of the next batch in a background thread while the
current batch computes. Rows that the current step then updates are stale in that copy: the
trainer reports every updated (table, ids) through ``invalidate``, and ``pull_many`` re-pulls
just those (after the step's writers are done) and patches them in. A request that does not match
the prefetched one falls through to the store. The result equals a plain ``store.pull_many``.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from embeddings.store import EmbeddingStore


class Prefetcher:
    def __init__(self, store: EmbeddingStore) -> None:
        self.store = store
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._requests: dict[str, np.ndarray] | None = None
        self._future: Future | None = None
        self._stale: dict[str, list[np.ndarray]] = {}
        self.num_hits = 0
        self.num_refreshed_rows = 0
        self.num_prefetched_rows = 0

    @property
    def tables(self):
        return self.store.tables

    def prefetch(self, requests: dict[str, np.ndarray]) -> None:
        """Start pulling ``requests`` (table -> unique ids) in the background."""
        self.drain()
        self._requests = {k: np.asarray(v) for k, v in requests.items()}
        self._stale = {}
        self._future = self._pool.submit(self.store.pull_many, self._requests)

    def invalidate(self, updated: dict[str, np.ndarray]) -> None:
        """Rows written since the pending prefetch started; they are re-pulled when served."""
        if self._requests is None:
            return
        for table, ids in updated.items():
            if table in self._requests and len(ids):
                self._stale.setdefault(table, []).append(np.asarray(ids))

    def pull_many(self, requests: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        pending, self._requests = self._requests, None
        future, self._future = self._future, None
        stale, self._stale = self._stale, {}
        if pending is None or future is None:
            return self.store.pull_many(requests)
        rows = future.result()  # re-raises a ShardUnavailableError from the background pull
        if pending.keys() != requests.keys() or any(
            not np.array_equal(pending[t], np.asarray(requests[t])) for t in requests
        ):
            return self.store.pull_many(requests)
        self.num_hits += 1
        refresh = {}
        for table, parts in stale.items():
            ids = pending[table]
            mask = np.isin(ids, np.concatenate(parts))
            if mask.any():
                refresh[table] = np.flatnonzero(mask)
        if refresh:
            fresh = self.store.pull_many({t: pending[t][pos] for t, pos in refresh.items()})
            for t, pos in refresh.items():
                rows[t][pos] = fresh[t]
                self.num_refreshed_rows += len(pos)
        self.num_prefetched_rows += sum(len(v) for v in pending.values())
        return rows

    def drain(self) -> None:
        """Wait for (and drop) a pending prefetch, e.g. before recovery rewrites rows."""
        future, self._future, self._requests, self._stale = self._future, None, None, {}
        if future is not None:
            try:
                future.result()
            except Exception:  # noqa: BLE001 - the data is dropped; a real pull will raise again
                pass

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)
