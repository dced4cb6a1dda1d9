"""The rows of a shard that is away (``embeddings.store.outage.OutageRows``), on their own: exact and
fallback rows, kept gradients in step order, an evaluation's reads leaving nothing, the budget, and
the rows two writers hand to every trainer (their sum of bit patterns, exact to the bit)."""

import numpy as np
import pytest

from embeddings.store.outage import ColdRows, OutageRows

WIDTH = 3


def init(keys: np.ndarray) -> np.ndarray:
    """A row's initial value: its key in every column (so a test can tell it)."""
    return np.repeat(keys.astype(np.float32)[:, None], WIDTH, axis=1)


def shard_of(keys: np.ndarray) -> np.ndarray:
    return (keys % 2).astype(np.int64)  # even keys on shard 0, odd on shard 1


def rows_of(*values: float) -> np.ndarray:
    return np.array([[v] * WIDTH for v in values], np.float32)


def test_held_rows_are_exact_the_rest_read_their_fallback_and_are_counted():
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    o.begin(0, np.array([2, 4]), rows_of(20.0, 40.0), np.array([True, True]))
    o.absent = lambda keys: keys == 8  # known never written: its initial value is exact
    o.serve(np.array([2, 6, 8]))
    got, exact = o.own_rows(np.array([2, 6, 8]))
    assert got[:, 0].tolist() == [20.0, 6.0, 8.0] and exact.tolist() == [True, False, True]
    c = o.counts[0]
    assert (c.exact_reads, c.fallback_reads) == (2, 1)
    assert o.read(np.array([4, 6]))[:, 0].tolist() == [40.0, 6.0]


def test_updates_split_exact_from_kept_and_end_hands_both_back_in_step_order():
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    o.begin(0, np.array([2]), rows_of(20.0), np.array([True]))
    keys = np.array([2, 6])
    exact = o.update(keys, rows_of(21.0, 7.0), np.full((2, WIDTH), 0.5, np.float32), step=5)
    assert exact.tolist() == [True, False]
    o.update(np.array([6]), rows_of(8.0), np.full((1, WIDTH), 0.25, np.float32), step=6)
    assert o.read(np.array([2, 6]))[:, 0].tolist() == [21.0, 8.0]  # the fallback row trains on
    assert (o.counts[0].exact_updates, o.counts[0].late_updates) == (1, 2)
    dirty_keys, dirty_rows, kept = o.end(0)
    assert dirty_keys.tolist() == [2] and dirty_rows[:, 0].tolist() == [21.0]
    assert [(st, k.tolist(), g[0, 0]) for st, k, g in kept] == [(5, [6], 0.5), (6, [6], 0.25)]
    assert not o.active


def test_an_evaluation_reads_leave_nothing_and_count_nothing():
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    o.begin(0, np.array([2]), rows_of(20.0), np.array([True]))
    before = o.used_bytes()
    o.serve(np.array([2, 10]), training=False)
    assert o.read(np.array([10]))[:, 0].tolist() == [10.0]
    assert o.counts[0].fallback_reads == 0 and o.used_bytes() == before
    keys, _, _ = o.end(0)
    assert keys.tolist() == []  # row 10 was never added


def test_the_budget_counts_rows_and_kept_gradients():
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=200)
    o.begin(0, np.array([2]), rows_of(20.0), np.array([True]))
    assert not o.over_budget()
    for step in range(1, 6):
        o.update(np.array([4, 6]), rows_of(1.0, 2.0), np.ones((2, WIDTH), np.float32), step)
    assert o.over_budget() and o.used_bytes() > 200


def test_two_writers_hand_every_trainer_the_same_bits():
    """Two trainers, each the writer of one shard that is away: the union of their keys, each row
    from its writer, summed as int64 bit patterns. -0.0 and a NaN payload survive the sum."""
    special = np.array([[-0.0, np.float32(np.nan), 1e-38]], np.float32)
    a = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    b = OutageRows(init, shard_of, mine={1}, budget_bytes=1 << 20)
    a.begin(0, np.array([2]), special, np.array([True]))
    a.begin(1, *empty())
    b.begin(0, *empty())
    b.begin(1, np.array([3]), rows_of(30.0), np.array([True]))
    mine = {id(a): np.array([2, 3]), id(b): np.array([3, 5])}
    gathered = np.unique(np.concatenate(list(mine.values())))
    parts: list[np.ndarray] = []

    def serve_both() -> None:
        # each trainer's contribution is computed first, then "all-reduced" as a sum of both
        for o in (a, b):
            o.serve(mine[id(o)], lambda keys: gathered, lambda bits: parts.append(bits.copy()) or bits)
        total = parts[0] + parts[1]  # the rows, then one row with the count of rows no writer holds
        assert total.shape == (len(gathered) + 1, WIDTH) and total[-1].tolist() == [0] * WIDTH
        for o in (a, b):
            o._served = (gathered, total[:-1].astype(np.int32).view(np.float32).reshape(len(gathered), WIDTH))

    serve_both()
    ra, rb = a.read(np.array([2, 3, 5])), b.read(np.array([2, 3, 5]))
    assert ra.tobytes() == rb.tobytes()
    assert ra[0].tobytes() == special[0].tobytes()  # -0.0 stays -0.0, the NaN keeps its bits
    assert ra[1, 0] == 30.0 and ra[2, 0] == 5.0  # key 5: its writer's fallback


def empty():
    return np.empty(0, np.int64), np.empty((0, WIDTH), np.float32), np.empty(0, bool)


def test_a_read_outside_the_served_rows_is_refused():
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    o.begin(1, *empty())  # away, written by another trainer
    o.serve(np.array([3]), lambda keys: np.array([3]), lambda bits: bits)
    with pytest.raises(RuntimeError, match="outside the step's served rows"):
        o.read(np.array([7]))


def test_where_every_read_must_be_exact_a_row_no_writer_holds_is_refused_before_anything_is_kept():
    """``exact_only`` (``--recovery log``): no fallback. A step that reads a row its writer does not
    hold, and that is not known never written, raises ``ColdRows`` (every trainer alike: with two,
    the count rides on the all-reduce) and leaves no row, count or kept update behind."""
    o = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    o.exact_only = True
    o.begin(0, np.array([2]), rows_of(20.0), np.array([True]))
    o.absent = lambda keys: keys == 8
    o.serve(np.array([2, 8]))  # held, and known never written: exact
    assert (o.counts[0].exact_reads, o.counts[0].fallback_reads) == (2, 0)
    with pytest.raises(ColdRows, match=r"^2 rows of shards \[0\] away that no trainer holds$") as e:
        o.serve(np.array([2, 4, 6]))
    assert e.value.count == 2 and o.counts[0].exact_reads == 2 and o.cold(np.array([4, 6])) == 2
    assert o.own_rows(np.array([4]), keep=False)[1].tolist() == [False]  # nothing was added
    # a shard that failed between a step's stage and its update: the update keeps a gradient for a
    # row it did not hold (a shadow value); a later read of it is cold too, never the shadow
    o.update(np.array([6]), rows_of(7.0), np.ones((1, WIDTH), np.float32), 3)
    assert o.cold(np.array([6])) == 1
    with pytest.raises(ColdRows):
        o.serve(np.array([6]))

    a = OutageRows(init, shard_of, mine={0}, budget_bytes=1 << 20)
    b = OutageRows(init, shard_of, mine={1}, budget_bytes=1 << 20)
    for o, held in ((a, 0), (b, 1)):
        o.exact_only = True
        for s in (0, 1):
            o.begin(
                s,
                np.array([2 + s]) if s == held else np.empty(0, np.int64),
                rows_of(1.0)[: int(s == held)],
                np.array([True])[: int(s == held)],
            )
    gathered = np.array([2, 3, 5])  # 5: shard 1's, not held by its writer (b)
    parts = {}

    class Stop(Exception):
        pass

    def capture(o):
        def reduce(x):
            parts[id(o)] = x.copy()
            raise Stop

        return reduce

    for o in (a, b):  # each trainer's part of the all-reduce
        with pytest.raises(Stop):
            o.serve(gathered, lambda keys: gathered, capture(o))
    assert parts[id(a)][-1, 0] == 0 and parts[id(b)][-1, 0] == 1  # b's writer counted its cold row
    total = parts[id(a)] + parts[id(b)]
    for o in (a, b):  # every trainer learns it from the sum: all refuse the step alike
        with pytest.raises(ColdRows, match=r"^1 rows of shards \[0, 1\]"):
            o.serve(gathered, lambda keys: gathered, lambda x: total)
    assert a.counts[0].exact_reads == 0 and b.counts[1].exact_reads == 0  # nothing counted or kept
