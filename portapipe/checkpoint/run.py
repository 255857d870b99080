"""One run per folder: run ids, the folder lock, and what a run starts from.

Before any rank starts, :func:`prepare_run` (in the launching process) decides, for a config:

- that ``log.dir`` and ``checkpoint.dir`` can be written, and locks the run folder for this run
  (``<log.dir>/.portapipe.lock`` holding the pid; a second run on it is refused naming that
  pid; a lock left by a process that died is taken over with a warning);
- what the run starts from: ``checkpoint.load`` (a new run from a given checkpoint, held for
  reading until the run ends, so a run pruning its folder passes over it), else with
  ``checkpoint.resume`` this folder's newest complete checkpoint (damaged newer ones are named
  and passed over), else nothing;
- the run id: the resumed run's, or a new one written to ``<log.dir>/run.json``. A new run in a
  folder holding another run's checkpoints is refused unless ``checkpoint.overwrite`` is set,
  which first moves that run's files to ``<log.dir>/previous/<run id>/``; leftovers of a run that
  never wrote a checkpoint are moved there with a note, so ``metrics.jsonl`` never mixes runs;
- that the checkpoint fits (same model, same global batch and seed) and the LR schedule.

Problems are ConfigErrors (one line each, exit 2); notes go to ``say`` (one line each). After a
fault, :func:`restart_plan` says what a restart of the same run starts from (``launch.max_restarts``).
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..config import Config, ConfigError
from ..data import identity
from ..data.batches import global_batch_size
from ..data.corpus import open_corpus
from . import files
from .folders import Locks, checkpoint_root, lock_folders

RUN_FILE = "run.json"
RUN_FILES = ("metrics.jsonl", "expert_loads.json", RUN_FILE)  # a run's own files in its log.dir


def new_run_id() -> str:
    return f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"


def say_stderr(line: str) -> None:
    print(f"portapipe: {line}", file=sys.stderr, flush=True)


@dataclass
class RunPlan:
    """What the ranks of a run need to know about it (plain data: it travels to every rank)."""

    run_id: str
    root: str  # checkpoint folder
    mode: str  # "new" | "resume" | "load"
    source: str | None = None  # the checkpoint started from
    step: int = 0  # its step
    lr_schedule_steps: int | None = None  # where the cosine ends; None: no decay
    lr_schedule: list[dict[str, Any]] | None = None  # the phases in force (train.lr_schedule's, or the checkpoint's); None: the default
    placement_fits: bool = False  # its expert placement applies to this balancer as it is
    restarts: int = 0  # the launcher's restarts of the run before this launch (launch.max_restarts)
    first: dict[str, Any] | None = None  # a restart's: what the run's first launch started from ({"mode", "source", "step"})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _owner(log_dir: Path) -> str | None:
    try:
        record = json.loads((log_dir / RUN_FILE).read_text())
        return str(record["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _move_aside(log_dir: Path, root: Path, owner: str | None, checkpoints: list[Path], say: Callable[[str], None], why: str) -> None:
    """Move another run's files out of the way into ``<log.dir>/previous/<run id>/``."""
    theirs = [log_dir / f for f in RUN_FILES if (log_dir / f).exists()]
    if not theirs and not checkpoints:
        return
    ids = {owner} | {m.get("run_id") for d in checkpoints if (m := files._manifest_or_none(d))}
    ids.discard(None)
    label = "-".join(sorted(ids)) if ids else f"unknown-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    aside = log_dir / "previous" / label
    n = 1
    while aside.exists():
        n += 1
        aside = log_dir / "previous" / f"{label}.{n}"
    aside.mkdir(parents=True)
    for f in theirs:
        shutil.move(str(f), str(aside / f.name))
    if checkpoints:
        (aside / "checkpoints").mkdir()
        for d in checkpoints:
            shutil.move(str(d), str(aside / "checkpoints" / d.name))
    say(f"{why}: moved {len(theirs)} file(s) and {len(checkpoints)} checkpoint folder(s) of run {label} to {aside}")


# --------------------------------------------------------------------- compatibility
def resume_problems(config: Config, manifest: dict[str, Any], path: Path, key: str) -> list[str]:
    """Why checkpoint ``path`` cannot start this config's run (empty when it can).

    Any layout, schedule, balancer and backend may resume any checkpoint; the model must be the
    same (its tensors are loaded by name) and so must the data stream: a step's batch is drawn
    from the seed, the sources and the global batch size, so changing any would change the data
    (the sources may change with ``data.allow_changed_sources``).
    """
    out = []
    if (line := _model_line(config, manifest.get("config", {}).get("model", {}), path, key)) is not None:
        out.append(line)
    data = manifest["trainer"].get("data", {})
    gb = global_batch_size(config)
    if data.get("global_batch") != gb:
        p, s, t = config.parallel, config.schedule, config.train
        out.append(
            f"train.micro_batch_size: the global batch is {gb} sequences (dp {p.dp} x ep {p.ep} x {s.microbatches} micro-batches x "
            f"{t.micro_batch_size}) but {path} was trained with {data.get('global_batch')}; keep {data.get('global_batch')} "
            "(adjust train.micro_batch_size or schedule.microbatches) so each step's data stays the same"
        )
    if data.get("seed") != config.train.seed:
        out.append(f"train.seed: {config.train.seed}, but {path} was trained with seed {data.get('seed')}; the data would change")
    change = data_change(config, data)
    if change is not None and not config.data.allow_changed_sources:
        out.append(f"{change}; {path}'s run would go on with other batches than it would have seen: restore its data, "
                   "or set data.allow_changed_sources: true")
    step = int(manifest["step"])
    if config.train.steps < step:
        out.append(
            f"train.steps: {config.train.steps} is below step {step} of {path}; set train.steps above {step} to continue it, "
            "or start afresh in another log.dir (or with checkpoint.overwrite: true)"
        )
    return out


def _model_line(config: Config, theirs: dict[str, Any], path: Path, key: str) -> str | None:
    """One line naming how the checkpoint's model differs from this config's (None when it does not).

    Another architecture is named alone (its other keys differ as a matter of course); a key the
    checkpoint's config lacks (added to the config since) counts as its default. ``dtype`` may
    differ: the checkpoint holds the master weights, read in whatever dtype this run keeps them.
    """
    fields = type(config.model).model_fields
    mine = config.to_dict()["model"]
    then = {k: theirs[k] if k in theirs else json.loads(json.dumps(fields[k].get_default(call_default_factory=True))) for k in mine}
    diff = [k for k in mine if then[k] != mine[k] and k != "dtype"]
    if "arch" in diff:
        diff = ["arch"]
    if not diff:
        return None
    shown = ", ".join(f"model.{k}: {mine[k]!r} (the checkpoint has {then[k]!r})" for k in diff)
    return f"{shown}; {path} was written for another model and {key} needs the same one"


def lr_line(config: Config, horizon: int | None, origin: str, step: int | None, phases: list[dict[str, Any]] | None = None) -> str:
    """The one line saying what the LR schedule is (after a resume from ``step``, or of a new run)."""
    from ..optim import lr_schedule

    t = config.train
    when = "LR schedule" if step is None else f"LR schedule after step {step}"
    if phases is not None:
        return f"{when}: {lr_schedule.describe(lr_schedule.resolve(phases, t.lr), t.lr)} ({origin})"
    warm = f"warm-up {t.warmup_steps} step{'s' * (t.warmup_steps != 1)} to {t.lr:g}, then" if t.warmup_steps else f"{t.lr:g} from the start,"
    if horizon is None:
        return f"{when}: {warm} constant, no decay ({origin})"
    line = f"{when}: {warm} cosine to {t.min_lr:g} at step {horizon} ({origin})"
    if horizon < t.steps:
        line += f"; steps {horizon + 1}..{t.steps} run at {t.min_lr:g}"
    return line


def _layout_line(config: Config, manifest: dict[str, Any], backend: str) -> str | None:
    have = manifest["layout"]
    p, s, b = config.parallel, config.schedule, config.balancer
    now = {"pp": p.pp, "ep": p.ep, "dp": p.dp, "schedule": s.name, "balancer": b.kind, "redundant": b.redundant if b.kind != "none" else 0,
           "backend": backend}
    then = {k: have.get(k) for k in now}
    if now == then:
        return None
    show = lambda d: ", ".join(f"{k} {d[k]}" for k in now)  # noqa: E731
    return f"resharding: the checkpoint was written with {show(then)}; this run has {show(now)}"


def moments_line(config: Config, manifest: dict[str, Any]) -> str | None:
    """The one line saying that AdamW's moments are converted on load: the checkpoint keeps them in
    another dtype than this run does (``train.moments_dtype``); None when both keep the same."""
    from ..optim.precision import moments_dtype

    then_cfg = manifest.get("config", {})
    model, train = then_cfg.get("model", {}), then_cfg.get("train", {})
    then = moments_dtype(model.get("dtype", "float32"), train.get("master_dtype", "auto"), train.get("moments_dtype", "auto"))
    t = config.train
    now = moments_dtype(config.model.dtype, t.master_dtype, t.moments_dtype)
    if then == now:
        return None
    return f"optimizer: the checkpoint keeps AdamW's moments in {then}; this run keeps them in {now} (train.moments_dtype): converted on load"


def placement_fits(config: Config, manifest: dict[str, Any]) -> bool:
    """Whether the checkpoint's expert placement is one for this run's balancer as it is."""
    have = manifest["layout"]
    b, p = config.balancer, config.parallel
    return b.kind != "none" and have.get("balancer") == b.kind and have.get("ep") == p.ep and have.get("redundant") == b.redundant


# ------------------------------------------------------------------------- the decision
def prepare_run(config: Config, backend_name: str, say: Callable[[str], None] = say_stderr) -> tuple[RunPlan, Locks]:
    """Check the folders, lock them, decide what the run starts from (see the module docstring).

    Raises ConfigError (folders unusable or busy, nothing usable to resume, a checkpoint that does
    not fit); the locks are then released. Call only in the one process that launches the ranks.
    """
    log_dir, root = Path(config.log.dir), checkpoint_root(config)
    locks = lock_folders(config, say)
    try:
        plan = _decide(config, backend_name, log_dir, root, say, locks)
    except BaseException:
        locks.release()
        raise
    return plan, locks


def _held_source(path: Path, say: Callable[[str], None]) -> tuple[files.Entry, files.ReadHold]:
    """``checkpoint.load``'s checkpoint, held for reading until the run ends: a run still pruning
    that folder passes over it (read under a shared lock on the checkpoint's folder, no copy).
    Removed between its check and the hold, it is looked for again."""
    for _ in range(3):
        try:
            source = files.resolve(path, warn=say)
        except files.CheckpointError as exc:
            raise ConfigError([f"checkpoint.load: {exc}"]) from None
        hold = files.hold_for_reading(source.path)
        if hold is not None:
            return source, hold
        say(f"checkpoint.load: {source.path} was removed while it was checked (its run pruned it); looking again")
    raise ConfigError([f"checkpoint.load: the checkpoints in {path} were removed as fast as they were checked (a run pruning them); load from a copy"])


def _decide(config: Config, backend_name: str, log_dir: Path, root: Path, say: Callable[[str], None], locks: Locks) -> RunPlan:
    ck = config.checkpoint
    owner = _owner(log_dir)
    checkpoints = [d for d in files.scan(root) if not d.name.startswith(".")]
    unfinished = [d for d in files.scan(root) if d.name.startswith(".")]
    newest = f" (newest {checkpoints[-1].name})" if checkpoints else ""
    way_out = f"use another log.dir, or checkpoint.overwrite: true to move them to {log_dir / 'previous'} first"
    source: files.Entry | None = None
    mode = "new"
    if ck.load is not None:
        source, hold = _held_source(Path(ck.load).expanduser(), say)
        locks.locks.append(hold)
        mode = "load"
        if source.path.resolve().is_relative_to(root.resolve()):
            raise ConfigError(
                [
                    f"checkpoint.load: {source.path} is one of this log.dir's own checkpoints; to continue its run leave "
                    "checkpoint.load unset (checkpoint.resume does it), or load it into another log.dir"
                ]
            )
        if checkpoints and not ck.overwrite:
            raise ConfigError(
                [
                    f"checkpoint.load starts a new run, but {root} holds {len(checkpoints)} checkpoint(s) of run "
                    f"{owner or 'another run'}{newest}; {way_out}"
                ]
            )
    elif ck.resume:
        try:
            source = files.newest_complete(root, run_id=owner, warn=say)
        except files.CheckpointFormatError as exc:
            raise ConfigError([f"checkpoint.resume: {exc}, or move it out of {root} to resume from the checkpoint before it"]) from None
        if source is not None:
            mode = "resume"
        elif checkpoints and not ck.overwrite:
            raise ConfigError(
                [f"checkpoint.resume: no complete checkpoint left in {root} (`portapipe checkpoints {root}` says why each is not); {way_out}"]
            )
    elif checkpoints and not ck.overwrite:
        raise ConfigError([f"checkpoint.resume: false, but {root} holds run {owner or '?'}'s checkpoints{newest}; {way_out}"])

    if source is not None:
        problems = resume_problems(config, source.manifest or {}, source.path, "checkpoint.load" if mode == "load" else "checkpoint.resume")
        if problems:
            raise ConfigError(problems)
    if mode == "resume":
        run_id = source.run_id  # type: ignore[union-attr]
        for d in unfinished:  # saves of this run that did not finish
            shutil.rmtree(d, ignore_errors=True)
        if owner is None:
            files.write_json(log_dir / RUN_FILE, {"run_id": run_id, "source": None})
    else:
        run_id = new_run_id()
        if checkpoints:
            _move_aside(log_dir, root, owner, checkpoints + unfinished, say, "checkpoint.overwrite")
        else:
            for d in unfinished:
                shutil.rmtree(d, ignore_errors=True)
            _move_aside(log_dir, root, owner, [], say, f"new run {run_id} in {log_dir}; the previous run there wrote no checkpoint")
        parent = None if source is None else {"run_id": source.run_id, "step": source.step, "path": str(source.path)}
        files.write_json(log_dir / RUN_FILE, {"run_id": run_id, "source": parent})

    asked = config.train.lr_schedule_steps
    phases = None  # written out with every lr filled in, so a checkpoint's phases mean the same under another train.lr
    if config.train.lr_schedule is not None:
        from ..optim import lr_schedule

        phases = [ph.to_dict() for ph in lr_schedule.resolve(config.train.lr_schedule, config.train.lr)]
    plan = RunPlan(run_id=run_id, root=str(root), mode=mode, lr_schedule_steps=asked, lr_schedule=phases)
    if source is None:
        if asked is not None and asked < config.train.steps:  # a horizon left behind when train.steps grew
            say(lr_line(config, asked, "train.lr_schedule_steps", None))
        return plan
    manifest = source.manifest or {}
    plan.source, plan.step = str(source.path), int(manifest["step"])
    plan.placement_fits = placement_fits(config, manifest)
    if phases is not None:
        origin = "train.lr_schedule"
    elif asked is not None:
        origin = "train.lr_schedule_steps"
    elif manifest["trainer"].get("lr_schedule") is not None:  # the checkpoint's phases
        plan.lr_schedule = manifest["trainer"]["lr_schedule"]
        origin = "kept from the checkpoint; train.lr_schedule or train.lr_schedule_steps changes it"
    else:  # the checkpoint's: None (no decay) or the horizon it was trained towards
        plan.lr_schedule_steps = manifest["trainer"].get("lr_schedule_steps")
        change = "changes it" if plan.lr_schedule_steps is not None else "sets a cosine decay"
        origin = f"kept from the checkpoint; train.lr_schedule_steps {change}"
    verb = f"resuming run {run_id} from" if mode == "resume" else f"new run {run_id} in {log_dir} from run {source.run_id}'s"
    note = f"{verb} {source.path} (step {plan.step} of {config.train.steps})"
    if plan.step >= config.train.steps:
        note += "; nothing left to train (raise train.steps to continue)"
    say(note)
    if (line := _layout_line(config, manifest, backend_name)) is not None:
        say(line)
    if (line := moments_line(config, manifest)) is not None:
        say(line)
    had_ema = manifest.get("config", {}).get("train", {}).get("ema_decay") is not None
    if config.train.ema_decay is not None and not had_ema:
        say(f"ema: the checkpoint holds no EMA of the weights (train.ema_decay was not set); it starts from the weights of step {plan.step}")
    elif config.train.ema_decay is None and had_ema:
        say("ema: the checkpoint holds an EMA of the weights that this run does not keep (train.ema_decay is not set); its checkpoints will hold none")
    if manifest["layout"].get("balancer", "none") != "none" and config.balancer.kind != "none" and not plan.placement_fits:
        say(
            "balancer: the checkpoint's expert placement was made for another balancer layout; experts load by id into "
            f"{config.balancer.kind}'s initial placement, the recorded loads carry over"
        )
    say(lr_line(config, plan.lr_schedule_steps, origin, plan.step, plan.lr_schedule))
    change = data_change(config, manifest["trainer"].get("data", {}))
    if change is not None:  # allowed, or it would have been refused above
        say(f"data: {change}; data.allow_changed_sources: true, so the batches from here differ from an uninterrupted run's")
    return plan


def restart_plan(config: Config, first: RunPlan, restarts: int, say: Callable[[str], None] = say_stderr) -> RunPlan:
    """What restart number ``restarts`` of the run ``first`` planned starts from, after a fault: the
    run's newest complete checkpoint (a damaged one named in a ``say`` line and passed over; the
    saves the fault cut short removed), else where ``first`` started (no checkpoint of the run yet).

    The run stays the same run: its id, folder and LR schedule are ``first``'s, whatever
    ``checkpoint.resume`` says; nothing else is said (the launcher says it restarts).
    """
    root = Path(first.root)
    for d in files.scan(root):
        if d.name.startswith(".") and d.name.endswith(f".{first.run_id}.tmp"):
            shutil.rmtree(d, ignore_errors=True)
    source = files.newest_complete(root, run_id=first.run_id, warn=say)
    if source is None:
        return replace(first, restarts=restarts)
    manifest = source.manifest or {}
    return replace(first, mode="resume", source=str(source.path), step=int(manifest["step"]), placement_fits=placement_fits(config, manifest),
                   restarts=restarts, first={"mode": first.mode, "source": first.source, "step": first.step})


def data_change(config: Config, then: dict[str, Any]) -> str | None:
    """How this config's sources differ from those a checkpoint's run trained on (None: the same,
    or a checkpoint that did not record them, or data that does not open, which the launch checks say)."""
    try:
        now = identity.record(open_corpus(config))
    except (ValueError, OSError):
        return None
    return identity.changes(then, now)


def plan_on_ranks(config: Config, backend: Any, rank: int, plan: dict[str, Any] | None) -> tuple[RunPlan, Locks]:
    """Every rank gets rank 0's plan (collective). Rank 0 prepares it when the launcher did not
    (under torchrun, or a rank function called directly): it then also holds the folder locks."""
    import torch.distributed as dist

    locks = Locks([])
    box: list[Any] = [None]
    if rank == 0:
        if plan is None:
            try:
                made, locks = prepare_run(config, backend.name)
                box = [("plan", made.to_dict())]
            except ConfigError as err:
                box = [("error", err.problems)]
        else:
            box = [("plan", plan)]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "error":
        raise ConfigError(value)
    return RunPlan(**value), locks
