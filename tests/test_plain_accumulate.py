"""Your own model: gradient accumulation over Pipeline.step calls equals one process's summed
gradients, and a parameter frozen on some ranks only is refused before any step."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from portapipe.ranks.launch import run_ranks

from .test_plain import M, _batch, _loss, _modules

pytestmark = pytest.mark.multiproc


def _rank(backend: Any) -> dict[str, Any]:
    import torch.distributed as dist

    import portapipe

    out: dict[str, Any] = {}
    pipe = portapipe.pipeline(_modules(4, True), backend=backend, loss_fn=_loss, schedule="dualpipev", microbatches=M)
    pipe.step(*_batch(True, 0))
    pipe.step(*_batch(True, 1), accumulate=True)
    out["accumulated"] = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    pipe.step(*_batch(True, 1))  # without accumulate: this step's gradient alone
    out["replaced"] = {k: p.grad.clone() for k, p in pipe.named_parameters()}

    modules = _modules(2, True)
    if dist.get_rank() == 1:
        modules[1][0].bias.requires_grad_(False)  # frozen on one of the two ranks holding it (DualPipe: both hold both blocks)
    try:
        portapipe.pipeline(modules, backend=backend, loss_fn=_loss, schedule="dualpipe", microbatches=M)
        out["refusal"] = "no error"
    except ValueError as exc:
        out["refusal"] = str(exc)
    return out


def _one_process(batches: list[int]) -> dict[str, torch.Tensor]:
    """The sum over ``batches`` of each batch's mean micro-batch loss's gradient, in one process."""
    model = nn.Sequential(*_modules(4, True))
    for b in batches:
        x, y = _batch(True, b)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (_loss(model(xm), ym) / M).backward()
    return {k: p.grad for k, p in model.named_parameters()}


def test_accumulated_steps_sum_their_gradients_and_a_plain_step_replaces_them() -> None:
    results = run_ranks(_rank, 2)
    for key, batches in (("accumulated", [0, 1]), ("replaced", [1])):
        ref = _one_process(batches)
        assert {k for r in results for k in r[key]} == ref.keys()  # DualPipeV: each rank holds half the blocks
        for r in results:
            worst = max(float((g - ref[k]).norm() / ref[k].norm()) for k, g in r[key].items())
            assert worst <= 1e-12, (key, worst)
    assert [r["refusal"] for r in results] == [
        "parameter 1.0.bias requires grad on rank 0 but not on rank 1: every rank must freeze the same parameters "
        "(requires_grad_(False) on each)"
    ] * 2
