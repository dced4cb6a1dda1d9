"""A run owns its key namespace: a claim on every shard, written before the run touches a row.

The claim is the shard's bookkeeping key ``{namespace}:meta:owner`` (``RedisStore.meta_key``: on a
Redis Cluster it carries the shard's hash tag, so it lives on the shard's slot like its rows), set
with ``SET NX`` to a JSON object: the run's id, its out folder (absolute), host, pid and time.

- a shard with no claim and no rows of the namespace: claimed;
- a claim of the same run id (``--resume`` of the owning run, a trainer group restarted under
  torchrun): taken back (rewritten with this process's pid and time);
- a claim of another run, or (for a fresh run) rows of the namespace with no claim (a step's
  ``applied`` marker: a run from before claims existed): refused with ``NamespaceClaimError``, one
  line naming the namespace, the shard and its endpoint, and both runs; nothing is written (claims
  this call made on other shards are taken back).

``take_over=True`` takes a namespace that another run (or no recorded run) left: every key of the
namespace is deleted on every shard (rows, markers, the old claim), then the claim is written. An
owner that ``alive(claim)`` reports as still running (its pid) is never taken over.

The claim stays when the run ends: its rows are still there, and the next run over the namespace
learns whose they are.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from embeddings.errors import EmbeddingStoreError

OWNER = "owner"  # the claim's name among the shard's meta keys: ``{namespace}:meta:owner``
APPLIED = "applied"  # a step's marker: the namespace holds rows a run wrote


class NamespaceClaimError(EmbeddingStoreError):
    """The namespace belongs to another run (or holds rows of one): this run did not start."""


@dataclass(frozen=True)
class Claim:
    run_id: str
    out: str
    """The run's out folder, absolute."""
    host: str
    pid: int
    time: float

    @classmethod
    def mine(cls, run_id: str, out: str | os.PathLike) -> Claim:
        """This process's claim for run ``run_id`` writing into ``out``."""
        return cls(run_id, os.path.abspath(out), socket.gethostname(), os.getpid(), round(time.time(), 3))

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> Claim | None:
        """The claim a shard holds (None: none); a value that is not one reads as an unknown run."""
        if raw is None:
            return None
        try:
            d = json.loads(raw)
            return cls(str(d["run_id"]), str(d["out"]), str(d["host"]), int(d["pid"]), float(d["time"]))
        except (ValueError, KeyError, TypeError):
            return cls("?", "?", "?", 0, 0.0)

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.time)) if self.time else "?"
        return f"run {self.run_id} (out {self.out}, pid {self.pid} on {self.host}, since {when})"


def claim_namespace(
    store,
    me: Claim,
    *,
    take_over: bool = False,
    fresh: bool = True,
    alive: Callable[[Claim], int | None] = lambda owner: None,
) -> list[int]:
    """Claim ``store``'s namespace on every shard for ``me`` (see the module doc). ``fresh``: a run
    that starts from step 0 (rows of the namespace with no claim are another run's); a resume
    expects its own rows. ``alive(owner)``: the pid of the owner's run if it still runs, else None.
    -> the shards whose keys a take-over deleted (empty when nothing was taken over)."""
    ns = store.namespace
    blob = me.encode()
    mine: list[int] = []  # shards this call claimed: taken back if another shard refuses
    foreign: dict[int, Claim | None] = {}  # shard -> the other run's claim (None: rows, no claim)
    try:
        for s in range(store.num_shards):
            key = store.meta_key(OWNER, s)
            if store.call(s, lambda c, key=key: c.set(key, blob, nx=True)):
                mine.append(s)
                if fresh and store.call(s, lambda c, s=s: c.exists(store.meta_key(APPLIED, s))):
                    foreign[s] = None
                continue
            owner = Claim.decode(store.call(s, lambda c, key=key: c.get(key)))
            if owner is not None and owner.run_id == me.run_id:
                store.call(s, lambda c, key=key: c.set(key, blob))  # our own run's: taken back
                continue
            foreign[s] = owner
        if not foreign:
            return []
        s, owner = min(foreign.items())
        where = f"namespace {ns!r} on shard {s} at {store.endpoint(s)}"
        this = f"this run (out {me.out})"
        if owner is None:
            held = "holds the rows of an earlier run that recorded no owner"
        else:
            held = f"is owned by {owner.describe()}"
        if not take_over:
            raise NamespaceClaimError(
                f"{where} {held}; {this} did not start: give another --namespace, or --take-over-namespace "
                "(its keys are deleted) once that run is gone"
            )
        for owner in {c for c in foreign.values() if c is not None}:
            pid = alive(owner)
            if pid is not None:
                raise NamespaceClaimError(
                    f"{where} is owned by {owner.describe()}, which is still running (pid {pid}); "
                    f"{this} did not start: --take-over-namespace takes only a namespace whose run is gone"
                )
    except BaseException:
        for s in mine:  # what this call wrote, nothing else (commands a run sends anyway: GET, UNLINK)
            try:
                key = store.meta_key(OWNER, s)
                if store.call(s, lambda c, key=key: c.get(key)) == blob:
                    store.call(s, lambda c, key=key: c.unlink(key))
            except EmbeddingStoreError:
                pass  # the shard is gone: so is the claim, or the refusal's cause is shown anyway
        raise
    store.clear()  # the old run's rows, markers and claim, on every shard
    for s in range(store.num_shards):
        store.call(s, lambda c, s=s: c.set(store.meta_key(OWNER, s), blob))
    return sorted(foreign)
