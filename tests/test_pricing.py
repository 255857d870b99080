"""``balancer.min_gain: auto`` against its closed form (pricing.py): a full migration's time
over ``interval`` steps of expert time, means over ranks, priced by the last migration's seconds
per byte or, before one, the replica gradient sum's."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from portapipe.balancing import pricing
from portapipe.balancing.runtime import ExpertBalancer


def _layer(seconds: float, rows: int) -> Any:
    return SimpleNamespace(moe=SimpleNamespace(clock=SimpleNamespace(last=(seconds, rows))))


class _TwoRanks:
    """torch.distributed as this rank sees it, the other rank's row added by the all-reduce."""

    def __init__(self, other: list[float]) -> None:
        self.other = torch.tensor(other, dtype=torch.float64)

    def all_reduce(self, t: torch.Tensor) -> None:
        t.add_(self.other)

    def get_world_size(self) -> int:
        return 2


def _balancer(interval: int, migrate: float, summed: float) -> Any:
    """What ExpertBalancer._auto_min_gain reads: two MoE layers of 0.25 + 0.5 s expert time per step,
    every slot's rows 4e6 bytes (worked out before)."""
    return SimpleNamespace(kind="eplb", modules=[_layer(0.25, 10), _layer(0.5, 20)], full_bytes=4_000_000, interval=interval,
                           migrate_s_per_byte=migrate, sum_s_per_byte=summed, min_gain=0.0, rebalancer=SimpleNamespace(min_gain=0.0))


@pytest.mark.parametrize("interval", [1, 5, 50])
def test_auto_min_gain_is_a_full_migration_over_interval_steps_of_expert_time(monkeypatch: pytest.MonkeyPatch, interval: int) -> None:
    # the other rank: 1.25 s of expert time, a full migration of 6e6 bytes at 2e-9 s per byte
    monkeypatch.setattr(pricing, "dist", _TwoRanks([1.25, 6e6 * 2e-9, 1.0, 1.0]))
    b = _balancer(interval, migrate=1e-9, summed=7e-9)  # the last migration's price, not the sum's
    value = ExpertBalancer._auto_min_gain(b, optimizer=object())
    expected = (4e6 * 1e-9 + 6e6 * 2e-9) / (interval * (0.75 + 1.25))  # 0.016 s / (interval x 2 s)
    assert value == pytest.approx(expected, rel=1e-12) and value == pytest.approx(0.008 / interval, rel=1e-12)
    assert b.min_gain == b.rebalancer.min_gain == value


def test_before_a_migration_the_replica_sum_prices_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pricing, "dist", _TwoRanks([1.25, 6e6 * 2e-9, 1.0, 1.0]))
    value = ExpertBalancer._auto_min_gain(_balancer(4, migrate=0.0, summed=3e-9), optimizer=object())
    assert value == pytest.approx((4e6 * 3e-9 + 6e6 * 2e-9) / (4 * 2.0), rel=1e-12)


def test_a_rank_that_priced_nothing_makes_it_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    # the other rank has MoE layers but timed neither a migration nor a replica sum
    monkeypatch.setattr(pricing, "dist", _TwoRanks([1.25, 0.0, 0.0, 1.0]))
    assert ExpertBalancer._auto_min_gain(_balancer(4, migrate=1e-9, summed=0.0), optimizer=object()) == 0.0
