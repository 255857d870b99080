"""The stage contract's names and parameter markers."""

from __future__ import annotations

import pytest
import torch

from portapipe.scheduling.stage import expert_ids, expert_key, is_expert, mark_expert, owned_rows


def test_expert_key_puts_the_expert_before_the_leaf() -> None:
    assert expert_key("layers.3.moe.experts.gate_up", 5) == "layers.3.moe.experts.5.gate_up"
    assert expert_key("w", 2) == "2.w"


def test_markers_round_trip_and_check_the_row_count() -> None:
    p = torch.nn.Parameter(torch.zeros(3, 2))
    assert not is_expert(p) and owned_rows(p) is None
    with pytest.raises(ValueError, match="no expert_ids"):
        expert_ids(p)
    mark_expert(p, [4, 1, 4])
    assert is_expert(p) and expert_ids(p) == [4, 1, 4]
    with pytest.raises(ValueError, match="3 rows cannot hold 2 experts"):
        mark_expert(p, [0, 1])


def test_the_model_labels_its_experts_by_logical_id() -> None:
    from portapipe.backends.cpu import CPUBackend
    from portapipe.config import load_config
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.models.moe import build_blocks

    cfg = load_config({"model": {"n_layers": 2, "n_dense": 1, "n_experts": 4}})
    ep = ExpertParallel(CPUBackend(), size=2, rank=1)
    blocks = build_blocks(cfg.model, [0], 1, ep, seed=0)
    experts = blocks[0].moe_layers()[0].moe.experts
    assert expert_ids(experts.gate_up) == [2, 3] == expert_ids(experts.down)
    experts.logical = [3, 2]
    assert expert_ids(experts.gate_up) == [3, 2]
