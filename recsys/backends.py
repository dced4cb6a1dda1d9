"""Embedding backends behind one small interface (``Backend``), so the training loop has no branches.

``StoreBackend``: rows in the Redis tier (pull, prefetch, cross-trainer aggregation, one writer
per shard). ``LocalBackend``: torchrec's in-process fused engine (the baseline).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torchrec.datasets.utils import Batch

from embeddings import ConnectionOptions, RedisStore
from embeddings.bags.prefetch import Prefetcher
from recsys.config import RunConfig
from recsys.group import StepUpdate, TrainerGroup
from recsys.model import local_model, row_optimizer, store_model, table_set

DIGEST_BLOCK = 65536


class StagedRows:
    """Rows pulled for the batch about to run; forward takes them instead of pulling again."""

    def __init__(self, source) -> None:
        self.source = source
        self._staged: list[tuple[np.ndarray, np.ndarray]] = []

    @property
    def tables(self):
        return self.source.tables

    def stage(self, keys: np.ndarray, more: bool = False) -> None:
        """Pull ``keys``' rows for the next forward; ``more``: beside the rows staged already (a
        trainer's further chunks of the step, each its own forward)."""
        if not more:
            self._staged = []
        self._staged.append((keys, self.source.pull_keys(keys)))

    def clear(self) -> None:
        self._staged = []

    def pull_keys(self, keys: np.ndarray) -> np.ndarray:
        """The first staged rows where they are ``keys``' (the forwards run in staging order);
        otherwise every staged row is dropped and ``keys`` are read from the source."""
        if self._staged:
            staged, rows = self._staged.pop(0)
            if staged is keys or np.array_equal(staged, keys):
                return rows
            self._staged = []
        return self.source.pull_keys(keys)


def open_store(cfg: RunConfig, urls: list[str], namespace: str, replicas: bool = True) -> RedisStore:
    """The run's store over ``urls``: its tables, row optimizer, placement and timeout (with the
    replicas of ``--replicas`` unless ``replicas`` is False)."""
    return RedisStore(
        urls,
        table_set(cfg),
        row_optimizer(cfg),
        namespace=namespace,
        seed=cfg.train.seed,
        placement=cfg.embeddings.placement,
        timeout_s=cfg.embeddings.timeout_s,
        connect=ConnectionOptions(replica_urls=(cfg.embeddings.replica_urls or None) if replicas else None),
    )


class Backend:
    """What the training loop calls on an embedding backend. The defaults do nothing: the answer of
    a backend whose rows live in this process (nothing to read ahead, stage, drain or restore)."""

    model: torch.nn.Module  # the DLRM over this backend's embedding module
    # the Redis tier, whose counters (``embeddings.store.base.StoreCounters``) the run's summary reads;
    # None where the rows live in this process
    store: RedisStore | None = None

    def prepare(self, batch: Batch) -> None:
        """On the data reader's read-ahead thread: work on ``batch`` that need not wait for its step."""

    def prefetch(self, batch: Batch | None) -> None:
        """Start loading the rows of ``batch`` (the next step's, None after the last) while this step trains."""

    def stage(self, batch: Batch | list[Batch]) -> None:
        """Read this batch's rows (a list: this trainer's chunks of the step) before its step computes anything."""

    def end_chunk(self) -> None:
        """After a chunk's backward: its row gradients are kept apart for ``gradients``."""

    def chunk_rows(self) -> list[tuple[np.ndarray, torch.Tensor]] | None:
        """After the backward: each chunk's row keys and gradients, gathered with the dense gradients
        (None: none)."""
        return None

    @property
    def stages_ahead(self) -> bool:
        """Whether a step's stage may commit in the dense gather (``CommitPoints.stage_ahead``): no
        shard away, whose rows every trainer serves in collectives of the stage's own."""
        return False

    def reset_chunks(self, empty: int = 0) -> None:
        """This step's row gradients forgotten (a stage failed on some trainer: the step runs
        again); ``empty``: this trainer computed nothing, and as many chunks without rows stand for
        its chunks in the dense gather."""

    def gradients(self) -> StepUpdate | None:
        """This step's row gradients for the store to apply; None: ``apply_local`` applies them."""
        return None

    def apply_local(self) -> None:
        """Apply this step's row update in this process (where ``gradients`` gave None)."""

    def update_peers(self, update: StepUpdate, step: int) -> None:
        """The step's update committed: rows kept here of shards other trainers write take it too."""

    def fresh_start(self) -> None:
        """A new run (not a resume) begins."""

    def resumed_start(self, step: int) -> None:
        """A resumed run begins, its rows back at ``step``."""

    def drain(self) -> None:
        """Forget rows read ahead (a shard was restored under them)."""

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """The rows an evaluation reads: as they are stored."""
        yield

    def serve_eval(self, batch: Batch) -> None:
        """Before an evaluation batch's forward: rows that only other trainers have are handed over."""

    lockstep_eval = False  # every trainer evaluates (rank 0 alone otherwise)

    def table_blocks(self) -> Iterable[tuple[str, Iterable[np.ndarray]]]:
        """Every table's rows (weights and optimizer state), by name, in blocks (the run's digest)."""
        raise NotImplementedError

    def weights(self) -> dict[str, torch.Tensor]:
        """Every table's weights, by name."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Counters for the run's summary."""
        return {}

    def close(self) -> None:
        pass


class StoreBackend(Backend):
    store: RedisStore

    def __init__(self, cfg: RunConfig, urls: list[str], namespace: str, group: TrainerGroup) -> None:
        self.cfg, self.group = cfg, group
        world_size = group.world_size
        self.store = open_store(cfg, urls, namespace)
        self.store.watch_evictions()  # a server that may evict rows is refused; evicted_keys noted
        if cfg.embeddings.held_rows_mb:  # shard s is written by trainer s % W alone
            n = self.store.num_shards
            mine = {s for s in range(n) if group.writes_shard(s)}
            budget = int(cfg.embeddings.held_rows_mb * (1 << 20))
            if world_size > 1 and len(mine) < n:
                # the budget split by shards: this trainer's rows, and the rows of the shards the
                # others write, kept current by every step's summed gradients (no read of them back)
                own = budget * len(mine) // n
                self.store.hold_rows(mine, own)
                self.store.hold_peer_rows(set(range(n)) - mine, budget - own)
            else:
                self.store.hold_rows(mine, budget)
        held = self.store.row_cache
        if os.environ.get("RECSYS_ROWS_NOWHERE") == "1":
            self._rows_nowhere(cfg, world_size, held)
        # one trainer holding every table reads every row from memory: a prefetch would only copy them twice
        held_all = world_size == 1 and held is not None and held.holds_everything()
        self.prefetcher = Prefetcher(self.store) if cfg.embeddings.prefetch and not held_all else None
        self.stager = StagedRows(self.prefetcher if self.prefetcher is not None else self.store)
        self.model, self.ebc = store_model(cfg, self.store, row_source=self.stager)
        self.names = self.store.tables.names
        self._chunks: list[tuple[np.ndarray, torch.Tensor]] = []  # this step's row gradients, a chunk each

    def _rows_nowhere(self, cfg: RunConfig, world_size: int, held) -> None:
        """``RECSYS_ROWS_NOWHERE=1``: the benchmark's ceiling (``scripts/bench_throughput.py``'s
        limit row): the same loop with no row written to Redis. Only where nothing reads a row back
        from Redis: one trainer holding every row, no checkpoints, logs or injected failures."""
        from recsys.config import ConfigError

        if world_size != 1 or held is None or not held.holds_everything():
            raise ConfigError("RECSYS_ROWS_NOWHERE=1: needs one trainer whose --held-rows-mb holds every row")
        if cfg.recovery.checkpoint_every or cfg.recovery.inject or cfg.recovery.recovery == "log":
            raise ConfigError("RECSYS_ROWS_NOWHERE=1: no checkpoints, update logs or injected failures")
        self.store.write_nowhere()
        print("warning: RECSYS_ROWS_NOWHERE=1: no row is written to Redis (a benchmark's ceiling)", file=sys.stderr)

    def prepare(self, batch: Batch) -> None:
        """On the data reader's read-ahead thread: the batch's unique row keys, before its step."""
        self.ebc.prepare(batch)

    def prefetch(self, batch: Batch | None) -> None:
        away = self.store.outage_active
        if self.prefetcher is not None and batch is not None and not away:  # rows away: read at the stage
            self.prefetcher.prefetch(self.ebc.unique_keys(batch.sparse_features))

    def stage(self, batch: Batch | list[Batch]) -> None:
        """Pull this batch's rows now (a shard failure surfaces here, before any compute); a list:
        each of this trainer's chunks of the step, for a forward of its own. Rows of shards away
        (``--train-through``) are served first, the same on every trainer."""
        self._chunks = []
        peers = self.store.peer_rows is not None
        if peers and self.store.outage_active:  # rows away are served by every writer: none kept here
            self.store.drop_peer_rows()
            peers = False
        for i, b in enumerate(batch if isinstance(batch, list) else [batch]):
            keys = self.ebc.unique_keys(b.sparse_features)
            self._serve(keys, training=True)
            if peers:  # before the rows are staged: those kept here are not read
                self.store.learn_peer_rows(keys)
            self.stager.stage(keys, more=i > 0)

    def end_chunk(self) -> None:
        self._chunks.append(self.ebc.pop_key_grads())

    def chunk_rows(self) -> list[tuple[np.ndarray, torch.Tensor]] | None:
        return self._chunks or None

    @property
    def stages_ahead(self) -> bool:
        return not self.store.outage_active

    def reset_chunks(self, empty: int = 0) -> None:
        self.ebc.pop_key_grads()  # the forwards of a step discarded
        self._chunks = [self.ebc.pop_key_grads() for _ in range(empty)]  # no rows, each at the tables' dim

    def _serve(self, keys: np.ndarray, training: bool) -> None:
        if not self.group.solo:
            self.store.serve_away(keys, training, self.group.all_gather_keys, self.group.all_reduce_sum)
        else:
            self.store.serve_away(keys, training)

    def serve_eval(self, batch: Batch) -> None:
        """Before an evaluation batch's forward while shards are away: their rows served as a step's
        are (every trainer evaluates then, in step), neither kept nor counted."""
        self._serve(self.ebc.unique_keys(batch.sparse_features), training=False)

    @property
    def lockstep_eval(self) -> bool:
        """Shards are away and several trainers run: an evaluation's rows of them come from every
        writer, so every trainer evaluates."""
        return not self.group.solo and self.store.outage_active

    def gradients(self) -> StepUpdate:
        """This step's row gradients aggregated over trainers (a collective)."""
        chunks, self._chunks = self._chunks or [self.ebc.pop_key_grads()], []
        update = self.group.aggregate(chunks, self.store.shard_map)
        if self.prefetcher is not None:
            self.prefetcher.invalidate(update.updated_keys)
        return update

    def update_peers(self, update: StepUpdate, step: int) -> None:
        """The step's update committed on every shard: the rows of the other trainers' shards kept
        here take it too (``RedisStore.update_peer_rows``), unless a shard is away."""
        if self.store.peer_rows is None or update.updated_grads is None:
            return
        if self.store.outage_active:
            self.store.drop_peer_rows()
            return
        theirs = np.flatnonzero(update.updated_shards % self.group.world_size != self.group.rank)
        if len(theirs):
            at = torch.from_numpy(theirs)
            self.store.update_peer_rows(update.updated_keys[theirs], update.updated_grads[at], step)

    def fresh_start(self) -> None:
        """A new run: the rows of this trainer's shards are known absent until it writes them (not
        so under ``--init-from``, whose rows were written before the first step)."""
        if not self.cfg.train.init_from:
            self.store.assume_fresh()

    def resumed_start(self, step: int) -> None:
        """A resumed run, its shards back at ``step``: which rows of this trainer's shards exist is
        listed from them in the background, so that a row never written is known so without a read,
        as in a fresh run (``embeddings.store.present``); a cache taken from the trainer before in
        this process keeps what holds of it, and only the shards it does not know are listed."""
        self.store.learn_present(step)

    def drain(self) -> None:
        """Forget prefetched and staged rows, and the peer rows (after a shard was restored)."""
        self.stager.clear()
        self.store.drop_peer_rows()
        if self.prefetcher is not None:
            self.prefetcher.drain()

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Read straight from the shards (not held rows), leaving a pending prefetch untouched."""
        self.ebc.row_source = self.store
        try:
            with self.store.from_redis():
                yield
        finally:
            self.ebc.row_source = self.stager

    def table_blocks(self):
        """Every table's rows as the shards hold them (held rows are not consulted)."""
        for spec in self.store.tables:
            yield spec.name, self._blocks(spec)

    def _blocks(self, spec):
        for lo in range(0, spec.num_rows, DIGEST_BLOCK):
            with self.store.from_redis():
                block = self.store.read_rows(spec.name, np.arange(lo, min(lo + DIGEST_BLOCK, spec.num_rows)))
            yield block

    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for spec in self.store.tables:
            out[spec.name] = torch.from_numpy(self.store.pull(spec.name, np.arange(spec.num_rows)))
        return out

    def stats(self) -> dict:
        p = self.prefetcher
        return (
            {}
            if p is None
            else {
                "prefetch_hits": p.num_hits,
                "prefetch_refreshed_rows": p.num_refreshed_rows,
                "prefetched_rows": p.num_prefetched_rows,
            }
        )

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.store.close()


class LocalBackend(Backend):
    """torchrec's ``FusedEmbeddingBagCollection`` in this process: fbgemm's TBE kernels on the host,
    the row optimizer fused into backward (nothing to apply after it: ``apply_local`` does nothing).
    No store: ``store`` is None."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.model, self.ebc = local_model(cfg)

    def _tables(self) -> dict[str, torch.Tensor]:
        sd = self.ebc.state_dict()
        return {c.name: sd[f"embedding_bags.{c.name}.weight"] for c in self.ebc.embedding_bag_configs()}

    def table_blocks(self):
        state = self.ebc.fused_optimizer().state_dict()["state"]
        for name, w in self._tables().items():
            w = w.detach()
            if self.cfg.optim.optimizer != "sgd":  # the Adagrads: an accumulator per row or per weight
                acc = state.get(f"{name}.weight", {}).get(f"{name}.weight.momentum_1")
                width = 1 if self.cfg.optim.optimizer == "adagrad" else w.shape[1]
                acc = acc if acc is not None else torch.zeros(w.shape[0], width)
                w = torch.cat([w, acc.reshape(w.shape[0], width)], dim=1)
            yield name, (w[lo : lo + DIGEST_BLOCK].numpy() for lo in range(0, w.shape[0], DIGEST_BLOCK))

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: w.detach().clone() for name, w in self._tables().items()}
