"""Exception tree of the recovery package."""

from __future__ import annotations


class RecoveryError(Exception):
    """Base class of every error raised by ``recovery``."""


class CorruptCheckpointError(RecoveryError):
    """A checkpoint file whose bytes do not match its manifest: never load it."""


class CheckpointsAbandonedError(RecoveryError):
    """Several checkpoints in a row failed (a full disk, a refused snapshot): the run stops before
    a shard failure loses every step since the last complete one."""


class NoCheckpointError(RecoveryError):
    """No complete, verified checkpoint to restore from."""


class InjectionSpecError(RecoveryError, ValueError):
    """A ``--inject`` value that does not parse."""


class ShardLostError(RecoveryError):
    """A remote shard that its supervisor did not bring back in time: the run stops, resumable."""


class LogGapError(RecoveryError):
    """A log replay could not reach a step it needed (a gap, a damaged record, a missing segment):
    the shard cannot be rebuilt exactly, and the run stops rather than train on a wrong shard."""


class PeerError(RecoveryError):
    """Another trainer's error ends the run (its own record names the cause): a launcher that
    reads every trainer's error names that one first."""
