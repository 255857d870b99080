"""FP8-cached activations (``memory.fp8_activations``): what each FP8 Linear keeps is the forward's
1x128 FP8 rows, re-tiled 128x1 for the weight gradient exactly as an independent float64 re-tiling
written here does; the forward (the loss) is unchanged bit for bit; the gradients stay within a
measured SQNR of the bfloat16-cached FP8 step; every memory option, the F&B overlap and EPLB / LPLB
give the cached step's gradients; the rules refuse it without train.fp8; the accounting sees the
smaller bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.backends.scaled_mm import sqnr_db
from portapipe.config import ConfigError, load_config
from portapipe.fp8.quantize import dequantize_rows, quantize_rows
from portapipe.memory.accounting import SavedActivations
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.fp8_layers import enable_fp8
from portapipe.models.functions import swiglu, swiglu_fp8_kept
from portapipe.models.linear import Linear
from portapipe.models.moe import build_blocks
from portapipe.ranks.launch import run_ranks

BE = CPUBackend()


# ------------------------------------------------------------------ an independent re-tiling
def _e4m3(v: torch.Tensor) -> torch.Tensor:
    """float64 ``v`` rounded to E4M3 from the format's definition: 3 mantissa bits, normal from
    2^-6, subnormal steps of 2^-9 below, ties to even, saturated at 448."""
    a = v.abs().clamp(max=448.0)
    e = torch.floor(torch.log2(a.clamp(min=2.0**-6)))
    step = torch.exp2(e - 3)
    return torch.sign(v) * torch.round(a / step) * step  # torch.round: half to even


def _scale(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with amax <= 448 s, at least 2^-124 (float64)."""
    return torch.exp2(torch.ceil(torch.log2((amax / 448.0).clamp(min=2.0**-124))))


def _tiles_f64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, per-element scales) of float64 ``x[R, C]`` quantized in 1x128 tiles along C."""
    r, c = x.shape
    s = _scale(x.abs().view(r, c // 128, 128).amax(-1)).repeat_interleave(128, -1)
    return _e4m3(x / s), s


def _mixed(t: int, k: int, seed: int) -> torch.Tensor:
    """Tokens and channels of magnitudes 2^-6 .. 2^6 apart, so that a token's 1x128 tile and a
    channel's 128x1 tile get different scales (equal scales re-tile to the same bytes)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.exp2(torch.randint(-6, 7, (t, 1), generator=g).double())
    cols = torch.exp2(torch.randint(-3, 4, (1, k), generator=g).double())
    return (torch.randn(t, k, generator=g, dtype=torch.float64) * rows * cols).to(torch.bfloat16)


def test_the_re_tiling_is_an_independent_float64_re_tiling_bit_for_bit() -> None:
    """1x128 -> dequantize -> 128x1 along the tokens, as the weight gradient reads a cached input:
    the E4M3 values and scales of a float64 re-tiling written from the format's definition. It is
    exact wherever the 128x1 scale is not larger than the 1x128 one; elsewhere only values that
    the larger scale pushes below E4M3's normal range (2^-6 s) round again."""
    x = _mixed(384, 256, 0)
    q1, s1 = _tiles_f64(x.double())
    once = q1 * s1  # the cached input as the backward dequantizes it
    q2t, s2t = _tiles_f64(once.t().contiguous())
    got = quantize_rows(dequantize_rows(quantize_rows(x)).to(torch.bfloat16).t())  # what gemm.weight_grad is given
    assert torch.equal(got.data.double(), q2t) and torch.equal(got.scale.double().repeat_interleave(128, -1), s2t)
    back, s2 = (q2t * s2t).t(), s2t.t()
    moved = back != once
    assert bool(moved.any())  # the data does meet the rounding case
    assert bool((s2[moved] > s1[moved]).all()) and bool((once[moved].abs() < 2.0**-6 * s2[moved]).all())
    assert bool((back[s2 <= s1] == once[s2 <= s1]).all())


# --------------------------------------------------------------------- one Linear, one FFN
def _linear_grads(cache: bool, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    lin = Linear(x.shape[-1], dy.shape[-1], torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(dy.shape[-1], x.shape[-1], generator=torch.Generator().manual_seed(1)) * 0.05)
    lin.fp8, lin.fp8_cache = BE, cache
    xl = x.clone().requires_grad_()
    tracker = SavedActivations(ignore=lin.parameters())
    with tracker.track():
        y = lin(xl)
    saved = tracker.live_bytes
    y.backward(dy)
    return y.detach(), xl.grad, lin.weight.grad, saved


def test_a_cached_linear_keeps_fp8_rows_and_its_weight_gradient_is_that_of_their_values() -> None:
    """Output and input gradient bit for bit; the weight gradient is the bfloat16-cached layer's
    applied to the dequantized 1x128 rows, bit for bit, within 30 dB of the bfloat16-cached one;
    the bytes kept are the E4M3 values and the float32 scales (1 + 4/128 per element, not 2)."""
    x, dy = _mixed(256, 384, 2).view(2, 128, 384), torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    y, gx, gw, kept = _linear_grads(True, x, dy)
    y0, gx0, gw0, kept0 = _linear_grads(False, x, dy)
    assert torch.equal(y, y0) and torch.equal(gx, gx0)
    assert not torch.equal(gw, gw0) and sqnr_db(gw, gw0) >= 30.0
    x_fp8 = dequantize_rows(quantize_rows(x)).to(torch.bfloat16)
    assert torch.equal(gw, _linear_grads(False, x_fp8, dy)[2])
    assert kept0 == x.numel() * 2 and kept == x.numel() + x.numel() // 128 * 4


def test_an_input_changed_in_place_after_its_fp8_copy_is_quantized_again() -> None:
    """The FP8 rows shared by the Linears reading one tensor are made once per version of it: a
    Linear reading the tensor after it was written in place keeps the new values' rows, so its
    weight gradient equals a fresh layer's on a fresh copy of the changed input, bit for bit."""
    x, dy = _mixed(256, 384, 4).view(2, 128, 384), torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    lin = Linear(384, 256, torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(256, 384, generator=torch.Generator().manual_seed(1)) * 0.05)
    lin.fp8, lin.fp8_cache = BE, True
    lin(x)  # the FP8 copy of x's values now exists
    with torch.no_grad():
        x.mul_(-3.0).add_(1.0)  # written in place: new values, new scales
    lin(x).backward(dy)
    assert not torch.equal(lin.weight.grad, _linear_grads(True, _mixed(256, 384, 4).view(2, 128, 384), dy)[2])  # the old values' gradient differs
    assert torch.equal(lin.weight.grad, _linear_grads(True, x.clone(), dy)[2])


def test_the_swiglu_keeps_its_input_in_fp8_and_the_down_projection_remakes_its_own() -> None:
    """The activation's output bit for bit; its gradient is the formula's at gu's FP8 values; the
    down projection's input is remade from those same FP8 rows (one copy of them is kept)."""
    g = torch.Generator().manual_seed(4)
    gu, w = (torch.randn(64, 256, generator=g) * 3).to(torch.bfloat16), torch.rand(64, generator=g).to(torch.bfloat16)
    grad = torch.randn(64, 128, generator=g).to(torch.bfloat16)
    a, wa = gu.clone().requires_grad_(), w.clone().requires_grad_()
    tracker = SavedActivations()
    with tracker.track():
        out, remade = swiglu_fp8_kept(a, 128, wa)
    out.backward(grad)
    b, wb = dequantize_rows(quantize_rows(gu)).to(torch.bfloat16).requires_grad_(), w.clone().requires_grad_()
    ref = swiglu(b, 128, wb)
    ref.backward(grad)
    assert torch.equal(out, swiglu(gu, 128, w)) and torch.equal(a.grad, b.grad) and torch.equal(wa.grad, wb.grad)
    assert torch.equal(remade.fn(*remade.tensors), ref.detach())
    assert tracker.peak_bytes == gu.numel() + gu.numel() // 128 * 4 + w.numel() * 2


FP8_MODEL = {"arch": "deepseek_v3", "hidden": 128, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 128, "moe_hidden": 128,
             "n_experts": 4, "top_k": 2, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
             "v_head_dim": 64, "dtype": "bfloat16", "seq_len": 16}


def _cfg(**sections: dict[str, Any]) -> Any:
    raw = {"backend": "cpu", "parallel": {"ep": 2}, "schedule": {"name": "dualpipev", "microbatches": 2}, "model": dict(FP8_MODEL),
           "train": {"fp8": "deepseek", "micro_batch_size": 2}, "memory": {"fp8_activations": True}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw)


def _cached_modules(model: dict[str, Any]) -> list[str]:
    cfg = _cfg(model=model)
    with torch.device("meta"):
        blocks = build_blocks(cfg.model, [0], 1, ExpertParallel(CPUBackend()), seed=0)
    enable_fp8(blocks, BE, cache=True)
    return sorted(n for n, m in blocks[0].named_modules() if getattr(m, "fp8_cache", False))


def test_which_modules_keep_fp8_activations() -> None:
    """Every FP8 projection but the attention output one (its input stays bfloat16); the attention
    input's readers only when all of them are FP8 (a 192-wide kv_a keeps that input in bfloat16:
    an FP8 copy would add bytes); the shared expert's gate / up never (the router keeps its input),
    its activation yes."""
    names = _cached_modules({})  # kv_a: 128 -> 128 + 64, in bfloat16: the attention's input stays so
    assert "layers.0.attn.wo" not in names and "layers.1.moe.shared.gate_up" not in names
    assert "layers.0.attn.q_a" not in names and "layers.0.attn.kv_a" not in names
    want = {"layers.0.attn.q_b", "layers.0.attn.kv_b", "layers.0.ffn", "layers.0.ffn.gate_up", "layers.1.moe.shared", "layers.1.moe.experts"}
    assert want <= set(names) and not [n for n in names if n.endswith(("down", "wo"))]
    wide = _cached_modules({"kv_lora_rank": 192})  # kv_a: 128 -> 192 + 64 in FP8 (kv_b, 192 wide, not)
    assert {"layers.0.attn.q_a", "layers.0.attn.kv_a"} <= set(wide) and "layers.0.attn.kv_b" not in wide


def test_refused_without_fp8_in_one_line() -> None:
    with pytest.raises(ConfigError, match=r"memory.fp8_activations: true .* train.fp8 is off: set train.fp8: deepseek"):
        _cfg(train={"fp8": "off"})


# ------------------------------------------------------------------------- whole steps
@pytest.mark.multiproc
def test_the_loss_is_unchanged_and_the_gradients_within_the_measured_bound() -> None:
    """Against the bfloat16-cached FP8 step (pp 1 x ep 2, DualPipeV): the loss bit for bit (the
    forward is the same), every gradient changed only by the re-tiling and the SwiGLU's FP8
    input: at least 20 dB (measured 2026-11-28: 24.2 dB in the worst tensor, the dense FFN's down
    projection, 27 dB the median; docs/fp8.md); the head's gradient unchanged (it is not FP8);
    zero-memory level0 / level1, recompute moe and full, the F&B overlap off give the cached step's
    gradients bit for bit; with EPLB's redundant experts the loss is again the bfloat16-cached
    step's (``portapipe verify`` with it: tests/test_fp8_dispatch.py)."""
    from portapipe.verify.pipelined import rank_step

    eplb = {"kind": "eplb", "redundant": 1, "interval": 1000}
    configs = [_cfg(memory={"fp8_activations": False}), _cfg(), _cfg(memory={"zero_memory": "level0"}), _cfg(memory={"zero_memory": "level1"}),
               _cfg(memory={"recompute": "moe"}), _cfg(schedule={"overlap": False}), _cfg(memory={"recompute": "full"}),
               _cfg(memory={"fp8_activations": False}, balancer=eplb), _cfg(balancer=eplb)]
    per_rank = run_ranks(rank_step, 2, [c.to_dict() for c in configs], False)
    for rank in per_rank:
        plain, cached = rank[0], rank[1]
        assert cached["loss"] == plain["loss"] and rank[8]["loss"] == rank[7]["loss"]
        worst = min(sqnr_db(cached["grads"][n], g) for n, g in plain["grads"].items() if float(g.abs().sum()) > 0)
        assert 20.0 <= worst < float("inf"), worst
        assert torch.equal(cached["grads"]["head.weight"], plain["grads"]["head.weight"])
        for other in rank[2:7]:
            assert other["loss"] == cached["loss"]
            for name, g in cached["grads"].items():
                assert torch.equal(other["grads"][name], g), name


# ------------------------------------------------------------------ the memory model's bytes
PART_OPTIONS = {"off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"}, "recompute_moe": {"recompute": "moe"}}


@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("option", list(PART_OPTIONS))
@pytest.mark.parametrize("shape", [[], ["model.ffn_hidden=192", "model.n_shared=2"]])
def test_each_fp8_part_saves_what_the_memory_model_says(shape: list[str], option: str, cached: bool) -> None:
    """Under train.fp8, with and without FP8-cached activations, per part call: the accounting's
    bytes equal shape.saved_bytes plus fp8_bytes.saved_delta (a 192-wide dense FFN stays in
    bfloat16; two shared experts make one 256 wide)."""
    from pathlib import Path

    from portapipe.config import MemoryConfig
    from portapipe.memory.policy import configure
    from portapipe.plan.fp8_bytes import saved_delta
    from portapipe.plan.shape import Shape, saved_bytes
    from portapipe.scheduling.overlap import run
    from tests.test_plan_memory import part_bytes

    example = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
    cfg = load_config(example, ["parallel.pp=1", "parallel.ep=1", "schedule.name=1f1b", "train.micro_batch_size=2", "model.seq_len=16",
                                "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=128", "model.dtype=bfloat16",
                                "train.fp8=deepseek", f"memory.fp8_activations={str(cached).lower()}", *shape])
    m, s = cfg.model, Shape.of(cfg.model)
    blocks = build_blocks(m, [0], 1, ExpertParallel(CPUBackend()), 1)
    enable_fp8(blocks, BE, cached)
    configure(blocks, MemoryConfig(**PART_OPTIONS[option]))
    block = blocks[0]
    x = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=torch.Generator().manual_seed(0))
    parts, tape, out = part_bytes(block, x, x.clone())
    checked = 0
    for part, units, got in parts:
        want = saved_bytes(s, part, option, units, units) + saved_delta(s, cached, part, option, units, units, 0)  # one EP rank: no row travels
        if part in ("attention", "dense"):
            want += s.rope_bytes()
        assert got == want, (part, option, got, want)
        checked += 1
    assert checked >= 4
    run(tape.backward(out, torch.ones_like(out)))


WIDE = ["model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=128", "model.dtype=bfloat16", "model.seq_len=32",
        "train.micro_batch_size=2", "train.fp8=deepseek"]
STEP_SETUPS = {
    "1f1b-fp8": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b"],
    "1f1b-fp8-cached": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "memory.fp8_activations=true"],
    "dualpipev-fp8-cached-level1": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "memory.fp8_activations=true",
                                    "memory.zero_memory=level1"],
    # with the norms' recompute: the norms' outputs go, the FP8 rows the projections keep stay
    "1f1b-fp8-cached-norms": ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "memory.fp8_activations=true",
                              "memory.recompute=norms"],
    "dualpipev-fp8-cached-norms-moe": ["parallel.pp=2", "parallel.ep=1", "schedule.name=dualpipev", "memory.fp8_activations=true",
                                       "memory.recompute=[norms, moe]"],
}


@pytest.mark.multiproc
def test_the_memory_model_predicts_a_real_fp8_step_to_the_byte() -> None:
    """Per pipeline rank, the memory model's peak saved bytes equal the accounting's over a real
    step (one EP rank: no routing noise), FP8 with and without cached activations; the cached
    step keeps less."""
    from pathlib import Path

    from portapipe.config.setup import Setup
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.scheduling.executor import build_schedule
    from tests.test_plan_memory import _step_peaks  # one real step's peak per rank, tracked as the memory tests track it

    example = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
    cfgs = {n: load_config(example, WIDE + o) for n, o in STEP_SETUPS.items()}
    per_rank = run_ranks(_step_peaks, 2, {n: c.to_dict() for n, c in cfgs.items()}, wall_timeout_s=300)
    for name, cfg in cfgs.items():
        report = MemoryModel(Setup.from_config(cfg), build_schedule(cfg)).report()
        for r in per_rank:
            pp_rank, peak = r[name]["pp_rank"], r[name]["saved_peak"]
            assert report.ranks[pp_rank].saved_peak == peak, (name, pp_rank, report.ranks[pp_rank].saved_peak, peak)
    for r in per_rank:
        assert r["1f1b-fp8-cached"]["saved_peak"] < 0.8 * r["1f1b-fp8"]["saved_peak"]


def test_the_planner_enumerates_fp8_activations_where_fp8_is_on() -> None:
    """Under train.fp8 every candidate has a twin with FP8-cached activations (labelled so, its
    overrides setting the key) whose predicted saved activations are fewer; without FP8 none is enumerated."""
    from pathlib import Path

    from portapipe.config.setup import Setup
    from portapipe.plan.planner import _Context, enumerate_setups, evaluate
    from portapipe.plan.published import published

    example = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
    cfg = load_config(example, WIDE)
    setups = list(enumerate_setups(Setup.from_config(cfg), 4))
    cached = [x for x in setups if x.fp8_activations]
    assert cached and len(cached) * 2 == len(setups) and set(setups) >= {x.replace(fp8_activations=False) for x in cached}
    assert all("fp8 activations" in x.memory_label() and x.overrides()["memory.fp8_activations"] is True for x in cached)
    ctx = _Context(published("h800", Setup.from_config(cfg).shape), lambda ep: 1.0)  # the planner's shape: train.fp8 priced
    x = next(x for x in cached if x.schedule == "1f1b" and x.pp == 2 and x.memory_label() == "fp8 activations")
    a, b = evaluate(x.replace(fp8_activations=False), None, ctx, search_zero=False), evaluate(x, None, ctx, search_zero=False)
    assert b.memory.ranks[0].saved_peak < a.memory.ranks[0].saved_peak and b.memory.peak <= a.memory.peak
    plain = load_config(example, WIDE[:-1])
    assert not any(x.fp8_activations for x in enumerate_setups(Setup.from_config(plain), 4))


def test_what_the_1x128_tiles_flushed_does_not_come_back() -> None:
    """Every other channel 2^-20 of the rest: its 1x128 tiles flush it, so with cached FP8 rows its
    weight gradient is zero, where the bfloat16-cached layer's 128x1 tiles keep it (docs/fp8.md)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(256, 256, generator=g) * torch.tensor([1.0, 2.0**-20]).repeat(128)).to(torch.bfloat16)
    dy = torch.randn(256, 128, generator=g).to(torch.bfloat16)
    small = slice(1, None, 2)
    cached, plain = _linear_grads(True, x, dy)[2], _linear_grads(False, x, dy)[2]
    assert bool((cached[:, small] == 0).all()) and bool((plain[:, small] != 0).any())


def test_verify_s_unquantized_reference_turns_both_off() -> None:
    """The float64 reference of an FP8 config with cached activations is unquantized and keeps
    nothing in FP8 (a valid config: the rule would refuse the key alone); in bfloat16 both stay."""
    from portapipe.verify.tolerance import in_dtype

    ref = in_dtype(_cfg(), "float64", backend="cpu")
    assert ref.train.fp8 == "off" and ref.memory.fp8_activations is False
    same = in_dtype(_cfg(), "bfloat16")
    assert same.train.fp8 == "deepseek" and same.memory.fp8_activations is True
