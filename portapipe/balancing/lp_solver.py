"""Batched primal-dual interior-point LP solver in torch, and LPLB's balancing LP built on it.

:func:`solve_lp` solves ``B`` independent standard-form LPs at once,

    minimise c^T x   subject to   A x = b,   x >= 0,

with Mehrotra's predictor-corrector method: one batched Cholesky factorisation of the normal
matrix ``A D A^T`` per iteration, shared by the predictor and the corrector. It runs on the
device of its inputs, stops when every instance meets the tolerance (primal residual, dual
residual and complementarity gap, relative to the data's scale) or at the iteration cap, and
freezes converged instances while the others go on. Small problems are dominated by per-call
overhead, so an iteration is a few dozen batched tensor operations regardless of the batch size.

:func:`solve_box_lp` solves the LPLB LP in its compact form (only the moved shares q in [0, 1]
and the max load z are variables; the bounds are barrier terms, not rows), where the normal
matrix is one row per rank; it is the same method, specialised so that an iteration is fewer and
smaller operations. :func:`solve_balance` / :class:`BalanceLP` build the LPLB LP of every group of
a batch (REFERENCE.md: minimise the largest rank load when each replicated class may move a
share of its tokens to its copy), solve them in one call with it, check each solution against a
certified lower bound, and replace a failed one by the even split. On CPU tensors they hand the
batch to the compiled solver of :mod:`~portapipe.balancing.lplb_native` when it is available (the
same method, start, stopping rule and checks, without the per-operation overhead). The standard
form of the same LP (:func:`balance_lp`) feeds :func:`solve_lp` for cross-checks.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import lplb_native

__all__ = ["LPResult", "solve_lp", "solve_box_lp", "BalanceResult", "BalanceLP", "balance_lp", "solve_balance", "rank_loads"]


@dataclass
class LPResult:
    """Solutions of a batch of LPs (leading dimension B everywhere)."""

    x: torch.Tensor  #: [B, N] primal solution
    y: torch.Tensor  #: [B, M] multipliers of A x = b
    objective: torch.Tensor  #: [B] c^T x
    dual_objective: torch.Tensor  #: [B] b^T y (a lower bound on the optimum up to the dual residual)
    error: torch.Tensor  #: [B] largest of the scaled primal residual, dual residual and gap
    converged: torch.Tensor  #: [B] bool: error <= tol
    iterations: int  #: iterations run (those of the slowest instance)


def _max_step(z: torch.Tensor, dz: torch.Tensor) -> torch.Tensor:
    """Largest a <= 1 with z + a dz >= 0 along dim 2, for z > 0: -1 / min(-1, min(dz / z))."""
    return torch.div(-1.0, (dz / z).amin(2, keepdim=True).clamp(max=-1.0))


def _mehrotra_start(A: torch.Tensor, At: torch.Tensor, b3: torch.Tensor, c3: torch.Tensor, shift: torch.Tensor):
    """Mehrotra's starting point: least-norm x and least-squares (y, s), shifted to the interior."""
    L, _ = torch.linalg.cholesky_ex(torch.baddbmm(shift, A, At))
    x = At @ torch.cholesky_solve(b3, L)
    y = torch.cholesky_solve(A @ c3, L)
    s = c3 - At @ y
    x = x + (-1.5 * x.amin(1, keepdim=True)).clamp(min=0)
    s = s + (-1.5 * s.amin(1, keepdim=True)).clamp(min=0)
    # Equal margins on both so that no product x_j s_j starts near zero.
    xs = (x * s).sum(1, keepdim=True)
    x2 = x + 0.5 * xs / s.sum(1, keepdim=True).clamp(min=1e-30)
    s2 = s + 0.5 * xs / x.sum(1, keepdim=True).clamp(min=1e-30)
    # Degenerate data (b = 0 or c = 0) leaves zeros: lift them to a unit interior point.
    x2 = torch.where(x2 > 0, x2, 1.0)
    s2 = torch.where(s2 > 0, s2, 1.0)
    return torch.stack([x2, s2], 1), y


def solve_lp(
    c: torch.Tensor,
    A: torch.Tensor,
    b: torch.Tensor,
    *,
    tol: float = 1e-8,
    max_iter: int = 50,
    step_frac: float = 0.99,
) -> LPResult:
    """Solve ``min c^T x, A x = b, x >= 0`` for a batch: c [B, N], A [B, M, N], b [B, M].

    ``A`` must have full row rank for every instance (a tiny diagonal shift guards round-off).
    Computation is in the inputs' dtype (float64 recommended) on their device. Residuals are
    measured relative to ``1 + max|b|`` and ``1 + max|c|``, the gap x^T s relative to their
    product.
    """
    if A.dim() != 3:
        raise ValueError(f"A must have shape [batch, rows, columns], got {list(A.shape)}")
    nb, m, n = A.shape
    for name, t, shape in (("c", c, (nb, n)), ("b", b, (nb, m))):
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)} to match A {list(A.shape)}, got {list(t.shape)}")
    if not (A.dtype.is_floating_point and b.dtype == A.dtype and c.dtype == A.dtype):
        raise TypeError(f"c, A and b must share one floating dtype, got {c.dtype}, {A.dtype}, {b.dtype}")
    if m > n:
        raise ValueError(f"A has more rows ({m}) than columns ({n}); it cannot have full row rank")
    At = A.mT
    b3, c3 = b.unsqueeze(-1), c.unsqueeze(-1)
    shift = torch.eye(m, dtype=A.dtype, device=A.device) * (torch.finfo(A.dtype).eps * 64)
    # One scale per residual entry: primal rows by 1 + max|b|, dual rows by 1 + max|c|, the
    # gap x^T s by the product of both (the objective's scale).
    bs = 1.0 + b3.abs().amax(1, keepdim=True)
    cs = 1.0 + c3.abs().amax(1, keepdim=True)
    inv_scale = torch.cat([bs.expand(nb, m, 1), cs.expand(nb, n, 1), bs * cs], 1).reciprocal()
    Z, y = _mehrotra_start(A, At, b3, c3, shift)  # Z[:, 0] = x, Z[:, 1] = s, each [B, N, 1]
    frac = torch.full((nb, 1, 1, 1), step_frac, dtype=A.dtype, device=A.device)
    it = 0
    # Every line below is one or two batched operations: on small LPs their count, not their
    # size, sets the time, so the iteration is written to keep that count low.
    while True:
        x, s = Z.unbind(1)
        rp = torch.baddbmm(b3, A, x, alpha=-1)  # b - A x
        cy = torch.baddbmm(c3, At, y, alpha=-1)  # c - A^T y
        rd = cy - s
        xs = x * s
        err = (torch.cat([rp, rd, xs.sum(1, keepdim=True)], 1) * inv_scale).abs().amax(1).squeeze(1)
        done = err <= tol  # NaN counts as not converged
        if it >= max_iter or bool(done.all()):
            break
        it += 1
        step = torch.where(done.view(nb, 1, 1, 1), 0.0, frac)
        mu = xs.mean(1, keepdim=True)
        d = x / s
        AD = A * d.mT
        L, _ = torch.linalg.cholesky_ex(torch.baddbmm(shift, AD, At))
        # Newton system: (A D A^T) dy = rp + A D r, dx = D (A^T dy - r), ds = (rxs - s dx) / x,
        # with r = rd - rxs / x. Predictor (affine scaling): rxs = -x s, so r = c - A^T y.
        dy = torch.cholesky_solve(torch.baddbmm(rp, AD, cy), L)
        dx = d * torch.baddbmm(cy, At, dy, beta=-1)
        ds = torch.addcdiv(s, dx, d).neg_()
        dZ = torch.stack([dx, ds], 1)
        mu_aff = torch.addcmul(Z, _max_step(Z, dZ), dZ).prod(1).mean(1, keepdim=True)
        sigma_mu = (mu_aff / mu).pow_(3).mul_(mu)
        # Corrector: centring plus the predictor's second-order term.
        rxs = torch.addcmul(sigma_mu - xs, dx, ds, value=-1)
        r = torch.addcdiv(rd, rxs, x, value=-1)
        dy = torch.cholesky_solve(torch.baddbmm(rp, AD, r), L)
        dx = d * torch.baddbmm(r, At, dy, beta=-1)
        ds = torch.addcmul(rxs, s, dx, value=-1).div_(x)
        dZ = torch.stack([dx, ds], 1)
        alpha = _max_step(Z, dZ).mul_(step)
        Z = torch.addcmul(Z, alpha, dZ)
        y = torch.addcmul(y, alpha[:, 1], dy)
    x = Z[:, 0, :, 0]
    return LPResult(x, y[..., 0], (c * x).sum(1), (b3 * y).sum(1)[:, 0], err, done, it)


# ------------------------------------------------------------------- the LPLB balancing LP
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


def solve_box_lp(
    M: torch.Tensor,
    h: torch.Tensor,
    c: torch.Tensor | None = None,
    *,
    tol: float = 1e-8,
    max_iter: int = 50,
    step_frac: float = 0.9999,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Solve ``min_q max_i (h + M q)_i + c^T q  s.t.  0 <= q <= 1`` for a batch: M [B, m, n], h [B, m].

    A primal-dual interior-point method (Mehrotra's predictor-corrector) on the compact form

        min z + c^T q   s.t.   z - M q - s = h,   s >= 0,   0 <= q <= 1,

    with multipliers y >= 0 of the rows (sum y = 1), u >= 0 of q >= 0 and v >= 0 of q <= 1. The
    start is strictly feasible (q = 1/2, z above the largest load, u - v = c + M^T y) and Newton
    steps keep every linear constraint, so only the complementarity gap
    ``q u + (1 - q) v + s y`` (= primal minus dual objective) is left to drive to zero. Eliminating
    the bounds leaves an m x m normal matrix ``M Theta^-1 M^T + diag(s / y)``, inverted once per
    iteration (batched Cholesky) and shared by the predictor and the corrector. Pairs are packed as
    X = [q, 1 - q, y] and Z = [u, v, s] so that each step is a handful of batched operations.

    Returns (q [B, n], y [B, m], gap [B], iterations). An instance is converged when its gap is
    <= ``tol`` (absolute: scale the data so that loads are O(1)); converged instances are frozen.
    """
    return _compiled(_box_ipm)(M, h, c, tol, max_iter, step_frac)


def _box_ipm(
    M: torch.Tensor, h: torch.Tensor, c: Optional[torch.Tensor], tol: float, max_iter: int, step_frac: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """:func:`solve_box_lp`'s start and iterations (scriptable)."""
    B, m, n = M.shape
    Mt = M.mT
    # Strictly feasible start from the even split.
    y = torch.full((B, m, 1), 1.0 / m, dtype=M.dtype, device=M.device)
    half = torch.full((B, n, 1), 0.5, dtype=M.dtype, device=M.device)
    load = torch.baddbmm(h.unsqueeze(2), M, half)
    s = (load.amax(1, keepdim=True) + 0.1) - load
    dual = torch.bmm(Mt, y)  # u - v
    if c is not None:
        dual = dual + c.unsqueeze(2)
    margin = 2 * (y * s).mean(1, keepdim=True)
    X = torch.cat([half, half, y], 1)
    Z = torch.cat([dual.clamp(min=0) + margin, margin - dual.clamp(max=0), s], 1)
    V, gap, it = _iterate(torch.stack([X, Z], 1), M, tol, max_iter, step_frac)
    X = V[:, 0, :, 0]
    gap = gap.view(B)
    return X[:, :n], X[:, 2 * n :], torch.where(torch.isnan(gap), torch.inf, gap), it


def _newton(
    rc: torch.Tensor, V: torch.Tensor, X: torch.Tensor, Z: torch.Tensor, M: torch.Tensor, MT: torch.Tensor,
    Ti: torch.Tensor, Kinv: torch.Tensor, k1: torch.Tensor, den: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dV, largest step <= 1 keeping V >= 0) of :func:`solve_box_lp` for complementarity rhs rc."""
    n = M.shape[2]
    a = rc / X
    rq = a[:, :n] - a[:, n : 2 * n]
    krho = torch.bmm(Kinv, torch.baddbmm(a[:, 2 * n :], MT, rq))
    dy = torch.addcmul(krho, krho.sum(1, keepdim=True) / den, k1, value=-1)
    dq = torch.baddbmm(rq, M.mT, dy, alpha=-1).mul_(Ti)
    dX = torch.cat([dq, -dq, dy], 1)
    dV = torch.stack([dX, torch.addcmul(rc, Z, dX, value=-1).div_(X)], 1)
    return dV, torch.div(-1.0, (dV / V).amin((1, 2), keepdim=True).clamp_(max=-1.0))


def _iterate(V: torch.Tensor, M: torch.Tensor, tol: float, max_iter: int, step_frac: float) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The iterations of :func:`solve_box_lp` from the packed start V = [X, Z] [B, 2, N, 1]."""
    B, m, n = M.shape
    N = 2 * n + m
    Mt = M.mT
    eye = torch.eye(m, dtype=M.dtype, device=M.device).expand(B, m, m)
    it = 0
    X, Z = V.unbind(1)
    XZ = X * Z
    gap = XZ.sum(1, keepdim=True)  # [B, 1, 1]
    active = gap > tol  # NaN counts as converged here and is rejected by the caller's checks
    while it < max_iter and bool(active.any()):
        it += 1
        R = Z / X
        Ti = (R[:, :n] + R[:, n : 2 * n]).reciprocal_()  # Theta^-1 = 1 / (u/q + v/(1-q))
        MT = M * Ti.mT
        K = torch.baddbmm(torch.diag_embed(R[:, 2 * n :, 0]), MT, Mt)
        # Near the optimum K is singular along the constraint 1^T dy = 0 (binding rows have
        # s / y -> 0); adding kappa 1 1^T changes nothing on that subspace and keeps K well
        # conditioned. kappa: K's mean diagonal, a tiny floor for all-zero data.
        K = K + K.diagonal(0, 1, 2).mean(1, keepdim=True).unsqueeze(2).clamp_(min=1e-12)
        # K^-1 = L^-T L^-1: one triangular solve against I and one product are cheaper on small
        # batches than cholesky_inverse or cholesky_solve, and serve both right-hand sides.
        Linv = torch.linalg.solve_triangular(torch.linalg.cholesky_ex(K)[0], eye, upper=False)
        Kinv = torch.bmm(Linv.mT, Linv)
        k1 = Kinv.sum(2, keepdim=True)
        den = k1.sum(1, keepdim=True)
        # Predictor (affine scaling), then the corrector with Mehrotra's centring and
        # second-order term.
        dV, alpha = _newton(-XZ, V, X, Z, M, MT, Ti, Kinv, k1, den)
        mu_aff = torch.addcmul(V, alpha, dV).prod(1).sum(1, keepdim=True)  # N times the mean
        sigma_mu = (mu_aff / gap).pow_(3).mul_(gap).div_(N)
        dV, alpha = _newton(torch.sub(sigma_mu, XZ).sub_(dV.prod(1)), V, X, Z, M, MT, Ti, Kinv, k1, den)
        V = torch.addcmul(V, alpha.mul_(active.unsqueeze(1)).mul_(step_frac), dV)
        X, Z = V.unbind(1)
        XZ = X * Z
        gap = XZ.sum(1, keepdim=True)
        active = gap > tol
    return V, gap, it


@functools.lru_cache(maxsize=None)
def _compiled(fn: Callable) -> Callable:
    """``fn`` compiled by TorchScript when available: the solver is a few hundred tiny tensor
    operations, and the script interpreter dispatches each at about half eager Python's cost.
    Same operations, same results; plain Python where scripting is unavailable."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script is deprecated in favour of torch.compile
            return torch.jit.script(fn)
    except Exception:  # scripting is an optimisation only
        return fn


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
