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
- :func:`parameter_bytes`: parameters of a block (gradients and AdamW's state follow from them);
- :func:`fp8_flops`, :func:`quantize_bytes`, :func:`dispatch_row_bytes`: what ``train.fp8`` runs
  in FP8, the memory traffic of its quantization and the bytes of a routed row on the wire;
- :func:`up_projection_flops`: MLA's up-projection, made again under ``memory.recompute: norms``.

What ``memory.recompute: norms`` and ``memory.fp8_activations`` change in these bytes, for every
architecture's attention, is :mod:`.norm_recompute`'s and :mod:`.fp8_bytes`'s.

Each architecture's attention is modelled as :mod:`portapipe.models.attention` runs it: the
portapipe model's multi-head attention, qwen3_moe's grouped-query attention (q / k norms per
head, key / value heads repeated for the fused kernel) and deepseek_v3's multi-head latent
attention (low-rank query and key / value with their norms, the decoupled rotary part). torch's
fused attention kernels keep the queries, keys, values, output and log-sum-exp; MLA's value
width differs from its query / key width, which only some devices' fused kernels take
(``Shape.fused_unequal_heads``): elsewhere (the CPU) torch's math path runs, which keeps float32
copies of the scaled queries, keys and values and the attention probabilities, ``heads x
sequence`` per token. The Hugging Face architectures' norms keep a float32 scale per row and
their routers score in float32. A float64 Hugging Face model runs transformers' eager attention
and is refused (:func:`unmodelled`).

Memory options per layer are named ``off``, ``level0``, ``level1`` (zero-memory),
``recompute_moe`` and ``recompute_full``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.model_shape import Shape  # below setup.py and this module; the planner's modules import it from here
from .fp8_bytes import TILE, fp8_eligible, fp8_rows

INDEX_BYTES = 8  # int64 indices
F32 = 4  # float32: the Hugging Face architectures' norm scales and router scores, torch's math attention
PARTS = ("embed", "attention", "dense", "experts", "shared", "combine", "head", "mtp")
PHASES = ("F", "B", "W")  # forward, input-gradient backward, weight-gradient backward
OPTIONS = ("off", "level0", "level1", "recompute_moe", "recompute_full")


def unmodelled(s: Shape) -> str | None:
    """Why the planner cannot model this shape (one line), or None."""
    if s.arch != "portapipe" and s.dtype == "float64":
        return (f"model.dtype: float64 with model.arch {s.arch} runs transformers' eager attention, whose saved bytes the "
                "planner does not model; plan it in float32 or bfloat16")
    return None


def norm_scale_bytes(s: Shape) -> int:
    """One RMSNorm row's scale: float32 where the norm computes in it (Hugging Face architectures, float16)."""
    return F32 if s.arch != "portapipe" or s.dtype == "float16" else s.e


def math_attention(s: Shape) -> bool:
    """MLA on a device whose fused attention does not take its value width: torch's math path
    (which keeps float32 copies of the queries, keys and values, not the tensors themselves)."""
    return s.arch == "deepseek_v3" and s.qk_nope_head_dim + s.qk_rope_head_dim != s.v_head_dim and not s.fused_unequal_heads


def _attention_module(s: Shape, seq: int) -> int:
    """Per token: what the attention keeps besides its (normed) input; ``seq``: the rows' sequence length."""
    e, H = s.e, s.n_heads
    if s.arch == "qwen3_moe":  # q / k projections (the per-head norms' inputs) and their scales; the fused
        # kernel's q, repeated k and v, output and log-sum-exp
        d, kv = s.head_dim, s.n_kv_heads
        # a key / value head repeated for several query heads is a copy, except from a single one (a view)
        rep = kv if kv in (1, H) else H
        return (H + kv) * (d * e + F32) + 2 * (H + rep) * d * e + H * s.lse_bytes
    if s.arch == "deepseek_v3":
        qk, v = s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim
        out = (s.kv_lora_rank + s.qk_rope_head_dim + s.kv_lora_rank) * e + F32  # the latent (norm input), its scale, norm output
        if s.q_lora_rank:
            out += 2 * s.q_lora_rank * e + F32  # the query's latent, its scale and norm output
        if math_attention(s):  # float32 copies of the scaled q and k and of v, the probabilities; the output
            return out + H * (2 * qk + v + seq) * F32 + H * v * e
        # the fused kernel's q, k, v (a view of the key / value up-projection: its whole output), output, log-sum-exp
        return out + H * (2 * qk + s.qk_nope_head_dim + 2 * v) * e + H * s.lse_bytes
    return 4 * s.hidden * e + H * s.lse_bytes  # q, k, v, the output, its log-sum-exp


def _attention_core(s: Shape, seq: int) -> int:
    """Per token: both norms' inputs, outputs and scales, and the attention's own."""
    return 4 * s.hidden * s.e + 2 * norm_scale_bytes(s) + _attention_module(s, seq)


def _router_copies(s: Shape) -> bool:
    """deepseek_v3's router scores in float32 from float32 copies of its input and weight."""
    return s.arch == "deepseek_v3" and s.e != F32


def _routing(s: Shape, tokens: int) -> float:
    """The router's saved bytes for ``tokens`` tokens: scores, chosen experts, the weights'
    normalisation, and the two gather indices of the dispatch."""
    e, h, k, E = s.e, s.hidden, s.top_k, s.n_experts
    per = k * INDEX_BYTES + 2 * k * INDEX_BYTES  # the top-k's (its backward scatters by them)
    fixed = 0
    if s.arch == "portapipe":
        per += E * e + (k * e + e if k > 1 else 0)
    else:  # scores in float32; renormalised (top-k weights and their sum) with norm_topk_prob
        per += E * F32 + (k * F32 + F32 if s.norm_topk_prob else 0)
        if _router_copies(s):  # the gate runs on float32 copies of the input and the weight, so
            # the FFN norm's output is not kept here (the shared expert keeps it, if any)
            per += h * F32 - h * e
            fixed = E * h * F32
    return tokens * per + fixed


def _balance(s: Shape, tokens: int, seq: int) -> float:
    """The sequence-wise balance loss's saved bytes (``train.seq_aux_loss_weight``), in the
    router's score dtype: the product ``f_i P_i`` keeps the per-sequence load fractions ``f``
    (sequences x experts); the sigmoid routers' affinities, the scores over their per-token sum,
    keep that sum (the softmax router's probabilities are its affinities, kept already)."""
    if not s.seq_aux:
        return 0.0
    score = s.e if s.arch == "portapipe" else F32
    per_token = score if s.arch != "qwen3_moe" else 0
    return tokens * per_token + tokens / seq * s.n_experts * score


def saved_bytes(s: Shape, part: str, option: str, tokens: int, rows: float, slots: int | None = None, seq: int | None = None) -> float:
    """Bytes ``part`` saves for backward for one micro-batch under the layer's ``option``, in the
    compute dtype (what ``train.fp8`` keeps as FP8 instead: :mod:`.fp8_bytes`).

    ``rows``: routed rows this EP rank's experts receive; ``slots``: grouped-matmul groups
    (EP ranks x local expert slots; default the experts); ``seq``: the rows' sequence length
    (default ``seq_len``; a multi-token prediction depth's is shorter). Recomputed parts save
    nothing here (their replay saves ``off``'s bytes during the backward).
    """
    e, h, k, T = s.e, s.hidden, s.top_k, tokens
    seq = s.seq_len if seq is None else seq
    if option == "recompute_full" and part not in ("embed", "head", "mtp"):
        return 0
    if option == "recompute_moe" and part in ("experts", "shared", "combine"):
        return 0
    if part == "embed":
        return T * INDEX_BYTES
    if part == "mtp":  # the embedding (its indices are the targets' storage), its norm's input and
        # scale, the hidden state's norm scale (its input is the head's), the projection's input
        return T * (3 * h * e + 2 * norm_scale_bytes(s))
    if part == "head":  # final norm (input, scale, output), log-softmax, targets, the loss's weight sum
        return T * (2 * h * e + norm_scale_bytes(s) + s.vocab_size * e + INDEX_BYTES) + e
    if part == "dense":
        return T * (_attention_core(s, seq) + 3 * s.ffn_hidden * e)
    if part == "attention":
        return T * _attention_core(s, seq) + _routing(s, T) + _balance(s, T, seq)
    if part == "experts":  # input rows, gate/up output, router weight, activation; group offsets
        per_row = {"off": h + 3 * s.moe_hidden, "level0": 3 * s.moe_hidden, "level1": 2 * s.moe_hidden}[option] * e + e
        return rows * per_row + (s.n_experts if slots is None else slots) * INDEX_BYTES
    if part == "shared":
        if s.n_shared == 0:
            return 0
        normed = h * e if _router_copies(s) else 0  # its input, which the router did not keep
        return T * ((2 if option == "level1" else 3) * s.shared_width * e + normed)
    if part == "combine":  # the inverse dispatch order
        return T * k * INDEX_BYTES
    raise ValueError(f"unknown part {part!r}; known: {', '.join(PARTS)}")


def held_bytes(s: Shape, part: str, option: str, tokens: int, rows: float, *, ep: int) -> float:
    """Bytes the tape keeps for ``part`` until its backward besides what autograd saves.

    The MoE layer releases its part outputs and exchange buffers as soon as nothing reads them
    (:meth:`portapipe.models.layer.Layer.moe_program`): the rows sent (with their router weights)
    once the dispatch has delivered them, the experts' and the shared expert's outputs and the
    rows the combine brought back once the combine part has summed them; the backward needs
    only their gradients. What stays: zero-memory keeps the dispatch plan for the re-dispatch
    (per expert two index buffers, three with other EP ranks, and then the send order, one per
    routed row); a recomputed MoE block keeps its router weights and dispatch plan for the
    replay (the expert order, and with other EP ranks the send order apart; per expert three
    buffers, four with other EP ranks) and a recomputed layer its input. The same on every EP
    rank whatever the routing (tests/test_plan_memory.py, on 1, 2 and 4 EP ranks). With other
    EP ranks an MoE layer runs its experts twice (the received rows, its own rows): ``experts``
    here is the received rows' call, the other keeps nothing apart.
    """
    k, T, E = s.top_k, tokens, s.n_experts
    if option == "recompute_full":
        return T * s.hidden * s.e if part in ("attention", "dense") else 0
    if part == "attention" and option == "recompute_moe":
        return T * k * (2 if ep > 1 else 1) * INDEX_BYTES + (4 if ep > 1 else 3) * E * INDEX_BYTES + T * k * s.e
    if part == "experts" and option in ("level0", "level1"):
        return (T * k + 3 * E) * INDEX_BYTES if ep > 1 else 2 * E * INDEX_BYTES
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
    core = attention_core_flops(s)
    attn = 2 * sum(i * o for _, i, o in attention_linears(s))
    proj = attn + 2 * h * E
    table = {
        "attention": {"F": proj + core, "B": proj + 2 * core, "W": proj},
        "dense": {"F": attn + core + 6 * h * f, "B": attn + 2 * core + 6 * h * f, "W": attn + 6 * h * f},
        "experts": dict.fromkeys(PHASES, 6 * h * s.moe_hidden),
        "shared": dict.fromkeys(PHASES, 6 * h * s.shared_width),
        "head": dict.fromkeys(PHASES, 2 * h * s.vocab_size),
        "combine": {"F": (s.top_k + 2) * h * s.e, "B": (s.top_k + 2) * h * s.e, "W": 0},
        "embed": {"F": h * s.e, "B": h * s.e, "W": 0},
        "mtp": dict.fromkeys(PHASES, 4 * h * h),  # the projection of [embedding; hidden]
        "norms": {"F": 2 * h * s.e, "B": 2 * h * s.e, "W": 0},  # one norm made again: bytes moved (plan.norm_recompute)
        "up_projection": {"F": up_projection_flops(s), "B": up_projection_flops(s), "W": 0},  # MLA's q / k / v made again (plan.norm_recompute)
    }
    if part not in table:
        raise ValueError(f"unknown part {part!r}; known: {', '.join(PARTS)}")
    return float(table[part][phase])


def attention_core_flops(s: Shape) -> float:
    """softmax(QK^T)V per token, forward: QK^T and AV over (seq + 1) / 2 keys on average (causal)."""
    qk, v = _head_widths(s)
    return float((s.seq_len + 1) * s.n_heads * (qk + v))


def up_projection_flops(s: Shape) -> float:
    """MLA's up-projection per token: the query's (``q_b``, or ``wq`` without a low rank) and the
    key / value's (``kv_b``) GEMMs; 0 for the other architectures."""
    if s.arch != "deepseek_v3":
        return 0.0
    widths = {name: (i, o) for name, i, o in attention_linears(s)}
    return float(sum(2 * i * o for name, (i, o) in widths.items() if name in ("q_b", "wq", "kv_b")))


def _head_widths(s: Shape) -> tuple[int, int]:
    """(query / key, value) width of one head."""
    if s.arch == "deepseek_v3":
        return s.qk_nope_head_dim + s.qk_rope_head_dim, s.v_head_dim
    d = s.head_dim if s.arch == "qwen3_moe" else s.hidden // s.n_heads
    return d, d


def attention_linears(s: Shape) -> list[tuple[str, int, int]]:
    """The attention's Linears as :mod:`portapipe.models.attention` builds them: (name, in, out)."""
    h, H = s.hidden, s.n_heads
    if s.arch == "deepseek_v3":
        qk, rope = s.qk_nope_head_dim + s.qk_rope_head_dim, s.qk_rope_head_dim
        q = [("q_a", h, s.q_lora_rank), ("q_b", s.q_lora_rank, H * qk)] if s.q_lora_rank else [("wq", h, H * qk)]
        return [*q, ("kv_a", h, s.kv_lora_rank + rope), ("kv_b", s.kv_lora_rank, H * (s.qk_nope_head_dim + s.v_head_dim)),
                ("wo", H * s.v_head_dim, h)]
    if s.arch == "qwen3_moe":
        d, kv = s.head_dim, s.n_kv_heads
        return [("wq", h, H * d), ("wk", h, kv * d), ("wv", h, kv * d), ("wo", H * d, h)]
    return [("wq", h, h), ("wk", h, h), ("wv", h, h), ("wo", h, h)]


def fp8_dispatch(s: Shape) -> bool:
    """The routed rows travel (and the experts keep their inputs) in FP8: ``train.fp8`` with FP8 experts."""
    return s.fp8 and s.n_experts > 0 and fp8_eligible(s.hidden, s.moe_hidden)


def dispatch_row_bytes(s: Shape, weights: bool = True) -> float:
    """Bytes of one routed row on the wire towards the experts: its values (and router weight) in
    the compute dtype, or under FP8 its E4M3 values, float32 1x128 scales and the weight in the
    compute dtype (:func:`portapipe.fp8.dispatch.row_bytes`)."""
    h, e = s.hidden, s.e
    if fp8_dispatch(s):
        return fp8_rows(1, h) + (e if weights else 0)
    return (h + (1 if weights else 0)) * e


def _fp8_gemms(s: Shape, part: str) -> list[tuple[int, int]]:
    """(in, out) of each GEMM of ``part`` that runs in FP8 under ``train.fp8`` (per token; the experts per row)."""
    if not s.fp8:
        return []
    h = s.hidden
    attn = [(i, o) for _, i, o in attention_linears(s) if fp8_eligible(i, o)]
    ffn = lambda w: [(h, 2 * w), (w, h)] if fp8_eligible(h, w) else []  # noqa: E731  gate / up, down
    return {"attention": attn, "dense": attn + ffn(s.ffn_hidden), "experts": ffn(s.moe_hidden),
            "shared": ffn(s.shared_width) if s.n_shared else []}.get(part, [])


def fp8_flops(s: Shape, part: str, phase: str) -> float:
    """Of :func:`flops`, the FP8 GEMMs' (each phase runs one GEMM per FP8 Linear)."""
    return float(sum(2 * i * o for i, o in _fp8_gemms(s, part)))


def quantize_bytes(s: Shape, part: str, phase: str) -> float:
    """Memory traffic per unit of quantizing the FP8 GEMMs' activation-side operands (read in the
    compute dtype, written as E4M3 with a float32 scale per 128): F the inputs (1x128), B the output
    gradients (1x128), W both again (128x1 along the tokens)."""
    per = s.e + 1 + 4 / TILE
    gemms = _fp8_gemms(s, part)
    ins, outs = sum(i for i, _ in gemms), sum(o for _, o in gemms)
    return float({"F": ins, "B": outs, "W": ins + outs}[phase] * per)


def weight_quantize_bytes(s: Shape, part: str, phase: str) -> float:
    """Memory traffic of quantizing the weights of ``part``'s FP8 GEMMs into 128x128 blocks, at each
    use (a call's forward and input gradient; the weight gradient reads none); the routed experts
    counted as one expert's (a rank's other local experts' are left out)."""
    return 0.0 if phase == "W" else float(sum(i * o for i, o in _fp8_gemms(s, part)) * (s.e + 1))


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
    c = ParamCount(sum(i * o for _, i, o in attention_linears(s)) + 2 * h, len(attention_linears(s)) + 2)  # + two norms
    if s.arch == "deepseek_v3":  # the latent norms
        c += ParamCount(s.kv_lora_rank + s.q_lora_rank, 1 + bool(s.q_lora_rank))
    if s.arch == "qwen3_moe":  # the per-head q / k norms
        c += ParamCount(2 * s.head_dim, 2)
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
    """Module buffers of one layer: rotary tables; the router's bias (float32; qwen3_moe's router
    has none) and load counters."""
    out = s.rope_bytes()
    if s.is_moe(layer):
        bias = 0 if s.arch == "qwen3_moe" else s.n_experts * 4
        out += bias + s.n_experts * INDEX_BYTES + (slots * INDEX_BYTES if slots != s.n_experts else 0)
    return out

