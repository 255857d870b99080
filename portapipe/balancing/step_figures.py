"""A balancer's per-step figures gathered from every rank as one float tensor.

Every rank's figures (:func:`~portapipe.balancing.report.rank_figures` plus the replica switch's
gain and cost, ``min_gain: auto``'s price and a periodic decision's record) have a fixed shape
once the job's most MoE layers on a rank is known, so they travel as one ``float64`` row per
rank through one all-gather, on every step, a rebalance step included: never as pickled dicts
(``all_gather_object``: two collectives and serialisation, which LPLB re-planning every step
would pay every step). The rows are turned back into the same dicts, so
:func:`~portapipe.balancing.report.merge_figures` and the replica switch see exactly what an
object gather would give them: every value is a count, a layer id, a policy named from
:data:`POLICIES` or a ``float64`` figure, all held exactly by a ``float64``.

Row layout: :data:`HEAD` (``pp_rank, dp_rank, layers, has_switch, gain_s, cost_s, replica_tokens,
has_orig, refresh_s, has_min_gain, min_gain, has_event``), the event's :data:`EVENT` fields, then
the layer ids, ``rank_loads`` and ``orig_loads`` (``max_layers`` and ``max_layers * ep`` entries,
zero-padded).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .eplb import POLICIES as EPLB_POLICIES

HEAD = ("pp_rank", "dp_rank", "layers", "has_switch", "gain_s", "cost_s", "replica_tokens", "has_orig", "refresh_s",
        "has_min_gain", "min_gain", "has_event")

#: a decision record's fields in the row (its ``layers`` are the rank's; ``policy`` by its index in POLICIES)
EVENT = ("step", "before", "after", "applied", "policy", "slots_changed", "rows_moved", "rows_inter_node",
         "bytes_moved", "bytes_inter_node")

#: every policy a decision record can name
POLICIES = (*EPLB_POLICIES, "incremental+refined", "lplb")

_INTS = {"step", "slots_changed", "rows_moved", "rows_inter_node", "bytes_moved", "bytes_inter_node"}


def row_width(max_layers: int, ep: int) -> int:
    """Entries of one rank's row."""
    return len(HEAD) + len(EVENT) + max_layers + 2 * max_layers * ep


def pack_figures(figures: dict[str, Any], max_layers: int, ep: int) -> torch.Tensor:
    """One rank's step figures as a ``float64`` row of :func:`row_width`."""
    n = len(figures["layers"])
    if n > max_layers:
        raise ValueError(f"{n} MoE layers on this rank but rows were sized for {max_layers}")
    row = torch.zeros(row_width(max_layers, ep), dtype=torch.float64)
    switch, orig, event = figures["switch"], figures["orig_loads"], figures.get("event")
    head = {"pp_rank": figures["pp_rank"], "dp_rank": figures.get("dp_rank", 0), "layers": n, "has_switch": switch is not None,
            "replica_tokens": figures["replica_tokens"], "has_orig": bool(orig), "has_min_gain": "min_gain" in figures,
            "min_gain": figures.get("min_gain", 0.0), "has_event": event is not None}
    for key in ("gain_s", "cost_s", "refresh_s"):
        head[key] = switch[key] if switch else 0.0
    row[: len(HEAD)] = torch.tensor([float(head[k]) for k in HEAD], dtype=torch.float64)
    if event is not None:
        if list(event["layers"]) != list(figures["layers"]):
            raise ValueError(f"a decision on layers {event['layers']} travels with the figures of layers {figures['layers']}")
        if event["policy"] not in POLICIES:
            raise ValueError(f"a decision by policy {event['policy']!r}; the row names {', '.join(POLICIES)}")
        values = {**event, "policy": POLICIES.index(event["policy"])}
        row[len(HEAD): len(HEAD) + len(EVENT)] = torch.tensor([float(values[k]) for k in EVENT], dtype=torch.float64)
    at = len(HEAD) + len(EVENT)
    row[at: at + n] = torch.tensor(figures["layers"], dtype=torch.float64)
    loads = at + max_layers
    if n:
        row[loads: loads + n * ep] = torch.tensor(figures["rank_loads"], dtype=torch.float64).reshape(-1)
    if orig:
        row[loads + max_layers * ep: loads + max_layers * ep + n * ep] = torch.tensor(orig, dtype=torch.float64).reshape(-1)
    return row


def unpack_figures(row: torch.Tensor, max_layers: int, ep: int) -> dict[str, Any]:
    """The dict :func:`pack_figures` was given."""
    head = dict(zip(HEAD, row[: len(HEAD)].tolist()))
    n = int(head["layers"])
    at = len(HEAD) + len(EVENT)
    loads = at + max_layers
    layers = [int(x) for x in row[at: at + n].tolist()]
    out: dict[str, Any] = {
        "pp_rank": int(head["pp_rank"]),
        "dp_rank": int(head["dp_rank"]),
        "layers": layers,
        "rank_loads": row[loads: loads + n * ep].view(n, ep).tolist(),
        "orig_loads": row[loads + max_layers * ep: loads + max_layers * ep + n * ep].view(n, ep).tolist() if head["has_orig"] else [],
        "replica_tokens": head["replica_tokens"],
        "switch": {k: head[k] for k in ("gain_s", "cost_s", "refresh_s")} if head["has_switch"] else None,
        "event": None,
    }
    if head["has_min_gain"]:
        out["min_gain"] = head["min_gain"]
    if head["has_event"]:
        values = dict(zip(EVENT, row[len(HEAD): at].tolist()))
        event: dict[str, Any] = {k: int(v) if k in _INTS else v for k, v in values.items()}
        event["applied"], event["policy"], event["layers"] = bool(values["applied"]), POLICIES[int(values["policy"])], layers
        out["event"] = event
    return out


def gather_figures(backend: Any, figures: dict[str, Any], max_layers: int, ep: int, world: int) -> list[dict[str, Any]]:
    """Every rank's figures, in rank order, through one all-gather over the job (collective)."""
    row = pack_figures(figures, max_layers, ep)
    rows = row.new_empty(world * row.numel())
    backend.all_gather_into_tensor(rows, row)
    return [unpack_figures(r, max_layers, ep) for r in rows.view(world, -1)]


class FigureGather:
    """Every rank's after-step figures, one fixed-shape row per rank (collective over the job)."""

    def __init__(self, backend: Any, layers: int, ep: int) -> None:
        self.backend, self.layers, self.ep = backend, layers, ep
        self.max_layers: int | None = None  # the job's most MoE layers on a rank: the rows' size

    def __call__(self, figures: dict[str, Any]) -> list[dict[str, Any]]:
        world = dist.get_world_size()
        if self.max_layers is None:  # once
            most = torch.tensor([self.layers], dtype=torch.int64)
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            self.max_layers = int(most)
        return gather_figures(self.backend, figures, self.max_layers, self.ep, world)
