"""The FP8 matmul's reference semantics (the emulation every device is held to) and its operand rules.

Operands are E4M3 (``torch.float8_e4m3fn``) values with float32 dequantization scales, one per
128-wide block of the contracted dimension K (DeepSeek-V3's fine-grained scaling):

- ``a[M, K]`` with ``a_scale[M, ceil(K/128)]``: 1x128 tiles (one scale per row and K block);
- ``b[K, N]`` with either ``b_scale[ceil(K/128), ceil(N/128)]``: 128x128 blocks (a weight), or
  ``b_scale[ceil(K/128), N]``: 128x1 tiles (one scale per column and K block; the weight-gradient
  GEMM's second operand, quantized along the tokens). The shape says which; with N = 1 the two
  are the same thing.

The emulation (:func:`fp8_mm_emulated`): for each 128-wide block of K, the products of the E4M3
values are summed exactly (in float64: an E4M3 product is a multiple of 2^-18 below 2^18, so a
sum of 128 of them needs at most 43 bits), multiplied by the two blocks' scales (exact for
power-of-two scales), rounded to float32 and added to a float32 accumulator, block after block in
K order; the result is rounded to ``out_dtype`` once. A K block past the end of K (K not a multiple
of 128) holds the remaining columns only. Hopper's tensor cores do the same up to the order of the
sums inside a block and their truncation (about 14 bits) before each promotion to float32, which
the conformance kit bounds (:mod:`portapipe.testing`).

Grouped forms (the routed experts), per group the dense semantics above:

- 2d x 3d: rows of ``a[T, K]`` grouped by ``offs`` (cumulative ends), ``b[G, K, N]`` with
  ``b_scale[G, ceil(K/128), ceil(N/128)]`` -> ``[T, N]`` (rows past the last group: zeros);
- 2d x 2d (the weight gradient): ``a[M, T]`` and ``b[T, N]`` grouped along the contracted T; each
  group's 128-wide tiles start at the group's first row (:func:`group_tiles`), so ``a_scale`` is
  ``[M, tiles]`` and ``b_scale`` ``[tiles, N]`` over all groups' tiles in order -> ``[G, M, N]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: the width of a scaling tile / block along every dimension the recipe tiles
TILE = 128
E4M3 = torch.float8_e4m3fn


def n_tiles(n: int) -> int:
    """128-wide tiles covering ``n`` (the last one may be partial)."""
    return -(-n // TILE)


def group_tiles(offs: Sequence[int]) -> list[tuple[int, int, int, int]]:
    """(first row, end row, first tile, end tile) of each group of rows ending at ``offs``: each
    group's tiles start at its first row, so a tile never mixes two groups."""
    out, start, tile = [], 0, 0
    for end in offs:
        end = int(end)
        t = n_tiles(end - start)
        out.append((start, end, tile, tile + t))
        start, tile = end, tile + t
    return out


def operand_problem(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> str | None:
    """What is wrong with these dense FP8 matmul operands (one line), or None."""
    if a.dtype != E4M3 or b.dtype != E4M3:
        return f"fp8_mm takes float8_e4m3fn operands, got {a.dtype} and {b.dtype}"
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        return f"fp8_mm: shapes {tuple(a.shape)} and {tuple(b.shape)} do not multiply"
    m, k = a.shape
    n = b.shape[1]
    if a_scale.dtype != torch.float32 or b_scale.dtype != torch.float32:
        return f"fp8_mm: scales must be float32, got {a_scale.dtype} and {b_scale.dtype}"
    if tuple(a_scale.shape) != (m, n_tiles(k)):
        return f"fp8_mm: a_scale has shape {tuple(a_scale.shape)}, want ({m}, {n_tiles(k)}) (1x128 tiles of a[{m}, {k}])"
    if tuple(b_scale.shape) not in ((n_tiles(k), n_tiles(n)), (n_tiles(k), n)):
        return (f"fp8_mm: b_scale has shape {tuple(b_scale.shape)}, want ({n_tiles(k)}, {n_tiles(n)}) (128x128 blocks of "
                f"b[{k}, {n}]) or ({n_tiles(k)}, {n}) (128x1 tiles)")
    return None


def _check(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor) -> None:
    problem = operand_problem(a, a_scale, b, b_scale)
    if problem:
        raise ValueError(problem)


def column_scales(b_scale: torch.Tensor, n: int) -> torch.Tensor:
    """``b_scale`` as one scale per (K block, column): 128x128 blocks repeated over their columns."""
    if b_scale.shape[-1] == n:
        return b_scale
    return b_scale.repeat_interleave(TILE, dim=-1)[..., :n]


def fp8_mm_emulated(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` under the reference semantics (module docstring), computed where the operands are."""
    _check(a, a_scale, b, b_scale)
    m, k = a.shape
    n = b.shape[1]
    sb = column_scales(b_scale, n).double()
    sa = a_scale.double()
    acc = torch.zeros(m, n, dtype=torch.float32, device=a.device)
    for kb in range(n_tiles(k)):
        cols = slice(kb * TILE, min(k, (kb + 1) * TILE))
        exact = a[:, cols].double() @ b[cols].double()  # every partial sum is exact in float64
        acc += (exact * sa[:, kb : kb + 1] * sb[kb]).float()
    return acc.to(out_dtype)


def fp8_grouped_mm_emulated(
    a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, offs: torch.Tensor, out_dtype: torch.dtype,
    mm: object = None,
) -> torch.Tensor:
    """The grouped forms (module docstring), one dense FP8 matmul per group: ``mm`` (default the
    emulation), the dense operation of whoever calls, with :func:`fp8_mm_emulated`'s arguments."""
    dense = fp8_mm_emulated if mm is None else mm
    ends = [int(x) for x in offs.tolist()]
    if a.dim() == 2 and b.dim() == 3:
        if b.shape[0] != len(ends) or b_scale.dim() != 3 or b_scale.shape[0] != len(ends):
            raise ValueError(f"fp8_grouped_mm: b {tuple(b.shape)} / b_scale {tuple(b_scale.shape)} do not hold {len(ends)} groups")
        out = torch.zeros(a.shape[0], b.shape[2], dtype=out_dtype, device=a.device)
        start = 0
        for g, end in enumerate(ends):
            if end > start:
                out[start:end] = dense(a[start:end], a_scale[start:end], b[g], b_scale[g], out_dtype)  # type: ignore[operator]
            start = end
        return out
    if a.dim() == 2 and b.dim() == 2:
        spans = group_tiles(ends)
        tiles = spans[-1][3] if spans else 0
        if a_scale.shape != (a.shape[0], tiles) or b_scale.shape != (tiles, b.shape[1]):
            raise ValueError(
                f"fp8_grouped_mm: scales {tuple(a_scale.shape)} and {tuple(b_scale.shape)} do not hold the {tiles} "
                f"per-group 128-row tiles of offs {ends} (want ({a.shape[0]}, {tiles}) and ({tiles}, {b.shape[1]}))"
            )
        out = torch.zeros(len(ends), a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
        for g, (s, e, ts, te) in enumerate(spans):
            if e > s:
                out[g] = dense(a[:, s:e], a_scale[:, ts:te], b[s:e], b_scale[ts:te], out_dtype)  # type: ignore[operator]
        return out
    raise ValueError(f"fp8_grouped_mm: unsupported shapes {tuple(a.shape)} x {tuple(b.shape)}")
