"""What a verification accepts: the exact float64 claim, the rounding tolerance of float32, and
the tolerance a low-precision check measures from its own noise floor (:func:`measured_tolerance`);
the dtypes a check runs in."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..config import Config, config_from_dict
from ..optim.precision import master_dtype, reduce_dtype



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
    from ..backends.registry import backend_class, resolve_name

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


def in_dtype(config: Config, dtype: str, backend: str | None = None) -> Config:
    """The config with the model in ``dtype``, its master weights and gradients' reduction too
    (``train.master_dtype`` and ``train.grad_reduce_dtype`` auto), on ``backend`` when given;
    unquantized (``train.fp8`` off, and with it ``memory.fp8_activations``) in any dtype but
    bfloat16, which FP8 runs on."""
    raw = config.to_dict()
    raw["model"]["dtype"] = dtype
    raw["train"]["master_dtype"] = raw["train"]["grad_reduce_dtype"] = "auto"
    if dtype != "bfloat16":
        raw["train"]["fp8"] = "off"
        raw["memory"]["fp8_activations"] = False
    if backend is not None:
        raw["backend"], raw["backend_options"] = backend, {}
    return config_from_dict(raw)


def float64(config: Config) -> Config:
    """The config with the model in float64 (what verification runs in where the device allows)."""
    return in_dtype(config, "float64")


def measured_tolerance(config: Config, bias: float, same: tuple[Any, ...], other: tuple[Any, ...]) -> Tolerance:
    """The low-precision check's tolerance: :data:`NOISE_FACTOR` times the noise floor, the
    distance between two one-process steps under the run's recipe that differ only in the order
    of their sums (``same`` and ``other``: :func:`recipe_step` forwards and reversed), each figure
    at least one rounding of its sum (the loss's mean in float64; the gradients' accumulation in
    the master dtype, or the reduction's dtype where replicas are summed in a coarser one): an
    order that happens to round alike in both must not make the check exact."""
    m, t, p = config.model, config.train, config.parallel
    loss_floor = max(abs(other[0] - same[0]) / abs(same[0]) if same[0] else abs(other[0]), terms_diff(same[3], [other[3]]))
    grad_floor = max((rel_diff(other[1][name], g) for name, g in same[1].items()), default=0.0)
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


def rel_diff(a: torch.Tensor, ref: torch.Tensor) -> float:
    num = float((a.to(torch.float64) - ref.to(torch.float64)).norm())
    den = float(ref.to(torch.float64).norm())
    if den == 0.0:
        return 0.0 if num == 0.0 else float("inf")
    return num / den


def terms_diff(ref: dict[str, float], ranks: list[dict[str, float]]) -> float:
    """The largest relative difference of a loss term over the ranks (inf for a term one side lacks)."""
    worst = 0.0
    for got in ranks:
        if set(got) != set(ref):
            return float("inf")
        for name, want in ref.items():
            d = abs(got[name] - want)
            worst = max(worst, d / abs(want) if want else (0.0 if d == 0 else float("inf")))
    return worst
