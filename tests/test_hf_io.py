"""Hugging Face folders in and out: model.init_from, export, and the errors before launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from portapipe import checkpoint, cli
from portapipe.backends.cpu import CPUBackend
from portapipe.config import load_config
from portapipe.models import hf_folder
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.hf_io import export_hf, init_problems
from portapipe.models.moe import build_blocks
from portapipe.scheduling.stage import logical_state

from .hf_models import logits, model_section, portapipe_blocks, save, tokens, transformers_model


def _state(blocks: list[Any]) -> dict[str, torch.Tensor]:
    return logical_state([(n, t) for b in blocks for n, t in b.state_dict(keep_vars=True).items()])


def _from_pretrained(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float64, attn_implementation="eager", experts_implementation="eager")


@pytest.mark.parametrize("variant, shard", [("deepseek_v3", 4096), ("qwen3_moe", None)])
def test_round_trip_hf_folder_to_portapipe_to_export_to_transformers_same_logits(variant: str, shard: int | None, tmp_path: Path) -> None:
    original = transformers_model(variant, seed=11)
    folder = save(original, tmp_path / "in", max_shard_size="30KB")  # sharded, with an index
    blocks = portapipe_blocks(variant, folder)
    state = _state(blocks)
    m = load_config({"model": model_section(variant)}).model
    out = export_hf(state, m, tmp_path / "out", **({"max_shard_bytes": shard} if shard else {}))
    files = sorted(p.name for p in out.iterdir())
    if shard:
        assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) > 2
    else:
        assert files == ["config.json", "model.safetensors"]
    again = _from_pretrained(out)
    x = tokens(2, 16, seed=12)
    with torch.no_grad():
        want = original(x).logits
        assert float((again(x).logits - want).abs().max()) <= 1e-9
        assert float((logits(blocks, x) - want).abs().max()) <= 1e-9
    if variant == "deepseek_v3":  # the router's correction bias made the trip too
        bias = dict(again.named_buffers())["model.layers.2.mlp.gate.e_score_correction_bias"]
        # exported as read (float64); transformers holds it in float32 whatever the model's dtype
        assert torch.equal(bias, state["layers.2.moe.router.bias"].to(bias.dtype)) and bool(bias.abs().sum() > 0)


def test_a_rank_reads_only_the_tensors_it_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = save(transformers_model("deepseek_v3", seed=12), tmp_path / "in")
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), dtype="float64")}).model
    whole = _state(portapipe_blocks("deepseek_v3", folder, n_blocks=1))
    asked: list[str] = []
    real = hf_folder.Folder.read

    def spy(self: Any, names: Any) -> Any:
        names = list(names)
        asked.extend(names)
        return real(self, names)

    monkeypatch.setattr(hf_folder.Folder, "read", spy)
    # block 1 of 2 (layers 2 and 3, the head) on EP rank 1 of 2 (experts 4..7)
    blocks = build_blocks(m, [1], 2, ExpertParallel(CPUBackend(), 2, 1), seed=0)
    assert all(n.startswith(("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head.")) for n in asked)
    experts = {int(n.split(".")[5]) for n in asked if ".mlp.experts." in n}
    assert experts == {4, 5, 6, 7}
    assert not any("embed_tokens" in n or "layers.0." in n for n in asked)
    mine = _state(list(blocks.values()))
    assert mine.keys() < whole.keys() and all(torch.equal(mine[k], whole[k]) for k in mine)


# ----------------------------------------------------------------------------------- errors
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(transformers_model("qwen3_moe", seed=13), tmp_path_factory.mktemp("q"))


def _problems(path: Path, **model: Any) -> list[str]:
    return init_problems(load_config({"model": model_section("qwen3_moe", init_from=str(path), **model)}).model)


def _copy(src: Path, dst: Path, edit_config: Any = None, edit_tensors: Any = None) -> Path:
    shutil.copytree(src, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_folder_that_fits_has_no_problems(folder: Path) -> None:
    assert _problems(folder) == []


def test_config_mismatches_name_the_model_key_and_the_hf_value(folder: Path, tmp_path: Path) -> None:
    lines = _problems(folder, hidden=48, top_k=3)
    assert any(line.startswith("model.hidden: 48, but ") and "says 32" in line for line in lines)
    assert any(line.startswith("model.top_k: 3, but ") for line in lines)
    lines = _problems(folder, arch="deepseek_v3", n_kv_heads=None, head_dim=None, n_shared=0)
    assert any(line.startswith("model.arch: 'deepseek_v3', but ") for line in lines)

    def unsupported(cfg: dict[str, Any]) -> None:
        cfg.update(use_sliding_window=True, quantization_config={"quant_method": "fp8"})
        cfg["mlp_only_layers"] = [2]

    lines = _problems(_copy(folder, tmp_path / "bad", edit_config=unsupported))
    text = "\n".join(lines)
    for what in ("use_sliding_window", "quantization_config", "mlp_only_layers = [2]"):
        assert what in text, (what, text)
    assert all(line.startswith("model.") for line in lines)


def test_missing_extra_and_misshapen_tensors_are_named(folder: Path, tmp_path: Path) -> None:
    def edit(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.2.mlp.experts.3.up_proj.weight"]
        t["model.layers.1.mlp.experts.9.up_proj.weight"] = torch.zeros(16, 32)
        t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(9)

    text = "\n".join(_problems(_copy(folder, tmp_path / "bad", edit_tensors=edit)))
    assert "lacks 1 tensor(s)" in text and "model.layers.2.mlp.experts.3.up_proj.weight" in text
    assert "no place for" in text and "experts.9.up_proj" in text
    assert "model.layers.0.self_attn.q_norm.weight has shape [9], the model needs [8]" in text


def test_a_missing_or_damaged_shard_and_an_unreadable_dtype_are_named(tmp_path: Path) -> None:
    sharded = save(transformers_model("qwen3_moe", seed=14), tmp_path / "sharded", max_shard_size="40KB")
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    gone = _copy(sharded, tmp_path / "gone")
    (gone / shards[2]).unlink()
    assert _problems(gone) == [f"model.init_from: {gone / 'model.safetensors.index.json'} names file(s) that are not there: {shards[2]}"]
    cut = _copy(sharded, tmp_path / "cut")
    with open(cut / shards[1], "r+b") as f:  # a download that stopped early
        f.truncate(f.seek(0, 2) // 2)
    (line,) = _problems(cut)
    assert line.startswith(f"model.init_from: {cut / shards[1]} is not a readable safetensors file"), line

    def as_dtype(dtype: torch.dtype) -> Any:
        def edit(t: dict[str, torch.Tensor]) -> None:
            t["model.layers.1.mlp.experts.0.up_proj.weight"] = t["model.layers.1.mlp.experts.0.up_proj.weight"].to(dtype)
        return edit

    folder = save(transformers_model("qwen3_moe", seed=14), tmp_path / "whole")
    assert _problems(_copy(folder, tmp_path / "int8", edit_tensors=as_dtype(torch.int8))) == [
        "model.init_from: model.layers.1.mlp.experts.0.up_proj.weight is stored as I8; portapipe reads F64, F32, BF16, F16, F8_E4M3"
    ]
    # E4M3 is read with its block scales (DeepSeek-V3's published layout, tests/test_fp8_hf.py): without them, named
    fp8 = _copy(folder, tmp_path / "fp8", edit_tensors=as_dtype(torch.float8_e4m3fn))
    assert _problems(fp8) == [
        f"model.init_from: {fp8}: model.layers.1.mlp.experts.0.up_proj.weight is stored as F8_E4M3 without its "
        "model.layers.1.mlp.experts.0.up_proj.weight_scale_inv (one float32 scale per 128x128 block)"
    ]


def test_multi_token_prediction_layers_and_stored_rope_tables_are_ignored(tmp_path: Path) -> None:
    """DeepSeek-V3's published folders hold an MTP layer past num_hidden_layers (not part of
    transformers' model) and some folders store RoPE frequencies: loading skips them."""
    original = transformers_model("deepseek_v3", seed=15)
    folder = save(original, tmp_path / "ds")

    def mtp(cfg: dict[str, Any]) -> None:
        cfg["num_nextn_predict_layers"] = 1

    def extra(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.4.eh_proj.weight"] = torch.zeros(32, 64, dtype=torch.float64)
        t["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"] = torch.zeros(24, 32, dtype=torch.float64)
        t["model.layers.1.self_attn.rotary_emb.inv_freq"] = torch.ones(4, dtype=torch.float64)

    published = _copy(folder, tmp_path / "published", edit_config=mtp, edit_tensors=extra)
    m = load_config({"model": model_section("deepseek_v3", init_from=str(published))}).model
    assert init_problems(m) == []
    x = tokens(2, 16, seed=16)
    with torch.no_grad():
        assert float((logits(portapipe_blocks("deepseek_v3", published), x) - original(x).logits).abs().max()) <= 1e-9


def test_a_folder_that_is_not_a_model_is_refused(tmp_path: Path) -> None:
    assert _problems(tmp_path / "nowhere")[0].startswith("model.init_from: ") and "is not a folder" in _problems(tmp_path / "nowhere")[0]
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in _problems(tmp_path / "empty")[0]


def test_verify_with_a_mismatched_folder_exits_2_before_any_rank_starts(folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw = {"backend": "cpu", "parallel": {"pp": 2}, "model": model_section("qwen3_moe", init_from=str(folder), n_experts=4)}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["verify", str(path)]) == 2
    err = capsys.readouterr().err
    assert "portapipe: config error: model.n_experts: 4, but " in err and "Traceback" not in err


def test_export_refuses_a_wrong_state_or_a_used_folder_and_writes_nothing(tmp_path: Path) -> None:
    blocks = portapipe_blocks("qwen3_moe", save(transformers_model("qwen3_moe"), tmp_path / "in"))
    state = _state(blocks)
    m = load_config({"model": model_section("qwen3_moe")}).model
    bad = dict(state)
    del bad["layers.1.moe.experts.2.down"]
    bad["layers.9.norm1.weight"] = torch.ones(32)
    with pytest.raises(ValueError, match=r"1 missing \(first: layers.1.moe.experts.2.down\); 1 unexpected"):
        export_hf(bad, m, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        export_hf(state, m, tmp_path / "used")
    export_hf(state, m, tmp_path / "out")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):  # a second export to the same folder
        export_hf(state, m, tmp_path / "out")
    with pytest.raises(ValueError, match="has no Hugging Face form"):
        export_hf(state, load_config({}).model, tmp_path / "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out", "used"]  # no temporary folder left


def test_export_command_rejects_a_missing_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "out"), "--format", "hf"]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["export", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "lots"])
    assert exc.value.code == 2


@pytest.mark.multiproc
def test_export_command_writes_a_trained_checkpoint_that_transformers_loads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from portapipe.train import train

    raw = {
        "backend": "cpu",
        "parallel": {"pp": 2, "ep": 1},
        "schedule": {"name": "1f1b", "microbatches": 2},
        "model": model_section("deepseek_v3", vocab_size=256, seq_len=16),
        "train": {"steps": 2, "micro_batch_size": 2},
        "log": {"dir": str(tmp_path / "run"), "progress": False},
    }
    summary = train(load_config(raw))
    assert cli.main(["export", summary["checkpoint"], str(tmp_path / "hf"), "--format", "hf"]) == 0
    assert json.loads(capsys.readouterr().out)["arch"] == "deepseek_v3"
    assert cli.main(["export", str(tmp_path / "run"), str(tmp_path / "from-run")]) == 0  # the run folder: its newest checkpoint
    assert (tmp_path / "from-run" / "model.safetensors").read_bytes() == (tmp_path / "hf" / "model.safetensors").read_bytes()
    state, _ = checkpoint.load_model_state(Path(summary["checkpoint"]))
    again = _from_pretrained(tmp_path / "hf")
    blocks = portapipe_blocks("deepseek_v3", tmp_path / "hf", vocab_size=256, seq_len=16)
    assert _state(blocks).keys() == state.keys() and all(torch.equal(_state(blocks)[k].double(), state[k].double()) for k in state)
    x = tokens(2, 16, seed=3, vocab=256)
    with torch.no_grad():
        assert float((again(x).logits - logits(blocks, x)).abs().max()) <= 1e-9
