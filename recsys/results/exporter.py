"""``python -m recsys export RUN --to DIR``: a finished run's trained model as torchrec's own checkpoint.

The output is a ``torch.distributed.checkpoint`` (DCP) folder whose keys are those torchrec's own
``DLRM`` (``--model dcn``: ``DLRM_DCN``) over an ``EmbeddingBagCollection`` of the run's tables has
in its ``state_dict()``:

- ``dense_arch.*``, ``over_arch.*`` (and ``crossnet.*`` under DCN): the dense state the run ended with;
- ``sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight``: every row of every table,
  ``[num_rows, dim]`` float32; rows the run never trained at their initial values (the tier's lazy
  init, as the run read them);
- with ``--optimizer-state``, also ``optim.*``: the dense optimizer's state as
  ``torch.distributed.checkpoint.state_dict.get_state_dict`` keys it (``optim.state.<fqn>.<name>``,
  ``optim.param_groups``), and each table's row optimizer state under its weight's key:
  ``optim.state.<weight key>.momentum1`` (``adagrad``, row-wise: ``[num_rows]``), ``.sum``
  (``adagrad-exact``), ``.exp_avg`` and ``.exp_avg_sq`` (``adam``).

A torchrec model loads it with ``dcp.load(model.state_dict(), checkpoint_id=DIR)``
(``tests/test_export.py`` does, and evaluates the result on the run's evaluation set: the run's
final AUC and logloss).

Where the rows come from: the run's final model (``{run}/final/step_*``, written at the end of
every run unless ``--no-keep-model``; its SHA-256 manifest is checked first), or with ``--step N``
the run's checkpoint of step N (a committed step of a run that may still be training). With
``--redis URLS`` the rows are read from live servers instead (the run's shards, which keep its rows
under its namespace when the project did not start them): they must stand at the exported step
(every shard's applied marker, checked before and after the rows are read). Each shard's snapshot
is served by a temporary ``redis-server`` (started on a loopback port, stopped at the end) and the
rows are read from it in blocks. Written table by table in bounded memory: every table is cut into
row blocks of about ``--block-mb`` MB, each a chunk of its tensor in DCP's metadata, read from the
shards only when DCP writes it (a ``SavePlanner`` whose ``resolve_data`` reads the rows), one file
per chunk. The process holds about one block at a time whatever the tables' size; the temporary
servers hold the snapshots (about the tables' bytes, in their own processes).

Back into the tier (``recsys train --init-from DIR``, ``check_init_from``, ``stream_rows``,
``load_dense``): a DCP folder of torchrec's keys starts a run. Before anything starts its metadata
must hold every key of the run's model at the run's shape (else one line naming the key); rank 0
streams each table's rows into the shards a block at a time (``BlockLoadPlanner``: DCP reads only
the stored chunks a block overlaps, so a folder written here costs a block of memory; one written
by torch whole, a table), with the row optimizer's state where the folder holds it; every trainer
loads the dense layers. Export, ``--init-from``, export of the new run's checkpoint 0 gives equal
tensors (``tests/test_export.py``).

The run folder is read where it lies now (``recsys.results.rundir.run_config``): a run may be moved or
copied. Bad input (not a run folder, an unfinished run, no final model, a damaged file, a ``--to``
that already holds a checkpoint) is one line, exit 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import resource
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from recovery.durable import layout

# "torch.distributed is disabled ... assuming the intent is to save in a single process": it is
warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")

EBC_PREFIX = "sparse_arch.embedding_bag_collection.embedding_bags."
"""Where torchrec's ``DLRM`` keeps its ``EmbeddingBagCollection``'s tables in its ``state_dict()``."""

ROW_STATE = {
    "sgd": [],
    "adagrad": [("momentum1", 0, 1, True)],
    "adagrad-exact": [("sum", 0, 1, False)],
    "adam": [("exp_avg", 0, 1, False), ("exp_avg_sq", 1, 2, False)],
}
"""``--optimizer`` -> the row optimizer's state, as (name, first, end, one per row): columns
``dim + first * dim .. dim + end * dim`` of a stored row (one column where ``one per row``)."""


class ExportError(Exception):
    """The run cannot be exported (one line; exit 2)."""


def weight_key(table: str) -> str:
    """``sparse_arch.embedding_bag_collection.embedding_bags.<table>.weight``: torchrec's key."""
    return f"{EBC_PREFIX}{table}.weight"


@dataclass
class LazyTensor:
    """A 2-D (or 1-D) float32 tensor of DCP's checkpoint whose rows are read only when written:
    ``read(lo, hi)`` -> rows ``lo..hi`` as ``[hi - lo, cols]`` (``[hi - lo]`` where ``cols`` is None)."""

    fqn: str
    rows: int
    cols: int | None
    read: Callable[[int, int], np.ndarray]
    width: int = 0
    """floats a row of its table takes in the checkpoint (its weights and the state written with
    them): the tensors of a table are cut at the same rows, a block of about the same bytes"""

    @property
    def size(self) -> torch.Size:
        return torch.Size([self.rows] if self.cols is None else [self.rows, self.cols])


class RowsSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the state dict it is given (the dense state), plus ``lazy`` tensors
    cut into chunks of ``block_rows`` rows: each chunk is one write item (``WriteItemType.SHARD``,
    its offsets in the tensor), resolved by reading its rows when the writer gets to it."""

    def __init__(self, lazy: list[LazyTensor], block_rows: Callable[[LazyTensor], int]) -> None:
        super().__init__()
        self.lazy = {t.fqn: t for t in lazy}
        self.block_rows = block_rows
        self.rows_read = 0
        self.bytes_read = 0

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for t in self.lazy.values():
            step = max(1, self.block_rows(t))
            for lo in range(0, max(t.rows, 1), step):
                n = min(step, t.rows - lo)
                offsets = torch.Size([lo] if t.cols is None else [lo, 0])
                sizes = torch.Size([n] if t.cols is None else [n, t.cols])
                items.append(
                    WriteItem(
                        index=MetadataIndex(t.fqn, offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                            properties=TensorProperties(dtype=torch.float32),
                            size=t.size,
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        t = self.lazy.get(write_item.index.fqn)
        if t is None:
            return super().resolve_data(write_item)
        assert write_item.tensor_data is not None
        lo, n = int(write_item.tensor_data.chunk.offsets[0]), int(write_item.tensor_data.chunk.sizes[0])
        rows = np.ascontiguousarray(t.read(lo, lo + n), dtype=np.float32)
        self.rows_read += n
        self.bytes_read += rows.nbytes
        return torch.from_numpy(rows)


def write_dcp(to: Path, state: dict, lazy: list[LazyTensor], block_bytes: int) -> RowsSavePlanner:
    """Write ``state`` (tensors in memory) and ``lazy`` (read as written, in blocks of about
    ``block_bytes``) as one DCP checkpoint in ``to``: one file per block, written one at a time."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    def block_rows(t: LazyTensor) -> int:
        return max(1, block_bytes // (4 * (t.width or t.cols or 1)))

    planner = RowsSavePlanner(lazy, block_rows)
    writer = FileSystemWriter(str(to), single_file_per_rank=False, thread_count=1, sync_files=True)
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    return planner


# -- where the rows are -------------------------------------------------------------------------------
@contextlib.contextmanager
def snapshot_servers(files: list[Path]) -> Iterator[list[str]]:
    """A temporary ``redis-server`` per snapshot file (loaded from it; its persistence off), on
    loopback ports, stopped and removed at the end: -> their URLs."""
    from embeddings.servers.launcher import ShardSpec, _stop_process, find_redis_server, free_port, spawn_shard

    binary = find_redis_server()
    root = Path(tempfile.mkdtemp(prefix="recsys-export-"))
    procs = []
    try:
        urls = []
        for s, f in enumerate(files):
            workdir = root / f"shard{s}"
            workdir.mkdir()
            spec = ShardSpec(index=s, port=free_port(), workdir=str(workdir), binary=binary)
            os.symlink(os.path.abspath(f), spec.rdb_path)  # read at start; never written (save "")
            procs.append(spawn_shard(spec, die_with_parent=True, timeout_s=600.0))
            urls.append(f"redis://127.0.0.1:{spec.port}")
        yield urls
    finally:
        for p in procs:
            _stop_process(p)
        shutil.rmtree(root, ignore_errors=True)


def final_model(run: Path, namespace: str):
    """The run's final model (``{run}/final``, ``recovery.durable.layout.final_dir``), its files checked
    against its manifest. ``ExportError`` where there is none or it is damaged."""
    from recovery.durable.manifest import list_checkpoints
    from recovery.errors import CorruptCheckpointError

    where = layout.final_dir(run)
    kept = list_checkpoints(where, namespace)
    if not kept:
        raise ExportError(
            f"export {run}: no final model in {where} (a run keeps one at its end unless --no-keep-model; "
            "runs of --embeddings local and runs from before it keep none)"
        )
    try:
        kept[0].verify()
    except CorruptCheckpointError as e:
        raise ExportError(f"export {run}: its final model is damaged: {e}") from None
    return kept[0]


def checkpoint_at(cfg, run: Path, namespace: str, step: int):
    """The run's checkpoint of ``step`` (a committed step, the run finished or not), its files
    checked against its manifest. ``ExportError`` where it is not kept or is damaged."""
    from recovery.durable.manifest import list_checkpoints
    from recovery.errors import CorruptCheckpointError

    kept = list_checkpoints(cfg.checkpoint_dir, namespace) if cfg.checkpoint_dir else []
    found = [c for c in kept if c.step == step]
    if not found:
        steps = ", ".join(str(c.step) for c in reversed(kept)) or "none"
        raise ExportError(f"export {run} --step {step}: no checkpoint of that step (kept: {steps})")
    try:
        found[0].verify()
    except CorruptCheckpointError as e:
        raise ExportError(f"export {run} --step {step}: the checkpoint is damaged: {e}") from None
    return found[0]


def dense_state(cfg, dense_dir: Path, optimizer_state: bool) -> tuple[dict, dict | None]:
    """The dense model state (torchrec's keys, no table) and, with ``optimizer_state``, the dense
    optimizer's (``get_state_dict``'s keys), as the run saved them in the DCP folder ``dense_dir``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recsys.model import build_dlrm, dense_optimizer, dense_params, table_configs

    ebc = EmbeddingBagCollection(table_configs(cfg), device=torch.device("meta"))  # no row in memory
    model = build_dlrm(cfg, ebc, stock=True)
    msd = {k: v for k, v in model.state_dict().items() if "embedding_bags" not in k}
    want: dict = {"model": msd}
    osd = None
    if optimizer_state:
        opt = dense_optimizer(cfg, dense_params(model))
        _, osd = get_state_dict(model, opt)
        want["optim"] = osd
    try:
        dcp.load(want, checkpoint_id=str(dense_dir), no_dist=True)
    except Exception as e:  # noqa: BLE001 - DCP's errors: one line naming the folder
        line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ExportError(f"{dense_dir}: the dense state does not load into the run's model: {line}") from None
    return {k: v.detach() for k, v in msd.items()}, osd


@dataclass
class ExportStats:
    """What an export wrote and what it cost."""

    to: str
    step: int
    tables: int
    rows: int
    row_bytes: int
    """bytes of rows written (weights, and the row optimizer's state with it)"""
    seconds: float
    peak_rss_mb: float
    """this process's peak resident set (``ru_maxrss``), MB"""

    @property
    def mb_per_s(self) -> float:
        return self.row_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        return (
            f"exported step {self.step}: {self.tables} tables, {self.rows:,} rows ({self.row_bytes / 1e6:,.1f} MB) "
            f"to {self.to} in {self.seconds:.1f}s ({self.mb_per_s:,.1f} MB/s), peak RSS {self.peak_rss_mb:,.0f} MB"
        )


def _check_target(to: Path) -> None:
    if to.exists() and not to.is_dir():
        raise ExportError(f"--to {to}: not a folder")
    if to.is_dir() and any(to.iterdir()):
        raise ExportError(f"--to {to}: the folder is not empty (an export writes a new one)")


def export(
    run_dir: str | os.PathLike,
    to: str | os.PathLike,
    *,
    optimizer_state: bool = False,
    block_mb: float = 8.0,
    step: int | None = None,
    redis: str | None = None,
) -> ExportStats:
    """Write the trained model of the finished run in ``run_dir`` into ``to`` as a DCP checkpoint of
    torchrec's ``DLRM`` over an ``EmbeddingBagCollection`` (the module docstring); with ``step``,
    the model of the run's checkpoint of that step instead (the run finished or not). ``redis``
    (comma-separated URLs, one per shard): the rows are read from those live servers (the run's own
    shards, under its namespace), which must stand at the step of the dense state exported (every
    shard's applied marker, before and after the rows are read). ``ExportError`` in one line for bad
    input."""
    from recsys.backends import open_store
    from recsys.config import ConfigError
    from recsys.results.rundir import read_run_file, run_config

    run, to = Path(run_dir), Path(to)
    if block_mb <= 0:
        raise ExportError(f"--block-mb {block_mb}: must be > 0")
    try:
        cfg = run_config(run, "export")
        namespace = read_run_file(run, "export")["namespace"]
    except (ConfigError, OSError) as e:
        raise ExportError(str(e)) from None
    if cfg.embeddings.embeddings != "redis":
        raise ExportError(f"export {run}: a run of --embeddings local keeps no final model in the tier's format")
    if cfg.embeddings.cluster:
        raise ExportError(f"export {run}: a Redis Cluster run's snapshots are per node: not exported here")
    _check_target(to)
    t0 = time.perf_counter()
    ckpt = final_model(run, namespace) if step is None else checkpoint_at(cfg, run, namespace, step)
    dense, osd = dense_state(cfg, layout.dense_dcp_dir(ckpt.path), optimizer_state)
    n = len(cfg.embeddings.urls) or cfg.embeddings.shards
    live = [u for u in redis.split(",") if u] if redis else None
    if live is not None and len(live) != n:
        raise ExportError(f"--redis {redis}: {len(live)} URL(s), the run has {n} shards")
    files = [ckpt.shard_file(s) for s in range(n)]
    with contextlib.nullcontext(live) if live is not None else snapshot_servers(files) as urls:
        store = open_store(cfg, urls, namespace, replicas=False)
        try:
            if live is not None:
                _at_step(store, ckpt.step, run)
            lazy = table_tensors(store, cfg.optim.optimizer, optimizer_state)
            state: dict = dict(dense)
            if osd is not None:
                state["optim"] = osd
            to.mkdir(parents=True, exist_ok=True)
            planner = write_dcp(to, state, lazy, int(block_mb * (1 << 20)))
            if live is not None:
                _at_step(store, ckpt.step, run, after=True)
        finally:
            store.close()
    seconds = time.perf_counter() - t0
    return ExportStats(
        to=str(to),
        step=ckpt.step,
        tables=len(store.tables.specs),
        rows=sum(spec.num_rows for spec in store.tables.specs),
        row_bytes=planner.bytes_read,
        seconds=seconds,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


def _at_step(store, step: int, run: Path, after: bool = False) -> None:
    """``ExportError`` unless every live shard's applied marker is ``step`` (the dense state's)."""
    from embeddings.errors import EmbeddingStoreError

    try:
        steps = store.applied_steps()
    except EmbeddingStoreError as e:
        raise ExportError(f"export {run} --redis: {e}") from None
    off = [(s, got) for s, got in enumerate(steps) if got != step and not (got is None and step == 0)]
    if off:
        s, got = off[0]
        when = "moved while its rows were read" if after else "is not at the exported step"
        raise ExportError(
            f"export {run} --redis: shard {s} {when}: it applied step {got}, the dense state is of step {step} "
            "(export a live tier that stands still: a finished run, or a stopped one with --step of its newest checkpoint)"
        )


def table_tensors(store, optimizer: str, optimizer_state: bool) -> list[LazyTensor]:
    """Every table's weights (and with ``optimizer_state`` its rows' optimizer state) as tensors
    read from ``store`` when written, under torchrec's keys."""
    out = []
    for spec in store.tables.specs:
        name, dim = spec.name, spec.dim

        def reader(cols: slice, name: str = name) -> Callable[[int, int], np.ndarray]:
            def read(lo: int, hi: int) -> np.ndarray:
                with store.from_redis():
                    return store.read_rows(name, np.arange(lo, hi))[:, cols]

            return read

        state = ROW_STATE[optimizer] if optimizer_state else []
        width = dim + sum(1 if per_row else (end - first) * dim for _, first, end, per_row in state)
        out.append(LazyTensor(weight_key(name), spec.num_rows, dim, reader(slice(0, dim)), width))
        for what, first, end, per_row in state:
            lo_col, hi_col = (dim, dim + 1) if per_row else (dim + first * dim, dim + end * dim)
            cols = None if per_row else hi_col - lo_col
            read_cols = reader(slice(lo_col, hi_col))
            fn = (lambda lo, hi, r=read_cols: r(lo, hi)[:, 0]) if per_row else read_cols
            out.append(LazyTensor(f"optim.state.{weight_key(name)}.{what}", spec.num_rows, cols, fn, width))
    return out


# -- into the tier: --init-from -------------------------------------------------------------------
class BlockLoadPlanner(DefaultLoadPlanner):
    """DCP's load of row ranges: ``wants`` maps a key to (the rows ``lo..hi`` of the checkpoint's
    tensor, the tensor to fill with them): only the stored chunks that overlap them are read."""

    def __init__(self, wants: dict[str, tuple[ChunkStorageMetadata, torch.Tensor]]) -> None:
        super().__init__()
        self.wants = wants

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for fqn, (chunk, _) in self.wants.items():
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        dest = self.wants[read_item.dest_index.fqn][1]
        for d, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths, strict=True)):
            dest = dest.narrow(d, at, n)
        return dest


def read_metadata(path: str | os.PathLike, who: str = "--init-from"):
    """The DCP checkpoint's metadata; ``ConfigError`` in one line where ``path`` holds none."""
    from torch.distributed.checkpoint import FileSystemReader

    from recsys.config import ConfigError

    if not Path(path).is_dir():
        raise ConfigError(f"{who} {path}: not a folder")
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # noqa: BLE001 - a missing or damaged .metadata: one line
        raise ConfigError(
            f"{who} {path}: not a torch.distributed.checkpoint folder ({type(e).__name__}: {e})"
        ) from None


def _size(md, key: str) -> tuple | None:
    meta = md.state_dict_metadata.get(key)
    return tuple(meta.size) if meta is not None and hasattr(meta, "size") else None


def check_init_from(cfg) -> None:
    """``--init-from DIR`` before anything starts: a DCP checkpoint holding every table's
    ``embedding_bags.<table>.weight`` of the run's shape and every dense key of the run's model of
    its shape. ``ConfigError`` naming the first key that is missing or of another shape."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from recsys.config import ConfigError
    from recsys.model import build_dlrm, table_configs

    path = cfg.train.init_from
    md = read_metadata(path)
    ebc = EmbeddingBagCollection(table_configs(cfg), device=torch.device("meta"))
    for key, value in build_dlrm(cfg, ebc, stock=True).state_dict().items():
        got = _size(md, key)
        if got is None:
            raise ConfigError(f"--init-from {path}: no {key} there (the run's model needs it, {list(value.shape)})")
        if got != tuple(value.shape):
            raise ConfigError(f"--init-from {path}: {key} is {list(got)}, the run's model has {list(value.shape)}")


def load_dense(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """The dense state of the DCP checkpoint at ``path`` (torchrec's keys) into ``model`` in place."""
    import torch.distributed.checkpoint as dcp

    sd = {k: v for k, v in model.state_dict().items() if "embedding_bags" not in k}
    dcp.load(sd, checkpoint_id=str(path), no_dist=True)
    model.load_state_dict(sd, strict=False)


@dataclass
class InitStats:
    rows: int
    row_bytes: int
    seconds: float


def stream_rows(store, path: str | os.PathLike, optimizer: str, block_mb: float = 8.0) -> InitStats:
    """Every table's rows from the DCP checkpoint at ``path`` into ``store``: its weights, and the
    row optimizer's state where the checkpoint holds it (``optim.state.<weight key>.<name>``, as
    ``recsys export --optimizer-state`` writes it; else the optimizer's initial state). Read and
    written a block of rows at a time (about ``block_mb`` MB, or a chunk as stored where that is
    larger: DCP reads a stored chunk whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from embeddings.optim import initial_state

    md = FileSystemReader(str(path)).read_metadata()
    t0 = time.perf_counter()
    rows_done = bytes_done = 0
    for t, spec in enumerate(store.tables.specs):
        name, dim, width = spec.name, spec.dim, store.width(t)
        key = weight_key(name)
        states = []
        for what, first, end, per_row in ROW_STATE[optimizer]:
            skey = f"optim.state.{key}.{what}"
            shape = (spec.num_rows,) if per_row else (spec.num_rows, (end - first) * dim)
            if _size(md, skey) == shape:
                states.append((skey, dim, dim + 1) if per_row else (skey, dim + first * dim, dim + end * dim))
        step = max(1, int(block_mb * (1 << 20)) // (4 * width))
        for lo in range(0, spec.num_rows, step):
            n = min(step, spec.num_rows - lo)
            block = np.full((n, width), initial_state(store.optimizer), np.float32)
            dest = torch.from_numpy(block)
            wants = {key: (ChunkStorageMetadata(torch.Size([lo, 0]), torch.Size([n, dim])), dest[:, :dim])}
            for skey, a, b in states:
                cols = dest[:, a:b]
                one = _size(md, skey) == (spec.num_rows,)
                chunk = ChunkStorageMetadata(torch.Size([lo]), torch.Size([n])) if one else None
                if chunk is None:
                    chunk = ChunkStorageMetadata(torch.Size([lo, 0]), torch.Size([n, b - a]))
                wants[skey] = (chunk, cols[:, 0] if one else cols)
            dcp.load({}, checkpoint_id=str(path), planner=BlockLoadPlanner(wants), no_dist=True)
            store.write_rows(name, np.arange(lo, lo + n), block)
            rows_done += n
            bytes_done += block.nbytes
    return InitStats(rows_done, bytes_done, time.perf_counter() - t0)
