"""A rank's training state as logical tensors (the single-process model's names), and back.

What a rank contributes to a checkpoint (a nested dict that DCP flattens to dotted keys):

- ``model.<name>``: parameters and persistent buffers (the routers' ``bias``), routed experts one
  per logical expert (``layers.3.moe.experts.5.gate_up``), in the model dtype (what ``portapipe
  export`` writes: the master weights cast);
- ``master.<name>``: the master weights, when the optimizer keeps them apart from the parameters
  (another dtype, or sharded), so a run may resume in another model or master dtype and zero
  stage (a checkpoint without them: the parameters are the master weights);
- ``optim.<name>.{exp_avg, exp_avg_sq, step}``: AdamW's state under the same names, whole
  (a sharded optimizer's ranges are gathered first), so any ``zero_stage`` and dp size reads it;
  the moments in the dtype they are kept in (``train.moments_dtype``), read in whatever dtype
  the resuming run keeps them;
- ``balancer.<layer>.{phy2log, log2phy, loads, planned}``: the expert placement in force (and whether it came from loads), the window of
  recorded per-expert loads, per MoE layer (global index);
- ``ema.<name>``: the host EMA of the weights (``train.ema_decay``), float32, whole;
- ``rng.<device type>``: rank 0's generator states;
- ``stamp.<rank>``: the run id and step this rank's part belongs to.

Only a rank's *owned* share is written (one copy of a replicated expert); DualPipe's two copies
of a block and the data-parallel replicas write the same keys with the same values, and DCP's
save plan keeps one. Every tensor is a CPU copy, so a checkpoint holds no device tensors and the
training may go on while it is written. Loading asks DCP for exactly the keys this rank holds, in
whatever layout: that is the resharding.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..scheduling.stage import expert_ids, is_expert, load_logical_state, logical_slices, logical_state, mark_expert, owned_rows

MOMENTS = ("exp_avg", "exp_avg_sq")


def named_state(runtime: Any) -> list[tuple[str, torch.Tensor]]:
    """This rank's parameters and persistent buffers under their logical names (markers kept)."""
    return [item for b in sorted(runtime.blocks) for item in runtime.blocks[b].state_dict(keep_vars=True).items()]


def _params(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in named if isinstance(p, nn.Parameter)]


def _shaped_like(t: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``t`` (an AdamW moment of ``p``) seen with ``p``'s expert markers, so it splits per expert as ``p`` does."""
    if not is_expert(p):
        return t
    v = t.view_as(t)
    mark_expert(v, expert_ids(p))
    owned = owned_rows(p)
    if owned is not None:
        v.slot_owned = owned  # type: ignore[attr-defined]
    return v


def capture(runtime: Any, optimizer: Any, balancer: Any, rng: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """This rank's share of the logical state (CPU copies; see the module docstring; collective
    under a sharded optimizer)."""
    named = named_state(runtime)
    full = dict(optimizer.full_state())  # parameter -> whole exp_avg, exp_avg_sq (and master)
    state: dict[str, Any] = {"model": logical_state(named)}
    masters = [(n, _shaped_like(full[p]["master"], p)) for n, p in _params(named) if p in full and "master" in full[p]]
    if masters:
        state["master"] = logical_state(masters)
    emas = [(n, _shaped_like(full[p]["ema"], p)) for n, p in _params(named) if p in full and "ema" in full[p]]
    if emas:
        state["ema"] = logical_state(emas)
    params = [(n, p) for n, p in _params(named) if p in full and optimizer.steps]
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for kind in MOMENTS:
        moments = [(n, _shaped_like(full[p][kind], p)) for n, p in params]
        for key, t in logical_state(moments).items():
            optim.setdefault(key, {})[kind] = t
    step = torch.tensor(float(optimizer.steps))
    for n, p in params:
        for key, _, owned in logical_slices([(n, p)]):
            if owned:
                optim[key]["step"] = step
    state["optim"] = optim
    if balancer is not None and balancer.layers:
        state["balancer"] = balancer_state(balancer)
    if rng is not None:
        state["rng"] = {kind: t.detach().cpu().clone() for kind, t in rng.items()}
    return state


def first_nonfinite(runtime: Any, optimizer: Any, balancer: Any) -> str | None:
    """The first of this rank's tensors a checkpoint would save that is not finite (local): a
    parameter or persistent buffer (a router's bias) by its logical name, the master weights or
    AdamW state, a balancer's recorded loads; None when all are finite."""
    for name, t in named_state(runtime):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    if not optimizer.finite():
        return "the master weights or AdamW state"
    if balancer is not None:
        for key, t in _tensors(balancer.state_dict()):
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"the balancer's {key}"
    return None


def _tensors(tree: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        return [(prefix, tree)]
    if isinstance(tree, Mapping):
        return [item for k, v in tree.items() for item in _tensors(v, f"{prefix}.{k}" if prefix else str(k))]
    return []


def balancer_state(balancer: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per MoE layer: the placement in force (``log2phy`` trimmed to that layer's replica count, so
    every rank holding the layer writes the same tensor) and the recorded loads, oldest step first."""
    s = balancer.state_dict()
    steps = s["loads"]["steps"]
    out = {}
    for i, layer in enumerate(balancer.layers):
        width = int(balancer.placement.logcnt[i].max())
        # CPU copies, wherever the balancer keeps its tensors: a checkpoint holds no device tensors
        entry = {"phy2log": s["phy2log"][i].to("cpu", copy=True), "log2phy": s["log2phy"][i, :, :width].to("cpu", copy=True)}
        entry["planned"] = torch.tensor(bool(s.get("planned", True)))  # incremental changes it, not plans afresh
        if len(steps):
            entry["loads"] = steps[:, i].to("cpu", copy=True)
        out[str(layer)] = entry
    return out


# ------------------------------------------------------------------------------------ load
def balancer_targets(balancer: Any, meta: Mapping[str, Any]) -> dict[str, Any]:
    """Empty tensors for the checkpoint's placement and loads of this rank's MoE layers."""
    layers = {}
    for layer in balancer.layers:
        parts = {}
        for part in ("phy2log", "log2phy", "loads", "planned"):
            key = f"balancer.{layer}.{part}"
            if key in meta:
                parts[part] = torch.empty(tuple(meta[key].size), dtype=meta[key].properties.dtype)
        if parts:
            layers[str(layer)] = parts
    return {"balancer": layers} if layers else {}


def targets(runtime: Any, optimizer: Any, rng_kinds: list[str], meta: Mapping[str, Any]) -> dict[str, Any]:
    """Empty CPU tensors for every key this rank needs, to be filled by DCP's load.

    ``meta`` is DCP's index of the checkpoint (key -> size and dtype). Which experts a rank
    holds depends on the balancer's placement, so restore that first (:func:`restore_balancer`).
    Raises ValueError naming missing keys or shape mismatches, so nothing is half-loaded.
    """
    named = named_state(runtime)
    problems: list[str] = []

    def want(key: str, shape: torch.Size | tuple[int, ...] | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        m = meta.get(key)
        if m is None or not hasattr(m, "size"):
            problems.append(f"{key}: not in the checkpoint")
            return None
        if shape is not None and tuple(m.size) != tuple(shape):
            problems.append(f"{key}: {tuple(m.size)} in the checkpoint, {tuple(shape)} here")
            return None
        return torch.empty(tuple(m.size), dtype=dtype or m.properties.dtype)

    model: dict[str, torch.Tensor] = {}
    has_master = any(k.startswith("master.") for k in meta)
    for key, t, _ in logical_slices(named):
        # without saved master weights the parameters are them: read in the master dtype (DCP converts)
        dtype = optimizer.master_dtype if not has_master and t.requires_grad else t.dtype
        if key not in model and (x := want(f"model.{key}", t.shape, dtype)) is not None:
            model[key] = x
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for n, p in _params(named):
        for key, t, _ in logical_slices([(n, p)]):
            if key in optim:
                continue
            entry = {kind: want(f"optim.{key}.{kind}", t.shape, optimizer.moments_dtype) for kind in MOMENTS}
            entry["step"] = want(f"optim.{key}.step", ())
            optim[key] = entry  # type: ignore[assignment]
    if problems:
        raise ValueError(f"the checkpoint does not fit this model ({len(problems)} problems; first: {'; '.join(problems[:4])})")
    out: dict[str, Any] = {"model": model, "optim": optim}
    if has_master:  # read in this run's master dtype
        out["master"] = {key: torch.empty(tuple(meta[f"master.{key}"].size), dtype=optimizer.master_dtype)
                         for n, p in _params(named) for key, _, _ in logical_slices([(n, p)]) if f"master.{key}" in meta}
    if getattr(optimizer, "ema", None) is not None and any(k.startswith("ema.") for k in meta):  # the host EMA, float32
        out["ema"] = {key: torch.empty(tuple(meta[f"ema.{key}"].size), dtype=torch.float32)
                      for n, p in _params(named) for key, _, _ in logical_slices([(n, p)]) if f"ema.{key}" in meta}
    rng = {k: torch.empty(tuple(meta[f"rng.{k}"].size), dtype=meta[f"rng.{k}"].properties.dtype) for k in rng_kinds if f"rng.{k}" in meta}
    if rng:
        out["rng"] = rng
    return out


def restore(loaded: dict[str, Any], runtime: Any, optimizer: Any) -> None:
    """Put what :func:`targets` was filled with into the rank's model and optimizer: the weights
    by logical name (every replica of an expert gets its expert; cast to the model dtype), then
    AdamW's state and the master weights."""
    named = named_state(runtime)
    load_logical_state(named, loaded["model"])
    master = {**loaded["model"], **loaded.get("master", {})}  # the master weights where saved, else the parameters
    if "master" in loaded:  # the parameters as the master weights cast (exactly what the run computed with)
        load_logical_state(_params(named), master)
    _restore_optimizer(optimizer, _params(named), loaded["optim"], master, loaded.get("ema"))


def restore_balancer(balancer: Any, loaded: dict[str, Any], placement_fits: bool) -> None:
    """The checkpoint's placement (when ``placement_fits``: made for this balancer kind, EP size
    and slot count) and its recorded loads. Otherwise the balancer keeps its initial placement
    (experts are loaded by id either way) and only the loads carry over."""
    layers = loaded.get("balancer", {})
    if not balancer.layers or any(str(layer) not in layers for layer in balancer.layers):
        return
    rows = [layers[str(layer)] for layer in balancer.layers]
    state = balancer.state_dict()
    if placement_fits and all("phy2log" in r and "log2phy" in r for r in rows):
        width = max(r["log2phy"].shape[1] for r in rows)
        state["phy2log"] = torch.stack([r["phy2log"] for r in rows])
        state["log2phy"] = torch.stack([torch.nn.functional.pad(r["log2phy"], (0, width - r["log2phy"].shape[1]), value=-1) for r in rows])
        if all("planned" in r for r in rows):
            state["planned"] = bool(rows[0]["planned"])
        else:
            state.pop("planned", None)  # the balancer tells from the placement itself
    if all("loads" in r for r in rows) and len({r["loads"].shape[0] for r in rows}) == 1:
        state["loads"] = {"steps": torch.stack([r["loads"] for r in rows], 1)}
    balancer.load_state_dict(state)


def _restore_optimizer(optimizer: Any, params: list[tuple[str, nn.Parameter]], optim: dict[str, dict[str, torch.Tensor]],
                       model: dict[str, torch.Tensor], ema: dict[str, torch.Tensor] | None = None) -> None:
    """AdamW's state, the master weights (the saved parameters, in the master dtype) and the host
    EMA when saved (else it starts from the master weights) per parameter from logical entries,
    into what this rank holds of them."""
    by_kind = {kind: {key: e[kind] for key, e in optim.items()} for kind in MOMENTS}
    by_kind["master"] = model
    if ema is not None:
        by_kind["ema"] = ema
    loaded: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    steps: set[float] = set()
    for n, p in params:
        if not p.requires_grad:
            continue
        entry = {}
        for kind, values in by_kind.items():
            dtypes = {"master": optimizer.master_dtype, "ema": torch.float32}
            buf = torch.zeros(p.shape, dtype=dtypes.get(kind, optimizer.moments_dtype))
            load_logical_state([(n, _shaped_like(buf, p))], values)
            entry[kind] = buf if kind == "ema" else buf.to(p.device)  # the EMA stays in host memory
        steps |= {float(optim[key]["step"]) for key, _, _ in logical_slices([(n, p)])}
        loaded[p] = entry
    if len(steps) > 1:
        raise ValueError(f"optimizer state saved at different step counts {sorted(steps)}")
    optimizer.load_full_state(loaded, int(steps.pop()) if steps else 0)
