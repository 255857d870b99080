"""Part e's peer and its FLOPs: transformers' model of the same config (its fastest experts
implementation that runs), the model FLOPs per token by torchtitan's and Megatron's convention,
and the peer's tokens/s on the same batch."""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Any

from .common import Ctx, tail


def hf_model(raw: dict[str, Any], device: Any = "meta") -> tuple[Any, str, list[str]]:
    """transformers' model of ``raw``'s config with its fastest experts implementation that this
    transformers offers: (model, implementation, tried)."""
    import torch
    import transformers

    from portapipe.config import load_config
    from portapipe.models.hf import hf_config

    hf = hf_config(load_config(raw).model)
    cls = getattr(transformers, hf["architectures"][0])
    kwargs = {k: v for k, v in hf.items() if k not in ("architectures", "model_type", "torch_dtype")}
    tried: list[str] = []
    # the fastest first; a transformers without one refuses it when the config or model is built
    for impl in ("grouped_mm", "batched_mm", "eager"):
        tried.append(impl)
        try:
            config = cls.config_class(**kwargs, attn_implementation="sdpa", experts_implementation=impl)
            with torch.device(device):  # built where it runs (meta: shapes only, for counting)
                model = cls(config)
            return model, impl, tried
        except Exception as exc:
            tried[-1] = f"{impl} ({type(exc).__name__}: {str(exc)[:120]})"
    raise RuntimeError(f"no experts implementation of transformers {transformers.__version__} builds this model: {tried}")


def flops_per_token(raw: dict[str, Any]) -> dict[str, Any]:
    """Model FLOPs per token by torchtitan's and Megatron's convention: 6 x the parameters a token
    passes through (routed experts counted at top_k of n_experts, the input embedding left out)
    plus the attention term 6 x layers x seq x heads x (q/k width + v width)."""
    m = raw["model"]
    model, _, _ = hf_model(raw)
    total = active = embed = 0
    for name, p in model.named_parameters():
        n = p.numel()
        total += n
        if "embed_tokens" in name:
            embed += n
            continue
        active += n * m["top_k"] / m["n_experts"] if ".experts." in name else n
    attention = 6 * m["n_layers"] * m["seq_len"] * m["n_heads"] * (m["qk_nope_head_dim"] + m["qk_rope_head_dim"] + m["v_head_dim"])
    return {"params_total": total, "params_embedding": embed, "params_active_per_token": int(active), "attention_term": attention,
            "flops_per_token": 6 * int(active) + attention,
            "convention": "6 x active parameters per token (routed experts at top_k / n_experts, input embedding excluded) "
                          "+ 6 x n_layers x seq_len x n_heads x (qk_nope + qk_rope + v head dims), causal mask not discounted"}


def hf_speed(raw: dict[str, Any], ctx: Ctx) -> dict[str, Any]:
    """transformers' model, float32 weights under bfloat16 autocast (float32 master, as ours),
    the same batch shape, AdamW; the median tokens/s of the timed steps."""
    import torch

    from portapipe.backends import get_backend

    be = get_backend(raw["backend"])
    try:
        model, impl, tried = hf_model(raw, be.device())
        model = model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=raw["backend"] != "cpu")  # torch's fastest AdamW on a GPU
        m, t = raw["model"], raw["train"]
        mbs, n_mb = t["micro_batch_size"], raw["schedule"]["microbatches"]
        tokens = torch.randint(0, m["vocab_size"], (n_mb, mbs, m["seq_len"] + 1), device=be.device())
        autocast = torch.autocast(be.device().type, dtype=torch.bfloat16, enabled=raw["backend"] != "cpu")
        times = []

        def step_once() -> None:
            for i in range(n_mb):
                with autocast:
                    # transformers shifts the labels itself: the same tokens, predicting each next one
                    loss = model(input_ids=tokens[i, :, :-1], labels=tokens[i, :, :-1]).loss / n_mb
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        order = ["grouped_mm", "batched_mm", "eager"]
        while True:  # an implementation that builds may still refuse to run (dtype, device): the next one then
            try:
                step_once()
                break
            except Exception as exc:
                later = order[order.index(impl) + 1:] if impl in order else []
                if not later or not hasattr(model, "set_experts_implementation"):
                    raise
                tried.append(f"{impl} failed at its first step ({type(exc).__name__}: {str(exc)[:120]})")
                opt.zero_grad(set_to_none=True)
                impl = later[0]
                model.set_experts_implementation(impl)
        for step in range(t["steps"]):
            with be.timed() as timer:
                step_once()
            if step >= t["warmup_steps"]:
                times.append(timer.elapsed_s)
            if time.time() > ctx.deadline - 10:
                break
        rate = n_mb * mbs * m["seq_len"] / statistics.median(times) if times else None
        return {"tokens_per_s": rate, "experts_implementation": impl, "tried": tried, "steps_timed": len(times),
                "config_experts_implementation": str(getattr(model.config, "_experts_implementation", None)),
                "transformers": __import__("transformers").__version__,
                "precision": "float32 weights and AdamW, bfloat16 autocast" if raw["backend"] != "cpu" else "float32"}
    except Exception as exc:
        return {"error": tail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), 6)}

