"""The metrics of ``metrics.jsonl`` as a Weights & Biases run (``log.wandb``, extra ``wandb``).

Rank 0 logs the numbers of each metrics line as TensorBoard gets them (the same tags, from
:func:`portapipe.metrics.tensorboard_sink.scalars`: ``train/loss``, ``train/lr``, ..., ``balancer/...``,
``val/loss``) at the line's step, to a W&B run whose id and name are the run id, with the config
as the run's config. ``mode: offline`` writes the run into ``<log.dir>/wandb/`` without a
network (``wandb sync`` sends it later); ``online`` needs ``wandb login``. A resumed run continues
the same W&B run (W&B keeps a run's history append-only: steps an interrupted run logged past
its checkpoint keep their first values there; ``metrics.jsonl`` stays the source of truth).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from .tensorboard_sink import scalars

EXTRA = "pip install 'portapipe[wandb]'"


def wandb_problems(settings: Any) -> list[str]:
    """What stops ``log.wandb`` from working here (checked before any rank starts): the package, and
    for ``online`` a login (``wandb login``'s key, or ``WANDB_API_KEY``), looked up without the network."""
    if settings.mode == "off":
        return []
    try:
        import wandb
    except ImportError:
        return [f"log.wandb.mode: {settings.mode} needs the wandb package: {EXTRA}"]
    if settings.mode == "online" and not _logged_in(wandb):
        return ["log.wandb.mode: online needs a W&B login and none is configured here: run `wandb login` (or set WANDB_API_KEY), "
                "or use log.wandb.mode: offline, which writes the run into <log.dir>/wandb/ for `wandb sync` later"]
    return []


def _logged_in(wandb: Any) -> bool:
    """Whether wandb finds credentials (environment, netrc, its settings), never prompting; its own
    lines about where it found them stay out of portapipe's output."""
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        try:
            return bool(wandb.login(verify=False, prompt=False))
        except TypeError:  # a wandb without ``prompt``: it raises UsageError where it would have to ask
            try:
                return bool(wandb.login(verify=False))
            except wandb.errors.UsageError:
                return False


class WandbLog:
    """Rank 0's W&B run for one portapipe run: a sink of :class:`~portapipe.metrics.log.MetricsLog`."""

    def __init__(self, log_dir: Path, run_id: str, settings: Any, config: dict[str, Any]) -> None:
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=settings.project, entity=settings.entity, mode=settings.mode, id=run_id, name=run_id, dir=str(log_dir),
            resume="allow", config=config,
            # stdout / stderr stay portapipe's: no console capture, no banner
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, record: dict[str, Any]) -> None:
        found = scalars(record)
        if found is not None:
            step, values = found
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()
