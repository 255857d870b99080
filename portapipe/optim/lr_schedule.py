"""The learning-rate schedule: phases laid end to end (``train.lr_schedule``), or the default
warm-up and cosine (``train.warmup_steps``, ``lr``, ``min_lr``, ``lr_schedule_steps``).

A phase runs ``steps`` optimizer steps and ends at ``lr``; it starts where the one before it
ended (the first at ``train.lr``):

- ``warmup``: linear from 0, step i of n at ``lr x (i + 1) / n`` [lr: train.lr];
- ``constant``: ``lr`` throughout [lr: where the phase before ended];
- ``cosine``: a half cosine from the start to ``lr``, its first step at the start and its last
  at ``lr`` (the default's decay, as it always ran);
- ``linear``: linear from the start, step i of n at ``start + (lr - start) x (i + 1) / n``.

After the last phase the learning rate stays at its end. The default is the phases
``warmup(warmup_steps, lr)``, then with ``lr_schedule_steps`` N ``cosine(N - warmup_steps,
min_lr)`` (without it nothing more: ``lr`` for good), and gives the values it gave before the
phases existed, bit for bit.

Phases count optimizer steps. A schedule published in tokens maps to steps through the global
batch: one step trains ``dp x ep x schedule.microbatches x train.micro_batch_size x model.seq_len``
tokens, and a phase that ends after X tokens of the run ends at step ceil(X / tokens per step)
(the first step that starts at or past X).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("warmup", "constant", "cosine", "linear")


@dataclass(frozen=True)
class Phase:
    kind: str
    steps: int
    lr: float  # the value the phase ends at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def resolve(phases: Sequence[Any], start: float) -> tuple[Phase, ...]:
    """Phases as written (``train.lr_schedule``'s entries, or their dicts) with each ``lr`` filled
    in: a warm-up's to ``start`` (train.lr), a constant's to where the phase before ended."""
    out: list[Phase] = []
    level = start
    for p in phases:
        kind, steps, lr = (p["kind"], p["steps"], p.get("lr")) if isinstance(p, dict) else (p.kind, p.steps, p.lr)
        if lr is None:
            lr = start if kind == "warmup" else level
        out.append(Phase(kind, int(steps), float(lr)))
        level = float(lr)
    return tuple(out)


def default_phases(lr: float, min_lr: float, warmup_steps: int, horizon: int | None) -> tuple[Phase, ...]:
    """The default schedule: a warm-up, then ``lr`` for good or a cosine to ``min_lr`` at step ``horizon``."""
    out = [Phase("warmup", warmup_steps, lr)] if warmup_steps else []
    if horizon is not None:
        out.append(Phase("cosine", max(horizon - warmup_steps, 0), min_lr))  # 0 steps: min_lr from the horizon on
    return tuple(out)


def lr_at(step: int, phases: Sequence[Phase], start: float) -> float:
    """The learning rate of optimizer step ``step`` (0-based)."""
    first = 0
    level = start
    for p in phases:
        i = step - first
        if i < p.steps:
            if p.kind == "warmup":
                return p.lr * (i + 1) / p.steps
            if p.kind == "constant":
                return p.lr
            if p.kind == "linear":
                return level + (p.lr - level) * (i + 1) / p.steps
            if p.steps <= 1:
                return level
            return p.lr + 0.5 * (level - p.lr) * (1.0 + math.cos(math.pi * (i / (p.steps - 1))))
        first += p.steps
        level = p.lr
    return level


def phase_index(step: int, phases: Sequence[Phase]) -> int:
    """The phase optimizer step ``step`` (0-based) runs in; past the end, the last (its lr stays)."""
    first = 0
    for i, p in enumerate(phases):
        if step - first < p.steps:
            return i
        first += p.steps
    return len(phases) - 1


def peak(phases: Sequence[Phase], start: float) -> float:
    """The largest learning rate the schedule gives."""
    return max([start, *(p.lr for p in phases)])


def problems(phases: Sequence[Phase]) -> list[str]:
    """What makes written phases unusable, one line each naming ``train.lr_schedule[i]``."""
    out = []
    for i, p in enumerate(phases):
        if p.kind == "warmup" and p.lr <= 0:
            out.append(f"train.lr_schedule[{i}].lr: {p.lr:g}; a warm-up must end above 0")
    return out


def describe(phases: Sequence[Phase], start: float) -> str:
    """The schedule in words: ``warm-up 2000 steps to 0.00022, constant 0.00022 for 156946 steps, ...``."""
    if not phases:
        return f"{start:g} throughout"
    words = []
    for p in phases:
        n = f"{p.steps} step{'s' * (p.steps != 1)}"
        if p.kind == "warmup":
            words.append(f"warm-up {n} to {p.lr:g}")
        elif p.kind == "constant":
            words.append(f"constant {p.lr:g} for {n}")
        else:
            words.append(f"{p.kind} to {p.lr:g} over {n}")
    return ", ".join(words) + f", then {phases[-1].lr:g}"
