"""Step time of one setup: the schedule simulator priced action by action from a profile.

Each action's duration comes from running its stage program (:mod:`.programs`) against the
profile: parts cost their measured time, exchanges are issued on one communication channel per
rank (in order) and take the all-to-all's latency plus bytes over bandwidth; a wait costs what
is left of its exchange. A lone F, B or BW therefore hides an exchange only behind the work its
own program does before waiting (the shared expert hides the combine); an F&B runs the two
programs as the executor does, switching at every exchange in flight, so one micro-batch's
compute hides the other's all-to-all. Zero-memory's re-dispatch and recompute's replays are
steps of those programs, so their cost and what hides them follow.

The routed rows an EP rank computes are the mean (tokens x top-k) times the imbalance of the
recorded loads: every all-to-all waits for the busiest EP rank, so its pace is everyone's.

The pipeline is then simulated with these durations (p2p transfers cost latency plus bytes over
bandwidth). Ranks that share a host's processors (a CPU profile) slow each other down, and
what the host adds is measured by the profile: the communication threads' processor time, the
waits for EP peers that fell behind (lag), and compute's processor time growing once ranks
outnumber processors (crowding). The simulation is repeated under processor sharing (each
action's compute stretched by the threads ready to run beside it over the processors) until
the timeline settles. After the pipeline, the step adds the gradient reductions (DualPipe's
copies, dp x ep replicas: an all-reduce, or under ``zero_stage`` 2 a reduce-scatter, in the
reduction dtype), the all-gather of the updated parameters under ``zero_stage`` 1 / 2, the loss
and load gathers, and AdamW's update.

Offload's host copies are priced from the profile's host link: an action's ``memory.offload``
copies (what its forwards send, what its backwards fetch) against the action's own time, where
they run on a copy stream beside it, only what does not fit showing; ``train.optimizer_offload``'s
trips (the host share of the states to the device and back) against AdamW's update. Where the
copies run in line with the compute (the CPU) all of their time shows.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field
from typing import Any

from ..scheduling.ir import Action, Kind, Schedule
from ..scheduling.simulate import run_lists
from ..scheduling.wgrad import early_weight_grads
from .profile import Linear, Profile
from .programs import Programs, StageSpec, interleave, stage_specs
from .shape import Shape, block_params


@dataclass(frozen=True)
class ActionTime:
    wall: float  # seconds from start to end with nothing else sharing the processor
    compute: float  # of which the rank computes
    exposed: float  # of which it waits for exchanges
    comm: float  # exchange time issued by the action (hidden or not)
    background: float = 0.0  # processor time other threads (communication) spend for it
    lagged: float = 0.0  # of the waits, those for EP peers still computing (their lag)
    copy: float = 0.0  # memory.offload's host copies of its parts (sent by its forwards, fetched for its backwards)
    copy_exposed: float = 0.0  # of which not hidden behind the action's compute (included in wall)


@dataclass
class TimeReport:
    step_s: float
    pipeline_s: float  # the schedule's makespan
    post_s: float  # gradient reductions, gathers and the optimizer after the schedule
    bubble_s: float  # the largest idle time of a rank within the makespan
    a2a_s: float  # all-to-all time per step on the busiest rank
    a2a_exposed_s: float  # of which not hidden behind compute
    imbalance: float
    per_rank_busy: list[float] = field(default_factory=list)
    per_rank_cpu: list[float] = field(default_factory=list)  # per pipeline rank: one rank's processor time, all threads, in the schedule
    a2a_edge_s: float = 0.0  # of a2a_s, the lone F, B and BW actions' (warm-up, cool-down, 1F1B, ZB1P)
    a2a_edge_exposed_s: float = 0.0  # of which not hidden behind the actions' own parts
    host_copy_s: float = 0.0  # memory.offload's host copies per step on the busiest rank (in the schedule)
    host_copy_exposed_s: float = 0.0  # of which not hidden behind compute
    optimizer_copy_s: float = 0.0  # train.optimizer_offload's trips per step (after the schedule)
    optimizer_copy_exposed_s: float = 0.0  # of which not hidden behind the update

    @property
    def a2a_hidden_frac(self) -> float:
        return 1.0 - self.a2a_exposed_s / self.a2a_s if self.a2a_s > 0 else 0.0

    @property
    def a2a_edge_hidden_frac(self) -> float:
        return 1.0 - self.a2a_edge_exposed_s / self.a2a_edge_s if self.a2a_edge_s > 0 else 0.0

    @property
    def a2a_steady_hidden_frac(self) -> float:
        """Over the F&B pairs."""
        steady = self.a2a_s - self.a2a_edge_s
        return 1.0 - (self.a2a_exposed_s - self.a2a_edge_exposed_s) / steady if steady > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s, "pipeline_s": self.pipeline_s, "post_s": self.post_s, "bubble_s": self.bubble_s,
            "a2a_s": self.a2a_s, "a2a_exposed_s": self.a2a_exposed_s, "a2a_hidden_frac": self.a2a_hidden_frac,
            "a2a_steady_hidden_frac": self.a2a_steady_hidden_frac, "a2a_edge_hidden_frac": self.a2a_edge_hidden_frac,
            "imbalance": self.imbalance, "host_copy_s": self.host_copy_s, "host_copy_exposed_s": self.host_copy_exposed_s,
            "optimizer_copy_s": self.optimizer_copy_s, "optimizer_copy_exposed_s": self.optimizer_copy_exposed_s,
        }


def run_ops(ops: list[tuple[int, tuple]], profile: Profile, ep: int, lag: Linear | None = None, crowding: float = 1.0) -> ActionTime:
    """Time one merged program (``(program index, op)`` pairs, see :func:`~.programs.interleave`).

    Exchanges run on one channel per rank in issue order, each taking the all-to-all's latency
    plus bytes over bandwidth. ``lag``: how long an exchange waits for its EP peers to arrive,
    against the processor time the rank computed since the last exchange it waited for (where
    the peers last lined up): on processors the ranks share, the same work takes each peer a
    different wall time, and an exchange starts when the last one issues it. ``crowding``: the
    factor on the rank's processor time when more ranks than processors share them."""
    t = comm_free = compute = exposed = comm = background = since = lagged = 0.0
    on_time = 0.0  # when the channel would be free had no peer been late
    ready: dict[Any, tuple[float, float]] = {}
    for prog, op in ops:
        code = op[0]
        if code == "C":
            part, phase, units = op[1], op[2], op[3]
            if part in ("output", "input", "rope"):  # bookkeeping, no work
                continue
            dt = profile.time(part, phase, op[6], units) * crowding
            t += dt
            compute += dt
            since += dt
        elif code == "I":
            dur = profile.a2a_time(ep, op[2])
            background += profile.a2a_background(ep, op[2])
            issue = profile.issue_time(ep) * crowding
            t += issue
            compute += issue
            start = max(t + lag(since), comm_free) if lag is not None else max(t, comm_free)
            on_time = max(t, on_time) + dur
            comm_free = start + dur
            ready[(prog, op[1])] = (comm_free, comm_free - on_time)  # of its end, how late peers made it
            comm += dur
        elif code == "A":
            since = 0.0
            done, late = ready.pop((prog, op[1]), (t, 0.0))
            if done > t:
                exposed += done - t
                lagged += min(done - t, late)
                t = done
    return ActionTime(t, compute, exposed, comm, background, lagged)


def early_bs(schedule: Schedule) -> frozenset[tuple[int, int]]:
    """(stage, micro-batch) of every B that starts its W's work in its waits, on any rank
    (:func:`~portapipe.scheduling.wgrad.early_weight_grads`, as the executor picks them)."""
    return frozenset().union(*(early_weight_grads(acts, schedule.stage_block) for acts in schedule.actions))


class TimeModel:
    """Durations of every action of ``schedule`` (lowered) for ``setup`` under ``profile``."""

    SHARING_ROUNDS = 30  # simulations at most while the shared processors' stretch settles

    def __init__(
        self, setup: Any, profile: Profile, schedule: Schedule, imbalance: float = 1.0,
        programs: Programs | None = None, cache: dict[tuple, ActionTime] | None = None, lists: list[list[Any]] | None = None,
        specs: list[StageSpec] | None = None, early: frozenset[tuple[int, int]] | None = None,
    ) -> None:
        """``schedule`` is lowered, or its lowered ``lists`` are given (posts as light tuples,
        see :func:`~portapipe.scheduling.comms.plan`). ``programs`` and ``cache`` may be shared
        by setups with the same micro-batch size, imbalance, EP size, overlap and device count (the
        planner's do): action times depend on nothing else. ``early``: :func:`early_bs` of
        ``schedule``, when the caller keeps it."""
        self.setup, self.schedule, self.imbalance = setup, schedule, imbalance
        self.lists = lists if lists is not None else schedule.actions
        self.shape = setup.shape
        self.profile = profile.for_shape(self.shape)
        self.tokens = setup.micro_batch_size * setup.model.seq_len
        self.programs = programs or Programs.of(setup, imbalance)
        self.rows = self.programs.R
        self.specs = specs if specs is not None else stage_specs(setup, schedule)
        # the Bs that start their W's work in their waits, as the executor runs them
        self.early = early_bs(schedule) if early is None else early
        self.switching = setup.ep > 1 and setup.overlap
        self.lag = self.profile.lag(setup.devices) if setup.ep > 1 else None
        self.crowding = self.profile.crowded(setup.devices)
        self._cache: dict[tuple, ActionTime] = {} if cache is None else cache
        act = self.tokens * self.shape.hidden * self.shape.e
        self.p2p_s = self.profile.p2p(act) + self.profile.p2p_extra(setup.devices)
        # posting point-to-point transfers costs the posting rank's thread (each batch of
        # consecutive SEND/RECV actions) and the communication threads (each transfer); both
        # are charged to the compute action after the batch
        self.posts: dict[tuple[int, Action], float] = {}
        self.post_background: dict[tuple[int, Action], float] = {}
        per_batch, per_transfer = self.profile.post_s * self.crowding, self.profile.p2p_cpu(act)
        if per_batch > 0 or per_transfer > 0:
            for r, acts in enumerate(self.lists):
                batches = transfers = 0
                prev_comm, last = False, None
                for a in acts:
                    if a.__class__ is tuple or a.kind.is_comm:
                        batches += not prev_comm
                        transfers += 1
                        prev_comm = True
                        continue
                    prev_comm, last = False, a
                    if batches:
                        self._charge(r, a, batches * per_batch, transfers * per_transfer)
                        batches = transfers = 0
                if batches and last is not None:
                    self._charge(r, last, batches * per_batch, transfers * per_transfer)
        self.posts_per_rank = [0.0] * schedule.n_ranks
        for (r, _), v in self.posts.items():
            self.posts_per_rank[r] += v

    def _charge(self, rank: int, a: Action, thread_s: float, background_s: float) -> None:
        key = (rank, a)
        self.posts[key] = self.posts.get(key, 0.0) + thread_s
        self.post_background[key] = self.post_background.get(key, 0.0) + background_s

    # ----------------------------------------------------------------- actions
    def _ops(self, half: Action) -> list[tuple]:
        spec: StageSpec = self.specs[half.stage]
        if half.kind is Kind.F:
            return self.programs.forward(spec)
        if half.kind is Kind.W:
            return self.programs.weights(spec, self._early(half))
        if half.kind is Kind.B:
            return self.programs.backward(spec, "B+" if self._early(half) else "B")
        return self.programs.backward(spec, "BW")

    def _early(self, half: Action) -> bool:
        """Whether ``half`` is a B that starts its W's work, or the W of one (its ops differ)."""
        return half.kind in (Kind.B, Kind.W) and (half.stage, half.mb) in self.early

    def exchanges(self, a: Action) -> int:
        """All-to-alls ``a`` issues (its halves' programs; none with one EP rank)."""
        if self.setup.ep <= 1:
            return 0
        return sum(op[0] == "I" for h in a.halves() for op in self._ops(h))

    def action(self, a: Action) -> ActionTime:
        """The duration of one compute action with nothing else sharing the processor."""
        if a.pair is not None:
            f, b = a.pair
            key: tuple = ("FB", self.specs[f.stage], self.specs[b.stage], b.kind, self._early(b))
        else:
            key = (a.kind, self.specs[a.stage], self._early(a))
        got = self._cache.get(key)
        if got is None:
            if a.pair is not None:
                merged = interleave(self._ops(a.pair[0]), self._ops(a.pair[1]), self.switching)
                halves = 2
            else:
                merged = [(0, op) for op in self._ops(a)]
                halves = 1
            t = run_ops(merged, self.profile, self.setup.ep, self.lag, self.crowding)
            extra = halves * self.profile.action_s * self.crowding
            copy = self._copies(a)
            # on their own stream the copies hide behind the action's work, and what does not fit shows;
            # in line with the compute (a CPU's), all of it shows
            shown = max(0.0, copy - t.wall - extra) if self.profile.host_overlap else copy
            own = 0.0 if self.profile.host_overlap else shown  # in line: the rank's own processor time
            got = ActionTime(t.wall + extra + shown, t.compute + extra + own, t.exposed, t.comm, t.background, t.lagged, copy, shown)
            self._cache[key] = got
        return got

    def _copies(self, a: Action) -> float:
        """Seconds of ``memory.offload``'s copies an action makes: what its forwards send to the
        host and what its backwards fetch back (issued as the action before starts: priced here,
        the same bytes each step)."""
        sent = fetched = 0.0
        for half in a.halves():
            spec = self.specs[half.stage]
            if not spec.offload:
                continue
            nbytes = sum(op[7] for op in self.programs.forward(spec) if op[0] == "C" and len(op) > 7)
            if half.kind is Kind.F:
                sent += nbytes
            elif half.kind in (Kind.B, Kind.BW):
                fetched += nbytes
        return self.profile.host_copy_time(fetched, sent) if sent or fetched else 0.0

    def _optimizer_copies(self, elements: float, experts: float) -> float:
        """Seconds of ``train.optimizer_offload``'s trips: the host share of this rank's master
        weights and moments to the device and back."""
        from ..config.model_shape import ELEMENT_BYTES
        from ..optim.precision import master_dtype, moments_dtype

        x = self.setup
        train = getattr(x, "train", None)
        if train is None or getattr(x, "optimizer_offload", "off") == "off":
            return 0.0
        em = ELEMENT_BYTES[master_dtype(x.model.dtype, train.master_dtype)]
        emo = ELEMENT_BYTES[moments_dtype(x.model.dtype, train.master_dtype, getattr(x, "moments_dtype", train.moments_dtype))]
        kept = (elements - experts) / (x.dp * x.ep) + experts / x.dp if getattr(x, "zero_stage", 0) else elements
        nbytes = x.offload_fraction * kept * ((em if em != self.shape.e else 0) + 2 * emo)
        return self.profile.host_copy_time(nbytes, nbytes)

    # --------------------------------------------------------------- the step
    def post_step(self) -> float:
        """After the schedule: DualPipe's gradient swap, replica all-reduces, gathers, AdamW."""
        s, x, prof = self.shape, self.setup, self.profile
        sched = self.schedule
        worst = 0.0
        self.optimizer_copy = (0.0, 0.0)  # the rank with the most: its trips' seconds, of them shown
        for r in range(sched.n_ranks):
            blocks = sched.blocks_of(r)
            elements = experts = tensors = 0
            for b in blocks:
                c = _block_count(x, s, b, sched.n_blocks)
                elements += c.elements
                experts += c.expert_elements
                tensors += c.tensors
            t = (prof.optimizer(elements) + prof.optimizer_tensor_s * tensors) * self.crowding
            copy = self._optimizer_copies(elements, experts)  # the trips run beside the buckets' updates where they can
            shown = max(0.0, copy - t) if prof.host_overlap else copy
            t += shown
            self.optimizer_copy = max(self.optimizer_copy, (copy, shown))
            if sched.name == "dualpipe":  # the two copies of each block exchange their gradients
                t += prof.p2p(elements * s.e)
            for n, count in ((x.dp * x.ep, elements - experts), (x.dp, experts)):
                t += self._replica_sync(n, count)
            small = 64.0
            t += prof.allreduce_time(x.pp, small) + prof.allreduce_time(x.dp * x.ep, small) + prof.allreduce_time(x.ep, small) + prof.allreduce_time(x.dp, small)
            worst = max(worst, t)
        share = self._share(x.devices)
        return worst * share

    def _replica_sync(self, n: int, elements: int) -> float:
        """Summing ``elements`` gradients over ``n`` replicas, in the reduction dtype: a ring all-reduce
        (zero_stage 0 / 1) or a reduce-scatter into the shards (2, half the ring's traffic); under
        zero_stage 1 / 2 the updated parameters (model dtype) are all-gathered from the shards (the
        other half of a ring)."""
        from ..config.model_shape import ELEMENT_BYTES
        from ..optim.precision import reduce_dtype

        x, prof = self.setup, self.profile
        train = getattr(x, "train", None)
        zero = getattr(x, "zero_stage", 0)
        grad_e = ELEMENT_BYTES[reduce_dtype(x.model.dtype, train.master_dtype, train.grad_reduce_dtype)] if train is not None else self.shape.e
        if n == 1 or zero == 0:
            return prof.allreduce_time(n, elements * grad_e)
        reduce = prof.allreduce_time(n, elements * grad_e) * (0.5 if zero == 2 else 1.0)
        return reduce + 0.5 * prof.allreduce_time(n, elements * self.shape.e)

    def _share(self, busy_procs: float) -> float:
        """How much slower compute runs with ``busy_procs`` processes on the profile's processors."""
        p = self.profile.processors
        return 1.0 if p is None else max(1.0, busy_procs / p)

    def demand(self, rank: int, a: Action) -> tuple[float, float, float]:
        """``a``'s wall time on ``rank`` with the processors to itself (posts included), the part
        of it spent waiting for exchanges, and the processor time it asks for meanwhile: its
        thread's and the communication threads'."""
        t, key = self.action(a), (rank, a)
        posted = self.posts.get(key, 0.0)
        return t.wall + posted, t.exposed, t.compute + t.background + posted + self.post_background.get(key, 0.0)

    def simulated(self) -> Any:
        """The schedule simulated with these durations (processor sharing included): its
        :class:`~portapipe.scheduling.simulate.SimResult`, in seconds (``portapipe timeline``'s plan)."""
        priced = _Priced(self, {})
        result = run_lists(self.schedule, self.lists, priced, True, True)
        if self.profile.processors is not None:
            result = self._with_sharing(priced, result)
        return result

    def predict(self) -> TimeReport:
        sched = self.schedule
        result = self.simulated()
        per_rank_a2a = [0.0] * sched.n_ranks
        per_rank_exposed = [0.0] * sched.n_ranks
        per_rank_cpu = [0.0] * sched.n_ranks
        edge_a2a = [0.0] * sched.n_ranks
        edge_exposed = [0.0] * sched.n_ranks
        copies = [[0.0, 0.0] for _ in range(sched.n_ranks)]  # per rank: memory.offload's copies, of them shown
        for r, acts in enumerate(self.lists):
            for a in acts:
                if a.__class__ is not tuple and a.kind.is_compute:
                    t = self.action(a)
                    copies[r][0] += t.copy
                    copies[r][1] += t.copy_exposed
                    per_rank_a2a[r] += t.comm
                    per_rank_exposed[r] += t.exposed
                    per_rank_cpu[r] += self.demand(r, a)[2]
                    if not a.fb_pair:
                        edge_a2a[r] += t.comm
                        edge_exposed[r] += t.exposed
        post = self.post_step()
        busiest = max(range(sched.n_ranks), key=lambda r: per_rank_exposed[r])
        copied = max(copies)
        return TimeReport(
            step_s=result.makespan + post, pipeline_s=result.makespan, post_s=post, bubble_s=result.max_bubble,
            a2a_s=per_rank_a2a[busiest], a2a_exposed_s=per_rank_exposed[busiest], imbalance=self.imbalance,
            per_rank_busy=list(result.busy), per_rank_cpu=per_rank_cpu,
            a2a_edge_s=edge_a2a[busiest], a2a_edge_exposed_s=edge_exposed[busiest],
            host_copy_s=copied[0], host_copy_exposed_s=copied[1], optimizer_copy_s=self.optimizer_copy[0],
            optimizer_copy_exposed_s=self.optimizer_copy[1],
        )

    def _with_sharing(self, priced: _Priced, result: Any) -> Any:
        """Re-simulate the ranks sharing the profile's processors (processor sharing): while
        more threads are ready to run than there are processors, every action's compute runs
        slower by ready threads / processors; its waits for exchanges are wall time as measured
        (peers' lag included). Over an action, the rank's thread is ready while it computes, the
        communication threads for their processor time stretched alike, and while it waits for
        a late EP peer the peer is still computing (the group keeps its share of the
        processors); during its other waits its processor serves the other ranks. A pipeline
        rank's EP and DP peers run the same actions at once."""
        peers = self.setup.ep * self.setup.dp
        p = float(self.profile.processors)
        priced.per_action = True
        for _ in range(self.SHARING_ROUNDS):
            edges: list[tuple[float, float]] = []
            rates: dict[tuple[int, Action], float] = {}
            for r, slots in enumerate(result.timeline):
                for sl in slots:
                    wall, waits, cpu = self.demand(r, sl.action)
                    length, work = sl.end - sl.start, wall - waits
                    # the thread computes for (length - waits) of the slot, stretched as it is now
                    ready = peers * cpu / work * max(0.0, length - waits) / length if length > 0 and work > 0 else 0.0
                    if length > 0:  # a wait for a late peer: that peer is still computing
                        ready += peers * self.action(sl.action).lagged / length
                    rates[(r, sl.action)] = ready
                    edges += [(sl.start, ready), (sl.end, -ready)]
            edges.sort()
            times: list[float] = []
            integral: list[float] = []
            active = last = acc = 0.0
            for when, delta in edges:
                acc += active * (when - last)
                times.append(when)
                integral.append(acc)
                active += delta
                last = when

            def area(t: float) -> float:  # integral of the ready threads from 0 to t
                i = bisect.bisect_right(times, t) - 1
                if i < 0:
                    return 0.0
                # the demand between breakpoints i and i+1 is constant
                nxt_i = min(i + 1, len(times) - 1)
                span = times[nxt_i] - times[i]
                slope = (integral[nxt_i] - integral[i]) / span if span > 0 else 0.0
                return integral[i] + slope * (t - times[i])

            change = 0.0
            new: dict[tuple[int, Action], float] = {}
            for r, slots in enumerate(result.timeline):
                for sl in slots:
                    wall, waits, _ = self.demand(r, sl.action)
                    length = sl.end - sl.start
                    ready = (area(sl.end) - area(sl.start)) / length if length > 0 else rates[(r, sl.action)]
                    want = (wall - waits) * max(1.0, ready / p) + waits
                    old = priced.of(sl.action, r)
                    dur = 0.5 * (old + want)
                    change = max(change, abs(dur - old) / max(old, 1e-12))
                    new[(r, sl.action)] = dur
            priced.durations = new
            result = run_lists(self.schedule, self.lists, priced, True, True)
            if change < 1e-3:
                break
        return result


class _Priced:
    """The simulator's cost model: each action's duration (per rank and action once stretched)."""

    rank_scale = None
    stage_scale = None

    def __init__(self, model: TimeModel, durations: dict[tuple[int, Action], float]) -> None:
        self.model, self.durations = model, durations
        self.p2p = model.p2p_s
        self.per_action = bool(model.posts)

    def of(self, action: Action, rank: int) -> float:
        got = self.durations.get((rank, action))
        if got is not None:
            return got
        return self.model.action(action).wall + self.model.posts.get((rank, action), 0.0)


def _block_count(setup: Any, s: Shape, block: int, n_blocks: int) -> Any:
    """Parameters of model block ``block`` of ``n_blocks`` on one EP rank of ``setup``."""
    bal = getattr(setup, "balancer", None)
    redundant = bal.redundant if bal is not None and bal.kind != "none" else 0
    return _block_params(s, block, n_blocks, s.n_experts // setup.ep + redundant, getattr(setup, "layers_per_stage", None))


@functools.lru_cache(maxsize=4096)
def _block_params(s: Shape, block: int, n_blocks: int, local_slots: int, split: Any = None) -> Any:
    from ..config.setup import layer_range

    first, last = layer_range(s.n_layers, n_blocks, block, split)
    return block_params(s, range(first, last), block == 0, block == n_blocks - 1, local_slots)
