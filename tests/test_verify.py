"""`portapipe verify`: every schedule at pp 2 and 4, EP 1 and 2, overlap and W split on, is exact.

Each launch of ranks runs several configurations in sequence (start-up is paid once per world
size). The claim checked is the README's: a pipelined float64 step has the same loss as one
process, bit for bit, and gradients equal to 1e-12 relative.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from portapipe import cli
from portapipe.config import Config, load_config
from portapipe.launch import LaunchError
from portapipe.verify import (
    EXACT,
    FLOAT32_UNIT_ROUNDOFF,
    VerifyReport,
    compare,
    float32_tolerance,
    float64,
    in_dtype,
    precision_for,
    reference,
    verify_many,
)

SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


def _config(
    name: str, pp: int, ep: int = 1, dp: int = 1, overlap: bool = True, w_split: bool = True, pair_forwards: bool = False,
    memory: dict[str, Any] | None = None, **model: Any,
) -> Config:
    n_layers = 8 if pp == 4 else 4
    mb = 2 * pp if name in ("dualpipe", "dualpipev") else pp
    return load_config(
        {
            "backend": "cpu",
            "parallel": {"pp": pp, "ep": ep, "dp": dp},
            "schedule": {"name": name, "microbatches": mb, "overlap": overlap, "w_split": w_split, "pair_forwards": pair_forwards},
            "memory": memory or {},
            "model": {
                "vocab_size": 32, "hidden": 16, "n_layers": n_layers, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32,
                "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 8, "n_groups": 2, "topk_groups": 1, **model,
            },
            "train": {"micro_batch_size": 2, "seed": 5},
        }
    )


def _check(reports: list[VerifyReport]) -> None:
    bad = [(r.schedule, r.pp, r.ep, r.dp, r.overlap, r.w_split, r.loss_diff, r.max_rel_grad_diff, r.worst_param) for r in reports if not r.ok]
    assert not bad, bad
    for r in reports:
        assert r.loss_diff == 0.0 and r.max_rel_grad_diff <= 1e-12 and r.max_bias_diff == 0.0


@pytest.mark.multiproc
def test_every_schedule_is_exact_on_two_pipeline_ranks() -> None:
    configs = [_config(name, 2) for name in SCHEDULES]
    configs += [_config("dualpipev", 2, overlap=False), _config("interleaved", 2, w_split=False)]
    _check(verify_many(configs))


@pytest.mark.multiproc
def test_every_schedule_is_exact_with_expert_parallelism_and_on_four_pipeline_ranks() -> None:
    configs = [_config(name, 2, ep=2) for name in SCHEDULES]
    configs += [_config(name, 4) for name in SCHEDULES]
    configs += [_config("dualpipe", 2, ep=2, overlap=False, w_split=False), _config("dualpipev", 2, dp=2, n_shared=0)]
    reports = verify_many(configs)
    _check(reports)
    # With EP, the F&B pairs' all-to-alls really ran inside the overlapped pairs.
    ep_dualpipev = reports[SCHEDULES.index("dualpipev")]
    assert all(t["fb_a2a_total_s"] > 0 for t in ep_dualpipev.timings)
    assert all(t["a2a_total_s"] >= t["a2a_wait_s"] >= 0 for t in ep_dualpipev.timings)


@pytest.mark.multiproc
def test_paired_forwards_are_exact_with_every_schedule_and_memory_option() -> None:
    from portapipe.scheduling.executor import build_schedule

    configs = [_config(name, 2, ep=2, pair_forwards=True) for name in SCHEDULES]
    configs += [_config("dualpipev", 2, ep=2, pair_forwards=True, memory=m) for m in ({"zero_memory": "level1"}, {"recompute": "full"}, {"recompute": "moe"})]
    for c in configs:  # each runs F&F pairs
        assert any(a.pair is not None and not a.fb_pair for acts in build_schedule(c).actions for a in acts), c.schedule.name
    reports = verify_many(configs)
    _check(reports)
    # 1F1B has no F&B pair: its F&F pairs' exchanges are the edges'
    one_f_one_b = reports[SCHEDULES.index("1f1b")]
    assert all(t["fb_a2a_total_s"] == 0.0 and t["a2a_total_s"] > 0 for t in one_f_one_b.timings)


def _self_report(config: Config) -> tuple[Config, list[dict[str, Any]]]:
    config = float64(config)
    loss, grads, biases = reference(config)
    ranks = [{"ep_rank": 0, "loss": loss, "grads": {n: g.clone() for n, g in grads.items()}, "experts": [], "biases": biases, "timings": {}}]
    return config, ranks


def test_compare_detects_a_wrong_gradient_and_a_wrong_loss() -> None:
    config, ranks = _self_report(_config("1f1b", 1))
    good = compare(config, ranks)
    assert good.ok and good.loss_diff == 0.0 and good.max_rel_grad_diff == 0.0
    name = "layers.2.moe.experts.down"
    ranks[0]["grads"][name] = ranks[0]["grads"][name] * (1 + 1e-9)
    bad = compare(config, ranks)
    assert not bad.ok and bad.worst_param == name and 1e-10 < bad.max_rel_grad_diff < 1e-8
    config, ranks = _self_report(_config("1f1b", 1))
    ranks[0]["loss"] = float(torch.nextafter(torch.tensor(ranks[0]["loss"], dtype=torch.float64), torch.tensor(10.0, dtype=torch.float64)))
    assert not compare(config, ranks).ok


def test_the_precision_follows_the_backends_declaration() -> None:
    """float64 where the backend computes, reduces and moves it as the CPU does; float32 (with its
    tolerance) elsewhere: a GPU's float64 kernels sum in their own order, not the CPU reference's."""
    cfg = _config("1f1b", 2)
    assert precision_for(cfg) is EXACT
    cuda = precision_for(in_dtype(cfg, "float32", backend="cuda"))
    assert cuda.precision == "float32" and cuda == float32_tolerance(cfg)
    npu = precision_for(in_dtype(cfg, "float32", backend="npu"))  # HCCL reduces no float64, the matmul takes none
    assert npu.precision == "float32" and npu == float32_tolerance(cfg)


def test_the_float32_tolerance_is_derived_from_rounding_and_depth() -> None:
    cfg = _config("1f1b", 2)  # hidden 16, ffn 32, seq 8, vocab 32, 2 x 8 tokens per micro-batch, 4 layers
    tol = float32_tolerance(cfg)
    u = FLOAT32_UNIT_ROUNDOFF
    assert tol.loss == pytest.approx(4 * u * 32**0.5 * 5) and tol.grad == 2 * tol.loss
    deeper = float32_tolerance(load_config({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "n_layers": 8}}))
    assert deeper.loss == pytest.approx(tol.loss * 9 / 5)  # grows with depth
    assert "k = 32" in tol.basis and "n_layers + 1 = 5" in tol.basis


def test_a_float32_step_meets_its_tolerance_against_the_float64_reference_and_a_wrong_one_fails() -> None:
    """The single-process step in float32 (what a float32 device computes) against the float64
    reference: within the derived tolerance, not equal, and a gradient off by 1e-4 is caught."""
    cfg = _config("1f1b", 1)
    loss, grads, biases = reference(in_dtype(cfg, "float32"))
    ranks = [{"ep_rank": 0, "loss": loss, "grads": grads, "experts": [], "biases": biases, "timings": {}}]
    tol = float32_tolerance(cfg)
    got = compare(float64(cfg), ranks, tol)
    assert got.ok and got.precision == "float32", got.summary()
    assert 0 < got.max_rel_grad_diff < tol.grad / 10 and got.loss_diff < tol.loss * abs(got.ref_loss) / 10
    name = "layers.2.moe.experts.down"
    ranks[0]["grads"] = {**grads, name: grads[name] * (1 + 1e-4)}
    bad = compare(float64(cfg), ranks, tol)
    assert not bad.ok and bad.worst_param == name


def _write(tmp_path: Path, config: Config) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return str(path)


@pytest.mark.multiproc
def test_cli_prints_the_json_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _config("zb1p", 2))
    assert cli.main(["verify", path, "--set", "schedule.microbatches=3"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(out) == ["schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok", "precision", "tolerance"]
    assert out["schedule"] == "zb1p" and out["microbatches"] == 3 and out["ok"] is True and out["loss_diff"] == 0.0
    assert out["precision"] == "float64" and out["tolerance"]["loss"] == 0.0  # cpu declares float64 throughout


def test_cli_config_errors_exit_2_before_ranks_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _config("dualpipev", 2))
    assert cli.main(["verify", path, "--set", "schedule.microbatches=3"]) == 2
    assert "schedule.microbatches: 3 < 2*pp = 4" in capsys.readouterr().err
    assert cli.main(["verify", path, "--set", "model.n_layers=3"]) == 2
    assert "model.n_layers: 3" in capsys.readouterr().err


def test_cli_a_failing_rank_exits_1_with_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import portapipe.verify

    def fail(config: Config) -> dict[str, Any]:
        raise LaunchError("rank 1 failed:\nTraceback ...\nValueError: boom", rank=1, traceback="ValueError: boom")

    monkeypatch.setattr(portapipe.verify, "verify", fail)
    assert cli.main(["verify", _write(tmp_path, _config("1f1b", 2))]) == 1
    assert "ValueError: boom" in capsys.readouterr().err
