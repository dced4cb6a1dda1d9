"""Rows in hash buckets (``embeddings.store.buckets``): memory, round trips at several widths, lazy init,
undo, snapshots read back by a server and by the RDB reader, restores. Real redis-servers."""

import shutil
import time

import numpy as np
import pytest
import redis
import torch

from embeddings import SGD, LocalShards, RedisStore, RowWiseAdagrad, TableSet, TableSpec, rowkeys
from embeddings.rowinit import init_rows
from embeddings.snapshots.rdb import NetworkSnapshot, group_rows, listpack_entries, read_keys
from embeddings.store.buckets import BucketLayout, bucket_rows, size_class_at_most, string_entry_bytes
from tests.conftest import track

GOAL = 1.3  # bytes per row over the row's bytes, at dim 16 with row-wise Adagrad (68 bytes)


def scattered(n: int, rows: int) -> np.ndarray:
    """The ``n`` hottest Zipf ranks, scattered over ``rows`` as the synthetic data scatters them."""
    return np.unique((np.arange(n, dtype=np.int64) * 2654435761) % rows)


def bgsave(client: redis.Redis) -> None:
    before = int(client.info("persistence")["rdb_saves"])
    client.bgsave()
    deadline = time.monotonic() + 30
    while True:
        info = client.info("persistence")
        if int(info["rdb_saves"]) > before and not int(info["rdb_bgsave_in_progress"]):
            assert info["rdb_last_bgsave_status"] == "ok"
            return
        assert time.monotonic() < deadline, "BGSAVE did not finish"
        time.sleep(0.01)


def every_row(store: RedisStore) -> dict[str, np.ndarray]:
    with store.from_redis():
        return {t.name: store.read_rows(t.name, np.arange(t.num_rows)) for t in store.tables}


def test_bucket_sizes_fill_a_size_class_and_fields_fit_the_span():
    assert [bucket_rows(4 * w, 1) for w in (17, 65, 129)] == [110, 61, 31]  # dims 16, 64, 128 with Adagrad
    for w in (1, 9, 17, 65, 129, 300, 1100, 5000):
        entry = string_entry_bytes(1) + string_entry_bytes(4 * w)
        b = bucket_rows(4 * w, 1)
        assert 1 <= b <= 128 and (b == 1 or b * entry + 7 <= min(16384, size_class_at_most(128 * entry + 7)))
    assert size_class_at_most(9479) == 8192 and size_class_at_most(10240) == 10240
    for spread in (1, 2, 3, 7):
        layout = BucketLayout(spread)
        span = layout.span(68)
        ids = np.arange(5 * span)
        fields = layout.fields(ids, 68)
        assert fields.shape == (len(ids), layout.field_bytes) and layout.field_bytes == (1 if spread <= 2 else 2)
        back = layout.row_ids(3, [bytes(f) for f in fields[3 * span : 4 * span]], 68)
        np.testing.assert_array_equal(back, ids[3 * span : 4 * span])
    with pytest.raises(ValueError, match="1 to 512"):
        BucketLayout(513)


@pytest.mark.parametrize("kind", ["zipf", "dense"])
def test_bytes_per_row_at_dim_16_are_under_the_goal(namespace, kind):
    """50k rows of a 250k-row table (the Zipf case: 20% of it, scattered), one shard, as INFO memory
    sees them: under 1.3x the 68 bytes of a row (measured 1.16-1.21x; a string per row was 2.54x)."""
    rows = 250_000
    tables = TableSet([TableSpec("t", rows, 16)])
    ids = scattered(50_000, rows) if kind == "zipf" else np.arange(50_000)
    with LocalShards(1) as sh, RedisStore(sh.urls, tables, RowWiseAdagrad(0.05), namespace=namespace) as st:
        track(sh)
        c = redis.Redis.from_url(sh.urls[0])
        assert c.config_get("hash-max-listpack-*") == {  # the project's servers start with them
            "hash-max-listpack-entries": "65536",
            "hash-max-listpack-value": "65536",
        }
        st.write_rows("t", ids[:10], np.zeros((10, 17), np.float32))  # the store's listpack check, the dict
        base = c.info("memory")["used_memory"]
        values = np.random.default_rng(0).standard_normal((len(ids) - 10, 17)).astype(np.float32)
        for lo in range(0, len(values), 5000):  # a step's batch at a time
            st.write_rows("t", ids[10 + lo : 10 + lo + 5000], values[lo : lo + 5000])
        st.close()  # its buffers are not rows
        per_row = (c.info("memory")["used_memory"] - base) / len(values)
        assert per_row <= GOAL * 68, f"{per_row:.1f} bytes per row ({per_row / 68:.2f}x)"
        key = next(k for k in c.scan_iter(f"{namespace}:0:*"))
        assert c.object("encoding", key) == b"listpack"


def test_three_shards_keep_their_buckets_as_full_as_one(namespace):
    """With rows hashed over 3 shards a bucket spans 3x the ids, so each shard's part of it is as
    full as one shard's bucket: the bytes per row stay under the goal."""
    rows = 150_000
    tables = TableSet([TableSpec("t", rows, 16)])
    ids = scattered(30_000, rows)
    with LocalShards(3) as sh, RedisStore(sh.urls, tables, RowWiseAdagrad(0.05), namespace=namespace) as st:
        track(sh)
        clients = [redis.Redis.from_url(u) for u in sh.urls]
        st.write_rows("t", ids[:30], np.zeros((30, 17), np.float32))
        base = [c.info("memory")["used_memory"] for c in clients]
        st.write_rows("t", ids[30:], np.ones((len(ids) - 30, 17), np.float32))
        st.close()
        grown = sum(c.info("memory")["used_memory"] - b for c, b in zip(clients, base))
        assert grown / (len(ids) - 30) <= GOAL * 68
        assert st.layout.field_bytes == 2 and st.layout.span(68) == 3 * 109


@pytest.mark.parametrize("placement", ["row", "table"])
def test_rows_of_several_widths_round_trip_exactly(shards3, namespace, placement):
    """Dims 1 to 1100 (one row per bucket at the widest), SGD and Adagrad: sparse rows, dense runs,
    rows next to never-written ones in one bucket, duplicates in a write, a row whose bytes hold a
    nil reply (``$-1\\r\\n``), all read back bit for bit through every read path."""
    rng = np.random.default_rng(7)
    dims = (1, 4, 16, 64, 128, 300, 1100)
    tables = TableSet([TableSpec(f"d{d}", 5000, d) for d in dims])
    for opt in (SGD(0.1), RowWiseAdagrad(0.05)):
        with RedisStore(shards3.urls, tables, opt, namespace=namespace, placement=placement) as st:
            want: dict[str, dict[int, np.ndarray]] = {t.name: {} for t in tables}
            for t in tables:
                w = t.dim + opt.state_width
                for ids in (rng.choice(5000, 400, replace=False), np.arange(1000, 1400), np.array([7, 7, 8])):
                    rows = rng.standard_normal((len(ids), w)).astype(np.float32)
                    st.write_rows(t.name, ids, rows)
                    want[t.name].update(zip(ids.tolist(), rows))
            w64 = 64 + opt.state_width
            nasty = np.frombuffer((b"$-1\r\n" + bytes(range(3)) * 200)[: 4 * w64], "<f4").copy()
            st.write_rows("d64", np.array([2001]), nasty[None, :])
            want["d64"][2001] = nasty
            for t in tables:
                ids = np.arange(5000)
                got = st.read_rows(t.name, ids)
                known = np.array([i in want[t.name] for i in ids])
                expect = np.stack([want[t.name][i] for i in ids[known]])
                np.testing.assert_array_equal(got[known].view(np.uint32), expect.view(np.uint32))
                init = init_rows(0, tables.index(t.name), ids[~known], t.dim, t.scale)
                np.testing.assert_array_equal(got[~known, : t.dim], init)
                assert not got[~known, t.dim :].any()
                # the packed-key path and a mixed read in one call agree
                keys = rowkeys.pack(tables.index(t.name), ids[::7])
                np.testing.assert_array_equal(st.read_keys(keys).view(np.uint32), got[::7].view(np.uint32))
            st.clear()


def test_never_written_rows_read_as_their_init_beside_written_ones(shards3, namespace):
    tables = TableSet([TableSpec("t", 10**8, 16), TableSpec("u", 300, 8)])
    with RedisStore(shards3.urls, tables, RowWiseAdagrad(0.05), namespace=namespace, seed=11) as st:
        ids = np.array([0, 1, 2, 3, 5, 99_999_999])
        before = st.pull("t", ids)
        np.testing.assert_array_equal(before, init_rows(11, 0, ids, 16, tables.specs[0].scale))
        st.update("t", np.array([2]), np.ones((1, 16), np.float32))  # one field of the first bucket
        after = st.read_rows("t", ids)
        np.testing.assert_array_equal(after[[0, 1, 3, 4, 5], :16], before[[0, 1, 3, 4, 5]])
        assert not after[[0, 1, 3, 4, 5], 16:].any() and after[2, 16] > 0  # Adagrad's state only where written
        assert not np.array_equal(after[2, :16], before[2])
        assert st.clear() == 1  # one bucket key: reads wrote nothing


def test_a_step_is_undone_exactly_also_for_rows_it_wrote_first(shards3, namespace):
    """Step 1 writes rows, step 2 rewrites some and writes others for the first time (into buckets
    that exist and ones that do not); the rollback of step 2 gives back step 1's rows bit for bit,
    and the rows step 2 wrote first read as their init values again."""
    tables = TableSet([TableSpec("a", 4000, 16), TableSpec("b", 900, 16)])
    rng = np.random.default_rng(3)
    with RedisStore(shards3.urls, tables, RowWiseAdagrad(0.05), namespace=namespace) as st:
        first = np.unique(
            np.concatenate([rowkeys.pack(0, rng.choice(2000, 300)), rowkeys.pack(1, rng.choice(900, 50))])
        )
        st.apply_keys(first, torch.from_numpy(rng.standard_normal((len(first), 16)).astype(np.float32)), step=1)
        second = np.unique(np.concatenate([first[::3], rowkeys.pack(0, rng.choice(np.arange(2000, 4000), 200))]))
        every = np.unique(np.concatenate([first, second]))
        with st.from_redis():
            at_one = st.read_keys(every)
        st.apply_keys(second, torch.ones((len(second), 16)), step=2)
        with st.from_redis():
            assert not np.array_equal(st.read_keys(every), at_one)
        restored = sum(st.rollback(s, 1) for s in range(3))
        assert restored == len(second)
        with st.from_redis():
            np.testing.assert_array_equal(st.read_keys(every).view(np.uint32), at_one.view(np.uint32))
        assert st.applied_steps() == [1, 1, 1]
        st.clear()


def test_an_undo_record_that_starts_like_an_error_reply_reads_back(namespace):
    """Step 45's undo record starts with the byte ``-`` (the step, little-endian), holds CRLFs and
    spans many socket reads: it is a value, not an error reply."""
    tables = TableSet([TableSpec("t", 50_000, 16)])
    with LocalShards(1) as sh, RedisStore(sh.urls, tables, RowWiseAdagrad(0.05), namespace=namespace) as st:
        track(sh)
        keys = rowkeys.pack(0, np.arange(3, 50_000, 5))  # row 2573 is 0x0a0d: a CRLF among the record's ids
        st.apply_keys(keys, torch.ones((len(keys), 16)), step=44)
        crlf = np.frombuffer(b"\r\n" * 34 * len(keys), "<f4").reshape(len(keys), 17)
        st.write_rows("t", keys & rowkeys.ROW_MASK, crlf)  # the rows step 45's undo record keeps
        before = st.read_keys(keys)
        st.apply_keys(keys, torch.ones((len(keys), 16)), step=45)
        assert st.links.locked_get(0, st.meta_key("undo", 0))[:1] == b"-"
        assert st.rollback(0, 44) == len(keys)
        np.testing.assert_array_equal(st.read_keys(keys), before)


def _odd_hash(client: redis.Redis, key: bytes) -> dict[bytes, bytes]:
    """A hash of the namespace that is no row bucket, with every listpack encoding Redis picks:
    integers of 7, 13, 16, 24, 32 and 64 bits, strings of 6-bit, 12-bit and 32-bit lengths."""
    values = {
        b"i7": b"5",
        b"i13": b"-100",
        b"i16": b"1000",
        b"i24": b"-70000",
        b"i32": b"1073741824",
        b"i64": b"-1099511627776",
        b"s6": b"abc",
        b"s12": bytes(range(100)),
        b"s32": b"x" * 5000,
    }
    client.hset(key, mapping=values)
    return values


def test_a_snapshot_loads_into_a_fresh_server_and_through_the_reader_with_the_same_rows(namespace, tmp_path):
    """Rows of three widths on one shard (listpack buckets, and some buckets converted to hash
    tables by a server whose limits were lowered meanwhile): its BGSAVE file loaded by a fresh
    redis-server, its snapshot over the network parsed by the RDB reader and written back over the
    protocol into an empty server, each give back the same rows, markers and other keys."""
    tables = TableSet([TableSpec("a", 3000, 16), TableSpec("b", 800, 64), TableSpec("c", 200, 128)])
    rng = np.random.default_rng(9)
    opt = RowWiseAdagrad(0.05)
    with LocalShards(2) as sh:
        track(sh)
        src = RedisStore(sh.urls[:1], tables, opt, namespace=namespace)
        c0 = redis.Redis.from_url(sh.urls[0])
        for t in tables:
            ids = np.unique(np.concatenate([rng.choice(t.num_rows, t.num_rows // 4), np.arange(40, 140)]))
            src.write_rows(t.name, ids, rng.standard_normal((len(ids), t.dim + 1)).astype(np.float32))
        c0.config_set("hash-max-listpack-value", 70)  # wider rows written now turn their buckets into hash tables
        src.write_rows("b", np.arange(0, 30), np.full((30, 65), 2.5, np.float32))
        src.write_rows("a", np.arange(0, 30), np.full((30, 17), -1.5, np.float32))  # still a listpack
        encodings = {c0.object("encoding", src.key(t, 5)) for t in range(3)}
        assert encodings == {b"listpack", b"hashtable"}
        src.writes.write_shard(0, [(0, np.array([7]), np.full((1, 17), 3.0, np.float32))], step=12)
        odd_key = f"{namespace}:extra".encode()
        odd = _odd_hash(c0, odd_key)
        want = every_row(src)

        # (a) the server's own file, loaded by a fresh server (the local restore path)
        bgsave(c0)
        dump = tmp_path / "shard0.rdb"
        shutil.copy(sh.spec(0).rdb_path, dump)
        shutil.copy(dump, sh.spec(1).rdb_path)
        sh.restart(1)
        c1 = redis.Redis.from_url(sh.urls[1])
        assert c1.hgetall(odd_key) == odd and c1.get(src.meta_key("applied", 0)) == b"12"
        loaded = RedisStore(sh.urls[1:], tables, opt, namespace=namespace)
        for name, rows in every_row(loaded).items():
            np.testing.assert_array_equal(rows.view(np.uint32), want[name].view(np.uint32))

        # (b) over the network, parsed by the RDB reader, written back over the protocol
        net = tmp_path / "net.rdb"
        snap = src.snapshots.snapshot(0, net)
        snap.start()
        snap.finish()
        assert isinstance(snap, NetworkSnapshot)
        items = dict(read_keys(net, f"{namespace}:".encode()))
        assert dict(items[odd_key]) == odd
        rows_by_table, other = group_rows(iter(items.items()), namespace, src.layout, [68, 260, 516])
        assert sorted(rows_by_table) == [0, 1, 2] and {k for k, _ in other} >= {odd_key, src.meta_key("applied", 0)}
        for t, (ids, values) in rows_by_table.items():
            name = tables.specs[t].name
            got = np.frombuffer(values, "<f4").reshape(len(ids), -1)
            np.testing.assert_array_equal(got.view(np.uint32), want[name][ids].view(np.uint32))
        c1.flushall()
        loaded.links.reconnect(0)
        assert loaded.load_snapshot(0, net) > 0
        for name, rows in every_row(loaded).items():
            np.testing.assert_array_equal(rows.view(np.uint32), want[name].view(np.uint32))
        assert c1.hgetall(odd_key) == odd and loaded.applied_step(0) == 12
        src.close()
        loaded.close()


def test_a_snapshot_of_rows_as_strings_is_refused_in_one_line(namespace):
    """A checkpoint written with one string per row (the layout before the buckets)."""
    from embeddings.errors import ShardDataError

    with LocalShards(1) as sh:
        track(sh)
        c = redis.Redis.from_url(sh.urls[0])
        c.set(f"{namespace}:0:".encode() + (5).to_bytes(8, "big"), bytes(68))
        c.set(f"{namespace}:meta:applied", b"3")
        bgsave(c)
        items = read_keys(sh.spec(0).rdb_path, f"{namespace}:".encode())
        with pytest.raises(ShardDataError, match="a row as one string .* reads row buckets only"):
            group_rows(items, namespace, BucketLayout(), [68])


def test_listpack_entries_reads_every_encoding_and_refuses_a_damaged_one():
    from embeddings.errors import ShardDataError

    def entry(head: bytes, data: bytes = b"") -> bytes:
        n = len(head) + len(data)
        back = 1 if n <= 127 else 2
        return head + data + b"\x00" * back

    body = (
        entry(b"\x05")
        + entry(b"\x83", b"abc")
        + entry(bytes([0xDF, 0x9C]))  # 13 bits: -100
        + entry(bytes([0xE0, 100]), bytes(100))
        + entry(b"\xf1", (1000).to_bytes(2, "little"))
        + entry(b"\xf2", (-70000).to_bytes(3, "little", signed=True))
        + entry(b"\xf3", (1 << 30).to_bytes(4, "little"))
        + entry(b"\xf4", (-(1 << 40)).to_bytes(8, "little", signed=True))
        + entry(b"\xf0" + (300).to_bytes(4, "little"), b"y" * 300)
    )
    blob = (len(body) + 7).to_bytes(4, "little") + (9).to_bytes(2, "little") + body + b"\xff"
    assert listpack_entries(blob) == [b"5", b"abc", b"-100", bytes(100), b"1000", b"-70000"] + [
        str(1 << 30).encode(),
        str(-(1 << 40)).encode(),
        b"y" * 300,
    ]
    with pytest.raises(ShardDataError, match="entries, its header says"):
        listpack_entries(blob[:4] + (8).to_bytes(2, "little") + blob[6:])
    with pytest.raises(ShardDataError, match="do not frame a listpack"):
        listpack_entries(blob[:-1])


def test_a_restore_from_a_network_snapshot_and_a_replay_is_exact(namespace, tmp_path):
    """A shard snapshotted at step 2, then two more steps; the shard is lost (emptied), loaded back
    from its snapshot and the later steps replayed onto it (as a log restore does): every row equals
    a reference store that never failed, bit for bit."""
    tables = TableSet([TableSpec("a", 5000, 16), TableSpec("b", 700, 16)])
    rng = np.random.default_rng(4)
    opt = RowWiseAdagrad(0.05)
    steps = []
    for _ in range(4):
        keys = np.unique(
            np.concatenate([rowkeys.pack(0, rng.zipf(1.2, 600) % 5000), rowkeys.pack(1, rng.choice(700, 80))])
        )
        steps.append((keys, torch.from_numpy(rng.standard_normal((len(keys), 16)).astype(np.float32))))
    with LocalShards(3) as sh:
        track(sh)
        st = RedisStore(sh.urls, tables, opt, namespace=namespace)
        ref = RedisStore(sh.urls, tables, opt, namespace=namespace + "ref")
        later: list[tuple[int, list]] = []
        for step, (keys, grads) in enumerate(steps, start=1):
            new = st.apply_keys(keys, grads, step)
            ref.apply_keys(keys, grads, step)
            if step == 2:
                snap = st.snapshots.snapshot(1, tmp_path / "s1.rdb")
                snap.start()
                snap.finish()
            elif step > 2:
                on1 = st.shard_map.shard_of_keys(keys) == 1
                later.append(
                    (step, [(t, ids, new[on1][lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(keys[on1]).items()])
                )
        assert st.snapshots.clear_shard(1) > 0
        st.load_snapshot(1, tmp_path / "s1.rdb")
        assert st.applied_step(1) == 2
        for step, groups in later:
            st.writes.write_shard(1, groups, step)
        assert st.applied_steps() == [4, 4, 4]
        want, got = every_row(ref), every_row(st)
        for name in want:
            np.testing.assert_array_equal(got[name].view(np.uint32), want[name].view(np.uint32))
        st.clear()
        ref.clear()
        st.close()
        ref.close()


def test_a_server_that_refuses_config_set_keeps_exact_rows_and_says_so_in_one_line(redis_servers, namespace):
    """A server the project did not start, with Redis's default listpack limits (64-byte values,
    under a 68-byte row): the store raises them where CONFIG SET is allowed; for an ACL user without
    it, one warning line names the settings and the fix, and the rows are exact, as hash tables."""
    servers = redis_servers(1)
    port = servers.ports[0]
    admin = redis.Redis(port=port)
    before = admin.config_get("hash-max-listpack-*")
    assert before["hash-max-listpack-value"] == "64" and int(before["hash-max-listpack-entries"]) >= 110
    admin.execute_command("ACL", "SETUSER", "noconf", "on", ">pw-nc", "~*", "+@all", "-config")
    tables = TableSet([TableSpec("t", 1000, 16)])
    ids = np.arange(0, 1000, 3)
    rows = np.random.default_rng(1).standard_normal((len(ids), 17)).astype(np.float32)
    lines: list[str] = []
    with RedisStore([f"redis://noconf:pw-nc@127.0.0.1:{port}"], tables, RowWiseAdagrad(), namespace=namespace) as st:
        st.warn = lines.append
        st.write_rows("t", ids, rows)
        st.write_rows("t", ids[:5], rows[:5])  # once per connection
        np.testing.assert_array_equal(st.read_rows("t", ids), rows)
        assert admin.object("encoding", st.key(0, 0)) == b"hashtable"
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"warning: shard 0 at redis://noconf@127.0.0.1:{port}: CONFIG SET refused")
    assert "`hash-max-listpack-entries 110`" in lines[0] and "`hash-max-listpack-value 68`" in lines[0]
    assert "pw-nc" not in lines[0]
    admin.flushall()
    with RedisStore([f"redis://127.0.0.1:{port}"], tables, RowWiseAdagrad(), namespace=namespace) as st:
        st.warn = lines.append
        st.write_rows("t", ids, rows)
        np.testing.assert_array_equal(st.read_rows("t", ids), rows)
        assert admin.object("encoding", st.key(0, 0)) == b"listpack"
    assert len(lines) == 1
    got = admin.config_get("hash-max-listpack-*")
    assert got == {**before, "hash-max-listpack-value": "68"}  # raised where too low, never lowered
    admin.flushall()
