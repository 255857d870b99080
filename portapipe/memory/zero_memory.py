"""Zero-memory: the experts' inputs are not kept between forward and backward.

An MoE layer's largest activation is the experts' grouped-matmul input, the dispatched tokens:
top-k rows per token. It is the all-to-all of rows that the layer keeps anyway (the normed
tokens, saved by the router, gathered in dispatch order), so the backward can fetch it again
instead of keeping it:

- ``level0``: the dispatched tokens are dropped after the forward (autograd keeps a recipe
  instead, through saved-tensor hooks; the exchange buffers are freed too). The backward
  re-runs the dispatch all-to-all of the remote rows from the saved tokens and routing, and
  gathers the rows this rank routed to itself from the tokens again (no exchange).
  :meth:`ExpertRefetch.issue` is recorded with :meth:`~portapipe.scheduling.overlap.Tape.ahead`,
  so the stage's backward starts it while the layer above waits for its dispatch's reverse
  exchanges (one layer ahead); at the latest it is issued as the layer's own backward starts
  (before the combine backward and the shared expert's backward, and before the combine
  all-to-all, behind which an F&B runs the other micro-batch's parts). It is waited for only
  when the received rows' experts backward reads its input.
- ``level1``: in addition, the activation function's output (the down projection's input) is
  dropped and recomputed from its input (the gate/up projection's output), which the
  activation function keeps for its own backward anyway; in the routed experts and in the
  shared expert.

The recomputed tensors are made by the same operations on the same values, so gradients are
identical to ``off``, bit for bit. Under ``train.fp8`` the received rows are FP8 values with their
scales (:class:`~portapipe.fp8.dispatch.Fp8Rows`): both are dropped, and the re-dispatch sends the
rows through the layer's ``refetch_wire`` (the same quantizer: the same bytes arrive again).

The model calls this module at three points of an MoE layer (see
:meth:`portapipe.models.layer.Layer.moe_program`): :meth:`ExpertRefetch.dropping` around the
experts' MLP, :meth:`ExpertRefetch.activation` for the activation function, and
:meth:`ExpertRefetch.issue_early` around the last part of the layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from ..fp8.quantize import Quantized
from ..models.expert_parallel import DispatchPlan, ExpertParallel
from ..scheduling.exchange import A2AStats, Pending, Wire, encoded
from ..tensors.storage import free_storage
from .remake import Recipes


def dispatch_rows(tokens: torch.Tensor, plan: DispatchPlan, top_k: int, rows: slice) -> torch.Tensor:
    """The rows a dispatch sends (``rows`` ``[:n_remote]``) or keeps (``[n_remote:]``): token
    ``i // top_k`` for each (token, slot) in ``plan.send_order[rows]``.

    Must match what :meth:`portapipe.models.layer.Layer.attention_part` gathers.
    """
    return tokens.reshape(-1, tokens.shape[-1]).index_select(0, plan.send_order[rows] // top_k)


@dataclass
class ZeroMemory:
    """One MoE layer's zero-memory setting and its re-dispatch timings (summed over the step)."""

    level: str = "level0"
    stats: A2AStats = field(default_factory=A2AStats)

    def __post_init__(self) -> None:
        if self.level not in ("level0", "level1"):
            raise ValueError(f"zero-memory level {self.level!r} is not one of level0, level1")

    def begin(self, layer: Any, tokens: torch.Tensor, send: torch.Tensor, plan: DispatchPlan) -> ExpertRefetch:
        """State for one micro-batch's pass through ``layer`` (after its attention part)."""
        return ExpertRefetch(self, layer.moe.ep, tokens.detach(), send, plan, layer.top_k, layer.moe.refetch_wire, layer.index)


class ExpertRefetch:
    """One micro-batch of one zero-memory layer: drops the experts' inputs, fetches them back."""

    def __init__(
        self, config: ZeroMemory, ep: ExpertParallel, tokens: torch.Tensor, send: torch.Tensor, plan: DispatchPlan, top_k: int,
        wire: Wire | None = None, layer: int | None = None,
    ) -> None:
        self.config, self.ep, self.tokens, self.plan, self.top_k, self.wire = config, ep, tokens, plan, top_k, wire
        self.layer = layer  # names the re-dispatch on a recorded step
        self._send: torch.Tensor | None = send
        self._recipes = Recipes()
        self._pending: Pending | None = None
        self._inputs: Any = None

    # ----------------------------------------------------------------- forward
    @contextlib.contextmanager
    def dropping(self, inputs: torch.Tensor | Quantized, local: bool = False) -> Iterator[None]:
        """Run the experts' MLP on ``inputs`` without keeping it.

        ``inputs``: the received rows (under FP8 their values and scales), or with ``local`` the
        rows this rank routed to itself (remade by a gather from the tokens, no exchange).
        Tensors saved for backward that share ``inputs``' storage (and, at level1, the
        activation's output) are replaced by recipes; everything else is saved as usual (and
        counted by an active :class:`~portapipe.memory.accounting.SavedActivations`).
        """
        if isinstance(inputs, Quantized):
            self._watch(inputs.data, lambda: self.expert_inputs().data)
            self._watch(inputs.scale, lambda: self.expert_inputs().scale)
        else:
            self._watch(inputs, self.local_rows if local else self.expert_inputs)
        with self.recipes():
            yield
        # Nothing reads these buffers again: index_select's backward needs only the index.
        for t in (inputs.data, inputs.scale) if isinstance(inputs, Quantized) else (inputs,):
            free_storage(t)
        if not local and self._send is not None:  # sent: the dispatch is over
            free_storage(self._send)
            self._send = None

    @contextlib.contextmanager
    def recipes(self) -> Iterator[None]:
        """Within this block, saved tensors this layer can remake (see :meth:`activation`) are
        kept as recipes; the shared expert runs in it too, so level1 drops its activation as well."""
        with self._recipes.active():
            yield

    def activation(self, fn: Callable[..., torch.Tensor], x: torch.Tensor, *args: Any) -> torch.Tensor:
        """``fn(x, *args)``; at level1 its output is not kept but recomputed in backward.

        ``fn`` keeps only its inputs for its own backward (the model's
        :class:`~portapipe.models.functions.SwiGLU`, with the rows' router weights as ``args``); what
        is dropped here is its output, which the next projection would keep. It is remade from
        the same inputs by the same ``fn``.
        """
        out = fn(x, *args)
        if self.config.level == "level1":
            saved_x = x.detach()
            saved_args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]

            def remake() -> torch.Tensor:
                with torch.no_grad():
                    return fn(saved_x, *saved_args)

            self._watch(out, remake)
        return out

    def issue_early(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Wrap the layer's last part so that its backward starts the re-dispatch first."""

        @functools.wraps(fn)  # still the layer's combine part to whoever names parts (profiling)
        def part(*args: Any) -> Any:
            out = fn(*args)
            return _IssueOnBackward.apply(out, self)

        return part

    # ---------------------------------------------------------------- backward
    def issue(self) -> None:
        """Start the re-dispatch all-to-all of the remote rows (once); their experts' backward waits for it."""
        if self._pending is None and self._inputs is None and self.ep.size > 1:
            plan = self.plan
            rows = dispatch_rows(self.tokens, plan, self.top_k, slice(None, plan.n_remote))
            self._pending, _ = encoded(self.ep, rows, plan.remote_recv_splits, plan.remote_send_splits, self.wire, stats=self.config.stats,
                                       label=("re-dispatch", self.layer))

    def expert_inputs(self) -> Any:
        """The received rows again (under FP8: their values and scales, :class:`~portapipe.fp8.quantize.Quantized`)."""
        if self._inputs is None:
            self.issue()
            assert self._pending is not None
            got = self._pending.wait()
            self._inputs = got if self.wire is None else got.rows
            self._pending = None
        return self._inputs

    def local_rows(self) -> torch.Tensor:
        """The rows this rank routed to itself, gathered again."""
        return dispatch_rows(self.tokens, self.plan, self.top_k, slice(self.plan.n_remote, None))

    # ------------------------------------------------------------------- hooks
    def _watch(self, t: torch.Tensor, remake: Callable[[], torch.Tensor]) -> None:
        self._recipes.watch(t, remake)


class _IssueOnBackward(torch.autograd.Function):
    """Identity whose backward starts a layer's re-dispatch before the rest of its backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, refetch: ExpertRefetch) -> torch.Tensor:
        ctx.refetch = refetch
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        ctx.refetch.issue()
        ctx.refetch = None
        return grad, None
