"""Schedule intermediate representation: actions and per-rank action lists.

A schedule is data. Generators (schedules.py) produce it, the validator and simulator read
it, the executor runs it. Actions print compactly, torch.distributed.pipelining style:

    0F3        forward of virtual stage 0, micro-batch 3
    1B2        input-gradient backward (weights' part deferred to a W)
    1W2        weight-gradient backward
    1BW2       full backward (input and weight gradients together)
    (0F3;3B1)  forward of 0F3 overlapped with backward 3B1 on the same rank (F&B)
    (2F0;1F1)  two forwards of different micro-batches overlapped (F&F, ``pair_forwards``)
    0SEND_F3   communication actions added by :func:`lower_comms`

Stages are *virtual* stages: ``stage_rank[v]`` says which rank runs virtual stage ``v`` and
``stage_block[v]`` which block of the model (a contiguous slice of layers) it computes.
DualPipe has two pipelines (directions) over the same model blocks, so a block appears in
two virtual stages on two ranks; every other schedule has one pipeline.
"""

from __future__ import annotations

import gc
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector. Long schedules allocate hundreds of thousands of
    small acyclic objects (actions, tuples), which otherwise trigger repeated full
    collections that double the time to build, lower, validate and simulate them."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Kind(str, Enum):
    F = "F"
    B = "B"  # input-gradient backward
    W = "W"  # weight-gradient backward
    BW = "BW"  # full backward
    FB = "FB"  # overlapped forward and backward of two micro-batches
    SEND_F = "SEND_F"  # activation to the next stage
    RECV_F = "RECV_F"  # activation from the previous stage
    SEND_B = "SEND_B"  # gradient to the previous stage
    RECV_B = "RECV_B"  # gradient from the next stage

    # Hash as the value string (in C; Enum's own hash runs Python code). Consistent with
    # equality, since a str-valued member already equals its value.
    __hash__ = str.__hash__

    @property
    def is_comm(self) -> bool:
        return self._value_ in _COMM  # by value: str hashes are cached, Enum hashes are not

    @property
    def is_compute(self) -> bool:
        return self._value_ not in _COMM


_COMM = {"SEND_F", "RECV_F", "SEND_B", "RECV_B"}
_SECOND = (Kind.B, Kind.BW, Kind.F)  # what may run beside a pair's forward


@dataclass(frozen=True)
class Action:
    """One step of a rank: ``kind`` on virtual ``stage`` for micro-batch ``mb``.

    An ``FB`` action carries its two halves in ``pair`` (forward first); its own stage and mb
    are -1. The second half is ``B`` (input gradient, W later) or ``BW`` (full): an F&B pair;
    or ``F``, another micro-batch's forward: an F&F pair (``schedule.pair_forwards``). Either
    way the two programs run interleaved, switching at each exchange in flight.
    """

    kind: Kind
    stage: int = -1
    mb: int = -1
    pair: tuple[Action, Action] | None = None

    # Schedules hold hundreds of thousands of actions: a hand-written constructor (writing
    # the frozen fields straight into __dict__) and hash keep building and lookups cheap.
    def __init__(self, kind: Kind, stage: int = -1, mb: int = -1, pair: tuple[Action, Action] | None = None) -> None:
        d = self.__dict__
        d["kind"] = kind
        d["stage"] = stage
        d["mb"] = mb
        d["pair"] = pair
        if pair is None:
            if kind is not Kind.FB and kind.__class__ is Kind and stage >= 0 and mb >= 0:
                return
        elif kind is Kind.FB and len(pair) == 2 and pair[0].kind is Kind.F and pair[1].kind in _SECOND:
            return
        self.__post_init__()

    def __hash__(self) -> int:
        return hash((self.kind._value_, self.stage, self.mb, self.pair))

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise TypeError(f"Action kind must be a Kind, got {self.kind!r}")
        if self.kind is Kind.FB:
            if self.pair is None or len(self.pair) != 2:
                raise ValueError("an FB action needs pair=(forward, backward or forward)")
            f, b = self.pair
            if f.kind is not Kind.F or b.kind not in _SECOND:
                raise ValueError(f"an FB pair is (F, B|BW|F), got ({f.kind.value}, {b.kind.value})")
        elif self.pair is not None:
            raise ValueError(f"only FB actions carry a pair, not {self.kind.value}")
        elif self.stage < 0 or self.mb < 0:
            raise ValueError(f"{self.kind.value} needs stage >= 0 and mb >= 0, got stage={self.stage} mb={self.mb}")

    @property
    def fb_pair(self) -> bool:
        """An F&B pair (a forward beside another micro-batch's backward), not an F&F pair."""
        return self.pair is not None and self.pair[1].kind is not Kind.F

    @property
    def ff_pair(self) -> bool:
        """An F&F pair (two micro-batches' forwards, ``schedule.pair_forwards``)."""
        return self.pair is not None and self.pair[1].kind is Kind.F

    def halves(self) -> tuple[Action, ...]:
        """The compute actions inside: (self,) or the FB pair."""
        return self.pair if self.pair is not None else (self,)

    def __str__(self) -> str:
        if self.pair is not None:
            return f"({self.pair[0]};{self.pair[1]})"
        return f"{self.stage}{self.kind.value}{self.mb}"

    __repr__ = __str__

    def to_json(self) -> str:
        return str(self)


F, B, W, BW = Kind.F, Kind.B, Kind.W, Kind.BW

_ATOM = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|BW|F|B|W)(\d+)$")


def parse_action(text: str) -> Action:
    """Inverse of ``str(action)``."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        parts = text[1:-1].split(";")
        if len(parts) != 2:
            raise ValueError(f"cannot parse a pair {text!r}: expected '(xFy;xBy)' or '(xFy;xFz)'")
        return Action(Kind.FB, pair=(parse_action(parts[0]), parse_action(parts[1])))
    m = _ATOM.match(text)
    if not m:
        raise ValueError(f"cannot parse action {text!r}: expected e.g. '0F3', '1B2', '1W2', '1BW2', '(0F3;3B1)'")
    return Action(Kind(m.group(2)), int(m.group(1)), int(m.group(3)))


def fb(forward: Action, second: Action) -> Action:
    """A pair: ``forward`` beside ``second`` (a backward, or another micro-batch's forward)."""
    return Action(Kind.FB, pair=(forward, second))


@dataclass
class Schedule:
    """Per-rank ordered action lists plus the placement of virtual stages.

    ``pipelines[p]`` lists the virtual stages micro-batches of pipeline ``p`` pass through,
    first to last; ``mb_pipeline[m]`` says which pipeline micro-batch ``m`` takes.
    """

    name: str
    n_ranks: int
    n_microbatches: int
    stage_rank: list[int]
    stage_block: list[int]
    pipelines: list[list[int]]
    mb_pipeline: list[int]
    actions: list[list[Action]]
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------- placement
    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def n_blocks(self) -> int:
        return max(self.stage_block) + 1

    def stages_of(self, rank: int) -> list[int]:
        """Virtual stages placed on ``rank``, in increasing order."""
        return [v for v, r in enumerate(self.stage_rank) if r == rank]

    def blocks_of(self, rank: int) -> list[int]:
        """Distinct model blocks held by ``rank`` (DualPipe: two, each also held elsewhere)."""
        return sorted({self.stage_block[v] for v in self.stages_of(rank)})

    @property
    def params_per_rank(self) -> float:
        """Largest share of the model one rank holds, times the rank count (1F1B: 1, DualPipe: 2)."""
        share = max(len(self.blocks_of(r)) for r in range(self.n_ranks)) / self.n_blocks
        return share * self.n_ranks

    def links(self) -> tuple[list[int | None], list[int | None]]:
        """(prev, next): per virtual stage, the stage before and after it in its pipeline.

        Placement is fixed once built, so the table is computed once (a new ``pipelines``
        list object recomputes it) and prev/next are O(1) on long schedules."""
        cache = self.__dict__.get("_links")
        if cache is None or cache[0] is not self.pipelines:
            n = len(self.stage_rank)
            prev: list[int | None] = [None] * n
            nxt: list[int | None] = [None] * n
            for stages in self.pipelines:
                for i, v in enumerate(stages):
                    if 0 <= v < n:
                        prev[v] = stages[i - 1] if i > 0 else None
                        nxt[v] = stages[i + 1] if i + 1 < len(stages) else None
            cache = (self.pipelines, (prev, nxt))
            self.__dict__["_links"] = cache
        return cache[1]

    def _position(self, stage: int) -> tuple[int, int]:
        for p, stages in enumerate(self.pipelines):
            if stage in stages:
                return p, stages.index(stage)
        raise KeyError(f"virtual stage {stage} is in no pipeline")

    def prev_stage(self, stage: int) -> int | None:
        """The stage feeding ``stage`` its activations (None for a first stage)."""
        if not 0 <= stage < len(self.stage_rank):
            raise KeyError(f"virtual stage {stage} is outside 0..{len(self.stage_rank) - 1}")
        return self.links()[0][stage]

    def next_stage(self, stage: int) -> int | None:
        """The stage ``stage`` sends activations to (None for a last stage, which computes the loss)."""
        if not 0 <= stage < len(self.stage_rank):
            raise KeyError(f"virtual stage {stage} is outside 0..{len(self.stage_rank) - 1}")
        return self.links()[1][stage]

    def is_first(self, stage: int) -> bool:
        return self.prev_stage(stage) is None

    def is_last(self, stage: int) -> bool:
        return self.next_stage(stage) is None

    def microbatches_of(self, stage: int) -> list[int]:
        p, _ = self._position(stage)
        return [m for m, q in enumerate(self.mb_pipeline) if q == p]

    # ------------------------------------------------------------------ text
    def format(self) -> str:
        """One line per rank, actions separated by spaces."""
        width = len(str(self.n_ranks - 1))
        return "\n".join(f"rank {r:>{width}}: " + " ".join(map(str, a)) for r, a in enumerate(self.actions))

    def with_actions(self, actions: list[list[Action]], **meta: Any) -> Schedule:
        """The same placement with other per-rank lists (and ``meta`` entries added)."""
        return Schedule(
            name=self.name,
            n_ranks=self.n_ranks,
            n_microbatches=self.n_microbatches,
            stage_rank=list(self.stage_rank),
            stage_block=list(self.stage_block),
            pipelines=[list(p) for p in self.pipelines],
            mb_pipeline=list(self.mb_pipeline),
            actions=actions,
            meta={**self.meta, **meta},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "n_ranks": self.n_ranks,
            "n_microbatches": self.n_microbatches,
            "stage_rank": list(self.stage_rank),
            "stage_block": list(self.stage_block),
            "pipelines": [list(p) for p in self.pipelines],
            "mb_pipeline": list(self.mb_pipeline),
            "actions": [[str(a) for a in acts] for acts in self.actions],
            "meta": dict(self.meta),
        }

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        return cls(
            name=d["name"],
            n_ranks=int(d["n_ranks"]),
            n_microbatches=int(d["n_microbatches"]),
            stage_rank=[int(x) for x in d["stage_rank"]],
            stage_block=[int(x) for x in d["stage_block"]],
            pipelines=[[int(x) for x in p] for p in d["pipelines"]],
            mb_pipeline=[int(x) for x in d["mb_pipeline"]],
            actions=[[parse_action(a) for a in acts] for acts in d["actions"]],
            meta=dict(d.get("meta", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))
