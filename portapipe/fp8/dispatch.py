"""FP8 dispatch, bfloat16 combine: how the routed experts' rows travel under ``train.fp8``.

DeepSeek-V3's recipe (report, 3.3): the rows sent to the routed experts travel in FP8 with their
1x128 scales and the up projection consumes them as they arrive; the combine travels in the
compute dtype, forward and backward, except the activation gradient sent back to the experts
before the down projection's backward, which travels in FP8 too. So both directions *towards*
the experts carry FP8, both directions *away* from them the compute dtype.

One row on the wire is bytes (``uint8``), in this order: the row's E4M3 values (``H`` bytes), its
float32 scales (4 bytes per 128 values), and for a dispatch its router weight in the compute
dtype (which the experts scale their activation by): ``H + 4 ceil(H/128) + 2`` bytes for
bfloat16 against ``2 (H + 1)``, about 0.52x. Moving bytes changes no bit, so the receiver gets
exactly what the sender's quantizer made, and a rank's own rows (which never travel) are
quantized the same way: the experts see the same bytes whatever the layout
(:class:`~portapipe.models.linear.Fp8GroupedLinearFunction` takes every row's input and output
gradient as its FP8 values for that reason).

- :class:`DispatchWire`: the forward's rows ``[n, H + 1]`` (the router weight as the last column,
  as :func:`~portapipe.models.expert_parallel.with_weights` makes them) travel encoded and arrive
  as :class:`Fp8Rows`; their gradient travels back in the compute dtype. ``weights=False``: the
  rows alone (zero-memory's re-dispatch of the experts' input).
- :class:`CombineWire`: the forward's expert outputs travel as they are; their gradient travels
  encoded and is decoded to the compute dtype (exactly: an E4M3 value times a power-of-two scale
  of at least 2^-124 is a bfloat16 number), and the down projection's backward reads its FP8
  values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..backends.fp8_mm import E4M3, n_tiles
from ..tensors.storage import free_storage
from .quantize import Quantized, dequantize_rows, quantize_rows


@dataclass(frozen=True)
class Fp8Rows:
    """What an FP8 dispatch delivers: ``rows`` (E4M3 values and 1x128 scales), the router
    ``weights`` (None for rows alone) and ``standin``, the ``[m, H (+ 1)]`` tensor of no data that
    stands for them in autograd."""

    rows: Quantized
    weights: torch.Tensor | None
    standin: torch.Tensor


def row_bytes(hidden: int, weight_dtype: torch.dtype | None) -> int:
    """Bytes of one encoded row (the module docstring's layout)."""
    weight = 0 if weight_dtype is None else torch.empty(0, dtype=weight_dtype).element_size()
    return hidden + 4 * n_tiles(hidden) + weight


def pack(rows: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """``rows[n, H]`` (and ``weights[n]``) as ``uint8[n, row_bytes]``."""
    q = quantize_rows(rows)
    parts = [q.data.view(torch.uint8), q.scale.contiguous().view(torch.uint8)]
    if weights is not None:
        parts.append(weights.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.uint8).view(-1, weights.element_size()))
    return torch.cat(parts, 1)


def unpack(packed: torch.Tensor, hidden: int, weight_dtype: torch.dtype | None) -> tuple[Quantized, torch.Tensor | None]:
    """:func:`pack`'s bytes back as (E4M3 rows and scales, weights or None), each a tensor of its
    own; ``packed`` is freed (an exchange buffer nothing reads again)."""
    if packed.shape[1] != row_bytes(hidden, weight_dtype):
        raise ValueError(f"an FP8 row of {hidden} values takes {row_bytes(hidden, weight_dtype)} bytes, got {packed.shape[1]}")
    s = hidden + 4 * n_tiles(hidden)

    def part(cols: slice) -> torch.Tensor:  # always a copy: ``packed`` is freed next
        return packed[:, cols].clone(memory_format=torch.contiguous_format)

    data, scale = part(slice(0, hidden)).view(E4M3), part(slice(hidden, s)).view(torch.float32)
    weights = None if weight_dtype is None else part(slice(s, None)).view(weight_dtype).reshape(-1)
    free_storage(packed)
    return Quantized(data, scale), weights


class DispatchWire:
    """The dispatch's rows in FP8 (module docstring); their gradient in the compute dtype."""

    forward = True
    backward = False

    def __init__(self, hidden: int, dtype: torch.dtype, weights: bool = True) -> None:
        self.hidden, self.dtype, self.weights = hidden, dtype, weights

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights:
            return pack(x[:, : self.hidden], x[:, self.hidden])
        return pack(x, None)

    def decode(self, received: torch.Tensor, standin: torch.Tensor) -> Fp8Rows:
        rows, weights = unpack(received, self.hidden, self.dtype if self.weights else None)
        return Fp8Rows(rows, weights, standin)

    def encode_grad(self, g: torch.Tensor) -> torch.Tensor:
        return g

    def decode_grad(self, received: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return received


class CombineWire:
    """The combine's rows as they are; their gradient (towards the experts) in FP8 (module docstring)."""

    forward = False
    backward = True

    def __init__(self, hidden: int) -> None:
        self.hidden = hidden

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(self, received: torch.Tensor, standin: torch.Tensor) -> Any:
        return received

    def encode_grad(self, g: torch.Tensor) -> torch.Tensor:
        return pack(g, None)

    def decode_grad(self, received: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        rows, _ = unpack(received, self.hidden, None)
        return dequantize_rows(rows).to(like.dtype)


class _Unpacked(torch.autograd.Function):
    """(a stand-in for the rows, the router weights) of an FP8 dispatch's stand-in ``[m, H + 1]``,
    whose backward joins the two gradients as the dispatch's reverse exchange carries them."""

    @staticmethod
    def forward(ctx: Any, standin: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return standin.new_zeros(()).expand(standin.shape[0], standin.shape[1] - 1), weights.clone()

    @staticmethod
    def backward(ctx: Any, grad_rows: torch.Tensor, grad_weights: torch.Tensor) -> tuple[torch.Tensor, None]:
        return torch.cat([grad_rows, grad_weights.unsqueeze(1)], 1), None


def split_received(standin: torch.Tensor, rows: Fp8Rows) -> tuple[torch.Tensor, torch.Tensor]:
    """(the rows' stand-in ``[m, H]``, the router weights ``[m]``) of an FP8 dispatch's rows, whose
    gradients reach ``standin`` (the part's leaf for the dispatch's stand-in) joined."""
    assert rows.weights is not None, "rows dispatched without their router weights"
    return _Unpacked.apply(standin, rows.weights)
