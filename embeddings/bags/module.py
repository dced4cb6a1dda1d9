"""A torchrec-compatible embedding-bag collection whose rows live in an ``EmbeddingStore``.

``StoreEmbeddingBagCollection`` takes a ``KeyedJaggedTensor`` and returns a ``KeyedTensor`` like
``torchrec.EmbeddingBagCollection``, so ``torchrec.models.dlrm.DLRM`` accepts it in its place.
Rows are not module parameters. A batch is handled in packed row keys (``embeddings.rowkeys``:
table index and row id in one int64), every table at once: the batch's keys are made unique once
(``batch_keys``, shared by stage, prefetch and forward), forward pulls their rows from the store as
one leaf tensor ``[num_unique, dim]`` and pools every feature with one ``embedding_bag`` call. After
``loss.backward()`` that tensor's gradient is the per-row gradient: ``pop_key_grads()`` hands it to
the caller (the trainer aggregates it over trainers), ``apply_gradients()`` to the store's
optimizer (the store is the single writer of its rows).

What it accepts is what torchrec's ``EmbeddingBagCollection`` accepts, with the same results (the
equivalence suite: ``tests/test_ebc_equivalence.py``): tables of different embedding dims (each
table's rows are stored at its own width; forward pulls once per dim), SUM and MEAN pooling mixed,
weighted features (``is_weighted=True``: the KJT's per-value weights), a table shared by several
features, batches with empty bags, empty features or no ids at all, a variable batch per feature
(a KJT with ``inverse_indices``), a ``TensorDict`` input, ``tables=[]``, ``device=``. The one shape
of our DLRM (one dim, one pooling, one feature per table) keeps its fast path: one pull, one pooling
call (a gather when every bag holds one id).

Tables are not parameters: ``model.parameters()`` holds the dense parameters only, so a dense
optimizer built over it excludes the tables by construction; the rows are trained by
``apply_gradients()`` (or the trainer's aggregation). A module whose row gradients pile up unapplied
(``_UNAPPLIED_WARN`` backwards without ``apply_gradients``/``pop_key_grads``: the sign of a loop that
steps a dense optimizer only) warns once. ``state_dict()`` holds torchrec's
``embedding_bags.<table>.weight`` for every table: a ``RowsTensor`` (its rows read on demand; DCP
saves and loads it a block at a time) beside a small entry, ``embedding_bags.<table>._extra_state``,
saying where the rows are (store kind, namespace, shape, optimizer, seed; see ``TableLocation``),
or within ``weights_mb`` the rows themselves alone.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollectionInterface, get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor, KeyedTensor
from torchrec.sparse.tensor_dict import maybe_td_to_kjt

from embeddings import rowkeys
from embeddings.bags import kernels
from embeddings.bags.table_state import RowsTensor, TableLocation, location_entry
from embeddings.errors import RowRangeError
from embeddings.store.base import EmbeddingStore

# batch contexts kept: the step's, the next batch's, the two read ahead (``data.batches.READ_AHEAD``), one spare
_CACHED = 5
_MODES = {PoolingType.SUM: "sum", PoolingType.MEAN: "mean"}
KERNELS = ("fbgemm", "torch")  # the pooling's and its backward's: fbgemm's TBE (``embeddings.bags.kernels``) or torch's
_UNAPPLIED_WARN = 8  # forwards whose row gradients were computed and never applied: warn once
_HOST = torch.device("cpu")

__all__ = ["BatchKeys", "GroupKeys", "NotTraceableError", "RowsTensor", "StoreEmbeddingBagCollection", "sum_by_key"]


class NotTraceableError(RuntimeError):
    """FX symbolic tracing, TorchScript (``torch.jit.script``/``torch.jit.trace``) or ``torch.export``
    of a ``StoreEmbeddingBagCollection``: its forward pulls rows from a store at run time, which no
    traced, scripted or exported graph can hold."""


@dataclass
class GroupKeys:
    """The rows of one embedding dim of a batch, on the general path (tables of several dims or
    pooling modes, a table shared by features, weights, a variable batch per feature)."""

    keys: np.ndarray
    """Sorted unique packed keys of the group's tables (one width: one ``pull_keys``)."""
    tables: list[tuple[int, int]]
    """(lo, hi) in ``keys`` of each of the group's tables present in the batch, in key order."""
    inverse: torch.Tensor | None = None
    """Fused group (one pooling call): per value of the group's features, its position in ``keys``."""
    offsets: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    features: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] | None = None
    """Split group: per feature, (its table's place in ``tables`` or -1, positions of its values in
    that table's rows, its bag offsets, its weights)."""


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
    weights: torch.Tensor | None = None
    """Per looked-up value, its weight (a weighted module), [N]."""
    groups: list[GroupKeys] | None = None
    """The general path's work per embedding dim; None: the fast path (one dim, one pooling, one
    feature per table, one batch size)."""
    bags: list[int] = field(default_factory=list)
    """Bags per feature (the batch size, or each feature's own in a variable-batch KJT)."""
    expand: list[torch.Tensor] | None = None
    """A variable-batch KJT: per feature, the bag of each output sample (its ``inverse_indices``)."""


@dataclass(frozen=True)
class _Group:
    """The module's tables of one embedding dim."""

    dim: int
    tables: tuple[int, ...]  # store table indices, ascending (the order of their keys)
    features: tuple[int, ...]  # the features on them (positions in the output), in output order
    modes: tuple[str, ...]  # each feature's pooling
    fused: bool  # one feature per table and one pooling: every feature pooled in one call


@torch.compiler.disable
def _eager_forward(module: StoreEmbeddingBagCollection, features) -> KeyedTensor:
    """Under ``torch.compile``: the lookup runs eagerly (a graph break), the dense model compiles."""
    return module._forward(features)


# FX symbolic tracing in progress (torch's probe; absent from older versions)
_fx_tracing = getattr(torch.fx._symbolic_trace, "is_fx_symbolic_tracing", lambda: False)


def sum_by_key(keys: np.ndarray, grads: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    """Gradients of possibly repeated keys summed per key: -> (sorted unique keys, [U, dim])."""
    if len(keys) < 2 or bool(np.all(keys[1:] > keys[:-1])):
        return keys, grads
    uniq, inverse = np.unique(keys, return_inverse=True)
    summed = torch.zeros((len(uniq), grads.shape[1]), dtype=grads.dtype)
    summed.index_add_(0, torch.from_numpy(inverse.reshape(-1)), grads)
    return uniq, summed


def _check_tables(tables: list[EmbeddingBagConfig], store: EmbeddingStore | None, device: torch.device) -> None:
    """The module's tables as ``StoreEmbeddingBagCollection`` takes them (each refusal one
    ``ValueError``); a table with no feature names gets its own name, as torchrec's does."""
    names = set()
    for c in tables:
        if c.name in names:
            raise ValueError(f"Duplicate table name {c.name}")  # torchrec's words and type
        names.add(c.name)
    if store is None and device.type != "meta":
        raise ValueError("StoreEmbeddingBagCollection: a store is required (store=None only on device='meta')")
    for c in tables:
        if not c.feature_names:  # as torchrec's EmbeddingBagCollection: the table's own name
            c.feature_names = [c.name]
        if c.pooling not in _MODES:
            raise ValueError(f"table {c.name!r}: pooling {c.pooling} not supported; use SUM or MEAN")
        if c.data_type != DataType.FP32:
            raise ValueError(f"table {c.name!r}: data_type {c.data_type} not supported; the store holds FP32 rows")
        if store is None:
            continue
        spec = store.tables.spec(c.name)  # raises UnknownTableError naming the table
        if (spec.num_rows, spec.dim) != (c.num_embeddings, c.embedding_dim):
            raise ValueError(
                f"table {c.name!r}: config has {c.num_embeddings} rows x {c.embedding_dim} dim, "
                f"store has {spec.num_rows} x {spec.dim}"
            )


class StoreEmbeddingBagCollection(EmbeddingBagCollectionInterface):
    """torchrec's ``EmbeddingBagCollection`` over rows that live in an ``EmbeddingStore``.

    ``StoreEmbeddingBagCollection(tables, store, is_weighted=False, row_source=None, device=None,
    weights_mb=0.0)``: ``tables`` as torchrec takes them (each must be a table of ``store`` with the
    same rows and dim; duplicate names raise ``ValueError`` as torchrec's does), ``row_source`` where
    forward reads rows (the store, or a stage or prefetch in front of it), ``device`` where the pooled
    embeddings are computed (rows are moved there; ``.device`` says which, and follows
    ``module.to(...)``). On ``device="meta"`` (torchrec's planners build modules there) the store may
    be None and is never read: forward returns meta tensors of the output's shape.

    ``kernels`` (default ``"fbgemm"``): the pooling and its backward in fbgemm's TBE host kernels,
    the fused engine's own (``embeddings.bags.kernels``), wherever a call has rows on the host, one
    number of bags per feature and no per-sample weights; ``"torch"``: torch's
    ``index_select`` and ``embedding_bag`` everywhere (the path the others take). The update is the
    store's optimizer either way (``apply_gradients``).

    ``weights_mb`` (default 0: none): a table of at most that many MB of fp32 weights is given as
    torchrec gives it: ``embedding_bags[name].weight`` (its rows read from the store, a copy) and
    ``state_dict``'s ``embedding_bags.<table>.weight`` in place of its location entry, so a torchrec
    ``EmbeddingBagCollection`` loads this module's state dict and this module loads its (the rows
    written to the store, each row's optimizer state kept). A larger table's ``weight`` (and its
    ``state_dict`` entry, beside the location entry) is a ``RowsTensor``: its rows read on demand,
    saved and loaded by DCP a block at a time. A plain ``weight`` in a loaded state dict is always
    written to the store, whatever the budget; a ``RowsTensor`` moves no rows.

    What it refuses, each with one clear error:

    - FX symbolic tracing, ``torch.jit.trace``, ``torch.jit.script`` and ``torch.export`` of a module
      that holds it raise ``NotTraceableError``: the lookup pulls rows from a store at run time, which
      a graph cannot hold. (``torch.compile`` works: the lookup runs eagerly, a graph break.)
    - Pooling other than SUM and MEAN, and tables of ``data_type`` other than FP32 (the store holds
      float32 rows), raise ``ValueError`` at construction.
    - Weighted MEAN pooling raises at forward, as torchrec's module does (torch's ``embedding_bag``
      takes per-sample weights with SUM only).
    """

    def __init__(
        self,
        tables: list[EmbeddingBagConfig],
        store: EmbeddingStore | None = None,
        is_weighted: bool = False,
        row_source=None,
        device: torch.device | str | None = None,
        weights_mb: float = 0.0,
        kernels: str = "fbgemm",
    ) -> None:
        super().__init__()
        if not weights_mb >= 0:
            raise ValueError(f"StoreEmbeddingBagCollection weights_mb={weights_mb} must be >= 0")
        if kernels not in KERNELS:
            raise ValueError(f"StoreEmbeddingBagCollection kernels={kernels!r}: one of {', '.join(KERNELS)}")
        self._kernels = kernels
        # none given: the default device (``with torch.device("meta"):`` builds on meta, as torchrec's)
        self._device = torch.device(device) if device is not None else torch.empty(0).device
        self._on_host = self._device.type == "cpu"
        _check_tables(tables, store, self._device)
        self._configs = list(tables)
        self._weighted = bool(is_weighted)
        self._names = get_embedding_names_by_table(tables)
        self.store = store
        # where forward gets rows: the store, or a stage/prefetch in front of it (``pull_keys``)
        self.row_source = row_source if row_source is not None else store
        index = (lambda c, i: store.tables.index(c.name)) if store is not None else (lambda c, i: i)
        table_of = [index(c, i) for i, c in enumerate(tables)]
        # per feature, in output order: (feature name, store table index, rows)
        self._features = [(f, t, c.num_embeddings) for c, t in zip(tables, table_of) for f in c.feature_names]
        self._feature_names = [f for f, _, _ in self._features]
        self._table_names = {t: c.name for c, t in zip(tables, table_of)}
        self._output_keys = [name for names in self._names for name in names]
        self._lengths = [c.embedding_dim for c in tables for _ in c.feature_names]
        modes = [_MODES[c.pooling] for c in tables for _ in c.feature_names]
        # per feature: its table's rows (the bound of its ids) and the table's key bits
        self._limits = torch.tensor([n for _, _, n in self._features], dtype=torch.int64)
        self._bases = torch.tensor([t << rowkeys.ROW_BITS for _, t, _ in self._features], dtype=torch.int64)
        # each feature on a table of its own, tables ascending: a batch's keys sort feature by feature
        # (``sorted_keys``); the bits an id takes, beside those of its position in the batch
        tables_in_order = [t for _, t, _ in self._features]
        self._by_feature = tables_in_order == sorted(set(tables_in_order))
        self._id_bits = max([int(n) for _, _, n in self._features] + [1]).bit_length()
        dims = list(dict.fromkeys(c.embedding_dim for c in tables))
        self.dim = dims[0] if len(dims) == 1 else None  # None: tables of several dims (or none)
        self._groups = []
        for d in dims:
            of_dim = [(t, c) for t, c in zip(table_of, tables) if c.embedding_dim == d]
            mine = {t for t, _ in of_dim}
            feats = tuple(j for j, (_, t, _) in enumerate(self._features) if t in mine)
            fmodes = tuple(modes[j] for j in feats)
            fused = len(feats) == len(of_dim) and len(set(fmodes)) == 1
            self._groups.append(_Group(d, tuple(sorted(mine)), feats, fmodes, fused))
        # the fast path: one dim, one pooling, one feature per table (our DLRM's shape)
        self._fast = len(self._groups) == 1 and self._groups[0].fused
        self._mode = modes[0] if self._fast else None
        # where each table's rows are, as its state_dict entry (the rows themselves are not in it)
        # optimizer steps applied (``apply_gradients`` calls): Adam's bias correction counts them; in
        # every table's state_dict entry, and put back by a load
        self._steps = [0]
        self.embedding_bags = nn.ModuleDict(  # torchrec's attribute name
            {c.name: TableLocation(location_entry(c, store), self._steps, store, weights_mb) for c in tables}
        )
        # per forward with grad: (dim, packed keys [U], leaves of their rows in key order: one for
        # every table of a dim, or with several features on a table one per table, each feature
        # pooled by its own call, so that a table's row gradient sums its features' contributions in
        # the order torchrec's EmbeddingBagCollection sums them)
        self._pending: list[tuple[int, np.ndarray, list[torch.Tensor]]] = []
        self._warned_unapplied = False
        self._cache: list[tuple[KeyedJaggedTensor, BatchKeys]] = []
        self._cache_lock = threading.Lock()

    def embedding_bag_configs(self) -> list[EmbeddingBagConfig]:
        return self._configs

    def is_weighted(self) -> bool:
        return self._weighted

    @property
    def device(self) -> torch.device:
        """Where forward computes (rows are moved there); follows ``module.to(device)``."""
        return self._device

    def _apply(self, fn, recurse=True):
        # ``to``, ``cuda``, ``cpu``, ``to_empty``: the module has no tensors of its own, so learn the
        # target device from what ``fn`` does to an empty one
        self._device = fn(torch.empty(0, device=self._device)).device
        self._on_host = self._device.type == "cpu"
        return super()._apply(fn, recurse)

    def __prepare_scriptable__(self):
        raise NotTraceableError(self._refusal("scripted by torch.jit.script"))

    def _refusal(self, how: str) -> str:
        kind = type(self.store).__name__ if self.store is not None else "a store"
        return (
            f"StoreEmbeddingBagCollection cannot be {how}: its forward pulls rows from {kind} at run time, "
            "which a graph cannot hold. Keep the module eager (torch.compile works: the lookup runs eagerly) "
            "or trace/export the dense part of the model alone."
        )

    def batch_keys(self, features: KeyedJaggedTensor) -> BatchKeys:
        """The batch's unique row keys and lookups, computed once per batch: by the data reader's
        read-ahead thread (``prepare``) or by the first of stage, prefetch and forward to ask. The
        newest few are kept: the batch in training, the next one and those being read ahead."""
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
        if not isinstance(features, KeyedJaggedTensor):
            features = maybe_td_to_kjt(features, None)  # a TensorDict, as torchrec's module takes it
        if features.device().type != "cpu":  # keys are worked out on the host, for the store
            features = features.to(_HOST)
        names = self._feature_names
        if not names:  # tables=[]: nothing to look up
            empty = torch.empty(0, dtype=torch.int64)
            return BatchKeys(
                np.empty(0, np.int64), empty, torch.zeros(1, dtype=torch.int64), features.stride(), groups=[]
            )
        vbe = features.variable_stride_per_key()
        weights = bags = None
        if features.keys() == names:  # the usual case: the batch holds exactly these features, in order
            values, lengths, batch = features.values(), features.length_per_key(), features.stride()
            offsets = features.offsets()
            if vbe:
                bags = features.stride_per_key()
            if self._weighted:
                weights = features.weights()
        else:
            # each feature's values and bags cut out of the batch (not ``to_dict``, which fails on a
            # batch of no samples)
            at = {k: i for i, k in enumerate(features.keys())}
            missing = [f for f in names if f not in at]
            if missing:
                raise KeyError(f"features {missing} are not in the batch (it has {features.keys()})")
            batch = features.stride()
            per_key = features.stride_per_key() if vbe else [batch] * len(at)
            vstart = np.concatenate([[0], np.cumsum(features.length_per_key(), dtype=np.int64)]).tolist()
            bstart = np.concatenate([[0], np.cumsum(per_key, dtype=np.int64)]).tolist()
            pick = [at[f] for f in names]
            all_values, all_lengths = features.values(), features.lengths()
            values = torch.cat([all_values[vstart[i] : vstart[i + 1]] for i in pick])
            lengths = [vstart[i + 1] - vstart[i] for i in pick]
            per_bag = torch.cat([all_lengths[bstart[i] : bstart[i + 1]] for i in pick]).to(torch.int64)
            if vbe:
                bags = [per_key[i] for i in pick]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), per_bag.cumsum(0)])
            if self._weighted:
                all_weights = features.weights()
                weights = torch.cat([all_weights[vstart[i] : vstart[i + 1]] for i in pick])
        num_bags = len(names) * batch if bags is None else sum(bags)
        if len(offsets) != num_bags + 1:
            raise ValueError(f"batch has {len(offsets) - 1} bags for {len(names)} features x batch {batch}")
        values = values.to(torch.int64)
        got = None
        if self._by_feature and not vbe and all(n == batch for n in lengths):
            got = sorted_keys(values, batch, self._bases, self._limits, self._id_bits)
        if got is None:
            got = checked_unique(values, lengths, self)
        uniq, inverse = got
        offsets = offsets.to(torch.int64)
        # no bag empty with one value a bag over all: each holds one (numpy: no op that lets go of the GIL)
        starts = offsets.numpy()
        single = len(values) == num_bags and bool((starts[1:] != starts[:-1]).all())
        ctx = BatchKeys(uniq.numpy(), inverse, offsets, batch, single, weights)
        ctx.bags = [batch] * len(names) if bags is None else list(bags)
        spread = features.inverse_indices_or_none()
        if spread is not None:  # each feature's bags spread over the output's samples, as torchrec's module does
            at = {k: i for i, k in enumerate(spread[0])}
            ctx.expand = [spread[1][at[f]].to(torch.int64) for f in names]
            ctx.batch_size = int(spread[1].shape[1])
        if not self._fast or spread is not None:
            ctx.groups = self._group_keys(ctx, [int(n) for n in lengths])
        if not self._on_host:
            self._move(ctx)
        return ctx

    def _group_keys(self, ctx: BatchKeys, lengths: list[int]) -> list[GroupKeys]:
        """The general path's per-dim work of a batch: each dim's keys and, per pooling call, the
        positions of its values in that dim's rows, its bag offsets and weights."""
        keys, inverse, offsets, weights = ctx.keys, ctx.inverse, ctx.offsets, ctx.weights
        vstart = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
        bstart = np.concatenate([[0], np.cumsum(ctx.bags, dtype=np.int64)]).tolist()
        slices = {t: (lo, hi) for t, lo, hi in rowkeys.table_slices(keys)}
        one = len(self._groups) == 1
        out = []
        for plan in self._groups:
            present = [(t, *slices[t]) for t in plan.tables if t in slices]
            if one:
                gkeys = keys
            elif present:
                gkeys = np.concatenate([keys[lo:hi] for _, lo, hi in present])
            else:
                gkeys = np.empty(0, np.int64)
            place, at = {}, 0  # table -> (its place in `present`, its first row in gkeys, in keys)
            for i, (t, lo, hi) in enumerate(present):
                place[t] = (i, at, lo)
                at += hi - lo
            g = GroupKeys(gkeys, [(place[t][1], place[t][1] + hi - lo) for t, lo, hi in present])
            if plan.fused and one:  # every feature in one call over every row: the batch's own arrays
                g.inverse, g.offsets, g.weights = inverse, offsets, weights
            elif plan.fused:
                inv, off, w, n = [], [], [], 0
                for j in plan.features:
                    s, e = vstart[j], vstart[j + 1]
                    _, first, lo = place.get(self._features[j][1], (-1, 0, 0))
                    inv.append(inverse[s:e] - (lo - first))
                    off.append(offsets[bstart[j] : bstart[j + 1]] - s + n)
                    if weights is not None:
                        w.append(weights[s:e])
                    n += e - s
                off.append(torch.tensor([n], dtype=torch.int64))
                g.inverse, g.offsets = torch.cat(inv), torch.cat(off)
                g.weights = torch.cat(w) if weights is not None else None
            else:
                g.features = []
                for j in plan.features:
                    s, e = vstart[j], vstart[j + 1]
                    i, _, lo = place.get(self._features[j][1], (-1, 0, 0))
                    g.features.append(
                        (
                            i,
                            inverse[s:e] - lo,
                            offsets[bstart[j] : bstart[j + 1] + 1] - s,
                            weights[s:e] if weights is not None else None,
                        )
                    )
            out.append(g)
        return out

    def _move(self, ctx: BatchKeys) -> None:
        """The batch's index tensors on the module's device (keys stay on the host, for the store)."""
        dev = self._device

        def to(t):
            return t.to(dev, non_blocking=True) if t is not None else None

        ctx.inverse, ctx.offsets, ctx.weights = to(ctx.inverse), to(ctx.offsets), to(ctx.weights)
        if ctx.expand is not None:
            ctx.expand = [to(e) for e in ctx.expand]
        for g in ctx.groups or []:
            g.inverse, g.offsets, g.weights = to(g.inverse), to(g.offsets), to(g.weights)
            if g.features is not None:
                g.features = [(i, to(v), to(o), to(w)) for i, v, o, w in g.features]

    def unique_keys(self, features: KeyedJaggedTensor) -> np.ndarray:
        """The sorted unique packed row keys that ``forward(features)`` will pull."""
        return self.batch_keys(features).keys

    def forward(self, features: KeyedJaggedTensor) -> KeyedTensor:
        if torch.compiler.is_compiling():  # dynamo (torch.compile, strict torch.export) or non-strict torch.export
            if torch.compiler.is_exporting():
                raise NotTraceableError(self._refusal("exported by torch.export"))
            return _eager_forward(self, features)
        return self._forward(features)

    def _forward(self, features) -> KeyedTensor:
        if torch.jit.is_tracing():
            raise NotTraceableError(self._refusal("traced by torch.jit.trace"))
        if _fx_tracing():
            raise NotTraceableError(self._refusal("traced by torch.fx"))
        if not self._on_host and self._device.type == "meta":
            return self._meta_forward(features)
        if self.store is None:
            raise ValueError("StoreEmbeddingBagCollection built on device='meta' without a store has no rows to read")
        ctx = self.batch_keys(features)
        track = torch.is_grad_enabled() and self.training
        if ctx.groups is not None:
            return self._forward_groups(ctx, track)
        # the fast path: one dim, one pooling, one feature per table; every row pooled in one call
        keys, dim = ctx.keys, self.dim
        rows = torch.from_numpy(self.row_source.pull_keys(keys)) if len(keys) else torch.empty((0, dim))
        if not self._on_host:
            rows = rows.to(self._device)
        num, batch = len(self._features), ctx.batch_size
        if track:
            rows.requires_grad_(True)
            self._track(dim, keys, [rows])
        every = len(ctx.offsets) == num * batch + 1  # as many bags for every feature (no variable batch)
        if self._kernels == "fbgemm" and every and kernels.applies(rows, self._mode, ctx.weights):
            # fbgemm's TBE forward and backward (``embeddings.bags.kernels``): [B, num_features * dim] at once
            values = kernels.pool(rows, ctx.inverse, ctx.offsets, num, self._mode)
            return KeyedTensor(keys=self._output_keys, length_per_key=[dim] * num, values=values, key_dim=1)
        # one value per bag: a gather, whose backward (index_add) is a quarter of embedding_bag's
        if ctx.single and ctx.weights is None:
            pooled = rows.index_select(0, ctx.inverse)
        else:
            pooled = F.embedding_bag(
                ctx.inverse,
                rows,
                ctx.offsets,
                mode=self._mode,
                per_sample_weights=ctx.weights,
                include_last_offset=True,
            )
        # [num_features * B, dim], feature-major -> [B, num_features * dim]
        values = pooled.view(num, batch, dim).transpose(0, 1).reshape(batch, num * dim)
        return KeyedTensor(keys=self._output_keys, length_per_key=[dim] * num, values=values, key_dim=1)

    def _forward_groups(self, ctx: BatchKeys, track: bool) -> KeyedTensor:
        """Every other shape: per embedding dim one pull; a dim whose tables each feed one feature
        with one pooling pooled in one call, else one call per feature over its table's rows."""
        dev = self._device
        pooled: list[torch.Tensor] = [None] * len(self._features)  # type: ignore[list-item]
        for plan, g in zip(self._groups, ctx.groups):
            d = plan.dim
            rows = torch.from_numpy(self.row_source.pull_keys(g.keys)) if len(g.keys) else torch.empty((0, d))
            if not self._on_host:
                rows = rows.to(dev)
            if plan.fused:
                if track:
                    rows.requires_grad_(True)
                    self._track(d, g.keys, [rows])
                bags = {ctx.bags[j] for j in plan.features}
                if self._kernels == "fbgemm" and len(bags) == 1 and kernels.applies(rows, plan.modes[0], g.weights):
                    out = kernels.pool(rows, g.inverse, g.offsets, len(plan.features), plan.modes[0])
                    for k, j in enumerate(plan.features):  # [B, features * d]: each feature's columns
                        pooled[j] = out[:, k * d : (k + 1) * d]
                    continue
                out = F.embedding_bag(
                    g.inverse,
                    rows,
                    g.offsets,
                    mode=plan.modes[0],
                    per_sample_weights=g.weights,
                    include_last_offset=True,
                )
                at = 0
                for j in plan.features:
                    pooled[j] = out[at : at + ctx.bags[j]]
                    at += ctx.bags[j]
                continue
            leaves = [rows[lo:hi].requires_grad_(True) if track else rows[lo:hi] for lo, hi in g.tables]
            if track and leaves:
                self._track(d, g.keys, leaves)
            for j, mode, (i, inverse, offsets, weights) in zip(plan.features, plan.modes, g.features):
                # a table with no id in the batch: an empty one (its bags pool to zeros, as torchrec's)
                leaf = leaves[i] if i >= 0 else torch.empty((0, d), device=dev, requires_grad=track)
                pooled[j] = F.embedding_bag(
                    inverse, leaf, offsets, mode=mode, per_sample_weights=weights, include_last_offset=True
                )
        if ctx.expand is not None:  # a variable batch per feature: each sample's bag
            pooled = [p.index_select(0, e) for p, e in zip(pooled, ctx.expand)]
        values = torch.cat(pooled, dim=1) if pooled else torch.empty((ctx.batch_size, 0), device=dev)
        return KeyedTensor(keys=self._output_keys, length_per_key=list(self._lengths), values=values, key_dim=1)

    def _meta_forward(self, features) -> KeyedTensor:
        """On the meta device (planners, shape inference): the output's shape; no store is read."""
        if not isinstance(features, KeyedJaggedTensor):
            features = maybe_td_to_kjt(features, None)
        inverse = features.inverse_indices_or_none()
        batch = int(inverse[1].shape[1]) if inverse is not None else features.stride()
        values = torch.empty((batch, sum(self._lengths)), device=self._device)
        return KeyedTensor(keys=self._output_keys, length_per_key=list(self._lengths), values=values, key_dim=1)

    def _track(self, dim: int, keys: np.ndarray, leaves: list[torch.Tensor]) -> None:
        """Keep a forward's row leaves for ``pop_key_grads``; warn once when row gradients pile up
        unapplied (a loop that steps a dense optimizer over ``model.parameters()`` only)."""
        if len(self._pending) >= _UNAPPLIED_WARN and not self._warned_unapplied:
            backwards = sum(any(leaf.grad is not None for leaf in ls) for _, _, ls in self._pending)
            if backwards >= _UNAPPLIED_WARN * len(self._groups):
                self._warned_unapplied = True
                warnings.warn(
                    f"StoreEmbeddingBagCollection: the row gradients of {backwards // len(self._groups)} backward passes were "
                    "never applied. Its tables are not in model.parameters() (an optimizer over them trains the "
                    "dense part only); call apply_gradients() after each backward (or pop_key_grads() to apply "
                    "them yourself)",
                    stacklevel=3,
                )
        self._pending.append((dim, keys, leaves))

    @staticmethod
    def _collect(pending, keys: list, grads: list) -> None:
        """The keys and row gradients of ``pending`` forwards, in order, onto ``keys`` and ``grads``."""
        for _, k, leaves in pending:
            if all(leaf.grad is not None for leaf in leaves):
                keys.append(k)
                grads.extend(leaf.grad for leaf in leaves)
                continue
            at = 0  # some tables took no part in the loss (or no backward ran): their rows get no update
            for leaf in leaves:
                n = leaf.shape[0]
                if leaf.grad is not None:
                    keys.append(k[at : at + n])
                    grads.append(leaf.grad)
                at += n

    def _joined(self, keys: list, grads: list) -> tuple[np.ndarray, torch.Tensor]:
        # one forward of one leaf (the usual step): its keys as they are, the object the stage's
        # read looked up (the row cache finds a step's write by its read's keys), no copy
        g = grads[0] if len(grads) == 1 else torch.cat(grads)
        return keys[0] if len(keys) == 1 else np.concatenate(keys), g if self._on_host else g.cpu()

    def pop_key_grads(self) -> tuple[np.ndarray, torch.Tensor]:
        """Per-row gradients of the forwards since the last pop, then forgotten: (packed keys [n],
        gradients [n, dim]) on the host; a key appears once per forward that pulled it (and had a
        gradient). Tables of several dims: ``pop_key_grads_by_dim``."""
        if self.dim is None and self._groups:
            raise ValueError(
                "StoreEmbeddingBagCollection: tables of several embedding dims; use pop_key_grads_by_dim()"
            )
        keys, grads = [], []
        self._collect(self._pending, keys, grads)
        self._pending = []
        if not keys:
            return np.empty(0, np.int64), torch.empty((0, self.dim or 0))
        return self._joined(keys, grads)

    def pop_key_grads_by_dim(self) -> dict[int, tuple[np.ndarray, torch.Tensor]]:
        """``pop_key_grads`` per embedding dim: dim -> (packed keys [n], gradients [n, dim]); dims
        without a gradient are left out."""
        pending, self._pending = self._pending, []
        out = {}
        for dim in dict.fromkeys(d for d, _, _ in pending):
            keys, grads = [], []
            self._collect([p for p in pending if p[0] == dim], keys, grads)
            if keys:
                out[dim] = self._joined(keys, grads)
        return out

    def apply_gradients(self) -> None:
        """Send this step's per-row gradients to the store's optimizer (one write per embedding dim),
        then forget them."""
        self._steps[0] += 1  # a step, with or without a gradient (as torch's optimizers count one)
        for keys, grads in self.pop_key_grads_by_dim().values():
            keys, grads = sum_by_key(keys, grads)
            if len(keys):
                self.store.apply_keys(keys, grads, t=self._steps[0])

    @property
    def optimizer_step(self) -> int:
        """Optimizer steps applied so far (``apply_gradients`` calls; ``Adam``'s ``t`` is the next)."""
        return self._steps[0]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._pending = []
        super().zero_grad(set_to_none)


def checked_unique(values: torch.Tensor, lengths: list[int], module) -> tuple[torch.Tensor, torch.Tensor]:
    """Every id of ``module``'s features (``lengths`` values each, in its feature order) in its
    table's range (else ``RowRangeError`` naming the first out of it), -> (the sorted unique packed
    keys, each value's position among them)."""
    counts = torch.tensor(lengths, dtype=torch.int64)
    limit = torch.repeat_interleave(module._limits, counts)
    bad = (values < 0) | (values >= limit)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0])
        f = int(torch.searchsorted(counts.cumsum(0), torch.tensor(i), right=True))
        name, t, n = module._features[f]
        raise RowRangeError(
            f"table {module._table_names[t]!r} (feature {name!r}): row id {int(values[i])} out of range [0, {n})"
        )
    base = torch.repeat_interleave(module._bases, counts)
    return torch.unique(values + base, return_inverse=True)


def sorted_keys(
    values: torch.Tensor, batch: int, bases: torch.Tensor, limits: torch.Tensor, id_bits: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``checked_unique`` where every feature has ``batch`` ids, each on a table of its own in
    ascending order (``bases``, ``limits``: each feature's table's first packed key and rows;
    ``id_bits``: the bits the largest id takes): the ids of each feature sorted apart, each with its
    position in the low bits of one int64 (one small sort a feature, no index array sorted beside the
    keys: half of ``torch.unique``'s time at batch 512 and 1024). A feature's keys are all below the
    next one's, so the features' runs joined are sorted. The same keys and positions. None: an id out
    of range, or ids too wide for the bits (the general path answers)."""
    bits = max(batch - 1, 1).bit_length()
    if not batch or id_bits + bits > 62:
        return None
    ids = values.numpy().reshape(-1, batch)
    packed = np.sort((ids << bits) | np.arange(batch, dtype=np.int64), axis=1)
    low, high = packed[:, 0] >> bits, packed[:, -1] >> bits  # each feature's least and largest id
    if bool((low < 0).any() or (high >= limits.numpy()).any()):
        return None
    keys = ((packed >> bits) + bases.numpy()[:, None]).reshape(-1)
    first = np.empty(len(keys), bool)
    first[:1] = True
    np.not_equal(keys[1:], keys[:-1], out=first[1:])
    inverse = np.empty(len(keys), np.int64)
    at = (packed & ((1 << bits) - 1)) + np.arange(0, len(keys), batch, dtype=np.int64)[:, None]
    inverse[at.reshape(-1)] = np.cumsum(first) - 1
    return torch.from_numpy(keys[first]), torch.from_numpy(inverse)
