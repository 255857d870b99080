"""A stage's forward and backward as the executor runs them: parts, exchanges, switch points.

The executor runs a stage's forward as a program of parts that yields at each expert
all-to-all (:mod:`portapipe.scheduling.overlap`); its backward walks the recorded parts in
reverse, issuing each reverse exchange and waiting only when the part needing its gradient
comes up. This module writes those programs down as op lists, from the model's shape and each
layer's memory option, so the memory and time models follow the same order the executor does:

- ``("C", part, phase, units, saved, held, timing)``: a part's compute (phase F, B, BW or W;
  ``units`` tokens, or routed rows for ``experts``), the bytes it adds (forward, replay) or
  releases (backward, negative) in what autograd saves and in what the tape holds besides, and
  the memory option whose measured time applies (``off``, ``level0``, ``level1``); a forward
  part ``memory.offload`` names has an eighth field, the bytes of its saved ones that leave
  for host memory when it returns (:mod:`.offload_bytes`);
- ``("I", key, nbytes)``: an exchange issued (``nbytes`` sent by this rank);
- ``("Y", key)``: the program yields after issuing it: an F&B switches to the other program;
- ``("A", key)``: the program waits for the exchange.

:func:`interleave` merges a forward and a backward program the way
:func:`~portapipe.scheduling.overlap.run_pair` does; with one EP rank exchanges are plain copies
that are never in flight, so the pair runs one program after the other.

A last block's multi-token prediction modules (layers ``n_layers .. n_layers + D - 1``) run after
its head: per depth k, the ``mtp`` part, the module's MoE layer and a ``head`` part, over the
``(seq_len - k) / seq_len`` share of the micro-batch's tokens that has a token k + 1 ahead. Their
backward is priced before the main head's rather than after it (the tape runs the main head's
last, as the modules read its output): the same work, a different order within the action.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from dataclasses import dataclass

from . import norm_recompute
from .fp8_bytes import saved_delta
from .offload_bytes import sent_bytes
from .shape import Shape, dispatch_row_bytes, held_bytes, saved_bytes

Op = tuple


@dataclass(frozen=True)
class StageSpec:
    """One model block as placed on a rank: its layers and their memory options."""

    layers: tuple[int, ...]
    options: tuple[str, ...]  # per layer: off, level0, level1, recompute_moe, recompute_full
    first: bool  # holds the embedding
    last: bool  # holds the head and the loss
    norms: tuple[bool, ...] = ()  # per layer: its norms' outputs recomputed (memory.recompute: norms); empty: none
    offload: tuple[tuple[str, ...], ...] = ()  # per layer: the parts whose saved bytes go to host memory (memory.offload); empty: none

    def normed(self, layer: int) -> bool:
        return bool(self.norms) and self.norms[self.layers.index(layer)]

    def sent(self, layer: int) -> tuple[str, ...]:
        return self.offload[self.layers.index(layer)] if self.offload else ()


class Programs:
    """Op lists of the stages of one setup, per micro-batch of ``tokens`` tokens whose EP rank
    receives ``rows`` routed rows per MoE layer (``slots`` grouped-matmul groups) over ``ep``
    EP ranks.

    Of those rows, the ones a rank routes to its own experts (``tokens * top_k / ep``) are not
    exchanged: the experts run on them in a call of their own (``local`` below), while the
    combine travels; the rest arrive by the dispatch. With one EP rank every row is local and
    a layer exchanges nothing."""

    def __init__(
        self, shape: Shape, tokens: float, rows: float, slots: int | None = None, *, ep: int, depth: int = 0,
        fp8: tuple[bool, bool] = (False, False), local: float | None = None, routed: dict[int, tuple[float, float]] | None = None,
    ) -> None:
        self.s, self.T, self.R, self.slots, self.ep = shape, tokens, rows, slots, ep
        self.fp8 = fp8  # (train.fp8 on, memory.fp8_activations): what the parts keep in FP8 (.fp8_bytes)
        self.depth = depth  # a multi-token prediction depth's programs: its share of the tokens
        # ``local``: the rows a routing sent to this rank's own experts (default: its even share)
        self.local_rows = min(rows, tokens * shape.top_k / ep) if local is None else local
        # a run's routing: per MoE layer, its rows and its own rows over their even shares (:meth:`_routed_at`)
        self.routed = routed
        self._layers: dict[int, Programs] = {}
        self._depths: dict[int, Programs] = {}
        self._cache: dict[tuple[StageSpec, str], list[Op]] = {}
        self.stats: dict[tuple, tuple[float, float, float, float]] = {}  # the memory model's, per program
        self.wqueue: dict[StageSpec, float] = {}  # the memory model's, per stage

    @classmethod
    def of(cls, setup: Any, imbalance: float = 1.0, routed: dict[int, tuple[float, float]] | None = None) -> Programs:
        """The programs of ``setup``'s model and micro-batch, the busiest EP rank receiving
        ``imbalance`` times the mean routed rows; ``routed``: a run's own routing instead, per
        MoE layer the rows the rank's experts ran on and of them the rows it routed to itself,
        each over its even share (the micro-batch's tokens x top_k, and that over the EP ranks)."""
        m = setup.model
        tokens = setup.micro_batch_size * m.seq_len
        bal = getattr(setup, "balancer", None)
        slots = m.n_experts + bal.redundant * setup.ep if bal is not None and bal.kind != "none" else None
        train = getattr(setup, "train", None)
        fp8 = train is not None and getattr(train, "fp8", "off") != "off"
        return cls(setup.shape, tokens, tokens * m.top_k * imbalance, slots, ep=setup.ep,
                   fp8=(fp8, fp8 and getattr(setup, "fp8_activations", False)), routed=routed)

    # ------------------------------------------------------------------ parts
    def _c(self, part: str, phase: str, option: str, sign: int, units: float | None = None, memory: bool = True, norms: bool = False,
           sent: tuple[str, ...] = ()) -> Op:
        """A part's op, for ``units`` (default the part's whole: tokens, or all routed rows);
        ``memory`` False: the bytes the part keeps are another op's (the experts' two calls
        count theirs once, on the received rows' call); ``sent``: the layer's offloaded parts."""
        s, T, R = self.s, self.T, self.R
        saved = saved_bytes(s, part, option, T, R, self.slots, seq=s.seq_len - self.depth) if memory else 0
        if norms and memory:
            saved -= norm_recompute.dropped_bytes(s, part, T, self.fp8[1])
        if memory and self.fp8[0]:
            saved += saved_delta(s, self.fp8[1], part, option, T, R, R - self.local_rows)
        held = held_bytes(s, part, option, T, R, ep=self.ep) if memory else 0
        if units is None:
            units = R if part == "experts" else T
        op = ("C", part, phase, units, sign * saved, sign * held, option if option in ("level0", "level1") else "off")
        if part in sent and memory and sign > 0:
            op += (sent_bytes(saved, s, part, option, T, R, self.local_rows, self.slots, norms=norms, cached=self.fp8[1]),)
        return op

    def _experts(self, phase: str, option: str, sign: int, local: bool, sent: tuple[str, ...] = ()) -> Op:
        """The experts' call on the local rows, or on the received ones."""
        return self._c("experts", phase, option, sign, self.local_rows if local else self.R - self.local_rows, memory=not local, sent=sent)

    def _moe_forward(self, layer: int, option: str, replay: bool = False, sent: tuple[str, ...] = ()) -> list[Op]:
        """Dispatch -> shared expert -> received rows' experts -> combine -> local rows' experts
        -> combine part, as ``moe_program``. ``replay``: the recompute replay, which saves what
        ``off`` saves."""
        s, T, R, e, h = self.s, self.T, self.R, self.s.e, self.s.hidden
        opt = "off" if replay else option
        shared = [self._c("shared", "F", opt, 1, sent=sent)] if s.n_shared else []
        if self.ep == 1:
            return shared + [self._c("experts", "F", opt, 1, sent=sent), self._c("combine", "F", opt, 1)]
        return [
            ("I", ("d", layer), T * s.top_k * dispatch_row_bytes(s)),  # each row with its router weight (FP8 under train.fp8)
            ("Y", ("d", layer)),
            *shared,  # while the rows travel
            ("A", ("d", layer)),
            self._experts("F", opt, 1, local=False, sent=sent),
            ("I", ("c", layer), R * h * e),
            ("Y", ("c", layer)),
            self._experts("F", opt, 1, local=True),  # while the combine travels
            ("A", ("c", layer)),
            self._c("combine", "F", opt, 1),
        ]

    def _moe_backward(self, layer: int, option: str, phase: str) -> list[Op]:
        """The MoE parts' backward as the tape's data flow runs it: the combine's reverse
        exchange is issued as soon as the combine part's backward gave its gradient, and the
        local rows' experts backward and the shared expert's run while it travels."""
        s, T, R, e, h = self.s, self.T, self.R, self.s.e, self.s.hidden
        opt = "off" if option.startswith("recompute") else option
        shared = [self._c("shared", phase, opt, -1)] if s.n_shared else []
        if self.ep == 1:
            return [self._c("combine", phase, opt, -1), self._c("experts", phase, opt, -1), *shared]
        ops: list[Op] = []
        if opt in ("level0", "level1"):  # the re-dispatch starts as the layer's backward begins
            ops.append(("I", ("r", layer), T * s.top_k * dispatch_row_bytes(s, weights=False)))
        ops += [
            self._c("combine", phase, opt, -1),
            ("I", ("c'", layer), T * s.top_k * dispatch_row_bytes(s, weights=False)),  # towards the experts: FP8 under train.fp8
            ("Y", ("c'", layer)),
            self._experts(phase, opt, -1, local=True),
            *shared,
            ("A", ("c'", layer)),
        ]
        if opt in ("level0", "level1"):
            ops.append(("A", ("r", layer)))
        ops += [
            self._experts(phase, opt, -1, local=False),
            ("I", ("d'", layer), R * (h + 1) * e),  # the rows' and the weights' gradients
            ("Y", ("d'", layer)),
            ("A", ("d'", layer)),
        ]
        return ops

    def _attention(self, layer: int, option: str, norms: bool = False, sent: tuple[str, ...] = ()) -> list[Op]:
        """The attention part, then the routing's exchange of per-expert row counts, which the
        program yields at (an F&B pair's other program runs while it travels) and waits for."""
        counts = ("n", layer)
        return [self._c("attention", "F", option, 1, norms=norms, sent=sent), ("I", counts, self.s.n_experts * 8), ("Y", counts), ("A", counts)]

    def _at_depth(self, layer: int) -> Programs:
        """The programs of the multi-token prediction module whose layer is ``layer``."""
        k = layer - self.s.n_layers + 1
        if k not in self._depths:
            share = (self.s.seq_len - k) / self.s.seq_len
            self._depths[k] = Programs(self.s, self.T * share, self.R * share, self.slots, ep=self.ep, depth=k, fp8=self.fp8,
                                       local=self.local_rows * share, routed=self.routed)
        return self._depths[k]

    def _routed_at(self, layer: int) -> Programs:
        """The programs of MoE layer ``layer`` under ``routed`` (itself without)."""
        if not self.routed or layer not in self.routed:
            return self
        if layer not in self._layers:
            rows, own = self.routed[layer]
            even = self.T * self.s.top_k
            self._layers[layer] = Programs(self.s, self.T, even * rows, self.slots, ep=self.ep, depth=self.depth, fp8=self.fp8,
                                           local=even / self.ep * own)
        return self._layers[layer]

    def _layer_forward(self, layer: int, option: str, norms: bool = False, sent: tuple[str, ...] = ()) -> list[Op]:
        """``norms``: the layer's norms' outputs are recomputed (not saved); ``sent``: the parts
        whose saved bytes go to host memory."""
        if layer >= self.s.n_layers and not self.depth:  # a prediction module: its input, layer and head
            d = self._at_depth(layer)
            return [d._c("mtp", "F", "off", 1), *d._layer_forward(layer, option, norms, sent), d._c("head", "F", "off", 1)]
        if not self.s.is_moe(layer):
            return [self._c("dense", "F", option, 1, norms=norms, sent=sent)]
        p = self._routed_at(layer)
        return p._attention(layer, option, norms, sent) + p._moe_forward(layer, option, sent=sent)

    def _part_backward(self, part: str, phase: str, option: str, norms: bool) -> list[Op]:
        """An attention or dense part's backward, after its norms' recompute when they were not saved."""
        op = self._c(part, phase, option, -1, norms=norms)
        return [*norm_recompute.recompute_ops(self.s, part, phase, self.T, self.fp8[1]), op] if norms else [op]

    def _layer_backward(self, layer: int, option: str, phase: str, norms: bool = False) -> tuple[list[Op], list[Op], list[Op]]:
        """A layer's backward as (replay, recomputed backward, the rest): a recomputed layer's
        replay needs no gradient, so the stage's backward may run it early (see :meth:`backward`)."""
        if layer >= self.s.n_layers and not self.depth:  # a prediction module: its head, layer and input
            d = self._at_depth(layer)
            replay, custom, ops = d._layer_backward(layer, option, phase, norms)
            head, mtp = d._c("head", phase, "off", -1), d._c("mtp", phase, "off", -1)
            if custom:  # recomputed: the head's backward comes before its replay's
                return replay, [head, *custom], [*ops, mtp]
            return replay, custom, [head, *ops, mtp]
        routed = self._routed_at(layer)
        if routed is not self:
            return routed._layer_backward(layer, option, phase, norms)
        s = self.s
        replay: list[Op] = []
        custom: list[Op] = []
        full = option == "recompute_full"
        if full:  # replay the whole layer, saving as off does, then its backward
            if s.is_moe(layer):
                replay += self._attention(layer, "off") + self._moe_forward(layer, option, replay=True)
            else:
                replay.append(self._c("dense", "F", "off", 1))
            # the replayed attention saves the layer's rotary tables, which nothing else holds
            replay.insert(1, ("C", "rope", "F", 0, s.rope_bytes(), 0, "off"))
            option = "off"
        ops: list[Op] = []
        if not s.is_moe(layer):
            ops += self._part_backward("dense", phase, option, norms)
        else:
            if option == "recompute_moe":
                replay += self._moe_forward(layer, option, replay=True)
                custom = self._moe_backward(layer, option, phase)
            else:
                ops += self._moe_backward(layer, option, phase)
            ops += self._part_backward("attention", phase, option, norms)
        if full:  # the rotary tables and the layer input, kept for the replay, are let go
            custom, ops = ops, []
            kept = held_bytes(s, "attention", "recompute_full", self.T, self.R, ep=self.ep)
            ops.append(("C", "input", phase, self.T, -s.rope_bytes(), -kept, "off"))
        return replay, custom, ops

    def _stage_layers_backward(self, stage: StageSpec, phase: str) -> list[Op]:
        """The layers' backward, top down, with recompute's replays where the tape runs them:
        the next recomputed layer's replay beside the recomputed backward above it (switching
        at every exchange, as an F&B pair), or, below a layer that is not recomputed, before
        that layer's first wait."""
        segs = [self._layer_backward(layer, option, phase, stage.normed(layer)) for layer, option in reversed(list(zip(stage.layers, stage.options)))]
        ahead = [i for i, (replay, _, _) in enumerate(segs) if replay]
        prepared: int | None = None
        ops: list[Op] = []
        for i, (replay, custom, rest) in enumerate(segs):
            if not replay:
                waits = [n for n, op in enumerate(rest) if op[0] == "A"]
                if waits and prepared is None and ahead:
                    prepared = ahead.pop(0)
                    rest = rest[: waits[0]] + segs[prepared][0] + rest[waits[0] :]
                ops += rest
                continue
            if prepared == i:  # replayed ahead
                mine, prepared = list(custom), None
            else:
                mine = replay + custom
                ahead.remove(i)
            if prepared is None and ahead:
                prepared = ahead.pop(0)
                mine = [op for _, op in interleave(mine, segs[prepared][0], True)]
            ops += mine + rest
        inner = {layer for layer, option in zip(stage.layers, stage.options) if option.startswith("recompute")}
        return _redispatch_ahead(ops, inner)

    # ----------------------------------------------------------------- stages
    def forward(self, stage: StageSpec) -> list[Op]:
        key = (stage, "F")
        if key not in self._cache:
            ops: list[Op] = [self._c("embed", "F", "off", 1)] if stage.first else []
            main = [(layer, option) for layer, option in zip(stage.layers, stage.options) if layer < self.s.n_layers]
            for layer, option in main:
                ops += self._layer_forward(layer, option, stage.normed(layer), stage.sent(layer))
            if stage.last:
                ops.append(self._c("head", "F", "off", 1))
                for layer, option in zip(stage.layers[len(main):], stage.options[len(main):]):
                    ops += self._layer_forward(layer, option, stage.normed(layer), stage.sent(layer))
            else:  # the stage output, held until the backward
                ops.append(("C", "output", "F", self.T, 0, self.T * self.s.hidden * self.s.e, "off"))
            self._cache[key] = ops
        return self._cache[key]

    def backward(self, stage: StageSpec, phase: str) -> list[Op]:
        """``phase`` B (weight gradients deferred to a W), BW (computed in the same action) or
        B+ (a B that starts its W's work while its exchanges travel: the weight gradients of
        the parts before its last wait; the rest is left to the W, :meth:`weights`).

        A BW is the B's ops with each part's weight gradient set aside and computed just
        before the next wait for an exchange (or at the end), as the tape does in a full
        backward with exchanges: the W work hides the exchange in flight.
        """
        key = (stage, phase)
        if key not in self._cache:
            if phase in ("BW", "B+"):
                before, after = _weights_before_waits(self.backward(stage, "B"))
                self._cache[key] = before + after if phase == "BW" else before
                return self._cache[key]
            ops: list[Op] = []
            if stage.last:
                ops.append(self._c("head", phase, "off", -1))
            else:
                ops.append(("C", "output", phase, self.T, 0, -self.T * self.s.hidden * self.s.e, "off"))
            ops += self._stage_layers_backward(stage, phase)
            if stage.first:
                ops.append(self._c("embed", phase, "off", -1))
            self._cache[key] = ops
        return self._cache[key]

    def weights(self, stage: StageSpec, after_start: bool = False) -> list[Op]:
        """The W pass: every part's deferred weight gradients, in the order the backward queued
        them; ``after_start``: those its B (a B+) left, the parts' after its last wait."""
        key = (stage, "W+" if after_start else "W")
        if key not in self._cache:
            b_ops = self.backward(stage, "B")
            if after_start:
                self._cache[key] = _weights_before_waits(b_ops)[1]
            else:
                self._cache[key] = [_weight_op(op) for op in b_ops if op[0] == "C" and op[2] == "B"]
        return self._cache[key]


def _redispatch_ahead(ops: Sequence[Op], inner: set[int]) -> list[Op]:
    """Zero-memory's re-dispatches where the tape starts them (:meth:`~portapipe.scheduling.overlap.Tape.ahead`):
    at the layer's own backward start, or earlier, at a wait of the stage's own tape (not one
    inside a recomputed layer's replay, ``inner``), once the layer above has issued its
    dispatch's reverse exchanges: one layer ahead."""
    redispatch = {op[1][1]: op for op in ops if op[0] == "I" and op[1][0] == "r"}
    marks = list(redispatch)  # top layer first, the order the backward meets them
    issued: set[int] = set()
    passed: set[int] = set()
    last: int | None = None
    out: list[Op] = []
    for op in ops:
        if op[0] == "I" and op[1][0] == "r":
            if op[1][1] not in issued:
                issued.add(op[1][1])
                out.append(op)
            continue
        if op[0] == "A" and op[1][0] in ("c'", "d'") and op[1][1] not in inner and marks and (last is None or last in passed):
            last = marks.pop(0)
            if last not in issued:
                issued.add(last)
                out.append(redispatch[last])
        out.append(op)
        if op[0] == "I" and op[1][0] == "d'":
            passed.add(op[1][1])
    return out


def _weight_op(op: Op) -> Op:
    """The W pass's op for one B-phase part op."""
    return ("C", op[1], "W", op[3], 0, 0, op[6])


def _weights_before_waits(b_ops: Sequence[Op]) -> tuple[list[Op], list[Op]]:
    """An input-gradient backward with each part's W right before the next wait, and the Ws
    of the parts after the last wait (a full backward ends with them)."""
    out: list[Op] = []
    aside: list[Op] = []
    for op in b_ops:
        if op[0] == "A":
            out += aside
            aside = []
        out.append(op)
        if op[0] == "C" and op[2] == "B":
            aside.append(_weight_op(op))
    return out, aside


def interleave(forward: Sequence[Op], backward: Sequence[Op], switching: bool) -> list[tuple[int, Op]]:
    """The order :func:`~portapipe.scheduling.overlap.run_pair` runs two programs in, as
    (program index, op) pairs: each runs until it yields an exchange in flight, then the other
    resumes. ``switching`` is False when exchanges are never in flight (one EP rank)."""
    progs = [list(forward), list(backward)]
    pos = [0, 0]
    out: list[tuple[int, Op]] = []
    cur = 0
    while pos[0] < len(progs[0]) or pos[1] < len(progs[1]):
        prog, i = progs[cur], pos[cur]
        other_left = pos[1 - cur] < len(progs[1 - cur])
        while i < len(prog):
            op = prog[i]
            out.append((cur, op))
            i += 1
            if op[0] == "Y" and switching and other_left:
                break
        pos[cur] = i
        cur = 1 - cur
    return out


def layer_option(opts: Any) -> str:
    """A layer's memory option (a :class:`~portapipe.memory.policy.LayerMemory` or None) by name."""
    if opts is None:
        return "off"
    if opts.recompute is not None:
        return f"recompute_{opts.recompute.mode}"
    return opts.zero_memory.level if opts.zero_memory is not None else "off"


def stage_specs(setup: Any, schedule: Any) -> list[StageSpec]:
    """Every virtual stage's block, as :class:`StageSpec` (layers, options, embedding, head)."""
    from ..memory.policy import offloaded_parts, plan_layers
    from ..config.setup import layer_range

    m = setup.model
    n_blocks = schedule.n_blocks
    specs: dict[int, StageSpec] = {}
    out = []
    for v in range(schedule.n_stages):
        b = schedule.stage_block[v]
        if b not in specs:
            first, last = layer_range(m.n_layers, n_blocks, b, getattr(setup, "layers_per_stage", None))
            # the last block's multi-token prediction modules after its layers (memory options as
            # portapipe.memory.policy.configure gives them: counted after the block's layers)
            layers = tuple(range(first, last)) + (tuple(range(m.n_layers, m.n_layers + m.mtp_layers)) if b == n_blocks - 1 else ())
            planned = plan_layers(setup, [i >= m.n_dense for i in layers])
            options = tuple(layer_option(o) for o in planned)
            norms = tuple(o is not None and o.norms is not None for o in planned)
            # memory.offload, as portapipe.memory.policy.configure_offload gives it (every MoE layer has a shared expert or none)
            sent = tuple(offloaded_parts(setup, i, layer >= m.n_dense, o.recompute.mode if o is not None and o.recompute is not None else None,
                                         bool(m.n_shared)) for i, (layer, o) in enumerate(zip(layers, planned)))
            specs[b] = StageSpec(layers, options, b == 0, b == n_blocks - 1, norms if any(norms) else (), sent if any(sent) else ())
        out.append(specs[b])
    return out
