"""What a backend declares (:class:`~portapipe.backends.capabilities.Capabilities`) and what is read off it."""

from __future__ import annotations

from portapipe.backends.capabilities import Capabilities


def test_the_widest_reduce_dtype_reads_the_reduce_dtypes_not_the_move_dtypes() -> None:
    """Losses and stop flags are all-reduced in it: a dtype the backend only moves would fail there."""
    moves_float64 = Capabilities("gloo", ("float32",), reduce_dtypes=("float32",), move_dtypes=("float64", "float32"))
    reduces_float64 = Capabilities("gloo", ("float32",), reduce_dtypes=("float64", "float32"), move_dtypes=("float32",))
    assert moves_float64.widest_reduce_dtype == "float32"
    assert reduces_float64.widest_reduce_dtype == "float64"
