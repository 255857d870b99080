"""Grouped matmul across backends: the fused/loop decision is torch's own, and what torch leaves
unwritten is zeroed on every backend.

torch decides whether grouped_mm accepts an operand from its strides (``check_valid_strides``:
the non-unit stride of the last two dims a multiple of 16 bytes), not from its shape. The
decision here is checked against ``F.grouped_mm`` itself, on the meta device (which runs
torch's CUDA checks) and on the CPU, for every operand layout the expert layers produce.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from portapipe.backends.grouped_mm import grouped_mm_fused_ok, grouped_mm_reference
from portapipe.backends.cpu import CPUBackend
from portapipe.backends.cuda import CUDABackend, fused_path_ok
from portapipe.models.linear import grouped_linear

pytestmark = pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm")


class _LayoutRecorder(CPUBackend):
    """Records the (shape, strides) of both operands of every grouped matmul the layers ask for."""

    def __init__(self) -> None:
        super().__init__()
        self.layouts: set[tuple] = set()

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        self.layouts.add((tuple(a.shape), a.stride(), tuple(b.shape), b.stride()))
        return grouped_mm_reference(a, b, offs)


def _layouts_of_expert_layers() -> list[tuple]:
    """Forward, input gradient and weight gradient of grouped_linear, over token counts and widths."""
    rec = _LayoutRecorder()
    for t, k, n, tiles in itertools.product((0, 1, 7, 8, 96, 100), (16, 60, 64), (24, 30, 32), (1, 2)):
        g = 2
        counts = [t // (g * tiles)] * (g * tiles)
        counts[-1] += t - sum(counts)
        offs = torch.tensor(counts).cumsum(0)
        x = torch.randn(t, k, requires_grad=True)
        w = torch.randn(g, k, n, requires_grad=True)
        tile_rows = [sum(counts[i * g:(i + 1) * g]) for i in range(tiles)]
        grouped_linear(x, w, offs, rec, tile_rows).sum().backward()
    return sorted(rec.layouts)


LAYOUTS = _layouts_of_expert_layers()


def _accepted(a: torch.Tensor, b: torch.Tensor) -> bool:
    groups = b.shape[0] if b.dim() == 3 else 2
    offs = torch.full((groups,), a.shape[0] if b.dim() == 3 else a.shape[1], dtype=torch.int32, device=a.device)
    try:
        F.grouped_mm(a, b, offs=offs)
    except RuntimeError:
        return False
    return True


def test_the_expert_layers_produce_all_three_forms() -> None:
    forms = {(len(a), len(b)) for a, _, b, _ in LAYOUTS}
    assert forms == {(2, 3), (2, 2)}
    assert any(sa[0] == 1 for _, sa, _, _ in LAYOUTS)  # x.t(): the column-major weight-gradient operand
    assert any(sb[1] == 1 for _, _, _, sb in LAYOUTS if len(sb) == 3)  # weight.transpose(1, 2)


def test_cuda_decision_is_torchs_on_the_meta_device() -> None:
    """fused_path_ok == F.grouped_mm accepts (meta device: torch's CUDA checks), every layout, bf16."""
    wrong = []
    for sa, ta, sb, tb in LAYOUTS:
        a = torch.empty_strided(sa, ta, dtype=torch.bfloat16, device="meta")
        b = torch.empty_strided(sb, tb, dtype=torch.bfloat16, device="meta")
        if fused_path_ok(a, b, (9, 0)) != _accepted(a, b):
            wrong.append((sa, ta, sb, tb, _accepted(a, b)))
    assert not wrong, f"decision differs from torch for {len(wrong)} layouts, e.g. {wrong[:3]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_decision_is_torchs_on_the_cpu(dtype) -> None:
    wrong = []
    for sa, ta, sb, tb in LAYOUTS:
        a = torch.empty_strided(sa, ta, dtype=dtype).zero_()
        b = torch.empty_strided(sb, tb, dtype=dtype).zero_()
        if grouped_mm_fused_ok(a, b) != _accepted(a, b):
            wrong.append((sa, ta, sb, tb, _accepted(a, b)))
    assert not wrong, f"decision differs from torch for {len(wrong)} layouts, e.g. {wrong[:3]}"


@pytest.mark.parametrize(("t", "k", "fused"), [(96, 60, False), (100, 64, True), (97, 64, True), (96, 56, True)])
def test_weight_gradient_operand_is_judged_by_its_stride(t, k, fused) -> None:
    """``x.t()`` of ``x[T, K]`` has strides (1, K): K decides, whatever T is."""
    a = torch.empty(t, k, dtype=torch.bfloat16, device="meta").t()
    b = torch.empty(t, 32, dtype=torch.bfloat16, device="meta")
    assert fused_path_ok(a, b, (9, 0)) is fused
    assert _accepted(a, b) is fused


# ------------------------------------------------------------ rows past offs[-1]
def _unwritten_tail(real):
    """torch's grouped_mm as documented: rows past offs[-1] are not written (here: NaN)."""

    def grouped_mm(a, b, *, offs=None, bias=None, out_dtype=None):
        out = real(a, b, offs=offs)
        if b.dim() == 3:
            out[int(offs[-1]) :] = float("nan")
        return out

    return grouped_mm


def _short_offs_case(dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randn(12, 16, generator=g).to(dtype)
    b = torch.randn(3, 16, 8, generator=g).to(dtype)
    offs = torch.tensor([2, 2, 9])  # rows 9..11 belong to no group
    return a, b, offs


def test_cpu_backend_zeroes_rows_past_the_last_offset(monkeypatch) -> None:
    monkeypatch.setattr(F, "grouped_mm", _unwritten_tail(F.grouped_mm))
    a, b, offs = _short_offs_case(torch.float32)
    out = CPUBackend().grouped_mm(a, b, offs)
    assert torch.equal(out[9:], torch.zeros(3, 8))
    torch.testing.assert_close(out, grouped_mm_reference(a, b, offs))


def test_rows_past_the_last_offset_get_a_zero_gradient_and_full_groups_are_not_copied() -> None:
    from portapipe.backends.grouped_mm import cut_rows_past_end

    a, b, offs = _short_offs_case(torch.float32)
    a.requires_grad_(True)
    CPUBackend().grouped_mm(a, b, offs).sum().backward()
    assert torch.equal(a.grad[9:], torch.zeros(3, 16)) and a.grad[:9].abs().sum() > 0
    full = torch.tensor([2, 2, 12])  # every row in a group: nothing to cut, no copy
    assert cut_rows_past_end(a, full) is a and cut_rows_past_end(a, offs) is not a


def test_cuda_backend_zeroes_rows_past_the_last_offset(monkeypatch) -> None:
    monkeypatch.setattr(F, "grouped_mm", _unwritten_tail(F.grouped_mm))
    be = CUDABackend()
    monkeypatch.setattr(be, "grouped_mm_fused", lambda a, b: True)  # the fused branch, on CPU tensors
    a, b, offs = _short_offs_case(torch.float32)
    out = be.grouped_mm(a, b, offs)
    assert torch.equal(out[9:], torch.zeros(3, 8))
    torch.testing.assert_close(out, grouped_mm_reference(a, b, offs))


@pytest.mark.parametrize(("capability", "zeroed"), [((10, 0), True), ((9, 0), False)])
def test_cuda_backend_zeroes_empty_weight_gradient_groups_on_blackwell(monkeypatch, capability, zeroed) -> None:
    """pytorch issue 172439: on compute capability 10.x the 2d x 2d form leaves non-zero values
    in groups without rows; the capability gate zeroes them there."""
    real = F.grouped_mm

    def blackwell(a, b, *, offs=None, bias=None, out_dtype=None):
        out = real(a, b, offs=offs)
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        out[counts == 0] = 1.5  # what the issue reports: stale values where zeros belong
        return out

    monkeypatch.setattr(F, "grouped_mm", blackwell)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    be = CUDABackend()
    monkeypatch.setattr(be, "grouped_mm_fused", lambda a, b: True)
    g = torch.Generator().manual_seed(4)
    x, dy = torch.randn(10, 16, generator=g), torch.randn(10, 8, generator=g)
    offs = torch.tensor([4, 4, 10])
    out = be.grouped_mm(x.t(), dy, offs)
    assert torch.equal(out[1], torch.zeros(16, 8)) is zeroed
    torch.testing.assert_close(out[[0, 2]], grouped_mm_reference(x.t(), dy, offs)[[0, 2]])


def test_a_float64_rows_product_does_not_depend_on_the_rows_beside_it() -> None:
    """A balancer splits an expert's rows among its replicas: each row of a float64 group comes out
    bit for bit as in any other group (a BLAS matmul rounds by the group's size: checked here
    too, so that the test keeps a case where grouping matters), and equals float64 k-ordered sums.
    Where a BLAS rounds by the group's size depends on its kernels: with AVX2 at k = 16 already, with
    AVX-512 on one thread from about k = 512 (one- and two-row products take another path), so both
    widths are run."""
    g = torch.Generator().manual_seed(0)
    blas_differs = False
    for k in (16, 512):
        a = torch.randn(64, k, generator=g, dtype=torch.float64)
        w = torch.randn(2, k, 32, generator=g, dtype=torch.float64)
        whole = CPUBackend().grouped_mm(a, w, torch.tensor([40, 64]))
        for cut in range(1, 40):  # expert 0's rows split in two groups, as between two replicas of it
            split = CPUBackend().grouped_mm(a[:40], torch.stack([w[0], w[0]]), torch.tensor([cut, 40]))
            assert torch.equal(split, whole[:40]), (k, cut)
            blas_differs |= not torch.equal(a[:cut] @ w[0], (a[:40] @ w[0])[:cut])
        want = torch.zeros(64, 32, dtype=torch.float64)
        for i in range(k):
            want += a[:, i : i + 1] * torch.cat([w[0, i : i + 1].expand(40, -1), w[1, i : i + 1].expand(24, -1)])
        assert torch.equal(whole, want), k
    assert blas_differs
