"""The validation loss a run ends with (and its EMA weights' with ``train.ema_decay``)."""

from __future__ import annotations

from typing import Any

from ..config import Config
from ..data.batches import Batches, replica_of
from ..scheduling.spans import COMPUTE, span

VAL_BATCHES = 4  # validation steps' worth of micro-batches evaluated at the end


def validation_loss(runtime: Any, data: Batches, config: Config, groups: Any) -> tuple[float | None, dict[str, float]]:
    """(mean loss over the validation sources, weighted as they are, each source's loss): each
    source's over ``VAL_BATCHES`` steps of its own validation data, on the model as training left
    it; nothing is changed. It is the main next-token loss (the objective's other terms apart), so
    runs with and without multi-token prediction or the balance loss compare.

    Each batch runs the schedule's forwards alone (:meth:`~portapipe.scheduling.executor.PipelineExecutor.evaluate`:
    no backward, no gradients). What the forwards leave in the model (the routers' expert counts,
    the balancer's and expert clocks' figures, the RNG) is undone after each batch
    (:meth:`~portapipe.compose.PipelineRuntime.unchanged`), so evaluating never changes training.
    """
    parts = data.parts("val")
    if not parts or any(p.tokens < config.model.seq_len + 1 for p in parts):
        return None, {}
    replica, replicas = replica_of(groups)
    by_source: dict[str, float] = {}
    for source, (part, name) in enumerate(zip(parts, data.names["val"])):
        losses = []
        for i in range(VAL_BATCHES):
            shape = (config.schedule.microbatches, config.train.micro_batch_size, config.model.seq_len)
            batches = data.microbatches(i, replica, replicas, *shape, split="val", source=source)
            runtime.keep_targets(data.kept_per_microbatch(i, replicas, *shape, split="val", source=source))
            with runtime.unchanged():
                losses.append(float(runtime.evaluate(batches).loss))
        by_source[name] = sum(losses) / len(losses)
    total = sum(p.weight for p in parts)
    return sum(p.weight / total * loss for p, loss in zip(parts, by_source.values())), by_source


def final_validation(runtime: Any, data: Batches, config: Config, groups: Any, ema: Any, skip: bool) -> dict[str, Any]:
    """The summary's validation figures: ``val_loss``, with an ``ema`` (``train.ema_decay``) also
    ``val_loss_ema`` (its weights swapped in for the evaluation, then the trained ones back), and
    ``val_loss_by_source``; all empty with ``skip`` (a run that ended early)."""
    with span(COMPUTE, "validation"):
        val_loss, by_source = (None, {}) if skip else validation_loss(runtime, data, config, groups)
    out: dict[str, Any] = {"val_loss": val_loss}
    if ema is not None:
        out["val_loss_ema"] = None
        if val_loss is not None:
            with ema.swapped_in(list(runtime.parameters())), span(COMPUTE, "validation (EMA)"):
                out["val_loss_ema"], _ = validation_loss(runtime, data, config, groups)
    out["val_loss_by_source"] = by_source
    return out
