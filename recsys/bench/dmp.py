"""torchrec's ``DistributedModelParallel`` on W CPU ranks: the reference for W trainers of the tier.

The strongest peer for several data-parallel trainers on one host: torchrec's distributed engine,
every rank a process of its own over gloo, the 26 tables placed table-wise by torchrec's planner on
the ``fused`` compute kernel (fbgemm's TBE on the host, ``EXACT_ROWWISE_ADAGRAD`` fused into the
backward through the sharder's fused params), the pooled rows exchanged by torchrec's all-to-all,
the dense layers in DDP. One torch thread a rank (torch's default ran DMP 3-4x slower on 2 ranks
here). The same DLRM (``recsys.model.build_dlrm``), dense optimizer, data and global batch as the
tier: each rank trains its chunk of the global batch (``BatchReader(world_size=W, rank=r)``), read
before the timed loop as the fused reference's are. samples/s after 10 warm-up steps, the global
batch counted once a step.

    dmp_samples_per_s(cfg, world_size=2, steps=200) -> {"samples_per_s": ..., "step_ms": ...}
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from pathlib import Path

WARMUP = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dmp_samples_per_s(cfg, world_size: int, steps: int, threads: int = 1) -> dict:
    """torchrec DMP on ``world_size`` spawned CPU ranks under ``cfg``'s model, tables, data, dense
    optimizer and global batch (``cfg.train.batch_size``), ``steps`` timed steps after the warm-up.
    -> samples/s (global) and the mean step in ms (rank 0's)."""
    import torch.multiprocessing as mp

    if cfg.train.batch_size % world_size:
        raise ValueError(f"DMP reference: batch size {cfg.train.batch_size} does not split over {world_size} ranks")
    with tempfile.TemporaryDirectory(prefix="dmp-") as tmp:
        out = Path(tmp) / "result.json"
        port = free_port()
        mp.start_processes(
            _rank_main,
            args=(world_size, port, cfg.to_dict(), steps, threads, str(out)),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return json.loads(out.read_text())


def _rank_main(rank: int, world_size: int, port: int, cfg_dict: dict, steps: int, threads: int, out: str) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from data.batches import BatchReader
    from recsys.config import RunConfig
    from recsys.datasets import sources
    from recsys.model import build_dlrm, dense_optimizer, table_configs

    for name in ("torch.fx._symbolic_trace", "torchrec.distributed.planner"):  # warnings about the planner's
        logging.getLogger(name).setLevel(logging.ERROR)  # dry run and topology, not about this run
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = RunConfig.from_dict(cfg_dict)
        configs = table_configs(cfg)
        model = build_dlrm(cfg, EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": cfg.optim.lr, "eps": cfg.optim.eps}
        if cfg.optim.optimizer == "sgd":
            fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": cfg.optim.lr}
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        constraints = {
            c.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for c in configs
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints
        )
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(
            model, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=True
        )
        dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
        opt = dense_optimizer(cfg, dense)
        reader = BatchReader(sources(cfg).train, cfg.train.batch_size, world_size=world_size, rank=rank, epochs=1 << 30)
        batches = [next(reader) for _ in range(steps + WARMUP)]
        reader.close()

        def step(b) -> None:
            logits = dmp(b.dense_features, b.sparse_features).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

        for b in batches[:WARMUP]:
            step(b)
        dist.barrier()
        t0 = time.perf_counter()
        for b in batches[WARMUP:]:
            step(b)
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            res = {"samples_per_s": steps * cfg.train.batch_size / elapsed, "step_ms": 1000 * elapsed / steps}
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def unique_rows(cfg, global_batch: int, world_size: int, steps: int = 4) -> tuple[float, float]:
    """Measured on the run's data (``cfg``'s synthetic stream): the mean over ``steps`` global
    batches of (the most unique rows in one trainer's chunk, the unique rows of the global batch),
    every table together."""
    import numpy as np

    from data.synthetic import SyntheticSource
    from recsys.datasets import synthetic_config

    source = SyntheticSource(synthetic_config(cfg), "train")
    most, every = [], []
    for i in range(steps):
        sparse = np.asarray(source.read(i * global_batch, global_batch).sparse, np.int64)
        keys = sparse + (np.arange(sparse.shape[1], dtype=np.int64) << 40)  # one key space per table
        chunk = global_batch // world_size
        most.append(max(len(np.unique(keys[r * chunk : (r + 1) * chunk])) for r in range(world_size)))
        every.append(len(np.unique(keys)))
    return float(np.mean(most)), float(np.mean(every))


def bytes_per_step(w: int, u_chunk: float, u_all: float, batch: int, tables: int, dim: int) -> dict[str, float]:
    """Bytes one trainer sends (= receives) in a step, on paper, for ``w`` trainers:

    - ``allgather``: the tier today: every trainer's (key, gradient) rows all-gathered, padded to the
      largest chunk's (gloo's ring: each trainer passes on the other ``w - 1`` parts);
    - ``reduce_scatter``: the row gradients reduce-scattered to their shards' writers, then the
      step's summed rows all-gathered (each trainer's part is its shards' share of the step's unique
      rows): what a trainer needs to keep every row it holds current, and no more than the step's
      unique rows however many trainers;
    - ``alltoall``: torchrec's table-wise DMP: the ids of a chunk to the tables' owners, the pooled
      embeddings back, their gradients out again (forward and backward all-to-alls).
    """
    row = 8 + 4 * dim  # a packed key and a float32 gradient row
    chunk = batch / w
    return {
        "allgather": (w - 1) * u_chunk * row,
        "reduce_scatter": (w - 1) / w * u_chunk * row + (w - 1) / w * u_all * row,
        "alltoall": (w - 1) / w * (chunk * tables * 8 + 2 * chunk * tables * dim * 4),
    }
