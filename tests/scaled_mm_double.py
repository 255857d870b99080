"""A stand-in for ``torch._scaled_mm`` on CUDA, clearly named as such, that enforces torch's argument
rules for DeepSeek-style blockwise scaling and computes what cuBLASLt would (to rounding).

The rules, read from torch 2.11-2.13 (``torch/_meta_registrations.py``'s ``_check_scaled_mm_sizes``
and ATen's ``ScaledBlas.cpp``: ``_scaled_mm_out_cuda``, ``get_joint_scaling``,
``is_blockwise_1x128_scaling`` / ``is_blockwise_128x128_scaling``, ``_scaled_gemm``):

- 2-D E4M3 operands (two E5M2 are refused), ``mat1`` row-major and ``mat2`` column-major
  (sm90: "Only multiplication of row-major and column-major matrices is supported by cuBLASLt"),
  ``mat1.size(1) % 16 == 0``, both dims of ``mat2`` multiples of 16;
- scales float32; 1x128 (of ``mat1``, or of ``mat2.t()``): shape ``[rows, ceil(K/128)]``, stride 1
  along rows and ``rows`` along K blocks (outer-dim-major); 128x128 (of ``mat2.t()``): shape
  ``[ceil(N/128), ceil(K/128)]``, stride 1 along K blocks and ``round_up(ceil(K/128), 4)`` along N
  blocks; a dim of size 1 may have any stride. The pairs tried, in torch's order: (128x128,
  1x128), (1x128, 128x128), (1x128, 1x128);
- the DeepSeek pairs need compute capability 9.x and cuBLASLt >= 12.9 (``capability`` /
  ``cublaslt`` here: what the stand-in's "GPU" has);
- no ``out_dtype``: the output is E4M3, which this recipe never wants (and cuBLAS fails on).

The result is the dequantized float64 product rounded to ``out_dtype`` (the tensor cores' order
and truncation aside, which the kit's bounds cover).
"""

from __future__ import annotations

from typing import Any

import torch

from portapipe.backends.fp8_mm import column_scales, n_tiles


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _size_stride(scale: torch.Tensor, dim: int, size: int, stride: int) -> bool:
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


def _is_1x128(t: torch.Tensor, scale: torch.Tensor) -> bool:
    return scale.dtype == torch.float32 and scale.dim() == 2 and _size_stride(scale, 0, t.size(0), 1) and _size_stride(scale, 1, n_tiles(t.size(1)), t.size(0))


def _is_128x128(t: torch.Tensor, scale: torch.Tensor) -> bool:
    kb = n_tiles(t.size(1))
    return (scale.dtype == torch.float32 and scale.dim() == 2 and _size_stride(scale, 0, n_tiles(t.size(0)), _round_up(kb, 4))
            and _size_stride(scale, 1, kb, 1))


class ScaledMMDouble:
    """``torch._scaled_mm`` as a Hopper GPU with ``cublaslt`` runs it (see the module docstring);
    ``calls`` records each call's (M, K, N, pair)."""

    def __init__(self, capability: tuple[int, int] = (9, 0), cublaslt: int = 120900) -> None:
        self.capability, self.cublaslt = capability, cublaslt
        self.calls: list[tuple[int, int, int, str]] = []

    def __call__(self, mat1: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, bias: Any = None,
                 scale_result: Any = None, out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
        fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
        if mat1.dim() != 2 or mat2.dim() != 2:
            raise RuntimeError("mat1 must be a matrix")
        if mat1.dtype not in fp8 or mat2.dtype not in fp8:
            raise RuntimeError(f"Expected mat1 to be Float8 matrix got {mat1.dtype}")
        if mat1.dtype == mat2.dtype == torch.float8_e5m2:
            raise ValueError("Multiplication of two Float8_e5m2 matrices is not supported")
        if mat1.size(1) != mat2.size(0):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
        pairs = [("128x128", "1x128", _is_128x128, _is_1x128), ("1x128", "128x128", _is_1x128, _is_128x128), ("1x128", "1x128", _is_1x128, _is_1x128)]
        pair = next((f"{a}x{b}" for a, b, ok_a, ok_b in pairs if ok_a(mat1, scale_a) and ok_b(mat2.t(), scale_b.t())), None)
        if pair is None:
            raise RuntimeError(f"Invalid scaling configuration. Got scale_a.size()={tuple(scale_a.shape)}, scale_a.stride()={scale_a.stride()}, "
                               f"scale_b.size()={tuple(scale_b.shape)} and scale_b.stride()={scale_b.stride()}")
        if mat1.size(1) % 16:
            raise RuntimeError(f"Expected trailing dimension of mat1 to be divisible by 16 but got mat1 shape: {tuple(mat1.shape)}.")
        if mat2.size(0) % 16 or mat2.size(1) % 16:
            raise RuntimeError(f"mat2 shape {tuple(mat2.shape)} must be divisible by 16")
        if not (mat1.stride(1) == 1 and mat1.stride(0) > 1) or not (mat2.stride(0) == 1 and mat2.stride(1) > 1):
            raise RuntimeError("Only multiplication of row-major and column-major matrices is supported by cuBLASLt")
        if self.capability[0] != 9 or self.cublaslt < 120900:
            raise NotImplementedError("DeepSeek style (1x128, 128x128) scaling only supported in CUDA for SM90")
        if out_dtype is None:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul (an E4M3 output)")
        m, k = mat1.shape
        n = mat2.size(1)
        self.calls.append((m, k, n, pair))
        sa = scale_a.repeat_interleave(128, dim=1)[:, :k].double()
        if pair.endswith("128x128"):
            sb = column_scales(scale_b, n).repeat_interleave(128, dim=0)[:k].double()
        else:
            sb = scale_b.repeat_interleave(128, dim=0)[:k].double()
        return ((mat1.double() * sa) @ (mat2.double() * sb)).to(out_dtype)
