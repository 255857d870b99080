"""A test backend: the CPU playing a device whose memory gloo's send / recv cannot read.

Every tensor counts as device memory except the host buffers its staging makes; a double of
gloo's point-to-point refuses any other tensor, as gloo's send / recv cannot move device memory
(they hand the data pointer to the transport; its collectives stage device tensors themselves,
so they pass). With ``backend_options: {staging: on}`` (the default) the pipeline's point-to-point
goes through :class:`~portapipe.backends.staged_p2p.HostStagedP2P`, the cuda backend's logic for
ranks sharing a GPU over gloo; with ``staging: off`` it does not, and the double refuses.

Registered for rank processes by :func:`install` (entry point ``staged``), as a plug-in would be.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from portapipe.backends.cpu import CPUBackend
from portapipe.backends.staged_p2p import HostStagedP2P, HostStaging

NAME = "staged"
REFUSAL = "gloo send/recv: a tensor in device memory; gloo's send and recv move host memory only"


class HostBuffers:
    """The host buffers a staging made (by identity, without keeping them alive)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}
        self.made = 0

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.shape, dtype=t.dtype)
        self._refs = {k: r for k, r in self._refs.items() if r() is not None}
        self._refs[id(buf)] = weakref.ref(buf)
        self.made += 1
        return buf

    def holds(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t


def gloo_p2p_double(host: HostBuffers) -> Any:
    """torch's batch_isend_irecv, refusing what gloo cannot move: any tensor not in host memory."""

    def post(ops: list[Any]) -> list[Any]:
        for op in ops:
            if not host.holds(op.tensor):
                raise RuntimeError(f"{REFUSAL} (shape {tuple(op.tensor.shape)}, peer {op.peer})")
        return dist.batch_isend_irecv(ops)

    return post


class StagedCPUBackend(CPUBackend):
    name = NAME
    option_keys = frozenset({"ep_transport", "staging"})
    install_hint = "The staged test backend needs only torch."

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        staging = str(self.options.get("staging", "on"))
        if staging not in ("on", "off"):
            raise ValueError(f"backend_options.staging: {staging!r} is not one of on, off")
        self.host = HostBuffers()
        self._post = gloo_p2p_double(self.host)
        plan = HostStaging(
            host_empty=self.host.empty_like,
            to_host=lambda dst, src: dst.copy_(src),
            host_ready=lambda: None,
            to_device=lambda dst, src: dst.copy_(src),
            on_host=self.host.holds,
        )
        self._staged = HostStagedP2P(plan, post=self._post) if staging == "on" else None

    def batch_isend_irecv(self, ops: Sequence[dist.P2POp]) -> list[Any]:
        if not ops:
            return []
        if self._staged is None:
            return self._post(list(ops))
        return self._staged.batch_isend_irecv(ops)


def install(site: Path) -> dict[str, str]:
    """Register the backend in a distribution's metadata under ``site``; the environment of a
    process (and so of the ranks it starts) that sees it installed."""
    info = site / "portapipe_staged_test_backend-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portapipe-staged-test-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[portapipe.backends]\n{NAME} = tests.staged_backend:StagedCPUBackend\n")
    root = Path(__file__).resolve().parents[1]
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(root), env.get("PYTHONPATH", "")) if p)
    return env
