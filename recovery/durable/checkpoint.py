"""Checkpoints: every embedding shard as of one step, the dense state, the readers' positions.

Layout: ``{dir}/step_{step:010d}/`` holding ``shard{S}.rdb`` (each shard's Redis snapshot),
``dense/`` (``torch.distributed.checkpoint`` of model and optimizer), ``meta.json`` (step,
readers' positions, accounting) and, written last and atomically, ``manifest.json`` with a
SHA-256 per file. A folder without a valid manifest is not a checkpoint.

Taking one at a step boundary: every shard forks a snapshot: the training pause is the fork, not
the copy. A local shard (its folder is readable here) forks with ``BGSAVE`` and its file is copied;
a shard known only by its URL forks for a replication full sync and the snapshot streams over
the network (``embeddings.snapshots.rdb.NetworkSnapshot``). The dense state goes through DCP. A background
thread then waits for the snapshots, writes them into the folder while hashing them, fsyncs,
writes the manifest, and drops checkpoints beyond ``keep``.

A checkpoint that fails on the way (a full disk, a server that refuses the snapshot, a shard that
dies under it) is abandoned: it never gets a manifest and the previous one stays the newest. An
abandonment for a cause that repeats (anything but a shard failure, which its failure record and
the recovery account for) is one warning line on rank 0 naming the file and the cause
(``Checkpointer.warn``); ``max_abandoned`` of them in a row stop the run at the next checkpoint
(``check_abandoned``): past that, every step trained is one a shard failure would lose.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from embeddings.errors import EmbeddingStoreError
from embeddings.servers.launcher import ShardSpec, log_tail
from recovery.durable import layout
from recovery.durable.dense import clone_state
from recovery.durable.files import fsync_dir
from recovery.durable.identity import snapshot_mismatch
from recovery.durable.manifest import (
    Checkpoint,
    SaveStats,
    abandon_cause,
    copy_hashed,
    list_checkpoints,
    print_warning,
    rdb_trailer,
    sha256_file,
    write_json_atomic,
)
from recovery.errors import CheckpointsAbandonedError, CorruptCheckpointError, NoCheckpointError, RecoveryError


@dataclass(frozen=True)
class CheckpointHooks:
    """What a ``Checkpointer`` calls out to: ``barrier`` synchronises the trainers (no-op with one),
    ``on_saved(checkpoint)`` after a manifest is written (the kept logs and saves trimmed),
    ``on_fork(shard)`` after each shard's fork (failure injection), ``warn(line)`` for an abandoned
    checkpoint (None: stderr)."""

    barrier: Callable[[], None] = lambda: None
    on_saved: Callable[[Checkpoint], None] = lambda c: None
    on_fork: Callable[[int], None] = lambda shard: None
    warn: Callable[[str], None] | None = None


class Checkpointer:
    """Takes and finds checkpoints. ``save`` is called by every trainer at the same step.

    ``shards``: specs of the local shards (rank 0 copies their snapshot files; every other shard
    is snapshotted over the network); ``store``: the run's
    ``RedisStore`` (its ``call`` maps a dead shard to ``ShardUnavailableError``, so the fork runs
    under the recovery protocol); ``hooks``: what it calls out to (``CheckpointHooks``).

    Under the protocol a save is two halves: ``begin`` (rank 0 forks every shard's snapshot: the
    store calls that can fail) and, once the trainers committed, ``finish`` (the dense state and
    the background copy). ``save`` does both, for callers without a protocol.
    """

    snapshot_timeout_s = 600.0  # how long a shard's snapshot may run

    def __init__(
        self,
        directory: str | os.PathLike,
        keep: int,
        shards: list[ShardSpec],
        store,
        rank: int = 0,
        hooks: CheckpointHooks | None = None,
        run: str | None = None,
        max_abandoned: int = 3,
    ) -> None:
        hooks = hooks or CheckpointHooks()
        self.run = run
        if keep < 1:
            raise ValueError(f"keep_checkpoints={keep} must be >= 1")
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.shards = shards
        self.local = {spec.index: spec for spec in shards}
        self.network_only = False  # snapshot local shards over the network too (benchmarks)
        self.store = store
        self.rank = rank
        self.barrier, self.on_saved = hooks.barrier, hooks.on_saved
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._begun: tuple[int, float, dict[int, int]] | None = None
        self.on_fork = hooks.on_fork  # after each shard's fork (injection)
        self.history: list[SaveStats] = []
        self.warn = hooks.warn or print_warning  # the line of an abandoned checkpoint (rank 0)
        self.max_abandoned = max_abandoned  # abandoned in a row (for a cause that repeats) stop the run; 0: never
        self.abandoned_in_row: list[SaveStats] = []
        self._stamped: dict[int, int | None] = {}  # shard -> its applied marker at the snapshot

    def path(self, step: int) -> Path:
        return layout.step_dir(self.dir, step)

    # -- saving ------------------------------------------------------------------------------
    def save(self, step: int, dense_state: dict, meta: dict) -> SaveStats:
        self.begin(step)
        self.barrier()  # no trainer writes a row before every shard forked
        return self.finish(step, dense_state, meta)

    def begin(self, step: int, only=None) -> None:
        """Rank 0: fork every shard's snapshot (BGSAVE): the snapshot point. Raises
        ``ShardUnavailableError`` for a dead shard; call again after its recovery."""
        self.wait()  # one checkpoint in flight at a time
        t0 = self._begun[1] if self._begun is not None and self._begun[0] == step else time.perf_counter()
        self._begun = (step, t0, {})
        if self.rank != 0:
            return
        path = self.path(step)
        if path.exists():
            shutil.rmtree(path)  # an unfinished attempt, an abandoned timeline, or another run's
        path.mkdir(parents=True)
        saves_before: dict = {}
        # every shard stamped before any fork: a cluster node's logical shards share one fork
        self._stamped = {s: self.store.stamp(s) for s in range(self.store.num_shards)}
        try:
            for s in range(self.store.num_shards):
                if s in self.local and not self.network_only:
                    saves_before[s] = self.store.call(s, lambda c: self._fork(c))
                else:
                    same = [x for x in saves_before if self.store.endpoint(x) == self.store.endpoint(s)]
                    if same and not isinstance(saves_before[same[0]], int):  # one fork per server (a cluster
                        saves_before[s] = same[0]  # node serves several logical shards): its file is shared
                        continue
                    snap = self.store.snapshot(s, layout.shard_snapshot(path, s), self.snapshot_timeout_s)
                    snap.start()  # returns once the server forked
                    saves_before[s] = snap
                self.on_fork(s)
        except BaseException:
            for v in saves_before.values():
                if not isinstance(v, int):
                    v.close()
            raise
        self._begun = (step, t0, saves_before)

    def _fork(self, client) -> int:
        """BGSAVE once no snapshot is in progress; -> the server's save count before it."""
        deadline = time.monotonic() + self.snapshot_timeout_s
        while True:
            info = client.info("persistence")
            if not int(info["rdb_bgsave_in_progress"]):
                break
            if time.monotonic() > deadline:
                raise RecoveryError(f"a snapshot still runs after {self.snapshot_timeout_s}s")
            time.sleep(0.005)
        client.bgsave()
        return int(info["rdb_saves"])

    def finish(self, step: int, dense_state: dict, meta: dict) -> SaveStats:
        """Every trainer, after ``begin`` committed. The dense state is replicated over the trainers
        (DDP): rank 0 copies it (the pause) and a background thread writes it (DCP), copies the
        snapshots and writes the manifest, off the training path."""
        if self._begun is None or self._begun[0] != step:
            raise RecoveryError(f"checkpoint step {step}: finish without begin")
        _, t0, saves_before = self._begun
        self._begun = None
        stats = SaveStats(step=step)
        path = self.path(step)
        if self.rank == 0:
            dense = clone_state(dense_state)  # training moves the live tensors on at once
            stats.pause_s = time.perf_counter() - t0
            self._thread = threading.Thread(
                target=self._finish,
                args=(step, path, saves_before, meta, stats, t0, dense),
                name="checkpoint",
                daemon=True,
            )
            self._thread.start()
        else:
            stats.pause_s = time.perf_counter() - t0
        self.history.append(stats)
        return stats

    def _finish(self, step, path, saves_before, meta, stats, t0, dense) -> None:
        import torch.distributed.checkpoint as dcp

        try:
            dcp.save(dense, checkpoint_id=str(layout.dense_dcp_dir(path)), no_dist=True)  # rank 0 alone: no collective
            files = {}
            for s, before in saves_before.items():  # every fork has written its file: from here on no shard is needed
                if isinstance(before, int) and s in self.local and not self.network_only:
                    self._wait_snapshot(self.local[s], before)
            for s, before in saves_before.items():
                if isinstance(before, int) and s in self.local and not self.network_only:
                    digest, n = copy_hashed(self.local[s].rdb_path, layout.shard_snapshot(path, s))
                elif isinstance(before, int):  # the same server's snapshot as shard ``before``
                    digest, n = copy_hashed(layout.shard_snapshot(path, before), layout.shard_snapshot(path, s))
                else:
                    digest, n = before.finish()
                files[layout.shard_snapshot_name(s)] = digest
                stats.bytes += n
            identity = self._check_identity(step, path, list(saves_before))
            for p in sorted(layout.dense_dcp_dir(path).rglob("*")):
                if p.is_file():
                    files[str(p.relative_to(path))] = sha256_file(p)
                    stats.bytes += p.stat().st_size
            write_json_atomic(layout.meta_file(path), meta)
            files[layout.META] = sha256_file(layout.meta_file(path))
            fsync_dir(path)
            trailers = {n: rdb_trailer(path / n) for n in files if n.endswith(".rdb")}
            checksums = {n: t for n, t in trailers.items() if t is not None}
            doc = {"step": step, "files": files, "meta": meta, "rdb_checksums": checksums, "identity": identity}
            write_json_atomic(layout.manifest_file(path), doc)
            stats.total_s = time.perf_counter() - t0
            ckpt = Checkpoint(step, path, files, meta, checksums)
            for old in list_checkpoints(self.dir, self.run)[self.keep :]:
                shutil.rmtree(old.path, ignore_errors=True)
            self.abandoned_in_row = []
            self.on_saved(ckpt)
        except BaseException as e:  # noqa: BLE001 - abandoned, or surfaced by wait()
            if not isinstance(e, (redis.RedisError, OSError, RecoveryError, EmbeddingStoreError)) and (
                type(e).__name__ != "CheckpointException"  # DCP's (a BaseException): a failed write
            ):
                self._error = e
                return
            # a shard failed before its snapshot was safe, a disk filled up, a server refused: this
            # checkpoint is abandoned (it never gets a manifest); the previous one stays the newest
            cause, stats.repeats = abandon_cause(e, path)
            stats.abandoned = f"{type(e).__name__}: {cause}"
            for v in saves_before.values():
                if not isinstance(v, int):
                    v.close()
            shutil.rmtree(path, ignore_errors=True)
            if not stats.repeats:  # a shard failed under it: its failure record and recovery say so
                return
            self.abandoned_in_row.append(stats)
            try:
                self.warn(f"warning: checkpoint at step {step} abandoned: {cause}")
            except Exception:  # noqa: BLE001 - a closed terminal must not fail the run
                pass

    def _check_identity(self, step: int, path: Path, shards: list[int]) -> dict[str, dict]:
        """Every shard's snapshot is that shard's, at this snapshot (``recovery.durable.identity``): else
        ``RecoveryError`` naming the file, and the checkpoint is abandoned. -> the manifest's record."""
        out = {}
        for s in shards:
            name = layout.shard_snapshot_name(s)
            why = snapshot_mismatch(path / name, self.store.key_namespace(s), s, self._stamped.get(s))
            if why:
                raise RecoveryError(f"{why} (a snapshot must be its own shard's: docs/operations.md)")
            out[name] = {"shard": s, "namespace": self.store.key_namespace(s), "applied": self._stamped.get(s)}
        return out

    def _wait_snapshot(self, spec: ShardSpec, saves_before: int) -> None:
        deadline = time.monotonic() + self.snapshot_timeout_s
        while time.monotonic() < deadline:
            info = self.store.call(spec.index, lambda c: c.info("persistence"))
            if int(info["rdb_saves"]) > saves_before and int(info["rdb_bgsave_in_progress"]) == 0:
                if info["rdb_last_bgsave_status"] != "ok":
                    raise RecoveryError(
                        f"shard {spec.index} (port {spec.port}): background snapshot to {spec.rdb_path} failed "
                        f"(its log: {log_tail(spec)})"
                    )
                return
            time.sleep(0.01)
        raise RecoveryError(f"shard {spec.index} (port {spec.port}): snapshot not done in {self.snapshot_timeout_s}s")

    def check_abandoned(self) -> None:
        """Before a checkpoint: raise ``CheckpointsAbandonedError`` once the last ``max_abandoned``
        checkpoints were all abandoned for a cause that repeats (waits for the one in flight)."""
        self.settle()
        failed = self.abandoned_in_row
        if not self.max_abandoned or len(failed) < self.max_abandoned:
            return
        done = [s.step for s in self.history if not s.abandoned and s.total_s > 0]
        last = f"the last complete one is of step {done[-1]}" if done else "none is complete"
        raise CheckpointsAbandonedError(
            f"{len(failed)} checkpoints in a row were abandoned (steps {', '.join(str(s.step) for s in failed)}; "
            f"{last}): {failed[-1].abandoned.split(': ', 1)[-1]}; stopping before a shard failure loses more "
            f"steps (--max-abandoned-checkpoints {self.max_abandoned}; 0: never stop)"
        )

    def settle(self) -> None:
        """Block until the checkpoint in flight is complete (its error stays for ``wait``)."""
        if self._thread is not None:
            self._thread.join()

    def wait(self) -> None:
        """Block until the checkpoint in flight is complete; re-raise its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    # -- finding and loading -----------------------------------------------------------------
    def load(self, step: int, dense_state: dict) -> dict:
        """Fill ``dense_state`` in place from checkpoint ``step`` (DCP); -> the checkpoint's meta."""
        import torch.distributed.checkpoint as dcp

        path = self.path(step)
        dcp.load(dense_state, checkpoint_id=str(layout.dense_dcp_dir(path)), no_dist=True)  # rank 0 wrote it for all
        return json.loads(layout.meta_file(path).read_text())

    def candidates(self) -> list[Checkpoint]:
        return list_checkpoints(self.dir, self.run)

    def latest_verified(
        self,
        names: Callable[[Checkpoint], list[str] | None] = lambda c: None,
        on_corrupt: Callable[[CorruptCheckpointError], None] = lambda e: None,
        max_step: int | None = None,
        check: Callable[[Checkpoint], object] = lambda c: None,
    ) -> Checkpoint:
        """The newest checkpoint (of step ``max_step`` or before) whose files (``names(c)``, default
        all: shard snapshots and dense files) verify; corrupt ones are reported and skipped."""
        for c in self.candidates():
            if max_step is not None and c.step > max_step:
                continue
            try:
                check(c)  # its snapshots are their shards' (``Checkpoint.check_shard``)
                c.verify(names(c))
                return c
            except CorruptCheckpointError as e:
                on_corrupt(e)
        raise NoCheckpointError(f"no complete, verified checkpoint in {self.dir}")
