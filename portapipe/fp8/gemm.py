"""The three GEMMs of a Linear under DeepSeek-V3's recipe, each through the backend's FP8 matmul.

For ``y = x @ W.T`` (``x[T, in]`` tokens by channels, ``W[out, in]``; routed experts keep
``W[g]`` as ``[in, out]``):

- forward ``y = x W^T``: ``x`` in 1x128 tiles (per token, 128 input channels), ``W`` in 128x128
  blocks, output in the compute dtype;
- input gradient ``dx = dy W``: ``dy`` in 1x128 tiles (never 128x128: the report's appendix
  B.2 saw that diverge), ``W`` in its 128x128 blocks, transposed with their scales;
- weight gradient ``dW = dy^T x``, contracted over the tokens: both operands quantized 128x1
  along the tokens, from the high-precision tensors (never by re-tiling already quantized
  1x128 data); for the routed experts the tiles restart at each group of rows (an expert's rows
  from one source), so a row's tile is the one it has in a single process.

The quantizer is :mod:`portapipe.fp8.quantize`; the matmul is the backend's
(:meth:`~portapipe.backends.base.Backend.fp8_mm`, :meth:`~portapipe.backends.base.Backend.fp8_grouped_mm`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..backends.base import Backend
from .quantize import Quantized, quantize_blocks, quantize_rows


def weight_blocks(weight: torch.Tensor) -> Quantized:
    """A weight's 128x128 blocks (over its last two dimensions), quantized at each use: the
    weights change at every optimizer step and a forward and its backward see the same ones."""
    return quantize_blocks(weight)


def _t(q: Quantized) -> Quantized:
    """Data and scales transposed over their last two dimensions."""
    return Quantized(q.data.transpose(-2, -1), q.scale.transpose(-2, -1))


# -------------------------------------------------------------------------------------- dense
def forward(backend: Backend, xq: Quantized, w: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """``x W^T`` of 1x128 ``xq[T, in]`` and the blocks of ``W[out, in]``."""
    wt = _t(w)
    return backend.fp8_mm(xq.data, xq.scale, wt.data, wt.scale, dtype)


def input_grad(backend: Backend, gq: Quantized, w: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """``dy W`` of 1x128 ``gq[T, out]`` and the blocks of ``W[out, in]``."""
    return backend.fp8_mm(gq.data, gq.scale, w.data, w.scale, dtype)


def weight_grad(backend: Backend, g: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dy^T x`` of high-precision ``g[T, out]`` and ``x[T, in]``, each quantized 128x1 along T."""
    gt, xt = quantize_rows(g.t()), quantize_rows(x.t())
    return backend.fp8_mm(gt.data, gt.scale, xt.data.t(), xt.scale.t(), dtype)


# ------------------------------------------------------------------------- grouped (experts)
def grouped_forward(backend: Backend, xq: Quantized, w: Quantized, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of 1x128 ``xq[T, K]`` grouped by ``offs`` times the blocks of ``W[G, K, N]``."""
    return backend.fp8_grouped_mm(xq.data, xq.scale, w.data, w.scale, offs, dtype)


def grouped_input_grad(backend: Backend, gq: Quantized, w: Quantized, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows of 1x128 ``gq[T, N]`` grouped by ``offs`` times the blocks of ``W[G, K, N]``, transposed."""
    wt = _t(w)
    return backend.fp8_grouped_mm(gq.data, gq.scale, wt.data, wt.scale, offs, dtype)


def grouped_weight_grad(backend: Backend, x: torch.Tensor, g: torch.Tensor, offs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[G, K, N]``: each group's ``x_g^T g_g`` of high-precision ``x[T, K]`` and ``g[T, N]``,
    quantized 128x1 along each group's rows."""
    ends: Sequence[int] = [int(e) for e in offs.tolist()]
    xt, gt = quantize_rows(x[: ends[-1] if ends else 0].t(), ends), quantize_rows(g[: ends[-1] if ends else 0].t(), ends)
    return backend.fp8_grouped_mm(xt.data, xt.scale, gt.data.t(), gt.scale.t(), offs, dtype)
