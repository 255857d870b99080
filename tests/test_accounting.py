"""Saved-activation accounting: storage bytes autograd keeps for backward, counted once, released after it."""

from __future__ import annotations

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.memory.accounting import SavedActivations, label_layers, region
from portapipe.models.linear import Linear
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.wgrad import WeightGradQueue, deferring
from tests.test_zero_memory import MODEL, one_block


def test_counts_each_storage_once_and_never_parameters() -> None:
    lin = Linear(16, 16, torch.float64)
    x = torch.randn(4, 16, dtype=torch.float64, requires_grad=True)
    tracker = SavedActivations()
    with tracker.track():
        y = lin(x)  # saves x and the weight (a parameter: not counted)
        z = torch.tanh(y)  # saves its output z
        w = z * z  # saves z twice: same storage
        v = x[1:3] * 2.0  # a view of x: x's storage, already counted... saves nothing (scalar)
        u = x[1:3] * z[1:3]  # views of x and z: nothing new
    assert tracker.live_bytes == tracker.peak_bytes == 2 * 4 * 16 * 8
    (w.sum() + v.sum() + u.sum()).backward()
    assert tracker.live_bytes == 0  # released with the graph
    assert tracker.peak_bytes == 2 * 4 * 16 * 8


def test_regions_attribute_bytes_to_layer_and_microbatch() -> None:
    tracker = SavedActivations()
    a = torch.randn(8, requires_grad=True, dtype=torch.float64)
    with tracker.track():
        with region(microbatch=3):
            with region(layer=1):
                y1 = torch.exp(a)  # output, 64 bytes
            y2 = torch.sin(a)  # input a, 64 bytes, no layer
            with region(layer=2):
                y3 = torch.exp(a) * torch.exp(-a)  # two new outputs, 128 bytes (a again: not new)
    assert tracker.by_region == {(1, 3): 64, (None, 3): 64, (2, 3): 128}
    assert tracker.layer_bytes(2) == 128 and tracker.microbatch_bytes(3) == 256
    assert tracker.live_layer_bytes(1) == 64
    y1.sum().backward()
    assert tracker.live_layer_bytes(1) == 0  # that graph has run its backward: released
    (y2.sum() + y3.sum()).backward()
    assert tracker.live_bytes == 0


def test_peak_is_the_most_held_at_once() -> None:
    tracker = SavedActivations()
    xs = [torch.randn(100, requires_grad=True, dtype=torch.float32) for _ in range(3)]
    with tracker.track():
        for x in xs:
            torch.exp(x).sum().backward()  # each graph holds 400 bytes, then frees them
    assert tracker.peak_bytes == 400 and tracker.live_bytes == 0
    tracker.reset_peak()
    assert tracker.peak_bytes == 0


def test_deferred_weight_gradients_reach_parameters_under_tracking() -> None:
    """Saved tensors come back as aliases under hooks; a queued W must still land on the parameter."""
    lin = Linear(8, 4, torch.float64)
    torch.nn.init.normal_(lin.weight)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    lin(x).sum().backward()
    want = lin.weight.grad.clone()
    lin.weight.grad = None
    with SavedActivations().track():
        y = lin(x)
    queue = WeightGradQueue()
    with deferring(queue):
        y.sum().backward()
    queue.run()
    assert torch.equal(lin.weight.grad, want)


def test_layer_labels_cover_a_model_forward_and_summary_is_json_ready() -> None:
    block = one_block({})
    label_layers([block])
    tokens = torch.randint(0, 256, (2, MODEL["seq_len"] + 1))
    tracker = SavedActivations(ignore=block.parameters())
    tape = Tape()
    with tracker.track():
        out = run(block.program(tape, tokens[:, :-1], tokens[:, 1:]))
    per_layer = [tracker.layer_bytes(i) for i in range(MODEL["n_layers"])]
    assert all(n > 0 for n in per_layer)
    assert sum(per_layer) + tracker.by_region.get((None, None), 0) == tracker.live_bytes
    # Routed layers keep top-k rows per token: more than the dense layer.
    assert per_layer[1] > per_layer[0] and per_layer[2] > per_layer[0]
    summary = tracker.summary(CPUBackend())
    assert summary["peak_saved_bytes"] == tracker.live_bytes
    assert isinstance(summary["allocator_peak_bytes"], int) and summary["allocator_peak_bytes"] > 0
    assert [r["layer"] for r in summary["regions"]] == [None, 0, 1, 2]
    run(tape.backward(out, torch.ones_like(out)))
    assert tracker.live_bytes == 0


def _tracked_steps(backend, raws: list[dict]) -> list[list[int]]:
    """On each rank: one runtime step per config under ``tracker.step()``; every rank's peak."""
    from portapipe.memory.accounting import peak_per_rank
    from portapipe.verify.pipelined import runtime_for

    torch.set_num_threads(1)
    peaks = []
    for raw in raws:
        runtime, batches = runtime_for(backend, raw)
        tracker = SavedActivations(ignore=runtime.parameters())
        with tracker.step():
            runtime.step(batches)
        assert tracker.live_bytes == 0, tracker.live_by_region  # all backwards ran; W recorded no graph
        peaks.append(peak_per_rank(runtime.backend, tracker))
    return peaks


@pytest.mark.multiproc
def test_runtime_step_reports_peak_saved_bytes_per_rank() -> None:
    from portapipe.config import load_config
    from portapipe.ranks.launch import run_ranks

    base = {
        "backend": "cpu",
        "parallel": {"pp": 1, "ep": 2},
        "schedule": {"name": "dualpipev", "microbatches": 2},
        "model": {"n_layers": 2, "n_dense": 0, "hidden": 32, "n_heads": 2, "moe_hidden": 16, "n_experts": 4, "top_k": 4, "seq_len": 8},
        "train": {"micro_batch_size": 2},
    }
    raws = [load_config({**base, "memory": m}).to_dict() for m in ({}, {"zero_memory": "level0"})]
    per_rank = run_ranks(_tracked_steps, 2, raws)
    assert per_rank[0] == per_rank[1]  # every rank got every rank's figures
    off, level0 = per_rank[0]
    assert all(n > 0 for n in off)
    assert all(z < o for z, o in zip(level0, off))


def test_rmsnorm_and_swiglu_keep_only_their_inputs() -> None:
    """RMSNorm keeps x and one scale per row; SwiGLU keeps its gate/up input (nothing else)."""
    from portapipe.models.functions import RMSNorm, swiglu

    norm = RMSNorm(32, torch.float64)
    x = torch.randn(2, 5, 32, dtype=torch.float64, requires_grad=True)
    gu = torch.randn(10, 2 * 16, dtype=torch.float64, requires_grad=True)
    tracker = SavedActivations(ignore=norm.parameters())
    with tracker.track():
        y = norm(x)
        z = swiglu(gu, 16)
    assert tracker.live_bytes == (2 * 5 * 32 + 2 * 5) * 8 + 10 * 32 * 8
    (y.sum() + z.sum()).backward()
    assert tracker.live_bytes == 0
