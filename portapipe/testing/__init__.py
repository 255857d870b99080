"""The conformance kit: the contract every backend passes, built in or plug-in. (Beside it,
:mod:`.faults` injects faults into training ranks for the restart suite and benchmark.)

It sits beside the launcher, which its rank lines start ranks with; the backends below import
nothing of it (the old name ``portapipe.backends.testing`` only says that it moved).

A plug-in's author runs it with one line (the backend registered by its entry point; pytest comes
with the ``testing`` extra)::

    PORTAPIPE_CONFORMANCE_BACKEND=<name> pytest --pyargs portapipe.testing

Each contract line has a name; a failure names the line, what was expected and what came back.
Local lines run on one backend object (streams and events, timers, grouped matmul against
the reference, memory figures, RNG state, options, the capability declaration itself); rank
lines run on two ranks through portapipe's launcher (batched p2p, all-to-all with uneven
splits, reductions, reduce-scatter / all-gather), once per dtype the backend declares for that
operation family: a declaration promises behaviour, and the kit holds the backend to it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..backends.base import REDUCE_OPS, Backend, EventSpanClock, EventTimer
from ..backends.capabilities import Capabilities
from ..backends.fp8_mm import fp8_grouped_mm_emulated, fp8_mm_emulated
from ..backends.grouped_mm import grouped_mm_reference
from ..backends.scaled_mm import KIT_CALC_DIFF, KIT_SQNR_DB, calc_diff, probe_operands, sqnr_db
from ..ranks.launch import run_ranks
from ..optim.precision import unit_roundoff
from ..verify.tolerance import FLOAT32_SAFETY

def grouped_mm_tolerance(dtype: str, k: int) -> float:
    """Relative error (2-norm) a grouped matmul in ``dtype`` may show against the float64 reference
    of the same numbers, whose longest sum has ``k`` terms; derived as verify's tolerance is.

    Rounding the inputs and the result to ``dtype`` costs about one unit roundoff u (three
    roundings, each of typical size u / sqrt(3)); the sum of k terms, accumulated in ``dtype`` or
    float32 if wider (as every fused kernel does), adds sqrt(k) of its own roundoff (a random walk,
    Higham and Mary 2019). verify's factor (:data:`portapipe.verify.tolerance.FLOAT32_SAFETY` typical errors)
    on top: bfloat16 with k = 8 allows 1.6e-2, where a correct kernel errs by about 3e-3 and one
    that is 2% off fails.
    """
    u = unit_roundoff(dtype)
    return FLOAT32_SAFETY * (u + math.sqrt(k) * min(u, unit_roundoff("float32")))
ENV = "PORTAPIPE_CONFORMANCE_BACKEND"
OPTIONS_ENV = "PORTAPIPE_CONFORMANCE_OPTIONS"  # JSON backend_options, if the backend needs some


class ContractFailure(AssertionError):
    """A backend broke a contract line: ``line`` names it."""

    def __init__(self, line: str, message: str) -> None:
        self.line = line
        super().__init__(f"[{line}] {message}")


@dataclass(frozen=True)
class Contract:
    line: str
    what: str
    check: Callable[..., None]


def _require(line: str, cond: bool, message: str) -> None:
    if not cond:
        raise ContractFailure(line, message)


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


# ------------------------------------------------------------------------- local lines
def _capabilities(be: Backend, device: torch.device) -> None:
    caps = type(be).capabilities
    line = "capabilities-declared"
    _require(line, isinstance(caps, Capabilities), f"{type(be).__name__}.capabilities is {type(caps).__name__}, not a Capabilities")
    problems = caps.problems()
    if caps.dist_backend != type(be).dist_backend:
        problems.append(f"capabilities.dist_backend {caps.dist_backend!r} != the class's dist_backend {type(be).dist_backend!r}")
    _require(line, not problems, "; ".join(problems))


def _streams_and_events(be: Backend, device: torch.device) -> None:
    line = "streams-and-events"
    comm = be.comm_stream()
    if be.capabilities.streams:
        _require(line, comm is not be.compute_stream(), "capabilities.streams is true but comm_stream() is the compute stream")
    with be.stream(comm):
        x = torch.full((4,), 2.0, device=device) * 3
        ev = be.event()
        ev.record()
    be.compute_stream().wait_event(ev)
    be.synchronize()
    _require(line, x.cpu().tolist() == [6.0] * 4, f"work issued on the communication stream gave {x.cpu().tolist()}")


def _host_copies(be: Backend, device: torch.device) -> None:
    """Offload's copies: to a host buffer and back on the copy stream, bit for bit, ordered by
    the events they return; a stream of their own where declared ``async``, page-locked host
    memory on a real device."""
    line = "host-copies"
    kind = be.capabilities.host_copies
    if kind == "none":
        return
    src = torch.arange(4096, dtype=torch.float32, device=device) * 1.5 - 7.25
    host = be.host_buffer(src.numel(), src.dtype, device)
    _require(line, host.device.type == "cpu" and host.numel() == src.numel(), f"host_buffer gave {host.numel()} elements on {host.device}")
    be.copy_async(host, src).synchronize()  # the host reads it: the event says the copy ran
    _require(line, torch.equal(host, src.cpu()), "a copy to the host buffer does not hold the device tensor's values")
    back = torch.empty_like(src)
    be.wait_copy(be.copy_async(back, host))
    _require(line, torch.equal((back + 0).cpu(), src.cpu()), "a copy back from the host buffer does not hold the values sent")
    if kind == "async":
        _require(line, not (be.copy_stream() == be.compute_stream()), "capabilities.host_copies is async but copy_stream() is the compute stream")
        if device.type == be.device_type:  # a real device (a double plays it on CPU memory)
            _require(line, host.is_pinned(), "capabilities.host_copies is async but host_buffer() is not page-locked")


def _timer(be: Backend, device: torch.device) -> None:
    line = "timer"
    with be.timed() as t:
        (torch.ones(8, 8, device=device) @ torch.ones(8, 8, device=device)).sum()
    _require(line, math.isfinite(t.elapsed_s) and t.elapsed_s >= 0, f"elapsed_s = {t.elapsed_s}")
    events = isinstance(be.timer(), EventTimer)
    _require(line, events == (be.capabilities.timer == "events"), f"capabilities.timer is {be.capabilities.timer!r} but timer() is a {type(be.timer()).__name__}")


def _span_clock(be: Backend, device: torch.device) -> None:
    """A recorded step's clock: started before the step, marks taken in order around work and read
    once after it, on the host clock; by device events where ``capabilities.timer`` says events."""
    line = "span-clock"
    clock = be.span_clock()
    events = isinstance(clock, EventSpanClock)
    _require(line, events == (be.capabilities.timer == "events"),
             f"capabilities.timer is {be.capabilities.timer!r} but span_clock() is a {type(clock).__name__}")
    clock.start()
    marks = [clock.mark()]
    x = torch.ones(64, 64, device=device)
    for _ in range(3):
        x = x @ x / 64
        marks.append(clock.mark())
    times = clock.read(marks)
    _require(line, all(t is not None and math.isfinite(t) for t in times), f"read() gave {times}")
    _require(line, all(b >= a for a, b in zip(times, times[1:])), f"marks taken in order read out of order: {times}")
    host = time.perf_counter()
    _require(line, abs(times[-1] - host) < 60.0, f"the last mark reads {times[-1]:.3f} s, the host clock {host:.3f} s: not on the host's clock")


def _grouped_mm_case(be: Backend, device: torch.device, dtype: str, groups: int) -> None:
    line = "grouped-mm-matches-reference"
    g = torch.Generator().manual_seed(groups)
    counts = torch.randint(0, 4, (groups,), generator=g)
    counts[0] = 0  # an empty group
    rows = int(counts.sum()) + 2  # and rows past the last group's end
    offs = counts.cumsum(0)
    k, n = 8, 4
    a64 = torch.randn(rows, k, generator=g, dtype=torch.float64)
    b64 = torch.randn(groups, k, n, generator=g, dtype=torch.float64)
    tol = grouped_mm_tolerance(dtype, max(k, n, int(counts.max())))  # the longest sum: a row by a column, or a group's rows
    a = a64.to(device=device, dtype=_dtype(dtype), copy=True).requires_grad_()
    b = b64.to(device=device, dtype=_dtype(dtype), copy=True).requires_grad_()
    out = be.grouped_mm(a, b, offs.to(device))
    out.backward(torch.ones_like(out))
    ra, rb = a64.clone().requires_grad_(), b64.clone().requires_grad_()
    want = grouped_mm_reference(ra, rb, offs)
    want.backward(torch.ones_like(want))
    for what, got, ref in (("2d x 3d result", out, want), ("input gradient", a.grad, ra.grad), ("weight gradient", b.grad, rb.grad)):
        _require(line, got is not None and tuple(got.shape) == tuple(ref.shape), f"{dtype}, {groups} groups: {what} has shape {None if got is None else tuple(got.shape)}, want {tuple(ref.shape)}")
        ref = ref.detach()
        err = float((got.detach().cpu().to(torch.float64) - ref).norm()) / max(float(ref.norm()), 1e-300)
        _require(line, err <= tol, f"{dtype}, {groups} groups: {what} is {err:.3g} off the reference (relative), more than {tol:.3g}")
    # 2d x 2d: the weight-gradient form, groups along the shared axis
    x64 = torch.randn(k, int(offs[-1]), generator=g, dtype=torch.float64)
    y64 = torch.randn(int(offs[-1]), n, generator=g, dtype=torch.float64)
    got2 = be.grouped_mm(x64.to(device=device, dtype=_dtype(dtype)), y64.to(device=device, dtype=_dtype(dtype)), offs.to(device))
    ref2 = grouped_mm_reference(x64, y64, offs)
    err = float((got2.cpu().to(torch.float64) - ref2).norm()) / max(float(ref2.norm()), 1e-300)
    _require(line, tuple(got2.shape) == tuple(ref2.shape) and err <= tol,
             f"{dtype}, {groups} groups: 2d x 2d result {tuple(got2.shape)} is {err:.3g} off the reference, more than {tol:.3g}")


def _grouped_mm(be: Backend, device: torch.device) -> None:
    for dtype in be.capabilities.compute_dtypes:
        _grouped_mm_case(be, device, dtype, 5)


def _grouped_mm_limit(be: Backend, device: torch.device) -> None:
    # at the declared limit the fused kernel runs; past it the backend must still answer (a loop)
    limit = be.capabilities.grouped_mm_max_groups
    if limit is not None:
        for groups in (limit, limit + 1):
            _grouped_mm_case(be, device, "float32", groups)


def _fp8_close(line: str, what: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    _require(line, tuple(got.shape) == tuple(want.shape) and got.dtype == dtype,
             f"{what}: {tuple(got.shape)} {got.dtype}, want {tuple(want.shape)} {dtype}")
    s, d = sqnr_db(got.cpu(), want), calc_diff(got.cpu(), want)
    _require(line, s >= KIT_SQNR_DB and d < KIT_CALC_DIFF,
             f"{what}: SQNR {s:.1f} dB and calc_diff {d:.2e} against the emulation; want >= {KIT_SQNR_DB:g} dB and < {KIT_CALC_DIFF:g}")


def _fp8_matmul(be: Backend, device: torch.device) -> None:
    """The FP8 matmul against the emulation (the reference semantics), where one is declared: 1x128 x
    128x128 with ceil(K/128) = 3, 1x128 x 128x1 over a token count no multiple of 128, and the
    grouped forms (an empty group and rows past the last one included)."""
    if be.capabilities.fp8_matmul == "none":
        return
    line = "fp8-matmul-matches-emulation"
    a, sa, b, sb = probe_operands(device, m=40, seed=1)
    for dtype in (torch.float32, torch.bfloat16):
        want = fp8_mm_emulated(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), dtype)
        _fp8_close(line, f"fp8_mm 1x128 x 128x128 to {dtype}", be.fp8_mm(a, sa, b, sb, dtype), want, dtype)
    g = torch.Generator().manual_seed(2)
    cols = (torch.randn(200, 256, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    scol = torch.exp2(torch.randint(-3, 3, (2, 256), generator=g).float()).to(device)
    at = (torch.randn(128, 200, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    sat = torch.exp2(torch.randint(-3, 3, (128, 2), generator=g).float()).to(device)
    want = fp8_mm_emulated(at.cpu(), sat.cpu(), cols.cpu(), scol.cpu(), torch.float32)
    _fp8_close(line, "fp8_mm 1x128 x 128x1 over 200 rows", be.fp8_mm(at, sat, cols, scol, torch.float32), want, torch.float32)
    w = (torch.randn(3, 384, 256, generator=g) * 4).to(torch.float8_e4m3fn).to(device)
    sw = torch.exp2(torch.randint(-3, 3, (3, 3, 2), generator=g).float()).to(device)
    offs = torch.tensor([10, 10, 30], device=device)
    want = fp8_grouped_mm_emulated(a.cpu(), sa.cpu(), w.cpu(), sw.cpu(), offs.cpu(), torch.bfloat16)
    _fp8_close(line, "fp8_grouped_mm 2d x 3d", be.fp8_grouped_mm(a, sa, w, sw, offs, torch.bfloat16), want, torch.bfloat16)
    toffs = torch.tensor([100, 100, 200], device=device)  # tiles restart at each group: 1 + 0 + 1 of them
    want = fp8_grouped_mm_emulated(at.cpu(), sat.cpu(), cols.cpu(), scol.cpu(), toffs.cpu(), torch.float32)
    _fp8_close(line, "fp8_grouped_mm 2d x 2d", be.fp8_grouped_mm(at, sat, cols, scol, toffs, torch.float32), want, torch.float32)


def _memory(be: Backend, device: torch.device) -> None:
    line = "memory-figures"
    now, peak = be.memory_allocated(), be.max_memory_allocated()
    if not be.capabilities.memory_stats:
        _require(line, now is None, f"capabilities.memory_stats is false but memory_allocated() = {now!r} (None says: no allocator figures)")
        return
    _require(line, isinstance(now, int) and isinstance(peak, int) and 0 <= now <= peak, f"memory_allocated() = {now!r}, max_memory_allocated() = {peak!r}: want ints, 0 <= now <= peak")
    if device.type == be.device_type:  # a real device (a double plays it on CPU memory: no allocator to read)
        x = torch.empty(1 << 20, dtype=torch.uint8, device=device)
        grown = be.memory_allocated() - now
        _require(line, grown >= x.numel(), f"allocating 1 MiB raised memory_allocated() by {grown} bytes")
        del x
    be.reset_peak_memory_stats()
    after = be.max_memory_allocated()
    _require(line, isinstance(after, int) and after >= be.memory_allocated(), f"after reset_peak_memory_stats(), max_memory_allocated() = {after!r} < memory_allocated()")


def _rng(be: Backend, device: torch.device) -> None:
    state = be.get_rng_state()
    first = torch.rand(4)
    be.set_rng_state(state)
    _require("rng-state", torch.equal(torch.rand(4), first), "set_rng_state(get_rng_state()) does not replay the same draws")


def _options(be: Backend, device: torch.device) -> None:
    line = "options-refused"
    cls = type(be)
    if cls.option_keys is not None:
        try:
            cls({**be.options, "no_such_option": 1})
        except ValueError as exc:
            _require(line, "backend_options.no_such_option" in str(exc), f"an unknown option is refused without naming it: {exc}")
        else:
            raise ContractFailure(line, "an unknown backend option was accepted")
    try:
        cls({**be.options, "ep_transport": "no-such-transport"})
    except ValueError as exc:
        _require(line, "ep_transport" in str(exc), f"an unknown ep_transport is refused without naming the key: {exc}")
    else:
        raise ContractFailure(line, "ep_transport: no-such-transport was accepted")


LOCAL: tuple[Contract, ...] = (
    Contract("capabilities-declared", "the declaration is well formed and names the class's process-group backend", _capabilities),
    Contract("streams-and-events", "work on the communication stream, an event recorded there and waited on", _streams_and_events),
    Contract("host-copies", "a tensor to a host buffer and back on the copy stream, bit for bit; a stream of its own where declared async", _host_copies),
    Contract("timer", "timers measure a finite, non-negative time, by events where declared", _timer),
    Contract("span-clock", "a recorded step's marks read after it in order on the host clock, by events where declared", _span_clock),
    Contract("grouped-mm-matches-reference", "grouped matmul, forward and both gradients, equals the loop reference in every compute dtype", _grouped_mm),
    Contract("grouped-mm-group-limit", "at and past the declared group limit the result still equals the reference", _grouped_mm_limit),
    Contract("fp8-matmul-matches-emulation", "the FP8 matmul (dense and grouped) within 40 dB SQNR and 1e-4 calc_diff of the emulation, where declared", _fp8_matmul),
    Contract("memory-figures", "allocator figures where declared, None where not", _memory),
    Contract("rng-state", "the RNG state saved and restored replays the same draws", _rng),
    Contract("options-refused", "unknown options and transports are refused, naming the key", _options),
)


def run_local(be: Backend, device: torch.device | None = None, lines: tuple[Contract, ...] = LOCAL) -> dict[str, str | None]:
    """Every local line on ``be`` (tensors on ``device``, default the backend's): line -> failure or None."""
    device = be.device() if device is None else device
    out: dict[str, str | None] = {}
    for c in lines:
        try:
            c.check(be, device)
            out[c.line] = None
        except ContractFailure as exc:
            out[c.line] = str(exc)
    return out


# -------------------------------------------------------------------------- rank lines
def _p2p(be: Backend, device: torch.device, dtype: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    send = (torch.arange(5) + 10 * rank).to(device=device, dtype=_dtype(dtype))
    recv = torch.empty(5, device=device, dtype=_dtype(dtype))
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for work in be.batch_isend_irecv(ops):
        work.wait()
    want = [float(i + 10 * ((rank - 1) % world)) for i in range(5)]
    _require("p2p-batched", recv.cpu().tolist() == want, f"{dtype}: rank {rank} received {recv.cpu().tolist()}, want {want}")


def _all_to_all(be: Backend, device: torch.device, dtype: str) -> None:
    """Rank r sends r+j+1 rows to rank j, each row (src, dst, index); once plain, once as the expert transport."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ins = [rank + j + 1 for j in range(world)]
    outs = [j + rank + 1 for j in range(world)]
    inp = torch.tensor([[rank, j, i] for j in range(world) for i in range(ins[j])], dtype=_dtype(dtype), device=device)
    want = [[float(j), float(rank), float(i)] for j in range(world) for i in range(outs[j])]
    for name, call in (("all_to_all_single", be.all_to_all_single), ("expert_all_to_all", be.expert_all_to_all)):
        out = torch.empty(sum(outs), 3, dtype=_dtype(dtype), device=device)
        call(out, inp, outs, ins, async_op=True).wait()
        _require("all-to-all-uneven", out.cpu().tolist() == want, f"{dtype} {name}: rank {rank} received {out.cpu().tolist()}, want {want}")


def _byte_rows(be: Backend, device: torch.device, dtype: str) -> None:
    """The FP8 dispatch's rows are bytes: all-to-all and the expert transport move uint8 rows unchanged."""
    if be.capabilities.fp8_matmul == "none":
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    ins = [rank + j + 1 for j in range(world)]
    outs = [j + rank + 1 for j in range(world)]
    inp = torch.tensor([[(7 * rank + 3 * j + i + b) % 256 for b in range(37)] for j in range(world) for i in range(ins[j])], dtype=torch.uint8, device=device)
    want = [[(7 * j + 3 * rank + i + b) % 256 for b in range(37)] for j in range(world) for i in range(outs[j])]
    for name, call in (("all_to_all_single", be.all_to_all_single), ("expert_all_to_all", be.expert_all_to_all)):
        out = torch.empty(sum(outs), 37, dtype=torch.uint8, device=device)
        call(out, inp, outs, ins, async_op=True).wait()
        _require("all-to-all-bytes", out.cpu().tolist() == want, f"uint8 {name}: rank {rank} received other bytes than were sent")


def _reduced(op: str, world: int) -> list[float]:
    """What every rank holds after reducing rank r's :func:`_contribution` by ``op`` over ``world`` ranks."""
    cols = list(zip(*(_contribution(r) for r in range(world))))
    return [{"SUM": sum, "PRODUCT": math.prod, "MIN": min, "MAX": max}[op](c) for c in cols]


def _contribution(rank: int) -> list[float]:
    # small integers and halves, exact in every dtype; the four ops give four different answers
    v = float(rank + 2)
    return [v, -v, v / 2]


def _reductions(be: Backend, device: torch.device, dtype: str) -> None:
    """all_reduce (async) by every op of the interface (REDUCE_OPS): an op ignored is a wrong answer."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for op in REDUCE_OPS:
        t = torch.tensor(_contribution(rank), dtype=_dtype(dtype), device=device)
        be.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True).wait()
        want = _reduced(op, world)
        _require("reductions", t.cpu().tolist() == want, f"{dtype} all_reduce {op}: {t.cpu().tolist()}, want {want}")


def _moves(be: Backend, device: torch.device, dtype: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    parts = [torch.empty(2, dtype=_dtype(dtype), device=device) for _ in range(world)]
    be.all_gather(parts, torch.tensor([rank, 2 * rank], dtype=_dtype(dtype), device=device))
    got = [p.cpu().tolist() for p in parts]
    _require("gather-and-broadcast", got == [[float(r), float(2 * r)] for r in range(world)], f"{dtype} all_gather: {got}")
    b = torch.tensor([float(rank)], dtype=_dtype(dtype), device=device)
    be.broadcast(b, src=world - 1)
    _require("gather-and-broadcast", b.item() == float(world - 1), f"{dtype} broadcast from rank {world - 1}: {b.item()}")


def _shards(be: Backend, device: torch.device, dtype: str) -> None:
    """The distributed optimizer's pair: rank r gets slice r of the sum, then the slices joined."""
    caps = be.capabilities
    rank, world = dist.get_rank(), dist.get_world_size()
    whole = [float(i * world * (world + 1) // 2) for i in range(2 * world)]
    if caps.reduce_scatter and dtype in caps.reduce_dtypes:
        shard = torch.empty(2, dtype=_dtype(dtype), device=device)
        be.reduce_scatter_tensor(shard, (torch.arange(2 * world) * (rank + 1)).to(device=device, dtype=_dtype(dtype)))
        _require("reduce-scatter-all-gather", shard.cpu().tolist() == whole[2 * rank : 2 * rank + 2], f"{dtype} reduce_scatter_tensor: {shard.cpu().tolist()}")
        for op in REDUCE_OPS:  # slice j of rank r's input is its contribution's value j % 3
            shard = torch.empty(3, dtype=_dtype(dtype), device=device)
            be.reduce_scatter_tensor(shard, torch.tensor(_contribution(rank) * world, dtype=_dtype(dtype), device=device), op=getattr(dist.ReduceOp, op))
            want = _reduced(op, world)
            _require("reduce-scatter-all-gather", shard.cpu().tolist() == want, f"{dtype} reduce_scatter_tensor {op}: {shard.cpu().tolist()}, want {want}")
    if caps.all_gather_into_tensor and dtype in caps.move_dtypes:
        joined = torch.empty(2 * world, dtype=_dtype(dtype), device=device)
        mine = torch.tensor(whole[2 * rank : 2 * rank + 2], dtype=_dtype(dtype), device=device)
        be.all_gather_into_tensor(joined, mine, async_op=True).wait()
        _require("reduce-scatter-all-gather", joined.cpu().tolist() == whole, f"{dtype} all_gather_into_tensor: {joined.cpu().tolist()}")


def _span_clock_done(be: Backend, device: torch.device, dtype: str) -> None:
    """The completion mark of an async all-reduce reads between its issue and the end of its wait."""
    line = "span-clock-done"
    clock = be.span_clock()
    clock.start()
    t = torch.ones(1 << 16, device=device)
    issued = clock.mark()
    work = be.all_reduce(t, async_op=True)
    done = clock.done(work)
    work.wait()
    after = clock.mark()
    got = clock.read([issued, done, after])
    _require(line, got[1] is not None, "done() of an async all-reduce gave no completion time")
    # a completion callback may run a moment after wait() returned on the host
    _require(line, got[0] <= got[1] <= got[2] + 0.05, f"issued {got[0]:.6f}, done {got[1]:.6f}, waited until {got[2]:.6f} (seconds)")


#: (line, what, check, the dtype family it runs over)
RANK_LINES: tuple[tuple[str, str, Callable[..., None], str], ...] = (
    ("p2p-batched", "batched send / receive around a ring, in every move dtype", _p2p, "move_dtypes"),
    ("all-to-all-uneven", "all-to-all and the expert transport with uneven splits, async, in every move dtype", _all_to_all, "move_dtypes"),
    ("all-to-all-bytes", "all-to-all and the expert transport of uint8 rows (an FP8 dispatch's), where an FP8 matmul is declared", _byte_rows, "fp8_once"),
    ("reductions", "all-reduce (async) by every op of the interface (sum, product, min, max) in every reduce dtype", _reductions, "reduce_dtypes"),
    ("gather-and-broadcast", "all-gather and broadcast in every move dtype", _moves, "move_dtypes"),
    ("reduce-scatter-all-gather", "reduce-scatter (by every op) and all-gather into one tensor, where declared", _shards, "move_dtypes"),
    ("span-clock-done", "the span clock's completion mark of an async all-reduce lies between its issue and its wait's end", _span_clock_done, "once"),
)


def rank_contracts(be: Backend) -> dict[str, str | None]:
    """On every rank (run through :func:`portapipe.ranks.launch.run_ranks`): line -> failure or None."""
    device = be.device()
    out: dict[str, str | None] = {}
    for line, _, check, family in RANK_LINES:
        out[line] = None
        try:
            for dtype in {"fp8_once": ("uint8",), "once": ("float32",)}.get(family) or getattr(be.capabilities, family):
                check(be, device, dtype)
        except ContractFailure as exc:
            out[line] = str(exc)
        except Exception as exc:  # a collective the backend declares but cannot run
            out[line] = f"[{line}] {type(exc).__name__}: {exc}"
    return out


def run_ranks_contracts(name: str, options: dict[str, Any] | None = None, world: int = 2) -> dict[str, str | None]:
    """Every rank line on ``world`` ranks of backend ``name``: line -> the first rank's failure, or None."""
    per_rank = run_ranks(rank_contracts, world, backend=name, backend_options=options or {}, wall_timeout_s=300)
    return {line: next((r[line] for r in per_rank if r[line]), None) for line, *_ in RANK_LINES}
