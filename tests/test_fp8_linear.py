"""A Linear in FP8: the three GEMMs against bfloat16 and against float64 references of the recipe's
tiles, the weight gradient's 128x1 groups along the tokens, the W split, and which of a model's
Linears the recipe runs in FP8."""

from __future__ import annotations

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.backends.scaled_mm import calc_diff, sqnr_db
from portapipe.config import load_config
from portapipe.fp8.quantize import dequantize_blocks, dequantize_rows, quantize_blocks, quantize_rows
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.fp8_layers import enable_fp8, fp8_linears, fp8_note, fp8_problems, plan
from portapipe.models.linear import grouped_linear, linear
from portapipe.models.moe import build_blocks
from portapipe.scheduling.wgrad import WeightGradQueue, deferring

BE = CPUBackend()


def _data(t: int = 256, k: int = 384, n: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    dy = torch.randn(t, n, generator=g).to(torch.bfloat16)
    return x, w, dy


def _grads(fp8: bool, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = linear(xl, wl, fp8=BE if fp8 else None)
    y.backward(dy)
    return y.detach(), xl.grad, wl.grad


def test_fp8_linear_against_bfloat16_sqnr() -> None:
    """torchao's bounds for blockwise FP8 training, in its setting (the gradient of y.sum()):
    outputs >= 25 dB, input and weight gradients >= 30 dB against bfloat16; with a random output
    gradient (two quantized operands in every GEMM) >= 25 dB."""
    x, w, dy = _data()
    for grad, bound in ((torch.ones_like(dy), 30.0), (dy, 25.0)):
        y8, gx8, gw8 = _grads(True, x, w, grad)
        y, gx, gw = _grads(False, x, w, grad)
        assert y8.dtype == gx8.dtype == gw8.dtype == torch.bfloat16
        assert sqnr_db(y8, y) >= 25.0 and calc_diff(y8, y) < 1e-3
        assert sqnr_db(gx8, gx) >= bound and sqnr_db(gw8, gw) >= bound


def test_each_gemm_is_the_float64_product_of_its_tiles() -> None:
    """forward: 1x128 x 128x128; input gradient: dy 1x128 (never 128x128) x the same blocks;
    weight gradient: both operands 128x1 along the tokens, from the high-precision tensors."""
    x, w, dy = _data(t=200)  # a token count that is not a multiple of 128
    y8, gx8, gw8 = _grads(True, x, w, dy)
    wd = dequantize_blocks(quantize_blocks(w)).double()
    fwd = dequantize_rows(quantize_rows(x)).double() @ wd.t()
    dgrad = dequantize_rows(quantize_rows(dy)).double() @ wd
    wgrad = dequantize_rows(quantize_rows(dy.t())).double() @ dequantize_rows(quantize_rows(x.t())).double().t()
    for got, want in ((y8, fwd), (gx8, dgrad), (gw8, wgrad)):
        want_bf16 = want.to(torch.bfloat16).double()
        assert float((got.double() - want_bf16).norm() / want_bf16.norm()) < 4e-3  # one bfloat16 rounding apart at most
        assert float((got.double() - want).norm() / want.norm()) < 4e-3


def _two_ranges(t: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Every other channel 2^-20 of the rest: a 1x128 tile (one token, 128 channels) flushes the
    small ones to zero, a 128x1 tile (one channel, 128 tokens) keeps them."""
    return (torch.randn(t, k, generator=g) * torch.tensor([1.0, 2.0**-20]).repeat(k // 2)).to(torch.bfloat16)


def test_the_weight_gradient_uses_128x1_groups_along_the_tokens() -> None:
    """The weight gradient of the small channels is there (128x1 tiles along the tokens, from the
    high-precision x); re-using the forward's 1x128 tiles of x would make it zero."""
    g = torch.Generator().manual_seed(7)
    x, w = _two_ranges(256, 256, g), (torch.randn(128, 256, generator=g) * 0.05).to(torch.bfloat16)
    dy = torch.randn(256, 128, generator=g).to(torch.bfloat16)
    _, _, gw8 = _grads(True, x, w, dy)
    small = slice(1, None, 2)
    exact = (dy.double().t() @ x.double())[:, small]
    right = (dequantize_rows(quantize_rows(dy.t())).double() @ dequantize_rows(quantize_rows(x.t())).double().t())[:, small]
    wrong = (dequantize_rows(quantize_rows(dy)).double().t() @ dequantize_rows(quantize_rows(x)).double())[:, small]
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert rel(gw8[:, small], right) < 4e-3 and rel(gw8[:, small], exact) < 0.05
    assert bool((wrong == 0).all())  # the small channels' gradient lost


def test_the_weight_gradient_is_deferred_to_the_w_split() -> None:
    x, w, dy = _data()
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    queue = WeightGradQueue()
    with deferring(queue):
        linear(xl, wl, fp8=BE).backward(dy)
    assert wl.grad is None and xl.grad is not None and len(queue) == 1
    queue.run()
    assert torch.equal(wl.grad, _grads(True, x, w, dy)[2])


def test_heads_merged_as_the_bfloat16_linear_merges_them() -> None:
    g = torch.Generator().manual_seed(3)
    o = torch.randn(2, 4, 8, 64, generator=g).to(torch.bfloat16)  # [batch, heads, seq, head_dim]
    w = (torch.randn(128, 256, generator=g) * 0.05).to(torch.bfloat16)
    merged = o.transpose(1, 2).flatten(-2).contiguous()
    a, b = o.clone().requires_grad_(), merged.clone().requires_grad_()
    ya, yb = linear(a, w, heads=True, fp8=BE), linear(b, w, fp8=BE)
    assert torch.equal(ya, yb)
    dy = torch.randn(ya.shape, generator=g).to(torch.bfloat16)
    ya.backward(dy)
    yb.backward(dy)
    assert torch.equal(a.grad.transpose(1, 2).flatten(-2), b.grad)


def test_grouped_fp8_linear_against_bfloat16_and_its_weight_gradient_per_group() -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(3, 256, 128, generator=g) * 0.06).to(torch.bfloat16)
    offs = torch.tensor([90, 90, 300])
    dy = torch.randn(300, 128, generator=g).to(torch.bfloat16)
    for grad, bound in ((torch.ones_like(dy), 30.0), (dy, 25.0)):  # as the dense test's
        outs = []
        for fp8 in (True, False):
            xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = grouped_linear(xl, wl, offs, BE, (), fp8)
            y.backward(grad)
            outs.append((y.detach(), xl.grad, wl.grad))
        (y8, gx8, gw8), (y, gx, gw) = outs
        assert sqnr_db(y8, y) >= 25.0 and sqnr_db(gx8, gx) >= bound and sqnr_db(gw8[[0, 2]], gw[[0, 2]]) >= bound
    assert bool((gw8[1] == 0).all())  # the empty group
    # group 2's weight gradient: its 210 rows tiled from its own first row
    want = dequantize_rows(quantize_rows(x[90:].t())).double() @ dequantize_rows(quantize_rows(dy[90:].t())).double().t()
    assert float((gw8[2].double() - want).norm() / want.norm()) < 4e-3


def test_routed_experts_take_their_input_and_output_gradient_as_fp8_values() -> None:
    """fp8_input / fp8_grad: the weight gradient reads the FP8 values of the input and of the
    output gradient (what travels), so a row gives the same whether it travelled or not."""
    g = torch.Generator().manual_seed(5)
    x = _two_ranges(64, 128, g)  # the FP8 values differ from what a 128x1 tile of x would keep
    w = (torch.randn(1, 128, 128, generator=g) * 0.1).to(torch.bfloat16)
    offs = torch.tensor([64])
    dy = _two_ranges(64, 128, g)
    got = []
    for rows_of in (x, dequantize_rows(quantize_rows(x)).to(torch.bfloat16)):  # the input as it is, or its FP8 values
        for grad in (dy, dequantize_rows(quantize_rows(dy)).to(torch.bfloat16)):
            wl = w.clone().requires_grad_()
            grouped_linear(rows_of.clone().requires_grad_(), wl, offs, BE, (), True, fp8_input=True, fp8_grad=True).backward(grad)
            got.append(wl.grad)
    assert all(torch.equal(got[0], other) for other in got[1:])
    wl = w.clone().requires_grad_()
    grouped_linear(x.clone().requires_grad_(), wl, offs, BE, (), True).backward(dy)
    assert not torch.equal(wl.grad, got[0])  # without them: the high-precision tensors


# ---------------------------------------------------------------------------- the model's Linears
def _cfg(**model: object) -> object:
    base = {"arch": "deepseek_v3", "hidden": 128, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 128, "moe_hidden": 128,
            "n_experts": 4, "top_k": 2, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
            "v_head_dim": 64, "dtype": "bfloat16", "seq_len": 16, "mtp_layers": 1}
    base.update(model)
    return load_config({"model": base, "train": {"fp8": "deepseek"}, "backend": "cpu"})


def test_deepseek_v3_linears_in_fp8_and_what_stays_high_precision() -> None:
    c = _cfg()
    blocks = build_blocks(c.model, [0], 1, ExpertParallel(CPUBackend()), seed=0)
    kept = enable_fp8(blocks, BE)
    names = {lin.name: lin.eligible for lin in fp8_linears(blocks)}
    # every layer (the prediction module's too): MLA's down and up projections, the output projection,
    # the dense FFN, the shared and the routed experts
    for i in (0, 1, 2):
        for n in ("attn.q_a", "attn.q_b", "attn.kv_b", "attn.wo"):
            assert names[f"layers.{i}.{n}"], n
        assert names[f"layers.{i}.attn.kv_a"] is False  # 128 -> 128 + 64 (as DeepSeek-V3's 7168 -> 512 + 64)
    assert names["layers.0.ffn.gate_up"] and names["layers.1.moe.shared.down"] and names["layers.2.moe.experts"]
    assert [lin.name for lin in kept] == ["layers.0.attn.kv_a", "layers.1.attn.kv_a", "layers.2.attn.kv_a"]
    b = blocks[0]
    assert b.layers["0"].attn.q_b.fp8 is BE and b.layers["1"].moe.experts.fp8 is True
    assert b.layers["0"].attn.kv_a.fp8 is None
    # kept high precision: the embedding, the head, the routers, the norms, the prediction module's eh_proj
    assert b.layers["2"].eh_proj.fp8 is None and b.head.fp8 is None
    assert not any(n.endswith(("router", "eh_proj")) for n in names)
    assert b.layers["1"].moe.dispatch_wire is not None and b.layers["1"].moe.combine_wire is not None


def test_qwen3_moe_q_k_v_o_in_fp8() -> None:
    c = load_config({"model": {"arch": "qwen3_moe", "hidden": 128, "n_layers": 1, "n_dense": 0, "n_heads": 2, "n_kv_heads": 1, "head_dim": 128,
                               "moe_hidden": 128, "n_experts": 4, "top_k": 2, "dtype": "bfloat16", "seq_len": 16},
                     "train": {"fp8": "deepseek"}, "schedule": {"name": "1f1b", "microbatches": 1}, "backend": "cpu"})
    eligible, kept = plan(c.model)
    assert sorted(lin.name for lin in eligible) == ["layers.0.attn.wk", "layers.0.attn.wo", "layers.0.attn.wq", "layers.0.attn.wv", "layers.0.moe.experts"]
    assert kept == []


def test_a_fused_gate_up_needs_each_half_a_multiple_of_128() -> None:
    eligible, kept = plan(_cfg(ffn_hidden=192, moe_hidden=64, mtp_layers=0).model)  # 2 x 192 = 384 and 2 x 64 = 128: halves straddle
    assert {lin.name for lin in kept} >= {"layers.0.ffn.gate_up", "layers.0.ffn.down", "layers.1.moe.experts", "layers.1.moe.shared.gate_up"}


def test_none_eligible_is_refused_and_the_rest_is_said_once() -> None:
    small = _cfg(hidden=64, ffn_hidden=64, moe_hidden=32, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    (line,) = fp8_problems(small.model, "deepseek")
    assert line.startswith("train.fp8: deepseek, but no Linear of this model has every width a multiple of 128 (layers.*.attn.q_a (64 -> 32)")
    assert fp8_problems(_cfg().model, "deepseek") == [] and fp8_problems(small.model, "off") == []
    note = fp8_note(_cfg().model, "deepseek")
    assert note == "train.fp8: 20 Linears run in FP8; 3 stay in bfloat16 (a width not a multiple of 128): layers.*.attn.kv_a (128 -> 192)"
    assert fp8_note(_cfg(kv_lora_rank=96).model, "off") is None


@pytest.mark.parametrize("key,value,expect", [
    ("model.dtype", "float32", "model.dtype: float32; train.fp8: deepseek trains in bfloat16 against float32 master weights"),
    ("train.master_dtype", "bfloat16", "train.master_dtype: bfloat16; train.fp8: deepseek trains in bfloat16 against float32 master weights"),
])
def test_fp8_needs_bfloat16_with_float32_master(key: str, value: str, expect: str) -> None:
    from portapipe.config import ConfigError

    with pytest.raises(ConfigError) as err:
        load_config({"model": {"dtype": "bfloat16"}, "train": {"fp8": "deepseek"}}, [f"{key}={value}"])
    assert [p for p in err.value.problems if p.startswith(key)] == [expect + " (DeepSeek-V3's recipe): set model.dtype: bfloat16 and "
                                                                   "train.master_dtype: auto (or float32), or train.fp8: off"]


def test_fp8_off_in_yaml_is_the_word_off() -> None:
    assert load_config({}, ["train.fp8=off"]).train.fp8 == "off"
    from portapipe.config import ConfigError

    with pytest.raises(ConfigError, match="train.fp8"):
        load_config({}, ["train.fp8=e5m2"])
