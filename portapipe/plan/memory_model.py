"""Per-rank peak memory of one setup: what is static plus what the schedule keeps in flight.

Static, per pipeline rank: the parameters of every block the rank holds (DualPipe: two blocks,
each also held by another rank; routed experts: ``n_experts / ep`` plus the balancer's redundant
slots), their gradients (accumulated in the master dtype), the master weights (when kept apart
from the parameters: another dtype, or ``zero_stage`` 1 / 2), AdamW's two moments (in
``train.moments_dtype``; this rank's ranges under ``zero_stage`` 1 / 2, and the gradients' too under 2), the
model's buffers. The host EMA of the weights (``train.ema_decay``) is counted apart, in host
memory (``ema_host``): it takes nothing of the device's.

In flight: each rank's lowered action list is walked in order, and each compute action through
its stage program (:mod:`.programs`), part by part; an F&B interleaves its two programs as the
executor does. Two running totals:

- ``saved``: what autograd keeps for backward, byte for byte what
  :class:`~portapipe.memory.accounting.SavedActivations` counts (the rotary tables count once per
  block while any micro-batch of it is held, as the accounting's storage de-duplication does);
  recompute's replays count while they last;
- ``held``: ``saved`` plus what only an allocator sees: part outputs and exchange buffers the
  tape keeps until the backward, posted receive buffers, the input gradients sent until their
  sends complete (the step looks after each compute action: modelled as the end of the next
  one), deferred weight gradients between B and W (an estimate).

The step's peak is the larger of the walk's peak and what is left at its end plus a gradient
bucket's temporaries and the parameters' refresh after the optimizer step.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from ..scheduling.ir import Action, Kind, Schedule
from .programs import Programs, StageSpec, interleave, stage_specs
from .shape import Shape, block_params, layer_buffer_bytes, mtp_layer_indices, wqueue_bytes
from .time_model import _block_params


@dataclass
class _Walk:
    """One rank's action list as arrays over its compute steps (see :meth:`MemoryModel._compile`)."""

    keys: list[tuple]  # per step type: the halves' (kind, stage, micro-batch: 0 without a routing); type 0 runs no ops
    tid: torch.Tensor  # step -> type
    posts: torch.Tensor  # stage-sized buffers posted before the step (receives, sent gradients)
    consume: torch.Tensor  # received inputs that become a stage's saved input (negative counts)
    release: torch.Tensor  # received output gradients used up by the step's backwards (negative)
    rope_on: torch.Tensor  # [step, block]: the block's first micro-batch in flight starts here
    rope_off: torch.Tensor  # [step, block]: its last one ends here
    wq: torch.Tensor  # [step, stage]: deferred weight gradients queued (+1) or run (-1)
    fetch: list[tuple[int, int, int]]  # (step, stage, micro-batch): a backward's offloaded bytes back on the device from this step
    blocks: list[int]
    stages: list[int]
    most: int  # most micro-batch chunks held at once


@dataclass
class RankMemory:
    params: float = 0.0
    grads: float = 0.0
    master: float = 0.0
    optimizer: float = 0.0
    buffers: float = 0.0
    ema_host: float = 0.0  # host memory, not the device's: the EMA of the weights and its staging copy (train.ema_decay)
    optimizer_host: float = 0.0  # host memory: the master weights and moments train.optimizer_offload keeps there
    saved_host_peak: float = 0.0  # host memory: the most saved activations memory.offload holds there at once
    saved_peak: float = 0.0  # activations saved for backward (the accounting's figure)
    held_peak: float = 0.0  # everything the schedule keeps in flight, at its peak
    post: float = 0.0  # transient after the schedule (reductions, optimizer)
    microbatches_peak: int = 0  # most micro-batch chunks held at once

    @property
    def static(self) -> float:
        return self.params + self.grads + self.master + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.static + max(self.held_peak, self.post)

    def to_dict(self) -> dict[str, Any]:
        return {
            "params": self.params, "grads": self.grads, "master": self.master, "optimizer": self.optimizer, "buffers": self.buffers,
            "ema_host": self.ema_host, "optimizer_host": self.optimizer_host, "saved_host_peak": self.saved_host_peak,
            "saved_peak": self.saved_peak, "held_peak": self.held_peak, "post": self.post, "total": self.total,
            "microbatches_peak": self.microbatches_peak,
        }


@dataclass
class MemoryReport:
    ranks: list[RankMemory] = field(default_factory=list)
    over: int | None = None  # the pipeline rank found over a budget (then ``ranks`` may be partial)
    over_total: float = 0.0  # and what it needs

    @property
    def peak(self) -> float:
        return max(r.total for r in self.ranks)

    @property
    def worst_rank(self) -> int:
        if self.over is not None:
            return self.over
        return max(range(len(self.ranks)), key=lambda i: self.ranks[i].total)


def static_memory(setup: Any, schedule: Schedule, rank: int) -> RankMemory:
    """Parameters, gradients, master weights, AdamW state and buffers of pipeline rank ``rank``."""
    s = setup.shape
    bal = getattr(setup, "balancer", None)
    redundant = bal.redundant if bal is not None and bal.kind != "none" else 0
    train, model = getattr(setup, "train", None), getattr(setup, "model", None)
    master, moments = _optimizer_bytes(model.dtype if model is not None else "float32", train, getattr(setup, "moments_dtype", None))
    ema = train is not None and getattr(train, "ema_decay", None) is not None
    away = getattr(setup, "offload_fraction", 1.0) if getattr(setup, "optimizer_offload", "off") != "off" else 0.0
    return _static(s, tuple(schedule.blocks_of(rank)), schedule.n_blocks, s.n_experts // setup.ep + redundant,
                   s.n_experts + redundant * setup.ep, master, getattr(setup, "zero_stage", 0), setup.dp, setup.ep,
                   getattr(setup, "layers_per_stage", None), moments, ema, away)


def _optimizer_bytes(model_dtype: str, train: Any, moments: str | None = None) -> tuple[int, int]:
    """Bytes of one master weight and of one AdamW moment (``train.master_dtype``; ``moments``, a
    setup's choice, else ``train.moments_dtype``)."""
    from ..config.model_shape import ELEMENT_BYTES
    from ..optim.precision import master_dtype, moments_dtype

    master_setting = train.master_dtype if train is not None else "auto"
    moments_setting = moments or (getattr(train, "moments_dtype", "auto") if train is not None else "auto")
    return (ELEMENT_BYTES[master_dtype(model_dtype, master_setting)],
            ELEMENT_BYTES[moments_dtype(model_dtype, master_setting, moments_setting)])


@functools.lru_cache(maxsize=8192)
def _static(s: Shape, blocks: tuple[int, ...], n_blocks: int, local_slots: int, slots: int, em: int = 4, zero: int = 0,
            dp: int = 1, ep: int = 1, split: Any = None, emo: int | None = None, ema: bool = False, away: float = 0.0) -> RankMemory:
    """Gradients accumulate in the master dtype (``em`` bytes), AdamW's moments take ``emo`` bytes
    each (default ``em``); zero_stage 1 shards the master weights and the moments, 2 the gradients
    too, over dp x ep (shared) or dp (experts). The parameters are the master weights when the
    model computes in the master dtype (no copy). ``away``: the share of the master weights and
    moments ``train.optimizer_offload`` keeps in host memory (``optimizer_host``)."""
    from ..config.setup import layer_range

    mem = RankMemory()
    elements = experts = 0
    for b in blocks:
        c = _block_params(s, b, n_blocks, local_slots, split)
        elements += c.elements
        experts += c.expert_elements
        first, last = layer_range(s.n_layers, n_blocks, b, split)
        mtp = mtp_layer_indices(s) if b == n_blocks - 1 else range(0)
        mem.buffers += sum(layer_buffer_bytes(s, i, slots) for i in [*range(first, last), *mtp])
    if n_blocks > 1 and 0 in blocks and n_blocks - 1 in blocks and (s.tie_word_embeddings or s.mtp_layers):
        elements -= s.vocab_size * s.hidden  # the first and last blocks on one rank hold one embedding, not a copy each
    sharded = (elements - experts) / (dp * ep) + experts / dp  # this rank's ranges of its buckets
    mem.params = float(elements * s.e)
    mem.grads = float((sharded if zero == 2 else elements) * em)
    kept = sharded if zero >= 1 else elements
    mem.optimizer = float(2 * kept * (em if emo is None else emo))  # exp_avg, exp_avg_sq
    mem.master = float(kept * em) if em != s.e else 0.0
    if ema:  # float32, over the master weights' ranges, and its staging copy of them (optim.ema.HostEMA)
        mem.ema_host = float(kept * (4 + em))
    if away:
        mem.optimizer_host = away * (mem.master + mem.optimizer)
        mem.master, mem.optimizer = (1 - away) * mem.master, (1 - away) * mem.optimizer
    return mem


class MemoryModel:
    """Peak memory per pipeline rank of ``setup`` running ``schedule`` (lowered)."""

    def __init__(
        self, setup: Any, schedule: Schedule, imbalance: float = 1.0, programs: Programs | None = None,
        walks: dict | None = None, lists: list[list[Any]] | None = None, specs: list[StageSpec] | None = None,
        routing: dict[tuple[int, int], tuple[tuple[int, float, float], ...]] | None = None,
    ) -> None:
        """``schedule`` is lowered, or its lowered ``lists`` are given (a
        :func:`~portapipe.scheduling.comms.plan`, posts as light tuples). ``programs`` may be shared
        by setups with the same micro-batch size and imbalance, and ``walks`` (compiled action
        lists, by schedule and rank) by setups with the same schedule.

        ``routing``: one EP rank's routing in a run, to set the model against that run: per
        (stage, micro-batch), per MoE layer ``(layer, rows, own)``: the rows its experts ran on
        and of them the rows it routed to itself, each over its even share
        (:func:`portapipe.verify.pipelined.routed_rows`). Without it every micro-batch routes the
        mean (times ``imbalance``): what a plan can know before the run."""
        self.routing = routing
        self._routed: dict[tuple[tuple[int, float, float], ...], Programs] = {}
        self.walks: dict = {} if walks is None else walks
        self.lists = lists if lists is not None else schedule.actions
        self.setup, self.schedule = setup, schedule
        self.shape = s = setup.shape
        self.tokens = setup.micro_batch_size * setup.model.seq_len
        self.programs = programs or Programs.of(setup, imbalance)
        self.rows = self.programs.R
        self.specs = specs if specs is not None else stage_specs(setup, schedule)
        self.switching = setup.ep > 1 and setup.overlap
        self.act = float(self.tokens * s.hidden * s.e)  # one stage input / output / gradient
        self._rope: dict[StageSpec, float] = {}

    def _wqueue(self, spec: StageSpec) -> float:
        cache = self.programs.wqueue
        if spec not in cache:
            ops = self.programs.weights(spec)
            cache[spec] = sum(wqueue_bytes(self.shape, op[1], self.tokens, op[3]) for op in ops)
        return cache[spec]

    def _rope_bytes(self, spec: StageSpec) -> float:
        if spec not in self._rope:
            kept = [o for o in spec.options if o != "recompute_full"]
            self._rope[spec] = float(len(kept) * self.shape.rope_bytes())
        return self._rope[spec]

    def _programs_of(self, stage: int, mb: int) -> Programs:
        """The programs of micro-batch ``mb`` on ``stage``: under ``routing``, its own rows."""
        if self.routing is None:
            return self.programs
        moe = {layer for layer in self.specs[stage].layers if self.shape.is_moe(layer)}
        routed = self.routing.get((stage, mb), ())
        if {layer for layer, _, _ in routed} != moe:  # a silent mean for a missing layer would hide it
            raise ValueError(f"routing: stage {stage}, micro-batch {mb} gives the rows of MoE layers "
                             f"{sorted(layer for layer, _, _ in routed)}, the stage has {sorted(moe)}")
        if not routed:  # a stage without MoE layers
            return self.programs
        if routed not in self._routed:
            self._routed[routed] = Programs.of(self.setup, routed={layer: (rows, own) for layer, rows, own in routed})
        return self._routed[routed]

    def _program_stats(self, r: int, halves: tuple[Any, ...]) -> tuple[float, float, float, float]:
        """(saved delta, held delta, highest saved, highest saved + held) over the ops of one
        compute action on rank ``r``, relative to where it starts."""
        sched = self.schedule

        def ops_of(half: Any) -> list[tuple]:
            spec, programs = self.specs[half.stage], self._programs_of(half.stage, half.mb)
            if half.kind is Kind.F:
                return programs.forward(spec)
            return programs.backward(spec, "B" if half.kind is Kind.B else "BW")

        if len(halves) == 2:
            merged = interleave(ops_of(halves[0]), ops_of(halves[1]), self.switching)
        else:
            merged = [(0, op) for op in ops_of(halves[0])]
        saved = held = top_s = top_t = 0.0
        for prog, op in merged:
            if op[0] != "C":
                continue
            if op[1] == "output":
                half = halves[prog]
                nxt = sched.next_stage(half.stage)
                # handed to this rank's next stage, which saves it: counted there; a stage output sent
                # to another rank is let go with its tape at the stage's backward (its send completed
                # long before: the step lets completed sends go)
                if nxt is not None and sched.stage_rank[nxt] == r:
                    continue
            saved += op[4]
            held += op[5]
            top_s = max(top_s, saved)
            top_t = max(top_t, saved + held)
            if len(op) > 7:  # memory.offload: the part's sent bytes leave for host memory as it returns
                saved -= op[7]
        return saved, held, top_s, top_t

    def _compile(self, r: int) -> _Walk:
        """Rank ``r``'s action list as arrays the walk evaluates for any memory option."""
        sched = self.schedule
        blocks = sorted({sched.stage_block[v] for v in sched.stages_of(r)})
        stages = sched.stages_of(r)
        bcol = {b: i for i, b in enumerate(blocks)}
        vcol = {v: i for i, v in enumerate(stages)}
        cross_in = {v: not sched.is_first(v) and sched.stage_rank[sched.prev_stage(v)] != r for v in stages}
        cross_out = {v: not sched.is_last(v) and sched.stage_rank[sched.next_stage(v)] != r for v in stages}
        keys: dict[tuple, int] = {(): 0}  # type 0: no ops (a W, the end)
        tid: list[int] = []
        posts: list[float] = []
        consume: list[float] = []
        release: list[float] = []
        rope_on: list[tuple[int, int]] = []  # (step, block column): the block's first micro-batch in flight
        rope_off: list[tuple[int, int]] = []
        wq: list[tuple[int, int, float]] = []  # (step, stage column, +1 queued / -1 run)
        inflight = [0] * len(blocks)
        forward_at: dict[tuple[int, int], int] = {}  # (stage, micro-batch) -> the step of its forward
        fetch: list[tuple[int, int, int]] = []
        pending = 0.0
        sent = 0.0  # input gradients sent since the last compute action
        held_mbs = most = 0
        for a in self.lists[r]:
            k = a[0] if a.__class__ is tuple else a.kind  # posts may come as (Kind, stage, mb)
            if k is Kind.RECV_F or k is Kind.RECV_B or k is Kind.SEND_B:
                pending += 1  # a posted receive; a sent input gradient
                sent += k is Kind.SEND_B
                continue
            if k is Kind.SEND_F:
                continue  # the stage output, already held
            i = len(tid)
            posts.append(pending)
            pending = 0.0
            # a sent input gradient is let go once its send completes, which the executor looks
            # at after each compute action: modelled as done by the end of the next one
            done, sent = sent, 0.0
            if k is Kind.W:
                tid.append(0)
                consume.append(0.0)
                release.append(-done)
                wq.append((i, vcol[a.stage], -1.0))
                continue
            halves = a.pair if a.pair is not None else (a,)
            # a run's routing differs per micro-batch: then each is a step type of its own
            key = tuple((h.kind, h.stage, h.mb if self.routing is not None else 0) for h in halves)
            tid.append(keys.setdefault(key, len(keys)))
            took = gave = 0.0
            for h in halves:
                b = bcol[sched.stage_block[h.stage]]
                if h.kind is Kind.F:
                    forward_at[(h.stage, h.mb)] = i
                    took -= cross_in[h.stage]  # the received input becomes the stage's (saved) input
                    if inflight[b] == 0:
                        rope_on.append((i, b))
                    inflight[b] += 1
                    held_mbs += 1
                    most = max(most, held_mbs)
                else:
                    # memory.offload: the executor fetches a backward's bytes as the compute action before it
                    # starts, when its forward ran before that one; else as its own starts
                    f = forward_at.get((h.stage, h.mb), i - 1)
                    fetch.append((i - 1 if f < i - 1 else i, h.stage, h.mb))
                    gave -= cross_out[h.stage]  # the received output gradient is used up
                    inflight[b] -= 1
                    held_mbs -= 1
                    if inflight[b] == 0:
                        rope_off.append((i, b))
                    if h.kind is Kind.B:
                        wq.append((i, vcol[h.stage], 1.0))
            consume.append(took)
            release.append(gave - done)
        posts.append(pending)  # trailing posts, after the last step
        tid.append(0)
        consume.append(0.0)
        release.append(0.0)
        n, f64 = len(tid), torch.float64

        def matrix(entries: list, cols: int) -> torch.Tensor:
            out = torch.zeros(n, cols, dtype=f64)
            if entries:
                rows = torch.tensor([e[0] for e in entries])
                col = torch.tensor([e[1] for e in entries])
                vals = torch.tensor([e[2] if len(e) > 2 else 1.0 for e in entries], dtype=f64)
                out.index_put_((rows, col), vals, accumulate=True)
            return out

        return _Walk(
            [k for k, _ in sorted(keys.items(), key=lambda kv: kv[1])], torch.tensor(tid), torch.tensor(posts, dtype=f64),
            torch.tensor(consume, dtype=f64), torch.tensor(release, dtype=f64), matrix(rope_on, len(blocks)),
            matrix(rope_off, len(blocks)), matrix(wq, len(stages)), fetch, blocks, stages, most,
        )

    def rank(self, r: int) -> RankMemory:
        sched = self.schedule
        mem = dataclasses.replace(static_memory(self.setup, sched, r))  # a copy: the static part is cached
        at = (id(sched), r, self.routing is not None)
        walk = self.walks.get(at)
        if walk is None:
            walk = self.walks[at] = self._compile(r)
        # what becomes of a stage's output: loss (last stage), handed over on this rank, or sent
        out_mode = {
            v: "last" if sched.is_last(v) else "cross" if sched.stage_rank[sched.next_stage(v)] != r else "here" for v in walk.stages
        }
        stats = self.programs.stats
        table = []
        for halves in walk.keys:
            if not halves:
                table.append((0.0, 0.0, 0.0, 0.0))
                continue
            routed = tuple(self.routing.get((v, mb)) for _, v, mb in halves) if self.routing is not None else ()
            key = tuple((kind, self.specs[v], out_mode[v]) for kind, v, _ in halves) + (self.switching,) + routed
            st = stats.get(key)
            if st is None:
                st = stats[key] = self._program_stats(r, tuple(Action(kind, v, mb) for kind, v, mb in halves))
            table.append(st)
        f64 = torch.float64
        st = torch.tensor(table, dtype=f64)[walk.tid]  # per step: saved delta, held delta, top saved, top total
        rope = torch.tensor([self._rope_bytes(self._block_spec(b)) for b in walk.blocks], dtype=f64)
        wqb = torch.tensor([self._wqueue(self.specs[v]) for v in walk.stages], dtype=f64)
        act = self.act
        pre_s = walk.rope_on @ rope
        post_s = -(walk.rope_off @ rope)
        posts_h = walk.posts * act
        pre_h = walk.consume * act
        post_h = walk.release * act + walk.wq @ wqb
        fetched, sent = self._offloaded(walk, len(table))
        pre_s = pre_s + fetched  # memory.offload: a backward's bytes back before the compute action ahead of it
        ds = pre_s + st[:, 0] + post_s
        dh = posts_h + pre_h + st[:, 1] + post_h
        s_end, h_end = torch.cumsum(ds, 0), torch.cumsum(dh, 0)
        s_start, h_start = s_end - ds, h_end - dh
        mem.saved_peak = max(0.0, float((s_start + pre_s + st[:, 2]).max()))
        if sent is not None:  # in host memory: sent by the forwards, let go as the backwards read them (the step after the fetch)
            mem.saved_host_peak = max(0.0, float(torch.cumsum(sent, 0).max()))
        tops = torch.stack([s_start + h_start + posts_h, s_start + h_start + posts_h + pre_s + pre_h + st[:, 3], s_end + h_end])
        mem.held_peak = max(0.0, float(tops.max()))
        mem.microbatches_peak = walk.most
        # after the schedule: no flat copy of the gradients (they sit in their buckets); a bucket's
        # temporaries (DualPipe's copy sum: theirs and the sum; the clipped gradient) and the
        # parameters' refresh (all-gathered under zero_stage 1 / 2, about one parameter-sized buffer)
        train = getattr(self.setup, "train", None)
        bucket = min(float(train.grad_bucket_mb if train is not None else 25.0) * 2**20, mem.grads)
        mem.post = float(s_end[-1] + h_end[-1]) + 2 * bucket + mem.params
        if mem.optimizer_host:  # train.optimizer_offload: two buckets' states on the device during the step
            mem.post += min(2 * self._slot_bytes(train), mem.optimizer_host)  # no more than the states there are
        return mem

    def _slot_bytes(self, train: Any) -> float:
        """One device slot of ``train.optimizer_offload``: a bucket's master weights and moments (its
        shard under zero_stage 1 / 2, the experts' the larger: they shard over dp alone)."""
        em, emo = _optimizer_bytes(self.setup.model.dtype, train, getattr(self.setup, "moments_dtype", None))
        elements = float(train.grad_bucket_mb) * 2**20 / em
        if getattr(self.setup, "zero_stage", 0):
            elements /= self.setup.dp
        return elements * ((em if em != self.shape.e else 0) + 2 * emo)

    def _offloaded(self, walk: _Walk, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per step of the walk: the offloaded bytes fetched back as it starts, and the change of
        what is held in host memory (None without ``memory.offload``)."""
        f64 = torch.float64
        fetched = torch.zeros(len(walk.tid), dtype=f64)
        if not any(self.specs[v].offload for v in walk.stages):
            return fetched, None
        host = torch.zeros(len(walk.tid), dtype=f64)
        for step, v, mb in walk.fetch:
            nbytes = self._sent(v, mb)
            fetched[step] += nbytes
            host[min(step + 1, len(host) - 1)] -= nbytes
        for step, key in enumerate(walk.keys[t] for t in walk.tid.tolist()):
            for kind, v, mb in key:
                if kind is Kind.F:
                    host[step] += self._sent(v, mb)
        return fetched, host

    def _sent(self, stage: int, mb: int) -> float:
        """What one forward of ``stage`` sends to host memory (the micro-batch's own programs under ``routing``)."""
        ops = self._programs_of(stage, mb).forward(self.specs[stage])
        return float(sum(op[7] for op in ops if op[0] == "C" and len(op) > 7))

    def _block_spec(self, block: int) -> StageSpec:
        return next(spec for v, spec in enumerate(self.specs) if self.schedule.stage_block[v] == block)

    def report(self, budget: float | None = None, first_over: bool = True) -> MemoryReport:
        """Every pipeline rank's memory. With a ``budget``, stop at the first rank over it (the
        report then holds the ranks seen); with ``first_over`` False, walk every rank and name the
        fullest when it is over (a user's own config: its report says which rank needs the most)."""
        order = list(range(self.schedule.n_ranks))  # the first ranks hold the most in the 1F1B family
        ranks: dict[int, RankMemory] = {}
        for r in order:
            ranks[r] = self.rank(r)
            if budget is not None and first_over and ranks[r].total > budget:
                return MemoryReport([ranks[q] for q in sorted(ranks)], over=r, over_total=ranks[r].total)
        report = MemoryReport([ranks[q] for q in range(self.schedule.n_ranks)])
        if budget is not None and report.peak > budget:
            report.over, report.over_total = report.worst_rank, report.peak
        return report


__all__ = ["MemoryModel", "MemoryReport", "RankMemory", "static_memory", "block_params"]
