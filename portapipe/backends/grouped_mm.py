"""Grouped matmul shared by the backends: the CPU reference every kernel must match, torch's own
acceptance rule for its fused ``grouped_mm``, and the zeroing of what that kernel leaves unwritten."""

from __future__ import annotations

from typing import Any

import torch


def _fused_grouped_mm() -> Any:
    return getattr(torch.nn.functional, "grouped_mm", None)


def grouped_mm_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Loop implementation of grouped matmul: the CPU reference every kernel must match."""
    ends = [int(x) for x in offs.tolist()]
    starts = [0] + ends[:-1]
    if a.dim() == 2 and b.dim() == 3:
        if b.shape[0] != len(ends):
            raise ValueError(f"grouped_mm: b has {b.shape[0]} groups but offs has {len(ends)}")
        if a.dtype == torch.float64:
            return rowwise_grouped_mm(a, b, ends)
        out = a.new_empty(a.shape[0], b.shape[2])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = a[s:e] @ b[g]
        if ends:
            out[ends[-1]:] = 0
        return out
    if a.dim() == 2 and b.dim() == 2:
        out = a.new_empty(len(ends), a.shape[0], b.shape[1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[g] = a[:, s:e] @ b[s:e]
        return out
    raise ValueError(f"grouped_mm: unsupported shapes {tuple(a.shape)} x {tuple(b.shape)}")


def rowwise_grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: list[int]) -> torch.Tensor:
    """The 2d x 3d grouped product (rows ``[start, end)`` of ``a`` times ``b[g]``; rows past the
    last end zero) with every output element summed over k in ascending order, whatever the rows
    beside it. A BLAS matmul blocks and vectorizes by the number of rows, so a row's float64 result
    may differ in its last bit between a group of 11 rows and one of 40; a balancer splits an
    expert's rows among its replicas, and verify's exact claim needs each row computed as in any
    other group. Separate multiply and add kernels: each element rounds the same in a vector lane
    and in the scalar tail (no fused multiply-add on one path only). About 3 to 10 times a BLAS
    call's time at the widths float64 runs use (tests, verify)."""
    out = a.new_zeros(a.shape[0], b.shape[2])
    start = 0
    for g, end in enumerate(ends):
        rows, x = out[start:end], a[start:end]
        for k in range(a.shape[1] if end > start else 0):
            rows += x[:, k : k + 1] * b[g, k]
        start = end
    return out


def _operand_strides_ok(t: torch.Tensor) -> bool:
    """torch's rule for one grouped_mm operand (``check_valid_strides`` in ATen's
    GroupedMMUtils.h and in the meta function of ``aten::_grouped_mm``): of the last two
    dims one has stride 1 and the other a stride of at least the first's extent, and that
    stride is a multiple of 16 bytes. Shapes do not enter: ``x.t()`` of a ``[T, K]`` tensor
    is judged by K alone, whatever T is."""
    align = max(1, 16 // t.element_size())
    rows, cols = t.shape[-2], t.shape[-1]
    s_rows, s_cols = t.stride()[-2], t.stride()[-1]
    if s_rows == 1 and s_cols >= max(1, rows):  # column-major
        return s_cols % align == 0
    if s_cols == 1 and s_rows >= max(1, cols):  # row-major
        return s_rows % align == 0
    return False


def grouped_mm_layout_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped_mm accepts these operands' dims, strides and alignment (dtype aside).

    Decided from strides exactly as torch does; off the CPU torch also needs each operand's
    data pointer 16-byte aligned (a row slice of a tensor may not be).
    """
    if a.dim() not in (2, 3) or b.dim() not in (2, 3):
        return False
    if not (a.dim() == 2 and b.dim() == 2) and a.shape[-1] != b.shape[-2]:
        return False
    for t in (a, b):
        if not _operand_strides_ok(t):
            return False
        if t.device.type not in ("cpu", "meta") and t.data_ptr() % 16:
            return False
    return True


#: dtypes torch's CPU grouped_mm takes (GroupedMMUtils.h); CUDA's fused kernel takes bf16 only.
CPU_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_fused_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's CPU grouped_mm accepts these operands (dtype, strides)."""
    if _fused_grouped_mm() is None or a.dtype not in CPU_GROUPED_MM_DTYPES or b.dtype != a.dtype:
        return False
    return grouped_mm_layout_ok(a, b)


def fused_offs(offs: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``offs`` as torch's grouped_mm wants it: int32, stride (1,), on the operands' device."""
    return offs.to(device=device, dtype=torch.int32).contiguous()


def zero_rows_past_end(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero the rows of a 2d x 3d result past ``offs[-1]``: torch's grouped_mm leaves them
    unwritten (its output is ``empty_strided``), the reference and every backend zero them."""
    if offs.numel() == 0:
        return out.zero_()
    if offs.device.type == "cpu":  # the end is known on the host: touch only the tail
        end = int(offs[-1])
        if end < out.shape[0]:
            out[end:] = 0
        return out
    tail = torch.arange(out.shape[0], device=out.device) >= offs[-1].to(out.device)
    return out.masked_fill_(tail.unsqueeze(1), 0)


def cut_rows_past_end(a: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` (2d x 3d form) with its rows past ``offs[-1]`` zeroed, so that they get a zero gradient.

    torch's fused grouped_mm leaves those rows of the *input gradient* unwritten (whatever the
    allocator held; seen on the CPU with torch 2.13), where the reference gives zeros. Done on
    the device (no host sync), and only where a gradient is wanted; with the offsets on the host
    (the CPU) ``a`` itself, uncopied, when every row is in a group (a dispatch's rows always are).
    """
    if not a.requires_grad or offs.numel() == 0:
        return a
    if offs.device.type == "cpu" and int(offs[-1]) >= a.shape[0]:
        return a
    tail = torch.arange(a.shape[0], device=a.device) >= offs[-1].to(a.device)
    return a.masked_fill(tail.unsqueeze(1), 0)


def zero_empty_groups(out: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Zero the groups of a 2d x 2d result ``[G, M, N]`` that have no rows (see the CUDA gate)."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    if offs.device.type == "cpu":
        empty = (counts == 0).nonzero().flatten().tolist()
        if empty:
            out[empty] = 0
        return out
    return out.masked_fill_((counts == 0).to(out.device).view(-1, 1, 1), 0)
