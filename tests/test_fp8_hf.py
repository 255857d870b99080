"""DeepSeek-V3's published FP8 weights in and out: a folder written here from a transformers model
with this test's own block quantizer loads into the logits of transformers' model of the
dequantized weights; ``export --fp8`` writes that layout, and FP8-representable weights make the
round trip bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from portapipe.config import load_config
from portapipe.models.hf import model_keys
from portapipe.models.hf_io import export_hf, init_problems

from .hf_models import logits, model_section, portapipe_blocks, tokens, transformers_model
from .test_hf_io import _from_pretrained, _state

QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
#: wider than 128 in places: several blocks, ceil-divided edges
WIDE = {"hidden": 160, "ffn_hidden": 144, "moe_hidden": 136}


def _fp8_name(name: str) -> bool:
    """The published layout's E4M3 tensors: the attention projections and every MLP projection."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and (".self_attn." in name or ".mlp." in name)


def _block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's published way, written here: per 128x128 block scale = amax / 448 (float32, not a
    power of two), values w / scale cast to E4M3."""
    r, c = w.shape
    scale = torch.empty(-(-r // 128), -(-c // 128), dtype=torch.float32)
    q = torch.empty(r, c, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            scale[i, j] = block.abs().max() / 448.0
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale[i, j]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def _block_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = q.double()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= float(scale[i, j])
    return out


def fp8_folder(path: Path) -> tuple[Path, object]:
    """A transformers DeepSeek-V3 saved in the published FP8 layout, and transformers' model of its
    dequantized weights (saved and loaded as transformers does it)."""
    src = path.parent / f"{path.name}-src"
    transformers_model("deepseek_v3", seed=3, **WIDE).save_pretrained(str(src))
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    fp8, plain = {}, {}
    for name, t in saved.items():
        if _fp8_name(name):
            q, scale = _block_quantize(t)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            plain[name] = _block_dequantize(q, scale)
        else:
            fp8[name] = plain[name] = t
    assert sum(n.endswith("_scale_inv") for n in fp8) > 20
    config = json.loads((src / "config.json").read_text())
    deq = path.parent / f"{path.name}-dequantized"
    for folder, tensors, extra in ((path, fp8, {"quantization_config": QUANT}), (deq, plain, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))
    return path, _from_pretrained(deq)


def test_a_published_fp8_folder_loads_into_the_logits_of_its_dequantized_weights(tmp_path: Path) -> None:
    folder, model = fp8_folder(tmp_path / "fp8")
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), dtype="float64", **WIDE)}).model
    assert init_problems(m) == []
    blocks = portapipe_blocks("deepseek_v3", folder, **WIDE)
    x = tokens(2, 16, seed=4)
    with torch.no_grad():
        assert float((logits(blocks, x) - model(x).logits).abs().max()) <= 1e-9


def test_a_scale_missing_or_misshapen_is_named_before_launch(tmp_path: Path) -> None:
    folder, _ = fp8_folder(tmp_path / "fp8")
    name = "model.layers.1.self_attn.q_b_proj.weight"
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors[name + "_scale_inv"] = tensors[name + "_scale_inv"][:, :0]
    del tensors["model.layers.2.mlp.experts.3.down_proj.weight_scale_inv"]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), **WIDE)}).model
    problems = init_problems(m)
    assert any("q_b_proj.weight_scale_inv is F32 [1, 0]; the E4M3 model.layers.1.self_attn.q_b_proj.weight" in p for p in problems)
    assert any("model.layers.2.mlp.experts.3.down_proj.weight is stored as F8_E4M3 without its "
               "model.layers.2.mlp.experts.3.down_proj.weight_scale_inv" in p for p in problems)


def test_a_scale_not_finite_or_not_positive_is_named_before_launch_and_when_read(tmp_path: Path) -> None:
    """A NaN, infinite, zero or negative block scale would make its weights NaN, infinite or zero
    and the run stop at its first step; it is named in one line before any rank starts, and again
    where a rank reads the tensor."""
    from portapipe.models.hf_folder import Folder

    folder, _ = fp8_folder(tmp_path / "fp8")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), **WIDE)}).model
    name = "model.layers.0.mlp.gate_proj.weight"  # [144, 160]: 2 x 2 blocks
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        scale = tensors[name + "_scale_inv"].clone()
        scale[0, 1] = bad
        save_file({**tensors, name + "_scale_inv": scale}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        line = (f"model.init_from: {folder}: {name}_scale_inv holds {bad} at block [0, 1] (1 of {scale.numel()} blocks not finite "
                "and > 0); a dequantization scale must be a finite number > 0: the folder is damaged")
        assert init_problems(m) == [line]
        with pytest.raises(ValueError) as info:
            Folder(folder).read([name])
        assert str(info.value) == line
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert init_problems(m) == []


def test_other_quantization_is_refused() -> None:
    base = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts_per_tok": 2, "n_routed_experts": 4, "kv_lora_rank": 8,
            "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4}
    assert model_keys({**base, "quantization_config": QUANT})[1] == []
    _, bad = model_keys({**base, "quantization_config": {**QUANT, "weight_block_size": [64, 64]}})
    assert len(bad) == 1 and bad[0].startswith("quantization_config = ") and "weight_block_size [128, 128]" in bad[0]


def test_export_fp8_writes_the_published_layout_and_round_trips_bit_for_bit(tmp_path: Path) -> None:
    transformers_model("deepseek_v3", seed=5, **WIDE).save_pretrained(str(tmp_path / "src"))
    m = load_config({"model": model_section("deepseek_v3", **WIDE)}).model
    first = export_hf(_state(portapipe_blocks("deepseek_v3", tmp_path / "src", **WIDE)), m, tmp_path / "fp8a", fp8=True)
    config = json.loads((first / "config.json").read_text())
    assert config["quantization_config"] == QUANT
    with safe_open(str(first / "model.safetensors"), "pt") as f:
        names = list(f.keys())
        fp8 = sorted(n for n in names if f.get_slice(n).get_dtype() == "F8_E4M3")
        assert fp8 and fp8 == sorted(n for n in names if _fp8_name(n))  # exactly the published layout's
        assert all(n + "_scale_inv" in names for n in fp8)
        q = f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight")  # [136, 160]: 2 x 2 blocks
        assert q.get_shape() == [136, 160] and f.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv").get_shape() == [2, 2]
        for kept in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight", "model.norm.weight"):
            assert f.get_slice(kept).get_dtype() != "F8_E4M3"
    # what came back is FP8-representable: exported again and read again, the same bits
    again = _state(portapipe_blocks("deepseek_v3", first, **WIDE))
    second = export_hf(again, m, tmp_path / "fp8b", fp8=True)
    third = _state(portapipe_blocks("deepseek_v3", second, **WIDE))
    assert again.keys() == third.keys() and all(torch.equal(again[k], third[k]) for k in again)
    # the files hold the same values (a block whose largest E4M3 value was 224 or less may come
    # back as twice the values at half the scale: other bytes, the same numbers)
    with safe_open(str(first / "model.safetensors"), "pt") as a, safe_open(str(second / "model.safetensors"), "pt") as b:
        for n in fp8:
            s = n + "_scale_inv"
            assert torch.equal(_block_dequantize(a.get_tensor(n), a.get_tensor(s)), _block_dequantize(b.get_tensor(n), b.get_tensor(s))), n


@pytest.mark.parametrize("fp8", [False, True])
def test_export_command_fp8_flag(fp8: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portapipe import cli

    cfg = {"model": model_section("deepseek_v3", **{**WIDE, "vocab_size": 256}), "train": {"steps": 1, "micro_batch_size": 1},
           "schedule": {"name": "1f1b", "microbatches": 1}, "backend": "cpu",
           "log": {"dir": str(tmp_path / "run"), "progress": False}}
    (tmp_path / "c.yaml").write_text(json.dumps(cfg))
    assert cli.main(["train", str(tmp_path / "c.yaml")]) == 0
    capsys.readouterr()
    args = ["export", str(tmp_path / "run"), str(tmp_path / "out")] + (["--fp8"] if fp8 else [])
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["fp8"] is fp8
    assert ("quantization_config" in json.loads((tmp_path / "out" / "config.json").read_text())) is fp8
