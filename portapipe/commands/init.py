"""``portapipe init [NAME] [--out FILE] [--force] [--list]``: write a commented starter config.

The starters are the configs of examples/ shipped inside the package (``portapipe/configs``,
whose files are links to examples/ in a source checkout, so there is one copy of each): ``cpu``
(runs anywhere), ``cuda`` and ``npu`` (the same run on a device), ``cuda_1gpu`` (that run's
ranks sharing one GPU, gloo between them), ``deepseek_v3`` and ``qwen3_moe``. The file written is checked like any config, and one line says what to run next.
"""

from __future__ import annotations

import argparse
import sys
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT = "cpu"


def _folder() -> Any:
    return resources.files("portapipe") / "configs"


def starter_names() -> list[str]:
    """Names of the starter configs shipped with the package."""
    return sorted(entry.name[: -len(".yaml")] for entry in _folder().iterdir() if entry.name.endswith(".yaml"))


def starter_text(name: str) -> str:
    """The text of starter ``name``; ValueError naming the choices when there is none."""
    names = starter_names()
    if name not in names:
        raise ValueError(f"no starter config {name!r}; choose one of: {', '.join(names)}")
    return (_folder() / f"{name}.yaml").read_text(encoding="utf-8")


def describe(config: Any) -> str:
    """What a config runs, in one line (read from the config, so it holds for every starter)."""
    p, m = config.parallel, config.model
    d = config.data
    if d.format == "bytes":
        data = "bytes of " + (d.path or "the shipped corpus")
    else:
        data = f"token data {d.path}" if d.sources is None else f"a blend of {len(d.sources)} token sources"
    return (f"{m.arch} model on backend {config.backend}, {config.world_size} ranks (pp {p.pp} x ep {p.ep} x dp {p.dp}), "
            f"{config.schedule.name}, {config.train.steps} steps, {data}, logs in {config.log.dir}")


def next_step(path: Path, config: Any) -> str:
    """The line that says what to run after writing ``path``."""
    train = f"portapipe train {path}"
    data = config.data
    if data.format == "tokens" and data.path and not Path(data.path).exists():
        return f"next: write its token data {data.path} (the comment at the top of {path} says how), then: {train}"
    from ..backends.base import BackendUnavailable
    from ..backends.registry import check_available

    try:
        check_available(config.backend)
    except BackendUnavailable as exc:  # e.g. a device starter on a machine without that device
        return f"next, on a machine with backend {config.backend}: {train}   (not here: {exc})"
    return f"next: {train}"


def run(args: argparse.Namespace) -> int:
    import yaml

    from ..config import load_config

    if args.list:
        for name in starter_names():
            print(f"{name:<12}  {describe(load_config(yaml.safe_load(starter_text(name))))}")
        return 0
    try:
        text = starter_text(args.name)
    except ValueError as exc:
        print(f"portapipe: init: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"{args.name}.yaml")
    if out.is_dir():  # --force replaces a file, never a folder
        print(f"portapipe: init: --out {out} is a folder; name a file, e.g. {out / f'{args.name}.yaml'}", file=sys.stderr)
        return 2
    if out.exists() and not args.force:
        print(f"portapipe: init: {out} exists; pass --force to replace it, or --out another file", file=sys.stderr)
        return 2
    if not out.parent.is_dir():
        print(f"portapipe: init: the folder {str(out.parent)!r} of --out does not exist", file=sys.stderr)
        return 2
    try:
        out.write_text(text, encoding="utf-8")
    except OSError as exc:  # no permission, no space
        print(f"portapipe: init: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    config = load_config(out)  # a starter that stopped validating is a bug, reported as a config error
    print(f"wrote {out}: {describe(config)}")
    print(next_step(out, config))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("init", help="write a commented starter config (cpu, cuda, cuda_1gpu, npu, deepseek_v3, qwen3_moe)")
    p.add_argument("name", nargs="?", default=DEFAULT, metavar="NAME", help=f"which starter [{DEFAULT}]; --list shows them")
    p.add_argument("--out", metavar="FILE", help="where to write it [NAME.yaml in this folder]")
    p.add_argument("--force", action="store_true", help="replace FILE if it exists")
    p.add_argument("--list", action="store_true", help="list the starters and what each is")
    p.set_defaults(func=run)
