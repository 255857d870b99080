"""``portapipe profile``: measure a device profile on the configured backend.

Every rank of the config's world joins; the measurements run on as few ranks as they need
while the others wait at a barrier, so ranks sharing a host's processors do not slow each
other down (the time model adds that sharing back for the layouts it prices):

Compute (parts, the programs' own work, issuing exchanges, the optimizer) is timed as the
thread's processor time, which other processes on the machine do not inflate; communication
as the wall time of the least disturbed repetition.

- parts: the whole model as one block on an expert-parallel group of the config's ``ep`` ranks
  (fewer when the host has fewer processors), a few micro-batches of two sizes per memory
  option; every part's forward, input-gradient backward and weight-gradient pass timed through
  an observer on the tape (:func:`portapipe.scheduling.overlap.observing`), then fitted as
  ``fixed + per_unit * units``;
- saved bytes: each part's bytes kept for backward, counted by
  :class:`~portapipe.memory.accounting.SavedActivations` one micro-batch at a time;
  The attention part's blocking exchange of per-expert row counts waits without using the
  processor, so its processor time leaves the exchange out; the time model adds it per EP size.
- communication: all-to-all and all-reduce over groups of 2, 4, ... ranks, point-to-point
  between two ranks, each at two sizes; for the all-to-all and point-to-point also the
  processor time the process's other threads (gloo's) spend on them, which competes with the
  compute of ranks sharing a host's processors;
- AdamW's step per parameter element, and the expert loads the profiling batches produced.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config, MemoryConfig, config_from_dict
from ..memory import accounting
from ..memory.policy import configure
from ..models.expert_parallel import ExpertParallel
from ..scheduling.exchange import exchange
from ..scheduling.wgrad import WeightGradQueue
from ..models.moe import DTYPES, build_blocks
from ..scheduling.overlap import Tape, observing, run
from .executor_cost import action_cost
from .profile import FORMAT, Linear, Profile
from .shape import Shape

PART_NAMES = {
    "embed_part": "embed", "attention_part": "attention", "dense_part": "dense", "experts_part": "experts",
    "shared_part": "shared", "combine_part": "combine", "loss_part": "head",
}
MEMORY = {
    "off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"},
    "recompute_moe": {"recompute": "moe"}, "recompute_full": {"recompute": "full"},
}


def part_name(fn: Callable[..., Any]) -> str:
    """The model part a tape step runs ("other" for helpers such as recompute's captures)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return PART_NAMES.get(getattr(fn, "__name__", ""), "other")


def part_units(name: str, args: tuple[Any, ...]) -> int:
    """Tokens a part call handles (routed rows for the experts)."""
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if first is None:
        return 0
    if name == "experts" or name == "embed":
        return int(first.shape[0]) if name == "experts" else int(first.numel())
    return int(first.numel() // first.shape[-1])


# ------------------------------------------------------------------------------ observers
class _Note:
    def __init__(self, timer: PartTimer, name: str, units: int) -> None:
        self.timer, self.name, self.units = timer, name, units

    @contextlib.contextmanager
    def backward(self, queue: WeightGradQueue | None) -> Iterator[None]:
        if isinstance(queue, TaggedQueue):
            queue.current = self
        t0 = cpu()
        yield
        self.timer.add(self.name, "B" if queue is not None else "BW", self.units, cpu() - t0)


class PartTimer:
    """Observer timing every part's forward and backward: ``samples[(part, phase)]`` holds
    ``(units, seconds)`` pairs of this round."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)

    def add(self, name: str, phase: str, units: int, seconds: float) -> None:
        self.samples[(name, phase)].append((units, seconds))

    def total(self, phase: str) -> tuple[float, int]:
        """Seconds and calls of ``phase`` (F, or B for input-gradient backwards) seen so far."""
        got = [s for (_, ph), v in self.samples.items() if ph == phase for _, s in v]
        return sum(got), len(got)

    @contextlib.contextmanager
    def forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Iterator[_Note]:
        name = part_name(fn)
        note = _Note(self, name, part_units(name, args))
        t0 = cpu()
        yield note
        self.add(name, "F", note.units, cpu() - t0)


class TaggedQueue(WeightGradQueue):
    """A weight-gradient queue that knows which part queued each entry and times them per part."""

    def __init__(self) -> None:
        super().__init__()
        self.current: _Note | None = None
        self._tagged: list[tuple[_Note | None, Callable[[], None]]] = []

    def put(self, fn: Callable[[], None]) -> None:
        self._tagged.append((self.current, fn))

    def __len__(self) -> int:
        return len(self._tagged)

    def run(self) -> None:
        work, self._tagged = self._tagged, []
        spent: dict[int, tuple[_Note, float]] = {}
        with torch.no_grad():
            for note, fn in work:
                t0 = cpu()
                fn()
                if note is not None:
                    spent[id(note)] = (note, spent.get(id(note), (note, 0.0))[1] + cpu() - t0)
        for note, seconds in spent.values():
            note.timer.add(note.name, "W", note.units, seconds)


class PartBytes:
    """Observer attributing saved bytes to ``<part>#<call>`` regions, remembering each call's units."""

    def __init__(self) -> None:
        self.units: dict[str, tuple[str, int]] = {}

    @contextlib.contextmanager
    def forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Iterator[Any]:
        name = part_name(fn)
        label = f"{name}#{len(self.units)}"
        self.units[label] = (name, part_units(name, args))
        with accounting.region(layer=label):
            yield _NoBackward()


class _NoBackward:
    def backward(self, queue: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


# ------------------------------------------------------------------------------- helpers
def _tokens(config: Config, mbs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = config.model
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, m.vocab_size, (mbs, m.seq_len + 1), generator=g)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def _block(config: Config, ep: ExpertParallel, option: str) -> Any:
    blocks = build_blocks(config.model, [0], 1, ep, config.train.seed)
    configure(blocks, MemoryConfig(**MEMORY[option]))
    return blocks[0]


def _fit(samples_by_size: list[list[tuple[int, float]]]) -> Linear:
    """A line through the medians of each size's samples."""
    points = []
    for samples in samples_by_size:
        if samples:
            points.append((statistics.median(u for u, _ in samples), statistics.median(v for _, v in samples)))
    return Linear.fit(points)


def _time_parts(
    config: Config, ep: ExpertParallel, option: str, sizes: list[int], reps: int, warmup: int
) -> tuple[dict[str, dict[str, Linear]], dict[str, list[float]], Any]:
    """Per-part costs under ``option``; overhead samples of the forward and backward programs
    (processor time beyond the parts, part calls, exchanges issued); the block."""
    block = _block(config, ep, option)
    per_size: dict[tuple[str, str], list[list[tuple[int, float]]]] = defaultdict(list)
    overhead: dict[str, list[tuple[float, int, int]]] = {"F": [], "B": []}

    def program(obs: PartTimer, phase: str, fn: Callable[[], Any]) -> Any:
        spent0, calls0 = obs.total(phase)
        issued0 = ep.stats.count
        t0 = cpu()
        out = fn()
        used = cpu() - t0  # waiting for an exchange takes no processor time
        spent, calls = obs.total(phase)
        if calls > calls0:
            overhead[phase].append((used - (spent - spent0), calls - calls0, ep.stats.count - issued0))
        return out

    for size_i, mbs in enumerate(sizes):
        timer = PartTimer()
        for rep in range(warmup + reps):
            keep = rep >= warmup
            obs = timer if keep else PartTimer()  # warm-up rounds are timed but not kept
            x, y = _tokens(config, mbs, 7919 * size_i + rep + 17 * ep.rank)
            tape, queue = Tape(), TaggedQueue()
            with observing(obs):
                out = program(obs, "F", lambda: run(block.program(tape, x, y)))
                program(obs, "B", lambda: run(tape.backward(out, torch.ones_like(out), queue)))
            queue.run()
            if not keep:
                overhead["F"].pop()
                overhead["B"].pop()
            for p in block.parameters():
                p.grad = None
        for key, samples in timer.samples.items():
            while len(per_size[key]) < size_i:
                per_size[key].append([])
            per_size[key].append(samples)
    parts: dict[str, dict[str, Linear]] = defaultdict(dict)
    for (name, phase), lists in per_size.items():
        if name != "other" and phase in ("F", "B", "W"):
            parts[name][phase] = _fit(lists)
    return dict(parts), overhead, block


def _crowding(backend: Any, config: Config, ep_size: int, processors: float | None, rounds: int, reps: int) -> float | None:
    """How much more processor time the model's forward and backward take when every rank of
    the host computes at once than when an EP group of ``ep_size`` ranks (that the parts were
    timed on) does alone: the ratio of the medians, the two taken in alternating rounds so that
    a drift in the machine's speed hits both alike. None where the ranks fit the processors."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if processors is None or world <= processors:
        return None
    groups = [backend.new_group(list(range(k, k + ep_size))) for k in range(0, world - ep_size + 1, ep_size)] if ep_size > 1 else []
    full = rank // ep_size < len(groups)  # ranks past the last whole group compute without EP
    ep = ExpertParallel(backend, ep_size, rank % ep_size, groups[rank // ep_size]) if full else ExpertParallel(backend, 1, 0, None)
    block = _block(config, ep, "off")

    def step(seed: int) -> float:
        x, y = _tokens(config, config.train.micro_batch_size, seed)
        tape, queue = Tape(), WeightGradQueue()
        t0 = cpu()
        out = run(block.program(tape, x, y))
        run(tape.backward(out, torch.ones_like(out), queue))
        queue.run()
        used = cpu() - t0
        for p in block.parameters():
            p.grad = None
        return used

    alone: list[float] = []
    together: list[float] = []
    for r in range(rounds + 1):  # the first round warms up
        dist.barrier()
        if rank < ep_size:
            got = [step(1000 * r + i + 17 * rank) for i in range(reps)]
            alone += got if r else []
        dist.barrier()
        got = [step(1000 * r + i + 17 * rank) for i in range(reps)]
        together += got if r else []
    ratio = torch.tensor([statistics.median(together) / statistics.median(alone) if alone else 0.0], dtype=torch.float64)
    dist.all_reduce(ratio)
    return float(ratio) / min(ep_size, world)


def _saved_bytes(config: Config, ep: ExpertParallel, option: str, sizes: list[int]) -> dict[str, Linear]:
    block = _block(config, ep, option)
    samples: dict[str, list[list[tuple[int, float]]]] = defaultdict(lambda: [[] for _ in sizes])
    for size_i, mbs in enumerate(sizes):
        for rep in range(2):
            x, y = _tokens(config, mbs, 104729 + 31 * size_i + rep + 17 * ep.rank)
            obs = PartBytes()
            tracker = accounting.SavedActivations(ignore=block.parameters())
            with tracker.track(), observing(obs):
                tape = Tape()
                out = run(block.program(tape, x, y))
            for (label, _mb), nbytes in tracker.live_by_region.items():
                if label in obs.units:
                    name, units = obs.units[label]
                    samples[name][size_i].append((units, float(nbytes)))
            run(tape.backward(out, torch.ones_like(out)))  # the EP peers take part in its exchanges
            for p in block.parameters():
                p.grad = None
    return {name: _fit(lists) for name, lists in samples.items() if name != "other"}


def cpu() -> float:
    """This thread's processor time: what a part costs, however busy other processes keep the machine."""
    return time.thread_time()


def _least_time(fn: Callable[[], None], reps: int) -> float:
    """Wall time of the least disturbed of ``reps`` runs (communication waits, so processor time
    would not count it; other processes' load only ever adds to it)."""
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def _cpu_time(fn: Callable[[], None], reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = cpu()
        fn()
        out.append(cpu() - t0)
    return statistics.median(out)


def _rounds(call: Callable[[], None], spans: list[float], reps: int) -> tuple[list[float], float]:
    """Compute for each of ``spans`` seconds of processor time in turn, then ``call``
    (communication, waited for), ``reps`` times over, as a stage computes between exchanges
    (taking the spans in turn keeps a drift in the machine's speed out of their differences).
    Returns the mean wall time of ``call`` after each span (what the rank waits, its peers' lag
    included: the mean, since the rare long waits are part of every step) and the processor
    time the process's other threads (a CPU backend's communication threads) spent per call,
    which a call alone measures poorly: who does the work depends on who waits."""
    call()  # the peers line up
    waited = [0.0] * len(spans)
    p0, t0 = time.process_time(), cpu()
    for _ in range(reps):
        for i, span in enumerate(spans):
            _spin(span)
            w0 = time.perf_counter()
            call()
            waited[i] += time.perf_counter() - w0
    background = (time.process_time() - p0) - (cpu() - t0)
    return [w / reps for w in waited], max(0.0, background) / (reps * len(spans))


def _spin(seconds: float) -> None:
    """Compute for ``seconds`` of this thread's processor time (small matrix products)."""
    a = torch.randn(64, 64)
    t0 = cpu()
    while cpu() - t0 < seconds:
        a = torch.tanh(a @ a)


def _mean(backend: Any, values: list[float], group: Any, size: int) -> list[float]:
    """The mean of ``values`` over the ``size`` ranks of ``group``."""
    t = torch.tensor(values, dtype=torch.float64)
    backend.all_reduce(t, group=group)
    return [float(v) / size for v in t]


def _comm(
    backend: Any, world: int, hidden: int, dtype: torch.dtype, rows: int, reps: int, ep: int, span: float, processors: float | None
) -> dict[str, Any]:
    """All-to-all and all-reduce over the first n ranks (n = 2, 4, ..., world, and ``ep``), p2p
    between ranks 0 and 1: latency and bytes per second from the least disturbed of ``reps``
    calls; what the communication threads spend, with ``span`` seconds of compute between calls;
    on a host with fewer processors than ranks, what a transfer adds while the others compute."""
    rank = dist.get_rank()
    sizes = sorted({n for n in (2, 4, 8, 16, 32, 64, world, ep) if 2 <= n <= world})
    groups = {n: backend.new_group(list(range(n))) for n in sizes}
    a2a: dict[str, Linear] = {}
    issue: dict[str, float] = {}  # issuing an all-to-all: what the caller's thread pays before it can go on
    background: dict[str, Linear] = {}  # what the communication threads pay per all-to-all
    allreduce: dict[str, Linear] = {}
    for n, group in groups.items():
        if rank < n:
            ep = ExpertParallel(backend, n, rank, group)
            pts, ar, bg = [], [], []
            for r in (max(2, rows // 16), rows):
                per = max(1, r // n)
                x = torch.randn(per * n, hidden, dtype=dtype)
                splits = [per] * n
                exchange(ep, x, splits, splits).wait()  # warm up
                t = _least_time(lambda: exchange(ep, x, splits, splits).wait(), reps)
                issued = []
                for _ in range(reps):
                    t0 = cpu()
                    pending = exchange(ep, x, splits, splits)
                    issued.append(cpu() - t0)
                    pending.wait()
                issue[str(n)] = statistics.median(issued)
                sent = per * (n - 1) * hidden * x.element_size()
                pts.append((sent, t))
                bg.append((sent, _rounds(lambda: exchange(ep, x, splits, splits).wait(), [span], 12 * reps)[1]))
                flat = torch.zeros(r * hidden, dtype=dtype)
                backend.all_reduce(flat, group=group)
                ar.append((flat.numel() * flat.element_size(), _least_time(lambda: backend.all_reduce(flat, group=group), reps)))
            spent = _mean(backend, [b for _, b in bg], group, n)
            a2a[str(n)], allreduce[str(n)] = Linear.fit(pts), Linear.fit(ar)
            background[str(n)] = Linear.fit([(sent, b) for (sent, _), b in zip(bg, spent)])
        dist.barrier()
    p2p, p2p_bg = Linear(), Linear()
    posts: list[float] = []
    if world >= 2:
        pts, bg_pts = [], []
        for r in (max(2, rows // 16), rows):
            buf, got = torch.zeros(r * hidden, dtype=dtype), torch.zeros(r * hidden, dtype=dtype)

            def round_trip(buf: torch.Tensor = buf) -> None:
                if rank == 0:
                    t0 = cpu()
                    works = backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, 1)])
                    posts.append(cpu() - t0)  # posting alone: what the sender's thread pays
                    for w in works:
                        w.wait()
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 1)]):
                        w.wait()
                elif rank == 1:
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.irecv, buf, 0)]):
                        w.wait()
                    for w in backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, 0)]):
                        w.wait()

            def both_ways() -> None:  # as a stage does: post, compute, then wait
                peer = 1 - rank
                works = backend.batch_isend_irecv([dist.P2POp(dist.isend, buf, peer), dist.P2POp(dist.irecv, got, peer)])
                _spin(span)
                for w in works:
                    w.wait()

            if rank < 2:
                round_trip()
                nbytes = buf.numel() * buf.element_size()
                pts.append((nbytes, _least_time(round_trip, reps) / 2))
                # a round both ways is one send and one receive at each end
                bg_pts.append((nbytes, _mean(backend, [_rounds(both_ways, [0.0], 12 * reps)[1] / 2], groups[2], 2)[0]))
            dist.barrier()
        p2p = Linear.fit(pts) if rank == 0 else p2p
        p2p_bg = Linear.fit(bg_pts) if rank == 0 else p2p_bg
    crowded: dict[str, float] = {}
    if processors is not None and world > processors:
        # the same transfers while every other rank computes: the communication threads wait
        # for a processor
        n, posted = 12 * reps, len(posts)
        if rank < 2:
            t0 = time.perf_counter()
            for _ in range(n):
                round_trip()
            crowded[str(world)] = max(0.0, (time.perf_counter() - t0) / n / 2 - p2p(buf.numel() * buf.element_size()))
            del posts[posted:]
        else:
            _spin(n * 4 * max(p2p.fixed, 1e-3))  # longer than the transfers take
        dist.barrier()
    return {
        "a2a": a2a, "issue_s": issue, "a2a_cpu": background, "allreduce": allreduce, "p2p": p2p, "p2p_cpu": p2p_bg,
        "p2p_crowded": crowded, "post_s": statistics.median(posts) if posts else 0.0,
    }


def _lag(
    backend: Any, world: int, processors: float | None, ep_size: int, hidden: int, dtype: torch.dtype, rows: int,
    span: float, reps: int, a2a: dict[str, Linear],
) -> dict[str, Linear]:
    """How long exchanges wait for their EP peers on a host whose ranks share the processors:
    EP groups of ``ep_size`` ranks (2 if 1) compute and exchange in turns, the first group alone,
    then every rank at once (ranks past the last whole group compute alike without exchanging);
    ``fixed + per_unit * span``, the mean over the exchanging ranks of the mean wait less the
    exchange's latency, keyed by the ranks computing at once."""
    n = max(2, ep_size)
    if processors is None or world < n:
        return {}
    rank = dist.get_rank()
    groups = [backend.new_group(list(range(k, k + n))) for k in range(0, world - n + 1, n)]
    per = max(1, rows // n)
    x = torch.randn(per * n, hidden, dtype=dtype)
    splits = [per] * n
    sent = per * (n - 1) * hidden * x.element_size()
    spans = [0.0, span / 2, span]  # the stretches of compute a program has between exchanges
    out: dict[str, Linear] = {}
    for running in sorted({n, world}):
        waits = [0.0] * len(spans)
        exchanging = min(running, n * len(groups))
        if rank < exchanging:
            ep = ExpertParallel(backend, n, rank % n, groups[rank // n])
            waits = _rounds(lambda: exchange(ep, x, splits, splits).wait(), spans, reps)[0]
        elif rank < running:
            _rounds(lambda: None, spans, reps)
        waits = _mean(backend, waits, None, exchanging)
        latency = a2a[str(n)](sent) if str(n) in a2a else 0.0
        out[str(running)] = Linear.fit([(s, max(0.0, w - latency)) for s, w in zip(spans, waits)])
    return out


def _optimizer(dtype: torch.dtype, reps: int) -> tuple[Linear, float]:
    """AdamW's update: per parameter element (one large tensor at two sizes), and what each
    further tensor adds (the same elements in many tensors: the update runs tensor by tensor)."""

    def step_time(sizes: list[int]) -> float:
        params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in sizes]
        for p in params:
            p.grad = torch.full_like(p, 1e-3)
        opt = torch.optim.AdamW(params, lr=1e-3)
        opt.step()
        return _cpu_time(opt.step, reps)

    one, many = 1 << 18, 64
    pts = [(n, step_time([n])) for n in (one, 1 << 20)]
    per_tensor = max(0.0, (step_time([one // many] * many) - pts[0][1]) / (many - 1))
    return Linear.fit(pts), per_tensor


def _busy(seconds: float) -> float:
    """Fixed compute work of about ``seconds`` on one processor; returns how long it took."""
    a = torch.randn(96, 96)
    t0 = time.perf_counter()
    n = 0
    while n < 400 or time.perf_counter() - t0 < seconds and n < 20000:
        a = torch.tanh(a @ a)
        n += 1
    return (time.perf_counter() - t0) / n


# ------------------------------------------------------------------------------ rank body
def profile_rank(backend: Any, raw: dict[str, Any], reps: int, warmup: int) -> dict[str, Any] | None:
    """Run on every rank; rank 0 returns the profile as a dict."""
    config = config_from_dict(raw)
    world, rank = dist.get_world_size(), dist.get_rank()
    shared = world >= 2 and backend.device(0) == backend.device(1)  # ranks share one device (a host's CPUs)
    processors = float(backend.device_count()) if shared else None
    m = config.model
    # an expert-parallel group for the part timings: the config's ep, no more ranks than processors
    limit = config.parallel.ep if processors is None else min(config.parallel.ep, int(processors))
    ep_size = max(d for d in range(1, limit + 1) if m.n_experts % d == 0 and world >= d)
    group = backend.new_group(list(range(ep_size))) if ep_size > 1 else None
    dtype = DTYPES[m.dtype]
    sizes = sorted({config.train.micro_batch_size, 2 * config.train.micro_batch_size})
    out: dict[str, Any] = {}
    if rank < ep_size:
        ep = ExpertParallel(backend, ep_size, rank, group)
        parts, loads = {}, None
        overhead: dict[str, list[tuple[float, int, int]]] = {"F": [], "B": []}
        options = ("off", "level0", "level1") if m.n_layers > m.n_dense else ("off",)
        for option in options:
            parts[option], ov, block = _time_parts(config, ep, option, sizes, reps, warmup)
            for phase in overhead:
                overhead[phase] += ov[phase]
            if option == "off" and block.moe_layers():
                counts = torch.stack([layer.moe.step_counts.to(torch.float64) for layer in block.moe_layers()])
                if ep_size > 1:
                    backend.all_reduce(counts, group=group)
                loads = counts.tolist()
        saved = {opt: _saved_bytes(config, ep, opt, sizes) for opt in MEMORY if opt == "off" or m.n_layers > m.n_dense}
        out = {"parts": parts, "saved_bytes": saved, "loads": loads or []}
    dist.barrier()
    rows = config.train.micro_batch_size * m.seq_len * m.top_k
    # communication between computes of about an attention part (the longest stretch of a
    # forward between two exchanges); rank 0 timed it
    span = torch.zeros(1, dtype=torch.float64)
    if rank == 0:
        span += out["parts"]["off"]["attention"]["F"](config.train.micro_batch_size * m.seq_len)
    dist.broadcast(span, 0)
    comm = _comm(backend, world, m.hidden, dtype, rows, reps, ep_size, float(span), processors)
    comm["a2a_lag"] = _lag(backend, world, processors, ep_size, m.hidden, dtype, rows, float(span), 30 * reps, comm["a2a"])
    # how much slower each rank computes when all run at once (a host's shared processors)
    alone = _busy(0.2) if rank == 0 else 0.0
    dist.barrier()
    together = _busy(0.2)
    made: list[Any] = [None]
    if rank == 0:
        optimizer, optimizer_tensor_s = _optimizer(dtype, reps)
        # the programs' own work per part call, less the cost of issuing their exchanges (measured apart)
        issue = comm["issue_s"].get(str(ep_size), 0.0) if ep_size > 1 else 0.0
        out["part_overhead_s"] = {
            phase: statistics.median(max(0.0, rest - n_issued * issue) / calls for rest, calls, n_issued in v) if v else 0.0
            for phase, v in overhead.items()
        }
        made[0] = Profile.from_dict({
            "format": FORMAT,
            "device": {
                "backend": backend.name, "name": platform.processor() or platform.machine(), "count": backend.device_count(),
                "ranks_profiled": world, "ep_profiled": ep_size, "host": platform.node(), "cpus": os.cpu_count(),
                "slowdown_all_ranks": together / alone if alone > 0 else None,
            },
            "torch": torch.__version__,
            "shape": Shape.of(m).to_dict(),
            "tokens": [s * m.seq_len for s in sizes],
            "processors": processors,
            "optimizer": _plain(optimizer),
            "optimizer_tensor_s": optimizer_tensor_s,
            "source": f"measured by portapipe profile on {world} {backend.name} ranks",
            **_plain(out),
            **_plain(comm),
        })
    crowding = _crowding(backend, config, ep_size, processors, 4, reps)
    dist.broadcast_object_list(made, 0)  # every rank prices the step below with the profile so far
    if crowding is not None:
        made[0].crowding = {str(world): max(1.0, crowding)}
    made[0].action_s = action_cost(backend, raw, made[0], reps, warmup)
    return made[0].to_dict() if rank == 0 else None


def _plain(x: Any) -> Any:
    """Linear costs as the dicts a profile file holds."""
    if isinstance(x, Linear):
        return {"fixed": x.fixed, "per_unit": x.per_unit}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x
