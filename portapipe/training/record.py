"""What rank 0 writes of each step: the metrics rows (train, overflow, diverged, memory), the
sinks they also go to (TensorBoard, W&B) and the progress bar on stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ..checkpoint.run import RunPlan, say_stderr
from ..config import Config
from ..metrics.log import MetricsLog
from ..metrics.step import StepStats, memory_record, percent


class StepRecorder:
    """Rank 0's metrics file (every ``log.every`` steps and the last) and progress bar
    (``log.progress``); on the other ranks every method does nothing."""

    def __init__(self, config: Config, run: RunPlan, rank: int, start: int) -> None:
        self.config, self.steps = config, config.train.steps
        self.restarted = run.restarts > 0  # the launcher said so in one line: the opening lines are not repeated
        self.metrics: MetricsLog | None = None
        self.bar: Any = None
        if rank != 0:
            return
        sinks = []
        if config.log.wandb.mode != "off":
            from ..metrics.wandb_sink import WandbLog

            sinks.append(WandbLog(Path(config.log.dir), run.run_id, config.log.wandb, config.to_dict()))
        tb_run = run.run_id if config.log.tensorboard else None
        # A restart cuts the file back to its step even before the run's first checkpoint: its restart rows stay.
        resumed = run.mode == "resume" or self.restarted
        self.metrics = MetricsLog(Path(config.log.dir), start if resumed else None, tb_run, sinks, every=config.log.every)

    def open_bar(self, start: int) -> None:
        """The progress bar from step ``start`` (``log.progress``), after the run's opening lines."""
        if self.metrics is not None and self.config.log.progress:
            self.bar = _progress_bar(self.steps, start)

    def write(self, row: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(row)

    def memory(self, backend: Any, parts: dict[str, int], step: int, placement: dict[str, Any], shown: tuple[str, ...]) -> None:
        """The ``memory`` row of the run's start (collective: the largest per rank of each part), and
        the parts ``shown`` and the pinned cores in one line each on stderr."""
        row = {**memory_record(backend, parts), "step": step, "launch": placement}
        if self.metrics is None:
            return
        self.metrics.write(row)
        if self.restarted:
            return
        say_stderr("memory per rank (largest): " + ", ".join(f"{k} {row[k] / 2**20:.2f} MiB" for k in shown))
        if placement["pinned"]:
            each = zip(placement["cores_by_rank"], placement["threads_by_rank"])
            say_stderr("cores per rank (launch.pin_cores): " + ", ".join(f"{c} ({t} thread{'s' * (t != 1)})" for c, t in each))

    def trained(self, row: dict[str, Any]) -> None:
        """An applied step's row: to the metrics file every ``log.every`` steps and at the last; to the bar."""
        step = row["step"]
        if step % self.config.log.every == 0 or step == self.steps:
            self.write(row)
        if self.bar is not None:
            show(self.bar, row)

    def overflow(self, step: int, scale: float, next_scale: float, overflows: int) -> None:
        """A float16 step skipped: one line on stderr and an ``overflow`` row."""
        if self.metrics is None:
            return
        say_stderr(f"step {step}: gradients overflowed at loss scale {scale:g}; step skipped, scale now {next_scale:g}")
        self.metrics.write({"kind": "overflow", "step": step, "loss_scale": scale, "next_loss_scale": next_scale, "overflows": overflows})

    def diverged(self, record: dict[str, Any], lr: float) -> None:
        self.write({"kind": "diverged", **record, "lr": lr})

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self, summary: dict[str, Any]) -> None:
        """The run's last row, then the file and its sinks closed."""
        if self.metrics is not None:
            self.metrics.write({"kind": "summary", **summary})
            self.metrics.close()


def step_record(step: int, lr: float, result: Any, stats: StepStats, clip: float, iter_s: float) -> dict[str, Any]:
    """One line of the metrics file. ``loss`` is the main next-token loss; the objective's other
    terms follow apart (:func:`~portapipe.models.objective.term_figures`: ``mtp_loss_<k>`` per
    multi-token prediction depth, ``balance_loss``) when the model computes them."""
    from ..models.objective import term_figures

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
        # memory.offload: what the step sent to host memory (all ranks) and the most one rank held there
        **({"offload_sent_bytes": stats.offload_sent_bytes, "offload_host_peak_bytes": stats.offload_host_peak_bytes}
           if stats.offload_sent_bytes else {}),
    }


def consumed(where: dict[str, Any]) -> dict[str, Any]:
    """The data position in a metrics line: ``tokens_consumed`` (inputs trained on since step 0)
    and ``epochs`` (each training source's, a fraction: 1.5 = half-way through its second)."""
    return {"tokens_consumed": where["tokens"], "epochs": where["epochs"]}


def param_bytes(runtime: Any) -> int:
    """Bytes of this rank's parameters (both DualPipe copies of a block count: both are held; a
    weight two of its blocks hold as one tensor counts once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in runtime.parameters()}.values())


def _progress_bar(total: int, start: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)


def show(bar: Any, record: dict[str, Any]) -> None:
    """A train row on the progress bar: the losses, tokens/s, the bubble, the data position and the
    exchange figures the run has."""
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
