"""``memory.recompute: norms`` in the plan's terms: what a layer's parts no longer keep for the
backward, and the work the backward does again.

The planner's shape is the portapipe architecture's (multi-head attention over the hidden
width): a dense layer's part drops its two RMSNorms' outputs, an MoE layer's attention part its
attention norm's (the FFN norm's output stays: the tape, the router and the dispatch hold it),
``hidden`` elements per token each (:mod:`portapipe.memory.remake`). The backward makes each
again from the norm's input: it reads the input and writes the output once more, work the
plan prices as the bytes it moves, at the pace of a part that only moves data (``combine``).
"""

from __future__ import annotations

from .fp8_bytes import fp8_eligible
from .shape import Shape

#: RMSNorms whose outputs a part drops: the attention norm, and a dense layer's FFN norm
NORMS = {"dense": 2, "attention": 1}


def dropped_bytes(s: Shape, part: str, tokens: float, fp8_cached: bool = False) -> float:
    """Bytes ``part`` no longer saves for one micro-batch of ``tokens`` tokens. With FP8-cached
    activations (``fp8_cached``) a norm whose output only FP8 Linears read is kept as their FP8
    rows already (:mod:`.fp8_bytes`), not in the compute dtype: there is nothing more to drop."""
    if not fp8_cached:
        return tokens * NORMS.get(part, 0) * s.hidden * s.e
    readers = {"attention": [(s.hidden,)], "dense": [(s.hidden,), (s.hidden, s.ffn_hidden)]}.get(part, [])
    return tokens * sum(not fp8_eligible(*w) for w in readers) * s.hidden * s.e


def moved_bytes(s: Shape) -> float:
    """Bytes one norm's recompute moves per token: its input read, its output written."""
    return 2.0 * s.hidden * s.e


def recompute_op(part: str, phase: str, tokens: float) -> tuple:
    """The backward's recompute before ``part``'s backward, as a program op (units: norms x tokens)."""
    return ("C", "norms", phase, tokens * NORMS.get(part, 0), 0, 0, "off")
