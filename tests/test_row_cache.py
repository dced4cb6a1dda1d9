"""The bounded row cache (``embeddings.store.row_cache``) and its key index, against plain Python models."""

import numpy as np
import pytest

from embeddings.keyindex import KeyIndex
from embeddings.rowkeys import pack
from embeddings.store.row_cache import ABSENT, HELD, HeldRows
from embeddings.tables import TableSet, TableSpec


def test_the_key_index_agrees_with_a_dict_through_inserts_removals_and_rebuilds():
    rng = np.random.default_rng(0)
    slot_keys = np.full(5000, -1, np.int64)
    index = KeyIndex(5000, slot_keys)
    model: dict[int, int] = {}
    free = list(range(5000))
    for _ in range(60):
        new = np.setdiff1d(np.unique(pack(rng.integers(0, 3), rng.integers(0, 10**9, 300))), list(model))
        new = new[: len(free)]
        slots = np.array([free.pop() for _ in new], np.int64)
        slot_keys[slots] = new
        index.insert(new, slots)
        model.update(zip(new.tolist(), slots.tolist(), strict=True))
        gone = rng.choice(list(model), min(len(model), 250), replace=False)
        index.remove(np.asarray(gone, np.int64))
        for k in gone.tolist():
            s = model.pop(k)
            slot_keys[s] = -1
            free.append(s)
        probe = np.concatenate([np.fromiter(model, np.int64), gone[:50], pack(7, np.arange(50))])
        want = np.array([model.get(k, -1) for k in probe.tolist()])
        np.testing.assert_array_equal(index.lookup(probe), want)


def cache(rows_per_table=10_000, budget_rows=500, tables=2, width=4):
    specs = TableSet([TableSpec(f"t{i}", rows_per_table, width - 1) for i in range(tables)])
    slot = width * 4 + 45
    return HeldRows(specs, [width] * tables, {0}, budget_rows * slot, init=lambda k: np.zeros((len(k), width)))


def test_a_bounded_cache_serves_what_was_written_keeps_hot_rows_and_never_outgrows_its_budget():
    held = cache()
    assert held.capacity == 500 and not held.holds_everything() and held.holds_all()
    rng = np.random.default_rng(1)
    truth: dict[int, np.ndarray] = {}
    hot = pack(0, np.arange(50))
    for step in range(1, 200):
        cold = pack(1, rng.choice(10_000, 200, replace=False))
        keys = np.unique(np.concatenate([hot, cold]))
        held.lookup_keys(keys)  # a stage reads them: the hot ones every step
        rows = rng.standard_normal((len(keys), 4)).astype(np.float32)
        held.put_keys(keys, rows, step)
        truth.update(zip(keys.tolist(), rows, strict=True))
        assert held.used <= held.capacity == 500
    pos, got, _ = held.lookup_keys(np.fromiter(truth, np.int64))
    probe = np.fromiter(truth, np.int64)[pos]
    np.testing.assert_array_equal(got, np.stack([truth[k] for k in probe.tolist()]))  # every row held is current
    assert np.isin(hot, probe).all()  # read every step: never evicted
    assert held.evicted > 0 and len(pos) <= 500


def test_pinned_rows_stay_and_grow_the_cache_only_when_they_must():
    held = cache(budget_rows=100)
    keys = pack(0, np.arange(150))
    held.put_keys(keys, np.ones((150, 4), np.float32), step=1, pin=True)  # an open window: on no shard yet
    assert held.capacity >= 150 and held.grown >= 50
    for step in range(2, 6):  # other rows come and go; the pinned ones stay
        held.put_keys(pack(1, np.arange(step * 100, step * 100 + 100)), np.zeros((100, 4), np.float32), step)
    np.testing.assert_array_equal(held.copy_rows(keys), np.ones((150, 4), np.float32))
    held.unpin(keys)
    assert (held.state_of(keys) == HELD).all()


def test_a_cleared_shard_is_read_back_and_an_evicted_forgotten_row_is_not_claimed():
    specs = TableSet([TableSpec("t", 1000, 3)])
    held = HeldRows(specs, [4], {0, 1}, 1 << 20, owner_of=lambda t, ids: (np.asarray(ids) % 2).astype(np.int16))
    keys = pack(0, np.arange(100))
    held.put_keys(keys, np.ones((100, 4), np.float32), step=3)
    held.restores.clear(1)
    unknown = held.restores.unknown(1)[0]
    np.testing.assert_array_equal(unknown, np.arange(1, 100, 2))  # shard 1's rows, to read back
    assert held.restores.reinstate(1) == 50 and held.restores.unknown(1) == {}


def test_a_window_writes_each_row_once_as_of_its_last_step_with_its_value_before_the_window():
    """``recovery.window.Window`` over the cache, against a dict: keys updated in several steps of a
    window come out once, sorted, with the row before the window's first update as their undo."""
    from recovery.window import Window

    held = cache(budget_rows=3000)
    window = Window(held, every=4)
    rng = np.random.default_rng(2)
    rows = {}  # key -> its row now
    for w in range(3):
        before_window: dict[int, np.ndarray] = {}
        for step in range(4 * w + 1, 4 * w + 5):
            keys = np.unique(pack(rng.integers(0, 2), rng.integers(0, 400, 120)))
            current = np.stack([rows.get(k, np.zeros(4, np.float32)) for k in keys.tolist()]).astype(np.float32)
            new = current + step
            for k, old in zip(keys.tolist(), current, strict=True):
                before_window.setdefault(k, old)
            window.add(("update", step), step, keys, current)
            held.put_keys(keys, new, step, pin=True)
            rows.update(zip(keys.tolist(), new, strict=True))
            assert window.open and window.closes_at(step) == (step % 4 == 0 or step == 1)  # step 1 too
        keys, now, undo, updates = window.take()
        want = sorted(before_window)
        np.testing.assert_array_equal(keys, want)
        np.testing.assert_array_equal(now, np.stack([rows[k] for k in want]))
        np.testing.assert_array_equal(undo, np.stack([before_window[k] for k in want]))
        assert [s for _, s in updates] == list(range(4 * w + 1, 4 * w + 5)) and not window.open


def test_a_fresh_cache_that_fits_every_row_holds_each_at_its_initial_value_before_the_first_step():
    specs = TableSet([TableSpec("a", 3000, 3), TableSpec("b", 700, 3)])

    def init(keys):  # a pure function of the key, as the lazy init is
        return np.repeat((keys % 1009).astype(np.float32)[:, None], 4, axis=1)

    def fresh(budget):
        held = HeldRows(specs, [4, 4], {0, 1}, budget, init=init, num_shards=2)
        held.put_keys(pack(1, np.array([5, 6])), np.full((2, 4), 7.0, np.float32), step=1)  # written before
        held.assume_fresh({0, 1})
        return held

    every = fresh(1 << 20)
    assert every.holds_everything() and every.used == 3700  # every row in its slot, none computed on a step
    keys = np.concatenate([pack(0, np.arange(3000)), pack(1, np.arange(700))])
    written = np.isin(keys, pack(1, np.array([5, 6])))
    state = every.state_of(keys)
    assert (state[written] == HELD).all() and (state[~written] == ABSENT).all()  # known never written
    rows = every.read_keys(keys)
    want = init(keys)
    want[3005:3007] = 7.0  # the rows written before the fresh start keep their values
    np.testing.assert_array_equal(rows, want)
    assert every.hits == 3700 and every.lookups == 3700  # each one held: no initial value computed now
    every.put_keys(pack(0, np.array([9])), np.zeros((1, 4), np.float32), step=2)
    assert every.state_of(pack(0, np.array([9, 10]))).tolist() == [HELD, ABSENT]

    bounded = fresh(3000 * (4 * 4 + 45))  # not every row fits: nothing is computed ahead
    assert not bounded.holds_everything() and bounded.used == 2
    np.testing.assert_array_equal(bounded.read_keys(keys), want)  # the same rows, by the lazy init
    assert bounded.hits == 2


def test_two_trainers_caches_each_prefill_their_shards_and_a_stage_reads_one_gather_from_each():
    from embeddings.peer_rows import PeerRows
    from embeddings.store.row_slots import UNKNOWN

    specs = TableSet([TableSpec("a", 500, 3), TableSpec("b", 300, 3)])

    def init(keys):
        return np.repeat((keys % 1009).astype(np.float32)[:, None], 4, axis=1)

    def owners(keys):  # shard of a packed key: its row id's parity
        return (keys & 1).astype(np.int16)

    own = HeldRows(specs, [4, 4], {0}, 1 << 20, init=init, owner_of_keys=owners, num_shards=2)
    peers = PeerRows(specs, [4, 4], {1}, 1 << 20, init=init, owner_of_keys=owners, num_shards=2)
    own.assume_fresh({0})
    peers.assume_fresh({0, 1})
    keys = np.concatenate([pack(0, np.arange(500)), pack(1, np.arange(300))])
    even = (keys & 1) == 0
    # each holds its own shard's rows at their initial values, known never written, and no other
    assert own.used == even.sum() and peers.used == (~even).sum()
    assert (own.state_of(keys[even]) == ABSENT).all() and (peers.state_of(keys[~even]) == ABSENT).all()
    np.testing.assert_array_equal(own.read_split(keys, peers), init(keys))
    # a write of each lands in its own cache, and the split read sees both
    own.put_keys(keys[:2][even[:2]], np.full((1, 4), 5.0, np.float32), step=1)
    peers.put_keys(keys[:2][~even[:2]], np.full((1, 4), 6.0, np.float32), step=1)
    want = init(keys)
    want[0], want[1] = 5.0, 6.0
    np.testing.assert_array_equal(own.read_split(keys, peers), want)
    # the peer rows forgotten (a restore behind the steps): the prefilled rows are no longer known never
    # written either (their writer may have written them), so the split read gives way to the general path
    peers.restores.clear()  # as ``RowCache.drop_peers`` forgets them
    peers.forget_fresh()
    assert (peers.state[peers.state != 0] == UNKNOWN).all() and peers.used == (~even).sum()
    assert own.read_split(keys, peers) is None
    assert own.read_split(keys[even], peers) is not None  # the trainer's own rows stand


def test_the_gathered_keys_joined_by_a_stable_sort_are_torch_unique():
    import torch

    from recsys.group import unique_runs

    rng = np.random.default_rng(3)
    for _ in range(50):
        runs = [np.unique(rng.integers(0, 2000, rng.integers(0, 400))) for _ in range(rng.integers(1, 4))]
        k = torch.from_numpy(np.concatenate(runs).astype(np.int64))
        got, want = unique_runs(k), torch.unique(k, return_inverse=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_cache_built_again_in_its_process_takes_the_released_arrays_and_holds_nothing_of_them():
    from embeddings.store import row_slots

    row_slots.keep_released()
    try:
        first = cache(rows_per_table=1000, budget_rows=4000)  # every row fits: direct slots
        keys = pack(1, np.arange(0, 1000, 7))
        first.put_keys(keys, np.full((len(keys), 4), 3.0, np.float32), step=1)
        assert (first.state_of(keys) == HELD).all()
        rows, key = first.rows, first.key
        first.release()
        assert first.capacity == 0
        with pytest.raises(IndexError):  # a late call fails: it never reads the arrays of another cache
            first.lookup_keys(keys)
        again = cache(rows_per_table=1000, budget_rows=4000)
        assert again.rows is rows and again.key is key  # the arrays, touched already
        assert (again.key == -1).all() and (again.state == 0).all()
        pos, _, absent = again.lookup_keys(keys)
        assert pos.size == 0 and absent.size == 0  # nothing of the released cache is held, or known
        again.put_keys(keys[:3], np.ones((3, 4), np.float32), step=2)
        np.testing.assert_array_equal(again.read_keys(keys[:3]), np.ones((3, 4), np.float32))
        other = cache(rows_per_table=500, budget_rows=4000)  # another size: arrays of its own
        assert other.rows is not rows
    finally:
        row_slots.keep_released(False)
    again.release()
    assert cache(rows_per_table=1000, budget_rows=4000).rows is not rows  # off: nothing kept
