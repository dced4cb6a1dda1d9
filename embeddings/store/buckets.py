"""Where a row sits in Redis: hash buckets of consecutive row ids, kept listpack-encoded.

One Redis string per row spends about 100 bytes of bookkeeping on each (its key, a dict entry, an
object header, a value allocation): 172 bytes for a 68-byte row. Rows are therefore grouped: a
table's rows on one shard sit in buckets of ``span`` consecutive row ids, each bucket one Redis hash

    key    prefix + (row // span) as 8 bytes big-endian       (prefix: ``{namespace}:{table}:``)
    field  row % span as ``field_bytes`` bytes big-endian     (1 byte when span <= 256, else 2)
    value  the row, ``[dim + state]`` little-endian float32

which Redis keeps as one listpack (a flat array: a row costs its bytes and 5-6 more) as long as the
hash has at most ``hash-max-listpack-entries`` fields and no value longer than
``hash-max-listpack-value`` bytes. Past either limit Redis converts the bucket for good to a hash
table (1.6x the memory at 16 dims; a string per row costs 2.1x).

``span`` is ``bucket_rows(row bytes) * spread``: ``spread`` is the number of shards a bucket's rows
are hashed over (``--placement row``: every shard; ``table``: 1), so that a shard's part of a bucket
holds about ``bucket_rows`` rows once the table is written densely, whatever the shard count.
``bucket_rows`` is the number of rows whose listpack just fits a jemalloc size class of at most
16 KiB (and at most 128 rows): a bucket is found by a linear scan of its listpack, so a bucket stays
short (a few hundred nanoseconds to find a row in it), and a full one wastes little of its allocation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import chain

import numpy as np
import redis

MAX_BUCKET_ROWS = 128
MAX_BUCKET_BYTES = 16384
LISTPACK_HEADER = 7  # total bytes (4), element count (2), end byte (1)
KEY_ID_BYTES = 8  # the bucket index in a key

# what the servers this project starts are configured with (embeddings.servers.launcher): above any layout here
LISTPACK_ENTRIES = 65536
LISTPACK_VALUE = 65536


def _backlen(n: int) -> int:
    """Bytes of the back-length of a listpack entry of ``n`` bytes (listpack.c ``lpEncodeBacklen``)."""
    return 1 if n <= 127 else 2 if n < 16383 else 3 if n < 2097151 else 4 if n < 268435455 else 5


def string_entry_bytes(n: int) -> int:
    """Listpack bytes of one entry holding an ``n``-byte string (as a string, not an integer)."""
    head = 1 if n < 64 else 2 if n < 4096 else 5
    return head + n + _backlen(head + n)


def size_class_at_most(n: int) -> int:
    """The largest jemalloc size class (16-byte quantum, four classes per doubling past 128) <= n."""
    if n < 128:
        return max(16, n // 16 * 16)
    k = n.bit_length() - 1
    step = 1 << (k - 2)
    return (1 << k) + (n - (1 << k)) // step * step


@functools.cache
def bucket_rows(row_bytes: int, field_bytes: int) -> int:
    """Rows of one shard's full bucket of rows of ``row_bytes``: as many as fill a jemalloc size class
    of at most 16 KiB (at most 128, at least 1)."""
    entry = string_entry_bytes(field_bytes) + string_entry_bytes(row_bytes)
    fill = size_class_at_most(min(MAX_BUCKET_ROWS * entry + LISTPACK_HEADER, MAX_BUCKET_BYTES))
    return int(min(MAX_BUCKET_ROWS, max(1, (fill - LISTPACK_HEADER) // entry)))


@dataclass(frozen=True)
class BucketLayout:
    """The bucket layout of one store: ``spread`` shards share each bucket's row ids."""

    spread: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.spread <= 512:
            raise ValueError(f"buckets spread over {self.spread} shards: 1 to 512 are possible (2-byte fields)")

    @property
    def field_bytes(self) -> int:
        return 1 if MAX_BUCKET_ROWS * self.spread <= 256 else 2

    def span(self, row_bytes: int) -> int:
        """Consecutive row ids per bucket, for rows of ``row_bytes``."""
        return bucket_rows(row_bytes, self.field_bytes) * self.spread

    def max_fields(self, row_bytes: int) -> int:
        """The most fields a bucket can hold (``hash-max-listpack-entries`` must allow it)."""
        return self.span(row_bytes)

    def buckets(self, ids: np.ndarray, row_bytes: int) -> np.ndarray:
        return np.asarray(ids, np.int64) // self.span(row_bytes)

    def fields(self, ids: np.ndarray, row_bytes: int) -> np.ndarray:
        """[n, field_bytes] uint8: each row's field."""
        f = np.asarray(ids, np.int64) % self.span(row_bytes)
        return (
            np.ascontiguousarray(f, dtype=">u2" if self.field_bytes == 2 else np.uint8)
            .view(np.uint8)
            .reshape(len(f), self.field_bytes)
        )

    def bucket_key(self, prefix: bytes, bucket: int) -> bytes:
        return prefix + int(bucket).to_bytes(KEY_ID_BYTES, "big")

    def location(self, prefix: bytes, row: int, row_bytes: int) -> tuple[bytes, bytes]:
        """(key, field) of one row."""
        span = self.span(row_bytes)
        return self.bucket_key(prefix, row // span), int(row % span).to_bytes(self.field_bytes, "big")

    def row_ids(self, bucket: int, fields: list[bytes], row_bytes: int) -> np.ndarray:
        """Row ids of ``fields`` of one bucket; ValueError when a field is not one of this layout."""
        span, fb = self.span(row_bytes), self.field_bytes
        joined = b"".join(fields)
        if len(joined) != fb * len(fields):
            bad = next(f for f in fields if len(f) != fb)
            raise ValueError(f"field {bad!r} is not {fb} bytes")
        offsets = np.frombuffer(joined, ">u2" if fb == 2 else np.uint8).astype(np.int64)
        if len(offsets) and offsets.max() >= span:
            raise ValueError(f"field {int(offsets.max())} is past the bucket's {span} rows")
        return bucket * span + offsets

    def bucket_row_ids(self, buckets: list[int], fields: list[list[bytes]], row_bytes: int) -> np.ndarray:
        """Row ids of the ``fields`` of each of ``buckets`` at once (``row_ids`` of many buckets);
        ValueError when a field is not one of this layout."""
        span, fb = self.span(row_bytes), self.field_bytes
        counts = np.fromiter(map(len, fields), np.int64, len(fields))
        joined = b"".join(chain.from_iterable(fields))
        if len(joined) != fb * int(counts.sum()):
            bad = next(x for f in fields for x in f if len(x) != fb)
            raise ValueError(f"field {bad!r} is not {fb} bytes")
        offsets = np.frombuffer(joined, ">u2" if fb == 2 else np.uint8).astype(np.int64)
        if len(offsets) and offsets.max() >= span:
            raise ValueError(f"field {int(offsets.max())} is past the bucket's {span} rows")
        return np.repeat(np.asarray(buckets, np.int64) * span, counts) + offsets


_SETTINGS = (
    ("hash-max-listpack-entries", "hash-max-listpack-value"),
    ("hash-max-ziplist-entries", "hash-max-ziplist-value"),
)


def fit_listpack(client: redis.Redis, entries: int, value: int) -> str | None:
    """Raise the server's ``hash-max-listpack-entries`` / ``-value`` to ``entries`` / ``value`` where
    they are lower (never lower them; Redis 6 names them ``ziplist``). -> None when the server keeps
    the buckets compact now, else why not, in one clause with the fix. Where ``CONFIG`` is refused
    (ACL, a renamed command), the buckets still work, as hash tables: at 16 dims 130-136 bytes a row
    against 75-84 compact (and 170 for a string per row), measured with scripts/bench_layout.py."""
    want = (entries, value)
    names = _SETTINGS[0]
    refused = ""
    try:
        for names in _SETTINGS:
            got = client.config_get(names[0][: -len("entries")] + "*")
            if names[0] in got:
                break
        else:
            got = {}
        have = tuple(int(got.get(n, 0)) for n in names)
        if all(h >= w for h, w in zip(have, want)):
            return None
    except redis.ResponseError as e:
        refused, have = str(e), (0, 0)
    args = [x for n, h, w in zip(names, have, want) if h < w for x in (n, w)]
    try:
        client.execute_command("CONFIG", "SET", *args)
        return None
    except redis.ResponseError as e:
        refused = str(e)
    need = " and ".join(f"`{n} {w}`" for n, w in zip(names, want))
    return (
        f"CONFIG SET refused ({refused}), so rows written there are kept as hash tables (at 16 dims 1.6x "
        f"the memory of compact buckets): set {need} (or more) in its redis.conf, or allow CONFIG SET"
    )
