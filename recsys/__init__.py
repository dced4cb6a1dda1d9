"""DLRM training over the disaggregated embedding tier: model, trainer, config, CLI.

The Python API (``recsys.api``), at the package top::

    import recsys

    run = recsys.train(recsys.configure(steps=200, recovery="partial", checkpoint_every=50, out="runs/x"))
    print(run.summary.final_auc, run.summary.pls)

``configure``, ``train``, ``resume``, ``load_run``, ``bench_recovery``, ``compare``, ``export``; the types
``RunConfig``, ``Run``, ``Summary``, ``Failure``; ``ConfigError``. Names load on first use, so
``import recsys`` stays cheap (torch is imported when a run starts).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "Failure",
    "Run",
    "RunConfig",
    "Summary",
    "bench_recovery",
    "compare",
    "configure",
    "export",
    "load_run",
    "resume",
    "train",
]


def __getattr__(name: str):
    if name in ("RunConfig", "ConfigError"):
        from recsys import config as _config

        return getattr(_config, name)
    if name in __all__:
        from recsys import api

        return getattr(api, name)
    raise AttributeError(f"module 'recsys' has no attribute {name!r}")
