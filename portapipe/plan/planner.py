"""Enumerate setups for a device count, drop what breaks a rule or the memory budget, rank the rest.

The global batch (sequences per step) stays the user's: every dp x ep rank of a stage runs its
own micro-batches, so a layout with ``r`` = dp x ep replicas runs ``m`` micro-batches of ``b``
sequences with ``r * m * b`` equal to the user's. Enumerated: pp x ep x dp layouts of the
devices, the five schedules (interleaved with the user's chunk count), every micro-batch count
that divides a replica's share, and the memory options (off, zero-memory level0 / level1,
recompute moe / full, full recompute of each stage's first layer with level1 on the rest, and
the recompute of norms alone, with recompute moe and with level1; under ``train.fp8`` each also with
FP8-cached activations, ``memory.fp8_activations``); per
candidate, the least ``train.zero_stage`` whose memory fits the budget (and, with ``allow``
``moments_dtype``, the user's moments dtype first, then bfloat16 moments, at each stage).

Each candidate is checked against the rule table first, then its per-rank peak memory
(:mod:`.memory_model`) against the budget; only then is its step time simulated
(:mod:`.time_model`), best bounds first: a candidate whose time cannot beat the ``keep``-th best
found so far (the busiest rank's work is a lower bound) is not simulated.
"""

from __future__ import annotations

import copy
import heapq
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..scheduling import comms
from ..scheduling.ir import Schedule
from ..scheduling.schedules import NAMES, build, pair_forwards, without_w_split
from .imbalance import imbalance
from .memory_model import MemoryModel, MemoryReport, static_memory
from .profile import Profile
from .programs import Programs, StageSpec, stage_specs
from ..config.rules import broken
from ..config.setup import Setup, split_problem, stage_layers
from .time_model import TimeModel, TimeReport, early_bs

PLANNED = ("layout", "schedule", "memory", "balancer")  # rule scopes a candidate can break
#: what ``portapipe plan --allow`` may let a candidate choose: ``moments_dtype`` (AdamW's moments in
#: bfloat16 where the user's do not fit, tried after them at each zero stage); ``offload`` (host
#: memory where nothing else fits: the optimizer's states, then also the parts' saved tensors)
ALLOWED = ("moments_dtype", "offload")
MEMORY_OPTIONS: tuple[dict[str, Any], ...] = (
    {},
    {"zero_memory": "level0"},
    {"zero_memory": "level1"},
    {"recompute": "moe"},
    {"recompute": "full"},
    {"recompute": "full", "recompute_layers": 1, "zero_memory": "level1"},
    {"recompute_norms": True},
    {"recompute": "moe", "recompute_norms": True},
    {"zero_memory": "level1", "recompute_norms": True},
)


@dataclass
class Candidate:
    setup: Setup
    problems: list[str] = field(default_factory=list)  # why it was dropped (empty: kept)
    memory: MemoryReport | None = None
    time: TimeReport | None = None
    bound_s: float = 0.0  # lower bound of the step time (the busiest rank's work)
    need: float | None = None  # dropped for memory alone: the bytes its fullest rank checked needs
    model: Any = field(default=None, repr=False, compare=False)  # its time model, until it is simulated

    @property
    def kept(self) -> bool:
        return not self.problems

    @property
    def tokens_per_step(self) -> int:
        return self.setup.global_batch * self.setup.model.seq_len


@dataclass
class PlanResult:
    base: Any  # the user's Config
    devices: int
    memory_bytes: float | None
    ranked: list[Candidate]  # kept and timed, fastest first
    dropped: dict[str, int]  # reason -> candidates dropped for it
    considered: int
    user: Candidate  # the user's own setup, judged the same way
    not_timed: int = 0  # kept but provably slower than the ranked ones
    #: the dropped setup nearest to fitting (:func:`nearer`), or None when none was dropped
    closest: Candidate | None = None
    #: layouts of the devices not enumerated, each with why (the experts or the batch do not split)
    untried: list[str] = field(default_factory=list)
    #: what the ranked rows' and the user's figures rest on beyond the profile's own (one line each)
    notes: list[str] = field(default_factory=list)

    def config_of(self, c: Candidate) -> Any:
        """The complete config of a candidate: the user's with the candidate's keys set."""
        from ..config import config_from_dict

        raw = copy.deepcopy(self.base.to_dict())
        for dotted, value in c.setup.overrides().items():
            section, key = dotted.split(".")
            raw[section][key] = value
        return config_from_dict(raw)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_counts(share: int, least: int, also: int | None = None) -> list[int]:
    """Micro-batch counts to try for a replica's ``share`` of sequences: divisors of it from
    ``least`` up, each at least twice the one before (the bubble's share halves each time), and
    the largest; ``also`` (the user's count) when it divides."""
    picked: list[int] = []
    target = least
    divs = [d for d in _divisors(share) if d >= least]
    for d in divs:
        if d >= target:
            picked.append(d)
            target = 2 * d
    if divs and divs[-1] not in picked:
        picked.append(divs[-1])
    if also is not None and share % also == 0 and also not in picked:
        picked.append(also)
    return sorted(picked)


def _least_microbatches(name: str, pp: int) -> int:
    return 2 * pp if name in ("dualpipe", "dualpipev") else pp


def enumerate_setups(user: Setup, devices: int, untried: list[str] | None = None) -> Iterator[Setup]:
    """Every layout, schedule, micro-batch count and memory option for ``devices`` that keeps the
    user's global batch; each with and without F&F pairs where pairs form (``schedule.pair_forwards``).
    ``untried`` (a list) is given a line for each layout left out, saying why."""
    g = user.global_batch
    m = user.model
    moe = m.n_layers > m.n_dense
    options = MEMORY_OPTIONS if moe else (MEMORY_OPTIONS[0], MEMORY_OPTIONS[4], MEMORY_OPTIONS[6])
    chunks = sorted({2, user.chunks})
    for pp in _divisors(devices):
        for ep in _divisors(devices // pp):
            dp = devices // (pp * ep)
            why = (f"{m.n_experts} experts do not split over ep {ep}" if m.n_experts % ep else
                   f"the global batch of {g} sequences does not split over dp x ep = {dp * ep} replicas" if g % (dp * ep) else None)
            if why is not None:
                if untried is not None:
                    untried.append(f"{pp}x{ep}x{dp}: {why}")
                continue
            share = g // (dp * ep)  # sequences per replica per step
            for name in NAMES:
                for v in chunks if name == "interleaved" else (2,):  # the default: other schedules refuse another value
                    for mb in microbatch_counts(share, _least_microbatches(name, pp), user.microbatches):
                        for opt in options:
                            even = user.replace(
                                pp=pp, ep=ep, dp=dp, world_size=None, schedule=name, chunks=v, microbatches=mb,
                                micro_batch_size=share // mb, zero_memory=opt.get("zero_memory", "off"),
                                zero_memory_layers=None, recompute=opt.get("recompute", "none"),
                                recompute_layers=opt.get("recompute_layers"), recompute_norms=opt.get("recompute_norms", False),
                                pair_forwards=False, layers_per_stage=None,
                            )
                            for x in with_fp8_activations((even, *lighter_last(even))):
                                yield x
                                paired = x.replace(pair_forwards=True)
                                if paired.paired_blocks:  # F&F pairs change something: both are candidates
                                    yield paired


def with_fp8_activations(setups: tuple[Setup, ...]) -> list[Setup]:
    """Each setup, and under ``train.fp8`` the same with FP8-cached activations
    (``memory.fp8_activations``) where the user's setup keeps them in the compute dtype."""
    out = list(setups)
    for x in setups:
        if x.train is not None and x.train.fp8 != "off" and not x.fp8_activations:
            out.append(x.replace(fp8_activations=True))
    return out


def lighter_last(x: Setup) -> list[Setup]:
    """``x`` with its last model block lighter by the multi-token prediction modules it holds
    (each an MoE layer and a head): ``parallel.layers_per_stage: {last: n}`` with n the even
    split's smallest block less the modules, the other blocks near-equal; none without modules
    or where that does not split."""
    m = x.model
    if not m.mtp_layers or m.n_layers < x.n_blocks:
        return []
    split = (("last", max(0, m.n_layers // x.n_blocks - m.mtp_layers)),)
    if split_problem(m.n_layers, x.n_blocks, split) or stage_layers(m.n_layers, x.n_blocks, split) == stage_layers(m.n_layers, x.n_blocks):
        return []
    return [x.replace(layers_per_stage=split)]


class _Context:
    """What candidates share: schedules, placements, stage programs and action times."""

    def __init__(self, profile: Profile, imb: Callable[[int], float], allow: tuple[str, ...] = ()) -> None:
        self.profile, self.imb = profile, imb
        #: ``--allow moments_dtype``: a candidate may keep AdamW's moments in bfloat16 to fit
        self.bf16_moments = "moments_dtype" in allow
        #: ``--allow offload``: a candidate may keep state in host memory to fit
        self.offload = "offload" in allow
        self._schedules: dict[tuple, Schedule | str] = {}
        self._placements: dict[tuple, Schedule | str] = {}
        self._programs: dict[tuple, Programs] = {}
        self._times: dict[tuple, dict] = {}
        self._counts: dict[int, list[list[tuple[Any, int]]]] = {}
        self._early: dict[int, frozenset[tuple[int, int]]] = {}  # id of a kept schedule -> its early Bs
        self._paired: dict[int, bool] = {}  # id of a kept schedule -> whether it runs F&F pairs
        self.walks: dict = {}  # the memory model's compiled action lists, by (schedule, rank)
        self._specs: dict[tuple, list[StageSpec]] = {}

    def specs(self, x: Setup, sched: Schedule) -> list[StageSpec]:
        """Each virtual stage's layers and memory options (placement and option decide them)."""
        key = (x.schedule, x.pp, x.chunks, x.zero_memory, x.zero_memory_layers, x.recompute, x.recompute_layers, x.layers_per_stage,
               x.recompute_norms, x.offload, x.offload_layers)
        if key not in self._specs:
            self._specs[key] = stage_specs(x, sched)
        return self._specs[key]

    def schedule(self, x: Setup) -> tuple[Schedule, list[list[Any]]] | str:
        """The schedule and its lowered lists (posts as light tuples: the models read both)."""
        pairs = x.paired_blocks
        key = (x.schedule, x.pp, x.microbatches, x.chunks, x.w_split, tuple(pairs))
        if key not in self._schedules:
            try:
                s = build(x.schedule, x.pp, x.microbatches, x.chunks)
                s = s if x.w_split else without_w_split(s)
                s = pair_forwards(s, pairs) if pairs else s
                self._schedules[key] = (s, comms.plan(s))
            except (ValueError, TypeError) as exc:
                self._schedules[key] = f"schedule: {exc}"
        return self._schedules[key]

    def has_pairs(self, sched: Schedule) -> bool:
        """Whether ``sched`` runs an F&F pair (kept schedules only: keyed by id)."""
        if id(sched) not in self._paired:
            self._paired[id(sched)] = any(a.ff_pair for acts in sched.actions for a in acts)
        return self._paired[id(sched)]

    def placement(self, x: Setup) -> Schedule | str:
        """A schedule with the fewest micro-batches: which blocks each rank holds."""
        key = (x.schedule, x.pp, x.chunks)
        if key not in self._placements:
            try:
                self._placements[key] = build(x.schedule, x.pp, _least_microbatches(x.schedule, x.pp), x.chunks)
            except (ValueError, TypeError) as exc:
                self._placements[key] = f"schedule: {exc}"
        return self._placements[key]

    def programs(self, x: Setup) -> Programs:
        key = (x.micro_batch_size, x.ep, x.fp8_activations)
        if key not in self._programs:
            self._programs[key] = Programs.of(x, self.imb(x.ep))
        return self._programs[key]

    def time_model(self, x: Setup, sched: Schedule, lists: list[list[Any]]) -> TimeModel:
        key = (x.micro_batch_size, x.ep, x.overlap, x.layers_per_stage)  # an action's time depends on its block's layers
        cache = self._times.setdefault(key, {})
        if id(sched) not in self._early:  # (the schedules are kept: their ids stay theirs)
            self._early[id(sched)] = early_bs(sched)
        return TimeModel(
            x, self.profile, sched, self.imb(x.ep), programs=self.programs(x), cache=cache, lists=lists, specs=self.specs(x, sched),
            early=self._early[id(sched)],
        )

    def busy(self, tm: TimeModel, sched: Schedule) -> float:
        """The busiest rank's work: a lower bound of the pipeline's makespan."""
        if id(sched) not in self._counts:  # one action of each kind and stage(s), and how many there are
            per_rank = []
            for acts in sched.actions:
                kinds: dict[tuple, list[Any]] = {}
                for a in acts:
                    if a.kind.is_compute:
                        key = tuple((h.kind, h.stage) for h in a.halves())
                        kinds.setdefault(key, [a, 0])[1] += 1
                per_rank.append([(a, n) for a, n in kinds.values()])
            self._counts[id(sched)] = per_rank
        worst = 0.0
        for r, counts in enumerate(self._counts[id(sched)]):
            worst = max(worst, sum(n * tm.action(a).wall for a, n in counts) + tm.posts_per_rank[r])
        return worst


def _twin(c: Candidate, paired: Setup) -> bool:
    """Whether ``c`` was made from ``paired``'s setup without F&F pairs (its zero stage, moments and offload aside)."""
    mine = c.setup.replace(zero_stage=paired.zero_stage, moments_dtype=paired.moments_dtype, optimizer_offload=paired.optimizer_offload,
                           offload_fraction=paired.offload_fraction, offload=paired.offload, offload_layers=paired.offload_layers)
    return mine == paired.replace(pair_forwards=False)


def _reason(line: str) -> str:
    """A problem line without its values, to count candidates per reason."""
    return line.split(":")[0]


def offload_levels(x: Setup) -> list[dict[str, Any]]:
    """What ``--allow offload`` tries for ``x`` where nothing fits without: the optimizer's states
    in host memory, then also the saved tensors of every part whose offload sends something under
    ``x``'s memory options (:func:`~portapipe.config.rules.violations` would refuse the others)."""
    from ..config.setup import OFFLOAD_PARTS

    m, per = x.model, x.max_stage_layers
    moe = m.n_layers > m.n_dense or bool(m.mtp_layers)
    has = {"attention": moe, "dense": m.n_dense > 0, "shared": moe and m.n_shared > 0, "experts": moe}
    every = (x.recompute_layers or per) >= per
    if x.recompute == "full" and every:
        has = {}
    elif (x.recompute == "moe" and every) or (x.zero_memory == "level1" and (x.zero_memory_layers or per) >= per and x.recompute == "none"):
        has["shared"] = has["experts"] = False
    parts = tuple(p for p in OFFLOAD_PARTS if has.get(p))
    levels = [{"optimizer_offload": "swap", "offload_fraction": 1.0, "offload": (), "offload_layers": None}]
    if parts:
        levels.append({**levels[0], "offload": parts})
    return levels


def evaluate(x: Setup, memory_bytes: float | None, ctx: _Context, search_zero: bool = True, timed: bool = True) -> Candidate:
    """Rules, then memory (parameters first, then the schedule's activations; with ``search_zero``
    the least zero_stage from the setup's that fits, and with ``--allow offload`` host memory
    where none does); a time bound (not with ``timed`` False: whether it fits is all that is asked).
    The time itself is left to :func:`plan`. With ``search_zero`` (a setup the planner made, not
    the user's own) one asking for F&F pairs where none form is dropped: it is its twin without them."""
    c = Candidate(x)
    for _rule, lines in broken(x, PLANNED):  # the model, train and backend rules hold for every candidate
        c.problems += lines
    if c.problems:
        return c
    place = ctx.placement(x)
    if isinstance(place, str):
        c.problems.append(place)
        return c
    built = ctx.schedule(x)
    if isinstance(built, str):
        c.problems.append(built)
        return c
    sched, lists = built
    if search_zero and x.pair_forwards and not ctx.has_pairs(sched):
        c.problems.append("schedule.pair_forwards: no two forwards in a row pair in this schedule")
        return c
    # zero_stage: the least sharding of the optimizer (and then the gradients) that fits the budget;
    # at each stage the user's moments dtype first, then bfloat16 moments where allowed
    searched = search_zero and memory_bytes is not None
    stages = [z for z in (0, 1, 2) if z >= x.zero_stage] if searched and x.replicas > 1 else [x.zero_stage]
    moments = [x.moments_dtype] + (["bfloat16"] if searched and ctx.bf16_moments and x.moments_dtype != "bfloat16" else [])
    hosts: list[dict[str, Any]] = [{}]
    if searched and ctx.offload and x.optimizer_offload == "off" and not x.offload:  # host memory where nothing else fits
        hosts += offload_levels(x)
    for host, zero, kept in [(o, z, m) for o in hosts for z in stages for m in moments]:
        c.problems = []
        c.setup = x = x.replace(zero_stage=zero, moments_dtype=kept, **host)
        if memory_bytes is not None:
            static = max(static_memory(x, place, r).static for r in range(place.n_ranks))
            if static > memory_bytes:
                c.problems.append(f"memory: parameters, gradients and optimizer state alone need {gib(static)} > budget {gib(memory_bytes)}")
                c.need = static
                continue
        # a setup the planner made stops at its first rank over the budget; the user's own is seen
        # whole, so that its report names the fullest rank, not the first one over
        c.memory = MemoryModel(
            x, sched, ctx.imb(x.ep), programs=ctx.programs(x), walks=ctx.walks, lists=lists, specs=ctx.specs(x, sched)
        ).report(memory_bytes, first_over=search_zero)
        if c.memory.over is None:
            break
        c.problems.append(f"memory: pipeline rank {c.memory.over} needs {gib(c.memory.over_total)} > budget {gib(memory_bytes)}")
        c.need = c.memory.over_total
    if c.problems:
        return c
    c.need = None
    if not timed:
        return c
    tm = ctx.time_model(x, sched, lists)
    c.bound_s = ctx.busy(tm, sched) + tm.post_step()
    c.model = tm
    return c


def nearer(a: Candidate | None, b: Candidate) -> Candidate:
    """Of two dropped setups, the nearer to fitting: one that breaks no rule and needs the least
    memory over the budget first, then the fewest problems (the first found on a tie)."""
    if a is None:
        return b
    key = lambda c: (0, c.need, 0) if c.need is not None else (1, 0.0, len(c.problems))  # noqa: E731
    return b if key(b) < key(a) else a


def a2a_notes(profile: Profile, eps: set[int]) -> list[str]:
    """One line per measured figure standing in for EP sizes the profile's ``a2a`` table lacks."""
    stand_ins: dict[str, list[int]] = {}
    for ep in sorted(eps):
        if (how := profile.a2a_stand_in(ep)) is not None:
            stand_ins.setdefault(how, []).append(ep)
    measured = ", ".join(str(k) for k in sorted(int(k) for k in profile.a2a))
    return [f"a2a at ep {', '.join(map(str, sizes))} {how} (the profile measured ep {measured})" for how, sizes in stand_ins.items()]


def gib(nbytes: float) -> str:
    """A byte count for people: GiB, or MiB / KiB / bytes when smaller."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def plan(
    config: Any,
    devices: int,
    memory_bytes: float | None,
    profile: Profile,
    loads: list[list[float]] | None = None,
    keep: int = 10,
    progress: Callable[[int, int], None] | None = None,
    allow: tuple[str, ...] = (),
) -> PlanResult:
    """Rank every setup of ``config``'s model on ``devices`` by predicted step time.

    ``loads`` (recorded expert loads) set the expert imbalance; default: the profile's.
    ``progress(done, total)`` is called as candidates are evaluated. ``allow``: settings the
    plan may choose beyond the layout, schedule and memory options (:data:`ALLOWED`).
    """
    user = Setup.from_config(config)
    ctx = _context(config, profile, loads, allow)
    untried: list[str] = []
    setups = list(enumerate_setups(user, devices, untried))
    if user.devices == devices and user not in setups:
        setups.append(user)
    if user.ep > 1 or any(x.ep > 1 for x in setups):
        profile.check_a2a()  # an empty table would make every all-to-all free
    total = len(setups)
    kept: list[Candidate] = []
    dropped: dict[str, int] = {}
    user_c: Candidate | None = None
    last: Candidate | None = None
    closest: Candidate | None = None
    for i, x in enumerate(setups):
        if x.pair_forwards and x != user and last is not None and not last.kept and _twin(last, x):
            # F&F pairs change no rule, no parameter and no peak of the memory model (two forwards
            # paired hold what they hold in turn): the twin of a dropped setup is dropped alike
            c = Candidate(x, problems=list(last.problems))
        else:
            c = evaluate(x, memory_bytes, ctx, search_zero=x != user)  # the user's own setup is judged as it is
        last = c
        if x == user:
            user_c = c
        if c.kept:
            kept.append(c)
        else:
            reason = _reason(c.problems[0])
            dropped[reason] = dropped.get(reason, 0) + 1
            closest = nearer(closest, c)
        if progress is not None and (i % 64 == 0 or i == total - 1):
            progress(i + 1, total)
    # simulate best bounds first; stop once a bound cannot beat the keep-th best time
    kept.sort(key=lambda c: c.bound_s)
    timed: list[Candidate] = []
    best: list[float] = []  # the keep fastest times so far, negated (a max-heap)
    not_timed = 0
    for c in kept:
        if len(best) >= keep and c.bound_s >= -best[0] and c is not user_c:
            not_timed += 1
            continue
        c.time = c.model.predict()
        timed.append(c)
        heapq.heappush(best, -c.time.step_s)
        if len(best) > keep:
            heapq.heappop(best)
    if user_c is None:  # the user's setup on another device count: judge it on its own
        user_c = evaluate(user, None, ctx)
        if user_c.kept:
            user_c.time = user_c.model.predict()
    elif user_c.kept and user_c.time is None:
        user_c.time = user_c.model.predict()
    timed.sort(key=lambda c: (c.time.step_s, c.memory.peak if c.memory else 0))  # type: ignore[union-attr]
    for c in kept + timed + [user_c]:
        c.model = None  # the schedules and caches it holds are not needed any more
    priced = {c.setup.ep for c in timed[:keep]} | ({user_c.setup.ep} if user_c.time is not None else set())
    return PlanResult(config, devices, memory_bytes, timed, dropped, total, user_c, not_timed, closest, untried, a2a_notes(profile, priced))


def _context(config: Any, profile: Profile, loads: list[list[float]] | None, allow: tuple[str, ...]) -> _Context:
    """What the candidates of ``config`` share, with the expert imbalance of ``loads`` (default: the profile's)."""
    loads = loads if loads is not None else profile.loads
    cache: dict[int, float] = {}

    def imb(ep: int) -> float:
        if ep not in cache:
            cache[ep] = imbalance(loads, ep, config.balancer, config.model.n_groups) if loads else 1.0
        return cache[ep]

    return _Context(profile, imb, allow)


def device_counts(user: Setup, most: int) -> list[int]:
    """The device counts up to ``most`` with a layout for ``user``'s model and global batch (the
    experts split evenly over the EP ranks, the batch over the dp x ep replicas)."""
    g, experts = user.global_batch, user.model.n_experts
    out = []
    for n in range(1, most + 1):
        if any(n % (pp * ep) == 0 and g % (n // pp) == 0 for pp in _divisors(n) for ep in _divisors(n // pp) if experts % ep == 0):
            out.append(n)
    return out


def least_held(setups: Iterator[Setup]) -> list[Setup]:
    """Of each layout, schedule and memory option, the setup with the most micro-batches (the
    smallest: what a stage holds per micro-batch in flight shrinks with them faster than the
    micro-batches in flight grow), without F&F pairs (they hold what their twins hold)."""
    best: dict[Setup, Setup] = {}
    for x in setups:
        if x.pair_forwards:
            continue
        key = x.replace(microbatches=1, micro_batch_size=1)
        if key not in best or x.microbatches > best[key].microbatches:
            best[key] = x
    return list(best.values())


def fits(config: Any, devices: int, memory_bytes: float, profile: Profile, allow: tuple[str, ...] = (), ctx: _Context | None = None) -> bool:
    """Whether a setup of ``config`` on ``devices`` devices fits ``memory_bytes`` per device (of
    :func:`least_held`'s: the rules, then the memory models; stops at the first that fits, no time priced)."""
    ctx = ctx or _context(config, profile, None, allow)
    return any(evaluate(x, memory_bytes, ctx, timed=False).kept for x in least_held(enumerate_setups(Setup.from_config(config), devices)))


def fewest_devices(config: Any, memory_bytes: float, profile: Profile, allow: tuple[str, ...] = (), most: int | None = None,
                   progress: Callable[[int, bool], None] | None = None) -> int | None:
    """The fewest devices (of :func:`device_counts`, up to ``most``: by default the config's own
    count) on which a setup of ``config`` fits ``memory_bytes`` (:func:`fits`), by bisection (a
    count that fits is taken to fit with more devices too: every layout family shards more over more devices);
    None when none fits at ``most``. ``progress(devices, fit)`` after each count tried."""
    user = Setup.from_config(config)
    counts = device_counts(user, most or user.devices)
    ctx = _context(config, profile, None, allow)

    def ok(n: int) -> bool:
        got = fits(config, n, memory_bytes, profile, allow, ctx)
        if progress is not None:
            progress(n, got)
        return got

    if not counts or not ok(counts[-1]):
        return None
    lo, hi = 0, len(counts) - 1  # counts[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(counts[mid]):
            hi = mid
        else:
            lo = mid + 1
    return counts[hi]


__all__ = ["ALLOWED", "device_counts", "fewest_devices", "fits", "offload_levels", "Candidate", "PlanResult", "enumerate_setups", "evaluate", "gib", "plan", "MEMORY_OPTIONS"]
