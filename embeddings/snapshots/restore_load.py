"""A shard's snapshot loaded back over the protocol, onto a server the project may not have started.

Three ways, each with the same result:
- one full synchronization (``embeddings.snapshots.sync_load``): the empty server loads the file as Redis
  loads its own; taken first wherever it applies (it costs the server and this process the least);
- one ``RESTORE key 0 payload REPLACE`` per key, where the sync does not apply: a row
  bucket is one listpack, sent as the checkpoint's RDB file holds it. The payloads are cut from the
  file (``embeddings.snapshots.rdb.restore_payloads``: the file's own checksum first, each listpack's framing,
  a CRC-64 per payload) and pipelined in batches of a few MB, one batch in flight while the next is
  built. The first row bucket of each table is decoded and checked against the run's layout (its
  table, row width and fields) before anything is sent; every key's table must be one of the
  run's. The bookkeeping strings (applied marker, undo record) go last;
- one ``HSET`` per bucket (``load_by_hset``), where the server refuses the other two.

A server that refuses a way (an ACL without ``RESTORE`` or ``REPLICAOF``, a renamed command, an RDB
version newer than the server's) is said in one line naming the next way, and remembered for the
endpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

from embeddings.errors import ShardDataError
from embeddings.net.wire import WireError, restore_many, restore_one
from embeddings.snapshots.rdb import check_file, decode_value, group_rows, read_keys, restore_payloads
from embeddings.snapshots.sync_load import load_by_sync

# the answers of a server that will not take RESTORE (fallen back from); any other error is raised
_REFUSALS = ("ERR unknown command", "NOPERM", "ERR DUMP payload version", "ERR Bad data format")


def load_snapshot(store, links, shard: int, path) -> int:
    """This namespace's keys of the RDB file at ``path`` onto one shard (existing buckets of the same
    keys are replaced); -> the bytes of the values sent.

    Each shard goes by the sync first where it applies (``sync_load.unsuitable``: an empty server
    with no function libraries and no replicas, not TLS, not a cluster node; a file of this
    namespace's keys alone): on 1 GB files its server used 1.6-1.7 s of CPU a GB against 1.8 by
    ``RESTORE``, and this process 0.4 against 1.0 (``first_way`` puts ``RESTORE`` first: the tests
    of each way, the benchmark's column). ``store``: the store's front; ``links``: its connections
    (``embeddings.net.links``)."""
    links.forget(shard)
    widths = [4 * store.width(t) for t in range(len(store.tables.specs))]
    links.fit_listpack(shard, widths, store.warn)
    ns = store.key_namespace(shard)
    head = f"{ns}:".encode()
    seen: set[int] = set()  # tables whose first bucket passed (one file: checked once, whichever way)

    def sample(key, kind, payload) -> bool:
        return _check(key, kind, payload, head, ns, store.layout, widths, seen, str(path))

    endpoint = store.endpoints[shard]

    def sync(then: str) -> int | None:
        return load_by_sync(store, links, shard, path, head, sample, then)

    def restore(then: str) -> int | None:
        return _by_restore(store, links, shard, path, head, sample, then)

    ways = [("the sync", sync, store.sync_refused), ("RESTORE", restore, store.restore_refused)]
    if getattr(store, "first_way", "the sync") == "RESTORE":
        ways.reverse()
    ways = [w for w in ways if endpoint not in w[2]]  # a refusal is remembered: no second probe
    for i, (_, way, _) in enumerate(ways):
        sent = way(ways[i + 1][0] if i + 1 < len(ways) else "one HSET per bucket")
        if sent is not None:
            return sent
    return load_by_hset(store, links, shard, path)


@contextlib.contextmanager
def first_way(store, way: str) -> Iterator[None]:
    """While ``way`` ("the sync" or "RESTORE") is tried first."""
    if way not in ("the sync", "RESTORE"):
        raise ValueError(f"first_way {way!r}: 'the sync' or 'RESTORE'")
    before = getattr(store, "first_way", "the sync")
    store.first_way = way
    try:
        yield
    finally:
        store.first_way = before


def _by_restore(store, links, shard: int, path, head: bytes, sample, then: str) -> int | None:
    """-> bytes sent, or None where the server refused the first ``RESTORE`` (noted, one line).
    ``sample(key, type, payload)``: each key's check before it is sent."""
    later: list[tuple[bytes, bytearray]] = []
    sent = [0]

    def rows_first():
        for key, kind, payload in restore_payloads(path, head):
            sample(key, kind, lambda p=payload: p)
            sent[0] += len(payload) - 11
            if kind == 0:  # bookkeeping: after the rows
                later.append((key, payload))
            else:
                yield key, payload

    wire = links.wires[shard]

    def run() -> int | None:
        with links.locks[shard]:
            items = rows_first()
            first = next(items, None) or (later.pop() if later else None)
            if first is None:
                return 0
            try:
                refused = restore_one(wire, *first)
                if refused is not None:
                    if not refused.startswith(_REFUSALS):
                        raise WireError(refused)  # mapped to unavailable / data error by ``_call``
                    _refuse(store, shard, refused, then)
                    return None
                restore_many(wire, items)
                restore_many(wire, later)
            finally:
                items.close()  # the file's mapping is let go of, whatever happened
            return sent[0]

    return links.mapped(shard, run)


def _refuse(store, shard: int, why: str, then: str) -> None:
    endpoint = store.endpoints[shard]
    store.restore_refused[endpoint] = why
    store.warn(f"warning: shard {shard} at {endpoint} refused RESTORE ({why}): its keys go by {then} instead")


def _check(key, kind, payload: Callable[[], bytearray], head, ns, layout, widths, seen: set[int], source: str) -> bool:
    """Every key's table is one of the run's; the first row bucket of each table decodes, and its
    rows are of the table's width in fields of the layout (``group_rows``' checks). -> True for a
    row bucket that passed: any other bucket of its table would pass as it did (``scan_mapped``
    shows those no more)."""
    t, sep, bucket = key[len(head) :].partition(b":")
    if not (sep and t.isdigit() and len(bucket) == 8):
        return False  # not a row bucket: bookkeeping
    table = int(t)
    if table >= len(widths):
        raise ShardDataError(f"snapshot: bucket {key!r} of table {table}, which the run does not have")
    if table in seen and kind != 0:
        return True
    seen.add(table)
    group_rows(iter([(key, decode_value(kind, payload(), source))]), ns, layout, widths)
    return kind != 0


def load_by_hset(store, links, shard: int, path, chunk_rows: int = 20_000) -> int:
    """The older path: the file parsed into rows, written with pipelined writes of ``chunk_rows``
    rows (one HSET per bucket), the bookkeeping keys in one transaction; -> bytes written."""
    ns = store.key_namespace(shard)
    widths = [4 * store.width(t) for t in range(len(store.tables.specs))]
    check_file(path)  # its bytes against the CRC-64 it ends with, as the RESTORE path checks them
    tables, other = group_rows(read_keys(path, f"{ns}:".encode()), ns, store.layout, widths)
    written = 0
    for t, (ids, values) in tables.items():
        rows = np.frombuffer(values, "<f4").reshape(len(ids), store.width(t))
        for lo in range(0, len(ids), chunk_rows):
            store.write_shard(shard, [(t, ids[lo : lo + chunk_rows], rows[lo : lo + chunk_rows])], step=None)
        written += ids.nbytes + rows.nbytes
    if other:  # bookkeeping strings (and any other hash of the namespace, field by field)
        cmds = [[b"SET", k, v] if isinstance(v, bytes) else [b"HSET", k, *(x for p in v for x in p)] for k, v in other]
        cmds = [c for c in cmds if len(c) > 2]

        def run():
            with links.locks[shard]:
                return links.wires[shard].send_commands(cmds)

        links.mapped(shard, run)
        written += sum(sum(len(x) for x in c[1:]) for c in cmds)
    return written
