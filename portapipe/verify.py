"""``verify``: one pipelined step against the same step in one process, in the device's precision.

Where the backend declares float64 compute and communication (its
:class:`~portapipe.backends.capabilities.Capabilities`), both sides run in float64 and the
claim is exact (below). Elsewhere the pipelined step runs in float32 on the device and is
compared with a float64 single-process reference on the CPU, within a tolerance derived from
float32 rounding and the model's depth (:func:`float32_tolerance`), printed with the result.
Either way the master weights and the gradients' reduction run in that dtype too: the dtype keys
this changes are named in the result (``changed``).

A config with ``train.fp8`` on is checked so whatever ``precision`` says: its recipe (FP8 GEMMs,
FP8 dispatch) is part of its dtypes, and the distance from the float64 step printed beside is the
distance from the unquantized step.

``precision="model"`` (``portapipe verify --precision model``) checks the run's own dtypes
instead: ``model.dtype`` (bfloat16, float16), the master dtype the gradients accumulate in, the
reduction's dtype and float16's loss scaling. A tolerance derived from rounding against float64
would have to allow what bfloat16 does to a whole step (tens of percent): a pipeline bug hides in
that. So the pipelined step is held to the one-process step *in the same dtypes and rounding
points* (:func:`recipe_step`): each micro-batch's arithmetic is the same on both sides, and
where the sums of micro-batches, replicas and copies run in another order the check measures
what that order moves (the same step with those sums reversed: the noise floor) and allows
:data:`NOISE_FACTOR` times it (:func:`measured_tolerance`). The distance from the float64 step
is printed beside it. Routing is forced by position on both sides: the float64 step would break
near-ties otherwise than bfloat16 (a token sent to another expert, which no rounding bounds), and
a balancer's routes, the same for every micro-batch then, are replayed in one process; the exact
check above covers the routing.

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
from .models.moe import DTYPES, tie_copies
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
#: the low-precision check allows this many times its measured noise floor (:func:`measured_tolerance`): the
#: pipelined step sums in other orders than the one-process step, as the reversed one does, by about as much
NOISE_FACTOR = 4.0


@dataclass(frozen=True)
class Tolerance:
    """What a verification accepts: relative loss and gradient differences, absolute bias difference."""

    precision: str  # the dtype the pipelined step ran in
    loss: float
    grad: float
    bias: float
    basis: str = ""  # how the figures were derived
    #: judged against the one-process step under the same recipe, loss and grad from its noise floor
    #: (:func:`measured_tolerance`); before the step ran, loss and grad are not known yet (0)
    measured: bool = False
    #: the noise floor measured (loss, gradients), relative
    floor: tuple[float, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"loss": self.loss, "grad": self.grad, "bias": self.bias, "basis": self.basis}
        if self.floor is not None:
            out["floor"] = {"loss": self.floor[0], "grad": self.floor[1]}
        return out


EXACT = Tolerance("float64", 0.0, GRAD_TOLERANCE, 0.0, "float64 on both sides: the loss bit for bit, gradients to summation order")


def rounding_tolerance(config: Config) -> Tolerance:
    """Tolerance of a pipelined step in the config's own dtypes against the float64 reference.

    A sum of k terms in a dtype of unit roundoff u carries a relative error of about sqrt(k) u
    (rounding errors adding as a random walk: Higham and Mary, SIAM J. Sci. Comput. 2019), and the
    errors of the stages a value passes through add up. The longest sums of one forward are over
    the hidden width, the dense and expert FFN widths, the sequence (attention) and the vocabulary
    (log-softmax); a weight gradient sums over a micro-batch's tokens. A forward passes
    n_layers + mtp_layers + 1 stages (the head included; the deepest multi-token prediction passes
    every layer, then each prediction module's), a gradient twice as many (forward, then backward).
    So, with u_c the unit roundoff of ``model.dtype``: loss ``FLOAT32_SAFETY * u_c * sqrt(k) *
    (n_layers + mtp_layers + 1)`` relative, gradients twice that. Gradients then accumulate over the
    micro-batches in the master dtype (never coarser than u_c: inside that budget) and are summed
    over the R = dp x ep replicas in ``train.grad_reduce_dtype`` (u_r): R casts and R - 1 additions,
    about sqrt(2R) u_r, ``FLOAT32_SAFETY`` times, added. float16's loss scale is a power of two:
    multiplying by it and dividing it out is exact. Router biases move by whole steps of
    ``bias_update_speed`` and differ only by its rounding in the bias dtype (float32 at least).
    """
    m, t, p = config.model, config.train, config.parallel
    k = max(m.hidden, m.ffn_hidden, m.moe_hidden, m.seq_len, m.vocab_size, t.micro_batch_size * m.seq_len)
    depth = m.n_layers + m.mtp_layers + 1  # the deepest prediction passes every layer, then each module's
    u = UNIT_ROUNDOFF[m.dtype]
    loss = FLOAT32_SAFETY * u * math.sqrt(k) * depth
    grad = 2 * loss
    replicas = p.dp * p.ep
    reduced, master = reduce_dtype(m.dtype, t.master_dtype, t.grad_reduce_dtype), master_dtype(m.dtype, t.master_dtype)
    basis = (
        f"{m.dtype} on the device (u = {_power(u)}) against float64 on the CPU: loss {FLOAT32_SAFETY:g} u sqrt(k) (n_layers + mtp_layers + 1) "
        f"relative with k = {k} (the longest sum), n_layers + mtp_layers + 1 = {depth}; gradients twice that (forward and backward)"
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
    under float64 would be refused); ``model``: the config as it is, judged against the
    one-process step in the same dtypes (a ``measured`` tolerance: :func:`measured_tolerance`).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision: {precision!r} is not one of {', '.join(PRECISIONS)}")
    if precision == "model" or config.train.fp8 != "off":  # FP8 is a recipe of its dtypes: checked in them
        if set(dtypes(config).values()) == {"float64"}:
            return config, EXACT, {}
        derived = rounding_tolerance(config)
        return config, Tolerance(derived.precision, 0.0, 0.0, derived.bias, "measured after the step", measured=True), {}
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
    #: a measured tolerance's check: the distances from the float64 reference (absolute loss, relative gradients)
    float64_loss_diff: float | None = None
    float64_grad_diff: float | None = None

    def summary(self) -> dict[str, Any]:
        """The ``portapipe verify`` JSON: schedule, pp, ep, dp, microbatches, loss_diff,
        max_rel_grad_diff, ok, precision, the dtype keys changed to check in it, float16's loss
        scale (null otherwise) and the tolerance it was judged by; with loss terms (balance loss,
        multi-token prediction), their names and ``loss_terms_diff``; checked against the one-process
        step in the same dtypes (``--precision model``), the distances from the float64 one
        (``float64``: loss_diff, max_rel_grad_diff)."""
        keys = ("schedule", "pp", "ep", "dp", "microbatches", "loss_diff", "max_rel_grad_diff", "ok", "precision", "changed", "loss_scale")
        out = {**{k: getattr(self, k) for k in keys}, "tolerance": self.tolerance.as_dict()}
        if self.float64_loss_diff is not None:
            out["float64"] = {"loss_diff": self.float64_loss_diff, "max_rel_grad_diff": self.float64_grad_diff}
        if self.ref_loss_terms:
            out.update(loss_terms=sorted(self.ref_loss_terms), loss_terms_diff=self.loss_terms_diff)
        return out


def in_dtype(config: Config, dtype: str, backend: str | None = None) -> Config:
    """The config with the model in ``dtype``, its master weights and gradients' reduction too
    (``train.master_dtype`` and ``train.grad_reduce_dtype`` auto), on ``backend`` when given;
    unquantized (``train.fp8`` off) in any dtype but bfloat16, which FP8 runs on."""
    raw = config.to_dict()
    raw["model"]["dtype"] = dtype
    raw["train"]["master_dtype"] = raw["train"]["grad_reduce_dtype"] = "auto"
    if dtype != "bfloat16":
        raw["train"]["fp8"] = "off"
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
    """On every rank: for each config, build the runtime, run one step, return its gradients
    (routed by position: with the balancer's routes, :func:`record_routes`)."""
    out = []
    for raw in raws:
        runtime, data = runtime_for(backend, raw, by_position)
        routes = record_routes(runtime) if by_position and runtime.balancer is not None else None
        report = step_report(runtime, data)
        if routes is not None:
            report["routes"] = {layer: calls[0] if all(torch.equal(calls[0], c) for c in calls) else None for layer, calls in routes.items()}
        out.append(report)
    return out


def record_routes(runtime: PipelineRuntime) -> dict[int, list[torch.Tensor]]:
    """Records the physical slot of every routed entry the balancer gives, by MoE layer, one
    tensor per call (routed by position, every micro-batch of a rank routes alike: the one-process
    step replays them, :class:`RouteReplay`)."""
    calls: dict[int, list[torch.Tensor]] = {}
    route = runtime.balancer.route

    def recording(layer: int, idx: torch.Tensor) -> torch.Tensor:
        slots = route(layer, idx)
        calls.setdefault(layer, []).append(slots.detach().cpu().clone())
        return slots

    runtime.balancer.route = recording
    return calls


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
        "dp_rank": runtime.groups.dp_rank,
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
    grads = {}
    for b in range(n_blocks):
        for name, q in blocks[b].named_parameters():
            grads[name] = q.grad if q.grad is not None else torch.zeros_like(q)
    return mean_loss(losses), grads, _updated_biases(blocks), _term_means(terms)


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
    from .backends.base import ParallelGroups

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
    from .backends.registry import backend_class, resolve_name
    from .optim.buckets import GradBuckets

    p, m_cfg, t = config.parallel, config.model, config.train
    n_blocks = config.n_blocks()
    m = config.schedule.microbatches
    order = (lambda xs: list(xs)[::-1]) if reverse else list
    seed = scale / (m * p.dp * p.ep)
    backend = backend_class(resolve_name(config.backend))(config.backend_options)
    ep = ExpertParallel(backend)
    ep.balancer = replay
    blocks = build_model(config, range(n_blocks), n_blocks, ep)
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
    with _threads(1):  # as on the ranks
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
    return mean_loss(rows), grads_out, _updated_biases(blocks), _term_means(term_rows)


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


def _updated_biases(blocks: dict[int, Any]) -> dict[str, torch.Tensor]:
    """Every router's bias after its step on the loads the blocks counted."""
    biases = {}
    for b in range(len(blocks)):
        for layer in blocks[b].moe_layers():
            layer.moe.router.update_bias(layer.moe.step_counts)
            if (bias := _bias(layer)) is not None:
                biases[f"{layer.index}"] = bias.detach().cpu().clone()
    return biases


def _term_means(terms: list[list[dict[str, float]]]) -> dict[str, float]:
    """Each loss term's mean over (replica, micro-batch), summed as the ranks sum it."""
    names = sorted({name for row in terms for mb in row for name in mb})
    return {name: mean_loss([[mb[name] for mb in row] for row in terms]) for name in names}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    num = float((a.to(torch.float64) - ref.to(torch.float64)).norm())
    den = float(ref.to(torch.float64).norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def _distances(ref: tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, float]], rank_results: list[dict[str, Any]],
               per: int) -> tuple[float, float, str, float, float]:
    """Every rank against one reference step (:func:`reference_step`'s tuple): the largest absolute
    loss difference, the largest relative gradient difference and its parameter, the largest bias
    difference, the largest relative loss-term difference. ``per``: experts per EP rank."""
    ref_loss, ref_grads, ref_biases, ref_terms = ref
    worst, worst_name, bias_diff = 0.0, "", 0.0
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
    loss_diff = max(abs(r["loss"] - ref_loss) for r in rank_results)
    return loss_diff, worst, worst_name, bias_diff, _terms_diff(ref_terms, [r.get("loss_terms", {}) for r in rank_results])


def measured_tolerance(config: Config, bias: float, same: tuple[Any, ...], other: tuple[Any, ...]) -> Tolerance:
    """The low-precision check's tolerance: :data:`NOISE_FACTOR` times the noise floor, the
    distance between two one-process steps under the run's recipe that differ only in the order
    of their sums (``same`` and ``other``: :func:`recipe_step` forwards and reversed), each figure
    at least one rounding of its sum (the loss's mean in float64; the gradients' accumulation in
    the master dtype, or the reduction's dtype where replicas are summed in a coarser one): an
    order that happens to round alike in both must not make the check exact."""
    m, t, p = config.model, config.train, config.parallel
    loss_floor = max(abs(other[0] - same[0]) / abs(same[0]) if same[0] else abs(other[0]), _terms_diff(same[3], [other[3]]))
    grad_floor = max((_rel(other[1][name], g) for name, g in same[1].items()), default=0.0)
    acc = master_dtype(m.dtype, t.master_dtype)
    if p.dp * p.ep > 1:
        acc = max(acc, reduce_dtype(m.dtype, t.master_dtype, t.grad_reduce_dtype), key=lambda d: UNIT_ROUNDOFF[d])
    least_loss, least_grad = UNIT_ROUNDOFF["float64"], UNIT_ROUNDOFF[acc]
    basis = (
        f"{m.dtype} on both sides, against the one-process step with the same dtypes and rounding points: {NOISE_FACTOR:g} x the noise floor, "
        f"the distance of that step from itself with its replicas, micro-batches, copies and replicas' slots summed in the reverse order "
        f"(loss {loss_floor:.3g} relative, gradients {grad_floor:.3g}), each at least one rounding of its sum "
        f"(the loss's float64 mean {_power(least_loss)}, the gradients' {acc} accumulation {_power(least_grad)})"
    )
    return Tolerance(m.dtype, NOISE_FACTOR * max(loss_floor, least_loss), NOISE_FACTOR * max(grad_floor, least_grad), bias, basis,
                     measured=True, floor=(loss_floor, grad_floor))


def compare(config: Config, rank_results: list[dict[str, Any]], tolerance: Tolerance = EXACT, changed: dict[str, str] | None = None,
            by_position: bool = False, recipe: Config | None = None) -> VerifyReport:
    """Every rank's loss, gradients and router biases against the single-process reference
    (``config`` in float64, routed by position where the ranks were), judged by ``tolerance``
    (exact for a float64 step); ``changed``: the dtype keys the ranks ran otherwise than asked.

    A ``measured`` tolerance (``--precision model``) judges them against the one-process step
    under ``recipe`` (the config the ranks ran: :func:`recipe_step`) by :func:`measured_tolerance`
    instead; the distances from the float64 reference are then reported beside (``float64_*``)."""
    p = config.parallel
    per = config.model.n_experts // p.ep
    ref = reference_step(config, by_position)
    loss_diff, worst, worst_name, bias_diff, terms_diff = _distances(ref, rank_results, per)
    float64_diffs: tuple[float, float] | None = None
    if tolerance.measured:
        if recipe is None:
            raise ValueError("a measured tolerance compares with the one-process step under the ranks' recipe: pass recipe")
        float64_diffs = (loss_diff, worst)
        scale = rank_results[0].get("loss_scale") or 1.0
        ref = recipe_step(recipe, by_position, scale, replay=route_replay(recipe, rank_results))
        other = recipe_step(recipe, by_position, scale, reverse=True, replay=route_replay(recipe, rank_results))
        tolerance = measured_tolerance(recipe, tolerance.bias, ref, other)
        loss_diff, worst, worst_name, bias_diff, terms_diff = _distances(ref, rank_results, per)
    ref_loss = ref[0]
    losses = [r["loss"] for r in rank_results]
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
        ref_loss_terms=ref[3],
        float64_loss_diff=None if float64_diffs is None else float64_diffs[0],
        float64_grad_diff=None if float64_diffs is None else float64_diffs[1],
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


def forced_routing_problems(config: Config) -> list[str]:
    """A benchmark's routing (``bench``): verify would check the model's router, which such a run
    does not use, and the forced choices follow the order of the router's calls (or a generator's
    draws), which differs between the ranks and one process; refused, one line each."""
    b = config.bench
    out = []
    if b.force_uniform_routing:
        out.append("bench.force_uniform_routing: true routes every token round-robin, a benchmark's routing that verify does not check "
                   "(it checks the model's router); verify the config with it false")
    if b.router_skew_from is not None:
        out.append(f"bench.router_skew_from: {b.router_skew_from} draws each token's experts from recorded loads, a benchmark's routing "
                   "that verify does not check (it checks the model's router); verify the config without it")
    return out


def verify_many(configs: list[Config], wall_timeout_s: float = 600.0, precision: str = "highest") -> list[VerifyReport]:
    """Verify several configs of one world size in one launch of ranks (start-up paid once).

    ``precision`` highest: the ranks run in float64 where the backend declares float64 compute
    and communication, else in float32; model: in each config's own dtypes (:func:`checked`).
    The float64 reference runs on the CPU; model's one-process step in the same dtypes
    (:func:`recipe_step`) on the backend's device.
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

    forced = [line for c in configs for line in forced_routing_problems(c)]
    if forced:
        raise ConfigError(forced)
    plans = [checked(c, precision) for c in configs]
    ranks_configs = [ranks for ranks, _, _ in plans]
    references = [in_dtype(c, "float64", backend="cpu") for c in configs]  # under FP8: the unquantized float64 step
    by_position = precision == "model" or any(c.train.fp8 != "off" for c in configs)
    for c in ranks_configs:
        build_schedule(c)  # a schedule or split that cannot run fails here, before any rank starts
        problems = init_problems(c.model)  # weights to start from that do not fit
        if problems:
            raise ConfigError(problems)
    steps = run_steps(ranks_configs, by_position, wall_timeout_s)
    return [compare(ref, ranks, tol, changed, by_position, recipe) for ref, ranks, (recipe, tol, changed) in zip(references, steps, plans)]


def run_steps(configs: list[Config], by_position: bool = False, wall_timeout_s: float = 600.0) -> list[list[dict[str, Any]]]:
    """One pipelined step of each config (one world size and backend) in one launch of ranks:
    per config, every rank's :func:`step_report` in rank order (with ``by_position``, routed by
    position, with the balancer's routes)."""
    per_rank = run_ranks(
        _rank_step,
        configs[0].world_size,
        [c.to_dict() for c in configs],
        by_position,
        backend=configs[0].backend,
        backend_options=configs[0].backend_options,
        wall_timeout_s=wall_timeout_s,
        stall_timeout_s=configs[0].launch.stall_timeout_s,
        stop_grace_s=configs[0].launch.stop_grace_s,
    )
    return [[ranks[i] for ranks in per_rank] for i in range(len(configs))]


def verify(config: Config, precision: str = "highest") -> dict[str, Any]:
    """One step pipelined vs in one process, in ``precision`` (see :func:`checked`): the summary (see VerifyReport.summary)."""
    return verify_many([config], precision=precision)[0].summary()
