"""Per-rank peak memory of one setup: what is static plus what the schedule keeps in flight.

Static, per pipeline rank: the parameters of every block the rank holds (DualPipe: two blocks,
each also held by another rank; routed experts: ``n_experts / ep`` plus the balancer's redundant
slots), their gradients (same dtype), AdamW's two moments and step counters, the model's
buffers.

In flight: each rank's lowered action list is walked in order, and each compute action through
its stage program (:mod:`.programs`), part by part; an F&B interleaves its two programs as the
executor does. Two running totals:

- ``saved``: what autograd keeps for backward, byte for byte what
  :class:`~portapipe.memory.accounting.SavedActivations` counts (the rotary tables count once per
  block while any micro-batch of it is held, as the accounting's storage de-duplication does);
  recompute's replays count while they last;
- ``held``: ``saved`` plus what only an allocator sees: part outputs and exchange buffers the
  tape keeps until the backward, posted receive buffers, every tensor sent (the executor keeps
  them until the step ends), deferred weight gradients between B and W (an estimate).

The step's peak is the larger of the walk's peak and what is left at its end plus the gradient
reductions' flat copies and the optimizer's temporaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..scheduling.ir import Kind, Schedule
from .programs import Programs, StageSpec, interleave, stage_specs
from .shape import Shape, block_params, layer_buffer_bytes, wqueue_bytes
from .time_model import _block_count


@dataclass
class RankMemory:
    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    buffers: float = 0.0
    saved_peak: float = 0.0  # activations saved for backward (the accounting's figure)
    held_peak: float = 0.0  # everything the schedule keeps in flight, at its peak
    post: float = 0.0  # transient after the schedule (reductions, optimizer)
    microbatches_peak: int = 0  # most micro-batch chunks held at once

    @property
    def static(self) -> float:
        return self.params + self.grads + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.static + max(self.held_peak, self.post)

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "grads": self.grads, "optimizer": self.optimizer, "buffers": self.buffers,
            "saved_peak": self.saved_peak, "held_peak": self.held_peak, "post": self.post, "total": self.total,
            "microbatches_peak": self.microbatches_peak,
        }


@dataclass
class MemoryReport:
    ranks: list[RankMemory] = field(default_factory=list)

    @property
    def peak(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def worst_rank(self) -> int:
        return max(range(len(self.ranks)), key=lambda i: self.ranks[i].total)


def static_memory(setup: Any, schedule: Schedule, rank: int) -> RankMemory:
    """Parameters, gradients, AdamW state and buffers of pipeline rank ``rank``."""
    s = Shape.of(setup.model)
    mem = RankMemory()
    bal = getattr(setup, "balancer", None)
    slots = s.n_experts + (bal.redundant * setup.ep if bal is not None and bal.kind != "none" else 0)
    elements = tensors = 0
    for b in schedule.blocks_of(rank):
        c = _block_count(setup, s, b, schedule.n_blocks)
        elements += c.elements
        tensors += c.tensors
        from ..models.moe import layer_range

        first, last = layer_range(s.n_layers, schedule.n_blocks, b)
        mem.buffers += sum(layer_buffer_bytes(s, i, slots) for i in range(first, last))
    mem.params = mem.grads = float(elements * s.e)
    mem.optimizer = float(2 * elements * s.e + 4 * tensors)  # exp_avg, exp_avg_sq; a float32 step per tensor
    return mem


class _Walk:
    """Running totals of one rank's in-flight bytes."""

    def __init__(self) -> None:
        self.saved = self.held = 0.0
        self.saved_peak = self.held_peak = 0.0

    def add(self, saved: float, held: float) -> None:
        self.saved += saved
        self.held += held
        if self.saved > self.saved_peak:
            self.saved_peak = self.saved
        if self.saved + self.held > self.held_peak:
            self.held_peak = self.saved + self.held


class MemoryModel:
    """Peak memory per pipeline rank of ``setup`` running ``schedule`` (lowered)."""

    def __init__(self, setup: Any, schedule: Schedule, imbalance: float = 1.0) -> None:
        self.setup, self.schedule = setup, schedule
        self.shape = s = Shape.of(setup.model)
        self.tokens = setup.micro_batch_size * setup.model.seq_len
        self.rows = self.tokens * s.top_k * imbalance
        bal = getattr(setup, "balancer", None)
        slots = s.n_experts + bal.redundant * setup.ep if bal is not None and bal.kind != "none" else None
        self.programs = Programs(s, self.tokens, self.rows, slots)
        self.specs = stage_specs(setup, schedule)
        self.switching = setup.ep > 1 and setup.overlap
        self.act = float(self.tokens * s.hidden * s.e)  # one stage input / output / gradient
        self._wq: dict[StageSpec, float] = {}
        self._rope: dict[StageSpec, float] = {}

    def _wqueue(self, spec: StageSpec) -> float:
        if spec not in self._wq:
            ops = self.programs.weights(spec)
            self._wq[spec] = sum(wqueue_bytes(self.shape, op[1], self.tokens, op[3]) for op in ops)
        return self._wq[spec]

    def _rope_bytes(self, spec: StageSpec) -> float:
        if spec not in self._rope:
            kept = [o for o in spec.options if o != "recompute_full"]
            self._rope[spec] = float(len(kept) * self.shape.rope_bytes())
        return self._rope[spec]

    def rank(self, r: int) -> RankMemory:
        s, sched = self.shape, self.schedule
        mem = static_memory(self.setup, sched, r)
        walk = _Walk()
        inflight: dict[int, int] = {}  # model block -> micro-batches held
        kept_by_send: set[tuple[int, int]] = set()
        waiting_w: dict[tuple[int, int], float] = {}
        held_mbs = most = 0

        def ops_of(half: Any) -> list[tuple]:
            spec = self.specs[half.stage]
            if half.kind is Kind.F:
                return self.programs.forward(spec)
            return self.programs.backward(spec, "B" if half.kind is Kind.B else "BW")

        def begin(half: Any) -> None:
            nonlocal held_mbs, most
            spec, block = self.specs[half.stage], sched.stage_block[half.stage]
            if half.kind is Kind.F:
                if not sched.is_first(half.stage) and sched.stage_rank[sched.prev_stage(half.stage)] != r:
                    walk.add(0, -self.act)  # the received input becomes the stage's (saved) input
                if inflight.get(block, 0) == 0:
                    walk.add(self._rope_bytes(spec), 0)
                inflight[block] = inflight.get(block, 0) + 1
                held_mbs += 1
                most = max(most, held_mbs)

        def step(half: Any, op: tuple) -> None:
            if op[0] != "C":
                return
            if op[1] == "output":
                nxt = sched.next_stage(half.stage)
                if nxt is not None and sched.stage_rank[nxt] == r:
                    return  # handed to this rank's next stage, which saves it: counted there
                if op[5] < 0 and (half.stage, half.mb) in kept_by_send:
                    return  # the send list keeps the stage output until the step ends
            walk.add(op[4], op[5])

        def end(half: Any) -> None:
            nonlocal held_mbs
            spec, block = self.specs[half.stage], sched.stage_block[half.stage]
            if half.kind in (Kind.B, Kind.BW):
                if not sched.is_last(half.stage) and sched.stage_rank[sched.next_stage(half.stage)] != r:
                    walk.add(0, -self.act)  # the received output gradient is used up
                inflight[block] -= 1
                held_mbs -= 1
                if inflight[block] == 0:
                    walk.add(-self._rope_bytes(spec), 0)
                if half.kind is Kind.B:
                    waiting_w[(half.stage, half.mb)] = self._wqueue(spec)
                    walk.add(0, waiting_w[(half.stage, half.mb)])

        for a in sched.actions[r]:
            k = a.kind
            if k in (Kind.RECV_F, Kind.RECV_B):
                walk.add(0, self.act)
            elif k is Kind.SEND_F:
                kept_by_send.add((a.stage, a.mb))
            elif k is Kind.SEND_B:
                walk.add(0, self.act)  # the input gradient, kept by the send list until the step ends
            elif k is Kind.W:
                walk.add(0, -waiting_w.pop((a.stage, a.mb), 0.0))
            elif a.pair is not None:
                f, b = a.pair
                begin(f)
                begin(b)
                for prog, op in interleave(ops_of(f), ops_of(b), self.switching):
                    step(f if prog == 0 else b, op)
                end(f)
                end(b)
            else:
                begin(a)
                for op in ops_of(a):
                    step(a, op)
                end(a)
        mem.saved_peak, mem.held_peak = walk.saved_peak, walk.held_peak
        mem.microbatches_peak = most
        # after the schedule: flat gradient copies for the reductions (DualPipe: mine, theirs, sum)
        # and AdamW's foreach temporaries (about one parameter-sized buffer)
        c = [_block_count(self.setup, s, b, sched.n_blocks) for b in sched.blocks_of(r)]
        shared = sum(x.elements - x.expert_elements for x in c) * s.e
        experts = sum(x.expert_elements for x in c) * s.e
        swap = 3 * max((x.elements for x in c), default=0) * s.e if sched.name == "dualpipe" else 0
        mem.post = walk.saved + walk.held + max(swap, shared, experts) + mem.params
        return mem

    def report(self) -> MemoryReport:
        return MemoryReport([self.rank(r) for r in range(self.schedule.n_ranks)])


__all__ = ["MemoryModel", "MemoryReport", "RankMemory", "static_memory", "block_params"]
