"""Rotary position embeddings.

Two families:

- :func:`rope_tables` / :func:`apply_rope`: the portapipe model's (tables in float64, the first
  half of each head rotated against the second);
- :class:`Rotary`: the Hugging Face architectures' (deepseek_v3, qwen3_moe). Its tables are
  computed as transformers computes them, in float32 (inverse frequencies, angles, cos and sin,
  times the attention factor of yarn scaling), then cast to the model's dtype; the rotation is
  either over the two halves of the rotary dimensions or over interleaved pairs (DeepSeek's
  weights are laid out that way). Yarn scaling follows transformers' yarn parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch


def rope_tables(seq: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    half = head_dim // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float64) / max(half, 1)))
    ang = torch.outer(torch.arange(seq, dtype=torch.float64), inv)
    return ang.cos().to(dtype), ang.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x[..., seq, head_dim]`` whose rows sit at positions ``offset, offset + 1, ...``, or
    ``x[b, heads, seq, head_dim]`` whose rows sit at ``positions[b, seq]``."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    s = x.shape[-2]
    if positions is None:
        c, n = cos[offset : offset + s], sin[offset : offset + s]
    else:
        c, n = cos[positions][:, None], sin[positions][:, None]
    return torch.cat([x1 * c - x2 * n, x1 * n + x2 * c, rest], dim=-1)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_kind(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def softmax_scale(head_dim: int, scaling: dict[str, Any] | None) -> float:
    """deepseek_v3's attention scale: head_dim^-0.5, times yarn's mscale(factor, mscale_all_dim)^2."""
    scale = head_dim**-0.5
    if _yarn_kind(scaling) != "default" and scaling.get("mscale_all_dim"):  # type: ignore[union-attr]
        m = yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])  # type: ignore[index]
        scale = scale * m * m
    return scale


def inverse_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequency of each rotated pair [dim/2] in float32, factor applied to cos and sin)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if _yarn_kind(scaling) == "default":
        return 1.0 / pos_freqs, 1.0
    assert scaling is not None
    factor = scaling["factor"]
    orig = scaling["original_max_position_embeddings"]
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``orig``
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate = 1 - ramp  # high frequencies keep their rotation, low ones are interpolated
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv, float(attention_factor)


@dataclass
class Rotary:
    """RoPE over the last ``dim`` features of a head, tables as transformers makes them."""

    dim: int
    theta: float = 10000.0
    scaling: dict[str, Any] | None = None
    interleaved: bool = False
    _cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    def tables(self, seq: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[1, seq, dim]`` (the angles of the pairs, twice over), float32 math cast to ``dtype``."""
        key = (seq, dtype, device)
        if key not in self._cache:
            inv, factor = inverse_frequencies(self.dim, self.theta, self.scaling)
            angles = torch.arange(seq, dtype=torch.int64)[None, :, None].float() * inv
            emb = torch.cat((angles, angles), dim=-1)
            self._cache[key] = ((emb.cos() * factor).to(dtype).to(device), (emb.sin() * factor).to(dtype).to(device))
        return self._cache[key]

    def __call__(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x[batch, heads, seq, dim]`` whose rows sit at positions ``offset, offset + 1, ...``,
        or at ``positions[batch, seq]``.

        The tables broadcast as ``[1, 1, seq, dim]``, the shape transformers gives them: the
        layout of the gradients autograd produces depends on it, and with it the rounding of
        later float32 reductions (the q/k norms' backward).
        """
        cos, sin = self.tables(offset + x.shape[-2], x.dtype, x.device)
        if positions is not None:
            cos, sin = cos[0][positions], sin[0][positions]  # [batch, seq, dim]
        elif offset:
            cos, sin = cos[:, offset:], sin[:, offset:]
        if self.interleaved:
            # pairs (x0, x1), (x2, x3), ... each turned by one angle; the result holds the first
            # members, then the second ones (the same permutation for queries and keys).
            c, s = cos[..., : self.dim // 2].unsqueeze(1), sin[..., : self.dim // 2].unsqueeze(1)
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        # In transformers' order (the product with cos first, then the halves): the order in
        # which autograd receives x's gradient terms decides the layout of their sum.
        straight = x * cos.unsqueeze(1)
        x1, x2 = x[..., : self.dim // 2], x[..., self.dim // 2 :]
        return straight + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)
