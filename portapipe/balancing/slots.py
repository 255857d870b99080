"""The slot rule of the non-published EPLB policies: no GPU holds two replicas of one expert.

A second replica on the same GPU keeps the same weights (and optimizer state) twice there; it
only changes the share of its expert's tokens the GPU gets, which matters only when a GPU has
few slots for very uneven loads. ``refined`` and ``incremental`` keep the rule; the published
``hierarchical`` / ``global`` policies do not (they stay identical to the published algorithm). A plan keeping it needs at most R / P <= E slots per GPU and at most P replicas per expert.
"""

from __future__ import annotations

import torch


def duplicated(phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Per layer [L] bool: some GPU holds two replicas of one expert."""
    layers, slots = phy2log.shape
    v = phy2log.view(layers, num_gpus, slots // num_gpus).sort(-1).values
    return (v[..., 1:] == v[..., :-1]).flatten(1).any(1)


def check_distinct(phy2log: torch.Tensor, num_gpus: int, what: str) -> None:
    """ValueError naming the first layer, GPU and expert where ``what`` breaks the slot rule."""
    layers, slots = phy2log.shape
    per = slots // num_gpus
    v = phy2log.view(layers, num_gpus, per).sort(-1).values
    twice = v[..., 1:] == v[..., :-1]
    if bool(twice.any()):
        layer, gpu, k = (int(i) for i in twice.nonzero()[0])
        raise ValueError(
            f"{what} puts two replicas of expert {int(v[layer, gpu, k])} on GPU {gpu} (layer {layer}); "
            "a GPU may hold each expert once (plan it with policy refined)"
        )


def check_fits(num_experts: int, num_replicas: int, num_gpus: int) -> None:
    """ValueError when no placement can keep the rule: more slots per GPU than experts."""
    per = num_replicas // num_gpus
    if per > num_experts:
        raise ValueError(
            f"{per} slots per GPU for {num_experts} experts: a GPU may hold each expert once, so "
            f"num_replicas / num_gpus must be <= experts (num_replicas <= {num_experts * num_gpus})"
        )


def replicas_in_slot_order(phy2log: torch.Tensor, num_experts: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log2phy [L, E, width], logcnt [L, E]): each expert's slots in ascending order, -1 padded at
    the tail; ``width`` defaults to the largest replica count."""
    layers, slots = phy2log.shape
    logcnt = torch.zeros(layers, num_experts, dtype=torch.int64).scatter_add_(1, phy2log, torch.ones_like(phy2log))
    if width is None:
        width = int(logcnt.max()) if logcnt.numel() else 1
    by_expert = phy2log.sort(dim=1, stable=True)
    start = logcnt.cumsum(1) - logcnt
    pos = torch.arange(slots).expand(layers, slots) - start.gather(1, by_expert.values)
    log2phy = torch.full((layers, num_experts * width), -1, dtype=torch.int64)
    log2phy.scatter_(1, by_expert.values * width + pos, by_expert.indices)
    return log2phy.view(layers, num_experts, width), logcnt
