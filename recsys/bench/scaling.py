"""``bench-recovery --scaling``: snapshots and restores against shard size, each restore beside what
bounds it.

Per size (bytes of rows per shard, 64-dim float32 rows, ``--scaling-shards`` shards):

- the snapshot: a local ``BGSAVE`` and file copy, a fork streamed over the replication protocol,
  and a scan copy (its whole time is a pause);
- one shard restored from its local file (a replacement ``redis-server`` loads it), over the
  protocol after its supervisor restarted it empty by one full synchronization (the server a
  replica of the restorer for one ``PSYNC``, the way taken first), the same by one ``RESTORE`` per
  bucket (the way where the sync does not apply) and over the older path (one ``HSET`` per bucket;
  up to 1 GB), by replica promotion, and a full restore;
- the same node failure with every shard at once, from local files and over the protocol (the
  shards are restored in parallel);
- the sources: Redis's own load of the same file (a fresh ``redis-server`` on it, until it
  serves), a loopback send of its bytes, a read of it from disk;
- a log replay: the rows of ``--scaling-log-steps`` logged steps read back and written (rows/s).

Replicas are started where 4 copies of every shard fit in the free memory; above that the replica
column reads ``-`` (said in the table's title). The benchmark returns once every server it started
has exited.
"""

from __future__ import annotations

import csv
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import numpy as np

from data.progress import progress

DIM = 64
HSET_UP_TO = 10**9  # the older path's column is measured up to this many bytes a shard (20 s per GB)


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    t = text.strip().upper()
    for u, m in units.items():
        if t.endswith(u):
            return int(float(t[: -len(u)]) * m)
    return int(t)


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (bytes)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def bench_scaling(args) -> list[dict]:
    from recsys.config import ConfigError

    if args.scaling_repeats < 1:
        raise ConfigError(f"--scaling-repeats {args.scaling_repeats}: at least 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    rows: list[dict] = []
    for size in progress(args.scaling_sizes, desc="scaling", unit="size"):
        rows.append(scaling_row(args, size, out, rng))
        md = write_tables(rows, out, args.scaling_shards)  # after each size: a long run keeps what it measured
    print(md)
    return rows


def write_tables(rows: list[dict], out: Path, shards: int) -> str:
    from recsys.bench import markdown

    cols = list(rows[0])
    no_replica = [r["shard_snapshot_mb"] for r in rows if r["recovery_replica_s"] == "-"]
    md = (
        f"Snapshots and restores against shard size ({shards} shards, 64-dim float32 rows; pauses are "
        "what training waits for; `x_redis_load`: against Redis's own load of the same file"
        + (
            f"; no replica at {', '.join(map(str, no_replica))} MB a shard: four copies would not fit"
            if no_replica
            else ""
        )
        + f")\n\n{markdown(rows, cols)}\n"
    )
    (out / "scaling.md").write_text(md)
    with open(out / "scaling.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    return md


def fill(store, per_shard: int, shards: int, rng) -> None:
    chunk = 200_000
    total = per_shard * shards
    for lo in range(0, total, chunk):
        ids = np.arange(lo, min(total, lo + chunk))
        # random rows: a snapshot of constant rows would compress to nothing
        store.write_rows("t", ids, rng.standard_normal((len(ids), DIM), dtype=np.float32))


def scaling_row(args, size: str, out: Path, rng) -> dict:
    import torch

    from embeddings import SGD, ConnectionOptions, LocalShards, RedisStore, TableSet, TableSpec
    from recovery.durable.checkpoint import Checkpointer

    nbytes = parse_size(size)
    per_shard = max(1, nbytes // (4 * DIM))
    n = args.scaling_shards
    tables = TableSet([TableSpec("t", per_shard * n, DIM)])
    replicas = 4 * n * nbytes * 1.2 < available_bytes()
    ckpt_dir = out / f"scaling-{size}"
    with LocalShards(n, replicas=replicas) as sh:
        specs = sh.specs + ([sh.spec(i, replica=True) for i in range(n)] if replicas else [])
        ns = "scale"
        store = RedisStore(
            sh.urls,
            tables,
            SGD(0.1),
            namespace=ns,
            timeout_s=600.0,
            connect=ConnectionOptions(replica_urls=sh.replica_urls or None),
        )
        fill(store, per_shard, n, rng)
        for s in range(n if replicas else 0):
            store.wait_replicated(s, 600_000)
        ckpt = Checkpointer(ckpt_dir, 1, sh.specs, store, run=ns)
        dense = {"x": torch.zeros(1)}
        ckpt.save(0, dense, {"step": 0, "namespace": ns})  # warm-up (DCP's first save, replica syncs)
        ckpt.wait()
        local = ckpt.save(1, dense, {"step": 1, "namespace": ns})
        ckpt.wait()
        ckpt.network_only = True
        net = ckpt.save(2, dense, {"step": 2, "namespace": ns})
        ckpt.wait()
        shard_file = ckpt.candidates()[0].shard_file(0)
        t0 = time.perf_counter()
        scan_copy(store, 0, ckpt_dir / "scan.bin")
        scan_s = time.perf_counter() - t0
        (ckpt_dir / "scan.bin").unlink()  # its pages would crowd the snapshot files out of the page cache
        t = restores(sh, store, ckpt, nbytes, replicas, args.scaling_repeats)
        t["log_replay_rows_per_s"], t["log_replay_write_rows_per_s"] = log_replay(store, ckpt_dir / "log", rng)
        shard_bytes = shard_file.stat().st_size
        disk_s, loopback_s = read_seconds(shard_file), loopback_seconds(shard_file)
        store.close()
    wait_exited(specs)
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return scaling_columns(per_shard, shard_bytes, local, net, scan_s, t, disk_s, loopback_s, n)


def restores(sh, store, ckpt, nbytes: int, replicas: bool, repeats: int) -> dict:
    """Seconds of each restore path (the recovery manager's, as a run uses it) and of Redis's own
    load: the one-shard and every-shard restores and the load the least of ``repeats`` rounds, the
    others once."""
    from embeddings.snapshots.restore_load import first_way
    from recovery.manager import RecoveryManager
    from recovery.protocol import Collective

    every = list(range(store.num_shards))

    def recover(strategy: str, specs, failed=(0,), before=lambda: None) -> float:
        mgr = RecoveryManager(
            strategy=strategy,
            store=store,
            shards=specs,
            rank=0,
            batch_size=1,
            collective=Collective(),
            checkpointer=ckpt,
        )
        for s in failed:
            sh.kill(s)
        before()
        t0 = time.time()
        for s in failed:
            mgr.detected(s, t0)
        mgr.recover_outcome(list(failed), 3, "bench")
        return time.time() - t0

    def restart(*shards):
        return lambda: restart_empty(sh, shards)

    def by_restore(fn) -> float:
        with first_way(store, "RESTORE"):  # the way a server that cannot take the sync gets its keys
            return fn()

    def replicas_follow(follow: bool) -> None:
        if replicas:
            follow_primaries(sh, every, follow)

    # the restores compared with each other, and Redis's own load, are taken in rounds, the least of
    # each kept: a round's measurements share the machine's state (the page cache, another tenant)
    os.sync()  # the checkpoints' dirty pages written back first: not while a restore is timed
    replicas_follow(False)
    files = [ckpt.candidates()[0].shard_file(s) for s in every]
    rounds: dict[str, list[float]] = {}
    for _ in range(repeats):
        for name, fn in (
            ("redis_load_s", lambda: redis_load_seconds(sh, ckpt.candidates()[0].shard_file(0))),
            ("local_1", lambda: recover("partial", sh.specs)),
            # a server the project did not start: its supervisor restarts it empty, rows over the protocol
            ("protocol_1", lambda: recover("partial", [], before=restart(0))),
            ("local_all", lambda: recover("partial", sh.specs, failed=every)),
            ("protocol_all", lambda: recover("partial", [], failed=every, before=restart(*every))),
            ("restore_1", lambda: by_restore(lambda: recover("partial", [], before=restart(0)))),
        ):
            for f in files:  # every source in the page cache, as the one-shard restores find theirs
                read_seconds(f)
            rounds.setdefault(name, []).append(fn())
    t: dict = {name: min(v) for name, v in rounds.items()}
    t["hset_1"] = "-"
    if nbytes <= HSET_UP_TO:
        store.sync_refused[store.endpoint(0)] = store.restore_refused[store.endpoint(0)] = "the benchmark's older path"
        t["hset_1"] = recover("partial", [], before=restart(0))
        store.restore_refused.clear()
        store.sync_refused.clear()
    t["full"] = recover("full", sh.specs)
    t["replica"] = "-"
    if replicas:
        replicas_follow(True)
        sh.await_replica(0, timeout_s=600)  # the replica has resynced with its restored primary
        t["replica"] = recover("replica", sh.specs)
    return t


def restart_empty(sh, shards) -> None:
    """Each shard's server restarted empty, as a supervisor on another machine would (not timed:
    the restore is timed from the moment its empty replacement answers)."""
    for s in shards:
        sh.spec(s).rdb_path.unlink(missing_ok=True)
        sh.restart(s)


def follow_primaries(sh, shards, follow: bool) -> None:
    """Each replica off its primary (the restores are timed without a second server replaying every
    write on this machine's two cores), or back on it."""
    import redis

    for s in shards:
        c = redis.Redis.from_url(sh.url(s, replica=True))
        c.replicaof(sh.host, sh.spec(s).port) if follow else c.replicaof("NO", "ONE")
        c.close()


def redis_load_seconds(sh, shard_file: Path) -> float:
    """Redis's own load of a shard's file: a fresh server on it, started until it serves."""
    from embeddings.servers.launcher import spawn_shard
    from recovery.restore.shard_restore import link_or_copy

    spec = sh.spec(0)
    sh.kill(0)
    link_or_copy(shard_file, spec.rdb_path)
    t0 = time.perf_counter()
    spawn_shard(spec, die_with_parent=False, timeout_s=600)
    return time.perf_counter() - t0


def log_replay(store, log_dir: Path, rng, steps: int = 100, rows_per_step: int = 20_000) -> tuple[int, int]:
    """A log of ``steps`` steps of ``rows_per_step`` Zipf-skewed row updates of shard 0, replayed as
    ``--recovery log`` does it (read, each row's newest, one write). -> (logged rows replayed per
    second, rows written per second of the write)."""
    from recovery.durable.log import ShardLog
    from recovery.restore.strategies import log_groups

    log = ShardLog(log_dir, 0, fsync="none")
    log.open_segment(1)
    rows = store.tables.specs[0].num_rows
    logged = 0
    for step in range(1, steps + 1):
        ids = np.unique(np.minimum(rng.zipf(1.1, rows_per_step) - 1, rows - 1))
        ids = ids[store.shard_map.shard_of(0, ids) == 0]
        log.append_step(step, [(0, ids, rng.standard_normal((len(ids), store.width(0)), dtype=np.float32))])
        logged += len(ids)
    log.close()
    t0 = time.perf_counter()
    groups, _, last = log_groups(log_dir, 0, 0, steps)
    t1 = time.perf_counter()
    store.lay_rows(0, groups, step=last)
    t2 = time.perf_counter()
    written = sum(len(ids) for _, ids, _ in groups)
    return round(logged / (t2 - t0)), round(written / (t2 - t1))


def scaling_columns(per_shard, shard_bytes, local, net, scan_s, t, disk_s, loopback_s, n) -> dict:
    gb = shard_bytes / 1e9
    load = t["redis_load_s"]

    def r(x, nd=3):
        return round(x, nd) if isinstance(x, float) else x

    return {
        "rows_per_shard": per_shard,
        "shard_snapshot_mb": round(shard_bytes / 1e6, 1),
        "snapshot_pause_local_s": round(local.pause_s, 4),
        "snapshot_total_local_s": round(local.total_s, 3),
        "snapshot_pause_network_s": round(net.pause_s, 4),
        "snapshot_total_network_s": round(net.total_s, 3),
        "scan_copy_pause_s": round(scan_s, 3),
        "redis_load_s": round(load, 3),
        "recovery_local_file_s": r(t["local_1"]),
        "local_x_redis_load": round(t["local_1"] / load, 2),
        "recovery_remote_s": r(t["protocol_1"]),
        "remote_x_redis_load": round(t["protocol_1"] / load, 2),
        "recovery_remote_restore_s": r(t["restore_1"]),
        "restore_x_redis_load": round(t["restore_1"] / load, 2),
        "recovery_remote_hset_s": r(t["hset_1"]),
        f"recovery_local_{n}_shards_s": r(t["local_all"]),
        f"local_{n}_x_1": round(t["local_all"] / t["local_1"], 2),
        f"recovery_remote_{n}_shards_s": r(t["protocol_all"]),
        f"remote_{n}_x_1": round(t["protocol_all"] / t["protocol_1"], 2),
        f"remote_{n}_x_restore_1": round(t["protocol_all"] / t["restore_1"], 2),
        "recovery_replica_s": r(t["replica"], 4),
        "full_restore_s": r(t["full"]),
        "log_replay_rows_per_s": t["log_replay_rows_per_s"],
        "log_replay_write_rows_per_s": t["log_replay_write_rows_per_s"],
        # seconds per GB of shard snapshot: the restores, and their sources
        "restore_local_s_per_gb": round(t["local_1"] / gb, 2),
        "restore_remote_s_per_gb": round(t["protocol_1"] / gb, 2),
        "redis_load_s_per_gb": round(load / gb, 2),
        "disk_read_s_per_gb": round(disk_s / gb, 3),
        "loopback_send_s_per_gb": round(loopback_s / gb, 3),
        "remote_x_loopback": round(t["protocol_1"] / loopback_s, 1),
        "shards": n,
    }


def wait_exited(specs, timeout_s: float = 60.0) -> None:
    """Until no ``redis-server`` of these shards' addresses runs (a server killed with a few GB takes
    a moment to give its memory back)."""
    from embeddings.servers.launcher import shard_servers

    deadline = time.monotonic() + timeout_s
    while any(shard_servers(s) for s in specs) and time.monotonic() < deadline:
        time.sleep(0.05)


def scan_copy(store, shard: int, path: Path) -> int:
    """The scan-based alternative to a fork: SCAN the shard's row buckets, read their rows (HVALS,
    pipelined) in chunks, write them. Consistent only if nothing writes meanwhile: its time is the
    pause it would cost. -> bytes."""
    c, n = store.client(shard), 0
    with open(path, "wb") as f:
        keys = []
        for key in c.scan_iter(match=store.key_namespace(shard) + ":*", count=10_000, _type="hash"):
            keys.append(key)
            if len(keys) == 1_000:
                n += _copy_values(c, keys, f)
                keys = []
        n += _copy_values(c, keys, f) if keys else 0
    return n


def _copy_values(client, keys: list, f) -> int:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.hvals(k)
    vals = [v for rows in pipe.execute() for v in rows]
    f.write(b"".join(vals))
    return sum(len(v) for v in vals)


def read_seconds(path: Path) -> float:
    """Seconds to read a file start to end (the source of a restore from a local file, as it stands:
    a snapshot just written is likely in the page cache)."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t0


def loopback_seconds(path: Path) -> float:
    """Seconds to send a file's bytes over a loopback TCP socket to a reader that drops them (the
    network source of a restore over the protocol, without Redis)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def drain() -> None:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 20):
                pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c, open(path, "rb") as f:
        c.sendfile(f)
    reader.join()
    server.close()
    return time.perf_counter() - t0
