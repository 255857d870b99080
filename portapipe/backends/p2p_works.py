"""One work handle per point-to-point operation of a batch, whatever the process group returns.

torch's ``batch_isend_irecv`` returns one work per operation where the backend posts them one by
one (gloo), but a single work for the whole batch where it coalesces them (NCCL, and HCCL where it
does the same): ``_coalescing_manager`` ends the batch with one ``_end_coalescing`` work. The
executor keeps a handle per receive and per send, so a single work is given to each of them.
"""

from __future__ import annotations

from typing import Any


class SharedWork:
    """One operation's handle on the work that completes its whole coalesced batch (waiting for it
    waits for the batch; every other call goes to that work). A handle of its own, not the work
    itself repeated: the executor files each operation's handle by its identity."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def per_op(works: list[Any], n_ops: int) -> list[Any]:
    """``works`` as one handle per operation of a batch of ``n_ops``."""
    if len(works) == n_ops:
        return list(works)
    if len(works) == 1:
        return [SharedWork(works[0]) for _ in range(n_ops)]
    raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {n_ops} operations (one, or one each, expected)")
