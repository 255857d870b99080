"""The W split: input gradient now (B), weight gradient later (W).

Zero-bubble schedules split a backward into B (input gradient, needed at once by the previous
stage) and W (weight gradient, free to fill a bubble later). The executor gives each B a
:class:`WeightGradQueue` and runs it at the matching W. Two ways fill the queue:

- **Layers that defer themselves** (portapipe's ``Linear`` and grouped linear): inside
  autograd's backward each computes its input gradient and hands its weight gradient to
  :func:`defer_weight_grad`, which queues it when a queue is active (:func:`deferring`, a
  context variable set by whoever drives the backward; there is no module-level queue) and
  computes it at once otherwise. Cheap: no graph walk.
- **Ordinary torch code** (:func:`split_backward`): autograd's input-only backward first, with
  the gradients reaching the nodes where the weights' branches leave the input's path captured
  on the way; the queued weight backward then starts from those nodes, so nothing of the
  input's path is computed twice. (torch.distributed.pipelining splits the same way.)

Both give the same numbers as one full backward: the same operations on the same values.
"""

from __future__ import annotations

import contextvars
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from .ir import Action, Kind


class WeightGradQueue:
    """Deferred weight-gradient computations of one (stage, micro-batch) backward.

    ``fill_waits``: the B that fills this queue may run its oldest entries while one of its
    exchanges travels (:meth:`run_until`), the rest waiting for the W. The executor allows it
    only where no action between the B and its W adds to the same block's gradients, so every
    gradient is still summed in the schedule's order.
    """

    def __init__(self, fill_waits: bool = False) -> None:
        self._work: list[Callable[[], None]] = []
        self.fill_waits = fill_waits

    def put(self, fn: Callable[[], None]) -> None:
        self._work.append(fn)

    def __len__(self) -> int:
        return len(self._work)

    def run(self) -> None:
        """Compute and accumulate every queued weight gradient, in queue order, then forget them."""
        work, self._work = self._work, []
        if not work:  # a part with no weights of its own (a full backward gives every part a queue)
            return
        # Outside autograd's backward grad mode is on: record no graph (it would keep the
        # layers' inputs alive for nothing).
        with torch.no_grad():
            for fn in work:
                fn()

    def run_until(self, done: Callable[[], bool]) -> None:
        """Run the oldest entries, one at a time, until ``done()`` or none is left (queue order kept)."""
        while self._work and not done():
            fn = self._work.pop(0)
            with torch.no_grad():
                fn()


def early_weight_grads(actions: Sequence[Action], stage_block: Sequence[int]) -> frozenset[tuple[int, int]]:
    """(stage, micro-batch) of each B in one rank's ``actions`` that may start its W's work
    while its exchanges travel (:attr:`WeightGradQueue.fill_waits`): those with no action
    between the B and its W that adds to the same block's gradients (another B, W or BW of it),
    so every weight gradient is still added in the schedule's order, whenever its share of the
    W work runs. Other actions (posts, forwards, other blocks' work) may lie between."""
    last: dict[int, int] = {}  # block -> the latest action adding to its gradients
    open_b: dict[tuple[int, int], int] = {}  # a B waiting for its W -> its action's index
    out: set[tuple[int, int]] = set()
    for i, a in enumerate(actions):
        if a.kind.is_comm:
            continue
        halves = a.pair if a.kind is Kind.FB else (a,)
        for h in halves:
            if h.kind is Kind.W and (h.stage, h.mb) in open_b and last.get(stage_block[h.stage]) == open_b.pop((h.stage, h.mb)):
                out.add((h.stage, h.mb))
        for h in halves:
            if h.kind in (Kind.B, Kind.BW, Kind.W):
                last[stage_block[h.stage]] = i
            if h.kind is Kind.B:
                open_b[(h.stage, h.mb)] = i
    return frozenset(out)


_ACTIVE: contextvars.ContextVar[WeightGradQueue | None] = contextvars.ContextVar("portapipe_wgrad_queue", default=None)


class deferring:  # noqa: N801 - used as a function: ``with deferring(queue):``
    """Within this block, layers using :func:`defer_weight_grad` queue their weight gradients in ``queue``.

    ``None`` means compute them at once (a full backward). A class rather than a generator
    context manager: the tape enters one per part's backward.
    """

    def __init__(self, queue: WeightGradQueue | None) -> None:
        self.queue = queue
        self._token: contextvars.Token[WeightGradQueue | None] | None = None

    def __enter__(self) -> WeightGradQueue | None:
        self._token = _ACTIVE.set(self.queue)
        return self.queue

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._token)


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Add ``grad`` into ``param.grad`` the way autograd's accumulation would, or into
    ``param.main_grad`` when the parameter has one (an accumulator in a wider dtype)."""
    main = getattr(param, "main_grad", None)
    if main is not None:
        main.add_(grad)
    elif param.grad is None:
        param.grad = grad.detach()
    else:
        param.grad.add_(grad)


def defer_weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """For an autograd function's backward: the weight gradient now, or queued (returns None,
    so autograd adds nothing) when a queue is active; the queued work accumulates into ``weight.grad``."""
    queue = _ACTIVE.get()
    if queue is None:
        return compute()
    queue.put(lambda: accumulate_grad(weight, compute()))
    return None


def accumulate_weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> None:
    """For an autograd function's backward that returns no gradient for ``weight`` (None): the
    part ``compute()`` gives accumulated on its own, now or queued as :func:`defer_weight_grad`
    queues (several parts each reach the accumulator in ``weight``'s dtype once, unsummed)."""
    queue = _ACTIVE.get()
    if queue is None:
        accumulate_grad(weight, compute())
    else:
        queue.put(lambda: accumulate_grad(weight, compute()))


# ----------------------------------------------------------------------- ordinary torch code
def _node(t: torch.Tensor) -> Node | None:
    """The graph node gradients of ``t`` flow into: its grad_fn, or a leaf's accumulator."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad (made once, then cached)


def _graph(roots: Sequence[Node]) -> tuple[dict[Node, list[Node]], list[Node]]:
    """Consumers of every node reachable from ``roots`` and the accumulators of requires-grad leaves."""
    users: dict[Node, list[Node]] = {}
    leaves: list[Node] = []
    todo = deque(r for r in dict.fromkeys(roots))
    seen = set(todo)
    while todo:
        node = todo.popleft()
        if hasattr(node, "variable"):
            leaves.append(node)
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            users.setdefault(nxt, []).append(node)
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return users, leaves


def _upwards(starts: Sequence[Node], users: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Nodes reached from ``starts`` towards the outputs, not passing ``stop``; and the stop nodes met."""
    seen, met = set(starts), set()
    todo = deque(starts)
    while todo:
        for user in users.get(todo.popleft(), ()):
            if user in stop:
                met.add(user)
            elif user not in seen:
                seen.add(user)
                todo.append(user)
    return seen, met


def split_backward(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], queue: WeightGradQueue
) -> list[torch.Tensor | None]:
    """Input gradients of ``outputs`` now; their weights' gradients put on ``queue``.

    ``inputs`` are leaves (the part's inputs); every other requires-grad leaf the outputs depend
    on is a weight and gets its gradient accumulated into ``.grad`` when the queue runs.
    """
    roots = [n for n in map(_node, outputs) if n is not None]
    input_nodes = [n for n in map(_node, inputs) if n is not None]
    if not input_nodes:  # nothing to hand back now: the whole backward is weight work
        kept_out, kept_grads = list(outputs), list(grads)
        queue.put(lambda: torch.autograd.backward(kept_out, kept_grads))
        return [None] * len(inputs)
    users, leaves = _graph(roots)
    known = set(input_nodes)
    weights = [n for n in leaves if n not in known]
    on_path, _ = _upwards(input_nodes, users, set())  # the input's path: nodes the inputs are reached from
    # Per weight, the nodes where its branches join the input's path; weights sharing a join
    # node form one group (one autograd call each, so no branch is walked twice). A weight with
    # a branch reaching an output off that path takes its gradient from the outputs instead.
    groups: list[tuple[set[Node], list[Node]]] = []
    off_path: list[Node] = []
    top = set(roots)
    for w in weights:
        seen, joins = _upwards([w], users, on_path)
        if seen & top:
            off_path.append(w)
            continue
        merged = [g for g in groups if g[0] & joins]
        for g in merged:
            groups.remove(g)
            joins |= g[0]
        groups.append((joins, [w] + [x for g in merged for x in g[1]]))
    captured: dict[Node, dict[int, torch.Tensor]] = {}

    def capture(node: Node) -> Callable[[tuple[Any, ...]], None]:
        def hook(grad_outputs: tuple[Any, ...]) -> None:
            captured[node] = {i: g for i, g in enumerate(grad_outputs) if g is not None}

        return hook

    handles = [n.register_prehook(capture(n)) for joins, _ in groups for n in joins]
    try:
        wanted = [t for t in inputs if t.requires_grad]
        got = torch.autograd.grad(list(outputs), wanted, list(grads), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    by_id = {id(t): g for t, g in zip(wanted, got)}
    kept_out, kept_grads = (list(outputs), list(grads)) if off_path else ([], [])  # keep outputs only if needed

    def weight_backward() -> None:
        _from_joins(groups, captured)
        if off_path:
            dws = torch.autograd.grad(kept_out, [GradientEdge(w, 0) for w in off_path], kept_grads, retain_graph=True, allow_unused=True)
            for w, dw in zip(off_path, dws):
                if dw is not None:
                    accumulate_grad(w.variable, dw)

    queue.put(weight_backward)
    return [by_id.get(id(t)) for t in inputs]


def _from_joins(groups: list[tuple[set[Node], list[Node]]], captured: dict[Node, dict[int, torch.Tensor]]) -> None:
    """Each group's weight gradients from the gradients captured at its join nodes."""
    for joins, weights in groups:
        edges, seeds = [], []
        for node in joins:
            for i, g in captured.get(node, {}).items():
                edges.append(GradientEdge(node, i))
                seeds.append(g)
        if not edges:
            continue
        # With several join nodes one may lie above another: pin each to its captured gradient
        # so a branch's gradient is not counted again through the one above it.
        handles = [n.register_prehook(_pinned(captured.get(n, {}))) for n in joins] if len(joins) > 1 else []
        try:
            dws = torch.autograd.grad(edges, [GradientEdge(w, 0) for w in weights], seeds, retain_graph=True, allow_unused=True)
        finally:
            for h in handles:
                h.remove()
        for w, dw in zip(weights, dws):
            if dw is not None:
                accumulate_grad(w.variable, dw)


def _pinned(saved: dict[int, torch.Tensor]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    def hook(grad_outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(saved.get(i) for i in range(len(grad_outputs)))

    return hook
