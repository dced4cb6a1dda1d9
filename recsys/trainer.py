"""The training loop: load, step, evaluate, write outputs. One trainer process runs ``train``.

Under torch's elastic launcher (``python -m recsys train --trainers W`` or ``torchrun``) every
trainer runs ``worker_main``; with one trainer and no launcher, ``train`` runs in-process.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data.batches import BatchReader, make_batch
from embeddings.store import EmbeddingStore  # noqa: F401  (type reference in docs)
from recsys.backends import LocalBackend, StoreBackend
from recsys.config import RunConfig
from recsys.datasets import sources
from recsys.metrics import evaluate_scores
from recsys.model import dense_optimizer, dense_params
from recsys.outputs import NullOutputs, RunOutputs, embedding_digest

EVAL_BATCH = 4096
# torchrec's KJT code asks torch.fx whether it is tracing; torch answers with a deprecation
# warning on every process. It says nothing about this run.
logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


def evaluate(model, backend, source, num_samples: int) -> dict[str, float]:
    """AUC / logloss / NE of the model on the first ``num_samples`` of ``source``."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    n = num_samples if source.num_rows is None else min(num_samples, source.num_rows)
    with torch.no_grad(), backend.evaluating():
        for lo in range(0, n, EVAL_BATCH):
            a = source.read(lo, min(EVAL_BATCH, n - lo))
            b = make_batch(a.dense, a.sparse, a.labels)
            logits.append(model(b.dense_features, b.sparse_features).squeeze(1).numpy())
            labels.append(b.labels.numpy())
    model.train(was_training)
    return evaluate_scores(np.concatenate(logits), np.concatenate(labels))


def train(cfg: RunConfig, urls: list[str], namespace: str, world_size: int = 1, rank: int = 0) -> dict | None:
    """Train ``cfg.train.steps`` steps; rank 0 writes the run outputs and returns the summary."""
    t_setup = time.perf_counter()
    backend = (
        LocalBackend(cfg)
        if cfg.embeddings.embeddings == "local"
        else StoreBackend(cfg, urls, namespace, world_size, rank)
    )
    plain = backend.model
    model = DistributedDataParallel(plain) if world_size > 1 else plain
    opt = dense_optimizer(cfg, dense_params(plain))
    data = sources(cfg)
    reader = BatchReader(data.train, cfg.train.batch_size, world_size=world_size, rank=rank, epochs=1 << 30)
    out = RunOutputs(cfg) if rank == 0 else NullOutputs()
    steps, G = cfg.train.steps, cfg.train.batch_size

    def maybe_eval(step: int) -> dict:
        if rank == 0:
            return evaluate(plain, backend, data.eval, cfg.data.eval_samples)
        return {}

    bar = tqdm(total=steps, desc="train", unit="step", disable=rank != 0, dynamic_ncols=True)
    batch = next(reader)
    t0 = time.perf_counter()
    last: dict = {}
    try:
        for step in range(1, steps + 1):
            nxt = next(reader) if step < steps else None
            logits = model(batch.dense_features, batch.sparse_features).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            backend.prefetch(nxt)  # the next batch's rows load while this one trains
            opt.zero_grad()
            loss.backward()
            backend.step()
            opt.step()
            eval_now = cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0 and step != steps
            if step % cfg.train.log_every == 0 or step == steps or eval_now:
                mean_loss = loss.detach().clone()
                if world_size > 1:
                    dist.all_reduce(mean_loss)
                    mean_loss /= world_size
                record = {
                    "step": step,
                    "loss": float(mean_loss),
                    "samples": step * G,
                    "elapsed_s": round(time.perf_counter() - t0, 3),
                }
                if eval_now:
                    last = maybe_eval(step)
                    record.update(last)
                    if world_size > 1:
                        dist.barrier()
                out.log(record)
                bar.set_postfix(loss=f"{record['loss']:.4f}", **({"auc": f"{last['auc']:.4f}"} if last else {}))
            bar.update(1)
            batch = nxt
        wall = time.perf_counter() - t0
        bar.close()
        if world_size > 1:
            dist.barrier()
        if rank != 0:
            return None
        final = evaluate(plain, backend, data.eval, cfg.data.eval_samples)
        out.log({"step": steps, "samples": steps * G, "elapsed_s": round(wall, 3), **final})
        summary = {
            "steps_completed": steps,
            "samples_trained": steps * G,
            "wall_seconds": round(wall, 3),
            "setup_seconds": round(t0 - t_setup, 3),
            "throughput_samples_per_s": round(steps * G / wall, 1),
            "final_auc": final["auc"],
            "final_logloss": final["logloss"],
            "final_ne": final["ne"],
            "ceiling_auc": data.ceiling_auc,
            "failures": [],
            "embedding_digest": embedding_digest(backend.table_blocks()),
            "embeddings": cfg.embeddings.embeddings,
            "trainers": world_size,
            "shards": len(urls) if urls else 0,
            **backend.stats(),
        }
        if cfg.train.save_model:
            state = {f"dense.{k}": v for k, v in plain.state_dict().items() if "embedding_bags" not in k}
            state.update({f"embedding.{k}": v for k, v in backend.weights().items()})
            torch.save(state, os.path.join(cfg.train.out, "final_model.pt"))
        out.finish(summary)
        return summary
    finally:
        bar.close()
        backend.close()


def worker_main(cfg_dict: dict, urls: list[str], namespace: str) -> dict | None:
    """Entry point of one trainer process under torch's elastic launcher (env: RANK, WORLD_SIZE)."""
    cfg = RunConfig.from_dict(cfg_dict)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    try:
        return train(cfg, urls, namespace, world_size, rank)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
