"""What a resumed trainer learns of its shards (``embeddings.store.present``): every row on them,
listed from real redis-servers, and nothing where a shard cannot tell or changed meanwhile."""

import numpy as np
import pytest
import redis
import torch

from embeddings import RedisStore, RowWiseAdagrad, TableSet, TableSpec
from embeddings.rowkeys import pack
from embeddings.store.row_cache import ABSENT, HELD, UNKNOWN

pytestmark = pytest.mark.redis

TABLES = TableSet([TableSpec("a", 3000, 8), TableSpec("b", 5000, 8)])
OPT = RowWiseAdagrad(lr=0.05)
EVERY_ROW = 1 << 26  # a budget that holds every row of TABLES


def written_store(urls, namespace: str) -> tuple[np.ndarray, np.ndarray]:
    """A fresh run's writer of every shard applies three steps; -> (the sorted packed keys it
    wrote, keys it never wrote)."""
    rng = np.random.default_rng(4)
    wrote = set()
    with RedisStore(urls, TABLES, OPT, namespace=namespace, seed=1) as st:
        st.hold_rows({0, 1, 2}, EVERY_ROW)
        st.assume_fresh()
        for step in (1, 2, 3):
            keys = np.unique(np.concatenate([pack(0, rng.integers(0, 3000, 400)), pack(1, rng.integers(0, 5000, 700))]))
            st.apply_keys(keys, torch.from_numpy(rng.standard_normal((len(keys), 8)).astype(np.float32)), step)
            wrote.update(keys.tolist())
    every = np.concatenate([pack(0, np.arange(3000)), pack(1, np.arange(5000))])
    keys = np.array(sorted(wrote), np.int64)
    return keys, np.setdiff1d(every, keys)


def resumed(urls, namespace: str, budget: int = EVERY_ROW) -> RedisStore:
    st = RedisStore(urls, TABLES, OPT, namespace=namespace, seed=1)
    st.hold_rows({0, 1, 2}, budget)
    return st


def test_a_resumed_writer_learns_every_row_on_its_shards_and_holds_them_where_they_fit(shards3, namespace):
    wrote, never = written_store(shards3.urls, namespace)
    with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace, seed=1) as plain:
        want = plain.read_keys(wrote)  # from Redis: this store holds nothing
    with resumed(shards3.urls, namespace) as st:
        held = st.row_cache
        assert held is not None and (held.state_of(wrote) == UNKNOWN).all()
        assert (held.state_of(never) == UNKNOWN).all()
        st.learn_present()
        assert st.present.wait() == [0, 1, 2]
        assert st.present_stats()["rows"] == len(wrote)
        assert (held.state_of(wrote) == HELD).all()
        assert (held.state_of(never) == ABSENT).all()
        np.testing.assert_array_equal(held.read_keys(wrote), want)
        # a row written after the listing began is not taken for a row never written
        new = never[:5]
        st.apply_keys(new, torch.ones((5, 8)), 4)
        assert (held.state_of(new) == HELD).all()
    with resumed(shards3.urls, namespace, budget=200 * 200) as st:  # a few hundred rows fit: presence only
        held = st.row_cache
        assert held is not None and not held.holds_everything()
        st.learn_present()
        assert st.present.wait() == [0, 1, 2]
        assert st.present_stats()["rows"] == len(wrote) + 5
        assert (held.state_of(wrote) == UNKNOWN).all()  # on its shard: read once when first needed
        assert (held.state_of(never[5:]) == ABSENT).all()
        st.clear()


def test_nothing_is_learned_of_a_shard_started_again_empty_nor_after_a_shard_was_forgotten(shards3, namespace):
    wrote, never = written_store(shards3.urls, namespace)
    # shard 1's server lost everything (started again empty; recovery has yet to meet it)
    c = redis.Redis.from_url(shards3.urls[1])
    c.delete(*c.keys(f"{namespace}:*"))
    with resumed(shards3.urls, namespace) as st:
        st.learn_present()
        assert st.present.wait() == [0, 2]
        held = st.row_cache
        assert held is not None
        on_1 = st.shard_map.shard_of_keys(never) == 1
        assert (held.state_of(never[on_1]) == UNKNOWN).all()
        assert (held.state_of(never[~on_1]) == ABSENT).all()
    with resumed(shards3.urls, namespace) as st:
        held = st.row_cache
        assert held is not None
        generation = st.present.prepare()
        st.cache.forget(0)  # a restore or rollback of shard 0 while the listing ran
        assert st.present.run(generation) == []
        generation = st.present.prepare()
        st.stop_learning()  # any trainer's recovery of a failed shard began
        assert st.present.run(generation) == []
        assert (held.state_of(never) == UNKNOWN).all()
        # a recovery before the listing begins (during the resume) stops nothing begun after it
        generation = st.present.prepare()
        assert st.present.run(generation) == [0, 2]
    with resumed(shards3.urls, namespace) as st:
        held = st.row_cache
        assert held is not None
        # shard 2 gone back before the step the trainer resumed at (another trainer restored it)
        generation = st.present.prepare()
        c2 = redis.Redis.from_url(shards3.urls[2])
        c2.set(f"{namespace}:meta:applied", b"1")
        assert st.present.run(generation) == [0]
        on_0 = st.shard_map.shard_of_keys(never) == 0
        assert (held.state_of(never[on_0]) == ABSENT).all()
        assert (held.state_of(never[~on_0]) == UNKNOWN).all()
        st.clear()


def test_a_listing_connection_sends_a_batch_in_one_write_and_an_error_reply_names_itself(shards3, namespace):
    """``RowConnection.replies``, as the listing uses it: one write of many commands, each reply
    parsed; an error reply raises with the server's words and drops the socket (the next call
    opens another)."""
    from embeddings.net.wire import RowConnection, WireError, key_commands

    c = redis.Redis.from_url(shards3.urls[0])
    c.hset(f"{namespace}:h1", mapping={b"a": b"1", b"b": b"2"})
    c.hset(f"{namespace}:h2", mapping={b"c": b"3"})
    c.set(f"{namespace}:s1", b"x")
    keys = [f"{namespace}:h1".encode(), f"{namespace}:h2".encode(), f"{namespace}:hx".encode()]
    wire = RowConnection(redis.ConnectionPool.from_url(shards3.urls[0], protocol=2), 5.0)  # as ShardLinks opens it
    try:
        got = wire.replies(key_commands(b"HGETALL", keys), 3)
        assert [dict(zip(r[0::2], r[1::2])) for r in got] == [{b"a": b"1", b"b": b"2"}, {b"c": b"3"}, {}]
        mixed = [f"{namespace}:s1".encode(), keys[0]]  # unequal lengths: a command each
        with pytest.raises(WireError, match="WRONGTYPE"):
            wire.replies(key_commands(b"HKEYS", mixed), 2)
        # h1's reply, left unread after the error, went with the socket: h2's is h2's
        assert wire.replies(key_commands(b"HKEYS", keys[1:2]), 1) == [[b"c"]]
    finally:
        wire.close()


def test_a_listing_connection_to_an_endpoint_that_does_not_speak_resp_names_it():
    """An endpoint that answers the listing's commands with something other than RESP (a wrong port
    given as a shard): one ``WireError`` that says so, not hiredis's own exception."""
    import socket
    import threading

    from embeddings.net.wire import RowConnection, WireError, key_commands

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            while data := conn.recv(1 << 16):
                if b"HKEYS" in data:  # the listing's batch: not RESP
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                else:  # the connection's own set-up (CLIENT SETINFO ...): +OK to each command
                    conn.sendall(b"+OK\r\n" * data.count(b"\r\n*") + b"+OK\r\n")

    t = threading.Thread(target=answer, daemon=True)
    t.start()
    wire = RowConnection(redis.ConnectionPool.from_url(f"redis://127.0.0.1:{port}/0", protocol=2), 5.0)
    try:
        with pytest.raises(WireError, match="not RESP"):
            wire.replies(key_commands(b"HKEYS", [b"k1", b"k2"]), 2)
    finally:
        wire.close()
        listener.close()
        t.join(5)


def test_a_trainer_built_again_in_its_process_takes_its_cache_whole_and_keeps_what_a_rollback_left(shards3, namespace):
    """``--trainer-recovery replace``: the next trainer of a process that writes the same shards
    takes the last one's cache; after another trainer rolled a step back behind its back, the rows
    that step wrote are read back (or known never written), the rest stay held, and nothing is listed."""
    from embeddings.store import row_slots

    rng = np.random.default_rng(7)
    row_slots.keep_released()
    try:
        with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace, seed=1) as first:
            first.hold_rows({0, 1, 2}, EVERY_ROW)
            first.assume_fresh()
            for step in (1, 2, 3):
                keys = np.unique(pack(1, rng.integers(0, 2500, 600)))
                first.apply_keys(keys, torch.from_numpy(rng.standard_normal((len(keys), 8)).astype(np.float32)), step)
            held_before = first.row_cache
            kept = np.unique(pack(1, np.arange(0, 2500)))
            kept = kept[first.row_cache.state_of(kept) == HELD]
            again = kept[:40]  # written again in step 4, which is then rolled back
            new = pack(1, np.arange(4000, 4030))  # first written in step 4
            step4 = np.concatenate([again, new])
            first.apply_keys(step4, torch.ones((len(step4), 8)), 4)
        with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace, seed=1) as rank0:
            assert sum(rank0.rollback(s, 3) for s in range(3)) == len(step4)  # behind the writer's back
            want = rank0.read_keys(kept)
        # the next trainer of this process: another store, the same shards and budget
        with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace, seed=1) as nxt:
            nxt.hold_rows({0, 1, 2}, EVERY_ROW)
            held = nxt.row_cache
            assert held is not None and held is held_before and nxt.cache.taken_over
            nxt.learn_present(3)  # every shard back at step 3
            assert nxt.present._thread is None  # every row known: nothing listed
            assert (held.state_of(again) == UNKNOWN).all()  # step 4 wrote it: read back
            assert (held.state_of(new) == ABSENT).all()  # first written in step 4: not there now
            assert (held.state_of(kept[40:]) == HELD).all()  # untouched by step 4: still held
            np.testing.assert_array_equal(held.read_keys(kept[40:]), want[40:])
            np.testing.assert_array_equal(nxt.read_keys(kept), want)  # the step-4 rows read back as rolled back
        with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace + "x", seed=1) as other:
            other.hold_rows({0, 1, 2}, EVERY_ROW)  # another run's store: a cache of its own
            assert other.row_cache is not held and not other.cache.taken_over
            assert other.row_cache.state_of(kept[40:]).tolist() == [UNKNOWN] * len(kept[40:])
        with RedisStore(shards3.urls, TABLES, OPT, namespace=namespace, seed=1) as st:
            st.hold_rows({0, 1}, EVERY_ROW)  # other shards: a cache of its own
            assert st.row_cache is not held and not st.cache.taken_over
            st.clear()
    finally:
        row_slots.keep_released(False)
