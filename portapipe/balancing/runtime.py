"""The expert balancer of a running model: placement, routing, replica gradients, rebalancing.

:class:`ExpertBalancer` is built by the pipeline runtime when ``balancer.kind`` is ``eplb`` or
``lplb`` and handed to every MoE layer through its :class:`~portapipe.models.expert_parallel.ExpertParallel`:

- **Placement.** Each EP rank holds ``n_experts / ep + balancer.redundant`` physical expert
  slots; :meth:`experts_on` says which logical expert each local slot holds (the MoE layer
  builds and initialises its experts from it, so a replica starts as an exact copy).
  ``eplb`` starts from :meth:`ExpertPlacement.even` (each rank's own experts, then copies of
  other ranks' experts, even on even loads);
  ``lplb`` from the LPLB planner's layout (originals, then copies along the topology).
- **Routing** (:meth:`route`, called by the MoE layer for every micro-batch): logical expert ids
  to physical slots. ``eplb`` spreads an expert's tokens evenly over its replicas
  (:meth:`ExpertPlacement.route`); ``lplb`` runs the LP planner on the batch (counts all-reduced
  over the EP group, so every rank makes the same plan) and moves tokens between an original
  and its copy.
- **Gradients** (:meth:`reduce_gradients`, called by the runtime after its own reductions): the
  gradient of a replicated expert is the sum over its replicas (each saw only its own tokens),
  exchanged between the ranks holding it; every replica gets that sum, so replicas take
  identical optimizer steps and stay equal.
- **Rebalancing** (:meth:`after_step`, called by the training loop with the step's
  :class:`~portapipe.scheduling.executor.StepResult`): records the expert loads in a sliding
  window; every ``interval`` steps plans a new placement (``eplb``:
  :class:`~portapipe.balancing.loads.Rebalancer`; ``lplb``: the planner's EPLB reordering of
  which experts are replicated), adopts it when the balancedness gain reaches ``min_gain``
  (``auto``: pricing.py) times the fraction of slots it moves, and moves the changed slots'
  weights, gradients and AdamW state between ranks (:func:`migrate_parameters`). The replica
  switch (replica_switch.py) decides whether the replicas take tokens; the figures it returns
  for the metrics file are report.py's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..scheduling.spans import COMPUTE, span
from .loads import LoadWindow, Rebalancer
from .lplb_periodic import lp_rank_loads, lplb_placement, plan_periodic
from .migration import MigrationError, expert_tensors, migrate_parameters, plan_migration, row_bytes
from .placement import ExpertPlacement
from .pricing import auto_min_gain, full_migration_bytes, replica_gain_s
from .replica_sum import HolderPlan, holder_plan, sum_over_holders
from .replica_switch import ReplicaSwitch, first_slot_loads, spread_loads
from .report import Rebalance, merge_figures, rank_figures
from .step_figures import FigureGather

__all__ = ["EXPERT_PARAMS", "ExpertBalancer", "Rebalance", "merge_figures", "moe_layer_indices", "topology_of"]

log = logging.getLogger("portapipe.balancing")

#: the expert tensors of one MoE layer that migrate (stacked [local slots, ...])
EXPERT_PARAMS = ("gate_up", "down")


def moe_layer_indices(model: Any, blocks: list[int], n_blocks: int, split: Any = None) -> list[int]:
    """Global indices of the MoE layers in ``blocks`` (sorted): the rows of ``StepResult.expert_counts``;
    ``split``: ``parallel.layers_per_stage`` (:func:`~portapipe.config.setup.stage_layers`)."""
    from ..config.setup import layer_range

    out = []
    for b in blocks:
        first, last = layer_range(model.n_layers, n_blocks, b, split)
        out += [i for i in range(first, last) if i >= model.n_dense]
        if b == n_blocks - 1:  # the multi-token prediction modules' layers (always MoE)
            out += [model.n_layers + k for k in range(model.mtp_layers)]
    return sorted(out)


def topology_of(balancer: Any, ep: int) -> torch.Tensor:
    """The r2o tensor ``balancer.topology`` names for an EP group of ``ep`` ranks."""
    from .topology import by_name

    return by_name(balancer.topology, ring_size=ep, torus_shape=tuple(balancer.torus) if balancer.torus else None)


class ExpertBalancer:
    """The balancer of one rank of a running model (see the module docstring).

    ``layers``: global indices of this rank's MoE layers, in the order of
    ``StepResult.expert_counts``'s rows. Every rank of the job makes one (possibly with no layers),
    because :meth:`after_step` gathers the figures of all pipeline ranks.
    """

    def __init__(self, config: Any, backend: Any, groups: Any, layers: list[int]) -> None:
        bal, model = config.balancer, config.model
        if bal.kind not in ("eplb", "lplb"):
            raise ValueError(f"balancer.kind: {bal.kind!r}; ExpertBalancer runs eplb or lplb")
        self.kind = bal.kind
        self.backend, self.groups = backend, groups
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.num_experts = model.n_experts
        self.ep, self.ep_rank = groups.ep, groups.ep_rank
        self.num_slots = model.n_experts + bal.redundant * groups.ep
        self.interval, self.nodes = bal.interval, bal.nodes
        # min_gain auto: worked out before each decision from the measured migration and expert times
        self.min_gain_auto = bal.min_gain == "auto"
        self.min_gain = 0.0 if self.min_gain_auto else bal.min_gain
        self.migrate_s_per_byte = 0.0  # this rank's last migration: seconds per byte it moved
        self.sum_s_per_byte = 0.0  # this rank's last replica gradient sum: processor seconds per byte it sent
        self.full_bytes: int | None = None  # every slot's rows with the optimizer's state (min_gain auto)
        self.history: list[Rebalance] = []
        self.last_moved: dict[str, int] = {}  # what the last apply() moved
        self.modules: list[Any] = []  # this rank's MoE layers, set by attach()
        n = max(len(self.layers), 1)  # a rank without MoE layers keeps a one-row placement it never uses
        self.rebalancer: Rebalancer | None = None
        self.planners: list[Any] = []
        if self.kind == "eplb":
            self.rebalancer = Rebalancer.from_config(bal, n, model.n_experts, groups.ep, model.n_groups)
            # even with the replicas spreading tokens (so a balanced router gains nothing from a
            # first plan), and with them off every token goes to its expert's first slot: spread those evenly
            start = ExpertPlacement.even(n, model.n_experts, groups.ep, self.num_slots)
            self.placement = self.rebalancer.placement = start.with_first_slots_balanced()
        else:
            from .lplb import Planner

            r2o = topology_of(bal, groups.ep)
            group = groups.ep_group if groups.ep > 1 else None
            self.planners = [
                Planner(r2o, self.num_slots, model.n_experts, group=group, backend=backend if group is not None else None, ep_size=groups.ep)
                for _ in range(n)
            ]
            self.window = LoadWindow(bal.window, n, model.n_experts)
            self.placement = lplb_placement(self.planners, groups.ep, model.n_experts)
        # whether the replicas take tokens (and LPLB's LP runs) next step: see replica_switch.py
        self.switch = ReplicaSwitch(bal.stay_off, self.kind)
        # replicas skip their gradient sum while off only where their optimizer rows can be refilled
        self.can_refresh = config.train.zero_stage == 0
        self.stale = False  # replicas missed a gradient sum: refill them before they take tokens
        self.holder_plans: dict[int, HolderPlan] = {}  # per layer row, for the placement in force
        self.gather = FigureGather(backend, len(self.layers), groups.ep)

    # ------------------------------------------------------------------ placement
    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.ep

    def experts_on(self, layer: int) -> list[int]:
        """Logical expert held by each of this rank's local slots of MoE layer ``layer`` (global index)."""
        return self.placement.experts_on(self.ep_rank, self.row[layer]).tolist()

    def attach(self, moe_layers: list[Any]) -> None:
        """Take this rank's built MoE layers (sorted by index) and mark which slots count in the grad norm."""
        got = [layer.index for layer in moe_layers]
        if got != self.layers:
            raise ValueError(f"the balancer was planned for MoE layers {self.layers} but the model has {got}")
        self.modules = list(moe_layers)
        self._label()

    def _label(self) -> None:
        """After a placement change: each layer's slot labels and the slots that own their expert.

        A replicated expert's gradient is counted once in the global gradient norm: by the slot
        its tokens are routed to first (``log2phy[.., 0]``).
        """
        per = self.slots_per_rank
        mine = torch.arange(self.ep_rank * per, (self.ep_rank + 1) * per)
        self.holder_plans = {}
        for layer in self.modules:
            row = self.row[layer.index]
            experts = layer.moe.experts
            logical = self.placement.experts_on(self.ep_rank, row)
            experts.logical = logical.tolist()
            owned = self.placement.log2phy[row, logical, 0] == mine
            for name in EXPERT_PARAMS:
                getattr(experts, name).slot_owned = owned

    # -------------------------------------------------------------------- routing
    def route(self, layer: int, topk_idx: torch.Tensor) -> torch.Tensor:
        """Physical slot of every (token, k) entry of one micro-batch of MoE layer ``layer``."""
        row = self.row[layer]
        if not self.switch.on:  # every token to its expert's first slot (the same on every EP rank)
            return self.placement.log2phy[row, :, 0].to(topk_idx.device)[topk_idx]
        if self.kind == "lplb":
            # processor time, as the experts' (expert_clock): on a shared host the counts'
            # all-reduce would otherwise measure the ranks waiting for each other
            t0 = time.thread_time()
            with span(COMPUTE, ("LPLB solve", layer)):
                out = self.planners[row].run(topk_idx)
            self.switch.charge(time.thread_time() - t0)
            return out
        return self.placement.route(row, topk_idx, offset=self.ep_rank)

    # ------------------------------------------------------------------ gradients
    def reduce_gradients(self) -> None:
        """Sum each replicated expert's gradient over its replicas (collective over the EP group).

        Each holder of a replicated expert exchanges its replicas' rows with the other holders
        only, and every replica slot takes its expert's total, bit-identical on every holder
        (:mod:`~portapipe.balancing.replica_sum`). Experts with one slot are untouched.
        While the replicas are switched off they took no tokens, so a first slot's gradient is
        already its expert's total: the sum is skipped (under ``zero_stage`` 0: :meth:`idle`) and
        the replicas are marked out of date. Under a ZeRO stage their optimizer rows cannot be
        refilled, so they are summed while off too and stay exact copies.
        """
        if self.idle():
            self.stale = self.stale or bool((self.placement.logcnt > 1).any())
            return
        t0, cpu0 = time.perf_counter(), time.process_time()
        sent = self._sum_replica_gradients()
        self.switch.charge(time.perf_counter() - t0)
        if sent:
            # processor time (every thread of this rank, the transport's too): on a shared host the
            # wall time would also count the wait for peers to be scheduled
            self.sum_s_per_byte = (time.process_time() - cpu0) / sent

    def idle(self) -> bool:
        """Whether the replicas have nothing to do this step: switched off (they take no tokens)
        where their rows can be refilled before they are used again (``zero_stage`` 0). Their
        gradient sum is then skipped, and the gradient buckets reduce over DP only the rows
        that own their expert (optim/buckets.py)."""
        return not self.switch.on and self.can_refresh

    def _sum_replica_gradients(self) -> int:
        """The replica sum of every MoE layer with replicas (see :meth:`reduce_gradients`); the bytes this rank sent."""
        jobs: list[tuple[torch.Tensor, HolderPlan]] = []
        for layer in self.modules:
            row = self.row[layer.index]
            if not bool((self.placement.logcnt[row] > 1).any()):
                continue
            if row not in self.holder_plans:
                self.holder_plans[row] = holder_plan(self.placement.phy2log[row], self.ep, self.ep_rank)
            for name in EXPERT_PARAMS:
                p = getattr(layer.moe.experts, name)
                grad = getattr(p, "main_grad", None)  # the accumulator of a wider dtype, when there is one
                if grad is None:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    grad = p.grad
                jobs.append((grad.view(p.shape[0], -1), self.holder_plans[row]))
        return sum_over_holders(jobs, self.backend, self.groups.ep_group, self.ep, self.ep_rank)

    # ---------------------------------------------------------------- migration
    def apply(
        self,
        new: ExpertPlacement,
        optimizer: torch.optim.Optimizer | None = None,
        planners: list[Any] | None = None,
        fault: Any = None,
    ) -> int:
        """Adopt ``new``: move every MoE layer's expert weights, gradients and optimizer state.

        Collective over the EP group (every EP rank passes the same placement). Returns the slot
        rows that crossed between ranks (:attr:`last_moved` has them split by node, with bytes).
        Only changed slots move; an expert a rank lacks is fetched from its own node when one of
        its ranks holds it. If a layer's migration fails, the layers already moved are moved back,
        so the old placement stays in force everywhere, and the error is raised. ``fault`` is
        passed to :func:`migrate_parameters` (a test hook for injected failures).
        """
        moved = self._move(new, optimizer, fault)
        if self.kind == "eplb":  # (lplb's planner sets which slot is an expert's original)
            new = new.with_first_slots_balanced(self.load_window.loads() if len(self.load_window) else None)
        self.placement = new
        if self.rebalancer is not None:
            self.rebalancer.placement = new
            self.rebalancer.planned = True
        if planners is not None:
            self.planners = planners
        self._label()
        self.last_moved = moved
        return moved["rows_moved"]

    def _stale_slots(self, row: int) -> frozenset[int]:
        """Global slots of layer ``row`` that are out of date: every replica but the first slot."""
        if not self.stale:
            return frozenset()
        first = set(self.placement.log2phy[row, :, 0].tolist())
        return frozenset(s for s in range(self.num_slots) if s not in first)

    def _move(self, new: ExpertPlacement, optimizer: Any, fault: Any = None) -> dict[str, int]:
        """Move every layer's expert rows from the placement in force (its out-of-date replicas
        refilled) to ``new``; all or nothing (see :meth:`apply`). Clears :attr:`stale`."""
        old = self.placement
        done: list[Any] = []
        moved = {"rows_moved": 0, "rows_inter_node": 0, "bytes_moved": 0, "bytes_inter_node": 0}
        t0 = time.perf_counter()
        try:
            for layer in self.modules:
                row = self.row[layer.index]
                params = {n: getattr(layer.moe.experts, n) for n in EXPERT_PARAMS}
                per_row = row_bytes(expert_tensors(params, self.slots_per_rank, optimizer))
                stale = self._stale_slots(row)
                migrate_parameters(old, new, params, self.backend, self.groups.ep_group, row, optimizer, self.ep_rank, fault, self.nodes, stale)
                done.append(layer)
                plan = plan_migration(old, new, row, self.nodes, stale)
                for key, rows in (("moved", plan.rows_moved), ("inter_node", plan.rows_inter_node)):
                    moved[f"rows_{key}"] += rows
                    moved[f"bytes_{key}"] += rows * per_row
        except MigrationError:
            for layer in done:
                params = {n: getattr(layer.moe.experts, n) for n in EXPERT_PARAMS}
                migrate_parameters(new, old, params, self.backend, self.groups.ep_group, layer=self.row[layer.index],
                                   optimizer=optimizer, rank=self.ep_rank, num_nodes=self.nodes)
            raise
        self.stale = False
        if moved["bytes_moved"]:
            self.migrate_s_per_byte = (time.perf_counter() - t0) / moved["bytes_moved"]
        return moved

    # ------------------------------------------------------------- periodic step
    def _global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """``StepResult.expert_counts`` (EP-summed, float64 on the CPU) summed over DP too, so every replica decides alike."""
        c = counts.clone()
        if self.groups.dp > 1:
            self.backend.all_reduce(c, group=self.groups.dp_group)
        return c

    def _slot_loads(self) -> torch.Tensor:
        """Rows this rank routed to each physical slot this step ``[layers, slots]``; resets them.
        The figure gather carries them and the merge adds them over the ranks (report.py)."""
        if not self.modules:
            return torch.zeros(0, self.num_slots, dtype=torch.float64)
        c = torch.stack([layer.moe.slot_counts for layer in self.modules]).to(torch.float64).cpu()
        for layer in self.modules:
            layer.moe.slot_counts.zero_()
        return c

    def _decide(self, step: int, optimizer: torch.optim.Optimizer | None) -> Rebalance:
        """Plan from the window's loads after (1-based) step ``step``; adopt and migrate if it gains enough."""
        if self.rebalancer is not None:
            event = self.rebalancer.decide(step)
            changed = int(event.cost.changed.sum()) if event.cost is not None else 0
            return self._migrate(Rebalance(step, event.before, event.after, event.applied, layers=list(self.layers),
                                           policy=event.policy, slots_changed=changed), event.placement, optimizer)
        # judged by the routing in force: with the LP only while the replicas are on
        plan = plan_periodic(self.planners, self.window.loads(), self.placement, self.nodes, with_lp=self.switch.on)
        gain = plan.after - plan.before
        applied = gain > 0 and gain >= self.min_gain * plan.fraction and plan.changes
        log.info(
            "lplb step %d: balancedness %.4f -> %.4f (gain %+.4f) moving %.1f%% of the slots (min_gain %.4f): %s",
            step, plan.before, plan.after, gain, 100 * plan.fraction, self.min_gain, "rebalanced" if applied else "kept the current placement",
        )
        record = Rebalance(step, plan.before, plan.after, applied, layers=list(self.layers), policy="lplb", slots_changed=plan.slots_changed)
        return self._migrate(record, plan.placement, optimizer, plan.planners)

    def _migrate(self, record: Rebalance, new: ExpertPlacement, optimizer: Any, planners: list[Any] | None = None) -> Rebalance:
        """Apply ``new`` when ``record`` says so, filling in what moved."""
        if record.applied:
            self.apply(new, optimizer, planners)
            for key, value in self.last_moved.items():
                setattr(record, key, value)
        return record

    def after_step(self, step: int, result: Any, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
        """The training loop's per-step hook (0-based ``step``); collective over the whole job.

        Records the step's loads, rebalances after every ``interval``-th step, decides whether
        the replicas take tokens next step, and returns every rank's figures merged
        (:func:`~portapipe.balancing.report.merge_figures`; the same dict on every rank).
        """
        slots = self._slot_loads()
        counts = group_counts = None
        if self.layers and result.expert_counts is not None:
            group_counts = result.expert_counts.detach().to(torch.float64).cpu()
            counts = self._global_counts(group_counts)
        # before a rebalance changes the placement the step ran with; LPLB's originals from this
        # DP replica's counts, as its EP group routed them
        mine = rank_figures(self.placement, self.layers, self.groups.pp_rank, self.groups.dp_rank, self.ep, slots,
                            group_counts, self.kind == "lplb")
        mine["switch"] = self.switch.figures(self._replica_gain(counts)) if self.modules else None
        event = None
        due = (step + 1) % self.interval == 0
        if due and self.min_gain_auto:
            mine["min_gain"] = self._auto_min_gain(optimizer)
        if counts is not None:
            self.load_window.record(counts)
            if due:
                with span(COMPUTE, f"{self.kind.upper()} rebalance"):
                    event = self._decide(step + 1, optimizer)  # numbered like the metrics: after step N
                self.history.append(event)
        mine["event"] = None if event is None else event.as_dict()
        parts = self.gather(mine)
        merged = merge_figures(parts)
        if "min_gain" in mine:  # auto: the same on every rank
            merged["min_gain"] = mine["min_gain"]
        merged.update(self.switch.decide(step + 1, [p["switch"] for p in parts], self.interval))
        if self.switch.on and self.stale:
            t0 = time.perf_counter()
            moved = self._move(self.placement, optimizer)
            self.switch.refresh_s = time.perf_counter() - t0
            merged["replicas_refreshed_rows"] = moved["rows_moved"]
            log.info("%s step %d: %d out-of-date replica rows refilled from their first slots", self.kind, step + 1, moved["rows_moved"])
        return merged

    def _replica_gain(self, counts: torch.Tensor | None) -> float:
        """Seconds per step the replicas are predicted to save on this rank (pricing.py), from the
        step's loads with every token on its first slot against LPLB's plan or EPLB's even spread."""
        if counts is None or not self.modules:
            return 0.0
        p, per = self.placement, self.slots_per_rank
        used = lp_rank_loads(self.planners, counts) if self.kind == "lplb" else spread_loads(counts, p.log2phy, p.logcnt, per, self.ep)
        return replica_gain_s(first_slot_loads(counts, p.log2phy, per, self.ep), used, self.modules, self.groups.dp)

    def _auto_min_gain(self, optimizer: Any) -> float:
        """``min_gain: auto`` before a decision (collective over the job; pricing.py), priced by the
        last migration's seconds per byte or, before the first, the replica sum's."""
        if self.full_bytes is None or optimizer is None:  # fixed once the optimizer holds its state
            self.full_bytes = full_migration_bytes(self.modules, EXPERT_PARAMS, self.slots_per_rank, self.num_slots, optimizer)
        full = self.full_bytes
        value = auto_min_gain(self.kind, self.modules, full, self.migrate_s_per_byte or self.sum_s_per_byte, self.interval)
        self.min_gain = value
        if self.rebalancer is not None:
            self.rebalancer.min_gain = value
        return value

    # ------------------------------------------------------------- checkpoints
    @property
    def load_window(self) -> LoadWindow:
        """The recorded per-step loads the next placement is planned from."""
        return self.rebalancer.window if self.rebalancer is not None else self.window

    def state_dict(self) -> dict[str, Any]:
        """The placement in force (the checkpointed expert weights are laid out by it), the
        recorded loads (so a resumed run plans its next placement from the same window) and
        ``planned`` (the placement came from loads, so an incremental policy changes it rather
        than planning a first placement)."""
        return {
            "kind": self.kind,
            "phy2log": self.placement.phy2log.clone(),
            "log2phy": self.placement.log2phy.clone(),
            "loads": self.load_window.state_dict(),
            "planned": self.rebalancer.planned if self.rebalancer is not None else True,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the placement of a checkpoint whose expert weights were just loaded."""
        if state.get("kind") != self.kind or tuple(state["phy2log"].shape) != tuple(self.placement.phy2log.shape):
            raise ValueError(
                f"checkpoint balancer state ({state.get('kind')}, phy2log {tuple(state['phy2log'].shape)}) does not fit "
                f"balancer.kind {self.kind} with phy2log {tuple(self.placement.phy2log.shape)}"
            )
        placement = ExpertPlacement(state["phy2log"], self.ep, self.num_experts, log2phy=state["log2phy"])
        self.placement = placement
        if self.rebalancer is not None:
            self.rebalancer.placement = placement
            # a state saved before "planned" was kept: any layout but the identity came from loads
            identity = ExpertPlacement.identity(placement.num_layers, self.num_experts, self.ep, self.num_slots)
            self.rebalancer.planned = bool(state.get("planned", not torch.equal(placement.phy2log, identity.phy2log)))
        for row, planner in enumerate(self.planners):
            # the planner's layout is a function of each rank's originals (its first local slots)
            planner.set_layout(placement.phy2log[row].view(self.ep, self.slots_per_rank)[:, : planner.local_logical])
        if "loads" in state:
            self.load_window.load_state_dict(state["loads"])
        self._label()
