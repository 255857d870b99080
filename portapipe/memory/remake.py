"""Saved tensors kept as recipes: what autograd would keep of a tensor that can be made again.

A memory option names the tensors it drops with a recipe each (:meth:`Recipes.watch`); within
:meth:`Recipes.active`, every tensor autograd saves that shares one of their storages is kept as
the recipe instead (``torch.autograd.graph.saved_tensors_hooks``), and made again when the
backward unpacks it. Everything else is saved as usual, counted by an active
:class:`~portapipe.memory.accounting.SavedActivations`, whose hooks these chain to.

Zero-memory's dropped expert inputs (:mod:`.zero_memory`) and the recompute of norms and MLA's
up-projections (:class:`NormRecompute`) are both kept this way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..models import remake as model_remake
from . import accounting


class Dropped:
    """What autograd keeps instead of a dropped tensor: how to make it again."""

    __slots__ = ("remake", "size", "stride", "offset")

    def __init__(self, remake: Callable[[], torch.Tensor], t: torch.Tensor) -> None:
        self.remake = remake
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()

    def get(self) -> torch.Tensor:
        base = self.remake()
        return base.as_strided(self.size, self.stride, self.offset)


class Recipes:
    """Watched storages and their recipes, for the saved-tensor hooks of one block of forward."""

    def __init__(self) -> None:
        self._remakes: dict[Any, Callable[[], torch.Tensor]] = {}
        # The watched tensors themselves, until the block ends: a watched storage freed inside
        # it could have its address reused by a tensor that must be saved as it is.
        self._held: list[torch.Tensor] = []

    def watch(self, t: torch.Tensor, remake: Callable[[], torch.Tensor]) -> None:
        """Tensors saved inside :meth:`active` that share ``t``'s storage are kept as ``remake``."""
        key = accounting.storage_key(t)
        if key is not None:
            self._remakes[key[0]] = remake
            self._held.append(t)

    def later(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """``t``'s values in the backward: its recipe when watched, else ``t`` itself (kept)."""
        key = accounting.storage_key(t)
        if key is not None and key[0] in self._remakes:
            return Dropped(self._remakes[key[0]], t).get
        kept = t.detach()
        return lambda: kept

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Saved tensors of watched storages are kept as recipes within this block."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self._remakes.clear()
            self._held.clear()

    def _pack(self, t: torch.Tensor) -> Any:
        key = accounting.storage_key(t)
        if key is not None and key[0] in self._remakes:
            return Dropped(self._remakes[key[0]], t)
        return accounting.pack_saved(t)

    @staticmethod
    def _unpack(obj: Any) -> torch.Tensor:
        if isinstance(obj, Dropped):
            return obj.get()
        return accounting.unpack_saved(obj)


class NormRecompute:
    """``memory.recompute: norms``: the RMSNorms' outputs and MLA's up-projected queries, keys and
    values are not kept for the backward but made again there from what is kept anyway (the
    tensors the model names, :mod:`portapipe.models.remake`)."""

    @contextlib.contextmanager
    def recipes(self) -> Iterator[None]:
        """Run one part's forward in this block: what it names is kept as recipes."""
        recipes = Recipes()
        with model_remake.listening(recipes), recipes.active():
            yield
