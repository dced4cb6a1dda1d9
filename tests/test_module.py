import numpy as np
import pytest
import redis
import torch
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad as TorchrecRowWiseAdagrad
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embeddings import SGD, RedisStore, RowWiseAdagrad, TableSet, UnknownTableError, rowkeys
from embeddings.bags.module import StoreEmbeddingBagCollection
from embeddings.errors import RowRangeError

CONFIGS = [
    EmbeddingBagConfig(name="t0", embedding_dim=8, num_embeddings=100, feature_names=["f0"]),
    EmbeddingBagConfig(name="t1", embedding_dim=8, num_embeddings=37, feature_names=["f1", "f2"]),
]
BATCH = 16


def make_kjt(rng: np.random.Generator) -> KeyedJaggedTensor:
    keys, lengths, values = [], [], []
    for c in CONFIGS:
        for f in c.feature_names:
            ln = rng.integers(0, 4, BATCH)
            keys.append(f)
            lengths.append(ln)
            # zipf-ish skew so rows repeat within and across bags
            values.append(np.minimum(rng.zipf(1.3, ln.sum()) - 1, c.num_embeddings - 1))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.from_numpy(np.concatenate(values)).long(),
        lengths=torch.from_numpy(np.concatenate(lengths)).int(),
    )


def loss_of(kt, proj):
    return ((kt.values() @ proj) ** 2).mean()


@pytest.mark.parametrize("kind", ["sgd", "adagrad"])
def test_matches_torchrec_ebc_for_20_steps(shards3, namespace, kind):
    lr = 0.5 if kind == "sgd" else 0.05
    opt = SGD(lr=lr) if kind == "sgd" else RowWiseAdagrad(lr=lr)
    store = RedisStore(shards3.urls, TableSet.from_torchrec(CONFIGS), opt, namespace=namespace, seed=11)
    ours = StoreEmbeddingBagCollection(CONFIGS, store)
    ref = EmbeddingBagCollection(CONFIGS)
    with torch.no_grad():  # same starting weights: the store's lazy init
        for c in CONFIGS:
            ref.embedding_bags[c.name].weight.copy_(torch.from_numpy(store.pull(c.name, np.arange(c.num_embeddings))))
    ref_opt = (
        torch.optim.SGD(ref.parameters(), lr=lr) if kind == "sgd" else TorchrecRowWiseAdagrad(ref.parameters(), lr=lr)
    )
    proj = torch.randn(
        sum(len(c.feature_names) * c.embedding_dim for c in CONFIGS), 4, generator=torch.Generator().manual_seed(0)
    )
    rng = np.random.default_rng(5)
    for _ in range(20):
        kjt = make_kjt(rng)
        out_ours, out_ref = ours(kjt), ref(kjt)
        assert out_ours.keys() == out_ref.keys() == ["f0", "f1", "f2"]
        torch.testing.assert_close(out_ours.values(), out_ref.values(), rtol=0, atol=1e-5)
        loss_of(out_ours, proj).backward()
        ours.apply_gradients()
        ref_opt.zero_grad()
        loss_of(out_ref, proj).backward()
        ref_opt.step()
    worst = 0.0
    for c in CONFIGS:
        got = store.pull(c.name, np.arange(c.num_embeddings))
        want = ref.embedding_bags[c.name].weight.detach().numpy()
        worst = max(worst, float(np.abs(got - want).max()))
    assert worst < 1e-5
    # rows were written to the shards: fields of the namespace's row buckets (hashes) there
    fields = 0
    for url in shards3.urls:
        c = redis.Redis.from_url(url)
        fields += sum(c.hlen(k) for k in c.scan_iter(f"{namespace}:*", count=1000) if c.type(k) == b"hash")
    assert fields > 20
    assert store.clear() > 0
    store.close()


def test_dlrm_accepts_module_and_trains(shards3, namespace):
    store = RedisStore(shards3.urls, TableSet.from_torchrec(CONFIGS), SGD(lr=0.1), namespace=namespace)
    ebc = StoreEmbeddingBagCollection(CONFIGS, store)
    model = DLRM(
        embedding_bag_collection=ebc, dense_in_features=4, dense_arch_layer_sizes=[16, 8], over_arch_layer_sizes=[8, 1]
    )
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    kjt = make_kjt(rng)
    dense = torch.randn(BATCH, 4, generator=torch.Generator().manual_seed(1))
    labels = (torch.arange(BATCH) % 2).float()
    ebc.prepare(Batch(dense_features=dense, sparse_features=kjt, labels=labels))  # as the data reader does, ahead
    ctx = ebc.batch_keys(kjt)
    losses = []
    for _ in range(100):
        logits = model(dense, kjt).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ebc.apply_gradients()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0]
    assert ebc.batch_keys(kjt) is ctx  # the batch's keys were worked out once, for every forward
    store.clear()
    store.close()


@pytest.mark.parametrize("batch", [1, 7, 512, 1024])
def test_a_batchs_keys_match_a_plain_unique_on_either_path_and_an_id_out_of_range_is_named(shards3, namespace, batch):
    """One id a bag, each feature on a table of its own (the features sorted apart) and two features
    on one table (``torch.unique`` over them all): the same sorted keys and positions as numpy's
    unique of the packed keys; an id out of its table's range is refused by name on both."""
    rng = np.random.default_rng(batch)
    apart = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate([100, 37, 5000])
    ]
    for configs in (apart, CONFIGS):
        store = RedisStore(shards3.urls, TableSet.from_torchrec(configs), SGD(), namespace=namespace)
        ebc = StoreEmbeddingBagCollection(configs, store)
        feats = [(f, t, c.num_embeddings) for t, c in enumerate(configs) for f in c.feature_names]
        ids = [np.minimum(rng.zipf(1.3, batch) - 1, n - 1).astype(np.int64) for _, _, n in feats]

        def kjt(values, feats=feats):
            return KeyedJaggedTensor.from_lengths_sync(
                keys=[f for f, _, _ in feats],
                values=torch.from_numpy(np.concatenate(values)),
                lengths=torch.ones(len(feats) * batch, dtype=torch.int32),
            )

        ctx = ebc.batch_keys(kjt(ids))
        keys, inverse = np.unique(
            np.concatenate([rowkeys.pack(t, v) for (_, t, _), v in zip(feats, ids)]), return_inverse=True
        )
        assert ebc._by_feature == (configs is apart)
        assert np.array_equal(ctx.keys, keys) and np.array_equal(ctx.inverse.numpy(), inverse.ravel()) and ctx.single
        for bad in (-1, feats[-1][2]):
            wrong = [v.copy() for v in ids]
            wrong[-1][batch // 2] = bad
            with pytest.raises(
                RowRangeError, match=rf"feature '{feats[-1][0]}'\): row id {bad} out of range \[0, {feats[-1][2]}\)"
            ):
                ebc.batch_keys(kjt(wrong))
        store.close()


def test_module_rejects_mismatched_configs(shards3, namespace):
    store = RedisStore(shards3.urls, TableSet.from_torchrec(CONFIGS), SGD(), namespace=namespace)
    other = [EmbeddingBagConfig(name="t0", embedding_dim=16, num_embeddings=100, feature_names=["f0"])]
    with pytest.raises(ValueError, match=r"table 't0': config has 100 rows x 16 dim, store has 100 x 8"):
        StoreEmbeddingBagCollection(other, store)
    missing = [EmbeddingBagConfig(name="zz", embedding_dim=8, num_embeddings=100, feature_names=["f0"])]
    with pytest.raises(UnknownTableError, match="'zz'"):
        StoreEmbeddingBagCollection(missing, store)
    store.close()


def test_pair_interaction_matches_torchrecs_bit_for_bit():
    from torchrec.models.dlrm import InteractionArch

    from recsys.model import PairInteraction

    torch.manual_seed(3)
    dense = torch.randn(64, 8)
    sparse = torch.randn(64, 5, 8)
    outs, grads = [], []
    for arch in (InteractionArch(5), PairInteraction(5)):
        d, s = dense.clone().requires_grad_(True), sparse.clone().requires_grad_(True)
        out = arch(d, s)
        (out * torch.linspace(-1, 1, out.shape[1])).sum().backward()
        outs.append(out.detach())
        grads.append((d.grad, s.grad))
    assert outs[0].shape == (64, 8 + 5 + 5 * 4 // 2) and torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
