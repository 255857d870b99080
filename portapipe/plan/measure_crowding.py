"""Crowding for ``portapipe profile``: how much slower the ranks of one host compute when all
of them run at once than when a few do (processors shared by more ranks than they have)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config
from ..models.expert_parallel import ExpertParallel
from ..scheduling.overlap import Tape, run
from ..scheduling.wgrad import WeightGradQueue
from .measure_clock import cpu
from .measure_parts import block_for, tokens


def crowding_ratio(backend: Any, config: Config, ep_size: int, processors: float | None, rounds: int, reps: int) -> float | None:
    """How much more processor time the model's forward and backward take when every rank of
    the host computes at once than when an EP group of ``ep_size`` ranks (that the parts were
    timed on) does alone: the ratio of the medians, the two taken in alternating rounds so that
    a drift in the machine's speed hits both alike. None where the ranks fit the processors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if processors is None or world <= processors:
        return None
    groups = [backend.new_group(list(range(k, k + ep_size))) for k in range(0, world - ep_size + 1, ep_size)] if ep_size > 1 else []
    full = rank // ep_size < len(groups)  # ranks past the last whole group compute without EP
    ep = ExpertParallel(backend, ep_size, rank % ep_size, groups[rank // ep_size]) if full else ExpertParallel(backend, 1, 0, None)
    block = block_for(config, ep, "off")

    def step(seed: int) -> float:
        x, y = tokens(config, config.train.micro_batch_size, seed)
        tape, queue = Tape(), WeightGradQueue()
        t0 = cpu()
        out = run(block.program(tape, x, y))
        run(tape.backward(out, torch.ones_like(out), queue))
        queue.run()
        used = cpu() - t0
        for p in block.parameters():
            p.grad = None
        return used

    alone: list[float] = []
    together: list[float] = []
    for r in range(rounds + 1):  # the first round warms up
        dist.barrier()
        if rank < ep_size:
            got = [step(1000 * r + i + 17 * rank) for i in range(reps)]
            alone += got if r else []
        dist.barrier()
        got = [step(1000 * r + i + 17 * rank) for i in range(reps)]
        together += got if r else []
    ratio = torch.tensor([statistics.median(together) / statistics.median(alone) if alone else 0.0], dtype=torch.float64)
    dist.all_reduce(ratio)
    return float(ratio) / min(ep_size, world)


def busy(seconds: float) -> float:
    """Fixed compute work of about ``seconds`` on one processor; returns how long it took."""
    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    n = 0
    while n < 400 or time.perf_counter() - t0 < seconds and n < 20000:
        a = torch.tanh(a @ a)
        n += 1
    return (time.perf_counter() - t0) / n
