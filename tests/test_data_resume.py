"""A step's batch is a function of (seed, sources, global batch, step): 40 steps straight on one
layout, against 20 steps then a resume to 40 on another, see the same samples and the same
losses, with a blend, epochs, document masking and a prediction module on (float64, 2 gloo ranks)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portapipe.config import load_config

from .test_data_epochs import random_docs, write_dataset

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64", "vocab_size": 100, "mtp_layers": 1}
LAYOUTS = {  # both a global batch of 8 sequences
    "A": {"parallel": {"pp": 2, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 4}, "train": {"micro_batch_size": 2}},
    # micro-batches of 4 samples, not 2: data.mask_eos_loss's mean is the global batch's, however it is cut
    "B": {"parallel": {"pp": 1, "ep": 2, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 1}, "train": {"micro_batch_size": 4}},
}


def config(root: Path, layout: str, log: str, steps: int) -> dict[str, Any]:
    sources = [{"path": str(root / "a"), "weight": 2}, {"path": str(root / "b"), "weight": 1}]
    lay = LAYOUTS[layout]
    return load_config({
        "backend": "cpu", "model": MODEL, "parallel": lay["parallel"], "schedule": lay["schedule"],
        "train": {"steps": steps, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, **lay["train"]},
        "data": {"format": "tokens", "sources": sources, "document_mask": True, "mask_eos_loss": True},
        "log": {"dir": str(root / log), "progress": False}, "checkpoint": {"every": 20, "keep": 5},
    }).to_dict()


def _rows(log_dir: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def _runs(backend: Any, root: str) -> dict[str, Any]:
    from portapipe.train import train_rank

    base = Path(root)
    out: dict[str, Any] = {}
    for layout, log, steps in (("A", "straight", 40), ("A", "resumed", 20), ("B", "resumed", 40)):
        fresh = type(backend)(backend.options)
        summary = train_rank(fresh, config(base, layout, log, steps))
        if fresh.parallel_groups(*(LAYOUTS[layout]["parallel"][k] for k in ("pp", "dp", "ep"))).rank == 0:
            out[f"{log}{steps}"] = summary
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("resume")
    write_dataset(root / "a", random_docs(11, 200))
    write_dataset(root / "b", random_docs(12, 40))  # a small source: several epochs in 40 steps
    out = run_ranks(_runs, 2, str(root), wall_timeout_s=900)[0]
    out["root"] = root
    return out


@pytest.mark.multiproc
def test_a_resume_on_another_layout_sees_the_same_samples_and_losses(runs: dict[str, Any]) -> None:
    root = runs["root"]
    straight, resumed = _rows(root / "straight"), _rows(root / "resumed")
    assert runs["resumed40"]["resumed_from"] == 20 and sorted(resumed) == sorted(straight) == list(range(1, 41))
    for step in range(21, 41):
        a, b = straight[step], resumed[step]
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(a["loss"]), step
        assert (a["tokens_consumed"], a["epochs"]) == (b["tokens_consumed"], b["epochs"]) == (step * 8 * 16, b["epochs"])
    # the small source went through more than one epoch, in proportion to its weight
    assert straight[40]["epochs"]["b"] > 1.0 and runs["straight40"]["val_loss_by_source"].keys() == {"a", "b"}


@pytest.mark.multiproc
def test_the_checkpoint_records_its_sources(runs: dict[str, Any]) -> None:
    manifest = json.loads((runs["root"] / "straight" / "checkpoints" / "step_00000040" / "manifest.json").read_text())
    data = manifest["trainer"]["data"]
    assert [(Path(s["path"]).name, s["kind"], round(s["weight"], 6)) for s in data["sources"]] == [("a", "dataset", 0.666667), ("b", "dataset", 0.333333)]
    assert data["sampling"] == "epochs" and data["global_batch"] == 8
