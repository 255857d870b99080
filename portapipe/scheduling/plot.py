"""Pictures of a simulated schedule: a text timeline for the terminal and a Gantt chart.

Both use one vocabulary (:data:`VOCABULARY`, also in ``portapipe simulate --help``), with the
costs of the DualPipe paper: F forward; B backward, of which W is the weight-gradient part. A
backward split in two shows as a B cell (its input-gradient part, cost B-W) and a W cell (cost
W); a backward run whole is an X cell (cost B); an F&B unit, one cell holding both halves. A
rank's second (or later) stage is shown in lower case in text and hatched in the chart: for
DualPipe that is direction 1 (micro-batches entering at the last rank), for DualPipeV the way
back up the V, for interleaved the later chunks.
"""

from __future__ import annotations

import math
from typing import Any

from .ir import Action, Kind, Schedule
from .simulate import SimResult, Slot

_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
#: The one vocabulary of the timeline, the chart and the cost option: cell -> meaning (cost).
VOCABULARY = {
    "F": "forward (cost F)",
    "B": "backward, input-grad part (cost B-W)",
    "W": "backward, weight-grad part (cost W)",
    "X": "backward, whole (cost B)",
    "(F;B)": "F&B, forward and backward overlapped (cost FB)",
}
LEGEND = "; ".join(f"{k} {v}" for k, v in VOCABULARY.items()) + "; lower case = rank's 2nd+ stage; . idle"


def chunk_index(s: Schedule) -> dict[int, int]:
    """Virtual stage -> its index among its rank's stages (0 = first)."""
    return {v: s.stages_of(s.stage_rank[v]).index(v) for v in range(s.n_stages)}


def _chunk_index(result: SimResult) -> dict[int, int]:
    return chunk_index(result.schedule)


def _half_label(h: Action, chunk: dict[int, int]) -> str:
    letter = _LETTER[h.kind]
    return f"{letter if chunk[h.stage] == 0 else letter.lower()}{h.mb}"


def label(a: Action, chunk: dict[int, int]) -> str:
    if a.pair is not None:
        return f"({_half_label(a.pair[0], chunk)};{_half_label(a.pair[1], chunk)})"
    return _half_label(a, chunk)


#: The narrowest text timeline: a rank's label and a few columns of time.
MIN_WIDTH = 12


def text_timeline(result: SimResult, width: int | None = None) -> str:
    """Rows of characters, one per rank, time left to right. Each cell starts with its label
    and is padded with '-'; idle time is '.'. ``width`` caps the row length (labels are cut
    when cells get too narrow)."""
    chunk = _chunk_index(result)
    slots = [s for row in result.timeline for s in row]
    if not slots or result.makespan <= 0:
        return "(empty schedule)"
    # enough characters per time unit for the widest label per unit of its duration
    per_unit = max((len(label(s.action, chunk)) + 1) / (s.end - s.start) for s in slots if s.end > s.start)
    per_unit = float(max(1, math.ceil(per_unit - 1e-9)))  # whole columns per unit keep cells aligned
    if width is not None:
        if width < MIN_WIDTH:
            raise ValueError(f"a timeline needs at least {MIN_WIDTH} columns, got width {width}")
        per_unit = min(per_unit, (width - 8) / result.makespan)
    cols = max(1, math.ceil(result.makespan * per_unit))
    lines = []
    for r, row in enumerate(result.timeline):
        cells = ["."] * cols
        for s in row:
            a, b = round(s.start * per_unit), round(s.end * per_unit)
            b = max(b, a + 1)
            text = label(s.action, chunk)
            for i in range(a, min(b, cols)):
                k = i - a
                cells[i] = text[k] if k < len(text) and k < b - a - 1 else ("|" if i == b - 1 else "-")
        lines.append(f"{r:>4} " + "".join(cells))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- chart
_COLOUR = {Kind.F: "#f4a259", Kind.B: "#5b8e7d", Kind.W: "#8cb3d9", Kind.BW: "#bc4b51"}


#: Chart size: as wide as the micro-batch numbers need to be readable, within caps, so a
#: viewer never has to shrink the picture (and its labels) to fit a screen; rows shrink when
#: there are many ranks; numbers that would be smaller than ``MIN_LABEL_PT`` are left out.
CHART_DPI = 125
CHART_WIDTH_IN = (8.0, 15.0)
CHART_PLOT_HEIGHT_IN = 9.0
MIN_LABEL_PT = 6.5
LEFT_IN, RIGHT_IN, TOP_IN, XLABEL_IN, LEGEND_ROW_IN = 0.95, 0.25, 0.45, 0.6, 0.24


def chart_layout(span: float, n_ranks: int, min_dur: float, max_mb: int) -> dict[str, float]:
    """Figure size (inches), legend columns and the micro-batch numbers' font (0: left out)."""
    digits = len(str(max(max_mb, 0)))
    per_label = 0.62 * digits + 0.6  # a number's width plus padding, in units of its font size
    lo, hi = CHART_WIDTH_IN
    wanted = span * 8.0 * per_label / max(min_dur, 1e-9) / 72 + LEFT_IN + RIGHT_IN  # 8 pt numbers
    width = min(hi, max(lo, wanted))
    row = min(0.55, CHART_PLOT_HEIGHT_IN / n_ranks)
    pts_per_unit = (width - LEFT_IN - RIGHT_IN) * 72 / span
    font = min(9.0, pts_per_unit * min_dur / per_label, row * 72 * 0.4 * 0.8)
    ncol = 3 if width >= 11 else 2
    legend_rows = -(-6 // ncol)
    height = row * n_ranks + TOP_IN + XLABEL_IN + legend_rows * LEGEND_ROW_IN
    return {"width": width, "height": height, "row": row, "ncol": ncol, "label_pt": font if font >= MIN_LABEL_PT else 0.0}


def check_chart_path(path: str) -> None:
    """Raise ValueError (one line) unless a chart can be written to ``path``: matplotlib is
    installed, the suffix names a format it writes and the folder exists."""
    import os

    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise ValueError("a chart needs matplotlib: pip install 'portapipe[viz]'") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = os.path.splitext(path)[1].lstrip(".").lower()
    if suffix not in formats:
        said = f"its suffix .{suffix} is not a format matplotlib writes" if suffix else "it has no suffix to say the format"
        raise ValueError(f"cannot write a chart to {path!r}: {said}; use .png, .svg or .pdf (or one of: {', '.join(sorted(formats))})")
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        raise ValueError(f"cannot write a chart to {path!r}: the folder {folder!r} does not exist")


def gantt(result: SimResult, path: str, title: str | None = None) -> dict[str, float]:
    """Write a Gantt chart (PNG, SVG or PDF by the file's suffix); return its layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.schedule
    chunk = _chunk_index(result)
    n = s.n_ranks
    span = result.makespan or 1.0
    slots = [x for row in result.timeline for x in row if x.end > x.start]
    min_dur = min((x.end - x.start for x in slots), default=1.0)
    layout = chart_layout(span, n, min_dur, max((x.action.mb for x in slots), default=0))
    font, w, h = layout["label_pt"], layout["width"], layout["height"]
    fig = plt.figure(figsize=(w, h))
    bottom = h - TOP_IN - layout["row"] * n
    ax = fig.add_axes((LEFT_IN / w, bottom / h, (w - LEFT_IN - RIGHT_IN) / w, layout["row"] * n / h))

    for r, row in enumerate(result.timeline):
        draw_row(ax, row, n - 1 - r + 0.1, 0.8, chunk, font)  # rank 0 on top
    ax.set_xlim(0, span)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)], fontsize=min(9.0, max(5.0, layout["row"] * 72 * 0.6)))
    ax.tick_params(axis="x", labelsize=9)
    ax.set_xlabel("time (cost units)" + ("" if font else "; micro-batch numbers left out at this size"), fontsize=9)
    fig.legend(handles=legend_handles(s.name), loc="lower center", bbox_to_anchor=(0.5, 0.0), ncol=int(layout["ncol"]), fontsize=8.5, frameon=False)
    fig.suptitle(title or f"{s.name}: {n} ranks, {s.n_microbatches} micro-batches", fontsize=10, y=1 - 0.12 / h, va="top")
    fig.savefig(path, dpi=CHART_DPI)
    plt.close(fig)
    return layout


def draw_row(ax: Any, slots: list[Slot], y: float, height: float, chunk: dict[int, int], font: float, alpha: float = 1.0,
             min_label: float = 0.0) -> None:
    """One rank's cells on ``ax``, from ``y`` up ``height``: a pair's two halves stacked in a black
    frame, a rank's later stage hatched, each cell's micro-batch written in ``font`` points (0: none)
    where the cell is at least ``min_label`` long."""
    from matplotlib.patches import Rectangle

    def cell(x0: float, x1: float, y0: float, h: float, half: Action) -> None:
        second = chunk[half.stage] > 0
        ax.add_patch(
            Rectangle(
                (x0, y0), x1 - x0, h, facecolor=_COLOUR[half.kind], edgecolor="white", linewidth=0.4,
                hatch="///" if second else None, alpha=(0.75 if second else 1.0) * alpha,
            )
        )
        if font and x1 - x0 >= min_label:
            ax.text((x0 + x1) / 2, y0 + h / 2, str(half.mb), ha="center", va="center", fontsize=font, color="black")

    for slot in slots:
        a = slot.action
        if a.pair is not None:
            f, b = a.pair
            cell(slot.start, slot.end, y + height / 2, height / 2, f)
            cell(slot.start, slot.end, y, height / 2, b)
            ax.add_patch(Rectangle((slot.start, y), slot.end - slot.start, height, fill=False, edgecolor="black", linewidth=1.2 * alpha))
        else:
            cell(slot.start, slot.end, y, height, a)


def legend_handles(name: str) -> list[Any]:
    """The chart's legend: the cell kinds, the F&B frame, the hatch of a rank's later stage."""
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=_COLOUR[k], label=f"{_LETTER[k]} {VOCABULARY[_LETTER[k]]}") for k in (Kind.F, Kind.B, Kind.W, Kind.BW)]
    handles.append(Patch(facecolor="white", edgecolor="black", label="frame: " + VOCABULARY["(F;B)"]))
    handles.append(Patch(facecolor="#cccccc", hatch="///", label="hatched: " + _second_label(name)))
    return handles


def _second_label(name: str) -> str:
    return {
        "dualpipe": "direction 1 (fed by the last rank)",
        "dualpipev": "second half of the V",
        "interleaved": "later chunks",
    }.get(name, "rank's later stage")


def to_json_timeline(result: SimResult) -> list[list[dict[str, Any]]]:
    return [[{"start": x.start, "end": x.end, "action": str(x.action)} for x in row] for row in result.timeline]
