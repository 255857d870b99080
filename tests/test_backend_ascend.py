"""Ascend backend against the STAND-IN torch_npu (tests/standin_torch_npu.py), on CPU.

These tests check that the backend calls the torch_npu API as torch_npu 2.14.0 declares it
(the stand-in binds every call against the release's schemas and enforces the documented
layout rules and limits of npu_grouped_matmul), and that the grouped matmul it builds,
forward and backward, equals the CPU reference. They cannot show that the real kernels behave
as documented: real Ascend hardware with torch_npu and CANN is needed to prove the backend
(the tests marked ``npu`` at the end do that, and run under ``ci/test.sh npu``).
"""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from portapipe.backends.ascend import AscendBackend
from portapipe.backends.base import BackendUnavailable, grouped_mm_reference

from .standin_torch_npu import make_standin


# npu_grouped_matmul limits (torch_npu 2.14.0 docstring, CANN aclnnGroupedMatmulV5): groups per call
# with a single-tensor weight, and the bound every x and weight's innermost dim stays below.
NPU_GMM_MAX_GROUPS = 1024
NPU_GMM_INNER_LIMIT = 65536


def _install(monkeypatch: pytest.MonkeyPatch, mod: types.ModuleType) -> types.ModuleType:
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    return mod


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    return _install(monkeypatch, make_standin())


def _backend(k_grouping: bool | None = True) -> AscendBackend:
    """A backend whose group_type 2 probe is already answered (None: left to probe)."""
    be = AscendBackend()
    be._k_grouping = k_grouping
    return be


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
    # torch_npu's current_stream() wraps the current stream anew on every call: equal, not identical.
    assert be.compute_stream() == npu.current_stream()
    assert be.compute_stream() is not be.compute_stream()
    comm = be.comm_stream()
    assert comm != be.compute_stream()
    assert be.comm_stream() is comm  # one communication stream per backend
    ev = be.event(enable_timing=True)
    assert standin.recorder.of("Event")[-1] == {"event": ev, "enable_timing": True}
    # Work issued under the comm stream is recorded on it; the compute stream then waits on it.
    with be.stream(comm):
        assert npu.current_stream() == comm
        ev.record()
    assert ev.recorded_on == comm
    assert npu.current_stream().stream_id == npu.default_stream_id()
    be.compute_stream().wait_event(ev)
    assert npu.waited_on(npu.current_stream()) == [ev]
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
    be = _backend()
    counts = [3, 0, 5, 2]
    a, b, offs = _operands(dtype, counts)
    out = be.grouped_mm(a, b, offs)
    (call,) = standin.recorder.of("npu_grouped_matmul")
    assert call["overload"] == ""  # the tensor group_list overload
    assert torch.equal(call["x"][0], a) and call["weight"][0] is b
    assert call["group_list"].dtype == torch.int64
    assert call["group_list"].tolist() == [3, 3, 8, 10]  # cumulative ends, as torch's offs
    assert (call["split_item"], call["group_type"], call["group_list_type"]) == (3, 0, 0)
    assert call["bias"] is None
    ref = grouped_mm_reference(a.double(), b.double(), offs)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["transposed", "row-major"])
def test_grouped_matmul_weight_gradient_form_maps_to_k_grouping(standin, layout) -> None:
    """group_type 2 needs x transposed: ``x.t()`` (what the layers pass) goes as it is, a
    row-major x through the generic API is stored transposed first."""
    be = _backend()
    g = torch.Generator().manual_seed(1)
    a = torch.randn(10, 6, generator=g).t() if layout == "transposed" else torch.randn(6, 10, generator=g)
    b = torch.randn(10, 4, generator=g)
    offs = _offs([4, 0, 6])
    out = be.grouped_mm(a, b, offs)
    (call,) = standin.recorder.of("npu_grouped_matmul")
    assert (call["split_item"], call["group_type"], call["group_list_type"]) == (3, 2, 0)
    assert call["x"][0].stride() == (1, 6)
    assert (call["x"][0].data_ptr() == a.data_ptr()) is (layout == "transposed")  # no copy when the layout is right
    assert out.shape == (3, 6, 4)
    torch.testing.assert_close(out, grouped_mm_reference(a, b, offs))


@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
def test_grouped_matmul_backward_equals_reference_gradients(standin, form) -> None:
    """The backward is built from the same kernel; its gradients must equal autograd's on the loop."""
    be = _backend()
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
    be = _backend()
    a, b, offs = _operands(torch.float64, [2, 3])  # float64: no NPU kernel
    torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    n = NPU_GMM_MAX_GROUPS + 1
    a, b, offs = _operands(torch.float32, [1] * n, k=4, n=4)  # more groups than one call takes
    torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    a, b, offs = _operands(torch.float16, [1, 1], k=NPU_GMM_INNER_LIMIT, n=2)  # K at the inner-dim limit
    torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    a, b, offs = _operands(torch.float16, [0, 0], k=4, n=2)  # no rows at all
    assert be.grouped_mm(a, b, offs).shape == (0, 2)
    assert standin.recorder.of("npu_grouped_matmul") == []


def test_up_to_1024_groups_take_the_kernel(standin) -> None:
    """1024 groups is the limit for a single-tensor weight (128 is the weight-list limit)."""
    be = _backend()
    for groups in (130, NPU_GMM_MAX_GROUPS):
        a, b, offs = _operands(torch.float32, [1] * groups, k=4, n=4)
        torch.testing.assert_close(be.grouped_mm(a, b, offs), grouped_mm_reference(a, b, offs))
    calls = standin.recorder.of("npu_grouped_matmul")
    assert [c["group_list"].numel() for c in calls] == [130, NPU_GMM_MAX_GROUPS]


def test_short_offs_runs_the_kernel_on_the_covered_rows_and_zeroes_the_rest(standin) -> None:
    """group_list must end at the grouped axis; torch's offs may stop short (rows after it belong
    to no group): the kernel gets the covered rows, the rest of the result is zero."""
    be = _backend()
    a, b, _ = _operands(torch.float32, [2, 3])
    short = torch.tensor([2, 4], dtype=torch.int32)
    a.requires_grad_()
    out = be.grouped_mm(a, b, short)
    torch.testing.assert_close(out, grouped_mm_reference(a.detach(), b, short))
    assert torch.equal(out[4:], torch.zeros(1, 16))
    (call,) = standin.recorder.of("npu_grouped_matmul")
    assert call["x"][0].shape == (4, 8)
    assert call["group_list"].dtype == torch.int64 and call["group_list"].tolist() == [2, 4]
    out.sum().backward()
    assert torch.equal(a.grad[4:], torch.zeros(1, 8))


def test_strict_standin_refuses_what_torch_npu_refuses(standin) -> None:
    """What the 2.14.0 declarations and checks refuse; a lenient stand-in would let each through."""
    gmm = standin.npu_grouped_matmul
    x, w, gl = [torch.randn(4, 8)], [torch.randn(2, 8, 3)], torch.tensor([1, 4])
    with pytest.raises(TypeError, match="unexpected keyword argument.*group_lst"):
        gmm(x, w, group_lst=gl, split_item=3, group_type=0)
    with pytest.raises(RuntimeError, match="group_type only supports -1, 0 and 2, but got None"):
        gmm(x, w, group_list=gl, split_item=3)  # group_type's default is None, not -1
    with pytest.raises(TypeError, match="output_dtype"):
        gmm(x, w, group_list=gl, split_item=3, group_type=0, output_dtype=torch.float32)  # an int enum here
    with pytest.raises(ValueError, match="list group_list needs group_type None"):
        gmm(x, w, group_list=[1, 4], split_item=3, group_type=0)
    with pytest.raises(TypeError, match="1-D int64"):
        gmm(x, w, group_list=gl.int(), split_item=3, group_type=0)
    with pytest.raises(ValueError, match="must end at the grouped axis length 4"):
        gmm(x, w, group_list=torch.tensor([1, 3]), split_item=3, group_type=0)
    with pytest.raises(ValueError, match="must end at the grouped axis length 4"):  # k axis: x's K
        gmm([torch.randn(4, 6).t()], [torch.randn(4, 3)], group_list=torch.tensor([1, 3]), split_item=3, group_type=2)
    with pytest.raises(TypeError):
        standin.npu.Event(enable_timing=True, external=True)  # torch.cuda's keyword, not torch_npu's
    assert standin.npu.current_stream() is not standin.npu.current_stream()
    assert standin.npu.current_stream() == standin.npu.current_stream()


def test_layout_rules_per_group_type(standin) -> None:
    """group_type 0: x not transposed; group_type 2: x transposed and the weight not."""
    gmm = standin.npu_grouped_matmul
    gl = torch.tensor([1, 4])
    x_t = torch.randn(8, 4).t()  # [4, 8] stored transposed
    with pytest.raises(ValueError, match="group_type 0 does not take a transposed"):
        gmm([x_t.t().t()], [torch.randn(2, 8, 3)], group_list=gl, split_item=3, group_type=0)
    gmm([torch.randn(4, 8)], [torch.randn(2, 3, 8).transpose(1, 2)], group_list=gl, split_item=3, group_type=0)
    with pytest.raises(ValueError, match="group_type 2 needs x transposed"):
        gmm([torch.randn(5, 4)], [torch.randn(4, 3)], group_list=gl, split_item=3, group_type=2)
    with pytest.raises(ValueError, match="group_type 2 does not take a transposed or strided weight"):
        gmm([torch.randn(4, 5).t()], [torch.randn(3, 4).t()], group_list=gl, split_item=3, group_type=2)
    gmm([torch.randn(4, 5).t()], [torch.randn(4, 3)], group_list=gl, split_item=3, group_type=2)
    with pytest.raises(ValueError, match="inner dim 65536"):
        gmm([torch.randn(1, NPU_GMM_INNER_LIMIT, dtype=torch.float16)], [torch.randn(1, NPU_GMM_INNER_LIMIT, 1, dtype=torch.float16)],
            group_list=torch.tensor([1]), split_item=3, group_type=0)


@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
@pytest.mark.parametrize("a_layout", ["row-major", "transposed"])
def test_every_layout_through_the_generic_api_reaches_the_kernel_conformant(standin, form, a_layout) -> None:
    """Forward and backward of both forms, whichever layout the caller's operand has."""
    be = _backend()
    g = torch.Generator().manual_seed(7)
    rows, cols = (9, 5) if form == "2d3d" else (5, 9)
    a0 = torch.randn(rows, cols, generator=g) if a_layout == "row-major" else torch.randn(cols, rows, generator=g).t()
    b0 = torch.randn(3, 5, 7, generator=g) if form == "2d3d" else torch.randn(9, 7, generator=g)
    offs = _offs([2, 4, 3])
    a, b = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    a_ref, b_ref = a0.clone().requires_grad_(), b0.clone().requires_grad_()
    out, ref = be.grouped_mm(a, b, offs), grouped_mm_reference(a_ref, b_ref, offs)
    torch.testing.assert_close(out, ref)
    w = torch.randn(ref.shape, generator=g)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a.grad, a_ref.grad)
    torch.testing.assert_close(b.grad, b_ref.grad)
    assert len(standin.recorder.of("npu_grouped_matmul")) == 3


def test_group_type_2_support_is_probed_once_with_one_log_line(monkeypatch, caplog) -> None:
    """An older CANN without k-axis grouping: the weight-gradient form runs the loop, said once."""
    standin = _install(monkeypatch, make_standin(k_grouping=False))
    be = _backend(k_grouping=None)
    g = torch.Generator().manual_seed(8)
    caplog.set_level(logging.WARNING, logger="portapipe.backends")
    for _ in range(3):
        x, dy, offs = torch.randn(10, 6, generator=g), torch.randn(10, 4, generator=g), _offs([4, 0, 6])
        torch.testing.assert_close(be.grouped_mm(x.t(), dy, offs), grouped_mm_reference(x.t(), dy, offs))
    a = torch.randn(10, 6, generator=g)
    b = torch.randn(3, 6, 4, generator=g, requires_grad=True)
    be.grouped_mm(a, b, _offs([4, 0, 6])).sum().backward()  # its weight gradient is the k form too
    a_ref = b.detach().clone().requires_grad_()
    grouped_mm_reference(a, a_ref, _offs([4, 0, 6])).sum().backward()
    torch.testing.assert_close(b.grad, a_ref.grad)
    lines = [r for r in caplog.records if "group_type 2" in r.getMessage()]
    assert len(lines) == 1 and "not supported by this CANN" in lines[0].getMessage()
    probes = [c for c in standin.recorder.of("npu_grouped_matmul") if c["group_type"] == 2]
    assert len(probes) == 1  # the probe; the kernel is not asked again
    assert be.k_grouping_supported(None, torch.device("cpu"), torch.float32) is False


def test_group_type_2_probe_passes_where_cann_supports_it(standin, caplog) -> None:
    be = _backend(k_grouping=None)
    caplog.set_level(logging.WARNING, logger="portapipe.backends")
    x, dy, offs = torch.randn(10, 6), torch.randn(10, 4), _offs([4, 0, 6])
    torch.testing.assert_close(be.grouped_mm(x.t(), dy, offs), grouped_mm_reference(x.t(), dy, offs))
    assert be._k_grouping is True and not caplog.records
    assert [c["group_type"] for c in standin.recorder.of("npu_grouped_matmul")] == [2, 2]  # probe, call


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
    with pytest.raises(ValueError, match=r"'nvshmem' is not a transport of backend 'npu' \(its transports: alltoall\)"):
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
