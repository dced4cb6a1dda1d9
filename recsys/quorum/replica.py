"""A trainer's death stops no one (``--trainer-recovery replace``): each trainer is one torchft
replica group, and the trainers meet at a quorum (torchft's Lighthouse) at the start of every K-th
step (``--quorum-every``); every step a commit decision (``Replica.commit``: torchft's
``should_commit`` at the quorum steps, the same decision made here on the steps between).

One ``Replica`` per trainer process holds its ``torchft.Manager`` and the quorum's gloo group
(``QuorumProcessGroup``, configured again by the manager whenever the quorum changes). Every
collective of the trainer runs on that group (``QuorumComm``, the ``TrainerGroup``'s ``comm``); a
collective that fails (a peer died, or stayed silent past ``--trainer-timeout``) raises ``PeerLost``.

A step: the quorum (``Replica.quorum``, every K-th step; unchanged: on), the step under the tier's
commit protocol, then ``should_commit``. The quorum changes, a collective fails or a step is not
committed: the trainer's loop ends (``Regroup`` or ``PeerLost``, ``recsys.quorum.regroup``), the
trainers of the new quorum agree where to go on from, and each builds its trainer again in the same
process (no torch import, no new process): a trainer left, or a step was cut short, and every
trainer resumes from the per-step dense state (every shard back to its step, the undo records taking
back what a discarded step wrote, as a group restart does); a trainer only joined, and the others go
on from the step they were at, the newcomer healed from a live peer through torchft's checkpoint
transport (the peer's dense model, optimizer and run state, as bytes). The chunks of each step are
fixed (one per trainer the run started with) and reduced in chunk order, so the quorum's size never
changes the arithmetic: survivors train a dead trainer's chunks beside their own, and the run ends
bit-identical to a run without the death.

Timeouts: a trainer's manager heartbeats every ``HEARTBEAT_S``; the Lighthouse drops one silent for
``HEARTBEAT_TIMEOUT_S`` (a killed trainer's detection time). A slow trainer that still heartbeats is
waited for at the quorum (up to ``JOIN_TIMEOUT_S``), and within a collective for
``--trainer-timeout`` seconds, after which the step is discarded and the quorum forms again (with
it, while it heartbeats).
"""

from __future__ import annotations

import datetime
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from recsys.clock import Collectives

HEARTBEAT_S = 0.05
HEARTBEAT_TIMEOUT_S = 0.25
QUORUM_TICK_MS = 10
# a quorum with a trainer heartbeating but not yet asking waits this long for it, counted from the
# first member's ask: a replacement that asked early (it waits for the others' next quorum step)
# must not let the first survivor to arrive form a quorum without the others
JOIN_TIMEOUT_S = 5.0
QUORUM_TIMEOUT_S = 600.0  # a quorum waits this long for its members (a slow step, a long restore)


class PeerLost(RuntimeError):
    """A collective of the quorum failed: a trainer died or stayed silent past the timeout."""


class Regroup(Exception):
    """The quorum changed at a step's start: the trainers regroup (``recsys.quorum.regroup``)."""

    def __init__(self, quorum: Quorum, live: dict | None) -> None:
        super().__init__(f"the quorum changed: trainers {list(quorum.members)}")
        self.quorum, self.live = quorum, live


@dataclass(frozen=True)
class Quorum:
    quorum_id: int
    members: tuple[int, ...]
    """The trainers (their indices) of the quorum, in rank order."""
    rank: int
    healed: bytes | None
    """The state healed from a peer at this quorum (``recsys.quorum.regroup.state_bytes``), or None."""
    seconds: float


def quiet_torchft() -> None:
    """torchft's per-step info, its warning that no NCCL flight recorder runs (gloo on CPU) and its
    transport's warnings about torch's own calls: nothing the user can act on."""
    for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
        logging.getLogger(name).setLevel(logging.ERROR)
    os.environ.setdefault("RUST_LOG", "error")
    warnings.filterwarnings("ignore", module=r"torchft\.")


class Lighthouse:
    """torchft's Lighthouse as a process of its own (``lighthouse_main.py``: torchft's native
    module alone, no torch), on loopback: its threads never live in the process that forks the
    trainers. ``log``: where its output goes."""

    def __init__(self, log: Path) -> None:
        import importlib.util

        from embeddings.servers.launcher import free_port

        spec = importlib.util.find_spec("torchft")  # found, not imported (that would import torch)
        where = Path(spec.origin).parent if spec is not None and spec.origin else None
        native = sorted(where.glob("_torchft*.so")) if where is not None else []
        if not native:
            raise RuntimeError("torchft is not installed (pip install torchft): --trainer-recovery replace needs it")
        self.log, self.native = log, native[0]
        self.address = f"127.0.0.1:{free_port()}"
        self.url = f"http://{self.address}"
        self.start()

    def start(self) -> None:
        """The Lighthouse process, started; returns once it accepts connections."""
        import socket
        import subprocess
        import sys

        min_replicas = 1
        port = int(self.address.rsplit(":", 1)[1])
        cmd = [
            sys.executable, str(Path(__file__).with_name("lighthouse_main.py")), "--bind", self.address,
            "--min_replicas", str(min_replicas),
            "--join_timeout_ms", str(int(JOIN_TIMEOUT_S * 1000)), "--quorum_tick_ms", str(QUORUM_TICK_MS),
            "--heartbeat_timeout_ms", str(int(HEARTBEAT_TIMEOUT_S * 1000)),
        ]  # fmt: skip
        env = {**os.environ, "RECSYS_TORCHFT_NATIVE": str(self.native), "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        log = self.log
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.close()
                    raise RuntimeError(f"the Lighthouse did not start on {self.address} (its output: {log})") from None
                time.sleep(0.02)

    def died(self) -> bool:
        return self.proc.poll() is not None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _quorum_group_class():
    from torchft.process_group import ProcessGroupGloo

    class QuorumProcessGroup(ProcessGroupGloo):
        """torchft's gloo group, which also keeps the quorum it was configured for."""

        members: tuple[int, ...] = ()
        quorum_id: int = -1

        def configure(
            self,
            store_addr,
            replica_id,
            rank,
            world_size,
            quorum_id=None,
            group_rank=None,
            group_world_size=None,
            global_ranks=None,
        ) -> None:
            super().configure(
                store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size, global_ranks
            )
            self.members = tuple(int(r) for r in global_ranks or ())
            self.quorum_id = -1 if quorum_id is None else int(quorum_id)

    return QuorumProcessGroup


class QuorumComm:
    """``TrainerGroup``'s collectives on the quorum's group; one that fails raises ``PeerLost``."""

    def __init__(self, pg) -> None:
        self.pg = pg

    def _wait(self, what: str, start: Callable[[], object]) -> None:
        try:
            Collectives.timed(lambda: start().wait())  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - gloo's errors: connection closed, timed out
            raise PeerLost(f"{what} on the trainers' quorum failed: {str(e).splitlines()[0][:200]}") from None

    def barrier(self) -> None:
        from torch.distributed.distributed_c10d import AllreduceOptions

        t = torch.zeros(1)
        self._wait("a barrier", lambda: self.pg.allreduce([t], AllreduceOptions()))

    def all_reduce(self, t: torch.Tensor, op=None) -> None:
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM if op is None else op
        self._wait("an all-reduce", lambda: self.pg.allreduce([t], opts))

    def broadcast(self, t: torch.Tensor, src: int) -> None:
        from torch.distributed.distributed_c10d import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank, opts.rootTensor = src, 0
        self._wait("a broadcast", lambda: self.pg.broadcast([t], opts))

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor) -> None:
        from torch.distributed.distributed_c10d import AllgatherOptions

        self._wait("an all-gather", lambda: self.pg.allgather([out], [t], AllgatherOptions()))

    def all_to_all(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        from torch.distributed.distributed_c10d import AllToAllOptions

        self._wait("an all-to-all", lambda: self.pg.alltoall_base(out, t, out_splits, in_splits, AllToAllOptions()))


class Replica:
    """One trainer's side of the quorum: its manager, the quorum's group, what it offers a peer
    that heals from it and what it healed."""

    def __init__(self, index: int, lighthouse: str, timeout_s: float) -> None:
        from torch.distributed import TCPStore
        from torchft import Manager
        from torchft.checkpointing.pg_transport import PGTransport

        quiet_torchft()
        self.index = index
        # the replica group's own store (one trainer a group); the quorum's gloo group meets on the
        # store of the quorum's first member
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        timeout = datetime.timedelta(seconds=timeout_s)
        self.pg = _quorum_group_class()(timeout=timeout)
        self.comm = QuorumComm(self.pg)
        self.offer: Callable[[], bytes] = lambda: b""
        self._healed: bytes | None = None
        self.manager = Manager(
            pg=self.pg,
            load_state_dict=self._heal,
            state_dict=self._offer,
            min_replica_size=1,
            use_async_quorum=False,  # a newcomer heals before its first step
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=QUORUM_TIMEOUT_S),
            connect_timeout=datetime.timedelta(seconds=60),
            rank=0,
            world_size=1,
            store_addr="127.0.0.1",
            store_port=self.store.port,
            lighthouse_addr=lighthouse,
            replica_id=f"trainer_{index}",
            hostname="127.0.0.1",
            heartbeat_interval=datetime.timedelta(seconds=HEARTBEAT_S),
            init_sync=False,  # every trainer starts from the same seed, or from the dense state
            # a newcomer's state comes over the quorum's own gloo group (no HTTP server to open)
            checkpoint_transport=PGTransport(self.pg, timeout, torch.device("cpu")),
        )

    def _offer(self) -> dict:
        data = self.offer()
        return {
            "state": torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        }

    def _heal(self, state: dict) -> None:
        t = state["state"]
        self._healed = t.numpy().tobytes() if t.numel() else None

    def quorum(self, step: int) -> Quorum:
        """The quorum of this step (``step``: the steps this trainer holds; one behind the others
        heals from a peer that holds the most, here, before it returns)."""
        self._healed = None
        self.manager.load_state_dict({"step": step, "batches_committed": self.manager.batches_committed()})
        t0 = time.perf_counter()
        self.manager.start_quorum()
        err = self.manager.errored()
        if err is not None:
            raise PeerLost(f"the quorum failed: {str(err.original_exception).splitlines()[0][:200]}")
        rank = self.manager.participating_rank()
        if rank is None:  # pragma: no cover - a synchronous quorum always places its members
            raise PeerLost("this trainer is not placed in the quorum")
        return Quorum(self.pg.quorum_id, self.pg.members, int(rank), self._healed, time.perf_counter() - t0)

    def commit(self, quorum_step: bool = True) -> bool:
        """The step's commit decision: False where its group failed. On a step that began with a
        quorum, torchft's ``should_commit`` (it also applies a heal and counts the step). On the
        steps between, the same decision made here without the round trip to the manager (1.0-1.3 ms
        a step at 2 trainers): a replica group of one trainer commits where its process group and its
        manager hold no error and the quorum has a member, which is what ``should_commit`` sends its
        manager and, with one rank, gets back. torchft's step count is set at every quorum
        (``quorum``), so the steps between need not advance it."""
        if quorum_step:
            return bool(self.manager.should_commit())
        return self.pg.errored() is None and self.manager.errored() is None and self.manager.num_participants() >= 1

    def close(self) -> None:
        try:
            self.manager.shutdown(wait=False)
        except Exception:  # noqa: BLE001 - the process ends anyway
            pass
