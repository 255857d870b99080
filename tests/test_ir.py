"""The schedule IR: compact text, JSON round trips, placement helpers."""

from __future__ import annotations

import dataclasses
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from portapipe.scheduling.ir import Action, Kind, Schedule, fb, parse_action
from portapipe.scheduling.schedules import build

ATOMS = [Kind.F, Kind.B, Kind.W, Kind.BW, Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B]
atoms = st.builds(Action, st.sampled_from(ATOMS), st.integers(0, 300), st.integers(0, 5000))


def test_actions_print_like_torch() -> None:
    assert str(Action(Kind.F, 0, 3)) == "0F3"
    assert str(Action(Kind.B, 1, 2)) == "1B2"
    assert str(Action(Kind.W, 1, 2)) == "1W2"
    assert str(Action(Kind.BW, 1, 2)) == "1BW2"
    assert str(fb(Action(Kind.F, 0, 3), Action(Kind.B, 3, 1))) == "(0F3;3B1)"
    assert str(Action(Kind.SEND_F, 0, 3)) == "0SEND_F3"


@settings(max_examples=60, deadline=None)
@given(atoms)
def test_parse_inverts_str(a: Action) -> None:
    assert parse_action(str(a)) == a
    assert hash(parse_action(str(a))) == hash(a)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 99), st.integers(0, 999), st.integers(0, 99), st.integers(0, 999), st.sampled_from([Kind.B, Kind.BW]))
def test_fb_round_trip(fs: int, fm: int, bs: int, bm: int, bk: Kind) -> None:
    a = fb(Action(Kind.F, fs, fm), Action(bk, bs, bm))
    assert parse_action(str(a)) == a
    assert a.halves() == (Action(Kind.F, fs, fm), Action(bk, bs, bm))


def test_an_f_and_f_pair_round_trips_and_is_not_an_f_and_b_pair() -> None:
    ff = parse_action("(2F0;1F1)")
    assert ff == fb(Action(Kind.F, 2, 0), Action(Kind.F, 1, 1)) and str(ff) == "(2F0;1F1)"
    assert not ff.fb_pair and parse_action("(2F0;1BW1)").fb_pair and not Action(Kind.F, 0, 0).fb_pair
    assert ff.ff_pair and not parse_action("(2F0;1BW1)").ff_pair and not Action(Kind.F, 0, 0).ff_pair


@pytest.mark.parametrize(
    "text,message",
    [("3X1", "cannot parse"), ("(0F1)", "expected '(xFy;xBy)'"), ("(0B1;1F0)", "FB pair is (F, B|BW|F)"), ("-1F0", "cannot parse")],
)
def test_bad_text_is_rejected(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_action(text)


def test_bad_actions_are_rejected() -> None:
    with pytest.raises(ValueError, match="stage >= 0"):
        Action(Kind.F, -1, 0)
    with pytest.raises(ValueError, match="needs pair"):
        Action(Kind.FB)
    with pytest.raises(ValueError, match="only FB actions carry a pair"):
        Action(Kind.F, 0, 0, pair=(Action(Kind.F, 0, 0), Action(Kind.B, 0, 0)))
    with pytest.raises(TypeError, match="must be a Kind"):
        Action("F", 0, 0)  # type: ignore[arg-type]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Action(Kind.F, 0, 0).stage = 1  # type: ignore[misc]


@pytest.mark.parametrize("name,pp,m", [("1f1b", 3, 5), ("zb1p", 4, 6), ("interleaved", 2, 4), ("dualpipe", 4, 8), ("dualpipev", 3, 6)])
def test_json_round_trip(name: str, pp: int, m: int) -> None:
    s = build(name, pp, m)
    back = Schedule.from_json(s.to_json())
    assert back == s
    assert back.format() == s.format()


def test_placement_helpers_dualpipe() -> None:
    s = build("dualpipe", 4, 8)
    # direction 0: stages 0..3 on ranks 0..3; direction 1: stages 4..7 on ranks 3..0
    assert s.stages_of(0) == [0, 7] and s.stages_of(3) == [3, 4]
    assert s.blocks_of(0) == [0, 3] and s.blocks_of(1) == [1, 2]
    assert s.prev_stage(4) is None and s.next_stage(4) == 5 and s.is_last(3) and s.is_first(0)
    assert s.microbatches_of(5) == [4, 5, 6, 7]
    assert s.params_per_rank == 2.0


def test_placement_helpers_dualpipev_and_interleaved() -> None:
    v = build("dualpipev", 3, 6)
    assert [v.stages_of(r) for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert v.is_last(5) and v.next_stage(2) == 3 and v.params_per_rank == 1.0
    i = build("interleaved", 2, 4, chunks=3)
    assert i.stages_of(1) == [1, 3, 5] and i.n_blocks == 6 and i.params_per_rank == 1.0
    with pytest.raises(KeyError, match="outside"):
        i.prev_stage(6)
