"""Weights two model blocks share: one logical weight with a copy in each, gradients summed.

A head tied to the embedding (``model.tie_word_embeddings``) puts a copy of the embedding in the
last block. Its gradient is summed over every copy on every rank, the mechanism DualPipe's two
copies of a block use, so:

- ``portapipe verify`` is exact in every schedule (DualPipe and DualPipeV hold the first and the
  last block on the same ranks: there the embedding is one tensor, one per rank);
- the copies start equal, stay equal through training steps (AdamW included), are counted once in
  the gradient norm, and a copy that differs is refused by name;
- Hugging Face folders with ``tie_word_embeddings: true`` load (logits equal transformers') and
  export with the key kept and no head of their own; a folder whose saved head is not its
  embedding is refused before launch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from portapipe.config import load_config
from portapipe.ranks.launch import run_ranks
from portapipe.models.hf_io import export_hf, init_problems
from portapipe.scheduling.stage import logical_state
from portapipe.verify import verify_many
from portapipe.verify.pipelined import microbatches
from portapipe.verify.reference import reference

from .hf_models import logits, model_section, portapipe_blocks, save, tokens, transformers_model
from .test_objective import check_exact, verify_config

SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")
TIED = {"tie_word_embeddings": True}


@pytest.mark.multiproc
def test_a_tied_head_is_exact_in_every_schedule() -> None:
    configs = [verify_config(name, alpha=0.01, model=TIED) for name in SCHEDULES]
    configs.append(verify_config("interleaved", pp=2, ep=1, alpha=0.01, model=TIED, memory={"recompute": "full"}))
    check_exact(verify_many(configs))


def _train_steps(backend: Any, raw: dict[str, Any], steps: int) -> dict[str, Any]:
    """A few optimizer steps on the verify data; then the copies' check, before and after one copy moves."""
    from portapipe.compose import PipelineRuntime
    from portapipe.config import config_from_dict
    from portapipe.training.update import counted_blocks, make_sharded_optimizer

    config = config_from_dict(raw)
    groups = backend.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
    rt = PipelineRuntime(config, backend, groups)
    opt = make_sharded_optimizer(rt, config, backend)
    opt.lr = 1e-2
    data = microbatches(config, 0)
    first_norm = None
    for _ in range(steps):
        rt.step(data)
        sq = torch.tensor([float(opt.local_sq_norm(counted_blocks(rt.schedule, groups.pp_rank)))], dtype=torch.float64)
        backend.all_reduce(sq)
        first_norm = float(sq.sqrt()) if first_norm is None else first_norm
        with torch.no_grad():
            opt.step(1.0)
        rt.grads.zero_grad()
    rt.check_copies()
    embeds = [p for n, p in rt.named_parameters() if n == "embed.weight"]
    copies = [p.detach().clone() for p in {id(p): p for p in embeds}.values()]
    laid_out = sum(p.numel() for bucket in rt.grads.buckets for p in bucket.params)
    unique = sum(p.numel() for p in {id(p): p for p in rt.parameters()}.values())
    with torch.no_grad():
        for b, block in rt.blocks.items():
            if block.is_last and block.embed is not None:
                block.embed.weight[0, 0] += 1.0
    try:
        rt.check_copies()
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    return {"norm": first_norm, "copies": copies, "refused": refused, "blocks_holding": len(embeds), "laid_out": laid_out, "unique": unique}


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["1f1b", "dualpipe"])
def test_copies_stay_equal_count_once_in_the_norm_and_a_differing_one_is_refused(name: str) -> None:
    config = verify_config(name, alpha=0.0, model={**TIED, "dtype": "float64"})
    results = run_ranks(_train_steps, 2, config.to_dict(), 3, backend="cpu")
    _, grads, _ = reference(config)
    want = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
    assert results[0]["norm"] == pytest.approx(want, rel=1e-12)
    copies = [t for r in results for t in r["copies"]]
    assert len(copies) == 2  # one tensor per rank: DualPipe's two blocks of a rank hold one embedding
    assert [r["blocks_holding"] for r in results] == ([2, 2] if name == "dualpipe" else [1, 1])
    assert all(r["laid_out"] == r["unique"] for r in results)  # its gradient is laid out once per rank
    assert all(torch.equal(copies[0], t) for t in copies[1:])
    for r in results:  # copies on two blocks of different ranks are compared; DualPipe's one tensor per rank has none
        assert ("the copies of embed.weight held by (pipeline rank, block)" in r["refused"]) == (name == "1f1b"), r["refused"]


# ----------------------------------------------------------------------------- Hugging Face
def test_a_tied_hugging_face_folder_loads_and_exports_tied(tmp_path: Path) -> None:
    original = transformers_model("qwen3_moe", seed=21)
    original.config.tie_word_embeddings = True
    original.tie_weights()
    folder = save(original, tmp_path / "in")
    assert json.loads((folder / "config.json").read_text())["tie_word_embeddings"] is True
    blocks = portapipe_blocks("qwen3_moe", folder, tie_word_embeddings=True)
    assert blocks[-1].head is None and blocks[-1].embed is not None
    x = tokens(2, 16, seed=22)
    with torch.no_grad():
        assert float((logits(blocks, x) - original(x).logits).abs().max()) <= 1e-9
    m = load_config({"model": model_section("qwen3_moe", **TIED)}).model
    state = logical_state([(n, t) for b in blocks for n, t in b.state_dict(keep_vars=True).items()])
    out = export_hf(state, m, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    written = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in written
    saved = {**load_file(str(folder / "model.safetensors"))}
    assert all(torch.equal(written[k], saved[k]) for k in written)


def test_a_folder_whose_saved_head_is_not_its_embedding_is_refused(tmp_path: Path) -> None:
    original = transformers_model("qwen3_moe", seed=23)
    folder = save(original, tmp_path / "in")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    m = load_config({"model": model_section("qwen3_moe", init_from=str(folder), **TIED)}).model
    (line,) = init_problems(m)
    assert "lm_head.weight differs from model.embed_tokens.weight" in line
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert init_problems(m) == []
    # the untied model reads the same folder's key and says so
    untied = load_config({"model": model_section("qwen3_moe", init_from=str(folder))}).model
    assert any(line.startswith("model.tie_word_embeddings: False, but ") for line in init_problems(untied))
