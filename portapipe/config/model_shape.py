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
    #: the architecture (portapipe, deepseek_v3, qwen3_moe): the attention, the router and the norms' precision
    arch: str = "portapipe"
    #: deepseek_v3's multi-head latent attention (0: not this architecture; q_lora_rank 0: a full-rank query)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    #: qwen3_moe's grouped-query attention (0: not this architecture)
    n_kv_heads: int = 0
    head_dim: int = 0
    #: deepseek_v3 / qwen3_moe: the top-k weights renormalised to sum 1
    norm_topk_prob: bool = False
    #: ``train.fp8`` is on: the recipe's GEMMs in FP8, the routed rows dispatched in FP8
    fp8: bool = False
    #: the device's fused attention takes a value head width other than the query / key's (else
    #: such an attention, MLA's, runs torch's math path, which saves the attention probabilities)
    fused_unequal_heads: bool = False
    #: ``train.seq_aux_loss_weight`` is on: each MoE layer's routing also computes the
    #: sequence-wise balance loss (what its backward keeps: :func:`portapipe.plan.shape.saved_bytes`)
    seq_aux: bool = False

    @classmethod
    def of(cls, model: Any, **extra: Any) -> Shape:
        """From a ``ModelConfig`` (or any object / dict with these fields; the ones with a default may
        be missing, and an architecture's keys another architecture leaves None are 0); ``extra``
        sets the fields that are not the model's (``fp8``, ``fused_unequal_heads``, ``seq_aux``)."""
        get = model.get if isinstance(model, dict) else lambda name: getattr(model, name, None)
        values = {f.name: get(f.name) for f in fields(cls)}
        values = {k: (0 if v is None and isinstance(cls.__dataclass_fields__[k].default, int) else v) for k, v in values.items()}
        return cls(**{**{k: v for k, v in values.items() if v is not None}, **extra})

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
        """The rotary tables of one attention (cos and sin in the model's dtype, saved by every
        micro-batch: counted once per layer while any micro-batch is held). The portapipe model's
        cover half a head (module buffers); the Hugging Face architectures' (cached per layer)
        the rotary width twice over."""
        if self.arch == "deepseek_v3":
            return 2 * self.seq_len * self.qk_rope_head_dim * self.e
        if self.arch == "qwen3_moe":
            return 2 * self.seq_len * self.head_dim * self.e
        return 2 * self.seq_len * ((self.hidden // self.n_heads) // 2) * self.e
