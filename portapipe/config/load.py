"""YAML -> validated, typed configuration: reading, overrides, and the checks across sections.

One section per concern, each field documented where it is declared. Every problem is
reported at once, one line each, naming the key path, the value and the rule:

    parallel.world_size: 6 != pp*ep*dp = 2*2*1 = 4

One typing rule holds for every key (:func:`kind_problem`): text is never a number or a boolean,
a number never a boolean, a boolean never a number; a key that takes one of several types says
in one line what it takes (:func:`accepts`).

Load with :func:`load_config`; apply command-line overrides (``--set a.b=value``) with
``overrides=[...]``. A :class:`ConfigError` carries the list of lines; the CLI prints them and
exits with code 2 before any rank starts.
"""


from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from .kinds import accepts, members
from .model_rules import objective_problems
from .schema import BalancerConfig, Config, DataConfig, LaunchConfig, ModelConfig, ScheduleConfig, TrainConfig
from .text import ConfigError, apply_overrides, read_yaml

def _cross_checks(c: Config) -> list[str]:
    """Every error rule of the compatibility table (portapipe.config.rules) the config breaks, and the
    rules that concern one run only (what a run starts from), which a planner never varies."""
    from .rules import violations  # imported when used: the rules read backend classes (torch)
    from .setup import Setup

    out = violations(Setup.from_config(c)) + _without_effect(c) + objective_problems(c.model, c.train) + _data_rules(c)
    from ..optim.precision import precision_problems

    out += precision_problems(c)
    if c.checkpoint.load is not None and not c.checkpoint.load.strip():
        out.append("checkpoint.load: empty; name a checkpoint folder (step_NNNNNNNN) or a folder of checkpoints")
    return out + _log_rules(c)


def _log_rules(c: Config) -> list[str]:
    """Steps to record that the run never reaches, ranks to profile it does not have."""
    out = []
    for key, choice in (("timeline", c.log.timeline), ("profiler", c.log.profiler)):
        late = [s for s in choice.steps if s > c.train.steps]
        if late:
            out.append(f"log.{key}.steps: {late} past train.steps = {c.train.steps}, never run; choose among steps 1..{c.train.steps}")
    p = c.log.profiler
    for key, value in (("ranks", p.ranks), ("memory", p.memory)):
        if not p.steps and value:
            out.append(f"log.profiler.{key}: {value} has no effect: log.profiler.steps chooses no step to profile; set it, or remove {key}")
    absent = [r for r in c.log.profiler.ranks or [] if r >= c.world_size]
    if absent:
        out.append(f"log.profiler.ranks: {absent} not among the run's {c.world_size} ranks (0..{c.world_size - 1})")
    return out


def _default(section: type[BaseModel], key: str) -> Any:
    return section.model_fields[key].default


def _without_effect(c: Config) -> list[str]:
    """Keys set to something other than their default where nothing reads them. A key at its
    default passes: a config written back (a checkpoint's, a plan's) holds every key."""
    out = []
    if c.schedule.name != "interleaved" and c.schedule.chunks != _default(ScheduleConfig, "chunks"):
        out.append(f"schedule.chunks: {c.schedule.chunks} has no effect: only schedule interleaved splits a rank's layers into chunks "
                   f"(schedule is {c.schedule.name}); remove it")
    if c.balancer.kind == "none" and c.balancer.redundant != _default(BalancerConfig, "redundant"):
        out.append(f"balancer.redundant: {c.balancer.redundant} has no effect: balancer.kind is none, so no expert is copied; "
                   "set balancer.kind eplb or lplb, or remove it")
    if c.model.mtp_layers == 0 and c.train.mtp_loss_weight != _default(TrainConfig, "mtp_loss_weight"):
        out.append(f"train.mtp_loss_weight: {c.train.mtp_loss_weight} has no effect: model.mtp_layers is 0 (no multi-token "
                   "prediction); set model.mtp_layers, or remove it")
    for key in ("loss_scale_growth_interval", "max_skipped_steps"):  # float16's loss scaling: one rule for its keys
        if c.model.dtype != "float16" and getattr(c.train, key) != _default(TrainConfig, key):
            out.append(f"train.{key}: {getattr(c.train, key)} has no effect: only a float16 model "
                       f"scales its loss (model.dtype is {c.model.dtype}); remove it")
    if c.train.lr_schedule is not None:
        for key in ("warmup_steps", "min_lr", "lr_schedule_steps"):
            if getattr(c.train, key) != _default(TrainConfig, key):
                out.append(f"train.{key}: {getattr(c.train, key)} has no effect: train.lr_schedule sets the schedule; "
                           "remove it (or express it as a phase)")
    for key in ("restart_window_s", "restart_backoff_s"):  # they shape restarts only
        if c.launch.max_restarts == 0 and getattr(c.launch, key) != _default(LaunchConfig, key):
            out.append(f"launch.{key}: {getattr(c.launch, key):g} has no effect: launch.max_restarts is 0 (a fault ends the run); "
                       "set launch.max_restarts, or remove it")
    if c.model.init_from is not None and c.model.init_std != _default(ModelConfig, "init_std"):
        out.append(f"model.init_std: {c.model.init_std} has no effect: every weight is read from model.init_from; remove it")
    return out


def _data_rules(c: Config) -> list[str]:
    """How the data keys combine (what the files hold is checked before launch, portapipe.data.checks)."""
    d, out = c.data, []
    if d.sources is not None and d.path is not None:
        out.append("data.sources: set beside data.path; give one of them (data.path is a blend of one source)")
    if d.sources is not None and not d.sources:
        out.append("data.sources: an empty list; give at least one {path, weight}, or data.path")
    if d.val_sources is not None and not d.val_sources:
        out.append("data.val_sources: an empty list; give at least one {path, weight}, or leave it out (data.val_fraction then holds out data)")
    if d.format == "bytes":
        for key in ("sources", "val_sources"):
            if getattr(d, key) is not None:
                out.append(f"data.{key}: data.format bytes reads one text (data.path); blends and validation sources are token data (data.format: tokens)")
        for key in ("document_mask", "mask_eos_loss"):
            if getattr(d, key):
                out.append(f"data.{key}: a text read as bytes is one document; it needs token data with document boundaries (data.format: tokens)")
    if d.sampling == "random" and d.sources is not None and len(d.sources) > 1:
        out.append(f"data.sampling: random draws windows from one source; data.sources has {len(d.sources)} (use sampling epochs for a blend)")
    if d.val_sources is not None and d.val_fraction != _default(DataConfig, "val_fraction"):
        out.append(f"data.val_fraction: {d.val_fraction} has no effect: data.val_sources is the validation data; remove it")
    if d.mask_eos_loss and c.model.mtp_layers and not d.document_mask:
        out.append(f"data.mask_eos_loss: with multi-token prediction (model.mtp_layers {c.model.mtp_layers}) it needs "
                   "data.document_mask: true (the targets it leaves out are tokens the prediction modules embed, which only rows "
                   "kept apart by the document mask may do without)")
    return out


def _key_of(loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """An error's location as the key path the user wrote, and that key's type. pydantic names the
    alternative it tried after a union-typed key (``balancer.min_gain.float``,
    ``balancer.min_gain.literal['auto']``, ``train.mtp_loss_weight.dict[int,float].a.[key]``): that
    part, and what follows it inside the value, is no key and is dropped."""
    section: Any = Config
    annotation: Any = None
    path: list[Any] = []
    rest = list(loc)
    while rest:
        part = rest.pop(0)
        path.append(part)
        fields = getattr(section, "model_fields", None)
        if fields is None or part not in fields:
            section = None
            continue
        annotation = fields[part].annotation
        section = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
        if section is None and len(members(annotation)) > 1 and rest and isinstance(rest[0], str):
            break  # the alternative's name, and what it found inside the value (a mapping's key): no key
    return tuple(path), annotation


def _pydantic_lines(err: ValidationError) -> list[str]:
    """One line per key: a union-typed key that no alternative took is one line saying what it takes."""
    lines = []
    seen: set[tuple[Any, ...]] = set()
    for e in err.errors():
        loc, annotation = _key_of(tuple(e["loc"]))
        path = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or "<root>"
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f"{value!r}: "
        if e["type"] == "extra_forbidden":
            line = f"{path}: unknown key"
        elif len(loc) < len(e["loc"]):  # an alternative of a union refused it: say what the key takes
            line = f"{path}: {shown}expected {accepts(annotation)}"
        else:
            line = f"{path}: {shown}{e['msg'].removeprefix('Value error, ')}"  # pydantic's prefix for a validator's ValueError
        if loc not in seen:  # a union's other alternatives: said once
            seen.add(loc)
            lines.append(line)
    return lines


def config_from_dict(raw: dict[str, Any]) -> Config:
    """Validate a raw dict; raise ConfigError with every problem found."""
    if not isinstance(raw, dict):
        raise ConfigError([f"<root>: expected a mapping of sections, got {type(raw).__name__}"])
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        problems = _pydantic_lines(err)
        # Report the cross-section mistakes too: check again with the bad keys at their defaults.
        pruned = copy.deepcopy(raw)
        bad = [_key_of(tuple(e["loc"]))[0] for e in err.errors()]
        for loc in bad:
            _drop_path(pruned, loc)
        try:
            rest = _cross_checks(Config.model_validate(pruned))
        except ValidationError:
            rest = []
        bad_paths = {".".join(map(str, loc)) for loc in bad}
        problems += [p for p in rest if p.split(":")[0] not in bad_paths]
        raise ConfigError(problems) from None
    problems = _cross_checks(cfg)
    if problems:
        raise ConfigError(problems)
    return cfg


def _drop_path(d: Any, loc: tuple[Any, ...]) -> None:
    for key in loc[:-1]:
        if not isinstance(d, dict) or key not in d:
            return
        d = d[key]
    if isinstance(d, dict):
        d.pop(loc[-1], None)


def load_config(source: str | Path | dict[str, Any] | None = None, overrides: list[str] | None = None) -> Config:
    """Read a YAML file (or take a dict), apply overrides, validate."""
    if source is None:
        raw: Any = {}
    elif isinstance(source, dict):
        raw = dict(source)
    else:
        raw = read_yaml(Path(source))
    if isinstance(raw, dict):
        raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw)
