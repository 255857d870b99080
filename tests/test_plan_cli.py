"""`portapipe profile` and `portapipe plan`: what they write, and bad input refused with exit 2
and one line, before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from portapipe.cli import main
from portapipe.config import load_config
from portapipe.plan.profile import Profile
from portapipe.config.setup import Setup
from portapipe.plan.shape import Shape, saved_bytes

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = str(ROOT / "examples" / "cpu.yaml")
TINY = ["--set", "parallel.pp=1", "--set", "parallel.ep=2", "--set", "schedule.name=1f1b", "--set", "model.hidden=32",
        "--set", "model.n_layers=2", "--set", "model.seq_len=16", "--set", "train.micro_batch_size=2"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and "Traceback" not in err[0], err


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["plan", EXAMPLE, "--devices", "4", "--memory", "12XB", "--profile", "h800"], "--memory: '12XB' is not a size"),
        (["plan", EXAMPLE, "--devices", "0", "--profile", "h800"], "--devices: 0"),
        (["plan", EXAMPLE, "--devices", "4", "--profile", "/no/such/profile.json"], "does not exist"),
        (["plan", EXAMPLE, "--devices", "4", "--profile", "h800", "--top", "0"], "--top: 0"),
        (["plan", EXAMPLE, "--devices", "4", "--profile", "h800", "--set", "model.n_experts=7"], "model.n_experts: 7"),
        (["profile", EXAMPLE, "--published", "a100", "--out", "/dev/null"], "unknown device 'a100'"),
        (["profile", EXAMPLE, "--reps", "0"], "--reps must be >= 1"),
        (["plan", EXAMPLE, "--profile", "h800"], "--devices or --memory is required"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str) -> None:
    _one_line_error(capsys, argv, fragment)


def test_bad_profile_and_loads_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": 1}')
    _one_line_error(capsys, ["plan", EXAMPLE, "--devices", "4", "--profile", str(bad)], "missing device")
    _one_line_error(capsys, ["plan", EXAMPLE, "--devices", "4", "--profile", str(tmp_path)],
                    f"--profile: '{tmp_path}' is a folder; it takes a profile file (JSON: `portapipe profile CONFIG --out {tmp_path / 'profile.json'}` "
                    "writes one) or a published device (h800)")
    loads = tmp_path / "loads.json"
    loads.write_text(json.dumps({"loads": [[1, 2, 3]]}))
    _one_line_error(capsys, ["plan", EXAMPLE, "--devices", "4", "--profile", "h800", "--loads", str(loads)], "3 experts per layer, the model 8")


def test_plan_prints_the_table_writes_the_best_and_the_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")  # a chart needs the viz extra
    out, png = tmp_path / "best.yaml", tmp_path / "plan.png"
    assert main(["plan", EXAMPLE, "--devices", "4", "--memory", "64MiB", "--profile", "h800", "--out", str(out), "--plot", str(png), "--top", "3"]) == 0
    text = capsys.readouterr().out
    assert "step s" in text and "<- your config" in text and f"wrote {out}" in text
    rows = [line for line in text.splitlines() if line[:3].strip() in ("1", "2", "3")]
    assert len(rows) == 3
    best = load_config(out)
    assert best.world_size == 4 and Setup.from_config(best).global_batch == Setup.from_config(load_config(EXAMPLE)).global_batch
    assert png.stat().st_size > 1000


def test_plan_json_and_nothing_fits(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", EXAMPLE, "--devices", "4", "--profile", "h800", "--json", "--top", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert len(data["ranked"]) == 2 and data["ranked"][0]["step_s"] <= data["ranked"][1]["step_s"]
    assert data["user"]["schedule"] == "dualpipev" and data["considered"] > 100
    assert main(["plan", EXAMPLE, "--devices", "4", "--memory", "1KiB", "--profile", "h800"]) == 1
    captured = capsys.readouterr()
    assert "no setup fits" in captured.err and "your config is dropped: memory" in captured.out


def test_a_profile_written_to_a_folder_is_refused_before_anything_is_measured(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import portapipe.ranks.launch

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    for extra in ([], ["--published", "h800"]):
        _one_line_error(capsys, ["profile", EXAMPLE, "--out", str(tmp_path), *extra],
                        f"portapipe profile: --out: '{tmp_path}' is a folder; give the profile file to write, e.g. {tmp_path / 'profile.json'}")
        _one_line_error(capsys, ["profile", EXAMPLE, "--out", str(tmp_path / "no" / "p.json"), *extra],
                        f"portapipe profile: --out: the folder '{tmp_path / 'no'}' does not exist")


def test_nothing_fits_names_the_closest_setup_and_what_it_breaks_or_exceeds(capsys: pytest.CaptureFixture[str]) -> None:
    """Seven devices for a 4-layer model and a batch of 32: pp 7 has too few layers, the batch and
    the 8 experts do not split 7 ways; under a budget, the setup that needs the least over it."""
    assert main(["plan", EXAMPLE, "--devices", "7", "--profile", "h800"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "portapipe plan: no setup fits on 7 devices: the closest, 1f1b 7x1x1, 8x4, off: model.n_layers: 4 < 7 model blocks that schedule "
        "1f1b with pp=7 needs (one layer each at least); layouts not tried: 1x1x7: the global batch of 32 sequences does not split over "
        "dp x ep = 7 replicas; 1x7x1: 8 experts do not split over ep 7"
    ]
    assert "your config is not among the ranked: " in captured.out and "the best" not in captured.out  # there is no best
    assert main(["plan", EXAMPLE, "--devices", "4", "--memory", "1MiB", "--profile", "h800", "--json"]) == 1
    captured = capsys.readouterr()
    closest = json.loads(captured.out)["closest"]
    assert (closest["schedule"], closest["layout"], closest["memory_option"]) == ("dualpipev", "2x2x1", "level0 + zero2")
    assert captured.err.splitlines() == [
        "portapipe plan: no setup fits on 4 devices: the closest, dualpipev 2x2x1, 4x4, level0 + zero2: memory: parameters, gradients "
        "and optimizer state alone need 1.31 MiB > budget 1.00 MiB"
    ]


def _published(tmp_path: Path, a2a: dict[str, object] | None) -> Path:
    """The published H800 profile for the example's shape as a file, its a2a table replaced."""
    path = tmp_path / "h800.json"
    assert main(["profile", EXAMPLE, "--published", "h800", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    data["a2a"] = data["a2a"] if a2a is None else a2a
    path.write_text(json.dumps(data))
    return path


def test_a_profile_whose_all_to_alls_are_free_is_refused_and_a_stand_in_figure_is_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An empty a2a table would price every all-to-all at 0 s: refused in one line naming the file
    and key. A table lacking the EP sizes the plan prices says which measured figure stands in."""
    empty = _published(tmp_path, {})
    _one_line_error(capsys, ["plan", EXAMPLE, "--devices", "4", "--profile", str(empty)],
                    f"--profile {empty}: a2a is empty, so every all-to-all would cost 0 s")
    one = ["--set", "parallel.pp=1", "--set", "parallel.ep=1", "--set", "schedule.name=1f1b"]
    assert main(["plan", EXAMPLE, "--devices", "1", "--profile", str(empty), *one]) == 0  # one device: no all-to-all to price
    capsys.readouterr()
    only8 = _published(tmp_path, {"8": {"fixed": 2e-5, "per_unit": 1 / 153e9}})
    capsys.readouterr()
    assert main(["plan", EXAMPLE, "--devices", "4", "--profile", str(only8), "--json", "--top", "2000"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {r["ep"] for r in data["ranked"]} == {1, 2, 4}  # every row shown: its all-to-alls priced
    assert data["notes"] == ["a2a at ep 2, 4 extrapolated from the 8-device figure (the profile measured ep 8)"]
    whole = _published(tmp_path, None)
    capsys.readouterr()
    assert main(["plan", EXAMPLE, "--devices", "4", "--profile", str(whole), "--top", "2000"]) == 0
    assert "note: a2a at ep 2, 4 extrapolated from the 8-device figure (the profile measured ep 8, 16, 32, 64, 128, 256)" in capsys.readouterr().out


def test_which_measured_all_to_all_figure_stands_in_for_another_ep_size() -> None:
    from portapipe.plan.published import published

    prof = published("h800", Setup.from_config(load_config(EXAMPLE)).shape)
    prof.a2a = {"8": prof.a2a["8"], "32": prof.a2a["32"]}
    assert prof.a2a_stand_in(8) is None and prof.a2a_stand_in(1) is None
    assert prof.a2a_stand_in(256) == "extrapolated from the 32-device figure"
    assert prof.a2a_stand_in(4) == "extrapolated from the 8-device figure"
    assert prof.a2a_stand_in(16) == "taken from the nearest, the 8-device figure"
    assert prof.a2a_time(256, 1e6) == prof.a2a["32"](1e6 * 255 / 256)  # the figure named is the one priced


def test_published_profile_is_written_for_the_configs_shape(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "h800.json"
    assert main(["profile", str(ROOT / "examples" / "plan" / "deepseek_v3.yaml"), "--published", "h800", "--out", str(out)]) == 0
    prof = Profile.load(out)
    assert prof.shape.hidden == 7168 and prof.processors is None and "2048" not in prof.source
    tokens = 4096
    assert prof.time("experts", "F", "off", tokens * 8) > prof.time("shared", "F", "off", tokens) > 0


@pytest.fixture
def two_busy_processes() -> Iterator[None]:
    """Two processes spinning beside the test: a profile is taken on a machine doing other work."""
    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for p in spin:
            p.kill()
            p.wait()


@pytest.mark.multiproc
def test_profile_measures_every_part_on_two_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path, two_busy_processes: None) -> None:
    """Every cost the profile records for work that takes time is above zero, with two busy
    processes beside it (AdamW's per-tensor cost came out 0.0 one run in three that way)."""
    out = tmp_path / "cpu.json"
    assert main(["profile", EXAMPLE, *TINY, "--out", str(out), "--reps", "2", "--warmup", "0", "--timeout", "300"]) == 0
    prof = Profile.load(out)
    cfg = load_config(EXAMPLE, TINY[1::2])
    s = Shape.of(cfg.model)
    assert prof.shape == s and prof.device["ep_profiled"] == 2 and prof.tokens == [32, 64]
    for part in ("embed", "attention", "dense", "experts", "shared", "combine", "head"):
        assert prof.time(part, "F", "off", 32) > 0 and prof.time(part, "B", "off", 32) > 0, part
    for option in ("off", "level0", "level1", "recompute_moe", "recompute_full"):
        for part, cost in prof.saved_bytes[option].items():
            slope = saved_bytes(s, part, option, 2, 2) - saved_bytes(s, part, option, 1, 1)  # per token (per row: experts)
            assert cost.per_unit == pytest.approx(slope), (option, part)
    assert "2" in prof.a2a and prof.p2p.fixed > 0 and prof.optimizer.per_unit > 0 and prof.optimizer_tensor_s > 0
    # what the communication threads spend, the waits for EP peers, the executor's work per action
    assert prof.a2a_background(2, 4096) > 0 and prof.p2p_cpu(4096) > 0 and 0 <= prof.action_s < 0.05
    assert prof.processors is not None and prof.lag(2) is not None
    assert (prof.crowding == {}) == (prof.processors >= 2)  # two ranks crowd a single processor only
    assert len(prof.loads) == cfg.model.n_layers - cfg.model.n_dense and len(prof.loads[0]) == cfg.model.n_experts
    assert sum(prof.loads[0]) > 0


def test_rules_are_printed_and_documented(capsys: pytest.CaptureFixture[str]) -> None:
    from portapipe.config.rules import RULES

    assert main(["plan", EXAMPLE, "--rules"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [r.name for r in RULES]
    doc = (ROOT / "docs" / "plan.md").read_text()
    for r in RULES:
        assert f"| `{r.name}` | {r.scope} | {r.severity} | {r.reason} |" in doc, r.name


@pytest.mark.multiproc
def test_a_profile_on_more_ranks_than_processors_measures_their_crowding(tmp_path: Path) -> None:
    out = tmp_path / "crowded.json"
    three = [*TINY, "--set", "parallel.pp=3", "--set", "parallel.ep=1", "--set", "model.n_layers=3"]
    assert main(["profile", EXAMPLE, *three, "--out", str(out), "--reps", "2", "--warmup", "0", "--timeout", "300"]) == 0
    prof = Profile.load(out)
    if prof.processors is not None and prof.processors < 3:
        assert set(prof.crowding) == {"3"} and prof.crowded(3) == prof.crowding["3"] >= 1.0
        assert set(prof.p2p_crowded) == {"3"} and prof.p2p_extra(3) == prof.p2p_crowded["3"] >= 0.0
        assert prof.lag(3) is not None  # an EP group of two waited for its peer, alone and with the third rank
    else:
        assert prof.crowding == prof.p2p_crowded == {}


def test_an_optimizer_cost_the_clock_cannot_resolve_is_refused_not_recorded_as_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from portapipe.plan import measure
    from portapipe.plan.profile import ProfileError

    per_element, per_tensor = measure._optimizer(torch.float32, 2)
    assert per_element.per_unit > 0 and per_tensor > 0
    monkeypatch.setattr(measure, "cpu_time", lambda fn, reps: 1e-3)  # a clock that sees no difference
    with pytest.raises(ProfileError, match="cannot resolve its costs"):
        measure._optimizer(torch.float32, 2)
