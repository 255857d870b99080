"""Your own model: plain nn.Module stages under every schedule equal one process; the W split by autograd."""

from __future__ import annotations

import functools
import operator
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from portapipe.ranks.launch import run_ranks
from portapipe.plain import PlainStage
from portapipe.scheduling.overlap import Tape, run
from portapipe.scheduling.wgrad import WeightGradQueue, split_backward

ROOT = Path(__file__).resolve().parents[1]
M = 4  # micro-batches


# ------------------------------------------------------------------ the W split by autograd
class Tied(nn.Module):
    """Weights on and off the input's path, one used twice (above and below a norm), a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8, dtype=torch.float64)
        self.norm = nn.LayerNorm(8, dtype=torch.float64)
        self.b = nn.Linear(8, 6, dtype=torch.float64)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6, dtype=torch.float64))
        self.offset = nn.Parameter(torch.full((6,), 0.25, dtype=torch.float64))  # reaches the output without x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.a(x)))
        return self.b(h) * self.scale + 0.5 * (h @ self.a.weight) ** 2 + x + self.offset.exp()


def _twins() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    a = Tied()
    b = Tied()
    b.load_state_dict(a.state_dict())
    return a, b


def test_split_backward_gives_input_grads_first_and_the_weights_exactly_at_w() -> None:
    ref, m = _twins()
    x0 = torch.randn(3, 4, 6, dtype=torch.float64)
    g = torch.randn(3, 4, 6, dtype=torch.float64)
    xr = x0.clone().requires_grad_()
    ref(xr).backward(g)
    x = x0.clone().requires_grad_()
    queue = WeightGradQueue()
    (gx,) = split_backward([m(x)], [g], [x], queue)
    assert torch.equal(gx, xr.grad)
    assert all(p.grad is None for p in m.parameters()) and len(queue) == 1
    queue.run()
    for (name, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_split_backward_covers_an_output_that_does_not_depend_on_the_input() -> None:
    torch.manual_seed(1)
    lin, w = nn.Linear(4, 4, dtype=torch.float64), nn.Parameter(torch.randn(3, dtype=torch.float64))
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    g1, g2 = torch.randn(2, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    torch.autograd.backward([lin(x), (w * lin.bias[:3]).sin()], [g1, g2])
    want = [t.grad.clone() for t in (x, lin.weight, lin.bias, w)]
    for t in (x, lin.weight, lin.bias, w):
        t.grad = None
    queue = WeightGradQueue()
    (gx,) = split_backward([lin(x), (w * lin.bias[:3]).sin()], [g1, g2], [x], queue)
    assert torch.equal(gx, want[0]) and lin.weight.grad is None and w.grad is None
    queue.run()
    assert all(torch.allclose(t.grad, g, rtol=1e-15, atol=0) for t, g in zip((lin.weight, lin.bias, w), want[1:]))


def test_split_backward_without_an_input_gradient_leaves_all_to_w() -> None:
    emb = nn.Embedding(10, 4, dtype=torch.float64)
    out = emb(torch.tensor([[1, 2, 2]]))
    queue = WeightGradQueue()
    assert split_backward([out], [torch.ones_like(out)], [], queue) == []
    assert emb.weight.grad is None
    queue.run()
    assert emb.weight.grad[2].tolist() == [2.0] * 4 and emb.weight.grad[0].tolist() == [0.0] * 4


def test_a_plain_stage_on_a_tape_splits_b_and_w() -> None:
    ref, m = _twins()
    x0, y = torch.randn(5, 6, dtype=torch.float64), torch.randn(5, 6, dtype=torch.float64)
    loss = nn.functional.mse_loss
    stage = PlainStage(m, 3, loss)
    assert stage.has_loss and dict(stage.named_parameters()).keys() == {f"3.{k}" for k, _ in m.named_parameters()}
    tape = Tape()
    out = run(stage.program(tape, x0, y))
    queue = WeightGradQueue()
    gx = run(tape.backward(out, torch.tensor(1.0, dtype=torch.float64), queue))
    xr = x0.clone().requires_grad_()
    loss(ref(xr), y).backward()
    assert torch.equal(out, loss(ref(x0), y)) and torch.equal(gx, xr.grad)
    assert all(p.grad is None for p in m.parameters())
    queue.run()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))


class Restart(nn.Module):
    """Ignores its input: a stage whose output does not depend on what it received."""

    def __init__(self) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.linspace(-1, 1, 16, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.start.expand(*x.shape[:-1], 16) * 2


def test_a_stage_that_ignores_its_input_sends_back_a_zero_gradient() -> None:
    stage = PlainStage(Restart(), 1)
    tape = Tape()
    x = torch.randn(2, 3, 12, dtype=torch.float64)
    out = run(stage.program(tape, x))
    gx = run(tape.backward(out, torch.ones_like(out), None))
    assert gx.shape == x.shape and not gx.any()
    assert torch.equal(stage.module.start.grad, torch.full((16,), 12.0, dtype=torch.float64))


def test_a_loss_that_is_not_a_scalar_is_refused() -> None:
    stage = PlainStage(nn.Identity(), 0, lambda out, y: (out - y) ** 2)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar tensor .* got \(2, 3\)"):
        run(stage.program(Tape(), torch.zeros(2, 3), torch.ones(2, 3)))


# ------------------------------------------------------------- every schedule on 2 ranks
def _modules(n: int, tokens: bool, seed: int = 0) -> list[nn.Module]:
    """n blocks of changing width (the boundary shapes differ), ending in a head; float64."""
    torch.manual_seed(seed)
    widths = [12 + 4 * (i % 3) for i in range(n + 1)]
    blocks: list[nn.Module] = []
    for i in range(n):
        layers: list[nn.Module] = [nn.Embedding(20, widths[0])] if tokens and i == 0 else []
        layers += [nn.Linear(widths[i], widths[i + 1]), nn.Tanh(), nn.LayerNorm(widths[i + 1])]
        if i == n - 1:
            layers.append(nn.Linear(widths[i + 1], 20))
        blocks.append(nn.Sequential(*layers).to(torch.float64))
    return blocks


def _batch(tokens: bool, replica: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + replica)
    x = torch.randint(0, 20, (8, 5), generator=g) if tokens else torch.randn(8, 5, 12, generator=g, dtype=torch.float64)
    return x, torch.randint(0, 20, (8, 5), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


class ScaledByMax(nn.Module):
    """Reads a value out of its input (float()): cannot run on meta tensors, so the boundary is given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 16, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) / float(x.detach().abs().max())


def _scaled_modules() -> list[nn.Module]:
    torch.manual_seed(3)
    return [ScaledByMax(), nn.Linear(16, 20, dtype=torch.float64)]


def _given_boundary(stage: int, shape: torch.Size) -> tuple[tuple[int, ...], torch.dtype]:
    return (*shape[:-1], 16), torch.float64


def _in_order_mean(losses: list[torch.Tensor]) -> float:
    """The micro-batches' losses added left to right, as the step reports them (Python 3.12's
    ``sum`` of floats compensates its rounding, so it can differ in the last bit)."""
    return functools.reduce(operator.add, (v.item() for v in losses)) / len(losses)


def _restart_modules() -> list[nn.Module]:
    """Block 1 ignores what block 0 sends: block 0 gets a zero gradient."""
    first = _modules(2, True)[0]
    torch.manual_seed(4)
    return [first, nn.Sequential(Restart(), nn.Linear(16, 20, dtype=torch.float64))]


CASES = [  # (schedule, modules on 2 pipeline ranks, token inputs, w_split)
    ("1f1b", 2, True, True),
    ("zb1p", 2, False, True),
    ("interleaved", 4, True, True),
    ("dualpipe", 2, False, True),
    ("dualpipev", 4, True, True),
    ("dualpipev", 4, False, False),
]


def _reference(n: int, tokens: bool, replicas: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = nn.Sequential(*_modules(n, tokens))
    total, losses = 0.0, []
    for r in range(replicas):
        x, y = _batch(tokens, r)
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            loss = _loss(model(xm), ym)
            (loss / (M * replicas)).backward()
            losses.append(loss.item())
    for v in losses:
        total += v
    return total / len(losses), {n_: p.grad for n_, p in model.named_parameters()}


def _rank(backend: Any, cases: list[tuple[str, int, bool, bool]], dp: int) -> dict[str, Any]:
    """Every case's loss, gradients and whether its schedule had W actions; then the refusals."""
    import torch.distributed as dist

    import portapipe

    out: dict[str, Any] = {"cases": []}
    replica = dist.get_rank() % dp  # pp x dp mesh: dp inside pp
    for schedule, n, tokens, w_split in cases:
        pipe = portapipe.pipeline(_modules(n, tokens), backend=backend, loss_fn=_loss, schedule=schedule, microbatches=M, dp=dp, w_split=w_split)
        result = pipe.step(*_batch(tokens, replica))
        has_w = any(h.kind.value == "W" for acts in pipe.schedule.actions for a in acts for h in a.halves())
        out["cases"].append((result.loss, {k: p.grad.clone() for k, p in pipe.named_parameters()}, has_w))
    if dp > 1:
        return out

    def refusal(**kw: Any) -> str:
        args: dict[str, Any] = dict(modules=_modules(2, True), backend=backend, loss_fn=_loss, schedule="1f1b", microbatches=M)
        batch = kw.pop("batch", _batch(True, 0))
        try:
            portapipe.pipeline(**(args | kw)).step(*batch)
        except ValueError as exc:
            return str(exc)
        return "no error"

    pipe = portapipe.pipeline(_scaled_modules(), backend=backend, loss_fn=_loss, schedule="zb1p", microbatches=M, boundary=_given_boundary)
    result = pipe.step(*_batch(False, 0))
    out["given_boundary"] = (result.loss, {k: p.grad.clone() for k, p in pipe.named_parameters()})
    frozen = _modules(2, True)  # a frozen embedding: no gradient, so the optimizer skips it
    frozen[0][0].weight.requires_grad_(False)
    pipe = portapipe.pipeline(frozen, backend=backend, loss_fn=_loss, schedule="dualpipe", microbatches=M)
    pipe.step(*_batch(True, 0))
    out["frozen"] = {k: None if p.grad is None else p.grad.clone() for k, p in pipe.named_parameters()}
    pipe = portapipe.pipeline(_restart_modules(), backend=backend, loss_fn=_loss, schedule="1f1b", microbatches=M)
    out["restart"] = (pipe.step(*_batch(True, 0)).loss, {k: p.grad.clone() for k, p in pipe.named_parameters()})
    out["errors"] = [
        refusal(modules=_scaled_modules(), batch=_batch(False, 0)),
        refusal(modules=_modules(3, True)),
        refusal(schedule="dualpipev"),
        refusal(schedule="gpipe"),
        refusal(schedule="dualpipev", modules=_modules(4, True), microbatches=2),
        refusal(modules=_modules(2, True, seed=dist.get_rank())),  # each rank built its own model
        refusal(batch=(torch.zeros(6, 5, dtype=torch.long), torch.zeros(6, 5, dtype=torch.long))),
    ]
    return out


def _check(results: list[dict[str, Any]], cases: list[tuple[str, int, bool, bool]], dp: int) -> None:
    for i, (schedule, n, tokens, w_split) in enumerate(cases):
        ref_loss, ref_grads = _reference(n, tokens, dp)
        ranks = [r["cases"][i] for r in results]
        assert all(loss == ref_loss for loss, _, _ in ranks), (schedule, [loss for loss, _, _ in ranks], ref_loss)
        for loss, named, _ in ranks:  # replicas and DualPipe copies hold identical gradients
            worst = max(float((g - ref_grads[k]).norm() / ref_grads[k].norm()) for k, g in named.items())
            assert worst <= 1e-12, (schedule, worst)
        assert {k for _, named, _ in ranks for k in named} == ref_grads.keys(), schedule
        assert ranks[0][2] == (w_split and schedule in ("zb1p", "dualpipe", "dualpipev")), schedule


@pytest.mark.multiproc
def test_plain_modules_under_every_schedule_equal_one_process() -> None:
    results = run_ranks(_rank, 2, CASES, 1)
    _check(results, CASES, 1)
    model = nn.Sequential(*_scaled_modules())
    x, y = _batch(False, 0)
    losses = [_loss(model(xm), ym) for xm, ym in zip(x.chunk(M), y.chunk(M))]
    (sum(losses) / M).backward()
    grads = {k: g for r in results for k, g in r["given_boundary"][1].items()}
    assert all(r["given_boundary"][0] == _in_order_mean(losses) for r in results)
    assert all(float((grads[k] - p.grad).norm() / p.grad.norm()) <= 1e-12 for k, p in model.named_parameters())
    _, ref_grads = _reference(2, True, 1)
    for r in results:  # DualPipe: both ranks hold both blocks and sum the copies' gradients
        assert r["frozen"]["0.0.weight"] is None and r["frozen"].keys() == ref_grads.keys()
        assert all(float((g - ref_grads[k]).norm() / ref_grads[k].norm()) <= 1e-12 for k, g in r["frozen"].items() if g is not None)
    model, (x, y) = nn.Sequential(*_restart_modules()), _batch(True, 0)
    losses = [_loss(model(xm), ym) for xm, ym in zip(x.chunk(M), y.chunk(M))]
    (sum(losses) / M).backward()
    grads = {k: g for r in results for k, g in r["restart"][1].items()}
    assert results[1]["restart"][0] == _in_order_mean(losses)
    assert all(torch.equal(grads[k], torch.zeros_like(grads[k])) for k in grads if k.startswith("0."))
    assert all(float((grads[k] - p.grad).norm() / p.grad.norm()) <= 1e-12 for k, p in model.named_parameters() if k.startswith("1."))
    errors = results[0]["errors"][1:]
    assert results[0]["errors"][0].startswith("cannot infer what stage 0 (module 0) outputs for inputs of shape [2, 5, 12]"), results[0]["errors"][0]
    assert "pass pipeline(..., boundary=...)" in results[0]["errors"][0]
    assert errors[0] == "1f1b on pp = 2 ranks runs 2 modules (one per model block); got 3"
    assert errors[1] == "dualpipev on pp = 2 ranks runs 4 modules (one per model block); got 2"
    assert errors[2].startswith("unknown schedule 'gpipe'; known: 1f1b, zb1p")
    assert errors[3].startswith("dualpipev with pp=2, microbatches=2:"), errors[3]
    assert errors[4].startswith("module 0 differs between ranks 0 and 1: every rank must build the same modules"), errors[4]
    assert errors[5].startswith("step() needs inputs and targets with the same batch size, a multiple of the 4 micro-batches; got 6 and 6")


@pytest.mark.multiproc
def test_plain_modules_with_data_parallel_replicas_equal_one_process() -> None:
    cases = [("dualpipev", 4, True, True), ("zb1p", 2, False, True)]
    _check(run_ranks(_rank, 4, cases, 2), cases, 2)


class _Float32Head(nn.Module):
    """A float32 block after a float64 one: the pipeline's buckets hold float64 gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.float())


def _mixed_modules() -> list[nn.Module]:
    torch.manual_seed(5)
    return [nn.Linear(12, 12, dtype=torch.float64), _Float32Head()]


def _mixed_rank(backend: Any) -> dict[str, Any]:
    import portapipe

    pipe = portapipe.pipeline(_mixed_modules(), backend=backend, loss_fn=_loss, schedule="dualpipev", microbatches=M)
    x, y = _batch(False, 0)
    pipe.step(x, y)
    storages = {b.grad.untyped_storage().data_ptr() for b in pipe.grads.buckets}
    in_buckets = [getattr(p, "main_grad", p.grad).untyped_storage().data_ptr() in storages for _, p in pipe.named_parameters()]
    once = {k: p.grad.clone() for k, p in pipe.named_parameters()}
    pipe.step(x, y, accumulate=True)
    return {"once": once, "twice": {k: p.grad.clone() for k, p in pipe.named_parameters()}, "dtype": str(pipe.dtype),
            "in_buckets": in_buckets}


@pytest.mark.multiproc
def test_parameters_of_two_dtypes_get_their_gradients_in_their_own_and_accumulate() -> None:
    """The buckets hold the wider dtype (float64); the float32 head's gradient comes back in
    float32, from a float64 sum over the micro-batches; an accumulating step adds to it."""
    got = run_ranks(_mixed_rank, 1)[0]
    model = nn.Sequential(*_mixed_modules())
    x, y = _batch(False, 0)
    for xm, ym in zip(x.chunk(M), y.chunk(M)):
        (_loss(model(xm), ym) / M).backward()
    assert got["dtype"] == "torch.float64" and all(got["in_buckets"])  # accumulated in the gradient buckets
    for k, p in model.named_parameters():
        g = got["once"][k]
        assert g.dtype == p.dtype, k
        torch.testing.assert_close(g, p.grad, rtol=1e-5 if p.dtype == torch.float32 else 1e-12, atol=0, msg=k)
        assert torch.equal(got["twice"][k], 2 * g), k  # the same step again, added to the first


@pytest.mark.multiproc
def test_the_own_model_example_runs_and_matches_one_process() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "own_model.py")], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = proc.stdout.strip().splitlines()[-1]
    assert line.startswith("pipelined loss ") and "one process" in line, line
    assert len((ROOT / "examples" / "own_model.py").read_text().splitlines()) < 60


def test_the_executor_refuses_stages_that_do_not_fit_the_schedule() -> None:
    from portapipe.backends.base import ParallelGroups
    from portapipe.backends.cpu import CPUBackend
    from portapipe.scheduling.executor import PipelineExecutor, make_schedule

    schedule = make_schedule("dualpipev", 1, 2)  # one rank holding blocks 0 and 1
    ok = {0: PlainStage(nn.Linear(2, 2), 0), 1: PlainStage(nn.Linear(2, 2), 1, _loss)}

    def make(stages: dict[int, PlainStage], pp: int = 1) -> PipelineExecutor:
        g = ParallelGroups(rank=0, world_size=pp, pp=pp, dp=1, ep=1, pp_rank=0, dp_rank=0, ep_rank=0)
        return PipelineExecutor(schedule, stages, CPUBackend(), g, boundary=lambda v, s: ((*s, 2), torch.float32))

    assert make(ok).blocks.keys() == {0, 1}
    with pytest.raises(ValueError, match=r"places blocks \[0, 1\] on pipeline rank 0, but the stages given are \[0\]"):
        make({0: ok[0]})
    with pytest.raises(ValueError, match=r"block 1 \(stage 1 of dualpipev\) ends a pipeline and must compute the loss"):
        make({0: ok[0], 1: PlainStage(nn.Linear(2, 2), 1)})
    with pytest.raises(ValueError, match=r"block 0 \(stage 0 of dualpipev\) feeds the next stage"):
        make({0: PlainStage(nn.Linear(2, 2), 0, _loss), 1: ok[1]})
    with pytest.raises(ValueError, match="schedule dualpipev has 1 ranks but the pipeline group has 2"):
        make(ok, pp=2)


def test_a_stage_that_does_not_watch_its_input_is_named() -> None:
    """A contract stage must pass its input through tape.watch, or no gradient can go back."""
    from portapipe.backends.base import ParallelGroups
    from portapipe.backends.cpu import CPUBackend
    from portapipe.optim.buckets import GradBuckets
    from portapipe.scheduling.executor import PipelineExecutor, make_schedule

    class Unwatched(PlainStage):
        def program(self, tape: Any, x: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
            return tape.part(self._loss, x, targets, plain=True)
            yield

    torch.manual_seed(0)
    stages = {0: PlainStage(nn.Linear(2, 2), 0), 1: Unwatched(nn.Linear(2, 2), 1, nn.functional.mse_loss)}
    g = ParallelGroups(rank=0, world_size=1, pp=1, dp=1, ep=1, pp_rank=0, dp_rank=0, ep_rank=0)
    ex = PipelineExecutor(make_schedule("dualpipev", 1, 2), stages, CPUBackend(), g, boundary=lambda v, s: (tuple(s), torch.float32))
    batch = [(torch.randn(3, 2), torch.randn(3, 2))] * 2
    with pytest.raises(RuntimeError, match=r"PipelineExecutor.step needs a grad_sync to own and sum the step's gradients"):
        ex.step(batch)  # nothing would own or reduce the gradients
    ex.grad_sync = GradBuckets(stages, g, ex.backend, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=0,
                               bucket_mb=1.0, overlap=True, copy_sum=ex.sum_copies, holders=ex.copy_holders)
    with pytest.raises(RuntimeError, match=r"1BW0: stage 1 gives no gradient for its input; its program must pass .* through tape.watch\(x\)"):
        ex.step(batch)
