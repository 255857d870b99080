"""The training loop: data, optimizer, LR schedule, clipping, metrics, checkpoints, balancer hook.

:func:`train` checks the config, the data and the schedule in this process (bad input fails
before any rank starts), then runs :func:`train_rank` on ``world_size`` ranks through
:func:`portapipe.ranks.launch.run_ranks` and returns rank 0's summary. Each rank builds its
:class:`~portapipe.compose.PipelineRuntime`, which runs one step of the schedule and
leaves its gradient buckets holding the gradient of the global mean loss (DP / EP
reduction and DualPipe's copy summing included); this loop adds AdamW over master weights,
sharded over the replicas with ``train.zero_stage`` 1 / 2 (:mod:`portapipe.optim`), with a
warm-up, then a constant learning rate or a cosine to ``train.lr_schedule_steps``, or the
phases of ``train.lr_schedule`` (:func:`lr_at`), and clipping by the global gradient norm. With ``model.dtype: float16`` the
loss is scaled dynamically: a step whose gradients overflow is skipped and lowers the scale
(one line on stderr, a ``overflow`` row in the metrics, the count in the summary).

Per step, rank 0 appends one JSON line to ``<log.dir>/metrics.jsonl``: loss, learning rate,
gradient norm, tokens/s, step time, the measured pipeline bubble (the largest idle share of
the step over ranks) and the share of all-to-all time hidden behind compute (whole step and
steady-phase F&B pairs). At the end: the validation loss, a summary line in the metrics file,
and the same summary returned (the CLI prints it as one JSON line).

Checkpoints (logical, resumable on any layout; one run per folder) are in
:mod:`portapipe.checkpoint`; this loop asks for one every ``checkpoint.every`` steps (written in
the background), at the end, and when every rank agreed to stop on SIGINT / SIGTERM
(:mod:`portapipe.ranks.stop`). A non-finite loss or gradient norm ends the run at that step, before the
optimizer applies it, and writes no checkpoint of it (under float16 that is an overflow instead,
until ``train.max_skipped_steps`` in a row). Weights or AdamW state that are not finite before a
checkpoint, and a validation loss that is not finite, end it as diverged too: no run ends well
with a model it cannot use.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .ranks import lifeline, stop
from .checkpoint.files import atomic_write
from .checkpoint.run import RunPlan, plan_on_ranks, prepare_run, say_stderr
from .config import Config, ConfigError, TrainConfig, config_from_dict
from .data import identity
from .data.batches import Batches, global_batch_size, replica_of
from .data.corpus import data_problems
from .metrics import Figures, MetricsLog, Progress, StepStats, everywhere, gather_step_stats, memory_record, percent, strict
from .metrics_tb import log_problems
from .optim.precision import LossScaler

VAL_BATCHES = 4  # validation steps' worth of micro-batches evaluated at the end


# ----------------------------------------------------------------------------- learning rate
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
    from .optim import lr_schedule

    if phases is not None:
        return lr_schedule.lr_at(step, lr_schedule.resolve(phases, train.lr), train.lr)
    return lr_schedule.lr_at(step, lr_schedule.default_phases(train.lr, train.min_lr, train.warmup_steps, horizon), train.lr)


# ------------------------------------------------------------------------------- optimizer
def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor the gradients are scaled by: 1 unless the global norm exceeds ``max_norm`` (> 0)."""
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)


# ------------------------------------------------------------------------------ rank helpers
def counted_blocks(schedule: Any, pp_rank: int) -> set[int]:
    """The blocks whose gradients this pipeline rank counts in the global norm: each block once
    over the world, by the rank of its first virtual stage (DualPipe holds a block twice)."""
    owner: dict[int, int] = {}
    for v, block in enumerate(schedule.stage_block):
        owner.setdefault(block, schedule.stage_rank[v])
    return {b for b, r in owner.items() if r == pp_rank}


def param_bytes(runtime: Any) -> int:
    """Bytes of this rank's parameters (both DualPipe copies of a block count: both are held; a
    weight two of its blocks hold as one tensor counts once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in runtime.parameters()}.values())


def make_sharded_optimizer(runtime: Any, config: Config, backend: Any) -> Any:
    """AdamW with master weights over the runtime's gradient buckets (``train.zero_stage``)."""
    from .models.moe import DTYPES
    from .optim.sharded import ShardedAdamW

    from .optim.precision import moments_dtype

    t, m = config.train, config.model
    return ShardedAdamW(runtime.grads, model_dtype=DTYPES[m.dtype], zero_stage=t.zero_stage, betas=t.betas,
                        weight_decay=t.weight_decay, backend=backend, moments_dtype=DTYPES[moments_dtype(m.dtype, t.master_dtype, t.moments_dtype)])


def validation_loss(runtime: Any, data: Batches, config: Config, groups: Any) -> tuple[float | None, dict[str, float]]:
    """(mean loss over the validation sources, weighted as they are, each source's loss): each
    source's over ``VAL_BATCHES`` steps of its own validation data, on the model as training left
    it; nothing is changed. It is the main next-token loss (the objective's other terms apart), so
    runs with and without multi-token prediction or the balance loss compare.

    Each batch runs the schedule's forwards alone (:meth:`~portapipe.scheduling.executor.PipelineExecutor.evaluate`:
    no backward, no gradients). What the forwards leave in the model (the routers' expert counts,
    the balancer's and expert clocks' figures, the RNG) is undone after each batch
    (:meth:`~portapipe.compose.PipelineRuntime.unchanged`), so evaluating never changes training.
    """
    parts = data.parts("val")
    if not parts or any(p.tokens < config.model.seq_len + 1 for p in parts):
        return None, {}
    replica, replicas = replica_of(groups)
    by_source: dict[str, float] = {}
    for source, (part, name) in enumerate(zip(parts, data.names["val"])):
        losses = []
        for i in range(VAL_BATCHES):
            shape = (config.schedule.microbatches, config.train.micro_batch_size, config.model.seq_len)
            batches = data.microbatches(i, replica, replicas, *shape, split="val", source=source)
            runtime.keep_targets(data.kept_per_microbatch(i, replicas, *shape, split="val", source=source))
            with runtime.unchanged():
                losses.append(float(runtime.evaluate(batches).loss))
        by_source[name] = sum(losses) / len(losses)
    total = sum(p.weight for p in parts)
    return sum(p.weight / total * loss for p, loss in zip(parts, by_source.values())), by_source


class BalancerHook:
    """balancer.kind: eplb: write the recorded expert loads out for planning.

    The balancer records each step's per-expert loads (this pipeline rank's MoE layers, summed
    over the EP and DP groups) in its window of ``balancer.window`` steps, which checkpoints carry.
    Every ``balancer.interval`` steps and at the end, the window's loads of all layers are
    gathered to rank 0 and written to ``<log.dir>/expert_loads.json`` (``{"step", "window",
    "layers", "loads", "phy2log"}``: the placement in force when written, so the file serves
    ``portapipe balance`` as both ``--loads`` and ``--current``).
    """

    FILE = "expert_loads.json"

    def __init__(self, config: Config, balancer: Any, groups: Any) -> None:
        self.balancer = balancer
        self.interval = config.balancer.interval
        self.path = Path(config.log.dir) / self.FILE
        # One copy of each layer's loads is enough: the ranks at dp = ep = 0 hold them all.
        self.writer_group = groups.pp_group if groups.dp_rank == 0 and groups.ep_rank == 0 else None
        self.is_main = groups.rank == 0

    def __call__(self, step: int, last: bool) -> None:
        """After the balancer recorded (0-based) step ``step``."""
        if self.writer_group is not None and ((step + 1) % self.interval == 0 or last):
            self._write(step + 1)

    def _write(self, step: int) -> None:
        window = self.balancer.load_window
        placement = self.balancer.placement.phy2log.tolist()
        mine = {layer: (loads, placement[i]) for i, (layer, loads) in enumerate(zip(self.balancer.layers, window.loads().tolist()))}
        parts: list[Any] = [None] * torch.distributed.get_world_size(self.writer_group)
        torch.distributed.all_gather_object(parts, mine, group=self.writer_group)
        if self.is_main:
            rows = {layer: row for part in parts for layer, row in part.items()}  # DualPipe copies agree
            layers = sorted(rows)
            record = {"step": step, "window": len(window), "layers": layers, "loads": [rows[i][0] for i in layers],
                      "phy2log": [rows[i][1] for i in layers]}
            atomic_write(self.path, lambda f: f.write(json.dumps(record).encode()))


# ------------------------------------------------------------------------------- rank body
def train_rank(backend: Any, config_dict: dict[str, Any], plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """One rank of a training run; returns the run's summary.

    ``plan`` (a :class:`~portapipe.checkpoint.run.RunPlan` as a dict) says what the run starts
    from; without it rank 0 makes it (and locks the run folder). Losses, tokens and step figures
    agree on every rank; rank 0's also names the files it wrote.
    """
    from .compose import PipelineRuntime

    config = config_from_dict(config_dict)
    tc = config.train
    backend.manual_seed(tc.seed)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    rank = groups.rank
    run, locks = plan_on_ranks(config, backend, rank, plan)
    try:
        return _train(backend, config, groups, run, PipelineRuntime(config, backend, groups))
    finally:
        locks.release()


def _train(backend: Any, config: Config, groups: Any, run: RunPlan, runtime: Any) -> dict[str, Any]:
    from .checkpoint.io import Checkpointer
    from .checkpoint.state import first_nonfinite
    from .models.objective import mtp_weight_at
    from .metrics import ep_step_figures
    from .models.routing import force_routing
    from .ranks.pinning import gather_placement

    tc, rank = config.train, groups.rank
    optimizer = make_sharded_optimizer(runtime, config, backend)
    if tc.ema_decay is not None:  # before the restore: a checkpoint's EMA is loaded into it
        from .optim.ema import HostEMA

        optimizer.ema = HostEMA(optimizer, tc.ema_decay, backend)
    scaler = LossScaler(config.model.dtype == "float16", growth_interval=tc.loss_scale_growth_interval)
    counted = counted_blocks(runtime.schedule, groups.pp_rank)
    data = Batches(config)
    data_record = identity.record(data.corpus)  # the sources' identity, read once (a few blocks of each file)
    balancer = runtime.balancer  # eplb / lplb on the running model (portapipe.balancing.runtime)
    hook = BalancerHook(config, balancer, groups) if config.balancer.kind == "eplb" else None
    ckpt = Checkpointer(run, config, backend, rank, groups.world_size, runtime, optimizer, balancer)
    trainer = ckpt.restore()  # the plan's checkpoint into model, optimizer, balancer, RNG
    runtime.check_copies()  # every copy of a shared weight (tied / MTP embedding) loaded equal
    progress = Progress(**trainer["progress"]) if trainer else Progress()
    scaler.load_state_dict(trainer.get("loss_scale", {}) if trainer else {})  # float16 resumes at its scale
    start, horizon, phases = progress.step, run.lr_schedule_steps, run.lr_schedule
    replica, replicas = replica_of(groups)
    force_routing(config.bench, config.model, {layer.index: layer.moe.router for layer in runtime.moe_layers()}, tc.seed)

    def record() -> dict[str, Any]:
        data_id = {"seed": tc.seed, "global_batch": global_batch_size(config), "train_tokens": data.n_tokens("train"), **data_record}
        return {"progress": progress.checkpoint(), "lr_schedule_steps": horizon, "lr_schedule": phases, "data": data_id,
                "loss_scale": scaler.state_dict()}

    tb_run = run.run_id if config.log.tensorboard else None
    metrics = None
    if rank == 0:
        sinks = []
        if config.log.wandb.mode != "off":
            from .metrics_wandb import WandbLog

            sinks.append(WandbLog(Path(config.log.dir), run.run_id, config.log.wandb, config.to_dict()))
        metrics = MetricsLog(Path(config.log.dir), start if run.mode == "resume" else None, tb_run, sinks, every=config.log.every)
    host_ema = optimizer.ema.host_bytes() if optimizer.ema is not None else 0
    memory = {**memory_record(backend, {**optimizer.memory(), "params": param_bytes(runtime), "grads": runtime.grads.memory(),
                                        "ema_host": host_ema}), "step": start,
              "launch": gather_placement(config.launch.pin_cores)}
    if metrics is not None:
        metrics.write(memory)
        shown = ("params", "grads", "master", "optimizer") + (("ema_host",) if optimizer.ema is not None else ())
        say_stderr("memory per rank (largest): " + ", ".join(f"{k} {memory[k] / 2**20:.2f} MiB" for k in shown))
        placed = memory["launch"]
        if placed["pinned"]:
            each = zip(placed["cores_by_rank"], placed["threads_by_rank"])
            say_stderr("cores per rank (launch.pin_cores): " + ", ".join(f"{c} ({t} thread{'s' * (t != 1)})" for c, t in each))
    bar = _progress_bar(tc.steps, start) if rank == 0 and config.log.progress else None
    figures = Figures()
    stopped: dict[str, Any] | None = None
    diverged: dict[str, Any] | None = None
    saved_at = start if run.mode == "resume" else None

    def diverge(record: dict[str, Any]) -> dict[str, Any]:
        if metrics is not None:
            metrics.write({"kind": "diverged", **record, "lr": optimizer.lr})
        return record

    def weights_broken(at: int) -> dict[str, Any] | None:
        """Before a checkpoint of step ``at`` (collective): the divergence when anything a
        checkpoint saves stopped being finite on any rank (weights, router biases, AdamW state, a
        balancer's loads), named, so that no checkpoint holds it."""
        bad = first_nonfinite(runtime, optimizer, balancer)
        if everywhere(backend, bad is None):
            return None
        names: list[Any] = [None] * groups.world_size
        torch.distributed.all_gather_object(names, bad)
        name = next(n for n in names if n is not None)
        return diverge({"step": at, "reason": f"{name} is not finite after the update of step {at}; no checkpoint was written of it"})

    failing = True
    try:
        for step in range(start, tc.steps):
            t0 = time.perf_counter()
            optimizer.lr = lr_at(step, tc, horizon, phases)
            lr = optimizer.lr
            shape = (config.schedule.microbatches, tc.micro_batch_size, config.model.seq_len)
            batches = data.microbatches(step, replica, replicas, *shape)
            runtime.keep_targets(data.kept_per_microbatch(step, replicas, *shape))  # data.mask_eos_loss: the global batch's mean
            runtime.grad_scale = scale = scaler.scale
            runtime.set_step(step)  # train.mtp_loss_weight's schedule
            result = runtime.step(batches)
            ep = ep_step_figures(backend, groups, runtime.moe_layers())
            stats = gather_step_stats(backend, float(optimizer.local_sq_norm(counted)), result, ep)
            stats.grad_norm /= scale
            finite = math.isfinite(result.loss) and math.isfinite(stats.grad_norm)
            # float16: the same figures on every rank, so every rank skips an overflowed step alike
            skipped = scaler.enabled and not scaler.update(finite)
            if not finite and not skipped:
                # Same figures on every rank, so every rank stops here, before the optimizer applies it.
                diverged = diverge({"step": step + 1, "loss": float(result.loss), "grad_norm": float(stats.grad_norm)})  # null where not finite
                break
            coef = 1.0 if skipped else clip_coefficient(stats.grad_norm, tc.grad_clip)
            if not skipped:
                with torch.no_grad():
                    optimizer.step(coef / scale)
                if optimizer.ema is not None:
                    optimizer.ema.update()  # the weights copied out, folded in while the next step runs
            runtime.grads.zero_grad()
            # loads recorded; every balancer.interval steps maybe a new placement, weights migrated
            balance = balancer.after_step(step, result, optimizer) if balancer is not None else None
            if hook is not None:
                hook(step, last=step + 1 == tc.steps)
            iter_s = time.perf_counter() - t0

            progress.record(step + 1, None if skipped else float(result.loss), int(result.tokens), iter_s)
            if skipped:
                if rank == 0:
                    say_stderr(f"step {step + 1}: gradients overflowed at loss scale {scale:g}; step skipped, scale now {scaler.scale:g}")
                if metrics is not None:
                    metrics.write({"kind": "overflow", "step": step + 1, "loss_scale": scale, "next_loss_scale": scaler.scale,
                                   "overflows": scaler.overflows})
                if scaler.in_a_row >= tc.max_skipped_steps:  # the same count on every rank
                    diverged = diverge({"step": step + 1, "reason": (
                        f"{scaler.in_a_row} steps in a row overflowed in float16 (train.max_skipped_steps {tc.max_skipped_steps}), "
                        f"the last at loss scale {scale:g}; none of them was applied")})
                    break
            else:
                if step > start:  # the first step of a process pays one-time costs
                    figures.add(stats)
                row = step_record(step + 1, lr, result, stats, coef, iter_s)
                if optimizer.ema is not None:
                    row["ema_s"], row["ema_fold_s"] = optimizer.ema.update_s, optimizer.ema.fold_s
                if config.model.mtp_layers:  # the weight in force (a schedule switches it)
                    row["mtp_loss_weight"] = mtp_weight_at(tc.mtp_loss_weight, step)
                row.update(consumed(data.consumed(step + 1)))
                if balance is not None:
                    row["balancer"] = balance
                if metrics is not None and ((step + 1) % config.log.every == 0 or step + 1 == tc.steps):
                    metrics.write(row)
                if bar is not None:
                    _show(bar, row)
            ckpt.poll()  # a failed save in the background stops the run at this step boundary
            every = config.checkpoint.every
            if every and (step + 1) % every == 0 and step + 1 < tc.steps:
                if (diverged := weights_broken(step + 1)) is not None:
                    break
                with lifeline.untimed():  # may wait for the previous save: not a slow step
                    ckpt.save_training(step + 1, record(), wait=False)  # written while training goes on
                saved_at = step + 1
            lifeline.mark_progress(last=step + 1 == tc.steps)  # the launcher's watch of steps far longer than the median
            sig = stop.agree(backend)
            if sig is not None:
                if saved_at != step + 1 and (diverged := weights_broken(step + 1)) is not None:
                    break
                path = ckpt.wait() if saved_at == step + 1 else ckpt.save_training(step + 1, record())
                stopped = {"signal": signal.Signals(sig).name, "step": step + 1, "checkpoint": str(path)}
                break
        if stopped is None and diverged is None and start < tc.steps:
            diverged = weights_broken(tc.steps)
            if diverged is None and config.checkpoint.at_end:
                ckpt.save_training(tc.steps, record())
        last_ckpt = ckpt.wait()
        failing = False
    finally:
        ckpt.close(failing=failing)
        if bar is not None:
            bar.close()
        if optimizer.ema is not None and failing:
            optimizer.ema.close()

    val_loss, val_by_source = validation_loss(runtime, data, config, groups) if stopped is None and diverged is None else (None, {})
    val_loss_ema = None
    if optimizer.ema is not None:
        if val_loss is not None:
            with optimizer.ema.swapped_in(list(runtime.parameters())):
                val_loss_ema, _ = validation_loss(runtime, data, config, groups)
        optimizer.ema.close()
    if val_loss is not None and not math.isfinite(val_loss):  # the same on every rank
        diverged = diverge({"step": progress.step, "reason": f"the validation loss is {val_loss!r}"})
    tail = progress.losses[-5:]
    summary = {
        "run_id": run.run_id,
        "schedule": config.schedule.name,
        "pp": config.parallel.pp,
        "ep": config.parallel.ep,
        "dp": config.parallel.dp,
        "steps": tc.steps,
        "resumed_from": start if run.mode == "resume" else None,
        "loaded_from": run.source if run.mode == "load" else None,
        "first_loss": progress.first_loss,
        "final_loss": progress.losses[-1] if progress.losses else None,
        "final_loss_avg5": sum(tail) / len(tail) if tail else None,
        "val_loss": val_loss,
        **({"val_loss_ema": val_loss_ema} if optimizer.ema is not None else {}),
        "val_loss_by_source": val_by_source,
        **consumed(data.consumed(progress.step)),
        "tokens": progress.tokens,
        "train_s": progress.train_s,
        "tokens_per_s": progress.tokens / progress.train_s if progress.train_s else None,
        **figures.medians(),
        "overflows": scaler.overflows,
        "metrics": str(metrics.path) if metrics is not None else None,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
    }
    if stopped is not None:
        summary["stopped"] = stopped
    if diverged is not None:
        summary["diverged"] = diverged
    summary = strict(summary)
    if metrics is not None:
        metrics.write({"kind": "summary", **summary})
        metrics.close()
    return summary


def step_record(step: int, lr: float, result: Any, stats: StepStats, clip: float, iter_s: float) -> dict[str, Any]:
    """One line of the metrics file. ``loss`` is the main next-token loss; the objective's other
    terms follow apart (:func:`~portapipe.models.objective.term_figures`: ``mtp_loss_<k>`` per
    multi-token prediction depth, ``balance_loss``) when the model computes them."""
    from .models.objective import term_figures

    return {
        "kind": "train",
        "step": step,
        "loss": float(result.loss),
        **term_figures(getattr(result, "loss_terms", {})),
        "lr": lr,
        "grad_norm": stats.grad_norm,
        "clipped": clip != 1.0,
        "tokens": int(result.tokens),
        "tokens_per_s": result.tokens / iter_s,
        "step_s": stats.step_s,
        "iter_s": iter_s,
        "bubble_pct": 100.0 * stats.bubble_frac,
        "a2a_hidden_pct": percent(stats.a2a_hidden_frac),
        "a2a_hidden_steady_pct": percent(stats.a2a_hidden_steady_frac),
        "a2a_hidden_edges_pct": percent(stats.a2a_hidden_edges_frac),
        "counts_a2a_hidden_pct": percent(stats.counts_a2a_hidden_frac),
        "a2a_bytes": stats.a2a_bytes,
        "ep_wait_frac": stats.ep_wait_frac,
        "rank_balancedness": stats.rank_balancedness,
        "grad_sync_exposed_s": stats.grad_sync_exposed_s,
    }


def consumed(where: dict[str, Any]) -> dict[str, Any]:
    """The data position in a metrics line: ``tokens_consumed`` (inputs trained on since step 0)
    and ``epochs`` (each training source's, a fraction: 1.5 = half-way through its second)."""
    return {"tokens_consumed": where["tokens"], "epochs": where["epochs"]}


def _progress_bar(total: int, start: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _show(bar: Any, record: dict[str, Any]) -> None:
    shown = {"loss": f"{record['loss']:.3f}"}
    shown.update({f"mtp{key[len('mtp_loss_'):]}": f"{v:.3f}" for key, v in record.items() if key.startswith("mtp_loss_")})
    if "balance_loss" in record:
        shown["bal"] = f"{record['balance_loss']:.3f}"
    shown.update({"tok/s": f"{record['tokens_per_s']:.0f}", "bubble": f"{record['bubble_pct']:.0f}%"})
    if "tokens_consumed" in record:
        shown["tokens"] = f"{record['tokens_consumed']:.3g}"
        epochs = record["epochs"]
        shown["epoch"] = " ".join(f"{v:.2f}" for v in epochs.values()) if len(epochs) > 1 else f"{next(iter(epochs.values()), 0):.2f}"
    if record["a2a_hidden_pct"] is not None:
        shown["a2a hidden"] = f"{record['a2a_hidden_pct']:.0f}%"
    if record["ep_wait_frac"] is not None:
        shown["ep wait"] = f"{100 * record['ep_wait_frac']:.0f}%"
        shown["ep bal"] = f"{record['rank_balancedness']:.2f}"
    shown["grad sync"] = f"{1000 * record['grad_sync_exposed_s']:.0f}ms"
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


# --------------------------------------------------------------------------------- launcher
def check_before_launch(config: Config) -> None:
    """Everything that can be checked without ranks or folders; raises ConfigError listing each problem."""
    from .scheduling.executor import build_schedule

    from .metrics_wandb import wandb_problems
    from .models.fp8_layers import fp8_problems
    from .models.hf_io import init_problems

    problems = (list(data_problems(config)) + init_problems(config.model) + log_problems(config.log.tensorboard)
                + wandb_problems(config.log.wandb) + pin_problems(config))
    problems += fp8_problems(config.model, config.train.fp8)
    try:
        build_schedule(config)  # the schedule fits pp and the micro-batches, the model splits into its blocks
    except ConfigError as err:
        problems.extend(err.problems)
    from .models.routing import skew_table

    try:
        skew_table(config.bench, config.model)  # a benchmark's routing file fits the model
    except ValueError as err:
        problems.append(str(err))
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
    plan, locks = None, Locks([])
    if not (under_torchrun() or under_mpirun()) or launching_rank() == 0:
        made, locks = prepare_run(config, backend)  # the folder locked until the ranks are done
        plan = made.to_dict()
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
        )
    return results[0]
