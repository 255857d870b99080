"""The host link as offload uses it (``portapipe profile``): the backend's own copies between a
host buffer and the device (:meth:`~portapipe.backends.base.Backend.copy_async`), each way at two
sizes, the least disturbed of a few repetitions in wall time, fitted as latency + bytes x seconds per byte."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from .profile import Linear

#: bytes of the two copies timed each way
SIZES = (1 << 20, 1 << 24)


def host_link(backend: Any, reps: int) -> dict[str, Linear]:
    """``h2d`` and ``d2h``: one copy's seconds as ``fixed + per_unit x bytes`` on this backend."""
    device = backend.device()
    out = {}
    for way in ("h2d", "d2h"):
        samples = []
        for n in SIZES:
            host = backend.host_buffer(n, torch.uint8, device).fill_(1)
            dev = torch.zeros(n, dtype=torch.uint8, device=device)
            dst, src = (dev, host) if way == "h2d" else (host, dev)
            best = math.inf
            for _ in range(reps + 1):  # the first warms the copy path up
                backend.synchronize()
                t0 = time.perf_counter()
                backend.copy_async(dst, src).synchronize()
                best = min(best, time.perf_counter() - t0)
            samples.append((float(n), best))
        out[way] = Linear.fit(samples)
    return out
