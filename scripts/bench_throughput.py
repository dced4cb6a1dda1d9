#!/usr/bin/env python
"""Training throughput of the Redis tier beside torchrec's fused engine, in one invocation.

Same model, data and steps for every row. The reference of the ratios is torchrec's
``FusedEmbeddingBagCollection`` (fbgemm TBE on the host, row-wise Adagrad fused into backward) in a
plain loop over pre-built batches: the strongest peer. Then ``--embeddings local`` (the same fused
engine inside the project's training loop, data read each step), and the Redis tier with each shard
count of ``--shards`` and each trainer count of ``--trainers`` (held rows on, the run's defaults:
trainer restarts on, rows written once per window of 32 steps; the goal
configuration, 1 trainer and 2 shards, also with ``--max-restarts 0``: no per-step dense state, what
the fused engine never writes; and with the bench's ``--write-every K``, default 1: each row written
to its shard after every step that updates it; several trainers on 2 shards also under
``--trainer-recovery restart``, beside the default ``replace``: the quorum's cost). The limit row is the design's own ceiling on
this machine: the same loop (1 trainer, 2 shards, every row held, defaults) with its row writes built
and never sent (``RECSYS_ROWS_NOWHERE=1``, refused anywhere a row would be read back). The project's DLRM computes
torchrec's interaction with one flat pick (``recsys.model.PairInteraction``); a row gives the fused
engine with torchrec's stock interaction, as a torchrec user gets it. samples/s counts training
steps only (no setup, no evaluation), after 10 warm-up steps for every engine: the project's runs
train ``--steps`` + 10 steps and report ``summary.json``'s ``throughput_after_warmup_samples_per_s``;
the whole run's figure is printed beside it. The step-time columns are ``summary.json``'s ``step_ms`` (rows in, data, compute, rows
out, waiting, after), over every step; the training-thread column is its ``training_thread_ms`` after the
warm-up (Linux schedstat): on a CPU, runnable but off one (the host's other threads and processes had
the cores), blocked (a wait for a write, a lock, the GIL).
The reference is measured first and again last; the ratios are to the fastest fused figure (the
two plain-loop ones and ``--embeddings local``'s), the strongest peer.

``--data preprocessed`` (default): the synthetic stream is written once to preprocessed Criteo
files (``kaggle_*.npy``, memory-mapped) and every engine, the reference included, trains from
them, as a production job trains from preprocessed data. ``--data synthetic``: the project's
engines generate each batch (teacher labels and all) inside their step, as ``recsys train`` does
by default, while the reference still trains from pre-built batches.

``--pairs N``: then N rounds, each the fused engine (in the plain loop and inside the project's
loop) and the tier's goal configuration (1 trainer, 2 shards; with its defaults, and with
``--write-every K``) measured back to back, in alternating order; the ratio of each round (to the
faster fused figure) and their medians. Each round also runs the fused engine in the project's loop
with the torch threads the tier gets (``--threads``' default: the cores its local Redis servers leave),
and gives the tier's ratio to it: the tier's own work apart from the cores its servers take. On a shared machine
whose speed moves over minutes, a round's figures see the same machine.

``--sweep 100000,1000000,10000000``: only the table-size sweep: rows per table against samples/s
for the tier (1 trainer, 2 shards, a row cache of ``--sweep-cache-mb``: its own process, its peak
RSS reported) and the fused engine, at ``--embedding-dim`` and at ``--sweep-dim``; the fused
engine's row says where it can no longer allocate its tables (needed beside available memory).

``--preset mlperf-v2``: only the tier (1 trainer, 2 shards) against the fused engine inside the
project's loop under the preset (DCN-v2, multi-hot bags), ``--pairs`` alternating rounds.

``--dmp 1,2,3``: only the several-trainers table: for each W, the tier with W trainers (``--dmp-shards``
shards, the run's defaults; ``--dmp-write-every K``: its windows of K steps) against torchrec's
``DistributedModelParallel`` on W CPU ranks
(``recsys.bench.dmp``: gloo, table-wise on the fused kernel, one torch thread a rank), same model,
data and global batch, ``--pairs`` alternating rounds; each round's ratio, the medians, the tier's
``step_ms`` parts, and a plot (``--dmp-plot``); with W = 1 each round also times torchrec's fused
engine in the plain loop (the one-trainer reference).

``--cache-sweep 100,25,10,2``: only the row cache sweep: each budget (percent of the tables' bytes)
against the tier's samples/s, hit rate and peak RSS (each run its own ``recsys train`` process,
synthetic data generated in the step), Zipf and uniform ids; first a budget that holds every row
(the reference of the ratios), last budget 0 for the RSS without a cache; torchrec's fused engine
beside them.

    python scripts/bench_throughput.py [--steps 200] [--batch-size 1024] [--shards 1,2,4] [--trainers 1,2] [--pairs 5]
    python scripts/bench_throughput.py --cache-sweep 100,25,10,2 --rows-per-table 2000000
    python scripts/bench_throughput.py --preset mlperf-v2 --pairs 3
    python scripts/bench_throughput.py --dmp 1,2,3 --pairs 2 --dmp-plot docs/img/dmp.png
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from recsys.clock import WARMUP_STEPS  # noqa: E402
from recsys.config import DataConfig, EmbeddingConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig  # noqa: E402
from recsys.launch import run  # noqa: E402


def tput(summary: dict) -> float:
    """A run's samples/s after its warm-up steps, as the reference is timed."""
    return summary["throughput_after_warmup_samples_per_s"] or summary["throughput_samples_per_s"]


def step_parts(summary: dict) -> dict:
    """``summary.json``'s step-time parts, and the training thread's time on a CPU, runnable but off
    one, and blocked, and the process's and its local servers' CPU by kind (``cpu_<kind>``; ms per
    step after the warm-up)."""
    cpu = {f"cpu_{k}": v for k, v in (summary.get("cpu_ms") or {}).items()}
    return {**summary["step_ms"], **(summary.get("training_thread_ms") or {}), **cpu}


def config(
    args,
    out: Path,
    embeddings: str,
    shards: int,
    prefetch: bool,
    trainers: int,
    rows=None,
    dim=None,
    restarts=True,
    write_every=0,
    kernels=None,
) -> RunConfig:
    rows = rows or args.rows_per_table
    cfg = RunConfig(
        data=DataConfig(data=data_spec(args, rows), rows_per_table=rows, eval_samples=4096),
        model=ModelConfig(embedding_dim=dim or args.embedding_dim),
        embeddings=EmbeddingConfig(
            embeddings=embeddings,
            shards=shards,
            prefetch=prefetch,
            write_every=write_every,
            kernels=kernels or args.kernels,
            server_nice=args.server_nice,
        ),
        optim=OptimConfig(optimizer=args.optimizer),
        train=TrainConfig(
            steps=args.steps + WARMUP_STEPS,  # timed: the steps after the warm-up, as the reference
            batch_size=args.batch_size,
            trainers=trainers,
            eval_every=0,
            log_every=args.steps,
            out=str(out),
            progress=False,
        ),
    )
    if not restarts:
        cfg.recovery.max_restarts = 0
    return cfg


LIMIT = "limit: the tier's loop, no row sent to Redis"


def limit_run(cfg: RunConfig) -> dict:
    """The design's own ceiling on this machine: the tier's run with every row write built and never
    sent (``RECSYS_ROWS_NOWHERE=1``; one trainer holding every row, so nothing is read back)."""
    import os

    os.environ["RECSYS_ROWS_NOWHERE"] = "1"
    try:
        return run(cfg)
    finally:
        del os.environ["RECSYS_ROWS_NOWHERE"]


def fused_samples_per_s(args, rows=None, dim=None, stock=False) -> float:
    """torchrec's fused engine under the same DLRM, data and dense optimizer; 10 warm-up steps.
    ``stock``: torchrec's own DLRM interaction, as a torchrec user gets it (the project's computes
    the same, faster)."""
    import time

    import torch
    import torch.nn.functional as F
    import torchrec
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

    from data.batches import BatchReader
    from recsys.datasets import sources
    from recsys.model import build_dlrm, dense_optimizer, dense_params, table_configs

    cfg = config(args, Path("unused"), "local", 1, False, 1, rows, dim)
    kind = torchrec.optim.RowWiseAdagrad if cfg.optim.optimizer == "adagrad" else torch.optim.SGD
    kwargs = {"lr": cfg.optim.lr, "eps": cfg.optim.eps} if cfg.optim.optimizer == "adagrad" else {"lr": cfg.optim.lr}
    ebc = FusedEmbeddingBagCollection(
        tables=table_configs(cfg), optimizer_type=kind, optimizer_kwargs=kwargs, device=torch.device("cpu")
    )
    model = build_dlrm(cfg, ebc, stock=stock)
    opt = dense_optimizer(cfg, dense_params(model))
    reader = BatchReader(sources(cfg).train, args.batch_size, world_size=1, rank=0, epochs=1 << 30)
    batches = [next(reader) for _ in range(args.steps + 10)]

    def step(b) -> None:
        loss = F.binary_cross_entropy_with_logits(model(b.dense_features, b.sparse_features).squeeze(1), b.labels)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for b in batches[:10]:
        step(b)
    t0 = time.perf_counter()
    for b in batches[10:]:
        step(b)
    return args.steps * args.batch_size / (time.perf_counter() - t0)


def data_spec(args, rows: int) -> str:
    """``--data preprocessed``: the synthetic stream of ``rows`` rows per table written once as
    preprocessed Criteo files (kaggle layout: days 0-5 train, then val), enough for every step and
    the warm-up. -> the ``data`` value that reads them."""
    if args.data == "synthetic":
        return "synthetic"
    folder = Path(args.tmp) / f"data-{rows}"
    if not (folder / "kaggle_labels.npy").exists():
        from data.synthetic import SyntheticSource
        from recsys.datasets import synthetic_config

        base = RunConfig(data=DataConfig(rows_per_table=rows))
        train_rows = (args.steps + WARMUP_STEPS + 2) * args.batch_size  # the timed steps, the warm-up, one read ahead
        total = -(-train_rows * 7 // 6) + 4096 * 3  # days 0-5 train; day 6's first half holds the eval samples
        samples = SyntheticSource(synthetic_config(base), "train").read(0, total)
        folder.mkdir(parents=True)
        np.save(folder / "kaggle_dense.npy", samples.dense.astype(np.float32))
        np.save(folder / "kaggle_sparse.npy", samples.sparse)
        np.save(folder / "kaggle_labels.npy", samples.labels.astype(np.int32).reshape(-1, 1))
    return f"criteo-kaggle:{folder}"


def mem_available() -> int:
    for line in open("/proc/meminfo"):
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def sweep(args, tmp: Path) -> list[tuple]:
    """Rows per table against samples/s: the tier (its own ``recsys train`` process, a row cache of
    ``--sweep-cache-mb``, so its peak RSS is its own) and the fused engine until it cannot allocate."""
    out = []
    for dim in dict.fromkeys([args.embedding_dim, args.sweep_dim]):
        for rows in [int(x) for x in args.sweep.split(",")]:
            saved, args.embedding_dim = args.embedding_dim, dim
            try:
                tier = cache_run(args, tmp / f"sweep-{rows}-{dim}", rows, args.sweep_cache_mb, 1.2, digest=False)
            except subprocess.CalledProcessError as e:
                last = (e.stderr or "").strip().splitlines()[-1:] or ["?"]
                tier = {"failed": last[0][:80]}
            finally:
                args.embedding_dim = saved
            need = 26 * rows * (dim + 1) * 4  # weights and row-wise state, fp32
            free = mem_available()
            if need > 0.8 * free:
                fused = f"cannot allocate: needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB available"
            else:
                try:
                    fused = f"{fused_samples_per_s(args, rows, dim):,.0f}"
                except (RuntimeError, MemoryError) as e:
                    fused = f"cannot allocate: {str(e).splitlines()[0][:60]}"
            out.append((rows, dim, tier, fused))
    return out


def cache_run(args, out: Path, rows: int, budget_mb: float, zipf: float, digest: bool = True) -> dict:
    """One tier run (1 trainer, 2 shards) with a row cache of ``budget_mb``, as its own process
    (``recsys train``), so that its peak RSS is the trainer's own."""
    import json

    cmd = [sys.executable, "-m", "recsys", "train", "--trainers", "1", "--shards", "2", "--max-restarts", "0"]
    cmd += ["--rows-per-table", str(rows), "--embedding-dim", str(args.embedding_dim), "--zipf", str(zipf)]
    cmd += ["--steps", str(args.steps + WARMUP_STEPS), "--batch-size", str(args.batch_size), "--eval-every", "0"]
    cmd += ["--eval-samples", "4096", "--log-every", str(args.steps), "--optimizer", args.optimizer]
    cmd += ["--held-rows-mb", f"{budget_mb:g}", "--out", str(out)]
    if not digest:  # the final digest reads every row of every table: not at the sizes of the sweep
        cmd += ["--digest-max-rows", "0"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    return json.loads((out / "summary.json").read_text())


def cache_sweep(args, tmp: Path) -> list[dict]:
    """Row cache budgets (percent of the tables' bytes) against samples/s, hit rate and the trainer's
    peak RSS, for Zipf ids (``--zipf`` of the run, 1.2) and uniform ids; budget 0 (no cache) gives the
    RSS a trainer has without one."""
    rows, dim = args.rows_per_table, args.embedding_dim
    table_mb = 26 * rows * (dim + 1) * 4 / 2**20
    out = []
    for zipf in (1.2, 0):
        budgets = [("every row", every_row_mb(rows, dim))]
        budgets += [(f"{float(x):g}%", table_mb * float(x) / 100) for x in args.cache_sweep.split(",")]
        for label, mb in budgets + [("0 (no cache)", 0.0)]:
            s = cache_run(args, tmp / f"cache-{zipf}-{mb:.0f}", rows, mb, zipf)
            c = s.get("row_cache") or {}
            hit = c["hits"] / c["lookups"] if c.get("lookups") else None
            out.append(
                {"zipf": zipf, "label": label, "mb": mb, "tput": tput(s), "hit": hit, "rss": s["max_rss_mb"], **c}
            )
    return out


def every_row_mb(rows: int, dim: int) -> float:
    """A budget that holds every row of the 26 tables (a slot per row, no eviction): the rows' bytes
    and each slot's bookkeeping (``embeddings.store.row_cache.SLOT_OVERHEAD``)."""
    from embeddings.store.row_cache import SLOT_OVERHEAD

    return 26 * rows * ((dim + 1) * 4 + SLOT_OVERHEAD) / 2**20 * 1.001


def preset_config(args, out: Path, embeddings: str, kernels=None) -> RunConfig:
    """``--preset``'s model, tables and multi-hot sizes (``recsys.config.PRESETS``), synthetic data
    generated in the step, 1 trainer; ``embeddings``: ``redis`` (2 local shards) or ``local``."""
    from recsys.config import PRESETS

    sections = RunConfig().to_dict()
    for section, values in PRESETS[args.preset].items():
        sections[section].update(values)
    sections["data"].update(data="synthetic", eval_samples=4096)
    sections["embeddings"].update(embeddings=embeddings, shards=2, kernels=kernels or args.kernels)
    sections["embeddings"]["server_nice"] = args.server_nice
    sections["optim"]["optimizer"] = args.optimizer
    sections["train"].update(
        steps=args.steps + WARMUP_STEPS,
        batch_size=args.batch_size,
        trainers=1,
        eval_every=0,
        log_every=args.steps,
        out=str(out),
        progress=False,
    )
    return RunConfig.from_dict(sections)


def preset_rounds(args, tmp: Path) -> None:
    """The tier (1 trainer, 2 shards) and the fused engine inside the project's loop
    (``--embeddings local``) under ``--preset``, back to back, alternating which goes first, for
    ``max(--pairs, 1)`` rounds: samples/s after the warm-up and their ratio per round, and medians."""
    rounds = max(args.pairs, 1)
    also = args.also_kernels
    got: dict[str, list[float]] = {"local": [], "redis": [], "also": []}
    parts: dict[str, dict] = {}
    for i in range(rounds):
        kinds = ("local", "redis") + (("also",) if also else ())
        for kind in kinds if i % 2 == 0 else kinds[::-1]:
            kernels = also if kind == "also" else None
            s = run(preset_config(args, tmp / f"preset-{kind}-{i}", "redis" if kernels else kind, kernels))
            got[kind].append(tput(s))
            parts[kind] = step_parts(s)
    ratios = [r / f for r, f in zip(got["redis"], got["local"])]
    print(f"\n--preset {args.preset}: steps={args.steps} batch={args.batch_size} optimizer={args.optimizer}")
    print("| engine | samples/s per round | median | tier / fused per round | median |")
    print("|---|---|---|---|---|")
    fused = ", ".join(f"{x:,.0f}" for x in got["local"])
    print(f"| torchrec fused EBC (--embeddings local) | {fused} | {np.median(got['local']):,.0f} | | |")
    tier = ", ".join(f"{x:,.0f}" for x in got["redis"])
    ratio = ", ".join(f"{x:.2f}" for x in ratios)
    print(
        f"| Redis tier, 1 trainer, 2 shards | {tier} | {np.median(got['redis']):,.0f} | {ratio} | {np.median(ratios):.2f}x |"
    )
    if also:
        ratios = [r / f for r, f in zip(got["also"], got["local"])]
        tier = ", ".join(f"{x:,.0f}" for x in got["also"])
        ratio = ", ".join(f"{x:.2f}" for x in ratios)
        print(
            f"| Redis tier, 1 trainer, 2 shards, --kernels {also} | {tier} | {np.median(got['also']):,.0f} | {ratio} "
            f"| {np.median(ratios):.2f}x |"
        )
    try:
        s = limit_run(preset_config(args, tmp / "preset-limit", "redis"))
        parts["limit"] = step_parts(s)
        print(f"| {LIMIT} | {tput(s):,.0f} (once, after the rounds) | | | {tput(s) / np.median(got['local']):.2f}x |")
    except Exception as e:  # noqa: BLE001 - the row says why it is missing
        print(f"| {LIMIT} | not measured: {str(e).splitlines()[-1][:120]} | | | |")
    for kind, p in parts.items():
        print(
            f"step ms ({kind}, last round): " + ", ".join(f"{k} {v:.1f}" for k, v in p.items() if isinstance(v, float))
        )


def main() -> None:
    args = parser().parse_args()
    if args.also_kernels and args.also_kernels == args.kernels:
        raise SystemExit(f"--also-kernels {args.also_kernels}: the tier's runs already use --kernels {args.kernels}")
    if args.preset:
        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
        with tempfile.TemporaryDirectory(prefix="bench-preset-") as tmp:
            preset_rounds(args, Path(tmp))
    elif args.bytes:
        from recsys.bench.dmp import print_bytes

        print_bytes(args)
    elif args.dmp:
        from recsys.bench.dmp import dmp_rounds, print_dmp

        logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
        with tempfile.TemporaryDirectory(prefix="bench-dmp-") as tmp:
            args.tmp = tmp
            runs = dmp_rounds(
                args,
                lambda w, i: config(
                    args,
                    Path(tmp) / f"dmp-tier-{w}-{i}",
                    "redis",
                    args.dmp_shards,
                    False,
                    w,
                    write_every=args.dmp_write_every,
                ),
                run,
                lambda: fused_samples_per_s(args),
            )
            print_dmp(args, runs)
    elif args.sweep:
        print_sweep(args)
    elif args.cache_sweep:
        print_cache_sweep(args)
    else:
        rows, pairs, threads = measure(args)
        print_table(args, rows)
        if pairs:
            print_pairs(args, pairs, threads)
        print_guard(args)


def print_guard(args) -> None:
    """The step guard (``recsys.bench.guard``): today's host, kernels and step parts of the fused
    engine in the project's loop and the tier's goal configuration beside the last recorded ones in
    docs/benchmarks.md, and where a move lies; ``--record-guard`` records today's."""
    from recsys.bench import guard

    runs = getattr(args, "guard_runs", {})
    if "local" not in runs or "tier" not in runs:
        print("\nguard: no run of the goal configuration (1 trainer, 2 shards) in this invocation: nothing compared")
        return
    try:
        now = guard.figures(runs["local"], runs["tier"], guard.kernel_ms())
        was, when = guard.recorded()
    except (RuntimeError, ValueError, OSError, subprocess.TimeoutExpired) as e:
        print(f"\nguard: not compared: {e}")
        return
    print(f"\nstep guard: today against docs/benchmarks.md ({when or 'nothing recorded'})\n")
    print("| figure | what | recorded | today |\n|---|---|---|---|")
    for key, what in guard.FIGURES:
        print(f"| {key} | {what} | {was.get(key, '-')} | {now.get(key, '-')} |")
    print()
    for line in guard.compare(was, now):
        print(line)
    if args.record_guard:
        guard.record(now)
        print(f"guard: recorded in {guard.DOC.relative_to(guard.ROOT)}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps per configuration")
    ap.add_argument("--batch-size", type=int, default=1024, help="global batch size")
    ap.add_argument("--rows-per-table", type=int, default=100_000, help="rows of each of the 26 tables")
    ap.add_argument("--embedding-dim", type=int, default=16, help="embedding dim")
    ap.add_argument("--optimizer", default="adagrad", choices=["sgd", "adagrad"], help="optimizer")
    ap.add_argument("--shards", default="1,2,4", help="comma-separated shard counts")
    ap.add_argument("--trainers", default="1,2", help="comma-separated trainer counts for the Redis tier")
    ap.add_argument(
        "--dmp",
        default="",
        help="only the several-trainers table: comma-separated trainer counts W, the tier with W trainers against "
        "torchrec's DistributedModelParallel on W CPU ranks, --pairs alternating rounds",
    )
    ap.add_argument(
        "--bytes",
        default="",
        help="only the bytes-per-step table on paper: comma-separated trainer counts W (e.g. 2,4,8,16,32,64)",
    )
    ap.add_argument("--bytes-batch", type=int, default=65536, help="--bytes: the larger global batch of the table")
    ap.add_argument("--dmp-shards", type=int, default=2, help="the tier's shards in the --dmp table")
    ap.add_argument("--dmp-write-every", type=int, default=0, help="--dmp: the tier's --write-every (0: its own)")
    ap.add_argument("--dmp-plot", default="", help="--dmp: write the plot (samples/s against W) to this PNG")
    ap.add_argument("--sweep", default="", help="comma-separated rows per table for the table-size sweep")
    ap.add_argument("--sweep-dim", type=int, default=64, help="second embedding dim of the sweep")
    ap.add_argument("--sweep-cache-mb", type=float, default=512, help="the tier's row cache in the sweep (MB)")
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="then N back-to-back rounds (fused engine, plain loop and in the project's loop; tier, 1 trainer "
        "2 shards): ratio of each to the faster fused figure, median",
    )
    ap.add_argument(
        "--write-every",
        type=int,
        default=1,
        help="the tier's goal configuration also with this --write-every (default 1: rows written every step; "
        "0: no such row)",
    )
    ap.add_argument(
        "--kernels",
        default="fbgemm",
        choices=["fbgemm", "torch"],
        help="the tier's pooling and its backward in every tier run (recsys train --kernels; default fbgemm)",
    )
    ap.add_argument("--server-nice", type=int, default=0, help="the tier's local shards: recsys train --server-nice")
    ap.add_argument(
        "--also-kernels",
        default="",
        choices=["", "fbgemm", "torch"],
        help="--pairs and --preset rounds: the tier's goal configuration also with these kernels (default: no such row)",
    )
    ap.add_argument(
        "--data",
        default="preprocessed",
        choices=["preprocessed", "synthetic"],
        help="preprocessed: every engine trains from the same preprocessed files; synthetic: generated in the step",
    )
    ap.add_argument(
        "--cache-sweep",
        default="",
        help="comma-separated row cache budgets in percent of the tables' bytes (e.g. 100,25,10,2): the tier's "
        "samples/s, hit rate and peak RSS at each, Zipf and uniform ids, beside the fused engine (only this)",
    )
    ap.add_argument(
        "--preset",
        default="",
        choices=["", "mlperf-v2"],
        help="only this: the tier against the fused engine under a preset (mlperf-v2: DCN-v2, multi-hot bags, "
        "MLPerf DLRM-v2's table shapes scaled down), --pairs rounds",
    )
    ap.add_argument(
        "--record-guard",
        action="store_true",
        help="write this invocation's step guard figures (host, kernels, step parts of the fused engine and "
        "the tier's goal configuration) to docs/benchmarks.md as the recorded ones",
    )
    return ap


def print_sweep(args) -> None:
    """``--sweep``: rows per table against samples/s, the tier beside the fused engine."""
    with tempfile.TemporaryDirectory(prefix="bench-sweep-") as tmp:
        args.tmp = tmp
        swept = sweep(args, Path(tmp))
    print(
        f"\nsteps={args.steps} batch={args.batch_size}; tier: 1 trainer, 2 local shards, row cache {args.sweep_cache_mb:g} MB"
    )
    print("| rows per table | dim | tier samples/s | tier hit rate | tier peak RSS MB | fused engine samples/s |")
    print("|---" * 6 + "|")
    for r, d, tier, fused in swept:
        if "failed" in tier:
            print(f"| {r:,} | {d} | failed: {tier['failed']} | | | {fused} |")
            continue
        c = tier.get("row_cache") or {}
        hit = f"{c['hits'] / c['lookups']:.3f}" if c.get("lookups") else "-"
        print(f"| {r:,} | {d} | {tput(tier):,.0f} | {hit} | {tier['max_rss_mb']:,.0f} | {fused} |")


def print_cache_sweep(args) -> None:
    """``--cache-sweep``: each row cache budget against the tier's samples/s, hit rate and RSS."""
    with tempfile.TemporaryDirectory(prefix="bench-cache-") as tmp:
        args.tmp = tmp
        table_mb = 26 * args.rows_per_table * (args.embedding_dim + 1) * 4 / 2**20
        got = cache_sweep(args, Path(tmp))
        fused = fused_samples_per_s(args)
    print(f"\nsteps={args.steps} batch={args.batch_size} tables=26x{args.rows_per_table}x{args.embedding_dim}")
    print(f"({table_mb:,.0f} MB of rows and row-wise state); torchrec fused EBC: {fused:,.0f} samples/s\n")
    print("(budgets in percent of those bytes; a slot also costs its bookkeeping, so 100% holds fewer rows")
    print("than every row; 'every row': a slot for each; RSS over: peak RSS - budget - the no-cache run's RSS)\n")
    head = "| ids | cache budget | MB | samples/s | x every row | x fused | hit rate | evicted rows | peak RSS MB |"
    print(head + " RSS over MB |")
    print("|---" * 10 + "|")
    for zipf in (1.2, 0):
        rs = [r for r in got if r["zipf"] == zipf]
        full = rs[0]["tput"]
        base = next(r["rss"] for r in rs if r["mb"] == 0)
        for r in rs:
            hit = f"{r['hit']:.3f}" if r["hit"] is not None else "-"
            over = r["rss"] - r["mb"] - base
            print(
                f"| {'Zipf 1.2' if zipf else 'uniform'} | {r['label']} | {r['mb']:,.1f} | {r['tput']:,.0f} | "
                f"{r['tput'] / full:.2f}x | {r['tput'] / fused:.2f}x | {hit} | {r.get('evicted', 0):,} | "
                f"{r['rss']:,.0f} | {over:,.0f} |"
            )


def tier_row(label: str, shards: int, trainers: int, prefetch: str, summary: dict) -> tuple:
    """One row of the main table for a run of the tier."""
    return (label, shards, trainers, prefetch, tput(summary), step_parts(summary), summary["throughput_samples_per_s"])


def same_threads(cfg: RunConfig) -> RunConfig:
    """``cfg`` (the fused engine in the project's loop) at the torch threads the tier's goal
    configuration (1 trainer, 2 local shards) gets by default."""
    from recsys.trainer import torch_threads

    tier = dataclasses.replace(cfg.embeddings, embeddings="redis", shards=2, redis="local")
    cfg.train.threads = torch_threads(dataclasses.replace(cfg, embeddings=tier), 1)
    return cfg


def pair_rounds(args, tmp: str) -> tuple[list, list]:
    """``--pairs`` rounds, each the fused engine (in the plain loop and inside the project's loop)
    and the tier's goal configuration measured back to back, in alternating order.
    -> (rounds, training-thread times)."""
    pairs, threads = [], []
    k = args.write_every
    for i in range(args.pairs):
        measures = [
            lambda: fused_samples_per_s(args),
            lambda i=i: tput(run(config(args, Path(tmp) / f"pair-local-{i}", "local", 1, False, 1))),
            lambda i=i: run(config(args, Path(tmp) / f"pair-{i}", "redis", 2, False, 1)),
        ]
        # the fused engine in the project's loop with the tier's torch threads (its cores less its servers'):
        # the tier's own work apart from the cores its Redis servers take
        same = len(measures)
        measures.append(
            lambda i=i: tput(run(same_threads(config(args, Path(tmp) / f"pair-local-t-{i}", "local", 1, False, 1))))
        )
        if k:
            measures.append(
                lambda i=i: run(config(args, Path(tmp) / f"pair-w{k}-{i}", "redis", 2, False, 1, write_every=k))
            )
        also = args.also_kernels
        if also:
            measures.append(
                lambda i=i, also=also: run(
                    config(args, Path(tmp) / f"pair-{also}-{i}", "redis", 2, False, 1, kernels=also)
                )
            )
        n = len(measures)
        order = range(n) if i % 2 == 0 else range(n - 1, -1, -1)
        got = {j: measures[j]() for j in order}
        pairs.append(
            (
                got[0],
                got[1],
                tput(got[2]),
                tput(got[same + 1]) if k else None,
                tput(got[n - 1]) if also else None,
                got[same],
            )
        )
        threads.append(
            [g.get("training_thread_ms") or {} for g in (got[2], got.get(same + 1) if k else None) if g is not None]
        )
    return pairs, threads


def measure(args) -> tuple[list, list, list]:
    """The main table's runs, then ``--pairs`` rounds: -> (table rows, rounds, training-thread times)."""
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    shard_counts = [int(s) for s in args.shards.split(",")]
    trainer_counts = [int(t) for t in args.trainers.split(",")]

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-throughput-") as tmp:
        args.tmp = tmp
        rows.append(("torchrec fused EBC (pre-built batches)", 1, 1, "-", fused_samples_per_s(args), {}, None))
        stock = fused_samples_per_s(args, stock=True)
        base = run(config(args, Path(tmp) / "local", "local", 1, False, 1))
        args.guard_runs = {"local": base}  # the step guard's (print_guard)
        rows.append(
            ("--embeddings local (fused)", 1, 1, "-", tput(base), step_parts(base), base["throughput_samples_per_s"])
        )
        for w in trainer_counts:
            for s in shard_counts:
                for prefetch in (False, True) if (s, w) == (2, 1) else (False,):
                    out = Path(tmp) / f"redis-{s}-{w}-{prefetch}"
                    summary = run(config(args, out, "redis", s, prefetch, w))
                    label = "on" if prefetch else "off"
                    cache = summary.get("row_cache") or {}
                    if prefetch and w == 1 and cache.get("capacity_rows", 0) >= cache.get("table_rows", 1):
                        label = "on (turned off: the trainer holds every row)"  # recsys/backends.py
                    k = summary.get("write_every", 1)
                    if (s, w, prefetch) == (2, 1, False):
                        args.guard_runs["tier"] = summary
                    rows.append(
                        tier_row(
                            f"redis tier, {'--prefetch' if prefetch else 'defaults'} (--write-every {k})",
                            s,
                            w,
                            label,
                            summary,
                        )
                    )
                    if w > 1 and s == 2 and not prefetch:  # the quorum's cost: replace (the default) beside restart
                        cfg = config(args, out.with_name(out.name + "-restart"), "redis", s, False, w)
                        cfg.recovery.trainer_recovery = "restart"
                        summary = run(cfg)
                        rows.append(tier_row("redis tier, --trainer-recovery restart", s, w, label, summary))
                    if (s, w, prefetch) == (2, 1, False):  # what the per-step dense save for restarts costs
                        summary = run(
                            config(args, out.with_name(out.name + "-norestart"), "redis", s, False, w, restarts=False)
                        )
                        rows.append(tier_row("redis tier, --max-restarts 0", s, w, label, summary))
                        summary = limit_run(config(args, out.with_name(out.name + "-limit"), "redis", s, False, w))
                        rows.append(tier_row(LIMIT, s, w, label, summary))
                        if args.write_every:
                            k = args.write_every
                            summary = run(
                                config(args, out.with_name(f"{out.name}-w{k}"), "redis", s, False, w, write_every=k)
                            )
                            rows.append(tier_row(f"redis tier, --write-every {k}", s, w, label, summary))
        # the reference again after the others: the machine is shared, and its figure moves most; the
        # ratios use the fastest fused figure (the strongest peer)
        rows.insert(
            1, ("torchrec fused EBC, measured again after the others", 1, 1, "-", fused_samples_per_s(args), {}, None)
        )
        rows.append(("torchrec fused EBC, torchrec's stock DLRM interaction", 1, 1, "-", stock, {}, None))
        pairs, threads = pair_rounds(args, tmp)
    return rows, pairs, threads


def print_table(args, rows: list) -> None:
    ref = max(rows[0][4], rows[1][4], rows[2][4])  # the plain loop twice, and --embeddings local
    print(
        f"\nsteps={args.steps} batch={args.batch_size} tables=26x{args.rows_per_table}x{args.embedding_dim} "
        f"optimizer={args.optimizer} data={args.data}\n"
    )
    parts = ["rows_in", "data", "compute", "rows_out", "waiting", "after", "on_cpu", "runnable", "blocked"]
    print(
        "| engine | shards | trainers | prefetch | samples/s | x fused | whole run samples/s | "
        + " | ".join(parts[:6])
        + " (ms/step) | training thread "
        + " / ".join(parts[6:])
        + " (ms/step) | CPU: training / helpers / servers (ms/step) |"
    )
    print("|---" * (9 + len(parts[:6])) + "|")
    cpu = ["cpu_training", "cpu_helpers", "cpu_servers"]
    for name, s, w, p, rate, ms, whole in rows:
        cells = " | ".join(str(ms.get(k, "")) for k in parts[:6])
        cells += " | " + (" / ".join(str(ms[k]) for k in parts[6:]) if "on_cpu" in ms else "")
        cells += " | " + (" / ".join(str(ms[k]) if ms[k] is not None else "-" for k in cpu) if cpu[0] in ms else "")
        whole = f"{whole:,.0f}" if whole is not None else ""
        print(f"| {name} | {s} | {w} | {p} | {rate:,.0f} | {rate / ref:.2f}x | {whole} | {cells} |")


def print_pairs(args, pairs: list, threads: list) -> None:
    k, also = args.write_every, args.also_kernels
    win = ([f"tier, --write-every {k}", "x fused"] if k else []) + (
        [f"tier, --kernels {also}", "x fused"] if also else []
    )
    print(
        "\n| round | order | fused, plain loop | fused, project's loop | tier (1 trainer, 2 shards, defaults) "
        "| x fused (faster) | fused, project's loop, the tier's threads | tier x that | "
        + "".join(f"{c} | " for c in win)
        + "tier's training thread on_cpu / runnable / blocked (ms/step)"
        + (f" (defaults; --write-every {k})" if win else "")
        + " |"
    )
    print("|---" * (9 + len(win)) + "|")
    names = ["plain", "loop", "tier", "loop-threads"] + ([f"w{k}"] if k else []) + ([also] if also else [])
    for i, ((plain, local, tier, window, other, same), ths) in enumerate(zip(pairs, threads)):
        order = ", ".join(names if i % 2 == 0 else names[::-1])
        split = "; ".join(" / ".join(str(th[c]) for c in ("on_cpu", "runnable", "blocked")) for th in ths if th)
        best = max(plain, local)
        extra = (f"{window:,.0f} | {window / best:.2f}x | " if k else "") + (
            f"{other:,.0f} | {other / best:.2f}x | " if also else ""
        )
        print(
            f"| {i + 1} | {order} | {plain:,.0f} | {local:,.0f} | {tier:,.0f} | {tier / best:.2f}x | "
            f"{same:,.0f} | {tier / same:.2f}x | {extra}{split} |"
        )
    for what, at in (
        [("tier, defaults", 2)]
        + ([(f"tier --write-every {k}", 3)] if k else [])
        + ([(f"tier --kernels {also}", 4)] if also else [])
    ):
        ratios = sorted(r[at] / max(r[0], r[1]) for r in pairs)
        print(
            f"\n{what}: median of {len(pairs)} rounds {float(np.median(ratios)):.2f}x "
            f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
        )
    ratios = sorted(r[2] / r[5] for r in pairs)
    print(
        f"\ntier, defaults, against the fused engine in the project's loop at the tier's threads: median of "
        f"{len(pairs)} rounds {float(np.median(ratios)):.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}x)"
    )


if __name__ == "__main__":
    main()
