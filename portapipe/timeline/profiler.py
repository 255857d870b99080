"""``log.profiler``: chosen steps under torch.profiler on chosen ranks, labelled as the timeline is.

The backend makes the profiler (:meth:`~portapipe.backends.base.Backend.profiler`: the host's
operators, and the device's kernels where it has them). While it runs, every span the core emits
(:mod:`portapipe.scheduling.spans`) is a ``record_function`` range of the name the timeline gives
it: each action (``F&B s1 mb3|mb7``), each exchange's issue (``dispatch L5 mb3``) and the time
blocked on it (``wait dispatch L5 mb3``), each wait for a pipeline receive, each gradient bucket's
issue, the loop's own parts. A profiled step runs from its batch to its checkpoint; its trace is
written as ``<log.dir>/profiler/rank<r>_step<N>.json.gz`` by a thread of its own, so a rank that
profiles holds the others up no longer than its profiled step takes (they train on, and wait for
it at their next collective, well within its timeout); the run waits for the files at its end.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from ..ranks import lifeline
from ..scheduling import spans
from ..scheduling.ir import Action
from .record import span_name

FOLDER = "profiler"


def path(log_dir: str | Path, rank: int, step: int) -> Path:
    return Path(log_dir) / FOLDER / f"rank{rank}_step{step}.json.gz"


class _Range:
    """A ``record_function`` range, entered and left by the span it stands for."""

    __slots__ = ("name", "cm")

    def __init__(self, name: str) -> None:
        self.name, self.cm = name, None

    def __enter__(self) -> None:
        self.cm = torch.profiler.record_function(self.name)
        self.cm.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.cm.__exit__(*exc)


class Labels:
    """A :class:`~portapipe.scheduling.spans.SpanRecorder` whose spans are profiler ranges. An
    exchange's or a bucket's range covers its issue (from :func:`~portapipe.scheduling.spans.begin`
    to the work it issued): ranges must nest, and a point-to-point batch's posts do not, so those
    are named by their waits alone."""

    def __init__(self) -> None:
        self.current: Any = None

    def span(self, track: str, what: Any, args: dict[str, Any] | None = None) -> _Range:
        if isinstance(what, Action) and what.pair is None:  # a lone action: its exchanges carry its micro-batch
            self.current = what
        return _Range(span_name(track, what, self.current))

    def begin(self, track: str, what: Any, args: dict[str, Any] | None = None) -> Any:
        name = span_name(track, what, self.current)
        if track == spans.P2P:
            return (name, None)
        issue = _Range(name)
        issue.__enter__()
        return (name, issue)

    def issued(self, token: Any, work: Any, done: Any = None) -> None:
        if token[1] is not None:
            token[1].__exit__(None, None, None)

    def end(self, token: Any) -> None:
        pass

    def blocked(self, token: Any) -> _Range:
        return _Range(f"wait {token[0]}")

    def running(self, half: Any) -> None:
        self.current = half


class ProfilerHook:
    """Profiles the steps ``settings`` (:class:`~portapipe.config.schema.ProfilerConfig`) chooses on
    its ranks (a :class:`~portapipe.training.hooks.StepHook`: it has the hook's four points)."""

    def __init__(self, settings: Any, log_dir: str | Path, backend: Any, groups: Any) -> None:
        self.settings, self.log_dir, self.backend, self.rank = settings, Path(log_dir), backend, groups.rank
        self.mine = settings.ranks is None or groups.rank in settings.ranks
        self.open: tuple[int, Any, Labels] | None = None
        self.writers: list[threading.Thread] = []
        self.written: list[Path] = []

    def before_step(self, step: int) -> None:
        self._stop()
        if self.mine and step + 1 in self.settings.steps:
            with lifeline.untimed():  # starting the profiler is not the step's time
                prof = self.backend.profiler(self.settings.memory)
                prof.__enter__()
            labels = Labels()
            spans.install(labels)
            self.open = (step + 1, prof, labels)

    def after_update(self, step: int, last: bool) -> None:
        pass

    def after_record(self, step: int, row: dict[str, Any] | None) -> None:
        pass

    def close(self, failing: bool) -> None:
        """The run's end: the last profiled step stopped and every trace written (waited for)."""
        self._stop(write=not failing)
        for t in self.writers:
            t.join()

    def _stop(self, write: bool = True) -> None:
        if self.open is None:
            return
        step, prof, labels = self.open
        self.open = None
        spans.uninstall(labels)
        with lifeline.untimed():
            prof.__exit__(None, None, None)
        if write:
            out = path(self.log_dir, self.rank, step)
            out.parent.mkdir(parents=True, exist_ok=True)
            writer = threading.Thread(target=self.backend.export_profile, args=(prof, str(out)), name=f"profile step {step}", daemon=True)
            writer.start()
            self.writers.append(writer)
            self.written.append(out)
