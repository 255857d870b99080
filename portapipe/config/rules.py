"""Which settings combine: one table of rules, each with its reason.

Config validation (:func:`portapipe.config.load_config`) reports every ``error`` rule a config
breaks, one line each naming the key; the planner drops every candidate that breaks one and
says which rules dropped the user's own setup. ``note`` rules never reject a config: they say
when a combination runs but wastes something (the planner prints them for the user's setup;
``portapipe train`` those about keys the user set, :func:`user_notes`).

A rule's ``check(setup)`` returns its problem lines (none when the rule holds); ``setup`` is a
:class:`~portapipe.config.setup.Setup` (config validation builds one from the config). This module sits
beside :mod:`portapipe.config` and below :mod:`portapipe.plan`, which reads it; it imports
neither (backend facts come from the backend classes' declared capabilities).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .setup import DUALPIPE_FAMILY, Setup, declared_capabilities


@dataclass(frozen=True)
class Rule:
    name: str
    scope: str  # layout | schedule | model | memory | balancer | backend | train
    reason: str
    check: Callable[[Setup], list[str]]
    severity: str = "error"  # error: the setup cannot run; note: it runs, but see the reason


def _one(cond: bool, line: str) -> list[str]:
    return [line] if cond else []


# ------------------------------------------------------------------------------ checks
def _world(x: Setup) -> list[str]:
    prod = x.pp * x.ep * x.dp
    return _one(x.world_size is not None and x.world_size != prod, f"parallel.world_size: {x.world_size} != pp*ep*dp = {x.pp}*{x.ep}*{x.dp} = {prod}")


def _dualpipe_even_pp(x: Setup) -> list[str]:
    return _one(x.schedule == "dualpipe" and x.pp % 2 == 1, f"parallel.pp: {x.pp} is odd; schedule dualpipe needs an even number of pipeline ranks")


def _dualpipe_family_mb(x: Setup) -> list[str]:
    return _one(
        x.schedule in DUALPIPE_FAMILY and x.microbatches < 2 * x.pp,
        f"schedule.microbatches: {x.microbatches} < 2*pp = {2 * x.pp}, the minimum for {x.schedule}",
    )


def _dualpipe_even_mb(x: Setup) -> list[str]:
    return _one(x.schedule == "dualpipe" and x.microbatches % 2 == 1, f"schedule.microbatches: {x.microbatches} is odd; dualpipe feeds half from each end")


def _interleaved(x: Setup) -> list[str]:
    if x.schedule != "interleaved":
        return []
    out = _one(x.chunks < 2, f"schedule.chunks: {x.chunks} < 2; interleaved needs at least 2 chunks per rank (use 1f1b for 1)")
    return out + _one(x.microbatches % x.pp != 0, f"schedule.microbatches: {x.microbatches} is not a multiple of pp = {x.pp}, as interleaved rounds need")


def _one_per_stage(x: Setup) -> list[str]:
    return _one(
        x.schedule in ("1f1b", "zb1p") and x.microbatches < x.pp,
        f"schedule.microbatches: {x.microbatches} < pp = {x.pp}; {x.schedule} needs at least one micro-batch per stage",
    )


def _dualpipe_two_ranks(x: Setup) -> list[str]:
    return _one(x.pp == 1 and x.schedule == "dualpipe", "parallel.pp: 1; dualpipe needs at least 2 pipeline ranks")


def _layers_per_block(x: Setup) -> list[str]:
    from .setup import split_problem

    blocks = x.n_blocks
    if x.layers_per_stage is None:
        return _one(
            x.model.n_layers < blocks,
            f"model.n_layers: {x.model.n_layers} < {blocks} model blocks that schedule {x.schedule} with pp={x.pp} needs (one layer each at least)",
        )
    problem = split_problem(x.model.n_layers, blocks, x.layers_per_stage)
    return [f"{problem} ({x.schedule} with pp={x.pp}" + (f", chunks={x.chunks}" if x.schedule == "interleaved" else "") + ")"] if problem else []


def _experts_over_ep(x: Setup) -> list[str]:
    return _one(x.model.n_experts % x.ep != 0, f"model.n_experts: {x.model.n_experts} is not divisible by parallel.ep = {x.ep}")


def _routing(x: Setup) -> list[str]:
    m = x.model
    out = _one(m.top_k > m.n_experts, f"model.top_k: {m.top_k} > model.n_experts = {m.n_experts}")
    out += _one(m.n_dense > m.n_layers, f"model.n_dense: {m.n_dense} > model.n_layers = {m.n_layers}")
    out += _one(m.n_experts % m.n_groups != 0, f"model.n_groups: {m.n_groups} does not divide model.n_experts = {m.n_experts}")
    if m.topk_groups > m.n_groups:
        out.append(f"model.topk_groups: {m.topk_groups} > model.n_groups = {m.n_groups}")
    elif m.top_k <= m.n_experts and m.top_k > m.topk_groups * (m.n_experts // max(m.n_groups, 1)):
        out.append(f"model.top_k: {m.top_k} > experts reachable in topk_groups = {m.topk_groups} groups of {m.n_experts // max(m.n_groups, 1)}")
    return out


def _n_moe(x: Setup) -> int:
    return x.model.n_layers - x.model.n_dense


def _memory_needs_moe(x: Setup) -> list[str]:
    out = _one(x.zero_memory != "off" and _n_moe(x) <= 0, f"memory.zero_memory: {x.zero_memory} but the model has no MoE layers (n_layers == n_dense)")
    return out + _one(x.recompute == "moe" and _n_moe(x) <= 0, "memory.recompute: moe but the model has no MoE layers (n_layers == n_dense)")


def _memory_layers_fit(x: Setup) -> list[str]:
    per = x.max_stage_layers
    out = _one(x.recompute_layers is not None and x.recompute_layers > per, f"memory.recompute_layers: {x.recompute_layers} > {per} layers in the largest stage")
    return out + _one(
        x.zero_memory_layers is not None and x.zero_memory_layers > per, f"memory.zero_memory_layers: {x.zero_memory_layers} > {per} layers in the largest stage"
    )


def _memory_layers_need_option(x: Setup) -> list[str]:
    out = _one(
        x.zero_memory_layers is not None and x.zero_memory == "off",
        f"memory.zero_memory_layers: {x.zero_memory_layers} is set but memory.zero_memory is off (set level0 or level1)",
    )
    return out + _one(
        x.recompute_layers is not None and x.recompute == "none" and not x.recompute_norms,
        f"memory.recompute_layers: {x.recompute_layers} is set but memory.recompute is none (set norms, moe or full)",
    )


def _zero_memory_not_all_recomputed(x: Setup) -> list[str]:
    per = x.max_stage_layers
    return _one(
        _n_moe(x) > 0 and x.zero_memory != "off" and x.recompute != "none" and (x.recompute_layers or per) >= per,
        f"memory.zero_memory: {x.zero_memory} has no effect: memory.recompute: {x.recompute} recomputes every layer of each stage; "
        + (f"set memory.recompute_layers to at most {per - 1}, " if per > 1 else "set ") + "memory.recompute: none or memory.zero_memory: off",
    )


def _offload_has_effect(x: Setup) -> list[str]:
    """Offloaded parts that keep nothing in any layer memory.offload covers: the model has none of
    them, a recompute of every layer of each stage keeps nothing of them to send, or zero-memory
    level1 on every MoE layer holds what they save."""
    m, per = x.model, x.max_stage_layers
    out = _one(x.offload_layers is not None and not x.offload, f"memory.offload_layers: {x.offload_layers} is set but memory.offload is empty (name the parts)")
    out += _one(x.offload_layers is not None and x.offload_layers > per, f"memory.offload_layers: {x.offload_layers} > {per} layers in the largest stage")
    absent = {"experts": _n_moe(x) <= 0 and not m.mtp_layers, "shared": (_n_moe(x) <= 0 and not m.mtp_layers) or m.n_shared == 0, "dense": m.n_dense == 0}
    why = {"experts": "the model has no MoE layers", "shared": "the model has no shared expert", "dense": "the model has no dense layers (model.n_dense: 0)"}
    for part in x.offload:
        if absent.get(part):
            out.append(f"memory.offload: {part} has no effect: {why[part]}; remove it")
    zeroed = x.zero_memory == "level1" and (x.zero_memory_layers or per) >= per  # its activation's recipe holds what they save
    held = [p for p in x.offload if zeroed and x.recompute == "none" and p in ("shared", "experts")]
    if held:
        out.append(f"memory.offload: {', '.join(held)} {'have' if len(held) > 1 else 'has'} no effect: memory.zero_memory: level1 on every MoE "
                   f"layer keeps the activation's input to make its output again, which holds what {'they save' if len(held) > 1 else 'it saves'}; "
                   "use level0, or set memory.zero_memory_layers below a stage's layers, or remove " + ", ".join(held))
    every = x.recompute != "none" and (x.recompute_layers or per) >= per
    kept_nothing = [p for p in x.offload if every and (x.recompute == "full" or p in ("shared", "experts"))]
    if kept_nothing:
        fix = f"set memory.recompute_layers to at most {per - 1}, or " if per > 1 else ""
        out.append(f"memory.offload: {', '.join(kept_nothing)} {'have' if len(kept_nothing) > 1 else 'has'} no effect: memory.recompute: {x.recompute} recomputes every layer of "
                   f"each stage, which keeps nothing of {'them' if len(kept_nothing) > 1 else 'it'} to send; {fix}remove {', '.join(kept_nothing)}")
    return out


def _optimizer_offload_has_effect(x: Setup) -> list[str]:
    return _one(
        x.optimizer_offload == "off" and x.offload_fraction != 1.0,
        f"train.optimizer_offload_fraction: {x.offload_fraction:g} has no effect: train.optimizer_offload is off (set swap)",
    )


def _host_copies(x: Setup) -> list[str]:
    """Offload copies through the backend's host copies (for ``auto``: refused only when no backend it could pick has them)."""
    keys = (["train.optimizer_offload"] if x.optimizer_offload != "off" else []) + (["memory.offload"] if x.offload else [])
    out = []
    for key in keys:
        problems = [caps.offload_problem(name, key) for name, caps in _declared(x)]
        out += [problems[0]] if problems and all(problems) else []
    return out


def _balancer_needs_moe(x: Setup) -> list[str]:
    b = x.balancer
    out = _one(b.kind != "none" and _n_moe(x) <= 0, f"balancer.kind: {b.kind} but the model has no MoE layers")
    return out + _one(b.kind == "lplb" and b.topology == "torus" and b.torus is None, "balancer.torus: missing; topology torus needs torus: [m, n]")


def _lplb_slots(x: Setup) -> list[str]:
    b, m = x.balancer, x.model
    if b.kind != "lplb":
        return []
    out: list[str] = []
    torus = b.torus or (0, 0)
    size = {"cube": 8, "hypercube": 16, "ring": x.ep, "torus": torus[0] * torus[1]}[b.topology]
    classes = 1 if b.topology == "ring" else 2
    if x.ep < 2:
        out.append(f"parallel.ep: {x.ep}; balancer.kind lplb moves tokens between EP ranks and needs ep >= 2")
    elif size and x.ep % size:
        out.append(f"balancer.topology: {b.topology} groups {size} ranks, which does not divide parallel.ep = {x.ep}")
    if b.topology == "torus" and b.torus is not None and min(b.torus) < 2:
        out.append(f"balancer.torus: {list(b.torus)}; both sides of the torus need at least 2 ranks")
    if b.redundant < classes or b.redundant % classes:
        out.append(
            f"balancer.redundant: {b.redundant}; lplb with topology {b.topology} needs a positive multiple of "
            f"{classes} redundant slots per EP rank (each copies another rank's expert)"
        )
    elif x.ep and b.redundant > m.n_experts // x.ep:
        out.append(f"balancer.redundant: {b.redundant} > model.n_experts / parallel.ep = {m.n_experts // x.ep}; lplb copies each of a rank's experts at most once")
    return out


def _balancer_nodes(x: Setup) -> list[str]:
    b = x.balancer
    return _one(b.kind != "none" and x.ep % b.nodes != 0, f"balancer.nodes: {b.nodes} does not divide parallel.ep = {x.ep}")


def _eplb_shape(x: Setup) -> list[str]:
    b, m = x.balancer, x.model
    if b.kind != "eplb":
        return []
    # one rule whatever the policy and node count (as `portapipe balance`): groups divide the experts;
    # hierarchical becomes global when the groups do not divide evenly over the nodes
    groups = b.groups or m.n_groups
    out = _one(m.n_experts % groups != 0, f"balancer.groups: {groups} does not divide model.n_experts = {m.n_experts}")
    per_rank = m.n_experts // x.ep + b.redundant if x.ep else 0
    return out + _one(
        b.policy in ("incremental", "refined") and per_rank > m.n_experts,
        f"balancer.redundant: {b.redundant} gives {per_rank} slots per EP rank for {m.n_experts} experts; policy "
        f"{b.policy} holds each expert at most once per rank, so redundant <= {m.n_experts - m.n_experts // x.ep}",
    )


def _architecture(x: Setup) -> list[str]:
    return x.model.problems()


def _lr(x: Setup) -> list[str]:
    from ..optim import lr_schedule

    t = x.train
    if t.lr_schedule is None:
        out = _one(t.min_lr > t.lr, f"train.min_lr: {t.min_lr} > train.lr = {t.lr}")
        s = t.lr_schedule_steps
        out += _one(s is not None and s < t.warmup_steps, f"train.lr_schedule_steps: {s} < train.warmup_steps = {t.warmup_steps}")
        key, lr = "train.lr", t.lr
    else:
        phases = lr_schedule.resolve(t.lr_schedule, t.lr)
        out = lr_schedule.problems(phases)
        lr = lr_schedule.peak(phases, t.lr)
        key = "train.lr" if lr == t.lr else f"train.lr_schedule[{[p.lr for p in phases].index(lr)}].lr"
    if x.model is None:
        return out
    import torch

    from ..optim.precision import master_dtype

    # AdamW's first step scales the update by lr / (1 - beta1) and the weights by 1 - lr x decay,
    # each a number in the dtype of the weights it updates: one that dtype cannot hold fails a rank
    # (the schedule's largest learning rate: any step may be the first of a resumed run)
    dtype = master_dtype(x.model.dtype, t.master_dtype)
    largest = torch.finfo(getattr(torch, dtype)).max
    scalar = max(lr / (1.0 - t.betas[0]), abs(1.0 - lr * t.weight_decay))
    below = min(largest * (1.0 - t.betas[0]), largest / t.weight_decay if t.weight_decay else largest)
    return out + _one(scalar > largest, f"{key}: {lr:g}: AdamW's first step multiplies by {scalar:.3g}, more than {dtype} "
                      f"(the dtype of the weights it updates) holds ({largest:.3g}); give a learning rate below {below:.3g}")


def _known_backend(x: Setup) -> list[str]:
    from ..backends.registry import PluginError, backend_class, known_backends  # built-ins and plug-ins; imports no device code

    known = known_backends()
    if x.backend == "auto":
        return []
    if x.backend not in known:
        return [f"backend: {x.backend!r} is not a known backend; known: auto, {', '.join(known)}"]
    try:
        backend_class(x.backend)  # a plug-in's module imported: one that fails is named here, not by a rank
    except PluginError as exc:
        return [str(exc)]
    return []


def _declared(x: Setup) -> list[tuple[str, Any]]:
    """(name, capabilities) of the setup's backend; for ``auto``, of every backend it could pick."""
    return declared_capabilities(x.backend)


def _transport(x: Setup) -> list[str]:
    t = x.backend_options.get("ep_transport", "alltoall")
    problems = [caps.transport_problem(name, t) for name, caps in _declared(x)]
    # auto: refused only when no backend offers the transport (the device is not known yet)
    return [problems[0]] if problems and all(problems) else []


def _fp8_matmul(x: Setup) -> list[str]:
    """``train.fp8`` needs a backend that declares an FP8 matmul (for ``auto``: any it could pick)."""
    if x.train is None or x.train.fp8 == "off":
        return []
    problems = [caps.fp8_problem(name) for name, caps in _declared(x)]
    return [problems[0]] if problems and all(problems) else []


def _fp8_activations(x: Setup) -> list[str]:
    """FP8-cached activations keep what the FP8 GEMMs made: without train.fp8 there is none."""
    off = x.train is None or x.train.fp8 == "off"
    return _one(x.fp8_activations and off, "memory.fp8_activations: true keeps the FP8 rows the FP8 GEMMs make, "
                "but train.fp8 is off: set train.fp8: deepseek or memory.fp8_activations: false")


def _model_dtype(x: Setup) -> list[str]:
    if x.backend == "auto":
        return []
    return [p for name, caps in _declared(x) if (p := caps.dtype_problem(name, x.model.dtype))]


def _reduce_dtype(x: Setup) -> list[str]:
    """The dtype gradients are summed over the replicas in must be one the backend reduces."""
    if x.backend == "auto" or x.train is None or x.model is None or x.replicas == 1:
        return []  # the device is not known yet, or nothing is summed over replicas
    from ..optim.precision import reduce_dtype

    t = x.train
    dtype = reduce_dtype(x.model.dtype, t.master_dtype, t.grad_reduce_dtype)
    key, value = ("train.grad_reduce_dtype", t.grad_reduce_dtype) if t.grad_reduce_dtype != "auto" else (
        ("train.master_dtype", t.master_dtype) if t.master_dtype != "auto" else ("model.dtype", x.model.dtype))
    out = []
    for name, caps in _declared(x):
        if dtype in caps.reduce_dtypes or (key == "model.dtype" and caps.dtype_problem(name, dtype)):
            continue  # a model dtype the backend does not compute in is the model-dtype rule's line
        fix = "use one of those" if key == "train.grad_reduce_dtype" else "set train.grad_reduce_dtype to one of those"
        out.append(
            f"{key}: {value}: the gradients of the {x.replicas} replicas (dp x ep) are summed in {dtype}, which backend {name!r} "
            f"does not reduce (capabilities.reduce_dtypes: {', '.join(caps.reduce_dtypes)}); {fix}"
        )
    return out


def _overlap_needs_pairs(x: Setup) -> list[str]:
    return _one(
        x.ep > 1 and x.overlap and x.schedule in ("1f1b", "zb1p"),
        f"schedule.overlap: {x.schedule} has no F&B pairs, so the all-to-all is hidden only by the shared expert"
        + (" and the F&F pairs of its forwards in a row" if x.paired_blocks else ""),
    )


def _extra_exchange_needs_pairs(x: Setup) -> list[str]:
    pairs = x.overlap and x.schedule not in ("1f1b", "zb1p")
    extra = x.zero_memory != "off" or x.recompute != "none"
    return _one(
        x.ep > 1 and extra and not pairs,
        f"memory: {x.memory_label()} adds all-to-alls that only F&B pairs hide (dualpipe, dualpipev, interleaved with overlap on); "
        f"with {x.schedule}{'' if x.overlap else ', overlap off'} they run exposed",
    )


def _pair_forwards_idle(x: Setup) -> list[str]:
    why = "schedule.overlap is false" if not x.overlap else "no block's forward exchanges rows (ep = 1 or no MoE layer)"
    return _one(x.pair_forwards and not x.paired_blocks, f"schedule.pair_forwards: {why}, so no forwards are paired")


def _eplb_without_ep(x: Setup) -> list[str]:
    return _one(
        x.balancer.kind == "eplb" and x.ep == 1,
        "balancer.kind: eplb with ep = 1 keeps every expert on the one EP rank: there is no load between ranks to balance",
    )


def _zero_without_replicas(x: Setup) -> list[str]:
    return _one(
        x.zero_stage > 0 and x.replicas == 1,
        f"train.zero_stage: {x.zero_stage} shards over each weight's replicas, and with dp = ep = 1 every weight has one: nothing is sharded",
    )


def _moments_lag(x: Setup) -> list[str]:
    if x.train is None or x.model is None:
        return []
    from ..optim.precision import moments_lag

    return moments_lag(x)


def _overlap_without_ep(x: Setup) -> list[str]:
    return _one(x.ep == 1 and x.overlap and _n_moe(x) > 0, "schedule.overlap: with ep = 1 the experts are local: no all-to-all to hide")


RULES: tuple[Rule, ...] = (
    Rule("world-size", "layout", "the launcher starts pp*ep*dp ranks, one per mesh position", _world),
    Rule("dualpipe-even-pp", "schedule", "DualPipe feeds micro-batches from both ends: two halves of pp/2 ranks", _dualpipe_even_pp),
    Rule("dualpipe-family-microbatches", "schedule", "DualPipe and DualPipeV fill both directions of the pipeline before the steady F&B phase: at least 2*pp micro-batches", _dualpipe_family_mb),
    Rule("dualpipe-even-microbatches", "schedule", "DualPipe sends half the micro-batches down each direction", _dualpipe_even_mb),
    Rule("interleaved-rounds", "schedule", "interleaved 1F1B sends micro-batches through each chunk in rounds of pp; one chunk is plain 1F1B", _interleaved),
    Rule("one-microbatch-per-stage", "schedule", "1F1B and ZB1P keep every stage busy only with at least one micro-batch per stage", _one_per_stage),
    Rule("dualpipe-two-ranks", "schedule", "DualPipe needs a rank at each end", _dualpipe_two_ranks),
    Rule("layers-per-block", "layout", "each model block (pp, 2*pp for DualPipeV, pp*chunks for interleaved) holds at least one layer, "
         "or parallel.layers_per_stage's count (the first and the last may hold none), all adding up to model.n_layers", _layers_per_block),
    Rule("experts-over-ep", "layout", "routed experts are sharded evenly over the EP ranks", _experts_over_ep),
    Rule("routing", "model", "top-k routing chooses among the experts of the allowed groups", _routing),
    Rule("architecture", "model", "each architecture has its own keys and shapes (heads, RoPE widths, its router's groups)", _architecture),
    Rule("memory-needs-moe", "memory", "zero-memory and MoE recompute act on MoE layers only", _memory_needs_moe),
    Rule("memory-layers-fit", "memory", "the layer counts are per stage, so they cannot exceed a stage's layers", _memory_layers_fit),
    Rule("memory-layers-need-option", "memory", "a layer count without its option does nothing", _memory_layers_need_option),
    Rule("zero-memory-not-all-recomputed", "memory", "a recomputed layer keeps nothing that zero-memory could drop", _zero_memory_not_all_recomputed),
    Rule("offload-has-effect", "memory", "memory.offload sends the tensors a part saves that nothing else holds; a part the model lacks, "
         "one a recompute of every layer keeps nothing of, or one zero-memory level1's recipes hold, sends nothing (the layer counts are per stage)",
         _offload_has_effect),
    Rule("optimizer-offload-fraction", "train", "the fraction says how much of the optimizer state train.optimizer_offload: swap keeps on the host", _optimizer_offload_has_effect),
    Rule("balancer-needs-moe", "balancer", "balancers place routed experts", _balancer_needs_moe),
    Rule("lplb-slots", "balancer", "LPLB moves tokens to a copy on a neighbouring EP rank of its topology", _lplb_slots),
    Rule("balancer-nodes", "balancer", "a balancer's nodes hold equal shares of the EP ranks", _balancer_nodes),
    Rule("eplb-shape", "balancer", "EPLB packs expert groups onto nodes; incremental and refined hold an expert at most once per rank", _eplb_shape),
    Rule("lr-range", "train", "the schedule decays the learning rate from lr to min_lr, after the warm-up; AdamW's first step "
         "(lr / (1 - beta1), 1 - lr x weight_decay) fits the master dtype", _lr),
    Rule("known-backend", "backend", "backends are built in or registered as plug-ins", _known_backend),
    Rule("ep-transport", "backend", "each backend declares its expert transports (capabilities.ep_transports); every backend has all-to-all", _transport),
    Rule("fp8-matmul", "backend", "train.fp8 runs its GEMMs through the backend's FP8 matmul (capabilities.fp8_matmul: blockwise or emulated)", _fp8_matmul),
    Rule("fp8-activations-need-fp8", "memory", "FP8-cached activations keep the FP8 values and scales the FP8 GEMMs make (train.fp8)", _fp8_activations),
    Rule("host-copies", "backend", "offload copies between host and device memory through the backend (capabilities.host_copies)", _host_copies),
    Rule("model-dtype", "backend", "the model computes in a dtype the backend's matmul takes (capabilities.compute_dtypes)", _model_dtype),
    Rule("reduce-dtype", "backend", "the replicas' gradients are summed in a dtype the backend's collectives reduce (capabilities.reduce_dtypes)", _reduce_dtype),
    Rule("overlap-needs-pairs", "schedule", "the F&B overlap hides one micro-batch's all-to-all behind another's compute; 1F1B and ZB1P run no pairs", _overlap_needs_pairs, "note"),
    Rule("extra-exchange-needs-pairs", "memory", "zero-memory's re-dispatch and recompute's replayed all-to-alls are hidden by the other micro-batch of an F&B pair", _extra_exchange_needs_pairs, "note"),
    Rule("overlap-without-ep", "schedule", "with one EP rank the experts need no all-to-all", _overlap_without_ep, "note"),
    Rule("eplb-needs-ep", "balancer", "EPLB evens the EP ranks' loads by placing and copying experts across them", _eplb_without_ep, "note"),
    Rule("zero-needs-replicas", "train", "ZeRO shards the optimizer state (stage 2: the gradients too) over a weight's replicas: dp x ep for the weights outside the experts, dp for the experts'", _zero_without_replicas, "note"),
    Rule("moments-follow-betas", "train", "a moment takes a step of 1 - beta towards its target each update; in a coarse dtype (bfloat16) a step below half its spacing rounds away", _moments_lag, "note"),
    Rule("pair-forwards-needs-exchanges", "schedule", "an F&F pair hides one forward's all-to-all behind another's compute: it needs the overlap and blocks that exchange rows", _pair_forwards_idle, "note"),
)


def violations(setup: Setup, severity: str = "error", scopes: tuple[str, ...] | None = None) -> list[str]:
    """Problem lines of every rule of ``severity`` (and ``scopes``, default all) that ``setup`` breaks, in table order."""
    out: list[str] = []
    for rule in RULES:
        if rule.severity == severity and (scopes is None or rule.scope in scopes):
            out += rule.check(setup)
    return out


def _away_from_default(config: Any, key: str) -> bool:
    """Whether ``config`` sets ``key`` (``section.name``, or a whole ``section``) to something other than its default."""
    section, _, name = key.partition(".")
    part = getattr(config, section, None)
    fields = getattr(type(part), "model_fields", {})
    names = [name] if name else list(fields)
    return any(n in fields and getattr(part, n) != fields[n].get_default(call_default_factory=True) for n in names)


def user_notes(config: Any) -> list[str]:
    """The note rules' lines about keys ``config`` sets away from their defaults (what ``portapipe
    train`` says at start). A key at its default stays quiet: ``schedule.overlap: true`` with one
    EP rank costs nothing and was no choice (a config written back holds every key)."""
    lines = violations(Setup.from_config(config), severity="note")
    return [line for line in lines if _away_from_default(config, line.split(":", 1)[0])]


def broken(setup: Setup, scopes: tuple[str, ...] | None = None) -> list[tuple[Rule, list[str]]]:
    """The error rules ``setup`` breaks, with their lines (for saying why a candidate was dropped)."""
    out = []
    for rule in RULES:
        if rule.severity == "error" and (scopes is None or rule.scope in scopes):
            lines = rule.check(setup)
            if lines:
                out.append((rule, lines))
    return out


def table() -> list[dict[str, Any]]:
    """The rules as rows: name, scope, severity, reason (docs and ``portapipe plan --rules``)."""
    return [{"name": r.name, "scope": r.scope, "severity": r.severity, "reason": r.reason} for r in RULES]
