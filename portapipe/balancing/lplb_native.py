"""Optional native CPU path of LPLB: counting, mapping and the balancing LP in one small C file.

On a CPU the torch implementations of these steps are a few hundred tiny tensor operations per
batch whose dispatch overhead, not their arithmetic, sets the time; ``native/lplb.c`` does each
step in one call. It is compiled on first use with the system C compiler (``CC``, else ``cc``,
``gcc`` or ``clang``) into a cache directory (``PORTAPIPE_CACHE_DIR``, else
``~/.cache/portapipe``, else the temp directory) under a name that hashes the source, the
compiler command, the flags and the platform, so ranks sharing a home directory reuse one build
and an edited source is rebuilt. The torch path stays the portable implementation (every other
device) and the fallback: :func:`why_unavailable` says why this one cannot run (tensors not on
the CPU, ``PORTAPIPE_NATIVE=0``, no compiler, a failed build) and never raises. The answer is
worked out once per process for each setting of ``PORTAPIPE_NATIVE``, ``CC`` and
``PORTAPIPE_CACHE_DIR``.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

__all__ = ["available", "why_unavailable", "wanted", "library", "count_experts", "map_indices", "balance", "plan", "PlanCall", "PlanOutput", "count_row", "cache_dir", "SOURCE", "FLAGS"]

SOURCE = Path(__file__).with_name("native") / "lplb.c"
#: no -march=native: a cached build must load on every machine that shares the cache directory.
#: -ffp-contract=off: no fused multiply-adds, so every rank's build computes the same plan.
FLAGS = ("-O2", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off")
_DISABLE = "PORTAPIPE_NATIVE"
_lock = threading.Lock()

_i64, _f64, _ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
_SIGNATURES = {
    "lplb_count_i32": (_i64, [_ptr, _i64, _i64, _ptr, _ptr]),
    "lplb_count_i64": (_i64, [_ptr, _i64, _i64, _ptr, _ptr]),
    "lplb_map_i32": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]),
    "lplb_map_i64": (ctypes.c_int, [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr]),
    "lplb_balance": (_i64, [_i64, _i64, _i64, _ptr, _ptr, _ptr, _f64, _f64, _i64, _f64, _f64, _ptr, _ptr, _ptr, _ptr]),
    "lplb_plan": (_i64, [_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr]),
}


class _PlanLayout(ctypes.Structure):
    """native/lplb.c's PlanLayout: what a plan call keeps between batches of one placement."""

    _fields_ = [(name, _i64) for name in ("E", "G", "m", "d", "max_iter", "frac_bits", "P", "per_rank")] + [
        (name, _f64) for name in ("tol", "accept_rtol", "step_frac")
    ] + [(name, _ptr) for name in ("rank_of", "lp_slot", "orig", "copy", "holder")]


def _compiler() -> list[str] | None:
    """The compiler command: $CC (split as a shell would), else the first of cc, gcc, clang on PATH."""
    cc = os.environ.get("CC", "").strip()
    if cc:
        return shlex.split(cc)
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    return None


def cache_dir() -> Path:
    """Where built libraries are kept: the first writable of PORTAPIPE_CACHE_DIR, ~/.cache/portapipe, the temp dir."""
    candidates = [os.environ.get("PORTAPIPE_CACHE_DIR", ""), os.path.join(os.path.expanduser("~"), ".cache", "portapipe")]
    for base in filter(None, candidates):
        path = Path(base) / "native"
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK):
            return path
    # A shared temp directory: a private folder per user, so nobody else's library gets loaded.
    uid = os.getuid() if hasattr(os, "getuid") else None
    path = Path(tempfile.gettempdir()) / f"portapipe-native-{uid if uid is not None else os.getlogin()}"
    path.mkdir(mode=0o700, exist_ok=True)
    if uid is not None and path.stat().st_uid != uid:
        raise OSError(f"{path} belongs to another user")
    return path


def _build(compiler: tuple[str, ...], where: Path) -> Path:
    """The library for this source and compiler, compiled unless already cached. Raises RuntimeError."""
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, " ".join(compiler).encode(), " ".join(FLAGS).encode(), f"{sys.platform}-{platform.machine()}".encode()])
    ).hexdigest()[:16]
    target = where / f"lplb-{key}{'.dll' if sys.platform == 'win32' else '.so'}"
    if target.exists():
        return target
    # Several ranks may build at once: each writes its own temporary file and renames it into
    # place atomically, so a reader sees either no library or a complete one.
    fd, tmp = tempfile.mkstemp(prefix=target.stem + "-", suffix=".tmp", dir=where)
    os.close(fd)
    try:
        cmd = [*compiler, *FLAGS, "-o", tmp, str(SOURCE), "-lm"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RuntimeError(f"could not run the C compiler {compiler[0]!r}: {exc}") from None
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip()[-600:]
            raise RuntimeError(f"compiling {SOURCE.name} with {' '.join(cmd)!r} failed (exit {proc.returncode}): {tail}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(compiler: tuple[str, ...], where: Path) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, reason)."""
    try:
        lib = ctypes.CDLL(str(_build(compiler, where)))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)  # AttributeError: a library that is not ours under our name
            fn.restype, fn.argtypes = restype, argtypes
    except (RuntimeError, OSError, AttributeError) as exc:
        return None, str(exc)
    return lib, ""


def _resolve(disabled: bool, cc: str, cache_env: str) -> tuple[ctypes.CDLL | None, str]:
    """The library or the reason for one setting of the environment variables that decide it
    (the arguments: CC and PORTAPIPE_CACHE_DIR are read again by the helpers)."""
    global _last
    if disabled:
        return None, f"disabled by {_DISABLE}=0"
    try:
        compiler = _compiler()
    except ValueError as exc:  # shlex: unbalanced quotes
        return None, f"cannot parse CC={cc!r}: {exc}"
    if compiler is None:
        return None, "no C compiler found (set CC, or install cc, gcc or clang)"
    try:
        where = cache_dir()
    except OSError as exc:
        return None, f"no writable cache directory for the compiled library: {exc}"
    lib, why = _load(tuple(compiler), where)
    if lib is not None:
        _last = lib
    return lib, why


#: resolutions so far, by (PORTAPIPE_NATIVE, CC, PORTAPIPE_CACHE_DIR): the per-batch check is a look-up
_resolved: dict[tuple[str, str, str], tuple[ctypes.CDLL | None, str]] = {}
#: the library loaded last (the kernels' calls skip the environment look-ups)
_last: ctypes.CDLL | None = None


def _library_or_reason() -> tuple[ctypes.CDLL | None, str]:
    env = os.environ
    key = (env.get(_DISABLE, "").strip(), env.get("CC", ""), env.get("PORTAPIPE_CACHE_DIR", ""))
    found = _resolved.get(key)
    if found is None:
        with _lock:  # one build per process even with several threads asking
            found = _resolved.get(key) or _resolved.setdefault(key, _resolve(key[0] == "0", key[1], key[2]))
    return found


def why_unavailable(device: torch.device | None = None) -> str:
    """Empty when the native path can run on tensors of ``device`` (None: on CPU tensors); else the reason."""
    if device is not None and device.type != "cpu":
        return f"the native path runs on CPU tensors, these are on {device.type}"
    return _library_or_reason()[1]


def available(device: torch.device | None = None) -> bool:
    return why_unavailable(device) == ""


def wanted(use_native: bool | None, device: torch.device) -> bool:
    """Resolve a ``use_native`` option for tensors on ``device``: False never, None when
    available, True always (RuntimeError naming the reason when it cannot run)."""
    if use_native is False:
        return False
    why = why_unavailable(device)
    if use_native and why:
        raise RuntimeError(f"use_native=True but the native LPLB path cannot run: {why}")
    return not why


def library() -> ctypes.CDLL:
    """The loaded library (the last one loaded, if any); RuntimeError with the reason when none can be."""
    if _last is not None:
        return _last
    lib, why = _library_or_reason()
    if lib is None:
        raise RuntimeError(f"the native LPLB path is unavailable: {why}")
    return lib


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor of ``dtype`` (a no-op when it already is one)."""
    if not t.is_cpu:
        raise ValueError(f"the native path takes CPU tensors, got one on {t.device.type}")
    if t.dtype == dtype and t.is_contiguous():
        return t
    return t.to(dtype).contiguous()


def _index_kind(flat: torch.Tensor) -> str:
    if flat.dtype == torch.int32:
        return "i32"
    if flat.dtype == torch.int64:
        return "i64"
    raise TypeError(f"indices must be int32 or int64, got {flat.dtype}")


def _check_status(status: int, name: str, bad_layout: str, bad_indices: str = "") -> None:
    """Raise for a negative status of the C functions: -1 out of memory, -2 bad layout, -3 bad indices."""
    if status == -1:
        raise MemoryError(f"{name} could not allocate its workspace")
    if status == -2:
        raise ValueError(f"{name}: {bad_layout}")
    if status == -3:
        raise ValueError(f"{name}: {bad_indices}")


def count_experts(flat: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, int]:
    """(``bincount(flat + 1, minlength=n_experts + 1)`` as int64, position of the first entry
    outside [-1, n_experts) or -1). ``flat``: int32/int64 CPU indices (read in memory order)."""
    flat = _cpu(flat, flat.dtype)
    out = torch.empty(n_experts + 1, dtype=torch.int64)
    p = out.data_ptr()
    return out, int(_count_fn(flat)(flat.data_ptr(), flat.numel(), n_experts, p + 8, p))


def count_row(indices: torch.Tensor, counts: torch.Tensor, row: int) -> int:
    """Count ``indices`` (int32/int64 CPU, any shape; -1 entries ignored) per expert into row
    ``row`` of ``counts`` [S, E] (contiguous int64), in place. Returns the position (in memory
    order) of the first entry outside [-1, E), or -1 when all are valid."""
    indices = _cpu(indices, indices.dtype)
    S, E = counts.shape
    if counts.dtype != torch.int64 or not counts.is_contiguous() or not counts.is_cpu or not 0 <= row < S:
        raise ValueError(f"count_row: counts must be a contiguous int64 CPU [S, E] tensor and row in [0, S), got {counts.dtype} {list(counts.shape)}, row {row}")
    return int(_count_fn(indices)(indices.data_ptr(), indices.numel(), E, counts.data_ptr() + 8 * row * E, None))


def _count_fn(indices: torch.Tensor) -> Any:
    lib = library()
    return lib.lplb_count_i32 if _index_kind(indices) == "i32" else lib.lplb_count_i64


def map_indices(flat: torch.Tensor, stay: torch.Tensor, orig_phys: torch.Tensor, copy_phys: torch.Tensor) -> torch.Tensor:
    """Physical ids in ``flat``'s dtype: entry j of expert e goes to ``orig_phys[e]`` if fewer than
    ``stay[e]`` entries of e precede it, else to ``copy_phys[e]``; -1 stays -1. Entries must be in
    [-1, E) (:func:`count_experts` checks that)."""
    flat = _cpu(flat, flat.dtype)
    kind = _index_kind(flat)
    n_experts = stay.numel()
    maps = [_cpu(t, torch.int64) for t in (stay, orig_phys, copy_phys)]
    if any(t.numel() != n_experts for t in maps):
        raise ValueError(f"stay, orig_phys and copy_phys must each have {n_experts} entries, got {[t.numel() for t in maps]}")
    out = torch.empty_like(flat)
    status = getattr(library(), f"lplb_map_{kind}")(flat.data_ptr(), flat.numel(), n_experts, *(t.data_ptr() for t in maps), out.data_ptr())
    if status == 2:
        raise ValueError(f"map_indices: indices must be in [-1, {n_experts}) (count_experts names the first one outside)")
    if status:
        raise MemoryError("lplb_map could not allocate its counters")
    return out


def balance(
    holder: torch.Tensor,
    fixed: torch.Tensor,
    w: torch.Tensor,
    *,
    move_cost: float,
    tol: float,
    max_iter: int,
    accept_rtol: float,
    step_frac: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The C counterpart of ``lp_balance._balance``: fixed [G, g], w [G, g*d] loads, holder [g*d]
    (the rank hosting each column's copy). Returns (keep [G, g*d], objective [G], lower bound [G],
    accepted [G] bool, iterations), float64."""
    G, g = fixed.shape
    n = w.shape[1]
    if w.shape[0] != G or holder.numel() != n or n % g:
        raise ValueError(f"balance: fixed [G, g], w [G, g*d] and holder [g*d] disagree: {list(fixed.shape)}, {list(w.shape)}, {list(holder.shape)}")
    holder = _cpu(holder, torch.int64)
    fixed, w = _cpu(fixed, torch.float64), _cpu(w, torch.float64)
    keep = torch.empty(G, n, dtype=torch.float64)
    objective = torch.empty(G, dtype=torch.float64)
    bound = torch.empty(G, dtype=torch.float64)
    accepted = torch.empty(G, dtype=torch.bool)  # one byte per entry, 0 or 1
    iterations = library().lplb_balance(
        G, g, n // g, holder.data_ptr(), fixed.data_ptr(), w.data_ptr(), move_cost, tol, max_iter, accept_rtol, step_frac,
        keep.data_ptr(), objective.data_ptr(), bound.data_ptr(), accepted.data_ptr(),
    )
    _check_status(iterations, "lplb_balance", f"holder must name ranks in [0, {g}) of the group")
    return keep, objective, bound, accepted, int(iterations)


class PlanOutput:
    """One plan call's results over its two output buffers, each tensor cut when first read: a
    cut is a tensor operation, and the training path reads one or two of them per batch.
    ``accepted`` [G] bool and ``iterations`` are there from the start."""

    def __init__(self, reals: torch.Tensor, ints: torch.Tensor, accepted: torch.Tensor, iterations: int, dims: tuple[int, ...]) -> None:
        self._reals, self._ints = reals, ints
        self._keep_shape, (self._S, self._E, self._P) = dims[:3], dims[3:]
        self._n = dims[0] * dims[1] * dims[2]  # keep's entries: the reals buffer's first part
        self.accepted, self.iterations = accepted, iterations

    @cached_property
    def keep(self) -> torch.Tensor:
        """[G, g, d] share of each (rank, class) load kept by the originals."""
        return self._reals[: self._n].view(self._keep_shape)

    @cached_property
    def objective(self) -> torch.Tensor:
        return self._reals[self._n : self._n + len(self.accepted)]

    @cached_property
    def bound(self) -> torch.Tensor:
        return self._reals[self._n + len(self.accepted) :]

    @cached_property
    def moved(self) -> torch.Tensor:
        return self._ints[: self._S * self._E].view(self._S, self._E)

    @cached_property
    def phys(self) -> torch.Tensor:
        return self._ints[self._S * self._E : self._S * self._E + self._P]

    @cached_property
    def rank_load(self) -> torch.Tensor:
        return self._ints[self._S * self._E + self._P :]


class PlanCall:
    """:func:`plan` with everything but the batch bound once: the layout, holder and solver
    settings are checked, converted and packed into the C call's layout record here, so a call
    costs the C work, one ctypes call of eleven arguments and three allocations (a planner makes
    one per placement; per batch it is the hot path).

    A call takes ``counts`` [S, E] (E = the layout's experts) and optionally the ``indices`` to
    map (counted in row ``source``); it returns (:class:`PlanOutput`, the mapped indices in
    ``indices``' shape and dtype, or None).
    """

    def __init__(
        self,
        layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        holder: torch.Tensor,
        *,
        n_groups: int,
        ep_size: int,
        n_physical: int,
        tol: float,
        max_iter: int,
        accept_rtol: float,
        step_frac: float,
        frac_bits: int,
    ) -> None:
        self.maps = [_cpu(t, torch.int64) for t in layout]  # kept: the C call reads their memory
        self.holder = _cpu(holder, torch.int64)
        E, n = self.maps[0].numel(), self.holder.numel()
        g = n_groups and ep_size // n_groups
        if any(t.numel() != E for t in self.maps) or g * n_groups != ep_size or not g or n % g or n_physical % ep_size:
            raise ValueError(
                f"plan: layout maps of {[t.numel() for t in self.maps]} entries, holder of {n}, "
                f"{n_groups} groups, EP {ep_size} and {n_physical} slots do not fit together"
            )
        self.E, self.G, self.g, self.d, self.ep, self.P = E, n_groups, g, n // g, ep_size, n_physical
        rank_of, lp_slot, orig, copy = (t.data_ptr() for t in self.maps)
        self._layout = _PlanLayout(
            E=E, G=n_groups, m=g, d=n // g, max_iter=max_iter, frac_bits=frac_bits, P=n_physical, per_rank=n_physical // ep_size,
            tol=tol, accept_rtol=accept_rtol, step_frac=step_frac,
            rank_of=rank_of, lp_slot=lp_slot, orig=orig, copy=copy, holder=self.holder.data_ptr(),
        )
        self._layout_ptr = ctypes.addressof(self._layout)
        self._fn = library().lplb_plan
        self._bad_layout = (
            f"holder must name ranks in [0, {g}), and rank_of, lp_slot, orig_phys and copy_phys ranks, LP slots and "
            f"physical slots in range (lp_slot and copy_phys may be -1)"
        )

    def __call__(self, counts: torch.Tensor, indices: torch.Tensor | None = None, source: int = 0) -> tuple[PlanOutput, torch.Tensor | None]:
        S, E = counts.shape
        if E != self.E or not 0 <= source < S:
            raise ValueError(f"plan: counts [{S}, {E}] and source {source} do not fit a layout of {self.E} experts")
        counts = _cpu(counts, torch.int64)
        G, n = self.G, self.g * self.d
        # One buffer per dtype, cut into the plan's tensors when they are read.
        reals = torch.empty(G * (n + 2), dtype=torch.float64)
        ints = torch.empty(S * E + self.P + self.ep, dtype=torch.int64)
        accepted = torch.empty(G, dtype=torch.bool)  # one byte per entry, 0 or 1
        mapped = idx_ptr = out_ptr = None
        n_idx = width = 0
        if indices is not None:
            indices = _cpu(indices, indices.dtype)
            _index_kind(indices)
            mapped = torch.empty_like(indices)
            idx_ptr, out_ptr, n_idx, width = indices.data_ptr(), mapped.data_ptr(), indices.numel(), indices.element_size()
        iterations = self._fn(self._layout_ptr, S, counts.data_ptr(), reals.data_ptr(), ints.data_ptr(), accepted.data_ptr(),
                              idx_ptr, n_idx, width, source, out_ptr)
        _check_status(iterations, "lplb_plan", self._bad_layout, f"indices must be in [-1, {E}) (count_experts names the first one outside)")
        return PlanOutput(reals, ints, accepted, int(iterations), (G, self.g, self.d, S, E, self.P)), mapped


def plan(
    counts: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    holder: torch.Tensor,
    *,
    indices: torch.Tensor | None = None,
    source: int = 0,
    **settings: Any,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The C counterpart of ``lplb.Planner.plan`` in one call: counts [S, E] int64 per source,
    layout = (rank_of, lp_slot, orig_phys, copy_phys) [E] each (lp_slot and copy_phys -1 for an
    expert without a copy), holder [g*d]. With ``indices`` (1-d, range-checked, counted in row
    ``source``) the same call maps them as :func:`map_indices` with that row's kept counts.
    ``settings``: :class:`PlanCall`'s keyword arguments (n_groups, ep_size, n_physical, tol,
    max_iter, accept_rtol, step_frac, frac_bits).
    Returns ((keep [G, g*d], objective, bound, accepted, iterations) as :func:`balance`,
    moved [S, E], phys_load [P], rank_load [ep], the mapped indices or None)."""
    S, E = counts.shape
    if any(t.numel() != E for t in layout):
        raise ValueError(f"plan: counts [{S}, {E}] and layout maps of {[t.numel() for t in layout]} entries do not fit together")
    out, mapped = PlanCall(layout, holder, **settings)(counts, indices, source)
    G = out.keep.shape[0]
    return (out.keep.reshape(G, -1), out.objective, out.bound, out.accepted, out.iterations), out.moved, out.phys, out.rank_load, mapped
