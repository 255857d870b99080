"""LPLB's balancing LP: every group's LP of one batch, solved in one call, checked, with a fallback.

:class:`BalanceLP` / :func:`solve_balance` build the LPLB LP of every group of a batch
(REFERENCE.md: minimise the largest rank load when each replicated class may move a share of its
tokens to its copy), solve them in one call with :func:`~portapipe.balancing.lp_solver.solve_box_lp`'s
method, check each solution against a certified lower bound, and replace a failed one by the even
split. On CPU tensors they hand the batch to the compiled solver of
:mod:`~portapipe.balancing.lplb_native` when it is available (the same method, start, stopping
rule and checks, without the per-operation overhead). The standard form of the same LP
(:func:`balance_lp`) feeds :func:`~portapipe.balancing.lp_solver.solve_lp` for cross-checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from . import lplb_native
from .lp_solver import _box_ipm, _compiled

__all__ = ["BalanceResult", "BalanceLP", "balance_lp", "solve_balance", "rank_loads", "STEP_FRAC", "ACCEPT_RTOL"]


#: fraction of the largest feasible step the balancing LP's iterations take (torch and native)
STEP_FRAC = 0.9999
#: a plan is accepted when its max load is within this of the certified lower bound (normalised loads)
ACCEPT_RTOL = 1e-6


@dataclass
class BalanceResult:
    """Per-group plans of one batch: G groups of g ranks with d classes each."""

    keep: torch.Tensor  #: [G, g, d] share of each (rank, class) load kept by the originals
    objective: torch.Tensor  #: [G] planned max rank load (in the loads' units)
    lower_bound: torch.Tensor  #: [G] the LP's dual bound (same units)
    accepted: torch.Tensor  #: [G] bool: the LP solution passed its checks (else the even split)
    iterations: int


def rank_loads(fixed: torch.Tensor, replicated: torch.Tensor, keep: torch.Tensor, r2o: torch.Tensor) -> torch.Tensor:
    """Rank loads [G, g] when rank i keeps ``keep[i,k]`` of its class-k load and hosts the rest of r2o[i,k]'s."""
    kept = replicated * keep
    incoming = (replicated - kept).gather(1, r2o.to(keep.device).unsqueeze(0).expand_as(kept))
    return fixed + kept.sum(2) + incoming.sum(2)


class BalanceLP:
    """The LPLB LP of ``n_groups`` groups sharing one topology: :meth:`solve` uses the compact form
    (``moves``), :meth:`build` gives the standard form below.

    Columns per group: q[i,k] (g*d shares moved from rank i's class-k originals to their copy),
    g rank slacks, the max load z, and g*d slacks of q <= 1. Rows: for each rank i,
    -sum_k W_ik q_ik + sum_k W_{r2o(i,k),k} q_{r2o(i,k),k} + slack_i - z = -(F_i + sum_k W_ik);
    then q_ik + t_ik = 1. Minimise z (+ ``move_cost`` * sum_ik W_ik q_ik: a small positive value
    picks, among the plans with the smallest max load, one that moves few tokens). The constant
    part of the matrix and the positions of the load entries are built once here.
    """

    def __init__(
        self,
        r2o: torch.Tensor,
        n_groups: int,
        *,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
        move_cost: float = 0.0,
    ) -> None:
        self.r2o = r2o.to(device=device, dtype=torch.int64)
        g, d = self.r2o.shape
        self.n_groups, self.g, self.d, self.n = n_groups, g, d, g * d
        self.dtype, self.move_cost = dtype, move_cost
        n, dev = self.n, self.r2o.device
        cols = 2 * n + g + 1
        a0 = torch.zeros(g + n, cols, dtype=dtype, device=dev)
        ranks = torch.arange(g, device=dev)
        a0[ranks, n + ranks] = 1.0  # rank slacks
        a0[:g, n + g] = -1.0  # -z
        qs = torch.arange(n, device=dev)
        a0[g + qs, qs] = 1.0  # q + t = 1
        a0[g + qs, n + g + 1 + qs] = 1.0
        self.a0 = a0
        rows = ranks.unsqueeze(1).expand(g, d)
        cls = torch.arange(d, device=dev)
        own = (rows * cols + rows * d + cls).reshape(-1)  # entry (i, column of q[i,k])
        src = (rows * cols + self.r2o * d + cls).reshape(-1)  # entry (i, column of q[r2o(i,k),k])
        self.positions = torch.cat([own, src]).expand(n_groups, 2 * n)
        self.src_class = (self.r2o * d + cls).reshape(-1)  # W flattened index of (r2o(i,k), k)
        self.c = torch.zeros(n_groups, cols, dtype=dtype, device=dev)
        self.c[:, n + g] = 1.0
        self.box_rhs = torch.ones(n_groups, n, dtype=dtype, device=dev)
        # Compact form: moving a unit share of column j = (r, k) takes W_j off rank r and puts it
        # on the rank that holds the copy; rank loads are h + (moves * w) q.
        moves = torch.zeros(g, n, dtype=dtype, device=dev)
        moves[rows.reshape(-1), qs] = -1.0
        holder = torch.empty_like(self.r2o)
        holder[self.r2o, cls.expand(g, d)] = ranks.unsqueeze(1).expand(g, d)  # holder[r, k]: who copies r's class k
        moves[holder.reshape(-1), qs] = 1.0
        self.moves = moves
        self.holder = holder.reshape(-1).cpu()  # the native solver's form of `moves`

    def build(self, fixed: torch.Tensor, replicated: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(c, A, b) for loads fixed [G, g] and replicated [G, g, d] (already in ``dtype``)."""
        G, n = self.n_groups, self.n
        w = replicated.reshape(G, n)
        A = self.a0.repeat(G, 1, 1)
        A.view(G, -1).scatter_(1, self.positions, torch.cat([-w, w.index_select(1, self.src_class)], 1))
        b = torch.cat([(fixed + replicated.sum(2)).neg_(), self.box_rhs], 1)
        c = self.c
        if self.move_cost:
            c = c.clone()
            c[:, :n] = self.move_cost * w
        return c, A, b

    def solve(
        self,
        fixed: torch.Tensor,
        replicated: torch.Tensor,
        *,
        tol: float = 1e-8,
        max_iter: int = 50,
        accept_rtol: float = ACCEPT_RTOL,
        use_native: bool | None = None,
    ) -> BalanceResult:
        """Plan every group: fixed [G, g] loads, replicated [G, g, d] class loads (any real dtype).

        Loads are normalised per group (largest rank load before moving = 1) and the compact
        form of the LP is solved by :func:`solve_box_lp`. A group's solution is accepted when the
        solver converged, the shares are finite and in [0, 1], and the loads they give are within
        ``accept_rtol`` of a certified lower bound (from the dual multipliers) and no worse than
        the even split. A rejected group gets the even split (keep = 1/2).

        ``use_native``: solve with the C solver of :mod:`~portapipe.balancing.lplb_native` (same
        method, checks and result, computed in float64; CPU tensors only) -- None: when it is
        available, True: always (RuntimeError with the reason if it cannot run), False: the
        torch solver.
        """
        G, g, d = self.n_groups, self.g, self.d
        if tuple(fixed.shape) != (G, g) or tuple(replicated.shape) != (G, g, d):
            raise ValueError(
                f"loads must be fixed [{G}, {g}] and replicated [{G}, {g}, {d}], got {list(fixed.shape)} and {list(replicated.shape)}"
            )
        out_dtype = replicated.dtype if replicated.dtype.is_floating_point else self.dtype
        fixed, w = fixed.to(self.dtype), replicated.to(self.dtype).reshape(G, self.n)
        if lplb_native.wanted(use_native, w.device):
            keep, objective, bound, ok, iterations = lplb_native.balance(
                self.holder, fixed, w, move_cost=self.move_cost, tol=tol, max_iter=max_iter, accept_rtol=accept_rtol,
                step_frac=STEP_FRAC,
            )
        else:
            keep, objective, bound, ok, iterations = _compiled(_balance)(
                self.moves, fixed, w, self.move_cost, tol, max_iter, accept_rtol, STEP_FRAC
            )
        return BalanceResult(keep.view(G, g, d).to(out_dtype), objective.to(out_dtype), bound.to(out_dtype), ok, iterations)


def _balance(
    moves: torch.Tensor, fixed: torch.Tensor, w: torch.Tensor, move_cost: float, tol: float, max_iter: int, accept_rtol: float,
    step_frac: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:meth:`BalanceLP.solve` on flat loads fixed [G, g], w [G, n]: (keep [G, n], objective,
    lower bound, accepted, iterations)."""
    G = w.shape[0]
    h = fixed + w.view(G, fixed.shape[1], -1).sum(2)  # rank loads before moving
    scale = h.amax(1, keepdim=True).clamp_(min=1e-30)
    h = h / scale
    wn = w / scale
    M = moves * wn.unsqueeze(1)  # [G, g, n]: load change of rank i per unit share q_j
    c: Optional[torch.Tensor] = None
    if move_cost != 0.0:
        c = move_cost * wn
    q, y, err, iterations = _box_ipm(M, h, c, tol, max_iter, step_frac)
    # Loads the shares give, the even split's, and a lower bound on the LP's objective valid for
    # any q in [0, 1] (the dual multipliers' certificate): for y >= 0 with sum y = 1,
    # max_i load_i + c^T q >= y^T h + (M^T y + c)^T q >= y^T h + sum_j min(0, (M^T y + c)_j).
    yn = y / y.sum(1, keepdim=True)
    both = torch.baddbmm(h.unsqueeze(2), M, torch.stack([q, torch.full_like(q, 0.5)], 2)).amax(1)
    achieved, even = both.unbind(1)
    mty = torch.bmm(yn.unsqueeze(1), M).squeeze(1)
    reached = achieved
    if c is not None:
        mty = mty + c
        reached = achieved + (c * q).sum(1)
    bound = (yn * h).sum(1) + mty.clamp_(max=0).sum(1)
    sane = (torch.isfinite(q) & (q >= -1e-6) & (q <= 1 + 1e-6)).all(1)
    ok = (err <= tol) & sane & (reached <= bound + accept_rtol) & (achieved <= even + accept_rtol)
    keep = torch.where(ok.unsqueeze(1), (1 - q).clamp_(0, 1), 0.5)
    s = scale.squeeze(1)
    return keep, torch.where(ok, achieved, even) * s, bound * s, ok, iterations


def balance_lp(
    fixed: torch.Tensor, replicated: torch.Tensor, r2o: torch.Tensor, move_cost: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(c, A, b) of the LPLB LP of every group (see :class:`BalanceLP`), in the loads' dtype."""
    lp = BalanceLP(r2o, replicated.shape[0], dtype=replicated.dtype, device=replicated.device, move_cost=move_cost)
    return lp.build(fixed.to(replicated.dtype), replicated)


def solve_balance(
    fixed: torch.Tensor,
    replicated: torch.Tensor,
    r2o: torch.Tensor,
    *,
    tol: float = 1e-8,
    max_iter: int = 50,
    accept_rtol: float = ACCEPT_RTOL,
    dtype: torch.dtype = torch.float64,
    use_native: bool | None = None,
) -> BalanceResult:
    """One-off :meth:`BalanceLP.solve`: fixed [G, g] loads, replicated [G, g, d], r2o [g, d]."""
    lp = BalanceLP(r2o, replicated.shape[0], dtype=dtype, device=replicated.device)
    return lp.solve(fixed, replicated, tol=tol, max_iter=max_iter, accept_rtol=accept_rtol, use_native=use_native)
