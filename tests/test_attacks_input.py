"""Bad input to the CLI: exit 2 and one line naming the problem, before any rank starts; an
unexpected error: exit 1 and one line with a hint; never a traceback unless debugging."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch

import portapipe.ranks.launch
from portapipe.cli import main
from portapipe.config import ConfigError, load_config
from portapipe.optim.adamw import adamw_

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
CORPUS = Path(__file__).resolve().parents[1] / "portapipe" / "assets" / "shakespeare.txt.gz"


@pytest.fixture
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were started although the input was bad")

    monkeypatch.setattr(portapipe.ranks.launch, "run_ranks", refuse)


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


def test_a_config_file_of_binary_bytes_exits_2_with_one_line(tmp_path, capsys, no_ranks) -> None:
    path = tmp_path / "noise.yaml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    code, lines = cli(capsys, "train", str(path))
    assert code == 2
    assert lines == [f"portapipe: config error: <file>: {path} is not a UTF-8 text file (byte 0x80 at offset 0); a config is YAML text"]


def test_a_folder_given_as_config_exits_2_with_one_line(tmp_path, capsys, no_ranks) -> None:
    code, lines = cli(capsys, "verify", str(tmp_path))
    assert code == 2 and lines == [f"portapipe: config error: <file>: {str(tmp_path)!r} is a folder, not a YAML file"]


def test_a_set_value_that_is_not_yaml_exits_2_naming_the_set(tmp_path, capsys, no_ranks) -> None:
    code, lines = cli(capsys, *train(tmp_path, "train.steps=["))
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith("portapipe: config error: --set 'train.steps=[': the value is not valid YAML ("), lines


def test_a_config_file_that_is_not_yaml_exits_2_with_one_line(tmp_path, capsys, no_ranks) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("train: {steps: [\n")
    code, lines = cli(capsys, "train", str(path))
    assert code == 2
    assert len(lines) == 1 and lines[0].startswith(f"portapipe: config error: <file>: {path} is not valid YAML: ") and "line 2" in lines[0]


def test_a_key_given_twice_exits_2_naming_both_lines(tmp_path, capsys, no_ranks) -> None:
    """PyYAML keeps the last of two equal keys: a second section would silently drop the first."""
    path = tmp_path / "twice.yaml"
    path.write_text("train:\n  steps: 5\nlog:\n  every: 1\ntrain:\n  lr: 0.01\n")
    code, lines = cli(capsys, "train", str(path))
    assert code == 2
    assert lines == [f"portapipe: config error: <file>: {path} is not valid YAML: key 'train' is given twice (first at line 1) at line 5, column 1"]
    code, lines = cli(capsys, *train(tmp_path, "train={steps: 1, steps: 2}"))
    assert code == 2 and lines == [
        "portapipe: config error: --set 'train={steps: 1, steps: 2}': the value is not valid YAML (key 'steps' is given twice (first at line 1) at line 1, column 12)"
    ]
    merged = tmp_path / "merged.yaml"  # a merge key's values are meant to be overridden
    merged.write_text("model: &m {hidden: 32, n_heads: 2}\nx: {<<: *m, hidden: 64}\n")
    with pytest.raises(ConfigError, match="x: unknown key"):
        load_config(merged)


@pytest.mark.parametrize(
    "betas, line",
    [
        ("[2,3]", "train.betas: [2, 3]: betas[0] = 2, betas[1] = 3 is outside [0, 1), as AdamW requires"),
        ("[0.9,1.0]", "train.betas: [0.9, 1.0]: betas[1] = 1 is outside [0, 1), as AdamW requires"),
        ("[-0.1,0.9]", "train.betas: [-0.1, 0.9]: betas[0] = -0.1 is outside [0, 1), as AdamW requires"),
    ],
)
def test_betas_adamw_refuses_exit_2_before_launch(tmp_path, capsys, no_ranks, betas, line) -> None:
    code, lines = cli(capsys, *train(tmp_path, f"train.betas={betas}"))
    assert code == 2 and lines == [f"portapipe: config error: {line}"]


def test_the_config_accepts_exactly_the_optimizer_values_adamw_accepts() -> None:
    param = [torch.nn.Parameter(torch.zeros(2))]
    values = [-1.0, -1e-9, 0.0, 0.5, 0.999999, 1.0, 1.5]
    for b0 in values:
        for b1 in values:
            try:
                torch.optim.AdamW(param, lr=1e-3, betas=(b0, b1))
                torch_ok = True
            except ValueError:
                torch_ok = False
            try:
                load_config({"train": {"betas": [b0, b1]}})
                ours_ok = True
            except ConfigError:
                ours_ok = False
            assert ours_ok == torch_ok, (b0, b1)
    for key in ("lr", "weight_decay", "min_lr"):  # AdamW: lr >= 0, weight_decay >= 0 (lr > 0 here)
        with pytest.raises(ConfigError, match=f"train.{key}"):
            load_config({"train": {key: -1e-3, **({"min_lr": 0.0} if key == "lr" else {})}})


@pytest.mark.parametrize(
    "setting, key",
    [
        ("train.lr=.inf", "train.lr: inf"),
        ("train.grad_clip=.nan", "train.grad_clip: nan"),
        ("model.init_std=-.inf", "model.init_std: -inf"),
        ("data.val_fraction=.nan", "data.val_fraction: nan"),
        ("train.betas=[.nan,0.9]", "train.betas[0]: nan"),
        ("launch.stall_timeout_s=.inf", "launch.stall_timeout_s: inf"),
    ],
)
def test_inf_and_nan_are_refused_at_load_naming_the_key(tmp_path, capsys, no_ranks, setting, key) -> None:
    code, lines = cli(capsys, *train(tmp_path, setting))
    assert code == 2 and lines == [f"portapipe: config error: {key}: Input should be a finite number"], lines


def test_a_learning_rate_the_master_dtype_cannot_hold_exits_2_before_any_rank(tmp_path, capsys, no_ranks) -> None:
    code, lines = cli(capsys, *train(tmp_path, "train.lr=1e39"))
    assert code == 2 and len(lines) == 1 and lines[0].startswith("portapipe: config error: train.lr: 1e+39: AdamW's first step multiplies by 1e+40, more than float32"), lines


@pytest.mark.parametrize("lr, decay", [(3.3e37, 0.0), (3.5e37, 0.0), (1e36, 1e3), (1e36, 1e2), (1e300, 0.0)])
def test_the_learning_rate_rule_refuses_exactly_what_adamw_cannot_step(lr, decay) -> None:
    """AdamW's first step on float32 weights (the float32 model's master) fails, or leaves a weight
    that is not finite (torch's in-place multiply rounds a scalar too large to inf, silently),
    where the rule refuses, and only there."""
    param, grad = torch.ones(4), torch.full((4,), 0.5)
    try:
        adamw_(param, grad, torch.zeros(4), torch.zeros(4), step=1, lr=lr, betas=(0.9, 0.95), weight_decay=decay, decayed=[(0, 4)])
        steps = bool(torch.isfinite(param).all())
    except RuntimeError:
        steps = False
    try:
        load_config({"train": {"lr": lr, "min_lr": 0.0, "weight_decay": decay}})
        accepted = True
    except ConfigError as exc:
        assert "train.lr" in str(exc)
        accepted = False
    assert accepted == steps, (lr, decay)


def test_an_empty_data_file_exits_2_is_empty(tmp_path, capsys, no_ranks) -> None:
    for name, content in (("empty.txt", b""), ("empty.txt.gz", gzip.compress(b""))):
        path = tmp_path / name
        path.write_bytes(content)
        code, lines = cli(capsys, *train(tmp_path, f"data.path={path}"))
        assert code == 2 and lines == [f"portapipe: config error: data.path: {str(path)!r} is empty"]


@pytest.mark.parametrize("cut", ["truncated", "garbage"])
def test_a_corrupt_gzip_data_file_exits_2_with_one_line(tmp_path, capsys, no_ranks, cut) -> None:
    path = tmp_path / "corpus.txt.gz"
    raw = CORPUS.read_bytes()
    path.write_bytes(raw[: len(raw) // 2] if cut == "truncated" else raw[:10] + b"\x00not deflate data" * 8)
    code, lines = cli(capsys, *train(tmp_path, f"data.path={path}"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"portapipe: config error: data.path: {str(path)!r} looks gzipped but cannot be decompressed ("), lines


def test_an_unexpected_error_is_one_line_with_a_hint_and_its_traceback_only_when_debugging(tmp_path, capsys, monkeypatch) -> None:
    import portapipe.train

    def broken(config: object) -> None:
        raise KeyError("layers.9.attn.wq.weight")

    monkeypatch.setattr(portapipe.train, "train", broken)
    # set (empty: not debug) rather than deleted, so that the PORTAPIPE_DEBUG=1 which log.level: debug
    # writes into this process below is undone after the test
    monkeypatch.setenv("PORTAPIPE_DEBUG", "")
    code, lines = cli(capsys, *train(tmp_path))
    assert code == 1
    assert lines == [
        "portapipe: KeyError: 'layers.9.attn.wq.weight'; rerun with log.level: debug (or PORTAPIPE_DEBUG=1) for the traceback"
    ]
    assert main(train(tmp_path, "log.level=debug")) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert err.strip().splitlines()[-1].startswith("portapipe: KeyError: 'layers.9.attn.wq.weight'")


def test_a_rank_failure_is_one_line_and_its_traceback_comes_with_debug(tmp_path, capsys, monkeypatch) -> None:
    import portapipe.train

    def failed(config: object) -> None:
        tb = 'Traceback (most recent call last):\n  File "model.py", line 3, in forward\nValueError: boom\n'
        raise portapipe.ranks.launch.LaunchError("rank 2 failed: ValueError: boom", rank=2, traceback=tb)

    monkeypatch.setattr(portapipe.train, "train", failed)
    monkeypatch.delenv("PORTAPIPE_DEBUG", raising=False)
    code, lines = cli(capsys, *train(tmp_path))
    assert code == 1
    assert lines == ["portapipe: rank 2 failed: ValueError: boom; rerun with log.level: debug (or PORTAPIPE_DEBUG=1) for the traceback"]
    monkeypatch.setenv("PORTAPIPE_DEBUG", "1")
    assert main(train(tmp_path)) == 1
    err = capsys.readouterr().err
    assert 'File "model.py", line 3, in forward' in err and err.strip().splitlines()[-1] == "portapipe: rank 2 failed: ValueError: boom"


def test_every_float_key_refuses_inf() -> None:
    """No numeric key of any section lets an infinity through (the rule is on the base section)."""
    from portapipe.config import Config

    for section, model in Config.model_fields.items():
        sub = model.annotation
        for key, field in getattr(sub, "model_fields", {}).items():
            if field.annotation is float or field.annotation == (float | None):
                with pytest.raises(ConfigError, match=f"{section}.{key}: inf: Input should be a finite number"):
                    load_config({section: {key: math.inf}})



def test_a_misspelled_backend_option_exits_2_before_launch(tmp_path, capsys, no_ranks) -> None:
    code, lines = cli(capsys, *train(tmp_path, "backend_options.ep_transprot=nvshmem"))
    assert code == 2
    assert lines == ["portapipe: config error: backend_options.ep_transprot: not an option of backend 'cpu' (its options: ep_transport)"]
