"""What differs between the architectures (portapipe, deepseek_v3, qwen3_moe): the attention, the
router and the norms' precision; everything else is one implementation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..config import ModelConfig
from .attention import HF_PRECISION, Attention, GroupedQueryAttention, LatentAttention
from .functions import RMSNorm
from .routing import Router, SoftmaxRouter


@dataclass(frozen=True)
class Arch:
    """What differs between architectures: the attention, the router and the norms' precision.

    Everything else (dense FFN, shared experts, routed experts and their dispatch / combine,
    the memory options' hooks, the balancer's routing, the blocks) is one implementation.
    """

    attention: Callable[[ModelConfig, torch.dtype], nn.Module]
    router: Callable[[ModelConfig, torch.dtype], nn.Module]
    #: dtype the RMSNorms compute in (None: the model's)
    norm_precision: torch.dtype | None = None


ARCHITECTURES: dict[str, Arch] = {
    "portapipe": Arch(Attention, Router),
    "deepseek_v3": Arch(LatentAttention, Router, HF_PRECISION),
    "qwen3_moe": Arch(GroupedQueryAttention, SoftmaxRouter, HF_PRECISION),
}


def norm(cfg: ModelConfig, dim: int, dtype: torch.dtype) -> RMSNorm:
    # float16's range cannot hold the backward's rsqrt(mean x^2)^3 of small activations: float32 there
    precision = ARCHITECTURES[cfg.arch].norm_precision or (torch.float32 if dtype == torch.float16 else None)
    return RMSNorm(dim, dtype, cfg.norm_eps, precision)
