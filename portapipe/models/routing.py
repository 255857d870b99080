"""Routers: tokens ``x[T, hidden]`` -> (weights[T, k], expert indices[T, k]).

- :class:`Router` (portapipe, deepseek_v3): sigmoid affinities, DeepSeek's auxiliary-loss-free
  bias (added to the affinities only to choose experts), optional group-limited routing,
  normalised top-k weights times ``routed_scale``. For deepseek_v3 it computes as transformers
  does: scores in float32, top-k unsorted, the normalising sum plus 1e-20, normalisation only
  with ``norm_topk_prob``.
- :class:`SoftmaxRouter` (qwen3_moe): a softmax over all experts (in float32), top-k, optionally
  renormalised (``norm_topk_prob``); no bias, so :meth:`~SoftmaxRouter.update_bias` does nothing.

Every router has ``update_bias(counts)``, which the training step calls with each step's global
expert loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from .attention import HF_PRECISION
from .linear import Linear


def group_limited(choice: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``choice[T, E]`` with every expert outside each token's ``topk_groups`` best groups at -inf.

    A group's score is the sum of its two best experts' (its one, if a group has one expert).
    """
    t, e = choice.shape
    per = e // n_groups
    grouped = choice.view(t, n_groups, per)
    group_score = grouped.topk(min(2, per), dim=-1).values.sum(-1)
    keep = group_score.topk(topk_groups, dim=-1).indices
    mask = torch.zeros(t, n_groups, dtype=torch.bool, device=choice.device).scatter_(1, keep, True)
    return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(t, e)


class Router(nn.Module):
    """Sigmoid top-k routing with the aux-loss-free bias and optional group limit."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.n_groups, self.topk_groups = cfg.n_groups, cfg.topk_groups
        self.scale = cfg.routed_scale
        self.speed = cfg.bias_update_speed
        self.gate = Linear(cfg.hidden, cfg.n_experts, dtype)
        # At least float32 (a bfloat16 bias would not move by bias_update_speed), the model's dtype when wider.
        self.register_buffer("bias", torch.zeros(cfg.n_experts, dtype=torch.promote_types(dtype, torch.float32)))
        hf = cfg.arch == "deepseek_v3"
        self.precision = HF_PRECISION if hf else None
        self.normalize = bool(cfg.norm_topk_prob) if hf else cfg.top_k > 1
        self.sorted = not hf
        self.eps = 1e-20 if hf else 0.0

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x[T, H] -> (weights[T, k], expert indices[T, k])."""
        if self.precision is None or self.precision == x.dtype:
            logits = self.gate(x)
        else:  # the scores in float32 (the weight's gradient is then computed with the input's)
            logits = F.linear(x.to(self.precision), self.gate.weight.to(self.precision))
        scores = torch.sigmoid(logits)
        choice = scores.detach() + self.bias.to(scores.dtype)
        if self.n_groups > 1:
            choice = group_limited(choice, self.n_groups, self.topk_groups)
        idx = choice.topk(self.top_k, dim=-1, sorted=self.sorted).indices
        w = scores.gather(1, idx)
        if self.normalize:
            total = w.sum(-1, keepdim=True)
            w = w / (total + self.eps if self.eps else total)
        return (w * self.scale).to(x.dtype), idx

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """One aux-loss-free step: raise under-loaded experts' bias, lower over-loaded ones'."""
        load = counts.to(torch.float64)
        self.bias += (self.speed * torch.sign(load.mean() - load)).to(self.bias.dtype)


class SoftmaxRouter(nn.Module):
    """Softmax top-k routing (qwen3_moe)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.normalize = bool(cfg.norm_topk_prob)
        self.gate = Linear(cfg.hidden, cfg.n_experts, dtype)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=HF_PRECISION)
        w, idx = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            w = w / w.sum(-1, keepdim=True)
        return w.to(logits.dtype), idx

    def update_bias(self, counts: torch.Tensor) -> None:
        """Nothing to update: this router has no load-balancing bias (balance with EPLB / LPLB)."""
