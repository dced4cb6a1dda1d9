"""What a resumed trainer learns of the shards it writes: which rows exist on them (and, where its
row cache holds every row, their values), listed from the shards in the background.

A fresh run knows a row of its shards that it never wrote is not on them (``RowCache.assume_fresh``):
no step reads such a row from Redis. A trainer that resumes (a restart, a new quorum) knows nothing
of its shards, and every row a step touches first costs a read, most of them of rows never written:
the steps after a trainer's death ran 2x slower to the run's end. ``PresentRows.start`` lists the
rows on each shard this trainer writes once recovery brought it back to the resumed step, on a
thread of its own while the steps go on; a row not listed, and not written by this trainer since,
is known never written from then on (``HeldRows.assume_present``), and the listed rows are held
with their values when every row fits. Nothing is learned of a shard away (``--train-through``), of
one that does not answer, of one whose server changed (its run id) or whose applied marker went
below the one it had at the start (a restore, by any trainer, to an earlier step; a server started
again empty holds none), and nothing at all once a shard was forgotten here (restored, rolled
back) or any trainer's recovery of a failed shard began (``stop``) while the listing ran. One
``PresentRows`` per ``RedisStore``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from embeddings import rowkeys
from embeddings.errors import ShardDataError, ShardUnavailableError
from embeddings.net.links import ShardLinks
from embeddings.snapshots.keys import Snapshots
from embeddings.store.buckets import BucketLayout
from embeddings.store.markers import Markers
from embeddings.store.row_cache import RowCache


class PresentRows:
    def __init__(
        self,
        cache: RowCache,
        links: ShardLinks,
        layout: BucketLayout,
        snapshots: Snapshots,
        markers: Markers,
        away: Callable[[], set[int]],
        warn: Callable[[str], None],
    ) -> None:
        """``away()``: the shards away now (their rows are an outage's); ``warn(line)``: one line
        where a listing failed for a reason other than a shard that does not answer."""
        self.cache, self.links, self.layout, self.snapshots, self.markers = cache, links, layout, snapshots, markers
        self.away, self.warn = away, warn
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._floor: dict[int, tuple[int | None, str]] = {}  # per shard, (applied marker, run id) at ``start``
        self._only: set[int] | None = None  # the held shards to list (None: all)
        self.learned: list[int] = []  # the shards learned by the last listing
        self.rows = 0  # rows listed by it
        self.seconds = 0.0  # its wall time

    def start(self, shards: set[int] | None = None) -> None:
        """List the held shards' rows (``shards`` of them: None, all) on a thread of its own
        (``prepare``, then ``run``)."""
        if self._thread is not None:
            return
        self._only = shards
        generation = self.prepare()
        if generation is not None:
            self._thread = threading.Thread(target=self._run, args=(generation,), name="present-rows", daemon=True)
            self._thread.start()

    def prepare(self) -> int | None:
        """Once recovery brought the shards back to the resumed step: writes from now on count
        (``HeldRows.begin_learning``), and each shard's applied marker and server run id now are
        what its listing must still find. -> the generation the listing runs at (None: no held rows)."""
        held = self.cache.held
        if held is None or not held.capacity or self._closed:
            return None
        self._stop.clear()  # a recovery during the resume stopped nothing begun after it
        generation = held.begin_learning()
        self._floor = {
            s: m for s in sorted(self._listing(held)) if (m := self._mark(s)) is not None and m[0] is not None
        }
        return generation

    def _listing(self, held) -> set[int]:
        return held.shards if self._only is None else held.shards & self._only

    def stop(self) -> None:
        """A shard failed (any trainer's recovery begins): what the listing learns from now on is
        void, as another trainer may restore a shard this one lists (``HeldRows.invalidate``)."""
        self._stop.set()
        held = self.cache.held
        if held is not None and self._floor:
            held.invalidate()

    def _mark(self, shard: int) -> tuple[int | None, str] | None:
        """(applied marker, the server's run id) of ``shard``, None when it does not answer."""
        try:
            step = self.markers.applied_step(shard)
            run_id = self.links.call(shard, lambda c: str(c.info("server").get("run_id", "")))
        except ShardUnavailableError:
            return None
        return step, run_id

    def wait(self) -> list[int]:
        """Until the listing ends. -> the shards learned."""
        if self._thread is not None:
            self._thread.join()
        return self.learned

    def stats(self) -> dict:
        """The last listing (this trainer's): shards learned, rows listed on them, its seconds."""
        return {"shards": list(self.learned), "rows": self.rows, "seconds": round(self.seconds, 3)}

    def close(self) -> None:
        self._closed = True
        self._stop.set()
        self.wait()

    def _run(self, generation: int) -> None:
        try:
            self.run(generation)
        except Exception as e:  # noqa: BLE001 - only an optimisation: the reads stay exact without it
            self.warn(f"listing the rows of this trainer's shards failed ({e}); they are read as before")

    def run(self, generation: int) -> list[int]:
        """List every held shard not away; -> the shards learned."""
        held = self.cache.held
        assert held is not None
        t0 = time.perf_counter()
        values = held.holds_everything()
        present: dict[int, np.ndarray] = {}
        for s in sorted(self._listing(held) - self.away()):
            if self._stop.is_set():
                return []
            keys = self._listed(s, generation, values)
            if keys is not None:
                present[s] = keys
        for s in self.away() & set(present):
            del present[s]
        if held.assume_present(present, generation):
            self.learned = sorted(present)
            self.rows = sum(len(k) for k in present.values())
        self.seconds = time.perf_counter() - t0
        return self.learned

    def _listed(self, shard: int, generation: int, values: bool) -> np.ndarray | None:
        """Packed keys of the rows on ``shard`` (held with their values with ``values``, once the
        listing is known whole), None when it cannot tell now."""
        held = self.cache.held
        assert held is not None

        def listing() -> list[tuple[int, np.ndarray, np.ndarray | None]] | None:
            batches = []
            for batch in self.snapshots.present_rows(shard, self.layout, values):
                if self._stop.is_set():
                    return None
                batches.append(batch)
            return batches

        floor = self._floor.get(shard)
        if floor is None or shard in self.away():
            return None
        try:
            before = self._mark(shard)
            # a server started again, or a shard gone back before the resumed step (a restore by
            # another trainer), since the listing began: not what this trainer resumed on
            if before is None or before[0] is None or before[0] < floor[0] or before[1] != floor[1]:
                return None
            batches = self.links.mapped(shard, listing)
            after = self._mark(shard)
            if batches is None or after is None or after[0] is None or after[0] < before[0] or after[1] != before[1]:
                return None
        except ShardUnavailableError:  # recovery meets it at its first read
            return None
        except ValueError as e:  # a bucket field of no row of this layout
            raise ShardDataError(f"shard {shard} at {self.links.endpoints[shard]}: {e}") from None
        keys = []
        for t, ids, rows in batches:
            if rows is not None:  # void once a shard was forgotten or a recovery began (``generation``)
                held.found(t, ids, rows, generation)
            keys.append(rowkeys.pack(t, ids))
        return np.concatenate(keys) if keys else np.empty(0, np.int64)
