"""What ``train.fp8`` and ``memory.fp8_activations`` change in the bytes a part keeps for backward.

:func:`~portapipe.plan.shape.saved_bytes` counts the compute dtype's tensors; under the FP8 recipe
(:mod:`portapipe.fp8`) some are kept as E4M3 rows with float32 scales per 1x128 tile instead
(:func:`fp8_rows`: ``w + 4 ceil(w / 128)`` bytes for ``w`` values), and :func:`saved_delta` says by
how much each part's bytes change, byte for byte what
:class:`~portapipe.memory.accounting.SavedActivations` counts (tests check equality):

- ``train.fp8``: the routed experts keep the input rows the FP8 dispatch delivered as they came
  (a rank's own rows, which do not travel, in the compute dtype);
- ``memory.fp8_activations`` (:func:`~portapipe.models.fp8_layers.cached`): the attention's inputs
  whose every reader runs in FP8 (:func:`attention_cached`) and the dense FFN's are kept as FP8
  rows (the MoE layer's is kept by the router as it is), and so are the routed experts' own rows (not under zero-memory, which drops them); every
  FFN in FP8 (dense, shared, routed) keeps its activation's input as FP8 rows and nothing of the
  activation's output (the down projection remakes it).

A part runs in FP8 when every width of its Linears is a multiple of 128, as
:mod:`portapipe.models.fp8_layers` decides, for each architecture's attention (portapipe's,
qwen3_moe's grouped-query and deepseek_v3's latent attention).
"""

from __future__ import annotations

from ..config.model_shape import Shape

TILE = 128


def fp8_rows(n: float, width: int) -> float:
    """Bytes of ``n`` rows of ``width`` values as E4M3 values and one float32 scale per 1x128 tile."""
    return n * (width + 4 * -(-width // TILE))


def fp8_eligible(*widths: int) -> bool:
    """A Linear with these widths runs in FP8 (each a multiple of the 128-wide tile)."""
    return all(w % TILE == 0 for w in widths)


def attention_cached(s: Shape) -> dict[str, int]:
    """Under ``memory.fp8_activations``, the attention's inputs kept as FP8 rows instead of the
    compute dtype, name -> width: ``x`` (the normed input) when every projection reading it runs
    in FP8 (else it is kept as it is, and an FP8 copy would only add bytes: qwen3_moe's wk / wv
    are ``n_kv_heads x head_dim`` wide); deepseek_v3's
    ``q_latent`` and ``kv_latent`` (the latent norms' outputs) where ``q_b`` / ``kv_b`` run in
    FP8. ``kv_a`` (``kv_lora_rank + qk_rope_head_dim``, 576 in DeepSeek-V3) is rarely a multiple
    of 128, so there the normed input stays in the compute dtype; ``wo``'s input always does."""
    h = s.hidden
    if s.arch == "qwen3_moe":  # wq, and wk / wv over the key / value heads
        return {"x": h} if fp8_eligible(h, s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim) else {}
    if s.arch != "deepseek_v3":
        return {"x": h} if fp8_eligible(h) else {}
    heads = s.n_heads
    qk = s.qk_nope_head_dim + s.qk_rope_head_dim
    q_reads_x = (h, s.q_lora_rank) if s.q_lora_rank else (h, heads * qk)
    out = {"x": h} if fp8_eligible(*q_reads_x) and fp8_eligible(h, s.kv_lora_rank + s.qk_rope_head_dim) else {}
    if s.q_lora_rank and fp8_eligible(s.q_lora_rank, heads * qk):
        out["q_latent"] = s.q_lora_rank
    if fp8_eligible(s.kv_lora_rank, heads * (s.qk_nope_head_dim + s.v_head_dim)):
        out["kv_latent"] = s.kv_lora_rank
    return out


def saved_delta(s: Shape, cached: bool, part: str, option: str, tokens: float, rows: float, remote: float) -> float:
    """Bytes ``part`` keeps under ``train.fp8`` (and with ``cached``, ``memory.fp8_activations``)
    minus what :func:`~portapipe.plan.shape.saved_bytes` counts for it in the compute dtype, for
    one micro-batch under the layer's memory ``option``; ``remote``: the routed rows that arrived
    by the FP8 dispatch (a rank's own rows are gathered in the compute dtype)."""
    e, h, T = s.e, s.hidden, tokens
    if option == "recompute_full" and part not in ("embed", "head", "mtp"):
        return 0.0
    if option == "recompute_moe" and part in ("experts", "shared", "combine"):
        return 0.0
    if part == "experts" and fp8_eligible(h, s.moe_hidden):
        m = s.moe_hidden
        kept = rows if cached else remote  # the input rows in FP8: those dispatched, or every row's cached copy
        out = 0.0 if option in ("level0", "level1") else fp8_rows(kept, h) - kept * h * e
        if cached:  # gate / up output in FP8; the activation's output (dropped by level1 already) not kept
            out += fp8_rows(rows, 2 * m) - rows * 2 * m * e - (0 if option == "level1" else rows * m * e)
        return out
    if not cached:
        return 0.0
    attention = sum(fp8_rows(T, w) - T * w * e for w in attention_cached(s).values())
    if part == "attention":
        return attention
    if part == "dense":
        f = s.ffn_hidden
        ffn = fp8_rows(T, h) - T * h * e + fp8_rows(T, 2 * f) - 3 * T * f * e if fp8_eligible(h, f) else 0.0
        return attention + ffn
    if part == "shared" and s.n_shared and fp8_eligible(h, s.shared_width):
        w = s.shared_width
        return fp8_rows(T, 2 * w) - (2 if option == "level1" else 3) * T * w * e
    return 0.0
