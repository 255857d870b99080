"""What the portapipe model holds and computes, part by part, from its shape alone.

An MoE layer runs as the parts ``attention`` (norms, attention, routing) -> dispatch all-to-all
-> ``experts`` -> combine all-to-all -> ``shared`` -> ``combine``; a dense layer as one part
``dense``; the first block adds ``embed`` and the last ``head`` (final norm, head, loss), then
per multi-token prediction depth ``mtp`` (its embedding, norms and projection), an MoE layer and
a ``head`` again, over the micro-batch's positions that have a token that far ahead. This
module says, for one micro-batch of ``tokens`` tokens of which an EP rank receives ``rows``
routed rows:

- :func:`saved_bytes`: what each part keeps for its backward, byte for byte what
  :class:`~portapipe.memory.accounting.SavedActivations` counts (tests check equality);
- :func:`held_bytes`: what the executor's tape keeps besides (part outputs, exchange buffers,
  a recomputed layer's input), which only an allocator sees;
- :func:`wqueue_bytes`: an estimate of what deferred weight gradients hold from B to W;
- :func:`flops`: floating-point work per part and phase, to scale measured times to a shape;
- :func:`parameter_bytes`: parameters of a block (gradients and AdamW's state follow from them).

Memory options per layer are named ``off``, ``level0``, ``level1`` (zero-memory),
``recompute_moe`` and ``recompute_full``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.model_shape import Shape  # below setup.py and this module; the planner's modules import it from here

INDEX_BYTES = 8  # int64 indices
PARTS = ("embed", "attention", "dense", "experts", "shared", "combine", "head", "mtp")
PHASES = ("F", "B", "W")  # forward, input-gradient backward, weight-gradient backward
OPTIONS = ("off", "level0", "level1", "recompute_moe", "recompute_full")


def _attention_core(s: Shape) -> int:
    """Per token: both norms' inputs, outputs and scales, q, k, v, the attention output, its log-sum-exp."""
    return 8 * s.hidden * s.e + 2 * s.e + s.n_heads * s.lse_bytes


def saved_bytes(s: Shape, part: str, option: str, tokens: int, rows: float, slots: int | None = None) -> float:
    """Bytes ``part`` saves for backward for one micro-batch under the layer's ``option``.

    ``rows``: routed rows this EP rank's experts receive; ``slots``: grouped-matmul groups
    (EP ranks x local expert slots; default the experts). Recomputed parts save nothing here
    (their replay saves ``off``'s bytes during the backward).
    """
    e, h, k, T = s.e, s.hidden, s.top_k, tokens
    if option == "recompute_full" and part not in ("embed", "head", "mtp"):
        return 0
    if option == "recompute_moe" and part in ("experts", "shared", "combine"):
        return 0
    if part == "embed":
        return T * INDEX_BYTES
    if part == "mtp":  # the embedding (its indices are the targets' storage), its norm's input and
        # scale, the hidden state's norm scale (its input is the head's), the projection's input
        return T * (3 * h * e + 2 * e)
    if part == "head":  # final norm (input, scale, output), log-softmax, targets, the loss's weight sum
        return T * (2 * h * e + e + s.vocab_size * e + INDEX_BYTES) + e
    if part == "dense":
        return T * (_attention_core(s) + 3 * s.ffn_hidden * e)
    if part == "attention":
        # + scores, chosen experts, two gather indices; the weights' normalisation
        routing = s.n_experts * e + k * INDEX_BYTES + 2 * k * INDEX_BYTES
        if k > 1:
            routing += k * e + e
        return T * (_attention_core(s) + routing)
    if part == "experts":  # input rows, gate/up output, router weight, activation; group offsets
        per_row = {"off": h + 3 * s.moe_hidden, "level0": 3 * s.moe_hidden, "level1": 2 * s.moe_hidden}[option] * e + e
        return rows * per_row + (s.n_experts if slots is None else slots) * INDEX_BYTES
    if part == "shared":
        if s.n_shared == 0:
            return 0
        return T * (2 if option == "level1" else 3) * s.shared_width * e
    if part == "combine":  # the inverse dispatch order
        return T * k * INDEX_BYTES
    raise ValueError(f"unknown part {part!r}; known: {', '.join(PARTS)}")


def held_bytes(s: Shape, part: str, option: str, tokens: int, rows: float, *, ep: int) -> float:
    """Bytes the tape keeps for ``part`` until its backward besides what autograd saves.

    Part outputs stay referenced as the roots of the part's backward: the rows to send and
    their router weights, the experts' output, the rows combined back from the other ``ep - 1``
    EP ranks (a rank's own rows, ``1 / ep`` of them, are not exchanged) and the shared expert's
    output. The rows to send and the local rows are one buffer (as are their router weights):
    the experts save the local rows, so only the ``(ep - 1) / ep`` sent to other ranks count
    here. Zero-memory frees the sent rows but keeps the dispatch plan for the re-dispatch; a
    recomputed MoE block keeps its router weights and dispatch plan (for the replay) and a
    recomputed layer its input.
    """
    e, h, k, T = s.e, s.hidden, s.top_k, tokens
    if option == "recompute_full":
        return T * h * e if part in ("attention", "dense") else 0
    if part == "attention":
        remote = (ep - 1) / ep  # the share of the rows sent to other ranks
        sent = 0 if option in ("level0", "level1", "recompute_moe") else T * k * remote * h * e
        if option == "recompute_moe":  # the replay's dispatch plan: the expert order and (with other EP
            # ranks) the send order apart; counts, offsets of all rows, and of the local and received ones
            sent += T * k * (2 if ep > 1 else 1) * INDEX_BYTES + 3 * s.n_experts * INDEX_BYTES
        return sent + T * k * (1 if option == "recompute_moe" else remote) * e
    if option == "recompute_moe":
        return 0
    if part == "experts":  # its output, and the combine exchange's output
        out = rows * h * e + T * k * (ep - 1) / ep * h * e
        if option in ("level0", "level1"):  # the dispatch plan kept for the re-dispatch: counts, offsets and
            # (with other EP ranks) the expert order apart from the send order
            out += (T * k if ep > 1 else 0) * INDEX_BYTES + 2 * s.n_experts * INDEX_BYTES
        return out
    if part == "shared" and s.n_shared:
        return T * h * e
    return 0


def wqueue_bytes(s: Shape, part: str, tokens: int, rows: float) -> float:
    """Estimate of what a part's deferred weight gradients hold between its B and its W: the
    inputs and output gradients of its linear layers."""
    e, h, T = s.e, s.hidden, tokens
    if part == "attention":
        return T * (7 * h + s.n_experts) * e
    if part == "dense":
        return T * (8 * h + 3 * s.ffn_hidden) * e
    if part == "experts":
        return rows * (2 * h + 3 * s.moe_hidden) * e
    if part == "shared" and s.n_shared:
        return T * (3 * s.shared_width + h) * e
    if part == "head":
        return T * (h + s.vocab_size) * e
    if part == "mtp":
        return T * 3 * h * e
    return 0


def flops(s: Shape, part: str, phase: str) -> float:
    """Floating-point operations per unit (token; routed row for ``experts``) of ``part`` in
    ``phase``. Parts that only move data (``embed``, ``combine``) count bytes moved instead."""
    h, f, E = s.hidden, s.ffn_hidden, s.n_experts
    core = 2 * h * (s.seq_len + 1)  # causal attention: QK^T and AV over (s+1)/2 keys on average
    proj = 8 * h * h + 2 * h * E
    table = {
        "attention": {"F": proj + core, "B": proj + 2 * core, "W": proj},
        "dense": {"F": 8 * h * h + core + 6 * h * f, "B": 8 * h * h + 2 * core + 6 * h * f, "W": 8 * h * h + 6 * h * f},
        "experts": dict.fromkeys(PHASES, 6 * h * s.moe_hidden),
        "shared": dict.fromkeys(PHASES, 6 * h * s.shared_width),
        "head": dict.fromkeys(PHASES, 2 * h * s.vocab_size),
        "combine": {"F": (s.top_k + 2) * h * s.e, "B": (s.top_k + 2) * h * s.e, "W": 0},
        "embed": {"F": h * s.e, "B": h * s.e, "W": 0},
        "mtp": dict.fromkeys(PHASES, 4 * h * h),  # the projection of [embedding; hidden]
    }
    if part not in table:
        raise ValueError(f"unknown part {part!r}; known: {', '.join(PARTS)}")
    return float(table[part][phase])


# ----------------------------------------------------------------------------- parameters
@dataclass
class ParamCount:
    """Parameter elements and tensors of some layers (all in the model's dtype)."""

    elements: int = 0
    tensors: int = 0
    expert_elements: int = 0  # of which routed experts' (sharded over EP)

    def __iadd__(self, other: ParamCount) -> ParamCount:
        self.elements += other.elements
        self.tensors += other.tensors
        self.expert_elements += other.expert_elements
        return self


def layer_params(s: Shape, layer: int, local_slots: int) -> ParamCount:
    """One layer holding ``local_slots`` routed-expert slots."""
    h = s.hidden
    c = ParamCount(4 * h * h + 2 * h, 6)  # two norms, q, k, v, o
    if not s.is_moe(layer):
        c += ParamCount(3 * h * s.ffn_hidden, 2)
        return c
    c += ParamCount(s.n_experts * h, 1)  # router
    if s.n_shared:
        c += ParamCount(3 * h * s.shared_width, 2)
    experts = local_slots * 3 * h * s.moe_hidden
    c += ParamCount(experts, 2, experts)
    return c


def block_params(s: Shape, layers: range, first: bool, last: bool, local_slots: int) -> ParamCount:
    """A model block: its layers, plus the embedding (first block) or final norm and head (last,
    none of its own when tied), the multi-token prediction modules (an MoE layer, three norms and
    a projection each) and, in a last block that is not the first, the embedding's copy they use."""
    c = ParamCount()
    for i in layers:
        c += layer_params(s, i, local_slots)
    embed = ParamCount(s.vocab_size * s.hidden, 1)
    if first:
        c += embed
    if last:
        c += ParamCount(s.hidden, 1)
        if not s.tie_word_embeddings:
            c += ParamCount(s.vocab_size * s.hidden, 1)
        if not first and (s.tie_word_embeddings or s.mtp_layers):
            c += embed
        for i in mtp_layer_indices(s):
            c += layer_params(s, i, local_slots)
            c += ParamCount(3 * s.hidden + 2 * s.hidden * s.hidden, 4)
    return c


def mtp_layer_indices(s: Shape) -> range:
    """Global indices of the multi-token prediction modules' layers (after the model's)."""
    return range(s.n_layers, s.n_layers + s.mtp_layers)


def layer_buffer_bytes(s: Shape, layer: int, slots: int) -> int:
    """Module buffers of one layer: rotary tables; the router's bias (float32) and load counters."""
    out = s.rope_bytes()
    if s.is_moe(layer):
        out += s.n_experts * 4 + s.n_experts * INDEX_BYTES + (slots * INDEX_BYTES if slots != s.n_experts else 0)
    return out
