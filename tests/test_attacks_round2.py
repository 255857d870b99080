"""Second round of commands tried as a new user would: each one that failed, answered wrongly
or stayed silent now refuses with exit 2 and one line naming the key or file, or does what the
documentation says."""

from __future__ import annotations

from pathlib import Path

import pytest

import portapipe.launch
from portapipe.cli import main
from portapipe.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started although the input was bad")

    monkeypatch.setattr(portapipe.launch, "run_ranks", refuse)


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return code, err.strip().splitlines()


def train(tmp_path: Path, *sets: str) -> list[str]:
    args = ["train", str(EXAMPLE), "--set", f"log.dir={tmp_path / 'run'}"]
    for s in sets:
        args += ["--set", s]
    return args


# ------------------------------------------------------------------------------- config values
@pytest.mark.parametrize(
    "setting, key",
    [
        ("train.steps=true", "train.steps: True"),
        ("train.lr=true", "train.lr: True"),
        ("model.init_std=false", "model.init_std: False"),
        ("train.betas=[true,0.5]", "train.betas: [True, 0.5]"),
        ("balancer.torus=[true,2]", "balancer.torus: [True, 2]"),
        ("memory.recompute_layers=true", "memory.recompute_layers: True"),
        ("launch.stall_timeout_s=false", "launch.stall_timeout_s: False"),
    ],
)
def test_a_boolean_in_a_number_key_is_refused(tmp_path, capsys, no_ranks, setting, key) -> None:
    code, lines = cli(capsys, *train(tmp_path, setting))
    assert code == 2 and lines == [f"portapipe: config error: {key}: a boolean is not a number; give a number"], lines


def test_yaml_integers_stay_valid_in_float_keys_and_booleans_in_boolean_keys() -> None:
    c = load_config(EXAMPLE, ["train.lr=1", "train.betas=[0, 0]", "launch.stall_timeout_s=5", "log.progress=false", "schedule.overlap=true"])
    assert c.train.lr == 1.0 and c.train.betas == (0.0, 0.0) and c.launch.stall_timeout_s == 5.0
    assert c.log.progress is False and c.schedule.overlap is True


@pytest.mark.parametrize(
    "sets, line",
    [
        (["schedule.chunks=3"], "schedule.chunks: 3 has no effect: only schedule interleaved splits a rank's layers into chunks (schedule is dualpipev); remove it"),
        (["balancer.redundant=2"], "balancer.redundant: 2 has no effect: balancer.kind is none, so no expert is copied; set balancer.kind eplb or lplb, or remove it"),
    ],
)
def test_keys_without_effect_are_refused_naming_the_key_and_why(tmp_path, capsys, no_ranks, sets, line) -> None:
    code, lines = cli(capsys, *train(tmp_path, *sets))
    assert code == 2 and lines == [f"portapipe: config error: {line}"], lines


def test_init_std_with_init_from_is_refused(tmp_path) -> None:
    sets = ["model.arch=qwen3_moe", "model.n_shared=0", f"model.init_from={tmp_path}", "model.init_std=0.05"]
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, sets)
    assert info.value.problems == ["model.init_std: 0.05 has no effect: every weight is read from model.init_from; remove it"]


def test_the_zero_memory_and_recompute_refusal_gives_advice_that_validates() -> None:
    base = ["memory.zero_memory=level1", "memory.recompute=full"]
    for layers in (4, 8):  # 1 and 2 layers per stage (dualpipev, pp 2: 4 stages)
        with pytest.raises(ConfigError) as info:
            load_config(EXAMPLE, [*base, f"model.n_layers={layers}"])
        (line,) = [p for p in info.value.problems if p.startswith("memory.zero_memory")]
        advice = line.split("; set ", 1)[1]
        for option in advice.replace(" or ", ", ").split(", "):
            key, value = (s.strip() for s in option.replace(" to at most ", ": ").split(":"))
            load_config(EXAMPLE, [*base, f"model.n_layers={layers}", f"{key}={value}"])  # each piece of advice is accepted


def test_the_planner_keeps_the_default_chunks_for_other_schedules(tmp_path) -> None:
    """A user on interleaved v3: the planner's candidates of other schedules must still be valid configs."""
    best = tmp_path / "best.yaml"
    assert main(["plan", str(EXAMPLE), "--devices", "4", "--profile", "h800", "--out", str(best),
                 "--set", "schedule.name=interleaved", "--set", "schedule.chunks=3", "--set", "model.n_layers=12"]) == 0
    c = load_config(best)
    assert c.schedule.name != "interleaved" and c.schedule.chunks == 2


# ------------------------------------------------------------------------------ argparse errors
@pytest.mark.parametrize(
    "argv, first",
    [
        (["train"], "portapipe train: error: the following arguments are required: config"),
        (["plan", "x.yaml", "--devices", "q"], "portapipe plan: error: argument --devices: invalid int value: 'q'"),
        (["nothing"], "portapipe: error: argument COMMAND: invalid choice: 'nothing'"),
    ],
)
def test_an_argument_error_is_one_line_and_a_pointer_to_help(capsys, argv, first) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(first), lines
    assert lines[1] == f"portapipe: see `{first.split(':')[0]} --help`"


# ----------------------------------------------------------------------- plan without --profile
@pytest.mark.multiproc
def test_plan_without_profile_measures_one_and_plans_with_it(capsys) -> None:
    tiny = ["--set", "parallel.pp=1", "--set", "schedule.name=1f1b", "--set", "model.n_layers=2", "--set", "model.hidden=32",
            "--set", "model.seq_len=16", "--set", "train.micro_batch_size=2"]
    assert main(["plan", str(EXAMPLE), "--devices", "2", "--top", "3", *tiny]) == 0
    captured = capsys.readouterr()
    assert "profile: measured by portapipe profile on 2 cpu ranks" in captured.out, captured
    assert "<- your config" in captured.out


# ------------------------------------------------------------------------------------ token files
def test_a_token_file_holding_another_width_than_its_sidecar_says_is_refused(tmp_path, capsys, no_ranks) -> None:
    """uint32 ids read as uint16 are the ids interleaved with zeros: valid-looking, silently wrong."""
    import json
    from array import array

    path = tmp_path / "t.bin"
    ids = [i % 200 + 1 for i in range(5000)]
    with path.open("wb") as f:
        array("I", ids).tofile(f)
    side = {"format": "portapipe.tokens", "dtype": "uint16", "vocab_size": 256, "tokens": len(ids)}
    (tmp_path / "t.bin.json").write_text(json.dumps(side))
    code, lines = cli(capsys, *train(tmp_path, "data.format=tokens", f"data.path={path}"))
    assert code == 2 and lines == [
        "portapipe: config error: data.path: t.bin has 20000 bytes, but t.bin.json says it holds 5000 uint16 tokens (10000 bytes); "
        "the file and its sidecar are from different tokenizations (run portapipe tokenize again)"
    ], lines
    (tmp_path / "t.bin.json").write_text(json.dumps({**side, "dtype": "uint32"}))  # the true description is accepted
    from portapipe.data import data_problems

    assert data_problems(load_config(EXAMPLE, ["data.format=tokens", f"data.path={path}"])) == []
