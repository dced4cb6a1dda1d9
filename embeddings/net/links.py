"""The store's connections to its shards: pools, row sockets, reconnects and failover, and the
mapping of every client error to the store's errors (shard and endpoint named).

One ``ShardLinks`` per ``RedisStore`` (its ``links``). Per shard it holds a ``redis`` connection
pool and client (control commands), an ``embeddings.net.wire.RowConnection`` (bulk row traffic) and the
lock that lets one bulk call at a time use that socket. A shard served by another process from now
on (a restart, a promoted replica, a cluster failover) gets new connections here; ``forget(shard)``
is called first, so that the writer's held rows of it go too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import redis
from redis.crc import key_slot

from embeddings.errors import ShardDataError, ShardTimeoutError, ShardUnavailableError, StoreAuthError
from embeddings.net.cluster import is_cluster_url, node_url, owner_of, owners, seed_urls, shard_tags
from embeddings.net.endpoints import one_try, redact
from embeddings.net.wire import RowConnection, WireError
from embeddings.store.buckets import BucketLayout, fit_listpack

T = TypeVar("T")
# redis-py's replies of a node up but not serving a shard now (a cluster failing over, a slot moving), typed:
# their message no longer starts with the code that the wire's errors are told apart by
_NOT_SERVING = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError, redis.exceptions.AskError)


@dataclass(frozen=True)
class ConnectionOptions:
    """What a store's connections are opened with beyond its shard URLs and timeout: extra
    ``redis.Redis`` keywords (``connection_kwargs``, e.g. ``ssl_ca_certs``) and one replica URL per
    shard (``replica_urls``; None: no replicas)."""

    connection_kwargs: dict | None = None
    replica_urls: Sequence[str] | None = None


class ShardLinks:
    """Connections to every shard, with the store's error mapping (``mapped``)."""

    def __init__(
        self,
        urls: Sequence[str],
        namespace: str,
        layout: BucketLayout,
        timeout_s: float,
        connection_kwargs: dict | None,
        replica_urls: Sequence[str] | None,
        forget: Callable[[int], None],
    ) -> None:
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
        self.timeout_s = timeout_s
        self.layout = layout
        self.forget = forget
        kwargs = dict(
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=one_try(),  # bounded: the recovery layer owns retries
            health_check_interval=0,
            protocol=2,  # embeddings.net.wire speaks RESP2 (nil is $-1)
        )
        kwargs.update(connection_kwargs or {})
        self.kwargs = kwargs
        self.tags: list[str] | None = None  # a cluster's hash tag per shard
        if self.cluster is not None:
            try:
                ranges = owners(self.cluster, kwargs)
            except redis.RedisError as e:
                raise ShardUnavailableError(0, urls[0].split("@")[-1], str(e)) from None
            self.tags = shard_tags(namespace, len(urls), ranges)
            self.urls = [self._owner_url(s, ranges) for s in range(len(urls))]
        self.endpoints = [redact(u) for u in self.urls]
        if replica_urls is not None and len(replica_urls) != len(urls):
            raise ValueError(f"{len(replica_urls)} replica URLs for {len(urls)} shards: one per shard")
        self.replica_urls: list[str | None] = list(replica_urls) if replica_urls else [None] * len(urls)
        self.pools = [self._new_pool(u) for u in self.urls]
        self.clients = [redis.Redis(connection_pool=p) for p in self.pools]
        self.wires = [RowConnection(p, timeout_s, layout) for p in self.pools]
        self.locks = [threading.Lock() for _ in urls]  # one bulk call per shard socket at a time
        self.timed_out = [-1e18] * len(urls)  # when a row call last timed out (monotonic)
        self.listpack_ok = [False] * len(urls)  # the server's listpack limits checked on this connection
        self.pool = ThreadPoolExecutor(max_workers=len(urls), thread_name_prefix="shard")

    def _new_pool(self, url: str) -> redis.ConnectionPool:
        pool = redis.ConnectionPool.from_url(url, **self.kwargs)
        pool.connection_kwargs["protocol"] = 2  # a ?protocol=3 in a URL must not change the wire format
        return pool

    def _owner_url(self, shard: int, ranges) -> str:
        host, port = owner_of(ranges, key_slot(self.tags[shard].encode()))
        return node_url(self.cluster[0], host, port)

    # -- error mapping -------------------------------------------------------------------
    def mapped(self, shard: int, fn: Callable[[], T]) -> T:
        """``fn()`` with every client error mapped to the store's, naming the shard and endpoint."""
        endpoint = self.endpoints[shard]
        try:
            return fn()
        except redis.AuthenticationError as e:
            raise StoreAuthError(shard, endpoint, str(e)) from None
        except redis.TimeoutError as e:
            raise ShardTimeoutError(shard, endpoint, f"no answer within {self.timeout_s}s ({e})") from None
        except redis.ConnectionError as e:
            raise ShardUnavailableError(shard, endpoint, str(e) or type(e).__name__) from None
        except _NOT_SERVING as e:  # redis-py's: its message lost the code (CLUSTERDOWN, TRYAGAIN, MOVED, ASK)
            raise ShardUnavailableError(shard, endpoint, f"{type(e).__name__}: {e}") from None
        except (redis.ResponseError, WireError) as e:
            msg = str(e)
            if "WRONGPASS" in msg or "NOAUTH" in msg or "NOPERM" in msg:
                raise StoreAuthError(shard, endpoint, msg) from None
            if msg.startswith(("LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN", "MOVED", "ASK")):
                # up but not serving this shard now (loading, failing over, slot moved): unavailable for now
                raise ShardUnavailableError(shard, endpoint, msg) from None
            raise ShardDataError(f"shard {shard} at {endpoint}: {msg}") from None

    def on_shards(self, work: dict[int, Callable[[], T]]) -> dict[int, T]:
        """Each shard's ``work`` at once (one thread per shard), mapped; every call has returned
        before the first error is raised."""
        if len(work) == 1:  # one shard: no hop through the pool
            ((s, fn),) = work.items()
            return {s: self.mapped(s, fn)}
        futures = {s: self.pool.submit(self.mapped, s, fn) for s, fn in work.items()}
        results, first_error = {}, None
        for s, f in futures.items():
            try:
                results[s] = f.result()
            except Exception as e:  # noqa: BLE001 - re-raised below
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return results

    def call(self, shard: int, fn: Callable[[redis.Redis], T]) -> T:
        """Run ``fn(client)`` on one shard with the store's error mapping."""
        return self.mapped(shard, lambda: fn(self.clients[shard]))

    def client(self, shard: int) -> redis.Redis:
        return self.clients[shard]

    def locked_get(self, shard: int, key: bytes) -> bytes | None:
        """``GET key`` on the shard's row socket, under its lock (not mapped)."""
        with self.locks[shard]:
            return self.wires[shard].get(key)

    def fit_listpack(self, shard: int, widths: list[int], warn: Callable[[str], None]) -> None:
        """Before the first row write on a shard's connection: the server's listpack limits raised to
        what the buckets of rows of ``widths`` bytes need (``CONFIG SET``); where it refuses, one
        warning line and on."""
        if self.listpack_ok[shard]:
            return
        entries = max(self.layout.max_fields(w) for w in widths)
        problem = self.call(shard, lambda c: fit_listpack(c, entries, max(widths)))
        self.listpack_ok[shard] = True
        if problem:
            warn(f"warning: shard {shard} at {self.endpoints[shard]}: {problem}")

    # -- another process serves the shard -------------------------------------------------------
    def reconnect(self, shard: int) -> None:
        """Drop this shard's connections (its server was replaced); the next call opens new ones. On
        a cluster, the shard follows its slot to the node that serves it now (after a failover)."""
        self.forget(shard)
        with self.locks[shard]:
            self.wires[shard].close()
            self.timed_out[shard] = -1e18
            self.listpack_ok[shard] = False  # the server may be another one now
        self.pools[shard].disconnect()
        if self.cluster is not None:
            known = list(dict.fromkeys(u for u in self.urls if u != self.urls[shard])) + self.cluster
            try:
                url = self._owner_url(shard, owners(known, self.kwargs))
            except redis.RedisError:
                return  # no node answers now: the next call fails and recovery tries again
            if url != self.urls[shard]:
                self._repoint(shard, url)

    def _repoint(self, shard: int, url: str) -> None:
        self.forget(shard)
        with self.locks[shard]:
            self.wires[shard].close()
            self.pools[shard].disconnect()
            self.pools[shard] = self._new_pool(url)
            self.clients[shard] = redis.Redis(connection_pool=self.pools[shard])
            self.wires[shard] = RowConnection(self.pools[shard], self.timeout_s, self.layout)
            self.urls[shard], self.endpoints[shard] = url, redact(url)
            self.listpack_ok[shard] = False

    def has_replica(self, shard: int) -> bool:
        return self.cluster is not None or self.replica_urls[shard] is not None

    def promote(self, shard: int) -> None:
        """Make the shard's replica a primary (``REPLICAOF NO ONE``) and serve the shard from it."""
        url = self.replica_urls[shard]
        if url is None:
            raise ShardDataError(f"shard {shard} at {self.endpoints[shard]}: no replica left to promote")
        client = redis.Redis(connection_pool=self._new_pool(url))
        try:
            self.mapped(shard, lambda: client.execute_command("REPLICAOF", "NO", "ONE"))
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

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for w in self.wires:
            w.close()
        for p in self.pools:
            p.disconnect()
