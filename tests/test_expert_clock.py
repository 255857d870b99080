"""ExpertClock: forward and backward expert compute of one MoE layer, and the rows computed."""

from __future__ import annotations

import pytest
import torch

from portapipe.models import expert_clock
from portapipe.models.expert_clock import ExpertClock


def test_forward_and_backward_are_timed_and_rows_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a scripted clock: the forward from 10 to 13, the backward's stamps at 20 and 27, so
    3 + 7 = 10 seconds over 512 rows; a take starts afresh and ``last`` keeps what it returned."""
    ticks = iter([10.0, 13.0, 20.0, 27.0])
    monkeypatch.setattr(expert_clock, "now", lambda: next(ticks))
    clock = ExpertClock()
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256, requires_grad=True)
    out = clock.run(lambda rows, weight: (rows @ weight).tanh() @ weight, x, w)
    assert (clock.seconds, clock.rows) == (3.0, 512)
    out.sum().backward()
    assert clock.seconds == 10.0  # the backward between the stamps counted too
    assert torch.allclose(x.grad, torch.autograd.grad(((x @ w).tanh() @ w).sum(), x)[0])  # the stamps are identities
    assert clock.take() == (10.0, 512) and clock.last == (10.0, 512)
    assert (clock.seconds, clock.rows) == (0.0, 0)
    assert clock.take() == (0.0, 0) and clock.last == (0.0, 0)


def test_the_real_clock_counts_forward_and_backward() -> None:
    clock = ExpertClock()
    w = torch.randn(256, 256, requires_grad=True)
    x = torch.randn(512, 256, requires_grad=True)
    out = clock.run(lambda rows, weight: (rows @ weight).tanh() @ weight, x, w)
    after_forward = clock.seconds
    assert after_forward > 0 and clock.rows == 512
    out.sum().backward()
    assert clock.seconds > after_forward


def test_no_gradient_no_stamps() -> None:
    clock = ExpertClock()
    with torch.no_grad():
        out = clock.run(lambda rows: rows * 2, torch.ones(3, 2, requires_grad=True))
    assert out.grad_fn is None and clock.rows == 3


def test_ep_step_figures_against_the_closed_form() -> None:
    """wait = sum over layers of (slowest peer - own), balancedness = mean / max rows, from one gather."""
    from types import SimpleNamespace

    from portapipe.metrics.step import ep_step_figures

    peer = torch.tensor([[3.0, 300.0], [1.0, 0.0]])  # the other EP rank: (seconds, rows) of layers 0 and 1

    class Backend:
        calls = 0

        def all_gather(self, parts, local, group=None):
            Backend.calls += 1
            parts[0].copy_(local)
            parts[1].copy_(peer)

    layers = []
    for seconds, rows in ((1.0, 100), (2.0, 50)):
        clock = ExpertClock()
        clock.seconds, clock.rows = seconds, rows
        layers.append(SimpleNamespace(moe=SimpleNamespace(clock=clock)))
    wait, balancedness, n = ep_step_figures(Backend(), SimpleNamespace(ep=2, ep_group=None), layers)
    assert Backend.calls == 1 and n == 2
    assert wait == (3.0 - 1.0) + (2.0 - 2.0)
    assert balancedness == (200 / 300) + (25 / 50)  # summed over layers; the caller divides
