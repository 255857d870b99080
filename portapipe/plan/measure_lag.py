"""Exchange lag for ``portapipe profile``: how long an all-to-all waits for its EP peers on a
host whose ranks share the processors."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..models.expert_parallel import ExpertParallel
from ..scheduling.exchange import exchange
from .measure_clock import mean_over, rounds
from .profile import Linear

def exchange_lag(
    backend: Any, world: int, processors: float | None, ep_size: int, hidden: int, dtype: torch.dtype, rows: int,
    span: float, reps: int, a2a: dict[str, Linear],
) -> dict[str, Linear]:
    """How long exchanges wait for their EP peers on a host whose ranks share the processors:
    EP groups of ``ep_size`` ranks (2 if 1) compute and exchange in turns, the first group alone,
    then every rank at once (ranks past the last whole group compute alike without exchanging);
    ``fixed + per_unit * span``, the mean over the exchanging ranks of the mean wait less the
    exchange's latency, keyed by the ranks computing at once."""
    n = max(2, ep_size)
    if processors is None or world < n:
        return {}
    rank = dist.get_rank()
    groups = [backend.new_group(list(range(k, k + n))) for k in range(0, world - n + 1, n)]
    per = max(1, rows // n)
    x = torch.randn(per * n, hidden, dtype=dtype)
    splits = [per] * n
    sent = per * (n - 1) * hidden * x.element_size()
    spans = [0.0, span / 2, span]  # the stretches of compute a program has between exchanges
    out: dict[str, Linear] = {}
    for running in sorted({n, world}):
        waits = [0.0] * len(spans)
        exchanging = min(running, n * len(groups))
        if rank < exchanging:
            ep = ExpertParallel(backend, n, rank % n, groups[rank // n])
            waits = rounds(lambda: exchange(ep, x, splits, splits).wait(), spans, reps)[0]
        elif rank < running:
            rounds(lambda: None, spans, reps)
        waits = mean_over(backend, waits, None, exchanging)
        latency = a2a[str(n)](sent) if str(n) in a2a else 0.0
        out[str(running)] = Linear.fit([(s, max(0.0, w - latency)) for s, w in zip(spans, waits)])
    return out
