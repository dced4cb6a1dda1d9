"""``python -m recsys bench-recovery``: what each recovery strategy costs, measured side by side.

The same training run (same data, model, seed and an emulated, seeded schedule of shard failures)
under each strategy: ``none`` (no failures, no checkpoints: the reference), ``full``, ``partial``,
``partial-mfu``, ``partial-ssu`` and ``log``. Per strategy: wall time; time lost to failures
(the failed call, redone; the restore; recomputation); time spent checkpointing, logging and priority-saving on the
training path; checkpoint-related overhead = (failure time + checkpoint/log/priority time) divided
by the reference run's wall time (CPR's definition); ``behind_wait_s``, the time the training path
waited for the write-behind beyond the reference run (background work taking the cores from the
servers; not in the overhead, as the rest of that contention is not); PLS; final AUC and logloss and the change
against the reference; bytes written. Outputs ``results.csv``, ``results.md`` and
``overhead_vs_auc.png`` in ``--out``.

``--train-through``: the strategies that restore (``partial``, ``partial-mfu``, ``partial-ssu``,
``incremental``, ``log``) do it in the background while training goes on; a failure's time is then
what the trainers waited, and ``trained_through``, ``fallback_reads`` and ``applied_late`` say what
the outage cost in steps and rows.

``replica`` runs with a local replica per shard (promoted on failure: nothing is loaded).
``incremental`` flushes each shard's dirty rows every tenth of the interval (Check-N-Run style).
Per strategy, bytes written per step (checkpoints, logs, priority saves, flushes).

``--sweep``: CPR's trade-off curve. Failures drawn from an emulated failure process (exponential
gaps of mean ``--mtbf`` steps, one draw for every strategy); each strategy at each checkpoint
interval of ``--intervals`` plus the planner's interval for ``--target-pls`` (marked). Outputs
``sweep.csv``, ``sweep.md`` (with the cheapest interval per strategy at equal accuracy, and the
planner's predicted PLS against the measured one) and ``sweep_pareto.png`` (overhead against
AUC change and against PLS, one line per strategy).

``--scaling``: per shard size, snapshots and every restore path beside Redis's own load of the same
file and a loopback send of its bytes, a node's shards restored at once, and a log replay's rows/s
(``recsys.bench.scaling``).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import math
from pathlib import Path

import numpy as np

from data.progress import progress
from recovery.durable import layout
from recovery.strategy import Strategy
from recsys.bench import markdown
from recsys.bench.scaling import bench_scaling, parse_size  # noqa: F401 - parse_size: this module's API too
from recsys.config import ConfigError

STRATEGIES = ("none", *(s.value for s in Strategy))
THROUGH_NAMES = ("partial", "partial-mfu", "partial-ssu", "incremental", "log")  # recovery.restore.through.THROUGH


def failure_schedule(steps: int, rate: float, num_shards: int, seed: int) -> list[str]:
    """Shard kills at rate ``rate`` per step (steps 2 .. steps-1), a seeded random shard each; at least one."""
    rng = np.random.default_rng([seed, 31337])
    at = [s for s in range(2, steps) if rng.random() < rate]
    if not at:
        at = [steps // 2]
    return [f"shard:{int(rng.integers(num_shards))}@step={s}" for s in at]


def mtbf_schedule(steps: int, mtbf: float, num_shards: int, seed: int) -> list[str]:
    """An emulated failure process: shard kills at exponentially distributed gaps of mean ``mtbf``
    steps (steps 2 .. steps-1), a seeded random shard each; the same draw for every strategy."""
    rng = np.random.default_rng([seed, 2718])
    out, t, last = [], 0.0, 0
    while True:
        t += rng.exponential(mtbf)
        step = max(2, math.ceil(t))
        if step >= steps:
            return out
        shard = int(rng.integers(num_shards))
        if step != last:  # two failures drawn in one step count as one
            out.append(f"shard:{shard}@step={step}")
            last = step


def _config(args, out: Path, strategy: str, injections: list[str], checkpoint_every: int | None = None):
    from recsys.config import RunConfig

    d = {
        "data": {"data": args.data, "rows_per_table": args.rows_per_table, "eval_samples": args.eval_samples},
        "model": {"embedding_dim": args.embedding_dim},
        # every step's rows on their shards: each strategy meets a failure at its step and its loss shows
        "embeddings": {"shards": args.shards, "write_every": 1},
        "optim": {"optimizer": args.optimizer, "lr": args.lr},
        "train": {
            "steps": args.steps,
            "batch_size": args.batch_size,
            "trainers": args.trainers,
            "seed": args.seed,
            "eval_every": 0,
            "log_every": max(1, args.steps // 20),
            "out": str(out),
            "progress": False,
        },
        "recovery": {},
    }
    if strategy == "replica":
        d["embeddings"]["replicas"] = "local"
    if strategy != "none":
        d["recovery"] = {
            "recovery": strategy,
            "checkpoint_every": checkpoint_every or args.checkpoint_every,
            "inject": injections,
            # set only where they are used, so that --reuse still finds the other strategies' runs
            **(
                {
                    "priority_budget": args.priority_budget,
                    "priority_every": args.priority_every,
                    # the trackers count at least the rows a save takes
                    "mfu_capacity": max(8192, args.priority_budget),
                    "ssu_capacity": max(8192, args.priority_budget),
                }
                if Strategy(strategy).priority_saves
                else {}
            ),
            "priority_half": getattr(args, "priority_half", False),
            **({"train_through": True} if getattr(args, "train_through", False) and strategy in THROUGH_NAMES else {}),
            "keep_checkpoints": 2,
            "max_restarts": 0,  # shard failures only: no per-step dense saves in the comparison
        }
    return RunConfig.from_dict(d, source="bench-recovery")


def summarize(strategy: str, s: dict, ref: dict) -> dict:
    step_s = ref["wall_seconds"] / ref["steps_completed"]
    fails = s["failures"]
    # a failure costs the call that saw it fail (redone), the restore and any recomputed steps; the
    # time between the failure and that call is not lost: the trainer went on training (a trainer
    # restart has no such call: its whole detection time counts)
    # (trained through: only the time every trainer waited for the restore, ``waited_s``)
    failure_s = sum(f.get("failed_call_s", f["detected_after_s"]) + f.get("waited_s", f["recovery_s"]) for f in fails)
    failure_s += sum(f.get("recomputed_steps", 0) for f in fails) * step_s
    failure_s += s.get("held_reload_s", 0.0)  # the writers reading their restored shards' rows back
    ckpt_s = sum(c["pause_s"] for c in s.get("checkpoints", []))
    saving_s = ckpt_s + s.get("log_seconds", 0.0) + s.get("priority_pause_s", 0.0) + s.get("flush_pause_s", 0.0)
    written = sum(c["bytes"] for c in s.get("checkpoints", []))
    written += s.get("log_bytes", 0) + s.get("priority_bytes", 0) + s.get("flush_bytes", 0)
    return {
        "strategy": strategy,
        "failures": len(fails),
        "wall_s": round(s["wall_seconds"], 2),
        "failure_time_s": round(failure_s, 3),
        "saving_time_s": round(saving_s, 3),
        "overhead_pct": round(100 * (failure_s + saving_s) / ref["wall_seconds"], 2),
        "wall_vs_none_pct": round(100 * (s["wall_seconds"] / ref["wall_seconds"] - 1), 1),
        # the training path waiting for the write-behind beyond the failure-free run: background work
        # (a snapshot's child, the log's writes) taking the cores from the servers; not in the overhead
        "behind_wait_s": round(s.get("behind_wait_s", 0.0) - ref.get("behind_wait_s", 0.0), 3),
        "pls": round(s.get("pls", 0.0), 5),
        "lost_updates": sum(f.get("lost_updates", 0) for f in fails),
        "saved_updates": sum(f.get("saved_updates", 0) for f in fails),
        "trained_through": sum(f.get("trained_through_steps", 0) for f in fails),
        "fallback_reads": sum(f.get("rows_read_fallback", 0) for f in fails),
        "applied_late": sum(f.get("updates_applied_late", 0) for f in fails),
        "final_auc": round(s["final_auc"], 5),
        "final_logloss": round(s["final_logloss"], 5),
        "auc_change": round(s["final_auc"] - ref["final_auc"], 5),
        "bytes_written": written,
        "bytes_per_step": int(written / max(1, s["steps_completed"])),
    }


COLUMNS = [
    "strategy",
    "failures",
    "wall_s",
    "failure_time_s",
    "saving_time_s",
    "overhead_pct",
    "wall_vs_none_pct",
    "behind_wait_s",
    "pls",
    "lost_updates",
    "saved_updates",
    "trained_through",
    "fallback_reads",
    "applied_late",
    "final_auc",
    "final_logloss",
    "auc_change",
    "bytes_written",
    "bytes_per_step",
]


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.scatter(r["overhead_pct"], r["auc_change"], s=60)
        ax.annotate(r["strategy"], (r["overhead_pct"], r["auc_change"]), textcoords="offset points", xytext=(6, 4))
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xlabel("checkpoint-related overhead (% of the failure-free run)")
    ax.set_ylabel("AUC change vs failure-free run")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def bench_strategies(args) -> list[dict]:
    from recsys.launch import run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    schedule = failure_schedule(args.steps, args.failure_rate, args.shards, args.seed)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad:
        raise ConfigError(f"--strategies {args.strategies!r}: unknown {bad}; choose from {', '.join(STRATEGIES)}")
    if "none" not in strategies:
        strategies.insert(0, "none")
    summaries = {}
    for strategy in progress(strategies, desc="bench-recovery", unit="run"):
        cfg = _config(args, out / strategy, strategy, schedule)
        summaries[strategy] = run(cfg)
    ref = summaries["none"]
    rows = [summarize(s, summaries[s], ref) for s in strategies]
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    title = (
        f"{args.steps} steps x {args.batch_size}, {args.shards} shards, {args.trainers} trainer(s), "
        f"checkpoint every {args.checkpoint_every}, failures at {', '.join(schedule)}"
    )
    md = f"{title}\n\n{markdown(rows, COLUMNS)}\n"
    (out / "results.md").write_text(md)
    layout.schedule_file(out).write_text(json.dumps(schedule))
    plot(rows, out / "overhead_vs_auc.png", title)
    print(md)
    return rows


SWEEP_COLUMNS = [
    "strategy",
    "interval",
    "draw",
    "planner",
    "failures",
    "overhead_pct",
    "wall_vs_none_pct",
    "behind_wait_s",
    "pls",
    "predicted_pls",
    "predicted_pls_drawn",
    "auc_change",
    "bytes_per_step",
]


def bench_sweep(args) -> list[dict]:
    """CPR's trade-off: every strategy at every checkpoint interval, under failures drawn from an
    emulated failure process (mean ``--mtbf`` steps between failures, one draw for all). The
    planner's interval for ``--target-pls`` is added to the intervals and marked; beside each
    measured PLS, the planner's prediction (from the MTBF) and the same model with the number of
    failures actually drawn."""
    from recovery.planner import expected_loss_steps, expected_pls, plan_interval
    from recsys.launch import run

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # one failure draw per --draws (the same for every strategy and interval)
    if args.draws < 1:
        raise ConfigError(f"--draws {args.draws}: must be >= 1")
    if not 0 < args.target_pls < 1:
        raise ConfigError(f"--target-pls {args.target_pls:g}: must be in (0, 1)")
    if not args.mtbf > 0:
        raise ConfigError(f"--mtbf {args.mtbf:g}: must be > 0 steps")
    schedules = [mtbf_schedule(args.steps, args.mtbf, args.shards, args.seed + 1000 * d) for d in range(args.draws)]
    if not any(schedules):
        raise ConfigError(f"--mtbf {args.mtbf:g}: no failure drawn in {args.steps} steps; lower it or add --steps")
    intervals = _step_counts(args.intervals, "--intervals", ",")
    planned = plan_interval(args.mtbf, args.target_pls, args.shards, 0.0, max_interval=args.steps).interval
    # STRATEGY (every interval of --intervals and the planner's) or STRATEGY@K1:K2 (those intervals)
    per_strategy = {}
    for item in (x.strip() for x in args.sweep_strategies.split(",") if x.strip()):
        strategy, _, own = item.partition("@")
        if strategy not in STRATEGIES or strategy in ("none", "replica"):
            raise ConfigError(
                f"--sweep-strategies {args.sweep_strategies!r}: {strategy!r} cannot be swept (strategies with checkpoints only)"
            )
        per_strategy[strategy] = (
            _step_counts(own, f"--sweep-strategies {item!r}", ":") if own else [*intervals, planned]
        )
    runs = [("none", 0, 0)] + [
        (s, k, d) for d in range(args.draws) for s, ks in per_strategy.items() for k in sorted(set(ks))
    ]
    summaries = {}
    for strategy, k, d in progress(runs, desc="sweep", unit="run"):
        name = f"{strategy}-{k}" + (f"-draw{d}" if args.draws > 1 else "")
        cfg = _config(args, out / name, strategy, schedules[d], checkpoint_every=k)
        summaries[(strategy, k, d)] = (args.reuse and _finished(cfg)) or run(cfg)
    ref = summaries[("none", 0, 0)]
    rows = []
    for strategy, k, d in runs[1:]:
        r = summarize(strategy, summaries[(strategy, k, d)], ref)
        n_fail = len(schedules[d])
        lost_every = max(1, k // 10) if strategy == "incremental" else k  # the restore point's spacing
        modeled = strategy in ("partial", "incremental")  # the planner's model: restore to the last save
        rows.append(
            {
                **r,
                "interval": k,
                "draw": d,
                "planner": k == planned,
                "predicted_pls": round(expected_pls(lost_every, args.mtbf, args.shards), 5) if modeled else "",
                "predicted_pls_drawn": round(
                    n_fail * expected_loss_steps(lost_every, args.mtbf, args.shards) / (args.shards * args.steps), 5
                )
                if modeled
                else "",
            }
        )
    with open(out / "sweep.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=SWEEP_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    title = (
        f"{args.steps} steps x {args.batch_size}, {args.shards} shards, MTBF {args.mtbf:g} steps "
        f"({'/'.join(str(len(x)) for x in schedules)} failures drawn), planner's interval {planned} "
        f"for target PLS {args.target_pls:g}"
    )
    md = [title, "", markdown(rows, SWEEP_COLUMNS), "", sweep_verdict(rows, ref, args.auc_tolerance, args.target_pls)]
    (out / "sweep.md").write_text("\n".join(md) + "\n")
    layout.schedule_file(out).write_text(json.dumps(schedules))
    plot_sweep(rows, out / "sweep_pareto.png", title)
    print("\n".join(md))
    return rows


def _step_counts(text: str, where: str, sep: str) -> list[int]:
    try:
        ks = sorted({int(x) for x in text.split(sep) if x.strip()})
    except ValueError:
        raise ConfigError(f"{where}: {text!r} must be {sep!r}-separated step counts") from None
    if not ks or min(ks) <= 0:
        raise ConfigError(f"{where}: {text!r} must be step counts > 0")
    return ks


def per_interval(rows: list[dict]) -> list[dict]:
    """Rows of several draws averaged per (strategy, interval), with the spread over the draws
    (``*_sd``: sample standard deviation; 0 with one draw)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["strategy"], r["interval"]), []).append(r)
    out = []
    for (strategy, k), rs in groups.items():
        digits = {"overhead_pct": 3, "auc_change": 5, "pls": 5}
        mean = {c: round(float(np.mean([r[c] for r in rs])), n) for c, n in digits.items()}
        sd = {
            f"{c}_sd": round(float(np.std([r[c] for r in rs], ddof=1)), digits[c]) if len(rs) > 1 else 0.0
            for c in ("overhead_pct", "auc_change")
        }
        out.append({"strategy": strategy, "interval": k, "planner": rs[0]["planner"], "draws": len(rs), **mean, **sd})
    return out


def _finished(cfg) -> dict | None:
    """--reuse: the summary of a finished run of exactly this config in its folder, if there is one."""
    from recsys.config import RunConfig
    from recsys.results.outputs import recorded

    folder = Path(cfg.train.out)
    try:
        if RunConfig.from_toml(layout.config_file(folder)).to_dict() != recorded(cfg).to_dict():
            return None
        return json.loads(layout.summary_file(folder).read_text())
    except (OSError, ValueError, ConfigError):
        return None


def sweep_verdict(rows: list[dict], ref: dict, tolerance: float, target_pls: float | None = None) -> str:
    """Per strategy: the cheapest interval whose AUC stays within ``tolerance`` (relative) of the
    failure-free run; the cheapest whose PLS meets ``target_pls`` (CPR's criterion: the planner's
    target); and the planner's PLS prediction against the measured PLS, summed."""
    means = per_interval(rows)
    criteria = [
        (
            f"Cheapest interval per strategy with |AUC change| <= {100 * tolerance:g}% of {ref['final_auc']:.5f} "
            "(means over the draws):",
            lambda r: abs(r["auc_change"]) <= tolerance * ref["final_auc"],
            "within the tolerance",
        )
    ]
    if target_pls is not None:
        criteria.append(
            (
                f"Cheapest interval per strategy with PLS <= {target_pls:g}, the planner's target (means over the draws):",
                lambda r: r["pls"] <= target_pls,
                "meets the target",
            )
        )
    lines = []
    for title, passes, none_msg in criteria:
        lines += [title, ""] if not lines else ["", title, ""]
        for strategy in dict.fromkeys(r["strategy"] for r in means):
            ok = [r for r in means if r["strategy"] == strategy and passes(r)]
            if ok:
                best = min(ok, key=lambda r: r["overhead_pct"])
                spread = (
                    f" (over {best['draws']} draws, SD of the overhead {best['overhead_pct_sd']}, "
                    f"of the AUC change {best['auc_change_sd']})"
                    if best["draws"] > 1
                    else ""
                )
                lines.append(
                    f"- {strategy}: interval {best['interval']}, overhead {best['overhead_pct']}%, "
                    f"AUC change {best['auc_change']}, PLS {best['pls']}{spread}"
                )
            else:
                lines.append(f"- {strategy}: no interval {none_msg}")
    lines.append("")
    for strategy in ("partial", "incremental"):
        mine = [r for r in rows if r["strategy"] == strategy]
        measured = sum(r["pls"] for r in mine)
        if mine and measured > 0:
            pred = sum(r["predicted_pls"] for r in mine)
            drawn = sum(r["predicted_pls_drawn"] for r in mine)
            lines.append(
                f"- {strategy} PLS over the sweep: measured {measured:.5f}, planner {pred:.5f} "
                f"({100 * (pred / measured - 1):+.1f}%), with the failures drawn {drawn:.5f} "
                f"({100 * (drawn / measured - 1):+.1f}%)"
            )
    return "\n".join(lines)


def plot_sweep(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    rows = per_interval(rows)
    for strategy in dict.fromkeys(r["strategy"] for r in rows):
        mine = sorted((r for r in rows if r["strategy"] == strategy), key=lambda r: r["overhead_pct"])
        x = [r["overhead_pct"] for r in mine]
        for ax, key in zip(axes, ("auc_change", "pls")):
            line = ax.plot(x, [r[key] for r in mine], marker="o", label=strategy)[0]
            if key == "auc_change" and any(r["draws"] > 1 for r in mine):  # the spread over the draws
                ax.errorbar(
                    x,
                    [r[key] for r in mine],
                    yerr=[r["auc_change_sd"] for r in mine],
                    fmt="none",
                    ecolor=line.get_color(),
                    alpha=0.4,
                    capsize=3,
                )
            for r in mine:
                ax.annotate(
                    str(r["interval"]),
                    (r["overhead_pct"], r[key]),
                    fontsize=7,
                    xytext=(3, 3),
                    textcoords="offset points",
                )
                if r["planner"]:
                    ax.scatter([r["overhead_pct"]], [r[key]], marker="*", s=180, color=line.get_color(), zorder=3)
    axes[0].axhline(0, color="gray", lw=0.8)
    axes[0].set_ylabel("AUC change vs failure-free run (bars: SD over the draws)")
    axes[1].set_ylabel("PLS (portion of lost samples)")
    for ax in axes:
        ax.set_xlabel("checkpoint-related overhead (%)")
        ax.set_xscale("symlog", linthresh=1.0)
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title + " (labels: interval; star: the planner's)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--data", default="synthetic", help="as for train: synthetic | criteo-kaggle:PATH | criteo-terabyte:DIR"
    )
    ap.add_argument("--steps", type=int, default=400, help="training steps per strategy")
    ap.add_argument("--batch-size", type=int, default=512, help="global batch size")
    ap.add_argument("--trainers", type=int, default=1, help="trainer processes per run")
    ap.add_argument("--shards", type=int, default=4, help="local Redis shards")
    ap.add_argument("--rows-per-table", type=int, default=20_000, help="rows of each of the 26 tables")
    ap.add_argument("--embedding-dim", type=int, default=16, help="embedding dim")
    ap.add_argument(
        "--optimizer", default="adagrad", choices=["sgd", "adagrad", "adagrad-exact", "adam"], help="optimizer"
    )
    ap.add_argument("--lr", type=float, default=0.05, help="learning rate")
    ap.add_argument("--eval-samples", type=int, default=32_768, help="held-out samples for the final AUC")
    ap.add_argument("--checkpoint-every", type=int, default=100, help="checkpoint interval in steps")
    ap.add_argument("--priority-budget", type=int, default=2000, help="partial-mfu/ssu rows per shard per save")
    ap.add_argument(
        "--priority-every",
        type=int,
        default=0,
        help="partial-mfu/ssu: steps between priority saves (0: a quarter of the checkpoint interval)",
    )
    ap.add_argument(
        "--priority-half",
        action="store_true",
        help="priority saves and flushes store weights as float16 (optimizer state stays float32)",
    )
    ap.add_argument(
        "--train-through",
        action="store_true",
        help="partial, partial-mfu, partial-ssu, incremental and log restore in the background while training goes "
        "on (their failure time is what the trainers waited; columns trained_through, fallback_reads, applied_late)",
    )
    ap.add_argument("--failure-rate", type=float, default=0.005, help="shard failures per step (seeded schedule)")
    ap.add_argument("--seed", type=int, default=0, help="seed of data, model and the failure schedule")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies")
    ap.add_argument("--out", default="runs/bench-recovery", help="output folder")
    ap.add_argument("--scaling", action="store_true", help="also measure recovery time against shard size")
    ap.add_argument("--scaling-only", action="store_true", help="only the shard-size scaling figures")
    ap.add_argument(
        "--scaling-sizes",
        default="64MB,256MB,1GB",
        type=lambda s: s.split(","),
        help="comma-separated bytes of rows per shard",
    )
    ap.add_argument("--scaling-shards", type=int, default=2, help="shards in the scaling runs")
    ap.add_argument(
        "--scaling-repeats",
        type=int,
        default=2,
        help="--scaling: tries of each restore and of Redis's own load; the least is kept (the others once)",
    )
    ap.add_argument(
        "--sweep", action="store_true", help="only CPR's sweep: strategies x checkpoint intervals under --mtbf failures"
    )
    ap.add_argument("--mtbf", type=float, default=200.0, help="--sweep: mean steps between shard failures")
    ap.add_argument("--intervals", default="50,100,200,400", help="--sweep: comma-separated checkpoint intervals")
    ap.add_argument("--draws", type=int, default=1, help="--sweep: independent failure draws (each run per draw)")
    ap.add_argument(
        "--reuse", action="store_true", help="--sweep: keep finished runs of the same config in --out (re-analyse)"
    )
    ap.add_argument(
        "--sweep-strategies",
        default="full,partial,partial-mfu,partial-ssu,incremental,log",
        help="--sweep: comma-separated strategies, each at every interval of --intervals and the planner's, "
        "or STRATEGY@K1:K2 at those intervals alone",
    )
    ap.add_argument(
        "--target-pls", type=float, default=0.02, help="--sweep: the planner's target PLS (its interval is marked)"
    )
    ap.add_argument(
        "--auc-tolerance", type=float, default=0.0005, help="--sweep: relative AUC change counted as equal accuracy"
    )


def run_bench(args: argparse.Namespace) -> list[dict]:
    """What the flags ask for; -> the rows of the main table (the sweep's, the strategies' or the scaling's)."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    if args.sweep:
        return bench_sweep(args)
    rows = [] if args.scaling_only else bench_strategies(args)
    if args.scaling or args.scaling_only:
        scaling = bench_scaling(args)
        rows = rows or scaling
    return rows


def main(args: argparse.Namespace) -> int:
    run_bench(args)
    return 0
