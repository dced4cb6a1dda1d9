"""Run outputs: config.toml, metrics.jsonl, summary.json, plots/training.png, embedding digest."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from recovery.durable import layout
from recovery.durable.files import name_path, write_atomic
from recsys.config import ConfigError, RunConfig
from recsys.errors import release_space


def embedding_digest(tables: Iterable[tuple[str, Iterable[np.ndarray]]]) -> str:
    """SHA-256 over every row of every table in (table, row id) order.

    ``tables`` yields (name, blocks of consecutive rows from row 0) with each block
    ``[n, dim + state]`` float32 (weights, then optimizer state).
    """
    h = hashlib.sha256()
    for name, blocks in tables:
        h.update(name.encode() + b"\0")
        for block in blocks:
            h.update(np.ascontiguousarray(block, dtype="<f4").tobytes())
    return h.hexdigest()


class TensorBoardEvents:
    """The run's metrics and failures as TensorBoard events (torch's ``SummaryWriter``): every
    numeric field of a metrics line as a scalar at its step; each failure as scalars under
    ``failures/`` (recovery seconds, lost updates and samples, restored bytes) at its step and one
    text record; the summary's figures as text at the end."""

    def __init__(self, folder: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ConfigError(
                f"--tensorboard: the tensorboard package is not installed ({e}); pip install .[tensorboard]"
            ) from None
        self.writer = SummaryWriter(log_dir=str(folder))

    def log(self, record: dict) -> None:
        step = record.get("step")
        for k, v in record.items():
            if k != "step" and isinstance(v, int | float) and not isinstance(v, bool):
                self.writer.add_scalar(f"train/{k}", v, step)
        self.writer.flush()

    def finish(self, summary: dict) -> None:
        for f in summary.get("failures", []):
            step = f.get("step")
            for k in ("recovery_s", "lost_updates", "lost_samples", "restored_bytes"):
                if isinstance(f.get(k), int | float):
                    self.writer.add_scalar(f"failures/{k}", f[k], step)
            self.writer.add_text("failures", f"`{json.dumps(f)}`", step)
        figures = {k: v for k, v in summary.items() if isinstance(v, int | float | str) and not isinstance(v, bool)}
        self.writer.add_text("summary", "\n".join(f"- {k}: {v}" for k, v in figures.items()), summary.get("steps"))
        self.writer.close()


def recorded(cfg: RunConfig) -> RunConfig:
    """``cfg`` as ``config.toml`` records it: its folders absolute, so that a command reading the run
    later knows which lay inside the run folder (``recsys.results.rundir.run_config`` takes those where the
    folder lies then) and which outside it, wherever it is started from."""
    import dataclasses
    import os

    rc = cfg.recovery
    dirs = {k: os.path.abspath(v) for k, v in (("checkpoint_dir", rc.checkpoint_dir), ("log_dir", rc.log_dir)) if v}
    return dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train, out=os.path.abspath(cfg.train.out)),
        recovery=dataclasses.replace(rc, **dirs),
    )


class RunOutputs:
    """Writer of a run directory (rank 0 only)."""

    def __init__(self, cfg: RunConfig, append: bool = False) -> None:
        self.dir = Path(cfg.train.out)
        layout.plots_dir(self.dir).mkdir(parents=True, exist_ok=True)
        write_atomic(layout.config_file(self.dir), recorded(cfg).to_toml())
        path = layout.metrics_file(self.dir)
        # a restarted trainer group continues the run's metrics
        self.records: list[dict] = (
            [json.loads(line) for line in path.read_text().splitlines()] if append and path.exists() else []
        )
        self._metrics = open(path, "a" if append else "w")
        self.events = TensorBoardEvents(layout.tensorboard_dir(self.dir)) if cfg.train.tensorboard else None

    def log(self, record: dict) -> None:
        self.records.append(record)
        if self.events is not None:
            self.events.log(record)
        try:
            self._metrics.write(json.dumps(record) + "\n")
            self._metrics.flush()
        except OSError as e:  # a failed write (ENOSPC) names no file
            name_path(e, self._metrics.name)
            raise

    def finish(self, summary: dict) -> None:
        self._metrics.close()
        if self.events is not None:
            self.events.finish(summary)
        write_atomic(layout.summary_file(self.dir), json.dumps(summary, indent=2) + "\n")
        release_space(self.dir)  # the run ended well: no traceback to keep room for
        plot_training(self.records, summary, layout.training_plot(self.dir))


class NullOutputs:
    """What ranks other than 0 write: nothing."""

    records: list[dict] = []

    def log(self, record: dict) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


def plot_training(records: list[dict], summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_auc) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    # fixed margins: tight_layout measured every label's extent (a fifth of the plot's time)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.08, top=0.93, hspace=0.08)
    steps = [r["step"] for r in records if "loss" in r]
    ax_loss.plot(steps, [r["loss"] for r in records if "loss" in r], lw=1, label="train loss (global batch)")
    ax_loss.set_ylabel("logloss")
    ev = [r for r in records if "auc" in r]
    ax_auc.plot([r["step"] for r in ev], [r["auc"] for r in ev], "o-", label="eval AUC")
    if summary.get("ceiling_auc") is not None:
        ax_auc.axhline(
            summary["ceiling_auc"], color="gray", ls="--", label=f"teacher ceiling {summary['ceiling_auc']:.4f}"
        )
    for i, f in enumerate(f for f in summary.get("failures", []) if f.get("step") is not None):
        for ax in (ax_loss, ax_auc):
            ax.axvline(
                f["step"], color="red", ls=":", label=f"{f['kind']} failure" if i == 0 and ax is ax_loss else None
            )
    ax_auc.set_xlabel("step")
    ax_auc.set_ylabel("AUC")
    for ax in (ax_loss, ax_auc):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    fig.suptitle(f"{summary.get('embeddings', '')} embeddings, {summary.get('trainers', '')} trainer(s)")
    fig.savefig(path, dpi=100)
    plt.close(fig)
