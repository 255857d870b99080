"""Tensors the model can make again, for whoever drops them between forward and backward.

The model names, where it makes them, the tensors it can rebuild cheaply from what autograd
keeps anyway (an RMSNorm's output from its input, which the norm's own backward keeps; MLA's
up-projected queries, keys and values from the latents the latent norms keep): :func:`remakes`.
Nothing happens unless a memory option listens (:func:`listening`, with the memory side's
recipes, :mod:`portapipe.memory.remake`); then the tensors autograd would save that share such
a tensor's storage are kept as recipes instead, and the backward runs the same operations on
the same values again, so values and gradients do not change by one bit.

A remake may need a tensor that is itself remade (MLA's queries from a normed input): it asks
for it through :func:`later`, which never keeps a dropped tensor alive.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch


class Listener(Protocol):
    def watch(self, t: torch.Tensor, remake: Callable[[], torch.Tensor]) -> None: ...

    def later(self, t: torch.Tensor) -> Callable[[], torch.Tensor]: ...


_LISTENER: contextvars.ContextVar[Listener | None] = contextvars.ContextVar("portapipe_remake_listener", default=None)


@contextlib.contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Within this block, :func:`remakes` tells ``listener`` (a part's forward runs in it)."""
    token = _LISTENER.set(listener)
    try:
        yield
    finally:
        _LISTENER.reset(token)


def active() -> bool:
    """Whether anyone listens: a model skips building its remakes otherwise."""
    return _LISTENER.get() is not None


def remakes(t: torch.Tensor, remake: Callable[[], torch.Tensor]) -> None:
    """``remake()`` gives ``t``'s values again (called without autograd, in the backward)."""
    listener = _LISTENER.get()
    if listener is not None:
        listener.watch(t, remake)


def later(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """``t``'s values in the backward: its remake when it has one, else ``t`` itself (kept)."""
    listener = _LISTENER.get()
    if listener is not None:
        return listener.later(t)
    kept = t.detach()
    return lambda: kept


def once(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` computed at its first call only; the value lives as long as this function (the
    recipes holding it, released with the backward that read them)."""
    box: list[Any] = []

    def get() -> Any:
        if not box:
            box.append(fn())
        return box[0]

    return get
