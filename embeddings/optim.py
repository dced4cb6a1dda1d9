"""Row optimizers applied by the store's single writer per shard.

The optimizer state lives with the row: a stored row is ``[dim + state_width]`` float32,
weights first. The arithmetic mirrors ``torch.optim.SGD`` and ``torchrec.optim.RowWiseAdagrad``
(without weight decay or lr decay) op for op, so that a run over the store and a run over
torchrec's ``EmbeddingBagCollection`` agree to float rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class RowOptimizer(Protocol):
    state_width: int

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """rows: [n, dim + state_width] float32, grads: [n, dim] -> new rows, same shape."""
        ...


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01
    state_width: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"SGD lr={self.lr} must be > 0")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        return rows.add(grads, alpha=-self.lr)


@dataclass(frozen=True)
class RowWiseAdagrad:
    lr: float = 0.01
    eps: float = 1e-10
    state_width: int = 1

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"RowWiseAdagrad lr={self.lr} must be > 0")
        if not self.eps >= 0:
            raise ValueError(f"RowWiseAdagrad eps={self.eps} must be >= 0")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        dim = grads.shape[1]
        weights, state = rows[:, :dim], rows[:, dim : dim + 1]
        state = state + grads.pow(2).mean(dim=1).view(-1, 1)  # [n, 1] running sum of mean g^2
        std = state.sqrt().add_(self.eps)
        weights = weights.addcdiv(grads, std, value=-self.lr)
        return torch.cat([weights, state], dim=1)


def make_optimizer(name: str, lr: float, eps: float = 1e-10) -> RowOptimizer:
    if name == "sgd":
        return SGD(lr=lr)
    if name == "adagrad":
        return RowWiseAdagrad(lr=lr, eps=eps)
    raise ValueError(f"optimizer {name!r} must be 'sgd' or 'adagrad'")
