"""The declared APIs of torch and torch_npu (tests/conformance/*.schemas) and call binding against them.

The files hold schema lines copied from real releases by ``ci/refresh_schemas.py``: ``op:``
lines are native schemas (parsed by ``torch._C.parse_schema``), ``py:`` lines Python
signatures. The strict test doubles bind every call they receive here, so a call the real
library would refuse (a misspelled keyword, a positional keyword-only argument, a wrong type,
no matching overload) fails on the CPU as it would on the device.
"""

from __future__ import annotations

import ast
import inspect
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch

DATA = Path(__file__).resolve().parent / "conformance"


@dataclass
class Declarations:
    package: str
    version: str
    requires: str
    path: Path
    ops: dict[str, list[Any]] = field(default_factory=dict)  # name -> FunctionSchema overloads, in order
    py: dict[str, inspect.Signature] = field(default_factory=dict)

    def bind_op(self, name: str, *args: Any, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        """Resolve the overload of op ``name`` these arguments select, as torch's dispatcher
        does (first overload that binds); return its overload name and all arguments bound."""
        if name not in self.ops:
            raise AttributeError(f"{self.package} {self.version} declares no op {name!r}")
        failures = []
        for schema in self.ops[name]:
            try:
                return schema.overload_name, _bind_schema(schema, args, kwargs)
            except TypeError as exc:
                failures.append(f"  {schema}: {exc}")
        raise TypeError(f"{name}() received an invalid combination of arguments ({self.package} {self.version}):\n" + "\n".join(failures))

    def bind_py(self, dotted: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if dotted not in self.py:
            raise AttributeError(f"{self.package} {self.version} declares no {dotted}")
        bound = self.py[dotted].bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)


def _type_ok(t: str, value: Any) -> bool:
    """``t`` is a type as the schema text writes it: ``Tensor[]?``, ``int?``, ``ScalarType?``..."""
    if t.endswith("?"):
        return value is None or _type_ok(t[:-1], value)
    if t.endswith("[]"):
        return isinstance(value, (list, tuple)) and all(_type_ok(t[:-2], v) for v in value)
    t = t.split("(", 1)[0]  # alias annotations: Tensor(a!)
    checks = {
        "Tensor": lambda v: isinstance(v, torch.Tensor),
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "str": lambda v: isinstance(v, str),
        "ScalarType": lambda v: isinstance(v, torch.dtype),
    }
    if t not in checks:
        raise NotImplementedError(f"no check for schema type {t}")
    return checks[t](value)


def _declared_types(text: str) -> dict[str, str]:
    """Argument name -> type as written in a schema line (parse_schema turns ScalarType into int)."""
    inner = text[text.index("(") + 1 : text.rindex(") ->")]
    out = {}
    for part in inner.split(", "):
        if part == "*":
            continue
        typ, name = part.split("=", 1)[0].rsplit(" ", 1)
        out[name] = typ
    return out


def _bind_schema(schema: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    types = _declared_types(str(schema))
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"takes {len(positional)} positional arguments but {len(args)} were given")
    known = {a.name for a in params}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {', '.join(unknown)}")
    bound: dict[str, Any] = {}
    for a, v in zip(positional, args):
        if a.name in kwargs:
            raise TypeError(f"got multiple values for argument {a.name!r}")
        bound[a.name] = v
    bound.update(kwargs)
    for a in params:
        if a.name not in bound:
            if a.default_value is None and not types[a.name].endswith("?"):
                raise TypeError(f"missing required argument {a.name!r}")
            bound[a.name] = a.default_value
        if not _type_ok(types[a.name], bound[a.name]):
            raise TypeError(f"argument {a.name!r} must be {types[a.name]}, not {type(bound[a.name]).__name__}")
    return bound


def _signature(params: str) -> inspect.Signature:
    """An inspect.Signature from a parameter list with literal defaults (no code is run)."""
    fn = ast.parse(f"def _f{params}: pass").body[0]
    a = fn.args
    kinds = inspect.Parameter
    positional = a.posonlyargs + a.args
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = [
        kinds(p.arg, kinds.POSITIONAL_OR_KEYWORD, default=kinds.empty if d is None else ast.literal_eval(d))
        for p, d in zip(positional, defaults)
    ]
    if a.vararg:
        out.append(kinds(a.vararg.arg, kinds.VAR_POSITIONAL))
    for p, d in zip(a.kwonlyargs, a.kw_defaults):
        out.append(kinds(p.arg, kinds.KEYWORD_ONLY, default=kinds.empty if d is None else ast.literal_eval(d)))
    if a.kwarg:
        out.append(kinds(a.kwarg.arg, kinds.VAR_KEYWORD))
    return inspect.Signature(out)


@cache
def load(package: str) -> Declarations:
    """The one declarations file of ``package`` ("torch" or "torch_npu") under tests/conformance."""
    paths = sorted(DATA.glob(f"{package}-[0-9]*.schemas"))
    if len(paths) != 1:
        raise FileNotFoundError(f"expected one {package}-<version>.schemas in {DATA}, found {[p.name for p in paths]}")
    path = paths[0]
    decl = Declarations(package, "", "", path)
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("# version:"):
            decl.version = line.split(":", 1)[1].strip()
        elif line.startswith("# requires:"):
            decl.requires = line.split(":", 1)[1].strip()
        elif line.startswith("op: "):
            text = line[4:]
            name = text.split("(", 1)[0]
            qualified = text if "::" in name else f"{package}::{text}"  # parse_schema wants a namespace
            schema = torch._C.parse_schema(qualified)
            base = name.split(".", 1)[0]
            decl.ops.setdefault(base, []).append(schema)
        elif line.startswith("py: "):
            text = line[4:]
            cut = text.index("(")
            decl.py[text[:cut]] = _signature(text[cut:])
    if not decl.version:
        raise ValueError(f"{path} does not name its version (# version: line)")
    return decl


@cache
def collective_dtypes() -> dict[tuple[str, str], tuple[str, ...]]:
    """(library, torch.distributed call) -> the floating dtypes that library takes there
    (tests/conformance/collectives.dtypes, read from NCCL's and HCCL's API references)."""
    out: dict[tuple[str, str], tuple[str, ...]] = {}
    for raw in (DATA / "collectives.dtypes").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            head, _, dtypes = line.partition(":")
            library, call = head.split()
            out[library, call] = tuple(dtypes.split())
    return out
