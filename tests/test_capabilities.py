"""What a backend declares (:class:`~portapipe.backends.capabilities.Capabilities`) and what is read off it."""

from __future__ import annotations

from portapipe.backends.capabilities import Capabilities


def test_the_widest_reduce_dtype_reads_the_reduce_dtypes_not_the_move_dtypes() -> None:
    """Losses and stop flags are all-reduced in it: a dtype the backend only moves would fail there."""
    moves_float64 = Capabilities("gloo", ("float32",), reduce_dtypes=("float32",), move_dtypes=("float64", "float32"))
    reduces_float64 = Capabilities("gloo", ("float32",), reduce_dtypes=("float64", "float32"), move_dtypes=("float32",))
    assert moves_float64.widest_reduce_dtype == "float32"
    assert reduces_float64.widest_reduce_dtype == "float64"


def test_host_copies_are_declared_per_backend_and_a_plug_in_without_them_refuses_offload() -> None:
    from portapipe.backends.ascend import AscendBackend
    from portapipe.backends.base import Backend
    from portapipe.backends.cpu import CPUBackend
    from portapipe.backends.cuda import CUDABackend

    assert [c.capabilities.host_copies for c in (CPUBackend, CUDABackend, AscendBackend, Backend)] == ["sync", "async", "async", "none"]
    assert Capabilities("gloo", ("float32",), ("float32",), ("float32",), host_copies="dma").problems() == [
        "capabilities.host_copies: 'dma' is not one of async, sync, none"]
    assert CPUBackend.capabilities.offload_problem("cpu", "memory.offload") is None
    assert Backend.capabilities.offload_problem("mine", "train.optimizer_offload") == (
        "train.optimizer_offload: backend 'mine' declares no host copies (capabilities.host_copies: none); "
        "use a backend that has them (cpu, cuda, npu) or turn the offload off")
