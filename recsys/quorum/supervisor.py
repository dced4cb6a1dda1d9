"""The launcher's side of ``--trainer-recovery replace``: the run's Lighthouse, its trainers, and a
dead trainer started again alone while the others go on.

The Lighthouse runs in the launching process on loopback (``--lighthouse host:port`` joins one that
runs elsewhere: trainers on several machines form one run). Each trainer is a process of its own
(``recsys.quorum.regroup.replica_main``). One that dies (a signal, an injected failure) is
started again after ``--restart-delay`` seconds, up to ``--max-restarts`` times in all; the others
meet it at a quorum when it is ready. A trainer that reports an error ends the run with that
error's line (the others are stopped). Every process started here is stopped on every way out.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import shutil
import sys
import time
from pathlib import Path

from recovery.durable import layout
from recovery.durable.files import append_line, read_lines
from recsys.errors import TrainerFailed, first_cause, read_errors

POLL_S = 0.05
END_GRACE_S = 120.0  # once the run ended, trainers still running get this long to end too
FATAL_GRACE_S = 10.0  # once a trainer reported an error, the others get this long to report its cause


def launch_replicas(cfg, urls: list[str], namespace: str, specs, start_method: str) -> dict | None:
    """Run the trainers as replica groups until the run ends; -> rank 0's summary."""
    from recsys.quorum.regroup import SUPERVISOR_ENV, RunMarks, replica_main
    from recsys.quorum.replica import Lighthouse, quiet_torchft

    quiet_torchft()
    if start_method == "fork":
        # torchft's modules (0.1 s to import, no thread started) once here: a trainer forked from
        # this process, a replacement too, builds its manager at once
        import torchft.checkpointing.pg_transport  # noqa: F401
        import torchft.manager  # noqa: F401
        import torchft.process_group  # noqa: F401
    out = Path(cfg.train.out)
    lighthouse = None
    address = cfg.recovery.lighthouse
    if not address:
        lighthouse = Lighthouse(out / "lighthouse.log")
        address = lighthouse.url
    elif "://" not in address:
        address = f"http://{address}"
    ctx = multiprocessing.get_context(start_method)
    results = ctx.Queue()
    marks = RunMarks(out, cfg.train.trainers)
    marks.clear()  # a launch begins: the first trainers meet by it, replacements know the run began
    shutil.rmtree(layout.errors_dir(out), ignore_errors=True)  # an earlier launch's errors are not this one's
    if lighthouse is not None:  # ``--inject lighthouse@WHEN`` kills it
        os.environ["RECSYS_LIGHTHOUSE_PID"] = str(lighthouse.proc.pid)
    specs_d = [s.__dict__.copy() for s in specs]
    os.environ[SUPERVISOR_ENV] = str(os.getpid())  # its trainers ask it to stop one left out (``fence_left``)
    procs: dict[int, multiprocessing.process.BaseProcess] = {}

    def start(i: int) -> None:
        p = ctx.Process(
            target=replica_main, args=(cfg.to_dict(), urls, namespace, specs_d, i, address, results), name=f"trainer{i}"
        )
        p.start()
        procs[i] = p

    sup = _Supervisor(cfg, out, procs, marks)
    try:
        for i in range(cfg.train.trainers):
            start(i)
        summary = None
        while procs or sup.pending:
            summary = _drain(results, summary)
            if lighthouse is not None and lighthouse.died() and procs and not marks.has_ended():
                # a Lighthouse started again would form a quorum of whoever asks first, under the
                # quorum ids of the one that died: the run stops here, its state kept to resume from
                for p in procs.values():
                    p.kill()
                raise TrainerFailed(
                    f"the Lighthouse at {lighthouse.address} died (exit status {lighthouse.proc.returncode}): "
                    f"the trainers were stopped; finish the run with --resume {out}"
                )
            for i in sup.reap():
                start(i)
            time.sleep(POLL_S)
        return _drain(results, summary)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
            p.join(5)
        if lighthouse is not None:
            lighthouse.close()
        os.environ.pop(SUPERVISOR_ENV, None)  # a later run of this process may have no supervisor


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` stands stopped (state T or t in ``/proc/PID/stat``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _drain(results, summary: dict | None) -> dict | None:
    try:
        while True:
            summary = results.get_nowait()
    except queue.Empty:
        return summary


class _Supervisor:
    """Which trainers ended how, and which to start again when."""

    def __init__(self, cfg, out: Path, procs: dict, marks) -> None:
        self.cfg, self.out, self.procs, self.marks = cfg, out, procs, marks
        self.pending: dict[int, float] = {}  # trainer -> when its replacement starts
        self.replaced = 0
        self.seen: dict[int, float] = {}  # trainer -> when its last death was met here
        self.started = time.time()
        self.ended_at: float | None = None
        self.left: dict[int, float] = {}  # trainer -> the --trainer-timeout it was left out after

    def stop_left_out(self) -> None:
        """A trainer a quorum left out while its process stands stopped (SIGSTOP, a debugger, a frozen
        container: silent past ``--trainer-timeout``) is killed here, before it can resume with its
        old state, recorded as a failure, and replaced as after a death; the members wait for it to
        be gone (``recsys.quorum.regroup.fence_left``). One that runs, late to see a death, is let
        be: it asks for the next quorum, as before."""
        for rec in self.marks.left_out():
            i, pid = rec["index"], rec["pid"]
            p = self.procs.get(i)
            if p is None or p.pid != pid or p.exitcode is not None or not _stopped(pid):
                self.marks.gone(rec["quorum_id"], pid)  # dead already, not ours, or running: the members go on
                continue
            if i not in self.left:
                self.left[i] = rec["timeout_s"]
                append_line(
                    layout.trainer_failures_file(self.out),
                    {"kind": "left-out", "rank": i, "step": rec["step"], "time": rec["silent_since"]},
                )
                p.kill()

    def reap(self) -> list[int]:
        """Trainers that exited since the last call met; -> the trainers to start again now."""
        self.stop_left_out()
        for i, p in list(self.procs.items()):
            if p.exitcode is None:
                continue
            del self.procs[i]
            if p.exitcode == 0:
                self.ended_at = self.ended_at or time.time()
            elif p.exitcode == 3:
                self._fatal(i)
            else:
                self._died(i, p.exitcode)
        now = time.time()
        if self.marks.has_ended() or self.ended_at is not None:
            self.pending.clear()  # the run ended: nobody to replace
            if self.ended_at is not None and now - self.ended_at > END_GRACE_S:
                for p in self.procs.values():
                    p.kill()
        due = [i for i, when in self.pending.items() if now >= when]
        for i in due:
            del self.pending[i]
        return due

    def _fatal(self, i: int) -> None:
        # the error may report another trainer's (``PeerError``): the others, which learn of it in
        # their next collective, get a moment to write theirs, and the run ends with the cause's line
        deadline = time.time() + FATAL_GRACE_S
        while time.time() < deadline and any(p.exitcode is None for p in self.procs.values()):
            first = first_cause(read_errors(self.out))
            if first is not None and first.get("type") != "PeerError":
                break
            time.sleep(POLL_S)
        for p in self.procs.values():
            p.kill()
        errors = read_errors(self.out)
        # the cause's line; else this trainer's own (a lost peer it could not get past)
        first = first_cause(errors) or errors.get(f"trainer{i}")
        who, line = (first["who"], first["line"]) if first else (f"trainer{i}", "exited with status 3")
        raise TrainerFailed(
            f"{who.replace('trainer', 'trainer ')}: {line} (traceback in {layout.errors_dir(self.out)})"
        )

    def _died(self, i: int, code: int) -> None:
        import signal

        why = (
            signal.Signals(-code).name
            if code < 0 and -code in signal.Signals._value2member_map_
            else f"exit status {code}"
        )
        if i in self.left:
            why = f"left out: no answer within --trainer-timeout {self.left.pop(i):g} s, stopped here"
        if self.marks.has_ended():
            return  # the run ended meanwhile: a replacement has nothing left to do
        deaths = read_lines(layout.trainer_failures_file(self.out))
        since = self.seen.get(i, self.started)
        self.seen[i] = time.time()
        if not any(d.get("rank") == i and d.get("time", 0) >= since for d in deaths):
            # not injected: what this supervisor saw (the survivors' record reads it)
            append_line(
                layout.trainer_failures_file(self.out),
                {"kind": "trainer", "rank": i, "step": None, "time": time.time()},
            )
        budget = self.cfg.recovery.max_restarts
        if self.replaced >= budget:
            if not self.procs:
                raise TrainerFailed(
                    f"trainer {i} died ({why}), the last one, after {self.replaced} replacement(s) of {budget}"
                )
            print(
                f"\ntrainer {i} died ({why}); the others go on without it ({budget} replacement(s) used)",
                file=sys.stderr,
            )
            return
        self.replaced += 1
        delay = self.cfg.recovery.restart_delay
        when = f" in {delay:g} s" if delay else ""
        print(
            f"\ntrainer {i} died ({why}); the others go on, its replacement starts{when} ({self.replaced}/{budget})",
            file=sys.stderr,
        )
        self.pending[i] = time.time() + delay
