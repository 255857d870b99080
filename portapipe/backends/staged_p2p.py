"""Point-to-point through host memory, for a process group whose send / recv take host memory only.

gloo moves device tensors in its collectives by staging them through pinned host buffers itself
(all-reduce, broadcast, reduce, all-gather and its tensor form, gather, scatter, all-to-all with
uneven splits, reduce-scatter's tensor form, which gloo runs as an all-reduce), but its send and
recv hand the tensor's data pointer to the transport as it is: a device tensor there is read as
host memory (torch's ProcessGroupGloo.cpp, send / recv; the wheels of torch 2.11 to 2.15 have
host-staging work for the collectives above and none for send / recv: docs/gpu.md). Several ranks on one GPU must use gloo (NCCL refuses two ranks on one
device), so their pipeline's point-to-point goes through :class:`HostStagedP2P`: each send is
copied to a host buffer first, each receive lands in one and is copied to its device tensor when
its work is waited on.

:class:`HostStaging` says how a tensor goes to host memory and back; the CUDA backend's uses
pinned buffers and copies ordered on the current stream (:func:`cuda_staging` in cuda.py), the
tests' a plain copy, so the same logic runs for real on CPU ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .p2p_works import per_op


@dataclass(frozen=True)
class HostStaging:
    """How a tensor goes to host memory and back.

    ``host_empty(t)``: an empty host buffer shaped like ``t`` (pinned, for a device).
    ``to_host(dst, src)``: start copying device tensor ``src`` into host buffer ``dst``.
    ``host_ready()``: wait until every ``to_host`` copy started so far has landed (the
    library reads the buffers from another thread, outside any stream's order).
    ``to_device(dst, src)``: copy host buffer ``src`` into device tensor ``dst``, ordered before
    any later work of the caller on ``dst`` (the current stream, as NCCL's ``wait`` orders it).
    ``on_host(t)``: ``t`` already lives in host memory and goes as it is.
    """

    host_empty: Callable[[torch.Tensor], torch.Tensor]
    to_host: Callable[[torch.Tensor, torch.Tensor], None]
    host_ready: Callable[[], None]
    to_device: Callable[[torch.Tensor, torch.Tensor], None]
    on_host: Callable[[torch.Tensor], bool]


class StagedRecv:
    """The work of a staged receive: waiting on it puts the received data into the device tensor."""

    def __init__(self, work: Any, host: torch.Tensor, dst: torch.Tensor, staging: HostStaging) -> None:
        self._work, self._host, self._dst, self._staging = work, host, dst, staging
        self._landed = False

    def _land(self) -> None:
        if not self._landed:
            self._staging.to_device(self._dst, self._host)
            self._landed = True

    def wait(self, timeout: Any = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._land()
        return bool(done) if done is not None else True

    def is_completed(self) -> bool:
        """True once the data has arrived (and has then been put into the device tensor)."""
        if self._landed:
            return True
        if not self._work.is_completed():
            return False
        self._work.wait()  # completes the library's own bookkeeping; returns at once
        self._land()
        return True


class StagedSend:
    """The work of a staged send; it keeps the host buffer alive until the library is done with it."""

    def __init__(self, work: Any, host: torch.Tensor) -> None:
        self._work, self._host = work, host

    def wait(self, timeout: Any = None) -> bool:
        done = self._work.wait() if timeout is None else self._work.wait(timeout)
        return bool(done) if done is not None else True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class HostStagedP2P:
    """``batch_isend_irecv`` whose device tensors travel through host buffers.

    Host tensors (``staging.on_host``) go as they are; so does a batch with no device tensor.
    The sends' host copies are all started, then waited for once, before the batch is posted;
    the receives' device copies happen when each work is waited on (or seen completed).
    """

    def __init__(self, staging: HostStaging, post: Callable[[list[Any]], list[Any]] | None = None) -> None:
        self.staging = staging
        # torch's batch_isend_irecv, looked up at each call so that a test's double stands in for it
        self._post = post or (lambda ops: dist.batch_isend_irecv(ops))

    def batch_isend_irecv(self, ops: Sequence[Any]) -> list[Any]:
        if not ops:
            return []
        staged: list[tuple[str, torch.Tensor | None, torch.Tensor]] = []
        posted: list[Any] = []
        for op in ops:
            t = op.tensor
            if self.staging.on_host(t):
                staged.append(("as-is", None, t))
                posted.append(op)
                continue
            host = self.staging.host_empty(t)
            if _is_send(op):
                self.staging.to_host(host, t)
                staged.append(("send", host, t))
            else:
                staged.append(("recv", host, t))
            # the peer as the op was made: a global rank, or a rank of its group (group_peer)
            peer = {"peer": op.peer} if op.peer is not None else {"group_peer": op.group_peer}
            posted.append(dist.P2POp(op.op, host, group=op.group, tag=op.tag, **peer))
        if any(kind == "send" for kind, _, _ in staged):
            self.staging.host_ready()
        works = per_op(self._post(posted), len(posted))
        out: list[Any] = []
        for (kind, host, t), work in zip(staged, works):
            if kind == "send":
                out.append(StagedSend(work, host))
            elif kind == "recv":
                out.append(StagedRecv(work, host, t, self.staging))
            else:
                out.append(work)
        return out


def _is_send(op: Any) -> bool:
    return op.op in (dist.isend, dist.send) or getattr(op.op, "__name__", "") in ("isend", "send")


def copy_staging(is_host: Callable[[torch.Tensor], bool] = lambda t: t.device.type == "cpu") -> HostStaging:
    """Staging by plain copies, with nothing to wait for: for host-side tests of the logic above."""
    return HostStaging(
        host_empty=lambda t: torch.empty(t.shape, dtype=t.dtype),
        to_host=lambda dst, src: dst.copy_(src),
        host_ready=lambda: None,
        to_device=lambda dst, src: dst.copy_(src),
        on_host=is_host,
    )
