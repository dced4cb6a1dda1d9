#!/usr/bin/env python
"""What a trainer's death costs under ``--trainer-recovery restart`` and ``replace``, side by side.

For each trainer count of ``--trainers`` and each delay of ``--restart-delays`` (a trainer host that
takes that much longer to come back, as on GPUs): a run without a failure, then the same run with
trainer 1 killed at step ``--kill-step`` under ``restart`` and under ``replace``. Every run is
``python -m recsys train`` as a user runs it (real trainer processes, real redis-servers, a real
SIGKILL), under ``--recovery log``.

Columns: the survivors' seconds waited (the failure record's ``waited_s``: restart, every trainer
from the death until the group trains again; replace, the others from the death until they step
at the new quorum), the run's extra wall over the failure-free run (``summary.json``'s
``wall_seconds``, restarts included, and measured from outside), the extra seconds of the death's
window alone (steps ``kill - 10`` to ``kill + --window`` against the same steps of the failure-free
run: the whole run's wall drifts by seconds on a shared machine), samples lost, whether the run
ended bit-identical to the failure-free one (``embedding_digest``), and AUC at equal wall time (each
run's AUC, interpolated, at the failure-free run's wall time). One plot: AUC against wall-clock
seconds for every run.

    python scripts/bench_trainer_death.py [--trainers 2,3] [--restart-delays 0,30] [--steps 400]
        [--batch-size 510] [--kill-step 200] [--window 60] [--modes restart,replace] [--dense-reduce chunks|allreduce]
        [--rounds 1] [--out runs/bench_trainer_death]

With ``--rounds N`` every run is made N times, each round's failure runs measured against its own
failure-free run, and the table gives the median of the rounds (the extra wall of every round in
``results.json``); samples lost and AUC are the last round's (the same in every round under ``log``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def run(out: Path, args, trainers: int, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "recsys", "train", "--trainers", str(trainers), "--shards", str(args.shards),
        "--steps", str(args.steps), "--batch-size", str(args.batch_size), "--recovery", "log",
        "--checkpoint-every", str(args.checkpoint_every), "--eval-every", str(args.eval_every),
        "--eval-samples", str(args.eval_samples), "--no-keep-model", "--dense-reduce", args.dense_reduce,
        "--out", str(out), *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"bench_trainer_death: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(r["elapsed_s"], r["auc"]) for r in records if "auc" in r]
    curve.append((s["wall_seconds"], s["final_auc"]))
    at = {r["step"]: r["elapsed_s"] for r in records if "step" in r and "elapsed_s" in r}
    return {"summary": s, "outside_s": wall, "curve": sorted(curve), "elapsed_at": at}


def window_s(r: dict, args) -> float:
    """The run's seconds from step ``kill - 10`` to step ``kill + --window`` (its ``metrics.jsonl``,
    a line every 10 steps; restarts included)."""
    at = r["elapsed_at"]
    lo, hi = args.kill_step - 10, args.kill_step + args.window
    return at[hi] - at[lo]


def measured(base: dict, r: dict, args) -> dict:
    """One failure run against its round's failure-free run."""
    s, t_ref = r["summary"], base["summary"]["wall_seconds"]
    (rec,) = [f for f in s["failures"] if f.get("kind") == "trainer"]
    return {
        "waited_s": rec["waited_s"],
        "extra_wall_s": round(s["wall_seconds"] - t_ref, 2),
        "extra_outside_s": round(r["outside_s"] - base["outside_s"], 2),
        "extra_window_s": round(window_s(r, args) - window_s(base, args), 2),
        "samples_lost": rec["samples_lost"],
        "bit_identical": s["embedding_digest"] == base["summary"]["embedding_digest"],
        "auc_at_equal_wall": round(auc_at(r["curve"], t_ref), 4),
        "auc_no_failure": round(base["summary"]["final_auc"], 4),
        "final_auc": round(s["final_auc"], 4),
        "pls": round(s["pls"], 4),
        "rejoin_step": rec.get("rejoin_step"),
        "heal_s": rec.get("heal_s"),
    }


def median_of(runs: list[dict]) -> dict:
    """The rounds' median of each figure (every round's extra wall kept); bit-identical in every round."""
    out = {
        k: float(np.median([r[k] for r in runs]))
        for k in ("waited_s", "extra_wall_s", "extra_outside_s", "extra_window_s")
    }
    out["extra_wall_rounds"] = [r["extra_wall_s"] for r in runs]
    out["extra_window_rounds"] = [r["extra_window_s"] for r in runs]
    out["bit_identical"] = all(r["bit_identical"] for r in runs)
    for k in ("samples_lost", "auc_at_equal_wall", "auc_no_failure", "final_auc", "pls", "rejoin_step", "heal_s"):
        out[k] = runs[-1][k]
    return out


def rounds(r: dict, key: str) -> str:
    each = r[key]
    return f" (rounds: {', '.join(f'{x:.2f}' for x in each)})" if len(each) > 1 else ""


def auc_at(curve: list[tuple[float, float]], t: float) -> float:
    xs, ys = zip(*curve)
    return float(np.interp(t, xs, ys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainers", default="2,3")
    ap.add_argument("--restart-delays", default="0,30")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=510)  # a multiple of 2 and 3 trainers
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--kill-step", type=int, default=200, help="a multiple of 10 (metrics.jsonl's lines)")
    ap.add_argument(
        "--window",
        type=int,
        default=60,
        help="the death's window: steps kill-10 to kill+WINDOW, timed against the same steps without the death",
    )
    ap.add_argument("--checkpoint-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--eval-samples", type=int, default=16384)
    ap.add_argument("--modes", default="restart,replace", help="the --trainer-recovery modes to compare")
    ap.add_argument(
        "--dense-reduce",
        default="chunks",
        help="chunks (exact: the dead trainer's chunk trained by the others) or allreduce (skipped until it rejoins)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="rounds of every run; the table gives the medians")
    ap.add_argument("--out", default="runs/bench_trainer_death")
    args = ap.parse_args()
    root = Path(args.out)
    rows, curves = [], {}
    for trainers in [int(x) for x in args.trainers.split(",")]:
        per: dict[tuple[float, str], list[dict]] = {}
        for rnd in range(args.rounds):  # each round's failure-free run beside its failure runs: the machine drifts
            tag = f"_r{rnd}" if args.rounds > 1 else ""
            base = run(root / f"w{trainers}_nofail{tag}", args, trainers, [])
            curves[f"{trainers} trainers, no failure"] = base["curve"]
            for delay in [float(x) for x in args.restart_delays.split(",")]:
                for mode in args.modes.split(","):
                    kill = ["--trainer-recovery", mode, "--inject", f"trainer:1@step={args.kill_step}"]
                    r = run(
                        root / f"w{trainers}_{mode}_d{delay:g}{tag}",
                        args,
                        trainers,
                        [*kill, "--restart-delay", str(delay)],
                    )
                    curves[f"{trainers} trainers, {mode}, delay {delay:g} s"] = r["curve"]
                    per.setdefault((delay, mode), []).append(measured(base, r, args))
                    print(
                        json.dumps({"trainers": trainers, "round": rnd, "mode": mode, **per[delay, mode][-1]}),
                        flush=True,
                    )
        for (delay, mode), runs in per.items():
            rows.append({"trainers": trainers, "mode": mode, "restart_delay_s": delay, **median_of(runs)})
    (root / "results.json").write_text(json.dumps(rows, indent=1) + "\n")
    print()
    print(
        "| trainers | mode | restart delay s | survivors waited s | extra wall s (summary / outside) | extra s in "
        f"steps {args.kill_step - 10}-{args.kill_step + args.window} | samples lost (PLS) | bit-identical | "
        "AUC at equal wall (no failure) | final AUC (no failure) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['trainers']} | {r['mode']} | {r['restart_delay_s']:g} | {r['waited_s']:.2f} | "
            f"{r['extra_wall_s']:.2f} / {r['extra_outside_s']:.2f}{rounds(r, 'extra_wall_rounds')} | "
            f"{r['extra_window_s']:.2f}{rounds(r, 'extra_window_rounds')} | {r['samples_lost']} ({r['pls']:.4f}) | "
            f"{r['bit_identical']} | {r['auc_at_equal_wall']:.4f} ({r['auc_no_failure']:.4f}) | "
            f"{r['final_auc']:.4f} ({r['auc_no_failure']:.4f}) |"
        )
    plot(curves, root / "auc_vs_wall.png", args)
    print(f"\nplot: {root / 'auc_vs_wall.png'}")


def plot(curves: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for name, curve in curves.items():
        xs, ys = zip(*curve)
        style = "-" if "no failure" in name else "--" if "restart" in name else ":"
        ax.plot(xs, ys, style, marker=".", label=name)
    ax.set_xlabel("wall-clock seconds (restarts included)")
    ax.set_ylabel("AUC")
    ax.set_title(f"trainer 1 killed at step {args.kill_step}: restart vs replace")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
