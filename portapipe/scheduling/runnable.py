"""The schedule a rank runs: built by name or from a config, lowered, validated, and checked
against the rank's pipeline group and stages before any action runs.

:func:`build_schedule` refuses what cannot run with a :class:`~portapipe.config.ConfigError`
naming the key, so a bad configuration is reported before any rank starts.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..backends.base import ParallelGroups
from ..config import Config, ConfigError
from ..config.setup import paired_blocks, split_problem
from . import comms, schedules, validate
from .ir import Schedule
from .stage import Stage


def make_schedule(
    name: str, pp: int, microbatches: int, chunks: int = 2, w_split: bool = True, paired_blocks: Collection[int] = ()
) -> Schedule:
    """The lowered, validated schedule ``name`` on ``pp`` pipeline ranks; ValueError (one line per
    problem) if it cannot run. ``paired_blocks``: their consecutive lone forwards run as F&F pairs
    (:func:`~.schedules.pair_forwards`)."""
    try:
        schedule = schedules.build(name, pp, microbatches, chunks)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{name} with pp={pp}, microbatches={microbatches}: {exc}") from None
    if not w_split:
        schedule = schedules.without_w_split(schedule)
    if paired_blocks:
        schedule = schedules.pair_forwards(schedule, paired_blocks)
    schedule = comms.lower_comms(schedule)
    problems = [f"{name} (pp={pp}, microbatches={microbatches}): {line}" for line in validate.problems(schedule)]
    if schedule.n_ranks != pp:
        problems.append(f"{name} runs on {schedule.n_ranks} ranks, not pp = {pp}")
    if problems:
        raise ValueError("\n".join(problems))
    return schedule


def build_schedule(config: Config) -> Schedule:
    """The lowered schedule a config asks for; ConfigError (before any rank starts) if it cannot run."""
    s, p = config.schedule, config.parallel
    pairs = paired_blocks(s.pair_forwards, s.overlap, p.ep, config.model, config.n_blocks(), config.stage_split())
    try:
        schedule = make_schedule(s.name, p.pp, s.microbatches, s.chunks, s.w_split, pairs)
    except ValueError as exc:
        raise ConfigError([f"schedule: {line}" for line in str(exc).splitlines()]) from None
    problems = []
    n_blocks = config.n_blocks()
    if schedule.n_blocks != n_blocks:
        problems.append(f"schedule: {s.name} places {schedule.n_blocks} model blocks but the config expects {n_blocks}")
    problem = split_problem(config.model.n_layers, schedule.n_blocks, config.stage_split())
    if problem:
        problems.append(f"{problem} ({s.name} with pp={p.pp})")
    if problems:
        raise ConfigError(problems)
    return schedule


def placed(schedule: Schedule, groups: ParallelGroups) -> Schedule:
    """``schedule`` with its SEND/RECV actions (added unless present), checked against the pipeline group."""
    if not comms.has_comms(schedule):
        schedule = comms.lower_comms(schedule)
    if schedule.n_ranks != groups.pp:
        raise ValueError(f"schedule {schedule.name} has {schedule.n_ranks} ranks but the pipeline group has {groups.pp}")
    return schedule


def check_stages(s: Schedule, rank: int, stages: Mapping[int, Stage]) -> None:
    """The stages fit the schedule: exactly its blocks for this rank, the loss where it ends."""
    want = s.blocks_of(rank)
    if sorted(stages) != sorted(want):
        raise ValueError(f"schedule {s.name} places blocks {sorted(want)} on pipeline rank {rank}, but the stages given are {sorted(stages)}")
    for v in s.stages_of(rank):
        b = s.stage_block[v]
        if bool(stages[b].has_loss) != s.is_last(v):
            where = "ends a pipeline and must compute the loss (has_loss True)" if s.is_last(v) else "feeds the next stage (has_loss must be False)"
            raise ValueError(f"block {b} (stage {v} of {s.name}) {where}")
