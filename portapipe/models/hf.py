"""Hugging Face names and configs of the deepseek_v3 and qwen3_moe architectures.

One place maps a logical name (the single-process model's, see
:mod:`portapipe.scheduling.stage`) to the Hugging Face tensors it is made of, and a
``config.json`` to the ``model`` section of a portapipe config and back:

- most tensors are one Hugging Face tensor under another name;
- a fused gate/up projection (``ffn.gate_up``, ``moe.shared.gate_up``) is the gate's and the
  up projection's weights stacked along the output dimension;
- a routed expert's slice (``layers.3.moe.experts.5.gate_up``, ``...down``) is stored
  ``[in, out]`` here and ``[out, in]`` (one ``nn.Linear`` per expert) there, so it is transposed.

Reading and writing the files is :mod:`portapipe.models.hf_io`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..config.model_rules import YARN_KEYS

HF_ARCHS = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}

_ATTN = {
    "wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm",
    "q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj",
    "kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj",
}  # fmt: skip
_TOP = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight", "head.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"moe\.experts\.(\d+)\.(gate_up|down)")


@dataclass(frozen=True)
class Source:
    """The Hugging Face tensors a logical tensor is made of: ``names`` stacked along dim 0, then
    transposed when ``transpose``."""

    names: tuple[str, ...]
    transpose: bool = False

    def combine(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        t = tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=0)
        return t.t() if self.transpose else t

    def split(self, t: torch.Tensor) -> dict[str, torch.Tensor]:
        """The logical tensor ``t`` as its Hugging Face tensors (contiguous copies)."""
        if self.transpose:
            t = t.t()
        parts = t.chunk(len(self.names), dim=0) if len(self.names) > 1 else (t,)
        return {n: p.contiguous().clone() for n, p in zip(self.names, parts)}

    def shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Shape of each Hugging Face tensor for a logical tensor of ``shape``."""
        s = tuple(reversed(shape)) if self.transpose else tuple(shape)
        return {n: (s[0] // len(self.names), *s[1:]) for n in self.names}


def source(key: str) -> Source:
    """The Hugging Face tensors of logical name ``key``; ValueError for a name with none."""
    if key in _TOP:
        return Source((_TOP[key],))
    m = _LAYER.fullmatch(key)
    if m is None:
        raise ValueError(f"{key!r} has no Hugging Face counterpart")
    pre, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if e := _EXPERT.fullmatch(rest):
        base = f"{pre}mlp.experts.{e.group(1)}."
        if e.group(2) == "gate_up":
            return Source((f"{base}gate_proj.weight", f"{base}up_proj.weight"), transpose=True)
        return Source((f"{base}down_proj.weight",), transpose=True)
    simple = {
        # a multi-token prediction module's own weights (DeepSeek-V3's published layout)
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "shared_head.norm.weight",
        "norm1.weight": "input_layernorm.weight",
        "norm2.weight": "post_attention_layernorm.weight",
        "ffn.down.weight": "mlp.down_proj.weight",
        "moe.shared.down.weight": "mlp.shared_experts.down_proj.weight",
        "moe.router.gate.weight": "mlp.gate.weight",
        "moe.router.bias": "mlp.gate.e_score_correction_bias",
    }
    if rest in simple:
        return Source((pre + simple[rest],))
    if rest in ("ffn.gate_up.weight", "moe.shared.gate_up.weight"):
        mlp = "mlp." if rest.startswith("ffn") else "mlp.shared_experts."
        return Source((f"{pre}{mlp}gate_proj.weight", f"{pre}{mlp}up_proj.weight"))
    parts = rest.split(".")
    if len(parts) == 3 and parts[0] == "attn" and parts[1] in _ATTN and parts[2] == "weight":
        return Source((f"{pre}self_attn.{_ATTN[parts[1]]}.weight",))
    raise ValueError(f"{key!r} has no Hugging Face counterpart")


def ignored(name: str, m: ModelConfig) -> bool:
    """Hugging Face tensors a portapipe model ``m`` does not hold: multi-token-prediction layers
    past its own (``num_hidden_layers + model.mtp_layers``), stored RoPE frequencies (recomputed),
    FP8 weights' block scales (read with their weights) and the copies :func:`stored_copies`
    names (checked equal to their originals on load)."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    past = layer is not None and int(layer.group(1)) >= m.n_layers + m.mtp_layers
    # an FP8 weight's scales are read with it (portapipe.models.hf_folder.Folder.read)
    return past or name.endswith(("rotary_emb.inv_freq", SCALE_SUFFIX)) or name in stored_copies(m)


def stored_copies(m: ModelConfig) -> dict[str, str]:
    """Hugging Face tensors a folder may hold as copies of another one (copy -> original), which
    loading checks equal: a tied head saved beside the embedding; each multi-token prediction
    layer's embedding and head (``model.layers.{n}.embed_tokens`` / ``shared_head.head``, the
    published layout), one weight with the model's."""
    head = _TOP["embed.weight"] if m.tie_word_embeddings else _TOP["head.weight"]
    out = {_TOP["head.weight"]: _TOP["embed.weight"]} if m.tie_word_embeddings else {}
    for i in range(m.n_layers, m.n_layers + m.mtp_layers):
        out[f"model.layers.{i}.embed_tokens.weight"] = _TOP["embed.weight"]
        out[f"model.layers.{i}.shared_head.head.weight"] = head
    return out


def written_copies(m: ModelConfig) -> dict[str, str]:
    """The copies :func:`stored_copies` names that an export writes: the multi-token prediction
    layers' (as published; transformers omits a tied head)."""
    return {k: v for k, v in stored_copies(m).items() if k != _TOP["head.weight"]}


# ------------------------------------------------------------------------------------- configs
#: transformers' defaults for optional config.json keys (what it uses when a key is absent)
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v3": {
        "rms_norm_eps": 1e-6, "norm_topk_prob": True, "rope_interleave": True, "q_lora_rank": None, "n_shared_experts": 1,
        "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "first_k_dense_replace": 3,
    },
    "qwen3_moe": {"rms_norm_eps": 1e-6, "norm_topk_prob": False, "mlp_only_layers": [], "decoder_sparse_step": 1},
}  # fmt: skip


#: a config.json's quantization_config of DeepSeek-V3's published FP8 weights (``*.weight`` in E4M3 with
#: ``*.weight_scale_inv``, one float32 dequantization scale per 128x128 block, ceil-divided at the edges)
FP8_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
SCALE_SUFFIX = "_scale_inv"


def fp8_blocks(hf: dict[str, Any]) -> dict[str, Any] | None:
    """The quantization_config of ``hf`` when it is DeepSeek's FP8 one (activations are quantized
    dynamically whatever the weights' file says), else None."""
    q = hf.get("quantization_config")
    if not isinstance(q, dict):
        return None
    ok = q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3" and list(q.get("weight_block_size") or []) == [128, 128]
    return q if ok else None


def fp8_weight(key: str) -> bool:
    """Whether the logical tensor ``key`` is one of the Linear weights the published FP8 layout
    stores in E4M3: the attention projections, the dense FFN, the shared and the routed experts
    (not the embedding, the head, the norms, the router, nor a prediction module's eh_proj)."""
    m = _LAYER.fullmatch(key)
    if m is None:
        return False
    rest = m.group(2)
    if _EXPERT.fullmatch(rest) or rest in ("ffn.gate_up.weight", "ffn.down.weight", "moe.shared.gate_up.weight", "moe.shared.down.weight"):
        return True
    parts = rest.split(".")
    return len(parts) == 3 and parts[0] == "attn" and parts[2] == "weight" and not parts[1].endswith("norm")


def rope_of(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) from either the current ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling`` keys."""
    params = hf.get("rope_parameters") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params else None)
    return float(theta), normal_scaling(scaling)


def normal_scaling(d: dict[str, Any] | None) -> dict[str, Any] | None:
    """A RoPE scaling dict in one spelling (``rope_type``, no theta), or None for no scaling."""
    if not d:
        return None
    kind = d.get("rope_type", d.get("type", "default"))
    if kind == "default":
        return None
    out = {k: v for k, v in d.items() if k in YARN_KEYS and k not in ("type", "rope_type", "rope_theta")}
    return {"rope_type": kind, **out}


def model_keys(hf: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(portapipe ``model`` keys a Hugging Face config.json describes, what portapipe cannot run of it)."""
    kind = hf.get("model_type")
    if kind not in HF_ARCHS:
        return {}, [f"model_type {kind!r} is not one of {', '.join(HF_ARCHS)}"]
    g = {**_HF_DEFAULTS[kind], **hf}
    bad: list[str] = []
    for key, ok in (("hidden_act", "silu"), ("attention_bias", False)):
        if g.get(key, ok) != ok:
            bad.append(f"{key} = {g[key]!r} (portapipe supports {ok!r})")
    if g.get("attention_dropout") not in (None, 0, 0.0):
        bad.append(f"attention_dropout = {g['attention_dropout']!r} (portapipe trains without dropout; set 0.0 in config.json to train without it)")
    quant = g.get("quantization_config")
    if quant and fp8_blocks(g) is None:
        bad.append(f"quantization_config = {quant!r} (portapipe reads DeepSeek-V3's FP8 weights: quant_method fp8, fmt e4m3, "
                   "weight_block_size [128, 128]; other quantized weights must be converted to bf16 / float32 first)")
    theta, scaling = rope_of(g)
    partial = g.get("partial_rotary_factor", (g.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        bad.append(f"partial_rotary_factor = {partial} (portapipe rotates the whole rotary part)")
    if scaling is not None and scaling["rope_type"] != "yarn":
        bad.append(f"RoPE type {scaling['rope_type']!r} (portapipe supports default and yarn)")
    try:
        keys: dict[str, Any] = {
            "arch": kind, "vocab_size": g["vocab_size"], "hidden": g["hidden_size"], "n_layers": g["num_hidden_layers"],
            "n_heads": g["num_attention_heads"], "ffn_hidden": g["intermediate_size"], "moe_hidden": g["moe_intermediate_size"],
            "top_k": g["num_experts_per_tok"], "norm_eps": g["rms_norm_eps"], "norm_topk_prob": bool(g["norm_topk_prob"]),
            "rope_theta": theta, "rope_scaling": scaling, "tie_word_embeddings": bool(g.get("tie_word_embeddings", False)),
        }  # fmt: skip
        if kind == "deepseek_v3":
            keys.update(
                n_experts=g.get("n_routed_experts", g.get("num_local_experts")), n_dense=g["first_k_dense_replace"],
                n_shared=g["n_shared_experts"], n_groups=g["n_group"], topk_groups=g["topk_group"],
                routed_scale=float(g["routed_scaling_factor"]), q_lora_rank=g["q_lora_rank"] or 0, kv_lora_rank=g["kv_lora_rank"],
                qk_nope_head_dim=g["qk_nope_head_dim"], qk_rope_head_dim=g["qk_rope_head_dim"], v_head_dim=g["v_head_dim"],
                rope_interleave=bool(g["rope_interleave"]), mtp_layers=int(g.get("num_nextn_predict_layers") or 0),
            )  # fmt: skip
            if g.get("num_key_value_heads", g["num_attention_heads"]) != g["num_attention_heads"]:
                bad.append(f"num_key_value_heads = {g['num_key_value_heads']} != num_attention_heads (latent attention has one key per head)")
            for key, ok in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
                if g.get(key, ok) != ok:
                    bad.append(f"{key} = {g[key]!r} (deepseek_v3 routes with {ok!r})")
        else:
            dense = list(g["mlp_only_layers"] or [])
            if dense != list(range(len(dense))) or g["decoder_sparse_step"] != 1:
                bad.append(
                    f"dense layers mlp_only_layers = {dense}, decoder_sparse_step = {g['decoder_sparse_step']} "
                    "(portapipe supports dense layers first: [0, 1, ..., k-1] and step 1)"
                )
            if g.get("use_sliding_window"):
                bad.append("use_sliding_window = true (portapipe attends over the whole sequence)")
            heads = g["num_attention_heads"]
            keys.update(
                n_experts=g.get("num_experts", g.get("num_local_experts")), n_dense=len(dense), n_shared=0,
                n_kv_heads=g.get("num_key_value_heads", heads), head_dim=g.get("head_dim") or g["hidden_size"] // heads,
            )  # fmt: skip
    except KeyError as missing:
        return {}, bad + [f"config.json lacks {missing.args[0]!r}"]
    return keys, bad


def config_problems(m: ModelConfig, hf: dict[str, Any], where: str) -> list[str]:
    """Where the ``model`` section ``m`` and the Hugging Face config ``hf`` (read from ``where``) disagree."""
    keys, bad = model_keys(hf)
    out = [f"model.init_from: {where}: {line}" for line in bad]
    for key, want in keys.items():
        have = getattr(m, key)
        if key == "mtp_layers":  # fewer modules than the folder holds: the first ones are trained, the rest left out
            if have > want:
                out.append(f"model.mtp_layers: {have}, but {where} holds {want} multi-token prediction layer(s) (num_nextn_predict_layers)")
            continue
        if key == "rope_scaling":
            have = normal_scaling(have)
        if have != want and not (isinstance(want, float) and isinstance(have, float) and abs(have - want) <= 1e-12 * abs(want)):
            out.append(f"model.{key}: {have!r}, but {where} says {want!r}")
    return out


#: config.json keys that describe the tokenizer or the positions a model was made for, not its
#: tensors: an export keeps the values of the folder the run started from.
SOURCE_KEYS = ("max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id")


def hf_config(m: ModelConfig, source: dict[str, Any] | None = None) -> dict[str, Any]:
    """A config.json for transformers (the key spelling of the published checkpoints).

    ``source`` (the config.json of the folder the model started from) gives :data:`SOURCE_KEYS`;
    without one, max_position_embeddings is the length the model was trained at (model.seq_len,
    or what yarn scales to) and no special token ids are written."""
    if m.arch not in HF_ARCHS:
        raise ValueError(f"model.arch {m.arch!r} has no Hugging Face form; export needs {' or '.join(HF_ARCHS)}")
    scaling = None
    max_pos = m.seq_len
    if m.rope_scaling is not None and normal_scaling(m.rope_scaling) is not None:
        scaling = {"type": "yarn", **{k: v for k, v in normal_scaling(m.rope_scaling).items() if k != "rope_type"}}  # type: ignore[union-attr]
        max_pos = max(m.seq_len, int(scaling["factor"] * scaling["original_max_position_embeddings"]))
    out: dict[str, Any] = {
        "architectures": [HF_ARCHS[m.arch]], "model_type": m.arch, "vocab_size": m.vocab_size, "hidden_size": m.hidden,
        "intermediate_size": m.ffn_hidden, "moe_intermediate_size": m.moe_hidden, "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads, "num_experts_per_tok": m.top_k, "norm_topk_prob": bool(m.norm_topk_prob),
        "hidden_act": "silu", "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": scaling,
        "max_position_embeddings": max_pos, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": bool(m.tie_word_embeddings),
        "initializer_range": m.init_std, "torch_dtype": m.dtype, "use_cache": True,
    }  # fmt: skip
    if m.arch == "deepseek_v3":
        out.update(
            num_key_value_heads=m.n_heads, n_routed_experts=m.n_experts, n_shared_experts=m.n_shared,
            first_k_dense_replace=m.n_dense, n_group=m.n_groups, topk_group=m.topk_groups, routed_scaling_factor=m.routed_scale,
            q_lora_rank=m.q_lora_rank or None, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
            qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim, rope_interleave=bool(m.rope_interleave),
            topk_method="noaux_tc", scoring_func="sigmoid", num_nextn_predict_layers=m.mtp_layers,
        )  # fmt: skip
    else:
        out.update(
            num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim, num_experts=m.n_experts,
            mlp_only_layers=list(range(m.n_dense)), decoder_sparse_step=1, use_sliding_window=False, sliding_window=None,
        )  # fmt: skip
    out.update({k: source[k] for k in SOURCE_KEYS if source is not None and k in source})
    return out
