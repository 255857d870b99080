"""`portapipe simulate`: one vocabulary in the help, the text legend and the chart; a chart
that stays legible at any schedule size."""

from __future__ import annotations

from pathlib import Path

import pytest

matplotlib = pytest.importorskip("matplotlib")  # the viz extra
from PIL import Image  # noqa: E402  (matplotlib's own dependency)

from portapipe.cli import build_parser
from portapipe.scheduling.comms import lower_comms
from portapipe.scheduling.plot import CHART_DPI, CHART_WIDTH_IN, LEGEND, MIN_LABEL_PT, VOCABULARY, gantt
from portapipe.scheduling.schedules import build
from portapipe.scheduling.simulate import Costs, simulate


def _sim(name: str, pp: int, mbs: int):
    return simulate(lower_comms(build(name, pp, mbs, 2)), Costs())


def _help(command: str) -> str:
    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None) and command in a.choices)
    return " ".join(sub.choices[command].format_help().split())


def test_the_help_the_legend_and_the_chart_use_one_vocabulary(tmp_path: Path) -> None:
    help_text = _help("simulate")
    # B is a backward; its split cell costs B-W; a whole backward is an X cell; W its weight part.
    assert "B a backward (a whole one: an X cell; split, its B cell costs B-W), W its weight-gradient part" in help_text
    assert "run every backward whole (X cells, no B/W split)" in help_text
    assert VOCABULARY["B"] == "backward, input-grad part (cost B-W)" and VOCABULARY["X"] == "backward, whole (cost B)"
    for letter, meaning in VOCABULARY.items():
        assert f"{letter} {meaning}" in LEGEND
    svg = tmp_path / "chart.svg"
    with matplotlib.rc_context({"svg.fonttype": "none"}):  # keep the text as text
        gantt(_sim("zb1p", 2, 4), str(svg))
    text = svg.read_text()
    for letter in ("F", "B", "W", "X"):
        assert f"{letter} {VOCABULARY[letter]}" in text
    assert "full backward" not in text and "input-grad backward" not in text


@pytest.mark.parametrize("name, pp, mbs", [("dualpipev", 2, 4), ("dualpipe", 8, 20), ("1f1b", 8, 64), ("1f1b", 16, 16)])
def test_the_chart_width_follows_the_makespan_within_caps_and_numbers_are_legible_or_left_out(tmp_path: Path, name, pp, mbs) -> None:
    result = _sim(name, pp, mbs)
    png = tmp_path / "chart.png"
    layout = gantt(result, str(png))
    width_px, height_px = Image.open(png).size
    lo, hi = CHART_WIDTH_IN
    assert round(lo * CHART_DPI) <= width_px <= round(hi * CHART_DPI)
    assert height_px <= 12 * CHART_DPI
    assert layout["label_pt"] == 0 or layout["label_pt"] >= MIN_LABEL_PT
    if (name, pp) in (("dualpipev", 2), ("dualpipe", 8)):
        assert layout["label_pt"] >= MIN_LABEL_PT  # small schedules keep their micro-batch numbers
    if (name, pp) == ("1f1b", 8):
        assert layout["label_pt"] == 0  # 213 cost units cannot hold readable numbers within the cap


def test_a_longer_schedule_never_gets_a_narrower_chart() -> None:
    from portapipe.scheduling.plot import chart_layout

    widths = [chart_layout(span, 4, 1.0, 20)["width"] for span in (5, 20, 40, 80, 160, 320)]
    assert widths == sorted(widths) and widths[0] == CHART_WIDTH_IN[0] and widths[-1] == CHART_WIDTH_IN[1]
