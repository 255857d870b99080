"""What an FP8 Linear keeps of its input between forward and backward: the one place to change it.

The weight-gradient GEMM quantizes the layer's input 128x1 along the tokens, so the FP8 Linears
(:mod:`portapipe.models.linear`) keep what gives that input back. :func:`keep` turns a *source*
into the tensors given to ``ctx.save_for_backward`` and :func:`restore` turns them back:

- ``None``: the high-precision input itself (what autograd would keep for a bfloat16 Linear);
- a :class:`~portapipe.fp8.quantize.Quantized`: E4M3 values and their 1x128 scales, either the
  rows as an FP8 dispatch delivered them (the routed experts' up projection) or, under
  ``memory.fp8_activations``, the forward's own 1x128 quantization of the input. The backward
  takes their dequantization, exact in the compute dtype, as the input, and the weight gradient
  quantizes it 128x1 along the tokens: the 1x128 -> 128x1 re-tiling (docs/fp8.md says which
  values it rounds);
- a :class:`Remake`: nothing of the input, which the backward computes again from tensors kept
  anyway (under ``memory.fp8_activations``, the down projection's input from the SwiGLU's FP8
  input).

:func:`rows_once`: the 1x128 quantization of a tensor made once however many Linears read it
(an attention's q / k / v projections), so that they keep one FP8 copy, not one each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .quantize import Quantized, dequantize_rows, quantize_rows


@dataclass(frozen=True)
class Remake:
    """An input not kept: the backward makes it again as ``fn(*tensors)``."""

    fn: Callable[..., torch.Tensor]
    tensors: tuple[torch.Tensor, ...]


Source = Quantized | Remake | None


def keep(x: torch.Tensor, source: Source) -> tuple[tuple[torch.Tensor, ...], Callable[..., torch.Tensor] | None]:
    """(the tensors to save, the function that remakes the input from them or None) for a layer
    whose input is ``x`` and which keeps ``source`` of it (module docstring)."""
    if source is None:
        return (x,), None
    if isinstance(source, Quantized):
        return (source.data, source.scale), None
    return source.tensors, source.fn


def restore(saved: Sequence[torch.Tensor], remake: Callable[..., torch.Tensor] | None, dtype: torch.dtype) -> tuple[torch.Tensor, Quantized | None]:
    """(the input in ``dtype``, its FP8 rows when it was kept so) from :func:`keep`'s tensors."""
    if remake is not None:
        return remake(*saved), None
    if len(saved) == 1:
        return saved[0], None
    rows = Quantized(saved[0], saved[1])
    return dequantize_rows(rows).to(dtype), rows


def rows_once(x: torch.Tensor) -> Quantized:
    """``quantize_rows(x)``, made once per tensor and version: the Linears reading one input share
    its FP8 copy (and autograd's saved-tensor accounting sees one storage)."""
    memo = getattr(x, "_portapipe_fp8_rows", None)
    if memo is not None and memo[0] == x._version:
        return memo[1]
    q = quantize_rows(x.detach())  # values only: autograd would keep the quantizer's intermediates
    x._portapipe_fp8_rows = (x._version, q)  # lives as long as x: nothing is kept past it
    return q
