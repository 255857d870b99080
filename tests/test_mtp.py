"""Multi-token prediction (DeepSeek-V3 report, 2.2): ``model.mtp_layers`` modules on the last stage.

- the module's forward equals transformers' ``MtpModel`` on a Hugging Face DeepSeek-V3 folder with
  ``num_nextn_predict_layers: 1`` (logits, float64);
- each depth's loss equals the report's formula written here independently, and the objective's
  gradient (main loss + lambda / D x the depths' losses) enters the last stage's backward, with and
  without the W split, recompute and zero-memory;
- the published layout goes in (``model.init_from``) and comes out (export) bit for bit;
- ``portapipe verify`` is exact with D = 1 and D = 2 in every schedule, the balance loss on, with and
  without EPLB's redundant experts;
- the keys are refused where they cannot apply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ConfigError, load_config
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.hf_io import export_hf, init_problems
from portapipe.models.moe import build_blocks
from portapipe.models.objective import Objective, mtp_weight_at, term_figures
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.stage import logical_state
from portapipe.verify import verify_many

from .hf_models import model_section, mtp_depth_logits, mtp_folder, portapipe_blocks, tokens, transformers_mtp
from .test_objective import SCHEDULES, check_exact, stage_step, verify_config


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return mtp_folder("deepseek_v3", tmp_path_factory.mktemp("mtp") / "ds", seed=4)


def _main_hidden(blocks: list[Any], x: torch.Tensor) -> torch.Tensor:
    """The main model's normed last hidden state (depth 0 of the prediction chain)."""
    tape, h = Tape(record=False), x
    for b in blocks:
        if b.block == 0:
            h = b.embed_part(h)
        for layer in b.main_layers():
            h = run(layer.program(tape, h))
    return blocks[-1].final_norm(h)


def _depths(blocks: list[Any], x_full: torch.Tensor, h: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each depth's (logits, normed output), written from the report: depth k's row i combines the
    previous depth's row i with the embedding of token i + k, at RoPE position i + k."""
    last = blocks[-1]
    seq = x_full.shape[1] - 1
    out = []
    for mtp in last.mtp_layers():
        k = mtp.depth
        emb = last.embed(x_full[:, k:seq])
        z = mtp.eh_proj(torch.cat([mtp.enorm(emb), mtp.hnorm(h[:, : seq - k])], dim=-1))
        z = run(mtp.program(Tape(record=False), z))
        h = mtp.shared_head["norm"](z)
        out.append((F.linear(h, last.head_weight()), h))
    return out


def report_loss(logits: torch.Tensor, x_full: torch.Tensor, k: int) -> torch.Tensor:
    """L_MTP^k = -(1 / T) sum_i log P^k_i[t_i], over the rows that have a token k + 1 ahead, T all
    the micro-batch's positions; row i of depth k predicts token i + k + 1."""
    batch, seq = x_full.shape[0], x_full.shape[1] - 1
    logp = torch.log_softmax(logits, dim=-1)
    total = logits.new_zeros(())
    for b in range(batch):
        for i in range(seq - k):
            total = total - logp[b, i, x_full[b, i + k + 1]]
    return total / (batch * seq)


def test_the_modules_forward_equals_transformers_mtp_model(folder: Path) -> None:
    main, mtp = transformers_mtp(folder)
    blocks = portapipe_blocks("deepseek_v3", folder, mtp_layers=1)
    x = tokens(2, 16, seed=5)
    seq = x.shape[1]
    with torch.no_grad():
        h0 = main(x, output_hidden_states=True).hidden_states[-1]
        position = torch.arange(1, seq)[None].expand(2, -1)
        want = mtp_depth_logits(mtp, 0, h0[:, : seq - 1], x[:, 1:], position)
        ours = blocks[-1].mtp_layers()[0]
        hn = _main_hidden(blocks, x)
        z = run(ours.program(Tape(record=False), ours.mtp_input_part(hn, x[:, 1:], blocks[-1].embed)))
        got = F.linear(ours.shared_head["norm"](z), blocks[-1].head_weight())
    assert float((hn - h0).abs().max()) <= 1e-12
    assert float((got - want).abs().max()) <= 1e-12 and float(want.abs().max()) > 0.5
    # what the equality rests on: row i embeds token i + 1, in the report's order [embedding; hidden]
    with torch.no_grad():
        for proj in (lambda: ours.mtp_input_part(hn, x[:, :-1], blocks[-1].embed),
                     lambda: ours.eh_proj(torch.cat([ours.hnorm(hn[:, :-1]), ours.enorm(blocks[-1].embed(x[:, 1:]))], dim=-1))):
            z = run(ours.program(Tape(record=False), proj()))
            assert float((F.linear(ours.shared_head["norm"](z), blocks[-1].head_weight()) - want).abs().max()) > 1e-3


def _model(depth: int, weight: Any = 0.3, **model: Any) -> Any:
    return load_config({
        "backend": "cpu",
        "model": {"vocab_size": 32, "hidden": 16, "n_layers": 3, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16,
                  "n_experts": 4, "top_k": 2, "seq_len": 8, "dtype": "float64", "mtp_layers": depth, **model},
        "train": {"mtp_loss_weight": weight},
    })


def _block(config: Any) -> Any:
    return build_blocks(config.model, [0], 1, ExpertParallel(CPUBackend()), seed=3, objective=Objective.from_train(config.train))[0]


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 32, (3, 9), generator=torch.Generator().manual_seed(4))
    return t[:, :-1], t[:, 1:], t


@pytest.mark.parametrize("memory", [{}, {"recompute": "full"}, {"zero_memory": "level1"}])
@pytest.mark.parametrize("w_split", [False, True])
def test_each_depths_loss_is_the_reports_and_its_gradient_enters_the_last_stages_backward(memory: dict[str, str], w_split: bool) -> None:
    depth, lam, seed = 2, 0.3, 0.25
    config = _model(depth, lam)
    x, y, full = _data()
    block = _block(config)
    loss, tape = stage_step(block, memory, x, y, seed, w_split)
    # independently: one autograd graph of seed x (main + lambda / D x sum_k L_MTP^k)
    ref = _block(config)
    h = _main_hidden([ref], x)
    main = F.cross_entropy(F.linear(h, ref.head_weight()).reshape(-1, 32), y.reshape(-1))
    losses = [report_loss(logits, full, k) for k, (logits, _) in enumerate(_depths([ref], full, h), 1)]
    (seed * (main + lam / depth * sum(losses))).backward()
    assert float(loss.detach()) == pytest.approx(float(main.detach()), rel=1e-14)
    assert [float(tape.terms[f"mtp.{k}"]) for k in (1, 2)] == pytest.approx([float(v.detach()) for v in losses], rel=1e-13)
    want = dict(ref.named_parameters())
    for name, p in block.named_parameters():
        assert torch.allclose(p.grad, want[name].grad, rtol=1e-11, atol=1e-16), name
    assert float(want["layers.4.eh_proj.weight"].grad.abs().max()) > 0  # depth 2 got its gradient


def test_lambda_follows_its_schedule_step_by_step() -> None:
    assert mtp_weight_at({0: 0.3, 10: 0.1}, 0) == 0.3 and mtp_weight_at({0: 0.3, 10: 0.1}, 9) == 0.3
    assert mtp_weight_at({0: 0.3, 10: 0.1}, 10) == 0.1 and mtp_weight_at(0.2, 123) == 0.2
    config = _model(1, {0: 0.3, 5: 0.1})
    x, y, _ = _data()
    grads = []
    for step in (0, 5):
        block = _block(config)
        block.objective.at_step(step)
        tape = Tape(input_grad=False, loss_seed=1.0)
        loss = run(block.program(tape, x, y))
        run(tape.backward(loss, torch.ones_like(loss)))
        grads.append(block.layers["3"].eh_proj.weight.grad)  # reached by the MTP loss only
    assert torch.allclose(grads[1] * 3, grads[0], rtol=1e-12)


def test_the_reported_figures_name_each_depth() -> None:
    assert term_figures({"mtp.2": 2.0, "mtp.1": 3.0, "balance.1": 1.0}) == {"mtp_loss_1": 3.0, "mtp_loss_2": 2.0, "balance_loss": 1.0}


# ------------------------------------------------------------------------------ Hugging Face
def test_the_published_layout_goes_in_and_comes_out_bit_for_bit(folder: Path, tmp_path: Path) -> None:
    m = load_config({"model": model_section("deepseek_v3", init_from=str(folder), mtp_layers=1, dtype="float64")}).model
    assert init_problems(m) == []
    blocks = portapipe_blocks("deepseek_v3", folder, mtp_layers=1)
    state = logical_state([(n, t) for b in blocks for n, t in b.state_dict(keep_vars=True).items()])
    assert {"layers.4.enorm.weight", "layers.4.eh_proj.weight", "layers.4.shared_head.norm.weight", "layers.4.moe.experts.3.down"} <= set(state)
    out = export_hf(state, load_config({"model": model_section("deepseek_v3", mtp_layers=1)}).model, tmp_path / "out")
    written, original = load_file(str(out / "model.safetensors")), load_file(str(folder / "model.safetensors"))
    assert sorted(written) == sorted(original)
    assert all(torch.equal(written[k], original[k]) and written[k].dtype == original[k].dtype for k in original)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_a_tied_model_with_a_prediction_module_exports_and_reads_back_bit_for_bit(tmp_path: Path) -> None:
    """tie_word_embeddings with mtp_layers 1: no lm_head.weight, the module's shared head is the
    embedding as the folder is read back (mapping the module's head to lm_head would raise here)."""
    from portapipe.backends.cpu import CPUBackend
    from portapipe.models.expert_parallel import ExpertParallel

    def state_of(m: Any) -> dict[str, torch.Tensor]:
        blocks = build_blocks(m, [0, 1], 2, ExpertParallel(CPUBackend()), seed=3)
        return logical_state([(n, t) for b in blocks.values() for n, t in b.state_dict(keep_vars=True).items()])

    m = load_config({"model": model_section("deepseek_v3", mtp_layers=1, tie_word_embeddings=True, dtype="float64")}).model
    state = state_of(m)
    out = export_hf(state, m, tmp_path / "out")
    written = load_file(str(out / "model.safetensors"))
    assert "lm_head.weight" not in written and json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    back = load_config({"model": model_section("deepseek_v3", mtp_layers=1, tie_word_embeddings=True, dtype="float64", init_from=str(out))}).model
    assert init_problems(back) == []
    again = state_of(back)
    assert sorted(again) == sorted(state) and all(torch.equal(again[k], state[k]) for k in state)


def test_a_folder_is_read_with_fewer_modules_but_not_more_and_its_copies_must_be_equal(folder: Path, tmp_path: Path) -> None:
    def problems(path: Path, depth: int) -> list[str]:
        return init_problems(load_config({"model": model_section("deepseek_v3", init_from=str(path), mtp_layers=depth)}).model)

    assert problems(folder, 0) == []  # the module is left out: the main model trains alone
    assert any(line.startswith("model.mtp_layers: 2, but ") and "holds 1 multi-token prediction" in line for line in problems(folder, 2))
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.4.shared_head.head.weight"] = tensors["model.layers.4.shared_head.head.weight"] + 1
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (line,) = problems(bad, 1)
    assert "model.layers.4.shared_head.head.weight differs from lm_head.weight" in line


def test_the_keys_are_refused_where_they_cannot_apply() -> None:
    cases = {
        "model.mtp_layers: 1; qwen3_moe has no multi-token prediction": {"model": {"arch": "qwen3_moe", "mtp_layers": 1}},
        "model.mtp_layers: 8 leaves no token to predict": {"model": {"seq_len": 8, "mtp_layers": 8}},
        "train.mtp_loss_weight: 0.1 has no effect": {"train": {"mtp_loss_weight": 0.1}},
        "the schedule starts at step 3": {"model": {"mtp_layers": 1}, "train": {"mtp_loss_weight": {3: 0.1}}},
        "is not a finite number >= 0": {"model": {"mtp_layers": 1}, "train": {"mtp_loss_weight": -0.5}},
    }
    for text, raw in cases.items():
        with pytest.raises(ConfigError, match=text):
            load_config(raw)
    assert load_config({"model": {"seq_len": 8, "mtp_layers": 7}, "train": {"mtp_loss_weight": {0: 0.3, 100: 0.1}}}).train.mtp_loss_weight == {0: 0.3, 100: 0.1}


@pytest.mark.parametrize("given, said", [
    ("0.3", "the weight '0.3' is not a number; write it unquoted"),
    (True, "the weight True is not a number"),
    ({"0": "0.3"}, "the weight of step 0 '0.3' is not a number"),
    ({"a": 0.3}, "step 'a' is not a whole number >= 0; the schedule is {step: weight}"),
    ({0: "0.3"}, "the weight of step 0 '0.3' is not a number"),
    (float("nan"), "the weight nan is not a finite number >= 0 and <= 10000"),
    (float("inf"), "the weight inf is not a finite number >= 0 and <= 10000"),
    (1e308, "the weight 1e+308 is not a finite number >= 0 and <= 10000"),
    ({0: float("nan")}, "the weight of step 0 nan is not a finite number"),
    ({0.5: 0.3}, "step 0.5 is not a whole number >= 0"),
    # --set "train.mtp_loss_weight={0:0.3,10:0.1}": YAML 1.1 reads 0:0.3 and 10:0.1 as base-60 numbers
    ({0.3: None, 600.1: None}, "read as {0.3: None, 600.1: None}: YAML 1.1 reads step:weight without a space"),
])
def test_the_mtp_weight_is_a_number_or_a_schedule_of_numbers_each_refusal_saying_what_was_read(given: Any, said: str) -> None:
    """The typing rule (no strings, no booleans, whole steps), the range, and one line naming what
    was read: never "expected a number or a mapping" nor a rank's overflow at 1e308."""
    with pytest.raises(ConfigError) as err:
        load_config({"model": {"mtp_layers": 1}, "train": {"mtp_loss_weight": given}})
    (line,) = str(err.value).strip().splitlines()
    assert line.startswith("train.mtp_loss_weight: ") and said in line, line


def test_a_schedule_written_back_as_json_reads_the_same() -> None:
    """JSON's keys are text: a config written back (a checkpoint's) gives {"0": 0.3, "2": 0.1}."""
    c = load_config({"model": {"mtp_layers": 1}, "train": {"mtp_loss_weight": {0: 0.3, 2: 0.1}}})
    assert load_config(json.loads(json.dumps(c.to_dict()))).train.mtp_loss_weight == {0: 0.3, 2: 0.1}


def test_the_sequence_balance_weight_has_the_same_bound() -> None:
    with pytest.raises(ConfigError, match="train.seq_aux_loss_weight: 1e\\+308: Input should be less than or equal to 10000"):
        load_config({"train": {"seq_aux_loss_weight": 1e308}})


# ------------------------------------------------------------------------------------ verify
@pytest.mark.multiproc
def test_verify_is_exact_with_one_and_two_modules_in_every_schedule() -> None:
    """pp 2 x ep 2, the balance loss on: D = 1 and D = 2 in every schedule; EPLB's redundant experts
    (which place the modules' experts too) with 1F1B and DualPipeV; recompute and zero-memory."""
    eplb = {"kind": "eplb", "redundant": 1}
    configs = [verify_config(name, ep=2, model={"mtp_layers": depth}) for depth in (1, 2) for name in SCHEDULES]
    configs += [
        verify_config("1f1b", ep=2, model={"mtp_layers": 2}, balancer=eplb),
        verify_config("dualpipev", ep=2, model={"mtp_layers": 1}, balancer=eplb, memory={"recompute": "full"}),
        verify_config("zb1p", ep=2, model={"mtp_layers": 1, "tie_word_embeddings": True}, memory={"zero_memory": "level1"}),
    ]
    reports = verify_many(configs)
    check_exact(reports)
    for r, c in zip(reports, configs):
        assert {f"mtp.{k}" for k in range(1, c.model.mtp_layers + 1)} <= set(r.ref_loss_terms)


@pytest.mark.multiproc
def test_verify_is_exact_with_three_tied_modules_under_lplb_in_every_schedule() -> None:
    """D = 3, tied embeddings and LPLB's redundant slot (which splits an expert's rows among its
    replicas micro-batch by micro-batch): each depth's loss bit for bit in every schedule. The CPU
    example's model at 16 tokens a sequence: at these widths a BLAS matmul rounds a row by its
    group's size, which once made ``mtp.3`` differ in its last bit."""
    base = ["model.seq_len=16", "model.mtp_layers=3", "model.tie_word_embeddings=true", "balancer.kind=lplb", "balancer.redundant=1"]
    pairs = {"1f1b": False, "zb1p": False, "interleaved": True, "dualpipe": True, "dualpipev": True}
    configs = [load_config(Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml",
                           [*base, f"schedule.name={name}", f"schedule.overlap={str(overlap).lower()}"]) for name, overlap in pairs.items()]
    reports = verify_many(configs)
    for r in reports:
        assert r.ok and r.loss_diff == 0.0 and r.loss_terms_diff == 0.0 and r.max_rel_grad_diff <= 1e-12, (r.schedule, r.summary())
        assert {"mtp.1", "mtp.2", "mtp.3"} <= set(r.ref_loss_terms)
