"""A torchrec-compatible embedding-bag collection whose rows live in an ``EmbeddingStore``.

``StoreEmbeddingBagCollection`` takes a ``KeyedJaggedTensor`` and returns a ``KeyedTensor`` like
``torchrec.EmbeddingBagCollection``, so ``torchrec.models.dlrm.DLRM`` accepts it in its place.
Rows are not module parameters: each forward pulls the unique rows of the batch from the store
as a leaf tensor ``[num_unique, dim]``; after ``loss.backward()`` that tensor's gradient is the
per-row gradient, which ``apply_gradients()`` hands to the store's optimizer (the store is the
single writer of its rows). Call it once per step, after backward.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor

from embeddings.store import EmbeddingStore

_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}


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
        self._configs = list(tables)
        self._names = get_embedding_names_by_table(tables)
        self.store = store
        # where forward gets rows: the store, or a Prefetcher in front of it
        self.row_source = row_source if row_source is not None else store
        # per forward with grad: table name -> (unique ids [n] int64, leaf rows [n, dim])
        self._pending: list[dict[str, tuple[np.ndarray, torch.Tensor]]] = []
        self._unique_cache: list[tuple[KeyedJaggedTensor, dict]] = []

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return False

    def _unique(self, features: KeyedJaggedTensor, jagged) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per table: (sorted unique ids, inverse), computed once per batch (prefetch, stage and
        forward of one batch share it; the two newest batches are kept)."""
        for f, u in self._unique_cache:
            if f is features:
                return u
        unique = {}
        for c in self._configs:
            values = torch.cat([jagged[f].values() for f in c.feature_names])
            unique[c.name] = torch.unique(values, return_inverse=True)
        self._unique_cache = [(features, unique), *self._unique_cache[:1]]
        return unique

    def unique_ids(self, features: KeyedJaggedTensor) -> dict[str, np.ndarray]:
        """Per table: the sorted unique row ids that ``forward(features)`` will pull."""
        return {name: u.numpy() for name, (u, _) in self._unique(features, features.to_dict()).items()}

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        jagged = features.to_dict()
        unique = self._unique(features, jagged)
        rows = self.row_source.pull_many({name: u.numpy() for name, (u, _) in unique.items()})

        track = torch.is_grad_enabled() and self.training
        pooled, keys, dims, step = [], [], [], {}
        for c, names in zip(self._configs, self._names):
            u, inverse = unique[c.name]
            weight = torch.from_numpy(rows[c.name])  # [num_unique, dim] float32
            if track:
                weight.requires_grad_(True)
                step[c.name] = (u.numpy(), weight)
            start = 0
            for f, name in zip(c.feature_names, names):
                jt = jagged[f]
                n = jt.values().numel()
                pooled.append(
                    F.embedding_bag(
                        inverse[start : start + n],
                        weight,
                        jt.offsets(),
                        mode=_MODES[c.pooling],
                        include_last_offset=True,
                    )
                )  # [B, dim]
                start += n
                keys.append(name)
                dims.append(c.embedding_dim)
        if track:
            self._pending.append(step)
        return KeyedTensor(keys=keys, length_per_key=dims, values=torch.cat(pooled, dim=1), key_dim=1)

    def sparse_grads(self) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """Per table: (row ids [n], gradients [n, dim]) of the forwards since the last apply."""
        ids: dict[str, list[np.ndarray]] = {}
        grads: dict[str, list[torch.Tensor]] = {}
        for step in self._pending:
            for name, (u, weight) in step.items():
                if weight.grad is None:
                    continue
                ids.setdefault(name, []).append(u)
                grads.setdefault(name, []).append(weight.grad)
        return {name: (np.concatenate(ids[name]), torch.cat(grads[name])) for name in ids}

    def pop_sparse_grads(self) -> dict[str, tuple[np.ndarray, torch.Tensor]]:
        """``sparse_grads()``, then forget them (the caller applies them, e.g. after aggregation)."""
        grads = self.sparse_grads()
        self._pending = []
        return grads

    def apply_gradients(self) -> None:
        """Send this step's per-row gradients to the store's optimizer, then forget them."""
        grads = self.pop_sparse_grads()
        if grads:
            self.store.update_many(grads)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending = []
        super().zero_grad(set_to_none)
