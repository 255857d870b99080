"""float16 runs attacked: master weights that cannot hold AdamW's state, steps that overflow for
good, and a resume across the loss scale and the master weights.

The float16 run below (pp 2, lr 1e-2, 12 steps) overflows at step 7 at the initial scale 2^16:
that step is skipped, and steps 8-12 apply at 2^15, so its checkpoint at step 8 holds an
``overflow`` row before it, float32 master weights finer than the float16 parameters and a loss
scale that changed between applied steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.cli import main
from portapipe.config import ConfigError, load_config
from tests.test_checkpoint_run import no_ranks, write_config  # noqa: F401  (a fixture)
from tests.test_checkpoint_tried import copy_run, losses, retarget, step_dir, train

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}


def raw(log_dir: Path, steps: int, **train_keys: Any) -> dict[str, Any]:
    return {
        "backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
        "model": {**MODEL, "dtype": "float16"},
        "train": {"steps": steps, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 0, **train_keys},
        "data": {"val_fraction": 0.05}, "log": {"dir": str(log_dir), "progress": False}, "checkpoint": {"every": 4, "keep": 3},
    }


def rows(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in metrics.jsonl")) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def manifest(d: Path) -> dict[str, Any]:
    return json.loads((d / "manifest.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in {d}/manifest.json"))


def masters(d: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's master weights (float32 beside the float16 parameters)."""
    from portapipe.checkpoint.files import load_no_dist, read_dcp_metadata

    meta = read_dcp_metadata(d)
    state = {"master": {k[len("master."):]: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in meta.items() if k.startswith("master.")}}
    load_no_dist(d, state)
    return state["master"]


# ------------------------------------------------------------------------ float16 master weights
def test_float16_master_weights_are_refused_in_one_line_before_any_rank_starts(tmp_path, capsys, no_ranks):  # noqa: F811
    """AdamW's eps (1e-8) and its squared gradients round to zero in float16: the update would be nan."""
    want = "train.master_dtype: float16 cannot hold AdamW's state"
    with pytest.raises(ConfigError, match=want):
        load_config({"model": {"dtype": "float16"}, "train": {"master_dtype": "float16"}})
    config = raw(tmp_path, 1, master_dtype="float16")
    assert main(["train", write_config(tmp_path / "c.json", config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and want in err[0] and "use auto (float32 under float16), float32 or float64" in err[0], err
    load_config({"model": {"dtype": "bfloat16"}, "train": {"master_dtype": "bfloat16"}})  # bfloat16 holds eps: allowed


# -------------------------------------------------------------------------- steps that overflow
@pytest.mark.multiproc
def test_steps_that_overflow_for_good_stop_as_divergence_and_their_losses_reach_no_manifest(tmp_path, capsys):
    """lr 1000 without clipping: step 1 applies, then every forward overflows. After
    train.max_skipped_steps (3) skipped steps in a row the run stops, exit 3, one line; the
    checkpoints written while it skipped are strict JSON and hold only the applied step's loss."""
    config = raw(tmp_path / "run", 10, lr=1000.0, min_lr=0.0, grad_clip=0.0, max_skipped_steps=3)
    config["checkpoint"] = {"every": 1, "keep": 10}
    code, lines, summary = train(capsys, config)
    assert code == 3 and summary is not None, lines
    assert lines[-1] == (
        "portapipe: training stopped at step 4: 3 steps in a row overflowed in float16 (train.max_skipped_steps 3), the last at loss "
        f"scale 16384; none of them was applied (last checkpoint: {step_dir(tmp_path / 'run', 3)}); lower train.lr or turn train.grad_clip on (it is 0: off)"
    )
    got = rows(tmp_path / "run")
    assert [(r["kind"], r["step"]) for r in got if r["kind"] in ("train", "overflow", "diverged")] == [
        ("train", 1), ("overflow", 2), ("overflow", 3), ("overflow", 4), ("diverged", 4)]
    first = got[1]["loss"]
    assert summary["overflows"] == 3 and summary["first_loss"] == summary["final_loss"] == first and summary["val_loss"] is None
    for step in (1, 2, 3):
        progress = manifest(step_dir(tmp_path / "run", step))["trainer"]["progress"]
        assert progress["step"] == step and progress["losses"] == [first] and progress["first_loss"] == first
    assert not step_dir(tmp_path / "run", 4).exists()


# -------------------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fp16")
    config = raw(root / "run", 12)
    assert main(["train", write_config(root / "run.json", config)]) == 0
    got = rows(root / "run")
    assert [r["step"] for r in got if r["kind"] == "overflow" and r["step"] <= 8] == [7], got  # what the tests below rely on
    return {"config": config, "dir": root / "run", "rows": got}


@pytest.mark.multiproc
def test_a_resumed_float16_run_keeps_every_row_and_its_float32_master_weights(fp16_run, tmp_path, capsys):
    """Resumed from step 8: the metrics file keeps every row up to it (the memory row and the
    overflow of step 7 with the train rows), and the run goes on bit for bit from the saved float32
    master weights, not from the float16 parameters: the step-12 checkpoints are equal."""
    run = copy_run(fp16_run["dir"], tmp_path / "run", drop_after=8)
    code, lines, summary = train(capsys, retarget(fp16_run["config"], run))
    assert code == 0 and summary is not None and summary["resumed_from"] == 8, lines
    kept = [r for r in rows(run) if r["kind"] != "summary"]
    assert kept[: len(kept) - 5] == [r for r in fp16_run["rows"] if r["kind"] != "summary" and r["step"] <= 8]
    assert [(r["kind"], r["step"]) for r in kept[len(kept) - 5:]] == [("memory", 8)] + [("train", s) for s in range(9, 13)]
    assert summary["overflows"] == 1
    assert losses(run) == losses(fp16_run["dir"])
    mine, theirs = masters(step_dir(run, 12)), masters(step_dir(fp16_run["dir"], 12))
    assert mine and all(t.dtype == torch.float32 for t in mine.values())
    assert all(torch.equal(mine[n], theirs[n]) for n in theirs)


@pytest.mark.multiproc
def test_the_loss_scale_is_divided_out_before_adamw_a_resume_at_another_scale_trains_the_same(fp16_run, tmp_path, capsys):
    """Resumed from step 8 at loss scale 2^9 instead of 2^15: gradients of a power-of-two scale
    differ only by that factor, so with the scale divided out the steps that follow equal the
    uninterrupted run's. AdamW's moments from steps at 2^15 meet gradients at 2^9 here: a scale
    left in the gradients would show (AdamW's scale invariance hides it only while the scale holds)."""
    run = copy_run(fp16_run["dir"], tmp_path / "run", drop_after=8)
    path = step_dir(run, 8) / "manifest.json"
    record = json.loads(path.read_text())
    assert record["trainer"]["loss_scale"]["scale"] == 2.0**15
    record["trainer"]["loss_scale"]["scale"] = 2.0**9
    path.write_text(json.dumps(record))
    code, lines, summary = train(capsys, retarget(fp16_run["config"], run))
    assert code == 0 and summary is not None and summary["resumed_from"] == 8, lines
    got, want = losses(run), losses(fp16_run["dir"])
    assert sorted(got) == sorted(want)  # the same steps applied
    assert [got[s] for s in range(9, 13)] == pytest.approx([want[s] for s in range(9, 13)], rel=1e-3, abs=0)
