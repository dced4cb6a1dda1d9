"""The Redis-backed store: rows sharded over several ``redis-server`` processes.

Layout (``embeddings.buckets``): rows sit in Redis hashes of ``span`` consecutive row ids, key
``{namespace}:{table_index}:`` followed by ``row // span`` as 8 bytes big-endian, field
``row % span`` (1 or 2 bytes), value the row's ``[dim + state]`` little-endian float32 bytes
(fixed width per table); each hash stays a listpack on the server, about 1.2x the rows' bytes
against 2.5x for a string per row. Bulk reads and writes go through ``embeddings.wire``
(numpy-encoded pipelined HGET/HSET); reads of several shards run in parallel from a thread pool
(socket I/O releases the GIL), a step's writes are sent to every shard before any reply is read
(``write_step``). A server keeps the hashes compact only under its ``hash-max-listpack-*`` limits:
the store raises them with ``CONFIG SET`` before its first write to a server, and where that is
refused, warns once (one line) and writes on: the rows are exact, only bigger.

Per shard, bookkeeping keys ``{namespace}:meta:applied`` (the last step whose update the shard
applied) and ``{namespace}:meta:undo`` (that step's rows as they were before it, for a rollback of
one step after a trainer restart).
"""

from __future__ import annotations

import contextlib
import struct
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np
import redis
from redis.crc import key_slot

from embeddings import groups as codec
from embeddings import rowkeys
from embeddings.buckets import BucketLayout, fit_listpack
from embeddings.cluster import is_cluster_url, node_url, owner_of, owners, seed_urls, shard_tags
from embeddings.endpoints import POLICY_FIX, one_try, policy_problem, redact, server_state
from embeddings.errors import (
    EndpointError,
    ShardDataError,
    ShardEvictedError,
    ShardTimeoutError,
    ShardUnavailableError,
    StoreAuthError,
)
from embeddings.held import HeldRows
from embeddings.optim import RowOptimizer, initial_state
from embeddings.outage import OutageRows
from embeddings.rowinit import init_rows_keys
from embeddings.shard_map import ShardMap
from embeddings.store import IdsByTable, StoreBase
from embeddings.tables import TableSet
from embeddings.wire import RowConnection, WireError

T = TypeVar("T")
BEHIND = "write-behind"  # the write-behind thread's name


class RedisStore(StoreBase):
    """Rows of every table, sharded over Redis endpoints by a ``ShardMap``.

    ``urls`` are ``redis://`` or ``rediss://`` (TLS) URLs, optionally with ``user:password@``.
    Every call is bounded by ``timeout_s``; a shard that is dead or does not answer in time raises
    ``ShardUnavailableError`` (or its subclass ``ShardTimeoutError``) naming shard and endpoint.
    ``connection_kwargs`` pass through to ``redis.Redis`` (e.g. ``ssl_ca_certs``).
    """

    def __init__(
        self,
        urls: Sequence[str],
        tables: TableSet,
        optimizer: RowOptimizer,
        *,
        namespace: str = "recsys",
        seed: int = 0,
        placement: str = "row",
        timeout_s: float = 5.0,
        connection_kwargs: dict | None = None,
        replica_urls: Sequence[str] | None = None,
    ) -> None:
        super().__init__(tables, optimizer, seed)
        if not urls:
            raise ValueError("RedisStore needs at least one shard URL")
        if not namespace or any(c in namespace for c in ": \t\n"):
            raise ValueError(f"namespace {namespace!r} must be non-empty without ':' or spaces")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.cluster: list[str] | None = None  # seed node URLs when the tier is a Redis Cluster
        if is_cluster_url(urls[0]):
            if len(set(urls)) != 1:
                raise ValueError("a Redis Cluster tier takes one redis+cluster:// URL (for every logical shard)")
            self.cluster = seed_urls(urls[0])
        else:
            for u in urls:
                if urlsplit(u).scheme not in ("redis", "rediss"):
                    raise ValueError(f"shard URL {redact(u)!r} must start with redis:// or rediss://")
        self.urls = list(urls)
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.shard_map = ShardMap(tables, len(urls), placement)  # type: ignore[arg-type]
        # a bucket's rows are hashed over every shard (``row`` placement), so its span grows with them
        self.layout = BucketLayout(spread=len(urls) if placement == "row" else 1)
        self._listpack_ok = [False] * len(urls)  # the server's listpack limits checked on this connection
        self.restore_refused: dict[str, str] = {}  # endpoint -> why it refused RESTORE (load_snapshot)
        self.sync_refused: dict[str, str] = {}  # endpoint -> why it did not load a snapshot as a sync
        # a benchmark's ceiling (``RECSYS_ROWS_NOWHERE=1``, bench_throughput's limit row): the row
        # writes are built and never sent, so the rows live in this process's held rows alone
        self.rows_nowhere = False
        self.warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
        kwargs = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=one_try(),  # bounded: the recovery layer owns retries
            health_check_interval=0,
            protocol=2,  # embeddings.wire speaks RESP2 (nil is $-1)
        )
        kwargs.update(connection_kwargs or {})
        self._kwargs = kwargs
        self._tags: list[str] | None = None
        self._scales = np.array([spec.scale for spec in tables], np.float32)  # lazy init per table
        self.held: HeldRows | None = None
        self._last_held_read: tuple[int, np.ndarray, np.ndarray] | None = None  # (held version, keys, rows)
        self._from_redis = 0  # > 0: reads skip held rows (evaluation, digest: what the tier holds)
        # the rows of shards that are away (restored in the background under --train-through):
        # reads of their rows are answered here, never by their servers (``embeddings.outage``)
        self.outage: OutageRows | None = None
        if self.cluster is not None:
            try:
                ranges = owners(self.cluster, kwargs)
            except redis.RedisError as e:
                raise ShardUnavailableError(0, urls[0].split("@")[-1], str(e)) from None
            self._tags = shard_tags(namespace, len(urls), ranges)
            self.urls = [self._owner_url(s, ranges) for s in range(len(urls))]
        self.endpoints = [redact(u) for u in self.urls]
        if replica_urls is not None and len(replica_urls) != len(urls):
            raise ValueError(f"{len(replica_urls)} replica URLs for {len(urls)} shards: one per shard")
        self.replica_urls: list[str | None] = list(replica_urls) if replica_urls else [None] * len(urls)
        self._pools = [self._new_pool(u) for u in self.urls]
        self._clients = [redis.Redis(connection_pool=p) for p in self._pools]
        self._wires = [RowConnection(p, timeout_s, self.layout) for p in self._pools]
        self._locks = [threading.Lock() for _ in urls]  # one bulk call per shard socket at a time
        self._timed_out = [-1e18] * len(urls)  # when a row call last timed out (monotonic)
        self._pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="shard")
        self._behind_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=BEHIND)
        self.behind_wait_s = 0.0  # the training path waiting at the commit point of a write-behind
        self.rows_written = 0  # rows the training steps' writes put on their shards
        self.reload_s = 0.0  # reading held rows back after their shard was restored (``reload_held``)
        self.reload_kept = self.reload_absent = self.reload_read = (
            0  # rows of restored shards: held again, absent, read
        )
        self._behind: Future | None = None  # write_behind in flight (its commit point: join_behind)
        self._evictions: dict[int, tuple[str, int | None]] = {}  # shard -> (server run_id, evicted_keys) noted

    def _new_pool(self, url: str) -> redis.ConnectionPool:
        pool = redis.ConnectionPool.from_url(url, **self._kwargs)
        pool.connection_kwargs["protocol"] = 2  # a ?protocol=3 in a URL must not change the wire format
        return pool

    @property
    def num_shards(self) -> int:
        return len(self._clients)

    def key_namespace(self, shard: int) -> str:
        """What a shard's keys start with: the namespace, or on a cluster its hash tag ``{ns.S.J}``."""
        return self.namespace if self._tags is None else "{" + self._tags[shard] + "}"

    def prefix(self, table_index: int, shard: int) -> bytes:
        return f"{self.key_namespace(shard)}:{table_index}:".encode()

    def meta_key(self, name: str, shard: int) -> bytes:
        """A per-shard bookkeeping key of this namespace (not a row: rows have 8 binary id bytes)."""
        return f"{self.key_namespace(shard)}:meta:{name}".encode()

    def key(self, table_index: int, row: int) -> bytes:
        """The Redis key of one row: its bucket (a hash; the row is its field ``location(...)[1]``)."""
        return self.location(table_index, row)[0]

    def location(self, table_index: int, row: int) -> tuple[bytes, bytes]:
        """(key, field) of one row: the hash of its bucket and its field there."""
        shard = int(self.shard_map.shard_of(table_index, np.array([row]))[0])
        return self.layout.location(self.prefix(table_index, shard), int(row), 4 * self.width(table_index))

    def _fit_listpack(self, shard: int) -> None:
        """Before the first row write on a shard's connection: the server's listpack limits raised to
        what the buckets need (``CONFIG SET``); where it refuses, one warning line and on."""
        if self._listpack_ok[shard]:
            return
        widths = [4 * self.width(t) for t in range(len(self.tables.specs))]
        entries = max(self.layout.max_fields(w) for w in widths)
        problem = self.call(shard, lambda c: fit_listpack(c, entries, max(widths)))
        self._listpack_ok[shard] = True
        if problem:
            self.warn(f"warning: shard {shard} at {self.endpoints[shard]}: {problem}")

    def _owner_url(self, shard: int, ranges) -> str:
        host, port = owner_of(ranges, key_slot(self._tags[shard].encode()))
        return node_url(self.cluster[0], host, port)

    # -- error mapping -------------------------------------------------------------------
    def _call(self, shard: int, fn: Callable[[], T]) -> T:
        endpoint = self.endpoints[shard]
        try:
            return fn()
        except redis.AuthenticationError as e:
            raise StoreAuthError(shard, endpoint, str(e)) from None
        except redis.TimeoutError as e:
            raise ShardTimeoutError(shard, endpoint, f"no answer within {self.timeout_s}s ({e})") from None
        except redis.ConnectionError as e:
            raise ShardUnavailableError(shard, endpoint, str(e) or type(e).__name__) from None
        except (redis.ResponseError, WireError) as e:
            msg = str(e)
            if "WRONGPASS" in msg or "NOAUTH" in msg or "NOPERM" in msg:
                raise StoreAuthError(shard, endpoint, msg) from None
            if msg.startswith(("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK")):
                # up but not serving this shard now (loading, failing over, slot moved): unavailable for now
                raise ShardUnavailableError(shard, endpoint, msg) from None
            raise ShardDataError(f"shard {shard} at {endpoint}: {msg}") from None

    def _on_shards(self, work: dict[int, Callable[[], T]]) -> dict[int, T]:
        if len(work) == 1:  # one shard: no hop through the pool
            ((s, fn),) = work.items()
            return {s: self._call(s, fn)}
        futures = {s: self._pool.submit(self._call, s, fn) for s, fn in work.items()}
        # collect every result before raising so no call outlives this one
        results, first_error = {}, None
        for s, f in futures.items():
            try:
                results[s] = f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def ping(self) -> list[bool]:
        """Per shard: True when it answers PING within the timeout."""
        out = []
        for s, c in enumerate(self._clients):
            try:
                out.append(bool(self._call(s, c.ping)))
            except ShardUnavailableError:
                out.append(False)
        return out

    # -- evictions (connect and commit points, never per step) ------------------------------------
    def watch_evictions(self) -> None:
        """At connect: refuse a shard whose ``maxmemory-policy`` can evict the run's rows (``EndpointError``:
        shard, endpoint, policy, fix) and note each shard's ``evicted_keys``, the baseline
        ``check_evictions`` compares with. A shard that does not answer now is noted when it does."""
        for s in range(self.num_shards):
            try:
                self._note_server(s, self.call(s, server_state))
            except ShardUnavailableError:
                continue  # dead now: the recovery protocol meets it at its first call

    def check_evictions(self, resume: str | None = None, why_not: str = "") -> None:
        """At a commit point (rank 0 after a checkpoint's forks, and at the end): one INFO per shard.

        A server that evicted keys since its baseline lost rows of the run, which would read back as
        never written and be initialised again (unless it runs a volatile-* policy now: those evict
        only keys with a TTL, none of the run's, and the baseline moves on). The recovery protocol
        cannot repair that while the server keeps evicting (a restore would be evicted in turn), so
        the run stops with one line (``ShardEvictedError``): the shard, its endpoint, how many keys,
        the fix, and what then:
        ``resume`` (``--resume DIR``), for which the shard's applied marker is dropped first, so that
        the resumed run finds it at no step and restores it under its strategy; else a new run
        (``why_not``: why this one cannot be resumed). A policy that evicts, set since the connect,
        stops the run too, nothing lost yet (the marker stays). A server replaced since (a restore, a
        restart by its supervisor, a promoted replica: another ``run_id``) gets a new baseline, its
        policy checked as at connect. A dead shard raises ``ShardUnavailableError``: call it under
        the protocol."""
        for s in range(self.num_shards):
            state = self.call(s, server_state)
            base = self._evictions.get(s)
            if base is None or base[0] != state["run_id"] or base[1] is None:
                self._note_server(s, state)
                continue
            policy, evicted = state["maxmemory_policy"], state["evicted_keys"]
            then = f"then finish the run with {resume}" if resume else f"then run it again ({why_not})"
            if evicted is not None and evicted > base[1] and not policy.startswith("volatile-"):
                if resume:
                    try:  # a shard with no applied marker is empty to a resume: it restores it first
                        self.call(s, lambda c, s=s: c.unlink(self.meta_key("applied", s)))
                        then += ", which restores the shard first"
                    except (ShardUnavailableError, StoreAuthError, ShardDataError) as e:
                        then = f"then run it again (the shard's marker could not be dropped for a resume: {e})"
                raise ShardEvictedError(
                    s,
                    self.endpoints[s],
                    f"the server evicted {evicted - base[1]} keys during the run (maxmemory-policy {policy}): "
                    f"rows of the run are lost there and would read back as never written; run `{POLICY_FIX}` "
                    f"on it, {then}",
                )
            problem = policy_problem(policy)
            if problem:
                raise ShardEvictedError(s, self.endpoints[s], f"set during the run: {problem}; {then}")
            self._evictions[s] = (base[0], evicted)  # keys with a TTL (volatile-*), another tenant's: not ours

    def _note_server(self, shard: int, state: dict) -> None:
        problem = policy_problem(state["maxmemory_policy"])
        if problem:
            raise EndpointError(f"shard {shard} at {self.endpoints[shard]}: {problem}")
        self._evictions[shard] = (state["run_id"], state["evicted_keys"])

    # -- StoreBase hooks -----------------------------------------------------------------
    def _fetch(self, requests: IdsByTable):
        out = {}
        generation = self.held.generation if self.held is not None else 0
        for t, ids in requests.items():
            out[t] = (np.empty((len(ids), self.width(t)), np.float32), np.zeros(len(ids), bool))
        # shard -> list of (table, positions into the request's ids); rows this trainer holds are not read
        plan: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, ids in requests.items():
            idx = None
            got = self.held.lookup(t, ids) if self.held is not None and not self._from_redis else None
            if got is not None and (len(got[0]) or len(got[2])):
                out[t][0][got[0]] = got[1]
                out[t][1][got[2]] = True  # never written: the lazy init fills it
                rest = np.ones(len(ids), bool)
                rest[got[0]] = False
                rest[got[2]] = False
                idx = np.flatnonzero(rest)
            if idx is not None and not len(idx):
                continue  # every row held (or known never written): nothing to read
            for s, pos in enumerate(self.shard_map.split(t, ids if idx is None else ids[idx])):
                if len(pos):
                    plan.setdefault(s, []).append((t, pos if idx is None else idx[pos]))

        def pull_from(s: int, groups: list[tuple[int, np.ndarray]]):
            args = [(self.prefix(t, s), requests[t][pos], 4 * self.width(t)) for t, pos in groups]

            def run():
                with self._bulk(s):
                    return self._wires[s].get_rows(args)

            return run

        replies = self._on_shards({s: pull_from(s, g) for s, g in plan.items()})
        for s, groups in plan.items():
            for (t, pos), (rows, missing) in zip(groups, replies[s]):
                out[t][0][pos] = rows.view("<f4").reshape(len(pos), self.width(t))
                out[t][1][pos] = missing
                if self.held is not None and s in self.held.shards and not self._from_redis:
                    if missing.any():
                        self.held.absent(t, requests[t][pos[missing]], generation)
                    if not missing.all():  # the writer holds them from now on
                        present = ~missing
                        self.held.found(t, requests[t][pos[present]], out[t][0][pos[present]], generation)
        return out

    def _store(self, requests, step=None, undo=None):
        """Plain rows (``write_rows``, ``update_many``). A training step's write, with its applied
        marker and undo record, goes through ``_store_keys`` -> ``write_step``."""
        if step is not None:
            raise ValueError("RedisStore writes a step's rows with apply_keys(keys, grads, step)")
        plan: dict[int, list[tuple[int, np.ndarray]]] = {}
        for t, (ids, _) in requests.items():
            for s, pos in enumerate(self.shard_map.split(t, ids)):
                if len(pos):
                    plan.setdefault(s, []).append((t, pos))

        def push_to(s: int, groups):
            args = [(self.prefix(t, s), requests[t][0][pos], requests[t][1][pos]) for t, pos in groups]

            def run():
                with self._bulk(s):
                    self._fit_listpack(s)
                    n = self._wires[s].set_rows(args)
                if self.held is not None and s in self.held.shards:  # written: now held as written
                    for t, pos in groups:
                        self.held.put(t, requests[t][0][pos], requests[t][1][pos])
                return n

            return run

        self._on_shards({s: push_to(s, g) for s, g in plan.items()})

    def read_keys(self, keys: np.ndarray) -> np.ndarray:
        """Rows of sorted packed keys: rows of shards away from their outage's rows, held rows by one
        gather, never-written rows by the lazy init, the rest read from their shards."""
        away = self.outage.split(keys) if self.outage is not None else None  # never read from their servers
        if away is None:
            return self._read_present(keys)
        out = np.empty((len(keys), self.width(int(keys[0] >> rowkeys.ROW_BITS))), np.float32)
        out[away] = self.outage.read(keys[away])
        if not away.all():
            out[~away] = self._read_present(keys[~away])
        return out

    def _read_present(self, keys: np.ndarray) -> np.ndarray:
        if self.held is None or self._from_redis or not len(keys):
            return super().read_keys(keys)
        last = self._last_held_read
        if last is not None and last[0] == self.held.version and (last[1] is keys or np.array_equal(last[1], keys)):
            return last[2]  # a step's update reads the rows its stage read, unchanged since: no second gather
        version = self.held.version
        rows = self.held.read_keys(keys)  # every row held or never written (the usual step): one gather
        if rows is not None:
            self._last_held_read = (version, keys, rows)
            return rows
        t0 = int(keys[0] >> rowkeys.ROW_BITS)
        pos, rows, absent = self.held.lookup_keys(keys)
        if len(pos) == len(keys):  # every row held (the usual step): the gather is the answer
            self._last_held_read = (version, keys, rows)
            return rows
        out = np.empty((len(keys), self.width(t0)), np.float32)
        out[pos] = rows
        if len(absent):
            dim = self.tables.specs[t0].dim
            out[absent, :dim] = init_rows_keys(self.seed, keys[absent], dim, self._scales)
            out[absent, dim:] = initial_state(self.optimizer)
        if len(pos) + len(absent) < len(keys):
            rest = np.ones(len(keys), bool)
            rest[pos] = False
            rest[absent] = False
            idx = np.flatnonzero(rest)
            out[idx] = super().read_keys(keys[idx])
        else:  # every row held or known never written: current until the held rows change
            self._last_held_read = (version, keys, out)
        return out

    def _store_keys(self, keys, rows, step=None, undo=None) -> None:
        failed = self.write_step(keys, rows, self.shard_map.shard_of_keys(keys), step, undo)
        if failed:
            raise next(iter(failed.values()))

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
        thread waits for the write first (``_bulk``), so nothing reads a shard behind it. ``before``
        runs on the write-behind thread first (what must be durable before the rows move).

        ``window``: the rows of several steps up to ``step``, already held (``hold_written``), and
        ``undo`` their values as of each shard's last write: each shard's undo record is named for
        the step after the one its applied marker shows (see ``rollback``). ``after`` runs on the
        write-behind thread once every shard took the write (none failed)."""
        if self._behind is not None:
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

        self._behind = self._behind_pool.submit(write)

    def hold_written(
        self, keys: np.ndarray, rows: np.ndarray, shards: np.ndarray, step: int, pin: bool = False
    ) -> None:
        """Rows handed to a write-behind are held at once: the next step reads them from here.
        ``pin``: an open window's, not on their shards until it is written (``HeldRows.unpin``)."""
        if self.held is not None:
            if len(self.held.shards) < self.num_shards:
                mine = np.isin(shards, list(self.held.shards))
                self.held.put_keys(keys[mine], rows[mine], step, pin)
            else:  # one writer of every shard: no mask, no copy
                self.held.put_keys(keys, rows, step, pin)

    def join_behind(self) -> dict[int, ShardUnavailableError]:
        """The commit point of the last ``write_behind``: waits for it. -> the shards that failed."""
        f, self._behind = self._behind, None
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
        failed: dict[int, ShardUnavailableError] = {}
        sent = []
        with contextlib.ExitStack() as locks:
            for s in np.unique(shards).tolist():
                mine = shards == s
                at = slice(None) if mine.all() else np.flatnonzero(mine)
                k, r = keys[at], rows[at]
                groups = rowkeys.table_groups(k)
                args = [(self.prefix(t, s), ids, r[lo:hi]) for t, (ids, lo, hi) in groups.items()]
                first, last = [], []  # undo record before the rows, applied marker after them
                try:
                    self._call(s, lambda s=s: locks.enter_context(self._bulk(s)))
                    self._fit_listpack(s)
                    if step is not None:
                        if undo is not None:
                            # a window's undo record covers the steps since the shard's last write
                            since = self._call(s, lambda s=s: self._marker(s)) + 1 if window else step
                            u = undo[at]
                            blob = encode_groups(since, [(t, ids, u[lo:hi]) for t, (ids, lo, hi) in groups.items()])
                            first.append([b"SET", self.meta_key("undo", s), blob])
                        last.append([b"SET", self.meta_key("applied", s), b"%d" % step])
                    if self.rows_nowhere:  # the benchmark's ceiling: the commands built, never sent
                        reply = self._wires[s]._row_commands(args)
                    else:
                        reply = self._call(s, lambda s=s, a=args, f=first, la=last: self._wires[s].send_rows(a, f, la))
                except ShardUnavailableError as e:
                    failed[s] = self._timed(s, e)
                    continue
                sent.append((s, k, r, reply))
            for s, k, r, reply in sent:
                try:
                    if not self.rows_nowhere:
                        self._call(s, lambda s=s, reply=reply: self._wires[s].finish(reply))
                except ShardUnavailableError as e:
                    failed[s] = self._timed(s, e)
                    continue
                self.rows_written += len(k)
                if hold and self.held is not None and s in self.held.shards:  # written: now held as written
                    self.held.put_keys(k, r, step)
        return failed

    def _timed(self, shard: int, error: ShardUnavailableError) -> ShardUnavailableError:
        if isinstance(error, ShardTimeoutError):  # as ``_bulk`` does: calls queued behind it fail at once
            self._timed_out[shard] = time.monotonic()
        return error

    @contextlib.contextmanager
    def _bulk(self, shard: int):
        """A row read or write on one shard. A call that queued for the shard while the call before it
        timed out fails at once: a write behind a timed-out prefetch does not wait a second time
        before the failure is seen."""
        behind = self._behind
        if behind is not None and not threading.current_thread().name.startswith(BEHIND):
            futures_wait([behind])  # a write-behind in flight reaches the shard first
        queued = time.monotonic()
        with self._locks[shard]:
            if self._timed_out[shard] >= queued:
                raise redis.TimeoutError("the call before this one timed out")
            try:
                yield
            except (redis.TimeoutError, ShardTimeoutError):
                self._timed_out[shard] = time.monotonic()
                raise

    def initial_rows(self, keys: np.ndarray) -> np.ndarray:
        """The initial rows [n, width] of packed keys of tables of one row width (lazy-init weights,
        the optimizer's initial state)."""
        t = int(keys[0] >> rowkeys.ROW_BITS) if len(keys) else 0
        dim = self.tables.specs[t].dim
        rows = np.full((len(keys), self.width(t)), initial_state(self.optimizer), np.float32)
        rows[:, :dim] = init_rows_keys(self.seed, keys, dim, self._scales)
        return rows

    def hold_rows(self, shards: set[int], budget_bytes: int) -> HeldRows:
        """Keep the rows of ``shards`` (the ones this process writes) in memory as they are written."""
        widths = [self.width(t) for t in range(len(self.tables.specs))]
        init = self.initial_rows  # held tables share one row width, hence one dim

        self.held = HeldRows(
            self.tables,
            widths,
            shards,
            budget_bytes,
            owner_of=self.shard_map.shard_of,
            init=init,
            owner_of_keys=self.shard_map.shard_of_keys,
            num_shards=self.num_shards,
        )
        return self.held

    def assume_fresh(self) -> None:
        """A fresh run: the held shards that never applied a step hold none of its rows yet, so a row
        of theirs this writer has not written is known absent (no first read from Redis)."""
        if self.held is None:
            return
        fresh = {s for s in self.held.shards if self.applied_step(s) is None}
        if fresh:
            self.held.assume_fresh(fresh)

    def reload_held(
        self,
        shard: int,
        kept_upto: int | None = None,
        absent_after: int | None = None,
        overlay: tuple[np.ndarray, int] | None = None,
    ) -> int:
        """After a shard was restored: read back the rows this writer held on it (one bulk read), so
        that the steps after the recovery read them from memory again and its write-behind keeps
        overlapping them; rows no longer on the shard are known never written. With the restore's
        steps (``HeldRows.restored``), rows unchanged by it are held again without a read and rows
        first written after it are known never written. -> rows read."""
        if self.held is None or shard not in self.held.shards:
            return 0
        t0 = time.perf_counter()
        if kept_upto is None or absent_after is None:
            self.held.drop_forgotten(shard)
        else:
            kept, gone = self.held.restored(shard, kept_upto, max(kept_upto, absent_after), overlay)
            self.reload_kept += kept
            self.reload_absent += gone
        requests = self.held.unknown(shard)
        if requests:
            self._fetch(requests)
        self.reload_s += time.perf_counter() - t0
        n = sum(len(ids) for ids in requests.values())
        self.reload_read += n
        return n

    def reinstate_held(self, shard: int) -> int:
        """After a shard was restored to exactly what this writer wrote to it (its log replayed up to
        the writer's last step): the rows it held there are held again, no read. -> rows held again."""
        if self.held is None or shard not in self.held.shards:
            return 0
        return self.held.reinstate(shard)

    @contextlib.contextmanager
    def from_redis(self):
        """Reads inside go to the shards even for held rows: an evaluation or a digest checks what the
        tier holds (and a shard that died meanwhile is seen there)."""
        self._from_redis += 1
        try:
            yield
        finally:
            self._from_redis -= 1

    def _forget(self, shard: int | None = None) -> None:
        """A shard changed behind the writers' backs (restore, rollback, failover): its held rows go
        (None: every shard's)."""
        if self.held is not None:
            self.held.clear(shard)

    # -- per-shard operations (recovery) ----------------------------------------------------
    def client(self, shard: int) -> redis.Redis:
        return self._clients[shard]

    def endpoint(self, shard: int) -> str:
        return self.endpoints[shard]

    def call(self, shard: int, fn: Callable[[redis.Redis], T]) -> T:
        """Run ``fn(client)`` on one shard with the store's error mapping."""
        return self._call(shard, lambda: fn(self._clients[shard]))

    def reconnect(self, shard: int) -> None:
        """Drop this shard's connections (its server was replaced); the next call opens new ones. On
        a cluster, the shard follows its slot to the node that serves it now (after a failover)."""
        self._forget(shard)
        with self._locks[shard]:
            self._wires[shard].close()
            self._timed_out[shard] = -1e18
            self._listpack_ok[shard] = False  # the server may be another one now
        self._pools[shard].disconnect()
        if self.cluster is not None:
            known = list(dict.fromkeys(u for u in self.urls if u != self.urls[shard])) + self.cluster
            try:
                url = self._owner_url(shard, owners(known, self._kwargs))
            except redis.RedisError:
                return  # no node answers now: the next call fails and recovery tries again
            if url != self.urls[shard]:
                self._repoint(shard, url)

    def _repoint(self, shard: int, url: str) -> None:
        self._forget(shard)
        with self._locks[shard]:
            self._wires[shard].close()
            self._pools[shard].disconnect()
            self._pools[shard] = self._new_pool(url)
            self._clients[shard] = redis.Redis(connection_pool=self._pools[shard])
            self._wires[shard] = RowConnection(self._pools[shard], self.timeout_s, self.layout)
            self.urls[shard], self.endpoints[shard] = url, redact(url)
            self._listpack_ok[shard] = False

    def has_replica(self, shard: int) -> bool:
        return self.cluster is not None or self.replica_urls[shard] is not None

    def promote(self, shard: int) -> None:
        """Make the shard's replica a primary (``REPLICAOF NO ONE``) and serve the shard from it."""
        url = self.replica_urls[shard]
        if url is None:
            raise ShardDataError(f"shard {shard} at {self.endpoints[shard]}: no replica left to promote")
        client = redis.Redis(connection_pool=self._new_pool(url))
        try:
            self._call(shard, lambda: client.execute_command("REPLICAOF", "NO", "ONE"))
        finally:
            client.close()
            client.connection_pool.disconnect()
        self.failover(shard)

    def failover(self, shard: int) -> None:
        """Serve the shard from its (promoted) replica from now on; it has no replica left."""
        if self.cluster is not None:
            self.reconnect(shard)  # the cluster promoted the replica: follow the slot
            return
        url = self.replica_urls[shard]
        if url is None:
            return  # already done
        self._repoint(shard, url)
        self.replica_urls[shard] = None

    def wait_replicated(self, shard: int, timeout_ms: int = 1000) -> int:
        """``WAIT 1``: block until the shard's replica has every write so far; -> replicas that have them."""
        return int(self.call(shard, lambda c: c.execute_command("WAIT", 1, timeout_ms)))

    def _marker(self, shard: int) -> int:
        """The shard's applied marker (0: never applied), read under its lock, held by the caller."""
        raw = self._wires[shard].get(self.meta_key("applied", shard))
        return 0 if raw is None else int(raw)

    def _locked_get(self, shard: int, key: bytes) -> bytes | None:
        with self._locks[shard]:
            return self._wires[shard].get(key)

    def applied_step(self, shard: int) -> int | None:
        """The last step whose update this shard applied (None: never)."""
        raw = self._call(shard, lambda: self._locked_get(shard, self.meta_key("applied", shard)))
        return None if raw is None else int(raw)

    def applied_steps(self) -> list[int | None]:
        """Per shard: the last step whose update it applied (None: never)."""

        def get(s: int):
            def run():
                with self._locks[s]:
                    v = self._wires[s].get(self.meta_key("applied", s))
                return None if v is None else int(v)

            return run

        res = self._on_shards({s: get(s) for s in range(self.num_shards)})
        return [res[s] for s in range(self.num_shards)]

    def write_shard(self, shard: int, groups: list[tuple[int, np.ndarray, np.ndarray]], step: int | None) -> int:
        """Write rows (table index, ids, rows [n, width]) onto one shard, with its applied-step marker."""
        self._forget(shard)
        args = [(self.prefix(t, shard), ids, rows) for t, ids, rows in groups]
        extra = [[b"SET", self.meta_key("applied", shard), b"%d" % step]] if step is not None else []
        self._fit_listpack(shard)

        def run():
            with self._locks[shard]:
                return self._wires[shard].set_rows(args, extra)

        return self._call(shard, run)

    def lay_rows(
        self, shard: int, groups: list[tuple[int, np.ndarray, np.ndarray]], step: int | None, chunk_rows: int = 65_536
    ) -> int:
        """Rows laid on a shard that is being restored (a log replay, an overlay, a flush): as
        ``write_shard``, but pipelined in chunks of ``chunk_rows`` rows, the server applying one chunk
        while the next is encoded and sent, the applied marker last. Not one transaction: a restore
        cut short is redone whole. -> rows written."""
        self._forget(shard)
        self._fit_listpack(shard)
        pieces = [
            (self.prefix(t, shard), ids[lo : lo + chunk_rows], rows[lo : lo + chunk_rows])
            for t, ids, rows in groups
            for lo in range(0, len(ids), chunk_rows)
        ]
        last = [[b"SET", self.meta_key("applied", shard), b"%d" % step]] if step is not None else []
        wire = self._wires[shard]

        def run() -> int:
            with self._locks[shard]:
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

        return self._call(shard, run)

    def rollback(self, shard: int, to_step: int) -> int:
        """Back to ``to_step``: undo the one write a shard applied after it, or the rows a writer that
        died part way through the write after ``to_step`` left (marker still at ``to_step``, undo
        record of ``to_step + 1``). A write covers one step, or a window of steps up to the marker
        (``write_every``); its undo record is named for its first step. Returns rows restored."""
        self._forget(shard)
        applied = self.applied_step(shard) or 0  # never applied: cut short in its first step, or untouched
        if applied < to_step:
            return 0
        blob = self._call(shard, lambda: self._locked_get(shard, self.meta_key("undo", shard)))
        try:
            undo_step, groups = decode_groups(blob) if blob else (None, [])
        except codec.GroupsError as e:
            raise ShardDataError(f"shard {shard} at {self.endpoints[shard]}: its undo record is damaged ({e})") from e
        if applied == to_step:  # complete at to_step, unless a write of to_step + 1 was cut short
            if undo_step != to_step + 1:
                return 0
        elif blob is None:
            raise ShardDataError(f"shard {shard} at {self.endpoints[shard]}: applied step {applied} has no undo record")
        if undo_step != to_step + 1:
            raise ShardDataError(
                f"shard {shard} at {self.endpoints[shard]}: at step {applied}, cannot roll back to {to_step} "
                f"(undo record is for step {undo_step}; one write can be undone)"
            )
        args = [(self.prefix(t, shard), ids, rows) for t, ids, rows in groups]
        extra = [
            [b"SET", self.meta_key("applied", shard), b"%d" % to_step],
            [b"SET", self.meta_key("undo", shard), b""],
        ]
        self._fit_listpack(shard)

        def run():
            with self._locks[shard]:
                return self._wires[shard].set_rows(args, extra)

        return self._call(shard, run)

    def clear_shard(self, shard: int) -> int:
        """Delete every key of this namespace on one shard; returns how many."""
        self._forget(shard)
        return self._call(shard, lambda: self._unlink_keys(shard))

    def _unlink_keys(self, shard: int) -> int:
        c, n = self._clients[shard], 0
        for batch in _chunks(c.scan_iter(match=self._match(shard), count=10_000), 10_000):
            n += c.unlink(*batch)
        return n

    def _match(self, shard: int) -> str:
        """SCAN pattern of a shard's keys (a cluster tag's braces are literal in a pattern)."""
        return self.key_namespace(shard).replace("[", "\\[") + ":*"

    def snapshot(self, shard: int, dest, timeout_s: float = 600.0):
        """A ``NetworkSnapshot`` of one shard into ``dest``; ``start()`` it at the snapshot point."""
        from embeddings.rdb import NetworkSnapshot

        def info() -> dict:
            return self.call(shard, lambda c: c.info("persistence"))

        return NetworkSnapshot(self._pools[shard], info, dest, shard, self.endpoints[shard], timeout_s)

    def load_snapshot(self, shard: int, path) -> int:
        """This namespace's keys of the RDB file at ``path`` onto one shard, over the protocol: one
        ``RESTORE`` per key, else (a server that refuses it, said in one line) one HSET per bucket
        (``embeddings.snapshot_load``); -> the bytes sent."""
        from embeddings.snapshot_load import load_snapshot

        return load_snapshot(self, shard, path)

    # -- maintenance ---------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every key of this namespace on every shard; returns how many."""
        self._forget()

        work = {s: (lambda s=s: self._unlink_keys(s)) for s in range(self.num_shards)}
        return sum(self._on_shards(work).values())

    def close(self) -> None:
        self._behind_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for w in self._wires:
            w.close()
        for p in self._pools:
            p.disconnect()


_UNDO_STEP = struct.Struct("<Q")


def encode_groups(step: int, groups: list[codec.Group]) -> bytes:
    """An undo record: the step (u64, little-endian), then the rows' groups (``embeddings.groups``)."""
    return codec.encode(groups, prefix=_UNDO_STEP.pack(step))


def decode_groups(blob: bytes) -> tuple[int, list[codec.Group]]:
    """An undo record -> (its step, its groups); ``GroupsError`` when it does not decode."""
    if len(blob) < _UNDO_STEP.size:
        raise codec.GroupsError(f"{len(blob)} bytes, too short for an undo record")
    return _UNDO_STEP.unpack_from(blob)[0], codec.decode(blob, _UNDO_STEP.size, copy=True)


def _chunks(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch
