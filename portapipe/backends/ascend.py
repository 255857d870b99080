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
import importlib.util
from typing import Any

import torch

from .base import Backend, BackendUnavailable, EventTimer, Timer, grouped_mm_reference

#: dtypes ``npu_grouped_matmul`` accepts in its non-quantised form (fp32 on Atlas A2/A3 only).
NPU_GMM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: The most groups one ``npu_grouped_matmul`` call takes (group_list length limit).
NPU_GMM_MAX_GROUPS = 128
# npu_grouped_matmul argument values (torch_npu documentation):
SPLIT_ITEM_SINGLE = 3  # x and y are single tensors (all groups stacked along one axis)
GROUP_TYPE_M = 0  # groups split the rows (m axis) of x: y[T, N] = x[T, K] @ w[g]
GROUP_TYPE_K = 2  # groups split the reduction (k) axis: y[g] = x[:, s:e] @ w[s:e]
GROUP_LIST_CUMSUM = 0  # group_list holds cumulative ends, like torch grouped_mm's offs


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
    device_type = "npu"
    dist_backend = "hccl"
    install_hint = (
        "Install the npu extra (pip install 'portapipe[npu]', which brings torch_npu) and Huawei CANN, "
        "then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`. Where torch_npu is installed "
        "but CANN is not, `import torch` itself fails unless TORCH_DEVICE_BACKEND_AUTOLOAD=0 is set."
    )

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        super().__init__(options)
        transport = self.options.get("ep_transport", "alltoall")
        if transport != "alltoall":
            raise BackendUnavailable(
                f"backend_options.ep_transport: {transport!r} is not available on backend 'npu'; "
                "Ascend uses alltoall (HCCL). nvshmem is a CUDA transport."
            )
        self._comm_stream: Any = None

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

    def stream(self, stream: Any) -> Any:
        return self._npu().stream(stream)

    def event(self, enable_timing: bool = False) -> Any:
        return self._npu().Event(enable_timing=enable_timing)

    def synchronize(self) -> None:
        self._npu().synchronize()

    # ------------------------------------------------------------------ kernels
    @staticmethod
    def npu_grouped_matmul_ok(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> bool:
        """Whether ``npu_grouped_matmul`` takes these operands (else the portable loop runs)."""
        if a.dtype not in NPU_GMM_DTYPES or b.dtype != a.dtype or offs.numel() > NPU_GMM_MAX_GROUPS:
            return False
        if offs.numel() == 0 or a.dim() != 2 or b.dim() not in (2, 3):
            return False
        # The kernel's group_list must end at the grouped axis' length (rows of x for the m
        # axis, its columns for k); torch's offs may stop short, with zero rows after.
        grouped_len = a.shape[0] if b.dim() == 3 else a.shape[1]
        return int(offs[-1]) == grouped_len

    def grouped_mm(self, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        if not self.npu_grouped_matmul_ok(a, b, offs):
            return grouped_mm_reference(a, b, offs)
        kernel = _import_torch_npu().npu_grouped_matmul
        group_list = offs.to(device=a.device, dtype=torch.int64)
        return _NpuGroupedMatmul.apply(a, b, group_list, kernel)

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

    # ---------------------------------------------------------------------- RNG
    def get_rng_state(self) -> dict[str, torch.Tensor]:
        return {"cpu": torch.get_rng_state(), "npu": self._npu().get_rng_state(self.local_rank)}

    def set_rng_state(self, state: dict[str, torch.Tensor]) -> None:
        torch.set_rng_state(state["cpu"])
        if "npu" in state:
            self._npu().set_rng_state(state["npu"], self.local_rank)


def _gmm_m(kernel: Any, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """Rows of ``x[T, K]`` grouped by ``group_list``, group g times ``w[g]`` -> ``[T, N]``."""
    return kernel(
        [x], [w], group_list=group_list, split_item=SPLIT_ITEM_SINGLE, group_type=GROUP_TYPE_M,
        group_list_type=GROUP_LIST_CUMSUM,
    )[0]


def _gmm_k(kernel: Any, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor) -> torch.Tensor:
    """``x[M, T]`` and ``w[T, N]`` grouped along T -> ``[G, M, N]`` (the weight-gradient form)."""
    return kernel(
        [x], [w], group_list=group_list, split_item=SPLIT_ITEM_SINGLE, group_type=GROUP_TYPE_K,
        group_list_type=GROUP_LIST_CUMSUM,
    )[0]


class _NpuGroupedMatmul(torch.autograd.Function):
    """``npu_grouped_matmul`` with a backward made of the same kernel (both operand layouts).

    2d x 3d, ``y[T, N] = a[T, K] @ b[g]``: ``da = gmm_m(dy, b^T)``, ``db = gmm_k(a^T, dy)``.
    2d x 2d, ``y[g] = a[:, s:e] @ b[s:e]``: ``da = gmm_m(b, dy^T)^T``, ``db = gmm_m(a^T, dy)``.
    """

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor, group_list: torch.Tensor, kernel: Any) -> torch.Tensor:
        ctx.save_for_backward(a, b, group_list)
        ctx.kernel = kernel
        return _gmm_m(kernel, a, b, group_list) if b.dim() == 3 else _gmm_k(kernel, a, b, group_list)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        a, b, group_list = ctx.saved_tensors
        k = ctx.kernel
        grad = grad.contiguous()
        da = db = None
        if b.dim() == 3:
            if ctx.needs_input_grad[0]:
                da = _gmm_m(k, grad, b.transpose(1, 2), group_list)
            if ctx.needs_input_grad[1]:
                db = _gmm_k(k, a.t(), grad, group_list)
        else:
            if ctx.needs_input_grad[0]:
                da = _gmm_m(k, b, grad.transpose(1, 2), group_list).t()
            if ctx.needs_input_grad[1]:
                db = _gmm_m(k, a.t(), grad, group_list)
        return da, db, None, None
