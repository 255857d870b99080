"""The planner: every candidate keeps the global batch and fills the devices; what breaks a rule
or the budget is dropped with its reason; the rest is ranked by predicted step time, and the
bound that skips simulations never changes the top of the table."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from portapipe.config import load_config
from portapipe.plan.planner import _Context, enumerate_setups, evaluate, microbatch_counts, plan
from portapipe.plan.published import published
from portapipe.plan.report import best_yaml, parse_bytes, row
from portapipe.config.rules import broken
from portapipe.config.setup import Setup
from portapipe.plan.shape import Shape

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load_config(EXAMPLE)


@pytest.fixture(scope="module")
def prof(cfg):
    return published("h800", Shape.of(cfg.model))


def test_candidates_fill_the_devices_and_keep_the_global_batch(cfg) -> None:
    user = Setup.from_config(cfg)
    setups = list(enumerate_setups(user, 8))
    assert setups and all(x.devices == 8 and x.global_batch == user.global_batch for x in setups)
    assert {x.schedule for x in setups} == {"1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"}
    assert {x.memory_label() for x in setups} >= {"off", "level0", "level1", "recompute moe", "recompute full", "recompute full x1 + level1"}
    assert all(cfg.model.n_experts % x.ep == 0 for x in setups)


def test_forwards_in_pairs_are_a_candidate_wherever_pairs_form(cfg, prof) -> None:
    setups = list(enumerate_setups(Setup.from_config(cfg), 4))
    paired = [x for x in setups if x.pair_forwards]
    assert paired and all(x.paired_blocks for x in paired)
    plain = set(x for x in setups if not x.pair_forwards)
    assert all(x.replace(pair_forwards=False) in plain for x in paired)  # each beside its twin
    assert all(x.replace(pair_forwards=True) in set(paired) for x in plain if x.replace(pair_forwards=True).paired_blocks)
    assert not any(x.ep == 1 for x in paired)  # nothing exchanges at ep 1
    result = plan(cfg, 4, None, prof, keep=10_000)
    twins = {}
    for c in result.ranked:
        twins.setdefault(c.setup.replace(pair_forwards=False), []).append(c)
    both = [cs for cs in twins.values() if len(cs) == 2]
    assert both and all(row(c)["schedule"].endswith(" ff") == c.setup.pair_forwards for cs in both for c in cs)
    assert all(cs[0].time.step_s != cs[1].time.step_s for cs in both)  # priced apart: the pairs change the time
    # the table says "ff" only where forwards pair: asked for at ep 1 nothing exchanges
    from portapipe.plan.planner import Candidate

    asked = Setup.from_config(load_config(EXAMPLE, ["schedule.pair_forwards=true", "parallel.ep=1", "parallel.dp=2"]))
    assert not row(Candidate(asked))["schedule"].endswith("ff") and row(Candidate(paired[0]))["schedule"].endswith(" ff")
    # the planner drops the twin of a dropped setup unevaluated: pairs change no peak of the memory model
    ctx = _Context(prof, lambda ep: 1.0)
    for x in paired:
        a, b = evaluate(x.replace(pair_forwards=False), 8 * 2**20, ctx), evaluate(x, 8 * 2**20, ctx)
        if a.memory is not None and b.memory is not None:
            assert a.memory.peak == b.memory.peak and a.kept == b.kept
    # where no two forwards stand in a row (1F1B and ZB1P on one rank: F BW F BW ...) the twin
    # asking for pairs is dropped
    assert result.dropped.get("schedule.pair_forwards", 0) > 0
    assert not any(c.setup.pair_forwards and c.setup.pp == 1 and c.setup.schedule in ("1f1b", "zb1p") for c in result.ranked)


def test_microbatch_counts_double_from_the_least_and_keep_the_users() -> None:
    assert microbatch_counts(32, 2) == [2, 4, 8, 16, 32]
    assert microbatch_counts(24, 4) == [4, 8, 24]
    assert microbatch_counts(24, 4, also=6) == [4, 6, 8, 24]
    assert microbatch_counts(6, 8) == []


def test_the_plan_ranks_what_fits_and_drops_the_rest_with_reasons(cfg, prof) -> None:
    budget = 8 * 2**20
    result = plan(cfg, 4, budget, prof, keep=5)
    assert result.ranked
    times = [c.time.step_s for c in result.ranked]
    assert times == sorted(times)
    for c in result.ranked:
        assert c.kept and c.memory.peak <= budget and not broken(c.setup, ("layout", "schedule", "memory", "balancer"))
    assert sum(result.dropped.values()) + len(result.ranked) + result.not_timed == result.considered
    assert any(reason == "memory" for reason in result.dropped)
    assert any(reason.startswith(("schedule", "model", "parallel")) for reason in result.dropped)
    assert result.user.setup == Setup.from_config(cfg)


def test_the_bound_never_changes_the_top_of_the_table(cfg, prof) -> None:
    few = plan(cfg, 4, None, prof, keep=3)
    every = plan(cfg, 4, None, prof, keep=10_000)
    assert every.not_timed == 0 and few.not_timed > 0
    assert [c.setup for c in few.ranked[:3]] == [c.setup for c in every.ranked[:3]]


def test_the_users_own_config_is_judged_even_when_it_does_not_fit(cfg, prof) -> None:
    result = plan(cfg, 4, 1 * 2**20, prof, keep=3)
    assert result.user.problems and result.user.problems[0].startswith("memory:")
    bad = load_config(EXAMPLE, ["parallel.pp=1", "parallel.ep=2", "parallel.dp=1", "schedule.name=1f1b"])
    other = plan(bad, 4, None, prof, keep=3)  # its 2 devices are not the 4 planned for
    assert other.user.setup.devices == 2 and other.user.time is not None


def test_the_users_own_config_over_the_budget_names_its_fullest_rank(prof) -> None:
    """A setup the planner makes stops at its first rank over the budget; the user's own is seen
    whole: with the prediction modules on the last stage, rank 1 holds more than rank 0, both over."""
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.scheduling.executor import build_schedule

    cfg = load_config(EXAMPLE, ["schedule.name=1f1b", "model.mtp_layers=3"])
    every = MemoryModel(Setup.from_config(cfg), build_schedule(cfg)).report()
    budget = (max(r.static for r in every.ranks) + min(r.total for r in every.ranks)) / 2  # the states fit, no rank does
    assert every.worst_rank == 1 and min(r.total for r in every.ranks) > budget
    user = plan(cfg, 4, budget, prof, keep=3).user
    assert user.memory.over == 1 and user.memory.over_total == every.ranks[1].total
    assert user.problems[0].startswith("memory: pipeline rank 1 needs ")


def test_the_best_is_written_as_a_complete_config_that_loads_back(cfg, prof, tmp_path: Path) -> None:
    result = plan(cfg, 4, None, prof, keep=3)
    best = result.ranked[0]
    path = tmp_path / "best.yaml"
    path.write_text(best_yaml(result, best))
    loaded = load_config(path)
    assert loaded == result.config_of(best)
    assert Setup.from_config(loaded) == best.setup
    assert yaml.safe_load(path.read_text())["model"] == cfg.to_dict()["model"]


@pytest.mark.parametrize("text, value", [("80GiB", 80 * 2**30), ("80 GB", 80e9), ("512MiB", 512 * 2**20), ("1e9", 1e9), ("2tib", 2 * 2**40)])
def test_memory_sizes(text: str, value: float) -> None:
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["80XB", "-1GiB", "GiB", "0", "inf"])
def test_bad_memory_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="--memory"):
        parse_bytes(text)
