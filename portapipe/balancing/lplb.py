"""LPLB: per-batch token redistribution between replicated experts, by linear programming.

Physical slot layout (``ep`` EP ranks, ``L = n_logical / ep`` originals and
``R = n_physical / ep - L`` redundant slots per rank, ``d = r2o.shape[1]`` classes, ``C = R / d``):

- physical slot ``p`` lives on EP rank ``p // (L + R)``; local slot ``t = p % (L + R)``;
- local slots ``0 .. L-1`` hold the rank's own experts (the originals), heaviest first after
  :meth:`Planner.update_placement`; the first ``C * d`` of them are replicated, slot
  ``c * d + k`` being the ``c``-th original of class ``k``;
- local slot ``L + c * d + k`` holds the copy of slot ``c * d + k`` of rank ``r2o[i, k]`` of the
  same group (``i`` = the rank's index in its group of ``g = r2o.shape[0]`` consecutive ranks).

So every replicated expert has exactly two slots (original first in ``log2phy``) and every
other expert one. Per batch, :meth:`Planner.run` counts the tokens per logical expert (summed
over the EP group through the backend), solves one LP per group for the share of each
(rank, class) load that stays on the originals, and sends each rank's own tokens of a
replicated expert to the original or the copy in that ratio: in token order, the first ones stay,
the rest move. The moved counts are rounded cumulatively over the ranks, so the integer plan
(identical on every rank) is exactly what the redirected indices produce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import lplb_native
from .lp_balance import ACCEPT_RTOL, STEP_FRAC, BalanceLP
from .lplb_map import map_sorted
from .topology import validate_r2o

__all__ = ["Plan", "Planner"]

#: shares are fixed-point numbers with this many fraction bits before integer rounding, so the
#: integer plan depends on the LP's solution only to 2^-20 and is reproduced bit for bit by
#: every rank
_FRAC_BITS = 20


@dataclass
class Plan:
    """One batch's plan; identical on every rank of the EP group."""

    counts: torch.Tensor  #: [S, E] tokens per source rank (row) and logical expert
    keep: torch.Tensor  #: [G, g, d] share of each (rank, class) load kept by the originals
    moved: torch.Tensor  #: [S, E] tokens each source sends to the copy instead of the original
    phys_load: torch.Tensor  #: [n_physical] tokens per physical slot after redirection
    rank_load: torch.Tensor  #: [ep] tokens per EP rank after redirection
    lp_objective: torch.Tensor  #: [G] the LP's max rank load per group (tokens, fractional)
    accepted: torch.Tensor  #: [G] bool: the group's LP solution passed its checks


class _CutPlan(Plan):
    """A :class:`Plan` over the C path's :class:`~portapipe.balancing.lplb_native.PlanOutput`:
    its tensors are cut from the call's buffers when first read."""

    def __init__(self, counts: torch.Tensor, out: lplb_native.PlanOutput) -> None:  # noqa: D107 - not the dataclass's
        self.counts, self.accepted, self._out = counts, out.accepted, out

    keep = property(lambda self: self._out.keep)
    moved = property(lambda self: self._out.moved)
    phys_load = property(lambda self: self._out.phys)
    rank_load = property(lambda self: self._out.rank_load)
    lp_objective = property(lambda self: self._out.objective)


class Planner:
    """Per-batch LP balancer for one MoE layer's EP group.

    Args:
        r2o: topology [g, d] (see :mod:`portapipe.balancing.topology`).
        n_physical: physical expert slots over the EP group (originals + redundant).
        n_logical: logical (routed) experts.
        group: the EP process group; per-expert counts are all-reduced over it so every rank
            reaches the same plan. None: one process sees the whole batch.
        backend: the portapipe Backend that made ``group`` (its all-reduce is used).
        ep_size: EP ranks when there is no group (default: the group's size).
        tol, max_iter: the LP solver's tolerance and iteration cap.
        use_triton: count and map with the Triton kernels (None: when triton is installed and
            the indices live on a device it drives, or on CPU under TRITON_INTERPRET=1); the
            torch path gives identical results.
        use_native: count, solve and map CPU tensors with the compiled C path of
            :mod:`~portapipe.balancing.lplb_native` (None: when it is available; True: always,
            RuntimeError naming the reason if it cannot run; False: the torch path), decided
            when the planner first sees a device. Same results as the torch path; Triton, when
            it is used, still counts and maps.
    """

    def __init__(
        self,
        r2o: torch.Tensor,
        n_physical: int,
        n_logical: int,
        group: Any = None,
        backend: Any = None,
        *,
        ep_size: int | None = None,
        tol: float = 1e-8,
        max_iter: int = 50,
        use_triton: bool | None = None,
        use_native: bool | None = None,
    ) -> None:
        if group is not None:
            if backend is None:
                raise ValueError("Planner(group=...) needs the portapipe backend of that group: pass backend=<Backend>")
            import torch.distributed as dist

            group_size, self.ep_rank = dist.get_world_size(group), dist.get_rank(group)
            if ep_size is not None and ep_size != group_size:
                raise ValueError(f"ep_size={ep_size} but the process group has {group_size} ranks")
            ep_size = group_size
        else:
            if ep_size is None:
                raise ValueError("Planner without a process group needs ep_size (the number of EP ranks)")
            self.ep_rank = 0
        for name, v in (("n_physical", n_physical), ("n_logical", n_logical), ("ep_size", ep_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.r2o = validate_r2o(r2o, ep_size)
        self.group_size, self.n_classes = self.r2o.shape
        self.ep_size = ep_size
        self.n_groups = ep_size // self.group_size
        if n_logical % ep_size or n_physical % ep_size:
            raise ValueError(
                f"n_logical={n_logical} and n_physical={n_physical} must both be multiples of the EP size {ep_size}"
            )
        self.n_logical, self.n_physical = n_logical, n_physical
        self.local_logical = n_logical // ep_size
        self.local_physical = n_physical // ep_size
        redundant = self.local_physical - self.local_logical
        d = self.n_classes
        if redundant < d or redundant % d:
            raise ValueError(
                f"each rank has {redundant} redundant slots (n_physical/ep - n_logical/ep); with {d} r2o classes it "
                f"needs a positive multiple of {d}, e.g. n_physical = {n_logical + d * ep_size}"
            )
        self.per_class = redundant // d
        if redundant > self.local_logical:
            raise ValueError(
                f"each rank would replicate {redundant} experts but holds only {self.local_logical} (n_logical/ep)"
            )
        self.group = group
        self.backend = backend
        self.tol, self.max_iter = tol, max_iter
        self.use_triton = use_triton
        self.use_native = use_native
        self._accepted = 0
        self._fallback = 0
        self.last_plan: Plan | None = None
        self._lps: dict[torch.device, BalanceLP] = {}
        self._paths_on: dict[torch.device, tuple[str, bool]] = {}
        self._set_layout(torch.arange(n_logical, dtype=torch.int64).view(ep_size, self.local_logical))

    # ------------------------------------------------------------------ placement
    @property
    def accepted_solves(self) -> int:
        """Group LPs whose solution passed its checks, over all runs."""
        return self._accepted

    @property
    def fallback_solves(self) -> int:
        """Group LPs replaced by the even split, over all runs."""
        return self._fallback

    def set_layout(self, originals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Adopt a layout given as ``originals[ep, L]``: the logical experts each EP rank holds as
        originals, its replicated ones first (e.g. restored from a checkpoint's ``phy2log``: each
        rank's first ``L`` slots). Returns (phy2log [P], log2phy [E, 2], logcnt [E])."""
        o = torch.as_tensor(originals)
        shape = (self.ep_size, self.local_logical)
        if o.dtype.is_floating_point or o.dtype == torch.bool or tuple(o.shape) != shape:
            raise ValueError(f"originals must be integer expert ids of shape {list(shape)} ([EP ranks, n_logical/ep]), got {o.dtype} {list(o.shape)}")
        o = o.to(torch.int64)
        if not torch.equal(torch.sort(o.reshape(-1)).values, torch.arange(self.n_logical)):
            raise ValueError(f"originals must hold every logical expert 0..{self.n_logical - 1} exactly once")
        self._set_layout(o.clone())
        return self.phy2log, self.log2phy, self.logcnt

    def _set_layout(self, originals: torch.Tensor) -> None:
        """Build all maps from ``originals[ep, L]``: each rank's experts, replicated ones first."""
        ep, L, g, d, C = self.ep_size, self.local_logical, self.group_size, self.n_classes, self.per_class
        ranks = torch.arange(ep)
        group_base = (ranks // g) * g
        r2o_global = group_base.unsqueeze(1) + self.r2o[ranks % g]  # [ep, d]: whose class-k experts rank r copies
        rep = originals[:, : C * d].reshape(ep, C, d)
        # copies[r, c, k] = rep[r2o_global[r, k], c, k]
        copies = rep[
            r2o_global.unsqueeze(1).expand(ep, C, d),
            torch.arange(C).view(1, C, 1).expand(ep, C, d),
            torch.arange(d).expand(ep, C, d),
        ]
        phy2log = torch.cat([originals, copies.reshape(ep, C * d)], 1).reshape(-1)
        slot = torch.arange(self.n_physical).view(ep, self.local_physical)
        E = self.n_logical
        orig_phys = torch.empty(E, dtype=torch.int64)
        orig_phys[originals.reshape(-1)] = slot[:, :L].reshape(-1)
        copy_phys = torch.full((E,), -1, dtype=torch.int64)
        copy_phys[copies.reshape(-1)] = slot[:, L:].reshape(-1)
        # LP slot of each replicated expert: (rank, class) flattened to rank * d + k.
        lp_slot = torch.full((E,), -1, dtype=torch.int64)
        lp_slot[rep.reshape(-1)] = (ranks.view(ep, 1, 1) * d + torch.arange(d).view(1, 1, d)).expand(ep, C, d).reshape(-1)
        rank_of = torch.empty(E, dtype=torch.int64)
        rank_of[originals.reshape(-1)] = ranks.repeat_interleave(L)
        self.phy2log = phy2log
        self.log2phy = torch.stack([orig_phys, copy_phys], 1)
        self.logcnt = 1 + (copy_phys >= 0).long()
        self._orig_phys, self._copy_phys, self._lp_slot, self._rank_of = orig_phys, copy_phys, lp_slot, rank_of
        self._replicated = lp_slot >= 0
        self._maps_on: dict[torch.device, tuple[torch.Tensor, ...]] = {}
        self._plan_call: lplb_native.PlanCall | None = None  # the C path bound to this layout (CPU only)

    def update_placement(
        self, workload: torch.Tensor, num_groups: int | None = None, num_nodes: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Reorder experts by ``workload`` [E] (recorded loads): EPLB without replication packs them
        onto ranks, then each rank's heaviest experts become its replicated originals.

        ``num_groups`` (default: the number of LP groups when it divides E, else 1) and
        ``num_nodes`` are passed to :func:`portapipe.balancing.eplb.rebalance_experts`.
        Returns (phy2log [P], log2phy [E, 2], logcnt [E]); the same on every rank given the same
        workload.
        """
        from .eplb import rebalance_experts

        if not isinstance(workload, torch.Tensor) or workload.numel() != self.n_logical:
            got = list(workload.shape) if isinstance(workload, torch.Tensor) else type(workload).__name__
            raise ValueError(f"workload must be a tensor of {self.n_logical} per-expert loads, got {got}")
        if workload.dtype == torch.bool or workload.dtype.is_complex:
            raise TypeError(f"workload must be integer or floating point, got {workload.dtype}")
        w = workload.detach().reshape(1, -1).to("cpu", torch.float32)
        if num_groups is None:
            num_groups = self.n_groups if self.n_logical % self.n_groups == 0 else 1
        nored, _, _ = rebalance_experts(w, self.n_logical, num_groups, num_nodes, self.ep_size)
        originals = nored.view(self.ep_size, self.local_logical)
        # Heaviest first within each rank; a stable sort keeps EPLB's slot order among ties.
        order = torch.sort(w[0][originals], dim=1, descending=True, stable=True).indices
        self._set_layout(originals.gather(1, order))
        return self.phy2log, self.log2phy, self.logcnt

    # ----------------------------------------------------------------- planning
    def _maps(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        """Per-device copies of the layout maps (made once per placement and device)."""
        if device not in self._maps_on:
            rep = self._replicated
            # Sorted-order output of run(): the -1 entries, then per expert its original
            # (repeated `stay` times) and its copy (repeated `moved` times).
            segments = torch.cat([torch.tensor([-1]), torch.stack([self._orig_phys, self._copy_phys.clamp(min=0)], 1).reshape(-1)])
            self._maps_on[device] = tuple(
                t.to(device)
                for t in (
                    self._rank_of,
                    self._lp_slot.clamp(min=0),
                    rep.double(),
                    self._orig_phys,
                    self._copy_phys.clamp(min=0),
                    segments,
                )
            )
        return self._maps_on[device]

    def _lp(self, device: torch.device) -> BalanceLP:
        if device not in self._lps:
            self._lps[device] = BalanceLP(self.r2o, self.n_groups, device=device)
        return self._lps[device]

    def group_loads(self, total: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The LP data of a batch with ``total[E]`` tokens per expert: each rank's load of
        non-replicated experts [G, g] and of its replicated originals per class [G, g, d] (float64)."""
        rank_of, lp_slot, rep_mask = self._maps(total.device)[:3]
        G, g, d = self.n_groups, self.group_size, self.n_classes
        rep_load = total * rep_mask
        fixed = torch.zeros(self.ep_size, dtype=torch.float64, device=total.device).index_add_(0, rank_of, total - rep_load)
        rep = torch.zeros(self.ep_size * d, dtype=torch.float64, device=total.device).index_add_(0, lp_slot, rep_load)
        return fixed.view(G, g), rep.view(G, g, d)

    def plan(self, counts: torch.Tensor) -> Plan:
        """Plan a batch from per-source token counts [S, E] (S ranks' rows; their sum is the batch)."""
        if counts.dim() != 2 or counts.shape[1] != self.n_logical:
            raise ValueError(f"counts must have shape [sources, {self.n_logical}], got {list(counts.shape)}")
        return self._plan(counts.long(), self._paths(counts.device)[1])[0]

    def _plan(
        self, counts: torch.Tensor, native: bool, flat: torch.Tensor | None = None, source: int = 0
    ) -> tuple[Plan, torch.Tensor | None]:
        """:meth:`plan` of int64 counts by the C path (``native``; it also maps ``flat``, this
        rank's entries counted in row ``source``, in the same call) or in tensor operations
        (then the mapping is left to the caller: None)."""
        mapped = None
        if native:
            if self._plan_call is None:
                self._plan_call = lplb_native.PlanCall(
                    (self._rank_of, self._lp_slot, self._orig_phys, self._copy_phys), self._lp(counts.device).holder,
                    n_groups=self.n_groups, ep_size=self.ep_size, n_physical=self.n_physical, tol=self.tol, max_iter=self.max_iter,
                    accept_rtol=ACCEPT_RTOL, step_frac=STEP_FRAC, frac_bits=_FRAC_BITS,
                )
            out, mapped = self._plan_call(counts, flat, source)
            plan: Plan = _CutPlan(counts, out)
        else:
            plan = self._plan_torch(counts, self._lp(counts.device))
        n_ok = plan.accepted.tolist().count(True)  # G flags: cheaper than a reduction and int()
        self._accepted += n_ok
        self._fallback += self.n_groups - n_ok
        self.last_plan = plan
        return plan, mapped

    def _plan_torch(self, counts: torch.Tensor, lp: BalanceLP) -> Plan:
        """The portable plan: group loads, the LPs by the torch solver, rounding, in tensor ops."""
        dev = counts.device
        _, lp_slot, rep_mask, orig_phys, copy_phys, _ = self._maps(dev)
        total = counts.sum(0)
        res = lp.solve(*self.group_loads(total), tol=self.tol, max_iter=self.max_iter, use_native=False)
        # Moved share per expert in fixed point; cumulative rounding over sources makes the
        # per-source integers add up to round(share * total) exactly.
        one = 1 << _FRAC_BITS
        q_fixed = torch.round((1 - res.keep.reshape(-1).index_select(0, lp_slot)) * rep_mask * one).long()
        cum = (counts.cumsum(0) * q_fixed + (one >> 1)) >> _FRAC_BITS
        moved = torch.diff(cum, dim=0, prepend=torch.zeros_like(cum[:1])) if cum.shape[0] > 1 else cum
        moved_total = cum[-1]
        phys = torch.zeros(self.n_physical, dtype=torch.int64, device=dev)
        phys.index_add_(0, orig_phys, total - moved_total).index_add_(0, copy_phys, moved_total)
        return Plan(
            counts=counts,
            keep=res.keep,
            moved=moved,
            phys_load=phys,
            rank_load=phys.view(self.ep_size, self.local_physical).sum(1),
            lp_objective=res.objective,
            accepted=res.accepted,
        )

    # ---------------------------------------------------------------------- run
    def check_indices(self, indices: torch.Tensor) -> None:
        """Raise TypeError / ValueError naming what is wrong with a batch of logical indices."""
        self._check_type(indices)
        if indices.numel() == 0:
            return
        lo, hi = (int(v) for v in torch.aminmax(indices))
        if lo < -1 or hi >= self.n_logical:
            bad = ((indices < -1) | (indices >= self.n_logical)).nonzero()[0].tolist()
            raise ValueError(
                f"indices{bad} = {int(indices[tuple(bad)])} is out of range: logical expert ids must be in "
                f"[0, {self.n_logical}) or -1 for a dropped token"
            )

    @staticmethod
    def _check_type(indices: torch.Tensor) -> None:
        if not isinstance(indices, torch.Tensor):
            raise TypeError(f"indices must be a torch.Tensor of logical expert ids, got {type(indices).__name__}")
        if indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be int32 or int64 logical expert ids, got {indices.dtype}")

    def _paths(self, device: torch.device) -> tuple[str, bool]:
        """(who counts and maps: "triton", "native" or "torch"; whether the C path plans) for
        tensors on ``device``, decided on first use there (the options, then the environment)."""
        if device not in self._paths_on:
            native = lplb_native.wanted(self.use_native, device)
            self._paths_on[device] = ("triton" if self._triton(device) else "native" if native else "torch", native)
        return self._paths_on[device]

    def _triton(self, device: torch.device) -> bool:
        """Whether to count and map with the Triton kernels for tensors on this device."""
        if self.use_triton is False:
            return False
        from . import lplb_triton  # no triton import unless the device could use it

        why = lplb_triton.why_unavailable(device)
        if self.use_triton and why:
            raise RuntimeError(f"use_triton=True but Triton cannot run on {device.type}: {why}")
        return not why

    def count(self, indices: torch.Tensor) -> torch.Tensor:
        """Tokens per logical expert in this rank's ``indices`` (int64 [E]); -1 entries are ignored."""
        self._check_type(indices)
        flat = indices.reshape(-1)
        return self._bincount(indices, flat, self._paths(flat.device)[0])[1:]

    def _bincount(self, indices: torch.Tensor, flat: torch.Tensor, path: str) -> torch.Tensor:
        """``bincount(flat + 1)`` with the -1 bin first, after checking the range of ``indices``
        (the native count checks it in the same pass)."""
        if path == "native":
            binned, bad = lplb_native.count_experts(flat, self.n_logical)
            if bad >= 0:
                self.check_indices(indices)  # raises, naming the entry
            return binned
        self.check_indices(indices)
        if path == "triton":
            from .lplb_triton import count_experts

            return count_experts(flat, self.n_logical)
        return torch.bincount((flat + 1).long(), minlength=self.n_logical + 1)

    def run(self, indices: torch.Tensor) -> torch.Tensor:
        """Map logical expert ids (any shape, -1 = dropped) to physical slots for this batch.

        Counts this rank's tokens, all-reduces the per-rank counts over the group, solves every
        group's LP, and returns physical ids of the same shape and dtype.
        """
        self._check_type(indices)
        dev = indices.device
        path, native = self._paths(dev)
        # Each rank fills its own row of the counts: the all-reduce gives every rank every rank's
        # counts, hence the same LP and the same cumulative rounding over ranks.
        source = self.ep_rank if self.group is not None else 0
        rows = self.ep_size if self.group is not None else 1
        counts = (torch.zeros if rows > 1 else torch.empty)(rows, self.n_logical, dtype=torch.int64, device=dev)
        if path == "native":
            # The C path counts straight into the row and maps in the planning call.
            if lplb_native.count_row(indices, counts, source) >= 0:
                self.check_indices(indices)  # raises, naming the entry
            binned = flat = None
        else:
            flat = indices.reshape(-1)
            binned = self._bincount(indices, flat, path)
            counts[source] = binned[1:]
        if self.group is not None:
            self.backend.all_reduce(counts, group=self.group)
        plan, out = self._plan(counts, native, indices if path == "native" else None, source)
        if out is None:
            moved = plan.moved[source]
            if path == "torch":
                out = map_sorted(flat, binned, moved, self._maps(dev)[5], self.n_logical)
            else:
                from .lplb_triton import map_indices

                _, _, _, orig_phys, copy_phys, _ = self._maps(dev)
                out = map_indices(flat, binned[1:] - moved, orig_phys, copy_phys)
        if out.dtype != indices.dtype:
            out = out.to(indices.dtype)
        return out if out.shape == indices.shape else out.view(indices.shape)
