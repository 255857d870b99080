"""Zero-memory: the experts' inputs are dropped after the forward and fetched again, with identical gradients."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import load_config
from portapipe.memory.accounting import SavedActivations, label_layers
from portapipe.memory.policy import configure
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.moe import build_blocks
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.wgrad import WeightGradQueue



MODEL = {"n_layers": 3, "n_dense": 1, "dtype": "float64", "hidden": 32, "n_heads": 4, "moe_hidden": 16, "top_k": 4, "n_experts": 8, "seq_len": 12}


def one_block(memory: dict[str, Any], ep: ExpertParallel | None = None, model: dict[str, Any] | None = None) -> Any:
    """The whole model (``model``, default MODEL) as one block in this process (EP size 1 unless
    ``ep``), with memory options applied."""
    cfg = load_config({"model": model or MODEL, "schedule": {"name": "1f1b", "microbatches": 1}, "memory": memory})
    block = build_blocks(cfg.model, [0], 1, ep or ExpertParallel(CPUBackend()), seed=7)[0]
    configure({0: block}, cfg.memory)
    return block


def pipelined_step(memory: dict[str, Any], held_after: int = 0, by_part: bool = False, model: dict[str, Any] | None = None) -> dict[str, Any]:
    """Three micro-batches as a zero-bubble rank runs them: F0 F1 B0 F2 B1 W0 B2 W1 W2.

    Returns the losses, the parameters' gradients, the expert loads, and the bytes each layer
    (or each ``"<layer>.<part>"``) held for backward after micro-batch ``held_after``'s forward.
    """
    block = one_block(memory, model=model)
    label_layers([block], by_part=by_part)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 256, (2, MODEL["seq_len"] + 1), generator=g) for _ in range(3)]
    tapes: dict[int, tuple[Tape, torch.Tensor]] = {}
    queues: dict[int, WeightGradQueue] = {}
    losses: dict[int, float] = {}
    held: dict[Any, int] = {}

    def forward(m: int) -> None:
        tracker = SavedActivations(ignore=block.parameters())
        tape = Tape()
        with tracker.track():
            out = run(block.program(tape, data[m][:, :-1], data[m][:, 1:]))
        if m == held_after:
            held.update({lay: n for (lay, _), n in tracker.live_by_region.items()})
        tapes[m] = (tape, out)
        losses[m] = float(out.detach())

    def backward(m: int) -> None:
        tape, out = tapes.pop(m)
        queues[m] = WeightGradQueue()
        run(tape.backward(out, torch.ones_like(out), queues[m]))

    forward(0), forward(1), backward(0), forward(2), backward(1)
    queues.pop(0).run()
    backward(2)
    queues.pop(1).run()
    queues.pop(2).run()
    grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    counts = [layer.moe.step_counts.clone() for layer in block.moe_layers()]
    return {"losses": losses, "grads": grads, "counts": counts, "held": held, "block": block}


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["losses"] == b["losses"]
    assert a["grads"].keys() == b["grads"].keys()
    for name in a["grads"]:
        assert torch.equal(a["grads"][name], b["grads"][name]), name
    for x, y in zip(a["counts"], b["counts"]):
        assert torch.equal(x, y)


@pytest.fixture(scope="module")
def off() -> dict[str, Any]:
    return pipelined_step({})


@pytest.mark.parametrize("level", ["level0", "level1"])
def test_gradients_identical_to_off_bit_for_bit(off: dict[str, Any], level: str) -> None:
    assert_identical(pipelined_step({"zero_memory": level}), off)


def test_saved_bytes_drop_by_the_dropped_tensors_exactly(off: dict[str, Any]) -> None:
    """level0 drops the dispatched rows (rows x hidden); level1 also the activation outputs of the
    routed experts (rows x width) and of the shared expert (tokens x width)."""
    h, f, item = MODEL["hidden"], MODEL["moe_hidden"], 8  # float64
    tokens = 2 * MODEL["seq_len"]
    rows = tokens * MODEL["top_k"]  # EP size 1: every (token, slot) row stays here
    l0 = pipelined_step({"zero_memory": "level0"})
    l1 = pipelined_step({"zero_memory": "level1"})
    for layer in (1, 2):  # the MoE layers; layer 0 is dense and unchanged
        assert off["held"][layer] - l0["held"][layer] == rows * h * item
        # SwiGLU keeps only its input; level1 drops its output, which the down projection keeps.
        assert l0["held"][layer] - l1["held"][layer] == (rows + tokens) * f * item
    assert l0["held"][0] == off["held"][0]


@pytest.mark.parametrize("level", ["off", "level0", "level1"])
def test_moe_parts_keep_closed_form_bytes(level: str) -> None:
    """What the experts and the combine keep, per MoE layer, by closed form (EP size 1, float64).

    experts: the dispatched rows (hidden wide; not at level0/1), the gate/up output (2 x width),
    the weighted activation's output (width; not at level1), the rows' router weights and the
    grouped-matmul offsets.
    combine: only the inverse dispatch order (the experts applied the weights, so the sum over
    top-k keeps neither the expert rows nor the all-to-all output).
    shared expert: its gate/up output and activation output (not at level1; its input is the
    attention part's).
    """
    h, f, k, item = MODEL["hidden"], MODEL["moe_hidden"], MODEL["top_k"], 8
    tokens = 2 * MODEL["seq_len"]
    rows = tokens * k
    held = pipelined_step({} if level == "off" else {"zero_memory": level}, by_part=True)["held"]
    offs = MODEL["n_experts"] * 8
    widths = {"off": h + 3 * f, "level0": 3 * f, "level1": 2 * f}[level]
    for layer in (1, 2):
        assert held[f"{layer}.experts"] == rows * widths * item + rows * item + offs
        assert held[f"{layer}.combine"] == rows * 8
        # one shared expert of width f: its gate/up output, and its activation's output but at level1
        assert held[f"{layer}.shared"] == tokens * (2 if level == "level1" else 3) * f * item


def test_zero_memory_layers_picks_the_first_moe_layers_of_a_block() -> None:
    block = one_block({"zero_memory": "level1", "zero_memory_layers": 1})
    layers = list(block.layers.values())
    assert layers[0].memory is None  # dense
    assert layers[1].memory.zero_memory.level == "level1"
    assert layers[2].memory is None


@pytest.mark.parametrize("ep_size", [1, 2])
def test_exchange_buffers_are_freed_after_the_forward(ep_size: int) -> None:
    from tests.test_overlap import _LoopbackBackend  # one process playing both EP ranks

    ep = ExpertParallel(_LoopbackBackend(), size=2, rank=1) if ep_size == 2 else None
    block = one_block({"zero_memory": "level0"}, ep)
    layer = block.moe_layers()[0]
    seen: list[torch.Tensor] = []
    original = layer.experts_part

    def spy(rows: torch.Tensor, weights: torch.Tensor, plan: Any, zm: Any = None, local: bool = False) -> Any:
        seen.append(rows)
        return original(rows, weights, plan, zm, local)

    layer.experts_part = spy
    tokens = torch.randint(0, 256, (2, MODEL["seq_len"] + 1))
    tape = Tape()
    out = run(block.program(tape, tokens[:, :-1], tokens[:, 1:]))
    # the local rows (a view of the sender's buffer) and, with a peer, the received ones
    assert len(seen) == ep_size and all(rows.untyped_storage().nbytes() == 0 for rows in seen)
    run(tape.backward(out, torch.ones_like(out)))  # still runs: nothing reads the freed rows
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad)


# ------------------------------------------------------------------- pipelined, EP = 2
VERIFY_BASE = {
    "backend": "cpu",
    "parallel": {"pp": 2, "ep": 2},
    "model": {"n_layers": 8, "n_dense": 1, "hidden": 16, "n_heads": 2, "moe_hidden": 8, "n_experts": 4, "top_k": 2, "seq_len": 8},
    "train": {"micro_batch_size": 1},
}
OPTIONS = {
    "level0": {"zero_memory": "level0"},
    "level1": {"zero_memory": "level1"},
    "recompute_moe": {"recompute": "moe"},
    "recompute_full": {"recompute": "full"},
    "full1_level1": {"recompute": "full", "recompute_layers": 1, "zero_memory": "level1"},
    "norms": {"recompute": "norms"},
    "norms_moe": {"recompute": ["norms", "moe"]},
    "norms_level1": {"recompute": "norms", "zero_memory": "level1"},
}
SCHEDULES = ("dualpipev", "interleaved")
# Lone-action schedules (every F, B and BW alone: each hides its exchanges behind its own
# independent parts, replays and W work only) and full backwards in DualPipeV's cool-down.
LONE = {
    ("1f1b", "level1"): {"name": "1f1b"},
    ("1f1b", "recompute_moe"): {"name": "1f1b"},
    ("1f1b", "full1_level1"): {"name": "1f1b"},
    ("zb1p", "level0"): {"name": "zb1p"},
    ("zb1p", "recompute_full"): {"name": "zb1p"},
    ("dualpipev_no_w_split", "recompute_moe"): {"name": "dualpipev", "w_split": False},
    ("1f1b", "norms"): {"name": "1f1b"},
    ("zb1p", "norms_moe"): {"name": "zb1p"},
    ("dualpipev_no_w_split", "norms_level1"): {"name": "dualpipev", "w_split": False},
}


@functools.lru_cache(maxsize=1)
def verified() -> dict[tuple[str, str], Any]:
    """Every (schedule, memory option) verified in one launch of 4 gloo ranks (shared with test_recompute)."""
    from portapipe.verify import verify_many

    keys, configs = [], []
    for schedule in SCHEDULES:
        for name, memory in OPTIONS.items():
            keys.append((schedule, name))
            configs.append(load_config({**VERIFY_BASE, "schedule": {"name": schedule, "microbatches": 4}, "memory": memory}))
    for (label, name), schedule_section in LONE.items():
        keys.append((label, name))
        configs.append(load_config({**VERIFY_BASE, "schedule": {**schedule_section, "microbatches": 4}, "memory": OPTIONS[name]}))
    return dict(zip(keys, verify_many(configs)))


@pytest.mark.multiproc
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("option", ["level0", "level1", "full1_level1"])
def test_verify_pipelined_with_zero_memory(schedule: str, option: str) -> None:
    report = verified()[(schedule, option)]
    assert (report.pp, report.ep) == (2, 2)
    assert report.loss_diff == 0.0
    assert report.max_rel_grad_diff <= 1e-12
    assert report.ok, report


@pytest.mark.multiproc
@pytest.mark.parametrize("key", list(LONE), ids=["-".join(k) for k in LONE])
def test_verify_lone_actions_with_memory_options(key: tuple[str, str]) -> None:
    report = verified()[key]
    assert (report.pp, report.ep) == (2, 2)
    assert report.loss_diff == 0.0
    assert report.max_rel_grad_diff <= 1e-12
    assert report.ok, report
    # every exchange of a 1F1B or ZB1P step is a lone action's: the steady phase has none
    for t in report.timings:
        assert t["edge_a2a_total_s"] + t["fb_a2a_total_s"] == pytest.approx(t["a2a_total_s"])
        if key[0] in ("1f1b", "zb1p"):
            assert t["fb_a2a_total_s"] == 0.0 and t["edge_a2a_total_s"] > 0
