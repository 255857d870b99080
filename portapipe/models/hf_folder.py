"""A Hugging Face model folder read tensor by tensor, and a rank's blocks filled from it.

- :class:`Folder`: ``config.json`` plus safetensors (one file or sharded): which file holds
  each tensor, headers (shape, dtype) without reading data, and the tensors asked for;
- :func:`load_hf_weights`: on a rank, read exactly the tensors its blocks hold (a rank with
  experts 4..7 of a layer reads those experts' tensors only) and fill them with
  :func:`~portapipe.scheduling.stage.load_logical_state`, whatever the split, EP sharding or
  balancer placement.

The model builder (:func:`portapipe.models.moe.build_blocks`) calls the loader; what needs the
model's shapes (checks before launch, export) lives in :mod:`portapipe.models.hf_io`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..fp8.quantize import Quantized, dequantize_blocks
from ..scheduling.stage import load_logical_state, logical_slices
from .hf import SCALE_SUFFIX, source

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
#: an E4M3 weight is read with its ``*_scale_inv`` (DeepSeek-V3's published FP8 layout) and dequantized
DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}
SAFETENSORS_DTYPE = {v: k for k, v in DTYPES.items()}


class Folder:
    """A Hugging Face model folder: its config and which file holds each tensor."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        if not self.path.is_dir():
            raise ValueError(f"{str(self.path)!r} is not a folder")
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise ValueError(f"{self.path} has no config.json")
        try:
            self.config: dict[str, Any] = json.loads(cfg.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{cfg} is not valid JSON: {exc}") from None
        index = self.path / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{index} is not a safetensors index (a weight_map of tensor -> file): {exc}") from None
            self.files: dict[str, Path] = {name: self.path / f for name, f in weight_map.items()}
            absent = sorted({str(p.name) for p in self.files.values() if not p.is_file()})
            if absent:
                raise ValueError(f"{index} names file(s) that are not there: {', '.join(absent[:5])}")
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise ValueError(f"{self.path} has no *.safetensors files")
            self.files = {}
            for f in shards:  # no index: every file's table of contents
                for name in _open(f).keys():
                    self.files[name] = f

    def header(self, names: Iterable[str]) -> dict[str, tuple[tuple[int, ...], str]]:
        """(shape, safetensors dtype) of each tensor, read from the files' headers only."""
        out = {}
        for f, group in _by_file(self.files, names).items():
            handle = _open(f)
            for n in group:
                sl = handle.get_slice(n)
                out[n] = (tuple(sl.get_shape()), sl.get_dtype())
        return out

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors; an E4M3 one dequantized exactly (in float64) by its 128x128 block scales."""
        out = {}
        for f, group in _by_file(self.files, names).items():
            handle = _open(f)
            for n in group:
                out[n] = handle.get_tensor(n)
        for n, t in out.items():
            if t.dtype == torch.float8_e4m3fn:
                out[n] = self._dequantized(n, t)
        return out

    def fp8_problem(self, name: str, shape: tuple[int, ...]) -> str | None:
        """What keeps the E4M3 tensor ``name`` of ``shape`` from being read (its scales), or None."""
        scale = name + SCALE_SUFFIX
        if scale not in self.files:
            return f"{name} is stored as F8_E4M3 without its {scale} (one float32 scale per 128x128 block)"
        want = tuple(-(-d // 128) for d in shape)
        got, dtype = self.header([scale])[scale]
        if got != want or dtype != "F32":
            return f"{scale} is {dtype} {list(got)}; the E4M3 {name} {list(shape)} needs F32 {list(want)} (one per 128x128 block, ceil-divided)"
        return None

    def scale_problems(self, names: Iterable[str]) -> str | None:
        """One line naming the E4M3 tensors among ``names`` whose block scales are not all finite
        and > 0 (read in full: one float32 per 128x128 block), or None."""
        scales = [n + SCALE_SUFFIX for n in names]
        bad = [line for n, s in self.read(scales).items() if (line := scale_problem(n, s)) is not None]
        if not bad:
            return None
        more = f"; {len(bad) - 1} more scale tensor(s) too" if len(bad) > 1 else ""
        return f"model.init_from: {self.path}: {bad[0]}{more}"

    def _dequantized(self, name: str, data: torch.Tensor) -> torch.Tensor:
        problem = self.fp8_problem(name, tuple(data.shape))
        if problem:
            raise ValueError(f"model.init_from: {self.path}: {problem}")
        scale = self.read([name + SCALE_SUFFIX])[name + SCALE_SUFFIX]
        if (problem := scale_problem(name + SCALE_SUFFIX, scale)) is not None:
            raise ValueError(f"model.init_from: {self.path}: {problem}")
        return dequantize_blocks(Quantized(data, scale), torch.float64)


def scale_problem(name: str, scale: torch.Tensor) -> str | None:
    """Why the block scales ``scale`` (the tensor ``name``) cannot dequantize a weight: a block's
    scale that is not finite or not > 0 (it would make the block's weights NaN, infinite or zero,
    and the run fail at its first step); None when every one is fine."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return None
    at = [int(i) for i in bad.nonzero()[0]]
    return (f"{name} holds {float(scale[tuple(at)])} at block {at} ({int(bad.sum())} of {scale.numel()} blocks not finite and > 0); "
            "a dequantization scale must be a finite number > 0: the folder is damaged")


def safetensors_lib() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("Hugging Face folders need the safetensors library: pip install 'portapipe[hf]'") from None
    return safetensors


def _open(path: Path) -> Any:
    safe_open = safetensors_lib().safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def _by_file(files: Mapping[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for n in names:
        out.setdefault(files[n], []).append(n)
    return out


@torch.no_grad()
def load_hf_weights(modules: Iterable[nn.Module], m: ModelConfig) -> None:
    """Fill these modules (this rank's blocks) from ``m.init_from``, reading only what they hold."""
    assert m.init_from is not None
    folder = Folder(m.init_from)
    named = [(n, t) for mod in modules for n, t in mod.state_dict(keep_vars=True).items()]
    keys = sorted({key for key, _, _ in logical_slices(named)})
    sources = {key: source(key) for key in keys}
    absent = sorted(n for s in sources.values() for n in s.names if n not in folder.files)
    if absent:
        raise ValueError(f"model.init_from: {folder.path} lacks {len(absent)} tensor(s) (first: {', '.join(absent[:4])})")
    tensors = folder.read(n for s in sources.values() for n in s.names)
    state = {key: s.combine([tensors[n] for n in s.names]) for key, s in sources.items()}
    load_logical_state(named, state)
    pad = folder.config.get("pad_token_id")
    if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < m.vocab_size:
        # transformers builds the embedding with padding_idx: the pad row never gets a gradient.
        for mod in modules:
            for emb in mod.modules():
                if isinstance(emb, nn.Embedding):
                    emb.padding_idx = pad
