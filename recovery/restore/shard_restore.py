"""What every restore needs, whatever its strategy (rank 0): the checkpoint to restore from, a
replacement server for the failed one (a local shard: kill, put the snapshot in place, start; a
remote one: wait for its supervisor, load the rows over the protocol), and the failure record."""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from embeddings import RedisStore, ShardUnavailableError
from embeddings.servers.launcher import ShardSpec, kill_and_wait, shard_servers, spawn_shard
from recovery.durable.checkpoint import Checkpointer
from recovery.durable.manifest import Checkpoint
from recovery.errors import CorruptCheckpointError, NoCheckpointError, ShardLostError
from recovery.inject import Injector
from recovery.protocol import Detector
from recovery.strategy import Strategy


def link_or_copy(src: Path, dst: Path) -> None:
    """``dst`` (replaced) with ``src``'s bytes: a hard link where both are on one file system
    (instant), else a copy. The checkpoint's file stays intact as long as nothing writes ``dst`` in
    place: redis-server never does (it writes a temporary file and renames it over the old name),
    and whatever puts a file there goes through this function, which unlinks first."""
    dst.unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def _yielding(fn, *args):
    """``fn(*args)`` on a thread that yields its core to everything else (nice 19, Linux: this thread
    alone): a snapshot's verification runs beside its load, and the load (a server, or the thread
    that feeds one) is what the restore waits for."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (OSError, AttributeError):
        pass
    return fn(*args)


class Laps:
    """Seconds spent in each part of a restore, kept in the failure record (``phases_s``)."""

    def __init__(self, rec: dict) -> None:
        self.rec, self.t = rec, time.perf_counter()
        rec.setdefault("phases_s", {})

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        phases = self.rec["phases_s"]
        phases[name] = round(phases.get(name, 0.0) + now - self.t, 4)
        self.t = now


def no_lap(_: str) -> None:
    pass


@dataclass
class Check:
    """How a candidate checkpoint's shard snapshot is verified as it loads (``candidates_for``)."""

    ckpt: Checkpoint
    name: str
    sha: Future | None  # its SHA-256 on a thread; None: left to its loader's CRC-64


class ShardRestore:
    """Rank 0's tools for bringing shards back (one per trainer; only rank 0 uses them)."""

    def __init__(
        self,
        store: RedisStore,
        strategy: Strategy,
        detector: Detector,
        shards: list[ShardSpec],
        checkpointer: Checkpointer | None = None,
        injector: Injector | None = None,
        run_dir: Path | None = None,
        restart_timeout_s: float = 60.0,
    ) -> None:
        self.store, self.strategy, self.detector = store, strategy, detector
        self.local = {spec.index: spec for spec in shards}
        self.checkpointer, self.injector = checkpointer, injector
        self.run_dir, self.restart_timeout_s = run_dir, restart_timeout_s
        self.newest_usable = 0  # the newest checkpoint step the restore in progress may use
        self.started_empty: set[int] = set()  # local shards a --resume started anew (empty): restored, not failed
        self.promoted: set[int] = set()  # replicas promoted in this round (a retry waits for them)
        # a restore on a background thread (--train-through): the commit point's ``Detector.seen_at``
        self.seen_at: int | None = None
        self._prepare = threading.Lock()

    def checkpoint_for(
        self, shards: list[int], record: dict, lap: Callable[[str], None] = no_lap, whole=False
    ) -> Checkpoint | None:
        """The newest checkpoint the restore in progress may use (``newest_usable``) whose files a
        restore of ``shards`` needs verify: their snapshots, and with ``whole`` every file (the dense
        state a rollback loads too). Corrupt ones are noted in ``record`` and passed over."""
        if self.checkpointer is None:
            return None
        self.checkpointer.wait()  # a checkpoint in flight finishes (or is abandoned) before a restore
        lap("checkpoint_wait")
        if self.injector is not None:
            self.injector.before_restore(lambda: self.latest_shard_file(shards[0]))

        def report(e: CorruptCheckpointError) -> None:
            record.setdefault("corrupt_checkpoints", []).append(str(e))

        try:
            return self.checkpointer.latest_verified(
                lambda c: None if whole else [c.shard_file(s).name for s in shards],
                report,
                max_step=self.newest_usable,
                check=lambda c: [c.check_shard(s, self.store.key_namespace(s)) for s in shards],
            )
        except NoCheckpointError:
            return None

    def candidates_for(
        self, shard: int, record: dict, lap: Callable[[str], None] = no_lap
    ) -> Iterator[tuple[Checkpoint | None, Check | None]]:
        """The checkpoints a restore of ``shard`` may use, newest first (``newest_usable``), each with
        how it is verified while it loads (``confirm`` says whether the restore may keep it):
        - its snapshot's loader checks every byte against the CRC-64 the file ends with, which the
          manifest recorded (``Checkpoint.loader_checks``): nothing more, unless the load fails;
        - else its SHA-256 on a thread meanwhile.
        Last, ``(None, None)``: none verified, the shard starts empty."""
        if self.checkpointer is not None:
            with self._prepare:  # a node's shards are restored at once: one waits, the others see it done
                self.checkpointer.wait()  # a checkpoint in flight finishes (or is abandoned) before a restore
                lap("checkpoint_wait")
                if self.injector is not None:
                    self.injector.before_restore(lambda: self.latest_shard_file(shard))
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="verify") as pool:
                for c in self.checkpointer.candidates():
                    if c.step > self.newest_usable:
                        continue
                    name = c.shard_file(shard).name
                    try:
                        c.check_shard(shard, self.store.key_namespace(shard))  # that shard's, or not used
                        by_loader = c.loader_checks(name)
                    except CorruptCheckpointError as e:
                        record.setdefault("corrupt_checkpoints", []).append(str(e))
                        continue
                    check = Check(c, name, None if by_loader else pool.submit(_yielding, c.verify, [name]))
                    lap("checkpoint")  # chosen (verified as it loads: ``confirm``)
                    yield c, check
        yield None, None

    def confirm(self, check: Check | None, record: dict, lap: Callable[[str], None] = no_lap, failed=False) -> bool:
        """Whether the checkpoint of ``check`` verifies (a corrupt one is noted in ``record``). A load
        left to its loader's check that ``failed``: the SHA-256 says whether the file is to blame."""
        if check is None:
            return True
        try:
            if check.sha is not None:
                check.sha.result()
            elif failed:
                check.ckpt.verify([check.name])
            return True
        except (CorruptCheckpointError, OSError) as e:  # unreadable counts as corrupt
            record.setdefault("corrupt_checkpoints", []).append(str(e))
            return False
        finally:
            lap("verify")

    def latest_shard_file(self, shard: int) -> Path | None:
        if self.checkpointer is None:
            return None
        cands = self.checkpointer.candidates()
        return cands[0].shard_file(shard) if cands else None

    def restore_shard(self, shard: int, ckpt: Checkpoint | None, lap: Callable[[str], None] = no_lap) -> int:
        """The shard back as of ``ckpt`` (empty without one); -> bytes restored. A local shard: kill
        whatever runs for it, start a replacement that loads the checkpoint's file. A remote one:
        wait for its supervisor to bring it back, then load the rows through the protocol."""
        spec = self.local.get(shard)
        if spec is None:
            self.await_server(shard)
            lap("await")
            self.store.clear_shard(shard)  # a stalled server comes back with its rows: they go
            lap("clear")
            restored = self.store.load_snapshot(shard, ckpt.shard_file(shard)) if ckpt is not None else 0
            lap("load")
            if self.injector is not None:
                self.injector.during("recovery", exclude=shard)
            self._slow(shard, lap)
            return restored
        for pid in shard_servers(spec):  # its pidfile's, and one a dead trainer started unrecorded
            kill_and_wait(pid)
        lap("kill")
        restored = 0
        if ckpt is not None:
            src = ckpt.shard_file(spec.index)
            link_or_copy(src, spec.rdb_path)
            restored = src.stat().st_size
        else:
            spec.rdb_path.unlink(missing_ok=True)  # the replacement starts empty
        lap("copy")
        spawn_shard(spec, die_with_parent=False)
        lap("start")
        self.store.reconnect(spec.index)
        if self.injector is not None:
            self.injector.during("recovery", exclude=spec.index)
        self._slow(shard, lap)
        return restored

    def _slow(self, shard: int, lap: Callable[[str], None]) -> None:
        """``--inject slow-restore:K:SECS``: the restore of shard K takes SECS longer, with its
        replacement up and loaded from the checkpoint, before anything is laid on it."""
        delay = self.injector.restore_delay(shard) if self.injector is not None else 0.0
        if delay:
            time.sleep(delay)
            lap("slow_restore")

    def await_server(self, shard: int) -> None:
        """Until the shard's server answers again (its supervisor restarts it), within the timeout."""
        deadline = time.monotonic() + self.restart_timeout_s
        while True:
            self.store.reconnect(shard)
            try:
                self.store.call(shard, lambda c: c.ping())
                return
            except ShardUnavailableError as e:
                if time.monotonic() > deadline:
                    where = f"; resume the run with --resume {self.run_dir}" if self.run_dir is not None else ""
                    raise ShardLostError(
                        f"shard {shard} at {self.store.endpoint(shard)} did not come back within "
                        f"{self.restart_timeout_s:g}s (--shard-restart-timeout): {e.reason}{where} once it is up"
                    ) from None
            time.sleep(0.1)

    def kind(self, shard: int) -> str:
        if shard in self.started_empty:
            return "resume"  # the run's local servers ended with it: the resume restores the new ones
        return self.injector.kind_of(shard) if self.injector is not None else "shard"

    def base_record(self, kind: str, target: int, step: int) -> dict:
        d, inj = self.detector, self.injector
        detected = d.detected_at.get(target, time.time())
        fired = inj.fired_at(target) if inj is not None else None
        began = d.call_began.get(target)
        if began is None:  # another trainer saw it; this one waited at the commit point meanwhile
            began = fired if fired is not None else detected
        elif fired is not None:
            began = max(began, fired)  # a call that began before the failure lost only what came after it
        seen, seen_at = step, self.seen_at if self.seen_at is not None else d.seen_at
        if seen_at is not None:  # a write-behind's failure: it happened in steps step .. seen_at
            at = inj.fired_step(target) if inj is not None else None
            seen = at if at is not None and step <= at <= seen_at else step
        return {
            "kind": kind,
            "target": target,
            "step": seen,
            **({"write_step": step} if seen != step else {}),
            "strategy": str(self.strategy),
            # seconds from the failure to the moment a call saw it (the trainer went on working
            # meanwhile), and of those, how long the call that saw it ran (its work is redone; all of
            # them where another trainer saw it and this one waited for it at the commit point)
            "detected_after_s": round(max(0.0, detected - fired), 4) if fired is not None else 0.0,
            "failed_call_s": round(max(0.0, detected - began), 4),
            "_detected_at": detected,
        }
