"""StoreEmbeddingBagCollection against torchrec's EmbeddingBagCollection (and the fused one where it
applies): the same configs, the same initial rows (the store's lazy init copied into torchrec's
weights), the same KJT batches; forward outputs and rows (and row-wise Adagrad's state) after a few
training steps agree within 1e-5. Every shape torchrec's module accepts: per-table dims, mixed
SUM/MEAN pooling, weighted features, shared tables, a feature name on two tables, multi-hot bags,
a variable batch per feature, a TensorDict, reordered and unknown keys; and empty batches of every
kind. In-process store here; the Redis tier: ``test_ebc_equivalence_redis.py`` (same helpers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torchrec
from tensordict import TensorDict
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import SGD, InProcessStore, TableSet, make_optimizer
from embeddings.bags.module import StoreEmbeddingBagCollection
from tests.test_module import loss_of

SUM, MEAN = PoolingType.SUM, PoolingType.MEAN
STEPS = 5
TOL = 1e-5
LR = {"sgd": 0.1, "adagrad": 0.05, "adagrad-exact": 0.05, "adam": 0.01}
KINDS = list(LR)


def table(name: str, dim: int, rows: int, features: list[str], pooling=SUM) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=features, pooling=pooling
    )


# name -> (a function building fresh configs, is_weighted, one id per bag)
CASES = {
    # our DLRM's shape: one dim, SUM, one feature per table, one id per bag (the fast path's gather)
    "dlrm": (lambda: [table(f"t{i}", 8, 40 + i, [f"f{i}"]) for i in range(4)], False, True),
    # the fast path's pooling call: one dim, one pooling, one feature per table, multi-hot bags
    "multi_hot": (lambda: [table(f"t{i}", 8, 40 + i, [f"f{i}"], MEAN) for i in range(3)], False, False),
    "dims": (
        lambda: [table("t0", 8, 50, ["f0"]), table("t1", 4, 30, ["f1"]), table("t2", 16, 20, ["f2"])],
        False,
        False,
    ),
    "pooling": (
        lambda: [table("t0", 8, 50, ["f0"], SUM), table("t1", 8, 30, ["f1"], MEAN), table("t2", 8, 20, ["f2"], SUM)],
        False,
        False,
    ),
    "shared": (lambda: [table("t0", 8, 100, ["f0"]), table("t1", 8, 37, ["f1", "f2"])], False, False),
    # per-table dims, mixed pooling, a table shared by two features, a feature name on two tables
    "mixed": (
        lambda: [
            table("t0", 8, 50, ["f0", "fx"], MEAN),
            table("t1", 4, 30, ["f1"]),
            table("t2", 16, 20, ["f2", "f3"]),
            table("t3", 4, 25, ["fx"], MEAN),
            table("t4", 8, 10, ["f4"]),
        ],
        False,
        False,
    ),
    "weighted": (
        lambda: [table("t0", 8, 50, ["f0", "f1"]), table("t1", 4, 30, ["f2"]), table("t2", 8, 20, ["f3"])],
        True,
        False,
    ),
    "weighted_fast": (lambda: [table(f"t{i}", 8, 30 + i, [f"f{i}"]) for i in range(3)], True, False),
}
BATCH = 12


def feature_rows(configs) -> dict[str, int]:
    """Each feature name's id bound: the fewest rows of the tables it feeds."""
    bound: dict[str, int] = {}
    for c in configs:
        for f in c.feature_names:
            bound[f] = min(bound.get(f, c.num_embeddings), c.num_embeddings)
    return bound


def make_batch(
    configs,
    rng: np.random.Generator,
    *,
    batch: int = BATCH,
    single: bool = False,
    weighted: bool = False,
    empty: tuple[str, ...] = (),
    max_len: int = 4,
    extra_key: bool = False,
    reverse: bool = False,
) -> KeyedJaggedTensor:
    """A KJT over every feature of ``configs`` (a shared feature name once); ``empty``: features with
    no id at all ("*": every feature); ``extra_key``: a key no table reads; ``reverse``: keys in
    reverse order."""
    bound = feature_rows(configs)
    names = list(bound) + (["unknown"] if extra_key else [])
    if reverse:
        names = names[::-1]
    lengths, values = [], []
    for f in names:
        if "*" in empty or f in empty:
            ln = np.zeros(batch, np.int64)
        elif single:
            ln = np.ones(batch, np.int64)
        else:
            ln = rng.integers(0, max_len + 1, batch)
        n = bound.get(f, 1000)
        lengths.append(ln)
        values.append(np.minimum(rng.zipf(1.3, ln.sum()) - 1, n - 1))  # zipf-ish: rows repeat
    total = int(sum(ln.sum() for ln in lengths))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=names,
        values=torch.from_numpy(np.concatenate(values)).long(),
        lengths=torch.from_numpy(np.concatenate(lengths)).int(),
        weights=torch.from_numpy(rng.uniform(0.25, 1.75, total).astype(np.float32)) if weighted else None,
        stride=batch,
    )


def make_vbe(configs, rng: np.random.Generator, weighted: bool = False, batch: int = BATCH) -> KeyedJaggedTensor:
    """A variable batch per feature: feature f has its own number of bags, spread over the batch's
    samples by ``inverse_indices`` (as torchrec's VBE KJTs are)."""
    bound = feature_rows(configs)
    names = list(bound)
    strides = [int(rng.integers(1, batch + 1)) for _ in names]
    lengths = [rng.integers(0, 4, s) for s in strides]
    values = [np.minimum(rng.zipf(1.3, ln.sum()) - 1, bound[f] - 1) for f, ln in zip(names, lengths)]
    inverse = torch.stack([torch.from_numpy(rng.integers(0, s, batch)) for s in strides])
    total = int(sum(ln.sum() for ln in lengths))
    return KeyedJaggedTensor(
        keys=names,
        values=torch.from_numpy(np.concatenate(values)).long(),
        lengths=torch.from_numpy(np.concatenate(lengths)).int(),
        weights=torch.from_numpy(rng.uniform(0.25, 1.75, total).astype(np.float32)) if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(names, inverse),
    )


def make_deduplicated(configs, rng: np.random.Generator, weighted: bool = False) -> KeyedJaggedTensor:
    """One batch size for every feature, fewer bags than samples, each sample pointing at its bag by
    ``inverse_indices`` (a deduplicated batch: torchrec's module spreads the bags over the samples)."""
    kjt = make_batch(configs, rng, batch=BATCH // 2, weighted=weighted)
    names = kjt.keys()
    return KeyedJaggedTensor(
        keys=names,
        values=kjt.values(),
        lengths=kjt.lengths(),
        weights=kjt.weights_or_none(),
        inverse_indices=(names, torch.from_numpy(rng.integers(0, BATCH // 2, (len(names), BATCH)))),
    )


def to_tensordict(kjt: KeyedJaggedTensor) -> TensorDict:
    """The batch as torchrec 1.8's TensorDict input: one jagged nested tensor per feature."""
    jagged = kjt.to_dict()
    return TensorDict(
        {
            f: torch.nested.nested_tensor_from_jagged(jt.values(), lengths=jt.lengths().long())
            for f, jt in jagged.items()
        },
        batch_size=[kjt.stride()],
    )


def row_optimizer(kind: str):
    """Ours: SGD, row-wise Adagrad, element-wise Adagrad, lazy Adam (torch's defaults for its eps)."""
    return make_optimizer(kind, LR[kind], eps=1e-8 if kind == "adam" else 1e-10)


def make_store(configs, kind: str, seed: int = 11):
    return InProcessStore(TableSet.from_torchrec(configs), row_optimizer(kind), seed=seed)


def reference_optimizer(ref: EmbeddingBagCollection, kind: str) -> torch.optim.Optimizer:
    """torch's and torchrec's optimizers on torchrec's module. Adam is ``torch.optim.SparseAdam`` on
    sparse gradients (``nn.EmbeddingBag(sparse=True)``): a dense gradient would decay the moments of
    every row each step, and a store moves only the rows a step touches."""
    params, lr = list(ref.parameters()), LR[kind]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "adagrad":
        return TorchrecRowWiseAdagrad(params, lr=lr)
    if kind == "adagrad-exact":
        return torch.optim.Adagrad(params, lr=lr)
    for bag in ref.embedding_bags.values():
        bag.sparse = True
    return torch.optim.SparseAdam(params, lr=lr)


def copy_rows_into(ref, configs, store) -> None:
    """torchrec's weights := the store's rows (its lazy init)."""
    state = ref.state_dict()
    with torch.no_grad():
        for c in configs:
            rows = store.pull(c.name, np.arange(c.num_embeddings))
            state[f"embedding_bags.{c.name}.weight"].copy_(torch.from_numpy(rows))


def reference(configs, weighted: bool, store):
    ref = EmbeddingBagCollection(configs, is_weighted=weighted)
    copy_rows_into(ref, configs, store)
    return ref


def projection(configs, seed: int = 0) -> torch.Tensor:
    total = sum(len(c.feature_names) * c.embedding_dim for c in configs)
    return torch.randn(total, 4, generator=torch.Generator().manual_seed(seed))


def assert_rows_match(store, ref, configs, kind: str, ref_opt=None) -> None:
    worst = 0.0
    for c in configs:
        got = store.read_rows(c.name, np.arange(c.num_embeddings))
        want = ref.embedding_bags[c.name].weight.detach()
        worst = max(worst, float(np.abs(got[:, : c.embedding_dim] - want.numpy()).max()))
        if ref_opt is None or kind == "sgd":
            continue
        state = ref_opt.state[ref.embedding_bags[c.name].weight]
        if kind == "adagrad":  # the row-wise accumulator: one float per row
            want_state = state["sum"].reshape(-1, 1)
        elif kind == "adagrad-exact":  # one accumulator per weight
            want_state = state["sum"]
        else:  # Adam's two moments per weight
            want_state = torch.cat([state["exp_avg"], state["exp_avg_sq"]], dim=1)
        assert got.shape[1] == c.embedding_dim + want_state.shape[1]
        worst = max(worst, float(np.abs(got[:, c.embedding_dim :] - want_state.numpy()).max()))
    assert worst < TOL, worst


def batches(configs, weighted: bool, single: bool, rng, inputs: str = "kjt") -> list:
    """``STEPS`` batches; the third has no id at all and the fourth leaves a feature empty (empty
    batches inside a training run)."""
    names = list(feature_rows(configs))
    out = []
    for step in range(STEPS):
        empty = ("*",) if step == 2 else (names[0],) if step == 3 else ()
        if inputs == "vbe" and step not in (2, 3):
            out.append(make_vbe(configs, rng, weighted))
            continue
        if inputs == "deduplicated" and step not in (2, 3):
            out.append(make_deduplicated(configs, rng, weighted))
            continue
        kjt = make_batch(
            configs,
            rng,
            single=single and not empty,
            weighted=weighted,
            empty=empty,
            extra_key=inputs == "reordered",
            reverse=inputs == "reordered",
        )
        out.append(to_tensordict(kjt) if inputs == "td" else kjt)
    return out


def run_equivalence(
    store, configs, weighted: bool, single: bool, kind: str, inputs: str = "kjt", kernels: str = "fbgemm"
) -> None:
    """Train ours and torchrec's side by side for ``STEPS`` steps; outputs and rows must agree."""
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted, kernels=kernels)
    ref = reference(configs, weighted, store)
    ref_opt = reference_optimizer(ref, kind)
    side_by_side(ours, ref, ref_opt, batches(configs, weighted, single, np.random.default_rng(5), inputs), configs)
    assert_rows_match(store, ref, configs, kind, ref_opt)


def side_by_side(ours, ref, ref_opt, kjts, configs) -> None:
    """Each batch through both modules: outputs equal, then each side's optimizer step."""
    proj = projection(configs)
    for kjt in kjts:
        out_ours, out_ref = ours(kjt), ref(kjt)
        assert out_ours.keys() == out_ref.keys()
        assert out_ours.length_per_key() == out_ref.length_per_key()
        assert out_ours.values().shape == out_ref.values().shape
        torch.testing.assert_close(out_ours.values(), out_ref.values(), rtol=0, atol=TOL)
        loss_of(out_ours, proj).backward()
        ours.apply_gradients()
        ref_opt.zero_grad()
        loss_of(out_ref, proj).backward()
        ref_opt.step()


# the cases whose every pooling call fbgemm's TBE kernels take (unweighted, one pooling per dim,
# one feature per table); the others take them where a dim's calls allow, torch's elsewhere
ON_TBE = ("dlrm", "multi_hot", "dims")


@pytest.mark.parametrize("kernels", ["fbgemm", "torch"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_torchrec_ebc(case, kind, kernels, monkeypatch):
    """Both kernels (fbgemm's TBE, the default, and torch's), every optimizer, every shape; where
    TBE's kernels apply, every pooling call goes through them (and none with ``kernels="torch"``)."""
    from embeddings.bags import kernels as tbe

    calls = []
    pool = tbe.pool
    monkeypatch.setattr(tbe, "pool", lambda *a: calls.append(a[3]) or pool(*a))
    make, weighted, single = CASES[case]
    configs = make()
    run_equivalence(make_store(configs, kind), configs, weighted, single, kind, kernels=kernels)
    if kernels == "torch" or weighted:
        assert not calls
    elif case in ON_TBE:  # one call a step and dim with ids (features pooled in it: every one of the dim's)
        assert len(calls) >= STEPS - 1 and sum(calls) >= (STEPS - 1) * len(configs) // len(
            {c.embedding_dim for c in configs}
        )


@pytest.mark.parametrize("inputs", ["vbe", "deduplicated", "td", "reordered"])
@pytest.mark.parametrize("case", ["dlrm", "multi_hot", "mixed", "weighted"])
def test_matches_torchrec_ebc_on_other_inputs(case, inputs):
    """A variable batch per feature, a deduplicated batch (bags spread over the samples by
    ``inverse_indices``), a TensorDict (no weights: it carries none), reordered keys with an unknown
    one."""
    make, weighted, single = CASES[case]
    if inputs == "td" and weighted:
        pytest.skip("a TensorDict carries no per-value weights")
    configs = make()
    run_equivalence(make_store(configs, "adagrad"), configs, weighted, single, "adagrad", inputs)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adagrad-exact"])
@pytest.mark.parametrize("case", ["dlrm", "multi_hot", "dims", "shared", "weighted"])
def test_matches_fused_ebc(case, kind):
    """Against fbgemm's fused engine (the optimizer inside backward), as a torchrec user would train.
    Not with SUM and MEAN mixed in one module: there the fused module's own outputs differ from
    torchrec's ``EmbeddingBagCollection`` (0.7 at the first forward), the reference this suite holds to.
    Not Adam: fbgemm's host kernels have no Adam (its CPU TBE takes SGD and the Adagrads alone)."""
    make, weighted, single = CASES[case]
    configs = make()
    store = make_store(configs, kind)
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted)
    opt_type = {"sgd": torch.optim.SGD, "adagrad": torchrec.optim.RowWiseAdagrad, "adagrad-exact": torch.optim.Adagrad}[
        kind
    ]
    fused = FusedEmbeddingBagCollection(
        tables=make(),
        optimizer_type=opt_type,
        optimizer_kwargs={
            "lr": LR[kind],
            **({"eps": 1e-10} if kind == "adagrad-exact" else {}),
        },  # torch.optim.Adagrad's eps
        is_weighted=weighted,
        device=torch.device("cpu"),
    )
    copy_rows_into(fused, configs, store)
    proj = projection(configs)
    for kjt in batches(configs, weighted, single, np.random.default_rng(7)):
        out_ours, out_fused = ours(kjt), fused(kjt)
        torch.testing.assert_close(out_ours.values(), out_fused.values(), rtol=0, atol=TOL)
        loss_of(out_ours, proj).backward()
        ours.apply_gradients()
        loss_of(out_fused, proj).backward()
    state = fused.state_dict()
    worst = 0.0
    for c in configs:
        got = store.pull(c.name, np.arange(c.num_embeddings))
        worst = max(worst, float(np.abs(got - state[f"embedding_bags.{c.name}.weight"].numpy()).max()))
    assert worst < TOL, worst


# -- empty batches of every kind ----------------------------------------------------------------


class CountingStore(InProcessStore):
    """An in-process store that counts what the module asks of it."""

    pulls = writes = 0

    def pull_keys(self, keys):
        self.pulls += 1
        assert len(keys), "an empty pull: the module must not ask the store for no rows"
        return super().pull_keys(keys)

    def apply_keys(self, keys, grads, step=None, t=None):
        self.writes += 1
        return super().apply_keys(keys, grads, step, t)


def empty_kinds(configs) -> dict[str, dict]:
    names = list(feature_rows(configs))
    shared = next((c for c in configs if len(c.feature_names) > 1), None)
    kinds = {
        "no ids at all": {"empty": ("*",)},
        "one feature empty": {"empty": (names[0],)},
        "all but one feature empty": {"empty": tuple(names[1:])},
        "empty bags only": {"max_len": 0},
    }
    if shared is not None:
        kinds["a shared table with no ids"] = {"empty": tuple(shared.feature_names)}
    return kinds


@pytest.mark.parametrize("case", list(CASES))
def test_empty_batches_of_every_kind(case):
    """Every kind of empty batch, on every shape: torchrec's output (zeros where a bag is empty, the
    right width and ``length_per_key``), a backward that works, no pull and no write of no rows, and
    training then goes on matching torchrec's."""
    make, weighted, _ = CASES[case]
    configs = make()
    store = CountingStore(TableSet.from_torchrec(configs), SGD(lr=0.5), seed=3)
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted)
    ref = reference(configs, weighted, store)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    proj = projection(configs)
    rng = np.random.default_rng(1)
    width = sum(len(c.feature_names) * c.embedding_dim for c in configs)
    for what, kw in empty_kinds(configs).items():
        kjt = make_batch(configs, rng, weighted=weighted, **kw)
        batch = BATCH
        pulls, writes = store.pulls, store.writes
        out_ours, out_ref = ours(kjt), ref(kjt)
        assert out_ours.values().shape == out_ref.values().shape == (batch, width), what
        assert out_ours.length_per_key() == out_ref.length_per_key(), what
        assert out_ours.keys() == out_ref.keys(), what
        torch.testing.assert_close(out_ours.values(), out_ref.values(), rtol=0, atol=TOL, msg=what)
        if not kjt.values().numel():
            assert not out_ours.values().any(), what
            assert store.pulls == pulls, what  # nothing to read: the store is not asked
        loss = (out_ours.values() @ proj).square().sum()
        loss.backward()  # works with no rows: the output still hangs off the graph
        ours.apply_gradients()
        if not kjt.values().numel():
            assert store.writes == writes, what
        ref_opt.zero_grad()
        (out_ref.values() @ proj).square().sum().backward()
        ref_opt.step()
        assert_rows_match(store, ref, configs, "sgd")


@pytest.mark.parametrize("case", list(CASES))
def test_batch_of_zero_samples(case):
    """A batch of no samples: an output of no rows and the full width (torchrec's module raises an
    IndexError splitting such a KJT); nothing pulled, nothing written."""
    make, weighted, _ = CASES[case]
    configs = make()
    store = CountingStore(TableSet.from_torchrec(configs), SGD(lr=0.5), seed=3)
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted)
    kjt = make_batch(configs, np.random.default_rng(0), weighted=weighted, batch=0)
    out = ours(kjt)
    width = sum(len(c.feature_names) * c.embedding_dim for c in configs)
    assert out.values().shape == (0, width)
    assert out.length_per_key() == [c.embedding_dim for c in configs for _ in c.feature_names]
    out.values().sum().backward()
    ours.apply_gradients()
    assert store.pulls == store.writes == 0


@pytest.mark.parametrize("case", ["dlrm", "mixed", "weighted"])
def test_empty_variable_batch(case):
    """A variable-batch KJT whose features have no ids: zeros over the output's samples."""
    make, weighted, _ = CASES[case]
    configs = make()
    store = make_store(configs, "sgd")
    ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted)
    ref = reference(configs, weighted, store)
    names = list(feature_rows(configs))
    strides = [1 + i % 3 for i in range(len(names))]
    kjt = KeyedJaggedTensor(
        keys=names,
        values=torch.empty(0, dtype=torch.int64),
        lengths=torch.zeros(sum(strides), dtype=torch.int32),
        weights=torch.empty(0) if weighted else None,
        stride_per_key_per_rank=[[s] for s in strides],
        inverse_indices=(names, torch.stack([torch.arange(BATCH) % s for s in strides])),
    )
    out_ours, out_ref = ours(kjt), ref(kjt)
    assert out_ours.values().shape == out_ref.values().shape
    assert not out_ours.values().any()


def test_empty_tables():
    """``tables=[]``: an output of no columns for the batch (torchrec's own module fails on it)."""
    store = make_store(CASES["dlrm"][0](), "sgd")
    ours = StoreEmbeddingBagCollection([], store)
    kjt = make_batch(CASES["dlrm"][0](), np.random.default_rng(0))
    out = ours(kjt)
    assert out.keys() == [] and out.length_per_key() == [] and out.values().shape == (BATCH, 0)
    assert ours.embedding_bag_configs() == [] and ours.state_dict() == {}
    out.values().sum().backward() if out.values().requires_grad else None
    ours.apply_gradients()  # nothing to apply
    assert ours.pop_key_grads()[0].shape == (0,)


# -- Adam's step --------------------------------------------------------------------------------


def test_adam_counts_the_modules_steps_and_a_load_puts_the_count_back():
    """Adam's bias correction needs the optimizer step: the module counts ``apply_gradients`` calls
    (an empty batch is a step too, as torch's optimizers count it), says it in every table's
    ``state_dict`` entry, and a load puts it back, so that a restored module corrects as the saved
    one would have. Without a step, Adam refuses in one line."""
    make, weighted, single = CASES["dlrm"]
    configs = make()
    store = make_store(configs, "adam")
    ours = StoreEmbeddingBagCollection(configs, store)
    proj = projection(configs)
    for kjt in batches(configs, weighted, single, np.random.default_rng(3)):
        loss_of(ours(kjt), proj).backward()
        ours.apply_gradients()
    assert ours.optimizer_step == STEPS
    sd = ours.state_dict()
    assert {v["optimizer_step"] for k, v in sd.items() if k.endswith("_extra_state")} == {STEPS}
    twin = StoreEmbeddingBagCollection(make(), store)
    twin.load_state_dict(sd)
    assert twin.optimizer_step == STEPS
    with pytest.raises(ValueError, match="Adam needs the optimizer step"):
        store.apply_keys(np.array([0]), torch.ones(1, 8))


@pytest.mark.parametrize("kind", ["adagrad", "adagrad-exact"])
def test_adagrad_keywords_as_torch_and_torchrec_take_them(kind):
    """``lr_decay``, ``weight_decay`` and ``initial_accumulator_value``, as ``torch.optim.Adagrad``
    and ``torchrec.optim.RowWiseAdagrad`` take them: rows and accumulators equal after a few steps.
    Every batch touches every row: torch's dense weight decay moves every row each step, a store
    only the rows a step touches (fbgemm's sparse update)."""
    from embeddings import Adagrad, RowWiseAdagrad

    kw = {"lr": 0.05, "lr_decay": 0.1, "weight_decay": 0.01, "initial_accumulator_value": 0.1}
    configs = [table("t0", 4, 6, ["f0"]), table("t1", 8, 6, ["f1", "f2"])]
    ours_opt = RowWiseAdagrad(**kw) if kind == "adagrad" else Adagrad(**kw)
    store = InProcessStore(TableSet.from_torchrec(configs), ours_opt, seed=3)
    ours = StoreEmbeddingBagCollection(configs, store)
    ref = reference(configs, False, store)
    params = list(ref.parameters())
    ref_opt = TorchrecRowWiseAdagrad(params, **kw) if kind == "adagrad" else torch.optim.Adagrad(params, **kw)
    ids = torch.arange(6)
    kjts = [
        KeyedJaggedTensor.from_lengths_sync(
            keys=["f0", "f1", "f2"],
            values=torch.cat([ids, ids.flip(0), (ids + step) % 6]),
            lengths=torch.ones(18, dtype=torch.int32),
        )
        for step in range(4)
    ]
    side_by_side(ours, ref, ref_opt, kjts, configs)
    assert_rows_match(store, ref, configs, kind, ref_opt)


def test_adagrad_keywords_out_of_range_are_refused_in_one_line():
    from embeddings import Adagrad, RowWiseAdagrad

    for cls in (Adagrad, RowWiseAdagrad):
        for field in ("lr_decay", "weight_decay", "initial_accumulator_value"):
            with pytest.raises(ValueError, match=rf"^{cls.__name__} {field}=-0.5 must be >= 0$"):
                cls(lr=0.1, **{field: -0.5})


@pytest.mark.parametrize("case", ["dlrm", "dims", "shared"])
def test_both_kernels_train_to_the_same_rows(case):
    """fbgemm's TBE forward and dense backward against torch's ``index_select`` and
    ``embedding_bag``: 5 steps of row-wise Adagrad end with the same rows and state, but for the
    last bit of a row's gradient (TBE sums a row's contributions in its own order)."""
    make, weighted, single = CASES[case]
    configs = make()
    got = []
    for kernels in ("fbgemm", "torch"):
        store = make_store(configs, "adagrad")
        ours = StoreEmbeddingBagCollection(configs, store, kernels=kernels)
        proj = projection(configs)
        for kjt in batches(configs, weighted, single, np.random.default_rng(7)):
            loss_of(ours(kjt), proj).backward()
            ours.apply_gradients()
        got.append({c.name: store.read_rows(c.name, np.arange(c.num_embeddings)) for c in configs})
    for c in configs:
        np.testing.assert_allclose(got[0][c.name], got[1][c.name], rtol=1e-6, atol=1e-7)


def test_an_unknown_kernels_value_is_refused_in_one_line():
    configs = CASES["dlrm"][0]()
    with pytest.raises(ValueError, match="kernels='tbe': one of fbgemm, torch"):
        StoreEmbeddingBagCollection(configs, make_store(configs, "sgd"), kernels="tbe")
