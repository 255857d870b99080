"""What a rebalance costs: the expert bytes a change of placement moves, inside and between nodes.

A slot whose expert changes needs that expert's parameters and optimizer state. It gets them
from a copy on its own GPU if the old placement had one there (no network), else from a GPU of
its own node that held the expert (intra-node), else from another node (inter-node); a GPU
needing one expert in several slots receives it once. This is exactly what
:func:`portapipe.balancing.migration.plan_migration` sends, given the same node layout.

Bytes per slot (:func:`slot_bytes`): the expert's parameters in their dtype, plus the optimizer
state kept per parameter (AdamW: two moments; SGD with momentum: one) in its dtype, plus a
master copy of the weights when the parameters are kept in a lower precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: optimizer state tensors kept per parameter
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


def slot_bytes(params: int, dtype: str = "bfloat16", optimizer: str = "adamw", state_dtype: str | None = None,
               master_dtype: str | None = None) -> int:
    """Bytes one expert slot carries: ``params`` parameters in ``dtype``, the optimizer's states in
    ``state_dtype`` (default ``dtype``, as torch's AdamW keeps them) and an optional master copy."""
    if params < 1:
        raise ValueError(f"an expert has at least one parameter, got {params}")
    for name, value in (("dtype", dtype), ("state_dtype", state_dtype), ("master_dtype", master_dtype)):
        if value is not None and value not in DTYPE_BYTES:
            raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}; got {value!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZER_STATES)}; got {optimizer!r}")
    per = DTYPE_BYTES[dtype] + OPTIMIZER_STATES[optimizer] * DTYPE_BYTES[state_dtype or dtype]
    return params * (per + (DTYPE_BYTES[master_dtype] if master_dtype else 0))


@dataclass(frozen=True)
class MigrationCost:
    """Per layer [L] int64: slots whose expert changes, and how each gets its expert's rows."""

    changed: torch.Tensor
    local: torch.Tensor  # changed slots filled from a copy on the same GPU
    intra: torch.Tensor  # rows received from a GPU of the same node
    inter: torch.Tensor  # rows received from another node

    def bytes(self, per_slot: int) -> dict[str, int]:
        """Totals over layers: slots changed and bytes moved inside / between nodes."""
        intra, inter = int(self.intra.sum()) * per_slot, int(self.inter.sum()) * per_slot
        return {"slots_changed": int(self.changed.sum()), "bytes_intra_node": intra, "bytes_inter_node": inter,
                "bytes": intra + inter}


def migration_cost(old: torch.Tensor, new: torch.Tensor, num_gpus: int, num_nodes: int = 1) -> MigrationCost:
    """Cost of going from placement ``old`` to ``new`` (both phy2log [L, R]); GPUs are numbered node-major."""
    old, new = torch.as_tensor(old, dtype=torch.int64), torch.as_tensor(new, dtype=torch.int64)
    if old.dim() == 1:
        old, new = old.unsqueeze(0), new.unsqueeze(0)
    if old.shape != new.shape:
        raise ValueError(f"placements differ in shape: {list(old.shape)} and {list(new.shape)}")
    layers, slots = old.shape
    if num_gpus < 1 or slots % num_gpus or num_nodes < 1 or num_gpus % num_nodes:
        raise ValueError(f"{slots} slots over {num_gpus} GPUs in {num_nodes} nodes: slots and GPUs must split evenly")
    experts = int(torch.maximum(old.max(), new.max())) + 1
    gpu = torch.arange(slots) // (slots // num_gpus)
    node = gpu // (num_gpus // num_nodes)
    held = torch.zeros(layers, num_gpus * experts, dtype=torch.bool).scatter_(1, gpu * experts + old, True)
    node_held = held.view(layers, num_nodes, num_gpus // num_nodes, experts).any(2).view(layers, -1)
    changed = old != new
    here = held.gather(1, gpu * experts + new)
    # each (GPU, expert) a GPU lacks crosses once, however many of its slots need it
    need = torch.zeros(layers, num_gpus * experts, dtype=torch.bool).scatter_(1, gpu * experts + new, changed & ~here)
    near = torch.zeros(layers, num_gpus * experts, dtype=torch.bool)
    near.scatter_(1, gpu * experts + new, node_held.gather(1, node * experts + new))
    return MigrationCost(changed.sum(1), (changed & here).sum(1), (need & near).sum(1), (need & ~near).sum(1))
