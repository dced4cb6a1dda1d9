"""Counter-based hashing shared by the synthetic generator and the embedding tier (pure numpy)."""

from __future__ import annotations

import numpy as np

M1 = np.uint64(0xBF58476D1CE4E5B9)
M2 = np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = np.asarray(x, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = x ^ (x >> np.uint64(30))
        x = x * M1
        x = x ^ (x >> np.uint64(27))
        x = x * M2
        x = x ^ (x >> np.uint64(31))
    return x


def keyed_hash(key: int, ids: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (key, id) per id; [n] uint64."""
    ids = np.asarray(ids, dtype=np.uint64)
    with np.errstate(over="ignore"):
        seed = mix64(np.array([key + 1], dtype=np.uint64) * GOLDEN)
        return mix64(ids ^ seed)


def keyed_hash_many(keys: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``keyed_hash(keys[i], ids[i])`` per element, for many keys in one pass; [n] uint64."""
    keys = np.asarray(keys, dtype=np.uint64)
    with np.errstate(over="ignore"):
        uniq, inverse = np.unique(keys, return_inverse=True)
        seeds = mix64((uniq + np.uint64(1)) * GOLDEN)
        return mix64(np.asarray(ids, dtype=np.uint64) ^ seeds[inverse.reshape(-1)])


def hash_uniform(key: int | np.ndarray, ids: np.ndarray, width: int) -> np.ndarray:
    """[n, width] float32 uniform in [0, 1), a pure function of (key, id, column); ``key`` may be
    one key or one per id."""
    with np.errstate(over="ignore"):
        base = keyed_hash(key, ids) if np.ndim(key) == 0 else keyed_hash_many(key, ids)
        cols = np.arange(width, dtype=np.uint64) * GOLDEN
        bits = mix64(base[:, None] + cols[None, :])
    # top 24 bits -> exactly representable in float32
    return (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))
