"""Activation recompute whose all-to-alls run beside other compute.

A recomputed segment runs its forward keeping nothing for backward (the parts run without
autograd, only the segment's inputs stay); its backward first replays the forward, recording
it on a fresh :class:`~portapipe.scheduling.overlap.Tape`, then runs that tape's part-wise
backward. The replay needs no gradient, so it is the step's ``prepare``
(:class:`~portapipe.scheduling.overlap.Custom`): the stage's backward runs it ahead, while the
layer above's dispatch gradient travels and nothing else could run, the same way a lone
action hides any exchange behind its own independent work. Both the replay and the backward are programs: each expert all-to-all of the replay
(dispatch, combine) and of the backward is issued asynchronously and yielded to the driver, so
inside an F&B the other micro-batch's parts compute while it is in flight, exactly as in a
forward that was never dropped. Nothing blocks on a recomputed layer's communication unless
there is nothing else to run.

Segments:

- ``full``: a whole layer, from its input;
- ``moe``: an MoE layer's dispatch -> shared expert -> experts -> combine -> local rows'
  experts -> combine parts,
  from the attention part's outputs (the attention part is kept; the rows to send are
  gathered again from the normed tokens).

A replay has no side effects on the layer's state: buffers the forward updates (the per-step
expert loads) are restored after each replayed part, so loads are counted once. Loss terms the
segment records (:meth:`~portapipe.scheduling.overlap.Tape.loss`, a router's balance loss) are
reported once, by the forward, and seeded by the replay, whose backward is where they get their
gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from ..models.expert_parallel import ExpertParallel, with_weights
from ..scheduling.exchange import Label, Pending, Wire, encoded
from ..scheduling.overlap import Custom, Program, Tape
from ..tensors.storage import free_storage
from ..scheduling.wgrad import WeightGradQueue
from .zero_memory import dispatch_rows

MODES = ("none", "moe", "full")


class _Forward(Tape):
    """Runs a program without keeping anything for backward; exchanges stay asynchronous. Its
    loss terms are reported on ``parent`` (the stage's tape); the replay seeds them."""

    def __init__(self, parent: Tape) -> None:
        super().__init__(record=True)
        self.terms = parent.terms

    def watch(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def part(self, fn: Any, *args: Any, plain: bool = False) -> Any:
        with torch.no_grad():
            return fn(*args)

    def all_to_all(self, ep: ExpertParallel, x: torch.Tensor, out_splits: list[int], in_splits: list[int], wire: Wire | None = None,
                   label: Label | None = None) -> Pending:
        return encoded(ep, x, out_splits, in_splits, wire, label=label)[0]


class _Replay(Tape):
    """A recording tape whose parts leave the module's buffers as they found them. Its loss terms
    are seeded as the stage's (``loss_seed``), not reported again."""

    replay = True

    def __init__(self, module: torch.nn.Module, loss_seed: float) -> None:
        super().__init__(record=True, loss_seed=loss_seed)
        self._buffers = list(module.buffers())

    def _report(self, name: str, value: torch.Tensor) -> None:
        pass

    def labelled(self, label: Label | None) -> Label | None:
        return None if label is None else (f"{label[0]} replay", label[1])

    def part(self, fn: Any, *args: Any, plain: bool = False) -> Any:
        before = [b.clone() for b in self._buffers]
        try:
            return super().part(fn, *args, plain=plain)
        finally:
            with torch.no_grad():
                for b, old in zip(self._buffers, before):
                    if not torch.equal(b, old):  # untouched ones keep their version (autograd saved them)
                        b.copy_(old)


class _Capture(torch.autograd.Function):
    """Identity on several tensors whose backward hands their gradients to ``sink``."""

    @staticmethod
    def forward(ctx: Any, sink: list[torch.Tensor | None], *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.sink = sink
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        ctx.sink[:] = list(grads)
        ctx.sink = None
        return (None, *grads)


class Recompute:
    """One layer's recompute setting: ``mode`` is ``moe`` or ``full``.

    Exchange timings go to the layer's ``ExpertParallel.stats`` like those of any forward.
    """

    def __init__(self, mode: str) -> None:
        if mode not in ("moe", "full"):
            raise ValueError(f"recompute mode {mode!r} is not one of moe, full")
        self.mode = mode

    def segment(
        self,
        tape: Tape,
        layer: torch.nn.Module,
        run: Any,
        inputs: list[torch.Tensor],
        values: Callable[[], list[torch.Tensor]] | None = None,
    ) -> Generator[Any, None, torch.Tensor]:
        """Program: ``run(tape, *inputs)`` (a layer program) without keeping its activations.

        ``run`` must be a program function of the layer returning one tensor; ``inputs`` are the
        tensors (from earlier parts) it reads, which receive its gradients. ``values`` gives
        their values for the replay (default: the inputs, kept), for inputs cheaper to rebuild
        than to keep. Records one step whose backward replays the segment.
        """
        out = yield from run(_Forward(tape), *inputs)
        out = out.detach().requires_grad_(True)
        if values is None:
            kept = [x.detach() for x in inputs]

            def values() -> list[torch.Tensor]:
                return kept

        replayed: list[Any] = []  # (tape, its output, the inputs' gradient sink) once replayed

        def prepare() -> Program:
            """The replay: needs no gradient, so the tape may run it while a later exchange travels."""
            replay = _Replay(layer, tape.loss_seed)
            sink: list[torch.Tensor | None] = []
            leaves = [x.detach().requires_grad_(x.is_floating_point()) for x in values()]
            xs = replay.part(lambda *a: _Capture.apply(sink, *a), *leaves)
            again = yield from run(replay, *xs)
            replayed.append((replay, again, sink))

        def backward(grads: list[torch.Tensor | None], queue: WeightGradQueue | None) -> Program:
            (grad,) = grads
            if grad is None:  # still replay: the EP peers take part in its exchanges
                grad = torch.zeros_like(out)
            if not replayed:
                yield from prepare()
            replay, again, sink = replayed.pop()
            yield from replay.backward(again, grad, queue)
            return sink + [None] * (len(inputs) - len(sink))

        tape.custom(Custom(inputs=list(inputs), outputs=[out], backward=backward, prepare=prepare))
        return out

    # ----------------------------------------------------------------- layers
    def full(self, tape: Tape, layer: Any, x: torch.Tensor, positions: torch.Tensor | None = None) -> Generator[Any, None, torch.Tensor]:
        """Program: the whole layer recomputed in backward (``positions``: as the layer's)."""

        def run(t: Tape, x_: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
            return (yield from layer.program(t, x_, positions))

        return (yield from self.segment(tape, layer, run, [x]))

    def moe(
        self, tape: Tape, layer: Any, h: torch.Tensor, hn: torch.Tensor, send: torch.Tensor, local: torch.Tensor,
        local_weights: torch.Tensor, plan: Any,
    ) -> Generator[Any, None, torch.Tensor]:
        """Program: an MoE layer's parts after attention, recomputed in backward.

        The rows to send and the local rows are not kept: the replay gathers them again from
        the normed tokens (kept by the attention part), and their gradients go back through
        ``send`` and ``local`` as usual. The router weights in dispatch order (one number per
        row: the sent rows' last column, and the local rows') are kept.
        """

        def run(t: Tape, *xs: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
            return (yield from layer.moe_program(t, *xs, plan))

        weights = send.detach()[:, -1].clone()  # the sent rows' router weights (the rows go)

        def values() -> list[torch.Tensor]:
            sent, kept = slice(None, plan.n_remote), slice(plan.n_remote, None)
            rows = [dispatch_rows(hn.detach(), plan, layer.top_k, part) for part in (sent, kept)]
            return [h.detach(), hn.detach(), with_weights(rows[0], weights), rows[1], local_weights.detach()]

        out = yield from self.segment(tape, layer, run, [h, hn, send, local, local_weights], values)
        free_storage(send)  # the replay gathers both again
        free_storage(local)
        return out
