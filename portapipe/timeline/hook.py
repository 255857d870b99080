"""``log.timeline``: the loop's hook that records chosen steps (a
:class:`~portapipe.training.hooks.StepHook`: it has the hook's four points).

At the start and before each chosen step every rank measures its clock against rank 0's
(:mod:`.align`); the backend's span clock starts (outside the step: a device clock synchronizes
here) and a :class:`~.record.StepRecorder` hears everything the core emits until the next step
begins, so a step's record holds its batch, its actions and exchanges, its update and its
checkpoint. Then, before the next step (or at the run's end), each rank reads its marks once and
rank 0 gathers every rank's rows and writes the step's two files (:mod:`.trace`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..scheduling import spans
from . import align, trace
from .record import StepRecorder


class TimelineHook:
    """Records the steps ``settings`` (:class:`~portapipe.config.schema.TimelineConfig`) chooses
    into ``log_dir``/timeline/. ``config``: the run's config as a dict (the files carry it, so
    ``portapipe timeline`` rebuilds the schedule). ``clock``: the backend's span clock unless given."""

    def __init__(self, settings: Any, log_dir: str | Path, config: dict[str, Any], backend: Any, groups: Any, clock: Any = None) -> None:
        self.settings, self.log_dir, self.config = settings, Path(log_dir), config
        self.backend, self.groups = backend, groups
        self.clock = backend.span_clock() if clock is None else clock
        self.at_start = align.measure(backend, self.clock.now)
        self.open: tuple[int, StepRecorder, align.Alignment] | None = None
        self.written: list[Path] = []

    def before_step(self, step: int) -> None:
        self._finish()
        if self.settings.chosen(step + 1):
            alignment = align.measure(self.backend, self.clock.now)
            self.clock.start()
            rec = StepRecorder(self.clock)
            spans.install(rec)
            self.open = (step + 1, rec, alignment)

    def after_update(self, step: int, last: bool) -> None:
        pass

    def after_record(self, step: int, row: dict[str, Any] | None) -> None:
        pass

    def close(self, failing: bool) -> None:
        """The run's end: the last recorded step's files (not after a failure: the others may be gone)."""
        if failing and self.open is not None:
            spans.uninstall(self.open[1])
            self.open = None
        self._finish()

    def payload(self, rec: StepRecorder, alignment: align.Alignment) -> dict[str, Any]:
        """This rank's part of a step's files: its place, its clock's alignment, its rows."""
        g = self.groups
        start, rows = rec.rows_read()
        return {"rank": g.rank, "pp_rank": g.pp_rank, "dp_rank": g.dp_rank, "ep_rank": g.ep_rank, "pp": g.pp, "dp": g.dp, "ep": g.ep,
                "ep_ranks": list(g.ep_ranks) or [g.rank], "clock": self.clock.kind, "alignment": alignment.as_dict(),
                "at_start": self.at_start.as_dict(), "start_s": start, "rows": rows}

    def _finish(self) -> None:
        """The open record read, gathered to rank 0 and written (collective)."""
        if self.open is None:
            return
        step, rec, alignment = self.open
        self.open = None
        spans.uninstall(rec)
        mine = self.payload(rec, alignment)
        parts: list[Any] | None = [None] * dist.get_world_size() if self.groups.rank == 0 else None
        dist.gather_object(mine, parts, dst=0)
        if parts is not None:
            self.written += trace.write(trace.merge(parts, step, self.config), self.log_dir)
