"""``memory.recompute: norms`` in the plan's terms: what a layer's parts no longer keep for the
backward, and the work the backward does again.

A dense layer's part drops its two RMSNorms' outputs, an MoE layer's attention part its
attention norm's (the FFN norm's output stays: the tape, the router and the dispatch hold it),
``hidden`` elements per token each (:mod:`portapipe.memory.remake`). qwen3_moe's per-head q / k
norms drop nothing: their outputs go through the rotary embedding, which keeps none of them, and
the attention kernel keeps the rotated copies. deepseek_v3's latent
attention drops besides its latent norms' outputs (``q_lora_rank`` and ``kv_lora_rank`` wide)
and, where a fused attention kernel keeps them (:func:`~portapipe.plan.shape.math_attention`
false), the up-projected queries, keys and values: ``heads x (2 (nope + rope) + nope + v)``
per token (the values are a view of the key / value up-projection's whole output). torch's math
attention keeps float32 copies of them instead, which stay. With FP8-cached activations a norm
output kept as FP8 rows (:func:`~portapipe.plan.fp8_bytes.attention_cached`) is not kept in the
compute dtype: there is nothing more to drop.

The backward makes each norm again from its input: it reads the input and writes the output
once more, work the plan prices as the bytes it moves, at the pace of a part that only moves
data (``combine``). MLA's up-projection runs its two GEMMs (``q_b``, ``kv_b``; ``wq`` with a
full-rank query) again, priced by their FLOPs at the attention part's pace per FLOP (the norms
and rotary inside it, a few elements per token against thousands of multiply-adds, left out).
"""

from __future__ import annotations

from .fp8_bytes import attention_cached, fp8_eligible
from .shape import Shape, math_attention

#: the parts whose norms (and MLA up-projection) the option drops
NORM_PARTS = ("attention", "dense")


def dropped_norms(s: Shape, part: str, fp8_cached: bool) -> list[tuple[str, int]]:
    """The norms whose outputs ``part`` no longer keeps (``x``: the attention norm, ``q_latent``,
    ``kv_latent``: MLA's latent norms, ``ffn``: a dense layer's FFN norm), with their widths."""
    if part not in NORM_PARTS:
        return []
    cached = attention_cached(s) if fp8_cached else {}
    norms = [("x", s.hidden)]
    if s.arch == "deepseek_v3":
        norms += [("q_latent", s.q_lora_rank)] * bool(s.q_lora_rank) + [("kv_latent", s.kv_lora_rank)]
    out = [(name, w) for name, w in norms if name not in cached]
    if part == "dense" and not (fp8_cached and fp8_eligible(s.hidden, s.ffn_hidden)):
        out.append(("ffn", s.hidden))  # the FFN norm's output, unless the gate / up projection keeps FP8 rows of it
    return out


def _norm_widths(s: Shape, part: str, fp8_cached: bool) -> list[int]:
    """Widths of the norm outputs ``part`` no longer keeps, per token."""
    return [w for _, w in dropped_norms(s, part, fp8_cached)]


def remade_up_projection(s: Shape) -> bool:
    """Whether MLA's up-projected queries, keys and values are dropped and made again (the fused kernel keeps them)."""
    return s.arch == "deepseek_v3" and not math_attention(s)


def _up_projection_width(s: Shape) -> int:
    """Per token, the elements of MLA's up-projected q, k and v a fused kernel keeps."""
    if not remade_up_projection(s):
        return 0
    return s.n_heads * (2 * (s.qk_nope_head_dim + s.qk_rope_head_dim) + s.qk_nope_head_dim + s.v_head_dim)


def dropped_bytes(s: Shape, part: str, tokens: float, fp8_cached: bool = False) -> float:
    """Bytes ``part`` no longer saves for one micro-batch of ``tokens`` tokens; ``fp8_cached``:
    under ``memory.fp8_activations`` (what is kept as FP8 rows is not dropped)."""
    if part not in NORM_PARTS:
        return 0.0
    return tokens * (sum(_norm_widths(s, part, fp8_cached)) + _up_projection_width(s)) * s.e


def moved_bytes(s: Shape, part: str, fp8_cached: bool = False) -> float:
    """Bytes ``part``'s norms' recompute moves per token: each input read, each output written."""
    return 2.0 * sum(_norm_widths(s, part, fp8_cached)) * s.e


def recompute_ops(s: Shape, part: str, phase: str, tokens: float, fp8_cached: bool = False) -> list[tuple]:
    """The backward's recompute before ``part``'s backward, as program ops: the norms (units:
    ``hidden``-wide norms x tokens) and MLA's up-projection (units: tokens,
    :func:`~portapipe.plan.shape.up_projection_flops` each)."""
    widths = sum(_norm_widths(s, part, fp8_cached))
    ops = [("C", "norms", phase, tokens * widths / s.hidden, 0, 0, "off")] if widths else []  # none made again: no op to pay for
    if part in NORM_PARTS and remade_up_projection(s):
        ops.append(("C", "up_projection", phase, tokens, 0, 0, "off"))
    return ops
