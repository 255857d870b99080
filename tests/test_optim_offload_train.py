"""``train.optimizer_offload: swap`` through training on two gloo ranks: the same run as without it,
bit for bit, with ZeRO 1 and 2, bfloat16 moments, the host EMA, an EPLB migration (the moving
experts' states are host memory) and a refill of out-of-date replicas (from host memory too);
checkpoints hold the same tensors, and a resume crosses offload on / off bit for bit on its layout
and continues on another.

float32 compute with float64 master weights: the master weights are the optimizer's own tensor,
so they travel with both moments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.config import config_from_dict
from tests.test_checkpoint_run import raw as run_config
from tests.test_checkpoint_run import same_steps
from tests.test_checkpoint_tried import copy_run, losses, retarget, step_dir, train
from tests.test_ema import _saved

STEPS = 4


def _config(root: Path, name: str, **sets: Any) -> dict[str, Any]:
    config = run_config(root / name, steps=STEPS, pp=1, parallel__dp=2, schedule__microbatches=1, model__dtype="float32",
                        train__master_dtype="float64", train__grad_bucket_mb=0.002, checkpoint__every=2, checkpoint__keep=4)
    for key, value in sets.items():
        section, _, field = key.partition("__")
        config[section][field] = value
    return config_from_dict(config).to_dict()


RUNS = {
    "zero1": {"train__zero_stage": 1, "train__ema_decay": 0.7},
    "zero1-swap": {"train__zero_stage": 1, "train__ema_decay": 0.7, "train__optimizer_offload": "swap"},
    "zero2-bf16": {"train__zero_stage": 2, "train__moments_dtype": "bfloat16"},
    "zero2-bf16-swap-half": {"train__zero_stage": 2, "train__moments_dtype": "bfloat16", "train__optimizer_offload": "swap",
                             "train__optimizer_offload_fraction": 0.5},
    # EPLB on ep 2 (zero_stage 0: a migration moves whole rows of state), a rebalance after steps 2 and 4;
    # the replicas' on / off switch is forced (_train_forced), never left to measured times
    "eplb": {"parallel__dp": 1, "parallel__ep": 2, "balancer": {"kind": "eplb", "interval": 2, "window": 2, "redundant": 1}},
    "eplb-swap": {"parallel__dp": 1, "parallel__ep": 2, "balancer": {"kind": "eplb", "interval": 2, "window": 2, "redundant": 1},
                  "train__optimizer_offload": "swap"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("offload")
    configs = {}
    for name, sets in RUNS.items():
        sets = dict(sets)
        balancer = sets.pop("balancer", None)
        config = _config(root, name, **sets)
        if balancer is not None:
            config["balancer"].update(balancer)
        configs[name] = config_from_dict(config).to_dict()
    got = run_ranks(_train_forced, 2, list(configs.values()), wall_timeout_s=400)[0]
    return {name: {"config": configs[name], "dir": Path(configs[name]["log"]["dir"]), "rows": g["rows"]} for name, g in zip(configs, got)}


def _train_forced(backend: Any, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train_runs`` with the EPLB replicas off for steps 2 and 3 and on again from step 4 (refilled
    after step 3). Left to itself the switch decides from measured times, and a replicated expert's
    gradient summed over its replicas rounds otherwise than one computed on one slot: two runs would
    agree bit for bit only when the machine's timings happened to decide alike."""
    from tests.test_optim_reference import train_runs
    from tests.test_replica_switch import force_replicas_off_for_steps_2_and_3

    force_replicas_off_for_steps_2_and_3()
    return train_runs(backend, raws)


def _train(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["kind"] == "train"]


def _checkpoint(run: dict[str, Any], step: int) -> dict[str, torch.Tensor]:
    ckpt = step_dir(run["dir"], step)
    return {f"{prefix}.{k}": v for prefix in ("model", "master", "ema", "optim") for k, v in _saved(ckpt, prefix).items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("kept, swapped", [("zero1", "zero1-swap"), ("zero2-bf16", "zero2-bf16-swap-half"), ("eplb", "eplb-swap")])
def test_swapped_optimizer_states_train_and_save_bit_for_bit_as_kept_ones(runs, kept, swapped):
    a, b = runs[kept], runs[swapped]
    same_steps(_train(a["rows"]), _train(b["rows"]))
    assert _train(a["rows"])[-1]["loss"] < _train(a["rows"])[0]["loss"]
    if kept == "eplb":  # the balancer moved experts, and their states with them; it refilled the replicas
        assert any(r["balancer"].get("rebalance", {}).get("rows_moved", 0) for r in _train(b["rows"]))
        assert [r["balancer"]["replicas_used"] for r in _train(b["rows"])] == [True, False, False, True]
        assert [bool(r["balancer"].get("replicas_refreshed_rows")) for r in _train(b["rows"])] == [False, False, True, False]
    for step in (2, 4):
        mine, theirs = _checkpoint(a, step), _checkpoint(b, step)
        assert sorted(mine) == sorted(theirs) and any(k.startswith("master.") for k in mine)
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), (step, k)


@pytest.mark.multiproc
def test_the_memory_row_tells_the_optimizers_device_bytes_from_its_host_bytes(runs):
    kept = next(r for r in runs["zero1"]["rows"] if r["kind"] == "memory")
    swapped = next(r for r in runs["zero1-swap"]["rows"] if r["kind"] == "memory")
    half = next(r for r in runs["zero2-bf16-swap-half"]["rows"] if r["kind"] == "memory")
    assert (swapped["master"], swapped["optimizer"]) == (0, 0)
    assert (swapped["master_host"], swapped["optimizer_host"]) == (kept["master"], kept["optimizer"])
    assert 0 < swapped["optimizer_slots"] < swapped["master_host"] + swapped["optimizer_host"]
    assert "master_host" not in kept
    whole = half["master"] + half["master_host"] + half["optimizer"] + half["optimizer_host"]
    assert 0.5 <= (half["master_host"] + half["optimizer_host"]) / whole < 1.0


@pytest.mark.multiproc
@pytest.mark.parametrize("source, sets, exact", [
    ("zero1-swap", ("train.optimizer_offload=off",), True),
    ("zero1", ("train.optimizer_offload=swap",), True),
    ("zero1-swap", ("parallel.dp=1", "parallel.pp=2", "schedule.microbatches=2", "train.zero_stage=0"), False),
], ids=["swap-to-kept", "kept-to-swap", "swap-to-pp2-zero0-swap"])
def test_a_resume_crosses_offload_on_and_off(runs, tmp_path, capsys, source, sets, exact):
    src = runs[source]
    run = copy_run(src["dir"], tmp_path / "run", drop_after=2)
    code, lines, summary = train(capsys, retarget(src["config"], run), *[a for s in sets for a in ("--set", s)])
    assert code == 0 and summary is not None and summary["resumed_from"] == 2, lines
    got, want = losses(run), {r["step"]: r["loss"] for r in _train(src["rows"])}
    if exact:
        assert [got[s] for s in (3, 4)] == [want[s] for s in (3, 4)]
    else:
        assert max(abs(got[s] - want[s]) for s in (3, 4)) <= 1e-5, (got, want)
