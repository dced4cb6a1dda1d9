"""The training loop: one ``Trainer`` per trainer process.

A step is four named phases: stage the batch's rows, forward/backward, commit the sparse update
(row gradients aggregated over trainers, each shard written by its single writer), dense step.
``after_step`` then saves (per-step dense state for restarts, checkpoints, priority saves), logs
and evaluates. Every phase that touches the Redis tier runs under the recovery manager's commit
protocol (``recovery.manager``): at its commit point the trainers agree on an outcome (continue,
retry the phase on recovered shards, roll back to a checkpoint) and the trainer acts on it alone.

The run state (step, reader position, checkpoint schedule, recovery accounting, dense model and
optimizer) is one ``state_dict()``: checkpoints, per-step dense saves and restarts all use it.

Under the launcher (``python -m recsys train --trainers W``) or ``torchrun`` every trainer runs
``recsys.launch.worker_main``; with one trainer and no launcher, ``Trainer(...).train()`` runs in-process.
"""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from tqdm import tqdm

from data.batches import BatchReader, ChunkReader, make_batch
from data.progress import progress
from embeddings.servers.launcher import ShardSpec, server_pids
from embeddings.store.outage import ColdRows
from recovery.durable.dense import DenseSaver, NoDenseSaver
from recovery.errors import CorruptCheckpointError, NoCheckpointError, RecoveryError
from recovery.factory import build_recovery
from recovery.protocol import CONTINUE, Outcome
from recovery.window import closes_window
from recsys.backends import Backend, LocalBackend, StoreBackend
from recsys.clock import WARMUP_STEPS, ChunkBalance, StepClock, TrainerSpeeds, host_cores
from recsys.config import RunConfig
from recsys.datasets import sources
from recsys.errors import reserve_space
from recsys.group import TrainerGroup, flat_grads, run_group
from recsys.model import dense_optimizer, dense_params
from recsys.quorum.epoch import Epoch, dense_crc, meet_quorum, quorum_step, same_everywhere
from recsys.quorum.replica import PeerLost
from recsys.results.final_model import digest, final_keeper, keep_model, save_model_file
from recsys.results.metrics import evaluate_scores
from recsys.results.outputs import NullOutputs, RunOutputs
from recsys.results.summary import run_summary, save_totals
from recsys.schedule import Schedule

EVAL_BATCH = 4096
MAX_COLD_WAITS = 16
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
    try:
        with torch.no_grad(), backend.evaluating():
            for lo in range(0, n, EVAL_BATCH):
                a = source.read(lo, min(EVAL_BATCH, n - lo))
                b = make_batch(a.dense, a.sparse, a.labels, bags=a.bags)
                backend.serve_eval(b)  # rows of shards away (--train-through)
                logits.append(model(b.dense_features, b.sparse_features).squeeze(1).numpy())
                labels.append(b.labels.numpy())
    finally:  # a shard failure mid-evaluation must not leave the model in eval mode
        model.train(was_training)
    return evaluate_scores(np.concatenate(logits), np.concatenate(labels))


def chunk_reader(source, batch_size: int, group: TrainerGroup, prepare) -> BatchReader | ChunkReader:
    """This trainer's reader: its chunk of each global batch, or its chunks (a list a step)."""
    kw = {"epochs": 1 << 30, "read_ahead": True, "prepare": prepare}
    if len(group.chunks) == 1:
        return BatchReader(source, batch_size, world_size=group.data_chunks, rank=group.chunks[0], **kw)
    return ChunkReader(source, batch_size, group.chunks, group.data_chunks, **kw)


def stage_again(recovery, step: int, stage, agreed: Outcome) -> Callable[[], Outcome]:
    """The stage under the protocol after its commit point rode in the dense gather (``agreed``: what
    the trainers did then; RETRY runs its shards' part first); called again after a wait for a cold
    row (``Trainer.exactly``), it starts afresh, as ``run_phase`` does."""
    first = [agreed]
    return lambda: recovery.run_phase(step, "stage", stage, after=first.pop() if first else None)


PREPARE_AHEAD = 4  # steps between picking a priority save's rows (on its writer thread) and the save


def torch_threads(cfg: RunConfig, world_size: int) -> int:
    """``--threads``, or the host's cores left after its local Redis servers, split over the trainers."""
    if cfg.train.threads:
        return cfg.train.threads
    cores = len(host_cores())  # the host's, not this trainer's share where it is pinned to one
    e = cfg.embeddings
    servers = 0
    if e.embeddings == "redis" and e.redis == "local":
        servers = e.shards * (2 if e.replicas == "local" else 1)
    return max(1, (cores - servers) // world_size)


def _dense_state(saver, pre: tuple[tuple, dict] | None) -> tuple[dict | None, bool]:
    """The per-step dense state, and whether it is the one loaded already while the quorum formed
    (``pre``: its file's identity then, and the state; ``recsys.quorum.regroup.Prebuilt``)."""
    if pre is not None and saver.identity() == pre[0]:
        return pre[1], True
    return saver.load(), False


class Trainer:
    """One trainer process: its parts are built here; ``train()`` runs the loop."""

    def __init__(
        self,
        cfg: RunConfig,
        urls: list[str],
        namespace: str,
        world_size: int = 1,
        rank: int = 0,
        specs: list[ShardSpec] | None = None,
        epoch: Epoch | None = None,
    ) -> None:
        self.t_setup = time.perf_counter()
        self.cfg, self.namespace, self.world_size, self.rank = cfg, namespace, world_size, rank
        # --trainer-recovery replace: this trainer of a quorum, its group the quorum's (``recsys.quorum.regroup``)
        self.epoch = epoch
        # every collective of this trainer goes through it; it says which chunks of each step are this trainer's
        self.group = epoch.group if epoch is not None else run_group(cfg.train, world_size, rank)
        self._threads_before = torch.get_num_threads()  # given back when train() ends (an in-process run)
        torch.set_num_threads(torch_threads(cfg, world_size))
        self.specs = specs or []
        self.num_shards = len(urls)
        self.steps, self.batch_size = cfg.train.steps, cfg.train.batch_size
        self.backend: Backend = (
            LocalBackend(cfg)
            if cfg.embeddings.embeddings == "local"
            else StoreBackend(cfg, urls, namespace, self.group)
        )
        self.plain = self.backend.model
        if cfg.train.init_from:  # every rank alike, before DDP compares them (a resume loads its own after)
            from recsys.results.exporter import load_dense

            load_dense(self.plain, cfg.train.init_from)
        self.init_stats: dict | None = None  # --init-from: what streaming the rows in cost (rank 0)
        self.model = self.group.wrap(self.plain)
        self.dense = list(dense_params(self.plain))
        self.opt = dense_optimizer(cfg, self.dense)
        self.data = sources(cfg)
        self.new_reader = lambda: chunk_reader(self.data.train, self.batch_size, self.group, self.backend.prepare)
        self.reader = self.new_reader()
        self.coll = self.group.collective()
        self.dense_saver = (
            DenseSaver(cfg.checkpoint_dir, namespace, writer=rank == 0)
            if (cfg.recovery.max_restarts or epoch is not None) and isinstance(self.backend, StoreBackend)
            else NoDenseSaver()
        )
        self.recovery, self.checkpointer, self.injector = build_recovery(
            cfg,
            self.backend.store,
            self.specs,
            self.coll,
            rank,
            drain=self.backend.drain,
            committer_of=self.dense_saver.committer,  # a window's write makes its step's save current
            warn=lambda line: tqdm.write(line, file=sys.stderr),  # on a line of its own under the bar
            trainer_index=epoch.index if epoch is not None else None,
        )
        self.schedule = Schedule(cfg, self.num_shards, self.coll, rank)
        self.out: RunOutputs | NullOutputs = NullOutputs()
        self.step = 1  # the step about to run
        self.priority_pauses: list[float] = []
        self.flush_pauses: list[float] = []
        self._first_step = 1
        self._warm: tuple[int, float] | None = None  # (step, time) at the end of the warm-up steps
        self.last_eval: dict = {}
        self._shown_loss: float | None = None  # the progress bar's: the last step record's loss
        self._t_step = 0.0
        self._dense_cache: tuple[int, dict, dict] | None = None
        self._checkpoint_owed = False  # one came due while a shard was away: taken at its rejoin
        # the dense state loaded while the quorum formed, and its file's identity then (``regroup.Prebuilt``)
        self.preloaded: tuple[tuple, dict] | None = None
        self._resumed_from: tuple[float, float] | None = None  # (elapsed_s, saved_at) of the state resumed from
        self._before = 0.0  # the run's wall time before this process trained (``elapsed_before``)
        self.clock = StepClock()
        self.speed = TrainerSpeeds()  # each trainer's compute a step, and the trainers found slow
        self.balance = ChunkBalance(cfg.train.balance_every)  # chunks that follow speed

    # -- run state ----------------------------------------------------------------------------
    def state_dict(self, step: int | None = None) -> dict:
        """Everything a resume needs, as of the end of ``step`` (default: the last completed step)."""
        step = self.step - 1 if step is None else step
        model, optim = self._dense_refs()
        return {
            "dense": {"model": model, "optim": optim},
            "run": {
                "step": step,
                # the run's wall time to here, restarts included, and when it was saved: a restart
                # adds the time until it trains again (``elapsed_before``)
                "elapsed_s": round(self.elapsed(), 3),
                "saved_at": time.time(),
                # the reader yields the batch of step + 1 next
                "reader": {"position": step * self.batch_size, "global_batch_size": self.batch_size},
                "schedule": self.schedule.state(),
                "recovery": self.recovery.state(),
            },
        }

    def _dense_refs(self) -> tuple[dict, dict]:
        """The dense model and optimizer state (live tensors, keyed as DCP keys them). Building the
        mapping costs ~2 ms; the optimizer updates its tensors in place, so it is built again only
        when the optimizer gains state or the state was loaded (``load_state_dict``)."""
        if self._dense_cache is None or self._dense_cache[0] != len(self.opt.state):
            if not self.opt.state:  # before the first step: get_state_dict makes the state by a step
                get_state_dict(self.plain, self.opt)  # of zero gradients at lr 0, which still counts:
                for state in self.opt.state.values():  # Adam's bias correction would start at t=2
                    if "step" in state:
                        state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
            msd, osd = get_state_dict(self.plain, self.opt)
            model = {k: v for k, v in msd.items() if "embedding_bags" not in k}
            self._dense_cache = (len(self.opt.state), model, osd)
        return self._dense_cache[1], self._dense_cache[2]

    def load_state_dict(self, state: dict, *, rollback: bool = False) -> None:
        """Restart: everything. Rollback to a checkpoint: dense state and reader only (the failures
        and accounting of the run so far stand)."""
        msd, osd = get_state_dict(self.plain, self.opt)
        msd.update(state["dense"]["model"])
        set_state_dict(self.plain, self.opt, model_state_dict=msd, optim_state_dict=state["dense"]["optim"])
        self._dense_cache = None
        run = state["run"]
        self.reader.load_state_dict(run["reader"])
        self.step = int(run["step"]) + 1
        if not rollback:
            self._resumed_from = (float(run.get("elapsed_s", 0.0)), float(run.get("saved_at", 0.0)))
            self.schedule.load(run["schedule"])
            self.recovery.load_state(run["recovery"])

    # -- the loop -----------------------------------------------------------------------------
    def train(self) -> dict | None:
        """Train ``cfg.train.steps`` steps; rank 0 writes the run outputs and returns the summary."""
        bar = None
        try:
            if self.rank == 0:
                reserve_space(Path(self.cfg.train.out))  # room for a traceback should the disk fill up
            self.resume()
            bar = progress(  # a bar on a terminal, a plain line now and then in a file or a pipe
                total=self.steps,
                initial=self.step - 1,
                desc="train",
                unit="step",
                disable=self.rank != 0 or not self.cfg.train.progress,
            )
            self.t0 = time.perf_counter()
            self._before = self.elapsed_before()
            self._first_step = self.step
            batch = next(self.reader)
            while True:
                if self.step > self.steps:
                    if self.epoch is not None:
                        self.epoch.finishing()
                    out, summary = self.finish()
                    if not out.rolled_back:
                        return summary
                else:
                    out, nxt, loss = self.train_step(batch)
                    out = out if out.rolled_back else self.after_step(loss)
                    self.clock.lap("after")  # saves, logging, evaluation
                    if not out.rolled_back:
                        self.show_progress(bar)
                        if self.step - self._first_step + 1 == WARMUP_STEPS:
                            self._warm = (self.step, time.perf_counter())
                            self.clock.mark(self.step, server_pids(self.specs))
                        self.step += 1
                        batch = nxt
                        if self.balance.next is not None:  # chunks follow speed from this step
                            self.reader, batch = self.balance.take(self.reader, self.group, batch, self.new_reader)
                        continue
                self.roll_back(out.to_step)  # full recovery: back to a checkpoint, then on from there
                batch = next(self.reader)
        finally:
            if bar is not None:
                bar.close()  # the line after it (an error, the summary) starts on a line of its own
            self.close()

    def close(self) -> None:
        """Its threads, connections and files closed (``train`` ends so; a trainer built for a quorum
        that did not form as expected is closed unused)."""
        if self.injector is not None:
            self.injector.close()
        # --trainer-recovery replace: its background work ends before the process builds the next trainer
        self.recovery.close(settle=self.epoch is not None)
        self.backend.close()
        self.reader.close()
        self.dense_saver.close()
        torch.set_num_threads(self._threads_before)

    def elapsed_before(self) -> float:
        """The run's wall time before this process's first step: 0 for a fresh start; after a
        restart, the elapsed time of the state resumed from plus everything since it was saved (the
        steps after it redone, the death, the new processes, their set-up): the run's figures cover
        the whole run, restarts included. A ``--resume`` (``RECSYS_RESUMED_AT``, set by the launcher)
        does not count the time the run stood stopped, only its own set-up."""
        if self._resumed_from is None:
            return 0.0
        elapsed, saved_at = self._resumed_from
        since = max(saved_at, float(os.environ.get("RECSYS_RESUMED_AT", "0") or 0))
        return elapsed + max(0.0, time.time() - since) if since else elapsed

    def elapsed(self) -> float:
        """The run's wall seconds so far (restarts included); 0 before its first step."""
        t0 = getattr(self, "t0", None)
        return 0.0 if t0 is None else time.perf_counter() - t0 + self._before

    def show_progress(self, bar) -> None:
        bar.n = self.step
        recent = [r for r in self.out.records[-4:] if r.get("step") == self.step and "loss" in r]
        if recent:  # the step's own record (a priority save's or a checkpoint's has no loss)
            self._shown_loss = recent[-1]["loss"]
        if self._shown_loss is not None:
            auc = {"auc": f"{self.last_eval['auc']:.4f}"} if self.last_eval else {}
            elapsed = time.perf_counter() - self.t0
            rate = (self.step - self._first_step + 1) * self.batch_size / elapsed if elapsed > 0 else 0.0
            bar.set_postfix(samples_per_s=f"{rate:,.0f}", loss=f"{self._shown_loss:.4f}", **auc, refresh=False)
        bar.refresh()

    def exactly(self, step: int, what: str, phase: Callable[[], Outcome]) -> Outcome:
        """``phase()``; where it reads rows of a shard away that no trainer holds under ``log``
        (``ColdRows``, on every trainer alike, before anything was read or kept), the run waits for
        the restore (counted in the failure's ``waited_s``, one line) and the phase runs again on
        the restored shard: ``log`` reads every row exactly, whatever the cache holds. ``step``:
        the step the shards rejoin at (the one about to run)."""
        for _ in range(MAX_COLD_WAITS):  # each wait ends an outage: another needs another failure
            try:
                return phase()
            except ColdRows as e:
                self.recovery.end_outage(step, f"the {what} reads {e} (--recovery log reads every row exactly)")
        return phase()

    def train_step(self, batch) -> tuple[Outcome, object, torch.Tensor | None]:
        """One step: stage rows, forward/backward, commit the sparse update, dense step.
        -> (outcome, the next batch, the loss)."""
        step = self.step
        self._t_step = time.perf_counter()
        self.clock.start(self._t_step)
        if self.epoch is not None:
            meet_quorum(self, step)  # --trainer-recovery replace
            self.clock.lap("quorum")
        self.recovery.poll_outage(step)  # shards restored in the background rejoin here (--train-through)
        if self.injector is not None:
            settle = self.checkpointer.settle if self.checkpointer is not None else None
            self.injector.at_step(step, lambda: self.recovery.latest_shard_file(0), settle)
        clock = self.clock

        def stage(only) -> None:
            self.backend.stage(batch)

        # several trainers reducing in chunk order: the stage's commit point rides in the dense gather
        ahead = self.group.agrees_in_gather(self.dense) and self.backend.stages_ahead
        staged, out = True, CONTINUE
        if ahead:
            staged = self.recovery.points.stage_ahead(step, stage)
        else:
            out = self.exactly(step, "step", lambda: self.recovery.run_phase(step, "stage", stage))
        clock.lap("rows_in")
        if out.rolled_back:
            return out, None, None
        nxt = next(self.reader) if step < self.steps else None
        clock.lap("data")
        while True:
            t_compute = time.perf_counter()
            if staged:
                loss, flats = self.forward_backward(batch, nxt)
                slow = self.injector.slow_factor(step) if self.injector is not None else 1.0
                if slow > 1.0:  # --inject slow-trainer: this trainer's compute takes ``slow`` times as long
                    time.sleep((slow - 1.0) * (time.perf_counter() - t_compute))
                self.speed.add(time.perf_counter() - t_compute)  # its own chunks' work, no wait for the others
            else:  # a shard failed under this trainer's stage: nothing computed, its chunks go empty
                chunks = len(batch) if isinstance(batch, list) else 1
                loss, flats = None, [torch.zeros(sum(p.numel() for p in self.dense))] * chunks
                self.backend.reset_chunks(chunks)
            failed = []
            if self.group.reduces_dense:
                flags = self.recovery.points.take_flags() if ahead else None
                failed = self.group.reduce_dense(self.dense, flats, self.backend.chunk_rows(), flags)
            if not failed:
                break
            # some trainer's stage failed: nothing of the step is kept; the shards are recovered, then
            # the stage (its commit point its own) and the compute run again
            clock.lap("compute")
            self.backend.reset_chunks()
            out = self.recovery.points.commit_agreed(step, "stage", failed)
            if not out.rolled_back:
                out = self.exactly(step, "step", stage_again(self.recovery, step, stage, out))
            if out.rolled_back:
                return out, None, None
            clock.lap("rows_in")  # the recovery and the stage again
            ahead, staged = False, True
        if loss is None:
            raise RuntimeError(f"step {step}: the stage failed here and no trainer was told")
        clock.lap("compute")
        out = self.commit_sparse(step)
        clock.lap("rows_out")
        if out.rolled_back:
            return out, None, None
        self.opt.step()
        clock.lap("compute")
        if self.recovery.window_steps == 1:  # in windows every trainer holds every row: none is read back
            self.group.barrier()  # every shard's writer is done before anyone reads the next step's rows
        clock.lap("waiting")
        if self.epoch is not None:
            if not self.epoch.replica.commit(quorum_step(self, step)):
                raise PeerLost(f"step {step} was not committed by the quorum (torchft's should_commit)")
            clock.lap("quorum")
        return out, nxt, loss

    def forward_backward(self, batch, nxt) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Each of this trainer's chunks of the step (``batch``: one, or a list) forward and backward on
        its own, its row gradients kept apart. -> (the sum of its chunks' losses, each chunk's dense
        gradients flat where the group reduces them in chunk order: ``TrainerGroup.reduce_dense``,
        after; DDP's backward reduces them otherwise)."""
        parts = batch if isinstance(batch, list) else [batch]
        losses, flats = [], []
        for i, b in enumerate(parts):
            logits = self.model(b.dense_features, b.sparse_features).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, b.labels)
            if i == 0:  # the next batch's rows load while this one trains (one chunk a trainer)
                self.backend.prefetch(None if isinstance(nxt, list) else nxt)
            self.opt.zero_grad()
            loss.backward()
            self.backend.end_chunk()
            if self.group.reduces_dense:
                flats.append(flat_grads(self.dense))
            losses.append(loss)
        # the sum over this trainer's chunks: ``TrainerGroup.mean`` divides the step's sum by the chunks
        return (losses[0] if len(losses) == 1 else torch.stack([x.detach() for x in losses]).sum()), flats

    def commit_sparse(self, step: int) -> Outcome:
        """Row gradients over trainers (a collective), then each writer's shards under the protocol."""
        update = self.backend.gradients()
        out = self.recovery.commit_behind(step)  # step - 1's write-behind commits (or is recovered) first
        if out.rolled_back:
            return out
        if update is None:
            self.backend.apply_local()
            return CONTINUE

        def write(only) -> None:
            # every row of step - 1 is on its shard (committed above): its dense state becomes the
            # file before any shard moves to step, on the write-behind thread or here
            self.recovery.apply(update, step, only, behind=True, durable=self.dense_saver.committer(step - 1))
            if self.injector is not None:
                self.injector.mid_step(step)

        out = self.recovery.run_phase(step, "update", write)
        if not out.rolled_back:
            self.recovery.count_updates((update.updated_keys, update.updated_shards), step)
            self.backend.update_peers(update, step)  # several trainers: the others' rows kept here
        return out

    def after_step(self, loss: torch.Tensor) -> Outcome:
        """Saves, logging and evaluation after a completed step."""
        step = self.step
        eval_now = self.cfg.train.eval_every > 0 and step % self.cfg.train.eval_every == 0 and step != self.steps
        sched = self.schedule
        owed = self._checkpoint_owed and not self.recovery.outage_active
        ckpt_due = sched.checkpoint_due(step) or owed
        prio_due, flush_due = (sched.priority_due(step), sched.flush_due(step)) if not ckpt_due else (False, False)
        if self.recovery.outage_active and (ckpt_due or prio_due or flush_due):
            # a save reads every shard: while one is restored in the background (--train-through) it
            # is put off, a checkpoint to the step the shard rejoins at, a priority save or flush to its next
            self._checkpoint_owed |= ckpt_due
            ckpt_due = prio_due = flush_due = False
        saves = ckpt_due or prio_due or flush_due
        reads = eval_now or saves
        window = self.recovery.window_steps
        if window == 1 or reads or closes_window(step, window) or step == self.steps:  # where a write may end
            # built only where it is saved, and written once the step's write-behind is on the shards
            self.dense_saver.save(step, lambda: self.state_dict(step))
        self.schedule.observe(step, time.perf_counter() - self._t_step)
        out = CONTINUE
        if reads:  # saves and evaluation read the shards as of this step
            away = self.recovery.outage_active
            out = self.recovery.commit_behind(step, reads=True)
            if out.rolled_back:
                return out
            if self.recovery.outage_active and not away:
                # a shard failed under that write and went away (--train-through): the saves due were
                # decided with every shard there, so it rejoins first (the run waits for its restore)
                self.recovery.end_outage(step + 1)
        if ckpt_due:
            self._checkpoint_owed = False
            out = self.checkpoint(step)
        elif prio_due:
            self.priority_save(step)
        elif flush_due:
            self.flush(step)
        # the next priority save's rows are picked off the path, a few steps ahead
        ahead = min(PREPARE_AHEAD, self.schedule.priority_every - 1)
        if ahead and self.schedule.priority_due(step + ahead) and not self.recovery.outage_active:
            self.recovery.saves.prepare_priority()
        if out.rolled_back:
            return out
        if self.balance.due(self.group, step, self.steps):
            self.balance.plan(self.speed, self.group, step, self.rank == 0, self.out.log)
        if step % self.cfg.train.log_every == 0 or step == self.steps or eval_now:
            mean_loss = self.group.mean(loss)
            record = {
                "step": step,
                "loss": float(mean_loss),
                "samples": step * self.batch_size,
                "elapsed_s": round(self.elapsed(), 3),
            }
            if not self.group.solo:  # each trainer's compute a step since the last record (a collective)
                index = self.epoch.index if self.epoch is not None else self.rank
                record["trainer_compute_ms"] = self.speed.exchange(self.group, index, step, self.rank == 0)
            if eval_now:
                out, res = self.evaluate(step)
                if out.rolled_back:
                    return out
                self.last_eval = res or self.last_eval
                record.update(res)
            self.out.log(record)
        return out

    # -- phases besides the step ----------------------------------------------------------------
    def checkpoint(self, step: int) -> Outcome:
        """Fork every shard's snapshot under the protocol, then the dense state and the background copy."""
        ckpt = self.checkpointer
        ckpt.check_abandoned()  # too many abandoned in a row: the run stops here (rank 0)

        def begin(only) -> None:
            ckpt.begin(step)
            self.check_evictions()  # after the forks: a snapshot missing evicted rows never gets a manifest

        out = self.recovery.run_phase(step, "checkpoint", begin)
        if out.rolled_back:
            return out
        self.recovery.saves.on_checkpoint(step)
        state = self.state_dict(step)
        stats = ckpt.finish(step, state["dense"], {**state["run"], "namespace": self.namespace})
        self.out.log({"step": step, "checkpoint_pause_s": round(stats.pause_s, 4)})
        return out

    def check_evictions(self, final: bool = False) -> None:
        """Rank 0 at a commit point (a checkpoint's forks, the end of the run): a shard whose server
        evicted keys stops the run (``RedisStore.check_evictions``), resumable where the per-step dense
        state is kept (``--max-restarts`` > 0, not yet discarded at the end) and the strategy restores
        from the run's own saves (a replica lost the same rows: evictions reach it as deletes)."""
        store = self.backend.store
        if self.rank != 0 or store is None:
            return
        rc = self.cfg.recovery
        why_not = (
            "the run finished training and its dense state is gone"
            if final
            else "it ran with --max-restarts 0, which keeps no state to resume from"
            if not rc.max_restarts
            else "--recovery replica cannot restore it: its replica lost the same rows"
            if rc.recovery == "replica"
            else ""
        )
        store.check_evictions(None if why_not else f"--resume {self.cfg.train.out}", why_not)

    def priority_save(self, step: int) -> None:
        """partial-mfu/ssu: each writer copies its shards' priority rows (no barrier: it is their only
        writer); a background thread writes them. A shard read that fails is seen at the next commit."""
        self._row_save(step, "priority", self.recovery.saves.save_priority, self.priority_pauses)

    def flush(self, step: int) -> None:
        """incremental: each writer copies its shards' rows dirtied since its last flush; a background
        thread writes them."""
        self._row_save(step, "flush", self.recovery.saves.flush, self.flush_pauses)

    def _row_save(self, step: int, what: str, save, pauses: list[float]) -> None:
        held = self.backend.store.row_cache
        hits = held.hits if held is not None else 0
        t0 = time.perf_counter()
        _, rows = self.recovery.guard(lambda: save(step))
        pauses.append(time.perf_counter() - t0)
        rows = rows or 0
        self.out.log(
            {
                "step": step,
                f"{what}_rows": rows,
                # rows not held (a shard restored since its writer last wrote them) are read from Redis
                f"{what}_rows_from_redis": rows - (held.hits - hits if held is not None else 0),
                f"{what}_pause_s": round(pauses[-1], 5),
                # mean seconds per step so far (the scale a pause is judged against)
                "step_s": round((time.perf_counter() - self.t0) / max(1, self.step - self._first_step + 1), 5),
            }
        )

    def evaluate(self, step: int) -> tuple[Outcome, dict]:
        """Rank 0 evaluates (reading the tier) under the protocol; the others wait at its commit point."""
        res: dict = {}

        def run(only) -> None:
            if self.rank == 0 or self.backend.lockstep_eval:  # shards away: every trainer serves their rows
                if self.injector is not None and self.rank == 0:
                    self.injector.during("eval")
                got = evaluate(self.plain, self.backend, self.data.eval, self.cfg.data.eval_samples)
                if self.rank == 0:
                    res.clear()
                    res.update(got)

        # rows no trainer holds of a shard away under log: the evaluation waits for them (as a step would)
        return self.exactly(step + 1, "evaluation", lambda: self.recovery.run_phase(step, "eval", run)), res

    def resume(self) -> None:
        """Fresh start, or resume after a trainer restart from the per-step dense state (or, when
        that file fails its checksum, from the newest checkpoint whose files all verify: every
        shard then rolls back to it, and the steps since are trained again)."""
        rebuild = False
        epoch = self.epoch
        pre, self.preloaded = self.preloaded, None
        try:
            # a quorum that only gained trainers goes on from the state each holds (``recsys.quorum.regroup``)
            if epoch is not None and epoch.start_state is not None:
                resumed, loaded = epoch.start_state, False
            else:
                resumed, loaded = _dense_state(self.dense_saver, pre)
        except CorruptCheckpointError as e:
            resumed, rebuild, loaded = self._resume_from_checkpoint(str(e)), True, False
        if resumed is None and pre is not None:
            raise RuntimeError(f"the per-step dense state {self.dense_saver.path} went away while the quorum formed")
        if self.rank == 0:
            self.out = RunOutputs(self.cfg, append=resumed is not None)
        t_restart = epoch.detected_at if epoch is not None and epoch.left else time.time()
        if resumed is not None and not loaded:
            self.load_state_dict(resumed)
        self.reader.read_ahead()  # the first step's batch is read while the run resumes
        if self.injector is not None:
            self.injector.step = self.step
            self.injector.start(fresh=resumed is None, barrier=self.coll.barrier)
        if resumed is None:
            if self.cfg.train.init_from:
                self.init_rows()
            self.recovery.fresh_start(t_restart)
            self.backend.fresh_start()
            if self.schedule.enabled:
                out = self.checkpoint(0)
                if out.rolled_back:  # pragma: no cover - a failure before any checkpoint exists
                    raise RuntimeError("a shard failed before the first checkpoint was taken")
                self.schedule.checkpoint_pause_s = self.checkpointer.history[-1].pause_s
            return
        self.recovery.saves.suspend_flushes()  # rows dirtied before the restart are unknown
        size = self.dense_saver.path.stat().st_size if self.dense_saver.path.exists() else 0
        out = self.recovery.resume(self.step - 1, t_restart, size, rebuild=rebuild)
        if out.rolled_back:
            self.roll_back(out.to_step)
        self.backend.resumed_start(self.step - 1)
        if epoch is not None:
            journal = self.recovery.journal
            if epoch.joined:  # the newcomers hold what every other trainer holds, bit for bit
                equal = same_everywhere(self.group, dense_crc(self))
                for i, from_peer in epoch.joined.items():
                    journal.note_rejoin(i, self.step, epoch.heal_s, from_peer, equal)
            for i in set(epoch.members) - set(epoch.joined):  # back without a join (a resumed run's first quorum)
                if journal.absent(i):
                    journal.note_rejoin(i, self.step)

    def init_rows(self) -> None:
        """``--init-from``: rank 0 streams every table's rows from the DCP folder into the shards, a
        block at a time, before the first step (and before checkpoint 0, the base of any restore);
        the others wait at a barrier."""
        if self.rank == 0:
            from recsys.results.exporter import stream_rows

            st = stream_rows(self.backend.store, self.cfg.train.init_from, self.cfg.optim.optimizer)
            self.init_stats = {
                "path": self.cfg.train.init_from,
                "rows": st.rows,
                "bytes": st.row_bytes,
                "seconds": round(st.seconds, 3),
            }
        self.coll.barrier()

    def _resume_from_checkpoint(self, why: str) -> dict:
        """The dense state and run state of the newest checkpoint whose files all verify (every
        trainer finds the same one), in place of a damaged per-step dense state."""
        where = self.checkpointer.dir if self.checkpointer is not None else None
        try:
            if self.checkpointer is None:
                raise NoCheckpointError("checkpoints are off")
            ckpt = self.checkpointer.latest_verified()
        except NoCheckpointError as e:
            raise RecoveryError(
                f"{why}, and there is no checkpoint to fall back to ({e}): the run cannot resume"
            ) from None
        state = self.state_dict(ckpt.step)
        meta = self.checkpointer.load(ckpt.step, state["dense"])
        if self.rank == 0:
            print(
                f"warning: {why}; resuming from the checkpoint of step {ckpt.step} in {where} "
                f"(every shard goes back to it; the steps since are trained again)",
                file=sys.stderr,
            )
        return {"dense": state["dense"], "run": meta}

    def roll_back(self, to_step: int) -> None:
        """Full recovery: dense state, readers and logs back to checkpoint ``to_step``."""
        state = self.state_dict(to_step)
        meta = self.checkpointer.load(to_step, state["dense"])
        self.load_state_dict({"dense": state["dense"], "run": meta}, rollback=True)
        self.recovery.on_rollback(to_step)
        self.backend.drain()  # rows read ahead or kept of the other trainers' shards are of later steps

    def finish(self) -> tuple[Outcome, dict | None]:
        """Final evaluation and embedding digest under the protocol; rank 0 writes the run's outputs."""
        wall = time.perf_counter() - self.t0
        self.clock.mark(self.steps, server_pids(self.specs))
        self.recovery.end_outage(self.steps + 1)  # a shard restored in the background rejoins first
        out = self.recovery.commit_behind(self.steps, reads=True)  # the last step's write-behind
        if out.rolled_back:
            return out, None
        # a shard that failed under that write went away (--train-through): it rejoins before anything reads it
        self.recovery.end_outage(self.steps + 1)
        commit = self.dense_saver.committer(self.steps)  # every row of the last step is on its shard
        if commit is not None:
            commit()
        self.recovery.guard(self.check_evictions)  # while the run can still be resumed (a dead shard: below)
        self.dense_saver.discard()
        if self.checkpointer is not None:
            self.checkpointer.wait()
        store = self.backend.store  # None: the rows live in this process (nothing held, nothing restored)
        saves = save_totals(self.coll, self.recovery.wait_background(), store)
        res: dict = {}
        keeper = final_keeper(self.cfg, self.backend.store, self.specs, self.namespace, self.rank)

        def final(only) -> None:
            if self.rank == 0:
                res["eval"] = evaluate(self.plain, self.backend, self.data.eval, self.cfg.data.eval_samples)
                res["digest"] = digest(self.cfg, self.backend)
                self.check_evictions(final=True)  # what the evaluation and the digest read was all there
                if keeper is not None:
                    keeper.begin(self.steps)  # every shard forks its final snapshot (no row moves after this)

        out = self.recovery.run_phase(self.steps, "final", final)
        if out.rolled_back or self.rank != 0:
            return out, None
        kept = None if keeper is None else keep_model(keeper, self.state_dict(self.steps), self.namespace, self.cfg)
        summary = run_summary(
            self.cfg,
            world_size=self.world_size,
            num_shards=self.num_shards,
            torch_threads=torch.get_num_threads(),
            t_setup=self.t_setup,
            t0=self.t0,
            wall=wall,
            wall_before=self._before,
            warm=self._warm,
            final=res["eval"],
            digest=res["digest"],
            ceiling_auc=self.data.ceiling_auc,
            failures=self.recovery.summary_failures(self.steps),
            lost=self.recovery.lost,
            injected=self.injector.fired() if self.injector is not None else [],
            not_fired=self.injector.not_fired() if self.injector is not None else [],
            checkpoints=self.checkpointer.history if self.checkpointer is not None else [],
            saves=saves,
            store=store,
            write_every=self.recovery.window_steps,
            schedule=self.schedule,
            priority_pauses=self.priority_pauses,
            flush_pauses=self.flush_pauses,
            clock=self.clock,
            dense_saves=self.dense_saver.num_saves,
            dense_save_seconds=self.dense_saver.seconds,
            backend_stats=self.backend.stats(),
        )
        summary.update({} if self.group.solo else {"slow_trainers": self.speed.slow, "chunk_plans": self.balance.plans})
        if kept is not None:
            summary["final_model"] = kept
        if self.init_stats is not None:
            summary["init_from"] = self.init_stats
        if self.cfg.train.save_model:
            save_model_file(self.cfg, self.plain, self.backend)
        self.out.log(
            {
                "step": self.steps,
                "samples": self.steps * self.batch_size,
                "elapsed_s": round(wall + self._before, 3),
                **res["eval"],
            }
        )
        self.out.finish(summary)
        return out, summary
