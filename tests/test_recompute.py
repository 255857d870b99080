"""Recompute: layers keep nothing for backward, replay their forward (all-to-alls as program steps), same gradients."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.config import ConfigError, load_config
from portapipe.scheduling.overlap import Tape, run
from tests.test_zero_memory import MODEL, SCHEDULES, assert_identical, one_block, pipelined_step, verified


@pytest.fixture(scope="module")
def off() -> dict[str, Any]:
    return pipelined_step({})


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_gradients_and_loads_identical_to_off(off: dict[str, Any], mode: str) -> None:
    # assert_identical also compares the expert loads: a replay must not count them again.
    assert_identical(pipelined_step({"recompute": mode}), off)


def test_recomputed_layers_hold_nothing_for_backward() -> None:
    full = pipelined_step({"recompute": "full"})
    assert all(full["held"].get(layer, 0) == 0 for layer in (0, 1, 2))
    # moe: an MoE layer keeps exactly its attention part's tensors; the dense layer is untouched.
    off = pipelined_step({}, by_part=True)["held"]
    moe = pipelined_step({"recompute": "moe"}, by_part=True)["held"]
    kept = {label: n for label, n in off.items() if str(label).startswith("0.") or str(label) in ("1.attention", "2.attention")}
    assert {label: n for label, n in moe.items() if label is not None} == kept


def test_recompute_layers_picks_the_first_layers_of_a_block() -> None:
    block = one_block({"recompute": "full", "recompute_layers": 2})
    modes = [None if layer.memory is None else layer.memory.recompute.mode for layer in block.layers.values()]
    assert modes == ["full", "full", None]
    block = one_block({"recompute": "moe", "recompute_layers": 2})
    modes = [None if layer.memory is None else layer.memory.recompute.mode for layer in block.layers.values()]
    assert modes == [None, "moe", None]  # layer 0 is dense


def _yields(program: Any) -> tuple[int, Any]:
    n = 0
    while True:
        try:
            next(program)
            n += 1
        except StopIteration as stop:
            return n, stop.value


def _backward_yields(memory: dict[str, Any], ep_size: int = 2) -> int:
    from portapipe.models.expert_parallel import ExpertParallel
    from tests.test_overlap import _LoopbackBackend  # one process playing both EP ranks

    block = one_block(memory, ExpertParallel(_LoopbackBackend(), size=2, rank=0) if ep_size == 2 else None)
    tokens = torch.randint(0, 256, (2, MODEL["seq_len"] + 1))
    tape = Tape()
    forward, out = _yields(block.program(tape, tokens[:, :-1], tokens[:, 1:]))
    backward, _ = _yields(tape.backward(out, torch.ones_like(out)))
    return backward if ep_size == 2 else forward + backward


def test_with_one_ep_rank_an_moe_layer_exchanges_nothing() -> None:
    for memory in ({}, {"recompute": "moe"}, {"zero_memory": "level0"}):
        assert _backward_yields(memory, ep_size=1) == 0, memory


def test_replayed_all_to_alls_are_program_steps() -> None:
    """A recomputed MoE layer's backward yields its replay's dispatch and combine too, so an F&B can
    run the other micro-batch while they are in flight instead of blocking on them."""
    n_moe = MODEL["n_layers"] - MODEL["n_dense"]
    plain = _backward_yields({})
    assert plain == 2 * n_moe  # combine and dispatch (rows with their router weights) backward per MoE layer
    # the replay's dispatch and combine
    assert _backward_yields({"recompute": "moe"}) == plain + 2 * n_moe
    assert _backward_yields({"recompute": "full"}) == plain + 2 * n_moe


@pytest.mark.parametrize(
    "memory, key",
    [
        ({"model.n_dense": 3, "memory.recompute": "moe"}, "memory.recompute:"),
        ({"model.n_dense": 3, "memory.zero_memory": "level0"}, "memory.zero_memory:"),
        ({"memory.recompute": "full", "memory.recompute_layers": 4}, "memory.recompute_layers:"),
        ({"memory.zero_memory": "level0", "memory.zero_memory_layers": 4}, "memory.zero_memory_layers:"),
        ({"memory.zero_memory_layers": 1}, "memory.zero_memory_layers:"),
        ({"memory.recompute_layers": 1}, "memory.recompute_layers:"),
        ({"memory.zero_memory": "level1", "memory.recompute": "full"}, "memory.zero_memory:"),
    ],
)
def test_invalid_combinations_fail_at_load_with_the_key_path(memory: dict[str, Any], key: str) -> None:
    overrides = [f"{k}={v}" for k, v in memory.items()]
    with pytest.raises(ConfigError) as err:
        load_config({"model": {"n_layers": 3}, "schedule": {"name": "1f1b", "microbatches": 1}}, overrides)
    assert any(line.startswith(key) for line in err.value.problems), err.value.problems


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("option", ["recompute_moe", "recompute_full"])
def test_verify_pipelined_with_recompute(schedule: str, option: str) -> None:
    report = verified()[(schedule, option)]
    assert (report.pp, report.ep) == (2, 2)
    assert report.loss_diff == 0.0
    assert report.max_rel_grad_diff <= 1e-12
    assert report.ok, report
