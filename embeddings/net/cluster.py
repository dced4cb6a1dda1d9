"""Redis Cluster as the tier: ``redis+cluster://[user:pass@]host:port[,host:port...]`` (``rediss+cluster``
for TLS) names seed nodes of a cluster.

Each logical shard of the run is pinned to one hash slot by a hash tag in its keys
(``{namespace.S.J}:table:row``), so every row of a shard lives on the node that owns that slot and a
shard's reads and writes stay single-slot transactions. Tags are picked so that the logical shards
spread over the primaries (shard S on the (S mod P)-th primary by slot order); the pick depends only
on the slot ranges, which a failover does not change, so every trainer (and a resumed run) picks
the same tags. When a node fails, the cluster promotes its replica; ``owners`` (``CLUSTER SLOTS``
from any node that answers) tells the store where each shard's slot is served now.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis
from redis.crc import key_slot

SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in SCHEMES


def seed_urls(url: str) -> list[str]:
    """``redis+cluster://u:p@h1:1,h2:2`` -> ``["redis://u:p@h1:1", "redis://u:p@h2:2"]``."""
    scheme, _, rest = url.partition("://")
    rest = rest.split("/", 1)[0]
    creds, at, hosts = rest.rpartition("@")
    auth = creds + at
    out = [f"{SCHEMES[scheme]}://{auth}{h.strip()}" for h in hosts.split(",") if h.strip()]
    if not out:
        raise ValueError(f"cluster URL {scheme}://...: names no node (host:port)")
    return out


def node_url(like: str, host: str, port: int) -> str:
    """A node's URL with the scheme and credentials of ``like``."""
    scheme, _, rest = like.partition("://")
    creds, at, _ = rest.split("/", 1)[0].rpartition("@")
    return f"{scheme}://{creds}{at}{host}:{port}"


@dataclass(frozen=True)
class SlotRange:
    start: int
    end: int
    host: str
    port: int


def owners(urls: list[str], kwargs: dict) -> list[SlotRange]:
    """``CLUSTER SLOTS`` from the first of ``urls`` that answers; raises ``redis.RedisError`` if none does."""
    last: Exception | None = None
    for url in urls:
        pool = redis.ConnectionPool.from_url(url, **kwargs)
        conn = pool.make_connection()
        try:
            conn.connect()
            conn.send_command("CLUSTER", "SLOTS")
            reply = conn.read_response()
            ranges = [SlotRange(int(r[0]), int(r[1]), _text(r[2][0]) or "127.0.0.1", int(r[2][1])) for r in reply]
            if ranges:
                return sorted(ranges, key=lambda r: r.start)
            last = redis.ConnectionError(f"{url}: the cluster serves no slots yet")
        except (redis.RedisError, OSError) as e:
            last = e
        finally:
            conn.disconnect()
            pool.disconnect()
    raise redis.ConnectionError(f"no cluster node answered CLUSTER SLOTS ({last})")


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def owner_of(ranges: list[SlotRange], slot: int) -> tuple[str, int]:
    for r in ranges:
        if r.start <= slot <= r.end:
            return r.host, r.port
    raise redis.ConnectionError(f"no node serves hash slot {slot}")


def shard_tags(namespace: str, num_shards: int, ranges: list[SlotRange]) -> list[str]:
    """One hash tag per logical shard, shard S on the (S mod P)-th primary (primaries by first slot)."""
    firsts: dict[tuple[str, int], int] = {}
    for r in ranges:
        firsts.setdefault((r.host, r.port), r.start)
    primaries = sorted(firsts, key=firsts.get)
    tags = []
    for s in range(num_shards):
        want = primaries[s % len(primaries)]
        mine = [r for r in ranges if (r.host, r.port) == want]
        j = 0
        while not any(r.start <= key_slot(f"{namespace}.{s}.{j}".encode()) <= r.end for r in mine):
            j += 1
        tags.append(f"{namespace}.{s}.{j}")
    return tags
