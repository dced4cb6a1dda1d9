"""A shard's snapshot loaded over the protocol onto real redis-servers, as one full synchronization
(the empty server a replica of the loader for one ``PSYNC``) or as serialized values (``RESTORE``):
exact for every row width and optimizer state either way; the sync only where it touches nothing
but the shard; a server that refuses the sync or ``RESTORE`` (or gives up a load) falls back with
one line each, and a damaged file never reaches the server."""

import contextlib
import shutil
import struct

import numpy as np
import pytest
import redis

from embeddings import SGD, Adagrad, Adam, LocalShards, RedisStore, RowWiseAdagrad, TableSet, TableSpec
from embeddings.errors import ShardDataError
from embeddings.snapshots.rdb import CRC64, restore_payloads
from embeddings.snapshots.restore_load import first_way
from tests.conftest import track
from tests.test_layout import bgsave, every_row

# row widths from 2 to 385 floats: buckets of 128 rows down to a few, listpack and hash-table encoded
TABLES = TableSet([TableSpec("a", 900, 1), TableSpec("b", 700, 16), TableSpec("c", 300, 64), TableSpec("d", 40, 128)])


def fill(store: RedisStore, rng, zeros: bool = True) -> dict[str, np.ndarray]:
    for t in store.tables:
        ids = np.unique(rng.choice(t.num_rows, t.num_rows // 2))
        w = store.width(store.tables.index(t.name))
        rows = rng.standard_normal((len(ids), w)).astype(np.float32)
        if zeros:
            rows[::7] = np.float32(-0.0)  # bit patterns survive, not just values (and LZF-compressed buckets)
        store.write_rows(t.name, ids, rows)
    store.writes.write_shard(0, [], step=31)
    return every_row(store)


def calls(client: redis.Redis, name: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{name}", {}).get("calls", 0))


@pytest.mark.parametrize("path", ["sync", "restore"])
@pytest.mark.parametrize(
    "opt", [SGD(0.1), Adagrad(0.1), RowWiseAdagrad(0.1), Adam(0.01)], ids=lambda o: type(o).__name__
)
def test_a_restore_over_the_protocol_is_exact_for_every_row_width_and_optimizer_state(tmp_path, namespace, opt, path):
    rng = np.random.default_rng(7)
    with LocalShards(2) as sh:
        track(sh)
        src = RedisStore(sh.urls[:1], TABLES, opt, namespace=namespace)
        c0 = redis.Redis.from_url(sh.urls[0])
        c0.config_set("hash-max-listpack-value", 300)  # the widest rows turn their buckets into hash tables
        want = fill(src, rng)
        assert {c0.object("encoding", src.key(t, 0)) for t in range(4) if c0.exists(src.key(t, 0))} >= {b"listpack"}
        bgsave(c0)
        rdb = tmp_path / "shard0.rdb"
        shutil.copy(sh.spec(0).rdb_path, rdb)
        dst = RedisStore(sh.urls[1:], TABLES, opt, namespace=namespace)
        lines: list[str] = []
        dst.warn = lines.append
        c1 = redis.Redis.from_url(sh.urls[1])
        keys = c0.dbsize()
        # RESTORE put first; the sync, the way taken by default
        with first_way(dst, "RESTORE") if path == "restore" else contextlib.nullcontext():
            sent = dst.load_snapshot(0, rdb)
        assert 0 < sent < rdb.stat().st_size and not lines  # the values' bytes, as the file holds them
        assert calls(c1, "restore") == (keys if path == "restore" else 0) and calls(c1, "hset") == 0
        assert calls(c1, "replicaof") == (2 if path == "sync" else 0) and c1.dbsize() == keys
        info = c1.info("replication")
        assert info["role"] == "master" and c1.config_get("repl-diskless-load")["repl-diskless-load"] == "disabled"
        got = every_row(dst)
        for name in want:
            np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))
        assert dst.applied_step(0) == 31
        for key in c0.scan_iter(match=f"{namespace}:*"):  # each key as its server encodes it
            assert c1.object("encoding", key) == c0.object("encoding", key), key
        src.close()
        dst.close()


def test_a_server_that_refuses_restore_falls_back_with_one_line_and_the_rows_stay_exact(tmp_path, namespace):
    rng = np.random.default_rng(3)
    with LocalShards(2) as sh:
        track(sh)
        src = RedisStore(sh.urls[:1], TABLES, RowWiseAdagrad(0.1), namespace=namespace)
        want = fill(src, rng)
        bgsave(redis.Redis.from_url(sh.urls[0]))
        path = tmp_path / "shard0.rdb"
        shutil.copy(sh.spec(0).rdb_path, path)
        c1 = redis.Redis.from_url(sh.urls[1])
        c1.acl_setuser(
            "loader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+@all", "-restore", "-replicaof"]
        )
        url = sh.urls[1].replace("redis://", "redis://loader:pw@")
        dst = RedisStore([url], TABLES, RowWiseAdagrad(0.1), namespace=namespace)
        lines: list[str] = []
        dst.warn = lines.append
        dst.first_way = "RESTORE"  # RESTORE's refusal first, then the sync's
        dst.load_snapshot(0, path)
        # a line for each way it could not take, naming the next: RESTORE, then the sync (no REPLICAOF)
        assert len(lines) == 2 and all("shard 0 at" in x and "pw" not in x for x in lines), lines
        assert "refused RESTORE (NOPERM" in lines[0] and "go by the sync instead" in lines[0], lines
        assert "did not load its snapshot as a sync (REPLICAOF: this user has no permissions" in lines[1], lines
        assert "go by one HSET per bucket instead" in lines[1], lines
        assert c1.config_get("repl-diskless-load")["repl-diskless-load"] == "disabled"  # put back
        assert calls(c1, "hset") > 0
        got = every_row(dst)
        for name in want:
            np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))
        assert dst.applied_step(0) == 31
        dst.snapshots.clear_shard(0)
        dst.load_snapshot(0, path)  # the refusals are remembered: no second probe, no second line
        assert len(lines) == 2 and every_row(dst)["c"].tobytes() == want["c"].tobytes()
        src.close()
        dst.close()


def _value_at(path, namespace: str) -> tuple[int, int]:
    """(offset, length) of a row bucket's listpack in the file (the first one found)."""
    data = path.read_bytes()
    key = next(k for k, kind, _ in restore_payloads(path, f"{namespace}:".encode()) if kind == 16)
    at = data.index(key) + len(key)
    assert data[at] >> 6 == 1  # a 14-bit length prefix (buckets are under 16 KiB)
    n = ((data[at] & 0x3F) << 8) | data[at + 1]
    assert int.from_bytes(data[at + 2 : at + 6], "little") == n  # the listpack's own total
    return at + 2, n


def test_a_damaged_snapshot_is_caught_before_the_server_gets_a_payload(tmp_path, namespace):
    rng = np.random.default_rng(5)
    with LocalShards(2) as sh:
        track(sh)
        src = RedisStore(sh.urls[:1], TABLES, RowWiseAdagrad(0.1), namespace=namespace)
        fill(src, rng, zeros=False)  # random rows: no bucket compresses
        bgsave(redis.Redis.from_url(sh.urls[0]))
        good = tmp_path / "good.rdb"
        shutil.copy(sh.spec(0).rdb_path, good)
        at, n = _value_at(good, namespace)
        dst = RedisStore(sh.urls[1:], TABLES, RowWiseAdagrad(0.1), namespace=namespace)
        c1 = redis.Redis.from_url(sh.urls[1])

        # one flipped bit in a row's value: the file's checksum no longer matches
        flipped = tmp_path / "flipped.rdb"
        data = bytearray(good.read_bytes())
        data[at + n // 2] ^= 0x10
        flipped.write_bytes(data)
        # a listpack whose length was damaged before the checksum was taken: its framing is caught
        framed = tmp_path / "framed.rdb"
        data = bytearray(good.read_bytes())
        struct.pack_into("<I", data, at, n + 1)
        struct.pack_into("<Q", data, len(data) - 8, CRC64.calc(bytes(data[:-8])))
        framed.write_bytes(data)
        for together in (1, 2):  # by RESTORE first, then by the sync first
            with first_way(dst, "RESTORE" if together == 1 else "the sync"):
                with pytest.raises(ShardDataError, match=r"flipped\.rdb: its bytes do not match its checksum"):
                    dst.load_snapshot(0, flipped)
                with pytest.raises(ShardDataError, match=r"framed\.rdb: hash .* do not frame a listpack"):
                    dst.load_snapshot(0, framed)
        assert calls(c1, "restore") == 0 and c1.dbsize() == 0  # neither reached the server
        # the flipped file started no sync; the framed one's was cut short before its bad listpack
        assert calls(c1, "replicaof") == 2 and c1.info("replication")["role"] == "master"
        # the HSET path checks the file alike
        dst.restore_refused[dst.endpoint(0)] = dst.sync_refused[dst.endpoint(0)] = "as if refused"
        with pytest.raises(ShardDataError, match=r"flipped\.rdb: its bytes do not match its checksum"):
            dst.load_snapshot(0, flipped)
        assert calls(c1, "hset") == 0 and c1.dbsize() == 0
        dst.restore_refused.clear()
        dst.sync_refused.clear()
        with first_way(dst, "RESTORE"):
            assert dst.load_snapshot(0, good) > 0 and calls(c1, "restore") == c1.dbsize() > 0
        src.close()
        dst.close()


def test_the_sync_touches_nothing_but_the_shard_and_a_load_the_server_gives_up_falls_back(tmp_path, namespace):
    rng = np.random.default_rng(9)
    with LocalShards(2) as sh:
        track(sh)
        src = RedisStore(sh.urls[:1], TABLES, SGD(0.1), namespace=namespace)
        want = fill(src, rng)
        c0, c1 = redis.Redis.from_url(sh.urls[0]), redis.Redis.from_url(sh.urls[1])
        bgsave(c0)
        alone = tmp_path / "alone.rdb"
        shutil.copy(sh.spec(0).rdb_path, alone)
        dst = RedisStore(sh.urls[1:], TABLES, SGD(0.1), namespace=namespace)
        dst.first_way = "the sync"  # as every shard is restored: by the sync first
        lines: list[str] = []
        dst.warn = lines.append

        # a server that holds another key: the sync would replace it, so the keys go by RESTORE
        c1.set("someone-else", b"kept")
        dst.load_snapshot(0, alone)
        assert calls(c1, "replicaof") == 0 and calls(c1, "restore") > 0 and c1.get("someone-else") == b"kept"
        assert every_row(dst)["b"].tobytes() == want["b"].tobytes() and not lines

        # a server with a function library and no key: a sync would empty its libraries too
        c1.flushall()
        c1.execute_command(
            "FUNCTION", "LOAD", "#!lua name=theirs\nredis.register_function('f', function() return 1 end)"
        )
        before = calls(c1, "restore")
        dst.load_snapshot(0, alone)
        assert calls(c1, "replicaof") == 0 and calls(c1, "restore") > before and not lines
        libraries = c1.execute_command("FUNCTION", "LIST")
        assert len(libraries) == 1 and "theirs" in str(libraries)
        assert every_row(dst)["b"].tobytes() == want["b"].tobytes()
        c1.execute_command("FUNCTION", "FLUSH")

        # a file that holds another namespace's key: the sync is cut short where the scan meets it
        # (the server loads nothing of it), and only this namespace's keys land, by RESTORE
        c1.flushall()
        c0.set("other-run:x", b"not ours")
        bgsave(c0)
        mixed = tmp_path / "mixed.rdb"
        shutil.copy(sh.spec(0).rdb_path, mixed)
        before = calls(c1, "restore")
        dst.load_snapshot(0, mixed)
        assert calls(c1, "replicaof") == 2 and calls(c1, "restore") > before and not c1.exists("other-run:x")
        assert c1.info("replication")["role"] == "master" and every_row(dst)["c"].tobytes() == want["c"].tobytes()

        # an RDB version the server cannot read: it gives up the sync's load (one line), then refuses
        # RESTORE (a second line), and the rows go one HSET per bucket, still exact
        c1.flushall()
        data = bytearray(alone.read_bytes())
        data[5:9] = b"0099"
        struct.pack_into("<Q", data, len(data) - 8, CRC64.calc(bytes(data[:-8])))
        newer = tmp_path / "newer.rdb"
        newer.write_bytes(data)
        dst.load_snapshot(0, newer)
        assert len(lines) == 2, lines
        assert "did not load its snapshot as a sync (it gave up loading" in lines[0], lines
        assert "refused RESTORE (ERR DUMP payload version" in lines[1], lines
        assert calls(c1, "replicaof") == 4 and c1.info("replication")["role"] == "master"
        got = every_row(dst)
        for name in want:
            np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))
        src.close()
        dst.close()


def test_the_crc_of_a_whole_file_on_every_core_is_redis_own():
    """``crc64`` runs anycrc's C function on one thread per core without the GIL; the parts joined
    give the CRC Redis's own code gives (its test vector) and anycrc's one call gives."""
    from embeddings.snapshots import crc64 as mod

    assert mod._C is not None  # the GIL-free path is taken with the pinned anycrc
    assert mod.crc64(b"123456789") == 0xE9C6D914C4B8D9CA  # Redis's crc64 test vector
    rng = np.random.default_rng(11)
    for n in (0, 1, 4095, (16 << 20) * 2 + 12_345, (16 << 20) * 3 - 1):
        data = rng.bytes(n)
        assert mod.crc64(data) == mod.CRC64.calc(data) if n else mod.crc64(data) == 0


def test_buckets_over_16_kib_scan_inline_exact_and_a_damaged_one_is_caught(tmp_path, namespace):
    """A shard's part of a full bucket of 64-dim rows, spread over two shards, passes 16 KiB: its
    length is written in 32 bits. Such buckets are read on the fast path, restore exact both ways,
    and one whose listpack does not frame is caught before the server gets a payload."""
    from embeddings.snapshots.rdb import _mapped, _spans, scan_snapshot

    tables = TableSet([TableSpec("w", 4000, 64)])
    with LocalShards(3) as sh:
        track(sh)
        src = RedisStore(sh.urls[:2], tables, SGD(0.1), namespace=namespace)
        rng = np.random.default_rng(3)
        src.write_rows("w", np.arange(4000), rng.standard_normal((4000, 64)).astype(np.float32))
        want = every_row(src)["w"][src.shard_map.shard_of(0, np.arange(4000)) == 0]
        bgsave(redis.Redis.from_url(sh.urls[0]))
        good = tmp_path / "big.rdb"
        shutil.copy(sh.spec(0).rdb_path, good)
        data = bytearray(good.read_bytes())
        with _mapped(good) as r:
            spans = [(key, start, end) for key, _, start, end in _spans(r, namespace.encode(), None)]
        big = [(key, start, end) for key, start, end in spans if data[start] == 0x80]
        assert big and len(big) < len(spans)  # both length encodings are in the file
        found = scan_snapshot(good, namespace.encode(), lambda *a: None)
        assert found.keys == len(spans) and found.value_bytes == sum(e - s for _, s, e in spans)
        shown: list[bytes] = []  # a sample that answers True sees one bucket a table, then no more
        once = scan_snapshot(good, namespace.encode(), lambda key, *a: shown.append(key) or key.count(b":") == 2)
        rows = [key for key, _, _ in spans if key.count(b":") == 2]
        assert once.keys == found.keys and sorted(shown) == sorted(
            [rows[0]] + [k for k, _, _ in spans if k not in rows]
        )
        for together in (1, 2):  # by RESTORE, then by the sync
            dst = RedisStore([sh.urls[2], sh.urls[1]], tables, SGD(0.1), namespace=namespace)
            dst.snapshots.clear_shard(0)
            with first_way(dst, "RESTORE" if together == 1 else "the sync"):
                dst.load_snapshot(0, good)
            got = every_row(dst)["w"][src.shard_map.shard_of(0, np.arange(4000)) == 0]
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            dst.close()
        damaged, start, end = big[0]
        struct.pack_into("<I", data, start + 5, end - start - 5 + 1)  # the listpack's own total, off by one
        struct.pack_into("<Q", data, len(data) - 8, CRC64.calc(bytes(data[:-8])))
        framed = tmp_path / "framed.rdb"
        framed.write_bytes(data)
        dst = RedisStore([sh.urls[2], sh.urls[1]], tables, SGD(0.1), namespace=namespace)
        dst.snapshots.clear_shard(0)
        c2 = redis.Redis.from_url(sh.urls[2])
        for together in (1, 2):
            dst.snapshots.clear_shard(0)
            restores = calls(c2, "restore")
            with (
                first_way(dst, "RESTORE" if together == 1 else "the sync"),
                pytest.raises(ShardDataError, match="do not frame a listpack"),
            ):
                dst.load_snapshot(0, framed)
            assert not c2.exists(damaged)  # by RESTORE, the buckets before it may have gone: never it
            if together == 2:  # the sync was cut short before it: the server loaded nothing
                assert c2.dbsize() == 0 and calls(c2, "restore") == restores
        src.close()
        dst.close()


def test_the_sync_send_timeout_keeps_a_fraction_of_a_second():
    """``SO_SNDTIMEO`` of {0, 0} means no timeout at all: a store timeout under a second must not
    become one (a server that stops reading would hold the restore for ever)."""
    from embeddings.snapshots.sync_load import _timeval

    def back(seconds: float) -> tuple[int, int]:
        return struct.unpack("ll", _timeval(seconds))

    assert back(0.5) == (0, 500_000) and back(1e-9) == (0, 1) and back(600.0) == (600, 0)
    assert back(2.25) == (2, 250_000)
