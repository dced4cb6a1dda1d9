"""Start what a run needs (data, local shards), launch the trainers, clean up.

``run(cfg)``: preprocess raw data once, start ``cfg.embeddings.shards`` local ``redis-server``
shards when ``--redis local``, then run the trainers: in-process for one trainer, through torch's
elastic launcher (``torch.distributed.launcher.api.elastic_launch``) for several. Shards and
trainer processes are stopped on every exit path, Ctrl-C included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import uuid

from embeddings import LocalShards
from embeddings.launcher import free_port
from recsys.config import RunConfig
from recsys.datasets import prepare
from recsys.trainer import train, worker_main


class TrainerFailed(RuntimeError):
    pass


@contextlib.contextmanager
def shard_urls(cfg: RunConfig):
    """-> (urls, specs of local shards or [])"""
    if cfg.embeddings.embeddings == "local":
        yield [], []
    elif cfg.embeddings.redis == "local":
        with LocalShards(cfg.embeddings.shards) as shards:
            yield shards.urls, shards.specs
    else:
        yield cfg.embeddings.urls, []


def launch_trainers(cfg: RunConfig, urls: list[str], namespace: str, specs) -> dict | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # a fresh rendezvous store per restart; without it gloo's second attempt hangs (torch 2.13)
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    lc = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.train.trainers,
        run_id=namespace,
        rdzv_backend="c10d",
        rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=cfg.recovery.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
    )
    try:
        results = elastic_launch(lc, worker_main)(
            cfg.to_dict(), urls, namespace, [dataclasses.asdict(s) for s in specs]
        )
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("message", str(msg))
        raise TrainerFailed(f"trainer rank {rank} failed: {str(msg).strip().splitlines()[-1]}") from None
    return results.get(0)


def run(cfg: RunConfig, under_launcher: bool = False) -> dict | None:
    """Run one training job; returns rank 0's summary (None on other ranks under torchrun)."""
    if under_launcher:  # torchrun started us: the world is set, the shards already run
        # every rank must agree on the namespace: torchrun's run id is the same on all nodes
        namespace = cfg.embeddings.namespace or "run-" + os.environ.get("TORCHELASTIC_RUN_ID", "torchrun")
        return worker_main(cfg.to_dict(), cfg.embeddings.urls, namespace)
    namespace = cfg.embeddings.namespace or f"run-{uuid.uuid4().hex[:10]}"
    prepare(cfg)
    with shard_urls(cfg) as (urls, specs):
        if cfg.train.trainers == 1:
            return train(cfg, urls, namespace, specs=specs)
        return launch_trainers(cfg, urls, namespace, specs)
