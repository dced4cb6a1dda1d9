"""Runtime faults end in one line on the terminal; the whole traceback goes to the run folder.

``report_error`` writes ``{out}/errors/{who}.log`` (the traceback) and ``{who}.json`` (the line);
``one_line`` is the line: the component (embedding tier, recovery, data, config, ...) and the message,
which names the value (shard and endpoint, file and line, flag; a file error names its file).

A disk that filled up must not leave the traceback empty: a run keeps ``RESERVE_BYTES`` in
``{out}/.error-reserve`` (``reserve_space``, removed when the run ends well), which ``report_error``
gives back to write the traceback when the disk is full.
"""

from __future__ import annotations

import errno
import faulthandler
import json
import os
import signal
import threading
import traceback
from pathlib import Path

from data.errors import DataError
from embeddings.errors import EmbeddingStoreError
from embeddings.servers.launcher import LauncherError
from recovery.durable import layout
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


RESERVE = ".error-reserve"
RESERVE_BYTES = 128 << 10


def reserve_space(run_dir: Path) -> None:
    """Keep ``RESERVE_BYTES`` of the run folder's disk for an error's traceback (written, not sparse)."""
    path = Path(run_dir) / RESERVE
    try:
        if not path.exists() or path.stat().st_size < RESERVE_BYTES:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                f.write(bytes(RESERVE_BYTES))
    except OSError:
        pass  # already full: nothing to keep


def release_space(run_dir: Path) -> None:
    Path(run_dir, RESERVE).unlink(missing_ok=True)


def report_error(run_dir: Path, who: str, e: BaseException) -> str:
    """Write the traceback and the line for ``who`` under ``run_dir/errors``; returns the line. On a
    full disk the run's reserve (``reserve_space``) is given back for them."""
    line = one_line(e)
    record = layout.error_record(run_dir, who)
    for attempt in range(2):
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            layout.error_traceback(run_dir, who).write_text("".join(traceback.format_exception(e)))
            tmp = record.with_name(record.name + ".tmp")
            tmp.write_text(json.dumps({"who": who, "line": line, "type": type(e).__name__, "pid": os.getpid()}))
            os.replace(tmp, record)
            break
        except OSError as err:
            if attempt or err.errno not in (errno.ENOSPC, errno.EDQUOT) or not Path(run_dir, RESERVE).exists():
                break  # the run folder itself is the problem: the line still reaches the terminal
            try:
                release_space(run_dir)
            except OSError:
                break
    return line


def read_errors(run_dir: Path) -> dict[str, dict]:
    out = {}
    for p in layout.error_records(run_dir):
        try:
            out[p.stem] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


# a trainer that ended because a peer died or erred: its record names no cause of its own
PEER_LOST_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "PeerLost")
PEER_LOST_WORDS = ("gloo", "connection closed by peer", "connection reset", "broken pipe", "timed out")


def peer_lost(err: dict) -> bool:
    line = err.get("line", "").lower()
    return err.get("type") in PEER_LOST_TYPES or any(w in line for w in PEER_LOST_WORDS)


def first_cause(errors: dict[str, dict]) -> dict | None:
    """The error that ends the run: a trainer's own before one that reports another's
    (``PeerError``), the lowest trainer first; None where every trainer's record is a lost peer
    (the command's own record, ``main``, is not a trainer's)."""
    own = [e for e in errors.values() if not peer_lost(e) and e.get("who", "").startswith("trainer")]
    own.sort(key=lambda e: (e.get("type") == "PeerError", _trainer_number(e.get("who", ""))))
    return own[0] if own else None


def _trainer_number(who: str) -> int:
    """``trainer12`` -> 12 (trainer 10 after trainer 2)."""
    digits = who.removeprefix("trainer")
    return int(digits) if digits.isdigit() else 1 << 30


def default_signals() -> None:
    """A trainer forked from the launcher inherits the elastic agent's handlers, which turn the
    SIGTERM that stops a surviving trainer into an exception raised wherever it lands: a started
    process's defaults instead (it ends at once; Ctrl-C is KeyboardInterrupt)."""
    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    # kill -USR1: every thread's stack on stderr, the process runs on (where a stuck run waits)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
