"""A synthetic Criteo-shaped click stream whose labels come from a fixed random teacher.

Every sample is a pure function of (seed, split, sample index): samples are generated in blocks
of ``BLOCK`` rows, block b of a split drawn from ``np.random.default_rng([seed, split, b])``, so
any row range can be produced without the rows before it (streaming, resumable, any size).

Features: 13 dense counts (log-normal, floored to integers, so they go through the same
``log(x + 1)`` transform as Criteo's) and 26 categorical ids, ``Zipf(a_t)`` ranks over each
table's ``num_rows``, scattered by a fixed permutation so hot ids are not the low ids.

Teacher (by seed): ``logit = b + w . dense + sum_t u_t[id_t] + gain * sum_{s<t} <v_s[id_s], v_t[id_t]>``
where ``u_t`` (scalar) and ``v_t`` (``teacher_dim``-vector) are hashed per (table, id): a
DLRM-like model with dot interactions (``teacher="dot"``) or without (``teacher="logistic"``).
The label is Bernoulli(sigmoid(logit)). The teacher's own AUC on the eval split is the ceiling
that a trained model can reach.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field

import numpy as np

from data.criteo import NUM_DENSE, NUM_SPARSE, dense_transform
from data.hashing import hash_uniform

BLOCK = 4096
SPLITS = {"train": 0, "eval": 1}
TEACHERS = ("logistic", "dot")


@dataclass(frozen=True)
class SyntheticConfig:
    """Shape of the synthetic stream. Per-table lists have one entry per categorical feature."""

    seed: int = 0
    rows_per_table: tuple[int, ...] = field(default_factory=lambda: (100_000,) * NUM_SPARSE)
    zipf: tuple[float, ...] = field(default_factory=lambda: (1.2,) * NUM_SPARSE)
    teacher: str = "dot"
    teacher_dim: int = 4
    interaction_gain: float = 1.0
    bias: float = -1.8  # about 25% positives, like Criteo

    def __post_init__(self) -> None:
        if len(self.rows_per_table) != NUM_SPARSE:
            raise ValueError(f"rows_per_table has {len(self.rows_per_table)} entries, expected {NUM_SPARSE}")
        if len(self.zipf) != NUM_SPARSE:
            raise ValueError(f"zipf has {len(self.zipf)} entries, expected {NUM_SPARSE}")
        if any(n <= 0 for n in self.rows_per_table):
            raise ValueError(f"rows_per_table {self.rows_per_table} must all be > 0")
        if any(a <= 1.0 and a != 0 for a in self.zipf):
            raise ValueError(f"zipf exponents {self.zipf} must all be > 1 (0: uniform ids)")
        if self.teacher not in TEACHERS:
            raise ValueError(f"teacher {self.teacher!r} must be one of {TEACHERS}")

    @classmethod
    def uniform(cls, rows: int, zipf: float = 1.2, **kw) -> SyntheticConfig:
        return cls(rows_per_table=(rows,) * NUM_SPARSE, zipf=(zipf,) * NUM_SPARSE, **kw)


class Teacher:
    """The fixed random model that labels the stream."""

    def __init__(self, cfg: SyntheticConfig) -> None:
        self.cfg = cfg
        rng = np.random.default_rng([cfg.seed, 7919])
        self.w_dense = rng.normal(0.0, 0.25, NUM_DENSE).astype(np.float64)

    def _key(self, table: int) -> int:
        return self.cfg.seed * 1_000_003 + 10_007 + table

    def logits(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        """dense [n, 13] log-transformed, sparse [n, 26] ids -> [n] float64 logits."""
        cfg = self.cfg
        # centre the dense features roughly so the bias sets the base rate
        z = self.cfg.bias + (dense - 1.5) @ self.w_dense
        vecs = []
        for t in range(NUM_SPARSE):
            h = hash_uniform(self._key(t), sparse[:, t], 1 + cfg.teacher_dim).astype(np.float64) * 2 - 1
            z += 0.35 * h[:, 0]
            vecs.append(h[:, 1:])
        if cfg.teacher == "dot":
            v = np.stack(vecs, axis=1)  # [n, 26, teacher_dim]
            s = v.sum(axis=1)
            # sum over pairs s<t of <v_s, v_t> = (|sum v|^2 - sum |v|^2) / 2
            pairs = 0.5 * ((s * s).sum(-1) - (v * v).sum(axis=(1, 2)))
            z += cfg.interaction_gain * pairs / np.sqrt(NUM_SPARSE * (NUM_SPARSE - 1) / 2) * 1.5
        return z

    def probabilities(self, dense: np.ndarray, sparse: np.ndarray) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(dense, sparse)))


@dataclass
class Samples:
    dense: np.ndarray  # [n, 13] float32, log-transformed
    sparse: np.ndarray  # [n, 26] int64 ids, each < its table's rows
    labels: np.ndarray  # [n] int32
    raw_dense: np.ndarray  # [n, 13] int64, before the log (for writing TSV)
    probs: np.ndarray  # [n] float64, the teacher's click probability
    bags: None = None  # one id per feature (``data.batches.MultiHot`` makes bags)


class SyntheticSource:
    """An endless, deterministic stream of samples of one split."""

    def __init__(self, cfg: SyntheticConfig, split: str = "train") -> None:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} must be one of {list(SPLITS)}")
        self.cfg = cfg
        self.split = split
        self.teacher = Teacher(cfg)
        self.num_rows: int | None = None  # endless
        self._cache: tuple[int, Samples] | None = None

    def _block(self, b: int) -> Samples:
        cached = self._cache  # read once: readers on several threads share this source
        if cached is not None and cached[0] == b:
            return cached[1]
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, SPLITS[self.split], b])
        raw = np.floor(np.exp(rng.normal(1.0, 1.5, (BLOCK, NUM_DENSE)))).astype(np.int64)
        raw[rng.random((BLOCK, NUM_DENSE)) < 0.1] = 0  # missing values read as 0
        sparse = np.empty((BLOCK, NUM_SPARSE), np.int64)
        for t in range(NUM_SPARSE):
            n = cfg.rows_per_table[t]
            a = cfg.zipf[t]
            ranks = rng.integers(0, n, BLOCK) if a == 0 else np.minimum(rng.zipf(a, BLOCK) - 1, n - 1)
            sparse[:, t] = (ranks * 2654435761 + 97 * t) % n  # scatter hot ranks over the table
        dense = dense_transform(raw)
        probs = self.teacher.probabilities(dense, sparse)
        labels = (rng.random(BLOCK) < probs).astype(np.int32)
        out = Samples(dense, sparse, labels, raw, probs)
        self._cache = (b, out)
        return out

    def read(self, start: int, count: int) -> Samples:
        """Samples ``[start, start + count)`` of this split."""
        if start < 0 or count < 0:
            raise ValueError(f"read(start={start}, count={count}) needs non-negative values")
        parts = []
        pos, end = start, start + count
        while pos < end:
            b, off = divmod(pos, BLOCK)
            take = min(BLOCK - off, end - pos)
            blk = self._block(b)
            parts.append(
                tuple(a[off : off + take] for a in (blk.dense, blk.sparse, blk.labels, blk.raw_dense, blk.probs))
            )
            pos += take
        if not parts:
            return Samples(
                *(np.empty((0, NUM_DENSE), np.float32), np.empty((0, NUM_SPARSE), np.int64)),
                np.empty(0, np.int32),
                np.empty((0, NUM_DENSE), np.int64),
                np.empty(0),
            )
        return Samples(*(np.concatenate(cols) for cols in zip(*parts)))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """ROC AUC by ranks (ties averaged); pure numpy."""
    scores = np.asarray(scores, dtype=np.float64)
    labels = np.asarray(labels).astype(bool)
    num_pos = int(labels.sum())
    num_neg = len(labels) - num_pos
    if num_pos == 0 or num_neg == 0:
        raise ValueError(f"AUC needs both classes; got {num_pos} positives and {num_neg} negatives")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    ranks = np.empty(len(scores), np.float64)
    # average ranks over ties
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg = first + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[labels].sum() - num_pos * (num_pos + 1) / 2) / (num_pos * num_neg))


@functools.lru_cache(maxsize=8)
def teacher_auc(cfg: SyntheticConfig, num_samples: int = 200_000) -> float:
    """The ceiling: the teacher's own AUC on the first ``num_samples`` of the eval split (kept per
    process: a trainer built again for a new quorum does not compute it again)."""
    s = SyntheticSource(cfg, "eval").read(0, num_samples)
    return auc(s.probs, s.labels)


def write_tsv(cfg: SyntheticConfig, path: str | os.PathLike, num_samples: int, split: str = "train") -> None:
    """Write samples as Criteo TSV (dense raw ints, missing as empty; ids as 8-digit hex)."""
    src = SyntheticSource(cfg, split)
    with open(path, "w", encoding="ascii") as f:
        for start in range(0, num_samples, BLOCK):
            s = src.read(start, min(BLOCK, num_samples - start))
            for lab, raw, sp in zip(s.labels.tolist(), s.raw_dense.tolist(), s.sparse.tolist()):
                dense = "\t".join(str(x) if x else "" for x in raw)
                cats = "\t".join(f"{x:08x}" for x in sp)
                f.write(f"{lab}\t{dense}\t{cats}\n")
        f.flush()
        os.fsync(f.fileno())
