"""A checkpoint's folder as written (``recovery.durable.checkpoint``): its files hashed while they are
copied, the SHA-256 manifest written last, checkpoints found and checked against it
(``Checkpoint``, ``list_checkpoints``); what a save cost or why it was abandoned (``SaveStats``,
``abandon_cause``)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import redis

from embeddings.errors import ShardUnavailableError
from recovery.durable import layout
from recovery.durable.files import name_path, write_atomic
from recovery.durable.identity import snapshot_mismatch
from recovery.errors import CorruptCheckpointError


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def copy_hashed(src: Path, dst: Path) -> tuple[str, int]:
    """Copy with fsync, hashing the bytes on the way; returns (sha256, bytes). ``dst`` is a new file
    (an old one is unlinked, not overwritten: it may be a link a restored shard was started from)."""
    h, n = hashlib.sha256(), 0
    dst.unlink(missing_ok=True)
    with open(src, "rb") as fi:
        try:
            with open(dst, "wb") as fo:
                while block := fi.read(1 << 22):
                    h.update(block)
                    fo.write(block)
                    n += len(block)
                fo.flush()
                os.fsync(fo.fileno())
        except OSError as e:  # a failed write (ENOSPC) names no file: this one
            name_path(e, dst)
            raise
    return h.hexdigest(), n


def write_json_atomic(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=1))


def rdb_trailer(path: Path) -> str | None:
    """The CRC-64 an RDB file ends with (its last 8 bytes, after the end marker 0xFF), hex; None
    where the server wrote none (``rdbchecksum no``: zeros) or the file does not end like one."""
    try:
        with open(path, "rb") as f:
            if f.seek(0, os.SEEK_END) < 18:
                return None
            f.seek(-9, os.SEEK_END)
            tail = f.read(9)
    except OSError:
        return None
    return tail[1:].hex() if tail[0] == 0xFF and any(tail[1:]) else None


@dataclass
class Checkpoint:
    step: int
    path: Path
    files: dict[str, str]  # relative path -> sha256
    meta: dict = field(default_factory=dict)
    # shard snapshot name -> the CRC-64 its file ends with (``rdb_trailer``), as written
    rdb_checksums: dict[str, str] = field(default_factory=dict)
    # shard snapshot name -> {"shard", "namespace", "applied"}: checked before the manifest (``recovery.durable.identity``)
    identity: dict[str, dict] = field(default_factory=dict)

    def check_shard(self, shard: int, key_namespace: str) -> None:
        """``CorruptCheckpointError`` unless this checkpoint's snapshot of ``shard`` is that shard's:
        as its manifest recorded it (its checksums prove the file is the one checked), or, for a
        manifest that recorded none, as the file itself says."""
        name = layout.shard_snapshot_name(shard)
        rec = self.identity.get(name)
        if rec is not None:
            if rec.get("shard") != shard or rec.get("namespace") != key_namespace:
                raise CorruptCheckpointError(
                    f"checkpoint step {self.step}: {self.path / name} is recorded as shard {rec.get('shard')}'s "
                    f"of namespace {rec.get('namespace')!r}, not shard {shard}'s of {key_namespace!r}"
                )
            return
        why = snapshot_mismatch(self.path / name, key_namespace, shard, check_applied=False, unstamped_ok=True)
        if why:
            raise CorruptCheckpointError(f"checkpoint step {self.step}: {why}")

    def loader_checks(self, name: str) -> bool | None:
        """Whether the shard snapshot ``name`` can be left to its loader's own check: Redis's load,
        and ``embeddings.snapshots.rdb.restore_payloads``, check every byte against the CRC-64 the file ends
        with, and that CRC-64 is the one the manifest recorded. None where the manifest has none (an
        older checkpoint, a server without checksums): the SHA-256 it is. ``CorruptCheckpointError``
        where the file ends with another (it is not the file that was written)."""
        want = self.rdb_checksums.get(name)
        if want is None:
            return None
        p = self.path / name
        got = rdb_trailer(p)
        if got != want:
            raise CorruptCheckpointError(
                f"checkpoint step {self.step}: {p} "
                + (
                    f"ends with CRC-64 {got}, manifest says {want}"
                    if got
                    else f"does not end with the CRC-64 its manifest recorded ({want}): missing or cut short"
                )
            )
        return True

    def shard_file(self, shard: int) -> Path:
        return layout.shard_snapshot(self.path, shard)

    def verify(self, names: list[str] | None = None) -> int:
        """Check the SHA-256 of ``names`` (default: every file); returns bytes checked."""
        total = 0
        for rel in names if names is not None else list(self.files):
            p = self.path / rel
            if not p.is_file():
                raise CorruptCheckpointError(f"checkpoint step {self.step}: {p} is missing")
            digest = sha256_file(p)
            if digest != self.files[rel]:
                raise CorruptCheckpointError(
                    f"checkpoint step {self.step}: {p} has SHA-256 {digest[:16]}..., manifest says {self.files[rel][:16]}..."
                )
            total += p.stat().st_size
        return total


def list_checkpoints(directory: str | os.PathLike, run: str | None = None) -> list[Checkpoint]:
    """Checkpoints with a readable manifest, newest first (files not yet verified); with ``run``,
    only those of that run (its namespace): a folder may hold an earlier run's checkpoints."""
    out = []
    d = Path(directory)
    if not d.is_dir():
        return out
    for p in reversed(layout.step_dirs(d)):
        m = layout.manifest_file(p)
        try:
            doc = json.loads(m.read_text())
            c = Checkpoint(
                step=int(doc["step"]),
                path=p,
                files=dict(doc["files"]),
                meta=doc.get("meta", {}),
                rdb_checksums=dict(doc.get("rdb_checksums", {})),
                identity=dict(doc.get("identity", {})),
            )
            if run is None or c.meta.get("namespace") == run:
                out.append(c)
        except (OSError, ValueError, KeyError):
            continue  # unfinished or damaged manifest: not a checkpoint
    return out


@dataclass
class SaveStats:
    step: int
    pause_s: float = 0.0
    total_s: float = 0.0
    bytes: int = 0
    abandoned: str = ""
    """Why the checkpoint was abandoned (the error's type, the cause and the file), or ""."""
    repeats: bool = False
    """Abandoned for a cause that repeats (a disk, a setting), not a shard failure: counts towards
    ``Checkpointer.max_abandoned``."""


def _chain(e: BaseException):
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def _newest_file(folder: Path) -> Path | None:
    try:
        files = [p for p in folder.rglob("*") if p.is_file()]
        return max(files, key=lambda p: p.stat().st_mtime_ns) if files else None
    except OSError:
        return None


def abandon_cause(e: BaseException, path: Path) -> tuple[str, bool]:
    """-> (why a checkpoint at ``path`` failed, naming the file; whether the cause repeats: anything
    but a shard that failed under it, whose recovery the protocol runs)."""
    if type(e).__name__ == "CheckpointException":  # DCP's wrapper of its writers' errors
        inner = [x[0] for x in getattr(e, "failures", {}).values() if isinstance(x, tuple) and x]
        e = inner[0] if inner else e
    for x in _chain(e):  # DCP's writer reports a failed write as an opaque RuntimeError
        if isinstance(x, OSError) and x.errno and not isinstance(x, ConnectionError):
            where = x.filename or _newest_file(layout.dense_dcp_dir(path)) or path
            return f"{x.strerror or x}: {where}", True
    if isinstance(e, (ShardUnavailableError, redis.ConnectionError, redis.TimeoutError)):
        return str(e), False
    return (str(e).strip().splitlines() or [type(e).__name__])[0], True


def print_warning(line: str) -> None:
    """A warning line on stderr (a checkpoint abandoned, where no other place is given)."""
    import sys

    print(line, file=sys.stderr, flush=True)
