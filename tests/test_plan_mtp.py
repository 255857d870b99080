"""The planner counts multi-token prediction: the modules on the last stage in the programs the
memory and time models walk, their parameters and the embedding's copy, a profile without them
priced by FLOPs. (The memory model's peaks with modules equal a real step's: test_plan_memory.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from portapipe.config import load_config
from portapipe.plan.memory_model import static_memory
from portapipe.plan.programs import Programs, stage_specs
from portapipe.plan.shape import Shape, block_params, flops
from portapipe.plan.time_model import TimeModel
from portapipe.scheduling.executor import build_schedule
from portapipe.config.setup import Setup

from .test_plan_time import MOE, profile

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
ONE_F_ONE_B = ["parallel.pp=2", "parallel.ep=2", "schedule.name=1f1b", "schedule.microbatches=4"]


def _setup(*sets: str) -> tuple[Setup, object]:
    cfg = load_config(EXAMPLE, [*ONE_F_ONE_B, *sets])
    return Setup.from_config(cfg), build_schedule(cfg)


def test_the_last_stage_runs_each_depth_after_its_head_on_the_tokens_that_have_one_ahead() -> None:
    setup, sched = _setup("model.mtp_layers=2")
    specs = stage_specs(setup, sched)
    last = next(spec for v, spec in enumerate(specs) if sched.is_last(v))
    assert last.layers[-2:] == (4, 5) and all(not spec.last or 4 in spec.layers for spec in specs)
    programs = Programs.of(setup)
    T, S = programs.T, setup.model.seq_len
    ops = [op for op in programs.forward(last) if op[0] == "C"]
    names = [op[1] for op in ops]
    head = names.index("head")
    assert names[head + 1] == "mtp" and names.count("head") == 3 and names.count("mtp") == 2
    depth2 = [op for op in ops if op[1] == "mtp"][1]
    assert depth2[3] == pytest.approx(T * (S - 2) / S)
    back = [op[1] for op in programs.backward(last, "B") if op[0] == "C"]
    assert back.count("mtp") == 2 and back.count("head") == 3


def test_the_modules_and_the_embeddings_copy_are_the_last_stages_parameters() -> None:
    base, sched = _setup()
    mtp, _ = _setup("model.mtp_layers=1")
    s0, s1 = base.shape, mtp.shape
    h, v = s1.hidden, s1.vocab_size
    layer = block_params(s1, range(4, 5), False, False, s1.n_experts // 2).elements
    grown = static_memory(mtp, sched, 1).params - static_memory(base, sched, 1).params
    assert grown == (v * h + layer + 3 * h + 2 * h * h) * s1.e
    assert static_memory(mtp, sched, 0).params == static_memory(base, sched, 0).params
    tied = Shape.of(load_config(EXAMPLE, [*ONE_F_ONE_B, "model.tie_word_embeddings=true"]).model)
    assert block_params(tied, range(2, 4), False, True, 4).elements == block_params(s0, range(2, 4), False, True, 4).elements
    assert block_params(tied, range(0, 4), True, True, 4).elements == block_params(s0, range(0, 4), True, True, 4).elements - v * h


def test_a_profile_without_the_module_prices_it_at_attentions_pace_and_the_step_grows() -> None:
    base, sched = _setup()
    mtp, _ = _setup("model.mtp_layers=1")
    parts = {**MOE, "embed": {"F": 0.1, "B": 0.1}, "dense": {"F": 3.0, "B": 3.0, "W": 1.0}, "head": {"F": 2.0, "B": 2.0, "W": 1.0}}
    per_unit = {p: {ph: (0.0, c / 256) if isinstance(c, float) else c for ph, c in t.items()} for p, t in parts.items()}
    prof = profile(base.shape, per_unit, a2a=0.5)
    s = mtp.shape
    want = prof.time("attention", "F", "off", 100) * flops(s, "mtp", "F") / flops(s, "attention", "F")
    assert prof.time("mtp", "F", "off", 100) == pytest.approx(want) and want > 0
    t0 = TimeModel(base, prof, sched).predict().step_s
    t1 = TimeModel(mtp, prof, sched).predict().step_s
    assert t1 > t0 * 1.05
