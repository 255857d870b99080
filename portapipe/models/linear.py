"""Linear and grouped-linear layers whose weight gradient can be deferred to a W action.

Zero-bubble schedules split a backward into B (input gradient, needed at once by the previous
stage) and W (weight gradient, free to fill a bubble later). Here each layer computes its input
gradient inside autograd's backward and hands its weight gradient to
:func:`~portapipe.scheduling.wgrad.defer_weight_grad`: queued for the matching W action when the
executor's :class:`~portapipe.scheduling.wgrad.WeightGradQueue` is active, else computed in the
same backward. Both paths run the same arithmetic, so results are identical either way.

Under ``train.fp8`` (:mod:`portapipe.fp8`) a layer's three GEMMs run in FP8 instead
(:class:`Fp8LinearFunction`, :class:`Fp8GroupedLinearFunction`: the recipe's GEMMs,
:mod:`portapipe.fp8.gemm`), with the same deferral of the weight gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..backends.base import Backend
from ..fp8 import gemm
from ..fp8.quantize import Quantized, dequantize_rows, quantize_rows
from ..fp8.saved import Remake, Source, keep, restore, rows_once
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
    return _by_tile(lambda rows, tile_offs: backend.grouped_mm(x[rows], weight, tile_offs), x, weight, offs, tiles)


def _by_tile(
    mm: Callable[[slice, torch.Tensor], torch.Tensor], x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, tiles: Sequence[int]
) -> torch.Tensor:
    """``mm(rows, offsets within them)`` of each non-empty tile of ``x``'s rows, the outputs in order."""
    outs = [mm(rows, tile_offs) for rows, tile_offs in _tile_spans(offs, tiles, weight.shape[0], x.shape[0])]
    if len(outs) == 1:  # one call, or one non-empty tile: it holds every row
        return outs[0]
    return torch.cat(outs) if outs else x.new_empty(0, weight.shape[-1])


class Fp8LinearFunction(torch.autograd.Function):
    """:class:`LinearFunction` with its three GEMMs in FP8 (:mod:`portapipe.fp8.gemm`) through
    ``backend``'s FP8 matmul; outputs and gradients in the compute dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, heads: bool, backend: Backend, source: Source = None) -> torch.Tensor:
        """``source``: what is kept of ``x`` for the weight gradient (:mod:`portapipe.fp8.saved`);
        a :class:`~portapipe.fp8.quantize.Quantized` one is ``x``'s 1x128 quantization, which the
        forward GEMM then reads too."""
        rows = merge_heads(x) if heads else x
        if heads and source is not None:
            raise ValueError("the attention output projection keeps its input in the compute dtype (the attention keeps it anyway)")
        saved, ctx.remake = keep(x, source)
        ctx.save_for_backward(*saved, weight)
        ctx.param, ctx.heads, ctx.backend, ctx.shape = weight, heads, backend, x.shape  # ctx.param: see LinearFunction.forward
        xq = source if isinstance(source, Quantized) else quantize_rows(rows)
        xq = Quantized(xq.data.reshape(-1, weight.shape[1]), xq.scale.reshape(-1, xq.scale.shape[-1]))
        y = gemm.forward(backend, xq, gemm.weight_blocks(weight), x.dtype)
        return y.view(*rows.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None, None]:
        *kept, weight = ctx.saved_tensors
        backend: Backend = ctx.backend
        shape = ctx.shape
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = gemm.input_grad(backend, quantize_rows(g2), gemm.weight_blocks(weight), grad_out.dtype)
            if ctx.heads:  # back to [..., heads, seq, head_dim], as LinearFunction gives it
                grad_x = grad_x.view(*shape[:-3], shape[-2], shape[-3], shape[-1]).transpose(-3, -2)
            else:
                grad_x = grad_x.view(shape)
        grad_w = None
        if ctx.needs_input_grad[1]:
            x, _ = restore(kept, ctx.remake, weight.dtype)  # under fp8_activations: dequantized 1x128 rows, re-tiled 128x1 below
            x2 = (merge_heads(x) if ctx.heads else x).reshape(-1, weight.shape[1])
            grad_w = defer_weight_grad(ctx.param, lambda: gemm.weight_grad(backend, g2, x2, weight.dtype))
        return grad_x, grad_w, None, None, None


class Fp8GroupedLinearFunction(torch.autograd.Function):
    """:class:`GroupedLinearFunction` with its three GEMMs in FP8 (:mod:`portapipe.fp8.gemm`), one
    grouped FP8 matmul of the backend per tile, as there.

    ``rows``: the input's FP8 rows as a dispatch delivered them (1x128 tiles), taken as they are;
    ``x`` is then a stand-in of their shape that holds no data (autograd routes its gradient).
    ``fp8_input``: the weight gradient reads the input's FP8 values, as the rows that travel
    carry them (the routed experts' up projection: every row, travelled or not, so any layout
    computes what one process does). ``fp8_grad``: the same for the output's gradient (the down
    projection, whose output gradient travels in FP8 too). ``source``
    (:mod:`portapipe.fp8.saved`, without ``rows``): what is kept of ``x`` under
    ``memory.fp8_activations``: its 1x128 quantization (``True``: the one the forward makes) or a
    :class:`~portapipe.fp8.saved.Remake` (the down projection's input, from the SwiGLU's).
    """

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: Sequence[int],
        rows: Quantized | None, fp8_input: bool, fp8_grad: bool, source: Remake | bool | None = None,
    ) -> torch.Tensor:
        xq = quantize_rows(x) if rows is None else rows
        saved, ctx.remake = keep(x, rows if rows is not None else xq if source is True else source or None)
        ctx.save_for_backward(*saved, weight, offs)
        ctx.backend, ctx.tiles, ctx.param, ctx.flags = backend, tiles, weight, (fp8_input, fp8_grad)
        wq = gemm.weight_blocks(weight)

        def mm(r: slice, tile_offs: torch.Tensor) -> torch.Tensor:
            return gemm.grouped_forward(backend, Quantized(xq.data[r], xq.scale[r]), wq, tile_offs, weight.dtype)

        return _by_tile(mm, x, weight, offs, tiles)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        *kept, weight, offs = ctx.saved_tensors
        x, rows = restore(kept, ctx.remake, weight.dtype)
        backend: Backend = ctx.backend
        tiles, (fp8_input, fp8_grad) = ctx.tiles, ctx.flags
        grad_out = grad_out.contiguous()
        gq = quantize_rows(grad_out)
        grad_x = None
        if ctx.needs_input_grad[0]:
            wq = gemm.weight_blocks(weight)

            def mm(r: slice, tile_offs: torch.Tensor) -> torch.Tensor:
                return gemm.grouped_input_grad(backend, Quantized(gq.data[r], gq.scale[r]), wq, tile_offs, weight.dtype)

            grad_x = _by_tile(mm, grad_out, weight.transpose(1, 2), offs, tiles)
        grad_w = None
        if ctx.needs_input_grad[1]:
            if rows is None and fp8_input:
                x = dequantize_rows(quantize_rows(x))
            g = dequantize_rows(gq) if fp8_grad else grad_out

            def weight_grad() -> torch.Tensor:
                total = None
                for r, tile_offs in _tile_spans(offs, tiles, weight.shape[0], x.shape[0]):
                    part = gemm.grouped_weight_grad(backend, x[r], g[r], tile_offs, weight.dtype)
                    total = part if total is None else total.add_(part)
                return torch.zeros_like(weight) if total is None else total

            grad_w = defer_weight_grad(ctx.param, weight_grad)
        return grad_x, grad_w, None, None, None, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, heads: bool = False, fp8: Backend | None = None, source: Source = None) -> torch.Tensor:
    """``x @ weight.T``; with ``heads``, over the merged heads of ``x[..., heads, seq, head_dim]``;
    with ``fp8`` (a backend), its GEMMs in FP8 through that backend's FP8 matmul, keeping
    ``source`` of ``x`` (:class:`Fp8LinearFunction`)."""
    if fp8 is not None:
        return Fp8LinearFunction.apply(x, weight, heads, fp8, source)
    return LinearFunction.apply(x, weight, heads)


def grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, backend: Backend, tiles: Sequence[int] = (), fp8: bool = False,
    rows: Quantized | None = None, fp8_input: bool = False, fp8_grad: bool = False, source: Remake | bool | None = None,
) -> torch.Tensor:
    """Grouped ``x @ weight[g]``; with ``fp8``, in FP8 (:class:`Fp8GroupedLinearFunction`'s ``rows``,
    ``fp8_input``, ``fp8_grad``, ``source``)."""
    if fp8:
        return Fp8GroupedLinearFunction.apply(x, weight, offs, backend, tiles, rows, fp8_input, fp8_grad, source)
    return GroupedLinearFunction.apply(x, weight, offs, backend, tiles)


class Linear(nn.Module):
    """Bias-free linear layer (``weight[out, in]``) with a deferrable weight gradient; ``fp8`` (a
    backend, set by :func:`portapipe.models.fp8_layers.enable_fp8`): its GEMMs run in FP8, and
    with ``fp8_cache`` (``memory.fp8_activations``) it keeps its input's FP8 rows, shared with the
    other Linears reading the same tensor, for the weight gradient."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.fp8: Backend | None = None
        self.fp8_cache = False

    def forward(self, x: torch.Tensor, heads: bool = False, source: Source = None) -> torch.Tensor:
        """``source``: what to keep of ``x`` instead of ``x`` (:mod:`portapipe.fp8.saved`; FP8 only)."""
        if source is None and self.fp8 is not None and self.fp8_cache:
            source = rows_once(x)
        return linear(x, self.weight, heads, self.fp8, source)
