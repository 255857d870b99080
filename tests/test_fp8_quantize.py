"""The FP8 quantizer is bit for bit an independent one written here from the format's definition
(E4M3: 4 exponent bits biased by 7, 3 mantissa bits, subnormals, no infinity, 0x7F / 0xFF NaN) and
the recipe's rule (the smallest power-of-two scale with amax <= 448 s, at least 2^-124), on edge
inputs: zeros, +-448, 464, 465, inf, NaN, subnormals, ties, bfloat16 sources. It runs in CI's torch
2.11 leg too (ci/oldest_torch.sh), where the cast itself gives NaN past 464."""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import pytest
import torch

from portapipe.fp8.quantize import (
    E4M3_MAX,
    MIN_SCALE,
    dequantize_blocks,
    dequantize_rows,
    pow2_scales,
    quantize_blocks,
    quantize_rows,
    saturate,
)

# ------------------------------------------------------------------ the independent quantizer
#: every non-negative finite E4M3 value, by code 0..126
TABLE = [Fraction(m, 8) * Fraction(2) ** -6 if e == 0 else (1 + Fraction(m, 8)) * Fraction(2) ** (e - 7) for e in range(16) for m in range(8)][:127]
NAN = 0x7F


def e4m3_code(v: float | Fraction) -> int:
    """Round to nearest E4M3, ties to the even code, saturated to +-448; NaN -> 0x7F (sign apart)."""
    if isinstance(v, float) and math.isnan(v):
        return NAN
    negative = v < 0 or (isinstance(v, float) and v == 0 and math.copysign(1.0, v) < 0)
    a = min(abs(Fraction(v) if not isinstance(v, float) or math.isfinite(v) else Fraction(448)), Fraction(448))
    lo = bisect.bisect_right(TABLE, a) - 1
    code = lo
    if lo < len(TABLE) - 1:
        d_lo, d_hi = a - TABLE[lo], TABLE[lo + 1] - a
        if d_hi < d_lo or (d_hi == d_lo and lo % 2 == 1):
            code = lo + 1
    return code | (0x80 if negative else 0)


def scale_of(amax: float) -> float:
    """The smallest power of two s with amax <= 448 s, at least 2^-124 (exact, by fractions)."""
    if math.isnan(amax) or math.isinf(amax):
        return amax
    a = max(Fraction(amax), 448 * Fraction(2) ** -124)
    k = -130
    while a > 448 * Fraction(2) ** k:
        k += 1
    return 2.0**k


def reference_rows(x: torch.Tensor) -> tuple[list[list[int]], list[list[float]]]:
    """(codes, scales) of the 1x128 tiles of a 2-D tensor, value by value in Python."""
    rows = x.float().tolist()
    codes, scales = [], []
    for row in rows:
        crow, srow = [], []
        for t in range(0, len(row), 128):
            tile = row[t : t + 128]
            amax = max((abs(v) for v in tile), default=0.0)
            if any(math.isnan(v) for v in tile):
                amax = math.nan
            s = scale_of(amax)
            srow.append(s)
            for v in tile:
                if math.isinf(s) or math.isnan(s) or math.isnan(v) or math.isinf(v) or v == 0:  # v == 0: keep its sign
                    crow.append(e4m3_code(v / s if not math.isnan(s) else math.nan))  # finite / inf: a signed zero
                else:
                    crow.append(e4m3_code(Fraction(v) / Fraction(s)))
        codes.append(crow)
        scales.append(srow)
    return codes, scales


def _same_codes(got: torch.Tensor, want: list[list[int]]) -> None:
    g = got.view(torch.uint8).tolist()
    for r, (grow, wrow) in enumerate(zip(g, want)):
        for c, (a, b) in enumerate(zip(grow, wrow)):
            if b & 0x7F == NAN:  # NaN: its sign bit is the arithmetic's, not the recipe's
                assert a & 0x7F == NAN, (r, c, a, b)
            else:
                assert a == b, (r, c, hex(a), hex(b))


# ---------------------------------------------------------------------------------- inputs
def edge_rows() -> torch.Tensor:
    """Rows of one or two tiles, each aiming at an edge of the recipe."""
    tiny32 = 1e-40  # a float32 subnormal
    rows = [
        [0.0] * 128,  # all zero: the floor, no division by zero
        [448.0, -448.0, 1.0, -0.0] + [0.0] * 124,  # the largest value: scale 1
        [464.0, 465.0, -464.0, 0.5] + [0.0] * 124,  # past 448: scale 2, nothing saturates in the scaled values
        [float("inf"), 1.0, -2.0] + [0.0] * 125,  # inf: the tile is not made finite
        [float("nan"), 3.0] + [0.0] * 126,  # NaN
        [tiny32, -tiny32, 0.0] + [0.0] * 125,  # float32 subnormals: the 2^-124 floor
        [448.0, 2.0**-10, 3 * 2.0**-10, 5 * 2.0**-10, 2.0**-9] + [0.0] * 123,  # E4M3 subnormal ties (scale 1)
        [448.0, 232.0, 248.0, 264.0, 9.5, 10.5] + [0.0] * 122,  # ties between normal E4M3 values, to the even code
        [3.0e38, -1.0, 2.0**-100] + [0.0] * 125,  # near float32's largest
        [1.0] * 100 + [2.0**-30] * 28 + [7.0] * 60,  # two tiles, the last one partial
    ]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)


# ----------------------------------------------------------------------------------- tests
def test_rows_equal_the_independent_quantizer_on_edge_inputs() -> None:
    x = edge_rows()
    q = quantize_rows(x)
    codes, scales = reference_rows(x)
    _same_codes(q.data, codes)
    got = q.scale.tolist()
    for r, (grow, wrow) in enumerate(zip(got, scales)):
        for a, b in zip(grow, wrow):
            assert (math.isnan(a) and math.isnan(b)) or a == b, (r, a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_random_sources_equal_the_independent_quantizer(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 300, generator=g) * torch.logspace(-6, 3, 300)).to(dtype)  # tiles of very different ranges
    q = quantize_rows(x)
    codes, scales = reference_rows(x)
    _same_codes(q.data, codes)
    assert q.scale.tolist() == scales


def test_scales_are_powers_of_two_that_fit_and_division_form_does_not_matter() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 256, generator=g, dtype=torch.float32) * 37.0
    q = quantize_rows(x)
    m, _ = torch.frexp(q.scale)
    assert bool((m == 0.5).all())  # every scale is a power of two
    amax = x.abs().unflatten(-1, (2, 128)).amax(-1)
    assert bool((amax <= E4M3_MAX * q.scale).all()) and bool((amax > E4M3_MAX * q.scale / 2).all())
    by_reciprocal = saturate(x * (1.0 / q.scale).repeat_interleave(128, -1))
    assert torch.equal(by_reciprocal.view(torch.uint8), q.data.view(torch.uint8))


def test_saturation_never_relies_on_the_cast() -> None:
    """2.11 / 2.12 cast 465 to NaN, 2.13 to 448: saturate gives 448 on every release."""
    got = saturate(torch.tensor([464.0, 465.0, 1e30, -465.0, float("inf"), float("nan")]))
    assert got.view(torch.uint8).tolist()[:5] == [0x7E, 0x7E, 0x7E, 0xFE, 0x7E]
    assert math.isnan(float(got[5].float()))


def test_non_finite_tiles_stay_non_finite_and_zero_tiles_stay_zero() -> None:
    x = edge_rows()
    back = dequantize_rows(quantize_rows(x))
    assert bool(torch.isnan(back[3, :128]).all()) and bool(torch.isnan(back[4, :128]).all())  # the whole tile
    assert bool((back[3:5, 128:] == 0).all()) and bool((back[0] == 0).all())  # the next tile and a zero one
    assert float(quantize_rows(x).scale[0, 0]) == MIN_SCALE


def test_dequantized_values_are_exact_in_bfloat16() -> None:
    """q * s with s >= 2^-124 is a bfloat16 number: decoding what travelled loses nothing."""
    x = edge_rows()
    finite = torch.isfinite(x).all(1)
    back = dequantize_rows(quantize_rows(x[finite]))
    assert torch.equal(back.to(torch.bfloat16).float(), back)


def test_requantizing_dequantized_values_gives_the_same_values() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 384, generator=g) * torch.logspace(-20, 10, 6).unsqueeze(1)
    once = dequantize_rows(quantize_rows(x))
    assert torch.equal(dequantize_rows(quantize_rows(once)), once)


def test_grouped_rows_restart_their_tiles_at_each_group() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 300, generator=g)
    x[:, 100:] *= 1000.0  # the groups have different ranges
    offs = [100, 100, 300]  # an empty group; a group of 200 rows: two tiles, the second partial
    q = quantize_rows(x, offs)
    assert q.scale.shape == (3, 1 + 0 + 2)
    want = [quantize_rows(x[:, 0:100]), quantize_rows(x[:, 100:300])]
    assert torch.equal(q.data.view(torch.uint8), torch.cat([w.data for w in want], 1).view(torch.uint8))
    assert torch.equal(q.scale, torch.cat([w.scale for w in want], 1))
    assert torch.equal(dequantize_rows(q, offs), torch.cat([dequantize_rows(w) for w in want], 1))
    # tiles that ignored the groups would mix columns 0..99 with 100..127: another answer
    assert not torch.equal(dequantize_rows(q, offs), dequantize_rows(quantize_rows(x)))


def test_blocks_equal_the_independent_quantizer_block_by_block() -> None:
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(200, 300, generator=g) * 0.05).to(torch.bfloat16)  # ceil-divided edges: 2 x 3 blocks
    w[130, 7] = 900.0  # one block with a larger amax
    q = quantize_blocks(w)
    assert q.scale.shape == (2, 3)
    for i in range(2):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            assert float(q.scale[i, j]) == scale_of(float(block.abs().max()))
            codes = [[e4m3_code(Fraction(v) / Fraction(float(q.scale[i, j]))) for v in row] for row in block.tolist()]
            _same_codes(q.data[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128], codes)
    back = dequantize_blocks(q)
    assert back.shape == w.shape and float((back - w.float()).abs().max()) <= 900.0 * 2.0**-4


def test_pow2_scales_from_the_exponent() -> None:
    got = pow2_scales(torch.tensor([448.0, 448.00003, 224.0, 224.00002, 0.0, 1.0, float("inf"), float("nan")]))
    assert got.tolist()[:6] == [1.0, 2.0, 0.5, 1.0, MIN_SCALE, 2.0**-8]
    assert math.isinf(got[6]) and math.isnan(got[7])


def test_float64_is_refused() -> None:
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        quantize_rows(torch.zeros(2, 128, dtype=torch.float64))
