"""Batched primal-dual interior-point LP solver in torch, and LPLB's balancing LP built on it.

:func:`solve_lp` solves ``B`` independent standard-form LPs at once,

    minimise c^T x   subject to   A x = b,   x >= 0,

with Mehrotra's predictor-corrector method: one batched Cholesky factorisation of the normal
matrix ``A D A^T`` per iteration, shared by the predictor and the corrector. It runs on the
device of its inputs, stops when every instance meets the tolerance (primal residual, dual
residual and complementarity gap, relative to the data's scale) or at the iteration cap, and
freezes converged instances while the others go on. Small problems are dominated by per-call
overhead, so an iteration is a few dozen batched tensor operations regardless of the batch size.

:func:`solve_balance` builds the LPLB LP of every group of a batch (REFERENCE.md: minimise the
largest rank load when each replicated class may move a share of its tokens to its copy),
solves them in one call, checks each solution, and replaces a failed one by the even split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LPResult", "solve_lp", "BalanceResult", "BalanceLP", "balance_lp", "solve_balance", "rank_loads"]


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
    """The LPLB LP of ``n_groups`` groups sharing one topology, in standard form, ready to solve.

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
        self.half = torch.full((n_groups, g, d), 0.5, dtype=dtype, device=dev)

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
        accept_rtol: float = 1e-6,
    ) -> BalanceResult:
        """Plan every group: fixed [G, g] loads, replicated [G, g, d] class loads (any real dtype).

        Loads are normalised per group (largest rank load before moving = 1). A group's
        solution is accepted when the solver converged, the shares are finite and in [0, 1],
        and the loads they give are within ``accept_rtol`` of the LP's dual bound and no worse
        than the even split. A rejected group gets the even split (keep = 1/2).
        """
        G, g, d = self.n_groups, self.g, self.d
        if tuple(fixed.shape) != (G, g) or tuple(replicated.shape) != (G, g, d):
            raise ValueError(
                f"loads must be fixed [{G}, {g}] and replicated [{G}, {g}, {d}], got {list(fixed.shape)} and {list(replicated.shape)}"
            )
        out_dtype = replicated.dtype if replicated.dtype.is_floating_point else self.dtype
        F = fixed.to(self.dtype)
        W = replicated.to(self.dtype)
        scale = (F + W.sum(2)).amax(1, keepdim=True).clamp_(min=1e-30)
        Fn, Wn = F / scale, W / scale.unsqueeze(2)
        res = solve_lp(*self.build(Fn, Wn), tol=tol, max_iter=max_iter)
        q = res.x[:, : g * d].reshape(G, g, d)
        sane = (torch.isfinite(q) & (q >= -1e-6) & (q <= 1 + 1e-6)).flatten(1).all(1)
        keep = (1 - q).nan_to_num_(0.5).clamp_(0, 1)
        both = rank_loads(Fn.repeat(2, 1), Wn.repeat(2, 1, 1), torch.cat([keep, self.half]), self.r2o).amax(1)
        achieved, even = both[:G], both[G:]
        bound = res.dual_objective
        ok = res.converged & sane & (achieved <= bound + accept_rtol) & (achieved <= even + accept_rtol)
        keep = torch.where(ok.view(G, 1, 1), keep, self.half)
        objective = torch.where(ok, achieved, even) * scale.squeeze(1)
        return BalanceResult(keep.to(out_dtype), objective.to(out_dtype), (bound * scale.squeeze(1)).to(out_dtype), ok, res.iterations)


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
    accept_rtol: float = 1e-6,
    dtype: torch.dtype = torch.float64,
) -> BalanceResult:
    """One-off :meth:`BalanceLP.solve`: fixed [G, g] loads, replicated [G, g, d], r2o [g, d]."""
    lp = BalanceLP(r2o, replicated.shape[0], dtype=dtype, device=replicated.device)
    return lp.solve(fixed, replicated, tol=tol, max_iter=max_iter, accept_rtol=accept_rtol)
