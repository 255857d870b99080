"""A temporary environment in which the example plug-in (tests/plugin_example) is installed:
its package on the path and a distribution whose metadata registers it in the
``portapipe.backends`` entry-point group, as ``pip install`` would leave it."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLUGIN_SRC = Path(__file__).resolve().parent / "plugin_example"
NAME = "example32"
ENTRY = "portapipe_example_backend:Float32Backend"


def install(site: Path, entry: str = ENTRY) -> dict[str, str]:
    """Write the distribution's metadata under ``site`` (``entry``: what the entry point names);
    the environment variables of a process that sees the plug-in installed (the ranks it starts
    inherit them)."""
    info = site / "portapipe_example_backend-0.1.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: portapipe-example-backend\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[portapipe.backends]\n{NAME} = {entry}\n")
    env = os.environ.copy()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), str(PLUGIN_SRC), str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env
