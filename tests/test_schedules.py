"""Schedule generators: every generated schedule validates; arguments are checked; the
DualPipe family follows DeepSeek's phase structure."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portapipe.scheduling.comms import lower_comms
from portapipe.scheduling.ir import Kind, fb
from portapipe.scheduling.schedules import NAMES, build, dualpipe, dualpipev, interleaved, one_f_one_b, pair_forwards, without_w_split, zb1p
from portapipe.scheduling.validate import stalls, validate

MIN_MB = {"1f1b": lambda pp: pp, "zb1p": lambda pp: pp, "interleaved": lambda pp: pp, "dualpipe": lambda pp: 2 * pp, "dualpipev": lambda pp: 2 * pp}


@st.composite
def sizes(draw: st.DrawFn, name: str) -> tuple[int, int, int]:
    pp = draw(st.integers(2, 16))
    if name == "dualpipe" and pp % 2:
        pp -= 1
    m = draw(st.integers(MIN_MB[name](pp), max(64, MIN_MB[name](pp))))
    if name == "interleaved":
        m = max(pp, m - m % pp)
    if name == "dualpipe" and m % 2:
        m += 1
    chunks = draw(st.integers(2, 3))
    return pp, m, chunks


def _check_all_forms(name: str, pp: int, m: int, chunks: int) -> None:
    s = build(name, pp, m, chunks)
    assert (s.n_ranks, s.n_microbatches) == (pp, m)
    validate(s)  # lowers it and runs the lowered lists for the deadlock check
    validate(lower_comms(without_w_split(s)))  # the lowered form's comm rules, checked directly


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_every_generated_schedule_validates(name: str, data: st.DataObject) -> None:
    pp, m, chunks = data.draw(sizes(name))
    _check_all_forms(name, pp, m, chunks)


@pytest.mark.parametrize("name", NAMES)
def test_corners_validate(name: str) -> None:
    # the smallest sizes each schedule accepts, and 16 ranks with 64 micro-batches
    for pp in (2, 3, 16):
        if name == "dualpipe" and pp % 2:
            continue
        _check_all_forms(name, pp, MIN_MB[name](pp), 2)
    _check_all_forms(name, 16, 64, 3)


def test_single_rank_schedules() -> None:
    for s in (one_f_one_b(1, 3), zb1p(1, 2), dualpipev(1, 2), interleaved(1, 2, 2)):
        validate(lower_comms(s))
        assert all(not a.kind.is_comm for a in lower_comms(s).actions[0])


def test_one_f_one_b_lists() -> None:
    assert one_f_one_b(2, 3).format() == "rank 0: 0F0 0F1 0BW0 0F2 0BW1 0BW2\nrank 1: 1F0 1BW0 1F1 1BW1 1F2 1BW2"


def test_zb1p_holds_back_rank_many_weight_passes() -> None:
    s = zb1p(4, 8)
    assert " ".join(map(str, s.actions[3][:8])) == "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3"
    assert [str(a) for a in s.actions[3][-3:]] == ["3W5", "3W6", "3W7"]
    assert " ".join(map(str, s.actions[0][:7])) == "0F0 0F1 0F2 0F3 0B0 0W0 0F4"


def test_interleaved_steady_phase_is_fb_pairs() -> None:
    s = interleaved(4, 8, 2)
    for r, acts in enumerate(s.actions):
        pairs = [a for a in acts if a.kind is Kind.FB]
        assert pairs, f"rank {r} has no F&B pair"
        for a in pairs:
            f, b = a.pair  # type: ignore[misc]
            assert f.mb != b.mb  # independent halves
    # rank 0 warms up with Megatron's (pp-1-r)*2 + (v-1)*pp forwards plus one, so the last
    # rank can pair its forward with an earlier micro-batch's backward
    first_pair = next(i for i, a in enumerate(s.actions[0]) if a.kind is Kind.FB)
    assert first_pair == (4 - 1) * 2 + 4 + 1


def _kinds(acts: list) -> list[str]:
    out = []
    for a in acts:
        if a.kind is Kind.FB:
            out.append(f"({a.pair[0].kind.value};{a.pair[1].kind.value})")
        else:
            out.append(a.kind.value)
    return out


@pytest.mark.parametrize("ranks,m", [(2, 4), (3, 6), (4, 10), (4, 13)])
def test_dualpipev_phase_counts(ranks: int, m: int) -> None:
    s = dualpipev(ranks, m)
    for r, acts in enumerate(s.actions):
        c0, c1 = r, 2 * ranks - 1 - r
        warm = (ranks - r - 1) * 2
        assert [str(a) for a in acts[:warm]] == [f"{c0}F{i}" for i in range(warm)]
        # then r+1 alternating forwards of both chunks
        alt = acts[warm : warm + 2 * (r + 1)]
        assert [(a.kind, a.stage) for a in alt] == [(Kind.F, c0), (Kind.F, c1)] * (r + 1)
        pairs = [a for a in acts if a.kind is Kind.FB]
        steady = m - 2 * ranks + r + 1
        turn = r == ranks - 1  # at the turn of the V the first F0/B1 runs unpaired
        assert len(pairs) == 2 * steady + (ranks - r - 1) - int(turn)
        kinds = Counter(a.kind for a in acts)
        assert kinds[Kind.W] == kinds[Kind.B]
        assert acts[-1].kind is Kind.W


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (6, 14), (8, 20)])
def test_dualpipe_is_two_half_v_schedules(pp: int, m: int) -> None:
    """Rank r of DualPipe runs the same kind sequence as rank min(r, pp-1-r) of DualPipeV on
    pp/2 ranks with m/2 micro-batches (the halves of the bidirectional pipe are V schedules)."""
    d, v = dualpipe(pp, m), dualpipev(pp // 2, m // 2)
    for r in range(pp):
        assert _kinds(d.actions[r]) == _kinds(v.actions[min(r, pp - 1 - r)])
    # rank 0 feeds direction 0 (micro-batches 0..m/2-1), rank pp-1 direction 1
    assert d.actions[0][0].mb == 0 and d.actions[pp - 1][0].mb == m // 2


def test_without_w_split() -> None:
    s = without_w_split(dualpipev(3, 8))
    kinds = Counter(h.kind for acts in s.actions for a in acts for h in a.halves())
    assert kinds[Kind.W] == 0 and kinds[Kind.B] == 0 and kinds[Kind.BW] == 2 * 3 * 8
    assert s.meta["w_split"] is False
    lowered = lower_comms(dualpipev(3, 8))
    assert without_w_split(lowered).actions[0].count(lowered.actions[0][1]) == 1  # comm actions kept


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: dualpipe(3, 12), "even number of pipeline ranks"),
        (lambda: dualpipe(4, 7), "must be even; got 7"),
        (lambda: dualpipe(4, 6), "microbatches >= 2\\*pp, got microbatches=6 < 2\\*4=8"),
        (lambda: dualpipev(4, 7), "microbatches >= 2\\*pp, got microbatches=7 < 2\\*4=8"),
        (lambda: one_f_one_b(4, 3), "microbatches >= pp .*microbatches=3 < pp=4"),
        (lambda: zb1p(4, 2), "microbatches=2 < pp=4"),
        (lambda: interleaved(4, 6, 2), "multiple of pp; got microbatches=6, pp=4"),
        (lambda: interleaved(4, 8, 1), "chunks >= 2"),
        (lambda: one_f_one_b(0, 3), "pp must be >= 1, got 0"),
        (lambda: build("gpipe", 2, 4), "unknown schedule 'gpipe'; known: 1f1b"),
    ],
)
def test_impossible_arguments_are_rejected(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def _torch_bench():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "schedules_vs_torch.py"
    spec = importlib.util.spec_from_file_location("schedules_vs_torch", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 13), (6, 20)])
def test_dualpipev_equals_torch_and_1f1b_too(pp: int, m: int) -> None:
    """Our DualPipeV lists, derived from DeepSeek's phase description, are action for action
    torch.distributed.pipelining's ScheduleDualPipeV; 1F1B likewise (after torch's forward
    renumbering on the last rank, see the benchmark)."""
    bench = _torch_bench()
    for cls, ours in ((bench.T.ScheduleDualPipeV, dualpipev(pp, m)), (bench.T.Schedule1F1B, one_f_one_b(pp, m))):
        order, style, n_stages = bench.torch_order(cls, pp, m)
        theirs = bench.to_ir(cls.__name__, order, style, n_stages, pp, m)
        assert theirs.format() == ours.format()
        assert theirs.stage_rank == ours.stage_rank


# ------------------------------------------------------------------------ F&F pairs
def _halves(s) -> list[list[tuple[Kind, int, int]]]:
    return [[(h.kind, h.stage, h.mb) for a in acts for h in a.halves()] for acts in s.actions]


@pytest.mark.parametrize("name,pp,m", [("dualpipev", 2, 4), ("dualpipev", 4, 10), ("interleaved", 2, 6), ("1f1b", 4, 8), ("zb1p", 3, 6), ("dualpipe", 4, 8)])
def test_pair_forwards_pairs_independent_neighbours_keeps_every_rank_s_order_and_validates(name: str, pp: int, m: int) -> None:
    s = build(name, pp, m)
    paired = pair_forwards(s, range(s.n_blocks))
    assert _halves(paired) == _halves(s)  # nothing added, dropped or reordered
    validate(paired)  # lowers it; its deadlock check runs the lowered lists
    prev, _ = s.links()
    n_pairs = 0
    for acts in paired.actions:
        for a in acts:
            if a.pair is not None and a.pair[1].kind is Kind.F:
                first, second = a.pair
                n_pairs += 1
                assert first.kind is Kind.F and not (second.mb == first.mb and prev[second.stage] == first.stage)
    assert n_pairs > 0 and paired.meta["pair_forwards"] is True


def test_pair_forwards_leaves_blocks_without_exchanges_and_dependent_forwards_alone() -> None:
    s = dualpipev(2, 4)
    assert [str(a) for a in pair_forwards(s, [1, 2, 3]).actions[1][:3]] == ["1F0", "(2F0;1F1)", "(2F1;1F2)"]  # 2F0 takes 1F0's output
    assert pair_forwards(s, [1, 2]).actions[0] == s.actions[0]  # rank 0's blocks 0 and 3: not listed
    assert _halves(pair_forwards(s, [])) == _halves(s) and all(a.pair is None or a.fb_pair for acts in pair_forwards(s, []).actions for a in acts)
    with pytest.raises(ValueError, match="before its posts"):
        pair_forwards(lower_comms(s), [1])


def test_pair_forwards_refuses_the_pairs_that_would_close_a_cycle() -> None:
    """DualPipe on two ranks: rank 0's (0F0;3F2) waits for 2F2 of rank 1, whose pair (2F2;1F0)
    waits for 0F0, which leaves rank 0 only after its pair: pairing both would hang."""
    s = dualpipe(2, 4)
    naive = [list(acts) for acts in s.actions]
    naive[0][0:2] = [fb(naive[0][0], naive[0][1])]
    naive[1][0:2] = [fb(naive[1][0], naive[1][1])]
    assert [str(a) for a in (naive[0][0], naive[1][0])] == ["(0F0;3F2)", "(2F2;1F0)"]
    with pytest.raises(ValueError, match="cannot finish"):
        validate(s.with_actions(naive))
    assert stalls(s.with_actions(naive)) == [(0, 0), (1, 0)]
    paired = pair_forwards(s, [0, 1])
    validate(paired)
    assert stalls(paired) == [] and sum(a.pair is not None and not a.fb_pair for acts in paired.actions for a in acts) >= 2


def test_the_config_pairs_forwards_only_where_blocks_exchange() -> None:
    from pathlib import Path

    from portapipe.config import load_config
    from portapipe.scheduling.runnable import build_schedule

    example = Path(__file__).resolve().parents[1] / "examples" / "cpu.yaml"

    def ff(*overrides: str) -> int:
        s = build_schedule(load_config(example, ["schedule.name=dualpipev", *overrides]))
        return sum(a.pair is not None and not a.fb_pair for acts in s.actions for a in acts)

    assert ff() == 0 and ff("schedule.pair_forwards=true") == 2  # rank 1's (2F0;1F1) (2F1;1F2)
    assert ff("schedule.pair_forwards=true", "parallel.ep=1") == 0 and ff("schedule.pair_forwards=true", "schedule.overlap=false") == 0
