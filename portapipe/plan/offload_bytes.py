"""``memory.offload`` in the plan's terms: what of a part's saved bytes goes to host memory.

A part sends every storage it saved that nothing else holds when it returns
(:mod:`portapipe.memory.offload`); what stays on the device is what other holders keep (measured
against the accounting on every architecture; ``tests/test_plan_offload.py``):

- its inputs and outputs, which the tape holds: an attention part's input, its residual sum and
  (unless deepseek_v3's router scores a float32 copy of it) the FFN norm's output; a dense part's
  input; the shared expert's input where the router did not keep it; the experts' input rows
  where they are the part's arguments (a rank's own rows, and under ``train.fp8`` the rows the
  FP8 dispatch delivered) and their router weights;
- what a recipe of ``memory.recompute: norms`` holds to make a norm again: the inputs of the
  norms it drops that are not the part's input (MLA's query latent, its key / value
  projection's output, a dense layer's FFN norm input);
- the dispatch's gather index (one per routed row) and the experts' group offsets, which the
  dispatch plan holds;
- under zero-memory ``level1`` the experts' and the shared expert's everything (the activation's
  recipe holds its input).

The rotary tables are the model's buffers and are counted apart (:mod:`.memory_model`).
"""

from __future__ import annotations

from .fp8_bytes import fp8_eligible, fp8_rows
from .norm_recompute import dropped_norms, remade_up_projection
from .shape import INDEX_BYTES, Shape, _router_copies

#: the parts memory.offload may name, as the programs name them
PARTS = ("attention", "dense", "shared", "experts")


def _recipe_inputs(s: Shape, part: str, cached: bool) -> float:
    """Per token, the bytes ``memory.recompute: norms``' recipes hold besides the part's own input:
    MLA's query latent and key / value projection output, from which its latent norms and (a fused
    attention keeping them) its up-projections are made again, and a dense layer's FFN norm input."""
    names = {name for name, _ in dropped_norms(s, part, cached)}
    out = s.hidden if "ffn" in names else 0
    if s.arch == "deepseek_v3" and ({"q_latent", "kv_latent"} & names or remade_up_projection(s)):
        out += (s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_rope_head_dim
    return out * s.e


def kept_bytes(s: Shape, part: str, option: str, tokens: float, rows: float, local: float, slots: int | None, *,
               norms: bool = False, cached: bool = False) -> float:
    """Bytes of ``part``'s saved bytes (for one micro-batch, as :func:`~.shape.saved_bytes` and
    :func:`~.fp8_bytes.saved_delta` count them) that stay on the device under ``memory.offload``;
    ``rows`` routed rows this rank's experts run, ``local`` of them its own; ``cached``:
    ``memory.fp8_activations``."""
    e, h, T = s.e, s.hidden, tokens
    if part == "dense":
        return T * h * e + (T * _recipe_inputs(s, part, cached) if norms else 0.0)
    if part == "attention":
        kept = 2 * h * e + (0 if _router_copies(s) else h * e) + s.top_k * INDEX_BYTES
        return T * kept + (T * _recipe_inputs(s, part, cached) if norms else 0.0)
    if part == "shared":
        return T * h * e if s.n_shared and _router_copies(s) else 0.0
    if part == "experts":
        remote = rows - local
        offsets = (s.n_experts if slots is None else slots) * INDEX_BYTES
        fp8 = s.fp8 and fp8_eligible(h, s.moe_hidden)
        if fp8:  # the rows the FP8 dispatch delivered (values, scales, weights) are the part's arguments
            arrived = remote * e + (fp8_rows(remote, h) if option == "off" else 0.0)
        else:
            arrived = 0.0  # copied out of the received buffer inside the part: sent
        own = local * e + (local * h * e if option == "off" and not (fp8 and cached) else 0.0)
        return arrived + own + offsets
    return 0.0


def sent_bytes(saved: float, s: Shape, part: str, option: str, tokens: float, rows: float, local: float, slots: int | None, *,
               norms: bool = False, cached: bool = False) -> float:
    """Of ``saved`` (the part's saved bytes), what goes to host memory: none under zero-memory
    ``level1`` for the experts and the shared expert, else what :func:`kept_bytes` does not keep."""
    if part in ("experts", "shared") and option == "level1":
        return 0.0
    return max(0.0, saved - kept_bytes(s, part, option, tokens, rows, local, slots, norms=norms, cached=cached))
