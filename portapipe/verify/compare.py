"""The pipelined step against a reference: loss, gradients, biases and loss terms, within a tolerance."""

from __future__ import annotations

from typing import Any

import torch

from ..config import Config
from .pipelined import generated_batch
from .recipe import recipe_step, route_replay
from .reference import reference_step
from .report import VerifyReport
from .tolerance import EXACT, Tolerance, measured_tolerance, rel_diff, terms_diff


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
            d = rel_diff(g, want)
            if not worst_name or d > worst:
                worst, worst_name = d, name
        for layer, bias in r["biases"].items():
            bias_diff = max(bias_diff, float((bias - ref_biases[layer]).abs().max()))
    loss_diff = max(abs(r["loss"] - ref_loss) for r in rank_results)
    return loss_diff, worst, worst_name, bias_diff, terms_diff(ref_terms, [r.get("loss_terms", {}) for r in rank_results])


def fp8_count(rank_results: list[dict[str, Any]]) -> int | None:
    """How many Linears ran in FP8 on the ranks, each once however many ranks hold it (DualPipe's
    two copies, the replicas); None where the ranks ran without ``train.fp8`` (the reference of an
    FP8 step runs without it: the ranks say)."""
    names = [r.get("fp8_linears") for r in rank_results]
    if all(n is None for n in names):
        return None
    return len({n for ranks in names if ranks for n in ranks})


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
        batch=generated_batch(config),
        fp8_linears=fp8_count(rank_results),
    )


