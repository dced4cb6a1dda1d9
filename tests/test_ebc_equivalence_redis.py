"""The equivalence suite of ``test_ebc_equivalence.py`` on the Redis tier (``LocalShards`` +
``RedisStore``): tables of several widths stored as they are (no padding to the widest), mixed
pooling, weighted and shared features, a variable batch per feature, and empty batches, against
torchrec's ``EmbeddingBagCollection`` with SGD, row-wise and element-wise Adagrad and Adam, within 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embeddings import RedisStore, TableSet, state_of
from embeddings.bags.module import StoreEmbeddingBagCollection
from tests.test_ebc_equivalence import (
    CASES,
    KINDS,
    LR,
    empty_kinds,
    make_batch,
    projection,
    reference,
    row_optimizer,
    run_equivalence,
)


def redis_store(shards, namespace: str, configs, kind: str) -> RedisStore:
    return RedisStore(shards.urls, TableSet.from_torchrec(configs), row_optimizer(kind), namespace=namespace, seed=11)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", ["dlrm", "dims", "mixed", "weighted"])
def test_matches_torchrec_ebc_on_redis(shards3, namespace, case, kind):
    make, weighted, single = CASES[case]
    configs = make()
    store = redis_store(shards3, namespace, configs, kind)
    try:
        run_equivalence(store, configs, weighted, single, kind)
        # every table's rows at its own width: [dim + state] float32 each, as read back
        for c in configs:
            state = {"sgd": 0, "adagrad": 1, "adagrad-exact": c.embedding_dim, "adam": 2 * c.embedding_dim}[kind]
            assert state_of(store.optimizer, c.embedding_dim) == state
            assert store.read_rows(c.name, np.arange(3)).shape == (3, c.embedding_dim + state)
        assert store.clear() > 0  # rows were written to the shards
    finally:
        store.close()


def test_variable_batch_on_redis(shards3, namespace):
    make, weighted, single = CASES["mixed"]
    configs = make()
    store = redis_store(shards3, namespace, configs, "adagrad")
    try:
        run_equivalence(store, configs, weighted, single, "adagrad", inputs="vbe")
    finally:
        store.clear()
        store.close()


@pytest.mark.parametrize("case", ["dlrm", "mixed", "weighted"])
def test_empty_batches_on_redis(shards3, namespace, case):
    """No ids at all: nothing read or written on the shards; every other empty kind matches torchrec."""
    make, weighted, _ = CASES[case]
    configs = make()
    store = redis_store(shards3, namespace, configs, "sgd")
    try:
        ours = StoreEmbeddingBagCollection(configs, store, is_weighted=weighted)
        ref = reference(configs, weighted, store)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR["sgd"])
        proj = projection(configs)
        rng = np.random.default_rng(4)
        for what, kw in empty_kinds(configs).items():
            kjt = make_batch(configs, rng, weighted=weighted, **kw)
            out_ours, out_ref = ours(kjt), ref(kjt)
            assert out_ours.values().shape == out_ref.values().shape, what
            torch.testing.assert_close(out_ours.values(), out_ref.values(), rtol=0, atol=1e-5, msg=what)
            (out_ours.values() @ proj).square().sum().backward()
            ours.apply_gradients()
            ref_opt.zero_grad()
            (out_ref.values() @ proj).square().sum().backward()
            ref_opt.step()
            if what == "no ids at all":  # the first batch: nothing may be written by it
                assert not out_ours.values().any() and store.clear() == 0, what
        for c in configs:
            got = store.pull(c.name, np.arange(c.num_embeddings))
            assert np.abs(got - ref.embedding_bags[c.name].weight.detach().numpy()).max() < 1e-5
        zero = ours(make_batch(configs, rng, weighted=weighted, batch=0))
        assert zero.values().shape == (0, sum(zero.length_per_key()))
    finally:
        store.clear()
        store.close()
