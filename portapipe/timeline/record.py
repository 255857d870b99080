"""One rank's record of one step: the spans the core emits (:mod:`portapipe.scheduling.spans`),
their times taken by the backend's span clock and read once, after the step, as rows.

A row is one span: its track, its name as the schedule reads (``F&B s1 mb3|mb7``, ``dispatch L5
mb3``, ``wait RECV_F s2 mb3``), what it is (``action``, ``wait``, ``exchange``, ``p2p``,
``reduce``, ``part``: the step and the loop's own work), its begin and end on the host clock,
the compute span it ran inside (``parent``) and, for a wait, the span it waited on (``of``).
"""

from __future__ import annotations

from typing import Any

from ..scheduling.ir import Action, Kind
from ..scheduling.spans import COMPUTE, EXCHANGES, GRAD_SYNC, P2P

#: what a span is, by its track (a compute span is an action, a wait or a part)
KIND_OF_TRACK = {EXCHANGES: "exchange", P2P: "p2p", GRAD_SYNC: "reduce"}


def half_name(h: Action) -> str:
    return f"{h.kind.value} s{h.stage} mb{h.mb}"


def action_name(a: Action) -> str:
    """An action as the schedule reads: ``F s0 mb3``, ``BW s2 mb1``, ``SEND_F s1 mb3``; a pair
    ``F&B s1 mb3|mb7`` (its halves on one stage) or ``F&B s0 mb3|s3 mb1``; two forwards ``F&F``."""
    if a.pair is None:
        return half_name(a)
    f, second = a.pair
    what = "F&F" if second.kind is Kind.F else "F&B"
    other = f"mb{second.mb}" if second.stage == f.stage else f"s{second.stage} mb{second.mb}"
    return f"{what} s{f.stage} mb{f.mb}|{other}"


def exchange_name(label: tuple[str, int | None], half: Action | None) -> str:
    """``dispatch L5 mb3`` (``half``: the action whose program issued it; a pair's half)."""
    name, layer = label
    return name + (f" L{layer}" if layer is not None else "") + (f" mb{half.mb}" if half is not None else "")


def span_name(track: str, what: Any, half: Action | None) -> str:
    """The name of a span (a wait's is ``wait`` and the name of what it waited on)."""
    if what.__class__ is Action:
        return action_name(what)
    if isinstance(what, tuple):
        if track == GRAD_SYNC:
            return f"{what[0]} block {what[1]} #{what[2]}"
        return exchange_name(what, half)
    return str(what)


class _Open:
    """A compute span while it runs (its enter and exit take the marks)."""

    __slots__ = ("rec", "row", "ends")

    def __init__(self, rec: StepRecorder, row: list[Any], ends: int | None = None) -> None:
        self.rec, self.row, self.ends = rec, row, ends

    def __enter__(self) -> None:
        rec = self.rec
        self.row[5] = rec.clock.mark()
        self.row[4] = rec.stack[-1] if rec.stack else -1
        rec.stack.append(len(rec.rows))
        rec.rows.append(self.row)
        what = self.row[1]
        if what.__class__ is Action and what.pair is None:
            rec.current = what

    def __exit__(self, *exc: object) -> None:
        rec = self.rec
        self.row[6] = rec.clock.mark()
        rec.stack.pop()
        if self.row[1].__class__ is Action:
            rec.current = None
        if self.ends is not None:  # a wait: the work it waited on is complete now
            rec.end(self.ends)


class StepRecorder:
    """Spans of one step on one rank, timed by ``clock`` (a backend's
    :class:`~portapipe.backends.base.SpanClock`), read by :meth:`rows` once the step is over.

    Each span is a list: [track, what, args, half, parent, begin, end, done, of], ``done`` the
    clock's completion mark of its work, ``half`` the action computing when it began."""

    def __init__(self, clock: Any) -> None:
        self.clock = clock
        self.rows: list[list[Any]] = []
        self.stack: list[int] = []
        self.current: Action | None = None
        self.untold: set[str] = set()  # tracks whose works' completion the clock cannot tell
        self.start = clock.mark()

    # ------------------------------------------------------------ what the core calls
    def span(self, track: str, what: Any, args: dict[str, Any] | None = None) -> _Open:
        return _Open(self, [track, what, args, self.current, -1, None, None, None, -1])

    def begin(self, track: str, what: Any, args: dict[str, Any] | None = None) -> int:
        self.rows.append([track, what, args, self.current, self.stack[-1] if self.stack else -1, self.clock.mark(), None, None, -1])
        return len(self.rows) - 1

    def issued(self, token: int, work: Any, done: Any = None) -> None:
        row = self.rows[token]
        if row[0] in self.untold:
            return
        row[7] = self.clock.done(work, done)
        if row[7] is None:  # this track's works cannot tell (gloo's point-to-point, whose asking raises): not asked again
            self.untold.add(row[0])

    def end(self, token: int) -> None:
        row = self.rows[token]
        if row[6] is None:
            row[6] = self.clock.mark()

    def blocked(self, token: int) -> _Open:
        row = [COMPUTE, ("wait", token), None, self.current, -1, None, None, None, token]
        return _Open(self, row, ends=token)

    def running(self, half: Action) -> None:
        self.current = half

    # ------------------------------------------------------------------- after the step
    def rows_read(self) -> tuple[float, list[dict[str, Any]]]:
        """(the recording's start, the spans as rows), every mark read at once, in host seconds.
        A span whose work completed before its caller saw it ends at the completion."""
        marks = [self.start]
        for r in self.rows:
            marks += [r[5], r[6], r[7]]
        times = self.clock.read(marks)
        start, out = times[0], []
        for i, r in enumerate(self.rows):
            begin, seen, done = times[1 + 3 * i: 4 + 3 * i]
            end = seen if done is None else done if seen is None else min(done, seen)
            if end is None or begin is None:
                raise RuntimeError(f"span {self.name(i)} of the recorded step never ended")
            track, what, args, half = r[0], r[1], r[2], r[3]
            row = {"track": track, "name": self.name(i), "kind": self.kind(i), "begin_s": begin, "end_s": max(end, begin), "parent": r[4]}
            row.update(_fields(what, half))
            if r[8] >= 0:
                row["of"] = r[8]
            if args:
                row["args"] = args
            out.append(row)
        return start, out

    def name(self, i: int) -> str:
        track, what, _, half = self.rows[i][:4]
        if isinstance(what, tuple) and what[0] == "wait":
            return f"wait {self.name(what[1])}"
        return span_name(track, what, half)

    def kind(self, i: int) -> str:
        track, what = self.rows[i][:2]
        if track != COMPUTE:
            return KIND_OF_TRACK[track]
        if what.__class__ is Action:
            return "action"
        return "wait" if isinstance(what, tuple) and what[0] == "wait" else "part"


def _fields(what: Any, half: Action | None) -> dict[str, Any]:
    """The schedule's fields of a span: an action's IR text, stage and micro-batch(es); an
    exchange's layer and the micro-batch of the program that issued it."""
    if what.__class__ is Action:
        if what.pair is not None:
            f, s = what.pair
            return {"ir": str(what), "stage": f.stage, "mb": f.mb, "stage2": s.stage, "mb2": s.mb}
        return {"ir": str(what), "stage": what.stage, "mb": what.mb}
    if isinstance(what, tuple) and what[0] != "wait" and len(what) == 2:
        return {"layer": what[1], **({"mb": half.mb, "stage": half.stage} if half is not None else {})}
    return {}
