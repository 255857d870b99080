"""The time model: exchanges exposed or hidden as the executor runs them, the simulator priced
per action (closed forms come back), ranks sharing processors, imbalance from recorded loads,
and profiles (fit, scale, bad files)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from portapipe.config import load_config
from portapipe.plan.imbalance import LoadsError, imbalance, read_loads
from portapipe.plan.profile import FORMAT, Linear, Profile, ProfileError
from portapipe.plan.programs import Programs, StageSpec, interleave
from portapipe.plan.published import published
from portapipe.config.setup import Setup
from portapipe.plan.shape import Shape, flops
from portapipe.plan.time_model import TimeModel, run_ops
from portapipe.scheduling.executor import build_schedule
from portapipe.scheduling.ir import Kind
from portapipe.scheduling.simulate import Costs, simulate

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"


def profile(shape: Shape, parts: dict, a2a: float = 0.0, processors: float | None = None, a2a_cpu: float = 0.0, **extra: object) -> Profile:
    """A made-up profile: ``parts[part][phase]`` seconds per call (fixed; or (fixed, per unit)), all-to-all ``a2a``
    seconds taking ``a2a_cpu`` seconds of the communication threads' processor time."""
    return Profile.from_dict({
        "format": FORMAT, "device": {"backend": "test"}, "torch": "-", "shape": shape.to_dict(),
        "parts": {"off": {p: {ph: _cost(v) for ph, v in t.items()} for p, t in parts.items()}},
        "a2a": {"2": {"fixed": a2a, "per_unit": 0.0}}, "p2p": {"fixed": 0.0, "per_unit": 0.0},
        "a2a_cpu": {"2": {"fixed": a2a_cpu, "per_unit": 0.0}},
        "allreduce": {}, "optimizer": {"fixed": 0.0, "per_unit": 0.0}, "processors": processors, **extra,
    })


def _cost(v: float | tuple[float, float]) -> dict[str, float]:
    fixed, per_unit = v if isinstance(v, tuple) else (v, 0.0)
    return {"fixed": fixed, "per_unit": per_unit}


# the experts by the row (3 s and 1 s for the 512 rows of every test's micro-batch), so that
# their calls on the local and on the received rows add up whatever the split
MOE = {"attention": {"F": 4.0, "B": 4.0, "W": 2.0}, "experts": {"F": (0.0, 3 / 512), "B": (0.0, 3 / 512), "W": (0.0, 1 / 512)},
       "shared": {"F": 1.0, "B": 1.0, "W": 0.5}, "combine": {"F": 0.5, "B": 0.5}}


def _one_layer() -> tuple[Shape, Programs, StageSpec]:
    cfg = load_config(EXAMPLE, ["parallel.pp=1", "model.n_layers=2", "model.n_dense=1"])
    s = Shape.of(cfg.model)
    return s, Programs(s, 256, 512, ep=2), StageSpec((1,), ("off",), False, False)


def test_a_lone_forward_hides_its_dispatch_behind_the_shared_expert_and_its_combine_behind_the_local_rows() -> None:
    s, progs, spec = _one_layer()
    prof = profile(s, MOE, a2a=2.0)
    t = run_ops([(0, op) for op in progs.forward(spec)], prof, ep=2)
    # attention 4; the counts (waited for: 2 s), then the rows with their router weights (2 s
    # each): the rows arrive at 4 + 4 = 8, of which the shared expert (1) hides 1 s; the received
    # rows' experts 1.5 (half the rows at ep 2); the local rows' 1.5 hide as much of the combine (2 s)
    assert t.compute == pytest.approx(4 + 1 + 3 + 0.5)
    assert t.exposed == pytest.approx(2 + 1 + 0.5)
    # the program yields while the counts travel (an F&B pair's other program runs), then waits
    ops = progs.forward(spec)
    assert ops.index(("Y", ("n", 1))) == ops.index(("A", ("n", 1))) - 1
    assert t.wall == pytest.approx(t.compute + t.exposed)
    assert t.comm == pytest.approx(6.0)


def test_a_lone_backward_hides_its_exchanges_behind_the_local_rows_and_the_shared_expert_and_in_a_bw_the_w_work() -> None:
    s, progs, spec = _one_layer()
    prof = profile(s, MOE, a2a=2.0)
    b = run_ops([(0, op) for op in progs.backward(spec, "B")], prof, ep=2)
    # combine 0.5, then its reverse exchange (arrives at 2.5) while the local rows' experts
    # backward (1.5) and the shared expert's (1) run: nothing exposed; the received rows'
    # experts 1.5 (to 4.5); the rows' reverse exchange, with the weights' gradients (to 6.5),
    # nothing left to hide it: 2 s exposed
    assert b.exposed == pytest.approx(2)
    bw = run_ops([(0, op) for op in progs.backward(spec, "BW")], prof, ep=2)
    # a full backward also computes the local rows' and the shared expert's W before the first
    # wait and the received rows' experts W (0.5) while the rows travel: 1.5 exposed
    assert bw.exposed == pytest.approx(1.5)
    assert bw.compute == pytest.approx(b.compute + 2.0 + 1.0 + 0.5)  # W: attention, experts (every row), shared
    # the W ops are the W pass's, each moved to the first wait after its part
    assert sorted(op for op in progs.backward(spec, "BW") if op[0] == "C" and op[2] == "W") == sorted(progs.weights(spec))


def test_a_b_that_starts_its_w_work_early_prices_it_before_its_waits_and_leaves_the_rest_to_the_w() -> None:
    s, progs, spec = _one_layer()
    prof = profile(s, MOE, a2a=2.0)
    b = run_ops([(0, op) for op in progs.backward(spec, "B")], prof, ep=2)
    early = run_ops([(0, op) for op in progs.backward(spec, "B+")], prof, ep=2)
    # as a BW up to its last wait: the local rows' experts W and the shared expert's before the
    # first, the received rows' experts W (0.5) while the rows travel: 1.5 s exposed, not 2
    assert early.exposed == pytest.approx(1.5)
    assert early.compute == pytest.approx(b.compute + 1.0 + 0.5)  # experts (every row), shared
    rest = progs.weights(spec, after_start=True)
    assert [op[1] for op in rest] == ["attention"]  # its W: the attention's, after the last wait
    moved = [op for op in progs.backward(spec, "B+") if op[0] == "C" and op[2] == "W"]
    assert sorted(moved + rest) == sorted(progs.weights(spec))


def test_the_time_model_prices_the_executors_early_bs_and_their_ws() -> None:
    cfg = load_config(EXAMPLE, ["schedule.name=dualpipev", "parallel.ep=2"])
    setup = Setup.from_config(cfg)
    schedule = build_schedule(cfg)
    prof = profile(Shape.of(cfg.model), MOE, a2a=2.0)
    tm = TimeModel(setup, prof, schedule)
    acts = {str(a): a for r in schedule.actions for a in r if a.kind.is_compute}
    assert tm.early == {(3, 0), (0, 2), (0, 3), (1, 3), (2, 3)}
    # 3B0 (its W next) hides more of its exchanges than a B of the same stage that may not,
    # and its W is left with less work
    late = TimeModel(setup, prof, schedule)
    late.early = frozenset()
    assert tm.action(acts["3B0"]).exposed < late.action(acts["3B0"]).exposed
    assert tm.action(acts["3W0"]).compute < late.action(acts["3W0"]).compute


def test_an_fb_pair_hides_one_micro_batchs_exchanges_behind_the_other_and_ep1_runs_them_in_turn() -> None:
    s, progs, spec = _one_layer()
    prof = profile(s, MOE, a2a=2.0)
    f, b = progs.forward(spec), progs.backward(spec, "BW")
    lone = run_ops([(0, op) for op in f], prof, 2).wall + run_ops([(0, op) for op in b], prof, 2).wall
    pair = run_ops(interleave(f, b, switching=True), prof, 2)
    assert pair.wall < lone
    assert pair.exposed < run_ops([(0, op) for op in f], prof, 2).exposed + run_ops([(0, op) for op in b], prof, 2).exposed
    in_turn = interleave(f, b, switching=False)
    assert [op for _, op in in_turn] == list(f) + list(b)
    assert run_ops(in_turn, prof, 1).wall == pytest.approx(run_ops([(0, op) for op in f], prof, 1).wall + run_ops([(0, op) for op in b], prof, 1).wall)


def test_an_f_and_f_pair_hides_each_forwards_exchanges_behind_the_other_and_counts_at_the_edges() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=2", "parallel.ep=2", "schedule.name=1f1b", "schedule.microbatches=4", "schedule.pair_forwards=true"])
    s = Shape.of(cfg.model)
    prof = profile(s, {**MOE, "dense": {"F": 1.0, "B": 1.0, "W": 0.5}, "embed": {"F": 0.1, "B": 0.1}, "head": {"F": 1.0, "B": 1.0, "W": 0.5}}, a2a=2.0)
    sched = build_schedule(cfg)
    model = TimeModel(Setup.from_config(cfg), prof, sched)
    pair = next(a for a in sched.actions[0] if a.pair is not None)
    assert str(pair) == "(0F0;0F1)" and not pair.fb_pair
    first, second = (model.action(h) for h in pair.pair)
    both = model.action(pair)
    assert max(first.wall, second.wall) < both.wall < first.wall + second.wall
    assert both.exposed < first.exposed + second.exposed and both.comm == pytest.approx(first.comm + second.comm)
    got = model.predict()  # 1F1B has no F&B pair: every exchange is the edges'
    assert got.a2a_edge_s == pytest.approx(got.a2a_s) and got.a2a_steady_hidden_frac == 0.0


def test_zero_memorys_re_dispatch_goes_first_and_the_combines_reverse_exchange_queues_behind_it() -> None:
    s, progs, _ = _one_layer()
    off, lvl0 = StageSpec((1,), ("off",), False, False), StageSpec((1,), ("level0",), False, False)
    combine = MOE["combine"]["B"]
    # 4.0 s of full backward: the combine, the local rows' experts (half the rows: B and W)
    # and the shared expert (B and W)
    before_wait = combine + (3.0 + 1.0) / 2 + MOE["shared"]["B"] + MOE["shared"]["W"]
    for a2a in (2.0, 5.0):
        prof = profile(s, MOE, a2a=a2a)
        lone_off = run_ops([(0, op) for op in progs.backward(off, "BW")], prof, 2)
        lone_l0 = run_ops([(0, op) for op in progs.backward(lvl0, "BW")], prof, 2)
        assert lone_l0.comm == pytest.approx(lone_off.comm + a2a)
        # off: the combine's reverse rows arrive at combine + a2a; level0: the re-dispatch,
        # issued at 0, holds the channel until a2a, so they arrive at 2 a2a
        assert lone_l0.wall - lone_off.wall == pytest.approx(max(before_wait, 2 * a2a) - max(before_wait, combine + a2a))


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"])
def test_priced_per_action_the_simulator_gives_the_uniform_costs_makespan(name: str) -> None:
    """Dense layers only, one per stage, no exchanges: every action costs what Costs(F, B, W) says."""
    blocks = {"interleaved": 8, "dualpipev": 8}.get(name, 4)
    cfg = load_config(EXAMPLE, ["parallel.pp=4", "parallel.ep=1", f"schedule.name={name}", "schedule.microbatches=8",
                                f"model.n_layers={blocks}", f"model.n_dense={blocks}", "schedule.overlap=false"])
    s = Shape.of(cfg.model)
    prof = profile(s, {"dense": {"F": 1.0, "B": 1.5, "W": 0.5}})
    sched = build_schedule(cfg)
    got = TimeModel(Setup.from_config(cfg), prof, sched).predict()
    want = simulate(sched, Costs(F=1.0, B=2.0, W=0.5))
    assert got.pipeline_s == pytest.approx(want.makespan)
    assert got.bubble_s == pytest.approx(want.max_bubble)


def test_ranks_sharing_processors_slow_each_other_down() -> None:
    cfg = load_config(EXAMPLE, ["parallel.ep=1", "schedule.name=1f1b", "model.n_dense=4", "schedule.microbatches=4"])
    s = Shape.of(cfg.model)
    sched = build_schedule(cfg)
    x = Setup.from_config(cfg)
    own = TimeModel(x, profile(s, {"dense": {"F": 1.0, "B": 2.0, "W": 0.0}}), sched).predict()
    two = TimeModel(x, profile(s, {"dense": {"F": 1.0, "B": 2.0, "W": 0.0}}, processors=2), sched).predict()
    one = TimeModel(x, profile(s, {"dense": {"F": 1.0, "B": 2.0, "W": 0.0}}, processors=1), sched).predict()
    assert two.pipeline_s == pytest.approx(own.pipeline_s)  # as many processors as ranks
    # two ranks on one processor: at least all the work one after the other, at most twice the time
    busy = sum(own.per_rank_busy)
    assert busy * 0.98 <= one.pipeline_s <= 2 * own.pipeline_s


def test_imbalance_from_recorded_loads() -> None:
    loads = [[10.0, 0.0, 0.0, 0.0], [4.0, 4.0, 4.0, 4.0]]
    assert imbalance(loads, 1) == 1.0
    assert imbalance(loads, 2) == pytest.approx((2.0 + 1.0) / 2)  # rank loads [10, 0] and [8, 8]
    assert imbalance(loads, 4) == pytest.approx((4.0 + 1.0) / 2)
    skewed = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86]]
    cfg = load_config(EXAMPLE, ["model.n_experts=12", "balancer.kind=eplb", "balancer.redundant=2"])
    none = imbalance(skewed, 4)
    eplb = imbalance(skewed, 4, cfg.balancer)
    assert 1.0 <= eplb < none
    lplb_cfg = load_config(EXAMPLE, ["model.n_experts=12", "balancer.kind=lplb", "balancer.redundant=1", "parallel.ep=4", "parallel.pp=1"])
    assert 1.0 <= imbalance(skewed, 4, lplb_cfg.balancer) < none


def test_loads_files(tmp_path: Path) -> None:
    good = tmp_path / "expert_loads.json"
    good.write_text(json.dumps({"step": 10, "layers": [1, 2], "loads": [[1, 2], [3, 4]]}))
    assert read_loads(good) == [[1.0, 2.0], [3.0, 4.0]]
    for bad, text in (("ragged", [[1, 2], [3]]), ("negative", [[1, -2]]), ("empty", [])):
        path = tmp_path / f"{bad}.json"
        path.write_text(json.dumps(text))
        with pytest.raises(LoadsError, match="--loads"):
            read_loads(path)
    with pytest.raises(LoadsError, match="does not exist"):
        read_loads(tmp_path / "missing.json")
    # the files `portapipe balance --loads` reads, with its errors
    text = tmp_path / "loads.txt"
    text.write_text("# layer per line\n1, 2\n3 4\n")
    assert read_loads(text) == [[1.0, 2.0], [3.0, 4.0]]
    text.write_text("1,,2\n")
    with pytest.raises(LoadsError, match="--loads: .*empty field"):
        read_loads(text)
    flags = tmp_path / "flags.json"
    flags.write_text("[[true, 2]]")
    with pytest.raises(LoadsError, match="not a number"):
        read_loads(flags)


# ------------------------------------------------------------------------------ profiles
def test_linear_fit_recovers_a_line_and_never_goes_negative() -> None:
    fit = Linear.fit([(100, 1.5), (300, 3.5)])
    assert (fit.fixed, fit.per_unit) == pytest.approx((0.5, 0.01))
    steep = Linear.fit([(100, 0.5), (200, 2.0)])  # would need a negative fixed cost: through the mean instead
    assert steep.fixed == 0.0 and steep(150) == pytest.approx(1.25)


def test_a_profile_scales_to_another_shape_by_flops() -> None:
    cfg = load_config(EXAMPLE)
    s = Shape.of(cfg.model)
    prof = published("h800", s)
    assert prof.for_shape(s) is prof
    big = Shape.of(load_config(EXAMPLE, ["model.hidden=128", "model.moe_hidden=64"]).model)
    scaled = prof.for_shape(big)
    for part in ("attention", "experts", "head"):
        ratio = flops(big, part, "F") / flops(s, part, "F")
        assert scaled.parts["off"][part]["F"].per_unit == pytest.approx(prof.parts["off"][part]["F"].per_unit * ratio)
        assert scaled.parts["off"][part]["F"].fixed == prof.parts["off"][part]["F"].fixed
    assert "scaled by FLOPs" in scaled.source


def test_bad_profiles_are_refused_naming_what_is_wrong(tmp_path: Path) -> None:
    s = Shape.of(load_config(EXAMPLE).model)
    good = published("h800", s).to_dict()
    cases = {
        "format": {**good, "format": 0},
        "missing": {k: v for k, v in good.items() if k != "a2a"},
        "negative": {**good, "p2p": {"fixed": -1.0, "per_unit": 0.0}},
        "part": {**good, "parts": {"off": {"gpu": {"F": {"fixed": 0, "per_unit": 0}}}}},
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(data))
        with pytest.raises(ProfileError, match=f"--profile {path}"):
            Profile.load(path)
    (tmp_path / "text.json").write_text("not json")
    with pytest.raises(ProfileError, match="is not JSON"):
        Profile.load(tmp_path / "text.json")
    round_trip = tmp_path / "ok.json"
    published("h800", s).save(round_trip)
    assert Profile.load(round_trip).to_dict() == good


# ------------------------------------------------------------------- shared processors
def _moe_ep2(extra: list[str] = ()) -> tuple:
    cfg = load_config(EXAMPLE, ["parallel.pp=1", "parallel.ep=2", "schedule.name=1f1b", "schedule.microbatches=2",
                                "model.n_layers=2", "model.n_dense=1", *extra])
    return cfg, Shape.of(cfg.model), build_schedule(cfg), Setup.from_config(cfg)


def test_the_communication_threads_processor_time_competes_for_shared_processors() -> None:
    """Exchanges that take no wall time but g seconds of gloo's threads: a forward issues three
    (row counts, rows with their router weights, combine), a backward two. Two EP ranks on two
    processors each ask for their compute plus g per exchange, so every action takes that long;
    with four processors (or a device each) the background runs beside the compute for free."""
    cfg, s, sched, x = _moe_ep2()
    parts = {"dense": {"F": 1.0, "B": 2.0, "W": 0.5}, **MOE}
    g = 0.25
    lone = TimeModel(x, profile(s, parts, a2a_cpu=g), sched)
    f = next(a for a in sched.actions[0] if a.kind is Kind.F)
    b = next(a for a in sched.actions[0] if a.kind in (Kind.B, Kind.BW))
    assert lone.action(f).background == pytest.approx(3 * g)
    assert lone.action(b).background == pytest.approx(2 * g)
    m = cfg.schedule.microbatches
    compute = m * (lone.action(f).compute + lone.action(b).compute)
    assert lone.predict().pipeline_s == pytest.approx(compute)
    two = TimeModel(x, profile(s, parts, a2a_cpu=g, processors=2), sched).predict()
    assert two.pipeline_s == pytest.approx(compute + m * 5 * g, rel=2e-3)
    four = TimeModel(x, profile(s, parts, a2a_cpu=g, processors=4), sched).predict()
    assert four.pipeline_s == pytest.approx(compute, rel=2e-3)


def test_point_to_point_transfers_charge_both_ends() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=2", "parallel.ep=1", "schedule.name=1f1b", "schedule.microbatches=4",
                                "model.n_dense=4", "schedule.w_split=false"])
    s, sched, x = Shape.of(cfg.model), build_schedule(cfg), Setup.from_config(cfg)
    dense = {"dense": {"F": 1.0, "B": 2.0, "W": 0.0}}
    per_end, per_batch = 0.125, 0.0625
    tm = TimeModel(x, profile(s, dense, p2p_cpu={"fixed": per_end, "per_unit": 0.0}, post_s=per_batch), sched)
    # each rank sends and receives one tensor per micro-batch and direction: 4 x 2 transfers
    for r in range(2):
        assert sum(v for (rank, _), v in tm.post_background.items() if rank == r) == pytest.approx(8 * per_end)
    busy = max(tm.demand(r, a)[2] for r, acts in enumerate(tm.lists) for a in acts if a.__class__ is not tuple and a.kind.is_compute)
    assert busy > 2.0  # a backward's compute plus what its transfers cost the communication threads
    alone = TimeModel(x, profile(s, dense, p2p_cpu={"fixed": per_end, "per_unit": 0.0}, post_s=per_batch), sched).predict()
    shared = TimeModel(x, profile(s, dense, processors=1, p2p_cpu={"fixed": per_end, "per_unit": 0.0}, post_s=per_batch), sched).predict()
    # one processor: at least every rank's processor time one after the other
    total = sum(tm.demand(r, a)[2] for r, acts in enumerate(tm.lists) for a in acts if a.__class__ is not tuple and a.kind.is_compute)
    assert shared.pipeline_s >= total * 0.98 and shared.pipeline_s > alone.pipeline_s


def test_an_exchange_waits_for_its_peers_lag_after_computing() -> None:
    """lag = 0.5 s + 0.25 x the compute since the peers last lined up (the last wait): the row
    counts follow 4 s of attention (1.5 s late), the rows (with their router weights) follow the
    counts' wait (0.5 s), the combine follows 1.5 s of the received
    rows' experts (0.875 s late, 1.375 s after its issue, of which the local rows' 1.5 s hid 0.5)."""
    s, progs, spec = _one_layer()
    prof = profile(s, MOE, a2a=2.0)
    ops = [(0, op) for op in progs.forward(spec)]
    plain = run_ops(ops, prof, ep=2)
    late = run_ops(ops, prof, ep=2, lag=Linear(0.5, 0.25))
    assert late.compute == plain.compute == pytest.approx(8.5)
    assert late.exposed == pytest.approx(plain.exposed + 1.5 + 0.5 + 0.875)
    # attention 4, counts 3.5, rows 2.5 (the shared expert's 1 inside), received rows' experts
    # 1.5, local rows' experts 1.5, the combine's exposed 1.375, combine part 0.5
    assert late.wall == pytest.approx(14.875)


def test_the_lag_is_the_one_measured_with_as_many_ranks_computing() -> None:
    s = Shape.of(load_config(EXAMPLE).model)
    lags = {"2": {"fixed": 1e-4, "per_unit": 0.1}, "4": {"fixed": 3e-4, "per_unit": 0.2}}
    shared = profile(s, MOE, processors=2, a2a_lag=lags)
    assert shared.lag(2) == Linear(1e-4, 0.1) and shared.lag(4) == Linear(3e-4, 0.2) and shared.lag(8) == Linear(3e-4, 0.2)
    assert shared.lag(1) == Linear(1e-4, 0.1)
    assert profile(s, MOE, a2a_lag=lags).lag(4) is None  # ranks with a device each do not share processors


def test_a_ranks_waits_let_the_others_compute_on_shared_processors() -> None:
    """Four EP ranks on two processors: each runs at half speed while all compute, and while one
    waits for an exchange the others use its processor, so every action takes twice its compute
    (the fixed point of processor sharing while that exceeds the waits)."""
    cfg, s, sched, x = _moe_ep2(["parallel.ep=4"])
    parts = {"dense": {"F": 1.0, "B": 2.0, "W": 0.5}, **MOE}
    alone = TimeModel(x, profile(s, parts, a2a=0.5), sched)
    work = sum(alone.action(a).compute for a in sched.actions[0] if a.kind.is_compute)
    waits = sum(alone.action(a).exposed for a in sched.actions[0] if a.kind.is_compute)
    assert 0 < waits < work / 4
    assert alone.predict().pipeline_s == pytest.approx(work + waits)
    shared = TimeModel(x, profile(s, parts, a2a=0.5, processors=2), sched).predict()
    assert shared.pipeline_s == pytest.approx(2 * work, rel=1e-2)


def test_crowding_scales_compute_once_ranks_outnumber_processors() -> None:
    s = Shape.of(load_config(EXAMPLE).model)
    prof = profile(s, MOE, processors=2, crowding={"6": 1.5})
    assert prof.crowded(2) == 1.0 and prof.crowded(4) == pytest.approx(1.25) and prof.crowded(6) == 1.5 and prof.crowded(12) == 1.5
    assert profile(s, MOE, crowding={"6": 1.5}).crowded(6) == 1.0  # a device per rank
    # four EP ranks on two processors, the parts 25% slower each: twice the compute (sharing), times 1.25
    cfg, s, sched, x = _moe_ep2(["parallel.ep=4"])
    parts = {"dense": {"F": 1.0, "B": 2.0, "W": 0.5}, **MOE}
    work = sum(TimeModel(x, profile(s, parts, a2a=0.5), sched).action(a).compute for a in sched.actions[0] if a.kind.is_compute)
    crowded = TimeModel(x, profile(s, parts, a2a=0.5, processors=2, crowding={"4": 1.25}), sched).predict()
    assert crowded.pipeline_s == pytest.approx(2 * 1.25 * work, rel=1e-2)


def test_transfers_take_longer_while_ranks_outnumber_processors() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=4", "parallel.ep=1", "schedule.name=1f1b", "model.n_dense=4"])
    s, sched, x = Shape.of(cfg.model), build_schedule(cfg), Setup.from_config(cfg)
    p2p = {"fixed": 1e-4, "per_unit": 1e-9}
    act = cfg.train.micro_batch_size * cfg.model.seq_len * cfg.model.hidden * 4
    for processors, extra in ((None, 0.0), (4, 0.0), (2, 2e-3)):
        prof = profile(s, {"dense": {"F": 1.0}}, processors=processors, p2p=p2p, p2p_crowded={"4": 2e-3})
        assert TimeModel(x, prof, sched).p2p_s == pytest.approx(1e-4 + 1e-9 * act + extra)


def test_the_optimizer_pays_per_parameter_element_and_tensor() -> None:
    """AdamW updates tensor by tensor: a rank holding the whole model pays per element and per
    tensor of the real model's parameters."""
    from portapipe.compose import build_model
    from portapipe.models.expert_parallel import ExpertParallel

    cfg = load_config(EXAMPLE, ["parallel.pp=1", "parallel.ep=1", "schedule.name=1f1b"])
    s, sched, x = Shape.of(cfg.model), build_schedule(cfg), Setup.from_config(cfg)
    params = [p for b in build_model(cfg, [0], 1, ExpertParallel(None, 1, 0, None)).values() for p in b.parameters()]
    tensors, elements = len(params), sum(p.numel() for p in params)
    per_tensor = profile(s, {"dense": {"F": 1.0}}, optimizer_tensor_s=1e-3)
    assert TimeModel(x, per_tensor, sched).post_step() == pytest.approx(1e-3 * tensors)
    per_element = profile(s, {"dense": {"F": 1.0}}, optimizer={"fixed": 0.0, "per_unit": 1e-9})
    assert TimeModel(x, per_element, sched).post_step() == pytest.approx(1e-9 * elements)


def test_zero_stages_price_the_reduce_scatter_and_the_all_gather_of_the_updated_parameters() -> None:
    """Ring collectives over the dp replicas (pp 1, ep 1): zero 0 all-reduces the gradients
    (float32: 4 bytes each), zero 1 adds the all-gather of the updated parameters (bfloat16: 2
    bytes, half a ring), zero 2 reduce-scatters the gradients instead (half a ring)."""
    from portapipe.compose import build_model
    from portapipe.models.expert_parallel import ExpertParallel

    cfg = load_config(EXAMPLE, ["parallel.pp=1", "parallel.ep=1", "parallel.dp=4", "schedule.name=1f1b", "model.dtype=bfloat16"])
    s, sched = Shape.of(cfg.model), build_schedule(cfg)
    n = sum(p.numel() for b in build_model(cfg, [0], 1, ExpertParallel(None, 1, 0, None)).values() for p in b.parameters())
    ring = 2 * 3 / 4  # a ring all-reduce over 4 moves 2(n-1)/n of the bytes; the fit is stored at n = 2 (factor 1)
    prof = profile(s, {"dense": {"F": 1.0}}, allreduce={"2": {"fixed": 0.0, "per_unit": 1e-9}})
    times = [TimeModel(Setup.from_config(cfg).replace(zero_stage=z), prof, sched).post_step() for z in (0, 1, 2)]
    grads, params = 1e-9 * ring * 4 * n, 1e-9 * ring * 2 * n
    gathers = 2 * 1e-9 * ring * 64  # the loss and load gathers over dp x ep and dp (64 bytes each)
    assert times == pytest.approx([grads + gathers, grads + params / 2 + gathers, grads / 2 + params / 2 + gathers], rel=1e-12)


def test_profiles_refuse_negative_costs_and_crowding_below_one(tmp_path: Path) -> None:
    s = Shape.of(load_config(EXAMPLE).model)
    for extra, fragment in (({"action_s": -1.0}, "action_s"), ({"optimizer_tensor_s": float("inf")}, "optimizer_tensor_s"),
                            ({"crowding": {"4": 0.9}}, "crowding.4"), ({"a2a_lag": {"2": {"fixed": -1}}}, "a2a_lag.2")):
        with pytest.raises(ProfileError, match=fragment):
            profile(s, MOE, processors=2, **extra)


def test_a_wait_for_a_late_peer_keeps_the_processors_busy() -> None:
    """Exchanges that take no time but wait 0.25 s for the late peer: four EP ranks on two
    processors compute at half speed and the late peers' catching up holds the processors,
    so every action takes twice its compute plus its waits (without a lag: twice its compute,
    see above). A forward waits once: for the row counts (a blocking exchange); the shared
    expert hides the rows' lag, the local rows' experts the combine's."""
    cfg, s, sched, x = _moe_ep2(["parallel.ep=4"])
    parts = {"dense": {"F": 1.0, "B": 2.0, "W": 0.5}, **MOE}
    lag = {"2": {"fixed": 0.25, "per_unit": 0.0}}
    alone = TimeModel(x, profile(s, parts, processors=8, a2a_lag=lag), sched)
    acts = [a for a in sched.actions[0] if a.kind.is_compute]
    f = next(a for a in acts if a.kind is Kind.F)
    assert alone.action(f).lagged == alone.action(f).exposed == pytest.approx(0.25)
    work = sum(alone.action(a).compute for a in acts)
    waits = sum(alone.action(a).exposed for a in acts)
    assert alone.predict().pipeline_s == pytest.approx(work + waits)  # processors to spare
    shared = TimeModel(x, profile(s, parts, processors=2, a2a_lag=lag), sched).predict()
    assert shared.pipeline_s == pytest.approx(2 * work + waits, rel=1e-2)


def test_actions_count_the_exchanges_they_issue() -> None:
    cfg, s, sched, x = _moe_ep2(["schedule.name=dualpipev", "schedule.microbatches=4", "model.n_layers=4", "model.n_dense=1"])
    tm = TimeModel(x, profile(s, MOE), sched)
    # per MoE layer: row counts, rows with their router weights and the combine forward; two backward
    moe = {b: sum(s.is_moe(i) for i in spec.layers) for b, spec in enumerate(tm.specs)}
    for a in sched.actions[0]:
        if a.kind.is_compute:
            want = sum(moe[h.stage] * (3 if h.kind is Kind.F else 2 if h.kind in (Kind.B, Kind.BW) else 0) for h in a.halves())
            assert tm.exchanges(a) == want, a
    one = load_config(EXAMPLE, ["parallel.ep=1"])
    assert all(TimeModel(Setup.from_config(one), profile(s, MOE), build_schedule(one)).exchanges(a) == 0
               for a in build_schedule(one).actions[0] if a.kind.is_compute)


def test_recomputes_next_replay_runs_beside_the_backward_above_and_before_a_plain_layers_first_wait() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=1", "model.n_layers=3", "model.n_dense=1"])
    s = Shape.of(cfg.model)
    progs = Programs(s, 256, 512, ep=2)
    prof = profile(s, MOE, a2a=2.0)
    both = StageSpec((1, 2), ("recompute_moe", "recompute_moe"), False, False)
    ops = progs.backward(both, "B")
    first_attention = ops.index(next(op for op in ops if op[:3] == ("C", "attention", "B")))
    sent = 256 * s.top_k * (s.hidden + 1) * s.e  # each row with its router weight
    replay_2, replay_1 = ops.index(("I", ("d", 2), sent)), ops.index(("I", ("d", 1), sent))
    assert replay_2 < replay_1 < first_attention  # the lower layer replays before the upper's attention backward
    # the same ops as each layer replayed in turn, only moved, and less of the exchanges exposed
    in_turn = []
    for layer in (2, 1):
        replay, custom, rest = progs._layer_backward(layer, "recompute_moe", "B")
        in_turn += replay + custom + rest
    assert ops[0][1] == "output" and sorted(map(repr, ops[1:])) == sorted(map(repr, in_turn))
    paired, alone = run_ops([(0, op) for op in ops], prof, 2), run_ops([(0, op) for op in ops[:1] + in_turn], prof, 2)
    assert paired.compute == pytest.approx(alone.compute) and paired.exposed < alone.exposed
    # below a layer that is not recomputed, the replay goes before that layer's first wait
    mixed = progs.backward(StageSpec((1, 2), ("recompute_moe", "off"), False, False), "B")
    where = {op[:2]: i for i, op in enumerate(mixed) if op[0] in ("I", "A")}
    assert where[("I", ("c'", 2))] < where[("I", ("d", 1))] < where[("A", ("c", 1))] < where[("A", ("c'", 2))]


@pytest.mark.parametrize("name", ["1f1b", "dualpipev"])
def test_the_step_reports_the_lone_actions_exchanges_apart_from_the_pairs(name: str) -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=2", "parallel.ep=2", f"schedule.name={name}", "schedule.microbatches=4"])
    s = Shape.of(cfg.model)
    prof = profile(s, {**MOE, "dense": {"F": 1.0, "B": 1.0, "W": 0.5}, "embed": {"F": 0.1, "B": 0.1}, "head": {"F": 1.0, "B": 1.0, "W": 0.5}}, a2a=2.0)
    sched = build_schedule(cfg)
    model = TimeModel(Setup.from_config(cfg), prof, sched)
    got = model.predict()
    busiest = max(range(sched.n_ranks), key=lambda r: sum(model.action(a).exposed for a in sched.actions[r] if a.kind.is_compute))
    lone = [model.action(a) for a in sched.actions[busiest] if a.kind.is_compute and a.pair is None]
    assert got.a2a_edge_s == pytest.approx(sum(t.comm for t in lone))
    assert got.a2a_edge_exposed_s == pytest.approx(sum(t.exposed for t in lone))
    assert 0.0 < got.a2a_edge_hidden_frac < 1.0  # the shared expert and the W work hide some
    if name == "1f1b":  # every action is lone
        assert got.a2a_edge_s == pytest.approx(got.a2a_s) and got.a2a_steady_hidden_frac == 0.0
    else:
        assert 0.0 < got.a2a_edge_s < got.a2a_s and got.a2a_steady_hidden_frac > got.a2a_edge_hidden_frac


def test_zero_memorys_re_dispatch_goes_out_one_layer_ahead_at_the_waits_above() -> None:
    cfg = load_config(EXAMPLE, ["parallel.pp=1", "model.n_layers=4", "model.n_dense=1"])
    progs = Programs(Shape.of(cfg.model), 256, 512, ep=2)
    ops = progs.backward(StageSpec((1, 2, 3), ("level0", "level0", "level0"), False, False), "B")
    at = {op[:2]: i for i, op in enumerate(ops) if op[0] in ("I", "A")}
    # the top layer's at its own start; layer 2's once layer 3 sent its dispatch's gradients,
    # before layer 3 waits for them; layer 1's only once layer 2 did the same
    assert at[("I", ("r", 3))] < at[("I", ("c'", 3))]
    assert at[("I", ("d'", 3))] < at[("I", ("r", 2))] < at[("A", ("d'", 3))]
    assert at[("I", ("d'", 2))] < at[("I", ("r", 1))] < at[("A", ("d'", 2))]
    assert sum(op[:2] == ("I", ("r", 2)) for op in ops) == 1
