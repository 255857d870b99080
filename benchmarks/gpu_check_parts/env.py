"""Part a: the environment (device, compute capability, memory, torch / CUDA / NCCL / Triton
versions, NVSHMEM, `portapipe info`)."""

from __future__ import annotations

import os
import platform
from typing import Any

from .common import CHECKOUT, Ctx, Record, cli, cuda_reason, gpu_count, tail


def part_env(rec: Record, ctx: Ctx) -> None:
    import torch

    from portapipe.ranks import pinning
    from portapipe.backends.registry import backend_class

    env: dict[str, Any] = {
        "python": platform.python_version(), "platform": platform.platform(), "cores": os.cpu_count(),
        "cores_usable": len(pinning.usable_cores()),  # affinity cut to the CPU quota, as part i's
        "torch": torch.__version__, "checkout": str(CHECKOUT) if CHECKOUT else None,
    }
    for mod in ("triton", "transformers", "xdist", "pydantic", "numpy", "scipy"):
        try:
            env[mod] = getattr(__import__(mod), "__version__", "present")
        except Exception as exc:
            env[mod] = f"missing ({type(exc).__name__})"
    cuda = backend_class("cuda")
    env.update(cuda.software())
    env["gpus"] = gpu_count()
    reason = cuda_reason()
    if reason is None:
        from portapipe.backends import get_backend

        env["device"] = get_backend("cuda").describe()
    else:
        env["device"] = {"available": False, "why": reason}
    rec.put("environment", env)
    info = cli(["info", "--compact"], ctx.left())
    rec.put("portapipe_info", info.get("json", tail(info["stdout"] + info["stderr"])))
    dev = env["device"]
    rec["summary"] = (f"{dev.get('device_name')} cc {dev.get('capability')}, {dev.get('memory_bytes', 0) / 2**30:.0f} GiB; "
                      if reason is None else "no GPU; ") + f"torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, triton {env['triton']}"
    rec["status"] = "ok"

