"""The model's shape: the fields of ``ModelConfig`` that decide sizes and work.

A leaf module below both :mod:`portapipe.config.setup` (a :class:`~portapipe.config.setup.Setup` carries the
shape of its model, made once and shared by every candidate a plan makes from it) and
:mod:`portapipe.plan.shape`, which says what each part of the model holds and computes from it.
It imports nothing of portapipe.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

ELEMENT_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Shape:
    """The model fields that decide sizes and work (a subset of ``ModelConfig``)."""

    vocab_size: int
    hidden: int
    n_layers: int
    n_dense: int
    n_heads: int
    ffn_hidden: int
    moe_hidden: int
    n_experts: int
    n_shared: int
    top_k: int
    seq_len: int
    dtype: str
    #: multi-token prediction modules (DeepSeek-V3's D) on the last block
    mtp_layers: int = 0
    #: the head is the embedding (one weight; its copy on the last block when that is not the first)
    tie_word_embeddings: bool = False

    @classmethod
    def of(cls, model: Any) -> Shape:
        """From a ``ModelConfig`` (or any object / dict with these fields; the ones with a default may be missing)."""
        if isinstance(model, dict):
            return cls(**{f.name: model[f.name] for f in fields(cls) if f.name in model})
        return cls(**{f.name: getattr(model, f.name) for f in fields(cls) if hasattr(model, f.name)})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def e(self) -> int:
        """Bytes of one element of the model's dtype."""
        return ELEMENT_BYTES[self.dtype]

    @property
    def lse_bytes(self) -> int:
        """Bytes of one attention log-sum-exp (kept in at least float32)."""
        return max(self.e, 4)

    @property
    def shared_width(self) -> int:
        return self.moe_hidden * self.n_shared

    def is_moe(self, layer: int) -> bool:
        return layer >= self.n_dense

    def rope_bytes(self) -> int:
        """The rotary tables of one attention (module buffers, saved by every micro-batch:
        counted once per layer while any micro-batch is held)."""
        return 2 * self.seq_len * ((self.hidden // self.n_heads) // 2) * self.e
