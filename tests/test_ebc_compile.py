"""``torch.compile`` of a model over StoreEmbeddingBagCollection: the lookup runs eagerly (a graph
break), the dense part compiles, the output is the eager one. (Compiling takes seconds: not in the
unit tier with ``test_ebc_surface.py``.)"""

from __future__ import annotations

import numpy as np
import torch

from embeddings import InProcessStore, RowWiseAdagrad, TableSet
from tests.test_ebc_equivalence import BATCH, make_batch
from tests.test_ebc_surface import dlrm_over, one_dim_configs


def test_torch_compile_runs_the_lookup_eagerly():
    configs = one_dim_configs()
    store = InProcessStore(TableSet.from_torchrec(configs), RowWiseAdagrad(lr=0.05), seed=1)
    model, _ = dlrm_over(configs, store)
    kjt = make_batch(configs, np.random.default_rng(0), single=True)
    dense = torch.randn(BATCH, 3)
    eager = model(dense, kjt)
    compiled = torch.compile(model)(dense, kjt)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
