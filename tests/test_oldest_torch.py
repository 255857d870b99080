"""The oldest torch supported is the one CI's short leg installs (ci/oldest_torch.sh), and what it
lacks is found by presence: the tensor collectives under the names this torch has."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from portapipe.backends import base

ROOT = Path(__file__).resolve().parents[1]


def test_the_ci_leg_installs_the_lower_bound_the_package_declares() -> None:
    floor = re.search(r'"torch>=([\d.]+),<[\d.]+"', (ROOT / "pyproject.toml").read_text()).group(1)
    script = (ROOT / "ci" / "oldest_torch.sh").read_text()
    assert re.search(r'release="\$\{OLDEST_TORCH:-([\d.]+)\}"', script).group(1) == f"{floor}.0"
    assert subprocess.run(["bash", "-n", str(ROOT / "ci" / "oldest_torch.sh")]).returncode == 0
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == "bash ci/oldest_torch.sh"


def test_the_tensor_collectives_take_the_newest_name_this_torch_has(monkeypatch: pytest.MonkeyPatch) -> None:
    for kind, (new, old) in base.TENSOR_COLLECTIVE_NAMES.items():
        want = getattr(dist, new, None) or getattr(dist, old)
        assert base.tensor_collective(kind) is want
        monkeypatch.delattr(dist, new, raising=False)  # as torch 2.11 / 2.12 are
        assert base.tensor_collective(kind) is getattr(dist, old)
        monkeypatch.delattr(dist, old)
        with pytest.raises(AttributeError, match=f"none of torch.distributed.{new}, {old}"):
            base.tensor_collective(kind)
