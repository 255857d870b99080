"""Optional Triton kernels for LPLB's token counting and index mapping.

Same results as the torch path in :mod:`portapipe.balancing.lplb` (which stays the fallback):
entries are split into blocks; one kernel counts each block's entries per expert, a cumulative
sum over blocks gives each block its starting occurrence number per expert, and the mapping
kernel adds each entry's rank inside its block (a BLOCK x BLOCK comparison) to decide original
or copy. Triton is imported only when these functions are called; on CPU they run under
``TRITON_INTERPRET=1`` (tests, in int32/fp32 only).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

__all__ = ["available", "why_unavailable", "count_experts", "map_indices", "BLOCK"]

BLOCK = 128

# Bound on first use. Kernels and everything they call must be module globals: the interpreter
# (TRITON_INTERPRET=1) runs a kernel's source against its module's globals, not its closure.
tl: Any = None
_block_counts_kernel: Any = None
_map_block_kernel: Any = None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def why_unavailable(device: torch.device | None = None) -> str:
    """Empty when the kernels can run on ``device``; else the reason. Imports triton only when
    the answer depends on it (not for CPU tensors without the interpreter)."""
    interpret = _interpret()
    if device is not None and device.type == "cpu" and not interpret:
        return "Triton compiles for accelerators; on CPU set TRITON_INTERPRET=1"
    try:
        import triton
    except ImportError:
        return "triton is not installed (pip install 'portapipe[triton]')"
    if interpret:
        return "" if device is None or device.type == "cpu" else f"TRITON_INTERPRET=1 runs on CPU tensors, not {device.type}"
    if device is None:
        return ""
    try:
        target = triton.runtime.driver.active.get_current_target().backend
    except Exception as exc:  # no driver for this machine
        return f"Triton has no active driver: {exc}"
    return "" if target == device.type else f"Triton targets {target}, tensors are on {device.type}"


def available(device: torch.device) -> bool:
    return why_unavailable(device) == ""


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool) -> tuple[Any, Any]:
    # Decorated here, not at import: triton.jit reads TRITON_INTERPRET when it wraps a function.
    global tl, _block_counts_kernel, _map_block_kernel
    import triton
    import triton.language

    tl = triton.language

    @triton.jit
    def _block_counts_kernel(idx_ptr, out_ptr, n, n_bins, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        e = tl.load(idx_ptr + offs, mask=mask, other=-1)
        # bin 0 holds dropped tokens (-1), bin e + 1 expert e
        tl.atomic_add(out_ptr + pid * n_bins + e + 1, tl.full([BLOCK], 1, tl.int32), mask=mask)

    @triton.jit
    def _map_block_kernel(idx_ptr, base_ptr, stay_ptr, orig_ptr, copy_ptr, out_ptr, n, n_bins, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        pos = tl.arange(0, BLOCK)
        offs = pid * BLOCK + pos
        mask = offs < n
        e = tl.load(idx_ptr + offs, mask=mask, other=-2)
        # rank among equal ids earlier in this block. tl.sum's own body is decorated when triton
        # is imported, so it is not interpretable if TRITON_INTERPRET=1 was set later; reducing
        # with its combine function works compiled and hits the interpreter's numpy fast path.
        same = (e[:, None] == e[None, :]) & (pos[None, :] < pos[:, None])
        inblock = tl.reduce(same.to(tl.int32), 1, tl.standard._sum_combine)
        valid = mask & (e >= 0)
        ec = tl.where(valid, e, 0)
        occ = tl.load(base_ptr + pid * n_bins + ec + 1, mask=valid, other=0) + inblock
        stay = tl.load(stay_ptr + ec, mask=valid, other=0)
        orig = tl.load(orig_ptr + ec, mask=valid, other=-1)
        copy = tl.load(copy_ptr + ec, mask=valid, other=-1)
        out = tl.where(valid, tl.where(occ < stay, orig, copy), -1)
        tl.store(out_ptr + offs, out, mask=mask)

    return _block_counts_kernel, _map_block_kernel


def _block_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[blocks, E + 1] int32 per-block counts (bin 0 = -1 entries)."""
    kc, _ = _kernels(_interpret())
    n = flat.numel()
    nblocks = max(1, -(-n // BLOCK))
    out = torch.zeros(nblocks, n_experts + 1, dtype=torch.int32, device=flat.device)
    if n:
        kc[(nblocks,)](flat.int().contiguous(), out, n, n_experts + 1, BLOCK=BLOCK)
    return out


def count_experts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """``bincount(flat + 1, minlength=E + 1)`` as int64, by the counting kernel."""
    return _block_counts(flat, n_experts).sum(0, dtype=torch.int64)


def map_indices(flat: torch.Tensor, stay: torch.Tensor, orig_phys: torch.Tensor, copy_phys: torch.Tensor) -> torch.Tensor:
    """Physical ids: entry j of expert e goes to ``orig_phys[e]`` if fewer than ``stay[e]`` entries
    of e precede it, else to ``copy_phys[e]``; -1 stays -1. int64, same length as ``flat``."""
    _, km = _kernels(_interpret())
    n_experts = stay.numel()
    counts = _block_counts(flat, n_experts)
    base = (counts.cumsum(0, dtype=torch.int32) - counts).contiguous()
    out = torch.empty(flat.numel(), dtype=torch.int32, device=flat.device)
    if flat.numel():
        km[(counts.shape[0],)](
            flat.int().contiguous(),
            base,
            stay.int().contiguous(),
            orig_phys.int().contiguous(),
            copy_phys.int().contiguous(),
            out,
            flat.numel(),
            n_experts + 1,
            BLOCK=BLOCK,
        )
    return out.long()
