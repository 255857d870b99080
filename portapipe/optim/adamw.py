"""AdamW on flat tensors (torch.optim.AdamW's update, decoupled weight decay on given ranges)."""

from __future__ import annotations

import math

import torch

EPS = 1e-8  # torch.optim.AdamW's default
#: elements updated at a time when the moments are stored in another dtype than the update's:
#: the widened copies stay a few MiB whatever the bucket's size
PIECE = 1 << 18


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
    compute: torch.dtype | None = None,
) -> None:
    """One AdamW update of the flat ``param`` in place (``step`` 1-based); weight decay applies to
    the ``decayed`` (start, end) ranges only (matrices; norm gains and biases are not decayed).

    ``compute``: the dtype the update is computed in when it differs from the stored tensors'
    (bfloat16 moments under float32 master weights): piece by piece, the moments and the weights
    are widened, updated, and stored back rounded to nearest; the weights move by the widened
    moments' update, as Megatron-Core's optimizer does with bfloat16 ``exp_avg_dtype``."""
    b1, b2 = betas
    if weight_decay:
        for a, b in decayed:
            param[a:b].mul_(1.0 - lr * weight_decay)
    bias1 = 1.0 - b1**step
    bias2_sqrt = math.sqrt(1.0 - b2**step)
    if compute is None or all(t.dtype == compute for t in (param, exp_avg, exp_avg_sq)):
        _update(param, grad, exp_avg, exp_avg_sq, b1, b2, -lr / bias1, bias2_sqrt)
        return
    for at in range(0, param.numel(), PIECE):
        piece = slice(at, min(at + PIECE, param.numel()))
        p, m, v = (t[piece].to(compute) for t in (param, exp_avg, exp_avg_sq))
        _update(p, grad[piece].to(compute), m, v, b1, b2, -lr / bias1, bias2_sqrt)
        for stored, wide in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
            if stored.dtype != compute:
                stored[piece].copy_(wide)


def _update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, b1: float, b2: float,
            step_size: float, bias2_sqrt: float) -> None:
    exp_avg.lerp_(grad, 1.0 - b1)
    exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(EPS)
    param.addcdiv_(exp_avg, denom, value=step_size)
