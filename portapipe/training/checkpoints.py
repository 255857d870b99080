"""When the loop checkpoints, and that no checkpoint holds what cannot be trained on.

Every ``checkpoint.every`` steps (written in the background while training goes on), when every
rank agreed to stop on SIGINT / SIGTERM (waited for), and at the end (``checkpoint.at_end``).
Before each, the weights, router biases, AdamW state and a balancer's loads are checked finite on
every rank: a run whose state stopped being finite ends as diverged, naming the first such
tensor, and writes no checkpoint of it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.io import Checkpointer
from ..checkpoint.state import first_nonfinite
from ..metrics.step import everywhere
from ..ranks import lifeline
from ..scheduling.spans import COMPUTE, span


class CheckpointPolicy:
    """The run's :class:`~portapipe.checkpoint.io.Checkpointer` and the rules above.

    ``trainer_state`` gives what a checkpoint carries besides weights (progress, LR schedule, data
    identity, loss scale), read at each save.
    """

    def __init__(self, checkpointer: Checkpointer, config: Any, backend: Any, world_size: int,
                 trainer_state: Callable[[], dict[str, Any]]) -> None:
        self.ckpt, self.backend, self.world_size = checkpointer, backend, world_size
        self.every, self.at_end = config.checkpoint.every, config.checkpoint.at_end
        self.trainer_state = trainer_state
        plan = checkpointer.plan
        self.saved_at: int | None = plan.step if plan.mode == "resume" else None  # the step the newest checkpoint of this run holds

    def restore(self) -> dict[str, Any] | None:
        """The run plan's checkpoint into model, optimizer, balancer and RNG; its trainer record."""
        return self.ckpt.restore()

    def unsaveable(self, at: int) -> dict[str, Any] | None:
        """Before a checkpoint of step ``at`` (collective): the divergence record when anything a
        checkpoint saves stopped being finite on any rank, named; None when all is finite."""
        c = self.ckpt
        bad = first_nonfinite(c.runtime, c.optimizer, c.balancer)
        if everywhere(self.backend, bad is None):
            return None
        names: list[Any] = [None] * self.world_size
        torch.distributed.all_gather_object(names, bad)
        name = next(n for n in names if n is not None)
        return {"step": at, "reason": f"{name} is not finite after the update of step {at}; no checkpoint was written of it"}

    def after_step(self, step: int, steps: int) -> dict[str, Any] | None:
        """After (1-based) step ``step`` of ``steps``: a failed save in the background stops the run
        here; every ``checkpoint.every`` steps (not the last: the end writes that) a save starts in
        the background. The divergence record when the state may not be saved."""
        self.ckpt.poll()
        if not (self.every and step % self.every == 0 and step < steps):
            return None
        if (bad := self.unsaveable(step)) is not None:
            return bad
        with lifeline.untimed(), span(COMPUTE, "checkpoint"):  # may wait for the previous save: not a slow step
            self.ckpt.save_training(step, self.trainer_state(), wait=False)  # written while training goes on
        self.saved_at = step
        return None

    def on_stop(self, step: int) -> tuple[Path | None, dict[str, Any] | None]:
        """A stop agreed after step ``step``: (its checkpoint, written or waited for, None) or (None,
        the divergence record) when the state may not be saved."""
        if self.saved_at == step:
            return self.ckpt.wait(), None
        if (bad := self.unsaveable(step)) is not None:
            return None, bad
        with span(COMPUTE, "checkpoint"):
            return self.ckpt.save_training(step, self.trainer_state()), None

    def at_the_end(self, steps: int) -> dict[str, Any] | None:
        """The run trained to ``steps``: its state checked, and saved with ``checkpoint.at_end``."""
        if (bad := self.unsaveable(steps)) is not None:
            return bad
        if self.at_end:
            with span(COMPUTE, "checkpoint"):
                self.ckpt.save_training(steps, self.trainer_state())
        return None

    def wait(self) -> Path | None:
        """The newest checkpoint written, once any save in the background is done."""
        return self.ckpt.wait()

    def close(self, failing: bool) -> None:
        self.ckpt.close(failing=failing)
