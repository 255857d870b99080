"""Recompute of norms and MLA's up-projections: the RMSNorms' outputs and MLA's queries, keys and
values are not kept for the backward but made again there; values and gradients do not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.config import ConfigError, load_config
from tests.test_zero_memory import MODEL, SCHEDULES, assert_identical, one_block, pipelined_step, verified

#: deepseek_v3 with a low-rank query projection (q_a, its norm, q_b) and without one (wq)
MLA = {**MODEL, "arch": "deepseek_v3", "kv_lora_rank": 16, "q_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
       "v_head_dim": 8, "n_groups": 1, "topk_groups": 1}
MLA_FULL_Q = {**MLA, "q_lora_rank": 0}
QWEN = {**MODEL, "arch": "qwen3_moe", "head_dim": 8, "n_kv_heads": 2}
ARCHS = {"portapipe": None, "deepseek_v3": MLA, "deepseek_v3_no_q_lora": MLA_FULL_Q, "qwen3_moe": QWEN,
         "portapipe_bf16": {**MODEL, "dtype": "bfloat16"}, "deepseek_v3_bf16": {**MLA, "dtype": "bfloat16"}}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("memory", [{"recompute": "norms"}, {"recompute": ["norms", "moe"]}, {"recompute": "norms", "zero_memory": "level1"}],
                         ids=["norms", "norms+moe", "norms+level1"])
def test_gradients_identical_to_off_bit_for_bit(arch: str, memory: dict[str, Any]) -> None:
    model = ARCHS[arch]
    assert_identical(pipelined_step(memory, model=model), pipelined_step({}, model=model))


def _held(memory: dict[str, Any], model: dict[str, Any] | None) -> dict[Any, int]:
    return pipelined_step(memory, by_part=True, model=model)["held"]


def test_portapipe_drops_the_norms_outputs_exactly() -> None:
    """The dense layer drops both norms' outputs (tokens x hidden each), the MoE layers their
    attention norm's; the FFN norm's output of an MoE layer stays (the tape, the router and the
    dispatch hold it), and nothing else changes."""
    tokens, h, item = 2 * MODEL["seq_len"], MODEL["hidden"], 8
    off, norms = _held({}, None), _held({"recompute": "norms"}, None)
    assert off["0.dense"] - norms["0.dense"] == 2 * tokens * h * item
    for layer in (1, 2):
        assert off[f"{layer}.attention"] - norms[f"{layer}.attention"] == tokens * h * item
    assert {k: v for k, v in off.items() if not str(k).endswith(("dense", "attention"))} == {
        k: v for k, v in norms.items() if not str(k).endswith(("dense", "attention"))
    }


@pytest.mark.parametrize(
    "q_lora, dtype, v_dim, kept_by_attention",
    [(True, "float64", 8, "qk"), (False, "float64", 8, "qk"), (True, "float32", 12, "qkv"), (True, "bfloat16", 12, "qkv"),
     (True, "float32", 8, "")],
)
def test_mla_drops_norms_and_up_projections_exactly(q_lora: bool, dtype: str, v_dim: int, kept_by_attention: str) -> None:
    """deepseek_v3: the input norm's output and the latent norms' outputs always; of the
    up-projections, what the attention keeps as it was given. float64 (portapipe's own attention)
    keeps the queries and keys (heads x (nope + rope) each) and a copy of the values; torch's
    fused attention, where the query/key and value widths are equal, keeps all three (the values a
    view of the up-projected keys and values, heads x (nope + v)); where they differ (DeepSeek-V3's
    192 and 128) torch falls back to its math path, which keeps scaled copies it makes itself:
    only the norms' outputs go."""
    model = {**(MLA if q_lora else MLA_FULL_Q), "dtype": dtype, "v_head_dim": v_dim}
    tokens, h, heads = 2 * model["seq_len"], model["hidden"], model["n_heads"]
    item = {"float64": 8, "float32": 4, "bfloat16": 2}[dtype]
    qk = model["qk_nope_head_dim"] + model["qk_rope_head_dim"]
    norms_out = h + model["kv_lora_rank"] + (model["q_lora_rank"] if q_lora else 0)
    up = {"": 0, "qk": 2 * heads * qk, "qkv": 2 * heads * qk + heads * (model["qk_nope_head_dim"] + v_dim)}[kept_by_attention]
    off, norms = _held({}, model), _held({"recompute": "norms"}, model)
    for layer in (1, 2):
        assert off[f"{layer}.attention"] - norms[f"{layer}.attention"] == tokens * (norms_out + up) * item
    # the dense layer's FFN norm too
    assert off["0.dense"] - norms["0.dense"] == tokens * (norms_out + up + h) * item


def test_recompute_layers_limits_the_norms_to_the_first_layers() -> None:
    block = one_block({"recompute": "norms", "recompute_layers": 2})
    assert [layer.memory is not None and layer.memory.norms is not None for layer in block.layers.values()] == [True, True, False]
    block = one_block({"recompute": ["moe", "norms"], "recompute_layers": 1})
    opts = [layer.memory for layer in block.layers.values()]
    assert opts[0].norms is not None and opts[0].recompute is None  # layer 0 is dense: norms only
    assert opts[1] is None and opts[2] is None


def test_config_takes_a_part_or_a_list_of_parts() -> None:
    assert load_config({"memory": {"recompute": ["moe", "norms"]}}).memory.recompute == "norms+moe"
    mem = load_config({"memory": {"recompute": "norms+moe"}}).memory
    assert (mem.segment, mem.norms) == ("moe", True)
    mem = load_config({"memory": {"recompute": "norms"}}).memory
    assert (mem.segment, mem.norms) == ("none", True)
    assert (load_config({"memory": {"recompute": "full"}}).memory.norms) is False


@pytest.mark.parametrize(
    "value, words",
    [
        (["norms", "full"], "full recomputes whole layers, their norms included: write full alone"),
        (["norms", "norms"], "holds norms and moe, each once"),
        ([], "holds norms and moe, each once"),
        (["attention"], "holds norms and moe, each once"),
    ],
)
def test_lists_without_effect_are_refused_in_one_line(value: list[str], words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"memory": {"recompute": value}})
    (line,) = info.value.problems
    assert line.startswith("memory.recompute") and words in line, line


def test_recompute_layers_with_norms_alone_is_accepted() -> None:
    load_config({"memory": {"recompute": "norms", "recompute_layers": 1}})
    with pytest.raises(ConfigError) as info:
        load_config({"memory": {"recompute_layers": 1}})
    assert "set norms, moe or full" in info.value.problems[0]


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "key",
    [(s, o) for s in SCHEDULES for o in ("norms", "norms_moe", "norms_level1")]
    + [("1f1b", "norms"), ("zb1p", "norms_moe"), ("dualpipev_no_w_split", "norms_level1")],
    ids=lambda k: "-".join(k),
)
def test_verify_is_exact_with_norms_recomputed(key: tuple[str, str]) -> None:
    """pp 2 x ep 2 against one float64 process: DualPipeV and interleaved (F&B pairs), 1F1B and
    ZB1P (lone actions), DualPipeV without the W split; alone, with recompute moe, with level1."""
    report = verified()[key]
    assert (report.pp, report.ep) == (2, 2)
    assert report.loss_diff == 0.0
    assert report.max_rel_grad_diff <= 1e-12
    assert report.ok, report


# ----------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("memory, option", [({"recompute": "norms"}, "off"), ({"recompute": ["norms", "moe"]}, "recompute_moe"),
                                            ({"recompute": "norms", "zero_memory": "level1"}, "level1")])
@pytest.mark.parametrize("shape", [[], ["model.dtype=float64", "model.hidden=48", "model.n_heads=3"], ["model.mtp_layers=1"]])
def test_each_part_saves_the_formula_less_the_norms(memory: dict[str, Any], option: str, shape: list[str]) -> None:
    """Per part call, the accounting's bytes equal shape.saved_bytes less plan.norm_recompute's
    dropped bytes (attention also keeps the rotary tables, counted once per layer)."""
    from portapipe.backends.cpu import CPUBackend
    from portapipe.config import MemoryConfig
    from portapipe.memory.policy import configure
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.models.moe import build_blocks
    from portapipe.plan.norm_recompute import dropped_bytes
    from portapipe.plan.shape import Shape, saved_bytes
    from portapipe.scheduling.overlap import run
    from tests.test_plan_memory import EXAMPLE, SMALL, part_bytes

    cfg = load_config(EXAMPLE, SMALL + shape)
    s = Shape.of(cfg.model)
    block = build_blocks(cfg.model, [0], 1, ExpertParallel(CPUBackend()), 1)[0]
    configure({0: block}, MemoryConfig(**memory))
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    parts, tape, out = part_bytes(block, x, x.clone())
    checked = 0
    for part, units, got in parts:
        want = saved_bytes(s, part, option, units, units) - dropped_bytes(s, part, units)
        if part in ("attention", "dense"):
            want += s.rope_bytes()
            checked += 1
        assert got == want, (part, got, want)
    assert checked >= 2
    run(tape.backward(out, torch.ones_like(out)))


def test_the_memory_model_counts_the_norms_and_the_planner_offers_them() -> None:
    """The model's saved peak drops by the norms' bytes of the micro-batches in flight; the time
    model prices their recompute in the backward (a little more time, never less); the planner
    enumerates norms alone, with moe and with level1."""
    from portapipe.config.setup import Setup
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.plan.planner import MEMORY_OPTIONS
    from portapipe.scheduling.executor import build_schedule
    from tests.test_plan_memory import EXAMPLE

    base = ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "model.seq_len=32"]
    off_cfg = load_config(EXAMPLE, base)
    norms_cfg = load_config(EXAMPLE, base + ["memory.recompute=norms"])
    off, norms = Setup.from_config(off_cfg), Setup.from_config(norms_cfg)
    assert norms.recompute_norms and norms.recompute == "none" and norms.memory_label() == "recompute norms"
    assert norms.overrides()["memory.recompute"] == "norms"
    sched = build_schedule(off_cfg)
    a, b = MemoryModel(off, sched).report(), MemoryModel(norms, sched).report()
    m = off_cfg.model
    tokens = off_cfg.train.micro_batch_size * m.seq_len
    # rank 0 of 1F1B holds pp micro-batches of its block at the peak: per micro-batch, every layer's attention
    # norm and the dense layers' FFN norm
    layers = m.n_layers // 2
    dense = min(m.n_dense, layers)
    per_mb = tokens * (layers + dense) * m.hidden * {"float32": 4, "bfloat16": 2, "float64": 8}[m.dtype]
    assert a.ranks[0].saved_peak - b.ranks[0].saved_peak == 2 * per_mb
    assert {"recompute_norms": True} in MEMORY_OPTIONS and {"recompute": "moe", "recompute_norms": True} in MEMORY_OPTIONS


TIMED = {"portapipe": ("cpu.yaml", [], "cpu"), "mla-math": ("deepseek_v3.yaml", [], "cpu"), "mla-fused": ("deepseek_v3.yaml", [], "cuda"),
         "mla-fused-full-rank-q": ("deepseek_v3.yaml", ["model.q_lora_rank=0"], "cuda"), "gqa": ("qwen3_moe.yaml", [], "cpu")}


@pytest.mark.parametrize("name", list(TIMED))
def test_the_time_model_prices_the_norms_and_mlas_up_projection_again_in_the_backward(name: str) -> None:
    """A layer whose norms are recomputed: its forward costs what it did, its backward the part's
    own time plus its norms made again (one for an MoE layer's attention, two for a dense layer;
    MLA's latent norms besides; GQA's per-head norms keep nothing to drop), priced by the bytes they
    move at the measured combine's pace per byte, plus, where the fused kernel kept them (cuda), MLA's queries, keys and values made again:
    q_b's (wq's) and kv_b's GEMMs, at the attention's pace per FLOP."""
    from pathlib import Path

    from portapipe.config.setup import shape_of
    from portapipe.plan.norm_recompute import moved_bytes
    from portapipe.plan.programs import Programs, StageSpec
    from portapipe.plan.shape import flops
    from portapipe.plan.time_model import run_ops
    from tests.test_plan_time import MOE, profile

    example, extra, backend = TIMED[name]
    path = Path(__file__).resolve().parents[1] / "examples" / example
    cfg = load_config(path, ["parallel.pp=1", "model.n_layers=2", "model.n_dense=1", "data.format=bytes", "data.path=null", *extra])
    s = shape_of(cfg.model, cfg.train, backend)
    m = cfg.model
    per_byte, per_flop = 1e-9, 1e-12
    attention = {ph: (0.0, per_flop * flops(s, "attention", ph)) for ph in ("F", "B", "W")}
    parts = {**MOE, "attention": attention, "combine": {"F": (0.0, per_byte * flops(s, "combine", "F")), "B": (0.0, per_byte * flops(s, "combine", "B"))},
             "dense": {"F": 5.0, "B": 5.0, "W": 2.0}}
    prof = profile(s, parts, a2a=2.0)
    progs = Programs(s, 256, 512, ep=2)
    tokens = 256
    latent = (m.q_lora_rank or 0) + (m.kv_lora_rank or 0)
    qk, up = (m.qk_nope_head_dim or 0) + (m.qk_rope_head_dim or 0), 0.0
    if backend == "cuda":  # the up-projection's GEMMs, written out: (q_lora_rank or hidden) -> heads x qk, kv_lora_rank -> heads x (nope + v)
        up = 2 * m.n_heads * ((m.q_lora_rank or m.hidden) * qk + m.kv_lora_rank * (m.qk_nope_head_dim + m.v_head_dim))
    for layer, part, norms in ((1, "attention", 1), (0, "dense", 2)):
        assert moved_bytes(s, part) == 2 * (norms * m.hidden + latent) * s.e
        plain, normed = StageSpec((layer,), ("off",), False, False), StageSpec((layer,), ("off",), False, False, (True,))
        assert run_ops([(0, op) for op in progs.forward(normed)], prof, ep=2).compute == pytest.approx(
            run_ops([(0, op) for op in progs.forward(plain)], prof, ep=2).compute)
        for phase in ("B", "BW"):
            t0 = run_ops([(0, op) for op in progs.backward(plain, phase)], prof, ep=2).compute
            t1 = run_ops([(0, op) for op in progs.backward(normed, phase)], prof, ep=2).compute
            assert t1 - t0 == pytest.approx(tokens * (moved_bytes(s, part) * per_byte + up * per_flop)), (layer, phase)
        if backend == "cuda":
            assert up > 0


@pytest.mark.parametrize("model", [{**MLA, "mtp_layers": 1}, QWEN], ids=["deepseek_v3-mtp", "qwen3_moe"])
def test_documents_and_prediction_modules_change_nothing_either(model: dict[str, Any]) -> None:
    """Attention inside documents (each token's position in its document: the remade queries and
    keys take the same RoPE angles) and a multi-token prediction module (its rows at an offset):
    the loss and every gradient equal off's, bit for bit."""
    from portapipe.scheduling.overlap import Tape, run

    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]])
    tokens = torch.randint(0, 256, (2, MODEL["seq_len"] + 1), generator=torch.Generator().manual_seed(3))
    results = []
    for memory in ({}, {"recompute": "norms"}):
        block = one_block(memory, model=model)
        tape = Tape()
        out = run(block.program(tape, tokens[:, :-1], tokens[:, 1:], positions))
        run(tape.backward(out, torch.ones_like(out)))
        results.append((float(out.detach()), {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == loss_b and grads_a.keys() == grads_b.keys() and len(grads_a) > 10
    for name, g in grads_a.items():
        assert torch.equal(g, grads_b[name]), name


def test_with_every_norm_output_kept_as_fp8_rows_nothing_is_made_again() -> None:
    """Under FP8-cached activations an MoE layer's attention norm output is kept as FP8 rows (the
    projections reading it all run in FP8): the norms' recompute drops nothing there and adds no op
    to the backward (not even a fixed cost), while a dense layer still remakes its FFN norm only
    when its FFN stays in the compute dtype."""
    from portapipe.plan.norm_recompute import dropped_bytes, moved_bytes, recompute_ops
    from portapipe.plan.shape import Shape
    from tests.test_plan_memory import EXAMPLE

    cfg = load_config(EXAMPLE, ["model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=192", "model.dtype=bfloat16", "train.fp8=deepseek"])
    s = Shape.of(cfg.model)
    assert dropped_bytes(s, "attention", 64, fp8_cached=True) == 0 and recompute_ops(s, "attention", "B", 64, fp8_cached=True) == []
    assert moved_bytes(s, "dense", fp8_cached=True) == 2 * 128 * 2  # the FFN (192 wide) in bfloat16 keeps its norm's output
    assert [op[1] for op in recompute_ops(s, "attention", "B", 64)] == ["norms"]
