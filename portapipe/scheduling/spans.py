"""Spans of a recorded step: what the executor, the exchanges and the training loop tell a recorder.

The core only emits. A recorder installed with :func:`install` (portapipe.timeline's, which takes
times from the backend's span clock; the labels of a torch.profiler run) hears of every

- span of the compute thread (:func:`span`): the step, each schedule action, the time blocked
  on an exchange or a receive, the gradient synchronisation left after the last action, and the
  loop's own parts (data, optimizer, EMA, balancer, checkpoint, validation);
- exchange or transfer (:func:`begin`, :func:`issued`, :func:`waiting`, :func:`end`): an
  all-to-all from its issue to its completion, named by what its caller says (``("dispatch",
  layer)``) and the micro-batch whose program issued it; a point-to-point send or receive; a
  gradient bucket's reduction; each from its post to its completion, with the time the caller
  was blocked on it.

With no recorder installed (every step that is not recorded) each call site costs one context
variable read and returns :data:`OFF`, one shared object whose enter and exit do nothing; names
are made by the recorder, after the step, from what the call site passed (an
:class:`~.ir.Action`, a tuple): nothing is formatted unless it is recorded.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any, ContextManager, Protocol

#: the tracks of a rank: what runs on its compute stream, its expert exchanges, its pipeline
#: sends and receives, its gradient reductions
COMPUTE, EXCHANGES, P2P, GRAD_SYNC = "compute", "exchanges", "pipeline p2p", "gradient sync"
TRACKS = (COMPUTE, EXCHANGES, P2P, GRAD_SYNC)


class _Off:
    """The span of a step that is not recorded: enters and leaves doing nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


OFF: ContextManager[Any] = _Off()


class SpanRecorder(Protocol):
    """What the core tells a recorder. ``what`` is named by the recorder (an Action, a string, a
    tuple such as ``("dispatch", layer)``); ``args`` are figures for the record (bytes, splits)."""

    def span(self, track: str, what: Any, args: dict[str, Any] | None = None) -> ContextManager[Any]: ...

    def begin(self, track: str, what: Any, args: dict[str, Any] | None = None) -> Any: ...

    def issued(self, token: Any, work: Any, done: Any = None) -> None: ...

    def end(self, token: Any) -> None: ...

    def blocked(self, token: Any) -> ContextManager[Any]: ...

    def running(self, half: Any) -> None: ...


RECORDER: contextvars.ContextVar[SpanRecorder | None] = contextvars.ContextVar("portapipe_span_recorder", default=None)
_INSTALLED: contextvars.ContextVar[tuple[SpanRecorder, ...]] = contextvars.ContextVar("portapipe_span_recorders", default=())


def install(recorder: SpanRecorder) -> None:
    """From now on everything above goes to ``recorder`` too (a timeline and a profiler's labels
    may record one step together), until :func:`uninstall`; each may end at its own point."""
    _set(_INSTALLED.get() + (recorder,))


def uninstall(recorder: SpanRecorder) -> None:
    _set(tuple(r for r in _INSTALLED.get() if r is not recorder))


def _set(recorders: tuple[SpanRecorder, ...]) -> None:
    _INSTALLED.set(recorders)
    RECORDER.set(None if not recorders else recorders[0] if len(recorders) == 1 else _Both(recorders))


@contextlib.contextmanager
def recording(recorder: SpanRecorder) -> Iterator[SpanRecorder]:
    """Within this block, everything above goes to ``recorder``."""
    install(recorder)
    try:
        yield recorder
    finally:
        uninstall(recorder)


class _Both:
    """Several recorders hearing one step: each call goes to each, a span is each one's span."""

    def __init__(self, recorders: tuple[SpanRecorder, ...]) -> None:
        self.recorders = recorders

    def span(self, track: str, what: Any, args: dict[str, Any] | None = None) -> ContextManager[Any]:
        return _Stack([r.span(track, what, args) for r in self.recorders])

    def begin(self, track: str, what: Any, args: dict[str, Any] | None = None) -> Any:
        return [r.begin(track, what, args) for r in self.recorders]

    def issued(self, token: Any, work: Any, done: Any = None) -> None:
        for r, t in zip(self.recorders, token):
            r.issued(t, work, done)

    def end(self, token: Any) -> None:
        for r, t in zip(self.recorders, token):
            r.end(t)

    def blocked(self, token: Any) -> ContextManager[Any]:
        return _Stack([r.blocked(t) for r, t in zip(self.recorders, token)])

    def running(self, half: Any) -> None:
        for r in self.recorders:
            r.running(half)


class _Stack:
    def __init__(self, spans: list[ContextManager[Any]]) -> None:
        self.spans = spans

    def __enter__(self) -> None:
        for s in self.spans:
            s.__enter__()

    def __exit__(self, *exc: Any) -> None:
        for s in reversed(self.spans):
            s.__exit__(*exc)


def span(track: str, what: Any, args: dict[str, Any] | None = None) -> ContextManager[Any]:
    """A span of ``track`` around the block, or :data:`OFF` when no step is recorded."""
    rec = RECORDER.get()
    return OFF if rec is None else rec.span(track, what, args)


def begin(track: str, what: Any, args: dict[str, Any] | None = None) -> Any:
    """Start a span that ends elsewhere: an exchange or a transfer posted now. The token it gives
    (None when no step is recorded) is told the work (:func:`issued`), the caller's wait for it
    (:func:`waiting`) and when the caller saw it complete (:func:`end`)."""
    rec = RECORDER.get()
    return None if rec is None else (rec, rec.begin(track, what, args))


def issued(token: Any, work: Any, done: Any = None) -> None:
    """The work of a span :func:`begin` started: its completion ends the span, where the clock can
    tell it. ``done``: a list the caller's own completion callback appends the host time to (the
    clock takes it instead of adding a callback of its own)."""
    if token is not None:
        token[0].issued(token[1], work, done)


def end(token: Any) -> None:
    """The caller saw the work complete (a no-op for None, or for a span already ended)."""
    if token is not None:
        token[0].end(token[1])


def waiting(token: Any) -> ContextManager[Any]:
    """The block in which the caller waits for a begun span's work: the time it is blocked on it
    (a span of the compute track, named after the work), which also ends the work's span."""
    return OFF if token is None else token[0].blocked(token[1])


def following(program: Any, half: Any) -> Any:
    """``program`` (a stage's forward or backward) telling the recorder, each time it runs on,
    that ``half`` is the action computing, so the exchanges it issues carry its micro-batch.
    Used only on recorded steps (an F&B pair's two programs take turns)."""
    rec = RECORDER.get()
    if rec is None:
        return program
    return _following(rec, program, half)


def _following(rec: SpanRecorder, program: Any, half: Any) -> Any:
    while True:
        rec.running(half)
        try:
            item = next(program)
        except StopIteration as stop:
            return stop.value
        yield item
