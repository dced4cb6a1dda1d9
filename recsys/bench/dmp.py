"""torchrec's ``DistributedModelParallel`` on W CPU ranks: the reference for W trainers of the tier.

The strongest peer for several data-parallel trainers on one host: torchrec's distributed engine,
every rank a process of its own over gloo, the 26 tables placed table-wise by torchrec's planner on
the ``fused`` compute kernel (fbgemm's TBE on the host, ``EXACT_ROWWISE_ADAGRAD`` fused into the
backward through the sharder's fused params), the pooled rows exchanged by torchrec's all-to-all,
the dense layers in DDP. One torch thread a rank (torch's default ran DMP 3-4x slower on 2 ranks
here). The same DLRM (``recsys.model.build_dlrm``), dense optimizer, data and global batch as the
tier: each rank trains its chunk of the global batch (``BatchReader(world_size=W, rank=r)``), read
before the timed loop as the fused reference's are. samples/s after 10 warm-up steps, the global
batch counted once a step.

    dmp_samples_per_s(cfg, world_size=2, steps=200) -> {"samples_per_s": ..., "step_ms": ...}
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from recsys.clock import CPU_KINDS, cpu_between, process_cpu

WARMUP = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dmp_samples_per_s(cfg, world_size: int, steps: int, threads: int = 1, pin: bool = False) -> dict:
    """torchrec DMP on ``world_size`` spawned CPU ranks under ``cfg``'s model, tables, data, dense
    optimizer and global batch (``cfg.train.batch_size``), ``steps`` timed steps after the warm-up.
    ``pin``: each rank on cores of its own, as the tier's trainers are (``recsys.clock``).
    -> samples/s (global) and the mean step in ms (rank 0's)."""
    import torch.multiprocessing as mp

    if cfg.train.batch_size % world_size:
        raise ValueError(f"DMP reference: batch size {cfg.train.batch_size} does not split over {world_size} ranks")
    with tempfile.TemporaryDirectory(prefix="dmp-") as tmp:
        out = Path(tmp) / "result.json"
        port = free_port()
        mp.start_processes(
            _rank_main,
            args=(world_size, port, cfg.to_dict(), steps, threads, str(out), pin),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return json.loads(out.read_text())


def _rank_main(
    rank: int, world_size: int, port: int, cfg_dict: dict, steps: int, threads: int, out: str, pin: bool = False
) -> None:
    import logging
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from data.batches import BatchReader
    from recsys.clock import pin_trainer
    from recsys.config import RunConfig
    from recsys.datasets import sources
    from recsys.model import build_dlrm, dense_optimizer, table_configs

    for name in ("torch.fx._symbolic_trace", "torchrec.distributed.planner"):  # warnings about the planner's
        logging.getLogger(name).setLevel(logging.ERROR)  # dry run and topology, not about this run
    warnings.filterwarnings("ignore")
    pin_trainer(rank, world_size, pin)  # as the tier's trainers are (``--no-pin-trainers``: neither)
    torch.set_num_threads(threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        cfg = RunConfig.from_dict(cfg_dict)
        configs = table_configs(cfg)
        model = build_dlrm(cfg, EmbeddingBagCollection(tables=configs, device=torch.device("meta")))
        fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": cfg.optim.lr, "eps": cfg.optim.eps}
        if cfg.optim.optimizer == "sgd":
            fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": cfg.optim.lr}
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        constraints = {
            c.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for c in configs
        }
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world_size, compute_device="cpu"), constraints=constraints
        )
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
        dmp = DistributedModelParallel(
            model, device=torch.device("cpu"), plan=plan, sharders=[sharder], init_data_parallel=True
        )
        dense = [p for n, p in dmp.named_parameters() if "embedding_bags" not in n]
        opt = dense_optimizer(cfg, dense)
        reader = BatchReader(sources(cfg).train, cfg.train.batch_size, world_size=world_size, rank=rank, epochs=1 << 30)
        batches = [next(reader) for _ in range(steps + WARMUP)]
        reader.close()

        def step(b) -> None:
            logits = dmp(b.dense_features, b.sparse_features).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, b.labels)
            opt.zero_grad()
            loss.backward()
            opt.step()

        for b in batches[:WARMUP]:
            step(b)
        dist.barrier()
        t0, cpu0 = time.perf_counter(), process_cpu()
        for b in batches[WARMUP:]:
            step(b)
        cpu1 = process_cpu()
        dist.barrier()
        elapsed = time.perf_counter() - t0
        if rank == 0:
            res = {
                "samples_per_s": steps * cfg.train.batch_size / elapsed,
                "step_ms": 1000 * elapsed / steps,
                "cpu_ms": cpu_between(cpu0, cpu1, steps),
            }
            Path(out).write_text(json.dumps(res))
    finally:
        dist.destroy_process_group()


def unique_rows(cfg, global_batch: int, world_size: int, steps: int = 4) -> tuple[float, float, float]:
    """Measured on the run's data (``cfg``'s synthetic stream): the mean over ``steps`` global
    batches of (the most unique rows in one trainer's chunk, the unique rows of the global batch,
    the most of them one trainer owns under ``--row-exchange scatter``: ``recsys.group.owners_of``),
    every table together."""
    from data.synthetic import SyntheticSource
    from recsys.datasets import synthetic_config
    from recsys.group import owners_of

    source = SyntheticSource(synthetic_config(cfg), "train")
    most, every, owned = [], [], []
    for i in range(steps):
        sparse = np.asarray(source.read(i * global_batch, global_batch).sparse, np.int64)
        keys = sparse + (np.arange(sparse.shape[1], dtype=np.int64) << 40)  # one key space per table
        chunk = global_batch // world_size
        most.append(max(len(np.unique(keys[r * chunk : (r + 1) * chunk])) for r in range(world_size)))
        step = np.unique(keys)
        every.append(len(step))
        owned.append(int(np.bincount(owners_of(step, world_size), minlength=world_size).max()))
    return float(np.mean(most)), float(np.mean(every)), float(np.mean(owned))


def bytes_per_step(
    w: int, u_chunk: float, u_all: float, batch: int, tables: int, dim: int, u_owner: float | None = None
) -> dict[str, float]:
    """Bytes one trainer sends (= receives) in a step, on paper, for ``w`` trainers:

    - ``allgather`` (``--row-exchange gather``): every trainer's (key, gradient) rows all-gathered
      with the dense gradients, padded to 1.125x the largest chunk's plus 16 rows (gloo's ring: each
      trainer passes on the other ``w - 1`` parts);
    - ``reduce_scatter`` (``--row-exchange scatter``): each row's gradient to the trainer owning its
      key (an all-to-all: the ``(w - 1) / w`` of a chunk's rows owned elsewhere), then every owner's
      sums all-gathered, padded to 1.125x the most one owner summed, plus 17 rows (``u_owner``; the
      even share ``u_all / w`` where not given): what a trainer needs to keep every row it holds
      current, near the step's unique rows however many trainers;
    - ``alltoall``: torchrec's table-wise DMP: the ids of a chunk to the tables' owners, the pooled
      embeddings back, their gradients out again (forward and backward all-to-alls).
    """
    row = 8 + 4 * dim  # a packed key and a float32 gradient row
    chunk = batch / w
    owner = u_all / w if u_owner is None else u_owner
    return {
        "allgather": (w - 1) * (1.125 * u_chunk + 16) * row,
        "reduce_scatter": (w - 1) / w * u_chunk * row + (w - 1) * (1.125 * owner + 17) * row,
        "alltoall": (w - 1) / w * (chunk * tables * 8 + 2 * chunk * tables * dim * 4),
    }


def dmp_rounds(args, make_cfg, run_tier, fused=None) -> dict[int, dict]:
    """``--dmp 1,2,3``: for each trainer count W, ``max(--pairs, 1)`` rounds of torchrec's
    ``DistributedModelParallel`` on W ranks (``recsys.bench.dmp``) and the tier with W trainers on
    ``--dmp-shards`` shards (the run's defaults), back to back, alternating which goes first.
    ``make_cfg(w, round)``: the tier's ``RunConfig`` at ``args.batch_size``; ``run_tier(cfg)``: its
    run's summary; ``fused()``: torchrec's fused engine in one process (samples/s), measured in
    each round of W = 1 too. -> W -> {"dmp": [samples/s], "tier": [samples/s], "fused": [samples/s]
    (W = 1), "parts": the tier's last ``step_ms``, "collectives": its last ``collectives_ms``, "dmp_ms": [...],
    "cpu": {"tier": [...], "dmp": [...]} (trainer 0's and rank 0's ``cpu_ms`` a round), "batch": the global batch}."""

    out: dict[int, dict] = {}
    for w in [int(x) for x in args.dmp.split(",")]:
        got: dict = {"dmp": [], "tier": [], "fused": [], "dmp_ms": [], "parts": {}, "cpu": {"tier": [], "dmp": []}}
        batch = args.batch_size
        args.batch_size = batch - batch % w  # a global batch that splits over W (1023 for 3 out of 1024)
        got["batch"] = args.batch_size
        for i in range(max(args.pairs, 1)):
            cfg = make_cfg(w, i)
            kinds = ("dmp", "tier") + (("fused",) if w == 1 and fused is not None else ())
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                if kind == "fused":
                    got["fused"].append(fused())
                elif kind == "dmp":
                    d = dmp_samples_per_s(cfg, w, args.steps, pin=cfg.train.pin_trainers)  # pinned as the tier
                    got["dmp"].append(d["samples_per_s"])
                    got["dmp_ms"].append(d["step_ms"])
                    got["cpu"]["dmp"].append(d.get("cpu_ms"))
                else:
                    summary = run_tier(cfg)
                    got["tier"].append(
                        summary["throughput_after_warmup_samples_per_s"] or summary["throughput_samples_per_s"]
                    )
                    got["parts"] = summary["step_ms"]
                    got["collectives"] = summary.get("collectives_ms") or {}
                    got["cpu"]["tier"].append(summary.get("cpu_ms"))
            print(
                f"W={w} round {i + 1}: tier {got['tier'][-1]:,.0f}, DMP {got['dmp'][-1]:,.0f} samples/s",
                file=sys.stderr,
                flush=True,
            )
        out[w] = got
        args.batch_size = batch
    return out


def print_bytes(args) -> None:
    """``--bytes 2,4,8,16,32,64``: the bytes a trainer sends (= receives) a step, on paper, for each W,
    at global batches 1024 and ``--bytes-batch``, with the unique rows measured on the run's data
    (``recsys.bench.dmp.bytes_per_step``)."""
    from recsys.config import DataConfig, ModelConfig, RunConfig

    cfg = RunConfig(
        data=DataConfig(rows_per_table=args.rows_per_table), model=ModelConfig(embedding_dim=args.embedding_dim)
    )
    print(f"\ntables=26x{args.rows_per_table}x{args.embedding_dim}, synthetic Zipf data; KiB a trainer sends a step\n")
    print(
        "| global batch | W | unique rows, largest chunk | unique rows, step | most one owner sums | "
        "`--row-exchange gather` | `--row-exchange scatter` | torchrec DMP all-to-all |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in dict.fromkeys([1024, args.bytes_batch]):
        for w in [int(x) for x in args.bytes.split(",")]:
            u_chunk, u_all, u_owner = unique_rows(cfg, batch, w)
            b = bytes_per_step(w, u_chunk, u_all, batch, 26, args.embedding_dim, u_owner)
            print(
                f"| {batch} | {w} | {u_chunk:,.0f} | {u_all:,.0f} | {u_owner:,.0f} | {b['allgather'] / 1024:,.0f} | "
                f"{b['reduce_scatter'] / 1024:,.0f} | {b['alltoall'] / 1024:,.0f} |"
            )


def print_cpu(got: dict[int, dict]) -> None:
    """Where the CPU of a step goes, the tier's trainer 0 beside DMP's rank 0 (medians of rounds, ms
    a step after the warm-up, ``recsys.clock.process_cpu``'s kinds): what W processes on the host's
    cores must fit into a step."""
    kinds = list(CPU_KINDS)
    print("\nCPU a step (ms, medians of rounds): trainer 0's or rank 0's threads by kind, the local servers (all)\n")
    print("| W | engine | " + " | ".join(kinds) + " | a trainer's share: its threads + servers / W | step (ms) |")
    print("|---|---|" + "---|" * (len(kinds) + 2))
    for w, g in got.items():
        steps = {
            "tier": [1000 * g["batch"] / x for x in g["tier"]],
            "DMP": g["dmp_ms"],
        }
        for name, rounds in (("tier", g["cpu"]["tier"]), ("DMP", g["cpu"]["dmp"])):
            rounds = [r for r in rounds if r]
            if not rounds:
                continue
            med = {k: float(np.median([r.get(k) or 0.0 for r in rounds])) for k in kinds}
            share = sum(v for k, v in med.items() if k != "servers") + med["servers"] / w
            ran = {k for r in rounds for k, v in r.items() if v is not None}  # DMP has no servers: "-"
            cells = " | ".join(f"{med[k]:.2f}" if k in ran else "-" for k in kinds)
            print(f"| {w} | {name} | {cells} | **{share:.2f}** | {float(np.median(steps[name])):.1f} |")


def print_dmp(args, got: dict[int, dict]) -> None:
    """The several-trainers table (tier against DMP on as many ranks, each round's ratio and the
    median) and its plot (``--dmp-plot``)."""
    print(
        f"\nsteps={args.steps} global batch={args.batch_size} tables=26x{args.rows_per_table}x{args.embedding_dim} "
        f"optimizer={args.optimizer} data={args.data} tier shards={args.dmp_shards}"
        f"{f' --write-every {args.dmp_write_every}' if getattr(args, 'dmp_write_every', 0) else ''}; DMP: 1 torch thread a rank, "
        "table-wise on the fused kernel\n"
    )
    parts = ["quorum", "rows_in", "data", "compute", "rows_out", "waiting", "after"]
    print(
        "| W | global batch | tier samples/s per round | DMP samples/s per round | tier / DMP per round | median | "
        "DMP step (ms) | tier " + " / ".join(parts) + " (ms/step) | of which in collectives, ms (calls) a step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    medians = {}
    for w, g in got.items():
        ratios = [t / d for t, d in zip(g["tier"], g["dmp"])]
        medians[w] = (float(np.median(g["tier"])), float(np.median(g["dmp"])), float(np.median(ratios)))
        cells = " / ".join(str(g["parts"].get(k, "-")) for k in parts)
        c = g.get("collectives") or {}
        cells += f" | {c['ms']} ({c['calls']})" if c else " | -"
        print(
            f"| {w} | {g['batch']} | {', '.join(f'{x:,.0f}' for x in g['tier'])} | {', '.join(f'{x:,.0f}' for x in g['dmp'])} | "
            f"{', '.join(f'{x:.2f}' for x in ratios)} | **{medians[w][2]:.2f}x** | "
            f"{np.median(g['dmp_ms']):.1f} | {cells} |"
        )
    print_cpu(got)
    one = got.get(1, {})
    if one.get("fused"):
        ratios = [t / f for t, f in zip(one["tier"], one["fused"])]
        print(
            f"\n1 trainer against torchrec's fused engine (one process, plain loop), the same rounds: fused "
            f"{', '.join(f'{x:,.0f}' for x in one['fused'])} samples/s; tier / fused "
            f"{', '.join(f'{x:.2f}' for x in ratios)}, median **{float(np.median(ratios)):.2f}x**"
        )
    if args.dmp_plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ws = sorted(medians)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(ws, [medians[w][0] for w in ws], "o-", label="the tier (W trainers)")
        ax.plot(ws, [medians[w][1] for w in ws], "s--", label="torchrec DMP (W ranks)")
        ax.set_xlabel("trainers / ranks (W)")
        ax.set_ylabel("samples/s (median of rounds)")
        ax.set_xticks(ws)
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.dmp_plot)
        print(f"\nplot: {args.dmp_plot}")
