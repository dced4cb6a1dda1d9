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
every run unless ``--no-keep-model``; its SHA-256 manifest is checked first). Each shard's snapshot
is served by a temporary ``redis-server`` (started on a loopback port, stopped at the end) and the
rows are read from it in blocks. Written table by table in bounded memory: every table is cut into
row blocks of about ``--block-mb`` MB, each a chunk of its tensor in DCP's metadata, read from the
shards only when DCP writes it (a ``SavePlanner`` whose ``resolve_data`` reads the rows), one file
per chunk. The process holds about one block at a time whatever the tables' size; the temporary
servers hold the snapshots (about the tables' bytes, in their own processes).

The run folder is read where it lies now (``recsys.rundir.run_config``): a run may be moved or
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
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from recovery import layout

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
        return max(1, block_bytes // (4 * (t.cols or 1)))

    planner = RowsSavePlanner(lazy, block_rows)
    writer = FileSystemWriter(str(to), single_file_per_rank=False, thread_count=1, sync_files=True)
    dcp.save(state, storage_writer=writer, planner=planner, no_dist=True)
    return planner


# -- where the rows are -------------------------------------------------------------------------------
@contextlib.contextmanager
def snapshot_servers(files: list[Path]) -> Iterator[list[str]]:
    """A temporary ``redis-server`` per snapshot file (loaded from it; its persistence off), on
    loopback ports, stopped and removed at the end: -> their URLs."""
    from embeddings.launcher import ShardSpec, _stop_process, find_redis_server, free_port, spawn_shard

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
    """The run's final model (``{run}/final``, ``recovery.layout.final_dir``), its files checked
    against its manifest. ``ExportError`` where there is none or it is damaged."""
    from recovery.checkpoint import list_checkpoints
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
    run_dir: str | os.PathLike, to: str | os.PathLike, *, optimizer_state: bool = False, block_mb: float = 8.0
) -> ExportStats:
    """Write the trained model of the finished run in ``run_dir`` into ``to`` as a DCP checkpoint of
    torchrec's ``DLRM`` over an ``EmbeddingBagCollection`` (the module docstring). ``ExportError``
    in one line for bad input."""
    from recsys.backends import open_store
    from recsys.config import ConfigError
    from recsys.rundir import read_run_file, run_config

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
    ckpt = final_model(run, namespace)
    dense, osd = dense_state(cfg, layout.dense_dcp_dir(ckpt.path), optimizer_state)
    n = len(cfg.embeddings.urls) or cfg.embeddings.shards
    files = [ckpt.shard_file(s) for s in range(n)]
    with snapshot_servers(files) as urls:
        store = open_store(cfg, urls, namespace, replicas=False)
        try:
            lazy = table_tensors(store, cfg.optim.optimizer, optimizer_state)
            state: dict = dict(dense)
            if osd is not None:
                state["optim"] = osd
            to.mkdir(parents=True, exist_ok=True)
            planner = write_dcp(to, state, lazy, int(block_mb * (1 << 20)))
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

        out.append(LazyTensor(weight_key(name), spec.num_rows, dim, reader(slice(0, dim))))
        if not optimizer_state:
            continue
        for what, first, end, per_row in ROW_STATE[optimizer]:
            lo_col, hi_col = (dim, dim + 1) if per_row else (dim + first * dim, dim + end * dim)
            cols = None if per_row else hi_col - lo_col
            read_cols = reader(slice(lo_col, hi_col))
            fn = (lambda lo, hi, r=read_cols: r(lo, hi)[:, 0]) if per_row else read_cols
            out.append(LazyTensor(f"optim.state.{weight_key(name)}.{what}", spec.num_rows, cols, fn))
    return out
