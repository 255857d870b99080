"""Recorded expert loads from a file: ``[layers, experts]`` tables in text, JSON or torch format.

Text (``.csv`` / ``.txt``): one layer per line, numbers separated by commas and/or whitespace,
``#`` comments and a first line without any number (a header) skipped, an empty field refused.
``.json``: a list of rows or ``{"loads": rows}`` (a run's ``expert_loads.json``). ``.pt``: a
tensor or ``{"loads": tensor}``. A single row is one layer. Read by ``portapipe balance`` and by
the planner's ``--loads``, so both accept the same files with the same errors.
"""

from __future__ import annotations

import json
import pickle
import re
import warnings
from pathlib import Path
from typing import Any

import torch

from .published import check_weight

#: a comma with any spaces around it, or a run of spaces
_SEP = re.compile(r"\s*,\s*|\s+")


def read_table(path: str | Path, key: str = "loads") -> torch.Tensor:
    """A float64 [rows, cols] table from a loads-format file; ValueError naming the file and the problem."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{key} file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    try:
        if suffix == ".pt":
            with warnings.catch_warnings():  # torch warns about unknown pickle protocols before failing
                warnings.simplefilter("ignore")
                data: Any = torch.load(p, map_location="cpu", weights_only=True)
            if isinstance(data, dict):
                if key not in data:
                    raise ValueError(f"a .pt dict needs the key {key!r}; found {sorted(map(str, data))}")
                data = data[key]
            if isinstance(data, torch.Tensor) and (data.dtype == torch.bool or data.is_complex()):
                raise ValueError(f"a tensor of {data.dtype} is not a table of loads; save real numbers")
        elif suffix == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                if key not in data:
                    raise ValueError(f"a JSON object needs the key {key!r}; found {sorted(data)}")
                data = data[key]
            _no_booleans(data)
        elif suffix in (".csv", ".txt"):
            data = _text_rows(p.read_text())
        else:
            raise ValueError(f"unknown {key} format {suffix or '(none)'!r}; use .csv, .txt, .json or .pt")
    except json.JSONDecodeError as exc:
        raise ValueError(f"{p}: cannot read {key}: not JSON ({exc})") from None
    except UnicodeDecodeError:
        raise ValueError(f"{p}: cannot read {key}: not UTF-8 text") from None
    except ValueError as exc:
        raise ValueError(f"{p}: {exc}") from None
    except (RuntimeError, TypeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        if suffix == ".pt":  # torch's own message suggests unsafe loading; say what the file is not
            raise ValueError(f"{p}: cannot read {key}: not a tensor saved by torch.save ({type(exc).__name__})") from None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(f"{p}: cannot read {key}: {first}") from None
    try:
        w = torch.as_tensor(data, dtype=torch.float64)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ValueError(f"{p}: cannot read {key} as a table of numbers: {exc}") from None
    if w.dim() == 1:
        w = w.unsqueeze(0)
    if w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"{p}: {key} must be a [rows, columns] table of numbers, got shape {tuple(w.shape)}")
    return w


def _text_rows(text: str) -> list[list[float]]:
    """Rows of numbers separated by commas and/or whitespace; '#' starts a comment; a first line
    without any number is a header. An empty field (two commas in a row) is refused: it would
    shift every later expert's load by one."""
    rows, first = [], True
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        cells = _SEP.split(line)
        numbers = [_number(c) for c in cells]
        if first and any(cells) and all(x is None for x in numbers):
            first = False
            continue  # a header
        first = False
        if "" in cells:
            raise ValueError(f"line {n}: empty field {cells.index('') + 1}; every expert needs a number (0 if it got no tokens)")
        if None in numbers:
            raise ValueError(f"line {n}: {cells[numbers.index(None)]!r} is not a number (separate numbers by commas and/or spaces)")
        rows.append(numbers)
    if not rows:
        raise ValueError("no numbers: the file is empty or holds only comments and a header")
    if len({len(r) for r in rows}) > 1:
        raise ValueError(f"rows have different lengths: {sorted({len(r) for r in rows})}; every layer needs one number per expert")
    return rows


def _number(cell: str) -> float | None:
    try:
        return float(cell)
    except ValueError:
        return None


def _no_booleans(data: Any) -> None:
    """JSON's true / false would silently read as 1 / 0."""
    if isinstance(data, bool):
        raise ValueError(f"{str(data).lower()} is not a number")
    if isinstance(data, list):
        for item in data:
            _no_booleans(item)


def read_loads(path: str | Path) -> torch.Tensor:
    """Loads as a float64 [layers, experts] tensor of finite numbers >= 0 that fit float32 (planning
    uses float32); ValueError naming the file and the problem."""
    w = read_table(path, "loads")
    big = torch.isfinite(w) & (w.abs() > torch.finfo(torch.float32).max)
    if bool(big.any()):
        layer, expert = (int(i) for i in big.nonzero()[0])
        raise ValueError(f"{path}: load {float(w[layer, expert]):g} (layer {layer} expert {expert}) is beyond float32's range, "
                         "which planning uses; scale the loads down")
    try:
        check_weight(w)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return w
