"""AdamW's moments in bfloat16 (``train.moments_dtype``): the update, the config, checkpoints.

The update with bfloat16 moments under float32 weights is checked against AdamW written out in
float64 here: the weights move by the widened (unrounded) moments, the moments are stored rounded
to nearest. Runs on gloo ranks: the memory record's optimizer bytes halve; a float32-moments
checkpoint resumed with bfloat16 moments says so in one line and trains on; a bfloat16-moments run
resumed on another zero stage and dp size gives the uninterrupted run's losses.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import portapipe.optim.adamw as adamw
from portapipe.config import ConfigError, load_config
from portapipe.config.rules import user_notes
from tests.test_checkpoint_run import raw as run_config
from tests.test_checkpoint_tried import copy_run, losses, retarget, train

B1, B2, LR, WD, EPS = 0.9, 0.95, 1e-2, 0.1, 1e-8


def _state(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    exp_avg = (torch.randn(n, generator=g) * 1e-2).bfloat16()
    exp_avg_sq = (torch.rand(n, generator=g) * 1e-4).bfloat16()
    return param, grad, exp_avg, exp_avg_sq


def _by_hand(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int) -> tuple[torch.Tensor, ...]:
    """AdamW in float64 from the stored moments: (new weights, new exp_avg, new exp_avg_sq), unrounded."""
    p, g, m, v = (t.double() for t in (param, grad, m, v))
    p = p * (1 - LR * WD)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    p = p - LR * (m / (1 - B1**step)) / ((v / (1 - B2**step)).sqrt() + EPS)
    return p, m, v


def test_bfloat16_moments_are_widened_for_the_update_and_stored_rounded():
    param, grad, m, v = _state(4096, 0)
    want_p, want_m, want_v = _by_hand(param, grad, m, v, step=3)
    before = param.clone()
    adamw.adamw_(param, grad, m, v, step=3, lr=LR, betas=(B1, B2), weight_decay=WD, decayed=[(0, 4096)], compute=torch.float32)
    assert m.dtype == v.dtype == torch.bfloat16
    # stored: the float32 update rounded to bfloat16 (the float64 one rounded agrees but for ties of the two roundings)
    for got, want in ((m, want_m), (v, want_v)):
        same = got.double() == want.to(torch.bfloat16).double()
        assert float(same.double().mean()) > 0.999
        spacing = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        assert bool(((got.double() - want).abs() <= spacing).all())
    # the weights move by the unrounded moments: within float32's rounding of the update, which
    # the rounded moments' update is not
    step = (param - before).double()
    err = float((step - (want_p - before.double())).abs().max() / step.abs().max())
    assert err < 1e-5, err
    rounded = before.double() * (1 - LR * WD) - LR * (m.double() / (1 - B1**3)) / ((v.double() / (1 - B2**3)).sqrt() + EPS)
    assert float((rounded - want_p).abs().max() / step.abs().max()) > 10 * err


def test_the_update_in_pieces_equals_the_update_at_once(monkeypatch):
    a = _state(1000, 1)
    b = tuple(t.clone() for t in a)
    adamw.adamw_(*a, step=1, lr=LR, betas=(B1, B2), weight_decay=WD, decayed=[(10, 700)], compute=torch.float32)
    monkeypatch.setattr(adamw, "PIECE", 7)
    adamw.adamw_(*b, step=1, lr=LR, betas=(B1, B2), weight_decay=WD, decayed=[(10, 700)], compute=torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_moments_in_the_weights_dtype_update_in_place_as_before():
    p, g, m, v = (t.float() for t in _state(64, 2))
    p2, g2, m2, v2 = (t.clone() for t in (p, g, m, v))
    adamw.adamw_(p, g, m, v, step=2, lr=LR, betas=(B1, B2), weight_decay=0.0, decayed=[], compute=torch.float32)
    m2.lerp_(g2, 1 - B1)
    v2.mul_(B2).addcmul_(g2, g2, value=1 - B2)
    p2.addcdiv_(m2, (v2.sqrt() / math.sqrt(1 - B2**2)).add_(EPS), value=-LR / (1 - B1**2))
    assert torch.equal(p, p2) and torch.equal(m, m2) and torch.equal(v, v2)


def test_float16_moments_are_refused_and_slow_betas_get_a_note():
    with pytest.raises(ConfigError) as err:
        load_config({"train": {"moments_dtype": "float16"}})
    assert err.value.problems == [
        "train.moments_dtype: float16 cannot hold AdamW's squared gradients (below 6.0e-08 they round to zero, as does eps 1e-08, "
        "and the update divides by zero); use auto, bfloat16 (the range of float32), float32 or float64"
    ]
    assert user_notes(load_config({"train": {"moments_dtype": "bfloat16"}})) == []  # betas (0.9, 0.95): DeepSeek-V3's
    notes = user_notes(load_config({"train": {"moments_dtype": "bfloat16", "betas": [0.9, 0.999]}}))
    assert len(notes) == 1 and notes[0].startswith(
        "train.moments_dtype: bfloat16 exp_avg_sq with betas[1] 0.999 may move only when the squared gradient differs from it by more than 391%"
    ), notes
    assert user_notes(load_config({"train": {"betas": [0.9, 0.999]}})) == []  # float32 moments follow


# ------------------------------------------------------------------------------------- runs
def _run(root: Path, name: str, **over: object) -> dict[str, object]:
    config = run_config(root / name, steps=4, pp=2, **{"checkpoint__every": 2, **over})
    path = root / f"{name}.json"
    path.write_text(json.dumps(config))
    from portapipe.cli import main

    assert main(["train", str(path)]) == 0
    return {"config": config, "dir": root / name, "losses": losses(root / name)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    root = tmp_path_factory.mktemp("moments")
    return {
        "float32": _run(root, "float32", model__dtype="float32"),
        "bf16": _run(root, "bf16", model__dtype="float32", train__moments_dtype="bfloat16"),
        "bf16_f64_zero2": _run(root, "bf16_f64_zero2", train__moments_dtype="bfloat16", train__zero_stage=2, parallel__pp=1,
                               parallel__dp=2, schedule__microbatches=1),
    }


def _memory(log_dir: Path) -> dict[str, int]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in rows if r["kind"] == "memory")


@pytest.mark.multiproc
def test_bfloat16_moments_halve_the_optimizer_bytes_and_train_alike(runs):
    f32, bf16 = _memory(runs["float32"]["dir"]), _memory(runs["bf16"]["dir"])
    assert bf16["optimizer"] * 2 == f32["optimizer"] > 0
    assert (bf16["params"], bf16["grads"], bf16["master"]) == (f32["params"], f32["grads"], f32["master"])
    a, b = runs["float32"]["losses"], runs["bf16"]["losses"]
    assert a[1] == b[1] and a[4] != b[4] and abs(a[4] / b[4] - 1) < 1e-3, (a, b)


@pytest.mark.multiproc
def test_a_float32_moments_checkpoint_resumes_in_bfloat16_and_says_so_in_one_line(runs, tmp_path, capsys):
    src = runs["float32"]
    run = copy_run(src["dir"], tmp_path / "run", drop_after=2)
    code, lines, summary = train(capsys, retarget(src["config"], run), "--set", "train.moments_dtype=bfloat16")
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    said = [line for line in lines if line.startswith("portapipe: optimizer:")]
    assert said == ["portapipe: optimizer: the checkpoint keeps AdamW's moments in float32; this run keeps them in bfloat16 "
                    "(train.moments_dtype): converted on load"], lines
    got = losses(run)
    assert got[3] == src["losses"][3] and abs(got[4] / src["losses"][4] - 1) < 1e-4  # step 3 reads the converted moments' update


@pytest.mark.multiproc
def test_bfloat16_moments_reshard_from_zero_2_on_dp_2_to_zero_0_on_pp_2_with_the_same_losses(runs, tmp_path, capsys):
    src = runs["bf16_f64_zero2"]
    run = copy_run(src["dir"], tmp_path / "run", drop_after=2)
    change = ("parallel.pp=2", "parallel.dp=1", "schedule.microbatches=2", "train.zero_stage=0")
    code, lines, summary = train(capsys, retarget(src["config"], run), *[a for item in change for a in ("--set", item)])
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    assert not [line for line in lines if line.startswith("portapipe: optimizer:")], lines  # the same dtype: nothing converted
    got = losses(run)
    assert max(abs(got[s] - src["losses"][s]) for s in (3, 4)) <= 1e-9, (got, src["losses"])
