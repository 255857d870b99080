"""Causal self-attention of each architecture: ``[batch, seq, hidden] -> [batch, seq, hidden]``.

- :class:`Attention` (portapipe): multi-head attention with RoPE over the whole head.
- :class:`GroupedQueryAttention` (qwen3_moe): fewer key/value heads than query heads, an
  RMSNorm over each query and key head before RoPE.
- :class:`LatentAttention` (deepseek_v3): multi-head latent attention. Queries come through a
  low-rank projection (or a full one), keys and values from one shared low-rank latent; each
  head's query/key is a part without position (``qk_nope_head_dim``) and a rotary part
  (``qk_rope_head_dim``) whose key is one for all heads.

The Hugging Face architectures follow transformers' arithmetic: their norms run in float32
(:class:`~portapipe.models.functions.RMSNorm` with ``precision``), their RoPE tables are made in
float32 (:class:`~portapipe.models.rope.Rotary`), and in float64 the attention is computed as
transformers' eager attention, whose softmax rounds to float32 (:func:`attend`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from . import remake
from .functions import RMSNorm
from .linear import Linear
from .rope import Rotary, apply_rope, rope_tables, softmax_scale

#: dtype the Hugging Face architectures' norms, router scores and attention softmax run in
HF_PRECISION = torch.float32


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.hidden // cfg.n_heads
        self.wq = Linear(cfg.hidden, cfg.hidden, dtype)
        self.wk = Linear(cfg.hidden, cfg.hidden, dtype)
        self.wv = Linear(cfg.hidden, cfg.hidden, dtype)
        self.wo = Linear(cfg.hidden, cfg.hidden, dtype)
        cos, sin = rope_tables(cfg.seq_len, self.head_dim, dtype)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``x[b, s, hidden]`` at positions ``offset .. offset + s - 1`` (a multi-token prediction
        module's rows sit at the positions of the tokens they embed), or, given ``positions[b, s]``,
        at those, each token attending only inside its document (:func:`document_mask`)."""
        b, s, h = x.shape
        if offset + s > self.cos.shape[0]:
            raise ValueError(f"sequence length {offset + s} exceeds model.seq_len = {self.cos.shape[0]}")

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)

        q = apply_rope(heads(self.wq(x)), self.cos, self.sin, offset, positions)
        k = apply_rope(heads(self.wk(x)), self.cos, self.sin, offset, positions)
        v = heads(self.wv(x))
        if positions is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(positions))
        # wo merges the heads itself and keeps ``o`` (kept by the attention anyway), not a copy.
        return self.wo(o, heads=True)


def document_mask(positions: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]``, True where token i may attend to token j: j <= i in the same document.
    A document starts where ``positions[b, s]`` (each token's position in its document) is 0."""
    s = positions.shape[-1]
    document = torch.cumsum(positions == 0, dim=-1)
    causal = torch.ones(s, s, dtype=torch.bool, device=positions.device).tril()
    return ((document[:, :, None] == document[:, None, :]) & causal)[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of ``q[b, h, s, d]`` over ``k[b, h, s, d]``, ``v[b, h, s, dv]``; given each
    token's position in its document (``positions[b, s]``), inside documents only.

    float64: scores, then a softmax computed in float32 (the scores rounded to float32 first),
    as transformers' eager attention does, so the two agree to float64 rounding. Other dtypes:
    torch's fused attention, the same function (its softmax accumulates in float32 too).
    """
    mask = None if positions is None else document_mask(positions)
    if q.dtype != torch.float64:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1) if mask is None else ~mask
    probs = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1, dtype=HF_PRECISION).to(q.dtype)
    return torch.matmul(probs, v)


def _repeat_heads(t: torch.Tensor, times: int) -> torch.Tensor:
    """``[b, kv, s, d] -> [b, kv * times, s, d]``, each key/value head serving ``times`` query heads."""
    if times == 1:
        return t
    b, kv, s, d = t.shape
    return t[:, :, None].expand(b, kv, times, s, d).reshape(b, kv * times, s, d)


class GroupedQueryAttention(nn.Module):
    """qwen3_moe: GQA with per-head q/k RMSNorm, RoPE over the two halves of each head."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.head_dim is not None and cfg.n_kv_heads is not None and cfg.rope_theta is not None
        self.n_heads, self.n_kv, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = Linear(cfg.hidden, cfg.n_heads * cfg.head_dim, dtype)
        self.wk = Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, dtype)
        self.wv = Linear(cfg.hidden, cfg.n_kv_heads * cfg.head_dim, dtype)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.hidden, dtype)
        self.q_norm = RMSNorm(cfg.head_dim, dtype, cfg.norm_eps, HF_PRECISION)
        self.k_norm = RMSNorm(cfg.head_dim, dtype, cfg.norm_eps, HF_PRECISION)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_norm(self.wq(x).view(b, s, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.wk(x).view(b, s, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = self.rotary(q, offset, positions), self.rotary(k, offset, positions)
        times = self.n_heads // self.n_kv
        o = attend(q, _repeat_heads(k, times), _repeat_heads(v, times), self.scale, positions)
        return self.wo(o, heads=True)


class LatentAttention(nn.Module):
    """deepseek_v3: multi-head latent attention with decoupled RoPE."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        assert cfg.kv_lora_rank and cfg.qk_nope_head_dim and cfg.qk_rope_head_dim and cfg.v_head_dim and cfg.rope_theta
        self.n_heads = cfg.n_heads
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope
        if cfg.q_lora_rank:
            self.q_a: Linear | None = Linear(cfg.hidden, cfg.q_lora_rank, dtype)
            # transformers builds the two latent norms with the default epsilon, not rms_norm_eps
            self.q_a_norm: RMSNorm | None = RMSNorm(cfg.q_lora_rank, dtype, 1e-6, HF_PRECISION)
            self.q_b: Linear | None = Linear(cfg.q_lora_rank, cfg.n_heads * qk, dtype)
            self.wq: Linear | None = None
        else:
            self.q_a = self.q_a_norm = self.q_b = None
            self.wq = Linear(cfg.hidden, cfg.n_heads * qk, dtype)
        self.kv_a = Linear(cfg.hidden, cfg.kv_lora_rank + self.rope, dtype)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, dtype, 1e-6, HF_PRECISION)
        self.kv_b = Linear(cfg.kv_lora_rank, cfg.n_heads * (self.nope + self.v_dim), dtype)
        self.wo = Linear(cfg.n_heads * self.v_dim, cfg.hidden, dtype)
        self.rotary = Rotary(self.rope, cfg.rope_theta, cfg.rope_scaling, interleaved=bool(cfg.rope_interleave))
        self.scale = softmax_scale(qk, cfg.rope_scaling)

    def forward(self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
        q_latent = x if self.wq is not None else self.q_a(x)
        kv_latent = self.kv_a(x)
        q, k, v = self.up_projection(q_latent, kv_latent, offset, positions)
        if remake.active():
            # The attention keeps q, k and v (v a view of the up-projected keys' and values'
            # storage); they are made again from the latents, which the latent norms keep anyway
            # (the queries without a low rank from ``x``, itself a norm's output).
            q_source, kv_source = remake.later(q_latent), remake.later(kv_latent)
            again = remake.once(lambda: self._again(q_source(), kv_source(), offset, positions))
            for i, t in enumerate((q, k, v)):
                remake.remakes(t, lambda i=i: again()[i])
        o = attend(q, k, v, self.scale, positions)
        return self.wo(o, heads=True)

    def up_projection(
        self, q_latent: torch.Tensor, kv_latent: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The attention's queries, keys and values ``[b, heads, s, *]`` from the query latent (the
        query projection's low-rank output, or the input itself without one) and the key/value
        latent with the shared rotary key (``kv_a``'s output)."""
        b, s, _ = kv_latent.shape
        q = self.wq(q_latent) if self.wq is not None else self.q_b(self.q_a_norm(q_latent))  # type: ignore[misc]
        q = q.view(b, s, self.n_heads, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = kv_latent.split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b(self.kv_a_norm(latent)).view(b, s, self.n_heads, self.nope + self.v_dim).transpose(1, 2)
        k_pass, v = kv.split([self.nope, self.v_dim], dim=-1)
        q_rot = self.rotary(q_rot, offset, positions)
        k_rot = self.rotary(k_rot.reshape(b, 1, s, self.rope), offset, positions).expand(b, self.n_heads, s, self.rope)
        return torch.cat((q_pass, q_rot), dim=-1), torch.cat((k_pass, k_rot), dim=-1), v

    def _again(self, q_latent: torch.Tensor, kv_latent: torch.Tensor, offset: int, positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            return self.up_projection(q_latent, kv_latent, offset, positions)
