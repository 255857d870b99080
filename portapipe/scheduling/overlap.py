"""Part-by-part forward and backward, and the F&B overlap built on it.

A stage's forward is a *program*: a generator that calls the model's parts (attention,
dispatch, experts, combine, ...) through a :class:`Tape` and yields each expert all-to-all
right after issuing it. The tape cuts the autograd graph at every part boundary (each part
runs on detached leaves) and remembers the parts in order, so the backward can be driven
part by part too: :meth:`Tape.backward` is a program of the same kind that runs the parts'
backwards as their data allow, issuing each reverse all-to-all asynchronously as soon as its
gradient is complete and running the parts that do not need its result while it travels.

Both kinds of program run through the same drivers:

- :func:`run` drives one program to completion (a lone F, B or BW). It hides an exchange
  behind the program's own work: in the forward the parts placed between its issue and its
  first use (the shared expert behind the dispatch), in the backward the independent parts, a
  full backward's set-aside weight gradients, recompute's replays and zero-memory's
  re-dispatch started ahead (:meth:`Tape.ahead`, :attr:`Custom.prepare`).
- :func:`run_pair` runs a forward and a backward program of two micro-batches alternately,
  switching whenever one has an all-to-all in flight, so the other's compute hides it
  (MindSpeed / DualPipe's F&B overlap): ATTN(F) beside COMBINE(B), MLP(B) beside DISPATCH(F),
  and so on. :func:`interleaved` is the same as a program (the tape pairs a recomputed layer's
  backward with the next one's replay with it).

Exchanges are issued on the backend's communication stream after it has waited for the
compute stream (working no-ops on CPU, where gloo's async work handles carry the overlap),
so device backends overlap on streams with no change here.

With ``Tape(record=False)`` parts are plain calls and exchanges are blocking autograd
functions: the whole stage is one ordinary autograd graph (used as the reference).

Loss terms produced inside a stage (:meth:`Tape.loss`: an auxiliary loss such as a router's
balance loss, or a prediction loss computed beside the main one) seed the stage's own backward:
the tape adds ``loss_seed x weight`` as the term's gradient when its backward starts, exactly as
the executor seeds a last stage's loss, so the term's gradient never travels to the last stage
and every step of the backward (W split, F&B overlap, a recomputed segment's replay) treats it
like any other gradient. The executor only collects the terms' values (:attr:`Tape.terms`) for
reporting; what a term means is the stage's business.

Weight gradients under a W split (a B action passes a :class:`~.wgrad.WeightGradQueue`): a part
recorded with ``tape.part(fn, *args)`` runs its backward with the queue active, so layers that
defer themselves (:func:`~.wgrad.defer_weight_grad`) queue their weight gradients; a part
recorded with ``tape.part(fn, *args, plain=True)`` is ordinary torch code and is split by
autograd (:func:`~.wgrad.split_backward`).

Profiling (``portapipe profile``) times every part's forward and backward through an
observer installed with :func:`observing`; without one, parts run exactly as above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .drive import Done, Program, discard_second, interleaved, run, run_pair  # run, run_pair, Program: re-exported
from .exchange import AllToAll, ExchangeGroup, Label, Pending, Wire, encoded, encoded_grad
from .observe import NO_NOTE, OBSERVER, PART_TAPE, PartNote, observing  # observing: re-exported
from .wgrad import WeightGradQueue, deferring, split_backward

__all__ = ["Custom", "Done", "Program", "Tape", "interleaved", "observing", "run", "run_pair"]


@dataclass
class _Part:
    leaves: list[tuple[torch.Tensor, torch.Tensor]]  # (detached leaf the part saw, tensor it came from)
    outputs: list[torch.Tensor]
    plain: bool = False  # ordinary torch code: a W split goes through split_backward
    note: PartNote | None = None  # an observer's, when one watched the forward


@dataclass
class _Exchange:
    group: ExchangeGroup
    source: torch.Tensor
    output: torch.Tensor  # the received rows, or their stand-in when they travelled encoded
    out_splits: list[int]
    in_splits: list[int]
    wire: Wire | None = None
    label: Label | None = None


@dataclass
class Custom:
    """A step whose backward is a program of its own (activation recompute replays a segment).

    ``backward(grads, queue)`` gets the gradients of ``outputs`` (None where none arrived) and
    returns those of ``inputs``; it may yield exchanges like any program.

    ``prepare`` (optional): the part of that work that needs no gradient (recompute's replay of
    the forward), as a program. The tape's backward may run it early, while a later step's
    exchange travels and nothing else could run; ``backward`` then finds it done.
    """

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    backward: Callable[[list[torch.Tensor | None], WeightGradQueue | None], Program]
    prepare: Callable[[], Program] | None = None


def _tensors(x: Any) -> list[torch.Tensor]:
    items = x if isinstance(x, (tuple, list)) else (x,)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class Tape:
    """Records one micro-batch's forward through a stage, part by part, for a part-wise backward."""

    replay = False  # a recompute's replay of a forward that already ran (which counts its work once)

    def __init__(self, record: bool = True, input_grad: bool = True, loss_seed: float = 1.0) -> None:
        self.record = record
        self.input_grad = input_grad  # False: the stage input's gradient is not wanted (a first stage)
        #: the gradient a loss term of weight 1 starts the backward with (the executor's seed of the
        #: main loss: 1 / (micro-batches x replicas), times a loss scale)
        self.loss_seed = loss_seed
        #: the loss terms recorded by the forward (:meth:`loss`), by name, detached: what is reported
        self.terms: dict[str, torch.Tensor] = {}
        self._seeds: list[tuple[torch.Tensor, float]] = []  # (term, weight) whose gradient the backward seeds
        self._steps: list[_Part | _Exchange | Custom] = []
        self._grads: dict[int, tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]] = {}  # id -> (tensor, (step, term)s)
        self._input: torch.Tensor | None = None
        self._ahead: list[tuple[int, Callable[[], None]]] = []  # (steps recorded before it, work)
        # ids of the tensors whose gradient the backward routes: the watched input and the
        # outputs of parts and exchanges (alive while recorded, held by the steps)
        self._known: set[int] = set()

    # ------------------------------------------------------------------ forward
    def watch(self, x: torch.Tensor) -> torch.Tensor:
        """Mark the stage input whose gradient the backward returns."""
        if self.record and self.input_grad and x.is_floating_point():
            x = x.detach().requires_grad_(True)
            self._input = x
            self._known.add(id(x))
        return x

    def part(self, fn: Callable[..., Any], *args: Any, plain: bool = False) -> Any:
        """Run ``fn(*args)`` as one part; tensor arguments that carry gradients become leaves.

        ``plain``: ``fn`` is ordinary torch code whose weight gradients autograd splits off
        under a W split (see the module docstring).
        """
        if not self.record:
            return fn(*args)
        leaves: list[tuple[torch.Tensor, torch.Tensor]] = []
        call_args = list(args)
        for i, a in enumerate(args):
            # a weight (Parameter) is used as it is: its gradient accumulates as a captured one's would
            # (type() first: Parameter's isinstance check runs Python code)
            if isinstance(a, torch.Tensor) and a.requires_grad and (type(a) is torch.Tensor or not isinstance(a, torch.nn.Parameter)):
                self._check_known(a, "tape.part({!s}) argument {}", getattr(fn, "__name__", fn), i)
                leaf = a.detach().requires_grad_(True)
                leaves.append((leaf, a))
                call_args[i] = leaf
        observer = OBSERVER.get()
        note = None
        running = PART_TAPE.set(self)
        try:
            if observer is None and torch.is_grad_enabled():  # the usual case: no mode switch to make
                out = fn(*call_args)
            else:
                with torch.enable_grad():
                    if observer is None:
                        out = fn(*call_args)
                    else:
                        with observer.forward(fn, tuple(call_args)) as note:
                            out = fn(*call_args)
        finally:
            PART_TAPE.reset(running)
        outputs = _tensors(out)
        self._known.update(id(t) for t in outputs)
        self._steps.append(_Part(leaves, outputs, plain, note))
        return out

    def all_to_all(
        self, group: ExchangeGroup, x: torch.Tensor, out_splits: list[int], in_splits: list[int], wire: Wire | None = None,
        label: Label | None = None,
    ) -> Pending | Done:
        """Issue an exchange of ``x`` over ``group``; the caller yields the result, then ``wait()``s on it.

        ``wire``: the rows and / or their gradients travel encoded (:class:`~.exchange.Wire`);
        ``wait()`` then gives what the wire decodes, and rows that travelled encoded reach the
        receiver's parts through the stand-in the decoded value holds. ``label``: what the
        exchange is (``("dispatch", layer)``), for a recorded step; its reverse in the backward
        is named ``"<name> grad"``."""
        if not self.record:
            out = AllToAll.apply(x, group, list(out_splits), list(in_splits), wire)
            return Done(out[1] if isinstance(out, tuple) else out)
        if x.requires_grad:
            self._check_known(x, "tape.all_to_all rows")
        label = self.labelled(label)
        pending, rows = encoded(group, x, out_splits, in_splits, wire, label=label)
        output = pending.output if rows is None else rows
        output.requires_grad_(True)
        self._known.add(id(output))
        self._steps.append(_Exchange(group, x, output, list(out_splits), list(in_splits), wire, label))
        return pending

    def labelled(self, label: Label | None) -> Label | None:
        """The label this tape's exchanges carry (a replay's say so)."""
        return label

    def ahead(self, fn: Callable[[], None]) -> None:
        """Record gradient-free work the backward may start early: ``fn()`` (zero-memory's
        re-dispatch) is called while an exchange of a later step travels and nothing else
        could run, once the steps recorded after the previous such mark have begun their
        backward (so at most one layer ahead). ``fn`` must be idempotent: whoever needs its
        result may start it first."""
        if self.record:
            self._ahead.append((len(self._steps), fn))

    def loss(self, name: str, value: torch.Tensor, weight: float = 1.0) -> None:
        """Record a loss term produced in this stage: ``value`` (a scalar output of a part) enters
        the objective as ``weight x value``, so the backward starts it with the gradient
        ``weight x loss_seed``. ``name`` (unique per micro-batch over the whole model) reports it."""
        if value.dim() != 0:
            raise ValueError(f"loss term {name!r} must be a scalar, got shape {tuple(value.shape)}")
        if name in self.terms:
            raise ValueError(f"loss term {name!r} was recorded twice in one forward")
        self._report(name, value)
        if weight and value.requires_grad:
            if self.record:
                self._check_known(value, "loss term {!r}", name)
            self._seeds.append((value, float(weight)))

    def _report(self, name: str, value: torch.Tensor) -> None:
        self.terms[name] = value.detach()

    def plain_backward(self, output: torch.Tensor, grad: torch.Tensor) -> None:
        """The backward of a ``Tape(record=False)`` graph: ``output`` seeded with ``grad`` and
        every loss term with ``weight x loss_seed``, in one autograd call."""
        roots = [output, *(t for t, _ in self._seeds)]
        grads = [grad, *(torch.full_like(t, self.loss_seed * w) for t, w in self._seeds)]
        self._seeds = []
        torch.autograd.backward(roots, grads)

    def custom(self, step: Custom) -> None:
        """Record a step with its own backward program (see :class:`Custom`)."""
        self._known.update(id(t) for t in step.outputs)
        self._steps.append(step)

    def _check_known(self, t: torch.Tensor, what: str, *fields: Any) -> None:
        """A non-leaf tensor with a gradient the tape does not route: made by code between parts,
        whose gradient would be lost without a word. ``what``: a format string of ``fields``
        (formatted only when refusing: this runs for every part's every argument)."""
        if not t.is_leaf and id(t) not in self._known:
            raise ValueError(
                f"{what.format(*fields)} carries a gradient but is not the output of a part, an exchange or tape.watch: "
                "computations between parts are not recorded; do them inside a tape.part"
            )

    # ----------------------------------------------------------------- backward
    def _add_grad(self, t: torch.Tensor, g: torch.Tensor, order: int) -> None:
        """A gradient contribution to ``t`` from step ``order`` (its consumer)."""
        key = id(t)
        if key in self._grads:
            self._grads[key][1].append((order, g))
        else:
            self._grads[key] = (t, [(order, g)])

    def _pop_grad(self, t: torch.Tensor) -> torch.Tensor | None:
        """The sum of ``t``'s contributions, added from the latest consumer step to the earliest
        (the plain reverse walk's order), whatever order they arrived in: reordering the
        backward's independent steps changes no value."""
        item = self._grads.pop(id(t), None)
        if item is None:
            return None
        if len(item[1]) == 1:
            return item[1][0][1]
        terms = sorted(item[1], key=lambda c: -c[0])  # stable: a step's own terms keep their order
        total = terms[0][1]
        for _, g in terms[1:]:
            total = total + g
        return total

    def backward(self, output: torch.Tensor, grad: torch.Tensor, queue: WeightGradQueue | None = None) -> Program:
        """Program: backward of the recorded parts from ``output``'s gradient.

        Weight gradients go to ``queue`` when given (a B action), else are computed at once (BW).
        Returns the stage input's gradient: zeros when the output does not depend on it, None
        when the input was not watched (tokens).

        The steps run as their data allow (:class:`_Flow`): each reverse exchange is issued
        as soon as its gradient is complete, and while it travels the steps that do not need
        its result run. A custom step's gradient-free work (:attr:`Custom.prepare`: recompute's
        replay) runs ahead, one step at a time: beside the custom step above it (the two
        switch at every exchange in flight, as an F&B pair does), or when nothing else can run
        before waiting for the first exchange in flight; so does work recorded with
        :meth:`ahead` (zero-memory's re-dispatch), one mark at a time. Then, in a full
        backward (BW) of a tape with exchanges, the weight gradients that layers deferring
        themselves (:mod:`.wgrad`) set aside run, entry by entry, until the rows are there (the
        rest waits for the next wait, or the end); a B whose queue allows it
        (:attr:`~.wgrad.WeightGradQueue.fill_waits`) runs its queue's oldest entries the same
        way, leaving the rest to its W. Which exchanges are issued, and in which order, never
        depends on timing, so EP peers stay in step; values do not depend on the order at all.
        Each part's graph and boundaries are dropped as soon as its backward ran.
        """
        if not self.record:
            raise RuntimeError("a Tape(record=False) is one autograd graph: call backward() on its output")
        if output.requires_grad:
            self._check_known(output, "the stage's output")
        self._known.clear()  # ids stay valid only while the forward's steps hold the tensors
        steps, self._steps = self._steps, []
        has_exchanges = any(isinstance(s, _Exchange) for s in steps)
        # A full backward keeps its parts' deferrable W work aside in a queue of its own, run
        # while the rows travel and at the end; a B whose queue may fill its waits
        # (WeightGradQueue.fill_waits) runs that queue's oldest entries alike. Not while
        # profiling: an observer times each part's full backward as one.
        aside = WeightGradQueue() if queue is None and has_exchanges and OBSERVER.get() is None else None
        parts_queue = queue if aside is None else aside  # (a custom step's backward still gets ``queue``)
        fill = aside if aside is not None else queue if queue is not None and queue.fill_waits and OBSERVER.get() is None else None
        self._add_grad(output, grad, len(steps))
        for term, weight in self._seeds:  # the loss terms produced in this stage start here too
            self._add_grad(term, torch.full_like(term, self.loss_seed * weight), len(steps))
        self._seeds = []
        flow = _Flow(steps)
        in_flight: list[tuple[int, Pending]] = []
        ahead = [j for j, st in enumerate(steps) if isinstance(st, Custom) and st.prepare is not None]
        prepared: int | None = None  # a custom step whose prepare ran and whose backward has not
        marks, self._ahead = self._ahead, []
        last_mark: int | None = None  # where the last mark that ran was recorded
        while not flow.finished():
            j = flow.next_exchange()
            if j is not None:  # issue first: the rows travel while everything else runs
                step = steps[j]
                g = self._pop_grad(step.output)
                if g is None:  # the exchange must still happen: the peers take part in it
                    g = torch.zeros(step.output.shape, dtype=step.output.dtype, device=step.output.device)
                back = None if step.label is None else (f"{step.label[0]} grad", step.label[1])
                pending = encoded_grad(step.group, g, step.in_splits, step.out_splits, step.wire, step.source, back)
                flow.start(j)
                in_flight.append((j, pending))
                yield pending
                continue
            j = flow.next_step()
            if j is not None:
                flow.start(j)
                step = steps[j]
                if isinstance(step, Custom):
                    if prepared == j:
                        prepared = None
                    if j in ahead:
                        ahead.remove(j)
                    work = self._custom_backward(step, j, queue)
                    if prepared is None and ahead:
                        # a custom backward (a replay's backward) beside the next one's replay,
                        # switching at every exchange in flight as an F&B pair does
                        prepared = ahead.pop()
                        work = discard_second(interleaved(work, steps[prepared].prepare()))
                    yield from work
                else:  # a part's backward yields nothing: a plain call
                    self._part_backward(step, j, parts_queue)
                flow.finish(j)
                continue
            if not in_flight:
                raise RuntimeError("the tape's backward cannot go on: a step waits for one that never runs")
            if prepared is None and ahead:  # the next replay, while the rows travel
                prepared = ahead.pop()
                yield from steps[prepared].prepare()
                continue
            if marks and (last_mark is None or last_mark >= len(steps) or flow.started(last_mark)):
                last_mark, early = marks.pop()
                early()
                continue
            j, pending = in_flight.pop(0)  # the first issued arrives first
            if fill is not None:  # weight gradients while the rows travel
                fill.run_until(lambda: pending.arrived)
            step = steps[j]
            self._add_grad(step.source, pending.wait(), j)
            flow.finish(j)
        if aside is not None:
            aside.run()
        grad_in = None if self._input is None else self._pop_grad(self._input)
        if grad_in is None and self._input is not None:  # the output does not depend on the input
            grad_in = torch.zeros_like(self._input)
        self._grads.clear()
        self._input = None
        return grad_in

    def _custom_backward(self, step: Custom, j: int, queue: WeightGradQueue | None) -> Program:
        """A custom step's backward program; its inputs' gradients are added as step ``j``'s."""
        grads_in = yield from step.backward([self._pop_grad(o) for o in step.outputs], queue)
        for src, g in zip(step.inputs, grads_in):
            if g is not None:
                self._add_grad(src, g, j)

    def _part_backward(self, step: _Part, j: int, queue: WeightGradQueue | None) -> None:
        """One part's backward; its inputs' gradients are added as step ``j``'s, its deferrable
        weight gradients go to ``queue`` (None: computed at once)."""
        outs, grads = [], []
        for o in step.outputs:
            g = self._pop_grad(o)
            if g is not None:
                outs.append(o)
                grads.append(g)
        watch = NO_NOTE if step.note is None else step.note.backward(queue)
        if outs and step.plain and queue is not None:
            with watch:
                leaf_grads = split_backward(outs, grads, [leaf for leaf, _ in step.leaves], queue)
            for (_, src), g in zip(step.leaves, leaf_grads):
                if g is not None:
                    self._add_grad(src, g, j)
        else:
            if outs:
                with deferring(queue), watch:
                    _autograd_backward(outs, grads)
            for leaf, src in step.leaves:
                if leaf.grad is not None:
                    self._add_grad(src, leaf.grad, j)
        step.leaves.clear()
        step.outputs.clear()


try:  # what torch.autograd.backward calls once it has checked and converted its arguments
    from torch.autograd.graph import _engine_run_backward
except ImportError:  # a torch without it: the public call
    _engine_run_backward = None


def _autograd_backward(outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    """``torch.autograd.backward(outputs, grads)`` minus its Python-side argument checks and
    conversions: a part's gradients come from the tape (the same shapes, dtypes and devices as
    its outputs; the engine checks them again), and a stage runs this once per part."""
    if _engine_run_backward is None:
        torch.autograd.backward(outputs, grads)
    else:
        _engine_run_backward(tuple(outputs), tuple(grads), False, False, (), allow_unreachable=True, accumulate_grad=True)


class _Flow:
    """Which recorded steps' backwards may run: a step's gradients are complete once every
    later step that read one of its outputs has finished (an exchange once its reverse rows
    arrived)."""

    def __init__(self, steps: list[_Part | _Exchange | Custom]) -> None:
        made: dict[int, int] = {}  # id of an output -> the step that made it
        for i, step in enumerate(steps):
            for t in _outputs(step):
                made[id(t)] = i
        self._feeds: list[set[int]] = [set() for _ in steps]  # step -> the earlier steps it read from
        self._waiting = [0] * len(steps)  # step -> its readers not finished yet
        for j, step in enumerate(steps):
            feeds = self._feeds[j]
            for t in _inputs(step):
                i = made.get(id(t))
                if i is not None and i != j and i not in feeds:
                    feeds.add(i)
                    self._waiting[i] += 1
        self._exchange = [isinstance(step, _Exchange) for step in steps]
        # ready steps, exchanges apart: the backward issues those first
        self._ready: tuple[set[int], set[int]] = (set(), set())
        for i, n in enumerate(self._waiting):
            if n == 0:
                self._ready[self._exchange[i]].add(i)
        self._started: set[int] = set()
        self._left = len(steps)

    def next_exchange(self) -> int | None:
        """The latest ready exchange (not started), if any."""
        ready = self._ready[True]
        return max(ready) if ready else None

    def next_step(self) -> int | None:
        """The latest ready step that is not an exchange (not started), if any."""
        ready = self._ready[False]
        return max(ready) if ready else None

    def start(self, j: int) -> None:
        self._ready[self._exchange[j]].discard(j)
        self._started.add(j)

    def started(self, j: int) -> bool:
        return j in self._started

    def finish(self, j: int) -> None:
        self._left -= 1
        for i in self._feeds[j]:
            self._waiting[i] -= 1
            if self._waiting[i] == 0:
                self._ready[self._exchange[i]].add(i)

    def finished(self) -> bool:
        return self._left == 0


def _outputs(step: _Part | _Exchange | Custom) -> list[torch.Tensor]:
    return [step.output] if isinstance(step, _Exchange) else list(step.outputs)


def _inputs(step: _Part | _Exchange | Custom) -> list[torch.Tensor]:
    if isinstance(step, _Exchange):
        return [step.source]
    if isinstance(step, Custom):
        return list(step.inputs)
    return [src for _, src in step.leaves]

