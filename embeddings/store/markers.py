"""Each shard's applied marker and undo record, and the rollback they allow.

Per shard, ``{namespace}:meta:shard`` holds its index (set before each checkpoint's snapshot: a
snapshot names its shard), ``{namespace}:meta:applied`` holds the last step whose update the shard applied, and
``{namespace}:meta:undo`` that write's rows as they were before it (named for its first step): a
writer that dies part way through a write leaves the marker at the step before and the undo
record of the write, so the shard goes back one write, never half-way. One ``Markers`` per
``RedisStore`` (``store.markers``).
"""

from __future__ import annotations

import struct

import numpy as np

from embeddings import groups as codec
from embeddings.errors import ShardDataError

_UNDO_STEP = struct.Struct("<Q")


def encode_groups(step: int, groups: list[codec.Group]) -> bytes:
    """An undo record: the step (u64, little-endian), then the rows' groups (``embeddings.groups``)."""
    return codec.encode(groups, prefix=_UNDO_STEP.pack(step))


def decode_groups(blob: bytes) -> tuple[int, list[codec.Group]]:
    """An undo record -> (its step, its groups); ``GroupsError`` when it does not decode."""
    if len(blob) < _UNDO_STEP.size:
        raise codec.GroupsError(f"{len(blob)} bytes, too short for an undo record")
    return _UNDO_STEP.unpack_from(blob)[0], codec.decode(blob, _UNDO_STEP.size, copy=True)


class Markers:
    def __init__(self, store) -> None:
        self.store = store
        self.links = store.links

    def marker(self, shard: int) -> int:
        """The shard's applied marker (0: never applied), read under its lock, held by the caller."""
        raw = self.links.wires[shard].get(self.store.meta_key("applied", shard))
        return 0 if raw is None else int(raw)

    def applied_step(self, shard: int) -> int | None:
        """The last step whose update this shard applied (None: never)."""
        key = self.store.meta_key("applied", shard)
        raw = self.links.mapped(shard, lambda: self.links.locked_get(shard, key))
        return None if raw is None else int(raw)

    def stamp(self, shard: int) -> int | None:
        """Before a snapshot of ``shard``: its identity key ``{namespace}:meta:shard`` set to its
        index, so that its snapshot names the shard it is of (``recovery.durable.checkpoint.check_snapshot``);
        -> its applied marker (None: never applied), which the snapshot must hold."""
        key = self.store.meta_key("shard", shard)
        self.links.call(shard, lambda c: c.set(key, b"%d" % shard))
        return self.applied_step(shard)

    def applied_steps(self) -> list[int | None]:
        """Per shard: the last step whose update it applied (None: never)."""

        def get(s: int):
            def run():
                v = self.links.locked_get(s, self.store.meta_key("applied", s))
                return None if v is None else int(v)

            return run

        n = self.store.num_shards
        res = self.links.on_shards({s: get(s) for s in range(n)})
        return [res[s] for s in range(n)]

    def rollback(self, shard: int, to_step: int) -> int:
        """Back to ``to_step``: undo the one write a shard applied after it, or the rows a writer that
        died part way through the write after ``to_step`` left (marker still at ``to_step``, undo
        record of ``to_step + 1``). A write covers one step, or a window of steps up to the marker
        (``write_every``); its undo record is named for its first step. Returns rows restored."""
        st, links = self.store, self.links
        st._forget(shard)
        endpoint = links.endpoints[shard]
        applied = self.applied_step(shard) or 0  # never applied: cut short in its first step, or untouched
        if applied < to_step:
            return 0
        blob = links.mapped(shard, lambda: links.locked_get(shard, st.meta_key("undo", shard)))
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
        args: list[tuple[bytes, np.ndarray, np.ndarray]] = [(st.prefix(t, shard), ids, rows) for t, ids, rows in groups]
        extra = [
            [b"SET", st.meta_key("applied", shard), b"%d" % to_step],
            [b"SET", st.meta_key("undo", shard), b""],
        ]
        st.writes.fit(shard)

        def run():
            with links.locks[shard]:
                return links.wires[shard].set_rows(args, extra)

        return links.mapped(shard, run)
