"""Watching a tape's parts (``portapipe profile``): an observer installed with :func:`observing`
sees every recorded part's forward, and the note it keeps times that part's backward."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any, ContextManager, Protocol

from .wgrad import WeightGradQueue

class PartNote(Protocol):
    """What an observer keeps of one part's forward; it also times that part's backward."""

    def backward(self, queue: WeightGradQueue | None) -> ContextManager[Any]: ...


class PartObserver(Protocol):
    """Sees every part a :class:`Tape` runs (see :func:`observing`)."""

    def forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> ContextManager[PartNote]: ...


#: the recording tape whose part runs now (set by :meth:`~.overlap.Tape.part` around the call, which
#: is synchronous, so two programs of an F&B pair never see each other's): whose backward the
#: tensors saved meanwhile are for (activation offload files what it sends by it)
PART_TAPE: contextvars.ContextVar[Any] = contextvars.ContextVar("portapipe_part_tape", default=None)

NO_NOTE = contextlib.nullcontext()  # reusable: no observer watched the part's forward
OBSERVER: contextvars.ContextVar[PartObserver | None] = contextvars.ContextVar("portapipe_part_observer", default=None)


@contextlib.contextmanager
def observing(observer: PartObserver) -> Iterator[PartObserver]:
    """Within this block every recorded part's forward runs inside ``observer.forward(fn, args)``,
    and its backward later inside ``note.backward(queue)`` of the note that forward yielded
    (``queue`` is the weight-gradient queue of a B, None for a full backward)."""
    token = OBSERVER.set(observer)
    try:
        yield observer
    finally:
        OBSERVER.reset(token)
