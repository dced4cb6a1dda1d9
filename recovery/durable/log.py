"""Per-shard persistent update logs: append-only, length-framed, CRC32C per record.

File ``{log_dir}/shard{S}/seg_{first_step:010d}.log`` holds the updates applied to shard S from
``first_step`` on; a new segment starts after each checkpoint, and segments wholly older than the
oldest checkpoint kept are dropped (a restore that falls back to it still replays exactly).

Record::

    magic   u32  0x52454332 ("REC2")
    length  u32  payload bytes
    crc     u32  CRC32C of the payload
    payload      step u64 | one group of ``embeddings.groups`` (table, ids, float32 rows)

Records of one step are written with one ``write`` (group commit) and made durable by the fsync
policy: ``always`` (fsync every step), ``every:N`` (fsync when N ms passed since the last), or
``none`` (the OS decides). On open, a torn or corrupt tail is cut at the last whole record.

Every step's records end with an end record (table ``END``, no rows, ``width`` = the number of
records of the step before it), written for every step the writer owns the shard in, rows or none.
A step is *complete* in the log when an end record follows that many whole records of its step. A replay
(``ShardLog.replay``) proves its coverage: every step from the restore base to the step it must
reach is complete, or it raises ``LogGapError`` naming the segment, the first step it cannot
rebuild and why (a record failing its CRC, a torn record, a missing segment): never a silent
partial replay.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from embeddings import rowkeys
from recovery.durable import layout
from recovery.durable.files import fsync_dir, write_atomic
from recovery.durable.log_format import (
    END,
    Entry,
    LogRecord,
    cut_file,
    encode_group,
    entries,
    file_frames,
    repair,
    scan,
    step_bytes,
)
from recovery.errors import LogGapError, RecoveryError


def parse_fsync_policy(policy: str) -> float | None:
    """'always' -> 0.0, 'every:N' -> N ms, 'none' -> None."""
    if policy == "always":
        return 0.0
    if policy == "none":
        return None
    if policy.startswith("every:"):
        try:
            ms = float(policy.split(":", 1)[1])
        except ValueError:
            ms = -1.0
        if ms > 0:
            return ms
    raise ValueError(f"fsync policy {policy!r} must be 'always', 'every:N' (milliseconds, N > 0) or 'none'")


# per shard log directory, what this process last wrote to its open segment: (the segment, its
# inode, its size when opened, its size and modification time now, [(step, offset of the step's
# first record)]): a cut after a step in this process (a regroup) finds the offset without framing
# the segment, if the file is still as written
_written: dict[Path, tuple[Path, int, int, tuple[int, int], list[tuple[int, int]]]] = {}


class ShardLog:
    """The log of one shard, written by the shard's single writer."""

    def __init__(self, directory: str | os.PathLike, shard: int, fsync: str = "always") -> None:
        self.dir = layout.log_shard_dir(directory, shard)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self._fsync_ms = parse_fsync_policy(fsync)
        self._file = None  # touched by the log's thread while a write or switch is queued
        self._opened = False  # the writer's view: a segment is open or queued to open
        self._last_fsync = time.monotonic()
        self.bytes_written = 0
        self.seconds = 0.0  # on the training path: handing a step's records over, waiting for the last
        self.behind_seconds = 0.0  # waits on the write-behind thread (off the path unless the path waits for it)
        self.background_seconds = 0.0  # encoding, writing and syncing, off the path
        self.num_cut_bytes = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def segments(self) -> list[Path]:
        return layout.log_segments(self.dir.parent, self.shard)

    @staticmethod
    def first_step(path: Path) -> int:
        return layout.segment_first_step(path)

    def open_segment(self, first_step: int, cut: bool = False) -> None:
        """Start appending to the segment of updates from ``first_step`` on (cutting a torn tail;
        ``cut``: ``truncate_after`` cut it just now, and nothing was appended since: not read again).
        While records are being written in the background (at a checkpoint), the switch is queued
        behind them on the log's thread and the caller goes on: records of later steps land in the
        new segment, and ``wait`` reports a failure of the switch like one of a write."""
        if self._pool is not None and self._opened:
            t0 = time.perf_counter()
            self._pending = self._pool.submit(self._switch, self._pending, first_step)
            self.seconds += time.perf_counter() - t0
            return
        self.close()
        if not cut:
            self._cut_torn(first_step)
        self._open(first_step)
        self._opened = True

    def _switch(self, before: Future | None, first_step: int) -> None:
        if before is not None:
            before.result()  # the records ahead of the switch are written (their error surfaces here)
        t0 = time.perf_counter()
        self._close_file()
        self._cut_torn(first_step)
        self._open(first_step)
        self.background_seconds += time.perf_counter() - t0

    def _cut_torn(self, first_step: int) -> None:
        """The torn tail of the segment from ``first_step`` on, if it exists, cut (``repair``)."""
        path = layout.log_segment(self.dir.parent, self.shard, first_step)
        if path.exists():
            self.num_cut_bytes += repair(path)

    def _open(self, first_step: int) -> None:
        path = layout.log_segment(self.dir.parent, self.shard, first_step)
        self._file = open(path, "ab")
        fsync_dir(self.dir)
        st = os.fstat(self._file.fileno())
        _written[self.dir] = (path, st.st_ino, st.st_size, (st.st_size, st.st_mtime_ns), [])

    def append_step(self, step: int, groups: list[tuple[int, np.ndarray, np.ndarray]], wait: bool = True) -> int:
        """Group commit of one step's updates (table, ids, new rows), written by a background thread
        while training goes on; returns the bytes it will write. The writer calls ``wait`` before the
        next step's rows reach the shard, and recovery before it reads the log, so a record is on disk
        before anything depends on it (``fsync`` policy: as for a synchronous write). ``wait=False``:
        the records before are not waited for here (they are written first all the same; the caller
        waits for them with ``wait_for(pending())`` taken before this call)."""
        nbytes = step_bytes(groups)
        self._hand_over(wait, self._write, step, groups)
        self.bytes_written += nbytes
        return nbytes

    def append_keys(
        self, step: int, keys: np.ndarray, rows: np.ndarray, shards: np.ndarray, wait: bool = False
    ) -> None:
        """``append_step`` of one step's sorted packed keys and new rows of every shard (``shards``:
        the shard of each): picking this log's shard's rows and grouping them per table run on the
        log's thread, so the training path only hands the arrays over (they must not change after)."""
        self._hand_over(wait, self._write_keys, step, keys, rows, shards)

    def _hand_over(self, wait: bool, write, *args) -> None:
        """Queue ``write(records before, *args)`` on the log's thread (the training path's part)."""
        if not self._opened:
            raise RecoveryError(f"log of shard {self.shard}: append before open_segment")
        t0 = time.perf_counter()
        if wait:
            self.wait()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"log{self.shard}")
        self._pending = self._pool.submit(write, self._pending, *args)
        self.seconds += time.perf_counter() - t0

    def _write_keys(self, before: Future | None, step: int, keys, rows, shards) -> None:
        t0 = time.perf_counter()
        at = np.flatnonzero(shards == self.shard)
        keys, rows = keys[at], rows[at]
        groups = [(t, ids, rows[lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(keys).items()]
        self.bytes_written += step_bytes(groups)
        self.background_seconds += time.perf_counter() - t0
        self._write(before, step, groups)

    def _write(self, before: Future | None, step: int, groups) -> None:
        if before is not None:
            before.result()  # a segment switch queued ahead of these records is done
        t0 = time.perf_counter()
        blob = encode_group(step, groups)
        file = self._file
        at = file.tell()
        file.write(blob)
        file.flush()
        memo = _written.get(self.dir)
        if memo is not None and memo[3][0] == at:  # the segment as this writer wrote it, step by step
            memo[4].append((step, at))
            _written[self.dir] = (*memo[:3], (at + len(blob), os.fstat(file.fileno()).st_mtime_ns), memo[4])
        if self._fsync_ms is not None and (time.monotonic() - self._last_fsync) * 1000 >= self._fsync_ms:
            os.fsync(file.fileno())
            self._last_fsync = time.monotonic()
        self.background_seconds += time.perf_counter() - t0

    def wait(self) -> None:
        """The records handed over so far are written (and synced per the policy)."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self.wait_for(pending)

    def pending(self) -> Future | None:
        """The write of the records handed over so far (None: all written): for ``wait_for``."""
        return self._pending

    def wait_for(self, pending: Future | None, behind: bool = False) -> None:
        """Those records are written. ``behind``: the caller is the write-behind thread, whose wait
        is off the training path (``behind_seconds``); any other is on it (``seconds``)."""
        if pending is None:
            return
        t0 = time.perf_counter()
        pending.result()
        waited = time.perf_counter() - t0
        if behind:
            self.behind_seconds += waited
        else:
            self.seconds += waited

    def records(self, after_step: int, up_to_step: int | None = None) -> Iterator[LogRecord]:
        """Records with ``after_step < step <= up_to_step``, in log order, across segments. A segment
        followed by one that starts at or before ``after_step + 1`` holds no such record: it is not read."""
        segs = self.segments()
        for seg, nxt in zip(segs, [*segs[1:], None]):
            if nxt is not None and self.first_step(nxt) <= after_step + 1:
                continue
            records, _ = scan(seg)
            for r in records:
                if r.step > after_step and (up_to_step is None or r.step <= up_to_step):
                    yield r

    def replay(self, after_step: int, need: int) -> tuple[list[LogRecord], int]:
        """The records of every complete step after ``after_step``, as long as the steps run on
        without a gap, and the last such step (``after_step`` if none). Raises ``LogGapError`` when
        that last step is before ``need``: the log cannot bring the shard to the step it must reach,
        and the error names the segment, the first step missing and why."""
        segs = self.segments()
        complete: dict[int, list[LogRecord]] = {}
        damage: dict[int, tuple[Path, str]] = {}  # step -> where a record of or after it was damaged
        read: list[Path] = []
        for seg, nxt in zip(segs, [*segs[1:], None]):
            if nxt is not None and self.first_step(nxt) <= after_step + 1:
                continue
            read.append(seg)
            out, end, why = entries(seg)
            pending: list[Entry] = []
            last_step = self.first_step(seg) - 1  # the step of the last end record read
            for e in out:
                r = e.record
                if r is None:
                    damage.setdefault(last_step + 1, (seg, f"the record at byte {e.offset} fails its CRC"))
                    pending.append(e)
                    continue
                if r.table != END:
                    pending.append(e)
                    continue
                count = r.rows.shape[1]
                group = pending[len(pending) - count :] if count else []
                if len(pending) >= count and all(g.record is not None and g.record.step == r.step for g in group):
                    complete.setdefault(r.step, []).extend(g.record for g in group)
                last_step = max(last_step, r.step)
                pending = []
            if why:
                damage.setdefault(last_step + 1, (seg, why))
        last = after_step
        while last + 1 in complete:
            last += 1
        if last < need:
            raise LogGapError(self._gap(last + 1, need, read, damage))
        return [r for step in range(after_step + 1, last + 1) for r in complete[step]], last

    def _gap(self, step: int, need: int, read: list[Path], damage: dict[int, tuple[Path, str]]) -> str:
        """Why ``step`` is not in the log, in one line."""
        where = f"log of shard {self.shard}: step {step} cannot be rebuilt"
        hit = [(s, d) for s, d in damage.items() if s <= step]
        holders = [seg for seg in read if self.first_step(seg) <= step]
        if hit:
            seg, why = max(hit)[1]
            cause = f"{seg}: {why}"
        elif not holders:
            first = f"the first segment left is {read[0].name}" if read else "no segment is left"
            cause = f"{self.dir}: no segment holds it ({first}; the segments before were removed)"
        else:
            seg = holders[-1]
            later = [s for s in read if self.first_step(s) > step]
            cause = f"{seg}: it ends before step {step}" + (
                f" and the next segment is {later[0].name} (a segment is missing)" if later else ""
            )
        return (
            f"{where} ({cause}); the shard's updates of steps {step}..{need} are in no intact log, so it cannot "
            f"be restored exactly: put the segment back and --resume, or start the run again"
        )

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after ``step`` (a replayed step will write them again). A segment that
        starts after ``step`` goes: records of later steps are appended to the one open before it, and
        ``records`` and ``replay`` rely on no segment holding steps at or past the next one's first."""
        removed = False
        segs = self.segments()
        for seg, nxt in zip(segs, [*segs[1:], None]):
            if self.first_step(seg) > step:
                seg.unlink()
                removed = True
                continue
            if nxt is not None and self.first_step(nxt) <= step + 1:
                continue  # its steps are all before the next one's first, which is at most step + 1
            at, size = self._cut_from(seg, step)
            if at is None:
                framed, end, size = file_frames(seg)
                # the records before the first whose step field says a later step stay as they are,
                # damaged ones included (a replay that needs their steps names them): only the records
                # from there on are read and checked (a regroup cuts the last step's, at the tail); a
                # torn tail goes. Nothing from there on: the file stays as it is, unread.
                at = next((a for a, s in framed if s > step), end)
            if at == size:
                continue
            with open(seg, "rb") as f:
                f.seek(at)
                tail = f.read()
            out, end, _ = entries(seg, tail)  # offsets from ``at``
            bounds = [e.offset for e in out[1:]] + [end]
            cut = next((e.offset for e in out if e.record is not None and e.record.step > step), end)
            later = [
                tail[e.offset : b]
                for e, b in zip(out, bounds)
                if e.offset >= cut and e.record is not None and e.record.step <= step
            ]
            if later:
                with open(seg, "rb") as f:
                    head = f.read(at + cut)
                write_atomic(seg, b"".join([head, *later]))
            elif at + cut < size:
                cut_file(seg, at + cut)  # the tail goes: the file cut in place, not written again
        if removed:
            fsync_dir(self.dir)

    def _cut_from(self, seg: Path, step: int) -> tuple[int | None, int]:
        """Where the records of steps after ``step`` begin in ``seg``, and its size, from what this
        process wrote to it (its step offsets, ``_written``), if the file is still exactly that
        (the same inode, size and time: nothing appended, cut or replaced since) and what it held before
        this process appended (steps before its first: records are appended in step order) needs
        no cut; (None, 0) otherwise (the segment is framed)."""
        memo = _written.get(self.dir)
        if memo is None or memo[0] != seg:
            return None, 0
        path, inode, base, (size, mtime), steps = memo
        if base and (not steps or step < steps[0][0] - 1):
            return None, 0
        try:
            st = os.stat(seg)
        except FileNotFoundError:
            return None, 0
        if (st.st_ino, st.st_size, st.st_mtime_ns) != (inode, size, mtime):
            return None, 0
        return next((a for s, a in steps if s > step), size), size

    def drop_before(self, step: int) -> list[Path]:
        """Remove segments whose updates all precede ``step`` (a newer checkpoint covers them)."""
        segs = self.segments()
        dropped = []
        for seg, nxt in zip(segs, segs[1:]):
            if self.first_step(nxt) <= step + 1:
                seg.unlink()
                dropped.append(seg)
        if dropped:
            fsync_dir(self.dir)
        return dropped

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._close_file()
        self._opened = False

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.flush()
            if self._fsync_ms is not None:
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
