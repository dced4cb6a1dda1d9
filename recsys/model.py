"""The DLRM model from torchrec parts over either embedding backend."""

from __future__ import annotations

import numpy as np
import torch
import torchrec
from torchrec.models.dlrm import DLRM, DLRM_DCN, InteractionArch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

from data.criteo import NUM_DENSE, NUM_SPARSE, SPARSE_NAMES
from embeddings import EmbeddingStore, TableSet, make_optimizer
from embeddings.bags.module import StoreEmbeddingBagCollection
from embeddings.rowinit import init_rows
from recsys.config import RunConfig


def table_configs(cfg: RunConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_{name}",
            embedding_dim=cfg.model.embedding_dim,
            num_embeddings=rows,
            feature_names=[name],
        )
        for name, rows in zip(SPARSE_NAMES[:NUM_SPARSE], cfg.data.rows, strict=True)
    ]


def table_set(cfg: RunConfig) -> TableSet:
    return TableSet.from_torchrec(table_configs(cfg))


def row_optimizer(cfg: RunConfig):
    return make_optimizer(cfg.optim.optimizer, cfg.optim.lr, cfg.optim.eps)


class PairInteraction(InteractionArch):
    """torchrec's ``InteractionArch`` (the same values and gradients, bit for bit), with the upper
    triangle of each sample's ``[F + 1, F + 1]`` dot products picked by one flat ``index_select``
    instead of advanced indexing with two index tensors: on the host that pick and its backward
    took 3.5 ms of a 1-thread step at batch 1024 (7.3 against 3.8 ms, forward and backward with the
    dot products, measured alone)."""

    def __init__(self, num_sparse_features: int) -> None:
        super().__init__(num_sparse_features)
        rows, cols = self.triu_indices
        self.register_buffer("triu_flat", rows * (self.F + 1) + cols, persistent=False)

    def forward(self, dense_features: torch.Tensor, sparse_features: torch.Tensor) -> torch.Tensor:
        if self.F <= 0:
            return dense_features
        combined = torch.cat((dense_features.unsqueeze(1), sparse_features), dim=1)
        dots = torch.bmm(combined, torch.transpose(combined, 1, 2))
        return torch.cat((dense_features, dots.flatten(1).index_select(1, self.triu_flat)), dim=1)


def build_dlrm(cfg: RunConfig, ebc, stock: bool = False) -> DLRM:
    """DLRM over ``ebc``; dense init from ``cfg.train.seed`` so every backend starts the same.
    ``stock``: torchrec's own interaction (``PairInteraction`` computes the same). ``--model dcn``:
    torchrec's ``DLRM_DCN`` (DCN-v2 crosses of low rank ``dcn_low_rank``, as MLPerf DLRM-v2)."""
    torch.manual_seed(cfg.train.seed)
    if cfg.model.model == "dcn":
        return DLRM_DCN(
            embedding_bag_collection=ebc,
            dense_in_features=NUM_DENSE,
            dense_arch_layer_sizes=[*cfg.model.dense_arch, cfg.model.embedding_dim],
            over_arch_layer_sizes=[*cfg.model.over_arch, 1],
            dcn_num_layers=cfg.model.dcn_layers,
            dcn_low_rank_dim=cfg.model.dcn_low_rank,
        )
    model = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=NUM_DENSE,
        dense_arch_layer_sizes=[*cfg.model.dense_arch, cfg.model.embedding_dim],
        over_arch_layer_sizes=[*cfg.model.over_arch, 1],
    )
    if not stock:
        model.inter_arch = PairInteraction(model.inter_arch.F)
    return model


def store_model(cfg: RunConfig, store: EmbeddingStore, row_source=None) -> tuple[DLRM, StoreEmbeddingBagCollection]:
    ebc = StoreEmbeddingBagCollection(table_configs(cfg), store, row_source=row_source, kernels=cfg.embeddings.kernels)
    return build_dlrm(cfg, ebc), ebc


def local_model(cfg: RunConfig) -> tuple[DLRM, FusedEmbeddingBagCollection]:
    """torchrec's ``FusedEmbeddingBagCollection`` (fbgemm TBE on the host, SGD or row-wise Adagrad
    fused into backward), started from the store's lazy init: the engine a torchrec user would pick."""
    configs = table_configs(cfg)
    if cfg.optim.optimizer == "sgd":
        kind, kwargs = torch.optim.SGD, {"lr": cfg.optim.lr}  # torchrec.optim.SGD is refused by the fused engine
    elif cfg.optim.optimizer == "adagrad-exact":  # fbgemm's EXACT_ADAGRAD
        kind, kwargs = torch.optim.Adagrad, {"lr": cfg.optim.lr, "eps": cfg.optim.eps}
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
    if cfg.optim.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.optim.lr, eps=cfg.optim.eps, foreach=True)
    return torch.optim.Adagrad(params, lr=cfg.optim.lr, eps=cfg.optim.eps, foreach=True)
