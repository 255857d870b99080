"""The feed-forward parts: the dense SwiGLU FFN, a rank's routed experts as grouped matmuls, and the
MoE that joins shared and routed experts (its dispatch and combine are parts of the layer's program)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..backends.base import Backend
from ..config import ModelConfig
from ..fp8.dispatch import Fp8Rows, split_received
from ..scheduling.stage import expert_ids, mark_expert
from .arch import ARCHITECTURES
from .expert_clock import ExpertClock
from .expert_parallel import DispatchPlan, ExpertParallel, plan_dispatch
from .functions import swiglu, swiglu_fp8_kept
from .linear import Linear, grouped_linear


class DenseFFN(nn.Module):
    """SwiGLU MLP: down(silu(gate(x)) * up(x)); gate and up fused in one projection."""

    def __init__(self, hidden: int, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.width = width
        self.gate_up = Linear(hidden, 2 * width, dtype)
        self.down = Linear(width, hidden, dtype)
        #: memory.fp8_activations (set by portapipe.models.fp8_layers.enable_fp8): the activation
        #: keeps its input in FP8 and the down projection remakes its own input from it
        self.fp8_cache = False

    def forward(self, x: torch.Tensor, zm: Any = None) -> torch.Tensor:
        gu = self.gate_up(x)
        if self.fp8_cache:  # nothing of the activation's output is kept: zero-memory level1 has nothing to drop
            act, remade = swiglu_fp8_kept(gu, self.width)
            return self.down(act, source=remade)
        # zm: zero-memory (portapipe.memory.zero_memory) may recompute the activation in backward.
        return self.down(swiglu(gu, self.width) if zm is None else zm.activation(swiglu, gu, self.width))


class Experts(nn.Module):
    """This EP rank's routed experts as stacked weights, run as grouped matmuls."""

    def __init__(self, cfg: ModelConfig, n_local: int, first: int, dtype: torch.dtype, logical: list[int] | None = None) -> None:
        super().__init__()
        self.width, self.first = cfg.moe_hidden, first
        self.gate_up = nn.Parameter(torch.empty(n_local, cfg.hidden, 2 * cfg.moe_hidden, dtype=dtype))
        self.down = nn.Parameter(torch.empty(n_local, cfg.moe_hidden, cfg.hidden, dtype=dtype))
        self.logical = list(range(first, first + n_local)) if logical is None else logical
        #: the GEMMs in FP8, and memory.fp8_activations (both set by portapipe.models.fp8_layers.enable_fp8)
        self.fp8 = self.fp8_cache = False

    @property
    def logical(self) -> list[int]:
        """Logical expert held by each local slot (a balancer may replicate and reorder them)."""
        return expert_ids(self.gate_up)

    @logical.setter
    def logical(self, ids: list[int]) -> None:
        for p in (self.gate_up, self.down):
            mark_expert(p, ids)  # sharded over EP, reduced over DP only

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor | Fp8Rows, offs: torch.Tensor, backend: Backend, tiles: Sequence[int] = (), zm: Any = None
    ) -> torch.Tensor:
        """Rows ``x`` grouped by ``offs`` into tiles (``tiles``: rows per tile) of local-expert
        groups (tile-major), each output row scaled by its router weight ``weights[row]``.
        ``weights`` may be the rows of an FP8 dispatch (:class:`~portapipe.fp8.dispatch.Fp8Rows`,
        ``x`` their stand-in): the up projection takes their FP8 values as they arrived."""
        rows = None
        if isinstance(weights, Fp8Rows):
            rows = weights.rows
            x, weights = split_received(x, weights)
        # the recipe (portapipe.fp8): every row's input and output gradient as FP8 values, as they travel
        # zero-memory drops and fetches the input again: an FP8 copy of it would stay
        gu = grouped_linear(x, self.gate_up, offs, backend, tiles, self.fp8, rows, fp8_input=True, source=self.fp8_cache and zm is None)
        if self.fp8_cache:  # as DenseFFN's: the activation's input in FP8, the down projection's input remade
            act, remade = swiglu_fp8_kept(gu, self.width, weights)
            return grouped_linear(act, self.down, offs, backend, tiles, self.fp8, fp8_grad=True, source=remade)
        # zm: zero-memory (portapipe.memory.zero_memory) may recompute the activation in backward.
        act = swiglu(gu, self.width, weights) if zm is None else zm.activation(swiglu, gu, self.width, weights)
        return grouped_linear(act.contiguous(), self.down, offs, backend, tiles, self.fp8, fp8_grad=True)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ep: ExpertParallel, dtype: torch.dtype, index: int = -1) -> None:
        super().__init__()
        self.ep = ep
        self.index = index
        self.n_experts = cfg.n_experts
        self.router = ARCHITECTURES[cfg.arch].router(cfg, dtype)
        #: how the dispatch and the combine travel (:class:`~portapipe.scheduling.exchange.Wire`; None:
        #: as they are; FP8 under train.fp8, set by portapipe.models.fp8_layers.enable_fp8)
        self.dispatch_wire: Any = None
        self.combine_wire: Any = None
        self.refetch_wire: Any = None  # zero-memory's re-dispatch of the rows alone
        self.shared = DenseFFN(cfg.hidden, cfg.moe_hidden * cfg.n_shared, dtype) if cfg.n_shared > 0 else None
        if ep.balancer is None:
            first, _ = ep.expert_range(cfg.n_experts)
            self.experts = Experts(cfg, ep.local_experts(cfg.n_experts), first, dtype)
        else:  # physical slots, each holding the logical expert the balancer's placement says
            slots = ep.balancer.experts_on(index)
            self.experts = Experts(cfg, len(slots), slots[0], dtype, logical=slots)
            # Rows this rank routed to each physical slot since the balancer last read them.
            self.register_buffer("slot_counts", torch.zeros(ep.balancer.num_slots, dtype=torch.int64), persistent=False)
        # Rows routed to each logical expert by this rank since the last bias update.
        self.register_buffer("step_counts", torch.zeros(cfg.n_experts, dtype=torch.int64), persistent=False)
        self.clock = ExpertClock()  # this rank's expert compute per step (EP wait figures)

    def dispatch_plan(self, idx: torch.Tensor) -> DispatchPlan:
        """Plan the dispatch of routed entries ``idx[T, k]`` (logical ids) and count them."""
        if self.ep.balancer is None:
            plan = plan_dispatch(self.ep, idx, self.n_experts, self.index)
            self.step_counts += plan.counts
            return plan
        slots = self.ep.balancer.route(self.index, idx)
        plan = plan_dispatch(self.ep, slots, self.ep.balancer.num_slots, self.index)
        self.step_counts += torch.bincount(idx.reshape(-1), minlength=self.n_experts)
        self.slot_counts += plan.counts
        return plan
