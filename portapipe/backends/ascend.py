"""Ascend NPU backend: torch_npu with HCCL process groups and ``npu_grouped_matmul`` for experts.

torch_npu is imported only inside methods, never when this module is imported: an installed
torch_npu without Huawei's CANN breaks ``import torch`` itself unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, so nothing else in portapipe may pull it in. Presence is
judged from the ``/dev/davinci*`` device files alone.

torch_npu mirrors torch.cuda: ``torch_npu.npu`` (also reachable as ``torch.npu`` once imported)
has Stream, Event, current_stream, memory statistics and RNG state with the same meaning.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import logging
import os
import shutil
from typing import Any

import torch

from .base import Backend, BackendUnavailable, EventSpanClock, EventTimer, SpanClock, Timer
from .capabilities import Capabilities
from .grouped_mm import grouped_mm_reference

log = logging.getLogger("portapipe.backends")

# npu_grouped_matmul facts (torch_npu 2.14.0 docstring and schema, CANN aclnnGroupedMatmulV5):
#: dtypes of its non-quantised form (fp32 only with x, weight and y single tensors, Atlas A2/A3).
NPU_GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The most groups of one call with a single-tensor weight (group_type 0 and 2); 128 is the
#: limit for a *list* of weights, which portapipe does not pass.
NPU_GMM_MAX_GROUPS = 1024
#: The innermost (stride-1) dim of every x and weight must be below this ("InnerLimit").
NPU_GMM_INNER_LIMIT = 65536
SPLIT_ITEM_SINGLE = 3  # x and y are single tensors (all groups stacked along one axis)
GROUP_TYPE_M = 0  # groups split the rows (m axis) of x: y[T, N] = x[T, K] @ w[g]; x not transposed
GROUP_TYPE_K = 2  # groups split the reduction (k) axis: y[g] = x[:, s:e] @ w[s:e]; x transposed, w not
GROUP_LIST_CUMSUM = 0  # group_list holds cumulative ends (int64, on the device), like torch's offs


def _davinci_files() -> list[str]:
    # /dev/davinci0, davinci1, ... are the NPUs; davinci_manager and friends are not.
    return sorted(glob.glob("/dev/davinci[0-9]*"))


def _import_torch_npu() -> Any:
    try:
        import torch_npu  # noqa: F401  (registers the npu device and the hccl process-group backend)
    except Exception as exc:
        raise BackendUnavailable(
            f"backend 'npu' is not available: import torch_npu failed ({type(exc).__name__}: {exc}). "
            + AscendBackend.install_hint
        ) from exc
    return torch_npu


class AscendBackend(Backend):
    name = "npu"
    option_keys = frozenset({"ep_transport"})
    device_type = "npu"
    dist_backend = "hccl"
    install_hint = (
        "Install the npu extra (pip install 'portapipe[npu]', which brings torch_npu) and Huawei CANN, "
        "then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`. Where torch_npu is installed "
        "but CANN is not, `import torch` itself fails unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set."
    )

    # Sources (quoted in docs/backends.md): aclnnMatmul / aclnnMm take FLOAT, FLOAT16 and
    # BFLOAT16, no DOUBLE; HcclAllReduce / HcclReduceScatter reduce int8-int64, float16, float32
    # and bfp16 on Atlas A2/A3 (float64 only on Ascend 950, within a node); HcclAlltoAll(V) and
    # HcclAllGather move float64 as well. So float64 moves but neither computes nor reduces.
    capabilities = Capabilities(
        dist_backend="hccl",
        compute_dtypes=("float32", "bfloat16", "float16"),
        reduce_dtypes=("float32", "bfloat16", "float16"),
        move_dtypes=("float64", "float32", "bfloat16", "float16"),
        fused_grouped_mm_dtypes=tuple(str(d).removeprefix("torch.") for d in NPU_GMM_DTYPES),
        grouped_mm_max_groups=NPU_GMM_MAX_GROUPS,
        fp8_matmul="emulated",  # Atlas A2 / A3 have no FP8 matmul (int8 / int4 only)
        streams=True,
        memory_stats=True,
        timer="events",
        host_copies="async",  # page-locked host buffers, copies on a stream of their own
    )

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        self._comm_stream: Any = None
        self._copy_stream: Any = None
        self._k_grouping: bool | None = None  # group_type 2 support of this CANN, probed once

    # ------------------------------------------------------------------ identity
    @classmethod
    def device_present(cls) -> bool:
        return bool(_davinci_files())

    @classmethod
    def device_count(cls) -> int:
        return len(_davinci_files())

    @classmethod
    def is_available(cls) -> bool:
        if not cls.device_present() or importlib.util.find_spec("torch_npu") is None:
            return False
        try:
            return bool(_import_torch_npu().npu.is_available())
        except BackendUnavailable:
            return False

    @classmethod
    def unavailable_reason(cls) -> str:
        if not cls.device_present():
            return (
                "backend 'npu' is not available: no Ascend NPU found (no /dev/davinci* device files; "
                "check the Ascend driver with `npu-smi info`). " + cls.install_hint
            )
        if importlib.util.find_spec("torch_npu") is None:
            return "backend 'npu' is not available: an NPU is present but torch_npu is not installed. " + cls.install_hint
        try:
            npu = _import_torch_npu().npu
        except BackendUnavailable as exc:
            return str(exc)
        if not npu.is_available():
            return (
                "backend 'npu' is not available: torch_npu is installed but torch_npu.npu.is_available() is False "
                "(CANN environment not set, or ASCEND_RT_VISIBLE_DEVICES hides the NPUs). " + cls.install_hint
            )
        return "backend 'npu' is available."

    def _npu(self) -> Any:
        return _import_torch_npu().npu

    def device(self, local_rank: int | None = None) -> torch.device:
        _import_torch_npu()  # the "npu" device type exists only once torch_npu is imported
        return super().device(local_rank)

    def device_module(self) -> Any:
        return self._npu()

    def set_device(self) -> None:
        self._npu().set_device(self.local_rank)

    def process_group_kwargs(self) -> dict[str, Any]:
        # HCCL binds to the device chosen by set_device; torch_npu documents no device_id use.
        return {}

    # ------------------------------------------------------- streams and events
    def compute_stream(self) -> Any:
        return self._npu().current_stream()

    def comm_stream(self) -> Any:
        if self._comm_stream is None:
            self._comm_stream = self._npu().Stream()
        return self._comm_stream

    def copy_stream(self) -> Any:
        if self._copy_stream is None:
            self._copy_stream = self._npu().Stream()
        return self._copy_stream

    def stream(self, stream: Any) -> Any:
        return self._npu().stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return self._npu().Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        self._npu().synchronize()

    # ------------------------------------------------------------------ kernels
    @staticmethod
    def npu_grouped_matmul_refusal(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> str | None:
        """Why ``npu_grouped_matmul`` cannot take these operands (the portable loop runs), or None."""
        if a.dtype not in NPU_GMM_DTYPES or b.dtype != a.dtype:
            return f"dtypes {a.dtype} x {b.dtype}"
        if a.dim() != 2 or b.dim() not in (2, 3):
            return f"shapes {tuple(a.shape)} x {tuple(b.shape)}"
        if not 1 <= offs.numel() <= NPU_GMM_MAX_GROUPS:
            return f"{offs.numel()} groups (1 to {NPU_GMM_MAX_GROUPS} per call)"
        if b.dim() == 3:
            (t, k), n = a.shape, b.shape[2]
            if b.shape[0] != offs.numel() or b.shape[1] != k:
                return f"weight {tuple(b.shape)} does not match x {tuple(a.shape)} and {offs.numel()} groups"
            inner = (k, n)  # x [T, K] rows, weight [G, K, N] (or its transpose, inner dim K or N)
        else:
            (m, t), n = a.shape, b.shape[1]
            if b.shape[0] != t:
                return f"x {tuple(a.shape)} and weight {tuple(b.shape)} do not share the grouped axis"
            inner = (m, n)  # x transposed: its inner dim is M; weight [T, N] rows
        if min(a.shape) == 0 or min(b.shape) == 0 or int(offs[-1]) == 0:
            return "an empty operand"
        if max(inner) >= NPU_GMM_INNER_LIMIT:
            return f"an inner dim of {max(inner)} (the kernel takes less than {NPU_GMM_INNER_LIMIT})"
        if int(offs[-1]) > t:
            return f"offs ends at {int(offs[-1])}, past the grouped axis ({t})"
        return None

    def k_grouping_supported(self, kernel: Any, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether this CANN runs ``group_type=2`` (k-axis groups, the weight-gradient form).

        The torch_npu 2.14.0 docstring lists group_type -1/0/1 while its schema and meta function
        accept 2: support depends on the CANN version. Decided once per backend by a small probe
        against a known answer; without support the 2d x 2d form runs the per-group loop, said in
        one log line.
        """
        if self._k_grouping is None:
            reason = ""
            try:
                x_rows = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])  # [T=4, M=2]
                w = torch.tensor([[1.0, 0.0, 2.0], [0.0, 1.0, 1.0], [2.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # [T, N=3]
                offs = torch.tensor([1, 4])
                want = grouped_mm_reference(x_rows.t(), w, offs)
                x = x_rows.to(device=device, dtype=dtype).t()  # transposed, as group_type 2 needs
                got = _gmm_k(kernel, x, w.to(device=device, dtype=dtype), offs.to(device=device, dtype=torch.int64))
                self._k_grouping = bool(torch.equal(got.float().cpu(), want))
                reason = "" if self._k_grouping else f"probe result {got.float().cpu().tolist()} != {want.tolist()}"
            except Exception as exc:  # an unsupported group_type surfaces as a runtime error of CANN
                self._k_grouping, reason = False, f"{type(exc).__name__}: {exc}"
            if not self._k_grouping:
                log.warning(
                    "npu_grouped_matmul: group_type 2 (k-axis groups) is not supported by this CANN (%s); "
                    "the weight gradient of grouped matmul runs as a per-group loop",
                    reason,
                )
        return self._k_grouping

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if self.npu_grouped_matmul_refusal(a, b, offs) is not None:
            return grouped_mm_reference(a, b, offs)
        kernel = _import_torch_npu().npu_grouped_matmul
        if b.dim() == 2 and not self.k_grouping_supported(kernel, a.device, a.dtype):
            return grouped_mm_reference(a, b, offs)
        # group_list must end at the grouped axis' length; torch's offs may stop short, the
        # rows after it contributing nothing: run the kernel on the rows offs covers.
        end = int(offs[-1])
        group_list = offs.to(device=a.device, dtype=torch.int64)
        if b.dim() == 3:
            out = _NpuGroupedMatmul.apply(a[:end], b, group_list, kernel, self)
            return out if end == a.shape[0] else torch.nn.functional.pad(out, (0, 0, 0, a.shape[0] - end))
        return _NpuGroupedMatmul.apply(a[:, :end], b[:end], group_list, kernel, self)

    # ------------------------------------------------------------------- memory
    def memory_allocated(self) -> int | None:
        return int(self._npu().memory_allocated(self.local_rank))

    def max_memory_allocated(self) -> int | None:
        return int(self._npu().max_memory_allocated(self.local_rank))

    def reset_peak_memory_stats(self) -> None:
        self._npu().reset_peak_memory_stats(self.local_rank)

    # ------------------------------------------------------------------- timers
    def timer(self) -> Timer:
        return EventTimer(self._npu().Event)

    def profiler(self, memory: bool = False) -> Any:
        """torch_npu's profiler: the host's operators and the NPU's kernels; torch.profiler's
        interface (enter / exit, ``export_chrome_trace``), and record_function's ranges in it."""
        profiler = _import_torch_npu().profiler
        activity = profiler.ProfilerActivity
        return profiler.profile(activities=[activity.CPU, activity.NPU], profile_memory=memory, record_shapes=memory)

    def export_profile(self, prof: Any, path: str) -> None:
        """torch_npu's analysis writes plain JSON: written beside ``path``, then gzipped into it."""
        plain = path.removesuffix(".gz")
        prof.export_chrome_trace(plain)
        if plain != path:
            with open(plain, "rb") as src, gzip.open(path, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.remove(plain)

    def span_clock(self) -> SpanClock:
        npu = self._npu()
        return EventSpanClock(npu.Event, self.synchronize, lambda: npu.Stream(), npu.stream)  # HCCL's wait() holds a stream

    # ---------------------------------------------------------------------- RNG
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state(), "npu": self._npu().get_rng_state(self.local_rank)}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "npu" in state:
            self._npu().set_rng_state(state["npu"], self.local_rank)


def _is_transposed(t: torch.Tensor) -> bool:
    """torch_npu's "transposed": the last two dims ``[R, C]`` stored as ``[C, R]`` (strides 1, R)."""
    rows = t.shape[-2]
    return t.stride()[-2:] == (1, rows) and (t.dim() == 2 or t.stride(0) == rows * t.shape[-1])


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with the same values, stored transposed (a copy unless it already is)."""
    return t if _is_transposed(t) else t.transpose(-1, -2).contiguous().transpose(-1, -2)


def _gmm_m(kernel: Any, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``x[T, K]`` grouped by ``group_list``, group g times ``w[g]`` -> ``[T, N]``.

    group_type 0: x must not be transposed; the weight may be (as ``b.transpose(1, 2)`` is).
    """
    w = w if _is_transposed(w) else _plain(w)
    return kernel(
        [_plain(x)], [w], group_list=group_list, split_item=SPLIT_ITEM_SINGLE, group_type=GROUP_TYPE_M,
        group_list_type=GROUP_LIST_CUMSUM,
    )[0]


def _gmm_k(kernel: Any, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """``x[M, T]`` and ``w[T, N]`` grouped along T -> ``[G, M, N]`` (the weight-gradient form).

    group_type 2: x must be transposed (``a.t()`` of a row-major ``a``) and the weight not.
    """
    return kernel(
        [_transposed(x)], [_plain(w)], group_list=group_list, split_item=SPLIT_ITEM_SINGLE, group_type=GROUP_TYPE_K,
        group_list_type=GROUP_LIST_CUMSUM,
    )[0]


class _NpuGroupedMatmul(torch.autograd.Function):
    """``npu_grouped_matmul`` with a backward made of the same kernel (both operand layouts).

    2d x 3d, ``y[T, N] = a[T, K] @ b[g]``: ``da = gmm_m(dy, b^T)``, ``db = gmm_k(a^T, dy)``
    (the per-group loop where this CANN has no k-axis grouping).
    2d x 2d, ``y[g] = a[:, s:e] @ b[s:e]``: ``da = gmm_m(b, dy^T)^T``, ``db = gmm_m(a^T, dy)``.
    """

    @staticmethod
    def forward(
        ctx: Any, a: torch.Tensor, b: torch.Tensor, group_list: torch.Tensor, kernel: Any, backend: AscendBackend
    ) -> torch.Tensor:
        ctx.save_for_backward(a, b, group_list)
        ctx.kernel, ctx.backend = kernel, backend
        return _gmm_m(kernel, a, b, group_list) if b.dim() == 3 else _gmm_k(kernel, a, b, group_list)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        a, b, group_list = ctx.saved_tensors
        k = ctx.kernel
        grad = grad.contiguous()
        da = db = None
        if b.dim() == 3:
            if ctx.needs_input_grad[0]:
                da = _gmm_m(k, grad, b.transpose(1, 2), group_list)
            if ctx.needs_input_grad[1]:
                if ctx.backend.k_grouping_supported(k, a.device, a.dtype):
                    db = _gmm_k(k, a.t(), grad, group_list)
                else:
                    db = grouped_mm_reference(a.t(), grad, group_list)
        else:
            if ctx.needs_input_grad[0]:
                da = _gmm_m(k, b, grad.transpose(1, 2), group_list).t()
            if ctx.needs_input_grad[1]:
                db = _gmm_m(k, a.t(), grad, group_list)
        return da, db, None, None, None
