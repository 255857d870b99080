"""Move expert tensors between ranks from one :class:`~.placement.ExpertPlacement` to another.

:func:`migrate` turns one layer's expert tensors (anything shaped ``[local_slots, ...]``: weights,
their gradients, optimizer moments) from an old placement into a new one through the backend's
``all_to_all_single``. It moves only what changes slot: a slot that keeps its expert keeps its
rows, an expert already on the rank is copied locally, and each missing expert crosses the
network once per rank that needs it. It is failure-safe: the new tensors are built in fresh
buffers and handed back only after every rank reports success through an all-reduce; if any rank
fails, every rank raises :class:`MigrationError` and the old tensors are untouched everywhere.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .placement import ExpertPlacement


class MigrationError(RuntimeError):
    """A migration did not happen; every rank raises it and keeps its old tensors."""

    def __init__(self, message: str, failed_ranks: list[int]) -> None:
        super().__init__(message)
        self.failed_ranks = failed_ranks


# ------------------------------------------------------------------------------ migration plan
@dataclass
class MigrationPlan:
    """One layer's moves, identical on every rank (a pure function of the two placements).

    ``source[r]``: for each local slot of rank r, where its new rows come from: ``(kind, a)`` with
    kind "keep" (own old slot a == the same slot), "copy" (own old local slot a) or "recv" (row a
    of what r receives). ``sends[(src, dst)]``: the old local slots of ``src`` sent to ``dst``, in
    order; the receiver numbers received rows by source rank, then that order. Ranks are grouped
    into ``num_nodes`` nodes of consecutive ranks; a rank fetches from its own node when it can.
    """

    num_ranks: int
    slots_per_rank: int
    source: list[list[tuple[str, int]]]
    sends: dict[tuple[int, int], list[int]]
    num_nodes: int = 1

    def send_counts(self, rank: int) -> list[int]:
        return [len(self.sends.get((rank, d), [])) for d in range(self.num_ranks)]

    def recv_counts(self, rank: int) -> list[int]:
        return [len(self.sends.get((s, rank), [])) for s in range(self.num_ranks)]

    @property
    def rows_moved(self) -> int:
        """Slot rows crossing between ranks (each needed expert once per receiving rank)."""
        return sum(len(v) for v in self.sends.values())

    @property
    def rows_inter_node(self) -> int:
        """Of :attr:`rows_moved`, the rows crossing between nodes."""
        per = self.num_ranks // self.num_nodes
        return sum(len(v) for (src, dst), v in self.sends.items() if src // per != dst // per)

    @property
    def rows_copied(self) -> int:
        return sum(kind == "copy" for src in self.source for kind, _ in src)

    @property
    def rows_kept(self) -> int:
        return sum(kind == "keep" for src in self.source for kind, _ in src)


def plan_migration(
    old: ExpertPlacement, new: ExpertPlacement, layer: int = 0, num_nodes: int = 1, stale: frozenset[int] = frozenset()
) -> MigrationPlan:
    """Which rows each rank keeps, copies locally, sends and receives to go from ``old`` to ``new``.

    An expert a rank lacks comes from a rank of the same node when one holds it (ranks are
    numbered node-major, ``num_ranks / num_nodes`` per node), else from any holder; the sending is
    spread over the candidates. :func:`portapipe.balancing.cost.migration_cost` counts the same rows.
    ``stale``: slots of ``old`` (global indices) whose rows are out of date (a replica that took no
    tokens and skipped its gradient sum): they hold nothing, so they are refilled from a current
    copy and never serve as one.
    """
    if (old.num_ranks, old.num_slots, old.num_experts) != (new.num_ranks, new.num_slots, new.num_experts):
        raise ValueError(
            "placements differ in shape: old has "
            f"{old.num_ranks} ranks, {old.num_slots} slots, {old.num_experts} experts; new has "
            f"{new.num_ranks} ranks, {new.num_slots} slots, {new.num_experts} experts"
        )
    if not (0 <= layer < min(old.num_layers, new.num_layers)):
        raise ValueError(f"layer {layer} is outside the placements' {min(old.num_layers, new.num_layers)} layers")
    ranks, per = old.num_ranks, old.slots_per_rank
    if num_nodes < 1 or ranks % num_nodes:
        raise ValueError(f"{ranks} ranks do not split evenly over {num_nodes} nodes")
    per_node = ranks // num_nodes
    before, after = old.phy2log[layer].tolist(), new.phy2log[layer].tolist()
    for s in stale:
        before[s] = -1
    # where each expert sits in the old placement: {expert: {rank: first local slot}}
    holders: dict[int, dict[int, int]] = {}
    for s, e in enumerate(before):
        if e >= 0:
            holders.setdefault(e, {}).setdefault(s // per, s % per)
    sends: dict[tuple[int, int], list[int]] = {}
    sent_by = [0] * ranks  # spread the sending over the ranks that hold a copy
    source: list[list[tuple[str, int]]] = []
    for r in range(ranks):
        fetched: dict[int, int] = {}  # expert -> index among r's received rows, before renumbering
        wanted: list[tuple[int, int]] = []  # (src rank, expert) in the order first needed
        entries: list[tuple[str, int]] = []
        for j in range(per):
            s, e = r * per + j, after[r * per + j]
            if before[s] == e:
                entries.append(("keep", j))
            elif r in holders[e]:
                entries.append(("copy", holders[e][r]))
            else:
                if e not in fetched:
                    near = [q for q in holders[e] if q // per_node == r // per_node] or list(holders[e])
                    src = min(near, key=lambda q: (sent_by[q], q))
                    sent_by[src] += 1
                    fetched[e] = len(wanted)
                    wanted.append((src, e))
                entries.append(("want", fetched[e]))
        # received rows arrive grouped by source rank (all_to_all order), in request order inside
        arrival = sorted(range(len(wanted)), key=lambda k: (wanted[k][0], k))
        row_of = {k: row for row, k in enumerate(arrival)}
        for k in arrival:
            src, e = wanted[k]
            sends.setdefault((src, r), []).append(holders[e][src])
        source.append([("recv", row_of[a]) if kind == "want" else (kind, a) for kind, a in entries])
    return MigrationPlan(ranks, per, source, sends, num_nodes)


# ------------------------------------------------------------------------------ migration
def _fingerprint(*parts: Any) -> int:
    """A 31-bit checksum of the given values, for checking that every rank agrees on them."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def _group_by_dtype(tensors: Mapping[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    groups: dict[torch.dtype, list[str]] = {}
    for name, t in tensors.items():
        groups.setdefault(t.dtype, []).append(name)
    return groups


def migrate(
    old: ExpertPlacement,
    new: ExpertPlacement,
    tensors: Mapping[str, torch.Tensor],
    backend: Any,
    group: Any = None,
    layer: int = 0,
    rank: int | None = None,
    fault: Callable[[str, int], None] | None = None,
    num_nodes: int = 1,
    stale: frozenset[int] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Move this rank's expert tensors of one layer from ``old`` to ``new``; collective over ``group``.

    ``tensors`` maps names to this rank's tensors shaped ``[slots_per_rank, ...]`` (rows in local
    slot order; every rank passes the same names, shapes and dtypes). Returns new tensors, in
    fresh buffers, with each local slot holding its new logical expert's rows bit for bit; the
    inputs are never written. Raises :class:`MigrationError` on every rank if any rank failed
    (bad input, or an exception while packing or unpacking), with the failing ranks named.
    ``fault(phase, rank)`` is called at "prepare" and "build" (a test hook for injected failures).
    ``num_nodes`` groups the ranks into nodes so experts are fetched within a node when possible;
    ``stale`` slots are refilled, never copied from (see :func:`plan_migration`).
    """
    world = dist.get_world_size(group)
    me = dist.get_rank(group) if rank is None else rank
    problem = ""
    plan: MigrationPlan | None = None
    buffers: dict[torch.dtype, torch.Tensor] = {}
    names = _group_by_dtype(tensors)
    widths = {dt: [tensors[n][0].numel() if tensors[n].dim() and tensors[n].shape[0] else 0 for n in ns] for dt, ns in names.items()}
    try:  # ---- prepare: validate and pack what this rank sends
        if old.num_ranks != world:
            raise ValueError(f"the placement spans {old.num_ranks} ranks but the group has {world}")
        plan = plan_migration(old, new, layer, num_nodes, stale)
        for name, t in tensors.items():
            if t.dim() < 1 or t.shape[0] != plan.slots_per_rank:
                raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}; its first dim must be the {plan.slots_per_rank} local slots")
        rows = [i for d in range(world) for i in plan.sends.get((me, d), [])]
        idx = torch.tensor(rows, dtype=torch.int64)
        device = backend.device()  # optimizer states kept in host memory travel through the device with the rest
        for dt, ns in names.items():
            parts = [tensors[n].reshape(plan.slots_per_rank, -1).index_select(0, idx.to(tensors[n].device)).to(device) for n in ns]
            buffers[dt] = torch.cat(parts, dim=1) if parts else torch.empty(0)
        if fault is not None:
            fault("prepare", me)
    except Exception as exc:  # reported to every rank below; nothing has been written
        problem = f"{type(exc).__name__}: {exc}"
    # ---- agree: every rank ready, same plan, same tensor layout
    spec = _fingerprint(old.phy2log[layer].tolist() if layer < old.num_layers else None,
                        new.phy2log[layer].tolist() if layer < new.num_layers else None,
                        sorted((str(dt), ns, widths[dt]) for dt, ns in names.items()), sorted(stale))
    _agree(backend, group, world, me, bool(problem), spec, "prepare", problem)
    assert plan is not None
    # ---- exchange: one all-to-all per dtype, sizes known to every rank from the plan
    send_counts, recv_counts = plan.send_counts(me), plan.recv_counts(me)
    received: dict[torch.dtype, torch.Tensor] = {}
    any_moves = plan.rows_moved > 0
    for dt, ns in names.items():
        buf = buffers[dt]
        out = buf.new_empty(sum(recv_counts), buf.shape[1])
        if any_moves:
            backend.all_to_all_single(out, buf.contiguous(), recv_counts, send_counts, group=group)
        received[dt] = out
    # ---- build: fresh buffers, old tensors untouched
    result: dict[str, torch.Tensor] = {}
    try:
        src = plan.source[me]
        for dt, ns in names.items():
            col = 0
            for n, width in zip(ns, widths[dt]):
                t = tensors[n]
                rows = t.reshape(plan.slots_per_rank, -1)
                got = received[dt][:, col:col + width].to(t.device)
                col += width
                pool = torch.cat([rows, got], dim=0)  # old rows, then received rows
                pick = torch.tensor([a if kind in ("keep", "copy") else plan.slots_per_rank + a for kind, a in src], dtype=torch.int64)
                result[n] = pool.index_select(0, pick.to(t.device)).view(t.shape)
                if fault is not None:
                    fault("build", me)
    except Exception as exc:
        problem = f"{type(exc).__name__}: {exc}"
    _agree(backend, group, world, me, bool(problem), spec, "build", problem)
    return result


def _agree(backend: Any, group: Any, world: int, me: int, failed: bool, spec: int, phase: str, problem: str) -> None:
    """All-reduce (MAX) per-rank failure flags and the spec checksum; raise on every rank if needed."""
    flags = torch.zeros(world + 2, dtype=torch.int64)
    flags[me] = int(failed)
    flags[world], flags[world + 1] = spec, -spec  # max(spec) == -max(-spec) iff all ranks agree
    backend.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    bad = [r for r in range(world) if flags[r]]
    if bad:
        detail = f" (this rank: {problem})" if problem else ""
        raise MigrationError(f"expert migration failed at {phase} on rank(s) {bad}; the old placement is kept{detail}", bad)
    if int(flags[world]) != -int(flags[world + 1]):
        raise MigrationError("expert migration refused: ranks disagree on the placements or on the tensors' names, dtypes or shapes", [])


def expert_tensors(
    params: Mapping[str, torch.nn.Parameter], slots_per_rank: int, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, torch.Tensor]:
    """Everything that moves with a slot: each parameter, its gradient and every optimizer state
    tensor whose first dim is the local slot count (Adam's exp_avg, exp_avg_sq; momentum buffers)."""
    tensors: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        tensors[name] = p.detach()
        if p.grad is not None:
            tensors[f"{name}.grad"] = p.grad
        if optimizer is not None:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == slots_per_rank:
                    tensors[f"{name}.state.{key}"] = value
    return tensors


def row_bytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """Bytes of one slot's row across ``tensors`` (each shaped [slots, ...]), dtype by dtype."""
    return sum(t[0].numel() * t.element_size() for t in tensors.values() if t.dim() and t.shape[0])


def migrate_parameters(
    old: ExpertPlacement,
    new: ExpertPlacement,
    params: Mapping[str, torch.nn.Parameter],
    backend: Any,
    group: Any = None,
    layer: int = 0,
    optimizer: torch.optim.Optimizer | None = None,
    rank: int | None = None,
    fault: Callable[[str, int], None] | None = None,
    num_nodes: int = 1,
    stale: frozenset[int] = frozenset(),
) -> None:
    """Migrate expert parameters in place, with their gradients and per-slot optimizer state.

    Every optimizer state tensor whose first dim is the local slot count (Adam's exp_avg and
    exp_avg_sq, momentum buffers) moves with its parameter; scalars such as Adam's step stay.
    Nothing is replaced unless every rank succeeded (see :func:`migrate`).
    """
    tensors = expert_tensors(params, new.slots_per_rank, optimizer)
    moved = migrate(old, new, tensors, backend, group, layer, rank, fault, num_nodes, stale)
    # commit: only reached when every rank succeeded
    for name, p in params.items():
        p.data = moved[name]
        if p.grad is not None:
            p.grad = moved[f"{name}.grad"]
        if optimizer is not None:
            state = optimizer.state.get(p, {})
            for key in list(state):
                if f"{name}.state.{key}" in moved:
                    state[key] = moved[f"{name}.state.{key}"]
