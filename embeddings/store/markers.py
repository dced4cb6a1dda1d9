"""Each shard's applied marker and undo record, and the rollback they allow.

Per shard, ``{namespace}:meta:shard`` holds its index (set before each checkpoint's snapshot: a
snapshot names its shard), ``{namespace}:meta:applied`` holds the last step whose update the shard applied, and
``{namespace}:meta:undo`` that write's rows as they were before it (named for its first step): a
writer that dies part way through a write leaves the marker at the step before and the undo
record of the write, so the shard goes back one write, never half-way. One ``Markers`` per
``RedisStore``, given the shards' links and key names.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np

from embeddings import groups as codec
from embeddings.errors import ShardDataError
from embeddings.net.links import ShardLinks
from embeddings.store.row_space import RowSpace

_UNDO_STEP = struct.Struct("<Q")


def encode_groups(step: int, groups: list[codec.Group]) -> bytes:
    """An undo record: the step (u64, little-endian), then the rows' groups (``embeddings.groups``)."""
    return codec.encode(groups, prefix=_UNDO_STEP.pack(step))


def decode_groups(blob: bytes) -> tuple[int, list[codec.Group]]:
    """An undo record -> (its step, its groups); ``GroupsError`` when it does not decode."""
    if len(blob) < _UNDO_STEP.size:
        raise codec.GroupsError(f"{len(blob)} bytes, too short for an undo record")
    return _UNDO_STEP.unpack_from(blob)[0], codec.decode(blob, _UNDO_STEP.size, copy=True)


def read_marker(links: ShardLinks, space: RowSpace, shard: int) -> int:
    """The shard's applied marker (0: never applied), read under its lock, held by the caller."""
    raw = links.wires[shard].get(space.meta_key("applied", shard))
    return 0 if raw is None else int(raw)


class Markers:
    def __init__(
        self,
        links: ShardLinks,
        space: RowSpace,
        forget: Callable[[int], None],
        fit: Callable[[int], None],
    ) -> None:
        """``forget(shard)``: the writer's held rows of a shard rolled back go; ``fit(shard)``: its
        listpack limits raised before a row write (``RowWrites.fit``)."""
        self.links, self.space, self.forget, self.fit = links, space, forget, fit

    def applied_step(self, shard: int) -> int | None:
        """The last step whose update this shard applied (None: never)."""
        key = self.space.meta_key("applied", shard)
        raw = self.links.mapped(shard, lambda: self.links.locked_get(shard, key))
        return None if raw is None else int(raw)

    def stamp(self, shard: int) -> int | None:
        """Before a snapshot of ``shard``: its identity key ``{namespace}:meta:shard`` set to its
        index, so that its snapshot names the shard it is of (``recovery.durable.checkpoint.check_snapshot``);
        -> its applied marker (None: never applied), which the snapshot must hold."""
        key = self.space.meta_key("shard", shard)
        self.links.call(shard, lambda c: c.set(key, b"%d" % shard))
        return self.applied_step(shard)

    def applied_steps(self) -> list[int | None]:
        """Per shard: the last step whose update it applied (None: never)."""

        def get(s: int):
            def run():
                v = self.links.locked_get(s, self.space.meta_key("applied", s))
                return None if v is None else int(v)

            return run

        n = len(self.links.clients)
        res = self.links.on_shards({s: get(s) for s in range(n)})
        return [res[s] for s in range(n)]

    def rollback(self, shard: int, to_step: int) -> int:
        """Back to ``to_step``: undo the one write a shard applied after it, or the rows a writer that
        died part way through the write after ``to_step`` left (marker still at ``to_step``, undo
        record of ``to_step + 1``). A write covers one step, or a window of steps up to the marker
        (``write_every``); its undo record is named for its first step. Returns rows restored."""
        sp, links = self.space, self.links
        self.forget(shard)
        endpoint = links.endpoints[shard]
        applied = self.applied_step(shard) or 0  # never applied: cut short in its first step, or untouched
        if applied < to_step:
            return 0
        blob = links.mapped(shard, lambda: links.locked_get(shard, sp.meta_key("undo", shard)))
        try:
            undo_step, groups = decode_groups(blob) if blob else (None, [])
        except codec.GroupsError as e:
            raise ShardDataError(f"shard {shard} at {endpoint}: its undo record is damaged ({e})") from e
        if applied == to_step:  # complete at to_step, unless a write of to_step + 1 was cut short
            if undo_step != to_step + 1:
                return 0
        elif blob is None:
            raise ShardDataError(f"shard {shard} at {endpoint}: applied step {applied} has no undo record")
        if undo_step != to_step + 1:
            raise ShardDataError(
                f"shard {shard} at {endpoint}: at step {applied}, cannot roll back to {to_step} "
                f"(undo record is for step {undo_step}; one write can be undone)"
            )
        args: list[tuple[bytes, np.ndarray, np.ndarray]] = [(sp.prefix(t, shard), ids, rows) for t, ids, rows in groups]
        extra = [
            [b"SET", sp.meta_key("applied", shard), b"%d" % to_step],
            [b"SET", sp.meta_key("undo", shard), b""],
        ]
        self.fit(shard)

        def run():
            with links.locks[shard]:
                return links.wires[shard].set_rows(args, extra)

        return links.mapped(shard, run)
