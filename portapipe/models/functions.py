"""The model's activation and normalisation as autograd functions that keep little for backward.

Autograd on the written-out formulas would keep every intermediate as wide as the input. These
functions keep only their inputs (and a per-row scale) and recompute the rest in backward with
the same operations and the same derivative formulas, in the same order, as autograd on the
formulas, so values and gradients are those of the formulas bit for bit.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from . import remake
from ..fp8.quantize import Quantized, dequantize_rows, quantize_rows
from ..fp8.saved import Remake, keep, restore


def silu(x: torch.Tensor) -> torch.Tensor:
    # Written with exp and a division, which round the same whatever the element's position;
    # torch's fused silu may not (vector body vs scalar tail), and the expert inputs of an EP
    # run are laid out differently from a single process's.
    return x / (1 + torch.exp(-x))


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` of a fused gate/up projection output ``gu``, times an optional
    per-row ``scale``, keeping only ``gu`` (and ``scale``).

    Autograd on the written-out formula would keep ``exp(-gate)``, ``1 + exp(-gate)`` and
    ``silu(gate)`` as well (three width-sized tensors), and with a scale the unscaled product
    too. The backward recomputes them with the same operations and applies the same derivative
    formulas, in the same order, as autograd does for that formula, so the gradients are the
    same bit for bit.

    The routed experts pass their rows' router weights as ``scale``: weighting the activation
    instead of the expert's output is the same function (the down projection is linear), and
    the weight's gradient then needs only ``gu``, where weighting the output would keep the
    output (hidden-sized, top-k rows per token) for it.

    With ``kept`` (``gu``'s 1x128 FP8 rows, under ``memory.fp8_activations``) those are saved
    instead of ``gu``, and the backward reads their dequantization: the forward is unchanged, the
    gradients are the formula's at the FP8 values of ``gu``.
    """

    @staticmethod
    def forward(ctx: Any, gu: torch.Tensor, width: int, scale: torch.Tensor | None, kept: Quantized | None = None) -> torch.Tensor:
        saved, _ = keep(gu, kept)
        ctx.save_for_backward(scale, *saved)
        ctx.width, ctx.dtype = width, gu.dtype
        return swiglu_value(gu, width, scale)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, torch.Tensor | None, None]:
        scale, *saved = ctx.saved_tensors
        gu, _ = restore(saved, None, ctx.dtype)
        g, u = gu[..., : ctx.width], gu[..., ctx.width :]
        e = torch.exp(-g)
        d = 1 + e
        grad_scale = None
        if scale is not None:
            grad_scale = (grad * ((g / d) * u)).sum(-1)  # mul: d(p*scale)/dscale = p
            grad = grad * scale.unsqueeze(-1)  # mul: d(p*scale)/dp = scale
        grad_s = grad * u  # mul: d(s*u)/ds
        grad_u = grad * (g / d)  # mul: d(s*u)/du = s
        grad_d = -grad_s * ((g / d) / d)  # div, denominator: -grad * (a / b) / b
        grad_g = grad_s / d + (grad_d * e).neg()  # div numerator + exp(-g) through exp and neg
        return torch.cat([grad_g, grad_u], dim=-1), None, grad_scale, None


def swiglu_value(gu: torch.Tensor, width: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The formula :class:`SwiGLU` computes, without autograd's bookkeeping."""
    out = silu(gu[..., :width]) * gu[..., width:]
    return out if scale is None else out * scale.unsqueeze(-1)


def swiglu(gu: torch.Tensor, width: int, scale: torch.Tensor | None = None, kept: Quantized | None = None) -> torch.Tensor:
    """silu(gate) * up of a fused gate/up projection output, each row times ``scale`` when given
    (saves only ``gu``, or its FP8 rows ``kept``, and ``scale`` for backward)."""
    return SwiGLU.apply(gu, width, scale, kept)


def swiglu_fp8_kept(gu: torch.Tensor, width: int, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, Remake]:
    """:func:`swiglu` keeping ``gu``'s 1x128 FP8 rows (``memory.fp8_activations``), and how the
    down projection remakes its input from them in the backward instead of keeping it (the same
    tensors: one copy is kept)."""
    kept = quantize_rows(gu.detach())  # values only: autograd would keep the quantizer's intermediates
    out = swiglu(gu, width, scale, kept)
    tensors = (kept.data, kept.scale) if scale is None else (kept.data, kept.scale, scale)
    return out, Remake(functools.partial(_swiglu_of_rows, width, gu.dtype), tensors)


def _swiglu_of_rows(width: int, dtype: torch.dtype, data: torch.Tensor, scale: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    return swiglu_value(dequantize_rows(Quantized(data, scale)).to(dtype), width, weights)


class _RMSNorm(torch.autograd.Function):
    """``x * rsqrt(mean(x^2) + eps) * weight``, keeping ``x`` and the row scale only.

    Autograd on the formula would keep ``x * rsqrt(...)`` too (as wide as ``x``). The backward
    recomputes it and applies the derivative formulas autograd uses for the formula, in the same
    order. ``x`` comes in twice so that its two gradient terms (through the product and through
    the square) reach ``x`` as two separate terms, as they do from the formula's graph: the sum
    with ``x``'s other gradients (the residual's) is then formed in the same order.

    With a ``compute`` dtype other than ``x``'s, the normalisation runs in it and its result is
    cast back before the gain: ``weight * (xc * rsqrt(mean(xc^2) + eps)).to(x.dtype)`` with
    ``xc = x.to(compute)`` (transformers' RMSNorm computes in float32 this way); then the two
    gradient terms of ``xc`` are summed in the compute dtype before the cast back, as autograd
    does on that formula.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, x_sq: torch.Tensor, weight: torch.Tensor, eps: float, compute: torch.dtype) -> torch.Tensor:
        xc, xc_sq = x.to(compute), x_sq.to(compute)
        r = torch.rsqrt(xc_sq.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, r, weight)
        return (xc * r).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        x, r, weight = ctx.saved_tensors
        xc = x.to(r.dtype)
        grad_xr = (grad * weight).to(r.dtype)
        grad_w = (grad * (xc * r).to(x.dtype)).sum_to_size(weight.shape)
        grad_x = grad_xr * r
        grad_r = (grad_xr * xc).sum_to_size(r.shape)
        grad_mean = -0.5 * grad_r * r.pow(3)  # rsqrt; adding eps passes the gradient on
        grad_sq = grad_mean.expand(x.shape) / x.shape[-1]  # mean over the last dim
        grad_x_sq = grad_sq * (2.0 * xc.pow(1.0))  # pow(2)
        if xc is x:
            return grad_x, grad_x_sq, grad_w, None, None
        # One cast feeds both terms: they meet in the compute dtype, then go back through the cast.
        return (grad_x + grad_x_sq).to(x.dtype), None, grad_w, None, None


class RMSNorm(nn.Module):
    """RMSNorm with a gain; ``precision`` (e.g. float32) is the dtype the normalisation runs in
    (None: the input's)."""

    def __init__(self, dim: int, dtype: torch.dtype, eps: float = 1e-6, precision: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.precision = precision
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _RMSNorm.apply(x, x, self.weight, self.eps, self.precision or x.dtype)
        if remake.active():  # the output can be made again from x, which the norm keeps anyway
            source = remake.later(x)
            remake.remakes(out, remake.once(lambda: self._again(source())))
        return out

    def _again(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return _RMSNorm.apply(x, x, self.weight, self.eps, self.precision or x.dtype)
