"""The DLRM model from torchrec parts over either embedding backend."""

from __future__ import annotations

import numpy as np
import torch
import torchrec
from torchrec.models.dlrm import DLRM
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from data.criteo import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from embeddings import EmbeddingStore, TableSet, make_optimizer
from embeddings.module import StoreEmbeddingBagCollection
from embeddings.rowinit import init_rows
from recsys.config import RunConfig


def table_configs(cfg: RunConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.model.embedding_dim,
            num_embeddings=cfg.data.rows_per_table,
            feature_names=[name],
        )
        for name in SPARSE_NAMES[:NUM_SPARSE]
    ]


def table_set(cfg: RunConfig) -> TableSet:
    return TableSet.from_torchrec(table_configs(cfg))


def row_optimizer(cfg: RunConfig):
    return make_optimizer(cfg.optim.optimizer, cfg.optim.lr, cfg.optim.eps)


def build_dlrm(cfg: RunConfig, ebc) -> DLRM:
    """DLRM over ``ebc``; dense init from ``cfg.train.seed`` so every backend starts the same."""
    torch.manual_seed(cfg.train.seed)
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*cfg.model.dense_arch, cfg.model.embedding_dim],
        over_arch_layer_sizes=[*cfg.model.over_arch, 1],
    )


def store_model(cfg: RunConfig, store: EmbeddingStore, row_source=None) -> tuple[DLRM, StoreEmbeddingBagCollection]:
    ebc = StoreEmbeddingBagCollection(table_configs(cfg), store, row_source=row_source)
    return build_dlrm(cfg, ebc), ebc


def local_model(cfg: RunConfig) -> tuple[DLRM, FusedEmbeddingBagCollection]:
    """torchrec's ``FusedEmbeddingBagCollection`` (fbgemm TBE on the host, SGD or row-wise Adagrad
    fused into backward), started from the store's lazy init: the engine a torchrec user would pick."""
    configs = table_configs(cfg)
    if cfg.optim.optimizer == "sgd":
        kind, kwargs = torchrec.optim.SGD, {"lr": cfg.optim.lr}
    else:
        kind, kwargs = torchrec.optim.RowWiseAdagrad, {"lr": cfg.optim.lr, "eps": cfg.optim.eps}
    ebc = FusedEmbeddingBagCollection(
        tables=configs, optimizer_type=kind, optimizer_kwargs=kwargs, device=torch.device("cpu")
    )
    tables = table_set(cfg)
    state = ebc.state_dict()
    with torch.no_grad():
        for t, c in enumerate(configs):
            spec = tables.specs[t]
            rows = init_rows(cfg.train.seed, t, np.arange(c.num_embeddings), c.embedding_dim, spec.scale)
            state[f"embedding_bags.{c.name}.weight"].copy_(torch.from_numpy(rows))
    return build_dlrm(cfg, ebc), ebc


def dense_params(model: torch.nn.Module):
    return [p for n, p in model.named_parameters() if "embedding_bags" not in n]


def dense_optimizer(cfg: RunConfig, params) -> torch.optim.Optimizer:
    # foreach: one multi-tensor kernel per update op rather than one per parameter (about 1 ms a step on CPU)
    if cfg.optim.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.optim.lr, foreach=True)
    return torch.optim.Adagrad(params, lr=cfg.optim.lr, eps=cfg.optim.eps, foreach=True)
