"""The tier's pooling and its backward in fbgemm's TBE kernels: the fused engine's own code on the host.

``pool(rows, indices, offsets, features, mode)`` pools a batch's bags over the rows the
step pulled (its unique rows, ``[n, dim]``, one leaf the gradient lands on): each of ``features``
features has the same number of bags, ``offsets`` (``features * B + 1``, feature-major) cut
``indices`` (positions in ``rows``) into them, and the result is ``[B, features * dim]``, each
feature's columns in turn, as torchrec's ``KeyedTensor`` holds them. Forward is TBE's host forward
(``split_embedding_codegen_forward_cpu``), backward its dense backward
(``split_embedding_backward_codegen_dense_cpu``): the per-row gradient of every unique row, summed
over every bag that used it, in one pass. The update is not TBE's: with several trainers the rows'
gradients are summed across them before any row moves (``recsys.group.TrainerGroup.aggregate``), then the
store's optimizer applies them (TBE on the host fuses the update into backward and has neither a
gradient-only mode nor Adam).

Every feature of one call shares one table (``rows``): TBE's per-feature table offset is 0 for each
and its indices are the positions the batch's keys were given (``torch.unique``'s inverse).
The outputs and row gradients are those of ``index_select`` / ``embedding_bag`` but for their last
bit: TBE sums a row's contributions in its own order, and MEAN multiplies by 1/L where torch divides.
A whole step of the tier (``scripts/bench_kernels.py``, 26 tables x 100k x 16, batch 1024, one
thread / two): 3.38 / 2.92 ms on these kernels, 3.50 / 2.67 on ``index_select`` (one id a bag);
84.1 / 56.8 against 125.0 / 65.4 on ``embedding_bag`` with the mlperf-v2 bags at dim 128.
"""

from __future__ import annotations

import torch
from fbgemm_gpu import split_table_batched_embeddings_ops_training  # noqa: F401  (loads the host ops)

MODES = {"sum": 0, "mean": 1}  # fbgemm's PoolingMode
_FP32 = 0  # fbgemm's SparseType.FP32, the output's type


def applies(rows: torch.Tensor, mode: str, weights: torch.Tensor | None) -> bool:
    """Whether ``pool`` takes this call: unweighted bags, SUM or MEAN, over at least one row on the
    host (with none, TBE's forward reads past its table offsets: torch's answers zeros). The caller
    checks that every feature has the same number of bags.
    Weighted bags stay with torch's ``embedding_bag``: TBE's weighted backward rounds its sums
    otherwise (a last bit of a row's gradient), which SGD at a large rate grows past 1e-5 of
    torchrec's module within a few steps (the equivalence suite's empty-batch test)."""
    on_host = rows.device.type == "cpu" and rows.dtype == torch.float32 and rows.shape[0] > 0
    return weights is None and mode in MODES and on_host


def pool(rows: torch.Tensor, indices: torch.Tensor, offsets: torch.Tensor, features: int, mode: str) -> torch.Tensor:
    """The pooled bags, ``[B, features * dim]`` (see the module's text)."""
    n, dim = rows.shape
    table_at = torch.zeros(features, dtype=torch.int64)  # every feature's table starts at row 0
    columns = torch.arange(features + 1, dtype=torch.int32) * dim
    cumsum = torch.zeros(features + 1, dtype=torch.int64)
    cumsum[-1] = n
    bits = max(n, 1).bit_length()
    return _Pool.apply(
        rows, indices.to(torch.int64), offsets.to(torch.int64), table_at, columns, cumsum, bits, MODES[mode]
    )


class _Pool(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, indices, offsets, table_at, columns, cumsum, bits, mode):
        rows = rows.contiguous()
        total = int(columns[-1])
        out = torch.ops.fbgemm.split_embedding_codegen_forward_cpu(
            rows.view(-1), table_at, columns, total, cumsum, indices, offsets, mode, None, _FP32
        )
        ctx.save_for_backward(rows, indices, offsets, table_at, columns, cumsum)
        ctx.bits, ctx.mode = bits, mode
        return out

    @staticmethod
    def backward(ctx, grad):
        rows, indices, offsets, table_at, columns, cumsum = ctx.saved_tensors
        dim = rows.shape[1]
        g = torch.ops.fbgemm.split_embedding_backward_codegen_dense_cpu(
            grad.contiguous(),
            rows.view(-1),
            table_at,
            columns,
            dim,
            cumsum,
            ctx.bits,
            indices,
            offsets,
            ctx.mode,
            None,
            0.0,
        )
        return g.view(rows.shape), None, None, None, None, None, None, None
