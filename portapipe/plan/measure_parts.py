"""Part timing for ``portapipe profile``: every part's forward, input-gradient backward and
weight-gradient pass timed through an observer on the tape
(:func:`portapipe.scheduling.overlap.observing`) and fitted as ``fixed + per_unit * units``;
each part's saved bytes counted by :class:`~portapipe.memory.accounting.SavedActivations`.
Compute is timed as the thread's processor time (:func:`~portapipe.plan.measure_clock.cpu`).
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import Config, MemoryConfig
from ..memory import accounting
from ..memory.policy import configure
from ..models.expert_parallel import ExpertParallel
from ..models.fp8_layers import enable_fp8
from ..models.moe import build_blocks
from ..models.objective import Objective
from ..scheduling.overlap import Tape, observing, run
from ..scheduling.wgrad import WeightGradQueue
from .measure_clock import cpu
from .profile import Linear

PART_NAMES = {
    "embed_part": "embed", "attention_part": "attention", "dense_part": "dense", "experts_part": "experts",
    "shared_part": "shared", "combine_part": "combine", "loss_part": "head", "mtp_input_part": "mtp", "mtp_output_part": "head",
}
MEMORY = {
    "off": {}, "level0": {"zero_memory": "level0"}, "level1": {"zero_memory": "level1"},
    "recompute_moe": {"recompute": "moe"}, "recompute_full": {"recompute": "full"},
}


def part_name(fn: Callable[..., Any]) -> str:
    """The model part a tape step runs ("other" for helpers such as recompute's captures)."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return PART_NAMES.get(getattr(fn, "__name__", ""), "other")


def part_units(name: str, args: tuple[Any, ...]) -> int:
    """Tokens a part call handles (routed rows for the experts)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "mtp" and len(tensors) > 1:  # the tokens it embeds (the hidden state may be longer)
        return int(tensors[1].numel())
    first = tensors[0] if tensors else None
    if first is None:
        return 0
    if name == "experts" or name == "embed":
        return int(first.shape[0]) if name == "experts" else int(first.numel())
    return int(first.numel() // first.shape[-1])


# ------------------------------------------------------------------------------ observers
class _Note:
    def __init__(self, timer: PartTimer, name: str, units: int) -> None:
        self.timer, self.name, self.units = timer, name, units

    @contextlib.contextmanager
    def backward(self, queue: WeightGradQueue | None) -> Iterator[None]:
        if isinstance(queue, TaggedQueue):
            queue.current = self
        t0 = cpu()
        yield
        self.timer.add(self.name, "B" if queue is not None else "BW", self.units, cpu() - t0)


class PartTimer:
    """Observer timing every part's forward and backward: ``samples[(part, phase)]`` holds
    ``(units, seconds)`` pairs of this round."""

    def __init__(self) -> None:
        self.samples: dict[tuple[str, str], list[tuple[int, float]]] = defaultdict(list)

    def add(self, name: str, phase: str, units: int, seconds: float) -> None:
        self.samples[(name, phase)].append((units, seconds))

    def total(self, phase: str) -> tuple[float, int]:
        """Seconds and calls of ``phase`` (F, or B for input-gradient backwards) seen so far."""
        got = [s for (_, ph), v in self.samples.items() if ph == phase for _, s in v]
        return sum(got), len(got)

    @contextlib.contextmanager
    def forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Iterator[_Note]:
        name = part_name(fn)
        note = _Note(self, name, part_units(name, args))
        t0 = cpu()
        yield note
        self.add(name, "F", note.units, cpu() - t0)


class TaggedQueue(WeightGradQueue):
    """A weight-gradient queue that knows which part queued each entry and times them per part."""

    def __init__(self) -> None:
        super().__init__()
        self.current: _Note | None = None
        self._tagged: list[tuple[_Note | None, Callable[[], None]]] = []

    def put(self, fn: Callable[[], None]) -> None:
        self._tagged.append((self.current, fn))

    def __len__(self) -> int:
        return len(self._tagged)

    def run(self) -> None:
        work, self._tagged = self._tagged, []
        spent: dict[int, tuple[_Note, float]] = {}
        with torch.no_grad():
            for note, fn in work:
                t0 = cpu()
                fn()
                if note is not None:
                    spent[id(note)] = (note, spent.get(id(note), (note, 0.0))[1] + cpu() - t0)
        for note, seconds in spent.values():
            note.timer.add(note.name, "W", note.units, seconds)


class PartBytes:
    """Observer attributing saved bytes to ``<part>#<call>`` regions, remembering each call's units."""

    def __init__(self) -> None:
        self.units: dict[str, tuple[str, int]] = {}

    @contextlib.contextmanager
    def forward(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Iterator[Any]:
        name = part_name(fn)
        label = f"{name}#{len(self.units)}"
        self.units[label] = (name, part_units(name, args))
        with accounting.region(layer=label):
            yield _NoBackward()


class _NoBackward:
    def backward(self, queue: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


# ------------------------------------------------------------------------------- helpers
def tokens(config: Config, mbs: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    m = config.model
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, m.vocab_size, (mbs, m.seq_len + 1), generator=g)
    return tok[:, :-1].contiguous(), tok[:, 1:].contiguous()


def block_for(config: Config, ep: ExpertParallel, option: str) -> Any:
    blocks = build_blocks(config.model, [0], 1, ep, config.train.seed, Objective.from_train(config.train))
    if config.train.fp8 != "off":  # the parts as training runs them: the recipe's GEMMs through the backend's FP8 matmul
        enable_fp8(blocks, ep.backend)
    configure(blocks, MemoryConfig(**MEMORY[option]))
    return blocks[0]


def fit(samples_by_size: list[list[tuple[int, float]]]) -> Linear:
    """A line through the medians of each size's samples."""
    points = []
    for samples in samples_by_size:
        if samples:
            points.append((statistics.median(u for u, _ in samples), statistics.median(v for _, v in samples)))
    return Linear.fit(points)


def time_parts(
    config: Config, ep: ExpertParallel, option: str, sizes: list[int], reps: int, warmup: int
) -> tuple[dict[str, dict[str, Linear]], dict[str, list[float]], Any]:
    """Per-part costs under ``option``; overhead samples of the forward and backward programs
    (processor time beyond the parts, part calls, exchanges issued); the block."""
    block = block_for(config, ep, option)
    per_size: dict[tuple[str, str], list[list[tuple[int, float]]]] = defaultdict(list)
    overhead: dict[str, list[tuple[float, int, int]]] = {"F": [], "B": []}

    def program(obs: PartTimer, phase: str, fn: Callable[[], Any]) -> Any:
        spent0, calls0 = obs.total(phase)
        issued0 = ep.stats.count
        t0 = cpu()
        out = fn()
        used = cpu() - t0  # waiting for an exchange takes no processor time
        spent, calls = obs.total(phase)
        if calls > calls0:
            overhead[phase].append((used - (spent - spent0), calls - calls0, ep.stats.count - issued0))
        return out

    for size_i, mbs in enumerate(sizes):
        timer = PartTimer()
        for rep in range(warmup + reps):
            keep = rep >= warmup
            obs = timer if keep else PartTimer()  # warm-up rounds are timed but not kept
            x, y = tokens(config, mbs, 7919 * size_i + rep + 17 * ep.rank)
            tape, queue = Tape(), TaggedQueue()
            with observing(obs):
                out = program(obs, "F", lambda: run(block.program(tape, x, y)))
                program(obs, "B", lambda: run(tape.backward(out, torch.ones_like(out), queue)))
            queue.run()
            if not keep:
                overhead["F"].pop()
                overhead["B"].pop()
            for p in block.parameters():
                p.grad = None
        for key, samples in timer.samples.items():
            while len(per_size[key]) < size_i:
                per_size[key].append([])
            per_size[key].append(samples)
    parts: dict[str, dict[str, Linear]] = defaultdict(dict)
    for (name, phase), lists in per_size.items():
        if name != "other" and phase in ("F", "B", "W"):
            parts[name][phase] = fit(lists)
    return dict(parts), overhead, block


def saved_bytes(config: Config, ep: ExpertParallel, option: str, sizes: list[int]) -> dict[str, Linear]:
    block = block_for(config, ep, option)
    samples: dict[str, list[list[tuple[int, float]]]] = defaultdict(lambda: [[] for _ in sizes])
    for size_i, mbs in enumerate(sizes):
        for rep in range(2):
            x, y = tokens(config, mbs, 104729 + 31 * size_i + rep + 17 * ep.rank)
            obs = PartBytes()
            tracker = accounting.SavedActivations(ignore=block.parameters())
            with tracker.track(), observing(obs):
                tape = Tape()
                out = run(block.program(tape, x, y))
            for (label, _mb), nbytes in tracker.live_by_region.items():
                if label in obs.units:
                    name, units = obs.units[label]
                    samples[name][size_i].append((units, float(nbytes)))
            run(tape.backward(out, torch.ones_like(out)))  # the EP peers take part in its exchanges
            for p in block.parameters():
                p.grad = None
    return {name: fit(lists) for name, lists in samples.items() if name != "other"}
