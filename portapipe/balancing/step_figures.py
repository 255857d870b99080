"""A balancer's per-step figures gathered from every rank as one float tensor.

On a step without a rebalance every rank's figures (:meth:`ExpertBalancer._figures` plus the
replica switch's gain and cost) have a fixed shape once the job's most MoE layers on a rank is
known, so they travel as one ``float64`` row per rank through one all-gather instead of a
pickled dict per rank (``all_gather_object``: two collectives and serialisation on every step).
The rows are turned back into the same dicts, so :func:`~portapipe.balancing.report.merge_figures`
and the replica switch see exactly what the object gather gave them: every value is a count,
a layer id or a ``float64`` figure, all held exactly by a ``float64``.

Row layout: ``pp_rank, layers, has_switch, gain_s, cost_s, replica_tokens, has_orig, refresh_s``, then the
layer ids, ``rank_loads`` and ``orig_loads`` (``max_layers`` and ``max_layers * ep`` entries,
zero-padded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

HEAD = 8


def row_width(max_layers: int, ep: int) -> int:
    """Entries of one rank's row."""
    return HEAD + max_layers + 2 * max_layers * ep


def pack_figures(figures: dict[str, Any], max_layers: int, ep: int) -> torch.Tensor:
    """One rank's step figures (no rebalance event) as a ``float64`` row of :func:`row_width`."""
    if figures.get("event") is not None:
        raise ValueError("a rebalance event does not fit a fixed-shape row; gather it as an object")
    n = len(figures["layers"])
    if n > max_layers:
        raise ValueError(f"{n} MoE layers on this rank but rows were sized for {max_layers}")
    row = torch.zeros(row_width(max_layers, ep), dtype=torch.float64)
    switch = figures["switch"]
    orig = figures["orig_loads"]
    row[:HEAD] = torch.tensor([figures["pp_rank"], n, switch is not None, switch["gain_s"] if switch else 0.0,
                               switch["cost_s"] if switch else 0.0, figures["replica_tokens"], bool(orig),
                               switch["refresh_s"] if switch else 0.0], dtype=torch.float64)
    row[HEAD:HEAD + n] = torch.tensor(figures["layers"], dtype=torch.float64)
    loads = HEAD + max_layers
    if n:
        row[loads:loads + n * ep] = torch.tensor(figures["rank_loads"], dtype=torch.float64).reshape(-1)
    if orig:
        at = loads + max_layers * ep
        row[at:at + n * ep] = torch.tensor(orig, dtype=torch.float64).reshape(-1)
    return row


def unpack_figures(row: torch.Tensor, max_layers: int, ep: int) -> dict[str, Any]:
    """The dict :func:`pack_figures` was given (with ``event`` None)."""
    head = row[:HEAD].tolist()
    n = int(head[1])
    loads = HEAD + max_layers
    out: dict[str, Any] = {
        "pp_rank": int(head[0]),
        "layers": [int(x) for x in row[HEAD:HEAD + n].tolist()],
        "rank_loads": row[loads:loads + n * ep].view(n, ep).tolist(),
        "orig_loads": row[loads + max_layers * ep:loads + max_layers * ep + n * ep].view(n, ep).tolist() if head[6] else [],
        "replica_tokens": head[5],
        "switch": {"gain_s": head[3], "cost_s": head[4], "refresh_s": head[7]} if head[2] else None,
        "event": None,
    }
    return out


def gather_figures(backend: Any, figures: dict[str, Any], max_layers: int, ep: int, world: int) -> list[dict[str, Any]]:
    """Every rank's figures, in rank order, through one all-gather over the job (collective)."""
    row = pack_figures(figures, max_layers, ep)
    rows = row.new_empty(world * row.numel())
    backend.all_gather_into_tensor(rows, row)
    return [unpack_figures(r, max_layers, ep) for r in rows.view(world, -1)]


class FigureGather:
    """Every rank's after-step figures (collective over the job): a rebalance step's events and
    ``min_gain`` as objects (``all_gather_object``), any other step as one fixed-shape row per rank."""

    def __init__(self, backend: Any, layers: int, ep: int) -> None:
        self.backend, self.layers, self.ep = backend, layers, ep
        self.max_layers: int | None = None  # the job's most MoE layers on a rank: the rows' size

    def __call__(self, figures: dict[str, Any], as_objects: bool) -> list[dict[str, Any]]:
        world = dist.get_world_size()
        if as_objects:
            parts: list[Any] = [None] * world
            dist.all_gather_object(parts, figures)
            return parts
        if self.max_layers is None:  # once
            most = torch.tensor([self.layers], dtype=torch.int64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            self.max_layers = int(most)
        return gather_figures(self.backend, figures, self.max_layers, self.ep, world)
