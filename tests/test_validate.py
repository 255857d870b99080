"""The validator fails hand-broken schedules, naming the fault."""

from __future__ import annotations

import copy

import pytest

from portapipe.scheduling.comms import lower_comms
from portapipe.scheduling.ir import Action, Kind, Schedule, fb
from portapipe.scheduling.schedules import dualpipe, dualpipev, one_f_one_b, zb1p
from portapipe.scheduling.validate import ScheduleError, problems, validate


def _edit(s: Schedule, rank: int, fn) -> Schedule:
    t = copy.deepcopy(s)
    t.actions[rank] = fn(list(t.actions[rank]))
    return t


def _only(s: Schedule, text: str) -> list[str]:
    found = problems(s)
    assert found, "the broken schedule passed validation"
    assert any(text in p for p in found), found
    return found


def test_valid_schedules_pass() -> None:
    for s in (one_f_one_b(3, 5), zb1p(3, 5), dualpipe(4, 8), dualpipev(3, 6)):
        assert problems(s) == []
        assert problems(lower_comms(s)) == []


def test_missing_w() -> None:
    s = _edit(zb1p(3, 4), 1, lambda acts: [a for a in acts if str(a) != "1W2"])
    _only(s, "1B2 has no weight-gradient pass 1W2")
    with pytest.raises(ScheduleError, match="1W2"):
        validate(s)


def test_missing_and_duplicated_forward() -> None:
    s = _edit(one_f_one_b(2, 3), 0, lambda acts: [a for a in acts if str(a) != "0F1"])
    _only(s, "0F1 runs 0 times, expected once")
    s = _edit(one_f_one_b(2, 3), 0, lambda acts: acts + [Action(Kind.F, 0, 2)])
    _only(s, "0F2 runs 2 times")


def test_b_and_bw_both_present() -> None:
    s = _edit(zb1p(2, 2), 0, lambda acts: acts + [Action(Kind.BW, 0, 1)])
    _only(s, "stage 0 micro-batch 1: backward as BW x1, B x1, W x1")


def test_swapped_dependency_on_one_rank() -> None:
    # the backward of a micro-batch placed before its own forward
    def swap(acts: list[Action]) -> list[Action]:
        i, j = acts.index(Action(Kind.F, 1, 2)), acts.index(Action(Kind.BW, 1, 2))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    _only(_edit(one_f_one_b(2, 4), 1, swap), "rank 1: 1BW2 at step")
    # W before its B
    def w_first(acts: list[Action]) -> list[Action]:
        i, j = acts.index(Action(Kind.B, 0, 1)), acts.index(Action(Kind.W, 0, 1))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    _only(_edit(zb1p(2, 3), 0, w_first), "0W1 at step")


def test_same_rank_stage_order_dualpipev() -> None:
    # on the turn rank of a V, the second chunk's forward needs the first chunk's forward
    s = dualpipev(2, 4)
    def early(acts: list[Action]) -> list[Action]:
        i, j = acts.index(Action(Kind.F, 1, 0)), acts.index(Action(Kind.F, 2, 0))
        acts[i], acts[j] = acts[j], acts[i]
        return acts

    _only(_edit(s, 1, early), "2F0 at step 0 runs before 1F0")


def test_dependent_fb_halves() -> None:
    s = _edit(one_f_one_b(1, 2), 0, lambda acts: [Action(Kind.F, 0, 0), fb(Action(Kind.F, 0, 1), Action(Kind.BW, 0, 1)), Action(Kind.BW, 0, 0)])
    _only(s, "a pair's halves must be independent")


def test_swapped_cross_rank_dependency_deadlocks() -> None:
    # rank 1 runs its second forward before the first backward, rank 0 the other way round:
    # each waits for the other
    s = one_f_one_b(2, 2)
    s.actions[0] = [Action(Kind.F, 0, 0), Action(Kind.BW, 0, 0), Action(Kind.F, 0, 1), Action(Kind.BW, 0, 1)]
    s.actions[1] = [Action(Kind.F, 1, 0), Action(Kind.F, 1, 1), Action(Kind.BW, 1, 0), Action(Kind.BW, 1, 1)]
    found = _only(s, "cannot finish")
    assert "(0BW0)" in found[0] and "(1F1)" in found[0]


def test_wrong_rank_and_wrong_pipeline() -> None:
    s = _edit(one_f_one_b(2, 2), 0, lambda acts: acts + [Action(Kind.F, 1, 0)])
    _only(s, "rank 0: 1F0 runs stage 1, which lives on rank 1")
    d = _edit(dualpipe(2, 4), 0, lambda acts: acts + [Action(Kind.F, 0, 3)])
    _only(d, "micro-batch 3 takes pipeline 1, stage 0 is in pipeline 0")


def test_send_without_receive() -> None:
    s = lower_comms(one_f_one_b(3, 4))
    s = _edit(s, 1, lambda acts: [a for a in acts if str(a) != "1RECV_F2"])
    _only(s, "rank 1: 1F2 at step")
    found = problems(s)
    assert any("needs 1RECV_F2, which is never posted" in p for p in found)


def test_missing_send_and_stray_comm() -> None:
    s = lower_comms(dualpipev(2, 4))
    t = _edit(s, 0, lambda acts: [a for a in acts if str(a) != "0SEND_F1"])
    _only(t, "no 0SEND_F1 follows it")
    # a comm action for an edge that stays on one rank (the turn of the V)
    u = _edit(s, 1, lambda acts: acts + [Action(Kind.SEND_F, 1, 0)])
    _only(u, "1SEND_F0 has no receiver")


def test_receive_after_consumer() -> None:
    s = lower_comms(one_f_one_b(2, 3))

    def late(acts: list[Action]) -> list[Action]:
        recv = Action(Kind.RECV_F, 1, 1)
        acts.remove(recv)
        return acts + [recv]

    _only(_edit(s, 1, late), "1RECV_F1 at rank 1 step")


def test_receives_out_of_send_order() -> None:
    s = lower_comms(one_f_one_b(2, 4))

    def reverse_recvs(acts: list[Action]) -> list[Action]:
        # every receive posted up front (all before their consumers) but in reverse order
        recvs = [a for a in acts if a.kind is Kind.RECV_F]
        return recvs[::-1] + [a for a in acts if a.kind is not Kind.RECV_F]

    _only(_edit(s, 1, reverse_recvs), "ranks 0->1: message 0 is sent as 0SEND_F0 but received as the match of 0SEND_F3")


def test_placement_errors() -> None:
    s = one_f_one_b(2, 2)
    s.pipelines = [[0]]
    _only(s, "must list every virtual stage 0..1 exactly once")
