"""A checkpoint's shard snapshot is that shard's, at that step, or it is not kept.

Before every checkpoint's snapshot, each shard's identity key ``{namespace}:meta:shard`` is set to
its index (``embeddings.store.markers.Markers.stamp``), and its applied marker read. Before the manifest
is written, each snapshot file is read back for its keys of the run's namespace: it must hold
exactly one identity key, naming its shard, and the applied marker the shard had at the snapshot.
A file that fails (another server's file picked up, another run's namespace, a stale dump) is named
in one line, and the checkpoint is abandoned. The manifest records what was checked (``identity``);
a restore takes a snapshot only where the manifest says it is that shard's (the checksums prove
the file is the one checked), and checks an older manifest's file itself.
"""

from __future__ import annotations

from pathlib import Path

from embeddings.errors import EmbeddingStoreError

SHARD_KEY = b"meta:shard"
APPLIED_KEY = b"meta:applied"


def snapshot_identity(path: Path, key_namespace: str) -> tuple[list[int], list[int]]:
    """The identity keys' shards and the applied markers that the snapshot at ``path`` holds under
    ``key_namespace`` (more than one of each where it holds several databases or servers)."""
    from embeddings.snapshots.rdb import read_keys

    head = f"{key_namespace}:".encode()
    shards: list[int] = []
    applied: list[int] = []
    for key, value in read_keys(path, head + b"meta:"):
        if not isinstance(value, bytes):
            continue
        name = key[len(head) :]
        if name == SHARD_KEY:
            shards.append(int(value))
        elif name == APPLIED_KEY:
            applied.append(int(value))
    return shards, applied


def snapshot_mismatch(
    path: Path, key_namespace: str, shard: int, applied: int | None = None, check_applied=True, unstamped_ok=False
) -> str:
    """Why the snapshot at ``path`` is not shard ``shard``'s of namespace ``key_namespace`` with
    applied marker ``applied`` (None: never applied); '' where it is. ``unstamped_ok``: a file with
    no identity key passes (a checkpoint written before identity keys: only another shard's key
    fails it). A file that does not parse is named too."""
    try:
        shards, markers = snapshot_identity(path, key_namespace)
    except (OSError, ValueError, EmbeddingStoreError) as e:
        return f"{path} cannot be read for its identity ({e})"
    if not shards and unstamped_ok:
        return ""
    if not shards:
        return f"{path} holds no identity key of namespace {key_namespace!r}: it is not shard {shard}'s snapshot"
    if shards != [shard]:
        return f"{path} is the snapshot of shard(s) {shards} of namespace {key_namespace!r}, not of shard {shard}"
    want = [] if applied is None else [applied]
    if check_applied and markers != want:
        return (
            f"{path} holds applied marker {markers or 'none'}, shard {shard} was at "
            f"{'no applied step' if applied is None else 'step ' + str(applied)} at the snapshot"
        )
    return ""
