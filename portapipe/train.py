"""The training loop: data, optimizer, LR schedule, clipping, metrics, checkpoints, balancer hook.

:func:`train` checks the config, the data and the schedule in this process (bad input fails
before any rank starts), then runs :func:`train_rank` on ``world_size`` ranks through
:func:`portapipe.launch.run_ranks` and returns rank 0's summary. Each rank builds its
:class:`~portapipe.compose.PipelineRuntime`, which runs one step of the schedule and
leaves every parameter's ``.grad`` holding the gradient of the global mean loss (DP / EP
reduction and DualPipe's copy summing included); this loop adds AdamW with warm-up + cosine
learning rate and clipping by the global gradient norm.

Per step, rank 0 appends one JSON line to ``<log.dir>/metrics.jsonl``: loss, learning rate,
gradient norm, tokens/s, step time, the measured pipeline bubble (the largest idle share of
the step over ranks) and the share of all-to-all time hidden behind compute (whole step and
steady-phase F&B pairs). At the end: the validation loss, a summary line in the metrics file,
and the same summary returned (the CLI prints it as one JSON line).

Checkpoints (written so that nothing is lost on failure) are in :mod:`portapipe.checkpoint`.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .checkpoint import atomic_write, checkpoint_root, latest_checkpoint, load_shard, resume_problems, save_checkpoint
from .config import Config, ConfigError, TrainConfig, config_from_dict
from .data import TextData, data_problems
from .metrics import Figures, MetricsLog, Progress, StepStats, gather_step_stats, percent
from .models.moe import is_expert_param

VAL_BATCHES = 4  # validation steps' worth of micro-batches evaluated at the end


# ----------------------------------------------------------------------------- learning rate
def lr_at(step: int, train: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``train.steps``.

    Linear warm-up over ``warmup_steps`` (step 0 gets lr/warmup_steps, step warmup-1 the full
    lr), then a half cosine from ``lr`` at the first step after warm-up to ``min_lr`` at the last.
    """
    if step < train.warmup_steps:
        return train.lr * (step + 1) / train.warmup_steps
    decay_steps = train.steps - train.warmup_steps
    if decay_steps <= 1:
        return train.lr
    progress = min(1.0, (step - train.warmup_steps) / (decay_steps - 1))
    return train.min_lr + 0.5 * (train.lr - train.min_lr) * (1.0 + math.cos(math.pi * progress))


# ------------------------------------------------------------------------------- optimizer
def make_optimizer(named_parameters: list[tuple[str, torch.nn.Parameter]], train: TrainConfig) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (norm gains and biases are not decayed)."""
    decay = [p for _, p in named_parameters if p.requires_grad and p.dim() >= 2]
    no_decay = [p for _, p in named_parameters if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=train.lr, betas=train.betas)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """Factor the gradients are scaled by: 1 unless the global norm exceeds ``max_norm`` (> 0)."""
    if max_norm <= 0 or not math.isfinite(total_norm) or total_norm <= max_norm:
        return 1.0
    return max_norm / (total_norm + 1e-6)


# ------------------------------------------------------------------------------ rank helpers
def owned_grad_sq(runtime: Any, groups: Any) -> float:
    """Sum of squared gradients of the parameters this rank counts in the global norm.

    Each distinct parameter is counted once over the world: a model block held by two ranks
    (DualPipe) by the rank of its first virtual stage; a parameter replicated over the data-
    and expert-parallel ranks by their first rank; an expert's parameters, sharded over the EP
    group, by every EP rank for its own experts (first DP rank only).
    """
    schedule = runtime.schedule
    owner: dict[int, int] = {}
    for v, block in enumerate(schedule.stage_block):
        owner.setdefault(block, schedule.stage_rank[v])
    total = 0.0
    for block_id, block in runtime.blocks.items():
        if owner.get(block_id) != groups.pp_rank:
            continue
        for p in block.parameters():
            if p.grad is None:
                continue
            if is_expert_param(p):
                counted = groups.dp_rank == 0
            else:
                counted = groups.dp_rank == 0 and groups.ep_rank == 0
            if counted:
                sq = p.grad.detach().double().pow(2)
                owned = getattr(p, "slot_owned", None)  # a balancer's replicated expert counts once
                total += float(sq.sum() if owned is None else sq.reshape(sq.shape[0], -1)[owned.to(sq.device)].sum())
    return total


def _snapshot_buffers(runtime: Any) -> dict[int, dict[str, torch.Tensor]]:
    return {b: {n: t.detach().clone() for n, t in m.named_buffers()} for b, m in runtime.blocks.items()}


def _restore_buffers(runtime: Any, saved: dict[int, dict[str, torch.Tensor]]) -> None:
    for b, m in runtime.blocks.items():
        for n, t in m.named_buffers():
            t.copy_(saved[b][n])


def validation_loss(runtime: Any, data: TextData, config: Config, groups: Any) -> float | None:
    """Mean loss over ``VAL_BATCHES`` steps of validation data; the model is left unchanged.

    The runtime's step also computes gradients and updates the routers' load-balancing bias;
    both are undone here so evaluating never changes training.
    """
    if data.n_bytes("val") < config.model.seq_len + 1:
        return None
    saved = _snapshot_buffers(runtime)
    losses = []
    for i in range(VAL_BATCHES):
        batches = data.microbatches(
            i, groups.dp_rank, groups.ep_rank, config.schedule.microbatches, config.train.micro_batch_size, config.model.seq_len, split="val"
        )
        losses.append(float(runtime.step(batches).loss))
        for p in runtime.parameters():
            p.grad = None
    _restore_buffers(runtime, saved)
    return sum(losses) / len(losses)


class BalancerHook:
    """balancer.kind: eplb: record each step's expert loads and write them out for planning.

    Every step's ``StepResult.expert_counts`` (this pipeline rank's MoE layers, summed over the
    EP group) goes into a sliding window (:class:`portapipe.balancing.loads.LoadWindow`, of
    ``balancer.window`` steps). Every ``balancer.interval`` steps and at the end, the window's
    loads of all layers are gathered to rank 0 and written to ``<log.dir>/expert_loads.json``
    (``{"step", "layers", "loads"}``), which ``portapipe balance`` reads to plan a placement.
    """

    FILE = "expert_loads.json"

    def __init__(self, config: Config, runtime: Any, groups: Any) -> None:
        from .balancing.loads import LoadWindow  # the eplb feature; imported only when asked for

        self.layers = [layer.index for layer in runtime.moe_layers()]
        self.window = LoadWindow(config.balancer.window, len(self.layers), config.model.n_experts)
        self.interval = config.balancer.interval
        self.path = Path(config.log.dir) / self.FILE
        # One copy of each layer's loads is enough: the ranks at dp = ep = 0 hold them all.
        self.writer_group = groups.pp_group if groups.dp_rank == 0 and groups.ep_rank == 0 else None
        self.is_main = groups.rank == 0

    def __call__(self, step: int, result: Any, last: bool) -> None:
        if result.expert_counts is not None and self.layers:
            self.window.record(result.expert_counts)
        if self.writer_group is not None and ((step + 1) % self.interval == 0 or last):
            self._write(step + 1)

    def _write(self, step: int) -> None:
        mine = dict(zip(self.layers, self.window.loads().tolist()))
        parts: list[Any] = [None] * torch.distributed.get_world_size(self.writer_group)
        torch.distributed.all_gather_object(parts, mine, group=self.writer_group)
        if self.is_main:
            rows = {layer: row for part in parts for layer, row in part.items()}  # DualPipe copies agree
            layers = sorted(rows)
            record = {"step": step, "window": len(self.window), "layers": layers, "loads": [rows[i] for i in layers]}
            atomic_write(self.path, lambda f: f.write(json.dumps(record).encode()))


# ------------------------------------------------------------------------------- rank body
def train_rank(backend: Any, config_dict: dict[str, Any]) -> dict[str, Any]:
    """One rank of a training run; returns the run's summary.

    Losses, tokens and step figures agree on every rank; rank 0's also names the files it wrote.
    """
    from .compose import PipelineRuntime

    config = config_from_dict(config_dict)
    tc = config.train
    backend.manual_seed(tc.seed)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    rank = groups.rank
    runtime = PipelineRuntime(config, backend, groups)
    named = list(runtime.named_parameters())
    optimizer = make_optimizer(named, tc)
    data = TextData(config)
    hook = BalancerHook(config, runtime, groups) if config.balancer.kind == "eplb" else None
    balancer = runtime.ep.balancer  # eplb / lplb on the running model (portapipe.balancing.runtime)

    root = checkpoint_root(config)
    progress = Progress()
    found = latest_checkpoint(root) if config.checkpoint.resume else None
    if found is not None:
        shard = load_shard(found[1], rank)
        for block_id, state in shard["model"].items():
            runtime.blocks[block_id].load_state_dict(state)
        optimizer.load_state_dict(shard["optimizer"])
        if balancer is not None and shard.get("balancer") is not None:
            balancer.load_state_dict(shard["balancer"])  # the placement the saved expert weights are in
        backend.set_rng_state(shard["rng"])
        progress = Progress(**shard["progress"])
    start = progress.step

    def save(step: int) -> Path:
        state = {
            "model": {b: m.state_dict() for b, m in runtime.blocks.items()},
            "optimizer": optimizer.state_dict(),
            "rng": backend.get_rng_state(),
            "progress": asdict(progress),
            "balancer": balancer.state_dict() if balancer is not None else None,
        }
        return save_checkpoint(root, step, rank, state, config, backend)

    metrics = MetricsLog(Path(config.log.dir), start if found else None) if rank == 0 else None
    bar = _progress_bar(tc.steps, start) if rank == 0 and config.log.progress else None
    figures = Figures()
    last_ckpt: Path | None = found[1] if found else None
    try:
        for step in range(start, tc.steps):
            t0 = time.perf_counter()
            lr = lr_at(step, tc)
            for g in optimizer.param_groups:
                g["lr"] = lr
            batches = data.microbatches(step, groups.dp_rank, groups.ep_rank, config.schedule.microbatches, tc.micro_batch_size, config.model.seq_len)
            result = runtime.step(batches)
            stats = gather_step_stats(backend, owned_grad_sq(runtime, groups), result)
            coef = clip_coefficient(stats.grad_norm, tc.grad_clip)
            if coef != 1.0:
                with torch.no_grad():
                    for _, p in named:
                        if p.grad is not None:
                            p.grad.mul_(coef)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if hook is not None:
                hook(step, result, last=step + 1 == tc.steps)
            # loads recorded; every balancer.interval steps maybe a new placement, weights migrated
            balance = balancer.after_step(step, result, optimizer) if balancer is not None else None
            iter_s = time.perf_counter() - t0

            progress.record(step + 1, float(result.loss), int(result.tokens), iter_s)
            if step > start:  # the first step of a process pays one-time costs
                figures.add(stats)
            record = step_record(step + 1, lr, result, stats, coef, iter_s)
            if balance is not None:
                record["balancer"] = balance
            if metrics is not None and ((step + 1) % config.log.every == 0 or step + 1 == tc.steps):
                metrics.write(record)
            if bar is not None:
                _show(bar, record)
            every = config.checkpoint.every
            if every and (step + 1) % every == 0 and step + 1 < tc.steps:
                last_ckpt = save(step + 1)
        if start < tc.steps or last_ckpt is None:
            last_ckpt = save(tc.steps)
    finally:
        if bar is not None:
            bar.close()

    tail = progress.losses[-5:]
    summary = {
        "schedule": config.schedule.name,
        "pp": config.parallel.pp,
        "ep": config.parallel.ep,
        "dp": config.parallel.dp,
        "steps": tc.steps,
        "resumed_from": start if found else None,
        "first_loss": progress.first_loss,
        "final_loss": progress.losses[-1] if progress.losses else None,
        "final_loss_avg5": sum(tail) / len(tail) if tail else None,
        "val_loss": validation_loss(runtime, data, config, groups),
        "tokens": progress.tokens,
        "train_s": progress.train_s,
        "tokens_per_s": progress.tokens / progress.train_s if progress.train_s else None,
        **figures.medians(),
        "metrics": str(metrics.path) if metrics is not None else None,
        "checkpoint": str(last_ckpt) if last_ckpt else None,
    }
    if metrics is not None:
        metrics.write({"kind": "summary", **summary})
        metrics.close()
    return summary


def step_record(step: int, lr: float, result: Any, stats: StepStats, clip: float, iter_s: float) -> dict[str, Any]:
    """One line of the metrics file."""
    return {
        "kind": "train",
        "step": step,
        "loss": float(result.loss),
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
    }


def _progress_bar(total: int, start: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def _show(bar: Any, record: dict[str, Any]) -> None:
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}", "bubble": f"{record['bubble_pct']:.0f}%"}
    if record["a2a_hidden_pct"] is not None:
        shown["a2a hidden"] = f"{record['a2a_hidden_pct']:.0f}%"
    bar.set_postfix(shown, refresh=False)
    bar.update(1)


# --------------------------------------------------------------------------------- launcher
def check_before_launch(config: Config) -> None:
    """Everything that can be checked without ranks; raises ConfigError listing each problem."""
    from .scheduling.executor import build_schedule

    from .models.hf_io import init_problems

    problems = list(data_problems(config)) + init_problems(config.model)
    try:
        build_schedule(config)  # the schedule fits pp and the micro-batches, the model splits into its blocks
    except ConfigError as err:
        problems.extend(err.problems)
    if config.checkpoint.resume:
        found = latest_checkpoint(checkpoint_root(config))
        if found is not None:
            problems.extend(resume_problems(config, found[1]))
    if problems:
        raise ConfigError(problems)


def rank_threads(world_size: int) -> int:
    """Intra-op threads per rank: the machine's cores shared out, at least one."""
    return max(1, (os.cpu_count() or 1) // world_size)


def train(config: Config, wall_timeout_s: float = 0.0) -> dict[str, Any]:
    """Check, launch ``world_size`` ranks, train; return the summary (raises LaunchError on a failed rank)."""
    from .backends.registry import check_available
    from .launch import run_ranks

    check_before_launch(config)
    backend = check_available(config.backend)
    found = latest_checkpoint(checkpoint_root(config)) if config.checkpoint.resume else None
    if found is not None:
        note = f"portapipe: resuming from {found[1]} (step {found[0]} of {config.train.steps})"
        if found[0] >= config.train.steps:
            note += "; nothing left to train (--set checkpoint.resume=false or another log.dir trains afresh)"
        print(note, file=sys.stderr, flush=True)
    results = run_ranks(
        train_rank,
        config.world_size,
        config.to_dict(),
        backend=backend,
        backend_options=config.backend_options,
        threads=rank_threads(config.world_size),
        pg_timeout_s=300.0,
        wall_timeout_s=wall_timeout_s,
        stall_timeout_s=config.launch.stall_timeout_s,
        stop_grace_s=config.launch.stop_grace_s,
    )
    return results[0]
