"""Linear and grouped-linear layers whose weight gradient can be deferred to a W action.

Zero-bubble schedules split a backward into B (input gradient, needed at once by the previous
stage) and W (weight gradient, free to fill a bubble later). Here each layer computes its input
gradient inside autograd's backward and hands its weight gradient to
:func:`~portapipe.scheduling.wgrad.defer_weight_grad`: queued for the matching W action when the
executor's :class:`~portapipe.scheduling.wgrad.WeightGradQueue` is active, else computed in the
same backward. Both paths run the same arithmetic, so results are identical either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..backends.base import Backend
from ..scheduling.wgrad import accumulate_weight_grad, defer_weight_grad


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

    With ``tiles`` (rows per tile, in order) the rows are ``len(tiles)`` consecutive tiles of
    ``G`` groups each, and group ``g`` of every tile uses ``weight[g]``: expert parallelism keeps
    each source rank's rows for an expert in a group of their own (see
    :mod:`portapipe.models.expert_parallel`). Each tile is one grouped matmul over the weight as
    it is, so no tiled copy of the weights is ever made (at EP n one would hold n - 1 times the
    rank's expert weights); a group meets the same rows and weight as in one call. Each tile's
    weight gradient is accumulated on its own (into the master-dtype accumulator where there is
    one), in tile order: summing the tiles first would round their sum in the model's dtype,
    a rounding that one process, which accumulates each source's micro-batch apart, does not have. Forward, input gradient and weight gradient are all
    grouped matmuls of the backend, so a device kernel (fused CUDA grouped GEMM,
    npu_grouped_matmul) serves all three.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: Sequence[int]) -> torch.Tensor:
        ctx.save_for_backward(x, weight, offs)
        ctx.backend, ctx.tiles = backend, tiles
        ctx.param = weight  # see LinearFunction.forward
        return _rows_by_tile(backend, x, weight, offs, tiles)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x, weight, offs = ctx.saved_tensors
        backend: Backend = ctx.backend
        tiles = ctx.tiles
        grad_out = grad_out.contiguous()
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = _rows_by_tile(backend, grad_out, weight.transpose(1, 2), offs, tiles)
        grad_w = None
        if ctx.needs_input_grad[1]:
            spans = _tile_spans(offs, tiles, weight.shape[0], x.shape[0])
            if not spans:
                grad_w = defer_weight_grad(ctx.param, lambda: torch.zeros_like(weight))
            elif len(spans) == 1:
                rows, tile_offs = spans[0]
                grad_w = defer_weight_grad(ctx.param, lambda: backend.grouped_mm(x[rows].t(), grad_out[rows], tile_offs))
            else:  # each source's tile reaches the accumulator on its own, as its micro-batch does in one process
                for rows, tile_offs in spans:
                    accumulate_weight_grad(ctx.param, lambda rows=rows, offs=tile_offs: backend.grouped_mm(x[rows].t(), grad_out[rows], offs))
        return grad_x, grad_w, None, None, None


def _tile_spans(offs: torch.Tensor, tiles: Sequence[int], groups: int, n_rows: int) -> list[tuple[slice, torch.Tensor]]:
    """(rows, offsets within them) of each non-empty tile; one span of every row without tiles."""
    if len(tiles) <= 1:
        return [(slice(None), offs)]
    if len(offs) != len(tiles) * groups or sum(tiles) != n_rows:
        raise ValueError(f"{len(tiles)} tiles of {groups} groups holding {sum(tiles)} rows do not fit {len(offs)} offsets over {n_rows} rows")
    spans, start = [], 0
    for t, n in enumerate(tiles):
        if n:  # an empty tile adds nothing (and its matmul would take no rows)
            spans.append((slice(start, start + n), offs[t * groups:(t + 1) * groups] - start))
        start += n
    return spans


def _rows_by_tile(backend: Backend, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, tiles: Sequence[int]) -> torch.Tensor:
    """``backend.grouped_mm`` of each tile's rows with ``weight`` itself, the tiles' outputs in order."""
    outs = [backend.grouped_mm(x[rows], weight, tile_offs) for rows, tile_offs in _tile_spans(offs, tiles, weight.shape[0], x.shape[0])]
    if len(outs) == 1:  # one call, or one non-empty tile: it holds every row
        return outs[0]
    return torch.cat(outs) if outs else x.new_empty(0, weight.shape[-1])


def linear(x: torch.Tensor, weight: torch.Tensor, heads: bool = False) -> torch.Tensor:
    """``x @ weight.T``; with ``heads``, over the merged heads of ``x[..., heads, seq, head_dim]``."""
    return LinearFunction.apply(x, weight, heads)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: Sequence[int] = ()) -> torch.Tensor:
    return GroupedLinearFunction.apply(x, weight, offs, backend, tiles)


class Linear(nn.Module):
    """Bias-free linear layer (``weight[out, in]``) with a deferrable weight gradient."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor, heads: bool = False) -> torch.Tensor:
        return linear(x, self.weight, heads)
