"""Routers: tokens ``x[T, hidden]`` -> (weights[T, k], expert indices[T, k]).

- :class:`Router` (portapipe, deepseek_v3): sigmoid affinities, DeepSeek's auxiliary-loss-free
  bias (added to the affinities only to choose experts), optional group-limited routing,
  normalised top-k weights times ``routed_scale``. For deepseek_v3 it computes as transformers
  does: scores in float32, top-k unsorted, the normalising sum plus 1e-20, normalisation only
  with ``norm_topk_prob``.
- :class:`SoftmaxRouter` (qwen3_moe): a softmax over all experts (in float32), top-k, optionally
  renormalised (``norm_topk_prob``); no bias, so :meth:`~SoftmaxRouter.update_bias` does nothing.

Every router's ``route(x, affinities=True)`` also gives each token's affinities to every routed
expert, normalised to sum 1 (what the sequence-wise balance loss reads, :mod:`.objective`); ``forward``
is its first two results. Every router has ``update_bias(counts)``, which the training step calls with each step's global
expert loads, and ``forced``: None, or a :class:`ForcedRouting` (the ``bench`` section's
benchmark-only routings, set by :func:`force_routing`) that chooses the experts instead of the
scores; the weights are still the scores of the chosen experts, so gradients flow as usual.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import BenchConfig, ModelConfig
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


class ForcedRouting:
    """Benchmark-only expert choice for one router.

    ``log_p`` None: round-robin (token t's j-th expert is ``(offset + t * k + j) % E``, the offset
    running on over calls, or 0 at every call with ``restart``: the choice then depends on the
    token's position only, not on the order of the calls), so every expert gets the same rows:
    routing forced to uniform, as the peers benchmark. Else each token draws its ``k`` distinct
    experts with probabilities proportional to ``exp(log_p)`` (Gumbel top-k from a generator
    seeded per layer), so the expert loads follow a recorded table.
    """

    def __init__(self, n_experts: int, top_k: int, log_p: torch.Tensor | None = None, seed: int = 0, restart: bool = False) -> None:
        self.n_experts, self.top_k, self.log_p = n_experts, top_k, log_p
        self.offset = 0
        self.restart = restart
        self.gen = torch.Generator().manual_seed(seed)

    def choose(self, tokens: int, device: torch.device) -> torch.Tensor:
        """Expert indices [tokens, k] (int64)."""
        if self.log_p is None:
            flat = (self.offset + torch.arange(tokens * self.top_k)) % self.n_experts
            if not self.restart:
                self.offset = (self.offset + tokens * self.top_k) % self.n_experts
            return flat.view(tokens, self.top_k).to(device)
        u = torch.rand(tokens, self.n_experts, generator=self.gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        return (self.log_p - torch.log(-torch.log(u))).topk(self.top_k, dim=1).indices.to(device)


def force_routing(bench: BenchConfig, model: ModelConfig, routers: dict[int, nn.Module], seed: int) -> None:
    """Give each router (by global layer index) the ``bench`` section's routing, if it asks for one.

    ``router_skew_from``: MoE layer i (counted from the first MoE layer) follows row
    ``i % rows`` of the loads file. Raises ValueError naming the file and what does not fit.
    """
    table = skew_table(bench, model)
    if table is None and not bench.force_uniform_routing:
        return
    for index, router in routers.items():
        log_p = None
        if table is not None:
            row = table[(index - model.n_dense) % table.shape[0]]
            log_p = torch.log(row / row.sum())
        router.forced = ForcedRouting(model.n_experts, model.top_k, log_p, seed=seed * 1000 + index)


def skew_table(bench: BenchConfig, model: ModelConfig) -> torch.Tensor | None:
    """The loads of ``bench.router_skew_from`` [rows, n_experts] (None when unset), checked."""
    if bench.router_skew_from is None:
        return None
    from ..balancing.loads_file import read_loads

    path = bench.router_skew_from
    table = read_loads(path)
    if table.shape[1] != model.n_experts:
        raise ValueError(f"bench.router_skew_from: {path} has {table.shape[1]} loads per row; the model has "
                         f"model.n_experts = {model.n_experts}")
    if bool(((table > 0).sum(1) < model.top_k).any()):
        raise ValueError(f"bench.router_skew_from: {path} has a row with fewer than model.top_k = {model.top_k} "
                         "experts of load > 0; each token needs that many distinct experts")
    return table


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
        self.forced: ForcedRouting | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x[T, H] -> (weights[T, k], expert indices[T, k])."""
        w, idx, _ = self.route(x)
        return w, idx

    def route(self, x: torch.Tensor, affinities: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x[T, H] -> (weights[T, k], expert indices[T, k], normalised affinities[T, E] or None
        unless asked): the sigmoid scores over their sum per token (the report's s'_{i,t})."""
        if self.precision is None or self.precision == x.dtype:
            logits = self.gate(x)
        else:  # the scores in float32 (the weight's gradient is then computed with the input's)
            logits = F.linear(x.to(self.precision), self.gate.weight.to(self.precision))
        scores = torch.sigmoid(logits)
        choice = scores.detach() + self.bias.to(scores.dtype)
        if self.n_groups > 1:
            choice = group_limited(choice, self.n_groups, self.topk_groups)
        if self.forced is None:
            idx = choice.topk(self.top_k, dim=-1, sorted=self.sorted).indices
        else:
            idx = self.forced.choose(x.shape[0], x.device)
        w = scores.gather(1, idx)
        if self.normalize:
            total = w.sum(-1, keepdim=True)
            w = w / (total + self.eps if self.eps else total)
        return (w * self.scale).to(x.dtype), idx, scores / scores.sum(-1, keepdim=True) if affinities else None

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
        self.forced: ForcedRouting | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w, idx, _ = self.route(x)
        return w, idx

    def route(self, x: torch.Tensor, affinities: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """x[T, H] -> (weights[T, k], expert indices[T, k], softmax probabilities[T, E] or None unless asked)."""
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=HF_PRECISION)
        if self.forced is None:
            w, idx = probs.topk(self.top_k, dim=-1)
        else:
            idx = self.forced.choose(x.shape[0], x.device)
            w = probs.gather(1, idx)
        if self.normalize:
            w = w / w.sum(-1, keepdim=True)
        return w.to(logits.dtype), idx, probs if affinities else None

    def update_bias(self, counts: torch.Tensor) -> None:
        """Nothing to update: this router has no load-balancing bias (balance with EPLB / LPLB)."""
