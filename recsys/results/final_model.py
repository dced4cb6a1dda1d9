"""The trained model a run keeps (``--keep-model``, the default): ``{out}/final/step_N/``, written as a
checkpoint (every shard's final snapshot, the dense state, a manifest) at the run's end, and the
embedding digest of ``summary.json``."""

from __future__ import annotations

import sys
from pathlib import Path

from embeddings.servers.launcher import ShardSpec
from recovery.durable import layout
from recovery.durable.checkpoint import Checkpointer, CheckpointHooks
from recsys.config import RunConfig
from recsys.results.outputs import embedding_digest


def digest(cfg: RunConfig, backend) -> str | None:
    """SHA-256 over every row of every table (``summary.json``'s ``embedding_digest``); None, with
    one line, where the tables hold more rows than ``--digest-max-rows`` (it reads them all)."""
    rows = sum(cfg.data.rows)
    limit = cfg.train.digest_max_rows
    if rows > limit:
        print(
            f"embedding_digest skipped: the tables hold {rows:,} rows, over --digest-max-rows {limit:,} "
            "(the digest reads every row)",
            file=sys.stderr,
        )
        return None
    return embedding_digest(backend.table_blocks())


def final_keeper(cfg: RunConfig, store, specs: list[ShardSpec], namespace: str, rank: int) -> Checkpointer | None:
    """Rank 0 of a tier run (``--keep-model``, the default): what writes the trained model into
    ``{out}/final`` (``recovery.durable.layout.final_dir``) as a checkpoint: every shard's final
    snapshot, the dense state, a manifest (a ``recovery.durable.checkpoint.Checkpointer``). None
    where the run keeps none (``store``: None where the rows live in the trainer)."""
    if not cfg.train.keep_model or rank != 0 or store is None:
        return None
    return Checkpointer(
        layout.final_dir(cfg.train.out),
        keep=1,
        # after a failover a shard is served by its replica: its snapshot over the network (as the factory's)
        shards=[] if cfg.recovery.recovery == "replica" else specs,
        store=store,
        run=namespace,
        hooks=CheckpointHooks(
            warn=lambda line: print(line.replace("checkpoint at", "final model at"), file=sys.stderr)
        ),
        max_abandoned=0,
    )


def keep_model(keeper: Checkpointer, state: dict, namespace: str, cfg: RunConfig) -> dict:
    """Rank 0, after the final phase forked every shard's snapshot: the dense state and the copies
    (``Checkpointer.finish``), waited for. ``state``: the trainer's ``state_dict`` at its last step.
    -> ``summary.json``'s ``final_model``: its folder, seconds (from the forks to the manifest) and
    bytes, or why it was abandoned."""
    steps = cfg.train.steps
    stats = keeper.finish(steps, state["dense"], {**state["run"], "namespace": namespace})
    keeper.wait()
    if stats.abandoned:
        return {"abandoned": stats.abandoned}
    where = keeper.path(steps).relative_to(Path(cfg.train.out))
    return {"path": str(where), "seconds": round(stats.total_s, 3), "bytes": stats.bytes}


def save_model_file(cfg: RunConfig, dense_model, backend) -> None:
    """``--save-model``: the dense weights and every table's rows in one ``torch.save`` file
    (``cfg.final_model_path``)."""
    import torch

    state = {f"dense.{k}": v for k, v in dense_model.state_dict().items() if "embedding_bags" not in k}
    state.update({f"embedding.{k}": v for k, v in backend.weights().items()})
    torch.save(state, cfg.final_model_path)
