import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from recsys.cli import build_parser, resolve
from recsys.config import ConfigError, DataConfig, EmbeddingConfig, ModelConfig, OptimConfig, RunConfig, TrainConfig
from recsys.launch import run
from tests import procs

ROOT = Path(__file__).resolve().parents[1]


def small_config(out: Path, **train) -> RunConfig:
    return RunConfig(
        data=DataConfig(rows_per_table=500, eval_samples=2048),
        model=ModelConfig(embedding_dim=8, dense_arch=[16], over_arch=[16]),
        embeddings=EmbeddingConfig(shards=3),
        optim=OptimConfig(optimizer="adagrad", lr=0.05),
        train=TrainConfig(
            **{
                "steps": 30,
                "batch_size": 64,
                "trainers": 2,
                "eval_every": 0,
                "out": str(out),
                "save_model": True,
                **train,
            }
        ),
    )


def test_two_trainers_three_shards_equal_local_torchrec_with_the_global_batch(tmp_path):
    dist_cfg = small_config(tmp_path / "dist")
    local_cfg = small_config(tmp_path / "local", trainers=1)
    local_cfg.embeddings.embeddings = "local"
    # the local run first: its tensor ops make this process spawn the trainers of the other (the path of
    # recsys.train called after torch has run; the suite's other in-process runs fork theirs)
    s_local = run(RunConfig.from_dict(local_cfg.to_dict()))
    s_dist = run(dist_cfg)
    assert s_dist["steps_completed"] == s_local["steps_completed"] == 30
    a = torch.load(tmp_path / "dist" / "final_model.pt", weights_only=True)
    b = torch.load(tmp_path / "local" / "final_model.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert sum(k.startswith("embedding.") for k in a) == 26 and sum(k.startswith("dense.") for k in a) >= 6
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, worst
    # and training really changed the model (not two untouched copies)
    init = small_config(tmp_path / "x")
    from recsys.model import local_model

    m0, ebc0 = local_model(init)
    moved = float((ebc0.embedding_bags["t_cat_0"].weight - a["embedding.t_cat_0"]).abs().max())
    assert moved > 1e-3
    assert abs(s_dist["final_auc"] - s_local["final_auc"]) < 1e-4


def test_cli_run_writes_all_outputs(tmp_path):
    out = tmp_path / "run"
    proc = procs.run(
        [
            "-m",
            "recsys",
            "train",
            "--steps",
            "20",
            "--trainers",
            "2",
            "--batch-size",
            "128",
            "--rows-per-table",
            "1000",
            "--embedding-dim",
            "8",
            "--eval-every",
            "10",
            "--eval-samples",
            "2048",
            "--log-every",
            "5",
            "--shards",
            "2",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "final AUC" in proc.stdout and str(out) in proc.stdout
    cfg = tomllib.loads((out / "config.toml").read_text())
    assert cfg["train"]["steps"] == 20 and cfg["embeddings"]["shards"] == 2 and cfg["train"]["trainers"] == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [5, 10, 15, 20]
    assert [r["step"] for r in records if "auc" in r] == [10, 20]
    summary = json.loads((out / "summary.json").read_text())
    for key in (
        "steps_completed",
        "samples_trained",
        "wall_seconds",
        "throughput_samples_per_s",
        "final_auc",
        "final_logloss",
        "ceiling_auc",
        "failures",
        "embedding_digest",
    ):
        assert key in summary, key
    assert summary["steps_completed"] == 20 and summary["samples_trained"] == 20 * 128
    assert summary["throughput_after_warmup_samples_per_s"] > 0  # steps 11-20, after the warm-up
    # the training thread over those steps: on a CPU, runnable, blocked, adding up to its wall time
    thread = summary["training_thread_ms"]
    assert thread["on_cpu"] > 0 and thread["runnable"] >= 0 and thread["blocked"] >= 0
    assert (
        abs(thread["on_cpu"] + thread["runnable"] + thread["blocked"] - thread["wall"]) < 0.05 + 0.01 * thread["wall"]
    )
    assert thread["wall"] == pytest.approx(1000 * 128 / summary["throughput_after_warmup_samples_per_s"], rel=0.2)
    # the CPU of those steps by kind: the training thread's is the one above; gloo moved the trainers'
    # collectives; the 2 local servers served the rows
    cpu = summary["cpu_ms"]
    assert cpu["training"] == pytest.approx(thread["on_cpu"], abs=0.05, rel=0.02)
    assert cpu["gloo"] > 0 and cpu["servers"] > 0 and cpu["helpers"] > 0
    assert summary["failures"] == [] and len(summary["embedding_digest"]) == 64
    assert 0.5 < summary["ceiling_auc"] < 1 and 0 < summary["final_auc"] < 1
    assert (out / "plots" / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-size", "7", "--trainers", "2"], "batch_size=7: must be a multiple of trainers=2"),
        (["--optimizer", "adamw"], "optimizer='adamw': must be sgd, adagrad, adagrad-exact or adam"),
        (
            ["--embeddings", "local", "--optimizer", "adam"],
            "optimizer='adam': the local fused engine has no Adam on the host",
        ),
        (["--data", "criteo-kaggle:/nonexistent/train.txt"], "path '/nonexistent/train.txt' does not exist"),
        (["--steps", "ten"], "--steps 'ten': not a valid int"),
        (["--embeddings", "local", "--trainers", "2"], "trainers=2: the local torchrec baseline runs in one process"),
        (["--write-every", "-1"], "write_every=-1: must be >= 1"),
        (["--kernels", "tbe"], "kernels='tbe': must be fbgemm or torch"),
        (["--prefetch", "--no-prefetch"], "--prefetch and --no-prefetch: give one"),
        (["--write-every", "8", "--no-write-behind"], "write_every=8: windows are written behind: needs"),
    ],
)
def test_bad_config_exits_with_one_line_and_no_traceback(tmp_path, flags, message):
    proc = procs.run(["-m", "recsys", "train", "--out", str(tmp_path / "r"), *flags], timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "r").exists()  # nothing started


def test_toml_config_round_trip_and_flag_override(tmp_path):
    cfg = small_config(tmp_path)
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    assert RunConfig.from_toml(path) == cfg
    args = build_parser().parse_args(["train", "--config", str(path), "--lr", "0.5", "--no-prefetch"])
    got = resolve(args)
    assert got.optim.lr == 0.5 and got.embeddings.prefetch is False and got.train.steps == 30
    assert resolve(build_parser().parse_args(["train", "--config", str(path), "--prefetch"])).embeddings.prefetch
    assert RunConfig().embeddings.prefetch is False  # off by default: it slowed every measured configuration
    path.write_text("[train]\nstepz = 3\n")
    with pytest.raises(ConfigError, match=r"c.toml: unknown field\(s\) \['stepz'\] in \[train\]"):
        RunConfig.from_toml(path)
    # a value of the wrong type is named with its section and key, before anything compares it
    for text, message in [
        ('[recovery]\nshard_restart_timeout = "60"\n', "[recovery] shard_restart_timeout = '60': must be a number"),
        ("[train]\nsteps = 10.5\n", "[train] steps = 10.5: must be an integer"),
        ('[model]\ndense_arch = [64, "a"]\n', "[model] dense_arch = [64, 'a']: must be a list of integers"),
        ("[embeddings]\nprefetch = 1\n", "[embeddings] prefetch = 1: must be true or false"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            RunConfig.from_toml(path)
        assert str(e.value) == f"{path}: {message}"


def test_torchrun_joins_shards_that_already_run(tmp_path):
    import os

    from embeddings import LocalShards
    from embeddings.servers.launcher import free_port
    from tests.conftest import track

    with LocalShards(2) as sh:
        track(sh)
        env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{free_port()}",
                "--rdzv-id",
                "t1",
                "-m",
                "recsys",
                "train",
                "--redis",
                ",".join(sh.urls),
                "--steps",
                "10",
                "--rows-per-table",
                "1000",
                "--batch-size",
                "64",
                "--eval-every",
                "0",
                "--eval-samples",
                "1024",
                "--out",
                str(tmp_path / "r"),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        summary = json.loads((tmp_path / "r" / "summary.json").read_text())
        assert summary["trainers"] == 2 and summary["shards"] == 2 and summary["steps_completed"] == 10
        import redis

        keys = sum(redis.Redis.from_url(u).dbsize() for u in sh.urls)
        assert keys > 100  # the rows live in the shards we started


def test_tensorboard_events_hold_the_metrics_and_each_failure_at_its_step(tmp_path):
    """``--tensorboard``: metrics.jsonl's numbers as scalars at their steps, each failure's recovery
    time and losses at its step, beside metrics.jsonl."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.conftest import train_cli

    out = tmp_path / "run"
    flags = ["--steps", "30", "--trainers", "1", "--shards", "2", "--rows-per-table", "1000", "--embedding-dim", "8"]
    flags += ["--batch-size", "128", "--log-every", "5", "--eval-samples", "2048", "--recovery", "partial"]
    flags += ["--write-every", "1"]  # the failure is seen at its own step, not at its window's end
    s = train_cli(out, *flags, "--checkpoint-every", "10", "--inject", "shard:1@step=14", "--tensorboard")
    ea = EventAccumulator(str(out / "tensorboard"))
    ea.Reload()
    losses = {e.step: e.value for e in ea.Scalars("train/loss")}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx({r["step"]: r["loss"] for r in lines if "loss" in r})
    (f,) = s["failures"]
    (lost,) = ea.Scalars("failures/lost_updates")
    assert lost.step == f["step"] == 14 and lost.value == f["lost_updates"] > 0
