"""The update of a step: its learning rate, the clipping factor, AdamW over master weights, the EMA."""

from __future__ import annotations

import math
from typing import Any

import torch

from ..config import Config, TrainConfig
from ..optim import lr_schedule
from ..scheduling.spans import COMPUTE, span


def lr_at(step: int, train: TrainConfig, horizon: int | None, phases: list[dict[str, Any]] | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based) (:mod:`portapipe.optim.lr_schedule`).

    ``phases`` (``train.lr_schedule``'s, as dicts, or a checkpoint's) when the run has them; else
    the default: a linear warm-up over ``warmup_steps`` (step 0 gets lr/warmup_steps, step
    warmup-1 the full lr), then, with ``horizon`` None (``train.lr_schedule_steps`` unset), ``lr``
    for good: the schedule does not depend on ``train.steps``, so a run extended by a resume
    trains exactly as one that was asked for all its steps at once. With a ``horizon``, a half
    cosine from ``lr`` at the first step after warm-up to ``min_lr`` at step ``horizon``
    (1-based), ``min_lr`` after it.
    """
    return lr_schedule.lr_at(step, _phases(train, horizon, phases), train.lr)


def _phases(train: TrainConfig, horizon: int | None, phases: list[dict[str, Any]] | None) -> tuple[lr_schedule.Phase, ...]:
    if phases is not None:
        return lr_schedule.resolve(phases, train.lr)
    return lr_schedule.default_phases(train.lr, train.min_lr, train.warmup_steps, horizon)


def lr_key(step: int, train: TrainConfig, horizon: int | None, phases: list[dict[str, Any]] | None, from_config: bool) -> str:
    """The setting that gives step ``step`` its learning rate, for a person to change: ``train.lr``
    (the default's warm-up, plateau and cosine), ``train.min_lr`` (past the cosine's end), or the phase
    of ``train.lr_schedule`` in force (``from_config`` False: the phases a resumed or loaded run kept
    from its checkpoint, which ``train.lr_schedule`` replaces)."""
    if phases is None:
        return "train.min_lr" if horizon is not None and step >= horizon else "train.lr"
    resolved = lr_schedule.resolve(phases, train.lr)
    if not resolved:
        return "train.lr"
    i = lr_schedule.phase_index(step, resolved)
    where = f"train.lr_schedule[{i}].lr" if from_config else f"phase {i} of the LR schedule kept from the checkpoint (train.lr_schedule replaces it)"
    return f"{where} ({resolved[i].kind} to {resolved[i].lr:g})"


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor the gradients are scaled by: 1 unless the global norm exceeds ``max_norm`` (> 0)."""
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)


def counted_blocks(schedule: Any, pp_rank: int) -> set[int]:
    """The blocks whose gradients this pipeline rank counts in the global norm: each block once
    over the world, by the rank of its first virtual stage (DualPipe holds a block twice)."""
    owner: dict[int, int] = {}
    for v, block in enumerate(schedule.stage_block):
        owner.setdefault(block, schedule.stage_rank[v])
    return {b for b, r in owner.items() if r == pp_rank}


def make_sharded_optimizer(runtime: Any, config: Config, backend: Any) -> Any:
    """AdamW with master weights over the runtime's gradient buckets (``train.zero_stage``), its
    states partly in host memory under ``train.optimizer_offload``."""
    from ..models.moe import DTYPES
    from ..optim.precision import moments_dtype
    from ..optim.sharded import ShardedAdamW

    t, m = config.train, config.model
    optimizer = ShardedAdamW(runtime.grads, model_dtype=DTYPES[m.dtype], zero_stage=t.zero_stage, betas=t.betas,
                             weight_decay=t.weight_decay, backend=backend, moments_dtype=DTYPES[moments_dtype(m.dtype, t.master_dtype, t.moments_dtype)])
    if t.optimizer_offload == "swap":  # the states of optimizer_offload_fraction of the buckets in host memory
        from ..optim.offload import HostStates

        optimizer.host = HostStates(optimizer, t.optimizer_offload_fraction, backend)
    return optimizer


class Update:
    """AdamW (and the EMA, ``train.ema_decay``) over this rank's gradient buckets, with the run's LR
    schedule (``horizon`` / ``phases``: the run plan's) and clipping by the global norm.

    The EMA is attached before a checkpoint is restored, which loads a checkpoint's EMA into it.
    """

    def __init__(self, runtime: Any, config: Config, backend: Any, pp_rank: int) -> None:
        self.runtime, self.train = runtime, config.train
        self.optimizer = make_sharded_optimizer(runtime, config, backend)
        if self.train.ema_decay is not None:
            from ..optim.ema import HostEMA

            self.optimizer.ema = HostEMA(self.optimizer, self.train.ema_decay, backend)
        self.counted = counted_blocks(runtime.schedule, pp_rank)
        self.horizon: int | None = None
        self.phases: list[dict[str, Any]] | None = None

    @property
    def ema(self) -> Any:
        return self.optimizer.ema

    def follow(self, horizon: int | None, phases: list[dict[str, Any]] | None) -> None:
        """The LR schedule the run plan settled (``train.lr_schedule_steps`` / phases, or the checkpoint's)."""
        self.horizon, self.phases = horizon, phases

    def set_lr(self, step: int) -> float:
        self.optimizer.lr = lr_at(step, self.train, self.horizon, self.phases)
        return self.optimizer.lr

    def lr_key(self, step: int, from_config: bool) -> str:
        return lr_key(step, self.train, self.horizon, self.phases, from_config)

    def local_sq_norm(self) -> float:
        """This rank's share of the squared global gradient norm (the blocks it counts)."""
        return float(self.optimizer.local_sq_norm(self.counted))

    def apply(self, applied: bool, grad_norm: float, scale: float) -> float:
        """The step's update when ``applied`` (the gradients unscaled by the loss ``scale`` and clipped),
        then the gradients zeroed for the next step; the clipping factor used (1 for a skipped step)."""
        coef = clip_coefficient(grad_norm, self.train.grad_clip) if applied else 1.0
        if applied:
            with torch.no_grad(), span(COMPUTE, "optimizer"):
                self.optimizer.step(coef / scale)
            if self.ema is not None:
                with span(COMPUTE, "EMA"):
                    self.ema.update()  # the weights copied out, folded in while the next step runs
        self.runtime.grads.zero_grad()
        return coef
