"""The recovery manager: detects failed shards, restores them by strategy, accounts for losses.

Every trainer holds one. Store calls that can fail run under ``guard``; failures are exchanged at
the step's commit points (``sync``, a MAX all-reduce of per-shard flags), so every trainer sees
the same failed set at the same point and calls ``recover`` together. Rank 0 does the work
(replacement process, restore, log replay); the others wait at a barrier.

Strategies:
- ``partial`` (CPR): a replacement for the failed shard loads that shard's snapshot from the newest
  verified checkpoint; other shards and the dense model keep their state. Updates to the shard since
  that checkpoint are lost and counted.
- ``log``: as ``partial``, then the shard's update log is replayed up to the failure: nothing lost.
- ``full``: every shard is restored from the checkpoint, and the trainers roll the dense state and
  the readers back to it (returned step) and recompute from there.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from embeddings import RedisStore, ShardUnavailableError
from embeddings.launcher import ShardSpec, kill_and_wait, spawn_shard
from recovery.accounting import UpdateCounter, lost_samples
from recovery.checkpoint import Checkpoint, Checkpointer
from recovery.errors import CorruptCheckpointError, NoCheckpointError, RecoveryError
from recovery.inject import Injector, read_pid
from recovery.log import ShardLog

STRATEGIES = ("full", "partial", "partial-mfu", "partial-ssu", "log")


@dataclass
class Collective:
    """The few collectives the manager needs; identity functions with one trainer."""

    world_size: int = 1
    barrier: Callable[[], None] = lambda: None
    max_flags: Callable[[np.ndarray], np.ndarray] = lambda a: a
    broadcast_int: Callable[[int], int] = lambda v: v


@dataclass
class RecoveryManager:
    strategy: str
    store: RedisStore
    shards: list[ShardSpec]
    rank: int
    batch_size: int
    collective: Collective
    checkpointer: Checkpointer | None = None
    logs: dict[int, ShardLog] = field(default_factory=dict)  # shards this trainer writes
    injector: Injector | None = None
    drain: Callable[[], None] = lambda: None  # drop prefetched rows after a restore
    failures: list[dict] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    counter: UpdateCounter | None = None
    priority: object | None = None  # PrioritySaver (rank 0, partial-mfu / partial-ssu)

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"recovery strategy {self.strategy!r} must be one of {STRATEGIES}")
        self.counter = self.counter or UpdateCounter(self.store.num_shards)
        self._flags = np.zeros(self.store.num_shards, dtype=np.int64)
        self._detected: dict[int, float] = {}
        self._lost_base = np.zeros(self.store.num_shards, dtype=np.int64)
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.store.num_shards), thread_name_prefix="apply")

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for log in self.logs.values():
            log.close()

    # -- detection -----------------------------------------------------------------------------
    def guard(self, fn: Callable[[], object]) -> tuple[bool, object]:
        """Run a store call; a failed shard is recorded (not raised) for the next ``sync``."""
        try:
            return True, fn()
        except ShardUnavailableError as e:
            self._flags[e.shard] = 1
            self._detected.setdefault(e.shard, time.time())
            return False, None

    def sync(self) -> list[int]:
        """Failed shards seen by any trainer since the last sync (a collective)."""
        flags = self.collective.max_flags(self._flags.copy())
        self._flags[:] = 0
        return [int(s) for s in np.flatnonzero(flags)]

    # -- accounting ------------------------------------------------------------------------------
    def count_updates(self, updated: dict[str, np.ndarray]) -> None:
        per_shard = np.zeros(self.store.num_shards, dtype=np.int64)
        for name, ids in updated.items():
            t = self.store.tables.index(name)
            per_shard += np.bincount(self.store.shard_map.shard_of(t, ids), minlength=self.store.num_shards)
            if self.priority is not None:
                self.priority.observe(t, ids)
        self.counter.add(per_shard)

    def on_checkpoint(self, step: int) -> None:
        self.counter.mark(step)
        if self.priority is not None:
            self.priority.on_checkpoint(step)

    def log_step(self, step: int, written: dict[str, tuple[np.ndarray, np.ndarray]]) -> int:
        """Group-commit this step's written rows to the logs of the shards this trainer writes."""
        if not self.logs:
            return 0
        groups: dict[int, list] = {s: [] for s in self.logs}
        for name, (ids, rows) in written.items():
            t = self.store.tables.index(name)
            for s, pos in enumerate(self.store.shard_map.split(t, ids)):
                if len(pos) and s in groups:
                    groups[s].append((t, ids[pos], rows[pos]))
        return sum(self.logs[s].append_step(step, g) for s, g in groups.items() if g)

    def apply(self, owned: dict[str, tuple[np.ndarray, object]], step: int, only: list[int] | None = None) -> None:
        """Write this step's rows of the shards this trainer owns, each shard on its own (a failed
        shard does not stop the others), then group-commit them to the shards' logs."""
        per_shard: dict[int, dict] = {}
        for name, (ids, grads) in owned.items():
            t = self.store.tables.index(name)
            for s, pos in enumerate(self.store.shard_map.split(t, ids)):
                if len(pos) and (only is None or s in only):
                    per_shard.setdefault(s, {})[name] = (ids[pos], grads[pos])

        def write(sub: dict) -> None:
            ok, written = self.guard(lambda: self.store.update_many(sub, step=step))
            if ok:
                self.log_step(step, written)

        if len(per_shard) <= 1:
            for sub in per_shard.values():
                write(sub)
            return
        futures = [self._pool.submit(write, sub) for sub in per_shard.values()]
        for f in futures:
            f.result()

    # -- recovery -------------------------------------------------------------------------------
    def recover(self, failed: list[int], step: int, phase: str) -> int | None:
        """Restore ``failed`` shards (all trainers call this together). ``full``: returns the step
        the trainers must roll back to; otherwise None (the interrupted step resumes)."""
        rollback = -1
        records = []
        if not self.shards:
            s = failed[0]
            raise RecoveryError(
                f"shard {s} at {self.store.endpoint(s)} failed; restarting and restoring a shard needs shards "
                "this project started (--redis local): bring that Redis back and resume the run"
            )
        if self.rank == 0:
            if self.strategy == "full":
                rollback, records = self._recover_full(failed, step)
            else:
                records = [self._recover_one(s, step) for s in failed]
        rollback = self.collective.broadcast_int(rollback)
        self.collective.barrier()
        for s in range(self.store.num_shards) if self.strategy == "full" else failed:
            self.store.reconnect(s)  # connections to the old processes are dead
        self.drain()
        done = time.time()
        for r in records:
            r["recovery_s"] = round(done - r.pop("_detected_at"), 4)
            r["phase"] = phase
            self.failures.append(r)
        for s in failed:
            self._detected.pop(s, None)
        if self.strategy == "full":
            self.counter.total = self.counter.at_step.get(rollback, np.zeros_like(self.counter.total)).copy()
            return rollback
        return None

    def _kill(self, spec: ShardSpec) -> None:
        pid = read_pid(spec.pidfile)
        if pid is not None:
            kill_and_wait(pid)

    def _checkpoint_for(self, shards: list[int], record: dict) -> Checkpoint | None:
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()  # a checkpoint in flight finishes (or is abandoned) before a restore
        if self.injector is not None:
            self.injector.before_restore(lambda: self.latest_shard_file(shards[0]))

        def report(e: CorruptCheckpointError) -> None:
            record.setdefault("corrupt_checkpoints", []).append(str(e))

        try:
            return self.checkpointer.latest_verified(lambda c: [f"shard{s}.rdb" for s in shards], report)
        except NoCheckpointError:
            return None

    def latest_shard_file(self, shard: int) -> Path | None:
        if self.checkpointer is None:
            return None
        cands = self.checkpointer.candidates()
        return cands[0].shard_file(shard) if cands else None

    def _restore_shard(self, spec: ShardSpec, ckpt: Checkpoint | None) -> int:
        """Kill whatever runs for the shard and start a replacement holding the checkpoint's rows."""
        self._kill(spec)
        spec.rdb_path.unlink(missing_ok=True)
        restored = 0
        if ckpt is not None:
            src = ckpt.shard_file(spec.index)
            shutil.copyfile(src, spec.rdb_path)
            restored = src.stat().st_size
        spawn_shard(spec, die_with_parent=False)
        return restored

    def _base_record(self, kind_target: tuple[str, int], step: int) -> dict:
        kind, target = kind_target
        detected = self._detected.get(target, time.time())
        fired = self.injector.fired_at.get(target) if self.injector is not None else None
        return {
            "kind": kind,
            "target": target,
            "step": step,
            "strategy": self.strategy,
            "detected_after_s": round(detected - fired, 4) if fired is not None else 0.0,
            "_detected_at": detected,
        }

    def _kind(self, shard: int) -> str:
        if self.injector is not None:
            for inj in self.injector.injections:
                if inj.target == shard and inj.kind in ("shard", "stall") and inj in self.injector._done:
                    return inj.kind
        return "shard"

    def _recover_one(self, shard: int, step: int) -> dict:
        spec = self.shards[shard]
        rec = self._base_record((self._kind(shard), shard), step)
        ckpt = self._checkpoint_for([shard], rec)
        base_step = ckpt.step if ckpt is not None else 0
        rec["restored_from_step"] = base_step if ckpt is not None else None
        rec["restored_bytes"] = self._restore_shard(spec, ckpt)
        since = self.counter.since(base_step)
        if self.strategy == "log":
            replayed = self._replay(shard, base_step)
            rec["restored_bytes"] += replayed
            rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        else:
            saved = 0
            if self.priority is not None:  # partial-mfu / partial-ssu: overlay the newest priority save
                nbytes, saved = self.priority.overlay(shard, base_step)
                rec["restored_bytes"] += nbytes
                rec["saved_updates"] = saved
            lost_here = int(self.counter.total[shard] - max(self._base_total(base_step)[shard], self._lost_base[shard]))
            completed = step - 1  # the interrupted step resumes on the restored shard
            samples_since = max(0, completed - base_step) * self.batch_size
            rec["lost_updates"] = max(lost_here - saved, 0)
            lost_share = max(int(since[shard]) - saved, 0)
            rec["lost_samples"] = round(lost_samples(samples_since, lost_share, int(since.sum())), 3)
            self.lost.append(rec["lost_samples"])
        self._lost_base[shard] = self.counter.total[shard]
        return rec

    def _base_total(self, step: int) -> np.ndarray:
        return self.counter.at_step.get(step, np.zeros_like(self.counter.total))

    def _replay(self, shard: int, after_step: int) -> int:
        """Write the shard's logged rows of steps after ``after_step`` back, in log order."""
        log = self.logs.get(shard) or ShardLog(self._log_dir(), shard)
        replayed = 0
        by_step: dict[int, list] = {}
        for r in log.records(after_step):
            by_step.setdefault(r.step, []).append((r.table, r.ids, r.rows))
        for s in sorted(by_step):
            self.store.write_shard(shard, by_step[s], step=s)
            replayed += sum(ids.nbytes + rows.nbytes for _, ids, rows in by_step[s])
        return replayed

    def _log_dir(self) -> Path:
        if not self.logs:
            raise RecoveryError("log recovery needs --log-dir")
        return next(iter(self.logs.values())).dir.parent

    def _recover_full(self, failed: list[int], step: int) -> tuple[int, list[dict]]:
        rec = self._base_record(("shard", failed[0]), step)
        rec["kind"] = self._kind(failed[0])
        rec["failed_shards"] = failed
        ckpt = self._checkpoint_for(list(range(self.store.num_shards)), rec)
        if ckpt is None:
            raise RecoveryError("full recovery needs a checkpoint (--checkpoint-every K)")
        ckpt.verify()  # dense files too
        rec["restored_from_step"] = ckpt.step
        rec["restored_bytes"] = sum(self._restore_shard(spec, ckpt) for spec in self.shards)
        rec["lost_updates"], rec["lost_samples"] = 0, 0.0
        rec["recomputed_steps"] = step - 1 - ckpt.step
        return ckpt.step, [rec]

    # -- persistence across trainer restarts ------------------------------------------------------
    def state(self) -> dict:
        return {
            "counter": self.counter.state(),
            "lost": list(self.lost),
            "lost_base": self._lost_base.tolist(),
            "failures": [dict(f) for f in self.failures],
        }

    def load_state(self, state: dict) -> None:
        self.counter.load(state["counter"])
        self.lost = list(state["lost"])
        self._lost_base = np.array(state["lost_base"], dtype=np.int64)
        self.failures = [dict(f) for f in state["failures"]]


class NoRecovery:
    """The local baseline has no shards: store calls cannot fail, and nothing is recovered."""

    failures: list[dict] = []
    lost: list[float] = []
    logs: dict = {}
    checkpointer = None
    priority = None

    def guard(self, fn):
        return True, fn()

    def sync(self) -> list[int]:
        return []

    def count_updates(self, updated) -> None:
        pass

    def on_checkpoint(self, step: int) -> None:
        pass

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass

    def close(self) -> None:
        pass
