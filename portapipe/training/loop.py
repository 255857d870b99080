"""One rank's training run: :class:`Trainer`'s loop reads as a step's parts, each an object of its own.

Per step: the learning rate and the batch; the schedule's forwards and backwards
(:class:`~portapipe.compose.PipelineRuntime`, which leaves the gradient of the global mean loss in
the buckets); the step's figures gathered over the ranks; the decision (apply, skip, diverge);
the update; the balancer and the hooks; the metrics row; maybe a checkpoint; maybe a stop. At
the end: the last checkpoint, the validation loss and the summary.
"""

from __future__ import annotations

import math
import signal
import time
from typing import Any

from ..checkpoint.io import Checkpointer
from ..checkpoint.run import RunPlan
from ..config import Config
from ..data import identity
from ..data.batches import Batches, global_batch_size, replica_of
from ..metrics.step import Figures, StepStats, ep_step_figures, gather_step_stats
from ..ranks import lifeline, stop
from ..scheduling.spans import COMPUTE, span
from .checkpoints import CheckpointPolicy
from .decide import Decision, PrecisionPolicy
from .hooks import Hooks, StepHook, step_hooks
from .record import StepRecorder, consumed, param_bytes, step_record
from .summary import Progress, run_summary
from .update import Update
from .validation import final_validation

Ended = tuple[str, dict[str, Any]]  # ("stopped" | "diverged", the record saying why)


class Trainer:
    """A rank's run from the run plan's start to ``train.steps``; :meth:`run` returns its summary.

    Built in this order: the optimizer (with its EMA), the data, the checkpoint (restored into
    model, optimizer, balancer and RNG), the progress it carries, the metrics. ``hooks``: more
    work per step (:class:`~portapipe.training.hooks.StepHook`), after those the config asks for.
    """

    def __init__(self, backend: Any, config: Config, groups: Any, run: RunPlan, runtime: Any, hooks: list[StepHook] | None = None) -> None:
        from ..models.routing import force_routing

        self.backend, self.config, self.groups, self.plan, self.runtime = backend, config, groups, run, runtime
        self.steps = config.train.steps
        self.update = Update(runtime, config, backend, groups.pp_rank)  # the EMA before the restore, which loads it
        self.policy = PrecisionPolicy(config)
        self.data = Batches(config)
        self.data_record = identity.record(self.data.corpus)  # the sources' identity, read once (a few blocks of each file)
        self.balancer = runtime.balancer  # eplb / lplb on the running model (portapipe.balancing.runtime)
        checkpointer = Checkpointer(run, config, backend, groups.rank, groups.world_size, runtime, self.update.optimizer, self.balancer)
        self.checkpoints = CheckpointPolicy(checkpointer, config, backend, groups.world_size, self.trainer_state)
        trainer = self.checkpoints.restore()
        runtime.check_copies()  # every copy of a shared weight (tied / MTP embedding) loaded equal
        self.progress = Progress.restored(trainer, run.mode)
        self.policy.load_state_dict(trainer.get("loss_scale", {}) if trainer else {})  # float16 resumes at its scale
        self.start = self.progress.step
        self.update.follow(run.lr_schedule_steps, run.lr_schedule)
        self.replica, self.replicas = replica_of(groups)
        force_routing(config.bench, config.model, {layer.index: layer.moe.router for layer in runtime.moe_layers()}, config.train.seed)
        self.records = StepRecorder(config, run, groups.rank, self.start)
        self.hooks = Hooks(step_hooks(config, self.balancer, groups, backend) + list(hooks or []))
        self.figures = Figures()

    # ------------------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any]:
        self._opening_lines()
        failing = True
        try:
            ended = self._loop()
            if ended is None and self.start < self.steps and (bad := self.checkpoints.at_the_end(self.steps)) is not None:
                ended = self._diverge(bad)
            last_checkpoint = self.checkpoints.wait()
            failing = False
        finally:
            self.checkpoints.close(failing)
            self.records.close_bar()
            if failing:
                self.hooks.close(failing)
                if self.update.ema is not None:
                    self.update.ema.close()
        # the hooks close after the end's validation: a recording of the last step holds it
        try:
            summary = self._summary(ended, last_checkpoint)
        except BaseException:
            self.hooks.close(failing=True)
            raise
        self.hooks.close(failing=False)
        return summary

    def _loop(self) -> Ended | None:
        for step in range(self.start, self.steps):
            self.hooks.before_step(step)
            t0 = time.perf_counter()
            lr = self.update.set_lr(step)
            with span(COMPUTE, "data"):
                batch = self.batch(step)
            result = self.runtime.step(batch)
            with span(COMPUTE, "figures"):  # the step's figures gathered over the ranks
                stats = self.gather(result)
            decision = self.policy.decide(step, result.loss, stats.grad_norm)
            if decision.kind == "diverge":  # before the optimizer applies it
                return self._diverge(decision.ends)
            coef = self.update.apply(decision.applied, stats.grad_norm, decision.scale)
            balance = self.after_update(step, result)
            row = self.record(step, lr, decision, result, stats, coef, balance, time.perf_counter() - t0)
            if decision.ends is not None:  # float16: too many skipped in a row
                return self._diverge(decision.ends)
            self.hooks.after_record(step, row)
            if (bad := self.checkpoints.after_step(step + 1, self.steps)) is not None:
                return self._diverge(bad)
            lifeline.mark_progress(last=step + 1 == self.steps)  # the launcher's watch of steps far longer than the median
            if (ended := self.maybe_stop(step + 1)) is not None:
                return ended
        return None

    # ------------------------------------------------------------------------ a step's parts
    def batch(self, step: int) -> Any:
        """This replica's micro-batches of ``step``; the runtime told which targets count
        (``data.mask_eos_loss``: the global batch's mean), the loss scale and the step."""
        config = self.config
        shape = (config.schedule.microbatches, config.train.micro_batch_size, config.model.seq_len)
        batches = self.data.microbatches(step, self.replica, self.replicas, *shape)
        self.runtime.keep_targets(self.data.kept_per_microbatch(step, self.replicas, *shape))
        self.runtime.grad_scale = self.policy.scale
        self.runtime.set_step(step)  # train.mtp_loss_weight's schedule
        return batches

    def gather(self, result: Any) -> StepStats:
        """The step's figures over the ranks (one all-gather), the gradient norm unscaled."""
        ep = ep_step_figures(self.backend, self.groups, self.runtime.moe_layers())
        stats = gather_step_stats(self.backend, self.update.local_sq_norm(), result, ep)
        stats.grad_norm /= self.policy.scale
        return stats

    def after_update(self, step: int, result: Any) -> Any:
        """The balancer (loads recorded; every ``balancer.interval`` steps maybe a new placement,
        weights migrated) and the hooks' work; the balancer's figures for the row."""
        balance = None
        if self.balancer is not None:
            with span(COMPUTE, "balancer"):
                balance = self.balancer.after_step(step, result, self.update.optimizer)
        self.hooks.after_update(step, last=step + 1 == self.steps)
        return balance

    def record(self, step: int, lr: float, decision: Decision, result: Any, stats: StepStats, coef: float, balance: Any,
               iter_s: float) -> dict[str, Any] | None:
        """The step counted in the progress and written: an applied step's metrics row (returned),
        or a skipped step's overflow line (None)."""
        self.progress.record(step + 1, float(result.loss) if decision.applied else None, int(result.tokens), iter_s)
        if not decision.applied:
            self.records.overflow(step + 1, decision.scale, self.policy.scale, self.policy.overflows)
            return None
        if step > self.start:  # the first step of a process pays one-time costs
            self.figures.add(stats)
        row = step_record(step + 1, lr, result, stats, coef, iter_s)
        ema = self.update.ema
        if ema is not None:
            row["ema_s"], row["ema_fold_s"] = ema.update_s, ema.fold_s
        if self.config.model.mtp_layers:  # the weight in force (a schedule switches it)
            from ..models.objective import mtp_weight_at

            row["mtp_loss_weight"] = mtp_weight_at(self.config.train.mtp_loss_weight, step)
        row.update(consumed(self.data.consumed(step + 1)))
        if balance is not None:
            row["balancer"] = balance
        self.records.trained(row)
        return row

    def maybe_stop(self, step: int) -> Ended | None:
        """A stop signal any rank received (agreed on every rank): the run ends after ``step``
        with a checkpoint of it."""
        sig = stop.agree(self.backend)
        if sig is None:
            return None
        path, bad = self.checkpoints.on_stop(step)
        if bad is not None:
            return self._diverge(bad)
        return "stopped", {"signal": signal.Signals(sig).name, "step": step, "checkpoint": str(path)}

    # --------------------------------------------------------------------------- the edges
    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint carries besides weights: progress, the LR schedule, the data's identity, the loss scale."""
        tc = self.config.train
        data_id = {"seed": tc.seed, "global_batch": global_batch_size(self.config), "train_tokens": self.data.n_tokens("train"), **self.data_record}
        return {"progress": self.progress.checkpoint(), "lr_schedule_steps": self.update.horizon, "lr_schedule": self.update.phases,
                "data": data_id, "loss_scale": self.policy.state_dict()}

    def _diverge(self, record: dict[str, Any]) -> Ended:
        """The run ends as diverged: the record (with the LR setting in force, to name it) in the metrics."""
        at = max(record["step"] - 1, 0)
        record = {**record, "lr_key": self.update.lr_key(at, from_config=self.config.train.lr_schedule is not None)}
        self.records.diverged(record, self.update.optimizer.lr)
        return "diverged", record

    def _opening_lines(self) -> None:
        """The memory row (each part's largest bytes per rank) and where the ranks run, then the bar."""
        from ..ranks.pinning import gather_placement

        optimizer, ema = self.update.optimizer, self.update.ema
        parts = {**optimizer.memory(), "params": param_bytes(self.runtime), "grads": self.runtime.grads.memory(),
                 "ema_host": ema.host_bytes() if ema is not None else 0}
        shown = ("params", "grads", "master", "optimizer") + (("ema_host",) if ema is not None else ())
        shown += tuple(k for k in ("master_host", "optimizer_host") if k in parts)  # train.optimizer_offload
        self.records.memory(self.backend, parts, self.start, gather_placement(self.config.launch.pin_cores), shown)
        self.records.open_bar(self.start)

    def _summary(self, ended: Ended | None, last_checkpoint: Any) -> dict[str, Any]:
        ema = self.update.ema
        validation = final_validation(self.runtime, self.data, self.config, self.groups, ema, skip=ended is not None)
        if ema is not None:
            ema.close()
        val_loss = validation["val_loss"]
        if val_loss is not None and not math.isfinite(val_loss):  # the same on every rank
            ended = self._diverge({"step": self.progress.step, "reason": f"the validation loss is {val_loss!r}"})
        metrics = self.records.metrics
        closing = {"overflows": self.policy.overflows, "metrics": str(metrics.path) if metrics is not None else None,
                   "checkpoint": str(last_checkpoint) if last_checkpoint else None}
        summary = run_summary(self.config, self.plan, self.start, self.progress, validation, consumed(self.data.consumed(self.progress.step)),
                              self.figures.medians(), closing, ended)
        self.records.close(summary)
        return summary
