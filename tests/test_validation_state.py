"""Validation changes nothing: every parameter, buffer, the RNG and the balancer's and expert
clocks' state are the same before and after it (LPLB on ep 2, EPLB on pp 2 x ep 2).

That each validation batch sees the trained model (no router bias moved by the batch before it)
is checked against a hand-computed reference in ``test_optim_reference.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.config import config_from_dict, load_config

MODEL = {"hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 16}


def _raw(pp: int, schedule: str, balancer: dict[str, Any]) -> dict[str, Any]:
    return load_config({
        "backend": "cpu", "parallel": {"pp": pp, "ep": 2, "dp": 1}, "schedule": {"name": schedule, "microbatches": 2 * pp},
        "model": MODEL, "balancer": balancer, "train": {"steps": 1, "micro_batch_size": 2}, "data": {"val_fraction": 0.1},
    }).to_dict()


def _plain(o: Any) -> dict[str, Any]:
    """An object's attributes that are plain values (numbers, flags, strings)."""
    return {k: v for k, v in vars(o).items() if isinstance(v, (bool, int, float, str, type(None)))}


def state(runtime: Any, backend: Any) -> dict[str, Any]:
    """Everything a step could leave behind on this rank, copied."""
    out: dict[str, Any] = {"rng": {k: t.clone() for k, t in backend.get_rng_state().items()}}
    for b, block in runtime.blocks.items():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            out[f"{b}.{name}"] = t.detach().clone()
    for layer in runtime.moe_layers():
        out[f"clock.{layer.index}"] = _plain(layer.moe.clock)
    bal = runtime.balancer
    out["balancer"] = {**_plain(bal), "state": bal.state_dict()}
    out["switch"] = _plain(bal.switch)
    out["planners"] = [_plain(p) for p in bal.planners]
    return out


def _differ(a: Any, b: Any, at: str = "") -> list[str]:
    if isinstance(a, torch.Tensor):
        return [] if torch.equal(a, b) else [at]
    if isinstance(a, dict):
        return [d for k in a for d in _differ(a[k], b[k], f"{at}.{k}")] + [f"{at}.{k}" for k in b if k not in a]
    if isinstance(a, list):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differ(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at}: {a!r} -> {b!r}"]


def runtimes(backend: Any, raws: list[dict[str, Any]]) -> Any:
    """Per config, on this rank: (config, backend, groups, runtime), each on a backend of its own."""
    from portapipe.compose import PipelineRuntime

    for raw in raws:
        config = config_from_dict(raw)
        be = type(backend)(backend.options)
        groups = be.parallel_groups(config.parallel.pp, config.parallel.dp, config.parallel.ep)
        yield config, be, groups, PipelineRuntime(config, be, groups)


def _validate(backend: Any, raws: list[dict[str, Any]]) -> list[list[str]]:
    """On every rank, per config: one training step, then the validation; what it changed."""
    from portapipe.data.batches import Batches, replica_of
    from portapipe.training.update import make_sharded_optimizer
    from portapipe.training.validation import validation_loss

    out = []
    for config, be, groups, runtime in runtimes(backend, raws):
        optimizer = make_sharded_optimizer(runtime, config, be)
        data = Batches(config)
        replica, replicas = replica_of(groups)
        result = runtime.step(data.microbatches(0, replica, replicas, config.schedule.microbatches, 2, config.model.seq_len))
        with torch.no_grad():
            optimizer.step()
        runtime.grads.zero_grad()
        runtime.balancer.after_step(0, result, optimizer)
        runtime.step(data.microbatches(1, replica, replicas, config.schedule.microbatches, 2, config.model.seq_len))
        runtime.grads.zero_grad()  # a step's figures left for the next (clocks, the switch's cost), not yet taken
        before = state(runtime, be)
        loss, _ = validation_loss(runtime, data, config, groups)
        assert loss is not None and loss > 0
        out.append(_differ(before, state(runtime, be)))
    return out


@pytest.mark.multiproc
def test_validation_leaves_every_parameter_buffer_rng_and_balancer_figure_as_it_found_them() -> None:
    from portapipe.ranks.launch import run_ranks

    lplb = _raw(1, "1f1b", {"kind": "lplb", "redundant": 1, "interval": 1})
    eplb = _raw(2, "dualpipev", {"kind": "eplb", "redundant": 1, "interval": 1, "window": 2})
    per_rank = run_ranks(_validate, 2, [lplb], wall_timeout_s=300) + run_ranks(_validate, 4, [eplb], wall_timeout_s=300)
    changed = [(rank, d) for rank, runs in enumerate(per_rank) for d in runs if d]
    assert not changed, changed
