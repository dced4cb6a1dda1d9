"""What trainer restarts cost: the per-step dense save, measured on the default run.

Runs the default training configuration (``RunConfig()``: 2 trainers, 3 local shards, 26 tables x
100k rows, batch 1024) for ``--steps`` steps with trainer restarts off (``max_restarts=0``) and on
(each step's dense state saved off the training path), interleaved ``--repeats`` times so that the
shared machine's noise hits both alike. Prints samples/s of each, their ratio, and the save's own
time (the background writer's seconds per step).

    python scripts/bench_dense_save.py --steps 300 --repeats 2
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from recsys.config import RunConfig
from recsys.launch import run


def one(steps: int, restarts: int, out: Path) -> dict:
    cfg = RunConfig()
    cfg.train.steps, cfg.train.eval_every, cfg.train.progress, cfg.train.out = steps, 0, False, str(out)
    cfg.data.eval_samples = 4096
    cfg.recovery.max_restarts = restarts
    return run(RunConfig.from_dict(cfg.to_dict()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="training steps per run")
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each setting")
    ap.add_argument("--restarts", type=int, default=3, help="max_restarts of the 'on' runs")
    args = ap.parse_args()
    speed: dict[str, list[float]] = {"off": [], "on": []}
    save_ms: list[float] = []
    with tempfile.TemporaryDirectory(prefix="bench-dense-") as tmp:
        for i in range(args.repeats):
            for name, restarts in (("off", 0), ("on", args.restarts)):
                s = one(args.steps, restarts, Path(tmp) / f"{name}{i}")
                speed[name].append(s["throughput_samples_per_s"])
                if restarts:
                    save_ms.append(1000 * s["dense_save_seconds"] / max(1, s["dense_saves"]))
                print(f"run {i} restarts {name}: {s['throughput_samples_per_s']:.0f} samples/s", flush=True)
    off, on = statistics.median(speed["off"]), statistics.median(speed["on"])
    step_ms = 1000 * 1024 / off
    print(
        f"\nrestarts off: {off:.0f} samples/s ({step_ms:.1f} ms/step)\n"
        f"restarts on:  {on:.0f} samples/s ({100 * (on / off - 1):+.1f}%)\n"
        f"dense save (background writer): {statistics.median(save_ms):.2f} ms/step"
    )


if __name__ == "__main__":
    main()
