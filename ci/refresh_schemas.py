#!/usr/bin/env python3
"""Re-read the declarations of every torch / torch_npu API the backends call into test data.

The conformance tests (tests/test_backend_conformance.py) and the strict test doubles
(tests/standin_torch_npu.py, tests/standin_nvshmem.py) check each call portapipe's backends
make against these declarations, copied from real releases. A new release is one command:

    # torch: run with the python whose torch should be recorded (a CUDA build: it has the
    # symmetric-memory ops); writes tests/conformance/torch-<version>.schemas
    python ci/refresh_schemas.py torch

    # torch_npu: from a downloaded wheel (it cannot be imported without Huawei CANN);
    # `pip download torch_npu==X --no-deps -d /tmp/w` fetches one
    python ci/refresh_schemas.py torch_npu /tmp/w/torch_npu-X-cp311-cp311-manylinux_2_28_x86_64.whl

Delete the previous file of that package, re-run the tests, and fix what they report.

File format, one declaration a line: ``op: <native schema>`` (parsed with
``torch._C.parse_schema``) and ``py: <dotted name>(<parameters>)`` (a Python signature with
literal defaults). ``#`` lines are comments; ``# version:`` and ``# requires:`` are read by
the tests.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import zipfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "conformance"

# What the backends call (portapipe/backends/*.py). The conformance test fails when a backend
# uses a name of these modules that is not recorded here.
TORCH_OPS = ["aten::_grouped_mm", "symm_mem::all_to_all_vdev"]
TORCH_PY = [
    "torch.nn.functional.grouped_mm",
    "torch.distributed._symmetric_memory.empty",
    "torch.distributed._symmetric_memory.rendezvous",
    "torch.distributed._symmetric_memory.set_backend",
    "torch.distributed._symmetric_memory.get_backend",
    "torch.distributed._symmetric_memory.is_nvshmem_available",
    "torch.backends.cuda.is_built",
    "torch.distributed.init_process_group",
    "torch.distributed.new_group",
    "torch.cuda.Stream",
    "torch.cuda.Stream.wait_event",
    "torch.cuda.Stream.wait_stream",
    "torch.cuda.Event",
    "torch.cuda.Event.record",
    "torch.cuda.Event.query",
    "torch.cuda.Event.synchronize",
    "torch.cuda.Event.elapsed_time",
    "torch.cuda.current_stream",
    "torch.cuda.stream",
    "torch.cuda.synchronize",
    "torch.cuda.device_count",
    "torch.cuda.is_available",
    "torch.cuda.set_device",
    "torch.cuda.get_device_capability",
    "torch.cuda.get_device_properties",
    "torch.cuda.memory_allocated",
    "torch.cuda.max_memory_allocated",
    "torch.cuda.reset_peak_memory_stats",
    "torch.cuda.get_rng_state",
    "torch.cuda.set_rng_state",
]
NPU_OPS = ["npu_grouped_matmul"]  # every overload of it
# (file inside the wheel, class or None, function) -> recorded as torch_npu.npu.<class.>function
NPU_PY = [
    ("torch_npu/npu/streams.py", "Stream", "__new__"),
    ("torch_npu/npu/streams.py", "Stream", "wait_event"),
    ("torch_npu/npu/streams.py", "Stream", "wait_stream"),
    ("torch_npu/npu/streams.py", "Stream", "synchronize"),
    ("torch_npu/npu/streams.py", "Event", "__new__"),
    ("torch_npu/npu/streams.py", "Event", "record"),
    ("torch_npu/npu/streams.py", "Event", "query"),
    ("torch_npu/npu/streams.py", "Event", "synchronize"),
    ("torch_npu/npu/streams.py", "Event", "elapsed_time"),
    ("torch_npu/npu/utils.py", None, "current_stream"),
    ("torch_npu/npu/utils.py", None, "stream"),
    ("torch_npu/npu/utils.py", None, "set_device"),
    ("torch_npu/npu/utils.py", None, "synchronize"),
    ("torch_npu/npu/__init__.py", None, "is_available"),
    ("torch_npu/npu/memory.py", None, "memory_allocated"),
    ("torch_npu/npu/memory.py", None, "max_memory_allocated"),
    ("torch_npu/npu/memory.py", None, "reset_peak_memory_stats"),
    ("torch_npu/npu/random.py", None, "get_rng_state"),
    ("torch_npu/npu/random.py", None, "set_rng_state"),
]


#: torch_npu's profiler, under its package's names: (file inside the wheel, class, function, recorded as)
NPU_PROFILER_PY = [
    ("torch_npu/profiler/profiler.py", "profile", "__init__", "torch_npu.profiler.profile"),
    ("torch_npu/profiler/profiler.py", "_KinetoProfile", "export_chrome_trace", "torch_npu.profiler.profile.export_chrome_trace"),
]


def _plain(sig: inspect.Signature, drop_first: bool = False) -> str:
    """A signature without annotations (they differ between releases for no reason that matters)."""
    params = list(sig.parameters.values())[1 if drop_first else 0 :]
    return str(inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params]))


def _resolve(dotted: str):  # noqa: ANN202
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def torch_lines() -> tuple[str, list[str]]:
    import torch

    lines = []
    for name in TORCH_OPS:
        ns, op = name.split("::")
        packet = getattr(getattr(torch.ops, ns), op)
        for overload in packet.overloads():
            lines.append(f"op: {getattr(packet, overload)._schema}")
    for dotted in TORCH_PY:
        obj = _resolve(dotted)
        if inspect.isclass(obj):
            lines.append(f"py: {dotted}{_plain(inspect.signature(obj.__new__), drop_first=True)}")
        else:
            sig = inspect.signature(obj)
            # a method read from its class keeps ``self``; record it as it is called
            lines.append(f"py: {dotted}{_plain(sig, drop_first=next(iter(sig.parameters), '') == 'self')}")
    return torch.__version__, lines


def _ast_signature(fn: ast.FunctionDef, drop_first: bool) -> str:
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    parts = []
    for arg, default in list(zip(positional, defaults))[1 if drop_first else 0 :]:
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.vararg:
        parts.append(f"*{a.vararg.arg}")
    elif a.kwonlyargs:
        parts.append("*")
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        parts.append(arg.arg if default is None else f"{arg.arg}={ast.unparse(default)}")
    if a.kwarg:
        parts.append(f"**{a.kwarg.arg}")
    return "(" + ", ".join(parts) + ")"


def _one(items: list, what: str, wheel: Path):  # noqa: ANN202
    if not items:
        raise ValueError(f"{wheel.name}: no {what} (is it a torch_npu wheel?)")
    return items[0]


def torch_npu_lines(wheel: Path) -> tuple[str, str, list[str]]:
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = _one([n for n in names if n.endswith(".dist-info/METADATA")], "*.dist-info/METADATA", wheel)
        metadata = zf.read(meta).decode()
        version = re.search(r"^Version: (\S+)", metadata, re.M).group(1)
        requires = [r for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if r.startswith("torch")]
        yaml_name = _one([n for n in names if n.endswith("npu_native_functions_by_codegen.yaml")], "op schema yaml", wheel)
        yaml_text = zf.read(yaml_name).decode()
        lines = []
        for op in NPU_OPS:
            found = re.findall(r"func:\s*(" + re.escape(op) + r"(?:\.\w+)?\(.*\) -> .+)$", yaml_text, re.M)
            if not found:
                raise ValueError(f"{wheel.name}: no schema of {op} in {yaml_name}")
            lines += [f"op: {f.strip()}" for f in found]
        entries = [(path, cls, func, "torch_npu.npu." + (cls if func == "__new__" else f"{cls}.{func}" if cls else func))
                   for path, cls, func in NPU_PY] + NPU_PROFILER_PY
        for path, cls, func, name in entries:
            if path not in names:
                raise ValueError(f"{wheel.name}: no {path}")
            tree = ast.parse(zf.read(path).decode())
            scope = tree.body
            if cls is not None:
                scope = _one([n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls], f"class {cls} in {path}", wheel).body
            fn = _one([n for n in scope if isinstance(n, ast.FunctionDef) and n.name == func], f"{func} in {path}", wheel)
            lines.append(f"py: {name}{_ast_signature(fn, drop_first=cls is not None)}")
    return version, "; ".join(requires), lines


def write(path: Path, header: list[str], lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {path} ({len(lines)} declarations)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("package", choices=["torch", "torch_npu"])
    p.add_argument("wheel", nargs="?", type=Path, help="torch_npu: the downloaded wheel")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    try:
        return _refresh(p, args)
    except (OSError, zipfile.BadZipFile, ValueError, AttributeError, ImportError) as exc:
        # a missing or wrong wheel, a torch without an API the backends call: one line, exit 2
        print(f"refresh_schemas: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


def _refresh(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.package == "torch":
        version, lines = torch_lines()
        header = [
            f"# Declarations of the torch APIs portapipe's backends call, read from torch {version}",
            "# by ci/refresh_schemas.py (facts copied from the release; do not edit by hand).",
            f"# version: {version}",
        ]
        write(args.out / f"torch-{version.split('+')[0]}.schemas", header, lines)
    else:
        if args.wheel is None:
            p.error("torch_npu needs the path of a downloaded torch_npu wheel")
        version, requires, lines = torch_npu_lines(args.wheel)
        header = [
            f"# Declarations of the torch_npu APIs portapipe's backends call, read from {args.wheel.name}",
            "# by ci/refresh_schemas.py (facts copied from the release; do not edit by hand).",
            f"# version: {version}",
            f"# requires: {requires}",
        ]
        write(args.out / f"torch_npu-{version}.schemas", header, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
