"""Run one rank's lowered action list over stages that follow the stage contract.

:class:`PipelineExecutor` takes a schedule, this rank's stages (:mod:`.stage`: anything with
``named_parameters()``, ``program(tape, x, targets)`` and ``has_loss``), the backend and the
parallel groups; :meth:`~PipelineExecutor.step` runs one training step's actions in order:

- ``RECV_*`` / ``SEND_*`` are posted without blocking (consecutive ones in one
  ``batch_isend_irecv``); only the compute that consumes a received tensor waits for it.
  Shapes are declared, not exchanged: ``boundary(stage, input_shape)`` gives the shape and
  dtype of what stage ``stage`` sends forward for a micro-batch whose input has that shape
  (its gradient comes back alike), so a receive is posted before its sender has computed.
  gloo tags are unique per (direction, sending stage, micro-batch), so messages can never
  pair up wrongly.
- ``F`` runs the stage's forward program on a :class:`~portapipe.scheduling.overlap.Tape`;
  ``B`` its part-wise backward with weight gradients queued (:mod:`.wgrad`) for the matching
  ``W``; ``BW`` the backward with weight gradients at once; ``FB`` the two programs
  interleaved (:func:`~portapipe.scheduling.overlap.run_pair`) when ``overlap`` is on, else one
  after the other. A micro-batch's tape is dropped as soon as its backward ran.
- Gradient synchronisation: with a ``grad_sync`` (:class:`GradSync`, e.g. portapipe's gradient
  buckets) the executor only offers the seams: ``start()`` before the step,
  ``block_done(block)`` right after the action that ends a block's backward work of the step on
  this rank (its last ``B``, ``BW``, ``W`` or ``FB``, read from the action list), ``finish()``
  after the last action; what is launched there is the composer's business. Without one,
  after the list (:meth:`~PipelineExecutor.reduce_gradients`): DualPipe's two copies of each
  block sum their gradients; gradients of parameters not marked as experts are summed over the
  replica group (dp x ep), expert gradients (:func:`~.stage.is_expert`) over dp; each
  micro-batch's backward was seeded with 1 / (micro-batches x replicas), so ``.grad`` is the
  gradient of the global mean loss. Then the optional ``end_step`` hook does the model's own
  end-of-step work (portapipe's model: replica gradients of a balancer, router biases, expert
  loads; see :mod:`portapipe.compose`) and returns extra :class:`StepResult` fields.

The loss is reported exactly: per-micro-batch losses are gathered and summed in a fixed order
(replica, then micro-batch), the order :mod:`portapipe.verify`'s reference uses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..backends.base import Backend, ParallelGroups
from .exchange import A2AStats
from .ir import Action, Kind, Schedule
from .overlap import Program, Tape, run, run_pair
from .runnable import build_schedule, check_stages, make_schedule, placed
from .stage import Boundary, Stage, is_expert
from .wgrad import WeightGradQueue

# where callers have always found them
__all__ = ["GradSync", "PipelineExecutor", "StepResult", "build_schedule", "last_backward", "make_schedule", "mean_loss", "placed"]


@dataclass
class StepResult:
    """What one step reports. ``loss`` is the global mean over micro-batches and replicas.

    ``timings`` (seconds unless noted, this rank): ``step_s`` the whole step; ``compute_s`` time
    in compute actions less their waits for p2p receives; ``p2p_wait_s`` those waits;
    ``bubble_frac`` = 1 - compute_s / step_s (idle share); ``a2a_total_s`` expert all-to-all
    time from issue to completion, ``a2a_wait_s`` the part spent blocked on it,
    ``a2a_hidden_frac`` = 1 - wait / total; ``fb_a2a_*`` the same for the exchanges inside F&B
    pairs (the steady phase), ``edge_a2a_*`` for those of lone F, B and BW actions (warm-up,
    cool-down, and every action of 1F1B and ZB1P); on a step run with the executor's
    ``time_exchanges`` off the totals and hidden shares are None (only the waits were taken);
    ``peak_activations`` the most micro-batches whose activations were held at once. The
    expert fields come from the model's ``end_step`` hook (None / empty without one):
    ``expert_counts[i, e]``: rows routed to logical expert e of MoE layer ``expert_layers[i]``
    this step, summed over the EP group (and DualPipe's two copies).
    """

    loss: float
    tokens: int
    timings: dict[str, float | None]
    expert_counts: torch.Tensor | None = None
    #: global layer index of each row of ``expert_counts``
    expert_layers: list[int] = field(default_factory=list)
    #: per replica (dp x ep order) per micro-batch losses, identical on every rank
    losses: list[list[float]] = field(default_factory=list)


def _tag(direction: int, stage: int, mb: int, n_stages: int, n_mb: int) -> int:
    return (direction * n_stages + stage) * n_mb + mb


class GradSync(Protocol):
    """What the executor tells a step's gradient synchronisation (see the module docstring).
    ``exposed_s``: time ``finish`` took (the synchronisation left exposed after the last action);
    ``sync_s``: from the first reduction issued to the last one done."""

    exposed_s: float
    sync_s: float

    def start(self) -> None: ...

    def block_done(self, block: int) -> None: ...

    def finish(self) -> None: ...


def last_backward(actions: list[Action], stage_block: list[int]) -> dict[int, list[int]]:
    """Index of the action after which each block's backward work on a rank is done -> blocks."""
    last: dict[int, int] = {}
    for i, a in enumerate(actions):
        part = a.pair[1] if a.kind is Kind.FB else a
        if part.kind in (Kind.B, Kind.BW, Kind.W):
            last[stage_block[part.stage]] = i
    out: dict[int, list[int]] = {}
    for block, i in sorted(last.items()):
        out.setdefault(i, []).append(block)
    return out


#: the model's end-of-step work: gets the executor after its gradient reduction, returns extra
#: StepResult fields (e.g. ``expert_counts``, ``expert_layers``)
EndStep = Callable[["PipelineExecutor"], Mapping[str, Any]]


class PipelineExecutor:
    """One rank of a pp x dp x ep job: its stages, its actions, and :meth:`step`.

    ``stages`` maps each model block this rank's schedule places here to its stage (already on
    the backend's device). ``exchange_stats``: where the stages' exchanges record their time
    (reported in the timings); ``end_step``: see :data:`EndStep`; ``grad_sync``: see
    :class:`GradSync` (None: the blocking reduction after the list). ``grad_scale`` multiplies
    every backward's seed (a loss scale). ``time_exchanges`` (an attribute a caller may flip
    between steps): take each exchange's completion time, for the all-to-all totals and hidden
    shares of the step's timings; off, a step saves a callback per exchange on the
    communication thread and reports only the time blocked on exchanges.
    """

    def __init__(
        self,
        schedule: Schedule,
        stages: Mapping[int, Stage],
        backend: Backend,
        groups: ParallelGroups,
        *,
        boundary: Boundary,
        overlap: bool = True,
        exchange_stats: A2AStats | None = None,
        end_step: EndStep | None = None,
        grad_sync: GradSync | None = None,
        time_exchanges: bool = True,
    ) -> None:
        self.backend, self.groups = backend, groups
        self.schedule = s = placed(schedule, groups)
        self.blocks: dict[int, Stage] = {b: stages[b] for b in sorted(stages)}
        check_stages(s, groups.pp_rank, self.blocks)
        self.boundary = boundary
        self.overlap = overlap
        self.exchange_stats = A2AStats() if exchange_stats is None else exchange_stats
        self.end_step = end_step
        self.grad_sync = grad_sync
        self.time_exchanges = time_exchanges
        self.grad_scale = 1.0
        self.device = backend.device()
        self.actions: list[Action] = s.actions[groups.pp_rank]
        # DualPipe: the other pipeline rank holding the same block (its gradients are summed).
        self.copy_rank: dict[int, int] = {}
        for b in self.blocks:
            holders = sorted({s.stage_rank[v] for v in range(s.n_stages) if s.stage_block[v] == b})
            others = [r for r in holders if r != groups.pp_rank]
            if len(others) > 1:
                raise ValueError(f"block {b} is held by ranks {holders}; at most two copies are supported")
            if others:
                self.copy_rank[b] = others[0]
        self.fb_stats = A2AStats()
        self._copy_calls: dict[int, int] = {}
        self.grads_final = last_backward(self.actions, s.stage_block)

    # ------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for b in self.blocks:
            yield from self.blocks[b].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # ------------------------------------------------------------------- step
    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Run this rank's actions for one step; ``.grad`` then holds the global mean loss's gradient."""
        s = self.schedule
        if len(microbatches) != s.n_microbatches:
            raise ValueError(f"step() got {len(microbatches)} micro-batches; schedule {s.name} runs {s.n_microbatches}")
        self._copy_calls.clear()  # copy-exchange tags restart every step
        if self.grad_sync is not None:
            self.grad_sync.start()
        else:
            for p in self.parameters():
                p.grad = None
        self.exchange_stats.reset()
        self.fb_stats.reset()
        self.exchange_stats.timed = self.time_exchanges
        run_ = _Step(self, microbatches)
        t0 = time.perf_counter()
        run_.execute()
        if self.grad_sync is not None:
            self.grad_sync.finish()
        else:
            self.reduce_gradients()
        losses = self._gather_losses(run_.losses)
        extra = dict(self.end_step(self)) if self.end_step is not None else {}
        step_s = time.perf_counter() - t0
        tokens = sum(int(t.numel()) for _, t in microbatches) * len(losses)
        timings = {
            "step_s": step_s,
            "compute_s": run_.compute_s,
            "p2p_wait_s": run_.p2p_wait_s,
            "bubble_frac": max(0.0, 1.0 - run_.compute_s / step_s) if step_s > 0 else 0.0,
            **a2a_timings(self.exchange_stats, self.fb_stats),
            "peak_activations": float(run_.peak_activations),
            "grad_sync_exposed_s": self.grad_sync.exposed_s if self.grad_sync is not None else 0.0,
            "grad_sync_s": self.grad_sync.sync_s if self.grad_sync is not None else 0.0,
        }
        return StepResult(loss=mean_loss(losses), tokens=tokens, timings=timings, losses=losses, **extra)

    # ---------------------------------------------------------- reductions
    def reduce_gradients(self) -> None:
        """DualPipe copies' sum, then replicated gradients over dp x ep and expert ones over dp.

        Collective over the pipeline copies and the replica groups; every trainable parameter
        ends with a ``.grad`` (zeros where no micro-batch reached it). Frozen parameters
        (``requires_grad`` False) keep ``.grad`` None, so an optimizer leaves them alone (a zero
        gradient would still let AdamW's weight decay move them).
        """
        g = self.groups
        params = [p for p in self.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # DualPipe: both copies of a block end with the sum of their gradients (a+b == b+a
        # exactly, so the copies stay bitwise identical).
        for b in self.copy_rank:
            grads = [p.grad for _, p in self.blocks[b].named_parameters() if p.requires_grad]
            _unflatten(self.sum_over_copies(b, _flatten(grads)), grads)
        shared = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        if g.dp * g.ep > 1 and shared:
            self._all_reduce_grads(shared, g.replica_group)
        if g.dp > 1 and experts:
            self._all_reduce_grads(experts, g.dp_group)

    def _all_reduce_grads(self, params: list[nn.Parameter], group: Any) -> None:
        flat = _flatten([p.grad for p in params])
        self.backend.all_reduce(flat, group=group)
        _unflatten(flat, [p.grad for p in params])

    def sum_over_copies(self, block: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` plus the same-shaped one of the other rank holding ``block`` (DualPipe), or
        ``tensor`` itself when this rank holds the only copy. Both ranks call it in the same order."""
        peer = self.copy_rank.get(block)
        if peer is None:
            return tensor
        s = self.schedule
        n = self._copy_calls.get(block, 0)
        self._copy_calls[block] = n + 1
        tag = 2 * s.n_stages * s.n_microbatches + n * s.n_blocks + block  # above every activation tag
        other = torch.empty_like(tensor)
        dst = self.groups.global_rank(peer)
        ops = [dist.P2POp(dist.isend, tensor, dst, tag=tag), dist.P2POp(dist.irecv, other, dst, tag=tag)]
        for work in self.backend.batch_isend_irecv(ops):
            work.wait()
        return tensor + other

    def _gather_losses(self, local: dict[int, torch.Tensor]) -> list[list[float]]:
        """Every (replica, micro-batch) loss, on every rank, exactly as computed."""
        g = self.groups
        m = self.schedule.n_microbatches
        # float64 where the backend reduces it; elsewhere float32 holds a float32 model's losses
        # exactly, and the other pipeline ranks add zeros
        dtype = getattr(torch, self.backend.capabilities.widest_reduce_dtype)
        vec = torch.zeros(m, dtype=dtype, device=self.device)
        for mb, loss in local.items():
            vec[mb] = loss.to(dtype)
        if g.pp > 1:  # one pipeline rank holds each micro-batch's loss; the others add zeros
            self.backend.all_reduce(vec, group=g.pp_group)
        replicas = g.dp * g.ep
        if replicas == 1:
            return [vec.tolist()]
        out = [torch.empty_like(vec) for _ in range(replicas)]
        self.backend.all_gather(out, vec, group=g.replica_group)
        return [t.tolist() for t in out]

def a2a_timings(step: A2AStats, fb: A2AStats) -> dict[str, float | None]:
    """The step's all-to-all fields: whole step, F&B pairs (``fb_``), the rest (``edge_``).
    Totals and hidden shares are None when the step's exchanges were not timed."""
    edge = A2AStats(step.total_s - fb.total_s, step.wait_s - fb.wait_s)
    out: dict[str, float | None] = {}
    for prefix, st in (("", step), ("fb_", fb), ("edge_", edge)):
        out[f"{prefix}a2a_total_s"] = st.total_s if step.timed else None
        out[f"{prefix}a2a_wait_s"] = st.wait_s
        out[f"{prefix}a2a_hidden_frac"] = st.hidden_frac if step.timed else None
    return out


def mean_loss(losses: list[list[float]]) -> float:
    """Mean of per-(replica, micro-batch) losses, summed in one fixed order (exact to reproduce)."""
    total = 0.0
    for row in losses:
        for x in row:
            total += x
    return total / (len(losses) * len(losses[0]))


def _flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.zeros(0)


def _unflatten(flat: torch.Tensor, into: list[torch.Tensor]) -> None:
    i = 0
    for t in into:
        n = t.numel()
        t.copy_(flat[i : i + n].view_as(t))
        i += n


class _Step:
    """The state of one step on one rank: posted receives, saved tapes, queued weight gradients."""

    def __init__(self, rt: PipelineExecutor, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rt = rt
        self.s = rt.schedule
        self.mbs = [(x.to(rt.device), y.to(rt.device)) for x, y in microbatches]
        self.scale = rt.grad_scale / (self.s.n_microbatches * rt.groups.dp * rt.groups.ep)
        self.recvs: dict[tuple[Kind, int, int], tuple[Any, torch.Tensor]] = {}
        self.local: dict[tuple[Kind, int, int], torch.Tensor] = {}  # same-rank hand-offs
        self.outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}  # waiting for their SEND
        self.sends: list[tuple[Any, torch.Tensor]] = []
        self.tapes: dict[tuple[int, int], tuple[Tape, torch.Tensor]] = {}
        self.queues: dict[tuple[int, int], WeightGradQueue] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.compute_s = 0.0
        self.p2p_wait_s = 0.0
        self.peak_activations = 0  # micro-batches whose activations were alive at once

    # ------------------------------------------------------------------ loop
    def execute(self) -> None:
        acts = self.rt.actions
        i = 0
        while i < len(acts):
            if acts[i].kind.is_comm:
                j = i
                while j < len(acts) and acts[j].kind.is_comm:
                    j += 1
                self._post(acts[i:j])
                i = j
                continue
            self._compute(acts[i])
            sync = self.rt.grad_sync
            if sync is not None:
                for block in self.rt.grads_final.get(i, ()):
                    sync.block_done(block)
            i += 1
        for work, _ in self.sends:
            work.wait()
        left = [f"{v}F{m} (no backward ran)" for v, m in self.tapes] + [f"{v}W{m}" for v, m in self.queues]
        if left or self.outbox or self.recvs or self.local:
            raise RuntimeError(
                f"schedule {self.s.name}, rank {self.rt.groups.pp_rank}: the step ended with work left over: "
                f"{left + [str(k) for k in list(self.outbox) + list(self.recvs) + list(self.local)]}"
            )

    def _compute(self, a: Action) -> None:
        t0 = time.perf_counter()
        wait0 = self.p2p_wait_s
        if a.kind is Kind.FB:
            f, b = a.pair
            st = self.rt.exchange_stats
            total0, wait_0 = st.total_s, st.wait_s
            if self.rt.overlap:
                run_pair(self._forward(f), self._backward(b))
            else:
                run(self._forward(f))
                run(self._backward(b))
            # the steady phase's share; the rest of the step's exchanges are the edges' (lone actions)
            self.rt.fb_stats.total_s += st.total_s - total0
            self.rt.fb_stats.wait_s += st.wait_s - wait_0
        elif a.kind is Kind.F:
            run(self._forward(a))
        elif a.kind in (Kind.B, Kind.BW):
            run(self._backward(a))
        elif a.kind is Kind.W:
            queue = self.queues.pop((a.stage, a.mb), None)
            if queue is None:
                raise RuntimeError(f"{a}: no input-gradient backward {a.stage}B{a.mb} ran before it")
            queue.run()
        else:
            raise ValueError(f"cannot run action {a}")
        self.compute_s += time.perf_counter() - t0 - (self.p2p_wait_s - wait0)

    # ------------------------------------------------------------- programs
    def _forward(self, a: Action) -> Program:
        s, v, m = self.s, a.stage, a.mb
        block = self.rt.blocks[s.stage_block[v]]
        inputs, targets = self.mbs[m]
        first = s.is_first(v)
        x = inputs if first else self._take(Kind.RECV_F, v, m)
        tape = Tape(input_grad=not first)
        out = yield from block.program(tape, x, targets if s.is_last(v) else None)
        self.tapes[(v, m)] = (tape, out)
        self.peak_activations = max(self.peak_activations, len(self.tapes))
        if s.is_last(v):
            self.losses[m] = out.detach()
            return
        nxt = s.next_stage(v)
        if s.stage_rank[nxt] == s.stage_rank[v]:
            self.local[(Kind.RECV_F, nxt, m)] = out.detach()
        else:
            self.outbox[(Kind.SEND_F, v, m)] = out.detach()

    def _backward(self, a: Action) -> Program:
        s, v, m = self.s, a.stage, a.mb
        if (v, m) not in self.tapes:
            raise RuntimeError(f"{a}: its forward {v}F{m} has not run on this rank")
        tape, out = self.tapes.pop((v, m))
        if s.is_last(v):
            grad = torch.full_like(out, self.scale)
        else:
            grad = self._take(Kind.RECV_B, v, m)
        queue = None
        if a.kind is Kind.B:
            queue = self.queues[(v, m)] = WeightGradQueue()
        grad_in = yield from tape.backward(out, grad, queue)
        if s.is_first(v):
            return
        if grad_in is None:
            raise RuntimeError(
                f"{a}: stage {v} gives no gradient for its input; its program must pass a floating-point input through tape.watch(x)"
            )
        prv = s.prev_stage(v)
        if s.stage_rank[prv] == s.stage_rank[v]:
            self.local[(Kind.RECV_B, prv, m)] = grad_in
        else:
            self.outbox[(Kind.SEND_B, v, m)] = grad_in

    # ------------------------------------------------------------------ p2p
    def _buffer(self, sender: int, m: int) -> torch.Tensor:
        """An empty tensor for what stage ``sender`` sends forward for micro-batch m (or its gradient)."""
        shape, dtype = self.rt.boundary(sender, self.mbs[m][0].shape)
        return torch.empty(shape, dtype=dtype, device=self.rt.device)

    def _peer(self, stage: int) -> int:
        return self.rt.groups.global_rank(self.s.stage_rank[stage])

    def _post(self, actions: list[Action]) -> None:
        s = self.s
        ops: list[dist.P2POp] = []
        keys: list[tuple[str, Any]] = []
        for a in actions:
            v, m = a.stage, a.mb
            if a.kind is Kind.RECV_F:
                src = s.prev_stage(v)
                buf = self._buffer(src, m)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(src), tag=_tag(0, src, m, s.n_stages, s.n_microbatches)))
                keys.append(("recv", (a.kind, v, m), buf))
            elif a.kind is Kind.RECV_B:
                src = s.next_stage(v)
                buf = self._buffer(v, m)  # the gradient of what stage v sent forward
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(src), tag=_tag(1, src, m, s.n_stages, s.n_microbatches)))
                keys.append(("recv", (a.kind, v, m), buf))
            else:
                tensor = self.outbox.pop((a.kind, v, m), None)
                if tensor is None:
                    raise RuntimeError(f"{a}: nothing to send; the compute producing it has not run on this rank")
                if a.kind is Kind.SEND_F:
                    dst, direction = s.next_stage(v), 0
                else:
                    dst, direction = s.prev_stage(v), 1
                tensor = tensor.contiguous()
                ops.append(dist.P2POp(dist.isend, tensor, self._peer(dst), tag=_tag(direction, v, m, s.n_stages, s.n_microbatches)))
                keys.append(("send", None, tensor))
        works = self.rt.backend.batch_isend_irecv(ops)
        for (what, key, tensor), work in zip(keys, works):
            if what == "recv":
                self.recvs[key] = (work, tensor)
            else:
                self.sends.append((work, tensor))

    def _take(self, kind: Kind, v: int, m: int) -> torch.Tensor:
        """Stage v's input (RECV_F) or output gradient (RECV_B) for micro-batch m: in memory or received."""
        key = (kind, v, m)
        if key in self.local:
            return self.local.pop(key)
        if key not in self.recvs:
            raise RuntimeError(f"{v}{kind.value}{m} was never posted before the compute that needs it")
        work, buf = self.recvs.pop(key)
        t0 = time.perf_counter()
        work.wait()
        self.p2p_wait_s += time.perf_counter() - t0
        return buf
