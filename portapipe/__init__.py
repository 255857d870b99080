"""portapipe: DeepSeek-style pipeline and expert parallelism for MoE training on any accelerator."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # ``portapipe.pipeline`` (your own model, docs/models.md) without importing torch on ``import portapipe``.
    if name == "pipeline":
        from .plain import pipeline

        return pipeline
    raise AttributeError(f"module 'portapipe' has no attribute {name!r}")
