"""Ascend backend against the STAND-IN torch_npu (tests/standin_torch_npu.py), on CPU.

These tests check that the backend calls the documented torch_npu API with the right
arguments (streams and events, the hccl process-group backend, npu_grouped_matmul's
argument mapping, memory figures) and that the grouped matmul it builds, forward and
backward, equals the CPU reference. They cannot show that the real kernels behave as
documented: real Ascend hardware with torch_npu and CANN is needed to prove the backend
(the tests marked ``npu`` at the end do that, and run under ``ci/test.sh npu``).
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from portapipe.backends.ascend import AscendBackend
from portapipe.backends.base import BackendUnavailable, grouped_mm_reference

from .standin_torch_npu import make_standin


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    mod = make_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    return mod


def _offs(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0)


def _operands(dtype: torch.dtype, counts: list[int], k: int = 8, n: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    a = torch.randn(t, k, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(len(counts), k, n, generator=g, dtype=torch.float64).to(dtype)
    return a, b, _offs(counts)


def test_identity_and_hccl_name() -> None:
    assert AscendBackend.name == "npu"
    assert AscendBackend.dist_backend == "hccl"
    assert AscendBackend.device_type == "npu"


def test_process_group_uses_hccl_and_binds_device_first(standin, monkeypatch) -> None:
    seen: dict = {}

    def fake_init(**kwargs):
        seen.update(kwargs)
        seen["set_device_before"] = standin.recorder.of("set_device")

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "init_process_group", fake_init)
    monkeypatch.setenv("LOCAL_RANK", "3")
    be = AscendBackend()
    be.init_process_group(rank=5, world_size=8, timeout_s=7)
    assert seen["backend"] == "hccl"
    assert (seen["rank"], seen["world_size"]) == (5, 8)
    assert seen["timeout"].total_seconds() == 7
    assert "device_id" not in seen
    assert seen["set_device_before"] == [{"device": 3}]


def test_streams_and_events_map_to_torch_npu(standin) -> None:
    be = AscendBackend()
    npu = standin.npu
    assert be.compute_stream() is npu.current_stream()
    comm = be.comm_stream()
    assert comm is not be.compute_stream()
    assert be.comm_stream() is comm  # one communication stream per backend
    ev = be.event(enable_timing=True)
    assert standin.recorder.of("Event")[-1] == {"event": ev, "enable_timing": True}
    # Work issued under the comm stream is recorded on it; the compute stream then waits on it.
    with be.stream(comm):
        assert npu.current_stream() is comm
        ev.record()
    assert ev.recorded_on is comm
    assert npu.current_stream() is npu._default
    be.compute_stream().wait_event(ev)
    assert npu._default.waited_on == [ev]
    be.synchronize()
    assert "synchronize" in standin.recorder.names()


def test_timer_uses_npu_timing_events(standin) -> None:
    be = AscendBackend()
    with be.timed() as t:
        sum(range(20000))
    events = standin.recorder.of("Event")
    assert len(events) == 2 and all(e["enable_timing"] for e in events)
    recorded = [c["event"] for c in standin.recorder.of("Event.record")]
    assert recorded == [e["event"] for e in events]
    assert standin.recorder.of("Event.synchronize")[0]["event"] is events[1]["event"]
    assert t.elapsed_s == pytest.approx((events[1]["event"].time - events[0]["event"].time), rel=1e-6)
    assert t.elapsed_s > 0


def test_memory_figures_map_to_torch_npu_for_this_device(standin, monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    be = AscendBackend()
    standin.npu.allocated = {0: 111, 1: 5000}
    standin.npu.peak = {0: 222, 1: 9000}
    assert be.memory_allocated() == 5000
    assert be.max_memory_allocated() == 9000
    be.reset_peak_memory_stats()
    assert standin.recorder.of("reset_peak_memory_stats") == [{"device": 1}]
    assert be.max_memory_allocated() == 5000  # the peak restarts from what is held now
    assert standin.npu.peak[0] == 222  # other devices untouched


def test_rng_state_round_trip_includes_npu(standin) -> None:
    be = AscendBackend()
    standin.npu.rng[0] = torch.arange(16, dtype=torch.uint8)
    torch.manual_seed(7)
    state = be.get_rng_state()
    first = torch.rand(3)
    standin.npu.rng[0] = torch.zeros(16, dtype=torch.uint8)
    be.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert torch.equal(standin.npu.rng[0], torch.arange(16, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grouped_matmul_forward_argument_mapping(standin, dtype) -> None:
    be = AscendBackend()
    counts = [3, 0, 5, 2]
    a, b, offs = _operands(dtype, counts)
    out = be.grouped_mm(a, b, offs)
    (call,) = standin.recorder.of("npu_grouped_matmul")
    assert call["x"][0] is a and call["weight"][0] is b
    assert call["group_list"].dtype == torch.int64
    assert call["group_list"].tolist() == [3, 3, 8, 10]  # cumulative ends, as torch's offs
    assert (call["split_item"], call["group_type"], call["group_list_type"]) == (3, 0, 0)
    assert call["bias"] is None
    ref = grouped_mm_reference(a.double(), b.double(), offs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_grouped_matmul_weight_gradient_form_maps_to_k_grouping(standin) -> None:
    be = AscendBackend()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(6, 10, generator=g)
    b = torch.randn(10, 4, generator=g)
    offs = _offs([4, 0, 6])
    out = be.grouped_mm(a, b, offs)
    (call,) = standin.recorder.of("npu_grouped_matmul")
    assert (call["split_item"], call["group_type"], call["group_list_type"]) == (3, 2, 0)
    assert out.shape == (3, 6, 4)
    torch.testing.assert_close(out, grouped_mm_reference(a, b, offs))


@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
def test_grouped_matmul_backward_equals_reference_gradients(standin, form) -> None:
    """The backward is built from the same kernel; its gradients must equal autograd's on the loop."""
    be = AscendBackend()
    g = torch.Generator().manual_seed(2)
    if form == "2d3d":
        a0, b0, offs = torch.randn(9, 5, generator=g), torch.randn(3, 5, 7, generator=g), _offs([2, 4, 3])
    else:
        a0, b0, offs = torch.randn(5, 9, generator=g), torch.randn(9, 7, generator=g), _offs([2, 4, 3])
    w = torch.randn(grouped_mm_reference(a0, b0, offs).shape, generator=g)
    grads = []
    for fn in (be.grouped_mm, grouped_mm_reference):
        a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
        (fn(a, b, offs) * w).sum().backward()
        grads.append((a.grad, b.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    torch.testing.assert_close(grads[0][1], grads[1][1])
    calls = standin.recorder.of("npu_grouped_matmul")
    assert len(calls) == 3  # forward, input gradient, weight gradient: all on the NPU kernel
    assert all(c["group_list_type"] == 0 and c["split_item"] == 3 for c in calls)


def test_grouped_matmul_falls_back_where_the_kernel_does_not_apply(standin) -> None:
    be = AscendBackend()
    a, b, offs = _operands(torch.float64, [2, 3])  # float64: no NPU kernel
    torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    a, b, _ = _operands(torch.float32, [2, 3])
    short = torch.tensor([2, 4])  # offs ends before the last row: kernel's group_list may not
    torch.testing.assert_close(be.grouped_mm(a, b, short), grouped_mm_reference(a, b, short))
    a, b, offs = _operands(torch.float32, [1] * 130, k=4, n=4)  # more groups than one call takes
    torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    assert standin.recorder.of("npu_grouped_matmul") == []


def test_unavailable_reason_names_package_cann_and_autoload(monkeypatch) -> None:
    monkeypatch.setattr("portapipe.backends.ascend._davinci_files", lambda: [])
    msg = AscendBackend.unavailable_reason()
    assert "no Ascend NPU" in msg and "/dev/davinci" in msg
    for needed in ("portapipe[npu]", "CANN", "TORCH_DEVICE_BACKEND_AUTOLOAD=0"):
        assert needed in msg
    # An NPU present but torch_npu missing: the message says so.
    monkeypatch.setattr("portapipe.backends.ascend._davinci_files", lambda: ["/dev/davinci0"])
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert "torch_npu is not installed" in AscendBackend.unavailable_reason()
    assert AscendBackend.is_available() is False


def test_presence_is_judged_without_importing_torch_npu(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # any import attempt would raise
    monkeypatch.setattr("portapipe.backends.ascend._davinci_files", lambda: [])
    assert AscendBackend.device_present() is False
    assert AscendBackend.is_available() is False
    assert AscendBackend.device_count() == 0


def test_nvshmem_transport_is_refused_on_npu(standin) -> None:
    with pytest.raises(BackendUnavailable, match="nvshmem is a CUDA transport"):
        AscendBackend({"ep_transport": "nvshmem"})


# ------------------------------------------------------------- real hardware (ci/test.sh npu)
@pytest.mark.npu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_npu_grouped_matmul_equals_cpu_reference(dtype) -> None:
    from portapipe.backends import get_backend

    be = get_backend("npu")
    a, b, offs = _operands(dtype, [7, 0, 33, 24], k=64, n=32, seed=3)
    a_dev, b_dev = a.to(be.device()).requires_grad_(), b.to(be.device()).requires_grad_()
    out = be.grouped_mm(a_dev, b_dev, offs.to(be.device()))
    ref = grouped_mm_reference(a.double(), b.double(), offs)
    torch.testing.assert_close(out.double().cpu(), ref, rtol=3e-2, atol=3e-2)
    out.float().sum().backward()
    a_ref, b_ref = a.double().requires_grad_(), b.double().requires_grad_()
    grouped_mm_reference(a_ref, b_ref, offs).sum().backward()
    torch.testing.assert_close(a_dev.grad.double().cpu(), a_ref.grad, rtol=3e-2, atol=3e-1)
    torch.testing.assert_close(b_dev.grad.double().cpu(), b_ref.grad, rtol=3e-2, atol=3e-1)


@pytest.mark.npu
def test_npu_streams_events_and_memory_figures() -> None:
    from portapipe.backends import get_backend

    be = get_backend("npu")
    be.set_device()
    before = be.memory_allocated()
    x = torch.ones(1 << 20, device=be.device())
    assert be.memory_allocated() >= before + x.numel() * 4
    comm = be.comm_stream()
    done = be.event()
    with be.stream(comm):
        y = x.mul(2)
        done.record()
    be.compute_stream().wait_event(done)
    with be.timed() as t:
        z = y + 1
    assert t.elapsed_s > 0
    assert float(z[0]) == float(x[0]) * 2 + 1
