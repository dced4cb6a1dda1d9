"""Start what a run needs (data, local shards), launch and supervise the trainers, clean up.

``run(cfg)``: preprocess raw data once, check ``--redis`` endpoints (or start ``cfg.embeddings.shards``
local ``redis-server`` shards with ``--redis local``), then run the trainers: in-process for one
trainer, through torch's elastic launcher (``elastic_launch``) for several. Shards and trainer
processes are stopped on every exit path, Ctrl-C included.

Trainer restarts are decided here, not inside the elastic agent: a trainer that was killed (a
signal, a node failure) restarts the group, up to ``--max-restarts`` times; each new group resumes
from the per-step dense state. A trainer that reported an error (``recsys.errors``) ends the run
at once with that error's one line: restarting would only repeat it.
"""

from __future__ import annotations

import sys

_TORCH_FRESH = "torch" not in sys.modules  # torch is first imported below: nothing ran on it before

import contextlib
import dataclasses
import datetime
import gc
import logging
import multiprocessing
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from embeddings import LocalShards
from embeddings.net.cluster import seed_urls
from embeddings.net.endpoints import check_endpoints, commands_needed
from embeddings.servers.launcher import ShardSpec, free_port
from recovery.durable import layout
from recovery.durable.files import append_line, read_lines
from recsys.clock import pin_trainer
from recsys.config import ConfigError, RunConfig
from recsys.datasets import prepare, sources
from recsys.errors import TrainerFailed, default_signals, first_cause, read_errors, report_error
from recsys.results.rundir import (
    OutLock,
    check_resume,
    check_unfinished,
    claim_namespace,
    new_run_id,
    read_run_file,
    resume_config,
    write_run_file,
)
from recsys.trainer import Trainer

# errors a trainer sees when a peer died under it: not a reason to stop the run


# Trainers are forked from the launcher when that is safe: each then starts without importing torch
# and torchrec again (about 5 s of CPU a trainer, at every start and restart). A process whose
# OpenMP pool exists (any torch op run in parallel) cannot be forked: the child's first parallel op
# hangs. The pool's threads are native threads that Python did not start, so fork is chosen only
# while there are no more of those than when torch was first imported here (nothing can have run
# on it yet), or than when ``allow_fork`` was called (the CLI calls it first).
_FORK_BASELINE: int | None = None


def _native_threads() -> int | None:
    try:
        tids = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # no /proc: nothing to count with
        return None
    return len(tids - {t.native_id for t in threading.enumerate()})


if _TORCH_FRESH:
    _FORK_BASELINE = _native_threads()


def allow_fork() -> None:
    """This process may fork its trainers while it has started no threads of its own since now
    (the command line's process, which runs no tensor op before it launches trainers)."""
    global _FORK_BASELINE
    _FORK_BASELINE = _native_threads()


def start_method() -> str:
    now = _native_threads()
    if _FORK_BASELINE is None or now is None or now > _FORK_BASELINE:
        return "spawn"
    return "fork"


@contextlib.contextmanager
def shard_urls(cfg: RunConfig):
    """-> (urls, specs of local shards or [], replica URLs or [])"""
    if cfg.embeddings.embeddings == "local":
        yield [], [], []
    elif cfg.embeddings.redis == "local":
        e = cfg.embeddings
        with LocalShards(
            e.shards, replicas=e.replicas == "local", huge_pages=e.huge_pages, nice=e.server_nice
        ) as shards:
            yield shards.urls, shards.specs, shards.replica_urls
    else:
        seeds = seed_urls(cfg.embeddings.redis) if cfg.embeddings.cluster else cfg.embeddings.urls
        check_endpoints(seeds + cfg.embeddings.replica_urls, cfg.embeddings.timeout_s, needs=_needs(cfg, len(seeds)))
        yield cfg.embeddings.urls, [], cfg.embeddings.replica_urls


def _needs(cfg: RunConfig, num_seeds: int) -> list:
    """What the run sends each server given by URL (``commands_needed``), checked against its ACL."""
    rc = cfg.recovery
    n = cfg.embeddings.shards if cfg.embeddings.cluster else num_seeds

    def hit(*kinds: str) -> list[int]:  # the shards injections of these kinds take down
        return sorted({s for i in rc.injections if i.kind in kinds for s in i.shards(cfg.train.trainers, n)})

    return commands_needed(
        rc.recovery,
        num_seeds,
        len(cfg.embeddings.replica_urls),
        checkpoints=bool(rc.checkpoint_every),
        replica_wait=cfg.embeddings.replica_wait,
        cluster=cfg.embeddings.cluster,
        killed=hit("shard", "node"),
        stalled=hit("stall"),
    )


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


@contextlib.contextmanager
def _launch_settings(**env: str):
    """``os.environ`` with ``env`` (torch's launcher adds its own) and torch's launch loggers quiet
    while the trainers run; both as the caller had them afterwards: ``recsys.train`` runs in the
    user's process, and its later runs and children must not inherit a launch's settings."""
    before = dict(os.environ)
    # the agent's own reports of a dead worker are replaced by our one line
    loggers = [logging.getLogger(n) for n in ("torch.distributed.elastic", "torch.multiprocessing")]
    levels = [lg.level for lg in loggers]
    os.environ.update(env)
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for k in set(os.environ) - set(before):
            del os.environ[k]
        os.environ.update(before)
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def launch_trainers(cfg: RunConfig, urls: list[str], namespace: str, specs) -> dict | None:
    with _launch_settings(
        # a fresh rendezvous store per launch; without it gloo's second attempt hangs (torch 2.13)
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        RECSYS_SUPERVISED="1",  # trainers leave their error lines to us
        # a killed trainer leaves a semaphore for multiprocessing's tracker to reap: not the user's concern
        PYTHONWARNINGS="ignore::UserWarning:multiprocessing.resource_tracker",
    ):
        method = start_method()
        if method == "fork" and cfg.data.kind == "synthetic":
            # the synthetic teacher's AUC (0.3 s, kept per process) once here: every trainer forked
            # from this process finds it, a replacement or a restarted group too (numpy alone: no thread)
            sources(cfg)
        if cfg.replaces_trainers:  # a trainer's death stops no one: only it starts again
            from recsys.quorum.supervisor import launch_replicas

            return launch_replicas(cfg, urls, namespace, specs, method)
        return _launch_trainers(cfg, urls, namespace, specs)


def _launch_trainers(cfg: RunConfig, urls: list[str], namespace: str, specs) -> dict | None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    out = Path(cfg.train.out)
    restarts = 0
    while True:
        shutil.rmtree(layout.errors_dir(out), ignore_errors=True)
        started = time.time()
        lc = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=cfg.train.trainers,
            run_id=f"{namespace}-{restarts}",
            rdzv_backend="c10d",
            rdzv_endpoint=f"127.0.0.1:{free_port()}",
            max_restarts=0,
            monitor_interval=0.1,
            start_method=start_method(),
        )
        try:
            results = elastic_launch(lc, worker_main)(
                cfg.to_dict(), urls, namespace, [dataclasses.asdict(s) for s in specs]
            )
            return results.get(0)
        except ChildFailedError as e:
            failures = {int(r): f for r, f in e.failures.items()}
        errors = read_errors(out)
        killed = {r: f.exitcode for r, f in failures.items() if f.exitcode is not None and f.exitcode < 0}
        deaths = [d for d in read_lines(layout.trainer_failures_file(out)) if d.get("time", 0) >= started]
        first = first_cause(errors)
        if first is not None and not killed and not deaths:
            raise TrainerFailed(f"{first['who']}: {first['line']} (traceback in {layout.errors_dir(out)})")
        # the agent reports the first dead trainer it finds; a trainer that ended because its peer
        # was killed may be the one, so a death the injector recorded names the rank
        if killed:
            rank, why = min(killed), _signal_name(killed[min(killed)])
        elif deaths:
            rank, why = deaths[0]["rank"], "SIGKILL"  # an injected trainer or node failure kills itself
        else:
            rank = min(failures)
            why = f"exit status {failures[rank].exitcode}"
        if restarts >= cfg.recovery.max_restarts:
            hint = "; --max-restarts N lets the group resume" if cfg.recovery.max_restarts == 0 else " (all used)"
            raise TrainerFailed(
                f"trainer rank {rank} died ({why}) after {restarts} restart(s) of {cfg.recovery.max_restarts}{hint}"
            )
        if not deaths:  # not injected: record what the supervisor saw
            append_line(
                layout.trainer_failures_file(out), {"kind": "trainer", "rank": rank, "step": None, "time": time.time()}
            )
        restarts += 1
        time.sleep(cfg.recovery.restart_delay)  # a host that takes longer to come back
        print(  # on a line of its own: the dead trainer's progress bar ends mid-line
            f"\ntrainer rank {rank} died ({why}); restarting the trainer group ({restarts}/{cfg.recovery.max_restarts})",
            file=sys.stderr,
        )


def run(
    cfg: RunConfig, under_launcher: bool = False, resume: bool = False, take_over_namespace: bool = False
) -> dict | None:
    """Run one training job; returns rank 0's summary (None on other ranks under torchrun).
    ``resume``: finish the run in ``cfg.train.out`` (stopped by a fault) from its per-step dense
    state, checkpoints and logs (``resume_config`` gives its config; a finished run, or a config
    that changes what the run must keep, is refused: ``recsys.results.rundir``).

    The run owns its folder (a lock held here for its life) and its namespace (a claim on every
    shard, ``embeddings.net.ownership``); ``take_over_namespace`` takes a namespace another run left,
    deleting its keys."""
    out = Path(cfg.train.out)
    flag = "--resume" if resume else "--out"
    with _resumed_at(resume):
        return _run(cfg, out, flag, under_launcher, resume, take_over_namespace)


@contextlib.contextmanager
def _resumed_at(resume: bool):
    """``RECSYS_RESUMED_AT``: when a ``--resume`` began (the run's wall time counts its set-up, not
    the time it stood stopped: ``Trainer.elapsed_before``); unset for any other run."""
    before = os.environ.pop("RECSYS_RESUMED_AT", None)
    if resume:
        os.environ["RECSYS_RESUMED_AT"] = repr(time.time())
    try:
        yield
    finally:
        os.environ.pop("RECSYS_RESUMED_AT", None)
        if before is not None:
            os.environ["RECSYS_RESUMED_AT"] = before


def _run(cfg: RunConfig, out: Path, flag: str, under_launcher: bool, resume: bool, take_over_namespace: bool):
    if under_launcher:  # torchrun started us: the world is set, the shards already run
        # rank 0 writes the folder; the group's namespace is unique to this launch (rank 0 picks it)
        lock = OutLock(out, flag) if os.environ.get("RANK", "0") == "0" else contextlib.nullcontext()
        with lock:
            return worker_main(
                cfg.to_dict(),
                cfg.embeddings.urls,
                cfg.embeddings.namespace,
                claim={"take_over": take_over_namespace, "resume": resume},
            )
    if cfg.recovery.trainer_index >= 0:  # one trainer of a run launched as separate commands
        return _run_one_trainer(cfg, out, resume, take_over_namespace)
    with OutLock(out, flag):
        return _run_locked(cfg, out, resume, take_over_namespace)


def _run_one_trainer(cfg: RunConfig, out: Path, resume: bool, take_over: bool) -> dict | None:
    """``--trainer-index I``: this command is trainer I of the run, meeting the others at
    ``--lighthouse``. Trainer 0 of a launch claims the namespace and writes the run folder's files
    (start it first, or in a folder of its own); the others wait for it. A command run again after
    its trainer died joins as the replacement (the run's marks say it began)."""
    from recsys.quorum.regroup import RunMarks, train_replica
    from recsys.quorum.replica import quiet_torchft
    from recsys.results.rundir import claim_namespace, new_run_id, read_run_file, write_run_file

    quiet_torchft()  # before torchft's native logger starts

    i, ns, urls = cfg.recovery.trainer_index, cfg.embeddings.namespace, cfg.embeddings.urls
    marks = RunMarks(out, cfg.train.trainers)
    lighthouse = cfg.recovery.lighthouse if "://" in cfg.recovery.lighthouse else f"http://{cfg.recovery.lighthouse}"
    out.mkdir(parents=True, exist_ok=True)
    if i == 0 and not marks.started():
        check_endpoints(urls, cfg.embeddings.timeout_s, needs=_needs(cfg, len(urls)))
        prepare(cfg)
        run_id = read_run_file(out)["run_id"] if resume else new_run_id()
        claim_namespace(cfg, urls, ns, run_id, take_over=take_over, fresh=not resume)
        if not resume:
            layout.dense_latest(cfg.checkpoint_dir).unlink(missing_ok=True)  # an earlier run's
            write_run_file(out, ns, run_id)
        marks.clear()
    elif not marks.started():
        marks.wait_for(0)
    os.environ["RECSYS_SUPERVISED"] = "1"
    return train_replica(cfg, urls, ns, [], i, lighthouse)


def _run_locked(cfg: RunConfig, out: Path, resume: bool, take_over: bool) -> dict | None:
    """``run`` in the launching process, holding the run folder's lock."""
    if resume:  # what the command line checked already, checked where nothing else writes the folder
        check_unfinished(out, f"--resume {out}")
        check_resume(resume_config(out), cfg, f"resume {out}", lambda key: key.split(".", 1)[1])
        run_id = read_run_file(out)["run_id"]
    else:
        run_id = new_run_id()
    namespace = cfg.embeddings.namespace or f"run-{run_id[:10]}"
    if cfg.train.init_from and not resume:  # the model to start from, before anything starts
        if cfg.embeddings.embeddings != "redis":
            raise ConfigError(f"--init-from {cfg.train.init_from}: needs --embeddings redis (the rows go to the tier)")
        from recsys.results.exporter import check_init_from

        check_init_from(cfg)
    prepare(cfg)
    dense = layout.dense_latest(cfg.checkpoint_dir)
    if resume and not dense.exists():
        raise ConfigError(
            f"--resume {out}: no per-step dense state at {dense} (the run had --max-restarts 0 or never started)"
        )
    supervised = cfg.train.trainers > 1 or (cfg.embeddings.embeddings == "redis" and cfg.recovery.max_restarts > 0)
    with shard_urls(cfg) as (urls, specs, replicas):
        if cfg.embeddings.embeddings == "redis":  # before anything of the run is written: the namespace is ours
            claim_namespace(cfg, urls, namespace, run_id, take_over=take_over, fresh=not resume)
        if not resume:
            dense.unlink(missing_ok=True)  # an earlier run's
            write_run_file(out, namespace, run_id)
        if replicas:  # local replicas: the trainers learn their URLs from the config
            cfg = dataclasses.replace(cfg, embeddings=dataclasses.replace(cfg.embeddings, replicas=",".join(replicas)))
        if not supervised:  # one trainer that nothing would restart: run it here
            return Trainer(cfg, urls, namespace, specs=specs).train()
        return launch_trainers(cfg, urls, namespace, specs)


# -- one trainer process ---------------------------------------------------------------------------
def torchrun_namespace(cfg: RunConfig, urls: list[str], namespace: str, rank: int, world: int, claim: dict) -> str:
    """Under torchrun: rank 0 picks the run's id and (without ``--namespace``) a namespace unique to
    this launch, claims it on the shards and records both in the run folder; every rank gets the
    namespace from it (a broadcast on the group just formed). A group the elastic agent restarted
    (``TORCHELASTIC_RESTART_COUNT`` > 0) of the same launch, or a ``--resume``, keeps the run's.
    ``claim``: ``take_over`` (``--take-over-namespace``), ``resume`` (``--resume``)."""
    from recsys.results import rundir

    said: list = [None, None]  # rank 0's namespace, or its error line
    error: Exception | None = None
    if rank == 0:
        try:
            run_id, ns, fresh = rundir.torchrun_identity(cfg.train.out, namespace, claim.get("resume", False))
            if cfg.embeddings.embeddings == "redis":
                take_over = claim.get("take_over", False)
                rundir.claim_namespace(cfg, urls, ns, run_id, take_over=take_over, fresh=fresh)
            rundir.write_run_file(cfg.train.out, ns, run_id, launch=rundir.launch_id())
            said[0] = ns
        except Exception as e:  # noqa: BLE001 - the other ranks learn it failed; rank 0 reports it
            error, said[1] = e, str(e)
    if world > 1:
        dist.broadcast_object_list(said, src=0)
    if error is not None:
        raise error
    if said[0] is None:
        raise SystemExit(3)  # rank 0 reports why
    return said[0]


_ENDED: list = []  # the trainers of this process, never freed before it exits (see worker_main)


def worker_main(
    cfg_dict: dict, urls: list[str], namespace: str, specs: list[dict] | None = None, claim: dict | None = None
) -> dict | None:
    """Entry point of one trainer process under the launcher or torchrun (env: RANK, WORLD_SIZE).
    ``claim`` (torchrun): the group claims its namespace itself (``torchrun_namespace``); under
    the launcher, the launcher did.

    An error ends this process with exit status 3 after writing its traceback to
    ``{out}/errors/trainer{rank}.log`` and its one line to ``trainer{rank}.json`` (the launcher
    prints that line); no traceback reaches the terminal."""
    default_signals()
    cfg = RunConfig.from_dict(cfg_dict)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if os.environ.get("RECSYS_SUPERVISED"):  # this launcher's trainers, not torchrun's: cores of their own
        pin_trainer(rank, world_size, cfg.train.pin_trainers, cfg.train.threads)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    try:
        if world_size > 1:
            dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
        if claim is not None:
            namespace = torchrun_namespace(cfg, urls, namespace, rank, world_size, claim)
        trainer = Trainer(cfg, urls, namespace, world_size, rank, [ShardSpec(**s) for s in specs or []])
        # kept until the process ends: freed here, DDP's reducer would destroy the gloo group with the
        # GIL held while a gloo thread, done with the step's last allreduce, waits for the GIL to free
        # its tensors under the lock the destructor waits for (a deadlock seen at the end of runs)
        if world_size > 1:
            _ENDED.append(trainer)
        profile = os.environ.get("RECSYS_PROFILE")  # developers: cProfile of the training, per rank
        if not profile:
            return trainer.train()
        import cProfile

        with cProfile.Profile() as prof:
            try:
                return trainer.train()
            finally:
                prof.dump_stats(f"{profile}.rank{rank}")
    except Exception as e:  # noqa: BLE001 - reported in one line, traceback to the run folder
        line = report_error(Path(cfg.train.out), f"trainer{rank}", e)
        if not os.environ.get("RECSYS_SUPERVISED"):  # torchrun: nobody else prints it
            print(f"error: trainer {rank}: {line} (traceback in {cfg.train.out}/errors)", file=sys.stderr)
        raise SystemExit(3) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if os.environ.get("RECSYS_SUPERVISED") and multiprocessing.parent_process() is not None:
            gc.freeze()  # a trainer process, which ends with this call: its exit need not walk torch's heap
