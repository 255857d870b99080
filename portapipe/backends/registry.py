"""Backend names -> classes; ``auto`` picks by device presence, never by an import succeeding.

Third-party backends register through the ``portapipe.backends`` entry-point group
(``name = "package.module:Class"``). Asking for a backend whose device or software is missing
raises :class:`BackendUnavailable` naming what is missing; nothing silently falls back to CPU.
"""

from __future__ import annotations

import functools
import importlib
import logging
from importlib.metadata import entry_points
from typing import Any

from .base import Backend, BackendUnavailable

log = logging.getLogger("portapipe.backends")

ENTRY_POINT_GROUP = "portapipe.backends"

# Built-in backends are imported only when used: ascend.py must not import torch_npu early.
_BUILTIN: dict[str, str] = {
    "cpu": "portapipe.backends.cpu:CPUBackend",
    "cuda": "portapipe.backends.cuda:CUDABackend",
    "npu": "portapipe.backends.ascend:AscendBackend",
}
# The order in which ``auto`` looks for a device; cpu always exists and comes last.
AUTO_ORDER = ("cuda", "npu", "cpu")

_auto_logged = False


def _load(path: str) -> type[Backend]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@functools.cache
def _plugins() -> dict[str, Any]:
    # read once per process: scanning every installed distribution's metadata takes milliseconds,
    # and the rules ask for each of the planner's thousands of candidate setups
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_backends() -> list[str]:
    """Every backend name that can be asked for: built-ins first, then plug-ins."""
    return list(_BUILTIN) + sorted(set(_plugins()) - set(_BUILTIN))


class PluginError(ValueError):
    """A plug-in backend whose entry point cannot be loaded: bad input (the config names it), said
    in one line naming the ``backend`` key, the entry point and what went wrong."""


def backend_class(name: str) -> type[Backend]:
    if name in _BUILTIN:
        return _load(_BUILTIN[name])
    plugins = _plugins()
    if name in plugins:
        ep = plugins[name]
        where = f"the plug-in entry point {name} = {getattr(ep, 'value', '?')} (group {ENTRY_POINT_GROUP})"
        try:
            cls = ep.load()
        except Exception as exc:  # its module or a module it imports is missing or broken
            text = " ".join(str(exc).split())
            raise PluginError(f"backend: {name!r}: {where} fails to import: {type(exc).__name__}: {text}; "
                              "reinstall the package that provides it, or choose another backend") from exc
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise PluginError(f"backend: {name!r}: {where} is {cls!r}, not a portapipe Backend subclass")
        return cls
    raise ValueError(f"unknown backend {name!r}; known: {', '.join(['auto'] + known_backends())}")


def device_present(name: str) -> bool:
    """Whether the hardware of backend ``name`` is on this machine (ignoring its software)."""
    return bool(backend_class(name).device_present())


def resolve_name(name: str) -> str:
    """``auto`` -> the first backend whose device is present; other names pass through."""
    global _auto_logged
    if name != "auto":
        backend_class(name)  # unknown names fail here
        return name
    for cand in AUTO_ORDER:
        if device_present(cand):
            if not _auto_logged:
                log.info("backend auto: found a %s device, using backend %r", cand, cand)
                _auto_logged = True
            return cand
    raise BackendUnavailable("backend auto found no device at all")  # unreachable: cpu is present


def check_available(name: str) -> str:
    """Resolve ``name`` and make sure it can run here; raise BackendUnavailable otherwise."""
    resolved = resolve_name(name)
    cls = backend_class(resolved)
    if not cls.is_available():
        raise BackendUnavailable(cls.unavailable_reason())
    return resolved


def get_backend(name: str = "auto", options: dict[str, Any] | None = None) -> Backend:
    """An instance of the named backend, checked to be usable on this machine."""
    return backend_class(check_available(name))(options)


def _fp8_path(cls: type[Backend]) -> str:
    """The FP8 matmul that would run here (cuda: whether torch's blockwise kernel serves this GPU)."""
    try:
        return cls().fp8_path()
    except Exception as exc:  # a plug-in that needs options to be made
        return f"{cls.capabilities.fp8_matmul} (not probed: {type(exc).__name__}: {exc})"


def info() -> dict[str, Any]:
    """What ``portapipe info`` reports about backends."""
    out: dict[str, Any] = {}
    for name in known_backends():
        try:
            cls = backend_class(name)
            out[name] = {
                "device_present": bool(cls.device_present()),
                "available": bool(cls.is_available()),
                "device_count": int(cls.device_count()) if cls.device_present() else 0,
                "dist_backend": cls.dist_backend,
                "capabilities": cls.capabilities.as_dict(),
            }
            if out[name]["available"]:
                out[name]["fp8_matmul_path"] = _fp8_path(cls)
            else:
                out[name]["missing"] = cls.unavailable_reason()
        except Exception as exc:  # a broken plug-in must not break `info`
            out[name] = {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    return out
