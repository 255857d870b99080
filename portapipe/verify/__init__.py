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

The pipelined step runs on ``pp x dp x ep`` ranks (:func:`portapipe.ranks.launch.run_ranks`) with
the configured schedule, overlap and W split; the reference builds the whole model in this
process (same seed, so the same weights), runs every replica's micro-batches through it as one
plain autograd graph each, and seeds each backward with the same 1 / (micro-batches x
replicas). Data are random tokens drawn from the seed per (replica, micro-batch): the config's
data are not read (the report's ``batch`` says so). Before any rank starts, a config is refused
where training refuses its model (:func:`portapipe.models.checks.model_problems`: the weights to
start from, ``train.fp8`` with no Linear able to run in FP8) or its schedule, with training's lines.

Why the loss can match bit for bit: every token's arithmetic is the same in both runs. Each
micro-batch passes through the same shapes (a rank sees exactly one replica's micro-batch),
the expert matmuls are row-independent (in float64 the CPU's grouped matmul sums each row over k
in order, :func:`~portapipe.backends.grouped_mm.rowwise_grouped_mm`: a BLAS matmul rounds a row by
the size of its group, which a balancer's replicas change), the SwiGLU activation is written
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

from typing import Any

from ..config import Config, ConfigError
from ..ranks.launch import run_ranks
from ..scheduling.executor import build_schedule
from .compare import compare
from .pipelined import rank_step
from .report import VerifyReport
from .tolerance import checked, in_dtype


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
    from ..models.checks import model_problems

    forced = [line for c in configs for line in forced_routing_problems(c)]
    if forced:
        raise ConfigError(forced)
    # what training refuses of the model (its weights, FP8 where nothing would run in it), before any rank starts
    refused = [line for c in configs for line in model_problems(c)]
    if refused:
        raise ConfigError(refused)
    plans = [checked(c, precision) for c in configs]
    ranks_configs = [ranks for ranks, _, _ in plans]
    references = [in_dtype(c, "float64", backend="cpu") for c in configs]  # under FP8: the unquantized float64 step
    by_position = precision == "model" or any(c.train.fp8 != "off" for c in configs)
    for c in ranks_configs:
        build_schedule(c)  # a schedule or split that cannot run fails here, before any rank starts
    steps = run_steps(ranks_configs, by_position, wall_timeout_s)
    return [compare(ref, ranks, tol, changed, by_position, recipe) for ref, ranks, (recipe, tol, changed) in zip(references, steps, plans)]


def run_steps(configs: list[Config], by_position: bool = False, wall_timeout_s: float = 600.0) -> list[list[dict[str, Any]]]:
    """One pipelined step of each config (one world size and backend) in one launch of ranks:
    per config, every rank's :func:`step_report` in rank order (with ``by_position``, routed by
    position, with the balancer's routes)."""
    per_rank = run_ranks(
        rank_step,
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
