"""Hugging Face folders in and out: ``config.json`` plus safetensors, one file or sharded.

- :func:`init_problems`: before any rank starts, whether ``model.init_from`` can fill this
  model (config agrees, every tensor present with its shape, none left over), one line each;
- reading a folder and filling a rank's blocks from it: :mod:`portapipe.models.hf_folder`;
- :func:`export_hf`: a logical state (e.g. from a checkpoint) written as a folder that
  transformers' ``from_pretrained`` loads.

The names are mapped in :mod:`portapipe.models.hf`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig
from ..scheduling.stage import logical_slices
from ..fp8.quantize import quantize_blocks
from .hf import FP8_QUANTIZATION, HF_ARCHS, SCALE_SUFFIX, config_problems, fp8_weight, hf_config, ignored, source, stored_copies, written_copies
from .hf_folder import DTYPES, INDEX, SINGLE, Folder, safetensors_lib


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
    """Why ``model.init_from`` cannot fill the model ``m`` (empty when it can); reads headers, the
    block scales of E4M3 weights (each finite and > 0) and the tensors stored twice
    (:func:`~.hf.stored_copies`), which must be equal."""
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
    extra = sorted(n for n in set(folder.files) - set(want) if not ignored(n, m))
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
        if dtype not in DTYPES:
            out.append(f"model.init_from: {n} is stored as {dtype}; portapipe reads {', '.join(DTYPES)}")
        elif dtype == "F8_E4M3" and (problem := folder.fp8_problem(n, shape)):
            out.append(f"model.init_from: {folder.path}: {problem}")
    if not out and (bad := folder.scale_problems(n for n, (_, dtype) in headers.items() if dtype == "F8_E4M3")):
        out.append(bad)
    if not out:
        out += copy_problems(folder, m)
    return out[:20]


def copy_problems(folder: Folder, m: ModelConfig) -> list[str]:
    """The tensors ``folder`` stores twice (:func:`~.hf.stored_copies`) that are not equal: one
    logical weight cannot start as two."""
    out = []
    for copy, original in stored_copies(m).items():
        if copy in folder.files and original in folder.files:
            a, b = folder.read([copy, original]).values()
            if a.shape != b.shape or not torch.equal(a, b):
                out.append(f"model.init_from: {folder.path}: {copy} differs from {original}, of which it is a copy here; "
                           "one weight cannot start as two")
    return out


def source_config(m: ModelConfig) -> dict[str, Any] | None:
    """The config.json of the folder ``m`` started from (``model.init_from``); None when there is
    none or it can no longer be read."""
    if m.init_from is None:
        return None
    try:
        return Folder(m.init_from).config
    except ValueError:
        return None


def export_hf(
    state: Mapping[str, torch.Tensor], config: ModelConfig, out_dir: str | Path, max_shard_bytes: int = 5 * 2**30, fp8: bool = False
) -> Path:
    """Write the logical ``state`` of a ``config`` model as a Hugging Face folder at ``out_dir``.

    ``state`` holds every logical tensor (experts one by one, under ``expert_key`` names, the
    router biases included); a missing, extra or misshapen tensor is an error naming it, and
    nothing is written. Tensors keep their dtype. Files: config.json and model.safetensors, or
    numbered shards of at most ``max_shard_bytes`` with model.safetensors.index.json. The folder
    is written beside ``out_dir`` and renamed into place; ``out_dir`` must not exist or be empty.
    config.json keeps ``SOURCE_KEYS`` of the ``model.init_from`` folder when it is still there.
    ``fp8``: DeepSeek-V3's published FP8 layout (what inference engines read): the attention, FFN
    and expert Linear weights as E4M3 ``*.weight`` with float32 ``*.weight_scale_inv``, one per
    128x128 block (ceil-divided at the edges), quantized by the recipe's quantizer (power-of-two
    scales; a float64 weight from its float32 value), and config.json's ``quantization_config``;
    weights that are E4M3 values times such scales come back bit for bit.
    """
    save_file = safetensors_lib().torch.save_file
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
        parts = source(key).split(state[key].detach().cpu())
        if fp8 and fp8_weight(key):
            for name, t in list(parts.items()):
                q = quantize_blocks(t.float() if t.dtype == torch.float64 else t)
                parts[name], parts[name + SCALE_SUFFIX] = q.data.contiguous(), q.scale.contiguous()
        tensors.update(parts)
    for copy, original in written_copies(config).items():
        tensors[copy] = tensors[original].clone()
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
        hf = hf_config(config, source_config(config))
        if fp8:
            hf["quantization_config"] = dict(FP8_QUANTIZATION)
        (tmp / "config.json").write_text(json.dumps(hf, indent=1))
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
