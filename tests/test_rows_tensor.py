"""The module's ``state_dict()`` is torchrec's at any size: ``embedding_bags.<table>.weight`` entries
that read their rows on demand (``RowsTensor``), saved by DCP a block at a time, loaded back into
the store, read by torchrec's own ``DLRM`` over its own ``EmbeddingBagCollection``."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embeddings.bags import table_state as module_mod
from embeddings.bags.module import RowsTensor, StoreEmbeddingBagCollection
from tests.test_ebc_equivalence import BATCH, make_batch, make_store
from tests.test_ebc_surface import Tripwire, dlrm_over, one_dim_configs

ROOT = Path(__file__).resolve().parents[1]


def torchrec_dlrm(configs) -> DLRM:
    torch.manual_seed(1)  # other dense weights than the tier model's: the load must bring them
    return DLRM(
        embedding_bag_collection=EmbeddingBagCollection(one_dim_configs(), device=torch.device("cpu")),
        dense_in_features=3,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[4, 1],
    )


def trained_rows(store, configs, seed: int = 5) -> None:
    """Some rows of every table moved off their initial values (the others stay lazily initial)."""
    rng = np.random.default_rng(seed)
    for c in configs:
        ids = rng.choice(c.num_embeddings, size=c.num_embeddings // 3, replace=False)
        rows = store.read_rows(c.name, ids)
        rows += rng.normal(size=rows.shape).astype(np.float32)
        store.write_rows(c.name, ids, rows)


def rows_of(store, configs) -> dict[str, np.ndarray]:
    return {c.name: store.read_rows(c.name, np.arange(c.num_embeddings)) for c in configs}


def test_dcp_save_of_a_dlrm_over_the_tier_loads_into_torchrecs_dlrm_and_back_into_a_store(tmp_path, monkeypatch):
    monkeypatch.setattr(module_mod, "ROWS_BLOCK_BYTES", 256)  # several blocks a table
    configs = one_dim_configs()
    store = make_store(configs, "adagrad")
    trained_rows(store, configs)
    ours, _ = dlrm_over(configs, store)
    sd = ours.state_dict()
    for c in configs:
        w = sd[f"sparse_arch.embedding_bag_collection.embedding_bags.{c.name}.weight"]
        assert isinstance(w, RowsTensor) and tuple(w.shape) == (c.num_embeddings, c.embedding_dim)
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt"))
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    key = f"sparse_arch.embedding_bag_collection.embedding_bags.{configs[0].name}.weight"
    assert len(meta[key].chunks) > 1  # written a block at a time

    ref = torchrec_dlrm(configs)
    rsd = ref.state_dict()
    dcp.load(rsd, checkpoint_id=str(tmp_path / "ckpt"))  # torchrec's keys, every one
    want = rows_of(store, configs)
    for c in configs:
        got = ref.sparse_arch.embedding_bag_collection.embedding_bags[c.name].weight.detach().numpy()
        assert np.array_equal(got, want[c.name][:, : c.embedding_dim]), c.name
    kjt = make_batch(configs, np.random.default_rng(2))
    dense = torch.randn(BATCH, 3)
    with torch.no_grad():
        torch.testing.assert_close(ref(dense, kjt), ours(dense, kjt), rtol=0, atol=1e-6)

    # back into another store: DCP writes each block through the weight (its copy_), state kept
    other = make_store(configs, "adagrad", seed=99)
    twin, _ = dlrm_over(configs, other)
    before = rows_of(other, configs)
    tsd = twin.state_dict()
    dcp.load(tsd, checkpoint_id=str(tmp_path / "ckpt"))
    after = rows_of(other, configs)
    for c in configs:
        d = c.embedding_dim
        assert np.array_equal(after[c.name][:, :d], want[c.name][:, :d]), c.name
        assert np.array_equal(after[c.name][:, d:], before[c.name][:, d:])  # the row optimizer's state kept


def test_load_state_dict_writes_torchrecs_weights_to_the_store_and_a_modules_own_moves_nothing():
    configs = one_dim_configs()
    ref = torchrec_dlrm(configs)
    store = make_store(configs, "sgd")
    ours, ebc = dlrm_over(configs, store)
    ours.load_state_dict(ref.state_dict())  # strict: torchrec's keys are this module's
    for c in configs:
        want = ref.sparse_arch.embedding_bag_collection.embedding_bags[c.name].weight.detach().numpy()
        assert np.array_equal(store.read_rows(c.name, np.arange(c.num_embeddings)), want)
    w = ebc.embedding_bags[configs[0].name].weight
    w[2:4].copy_(torch.full((2, configs[0].embedding_dim), 7.0))  # a view's copy_ writes those rows alone
    assert (store.read_rows(configs[0].name, np.array([1, 2, 3, 4]))[:, 0] == [w[1, 0], 7, 7, w[4, 0]]).all()
    before = rows_of(store, configs)
    ours.load_state_dict(ours.state_dict())  # its own RowsTensors: nothing read, nothing written
    assert all(np.array_equal(before[k], v) for k, v in rows_of(store, configs).items())


def test_a_rows_tensor_reads_only_what_an_op_needs(monkeypatch):
    configs = one_dim_configs()
    store = make_store(configs, "sgd")
    name = configs[1].name
    w = RowsTensor.of(store, name)
    reads: list[int] = []
    real = store.read_rows
    monkeypatch.setattr(store, "read_rows", lambda table, ids: reads.append(len(ids)) or real(table, ids))
    part = w[3:7, 1:5].detach()
    assert isinstance(part, RowsTensor) and tuple(part.shape) == (4, 4) and reads == []
    assert torch.equal(part * 1, torch.from_numpy(real(name, np.arange(3, 7))[:, 1:5]))
    assert reads == [4]


def test_on_the_meta_device_with_a_store_nothing_is_read_and_an_empty_collection_is_refused_by_dlrm():
    configs = one_dim_configs()
    ebc = StoreEmbeddingBagCollection(configs, Tripwire(configs), device="meta")
    out = ebc(make_batch(configs, np.random.default_rng(0)))
    assert out.values().device.type == "meta" and out.values().shape == (BATCH, 8 * len(configs))
    sd = ebc.state_dict()  # the weights' entries read nothing (the tripwire store would raise)
    assert all(tuple(sd[f"embedding_bags.{c.name}.weight"].shape) == (c.num_embeddings, 8) for c in configs)

    empty = StoreEmbeddingBagCollection([], make_store(configs, "sgd"))
    assert empty.embedding_bag_configs() == [] and empty.state_dict() == {}
    errors = []
    for collection in (empty, EmbeddingBagCollection([])):
        with pytest.raises(Exception) as e:
            DLRM(
                embedding_bag_collection=collection,
                dense_in_features=3,
                dense_arch_layer_sizes=[8],
                over_arch_layer_sizes=[4, 1],
            )
        errors.append((type(e.value), str(e.value)))
    assert errors[0] == errors[1], errors


BOUNDED = r"""
import json, sys
import numpy as np, torch
import torch.distributed.checkpoint as dcp
from torchrec.models.dlrm import DLRM
from embeddings.bags import table_state as m
from embeddings.servers.launcher import LocalShards
from recsys.backends import open_store
from recsys.config import RunConfig, DataConfig, ModelConfig
from recsys.model import store_model

m.ROWS_BLOCK_BYTES = 1 << 20
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
cfg = RunConfig(data=DataConfig(rows_per_table=200_000), model=ModelConfig(embedding_dim=16))
with LocalShards(2) as shards:
    store = open_store(cfg, shards.urls, "rows-tensor-bounded", replicas=False)
    model, _ = store_model(cfg, store)
    base = rss("VmRSS:")
    dcp.save(model.state_dict(), checkpoint_id=sys.argv[1])
    store.close()
print(json.dumps({"base_mb": base, "peak_mb": rss("VmHWM:")}))
"""


def test_dcp_save_of_a_tier_dlrm_holds_blocks_not_tables(tmp_path):
    """26 x 200k x 16 rows (333 MB) on two Redis shards, saved by DCP's default writer from the model's
    own state_dict: the process grows by a fraction of the rows (the default writer keeps each
    table's last block until its file is done: 26 blocks of 1 MB here)."""
    proc = subprocess.run(
        [sys.executable, "-c", BOUNDED, str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    rows_mb = 26 * 200_000 * 16 * 4 / (1 << 20)
    grew = got["peak_mb"] - got["base_mb"]
    print(
        f"DCP save of the tier's DLRM: RSS grew {grew:.0f} MB over {got['base_mb']:.0f} MB for {rows_mb:.0f} MB of rows"
    )
    assert grew < rows_mb / 4, (grew, rows_mb)
    meta = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata
    w = meta["sparse_arch.embedding_bag_collection.embedding_bags.t_cat_0.weight"]
    assert tuple(w.size) == (200_000, 16) and len(w.chunks) == 13


def test_the_weights_device_is_torchrecs_on_meta_by_argument_or_by_default():
    configs = one_dim_configs()
    name = configs[0].name
    for ebc in (StoreEmbeddingBagCollection(configs, None, device=torch.device("meta")), None):
        if ebc is None:
            with torch.device("meta"):  # the default device, as torchrec's module takes it
                ebc = StoreEmbeddingBagCollection(one_dim_configs(), None)
        assert ebc.device.type == "meta" and ebc.embedding_bags[name].weight.device.type == "meta"
        assert tuple(ebc.state_dict()[f"embedding_bags.{name}.weight"].shape) == (configs[0].num_embeddings, 8)
    on_host = StoreEmbeddingBagCollection(configs, make_store(configs, "sgd"))
    assert on_host.device.type == "cpu" and on_host.embedding_bags[name].weight.device.type == "cpu"
