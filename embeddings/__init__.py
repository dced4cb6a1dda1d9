"""The embedding tier: tables sharded over Redis, a reference store, a torchrec-compatible module."""

import importlib

# name -> the module that defines it; loaded on first use, so that importing one light module of
# the package (``embeddings.errors``, ``embeddings.servers.launcher``) does not import torch
_WHERE = {
    "DimMismatchError": "errors",
    "EmbeddingStoreError": "errors",
    "RowRangeError": "errors",
    "ShardDataError": "errors",
    "ShardTimeoutError": "errors",
    "ShardUnavailableError": "errors",
    "StoreAuthError": "errors",
    "UnknownTableError": "errors",
    "LocalShards": "servers.launcher",
    "ServerOptions": "servers.launcher",
    "TlsFiles": "servers.launcher",
    "ConnectionOptions": "net.links",
    "SGD": "optim",
    "Adagrad": "optim",
    "Adam": "optim",
    "RowOptimizer": "optim",
    "RowWiseAdagrad": "optim",
    "make_optimizer": "optim",
    "state_of": "optim",
    "RedisStore": "store.redis_store",
    "ShardMap": "shard_map",
    "StoreEmbeddingBagCollection": "bags.module",
    "EmbeddingStore": "store.base",
    "InProcessStore": "store.base",
    "TableSet": "tables",
    "TableSpec": "tables",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f"embeddings.{_WHERE[name]}"), name)
    if name in ("rowkeys",):
        return importlib.import_module(f"embeddings.{name}")
    raise AttributeError(f"module 'embeddings' has no attribute {name!r}")


__all__ = [
    "ConnectionOptions",
    "ServerOptions",
    "TlsFiles",
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
    "Adagrad",
    "Adam",
    "state_of",
    "ShardDataError",
    "ShardMap",
    "ShardTimeoutError",
    "ShardUnavailableError",
    "StoreAuthError",
    "StoreEmbeddingBagCollection",
    "TableSet",
    "TableSpec",
    "UnknownTableError",
    "make_optimizer",
]
