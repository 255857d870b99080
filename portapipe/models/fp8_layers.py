"""Which of the model's Linears run in FP8 under ``train.fp8: deepseek``, and switching them on.

DeepSeek-V3's recipe (report 3.3) runs in FP8 the three GEMMs of every Linear of the attention
projections (MLA's down and up projections, the output projection; Qwen3-MoE's q / k / v / o),
the dense FFN, the shared experts and the routed experts; it keeps in higher precision the
embedding, the output head, the router, the norms, the attention core (softmax(QK^T)V) and the
multi-token prediction module's ``eh_proj``. A Linear runs in FP8 when every input and output
width of it is a multiple of 128 (a fused gate / up projection: each half, as the published
checkpoint stores them apart), so that its 1x128 tiles and 128x128 blocks never straddle; the
others stay in the compute dtype and ``portapipe train`` says which, once.

:func:`fp8_linears` lists them for a built model (``portapipe train`` asks for it on a model
built on the meta device: no memory, no weights); :func:`enable_fp8` sets the eligible ones to
run through a backend's FP8 matmul and the MoE layers' dispatch and combine to travel as the
recipe says (:mod:`portapipe.fp8.dispatch`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..backends.base import Backend
from ..backends.fp8_mm import TILE
from ..config import ModelConfig
from ..fp8.dispatch import CombineWire, DispatchWire
from .linear import Linear


@dataclass(frozen=True)
class Fp8Linear:
    """One Linear of the recipe: its name in the single-process model, widths (a fused projection's
    output: each part's) and the module that runs it."""

    name: str
    inputs: int
    outputs: tuple[int, ...]
    module: nn.Module

    @property
    def eligible(self) -> bool:
        return self.inputs % TILE == 0 and all(o % TILE == 0 for o in self.outputs)

    def shape(self) -> str:
        return f"{self.inputs} -> {' + '.join(map(str, self.outputs))}"


def _layer_linears(prefix: str, layer: Any) -> list[Fp8Linear]:
    """A decoder layer's Linears the recipe covers (a multi-token prediction module's ``eh_proj``
    is not one: it lives beside the layer's attention and FFN, not in them)."""
    out = [Fp8Linear(f"{prefix}.attn.{n}", m.weight.shape[1], (m.weight.shape[0],), m) for n, m in layer.attn.named_children() if isinstance(m, Linear)]
    ffns = [("ffn", layer.ffn)] if layer.ffn is not None else []
    if layer.moe is not None and layer.moe.shared is not None:
        ffns.append(("moe.shared", layer.moe.shared))
    for n, ffn in ffns:
        out.append(Fp8Linear(f"{prefix}.{n}.gate_up", ffn.gate_up.weight.shape[1], (ffn.width, ffn.width), ffn.gate_up))
        out.append(Fp8Linear(f"{prefix}.{n}.down", ffn.down.weight.shape[1], (ffn.down.weight.shape[0],), ffn.down))
    if layer.moe is not None:
        experts = layer.moe.experts
        hidden, width = experts.gate_up.shape[1], experts.width
        out.append(Fp8Linear(f"{prefix}.moe.experts", hidden, (width, width, hidden), experts))
    return out


def fp8_linears(blocks: Mapping[int, Any]) -> list[Fp8Linear]:
    """Every Linear of these model blocks the recipe covers, in layer order."""
    return [lin for b in sorted(blocks) for i, layer in blocks[b].layers.items() for lin in _layer_linears(f"layers.{i}", layer)]


def enable_fp8(blocks: Mapping[int, Any], backend: Backend, cache: bool = False) -> list[Fp8Linear]:
    """Run the eligible Linears of these blocks in FP8 through ``backend``, and their MoE layers'
    rows as the recipe sends them; with ``cache`` (``memory.fp8_activations``) keep FP8
    activations for the backward (:func:`cached`); returns the Linears left in the compute dtype."""
    kept = []
    for lin in fp8_linears(blocks):
        if not lin.eligible:
            kept.append(lin)
        elif isinstance(lin.module, Linear):
            lin.module.fp8 = backend
        else:  # the routed experts: grouped, and their rows travel in FP8
            lin.module.fp8 = True
    if cache:
        for module in cached(blocks):
            module.fp8_cache = True
    for block in blocks.values():
        for layer in block.moe_layers():
            if layer.moe.experts.fp8:
                hidden = layer.moe.experts.gate_up.shape[1]
                dtype = layer.moe.experts.gate_up.dtype
                layer.moe.dispatch_wire = DispatchWire(hidden, dtype)
                layer.moe.refetch_wire = DispatchWire(hidden, dtype, weights=False)
                layer.moe.combine_wire = CombineWire(hidden)
    return kept


#: the attention projections that read the layer's normed input (the others read a norm's output or the heads)
ATTENTION_INPUT = ("wq", "wk", "wv", "q_a", "kv_a")


def cached(blocks: Mapping[int, Any]) -> list[nn.Module]:
    """The modules of these blocks (their FP8 already switched on) that keep FP8 activations
    under ``memory.fp8_activations``.

    Every FP8 Linear keeps its input's 1x128 FP8 rows instead of the compute-dtype tensor where
    that tensor would then not be kept at all, and every FFN in FP8 (dense, shared, routed)
    keeps its activation's input in FP8 and remakes the down projection's input from it. Where
    the tensor is kept anyway an FP8 copy would only add bytes, so these keep it as it is: the
    attention output projection's input (kept by the attention core; the report's E5M6 has no
    torch dtype), the attention's input when a projection reading it stays in the compute dtype
    (MLA's ``kv_a``, 576 wide in DeepSeek-V3), and the shared expert's input (kept by the router).
    """
    out: list[nn.Module] = []
    for block in blocks.values():
        for layer in block.layers.values():
            projections = [(n, m) for n, m in layer.attn.named_children() if isinstance(m, Linear)]
            readers_fp8 = all(m.fp8 is not None for n, m in projections if n in ATTENTION_INPUT)
            out += [m for n, m in projections if m.fp8 is not None and n != "wo" and (n not in ATTENTION_INPUT or readers_fp8)]
            if layer.ffn is not None and layer.ffn.gate_up.fp8 is not None:
                out += [layer.ffn, layer.ffn.gate_up]
            if layer.moe is not None:
                shared = layer.moe.shared
                if shared is not None and shared.gate_up.fp8 is not None:
                    out.append(shared)
                if layer.moe.experts.fp8:
                    out.append(layer.moe.experts)
    return out


def summary(kept: Iterable[Fp8Linear]) -> str:
    """The Linears left in the compute dtype, layers folded (``layers.*.attn.kv_a (64 -> 40)``)."""
    seen: dict[str, None] = {}
    for lin in kept:
        parts = lin.name.split(".")
        seen[".".join(["layers", "*", *parts[2:]]) + f" ({lin.shape()})"] = None
    return ", ".join(seen)


def plan(model: ModelConfig) -> tuple[list[Fp8Linear], list[Fp8Linear]]:
    """(the Linears that run in FP8, those that stay in the compute dtype) of the single-process
    model of ``model``, built on the meta device."""
    from ..backends.cpu import CPUBackend
    from .expert_parallel import ExpertParallel
    from .moe import build_blocks

    with torch.device("meta"):
        blocks = build_blocks(model, [0], 1, ExpertParallel(CPUBackend()), seed=0)
    linears = fp8_linears(blocks)
    return [lin for lin in linears if lin.eligible], [lin for lin in linears if not lin.eligible]


def fp8_problems(model: ModelConfig, fp8: str) -> list[str]:
    """``train.fp8`` on a model none of whose Linears can run in FP8: one line, before any rank starts."""
    if fp8 == "off":
        return []
    eligible, kept = plan(model)
    if eligible:
        return []
    return [
        f"train.fp8: {fp8}, but no Linear of this model has every width a multiple of 128 ({summary(kept)}); "
        "nothing would run in FP8: make model.hidden and the FFN / expert / attention widths multiples of 128, or train.fp8: off"
    ]


def fp8_note(model: ModelConfig, fp8: str) -> str | None:
    """The line ``portapipe train`` says once: the Linears that stay in the compute dtype, or None."""
    if fp8 == "off":
        return None
    eligible, kept = plan(model)
    if not kept:
        return None
    return (f"train.fp8: {len(eligible)} Linears run in FP8; {len(kept)} stay in {model.dtype} (a width not a multiple of 128): "
            f"{summary(kept)}")
