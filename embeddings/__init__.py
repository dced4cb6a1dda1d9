"""The embedding tier: tables sharded over Redis, a reference store, a torchrec-compatible module."""

from embeddings.errors import (
    DimMismatchError,
    EmbeddingStoreError,
    RowRangeError,
    ShardDataError,
    ShardTimeoutError,
    ShardUnavailableError,
    StoreAuthError,
    UnknownTableError,
)
from embeddings.launcher import LocalShards
from embeddings.optim import SGD, RowOptimizer, RowWiseAdagrad, make_optimizer
from embeddings.redis_store import RedisStore
from embeddings.shard_map import ShardMap
from embeddings.store import EmbeddingStore, InProcessStore
from embeddings.tables import TableSet, TableSpec

__all__ = [
    "DimMismatchError",
    "EmbeddingStore",
    "EmbeddingStoreError",
    "InProcessStore",
    "LocalShards",
    "RedisStore",
    "RowOptimizer",
    "RowRangeError",
    "RowWiseAdagrad",
    "SGD",
    "ShardDataError",
    "ShardMap",
    "ShardTimeoutError",
    "ShardUnavailableError",
    "StoreAuthError",
    "TableSet",
    "TableSpec",
    "UnknownTableError",
    "make_optimizer",
]
