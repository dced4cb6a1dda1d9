"""The training loop: load, step, checkpoint, evaluate. One trainer process runs ``train``.

A step has two commit points. (1) Stage: the batch's rows are pulled; a failed shard is
recovered and the pull retried before anything is computed. (2) Update: after forward/backward,
the row gradients are aggregated over trainers and each shard's single writer applies its rows;
a shard that failed is recovered and gets the step's rows again. Only then does the dense
optimizer step, the dense state get saved (for trainer restarts) and, on schedule, a checkpoint
get taken. Under ``full`` recovery a failure rolls everything back to the checkpoint instead.

Under torch's elastic launcher (``python -m recsys train --trainers W`` or ``torchrun``) every
trainer runs ``worker_main``; with one trainer and no launcher, ``train`` runs in-process.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from data.batches import BatchReader, make_batch
from embeddings.launcher import ShardSpec
from recovery.accounting import pls
from recovery.checkpoint import Checkpointer
from recovery.dense import DenseSaver, NoDenseSaver
from recovery.inject import Injector
from recovery.log import ShardLog
from recovery.manager import Collective, NoRecovery, RecoveryManager
from recovery.planner import parse_mtbf, plan_interval
from recovery.priority import MFUTracker, PrioritySaver, RowCounts, SSUTracker
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
warnings.filterwarnings("ignore", module="torch.distributed.checkpoint")


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


def collective(world_size: int) -> Collective:
    if world_size == 1:
        return Collective()

    def max_flags(a: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(a.astype(np.int64))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.numpy()

    def broadcast_int(v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64)
        dist.broadcast(t, src=0)
        return int(t.item())

    return Collective(world_size, dist.barrier, max_flags, broadcast_int)


class Schedule:
    """When to checkpoint and take priority saves. ``auto``: after ``WARMUP`` steps the planner picks
    the interval from the measured step time and checkpoint pause (rank 0 decides, all follow)."""

    WARMUP = 10

    def __init__(self, cfg: RunConfig, num_shards: int, coll: Collective, rank: int) -> None:
        rc = cfg.recovery
        self.rc, self.num_shards, self.coll, self.rank = rc, num_shards, coll, rank
        self.auto = rc.checkpoint_every == "auto"
        self.every = 0 if self.auto else int(rc.checkpoint_every)
        self.priority_on = rc.recovery in ("partial-mfu", "partial-ssu")
        self.plan: dict | None = None
        self._step_times: list[float] = []
        self.checkpoint_pause_s = 0.0

    @property
    def enabled(self) -> bool:
        return bool(self.rc.checkpoint_every)

    @property
    def priority_every(self) -> int:
        return self.rc.priority_every or max(1, self.every // 4)

    def observe(self, step: int, seconds: float) -> None:
        if not self.auto or self.every:
            return
        if step > 1:
            self._step_times.append(seconds)
        if step == self.WARMUP:
            interval = -1
            if self.rank == 0:
                step_s = float(np.median(self._step_times))
                mtbf = parse_mtbf(self.rc.mtbf, step_seconds=step_s)
                plan = plan_interval(mtbf, self.rc.target_pls, self.num_shards, self.checkpoint_pause_s / step_s)
                interval = plan.interval
                self.plan = {
                    "interval": plan.interval,
                    "expected_pls": plan.expected_pls,
                    "overhead": plan.overhead,
                    "young_interval": plan.young_interval,
                    "mtbf_steps": mtbf,
                    "step_s": step_s,
                    "checkpoint_pause_s": self.checkpoint_pause_s,
                    "target_pls": self.rc.target_pls,
                }
            self.every = self.coll.broadcast_int(interval)

    def checkpoint_due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def priority_due(self, step: int) -> bool:
        return (
            self.priority_on and bool(self.every) and step % self.priority_every == 0 and not self.checkpoint_due(step)
        )

    def state(self) -> dict:
        return {"every": self.every}

    def load(self, state: dict) -> None:
        self.every = int(state["every"])


def build_recovery(cfg: RunConfig, backend, specs: list[ShardSpec], coll: Collective, rank: int, restart_count: int):
    """Recovery manager, checkpointer and injector of one trainer (no-op objects where off)."""
    if not isinstance(backend, StoreBackend):
        return NoRecovery(), None
    rc, world = cfg.recovery, coll.world_size
    injector = Injector(rc.injections, rank, [s.pidfile for s in specs], Path(cfg.train.out), restart_count)
    logs = {}
    if cfg.log_dir:
        logs = {s: ShardLog(cfg.log_dir, s, rc.log_fsync) for s in range(len(specs)) if s % world == rank}
    ckpt = None
    if rc.checkpoint_every:

        def on_saved(c) -> None:
            # rank 0, after the manifest: log segments that every kept checkpoint covers can go.
            # (Not just those before the newest: if the newest turns out corrupt, log recovery
            # falls back to an older checkpoint and must still replay exactly.)
            if cfg.log_dir:
                oldest = min(k.step for k in ckpt.candidates())
                for s in range(len(specs)):
                    ShardLog(cfg.log_dir, s).drop_before(oldest)

        ckpt = Checkpointer(
            cfg.checkpoint_dir,
            rc.keep_checkpoints,
            specs,
            backend.store.client,
            rank,
            coll.barrier,
            on_saved,
            run=backend.store.namespace,
        )
    priority = None
    if rc.recovery in ("partial-mfu", "partial-ssu") and rank == 0:
        store = backend.store
        tracker = (
            MFUTracker(store)
            if rc.recovery == "partial-mfu"
            else SSUTracker(store, rc.ssu_fraction, rc.ssu_capacity, cfg.train.seed)
        )
        counts = RowCounts([t.num_rows for t in store.tables])
        priority = PrioritySaver(Path(cfg.checkpoint_dir) / "priority", store, tracker, rc.priority_budget, counts)
    manager = RecoveryManager(
        priority=priority,
        strategy=rc.recovery,
        store=backend.store,
        shards=specs,
        rank=rank,
        batch_size=cfg.train.batch_size,
        collective=coll,
        checkpointer=ckpt,
        logs=logs,
        injector=injector,
        drain=backend.drain,
    )
    return manager, injector


def train(
    cfg: RunConfig,
    urls: list[str],
    namespace: str,
    world_size: int = 1,
    rank: int = 0,
    specs: list[ShardSpec] | None = None,
) -> dict | None:
    """Train ``cfg.train.steps`` steps; rank 0 writes the run outputs and returns the summary."""
    t_setup = time.perf_counter()
    specs = specs or []
    restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
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
    coll = collective(world_size)
    recovery, injector = build_recovery(cfg, backend, specs, coll, rank, restart_count)
    ckpt = getattr(recovery, "checkpointer", None)
    dense_saver = (
        DenseSaver(cfg.checkpoint_dir, namespace, writer=rank == 0) if cfg.recovery.max_restarts else NoDenseSaver()
    )
    steps, G = cfg.train.steps, cfg.train.batch_size
    schedule = Schedule(cfg, len(specs), coll, rank)

    def resume_position(step: int) -> dict:
        """Reader state that yields the batch of ``step + 1`` next (the loop reads one batch ahead)."""
        return {"position": step * G, "global_batch_size": G}

    def dense_state() -> dict:
        msd, osd = get_state_dict(plain, opt)
        return {"model": {k: v for k, v in msd.items() if "embedding_bags" not in k}, "optim": osd}

    def load_dense(state: dict) -> None:
        msd, osd = get_state_dict(plain, opt)
        msd.update(state["model"])
        set_state_dict(plain, opt, model_state_dict=msd, optim_state_dict=state["optim"])

    def checkpoint(step: int) -> None:
        recovery.on_checkpoint(step)
        meta = {"step": step, "reader": resume_position(step), "recovery": recovery.state(), "namespace": namespace}
        stats = ckpt.save(step, dense_state(), meta)
        for log in recovery.logs.values():
            log.open_segment(step + 1)
        out.log({"step": step, "checkpoint_pause_s": round(stats.pause_s, 4)})

    def priority_save(step: int) -> None:
        """partial-mfu/ssu: rank 0 saves each shard's priority rows while the others wait (consistent rows)."""
        t0 = time.perf_counter()
        rows = recovery.priority.save(step) if recovery.priority is not None else 0
        coll.barrier()
        pauses.append(time.perf_counter() - t0)
        if rank == 0:
            out.log({"step": step, "priority_rows": rows, "priority_pause_s": round(pauses[-1], 4)})

    def roll_back(to_step: int) -> int:
        """Full recovery: dense state, readers and logs back to checkpoint ``to_step``."""
        import torch.distributed.checkpoint as dcp

        path = Path(cfg.checkpoint_dir) / f"step_{to_step:010d}"
        state = dense_state()
        dcp.load(state, checkpoint_id=str(path / "dense"))
        load_dense(state)
        meta = json.loads((path / "meta.json").read_text())
        reader.load_state_dict(meta["reader"])
        for log in recovery.logs.values():
            log.truncate_after(to_step)
            log.open_segment(to_step + 1)
        return to_step + 1

    # -- start: fresh, or resume after a trainer restart ------------------------------------------
    step = 1
    pauses: list[float] = []  # priority-save pauses
    resumed = dense_saver.load()
    out = RunOutputs(cfg, append=resumed is not None) if rank == 0 else NullOutputs()
    if resumed is not None:
        t_restore = time.time()
        d = int(resumed["step"])
        load_dense(resumed)
        reader.load_state_dict(resumed["reader"])
        recovery.load_state(resumed["recovery"])
        rolled = 0
        if rank == 0:
            rolled = sum(backend.store.rollback(s, d) for s in range(len(specs)))
            if cfg.log_dir:
                for s in range(len(specs)):
                    ShardLog(cfg.log_dir, s).truncate_after(d)
        coll.barrier()
        schedule.load(resumed["schedule"])
        last_ckpt = max([c for c in recovery.counter.at_step if c <= d] or [0]) if schedule.enabled else d
        for log in recovery.logs.values():
            log.open_segment(last_ckpt + 1)
        step = d + 1
        marker = Path(cfg.train.out) / "trainer_failure.json"
        if rank == 0 and marker.exists():
            info = json.loads(marker.read_text())
            recovery.failures.append(
                {
                    "kind": "trainer",
                    "target": info["rank"],
                    "step": info["step"],
                    "strategy": "restart",
                    "detected_after_s": round(t_restore - info["time"], 4),
                    "recovery_s": round(time.time() - t_restore, 4),
                    "restored_bytes": Path(dense_saver.path).stat().st_size,
                    "rolled_back_rows": rolled,
                    "lost_updates": 0,
                    "lost_samples": 0.0,
                    "replayed_steps": info["step"] - d,
                }
            )
            marker.unlink()
    else:
        if rank == 0:  # a fresh run: segments in the folder are an earlier run's
            if cfg.log_dir:
                for seg in Path(cfg.log_dir).glob("shard*/seg_*.log"):
                    seg.unlink()
            (Path(cfg.train.out) / "trainer_failure.json").unlink(missing_ok=True)
        coll.barrier()
        for log in recovery.logs.values():
            log.open_segment(1)
        if schedule.enabled:
            checkpoint(0)
            schedule.checkpoint_pause_s = ckpt.history[-1].pause_s

    bar = tqdm(
        total=steps,
        initial=step - 1,
        desc="train",
        unit="step",
        disable=rank != 0 or not cfg.train.progress,
        dynamic_ncols=True,
    )
    last_eval: dict = {}
    t0 = time.perf_counter()
    batch = next(reader)
    try:
        while step <= steps:
            t_step = time.perf_counter()
            if injector is not None:
                injector.at_step(step, lambda: recovery.latest_shard_file(0))
            # (1) stage: this batch's rows, or recover and retry
            recovery.guard(lambda b=batch: backend.stage(b))
            failed = recovery.sync()
            if failed:
                to = recovery.recover(failed, step, "pull")
                if to is not None:
                    step = roll_back(to)
                    batch = next(reader)
                continue
            nxt = next(reader) if step < steps else None
            logits = model(batch.dense_features, batch.sparse_features).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, batch.labels)
            backend.prefetch(nxt)  # the next batch's rows load while this one trains
            opt.zero_grad()
            loss.backward()
            # (2) update: one writer per shard; a failed shard is recovered and written again
            update = backend.gradients()
            dense_saver.wait()  # the dense state of step - 1 is durable before any shard moves to step
            rolled_to = None
            if update is None:
                backend.apply_local()
            else:
                only = None
                while True:
                    recovery.apply(update.owned, step, only)
                    if injector is not None:
                        injector.mid_step(step)
                    failed = recovery.sync()
                    if not failed:
                        break
                    rolled_to = recovery.recover(failed, step, "update")
                    if rolled_to is not None:
                        break
                    only = failed
            if rolled_to is not None:
                step = roll_back(rolled_to)
                batch = next(reader)
                continue
            if update is not None:
                recovery.count_updates(update.updated)
            opt.step()
            if world_size > 1:
                dist.barrier()  # every shard's writer is done before anyone reads the next step's rows
            dense_saver.save(  # the state is built only where it is saved (rank 0, restarts on)
                step,
                lambda step=step: {
                    **dense_state(),
                    "reader": resume_position(step),
                    "recovery": recovery.state(),
                    "schedule": schedule.state(),
                },
            )
            schedule.observe(step, time.perf_counter() - t_step)
            if schedule.checkpoint_due(step):
                checkpoint(step)
            elif schedule.priority_due(step):
                priority_save(step)
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
                    if rank == 0:
                        ok, res = recovery.guard(lambda: evaluate(plain, backend, data.eval, cfg.data.eval_samples))
                        last_eval = res if ok else last_eval
                        record.update(res if ok else {"eval_skipped": "shard failure"})
                    if world_size > 1:
                        dist.barrier()
                out.log(record)
                bar.set_postfix(
                    loss=f"{record['loss']:.4f}", **({"auc": f"{last_eval['auc']:.4f}"} if last_eval else {})
                )
            bar.n = step
            bar.refresh()
            step += 1
            batch = nxt
        wall = time.perf_counter() - t0
        bar.close()
        dense_saver.wait()
        if ckpt is not None:
            ckpt.wait()
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
            "failures": recovery.failures,
            "pls": pls(recovery.lost, steps * G),
            "embedding_digest": embedding_digest(backend.table_blocks()),
            "embeddings": cfg.embeddings.embeddings,
            "trainers": world_size,
            "shards": len(urls) if urls else 0,
            "recovery": cfg.recovery.recovery,
            "log_fsync": cfg.recovery.log_fsync if cfg.log_dir else None,
            "checkpoints": [
                {
                    "step": s.step,
                    "pause_s": round(s.pause_s, 4),
                    "total_s": round(s.total_s, 4),
                    "bytes": s.bytes,
                    **({"abandoned": s.abandoned} if s.abandoned else {}),
                }
                for s in (ckpt.history if ckpt is not None else [])
            ],
            "log_bytes": sum(log.bytes_written for log in recovery.logs.values()) if cfg.log_dir else 0,
            "log_seconds": round(sum(log.seconds for log in recovery.logs.values()), 4) if cfg.log_dir else 0.0,
            "checkpoint_every": schedule.every,
            "checkpoint_plan": schedule.plan,
            "priority_saves": len(pauses),
            "priority_pause_s": round(sum(pauses), 4),
            "priority_bytes": recovery.priority.bytes_written if getattr(recovery, "priority", None) else 0,
            "dense_saves": dense_saver.num_saves,
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
        recovery.close()
        backend.close()


def worker_main(cfg_dict: dict, urls: list[str], namespace: str, specs: list[dict] | None = None) -> dict | None:
    """Entry point of one trainer process under torch's elastic launcher (env: RANK, WORLD_SIZE)."""
    cfg = RunConfig.from_dict(cfg_dict)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    if world_size > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    try:
        return train(cfg, urls, namespace, world_size, rank, [ShardSpec(**s) for s in specs or []])
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
