"""The run's summary (``summary.json``): rank 0's account of a finished run, built from what the
trainer hands it (``run_summary``); the keys are documented in ``docs/architecture.md``."""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from recovery.accounting import pls
from recsys.clock import Collectives, usable_cores


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB: ``VmHWM`` of its address space (Linux). Not
    ``ru_maxrss``, which Linux carries across fork and exec: a process started by a large one would
    report its parent's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


if TYPE_CHECKING:
    from embeddings.store.base import StoreCounters
    from recovery.durable.manifest import SaveStats
    from recsys.clock import StepClock
    from recsys.config import RunConfig
    from recsys.schedule import Schedule


@dataclass
class SaveTotals:
    """What the run's background writers and held-row reloads came to (``Trainer.finish``): bytes
    and row counts summed over the trainers, seconds of the slowest trainer, except the log's
    behind and background seconds (this trainer's)."""

    log_bytes: float
    log_seconds: float
    log_behind_seconds: float
    log_background_seconds: float
    priority_bytes: float
    flush_bytes: float
    held_reload_s: float  # held rows read back after their shard was restored
    held_rows_after_restores: dict[str, int]  # kept (held again), absent (known never written), read


def save_totals(coll, bg, store) -> SaveTotals:
    """``SaveTotals`` over the trainers (two collectives of ``coll``, every trainer alike): ``bg``,
    this trainer's background writers once waited for (``Recovery.wait_background``); ``store``,
    its Redis store (None where the rows live in the trainer: nothing held, nothing restored)."""
    # every trainer writes its own shards' logs: bytes add up; the time is the slowest trainer's
    # bytes every trainer wrote (logs, priority saves, flushes), summed in one collective
    reloads = (store.reload_kept, store.reload_absent, store.reload_read) if store is not None else (0, 0, 0)
    # the rows of restored shards its writers held: held again, known absent, read back
    saved = coll.sum_floats(np.array([bg.log_bytes, bg.priority_bytes, bg.flush_bytes, *reloads], dtype=np.float64))
    reload_s = store.reload_s if store is not None else 0.0  # held rows read back after restores
    log_us, reload_us = coll.max_flags(np.array([int(1e6 * bg.log_s), int(1e6 * reload_s)], dtype=np.int64))
    return SaveTotals(
        log_bytes=saved[0],
        log_seconds=log_us / 1e6,
        log_behind_seconds=bg.log_behind_s,
        log_background_seconds=bg.log_background_s,
        priority_bytes=saved[1],
        flush_bytes=saved[2],
        held_reload_s=reload_us / 1e6,
        held_rows_after_restores={k: int(v) for k, v in zip(("kept", "absent", "read"), saved[3:], strict=True)},
    )


def after_warmup(warm: tuple[int, float] | None, steps: int, batch_size: int, end: float) -> float | None:
    """Samples/s of the steps after the first ``recsys.clock.WARMUP_STEPS`` of this process (first-step
    allocations, thread starts, the first reads of each row): how a reference engine timed after
    the same warm-up compares. ``warm``: (step, ``perf_counter``) at the end of the warm-up;
    ``end``: ``perf_counter`` when training ended. None when the run had no steps after them."""
    if warm is None or steps <= warm[0]:
        return None
    seconds = end - warm[1]
    return round((steps - warm[0]) * batch_size / seconds, 1) if seconds > 0 else None


def run_summary(
    cfg: RunConfig,
    *,
    world_size: int,
    num_shards: int,
    torch_threads: int,
    t_setup: float,
    t0: float,
    wall: float,
    wall_before: float = 0.0,
    warm: tuple[int, float] | None,
    final: dict,
    digest: str | None,
    ceiling_auc: float | None,
    failures: list[dict],
    lost: list[float],
    injected: list[dict],
    not_fired: list[str],
    checkpoints: list[SaveStats],
    saves: SaveTotals,
    store: StoreCounters | None,
    write_every: int,
    schedule: Schedule,
    priority_pauses: list[float],
    flush_pauses: list[float],
    clock: StepClock,
    dense_saves: int,
    dense_save_seconds: float,
    backend_stats: dict,
) -> dict:
    """The summary of a run of ``cfg.train.steps`` steps that trained from ``t0`` for ``wall``
    seconds after a setup that began at ``t_setup`` (``perf_counter`` times), ``wall_before``
    seconds of it before this process (restarts: the whole run's wall time is the figure). ``final``: the final
    evaluation; ``failures``, ``lost``: rank 0's failure records and samples lost per partial
    recovery; ``injected``: the injections that fired; ``store``: None where the rows live in
    this process."""
    steps, G = cfg.train.steps, cfg.train.batch_size
    # --dense-reduce allreduce under replace: a dead trainer's chunk skipped until it rejoined
    skipped = sum(int(f.get("samples_lost") or 0) for f in failures if f.get("strategy") == "replace")
    trained = steps * G - skipped
    return {
        "steps_completed": steps,
        "samples_trained": trained,
        # the whole run, restarts included: a run with a failure never reads faster than without
        "wall_seconds": round(wall + wall_before, 3),
        "wall_seconds_before_restart": round(wall_before, 3),
        "setup_seconds": round(t0 - t_setup, 3),
        "throughput_samples_per_s": round(trained / (wall + wall_before), 1),
        "throughput_after_warmup_samples_per_s": after_warmup(warm, steps, G, t0 + wall),
        "final_auc": final["auc"],
        "final_logloss": final["logloss"],
        "final_ne": final["ne"],
        "ceiling_auc": ceiling_auc,
        "failures": failures,
        "injected": [{k: r[k] for k in ("spec", "step", "t")} for r in injected],
        "injections_not_fired": not_fired,
        "pls": pls([*lost, skipped], steps * G),  # rank 0's losses: every partial recovery, every chunk skipped
        # what training through relaxed: rows read at a stale value, updates applied on a later value
        "rows_read_stale": sum(int(f.get("rows_read_fallback") or 0) for f in failures),
        "updates_applied_late": sum(int(f.get("updates_applied_late") or 0) for f in failures),
        "embedding_digest": digest,
        "embeddings": cfg.embeddings.embeddings,
        "trainers": world_size,
        "torch_threads": torch_threads,
        "trainer_cores": usable_cores(),  # trainer 0's: its own share with 2+ trainers (--no-pin-trainers: all)
        "shards": num_shards,
        "recovery": cfg.recovery.recovery,
        "log_fsync": cfg.recovery.log_fsync if cfg.log_dir else None,
        **save_figures(checkpoints, saves, store, write_every, schedule, priority_pauses, flush_pauses),
        "step_ms": clock.per_step_ms(steps),
        # after the warm-up: the training thread on a CPU, runnable but off one, blocked
        "training_thread_ms": clock.thread_ms(),
        # after the warm-up, ms on a CPU a step: this trainer's threads by kind, and every local server
        "cpu_ms": clock.cpu_ms(),
        # rank 0's time in the trainers' collectives (within the parts above), ms and calls a step
        "collectives_ms": Collectives.per_step(steps) if world_size > 1 else None,
        "dense_saves": dense_saves,
        "dense_save_seconds": round(dense_save_seconds, 4),
        **backend_stats,
    }


def save_figures(
    checkpoints: list[SaveStats],
    saves: SaveTotals,
    store: StoreCounters | None,
    write_every: int,
    schedule: Schedule,
    priority_pauses: list[float],
    flush_pauses: list[float],
) -> dict:
    """``run_summary``'s figures of what the run saved and wrote: checkpoints, logs, row writes, the
    row cache, priority saves and flushes."""
    return {
        "checkpoints": [
            {
                "step": s.step,
                "pause_s": round(s.pause_s, 4),
                "total_s": round(s.total_s, 4),
                "bytes": s.bytes,
                **({"abandoned": s.abandoned} if s.abandoned else {}),
            }
            for s in checkpoints
        ],
        "log_bytes": int(saves.log_bytes),
        "log_seconds": round(float(saves.log_seconds), 4),
        "log_behind_seconds": round(saves.log_behind_seconds, 4),
        "log_background_seconds": round(saves.log_background_seconds, 4),
        "behind_wait_s": round(store.behind_wait_s if store is not None else 0.0, 4),
        # this trainer's: rows its steps' writes put on the shards (a window writes each row once)
        "rows_written": store.rows_written if store is not None else None,
        "write_every": write_every,
        "held_reload_s": round(saves.held_reload_s, 4),
        "held_rows_after_restores": saves.held_rows_after_restores,
        # rank 0's row cache: slots, rows of the tables it caches, reads served, rows evicted, slots
        # added beyond the budget for an open window
        "row_cache": None if store is None else store.row_cache_stats(),
        # several trainers, rank 0's: the rows of the shards other trainers write, kept current by
        # each step's summed gradients (``RowCache.hold_peer_rows``); None: none kept
        "peer_rows": None if store is None or store.peer_rows is None else store.peer_rows.stats(),
        # rank 0's listing of the rows on its shards when it last resumed (``embeddings.store.present``)
        "rows_listed_at_resume": None if store is None else store.present_stats(),
        "max_rss_mb": peak_rss_mb(),
        "checkpoint_every": schedule.every,
        "checkpoint_plan": schedule.plan,
        "priority_saves": len(priority_pauses),
        "priority_pause_s": round(sum(priority_pauses), 4),
        "priority_bytes": int(saves.priority_bytes),
        "flushes": len(flush_pauses),
        "flush_pause_s": round(sum(flush_pauses), 4),
        "flush_bytes": int(saves.flush_bytes),
    }
