"""Train and eval sources for a run's ``--data`` choice."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.batches import BinarySource, ConcatSource, MultiHot, Source
from data.criteo import NUM_SPARSE, TERABYTE_DAYS, BinaryCriteo, kaggle_split, last_day_split, preprocess
from data.errors import DataError
from data.synthetic import SyntheticConfig, SyntheticSource, teacher_auc
from recsys.config import RunConfig


@dataclass
class Sources:
    train: Source
    eval: Source
    ceiling_auc: float | None


def synthetic_config(cfg: RunConfig) -> SyntheticConfig:
    return SyntheticConfig(
        rows_per_table=tuple(cfg.data.rows),
        zipf=(cfg.data.zipf,) * NUM_SPARSE,
        seed=cfg.train.seed,
        teacher=cfg.data.teacher,
    )


def prepare(cfg: RunConfig, progress: bool = True) -> None:
    """Preprocess raw Criteo text into npy once (before trainers start); no-op otherwise."""
    kind, path = cfg.data.kind, Path(cfg.data.path)
    if kind == "criteo-kaggle" and path.is_file():
        npy = Path(cfg.train.out) / "criteo-npy"
        if not (npy / "kaggle_labels.npy").exists():
            preprocess(path, npy, "kaggle", progress=progress)
    elif kind == "criteo-terabyte":
        npy = path / "npy"
        for d in range(TERABYTE_DAYS):
            if (path / f"day_{d}_labels.npy").exists() or (npy / f"day_{d}_labels.npy").exists():
                continue
            raw = next((p for p in (path / f"day_{d}", path / f"day_{d}.gz") if p.exists()), None)
            if raw is None:
                raise DataError(f"criteo-terabyte:{path}: neither day_{d}_*.npy nor day_{d}[.gz] found")
            preprocess(raw, npy, f"day_{d}", progress=progress)


def sources(cfg: RunConfig) -> Sources:
    """The run's train and eval sources; with ``multi_hot``, their ids made into bags (``MultiHot``)."""
    out = _sources(cfg)
    sizes = cfg.data.bag_sizes
    if sizes is None:
        return out
    rows = cfg.data.rows
    return Sources(MultiHot(out.train, sizes, rows), MultiHot(out.eval, sizes, rows), out.ceiling_auc)


def _sources(cfg: RunConfig) -> Sources:
    kind, path = cfg.data.kind, Path(cfg.data.path)
    mod = cfg.data.rows
    if kind == "synthetic":
        syn = synthetic_config(cfg)
        return Sources(
            SyntheticSource(syn, "train"), SyntheticSource(syn, "eval"), teacher_auc(syn, cfg.data.eval_samples)
        )
    if kind == "criteo-kaggle":
        npy = Path(cfg.train.out) / "criteo-npy" if path.is_file() else path
        data = BinaryCriteo.open(npy, "kaggle")
        lo, hi = kaggle_split(len(data), "train")
        vlo, vhi = kaggle_split(len(data), "val")
        return Sources(BinarySource(data, mod, lo, hi), BinarySource(data, mod, vlo, vhi), None)
    days = []
    for d in range(TERABYTE_DAYS):
        base = path if (path / f"day_{d}_labels.npy").exists() else path / "npy"
        days.append(BinaryCriteo.open(base, f"day_{d}"))
    last = days[-1]
    vlo, vhi = last_day_split(len(last), "val")
    train = ConcatSource([BinarySource(d, mod) for d in days[:-1]])
    return Sources(train, BinarySource(last, mod, vlo, vhi), None)
