"""Offload in the planner's models: what a part sends (the bytes that stay measured per part on
the accounting), the optimizer's host share and device slots, the host link priced against the
compute it hides behind, the plan choosing offload only where nothing else fits, and the fewest
devices a config fits on. (Each setup's peak device bytes equal the accounting's per rank:
``python benchmarks/plan_accuracy.py --only offload``, benchmarks/plan_accuracy_offload.json.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from portapipe.config import load_config
from portapipe.config.setup import Setup
from portapipe.plan.memory_model import MemoryModel, static_memory
from portapipe.plan.offload_bytes import kept_bytes
from portapipe.plan.planner import _context, device_counts, enumerate_setups, evaluate, fewest_devices, fits, offload_levels, plan
from portapipe.plan.profile import Profile, ProfileError
from portapipe.plan.programs import stage_specs
from portapipe.plan.published import published
from portapipe.plan.time_model import TimeModel
from portapipe.scheduling.executor import build_schedule

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "examples" / "cpu.yaml"
ALL = "memory.offload=[attention,dense,shared,experts]"


def _setup(*sets: str, path: Path = CPU) -> tuple[Setup, object]:
    c = load_config(path, list(sets))
    return Setup.from_config(c), build_schedule(c)


def test_what_stays_on_the_device_is_what_the_accounting_measured():
    # examples/deepseek_v3.yaml in bfloat16, 64 tokens, one EP rank (tests' probe of the accounting):
    # the attention part keeps its input and residual sum (the router scores a float32 copy of
    # the FFN norm's output) and the dispatch's gather index; the experts their rows and weights
    s = Setup.from_config(load_config(ROOT / "examples" / "deepseek_v3.yaml", ["model.dtype=bfloat16"])).shape
    assert kept_bytes(s, "attention", "off", 64, 128, 128, None) == 64 * (2 * 64 * 2 + 2 * 8) == 17408
    assert kept_bytes(s, "dense", "off", 64, 128, 128, None) == 64 * 64 * 2
    assert kept_bytes(s, "shared", "off", 64, 128, 128, None) == 64 * 64 * 2  # its input: the router kept none
    assert kept_bytes(s, "experts", "off", 64, 128, 128, None) == 128 * (64 * 2 + 2) + 8 * 8 == 16704
    assert kept_bytes(s, "experts", "level0", 64, 128, 128, None) == 128 * 2 + 64  # the rows are not saved at all
    # the norms' recipes hold MLA's query latent and key / value projection output besides
    assert kept_bytes(s, "attention", "off", 64, 128, 128, None, norms=True) == 17408 + 64 * (32 + 32 + 8) * 2


def test_stage_specs_name_the_parts_sent_in_the_first_offload_layers():
    x, sched = _setup(ALL, "memory.offload_layers=1", "schedule.name=1f1b")
    specs = stage_specs(x, sched)
    assert specs[0].offload == (("dense",), ()) and specs[1].offload == (("attention", "shared", "experts"), ())
    x, sched = _setup("memory.offload=[attention,experts]", "memory.recompute=moe", "memory.recompute_layers=1", "schedule.name=1f1b",
                      "model.n_layers=6")
    assert stage_specs(x, sched)[1].offload == (("attention",), ("attention", "experts"), ("attention", "experts"))  # recomputed: its experts keep nothing


def test_the_optimizers_host_share_leaves_the_device_and_two_buckets_come_back_for_the_step():
    x, sched = _setup("train.zero_stage=1", "train.grad_bucket_mb=0.01")
    kept = static_memory(x, sched, 0)
    swapped = static_memory(x.replace(optimizer_offload="swap"), sched, 0)
    half = static_memory(x.replace(optimizer_offload="swap", offload_fraction=0.5), sched, 0)
    assert (swapped.master, swapped.optimizer) == (0, 0) and swapped.optimizer_host == kept.master + kept.optimizer
    assert half.optimizer == kept.optimizer / 2 and half.optimizer_host == (kept.master + kept.optimizer) / 2
    a, b = MemoryModel(x, sched).rank(0), MemoryModel(x.replace(optimizer_offload="swap"), sched).rank(0)
    slot = 0.01 * 2**20 / 4 / x.dp * 2 * 4  # a bucket of float32 gradients: its moments (the float32 parameters are the master weights)
    assert b.post - a.post == pytest.approx(2 * slot) and 2 * slot < b.optimizer_host


def test_activation_offload_lowers_the_device_peak_and_holds_the_rest_on_the_host():
    x, sched = _setup()
    off = MemoryModel(x, sched).report()
    sent = MemoryModel(x.replace(offload=("attention", "dense", "shared", "experts")), sched).report()
    assert all(b.saved_peak < a.saved_peak for a, b in zip(off.ranks, sent.ranks))
    assert all(b.saved_host_peak > 0 and a.saved_host_peak == 0 for a, b in zip(off.ranks, sent.ranks))


def test_the_host_link_is_priced_against_the_compute_it_hides_behind():
    x, sched = _setup("schedule.name=1f1b")
    fast = published("h800", x.shape)
    sent = x.replace(offload=("attention", "dense", "shared", "experts"))
    base = TimeModel(x, fast, sched).predict()
    hidden = TimeModel(sent, fast, sched).predict()
    assert hidden.host_copy_s > 0 and hidden.host_copy_exposed_s == 0 and hidden.step_s == base.step_s
    slow = Profile.from_dict({**fast.to_dict(), "host_link": {"h2d": {"fixed": 0.0, "per_unit": 1e-6}, "d2h": {"fixed": 0.0, "per_unit": 1e-6}}})
    shown = TimeModel(sent, slow, sched).predict()
    assert shown.host_copy_exposed_s > 0 and shown.step_s > base.step_s
    inline = Profile.from_dict({**fast.to_dict(), "host_overlap": False})
    assert TimeModel(sent, inline, sched).predict().host_copy_exposed_s == pytest.approx(hidden.host_copy_s)
    trips = TimeModel(x.replace(optimizer_offload="swap"), slow, sched).predict()
    assert trips.optimizer_copy_exposed_s > 0 and trips.post_s > base.post_s


def test_profiles_carry_the_host_link_and_the_h800s_is_the_published_pcie_gen5():
    x, _ = _setup()
    h800 = published("h800", x.shape)
    assert h800.host_overlap and h800.host_link["h2d"].per_unit == pytest.approx(1 / (0.8 * 64e9))
    assert Profile.from_dict(h800.to_dict()).host_link == h800.host_link
    with pytest.raises(ProfileError, match="host_link has up; known: h2d, d2h"):
        Profile.from_dict({**h800.to_dict(), "host_link": {"up": {"fixed": 0.0, "per_unit": 1e-9}}})


def test_the_plan_offloads_only_where_nothing_else_fits():
    c = load_config(CPU, ["train.grad_bucket_mb=0.01"])  # small buckets: the step's transients below the states
    x = Setup.from_config(c)
    assert offload_levels(x) == [
        {"optimizer_offload": "swap", "offload_fraction": 1.0, "offload": (), "offload_layers": None},
        {"optimizer_offload": "swap", "offload_fraction": 1.0, "offload": ("attention", "dense", "shared", "experts"), "offload_layers": None}]
    assert offload_levels(x.replace(zero_memory="level1"))[1]["offload"] == ("attention", "dense")
    prof = published("h800", x.shape)
    loose = plan(c, 2, None, prof, allow=("offload",))
    assert all(r.setup.optimizer_offload == "off" and not r.setup.offload for r in loose.ranked)  # no budget: nothing to fit
    # a byte below the least any setup needs without host memory, its optimizer sharded as far as it goes
    ctx = _context(c, prof, None, ())
    peaks = [got.memory.peak for y in enumerate_setups(x, 2)
             if (got := evaluate(y.replace(zero_stage=2 if y.replicas > 1 else 0), None, ctx, search_zero=False, timed=False)).kept]
    least = min(peaks)
    assert plan(c, 2, least - 1, prof).ranked == []
    tight = plan(c, 2, least - 1, prof, allow=("offload",))
    assert tight.ranked and all(r.setup.optimizer_offload == "swap" for r in tight.ranked)
    assert all(r.memory.peak <= least - 1 for r in tight.ranked)
    from portapipe.plan.report import fullest, fullest_line

    best = tight.ranked[0]
    assert fullest(best)["optimizer_host"] > 0 and "; in host memory: master weights and moments " in fullest_line(best)


def test_the_fewest_devices_are_found_by_bisection_over_the_counts_with_a_layout():
    c = load_config(CPU, ["parallel.ep=1", "parallel.pp=2", "parallel.dp=2"])
    x = Setup.from_config(c)
    assert device_counts(x, 8) == list(range(1, 9))  # pp alone makes a layout of any count
    assert device_counts(x.replace(model=x.model.model_copy(update={"n_experts": 6, "top_k": 2})), 4) == [1, 2, 3, 4]
    prof = published("h800", x.shape)
    ctx = _context(c, prof, None, ())
    least = {n: min((got.memory.peak for y in enumerate_setups(x, n) if (got := evaluate(y, None, ctx, search_zero=False, timed=False)).kept),
                    default=float("inf")) for n in range(1, 9)}
    finite = sorted(v for v in least.values() if v < float("inf"))
    budget = finite[len(finite) // 2]  # some counts fit, some do not
    tried: list[tuple[int, bool]] = []
    got = fewest_devices(c, budget, prof, most=8, progress=lambda n, ok: tried.append((n, ok)))
    assert got is not None and fits(c, got, budget, prof) and (got == 1 or not fits(c, got - 1, budget, prof))
    assert tried[0] == (8, True) and len(tried) <= 4  # the most first, then halving
    assert fewest_devices(c, 1.0, prof, most=8) is None


def test_portapipe_profile_times_the_host_link_through_the_backends_copies():
    from portapipe.backends.cpu import CPUBackend
    from portapipe.plan.measure_host import SIZES, host_link

    link = host_link(CPUBackend(), reps=1)
    assert set(link) == {"h2d", "d2h"}
    assert all(cost(SIZES[-1]) > cost(SIZES[0]) > 0 for cost in link.values())  # more bytes, more time
