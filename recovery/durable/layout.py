"""Every file and folder name of a run, and the paths built from them: no other module spells them.

The output folder ``{out}`` (``--out``)::

    config.toml                  CONFIG            the run's settings (what --resume starts from)
    run.json                     RUN_FILE          the run's namespace and id
    run.lock                     LOCK_FILE         flock'ed by the process that writes the folder
    metrics.jsonl                METRICS           a line per logged step
    summary.json                 SUMMARY           written once, last: its presence marks the end
    plots/training.png           training_plot()
    final_model.pt               FINAL_MODEL       with --save-model
    final/step_{step:010d}/      final_dir()       the trained model: every shard's final snapshot and the
                                                   dense state, a checkpoint of the format below (unless
                                                   --no-keep-model); recsys export and verify read it
    recovery.log                 JOURNAL           the recovery journal: what was done, when
    failures.jsonl               FAILURES          a record per failure, as each recovery ends
    trainer_failures.jsonl       TRAINER_FAILURES  a line per trainer death
    recovery_in_progress.json    IN_RECOVERY       shards whose restore a dead trainer may have left half-done
    journal_run.json             JOURNAL_RUN       the run these journal files are of (its id)
    injections.jsonl             INJECTIONS        the injections fired, and the run's time origin
    errors/{who}.log, .json      error_traceback(), error_record()
    checkpoints/                 the checkpoint folder unless --checkpoint-dir
    logs/                        the log folder unless --log-dir (--recovery log)

The checkpoint folder ``{ckpt}``::

    step_{step:010d}/            step_dir(): one checkpoint
        shard{S}.rdb             shard_snapshot(): shard S's Redis snapshot
        dense/                   dense_dcp_dir(): model and optimizer (torch.distributed.checkpoint)
        meta.json                META: step, readers' positions, accounting
        manifest.json            MANIFEST: SHA-256 per file, written last
    dense_latest.pt              dense_latest(): the per-step dense state
    priority/                    priority_dir(): the priority-save folder
    incremental/                 flush_dir(): the flush folder

The log folder ``{logs}``: ``shard{S}/seg_{first_step:010d}.log`` (``log_segment``). The
priority-save folder: ``shard{S}.bin`` (``priority_save``). The flush folder:
``shard{S}/flush_{step:010d}.bin`` (``flush_file``). A bench's folder: ``schedule.json``.

Functions take a folder (``str`` or path) and return a ``Path``; nothing here touches the disk but
the ``glob`` of the listing functions. Only the standard library: any module may import this.
"""

from __future__ import annotations

import os
from pathlib import Path

Folder = str | os.PathLike

# -- the output folder ------------------------------------------------------------------------------
CONFIG = "config.toml"
"""The run's settings; ``--resume`` starts from them."""
RUN_FILE = "run.json"
"""The run's namespace and id: what ``--resume`` needs besides ``config.toml``."""
LOCK_FILE = "run.lock"
"""``flock``'ed by the process that writes the run folder."""
METRICS = "metrics.jsonl"
"""A line per logged step (loss, evaluations, saves)."""
SUMMARY = "summary.json"
"""Written once, atomically, when the run finished: its presence marks the end."""
PLOTS = "plots"
TRAINING_PLOT = "training.png"
FINAL_MODEL = "final_model.pt"
"""The dense state and every embedding row (``--save-model``)."""
FINAL = "final"
"""The run's trained model as it ended: one checkpoint folder ``step_{steps:010d}/`` (every shard's
snapshot, the dense state, the manifest), written at the end unless ``--no-keep-model``."""
JOURNAL = "recovery.log"
"""The run's recovery journal: a line per thing recovery did, when."""
FAILURES = "failures.jsonl"
"""The run's failure records, appended by rank 0 as each recovery ends."""
TRAINER_FAILURES = "trainer_failures.jsonl"
"""A line per trainer death (injector, launcher)."""
IN_RECOVERY = "recovery_in_progress.json"
"""Shards whose restore a dead trainer may have left half-done."""
JOURNAL_RUN = "journal_run.json"
"""The run (its id, ``run.json``'s) whose fresh start began the journal files beside it."""
INJECTIONS = "injections.jsonl"
"""Injections fired (each fires once per run), and the run's time origin."""
ERRORS = "errors"
"""``{who}.log`` (a traceback) and ``{who}.json`` (its line) per process that failed."""
CHECKPOINTS = "checkpoints"
"""The checkpoint folder in the output folder, unless the run names another."""
LOGS = "logs"
"""The log folder in the output folder, unless the run names another."""
SCHEDULE = "schedule.json"
TENSORBOARD = "tensorboard"
"""A bench's failure schedule(s), in the bench's output folder."""


def config_file(out: Folder) -> Path:
    """``{out}/config.toml``."""
    return Path(out) / CONFIG


def run_file(out: Folder) -> Path:
    """``{out}/run.json``."""
    return Path(out) / RUN_FILE


def run_id(out: Folder) -> str | None:
    """The run's id in ``{out}/run.json`` (written by its launch); None where there is none."""
    import json

    try:
        return json.loads(run_file(out).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def lock_file(out: Folder) -> Path:
    """``{out}/run.lock``."""
    return Path(out) / LOCK_FILE


def metrics_file(out: Folder) -> Path:
    """``{out}/metrics.jsonl``."""
    return Path(out) / METRICS


def summary_file(out: Folder) -> Path:
    """``{out}/summary.json``."""
    return Path(out) / SUMMARY


def plots_dir(out: Folder) -> Path:
    """``{out}/plots``."""
    return Path(out) / PLOTS


def training_plot(out: Folder) -> Path:
    """``{out}/plots/training.png``."""
    return plots_dir(out) / TRAINING_PLOT


def final_model_file(out: Folder) -> Path:
    """``{out}/final_model.pt``."""
    return Path(out) / FINAL_MODEL


def final_dir(out: Folder) -> Path:
    """``{out}/final``: the folder of the run's final model (a checkpoint folder: ``step_dir`` inside)."""
    return Path(out) / FINAL


def journal_file(out: Folder) -> Path:
    """``{out}/recovery.log``."""
    return Path(out) / JOURNAL


def failures_file(out: Folder) -> Path:
    """``{out}/failures.jsonl``."""
    return Path(out) / FAILURES


def trainer_failures_file(out: Folder) -> Path:
    """``{out}/trainer_failures.jsonl``."""
    return Path(out) / TRAINER_FAILURES


def journal_run_file(out: Folder) -> Path:
    """``{out}/journal_run.json``."""
    return Path(out) / JOURNAL_RUN


def began_before(out: Folder) -> bool:
    """Whether this run (``run.json``'s id) made a fresh start in ``out`` already: a group of it dead
    before its first restart point starts again from scratch as the same run (``journal_run.json``
    names the run whose first fresh start wrote it; ``recovery.journal.Journal.clear``)."""
    import json

    rid = run_id(out)
    try:
        return rid is not None and json.loads(journal_run_file(out).read_text()).get("run_id") == rid
    except (OSError, ValueError, AttributeError):
        return False


def in_recovery_file(out: Folder) -> Path:
    """``{out}/recovery_in_progress.json``."""
    return Path(out) / IN_RECOVERY


def kept_updates_file(out: Folder, shard: int) -> Path:
    """``{out}/kept_updates_shard{S}``: shard S is away (``--train-through``) and its writer keeps
    updates for rows it did not cache, which no log holds until the shard rejoins."""
    return Path(out) / f"kept_updates_shard{shard}"


def outage_file(out: Folder, shard: int) -> Path:
    """``{out}/outage_shard{S}.json``: shard S is away (``--train-through``): the outage so far (its
    step, the steps trained through, rows read, updates applied), rewritten by its writer at every
    step's start; a restart that cuts the outage short makes its record from it."""
    return Path(out) / f"outage_shard{shard}.json"


def injections_file(out: Folder) -> Path:
    """``{out}/injections.jsonl``."""
    return Path(out) / INJECTIONS


def errors_dir(out: Folder) -> Path:
    """``{out}/errors``."""
    return Path(out) / ERRORS


def error_traceback(out: Folder, who: str) -> Path:
    """``{out}/errors/{who}.log``: the traceback of process ``who``."""
    return errors_dir(out) / f"{who}.log"


def error_record(out: Folder, who: str) -> Path:
    """``{out}/errors/{who}.json``: its line, type and pid."""
    return errors_dir(out) / f"{who}.json"


def error_records(out: Folder) -> list[Path]:
    """Every ``{out}/errors/*.json``, by name (``Path.stem`` is the process)."""
    return sorted(errors_dir(out).glob("*.json"))


def default_checkpoint_dir(out: Folder) -> Path:
    """``{out}/checkpoints``: the checkpoint folder unless the run names one."""
    return Path(out) / CHECKPOINTS


def default_log_dir(out: Folder) -> Path:
    """``{out}/logs``: the log folder unless the run names one."""
    return Path(out) / LOGS


def tensorboard_dir(out: Folder) -> Path:
    """``{out}/tensorboard``: the run's TensorBoard events (``--tensorboard``)."""
    return Path(out) / TENSORBOARD


def schedule_file(out: Folder) -> Path:
    """``{out}/schedule.json`` of a bench."""
    return Path(out) / SCHEDULE


# -- the checkpoint folder --------------------------------------------------------------------------
META = "meta.json"
"""In a checkpoint: step, readers' positions, accounting."""
MANIFEST = "manifest.json"
"""In a checkpoint, written last and atomically: SHA-256 per file. A folder without one is no checkpoint."""
DENSE_DCP = "dense"
"""In a checkpoint: the model and optimizer (``torch.distributed.checkpoint``)."""
DENSE_LATEST = "dense_latest.pt"
"""The per-step dense state, beside the checkpoints."""
PRIORITY = "priority"
"""The priority-save folder, in the checkpoint folder."""
FLUSHES = "incremental"
"""The flush folder, in the checkpoint folder."""


def step_dir(ckpt_dir: Folder, step: int) -> Path:
    """``{ckpt_dir}/step_{step:010d}``: the checkpoint of ``step``."""
    return Path(ckpt_dir) / f"step_{step:010d}"


def step_dirs(ckpt_dir: Folder) -> list[Path]:
    """Every ``step_*`` folder in ``ckpt_dir``, oldest first (checkpoints or not: see its manifest)."""
    return sorted(Path(ckpt_dir).glob("step_*"))


def shard_snapshot_name(shard: int) -> str:
    """``shard{S}.rdb``: shard S's snapshot, by its name in a checkpoint (and its manifest)."""
    return f"shard{shard}.rdb"


def shard_snapshot(step_path: Folder, shard: int) -> Path:
    """``{step_path}/shard{S}.rdb``: shard S's snapshot in the checkpoint folder ``step_path``."""
    return Path(step_path) / shard_snapshot_name(shard)


def dense_dcp_dir(step_path: Folder) -> Path:
    """``{step_path}/dense``: the checkpoint's dense state (DCP)."""
    return Path(step_path) / DENSE_DCP


def meta_file(step_path: Folder) -> Path:
    """``{step_path}/meta.json``."""
    return Path(step_path) / META


def manifest_file(step_path: Folder) -> Path:
    """``{step_path}/manifest.json``."""
    return Path(step_path) / MANIFEST


def dense_latest(ckpt_dir: Folder) -> Path:
    """``{ckpt_dir}/dense_latest.pt``: the per-step dense state."""
    return Path(ckpt_dir) / DENSE_LATEST


def priority_dir(ckpt_dir: Folder) -> Path:
    """``{ckpt_dir}/priority``: the priority-save folder."""
    return Path(ckpt_dir) / PRIORITY


def flush_dir(ckpt_dir: Folder) -> Path:
    """``{ckpt_dir}/incremental``: the flush folder."""
    return Path(ckpt_dir) / FLUSHES


# -- the priority-save folder -----------------------------------------------------------------------
def priority_save(save_dir: Folder, shard: int) -> Path:
    """``{save_dir}/shard{S}.bin``: the newest priority save of shard S."""
    return Path(save_dir) / f"shard{shard}.bin"


def priority_saves(save_dir: Folder) -> list[Path]:
    """Every shard's priority save in ``save_dir``, by name."""
    return sorted(Path(save_dir).glob("shard*.bin"))


# -- the flush folder -------------------------------------------------------------------------------
def flush_shard_dir(flush_path: Folder, shard: int) -> Path:
    """``{flush_path}/shard{S}``: shard S's flushes."""
    return Path(flush_path) / f"shard{shard}"


def flush_file(flush_path: Folder, shard: int, step: int) -> Path:
    """``{flush_path}/shard{S}/flush_{step:010d}.bin``: shard S's flush at ``step``."""
    return flush_shard_dir(flush_path, shard) / f"flush_{step:010d}.bin"


def flush_files(flush_path: Folder, shard: int) -> list[Path]:
    """Every flush of shard S, oldest first."""
    return sorted(flush_shard_dir(flush_path, shard).glob("flush_*.bin"))


def flush_step(path: Folder) -> int:
    """The step of a flush file (``flush_file``)."""
    return int(Path(path).stem.split("_")[1])


# -- the log folder ---------------------------------------------------------------------------------
def log_shard_dir(log_dir: Folder, shard: int) -> Path:
    """``{log_dir}/shard{S}``: shard S's update log."""
    return Path(log_dir) / f"shard{shard}"


def log_segment(log_dir: Folder, shard: int, first_step: int) -> Path:
    """``{log_dir}/shard{S}/seg_{first_step:010d}.log``: shard S's updates from ``first_step`` on."""
    return log_shard_dir(log_dir, shard) / f"seg_{first_step:010d}.log"


def log_segments(log_dir: Folder, shard: int | None = None) -> list[Path]:
    """Shard S's segments, oldest first; with ``shard`` None, every segment of every shard (sorted)."""
    if shard is None:
        return sorted(Path(log_dir).glob("shard*/seg_*.log"))
    return sorted(log_shard_dir(log_dir, shard).glob("seg_*.log"))


def segment_first_step(path: Folder) -> int:
    """The first step a segment holds (``log_segment``)."""
    return int(Path(path).stem.split("_")[1])
