"""Pictures of a simulated schedule: a text timeline for the terminal and a Gantt chart.

Both colour/letter cells by kind: F forward, B input-gradient backward, W weight gradient,
BW full backward, and F&B units drawn as one cell holding both halves. A rank's second (or
later) stage is shown in lower case in text and hatched in the chart: for DualPipe that is
direction 1 (micro-batches entering at the last rank), for DualPipeV the way back up the V,
for interleaved the later chunks.
"""

from __future__ import annotations

import math
from typing import Any

from .ir import Action, Kind
from .simulate import SimResult

_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X"}
LEGEND = "F forward, B input-grad backward, W weight-grad, X full backward, (F;B) overlapped F&B; lower case = rank's 2nd+ stage; . idle"


def _chunk_index(result: SimResult) -> dict[int, int]:
    """Virtual stage -> its index among its rank's stages (0 = first)."""
    s = result.schedule
    return {v: s.stages_of(s.stage_rank[v]).index(v) for v in range(s.n_stages)}


def _half_label(h: Action, chunk: dict[int, int]) -> str:
    letter = _LETTER[h.kind]
    return f"{letter if chunk[h.stage] == 0 else letter.lower()}{h.mb}"


def label(a: Action, chunk: dict[int, int]) -> str:
    if a.pair is not None:
        return f"({_half_label(a.pair[0], chunk)};{_half_label(a.pair[1], chunk)})"
    return _half_label(a, chunk)


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


def gantt(result: SimResult, path: str, title: str | None = None) -> None:
    """Write a Gantt chart (PNG, SVG or PDF by the file's suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    s = result.schedule
    chunk = _chunk_index(result)
    n = s.n_ranks
    span = result.makespan or 1.0
    fig_w = min(40.0, max(10.0, span * 0.22))
    fig, ax = plt.subplots(figsize=(fig_w, 0.55 * n + 1.6))
    min_dur = min((x.end - x.start for row in result.timeline for x in row if x.end > x.start), default=1.0)
    # font size that lets a micro-batch id fit the narrowest cell
    pts_per_unit = fig_w * 72 * 0.9 / span
    font = max(4.0, min(9.0, pts_per_unit * min_dur / 2.2))

    def cell(x0: float, x1: float, y0: float, h: float, half: Action) -> None:
        second = chunk[half.stage] > 0
        ax.add_patch(
            Rectangle(
                (x0, y0), x1 - x0, h, facecolor=_COLOUR[half.kind], edgecolor="white", linewidth=0.4,
                hatch="///" if second else None, alpha=0.75 if second else 1.0,
            )
        )
        ax.text((x0 + x1) / 2, y0 + h / 2, str(half.mb), ha="center", va="center", fontsize=font, color="black")

    for r, row in enumerate(result.timeline):
        y = n - 1 - r  # rank 0 on top
        for slot in row:
            a = slot.action
            if a.pair is not None:
                f, b = a.pair
                cell(slot.start, slot.end, y + 0.5, 0.4, f)
                cell(slot.start, slot.end, y + 0.1, 0.4, b)
                ax.add_patch(Rectangle((slot.start, y + 0.1), slot.end - slot.start, 0.8, fill=False, edgecolor="black", linewidth=1.2))
            else:
                cell(slot.start, slot.end, y + 0.1, 0.8, a)
    ax.set_xlim(0, span)
    ax.set_ylim(0, n)
    ax.set_yticks([n - 1 - r + 0.5 for r in range(n)])
    ax.set_yticklabels([f"rank {r}" for r in range(n)])
    ax.set_xlabel("time (cost units)")
    handles = [Patch(facecolor=_COLOUR[k], label=t) for k, t in ((Kind.F, "F forward"), (Kind.B, "B input-grad"), (Kind.W, "W weight-grad"), (Kind.BW, "full backward"))]
    handles.append(Patch(facecolor="white", edgecolor="black", label="F&B overlapped (black frame)"))
    handles.append(Patch(facecolor="#cccccc", hatch="///", label=_second_label(s.name)))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 if n > 4 else -0.25), ncol=6, fontsize=8, frameon=False)
    ax.set_title(title or f"{s.name}: {n} ranks, {s.n_microbatches} micro-batches")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _second_label(name: str) -> str:
    return {
        "dualpipe": "direction 1 (fed by the last rank)",
        "dualpipev": "second half of the V",
        "interleaved": "later chunks",
    }.get(name, "rank's later stage")


def to_json_timeline(result: SimResult) -> list[list[dict[str, Any]]]:
    return [[{"start": x.start, "end": x.end, "action": str(x.action)} for x in row] for row in result.timeline]
