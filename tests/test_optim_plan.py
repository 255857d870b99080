"""The planner counts master weights and ZeRO shards, and picks the least zero_stage that fits."""

from __future__ import annotations

from pathlib import Path

from portapipe.config import load_config
from portapipe.plan.memory_model import static_memory
from portapipe.plan.planner import plan
from portapipe.plan.published import published
from portapipe.config.setup import Setup
from portapipe.plan.shape import Shape
from portapipe.scheduling.executor import build_schedule

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"
DP2 = ["parallel.pp=2", "parallel.ep=1", "parallel.dp=2"]


def _static(*sets: str):
    cfg = load_config(EXAMPLE, [*DP2, *sets])
    return static_memory(Setup.from_config(cfg), build_schedule(cfg), 0)


def test_bfloat16_keeps_float32_master_weights_and_zero_shards_them_over_dp():
    base = _static()  # float32: the parameters are the master weights
    n = base.params / 4  # elements on pipeline rank 0
    assert (base.grads, base.master, base.optimizer) == (4 * n, 0.0, 8 * n)
    bf = _static("model.dtype=bfloat16")
    assert (bf.params, bf.grads, bf.master, bf.optimizer) == (2 * n, 4 * n, 4 * n, 8 * n)
    z1, z2 = _static("model.dtype=bfloat16", "train.zero_stage=1"), _static("model.dtype=bfloat16", "train.zero_stage=2")
    assert (z1.grads, z1.master, z1.optimizer) == (4 * n, 2 * n, 4 * n)  # dp 2: half the master weights and moments
    assert (z2.grads, z2.master, z2.optimizer) == (2 * n, 2 * n, 4 * n)  # and half the gradients
    assert (z1.master + z1.optimizer) / (bf.master + bf.optimizer) == 0.5


def test_the_plan_shards_the_optimizer_only_where_the_budget_needs_it():
    cfg = load_config(EXAMPLE, ["model.dtype=bfloat16"])
    prof = published("h800", Shape.of(cfg.model))
    roomy = plan(cfg, 4, None, prof, keep=3)
    assert roomy.ranked and all(c.setup.zero_stage == 0 for c in roomy.ranked)
    best = roomy.ranked[0]
    # a budget just below that candidate's peak: it fits again only with a sharded optimizer
    tight = plan(cfg, 4, best.memory.peak - 1, prof, keep=50)
    same = [c for c in tight.ranked if c.setup.replace(zero_stage=0) == best.setup]
    assert best.setup.dp * best.setup.ep > 1 and same and same[0].setup.zero_stage >= 1
    assert same[0].memory.peak < best.memory.peak
    assert tight.config_of(same[0]).train.zero_stage == same[0].setup.zero_stage  # the config it proposes says so


def test_bfloat16_moments_halve_the_moments_bytes_in_the_memory_model():
    bf = _static("model.dtype=bfloat16")
    half = _static("model.dtype=bfloat16", "train.moments_dtype=bfloat16")
    assert (half.params, half.grads, half.master) == (bf.params, bf.grads, bf.master) and half.optimizer * 2 == bf.optimizer


def test_allowed_bfloat16_moments_are_chosen_only_where_the_users_do_not_fit():
    from portapipe.plan.report import fullest, row

    cfg = load_config(EXAMPLE, ["model.dtype=bfloat16", "parallel.pp=4", "parallel.dp=1", "parallel.ep=1", "schedule.name=1f1b"])
    prof = published("h800", Shape.of(cfg.model))
    roomy = plan(cfg, 4, None, prof, keep=3, allow=("moments_dtype",))
    assert roomy.ranked and all(c.setup.moments_dtype == "auto" for c in roomy.ranked)
    user = roomy.user  # pp 4 x dp 1: no zero stage can shard it, only the moments' dtype can make it fit
    tight_budget = user.memory.peak - user.memory.ranks[user.memory.worst_rank].optimizer / 4
    without = plan(cfg, 4, tight_budget, prof, keep=1000)  # every candidate that fits: none cut by the keep
    allowed = plan(cfg, 4, tight_budget, prof, keep=1000, allow=("moments_dtype",))
    fit_f32 = {c.setup for c in without.ranked}
    chosen = [c for c in allowed.ranked if c.setup.moments_dtype == "bfloat16"]
    assert chosen and all(c.setup.replace(moments_dtype="auto") not in fit_f32 for c in chosen)  # chosen only where needed
    # what fits without still fits, at the same zero stage or a lower one (bfloat16 moments are tried before the next stage)
    base = lambda x: x.replace(zero_stage=0, moments_dtype="auto")  # noqa: E731
    stage = {base(c.setup): c.setup.zero_stage for c in allowed.ranked}
    assert all(base(x) in stage and stage[base(x)] <= x.zero_stage for x in fit_f32)
    c = chosen[0]
    assert allowed.config_of(c).train.moments_dtype == "bfloat16" and "bf16 moments" in row(c)["memory_option"]
    f = fullest(c)
    assert f["moments"] * 2 == static_memory(c.setup.replace(moments_dtype="auto"), build_schedule(allowed.config_of(c)), int(f["rank"])).optimizer
    assert sum(v for k, v in f.items() if k not in ("rank", "total", "ema_host")) == f["total"] and f["ema_host"] == 0


def test_the_host_ema_counts_in_host_memory_not_the_devices():
    base, ema = _static("model.dtype=bfloat16"), _static("model.dtype=bfloat16", "train.ema_decay=0.999")
    n = base.params / 2  # elements on pipeline rank 0
    assert ema.ema_host == (4 + 4) * n and base.ema_host == 0  # float32 average + float32 staging of the master weights
    assert ema.static == base.static  # none of the device's
    z1 = _static("model.dtype=bfloat16", "train.ema_decay=0.999", "train.zero_stage=1")
    assert z1.ema_host == ema.ema_host / 2  # sharded like the master weights (dp 2)
