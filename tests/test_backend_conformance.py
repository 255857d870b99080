"""Conformance of the device backends with the real libraries' declarations.

tests/conformance/ holds the schema lines of every torch and torch_npu API the backends call,
copied from torch 2.14.1 (CUDA build) and torch_npu 2.14.0 by ci/refresh_schemas.py. These
tests check that the files name their releases, that every API the backend modules use is
declared there, that the test doubles have exactly the declared signatures, and that every
call the backends make binds to the declarations (names, keyword-only arguments, types,
defaults, overloads).
"""

from __future__ import annotations

import gzip
import inspect
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portapipe.backends.ascend import AscendBackend
from portapipe.backends.cuda import CUDABackend

from . import declared
from .standin_torch_npu import StandinEvent, StandinStream, make_standin

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ROOT / "portapipe" / "backends"


def test_declarations_name_the_releases_they_were_read_from() -> None:
    torch_decl, npu_decl = declared.load("torch"), declared.load("torch_npu")
    assert torch_decl.version == "2.14.1+cu130" and torch_decl.path.name == "torch-2.14.1.schemas"
    assert npu_decl.version == "2.14.0" and npu_decl.path.name == "torch_npu-2.14.0.schemas"
    assert npu_decl.requires == "torch==2.14.0.*"  # torch_npu pins the torch it was built for
    assert set(torch_decl.ops) == {"aten::_grouped_mm", "symm_mem::all_to_all_vdev"}
    assert [s.overload_name for s in npu_decl.ops["npu_grouped_matmul"]] == ["", "List"]


def _used(pattern: str) -> set[str]:
    found = set()
    for path in BACKENDS.glob("*.py"):
        found |= set(re.findall(pattern, path.read_text()))
    return found


def test_every_api_the_backends_use_is_declared() -> None:
    """A backend using an API of torch.cuda, symmetric memory or torch_npu that is not in the
    declarations fails here: record it with ci/refresh_schemas.py first."""
    t, npu = declared.load("torch"), declared.load("torch_npu")
    cuda = _used(r"\btorch\.cuda\.(\w+)") | {f"backends.cuda.{n}" for n in _used(r"\btorch\.backends\.cuda\.(\w+)")}
    assert cuda >= {"Event", "Stream", "current_stream", "get_device_capability"}
    assert sorted(n for n in cuda if f"torch.cuda.{n}" not in t.py and f"torch.{n}" not in t.py) == []
    symm = _used(r"\bsymm_mem\.(\w+)\(")
    assert symm == {"empty", "rendezvous", "set_backend", "get_backend", "is_nvshmem_available"}
    assert sorted(n for n in symm if f"torch.distributed._symmetric_memory.{n}" not in t.py) == []
    assert _used(r"torch\.ops\.symm_mem\.(\w+)") == {"all_to_all_vdev"}
    assert "_fused_grouped_mm()(" in (BACKENDS / "cpu.py").read_text()  # torch.nn.functional.grouped_mm
    npu_module = _used(r"(?:_npu\(\)|\bnpu)\.(\w+)\(")
    assert sorted(n for n in npu_module if f"torch_npu.npu.{n}" not in npu.py) == []
    assert _used(r"_import_torch_npu\(\)\.(\w+)") == {"npu", "npu_grouped_matmul", "profiler"}
    assert sorted(n for n in _used(r"\bprofiler\.(\w+)\(") if f"torch_npu.profiler.{n}" not in npu.py) == []  # torch_npu's profiler
    # Methods called on streams and events of either device.
    for method in ("record", "synchronize", "elapsed_time", "query"):
        assert f"torch.cuda.Event.{method}" in t.py and f"torch_npu.npu.Event.{method}" in npu.py
    for method in ("wait_event", "wait_stream"):
        assert f"torch.cuda.Stream.{method}" in t.py and f"torch_npu.npu.Stream.{method}" in npu.py


def _params(sig: inspect.Signature, drop_first: bool) -> list[tuple]:
    ps = list(sig.parameters.values())[1 if drop_first else 0 :]
    return [(p.name, p.kind, p.default) for p in ps]


def test_torch_npu_standin_has_exactly_the_declared_signatures() -> None:
    decl = declared.load("torch_npu")
    mod = make_standin()
    for dotted, sig in decl.py.items():
        parts = dotted.split(".")[2:]  # after torch_npu.npu or torch_npu.profiler
        if dotted.startswith("torch_npu.profiler."):
            cls = mod.profiler.profile
            fn, drop = (cls.__init__, True) if len(parts) == 1 else (getattr(cls, parts[1]), True)
        elif parts[0] in ("Stream", "Event"):
            cls = StandinStream if parts[0] == "Stream" else StandinEvent
            fn, drop = (cls.__new__, True) if len(parts) == 1 else (getattr(cls, parts[1]), True)
        else:
            fn, drop = getattr(mod.npu, parts[0]), False  # bound methods of the module stand-in
        assert _params(inspect.signature(fn), drop) == _params(sig, False), dotted


def test_installed_torch_declares_the_same_op_schemas() -> None:
    """The torch this suite runs with agrees with the recorded release on the ops the backends call."""
    for name, schemas in declared.load("torch").ops.items():
        ns, op = name.split("::")
        packet = getattr(getattr(torch.ops, ns), op)
        assert [str(packet.default._schema)] == [str(s) for s in schemas if s.overload_name == ""], name


# ------------------------------------------------------------- the calls themselves
def _strict_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict]]:
    """Replace every declared torch.cuda function by one that binds its call to the declaration."""
    decl = declared.load("torch")
    calls: list[tuple[str, dict]] = []
    returns = {
        "device_count": 2, "is_available": True, "get_device_capability": (9, 0), "memory_allocated": 5,
        "max_memory_allocated": 7, "get_rng_state": torch.zeros(8, dtype=torch.uint8), "is_built": True,
        "get_device_properties": types.SimpleNamespace(name="stand-in", major=9, minor=0, total_memory=80 * 2**30, multi_processor_count=132),
    }

    class Strict:
        def __init__(self, dotted: str) -> None:
            self.dotted = dotted

        def __call__(self, *args, **kwargs):
            calls.append((self.dotted, decl.bind_py(self.dotted, *args, **kwargs)))
            name = self.dotted.rsplit(".", 1)[1]
            if name in ("Stream", "Event"):
                return _StrictObject(self.dotted, decl, calls)
            if name == "current_stream":
                return _StrictObject("torch.cuda.Stream", decl, calls)
            if name == "stream":
                return __import__("contextlib").nullcontext()
            return returns.get(name)

    for dotted in decl.py:
        parts = dotted.split(".")
        if parts[:2] == ["torch", "cuda"] and len(parts) == 3:
            monkeypatch.setattr(torch.cuda, parts[2], Strict(dotted))
    monkeypatch.setattr(torch.backends.cuda, "is_built", Strict("torch.backends.cuda.is_built"))
    return calls


class _StrictObject:
    """A CUDA stream or event whose method calls bind to the declared methods."""

    def __init__(self, dotted: str, decl: declared.Declarations, calls: list) -> None:
        self._dotted, self._decl, self._calls = dotted, decl, calls

    def __getattr__(self, name: str):
        dotted = f"{self._dotted}.{name}"

        def method(*args, **kwargs):
            self._calls.append((dotted, self._decl.bind_py(dotted, *args, **kwargs)))
            return 1.0 if name == "elapsed_time" else True

        return method


def test_every_cuda_call_binds_to_the_declarations(monkeypatch) -> None:
    calls = _strict_cuda(monkeypatch)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    be = CUDABackend()
    be.set_device()
    compute, comm = be.compute_stream(), be.comm_stream()
    with be.stream(comm):
        ev = be.event(enable_timing=True)
        ev.record()
    compute.wait_event(ev)
    be.synchronize()
    assert (be.memory_allocated(), be.max_memory_allocated()) == (5, 7)
    be.reset_peak_memory_stats()
    be.set_rng_state(be.get_rng_state())
    with be.timed():
        pass
    assert be.describe()["capability"] == "9.0"
    used = {name for name, _ in calls}
    assert used >= {
        "torch.cuda.set_device", "torch.cuda.current_stream", "torch.cuda.Stream", "torch.cuda.stream",
        "torch.cuda.Event", "torch.cuda.Event.record", "torch.cuda.Event.synchronize", "torch.cuda.Event.elapsed_time",
        "torch.cuda.Stream.wait_event", "torch.cuda.synchronize", "torch.cuda.memory_allocated",
        "torch.cuda.reset_peak_memory_stats", "torch.cuda.get_rng_state", "torch.cuda.set_rng_state",
        "torch.cuda.get_device_properties",
    }
    stream_call = next(kw for name, kw in calls if name == "torch.cuda.Stream")
    assert stream_call["priority"] == -1  # a keyword torch.cuda.Stream declares


def test_process_group_calls_of_the_device_backends_bind_to_the_declarations(monkeypatch) -> None:
    """init_process_group (NCCL with device_id, HCCL without) and new_group, as only a device makes them."""
    decl = declared.load("torch")
    seen: dict[str, list[dict]] = {"init_process_group": [], "new_group": []}
    for name in seen:
        dotted = f"torch.distributed.{name}"
        monkeypatch.setattr(torch.distributed, name, lambda *a, _d=dotted, _n=name, **k: seen[_n].append(decl.bind_py(_d, *a, **k)))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    _strict_cuda(monkeypatch)
    cuda = CUDABackend()
    cuda.init_process_group(rank=1, world_size=2, timeout_s=5)
    cuda.new_group([0, 1])
    mod = make_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    npu = AscendBackend()
    npu.init_process_group(rank=0, world_size=2)
    npu.new_group([0, 1])
    (nccl, hccl), groups = seen["init_process_group"], seen["new_group"]
    assert (nccl["backend"], hccl["backend"]) == ("nccl", "hccl")
    assert nccl["device_id"] == torch.device("cuda", 0) and hccl["device_id"] is None
    assert [g["backend"] for g in groups] == ["nccl", "hccl"] and groups[0]["ranks"] == [0, 1]


@pytest.mark.skipif(not hasattr(F, "grouped_mm"), reason="this torch has no torch.nn.functional.grouped_mm")
def test_fused_grouped_mm_calls_bind_to_the_declarations(monkeypatch) -> None:
    """The CPU and CUDA backends' grouped_mm calls: torch.nn.functional.grouped_mm's signature
    and aten::_grouped_mm's schema (offs an int32 tensor of stride 1)."""
    decl = declared.load("torch")
    real = F.grouped_mm
    seen = []

    def strict(*args, **kwargs):
        bound = decl.bind_py("torch.nn.functional.grouped_mm", *args, **kwargs)
        decl.bind_op("aten::_grouped_mm", bound["mat_a"], bound["mat_b"], offs=bound["offs"])
        assert bound["offs"].dtype == torch.int32 and bound["offs"].stride() == (1,)
        seen.append(bound)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", strict)
    from portapipe.backends.cpu import CPUBackend

    cuda = CUDABackend()
    monkeypatch.setattr(cuda, "grouped_mm_fused", lambda a, b: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    offs = torch.tensor([3, 3, 16])
    for be in (CPUBackend(), cuda):
        x, w = torch.randn(16, 8), torch.randn(3, 8, 4)
        be.grouped_mm(x, w, offs)
        be.grouped_mm(x.t(), torch.randn(16, 4), offs)
    assert len(seen) == 4


def test_every_torch_npu_call_binds_to_the_declarations(monkeypatch, tmp_path) -> None:
    """Drive every AscendBackend method that reaches torch_npu under the strict stand-in."""
    mod = make_standin()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setitem(sys.modules, "torch_npu.npu", mod.npu)
    be = AscendBackend()
    be.set_device()
    with be.stream(be.comm_stream()):
        ev = be.event(enable_timing=True)
        ev.record()
    be.compute_stream().wait_event(ev)
    be.synchronize()
    be.memory_allocated(), be.max_memory_allocated(), be.reset_peak_memory_stats()
    be.set_rng_state(be.get_rng_state())
    with be.timed():
        pass
    a, w, offs = torch.randn(9, 8, requires_grad=True), torch.randn(3, 8, 4, requires_grad=True), torch.tensor([2, 2, 9])
    be.grouped_mm(a, w, offs).sum().backward()
    gmm = mod.recorder.of("npu_grouped_matmul")
    assert len(gmm) == 4  # forward, input gradient, group_type 2 probe, weight gradient
    for call in gmm:
        assert call["overload"] == "" and call["split_item"] == 3 and call["group_list_type"] == 0
        assert call["group_type"] in (0, 2) and call["group_list"].dtype == torch.int64
    assert {"set_device", "Event", "Event.record", "Stream.wait_event", "synchronize"} <= set(mod.recorder.names())
    # log.profiler: torch_npu's profiler over the host and the NPU, its plain JSON gzipped where asked
    prof = be.profiler(memory=True)
    with prof:
        pass
    be.export_profile(prof, str(tmp_path / "rank0_step2.json.gz"))
    made = mod.recorder.of("profiler.profile")
    assert [repr(a) for a in made[0]["activities"]] == ["ProfilerActivity.CPU", "ProfilerActivity.NPU"] and made[0]["profile_memory"] is True
    assert gzip.open(tmp_path / "rank0_step2.json.gz").read() == b'{"traceEvents": []}' and sorted(p.name for p in tmp_path.iterdir()) == ["rank0_step2.json.gz"]


def test_npu_extra_pins_the_torch_npu_and_torch_of_the_declarations() -> None:
    tomllib = pytest.importorskip("tomllib")
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["npu"]
    decl = declared.load("torch_npu")
    assert f"torch_npu=={decl.version}" in extra
    assert decl.requires in extra  # torch_npu installs only beside the torch it was built for


def test_refresh_script_reads_the_installed_torch_as_recorded(tmp_path) -> None:
    """ci/refresh_schemas.py on the torch this suite runs with: the ops the backends call come out
    as recorded, and every Python declaration it writes parses."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("refresh_schemas", ROOT / "ci" / "refresh_schemas.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    version, lines = script.torch_lines()
    assert version == torch.__version__
    recorded = declared.load("torch")
    ops = [line[4:] for line in lines if line.startswith("op: ")]
    assert ops == [str(s) for schemas in recorded.ops.values() for s in schemas]
    py = {line[4:].split("(", 1)[0] for line in lines if line.startswith("py: ")}
    assert py == set(recorded.py)
    assert script.main(["torch", "--out", str(tmp_path)]) == 0
    (written,) = tmp_path.glob("torch-*.schemas")
    assert f"# version: {torch.__version__}" in written.read_text()


def test_refresh_script_refuses_a_missing_or_wrong_wheel_in_one_line(tmp_path) -> None:
    import subprocess

    not_npu = tmp_path / "other-1.0-py3-none-any.whl"
    with __import__("zipfile").ZipFile(not_npu, "w") as zf:
        zf.writestr("other-1.0.dist-info/METADATA", "Name: other\nVersion: 1.0\n")
    for wheel, says in ((tmp_path / "absent.whl", "No such file"), (not_npu, "no op schema yaml"), (ROOT / "README.md", "not a zip file")):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "ci" / "refresh_schemas.py"), "torch_npu", str(wheel), "--out", str(tmp_path)],
            capture_output=True, text=True, timeout=120,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
    assert not list(tmp_path.glob("*.schemas"))
