"""Typed run configuration: one dataclass per section, validated on construction.

Every field can come from a TOML file (``--config run.toml``, sections as below) and be
overridden by a flag; the resolved config is written to ``{out}/config.toml``. A bad value raises
``ConfigError`` naming the field and the value before anything starts.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from embeddings.net.cluster import seed_urls
from recovery.durable import layout

NUM_TABLES = 26  # Criteo's categorical features, one table each
AUTO_WINDOW = 32  # steps per write-behind window by default, where windows apply (RunConfig.window_steps)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the field and the value."""


def _check(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r}: {why}")


@dataclass
class DataConfig:
    data: str = "synthetic"
    """``synthetic``, ``criteo-kaggle:PATH`` (preprocessed dir or train.txt) or ``criteo-terabyte:DIR``."""
    rows_per_table: int = 100_000
    """Rows of each of the 26 tables (categorical values are taken mod this)."""
    table_rows: list[int] = field(default_factory=list)
    """Rows of each table, 26 values (overrides rows_per_table); empty: rows_per_table each."""
    multi_hot: list[int] = field(default_factory=list)
    """Ids per bag of each feature, 26 values (``data.batches.MultiHot``, as MLPerf DLRM-v2 makes
    Criteo multi-hot), or one value for every feature; empty: one id per feature."""
    zipf: float = 1.2
    """Synthetic only: Zipf exponent of the categorical ids (> 1); 0: uniform ids (a cache's worst case)."""
    teacher: Literal["logistic", "dot"] = "dot"
    """Synthetic only: the label model."""
    eval_samples: int = 32_768
    """Held-out samples per evaluation."""

    def __post_init__(self) -> None:
        kind = self.kind
        _check(
            kind in ("synthetic", "criteo-kaggle", "criteo-terabyte"),
            "data",
            self.data,
            "must be synthetic, criteo-kaggle:PATH or criteo-terabyte:DIR",
        )
        if kind != "synthetic":
            _check(bool(self.path), "data", self.data, "needs a path after the colon")
            _check(Path(self.path).exists(), "data", self.data, f"path {self.path!r} does not exist")
        _check(self.rows_per_table > 0, "rows_per_table", self.rows_per_table, "must be > 0")
        _check(len(self.table_rows) in (0, NUM_TABLES), "table_rows", self.table_rows, f"needs {NUM_TABLES} values")
        _check(all(n > 0 for n in self.table_rows), "table_rows", self.table_rows, "must all be > 0")
        _check(
            len(self.multi_hot) in (0, 1, NUM_TABLES), "multi_hot", self.multi_hot, f"needs 1 or {NUM_TABLES} values"
        )
        _check(all(k > 0 for k in self.multi_hot), "multi_hot", self.multi_hot, "must all be > 0")
        _check(self.zipf > 1.0 or self.zipf == 0, "zipf", self.zipf, "must be > 1, or 0 for uniform ids")
        _check(self.teacher in ("logistic", "dot"), "teacher", self.teacher, "must be logistic or dot")
        _check(self.eval_samples > 0, "eval_samples", self.eval_samples, "must be > 0")

    @property
    def rows(self) -> list[int]:
        """Rows of each of the 26 tables."""
        return list(self.table_rows) or [self.rows_per_table] * NUM_TABLES

    @property
    def bag_sizes(self) -> list[int] | None:
        """Ids per bag of each feature (multi-hot), or None (one id each)."""
        if not self.multi_hot:
            return None
        return list(self.multi_hot) * NUM_TABLES if len(self.multi_hot) == 1 else list(self.multi_hot)

    @property
    def kind(self) -> str:
        return self.data.split(":", 1)[0]

    @property
    def path(self) -> str:
        return self.data.split(":", 1)[1] if ":" in self.data else ""


# MLPerf DLRM-v2 (Criteo 1TB, multi-hot), scaled to one small machine: its 26 tables' rows over 200
# (at least 1,000 rows, or the table's own where smaller), its multi-hot sizes, DCN-v2 with dims and
# layers scaled down (``--preset mlperf-v2``; flags given with it override it)
MLPERF_V2_ROWS = [40_000_000, 39_060, 17_295, 7_424, 20_265, 3, 7_122, 1_543, 63, 40_000_000, 3_067_956, 405_282, 10]
MLPERF_V2_ROWS += [2_209, 11_938, 155, 4, 976, 14, 40_000_000, 40_000_000, 40_000_000, 590_152, 12_973, 108, 36]
MLPERF_V2_MULTI_HOT = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]
PRESETS = {
    "mlperf-v2": {
        "data": {"table_rows": [max(min(n, 1000), n // 200) for n in MLPERF_V2_ROWS], "multi_hot": MLPERF_V2_MULTI_HOT},
        "model": {
            "model": "dcn",
            "embedding_dim": 16,  # 32 with these multi-hot sums stalls at chance on the synthetic teacher
            "dense_arch": [128, 64],
            "over_arch": [256, 128, 64],
            "dcn_layers": 3,
            "dcn_low_rank": 32,
        },
    }
}


@dataclass
class ModelConfig:
    model: Literal["dlrm", "dcn"] = "dlrm"
    """``dlrm``: torchrec's DLRM (dot interactions); ``dcn``: torchrec's DLRM_DCN (DCN-v2 interaction,
    low-rank crosses, as MLPerf DLRM-v2)."""
    embedding_dim: int = 16
    """Dim of every embedding table (DLRM's interaction needs one dim)."""
    dcn_layers: int = 3
    """dcn: cross layers."""
    dcn_low_rank: int = 64
    """dcn: rank of each cross layer's low-rank weight."""
    dense_arch: list[int] = field(default_factory=lambda: [64])
    """Hidden sizes of the bottom MLP; a final layer of embedding_dim is appended."""
    over_arch: list[int] = field(default_factory=lambda: [64, 32])
    """Hidden sizes of the top MLP; a final layer of 1 (the logit) is appended."""

    def __post_init__(self) -> None:
        _check(self.embedding_dim > 0, "embedding_dim", self.embedding_dim, "must be > 0")
        _check(self.model in ("dlrm", "dcn"), "model", self.model, "must be dlrm or dcn")
        _check(self.dcn_layers > 0, "dcn_layers", self.dcn_layers, "must be > 0")
        _check(self.dcn_low_rank > 0, "dcn_low_rank", self.dcn_low_rank, "must be > 0")
        _check(all(h > 0 for h in self.dense_arch), "dense_arch", self.dense_arch, "sizes must be > 0")
        _check(all(h > 0 for h in self.over_arch), "over_arch", self.over_arch, "sizes must be > 0")


@dataclass
class EmbeddingConfig:
    embeddings: Literal["redis", "local"] = "redis"
    """``redis``: the sharded tier; ``local``: torchrec's in-process EmbeddingBagCollection (baseline)."""
    redis: str = "local"
    """``local`` (start ``shards`` redis-servers here) or comma-separated ``redis://``/``rediss://`` URLs."""
    shards: int = 3
    """Local shards to start when redis=local (ignored when URLs are given: one shard per URL)."""
    placement: Literal["row", "table"] = "row"
    """Row -> shard map: hashed per row, or whole tables."""
    timeout_s: float = 5.0
    """Deadline of every store call; a shard that does not answer in time is failed."""
    kernels: Literal["fbgemm", "torch"] = "fbgemm"
    """The tier's pooling and its backward: ``fbgemm``, TBE's host kernels (the fused engine's own:
    ``embeddings.bags.kernels``) for every unweighted call over one dim's tables that each feed one
    feature with one pooling (the DLRM and DCN presets' shape); ``torch``, ``index_select`` and
    ``embedding_bag`` (the path every other call takes). The update is the store's optimizer
    either way, after the trainers' row gradients are summed."""
    prefetch: bool = False
    """Pull the next batch's rows while this batch computes (not where one trainer holds every table:
    its rows are all in memory). Off by default: on the measured 2-core host it slowed every
    configuration where it applies (2 trainers and 3 shards: 17.0k against 19.5-19.8k samples/s; one
    trainer with a 10% row cache: 35.9k against 38.4-39.4k), its reads competing with the step for
    the cores; ``--prefetch`` where the row reads wait on a network rather than on the host's CPU."""
    namespace: str = ""
    """Key namespace of the run in Redis (default: a fresh one per run)."""
    replicas: str = ""
    """A replica per shard (Redis replication), promoted by --recovery replica: ``local`` (with redis=local,
    start one here per shard) or comma-separated URLs, one per shard, in shard order."""
    held_rows_mb: float = 2048
    """Each trainer caches the rows it writes in memory (write-through), in at most this many MB (rows
    with their slot's bookkeeping; fractions allowed): updates and stages read them there, not Redis,
    and the least read go when it is full. 0: off."""
    write_behind: bool = True  # held rows: a step's rows reach the shards while the next computes (``writes_behind``)
    write_every: int = 0
    """With the write-behind: a row reaches its shard once per window of this many steps (as of its last step);
    saves, evaluations and the end close a window early; a restart resumes from the last window every shard
    took, a failed shard has it redone. 0: ``AUTO_WINDOW`` where windows apply (``RunConfig.window_steps``), else 1."""
    replica_wait: bool = False
    """Each writer waits (WAIT 1) until the replica acknowledged the step's writes: no update lost at a failover."""
    huge_pages: bool = False
    """Local shards keep their memory in 2 MB pages (jemalloc ``thp:always``: fewer TLB misses over millions
    of rows); needs the host's transparent huge pages at ``madvise`` or ``always``."""
    server_nice: int = 0  # local shards run this much nicer than their trainers (0-19; ``SERVER_NICE``)

    def __post_init__(self) -> None:
        _check(self.embeddings in ("redis", "local"), "embeddings", self.embeddings, "must be redis or local")
        _check(self.shards > 0, "shards", self.shards, "must be > 0")
        _check(self.placement in ("row", "table"), "placement", self.placement, "must be row or table")
        _check(self.kernels in ("fbgemm", "torch"), "kernels", self.kernels, "must be fbgemm or torch")
        _check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        _check(0 <= self.server_nice <= 19, "server_nice", self.server_nice, "must be in 0..19")
        _check(self.write_every >= 0, "write_every", self.write_every, "must be >= 1 (or 0: the default)")
        _check(
            not any(c in self.namespace for c in ":{}") and self.namespace == "".join(self.namespace.split()),
            "namespace",
            self.namespace,
            "must have no ':', braces or spaces (it starts every key of the run)",
        )
        if self.cluster:
            try:
                seed_urls(self.redis)
            except (ValueError, KeyError) as e:
                raise ConfigError(f"redis={self.redis!r}: {e}") from None
        elif self.redis != "local":
            for url in self.urls:
                _check(
                    url.startswith(("redis://", "rediss://")),
                    "redis",
                    url,
                    "each URL must start with redis://, rediss:// or (one URL for a cluster) redis+cluster://",
                )

        if self.replicas:
            if self.replicas == "local":
                _check(self.redis == "local", "replicas", self.replicas, "local replicas need --redis local")
            else:
                n = len(self.urls) or self.shards
                _check(len(self.replica_urls) == n, "replicas", self.replicas, f"needs one URL per shard ({n})")
                for url in self.replica_urls:
                    _check(url.startswith(("redis://", "rediss://")), "replicas", url, "must start with redis://")
        _check(not self.replica_wait or bool(self.replicas), "replica_wait", True, "needs --replicas")
        _check(self.held_rows_mb >= 0, "held_rows_mb", self.held_rows_mb, "must be >= 0")

    @property
    def cluster(self) -> bool:
        """The tier is a Redis Cluster (``redis+cluster://`` seed nodes; ``shards`` logical shards on it)."""
        return self.redis.startswith(("redis+cluster://", "rediss+cluster://"))

    @property
    def urls(self) -> list[str]:
        if self.cluster:  # one URL per logical shard: the store pins each to a hash slot
            return [self.redis] * self.shards
        return [] if self.redis == "local" else [u.strip() for u in self.redis.split(",") if u.strip()]

    @property
    def replica_urls(self) -> list[str]:
        """The replicas' URLs (empty when none, or before local ones are started)."""
        if self.replicas in ("", "local"):
            return []
        return [u.strip() for u in self.replicas.split(",") if u.strip()]


@dataclass
class OptimConfig:
    optimizer: Literal["sgd", "adagrad", "adagrad-exact", "adam"] = "adagrad"
    """Embedding rows: SGD, row-wise Adagrad (one accumulator a row), Adagrad (one a weight) or lazy
    Adam (``embeddings.optim``); dense layers: SGD, Adagrad, Adagrad or Adam."""
    lr: float = 0.05
    """Learning rate of embeddings and dense layers."""
    eps: float = 1e-8
    """The Adagrads' and Adam's epsilon."""

    def __post_init__(self) -> None:
        _check(
            self.optimizer in ("sgd", "adagrad", "adagrad-exact", "adam"),
            "optimizer",
            self.optimizer,
            "must be sgd, adagrad, adagrad-exact or adam",
        )
        _check(self.lr > 0, "lr", self.lr, "must be > 0")
        _check(self.eps >= 0, "eps", self.eps, "must be >= 0")


_EXCHANGES, _REDUCES = "must be auto, gather or scatter", "must be chunks or allreduce"


@dataclass
class TrainConfig:
    steps: int = 1000
    """Training steps (global batches)."""
    batch_size: int = 1024
    """Global batch size, split evenly across trainers."""
    trainers: int = 2
    """Local trainer processes (ignored under torchrun, which sets the world)."""
    seed: int = 0
    """Seeds data, model init and the lazy embedding init."""
    eval_every: int = 250
    """Evaluate every N steps (and at the end); 0 = only at the end."""
    log_every: int = 10
    """Write a metrics.jsonl line every N steps."""
    out: str = "runs/latest"
    """Run directory for config.toml, metrics.jsonl, summary.json, plots/."""
    save_model: bool = False
    """Also write final_model.pt (dense state and every embedding row; small tables only)."""
    keep_model: bool = True
    """At the end, write the trained model into ``{out}/final/step_{steps}/``: every shard's final
    snapshot and the dense state in the checkpoints' format with its SHA-256 manifest (``recsys
    export`` and ``verify`` read it): 1.05 bytes on disk per byte of rows, about 10 s a GB here
    (``summary.json``'s ``final_model``). ``--embeddings local`` keeps none."""
    init_from: str = ""
    """Start from the model in this ``torch.distributed.checkpoint`` folder (torchrec's ``DLRM`` over an
    ``EmbeddingBagCollection``, as ``recsys export`` writes it): every table's rows streamed into the
    shards a block at a time before the first step (the row optimizer's state too where the folder
    holds it), the dense layers loaded. A fresh run only (a resume keeps its own state)."""
    digest_max_rows: int = 100_000_000
    """summary.json's embedding_digest reads every row of every table at the end (from the shards,
    on the tier); tables of more rows in all skip it (the digest is null, one line says so)."""
    tensorboard: bool = False
    """Also write the metrics and failures as TensorBoard events in ``{out}/tensorboard`` (needs the
    ``tensorboard`` package: ``pip install .[tensorboard]``)."""
    progress: bool = True
    """Show progress on rank 0: a bar on a terminal; where stderr is a file or a pipe, a plain line
    (step, samples/s, loss, the last AUC) at every tenth of the steps and at least every 10 s."""
    threads: int = 0
    """torch intra-op threads per trainer; 0: the host's cores left after the local Redis servers
    (``--redis local``), split over the trainers, at least 1. Cores the servers need are not given to
    torch: its idle threads spin, and a shard that waits for a core stalls every step."""
    pin_trainers: bool = True
    """2+ trainers this launcher starts each get cores of their own: trainer ``i`` of ``W`` the ``i``-th ``n // W``
    of the ``n`` cores (``recsys.clock.pin_trainer``; none where ``W > n``; not under torchrun or --trainer-index)."""

    chunks: int = 0
    """The global batch in this many fixed chunks (0: one per trainer), each trained on its own and reduced over
    the trainers in chunk order (``--dense-reduce chunks``): one trainer with ``--chunks 3`` ends bit-identical
    to three trainers. Chunk ``c`` is trained by trainer ``c % trainers`` until chunks follow speed."""
    dense_reduce: str = "chunks"
    """How the dense gradients are reduced over trainers: ``chunks`` (every chunk's gradients
    gathered and summed in chunk order: exact whatever the number of trainers) or ``allreduce``
    (one chunk per trainer, its gradients all-reduced and averaged: torch's DDP under
    ``--trainer-recovery restart``; under ``replace`` torchft's way, where a quorum without a dead
    trainer skips its chunk until its replacement joins, and the run counts those samples lost)."""
    row_exchange: str = "auto"
    """The step's row gradients ``gather``-ed by every trainer (bytes growing with the trainers), or ``scatter``-ed
    to their keys' owners, summed there, the sums gathered (``recsys.group``); ``auto``: scatter from 8. Same bits."""
    balance_every: int = 20
    """With more chunks than trainers: every N steps the trainers give their compute a step (a collective) and a
    slower trainer a chunk trains fewer from the next step (``recsys.clock.plan_chunks``). 0: never."""

    def __post_init__(self) -> None:
        _check(self.steps > 0, "steps", self.steps, "must be > 0")
        _check(self.balance_every >= 0, "balance_every", self.balance_every, "must be >= 0 (0: chunks never move)")
        _check(self.threads >= 0, "threads", self.threads, "must be >= 0 (0: auto)")
        _check(self.row_exchange in ("auto", "gather", "scatter"), "row_exchange", self.row_exchange, _EXCHANGES)
        _check(self.chunks >= 0, "chunks", self.chunks, "must be >= 0 (0: one per trainer)")
        _check(self.dense_reduce in ("chunks", "allreduce"), "dense_reduce", self.dense_reduce, _REDUCES)
        whole = f"must be a multiple of chunks={self.chunks}"
        _check(self.batch_size % max(1, self.chunks) == 0, "batch_size", self.batch_size, whole)
        why = f"must be 0 (one per trainer) or at least trainers={self.trainers}"
        _check(self.chunks == 0 or self.chunks >= self.trainers, "chunks", self.chunks, why)
        _check(
            self.chunks in (0, self.trainers) or self.dense_reduce == "chunks",
            "chunks",
            self.chunks,
            "a trainer of several chunks reduces them in chunk order: needs --dense-reduce chunks",
        )
        _check(self.trainers > 0, "trainers", self.trainers, "must be > 0")
        _check(self.batch_size > 0, "batch_size", self.batch_size, "must be > 0")
        _check(
            self.batch_size % self.trainers == 0,
            "batch_size",
            self.batch_size,
            f"must be a multiple of trainers={self.trainers}",
        )
        _check(self.eval_every >= 0, "eval_every", self.eval_every, "must be >= 0")
        _check(self.log_every > 0, "log_every", self.log_every, "must be > 0")
        _check(self.digest_max_rows >= 0, "digest_max_rows", self.digest_max_rows, "must be >= 0")
        _check(bool(self.out), "out", self.out, "must be a directory path")


@dataclass
class RecoveryConfig:
    recovery: str = "partial"
    """What a failed embedding shard costs: partial (CPR: restore it alone from its checkpoint,
    count lost updates), log (as partial, then replay its update log: nothing lost), full (roll
    everything back to the checkpoint and recompute)."""
    checkpoint_every: int | str = 0
    """Checkpoint every K steps (0: never; a checkpoint is also taken at step 0 when on), or ``auto``:
    the planner picks K from ``mtbf``, ``target_pls`` and the measured checkpoint cost."""
    target_pls: float = 0.01
    """With checkpoint_every=auto: the portion of lost samples to stay under."""
    mtbf: str = ""
    """With checkpoint_every=auto: mean steps (``500``) or seconds (``120s``) between shard failures."""
    priority_every: int = 0
    """partial-mfu/ssu: save each shard's priority rows every N steps (0: a quarter of the checkpoint interval)."""
    priority_budget: int = 2000
    """partial-mfu/ssu: rows per shard per priority save."""
    ssu_fraction: float = 0.05
    """partial-ssu: fraction of updated rows tracked (sampled by a hash of the row)."""
    ssu_capacity: int = 8192
    """partial-ssu: rows tracked per shard (bounded memory)."""
    mfu_capacity: int = 8192
    """partial-mfu: rows counted per shard by the space-saving sketch (bounded memory)."""
    priority_half: bool = False
    """partial-mfu/ssu and incremental: saved weights as float16 (half the bytes; optimizer state stays float32)."""
    flush_every: int = 0
    """incremental: flush the rows dirtied since the last flush every N steps (0: a tenth of the checkpoint interval)."""
    checkpoint_dir: str = ""
    """Where checkpoints go (default: OUT/checkpoints)."""
    keep_checkpoints: int = 2
    """Checkpoints kept; older ones are deleted once a newer one is verified."""
    max_abandoned_checkpoints: int = 3
    """Checkpoints abandoned in a row (a full disk, a server that refuses the snapshot: not a shard failure, which the
    recovery handles) before the run stops with an error, at the next checkpoint: every step trained past them is one a
    shard failure would lose. Each abandoned checkpoint is a warning line (rank 0). 0: never stop."""
    log_dir: str = ""
    """Per-shard update logs (default: OUT/logs when recovery=log, else off)."""
    log_fsync: str = "always"
    """Log durability: always (fsync each step), every:N (at most every N ms), none."""
    inject: list[str] = field(default_factory=list)
    """Failures to inject: shard:K@WHEN, stall:K@WHEN:SECONDS, trainer:R@WHEN, node:R@WHEN (WHEN: step=N, t=SECONDS,
    during=PHASE), corrupt-checkpoint:latest[@step=N], corrupt-log:K@step=N; see recovery/inject.py."""
    max_restarts: int = 3
    """Trainers started again after deaths (replace: one at a time, past them the others go on;
    restart: the group; 0: a death ends a restart run). Rank 0 saves the dense state every step."""

    trainer_recovery: str = "auto"
    """A trainer's death: ``replace`` (the others go on at a new torchft quorum training its chunks,
    only it starts again, healed from a live peer: bit-identical; ``recsys.quorum``), ``restart``
    (the group restarts from the per-step dense state), ``auto`` (replace with 2+ trainers on the tier)."""
    lighthouse: str = ""
    """With replace: host:port of a torchft Lighthouse that runs already (default: one on loopback)."""
    restart_delay: float = 0.0
    """Seconds before a dead trainer (replace) or the group (restart) starts again: a slower host."""
    trainer_index: int = -1
    """With replace: run only trainer I, meeting the others at ``--lighthouse`` (trainers launched as
    separate commands sharing the run folder; run again, it replaces itself). -1: all of them."""
    trainer_timeout: float = 30.0
    """With replace: seconds a collective waits for a live trainer (a killed one: about 0.5 s)."""
    quorum_every: int = 4
    """With replace: a torchft quorum at every K-th step's start (a replacement waits up to K - 1
    steps more; a death is met at the next collective); a commit decision every step."""

    train_through: bool = False
    """A failed shard is restored in the background while every trainer keeps stepping (partial, partial-mfu,
    partial-ssu, incremental, log): its writer's cached rows are read exactly, other rows from a fallback (counted),
    their updates applied to the restored rows when the shard rejoins. Not with windows (--write-every > 1)."""
    through_budget_mb: float = 1024.0
    """With train_through: MB one trainer's outage rows and kept gradients may take; past it the run
    waits for the restore (one line)."""

    shard_restart_timeout: float = 60.0
    """Shards given by URL: seconds a failed shard's server has to come back (its supervisor restarts
    it) before the run stops with an error; the run can then be finished with --resume OUT."""

    def __post_init__(self) -> None:
        from recovery.durable.log import parse_fsync_policy
        from recovery.inject import parse_injection
        from recovery.strategy import Strategy

        try:
            strategy = Strategy.parse(self.recovery)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self._check_interval()
        _check(self.priority_every >= 0, "priority_every", self.priority_every, "must be >= 0")
        _check(self.priority_budget > 0, "priority_budget", self.priority_budget, "must be > 0")
        _check(0 < self.ssu_fraction <= 1, "ssu_fraction", self.ssu_fraction, "must be in (0, 1]")
        _check(self.ssu_capacity > 0, "ssu_capacity", self.ssu_capacity, "must be > 0")
        _check(self.mfu_capacity > 0, "mfu_capacity", self.mfu_capacity, "must be > 0")
        _check(self.flush_every >= 0, "flush_every", self.flush_every, "must be >= 0")
        if strategy.priority_saves:
            _check(bool(self.checkpoint_every), "recovery", self.recovery, "priority saves need --checkpoint-every")
            cap_name = "mfu_capacity" if self.recovery == "partial-mfu" else "ssu_capacity"
            cap = getattr(self, cap_name)
            _check(
                self.priority_budget <= cap,
                "priority_budget",
                self.priority_budget,
                f"more rows than the {cap_name} ({cap}) the tracker counts per shard; raise --{cap_name.replace('_', '-')}",
            )
        if strategy.flushes:
            _check(
                bool(self.checkpoint_every), "recovery", self.recovery, "incremental flushes need --checkpoint-every"
            )
        _check(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        _check(
            self.max_abandoned_checkpoints >= 0,
            "max_abandoned_checkpoints",
            self.max_abandoned_checkpoints,
            "must be >= 0 (0: never stop)",
        )
        _check(self.max_restarts >= 0, "max_restarts", self.max_restarts, "must be >= 0")
        self._check_trainers()
        if self.train_through:
            from recovery.restore.through import THROUGH

            _check(
                strategy in THROUGH,
                "recovery",
                self.recovery,
                "--train-through restores in the background under partial, partial-mfu, partial-ssu, incremental "
                "or log; full rolls every trainer back and replica promotes instead of restoring",
            )
        _check(self.through_budget_mb > 0, "through_budget_mb", self.through_budget_mb, "must be > 0")
        _check(self.shard_restart_timeout > 0, "shard_restart_timeout", self.shard_restart_timeout, "must be > 0")
        try:
            parse_fsync_policy(self.log_fsync)
        except ValueError as e:
            raise ConfigError(f"log_fsync={self.log_fsync!r}: {e}") from None
        try:
            self.injections = [parse_injection(s) for s in self.inject]
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if strategy.rolls_back:
            _check(
                self.checkpoint_every != 0, "recovery", self.recovery, "full recovery needs --checkpoint-every K > 0"
            )
        for inj in self.injections:
            if inj.kind in ("trainer", "node"):
                _check(self.max_restarts > 0, "inject", str(inj), "a trainer failure needs --max-restarts >= 1")
            if inj.kind == "corrupt-checkpoint":
                _check(self.checkpoint_every > 0, "inject", str(inj), "needs --checkpoint-every K > 0")
            if inj.kind == "corrupt-dense":
                _check(self.max_restarts > 0, "inject", str(inj), "needs --max-restarts >= 1 (per-step dense state)")
            if inj.kind == "corrupt-log":
                _check(
                    strategy.replays_log or bool(self.log_dir), "inject", str(inj), "needs update logs (--recovery log)"
                )

    def _check_trainers(self) -> None:
        """What a trainer's death costs: the mode, the delay, the collectives' timeout."""
        modes = ("auto", "replace", "restart")
        _check(
            self.trainer_recovery in modes,
            "trainer_recovery",
            self.trainer_recovery,
            "must be auto, replace or restart",
        )
        _check(self.restart_delay >= 0, "restart_delay", self.restart_delay, "must be >= 0")
        _check(self.trainer_timeout > 0, "trainer_timeout", self.trainer_timeout, "must be > 0")
        _check(self.quorum_every >= 1, "quorum_every", self.quorum_every, "must be >= 1")
        _check(self.trainer_index >= -1, "trainer_index", self.trainer_index, "must be >= 0 (-1: every trainer)")

    def _check_interval(self) -> None:
        """``checkpoint_every``: a step count, or ``auto`` with an ``mtbf`` and a ``target_pls``."""
        if isinstance(self.checkpoint_every, str) and self.checkpoint_every != "auto":
            try:
                self.checkpoint_every = int(self.checkpoint_every)
            except ValueError:
                raise ConfigError(f"checkpoint_every={self.checkpoint_every!r}: must be a step count or auto") from None
        if self.checkpoint_every == "auto":
            from recovery.planner import parse_mtbf

            _check(bool(self.mtbf), "mtbf", self.mtbf, "checkpoint_every=auto needs --mtbf STEPS or SECONDSs")
            try:
                parse_mtbf(self.mtbf, step_seconds=1.0)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            _check(0 < self.target_pls < 1, "target_pls", self.target_pls, "must be in (0, 1)")
        else:
            _check(self.checkpoint_every >= 0, "checkpoint_every", self.checkpoint_every, "must be >= 0")


@dataclass
class RunConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    embeddings: EmbeddingConfig = field(default_factory=EmbeddingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)

    def __post_init__(self) -> None:
        rc = self.recovery
        self._check_injections()
        _check(
            not (rc.checkpoint_every and self.embeddings.embeddings == "local"),
            "checkpoint_every",
            rc.checkpoint_every,
            "checkpoints cover the Redis tier; the local baseline takes none",
        )
        from recovery.strategy import Strategy

        if Strategy(rc.recovery).promotes:
            _check(
                bool(self.embeddings.replicas) or self.embeddings.cluster,
                "recovery",
                rc.recovery,
                "replica recovery needs a replica per shard (--replicas local or URLs) or a Redis Cluster",
            )
        if self.train.chunks > self.train.trainers:  # a trainer trains several chunks of each step
            _check(
                self.embeddings.embeddings == "redis",
                "chunks",
                self.train.chunks,
                "several chunks a trainer train on the Redis tier (--embeddings local applies rows in backward)",
            )
            _check(
                not rc.train_through,
                "chunks",
                self.train.chunks,
                "several chunks a trainer do not yet train through a shard's failure (--train-through)",
            )
        self._check_trainer_recovery()
        if rc.train_through:
            _check(
                self.embeddings.embeddings == "redis",
                "train_through",
                True,
                "trains through a failure of the Redis tier (--embeddings redis)",
            )
            _check(
                self.embeddings.write_every in (0, 1),
                "write_every",
                self.embeddings.write_every,
                "--train-through writes each step's rows behind the next at most: no windows",
            )
        if self.embeddings.write_every > 1:  # asked for: refused where windows do not apply
            _check(
                self.embeddings.embeddings == "redis" and self.embeddings.write_behind,
                "write_every",
                self.embeddings.write_every,
                "windows are written behind: needs --embeddings redis and write-behind",
            )
        if self.embeddings.embeddings == "local":
            _check(
                self.optim.optimizer != "adam",
                "optimizer",
                self.optim.optimizer,
                "the local fused engine has no Adam on the host (fbgemm's CPU kernels: sgd and the Adagrads)",
            )
            _check(
                self.train.trainers == 1,
                "trainers",
                self.train.trainers,
                "the local torchrec baseline runs in one process (use --trainers 1)",
            )

    def _check_trainer_recovery(self) -> None:
        """``--trainer-recovery replace`` and a trainer launched on its own (``--trainer-index``)."""
        rc, why = self.recovery, "a trainer launched on its own (--trainer-index) needs"
        if rc.trainer_index >= 0:
            for ok, what in (
                (rc.trainer_index < self.train.trainers, f"must be < trainers={self.train.trainers}"),
                (self.replaces_trainers, f"{why} --trainer-recovery replace"),
                (bool(rc.lighthouse), f"{why} --lighthouse host:port"),
                (bool(self.embeddings.urls), f"{why} --redis URLs"),
                (bool(self.embeddings.namespace), f"{why} --namespace"),
            ):
                _check(ok, "trainer_index", rc.trainer_index, what)
        if rc.trainer_recovery == "replace":
            mode = rc.trainer_recovery
            tier = self.embeddings.embeddings == "redis" and self.train.trainers > 1
            _check(
                tier,
                "trainer_recovery",
                mode,
                "replace needs --trainers 2 or more on the Redis tier (--embeddings redis)",
            )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def _check_injections(self) -> None:
        """Each ``--inject``'s target exists in this run, and its step within it."""
        rc = self.recovery
        for inj in rc.injections:
            if inj.kind in ("shard", "stall", "node", "slow-restore"):
                _check(
                    self.embeddings.embeddings == "redis",
                    "inject",
                    str(inj),
                    "shard failures act on the Redis tier (--embeddings redis)",
                )
            if inj.kind in ("shard", "stall", "slow-restore"):
                n = len(self.embeddings.urls) or self.embeddings.shards
                _check(inj.target < n, "inject", str(inj), f"shard {inj.target} does not exist (the run has {n})")
            ok = self.replaces_trainers and not rc.lighthouse if inj.kind == "lighthouse" else True
            _check(ok, "inject", str(inj), "the launcher's Lighthouse: needs replace, no --lighthouse")
            if inj.kind in ("trainer", "node", "slow-trainer", "stop-trainer"):
                _check(
                    inj.target < self.train.trainers,
                    "inject",
                    str(inj),
                    f"trainer {inj.target} does not exist (trainers={self.train.trainers})",
                )
            if inj.step is not None:
                _check(
                    1 <= inj.step <= self.train.steps, "inject", str(inj), f"step must be in [1, {self.train.steps}]"
                )

    @property
    def window_steps(self) -> int:
        """Steps per write-behind window: ``--write-every``, or where it is 0 (the default)
        ``AUTO_WINDOW`` where windows apply (the Redis tier, write-behind, not --train-through; the
        fastest measured setting there; ``recovery.factory.writes_behind``) and 1 elsewhere."""
        e = self.embeddings
        if e.write_every:
            return e.write_every
        applies = e.embeddings == "redis" and e.write_behind
        return AUTO_WINDOW if applies and not self.recovery.train_through else 1

    @property
    def replaces_trainers(self) -> bool:
        """``--trainer-recovery replace``, or ``auto`` with 2+ trainers on the tier, no torchrun."""
        mode, t = self.recovery.trainer_recovery, self.train
        if mode != "auto":
            return mode == "replace"
        tier = self.embeddings.embeddings == "redis" and "TORCHELASTIC_RUN_ID" not in os.environ
        return t.trainers > 1 and tier

    @property
    def checkpoint_dir(self) -> str:
        return self.recovery.checkpoint_dir or str(layout.default_checkpoint_dir(self.train.out))

    @property
    def log_dir(self) -> str:
        if self.recovery.log_dir:
            return self.recovery.log_dir
        return str(layout.default_log_dir(self.train.out)) if self.recovery.recovery == "log" else ""

    @property
    def final_model_path(self) -> Path:
        """``final_model.pt`` in the output folder (``--save-model``: ``recovery.durable.layout.final_model_file``)."""
        return layout.final_model_file(self.train.out)

    @classmethod
    def from_dict(cls, d: dict[str, dict[str, Any]], source: str = "config") -> RunConfig:
        sections = {f.name: f.type for f in dataclasses.fields(cls)}
        kwargs = {}
        for name, values in d.items():
            if name not in sections:
                raise ConfigError(f"{source}: unknown section [{name}]; known: {', '.join(sections)}")
            section_cls = {
                "data": DataConfig,
                "model": ModelConfig,
                "embeddings": EmbeddingConfig,
                "optim": OptimConfig,
                "train": TrainConfig,
                "recovery": RecoveryConfig,
            }[name]
            known = {f.name for f in dataclasses.fields(section_cls)}
            bad = set(values) - known
            if bad:
                raise ConfigError(f"{source}: unknown field(s) {sorted(bad)} in [{name}]; known: {sorted(known)}")
            types = {f.name: f.type for f in dataclasses.fields(section_cls)}
            for key, value in values.items():
                expected = _type_error(value, types[key])
                if expected:
                    raise ConfigError(f"{source}: [{name}] {key} = {value!r}: must be {expected}")
            try:
                kwargs[name] = section_cls(**values)
            except TypeError as e:
                raise ConfigError(f"{source}: [{name}]: {e}") from None
        return cls(**kwargs)

    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {str(path)!r}: {e}") from None
        return cls.from_dict(raw, source=str(path))

    def to_toml(self) -> str:
        lines = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            for k, v in values.items():
                lines.append(f"{k} = {_toml_value(v)}")
            lines.append("")
        return "\n".join(lines)


def _is(value: Any, kind: str) -> bool:
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, str)


_EXPECTED = {
    "int": ("an integer", ("int",)),
    "float": ("a number", ("float",)),
    "bool": ("true or false", ("bool",)),
    "str": ("a string", ("str",)),
    "int | str": ("an integer or a string", ("int", "str")),
}


def _type_error(value: Any, annotation: str) -> str:
    """What a config value must be when its type does not fit the field's annotation ('' if it fits;
    annotations this does not know, such as Literal choices, are checked by the section itself)."""
    if annotation in _EXPECTED:
        what, kinds = _EXPECTED[annotation]
        return "" if any(_is(value, k) for k in kinds) else what
    if annotation in ("list[int]", "list[str]"):
        kind = annotation[5:-1]
        if isinstance(value, list) and all(_is(v, kind) for v in value):
            return ""
        return {"int": "a list of integers", "str": "a list of strings"}[kind]
    return ""


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")
