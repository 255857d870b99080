"""Whether a step's update is applied: float16's skipped steps and the divergence that ends a run.

A step whose loss or gradient norm is not finite ends the run there, before the optimizer
applies it, except under float16, where it is an overflow: the step is skipped and the loss
scale halved, until ``train.max_skipped_steps`` steps in a row were skipped, which ends the run
too. The figures decided on are the same on every rank (gathered), so every rank decides alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..config import Config
from ..optim.precision import LossScaler


@dataclass(frozen=True)
class Decision:
    """What becomes of one step: ``kind`` "apply" (the optimizer updates with it), "skip" (float16's
    overflow: nothing applied, the step still counted and recorded) or "diverge" (nothing of it
    applied or recorded); ``ends``: the run ends at this step, with the record saying why (a
    divergence, or a skip that made ``train.max_skipped_steps`` in a row)."""

    kind: str
    scale: float  # the loss scale the step's gradients were computed at
    ends: dict[str, Any] | None = None

    @property
    def applied(self) -> bool:
        return self.kind == "apply"


class PrecisionPolicy:
    """float16's dynamic loss scale (:class:`~portapipe.optim.precision.LossScaler`) and the rule
    above; checkpoints carry its state (:meth:`state_dict`), so a resumed run goes on at its scale."""

    def __init__(self, config: Config) -> None:
        tc = config.train
        self.scaler = LossScaler(config.model.dtype == "float16", growth_interval=tc.loss_scale_growth_interval)
        self.max_skipped = tc.max_skipped_steps

    @property
    def scale(self) -> float:
        """The loss scale the next step's gradients are computed at (1 unless float16)."""
        return self.scaler.scale

    @property
    def overflows(self) -> int:
        return self.scaler.overflows

    def decide(self, step: int, loss: float, grad_norm: float) -> Decision:
        """For (0-based) step ``step``, whose gradients were computed at :attr:`scale`."""
        scale = self.scaler.scale
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if self.scaler.enabled and not self.scaler.update(finite):
            if self.scaler.in_a_row >= self.max_skipped:
                return Decision("skip", scale, {"step": step + 1, "reason": (
                    f"{self.scaler.in_a_row} steps in a row overflowed in float16 (train.max_skipped_steps {self.max_skipped}), "
                    f"the last at loss scale {scale:g}; none of them was applied")})
            return Decision("skip", scale)
        if not finite:
            return Decision("diverge", scale, {"step": step + 1, "loss": float(loss), "grad_norm": float(grad_norm)})  # null where not finite
        return Decision("apply", scale)

    def state_dict(self) -> dict[str, float]:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scaler.load_state_dict(state)
