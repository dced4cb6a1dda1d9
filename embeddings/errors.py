"""Exception tree of the embedding tier.

``ShardUnavailableError`` is the recoverable kind: the recovery layer catches it, restores the
shard and retries the step. Everything else signals a bug in the caller's input or a
misconfiguration and must not be retried.
"""

from __future__ import annotations


class EmbeddingStoreError(Exception):
    """Base class of every error raised by the embedding tier."""


class ShardUnavailableError(EmbeddingStoreError):
    """A shard did not answer: its process is gone, refused the connection or timed out."""

    def __init__(self, shard: int, endpoint: str, reason: str) -> None:
        self.shard = shard
        self.endpoint = endpoint
        self.reason = reason
        super().__init__(f"shard {shard} at {endpoint} is unavailable: {reason}")


class ShardTimeoutError(ShardUnavailableError):
    """A shard accepted the connection but did not answer within the timeout (stalled)."""


class StoreAuthError(EmbeddingStoreError):
    """The shard rejected our credentials (wrong password or ACL user)."""

    def __init__(self, shard: int, endpoint: str, reason: str) -> None:
        self.shard = shard
        self.endpoint = endpoint
        super().__init__(f"shard {shard} at {endpoint} rejected the credentials: {reason}")


class ShardEvictedError(EmbeddingStoreError):
    """A shard's server evicted keys during the run (``maxmemory`` with an ``allkeys-*`` policy), or
    its policy changed to one that would: its rows may read back as never written. Not recoverable
    like a failure while the server keeps evicting: the run stops (``RedisStore.check_evictions``)."""

    def __init__(self, shard: int, endpoint: str, message: str) -> None:
        self.shard = shard
        self.endpoint = endpoint
        super().__init__(f"shard {shard} at {endpoint}: {message}")


class ShardDataError(EmbeddingStoreError):
    """A shard returned bytes that do not decode as rows of the expected width."""


class UnknownTableError(EmbeddingStoreError, KeyError):
    """A table name that the store was not configured with."""

    def __init__(self, table: str, known: list[str]) -> None:
        self.table = table
        super().__init__(f"unknown table {table!r}; known tables: {', '.join(known)}")

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.args[0]


class RowRangeError(EmbeddingStoreError, IndexError):
    """A row id outside ``[0, num_rows)`` of its table."""


class DimMismatchError(EmbeddingStoreError, ValueError):
    """A gradient or row block whose width does not match the table's dim."""


class EndpointError(EmbeddingStoreError):
    """A ``--redis`` endpoint that cannot serve the run (checked before any trainer starts)."""
