"""Backends: the only package that knows which hardware portapipe runs on."""

from .base import Backend, BackendUnavailable, ParallelGroups, mesh_coords
from .registry import check_available, get_backend, known_backends, resolve_name

__all__ = [
    "Backend",
    "BackendUnavailable",
    "ParallelGroups",
    "check_available",
    "get_backend",
    "known_backends",
    "mesh_coords",
    "resolve_name",
]
