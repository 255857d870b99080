"""torch's blockwise FP8 matmul (``torch._scaled_mm`` with DeepSeek-style scaling), as cuBLASLt takes it.

The rules (torch 2.11-2.13: the meta function of ``aten._scaled_mm`` and ATen's ScaledBlas.cpp):

- ``a[M, K]`` row-major, ``b[K, N]`` column-major, both E4M3; K and N multiples of 16;
- 1x128 tiles (``a``, and ``b`` read as ``b.t()`` in the weight-gradient pair): scales
  ``[rows, ceil(K/128)]`` stored outer-dim-major (stride ``[1, rows]``);
- 128x128 blocks (``b``): ``b.t()``'s scales ``[ceil(N/128), ceil(K/128)]`` with a row stride
  padded to ``round_up(ceil(K/128), 4)`` (16-byte aligned; torch before that fix gave wrong
  results where ``ceil(K/128) % 4 != 0``, which the one-time probe catches);
- the output dtype given explicitly (left out, cuBLAS fails with an opaque error);
- the DeepSeek pairs (1x128 x 128x128, 1x128 x 1x128) only on compute capability 9.x with
  cuBLASLt >= 12.9: where they are missing, the call raises, and the probe says why.

:func:`blockwise_mm` lays operands out so (padding K to a multiple of 128 with zeros, as the
weight gradient's token counts need, and N to a multiple of 16), calls the function it is given
and cuts the padding off. :func:`probe` runs it once on operands with ``ceil(K/128) = 3`` and
compares it with the emulation within the conformance kit's bounds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .fp8_mm import E4M3, TILE, fp8_mm_emulated, n_tiles


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad_k(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """K padded to a multiple of 128 with zero columns of ``a`` / rows of ``b`` (the last tile's
    scale covers them), and N to a multiple of 16 with zero columns of ``b``."""
    k, n = a.shape[1], b.shape[1]
    pk, pn = round_up(k, TILE) - k, round_up(n, 16) - n
    if pk:  # float8 has no pad kernel everywhere: pad the bytes
        a = F.pad(a.view(torch.uint8), (0, pk)).view(E4M3)
        b = F.pad(b.view(torch.uint8), (0, 0, 0, pk)).view(E4M3)
    if pn:  # within the last 128-wide block: 128x128 scales already cover it
        b = F.pad(b.view(torch.uint8), (0, pn)).view(E4M3)
        if b_scale.shape[1] == n:  # 128x1 tiles: one scale per column
            b_scale = F.pad(b_scale, (0, pn), value=1.0)
    return a, a_scale, b, b_scale


def outer_major(scale: torch.Tensor) -> torch.Tensor:
    """``scale[rows, kb]`` stored with stride ``[1, rows]`` (1x128 scales)."""
    return scale.t().contiguous().t()


def padded_blocks(scale: torch.Tensor) -> torch.Tensor:
    """128x128 ``scale[kb, nb]`` as torch reads ``b.t()``'s: ``[nb, kb]`` rows padded to a multiple of 4, transposed back."""
    kb, nb = scale.shape
    buf = torch.zeros(nb, round_up(kb, 4), dtype=scale.dtype, device=scale.device)
    buf[:, :kb] = scale.t()
    return buf[:, :kb].t()


def blockwise_mm(
    scaled_mm: Callable[..., torch.Tensor], a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """:meth:`~portapipe.backends.base.Backend.fp8_mm`'s operands through ``scaled_mm``
    (``torch._scaled_mm``'s signature), laid out as the module docstring says."""
    m, n = a.shape[0], b.shape[1]
    columns = b_scale.shape[1] == n and n_tiles(n) != n  # 128x1 tiles of b (n = 1: either reading is one)
    a, a_scale, b, b_scale = _pad_k(a, a_scale, b, b_scale)
    sb = b_scale.contiguous() if columns else padded_blocks(b_scale)
    out = scaled_mm(a.contiguous(), b.t().contiguous().t(), outer_major(a_scale), sb, out_dtype=out_dtype)
    return out[:m, :n]


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref`` in dB (inf when equal)."""
    ref64, x64 = ref.double(), x.double()
    noise = float((x64 - ref64).pow(2).sum())
    return float("inf") if noise == 0 else 10.0 * torch.log10(ref64.pow(2).sum() / noise).item()


def calc_diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    """DeepGEMM's ``calc_diff``: ``1 - 2 sum(x y) / sum(x^2 + y^2)`` (0 when equal)."""
    x64, y64 = x.double(), ref.double()
    denom = float((x64 * x64 + y64 * y64).sum())
    return 0.0 if denom == 0 else 1.0 - 2.0 * float((x64 * y64).sum()) / denom


#: how far a device's FP8 matmul may sit from the emulation (the conformance kit's bounds): they
#: differ in the order of the sums inside a block and the tensor cores' truncation only
KIT_SQNR_DB = 40.0
KIT_CALC_DIFF = 1e-4


def probe_operands(device: Any, m: int = 64, k: int = 3 * TILE, n: int = 2 * TILE, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random E4M3 operands with power-of-two scales (1x128 a, 128x128 b), made on the CPU, moved to ``device``."""
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 8).to(E4M3)
    b = (torch.randn(k, n, generator=g) * 8).to(E4M3)
    sa = torch.exp2(torch.randint(-4, 4, (m, n_tiles(k)), generator=g).float())
    sb = torch.exp2(torch.randint(-4, 4, (n_tiles(k), n_tiles(n)), generator=g).float())
    return tuple(t.to(device) for t in (a, sa, b, sb))


def probe(scaled_mm: Callable[..., torch.Tensor] | None, device: Any) -> str | None:
    """Why the blockwise matmul cannot serve on ``device`` (one line), or None when it can: present,
    runs on operands whose ``ceil(K/128)`` is 3, and agrees with the emulation within the kit's bounds."""
    if scaled_mm is None:
        return "this torch has no torch._scaled_mm"
    try:
        a, sa, b, sb = probe_operands(device)
        got = blockwise_mm(scaled_mm, a, sa, b, sb, torch.float32)
    except Exception as exc:  # the device or cuBLASLt lacks DeepSeek-style scaling: torch says which
        return f"torch._scaled_mm with 1x128 x 128x128 scaling failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    want = fp8_mm_emulated(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float32)
    s, d = sqnr_db(got.cpu(), want), calc_diff(got.cpu(), want)
    if not (s >= KIT_SQNR_DB and d < KIT_CALC_DIFF):
        return f"torch._scaled_mm's blockwise result is off the emulation (SQNR {s:.1f} dB, calc_diff {d:.2e}): wrong results, not used"
    return None
