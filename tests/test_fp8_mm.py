"""The FP8 matmul: the emulation's semantics checked against an independent integer implementation,
against the dequantized float64 product and the unquantized one; its grouped forms; the CUDA
blockwise path through a stand-in that enforces torch's argument rules; the capability."""

from __future__ import annotations

import pytest
import torch

from portapipe.backends.base import Backend
from portapipe.backends.cpu import CPUBackend
from portapipe.backends.cuda import CUDABackend
from portapipe.backends.fp8_mm import fp8_grouped_mm_emulated, fp8_mm_emulated, group_tiles, operand_problem
from portapipe.backends.scaled_mm import KIT_CALC_DIFF, KIT_SQNR_DB, blockwise_mm, calc_diff, probe, sqnr_db
from portapipe.fp8.quantize import dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows

from .scaled_mm_double import ScaledMMDouble


def _operands(m: int, k: int, n: int, seed: int = 0, columns: bool = False) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, k)).to(torch.bfloat16)
    w = (torch.randn(k, n, generator=g) * 0.05).to(torch.bfloat16)
    xq = quantize_rows(x)
    if columns:  # 128x1 tiles of b: one scale per column and K block
        wq = quantize_rows(w.t())
        return x, w, xq.data, xq.scale, wq.data.t(), wq.scale.t()
    wq = quantize_blocks(w)
    return x, w, xq.data, xq.scale, wq.data, wq.scale


def _integer_reference(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, columns: bool) -> torch.Tensor:
    """The emulation written otherwise: E4M3 values times 2^9 are integers, so each 128-wide block
    sum is an exact int64 sum; scaled in float64, accumulated in float32 block after block."""
    ai = (a.double() * 512).long()
    bi = (b.double() * 512).long()
    m, k = a.shape
    n = b.shape[1]
    acc = torch.zeros(m, n, dtype=torch.float32)
    for kb in range(-(-k // 128)):
        lo, hi = kb * 128, min(k, kb * 128 + 128)
        block = (ai[:, lo:hi].unsqueeze(2) * bi[lo:hi].unsqueeze(0)).sum(1).double() / 2.0**18
        col = sb[kb] if columns else sb[kb].repeat_interleave(128)[:n]
        acc += (block * sa[:, kb : kb + 1].double() * col.double()).float()
    return acc


@pytest.mark.parametrize("m,k,n,columns", [(5, 128, 128, False), (7, 300, 130, False), (4, 384, 256, True), (3, 200, 9, True)])
def test_emulation_is_exact_block_sums_accumulated_in_float32(m: int, k: int, n: int, columns: bool) -> None:
    _, _, a, sa, b, sb = _operands(m, k, n, seed=m, columns=columns)
    got = fp8_mm_emulated(a, sa, b, sb, torch.float32)
    assert torch.equal(got, _integer_reference(a, sa, b, sb, columns))


def test_emulation_is_within_1e6_of_the_dequantized_float64_product_and_25_db_of_the_unquantized() -> None:
    x, w, a, sa, b, sb = _operands(64, 1024, 256, seed=1)
    got = fp8_mm_emulated(a, sa, b, sb, torch.float32).double()
    exact = dequantize_rows(quantize_rows(x)).double() @ dequantize_blocks(quantize_blocks(w)).double()
    assert float((got - exact).norm() / exact.norm()) < 1e-6
    unquantized = x.double() @ w.double()
    assert sqnr_db(got, unquantized) >= 25.0 and calc_diff(got, unquantized) < 1e-3
    assert fp8_mm_emulated(a, sa, b, sb, torch.bfloat16).dtype == torch.bfloat16


def test_grouped_forms_are_the_dense_product_per_group() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(70, 256, generator=g)
    w = torch.randn(3, 256, 128, generator=g) * 0.1
    offs = torch.tensor([20, 20, 60])  # an empty group; rows past the last group
    xq, wq = quantize_rows(x), quantize_blocks(w)
    out = fp8_grouped_mm_emulated(xq.data, xq.scale, wq.data, wq.scale, offs, torch.float32)
    assert torch.equal(out[:20], fp8_mm_emulated(xq.data[:20], xq.scale[:20], wq.data[0], wq.scale[0], torch.float32))
    assert torch.equal(out[20:60], fp8_mm_emulated(xq.data[20:60], xq.scale[20:60], wq.data[2], wq.scale[2], torch.float32))
    assert bool((out[60:] == 0).all())
    # 2d x 2d (the weight gradient): tiles restart at each group
    ends = offs.tolist()
    at, bt = quantize_rows(x[:60].t(), ends), quantize_rows(torch.randn(60, 64, generator=g).t(), ends)
    got = fp8_grouped_mm_emulated(at.data, at.scale, bt.data.t(), bt.scale.t(), offs, torch.float32)
    assert got.shape == (3, 256, 64) and bool((got[1] == 0).all())
    for gi, (s, e, ts, te) in enumerate(group_tiles(ends)):
        if e > s:
            want = fp8_mm_emulated(at.data[:, s:e], at.scale[:, ts:te], bt.data.t()[s:e], bt.scale.t()[ts:te], torch.float32)
            assert torch.equal(got[gi], want)


def test_operands_out_of_shape_are_refused_in_one_line() -> None:
    _, _, a, sa, b, sb = _operands(4, 256, 128)
    assert operand_problem(a, sa, b, sb) is None
    assert "a_scale has shape (4, 1)" in operand_problem(a, sa[:, :1], b, sb)
    assert "b_scale has shape" in operand_problem(a, sa, b, sb[:1])
    assert "float8_e4m3fn" in operand_problem(a.float(), sa, b, sb)
    with pytest.raises(ValueError, match="do not multiply"):
        fp8_mm_emulated(a, sa, b[:128], sb, torch.float32)


def test_declarations() -> None:
    from portapipe.backends.ascend import AscendBackend

    assert CPUBackend.capabilities.fp8_matmul == "emulated" and AscendBackend.capabilities.fp8_matmul == "emulated"
    assert CUDABackend.capabilities.fp8_matmul == "blockwise"
    assert Backend.capabilities.fp8_matmul == "none"
    from dataclasses import replace

    assert "capabilities.fp8_matmul: 'fast'" in replace(CPUBackend.capabilities, fp8_matmul="fast").problems()[0]


def test_a_backend_without_float64_emulates_on_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    from portapipe.backends import base

    class NoFloat64(CPUBackend):
        capabilities = base.Capabilities("gloo", ("float32", "bfloat16"), ("float32",), ("float32", "bfloat16"), fp8_matmul="emulated")

    _, _, a, sa, b, sb = _operands(6, 256, 128)
    seen = []
    real = base.fp8_mm_emulated
    monkeypatch.setattr(base, "fp8_mm_emulated", lambda *args: seen.append(args[0].device.type) or real(*args))
    meta = torch.device("meta")
    out = NoFloat64().fp8_mm(a, sa, b, sb, torch.float32)  # CPU tensors: computed where they are
    assert torch.equal(out, real(a, sa, b, sb, torch.float32)) and seen == ["cpu"]
    assert "on the host" in NoFloat64().fp8_path() and CPUBackend().fp8_path() == "emulated"
    assert meta.type == "meta"


# --------------------------------------------------------------------- the CUDA blockwise path
@pytest.mark.parametrize("m,k,n,columns", [(33, 384, 256, False), (8, 7168 // 8, 2048 // 8, False), (256, 200, 128, True), (128, 37, 130, True)])
def test_blockwise_layout_passes_torchs_rules_and_matches_the_emulation(m: int, k: int, n: int, columns: bool) -> None:
    """K / 128 = 3 (torch's padded 128x128 scales), a token count that is no multiple of 128 or 16
    (the weight gradient: K padded with zeros), N no multiple of 16 (padded, cut off)."""
    _, _, a, sa, b, sb = _operands(m, k, n, seed=k, columns=columns)
    double = ScaledMMDouble()
    got = blockwise_mm(double, a, sa, b, sb, torch.float32)
    want = fp8_mm_emulated(a, sa, b, sb, torch.float32)
    assert got.shape == want.shape
    assert sqnr_db(got, want) >= KIT_SQNR_DB and calc_diff(got, want) < KIT_CALC_DIFF
    assert double.calls[0][3] == ("1x128x1x128" if columns else "1x128x128x128")


def test_the_rules_refuse_what_the_layout_avoids() -> None:
    _, _, a, sa, b, sb = _operands(16, 384, 256)  # two blocks of N: the padded stride matters
    double = ScaledMMDouble()
    with pytest.raises(RuntimeError, match="Invalid scaling"):  # 128x128 scales without torch's padding (kb = 3)
        double(a, b.t().contiguous().t(), sa.t().contiguous().t(), sb.t().contiguous().t(), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="row-major and column-major"):  # b row-major
        from portapipe.backends.scaled_mm import outer_major, padded_blocks

        double(a, b.contiguous(), outer_major(sa), padded_blocks(sb), out_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="CUBLAS"):  # no out_dtype
        double(a, b.t().contiguous().t(), outer_major(sa), padded_blocks(sb))
    with pytest.raises(NotImplementedError, match="SM90"):
        ScaledMMDouble(capability=(8, 9))(a, b.t().contiguous().t(), outer_major(sa), padded_blocks(sb), out_dtype=torch.float32)


def test_probe_says_why_not_and_catches_wrong_results() -> None:
    assert probe(ScaledMMDouble(), "cpu") is None
    assert "no torch._scaled_mm" in probe(None, "cpu")
    assert "SM90" in probe(ScaledMMDouble(capability=(10, 0)), "cpu")

    def unpadded(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor, **kw: object) -> torch.Tensor:
        """torch before its fix: 128x128 scales read as if unpadded, so with K/128 = 3 the wrong
        blocks (and the padding's zeros) scale the products."""
        from portapipe.backends.scaled_mm import padded_blocks

        misread = torch.as_strided(sb, sb.shape, (1, sb.shape[0]))
        return ScaledMMDouble()(a, b, sa, padded_blocks(misread.contiguous()), **kw)

    assert "off the emulation" in probe(unpadded, "cpu")


def test_cuda_backend_runs_blockwise_where_the_probe_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    double = ScaledMMDouble()
    monkeypatch.setattr(torch, "_scaled_mm", double, raising=False)
    monkeypatch.setattr(CUDABackend, "_fp8_probed", {})
    monkeypatch.setattr(CUDABackend, "device", lambda self, local_rank=None: torch.device("cpu"))
    monkeypatch.setattr(CUDABackend, "device_type", "cpu")  # the stand-in's "GPU" memory is the host's
    be = CUDABackend()
    assert be.fp8_path() == "blockwise"
    _, _, a, sa, b, sb = _operands(20, 256, 128)
    calls = len(double.calls)
    out = be.fp8_mm(a, sa, b, sb, torch.bfloat16)
    assert len(double.calls) == calls + 1 and out.dtype == torch.bfloat16
    # routed experts: one blockwise call per non-empty expert (torch has no blockwise grouped op)
    w = quantize_blocks(torch.randn(3, 256, 128))
    be.fp8_grouped_mm(a, sa, w.data, w.scale, torch.tensor([5, 5, 20]), torch.float32)
    assert len(double.calls) == calls + 3
    # elsewhere: the emulation, and the reason is what info shows
    monkeypatch.setattr(CUDABackend, "_fp8_probed", {})
    monkeypatch.setattr(torch, "_scaled_mm", ScaledMMDouble(capability=(8, 9)), raising=False)
    assert CUDABackend().fp8_path().startswith("emulated: torch._scaled_mm with 1x128 x 128x128 scaling failed")
    assert torch.equal(CUDABackend().fp8_mm(a, sa, b, sb, torch.float32), fp8_mm_emulated(a, sa, b, sb, torch.float32))


def test_info_shows_the_declaration_and_the_path_that_runs_here() -> None:
    from portapipe.commands.info import collect

    cpu = collect()["backends"]["cpu"]
    assert cpu["capabilities"]["fp8_matmul"] == "emulated" and cpu["fp8_matmul_path"] == "emulated"
    assert collect()["backends"]["cuda"]["capabilities"]["fp8_matmul"] == "blockwise"
