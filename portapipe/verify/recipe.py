"""The one-process step under the run's own recipe (dtypes, rounding points, FP8, the routes the
ranks took, replayed): what ``--precision model`` holds the pipelined step to, and its noise floor
(the same step with its sums of micro-batches, replicas and copies reversed)."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from ..compose import build_model
from ..models.expert_parallel import ExpertParallel
from ..optim.precision import master_dtype, reduce_dtype
from ..models.moe import DTYPES
from ..models.objective import keep_targets
from ..scheduling.executor import mean_loss
from ..scheduling.overlap import Tape, run
from ..scheduling.stage import is_expert
from .pipelined import kept_per_microbatch, microbatches, route_by_position, term_means, threads, updated_biases


# ------------------------------------------------------ the one-process step under the run's recipe
class RouteReplay:
    """The balancer's stand-in in the one-process step: each MoE layer holds every physical slot
    of the EP group (``slots[layer]``: their logical experts, rank by rank), and the micro-batches
    of the replica ``source`` ((dp rank, EP rank)) go to the slots its rank sent them to
    (``routes[source][layer]``, recorded there: :func:`record_routes`). So each slot meets the
    rows it met on the ranks, and a replicated expert's gradient is its slots' partial sums, as
    there."""

    def __init__(self, slots: dict[int, list[int]], routes: dict[tuple[int, int], dict[int, torch.Tensor]]) -> None:
        self.slots, self.routes = slots, routes
        self.num_slots = len(next(iter(slots.values())))
        self.source = next(iter(routes))

    def experts_on(self, layer: int) -> list[int]:
        return self.slots[layer]

    def route(self, layer: int, idx: torch.Tensor) -> torch.Tensor:
        slots = self.routes[self.source][layer]
        if slots.shape != idx.shape:
            raise ValueError(f"layer {layer}: {tuple(idx.shape)} routed entries, {tuple(slots.shape)} recorded on the ranks")
        return slots.to(idx.device)


def route_replay(config: Config, rank_results: list[dict[str, Any]]) -> RouteReplay | None:
    """The ranks' balancer placement and routes for the one-process step (None without a balancer).
    ValueError where a rank routed one layer's micro-batches differently (nothing to replay)."""
    if not any("routes" in r for r in rank_results):
        return None
    slots: dict[int, dict[int, list[int]]] = {}  # layer -> EP rank -> its slots' logical experts
    routes: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for r in rank_results:
        for layer, recorded in r.get("routes", {}).items():
            if recorded is None:
                raise ValueError(f"the balancer routed layer {layer}'s micro-batches differently on one rank: "
                                 "the one-process step cannot replay them (routing by position should route each alike)")
            routes.setdefault((r["dp_rank"], r["ep_rank"]), {})[layer] = recorded
            slots.setdefault(layer, {})[r["ep_rank"]] = r["expert_ids"][f"layers.{layer}.moe.experts.gate_up"]
    return RouteReplay({layer: [e for rank in sorted(by) for e in by[rank]] for layer, by in slots.items()}, routes)


def _one_rank_groups() -> Any:
    from ..backends.base import ParallelGroups

    return ParallelGroups(0, 1, 1, 1, 1, 0, 0, 0, dp_ranks=[0], replica_ranks=[0])


def recipe_step(config: Config, by_position: bool = False, scale: float = 1.0, reverse: bool = False,
                replay: RouteReplay | None = None) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """The step in one process under the ranks' own recipe: ``config``'s dtypes and the pipeline's
    rounding points, as :func:`reference_step` returns it.

    Each block's program runs through a recording tape and its backward part by part, as a rank
    runs a stage (a weight used by several parts gets each part's gradient apart); gradients
    accumulate in the master dtype as the ranks' buckets do (the same :class:`~portapipe.optim.buckets.GradBuckets`),
    one replica at a time; the copies of a weight several blocks share stay apart and are summed
    in the master dtype; a replicated expert's slots (``replay``) are summed as the balancer does;
    an expert's gradient is then summed over the EP replicas in the master dtype and everything
    over the replicas in ``train.grad_reduce_dtype``. ``scale``: float16's loss scale (divided
    out in float64). What may still differ from the ranks is the order of those sums: ``reverse``
    runs the replicas, micro-batches, copies and slots in the reverse order (the noise floor).
    It runs on device 0 of ``config.backend`` (the ranks' kind: their kernels' rounding), on one
    thread on the CPU as a rank does.
    """
    from ..backends.registry import backend_class, resolve_name
    from ..optim.buckets import GradBuckets

    p, m_cfg, t = config.parallel, config.model, config.train
    n_blocks = config.n_blocks()
    m = config.schedule.microbatches
    order = (lambda xs: list(xs)[::-1]) if reverse else list
    seed = scale / (m * p.dp * p.ep)
    backend = backend_class(resolve_name(config.backend))(config.backend_options)
    ep = ExpertParallel(backend)
    ep.balancer = replay
    blocks = build_model(config, range(n_blocks), n_blocks, ep)
    keep_targets(blocks.values(), kept_per_microbatch(config))
    device = backend.device(0)  # the ranks' kind of device: their kernels, their rounding
    for block in blocks.values():
        block.to(device)
    if by_position:
        route_by_position(config, [layer for b in range(n_blocks) for layer in blocks[b].moe_layers()])
    master = DTYPES[master_dtype(m_cfg.dtype, t.master_dtype)]
    reduced = DTYPES[reduce_dtype(m_cfg.dtype, t.master_dtype, t.grad_reduce_dtype)]
    buckets = GradBuckets(blocks, _one_rank_groups(), backend, master_dtype=master, reduce_dtype=reduced, zero_stage=0,
                          bucket_mb=t.grad_bucket_mb, overlap=False, copy_sum=_no_copies)
    params = [(b, name, q) for b in range(n_blocks) for name, q in blocks[b].named_parameters()]
    per_replica: dict[int, dict[str, list[torch.Tensor]]] = {}
    losses: dict[int, list[float]] = {}
    terms: dict[int, list[dict[str, float]]] = {}
    with threads(1):  # as on the ranks
        for r in order(range(p.dp * p.ep)):
            if replay is not None:
                replay.source = (r // p.ep, r % p.ep)
            buckets.start()
            data = [tuple(t.to(device) for t in mb) for mb in microbatches(config, r)]
            losses[r], terms[r] = [0.0] * m, [{}] * m
            for i in order(range(m)):
                losses[r][i], terms[r][i] = _tape_step(blocks, *data[i][:2], seed, *data[i][2:])
            buckets.finish()
            full = buckets.full_grads()
            grads: dict[str, list[torch.Tensor]] = {}
            for _, name, q in params:  # every copy of a shared weight, block by block
                grads.setdefault(name, []).append(full[q].detach().cpu().clone())
            per_replica[r] = grads
    out = {}
    for _, name, q in params:
        if name in out:
            continue
        copies = {r: _sum(order(g[name])) for r, g in per_replica.items()}
        if is_expert(q):  # summed over the EP replicas in the master dtype, its slots as the balancer does, then over DP
            by_dp = [_sum(order(copies[d * p.ep + e] for e in range(p.ep))) for d in range(p.dp)]
            if replay is not None:
                by_dp = [_slot_sums(g, replay.slots[_layer_of(name)], p.ep, order) for g in by_dp]
            out[name] = _sum(order(g.to(reduced) for g in by_dp)).to(master)
        else:
            out[name] = _sum(order(copies[r].to(reduced) for r in range(p.dp * p.ep))).to(master)
    grads_out = {name: g if scale == 1.0 else g.to(torch.float64) / scale for name, g in out.items()}
    rows = [losses[r] for r in range(p.dp * p.ep)]
    term_rows = [terms[r] for r in range(p.dp * p.ep)]
    if reverse:
        rows, term_rows = [row[::-1] for row in rows[::-1]], [row[::-1] for row in term_rows[::-1]]
    return mean_loss(rows), grads_out, updated_biases(blocks), term_means(term_rows)


def _no_copies(*_: Any) -> torch.Tensor:
    raise RuntimeError("the one-process step sums its copies itself")


def _tape_step(
    blocks: dict[int, Any], inputs: torch.Tensor, targets: torch.Tensor, seed: float, positions: torch.Tensor | None = None
) -> tuple[float, dict[str, float]]:
    """One micro-batch through every block as the ranks run a stage (recording tapes, part-wise
    backward, seeded with ``seed`` as the executor seeds the loss); its loss and loss terms.
    ``positions``: the documents of the micro-batch, given to every block as the executor gives them."""
    n_blocks = len(blocks)
    tapes, h = [], inputs
    given = {} if positions is None else {"positions": positions}
    for b in range(n_blocks):
        tape = Tape(input_grad=b > 0, loss_seed=seed)
        h = run(blocks[b].program(tape, h, targets if b == n_blocks - 1 else None, **given))
        tapes.append((tape, h))
    loss = float(h.detach())
    grad: torch.Tensor | None = torch.full_like(h, seed)
    recorded = {name: float(v) for tape, _ in tapes for name, v in tape.terms.items()}
    for tape, out in reversed(tapes):
        grad = run(tape.backward(out, grad))
    return loss, recorded


def _sum(tensors: Any) -> torch.Tensor:
    """The tensors added left to right (in their dtype)."""
    total = None
    for x in tensors:
        total = x.clone() if total is None else total + x
    return total


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])  # layers.{index}.moe.experts.{gate_up,down}


def _slot_sums(grad: torch.Tensor, slots: list[int], ep: int, order: Any) -> torch.Tensor:
    """Each logical expert's gradient from its slots' (``grad[slot]``, ``slots``: the slots' logical
    experts, ``ep`` ranks' in turn): a rank's own slots added in slot order, then the ranks'
    parts in ascending rank order (:mod:`portapipe.balancing.replica_sum`); one row per logical expert."""
    per = len(slots) // ep
    out = grad.new_zeros((max(slots) + 1, *grad.shape[1:]))
    for e in range(out.shape[0]):
        parts = []
        for rank in order(range(ep)):
            mine = [s for s in order(range(rank * per, (rank + 1) * per)) if slots[s] == e]
            if mine:
                parts.append(_sum(grad[s] for s in mine))
        out[e] = _sum(parts)
    return out


