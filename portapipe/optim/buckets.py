"""Gradient buckets: where a step's gradients accumulate, and how they are summed over replicas.

Each of a rank's model blocks gets its trainable parameters laid out in flat buckets of at
most ``train.grad_bucket_mb`` (Megatron's main_grad): one kind of parameter per bucket, because
a shared parameter is summed over the replica group (dp x ep) and an expert's over dp. A
bucket's length is padded to a multiple of its group's size n so that it splits in n equal
ranges, range i belonging to the group's i-th rank: the same layout serves the reduce-scatter of
``zero_stage`` 2 and the master-weight / AdamW shards of stages 1 and 2 (see :mod:`.sharded`).

Gradients accumulate in the master dtype: when the model computes in it, a parameter's
``.grad`` *is* its view of the bucket (autograd adds into it in place); otherwise a hook adds
each accumulated gradient into ``param.main_grad`` (the view) and drops ``.grad``, and the
deferred weight gradients of the W split do the same (:func:`~portapipe.scheduling.wgrad.accumulate_grad`).
There is no flat copy of all gradients.

The executor calls :meth:`GradBuckets.block_done` when a block's last backward work of the
step ran on this rank; its buckets' reductions are issued there, asynchronously, while the rest
of the schedule runs (``train.overlap_grad_sync``). :meth:`GradBuckets.finish`, after the last
action, does what cannot start early (DualPipe's copy sums, a balancer's replica sums of expert
gradients, both before the replica reduction), then waits for everything; its time is the
gradient synchronisation left exposed.

A balancer with nothing to do (its replicas took no tokens this step and skip their replica
sum: ``idle``, zero_stage 0 only) holds its expert buckets back for nothing, and their replica
rows are out of date anyway (refilled from their first slots before they take tokens again):
those buckets are then issued at the seam like any other, and only the rows that own their
expert (:func:`~portapipe.scheduling.stage.owned_rows`) are reduced, packed into one buffer.

Every executor step goes through buckets (:mod:`portapipe.compose` for portapipe's model,
:mod:`portapipe.plain` for plain modules): they are the one gradient reduction.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..scheduling import spans
from ..scheduling.stage import is_expert, owned_rows, shared_blocks


@dataclass
class Bucket:
    """One flat gradient buffer: ``params`` at ``offsets``, ``numel`` elements (padded)."""

    block: int
    expert: bool
    params: list[nn.Parameter]
    offsets: list[int]
    numel: int
    group: Any
    group_size: int
    group_rank: int
    #: the full gradient (master dtype) while it exists; under zero_stage 2 freed once reduced
    grad: torch.Tensor | None = None
    #: zero_stage 2: this rank's reduced range of ``grad``
    shard_grad: torch.Tensor | None = None
    work: Any = None
    sent: torch.Tensor | None = None  # what is travelling, when not ``grad`` itself (another dtype)
    hooks: list[Any] = field(default_factory=list)
    #: the last norm runs and what they were built from (see GradBuckets.norm_runs)
    norm_cache: tuple[Any, ...] | None = None
    #: every copy of these parameters as (pipeline rank, block): the bucket's gradient is summed
    #: over them before the replica reduction (one holder: no copies)
    holders: tuple[tuple[int, int], ...] = ()
    #: the bucket's place among its block's buckets of the same holders and kind (pairs it with the copies')
    copy_index: int = 0
    #: whether the bucket is its weights' own (counted in the gradient norm) rather than a copy
    #: another block's weights lend to this block (a shared embedding)
    home: bool = True
    #: the owned rows' runs and what they were built from (see GradBuckets.owned_runs)
    owned_cache: tuple[Any, ...] | None = None
    #: the runs of ``grad`` travelling packed in ``sent`` (None: all of it)
    runs: list[tuple[int, int]] | None = None
    #: the reduction's span on a recorded step (:func:`~portapipe.scheduling.spans.begin`)
    span: Any = None

    @property
    def shard_size(self) -> int:
        return self.numel // self.group_size

    @property
    def shard(self) -> slice:
        """This rank's equal range of the bucket."""
        return slice(self.group_rank * self.shard_size, (self.group_rank + 1) * self.shard_size)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's view of a full-length flat tensor."""
        return [flat[o : o + p.numel()].view_as(p) for p, o in zip(self.params, self.offsets)]

    def segments(self, span: slice | None = None) -> list[tuple[nn.Parameter, int, int, int]]:
        """Per parameter overlapping ``span`` (this rank's range by default): (param, start in the
        param, start in the span, length)."""
        span = self.shard if span is None else span
        lo, hi = span.start, span.stop
        out = []
        for p, o in zip(self.params, self.offsets):
            a, b = max(lo, o), min(hi, o + p.numel())
            if a < b:
                out.append((p, a - o, a - lo, b - a))
        return out


def _group_of(groups: Any, expert: bool) -> tuple[Any, int, int]:
    if expert:
        ranks = groups.dp_ranks if groups.dp > 1 else [groups.rank]
        return (groups.dp_group if groups.dp > 1 else None), len(ranks), ranks.index(groups.rank)
    n = groups.dp * groups.ep
    ranks = groups.replica_ranks if n > 1 else [groups.rank]
    return (groups.replica_group if n > 1 else None), len(ranks), ranks.index(groups.rank)


Holders = Callable[[int, nn.Parameter], tuple[tuple[int, int], ...]]


def layout(blocks: Mapping[int, Any], groups: Any, bucket_elems: int, holders: Holders | None = None) -> list[Bucket]:
    """Buckets of every block (in block order), shared parameters before expert ones, each at most
    ``bucket_elems`` elements unless one parameter alone is larger. A block is anything with
    ``named_parameters()`` (a module, or a stage of the stage contract). ``holders(block, param)``:
    the copies of a parameter (see :attr:`Bucket.holders`); parameters with other copies than the
    rest of their block's (a weight shared with another block) get buckets of their own, laid
    out alike in every block holding a copy."""
    out: list[Bucket] = []
    seen: set[int] = set()  # a weight two blocks of this rank hold as one tensor is laid out once, by the first
    for b in sorted(blocks):
        params = [p for _, p in blocks[b].named_parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        for expert in (False, True):
            group, n, r = _group_of(groups, expert)
            by_holders: dict[tuple[tuple[int, int], ...], list[nn.Parameter]] = {}
            for p in [q for q in params if is_expert(q) == expert]:
                by_holders.setdefault(holders(b, p) if holders is not None else (), []).append(p)
            for held, ps in by_holders.items():
                home = not shared_blocks(ps[0]) or b == min(shared_blocks(ps[0]))
                made = len(out)
                chunk: list[nn.Parameter] = []
                size = 0
                for p in ps:
                    if chunk and size + p.numel() > bucket_elems:
                        out.append(_bucket(b, expert, chunk, group, n, r))
                        chunk, size = [], 0
                    chunk.append(p)
                    size += p.numel()
                if chunk:
                    out.append(_bucket(b, expert, chunk, group, n, r))
                for i, bucket in enumerate(out[made:]):
                    bucket.holders, bucket.copy_index, bucket.home = held, i, home
    return out


def _bucket(block: int, expert: bool, params: list[nn.Parameter], group: Any, n: int, r: int) -> Bucket:
    offsets, total = [], 0
    for p in params:
        offsets.append(total)
        total += p.numel()
    padded = -(-total // n) * n
    return Bucket(block, expert, params, offsets, padded, group, n, r)


class GradBuckets:
    """A rank's gradient buckets and their reduction over the replicas (see the module docstring).

    ``holders(block, param)``: every copy of a parameter as (pipeline rank, block): DualPipe's
    two copies of a block, the copies of a weight several blocks share
    (:func:`~portapipe.scheduling.stage.mark_shared`); ``copy_sum(holders, {block: tensor})``: the
    sum over those copies of a bucket-shaped tensor, given this rank's (collective with the
    other holders; see :meth:`~portapipe.scheduling.executor.PipelineExecutor.sum_copies`).
    ``before_expert_reduce``: run once per step before expert buckets are reduced (a balancer's
    replica sums), or None. ``idle``: asked at :meth:`start`, whether that work has nothing to
    do this step (a balancer's replicas idle: see the module docstring; zero_stage 0 only).
    ``zero_stage`` 2 reduce-scatters; 0 and 1 all-reduce.
    """

    def __init__(
        self,
        blocks: Mapping[int, Any],
        groups: Any,
        backend: Any,
        *,
        master_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        zero_stage: int,
        bucket_mb: float,
        overlap: bool,
        copy_sum: Callable[[tuple[tuple[int, int], ...], Mapping[int, torch.Tensor]], torch.Tensor],
        holders: Holders | None = None,
        before_expert_reduce: Callable[[], None] | None = None,
        idle: Callable[[], bool] | None = None,
    ) -> None:
        self.backend, self.groups = backend, groups
        self.master_dtype, self.reduce_dtype = master_dtype, reduce_dtype
        self.zero_stage, self.overlap = zero_stage, overlap
        self.copy_sum = copy_sum
        self.before_expert_reduce = before_expert_reduce
        # a shard's range must hold every row under zero_stage 1 / 2: only stage 0 reduces part of a bucket
        self.idle = idle if zero_stage == 0 else None
        self._idle = False  # this step's answer
        elem = torch.tensor([], dtype=master_dtype).element_size()
        self.buckets = layout(blocks, groups, max(1, int(bucket_mb * 2**20 / elem)), holders)
        self.device = next((b.params[0].device for b in self.buckets), torch.device("cpu"))
        self.by_block: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            self.by_block.setdefault(bucket.block, []).append(bucket)
            if zero_stage == 2:
                bucket.shard_grad = torch.zeros(bucket.shard_size, dtype=master_dtype, device=self.device)
            for p in bucket.params:
                if p.dtype != master_dtype:
                    bucket.hooks.append(p.register_post_accumulate_grad_hook(_into_main_grad))
        self.exposed_s = 0.0  # the last step's synchronisation time after the last action
        self.sync_s = 0.0  # the last step's time from the first reduction issued to the last done
        self._first_issue: float | None = None

    # -------------------------------------------------------------------- step
    def deferred(self, bucket: Bucket) -> bool:
        """Whether a bucket waits for :meth:`finish` (copy sum or replica sum first)."""
        return len(bucket.holders) > 1 or (bucket.expert and self.before_expert_reduce is not None and not self._idle)

    def start(self) -> None:
        """Before a step: zeroed buffers, every parameter's gradient pointed at its view."""
        self._first_issue = None
        self._idle = self.idle is not None and bool(self.idle())
        for bucket in self.buckets:
            if bucket.grad is None:
                bucket.grad = torch.zeros(bucket.numel, dtype=self.master_dtype, device=self.device)
            else:
                bucket.grad.zero_()
            bucket.work = bucket.sent = None
            for p, view in zip(bucket.params, bucket.views(bucket.grad)):
                if p.dtype == self.master_dtype:
                    p.grad = view
                else:
                    p.grad = None
                    p.main_grad = view  # type: ignore[attr-defined]

    def block_done(self, block: int) -> None:
        """The executor's seam: ``block``'s gradients on this rank are final for the step."""
        if not self.overlap:
            return
        for bucket in self.by_block.get(block, ()):
            if not self.deferred(bucket):
                self._issue(bucket)

    def finish(self) -> None:
        """After the last action: the deferred reductions, then wait for all (collective)."""
        t0 = time.perf_counter()
        copied: dict[tuple[Any, ...], list[Bucket]] = {}
        for bucket in self.buckets:
            if len(bucket.holders) > 1:
                copied.setdefault((bucket.holders, bucket.expert, bucket.copy_index), []).append(bucket)
        for key in sorted(copied):  # one order on every rank holding copies
            total = self.copy_sum(key[0], {bucket.block: bucket.grad for bucket in copied[key]})
            for bucket in copied[key]:
                bucket.grad.copy_(total)
        if self.before_expert_reduce is not None:
            self.before_expert_reduce()
        for bucket in self.buckets:
            if bucket.work is None:
                self._issue(bucket)
        for bucket in self.buckets:
            self._complete(bucket)
        t1 = time.perf_counter()
        self.exposed_s = t1 - t0
        self.sync_s = t1 - (self._first_issue if self._first_issue is not None else t0)

    def _issue(self, bucket: Bucket) -> None:
        if self._first_issue is None:
            self._first_issue = time.perf_counter()
        if bucket.group_size == 1:
            bucket.work = _DONE
            return
        bucket.runs = self.owned_runs(bucket) if bucket.expert and self._idle else None
        if bucket.runs == [(0, bucket.offsets[-1] + bucket.params[-1].numel())]:  # every row owns its expert
            bucket.runs = None
        if bucket.runs == []:  # replica rows only: nothing to reduce
            bucket.work = _DONE
            return
        if bucket.runs is not None:  # only the rows that own their expert: packed, sent, unpacked
            sent = torch.cat([bucket.grad[a:b] for a, b in bucket.runs]).to(self.reduce_dtype)
        else:
            sent = bucket.grad if self.reduce_dtype == self.master_dtype else bucket.grad.to(self.reduce_dtype)
        bucket.sent = sent
        if spans.RECORDER.get() is not None:  # a recorded step: the reduction's span, from its issue to its completion
            what = ("reduce-scatter" if self.zero_stage == 2 else "all-reduce", bucket.block, self.by_block[bucket.block].index(bucket))
            bucket.span = spans.begin(spans.GRAD_SYNC, what, {"bytes": sent.numel() * sent.element_size(), "expert": bucket.expert})
        if self.zero_stage == 2:
            out = bucket.shard_grad if self.reduce_dtype == self.master_dtype else sent.new_empty(bucket.shard_size)
            bucket.work = (self.backend.reduce_scatter_tensor(out, sent, group=bucket.group, async_op=True), out)
        else:
            bucket.work = (self.backend.all_reduce(sent, group=bucket.group, async_op=True), sent)
        spans.issued(bucket.span, bucket.work[0])

    def _complete(self, bucket: Bucket) -> None:
        if bucket.work is _DONE:
            if self.zero_stage == 2:
                bucket.shard_grad.copy_(bucket.grad[bucket.shard])
        else:
            work, out = bucket.work
            with spans.waiting(bucket.span):
                work.wait()
            if self.zero_stage == 2:
                if out is not bucket.shard_grad:
                    bucket.shard_grad.copy_(out)
            elif bucket.runs is not None:
                at = 0
                for a, b in bucket.runs:
                    bucket.grad[a:b].copy_(out[at:at + b - a])
                    at += b - a
            elif out is not bucket.grad:
                bucket.grad.copy_(out)
        bucket.work = bucket.sent = bucket.runs = bucket.span = None
        if self.zero_stage == 2:  # the full gradient is freed as soon as it is reduced
            bucket.grad = None
            self.release(bucket)

    def release(self, bucket: Bucket) -> None:
        """Drop the parameters' views of a bucket's full gradient."""
        for p in bucket.params:
            p.grad = None
            if hasattr(p, "main_grad"):
                del p.main_grad

    def zero_grad(self) -> None:
        """After the optimizer step: no parameter keeps a gradient (the buffers are reused)."""
        for bucket in self.buckets:
            self.release(bucket)

    # -------------------------------------------------------------- reading
    def grad_shard(self, bucket: Bucket) -> torch.Tensor:
        """This rank's reduced range of a bucket's gradient (after :meth:`finish`)."""
        if self.zero_stage == 2:
            return bucket.shard_grad
        return bucket.grad[bucket.shard]

    def full_grads(self) -> dict[nn.Parameter, torch.Tensor]:
        """Every trainable parameter's whole reduced gradient, shaped like it (after :meth:`finish`;
        collective under zero_stage 2, whose ranges are all-gathered)."""
        out = {}
        for bucket in self.buckets:
            full = bucket.grad if bucket.grad is not None else gather(self.backend, bucket, bucket.shard_grad)
            out.update(zip(bucket.params, bucket.views(full)))
        return out

    def norm_runs(self, bucket: Bucket, counted_block: bool) -> list[tuple[int, int]] | None:
        """The ``[start, end)`` runs of this rank's range that count in the global gradient norm
        (None: all of it).

        Each range is one rank's, so a replicated parameter is counted once over its group;
        DualPipe's second copy of a block (``counted_block`` False) and a copy of a weight another
        block owns (``bucket.home`` False) count nothing; a balancer's
        replicated expert counts only in the slot that owns it, padding never. Kept until a
        balancer relabels its slots (a new ``slot_owned`` tensor), not rebuilt every step."""
        counted_block = counted_block and bucket.home
        key = (counted_block, *(owned_rows(p) for p in bucket.params))
        cached = bucket.norm_cache
        if cached is not None and len(cached[0]) == len(key) and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        mask = self._owned_mask(bucket, bucket.shard) if counted_block else torch.zeros(bucket.shard_size, dtype=torch.bool)
        runs = None if bool(mask.all()) else _runs(mask)
        bucket.norm_cache = (key, runs)
        return runs

    def owned_runs(self, bucket: Bucket) -> list[tuple[int, int]]:
        """The ``[start, end)`` runs of the whole bucket holding rows that own their expert
        (every row of a parameter without ``slot_owned``), adjacent runs joined; kept until a
        balancer relabels its slots, like :meth:`norm_runs`."""
        key = tuple(owned_rows(p) for p in bucket.params)
        cached = bucket.owned_cache
        if cached is not None and all(a is b for a, b in zip(cached[0], key)):
            return cached[1]
        runs = _runs(self._owned_mask(bucket, slice(0, bucket.numel)))
        bucket.owned_cache = (key, runs)
        return runs

    def _owned_mask(self, bucket: Bucket, span: slice) -> torch.Tensor:
        """Over ``span`` of the bucket, on the CPU: the elements of rows that own their expert
        (every element of a parameter without ``slot_owned``; padding none)."""
        mask = torch.zeros(span.stop - span.start, dtype=torch.bool)
        for p, start, at, n in bucket.segments(span):
            owned = owned_rows(p)
            if owned is None:
                mask[at : at + n] = True
            else:
                mask[at : at + n] = owned.cpu().repeat_interleave(p[0].numel())[start : start + n]
        return mask

    def memory(self) -> int:
        """Bytes of gradient buffers held between steps (full buffers, or shards under zero 2)."""
        if self.zero_stage == 2:
            return sum(b.shard_grad.numel() * b.shard_grad.element_size() for b in self.buckets)
        elem = torch.tensor([], dtype=self.master_dtype).element_size()
        return sum(b.numel * elem for b in self.buckets)


_DONE = object()


def _runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of True in a 1-D boolean tensor."""
    edges = torch.diff(mask.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8))
    return list(zip((edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()))


def gather(backend: Any, bucket: Bucket, part: torch.Tensor) -> torch.Tensor:
    """The whole bucket-length tensor from every group rank's range ``part`` (collective)."""
    full = part.new_empty(bucket.numel)
    if bucket.group_size == 1:
        full.copy_(part)
    else:
        backend.all_gather_into_tensor(full, part, group=bucket.group)
    return full


def _into_main_grad(p: torch.Tensor) -> None:
    """Post-accumulate hook of a parameter computing in another dtype than the master's."""
    main = getattr(p, "main_grad", None)
    if main is not None and p.grad is not None:
        main.add_(p.grad)
        p.grad = None
