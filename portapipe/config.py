"""YAML -> validated, typed configuration.

One section per concern, each field documented where it is declared. Every problem is
reported at once, one line each, naming the key path, the value and the rule:

    parallel.world_size: 6 != pp*ep*dp = 2*2*1 = 4

Load with :func:`load_config`; apply command-line overrides (``--set a.b=value``) with
``overrides=[...]``. A :class:`ConfigError` carries the list of lines; the CLI prints them and
exits with code 2 before any rank starts.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

SCHEDULES = ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev")
DUALPIPE_FAMILY = ("dualpipe", "dualpipev")


class ConfigError(ValueError):
    """Invalid configuration; ``problems`` holds one human-readable line per mistake."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ParallelConfig(_Section):
    pp: int = Field(1, ge=1, description="pipeline ranks")
    ep: int = Field(1, ge=1, description="expert-parallel ranks (experts sharded over them)")
    dp: int = Field(1, ge=1, description="data-parallel replicas")
    world_size: int | None = Field(None, ge=1, description="total ranks; must equal pp*ep*dp (default: that product)")


class ScheduleConfig(_Section):
    name: Literal["1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"] = "dualpipev"
    microbatches: int = Field(4, ge=1, description="micro-batches per step")
    chunks: int = Field(2, ge=1, description="model chunks per rank for interleaved (VPP)")
    overlap: bool = Field(True, description="run F&B pairs overlapped (all-to-all behind compute)")
    w_split: bool = Field(True, description="split backward into input-grad (B) and weight-grad (W)")


class ModelConfig(_Section):
    vocab_size: int = Field(256, ge=2, description="byte-level by default")
    hidden: int = Field(64, ge=1)
    n_layers: int = Field(4, ge=1)
    n_dense: int = Field(1, ge=0, description="the first n_dense layers use a dense FFN")
    n_heads: int = Field(4, ge=1)
    ffn_hidden: int = Field(128, ge=1, description="dense FFN width")
    moe_hidden: int = Field(32, ge=1, description="width of one routed expert")
    n_experts: int = Field(8, ge=1, description="routed experts per MoE layer")
    n_shared: int = Field(1, ge=0, description="shared experts per MoE layer")
    top_k: int = Field(2, ge=1)
    n_groups: int = Field(1, ge=1, description="expert groups for group-limited routing")
    topk_groups: int = Field(1, ge=1, description="groups a token may route to")
    bias_update_speed: float = Field(1e-3, ge=0, description="aux-loss-free bias step per update")
    routed_scale: float = Field(1.0, gt=0)
    seq_len: int = Field(64, ge=2)
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    init_std: float = Field(0.02, gt=0)


class BalancerConfig(_Section):
    kind: Literal["none", "eplb", "lplb"] = "none"
    interval: int = Field(50, ge=1, description="eplb: rebalance every N steps")
    window: int = Field(10, ge=1, description="eplb: steps of recorded loads used")
    min_gain: float = Field(
        0.0, ge=0,
        description="adopt a rebalance only if mean balancedness (mean / max EP-rank load) gains at least "
        "min_gain x the fraction of expert slots whose rows it moves; i.e. the gain a full migration must win",
    )
    redundant: int = Field(0, ge=0, description="eplb: extra expert slots per EP rank")
    groups: int | None = Field(None, ge=1, description="eplb: expert groups (default: model.n_groups)")
    nodes: int = Field(1, ge=1, description="nodes the EP ranks span (consecutive ranks per node)")
    policy: Literal["incremental", "refined", "hierarchical", "global"] = Field(
        "incremental",
        description="eplb: incremental (first placement refined, then move few slots), refined, hierarchical, global",
    )
    max_moved: float = Field(0.1, gt=0, le=1, description="eplb incremental: at most this fraction of a layer's slots change per rebalance")
    topology: Literal["cube", "hypercube", "ring", "torus"] = "ring"
    torus: tuple[int, int] | None = Field(None, description="lplb: (m, n) for topology torus")


class MemoryConfig(_Section):
    zero_memory: Literal["off", "level0", "level1"] = "off"

    @field_validator("zero_memory", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as False.
        return "off" if v is False else v

    zero_memory_layers: int | None = Field(None, ge=1, description="MoE layers per stage using it (default all)")
    recompute: Literal["none", "moe", "full"] = "none"
    recompute_layers: int | None = Field(None, ge=1, description="layers per stage recomputed (default all)")


class TrainConfig(_Section):
    steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(4, ge=1, description="sequences per micro-batch per data-parallel rank")
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(3e-4, ge=0)
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0, description="0 disables clipping")
    seed: int = 1234


class DataConfig(_Section):
    path: str | None = Field(None, description="UTF-8 text file; default: the corpus shipped with portapipe")
    val_fraction: float = Field(0.05, ge=0, lt=1)


class LogConfig(_Section):
    dir: str = "runs/latest"
    every: int = Field(1, ge=1)
    progress: bool = True
    level: Literal["debug", "info", "warning", "error"] = "info"


class CheckpointConfig(_Section):
    dir: str | None = Field(None, description="default: <log.dir>/checkpoints")
    every: int = Field(0, ge=0, description="steps between checkpoints; 0 = only at the end")
    resume: bool = True
    keep: int = Field(2, ge=1)


class Config(_Section):
    backend: str = Field("auto", description="auto | cpu | cuda | npu | a plug-in name")
    backend_options: dict[str, Any] = Field(default_factory=dict)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    schedule: ScheduleConfig = Field(default_factory=ScheduleConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    balancer: BalancerConfig = Field(default_factory=BalancerConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.world_size if p.world_size is not None else p.pp * p.ep * p.dp

    def n_blocks(self) -> int:
        """Model blocks (contiguous layer slices) the schedule splits the model into."""
        return n_model_blocks(self.schedule.name, self.parallel.pp, self.schedule.chunks)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def n_model_blocks(schedule: str, pp: int, chunks: int) -> int:
    if schedule == "interleaved":
        return pp * chunks
    if schedule == "dualpipev":
        return 2 * pp
    return pp


# --------------------------------------------------------------------- checks across sections
def _cross_checks(c: Config) -> list[str]:
    out: list[str] = []
    p, s, m, mem, bal = c.parallel, c.schedule, c.model, c.memory, c.balancer
    prod = p.pp * p.ep * p.dp
    if p.world_size is not None and p.world_size != prod:
        out.append(f"parallel.world_size: {p.world_size} != pp*ep*dp = {p.pp}*{p.ep}*{p.dp} = {prod}")
    if s.name == "dualpipe" and p.pp % 2:
        out.append(f"parallel.pp: {p.pp} is odd; schedule dualpipe needs an even number of pipeline ranks")
    if s.name in DUALPIPE_FAMILY and s.microbatches < 2 * p.pp:
        out.append(f"schedule.microbatches: {s.microbatches} < 2*pp = {2 * p.pp}, the minimum for {s.name}")
    if s.name == "dualpipe" and s.microbatches % 2:
        out.append(f"schedule.microbatches: {s.microbatches} is odd; dualpipe feeds half from each end")
    if s.name == "interleaved":
        if s.chunks < 2:
            out.append(f"schedule.chunks: {s.chunks} < 2; interleaved needs at least 2 chunks per rank (use 1f1b for 1)")
        if s.microbatches % p.pp:
            out.append(f"schedule.microbatches: {s.microbatches} is not a multiple of pp = {p.pp}, as interleaved rounds need")
    elif s.name in ("1f1b", "zb1p") and s.microbatches < p.pp:
        out.append(f"schedule.microbatches: {s.microbatches} < pp = {p.pp}; {s.name} needs at least one micro-batch per stage")
    if p.pp == 1 and s.name in DUALPIPE_FAMILY and s.name == "dualpipe":
        out.append("parallel.pp: 1; dualpipe needs at least 2 pipeline ranks")
    blocks = c.n_blocks()
    if m.n_layers < blocks:
        out.append(f"model.n_layers: {m.n_layers} < {blocks} model blocks that schedule {s.name} with pp={p.pp} needs (one layer each at least)")
    if m.n_experts % p.ep:
        out.append(f"model.n_experts: {m.n_experts} is not divisible by parallel.ep = {p.ep}")
    if m.top_k > m.n_experts:
        out.append(f"model.top_k: {m.top_k} > model.n_experts = {m.n_experts}")
    if m.n_dense > m.n_layers:
        out.append(f"model.n_dense: {m.n_dense} > model.n_layers = {m.n_layers}")
    if m.hidden % m.n_heads:
        out.append(f"model.hidden: {m.hidden} is not divisible by model.n_heads = {m.n_heads}")
    if m.n_experts % m.n_groups:
        out.append(f"model.n_groups: {m.n_groups} does not divide model.n_experts = {m.n_experts}")
    if m.topk_groups > m.n_groups:
        out.append(f"model.topk_groups: {m.topk_groups} > model.n_groups = {m.n_groups}")
    elif m.top_k <= m.n_experts and m.top_k > m.topk_groups * (m.n_experts // max(m.n_groups, 1)):
        out.append(
            f"model.top_k: {m.top_k} > experts reachable in topk_groups = {m.topk_groups} groups of {m.n_experts // max(m.n_groups, 1)}"
        )
    n_moe = m.n_layers - m.n_dense
    layers_per_stage = -(-m.n_layers // blocks)
    if mem.zero_memory != "off" and n_moe <= 0:
        out.append(f"memory.zero_memory: {mem.zero_memory} but the model has no MoE layers (n_layers == n_dense)")
    if mem.recompute == "moe" and n_moe <= 0:
        out.append("memory.recompute: moe but the model has no MoE layers (n_layers == n_dense)")
    if mem.recompute_layers is not None and mem.recompute_layers > layers_per_stage:
        out.append(f"memory.recompute_layers: {mem.recompute_layers} > {layers_per_stage} layers in the largest stage")
    if mem.zero_memory_layers is not None and mem.zero_memory_layers > layers_per_stage:
        out.append(f"memory.zero_memory_layers: {mem.zero_memory_layers} > {layers_per_stage} layers in the largest stage")
    if mem.zero_memory_layers is not None and mem.zero_memory == "off":
        out.append(f"memory.zero_memory_layers: {mem.zero_memory_layers} is set but memory.zero_memory is off (set level0 or level1)")
    if mem.recompute_layers is not None and mem.recompute == "none":
        out.append(f"memory.recompute_layers: {mem.recompute_layers} is set but memory.recompute is none (set moe or full)")
    if n_moe > 0 and mem.zero_memory != "off" and mem.recompute != "none" and (mem.recompute_layers or layers_per_stage) >= layers_per_stage:
        # Zero-memory applies to MoE layers that are not recomputed (a recomputed layer keeps nothing).
        out.append(
            f"memory.zero_memory: {mem.zero_memory} has no effect: memory.recompute: {mem.recompute} recomputes every layer of each stage; "
            f"set memory.recompute_layers below {layers_per_stage} or memory.zero_memory: off"
        )
    if bal.kind != "none" and n_moe <= 0:
        out.append(f"balancer.kind: {bal.kind} but the model has no MoE layers")
    if bal.kind == "lplb" and bal.topology == "torus" and bal.torus is None:
        out.append("balancer.torus: missing; topology torus needs torus: [m, n]")
    out += _balancer_checks(c)
    if c.train.min_lr > c.train.lr:
        out.append(f"train.min_lr: {c.train.min_lr} > train.lr = {c.train.lr}")
    from .backends.registry import known_backends  # built-ins and plug-ins; imports no device code

    if c.backend != "auto" and c.backend not in known_backends():
        out.append(f"backend: {c.backend!r} is not a known backend; known: auto, {', '.join(known_backends())}")
    transport = c.backend_options.get("ep_transport", "alltoall")
    if transport not in ("alltoall", "nvshmem"):
        out.append(f"backend_options.ep_transport: {transport!r} is not one of alltoall, nvshmem")
    return out


def _balancer_checks(c: Config) -> list[str]:
    """The balancer's slots must fit the EP group (see portapipe.balancing.runtime)."""
    out: list[str] = []
    bal, p, m = c.balancer, c.parallel, c.model
    if bal.kind == "lplb":
        torus = bal.torus or (0, 0)
        size = {"cube": 8, "hypercube": 16, "ring": p.ep, "torus": torus[0] * torus[1]}[bal.topology]
        classes = 1 if bal.topology == "ring" else 2
        if p.ep < 2:
            out.append(f"parallel.ep: {p.ep}; balancer.kind lplb moves tokens between EP ranks and needs ep >= 2")
        elif size and p.ep % size:
            out.append(f"balancer.topology: {bal.topology} groups {size} ranks, which does not divide parallel.ep = {p.ep}")
        if bal.topology == "torus" and bal.torus is not None and min(bal.torus) < 2:
            out.append(f"balancer.torus: {list(bal.torus)}; both sides of the torus need at least 2 ranks")
        if bal.redundant < classes or bal.redundant % classes:
            out.append(
                f"balancer.redundant: {bal.redundant}; lplb with topology {bal.topology} needs a positive multiple of "
                f"{classes} redundant slots per EP rank (each copies another rank's expert)"
            )
        elif p.ep and bal.redundant > m.n_experts // p.ep:
            out.append(
                f"balancer.redundant: {bal.redundant} > model.n_experts / parallel.ep = {m.n_experts // p.ep}; "
                "lplb copies each of a rank's experts at most once"
            )
    if bal.kind != "none" and p.ep % bal.nodes:
        out.append(f"balancer.nodes: {bal.nodes} does not divide parallel.ep = {p.ep}")
    if bal.kind == "eplb":
        # one rule, whatever the policy and node count (as `portapipe balance`): groups divide the
        # experts, nodes divide the EP ranks; hierarchical becomes global when groups % nodes != 0
        groups = bal.groups or m.n_groups
        if m.n_experts % groups:
            out.append(f"balancer.groups: {groups} does not divide model.n_experts = {m.n_experts}")
        per_rank = m.n_experts // p.ep + bal.redundant if p.ep else 0
        if bal.policy in ("incremental", "refined") and per_rank > m.n_experts:
            out.append(
                f"balancer.redundant: {bal.redundant} gives {per_rank} slots per EP rank for {m.n_experts} experts; policy "
                f"{bal.policy} holds each expert at most once per rank, so redundant <= {m.n_experts - m.n_experts // p.ep}"
            )
    return out


def _pydantic_lines(err: ValidationError) -> list[str]:
    lines = []
    for e in err.errors():
        path = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown key")
        else:
            value = e.get("input")
            shown = "" if isinstance(value, dict) else f"{value!r}: "
            lines.append(f"{path}: {shown}{e['msg']}")
    return lines


def _set_path(d: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError([f"{dotted}: cannot set inside {k!r}, which is not a section"])
        cur = nxt
    cur[keys[-1]] = value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` strings (value parsed as YAML) to a raw config dict."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {item!r}: expected KEY.PATH=VALUE"])
        _set_path(raw, key.strip(), yaml.safe_load(text) if text.strip() else None)
    return raw


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
        bad = [e["loc"] for e in err.errors()]
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
        path = Path(source)
        if not path.is_file():
            raise ConfigError([f"<file>: {str(path)!r} does not exist"])
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError([f"<file>: {path} is not valid YAML: {exc}"]) from None
    if isinstance(raw, dict):
        raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw)
