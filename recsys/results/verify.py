"""``python -m recsys verify RUN``: rebuild a finished run's rows from its durable files and compare.

Under ``--recovery log`` a run's durable state is its oldest kept checkpoint plus every shard's
update log: together they must give exactly the rows the run ended with (nothing lost, nothing
applied twice, whatever failed on the way, trained through or not). ``verify`` rebuilds every
shard from them in memory (the checkpoint's ``shard{S}.rdb`` parsed as Redis wrote it, then each
row's newest logged value up to the run's last step; a row in neither has its initial value) and
compares the result with:

- the run's ``embedding_digest`` (``summary.json``: SHA-256 over every row, weights and optimizer
  state): always, where the run computed one;
- the rows themselves, to name the first that differs, wherever they are at hand: on the run's
  shards where they still answer (servers the project did not start keep the run's rows under its
  namespace); its final model (``final/step_N/``, which every run keeps unless ``--no-keep-model``:
  each shard's final snapshot, weights and optimizer state, its checksums checked first; one that
  fails them is named and skipped); the weights of ``final_model.pt`` (``--save-model``).

Every durable file ``verify`` does not read is named on a line of its own: a checkpoint that fails its
checksum, or the one the logs were kept for (a segment starts after each checkpoint) gone missing;
the check then ends in exit 1 even where what it could read agrees. Its closing line says from which
step the rows were rebuilt and how many logged steps that covers (none, when the base is the last
step's checkpoint: it says so). The folder it reads is the one it is given (a copied or moved run
reads its own files); a ``--checkpoint-dir`` or ``--log-dir`` the run was given outside its folder is
read where the run recorded it, and a line says so.

Under ``partial`` with update logs (``--log-dir``) a shard restored from a checkpoint is rebuilt as
it was restored: from that checkpoint (still kept) and its log from the failing step on (what came
between was lost, and counted). Equal: one line, exit 0. Not equal, or a log segment damaged or missing: one line naming the
shard, table and first differing row (or the digest where no rows are at hand, or the segment), exit 1. A run without a complete log (any other strategy)
cannot be rebuilt: ``verify`` says so and checks what it can (the checkpoints' checksums). Bad
input (not a run folder, an unfinished run) is one line, exit 2.

The tables are rebuilt in this process's memory: the run's tables must fit in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from recovery.durable import layout

if TYPE_CHECKING:
    from recsys.config import RunConfig


class VerifyError(Exception):
    """The run cannot be checked (one line; exit 2)."""


def _config(run: Path):
    """The run's config, its paths in the folder given (``recsys.results.rundir.run_config``)."""
    from recsys.config import ConfigError
    from recsys.results.rundir import run_config

    try:
        return run_config(run, "verify")
    except (ConfigError, OSError) as e:
        raise VerifyError(str(e)) from None


def _summary(run: Path) -> dict:
    path = layout.summary_file(run)
    if not path.is_file():
        raise VerifyError(f"verify {run}: the run did not finish (no {path.name}): there are no final rows to check")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise VerifyError(f"verify {run}: {path} is damaged ({e})") from None


def _checkpoints(cfg, namespace: str) -> tuple[list, list[str]]:
    """The run's checkpoints whose files verify, newest first, and a line per corrupt one."""
    from recovery.durable.manifest import list_checkpoints
    from recovery.errors import CorruptCheckpointError

    good, bad = [], []
    for c in list_checkpoints(cfg.checkpoint_dir, namespace):
        try:
            c.verify([n for n in c.files if n.endswith(".rdb")])
            good.append(c)
        except CorruptCheckpointError as e:
            bad.append(str(e))
    return good, bad


def initial_tables(store) -> dict[int, np.ndarray]:
    """Every table's rows [num_rows, width] at their initial values (weights and optimizer state)."""
    from embeddings import rowkeys

    return {
        t: store.initial_rows(rowkeys.pack(t, np.arange(spec.num_rows, dtype=np.int64)))
        for t, spec in enumerate(store.tables.specs)
    }


def overlay_snapshot(store, tables: dict[int, np.ndarray], path: Path, shard: int) -> None:
    """The rows shard ``shard``'s snapshot at ``path`` holds (parsed as Redis wrote it), over ``tables``."""
    from embeddings.snapshots.rdb import group_rows, read_keys

    widths = [4 * store.width(t) for t in range(len(store.tables.specs))]
    ns = store.key_namespace(shard)
    rows, _ = group_rows(read_keys(path, f"{ns}:".encode()), ns, store.layout, widths)
    for t, (ids, values) in rows.items():
        tables[t][ids] = np.frombuffer(values, "<f4").reshape(len(ids), store.width(t))


def kept_model(run: Path, namespace: str):
    """The run's final model (``{run}/final``, kept unless ``--no-keep-model``), its files checked
    against its manifest: the ``Checkpoint``, None where the run kept none.
    ``CorruptCheckpointError`` where a file fails its checksum."""
    from recovery.durable.manifest import list_checkpoints

    kept = list_checkpoints(layout.final_dir(run), namespace)
    if not kept:
        return None
    kept[0].verify()
    return kept[0]


def rebuild(cfg, store, ckpt, steps: int, restores: dict | None = None) -> dict[int, np.ndarray]:
    """Every table's rows [num_rows, width] from ``ckpt`` (None: empty shards) and the logs up to
    ``steps``. ``restores``: shard -> (checkpoint or None, step) of a lossy restore (``partial``):
    that shard is rebuilt from the checkpoint it was restored from and its log from that step on
    (the records before it were lost, and counted)."""
    from recovery.durable.log import ShardLog

    tables = initial_tables(store)
    for s in range(store.num_shards):
        base, after = (ckpt, ckpt.step if ckpt is not None else 0)
        if restores and s in restores:
            base, first = restores[s]
            after = first - 1
        if base is not None:
            overlay_snapshot(store, tables, base.shard_file(s), s)
        records, _ = ShardLog(cfg.log_dir, s).replay(after, steps)  # LogGapError: a damaged or missing segment
        for r in records:  # in log order: a row's newest record is written last
            if len(r.ids):
                tables[r.table][r.ids] = r.rows
    return tables


def lossy_restores(run: Path, strategy, good: list) -> dict:
    """``partial`` with update logs: shard -> (the checkpoint its last restore loaded, or None for
    empty, and the first step logged after it). ``VerifyError`` where that checkpoint is gone."""
    from recovery.durable.files import read_lines

    out: dict = {}
    if str(strategy) != "partial":
        return out
    by_step = {c.step: c for c in good}
    for f in read_lines(layout.failures_file(run)):
        if f.get("strategy") != "partial" or "restored_from_step" not in f:
            continue
        s, base = int(f["target"]), f["restored_from_step"]
        first = min(int(f["step"]), int(f.get("write_step", f["step"])))
        if base is not None and base not in by_step:
            raise VerifyError(
                f"verify {run}: shard {s} was restored from checkpoint {base} at step {first}, which is no longer "
                "kept (or fails its checksum): its rows cannot be rebuilt"
            )
        out[s] = (by_step.get(base) if base is not None else None, first)
    return out


def _final_rows(cfg, store, run: Path, skipped: list[str]) -> list[tuple[str, dict[int, np.ndarray]]]:
    """The rows the run ended with, wherever they are at hand: [(where, table -> rows [n, dim or
    width])]: its shards (where they still answer), its final model (``final/``: weights and
    optimizer state), ``final_model.pt`` (weights). A final model that fails its checksum is added
    to ``skipped``."""
    from embeddings import ShardUnavailableError
    from recovery.errors import CorruptCheckpointError

    out = []
    if cfg.embeddings.redis != "local":
        try:
            with store.from_redis():
                rows = {
                    t: store.read_rows(spec.name, np.arange(spec.num_rows)) for t, spec in enumerate(store.tables.specs)
                }
            if any(len(v) for v in rows.values()):
                out.append(("its shards", rows))
        except ShardUnavailableError:
            pass
    try:
        kept = kept_model(run, store.namespace)
    except CorruptCheckpointError as e:
        kept = None
        skipped.append(f"the final model: {e}")
    if kept is not None:
        tables = initial_tables(store)
        for s in range(store.num_shards):
            overlay_snapshot(store, tables, kept.shard_file(s), s)
        out.append((str(kept.path.relative_to(run)), tables))
    path = layout.final_model_file(run)
    if path.is_file():
        import torch

        state = torch.load(path, weights_only=True)
        weights = {}
        for t, spec in enumerate(store.tables.specs):
            w = state.get(f"embedding.{spec.name}")
            if w is not None:
                weights[t] = w.numpy()
        out.append((path.name, weights))
    return out


def log_reach(cfg, num_shards: int) -> int | None:
    """The step the update logs start after: a segment starts after each checkpoint, so the oldest
    base the logs were kept for. None where no shard has a segment."""
    firsts = [
        layout.segment_first_step(segs[0]) for s in range(num_shards) if (segs := layout.log_segments(cfg.log_dir, s))
    ]
    return min(firsts) - 1 if firsts else None


def missing_base(cfg, ckpt, reach: int | None, bad: list[str]) -> str:
    """The checkpoint the logs were kept for, where it is gone without a trace (one that fails its
    checksum is in ``bad``): a line naming it, or ''."""
    used = ckpt.step if ckpt is not None else 0
    if reach is None or reach == 0 or reach >= used:  # step 0's base is the empty shards
        return ""
    folder = layout.step_dir(cfg.checkpoint_dir, reach)
    if any(folder.name in b for b in bad):
        return ""
    return f"{folder}: missing, yet the logs start after step {reach}: they were kept for it"


def verify(run_dir: str | Path, say=lambda line: None) -> tuple[int, str]:
    """-> (exit status, the closing line to print). ``say``: a line to show before it (a durable
    folder read outside the run's own, a file skipped)."""
    from recovery.errors import LogGapError
    from recovery.strategy import Strategy
    from recsys.backends import open_store
    from recsys.results.outputs import embedding_digest
    from recsys.results.rundir import outside_paths, read_run_file

    run = Path(run_dir)
    cfg = _config(run)
    for line in outside_paths(cfg, "verify"):
        say(line)
    summary = _summary(run)
    try:
        namespace = read_run_file(run, "verify")["namespace"]
    except Exception as e:  # noqa: BLE001 - a ConfigError: one line
        raise VerifyError(str(e)) from None
    good, bad = _checkpoints(cfg, namespace)
    strategy = Strategy(cfg.recovery.recovery)
    if not cfg.log_dir or strategy.value not in ("log", "partial"):
        return _checksums_only(run, cfg, namespace, strategy, good, bad)
    steps = int(summary["steps_completed"])
    n = len(cfg.embeddings.urls) or cfg.embeddings.shards
    ckpt = good[-1] if good else None  # the oldest kept: the logs reach back to it
    # every durable file the check does not read is named, and fails it: never a clean 0
    # a missing base only where fewer checkpoints are kept than the run keeps (the logs may reach a
    # little further back than the oldest kept one: their trim follows the checkpoint's)
    short = len(good) < cfg.recovery.keep_checkpoints
    skipped = [b for b in [*bad, missing_base(cfg, ckpt, log_reach(cfg, n), bad) if short else ""] if b]
    for line in skipped:
        say(f"verify: skipped {line}")
    base = f"checkpoint {ckpt.step}" if ckpt else "empty shards"
    first = ckpt.step if ckpt else 0
    covered = (
        f"{steps - first} logged step(s), {first + 1}..{steps}"
        if steps > first
        else "no logged step: the rows are the checkpoint's own, the logs are not checked"
    )
    urls = cfg.embeddings.urls or ["redis://127.0.0.1:1"] * n  # local shards ended with the run: never dialled
    store = open_store(cfg, urls, namespace, replicas=False)
    try:
        try:
            tables = rebuild(cfg, store, ckpt, steps, lossy_restores(run, strategy, good))
        except LogGapError as e:  # a durable file damaged or gone: the check fails, naming it
            return 1, f"{run}: the rows cannot be rebuilt from {base}: {e}"
        names = [spec.name for spec in store.tables.specs]
        digest = embedding_digest((names[t], [rows]) for t, rows in tables.items())
        was = len(skipped)
        finals = _final_rows(cfg, store, run, skipped)
        for line in skipped[was:]:
            say(f"verify: skipped {line}")
        differs = _first_difference(run, store, tables, finals, base, steps)
        if differs is not None:
            return 1, differs
        expected = summary.get("embedding_digest")
        if expected is not None and expected != digest:
            return 1, (
                f"{run}: the rows rebuilt from the durable files have digest {digest[:16]}..., the run ended with "
                f"{expected[:16]}... (summary.json)"
                + ("" if not finals else f"; {' and '.join(w for w, _ in finals)} agree with the rebuilt rows")
            )
        if expected is None and not finals:
            return (
                1,
                f"{run}: the run kept no digest (--digest-max-rows) and no final rows are at hand: nothing to compare",
            )
        checked = " and ".join((["the digest"] if expected else []) + [where for where, _ in finals])
        line = (
            f"{run}: {n} shards rebuilt from {base} and their logs to step {steps} ({covered}) equal the run's "
            f"final rows ({checked})"
        )
        if skipped:
            return 1, f"{line}; but {len(skipped)} durable file(s) were skipped (named above): not a full check"
        return 0, line
    finally:
        store.close()


def _checksums_only(run: Path, cfg: RunConfig, namespace: str, strategy, good: list, bad: list[str]) -> tuple[int, str]:
    """A run whose final rows its files cannot rebuild (no update log, or saves the logs do not
    hold): its kept checkpoints and final model checked against their checksums alone."""
    from recovery.errors import CorruptCheckpointError

    try:
        kept = kept_model(run, namespace)
        model = f" and its final model ({kept.path.relative_to(run)})" if kept is not None else ""
    except CorruptCheckpointError as e:
        bad.append(f"the final model: {e}")
        model = ""
    corrupt = f"; {len(bad)} fail their checksums: {bad[0]}" if bad else ""
    return (
        1 if bad else 0,
        f"{run}: --recovery {strategy} {'overlays saves the logs do not hold' if cfg.log_dir else 'keeps no update log'}, "
        "so its final rows cannot be rebuilt from its files; "
        f"checked that {len(good)} kept checkpoint(s){model} verify (SHA-256){corrupt}",
    )


def _first_difference(run: Path, store, tables: dict, finals: list, base: str, steps: int) -> str | None:
    """The first row where a final copy of the rows (``finals``: (where, rows per table)) differs
    from the rebuilt ``tables``, as the closing line; None where every row is equal, bit for bit."""
    names = [spec.name for spec in store.tables.specs]
    for where, rows in finals:
        for t, got in rows.items():
            want = tables[t][:, : got.shape[1]]
            diff = np.flatnonzero(np.any(want.view(np.int32) != np.ascontiguousarray(got).view(np.int32), axis=1))
            if len(diff):
                row = int(diff[0])
                shard = int(store.shard_map.shard_of(t, np.array([row]))[0])
                return (
                    f"{run}: shard {shard}, table {names[t]}, row {row}: rebuilt from {base} and the logs to "
                    f"step {steps} it differs from {where} ({len(diff)} rows of the table differ)"
                )
    return None
