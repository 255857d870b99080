"""``portapipe info``: torch version, known backends, availability, what ``auto`` picks, and
each backend's declared capabilities (dtypes per operation family, transports, kernels, streams)."""

from __future__ import annotations

import argparse
import json
import platform
from typing import Any


def collect() -> dict[str, Any]:
    import torch

    from .. import __version__
    from ..backends import registry

    try:
        auto = registry.check_available("auto")
        auto_error = None
    except Exception as exc:  # auto found a device whose software is missing
        auto, auto_error = None, str(exc)
    out: dict[str, Any] = {
        "portapipe": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "backends_known": ["auto", *registry.known_backends()],
        "backends": registry.info(),
        "auto": auto,
    }
    out["available"] = [n for n, b in out["backends"].items() if b.get("available")]
    out["device_counts"] = {n: b.get("device_count", 0) for n, b in out["backends"].items()}
    if auto_error:
        out["auto_error"] = auto_error
    return out


def run(args: argparse.Namespace) -> int:
    print(json.dumps(collect(), indent=None if args.compact else 2))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("info", help="print JSON about torch, backends, devices and what each backend can do")
    p.add_argument("--compact", action="store_true", help="one line of JSON")
    p.set_defaults(func=run)
