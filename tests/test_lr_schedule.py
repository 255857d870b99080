"""train.lr_schedule: the learning rate as phases (warm-up, constant, cosine, linear).

The default (warm-up, then constant or a cosine to lr_schedule_steps) gives the values it gave
before the phases existed, bit for bit, against the formula written out here; DeepSeek-V3's
published schedule is one config (examples/plan/deepseek_v3.yaml) and gives the report's
values at the report's token counts; a resumed run continues its phases, also from a config
that no longer names them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from portapipe.config import ConfigError, TrainConfig, load_config
from portapipe.optim.lr_schedule import Phase, default_phases, describe, lr_at, resolve
from portapipe.training.update import lr_at as train_lr_at

ROOT = Path(__file__).resolve().parents[1]


def _old_lr_at(step: int, t: TrainConfig, horizon: int | None) -> float:
    """The schedule as it was before the phases: warm-up, then lr or a half cosine to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if horizon is None:
        return t.lr
    decay_steps = horizon - t.warmup_steps
    if decay_steps <= 1:
        return t.lr if step < horizon else t.min_lr
    progress = min(1.0, (step - t.warmup_steps) / (decay_steps - 1))
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("lr, min_lr, warmup", [(3e-3, 3e-4, 10), (1e-2, 0.0, 0), (2.2e-4, 2.2e-5, 1), (0.7, 0.1, 3)])
@pytest.mark.parametrize("horizon", [None, 10, 11, 12, 13, 57, 100])
def test_the_default_gives_the_values_it_gave_before_bit_for_bit(lr, min_lr, warmup, horizon) -> None:
    if horizon is not None and horizon < warmup:
        return
    t = TrainConfig(lr=lr, min_lr=min_lr, warmup_steps=warmup)
    got = [train_lr_at(s, t, horizon) for s in range(130)]
    assert got == [_old_lr_at(s, t, horizon) for s in range(130)]


def test_each_kind_of_phase_follows_its_closed_form_and_the_last_value_stays() -> None:
    phases = resolve([{"kind": "warmup", "steps": 4, "lr": None}, {"kind": "constant", "steps": 2, "lr": None},
                      {"kind": "linear", "steps": 4, "lr": 0.2}, {"kind": "cosine", "steps": 5, "lr": 0.1},
                      {"kind": "constant", "steps": 2, "lr": 0.05}], start=1.0)
    assert phases[0] == Phase("warmup", 4, 1.0) and phases[1] == Phase("constant", 2, 1.0)
    got = [lr_at(s, phases, 1.0) for s in range(20)]
    assert got[:4] == [0.25, 0.5, 0.75, 1.0]
    assert got[4:6] == [1.0, 1.0]
    assert got[6:10] == pytest.approx([0.8, 0.6, 0.4, 0.2])  # from 1.0, one step in, to 0.2 at its last
    assert got[10:15] == pytest.approx([0.2 - 0.1 * (1 - math.cos(math.pi * i / 4)) / 2 for i in range(5)])  # 0.2 .. 0.1
    assert got[14] == 0.1 and got[15:17] == [0.05, 0.05] and got[17:] == [0.05] * 3
    assert describe(phases, 1.0) == ("warm-up 4 steps to 1, constant 1 for 2 steps, linear to 0.2 over 4 steps, "
                                      "cosine to 0.1 over 5 steps, constant 0.05 for 2 steps, then 0.05")


def test_deepseek_v3s_published_schedule_is_one_config() -> None:
    """The report (arXiv 2412.19437, 4.2): warm-up over the first 2K steps to 2.2e-4, constant
    until 10T tokens, a cosine to 2.2e-5 over 4.3T tokens, 2.2e-5 for 333B tokens, then 7.3e-6
    for the last 167B; tokens map to steps through the config's global batch (15360 sequences of
    4096 tokens), a phase ending after X tokens at step ceil(X / tokens per step)."""
    c = load_config(ROOT / "examples" / "plan" / "deepseek_v3.yaml")
    t = c.train
    per_step = c.parallel.dp * c.parallel.ep * c.schedule.microbatches * t.micro_batch_size * c.model.seq_len
    assert per_step == 15360 * 4096
    phases = resolve(t.lr_schedule, t.lr)

    def lr(tokens: float) -> float:  # the learning rate of the step that starts at this token count
        return lr_at(math.ceil(tokens / per_step), phases, t.lr)

    assert lr_at(0, phases, t.lr) == pytest.approx(2.2e-4 / 2000) and lr_at(1999, phases, t.lr) == 2.2e-4
    assert lr_at(2000, phases, t.lr) == 2.2e-4 and lr(10e12 - per_step) == 2.2e-4
    assert lr(10e12 + 2.15e12) == pytest.approx((2.2e-4 + 2.2e-5) / 2, rel=1e-4)  # half way down the cosine
    assert lr(14.3e12 - per_step) == pytest.approx(2.2e-5, rel=1e-8) and lr(14.3e12) == 2.2e-5
    assert lr(14.3e12 + 333e9 - per_step) == 2.2e-5 and lr(14.3e12 + 333e9) == 7.3e-6
    assert lr(14.8e12 - per_step) == 7.3e-6
    assert t.steps == math.ceil(14.8e12 / per_step)  # the run's 14.8T tokens
    assert sum(p.steps for p in phases) == t.steps


@pytest.mark.parametrize(
    "setting, line",
    [
        ("train.lr_schedule=[{kind: cosine, steps: 10}]", "train.lr_schedule[0]: a cosine phase needs lr: the learning rate it ends at"),
        ("train.lr_schedule={kind: warmup, steps: 3}", "train.lr_schedule: expected a list of phases, each {kind, steps, lr}"),
        ("train.lr_schedule=[]", "train.lr_schedule: []: an empty schedule; give one phase at least, e.g. [{kind: constant, steps: 1}], or remove it"),
        ("train.lr_schedule=[{kind: warmup, steps: '5'}]", "train.lr_schedule[0].steps: '5': text is not a number; give an integer without quotes"),
        ("train.lr_schedule=[{kind: warmup, steps: 0}]", "train.lr_schedule[0].steps: 0: Input should be greater than or equal to 1"),
        ("train.lr_schedule=[{kind: decay, steps: 3}]", "train.lr_schedule[0].kind: 'decay': Input should be 'warmup', 'constant', 'cosine' or 'linear'"),
        ("train.lr_schedule=[{kind: warmup, steps: 3, to: 1}]", "train.lr_schedule[0].to: unknown key"),
        ("train.lr_schedule=[{kind: warmup, steps: 3, lr: 0}]", "train.lr_schedule[0].lr: 0; a warm-up must end above 0"),
    ],
)
def test_a_phase_that_cannot_work_is_refused_in_one_line(setting: str, line: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train": {"steps": 5}}, [setting])
    assert info.value.problems == [line]


def test_the_default_schedules_keys_beside_phases_are_refused_as_without_effect() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"train": {"warmup_steps": 5, "lr_schedule_steps": 20, "lr_schedule": [{"kind": "constant", "steps": 3}]}})
    assert info.value.problems == [
        "train.warmup_steps: 5 has no effect: train.lr_schedule sets the schedule; remove it (or express it as a phase)",
        "train.lr_schedule_steps: 20 has no effect: train.lr_schedule sets the schedule; remove it (or express it as a phase)",
    ]


def test_adamws_first_step_is_checked_at_the_schedules_largest_learning_rate() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"model": {"dtype": "bfloat16"}, "train": {"master_dtype": "bfloat16", "lr_schedule": [
            {"kind": "warmup", "steps": 2}, {"kind": "linear", "steps": 2, "lr": 1e38}]}})
    assert info.value.problems[0].startswith("train.lr_schedule[1].lr: 1e+38: AdamW's first step multiplies by")


# ------------------------------------------------------------------------------- on resume
MODEL = {"hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}
PHASES = [{"kind": "warmup", "steps": 2, "lr": 1e-2}, {"kind": "constant", "steps": 2}, {"kind": "cosine", "steps": 3, "lr": 1e-3},
          {"kind": "linear", "steps": 2, "lr": 0.0}]


def _raw(log_dir: Path, steps: int, phases: list[dict[str, Any]] | None) -> dict[str, Any]:
    train: dict[str, Any] = {"steps": steps, "micro_batch_size": 2}
    if phases is not None:
        train["lr_schedule"] = phases
    return {"backend": "cpu", "parallel": {"pp": 1, "ep": 1, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
            "model": dict(MODEL), "train": train, "data": {"val_fraction": 0.0}, "log": {"dir": str(log_dir), "progress": False},
            "checkpoint": {"every": 2, "keep": 1}}


def _lrs(log_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["lr"] for r in rows if r["kind"] == "train"]


@pytest.mark.multiproc
def test_a_resumed_run_continues_its_phases_also_from_a_config_that_no_longer_names_them(tmp_path, capfd) -> None:
    from portapipe.train import train

    train(load_config(_raw(tmp_path / "straight", 10, PHASES)))
    straight = _lrs(tmp_path / "straight")
    want = [lr_at(s, resolve(PHASES, 3e-3), 3e-3) for s in range(10)]
    assert straight == want
    train(load_config(_raw(tmp_path / "resumed", 4, PHASES)))
    train(load_config(_raw(tmp_path / "resumed", 7, PHASES)))  # the same config, more steps
    train(load_config(_raw(tmp_path / "resumed", 10, None)))  # no schedule named: the checkpoint's
    assert _lrs(tmp_path / "resumed") == straight
    err = capfd.readouterr().err
    assert ("LR schedule after step 7: warm-up 2 steps to 0.01, constant 0.01 for 2 steps, cosine to 0.001 over 3 steps, "
            "linear to 0 over 2 steps, then 0 (kept from the checkpoint; train.lr_schedule or train.lr_schedule_steps changes it)") in err
    manifest = json.loads(next((tmp_path / "resumed" / "checkpoints").glob("step_*/manifest.json")).read_text())
    assert manifest["trainer"]["lr_schedule"] == [Phase(p["kind"], p["steps"], p.get("lr") or 1e-2).to_dict() for p in PHASES[:1]] + [
        {"kind": "constant", "steps": 2, "lr": 1e-2}, {"kind": "cosine", "steps": 3, "lr": 1e-3}, {"kind": "linear", "steps": 2, "lr": 0.0}]


def test_default_phases_of_a_horizon_at_the_warm_ups_end_drop_to_min_lr() -> None:
    assert default_phases(1.0, 0.5, 2, 2) == (Phase("warmup", 2, 1.0), Phase("cosine", 0, 0.5))
    assert [lr_at(s, default_phases(1.0, 0.5, 2, 2), 1.0) for s in range(4)] == [0.5, 1.0, 0.5, 0.5]
