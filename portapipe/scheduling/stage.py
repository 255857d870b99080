"""The stage contract: what a pipeline stage gives the executor, and the names it uses.

A *stage* is one model block placed on a pipeline rank (docs/models.md shows both kinds below
with code). The executor (:class:`~.executor.PipelineExecutor`) needs three things of it:

- ``named_parameters()``: its parameters under their **logical names**, the names the same
  parameter has in the single-process model (global layer indices, never block, rank or slot
  numbers). Two copies of one block (DualPipe) and data-parallel replicas report the same names;
  that is what lets a checkpoint written on one layout load on any other.
- ``program(tape, x, targets)``: its forward for one micro-batch as a generator. It runs its
  work through ``tape`` in *parts* (``tape.part(fn, *args)``; ``plain=True`` for ordinary
  torch code, whose weight gradients autograd splits off for W actions) and, if it exchanges
  rows with other ranks inside its forward, issues each exchange with ``tape.all_to_all(group,
  rows, out_splits, in_splits)`` and yields the returned handle before ``wait()``-ing on it, so
  the executor can run another micro-batch's program while the rows travel (F&B overlap). A
  stage without exchanges never yields. It returns the tensor it sends on, or, in the last
  stage, the micro-batch's scalar loss.

  What may run while an exchange travels *within* the micro-batch (a lone F, B or BW has
  nothing else) is said by the program itself: in the forward, the parts it places between
  issuing an exchange and ``wait()``-ing on it; in the backward, the data (the tape issues each
  reverse exchange as soon as its gradient is complete and runs every part not reading its
  result meanwhile, and a full backward computes set-aside weight gradients before waiting);
  and, for a step recorded with ``tape.custom``, its gradient-free ``prepare`` program
  (:class:`~.overlap.Custom`), which the backward may run early. Nothing in the executor
  knows the model's parts.
- ``has_loss``: True for the stage whose program returns the loss (it gets the targets).

A micro-batch is ``(inputs, targets)``, or ``(inputs, targets, positions)`` when the data says
where documents start inside each sample (``data.document_mask``, :mod:`portapipe.data.samples`):
``positions[b, s]`` is each input token's position in its document, 0 where one starts. Every
stage's program then gets it as ``program(tape, x, targets, positions=positions)``, so attention
can stay inside documents at every stage: each rank holds its replica's whole batch (it is made
from the step alone), so nothing extra travels between stages. A stage that does not take
``positions`` never gets it from data without it.

A loss term produced inside any stage (an auxiliary loss of a router, a second prediction head
beside the main one) is recorded by its program with ``tape.loss(name, value, weight)``: the
stage's own backward starts with its gradient (``weight`` times the seed the executor gives the
main loss), so it needs no path to the last stage and is treated like every other gradient (W
split, F&B overlap, recompute). The executor reports each term's value by name, knowing nothing
else of it; whoever composes the executor names every term the stages record (``loss_terms``).

Beside the stages, the executor gets from whoever composes it: a :data:`Boundary` (the shape and
dtype of what each stage sends forward), optionally the exchanges' :class:`~.exchange.A2AStats`
and an end-of-step hook for the model's own work (:data:`~.executor.EndStep`).

Parameters carry their parallel role as attributes, read through the functions below:

- ``is_expert``: a routed expert's weights, stacked along dim 0, one row per *slot*; sharded
  over the expert-parallel group and reduced over data-parallel replicas only. Every other
  parameter is replicated over dp x ep and its gradient summed there.
- ``expert_ids``: the logical expert held by each row of an expert parameter (a balancer may
  replicate and reorder experts, so row j is not expert j in general).
- ``slot_owned`` (optional): the rows that count as *the* copy of their expert (one per expert
  over the EP group when experts are replicated); absent means every row.

- ``copy_blocks`` (optional, :func:`mark_shared`): the model blocks that each hold a copy of this
  logical weight (an embedding that the first block and the last block's multi-token prediction
  both use; an output head tied to the embedding). Its gradient is the sum over every copy on
  every rank, as DualPipe's two copies of a block are one weight (:meth:`~.executor.PipelineExecutor.sum_copies`);
  absent means the parameter's own block only.

The logical name of one expert's weights is :func:`expert_key`: ``prefix.{expert}.leaf`` for the
stacked parameter ``prefix.leaf``, e.g. ``layers.3.moe.experts.5.gate_up`` is logical expert 5
of ``layers.3.moe.experts.gate_up``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Stage(Protocol):
    """One model block as the executor sees it (see the module docstring)."""

    has_loss: bool

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...

    def program(self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None) -> Generator[Any, None, torch.Tensor]: ...


#: ``boundary(stage, input_shape) -> (shape, dtype)``: what virtual stage ``stage`` sends to the
#: next one (and gets back as its gradient) for a micro-batch whose input has ``input_shape``.
#: Declared rather than exchanged, so every receive can be posted before its sender computes.
Boundary = Callable[[int, torch.Size], tuple[tuple[int, ...], torch.dtype]]


def mark_expert(p: torch.Tensor, expert_ids: Sequence[int]) -> None:
    """Declare ``p`` a stacked expert parameter whose row j holds logical expert ``expert_ids[j]``."""
    ids = [int(e) for e in expert_ids]
    if len(ids) != p.shape[0]:
        raise ValueError(f"an expert parameter of {p.shape[0]} rows cannot hold {len(ids)} experts")
    p.is_expert = True  # type: ignore[attr-defined]
    p.expert_ids = ids  # type: ignore[attr-defined]


def mark_shared(p: torch.Tensor, blocks: Sequence[int]) -> None:
    """Declare ``p`` one copy of a logical weight that each of ``blocks`` holds (its own among them)."""
    p.copy_blocks = tuple(sorted({int(b) for b in blocks}))  # type: ignore[attr-defined]


def shared_blocks(p: torch.Tensor) -> tuple[int, ...]:
    """The blocks holding a copy of ``p``'s logical weight (empty: only its own block)."""
    return tuple(getattr(p, "copy_blocks", ()))


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` holds routed experts (sharded over EP, reduced over DP only)."""
    return bool(getattr(p, "is_expert", False))


def expert_ids(p: torch.Tensor) -> list[int]:
    """Logical expert of each row of the expert parameter ``p``."""
    ids = getattr(p, "expert_ids", None)
    if ids is None:
        raise ValueError("not an expert parameter: it has no expert_ids (see portapipe.scheduling.stage.mark_expert)")
    return list(ids)


def owned_rows(p: torch.Tensor) -> torch.Tensor | None:
    """Boolean mask of the rows that are their expert's counted copy, or None for all rows."""
    return getattr(p, "slot_owned", None)


def expert_key(name: str, expert: int) -> str:
    """Logical name of expert ``expert``'s slice of the stacked expert parameter ``name``."""
    prefix, _, leaf = name.rpartition(".")
    return f"{prefix}.{int(expert)}.{leaf}" if prefix else f"{int(expert)}.{leaf}"


def logical_slices(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor, bool]]:
    """``(logical name, tensor, owned)`` for each of this rank's tensors, experts split per expert.

    A whole tensor comes as it is (``owned`` True); a stacked expert parameter row by row, each
    row a view named :func:`expert_key` by the expert it holds, ``owned`` by :func:`owned_rows`.
    A replicated expert yields one view per replica, under the same name.
    """
    for name, t in named:
        if not is_expert(t):
            yield name, t, True
            continue
        owned = owned_rows(t)
        for j, e in enumerate(expert_ids(t)):
            yield expert_key(name, e), t[j], bool(owned is None or owned[j])


@torch.no_grad()
def logical_state(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """This rank's share of the single-process state: owned tensors by logical name, on the CPU."""
    return {key: t.detach().to("cpu", copy=True) for key, t, owned in logical_slices(named) if owned}


@torch.no_grad()
def load_logical_state(named: Iterable[tuple[str, torch.Tensor]], state: Mapping[str, torch.Tensor]) -> None:
    """Copy ``state`` (logical names, e.g. from :func:`logical_state` of any layout) into this rank's tensors.

    Every replica of an expert gets its expert's tensor. Raises ValueError naming the missing
    names and the shape mismatches (nothing is copied then); names this rank does not hold are ignored.
    """
    slices = list(logical_slices(named))
    missing = sorted({key for key, _, _ in slices if key not in state})
    wrong = sorted({f"{key}: {tuple(state[key].shape)} != {tuple(t.shape)}" for key, t, _ in slices if key in state and state[key].shape != t.shape})
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing (first: {', '.join(missing[:5])})")
        if wrong:
            parts.append(f"{len(wrong)} of another shape (first: {'; '.join(wrong[:5])})")
        raise ValueError("the state does not fit this model: " + "; ".join(parts))
    for key, t, _ in slices:
        t.copy_(state[key])
