"""A plug-in backend installed in a temporary environment (tests/plugin_env.py registers the
example in tests/plugin_example by entry point): it passes the conformance kit run by the one
pytest line a plug-in's author would type, trains, and verifies in float32 because it declares
no float64 compute; the same config on the cpu backend verifies in float64, exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from . import plugin_env

CONFIG = {
    "backend": plugin_env.NAME,
    "parallel": {"pp": 2, "ep": 2},
    "schedule": {"name": "dualpipev", "microbatches": 4},
    "model": {
        "vocab_size": 128, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32,
        "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 8,
    },
    "train": {"micro_batch_size": 2, "seed": 5, "steps": 2, "warmup_steps": 0},
    "log": {"progress": False},
}


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.multiproc
def test_the_example_plugin_passes_the_kit_with_one_pytest_line(tmp_path: Path) -> None:
    env = plugin_env.install(tmp_path / "site")
    env["PORTAPIPE_CONFORMANCE_BACKEND"] = plugin_env.NAME
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "portapipe.testing"], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    from portapipe.testing import LOCAL, RANK_LINES

    assert f"{len(LOCAL) + len(RANK_LINES)} passed" in proc.stdout  # every line of the kit ran, none skipped


_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from portapipe.cli import main
    from portapipe.config import load_config
    from portapipe.verify import verify

    path, log = sys.argv[1], sys.argv[2]
    code = main(["train", path, "--set", f"log.dir={log}"])
    print("TRAIN", code, flush=True)
    for backend in ("example32", "cpu"):
        print("VERIFY", json.dumps(verify(load_config(path, [f"backend={backend}"]))), flush=True)
    """
)


@pytest.mark.multiproc
def test_the_example_plugin_trains_and_verifies_in_float32_and_cpu_in_float64(tmp_path: Path) -> None:
    env = plugin_env.install(tmp_path / "site")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    proc = _run([sys.executable, "-c", _SCRIPT, str(path), str(tmp_path / "run")], env, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "TRAIN 0" in lines, proc.stdout[-2000:]
    summary = json.loads(lines[lines.index("TRAIN 0") - 1])
    assert summary["steps"] == 2 and 0 < summary["final_loss"] < 10, summary  # finite, near ln(128) at the start
    plugin, cpu = (json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("VERIFY "))
    # no float64 on the plug-in's device: float32 there, its tolerance printed, met
    assert plugin["precision"] == "float32" and plugin["ok"] is True
    assert 0 < plugin["max_rel_grad_diff"] < plugin["tolerance"]["grad"] and "u sqrt(k)" in plugin["tolerance"]["basis"]
    # the same config on the cpu backend: float64, exact
    assert cpu["precision"] == "float64" and cpu["ok"] is True and cpu["loss_diff"] == 0.0
