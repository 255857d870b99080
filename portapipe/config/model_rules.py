"""The model section's rules that depend on the architecture: which keys belong to which
architecture (and their values there when not given), and the checks of ``rope_scaling``."""

from __future__ import annotations

from typing import Any

ARCHS = ("portapipe", "deepseek_v3", "qwen3_moe")

#: Keys that belong to one architecture, and the value each takes there when not given.
#: Unset (None) for every other architecture; setting one there is an error.
ARCH_KEYS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "q_lora_rank": 0,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "rope_interleave": True,
        "norm_topk_prob": True,
        "rope_theta": 10000.0,
    },
    "qwen3_moe": {"n_kv_heads": None, "head_dim": None, "norm_topk_prob": False, "rope_theta": 10000.0},
}
#: Architecture-independent keys whose default differs for an architecture.
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {"qwen3_moe": {"n_shared": 0}}


YARN_KEYS = ("type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate")


def model_problems(m: Any) -> list[str]:
    """Rules of the model section (``m``, a :class:`~portapipe.config.ModelConfig`; not imported:
    config.py imports this module) that depend on the architecture."""
    out: list[str] = []
    owners: dict[str, list[str]] = {}
    for arch, keys in ARCH_KEYS.items():
        for key in keys:
            owners.setdefault(key, []).append(arch)
    for key, archs in owners.items():
        if m.arch not in archs and getattr(m, key) is not None:
            out.append(f"model.{key}: {getattr(m, key)!r} applies to model.arch {' / '.join(archs)} only (model.arch is {m.arch})")
    if m.arch != "portapipe" and m.rope_scaling is not None:
        out += _rope_scaling_checks(m.rope_scaling)
    elif m.rope_scaling is not None:
        out.append(f"model.rope_scaling: applies to model.arch deepseek_v3 / qwen3_moe only (model.arch is {m.arch})")
    if m.init_from is not None and m.arch == "portapipe":
        out.append("model.init_from: loads Hugging Face weights of model.arch deepseek_v3 or qwen3_moe; set model.arch")
    if m.arch == "portapipe" and m.hidden % m.n_heads:
        out.append(f"model.hidden: {m.hidden} is not divisible by model.n_heads = {m.n_heads}")
    if m.arch == "qwen3_moe":
        if m.head_dim is None:
            out.append(f"model.head_dim: not set, and model.hidden = {m.hidden} is not divisible by model.n_heads = {m.n_heads}; set it")
        elif m.head_dim % 2:
            out.append(f"model.head_dim: {m.head_dim} is odd; RoPE rotates pairs of dimensions")
        if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
            out.append(f"model.n_kv_heads: {m.n_kv_heads} does not divide model.n_heads = {m.n_heads}")
        if m.n_shared:
            out.append(f"model.n_shared: {m.n_shared}; qwen3_moe has no shared expert (set 0)")
        if m.n_groups != 1 or m.topk_groups != 1:
            out.append(f"model.n_groups: {m.n_groups} / topk_groups: {m.topk_groups}; qwen3_moe routes by a softmax over all experts (set both to 1)")
        if m.routed_scale != 1.0:
            out.append(f"model.routed_scale: {m.routed_scale}; qwen3_moe does not scale the routed weights (set 1.0)")
    if m.mtp_layers:
        if m.arch == "qwen3_moe":
            out.append(f"model.mtp_layers: {m.mtp_layers}; qwen3_moe has no multi-token prediction modules (its Hugging Face "
                       "layout holds none to load or write); set 0, or use deepseek_v3 / portapipe")
        if m.mtp_layers > m.seq_len - 1:
            out.append(f"model.mtp_layers: {m.mtp_layers} leaves no token to predict at depth {m.seq_len} in sequences of "
                       f"model.seq_len = {m.seq_len}; at most {m.seq_len - 1}")
    if m.arch == "deepseek_v3":
        if m.qk_rope_head_dim is not None and m.qk_rope_head_dim % 2:
            out.append(f"model.qk_rope_head_dim: {m.qk_rope_head_dim} is odd; RoPE rotates pairs of dimensions")
        if m.n_groups > 1 and m.n_experts % m.n_groups == 0 and m.n_experts // m.n_groups < 2:
            out.append(f"model.n_groups: {m.n_groups} leaves {m.n_experts // m.n_groups} expert per group; deepseek_v3 scores a group by its top 2 experts")
    return out


def _rope_scaling_checks(d: dict[str, Any]) -> list[str]:
    out = []
    kind = d.get("rope_type", d.get("type"))
    if kind not in ("yarn", "default"):
        out.append(f"model.rope_scaling: type {kind!r} is not supported; yarn (or default, no scaling) is")
    unknown = sorted(set(d) - set(YARN_KEYS))
    if unknown:
        out.append(f"model.rope_scaling: unknown key(s) {', '.join(unknown)}; known: {', '.join(YARN_KEYS)}")
    if kind == "yarn":
        factor, orig = d.get("factor"), d.get("original_max_position_embeddings")
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            out.append(f"model.rope_scaling.factor: {factor!r}; yarn needs a positive factor")
        if not isinstance(orig, int) or isinstance(orig, bool) or orig < 1:
            out.append(f"model.rope_scaling.original_max_position_embeddings: {orig!r}; yarn needs the pretraining length (a positive integer)")
    return out


def objective_problems(m: Any, t: Any) -> list[str]:
    """The training objective's keys (``t``, the train section) that the model ``m`` cannot honour."""
    out: list[str] = []
    if t.seq_aux_loss_weight and m.n_dense >= m.n_layers:
        out.append(f"train.seq_aux_loss_weight: {t.seq_aux_loss_weight} but the model has no MoE layer (model.n_dense = "
                   f"{m.n_dense} of {m.n_layers} layers); set 0")
    return out
