"""Command line: ``python -m recsys train [flags]``.

Every flag overrides one config field (``--config FILE.toml`` gives the base). Errors in the
config or its inputs print one line and exit with status 2, before anything starts.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

from data.errors import DataError
from embeddings.errors import EmbeddingStoreError
from embeddings.servers.launcher import LauncherError
from recovery.durable import layout
from recovery.errors import RecoveryError
from recsys.config import AUTO_WINDOW, PRESETS, ConfigError, RunConfig
from recsys.errors import TrainerFailed, one_line, report_error
from recsys.results.rundir import RESUME_MAY_CHANGE

KNOWN_ERRORS = (ConfigError, DataError, EmbeddingStoreError, LauncherError, RecoveryError)


def int_list(text: str) -> list[int]:
    """``3,2,1`` -> [3, 2, 1]."""
    return [int(x) for x in text.split(",") if x.strip()]


int_list.__name__ = "comma-separated list of ints"

# flag -> (section, field, type, help)
FLAGS: dict[str, tuple[str, str, type, str]] = {
    "--data": (
        "data",
        "data",
        str,
        "synthetic | criteo-kaggle:PATH (train.txt[.gz] or a preprocessed dir) | criteo-terabyte:DIR",
    ),
    "--rows-per-table": ("data", "rows_per_table", int, "rows of each of the 26 embedding tables"),
    "--table-rows": (
        "data",
        "table_rows",
        int_list,
        "comma-separated rows of each of the 26 tables (overrides --rows-per-table)",
    ),
    "--multi-hot": (
        "data",
        "multi_hot",
        int_list,
        "comma-separated ids per bag of each of the 26 features (MLPerf DLRM-v2's multi-hot), or one for all",
    ),
    "--model": ("model", "model", str, "dlrm (dot interactions) | dcn (torchrec's DLRM_DCN: DCN-v2 low-rank crosses)"),
    "--dcn-layers": ("model", "dcn_layers", int, "dcn: cross layers"),
    "--dcn-low-rank": ("model", "dcn_low_rank", int, "dcn: rank of each cross layer's weight"),
    "--zipf": ("data", "zipf", float, "synthetic: Zipf exponent of the categorical ids (> 1; 0: uniform ids)"),
    "--teacher": ("data", "teacher", str, "synthetic: label model, logistic | dot"),
    "--eval-samples": ("data", "eval_samples", int, "held-out samples per evaluation"),
    "--embedding-dim": ("model", "embedding_dim", int, "dim of every embedding table"),
    "--embeddings": (
        "embeddings",
        "embeddings",
        str,
        "redis (the sharded tier) | local (torchrec's in-process EBC baseline)",
    ),
    "--redis": (
        "embeddings",
        "redis",
        str,
        "local (start shards here) | redis[s]://[user:pass@]host:port[,...] (shards that already run)",
    ),
    "--shards": (
        "embeddings",
        "shards",
        int,
        "shards: local servers to start with --redis local, or logical shards over a Redis Cluster "
        "(with plain URLs: one per URL)",
    ),
    "--replicas": (
        "embeddings",
        "replicas",
        str,
        "a replica per shard for --recovery replica: local (start them here) | redis[s]://host:port[,...] (one per shard)",
    ),
    "--placement": ("embeddings", "placement", str, "row -> shard map: row (hashed per row) | table"),
    "--timeout": ("embeddings", "timeout_s", float, "seconds before a silent shard is failed"),
    "--kernels": (
        "embeddings",
        "kernels",
        str,
        "the tier's pooling and its backward: fbgemm (TBE's host kernels, the fused engine's; default) | torch",
    ),
    "--held-rows-mb": (
        "embeddings",
        "held_rows_mb",
        float,
        "MB of row cache each trainer keeps for the rows it writes (no re-read on update; the least read "
        "rows go when full); 0: off",
    ),
    "--write-every": (
        "embeddings",
        "write_every",
        int,
        "with write-behind: rows reach the shards once per window of N steps (1: every step; "
        f"default 0: {AUTO_WINDOW} where the trainers write behind and no --train-through, else 1)",
    ),
    "--server-nice": (
        "embeddings",
        "server_nice",
        int,
        "local shards run N nicer than their trainers (0-19): on a host that runs nothing else the "
        "training thread goes first on a shared core; on a busy one the servers' writes and saves lag",
    ),
    "--namespace": ("embeddings", "namespace", str, "Redis key namespace of the run (default: fresh per run)"),
    "--optimizer": (
        "optim",
        "optimizer",
        str,
        "sgd | adagrad (row-wise for embeddings) | adagrad-exact | adam (lazy for embeddings)",
    ),
    "--lr": ("optim", "lr", float, "learning rate"),
    "--steps": ("train", "steps", int, "training steps"),
    "--batch-size": ("train", "batch_size", int, "global batch size (split over trainers)"),
    "--trainers": ("train", "trainers", int, "local trainer processes (torchrun sets its own world)"),
    "--threads": ("train", "threads", int, "torch threads per trainer (0: cores left after local shards)"),
    "--balance-every": (
        "train",
        "balance_every",
        int,
        "with more --chunks than trainers: every N steps a trainer slower a chunk trains fewer chunks (0: never)",
    ),
    "--chunks": (
        "train",
        "chunks",
        int,
        "the global batch in this many fixed chunks, each trained on its own and reduced in chunk order "
        "(0: one per trainer; one trainer with --chunks W ends bit-identical to W trainers)",
    ),
    "--dense-reduce": (
        "train",
        "dense_reduce",
        str,
        "chunks (gathered, summed in chunk order: exact at any trainer count) or allreduce (averaged: "
        "DDP under restart; under replace a dead trainer's chunk is skipped until it rejoins, counted lost)",
    ),
    "--row-exchange": (
        "train",
        "row_exchange",
        str,
        "how the row gradients reach every trainer: gather (all-gathered), scatter (summed by their owners, "
        "the sums gathered: bytes that do not grow with trainers) or auto (scatter from 8 trainers); same bits",
    ),
    "--seed": ("train", "seed", int, "seed of data, model init and embedding init"),
    "--eval-every": ("train", "eval_every", int, "evaluate every N steps (0: only at the end)"),
    "--log-every": ("train", "log_every", int, "metrics.jsonl line every N steps"),
    "--digest-max-rows": (
        "train",
        "digest_max_rows",
        int,
        "the final embedding_digest reads every row; tables of more rows in all skip it (null digest)",
    ),
    "--out": ("train", "out", str, "run directory"),
    "--init-from": (
        "train",
        "init_from",
        str,
        "start from the model in this torch.distributed.checkpoint folder (torchrec's DLRM, as recsys export "
        "writes it): rows streamed into the shards, the dense layers loaded",
    ),
    "--recovery": (
        "recovery",
        "recovery",
        str,
        "shard failure strategy: partial (CPR) | partial-mfu | partial-ssu | incremental | log | full | replica",
    ),
    "--checkpoint-every": (
        "recovery",
        "checkpoint_every",
        str,
        "checkpoint every K steps (0: never) or auto (see --target-pls, --mtbf)",
    ),
    "--target-pls": (
        "recovery",
        "target_pls",
        float,
        "with --checkpoint-every auto: portion of lost samples to stay under",
    ),
    "--mtbf": (
        "recovery",
        "mtbf",
        str,
        "with --checkpoint-every auto: mean steps (500) or seconds (120s) between shard failures",
    ),
    "--priority-every": (
        "recovery",
        "priority_every",
        int,
        "partial-mfu/ssu: priority save every N steps (0: a quarter of the checkpoint interval)",
    ),
    "--priority-budget": ("recovery", "priority_budget", int, "partial-mfu/ssu: rows per shard per priority save"),
    "--ssu-fraction": ("recovery", "ssu_fraction", float, "partial-ssu: fraction of updated rows tracked"),
    "--mfu-capacity": ("recovery", "mfu_capacity", int, "partial-mfu: rows counted per shard by the sketch"),
    "--ssu-capacity": ("recovery", "ssu_capacity", int, "partial-ssu: sampled rows counted per shard"),
    "--flush-every": (
        "recovery",
        "flush_every",
        int,
        "incremental: write the rows dirtied since the last flush every N steps (0: a tenth of the checkpoint interval)",
    ),
    "--checkpoint-dir": ("recovery", "checkpoint_dir", str, "checkpoint folder (default OUT/checkpoints)"),
    "--keep-checkpoints": ("recovery", "keep_checkpoints", int, "checkpoints kept"),
    "--max-abandoned-checkpoints": (
        "recovery",
        "max_abandoned_checkpoints",
        int,
        "checkpoints abandoned in a row (disk full, snapshot refused; each a warning line) before the run "
        "stops with an error (0: never)",
    ),
    "--log-dir": ("recovery", "log_dir", str, "per-shard update logs (default OUT/logs with --recovery log)"),
    "--log-fsync": ("recovery", "log_fsync", str, "log durability: always | every:N (ms) | none"),
    "--shard-restart-timeout": (
        "recovery",
        "shard_restart_timeout",
        float,
        "shards given by URL: seconds a failed shard's server has to come back before the run stops (resumable)",
    ),
    "--through-budget-mb": (
        "recovery",
        "through_budget_mb",
        float,
        "with --train-through: MB one trainer's outage rows and kept gradients may take before the run waits "
        "for the restore",
    ),
    "--max-restarts": (
        "recovery",
        "max_restarts",
        int,
        "trainers started again after deaths (replace: one at a time; restart: the group; 0: off); "
        "while on, rank 0 saves the dense state each step",
    ),
    "--trainer-recovery": (
        "recovery",
        "trainer_recovery",
        str,
        "a trainer's death: replace (the others go on at a new quorum, only it starts again, healed from a "
        "peer; bit-identical) or restart (the whole group starts again); auto: replace with 2+ trainers",
    ),
    "--lighthouse": (
        "recovery",
        "lighthouse",
        str,
        "with replace: host:port of a running torchft Lighthouse to join (default: one on loopback for the run)",
    ),
    "--restart-delay": (
        "recovery",
        "restart_delay",
        float,
        "seconds before a dead trainer (replace) or the group (restart) starts again: a slower host",
    ),
    "--trainer-index": (
        "recovery",
        "trainer_index",
        int,
        "with replace: run only this trainer of --trainers N, meeting the others at --lighthouse (trainers "
        "launched separately, e.g. on several machines; run it again when it dies); needs --redis, --namespace",
    ),
    "--trainer-timeout": (
        "recovery",
        "trainer_timeout",
        float,
        "with replace: seconds a collective waits for a live but slow trainer before the step is discarded",
    ),
    "--quorum-every": (
        "recovery",
        "quorum_every",
        int,
        "with replace: the trainers meet at a torchft quorum every K steps (default 4; 1: every step); a "
        "replacement waits up to K - 1 steps more to join, a death is met at once whatever K",
    ),
}


# config field -> the flag that sets it (the switches besides FLAGS included)
_FLAG_OF = {f"{section}.{field}": flag for flag, (section, field, _, _) in FLAGS.items()} | {
    "embeddings.prefetch": "--prefetch",
    "embeddings.write_behind": "--no-write-behind",
    "embeddings.huge_pages": "--huge-pages",
    "embeddings.replica_wait": "--replica-wait",
    "train.save_model": "--save-model",
    "train.keep_model": "--no-keep-model",
    "train.pin_trainers": "--no-pin-trainers",
    "train.tensorboard": "--tensorboard",
    "recovery.priority_half": "--priority-half",
    "recovery.train_through": "--train-through",
    "recovery.inject": "--inject",
}
RESUME_FLAGS = {_FLAG_OF[k] for k in RESUME_MAY_CHANGE if k in _FLAG_OF and k != "train.out"}


def _doc(module: str) -> str:
    """A module's docstring, read from its source: the parser is built before anything heavy is
    imported (a refused resume is decided before torch is)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m recsys", description="DLRM training on a Redis embedding tier")
    sub = ap.add_subparsers(dest="command", required=True)
    add_train_arguments(sub.add_parser("train", help="train a DLRM model"))
    from recsys.bench.recovery import __doc__ as bench_doc
    from recsys.bench.recovery import add_arguments

    br = sub.add_parser(
        "bench-recovery",
        help="benchmark the recovery strategies",
        description=bench_doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(br)
    cp = sub.add_parser(
        "compare",
        help="put two or more run folders side by side (table and plot)",
        description=_doc("recsys.results.comparison"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cp.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run folders (changes are against the first)")
    cp.add_argument("--out", default=None, help="where compare.md and compare.png go (default: beside the first run)")
    vf = sub.add_parser(
        "verify",
        help="rebuild a finished run's rows from its checkpoint and update logs and compare them with its final rows",
        description=_doc("recsys.results.verify"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    vf.add_argument("run", metavar="RUN_DIR", help="the folder of a finished run")
    ex = sub.add_parser(
        "export",
        help="write a finished run's trained model as a torch.distributed.checkpoint of torchrec's DLRM",
        description=_doc("recsys.results.exporter"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ex.add_argument("run", metavar="RUN_DIR", help="the folder of a finished run (its final model: final/)")
    ex.add_argument("--to", required=True, metavar="DIR", help="the DCP folder to write (new, or empty)")
    ex.add_argument(
        "--optimizer-state",
        action="store_true",
        help="also write the optimizer state: the dense optimizer's and each table's row optimizer's (optim.*)",
    )
    ex.add_argument(
        "--step",
        type=int,
        default=None,
        help="export the run's checkpoint of this committed step instead of its final model (the run may still run)",
    )
    ex.add_argument(
        "--redis",
        default=None,
        metavar="URLS",
        help="read the rows from these live servers (the run's shards, comma-separated, one per shard), which must "
        "stand at the exported step, instead of its snapshots",
    )
    ex.add_argument(
        "--block-mb",
        type=float,
        default=8.0,
        help="rows are read and written in blocks of about this many MB, one at a time (default: 8)",
    )
    return ap


def add_train_arguments(tr: argparse.ArgumentParser) -> None:
    """``recsys train``'s flags: every config field's (``FLAGS``), then the switches and actions."""
    tr.add_argument("--config", help="TOML file with [data] [model] [embeddings] [optim] [train] [recovery] sections")
    defaults = RunConfig().to_dict()  # a flag not given keeps the config's value: these, or --config's
    for flag, (section, field, typ, help_) in FLAGS.items():
        value = defaults[section][field]
        shown = f"; default: {value}" if value not in ("", None) else ""
        tr.add_argument(flag, type=str, default=None, help=f"{help_} ({typ.__name__}{shown})")
    tr.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default=None,
        help="mlperf-v2: MLPerf DLRM-v2's 26 table shapes (rows over 200) and multi-hot sizes, DCN-v2 "
        "(--model dcn), dims scaled to one machine; flags given with it override it",
    )
    tr.add_argument(
        "--prefetch", action="store_true", help="prefetch the next batch's rows while this batch trains (default off)"
    )
    tr.add_argument("--no-prefetch", action="store_true", help="do not prefetch the next batch's rows (the default)")
    tr.add_argument(
        "--inject",
        action="append",
        default=None,
        metavar="SPEC",
        help="inject a failure (repeatable): shard:K@WHEN | stall:K@WHEN:SECONDS | trainer:R@WHEN | node:R@WHEN | "
        "corrupt-checkpoint:latest[@step=N] | corrupt-log:K@step=N | corrupt-dense@step=N | slow-restore:K:SECONDS (the next restore of shard K takes that "
        "much longer) | slow-trainer:R:FACTOR[@step=N] (from step N trainer R's compute takes FACTOR times as long); WHEN is step=N, t=SECONDS (after training started) or, for shard "
        "kills, during=checkpoint|eval|recovery|resume",
    )
    add_switches(tr)
    tr.add_argument(
        "--resume",
        metavar="RUN_DIR",
        help="finish a run that stopped (a shard that did not come back, Ctrl-C) from its dense state, "
        "checkpoints and logs; its config.toml is the base. A finished run is refused (its results are kept), "
        "and so is a flag that changes the model, tables, data, sharding, strategy or namespace; these may "
        "change: " + ", ".join(sorted(RESUME_FLAGS)),
    )
    tr.add_argument(
        "--take-over-namespace",
        action="store_true",
        help="the --namespace belongs to another run (its claim on the shards) that is gone: delete every key "
        "of the namespace on every shard (its rows, its claim) and claim it for this run",
    )


def add_switches(tr: argparse.ArgumentParser) -> None:
    """``recsys train``'s on/off switches that are no config field of their own."""
    tr.add_argument(
        "--no-write-behind",
        action="store_true",
        help="write each step's rows before the next step starts (default with one trainer: while it computes)",
    )
    tr.add_argument(
        "--huge-pages",
        action="store_true",
        help="local shards keep their memory in 2 MB pages (jemalloc thp:always; needs the host's THP at "
        "madvise or always)",
    )
    tr.add_argument("--save-model", action="store_true", help="write final_model.pt (small tables only)")
    tr.add_argument(
        "--no-pin-trainers",
        action="store_true",
        help="leave the trainers' cores to the scheduler (default with 2+ trainers started here: trainer I of W "
        "on the I-th W-th of the cores)",
    )
    tr.add_argument(
        "--no-keep-model",
        action="store_true",
        help="do not write the trained model into OUT/final at the end (by default every tier run does: each "
        "shard's final snapshot and the dense state, as a checkpoint; recsys export reads it)",
    )
    tr.add_argument(
        "--tensorboard",
        action="store_true",
        help="also write metrics and failures as TensorBoard events in OUT/tensorboard (pip install .[tensorboard])",
    )
    tr.add_argument(
        "--replica-wait",
        action="store_true",
        help="with --replicas: each step's writes wait until the replica has them (WAIT 1): a failover loses nothing",
    )
    tr.add_argument(
        "--priority-half",
        action="store_true",
        help="partial-mfu/ssu and incremental: saved weights as float16 (optimizer state stays float32)",
    )
    tr.add_argument(
        "--train-through",
        action="store_true",
        help="a failed shard is restored in the background while every trainer keeps stepping (partial, "
        "partial-mfu, partial-ssu, incremental, log); rows its writer caches are read exactly, others from "
        "their fallback (counted), and their updates are applied to the restored rows when it rejoins",
    )


def flag_of(key: str) -> str:
    """A config field (``section.field``) as the command line sets it: its flag, or where it is set."""
    if key in _FLAG_OF:
        return _FLAG_OF[key]
    section, field = key.split(".", 1)
    return f"[{section}] {field}"


def resolve(args: argparse.Namespace) -> RunConfig:
    base = None
    if args.resume:
        from recsys.results.rundir import resume_config

        if args.config:
            raise ConfigError(f"--config {args.config}: a resumed run's config is its own ({args.resume}/config.toml)")
        cfg = base = resume_config(args.resume)
        if args.out is not None and Path(args.out).resolve() != Path(args.resume).resolve():
            raise ConfigError(f"--out {args.out!r}: a resumed run writes to its own folder ({args.resume})")
    else:
        cfg = RunConfig.from_toml(args.config) if args.config else RunConfig()
    sections = cfg.to_dict()
    if args.preset:
        if args.resume:
            raise ConfigError(f"--preset {args.preset}: a resumed run's config is its own ({args.resume}/config.toml)")
        for section, values in PRESETS[args.preset].items():
            sections[section].update(values)
    for flag, (section, field, typ, _) in FLAGS.items():
        raw = getattr(args, flag[2:].replace("-", "_"))
        if raw is None:
            continue
        try:
            sections[section][field] = typ(raw)
        except ValueError:
            raise ConfigError(f"{flag} {raw!r}: not a valid {typ.__name__}") from None
    if args.inject:
        sections["recovery"]["inject"] = list(args.inject)
    if args.prefetch and args.no_prefetch:
        raise ConfigError("--prefetch and --no-prefetch: give one")
    if args.prefetch or args.no_prefetch:
        sections["embeddings"]["prefetch"] = bool(args.prefetch)
    if args.no_write_behind:
        sections["embeddings"]["write_behind"] = False
    if args.huge_pages:
        sections["embeddings"]["huge_pages"] = True
    if args.save_model:
        sections["train"]["save_model"] = True
    if args.no_keep_model:
        sections["train"]["keep_model"] = False
    if args.no_pin_trainers:
        sections["train"]["pin_trainers"] = False
    if args.tensorboard:
        sections["train"]["tensorboard"] = True
    if args.replica_wait:
        sections["embeddings"]["replica_wait"] = True
    if args.priority_half:
        sections["recovery"]["priority_half"] = True
    if args.train_through:
        sections["recovery"]["train_through"] = True
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ
    if under_torchrun:
        # the launcher sets the world; batch divisibility is checked against it
        sections["train"]["trainers"] = int(os.environ["WORLD_SIZE"])
    cfg = RunConfig.from_dict(sections, source="flags")
    if under_torchrun and cfg.embeddings.embeddings == "redis" and cfg.embeddings.redis == "local":
        raise ConfigError("redis='local': under torchrun, --redis must list the URLs of shards that already run")
    if base is not None:
        from recsys.results.rundir import check_resume

        check_resume(base, cfg, f"--resume {args.resume}", flag_of)
    return replace(cfg)


def _allow_fork() -> None:
    """This process has run no tensor op: its trainers may be forked (``recsys.launch``)."""
    from recsys.launch import allow_fork

    allow_fork()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from recsys import api

    # kill -USR1: every thread's stack on stderr, the process runs on (where a stuck run waits)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    out = None
    try:
        if args.command == "bench-recovery":
            out = args.out
            _allow_fork()
            api.bench_recovery(**vars(args))
            return 0
        if args.command == "verify":
            return _verify(args)
        if args.command == "export":
            return _export(args)
        if args.command == "compare":
            out = args.out or "."
            where = api.compare(args.runs, out=args.out)
            print(f"wrote {where}/compare.md and {where}/compare.png")
            return 0
        cfg = resolve(args)
        out = cfg.train.out
        _allow_fork()
        run = api.train(cfg, resume=bool(args.resume), take_over_namespace=args.take_over_namespace)
        summary = run.summary.raw if run.summary is not None else None
    except KNOWN_ERRORS as e:
        if args.command == "train" and out is not None and not isinstance(e, ConfigError) and Path(out).is_dir():
            report_error(Path(out), "main", e)  # a run's fault: its traceback beside its outputs
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2
    except TrainerFailed as e:
        print(f"\nerror: {e}", file=sys.stderr)  # a trainer's progress bar may end mid-line
        return 1
    except KeyboardInterrupt:
        print("interrupted: trainers and shards stopped", file=sys.stderr)
        return 130
    except SystemExit:
        raise
    except Exception as e:  # torch elastic turns SIGINT/SIGTERM into SignalException after stopping the trainers
        if type(e).__name__ == "SignalException":
            print(f"interrupted ({e}): trainers and shards stopped", file=sys.stderr)
            return 130
        line = report_error(Path(out or "."), "main", e)
        print(f"error: {line} (traceback in {layout.error_traceback(out or '.', 'main')})", file=sys.stderr)
        return 1
    if summary is not None:
        _print_summary(cfg, summary)
    return 0


def _verify(args) -> int:
    """``recsys verify RUN``: 0 when the rows rebuild, 1 when they do not, 2 on a bad run folder."""
    from recsys.results.verify import VerifyError, verify

    try:
        code, line = verify(args.run, say=lambda x: print(x, file=sys.stderr))
    except VerifyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(line, file=sys.stdout if code == 0 else sys.stderr)
    return code


def _export(args) -> int:
    """``recsys export RUN --to DIR``: 0 with the export's line, 2 with its error's."""
    from recsys.results.exporter import ExportError, export

    try:
        stats = export(
            args.run,
            args.to,
            optimizer_state=args.optimizer_state,
            block_mb=args.block_mb,
            step=args.step,
            redis=args.redis,
        )
        print(stats.line())
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _print_summary(cfg, summary: dict) -> None:
    """``recsys train``'s closing lines: the summary's headline figures as JSON, then in words."""
    ceiling = summary["ceiling_auc"]
    print(
        json.dumps(
            {
                k: summary[k]
                for k in (
                    "steps_completed",
                    "throughput_samples_per_s",
                    "final_auc",
                    "final_logloss",
                    "ceiling_auc",
                )
            }
        )
    )
    print(
        f"outputs in {cfg.train.out}/ (summary.json, metrics.jsonl, config.toml, plots/training.png)\n"
        f"final AUC {summary['final_auc']:.4f}"
        + (f"  beside the teacher's ceiling {ceiling:.4f}" if ceiling is not None else "")
        + f"\n{failures_line(summary)}"
    )


def failures_line(summary: dict) -> str:
    """The closing line on failures: how many, of what, what they lost (updates, PLS)."""
    failures = summary.get("failures") or []
    if not failures:
        return "failures: none"
    kinds: dict[str, int] = {}
    for f in failures:
        kinds[str(f.get("kind", "shard"))] = kinds.get(str(f.get("kind", "shard")), 0) + 1
    what = ", ".join(f"{n} {k}" for k, n in kinds.items())
    from recovery.journal import stale_words

    lost = sum(int(f.get("lost_updates") or 0) for f in failures)
    pls = float(summary.get("pls") or 0.0)
    return (
        f"failures: {len(failures)} ({what}), {lost:,} updates lost{stale_words(failures)}, "
        f"PLS {pls:.6f} ({100 * pls:.4f}% of samples)"
    )
