"""F&B overlap: the two programs interleave at every in-flight all-to-all, results unchanged."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ModelConfig
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.models.moe import build_blocks
from portapipe.scheduling.overlap import Tape, run, run_pair
from portapipe.scheduling.wgrad import WeightGradQueue

LOG: list[tuple[str, str]] = []
LABEL = ["-"]


class _Flight:
    in_flight = True


def _fake(name: str, steps: int) -> Generator[Any, None, str]:
    for i in range(steps):
        LOG.append((name, f"compute{i}"))
        yield _Flight()
    return name


def test_run_pair_alternates_at_in_flight_yields_and_drains_the_longer_program() -> None:
    LOG.clear()
    assert run_pair(_fake("F", 3), _fake("B", 1)) == ("F", "B")
    assert LOG == [("F", "compute0"), ("B", "compute0"), ("F", "compute1"), ("F", "compute2")]


def test_run_pair_does_not_switch_on_finished_exchanges() -> None:
    class _Done:
        in_flight = False

    def prog(name: str) -> Generator[Any, None, None]:
        for i in range(2):
            LOG.append((name, str(i)))
            yield _Done()

    LOG.clear()
    run_pair(prog("F"), prog("B"))
    assert LOG == [("F", "0"), ("F", "1"), ("B", "0"), ("B", "1")]


class _Work:
    def __init__(self, label: str) -> None:
        self.label = label

    def wait(self) -> None:
        LOG.append((LABEL[0], "wait"))


class _LoopbackBackend(CPUBackend):
    """One process playing both EP ranks with identical data: every exchange returns what was sent."""

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        output.copy_(input)

    def expert_all_to_all(self, output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> _Work:
        output.copy_(input)
        LOG.append((LABEL[0], "issue"))
        return _Work(LABEL[0])


def _labelled(name: str, program: Generator[Any, None, Any]) -> Generator[Any, None, Any]:
    while True:
        LABEL[0] = name
        try:
            item = next(program)
        except StopIteration as stop:
            return stop.value
        yield item


CFG = ModelConfig(
    dtype="float64", vocab_size=32, hidden=16, n_layers=3, n_dense=0, n_heads=2, moe_hidden=16,
    n_experts=4, top_k=2, seq_len=8, n_shared=1,
)


def _setup() -> tuple[Any, list[tuple[torch.Tensor, torch.Tensor]]]:
    ep = ExpertParallel(_LoopbackBackend(), size=2, rank=0)
    blocks = build_blocks(CFG, [0], 1, ep, seed=11)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)) for _ in range(2)]
    return blocks[0], data


def _grads(block: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}


def _fb(overlap: bool) -> tuple[dict[str, torch.Tensor], float, list[tuple[str, str]]]:
    """Forward mb0, then F(mb1) & B(mb0) (overlapped or one after the other), then B(mb1)."""
    block, data = _setup()
    t0, t1 = Tape(), Tape()
    loss0 = run(block.program(t0, *data[0]))
    LOG.clear()
    queue = WeightGradQueue()
    fwd = _labelled("F", block.program(t1, *data[1]))
    bwd = _labelled("B", t0.backward(loss0, torch.ones_like(loss0), queue))
    if overlap:
        loss1, _ = run_pair(fwd, bwd)
    else:
        loss1 = run(fwd)
        run(bwd)
    log = list(LOG)
    run(t1.backward(loss1, torch.ones_like(loss1)))
    queue.run()
    return _grads(block), float(loss1.detach()), log


def test_fb_overlap_computes_the_other_microbatch_while_each_exchange_is_in_flight() -> None:
    grads, loss, log = _fb(overlap=True)
    # 3 MoE layers x 2 exchanges per direction (rows with their router weights, combine), each issued then waited
    assert [e for e in log if e[0] == "F"].count(("F", "issue")) == 6
    assert [e for e in log if e[0] == "B"].count(("B", "issue")) == 6
    # Between every issue and its wait, the other micro-batch's program ran (it issued or waited
    # on something of its own, which it reaches only after computing its part).
    open_: dict[str, int] = {}
    hidden = 0
    for i, (who, what) in enumerate(log):
        if what == "issue":
            open_[who] = i
        elif who in open_:
            start = open_.pop(who)
            hidden += any(other != who for other, _ in log[start + 1 : i])
    assert hidden >= 10  # of 12: all but the last exchanges of the shorter program at most

    ref_grads, ref_loss, ref_log = _fb(overlap=False)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n  # the same arithmetic, only reordered
    # sequential: every exchange is waited for before the other program starts
    assert ref_log.index(("B", "issue")) > max(i for i, e in enumerate(ref_log) if e[0] == "F")


def test_lone_forward_hides_the_dispatch_behind_the_shared_expert_and_the_combine_behind_the_local_rows() -> None:
    block, data = _setup()
    calls: list[str] = []

    class Logging(Tape):
        def part(self, fn: Any, *args: Any) -> Any:
            local = fn.__name__ == "experts_part" and args[-1] is True
            calls.append(fn.__name__ + (" local" if local else ""))
            return super().part(fn, *args)

        def all_to_all(self, *args: Any) -> Any:
            calls.append("exchange")
            return super().all_to_all(*args)

    run(block.program(Logging(), *data[0]))
    first_layer = calls[1 : calls.index("combine_part") + 1]
    assert first_layer == [
        "attention_part", "exchange", "shared_part", "experts_part", "exchange", "experts_part local", "combine_part",
    ]


# ------------------------------------------------------- what the tape records, and refuses
def test_a_tensor_made_between_parts_is_refused_rather_than_losing_its_gradient() -> None:
    import pytest

    lin = torch.nn.Linear(3, 3, dtype=torch.float64)
    x = torch.randn(2, 3, dtype=torch.float64)

    def made_between(tape: Tape, x: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
        h = tape.part(lin, tape.watch(x))
        return tape.part(torch.tanh, h * 2)  # h * 2 is not recorded: its gradient would not reach h
        yield

    with pytest.raises(ValueError, match=r"tape.part\(tanh\) argument 0 carries a gradient but is not the output of a part"):
        run(made_between(Tape(), x))

    def output_between(tape: Tape, x: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
        return tape.part(lin, tape.watch(x)) * 2
        yield

    tape = Tape()
    out = run(output_between(tape, x))
    with pytest.raises(ValueError, match="the stage's output carries a gradient but is not the output of a part"):
        run(tape.backward(out, torch.ones_like(out)))
    # the same code inside parts: recorded, and the gradients are autograd's
    tape = Tape()
    h = tape.part(lin, tape.watch(x))
    out = tape.part(lambda t: torch.tanh(t * 2), h)
    gx = run(tape.backward(out, torch.ones_like(out)))
    xr = x.clone().requires_grad_()
    lin.zero_grad()
    torch.tanh(lin(xr) * 2).backward(torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(gx, xr.grad)


def test_a_parameter_passed_to_a_part_gets_its_gradient() -> None:
    w = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.float64))
    x = torch.randn(2, 3, dtype=torch.float64)
    tape = Tape()
    out = tape.part(torch.matmul, tape.watch(x), w)
    gx = run(tape.backward(out, torch.ones_like(out)))
    assert torch.equal(w.grad, x.t() @ torch.ones(2, 3, dtype=torch.float64))
    assert torch.equal(gx, torch.ones(2, 3, dtype=torch.float64) @ w.detach().t())


# ------------------------------------------------ a lone backward hides its own exchanges
def _lone_backward_log(mode: str, monkeypatch: Any) -> tuple[list[str], dict[str, torch.Tensor], torch.Tensor]:
    """One micro-batch's forward, then its backward alone (``mode`` BW; B and its W; B+, a B
    whose queue may fill its waits, and its W); the log of the top layer's events: exchanges
    issued and waited for, the shared expert's backward, the experts' weight gradients, and
    the W action's start."""
    import portapipe.scheduling.wgrad as wgrad

    block, data = _setup()
    top = list(block.layers.values())[-1]
    events: list[str] = []
    original = top.shared_part

    def shared_part(hn: torch.Tensor, zm: Any = None) -> torch.Tensor:
        out = original(hn, zm)
        out.register_hook(lambda g: events.append("shared backward"))
        return out

    top.shared_part = shared_part  # type: ignore[method-assign]
    experts = top.experts_part

    def experts_part(*args: Any) -> torch.Tensor:
        out = experts(*args)
        if args[-1] is True:  # the rows this rank routed to itself
            out.register_hook(lambda g: events.append("local experts backward"))
        return out

    top.experts_part = experts_part  # type: ignore[method-assign]
    accumulate = wgrad.accumulate_grad

    def logged(param: torch.Tensor, grad: torch.Tensor) -> None:
        if param is top.moe.experts.gate_up:
            events.append("experts W")
        accumulate(param, grad)

    monkeypatch.setattr(wgrad, "accumulate_grad", logged)
    tape = Tape()
    loss = run(block.program(tape, *data[0]))
    LOG.clear()
    queue = None if mode == "BW" else WeightGradQueue(fill_waits=mode == "B+")
    original_issue, original_wait = _LoopbackBackend.expert_all_to_all, _Work.wait

    def issue(self: Any, *args: Any, **kwargs: Any) -> _Work:
        events.append("issue")
        return original_issue(self, *args, **kwargs)

    def wait(self: _Work) -> None:
        events.append("wait")
        original_wait(self)

    monkeypatch.setattr(_LoopbackBackend, "expert_all_to_all", issue)
    monkeypatch.setattr(_Work, "wait", wait)
    run(tape.backward(loss, torch.ones_like(loss), queue))
    if queue is not None:
        events.append("W")
        queue.run()
    return events, _grads(block), loss.detach()


def test_a_lone_backward_issues_each_reverse_exchange_first_and_computes_beside_it(monkeypatch: Any) -> None:
    # the top layer: the combine's reverse exchange goes out, then the local rows' experts
    # backward and the shared expert's backward run while it travels; the received rows'
    # experts backward needs its rows; then the rows' reverse exchange (with the router
    # weights' gradients) goes out
    events, b_grads, _ = _lone_backward_log("B", monkeypatch)
    assert events[:6] == ["issue", "local experts backward", "shared backward", "wait", "issue", "wait"]
    assert events.count("experts W") == 2 and events.index("experts W") > events.index("W")  # all at the W
    # a full backward also computes the experts' weight gradients while the rows travel: the
    # local rows' behind the combine's, the received rows' behind the dispatch's
    events, bw_grads, _ = _lone_backward_log("BW", monkeypatch)
    expected = ["issue", "local experts backward", "shared backward", "experts W", "wait", "issue", "experts W", "wait"]
    assert events[:8] == expected
    # so does a B allowed to start its W's work (these exchanges never report arrival), in the
    # same order; its W computes what was queued after the last wait
    events, early_grads, _ = _lone_backward_log("B+", monkeypatch)
    assert events[:8] == expected and "experts W" not in events[events.index("W"):]
    assert b_grads.keys() == bw_grads.keys() == early_grads.keys()
    for n in b_grads:
        assert torch.equal(b_grads[n], bw_grads[n]), n  # the same arithmetic, reordered
        assert torch.equal(b_grads[n], early_grads[n]), n


def test_a_b_fills_a_wait_with_its_oldest_weight_gradients_until_the_rows_arrive() -> None:
    done: list[int] = []
    queue = WeightGradQueue(fill_waits=True)
    for i in range(4):
        queue.put(lambda i=i: done.append(i))
    queue.run_until(lambda: len(done) == 2)  # the rows arrive after two entries
    assert done == [0, 1] and len(queue) == 2
    queue.put(lambda: done.append(4))
    queue.run()  # the W: the rest, in queue order
    assert done == [0, 1, 2, 3, 4] and len(queue) == 0
    queue.run_until(lambda: False)  # nothing left: returns


def test_the_data_ordered_backward_gives_the_plain_graphs_gradients() -> None:
    block, data = _setup()
    tape = Tape()
    loss = run(block.program(tape, *data[0]))
    run(tape.backward(loss, torch.ones_like(loss)))
    grads = _grads(block)
    block.zero_grad(set_to_none=True)
    ref = run(block.program(Tape(record=False), *data[0]))
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    for n, g in _grads(block).items():
        assert torch.equal(grads[n], g), n  # bit for bit: the plain reverse walk's order of the terms


def _memory_lone_backward(memory: Any, instrument: Any) -> tuple[list[str], dict[str, torch.Tensor]]:
    """One micro-batch through a block with the ``memory`` options, then its lone B and W; the
    events ``instrument(layers, events)`` arranges to log, and each layer's attention backward."""
    from portapipe.memory.policy import configure

    block, data = _setup()
    configure({0: block}, memory)
    layers = list(block.layers.values())
    events: list[str] = []
    instrument(layers, events)
    for i, layer in enumerate(layers):
        def attention_part(x: torch.Tensor, _i: int = i, _f: Any = layer.attention_part) -> Any:
            out = _f(x)
            out[0].register_hook(lambda g: events.append(f"attention {_i} backward"))
            return out

        layer.attention_part = attention_part  # type: ignore[method-assign]
    tape = Tape()
    loss = run(block.program(tape, *data[0]))
    queue = WeightGradQueue()
    run(tape.backward(loss, torch.ones_like(loss), queue))
    queue.run()
    return events, _grads(block)


def test_recompute_replays_the_next_layer_beside_the_backward_above_with_the_same_gradients() -> None:
    from portapipe.config import MemoryConfig

    def log_replays(layers: list[Any], events: list[str]) -> None:
        for i, layer in enumerate(layers):
            def experts_part(*args: Any, _i: int = i, _f: Any = layer.experts_part) -> torch.Tensor:
                if torch.is_grad_enabled():  # recorded: the replay (the first forward keeps nothing)
                    events.append(f"replay {_i}")
                return _f(*args)

            layer.experts_part = experts_part  # type: ignore[method-assign]

    events, grads = _memory_lone_backward(MemoryConfig(recompute="moe"), log_replays)
    # the layer below is replayed while the top layer's replay and backward exchange rows,
    # before the top layer's attention (which its output feeds) even starts its backward
    assert events.index("replay 2") < events.index("replay 1") < events.index("attention 2 backward")
    _, ref = _memory_lone_backward(MemoryConfig(recompute="none"), log_replays)
    assert grads.keys() == ref.keys()
    for n in grads:
        assert torch.equal(grads[n], ref[n]), n


def test_zero_memorys_re_dispatch_starts_one_layer_ahead_during_the_waits_above(monkeypatch: Any) -> None:
    from portapipe.config import MemoryConfig
    from portapipe.memory import zero_memory

    def log_redispatches(layers: list[Any], events: list[str]) -> None:
        index = {id(layer.memory.zero_memory): i for i, layer in enumerate(layers) if layer.memory is not None}
        issue = zero_memory.ExpertRefetch.issue

        def logged(self: Any) -> None:
            if self._pending is None and self._inputs is None:
                events.append(f"re-dispatch {index[id(self.config)]}")
            issue(self)

        monkeypatch.setattr(zero_memory.ExpertRefetch, "issue", logged)

    events, grads = _memory_lone_backward(MemoryConfig(zero_memory="level0"), log_redispatches)
    # layer 1's rows are fetched again while layer 2 still waits for its exchanges, layer 0's
    # only once layer 1's backward is under way: one layer ahead, no more
    assert events.index("re-dispatch 2") < events.index("re-dispatch 1") < events.index("attention 2 backward")
    assert events.index("attention 2 backward") < events.index("re-dispatch 0") < events.index("attention 1 backward")
    _, ref = _memory_lone_backward(MemoryConfig(zero_memory="off"), lambda layers, events: None)
    for n in ref:
        assert torch.equal(grads[n], ref[n]), n


# ------------------------------------------- which Bs may start their W's work in their waits
def _early(*lists: str) -> list[list[tuple[int, int]]]:
    from portapipe.scheduling.ir import parse_action
    from portapipe.scheduling.wgrad import early_weight_grads

    stage_block = [0, 1, 1, 0]  # stages 0 and 3 share block 0 (as DualPipe's copies would)
    return [sorted(early_weight_grads([parse_action(a) for a in text.split()], stage_block)) for text in lists]


def test_a_b_starts_its_w_work_early_only_if_nothing_between_adds_to_its_blocks_gradients() -> None:
    assert _early(
        "0F0 0B0 0SEND_B0 0W0",  # only a post between
        "0F0 0F1 0B0 1BW0 0W0",  # another block's backward between
        "0F0 0F1 0B0 0B1 0W0 0W1",  # another B of the block between: neither (0B1's W has 0W0 between)
        "0F0 0B0 3BW0 0W0",  # the same block through another stage
        "0F0 0F1 0B0 (0F2;1BW0) 0W0",  # a pair of another block
        "0F0 0F1 0B0 (1F0;0BW1) 0W0",  # a pair adding to the block
        "0F0 0BW0 0F1 0B1 0F2 0W1",  # a forward between
    ) == [[(0, 0)], [(0, 0)], [], [], [(0, 0)], [], [(0, 1)]]


def test_the_executor_gives_those_bs_a_queue_that_fills_their_waits() -> None:
    from types import SimpleNamespace

    from portapipe.scheduling.ir import parse_action
    from portapipe.scheduling.runnable import make_schedule
    from portapipe.scheduling.step_run import StepRun
    from portapipe.scheduling.wgrad import early_weight_grads

    s = make_schedule("dualpipev", 2, 4)
    early = early_weight_grads(s.actions[0], s.stage_block)
    assert (3, 0) in early and (3, 1) not in early  # 3B0 3W0 back to back; 3BW1 is a full backward
    rt = SimpleNamespace(
        schedule=s, actions=s.actions[0], device=torch.device("cpu"), grad_scale=1.0, groups=SimpleNamespace(dp=1, ep=1),
        early_weight_grads=early,
    )
    run_ = StepRun(rt, [(torch.zeros(1), torch.zeros(1))] * 4)
    for mb, fills in ((0, True), (2, False)):  # stage 3 is the last: its backward starts from the loss
        tape = Tape()
        out = tape.part(lambda v: (v * 3).sum(), tape.watch(torch.ones(2)))
        run_.tapes[(3, mb)] = (tape, out)
        run(run_._backward(parse_action(f"3B{mb}")))
        assert run_.queues[(3, mb)].fill_waits is fills


def test_a_tensor_read_by_several_parts_sums_its_terms_in_the_plain_reverse_walks_order() -> None:
    """Four parts read the stage input: its gradient has four terms, and a float sum of more than
    two terms depends on their order. The tape adds them latest consumer first, as autograd's
    reverse walk does, so the result is bit for bit the plain graph's (any other order is not)."""
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(64, 64, dtype=torch.float64, generator=g) for _ in range(4)]
    fns = [lambda x: (x @ w[0]).tanh(), lambda x: (x @ w[1]).sin(), lambda x: (x @ w[2]).cos(), lambda x: x @ w[3]]

    def program(tape: Tape, x: torch.Tensor) -> Generator[Any, None, torch.Tensor]:
        x = tape.watch(x)
        outs = [tape.part(f, x) for f in fns]
        return tape.part(lambda a, b, c, d: (a * b + c * d).sum(), *outs)
        yield

    x = torch.randn(32, 64, dtype=torch.float64, generator=g)
    tape = Tape()
    loss = run(program(tape, x))
    got = run(tape.backward(loss, torch.ones_like(loss)))
    plain = x.clone().requires_grad_(True)
    ref = run(program(Tape(record=False), plain))
    ref.backward()
    assert torch.equal(loss.detach(), ref.detach())
    assert torch.equal(got, plain.grad)
