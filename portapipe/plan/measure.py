"""``portapipe profile``: measure a device profile on the configured backend (the rank body;
each concern in its own module: :mod:`.measure_parts`, :mod:`.measure_comm`,
:mod:`.measure_lag`, :mod:`.measure_crowding`, :mod:`.measure_clock`).

Every rank of the config's world joins; the measurements run on as few ranks as they need
while the others wait at a barrier, so ranks sharing a host's processors do not slow each
other down (the time model adds that sharing back for the layouts it prices):

Compute (parts, the programs' own work, issuing exchanges, the optimizer) is timed as the
thread's processor time, which other processes on the machine do not inflate; communication
as the wall time of the least disturbed repetition.

- parts: the whole model as one block on an expert-parallel group of the config's ``ep`` ranks
  (fewer when the host has fewer processors), a few micro-batches of two sizes per memory
  option; every part's forward, input-gradient backward and weight-gradient pass timed through
  an observer on the tape (:func:`portapipe.scheduling.overlap.observing`), then fitted as
  ``fixed + per_unit * units``;
- saved bytes: each part's bytes kept for backward, counted by
  :class:`~portapipe.memory.accounting.SavedActivations` one micro-batch at a time;
  The attention part's blocking exchange of per-expert row counts waits without using the
  processor, so its processor time leaves the exchange out; the time model adds it per EP size.
- communication: all-to-all and all-reduce over groups of 2, 4, ... ranks, point-to-point
  between two ranks, each at two sizes; for the all-to-all and point-to-point also the
  processor time the process's other threads (gloo's) spend on them, which competes with the
  compute of ranks sharing a host's processors;
- AdamW's step per parameter element, and the expert loads the profiling batches produced;
- the host link (:mod:`.measure_host`): offload's copies each way, and whether they run beside
  compute (``capabilities.host_copies``).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import config_from_dict
from ..models.expert_parallel import ExpertParallel
from ..models.moe import DTYPES
from .executor_cost import action_cost
from .measure_clock import cpu_time
from .measure_comm import communication
from .measure_crowding import busy, crowding_ratio
from .measure_host import host_link
from .measure_lag import exchange_lag
from .measure_parts import MEMORY, saved_bytes, time_parts
from .profile import FORMAT, Linear, Profile, ProfileError
from ..config.setup import shape_of


def _adamw_step(dtype: torch.dtype, sizes: list[int]) -> Callable[[], None]:
    """One AdamW update over tensors of ``sizes`` elements (warmed up once)."""
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    opt = torch.optim.AdamW(params, lr=1e-3)
    opt.step()
    return opt.step


def _least_in_turns(fns: list[Callable[[], None]], rounds: int) -> list[float]:
    """Each of ``fns``' least processor time over ``rounds`` rounds that take them in turn: a busy
    machine (other processes thrashing the caches and memory bandwidth) only ever adds time, and
    taking them in turn keeps a drift of the machine's speed out of their differences."""
    least = [math.inf] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            least[i] = min(least[i], cpu_time(fn, 1))
    return least


def _optimizer(dtype: torch.dtype, reps: int, many: int = 256, elements: int = 64) -> tuple[Linear, float]:
    """AdamW's update per parameter element (one tensor at two sizes) and what each further tensor
    adds: ``many`` tensors of ``elements`` each against one tensor of the same elements. At 64
    elements a tensor the element work is a few percent of the per-tensor work, so the difference
    is the per-tensor cost many times over, far above a busy machine's noise (the same elements in
    64 large tensors gave a difference of a tenth of the step, which noise took to zero one
    profile in three). Neither may come out zero: both are work that takes time."""
    small, large = 1 << 18, 1 << 20
    sizes = ([small], [large], [elements] * many, [elements * many])
    t_small, t_large, t_split, t_whole = _least_in_turns([_adamw_step(dtype, n) for n in sizes], max(reps, 5))
    per_element, per_tensor = Linear.fit([(small, t_small), (large, t_large)]), (t_split - t_whole) / (many - 1)
    if not (per_element.per_unit > 0 and per_tensor > 0):
        raise ProfileError(
            f"profile: AdamW took {t_small:.3g} s / {t_large:.3g} s over {small} / {large} elements and {t_split:.3g} s over "
            f"{many} tensors against {t_whole:.3g} s over one of the same elements: this thread's processor clock cannot "
            "resolve its costs on this machine; profile again"
        )
    return per_element, per_tensor


# ------------------------------------------------------------------------------ rank body
def profile_rank(backend: Any, raw: dict[str, Any], reps: int, warmup: int) -> dict[str, Any] | None:
    """Run on every rank; rank 0 returns the profile as a dict."""
    config = config_from_dict(raw)
    world, rank = dist.get_world_size(), dist.get_rank()
    shared = world >= 2 and backend.device(0) == backend.device(1)  # ranks share one device (a host's CPUs)
    processors = float(backend.device_count()) if shared else None
    m = config.model
    # an expert-parallel group for the part timings: the config's ep, no more ranks than processors
    limit = config.parallel.ep if processors is None else min(config.parallel.ep, int(processors))
    ep_size = max(d for d in range(1, limit + 1) if m.n_experts % d == 0 and world >= d)
    group = backend.new_group(list(range(ep_size))) if ep_size > 1 else None
    dtype = DTYPES[m.dtype]
    sizes = sorted({config.train.micro_batch_size, 2 * config.train.micro_batch_size})
    out: dict[str, Any] = {}
    if rank < ep_size:
        ep = ExpertParallel(backend, ep_size, rank, group)
        parts, loads = {}, None
        overhead: dict[str, list[tuple[float, int, int]]] = {"F": [], "B": []}
        options = ("off", "level0", "level1") if m.n_layers > m.n_dense else ("off",)
        for option in options:
            parts[option], ov, block = time_parts(config, ep, option, sizes, reps, warmup)
            for phase in overhead:
                overhead[phase] += ov[phase]
            if option == "off" and block.moe_layers():
                counts = torch.stack([layer.moe.step_counts.to(torch.float64) for layer in block.moe_layers()])
                if ep_size > 1:
                    backend.all_reduce(counts, group=group)
                loads = counts.tolist()
        saved = {opt: saved_bytes(config, ep, opt, sizes) for opt in MEMORY if opt == "off" or m.n_layers > m.n_dense}
        out = {"parts": parts, "saved_bytes": saved, "loads": loads or []}
    dist.barrier()
    rows = config.train.micro_batch_size * m.seq_len * m.top_k
    # communication between computes of about an attention part (the longest stretch of a
    # forward between two exchanges); rank 0 timed it
    span = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        span += out["parts"]["off"]["attention"]["F"](config.train.micro_batch_size * m.seq_len)
    dist.broadcast(span, 0)
    comm = communication(backend, world, m.hidden, dtype, rows, reps, ep_size, float(span), processors)
    comm["a2a_lag"] = exchange_lag(backend, world, processors, ep_size, m.hidden, dtype, rows, float(span), 30 * reps, comm["a2a"])
    # how much slower each rank computes when all run at once (a host's shared processors)
    alone = busy(0.2) if rank == 0 else 0.0
    dist.barrier()
    together = busy(0.2)
    made: list[Any] = [None]
    if rank == 0:
        optimizer, optimizer_tensor_s = _optimizer(dtype, reps)
        # the programs' own work per part call, less the cost of issuing their exchanges (measured apart)
        issue = comm["issue_s"].get(str(ep_size), 0.0) if ep_size > 1 else 0.0
        out["part_overhead_s"] = {
            phase: statistics.median(max(0.0, rest - n_issued * issue) / calls for rest, calls, n_issued in v) if v else 0.0
            for phase, v in overhead.items()
        }
        made[0] = Profile.from_dict({
            "format": FORMAT,
            "device": {
                "backend": backend.name, "name": platform.processor() or platform.machine(), "count": backend.device_count(),
                "ranks_profiled": world, "ep_profiled": ep_size, "host": platform.node(), "cpus": os.cpu_count(),
                "slowdown_all_ranks": together / alone if alone > 0 else None,
            },
            "torch": torch.__version__,
            "shape": shape_of(m, config.train, backend.name).to_dict(),
            "tokens": [s * m.seq_len for s in sizes],
            "processors": processors,
            "optimizer": _plain(optimizer),
            "optimizer_tensor_s": optimizer_tensor_s,
            "host_link": _plain(host_link(backend, reps)) if backend.capabilities.host_copies != "none" else {},
            "host_overlap": backend.capabilities.host_copies == "async",
            "source": f"measured by portapipe profile on {world} {backend.name} ranks",
            **_plain(out),
            **_plain(comm),
        })
    crowding = crowding_ratio(backend, config, ep_size, processors, 4, reps)
    dist.broadcast_object_list(made, 0)  # every rank prices the step below with the profile so far
    if crowding is not None:
        made[0].crowding = {str(world): max(1.0, crowding)}
    made[0].action_s = action_cost(backend, raw, made[0], reps, warmup)
    return made[0].to_dict() if rank == 0 else None


def _plain(x: Any) -> Any:
    """Linear costs as the dicts a profile file holds."""
    if isinstance(x, Linear):
        return {"fixed": x.fixed, "per_unit": x.per_unit}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x
