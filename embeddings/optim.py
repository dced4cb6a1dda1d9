"""Row optimizers applied by the store's single writer per shard.

The optimizer state lives with the row: a stored row is ``[dim + state_of(dim)]`` float32,
weights first (``state_of(dim) = state_per_dim * dim + state_width``). The arithmetic mirrors
``torch.optim.SGD``, ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.Adagrad`` and
``torch.optim.SparseAdam`` (without weight decay or lr decay) op for op, so that a run over the
store and a run over torchrec's ``EmbeddingBagCollection`` agree to float rounding.

Only the rows a step touches change, as with a sparse gradient: for SGD and both Adagrads that is
what a dense gradient does too (a zero gradient moves nothing); Adam's moments would decay on every
row under ``torch.optim.Adam``, so ``Adam`` here is the lazy Adam of ``torch.optim.SparseAdam``, whose
bias correction counts optimizer steps (``t``, 1 on the first) rather than a row's own updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch


class RowOptimizer(Protocol):
    state_width: int  # state floats per row, whatever its dim
    state_per_dim: int  # and per weight

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, t: int | None = None) -> torch.Tensor:
        """rows: [n, dim + state_of(dim)] float32, grads: [n, dim], ``t`` the optimizer step (1 on
        the first; needed by ``Adam`` alone) -> new rows, same shape."""
        ...


def state_of(optimizer: RowOptimizer, dim: int) -> int:
    """State floats a row of ``dim`` weights carries under ``optimizer``."""
    return getattr(optimizer, "state_per_dim", 0) * dim + optimizer.state_width


@dataclass(frozen=True)
class SGD:
    lr: float = 0.01
    state_width: int = 0
    state_per_dim: int = 0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"SGD lr={self.lr} must be > 0")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, t: int | None = None) -> torch.Tensor:
        return rows.add(grads, alpha=-self.lr)


@dataclass(frozen=True)
class RowWiseAdagrad:
    """Row-wise Adagrad (``torchrec.optim.RowWiseAdagrad``; fbgemm's ``EXACT_ROWWISE_ADAGRAD``): one
    accumulator per row, the mean of its squared gradient. ``lr_decay``, ``weight_decay`` (L2, on
    the rows a step touches, as fbgemm's sparse update) and ``initial_accumulator_value`` (a
    never-written row's accumulator) as torchrec's optimizer takes them."""

    lr: float = 0.01
    eps: float = 1e-10
    state_width: int = 1
    state_per_dim: int = 0
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_adagrad(self, "RowWiseAdagrad")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, t: int | None = None) -> torch.Tensor:
        dim = grads.shape[1]
        weights, state = rows[:, :dim], rows[:, dim : dim + 1]
        grads, clr = _adagrad_terms(self, weights, grads, t)
        # each result straight into its columns of the new rows: the same bits as a cat of the two,
        # in half the time (no second pass over the rows)
        out = torch.empty((rows.shape[0], dim + 1), dtype=rows.dtype)
        state = torch.add(state, grads.pow(2).mean(dim=1).view(-1, 1), out=out[:, dim:])  # running sum of mean g^2
        std = state.sqrt().add_(self.eps)
        torch.addcdiv(weights, grads, std, value=-clr, out=out[:, :dim])
        return out


def _check_adagrad(opt, name: str) -> None:
    if not opt.lr > 0:
        raise ValueError(f"{name} lr={opt.lr} must be > 0")
    for field in ("eps", "lr_decay", "weight_decay", "initial_accumulator_value"):
        if not getattr(opt, field) >= 0:
            raise ValueError(f"{name} {field}={getattr(opt, field)} must be >= 0")


def _adagrad_terms(opt, weights: torch.Tensor, grads: torch.Tensor, t: int | None) -> tuple[torch.Tensor, float]:
    """The gradient with L2 weight decay, and the step's learning rate (``lr_decay`` by the
    optimizer step ``t``, as torch's Adagrad counts it: 1 on the first)."""
    if opt.weight_decay:
        grads = grads.add(weights, alpha=opt.weight_decay)
    if not opt.lr_decay:
        return grads, opt.lr
    if t is None or t < 1:
        raise ValueError(f"Adagrad lr_decay={opt.lr_decay} needs the optimizer step t >= 1, got {t}")
    return grads, opt.lr / (1 + (t - 1) * opt.lr_decay)


def initial_state(optimizer: RowOptimizer) -> float:
    """The optimizer state of a row never written (Adagrad's ``initial_accumulator_value``; else 0)."""
    return float(getattr(optimizer, "initial_accumulator_value", 0.0))


@dataclass(frozen=True)
class Adagrad:
    """Element-wise Adagrad (``torch.optim.Adagrad``; fbgemm's ``EXACT_ADAGRAD``, which the fused
    engine runs on the host for ``torch.optim.Adagrad``): one accumulator per weight. ``lr_decay``,
    ``weight_decay`` and ``initial_accumulator_value`` as torch's optimizer takes them (weight
    decay on the rows a step touches)."""

    lr: float = 0.01
    eps: float = 1e-10
    state_width: int = 0
    state_per_dim: int = 1
    lr_decay: float = 0.0
    weight_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        _check_adagrad(self, "Adagrad")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, t: int | None = None) -> torch.Tensor:
        dim = grads.shape[1]
        weights, state = rows[:, :dim], rows[:, dim : 2 * dim]
        grads, clr = _adagrad_terms(self, weights, grads, t)
        out = torch.empty((rows.shape[0], 2 * dim), dtype=rows.dtype)  # as RowWiseAdagrad's: no cat
        state = torch.addcmul(state, grads, grads, value=1.0, out=out[:, dim:])
        std = state.sqrt().add_(self.eps)
        torch.addcdiv(weights, grads, std, value=-clr, out=out[:, :dim])
        return out


@dataclass(frozen=True)
class Adam:
    """Lazy Adam (``torch.optim.SparseAdam``): the first and second moments per weight, moved only on
    the rows a step touches; bias correction by the optimizer step ``t`` (1 on the first)."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    state_width: int = 0
    state_per_dim: int = 2

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"Adam lr={self.lr} must be > 0")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"Adam {name}={getattr(self, name)} must be in [0, 1)")
        if not self.eps >= 0:
            raise ValueError(f"Adam eps={self.eps} must be >= 0")

    def apply(self, rows: torch.Tensor, grads: torch.Tensor, t: int | None = None) -> torch.Tensor:
        if t is None or t < 1:
            raise ValueError(f"Adam needs the optimizer step t >= 1 for its bias correction, got {t}")
        dim = grads.shape[1]
        weights, m, v = rows[:, :dim], rows[:, dim : 2 * dim], rows[:, 2 * dim : 3 * dim]
        m_new = grads.sub(m).mul_(1 - self.beta1).add_(m)
        v_new = grads.pow(2).sub_(v).mul_(1 - self.beta2).add_(v)
        denom = v_new.sqrt().add_(self.eps)
        step_size = self.lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)
        weights = weights.add(m_new.div(denom), alpha=-step_size)
        return torch.cat([weights, m_new, v_new], dim=1)


OPTIMIZERS = ("sgd", "adagrad", "adagrad-exact", "adam")


def make_optimizer(name: str, lr: float, eps: float = 1e-10) -> RowOptimizer:
    if name == "sgd":
        return SGD(lr=lr)
    if name == "adagrad":
        return RowWiseAdagrad(lr=lr, eps=eps)
    if name == "adagrad-exact":
        return Adagrad(lr=lr, eps=eps)
    if name == "adam":
        return Adam(lr=lr, eps=eps)
    raise ValueError(f"optimizer {name!r} must be one of {', '.join(OPTIMIZERS)}")
