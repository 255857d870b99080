"""One step's figures gathered over the ranks (gradient norm, bubble, all-to-all hidden, EP wait)
and the run's medians of them; the memory record."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class StepStats:
    """One step's figures gathered over all ranks."""

    grad_norm: float
    step_s: float
    bubble_frac: float
    a2a_hidden_frac: float | None
    a2a_hidden_steady_frac: float | None  # over the overlapped F&B pairs only
    #: share of the ranks' step time spent waiting on a slower EP peer's experts (summed wait /
    #: summed step time, i.e. the mean over ranks); None without MoE layers
    ep_wait_frac: float | None = None
    #: mean over MoE layers of mean / max rows computed per EP rank; None without MoE layers
    rank_balancedness: float | None = None
    #: gradient synchronisation left after the last action (the largest over ranks), seconds
    grad_sync_exposed_s: float = 0.0
    #: over the rest: lone actions (warm-up, cool-down, 1F1B and ZB1P) and F&F pairs
    a2a_hidden_edges_frac: float | None = None
    #: over the exchanges of row counts that precede the rows' (not in the three above)
    counts_a2a_hidden_frac: float | None = None
    #: bytes the expert exchanges (dispatch, combine and their backwards) sent, summed over ranks
    a2a_bytes: float = 0.0
    #: activation offload (``memory.offload``): bytes sent to host memory, summed over ranks, and the
    #: most a rank held there at once
    offload_sent_bytes: float = 0.0
    offload_host_peak_bytes: float = 0.0


@dataclass
class Figures:
    """This process's per-step figures, for the summary's medians."""

    step_s: list[float] = field(default_factory=list)
    bubble: list[float] = field(default_factory=list)
    hidden: list[float] = field(default_factory=list)
    hidden_steady: list[float] = field(default_factory=list)
    hidden_edges: list[float] = field(default_factory=list)
    hidden_counts: list[float] = field(default_factory=list)
    ep_wait: list[float] = field(default_factory=list)
    grad_sync_exposed: list[float] = field(default_factory=list)

    def add(self, stats: StepStats) -> None:
        if stats.ep_wait_frac is not None:
            self.ep_wait.append(stats.ep_wait_frac)
        self.step_s.append(stats.step_s)
        self.bubble.append(stats.bubble_frac)
        self.grad_sync_exposed.append(stats.grad_sync_exposed_s)
        if stats.a2a_hidden_frac is not None:
            self.hidden.append(stats.a2a_hidden_frac)
        if stats.a2a_hidden_steady_frac is not None:
            self.hidden_steady.append(stats.a2a_hidden_steady_frac)
        if stats.a2a_hidden_edges_frac is not None:
            self.hidden_edges.append(stats.a2a_hidden_edges_frac)
        if stats.counts_a2a_hidden_frac is not None:
            self.hidden_counts.append(stats.counts_a2a_hidden_frac)

    def medians(self) -> dict[str, float | None]:
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        return {
            "median_step_s": med(self.step_s),
            "bubble_pct": percent(med(self.bubble)),
            "a2a_hidden_pct": percent(med(self.hidden)),
            "a2a_hidden_steady_pct": percent(med(self.hidden_steady)),
            "a2a_hidden_edges_pct": percent(med(self.hidden_edges)),
            "counts_a2a_hidden_pct": percent(med(self.hidden_counts)),
            "ep_wait_pct": percent(med(self.ep_wait)),
            "median_grad_sync_exposed_s": med(self.grad_sync_exposed),
        }


def percent(frac: float | None) -> float | None:
    return None if frac is None else 100.0 * frac


def everywhere(backend: Any, ok: bool) -> bool:
    """Whether ``ok`` holds on every rank (collective over the world)."""
    flag = torch.tensor([float(ok)], dtype=getattr(torch, backend.capabilities.widest_reduce_dtype), device=backend.device())
    backend.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())


def memory_record(backend: Any, parts: dict[str, int]) -> dict[str, Any]:
    """The ``memory`` record: the largest per-rank bytes of each part over the ranks (collective)."""
    keys = sorted(parts)
    local = torch.tensor([float(parts[k]) for k in keys], dtype=torch.float64)
    table = [torch.empty_like(local) for _ in range(torch.distributed.get_world_size())]
    backend.all_gather(table, local)
    top = torch.stack(table).max(0).values
    return {"kind": "memory", **{k: int(v) for k, v in zip(keys, top.tolist())}}


def timing(result: Any, key: str) -> float:
    value = result.timings.get(key, 0.0)
    return float(value) if value is not None else 0.0


def ep_step_figures(backend: Any, groups: Any, moe_layers: list[Any]) -> tuple[float, float, int]:
    """This rank's (seconds waited on EP peers, summed rank balancedness, MoE layers) of the step.

    One all-gather over the EP group of each layer's expert compute time and rows (its
    :class:`~portapipe.models.expert_clock.ExpertClock`, reset here): in layer l this rank waits
    ``max_j c_jl - c_l`` at the combine and the gradient's dispatch for the slowest rank j, and the
    layer's balancedness is mean / max of the rows the EP ranks computed (1 when none did).
    """
    taken = [layer.moe.clock.take() for layer in moe_layers]
    if not taken:
        return 0.0, 0.0, 0
    local = torch.tensor(taken, dtype=torch.float64)  # [layers, (seconds, rows)]
    table = local.unsqueeze(0)
    if groups.ep > 1:
        parts = [torch.empty_like(local) for _ in range(groups.ep)]
        backend.all_gather(parts, local, group=groups.ep_group)
        table = torch.stack(parts)  # [ep, layers, 2]: the group's ranks hold the same layers
    seconds, rows = table[..., 0], table[..., 1]
    wait = float((seconds.max(0).values - local[:, 0]).sum())
    top = rows.max(0).values
    balancedness = torch.where(top > 0, rows.mean(0) / top.clamp(min=1), torch.ones_like(top))
    return wait, float(balancedness.sum()), len(taken)


def gather_step_stats(backend: Any, grad_sq_owned: float, result: Any, ep: tuple[float, float, int] = (0.0, 0.0, 0)) -> StepStats:
    """One all-gather per step: the global gradient norm and the step's timings over ranks.

    Bubble = the largest idle share over ranks, likewise the exposed gradient synchronisation; all-to-all hidden = 1 - (summed wait) /
    (summed all-to-all time), over the whole step and over the F&B pairs (the steady phase),
    or None when there was no all-to-all. ``ep``: this rank's :func:`ep_step_figures`; the EP
    wait share is the summed wait over the summed step time (the mean over ranks), the rank
    balancedness the mean over every rank's MoE layers.
    """
    keys = (
        "step_s", "bubble_frac", "a2a_total_s", "a2a_wait_s", "fb_a2a_total_s", "fb_a2a_wait_s", "grad_sync_exposed_s",
        "edge_a2a_total_s", "edge_a2a_wait_s", "counts_a2a_total_s", "counts_a2a_wait_s", "a2a_bytes",
        "offload_sent_bytes", "offload_host_peak_bytes",
    )
    local = torch.tensor([grad_sq_owned, *(timing(result, k) for k in keys), *ep], dtype=torch.float64)
    world = torch.distributed.get_world_size()
    parts = [torch.empty_like(local) for _ in range(world)]
    backend.all_gather(parts, local)
    table = torch.stack(parts)
    col = {k: i + 1 for i, k in enumerate(keys)}
    wait, balanced, layers = (len(keys) + 1 + i for i in range(3))  # ep_step_figures' columns

    def hidden(prefix: str) -> float | None:
        total, waited = float(table[:, col[prefix + "a2a_total_s"]].sum()), float(table[:, col[prefix + "a2a_wait_s"]].sum())
        return None if total <= 0 else max(0.0, min(1.0, 1.0 - waited / total))

    step_sum, n_layers = float(table[:, col["step_s"]].sum()), float(table[:, layers].sum())
    return StepStats(
        grad_norm=math.sqrt(float(table[:, 0].sum())),
        step_s=float(table[:, col["step_s"]].max()),
        bubble_frac=float(table[:, col["bubble_frac"]].max()),
        a2a_hidden_frac=hidden(""),
        a2a_hidden_steady_frac=hidden("fb_"),
        grad_sync_exposed_s=float(table[:, col["grad_sync_exposed_s"]].max()),
        ep_wait_frac=float(table[:, wait].sum()) / step_sum if n_layers > 0 and step_sum > 0 else None,
        rank_balancedness=float(table[:, balanced].sum()) / n_layers if n_layers > 0 else None,
        a2a_hidden_edges_frac=hidden("edge_"),
        counts_a2a_hidden_frac=hidden("counts_"),
        a2a_bytes=float(table[:, col["a2a_bytes"]].sum()),
        offload_sent_bytes=float(table[:, col["offload_sent_bytes"]].sum()),
        offload_host_peak_bytes=float(table[:, col["offload_host_peak_bytes"]].max()),
    )
