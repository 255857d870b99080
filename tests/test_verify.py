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
from portapipe.config import Config, ConfigError, load_config
from portapipe.ranks.launch import LaunchError
from portapipe.verify import run_steps, verify_many
from portapipe.verify.compare import compare
from portapipe.verify.recipe import recipe_step
from portapipe.verify.reference import reference
from portapipe.verify.report import VerifyReport
from portapipe.verify.tolerance import EXACT, FLOAT32_UNIT_ROUNDOFF, PRECISIONS, checked, float32_tolerance, float64, in_dtype, precision_for, rounding_tolerance

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
    assert "k = 32" in tol.basis and "n_layers + mtp_layers + 1 = 5" in tol.basis
    # each multi-token prediction module is one more layer on the deepest prediction's path
    mtp = float32_tolerance(load_config({**cfg.to_dict(), "model": {**cfg.to_dict()["model"], "mtp_layers": 2}}))
    assert mtp.loss == pytest.approx(tol.loss * 7 / 5) and mtp.grad == 2 * mtp.loss and "n_layers + mtp_layers + 1 = 7" in mtp.basis


def test_a_micro_batchs_tokens_count_as_the_longest_sum_where_they_are() -> None:
    """8 sequences of 8 tokens: a weight gradient sums 64 terms, more than any width (hidden 16,
    ffn 32, vocab 32): k is 64, not 32."""
    cfg = _with(_config("1f1b", 2), train__micro_batch_size=8)
    tol = float32_tolerance(cfg)
    assert "k = 64" in tol.basis and tol.loss == pytest.approx(4 * FLOAT32_UNIT_ROUNDOFF * 64**0.5 * 5)


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
    assert list(out) == ["schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok", "precision", "changed",
                         "loss_scale", "tolerance", "batch"]
    assert out["schedule"] == "zb1p" and out["microbatches"] == 3 and out["ok"] is True and out["loss_diff"] == 0.0
    assert out["precision"] == "float64" and out["tolerance"]["loss"] == 0.0  # cpu declares float64 throughout
    assert out["changed"] == {"model.dtype": "float32 -> float64", "train.master_dtype": "float32 -> float64",
                              "train.grad_reduce_dtype": "float32 -> float64"} and out["loss_scale"] is None


def test_cli_config_errors_exit_2_before_ranks_start(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, _config("dualpipev", 2))
    assert cli.main(["verify", path, "--set", "schedule.microbatches=3"]) == 2
    assert "schedule.microbatches: 3 < 2*pp = 4" in capsys.readouterr().err
    assert cli.main(["verify", path, "--set", "model.n_layers=3"]) == 2
    assert "model.n_layers: 3" in capsys.readouterr().err


def test_verify_refuses_fp8_where_nothing_would_run_in_it_with_trainings_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example DeepSeek-V3 has no Linear whose widths are all multiples of 128: training
    refuses train.fp8 on it, and so does verify, with the same line, before any rank starts."""
    import portapipe.verify
    from portapipe.train import check_before_launch

    monkeypatch.setattr(portapipe.verify, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    example = str(Path(__file__).resolve().parents[1] / "examples" / "deepseek_v3.yaml")
    settings = ["--set", "train.fp8=deepseek", "--set", "model.dtype=bfloat16"]
    assert cli.main(["verify", example, *settings]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("portapipe: config error: train.fp8: deepseek, but no Linear of this model"), err
    with pytest.raises(ConfigError) as train_refusal:
        check_before_launch(load_config(example, settings[1::2]))
    assert err[0].removeprefix("portapipe: config error: ") in train_refusal.value.problems


def test_the_batch_verify_checks_is_generated_and_counted() -> None:
    """Every replica's micro-batches: sequences and input tokens, and the documents their inputs
    hold (each restarts the positions at 0, counted here from the micro-batches themselves)."""
    from portapipe.verify.pipelined import generated_batch, microbatches

    plain = _config("1f1b", 2, ep=2, dp=2)
    assert generated_batch(plain) == {"kind": "generated", "sequences": 4 * 2 * 2, "tokens": 16 * 8,
                                      "data": "not read: the shipped corpus (data.format bytes)"}
    docs = _with(plain, data__format="tokens", data__path="no/such/data", data__document_mask=True)
    starts = sum(int((mb[2] == 0).sum()) for r in range(4) for mb in microbatches(docs, r))
    assert starts > 16 and generated_batch(docs) == {"kind": "generated", "sequences": 16, "tokens": 128, "documents": starts,
                                                     "data": "not read: data.path no/such/data"}


@pytest.mark.multiproc
def test_verify_says_the_data_it_did_not_read_would_be_refused_by_training(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A data.path that does not exist: verify checks the pipeline on its generated batch (ok) and
    says in one line that training refuses that data, with training's words."""
    missing = tmp_path / "no-such-data"
    path = _write(tmp_path, _with(_config("1f1b", 2), model__vocab_size=256, data__format="tokens", data__path=str(missing)))
    assert cli.main(["verify", path]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["ok"] is True and out["batch"]["data"] == f"not read: data.path {missing}"
    lines = [line for line in captured.err.splitlines() if "generated batch" in line]
    assert lines == [f"portapipe: verify ran on a generated batch, not on the config's data, which training refuses: data.path: "
                     f"'{missing}' does not exist; name a dataset folder (portapipe tokenize), a Megatron prefix (PREFIX.bin + PREFIX.idx) "
                     "or a token file"]


def test_a_benchmarks_forced_routing_is_refused_in_one_line_before_ranks_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Training applies bench.force_uniform_routing / router_skew_from; verify would check the
    model's router instead and say ok for a routing the run does not do."""
    import portapipe.verify

    monkeypatch.setattr(portapipe.verify, "run_ranks", lambda *a, **k: pytest.fail("ranks started"))
    path = _write(tmp_path, _config("1f1b", 2))
    for setting, words in (("bench.force_uniform_routing=true", "bench.force_uniform_routing: true routes every token round-robin"),
                           ("bench.router_skew_from=loads.txt", "bench.router_skew_from: loads.txt draws each token's experts")):
        for precision in ("highest", "model"):
            assert cli.main(["verify", path, "--set", setting, "--precision", precision]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and words in err[0] and "verify does not check" in err[0], err


def test_cli_a_failing_rank_exits_1_with_its_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import portapipe.verify

    def fail(config: Config, precision: str = "highest") -> dict[str, Any]:
        raise LaunchError("rank 1 failed:\nTraceback ...\nValueError: boom", rank=1, traceback="ValueError: boom")

    monkeypatch.setattr(portapipe.verify, "verify", fail)
    assert cli.main(["verify", _write(tmp_path, _config("1f1b", 2))]) == 1
    assert "ValueError: boom" in capsys.readouterr().err


# ------------------------------------------------------------------ which precision is checked
def _with(config: Config, **keys: Any) -> Config:
    raw = config.to_dict()
    for key, value in keys.items():
        section, _, name = key.partition("__")
        raw[section][name] = value
    return load_config(raw)


def test_a_loss_off_by_ten_times_its_tolerance_fails_as_a_gradient_does() -> None:
    """The loss is judged by its own tolerance (relative to the reference loss), not a looser one."""
    cfg = _config("1f1b", 1)
    loss, grads, biases = reference(in_dtype(cfg, "float32"))
    tol = float32_tolerance(cfg)
    ranks = [{"ep_rank": 0, "loss": loss, "grads": grads, "experts": [], "biases": biases, "timings": {}}]
    good = compare(float64(cfg), ranks, tol)
    assert good.ok
    for factor, ok in ((0.5, True), (10.0, False)):
        off = good.ref_loss * (1 + factor * tol.loss)
        got = compare(float64(cfg), [{**ranks[0], "loss": off}], tol)
        assert got.ok is ok and got.max_rel_grad_diff == good.max_rel_grad_diff, (factor, got.loss_diff, tol.loss)


def test_the_low_precision_tolerance_is_derived_like_float32s_from_each_dtypes_unit_roundoff() -> None:
    """model.dtype's unit roundoff in float32's formula; the sum over the replicas in
    train.grad_reduce_dtype adds 4 u_r sqrt(2R) to the gradients'."""
    cfg = _config("1f1b", 2)  # k = 32, n_layers + 1 = 5
    for dtype, u in (("bfloat16", 2.0**-8), ("float16", 2.0**-11), ("float32", 2.0**-24)):
        tol = rounding_tolerance(_with(cfg, model__dtype=dtype))
        assert tol.precision == dtype and tol.loss == pytest.approx(4 * u * 32**0.5 * 5) and tol.grad == 2 * tol.loss, dtype
        assert f"u = 2^{round(__import__('math').log2(u))}" in tol.basis
    assert rounding_tolerance(_with(cfg, model__dtype="float32")) == float32_tolerance(cfg)
    dp2 = _with(_config("1f1b", 1, dp=2), model__dtype="float32", train__grad_reduce_dtype="bfloat16")
    tol = rounding_tolerance(dp2)
    assert tol.grad == pytest.approx(2 * tol.loss + 4 * 2.0**-8 * 4**0.5) and "R = 2 replicas in bfloat16" in tol.basis


def test_the_highest_precision_names_every_dtype_key_it_changes_and_the_model_precision_none() -> None:
    bf16 = _with(_config("1f1b", 2), model__dtype="bfloat16", train__master_dtype="float32")
    ranks, tol, changed = checked(bf16)
    assert tol is EXACT and ranks.model.dtype == "float64" and ranks.train.master_dtype == "auto"
    assert changed == {"model.dtype": "bfloat16 -> float64", "train.master_dtype": "float32 -> float64", "train.grad_reduce_dtype": "float32 -> float64"}
    reduced = _with(_config("1f1b", 1, dp=2), model__dtype="float64", train__grad_reduce_dtype="float32")
    assert checked(reduced)[2] == {"train.grad_reduce_dtype": "float32 -> float64"}  # no exact check passes a float32 sum
    model = checked(bf16, "model")
    assert model[0] is bf16 and model[2] == {} and model[1].measured and model[1].precision == "bfloat16"
    assert model[1].bias == rounding_tolerance(bf16).bias
    assert checked(reduced, "model")[1].measured
    assert checked(_with(_config("1f1b", 2), model__dtype="float64"), "model")[1] is EXACT
    with pytest.raises(ValueError, match="precision: 'exact' is not one of highest, model"):
        checked(bf16, "exact")


def test_the_cli_offers_the_precisions_verify_takes() -> None:
    from portapipe.commands.verify import PRECISIONS as CLI

    assert CLI == PRECISIONS


@pytest.mark.multiproc
def test_verify_adjusts_the_dtype_keys_it_overrides_and_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bfloat16 with train.master_dtype: float32 set by the user: checked in float64, exactly, and
    the changed keys named, never a refusal of a dtype the user did not write."""
    path = _write(tmp_path, _with(_config("1f1b", 2), model__dtype="bfloat16", train__master_dtype="float32"))
    assert cli.main(["verify", path]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out.strip().splitlines()[-1])
    assert out["ok"] is True and out["precision"] == "float64" and out["loss_diff"] == 0.0
    assert out["changed"] == {"model.dtype": "bfloat16 -> float64", "train.master_dtype": "float32 -> float64",
                              "train.grad_reduce_dtype": "float32 -> float64"}
    assert ("portapipe: verify checked the pipeline in float64, not in the config's dtypes (model.dtype bfloat16 -> float64, "
            "train.master_dtype float32 -> float64, train.grad_reduce_dtype float32 -> float64); --precision model checks those") in captured.err


@pytest.mark.multiproc
def test_a_float32_reduction_of_a_float32_model_is_checked_exactly_in_float64_and_within_its_tolerance_in_its_own() -> None:
    cfg = _with(_config("zb1p", 1, dp=2), model__dtype="float32", train__grad_reduce_dtype="float32")
    highest = verify_many([cfg])[0]
    assert highest.ok and highest.precision == "float64" and highest.max_rel_grad_diff <= 1e-12
    assert highest.changed["train.grad_reduce_dtype"] == "float32 -> float64"
    own = verify_many([cfg], precision="model")[0]
    assert own.ok and own.precision == "float32" and own.changed == {} and own.tolerance.measured, own.summary()
    assert own.loss_diff == 0.0 and own.max_rel_grad_diff <= own.tolerance.grad, own.summary()
    # the float64 distance beside it: float32's rounding, well inside what float32's derivation allows
    assert 0 < own.float64_grad_diff < rounding_tolerance(cfg).grad / 10, own.summary()


@pytest.mark.multiproc
def test_the_model_precision_checks_bfloat16_and_float16_against_the_one_process_step_in_the_same_dtypes() -> None:
    """bfloat16 and float16 (float32 master weights), float16 at training's loss scale 2^16 or
    lower where the step overflows (init_std 0.5: two halvings), a bfloat16 reduction under ZeRO 2:
    the loss bit for bit and the gradients within their measured tolerance of the one-process step
    in the same dtypes; the float64 distance beside it is low precision's own (not zero), with the
    loss scale divided out (2^16 x the loss would be off by 2^16)."""
    configs = [
        _with(_config("1f1b", 2), model__dtype="bfloat16"),
        _with(_config("dualpipev", 2), model__dtype="float16"),
        _with(_config("1f1b", 2), model__dtype="float16", model__init_std=0.5),
        _with(_config("1f1b", 1, dp=2), model__dtype="bfloat16", train__grad_reduce_dtype="bfloat16", train__zero_stage=2),
        _with(_config("dualpipe", 2, mtp_layers=2, tie_word_embeddings=True), model__dtype="bfloat16"),
    ]
    reports = verify_many(configs, precision="model")
    for cfg, r in zip(configs, reports):
        assert r.ok and r.precision == cfg.model.dtype and r.changed == {} and r.tolerance.measured, r.summary()
        assert r.loss_diff == 0.0 and r.loss_terms_diff == 0.0 and r.max_rel_grad_diff <= r.tolerance.grad, r.summary()
        assert 0 < r.float64_grad_diff < 0.1 and r.float64_loss_diff > 0, r.summary()
    assert [r.loss_scale for r in reports] == [None, 2.0**16, 2.0**14, None, None]
    # at least one rounding of the sums: the bfloat16 reduction's over the two replicas (whose order cannot
    # matter: the floor is 0), the others' float32 accumulation
    assert reports[3].tolerance.floor[1] == 0.0 and reports[3].tolerance.grad == 4 * 2.0**-8
    assert all(r.tolerance.grad < 1e-6 for r in reports[:3])
    out = reports[0].summary()
    assert list(out)[-1] == "float64" and set(out["float64"]) == {"loss_diff", "max_rel_grad_diff"}
    assert set(out["tolerance"]["floor"]) == {"loss", "grad"} and "noise floor" in out["tolerance"]["basis"]


@pytest.mark.multiproc
def test_the_model_precision_is_tight_with_expert_tiles_and_with_a_balancers_replicas() -> None:
    """Four EP ranks (each expert's rows from three other ranks: tiles whose weight gradients
    reach the accumulator one by one, as one process's micro-batches do) and EPLB / LPLB replicas
    (a replicated expert's rows split between its slots: the one-process step replays the ranks'
    routes, so each slot's partial gradient rounds as there) in bfloat16: within float32's rounding
    of the one-process step, where bfloat16's rounding of a sum of tiles or of a whole expert's
    rows would show as 2e-3."""
    four = dict(n_experts=8)
    configs = [
        _with(_config("1f1b", 1, ep=4, **four), model__dtype="bfloat16", schedule__microbatches=3),
        _with(_config("1f1b", 1, ep=4, **four), model__dtype="bfloat16", schedule__microbatches=3, balancer__kind="eplb", balancer__redundant=2),
        _with(_config("dualpipev", 2, ep=2), model__dtype="bfloat16", balancer__kind="lplb", balancer__redundant=1, balancer__topology="ring"),
    ]
    for r in verify_many(configs, precision="model"):
        assert r.ok and r.loss_diff == 0.0 and r.max_rel_grad_diff < 1e-6 and r.tolerance.grad < 1e-6, r.summary()


def _recipe_ranks(cfg: Config) -> list[dict[str, Any]]:
    """One rank's report of a one-rank step: the one-process step in the same dtypes itself."""
    loss, grads, biases, terms = recipe_step(cfg)
    return [{"ep_rank": 0, "dp_rank": 0, "loss": loss, "grads": grads, "experts": [], "biases": biases, "timings": {}, "loss_terms": terms}]


def test_the_measured_tolerance_judges_the_loss_and_the_gradients_each_on_their_own() -> None:
    """vocab 512: bfloat16's derived tolerance (8 u sqrt(k) (n_layers + 1) = 3.5) could not fail a
    zero gradient; the measured one is float32's accumulation (nothing reorders on one rank), so an
    expert's gradient 0.97 times what it should be fails, and so does a loss off by ten times its
    own tolerance while every gradient is exact (half of it passes)."""
    cfg = _with(_config("1f1b", 1, vocab_size=512), model__dtype="bfloat16")
    assert rounding_tolerance(cfg).grad > 1
    ranks_cfg, tol, _ = checked(cfg, "model")
    ranks = _recipe_ranks(ranks_cfg)
    good = compare(float64(cfg), ranks, tol, {}, False, ranks_cfg)
    assert good.ok and good.loss_diff == 0.0 and good.max_rel_grad_diff == 0.0 and good.tolerance.measured, good.summary()
    assert good.tolerance.grad == 4 * 2.0**-24 and good.tolerance.loss == 4 * 2.0**-53
    assert good.float64_grad_diff > 1e-3  # bfloat16's own rounding, beside it
    for factor, ok in ((0.5, True), (10.0, False)):
        off = good.ref_loss * (1 + factor * good.tolerance.loss)
        got = compare(float64(cfg), [{**ranks[0], "loss": off}], tol, {}, False, ranks_cfg)
        assert got.ok is ok and got.max_rel_grad_diff == 0.0, (factor, got.loss_diff)
    name = "layers.2.moe.experts.down"
    scaled = ranks[0]["grads"][name].clone()
    scaled[1] *= 0.97
    bad = compare(float64(cfg), [{**ranks[0], "grads": {**ranks[0]["grads"], name: scaled}}], tol, {}, False, ranks_cfg)
    assert not bad.ok and bad.worst_param == name and bad.loss_diff == 0.0
    assert bad.float64_grad_diff < rounding_tolerance(cfg).grad  # the float64 distance alone could not see it


def _one_expert_scaled(report: dict[str, Any], factor: float) -> dict[str, Any]:
    """A rank's report as a pipeline that scales one expert's gradient by ``factor`` gives it."""
    grads = dict(report["grads"])
    name = next(n for n in report["experts"] if n.endswith("experts.down"))
    grads[name] = grads[name].clone()
    grads[name][0] *= factor
    return {**report, "grads": grads}


@pytest.mark.multiproc
def test_the_model_precision_fails_a_pipeline_whose_expert_gradient_is_a_little_off() -> None:
    """A pipelined step whose expert gradient is 0.97 (bfloat16) or 0.995 (float16) of its value
    on one rank is not ok, while the unchanged step is; the old float64 tolerances would have
    passed both (bfloat16's 0.88, float16's 0.11 relative)."""
    configs = [_with(_config("dualpipev", 2, ep=2), model__dtype=dtype) for dtype in ("bfloat16", "float16")]
    plans = [checked(c, "model") for c in configs]
    steps = run_steps([ranks for ranks, _, _ in plans], by_position=True)
    for cfg, (ranks_cfg, tol, _), ranks, factor in zip(configs, plans, steps, (0.97, 0.995)):
        good = compare(float64(cfg), ranks, tol, {}, True, ranks_cfg)
        assert good.ok, good.summary()
        bad = compare(float64(cfg), [_one_expert_scaled(ranks[0], factor), *ranks[1:]], tol, {}, True, ranks_cfg)
        assert not bad.ok and bad.worst_param.endswith("experts.down") and bad.loss_diff == 0.0, bad.summary()
        assert bad.float64_grad_diff < rounding_tolerance(cfg).grad, bad.summary()
