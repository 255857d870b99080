"""Your own model: a list of ordinary ``nn.Module`` stages under any of portapipe's schedules.

:func:`pipeline` takes the model as one ``nn.Module`` per model block, in order (what
``nn.Sequential(*modules)`` would run in one process), and returns a :class:`Pipeline` whose
:meth:`~Pipeline.step` runs one training step of the schedule on this rank: forwards, backwards
with the W split where the schedule has W actions (autograd's input-only backward first, the
weights' backward at W), DualPipe's copy summing and the data-parallel gradient reduction (the
gradient buckets of :mod:`portapipe.optim.buckets`, as for portapipe's own model: each block's
buckets are reduced while the rest of the schedule runs). Call
it on every rank, e.g. inside a function started by :func:`portapipe.ranks.launch.run_ranks` (which
also joins the ranks of torchrun or mpirun)::

    def main(backend):
        pipe = portapipe.pipeline(build_modules(), backend=backend, schedule="dualpipev",
                                  microbatches=4, loss_fn=torch.nn.functional.cross_entropy)
        result = pipe.step(inputs, targets)   # .grad of every local parameter is now set

Parameters keep their names in ``nn.Sequential(*modules)`` (``"2.0.weight"``): the logical
names of the stage contract. How many modules: ``pp`` for 1f1b, zb1p and dualpipe (which
holds each on two ranks), ``pp * chunks`` for interleaved, ``2 * pp`` for dualpipev.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .backends.base import Backend, ParallelGroups
from .optim.buckets import GradBuckets
from .scheduling.executor import PipelineExecutor, StepResult, make_schedule
from .scheduling.ir import Schedule
from .scheduling.schedules import NAMES
from .scheduling.stage import Boundary

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: size of one gradient bucket (MB), as ``train.grad_bucket_mb``'s default
BUCKET_MB = 25.0


class PlainStage:
    """One ``nn.Module`` as a pipeline stage: one part of ordinary torch code, no exchanges.

    ``index``: its place in the model (the prefix of its parameters' names); ``loss_fn``: set
    for the stage that ends the model, applied to its output and the micro-batch's targets.
    """

    def __init__(self, module: nn.Module, index: int, loss_fn: LossFn | None = None) -> None:
        self.module, self.index, self.loss_fn = module, index, loss_fn

    @property
    def has_loss(self) -> bool:
        return self.loss_fn is not None

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in self.module.named_parameters():
            yield f"{self.index}.{name}", p

    def _loss(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = self.loss_fn(self.module(x), targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (the micro-batch's mean loss), got {shape}")
        return loss

    def program(self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None) -> Generator[Any, None, torch.Tensor]:
        x = tape.watch(x)
        if self.loss_fn is None:
            return tape.part(self.module, x, plain=True)
        if targets is None:
            raise ValueError(f"stage {self.index} computes the loss and needs the targets")
        return tape.part(self._loss, x, targets, plain=True)
        yield  # a generator that never yields: a plain stage has no exchange to overlap


class Pipeline:
    """This rank's part of a pipelined plain model (see :func:`pipeline`)."""

    def __init__(
        self, modules: Sequence[nn.Module], schedule: Schedule, backend: Backend, groups: ParallelGroups, loss_fn: LossFn,
        boundary: Boundary | None = None, loss_terms: Sequence[str] = (),
    ) -> None:
        self.modules, self.schedule, self._given = list(modules), schedule, boundary
        self._shapes: dict[tuple[int, ...], dict[int, tuple[tuple[int, ...], torch.dtype]]] = {}
        last = {schedule.stage_block[v] for v in range(schedule.n_stages) if schedule.is_last(v)}
        device = backend.device()
        stages = {b: PlainStage(modules[b].to(device), b, loss_fn if b in last else None) for b in schedule.blocks_of(groups.pp_rank)}
        self.executor = ex = PipelineExecutor(schedule, stages, backend, groups, boundary=boundary or self.boundary, loss_terms=loss_terms)
        # gradients accumulate and are reduced in the parameters' dtype (the wider of two: a
        # parameter in another one gets its gradient back in its own after the step)
        dtypes = {p.dtype for p in self.parameters() if p.requires_grad}
        self.dtype = functools.reduce(torch.promote_types, sorted(dtypes, key=str)) if dtypes else torch.float32
        ex.grad_sync = self.grads = GradBuckets(
            ex.blocks, groups, backend, master_dtype=self.dtype, reduce_dtype=self.dtype, zero_stage=0, bucket_mb=BUCKET_MB,
            overlap=True, copy_sum=ex.sum_copies, holders=ex.copy_holders,
        )

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters by their names in ``nn.Sequential(*modules)``."""
        return self.executor.named_parameters()

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.executor.parameters()

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, accumulate: bool = False) -> StepResult:
        """One training step on this replica's batch, cut into the schedule's micro-batches along dim 0.

        Every parameter's ``.grad`` then holds the gradient of the mean over micro-batches (and
        data-parallel replicas) of ``loss_fn``; ``result.loss`` is that mean. With ``accumulate``
        the gradient is added to the ``.grad`` already there (gradient accumulation: after k such
        steps ``.grad`` holds the sum of k means; scale by 1 / k for their mean), else it replaces it.
        ``.grad`` is a view of the pipeline's gradient buffers, which the next step overwrites:
        clone it to keep it.
        """
        m = self.schedule.n_microbatches
        if inputs.shape[0] != targets.shape[0] or inputs.shape[0] % m:
            raise ValueError(
                f"step() needs inputs and targets with the same batch size, a multiple of the {m} micro-batches; "
                f"got {inputs.shape[0]} and {targets.shape[0]}"
            )
        mbs = list(zip(inputs.chunk(m), targets.chunk(m)))
        if self._given is None:
            for x, _ in mbs:
                self._infer(x)
        # Every step starts from zeroed buffers: earlier gradients are set aside and added back.
        before = [(p, p.grad.clone()) for p in self.parameters() if p.grad is not None] if accumulate else []
        result = self.executor.step(mbs)
        with torch.no_grad():
            for p in self.parameters():
                main = getattr(p, "main_grad", None)  # accumulated and reduced in the buckets' dtype
                if main is not None and p.requires_grad:
                    p.grad = main.to(p.dtype)
            for p, g in before:
                p.grad = g if p.grad is None else p.grad.add_(g)
        return result

    def boundary(self, stage: int, input_shape: torch.Size) -> tuple[tuple[int, ...], torch.dtype]:
        """What ``stage`` sends for a micro-batch of ``input_shape``, as inferred (see :meth:`_infer`)."""
        return self._shapes[tuple(input_shape)][stage]

    def _infer(self, x: torch.Tensor) -> None:
        """What each stage sends for inputs shaped like ``x``: the modules run once on meta tensors (no compute)."""
        key = tuple(x.shape)
        if key in self._shapes:
            return
        s, out = self.schedule, {}
        for stages in s.pipelines:
            h = torch.empty_like(x, device="meta")
            for v in stages[:-1]:
                module = self.modules[s.stage_block[v]]
                state = {n: torch.empty_like(t, device="meta") for n, t in (*module.named_parameters(), *module.named_buffers())}
                try:
                    h = functional_call(module, state, (h,))
                except Exception as exc:
                    raise ValueError(
                        f"cannot infer what stage {v} (module {s.stage_block[v]}) outputs for inputs of shape {list(key)} "
                        f"on meta tensors ({type(exc).__name__}: {exc}); pass pipeline(..., boundary=...) to say it"
                    ) from exc
                if not isinstance(h, torch.Tensor):
                    raise ValueError(f"module {s.stage_block[v]} returns {type(h).__name__}; a stage that is not the last must return one tensor")
                out[v] = (tuple(h.shape), h.dtype)
        self._shapes[key] = out


def pipeline(
    modules: Sequence[nn.Module],
    *,
    backend: Backend,
    loss_fn: LossFn,
    schedule: str = "dualpipev",
    microbatches: int,
    dp: int = 1,
    w_split: bool = True,
    boundary: Boundary | None = None,
    loss_terms: Sequence[str] = (),
) -> Pipeline:
    """Pipeline ``modules`` (the whole model, one module per block, the same on every rank)
    over the ranks of ``backend``'s process group: ``dp`` replicas of ``world / dp`` pipeline ranks.

    Collective: every rank calls it with the same arguments. Raises ValueError naming what does
    not fit (module count, schedule, ranks), and when the modules differ between ranks holding
    the same block (DualPipe copies, replicas): seed torch before building them.

    ``boundary(stage, input_shape) -> (shape, dtype)`` says what each virtual stage sends on;
    by default it is inferred by running the modules on meta tensors once per input shape.
    ``loss_terms``: the names of the loss terms stages of your own record inside their programs
    (``tape.loss``, see :mod:`portapipe.scheduling.stage`), reported in ``StepResult.loss_terms``.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    if schedule not in NAMES:
        raise ValueError(f"unknown schedule {schedule!r}; known: {', '.join(NAMES)}")
    if dp < 1 or world % dp:
        raise ValueError(f"dp = {dp} does not divide the {world} ranks")
    pp, n = world // dp, len(modules)
    expected = {"dualpipev": 2 * pp, "interleaved": None}.get(schedule, pp)
    chunks = n // pp if schedule == "interleaved" else 2
    if schedule == "interleaved" and (n % pp or chunks < 2):
        raise ValueError(f"interleaved on pp = {pp} ranks needs a multiple of {pp} modules, at least {2 * pp}; got {n}")
    if expected is not None and n != expected:
        raise ValueError(f"{schedule} on pp = {pp} ranks runs {expected} modules (one per model block); got {n}")
    plan = make_schedule(schedule, pp, microbatches, chunks, w_split)
    _check_identical(modules)
    return Pipeline(modules, plan, backend, backend.parallel_groups(pp, dp, 1), loss_fn, boundary, loss_terms)


@torch.no_grad()
def _check_identical(modules: Sequence[nn.Module]) -> None:
    """Every rank must hold the same model: compare a fingerprint of each module over the world,
    and which of its parameters require gradients (ranks holding the same block reduce the
    gradients of exactly those: a parameter frozen on one rank only would pair unequal tensors)."""
    import torch.distributed as dist

    mine = []
    for m in modules:
        tensors = [t.detach().to("cpu", torch.float64).reshape(-1) for t in (*m.parameters(), *m.buffers()) if t.is_floating_point()]
        flat = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.float64)
        fingerprint = (flat.numel(), float(flat.sum()), float((flat * torch.arange(1, flat.numel() + 1, dtype=torch.float64)).sum()))
        mine.append((fingerprint, {name: p.requires_grad for name, p in m.named_parameters()}))
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for b in range(len(modules)):
        ranks = [r for r, fp in enumerate(every) if fp[b][0] != every[0][b][0]]
        if ranks:
            raise ValueError(
                f"module {b} differs between ranks 0 and {ranks[0]}: every rank must build the same modules "
                "(seed torch, e.g. torch.manual_seed(0), before building them)"
            )
        first = every[0][b][1]
        for r, fp in enumerate(every):
            odd = [name for name, flag in fp[b][1].items() if first.get(name) != flag]
            if odd:
                on, off = (0, r) if first.get(odd[0]) else (r, 0)
                raise ValueError(
                    f"parameter {b}.{odd[0]} requires grad on rank {on} but not on rank {off}: every rank must freeze "
                    "the same parameters (requires_grad_(False) on each)"
                )
