"""The store's row writes: a training step's write (undo record, rows, applied marker, on every
shard at once), the write-behind thread that overlaps it with the next step, plain row writes, and
the rows a restore lays on a shard. One ``RowWrites`` per ``RedisStore``, given the shards' links,
key names, shard map and row cache; it counts what it wrote (``rows_written``) and what the
training path waited for it (``behind_wait_s``).

Every row call on a shard's socket goes through ``bulk``: one call at a time per shard, a call
queued behind a timed-out one fails at once, and a read or write from any thread but the
write-behind one waits for the write-behind in flight first, so nothing reads a shard behind it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

import numpy as np
import redis

from embeddings import rowkeys
from embeddings.errors import ShardTimeoutError, ShardUnavailableError
from embeddings.net.links import ShardLinks
from embeddings.net.wire import row_commands
from embeddings.shard_map import ShardMap
from embeddings.store.markers import encode_groups, read_marker
from embeddings.store.row_cache import RowCache
from embeddings.store.row_space import RowSpace

BEHIND = "write-behind"  # the write-behind thread's name


class RowWrites:
    def __init__(
        self,
        links: ShardLinks,
        space: RowSpace,
        shard_map: ShardMap,
        cache: RowCache,
        warn: Callable[[str], None],
    ) -> None:
        """``cache``: the row cache, whose held rows take what is written; ``warn``: one line (a
        server that refuses its listpack limits)."""
        self.links, self.space, self.shard_map, self.cache, self.warn = links, space, shard_map, cache, warn
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=BEHIND)
        self.future: Future | None = None  # write_behind in flight (its commit point: join_behind)
        self.behind_wait_s = 0.0  # the training path waiting at the commit point of a write-behind
        self.rows_written = 0  # rows the training steps' writes put on their shards
        # a benchmark's ceiling (``RECSYS_ROWS_NOWHERE=1``, bench_throughput's limit row): the row
        # writes are built and never sent, so the rows live in this process's held rows alone
        self.rows_nowhere = False

    def fit(self, shard: int) -> None:
        """The shard's listpack limits raised before its first row write (``ShardLinks.fit_listpack``);
        on every write after it, one list look-up."""
        if self.links.listpack_ok[shard]:
            return
        self.links.fit_listpack(shard, self.space.row_bytes(), self.warn)

    @contextlib.contextmanager
    def bulk(self, shard: int):
        """A row read or write on one shard. A call that queued for the shard while the call before it
        timed out fails at once: a write behind a timed-out prefetch does not wait a second time
        before the failure is seen."""
        behind = self.future
        if behind is not None and not threading.current_thread().name.startswith(BEHIND):
            futures_wait([behind])  # a write-behind in flight reaches the shard first
        queued = time.monotonic()
        with self.links.locks[shard]:
            if self.links.timed_out[shard] >= queued:
                raise redis.TimeoutError("the call before this one timed out")
            try:
                yield
            except (redis.TimeoutError, ShardTimeoutError):
                self.links.timed_out[shard] = time.monotonic()
                raise

    def _timed(self, shard: int, error: ShardUnavailableError) -> ShardUnavailableError:
        if isinstance(error, ShardTimeoutError):  # as ``bulk`` does: calls queued behind it fail at once
            self.links.timed_out[shard] = time.monotonic()
        return error

    def plain(self, requests) -> None:
        """Rows with no step (``write_rows``, ``update_many``): table -> (ids, rows), on every shard
        at once; rows of held shards are held as written."""
        sp, cache = self.space, self.cache
        plan: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, (ids, _) in requests.items():
            for s, pos in enumerate(self.shard_map.split(t, ids)):
                if len(pos):
                    plan.setdefault(s, []).append((t, pos))

        def push_to(s: int, groups):
            args = [(sp.prefix(t, s), requests[t][0][pos], requests[t][1][pos]) for t, pos in groups]

            def run():
                with self.bulk(s):
                    self.fit(s)
                    n = self.links.wires[s].set_rows(args)
                held = cache.held
                if held is not None and s in held.shards:  # written: now held as written
                    for t, pos in groups:
                        held.put(t, requests[t][0][pos], requests[t][1][pos])
                return n

            return run

        self.links.on_shards({s: push_to(s, g) for s, g in plan.items()})

    def write_step(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        shards: np.ndarray,
        step: int | None = None,
        undo: np.ndarray | None = None,
    ) -> dict[int, ShardUnavailableError]:
        """Write now; see ``_write_io``. -> the shards that failed, with their error."""
        return self._write_io(keys, rows, shards, step, undo, hold=True)

    def write_behind(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        shards: np.ndarray,
        step: int,
        undo: np.ndarray,
        before: Callable[[], None] | None = None,
        window: bool = False,
        after: Callable[[], None] | None = None,
    ) -> None:
        """``write_step`` on the write-behind thread: this thread trains on while the servers apply the
        rows. The rows are held at once (the next step reads them from here), so only a process that
        writes every shard it reads may use it. ``join_behind`` is the write's commit point: it
        returns the shards that failed; until then a row read or write of this store from any other
        thread waits for the write first (``bulk``), so nothing reads a shard behind it. ``before``
        runs on the write-behind thread first (what must be durable before the rows move).

        ``window``: the rows of several steps up to ``step``, already held (``hold_written``), and
        ``undo`` their values as of each shard's last write: each shard's undo record is named for
        the step after the one its applied marker shows (see ``Markers.rollback``). ``after`` runs on
        the write-behind thread once every shard took the write (none failed)."""
        if self.future is not None:
            raise RuntimeError("write_behind: the previous write-behind was not joined")
        if not window:
            self.hold_written(keys, rows, shards, step)

        def write() -> dict[int, ShardUnavailableError]:
            if before is not None:
                before()
            failed = self._write_io(keys, rows, shards, step, undo, False, window)
            if after is not None and not failed:
                after()
            return failed

        self.future = self.pool.submit(write)

    def hold_written(
        self, keys: np.ndarray, rows: np.ndarray, shards: np.ndarray, step: int, pin: bool = False
    ) -> None:
        """Rows handed to a write-behind are held at once: the next step reads them from here.
        ``pin``: an open window's, not on their shards until it is written (``HeldRows.unpin``)."""
        held = self.cache.held
        if held is not None:
            mine = None
            if len(held.shards) < len(self.links.clients):  # by a table of the shards: no search a row
                own = np.zeros(len(self.links.clients), bool)
                own[list(held.shards)] = True
                mine = own[shards]
            if mine is not None and not mine.all():
                held.put_keys(keys[mine], rows[mine], step, pin)
            else:  # every row of a held shard (one writer of them all, or this trainer's rows): no copy
                held.put_keys(keys, rows, step, pin)

    def join_behind(self) -> dict[int, ShardUnavailableError]:
        """The commit point of the last ``write_behind``: waits for it. -> the shards that failed."""
        f, self.future = self.future, None
        if f is None:
            return {}
        t0 = time.perf_counter()
        try:
            return f.result()
        finally:
            self.behind_wait_s += time.perf_counter() - t0

    def _write_io(
        self,
        keys: np.ndarray,
        rows: np.ndarray,
        shards: np.ndarray,
        step: int | None,
        undo: np.ndarray | None,
        hold: bool,
        window: bool = False,
    ) -> dict[int, ShardUnavailableError]:
        """Sorted packed keys (``shards``: the shard of each) and their rows [n, width]. With ``step``,
        each shard gets, in this order on one connection: the step's undo record (the rows' previous
        values), the rows, the step's applied marker. A writer that dies part way leaves the marker
        at the step before and the undo record of this step, which ``rollback`` applies: the shard is
        never left half-way (no MULTI/EXEC, whose queueing costs the server about a third more per
        row). Every shard's commands are sent from this thread before any reply is read, so the
        servers apply them in parallel. -> the shards that failed, with their error;
        the others are written (and held)."""
        sp, links, cache = self.space, self.links, self.cache
        failed: dict[int, ShardUnavailableError] = {}
        sent = []
        with contextlib.ExitStack() as locks:
            for s in np.unique(shards).tolist():
                mine = shards == s
                at = slice(None) if mine.all() else np.flatnonzero(mine)
                k, r = keys[at], rows[at]
                groups = rowkeys.table_groups(k)
                args = [(sp.prefix(t, s), ids, r[lo:hi]) for t, (ids, lo, hi) in groups.items()]
                first, last = [], []  # undo record before the rows, applied marker after them
                try:
                    links.mapped(s, lambda s=s: locks.enter_context(self.bulk(s)))
                    self.fit(s)
                    if step is not None:
                        if undo is not None:
                            # a window's undo record covers the steps since the shard's last write
                            since = links.mapped(s, lambda s=s: read_marker(links, sp, s)) + 1 if window else step
                            u = undo[at]
                            blob = encode_groups(since, [(t, ids, u[lo:hi]) for t, (ids, lo, hi) in groups.items()])
                            first.append([b"SET", sp.meta_key("undo", s), blob])
                        last.append([b"SET", sp.meta_key("applied", s), b"%d" % step])
                    if self.rows_nowhere:  # the benchmark's ceiling: the commands built, never sent
                        reply = row_commands(links.wires[s].layout, args)
                    else:
                        reply = links.mapped(
                            s, lambda s=s, a=args, f=first, la=last: links.wires[s].send_rows(a, f, la)
                        )
                except ShardUnavailableError as e:
                    failed[s] = self._timed(s, e)
                    continue
                sent.append((s, k, r, reply))
            for s, k, r, reply in sent:
                try:
                    if not self.rows_nowhere:
                        links.mapped(s, lambda s=s, reply=reply: links.wires[s].finish(reply))
                except ShardUnavailableError as e:
                    failed[s] = self._timed(s, e)
                    continue
                self.rows_written += len(k)
                if hold and cache.held is not None and s in cache.held.shards:  # written: now held as written
                    cache.held.put_keys(k, r, step)
        return failed

    def write_shard(self, shard: int, groups: list[tuple[int, np.ndarray, np.ndarray]], step: int | None) -> int:
        """Write rows (table index, ids, rows [n, width]) onto one shard, with its applied-step marker."""
        sp = self.space
        self.cache.forget(shard)
        args = [(sp.prefix(t, shard), ids, rows) for t, ids, rows in groups]
        extra = [[b"SET", sp.meta_key("applied", shard), b"%d" % step]] if step is not None else []
        self.fit(shard)

        def run():
            with self.links.locks[shard]:
                return self.links.wires[shard].set_rows(args, extra)

        return self.links.mapped(shard, run)

    def lay_rows(
        self, shard: int, groups: list[tuple[int, np.ndarray, np.ndarray]], step: int | None, chunk_rows: int = 65_536
    ) -> int:
        """Rows laid on a shard that is being restored (a log replay, an overlay, a flush): as
        ``write_shard``, but pipelined in chunks of ``chunk_rows`` rows, the server applying one chunk
        while the next is encoded and sent, the applied marker last. Not one transaction: a restore
        cut short is redone whole. -> rows written."""
        sp = self.space
        self.cache.forget(shard)
        self.fit(shard)
        pieces = [
            (sp.prefix(t, shard), ids[lo : lo + chunk_rows], rows[lo : lo + chunk_rows])
            for t, ids, rows in groups
            for lo in range(0, len(ids), chunk_rows)
        ]
        last = [[b"SET", sp.meta_key("applied", shard), b"%d" % step]] if step is not None else []
        wire = self.links.wires[shard]

        def run() -> int:
            with self.links.locks[shard]:
                reply = None
                for piece in pieces:
                    sent = wire.send_rows([piece], [], [])
                    if reply is not None:
                        wire.finish(reply)
                    reply = sent
                if reply is not None:
                    wire.finish(reply)
                if last:  # only once every row is acknowledged: the marker never runs ahead of them
                    wire.finish(wire.send_rows([], [], last))
            return sum(len(p[1]) for p in pieces)

        return self.links.mapped(shard, run)

    def write_nowhere(self) -> None:
        """From now on the row writes are built and never sent (``rows_nowhere``)."""
        self.rows_nowhere = True

    def close(self) -> None:
        self.pool.shutdown(wait=True)
