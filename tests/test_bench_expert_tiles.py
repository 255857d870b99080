"""benchmarks/expert_tiles.py: the three grouped-matmul layouts of the routed experts run and
report their times; portapipe's per-tile layout equals one call over tiled weights bit for bit
and copies no weights; bad arguments exit 2."""

from __future__ import annotations

import json

import pytest
import torch


def test_reports_each_layout_and_the_weight_copies(capsys: pytest.CaptureFixture[str], bench_module) -> None:
    module = bench_module("expert_tiles")
    assert module.main(["--ep", "2,4", "--rows-per-source", "8", "--reps", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["ep"] for r in report["runs"]] == [2, 4]
    from portapipe.config import ModelConfig
    from portapipe.models.ffn import Experts

    weights = sum(p.numel() * p.element_size() for p in Experts(ModelConfig(**module.MODEL), 4, 4, torch.float32).parameters())
    for run in report["runs"]:
        assert run["rows"] == 8 * (run["ep"] - 1)
        assert set(run["median_ms"]) == {"per_tile", "tiled_copy", "expert_major"} and min(run["median_ms"].values()) > 0
        assert run["weight_copy_bytes"] == {"per_tile": 0, "tiled_copy": (run["ep"] - 1) * weights, "expert_major": 0}
        assert run["per_tile_equals_tiled_copy"] is True


@pytest.mark.parametrize("args", [["--ep", "1"], ["--ep", "four"], ["--reps", "0"], ["--rows-per-source", "2"]])
def test_bad_arguments_exit_2(args: list[str], capsys: pytest.CaptureFixture[str], bench_module) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench_module("expert_tiles").main(args)
    assert exit_.value.code == 2
    assert "error" in capsys.readouterr().err
