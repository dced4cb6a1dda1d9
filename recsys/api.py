"""The Python API: configure, train, benchmark recovery, read runs back and compare them.

Everything the CLI does goes through here (``python -m recsys train`` is ``train(configure(...))``)::

    import recsys

    cfg = recsys.configure(steps=200, shards=2, recovery="partial", checkpoint_every=50,
                        inject=["shard:1@step=120"], out="runs/example")
    run = recsys.train(cfg)                 # a Run: its folder, config, typed Summary, metrics
    run.summary.final_auc, run.summary.pls, run.summary.failures[0].lost_updates
    recsys.load_run("runs/example")          # the same Run, read back from its folder
    recsys.compare(["runs/a", "runs/b"], out="runs/a-vs-b")   # table and plot side by side

Config keys are the fields of the TOML sections (``[data]``, ``[model]``, ``[embeddings]``,
``[optim]``, ``[train]``, ``[recovery]``), given flat: each name belongs to one section.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recovery.durable import layout
from recsys.config import ConfigError, RunConfig


def _sections() -> dict[str, str]:
    """Flat config key -> its section."""
    out = {}
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(section.default_factory()):
            out[f.name] = section.name
    return out


def configure(toml: str | Path | None = None, base: RunConfig | None = None, **overrides: Any) -> RunConfig:
    """A run's configuration: defaults, or a TOML file (or ``base``), with ``overrides`` on top.

    ``configure("run.toml", steps=500, recovery="log")``. An unknown key is refused by name."""
    cfg = base if base is not None else RunConfig.from_toml(toml) if toml is not None else RunConfig()
    if not overrides:
        return cfg
    where = _sections()
    d = cfg.to_dict()
    for key, value in overrides.items():
        section = where.get(key)
        if section is None:
            near = difflib.get_close_matches(key.replace("-", "_"), list(where), n=3)
            hint = f"; did you mean {', '.join(near)}?" if near else ""
            raise ConfigError(f"config key {key!r} is not a setting of any section{hint}")
        d[section][key] = value
    return RunConfig.from_dict(d, source="recsys.configure()")


@dataclass(frozen=True)
class Failure:
    """One failure the run went through and what it cost."""

    kind: str
    target: int
    step: int | None
    strategy: str
    detected_after_s: float
    failed_call_s: float
    recovery_s: float
    phases_s: dict
    lost_updates: int
    lost_samples: float
    restored_from_step: int | None
    raw: dict = field(repr=False)
    trained_through_steps: int = 0
    """``--train-through``: steps completed while the shard was away."""
    waited_s: float = 0.0
    """Seconds every trainer waited for this failure: the whole recovery (from the failure) for a
    waiting strategy; under ``--train-through`` only where something made the run wait."""

    @classmethod
    def from_dict(cls, d: dict) -> Failure:
        return cls(
            kind=d.get("kind", ""),
            target=int(d.get("target", -1)),
            step=d.get("step"),
            strategy=d.get("strategy", ""),
            detected_after_s=float(d.get("detected_after_s", 0.0)),
            failed_call_s=float(d.get("failed_call_s", d.get("detected_after_s", 0.0))),
            recovery_s=float(d.get("recovery_s", 0.0)),
            phases_s=dict(d.get("phases_s", {})),
            lost_updates=int(d.get("lost_updates", 0)),
            lost_samples=float(d.get("lost_samples", 0.0)),
            restored_from_step=d.get("restored_from_step"),
            raw=d,
            trained_through_steps=int(d.get("trained_through_steps", 0)),
            waited_s=float(
                d["waited_s"] if "waited_s" in d else d.get("detected_after_s", 0.0) + d.get("recovery_s", 0.0)
            ),
        )


@dataclass(frozen=True)
class Summary:
    """A finished run's figures (``summary.json``); every field of the file stays in ``raw``."""

    steps: int
    samples: int
    wall_seconds: float
    throughput: float
    """samples per second"""
    final_auc: float
    final_logloss: float
    pls: float
    """portion of lost samples (partial recoveries)"""
    embedding_digest: str | None
    """SHA-256 over every row; None where the tables are over ``--digest-max-rows``"""
    recovery: str
    shards: int
    trainers: int
    failures: list[Failure]
    raw: dict = field(repr=False)

    @classmethod
    def from_dict(cls, d: dict) -> Summary:
        return cls(
            steps=int(d["steps_completed"]),
            samples=int(d["samples_trained"]),
            wall_seconds=float(d["wall_seconds"]),
            throughput=float(d["throughput_samples_per_s"]),
            final_auc=float(d["final_auc"]),
            final_logloss=float(d["final_logloss"]),
            pls=float(d.get("pls", 0.0)),
            embedding_digest=d.get("embedding_digest"),
            recovery=d.get("recovery", ""),
            shards=int(d.get("shards", 0)),
            trainers=int(d.get("trainers", 1)),
            failures=[Failure.from_dict(f) for f in d.get("failures", [])],
            raw=d,
        )

    @property
    def lost_updates(self) -> int:
        return sum(f.lost_updates for f in self.failures)


@dataclass
class Run:
    """A run folder: its config, its summary (None while unfinished) and its metrics."""

    path: Path
    config: RunConfig
    summary: Summary | None

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def metrics(self) -> list[dict]:
        """``metrics.jsonl``: a line per logged step (loss, evaluations, saves)."""
        p = layout.metrics_file(self.path)
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a kill
        return out

    @property
    def failures(self) -> list[Failure]:
        return self.summary.failures if self.summary is not None else []


def load_run(path: str | Path) -> Run:
    """Read a run folder back (what ``train`` wrote there)."""
    from recsys.results.rundir import run_config

    p = Path(path)
    if not layout.config_file(p).is_file():
        raise ConfigError(f"{p}: not a run folder (no {layout.CONFIG})")
    cfg = run_config(p)  # where the folder lies now
    summary = None
    if layout.summary_file(p).is_file():
        try:
            summary = Summary.from_dict(json.loads(layout.summary_file(p).read_text()))
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{layout.summary_file(p)}: damaged ({e})") from None
    return Run(p, cfg, summary)


def train(
    cfg: RunConfig | str | Path | None = None,
    *,
    resume: bool = False,
    take_over_namespace: bool = False,
    **overrides: Any,
) -> Run:
    """Train one run (start local shards when ``redis=local``, launch the trainers, clean up).

    ``cfg``: a RunConfig, a TOML path or None (defaults); ``overrides`` as for ``configure``.
    ``resume``: finish the run in ``cfg``'s folder that stopped (see ``--resume``).
    ``take_over_namespace``: the namespace's claim is another run's that is gone: its keys are
    deleted and the namespace claimed (see ``--take-over-namespace``).
    Returns the run; its ``summary`` is None on ranks other than 0 under torchrun."""
    import os

    from recsys.launch import run as launch_run

    if isinstance(cfg, RunConfig):
        cfg = configure(base=cfg, **overrides)
    else:
        cfg = configure(cfg, **overrides)
    under = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
    if under:  # the launcher sets the world, as for the CLI: every trainer sees the same trainers
        cfg = configure(base=cfg, trainers=int(os.environ["WORLD_SIZE"]))
    summary = launch_run(cfg, under_launcher=under, resume=resume, take_over_namespace=take_over_namespace)
    return Run(Path(cfg.train.out), cfg, Summary.from_dict(summary) if summary is not None else None)


def resume(run_dir: str | Path, *, take_over_namespace: bool = False, **overrides: Any) -> Run:
    """Finish a run that stopped (a shard that did not come back, Ctrl-C) from its folder.

    A finished run is refused (its results are kept), and so is an override of a setting the run
    must keep (``recsys.results.rundir.RESUME_MAY_CHANGE`` lists those that may change)."""
    from recsys.results.rundir import check_resume, resume_config

    base = resume_config(run_dir)
    cfg = configure(base=base, **overrides)
    check_resume(base, cfg, f"resume({str(run_dir)!r})", lambda key: key.split(".", 1)[1])
    return train(cfg, resume=True, take_over_namespace=take_over_namespace)


def bench_recovery(**options: Any) -> list[dict]:
    """``bench-recovery`` from Python: options are its flags (``steps=600``, ``sweep=True``,
    ``strategies="partial,log"``, ``out="runs/bench"``). Returns the table's rows."""
    import argparse

    from recsys.bench.recovery import add_arguments, run_bench

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    args = ap.parse_args([])
    for key, value in options.items():
        if key == "command":
            continue  # the CLI's sub-command
        if not hasattr(args, key):
            raise ConfigError(f"bench_recovery option {key!r} is not a flag of bench-recovery")
        setattr(args, key, value)
    if isinstance(args.scaling_sizes, str):
        args.scaling_sizes = args.scaling_sizes.split(",")
    return run_bench(args)


def compare(runs: list[str | Path | Run], out: str | Path | None = None) -> Path:
    """Runs side by side: ``compare.md`` (summary figures) and ``compare.png`` (loss and AUC
    curves on one plot, failures marked) in ``out`` (default: beside the first run). -> out."""
    from recsys.results.comparison import write_comparison

    loaded = [r if isinstance(r, Run) else load_run(r) for r in runs]
    if len(loaded) < 2:
        raise ConfigError(f"compare needs two runs or more, got {len(loaded)}")
    dest = Path(out) if out is not None else loaded[0].path.parent / "compare"
    write_comparison(loaded, dest)
    return dest


def export(
    run: str | Path | Run,
    to: str | Path,
    *,
    optimizer_state: bool = False,
    block_mb: float = 8.0,
    step: int | None = None,
    redis: str | None = None,
):
    """``recsys export``: the finished run's trained model (its ``final/``) as a DCP checkpoint of
    torchrec's ``DLRM`` over an ``EmbeddingBagCollection`` in ``to`` (``recsys.results.exporter``). Rows are
    read and written in blocks of about ``block_mb`` MB; ``step``: the run's checkpoint of that
    step instead of its final model; ``redis``: the rows read from these live servers (the run's
    shards, standing at that step). -> ``recsys.results.exporter.ExportStats``;
    ``recsys.results.exporter.ExportError`` in one line for bad input."""
    from recsys.results.exporter import export as export_run

    where = run.path if isinstance(run, Run) else run
    return export_run(where, to, optimizer_state=optimizer_state, block_mb=block_mb, step=step, redis=redis)
