"""Checkpoints stay logical across zero stages, dp sizes and master dtypes (float64 runs through the CLI).

A run on pp 2 with zero_stage 0 and one on dp 2 with zero_stage 2 (4 steps, checkpoints at 2 and 4);
each resumes from step 2 on the other's layout and stage: steps 3 and 4
equal the uninterrupted run's within 1e-9. A float64 checkpoint also continues as float32 compute
with float64 master weights (the master weights are the saved float64 parameters: the losses
agree to float32's rounding), and that run's checkpoint holds both: the parameters in float32
(what export writes) equal to its float64 master weights cast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_checkpoint_run import raw as run_config
from tests.test_checkpoint_tried import copy_run, losses, retarget, step_dir, train


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.cli import main

    root = tmp_path_factory.mktemp("zero")
    out = {}
    for name, sets in {"zero0": {}, "zero2": {"parallel__pp": 1, "parallel__dp": 2, "schedule__microbatches": 1}}.items():
        config = run_config(root / name, steps=4, pp=2, **sets)
        config["train"]["zero_stage"] = 2 if name == "zero2" else 0
        path = root / f"{name}.json"
        path.write_text(json.dumps(config))
        assert main(["train", str(path)]) == 0
        out[name] = {"config": config, "dir": root / name, "losses": losses(root / name)}
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "source, change",
    [
        ("zero0", ("parallel.pp=1", "parallel.dp=2", "schedule.microbatches=1", "train.zero_stage=2")),
        ("zero2", ("parallel.pp=2", "parallel.dp=1", "schedule.microbatches=2", "train.zero_stage=0")),
    ],
    ids=["zero0-pp2-to-zero2-dp2", "zero2-dp2-to-zero0-pp2"],
)
def test_a_resume_on_another_zero_stage_and_dp_size_continues_with_the_same_losses(runs, tmp_path, capsys, source, change):
    src = runs[source]
    run = copy_run(src["dir"], tmp_path / "run", drop_after=2)
    code, lines, summary = train(capsys, retarget(src["config"], run), *[a for item in change for a in ("--set", item)])
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    got = losses(run)
    assert max(abs(got[s] - src["losses"][s]) for s in (3, 4)) <= 1e-9, (got, src["losses"])


@pytest.mark.multiproc
def test_a_float64_run_continues_in_float32_with_float64_master_weights_and_saves_both(runs, tmp_path, capsys):
    from portapipe.checkpoint.files import load_no_dist, read_dcp_metadata

    src = runs["zero0"]
    run = copy_run(src["dir"], tmp_path / "run", drop_after=2)
    code, lines, summary = train(capsys, retarget(src["config"], run), "--set", "model.dtype=float32", "--set", "train.master_dtype=float64")
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    got = losses(run)
    assert max(abs(got[s] - src["losses"][s]) for s in (3, 4)) <= 1e-4
    ckpt = step_dir(run, 4)
    meta = read_dcp_metadata(ckpt)
    names = [k[len("master."):] for k in meta if k.startswith("master.")]
    assert names and all(meta[f"model.{n}"].properties.dtype == torch.float32 for n in names)
    state = {"model": {n: torch.empty(tuple(meta[f"model.{n}"].size), dtype=torch.float32) for n in names},
             "master": {n: torch.empty(tuple(meta[f"master.{n}"].size), dtype=torch.float64) for n in names}}
    load_no_dist(ckpt, state)
    for n in names:
        assert torch.equal(state["model"][n], state["master"][n].to(torch.float32)), n
    assert any(not torch.equal(state["model"][n].double(), state["master"][n]) for n in names)  # the master is finer
