"""The planner's shape of each architecture and of FP8: DeepSeek-V3 as published counts 671B
parameters (37B activated per token); train.fp8 prices the recipe's GEMMs at the FP8 rate, its
quantization as memory traffic and the dispatched rows in their wire format; what cannot be
modelled is refused in one line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from portapipe.cli import main
from portapipe.config import load_config
from portapipe.config.setup import Setup, shape_of
from portapipe.fp8.dispatch import row_bytes
from portapipe.models.fp8_layers import plan as fp8_plan
from portapipe.plan.profile import ProfileError
from portapipe.plan.programs import Programs, StageSpec
from portapipe.plan.published import H800, published
from portapipe.plan.shape import attention_linears, block_params, flops, fp8_flops, quantize_bytes

ROOT = Path(__file__).resolve().parents[1]
V3 = ROOT / "examples" / "plan" / "deepseek_v3.yaml"
DEEPSEEK, QWEN = ROOT / "examples" / "deepseek_v3.yaml", ROOT / "examples" / "qwen3_moe.yaml"
FP8 = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=256", "model.q_lora_rank=128",
       "model.kv_lora_rank=128", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=32", "train.fp8=deepseek"]


def test_deepseek_v3_as_published_counts_671b_parameters_37b_activated() -> None:
    """The main model (embedding, 61 layers, final norm and head; the prediction module apart) as
    the report counts it: 671B in all, 37B activated (8 of 256 routed experts per token)."""
    s = Setup.from_config(load_config(V3)).shape
    main_model = block_params(s, range(s.n_layers), True, False, s.n_experts)
    total = main_model.elements + s.vocab_size * s.hidden + s.hidden  # the head and final norm
    activated = total - main_model.expert_elements * (1 - s.top_k / s.n_experts)
    assert round(total / 1e9) == 671
    assert 37e9 <= activated < 38e9


@pytest.mark.parametrize("example, extra", [(DEEPSEEK, []), (DEEPSEEK, ["model.q_lora_rank=0"]), (QWEN, []), (QWEN, ["model.n_kv_heads=1"])])
def test_the_shapes_attention_linears_are_the_models(example: Path, extra: list[str]) -> None:
    """(in, out) of each attention Linear, as the built model's weights are."""
    cfg = load_config(example, ["data.format=bytes", "data.path=null", *extra])
    eligible, kept = fp8_plan(cfg.model)
    built = {lin.name.split(".")[-1]: (lin.inputs, lin.outputs[0]) for lin in eligible + kept if lin.name.startswith("layers.0.attn.")}
    assert built == {name: (i, o) for name, i, o in attention_linears(Setup.from_config(cfg).shape)}


def test_fp8_prices_the_recipes_gemms_at_the_fp8_rate() -> None:
    """The published profile under train.fp8: per token, the FP8 GEMMs' work at the FP8 peak, the
    rest at BF16's, the quantization's bytes at HBM's, each at the profile's efficiencies; the
    router (BF16 here) is not among them, and the dispatched rows cross in the FP8 wire format."""
    cfg = load_config(DEEPSEEK, ["data.format=bytes", "data.path=null", *FP8])
    s = Setup.from_config(cfg).shape
    assert s.fp8
    h, w = s.hidden, s.moe_hidden
    linears = {name: (i, o) for name, i, o in attention_linears(s)}
    eligible = {n: io for n, io in linears.items() if io[0] % 128 == 0 and io[1] % 128 == 0}
    assert set(eligible) == {lin.name.split(".")[-1] for lin in fp8_plan(cfg.model)[0] if ".attn." in lin.name}  # the model's own choice
    assert fp8_flops(s, "attention", "F") == sum(2 * i * o for i, o in eligible.values())
    assert fp8_flops(s, "experts", "B") == 6 * h * w
    prof = published("h800", s)
    eff = H800["matmul_efficiency"]
    bf16, fp8, hbm = H800["bf16_flops"] * eff, H800["fp8_flops"] * eff, H800["hbm_bytes_s"] * H800["memory_efficiency"]
    for part, phase in (("attention", "F"), ("attention", "W"), ("experts", "F"), ("dense", "B")):
        work, quick = flops(s, part, phase), fp8_flops(s, part, phase)
        assert 0 < quick < work or part == "experts"
        want = (work - quick) / bf16 + quick / fp8 + quantize_bytes(s, part, phase) / hbm
        assert prof.parts["off"][part][phase].per_unit == pytest.approx(want, rel=1e-12)
    # at DeepSeek-V3's widths the experts cost less in FP8 (at these small ones the quantization's
    # traffic outweighs the faster GEMMs)
    v3 = load_config(V3, ["train.fp8=deepseek"])
    fast, slow = (published("h800", shape_of(v3.model, t, v3.backend)) for t in (v3.train, None))
    assert fast.parts["off"]["experts"]["F"].per_unit < 0.6 * slow.parts["off"]["experts"]["F"].per_unit
    # rows on the wire: E4M3 values, a float32 scale per 128, the router weight in bfloat16
    progs = Programs(s, 64, 64 * s.top_k, ep=2)
    spec = StageSpec((1,), ("off",), True, False)
    sent = {op[1][0]: op[2] for op in progs.forward(spec) + progs.backward(spec, "B") if op[0] == "I"}
    assert sent["d"] == 64 * s.top_k * row_bytes(h, torch.bfloat16)
    assert sent["c'"] == 64 * s.top_k * row_bytes(h, None)  # the gradient towards the experts: FP8
    assert sent["d'"] == 64 * s.top_k * (h + 1) * 2  # away from them: bfloat16
    assert sent["d"] / (64 * s.top_k * (h + 1) * 2) == pytest.approx((h + 4 * math.ceil(h / 128) + 2) / (2 * h + 2))


def test_a_profile_with_other_fp8_is_refused(tmp_path: Path) -> None:
    cfg = load_config(DEEPSEEK, ["data.format=bytes", "data.path=null", *FP8])
    fp8 = Setup.from_config(cfg).shape
    plain = published("h800", shape_of(cfg.model, None, cfg.backend))
    with pytest.raises(ProfileError, match="train.fp8"):
        plain.for_shape(fp8)
    path = tmp_path / "plain.json"
    plain.save(path)
    assert main(["plan", str(DEEPSEEK), "--devices", "4", "--profile", str(path), *sum((["--set", o] for o in FP8), [])]) == 2


def test_float64_hugging_face_attention_is_refused_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(QWEN), "--devices", "4", "--profile", "h800", "--set", "model.dtype=float64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.dtype: float64" in err[0] and "qwen3_moe" in err[0]


QWEN_FP8 = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.head_dim=64", "train.fp8=deepseek"]


@pytest.mark.parametrize("option", ["memory.recompute=norms", "memory.fp8_activations=true"])
@pytest.mark.parametrize("example, fp8", [(DEEPSEEK, FP8), (QWEN, QWEN_FP8)], ids=["deepseek_v3", "qwen3_moe"])
def test_the_hugging_face_attentions_plan_the_norms_recompute_and_fp8_activations(example: Path, fp8: list[str], option: str) -> None:
    """MLA and GQA: a config asking for the norms' recompute or FP8-cached activations plans, and
    the planner offers both among its candidates."""
    from portapipe.plan.planner import enumerate_setups

    data = ["data.format=bytes", "data.path=null"]
    argv = ["plan", str(example), "--devices", "4", "--profile", "h800", "--top", "1", *sum((["--set", o] for o in data + fp8 + [option]), [])]
    assert main(argv) == 0
    offered = list(enumerate_setups(Setup.from_config(load_config(example, data + fp8)), 4))
    assert any(x.recompute_norms for x in offered) and any(x.fp8_activations for x in offered)


def test_mla_on_the_cpu_runs_the_math_attention_and_on_cuda_the_fused_one() -> None:
    """The attention part's bytes follow the backend's kernels: the math path keeps the
    probabilities (heads x sequence per token, float32), the fused kernel does not."""
    from portapipe.plan.shape import saved_bytes

    cfg = load_config(DEEPSEEK, ["data.format=bytes", "data.path=null"])
    cpu, cuda = shape_of(cfg.model, cfg.train, "cpu"), shape_of(cfg.model, cfg.train, "cuda")
    assert not cpu.fused_unequal_heads and cuda.fused_unequal_heads
    T, H, seq = 256, cpu.n_heads, cpu.seq_len
    grow = saved_bytes(cpu, "attention", "off", T, T, seq=2 * seq) - saved_bytes(cpu, "attention", "off", T, T, seq=seq)
    assert grow == T * H * seq * 4
    assert saved_bytes(cuda, "attention", "off", T, T, seq=2 * seq) == saved_bytes(cuda, "attention", "off", T, T, seq=seq)


def test_profile_times_the_fp8_gemms_as_training_runs_them_and_says_what_it_cannot() -> None:
    """`portapipe profile` of a train.fp8 config builds its parts with the recipe on (on the CPU:
    the emulated FP8 matmul) and says that a device's FP8 rate is not measured there."""
    from portapipe.backends.cpu import CPUBackend
    from portapipe.commands.profile import fp8_note
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.plan.measure_parts import block_for

    cfg = load_config(DEEPSEEK, ["data.format=bytes", "data.path=null", "parallel.pp=1", "parallel.ep=1", *FP8])
    block = block_for(cfg, ExpertParallel(CPUBackend()), "off")
    layer = block.layers["1"]
    assert layer.attn.q_a.fp8 is not None and layer.moe.experts.fp8
    assert "emulated" in fp8_note(cfg) and "--published h800" in fp8_note(cfg)
    plain = load_config(DEEPSEEK, ["data.format=bytes", "data.path=null"])
    assert fp8_note(plain) is None
