"""A run's trained model out of the tier: the final model every run keeps, ``recsys export`` to DCP,
proved by torchrec's own ``DLRM`` over its own ``EmbeddingBagCollection`` loading it."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection

import recsys
from data.batches import make_batch
from data.criteo import NUM_DENSE
from recovery.durable import layout
from recovery.durable.manifest import list_checkpoints
from recsys.model import table_configs
from recsys.results.exporter import ExportError, export, weight_key
from tests import procs

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(
    steps=40,
    trainers=1,
    shards=2,
    rows_per_table=3000,
    embedding_dim=8,
    batch_size=128,
    eval_samples=4096,
    eval_every=0,
    dense_arch=[16],
    over_arch=[16],
    save_model=True,
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small finished run on local shards (they stop with it), with final_model.pt to compare."""
    out = tmp_path_factory.mktemp("export") / "run"
    return recsys.train(recsys.configure(**SMALL, out=str(out)))


def torchrec_dlrm(cfg) -> DLRM:
    """torchrec's own DLRM over its own EmbeddingBagCollection, built from the run's shapes alone."""
    ebc = EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("cpu"))
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*cfg.model.dense_arch, cfg.model.embedding_dim],
        over_arch_layer_sizes=[*cfg.model.over_arch, 1],
    )


def eval_logits(model, cfg) -> tuple[np.ndarray, np.ndarray]:
    """The model's logits and the labels on the run's evaluation set (as the trainer reads it)."""
    from recsys.datasets import sources
    from recsys.trainer import EVAL_BATCH

    source = sources(cfg).eval
    n = cfg.data.eval_samples if source.num_rows is None else min(cfg.data.eval_samples, source.num_rows)
    logits, labels = [], []
    model.eval()
    with torch.no_grad():
        for lo in range(0, n, EVAL_BATCH):
            a = source.read(lo, min(EVAL_BATCH, n - lo))
            b = make_batch(a.dense, a.sparse, a.labels, bags=a.bags)
            logits.append(model(b.dense_features, b.sparse_features).squeeze(1).numpy())
            labels.append(b.labels.numpy())
    return np.concatenate(logits), np.concatenate(labels)


def tier_logits(run) -> np.ndarray:
    """The tier's own model (``StoreEmbeddingBagCollection`` over the run's final snapshots, the
    dense state the run ended with) on the same evaluation set."""
    from recsys.backends import open_store
    from recsys.model import store_model
    from recsys.results.exporter import dense_state, final_model, snapshot_servers
    from recsys.results.rundir import read_run_file

    cfg = run.config
    ns = read_run_file(run.path)["namespace"]
    ckpt = final_model(run.path, ns)
    dense, _ = dense_state(cfg, layout.dense_dcp_dir(ckpt.path), False)
    with snapshot_servers([ckpt.shard_file(s) for s in range(cfg.embeddings.shards)]) as urls:
        store = open_store(cfg, urls, ns, replicas=False)
        try:
            model, _ = store_model(cfg, store)
            missing, unexpected = model.load_state_dict(dense, strict=False)
            assert not unexpected and all("embedding_bags" in k for k in missing)
            return eval_logits(model, cfg)[0]
        finally:
            store.close()


def test_every_run_keeps_its_final_model_in_the_checkpoints_format(trained):
    s = trained.summary.raw
    kept = s["final_model"]
    assert kept["path"] == f"final/step_{40:010d}" and kept["bytes"] > 0 and kept["seconds"] > 0
    (ckpt,) = list_checkpoints(layout.final_dir(trained.path))
    assert ckpt.step == 40 and sorted(n for n in ckpt.files if n.endswith(".rdb")) == ["shard0.rdb", "shard1.rdb"]
    assert ckpt.verify() == sum((ckpt.path / n).stat().st_size for n in ckpt.files)  # SHA-256 as checkpoints
    assert any(n.startswith("dense/") for n in ckpt.files)


def test_export_loads_into_torchrecs_own_dlrm_with_the_runs_predictions_and_auc(trained, tmp_path):
    from recsys.results.metrics import evaluate_scores

    moved = tmp_path / "moved-run"  # the folder is read where it lies now
    shutil.copytree(trained.path, moved)
    stats = export(moved, tmp_path / "dcp", block_mb=0.05)  # several chunks per table
    assert stats.step == 40 and stats.tables == 26 and stats.rows == 26 * 3000
    assert stats.row_bytes == 26 * 3000 * 8 * 4 and stats.mb_per_s > 0

    cfg = trained.config
    model = torchrec_dlrm(cfg)
    sd = model.state_dict()
    before = sd[weight_key("t_cat_0")].clone()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))  # every key of torchrec's model, strictly
    after = model.state_dict()
    assert not torch.equal(before, after[weight_key("t_cat_0")])

    # every row equal to the run's own final rows (final_model.pt), trained or not, bit for bit
    final = torch.load(trained.path / layout.FINAL_MODEL, weights_only=True)
    for c in table_configs(cfg):
        assert torch.equal(after[weight_key(c.name)], final[f"embedding.{c.name}"]), c.name
    for k, v in after.items():
        if "embedding_bags" not in k:
            assert torch.equal(v, final[f"dense.{k}"]), k

    got, labels = eval_logits(model, cfg)
    want = tier_logits(trained)
    np.testing.assert_array_equal(got, want)  # the tier model's predictions, bit for bit
    scores = evaluate_scores(got, labels)
    assert scores["auc"] == pytest.approx(trained.summary.final_auc, abs=1e-12)
    assert scores["logloss"] == pytest.approx(trained.summary.final_logloss, abs=1e-9)
    assert 0.55 < scores["auc"] < 1.0


def test_export_with_the_optimizer_state(trained, tmp_path):
    stats = recsys.export(trained, tmp_path / "dcp", optimizer_state=True)  # the API
    meta = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata().state_dict_metadata
    rowwise = f"optim.state.{weight_key('t_cat_3')}.momentum1"
    assert meta[rowwise].size == torch.Size([3000])
    state = {rowwise: torch.zeros(3000), "optim.state.over_arch.model.1.weight.sum": torch.zeros(1, 16)}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"))
    # the row-wise Adagrad accumulator: zero for rows never trained, positive for those trained
    acc = state[rowwise].numpy()
    assert (acc >= 0).all() and 0 < (acc > 0).sum() < 3000
    assert float(state["optim.state.over_arch.model.1.weight.sum"].abs().sum()) > 0
    assert stats.row_bytes == 26 * 3000 * (8 + 1) * 4


def test_export_refuses_bad_input_in_one_line(trained, tmp_path):
    with pytest.raises(ExportError, match=r"export .*nowhere: no config.toml there"):
        export(tmp_path / "nowhere", tmp_path / "out")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("1")
    with pytest.raises(ExportError, match=r"--to .*full: the folder is not empty"):
        export(trained.path, full)
    copy = tmp_path / "copy"
    shutil.copytree(trained.path, copy)
    (ckpt,) = list_checkpoints(layout.final_dir(copy))
    with open(ckpt.shard_file(1), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff")
    with pytest.raises(ExportError, match=r"final model is damaged: .*shard1.rdb has SHA-256"):
        export(copy, tmp_path / "out2")
    shutil.rmtree(layout.final_dir(copy))
    with pytest.raises(ExportError, match=r"no final model in .*final.*--no-keep-model"):
        export(copy, tmp_path / "out3")


def test_no_keep_model_keeps_none_and_the_cli_exports(tmp_path):
    out = tmp_path / "run"
    flags = ["--steps", "10", "--trainers", "1", "--shards", "2", "--rows-per-table", "500", "--embedding-dim", "8"]
    flags += ["--batch-size", "64", "--eval-samples", "1024", "--no-keep-model", "--out", str(out)]
    proc = procs.run(["-m", "recsys", "train", *flags], timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not layout.final_dir(out).exists()
    assert "final_model" not in json.loads((out / "summary.json").read_text())
    proc = procs.run(["-m", "recsys", "export", str(out), "--to", str(tmp_path / "dcp")], timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "no final model in" in proc.stderr and "Traceback" not in proc.stderr


BOUNDED = r"""
import json, os, resource, sys
import torch  # imported before the baseline: what an export adds is measured
import torchrec  # noqa: F401
from recsys.results.exporter import export

def rss_mb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024

base = rss_mb("VmRSS:")
stats = export(sys.argv[1], sys.argv[2], block_mb=float(sys.argv[3]))
print(json.dumps({"base_mb": base, "peak_mb": rss_mb("VmHWM:"), "row_bytes": stats.row_bytes, "line": stats.line()}))
"""


def test_export_holds_a_block_not_the_tables(tmp_path):
    """26 tables x 200k rows x 16: 333 MB of rows, exported in 1 MB blocks by a process whose peak
    resident set grows by a fraction of that (the dense model, DCP's plan, a block as read)."""
    out = tmp_path / "run"
    recsys.train(
        recsys.configure(
            steps=5,
            trainers=1,
            shards=2,
            rows_per_table=200_000,
            embedding_dim=16,
            batch_size=256,
            eval_samples=1024,
            eval_every=0,
            out=str(out),
            digest_max_rows=0,
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(out), str(tmp_path / "dcp"), "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    rows_mb = got["row_bytes"] / (1 << 20)
    assert got["row_bytes"] == 26 * 200_000 * 16 * 4
    grew = got["peak_mb"] - got["base_mb"]
    print(got["line"], f"; RSS grew {grew:.0f} MB over {got['base_mb']:.0f} MB for {rows_mb:.0f} MB of rows")
    assert grew < rows_mb / 5, (grew, rows_mb)  # 32 MB here
    written = sum(p.stat().st_size for p in (tmp_path / "dcp").iterdir())
    assert written > got["row_bytes"]


def test_verify_checks_the_final_model(trained, tmp_path):
    from recsys.results.verify import verify

    code, line = verify(trained.path)  # no update log: the files' checksums, the final model's among them
    assert code == 0 and f"its final model (final/step_{40:010d}) verify (SHA-256)" in line, line

    out = tmp_path / "log"
    recsys.train(recsys.configure(**{**SMALL, "save_model": False}, recovery="log", checkpoint_every=15, out=str(out)))
    code, line = verify(out)  # rebuilt from checkpoint 30 and the logs, against the final snapshots' rows
    assert code == 0 and f"(the digest and final/step_{40:010d})" in line, line
    (ckpt,) = list_checkpoints(layout.final_dir(out))
    with open(ckpt.shard_file(0), "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01")
    said: list[str] = []
    code, line = verify(out, say=said.append)
    assert code == 1 and "1 durable file(s) were skipped" in line, line
    assert any(s.startswith("verify: skipped the final model:") and "shard0.rdb has SHA-256" in s for s in said), said


def dcp_tensors(folder: Path, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP folder (those whose keys start with ``skip`` left out), read back."""
    meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(m.size)) for k, m in meta.items() if hasattr(m, "size") and not k.startswith(skip)}
    dcp.load(sd, checkpoint_id=str(folder))
    return sd


def test_init_from_round_trip_export_init_export_gives_equal_tensors(trained, tmp_path):
    first = tmp_path / "first"
    export(trained.path, first, optimizer_state=True, block_mb=0.05)
    out = tmp_path / "again"
    flags = ["--steps", "2", "--trainers", "1", "--shards", "3", "--rows-per-table", "3000", "--embedding-dim", "8"]
    (tmp_path / "model.toml").write_text("[model]\ndense_arch = [16]\nover_arch = [16]\n")
    flags += ["--config", str(tmp_path / "model.toml"), "--batch-size", "128", "--eval-samples", "4096"]
    flags += ["--checkpoint-every", "100", "--init-from", str(first), "--out", str(out)]
    proc = procs.run(["-m", "recsys", "train", *flags], timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["init_from"]["rows"] == 26 * 3000 and s["init_from"]["bytes"] == 26 * 3000 * 9 * 4
    # the run started from the trained model, not from scratch: two steps keep its AUC
    assert abs(s["final_auc"] - trained.summary.final_auc) < 0.02, (s["final_auc"], trained.summary.final_auc)

    second = tmp_path / "second"
    export(out, second, optimizer_state=True, step=0)  # checkpoint 0: the tier as --init-from left it
    dense_optim = ("optim.state.dense_arch", "optim.state.over_arch", "optim.param_groups")  # not carried
    a, b = dcp_tensors(first, dense_optim), dcp_tensors(second, dense_optim)
    assert a.keys() == b.keys() and len(a) == 8 + 26 + 26  # dense, weights, row-wise Adagrad's accumulators
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    assert float(a[f"optim.state.{weight_key('t_cat_5')}.momentum1"].abs().sum()) > 0


def test_init_from_refuses_what_does_not_fit_in_one_line(trained, tmp_path):
    from recsys.config import ConfigError

    with pytest.raises(ConfigError, match=r"--init-from .*nowhere: not a folder"):
        recsys.train(recsys.configure(**SMALL, init_from=str(tmp_path / "nowhere"), out=str(tmp_path / "a")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"--init-from .*empty: not a torch.distributed.checkpoint folder"):
        recsys.train(recsys.configure(**SMALL, init_from=str(tmp_path / "empty"), out=str(tmp_path / "b")))
    export(trained.path, tmp_path / "dcp")
    key = weight_key("t_cat_0")
    with pytest.raises(ConfigError, match=rf"{key} is \[3000, 8\], the run's model has \[2000, 8\]"):
        recsys.train(
            recsys.configure(
                **{**SMALL, "rows_per_table": 2000}, init_from=str(tmp_path / "dcp"), out=str(tmp_path / "c")
            )
        )
    with pytest.raises(
        ConfigError, match=r"over_arch.model.0._mlp.0._linear.weight is \[16, 359\], the run.s model has \[32, 359\]"
    ):
        recsys.train(
            recsys.configure(**{**SMALL, "over_arch": [32]}, init_from=str(tmp_path / "dcp"), out=str(tmp_path / "d"))
        )


def test_export_from_a_live_tier_at_its_committed_step(tmp_path, redis_servers):
    """A run on servers the project did not start keeps its rows there: exported from them (at the
    step they stand at), the same tensors as from its final snapshots; a dense state of another
    step is refused in one line."""
    servers = redis_servers(2)
    out = tmp_path / "run"
    common = {k: v for k, v in SMALL.items() if k != "shards"}
    # max_restarts=0: the trainer runs in this process (a trainer forked from the pytest process after
    # the tests before it hung once in a futex with no CPU time: a lock held at the fork)
    cfg = recsys.configure(**common, redis=",".join(servers.urls), checkpoint_every=20, max_restarts=0, out=str(out))
    recsys.train(cfg)
    export(out, tmp_path / "snap", optimizer_state=True)
    stats = recsys.export(out, tmp_path / "live", optimizer_state=True, redis=",".join(servers.urls))
    assert stats.step == 40
    skip = ("optim.param_groups",)
    a, b = dcp_tensors(tmp_path / "snap", skip), dcp_tensors(tmp_path / "live", skip)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    with pytest.raises(
        ExportError,
        match=r"--redis: shard 0 is not at the exported step: it applied step 40, the dense state is of step 20",
    ):
        export(out, tmp_path / "old", step=20, redis=",".join(servers.urls))
    with pytest.raises(ExportError, match=r"--redis .*: 1 URL\(s\), the run has 2 shards"):
        export(out, tmp_path / "one", redis=servers.urls[0])


def test_a_dcn_run_exports_to_torchrecs_dlrm_dcn(tmp_path):
    from torchrec.models.dlrm import DLRM_DCN

    out = tmp_path / "dcn"
    run = recsys.train(recsys.configure(**{**SMALL, "save_model": False, "steps": 20}, model="dcn", out=str(out)))
    export(out, tmp_path / "dcp")
    cfg = run.config
    model = DLRM_DCN(
        embedding_bag_collection=EmbeddingBagCollection(tables=table_configs(cfg), device=torch.device("cpu")),
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*cfg.model.dense_arch, cfg.model.embedding_dim],
        over_arch_layer_sizes=[*cfg.model.over_arch, 1],
        dcn_num_layers=cfg.model.dcn_layers,
        dcn_low_rank_dim=cfg.model.dcn_low_rank,
    )
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "dcp"))
    got, _ = eval_logits(model, cfg)
    np.testing.assert_array_equal(got, tier_logits(run))
