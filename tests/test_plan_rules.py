"""The compatibility rules live in one table: config validation reports exactly its error
lines, every rule has a reason, notes never reject a config, and the planner drops by them."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from portapipe.config import ConfigError, load_config
from portapipe.config.load import _cross_checks
from portapipe.config import rules
from portapipe.config.setup import Setup

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


def test_every_rule_has_a_name_scope_reason_and_severity() -> None:
    names = [r.name for r in rules.RULES]
    assert len(names) == len(set(names))
    for row in rules.table():
        assert row["reason"] and row["scope"] in ("layout", "schedule", "model", "memory", "balancer", "backend", "train")
        assert row["severity"] in ("error", "note")


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["schedule.name=dualpipe", "parallel.pp=3", "parallel.ep=1", "schedule.microbatches=5"],
        ["schedule.name=interleaved", "schedule.microbatches=5", "schedule.chunks=1"],
        ["model.n_dense=4", "memory.zero_memory=level0", "memory.recompute=moe"],
        ["balancer.kind=lplb", "parallel.ep=2", "balancer.topology=cube"],
        ["backend_options.ep_transport=nvshmem"],
    ],
)
def test_config_validation_reports_the_tables_error_lines(overrides: list[str]) -> None:
    """load_config's problems are the rule table's error lines for the config, in table order."""
    raw = load_config(EXAMPLE).to_dict()
    from portapipe.config import Config, apply_overrides

    cfg = Config.model_validate(apply_overrides(raw, overrides))  # pydantic only: no cross checks yet
    want = rules.violations(Setup.from_config(cfg))
    assert _cross_checks(cfg) == want
    if want:
        with pytest.raises(ConfigError) as info:
            load_config(EXAMPLE, overrides)
        assert info.value.problems == want
    else:
        load_config(EXAMPLE, overrides)


def test_nvshmem_is_refused_before_any_rank_starts_on_cpu_and_npu() -> None:
    """The rule reads each backend's declared transports; its line is the one the backend itself raises."""
    from portapipe.backends.ascend import AscendBackend
    from portapipe.backends.cpu import CPUBackend

    for name, cls in (("cpu", CPUBackend), ("npu", AscendBackend)):
        with pytest.raises(ConfigError) as info:
            load_config(EXAMPLE, [f"backend={name}", "backend_options.ep_transport=nvshmem"])
        with pytest.raises(ValueError) as raised:
            cls({"ep_transport": "nvshmem"})
        assert info.value.problems == [str(raised.value)] == [
            f"backend_options.ep_transport: 'nvshmem' is not a transport of backend {name!r} (its transports: alltoall); "
            "use alltoall, which every backend has"
        ]
    load_config(EXAMPLE, ["backend=cuda", "backend_options.ep_transport=nvshmem"])  # a config, not a device check
    load_config(EXAMPLE, ["backend=auto", "backend_options.ep_transport=nvshmem"])  # auto may find a GPU
    with pytest.raises(ConfigError, match="'shmem' is not a transport of backend 'cpu'"):
        load_config(EXAMPLE, ["backend=auto", "backend_options.ep_transport=shmem"])  # no backend offers it


def test_a_model_dtype_the_backend_does_not_compute_in_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(EXAMPLE, ["backend=npu", "model.dtype=float64"])
    assert info.value.problems == ["model.dtype: float64 is not computed by backend 'npu' (it computes in float32, bfloat16, float16)"]
    for backend in ("cpu", "cuda", "auto"):
        load_config(EXAMPLE, [f"backend={backend}", "model.dtype=float64"])


def test_notes_never_reject_a_config_but_say_what_is_wasted() -> None:
    cfg = load_config(EXAMPLE, ["schedule.name=1f1b", "memory.zero_memory=level0"])  # loads
    notes = rules.violations(Setup.from_config(cfg), severity="note")
    assert any(n.startswith("schedule.overlap:") and "no F&B pairs" in n for n in notes)
    assert any(n.startswith("memory:") and "run exposed" in n for n in notes)
    assert rules.violations(Setup.from_config(load_config(EXAMPLE)), severity="note") == []


def _notes(key: str, *overrides: str) -> list[str]:
    """The notes on examples/cpu.yaml with ``overrides`` that name ``key``."""
    x = Setup.from_config(load_config(EXAMPLE, list(overrides)))
    return [n for n in rules.violations(x, severity="note") if n.startswith(f"{key}:")]


def test_zero_stage_with_one_replica_per_weight_is_a_note() -> None:
    notes = functools.partial(_notes, "train.zero_stage")

    for stage in (1, 2):
        assert notes(f"train.zero_stage={stage}", "parallel.ep=1") == [
            f"train.zero_stage: {stage} shards over each weight's replicas, and with dp = ep = 1 every weight has one: nothing is sharded"
        ]
        # the shared weights have a replica on each EP rank, every weight one on each DP rank
        assert notes(f"train.zero_stage={stage}") == notes(f"train.zero_stage={stage}", "parallel.ep=1", "parallel.dp=2") == []
    assert notes("parallel.ep=1") == []


def test_eplb_on_one_ep_rank_is_a_note() -> None:
    notes = functools.partial(_notes, "balancer.kind")

    line = "balancer.kind: eplb with ep = 1 keeps every expert on the one EP rank: there is no load between ranks to balance"
    assert notes("balancer.kind=eplb", "parallel.ep=1") == notes("balancer.kind=eplb", "parallel.ep=1", "balancer.policy=global") == [line]
    assert notes("balancer.kind=eplb") == notes("parallel.ep=1") == []


def test_pair_forwards_names_the_blocks_that_exchange_and_says_when_none_does() -> None:
    on = ["schedule.pair_forwards=true", "schedule.name=interleaved", "model.n_layers=4", "model.n_dense=1"]
    x = Setup.from_config(load_config(EXAMPLE, on))
    assert x.paired_blocks == [1, 2, 3]  # four blocks of one layer each; layer 0 is dense
    assert Setup.from_config(load_config(EXAMPLE, [*on, "model.n_dense=2"])).paired_blocks == [2, 3]
    assert rules.violations(x, severity="note") == []
    for off, why in (("parallel.ep=1", "no block's forward exchanges rows"), ("schedule.overlap=false", "schedule.overlap is false")):
        y = Setup.from_config(load_config(EXAMPLE, [*on, off]))
        assert y.paired_blocks == []
        assert any(n.startswith("schedule.pair_forwards:") and why in n for n in rules.violations(y, severity="note"))
    assert Setup.from_config(load_config(EXAMPLE, on[1:])).paired_blocks == []  # the option off


def test_broken_names_the_rule_and_its_lines() -> None:
    x = Setup.from_config(load_config(EXAMPLE)).replace(schedule="dualpipe", pp=3, microbatches=5)
    got = {rule.name: lines for rule, lines in rules.broken(x)}
    assert set(got) == {"dualpipe-even-pp", "dualpipe-family-microbatches", "dualpipe-even-microbatches"}
    assert got["dualpipe-even-pp"] == ["parallel.pp: 3 is odd; schedule dualpipe needs an even number of pipeline ranks"]
    assert rules.broken(x, scopes=("memory",)) == []
