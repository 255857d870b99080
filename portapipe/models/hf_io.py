"""Hugging Face folders in and out: ``config.json`` plus safetensors, one file or sharded.

- :func:`init_problems`: before any rank starts, whether ``model.init_from`` can fill this
  model (config agrees, every tensor present with its shape, none left over), one line each;
- :func:`load_hf_weights`: on a rank, read exactly the tensors its blocks hold (a rank with
  experts 4..7 of a layer reads those experts' tensors only) and fill them with
  :func:`~portapipe.scheduling.stage.load_logical_state`, whatever the split, EP sharding or
  balancer placement;
- :func:`export_hf`: a logical state (e.g. from a checkpoint) written as a folder that
  transformers' ``from_pretrained`` loads.

The names are mapped in :mod:`portapipe.models.hf`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..scheduling.stage import load_logical_state, logical_slices
from .hf import HF_ARCHS, config_problems, hf_config, ignored, source

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SAFETENSORS_DTYPE = {v: k for k, v in _DTYPES.items()}


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
        out = {}
        for f, group in _by_file(self.files, names).items():
            handle = _open(f)
            for n in group:
                out[n] = handle.get_tensor(n)
        return out


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise ValueError("Hugging Face folders need the safetensors library: pip install 'portapipe[hf]'") from None
    return safetensors


def _open(path: Path) -> Any:
    safe_open = _safetensors().safe_open

    try:
        return safe_open(str(path), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from None


def _by_file(files: Mapping[str, Path], names: Iterable[str]) -> dict[Path, list[str]]:
    out: dict[Path, list[str]] = {}
    for n in names:
        out.setdefault(files[n], []).append(n)
    return out


def logical_shapes(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every logical tensor of the single-process model and its shape (built on the meta device)."""
    from ..backends.cpu import CPUBackend
    from .expert_parallel import ExpertParallel
    from .moe import build_blocks

    with torch.device("meta"):
        blocks = build_blocks(m, [0], 1, ExpertParallel(CPUBackend()), seed=0)
    return {k: tuple(t.shape) for k, t, _ in logical_slices(blocks[0].state_dict(keep_vars=True).items())}


def expected_hf(m: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the model ``m`` is made of, with its shape."""
    out: dict[str, tuple[int, ...]] = {}
    for key, shape in logical_shapes(m).items():
        out.update(source(key).shapes(shape))
    return out


def init_problems(m: ModelConfig) -> list[str]:
    """Why ``model.init_from`` cannot fill the model ``m`` (empty when it can); reads headers only."""
    if m.init_from is None:
        return []
    try:
        folder = Folder(m.init_from)
    except ValueError as exc:
        return [f"model.init_from: {exc}"]
    where = f"{folder.path / 'config.json'}"
    out = config_problems(m, folder.config, where)
    if out:
        return out
    want = expected_hf(m)
    missing = sorted(set(want) - set(folder.files))
    extra = sorted(n for n in set(folder.files) - set(want) if not ignored(n, m.n_layers))
    if missing:
        out.append(f"model.init_from: {folder.path} lacks {len(missing)} tensor(s) the model needs (first: {', '.join(missing[:4])})")
    if extra:
        out.append(f"model.init_from: {folder.path} holds {len(extra)} tensor(s) the model has no place for (first: {', '.join(extra[:4])})")
    present = [n for n in want if n in folder.files]
    try:
        headers = folder.header(present)
    except ValueError as exc:  # a truncated or foreign file among the shards
        return out + [f"model.init_from: {exc}"]
    for n, (shape, dtype) in headers.items():
        if shape != want[n]:
            out.append(f"model.init_from: {n} has shape {list(shape)}, the model needs {list(want[n])}")
        if dtype not in _DTYPES:
            out.append(f"model.init_from: {n} is stored as {dtype}; portapipe reads {', '.join(_DTYPES)}")
    return out[:20]


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


def source_config(m: ModelConfig) -> dict[str, Any] | None:
    """The config.json of the folder ``m`` started from (``model.init_from``); None when there is
    none or it can no longer be read."""
    if m.init_from is None:
        return None
    try:
        return Folder(m.init_from).config
    except ValueError:
        return None


def export_hf(state: Mapping[str, torch.Tensor], config: ModelConfig, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write the logical ``state`` of a ``config`` model as a Hugging Face folder at ``out_dir``.

    ``state`` holds every logical tensor (experts one by one, under ``expert_key`` names, the
    router biases included); a missing, extra or misshapen tensor is an error naming it, and
    nothing is written. Tensors keep their dtype. Files: config.json and model.safetensors, or
    numbered shards of at most ``max_shard_bytes`` with model.safetensors.index.json. The folder
    is written beside ``out_dir`` and renamed into place; ``out_dir`` must not exist or be empty.
    config.json keeps ``SOURCE_KEYS`` of the ``model.init_from`` folder when it is still there.
    """
    save_file = _safetensors().torch.save_file
    if config.arch not in HF_ARCHS:
        raise ValueError(f"model.arch {config.arch!r} has no Hugging Face form; export needs {' or '.join(HF_ARCHS)}")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder; choose another output folder")
    want = logical_shapes(config)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    wrong = sorted(f"{k}: {list(state[k].shape)} != {list(want[k])}" for k in set(want) & set(state) if tuple(state[k].shape) != want[k])
    if missing or extra or wrong:
        parts = [f"{len(v)} {what} (first: {', '.join(v[:4])})" for what, v in (("missing", missing), ("unexpected", extra), ("of another shape", wrong)) if v]
        raise ValueError("the state does not fit the model config: " + "; ".join(parts))
    tensors: dict[str, torch.Tensor] = {}
    for key in sorted(want):
        tensors.update(source(key).split(state[key].detach().cpu()))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE), metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards, 1):
                fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in shard})
                total += sum(t.numel() * t.element_size() for t in shard.values())
            (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
        (tmp / "config.json").write_text(json.dumps(hf_config(config, source_config(config)), indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
