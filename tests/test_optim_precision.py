"""Mixed precision: dtype resolution and its checks, float16's dynamic loss scaling, a float16 run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from portapipe.config import ConfigError, load_config
from portapipe.optim.precision import LossScaler, master_dtype, reduce_dtype

MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}


def test_master_dtype_auto_is_float32_under_low_precision_else_the_model_dtype():
    assert [master_dtype(d, "auto") for d in ("bfloat16", "float16", "float32", "float64")] == ["float32", "float32", "float32", "float64"]
    assert master_dtype("bfloat16", "float64") == "float64" and master_dtype("bfloat16", "bfloat16") == "bfloat16"
    assert reduce_dtype("bfloat16", "auto", "auto") == "float32" and reduce_dtype("float32", "float64", "bfloat16") == "bfloat16"


def test_a_master_dtype_less_precise_than_the_model_and_zero_with_eplb_rebalancing_are_refused():
    with pytest.raises(ConfigError, match=r"train.master_dtype: float32 is less precise than model.dtype float64"):
        load_config({"model": {"dtype": "float64"}, "train": {"master_dtype": "float32"}})
    with pytest.raises(ConfigError, match=r"train.master_dtype: bfloat16 is less precise than model.dtype float16"):
        load_config({"model": {"dtype": "float16"}, "train": {"master_dtype": "bfloat16"}})
    base = {"parallel": {"ep": 2, "dp": 2, "pp": 1}, "schedule": {"name": "1f1b"}, "model": {"n_experts": 8}}
    with pytest.raises(ConfigError, match=r"train.zero_stage: 1 shards the optimizer state that an EPLB rebalance"):
        load_config({**base, "balancer": {"kind": "eplb", "interval": 5}, "train": {"steps": 10, "zero_stage": 1}})
    load_config({**base, "balancer": {"kind": "eplb", "interval": 50}, "train": {"steps": 10, "zero_stage": 1}})  # no rebalance: fine
    # LPLB re-plans which experts are copied at its interval too, and moves their rows the same way
    with pytest.raises(ConfigError, match=r"train.zero_stage: 2 shards the optimizer state that an LPLB rebalance"):
        load_config({**base, "balancer": {"kind": "lplb", "redundant": 1, "interval": 5}, "train": {"steps": 10, "zero_stage": 2}})


def test_loss_scale_halves_on_overflow_and_doubles_after_clean_steps():
    s = LossScaler(True, init=1024.0, growth_interval=3)
    assert [s.update(f) for f in (False, True, True, True, False)] == [False, True, True, True, False]
    assert s.overflows == 2 and s.scale == 512.0  # 1024 -> 512, three clean steps -> 1024, overflow -> 512
    s2 = LossScaler(True, init=8.0, growth_interval=2)
    s2.update(True)
    s2.update(True)
    assert s2.scale == 16.0
    s2.update(False)
    assert s2.scale == 8.0 and s2.clean == 0
    again = LossScaler(True)
    again.load_state_dict(s2.state_dict())
    assert (again.scale, again.clean, again.overflows) == (8.0, 0, 1)
    off = LossScaler(False)
    assert off.scale == 1.0 and off.update(False) is False and off.overflows == 0


def _float16_run(folder: Path, **train: Any) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """12 float16 steps (pp 2, 1F1B): stderr, the metrics rows and the last checkpoint's manifest."""
    import subprocess
    import sys

    raw = {"backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
           "model": {**MODEL, "dtype": "float16"}, "train": {"steps": 12, "micro_batch_size": 2, "lr": 1e-2, "warmup_steps": 0, **train},
           "data": {"val_fraction": 0.05}, "log": {"dir": str(folder), "progress": False}}
    (folder / "c.json").write_text(json.dumps(raw))
    # its own process: the ranks' stderr is then this command's (a fork server kept from an earlier
    # test of this pytest process would write where that test's stderr went)
    proc = subprocess.run([sys.executable, "-c", "import sys; from portapipe.cli import main; sys.exit(main(sys.argv[1:]))",
                           "train", str(folder / "c.json")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    last = max((folder / "checkpoints").glob("step_*/manifest.json"), key=lambda p: int(p.parent.name.split("_")[1]))
    return proc.stderr, rows, json.loads(last.read_text())


@pytest.mark.multiproc
def test_float16_overflows_skip_steps_lower_the_scale_and_training_goes_on(tmp_path: Path):
    """A step overflows at the initial scale 2**16 (not a divergence: exit 0); it is skipped, halves the scale, and training goes on."""
    err, rows, manifest = _float16_run(tmp_path)
    overflow = [r for r in rows if r["kind"] == "overflow"]
    train = [r for r in rows if r["kind"] == "train"]
    summary = rows[-1]
    assert overflow and train and len(overflow) + len(train) == 12
    assert [r["loss_scale"] for r in overflow] == [2.0**16 / 2**i for i in range(len(overflow))]
    assert not {r["step"] for r in overflow} & {r["step"] for r in train}  # an overflowed step is not applied
    assert summary["overflows"] == len(overflow) and "diverged" not in summary
    assert err.count("gradients overflowed at loss scale") == len(overflow)
    assert train[-1]["loss"] < train[0]["loss"]
    # the checkpoint carries the scale, so a resumed run goes on where this one stopped
    assert manifest["trainer"]["loss_scale"]["scale"] == 2.0**16 / 2 ** len(overflow)


@pytest.mark.multiproc
def test_the_growth_interval_key_sets_how_many_clean_steps_double_the_scale(tmp_path: Path):
    """With train.loss_scale_growth_interval 2 the scale doubles every second clean step: every
    overflow row's scale and the checkpoint's are the scaler's replayed over the run's own steps."""
    _, rows, manifest = _float16_run(tmp_path, loss_scale_growth_interval=2)
    steps = sorted((r["step"], r["kind"] == "train") for r in rows if r["kind"] in ("train", "overflow"))
    assert [s for s, _ in steps] == list(range(1, 13))
    replay, at_overflow = LossScaler(True, growth_interval=2), []
    for _, applied in steps:
        if not applied:
            at_overflow.append(replay.scale)
        replay.update(applied)
    assert [r["loss_scale"] for r in rows if r["kind"] == "overflow"] == at_overflow
    assert manifest["trainer"]["loss_scale"]["scale"] == replay.scale
    # the key mattered: the default interval would not have grown the scale in 12 steps
    assert replay.scale > 2.0**16 / 2 ** len(at_overflow)
