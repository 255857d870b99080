"""Batched primal-dual interior-point LP solvers in torch.

:func:`solve_lp` solves ``B`` independent standard-form LPs at once,

    minimise c^T x   subject to   A x = b,   x >= 0,

with Mehrotra's predictor-corrector method: one batched Cholesky factorisation of the normal
matrix ``A D A^T`` per iteration, shared by the predictor and the corrector. It runs on the
device of its inputs, stops when every instance meets the tolerance (primal residual, dual
residual and complementarity gap, relative to the data's scale) or at the iteration cap, and
freezes converged instances while the others go on. Small problems are dominated by per-call
overhead, so an iteration is a few dozen batched tensor operations regardless of the batch size.

:func:`solve_box_lp` solves ``min_q max_i (h + M q)_i + c^T q`` over shares ``0 <= q <= 1`` (the
LPLB LP in its compact form: only the shares and the max load are variables; the bounds are
barrier terms, not rows), where the normal matrix is one row per load; it is the same method,
specialised so that an iteration is fewer and smaller operations.
:mod:`~portapipe.balancing.lp_balance` builds LPLB's LPs on both.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

__all__ = ["LPResult", "solve_lp", "solve_box_lp"]


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
