"""A tensor's memory, apart from the tensor object."""

from __future__ import annotations

import torch


def free_storage(t: torch.Tensor) -> None:
    """Release ``t``'s memory now, keeping the tensor object (shape and autograd links stay): a
    buffer nothing reads again that something still names (an exchange's record, autograd's graph)."""
    storage = t.untyped_storage()
    if storage.nbytes() > 0:
        storage.resize_(0)
