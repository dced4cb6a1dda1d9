"""What a trainer built for a quorum is given (``Epoch``), and the quorum's part of its step:
meeting the quorum at the step's start (``meet_quorum``), the state it offers a peer that heals from
it (``state_bytes``), and whether every member holds the same dense state (``dense_crc``,
``same_everywhere``). ``recsys.quorum.regroup`` builds the epochs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from recsys.group import TrainerGroup
from recsys.quorum.replica import Regroup, Replica


@dataclass
class Epoch:
    """What a trainer built for a quorum is given: its group, and how the quorum came about."""

    group: TrainerGroup
    replica: Replica
    index: int
    """This trainer's index (``trainer:R`` names it; its chunks and shards follow its rank)."""
    quorum_id: int
    """The quorum this trainer was built for: another at a step's start ends it."""
    start_state: dict | None = None
    """The state to go on from (a survivor's own, a newcomer's healed one); None: the dense state's."""
    members: tuple[int, ...] = ()
    """The trainers of this quorum (their indices)."""
    left: list[int] = field(default_factory=list)
    joined: dict[int, bool] = field(default_factory=dict)
    """The trainers that joined this quorum, and whether each healed from a peer (else: from the
    per-step dense state, with the others)."""
    heal_s: float = 0.0
    """The longest a newcomer of this quorum took to heal from its peer."""
    detected_at: float = 0.0
    """When this trainer saw the quorum change (a failed collective, a new quorum)."""
    finishing: Callable[[], None] = lambda: None
    """Called as the trainer finishes training (the launcher starts no replacement after)."""


def state_bytes(trainer, step: int) -> bytes:
    """The trainer's state as of ``step`` (its last completed), in the dense state's format: what
    it offers a peer that heals from it."""
    from recovery.durable.dense import to_bytes

    return bytes(to_bytes(trainer.dense_saver.snapshot(step, trainer.state_dict(step))))


def dense_crc(trainer) -> int:
    """CRC-32C of the trainer's dense model and optimizer state (every tensor's bytes, in order)."""
    import crc32c

    from recovery.durable.dense import pack

    model, optim = trainer.state_dict()["dense"].values()
    crc = 0
    for part in (model, optim):
        for _, flat in sorted(pack(part)["flat"].items()):
            crc = crc32c.crc32c(flat.contiguous().numpy().tobytes(), crc)
    return crc


def same_everywhere(group: TrainerGroup, value: int) -> bool:
    """Whether every member of the group holds the same ``value`` (one collective)."""
    v = group.max_flags(np.array([value, -value], dtype=np.int64))
    return int(v[0]) == -int(v[1])


def quorum_step(trainer, step: int) -> bool:
    """``--quorum-every K``: a quorum at every K-th step's start (the same steps for every member);
    its commit decision is torchft's ``should_commit`` (``Replica.commit``)."""
    return step % trainer.cfg.recovery.quorum_every == 0


def meet_quorum(trainer, step: int) -> None:
    """The quorum of ``step`` (at its start, every ``--quorum-every`` steps); a changed one ends the
    trainer (``Regroup``, with the state it holds as of ``step - 1``: a peer that joins heals from it
    meanwhile)."""
    if not quorum_step(trainer, step):
        return
    replica = trainer.epoch.replica
    replica.offer = lambda: state_bytes(trainer, step - 1)
    q = replica.quorum(step - 1)
    if q.quorum_id != trainer.epoch.quorum_id:
        trainer.recovery.writer.settle_behind()  # this trainer's rows of step - 1 on their shards
        raise Regroup(q, trainer.state_dict(step - 1))
