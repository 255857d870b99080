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
- :meth:`~PipelineExecutor.evaluate` runs the forwards alone (:func:`.schedules.forward_only`:
  each rank's forwards in the schedule's order), as plain calls without gradients: a validation
  loss costs no backward and keeps no activations.
- ``F`` runs the stage's forward program on a :class:`~portapipe.scheduling.overlap.Tape`;
  ``B`` its part-wise backward with weight gradients queued (:mod:`.wgrad`) for the matching
  ``W``; ``BW`` the backward with weight gradients at once; ``FB`` the two programs (an F&B
  pair, or an F&F pair: two micro-batches' forwards) interleaved
  (:func:`~portapipe.scheduling.overlap.run_pair`) when ``overlap`` is on, else one after the
  other. A micro-batch's tape is dropped as soon as its backward ran.
- Gradient synchronisation: a ``grad_sync`` (:class:`GradSync`: portapipe's gradient buckets,
  :class:`~portapipe.optim.buckets.GradBuckets`) owns the step's gradients; the executor only
  offers the seams: ``start()`` before the step, ``block_done(block)`` right after the action
  that ends a block's backward work of the step on this rank (its last ``B``, ``BW``, ``W`` or
  ``FB``, read from the action list), ``finish()`` after the last action; what is launched
  there is the composer's business (:mod:`portapipe.compose`, :mod:`portapipe.plain`): DualPipe's
  two copies of each block sum their gradients (:meth:`~PipelineExecutor.sum_over_copies`),
  shared gradients are summed over the replica group (dp x ep), expert gradients
  (:func:`~.stage.is_expert`) over dp; each micro-batch's backward was seeded with
  1 / (micro-batches x replicas), so the gradients are those of the global mean loss. Then the
  optional ``end_step`` hook does the model's own end-of-step work (portapipe's model: router
  biases, expert loads; see :mod:`portapipe.compose`) and returns extra :class:`StepResult` fields.

The loss is reported exactly: per-micro-batch losses are gathered and summed in a fixed order
(replica, then micro-batch), the order :mod:`portapipe.verify`'s reference uses. So are the loss
terms the stages record inside their programs (:meth:`~.overlap.Tape.loss`, seeded in their own
backward): the composer names them (``loss_terms``), each is gathered per micro-batch from
whichever rank produced it and reported as its mean (:attr:`StepResult.loss_terms`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..backends.base import Backend, ParallelGroups
from . import spans
from .exchange import A2AStats
from .ir import Action, Kind, Schedule
from .comms import lower_comms
from .runnable import build_schedule, check_stages, make_schedule, placed
from .schedules import forward_only
from .stage import Boundary, Stage, shared_blocks
from .step_run import StepRun
from .wgrad import early_weight_grads

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
    pairs (the steady phase), ``edge_a2a_*`` for the rest: lone F, B and BW actions (warm-up,
    cool-down, and every action of 1F1B and ZB1P) and F&F pairs (``schedule.pair_forwards``);
    ``counts_a2a_*`` the same for the small exchanges of row counts that precede the rows'
    (a router's, given as the executor's ``counts_stats``; zeros and None without them);
    ``a2a_bytes`` the bytes this rank's expert exchanges sent to the other ranks; on a
    step run with the executor's ``time_exchanges`` off the totals and hidden shares are None (only the waits were taken);
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
    #: each loss term the stages recorded (the executor's ``loss_terms``), mean over micro-batches
    #: and replicas summed in the order of ``loss``
    loss_terms: dict[str, float] = field(default_factory=dict)


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
    :class:`GradSync` (it may be set after construction, since it sums DualPipe's copies through
    :meth:`sum_over_copies`; :meth:`step` refuses to run without one). ``counts_stats``: where the
    stages' exchanges of row counts record their time, reported apart from the rows' (portapipe's
    routing: :attr:`~portapipe.models.expert_parallel.ExpertParallel.counts_stats`).
    ``grad_scale`` multiplies every backward's seed (a loss scale). ``loss_terms``: the names of
    every loss term any stage of the model records (:meth:`~.overlap.Tape.loss`), the same list on
    every rank, reported in :attr:`StepResult.loss_terms`. ``time_exchanges`` (an attribute a caller may flip
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
        counts_stats: A2AStats | None = None,
        loss_terms: Sequence[str] = (),
    ) -> None:
        self.backend, self.groups = backend, groups
        self.loss_terms = list(loss_terms)
        self.schedule = s = placed(schedule, groups)
        self.blocks: dict[int, Stage] = {b: stages[b] for b in sorted(stages)}
        check_stages(s, groups.pp_rank, self.blocks)
        self.boundary = boundary
        self.overlap = overlap
        self.exchange_stats = A2AStats() if exchange_stats is None else exchange_stats
        self.counts_stats = A2AStats() if counts_stats is None else counts_stats
        self.end_step = end_step
        self.grad_sync = grad_sync
        self.time_exchanges = time_exchanges
        self.grad_scale = 1.0
        #: called at the start of each compute action with the tapes of that action's backwards and
        #: then of the rank's next compute action's: what they read may come back meanwhile
        #: (activation offload, :mod:`portapipe.memory.offload`); None: nothing to fetch
        self.prefetch: Callable[[list[Any]], None] | None = None
        self.device = backend.device()
        self.actions: list[Action] = s.actions[groups.pp_rank]
        # The pipeline ranks holding each block (two for DualPipe's blocks).
        self.block_ranks: dict[int, tuple[int, ...]] = {}
        for v in range(s.n_stages):
            self.block_ranks[s.stage_block[v]] = tuple(sorted({*self.block_ranks.get(s.stage_block[v], ()), s.stage_rank[v]}))
        # DualPipe: the other pipeline rank holding the same block (its gradients are summed).
        self.copy_rank: dict[int, int] = {}
        for b in self.blocks:
            holders = self.block_ranks[b]
            others = [r for r in holders if r != groups.pp_rank]
            if len(others) > 1:
                raise ValueError(f"block {b} is held by ranks {list(holders)}; at most two copies are supported")
            if others:
                self.copy_rank[b] = others[0]
        self.fb_stats = A2AStats()
        self._copy_calls: dict[int, int] = {}
        self.grads_final = last_backward(self.actions, s.stage_block)
        self.early_weight_grads = early_weight_grads(self.actions, s.stage_block)
        self._eval_actions: list[Action] | None = None

    @property
    def eval_actions(self) -> list[Action]:
        """This rank's forwards alone, with their sends and receives (made on first use)."""
        if self._eval_actions is None:
            self._eval_actions = lower_comms(forward_only(self.schedule)).actions[self.groups.pp_rank]
        return self._eval_actions

    # ------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for b in self.blocks:
            yield from self.blocks[b].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # ------------------------------------------------------------------- step
    def step(self, microbatches: list[tuple[torch.Tensor, ...]]) -> StepResult:
        """Run this rank's actions for one step; ``.grad`` then holds the global mean loss's gradient."""
        s = self.schedule
        if len(microbatches) != s.n_microbatches:
            raise ValueError(f"step() got {len(microbatches)} micro-batches; schedule {s.name} runs {s.n_microbatches}")
        if self.grad_sync is None:
            raise RuntimeError(
                "PipelineExecutor.step needs a grad_sync to own and sum the step's gradients "
                "(portapipe.optim.buckets.GradBuckets, as portapipe.plain.Pipeline builds it)"
            )
        self._copy_calls.clear()  # copy-exchange tags restart every step
        self.grad_sync.start()
        for st in (self.exchange_stats, self.fb_stats, self.counts_stats):
            st.reset()
        self.exchange_stats.timed = self.counts_stats.timed = self.time_exchanges
        run_ = StepRun(self, microbatches)
        with spans.span(spans.COMPUTE, "step"):  # on a recorded step: the step, its actions, what follows them
            t0 = time.perf_counter()
            run_.execute()
            with spans.span(spans.COMPUTE, "grad sync"):
                self.grad_sync.finish()
            with spans.span(spans.COMPUTE, "step end"):  # the losses gathered, the model's end of step
                losses, terms = self._gather_losses(run_.losses, run_.terms)
                extra = dict(self.end_step(self)) if self.end_step is not None else {}
            step_s = time.perf_counter() - t0
        tokens = sum(int(mb[1].numel()) for mb in microbatches) * len(losses)
        timings = {
            "step_s": step_s,
            "compute_s": run_.compute_s,
            "p2p_wait_s": run_.p2p_wait_s,
            "bubble_frac": max(0.0, 1.0 - run_.compute_s / step_s) if step_s > 0 else 0.0,
            **a2a_timings(self.exchange_stats, self.fb_stats, self.counts_stats),
            "peak_activations": float(run_.peak_activations),
            "grad_sync_exposed_s": self.grad_sync.exposed_s,
            "grad_sync_s": self.grad_sync.sync_s,
        }
        return StepResult(loss=mean_loss(losses), tokens=tokens, timings=timings, losses=losses, loss_terms=terms, **extra)

    @torch.no_grad()
    def evaluate(self, microbatches: list[tuple[torch.Tensor, ...]]) -> StepResult:
        """The step's forwards alone: each (replica, micro-batch) loss and the loss terms, as
        :meth:`step` reports them, with no backward, no gradient and no end-of-step work (what
        a forward leaves in the stages, such as a router's counts, stays: see the composer's
        ``unchanged``). ``timings`` holds ``step_s`` only."""
        s = self.schedule
        if len(microbatches) != s.n_microbatches:
            raise ValueError(f"evaluate() got {len(microbatches)} micro-batches; schedule {s.name} runs {s.n_microbatches}")
        run_ = StepRun(self, microbatches, forward_only=True)
        t0 = time.perf_counter()
        run_.execute()
        losses, terms = self._gather_losses(run_.losses, run_.terms)
        tokens = sum(int(mb[1].numel()) for mb in microbatches) * len(losses)
        return StepResult(loss=mean_loss(losses), tokens=tokens, timings={"step_s": time.perf_counter() - t0}, losses=losses, loss_terms=terms)

    # ------------------------------------------------------------ copies
    def copy_holders(self, block: int, param: torch.Tensor | None = None) -> tuple[tuple[int, int], ...]:
        """Every copy of one logical weight as ``(pipeline rank, block)``, sorted: of ``param``
        (a parameter of ``block``) or, without one, of ``block``'s own parameters. A block's
        parameters have a copy on each rank holding the block (DualPipe: two); a shared weight
        (:func:`~.stage.mark_shared`) has one on each rank holding each of its blocks, or one on
        each rank holding them all when they are :meth:`held_together`."""
        blocks = (shared_blocks(param) if param is not None else ()) or (block,)
        if self.held_together(blocks):  # one tensor on each rank holding them: the first block's stands for it
            blocks = (min(blocks),)
        return tuple(sorted((r, b) for b in blocks for r in self.block_ranks[b]))

    def held_together(self, blocks: Sequence[int]) -> bool:
        """Whether every rank holding one of ``blocks`` holds all of them (DualPipe and DualPipeV
        hold the first and the last block on the same ranks): a weight those blocks share is then
        one tensor per rank (:func:`~portapipe.models.moe.tie_copies`), not a copy per block."""
        return len(blocks) > 1 and len({self.block_ranks[b] for b in blocks}) == 1

    def sum_copies(self, holders: Sequence[tuple[int, int]], local: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The sum of every copy's same-shaped tensor (``local``: this rank's, by block), added in
        the order of ``holders`` on every rank, so each copy gets the same sum bit for bit.
        Collective with the other ranks in ``holders``, which call it in the same order."""
        copies = self._gather_copies(holders, local)
        total = copies[0]
        for t in copies[1:]:
            total = total + t
        return total

    def sum_over_copies(self, block: int, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over the copies of ``block`` (DualPipe's two), or ``tensor`` itself
        when this rank holds the only copy (see :meth:`sum_copies`)."""
        holders = self.copy_holders(block)
        return tensor if len(holders) == 1 else self.sum_copies(holders, {block: tensor})

    @torch.no_grad()
    def check_copies(self) -> None:
        """Every copy of every weight that several blocks share equals the others bit for bit
        (collective); ValueError naming the first that differs (copies start equal and stay so: a
        difference is a load or an update gone wrong). DualPipe's copies of a block are built and
        loaded alike and are not compared."""
        for holders, by_block in self.copy_groups():
            if len({b for _, b in holders}) == 1:
                continue
            for i, (name, _) in enumerate(next(iter(by_block.values()))):
                copies = self._gather_copies(holders, {b: params[i][1].detach() for b, params in by_block.items()})
                if any(not torch.equal(copies[0], t) for t in copies[1:]):
                    raise ValueError(f"the copies of {name} held by (pipeline rank, block) {list(holders)} differ")

    def copy_groups(self) -> list[tuple[tuple[tuple[int, int], ...], dict[int, list[tuple[str, torch.Tensor]]]]]:
        """This rank's parameters that have copies, by their holders (sorted: one order on every
        rank), then by block, in the block's order."""
        by: dict[tuple[tuple[int, int], ...], dict[int, list[tuple[str, torch.Tensor]]]] = {}
        for b, stage in self.blocks.items():
            for name, p in stage.named_parameters():
                holders = self.copy_holders(b, p)
                if len(holders) > 1:
                    by.setdefault(holders, {}).setdefault(b, []).append((name, p))
        return sorted(by.items())

    def _gather_copies(self, holders: Sequence[tuple[int, int]], local: Mapping[int, torch.Tensor]) -> list[torch.Tensor]:
        """Every copy's tensor in the order of ``holders``: this rank's from ``local`` (by block),
        the others' received (one exchange per other rank holding copies)."""
        me = self.groups.pp_rank
        mine = [c for r, c in holders if r == me]
        if sorted(mine) != sorted(local):
            raise ValueError(f"copies of blocks {sorted(local)} given where this rank holds blocks {mine} of {list(holders)}")
        peers = sorted({r for r, _ in holders if r != me})
        got: dict[tuple[int, int], torch.Tensor] = {(me, c): local[c] for c in mine}
        if peers:
            s = self.schedule
            blocks = sorted({c for _, c in holders})
            key = blocks[0] * s.n_blocks + blocks[-1]
            n = self._copy_calls.get(key, 0)
            self._copy_calls[key] = n + 1
            tag = 2 * s.n_stages * s.n_microbatches + n * s.n_blocks**2 + key  # above every activation tag
            sent = torch.stack([local[c].contiguous() for c in mine])
            ops, bufs = [], {}
            for peer in peers:
                theirs = [c for r, c in holders if r == peer]
                bufs[peer] = (theirs, torch.empty((len(theirs), *sent.shape[1:]), dtype=sent.dtype, device=sent.device))
                dst = self.groups.global_rank(peer)
                ops += [dist.P2POp(dist.isend, sent, dst, tag=tag), dist.P2POp(dist.irecv, bufs[peer][1], dst, tag=tag)]
            for work in self.backend.batch_isend_irecv(ops):
                work.wait()
            for peer, (theirs, buf) in bufs.items():
                got.update({(peer, c): buf[i] for i, c in enumerate(theirs)})
        return [got[h] for h in holders]

    def _gather_losses(
        self, local: dict[int, torch.Tensor], terms: Mapping[int, Mapping[str, torch.Tensor]]
    ) -> tuple[list[list[float]], dict[str, float]]:
        """Every (replica, micro-batch) loss, on every rank, exactly as computed; and each loss
        term's mean over them (its per-micro-batch values gathered alike)."""
        g = self.groups
        m = self.schedule.n_microbatches
        names = self.loss_terms
        column = {name: i + 1 for i, name in enumerate(names)}
        # float64 where the backend reduces it; elsewhere float32 holds a float32 model's losses
        # exactly, and the other pipeline ranks add zeros
        dtype = getattr(torch, self.backend.capabilities.widest_reduce_dtype)
        table = torch.zeros(m, 1 + len(names), dtype=dtype, device=self.device)
        for mb, loss in local.items():
            table[mb, 0] = loss.to(dtype)
        for mb, recorded in terms.items():
            for name, value in recorded.items():
                if name not in column:
                    raise RuntimeError(f"a stage recorded the loss term {name!r}, which the executor's loss_terms do not name")
                table[mb, column[name]] = value.to(dtype)
        if g.pp > 1:  # one pipeline rank holds each micro-batch's loss (and term); the others add zeros
            self.backend.all_reduce(table, group=g.pp_group)
        replicas = g.dp * g.ep
        if replicas == 1:
            every = [table]
        else:
            every = [torch.empty_like(table) for _ in range(replicas)]
            self.backend.all_gather(every, table, group=g.replica_group)
        cols = [t.t().tolist() for t in every]  # per replica: [column][micro-batch]
        return [c[0] for c in cols], {name: mean_loss([c[i] for c in cols]) for name, i in column.items()}


def a2a_timings(step: A2AStats, fb: A2AStats, counts: A2AStats) -> dict[str, float | None]:
    """The step's all-to-all fields: whole step, F&B pairs (``fb_``), the rest (``edge_``), and
    the exchanges of row counts (``counts_``, not in the others). Totals and hidden shares are
    None when the step's exchanges were not timed."""
    edge = A2AStats(step.total_s - fb.total_s, step.wait_s - fb.wait_s)
    out: dict[str, float | None] = {}
    for prefix, st in (("", step), ("fb_", fb), ("edge_", edge), ("counts_", counts)):
        out[f"{prefix}a2a_total_s"] = st.total_s if step.timed else None
        out[f"{prefix}a2a_wait_s"] = st.wait_s
        out[f"{prefix}a2a_hidden_frac"] = st.hidden_frac if step.timed else None
    out["a2a_bytes"] = float(step.sent_bytes)
    return out


def mean_loss(losses: list[list[float]]) -> float:
    """Mean of per-(replica, micro-batch) losses, summed in one fixed order (exact to reproduce)."""
    total = 0.0
    for row in losses:
        for x in row:
            total += x
    return total / (len(losses) * len(losses[0]))
