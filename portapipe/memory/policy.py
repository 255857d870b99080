"""Which layers use which memory option, from the config's ``memory`` section.

``recompute_layers: N`` recomputes the first N layers of every block (stage); with
``recompute: moe`` only the MoE layers among them. ``recompute: norms`` (alone or with moe:
``[norms, moe]``) applies to the same layers, dense and MoE (:class:`~.remake.NormRecompute`). ``zero_memory_layers: N`` applies
zero-memory to the first N MoE layers of every block that are not recomputed (a recomputed
layer keeps nothing to drop). Earlier layers come first because, in every schedule here, a
stage's first layers hold their activations longest.

:func:`configure` sets ``layer.memory`` (a :class:`LayerMemory`, or None) on each layer; the
block's program then runs such layers through :meth:`LayerMemory.program`. ``memory.offload``
(the parts whose saved tensors wait in host memory, :mod:`.offload`) applies to the first
``offload_layers`` layers of every block, beside the others: :func:`configure_offload`.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import MemoryConfig
from ..scheduling.exchange import A2AStats
from .recompute import Recompute
from .remake import NormRecompute
from .zero_memory import ZeroMemory


@dataclass
class LayerMemory:
    """One layer's memory options."""

    zero_memory: ZeroMemory | None = None
    recompute: Recompute | None = None
    #: read by the layer's parts (:meth:`~portapipe.models.layer.Layer.remaking`)
    norms: NormRecompute | None = None

    def program(self, layer: Any, tape: Any, x: torch.Tensor, positions: torch.Tensor | None = None) -> Generator[Any, None, torch.Tensor]:
        """The layer's forward program with its memory options applied (``positions``: as the layer's)."""
        if not tape.record:  # one plain autograd graph (the reference): nothing to drop
            return (yield from layer.program(tape, x, positions))
        if self.recompute is not None and self.recompute.mode == "full":
            return (yield from self.recompute.full(tape, layer, x, positions))
        if layer.moe is None:
            return (yield from layer.program(tape, x, positions))
        routed = layer.routed(tape, x, positions)
        if self.recompute is not None:
            return (yield from self.recompute.moe(tape, layer, *routed))
        hn, send, plan = routed[1], routed[2], routed[-1]
        zm = self.zero_memory.begin(layer, hn, send, plan) if self.zero_memory is not None else None
        return (yield from layer.moe_program(tape, *routed, zm))


def plan_layers(memory: MemoryConfig, is_moe: list[bool]) -> list[LayerMemory | None]:
    """Options for a block's layers in order (``is_moe[i]``: layer i has routed experts)."""
    n_rec = len(is_moe) if memory.recompute_layers is None else memory.recompute_layers
    n_zero = len(is_moe) if memory.zero_memory_layers is None else memory.zero_memory_layers
    out: list[LayerMemory | None] = []
    zeroed = 0
    segment = memory.segment
    for i, moe in enumerate(is_moe):
        rec = None
        if segment != "none" and i < n_rec and (segment == "full" or moe):
            rec = Recompute(segment)
        zm = None
        if rec is None and moe and memory.zero_memory != "off" and zeroed < n_zero:
            zm = ZeroMemory(memory.zero_memory)
            zeroed += 1
        norms = NormRecompute() if memory.norms and i < n_rec else None
        out.append(LayerMemory(zm, rec, norms) if (zm or rec or norms) else None)
    return out


def configure(blocks: Mapping[int, Any], memory: MemoryConfig) -> None:
    """Attach the memory options to every layer of these model blocks."""
    for block in blocks.values():
        layers = list(block.layers.values())
        for layer, opts in zip(layers, plan_layers(memory, [layer.moe is not None for layer in layers])):
            layer.memory = opts


#: ``memory.offload``'s names -> the layer methods they send the saved tensors of
PART_METHODS = {"attention": "attention_part", "dense": "dense_part", "shared": "shared_part", "experts": "experts_part"}


def offloaded_parts(memory: Any, index: int, moe: bool, recompute: str | None, shared: bool = True) -> tuple[str, ...]:
    """The parts of a block's ``index``-th layer whose saved tensors go to the host: ``memory.offload``
    in the first ``memory.offload_layers``, those the layer runs (``moe``: an MoE layer; ``shared``:
    with a shared expert) and that keep something under its recompute (``recompute``: the layer's
    segment, or None)."""
    if not memory.offload or (memory.offload_layers is not None and index >= memory.offload_layers) or recompute == "full":
        return ()
    runs = {"attention": moe, "dense": not moe, "shared": moe and shared and recompute is None, "experts": moe and recompute is None}
    return tuple(p for p in memory.offload if runs[p])


def configure_offload(blocks: Mapping[int, Any], memory: Any, backend: Any) -> Any:
    """Send the saved tensors of the parts ``memory.offload`` names to the host (after
    :func:`configure`, whose recompute it reads); the rank's
    :class:`~.offload.ActivationOffload`, or None when nothing is sent."""
    if not memory.offload:
        return None
    from .offload import ActivationOffload

    offload = ActivationOffload(backend)
    for block in blocks.values():
        for i, layer in enumerate(block.layers.values()):
            opts = getattr(layer, "memory", None)
            recompute = opts.recompute.mode if opts is not None and opts.recompute is not None else None
            shared = layer.moe is not None and layer.moe.shared is not None
            for part in offloaded_parts(memory, i, layer.moe is not None, recompute, shared):
                name = PART_METHODS[part]
                setattr(layer, name, offload.part(getattr(layer, name)))
    return offload


def redispatch_stats(blocks: Iterable[Any]) -> A2AStats:
    """Re-dispatch all-to-all time (total and waited) summed over the zero-memory layers."""
    total = A2AStats()
    for block in blocks:
        for layer in block.layers.values():
            opts = getattr(layer, "memory", None)
            if opts is not None and opts.zero_memory is not None:
                st = opts.zero_memory.stats
                total.total_s += st.total_s
                total.wait_s += st.wait_s
                total.count += st.count
    return total


def reset_redispatch_stats(blocks: Iterable[Any]) -> None:
    for block in blocks:
        for layer in block.layers.values():
            opts = getattr(layer, "memory", None)
            if opts is not None and opts.zero_memory is not None:
                opts.zero_memory.stats.reset()
