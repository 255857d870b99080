"""Config: every mistake is reported at once, one line per problem, naming its key path."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from portapipe.config import ConfigError, load_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


def problems(overrides: list[str], source: object = EXAMPLE) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides)
    return info.value.problems


def test_example_loads_with_defaults_filled() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.backend == "cpu"
    assert (cfg.parallel.pp, cfg.parallel.ep, cfg.parallel.dp) == (2, 2, 1)
    assert cfg.world_size == 4
    assert cfg.n_blocks() == 4  # dualpipev: 2 stages per rank
    assert cfg.memory.zero_memory == "off"  # YAML's bare `off` is read as False


def test_overrides_parse_yaml_values() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=4", "schedule.microbatches=8", "model.n_layers=8", "train.lr=1e-2"])
    assert cfg.parallel.pp == 4 and cfg.schedule.microbatches == 8 and cfg.train.lr == 1e-2


@pytest.mark.parametrize(
    "override, path, fragment",
    [
        ("parallel.world_size=6", "parallel.world_size", "pp*ep*dp"),
        ("schedule.microbatches=3", "schedule.microbatches", "2*pp"),
        ("model.n_experts=7", "model.n_experts", "parallel.ep"),
        ("model.top_k=9", "model.top_k", "n_experts"),
        ("model.hidden=66", "model.hidden", "n_heads"),
        ("model.n_layers=3", "model.n_layers", "model blocks"),
        ("train.min_lr=1.0", "train.min_lr", "train.lr"),
        ("backend=tpu", "backend", "known"),
        ("backend_options.ep_transport=shmem", "backend_options.ep_transport", "alltoall"),
        ("schedule.name=pipedream", "schedule.name", "1f1b"),
        ("parallel.pp=0", "parallel.pp", "greater than or equal"),
        ("model.hidden=abc", "model.hidden", "integer"),
        ("train.stepz=3", "train.stepz", "unknown key"),
    ],
)
def test_each_mistake_names_its_key_path(override: str, path: str, fragment: str) -> None:
    lines = problems([override])
    assert len(lines) == 1, lines
    assert lines[0].startswith(path + ":"), lines
    assert fragment in lines[0], lines


def test_dualpipe_rules() -> None:
    base = ["schedule.name=dualpipe", "parallel.pp=3", "parallel.ep=1", "model.n_experts=8"]
    lines = problems(base + ["schedule.microbatches=5"])
    assert any(line.startswith("parallel.pp:") and "odd" in line for line in lines)
    assert any(line.startswith("schedule.microbatches:") and "2*pp" in line for line in lines)
    assert any(line.startswith("schedule.microbatches:") and "odd" in line for line in lines)


def test_interleaved_rules() -> None:
    lines = problems(["schedule.name=interleaved", "schedule.microbatches=5", "schedule.chunks=1"])
    assert any(line.startswith("schedule.chunks:") for line in lines)
    assert any(line.startswith("schedule.microbatches:") and "multiple of pp" in line for line in lines)


def test_memory_options_need_moe_layers_and_fit_the_stage() -> None:
    lines = problems(["model.n_dense=4", "memory.zero_memory=level0", "memory.recompute=moe"])
    assert any(line.startswith("memory.zero_memory:") for line in lines)
    assert any(line.startswith("memory.recompute:") for line in lines)
    lines = problems(["memory.recompute=full", "memory.recompute_layers=5"])
    assert lines == ["memory.recompute_layers: 5 > 1 layers in the largest stage"]


def test_three_mistakes_three_lines(tmp_path: Path) -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["parallel"]["world_size"] = 6
    raw["model"]["n_experts"] = 7
    raw["schedule"]["microbatches"] = 3
    lines = problems([], raw)
    assert [line.split(":")[0] for line in lines] == ["parallel.world_size", "schedule.microbatches", "model.n_experts"]


def test_type_errors_and_rule_errors_are_reported_together() -> None:
    lines = problems(["model.hidden=abc", "parallel.world_size=6", "train.stepz=1"])
    assert sorted(line.split(":")[0] for line in lines) == ["model.hidden", "parallel.world_size", "train.stepz"]


def test_bad_files() -> None:
    assert "does not exist" in problems([], "/nonexistent/x.yaml")[0]
    assert problems(["=3"])[0].startswith("--set")


def test_cli_prints_one_line_per_problem_and_exits_2(tmp_path: Path) -> None:
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["parallel"]["world_size"] = 6
    raw["model"]["n_experts"] = 7
    raw["schedule"]["microbatches"] = 3
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    from portapipe.cli import main
    from portapipe.commands import add_config_args, load_checked_config
    import argparse

    parser = argparse.ArgumentParser()
    add_config_args(parser)
    args = parser.parse_args([str(path)])
    with pytest.raises(ConfigError) as info:
        load_checked_config(args)
    assert len(info.value.problems) == 3
    # Through the real CLI entry point when a config-reading command exists.
    proc = subprocess.run(
        [sys.executable, "-m", "portapipe.cli", "verify", str(path)], capture_output=True, text=True, timeout=120
    )
    if "invalid choice" in proc.stderr:
        pytest.skip("portapipe verify is not part of this build")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("portapipe: config error:")]
    assert proc.returncode == 2, proc.stderr
    assert len(errors) == 3, proc.stderr
    assert main is not None
