"""Which source each sample of the run comes from: a blend with weights.

The run's samples are numbered in order (step ``t``'s global batch holds samples ``t x B .. t x B
+ B - 1``). Megatron's blended-dataset rule assigns sample s to the source whose count lags its
weight most (the largest ``w_d x (s + 1) - count_d``, ties to the lower index), so every source's
share of the first s samples stays within one sample of its weight. That rule reads all earlier
samples; here it is run once over a period of :data:`PERIOD` samples and repeated, so that where
any sample comes from, and how many samples of its source came before it, is a lookup: a step's
batch stays a pure function of the step. Each source's share then differs from its weight by at
most ``1 / PERIOD`` in the long run and by about two samples over any stretch of samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERIOD = 10_000


class Blend:
    """Samples to sources, for weights ``weights`` (any positive numbers; normalised)."""

    def __init__(self, weights: Sequence[float]) -> None:
        w = np.asarray(weights, dtype=np.float64)
        if w.ndim != 1 or not len(w) or not (w > 0).all() or not np.isfinite(w).all():
            raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
        self.weights = w / w.sum()
        weights, counts = self.weights.tolist(), [0] * len(w)
        pattern, rank = [0] * PERIOD, [0] * PERIOD
        for s in range(PERIOD):  # plain floats: the same float64 arithmetic, without numpy's per-call cost
            lag = [wd * (s + 1) - c for wd, c in zip(weights, counts)]
            d = lag.index(max(lag))  # the first of equal lags: the lower index
            pattern[s], rank[s] = d, counts[d]
            counts[d] += 1
        self.pattern, self.rank = np.array(pattern, dtype=np.int64), np.array(rank, dtype=np.int64)
        self.per_period = np.array(counts, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.weights)

    def assign(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's sample count before it) of each of the run's ``samples``."""
        period, r = np.divmod(np.asarray(samples, dtype=np.int64), PERIOD)
        source = self.pattern[r]
        return source, period * self.per_period[source] + self.rank[r]

    def taken(self, samples: int) -> np.ndarray:
        """How many of the run's first ``samples`` samples each source gave."""
        period, r = divmod(int(samples), PERIOD)
        return period * self.per_period + np.bincount(self.pattern[:r], minlength=len(self.weights))
