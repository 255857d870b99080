"""An example plug-in backend, as a third party would ship it (registered by entry point).

It stands for a device whose matmul units and reducing collectives have no float64 path but
whose data movement does (Ascend's case, docs/backends.md), played by the CPU over gloo.
Every call refuses a dtype the declaration leaves out, as the real library would, so a test
that passes with it proves portapipe asked for nothing the device cannot do.

Registered in its distribution's metadata as::

    [portapipe.backends]
    example32 = portapipe_example_backend:Float32Backend

and checked, once installed, with the conformance kit (extra ``testing``)::

    PORTAPIPE_CONFORMANCE_BACKEND=example32 pytest --pyargs portapipe.testing
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from portapipe.backends.capabilities import Capabilities
from portapipe.backends.cpu import CPUBackend


class Float32Backend(CPUBackend):
    name = "example32"
    install_hint = "The example backend needs only torch."
    capabilities = Capabilities(
        dist_backend="gloo",
        compute_dtypes=("float32", "bfloat16", "float16"),
        reduce_dtypes=("float32", "bfloat16", "float16"),
        move_dtypes=("float64", "float32", "bfloat16", "float16"),
        fused_grouped_mm_dtypes=("float32", "bfloat16", "float16"),
        timer="wall",
    )

    def _only(self, family: str, allowed: Sequence[str], *tensors: torch.Tensor) -> None:
        for t in tensors:
            name = str(t.dtype).removeprefix("torch.")
            if t.is_floating_point() and name not in allowed:
                raise TypeError(f"backend {self.name!r}: {family} in {name} is not supported (declared: {', '.join(allowed)})")

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        self._only("grouped matmul", self.capabilities.compute_dtypes, a, b)
        return super().grouped_mm(a, b, offs)

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("all_reduce", self.capabilities.reduce_dtypes, tensor)
        return super().all_reduce(tensor, *args, **kwargs)

    def reduce_scatter_tensor(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("reduce_scatter_tensor", self.capabilities.reduce_dtypes, output, input)
        return super().reduce_scatter_tensor(output, input, *args, **kwargs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("all_to_all_single", self.capabilities.move_dtypes, output, input)
        return super().all_to_all_single(output, input, *args, **kwargs)

    def all_gather(self, tensors: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("all_gather", self.capabilities.move_dtypes, tensor, *tensors)
        return super().all_gather(tensors, tensor, *args, **kwargs)

    def all_gather_into_tensor(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("all_gather_into_tensor", self.capabilities.move_dtypes, output, input)
        return super().all_gather_into_tensor(output, input, *args, **kwargs)

    def broadcast(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self._only("broadcast", self.capabilities.move_dtypes, tensor)
        return super().broadcast(tensor, *args, **kwargs)

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Any]:
        self._only("batch_isend_irecv", self.capabilities.move_dtypes, *(op.tensor for op in ops))
        return super().batch_isend_irecv(ops)
