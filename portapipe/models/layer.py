"""One transformer layer as a program of parts (attention, dispatch, shared, experts, combine), and the
multi-token prediction module built on it."""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fp8.dispatch import Fp8Rows
from ..tensors.storage import free_storage
from .arch import ARCHITECTURES, norm
from .ffn import DenseFFN, MoE
from .expert_parallel import DispatchPlan, ExpertParallel, split_weights, with_weights
from .linear import Linear, linear
from .objective import balance_term, mtp_term, sequence_balance_loss
from ..data.samples import IGNORE


def mtp_positions(positions: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of multi-token prediction depth ``depth`` inside documents, from the input tokens'
    ``positions[b, seq]`` (0 where a document starts): (each row's position, ``[b, seq - depth]``;
    True where the row straddles two documents).

    Row p reads the hidden state of token p and embeds token p + depth: it straddles when a
    document starts at one of tokens p + 1 .. p + depth. Each row takes token p's position, so a
    document's rows are numbered from 0 as they are alone (RoPE sees the same distances between
    them as at the embedded tokens' positions, p + depth). The rows that straddle are the last
    ``depth`` of their document's: no row of it attends to them (attention is causal) and the next
    document's rows start afresh, so they change no other row; their targets leave the loss."""
    seq = positions.shape[1]
    started = torch.cumsum(positions == 0, dim=1)
    return positions[:, : seq - depth], started[:, depth:] != started[:, : seq - depth]


def _released(result: torch.Tensor, *done: Any) -> torch.Tensor:
    """``result``, with the memory of ``done`` released: tensors the combine part has summed (the
    experts' and the shared expert's outputs, the rows the combine brought back), which no
    backward reads (neither their parts' nor the combine's keeps them: their gradients need only
    their shapes), so they need not stay until the layer's backward as the tape's roots."""
    for t in done:
        if isinstance(t, torch.Tensor):
            free_storage(t)
    return result


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

    def remaking(self) -> contextlib.AbstractContextManager[Any]:
        """The block a part's forward runs in: with ``memory.recompute: norms`` what the layer can
        make again (:mod:`.remake`: norms' outputs, MLA's up-projections) is kept as recipes."""
        norms = None if self.memory is None else self.memory.norms
        return contextlib.nullcontext() if norms is None else norms.recipes()

    # ----------------------------------------------------------------- parts
    def dense_part(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        with self.remaking():
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
        with self.remaking():  # the FFN norm's output stays: the tape, the router and the dispatch hold it
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
            return _released(tape.part(last, h, shared, None, mine, plan), shared, mine)
        counts = plan.counts_exchange
        if counts is not None and counts.in_flight:
            # the other ranks' row counts travel (the routing started them): an F&B pair's other
            # program runs meanwhile; the dispatch's splits below wait for them
            yield counts
        if zm is not None:  # zero-memory's re-dispatch needs no gradient: the backward may start it early
            tape.ahead(zm.issue)
        # the rows with their router weights (one exchange; its reverse brings both gradients)
        dispatch = tape.all_to_all(moe.ep, send, plan.remote_recv_splits, plan.remote_send_splits, moe.dispatch_wire, ("dispatch", self.index))
        yield dispatch
        # The shared expert and the rows this rank routed to itself need nothing from other
        # ranks: the shared expert computes while the rows travel, the local rows' experts
        # while the combine does (in a lone forward they are what can; in an F&B the other
        # micro-batch's parts run at each yield first). Their backwards hide the combine's
        # reverse exchange.
        shared = tape.part(self.shared_part, hn, zm) if moe.shared is not None else None
        got = dispatch.wait()
        free_storage(send)  # sent: the attention part's backward needs only its gradient
        out = tape.part(self.experts_part, *((got.standin, got) if isinstance(got, Fp8Rows) else (got, None)), plan, zm)
        combine = tape.all_to_all(moe.ep, out, plan.remote_send_splits, plan.remote_recv_splits, moe.combine_wire, ("combine", self.index))
        yield combine
        mine = tape.part(self.experts_part, local, local_weights, plan, zm, True)
        back = combine.wait()
        return _released(tape.part(last, h, shared, back, mine, plan), shared, mine, back, out)


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

    With the documents of each sample (``data.document_mask``, the ``positions`` of the stage
    contract) each row attends within the document of the hidden state it reads
    (:func:`mtp_positions`), as the document's rows would run alone. A row whose embedded token
    lies in a later document mixes two documents and exists in neither run alone: no other row
    reads it, and its target is left out of the depth's loss. With ``data.mask_eos_loss`` (which
    needs the document mask here) a target starting a document is left out as well, and the
    token such a straddling row embeds is read as id 0 (the data hides it; only the experts'
    load counts see that row).
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
        self, tape: Any, h: torch.Tensor, targets: torch.Tensor, embed: nn.Embedding, head: torch.Tensor, weight: float,
        positions: torch.Tensor | None = None,
    ) -> Generator[Any, None, torch.Tensor]:
        """Program: this depth over the previous depth's output ``h`` (``targets``: the micro-batch's
        next tokens, from which the tokens it embeds are read); records its loss with ``weight``
        (lambda / D) as a loss term of the stage; returns its normed output. ``positions``: each
        input token's position in its document, when attention stays inside documents."""
        k = self.depth
        batch, seq = targets.shape
        embedded, wanted = targets[:, k - 1 : seq - 1], targets[:, k:]
        if positions is not None:
            positions, straddle = mtp_positions(positions, k)
            wanted = wanted.masked_fill(straddle, IGNORE)
            # data.mask_eos_loss leaves out each target that starts a document: such a token is
            # embedded only by a row that straddles (it reaches no loss and no other row), as id 0
            embedded = embedded.masked_fill(embedded == IGNORE, 0)
        x = tape.part(self.mtp_input_part, h, embedded, embed)
        x = yield from (self.program(tape, x, positions) if self.memory is None else self.memory.program(self, tape, x, positions))
        hk, loss = tape.part(self.mtp_output_part, x, wanted, head, batch * seq)
        tape.loss(mtp_term(k), loss, weight)
        return hk
