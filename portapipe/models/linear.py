"""Linear and grouped-linear layers whose weight gradient can be deferred to a W action.

Zero-bubble schedules split a backward into B (input gradient, needed at once by the previous
stage) and W (weight gradient, free to fill a bubble later). Here each layer computes its input
gradient inside autograd's backward and hands its weight gradient to
:func:`~portapipe.scheduling.wgrad.defer_weight_grad`: queued for the matching W action when the
executor's :class:`~portapipe.scheduling.wgrad.WeightGradQueue` is active, else computed in the
same backward. Both paths run the same arithmetic, so results are identical either way.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..backends.base import Backend
from ..scheduling.wgrad import defer_weight_grad


def merge_heads(o: torch.Tensor) -> torch.Tensor:
    """Attention heads ``o[..., heads, seq, head_dim]`` as rows ``[..., seq, heads * head_dim]`` (a copy)."""
    return o.transpose(-3, -2).flatten(-2)


class LinearFunction(torch.autograd.Function):
    """``y = x @ weight.T`` over the last dimension, with a deferrable weight gradient.

    With ``heads=True``, ``x`` is attention output ``[..., heads, seq, head_dim]`` and the
    product is taken over its merged heads. The merged copy is made again in backward instead of
    being kept: ``x`` itself is kept by the attention for its own backward, so nothing extra is.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, heads: bool = False) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        # The parameter itself: under saved-tensor hooks (memory accounting, zero-memory) saved
        # tensors come back as aliases, and a deferred gradient must land on the parameter.
        ctx.param = weight
        ctx.heads = heads
        return torch.matmul(merge_heads(x) if heads else x, weight.t())

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight = ctx.saved_tensors
        heads = ctx.heads
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.matmul(grad_out, weight)
            if heads:  # back to [..., heads, seq, head_dim], as a view (what the merge's backward gives)
                grad_x = grad_x.view(*x.shape[:-3], x.shape[-2], x.shape[-3], x.shape[-1]).transpose(-3, -2)
        grad_w = None
        if ctx.needs_input_grad[1]:
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = (merge_heads(x) if heads else x).reshape(-1, weight.shape[1])
            grad_w = defer_weight_grad(ctx.param, lambda: g2.t().matmul(x2))
        return grad_x, grad_w, None


class GroupedLinearFunction(torch.autograd.Function):
    """Rows of ``x[T, K]`` grouped by ``offs`` times ``weight[G, K, N]``, via ``backend.grouped_mm``.

    With ``tiles > 1`` there are ``tiles * G`` groups and group ``i`` uses ``weight[i % G]``:
    expert parallelism keeps each source rank's rows for an expert in a group of their own
    (see :mod:`portapipe.models.expert_parallel`), and the weight gradient sums the tiles in order.
    Forward, input gradient and weight gradient are all grouped matmuls of the backend, so a
    device kernel (fused CUDA grouped GEMM, npu_grouped_matmul) serves all three.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: int) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        ctx.backend, ctx.tiles = backend, tiles
        ctx.param = weight  # see LinearFunction.forward
        return backend.grouped_mm(x, _tile(weight, tiles), offs)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, offs = ctx.saved_tensors
        backend: Backend = ctx.backend
        tiles = ctx.tiles
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = backend.grouped_mm(grad_out, _tile(weight, tiles).transpose(1, 2), offs)
        grad_w = None
        if ctx.needs_input_grad[1]:

            def weight_grad() -> torch.Tensor:
                g = backend.grouped_mm(x.t(), grad_out, offs)
                return g if tiles == 1 else g.view(tiles, *weight.shape).sum(0)

            grad_w = defer_weight_grad(ctx.param, weight_grad)
        return grad_x, grad_w, None, None, None


def _tile(weight: torch.Tensor, tiles: int) -> torch.Tensor:
    return weight if tiles == 1 else weight.repeat(tiles, 1, 1)


def linear(x: torch.Tensor, weight: torch.Tensor, heads: bool = False) -> torch.Tensor:
    """``x @ weight.T``; with ``heads``, over the merged heads of ``x[..., heads, seq, head_dim]``."""
    return LinearFunction.apply(x, weight, heads)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: int = 1) -> torch.Tensor:
    return GroupedLinearFunction.apply(x, weight, offs, backend, tiles)


class Linear(nn.Module):
    """Bias-free linear layer (``weight[out, in]``) with a deferrable weight gradient."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor, heads: bool = False) -> torch.Tensor:
        return linear(x, self.weight, heads)
