"""The conformance kit (portapipe.testing) on the cpu backend, the cuda and npu doubles, and
deliberately broken doubles; its old name (portapipe.backends.testing) saying where it went; and
the collective dtypes the device backends declare, checked against what NCCL and HCCL take
(tests/conformance/collectives.dtypes)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from portapipe.backends.ascend import AscendBackend
from portapipe.backends.base import TENSOR_COLLECTIVE_NAMES
from portapipe.backends.capabilities import Capabilities
from portapipe.backends.cpu import CPUBackend
from portapipe.backends.cuda import CUDABackend
from portapipe.backends.grouped_mm import grouped_mm_reference
from portapipe.ranks.launch import run_ranks
from portapipe.testing import LOCAL, RANK_LINES, grouped_mm_tolerance, run_local, run_ranks_contracts

from . import declared, kit_doubles
from .standin_torch_npu import make_standin
from .test_backend_conformance import _strict_cuda

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")  # the doubles play their device on CPU memory


@pytest.fixture()
def npu_double(monkeypatch: pytest.MonkeyPatch) -> AscendBackend:
    mod = make_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    return AscendBackend()


@pytest.fixture()
def cuda_double(monkeypatch: pytest.MonkeyPatch) -> CUDABackend:
    _strict_cuda(monkeypatch)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    return CUDABackend()


def _passes(results: dict[str, str | None]) -> None:
    assert list(results) == [c.line for c in LOCAL]
    assert {line: msg for line, msg in results.items() if msg} == {}


def test_cpu_passes_every_local_line() -> None:
    _passes(run_local(CPUBackend()))


@pytest.mark.multiproc
def test_cpu_passes_every_rank_line() -> None:
    assert run_ranks_contracts("cpu") == {line: None for line, *_ in RANK_LINES}


def test_the_cuda_double_passes_every_local_line(cuda_double: CUDABackend) -> None:
    _passes(run_local(cuda_double, device=CPU))


def test_the_npu_double_passes_every_local_line(npu_double: AscendBackend) -> None:
    _passes(run_local(npu_double, device=CPU))
    # the group-limit line really ran the kernel at the limit and the loop past it
    groups = [c["group_list"].numel() for c in sys.modules["torch_npu"].recorder.of("npu_grouped_matmul")]
    assert 1024 in groups and 1025 not in groups


class BrokenBackend(CPUBackend):
    """Two faults a plug-in could ship: grouped matmul skips the last group, and the declaration
    promises allocator figures the backend does not give."""

    name = "broken"
    capabilities = Capabilities(**{**CPUBackend.capabilities.__dict__, "memory_stats": True})

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        out = grouped_mm_reference(a, b, offs)
        if b.dim() == 3 and offs.numel() > 1:
            out = out.index_fill(0, torch.arange(int(offs[-2]), int(offs[-1])), 0.0)
        return out


def test_a_broken_double_is_caught_by_the_lines_it_breaks() -> None:
    results = run_local(BrokenBackend())
    failed = {line for line, msg in results.items() if msg}
    assert failed == {"grouped-mm-matches-reference", "memory-figures"}
    assert results["grouped-mm-matches-reference"].startswith("[grouped-mm-matches-reference] float64, 5 groups: 2d x 3d result is")
    assert "memory_allocated() = None" in results["memory-figures"]


def test_a_span_clock_other_than_the_declared_timer_fails_its_line() -> None:
    """A backend declaring device events must time a recorded step's spans by them, not by the host clock."""

    class DeclaresEvents(CPUBackend):
        name = "declares-events"
        capabilities = Capabilities(**{**CPUBackend.capabilities.__dict__, "timer": "events"})

    results = run_local(DeclaresEvents())
    assert results["span-clock"] == "[span-clock] capabilities.timer is 'events' but span_clock() is a SpanClock"


@pytest.mark.multiproc
def test_an_all_reduce_that_ignores_its_op_fails_the_reductions() -> None:
    """The kit once tested SUM only: a backend summing for MAX passed it."""
    results = run_ranks(kit_doubles.rank_lines_of, 2, "ignores-op")[0]
    failed = {line: msg for line, msg in results.items() if msg}
    assert set(failed) == {"reductions", "reduce-scatter-all-gather"}, failed
    assert failed["reductions"] == "[reductions] float64 all_reduce PRODUCT: [5.0, -5.0, 2.5], want [6.0, 6.0, 1.5]"
    assert failed["reduce-scatter-all-gather"].startswith("[reduce-scatter-all-gather] float64 reduce_scatter_tensor PRODUCT: ")


def test_a_grouped_matmul_2_percent_off_in_bfloat16_only_fails_and_a_correct_one_passes() -> None:
    """bfloat16's tolerance is derived as verify's (1.6e-2 for the kit's sums of 8): the old 3e-2
    let a kernel 2% off through; the cpu backend's, correct, errs by about 3e-3 and passes."""
    results = run_local(kit_doubles.Bfloat16Off())
    failed = {line: msg for line, msg in results.items() if msg}
    assert list(failed) == ["grouped-mm-matches-reference"], failed
    assert failed["grouped-mm-matches-reference"].startswith("[grouped-mm-matches-reference] bfloat16, 5 groups: 2d x 3d result is 0.02")
    assert 1.5e-2 < grouped_mm_tolerance("bfloat16", 8) < 2e-2
    assert grouped_mm_tolerance("float16", 8) < 2e-3 and grouped_mm_tolerance("float32", 8) < 1e-6
    _passes(run_local(CPUBackend()))


def test_the_old_name_of_the_kit_names_the_new_one(tmp_path: Path) -> None:
    """`pytest --pyargs portapipe.backends.testing` (and an import from it) is refused with the
    line to run instead, not a bare "module not found" nor a kit that reaches the launcher from
    the backends."""
    with pytest.raises(ImportError, match="pytest --pyargs portapipe.testing"):
        from portapipe.backends.testing import run_local  # noqa: F401
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "portapipe.backends.testing"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "1 failed" in proc.stdout, proc.stdout[-2000:]
    assert "the conformance kit moved from portapipe.backends.testing to portapipe.testing: run PORTAPIPE_CONFORMANCE_BACKEND=<name> " \
        "pytest --pyargs portapipe.testing" in proc.stdout


class LosesCopies(CPUBackend):
    """Host copies that drop the last element, and a declaration of a copy stream of their own
    the backend does not have."""

    name = "loses-copies"
    capabilities = Capabilities(**{**CPUBackend.capabilities.__dict__, "host_copies": "async"})

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        done = super().copy_async(dst[:-1], src[:-1])
        return done


def test_host_copies_that_lose_values_or_claim_a_stream_are_caught() -> None:
    msg = run_local(LosesCopies(), lines=tuple(c for c in LOCAL if c.line == "host-copies"))["host-copies"]
    assert msg == "[host-copies] a copy to the host buffer does not hold the device tensor's values"

    class ClaimsStream(CPUBackend):
        capabilities = LosesCopies.capabilities

    msg = run_local(ClaimsStream(), lines=tuple(c for c in LOCAL if c.line == "host-copies"))["host-copies"]
    assert msg == "[host-copies] capabilities.host_copies is async but copy_stream() is the compute stream"


def test_the_npu_double_copies_on_a_stream_of_its_own_ordered_by_events(npu_double: AscendBackend) -> None:
    rec = sys.modules["torch_npu"].recorder
    src = torch.arange(8.0)
    host = npu_double.host_buffer(8, torch.float32, CPU)
    done = npu_double.copy_async(host, src)
    copy = npu_double.copy_stream()
    assert copy is npu_double.copy_stream() and copy != npu_double.compute_stream()
    issued = [c["event"] for c in rec.of("Event.record")]
    # the copy stream waits for what the compute stream issued, then records its own event
    assert [c["event"] for c in rec.of("Stream.wait_event")] == [issued[0]] and rec.of("Stream.wait_event")[0]["stream"] == copy
    assert issued[1] is done and done.recorded_on == copy
    npu_double.wait_copy(done)
    assert sys.modules["torch_npu"].npu.waited_on(npu_double.compute_stream()) == [done]
    assert torch.equal(host, src)


def test_the_npu_double_refuses_what_torch_npu_refuses(npu_double: AscendBackend) -> None:
    npu = sys.modules["torch_npu"].npu
    with pytest.raises(TypeError, match="wait_event takes a torch_npu.npu.Event, got Event"):
        npu_double.copy_stream().wait_event(torch.cpu.Event())
    with pytest.raises(TypeError, match="Event.record takes a torch_npu.npu.Stream, got Stream"):
        npu.Event().record(torch.cpu.Stream())
    with pytest.raises(TypeError, match="npu.stream takes a torch_npu.npu.Stream"):
        npu.stream(torch.cpu.Stream())
    ev = npu.Event()
    ev.record(npu.Stream(device=0))
    with pytest.raises(RuntimeError, match="an event of device 0 recorded on a stream of device 1"):
        ev.record(npu.Stream(device=1))


def test_a_declaration_is_checked_before_behaviour() -> None:
    class Undeclared(CPUBackend):
        capabilities = Capabilities(dist_backend="nccl", compute_dtypes=("float64",), reduce_dtypes=(), move_dtypes=())

    msg = run_local(Undeclared(), lines=LOCAL[:1])["capabilities-declared"]
    assert "must include float32" in msg and "lacks float64" in msg and "'nccl' != the class's dist_backend 'gloo'" in msg


# --------------------------------------- collectives against the libraries' dtype tables
class _Work:
    def wait(self) -> None:
        return None


def _strict_collectives(monkeypatch: pytest.MonkeyPatch, library: str) -> list[tuple[str, str]]:
    """Replace the torch.distributed calls the backends make by ones that bind to torch's own
    signature and refuse a dtype ``library`` does not take for that call, as the library would."""
    table = declared.collective_dtypes()
    seen: list[tuple[str, str]] = []

    def strict(call: str, real: Any) -> Any:
        sig = inspect.signature(real)

        def fn(*args: Any, **kwargs: Any) -> Any:
            bound = sig.bind(*args, **kwargs).arguments
            if call == "batch_isend_irecv":
                tensors = [op.tensor for op in bound["p2p_op_list"]]
            else:
                tensors = [v for v in bound.values() if isinstance(v, torch.Tensor)]
                tensors += [t for v in bound.values() if isinstance(v, list) for t in v if isinstance(t, torch.Tensor)]
            for t in tensors:
                name = str(t.dtype).removeprefix("torch.")
                if name not in table[library, call]:
                    raise TypeError(f"{library} {call}: dtype {name} is not supported (it takes {', '.join(table[library, call])})")
                seen.append((call, name))
            return [_Work()] if call == "batch_isend_irecv" else _Work()

        return fn

    # the table names torch >= 2.13's calls; an older torch has the tensor collectives' old names
    older = {names[0]: names[-1] for names in TENSOR_COLLECTIVE_NAMES.values()}
    for library_, call in table:
        if library_ == library:
            name = call if hasattr(dist, call) else older[call]
            monkeypatch.setattr(dist, name, strict(call, getattr(dist, name)))
    return seen


def _drive(be: Any, dtype: str, family: str) -> None:
    t = torch.ones(4, dtype=getattr(torch, dtype))
    if family == "reduce":
        be.all_reduce(t)
        be.reduce_scatter_tensor(t[:2], t)
    else:
        be.all_to_all_single(t.clone(), t, [2, 2], [2, 2])
        be.all_gather_into_tensor(torch.empty(8, dtype=t.dtype), t)
        be.all_gather([t.clone(), t.clone()], t)
        be.broadcast(t, src=0)
        be.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, group=object())])


@pytest.mark.parametrize("library", ["nccl", "hccl"])
def test_every_declared_dtype_is_one_the_library_takes_and_the_double_refuses_the_rest(
    library: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    be = request.getfixturevalue("cuda_double" if library == "nccl" else "npu_double")
    caps = type(be).capabilities
    assert caps.dist_backend == library
    seen = _strict_collectives(monkeypatch, library)
    monkeypatch.setattr(dist, "P2POp", lambda op, tensor, peer, group=None, tag=0: type("Op", (), {"tensor": tensor})())
    for family, dtypes in (("reduce", caps.reduce_dtypes), ("move", caps.move_dtypes)):
        for dtype in dtypes:
            _drive(be, dtype, family)
    calls = {c for c, _ in seen}
    assert calls == {"all_reduce", "reduce_scatter_single", "all_to_all_single", "all_gather_single", "all_gather", "broadcast", "batch_isend_irecv"}
    undeclared = [d for d in ("float64", "float32", "bfloat16", "float16") if d not in caps.reduce_dtypes]
    for dtype in undeclared:  # what the backend does not declare, the library refuses
        with pytest.raises(TypeError, match=f"{library} all_reduce: dtype {dtype} is not supported"):
            be.all_reduce(torch.ones(2, dtype=getattr(torch, dtype)))
    assert undeclared == ([] if library == "nccl" else ["float64"])
