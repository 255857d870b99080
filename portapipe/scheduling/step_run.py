"""One step of one rank's action list (:class:`StepRun`, driven by
:meth:`~portapipe.scheduling.executor.PipelineExecutor.step`): posted receives and sends,
the forward and backward programs of each action, saved tapes and queued weight gradients.
An evaluation (:meth:`~portapipe.scheduling.executor.PipelineExecutor.evaluate`) runs the
forwards alone, each as plain calls that record nothing for a backward."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from . import spans
from .ir import Action, Kind
from .overlap import Program, Tape, run, run_pair
from .wgrad import WeightGradQueue


def _tag(direction: int, stage: int, mb: int, n_stages: int, n_mb: int) -> int:
    """gloo tag of an activation or gradient message: unique per (direction, sending stage, micro-batch)."""
    return (direction * n_stages + stage) * n_mb + mb


class StepRun:
    """The state of one step on one rank: posted receives, saved tapes, queued weight gradients.

    ``rt``: the rank's :class:`~portapipe.scheduling.executor.PipelineExecutor` (not imported:
    the executor imports this module). ``forward_only``: run ``rt.eval_actions`` (forwards
    alone, :func:`~.schedules.forward_only`) on tapes that record nothing; call it without
    gradients (``torch.no_grad``)."""

    def __init__(self, rt: Any, microbatches: list[tuple[torch.Tensor, ...]], forward_only: bool = False) -> None:
        self.rt = rt
        self.s = rt.schedule
        self.forward_only = forward_only
        self.actions: list[Action] = rt.eval_actions if forward_only else rt.actions
        self.mbs = [tuple(t.to(rt.device) for t in mb) for mb in microbatches]
        self.scale = rt.grad_scale / (self.s.n_microbatches * rt.groups.dp * rt.groups.ep)
        self.recvs: dict[tuple[Kind, int, int], tuple[Any, torch.Tensor]] = {}
        self.local: dict[tuple[Kind, int, int], torch.Tensor] = {}  # same-rank hand-offs
        self.outbox: dict[tuple[Kind, int, int], torch.Tensor] = {}  # waiting for their SEND
        self.sends: list[tuple[Any, torch.Tensor]] = []
        # a recorded step: the spans of the sends (by their work's id) and of the receives not seen complete
        self.sent: dict[int, Any] = {}
        self.posted: dict[tuple[Kind, int, int], Any] = {}
        self.tapes: dict[tuple[int, int], tuple[Tape, torch.Tensor]] = {}
        self.queues: dict[tuple[int, int], WeightGradQueue] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.terms: dict[int, dict[str, torch.Tensor]] = {}  # micro-batch -> the stages' loss terms (Tape.loss)
        self.compute_s = 0.0
        self.p2p_wait_s = 0.0
        self.peak_activations = 0  # micro-batches whose activations were alive at once

    # ------------------------------------------------------------------ loop
    def execute(self) -> None:
        acts = self.actions
        i = 0
        while i < len(acts):
            if acts[i].kind.is_comm:
                j = i
                while j < len(acts) and acts[j].kind.is_comm:
                    j += 1
                self._post(acts[i:j])
                i = j
                continue
            if self.rt.prefetch is not None and not self.forward_only:
                self.rt.prefetch(self._backward_tapes(acts[i]) + self._backward_tapes(self._next_compute(acts, i)))
            self._compute(acts[i])
            self._release_sent()
            if self.posted:
                self._seen_received()
            sync = None if self.forward_only else self.rt.grad_sync
            if sync is not None:
                for block in self.rt.grads_final.get(i, ()):
                    sync.block_done(block)
            i += 1
        for work, _ in self.sends:
            work.wait()
            spans.end(self.sent.pop(id(work), None))
        left = [f"{v}F{m} (no backward ran)" for v, m in self.tapes] + [f"{v}W{m}" for v, m in self.queues]
        if left or self.outbox or self.recvs or self.local:
            raise RuntimeError(
                f"schedule {self.s.name}, rank {self.rt.groups.pp_rank}: the step ended with work left over: "
                f"{left + [str(k) for k in list(self.outbox) + list(self.recvs) + list(self.local)]}"
            )

    @staticmethod
    def _next_compute(acts: list[Action], i: int) -> Action | None:
        """The compute action after ``acts[i]`` (past the posts between them: a handful)."""
        return next((acts[j] for j in range(i + 1, len(acts)) if acts[j].kind.is_compute), None)

    def _backward_tapes(self, a: Action | None) -> list[Tape]:
        """The tapes whose backward ``a`` runs (those whose forward has run)."""
        if a is None:
            return []
        return [self.tapes[(h.stage, h.mb)][0] for h in a.halves() if h.kind in (Kind.B, Kind.BW) and (h.stage, h.mb) in self.tapes]

    def _release_sent(self) -> None:
        """Let go of the sends that have completed: a stage's input gradient is held by nothing
        else, and kept to the step's end, DualPipe's hundreds of them would hold gigabytes. A
        work that cannot say whether it completed is kept until the step's end, as before."""
        kept = []
        for work, t in self.sends:
            if _completed(work):
                work.wait()  # returns at once; raises what the send raised
                if self.sent:
                    spans.end(self.sent.pop(id(work), None))
            else:
                kept.append((work, t))
        self.sends = kept

    def _seen_received(self) -> None:
        """A recorded step: the receives that have completed since the last look end there (the
        wait of the compute that takes one ends it otherwise)."""
        for key in [k for k in self.posted if _completed(self.recvs[k][0])]:
            spans.end(self.posted.pop(key))

    def _compute(self, a: Action) -> None:
        with spans.span(spans.COMPUTE, a):
            self._run(a)

    def _run(self, a: Action) -> None:
        t0 = time.perf_counter()
        wait0 = self.p2p_wait_s
        if a.kind is Kind.FB:
            f, second = a.pair
            st = self.rt.exchange_stats
            total0, wait_0 = st.total_s, st.wait_s
            # on a recorded step each half's program says when it runs (its exchanges carry its micro-batch)
            other = spans.following(self._forward(second) if second.kind is Kind.F else self._backward(second), second)
            forward = spans.following(self._forward(f), f)
            if self.rt.overlap:
                run_pair(forward, other)
            else:
                run(forward)
                run(other)
            if a.fb_pair:
                # the steady phase's share; the rest of the step's exchanges (lone actions and
                # the warm-up's F&F pairs) are the edges'
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
        inputs, targets, *positions = self.mbs[m]
        first = s.is_first(v)
        x = inputs if first else self._take(Kind.RECV_F, v, m)
        # an evaluation's tape records nothing: the stage runs as plain calls
        tape = Tape(record=not self.forward_only, input_grad=not first, loss_seed=self.scale)
        # the documents in the micro-batch, for every stage: each rank has the whole batch, so they are not sent
        given = {"positions": positions[0]} if positions else {}
        out = yield from block.program(tape, x, targets if s.is_last(v) else None, **given)
        if tape.terms:
            self.terms.setdefault(m, {}).update(tape.terms)
        if not self.forward_only:
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
            queue = self.queues[(v, m)] = WeightGradQueue(fill_waits=(v, m) in self.rt.early_weight_grads)
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
        # a recorded step: each transfer is a span from its post to its completion
        tokens = [spans.begin(spans.P2P, a) for a in actions] if spans.RECORDER.get() is not None else [None] * len(actions)
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
        for (what, key, tensor), work, token in zip(keys, works, tokens):
            if token is not None:
                spans.issued(token, work)
            if what == "recv":
                self.recvs[key] = (work, tensor)
                if token is not None:
                    self.posted[key] = token
            else:
                self.sends.append((work, tensor))
                if token is not None:
                    self.sent[id(work)] = token

    def _take(self, kind: Kind, v: int, m: int) -> torch.Tensor:
        """Stage v's input (RECV_F) or output gradient (RECV_B) for micro-batch m: in memory or received."""
        key = (kind, v, m)
        if key in self.local:
            return self.local.pop(key)
        if key not in self.recvs:
            raise RuntimeError(f"{v}{kind.value}{m} was never posted before the compute that needs it")
        work, buf = self.recvs.pop(key)
        t0 = time.perf_counter()
        with spans.waiting(self.posted.pop(key, None)):
            work.wait()
        self.p2p_wait_s += time.perf_counter() - t0
        return buf


def _completed(work: Any) -> bool:
    """Whether a point-to-point work has completed (False when it cannot tell)."""
    done = getattr(work, "is_completed", None)
    return bool(done()) if done is not None else False
