"""A torchrec-compatible embedding-bag collection whose rows live in an ``EmbeddingStore``.

``StoreEmbeddingBagCollection`` takes a ``KeyedJaggedTensor`` and returns a ``KeyedTensor`` like
``torchrec.EmbeddingBagCollection``, so ``torchrec.models.dlrm.DLRM`` accepts it in its place.
Rows are not module parameters. A batch is handled in packed row keys (``embeddings.rowkeys``:
table index and row id in one int64), every table at once: the batch's keys are made unique once
(``batch_keys``, shared by stage, prefetch and forward), forward pulls their rows from the store as
one leaf tensor ``[num_unique, dim]`` and pools every feature with one ``embedding_bag`` call. After
``loss.backward()`` that tensor's gradient is the per-row gradient: ``pop_key_grads()`` hands it to
the caller (the trainer aggregates it over trainers), ``apply_gradients()`` to the store's
optimizer (the store is the single writer of its rows). Every table of one module has one
embedding dim and one pooling mode.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embeddings import rowkeys
from embeddings.errors import RowRangeError
from embeddings.store import EmbeddingStore

_CACHED = 4  # batch contexts kept: the step's, the next batch's, the read-ahead one's, one spare
_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


@dataclass
class BatchKeys:
    """One batch's rows, worked out once: what stage, prefetch and forward of the batch share."""

    keys: np.ndarray
    """Sorted unique packed row keys of every table, [U] int64."""
    inverse: torch.Tensor
    """Per looked-up value (the module's features, feature-major), its position in ``keys``; [N]."""
    offsets: torch.Tensor
    """Bag offsets over ``inverse``: [num_features * B + 1]."""
    batch_size: int
    single: bool = False
    """Every bag holds one value (Criteo's features): a bag's pooled row is its row."""


def sum_by_key(keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Gradients of possibly repeated keys summed per key: -> (sorted unique keys, [U, dim])."""
    if len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1])):
        return keys, grads
    uniq, inverse = np.unique(keys, return_inverse=True)
    summed = torch.zeros((len(uniq), grads.shape[1]), dtype=grads.dtype)
    summed.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grads)
    return uniq, summed


class StoreEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        store: EmbeddingStore,
        is_weighted: bool = False,
        row_source=None,
    ) -> None:
        super().__init__()
        if is_weighted:
            raise ValueError("StoreEmbeddingBagCollection: weighted features are not supported (is_weighted=True)")
        for c in tables:
            if c.pooling not in _MODES:
                raise ValueError(f"table {c.name!r}: pooling {c.pooling} not supported; use SUM or MEAN")
            spec = store.tables.spec(c.name)  # raises UnknownTableError naming the table
            if (spec.num_rows, spec.dim) != (c.num_embeddings, c.embedding_dim):
                raise ValueError(
                    f"table {c.name!r}: config has {c.num_embeddings} rows x {c.embedding_dim} dim, "
                    f"store has {spec.num_rows} x {spec.dim}"
                )
        for what, kinds in (
            ("embedding dim", {c.embedding_dim for c in tables}),
            ("pooling", {c.pooling for c in tables}),
        ):
            if len(kinds) > 1:
                raise ValueError(
                    f"StoreEmbeddingBagCollection: one {what} for every table, got {sorted(map(str, kinds))}"
                )
        self._configs = list(tables)
        self._names = get_embedding_names_by_table(tables)
        self.store = store
        # where forward gets rows: the store, or a stage/prefetch in front of it (``pull_keys``)
        self.row_source = row_source if row_source is not None else store
        self.dim = tables[0].embedding_dim
        self._mode = _MODES[tables[0].pooling]
        # per feature, in output order: (feature name, store table index, rows)
        self._features = [(f, store.tables.index(c.name), c.num_embeddings) for c in tables for f in c.feature_names]
        self._output_keys = [name for names in self._names for name in names]
        # per feature: its table's rows (the bound of its ids) and the table's key bits
        self._limits = torch.tensor([n for _, _, n in self._features], dtype=torch.int64)
        self._bases = torch.tensor([t << rowkeys.ROW_BITS for _, t, _ in self._features], dtype=torch.int64)
        self._one_feature_per_table = len({t for _, t, _ in self._features}) == len(self._features)
        # per forward with grad: (packed keys [U], leaves of their rows in key order: one for every
        # table, or with several features on a table one per table, each feature pooled by its own
        # call, so that a table's row gradient sums its features' contributions in the order
        # torchrec's EmbeddingBagCollection sums them)
        self._pending: list[tuple[np.ndarray, list[torch.Tensor]]] = []
        self._cache: list[tuple[KeyedJaggedTensor, BatchKeys]] = []
        self._cache_lock = threading.Lock()

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def batch_keys(self, features: KeyedJaggedTensor) -> BatchKeys:
        """The batch's unique row keys and lookups, computed once per batch: by the data reader's
        read-ahead thread (``prepare``) or by the first of stage, prefetch and forward to ask. The
        newest few are kept: the batch in training, the next one and the one being read ahead."""
        for f, ctx in self._cache:  # a list replaced whole, never changed in place: safe to scan
            if f is features:
                return ctx
        ctx = self._batch_keys(features)
        with self._cache_lock:
            self._cache = [(features, ctx), *(c for c in self._cache[: _CACHED - 1] if c[0] is not features)]
        return ctx

    def prepare(self, batch) -> None:
        """Work out a batch's keys ahead of its step (on the data reader's thread)."""
        self.batch_keys(batch.sparse_features)

    def _batch_keys(self, features: KeyedJaggedTensor) -> BatchKeys:
        names = [f for f, _, _ in self._features]
        if features.keys() == names:  # the usual case: the batch holds exactly these features, in order
            values, lengths, batch = features.values(), features.length_per_key(), features.stride()
            offsets = features.offsets()
        else:
            jagged = features.to_dict()
            missing = [f for f in names if f not in jagged]
            if missing:
                raise KeyError(f"features {missing} are not in the batch (it has {features.keys()})")
            parts = [jagged[f] for f in names]
            values = torch.cat([p.values() for p in parts])
            lengths = [p.values().numel() for p in parts]
            batch = len(parts[0].lengths())
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cat([p.lengths() for p in parts]).cumsum(0)])
        if len(offsets) != len(names) * batch + 1:
            raise ValueError(f"batch has {len(offsets) - 1} bags for {len(names)} features x batch {batch}")
        counts = torch.tensor(lengths, dtype=torch.int64)
        limit = torch.repeat_interleave(self._limits, counts)
        values = values.to(torch.int64)
        bad = (values < 0) | (values >= limit)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            f = int(torch.searchsorted(counts.cumsum(0), torch.tensor(i), right=True))
            name, t, n = self._features[f]
            raise RowRangeError(
                f"table {self.store.tables.specs[t].name!r} (feature {name!r}): row id {int(values[i])} out of range [0, {n})"
            )
        base = torch.repeat_interleave(self._bases, counts)
        uniq, inverse = torch.unique(values + base, return_inverse=True)
        offsets = offsets.to(torch.int64)
        single = len(values) == len(names) * batch and bool(torch.all(offsets[1:] - offsets[:-1] == 1))
        return BatchKeys(uniq.numpy(), inverse, offsets, batch, single)

    def unique_keys(self, features: KeyedJaggedTensor) -> np.ndarray:
        """The sorted unique packed row keys that ``forward(features)`` will pull."""
        return self.batch_keys(features).keys

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        ctx = self.batch_keys(features)
        rows = torch.from_numpy(self.row_source.pull_keys(ctx.keys))  # [U, dim] float32, every table
        track = torch.is_grad_enabled() and self.training
        keys = self._output_keys
        num, batch = len(self._features), ctx.batch_size
        if self._one_feature_per_table:  # each row is looked up by one feature: pool all in one call
            if track:
                rows.requires_grad_(True)
                self._pending.append((ctx.keys, [rows]))
            if ctx.single:  # one value per bag: a gather, whose backward (index_add) is a quarter of embedding_bag's
                pooled = rows.index_select(0, ctx.inverse)
            else:
                pooled = F.embedding_bag(ctx.inverse, rows, ctx.offsets, mode=self._mode, include_last_offset=True)
            # [num_features * B, dim], feature-major -> [B, num_features * dim]
            values = pooled.view(num, batch, self.dim).transpose(0, 1).reshape(batch, num * self.dim)
            return KeyedTensor(keys=keys, length_per_key=[self.dim] * num, values=values, key_dim=1)
        leaves = {}
        for t, (_, lo, hi) in rowkeys.table_groups(ctx.keys).items():
            leaves[t] = (rows[lo:hi].requires_grad_(True) if track else rows[lo:hi], lo)
        if track:
            self._pending.append((ctx.keys, [leaf for leaf, _ in leaves.values()]))
        pooled, start = [], 0
        for i, (_, t, _) in enumerate(self._features):
            end = int(ctx.offsets[(i + 1) * batch])
            leaf, lo = leaves.get(t, (rows[:0], 0))
            bag_offsets = ctx.offsets[i * batch : (i + 1) * batch + 1] - start
            pooled.append(
                F.embedding_bag(
                    ctx.inverse[start:end] - lo, leaf, bag_offsets, mode=self._mode, include_last_offset=True
                )
            )  # [B, dim]
            start = end
        return KeyedTensor(keys=keys, length_per_key=[self.dim] * num, values=torch.cat(pooled, dim=1), key_dim=1)

    def pop_key_grads(self) -> tuple[np.ndarray, torch.Tensor]:
        """Per-row gradients of the forwards since the last pop, then forgotten: (packed keys [n],
        gradients [n, dim]); a key appears once per forward that pulled it."""
        keys, grads = [], []
        for k, leaves in self._pending:
            if all(leaf.grad is not None for leaf in leaves):
                keys.append(k)
                grads.append(torch.cat([leaf.grad for leaf in leaves]))
        self._pending = []
        if not keys:
            return np.empty(0, np.int64), torch.empty((0, self.dim))
        return np.concatenate(keys), torch.cat(grads)

    def apply_gradients(self) -> None:
        """Send this step's per-row gradients to the store's optimizer, then forget them."""
        keys, grads = sum_by_key(*self.pop_key_grads())
        if len(keys):
            self.store.apply_keys(keys, grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending = []
        super().zero_grad(set_to_none)
