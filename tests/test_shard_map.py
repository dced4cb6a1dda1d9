import numpy as np
import pytest

from embeddings.rowinit import init_rows
from embeddings.shard_map import ShardMap, place_tables
from embeddings.tables import TableSet, TableSpec

TABLES = TableSet([TableSpec("a", 1000, 8), TableSpec("b", 50, 8), TableSpec("c", 10**8, 16)])


def test_row_placement_is_deterministic_in_range_and_balanced():
    m = ShardMap(TABLES, 4, "row")
    ids = np.arange(100_000)
    s1, s2 = m.shard_of(2, ids), ShardMap(TABLES, 4, "row").shard_of(2, ids)
    assert np.array_equal(s1, s2)
    assert s1.min() == 0 and s1.max() == 3
    counts = np.bincount(s1, minlength=4)
    assert counts.min() > 0.95 * 25_000 and counts.max() < 1.05 * 25_000
    # a different table places the same row ids differently
    assert (m.shard_of(0, ids[:1000]) != m.shard_of(2, ids[:1000])).mean() > 0.5


def test_table_placement_greedy_largest_first():
    assert place_tables([10, 100, 50, 40], 2) == [1, 0, 1, 1]
    m = ShardMap(TABLES, 2, "table")
    assert set(m.shard_of(2, np.arange(10)).tolist()) == {0}
    assert set(m.shard_of(0, np.arange(10)).tolist()) == {1}


@pytest.mark.parametrize("placement", ["row", "table"])
def test_split_partitions_positions(placement):
    m = ShardMap(TABLES, 3, placement)
    ids = np.random.default_rng(0).integers(0, 1000, 500)
    parts = m.split(0, ids)
    assert sorted(np.concatenate(parts).tolist()) == list(range(500))
    for s, pos in enumerate(parts):
        assert (m.shard_of(0, ids[pos]) == s).all()


def test_bad_shard_map_values_are_named():
    with pytest.raises(ValueError, match="num_shards=0"):
        ShardMap(TABLES, 0)
    with pytest.raises(ValueError, match="'column'"):
        ShardMap(TABLES, 2, "column")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dim=0"):
        TableSpec("x", 10, 0)
    with pytest.raises(ValueError, match=r"duplicate table names: \['a'\]"):
        TableSet([TableSpec("a", 1, 1), TableSpec("a", 2, 1)])


def test_lazy_init_is_deterministic_uniform_and_depends_on_seed_table_row():
    ids = np.array([0, 1, 99_999_999])
    a = init_rows(7, 2, ids, 16, 0.5)
    assert a.shape == (3, 16) and a.dtype == np.float32
    assert np.array_equal(a, init_rows(7, 2, ids, 16, 0.5))
    assert np.array_equal(a[1:2], init_rows(7, 2, ids[1:2], 16, 0.5))  # per row, not per call
    assert not np.array_equal(a, init_rows(8, 2, ids, 16, 0.5))
    assert not np.array_equal(a, init_rows(7, 1, ids, 16, 0.5))
    big = init_rows(0, 0, np.arange(20_000), 8, 0.5)
    assert big.min() >= -0.5 and big.max() < 0.5
    assert abs(float(big.mean())) < 0.01 and abs(float(big.std()) - 0.5 / np.sqrt(3)) < 0.01
