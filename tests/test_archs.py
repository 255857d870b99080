"""deepseek_v3 and qwen3_moe equal transformers' DeepseekV3ForCausalLM / Qwen3MoeForCausalLM.

Tiny random models built locally (no hub): transformers makes and saves them, portapipe loads
the folder (``model.init_from``). In float64 the single-process logits agree to 1e-9 (in fact
to the last bit here) and so do the loss's gradients; the pipelined loss on pp 2 x ep 2 (every
schedule family, the balancers, the memory options) equals transformers' loss, and
``portapipe verify`` is exact for each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from portapipe.config import Config, load_config
from portapipe.models.hf import source
from portapipe.scheduling.executor import mean_loss
from portapipe.verify import verify_many
from portapipe.verify.pipelined import microbatches
from portapipe.verify.tolerance import float64

from .hf_models import VARIANTS, logits, model_section, portapipe_blocks, save, tokens, transformers_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    """variant -> (transformers model in float64, its saved folder); one variant saved in shards."""
    out = {}
    for i, variant in enumerate(VARIANTS):
        model = transformers_model(variant, seed=i)
        path = tmp_path_factory.mktemp(variant)
        out[variant] = (model, save(model, path, max_shard_size="40KB") if variant == "qwen3_moe" else save(model, path))
    return out


def _hf_grads(model: Any, ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gradients under our logical names (its experts are fused [E, out, in] in memory)."""
    params = dict(model.named_parameters())
    out = {}
    for name in ours:
        if ".moe.experts." in name:
            layer, leaf = name.split(".")[1], name.rsplit(".", 1)[1]
            out[name] = params[f"model.layers.{layer}.mlp.experts.{leaf}_proj"].grad.transpose(1, 2)
        else:
            out[name] = torch.cat([params[n].grad for n in source(name).names], dim=0)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_forward_and_gradients_equal_transformers_in_float64(variant: str, folders: dict[str, tuple[Any, Path]]) -> None:
    model, folder = folders[variant]
    blocks = portapipe_blocks(variant, folder)
    seq = VARIANTS[variant]["seq_len"]
    t = tokens(3, seq + 1, seed=7)
    x, y = t[:, :-1], t[:, 1:]
    model.zero_grad()
    ref = model(x).logits
    got = logits(blocks, x)
    assert float((got - ref).detach().abs().max()) <= 1e-9
    assert float(ref.detach().abs().max()) > 0.1  # the comparison is not of near-zero logits
    F.cross_entropy(ref.reshape(-1, 64), y.reshape(-1)).backward()
    F.cross_entropy(got.reshape(-1, 64), y.reshape(-1)).backward()
    ours = {n: p.grad for b in blocks for n, p in b.named_parameters()}
    theirs = _hf_grads(model, ours)
    worst = max(float((ours[n] - theirs[n]).norm() / theirs[n].norm()) for n in ours)
    assert worst <= 1e-12, worst


def test_the_comparison_sees_rope_layout_routing_and_expert_weights(folders: dict[str, tuple[Any, Path]]) -> None:
    """What the equality rests on: change the RoPE layout, the weights' normalisation or one
    expert's weights and the logits move well past the tolerance."""
    model, folder = folders["deepseek_v3"]
    x = tokens(2, 16, seed=8)
    with torch.no_grad():
        ref = model(x).logits
        assert float((logits(portapipe_blocks("deepseek_v3", folder, rope_interleave=False), x) - ref).abs().max()) > 1e-4
        assert float((logits(portapipe_blocks("deepseek_v3", folder, norm_topk_prob=False), x) - ref).abs().max()) > 1e-4
        blocks = portapipe_blocks("deepseek_v3", folder)
        blocks[1].layers["3"].moe.experts.down[5].add_(0.01)
        assert float((logits(blocks, x) - ref).abs().max()) > 1e-6


def test_float32_models_use_fused_attention_and_agree_to_float32_rounding(tmp_path: Path) -> None:
    model = transformers_model("qwen3_moe", dtype=torch.float32)
    folder = save(model, tmp_path / "q")
    x = tokens(2, 16, seed=9)
    with torch.no_grad():
        got = logits(portapipe_blocks("qwen3_moe", folder, dtype="float32"), x)
        ref = model(x).logits
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


# -------------------------------------------------------------------------------- pipelined
def _config(variant: str, folder: Path, name: str, overlap: bool = True, **sections: Any) -> Config:
    raw: dict[str, Any] = {
        "backend": "cpu",
        "parallel": {"pp": 2, "ep": 2},
        "schedule": {"name": name, "microbatches": 4, "overlap": overlap},
        "model": model_section(variant, init_from=str(folder)),
        "train": {"micro_batch_size": 2, "seed": 3},
    }
    for key, value in sections.items():
        raw[key] = value
    return load_config(raw)


def _transformers_loss(model: Any, config: Config) -> float:
    c = float64(config)
    rows = []
    with torch.no_grad():
        for r in range(c.parallel.dp * c.parallel.ep):
            rows.append([float(F.cross_entropy(model(x).logits.reshape(-1, 64), y.reshape(-1))) for x, y in microbatches(c, r)])
    return mean_loss(rows)


@pytest.mark.multiproc
def test_pipelined_loss_equals_transformers_and_verify_is_exact(folders: dict[str, tuple[Any, Path]]) -> None:
    """pp 2 x ep 2: DualPipeV and interleaved 1F1B for both architectures (the acceptance
    cases), then 1F1B, ZB1P and DualPipe with EPLB / LPLB and the memory options."""
    ds, qw = folders["deepseek_v3"], folders["qwen3_moe"]
    cases = [
        (ds, _config("deepseek_v3", ds[1], "dualpipev")),
        (ds, _config("deepseek_v3", ds[1], "interleaved")),
        (qw, _config("qwen3_moe", qw[1], "dualpipev")),
        (qw, _config("qwen3_moe", qw[1], "interleaved")),
        (ds, _config("deepseek_v3", ds[1], "1f1b", memory={"zero_memory": "level1"}, balancer={"kind": "eplb", "redundant": 1})),
        (qw, _config("qwen3_moe", qw[1], "zb1p", memory={"recompute": "moe"}, balancer={"kind": "lplb", "redundant": 1})),
        (ds, _config("deepseek_v3", ds[1], "dualpipe", memory={"recompute": "full"}, overlap=False)),
        (ds, _config("deepseek_v3", ds[1], "dualpipe", memory={"recompute": ["norms", "moe"]})),
        (ds, _config("deepseek_v3", ds[1], "interleaved", memory={"recompute": "norms", "zero_memory": "level0"})),
        (qw, _config("qwen3_moe", qw[1], "dualpipev", memory={"recompute": "norms"})),
    ]
    reports = verify_many([c for _, c in cases])
    for (hf, config), report in zip(cases, reports):
        label = (config.model.arch, config.schedule.name)
        assert report.ok and report.loss_diff == 0.0 and report.max_rel_grad_diff <= 1e-12, (label, report.summary(), report.worst_param)
        assert abs(report.loss - _transformers_loss(hf[0], config)) <= 1e-9, label


# ----------------------------------------------------------------------------------- config
def _problems(**model: Any) -> list[str]:
    from portapipe.config import ConfigError

    try:
        load_config({"model": model})
    except ConfigError as err:
        return err.problems
    return []


def test_each_architecture_fills_its_own_keys_and_refuses_the_others() -> None:
    q = load_config({"model": {"arch": "qwen3_moe", "hidden": 48, "n_heads": 6}}).model
    assert (q.n_shared, q.n_kv_heads, q.head_dim, q.norm_topk_prob, q.kv_lora_rank) == (0, 6, 8, False, None)
    d = load_config({"model": {"arch": "deepseek_v3"}}).model
    assert (d.q_lora_rank, d.kv_lora_rank, d.qk_rope_head_dim, d.rope_interleave, d.norm_topk_prob, d.n_kv_heads) == (0, 32, 8, True, True, None)
    p = load_config({}).model
    assert p.arch == "portapipe" and p.rope_theta is None and p.n_shared == 1
    assert _problems(arch="qwen3_moe", kv_lora_rank=8) == ["model.kv_lora_rank: 8 applies to model.arch deepseek_v3 only (model.arch is qwen3_moe)"]
    assert _problems(head_dim=8) == ["model.head_dim: 8 applies to model.arch qwen3_moe only (model.arch is portapipe)"]
    assert _problems(rope_theta=1e6)[0].startswith("model.rope_theta: 1000000.0 applies to model.arch deepseek_v3 / qwen3_moe only")
    assert _problems(arch="llama")[0].startswith("model.arch: 'llama': Input should be 'portapipe', 'deepseek_v3' or 'qwen3_moe'")


def test_architecture_rules_name_the_key_and_the_fix() -> None:
    assert "model.n_shared: 1; qwen3_moe has no shared expert (set 0)" in _problems(arch="qwen3_moe", n_shared=1)
    assert any(p.startswith("model.n_kv_heads: 3 does not divide model.n_heads = 4") for p in _problems(arch="qwen3_moe", n_kv_heads=3))
    assert any(p.startswith("model.head_dim: not set") for p in _problems(arch="qwen3_moe", hidden=66))
    assert any(p.startswith("model.n_groups: 2 / topk_groups: 1; qwen3_moe") for p in _problems(arch="qwen3_moe", n_groups=2))
    assert any(p.startswith("model.qk_rope_head_dim: 7 is odd") for p in _problems(arch="deepseek_v3", qk_rope_head_dim=7))
    assert any("scores a group by its top 2 experts" in p for p in _problems(arch="deepseek_v3", n_groups=8))
    assert any(p.startswith("model.rope_scaling: type 'linear' is not supported") for p in _problems(arch="qwen3_moe", rope_scaling={"type": "linear", "factor": 2.0}))
    yarn = _problems(arch="deepseek_v3", rope_scaling={"type": "yarn", "factr": 4})
    assert any("unknown key(s) factr" in p for p in yarn) and any(p.startswith("model.rope_scaling.factor: None") for p in yarn)
    assert any(p.startswith("model.init_from: loads Hugging Face weights") for p in _problems(init_from="/tmp"))
    assert _problems(arch="deepseek_v3", hidden=66) == []  # latent attention has its own head widths
