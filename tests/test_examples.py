"""examples/cuda.yaml and examples/npu.yaml are examples/cpu.yaml with only the backend changed, and
the run's folder (each starter its own: a GPU run from the folder of `make train` must not resume
the finished CPU run)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from portapipe.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _backend_lines(lines: list[str]) -> list[int]:
    return [i for i, line in enumerate(lines) if line.startswith("backend:")]


# ids name the files: a bare "cuda"/"npu" id would read as a device marker to tests/conftest.py.
@pytest.mark.parametrize("device", ["cuda", "npu"], ids=["cuda.yaml", "npu.yaml"])
def test_device_example_differs_from_cpu_only_in_the_backend_and_its_folder(device: str) -> None:
    cpu = (EXAMPLES / "cpu.yaml").read_text().splitlines()
    dev = (EXAMPLES / f"{device}.yaml").read_text().splitlines()
    assert len(cpu) == len(dev), f"{device}.yaml has {len(dev)} lines, cpu.yaml {len(cpu)}"
    differing = [i for i, (a, b) in enumerate(zip(cpu, dev)) if a != b]
    assert _backend_lines(cpu) == _backend_lines(dev) and len(_backend_lines(cpu)) == 1
    assert [dev[i].strip() for i in differing] == [f"backend: {device}", f"dir: runs/{device}"], [(cpu[i], dev[i]) for i in differing]
    # The parsed configs agree on everything but the backend and the run's folder, too.
    parsed_cpu, parsed_dev = yaml.safe_load("\n".join(cpu)), yaml.safe_load("\n".join(dev))
    for parsed in (parsed_cpu, parsed_dev):
        parsed.pop("backend"), parsed["log"].pop("dir")
    assert parsed_cpu == parsed_dev


@pytest.mark.parametrize("name", ["cpu", "cuda", "npu"], ids=["cpu.yaml", "cuda.yaml", "npu.yaml"])
def test_examples_load(name: str) -> None:
    cfg = load_config(EXAMPLES / f"{name}.yaml")
    assert cfg.backend == name
