"""A table's place in a ``StoreEmbeddingBagCollection``'s ``state_dict``: its ``weight`` as a
``RowsTensor`` (its rows read from the store on demand, saved and loaded by DCP a block at a time)
and its ``_extra_state`` entry saying where the rows are (``TableLocation``)."""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig

_HOST = torch.device("cpu")


ROWS_BLOCK_BYTES = 8 << 20
"""A ``RowsTensor`` is read, saved (DCP) and written a block of about this many bytes of rows at a time."""


class RowsTensor(torch.Tensor):
    """A table's ``weight`` whose rows stay on the store: a ``[num_rows, dim]`` float32 tensor (or a
    view of rows ``lo..lo + n``, columns ``c0..c1`` of one) that reads its rows when an op needs
    them, as torchrec's ``PartiallyMaterializedTensor`` (over fbgemm's ``KVTensorWrapper``) does for
    its key-value tables. ``state_dict()``'s ``embedding_bags.<table>.weight`` of a table over
    ``weights_mb``, and its ``embedding_bags[name].weight``.

    - ``torch.distributed.checkpoint`` saves it in blocks (``__create_write_items__``: one chunk per
      ``ROWS_BLOCK_BYTES`` of rows, each read when DCP writes it) and loads into it in blocks
      (``__create_chunk_list__``, ``__get_tensor_shard__``: a view of the chunk's rows, whose
      ``copy_`` writes them to the store, each row's optimizer state kept).
    - ``w[lo:hi]`` (``narrow``, slices of rows or columns) is a view: nothing read. ``copy_`` and
      every in-place op write the rows back. Any other op reads the rows it covers (``materialize()``
      is every row of the view, a plain tensor) and runs on them: ``torch.equal(w, x)`` reads the
      table. ``torch.save``/``pickle`` write the rows (a plain tensor).
    """

    _store: object
    _table: str
    _lo: int
    _c0: int

    @staticmethod
    def __new__(cls, store, table: str, lo: int, n: int, c0: int, c1: int):
        t = torch.Tensor._make_wrapper_subclass(cls, (n, c1 - c0), dtype=torch.float32, device=_HOST)
        t._store, t._table, t._lo, t._c0 = store, table, lo, c0
        return t

    def __init__(self, *args, **kwargs) -> None:
        super().__init__()

    @classmethod
    def of(cls, store, table: str) -> RowsTensor:
        spec = store.tables.spec(table)
        return cls(store, table, 0, spec.num_rows, 0, spec.dim)

    def _view(self, lo: int, n: int, c0: int, c1: int) -> RowsTensor:
        return RowsTensor(self._store, self._table, lo, n, c0, c1)

    @property
    def _block_rows(self) -> int:
        return max(1, ROWS_BLOCK_BYTES // (4 * max(1, self.shape[1])))

    def same_rows(self, store, table: str) -> bool:
        """Whether this is every row of ``table``'s weights on ``store``."""
        spec = store.tables.spec(table)
        full = self._lo == 0 and self._c0 == 0 and tuple(self.shape) == (spec.num_rows, spec.dim)
        return self._store is store and self._table == table and full

    def materialize(self) -> torch.Tensor:
        """Every row of the view, read from the store: a plain tensor ``[n, cols]`` (a copy)."""
        n, cols = self.shape
        rows = self._store.read_rows(self._table, np.arange(self._lo, self._lo + n))  # type: ignore[attr-defined]
        return torch.from_numpy(np.ascontiguousarray(rows[:, self._c0 : self._c0 + cols]))

    def write(self, src: torch.Tensor) -> None:
        """``src`` onto the view's rows on the store, a block at a time; the rest of each row (other
        columns, the optimizer's state) kept."""
        n, cols = self.shape
        src = src.detach().to(_HOST, torch.float32).expand(n, cols)
        step = self._block_rows
        for at in range(0, n, step):
            k = min(step, n - at)
            block = src[at : at + k]
            block = block.materialize() if isinstance(block, RowsTensor) else block
            ids = np.arange(self._lo + at, self._lo + at + k)
            rows = self._store.read_rows(self._table, ids)  # type: ignore[attr-defined]
            rows[:, self._c0 : self._c0 + cols] = block.numpy()
            self._store.write_rows(self._table, ids, rows)  # type: ignore[attr-defined]

    # -- torch.distributed.checkpoint: saved and loaded a block at a time -------------------------
    def _chunks(self) -> list[tuple[int, int]]:
        n = int(self.shape[0])
        step = self._block_rows
        return [(at, min(step, n - at)) for at in range(0, max(n, 1), step)] if n else [(0, 0)]

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        cols = int(self.shape[1])
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([at, 0])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([at, 0]), sizes=torch.Size([k, cols])),
                    properties=TensorProperties(dtype=torch.float32),
                    size=self.shape,
                ),
            )
            for at, k in self._chunks()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        cols = int(self.shape[1])
        return [ChunkStorageMetadata(torch.Size([at, 0]), torch.Size([k, cols])) for at, k in self._chunks()]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        at = int(index.offset[0]) if index.offset is not None else 0
        k = dict(self._chunks()).get(at)
        if k is None:
            raise ValueError(f"table {self._table!r}: no chunk of rows at offset {list(index.offset)}")
        return self._view(self._lo + at, k, self._c0, self._c0 + int(self.shape[1]))

    # -- every other op ---------------------------------------------------------------------------
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        kwargs = kwargs or {}
        aten = torch.ops.aten
        first = args[0] if args else None
        if isinstance(first, RowsTensor):
            n, cols = (int(x) for x in first.shape)
            if func in (aten.detach.default, aten.alias.default):
                return first._view(first._lo, n, first._c0, first._c0 + cols)
            if func is aten.slice.Tensor:
                dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1 :])[:4]
                dim, size = int(dim) % 2, (n, cols)[int(dim) % 2]
                lo, hi, _ = slice(start, end).indices(size)
                if step == 1:
                    hi = max(lo, hi)
                    if dim == 0:
                        return first._view(first._lo + lo, hi - lo, first._c0, first._c0 + cols)
                    return first._view(first._lo, n, first._c0 + lo, first._c0 + hi)
            if func is aten.copy_.default:
                first.write(args[1])
                return first

        def plain(x):
            return x.materialize() if isinstance(x, RowsTensor) else x

        pargs, pkwargs = tree_map(plain, args), tree_map(plain, kwargs)
        out = func(*pargs, **pkwargs)
        if isinstance(first, RowsTensor) and func._schema.is_mutable:  # add_, normal_, zero_, ...: written back
            first.write(pargs[0])
            return first
        return out

    def __repr__(self, *, tensor_contents=None) -> str:
        n, cols = (int(x) for x in self.shape)
        where = type(self._store).__name__
        return f"RowsTensor(table {self._table!r}, rows {self._lo}..{self._lo + n} x {cols} on {where}: read on demand)"

    def __reduce_ex__(self, protocol):
        return self.materialize().__reduce_ex__(protocol)


class TableLocation(nn.Module):
    """Where one table's rows live, as its ``state_dict`` entry (``embedding_bags.<table>._extra_state``,
    where torchrec's ``EmbeddingBagCollection`` keeps ``embedding_bags.<table>.weight``): a small dict of
    plain values (``torch.load(weights_only=True)`` reads it) naming the store kind, its namespace,
    the table's shape, pooling, row optimizer and init seed. The rows themselves are not in it.

    Loading a location entry moves no rows: an entry for another shape of the table is refused
    (``ValueError``); one that names another store or namespace warns that the rows stay where they
    are. The table's ``weight`` entry: see ``_load_from_state_dict``."""

    def __init__(self, entry: dict, steps: list[int] | None = None, store=None, weights_mb: float = 0.0) -> None:
        super().__init__()
        self.entry = entry
        self.steps = steps if steps is not None else [0]  # the module's optimizer step, shared by its tables
        self._store = store
        self.weights_mb = weights_mb
        self.mb = entry["num_rows"] * entry["dim"] * 4 / 2**20  # the table's weights, fp32

    @property
    def as_weight(self) -> bool:
        """Whether the table is given as torchrec gives it (``weight``, ``state_dict``'s ``weight``)."""
        return self._store is not None and self.mb <= self.weights_mb

    @property
    def weight(self) -> torch.Tensor:
        """The table's rows [num_rows, dim]: within ``weights_mb`` read from the store (a copy: writes
        to it stay here); beyond it a ``RowsTensor``, which reads them when an op needs them (and
        writes an in-place op's result back). Without a store (the meta device): one line."""
        name = self.entry["table"]
        if self._store is None:  # built on the meta device: the shape alone, as torchrec's module there
            return torch.empty((self.entry["num_rows"], self.entry["dim"]), device="meta")
        if not self.as_weight:
            return RowsTensor.of(self._store, name)
        rows = self._store.read_rows(name, np.arange(self.entry["num_rows"]))
        return torch.from_numpy(np.ascontiguousarray(rows[:, : self.entry["dim"]]))

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self.as_weight:  # torchrec's key alone: a torchrec module loads it as its own
            destination[prefix + "weight"] = self.weight
            return
        # torchrec's key: its rows read on demand (DCP: a block at a time); on the meta device, the shape
        destination[prefix + "weight"] = (
            RowsTensor.of(self._store, self.entry["table"]) if self._store is not None else self.weight
        )
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        """``weight``: a tensor is written to the store (a block at a time, each row's optimizer state
        kept); a ``RowsTensor`` (a module's over a store) moves no rows. ``_extra_state``: as
        ``set_extra_state`` says."""
        key, extra = prefix + "weight", prefix + "_extra_state"
        weight = state_dict.get(key)
        table = self.entry["table"]
        if weight is not None and weight.is_meta:  # a module's on the meta device: no rows anywhere
            pass
        elif isinstance(weight, RowsTensor):
            if extra not in state_dict and self._store is not None and not weight.same_rows(self._store, table):
                warnings.warn(
                    f"table {table!r}: load_state_dict moves no rows: the weight reads table {weight._table!r} "
                    "on another store; the rows stay where they are",
                    stacklevel=2,
                )
        elif weight is not None:
            shape = (self.entry["num_rows"], self.entry["dim"])
            if tuple(weight.shape) != shape:
                errors.append(f"table {table!r}: a weight of {tuple(weight.shape)} for a table of {shape}")
                return
            if self._store is None:
                errors.append(f"table {table!r}: a weight to load, and no store to hold it")
                return
            self._write(weight)
        if weight is None or extra in state_dict:
            rest = {k: v for k, v in state_dict.items() if k != key}
            super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing, unexpected, errors)

    def _write(self, weight: torch.Tensor) -> None:
        """The table's weights onto the store, a block at a time, each row's optimizer state kept."""
        RowsTensor.of(self._store, self.entry["table"]).write(weight)

    def get_extra_state(self) -> dict:
        return {**self.entry, "optimizer_step": self.steps[0]}

    def set_extra_state(self, state) -> None:
        name = self.entry["table"]
        shape = ("table", "num_rows", "dim")
        if not isinstance(state, dict) or any(state.get(k) != self.entry[k] for k in shape):
            got = {k: state.get(k) for k in shape} if isinstance(state, dict) else state
            raise ValueError(
                f"table {name!r}: the state_dict's entry {got} is not this table "
                f"({ {k: self.entry[k] for k in shape} }); its rows live on a store, not in the state_dict"
            )
        self.steps[0] = int(state.get("optimizer_step", self.steps[0]))
        where = ("store", "namespace")
        if any(state.get(k) != self.entry[k] for k in where):
            warnings.warn(
                f"table {name!r}: load_state_dict moves no rows: the loaded entry names store "
                f"{state.get('store')} namespace {state.get('namespace')!r}, this module reads "
                f"{self.entry['store']} namespace {self.entry['namespace']!r}; the rows stay where they are",
                stacklevel=2,
            )

    def extra_repr(self) -> str:
        e = self.entry
        return f"{e['table']}: {e['num_rows']} x {e['dim']} on {e['store']} namespace {e['namespace']!r}"


def location_entry(c: EmbeddingBagConfig, store) -> dict:
    """A table's ``_extra_state`` entry: where its rows are (``TableLocation``)."""
    opt = getattr(store, "optimizer", None)
    return {
        "table": c.name,
        "num_rows": c.num_embeddings,
        "dim": c.embedding_dim,
        "pooling": c.pooling.name,
        "store": type(store).__name__ if store is not None else None,
        "namespace": getattr(store, "namespace", None),
        "optimizer": type(opt).__name__ if opt is not None else None,
        "seed": getattr(store, "seed", None),
        "rows": "on the store, not in this state_dict",
    }
