"""STAND-IN for torch_npu, for tests on machines without an Ascend NPU. Not torch_npu.

It lets the Ascend backend's code run on CPU: every call is recorded (name and arguments)
so tests can check that the backend calls the documented torch_npu API with the right
arguments, and ``npu_grouped_matmul`` computes a CPU reference result from the documented
semantics (and rejects argument combinations the documentation does not allow), which the
real kernel must match on hardware. Passing tests against this module prove the argument
mapping only: real Ascend hardware with torch_npu and CANN is needed to prove the backend.

Documented semantics modelled here (torch_npu ``npu_grouped_matmul``):
  * ``x`` and ``weight`` are lists; with one ``x`` tensor the groups are stacked in it.
  * ``split_item`` 2 or 3: the output is one tensor (list of length 1).
  * ``group_type`` 0 groups the m axis (rows of x): ``y[s:e] = x[s:e] @ weight[g]``;
    ``group_type`` 2 groups the k axis: ``y[g] = x[:, s:e] @ weight[s:e]``.
  * ``group_list_type`` 0: group_list holds cumulative ends (last = length of the grouped
    axis); 1: it holds per-group counts.
  * at most 128 groups; non-quantised dtypes float16, bfloat16, float32.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator
from typing import Any

import torch

GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_GROUPS = 128


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def names(self) -> list[str]:
        return [n for n, _ in self.calls]

    def of(self, name: str) -> list[dict[str, Any]]:
        return [kw for n, kw in self.calls if n == name]


class StandinStream:
    _next_id = 0

    def __init__(self, rec: Recorder, device: Any = None, priority: int = 0) -> None:
        StandinStream._next_id += 1
        self.id = StandinStream._next_id
        self._rec = rec
        self.waited_on: list[StandinEvent] = []
        rec.record("Stream", stream=self, device=device, priority=priority)

    def wait_event(self, event: StandinEvent) -> None:
        self.waited_on.append(event)
        self._rec.record("Stream.wait_event", stream=self, event=event)

    def wait_stream(self, other: StandinStream) -> None:
        self._rec.record("Stream.wait_stream", stream=self, other=other)

    def synchronize(self) -> None:
        self._rec.record("Stream.synchronize", stream=self)


class StandinEvent:
    def __init__(self, rec: Recorder, npu: StandinNpu, enable_timing: bool = False) -> None:
        self._rec, self._npu = rec, npu
        self.enable_timing = enable_timing
        self.recorded_on: StandinStream | None = None
        self.time = None  # host time at record: the stand-in runs everything synchronously
        rec.record("Event", event=self, enable_timing=enable_timing)

    def record(self, stream: StandinStream | None = None) -> None:
        self.recorded_on = stream if stream is not None else self._npu.current_stream()
        self.time = time.perf_counter()
        self._rec.record("Event.record", event=self, stream=self.recorded_on)

    def synchronize(self) -> None:
        self._rec.record("Event.synchronize", event=self)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: StandinEvent) -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("stand-in torch_npu: elapsed_time needs both events made with enable_timing=True")
        if self.time is None or end.time is None:
            raise RuntimeError("stand-in torch_npu: elapsed_time on an event that was never recorded")
        return (end.time - self.time) * 1000.0  # milliseconds, as torch.npu.Event reports


class StandinNpu(types.ModuleType):
    """Stand-in for ``torch_npu.npu`` (torch.npu): streams, events, memory figures, RNG."""

    def __init__(self, rec: Recorder) -> None:
        super().__init__("torch_npu.npu")
        self._rec = rec
        self._default = StandinStream(rec, device=0)
        self._current = self._default
        # Memory figures per device index; tests set them and read them back through the backend.
        self.allocated: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        self.rng: dict[int, torch.Tensor] = {}

    def Stream(self, device: Any = None, priority: int = 0) -> StandinStream:  # noqa: N802 (torch's name)
        return StandinStream(self._rec, device, priority)

    def Event(self, enable_timing: bool = False, **kwargs: Any) -> StandinEvent:  # noqa: N802
        return StandinEvent(self._rec, self, enable_timing)

    def current_stream(self, device: Any = None) -> StandinStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, s: StandinStream) -> Iterator[None]:
        self._rec.record("stream", stream=s)
        prev, self._current = self._current, s
        try:
            yield
        finally:
            self._current = prev

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

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

    def get_rng_state(self, device: Any = None) -> torch.Tensor:
        self._rec.record("get_rng_state", device=device)
        return self.rng.get(device, torch.zeros(16, dtype=torch.uint8)).clone()

    def set_rng_state(self, state: torch.Tensor, device: Any = None) -> None:
        self._rec.record("set_rng_state", device=device)
        self.rng[device] = state.clone()


def _group_bounds(group_list: Any, group_list_type: int, length: int) -> list[tuple[int, int]]:
    values = [int(v) for v in (group_list.tolist() if isinstance(group_list, torch.Tensor) else group_list)]
    if group_list_type == 1:
        ends, total = [], 0
        for c in values:
            total += c
            ends.append(total)
    elif group_list_type == 0:
        ends = values
    else:
        raise ValueError(f"stand-in torch_npu: group_list_type must be 0 (cumsum) or 1 (count), got {group_list_type}")
    if len(ends) > MAX_GROUPS:
        raise ValueError(f"stand-in torch_npu: at most {MAX_GROUPS} groups, got {len(ends)}")
    if any(b < a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"stand-in torch_npu: group_list {values} is not non-decreasing")
    if not ends or ends[-1] != length:
        raise ValueError(f"stand-in torch_npu: group_list must end at the grouped axis length {length}, got {values}")
    return list(zip([0] + ends[:-1], ends))


def make_standin() -> types.ModuleType:
    """A fresh stand-in ``torch_npu`` module with its own call record (``module.recorder``)."""
    rec = Recorder()
    mod = types.ModuleType("torch_npu", __doc__)
    mod.__file__ = __file__
    mod.STANDIN = True
    mod.recorder = rec
    mod.npu = StandinNpu(rec)

    def npu_grouped_matmul(
        x: list[torch.Tensor],
        weight: list[torch.Tensor],
        *,
        bias: Any = None,
        group_list: Any = None,
        split_item: int = 0,
        group_type: int = -1,
        group_list_type: int = 0,
        output_dtype: Any = None,
        **kwargs: Any,
    ) -> list[torch.Tensor]:
        rec.record(
            "npu_grouped_matmul", x=x, weight=weight, bias=bias, group_list=group_list, split_item=split_item,
            group_type=group_type, group_list_type=group_list_type, output_dtype=output_dtype, extra=kwargs,
        )
        if not (isinstance(x, list) and isinstance(weight, list)):
            raise TypeError("stand-in torch_npu: x and weight must be lists of tensors")
        if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3):
            raise NotImplementedError("stand-in torch_npu models only single x, single weight, split_item 2 or 3")
        xt, wt = x[0], weight[0]
        if xt.dtype not in GMM_DTYPES or wt.dtype != xt.dtype:
            raise TypeError(f"stand-in torch_npu: dtypes {xt.dtype} x {wt.dtype} not supported")
        if xt.dim() != 2:
            raise ValueError("stand-in torch_npu: with split_item 2/3, x must be 2-D")
        if group_type == 0:
            if wt.dim() != 3:
                raise ValueError("stand-in torch_npu: group_type 0 with one weight tensor needs it 3-D [G, K, N]")
            bounds = _group_bounds(group_list, group_list_type, xt.shape[0])
            if len(bounds) != wt.shape[0]:
                raise ValueError(f"stand-in torch_npu: {len(bounds)} groups but weight holds {wt.shape[0]}")
            y = torch.cat([xt[s:e] @ wt[g] for g, (s, e) in enumerate(bounds)])
        elif group_type == 2:
            if wt.dim() != 2:
                raise ValueError("stand-in torch_npu: group_type 2 needs a 2-D weight [K, N]")
            bounds = _group_bounds(group_list, group_list_type, xt.shape[1])
            y = torch.stack([xt[:, s:e] @ wt[s:e] for s, e in bounds])
        else:
            raise NotImplementedError(f"stand-in torch_npu models group_type 0 and 2, got {group_type}")
        return [y.to(output_dtype) if output_dtype is not None else y]

    mod.npu_grouped_matmul = npu_grouped_matmul
    return mod
