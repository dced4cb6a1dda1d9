"""Runtime faults end in one line on the terminal; the whole traceback goes to the run folder.

``report_error`` writes ``{out}/errors/{who}.log`` (the traceback) and ``{who}.json`` (the line);
``one_line`` is the line: the component (embedding tier, recovery, data, config, ...) and the message,
which names the value (shard and endpoint, file and line, flag).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path

from data.errors import DataError
from embeddings.errors import EmbeddingStoreError
from embeddings.launcher import LauncherError
from recovery.errors import RecoveryError


class TrainerFailed(RuntimeError):
    """A trainer process died or reported an error (the launcher's one line)."""


COMPONENTS: list[tuple[type, str]] = [
    (EmbeddingStoreError, "embedding tier"),
    (LauncherError, "shard launcher"),
    (RecoveryError, "recovery"),
    (DataError, "data"),
    (OSError, "file system"),
]


def one_line(e: BaseException) -> str:
    from recsys.config import ConfigError

    if isinstance(e, ConfigError):
        return f"config: {e}"
    for typ, component in COMPONENTS:
        if isinstance(e, typ):
            return f"{component}: {e}"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"unexpected {type(e).__name__}: {first}"


def report_error(run_dir: Path, who: str, e: BaseException) -> str:
    """Write the traceback and the line for ``who`` under ``run_dir/errors``; returns the line."""
    line = one_line(e)
    folder = Path(run_dir) / "errors"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{who}.log").write_text("".join(traceback.format_exception(e)))
        tmp = folder / f"{who}.json.tmp"
        tmp.write_text(json.dumps({"who": who, "line": line, "type": type(e).__name__, "pid": os.getpid()}))
        os.replace(tmp, folder / f"{who}.json")
    except OSError:
        pass  # the run folder itself is the problem: the line still reaches the terminal
    return line


def read_errors(run_dir: Path) -> dict[str, dict]:
    out = {}
    for p in sorted((Path(run_dir) / "errors").glob("*.json")):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out
