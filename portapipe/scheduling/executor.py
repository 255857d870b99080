"""Run one rank's lowered action list: p2p between stages, F / B / W / BW / F&B on the model.

:class:`PipelineRuntime` builds this rank's model blocks and schedule; :meth:`~PipelineRuntime.step`
runs one training step's actions in order:

- ``RECV_*`` / ``SEND_*`` are posted without blocking (consecutive ones in one
  ``batch_isend_irecv``); only the compute that consumes a received tensor waits for it.
  Shapes are derived, not registered: every activation and activation gradient of a micro-batch
  is ``[batch, seq, hidden]`` of that micro-batch's token tensor. gloo tags are unique per
  (direction, sending stage, micro-batch), so messages can never pair up wrongly.
- ``F`` runs the stage's forward program on a :class:`~portapipe.scheduling.overlap.Tape`;
  ``B`` its part-wise backward with the linear layers' weight gradients queued for the
  matching ``W``; ``BW`` the backward with weight gradients at once; ``FB`` the two programs
  interleaved (:func:`~portapipe.scheduling.overlap.run_pair`) when ``schedule.overlap`` is on,
  else one after the other. A micro-batch's tape is dropped as soon as its backward ran.
- After the list: DualPipe's two copies of each block sum their gradients; non-expert
  gradients are summed over the replica group (dp x ep), routed-expert gradients over dp;
  each micro-batch's backward was seeded with 1 / (micro-batches x replicas), so ``.grad`` is
  the gradient of the global mean loss. The router biases take one aux-loss-free step on the
  global expert loads.

The loss is reported exactly: per-micro-batch losses are gathered and summed in a fixed order
(replica, then micro-batch), the order :mod:`portapipe.verify`'s reference uses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..backends.base import Backend, ParallelGroups
from ..config import Config, ConfigError
from ..models.expert_parallel import A2AStats, ExpertParallel
from ..models.linear import WeightGradQueue
from ..memory.policy import configure as configure_memory
from ..models.moe import DTYPES, Block, build_blocks, is_expert_param
from . import comms, schedules, validate
from .ir import Action, Kind, Schedule
from .overlap import Program, Tape, run, run_pair


@dataclass
class StepResult:
    """What one step reports. ``loss`` is the global mean over micro-batches and replicas.

    ``timings`` (seconds unless noted, this rank): ``step_s`` the whole step; ``compute_s`` time
    in compute actions less their waits for p2p receives; ``p2p_wait_s`` those waits;
    ``bubble_frac`` = 1 - compute_s / step_s (idle share); ``a2a_total_s`` expert all-to-all
    time from issue to completion, ``a2a_wait_s`` the part spent blocked on it,
    ``a2a_hidden_frac`` = 1 - wait / total; ``fb_a2a_*`` the same for the exchanges inside F&B
    pairs (the steady phase); ``peak_activations`` the most micro-batches whose activations
    were held at once. ``expert_counts[i, e]``: rows routed to logical expert e of MoE layer
    ``expert_layers[i]`` this step, summed over the EP group (and DualPipe's two copies).
    """

    loss: float
    tokens: int
    timings: dict[str, float]
    expert_counts: torch.Tensor | None
    #: global layer index of each row of ``expert_counts``
    expert_layers: list[int] = field(default_factory=list)
    #: per replica (dp x ep order) per micro-batch losses, identical on every rank
    losses: list[list[float]] = field(default_factory=list)


def build_schedule(config: Config) -> Schedule:
    """The lowered schedule a config asks for; ConfigError (before any rank starts) if it cannot run."""
    s, p = config.schedule, config.parallel
    try:
        schedule = schedules.build(s.name, p.pp, s.microbatches, s.chunks)
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"schedule: {s.name} with pp={p.pp}, microbatches={s.microbatches}: {exc}"]) from None
    if not s.w_split:
        schedule = schedules.without_w_split(schedule)
    schedule = comms.lower_comms(schedule)
    problems = [f"schedule: {s.name} (pp={p.pp}, microbatches={s.microbatches}): {line}" for line in validate.problems(schedule)]
    n_blocks = config.n_blocks()
    if schedule.n_blocks != n_blocks:
        problems.append(f"schedule: {s.name} places {schedule.n_blocks} model blocks but the config expects {n_blocks}")
    if config.model.n_layers < schedule.n_blocks:
        problems.append(
            f"model.n_layers: {config.model.n_layers} layers cannot be cut into the {schedule.n_blocks} blocks of {s.name} with pp={p.pp}"
        )
    if schedule.n_ranks != p.pp:
        problems.append(f"schedule: {s.name} runs on {schedule.n_ranks} ranks but parallel.pp = {p.pp}")
    if problems:
        raise ConfigError(problems)
    return schedule


def _tag(direction: int, stage: int, mb: int, n_stages: int, n_mb: int) -> int:
    return (direction * n_stages + stage) * n_mb + mb


class PipelineRuntime:
    """One rank of a pp x dp x ep job: its model blocks, its actions, and :meth:`step`."""

    def __init__(self, config: Config, backend: Backend, groups: ParallelGroups, schedule: Schedule | None = None) -> None:
        self.config, self.backend, self.groups = config, backend, groups
        self.schedule = comms.lower_comms(schedule) if schedule is not None else build_schedule(config)
        s = self.schedule
        if s.n_ranks != groups.pp:
            raise ValueError(f"schedule {s.name} has {s.n_ranks} ranks but the pipeline group has {groups.pp}")
        self.dtype = DTYPES[config.model.dtype]
        self.overlap = config.schedule.overlap
        self.ep = ExpertParallel(backend, groups.ep, groups.ep_rank, groups.ep_group)
        if config.balancer.kind != "none":  # EPLB / LPLB: expert slots, routing, replica gradients
            from ..balancing.runtime import ExpertBalancer, moe_layer_indices

            layers = moe_layer_indices(config.model, s.blocks_of(groups.pp_rank), s.n_blocks)
            self.ep.balancer = ExpertBalancer(config, backend, groups, layers)
        self.device = backend.device()
        self.blocks: dict[int, Block] = build_blocks(
            config.model, s.blocks_of(groups.pp_rank), s.n_blocks, self.ep, config.train.seed
        )
        configure_memory(self.blocks, config.memory)  # zero-memory / recompute per layer
        for block in self.blocks.values():
            block.to(self.device)
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
        if self.ep.balancer is not None:
            self.ep.balancer.attach(self.moe_layers())

    # ------------------------------------------------------------- parameters
    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for b in sorted(self.blocks):
            yield from self.blocks[b].named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    def moe_layers(self) -> list[Any]:
        layers = [layer for b in sorted(self.blocks) for layer in self.blocks[b].moe_layers()]
        return sorted(layers, key=lambda layer: layer.index)

    # ------------------------------------------------------------------- step
    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        """Run this rank's actions for one step; ``.grad`` then holds the global mean loss's gradient."""
        s = self.schedule
        if len(microbatches) != s.n_microbatches:
            raise ValueError(f"step() got {len(microbatches)} micro-batches; schedule {s.name} runs {s.n_microbatches}")
        for p in self.parameters():
            p.grad = None
        self.ep.stats.reset()
        self.fb_stats.reset()
        run_ = _Step(self, microbatches)
        t0 = time.perf_counter()
        run_.execute()
        self._reduce_gradients()
        if self.ep.balancer is not None:  # replicated experts: sum over their replicas
            self.ep.balancer.reduce_gradients()
        losses = self._gather_losses(run_.losses)
        counts, layers = self._update_routing()
        step_s = time.perf_counter() - t0
        tokens = sum(int(t.numel()) for _, t in microbatches) * len(losses)
        st, fb = self.ep.stats, self.fb_stats
        timings = {
            "step_s": step_s,
            "compute_s": run_.compute_s,
            "p2p_wait_s": run_.p2p_wait_s,
            "bubble_frac": max(0.0, 1.0 - run_.compute_s / step_s) if step_s > 0 else 0.0,
            "a2a_total_s": st.total_s,
            "a2a_wait_s": st.wait_s,
            "a2a_hidden_frac": st.hidden_frac,
            "fb_a2a_total_s": fb.total_s,
            "fb_a2a_wait_s": fb.wait_s,
            "fb_a2a_hidden_frac": fb.hidden_frac,
            "peak_activations": float(run_.peak_activations),
        }
        return StepResult(loss=mean_loss(losses), tokens=tokens, timings=timings, expert_counts=counts, expert_layers=layers, losses=losses)

    # ---------------------------------------------------------- reductions
    def _block_params(self, b: int) -> list[nn.Parameter]:
        return list(self.blocks[b].parameters())

    def _reduce_gradients(self) -> None:
        g = self.groups
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        # DualPipe: both copies of a block end with the sum of their gradients (a+b == b+a
        # exactly, so the copies stay bitwise identical).
        if self.copy_rank:
            for b in sorted(self.blocks):
                if b not in self.copy_rank:
                    continue
                params = self._block_params(b)
                mine = _flatten([p.grad for p in params])
                theirs = self._swap(mine, self.copy_rank[b], tag=self._swap_tag(0, b))
                _unflatten(mine + theirs, [p.grad for p in params])
        shared = [p for p in self.parameters() if not is_expert_param(p)]
        experts = [p for p in self.parameters() if is_expert_param(p)]
        if g.dp * g.ep > 1 and shared:
            self._all_reduce_grads(shared, g.replica_group)
        if g.dp > 1 and experts:
            self._all_reduce_grads(experts, g.dp_group)

    def _all_reduce_grads(self, params: list[nn.Parameter], group: Any) -> None:
        flat = _flatten([p.grad for p in params])
        self.backend.all_reduce(flat, group=group)
        _unflatten(flat, [p.grad for p in params])

    def _swap_tag(self, what: int, block: int) -> int:
        """Tags above every activation / gradient tag of the step."""
        s = self.schedule
        return 2 * s.n_stages * s.n_microbatches + what * s.n_blocks + block

    def _swap(self, tensor: torch.Tensor, pp_peer: int, tag: int) -> torch.Tensor:
        """Exchange ``tensor`` with the same-shaped one of pipeline rank ``pp_peer``."""
        peer = self.groups.global_rank(pp_peer)
        other = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, peer, tag=tag), dist.P2POp(dist.irecv, other, peer, tag=tag)]
        for work in self.backend.batch_isend_irecv(ops):
            work.wait()
        return other

    def _gather_losses(self, local: dict[int, torch.Tensor]) -> list[list[float]]:
        """Every (replica, micro-batch) loss, on every rank, exactly as computed."""
        g = self.groups
        m = self.schedule.n_microbatches
        vec = torch.zeros(m, dtype=torch.float64, device=self.device)
        for mb, loss in local.items():
            vec[mb] = loss.to(torch.float64)
        if g.pp > 1:  # one pipeline rank holds each micro-batch's loss; the others add zeros
            self.backend.all_reduce(vec, group=g.pp_group)
        replicas = g.dp * g.ep
        if replicas == 1:
            return [vec.tolist()]
        out = [torch.empty_like(vec) for _ in range(replicas)]
        self.backend.all_gather(out, vec, group=g.replica_group)
        return [t.tolist() for t in out]

    def _update_routing(self) -> tuple[torch.Tensor | None, list[int]]:
        """Sum this step's expert loads (DualPipe copies, EP, DP) and step every router's bias."""
        g = self.groups
        by_block: dict[int, list[Any]] = {b: self.blocks[b].moe_layers() for b in sorted(self.blocks)}
        if not any(by_block.values()):
            return None, []
        for b, layers in by_block.items():
            if b in self.copy_rank and layers:
                mine = torch.stack([layer.moe.step_counts for layer in layers])
                theirs = self._swap(mine, self.copy_rank[b], tag=self._swap_tag(1, b))
                for layer, row in zip(layers, mine + theirs):
                    layer.moe.step_counts.copy_(row)
        layers = self.moe_layers()
        counts = torch.stack([layer.moe.step_counts for layer in layers])
        if g.ep > 1:
            self.backend.all_reduce(counts, group=g.ep_group)
        ep_counts = counts.clone()
        if g.dp > 1:
            self.backend.all_reduce(counts, group=g.dp_group)
        for layer, row in zip(layers, counts):
            layer.moe.router.update_bias(row)
            layer.moe.step_counts.zero_()
        return ep_counts, [layer.index for layer in layers]


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

    def __init__(self, rt: PipelineRuntime, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.rt = rt
        self.s = rt.schedule
        self.mbs = [(x.to(rt.device), y.to(rt.device)) for x, y in microbatches]
        self.scale = 1.0 / (self.s.n_microbatches * rt.groups.dp * rt.groups.ep)
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
            if self.rt.overlap:
                st = self.rt.ep.stats
                total0, wait_0 = st.total_s, st.wait_s
                fprog, bprog = self._forward(f), self._backward(b)
                run_pair(fprog, bprog)
                self.rt.fb_stats.total_s += st.total_s - total0
                self.rt.fb_stats.wait_s += st.wait_s - wait_0
            else:
                run(self._forward(f))
                run(self._backward(b))
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
        x = inputs if s.is_first(v) else self._take(Kind.RECV_F, v, m)
        tape = Tape()
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
        prv = s.prev_stage(v)
        if s.stage_rank[prv] == s.stage_rank[v]:
            self.local[(Kind.RECV_B, prv, m)] = grad_in
        else:
            self.outbox[(Kind.SEND_B, v, m)] = grad_in

    # ------------------------------------------------------------------ p2p
    def _shape(self, m: int) -> tuple[int, ...]:
        return tuple(self.mbs[m][0].shape) + (self.rt.config.model.hidden,)

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
                buf = torch.empty(self._shape(m), dtype=self.rt.dtype, device=self.rt.device)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(src), tag=_tag(0, src, m, s.n_stages, s.n_microbatches)))
                keys.append(("recv", (a.kind, v, m), buf))
            elif a.kind is Kind.RECV_B:
                src = s.next_stage(v)
                buf = torch.empty(self._shape(m), dtype=self.rt.dtype, device=self.rt.device)
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
