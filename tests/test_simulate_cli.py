"""`portapipe simulate`: text timeline, JSON summary, Gantt chart, argument errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from portapipe.cli import main


def test_text_timeline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("   0 ") or line.startswith("   1 ")]
    assert len(rows) == 2
    # rank 1 idles one forward at the start, then alternates F and full backward
    assert rows[1].split()[1].startswith(".")
    assert "F0" in rows[0] and "X2" in rows[1]
    assert "bubble max 3" in out and "closed form (pp-1)(F+B) = 3" in out


def test_json_summary(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "dualpipev", "--pp", "4", "--microbatches", "10", "--cost", "F=1,B=2,W=1,FB=2.5", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    assert {"schedule", "pp", "microbatches", "makespan", "bubble", "bubble_formula", "peak_activations", "params_per_rank"} <= d.keys()
    assert d["bubble"]["max"] == pytest.approx(3 * (2.5 + 2 - 3))
    assert d["bubble"]["max"] == max(d["bubble"]["per_rank"])
    assert d["bubble_formula"]["value"] == pytest.approx(4.5)
    assert d["peak_activations"] == [9, 9, 9, 9]


def test_json_timeline_and_no_w_split(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--schedule", "zb1p", "--pp", "3", "--microbatches", "4", "--json", "--timeline", "--no-w-split"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    acts = [x["action"] for row in d["timeline"] for x in row]
    assert not any(re.fullmatch(r"\d+[BW]\d+", a) for a in acts) and "0BW0" in acts
    assert d["w_split"] is False


def test_plot_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # a chart needs the viz extra
    target = tmp_path / "dualpipe.png"
    argv = ["simulate", "--schedule", "dualpipe", "--pp", "8", "--microbatches", "20", "--plot", str(target), "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["plot"] == str(target)
    data = target.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--schedule", "dualpipe", "--pp", "3", "--microbatches", "12"], "even number of pipeline ranks"),
        (["--schedule", "dualpipev", "--pp", "4", "--microbatches", "5"], "microbatches >= 2*pp"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost", "F=1,Q=2"], "expected NAME=VALUE"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost", "F=1,B=2,FB=1"], "FB >= max(F, B)"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost", "F=nan"], "cost F must be a finite number >= 0, got nan"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost", "F=inf,B=inf"], "cost F must be a finite number >= 0, got inf"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--cost", "p2p=inf"], "cost p2p must be a finite number >= 0, got inf"),
        (["--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--width", "0"], "--width: a timeline needs at least 12 columns, got width 0"),
    ],
)
def test_bad_arguments_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "name, said",
    [
        ("chart", "cannot write a chart to '{p}': it has no suffix to say the format; use .png, .svg or .pdf"),
        ("chart.xyz", "cannot write a chart to '{p}': its suffix .xyz is not a format matplotlib writes; use .png, .svg or .pdf"),
        ("missing/chart.png", "cannot write a chart to '{p}': the folder '{d}' does not exist"),
        ("/proc/portapipe-chart.png", "cannot write a chart to '{p}': No such file or directory"),
        ("a_folder.png", "cannot write a chart to '{p}': Is a directory"),
    ],
)
def test_a_chart_that_cannot_be_written_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, said: str) -> None:
    pytest.importorskip("matplotlib")  # a chart needs the viz extra
    (tmp_path / "a_folder.png").mkdir()
    path = name if name.startswith("/") else str(tmp_path / name)
    argv = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--plot", path]
    assert main(argv) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("portapipe simulate: " + said.format(p=path, d=str(Path(path).parent))), line
    assert captured.out == "" and sorted(p.name for p in tmp_path.iterdir()) == ["a_folder.png"]


def test_uneven_stage_splits_scale_each_stages_costs_by_its_layers(capsys: pytest.CaptureFixture[str]) -> None:
    """--layers-per-stage 3,1 on 1F1B pp 2: stage 0 costs 1.5x a mean block, stage 1 0.5x; the
    heavier stage sets the pace (m x 1.5 (F + B) = 18) and the lighter one idles (bubble 12)."""
    argv = ["simulate", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--json"]
    assert main(argv) == 0
    even = json.loads(capsys.readouterr().out)
    assert main([*argv, "--layers-per-stage", "3,1"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert even["makespan"] == 15 and d["makespan"] == 18
    assert d["bubble"]["per_rank"] == [0, 12] and d["bubble_formula"] is None
    assert main([*argv, "--layers-per-stage", "2,2"]) == 0  # equal stages: as without it
    assert json.loads(capsys.readouterr().out)["makespan"] == 15
    for bad, line in (("3,1,1", "3 entries; 1f1b with pp=2 has 2 model blocks"), ("4,0", "every block needs a layer"), ("a,b", "not a comma")):
        assert main([*argv, "--layers-per-stage", bad]) == 2
        assert line in capsys.readouterr().err
