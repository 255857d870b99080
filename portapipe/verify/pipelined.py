"""The pipelined side: each rank builds its runtime, runs one step on the verify data and reports
its loss, gradients, routes and loss terms."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from ..config import Config, config_from_dict
from ..data.samples import IGNORE, make_microbatches
from ..compose import PipelineRuntime
from ..metrics.step import everywhere
from ..models.routing import ForcedRouting
from ..optim.precision import LossScaler
from ..scheduling.executor import mean_loss
from ..scheduling.ir import Kind
from ..scheduling.stage import is_expert


def microbatches(config: Config, replica: int) -> list[tuple[torch.Tensor, ...]]:
    """Random token micro-batches of one replica, drawn from the seed, made as training makes its
    own (:func:`portapipe.data.samples.make_microbatches`). With ``data.document_mask`` or
    ``data.mask_eos_loss`` each token also starts a document with probability 1 / 8, so the
    samples hold documents of every length from one token on. The config's data are not read."""
    d = config.data
    windows, starts = _windows(config, replica)
    return make_microbatches(windows, starts, config.schedule.microbatches, d.document_mask, d.mask_eos_loss)


def _windows(config: Config, replica: int) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`microbatches`'s windows of ``seq_len + 1`` tokens, and where documents start in them
    (None without the data options that read documents)."""
    m, t, d = config.model, config.train, config.data
    documents = d.document_mask or d.mask_eos_loss
    windows, starts = [], []
    for mb in range(config.schedule.microbatches):
        g = torch.Generator().manual_seed(t.seed * 1_000_003 + replica * 1009 + mb)
        windows.append(torch.randint(0, m.vocab_size, (t.micro_batch_size, m.seq_len + 1), generator=g))
        if documents:
            starts.append(torch.rand(t.micro_batch_size, m.seq_len + 1, generator=g) < 1 / 8)
    return torch.cat(windows).numpy(), torch.cat(starts).numpy() if documents else None


def generated_batch(config: Config) -> dict[str, Any]:
    """What the step checked: the global batch :func:`microbatches` generates (every replica's
    micro-batches), in sequences and input tokens, and with the data options that read documents,
    how many documents (or pieces of one) the inputs hold; the config's data named as not read."""
    d = config.data
    replicas = config.parallel.dp * config.parallel.ep
    sequences = replicas * config.schedule.microbatches * config.train.micro_batch_size
    out: dict[str, Any] = {"kind": "generated", "sequences": sequences, "tokens": sequences * config.model.seq_len}
    if d.document_mask or d.mask_eos_loss:
        # a sample's inputs (its first seq_len tokens) hold one document, plus one per start after the first token
        out["documents"] = sum(sequences // replicas + int(np.count_nonzero(_windows(config, r)[1][:, 1:-1])) for r in range(replicas))
    out["data"] = "not read: " + (f"data.path {d.path}" if d.path is not None else
                                  f"data.sources ({len(d.sources)})" if d.sources else f"the shipped corpus (data.format {d.format})")
    return out


def kept_per_microbatch(config: Config) -> float | None:
    """Under ``data.mask_eos_loss``: the targets kept in the step's global batch (every replica's
    micro-batches) over its micro-batches, as training tells the loss
    (:meth:`~portapipe.data.batches.Batches.kept_per_microbatch`); None without the option."""
    if not config.data.mask_eos_loss:
        return None
    replicas = config.parallel.dp * config.parallel.ep
    kept = sum(int((mb[1] != IGNORE).sum()) for r in range(replicas) for mb in microbatches(config, r))
    return kept / (replicas * config.schedule.microbatches)


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
    runtime.keep_targets(kept_per_microbatch(config))
    return runtime, microbatches(config, groups.dp_rank * p.ep + groups.ep_rank)


def tracked_step(backend: Any, raw: dict[str, Any]) -> tuple[PipelineRuntime, int]:
    """This rank's runtime for ``raw`` after one step whose saved activations were counted
    (:class:`~portapipe.memory.accounting.SavedActivations`), and their peak in bytes."""
    rt, peak, _ = routed_step(backend, raw)
    return rt, peak


def routed_step(backend: Any, raw: dict[str, Any]) -> tuple[PipelineRuntime, int, dict[tuple[int, int], tuple[tuple[int, float, float], ...]]]:
    """:func:`tracked_step`, and the routing of that step on this rank (:func:`routed_rows`)."""
    from ..memory.accounting import SavedActivations

    rt, data = runtime_for(backend, raw)
    tracker = SavedActivations(ignore=rt.parameters())
    with recording_rows(rt) as calls, tracker.step():
        rt.step(data)
    return rt, tracker.peak_bytes, routed_rows(rt, calls)


@contextlib.contextmanager
def recording_rows(runtime: PipelineRuntime) -> Iterator[dict[int, list[tuple[float, float]]]]:
    """Records, while open, per MoE layer (by index) and forward in call order, the rows its
    experts ran on and of them the rows this rank routed to itself, each over its even share (the
    micro-batch's tokens x top_k, and that over the EP ranks); a recompute's replay is not a
    forward of its own."""
    calls: dict[int, list[tuple[float, float]]] = {}

    def recording(layer: Any, program: Any) -> Any:
        top_k, ep = layer.top_k, layer.moe.ep.size

        def moe_program(tape: Any, h: torch.Tensor, hn: torch.Tensor, send: torch.Tensor, local: torch.Tensor, *rest: Any) -> Any:
            plan = rest[1]
            own = local.shape[0]
            out = yield from program(tape, h, hn, send, local, *rest)
            if tape.replay:  # a recompute's replay routes as its forward did
                return out
            # read once the program ran: the received counts travel while it starts
            rows = own + (sum(plan.remote_recv_splits) if ep > 1 else 0)
            even = h.shape[:-1].numel() * top_k
            calls.setdefault(layer.index, []).append((rows / even, own / (even / ep)))
            return out

        return moe_program

    layers = runtime.moe_layers()
    for layer in layers:
        layer.moe_program = recording(layer, layer.moe_program)
    try:
        yield calls
    finally:
        for layer in layers:
            del layer.moe_program  # the class's again


def routed_rows(runtime: PipelineRuntime, calls: dict[int, list[tuple[float, float]]]) -> dict[tuple[int, int], tuple[tuple[int, float, float], ...]]:
    """One step's :func:`recording_rows` by (stage, micro-batch) of this rank, per MoE layer
    ``(layer, rows, own)``: the ``routing`` of :class:`~portapipe.plan.memory_model.MemoryModel`.
    A stage's layers ran once per forward of the step, in the order of the rank's forwards
    (ValueError otherwise: no step or a second one recorded)."""
    sched = runtime.schedule
    stage_of = {sched.stage_block[v]: v for v in sched.stages_of(runtime.groups.pp_rank)}
    forwards: dict[int, list[int]] = {}  # stage -> its micro-batches, in the order they ran
    for a in runtime.actions:
        for h in a.halves():
            if h.kind is Kind.F:
                forwards.setdefault(h.stage, []).append(h.mb)
    per: dict[tuple[int, int], list[tuple[int, float, float]]] = {}
    for b, block in runtime.blocks.items():
        v = stage_of[b]
        mbs = forwards.get(v, [])
        for layer in block.moe_layers():
            got = calls.get(layer.index, [])
            if len(got) != len(mbs):
                raise ValueError(f"layer {layer.index} ran {len(got)} forwards, stage {v} has {len(mbs)} in the step")
            for mb, (rows, own) in zip(mbs, got):
                per.setdefault((v, mb), []).append((layer.index, rows, own))
    return {k: tuple(sorted(layers)) for k, layers in per.items()}


def route_by_position(config: Config, moe_layers: list[Any]) -> None:
    """Every router sends token t of a micro-batch to experts (t k + j) mod E, j < k: the same on
    the ranks and in the reference, whatever the order of their calls."""
    for layer in moe_layers:
        layer.moe.router.forced = ForcedRouting(config.model.n_experts, config.model.top_k, restart=True)


def rank_step(backend: Any, raws: list[dict[str, Any]], by_position: bool = False) -> list[dict[str, Any]]:
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
        "biases": {f"{layer.index}": b.detach().cpu().clone() for layer in runtime.moe_layers() if (b := router_bias(layer)) is not None},
        "timings": result.timings,
        "expert_counts": None if result.expert_counts is None else result.expert_counts.cpu(),
        "expert_layers": result.expert_layers,
        "tokens": result.tokens,
        "loss_terms": dict(result.loss_terms),
        "fp8_linears": None if runtime.config.train.fp8 == "off" else fp8_running(runtime),
    }


def fp8_running(runtime: PipelineRuntime) -> list[str]:
    """The Linears of this rank's blocks that ran in FP8 (their names in the single-process model)."""
    from ..models.fp8_layers import fp8_linears

    return sorted({lin.name for lin in fp8_linears(runtime.blocks) if lin.module.fp8})


def router_bias(layer: Any) -> torch.Tensor | None:
    """The router's load-balancing bias (a softmax router has none)."""
    return getattr(layer.moe.router, "bias", None)


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def updated_biases(blocks: dict[int, Any]) -> dict[str, torch.Tensor]:
    """Every router's bias after its step on the loads the blocks counted."""
    biases = {}
    for b in range(len(blocks)):
        for layer in blocks[b].moe_layers():
            layer.moe.router.update_bias(layer.moe.step_counts)
            if (bias := router_bias(layer)) is not None:
                biases[f"{layer.index}"] = bias.detach().cpu().clone()
    return biases


def term_means(terms: list[list[dict[str, float]]]) -> dict[str, float]:
    """Each loss term's mean over (replica, micro-batch), summed as the ranks sum it."""
    names = sorted({name for row in terms for mb in row for name in mb})
    return {name: mean_loss([[mb[name] for mb in row] for row in terms]) for name in names}
