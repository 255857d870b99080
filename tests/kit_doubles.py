"""Backends with one fault each that the conformance kit must catch (tests/test_backend_kit.py),
and the rank function that runs the kit's rank lines on one of them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from portapipe.backends.cpu import CPUBackend
from portapipe.testing import rank_contracts


class IgnoresOp(CPUBackend):
    """An all_reduce and a reduce-scatter that sum whatever op they are asked for."""

    name = "ignores-op"

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return super().all_reduce(tensor, group=group, async_op=async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        return super().reduce_scatter_tensor(output, input, group=group, async_op=async_op)


class Bfloat16Off(CPUBackend):
    """A grouped matmul 2% off in bfloat16 only (a kernel right in every other dtype)."""

    name = "bf16-off"

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = super().grouped_mm(a, b, offs)
        return out * 1.02 if a.dtype == torch.bfloat16 else out


DOUBLES = {cls.name: cls for cls in (IgnoresOp, Bfloat16Off)}


def rank_lines_of(backend: Any, name: str) -> dict[str, str | None]:
    """On a rank whose process group ``backend`` set up: the kit's rank lines on double ``name``."""
    return rank_contracts(DOUBLES[name]())
