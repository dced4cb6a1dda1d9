"""DLRM-DCN with MLPerf DLRM-v2's multi-hot features (``--preset mlperf-v2``) on the Redis tier."""

from tests.conftest import train_cli

FLAGS = ["--preset", "mlperf-v2", "--steps", "40", "--trainers", "2", "--shards", "2", "--batch-size", "256"]
FLAGS += ["--eval-samples", "2048", "--log-every", "10", "--checkpoint-every", "10", "--recovery", "log"]


def test_dcn_with_multi_hot_bags_recovers_a_killed_shard_bit_for_bit(tmp_path):
    """Two trainers train torchrec's DLRM_DCN on bags of up to 100 ids; a shard killed mid-run is
    restored from its checkpoint and its log, and the run ends on the failure-free run's rows."""
    base = train_cli(tmp_path / "base", *FLAGS)
    s = train_cli(tmp_path / "kill", *FLAGS, "--inject", "shard:1@step=25")
    (f,) = s["failures"]
    assert f["target"] == 1 and f["lost_updates"] == 0 and f["restored_from_step"] == 20
    assert s["embedding_digest"] == base["embedding_digest"]
    cfg = (tmp_path / "kill" / "config.toml").read_text()
    assert 'model = "dcn"' in cfg and "100" in cfg  # the preset's DCN and its 100-id bags
