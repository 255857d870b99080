"""One training setup as the rules and the models read it: layout, schedule, batch and memory
option, plus the config sections a plan does not change (model, balancer, train, backend).

The planner makes thousands of these; a full config is built only for the one it writes out.
Nothing here imports torch or the planner: config validation reads setups too. The model's
:class:`~portapipe.config.model_shape.Shape` (a leaf module below both this one and the planner) is
made here only for setups that carry a model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .model_shape import Shape

DUALPIPE_FAMILY = ("dualpipe", "dualpipev")


def declared_capabilities(backend: str) -> list[tuple[str, Any]]:
    """(name, capabilities) of ``backend``; for ``auto``, of every backend it could pick."""
    from ..backends.registry import backend_class, known_backends

    names = known_backends() if backend == "auto" else [backend]
    out = []
    for name in names:
        try:
            out.append((name, backend_class(name).capabilities))
        except Exception:  # an unknown name is the known-backend rule's line; a broken plug-in its own
            continue
    return out


def shape_of(model: Any, train: Any = None, backend: str = "auto") -> Shape:
    """The model's :class:`Shape` with what the rest of the config decides of its work: ``train.fp8``,
    the sequence-wise balance loss (``train.seq_aux_loss_weight``), and whether the backend's fused
    attention takes MLA's value width (``auto``: only where every backend it could pick does, the
    larger memory otherwise)."""
    caps = [c for _, c in declared_capabilities(backend)]
    fused = bool(caps) and all(c.fused_attention_unequal_heads for c in caps)
    return Shape.of(model, fp8=getattr(train, "fp8", "off") != "off", fused_unequal_heads=fused,
                    seq_aux=bool(getattr(train, "seq_aux_loss_weight", 0.0)))


def n_model_blocks(schedule: str, pp: int, chunks: int) -> int:
    """Model blocks (contiguous layer slices) the schedule cuts the model into."""
    if schedule == "interleaved":
        return pp * chunks
    if schedule == "dualpipev":
        return 2 * pp
    return pp


#: ``parallel.layers_per_stage``: None (even), a tuple of counts (one per model block), or
#: ``(("first", n), ("last", m))`` items (Megatron's first / last stage counts, the rest even)
Split = Any


def split_problem(n_layers: int, n_blocks: int, split: Split) -> str | None:
    """Why ``split`` cannot cut ``n_layers`` into ``n_blocks`` (one line naming the key), or None.
    The first block (it holds the embedding) and the last (the head) may hold no layer; a block
    between them with none would only pass activations on."""
    key = "parallel.layers_per_stage"
    if split is None:
        if n_layers < n_blocks:
            return f"model.n_layers = {n_layers} cannot be cut into {n_blocks} blocks of at least one layer"
        return None
    if isinstance(split, tuple) and split and isinstance(split[0], tuple):
        ends = dict(split)
        first, last = ends.get("first"), ends.get("last")
        fixed = (first or 0) + (last or 0)
        middle = n_blocks - (first is not None) - (last is not None)
        if n_blocks == 1 and first is not None and last is not None:
            return f"{key}: first and last name one stage twice (there is one model block); give a list of one entry"
        if fixed > n_layers or middle > n_layers - fixed or (middle == 0 and fixed != n_layers):
            rest = n_layers - fixed
            given = ", ".join(f"{k} {v}" for k, v in (("first", first), ("last", last)) if v is not None)
            return (f"{key}: {given} leave{'s' * (given.count(',') == 0)} {rest} of model.n_layers = {n_layers} layers for the other "
                    f"{middle} of {n_blocks} model blocks, which need at least one each" + (" and all of them" if middle == 0 else ""))
        return None
    if len(split) != n_blocks:
        return f"{key}: {list(split)} has {len(split)} entries; the schedule cuts the model into {n_blocks} model blocks, one entry each"
    if sum(split) != n_layers:
        return f"{key}: {list(split)} adds up to {sum(split)}, not model.n_layers = {n_layers}"
    empty = [b for b in range(1, n_blocks - 1) if split[b] == 0]
    if empty:
        return (f"{key}: {list(split)} leaves model block {empty[0]} without a layer; only the first (the embedding) and the "
                "last (the head) may hold none")
    if n_blocks == 1 and split[0] == 0:
        return f"{key}: {list(split)} leaves the model without a layer"
    return None


def stage_layers(n_layers: int, n_blocks: int, split: Split = None) -> tuple[int, ...]:
    """Layers of each model block: ``split`` (``parallel.layers_per_stage``) resolved, or near-equal
    contiguous slices. ValueError (:func:`split_problem`'s line) when it does not add up."""
    problem = split_problem(n_layers, n_blocks, split)
    if problem:
        raise ValueError(problem)
    if split is None:
        return tuple((b + 1) * n_layers // n_blocks - b * n_layers // n_blocks for b in range(n_blocks))
    if split and isinstance(split[0], tuple):
        ends = dict(split)
        first, last = ends.get("first"), ends.get("last")
        lo = 0 if first is None else 1
        hi = n_blocks if last is None else n_blocks - 1
        rest = stage_layers(n_layers - (first or 0) - (last or 0), hi - lo) if hi > lo else ()
        return ((first,) if first is not None else ()) + rest + ((last,) if last is not None else ())
    return tuple(split)


def layer_range(n_layers: int, n_blocks: int, block: int, split: Split = None) -> tuple[int, int]:
    """Layers ``[first, last)`` of ``block`` when ``n_layers`` are cut into ``n_blocks`` contiguous
    slices: near-equal, or as ``split`` says (:func:`stage_layers`)."""
    counts = stage_layers(n_layers, n_blocks, split)
    first = sum(counts[:block])
    return first, first + counts[block]


def paired_blocks(pair_forwards: bool, overlap: bool, ep: int, model: Any, n_blocks: int, split: Split = None) -> list[int]:
    """The blocks whose consecutive lone forwards run as F&F pairs (``schedule.pair_forwards``):
    those holding an MoE layer (the first ``model.n_dense`` layers are dense), whose exchanges
    a pair can hide, when there are exchanges (ep > 1) and pairs overlap (``schedule.overlap``)."""
    if not (pair_forwards and overlap) or ep <= 1 or model is None or split_problem(model.n_layers, n_blocks, split):
        return []
    ranges = [layer_range(model.n_layers, n_blocks, b, split) for b in range(n_blocks)]
    return [b for b, (lo, hi) in enumerate(ranges) if hi > max(lo, model.n_dense)]


#: the parts a ``memory.recompute`` list may hold, in the order its written form names them
RECOMPUTE_PARTS = ("norms", "moe")
#: the parts whose saved tensors ``memory.offload`` may send to the host (a layer's parts that keep
#: something of their own: the combine keeps only an index)
OFFLOAD_PARTS = ("attention", "dense", "shared", "experts")


def recompute_segment(recompute: str) -> str:
    """``memory.recompute`` without its norms: ``none``, ``moe`` or ``full``."""
    rest = [p for p in recompute.split("+") if p != "norms"]
    return rest[0] if rest else "none"


def recompute_norms(recompute: str) -> bool:
    return "norms" in recompute.split("+")


def recompute_value(segment: str, norms: bool) -> str:
    """``memory.recompute`` as a config writes it, from its segment and whether norms are recomputed."""
    if not norms:
        return segment
    return "norms" if segment == "none" else f"norms+{segment}"


@dataclass(frozen=True)
class Setup:
    pp: int
    ep: int
    dp: int
    schedule: str
    microbatches: int
    chunks: int = 2
    micro_batch_size: int = 4
    zero_memory: str = "off"
    zero_memory_layers: int | None = None
    recompute: str = "none"  # the segment (none, moe, full); the norms are recompute_norms
    recompute_layers: int | None = None
    recompute_norms: bool = False
    fp8_activations: bool = False  # memory.fp8_activations
    overlap: bool = True
    w_split: bool = True
    pair_forwards: bool = False
    world_size: int | None = None
    zero_stage: int = 0
    #: ``train.moments_dtype`` (a plan may choose bfloat16 where the user allows it: ``--allow moments_dtype``)
    moments_dtype: str = "auto"
    optimizer_offload: str = "off"  # train.optimizer_offload
    offload_fraction: float = 1.0  # train.optimizer_offload_fraction
    offload: tuple[str, ...] = ()  # memory.offload, in OFFLOAD_PARTS' order
    offload_layers: int | None = None  # memory.offload_layers
    layers_per_stage: Split = None  # see Split
    # sections a plan keeps as they are (compared by identity: shared by every candidate)
    model: Any = field(default=None, compare=False, repr=False)
    balancer: Any = field(default=None, compare=False, repr=False)
    train: Any = field(default=None, compare=False, repr=False)
    backend: str = field(default="auto", compare=False)
    backend_options: Any = field(default_factory=dict, compare=False, repr=False)
    shape: Any = field(default=None, compare=False, repr=False)  # the model's Shape, made once and shared

    def __post_init__(self) -> None:
        if self.shape is None and self.model is not None:
            object.__setattr__(self, "shape", shape_of(self.model, self.train, self.backend))

    @classmethod
    def from_config(cls, c: Any) -> Setup:
        p, s, mem = c.parallel, c.schedule, c.memory
        return cls(
            pp=p.pp, ep=p.ep, dp=p.dp, schedule=s.name, microbatches=s.microbatches, chunks=s.chunks,
            micro_batch_size=c.train.micro_batch_size, zero_memory=mem.zero_memory, zero_memory_layers=mem.zero_memory_layers,
            recompute=mem.segment, recompute_layers=mem.recompute_layers, recompute_norms=mem.norms, fp8_activations=mem.fp8_activations, overlap=s.overlap, w_split=s.w_split,
            pair_forwards=s.pair_forwards, world_size=p.world_size, zero_stage=c.train.zero_stage, moments_dtype=c.train.moments_dtype,
            optimizer_offload=c.train.optimizer_offload, offload_fraction=c.train.optimizer_offload_fraction,
            offload=tuple(mem.offload), offload_layers=mem.offload_layers, model=c.model, balancer=c.balancer, train=c.train, backend=c.backend,
            backend_options=c.backend_options, layers_per_stage=split_of(p.layers_per_stage),
        )

    @property
    def segment(self) -> str:
        """As ``MemoryConfig.segment`` (the memory policy reads either)."""
        return self.recompute

    @property
    def norms(self) -> bool:
        """As ``MemoryConfig.norms``."""
        return self.recompute_norms

    def replace(self, **changes: Any) -> Setup:
        if "model" in changes:
            changes["shape"] = None  # made again from the new model
        return dataclasses.replace(self, **changes)

    @property
    def devices(self) -> int:
        return self.pp * self.ep * self.dp

    @property
    def n_blocks(self) -> int:
        return n_model_blocks(self.schedule, self.pp, self.chunks)

    @property
    def paired_blocks(self) -> list[int]:
        """See :func:`paired_blocks`."""
        return paired_blocks(self.pair_forwards, self.overlap, self.ep, self.model, self.n_blocks, self.layers_per_stage)

    @property
    def split(self) -> tuple[int, ...]:
        """Layers of each model block (:func:`stage_layers`); ValueError when they do not add up."""
        return stage_layers(self.model.n_layers, self.n_blocks, self.layers_per_stage)

    @property
    def max_stage_layers(self) -> int:
        """Layers of the largest model block (the even split's when the split does not add up)."""
        bad = split_problem(self.model.n_layers, self.n_blocks, self.layers_per_stage)
        return -(-self.model.n_layers // self.n_blocks) if bad else max(self.split)

    @property
    def replicas(self) -> int:
        """Micro-batch streams per step: every dp x ep rank of a stage runs its own micro-batches
        (and so holds its own copy of the weights outside the experts)."""
        return self.dp * self.ep

    @property
    def global_batch(self) -> int:
        """Sequences per step."""
        return self.replicas * self.microbatches * self.micro_batch_size

    def memory_label(self) -> str:
        """The memory option in a few words: ``off``, ``level1``, ``recompute full x1 + level1``,
        ``recompute moe + zero1`` (the optimizer sharded: ``train.zero_stage``), ``+ bf16 moments``
        (``train.moments_dtype``), ``+ offload attention+experts`` (``memory.offload``), ``+ optimizer
        swap`` (``train.optimizer_offload``)."""
        parts = []
        if self.recompute_norms:
            parts.append("recompute norms")
        if self.recompute != "none":
            parts.append(f"recompute {self.recompute}" + (f" x{self.recompute_layers}" if self.recompute_layers else ""))
        if self.zero_memory != "off":
            parts.append(self.zero_memory + (f" x{self.zero_memory_layers}" if self.zero_memory_layers else ""))
        if self.fp8_activations:
            parts.append("fp8 activations")
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.moments_dtype == "bfloat16":
            parts.append("bf16 moments")
        if self.offload:
            parts.append("offload " + "+".join(self.offload) + (f" x{self.offload_layers}" if self.offload_layers else ""))
        if self.optimizer_offload != "off":
            parts.append("optimizer swap" + (f" {self.offload_fraction:g}" if self.offload_fraction != 1.0 else ""))
        return " + ".join(parts) or "off"

    def overrides(self) -> dict[str, Any]:
        """The config keys this setup sets, as dotted paths."""
        return {
            "parallel.pp": self.pp, "parallel.ep": self.ep, "parallel.dp": self.dp, "parallel.world_size": None,
            "schedule.name": self.schedule, "schedule.microbatches": self.microbatches, "schedule.chunks": self.chunks,
            "schedule.overlap": self.overlap, "schedule.w_split": self.w_split, "schedule.pair_forwards": self.pair_forwards,
            "train.micro_batch_size": self.micro_batch_size, "train.zero_stage": self.zero_stage, "train.moments_dtype": self.moments_dtype,
            "memory.zero_memory": self.zero_memory, "memory.zero_memory_layers": self.zero_memory_layers,
            "memory.recompute": recompute_value(self.recompute, self.recompute_norms), "memory.recompute_layers": self.recompute_layers,
            "memory.fp8_activations": self.fp8_activations,
            "memory.offload": list(self.offload), "memory.offload_layers": self.offload_layers,
            "train.optimizer_offload": self.optimizer_offload, "train.optimizer_offload_fraction": self.offload_fraction,
            "parallel.layers_per_stage": split_value(self.layers_per_stage),
        }


def split_of(value: Any) -> Split:
    """``parallel.layers_per_stage`` as a config holds it (a list, a mapping of first / last, or
    None) in the hashable form a Setup holds."""
    if value is None:
        return None
    if isinstance(value, dict):
        return tuple(sorted((k, int(v)) for k, v in value.items()))
    return tuple(int(v) for v in value)


def split_value(split: Split) -> Any:
    """A Setup's split as a config writes it (see :func:`split_of`)."""
    if split is None:
        return None
    if split and isinstance(split[0], tuple):
        return dict(split)
    return list(split)
