import subprocess
import time

import numpy as np
import pytest
import redis

from embeddings import (
    SGD,
    DimMismatchError,
    InProcessStore,
    LocalShards,
    RedisStore,
    RowRangeError,
    RowWiseAdagrad,
    ShardTimeoutError,
    ShardUnavailableError,
    StoreAuthError,
    TableSet,
    TableSpec,
    UnknownTableError,
)
from embeddings.net.links import ConnectionOptions
from embeddings.servers.launcher import TlsFiles, free_port
from tests.conftest import track

TABLES = TableSet([TableSpec("small", 500, 8), TableSpec("wide", 2000, 64), TableSpec("huge", 10**8, 16)])


@pytest.mark.parametrize("opt", [SGD(lr=0.1), RowWiseAdagrad(lr=0.05)], ids=["sgd", "adagrad"])
@pytest.mark.parametrize("placement", ["row", "table"])
def test_redis_and_reference_agree_row_for_row(shards3, namespace, opt, placement):
    rng = np.random.default_rng(1)
    ref = InProcessStore(TABLES, opt, seed=3)
    written: set[tuple[str, int]] = set()
    with RedisStore(shards3.urls, TABLES, opt, namespace=namespace, seed=3, placement=placement) as st:
        for _ in range(10):
            req = {}
            for t in TABLES:
                ids = rng.integers(0, min(t.num_rows, 3000), 300)  # duplicates included
                req[t.name] = (ids, rng.standard_normal((300, t.dim)).astype(np.float32))
                written.update((t.name, int(i)) for i in ids)
            st.update_many(req)
            ref.update_many(req)
        for t in TABLES:
            ids = np.arange(min(t.num_rows, 3000))
            got, want = st.read_rows(t.name, ids), ref.read_rows(t.name, ids)
            assert got.shape == (len(ids), t.dim + opt.state_width)
            np.testing.assert_array_equal(got, want)
        # rows are really spread: every shard holds rows of this namespace (hash fields of its buckets)
        keys = [list(redis.Redis.from_url(u).scan_iter(f"{namespace}:*", count=1000)) for u in shards3.urls]
        per_shard = [sum(redis.Redis.from_url(u).hlen(k) for k in ks) for u, ks in zip(shards3.urls, keys)]
        if placement == "row":
            assert min(per_shard) > 0
        assert sum(per_shard) == len(written)  # one field per written row, none for reads
        assert st.clear() == sum(len(ks) for ks in keys)


def test_duplicates_are_summed_and_untouched_rows_are_lazy(shards3, namespace):
    with RedisStore(shards3.urls, TABLES, SGD(lr=1.0), namespace=namespace) as st:
        before = st.pull("huge", np.array([5, 99_999_999]))
        st.update("huge", np.array([5, 5]), np.ones((2, 16), np.float32))
        after = st.pull("huge", np.array([5, 99_999_999]))
        np.testing.assert_allclose(after[0], before[0] - 2.0, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(after[1], before[1])
        assert st.clear() == 1  # the read of a never-written row wrote nothing


def test_namespaces_isolate_two_runs_on_one_redis(shards3, namespace):
    a = RedisStore(shards3.urls, TABLES, SGD(lr=1.0), namespace=namespace + "a")
    b = RedisStore(shards3.urls, TABLES, SGD(lr=1.0), namespace=namespace + "b")
    ids = np.arange(10)
    base = b.pull("small", ids)
    a.update("small", ids, np.ones((10, 8), np.float32))
    np.testing.assert_array_equal(b.pull("small", ids), base)
    assert not np.array_equal(a.pull("small", ids), base)
    a.clear(), b.clear(), a.close(), b.close()


def test_bad_input_errors_name_the_value(shards3, namespace):
    with RedisStore(shards3.urls, TABLES, RowWiseAdagrad(), namespace=namespace) as st:
        with pytest.raises(UnknownTableError, match="unknown table 'nope'; known tables: small, wide, huge"):
            st.pull("nope", np.arange(3))
        with pytest.raises(RowRangeError, match=r"table 'small': row id 500 out of range \[0, 500\)"):
            st.pull("small", np.array([1, 500]))
        with pytest.raises(RowRangeError, match="row id -1"):
            st.update("small", np.array([-1]), np.zeros((1, 8), np.float32))
        with pytest.raises(DimMismatchError, match=r"table 'wide': gradients have shape \(2, 8\), expected \[n, 64\]"):
            st.update("wide", np.array([1, 2]), np.zeros((2, 8), np.float32))
        with pytest.raises(DimMismatchError, match=r"table 'small': rows have shape \(1, 8\), expected \[n, 9\]"):
            st.write_rows("small", np.array([1]), np.zeros((1, 8), np.float32))
    with pytest.raises(ValueError, match="must start with redis:// or rediss://"):
        RedisStore(["http://127.0.0.1:1"], TABLES, SGD())


def test_unreachable_endpoint_raises_typed_error_within_timeout():
    port = free_port()  # nothing listens there
    with RedisStore([f"redis://127.0.0.1:{port}/0"], TABLES, SGD(), timeout_s=1.0) as st:
        t0 = time.monotonic()
        with pytest.raises(ShardUnavailableError, match=rf"shard 0 at redis://127.0.0.1:{port}/0 is unavailable"):
            st.pull("small", np.arange(3))
        # a hang guard only: how soon the typed error comes is scripts/bench_fault_timing.py's figure
        assert time.monotonic() - t0 < 10


def test_wrong_password_and_acl_user(namespace):
    with LocalShards(1, password="s3cret-pw") as sh:
        track(sh)
        port = sh.ports[0]
        bad = f"redis://:wrong@127.0.0.1:{port}/0"
        with RedisStore([bad], TABLES, SGD(), timeout_s=2.0) as st:
            with pytest.raises(StoreAuthError, match=rf"shard 0 at redis://127.0.0.1:{port}/0 rejected") as ei:
                st.pull("small", np.arange(3))
            assert "wrong" not in str(ei.value).split("rejected")[0]  # the password is never echoed
        with RedisStore([f"redis://127.0.0.1:{port}/0"], TABLES, SGD(), timeout_s=2.0) as st:
            with pytest.raises(StoreAuthError):
                st.pull("small", np.arange(3))
        admin = redis.Redis.from_url(sh.url(0))
        admin.acl_setuser(
            "trainer", enabled=True, passwords=["+trainer-pw"], keys=[f"{namespace}:*"], commands=["+@all"]
        )
        with RedisStore(
            [f"redis://trainer:trainer-pw@127.0.0.1:{port}/0"], TABLES, SGD(lr=1.0), namespace=namespace
        ) as st:
            st.update("small", np.array([4]), np.ones((1, 8), np.float32))
            assert admin.exists(st.key(0, 4)) == 1
            assert st.endpoints == [f"redis://trainer@127.0.0.1:{port}/0"]
        admin.close()


def test_killed_and_stalled_shards_raise_within_timeout(namespace):
    with LocalShards(2) as sh:
        track(sh)
        with RedisStore(sh.urls, TABLES, SGD(), namespace=namespace, timeout_s=0.5) as st:
            ids = np.arange(200)
            st.pull("small", ids)
            admin = redis.Redis(port=sh.ports[1])
            accepted = admin.info("stats")["total_connections_received"]
            sh.stall(1)
            t0 = time.monotonic()
            with pytest.raises(ShardTimeoutError, match=f"shard 1 at redis://127.0.0.1:{sh.ports[1]}/0"):
                st.pull("small", ids)
            assert time.monotonic() - t0 < 10  # a hang guard; the latency is the timing benchmark's
            sh.resume(1)
            time.sleep(0.2)  # lets the resumed server accept what queued while it was stopped
            # one try: the timed-out call was not redone on a new connection behind the caller's back
            # (the stalled server accepts the queued connections once it runs again)
            assert admin.info("stats")["total_connections_received"] == accepted
            admin.close()
            sh.kill(0)
            with pytest.raises(ShardUnavailableError, match=f"shard 0 at redis://127.0.0.1:{sh.ports[0]}/0") as ei:
                st.pull("small", ids)
            assert not isinstance(ei.value, ShardTimeoutError)
            sh.restart(0)
            assert st.ping() == [True, True]
            st.pull("small", ids)  # a restarted shard serves (lazy init) again


def test_tls_with_password(tmp_path, namespace):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert, "-days", "1"]
        + ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True,
        capture_output=True,
    )
    with LocalShards(2, password="tls-pw", tls=TlsFiles(str(cert), str(key))) as sh:
        track(sh)
        assert all(u.startswith("rediss://:tls-pw@127.0.0.1:") for u in sh.urls)
        tls = {"ssl_ca_certs": str(cert)}
        with RedisStore(
            sh.urls, TABLES, SGD(lr=1.0), namespace=namespace, connect=ConnectionOptions(connection_kwargs=tls)
        ) as st:
            before = st.pull("wide", np.arange(1500))
            st.update("wide", np.arange(1500), np.ones((1500, 64), np.float32))
            np.testing.assert_allclose(st.pull("wide", np.arange(1500)), before - 1.0, atol=1e-6)
        # the same endpoints without TLS: the server speaks only TLS there
        plain = [u.replace("rediss://", "redis://") for u in sh.urls]
        with RedisStore(plain, TABLES, SGD(), timeout_s=1.0) as st:
            with pytest.raises(ShardUnavailableError, match="shard 0 at redis://127.0.0.1"):
                st.pull("wide", np.arange(3))


def test_a_shard_still_loading_its_snapshot_is_unavailable_for_now_not_corrupt(namespace):
    """A server that answers -LOADING (it is loading its RDB) is a shard to wait for or recover,
    not bad data. A real socket on loopback answers every command with Redis' LOADING error."""
    import socket
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    stop = threading.Event()

    def serve():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(2.0)
                try:
                    while conn.recv(65536):
                        conn.sendall(b"-LOADING Redis is loading the dataset in memory\r\n")
                except OSError:
                    pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    store = RedisStore([f"redis://127.0.0.1:{port}"], TABLES, SGD(0.1), namespace=namespace, timeout_s=1.0)
    try:
        with pytest.raises(
            ShardUnavailableError, match=rf"shard 0 at redis://127.0.0.1:{port} is unavailable: .*(LOADING|loading)"
        ):
            store.pull("small", np.arange(10))
        with pytest.raises(ShardUnavailableError, match="LOADING|loading"):
            store.applied_step(0)
    finally:
        store.close()
        stop.set()
        t.join()
        srv.close()


def test_held_rows_know_what_a_restore_left_of_each_row_from_their_write_steps():
    """Rows of shard 0 written at steps 2 and 6 (some both), the shard forgotten twice (a restore and
    the rows written on top of it) with a row held again in between; a restore to step 4 with rows up
    to step 5 on top: rows last written by 4 are held again, rows first written after 5 are absent,
    the rest are unknown; each forgotten row is counted once."""
    from embeddings.rowkeys import pack
    from embeddings.store.row_cache import ABSENT, HELD, UNKNOWN, HeldRows

    tables = TableSet([TableSpec("t", 100, 2)])
    held = HeldRows(tables, [2], {0, 1}, 1 << 20, owner_of=lambda t, ids: (np.asarray(ids) >= 50).astype(np.int16))
    held.assume_absent(0, np.arange(100))
    early, late, both = np.arange(0, 10), np.arange(10, 20), np.arange(20, 30)
    held.put_keys(pack(0, np.r_[early, both]), np.ones((20, 2), np.float32), step=2)
    held.put_keys(pack(0, np.r_[late, both]), np.full((20, 2), 2, np.float32), step=6)
    held.put_keys(pack(0, np.arange(60, 70)), np.ones((10, 2), np.float32), step=6)  # shard 1: untouched
    held.restores.clear(0)
    held.put_keys(pack(0, early[:3]), np.ones((3, 2), np.float32), step=2)  # held again, then forgotten again
    held.restores.clear(0)
    assert held.restores.restored(0, kept_upto=4, absent_after=5) == (10, 10)
    state = held.state_of(pack(0, np.arange(100)))  # per row id
    assert (state[early] == HELD).all() and (state[late] == ABSENT).all() and (state[both] == UNKNOWN).all()
    assert (state[60:70] == HELD).all() and (state[70:] == ABSENT).all()
    assert set(held.restores.unknown(0)[0].tolist()) == set(both.tolist()) and held.restores.restored(0, 4, 5) == (0, 0)


def test_held_rows_move_whole_rows_exactly_as_numpy_indexing_does():
    from embeddings.store.row_cache import put_rows

    rng = np.random.default_rng(2)
    dst = rng.standard_normal((1000, 17)).astype(np.float32)
    ref = dst.copy()
    at = np.sort(rng.choice(1000, 300, replace=False))
    src = rng.standard_normal((300, 34)).astype(np.float32)[:, ::2]  # not contiguous: copied first
    put_rows(dst, at, src)
    ref[at] = src
    np.testing.assert_array_equal(dst, ref)
    put_rows(dst, at[:5], np.ones((5, 17), np.float64))  # another dtype: converted
    ref[at[:5]] = 1.0
    np.testing.assert_array_equal(dst, ref)


def test_row_writes_encode_every_table_as_one_command_per_table_would():
    """A write of many tables (key prefixes of two lengths, rows of two widths, sparse rows and a
    dense run) is encoded a few arrays at a time; the HSETs carry exactly the (bucket, field, row) of
    each row as the layout places it alone: one command per row, or per bucket for the dense run."""
    import hiredis

    from embeddings.net.wire import RowConnection, row_commands
    from embeddings.store.buckets import BucketLayout

    rng = np.random.default_rng(5)
    groups = []
    for t in (3, 7, 12, 25, 31):
        n = int(rng.integers(1, 3000))
        width = 9 if t in (7, 25) else 17
        ids = np.sort(rng.choice(1 << 40, n, replace=False))
        groups.append((b"ns:{0}:%d:" % t, ids, rng.standard_normal((n, width)).astype(np.float32)))
    groups.append((b"ns:{0}:4:", np.empty(0, np.int64), np.empty((0, 17), np.float32)))
    groups.append((b"ns:{0}:5:", np.arange(100, 1100), rng.standard_normal((1000, 17)).astype(np.float32)))

    conn = RowConnection(None, 1.0, BucketLayout(spread=3))  # type: ignore[arg-type]
    commands, replies = row_commands(conn.layout, groups)
    got, sent = {}, 0
    for part in commands:
        reader = hiredis.Reader()
        reader.feed(bytes(part))
        while (cmd := reader.gets()) is not False:  # whole commands only
            assert cmd[0] == b"HSET" and len(cmd) % 2 == 0
            got.update({(cmd[1], f): v for f, v in zip(cmd[2::2], cmd[3::2])})
            sent += 1
    want = {}
    for prefix, ids, rows in groups:
        for i, r in zip(ids.tolist(), rows):
            want[conn.layout.location(prefix, i, 4 * rows.shape[1])] = r.astype("<f4").tobytes()
    assert got == want and len(got) == sum(len(ids) for _, ids, _ in groups)
    assert sent == sum(n for _, n in replies) < len(got)  # the dense run: one HSET per bucket


def test_row_writes_per_bucket_keep_each_rows_last_value_and_name_an_error_among_their_replies(shards3):
    """On a real server: rows out of bucket order, a row given twice in one group, and two groups
    of one prefix (the later group's value stays) are written as per-bucket HSETs with the values
    one HSET per row in order would leave; a reply that is an error, among thousands of integer
    replies, is raised naming the server's text, and the connection is dropped."""
    from embeddings.net.wire import RowConnection, WireError
    from embeddings.store.buckets import BucketLayout

    pool = redis.ConnectionPool.from_url(shards3.urls[0])
    conn = RowConnection(pool, 5.0, BucketLayout())
    admin = redis.Redis.from_url(shards3.urls[0])
    rng = np.random.default_rng(11)
    prefix, other = b"wtest:{0}:1:", b"wtest:{0}:22:"
    ids = rng.integers(0, 5000, 4000)  # unsorted, repeats
    rows = rng.standard_normal((4000, 5)).astype(np.float32)
    again = rng.choice(ids, 300)  # a second group on the same prefix: its values are the last
    again_rows = rng.standard_normal((300, 5)).astype(np.float32)
    wide = np.sort(rng.choice(10**9, 3000, replace=False))  # sparse: a bucket a row
    wide_rows = rng.standard_normal((3000, 9)).astype(np.float32)
    try:
        conn.set_rows([(prefix, ids, rows), (other, wide, wide_rows), (prefix, again, again_rows)])
        want = {}
        for g_prefix, g_ids, g_rows in ((prefix, ids, rows), (other, wide, wide_rows), (prefix, again, again_rows)):
            for i, r in zip(g_ids.tolist(), g_rows):
                want[conn.layout.location(g_prefix, i, 4 * g_rows.shape[1])] = r.tobytes()
        got = {loc: admin.hget(*loc) for loc in want}
        assert got == want
        # a bucket key that holds a string: its HSET fails (WRONGTYPE) among the others
        key, _ = conn.layout.location(prefix, int(ids[1234]), 20)
        admin.delete(key)
        admin.set(key, b"not a hash")
        with pytest.raises(WireError, match="WRONGTYPE"):
            conn.set_rows([(prefix, ids, rows)])
        assert conn._conn is None  # dropped: the replies after the error are not read
        conn.set_rows([(other, wide[:10], wide_rows[:10])])  # a new connection works
        assert admin.hget(*conn.layout.location(other, int(wide[3]), 36)) == wide_rows[3].tobytes()
    finally:
        for k in admin.scan_iter(match="wtest:*"):
            admin.delete(k)
        conn.close()
        pool.disconnect()


def test_integer_replies_read_in_pieces_cut_mid_reply_are_read_without_waiting_for_more():
    """The replies of a per-bucket write arriving in pieces, one cut inside a reply longer than 4
    bytes (``:10\\r\\n``): every reply is read as soon as its last byte comes, never waiting out the
    deadline for bytes the server will not send (a real socket pair; the server side sends by hand)."""
    import socket
    import threading
    import types

    from embeddings.net.wire import RowConnection, _read_ints

    ours, theirs = socket.socketpair()
    conn = RowConnection(None, 5.0)  # type: ignore[arg-type]
    conn._conn = types.SimpleNamespace(_sock=ours, disconnect=ours.close)  # type: ignore[assignment]

    first_read = threading.Event()

    def send() -> None:  # the second write's replies only once the first's are read: nothing more comes
        for piece in (b":10\r\n:0\r", b"\n", None, b":112\r\n:3", b"\r\n:1\r\n"):
            if piece is None:
                first_read.wait(10)
                continue
            theirs.sendall(piece)
            time.sleep(0.05)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        t0 = time.monotonic()
        conn._run(lambda: _read_ints(conn, 2))
        first_read.set()
        conn._run(lambda: _read_ints(conn, 3))
        assert time.monotonic() - t0 < 2.0  # not the 5 s deadline
        assert bytes(conn._buf) == b""
    finally:
        sender.join()
        ours.close()
        theirs.close()
