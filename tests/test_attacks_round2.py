"""Second round of commands tried as a new user would: each one that failed, answered wrongly
or stayed silent now refuses with exit 2 and one line naming the key or file, or does what the
documentation says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from portapipe.cli import main
from portapipe.config import ConfigError, load_config

from .test_attacks_input import EXAMPLE, cli, no_ranks, train  # noqa: F401  (no_ranks: a fixture)


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
        ("train.zero_stage=true", "train.zero_stage: True"),  # a choice of numbers: True == 1 would pass
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
        (["train.loss_scale_growth_interval=100"],
         "train.loss_scale_growth_interval: 100 has no effect: only a float16 model scales its loss (model.dtype is float32); remove it"),
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
        # (`portapipe train` with no config at all points at `portapipe init`: tests/test_init.py)
        (["train", "c.yaml", "--set"], "portapipe train: error: argument --set: expected one argument"),
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
    from portapipe.data.corpus import data_problems

    assert data_problems(load_config(EXAMPLE, ["data.format=tokens", f"data.path={path}"])) == []


# --------------------------------------------------------------------------- Hugging Face folders
def _hf_folder(tmp_path: Path, variant: str, **config: object) -> Path:
    """A random transformers model of ``variant`` saved in float64, its config.json given ``config``."""
    import json

    from .hf_models import save, transformers_model

    folder = save(transformers_model(variant, seed=7), tmp_path / "in")
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, **config}))
    return folder


def test_a_pad_token_id_leaves_the_pad_row_without_gradient_as_transformers_does(tmp_path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from .hf_models import logits, portapipe_blocks, tokens

    folder = _hf_folder(tmp_path, "deepseek_v3", pad_token_id=3)
    ours = portapipe_blocks("deepseek_v3", folder)
    theirs = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")
    x = tokens(2, 16, seed=4)
    x[:, -4:] = 3  # right padding
    weight = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (logits(ours, x) * weight).sum().backward()
    (theirs(x).logits * weight).sum().backward()
    grad, want = ours[0].embed.weight.grad, theirs.model.embed_tokens.weight.grad
    assert float(want[3].abs().max()) == 0.0 and float(grad[3].abs().max()) == 0.0
    assert float((grad - want).abs().max()) <= 1e-9 * float(want.abs().max())


def test_export_keeps_the_source_folders_positions_and_token_ids_and_the_router_bias_as_read(tmp_path) -> None:
    import json

    import torch
    from safetensors.torch import load_file

    from portapipe.models.hf_io import export_hf
    from portapipe.scheduling.stage import logical_state

    from .hf_models import model_section, portapipe_blocks

    kept = {"max_position_embeddings": 200, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    folder = _hf_folder(tmp_path, "deepseek_v3", **kept)
    blocks = portapipe_blocks("deepseek_v3", folder)  # float64
    state = logical_state([(n, t) for b in blocks for n, t in b.state_dict(keep_vars=True).items()])
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), dtype="float64")}).model
    out = export_hf(state, m, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert {k: written.get(k) for k in kept} == kept
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    read, exported = load_file(str(folder / "model.safetensors"))[name], load_file(str(out / "model.safetensors"))[name]
    assert read.dtype == exported.dtype == torch.float64 and torch.equal(read, exported)
    # without a source folder: the length the model was trained at (yarn: factor x original), no token ids
    plain = export_hf(state, m.model_copy(update={"init_from": None}), tmp_path / "plain")
    written = json.loads((plain / "config.json").read_text())
    assert written["max_position_embeddings"] == 4 * 32 and "pad_token_id" not in written


def test_a_folder_with_attention_dropout_is_refused_before_launch(tmp_path, capsys, no_ranks) -> None:
    import yaml

    from .hf_models import model_section

    folder = _hf_folder(tmp_path, "qwen3_moe", attention_dropout=0.1)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"backend": "cpu", "model": model_section("qwen3_moe", init_from=str(folder)), "log": {"dir": str(tmp_path / "run")}}))
    capsys.readouterr()  # transformers' progress bars while saving
    code, lines = cli(capsys, "train", str(cfg))
    # (the tiny model's 64 tokens are also too few for the shipped byte corpus: a line of its own)
    assert code == 2 and (
        f"portapipe: config error: model.init_from: {folder / 'config.json'}: attention_dropout = 0.1 "
        "(portapipe trains without dropout; set 0.0 in config.json to train without it)"
    ) in lines, lines


@pytest.mark.multiproc
def test_export_of_a_run_whose_newest_checkpoint_is_damaged_names_it_and_the_step_exported(tmp_path, capsys) -> None:
    import json

    from portapipe.train import train as train_run

    from .hf_models import model_section

    raw = {
        "backend": "cpu", "parallel": {"pp": 1, "ep": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
        "model": model_section("qwen3_moe", vocab_size=256, seq_len=16), "train": {"steps": 2, "micro_batch_size": 2},
        "log": {"dir": str(tmp_path / "run"), "progress": False}, "checkpoint": {"every": 1, "keep": 2},
    }  # fmt: skip
    newest = Path(train_run(load_config(raw))["checkpoint"])
    assert newest.name == "step_00000002"
    part = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"portapipe: checkpoint {newest} is not usable: part {part.name} does not match its checksum (damaged or from another save); trying the previous one"
    ]
    record = json.loads(captured.out)
    assert record["step"] == 1 and record["checkpoint"] == str(newest.with_name("step_00000001"))


# ------------------------------------------------------------------------ a full disk while saving
class _DCPFailure(BaseException):
    """Stands in for DCP's CheckpointException: a BaseException holding each rank's failure."""

    def __init__(self, failures: dict[int, tuple[BaseException, object]]) -> None:
        super().__init__("CheckpointException ranks: ... every rank's flattened traceback ...")
        self.failures = failures


def test_a_write_error_is_one_line_naming_checkpoint_path_and_cause(tmp_path, monkeypatch) -> None:
    import errno
    import shutil
    from collections import namedtuple

    from portapipe.checkpoint import files

    final, previous = tmp_path / "step_00000004", tmp_path / "step_00000002"
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    full = OSError(errno.ENOSPC, "No space left on device")
    err = files.write_error(_DCPFailure({0: (short, None), 1: (full, None)}), final, previous)
    assert str(err) == f"checkpoint {final} could not be written: no space left on device; the previous complete checkpoint is {previous}"
    # torch's writer may say only "unexpected pos" on every rank: the free space beside it tells
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(6 << 20, (6 << 20) - 4096, 4096))
    err = files.write_error(_DCPFailure({0: (short, None)}), final, None)
    assert str(err) == f"checkpoint {final} could not be written: no space left on device (4096 bytes free); no earlier checkpoint of this run is complete"
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(1 << 40, 0, 1 << 40))
    err = files.write_error(_DCPFailure({0: (short, None)}), final, None)
    assert "\n" not in str(err) and str(err).startswith(f"checkpoint {final} could not be written: _DCPFailure: CheckpointException ranks")


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MB tmpfs (root only; skipped where it cannot be mounted)."""
    import shutil
    import subprocess

    where = tmp_path / "disk"
    where.mkdir()
    if shutil.which("mount") is None or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.multiproc
def test_a_full_disk_stops_the_run_at_the_next_step_naming_the_previous_checkpoint(small_disk, capsys, monkeypatch) -> None:
    """Checkpoints of 4 MB on 6 MB: step 2's fits, step 4's (in the background) does not."""
    monkeypatch.delenv("PORTAPIPE_DEBUG", raising=False)  # the one-line failure, not the debug traceback
    run = small_disk / "run"
    argv = ["train", str(EXAMPLE), "--set", f"log.dir={run}", "--set", "parallel.ep=1", "--set", "schedule.name=1f1b",
            "--set", "train.steps=8", "--set", "checkpoint.every=2", "--set", "log.progress=false"]
    capsys.readouterr()
    assert main(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    root = run / "checkpoints"
    shown = [line.replace(str(root), "ROOT") for line in lines]
    # (torch's writer may report the full disk as a short write only: then the free bytes are said)
    assert len(shown) == 1 and re.search(
        r"checkpoint ROOT/step_00000004 could not be written: no space left on device( \(\d+ bytes free\))?; "
        r"the previous complete checkpoint is ROOT/step_00000002;", shown[0]
    ), shown
    import json

    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines() if '"train"' in line]
    assert max(steps) <= 5, steps  # the boundary after the failed save, not the next save (step 6)
    left = sorted(p.name for p in root.iterdir() if p.name != ".portapipe.lock")
    assert left == ["step_00000002"], left  # no temporary folder left
