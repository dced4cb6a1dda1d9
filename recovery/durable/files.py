"""Durable file writes: temp file, fsync, rename, fsync of the folder."""

from __future__ import annotations

import os
from pathlib import Path


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def name_path(e: OSError, path) -> OSError:
    """``e`` naming ``path`` when it names no file (a failed write or fsync, ENOSPC among them, names
    none): its line then says which file. Returns ``e``."""
    if e.filename is None and e.errno is not None:
        e.filename = str(path)
    return e


def write_atomic(path: Path, data: bytes | str) -> None:
    """Replace ``path`` with ``data`` so that a crash leaves either the old or the new file, whole."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        name_path(e, tmp)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def append_line(path: Path, record: dict) -> None:
    """Append one JSON line and fsync it (a line torn by a kill is skipped by readers)."""
    import json

    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        name_path(e, path)
        raise


def read_lines(path: Path) -> list[dict]:
    import json

    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # torn by a kill
    return out
