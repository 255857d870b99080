"""CUDA backend: what a CPU can check (messages, refusals, kernel choice), then GPU tests.

The tests marked ``cuda`` need an NVIDIA GPU; they skip elsewhere (saying so) and are
enforced by ``ci/test.sh cuda``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from portapipe.backends import cuda as cuda_mod
from portapipe.backends.base import Backend, BackendUnavailable, EventTimer, grouped_mm_reference
from portapipe.backends.cuda import CUDABackend, fused_grouped_mm_supported, fused_path_ok

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this machine look GPU-less, whatever it has (with a CUDA build of torch)."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(CUDABackend, "device_count", classmethod(lambda cls: 0))
    monkeypatch.setattr(cuda_mod, "_nvidia_device_files", lambda: [])


@pytest.fixture
def usable_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make this machine look like it has a usable GPU (for the NVSHMEM checks that follow)."""
    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: True))


# ------------------------------------------------------------------------- CPU-side checks
def test_identity() -> None:
    assert (CUDABackend.name, CUDABackend.device_type, CUDABackend.dist_backend) == ("cuda", "cuda", "nccl")


def test_no_gpu_reads_as_absent_and_unavailable(no_gpu) -> None:
    assert CUDABackend.device_present() is False
    assert CUDABackend.is_available() is False
    msg = CUDABackend.unavailable_reason()
    assert "no NVIDIA GPU found" in msg and "/dev/nvidia" in msg and "nvidia-smi" in msg


def test_cpu_only_torch_build_is_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    assert CUDABackend.device_count() == 0
    assert "built without CUDA" in CUDABackend.unavailable_reason()


def test_gpu_present_but_unusable_is_named(monkeypatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(CUDABackend, "device_count", classmethod(lambda cls: 1))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert CUDABackend.device_present() is True
    assert CUDABackend.is_available() is False
    assert "torch cannot use it" in CUDABackend.unavailable_reason()


def test_get_backend_cuda_without_gpu_raises_with_reason(no_gpu) -> None:
    from portapipe.backends import get_backend

    with pytest.raises(BackendUnavailable, match="no NVIDIA GPU found"):
        get_backend("cuda")


def test_nvshmem_refused_without_gpu(no_gpu) -> None:
    with pytest.raises(BackendUnavailable) as err:
        CUDABackend({"ep_transport": "nvshmem"})
    msg = str(err.value)
    assert "ep_transport: nvshmem needs a usable NVIDIA GPU" in msg
    assert "ep_transport: alltoall" in msg  # says what would work


def test_nvshmem_refused_where_torch_reports_it_unavailable(usable_gpu, monkeypatch) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: False)
    with pytest.raises(BackendUnavailable, match=r"is_nvshmem_available\(\) is False"):
        CUDABackend({"ep_transport": "nvshmem"})
    monkeypatch.setattr(symm_mem, "is_nvshmem_available", lambda: True)
    be = CUDABackend({"ep_transport": "nvshmem"})  # accepted where torch reports it available
    assert be.ep_transport == "nvshmem"


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match=r"ep_transport: 'deepep' is not a transport of backend 'cuda' \(its transports: alltoall, nvshmem\)"):
        CUDABackend({"ep_transport": "deepep"})
    with pytest.raises(ValueError, match="dist_backend: 'mpi' is not one of nccl, gloo"):
        CUDABackend({"dist_backend": "mpi"})


def test_process_group_kwargs_bind_nccl_to_the_device_only(monkeypatch) -> None:
    monkeypatch.setattr(CUDABackend, "device_count", classmethod(lambda cls: 2))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert CUDABackend().process_group_kwargs() == {"device_id": torch.device("cuda", 1)}  # 3 % 2 GPUs
    assert CUDABackend({"dist_backend": "gloo"}).process_group_kwargs() == {}


def test_default_expert_transport_is_the_base_all_to_all() -> None:
    assert CUDABackend().ep_transport == "alltoall"
    assert "expert_all_to_all" in CUDABackend.__dict__  # overridden only to route nvshmem


def test_fused_grouped_mm_only_for_bf16_on_hopper_and_blackwell() -> None:
    for cap, expect in [((9, 0), True), ((10, 0), True), ((8, 0), False), ((8, 9), False), ((12, 0), False)]:
        assert fused_grouped_mm_supported(torch.bfloat16, cap) is expect, cap
    for dtype in (torch.float32, torch.float16, torch.float64):
        assert fused_grouped_mm_supported(dtype, (9, 0)) is False


def test_fused_path_needs_16_byte_strides_too() -> None:
    a = torch.zeros(8, 16, dtype=torch.bfloat16)
    b = torch.zeros(2, 16, 8, dtype=torch.bfloat16)
    assert fused_path_ok(a, b, (9, 0))
    assert not fused_path_ok(a, b, (8, 0))
    odd = torch.zeros(8, 13, dtype=torch.bfloat16)  # 26-byte rows
    assert not fused_path_ok(odd, torch.zeros(2, 13, 8, dtype=torch.bfloat16), (9, 0))
    assert not fused_path_ok(a.float(), b.float(), (9, 0))


def test_grouped_mm_dispatch_and_fallback(monkeypatch) -> None:
    """CPU tensors take the loop; the fused branch passes int32 offs and gives the same numbers."""
    be = CUDABackend()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    offs = torch.tensor([4, 4, 10])
    assert be.grouped_mm_fused(a, b) is False
    ref = grouped_mm_reference(a, b, offs)
    torch.testing.assert_close(be.grouped_mm(a, b, offs), ref)
    seen = {}
    real = torch.nn.functional.grouped_mm

    def spy(x, y, *, offs):
        seen["offs_dtype"] = offs.dtype
        return real(x, y, offs=offs)

    monkeypatch.setattr(be, "grouped_mm_fused", lambda x, y: True)
    monkeypatch.setattr(torch.nn.functional, "grouped_mm", spy)
    torch.testing.assert_close(be.grouped_mm(a, b, offs), ref)
    assert seen["offs_dtype"] == torch.int32


def test_timer_is_event_based(monkeypatch) -> None:
    assert CUDABackend.timer is not Backend.timer
    # A CPU-only torch cannot make CUDA events at all; the factory is what makes them.
    made = []
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: made.append(kw) or types.SimpleNamespace(**kw))
    assert isinstance(CUDABackend().timer(), EventTimer)
    assert made == [{"enable_timing": True}, {"enable_timing": True}]


def test_expert_all_to_all_routes_by_transport(monkeypatch) -> None:
    """alltoall goes to NCCL; nvshmem to the NVSHMEM transport, except on a one-rank group
    (nothing to send, no symmetric buffers made for it)."""
    from portapipe.backends import nvshmem

    from .standin_nvshmem import SymmMemDouble, install

    install(monkeypatch.setattr, SymmMemDouble())
    nccl_calls, nvshmem_calls = [], []
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, **k: nccl_calls.append(k))
    monkeypatch.setattr(nvshmem.NvshmemTransport, "all_to_all", lambda self, *a, **k: nvshmem_calls.append(a))
    world = {"size": 2}
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: world["size"])
    x, out, group = torch.randn(4, 2), torch.empty(4, 2), types.SimpleNamespace(group_name="g")
    CUDABackend().expert_all_to_all(out, x, [4], [4], group=group)
    assert (len(nccl_calls), len(nvshmem_calls)) == (1, 0)
    be = CUDABackend({"ep_transport": "nvshmem", "nvshmem_buffer_mb": 1})
    be.expert_all_to_all(out, x, [4], [4], group=group)
    assert (len(nccl_calls), len(nvshmem_calls)) == (1, 1)
    assert be._nvshmem.capacity_bytes == 2**20
    world["size"] = 1
    be.expert_all_to_all(out, x, [4], [4], group=group)
    assert (len(nccl_calls), len(nvshmem_calls)) == (2, 1)


@pytest.mark.parametrize("mb", [0, -1, float("nan"), float("inf"), "64", True, 0.0001])
def test_bad_nvshmem_buffer_size_is_refused_at_construction(mb) -> None:
    """Before any rank starts (the CLI builds the backend first), in one line naming the option."""
    with pytest.raises(ValueError, match=r"backend_options\.nvshmem_buffer_mb: .* is not a size in MiB"):
        CUDABackend({"nvshmem_buffer_mb": mb})
    assert CUDABackend({"nvshmem_buffer_mb": 0.5}).nvshmem_buffer_bytes == 2**19


def test_cli_refuses_a_bad_backend_option_with_exit_2(monkeypatch, capsys) -> None:
    """On a machine with a GPU (simulated), a refused option value is a config error: one line, exit 2."""
    from portapipe.cli import main

    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: True))
    code = main(["verify", str(ROOT / "examples" / "cuda.yaml"), "--set", "backend_options.nvshmem_buffer_mb=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("portapipe: config error: backend_options.nvshmem_buffer_mb: 0 is not a size in MiB")


# ------------------------------------------------- several ranks on one GPU (gloo between them)
@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with one usable GPU, as NVML counts it (no CUDA context made)."""
    monkeypatch.setattr(CUDABackend, "device_count", classmethod(lambda cls: 1))
    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: True))


def test_more_ranks_than_gpus_over_nccl_is_refused_naming_gloo(one_gpu) -> None:
    msg = CUDABackend.launch_problem(4, {})
    assert msg is not None and "\n" not in msg
    assert "4 ranks on this machine but 1 GPU" in msg and "backend_options.dist_backend: gloo" in msg
    assert CUDABackend.launch_problem(1, {}) is None  # one rank per GPU: NCCL's case
    assert CUDABackend.launch_problem(4, {"dist_backend": "gloo"}) is None  # ranks share the GPU over gloo
    assert CUDABackend.launch_problem(4, {"dist_backend": "nccl"}) == msg


def test_no_gpu_is_left_to_the_availability_message(no_gpu) -> None:
    assert CUDABackend.launch_problem(4, {}) is None


def test_the_refusal_comes_before_any_rank_starts(one_gpu, monkeypatch) -> None:
    from portapipe.ranks import launch

    started = []
    monkeypatch.setattr(launch, "LocalJob", lambda *a, **k: started.append(a))
    with pytest.raises(BackendUnavailable, match="backend_options.dist_backend: gloo"):
        launch.run_ranks(print, 2, backend="cuda")
    assert started == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun's one rank per GPU on this node
    monkeypatch.setattr(launch, "under_torchrun", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(launch, "_rank_main", lambda *a: "ran")
    assert launch.run_ranks(print, 2, backend="cuda") == ["ran"]


def test_cli_refuses_four_ranks_on_one_gpu_with_exit_2_in_one_line(one_gpu, monkeypatch, capsys, tmp_path) -> None:
    from portapipe.cli import main

    monkeypatch.chdir(tmp_path)
    code = main(["verify", str(ROOT / "examples" / "cuda.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("portapipe: backend 'cuda': 4 ranks on this machine but 1 GPU") and "dist_backend: gloo" in err[0]


def test_gloo_between_ranks_stages_point_to_point_and_nccl_does_not(monkeypatch) -> None:
    from portapipe.backends.staged_p2p import HostStagedP2P

    monkeypatch.setattr(CUDABackend, "device_count", classmethod(lambda cls: 1))
    gloo, nccl = CUDABackend({"dist_backend": "gloo"}), CUDABackend()
    assert isinstance(gloo._staged_p2p, HostStagedP2P) and nccl._staged_p2p is None
    seen = []
    monkeypatch.setattr(gloo._staged_p2p, "batch_isend_irecv", lambda ops: seen.append(ops) or ["staged"])
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: ["direct"])
    assert gloo.batch_isend_irecv(["op"]) == ["staged"] and seen == [["op"]]
    assert nccl.batch_isend_irecv(["op"]) == ["direct"]


def test_the_cuda_staging_pins_its_host_buffers_and_copies_without_blocking() -> None:
    from portapipe.backends.cuda import cuda_staging

    staging = cuda_staging(torch.device("cuda", 0))
    copies = []

    class Spy:
        def copy_(self, src, non_blocking=False):
            copies.append(non_blocking)

    staging.to_host(Spy(), torch.zeros(1))
    staging.to_device(Spy(), torch.zeros(1))
    assert copies == [True, True]
    assert staging.on_host(torch.zeros(1)) and not staging.on_host(torch.zeros(1, device="meta"))


def test_the_one_gpu_starter_is_the_cuda_example_with_gloo_between_ranks() -> None:
    """examples/cuda_1gpu.yaml: examples/cuda.yaml with only a backend_options line added, and the
    run's folder its own."""
    import yaml

    from portapipe.config import load_config

    cuda = (ROOT / "examples" / "cuda.yaml").read_text().splitlines()
    one = (ROOT / "examples" / "cuda_1gpu.yaml").read_text().splitlines()
    body = [line for line in one if not line.startswith("#")]
    assert [line for line in body if line not in cuda] == ["backend_options: {dist_backend: gloo}", "  dir: runs/cuda_1gpu"]
    assert [line for line in cuda if not line.startswith("#") and line not in body] == ["  dir: runs/cuda"]
    raw_one, raw_cuda = yaml.safe_load("\n".join(one)), yaml.safe_load("\n".join(cuda))
    assert raw_one["log"].pop("dir") == "runs/cuda_1gpu" and raw_cuda["log"].pop("dir") == "runs/cuda"
    assert raw_one.pop("backend_options") == {"dist_backend": "gloo"} and raw_one == raw_cuda
    assert load_config(ROOT / "examples" / "cuda_1gpu.yaml").backend_options == {"dist_backend": "gloo"}


# ------------------------------------------------------------------------------ GPU tests
def _gmm_operands(form: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if form == "2d3d":
        return torch.randn(128, 64, generator=g, dtype=torch.float64), torch.randn(4, 64, 32, generator=g, dtype=torch.float64)
    return torch.randn(64, 128, generator=g, dtype=torch.float64), torch.randn(128, 32, generator=g, dtype=torch.float64)


def _gmm_tol(dtype: torch.dtype) -> dict:
    return dict(rtol=2e-2, atol=2e-1) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
def test_cuda_grouped_mm_equals_cpu_reference(dtype, form) -> None:
    from portapipe.backends import get_backend

    be = get_backend("cuda")
    g = torch.Generator().manual_seed(4)
    offs = torch.tensor([16, 16, 48, 128])  # an empty group included
    a, b = _gmm_operands(form, g)
    a_dev = a.to(be.device(), dtype).requires_grad_()
    b_dev = b.to(be.device(), dtype).requires_grad_()
    expect_fused = fused_path_ok(a_dev, b_dev, torch.cuda.get_device_capability(be.device()))
    assert be.grouped_mm_fused(a_dev, b_dev) is expect_fused
    out = be.grouped_mm(a_dev, b_dev, offs.to(be.device()))
    a_ref, b_ref = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = grouped_mm_reference(a_ref, b_ref, offs)
    torch.testing.assert_close(out.double().cpu(), ref, **_gmm_tol(dtype))
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    (out.float() * w.to(be.device())).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(a_dev.grad.double().cpu(), a_ref.grad, **_gmm_tol(dtype))
    torch.testing.assert_close(b_dev.grad.double().cpu(), b_ref.grad, **_gmm_tol(dtype))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["2d3d", "2d2d"])
def test_cuda_grouped_mm_on_transposed_views(dtype, form) -> None:
    """The layouts an expert layer's backward passes: ``weight.transpose(1, 2)`` and ``x.t()``."""
    from portapipe.backends import get_backend

    be = get_backend("cuda")
    g = torch.Generator().manual_seed(5)
    offs = torch.tensor([16, 16, 48, 128])
    a, b = _gmm_operands(form, g)
    if form == "2d3d":
        a_dev = a.to(be.device(), dtype)
        b_dev = b.transpose(1, 2).contiguous().to(be.device(), dtype).transpose(1, 2)  # column-major view
    else:
        a_dev = a.t().contiguous().to(be.device(), dtype).t()
        b_dev = b.to(be.device(), dtype)
    out = be.grouped_mm(a_dev, b_dev, offs.to(be.device()))
    torch.testing.assert_close(out.double().cpu(), grouped_mm_reference(a, b, offs), **_gmm_tol(dtype))


def _busy(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x @ x) * 0.5
    return x


@pytest.mark.cuda
def test_cuda_event_timer_measures_device_time() -> None:
    import time

    from portapipe.backends import get_backend

    be = get_backend("cuda")
    be.set_device()
    x = torch.randn(2048, 2048, device=be.device())
    _busy(x, 2)
    be.synchronize()
    wall0 = time.perf_counter()
    with be.timed() as t:
        _busy(x, 40)
    wall = time.perf_counter() - wall0  # includes the wait in stop(): device time <= wall
    assert 0 < t.elapsed_s <= wall * 1.05
    # The launches return at once; the events see the kernels, so the figure is most of the wall time.
    assert t.elapsed_s >= 0.5 * wall


@pytest.mark.cuda
def test_cuda_comm_stream_copy_overlaps_compute_stream() -> None:
    """A copy on the communication stream runs while matmuls run on the compute stream."""
    from portapipe.backends import get_backend

    be = get_backend("cuda")
    be.set_device()
    dev = be.device()
    x = torch.randn(4096, 4096, device=dev)
    payload = torch.randn(64 * 2**20, device=dev)  # 256 MiB to host over the copy engine
    host = torch.empty(payload.shape, pin_memory=True)
    _busy(x, 2)
    be.synchronize()
    compute, comm = be.compute_stream(), be.comm_stream()
    assert comm != compute
    ev = {k: be.event(enable_timing=True) for k in ("ref", "c0", "c1", "m0", "m1")}
    ev["ref"].record(compute)
    comm.wait_event(ev["ref"])
    with be.stream(comm):
        ev["c0"].record()
        host.copy_(payload, non_blocking=True)
        ev["c1"].record()
    ev["m0"].record(compute)
    _busy(x, 30)
    ev["m1"].record(compute)
    be.synchronize()
    t = {k: ev["ref"].elapsed_time(e) for k, e in ev.items() if k != "ref"}  # ms since ref
    overlap = min(t["c1"], t["m1"]) - max(t["c0"], t["m0"])
    shorter = min(t["c1"] - t["c0"], t["m1"] - t["m0"])
    assert overlap > 0.5 * shorter, t
    assert torch.equal(host[:1000], payload[:1000].cpu())


@pytest.mark.cuda
def test_cuda_memory_figures_and_rng_state() -> None:
    from portapipe.backends import get_backend

    be = get_backend("cuda")
    be.set_device()
    be.reset_peak_memory_stats()
    before = be.memory_allocated()
    x = torch.empty(2**20, device=be.device())
    assert be.memory_allocated() >= before + x.numel() * 4
    assert be.max_memory_allocated() >= be.memory_allocated()
    state = be.get_rng_state()
    first = torch.rand(4, device=be.device())
    be.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=be.device()), first)


def nvshmem_vs_nccl_all_to_all(backend: CUDABackend) -> bool:
    """Rank r sends r+j+1 rows of width 5 to rank j, once over NVSHMEM and once over NCCL."""
    rank, world = dist.get_rank(), dist.get_world_size()
    in_splits = [rank + j + 1 for j in range(world)]
    out_splits = [j + rank + 1 for j in range(world)]
    inp = torch.randn(sum(in_splits), 5, device=backend.device()) + 100 * rank
    got = torch.empty(sum(out_splits), 5, device=backend.device())
    backend.setup_expert_transport(None)  # collective at setup, on every rank
    for _ in range(3):  # the same buffers again and again, as the expert layers use them
        backend.expert_all_to_all(got, inp, out_splits, in_splits, async_op=True).wait()
    want = torch.empty_like(got)
    backend.all_to_all_single(want, inp, out_splits, in_splits)
    backend.synchronize()
    return bool(torch.equal(got, want))


@pytest.mark.cuda
@pytest.mark.multiproc
def test_nvshmem_expert_all_to_all_equals_nccl() -> None:
    if CUDABackend.device_count() < 2:
        pytest.skip("needs 2 NVIDIA GPUs for an NVSHMEM all-to-all (one GPU per rank)")
    if CUDABackend.nvshmem_unavailable_reason():
        pytest.skip(CUDABackend.nvshmem_unavailable_reason())
    from portapipe.ranks.launch import run_ranks

    got = run_ranks(nvshmem_vs_nccl_all_to_all, 2, backend="cuda", backend_options={"ep_transport": "nvshmem"})
    assert got == [True, True]


def _verify_on_cuda(overrides: list[str]) -> dict:
    if not (ROOT / "portapipe" / "commands" / "verify.py").exists():
        pytest.fail("portapipe/commands/verify.py is missing: `portapipe verify` cannot be checked on the GPU")
    cmd = [sys.executable, "-m", "portapipe.cli", "verify", str(ROOT / "examples" / "cuda.yaml")]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(result) >= {"schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok"}
    return result


@pytest.mark.cuda
def test_portapipe_verify_on_cuda_one_rank() -> None:
    """examples/cuda.yaml's DualPipeV step on one GPU equals the single-process float64 step."""
    result = _verify_on_cuda(["parallel.pp=1", "parallel.ep=1"])
    assert (result["schedule"], result["pp"], result["ep"]) == ("dualpipev", 1, 1)
    assert result["ok"] is True, result


@pytest.mark.cuda
@pytest.mark.multiproc
def test_portapipe_verify_on_cuda_two_ranks() -> None:
    """Two pipeline ranks: one GPU each over NCCL, or sharing one GPU over gloo (NCCL refuses that)."""
    overrides = ["parallel.pp=2", "parallel.ep=1"]
    if CUDABackend.device_count() < 2:
        overrides.append("backend_options.dist_backend=gloo")
    result = _verify_on_cuda(overrides)
    assert (result["pp"], result["ep"]) == (2, 1)
    assert result["ok"] is True, result
