"""``portapipe export CHECKPOINT OUT --format hf``: a checkpoint as a Hugging Face model folder.

CHECKPOINT is a checkpoint folder (``step_NNNNNNNN``) or a run folder (its newest checkpoint).
Reads the checkpoint's logical model state (``--ema``: its parameters the host EMA of the
weights, ``train.ema_decay``) and its config
(:func:`portapipe.checkpoint.load_model_state`) and writes OUT with config.json and
safetensors (sharded with an index past ``--max-shard-size``), which transformers'
``from_pretrained`` loads (model.arch deepseek_v3 or qwen3_moe); with ``--fp8`` the Linear weights
in DeepSeek-V3's published FP8 layout. A damaged checkpoint passed over
in a run folder is named in one line on stderr. Prints one JSON line (the checkpoint and step
exported among its keys). Exit 0
on success, 2 for input that cannot be exported (said before anything is written).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``2GiB`` or a byte count -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if m is None or m.group(2).upper() not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _fail(message: str) -> int:
    print(f"portapipe: export: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from ..checkpoint import load_model_state, resolve
    from ..checkpoint.run import say_stderr
    from ..config import config_from_dict
    from ..models.hf_io import export_hf

    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        return _fail(f"{ckpt} does not exist; give a checkpoint folder (e.g. runs/x/checkpoints/step_00000100)")
    try:
        entry = resolve(ckpt, warn=say_stderr)  # a damaged newer checkpoint is named, as train names it
        state, raw = load_model_state(entry.path, ema=args.ema)
    except (ValueError, FileNotFoundError) as exc:
        return _fail(f"{ckpt}: {exc}")
    config = config_from_dict(raw)  # a ConfigError exits 2 through the CLI
    try:
        out = export_hf(state, config.model, args.out, max_shard_bytes=args.max_shard_size, fp8=args.fp8)
    except ValueError as exc:
        return _fail(str(exc))
    files = sorted(p.name for p in out.iterdir())
    print(json.dumps({
        "format": args.format, "arch": config.model.arch, "checkpoint": str(entry.path), "step": entry.step,
        "out": str(out), "tensors": len(state), "files": files, "ema": args.ema, "fp8": args.fp8,
    }))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model folder (config.json + safetensors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint folder written by portapipe train, or its run folder (the newest checkpoint)")
    p.add_argument("out", help="output folder (must not exist, or be empty)")
    p.add_argument("--format", choices=["hf"], default="hf", help="output format [hf]")
    p.add_argument("--ema", action="store_true", help="the EMA of the weights (train.ema_decay) instead of the weights")
    p.add_argument("--max-shard-size", type=parse_size, default=5 * 10**9, metavar="SIZE", help="largest safetensors file [5GB]")
    p.add_argument("--fp8", action="store_true", help="the attention, FFN and expert weights in FP8 as DeepSeek-V3 publishes them: "
                   "E4M3 with a float32 weight_scale_inv per 128x128 block, quantization_config in config.json")
    p.set_defaults(func=run)
