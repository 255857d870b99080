"""AdamW on flat tensors (torch.optim.AdamW's update, decoupled weight decay on given ranges)."""

from __future__ import annotations

import math

import torch

EPS = 1e-8  # torch.optim.AdamW's default


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    decayed: list[tuple[int, int]],
) -> None:
    """One AdamW update of the flat ``param`` in place (``step`` 1-based); weight decay applies to
    the ``decayed`` (start, end) ranges only (matrices; norm gains and biases are not decayed)."""
    b1, b2 = betas
    if weight_decay:
        for a, b in decayed:
            param[a:b].mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    bias1 = 1.0 - b1**step
    bias2_sqrt = math.sqrt(1.0 - b2**step)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(EPS)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)
