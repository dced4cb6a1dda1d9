"""StoreEmbeddingBagCollection as PyTorch and torchrec tools see it: construction (duplicates,
``device=``, ``meta``), ``state_dict``/``load_state_dict`` (a small entry per table saying where its
rows are), ``parameters()`` (the tables are not in it; unapplied row gradients warn), and the one
clear refusal of FX tracing, TorchScript and ``torch.export``."""

from __future__ import annotations

import io
import warnings

import numpy as np
import pytest
import torch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from embeddings import SGD, InProcessStore, TableSet
from embeddings.bags.module import NotTraceableError, StoreEmbeddingBagCollection
from tests.test_ebc_equivalence import BATCH, CASES, make_batch, make_store, projection, reference
from tests.test_module import loss_of

MIXED = CASES["mixed"][0]
WIDTH = 64  # MIXED's output: f0, fx@t0 of 8, f1 of 4, f2, f3 of 16, fx@t3 of 4, f4 of 8


class Net(torch.nn.Module):
    """A model over tables of several dims (DLRM takes one dim)."""

    def __init__(self, ebc) -> None:
        super().__init__()
        self.sparse = ebc
        self.top = torch.nn.Linear(WIDTH, 1)

    def forward(self, kjt):
        return self.top(self.sparse(kjt).values())


def net_over(configs, store, **kw):
    ebc = StoreEmbeddingBagCollection(configs, store, **kw)
    torch.manual_seed(0)
    return Net(ebc), ebc


def dlrm_over(configs, store, **kw):
    ebc = StoreEmbeddingBagCollection(configs, store, **kw)
    torch.manual_seed(0)
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=3,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[4, 1],
    )
    return model, ebc


def one_dim_configs():
    return CASES["dlrm"][0]()


class Tripwire:
    """A store whose rows must not be touched (its configuration may be read: tables, optimizer, seed)."""

    def __init__(self, configs) -> None:
        self.tables = TableSet.from_torchrec(configs)
        self.optimizer, self.seed, self.namespace = SGD(), 0, "meta-test"

    def __getattr__(self, name):
        raise AssertionError(f"the store was used: {name}")


# -- construction -----------------------------------------------------------------------------


def test_duplicate_tables_refused_like_torchrec():
    configs = one_dim_configs()
    dup = [configs[0], configs[1], configs[0]]
    with pytest.raises(ValueError) as theirs:
        EmbeddingBagCollection(dup)
    with pytest.raises(ValueError) as ours:
        StoreEmbeddingBagCollection(dup, make_store(configs, "sgd"))
    assert str(ours.value) == str(theirs.value) == "Duplicate table name t0"


def test_refusals_at_construction():
    configs = one_dim_configs()
    store = make_store(configs, "sgd")
    half = [EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=40, data_type=DataType.FP16)]
    with pytest.raises(ValueError, match="data_type"):
        StoreEmbeddingBagCollection(half, store)
    with pytest.raises(ValueError, match="a store is required"):
        StoreEmbeddingBagCollection(configs, None)


def test_weighted_mean_fails_at_forward_as_torchrec_does():
    configs = [
        EmbeddingBagConfig(name="t0", embedding_dim=4, num_embeddings=9, feature_names=["f0"], pooling=PoolingType.MEAN)
    ]
    store = make_store(configs, "sgd")
    kjt = make_batch(configs, np.random.default_rng(0), weighted=True)
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=True)
    ref = EmbeddingBagCollection(configs, is_weighted=True)
    assert ours.is_weighted() and ref.is_weighted()
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        ref(kjt)
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        ours(kjt)


def test_device_keyword_and_property():
    configs = MIXED()
    store = make_store(configs, "sgd")
    for device in (None, "cpu", torch.device("cpu")):
        ebc = StoreEmbeddingBagCollection(configs, store, device=device)
        assert ebc.device == torch.device("cpu")
        assert ebc(make_batch(configs, np.random.default_rng(0))).values().device == torch.device("cpu")
    ebc = StoreEmbeddingBagCollection(configs, store)
    assert ebc.to("meta").device.type == "meta"  # follows module.to(...)
    assert ebc.to_empty(device="cpu").device == torch.device("cpu")
    assert ebc(make_batch(configs, np.random.default_rng(0))).values().shape == (BATCH, WIDTH)


def test_meta_builds_and_runs_without_the_store():
    """As torchrec's planners build modules: on ``meta`` no store is needed and none is read;
    forward gives meta tensors of the output's shape."""
    configs = MIXED()
    kjt = make_batch(configs, np.random.default_rng(0))
    ref = EmbeddingBagCollection(MIXED(), device=torch.device("meta"))
    for store in (None, Tripwire(configs)):
        ebc = StoreEmbeddingBagCollection(configs, store, device="meta")
        assert ebc.device.type == "meta"
        out = ebc(kjt)
        assert out.values().device.type == "meta"
        assert out.values().shape == ref(kjt).values().shape == (BATCH, WIDTH)
        assert out.keys() == ref(kjt).keys() and out.length_per_key() == ref(kjt).length_per_key()
        assert "embedding_bags.t0._extra_state" in ebc.state_dict()
    stranded = StoreEmbeddingBagCollection(configs, None, device="meta").to_empty(device="cpu")
    with pytest.raises(ValueError, match="without a store"):
        stranded(kjt)


# -- state_dict -----------------------------------------------------------------------------------


def test_state_dict_says_where_the_tables_are():
    configs = MIXED()
    store = make_store(configs, "adagrad")
    model, ebc = net_over(configs, store)
    sd = model.state_dict()
    entries = {k: v for k, v in sd.items() if k.endswith("_extra_state")}
    prefix = "sparse.embedding_bags."
    assert sorted(entries) == sorted(f"{prefix}{c.name}._extra_state" for c in configs)
    e = entries[f"{prefix}t2._extra_state"]
    assert e["table"] == "t2" and (e["num_rows"], e["dim"]) == (20, 16) and e["pooling"] == "SUM"
    assert (e["store"], e["namespace"], e["optimizer"], e["seed"]) == ("InProcessStore", None, "RowWiseAdagrad", 11)
    # the trainer's dense checkpoints leave out keys with "embedding_bags" (as the fused engine's weights)
    assert all("embedding_bags" in k for k in entries)
    # plain values: a weights-only load reads them back, and a load puts them back without a word
    buf = io.BytesIO()
    torch.save(sd, buf)
    loaded = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    twin, _ = net_over(MIXED(), store)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        twin.load_state_dict(loaded)
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, twin.state_dict()[k])


def test_load_state_dict_moves_no_rows():
    configs = MIXED()
    model, _ = net_over(configs, make_store(configs, "sgd"))
    sd = model.state_dict()
    elsewhere = InProcessStore(TableSet.from_torchrec(MIXED()), SGD(lr=0.1))
    elsewhere.namespace = "other-run"
    other, _ = net_over(MIXED(), elsewhere)
    with pytest.warns(UserWarning, match="moves no rows.*namespace None.*'other-run'"):
        other.load_state_dict(sd)
    shrunk = [
        EmbeddingBagConfig(
            name=c.name,
            embedding_dim=c.embedding_dim,
            num_embeddings=c.num_embeddings,
            feature_names=c.feature_names,
            pooling=c.pooling,
        )
        for c in MIXED()
    ]
    shrunk[1] = EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=29, feature_names=["f1"])
    small, _ = net_over(shrunk, InProcessStore(TableSet.from_torchrec(shrunk), SGD(lr=0.1)))
    with pytest.raises(ValueError, match="table 't1'.*not this table"):
        small.load_state_dict(sd)


def test_distributed_checkpoint_state_dict_round_trip():
    """The trainer's dense state goes through torch.distributed.checkpoint's get/set_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    configs = MIXED()
    model, _ = net_over(configs, make_store(configs, "sgd"))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    msd, osd = get_state_dict(model, opt)
    assert any(k.endswith("embedding_bags.t0._extra_state") for k in msd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)


# -- parameters() ---------------------------------------------------------------------------------


def test_tables_are_not_parameters_and_unapplied_gradients_warn():
    """``model.parameters()`` is the dense part alone; a loop that never applies the row gradients
    (an optimizer over ``model.parameters()`` and nothing else) is told once."""
    configs = one_dim_configs()
    store = make_store(configs, "sgd")
    model, ebc = dlrm_over(configs, store)
    assert list(ebc.parameters()) == [] and list(ebc.buffers()) == []
    assert all("embedding_bag" not in n for n, _ in model.named_parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    dense = torch.randn(BATCH, 3)

    def step(apply: bool) -> None:
        logits = model(dense, make_batch(configs, rng)).squeeze(1)
        opt.zero_grad()
        logits.square().mean().backward()
        opt.step()
        if apply:
            ebc.apply_gradients()

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(12):
            step(apply=True)  # the rows are trained: no warning
    with pytest.warns(UserWarning, match="never applied.*not in model.parameters"):
        for _ in range(10):
            step(apply=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step(apply=False)  # once
    ebc.zero_grad()


def test_pop_key_grads_by_dim():
    configs = MIXED()
    store = make_store(configs, "sgd")
    ebc = StoreEmbeddingBagCollection(configs, store)
    out = ebc(make_batch(configs, np.random.default_rng(0)))
    loss_of(out, projection(configs)).backward()
    with pytest.raises(ValueError, match="several embedding dims.*pop_key_grads_by_dim"):
        ebc.pop_key_grads()
    out = ebc(make_batch(configs, np.random.default_rng(0)))
    loss_of(out, projection(configs)).backward()
    got = ebc.pop_key_grads_by_dim()  # both forwards' (the refused pop forgot nothing)
    assert sorted(got) == [4, 8, 16]
    dims = {store.tables.index(c.name): c.embedding_dim for c in configs}
    for dim, (keys, grads) in got.items():
        assert grads.shape == (len(keys), dim)
        assert {dims[t] for t in (keys >> 40).tolist()} == {dim}
    assert ebc.pop_key_grads_by_dim() == {}


def test_loss_over_some_features_updates_their_tables_only():
    """Tables whose output the loss does not use get no gradient: no update (as torch's optimizers
    skip a parameter without one)."""
    configs = MIXED()
    store = make_store(configs, "adagrad")
    ebc = StoreEmbeddingBagCollection(configs, store)
    ref = reference(configs, False, store)
    from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad

    ref_opt = TorchrecRowWiseAdagrad(ref.parameters(), lr=0.05)
    before = {c.name: store.read_rows(c.name, np.arange(c.num_embeddings)) for c in configs}
    kjt = make_batch(configs, np.random.default_rng(2))
    for module, is_ref in ((ebc, False), (ref, True)):
        out = module(kjt)
        (out["f1"].square().sum() + out["f2"].square().sum()).backward()  # tables t1 and t2 only
        if is_ref:
            ref_opt.step()
        else:
            module.apply_gradients()
    for c in configs:
        after = store.read_rows(c.name, np.arange(c.num_embeddings))
        want = ref.embedding_bags[c.name].weight.detach().numpy()
        assert np.abs(after[:, : c.embedding_dim] - want).max() < 1e-5
        assert np.array_equal(after, before[c.name]) == (c.name not in ("t1", "t2"))


# -- what it refuses ------------------------------------------------------------------------------


def test_tracing_scripting_and_export_refused_with_one_error():
    configs = one_dim_configs()
    model, ebc = dlrm_over(configs, make_store(configs, "sgd"))
    kjt = make_batch(configs, np.random.default_rng(0), single=True)
    dense = torch.randn(BATCH, 3)
    with pytest.raises(NotTraceableError, match="cannot be traced by torch.fx"):
        torch.fx.symbolic_trace(model)
    with pytest.raises(NotTraceableError, match="cannot be scripted by torch.jit.script"):
        torch.jit.script(model)
    with pytest.raises(NotTraceableError, match="cannot be exported by torch.export"):
        torch.export.export(model, (dense, kjt), strict=False)
    # strict export: dynamo reports the same error as the exception it observed
    with pytest.raises(Exception, match="NotTraceableError.*cannot be exported by torch.export"):
        torch.export.export(model, (dense, kjt), strict=True)
    with pytest.raises(NotTraceableError, match="cannot be traced by torch.jit.trace"):
        torch.jit.trace(lambda d: ebc(kjt).values() + d.sum(), (dense,))


# -- torchrec's weights ----------------------------------------------------------------------------


def test_weights_within_the_budget_load_into_torchrec_and_back_with_the_rows_equal():
    """``weights_mb``: the state dict holds torchrec's keys alone, which a torchrec
    ``EmbeddingBagCollection`` loads strictly, and ours loads a torchrec module's (its rows written
    to the store, each row's optimizer state kept); outputs and rows equal both ways."""
    configs = MIXED()
    store = make_store(configs, "adagrad")
    ours = StoreEmbeddingBagCollection(configs, store, weights_mb=1)
    proj = projection(configs)
    rng = np.random.default_rng(2)
    for _ in range(3):  # rows and accumulators away from their initial values
        loss_of(ours(make_batch(configs, rng)), proj).backward()
        ours.apply_gradients()
    ref = EmbeddingBagCollection(MIXED())
    sd = ours.state_dict()
    assert sorted(sd) == sorted(ref.state_dict())  # embedding_bags.<table>.weight, nothing else
    ref.load_state_dict(sd)
    for c in configs:
        want = store.read_rows(c.name, np.arange(c.num_embeddings))[:, : c.embedding_dim]
        assert torch.equal(ref.embedding_bags[c.name].weight.detach(), torch.from_numpy(want))
        assert torch.equal(ours.embedding_bags[c.name].weight, torch.from_numpy(want))
    kjt = make_batch(configs, rng)
    torch.testing.assert_close(ours(kjt).values(), ref(kjt).values(), rtol=0, atol=1e-6)

    # back: torchrec's rows into ours; the accumulators the store holds stay
    with torch.no_grad():
        for bag in ref.embedding_bags.values():
            bag.weight.normal_()
    state_before = {c.name: store.read_rows(c.name, np.arange(c.num_embeddings))[:, c.embedding_dim :] for c in configs}
    ours.load_state_dict(ref.state_dict())
    for c in configs:
        rows = store.read_rows(c.name, np.arange(c.num_embeddings))
        assert np.array_equal(rows[:, : c.embedding_dim], ref.embedding_bags[c.name].weight.detach().numpy())
        assert np.array_equal(rows[:, c.embedding_dim :], state_before[c.name]) and state_before[c.name].any()
    torch.testing.assert_close(ours(kjt).values(), ref(kjt).values(), rtol=0, atol=1e-6)


def test_a_weight_over_the_budget_reads_its_rows_on_demand_and_the_default_gives_every_table_so():
    from embeddings.bags.module import RowsTensor

    configs = MIXED()
    store = make_store(configs, "sgd")
    small = StoreEmbeddingBagCollection(configs, store, weights_mb=1e-3)  # t1, t3, t4 fit; t0, t2 do not
    sizes = {c.name: c.num_embeddings * c.embedding_dim * 4 / 2**20 for c in configs}
    big = next(n for n, mb in sizes.items() if mb > 1e-3)
    lazy = small.embedding_bags[big].weight
    assert isinstance(lazy, RowsTensor) and "read on demand" in repr(lazy)
    spec = store.tables.spec(big)
    want = store.read_rows(big, np.arange(spec.num_rows))[:, : spec.dim]
    assert tuple(lazy.shape) == want.shape and torch.equal(lazy.materialize(), torch.from_numpy(want))
    assert 0 < sum(mb <= 1e-3 for mb in sizes.values()) < len(sizes)
    sd = small.state_dict()
    for name, mb in sizes.items():
        key = f"embedding_bags.{name}"
        assert isinstance(sd[f"{key}.weight"], RowsTensor) == (mb > 1e-3)  # torchrec's key either way
        assert (f"{key}._extra_state" in sd) == (mb > 1e-3)
    default = StoreEmbeddingBagCollection(configs, store).state_dict()
    assert sorted(k for k in default if k.endswith(".weight")) == sorted(EmbeddingBagCollection(MIXED()).state_dict())
    assert all(isinstance(v, RowsTensor) for k, v in default.items() if k.endswith(".weight"))
    with pytest.raises(ValueError, match="weights_mb=-1 must be >= 0"):
        StoreEmbeddingBagCollection(configs, store, weights_mb=-1)


def test_built_on_meta_then_to_empty_on_the_host_reads_its_store_as_torchrecs_reads_its_weights():
    """torchrec's modules are built on ``meta`` (a planner's shape pass) and then ``to_empty`` on a
    real device; ours too: with a store its outputs equal torchrec's over the same rows, without one
    the first forward says so in one line."""
    configs = MIXED()
    store = make_store(configs, "sgd")
    ours = StoreEmbeddingBagCollection(configs, store, device="meta")
    assert ours.device.type == "meta"
    ours = ours.to_empty(device="cpu")
    assert ours.device.type == "cpu"
    theirs = EmbeddingBagCollection(MIXED(), device=torch.device("meta")).to_empty(device="cpu")
    theirs.load_state_dict(reference(configs, False, store).state_dict())
    kjt = make_batch(configs, np.random.default_rng(1))
    torch.testing.assert_close(ours(kjt).values(), theirs(kjt).values(), rtol=0, atol=1e-6)
    bare = StoreEmbeddingBagCollection(MIXED(), None, device="meta").to_empty(device="cpu")
    with pytest.raises(ValueError, match="built on device='meta' without a store has no rows to read"):
        bare(kjt)


def test_a_dlrm_with_no_sparse_features_is_refused_as_torchrecs_is():
    """torchrec's ``DLRM`` takes no collection of zero tables (its pairwise interaction needs a
    sparse feature); the store refuses a run of no tables in one line before any server is touched."""
    with pytest.raises(AssertionError, match="At least one embedding bag is required"):
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=[], device=torch.device("cpu")),
            dense_in_features=3,
            dense_arch_layer_sizes=[8],
            over_arch_layer_sizes=[4, 1],
        )
    with pytest.raises(ValueError, match="at least one table is required"):
        TableSet([])
