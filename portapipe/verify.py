"""``verify``: one pipelined step against the same step in one process, in the device's precision.

Where the backend declares float64 compute and communication (its
:class:`~portapipe.backends.capabilities.Capabilities`), both sides run in float64 and the
claim is exact (below). Elsewhere the pipelined step runs in float32 on the device and is
compared with a float64 single-process reference on the CPU, within a tolerance derived from
float32 rounding and the model's depth (:func:`float32_tolerance`), printed with the result.
Either way the master weights and the gradients' reduction run in that dtype too: the dtype keys
this changes are named in the result (``changed``).

``precision="model"`` (``portapipe verify --precision model``) checks the run's own dtypes
instead: ``model.dtype`` (bfloat16, float16), the master dtype the gradients accumulate in, the
reduction's dtype and float16's loss scaling, against the float64 reference within a tolerance
derived the same way from each dtype's unit roundoff (:func:`rounding_tolerance`). Routing is
forced by position on both sides there: a top-k choice is discontinuous, and near-ties that a
low-precision forward breaks otherwise than float64 would send tokens to other experts, which no
rounding tolerance bounds (the exact check above covers the routing).

The pipelined step runs on ``pp x dp x ep`` ranks (:func:`portapipe.launch.run_ranks`) with
the configured schedule, overlap and W split; the reference builds the whole model in this
process (same seed, so the same weights), runs every replica's micro-batches through it as one
plain autograd graph each, and seeds each backward with the same 1 / (micro-batches x
replicas). Data are random tokens drawn from the seed per (replica, micro-batch).

Why the loss can match bit for bit: every token's arithmetic is the same in both runs. Each
micro-batch passes through the same shapes (a rank sees exactly one replica's micro-batch),
the expert matmuls are row-independent (``a[rows] @ w``), the SwiGLU activation is written
with position-independent operations, and both sides add the per-micro-batch losses in the
same order (:func:`portapipe.scheduling.executor.mean_loss`). Gradients are sums of the same
terms in different orders (micro-batches, replicas, DualPipe's copies), so they agree to
rounding: ``max_rel_grad_diff`` is the largest ``|g - g_ref| / |g_ref|`` (2-norms) over every
parameter tensor of every rank.

With a balancer (``balancer.kind`` eplb / lplb) an expert may sit in several slots: its replicas
hold the same weights bit for bit and a token's rows are computed row by row, so the loss still
matches exactly; a replicated expert's gradient is the sum of its replicas' partial sums, so it
matches to rounding. Each rank reports the logical expert of every slot (``expert_ids``).

Loss terms recorded inside the stages (the sequence-wise balance loss, multi-token prediction:
:mod:`portapipe.models.objective`) are compared the same way: each term's mean over micro-batches
and replicas equals the reference's bit for bit (``loss_terms_diff``), and the reference seeds them
in its one autograd graph as the pipeline seeds them in each stage's backward.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import Config, ConfigError, config_from_dict
from .data.samples import make_microbatches
from .launch import run_ranks
from .compose import PipelineRuntime, build_model
from .metrics import everywhere
from .models.expert_parallel import ExpertParallel
from .models.routing import ForcedRouting
from .optim.precision import LossScaler, master_dtype, reduce_dtype
from .models.moe import tie_copies
from .scheduling.executor import build_schedule, mean_loss
from .scheduling.overlap import Tape, run
from .scheduling.stage import is_expert

GRAD_TOLERANCE = 1e-12
#: unit roundoff of each dtype (half the distance from 1.0 to the next number): 2^-(mantissa bits + 1)
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOAT32_UNIT_ROUNDOFF = UNIT_ROUNDOFF["float32"]
#: how many typical (random-walk) rounding errors the tolerance allows: measured float32 errors sit
#: 45-65x below it on the test models (docs/backends.md), a pipeline bug lands far above it
FLOAT32_SAFETY = 4.0
#: what ``portapipe verify --precision`` takes: the highest the backend computes in, or the config's own dtypes
PRECISIONS = ("highest", "model")


@dataclass(frozen=True)
class Tolerance:
    """What a verification accepts: relative loss and gradient differences, absolute bias difference."""

    precision: str  # the dtype the pipelined step ran in
    loss: float
    grad: float
    bias: float
    basis: str = ""  # how the figures were derived

    def as_dict(self) -> dict[str, Any]:
        return {"loss": self.loss, "grad": self.grad, "bias": self.bias, "basis": self.basis}


EXACT = Tolerance("float64", 0.0, GRAD_TOLERANCE, 0.0, "float64 on both sides: the loss bit for bit, gradients to summation order")


def rounding_tolerance(config: Config) -> Tolerance:
    """Tolerance of a pipelined step in the config's own dtypes against the float64 reference.

    A sum of k terms in a dtype of unit roundoff u carries a relative error of about sqrt(k) u
    (rounding errors adding as a random walk: Higham and Mary, SIAM J. Sci. Comput. 2019), and the
    errors of the stages a value passes through add up. The longest sums of one forward are over
    the hidden width, the dense and expert FFN widths, the sequence (attention) and the vocabulary
    (log-softmax); a weight gradient sums over a micro-batch's tokens. A forward passes
    n_layers + 1 stages (the head included), a gradient twice as many (forward, then backward).
    So, with u_c the unit roundoff of ``model.dtype``: loss ``FLOAT32_SAFETY * u_c * sqrt(k) *
    (n_layers + 1)`` relative, gradients twice that. Gradients then accumulate over the
    micro-batches in the master dtype (never coarser than u_c: inside that budget) and are summed
    over the R = dp x ep replicas in ``train.grad_reduce_dtype`` (u_r): R casts and R - 1 additions,
    about sqrt(2R) u_r, ``FLOAT32_SAFETY`` times, added. float16's loss scale is a power of two:
    multiplying by it and dividing it out is exact. Router biases move by whole steps of
    ``bias_update_speed`` and differ only by its rounding in the bias dtype (float32 at least).
    """
    m, t, p = config.model, config.train, config.parallel
    k = max(m.hidden, m.ffn_hidden, m.moe_hidden, m.seq_len, m.vocab_size, t.micro_batch_size * m.seq_len)
    depth = m.n_layers + 1
    u = UNIT_ROUNDOFF[m.dtype]
    loss = FLOAT32_SAFETY * u * math.sqrt(k) * depth
    grad = 2 * loss
    replicas = p.dp * p.ep
    reduced, master = reduce_dtype(m.dtype, t.master_dtype, t.grad_reduce_dtype), master_dtype(m.dtype, t.master_dtype)
    basis = (
        f"{m.dtype} on the device (u = {_power(u)}) against float64 on the CPU: loss {FLOAT32_SAFETY:g} u sqrt(k) (n_layers + 1) "
        f"relative with k = {k} (the longest sum), n_layers + 1 = {depth}; gradients twice that (forward and backward)"
    )
    if replicas > 1:
        u_r = UNIT_ROUNDOFF[reduced]
        grad += FLOAT32_SAFETY * u_r * math.sqrt(2 * replicas)
        basis += f", plus {FLOAT32_SAFETY:g} u_r sqrt(2R) for the sum over R = {replicas} replicas in {reduced} (u_r = {_power(u_r)})"
    if master != m.dtype:
        basis += f"; accumulated in {master}"
    u_bias = UNIT_ROUNDOFF["float64" if m.dtype == "float64" else "float32"]
    bias = 2 * u_bias * m.bias_update_speed * max(1, replicas)
    return Tolerance(m.dtype, loss, grad, bias, basis)


def _power(u: float) -> str:
    return f"2^{round(math.log2(u))}"


def float32_tolerance(config: Config) -> Tolerance:
    """Tolerance of a float32 pipelined step (master weights and reduction in float32 too) against
    the float64 reference: :func:`rounding_tolerance` in float32."""
    return rounding_tolerance(in_dtype(config, "float32"))


def precision_for(config: Config) -> Tolerance:
    """float64 (exact) where the config's backend computes and communicates in float64 as the CPU
    does (``capabilities.matches_cpu_float64``), else float32."""
    from .backends.registry import backend_class, resolve_name

    caps = backend_class(resolve_name(config.backend)).capabilities
    return EXACT if caps.full_precision("float64") and caps.matches_cpu_float64 else float32_tolerance(config)


def dtypes(config: Config) -> dict[str, str]:
    """The dtype keys of a config, resolved (``auto`` read)."""
    m, t = config.model, config.train
    return {"model.dtype": m.dtype, "train.master_dtype": master_dtype(m.dtype, t.master_dtype),
            "train.grad_reduce_dtype": reduce_dtype(m.dtype, t.master_dtype, t.grad_reduce_dtype)}


def checked(config: Config, precision: str = "highest") -> tuple[Config, Tolerance, dict[str, str]]:
    """For ``precision`` (one of :data:`PRECISIONS`): the config the ranks run, the tolerance it
    is judged by, and every dtype key that differs from ``config`` (``{key: "was -> now"}``).

    ``highest``: :func:`precision_for`'s dtype throughout, so that the check can be exact (a
    float32 ``train.grad_reduce_dtype`` under a float64 check could not be, a float32 master dtype
    under float64 would be refused); ``model``: the config as it is. Raises ConfigError where the
    derived gradient tolerance is 1 or more: rounding alone could then explain any gradient, a
    zero one included, and the check could not fail.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "model":
        if set(dtypes(config).values()) == {"float64"}:
            return config, EXACT, {}
        tolerance = rounding_tolerance(config)
        if tolerance.grad >= 1.0:
            raise ConfigError([
                f"verify --precision model: the gradient tolerance derived for model.dtype {config.model.dtype} is {tolerance.grad:.3g} "
                f"relative ({tolerance.basis}), so no gradient could fail it; check this model with --precision highest, "
                "or a smaller one (model.hidden, ffn_hidden, seq_len, vocab_size, train.micro_batch_size) in its dtype"])
        return config, tolerance, {}
    tolerance = precision_for(config)
    ranks = in_dtype(config, tolerance.precision)
    was, now = dtypes(config), dtypes(ranks)
    return ranks, tolerance, {k: f"{was[k]} -> {now[k]}" for k in was if was[k] != now[k]}


@dataclass
class VerifyReport:
    schedule: str
    pp: int
    ep: int
    dp: int
    microbatches: int
    loss_diff: float
    max_rel_grad_diff: float
    ok: bool
    precision: str = "float64"
    tolerance: Tolerance = EXACT
    #: dtype keys verify changed from the config to check in ``precision`` (key -> "was -> now")
    changed: dict[str, str] = field(default_factory=dict)
    #: float16 checked in its own dtype: the loss scale of the step (the first without overflow)
    loss_scale: float | None = None
    #: beyond the printed keys: for tests and diagnosis
    overlap: bool = True
    w_split: bool = True
    loss: float = 0.0
    ref_loss: float = 0.0
    max_bias_diff: float = 0.0
    worst_param: str = ""
    timings: list[dict[str, float]] = field(default_factory=list)
    #: the largest difference of a loss term's mean (relative to the reference's), over terms and ranks
    loss_terms_diff: float = 0.0
    #: the reference's loss terms (name -> mean)
    ref_loss_terms: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """The ``portapipe verify`` JSON: schedule, pp, ep, dp, microbatches, loss_diff,
        max_rel_grad_diff, ok, precision, the dtype keys changed to check in it, float16's loss
        scale (null otherwise) and the tolerance it was judged by; with loss terms (balance loss,
        multi-token prediction), their names and ``loss_terms_diff``."""
        keys = ("schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok", "precision", "changed", "loss_scale")
        out = {**{k: getattr(self, k) for k in keys}, "tolerance": self.tolerance.as_dict()}
        if self.ref_loss_terms:
            out.update(loss_terms=sorted(self.ref_loss_terms), loss_terms_diff=self.loss_terms_diff)
        return out


def in_dtype(config: Config, dtype: str, backend: str | None = None) -> Config:
    """The config with the model in ``dtype``, its master weights and gradients' reduction too
    (``train.master_dtype`` and ``train.grad_reduce_dtype`` auto), on ``backend`` when given."""
    raw = config.to_dict()
    raw["model"]["dtype"] = dtype
    raw["train"]["master_dtype"] = raw["train"]["grad_reduce_dtype"] = "auto"
    if backend is not None:
        raw["backend"], raw["backend_options"] = backend, {}
    return config_from_dict(raw)


def float64(config: Config) -> Config:
    """The config with the model in float64 (what verification runs in where the device allows)."""
    return in_dtype(config, "float64")


def microbatches(config: Config, replica: int) -> list[tuple[torch.Tensor, ...]]:
    """Random token micro-batches of one replica, drawn from the seed, made as training makes its
    own (:func:`portapipe.data.samples.make_microbatches`). With ``data.document_mask`` or
    ``data.mask_eos_loss`` each token also starts a document with probability 1 / 8, so the
    samples hold documents of every length from one token on."""
    m, t, d = config.model, config.train, config.data
    documents = d.document_mask or d.mask_eos_loss
    windows, starts = [], []
    for mb in range(config.schedule.microbatches):
        g = torch.Generator().manual_seed(t.seed * 1_000_003 + replica * 1009 + mb)
        windows.append(torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len + 1), generator=g))
        if documents:
            starts.append(torch.rand(t.micro_batch_size, m.seq_len + 1, generator=g) < 1 / 8)
    flags = torch.cat(starts).numpy() if documents else None
    return make_microbatches(torch.cat(windows).numpy(), flags, config.schedule.microbatches, d.document_mask, d.mask_eos_loss)


# ------------------------------------------------------------------------------ ranks
def runtime_for(backend: Any, raw: dict[str, Any], by_position: bool = False) -> tuple[PipelineRuntime, Any]:
    """This rank's runtime for one raw config, and its data: the micro-batches of its replica.

    A fresh backend object per config, so each config gets its own pp x dp x ep groups.
    ``by_position``: routing forced by position (:func:`route_by_position`).
    """
    config = config_from_dict(raw)
    p = config.parallel
    be = type(backend)(backend.options)
    groups = be.parallel_groups(p.pp, p.dp, p.ep)
    runtime = PipelineRuntime(config, be, groups)
    if by_position:
        route_by_position(config, runtime.moe_layers())
    return runtime, microbatches(config, groups.dp_rank * p.ep + groups.ep_rank)


def route_by_position(config: Config, moe_layers: list[Any]) -> None:
    """Every router sends token t of a micro-batch to experts (t k + j) mod E, j < k: the same on
    the ranks and in the reference, whatever the order of their calls."""
    for layer in moe_layers:
        layer.moe.router.forced = ForcedRouting(config.model.n_experts, config.model.top_k, restart=True)


def _rank_step(backend: Any, raws: list[dict[str, Any]], by_position: bool = False) -> list[dict[str, Any]]:
    """On every rank: for each config, build the runtime, run one step, return its gradients."""
    return [step_report(*runtime_for(backend, raw, by_position)) for raw in raws]


def step_report(runtime: PipelineRuntime, data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Run one step; return what :func:`compare` checks (picklable, for the launcher).

    float16 scales the loss as training does: from training's first scale, halved while the
    gradients overflow (each overflowing try undone, :meth:`~portapipe.compose.PipelineRuntime.unchanged`);
    the gradients are reported divided by it (in float64, exactly)."""
    scaler = LossScaler(runtime.config.model.dtype == "float16")
    while True:
        runtime.grad_scale = scale = scaler.scale
        with runtime.unchanged() as keep:
            report = _one_step(runtime, data, scale)
            done = not scaler.enabled or scaler.scale == 1.0 or everywhere(runtime.backend, _finite(report))
            if done:
                keep()  # the step that counts leaves its state, as training's would
        if done:
            runtime.grad_scale = 1.0
            return report
        scaler.update(False)


def _finite(report: dict[str, Any]) -> bool:
    return math.isfinite(report["loss"]) and all(bool(torch.isfinite(g).all()) for g in report["grads"].values())


def _one_step(runtime: PipelineRuntime, data: list[tuple[torch.Tensor, torch.Tensor]], scale: float) -> dict[str, Any]:
    result = runtime.step(data)
    params = dict(runtime.named_parameters())
    grads = runtime.grads.full_grads()  # zero_stage 2 keeps only its ranges: gathered here

    def unscaled(g: torch.Tensor) -> torch.Tensor:
        return g.detach().cpu().clone() if scale == 1.0 else g.detach().cpu().to(torch.float64) / scale

    return {
        "loss_scale": scale if runtime.config.model.dtype == "float16" else None,
        "ep_rank": runtime.groups.ep_rank,
        "loss": result.loss,
        "grads": {n: unscaled(grads[q]) for n, q in params.items()},
        "experts": sorted(n for n, q in params.items() if is_expert(q)),
        # logical expert of each local slot, per expert parameter (a balancer may replicate / reorder)
        "expert_ids": {
            f"layers.{layer.index}.moe.experts.{n}": list(layer.moe.experts.logical)
            for layer in runtime.moe_layers()
            for n, _ in layer.moe.experts.named_parameters()
        },
        "biases": {f"{layer.index}": b.detach().cpu().clone() for layer in runtime.moe_layers() if (b := _bias(layer)) is not None},
        "timings": result.timings,
        "expert_counts": None if result.expert_counts is None else result.expert_counts.cpu(),
        "expert_layers": result.expert_layers,
        "tokens": result.tokens,
        "loss_terms": dict(result.loss_terms),
    }


def _bias(layer: Any) -> torch.Tensor | None:
    """The router's load-balancing bias (a softmax router has none)."""
    return getattr(layer.moe.router, "bias", None)


# -------------------------------------------------------------------------- reference
@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def reference(config: Config, by_position: bool = False) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The step in one process: (mean loss, gradients by name, router biases after the step);
    ``by_position``: routing forced as :func:`route_by_position` says."""
    loss, grads, biases, _ = reference_step(config, by_position)
    return loss, grads, biases


def reference_step(config: Config, by_position: bool = False) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
    """:func:`reference`, and each loss term's mean over micro-batches and replicas."""
    from .backends.cpu import CPUBackend

    p = config.parallel
    n_blocks = config.n_blocks()
    replicas, m = p.dp * p.ep, config.schedule.microbatches
    scale = 1.0 / (m * replicas)
    blocks = build_model(config, range(n_blocks), n_blocks, ExpertParallel(CPUBackend()))
    tie_copies(blocks)  # one process holds one of each shared weight (the pipeline's copies are summed)
    if by_position:
        route_by_position(config, [layer for b in range(n_blocks) for layer in blocks[b].moe_layers()])
    losses, terms = [], []
    with _threads(1):  # as on the ranks
        for r in range(replicas):
            row, term_row = [], []
            for inputs, targets, *positions in microbatches(config, r):
                tape = Tape(record=False, loss_seed=scale)
                h = inputs
                given = {"positions": positions[0]} if positions else {}
                for b in range(n_blocks):
                    h = run(blocks[b].program(tape, h, targets if b == n_blocks - 1 else None, **given))
                tape.plain_backward(h, torch.full_like(h, scale))
                row.append(float(h.detach()))
                term_row.append({name: float(t) for name, t in tape.terms.items()})
            losses.append(row)
            terms.append(term_row)
    names = sorted({name for row in terms for mb in row for name in mb})
    term_means = {name: mean_loss([[mb[name] for mb in row] for row in terms]) for name in names}
    grads, biases = {}, {}
    for b in range(n_blocks):
        for name, q in blocks[b].named_parameters():
            grads[name] = q.grad if q.grad is not None else torch.zeros_like(q)
        for layer in blocks[b].moe_layers():
            layer.moe.router.update_bias(layer.moe.step_counts)
            if (bias := _bias(layer)) is not None:
                biases[f"{layer.index}"] = bias.clone()
    return mean_loss(losses), grads, biases, term_means


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    num = float((a.to(torch.float64) - ref.to(torch.float64)).norm())
    den = float(ref.to(torch.float64).norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def compare(config: Config, rank_results: list[dict[str, Any]], tolerance: Tolerance = EXACT, changed: dict[str, str] | None = None,
            by_position: bool = False) -> VerifyReport:
    """Every rank's loss, gradients and router biases against the single-process reference
    (``config`` in float64, routed by position where the ranks were), judged by ``tolerance``
    (exact for a float64 step); ``changed``: the dtype keys the ranks ran otherwise than asked."""
    ref_loss, ref_grads, ref_biases, ref_terms = reference_step(config, by_position)
    p = config.parallel
    per = config.model.n_experts // p.ep
    worst, worst_name, bias_diff = 0.0, "", 0.0
    losses = [r["loss"] for r in rank_results]
    for r in rank_results:
        for name, g in r["grads"].items():
            want = ref_grads[name]
            if name in r.get("expert_ids", {}):
                want = want[r["expert_ids"][name]]
            elif name in r["experts"]:
                want = want[r["ep_rank"] * per : (r["ep_rank"] + 1) * per]
            d = _rel(g, want)
            if not worst_name or d > worst:
                worst, worst_name = d, name
        for layer, bias in r["biases"].items():
            bias_diff = max(bias_diff, float((bias - ref_biases[layer]).abs().max()))
    loss_diff = max(abs(x - ref_loss) for x in losses)
    terms_diff = _terms_diff(ref_terms, [r.get("loss_terms", {}) for r in rank_results])
    ok = loss_diff <= tolerance.loss * abs(ref_loss) and worst <= tolerance.grad and bias_diff <= tolerance.bias and terms_diff <= tolerance.loss
    return VerifyReport(
        schedule=config.schedule.name,
        pp=p.pp,
        ep=p.ep,
        dp=p.dp,
        microbatches=config.schedule.microbatches,
        loss_diff=loss_diff,
        max_rel_grad_diff=worst,
        ok=ok,
        precision=tolerance.precision,
        tolerance=tolerance,
        changed=dict(changed or {}),
        loss_scale=rank_results[0].get("loss_scale"),
        overlap=config.schedule.overlap,
        w_split=config.schedule.w_split,
        loss=losses[0],
        ref_loss=ref_loss,
        max_bias_diff=bias_diff,
        worst_param=worst_name,
        timings=[r["timings"] for r in rank_results],
        loss_terms_diff=terms_diff,
        ref_loss_terms=ref_terms,
    )


def _terms_diff(ref: dict[str, float], ranks: list[dict[str, float]]) -> float:
    """The largest relative difference of a loss term over the ranks (inf for a term one side lacks)."""
    worst = 0.0
    for got in ranks:
        if set(got) != set(ref):
            return float("inf")
        for name, want in ref.items():
            d = abs(got[name] - want)
            worst = max(worst, d / abs(want) if want else (0.0 if d == 0 else float("inf")))
    return worst


def verify_many(configs: list[Config], wall_timeout_s: float = 600.0, precision: str = "highest") -> list[VerifyReport]:
    """Verify several configs of one world size in one launch of ranks (start-up paid once).

    ``precision`` highest: the ranks run in float64 where the backend declares float64 compute
    and communication, else in float32; model: in each config's own dtypes (:func:`checked`).
    The reference always runs in float64 on the CPU.
    """
    if not configs:
        return []
    worlds = {c.world_size for c in configs}
    if len(worlds) != 1:
        raise ValueError(f"verify_many needs one world size per launch, got {sorted(worlds)}")
    backends = {c.backend for c in configs}
    if len(backends) != 1:
        raise ValueError(f"verify_many needs one backend per launch, got {sorted(backends)}")
    from .models.hf_io import init_problems

    plans = [checked(c, precision) for c in configs]
    ranks_configs = [ranks for ranks, _, _ in plans]
    references = [in_dtype(c, "float64", backend="cpu") for c in configs]
    by_position = precision == "model"
    for c in ranks_configs:
        build_schedule(c)  # a schedule or split that cannot run fails here, before any rank starts
        problems = init_problems(c.model)  # weights to start from that do not fit
        if problems:
            raise ConfigError(problems)
    per_rank = run_ranks(
        _rank_step,
        configs[0].world_size,
        [c.to_dict() for c in ranks_configs],
        by_position,
        backend=configs[0].backend,
        backend_options=configs[0].backend_options,
        wall_timeout_s=wall_timeout_s,
        stall_timeout_s=configs[0].launch.stall_timeout_s,
        stop_grace_s=configs[0].launch.stop_grace_s,
    )
    return [compare(ref, [ranks[i] for ranks in per_rank], tol, changed, by_position)
            for i, (ref, (_, tol, changed)) in enumerate(zip(references, plans))]


def verify(config: Config, precision: str = "highest") -> dict[str, Any]:
    """One step pipelined vs in one process, in ``precision`` (see :func:`checked`): the summary (see VerifyReport.summary)."""
    return verify_many([config], precision=precision)[0].summary()
