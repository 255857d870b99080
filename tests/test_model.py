"""The MoE model: seeded and split-independent, routing rules, and the part-wise backward."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ModelConfig
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.moe import Block, Router, build_blocks, layer_range
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.wgrad import WeightGradQueue

CFG = dict(
    dtype="float64", vocab_size=32, hidden=16, n_layers=4, n_dense=1, n_heads=2, ffn_hidden=32,
    moe_hidden=16, n_experts=4, top_k=2, seq_len=8, n_groups=2, topk_groups=1,
)


def _cfg(**kw: object) -> ModelConfig:
    return ModelConfig(**{**CFG, **kw})


def _ep(size: int = 1, rank: int = 0) -> ExpertParallel:
    return ExpertParallel(CPUBackend(), size, rank)


def _tokens(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _params(blocks: dict[int, Block]) -> dict[str, torch.Tensor]:
    return {n: p.detach() for b in blocks.values() for n, p in b.named_parameters()}


def test_layers_split_into_contiguous_near_equal_blocks() -> None:
    assert [layer_range(10, 4, b) for b in range(4)] == [(0, 2), (2, 5), (5, 7), (7, 10)]
    try:
        layer_range(3, 4, 0)
    except ValueError as exc:
        assert "n_layers = 3" in str(exc) and "4 blocks" in str(exc)
    else:
        raise AssertionError("3 layers cut into 4 blocks must fail")


def test_weights_do_not_depend_on_the_split_or_the_expert_sharding() -> None:
    cfg = _cfg()
    whole = _params(build_blocks(cfg, [0], 1, _ep(), seed=3))
    split = _params(build_blocks(cfg, [0, 1, 2, 3], 4, _ep(), seed=3))
    assert whole.keys() == split.keys()
    assert all(torch.equal(whole[n], split[n]) for n in whole)
    # EP rank 1 of 2 holds logical experts 2 and 3 of every MoE layer, with the same weights.
    shard = _params(build_blocks(cfg, [0], 1, _ep(2, 1), seed=3))
    name = "layers.2.moe.experts.gate_up"
    assert torch.equal(shard[name], whole[name][2:4])
    other = _params(build_blocks(cfg, [0], 1, _ep(), seed=4))
    assert not torch.equal(other[name], whole[name])


def test_weights_do_not_depend_on_the_threads_that_draw_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """The draws run side by side on the intra-op threads, each from its own generator: one
    thread and four give the same weights, and the pool is used (a shared generator, or one
    draw's target given another's values, would show)."""
    import concurrent.futures

    cfg = _cfg()
    saved = torch.get_num_threads()
    pools: list[int] = []
    real = concurrent.futures.ThreadPoolExecutor

    class Counted(real):  # type: ignore[misc, valid-type]
        def __init__(self, workers: int) -> None:
            pools.append(workers)
            super().__init__(workers)

    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", Counted)
    try:
        torch.set_num_threads(1)
        one = _params(build_blocks(cfg, [0], 1, _ep(), seed=3))
        assert pools == []
        torch.set_num_threads(4)
        four = _params(build_blocks(cfg, [0], 1, _ep(), seed=3))
        assert pools == [4]
    finally:
        torch.set_num_threads(saved)
    assert one.keys() == four.keys() and all(torch.equal(one[n], four[n]) for n in one)


def test_float64_and_float32_build_and_run() -> None:
    for dtype in ("float64", "float32"):
        blocks = build_blocks(_cfg(dtype=dtype), [0], 1, _ep(), seed=1)
        x, y = _tokens()
        loss = run(blocks[0].program(Tape(record=False), x, y))
        assert loss.dtype == (torch.float64 if dtype == "float64" else torch.float32)
        assert 2.0 < float(loss.detach()) < 5.0  # about ln(32) = 3.47 at initialisation


def test_router_sigmoid_topk_weights_and_group_limit() -> None:
    torch.manual_seed(0)
    cfg = _cfg(n_experts=8, n_groups=4, topk_groups=2, top_k=3)
    router = Router(cfg, torch.float64)
    torch.nn.init.normal_(router.gate.weight)
    x = torch.randn(50, 16, dtype=torch.float64)
    w, idx = router(x)
    assert w.shape == idx.shape == (50, 3)
    torch.testing.assert_close(w.sum(-1), torch.ones(50, dtype=torch.float64))  # normalised
    groups = idx // 2  # 4 groups of 2 experts
    assert all(len(set(row.tolist())) <= 2 for row in groups)  # at most topk_groups groups
    scores = torch.sigmoid(x @ router.gate.weight.t())
    picked = scores.gather(1, idx)
    torch.testing.assert_close(w, picked / picked.sum(-1, keepdim=True))


def test_bias_steers_choice_but_not_weights_and_updates_towards_balance() -> None:
    cfg = _cfg(n_experts=4, n_groups=1, topk_groups=1, top_k=1, bias_update_speed=0.5)
    router = Router(cfg, torch.float64)
    # Linear leaves its weight uninitialised (the model seeds it); set it, or the test reads garbage.
    torch.nn.init.normal_(router.gate.weight, generator=torch.Generator().manual_seed(1))
    x = torch.randn(20, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    _, before = router(x)
    router.update_bias(torch.tensor([10, 0, 5, 5]))  # expert 0 over-, expert 1 under-loaded
    assert router.bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    router.bias.copy_(torch.tensor([-10.0, 10.0, -10.0, -10.0]))
    w, idx = router(x)
    assert (idx == 1).all()  # the bias decides the choice ...
    scores = torch.sigmoid(x @ router.gate.weight.t())
    torch.testing.assert_close(w[:, 0], scores[:, 1])  # ... the affinity (no bias) the weight
    assert not (before == 1).all()


def test_partwise_backward_with_deferred_weights_equals_one_autograd_graph() -> None:
    cfg = _cfg()
    x, y = _tokens(5)
    ref_blocks = build_blocks(cfg, [0, 1], 2, _ep(), seed=7)
    tape = Tape(record=False)
    loss_ref = run(ref_blocks[1].program(tape, run(ref_blocks[0].program(tape, x)), y))
    loss_ref.backward()

    blocks = build_blocks(cfg, [0, 1], 2, _ep(), seed=7)
    t0, t1 = Tape(), Tape()
    h = run(blocks[0].program(t0, x))
    loss = run(blocks[1].program(t1, h, y))
    assert loss.item() == loss_ref.item()
    queue = WeightGradQueue()
    gh = run(t1.backward(loss, torch.ones_like(loss), queue))
    assert gh.shape == h.shape and len(queue) > 0
    assert all(p.grad is None for n, p in blocks[1].named_parameters() if n.endswith("wq.weight"))  # still queued
    assert run(t0.backward(h, gh, queue)) is None  # block 0's input is tokens
    queue.run()
    ref = {n: p.grad for b in ref_blocks.values() for n, p in b.named_parameters()}
    for b in blocks.values():
        for n, p in b.named_parameters():
            torch.testing.assert_close(p.grad, ref[n], rtol=1e-13, atol=1e-300, msg=n)


def test_partwise_backward_frees_the_graph() -> None:
    blocks = build_blocks(_cfg(), [0], 1, _ep(), seed=7)
    x, y = _tokens(6)
    tape = Tape()
    loss = run(blocks[0].program(tape, x, y))
    run(tape.backward(loss, torch.ones_like(loss)))
    assert tape._steps == [] and tape._grads == {}
    for p in blocks[0].parameters():
        assert p.grad is not None


def test_forward_counts_routed_rows_per_expert() -> None:
    cfg = _cfg()
    blocks = build_blocks(cfg, [0], 1, _ep(), seed=7)
    x, y = _tokens(7)
    run(blocks[0].program(Tape(record=False), x, y))
    for layer in blocks[0].moe_layers():
        assert int(layer.moe.step_counts.sum()) == x.numel() * cfg.top_k


@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_swiglu_function_matches_autograd_of_the_formula_bit_for_bit(dtype: torch.dtype, scaled: bool) -> None:
    """SwiGLU keeps only its input (and the row scale), yet its values and gradients equal
    autograd's on the formula, the scale's gradient included."""
    from portapipe.models.functions import silu, swiglu

    g = torch.Generator().manual_seed(3)
    width = 19
    gu = torch.randn(257, 2 * width, generator=g, dtype=torch.float64).mul(8).to(dtype)
    gu[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -40.0])
    scale = torch.rand(257, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(257, width, generator=g, dtype=torch.float64).to(dtype)
    a, b = gu.clone().requires_grad_(True), gu.clone().requires_grad_(True)
    sa, sb = scale.clone().requires_grad_(True), scale.clone().requires_grad_(True)
    want = silu(a[..., :width]) * a[..., width:]
    if scaled:
        want = want * sa.unsqueeze(-1)
    got = swiglu(b, width, sb if scaled else None)
    want.backward(grad)
    got.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(b.grad, a.grad)
    if scaled:
        assert torch.equal(sb.grad, sa.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rmsnorm_function_matches_autograd_of_the_formula_bit_for_bit(dtype: torch.dtype) -> None:
    """RMSNorm keeps x and its row scale only; values and gradients (through a residual too) are autograd's."""
    from portapipe.models.functions import RMSNorm

    g = torch.Generator().manual_seed(4)
    norm = RMSNorm(48, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g, dtype=torch.float64))
    x = torch.randn(3, 7, 48, generator=g, dtype=torch.float64).mul(5).to(dtype)
    lin = torch.randn(48, 48, generator=g, dtype=torch.float64).to(dtype)
    grad = torch.randn(3, 7, 48, generator=g, dtype=torch.float64).to(dtype)

    def layer(x: torch.Tensor, f: Any) -> torch.Tensor:
        return x + f(x) @ lin  # x's gradient sums the residual's and the norm's terms

    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    want = layer(a, lambda t: t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight)
    want.backward(grad)
    want_w = norm.weight.grad.clone()
    norm.weight.grad = None
    got = layer(b, norm)
    got.backward(grad)
    assert torch.equal(got, want)
    assert torch.equal(b.grad, a.grad)
    assert torch.equal(norm.weight.grad, want_w)
