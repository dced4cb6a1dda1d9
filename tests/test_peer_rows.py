"""Several trainers keep the rows of the shards the others write (``RowCache.hold_peer_rows``),
current by each step's summed row gradients, which every trainer receives anyway: no row another
trainer wrote is read back from Redis. The bits stay those of one trainer training the same
chunks, within the budget of ``--held-rows-mb``, and through a shard's failure. Real trainers over
gloo, real redis-servers."""

from pathlib import Path

import pytest

from tests.conftest import train_cli

FLAGS = [
    "--steps", "24", "--batch-size", "192", "--shards", "2", "--rows-per-table", "1000", "--eval-every", "0",
    "--embedding-dim", "8", "--no-keep-model", "--log-every", "6",
]  # fmt: skip


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return train_cli(tmp_path_factory.mktemp("peer-two") / "run", *FLAGS, "--trainers", "2")


def test_two_trainers_keep_the_others_rows_and_end_as_one_trainer_of_two_chunks(tmp_path, two):
    one = train_cli(tmp_path / "one", *FLAGS, "--trainers", "1", "--chunks", "2")
    assert two["embedding_digest"] == one["embedding_digest"]
    assert two["final_auc"] == one["final_auc"]
    peers = two["peer_rows"]
    # rank 0 read the rows of shard 1 (trainer 1's) from what it kept: most of its look-ups were served
    assert peers is not None and peers["lookups"] > 0 and peers["hits"] > 0.5 * peers["lookups"], peers
    assert one["peer_rows"] is None  # one trainer writes every shard: nothing of another's to keep


def test_the_budget_holds_with_two_trainers_and_a_cache_that_evicts(tmp_path, two):
    budget_mb = 0.25
    s = train_cli(tmp_path / "small", *FLAGS, "--trainers", "2", "--held-rows-mb", str(budget_mb))
    own, peers = s["row_cache"], s["peer_rows"]
    assert own["bytes"] + peers["bytes"] <= budget_mb * (1 << 20), (own, peers)
    assert peers["evicted"] > 0 and peers["capacity_rows"] < peers["table_rows"], peers  # it evicted: a real bound
    assert s["embedding_digest"] == two["embedding_digest"]  # rows evicted are read back, as of the step before


def test_a_shard_killed_under_log_while_two_trainers_train_through_ends_bit_identical(tmp_path, two):
    from recsys.results.verify import verify

    out: Path = tmp_path / "run"
    s = train_cli(
        out,
        *FLAGS,
        "--trainers",
        "2",
        "--recovery",
        "log",
        "--train-through",
        "--inject",
        "shard:1@step=10",
        "--inject",
        "slow-restore:1:2",
    )
    (f,) = [f for f in s["failures"] if f["kind"] == "shard"]
    assert (f["target"], f["step"], f["strategy"]) == (1, 10, "log"), f
    assert s["embedding_digest"] == two["embedding_digest"]
    assert s["peer_rows"]["hits"] > 0  # kept again once the shard rejoined
    assert verify(out)[0] == 0
