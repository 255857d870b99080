"""The training objective's extra terms: DeepSeek-V3's sequence-wise balance loss.

- the loss equals the report's formula, written here independently with loops;
- recorded inside a stage (``Tape.loss``), its gradient enters that stage's backward: a recorded
  step's gradients equal one autograd graph of main loss + alpha x the independent formula, with
  and without the W split, recompute and zero-memory;
- ``portapipe verify`` is exact with it on for every schedule, with expert parallelism and EPLB's
  redundant experts, and under the memory options.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ConfigError, load_config
from portapipe.memory.policy import configure
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.moe import build_blocks
from portapipe.models.objective import Objective, sequence_balance_loss, term_figures
from portapipe.models.routing import Router
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.wgrad import WeightGradQueue
from portapipe.verify import verify_many


def stage_step(block: Any, memory: dict[str, str], x: torch.Tensor, y: torch.Tensor, seed: float, w_split: bool) -> tuple[torch.Tensor, Tape]:
    """One stage's forward and part-wise backward as the executor runs them (memory options of
    ``memory``, weight gradients queued for a W when ``w_split``): the loss and the tape."""
    configure({0: block}, load_config({"memory": memory}).memory)
    tape = Tape(input_grad=False, loss_seed=seed)
    loss = run(block.program(tape, x, y))
    queue = WeightGradQueue() if w_split else None
    run(tape.backward(loss, torch.full_like(loss, seed), queue))
    if queue is not None:
        queue.run()
    return loss, tape

def report_formula(scores: torch.Tensor, idx: torch.Tensor, batch: int) -> torch.Tensor:
    """alpha-free L_Bal of DeepSeek-V3 (section 2.1.2), term by term, mean over the sequences."""
    rows, n_r = scores.shape
    k_r = idx.shape[1]
    t = rows // batch
    total = scores.new_zeros(())
    for s in range(batch):
        tok = range(s * t, (s + 1) * t)
        for i in range(n_r):
            f_i = n_r / (k_r * t) * sum(1.0 for j in tok if i in idx[j].tolist())
            p_i = sum(scores[j, i] / scores[j].sum() for j in tok) / t
            total = total + f_i * p_i
    return total / batch


def test_the_balance_loss_is_the_reports_formula() -> None:
    g = torch.Generator().manual_seed(0)
    scores = torch.sigmoid(torch.randn(12, 6, generator=g, dtype=torch.float64))
    idx = torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(12)])
    normed = scores / scores.sum(-1, keepdim=True)
    got = sequence_balance_loss(normed, idx, batch=3)
    assert torch.allclose(got, report_formula(scores, idx, 3), rtol=1e-14, atol=0)
    # perfectly even routing and affinities: 1
    even = torch.full((4, 4), 0.25, dtype=torch.float64)
    assert float(sequence_balance_loss(even, torch.tensor([[0, 1], [2, 3], [0, 2], [1, 3]]), batch=1)) == pytest.approx(1.0)


def _model(alpha: float, **model: Any) -> Any:
    return load_config({
        "backend": "cpu",
        "model": {"vocab_size": 32, "hidden": 16, "n_layers": 3, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16,
                  "n_experts": 4, "top_k": 2, "seq_len": 8, "dtype": "float64", **model},
        "train": {"seq_aux_loss_weight": alpha},
    })


def _blocks(config: Any) -> Any:
    return build_blocks(config.model, [0], 1, ExpertParallel(CPUBackend()), seed=3, objective=Objective.from_train(config.train))[0]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, 32, (3, 9), generator=torch.Generator().manual_seed(4))
    return t[:, :-1], t[:, 1:]


def _independent_grads(config: Any, alpha: float, seed: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One autograd graph: seed x (main loss + alpha x sum over MoE layers of the report's formula),
    the formula fed by each router's input and choice as the model ran them."""
    block = _blocks(_model(0.0))
    seen: list[tuple[torch.Tensor, torch.Tensor, Router]] = []
    original = Router.route

    def spy(self: Router, x: torch.Tensor, affinities: bool = False) -> Any:
        out = original(self, x, affinities)
        seen.append((x, out[1], self))
        return out

    x, y = _data()
    Router.route = spy  # type: ignore[method-assign]
    try:
        loss = run(block.program(Tape(record=False), x, y))
    finally:
        Router.route = original  # type: ignore[method-assign]
    values = []
    total = loss
    for inp, idx, router in seen:
        scores = torch.sigmoid(F.linear(inp, router.gate.weight))
        bal = report_formula(scores, idx, batch=x.shape[0])
        values.append(float(bal.detach()))
        total = total + alpha * bal
    (total * seed).backward()
    return {n: p.grad.clone() for n, p in block.named_parameters()}, values


@pytest.mark.parametrize("memory", [{}, {"recompute": "full"}, {"recompute": "moe"}, {"zero_memory": "level1"}])
@pytest.mark.parametrize("w_split", [False, True])
def test_a_stages_balance_loss_gets_its_gradient_in_that_stages_backward(memory: dict[str, str], w_split: bool) -> None:
    alpha, seed = 0.3, 0.25
    config = _model(alpha)
    block = _blocks(config)
    x, y = _data()
    loss, tape = stage_step(block, memory, x, y, seed, w_split)
    want, values = _independent_grads(config, alpha, seed)
    got = {n: p.grad for n, p in block.named_parameters()}
    assert set(tape.terms) == {"balance.1", "balance.2"}
    assert [float(tape.terms[f"balance.{i}"]) for i in (1, 2)] == pytest.approx(values, rel=1e-13)
    for name, g in got.items():
        assert torch.allclose(g, want[name], rtol=1e-11, atol=1e-15), name
    # the balance loss moved the routers' gradients (the check above would also pass without it otherwise)
    without, _ = _independent_grads(config, 0.0, seed)
    assert not torch.allclose(without["layers.1.moe.router.gate.weight"], want["layers.1.moe.router.gate.weight"], rtol=1e-6)


def test_the_reported_balance_loss_is_the_mean_over_layers() -> None:
    assert term_figures({"balance.3": 1.5, "balance.2": 1.0}) == {"balance_loss": 1.25}
    assert term_figures({}) == {}


def test_the_weight_is_checked_before_any_rank_starts() -> None:
    with pytest.raises(ConfigError, match="train.seq_aux_loss_weight"):
        load_config({"train": {"seq_aux_loss_weight": -0.1}})
    with pytest.raises(ConfigError, match="train.seq_aux_loss_weight: 0.1 but the model has no MoE layer"):
        load_config({"model": {"n_layers": 2, "n_dense": 2}, "train": {"seq_aux_loss_weight": 0.1}})


# ------------------------------------------------------------------------------------ verify
SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")


def verify_config(name: str, pp: int = 2, ep: int = 1, alpha: float = 0.01, **sections: Any) -> Any:
    mb = 2 * pp if name in ("dualpipe", "dualpipev") else pp
    raw: dict[str, Any] = {
        "backend": "cpu",
        "parallel": {"pp": pp, "ep": ep},
        "schedule": {"name": name, "microbatches": mb},
        "model": {"vocab_size": 32, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16,
                  "n_experts": 4, "top_k": 2, "seq_len": 8, "n_groups": 2, "topk_groups": 1},
        "train": {"micro_batch_size": 2, "seed": 5, "seq_aux_loss_weight": alpha},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw)


def check_exact(reports: list[Any]) -> None:
    for r in reports:
        label = (r.schedule, r.pp, r.ep, r.worst_param)
        assert r.ok and r.loss_diff == 0.0 and r.loss_terms_diff == 0.0 and r.max_rel_grad_diff <= 1e-12, (label, r.summary())
        assert r.ref_loss_terms and all(v > 0.5 for v in r.ref_loss_terms.values()), r.ref_loss_terms


@pytest.mark.multiproc
def test_verify_is_exact_with_the_balance_loss_in_every_schedule() -> None:
    """pp 2 x ep 2: every schedule; EPLB with a redundant expert per rank (1F1B, DualPipeV);
    recompute and zero-memory (each layer's term recorded where its router runs)."""
    eplb = {"kind": "eplb", "redundant": 1}
    configs = [verify_config(name, ep=2) for name in SCHEDULES]
    configs += [
        verify_config("1f1b", ep=2, balancer=eplb),
        verify_config("dualpipev", ep=2, balancer=eplb, memory={"recompute": "full"}),
        verify_config("zb1p", ep=2, memory={"zero_memory": "level1"}),
        verify_config("interleaved", ep=2, memory={"recompute": "moe"}),
    ]
    check_exact(verify_many(configs))


def test_a_loss_term_must_be_a_named_scalar_recorded_once_and_made_by_a_part() -> None:
    tape = Tape()
    w = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="must be a scalar"):
        tape.loss("x", tape.part(lambda a: a * 2, w))
    term = tape.part(lambda a: (a * 2).sum(), w)
    tape.loss("x", term, 0.5)
    with pytest.raises(ValueError, match="recorded twice"):
        tape.loss("x", term)
    with pytest.raises(ValueError, match="is not the output of a part"):
        tape.loss("y", (w * 3).sum())
    # recorded with weight 0.5: its gradient is 0.5 x the seed, whatever the output is
    out = tape.part(lambda a: a.sum() * 0.0, w)
    tape.loss_seed = 4.0
    run(tape.backward(out, torch.ones_like(out)))
    assert torch.equal(w.grad, torch.full((3,), 4.0 * 0.5 * 2, dtype=torch.float64))
