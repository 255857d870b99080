"""STAND-IN for torch_npu, for tests on machines without an Ascend NPU. Not torch_npu.

A strict double: it refuses what the real torch_npu / CANN refuse, so the CPU suite fails
where an NPU would. Every call is bound against the declarations copied from the torch_npu
release (tests/conformance/torch_npu-<version>.schemas, see tests/declared.py): keyword names,
keyword-only arguments, argument types and overload choice (a tensor ``group_list`` selects
the overload whose ``output_dtype`` is an int enum; a list selects ``.List``). Streams, events,
module functions and the profiler have exactly the declared signatures (a test compares them), and
``current_stream()`` returns a new wrapper each call, as the real one does. Streams take only
NPU events and events only NPU streams (the real ``Stream.wait_event`` calls ``event.wait(self)``;
an event, once recorded, is recorded again only on a stream of its device), as offload's copies
on a stream of their own need.

``npu_grouped_matmul`` computes a CPU reference from the documented semantics after checking
the documented rules (torch_npu 2.14.0 docstring, its meta function, CANN's
aclnnGroupedMatmulV5 constraints):

* ``group_type`` must be -1, 0 or 2 with a tensor ``group_list`` (the meta check; its default
  None is refused); with a list ``group_list`` it must be None.
* group_type 0 ("m" axis): split_item 2/3, x 2-D and not transposed, a single weight 3-D
  ``[G, K, N]`` (transposed allowed), ``group_list`` int64 on x's device, non-decreasing,
  its last value equal to x's rows, at most 1024 groups.
* group_type 2 ("k" axis): split_item 2/3, x 2-D and *transposed* (``[M, K]`` stored as
  ``[K, M]``: strides ``(1, M)``), the weight 2-D and not transposed, no bias, ``group_list``
  int64 on x's device with its last value equal to x's K (the grouped axis), at most 1024 groups. Whether CANN runs it depends on its version: ``make_standin
  (k_grouping=False)`` models a CANN without it.
* every x and weight's innermost (stride-1) dim below 65536; dtypes float16, bfloat16, float32,
  the weight's equal to x's.

Passing tests against this module prove the calls and their arguments; real Ascend hardware
with torch_npu and CANN is needed to prove the kernels (``bash ci/test.sh npu``).
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

from . import declared

GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUPS = 1024  # single-tensor weight
INNER_LIMIT = 65536


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kw for n, kw in self.calls if n == name]


_stream_ids = itertools.count(1)


class StandinStream:
    """torch_npu.npu.Stream: a wrapper around a stream id; wrappers of one stream compare equal."""

    _rec: Recorder
    _npu: StandinNpu

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> StandinStream:
        # The real base class takes stream_id / device_index / device_type (to wrap an existing stream).
        unknown = set(kwargs) - {"stream_id", "device_index", "device_type"}
        if unknown:
            raise TypeError(f"Stream() got unexpected keyword arguments {sorted(unknown)}")
        self = super().__new__(cls)
        self.stream_id = kwargs.get("stream_id", next(_stream_ids))
        self.device = device
        self.device_index = kwargs.get("device_index")
        self.priority = priority
        return self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StandinStream) and other.stream_id == self.stream_id

    def __hash__(self) -> int:
        return hash(self.stream_id)

    def wait_event(self, event: StandinEvent) -> None:
        # the real one calls event.wait(self): only an NPU event can be waited on
        if not isinstance(event, StandinEvent):
            raise TypeError(f"stand-in torch_npu: Stream.wait_event takes a torch_npu.npu.Event, got {type(event).__name__}")
        self._npu._waits.setdefault(self.stream_id, []).append(event)
        self._rec.record("Stream.wait_event", stream=self, event=event)

    def wait_stream(self, stream: StandinStream) -> None:
        self._rec.record("Stream.wait_stream", stream=self, other=stream)

    def synchronize(self) -> None:
        self._rec.record("Stream.synchronize", stream=self)


class StandinEvent:
    """torch_npu.npu.Event."""

    _rec: Recorder
    _npu: StandinNpu

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> StandinEvent:
        self = super().__new__(cls)
        self.enable_timing = enable_timing
        self.recorded_on: StandinStream | None = None
        self.time: float | None = None  # host time at record: the stand-in runs everything synchronously
        self._rec.record("Event", event=self, enable_timing=enable_timing)
        return self

    def record(self, stream: StandinStream | None = None) -> None:
        stream = stream if stream is not None else self._npu.current_stream()
        if not isinstance(stream, StandinStream):
            raise TypeError(f"stand-in torch_npu: Event.record takes a torch_npu.npu.Stream, got {type(stream).__name__}")
        # the real event: "after creation, only streams on the same device may record the event"
        if self.recorded_on is not None and _device_of(stream) != _device_of(self.recorded_on):
            raise RuntimeError(f"stand-in torch_npu: an event of device {_device_of(self.recorded_on)} recorded on a stream of device {_device_of(stream)}")
        self.recorded_on = stream
        self.time = time.perf_counter()
        self._rec.record("Event.record", event=self, stream=self.recorded_on)

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self._rec.record("Event.synchronize", event=self)

    def elapsed_time(self, end_event: StandinEvent) -> float:
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("stand-in torch_npu: elapsed_time needs both events made with enable_timing=True")
        if self.time is None or end_event.time is None:
            raise RuntimeError("stand-in torch_npu: elapsed_time on an event that was never recorded")
        return (end_event.time - self.time) * 1000.0  # milliseconds, as torch.npu.Event reports


def _device_of(stream: StandinStream) -> int:
    """The device index a stream belongs to (a stream made without one: the current device, 0)."""
    device = getattr(stream, "device_index", None) if stream.device is None else stream.device
    return 0 if device is None else int(getattr(device, "index", device) or 0)


class StandinNpu(types.ModuleType):
    """Stand-in for ``torch_npu.npu`` (torch.npu): streams, events, memory figures, RNG."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__("torch_npu.npu")
        self._rec = rec
        # Classes bound to this module's recorder, so isinstance and signatures stay the real ones.
        self.Stream = type("Stream", (StandinStream,), {"_rec": rec, "_npu": self})
        self.Event = type("Event", (StandinEvent,), {"_rec": rec, "_npu": self})
        self._default_id = self.Stream(device=0).stream_id
        self._current_id = self._default_id
        self._waits: dict[int, list[StandinEvent]] = {}
        # Memory figures per device index; tests set them and read them back through the backend.
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.rng: dict[int, torch.Tensor] = {}

    def waited_on(self, stream: StandinStream) -> list[StandinEvent]:
        return self._waits.get(stream.stream_id, [])

    def default_stream_id(self) -> int:
        return self._default_id

    def current_stream(self, device: Any = None) -> StandinStream:
        # A new wrapper of the current stream every call, as torch_npu's current_stream does.
        return self.Stream(stream_id=self._current_id, device_index=0, device_type=20)

    @contextlib.contextmanager
    def _stream_context(self, stream: StandinStream) -> Iterator[None]:
        self._rec.record("stream", stream=stream)
        prev, self._current_id = self._current_id, stream.stream_id
        try:
            yield
        finally:
            self._current_id = prev

    def stream(self, stream: StandinStream | None) -> contextlib.AbstractContextManager:
        if stream is not None and not isinstance(stream, StandinStream):
            raise TypeError(f"stand-in torch_npu: npu.stream takes a torch_npu.npu.Stream, got {type(stream).__name__}")
        return contextlib.nullcontext() if stream is None else self._stream_context(stream)

    def is_available(self) -> bool:
        return True

    def set_device(self, device: Any) -> None:
        self._rec.record("set_device", device=device)

    def synchronize(self, device: Any = None) -> None:
        self._rec.record("synchronize", device=device)

    def memory_allocated(self, device: Any = None) -> int:
        self._rec.record("memory_allocated", device=device)
        return self.allocated.get(device, 0)

    def max_memory_allocated(self, device: Any = None) -> int:
        self._rec.record("max_memory_allocated", device=device)
        return self.peak.get(device, 0)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._rec.record("reset_peak_memory_stats", device=device)
        self.peak[device] = self.allocated.get(device, 0)

    def get_rng_state(self, device: Any = "npu") -> torch.Tensor:
        self._rec.record("get_rng_state", device=device)
        return self.rng.get(device, torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "npu") -> None:
        self._rec.record("set_rng_state", device=device)
        self.rng[device] = new_state.clone()


class StandinProfile:
    """torch_npu.profiler.profile: records its arguments and its run; its Chrome trace is an empty
    one (the real profiler analyses what CANN collected into it)."""

    _rec: Recorder

    def __init__(self, *, activities: Any = None, schedule: Any = None, on_trace_ready: Any = None, record_shapes: bool = False,
                 profile_memory: bool = False, with_stack: bool = False, with_flops: bool = False, with_modules: bool = False,
                 experimental_config: Any = None, execution_trace_observer: Any = None, custom_trace_id_callback: Any = None,
                 use_cuda: Any = None) -> None:
        if activities is not None and any(not isinstance(a, StandinProfilerActivity) for a in activities):
            raise TypeError(f"stand-in torch_npu: activities must be torch_npu.profiler.ProfilerActivity members, got {list(activities)}")
        self._rec.record("profiler.profile", activities=activities, record_shapes=record_shapes, profile_memory=profile_memory)

    def __enter__(self) -> StandinProfile:
        self._rec.record("profiler.profile.start")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rec.record("profiler.profile.stop")

    def export_chrome_trace(self, output_path: str) -> None:
        if output_path.endswith(".gz"):
            raise ValueError("stand-in torch_npu: export_chrome_trace writes plain JSON (its analysis takes no .gz path)")
        self._rec.record("profiler.profile.export_chrome_trace", output_path=output_path)
        with open(output_path, "w") as f:
            f.write('{"traceEvents": []}')


class StandinProfilerActivity:
    """torch_npu.profiler.ProfilerActivity (a C enum: CPU and NPU)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"ProfilerActivity.{self.name}"


def is_transposed(t: torch.Tensor) -> bool:
    """torch_npu's "transposed": shape ``[.., R, C]`` with strides ``(.., 1, R)`` (stored as ``[C, R]``)."""
    rows = t.shape[-2]
    return t.stride()[-2:] == (1, rows) and (t.dim() == 2 or t.stride(0) == rows * t.shape[-1])


def _inner_dim(t: torch.Tensor) -> int:
    return t.shape[-2] if is_transposed(t) and not t.is_contiguous() else t.shape[-1]


def _bounds(group_list: torch.Tensor, group_list_type: int, x: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """Group bounds along the grouped axis (``length`` long), where ``group_list`` must end."""
    if group_list.dim() != 1 or group_list.dtype != torch.int64:
        raise TypeError(f"stand-in torch_npu: group_list must be a 1-D int64 tensor, got {group_list.dtype} {tuple(group_list.shape)}")
    if group_list.device != x.device:
        raise ValueError(f"stand-in torch_npu: group_list is on {group_list.device}, x on {x.device}")
    values = [int(v) for v in group_list.tolist()]
    if len(values) > MAX_GROUPS:
        raise ValueError(f"stand-in torch_npu: at most {MAX_GROUPS} groups with a single weight tensor, got {len(values)}")
    if group_list_type == 1:
        ends = list(itertools.accumulate(values))
    elif group_list_type == 0:
        ends = values
    else:
        raise ValueError(f"stand-in torch_npu: group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}")
    if not ends or min(values) < 0 or any(b < a for a, b in zip(ends, ends[1:])):
        raise ValueError(f"stand-in torch_npu: group_list {values} is not a non-negative non-decreasing cumsum")
    if ends[-1] != length:
        raise ValueError(f"stand-in torch_npu: group_list must end at the grouped axis length {length}, got {values}")
    return list(zip([0] + ends[:-1], ends))


def make_standin(k_grouping: bool = True) -> types.ModuleType:
    """A fresh stand-in ``torch_npu`` module with its own call record (``module.recorder``).

    ``k_grouping=False`` models a CANN whose grouped matmul has no group_type 2.
    """
    decl = declared.load("torch_npu")
    rec = Recorder()
    mod = types.ModuleType("torch_npu", __doc__)
    mod.__file__ = __file__
    mod.STANDIN = True
    mod.__version__ = decl.version
    mod.recorder = rec
    mod.npu = StandinNpu(rec)

    def npu_grouped_matmul(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        overload, a = decl.bind_op("npu_grouped_matmul", *args, **kwargs)
        rec.record("npu_grouped_matmul", overload=overload, **a)
        x, weight, group_type, split_item = a["x"], a["weight"], a["group_type"], a["split_item"]
        if overload == "List":
            if group_type is not None:
                raise ValueError(f"stand-in torch_npu: a list group_list needs group_type None, got {group_type}")
            raise NotImplementedError("stand-in torch_npu models the tensor group_list overload only")
        if group_type not in (-1, 0, 2):
            raise RuntimeError(f"group_type only supports -1, 0 and 2, but got {group_type}")
        others = [k for k, v in a.items() if k not in ("x", "weight", "group_list", "split_item", "group_type", "group_list_type", "act_type", "bias") and v is not None]
        if others or a["act_type"] not in (0, None) or a["bias"] is not None:
            raise NotImplementedError(f"stand-in torch_npu models the non-quantised form without bias or activation, got {others}")
        if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3):
            raise NotImplementedError("stand-in torch_npu models single x, single weight, split_item 2 or 3")
        xt, wt = x[0], weight[0]
        if xt.dtype not in GMM_DTYPES or wt.dtype != xt.dtype:
            raise TypeError(f"stand-in torch_npu: dtypes {xt.dtype} x {wt.dtype} not supported")
        if xt.dim() != 2:
            raise ValueError("stand-in torch_npu: with split_item 2/3, x must be 2-D")
        for name, t in (("x", xt), ("weight", wt)):
            if _inner_dim(t) >= INNER_LIMIT:
                raise ValueError(f"stand-in torch_npu: {name}'s inner dim {_inner_dim(t)} is not below {INNER_LIMIT}")
        if a["group_list"] is None:
            raise ValueError("stand-in torch_npu: group_type 0/2 with one weight tensor needs group_list")
        if group_type == 0:
            if wt.dim() != 3:
                raise ValueError("stand-in torch_npu: group_type 0 with one weight tensor needs it 3-D [G, K, N]")
            if not xt.is_contiguous():
                raise ValueError(f"stand-in torch_npu: group_type 0 does not take a transposed or strided x (strides {xt.stride()})")
            if not (wt.is_contiguous() or is_transposed(wt)):
                raise ValueError(f"stand-in torch_npu: weight strides {wt.stride()} are neither plain nor transposed")
            if wt.shape[1] != xt.shape[1]:
                raise ValueError(f"stand-in torch_npu: x {tuple(xt.shape)} and weight {tuple(wt.shape)} do not share K")
            bounds = _bounds(a["group_list"], a["group_list_type"], xt, xt.shape[0])
            if len(bounds) != wt.shape[0]:
                raise ValueError(f"stand-in torch_npu: {len(bounds)} groups but weight holds {wt.shape[0]}")
            y = torch.cat([xt[s:e] @ wt[g] for g, (s, e) in enumerate(bounds)])
        elif group_type == 2:
            if not k_grouping:
                raise RuntimeError("stand-in torch_npu (older CANN): GroupedMatmul does not support groupType 2")
            if wt.dim() != 2:
                raise ValueError("stand-in torch_npu: group_type 2 needs a 2-D weight [K, N]")
            if not (is_transposed(xt) and not xt.is_contiguous()):
                raise ValueError(f"stand-in torch_npu: group_type 2 needs x transposed (strides (1, M)), got strides {xt.stride()}")
            if not wt.is_contiguous():
                raise ValueError(f"stand-in torch_npu: group_type 2 does not take a transposed or strided weight (strides {wt.stride()})")
            bounds = _bounds(a["group_list"], a["group_list_type"], xt, xt.shape[1])
            y = torch.stack([xt[:, s:e] @ wt[s:e] for s, e in bounds])
        else:
            raise NotImplementedError("stand-in torch_npu models group_type 0 and 2")
        return [y]

    mod.npu_grouped_matmul = npu_grouped_matmul
    profile = type("profile", (StandinProfile,), {"_rec": rec})
    activity = types.SimpleNamespace(CPU=StandinProfilerActivity("CPU"), NPU=StandinProfilerActivity("NPU"))
    mod.profiler = types.SimpleNamespace(profile=profile, ProfilerActivity=activity)
    return mod
