"""The MoE transformer that follows the stage contract, for every architecture.

``model.arch`` picks the attention, the router and the norms' precision (:data:`ARCHITECTURES`:
portapipe, deepseek_v3, qwen3_moe; see docs/models.md); everything below is shared. The
portapipe architecture is a small DeepSeek-V3-style model:

Layers: RMSNorm -> causal attention (RoPE) -> RMSNorm -> FFN; the first ``n_dense`` layers
have a dense SwiGLU FFN, the rest an MoE: shared expert(s) plus routed experts chosen by
sigmoid affinities, top-k, with DeepSeek's auxiliary-loss-free bias (added to the affinities
for choosing experts only; raised for under-loaded experts and lowered for over-loaded ones
by ``bias_update_speed`` each step) and optional group-limited routing.

The model is built as *blocks* (contiguous layer slices; block 0 has the embedding, the last
the head and loss) so a schedule can place them on ranks. Parameters are named by global
layer index and initialised from a seed per parameter name (per logical expert for routed
experts), so any split, any EP sharding and the single-process model hold identical weights.

Each block's forward is a program (see :mod:`portapipe.scheduling.overlap`): an MoE layer is
the parts ``attention`` (norms, attention, routing, send order) -> dispatch all-to-all of the
rows routed to other EP ranks -> ``shared`` (computed while the dispatch is in flight) ->
``experts`` on the received rows (one grouped matmul per projection over (source rank, expert)
groups) -> combine all-to-all -> ``experts`` on the rows this rank routed to itself (computed
while the combine is in flight) -> ``combine`` (sum of the top-k outputs + residual). Each
row's router weight travels with it (one more column of the dispatched rows) and scales the
expert's activation before the down projection, the same function as weighting the expert's
output but without keeping the outputs for the weights' gradient.

The part-wise backward (:meth:`~portapipe.scheduling.overlap.Tape.backward`) follows the data:
it issues the combine's reverse exchange first; the local rows' experts backward and the shared
expert's backward then run while those rows travel; in a full backward the experts' weight
gradients hide the dispatch's reverse exchange.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import zlib
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..backends.base import Backend
from ..config import ModelConfig
from ..fp8.dispatch import Fp8Rows, split_received
from ..scheduling.exchange import free_storage
from ..scheduling.stage import expert_ids, is_expert, mark_expert, mark_shared, shared_blocks
from ..setup import layer_range
from .attention import HF_PRECISION, Attention, GroupedQueryAttention, LatentAttention
from .expert_clock import ExpertClock
from .expert_parallel import DispatchPlan, ExpertParallel, plan_dispatch, split_weights, with_weights
from .functions import RMSNorm, swiglu
from .linear import Linear, grouped_linear, linear
from .objective import Objective, balance_term, mtp_term, sequence_balance_loss
from .rope import apply_rope, rope_tables
from .routing import Router, SoftmaxRouter

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}

__all__ = ["Attention", "Block", "Router", "apply_rope", "build_blocks", "layer_range", "rope_tables"]


@dataclass(frozen=True)
class Arch:
    """What differs between architectures: the attention, the router and the norms' precision.

    Everything else (dense FFN, shared experts, routed experts and their dispatch / combine,
    the memory options' hooks, the balancer's routing, the blocks) is one implementation.
    """

    attention: Callable[[ModelConfig, torch.dtype], nn.Module]
    router: Callable[[ModelConfig, torch.dtype], nn.Module]
    #: dtype the RMSNorms compute in (None: the model's)
    norm_precision: torch.dtype | None = None


ARCHITECTURES: dict[str, Arch] = {
    "portapipe": Arch(Attention, Router),
    "deepseek_v3": Arch(LatentAttention, Router, HF_PRECISION),
    "qwen3_moe": Arch(GroupedQueryAttention, SoftmaxRouter, HF_PRECISION),
}


def norm(cfg: ModelConfig, dim: int, dtype: torch.dtype) -> RMSNorm:
    # float16's range cannot hold the backward's rsqrt(mean x^2)^3 of small activations: float32 there
    precision = ARCHITECTURES[cfg.arch].norm_precision or (torch.float32 if dtype == torch.float16 else None)
    return RMSNorm(dim, dtype, cfg.norm_eps, precision)


class DenseFFN(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate and up fused in one projection."""

    def __init__(self, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = width
        self.gate_up = Linear(hidden, 2 * width, dtype)
        self.down = Linear(width, hidden, dtype)

    def forward(self, x: torch.Tensor, zm: Any = None) -> torch.Tensor:
        gu = self.gate_up(x)
        # zm: zero-memory (portapipe.memory.zero_memory) may recompute the activation in backward.
        return self.down(swiglu(gu, self.width) if zm is None else zm.activation(swiglu, gu, self.width))


class Experts(nn.Module):
    """This EP rank's routed experts as stacked weights, run as grouped matmuls."""

    def __init__(self, cfg: ModelConfig, n_local: int, first: int, dtype: torch.dtype, logical: list[int] | None = None) -> None:
        super().__init__()
        self.width, self.first = cfg.moe_hidden, first
        self.gate_up = nn.Parameter(torch.empty(n_local, cfg.hidden, 2 * cfg.moe_hidden, dtype=dtype))
        self.down = nn.Parameter(torch.empty(n_local, cfg.moe_hidden, cfg.hidden, dtype=dtype))
        self.logical = list(range(first, first + n_local)) if logical is None else logical
        #: the GEMMs in FP8 (set by portapipe.models.fp8_layers.enable_fp8)
        self.fp8 = False

    @property
    def logical(self) -> list[int]:
        """Logical expert held by each local slot (a balancer may replicate and reorder them)."""
        return expert_ids(self.gate_up)

    @logical.setter
    def logical(self, ids: list[int]) -> None:
        for p in (self.gate_up, self.down):
            mark_expert(p, ids)  # sharded over EP, reduced over DP only

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor | Fp8Rows, offs: torch.Tensor, backend: Backend, tiles: Sequence[int] = (), zm: Any = None
    ) -> torch.Tensor:
        """Rows ``x`` grouped by ``offs`` into tiles (``tiles``: rows per tile) of local-expert
        groups (tile-major), each output row scaled by its router weight ``weights[row]``.
        ``weights`` may be the rows of an FP8 dispatch (:class:`~portapipe.fp8.dispatch.Fp8Rows`,
        ``x`` their stand-in): the up projection takes their FP8 values as they arrived."""
        rows = None
        if isinstance(weights, Fp8Rows):
            rows = weights.rows
            x, weights = split_received(x, weights)
        # the recipe (portapipe.fp8): every row's input and output gradient as FP8 values, as they travel
        gu = grouped_linear(x, self.gate_up, offs, backend, tiles, self.fp8, rows, fp8_input=True)
        # zm: zero-memory (portapipe.memory.zero_memory) may recompute the activation in backward.
        act = swiglu(gu, self.width, weights) if zm is None else zm.activation(swiglu, gu, self.width, weights)
        return grouped_linear(act.contiguous(), self.down, offs, backend, tiles, self.fp8, fp8_grad=True)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ep: ExpertParallel, dtype: torch.dtype, index: int = -1) -> None:
        super().__init__()
        self.ep = ep
        self.index = index
        self.n_experts = cfg.n_experts
        self.router = ARCHITECTURES[cfg.arch].router(cfg, dtype)
        #: how the dispatch and the combine travel (:class:`~portapipe.scheduling.exchange.Wire`; None:
        #: as they are; FP8 under train.fp8, set by portapipe.models.fp8_layers.enable_fp8)
        self.dispatch_wire: Any = None
        self.combine_wire: Any = None
        self.refetch_wire: Any = None  # zero-memory's re-dispatch of the rows alone
        self.shared = DenseFFN(cfg.hidden, cfg.moe_hidden * cfg.n_shared, dtype) if cfg.n_shared > 0 else None
        if ep.balancer is None:
            first, _ = ep.expert_range(cfg.n_experts)
            self.experts = Experts(cfg, ep.local_experts(cfg.n_experts), first, dtype)
        else:  # physical slots, each holding the logical expert the balancer's placement says
            slots = ep.balancer.experts_on(index)
            self.experts = Experts(cfg, len(slots), slots[0], dtype, logical=slots)
            # Rows this rank routed to each physical slot since the balancer last read them.
            self.register_buffer("slot_counts", torch.zeros(ep.balancer.num_slots, dtype=torch.int64), persistent=False)
        # Rows routed to each logical expert by this rank since the last bias update.
        self.register_buffer("step_counts", torch.zeros(cfg.n_experts, dtype=torch.int64), persistent=False)
        self.clock = ExpertClock()  # this rank's expert compute per step (EP wait figures)

    def dispatch_plan(self, idx: torch.Tensor) -> DispatchPlan:
        """Plan the dispatch of routed entries ``idx[T, k]`` (logical ids) and count them."""
        if self.ep.balancer is None:
            plan = plan_dispatch(self.ep, idx, self.n_experts)
            self.step_counts += plan.counts
            return plan
        slots = self.ep.balancer.route(self.index, idx)
        plan = plan_dispatch(self.ep, slots, self.ep.balancer.num_slots)
        self.step_counts += torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        self.slot_counts += plan.counts
        return plan


def _given(positions: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """The parts' extra argument: the positions when the data has documents, else none (the parts' calls stay as they were)."""
    return () if positions is None else (positions,)


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, ep: ExpertParallel, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index
        self.norm1 = norm(cfg, cfg.hidden, dtype)
        self.attn = ARCHITECTURES[cfg.arch].attention(cfg, dtype)
        self.norm2 = norm(cfg, cfg.hidden, dtype)
        self.top_k = cfg.top_k
        if index < cfg.n_dense:
            self.ffn: DenseFFN | None = DenseFFN(cfg.hidden, cfg.ffn_hidden, dtype)
            self.moe: MoE | None = None
        else:
            self.ffn, self.moe = None, MoE(cfg, ep, dtype, index)
        # Memory options (portapipe.memory.policy.LayerMemory), set by portapipe.memory.policy.configure.
        self.memory: Any = None
        #: alpha of the sequence-wise balance loss (portapipe.models.objective); 0: not computed
        self.balance_weight = 0.0
        #: the position of the layer's first row (a multi-token prediction module's: its depth)
        self.position_offset = 0

    # ----------------------------------------------------------------- parts
    def dense_part(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attn(self.norm1(x), self.position_offset, positions)
        return h + self.ffn(self.norm2(h))

    def attention_part(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[Any, ...]:
        """Attention + residual, FFN norm, routing, and the rows to send with their router
        weights: ``(h, hn, send, local, local_weights, plan)``. ``send`` goes to other EP ranks,
        each row with its router weight as its last column (:func:`.expert_parallel.with_weights`);
        ``local`` / ``local_weights`` (routed to this rank's own experts) need no exchange. Both
        gathered in ``plan.send_order``, each into a buffer of its own (the local rows are kept
        for the experts' backward, the sent ones are not). With a balance-loss weight, the
        layer's sequence-wise balance loss follows as a seventh element. ``positions``: each
        token's position in its document (:mod:`portapipe.data.samples`), None for one per row."""
        moe = self.moe
        h = x + self.attn(self.norm1(x), self.position_offset, positions)
        hn = self.norm2(h)
        flat = hn.reshape(-1, hn.shape[-1])
        w, idx, affinity = moe.router.route(flat, affinities=bool(self.balance_weight))
        plan = moe.dispatch_plan(idx)
        n, order, tokens, w = plan.n_remote, plan.send_order, plan.send_order // self.top_k, w.reshape(-1)
        send = with_weights(flat.index_select(0, tokens[:n]), w.index_select(0, order[:n]))
        out = (h, hn, send, flat.index_select(0, tokens[n:]), w.index_select(0, order[n:]), plan)
        if affinity is None:
            return out
        return (*out, sequence_balance_loss(affinity, idx, x.shape[0]))

    def routed(self, tape: Any, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[Any, ...]:
        """The attention part through ``tape``; its balance loss (when computed) recorded as a
        loss term of this stage (:meth:`~portapipe.scheduling.overlap.Tape.loss`).
        Returns :meth:`attention_part`'s first six elements."""
        out = tape.part(self.attention_part, x, *_given(positions))
        if len(out) == 7:
            tape.loss(balance_term(self.index), out[6], self.balance_weight)
            out = out[:6]
        return out

    def experts_part(
        self, rows: torch.Tensor, weights: torch.Tensor | Fp8Rows | None, plan: DispatchPlan, zm: Any = None, local: bool = False
    ) -> torch.Tensor:
        """Rows through the grouped expert MLP, each scaled by its router weight (``weights``,
        or None: the rows' last column, as a dispatch delivers them; or an FP8 dispatch's rows,
        ``rows`` their stand-in).

        ``local``: the rows this rank routed to itself (one group per local expert), else the
        received ones (grouped by source rank, then expert). Each (source, expert) block is a
        group of its own, with the rows in arrival order, so the output rows come back in the
        received order with no permutation, and a row meets the neighbours it meets in one
        process. ``zm`` (zero-memory) keeps the expert inputs out of what autograd saves.
        """
        moe = self.moe
        if weights is None:
            received = rows
            rows, weights = split_weights(received)
            free_storage(received)  # copied out; the split's backward needs only the sizes
        offs, tiles = (plan.local_offs, ()) if local else (plan.remote_offs, plan.remote_tile_rows)
        keep = contextlib.nullcontext() if zm is None else zm.dropping(weights.rows if isinstance(weights, Fp8Rows) else rows, local)
        with keep:
            return moe.clock.run(moe.experts, rows, weights, offs, moe.ep.backend, tiles, zm)

    def shared_part(self, hn: torch.Tensor, zm: Any = None) -> torch.Tensor:
        if zm is None:
            return self.moe.shared(hn)
        with zm.recipes():
            return self.moe.shared(hn, zm)

    def combine_part(
        self, h: torch.Tensor, shared: torch.Tensor | None, back: torch.Tensor | None, local: torch.Tensor, plan: DispatchPlan
    ) -> torch.Tensor:
        """Rows back in (token, k) order (already weighted by the experts), summed over k, plus
        shared expert and residual. ``back``: the remote rows' outputs (None without other EP
        ranks), ``local``: the local rows'. Keeps nothing for backward."""
        # A gather by the inverse permutation: its backward needs only the index (an
        # out-of-place index_copy by ``send_order`` would keep the rows as well).
        sent = local if back is None else torch.cat([back, local])
        rows = sent.index_select(0, plan.inverse_order)
        routed = rows.view(-1, self.top_k, rows.shape[-1]).sum(1).view_as(h)
        out = h + routed
        return out if shared is None else out + shared

    # --------------------------------------------------------------- program
    def program(self, tape: Any, x: torch.Tensor, positions: torch.Tensor | None = None) -> Generator[Any, None, torch.Tensor]:
        if self.moe is None:
            return tape.part(self.dense_part, x, *_given(positions))
        routed = self.routed(tape, x, positions)
        return (yield from self.moe_program(tape, *routed))

    def moe_program(
        self,
        tape: Any,
        h: torch.Tensor,
        hn: torch.Tensor,
        send: torch.Tensor,
        local: torch.Tensor,
        local_weights: torch.Tensor,
        plan: DispatchPlan,
        zm: Any = None,
    ) -> Generator[Any, None, torch.Tensor]:
        """The parts after attention: dispatch, shared expert, the received rows' experts,
        combine, the local rows' experts, sum over top-k."""
        moe = self.moe
        last = self.combine_part if zm is None else zm.issue_early(self.combine_part)
        if moe.ep.size == 1:  # every row is local: nothing to exchange
            shared = tape.part(self.shared_part, hn, zm) if moe.shared is not None else None
            mine = tape.part(self.experts_part, local, local_weights, plan, zm, True)
            return tape.part(last, h, shared, None, mine, plan)
        counts = plan.counts_exchange
        if counts is not None and counts.in_flight:
            # the other ranks' row counts travel (the routing started them): an F&B pair's other
            # program runs meanwhile; the dispatch's splits below wait for them
            yield counts
        if zm is not None:  # zero-memory's re-dispatch needs no gradient: the backward may start it early
            tape.ahead(zm.issue)
        # the rows with their router weights (one exchange; its reverse brings both gradients)
        dispatch = tape.all_to_all(moe.ep, send, plan.remote_recv_splits, plan.remote_send_splits, moe.dispatch_wire)
        yield dispatch
        # The shared expert and the rows this rank routed to itself need nothing from other
        # ranks: the shared expert computes while the rows travel, the local rows' experts
        # while the combine does (in a lone forward they are what can; in an F&B the other
        # micro-batch's parts run at each yield first). Their backwards hide the combine's
        # reverse exchange.
        shared = tape.part(self.shared_part, hn, zm) if moe.shared is not None else None
        got = dispatch.wait()
        out = tape.part(self.experts_part, *((got.standin, got) if isinstance(got, Fp8Rows) else (got, None)), plan, zm)
        combine = tape.all_to_all(moe.ep, out, plan.remote_send_splits, plan.remote_recv_splits, moe.combine_wire)
        yield combine
        mine = tape.part(self.experts_part, local, local_weights, plan, zm, True)
        return tape.part(last, h, shared, combine.wait(), mine, plan)


class MTPLayer(Layer):
    """Multi-token prediction module of depth ``depth`` (DeepSeek-V3 report, 2.2): a decoder
    layer (always with routed experts, as transformers builds it) at global index ``n_layers +
    depth - 1``, with its own input norms, projection and output norm (the published layout:
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``). It uses the model's embedding and
    output head, which the last block holds.

    Row p of depth k combines the previous depth's row p (``hnorm``) with the embedding of token
    p + k (``enorm``), ``eh_proj`` over ``[enorm(embedding); hnorm(hidden)]``, then runs the layer
    (RoPE at the embedded tokens' positions, ``p + k``) and predicts token p + k + 1 through
    ``shared_head.norm`` and the head; the normed output is the next depth's previous hidden state
    (as transformers' ``MtpModel`` chains them; depth 0's is the main model's normed last hidden
    state). Depth k has ``seq - k`` rows. Its loss is the report's: the cross-entropy summed over
    those rows, divided by all ``batch x seq`` positions (1 / T).
    """

    def __init__(self, cfg: ModelConfig, depth: int, ep: ExpertParallel, dtype: torch.dtype) -> None:
        super().__init__(cfg, cfg.n_layers + depth - 1, ep, dtype)
        self.depth = self.position_offset = depth
        self.enorm = norm(cfg, cfg.hidden, dtype)
        self.hnorm = norm(cfg, cfg.hidden, dtype)
        self.eh_proj = Linear(2 * cfg.hidden, cfg.hidden, dtype)
        self.shared_head = nn.ModuleDict({"norm": norm(cfg, cfg.hidden, dtype)})

    def mtp_input_part(self, h: torch.Tensor, tokens: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """``eh_proj([enorm(embed(tokens)); hnorm(h)])`` over the first ``tokens.shape[1]`` rows of ``h``."""
        rows = tokens.shape[1]
        return self.eh_proj(torch.cat([self.enorm(embed(tokens)), self.hnorm(h[:, :rows])], dim=-1))

    def mtp_output_part(
        self, x: torch.Tensor, targets: torch.Tensor, head: torch.Tensor, positions: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the normed output, the depth's loss: cross-entropy summed over its rows / ``positions``)."""
        hk = self.shared_head["norm"](x)
        logits = linear(hk, head)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum") / positions
        return hk, loss

    def predict(
        self, tape: Any, h: torch.Tensor, targets: torch.Tensor, embed: nn.Embedding, head: torch.Tensor, weight: float
    ) -> Generator[Any, None, torch.Tensor]:
        """Program: this depth over the previous depth's output ``h`` (``targets``: the micro-batch's
        next tokens, from which the tokens it embeds are read); records its loss with ``weight``
        (lambda / D) as a loss term of the stage; returns its normed output."""
        k = self.depth
        batch, seq = targets.shape
        x = tape.part(self.mtp_input_part, h, targets[:, k - 1 : seq - 1], embed)
        x = yield from (self.program(tape, x) if self.memory is None else self.memory.program(self, tape, x))
        hk, loss = tape.part(self.mtp_output_part, x, targets[:, k:], head, batch * seq)
        tape.loss(mtp_term(k), loss, weight)
        return hk


class Block(nn.Module):
    """Layers ``[first, last)`` of the model; block 0 embeds tokens, the final block ends in the loss.

    The last block also holds the ``model.mtp_layers`` multi-token prediction modules
    (:class:`MTPLayer`, in ``layers`` under their global indices after the main layers'), run
    after the head on its normed hidden state.

    Weights two blocks share are one logical weight with a copy in each
    (:func:`~portapipe.scheduling.stage.mark_shared`; their gradients are summed over the copies,
    as DualPipe's copies of a block are): the embedding, when the last block also needs it
    (multi-token prediction, or an output head tied to it, ``model.tie_word_embeddings``). With a
    tied head the last block's logits use its embedding's weight; no head weight of its own exists.
    """

    def __init__(
        self, cfg: ModelConfig, block: int, n_blocks: int, ep: ExpertParallel, seed: int, objective: Objective | None = None, split: Any = None
    ) -> None:
        super().__init__()
        self.objective = Objective() if objective is None else objective
        dtype = DTYPES[cfg.dtype]
        self.block, self.n_blocks = block, n_blocks
        self.is_last = block == n_blocks - 1
        self.first, self.last = layer_range(cfg.n_layers, n_blocks, block, split)  # split: parallel.layers_per_stage
        shares_embed = uses_embedding_last(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=dtype) if block == 0 or (self.is_last and shares_embed) else None
        if self.embed is not None and shares_embed and n_blocks > 1:
            mark_shared(self.embed.weight, (0, n_blocks - 1))
        self.layers = nn.ModuleDict({str(i): Layer(cfg, i, ep, dtype) for i in range(self.first, self.last)})
        self.mtp_depth = cfg.mtp_layers if self.is_last else 0
        for k in range(1, self.mtp_depth + 1):
            self.layers[str(cfg.n_layers + k - 1)] = MTPLayer(cfg, k, ep, dtype)
        for layer in self.moe_layers():
            layer.balance_weight = self.objective.seq_aux_weight
        if self.is_last:
            self.final_norm: RMSNorm | None = norm(cfg, cfg.hidden, dtype)
            self.head: Linear | None = None if cfg.tie_word_embeddings else Linear(cfg.hidden, cfg.vocab_size, dtype)
        else:
            self.final_norm = self.head = None
        if not next(self.parameters()).is_meta:  # a build on the meta device has shapes only
            init_parameters(self, cfg, seed)

    @property
    def has_loss(self) -> bool:
        return self.is_last

    def head_weight(self) -> nn.Parameter:
        """The output head's weight ``[vocab, hidden]``: the embedding's when tied."""
        return self.embed.weight if self.head is None else self.head.weight

    def embed_part(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)

    def logits_part(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.final_norm(x), self.head_weight())

    def loss_part(self, x: torch.Tensor, targets: torch.Tensor) -> Any:
        """The main next-token loss; with multi-token prediction also the normed hidden state it read."""
        hn = self.final_norm(x)
        logits = linear(hn, self.head_weight())
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return (loss, hn) if self.mtp_depth else loss

    def main_layers(self) -> list[Layer]:
        """The model's layers in this block, in order (the multi-token prediction modules apart)."""
        return [self.layers[str(i)] for i in range(self.first, self.last)]

    def mtp_layers(self) -> list[MTPLayer]:
        """The multi-token prediction modules, by depth."""
        return [layer for layer in self.layers.values() if isinstance(layer, MTPLayer)]

    def program(
        self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> Generator[Any, None, torch.Tensor]:
        """Forward of one micro-batch: tokens or hidden states in; hidden states or the loss out.
        ``positions``: each token's position in its document, when attention stays inside
        documents (the stage contract, :mod:`portapipe.scheduling.stage`)."""
        x = tape.watch(x)
        if self.block == 0:
            x = tape.part(self.embed_part, x)
        for layer in self.main_layers():
            # layer.memory: recompute / zero-memory options (portapipe.memory.policy), if any.
            x = yield from (layer.program(tape, x, positions) if layer.memory is None else layer.memory.program(layer, tape, x, positions))
        if self.is_last:
            if targets is None:
                raise ValueError(f"block {self.block} computes the loss and needs the targets")
            if not self.mtp_depth:
                return tape.part(self.loss_part, x, targets)
            loss, h = tape.part(self.loss_part, x, targets)
            weight = self.objective.mtp_weight / self.mtp_depth
            for mtp in self.mtp_layers():
                h = yield from mtp.predict(tape, h, targets, self.embed, self.head_weight(), weight)
            x = loss
        return x

    def moe_layers(self) -> list[Layer]:
        return [layer for layer in self.layers.values() if layer.moe is not None]


def tie_copies(blocks: dict[int, Block], together: Callable[[tuple[int, ...]], bool] | None = None) -> None:
    """Blocks held by one process: every copy of a shared weight
    (:func:`~portapipe.scheduling.stage.mark_shared`) becomes the one parameter of the first block
    holding it, so autograd sums its uses as one weight's. ``together(blocks)``: whether this
    process holds every copy of a weight shared by ``blocks`` (default: all of them are among
    ``blocks``, as in the single-process model); a weight whose copies are not together keeps
    them (their gradients are summed over the ranks holding them)."""
    first: dict[str, nn.Parameter] = {}
    for b in sorted(blocks):
        for name, p in list(blocks[b].named_parameters()):
            shared = shared_blocks(p)
            if not shared or not (together(shared) if together is not None else all(c in blocks for c in shared)):
                continue
            if name not in first:
                first[name] = p
                continue
            owner, _, leaf = name.rpartition(".")
            setattr(blocks[b].get_submodule(owner), leaf, first[name])


def uses_embedding_last(cfg: ModelConfig) -> bool:
    """Whether the last block uses the embedding too (and holds a copy when it is not block 0)."""
    return bool(cfg.tie_word_embeddings or cfg.mtp_layers)


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))


@torch.no_grad()
def init_parameters(block: Block, cfg: ModelConfig, seed: int) -> None:
    """Seeded per parameter name (per logical expert for routed experts): split-independent.

    Each draw has a generator of its own, so the draws run on the intra-op threads side by side
    (a 3-billion-parameter model's float64 normals take about a minute on one core) and give the
    same values in any order."""
    out_scale = 1.0 / math.sqrt(2 * cfg.n_layers)
    gains = {f"{n}.weight" for n, m in block.named_modules() if isinstance(m, RMSNorm)}
    draws: list[tuple[torch.Tensor, str, float]] = []  # (target, generator name, std)
    for name, p in block.named_parameters():
        if name in gains:
            p.fill_(1.0)
            continue
        std = cfg.init_std * (out_scale if name.endswith(("wo.weight", "down.weight", ".down")) else 1.0)
        if is_expert(p):
            experts = block.get_submodule(name.rsplit(".", 1)[0])
            draws += [(p[j], f"{name}[{experts.logical[j]}]", std) for j in range(p.shape[0])]
        else:
            draws.append((p, name, std))

    @torch.no_grad()  # grad mode is per thread: the pool's threads do not inherit this function's
    def draw(target: torch.Tensor, key: str, std: float) -> None:
        target.copy_(torch.randn(target.shape, generator=_generator(seed, key), dtype=torch.float64) * std)

    workers = min(torch.get_num_threads(), len(draws))
    if workers <= 1:
        for d in draws:
            draw(*d)
        return
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(draw, *d) for d in draws]:
            future.result()


def build_blocks(
    cfg: ModelConfig, blocks: list[int], n_blocks: int, ep: ExpertParallel, seed: int, objective: Objective | None = None, split: Any = None
) -> dict[int, Block]:
    """This rank's model blocks, seeded; with ``model.init_from``, holding that folder's weights.
    ``objective``: the weights of the objective's extra terms (none by default); ``split``: the
    layers of each block (``parallel.layers_per_stage``, :func:`~portapipe.setup.stage_layers`)."""
    built = {b: Block(cfg, b, n_blocks, ep, seed, objective, split) for b in blocks}
    if cfg.init_from is not None and built and not next(built[blocks[0]].parameters()).is_meta:
        from .hf_folder import load_hf_weights

        load_hf_weights(built.values(), cfg)
    return built


is_expert_param = is_expert
