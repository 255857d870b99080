"""The picture ``portapipe timeline`` draws: the measured step of every rank as a Gantt chart in
``portapipe simulate --plot``'s visual language (:mod:`portapipe.scheduling.plot`), the plan drawn
paler under each rank, and the time each rank was blocked on an exchange or a receive in red
along its top."""

from __future__ import annotations

from typing import Any

from ..scheduling.ir import Schedule
from ..scheduling.plot import CHART_DPI, LEFT_IN, RIGHT_IN, TOP_IN, chart_layout, check_chart_path, chunk_index, draw_row, legend_handles
from ..scheduling.simulate import SimResult, Slot
from . import analyze
from .plan import measured_slots

BLOCKED = "#c0392b"


def draw(doc: dict[str, Any], schedule: Schedule, plan: SimResult, path: str, title: str) -> None:
    """Write the chart to ``path`` (.png, .svg, .pdf); times in milliseconds from each rank's step start."""
    check_chart_path(path)  # ValueError in one line without matplotlib (pip install 'portapipe[viz]') or for a format it cannot write
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    ranks = sorted(analyze.by_rank(doc).items())
    rows: list[tuple[int, list[Slot], list[Slot], list[tuple[float, float]]]] = []
    for r, events in ranks:
        origin = analyze.step_span(events)["begin_s"]
        ms = [Slot(1e3 * s.start, 1e3 * s.end, s.action) for s in measured_slots(events, origin)]
        planned = [Slot(1e3 * s.start, 1e3 * s.end, s.action) for s in plan.timeline[doc["ranks"][r]["pp_rank"]]]
        blocked = [(1e3 * (w["begin_s"] - origin), 1e3 * (w["end_s"] - origin)) for w in events
                   if w["kind"] == "wait" and events[w["parent"]]["kind"] == "action"]
        rows.append((r, ms, planned, blocked))
    span = max([s.end for _, ms, pl, _ in rows for s in ms + pl] + [1e-3])
    lengths = [s.end - s.start for _, ms, _, _ in rows for s in ms if s.end > s.start]
    # the numbers sized for the shorter actions, not the shortest: a cell too short for its number goes without
    lengths.sort()
    layout = chart_layout(span, len(rows), lengths[len(lengths) // 4] if lengths else 1.0, schedule.n_microbatches - 1)
    n, w, h, font = len(rows), layout["width"], layout["height"], layout["label_pt"]
    digits = len(str(max(schedule.n_microbatches - 1, 0)))
    min_label = font * (0.62 * digits + 0.6) * span / ((w - LEFT_IN - RIGHT_IN) * 72)
    fig = plt.figure(figsize=(w, h))
    ax = fig.add_axes((LEFT_IN / w, (h - TOP_IN - layout["row"] * n) / h, (w - LEFT_IN - RIGHT_IN) / w, layout["row"] * n / h))
    chunk = chunk_index(schedule)
    for i, (r, ms, planned, blocked) in enumerate(rows):
        y = n - 1 - i  # rank 0 on top
        draw_row(ax, ms, y + 0.38, 0.52, chunk, font, min_label=min_label)
        draw_row(ax, planned, y + 0.06, 0.26, chunk, 0.0, alpha=0.45)
        for a, b in blocked:
            ax.add_patch(Rectangle((a, y + 0.9), max(b - a, 0.0), 0.07, facecolor=BLOCKED, edgecolor="none"))
    ax.set_xlim(0, span)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - i + 0.5 for i in range(n)])
    ax.set_yticklabels([f"rank {r}\n(pp {doc['ranks'][r]['pp_rank']})" for r, *_ in rows], fontsize=min(9.0, max(5.0, layout["row"] * 72 * 0.4)))
    ax.tick_params(axis="x", labelsize=9)
    ax.set_xlabel("ms from each rank's step start; under each rank, paler: the plan", fontsize=9)
    handles = legend_handles(schedule.name) + [Patch(facecolor=BLOCKED, label="blocked on an exchange or a receive")]
    fig.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=int(layout["ncol"]), fontsize=8.5, frameon=False)
    fig.suptitle(title, fontsize=10, y=1 - 0.12 / h, va="top")
    fig.savefig(path, dpi=CHART_DPI)
    plt.close(fig)
