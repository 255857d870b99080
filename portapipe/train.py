"""Training: the checks before launch, the launch, and each rank's run.

:func:`train` checks the config, the data and the schedule in this process (bad input fails
before any rank starts), prepares the run folder, then runs :func:`train_rank` on ``world_size``
ranks through :func:`portapipe.ranks.launch.run_ranks` and returns rank 0's summary. Each rank
builds its :class:`~portapipe.compose.PipelineRuntime`, which runs one step of the schedule and
leaves its gradient buckets holding the gradient of the global mean loss (DP / EP reduction and
DualPipe's copy summing included), and runs :class:`~portapipe.training.loop.Trainer` over it:
AdamW over master weights, sharded over the replicas with ``train.zero_stage`` 1 / 2
(:mod:`portapipe.optim`), the learning rate of ``train.lr_schedule`` or the default warm-up and
cosine (:func:`~portapipe.training.update.lr_at`), clipping by the global gradient norm, float16's
dynamic loss scale (a step whose gradients overflow is skipped and lowers the scale).

Per step, rank 0 appends one JSON line to ``<log.dir>/metrics.jsonl``: loss, learning rate,
gradient norm, tokens/s, step time, the measured pipeline bubble (the largest idle share of
the step over ranks) and the share of all-to-all time hidden behind compute (whole step and
steady-phase F&B pairs). At the end: the validation loss, a summary line in the metrics file,
and the same summary returned (the CLI prints it as one JSON line).

With ``launch.max_restarts`` the local launcher starts the ranks again after a fault
(:class:`TrainingRestarts`): the run resumes from its newest complete checkpoint as any resume
does, and a ``restart`` row in the metrics file is all it knows of it.

Checkpoints (logical, resumable on any layout; one run per folder) are in
:mod:`portapipe.checkpoint`; the loop asks for one every ``checkpoint.every`` steps (written in
the background), at the end, and when every rank agreed to stop on SIGINT / SIGTERM
(:mod:`portapipe.ranks.stop`). A non-finite loss or gradient norm ends the run at that step, before the
optimizer applies it, and writes no checkpoint of it (under float16 that is an overflow instead,
until ``train.max_skipped_steps`` in a row). Weights or AdamW state that are not finite before a
checkpoint, and a validation loss that is not finite, end it as diverged too: no run ends well
with a model it cannot use.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .checkpoint.files import CheckpointError
from .checkpoint.run import RunPlan, plan_on_ranks, prepare_run, restart_plan
from .config import Config, ConfigError, config_from_dict
from .data.corpus import data_problems
from .data.sources import DataReadError
from .metrics.log import append_row
from .metrics.tensorboard_sink import log_problems
from .ranks.local_job import LaunchError
from .ranks.restart import Fault, Restart, Restarts


def train_rank(backend: Any, config_dict: dict[str, Any], plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of a training run; returns the run's summary.

    ``plan`` (a :class:`~portapipe.checkpoint.run.RunPlan` as a dict) says what the run starts
    from; without it rank 0 makes it (and locks the run folder). Losses, tokens and step figures
    agree on every rank; rank 0's also names the files it wrote.
    """
    from .compose import PipelineRuntime
    from .training.loop import Trainer

    config = config_from_dict(config_dict)
    backend.manual_seed(config.train.seed)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    run, locks = plan_on_ranks(config, backend, groups.rank, plan)
    try:
        return Trainer(backend, config, groups, run, PipelineRuntime(config, backend, groups)).run()
    finally:
        locks.release()


# --------------------------------------------------------------------------------- launcher
def check_before_launch(config: Config) -> None:
    """Everything that can be checked without ranks or folders; raises ConfigError listing each problem.
    The model's checks are verify's too (:func:`portapipe.models.checks.model_problems`)."""
    from .metrics.wandb_sink import wandb_problems
    from .models.checks import model_problems
    from .scheduling.executor import build_schedule

    problems = (list(data_problems(config)) + model_problems(config) + log_problems(config.log.tensorboard)
                + wandb_problems(config.log.wandb) + pin_problems(config))
    try:
        build_schedule(config)  # the schedule fits pp and the micro-batches, the model splits into its blocks
    except ConfigError as err:
        problems.extend(err.problems)
    if problems:
        raise ConfigError(problems)


def pin_problems(config: Config) -> list[str]:
    """``launch.pin_cores: true`` on a machine with fewer usable cores than the job's ranks here."""
    from .ranks.launch import local_ranks
    from .ranks.pinning import plan

    try:
        plan(config.launch.pin_cores, local_ranks(config.world_size))
    except ConfigError as err:
        return err.problems
    return []


def train(config: Config, wall_timeout_s: float = 0.0) -> dict[str, Any]:
    """Check, prepare the run folder, launch ``world_size`` ranks, train; return the summary.

    Raises ConfigError for bad input (nothing started) and LaunchError for a failed rank.
    """
    from .backends.registry import check_available
    from .checkpoint.folders import Locks
    from .ranks.launch import launching_rank, rank_threads, run_ranks, under_mpirun, under_torchrun

    check_before_launch(config)
    backend = check_available(config.backend)
    plan, locks, restarts = None, Locks([]), None
    outer = under_torchrun() or under_mpirun()
    if not outer or launching_rank() == 0:
        made, locks = prepare_run(config, backend)  # the folder locked until the ranks are done
        plan = made.to_dict()
        if not outer and config.launch.max_restarts:
            restarts = TrainingRestarts(config, made)
    with locks:
        results = run_ranks(
            train_rank,
            config.world_size,
            config.to_dict(),
            plan,
            backend=backend,
            backend_options=config.backend_options,
            threads=rank_threads(config.world_size),
            pg_timeout_s=300.0,
            wall_timeout_s=wall_timeout_s,
            stall_timeout_s=config.launch.stall_timeout_s,
            stop_grace_s=config.launch.stop_grace_s,
            low_precision=config.model.dtype == "bfloat16",
            pin_cores=config.launch.pin_cores,
            restarts=restarts,
        )
    return results[0]


class TrainingRestarts(Restarts):
    """``launch.max_restarts`` for a training run: each restart resumes the run from its newest
    complete checkpoint (:func:`~portapipe.checkpoint.run.restart_plan`) and adds a ``restart`` row
    to its metrics (the step resumed from, the cause, the restarts left). What a restart cannot fix
    is not retried: a config error, a checkpoint or data file that cannot be read, a file that is
    gone. A divergence is: a loss that stops being finite once may be a fault of the hardware,
    but one that recurs at the same step after a restart is the training's own, and the run ends
    as diverged (marked ``deterministic``)."""

    #: What a restart cannot fix (by the class name a rank's failure reports), and why.
    UNRECOVERABLE = {
        ConfigError.__name__: "a config error fails every launch alike",
        CheckpointError.__name__: "the checkpoint cannot be read",
        DataReadError.__name__: "the data cannot be read",
        FileNotFoundError.__name__: "a file the run reads is gone",
    }

    def __init__(self, config: Config, first: RunPlan) -> None:
        launch = config.launch
        super().__init__(launch.max_restarts, launch.restart_window_s, launch.restart_backoff_s)
        self.config, self.first = config, first
        self.diverged_at: set[int] = set()

    def unrecoverable(self, error: LaunchError) -> str | None:
        return next((why for name, why in self.UNRECOVERABLE.items() if name in error.error_types), None)

    def fault_in(self, results: list[Any]) -> Fault | None:
        record = results[0].get("diverged")
        if record is None:
            return None
        if record["step"] in self.diverged_at:
            record["deterministic"] = True
            return None
        self.diverged_at.add(record["step"])
        figures = ", ".join(f"{k.replace('_', ' ')} {'not finite' if record[k] is None else record[k]}" for k in ("loss", "grad_norm") if k in record)
        return Fault(f"the run diverged at step {record['step']}: {record.get('reason') or figures}")

    def resume(self, restart: Restart) -> tuple[tuple[Any, ...], int]:
        try:
            plan = restart_plan(self.config, self.first, restart.number)
        except CheckpointError as exc:
            raise LaunchError(f"{restart.fault.line}; cannot restart: {exc}") from None
        append_row(Path(self.config.log.dir), {"kind": "restart", "step": plan.step, "restart": restart.number, "restarts_left": restart.left,
                                               "cause": restart.fault.line, "time": time.time()})
        return (self.config.to_dict(), plan.to_dict()), plan.step
