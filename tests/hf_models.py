"""Tiny random deepseek_v3 / qwen3_moe models in transformers and their portapipe model sections.

Each variant is one portapipe ``model`` section and the transformers config that describes the
same model (built from it with :func:`portapipe.models.hf.hf_config`, so the test also checks that
config.json form). Weights are random (norm gains around 1, router biases non-zero) and saved in
float64 with transformers' own ``save_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import load_config
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.hf import hf_config
from portapipe.models.moe import Block, build_blocks
from portapipe.scheduling.overlap import Tape, run

# mscale != mscale_all_dim: a swap of the two yarn terms changes the logits
YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.707}
COMMON = dict(vocab_size=64, hidden=32, ffn_hidden=48, moe_hidden=16, n_layers=4, n_experts=8, seq_len=16)

VARIANTS: dict[str, dict[str, Any]] = {
    # low-rank queries, yarn, interleaved RoPE, group-limited top-3, scaled weights, one shared expert
    "deepseek_v3": dict(
        COMMON, arch="deepseek_v3", n_heads=4, n_dense=1, n_shared=1, top_k=3, n_groups=4, topk_groups=2, routed_scale=2.5,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, rope_scaling=YARN,
    ),
    # full-rank queries, RoPE over halves, no groups, weights not normalised, two shared experts
    "deepseek_v3_plain": dict(
        COMMON, arch="deepseek_v3", n_heads=2, n_dense=2, n_shared=2, top_k=2, q_lora_rank=0, kv_lora_rank=8,
        qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=8, rope_interleave=False, norm_topk_prob=False, rope_theta=500.0,
    ),
    # GQA (4 query heads, 2 key/value heads), one dense layer first, normalised top-2
    "qwen3_moe": dict(COMMON, arch="qwen3_moe", n_heads=4, n_kv_heads=2, head_dim=8, n_dense=1, top_k=2, norm_topk_prob=True),
    # every layer MoE, yarn, softmax weights as they are
    "qwen3_moe_yarn": dict(COMMON, arch="qwen3_moe", n_heads=2, head_dim=16, n_dense=0, top_k=3, rope_scaling=YARN),
}  # fmt: skip


def model_section(variant: str, **extra: Any) -> dict[str, Any]:
    return {**VARIANTS[variant], **extra}


def transformers_model(variant: str, dtype: torch.dtype = torch.float64, seed: int = 0, **model: Any) -> Any:
    """A random transformers model of the variant (eager attention and experts, ``dtype``;
    ``model``: keys of the portapipe model section changed)."""
    import transformers

    m = load_config({"model": model_section(variant, **model)}).model
    raw = hf_config(m)
    cls = getattr(transformers, raw["architectures"][0])
    config_cls = cls.config_class
    kwargs = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = config_cls(**kwargs, attn_implementation="eager", experts_implementation="eager")
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn_like(b))
    return model


def save(model: Any, path: Path, **kwargs: Any) -> Path:
    model.save_pretrained(str(path), **kwargs)
    return path


def portapipe_blocks(variant: str, folder: Path, n_blocks: int = 2, dtype: str = "float64", **extra: Any) -> list[Block]:
    m = load_config({"model": model_section(variant, init_from=str(folder), dtype=dtype, **extra)}).model
    blocks = build_blocks(m, list(range(n_blocks)), n_blocks, ExpertParallel(CPUBackend()), seed=1)
    return [blocks[b] for b in range(n_blocks)]


def logits(blocks: list[Block], tokens: torch.Tensor) -> torch.Tensor:
    """The single-process forward to the logits (one autograd graph)."""
    tape = Tape(record=False)
    h = tokens
    for b in blocks:
        if b.block == 0:
            h = b.embed_part(h)
        for layer in b.layers.values():
            h = run(layer.program(tape, h))
        if b.is_last:
            return b.logits_part(h)
    raise AssertionError("no block ends in the head")


def tokens(n: int, seq: int, seed: int = 1, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


def mtp_folder(variant: str, path: Path, seed: int = 0, depth: int = 1) -> Path:
    """A folder in DeepSeek-V3's published layout with ``depth`` multi-token prediction layers:
    transformers saves a model ``depth`` layers deeper (those layers are the modules' decoder
    blocks, as published), then each gets ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and the copies ``embed_tokens`` / ``shared_head.head``, and config.json
    says ``num_hidden_layers: n`` and ``num_nextn_predict_layers: depth``."""
    import json

    from safetensors.torch import load_file, save_file

    n = VARIANTS[variant]["n_layers"]
    deeper = transformers_model(variant, seed=seed, n_layers=n + depth)
    save(deeper, path)
    tensors = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 100)
    hidden = VARIANTS[variant]["hidden"]
    for i in range(n, n + depth):
        for leaf in ("enorm", "hnorm", "shared_head.norm"):
            tensors[f"model.layers.{i}.{leaf}.weight"] = 1 + 0.2 * torch.randn(hidden, generator=g, dtype=torch.float64)
        tensors[f"model.layers.{i}.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=g, dtype=torch.float64)
        tensors[f"model.layers.{i}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[f"model.layers.{i}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=depth)
    (path / "config.json").write_text(json.dumps(config))
    return path


def transformers_mtp(folder: Path) -> tuple[Any, Any]:
    """transformers' main model and its ``MtpModel`` read from a folder of :func:`mtp_folder`."""
    import transformers
    from transformers.modeling_layers import MtpModel

    main = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    n = main.config.num_hidden_layers
    # its pattern of MTP keys names DeepSeek-V3's layer 61; this model's modules start at layer n
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{i}\..*" for i in range(n, n + main.config.num_mtp_layers)]
    return main, MtpModel.from_pretrained(main).to(torch.float64)


def mtp_depth_logits(mtp: Any, depth: int, hidden: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Every row's logits of ``MtpModel``'s module ``depth`` on ``hidden`` (the previous depth's rows)
    and the tokens each row embeds: one step of its drafting loop, made of the pieces every
    transformers 5 release has (5.2x adds ``forward_layer`` for it; 5.17 lacks it, and ``forward``
    without labels keeps only the last row)."""
    embeds = mtp.embed_tokens(input_ids)
    masks = mtp.create_masks_for_mtp_layer(depth, embeds, None, position_ids)
    rope = mtp.rotary_emb(embeds, position_ids=position_ids)
    # MtpLayer's positional order is one across releases (the cache argument's name is not)
    out = mtp.layers[depth](embeds, hidden, rope, masks.get("attention_mask"), position_ids, None)
    if mtp.use_shared_post_norm:
        out = mtp.shared_post_norm(out)
    return mtp._project_to_logits(out)
