"""The packed-key row path: one pass over every table must equal the per-table path it replaced."""

import numpy as np
import pytest
import torch

from embeddings import RedisStore, RowWiseAdagrad, TableSet, TableSpec, rowkeys
from embeddings.rowinit import init_rows, init_rows_keys
from embeddings.shard_map import ShardMap

TABLES = TableSet([TableSpec(f"t{i}", 1000 + 97 * i, 8) for i in range(12)])


def random_keys(rng, per_table=60):
    return rowkeys.from_tables(
        {t: np.unique(rng.integers(0, spec.num_rows, per_table)) for t, spec in enumerate(TABLES)}
    )[0]


@pytest.mark.parametrize("placement", ["row", "table"])
def test_shard_of_keys_and_init_match_the_per_table_functions(placement):
    keys = random_keys(np.random.default_rng(0))
    shard_map = ShardMap(TABLES, 3, placement)
    shards = shard_map.shard_of_keys(keys)
    scales = np.array([s.scale for s in TABLES], np.float32)
    init = init_rows_keys(7, keys, 8, scales)
    groups = rowkeys.table_groups(keys)
    assert sorted(groups) == list(range(len(TABLES)))
    for t, (ids, lo, hi) in groups.items():
        np.testing.assert_array_equal(shards[lo:hi], shard_map.shard_of(t, ids))
        np.testing.assert_array_equal(init[lo:hi], init_rows(7, t, ids, 8, TABLES.specs[t].scale))


def test_apply_keys_with_held_rows_equals_per_table_updates(shards3, namespace):
    """A step over every table in one pass (held rows, one optimizer call, every shard written from
    one thread) leaves the shards bit for bit where per-table ``update_many`` calls leave them."""
    rng = np.random.default_rng(3)
    opt = RowWiseAdagrad(lr=0.05)
    with (
        RedisStore(shards3.urls, TABLES, opt, namespace=namespace) as fast,
        RedisStore(shards3.urls, TABLES, opt, namespace=namespace + "-ref") as ref,
    ):
        fast.hold_rows({0, 1, 2}, 1 << 30)
        fast.assume_fresh()
        for step in range(1, 6):
            keys = random_keys(rng)
            grads = torch.from_numpy(rng.standard_normal((len(keys), 8)).astype(np.float32))
            fast.apply_keys(keys, grads, step)
            ref.update_many(
                {TABLES.specs[t].name: (ids, grads[lo:hi]) for t, (ids, lo, hi) in rowkeys.table_groups(keys).items()}
            )
        assert fast.row_cache.hits > 0  # later steps read rows from memory, not from Redis
        every = np.concatenate([rowkeys.pack(t, np.arange(s.num_rows)) for t, s in enumerate(TABLES)])
        with fast.from_redis():
            np.testing.assert_array_equal(fast.read_keys(every), ref.read_keys(every))
        assert fast.applied_steps() == [5, 5, 5] and ref.applied_steps() == [None, None, None]
        # every row on its own shard only: the same keys per shard as the per-table path wrote
        for s in range(3):
            on = [
                sorted(
                    k.split(b":", 1)[1]
                    for k in st.links.client(s).scan_iter(match=st.snapshots.match(s), count=1000)
                    if b":meta:" not in k  # the step's applied marker and undo record: only the fast path's
                )
                for st in (fast, ref)
            ]
            assert on[0] == on[1] and len(on[0]) > 10
        fast.clear()
        ref.clear()


def test_a_step_write_cut_short_is_rolled_back(shards3, namespace):
    """The undo record goes before a step's rows and the applied marker after them: a writer that
    dies part way (here: only the undo record and the first table's rows reached the shard) leaves a
    shard that ``rollback`` returns exactly to the step before."""
    rng = np.random.default_rng(4)
    with RedisStore(shards3.urls, TABLES, RowWiseAdagrad(lr=0.05), namespace=namespace) as st:
        keys = random_keys(rng)
        st.apply_keys(keys, torch.ones((len(keys), 8)), step=1)
        on0 = keys[st.shard_map.shard_of_keys(keys) == 0]
        before = st.read_keys(on0)
        # step 2 on shard 0, cut short: undo record and one table's rows, no applied marker
        from embeddings.store.redis_store import encode_groups

        groups = rowkeys.table_groups(on0)
        blob = encode_groups(2, [(t, ids, before[lo:hi]) for t, (ids, lo, hi) in groups.items()])
        t0, (ids0, lo0, hi0) = next(iter(groups.items()))
        junk = np.full((hi0 - lo0, 9), 123.0, np.float32)
        wire = st.links.wires[0]
        wire.finish(wire.send_rows([(st.prefix(t0, 0), ids0, junk)], [[b"SET", st.meta_key("undo", 0), blob]], []))
        assert st.applied_step(0) == 1
        assert np.all(st.read_keys(on0[lo0:hi0]) == 123.0)
        assert st.rollback(0, 1) == len(on0)
        np.testing.assert_array_equal(st.read_keys(on0), before)
        assert st.applied_step(0) == 1
        assert st.rollback(0, 1) == 0  # nothing left to undo
        st.clear()


def test_a_window_write_is_named_for_the_step_after_each_shards_marker_and_rolls_back_whole(shards3, namespace):
    """A write-behind window (the rows of steps 3-5 in one write, ``window=True``): each shard's undo
    record is named for the step after its applied marker, so a restart at step 2 takes the shard
    back over the whole window in one undo, and a restart at any other step is refused."""
    from embeddings import ShardDataError

    rng = np.random.default_rng(5)
    with RedisStore(shards3.urls, TABLES, RowWiseAdagrad(lr=0.05), namespace=namespace) as st:
        keys = random_keys(rng)
        st.apply_keys(keys, torch.ones((len(keys), 8)), step=2)
        shards = st.shard_map.shard_of_keys(keys)
        before = st.read_keys(keys)
        after = before + 1.0
        st.write_behind(keys, after, shards, 5, undo=before, window=True)
        assert st.join_behind() == {}
        assert st.applied_steps() == [5, 5, 5] and st.rows_written == 2 * len(keys)
        np.testing.assert_array_equal(st.read_keys(keys), after)
        from embeddings.store.redis_store import decode_groups

        for s in range(3):
            assert decode_groups(st.links.locked_get(s, st.meta_key("undo", s)))[0] == 3  # marker 2, then 3-5
        with pytest.raises(ShardDataError, match="undo record is for step 3"):
            st.rollback(0, 4)
        assert sum(st.rollback(s, 2) for s in range(3)) == len(keys)
        np.testing.assert_array_equal(st.read_keys(keys), before)
        assert st.applied_steps() == [2, 2, 2]
        st.clear()
