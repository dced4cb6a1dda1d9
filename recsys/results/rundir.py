"""A run's folder and namespace belong to that run: who writes the folder, what a resume may change.

- ``OutLock``: the launching process holds an exclusive ``flock`` on ``{out}/run.lock`` for the
  run's life (trainer processes it starts need none): a second run into the folder is refused in
  one line naming the pid that writes there.
- ``run.json`` (``recovery.durable.layout.RUN_FILE``): the run's namespace and id. The id is the run's claim on its
  namespace (``embeddings.net.ownership``): ``--resume`` takes its own claim back with it.
- ``check_resume``: a resumed run continues the same run. A finished run is refused (its results
  are kept); a setting that changes the model, tables, data stream, sharding, strategy or
  namespace is refused by name, with the run's value and the new one. ``RESUME_MAY_CHANGE`` lists
  what may change.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import uuid
from collections.abc import Callable
from pathlib import Path

from recovery.durable import layout
from recsys.config import ConfigError, RunConfig

RESUME_MAY_CHANGE: frozenset[str] = frozenset(
    {
        # how the run is watched and reported: no effect on what it computes
        "train.eval_every",
        "train.log_every",
        "train.progress",
        "train.save_model",
        "train.keep_model",
        "train.threads",
        "train.pin_trainers",
        "train.balance_every",
        "train.row_exchange",
        "train.tensorboard",
        "train.digest_max_rows",
        # where the shards are and how they are reached (same count, same kind: checked apart)
        "embeddings.redis",
        "embeddings.replicas",
        "embeddings.timeout_s",
        "embeddings.prefetch",
        "embeddings.held_rows_mb",
        "embeddings.replica_wait",
        "embeddings.huge_pages",
        "embeddings.server_nice",
        # how failures are met from here on (not the strategy or what it saves)
        "recovery.max_restarts",
        "recovery.max_abandoned_checkpoints",
        "recovery.shard_restart_timeout",
        "recovery.keep_checkpoints",
        "recovery.log_fsync",
        "recovery.inject",
        # the run folder itself (a resumed run writes to its own folder: checked apart)
        "train.out",
    }
)
"""Config fields (``section.field``) a resumed run may set anew. Everything else is the run: the
model (``[model]``, ``[optim]``), tables and data stream (``[data]``, ``seed``, ``batch_size``,
``steps``), sharding (shard count, ``placement``, ``trainers``, ``embeddings``), the strategy and
what it saves (``recovery``, ``checkpoint_every``, priority and flush settings, log and checkpoint
folders, ``write_behind``, ``write_every``) and the namespace; a resume that changes one of them is
refused. Of the fields here, ``redis`` may change only to the same number of shards of the same
kind (plain or cluster), and ``max_restarts`` only to 1 or more (a resume starts from the per-step
dense state those restarts save)."""

FIXED_WHY = "a resumed run keeps its model, tables, data, sharding, strategy and namespace"


# -- the folder lock ------------------------------------------------------------------------------
def _pid_in(fd: int) -> str:
    try:
        return os.pread(fd, 64, 0).decode().strip() or "?"
    except (OSError, UnicodeDecodeError):
        return "?"


class OutLock:
    """``with OutLock(out, flag)``: hold ``{out}/run.lock`` (flock, exclusive, non-blocking) or raise
    ``ConfigError``: "``flag`` OUT: another run (pid N) is writing there". The lock goes with the
    process (a kill releases it); the file stays."""

    def __init__(self, out: str | os.PathLike, flag: str = "--out") -> None:
        self.out, self.flag = Path(out), flag
        self._fd: int | None = None

    def __enter__(self) -> OutLock:
        self.out.mkdir(parents=True, exist_ok=True)
        fd = os.open(layout.lock_file(self.out), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _pid_in(fd)
            os.close(fd)
            raise ConfigError(f"{self.flag} {self.out}: another run (pid {pid}) is writing there") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def writer_of(out: str | os.PathLike) -> int | None:
    """The pid of the run that holds ``out``'s lock (on this host), or None: nothing writes there."""
    path = layout.lock_file(out)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = _pid_in(fd)
        return int(pid) if pid.isdigit() else -1
    finally:
        os.close(fd)  # closing drops a lock this took
    return None


# -- run.json: namespace and run id ---------------------------------------------------------------
def new_run_id() -> str:
    return uuid.uuid4().hex


def read_run_file(run_dir: str | os.PathLike, flag: str = "--resume") -> dict:
    path = layout.run_file(run_dir)
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict) or not isinstance(d.get("namespace"), str):
            raise ValueError
    except OSError:
        raise ConfigError(
            f"{flag} {run_dir}: no {layout.RUN_FILE} there (not the folder of a run that started)"
        ) from None
    except ValueError:
        raise ConfigError(f"{flag} {run_dir}: {path} is damaged") from None
    # a run from before run ids: its claim (if any) is under this name
    d.setdefault("run_id", "legacy-" + d["namespace"])
    return d


def write_run_file(run_dir: str | os.PathLike, namespace: str, run_id: str, **extra) -> None:
    from recovery.durable.files import write_atomic

    write_atomic(layout.run_file(run_dir), json.dumps({"namespace": namespace, "run_id": run_id, **extra}))


# -- what a resume may change ---------------------------------------------------------------------
def finished_at(run_dir: str | os.PathLike) -> int | str | None:
    """The step the run in ``run_dir`` finished at (``summary.json`` is written once, atomically, as
    its last act), '?' if the summary cannot be read, None if the run did not finish."""
    path = layout.summary_file(run_dir)
    if not path.exists():
        return None
    try:
        return int(json.loads(path.read_text())["steps_completed"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def check_unfinished(run_dir: str | os.PathLike, prefix: str) -> None:
    step = finished_at(run_dir)
    if step is not None:
        raise ConfigError(
            f"{prefix}: the run finished at step {step}; results kept (a finished run is not extended: "
            "start a new run with another --out)"
        )


def _shard_count(cfg: RunConfig) -> int:
    return len(cfg.embeddings.urls) or cfg.embeddings.shards


def _show(v) -> str:
    if isinstance(v, str) and "://" in v:  # endpoints: never a password on the terminal
        return re.sub(r"://[^/@,]*@", "://", v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, list):
        return json.dumps(v)
    return str(v)


def resume_changes(base: RunConfig, new: RunConfig) -> list[tuple[str, str, str]]:
    """Settings ``new`` changes that a resume of ``base`` must keep: [(section.field, run's, new)]."""
    out = []
    old_d, new_d = base.to_dict(), new.to_dict()
    for section, values in old_d.items():
        for name, was in values.items():
            key = f"{section}.{name}"
            now = new_d[section][name]
            if key == "embeddings.shards":
                was, now = _shard_count(base), _shard_count(new)
            if was == now or (key in RESUME_MAY_CHANGE and key != "embeddings.redis"):
                continue
            if key == "embeddings.redis":
                if base.embeddings.cluster != new.embeddings.cluster:
                    out.append((key, _show(was), _show(now)))
                continue  # a different count of shards is named as the shards'
            if key == "embeddings.shards" and base.embeddings.redis != new.embeddings.redis:
                key, was, now = (
                    "embeddings.redis",
                    f"{_show(base.embeddings.redis)} ({was} shards)",
                    f"{_show(new.embeddings.redis)} ({now} shards)",
                )
            out.append((key, _show(was), _show(now)))
    if new.recovery.max_restarts == 0 and base.recovery.max_restarts != 0:
        out.append(("recovery.max_restarts", _show(base.recovery.max_restarts), "0"))
    return out


def check_resume(base: RunConfig, new: RunConfig, prefix: str, name_of: Callable[[str], str]) -> None:
    """Refuse (``ConfigError``, one line) a resume whose config ``new`` changes what the run ``base``
    must keep; ``name_of(section.field)`` names a setting as the caller's user gives it (a flag)."""
    changes = resume_changes(base, new)
    if not changes:
        return
    said = ", ".join(f"{name_of(key)} {now} differs from the run's {was}" for key, was, now in changes)
    if any(key == "recovery.max_restarts" for key, _, _ in changes):
        said += " (a resume starts from the per-step dense state that --max-restarts >= 1 saves)"
    raise ConfigError(f"{prefix}: {said}; {FIXED_WHY}")


# -- the namespace claim ----------------------------------------------------------------------------
def owner_running(owner) -> int | None:
    """The pid of the run that owns a namespace if it still writes its folder (on this host), else None."""
    if owner.host != socket.gethostname() or owner.out in ("", "?"):
        return None
    return writer_of(owner.out)


def claim_namespace(
    cfg: RunConfig, urls: list[str], namespace: str, run_id: str, *, take_over: bool, fresh: bool
) -> list[int]:
    """Claim ``namespace`` on the run's shards (``embeddings.net.ownership``) for run ``run_id`` in
    ``cfg.train.out``. -> the shards whose keys a take-over deleted."""
    from embeddings.net.ownership import Claim
    from embeddings.net.ownership import claim_namespace as claim
    from recsys.backends import open_store

    out = os.path.abspath(cfg.train.out)
    store = open_store(cfg, urls, namespace, replicas=False)  # the claim lives on the primaries

    def alive(owner: Claim) -> int | None:
        if os.path.abspath(owner.out) == out:
            return None  # its folder is ours now: this process holds its lock
        return owner_running(owner)

    try:
        return claim(store, Claim.mine(run_id, out), take_over=take_over, fresh=fresh, alive=alive)
    finally:
        store.close()


# -- torchrun ---------------------------------------------------------------------------------------
def launch_id() -> str:
    """This torchrun launch on this host: its elastic agent (the trainer's parent) outlives the
    trainer groups it restarts."""
    return f"{socket.gethostname()}:{os.getppid()}"


def torchrun_identity(out: str | os.PathLike, namespace: str, resume: bool = False) -> tuple[str, str, bool]:
    """Rank 0 under torchrun: (run id, namespace, fresh). A new id, and without ``namespace`` one
    unique to this launch (torchrun's ``TORCHELASTIC_RUN_ID`` is "none" for every launch without
    ``--rdzv-id``); a group the agent restarted keeps the ones its launch recorded in the folder,
    and so does a ``--resume`` of the run there."""
    if resume:
        d = read_run_file(out)
        return d["run_id"], d["namespace"], False
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
        try:
            d = read_run_file(out)
        except ConfigError:
            d = {}
        if d.get("launch") == launch_id() and namespace in ("", d["namespace"]):
            return d["run_id"], d["namespace"], False
    run_id = new_run_id()
    return run_id, namespace or f"run-{run_id[:10]}", True


# -- reading a run folder back ----------------------------------------------------------------------
def run_config(run_dir: str | Path, who: str = "") -> RunConfig:
    """The config of the run in ``run_dir``, its paths taken where the folder lies now: a run folder
    can be copied, moved or archived, and every command reads the folder it is given, never the
    path the run was started with. ``train.out`` is ``run_dir``; a ``--checkpoint-dir`` or
    ``--log-dir`` that lay inside the run's folder is taken inside ``run_dir``; one given outside it
    is kept as the run recorded it (``outside_paths`` names it). ``ConfigError`` in one line
    (``who``: the command) where there is no config or it does not read."""
    run_dir = Path(run_dir)
    who = f"{who} {run_dir}" if who else str(run_dir)
    path = layout.config_file(run_dir)
    if not path.is_file():
        raise ConfigError(f"{who}: no {path.name} there (not the folder of a run)")
    try:
        d = RunConfig.from_toml(path).to_dict()
    except ValueError as e:  # a field the config's own checks refuse
        raise ConfigError(f"{who}: {path}: {e}") from None
    was = os.path.abspath(d["train"]["out"])
    d["train"]["out"] = str(run_dir)
    for key in ("checkpoint_dir", "log_dir"):
        given = d["recovery"][key]
        if given:
            rel = os.path.relpath(os.path.abspath(given), was)
            if not _outside(rel):  # inside the run's folder: where that lies now
                d["recovery"][key] = str(run_dir / rel) if rel != "." else str(run_dir)
    return RunConfig.from_dict(d, source=str(path))


def _outside(rel: str) -> bool:
    """A relative path that leaves its base folder (``..``, ``../x``; not a folder named ``..x``)."""
    return rel == os.pardir or rel.startswith(os.pardir + os.sep)


def outside_paths(cfg: RunConfig, who: str) -> list[str]:
    """A line per durable folder of the run that lies outside its folder (``--checkpoint-dir``,
    ``--log-dir`` given elsewhere): the command ``who`` reads it there, and says so."""
    out = os.path.abspath(cfg.train.out)
    lines = []
    for flag, folder in (("--checkpoint-dir", cfg.checkpoint_dir), ("--log-dir", cfg.log_dir)):
        if folder and _outside(os.path.relpath(os.path.abspath(folder), out)):
            lines.append(
                f"{who}: reads {flag} {folder}, outside the run folder {cfg.train.out} (as the run recorded it)"
            )
    return lines


def resume_config(run_dir: str | Path) -> RunConfig:
    """The config of the run in ``run_dir``, with its namespace: what ``--resume`` starts from.
    A run that finished is refused (``ConfigError``): its results are kept."""
    run_dir = Path(run_dir)
    for name in (layout.CONFIG, layout.RUN_FILE):
        if not (run_dir / name).is_file():
            raise ConfigError(f"--resume {run_dir}: no {name} there (not the folder of a run that started)")
    check_unfinished(run_dir, f"--resume {run_dir}")
    cfg = run_config(run_dir, "--resume")  # where the folder lies now: a moved run resumes into itself
    namespace = read_run_file(run_dir)["namespace"]
    d = cfg.to_dict()
    d["embeddings"]["namespace"] = namespace
    return RunConfig.from_dict(d, source=str(layout.config_file(run_dir)))
