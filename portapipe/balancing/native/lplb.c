/* LPLB's fused CPU kernels: token counting, index mapping and the balancing LP of every group.
 *
 * Plain C99 without torch headers, compiled on first use by portapipe/balancing/lplb_native.py
 * and called through ctypes on the data of contiguous CPU tensors. Each function is the CPU
 * counterpart of a torch path that stays the portable implementation:
 *   lplb_count_*  <-> torch.bincount(flat + 1), the -1 bin apart     (lplb.Planner._bincount)
 *   lplb_map_*    <-> the stable-sort mapping                       (lplb.Planner._map_sorted)
 *   lplb_balance  <-> lp_balance._balance, lp_solver._box_ipm / _iterate (same formulation, start,
 *                     iterations, stopping rule and acceptance checks; see lp_balance.py)
 *   lplb_plan     <-> lplb.Planner._plan_torch                     (group loads, the LPs, the
 *                     fixed-point rounding; optionally the mapping in the same call)
 * Sizes come from the arguments, so every topology works. Every index read from an argument is
 * range-checked before it is used to address memory.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ counting and mapping */

/* out[e] = entries of expert e (out has n_experts slots, e.g. a row of the plan's counts matrix:
 * no copy between count and plan), *dropped = entries equal to -1 unless dropped is NULL.
 * Returns the position of the first entry outside [-1, n_experts), or -1 when all are valid.
 * Four interleaved 32-bit histograms: consecutive entries of one expert would otherwise wait
 * on each other's increment (a store-to-load chain through one counter); the blocks are
 * checked before they are counted, so a bad block is rescanned by the plain loop for its
 * position. Falls back to the plain loop when n does not fit 32-bit counters or no scratch. */
#define LPLB_COUNT(NAME, T)                                                                  \
    int64_t NAME(const T *idx, int64_t n, int64_t n_experts, int64_t *out, int64_t *dropped) { \
        memset(out, 0, (size_t)n_experts * sizeof(int64_t));                                 \
        int64_t minus = 0;                                                                   \
        const uint64_t top = (uint64_t)n_experts;                                            \
        int64_t j = 0;                                                                       \
        uint32_t *h = n < INT32_MAX ? (uint32_t *)calloc((size_t)(4 * (n_experts + 1)), 4) : NULL; \
        if (h != NULL) {                                                                     \
            uint32_t *h1 = h + (n_experts + 1), *h2 = h1 + (n_experts + 1), *h3 = h2 + (n_experts + 1); \
            for (; j + 4 <= n; j += 4) {                                                     \
                uint64_t a = (uint64_t)((int64_t)idx[j] + 1), b = (uint64_t)((int64_t)idx[j + 1] + 1); \
                uint64_t c = (uint64_t)((int64_t)idx[j + 2] + 1), d = (uint64_t)((int64_t)idx[j + 3] + 1); \
                if ((a > top) | (b > top) | (c > top) | (d > top)) break;                    \
                ++h[a];                                                                      \
                ++h1[b];                                                                     \
                ++h2[c];                                                                     \
                ++h3[d];                                                                     \
            }                                                                                \
            minus = (int64_t)h[0] + (int64_t)h1[0] + (int64_t)h2[0] + (int64_t)h3[0];        \
            for (int64_t e = 1; e <= n_experts; ++e)                                         \
                out[e - 1] = (int64_t)h[e] + (int64_t)h1[e] + (int64_t)h2[e] + (int64_t)h3[e]; \
            free(h);                                                                         \
        }                                                                                    \
        for (; j < n; ++j) {                                                                 \
            int64_t e = (int64_t)idx[j];                                                     \
            if (e < -1 || e >= n_experts) return j;                                          \
            if (e < 0)                                                                       \
                ++minus;                                                                     \
            else                                                                             \
                ++out[e];                                                                    \
        }                                                                                    \
        if (dropped != NULL) *dropped = minus;                                               \
        return -1;                                                                           \
    }

/* Entry j of expert e goes to orig[e] when fewer than stay[e] earlier entries have expert e,
 * else to copy[e]; -1 stays -1. Returns 0; 1 when the per-expert state cannot be allocated,
 * 2 at an entry outside [-1, n_experts) (lplb_count reports which).
 * Branch-free: each expert counts down from stay[e], and the sign of what is left picks the
 * slot from a two-entry table (past a replicated expert's kept count the choice follows the
 * random order of experts, which a branch would mispredict). Row 0 of the table stands for -1
 * (both slots -1, a count that never runs out), so a dropped entry takes the same path; a
 * block of four entries is range-checked with one test, as in lplb_count. */
#define LPLB_MAP(NAME, T)                                                                    \
    int NAME(const T *idx, int64_t n, int64_t n_experts, const int64_t *stay,                \
             const int64_t *orig, const int64_t *copy, T *out) {                             \
        struct row { int64_t left; T slot[2]; };                                             \
        struct row *t = (struct row *)malloc((size_t)(n_experts + 1) * sizeof(struct row));  \
        if (t == NULL) return 1;                                                             \
        t[0].left = INT64_MAX;                                                               \
        t[0].slot[0] = t[0].slot[1] = (T)-1;                                                 \
        for (int64_t e = 0; e < n_experts; ++e) {                                            \
            t[e + 1].left = stay[e];                                                         \
            t[e + 1].slot[0] = (T)orig[e];                                                   \
            t[e + 1].slot[1] = (T)copy[e];                                                   \
        }                                                                                    \
        const uint64_t top = (uint64_t)n_experts;                                            \
        int64_t j = 0;                                                                       \
        for (; j + 4 <= n; j += 4) {                                                         \
            uint64_t a = (uint64_t)((int64_t)idx[j] + 1), b = (uint64_t)((int64_t)idx[j + 1] + 1); \
            uint64_t c = (uint64_t)((int64_t)idx[j + 2] + 1), d = (uint64_t)((int64_t)idx[j + 3] + 1); \
            if ((a > top) | (b > top) | (c > top) | (d > top)) break;                        \
            /* after the decrement, a negative count (sign bit 1) picks the copy */          \
            out[j] = t[a].slot[(uint64_t)(--t[a].left) >> 63];                               \
            out[j + 1] = t[b].slot[(uint64_t)(--t[b].left) >> 63];                           \
            out[j + 2] = t[c].slot[(uint64_t)(--t[c].left) >> 63];                           \
            out[j + 3] = t[d].slot[(uint64_t)(--t[d].left) >> 63];                           \
        }                                                                                    \
        for (; j < n; ++j) {                                                                 \
            uint64_t a = (uint64_t)((int64_t)idx[j] + 1);                                    \
            if (a > top) {                                                                   \
                free(t);                                                                     \
                return 2;                                                                    \
            }                                                                                \
            out[j] = t[a].slot[(uint64_t)(--t[a].left) >> 63];                               \
        }                                                                                    \
        free(t);                                                                             \
        return 0;                                                                            \
    }

LPLB_COUNT(lplb_count_i32, int32_t)
LPLB_COUNT(lplb_count_i64, int64_t)
LPLB_MAP(lplb_map_i32, int32_t)
LPLB_MAP(lplb_map_i64, int64_t)

/* ------------------------------------------------------------------------ the balancing LP */

/* One group's LP data and solver state. Column j = (rank j / d, class j % d) moves a share q_j
 * of wn_j from its owner to holder[j]; loads are h + M q with M[own, j] = -wn_j and
 * M[holder, j] = +wn_j, so M is applied column by column instead of as a dense matrix. */
typedef struct {
    int64_t m, n, d, N;
    const int64_t *holder;
    int64_t *own;  /* j / d, tabulated: a division per use would cost more than the arithmetic */
    double move_cost;
    double *h, *wn, *X, *Z, *iX, *dX, *dZ, *a, *rq, *Ti, *K, *k1, *rho, *inv;
} Box;

static int64_t own_of(const Box *b, int64_t j) { return b->own[j]; }

/* out = h + M q for shares q (n entries). */
static void loads(const Box *b, const double *q, double *out) {
    memcpy(out, b->h, (size_t)b->m * sizeof(double));
    for (int64_t j = 0; j < b->n; ++j) {
        double v = b->wn[j] * q[j];
        out[own_of(b, j)] -= v;
        out[b->holder[j]] += v;
    }
}

static double max_of(const double *v, int64_t len) {
    double best = v[0];
    for (int64_t i = 1; i < len; ++i)
        if (v[i] > best) best = v[i];
    return best;
}

/* In-place Cholesky K = L L^T (lower triangle of the row-major m x m K), with the reciprocals
 * of L's diagonal in inv (the solves multiply by them: a division per row on the critical path
 * of these tiny triangular solves would dominate). 0 when K is not numerically positive definite. */
static int cholesky(double *K, int64_t m, double *inv) {
    for (int64_t j = 0; j < m; ++j) {
        double s = K[j * m + j];
        for (int64_t k = 0; k < j; ++k) s -= K[j * m + k] * K[j * m + k];
        if (!(s > 0.0) || !isfinite(s)) return 0;
        double l = sqrt(s);
        K[j * m + j] = l;
        inv[j] = 1.0 / l;
        for (int64_t i = j + 1; i < m; ++i) {
            double t = K[i * m + j];
            for (int64_t k = 0; k < j; ++k) t -= K[i * m + k] * K[j * m + k];
            K[i * m + j] = t * inv[j];
        }
    }
    return 1;
}

/* x <- K^-1 x with K's Cholesky factor L and inv = 1 / diag(L). */
static void chol_solve(const double *L, const double *inv, int64_t m, double *x) {
    for (int64_t i = 0; i < m; ++i) {
        double t = x[i];
        for (int64_t k = 0; k < i; ++k) t -= L[i * m + k] * x[k];
        x[i] = t * inv[i];
    }
    for (int64_t i = m - 1; i >= 0; --i) {
        double t = x[i];
        for (int64_t k = i + 1; k < m; ++k) t -= L[k * m + i] * x[k];
        x[i] = t * inv[i];
    }
}

/* The Newton direction for complementarity right-hand side rc (lp_solver._newton): fills
 * dX, dZ and returns the largest step <= 1 that keeps X, Z >= 0. V = [X, Z] with
 * X = [q, 1 - q, y], Z = [u, v, s]; iX = 1 / X (divisions dominate otherwise),
 * Ti, K (factored), k1 = K^-1 1 and den = 1^T k1 are the iteration's. */
static double newton(Box *b, const double *rc, double den) {
    int64_t m = b->m, n = b->n, N = b->N;
    const double *X = b->X, *Z = b->Z, *iX = b->iX;
    double *a = b->a, *rq = b->rq, *rho = b->rho, *dX = b->dX, *dZ = b->dZ;
    for (int64_t j = 0; j < N; ++j) a[j] = rc[j] * iX[j];
    for (int64_t i = 0; i < m; ++i) rho[i] = a[2 * n + i];
    for (int64_t j = 0; j < n; ++j) {
        rq[j] = a[j] - a[n + j];
        double v = b->wn[j] * b->Ti[j] * rq[j];  /* (M Theta^-1 rq) column by column */
        rho[own_of(b, j)] -= v;
        rho[b->holder[j]] += v;
    }
    chol_solve(b->K, b->inv, m, rho);
    double shift = 0.0;
    for (int64_t i = 0; i < m; ++i) shift += rho[i];
    shift /= den;
    double *dy = dX + 2 * n;
    for (int64_t i = 0; i < m; ++i) dy[i] = rho[i] - shift * b->k1[i];
    for (int64_t j = 0; j < n; ++j) {
        double mty = b->wn[j] * (dy[b->holder[j]] - dy[own_of(b, j)]);
        dX[j] = (rq[j] - mty) * b->Ti[j];
        dX[n + j] = -dX[j];
    }
    /* The step: -1 / min(-1, min(dV / V)) as in lp_solver._newton. */
    double lowest = -1.0;
    for (int64_t j = 0; j < N; ++j) {
        dZ[j] = (rc[j] - Z[j] * dX[j]) * iX[j];
        /* dV / V < lowest, tested as dV < lowest * V (V > 0): a division only on a new low */
        if (dX[j] < lowest * X[j]) lowest = dX[j] * iX[j];
        if (dZ[j] < lowest * Z[j]) lowest = dZ[j] / Z[j];
        if (isnan(dX[j]) || isnan(dZ[j])) return NAN;
    }
    return -1.0 / lowest;
}

/* Mehrotra's predictor-corrector from the feasible start (lp_solver._box_ipm / _iterate).
 * Returns the iterations run; *gap is the final complementarity gap (inf after a failed
 * factorisation or a NaN). */
static int64_t box_ipm(Box *b, double tol, int64_t max_iter, double step_frac, double *gap_out) {
    int64_t m = b->m, n = b->n, N = b->N;
    double *X = b->X, *Z = b->Z, *dX = b->dX, *dZ = b->dZ;
    double *q = X, *y = X + 2 * n, *s = Z + 2 * n;
    /* Strictly feasible start from the even split. */
    for (int64_t j = 0; j < n; ++j) q[j] = X[n + j] = 0.5;
    for (int64_t i = 0; i < m; ++i) y[i] = 1.0 / (double)m;
    loads(b, q, s);
    double top = max_of(s, m) + 0.1, margin = 0.0;
    for (int64_t i = 0; i < m; ++i) {
        s[i] = top - s[i];
        margin += y[i] * s[i];
    }
    margin = 2.0 * margin / (double)m;
    for (int64_t j = 0; j < n; ++j) {
        double dual = b->wn[j] * (y[b->holder[j]] - y[own_of(b, j)]) + b->move_cost * b->wn[j];
        Z[j] = (dual > 0 ? dual : 0.0) + margin;
        Z[n + j] = margin - (dual < 0 ? dual : 0.0);
    }
    double *rc = b->a + N;  /* the a buffer has room for two N-vectors */
    double gap = 0.0;
    for (int64_t j = 0; j < N; ++j) gap += X[j] * Z[j];
    int64_t it = 0;
    while (it < max_iter && gap > tol) {  /* a NaN gap stops here and fails the checks */
        ++it;
        double *K = b->K;
        for (int64_t j = 0; j < N; ++j) {
            b->iX[j] = 1.0 / X[j];
        }
        memset(K, 0, (size_t)(m * m) * sizeof(double));
        for (int64_t i = 0; i < m; ++i) K[i * m + i] = Z[2 * n + i] * b->iX[2 * n + i];
        for (int64_t j = 0; j < n; ++j) {
            b->Ti[j] = 1.0 / (Z[j] * b->iX[j] + Z[n + j] * b->iX[n + j]);
            double t = b->Ti[j] * b->wn[j] * b->wn[j];
            int64_t o = own_of(b, j), h = b->holder[j];
            K[o * m + o] += t;
            K[h * m + h] += t;
            K[o * m + h] -= t;
            K[h * m + o] -= t;
        }
        /* K is singular along 1^T dy = 0 near the optimum; kappa 1 1^T (kappa: the mean
         * diagonal) leaves that subspace alone and keeps the factorisation stable. */
        double kappa = 0.0;
        for (int64_t i = 0; i < m; ++i) kappa += K[i * m + i];
        kappa /= (double)m;
        if (kappa < 1e-12) kappa = 1e-12;
        for (int64_t i = 0; i < m * m; ++i) K[i] += kappa;
        if (!cholesky(K, m, b->inv)) {
            gap = INFINITY;
            break;
        }
        double den = 0.0;
        for (int64_t i = 0; i < m; ++i) b->k1[i] = 1.0;
        chol_solve(K, b->inv, m, b->k1);
        for (int64_t i = 0; i < m; ++i) den += b->k1[i];
        /* Predictor (affine scaling). */
        for (int64_t j = 0; j < N; ++j) rc[j] = -X[j] * Z[j];
        double alpha = newton(b, rc, den);
        double mu_aff = 0.0;
        for (int64_t j = 0; j < N; ++j) mu_aff += (X[j] + alpha * dX[j]) * (Z[j] + alpha * dZ[j]);
        double ratio = mu_aff / gap;
        double sigma_mu = ratio * ratio * ratio * gap / (double)N;
        /* Corrector: Mehrotra's centring and the predictor's second-order term. */
        for (int64_t j = 0; j < N; ++j) rc[j] = sigma_mu - X[j] * Z[j] - dX[j] * dZ[j];
        alpha = newton(b, rc, den) * step_frac;
        gap = 0.0;
        for (int64_t j = 0; j < N; ++j) {
            X[j] += alpha * dX[j];
            Z[j] += alpha * dZ[j];
            gap += X[j] * Z[j];
        }
    }
    *gap_out = isnan(gap) ? INFINITY : gap;
    return it;
}

/* Plans G groups of m ranks with d classes (n = m * d columns): fixed [G, m], w [G, n] loads
 * (float64), holder [n] the rank hosting column j's copy. Writes keep [G, n], objective [G],
 * bound [G] (in the loads' units) and accepted [G]; returns the iterations of the slowest group,
 * -1 when out of memory, -2 when holder names a rank outside [0, m). Same normalisation, start, iterations and acceptance checks as
 * lp_balance._balance: a group is accepted when it converged, its shares are finite and in
 * [0, 1], and its loads are within accept_rtol of the certified lower bound and no worse than
 * the even split; otherwise it gets the even split (keep = 1/2). */
int64_t lplb_balance(int64_t G, int64_t m, int64_t d, const int64_t *holder, const double *fixed,
                     const double *w, double move_cost, double tol, int64_t max_iter,
                     double accept_rtol, double step_frac, double *keep, double *objective,
                     double *bound, uint8_t *accepted) {
    int64_t n = m * d, N = 2 * n + m;
    for (int64_t j = 0; j < n; ++j)
        if (holder[j] < 0 || holder[j] >= m) return -2;
    /* h, load, even [m]; wn, Ti, rq [n]; X, Z, iX, dX, dZ [N]; a and rc [2N]; K [m*m];
     * k1, rho, inv [m]. */
    size_t words = (size_t)(6 * m + 3 * n + 7 * N + m * m);
    double *ws = (double *)malloc(words * sizeof(double));
    int64_t *own = (int64_t *)malloc((size_t)(n > 0 ? n : 1) * sizeof(int64_t));
    if (ws == NULL || own == NULL) {
        free(ws);
        free(own);
        return -1;
    }
    for (int64_t j = 0; j < n; ++j) own[j] = j / d;
    Box b = {.m = m, .n = n, .d = d, .N = N, .holder = holder, .own = own, .move_cost = move_cost};
    double *load = ws, *even = load + m;
    b.h = even + m;
    b.wn = b.h + m;
    b.Ti = b.wn + n;
    b.rq = b.Ti + n;
    b.X = b.rq + n;
    b.Z = b.X + N;
    b.iX = b.Z + N;
    b.dX = b.iX + N;
    b.dZ = b.dX + N;
    b.a = b.dZ + N;
    b.K = b.a + 2 * N;
    b.k1 = b.K + m * m;
    b.rho = b.k1 + m;
    b.inv = b.rho + m;
    int64_t iterations = 0;
    for (int64_t gi = 0; gi < G; ++gi) {
        const double *F = fixed + gi * m, *W = w + gi * n;
        double scale = 0.0;
        for (int64_t i = 0; i < m; ++i) {
            double rep = 0.0;
            for (int64_t k = 0; k < d; ++k) rep += W[i * d + k];
            b.h[i] = F[i] + rep;
            if (i == 0 || b.h[i] > scale) scale = b.h[i];
        }
        if (!(scale >= 1e-30)) scale = 1e-30;  /* clamp(min=1e-30) */
        for (int64_t i = 0; i < m; ++i) b.h[i] /= scale;
        for (int64_t j = 0; j < n; ++j) b.wn[j] = W[j] / scale;
        double err;
        int64_t it = box_ipm(&b, tol, max_iter, step_frac, &err);
        if (it > iterations) iterations = it;
        /* Checks: the loads of the solution and of the even split, and the lower bound
         * y^T h + sum_j min(0, (M^T y + c)_j) for y normalised to sum 1 (valid for every q). */
        const double *q = b.X, *y = b.X + 2 * n;
        double *half = b.rq;
        for (int64_t j = 0; j < n; ++j) half[j] = 0.5;
        loads(&b, q, load);
        loads(&b, half, even);
        double achieved = max_of(load, m), even_max = max_of(even, m);
        double ysum = 0.0, lower = 0.0, cost = 0.0;
        for (int64_t i = 0; i < m; ++i) ysum += y[i];
        for (int64_t i = 0; i < m; ++i) lower += y[i] / ysum * b.h[i];
        int sane = 1;
        for (int64_t j = 0; j < n; ++j) {
            double c = move_cost * b.wn[j];
            double mty = b.wn[j] * (y[holder[j]] / ysum - y[own_of(&b, j)] / ysum) + c;
            if (mty < 0) lower += mty;
            cost += c * q[j];
            if (!(isfinite(q[j]) && q[j] >= -1e-6 && q[j] <= 1 + 1e-6)) sane = 0;
        }
        int ok = err <= tol && sane && achieved + cost <= lower + accept_rtol &&
                 achieved <= even_max + accept_rtol;
        for (int64_t j = 0; j < n; ++j) {
            double k = 1.0 - q[j];
            keep[gi * n + j] = ok ? (k < 0 ? 0.0 : (k > 1 ? 1.0 : k)) : 0.5;
        }
        objective[gi] = (ok ? achieved : even_max) * scale;
        bound[gi] = lower * scale;
        accepted[gi] = (uint8_t)ok;
    }
    free(ws);
    free(own);
    return iterations;
}

/* ----------------------------------------------------------------------------- the plan */

/* What stays fixed between batches of one placement (lplb_native.PlanCall binds it once):
 * E experts, G groups of m ranks with d classes (n = m * d LP columns), P physical slots,
 * per_rank of them on each EP rank; the solver's settings; and the layout maps: rank_of [E],
 * lp_slot [E] (-1 for experts without a copy), orig [E], copy [E] (-1 when none), holder [n]. */
typedef struct {
    int64_t E, G, m, d, max_iter, frac_bits, P, per_rank;
    double tol, accept_rtol, step_frac;
    const int64_t *rank_of, *lp_slot, *orig, *copy, *holder;
} PlanLayout;

/* One batch's plan from per-source counts [S, E] (lplb.Planner.plan): each rank's loads of
 * non-replicated experts (by rank_of) and of its replicated originals per class (by lp_slot),
 * the group LPs by lplb_balance, then per expert the moved share in fixed point (frac_bits
 * fraction bits, rounded half to even) and cumulative rounding over the sources, so the
 * per-source integers add up to the rounded total. Outputs in two buffers: reals = keep [G, n],
 * objective [G], bound [G] (as lplb_balance); ints = moved [S, E], phys [P] (tokens per physical
 * slot), rank_load [P / per_rank]; accepted [G]. When idx is not NULL, also maps source row
 * `source`'s n_idx entries (int32 or int64 as idx_bytes says, counted in that row) into out, as
 * lplb_map_* with stay = counts - moved of that row. Returns the iterations of the slowest group;
 * -1 when out of memory, -2 when source or a layout map points outside its range, -3 at an index
 * outside [-1, E). */
int64_t lplb_plan(const PlanLayout *L, int64_t S, const int64_t *counts, double *reals, int64_t *ints,
                  uint8_t *accepted, const void *idx, int64_t n_idx, int64_t idx_bytes, int64_t source,
                  void *out) {
    const int64_t E = L->E, G = L->G, m = L->m, d = L->d, P = L->P, per_rank = L->per_rank;
    const int64_t *rank_of = L->rank_of, *lp_slot = L->lp_slot, *orig = L->orig, *copy = L->copy;
    int64_t ranks = G * m, n = m * d;
    if (idx != NULL && (source < 0 || source >= S)) return -2;
    for (int64_t e = 0; e < E; ++e)
        if (rank_of[e] < 0 || rank_of[e] >= ranks || lp_slot[e] < -1 || lp_slot[e] >= ranks * d ||
            orig[e] < 0 || orig[e] >= P || copy[e] < -1 || copy[e] >= P)
            return -2;
    double *keep = reals, *objective = reals + G * n, *bound = objective + G;
    int64_t *moved = ints, *phys = ints + S * E, *rank_load = phys + P;
    int64_t *total = (int64_t *)calloc((size_t)(E > 0 ? E : 1), sizeof(int64_t));
    double *fixed = (double *)calloc((size_t)(ranks * (1 + d)), sizeof(double));
    if (total == NULL || fixed == NULL) {
        free(total);
        free(fixed);
        return -1;
    }
    double *rep = fixed + ranks;
    for (int64_t s = 0; s < S; ++s)
        for (int64_t e = 0; e < E; ++e) total[e] += counts[s * E + e];
    for (int64_t e = 0; e < E; ++e) {
        if (lp_slot[e] >= 0)
            rep[lp_slot[e]] += (double)total[e];
        else
            fixed[rank_of[e]] += (double)total[e];
    }
    int64_t iterations = lplb_balance(G, m, d, L->holder, fixed, rep, 0.0, L->tol, L->max_iter, L->accept_rtol,
                                      L->step_frac, keep, objective, bound, accepted);
    if (iterations >= 0) {
        const double one = (double)((int64_t)1 << L->frac_bits);
        const int64_t half = ((int64_t)1 << L->frac_bits) >> 1;
        memset(phys, 0, (size_t)P * sizeof(int64_t));
        for (int64_t e = 0; e < E; ++e) {
            int64_t q = lp_slot[e] >= 0 ? (int64_t)nearbyint((1.0 - keep[lp_slot[e]]) * one) : 0;
            int64_t running = 0, before = 0;
            for (int64_t s = 0; s < S; ++s) {
                running += counts[s * E + e];
                int64_t upto = (running * q + half) >> L->frac_bits;
                moved[s * E + e] = upto - before;
                before = upto;
            }
            phys[orig[e]] += total[e] - before;
            if (copy[e] >= 0) phys[copy[e]] += before;
        }
        for (int64_t r = 0; r * per_rank < P; ++r) {
            int64_t sum = 0;
            for (int64_t t = 0; t < per_rank; ++t) sum += phys[r * per_rank + t];
            rank_load[r] = sum;
        }
        if (idx != NULL) {
            int64_t *stay = total;  /* no longer needed as totals */
            for (int64_t e = 0; e < E; ++e) stay[e] = counts[source * E + e] - moved[source * E + e];
            int failed = idx_bytes == 4
                ? lplb_map_i32((const int32_t *)idx, n_idx, E, stay, orig, copy, (int32_t *)out)
                : lplb_map_i64((const int64_t *)idx, n_idx, E, stay, orig, copy, (int64_t *)out);
            if (failed) iterations = failed == 1 ? -1 : -3;
        }
    }
    free(total);
    free(fixed);
    return iterations;
}
