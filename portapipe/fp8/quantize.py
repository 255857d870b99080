"""The recipe's quantizer: E4M3 values with power-of-two scales over 1x128 tiles or 128x128 blocks.

For every tile (or block) of a float32 / bfloat16 / float16 tensor:

- ``amax``: the largest ``|x|`` of the tile (online, per call: no history);
- the dequantization scale ``s``: the smallest power of two with ``amax <= 448 s`` (the scale
  rounded up to a power of two, as UE8M0 stores it), and at least ``2^-124`` (:data:`MIN_SCALE`:
  an all-zero tile gets it instead of a division by zero, and with it every dequantized value
  is exact in bfloat16). It is found from ``amax``'s exponent and mantissa, never by rounding
  ``amax / 448``, so it is exact;
- the values ``x / s`` (exact: ``s`` is a power of two) saturated to +-448 and then cast to E4M3
  (round to nearest, ties to even; subnormals down to 2^-9). The saturation never relies on the
  cast: torch 2.11 and 2.12 cast values past 464 to NaN, 2.13 saturates them. A tile holding an
  inf or NaN gets that as its scale and dequantizes to NaN, so a non-finite value is never made
  finite: the training loop's check sees it.

Because the scale is a power of two, ``x / s``, ``x * (1 / s)`` and any other way of writing the
division give the same bytes.

Tiles: :func:`quantize_rows` (1x128 along the last dimension: activations, activation gradients;
with ``offs`` the tiles restart at each group of columns, which is how the weight-gradient GEMM's
operands are quantized 128x1 along the tokens of each expert's rows), :func:`quantize_blocks`
(128x128 over the last two dimensions: weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..backends.fp8_mm import E4M3, TILE, group_tiles, n_tiles

#: the largest finite E4M3 value
E4M3_MAX = 448.0
#: exponent of the smallest scale (UE8M0 reaches 2^-127; 2^-124 keeps q * s exact in bfloat16,
#: whose smallest subnormal is 2^-133 and an E4M3 value's lowest bit 2^-9)
MIN_SCALE_EXP = -124
MIN_SCALE = 2.0**MIN_SCALE_EXP
#: dtypes the quantizer reads (float64 is never quantized: it is the unquantized reference's)
SOURCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Quantized:
    """E4M3 ``data`` and its float32 dequantization ``scale`` (one per tile or block)."""

    data: torch.Tensor
    scale: torch.Tensor


def saturate(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` clamped to +-448, then cast to E4M3 (NaN stays NaN)."""
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def pow2_scales(amax: torch.Tensor) -> torch.Tensor:
    """The dequantization scale of each tile with largest magnitude ``amax`` (module docstring).

    ``amax = m 2^e`` with ``m`` in [0.5, 1) and ``448 = 0.875 2^9``: ``amax <= 448 2^k`` holds for
    ``k >= e - 9`` when ``m <= 0.875``, else for ``k >= e - 8``; the scale is built from its bits."""
    a = amax.float().clamp(min=E4M3_MAX * MIN_SCALE)  # NaN stays NaN
    m, e = torch.frexp(a)
    k = e - 9 + (m > 0.875).to(e.dtype)
    bits = (k.clamp(-126, 128) + 127).to(torch.int32) << 23  # k = 128: the bits of inf
    s = bits.view(torch.float32)
    return torch.where(torch.isfinite(a), s, a)


def _source(x: torch.Tensor) -> torch.Tensor:
    if x.dtype not in SOURCE_DTYPES:
        raise ValueError(f"the FP8 quantizer reads float32, bfloat16 or float16 tensors, not {x.dtype}")
    return x.float()


def quantize_rows(x: torch.Tensor, offs: Sequence[int] | None = None) -> Quantized:
    """1x128 tiles along the last dimension of ``x[..., K]``: ``scale[..., ceil(K/128)]``.

    With ``offs`` (cumulative ends of groups of columns; ``x`` 2-D) the tiles restart at each
    group's first column and ``scale`` is ``[R, tiles]`` over all groups' tiles in order
    (:func:`~portapipe.backends.fp8_mm.group_tiles`)."""
    xf = _source(x)
    if offs is None:
        k = xf.shape[-1]
        padded = F.pad(xf, (0, n_tiles(k) * TILE - k)).unflatten(-1, (n_tiles(k), TILE))
        scale = pow2_scales(padded.abs().amax(-1))
        q = saturate((padded / scale.unsqueeze(-1)).flatten(-2)[..., :k])
        return Quantized(q, scale)
    if x.dim() != 2:
        raise ValueError(f"grouped 1x128 tiles need a 2-D tensor, got shape {tuple(x.shape)}")
    spans = group_tiles(offs)
    if spans and spans[-1][1] != x.shape[1]:
        raise ValueError(f"groups ending at {list(offs)} do not cover the {x.shape[1]} columns")
    scales, qs = [], []
    for s, e, _, _ in spans:
        part = quantize_rows(xf[:, s:e])
        scales.append(part.scale)
        qs.append(part.data)
    scale = torch.cat(scales, 1) if scales else xf.new_zeros(x.shape[0], 0)
    data = torch.cat(qs, 1) if qs else torch.empty(x.shape[0], 0, dtype=E4M3, device=x.device)
    return Quantized(data, scale)


def dequantize_rows(q: Quantized, offs: Sequence[int] | None = None) -> torch.Tensor:
    """float32 values of :func:`quantize_rows`'s result (exact: a power-of-two scale times an E4M3 value)."""
    data = q.data.float()
    if offs is None:
        k = data.shape[-1]
        return data * q.scale.repeat_interleave(TILE, dim=-1)[..., :k]
    per_col = torch.empty_like(data)
    for s, e, ts, te in group_tiles(offs):
        per_col[:, s:e] = q.scale[:, ts:te].repeat_interleave(TILE, dim=-1)[:, : e - s]
    return data * per_col


def quantize_blocks(w: torch.Tensor) -> Quantized:
    """128x128 blocks over the last two dimensions of ``w[..., R, C]``: ``scale[..., ceil(R/128), ceil(C/128)]``."""
    wf = _source(w)
    r, c = wf.shape[-2:]
    rb, cb = n_tiles(r), n_tiles(c)
    padded = F.pad(wf, (0, cb * TILE - c, 0, rb * TILE - r)).unflatten(-1, (cb, TILE)).unflatten(-3, (rb, TILE))
    scale = pow2_scales(padded.abs().amax(dim=(-3, -1)))
    q = saturate(padded / scale.unsqueeze(-1).unsqueeze(-3))
    return Quantized(q.flatten(-2).flatten(-3, -2)[..., :r, :c], scale)


def block_scales_per_element(scale: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """128x128 block ``scale[..., rb, cb]`` spread over the ``[..., r, c]`` elements it scales."""
    return scale.repeat_interleave(TILE, dim=-2).repeat_interleave(TILE, dim=-1)[..., :r, :c]


def dequantize_blocks(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of 128x128-block data in ``dtype``: exact in float32 for power-of-two scales, and
    in float64 for any float32 scale (a published checkpoint's: 4 significant bits times 24)."""
    r, c = q.data.shape[-2:]
    return q.data.to(dtype) * block_scales_per_element(q.scale, r, c).to(dtype)
