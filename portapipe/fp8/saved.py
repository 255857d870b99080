"""What an FP8 Linear keeps of its input between forward and backward: the one place to change it.

The weight-gradient GEMM quantizes the layer's input 128x1 along the tokens from the
high-precision tensor, so the FP8 Linears (:mod:`portapipe.fp8.linear`) keep what gives it back:

- a dense or routed layer fed a high-precision input keeps that tensor itself (what autograd
  would keep for a bfloat16 Linear; the memory options see it as before);
- the routed experts' up projection fed FP8 rows as a dispatch delivered them keeps those E4M3
  values and their 1x128 scales (the high-precision tensor it has is their exact dequantization).

:func:`keep` gives the tensors to ``ctx.save_for_backward`` and :func:`restore` turns them back
into the input; a cached-activation option (FP8-cached activations) replaces these two.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .quantize import Quantized, dequantize_rows


def keep(x: torch.Tensor, fp8_rows: Quantized | None) -> tuple[torch.Tensor, ...]:
    """The tensors saved for the weight gradient of a layer whose input is ``x``, or ``fp8_rows``
    when it arrived quantized (``x`` is then a stand-in holding no data)."""
    return (x,) if fp8_rows is None else (fp8_rows.data, fp8_rows.scale)


def restore(saved: Sequence[torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, Quantized | None]:
    """(the input in ``dtype``, its FP8 rows when it arrived so) from :func:`keep`'s tensors."""
    if len(saved) == 1:
        return saved[0], None
    rows = Quantized(saved[0], saved[1])
    return dequantize_rows(rows).to(dtype), rows
