"""AdamW over gradient buckets: master weights, ZeRO shards, the step and the parameters' update.

:class:`ShardedAdamW` keeps, per bucket of :class:`~.buckets.GradBuckets`, AdamW's two moments
(in ``train.moments_dtype``) and the master weights (in the master dtype): the whole bucket with ``zero_stage`` 0, this rank's
equal range of it with 1 and 2 (Megatron-Core's distributed optimizer: a shared parameter's
bucket splits over the dp x ep replicas, an expert's over dp). A step updates what the rank
holds from its range of the reduced gradient, then the parameters are refreshed: copied (cast to
the model dtype) from the master, or, sharded, all-gathered from every rank's updated range.
When the model computes in the master dtype the parameters are the master weights (no copy
kept: a rank steps its range of them in place). Moments stored in another dtype than the master
weights are widened to the more precise of the two for the update, piece by piece
(:func:`~.adamw.adamw_`).

The global gradient norm is summed from every rank's range (:meth:`ShardedAdamW.local_sq_norm`),
so it equals the unsharded norm whatever the stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .adamw import adamw_
from .buckets import Bucket, GradBuckets, gather

MOMENTS = ("exp_avg", "exp_avg_sq")


class _State:
    """What the optimizer holds for one bucket (full length, or this rank's range)."""

    def __init__(self, bucket: Bucket, span: slice, master: torch.Tensor | None, moments: torch.dtype, device: torch.device) -> None:
        n = span.stop - span.start
        self.span = span
        self.master = master
        self.exp_avg = torch.zeros(n, dtype=moments, device=device)
        self.exp_avg_sq = torch.zeros(n, dtype=moments, device=device)
        # weight decay on matrices only: their (start, end) within the span
        self.decayed = []
        for p, o in zip(bucket.params, bucket.offsets):
            a, b = max(span.start, o), min(span.stop, o + p.numel())
            if p.dim() >= 2 and a < b:
                self.decayed.append((a - span.start, b - span.start))


class _InPlace(dict):
    """A parameter's optimizer state as a balancer migration sees it: replacing an entry writes
    the new rows into the optimizer's own buffer."""

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if key in self:
            self[key].copy_(value)
        else:
            super().__setitem__(key, value)


#: elements of a gradient squared and summed at a time for the norm (a float64 piece of 2 MiB)
NORM_PIECE = 1 << 18


class ShardedAdamW:
    """AdamW with master weights over a rank's gradient buckets (see the module docstring).

    ``lr`` is the learning rate the next :meth:`step` uses (the training loop sets it);
    ``steps`` the updates applied so far. ``moments_dtype``: the moments' dtype (default: the
    master dtype).
    """

    def __init__(
        self,
        grads: GradBuckets,
        *,
        model_dtype: torch.dtype,
        zero_stage: int,
        betas: tuple[float, float],
        weight_decay: float,
        backend: Any,
        moments_dtype: torch.dtype | None = None,
    ) -> None:
        from .precision import update_dtype

        self.grads, self.backend = grads, backend
        self.model_dtype, self.master_dtype = model_dtype, grads.master_dtype
        self.moments_dtype = self.master_dtype if moments_dtype is None else moments_dtype
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        self.compute_dtype = getattr(torch, update_dtype(name(self.master_dtype), name(self.moments_dtype)))
        self.zero_stage = zero_stage
        self.betas, self.weight_decay = betas, weight_decay
        self.lr = 0.0
        self.steps = 0
        #: a separate copy of the weights in the master dtype (else the parameters are it)
        self.has_master = self.master_dtype != model_dtype
        #: the host EMA of the weights (:class:`~.ema.HostEMA`, ``train.ema_decay``), or None
        self.ema: Any = None
        #: the states kept in host memory (:class:`~.offload.HostStates`, ``train.optimizer_offload``), or None
        self.host: Any = None
        self.states: list[_State] = []
        for bucket in grads.buckets:
            span = bucket.shard if zero_stage > 0 else slice(0, bucket.numel)
            master = None
            if self.has_master:
                full = torch.zeros(bucket.numel, dtype=self.master_dtype, device=grads.device)
                for p, view in zip(bucket.params, bucket.views(full)):
                    view.copy_(p.detach())
                master = full[span].clone() if zero_stage > 0 else full
            self.states.append(_State(bucket, span, master, self.moments_dtype, grads.device))

    # ------------------------------------------------------------------ step
    def local_sq_norm(self, counted_blocks: set[int]) -> torch.Tensor:
        """Sum of squares (float64) of this rank's ranges of the reduced gradients, counted once
        over the world (see :meth:`GradBuckets.norm_runs`); summed over ranks: the global norm²."""
        total = torch.zeros((), dtype=torch.float64, device=self.grads.device)
        for bucket in self.grads.buckets:
            g = self.grads.grad_shard(bucket)
            runs = self.grads.norm_runs(bucket, bucket.block in counted_blocks)
            for start, end in [(0, g.numel())] if runs is None else runs:
                # in pieces: a float64 copy of a whole bucket would leave the caches for memory
                for at in range(start, end, NORM_PIECE):
                    total += g[at:min(at + NORM_PIECE, end)].double().pow(2).sum()
        return total

    def step(self, grad_coef: float = 1.0) -> None:
        """One AdamW update at ``self.lr`` from the reduced gradients times ``grad_coef`` (clipping,
        loss-scale removal), then the parameters refreshed (collective under zero_stage 1 / 2).
        States kept in host memory (``host``) come to the device bucket by bucket for their update
        and go back after it (:mod:`.offload`)."""
        self.steps += 1
        hp = {"step": self.steps, "lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay, "compute": self.compute_dtype}
        taken: dict[int, torch.Tensor | None] = {}  # an offloaded bucket's weights for the refresh, taken while on the device
        with self.host.swapping() if self.host is not None else contextlib.nullcontext() as trips:
            for i, (bucket, st) in enumerate(zip(self.grads.buckets, self.states)):
                held = trips.bring(i) if trips is not None and self.host.offloaded[i] else st
                g = self.grads.grad_shard(bucket) if self.zero_stage > 0 else bucket.grad
                if grad_coef != 1.0:
                    g = g * grad_coef
                if held.master is not None:
                    adamw_(held.master, g, held.exp_avg, held.exp_avg_sq, decayed=st.decayed, **hp)
                else:
                    for p, start, at, n in bucket.segments(st.span):  # the parameters are the master weights
                        sl = slice(at, at + n)
                        adamw_(p.detach().view(-1)[start : start + n], g[sl], held.exp_avg[sl], held.exp_avg_sq[sl],
                               decayed=[(0, n)] if p.dim() >= 2 else [], **hp)
                if held is not st:
                    if held.master is not None:
                        taken[id(st)] = self._take(bucket, held.master)
                    trips.send_back(i, held)
        self._refresh(taken)

    def _take(self, bucket: Bucket, master: torch.Tensor) -> torch.Tensor | None:
        """What the refresh needs of a bucket's updated master weights before they leave the device:
        under zero_stage 0 the parameters are copied from them now (None: nothing left to do);
        sharded, this rank's range in the model dtype (its own tensor: the slot is reused)."""
        if self.zero_stage == 0:
            for p, view in zip(bucket.params, bucket.views(master)):
                p.detach().copy_(view)
            return None
        return master.to(self.model_dtype, copy=True)

    def finite(self) -> bool:
        """Whether every parameter, master weight and moment this rank holds is finite (local)."""
        for bucket, st in zip(self.grads.buckets, self.states):
            for t in (*bucket.params, st.master, st.exp_avg, st.exp_avg_sq):
                if t is not None and not bool(torch.isfinite(t).all()):
                    return False
        return True

    def _refresh(self, taken: dict[int, torch.Tensor | None] | None = None) -> None:
        """The parameters from the master weights: copied, or all-gathered from the shards;
        ``taken``: by state, an offloaded bucket's weights as :meth:`_take` left them."""
        if self.zero_stage == 0 and not self.has_master:
            return
        taken = taken or {}
        self.refresh(lambda st: taken[id(st)] if id(st) in taken else st.master)

    def refresh(self, source: Any) -> None:
        """The parameters from ``source(state)`` (this rank's range of a bucket's weights, or None:
        the parameters' own; any dtype and device): copied, or all-gathered from the shards under
        zero_stage 1 / 2 (collective)."""
        if self.zero_stage == 0:
            for bucket, st in zip(self.grads.buckets, self.states):
                if (weights := source(st)) is not None:
                    for p, view in zip(bucket.params, bucket.views(weights)):
                        p.detach().copy_(view)
            return
        pending = []
        for bucket, st in zip(self.grads.buckets, self.states):
            full = torch.empty(bucket.numel, dtype=self.model_dtype, device=self.grads.device)
            weights = source(st)
            mine = weights.to(self.grads.device, self.model_dtype) if weights is not None else self._own_range(bucket, st)
            if bucket.group_size == 1:
                full.copy_(mine)
                pending.append((bucket, full, None))
            else:
                pending.append((bucket, full, self.backend.all_gather_into_tensor(full, mine, group=bucket.group, async_op=True)))
        for bucket, full, work in pending:
            if work is not None:
                work.wait()
            for p, view in zip(bucket.params, bucket.views(full)):
                p.detach().copy_(view)

    def _own_range(self, bucket: Bucket, st: _State) -> torch.Tensor:
        """This rank's range of a bucket's parameters, flat (padding zero)."""
        mine = torch.zeros(st.span.stop - st.span.start, dtype=self.model_dtype, device=self.grads.device)
        for p, start, at, n in bucket.segments(st.span):
            mine[at : at + n] = p.detach().reshape(-1)[start : start + n]
        return mine

    # ------------------------------------------------------------- state out
    @property
    def state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Per parameter, its moments (and master weights) shaped like it: what an EPLB migration
        moves with an expert's rows. Only whole buckets (zero_stage 0) can be seen this way."""
        if self.zero_stage > 0:
            raise RuntimeError("zero_stage 1 / 2 shard the optimizer state; a parameter's state is split over the replicas")
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for bucket, st in zip(self.grads.buckets, self.states):
            entry = {kind: bucket.views(getattr(st, kind)) for kind in MOMENTS}
            if st.master is not None:
                entry["master"] = bucket.views(st.master)
            for i, p in enumerate(bucket.params):
                out[p] = _InPlace({kind: views[i] for kind, views in entry.items()})
        return out

    def full_state(self) -> Iterator[tuple[nn.Parameter, dict[str, torch.Tensor]]]:
        """Every parameter's whole moments (and master weights, when kept), shaped like it
        (collective under zero_stage 1 / 2: every rank's ranges are gathered); the host EMA's too,
        once its fold in flight is done."""
        if self.ema is not None:
            self.ema.wait()
        for bucket, st in zip(self.grads.buckets, self.states):
            full = {kind: self._whole(bucket, getattr(st, kind)) for kind in self._kinds(st)}
            for i, p in enumerate(bucket.params):
                yield p, {kind: bucket.views(t)[i] for kind, t in full.items()}

    def _kinds(self, st: _State) -> list[str]:
        """What this rank holds per bucket: the moments, the master weights when kept apart, the
        host EMA of the weights when one is kept (``ema``, set by :class:`~.ema.HostEMA`)."""
        return list(MOMENTS) + (["master"] if st.master is not None else []) + (["ema"] if getattr(st, "ema", None) is not None else [])

    def _whole(self, bucket: Bucket, part: torch.Tensor) -> torch.Tensor:
        if self.zero_stage == 0:
            return part
        if part.device != self.grads.device:  # the host EMA: gathered through the device, one bucket at a time
            return gather(self.backend, bucket, part.to(self.grads.device)).to(part.device)
        return gather(self.backend, bucket, part)

    def load_full_state(self, loaded: dict[nn.Parameter, dict[str, torch.Tensor]], steps: int) -> None:
        """Put whole per-parameter tensors (as :meth:`full_state` gives; ``master`` and ``ema``
        optional: the parameters stand for them) into what this rank holds."""
        self.steps = steps
        for bucket, st in zip(self.grads.buckets, self.states):
            for kind in self._kinds(st):
                target = getattr(st, kind)
                for p, o in zip(bucket.params, bucket.offsets):
                    entry = loaded.get(p)
                    if entry is None:
                        continue
                    fallback = {"master": p.detach(), "ema": entry.get("master", p.detach())}  # a checkpoint without them
                    src = entry.get(kind, fallback.get(kind))
                    if src is None:
                        continue
                    a, b = max(st.span.start, o), min(st.span.stop, o + p.numel())
                    if a < b:
                        target[a - st.span.start : b - st.span.start].copy_(src.reshape(-1)[a - o : b - o])

    def state_dict(self) -> dict[str, Any]:
        """What this rank holds, as it is (not logical: for a save and load on the same layout)."""
        return {"steps": self.steps, "lr": self.lr, "buckets": [
            {"exp_avg": st.exp_avg, "exp_avg_sq": st.exp_avg_sq, **({"master": st.master} if st.master is not None else {})}
            for st in self.states]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["buckets"]) != len(self.states):
            raise ValueError(f"optimizer state of {len(state['buckets'])} buckets; this rank has {len(self.states)}")
        self.steps, self.lr = int(state["steps"]), float(state["lr"])
        for st, saved in zip(self.states, state["buckets"]):
            for kind, t in saved.items():
                getattr(st, kind).copy_(t)

    # ---------------------------------------------------------------- memory
    def memory(self) -> dict[str, int]:
        """Bytes this rank holds on the device: ``master`` weights and ``optimizer`` state (AdamW's
        moments); with states in host memory (``train.optimizer_offload``) also ``master_host`` and
        ``optimizer_host``, and ``optimizer_slots``: the two buckets' worth the step brings to the device."""
        def size(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        out = {"master": 0, "optimizer": 0}
        away = self.host.offloaded if self.host is not None else [False] * len(self.states)
        for st, host in zip(self.states, away):
            suffix = "_host" if host else ""
            out["master" + suffix] = out.get("master" + suffix, 0) + size(st.master)
            out["optimizer" + suffix] = out.get("optimizer" + suffix, 0) + size(st.exp_avg) + size(st.exp_avg_sq)
        if self.host is not None:
            out.setdefault("master_host", 0)
            out.setdefault("optimizer_host", 0)
            out["optimizer_slots"] = min(2, sum(away)) * self.host.slot_bytes
        return out
