"""Recompute of norms and MLA's up-projections: the RMSNorms' outputs and MLA's queries, keys and
values are not kept for the backward but made again there; values and gradients do not change."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.config import ConfigError, load_config
from tests.test_zero_memory import MODEL, assert_identical, one_block, pipelined_step

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


@pytest.mark.parametrize("q_lora", [True, False])
def test_mla_drops_norms_and_up_projections_exactly(q_lora: bool) -> None:
    """deepseek_v3: the input norm's output, the latent norms' outputs, and the attention's
    queries and keys (each heads x (nope + rope)). In float64 the attention's product with the
    values copies them (a view of the up-projected keys and values) and keeps the copy, which
    stays; torch's fused attention (other dtypes) keeps the view, which goes too."""
    model = MLA if q_lora else MLA_FULL_Q
    tokens, h, item, heads = 2 * model["seq_len"], model["hidden"], 8, model["n_heads"]
    qk = model["qk_nope_head_dim"] + model["qk_rope_head_dim"]
    per_row = h + model["kv_lora_rank"] + (model["q_lora_rank"] if q_lora else 0) + 2 * heads * qk
    off, norms = _held({}, model), _held({"recompute": "norms"}, model)
    for layer in (1, 2):
        assert off[f"{layer}.attention"] - norms[f"{layer}.attention"] == tokens * per_row * item
    # the dense layer's FFN norm too
    assert off["0.dense"] - norms["0.dense"] == tokens * (per_row + h) * item


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
