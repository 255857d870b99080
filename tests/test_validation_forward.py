"""Validation runs the schedule's forwards alone: no backward, no gradient, the same losses.

The forward-only lists (:func:`portapipe.scheduling.schedules.forward_only`) hold every
forward once and stall nowhere, for every schedule; on gloo ranks, an evaluation gives each
micro-batch's loss and every loss term bit for bit as the training step's forwards do, in every
schedule with the memory options, multi-token prediction and F&F pairs, and leaves no gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.config import load_config
from portapipe.scheduling.comms import lower_comms
from portapipe.scheduling.ir import Kind
from portapipe.scheduling.schedules import build, forward_only, pair_forwards
from portapipe.scheduling.validate import stalls

MODEL = {"hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}


@pytest.mark.parametrize(
    "name, pp, m, chunks, paired",
    [("1f1b", 4, 6, 2, False), ("zb1p", 3, 5, 2, False), ("interleaved", 2, 4, 3, False), ("dualpipe", 4, 8, 2, False),
     ("dualpipev", 3, 7, 2, False), ("dualpipev", 2, 4, 2, True), ("interleaved", 2, 6, 2, True)],
)
def test_the_forward_only_lists_run_every_forward_once_in_the_schedules_order_and_stall_nowhere(name, pp, m, chunks, paired) -> None:
    s = build(name, pp, m, chunks)
    if paired:
        s = pair_forwards(s, range(s.n_blocks))
    lowered = lower_comms(forward_only(s))
    assert stalls(lowered) == []
    for rank, acts in enumerate(lowered.actions):
        halves = [h for a in acts if a.kind.is_compute for h in a.halves()]
        assert all(h.kind is Kind.F for h in halves)
        assert all(a.kind in (Kind.SEND_F, Kind.RECV_F) for a in acts if a.kind.is_comm)
        # the forwards of the schedule, in its order (F&F pairs kept as pairs)
        assert halves == [h for a in s.actions[rank] for h in a.halves() if h.kind is Kind.F]
        assert sum(a.ff_pair for a in acts) == sum(a.ff_pair for a in s.actions[rank])
    ran = sorted((h.stage, h.mb) for acts in lowered.actions for a in acts if a.kind.is_compute for h in a.halves())
    assert ran == sorted((v, mb) for v in range(s.n_stages) for mb in s.microbatches_of(v))


def _raw(pp: int, ep: int, dp: int, name: str, m: int, **sections: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {
        "backend": "cpu", "parallel": {"pp": pp, "ep": ep, "dp": dp}, "schedule": {"name": name, "microbatches": m},
        "model": dict(MODEL), "train": {"steps": 1, "micro_batch_size": 2}, "data": {"val_fraction": 0.1},
    }
    for key, value in sections.items():
        raw.setdefault(key, {}).update(value)
    return load_config(raw).to_dict()


def _evaluate(backend: Any, raws: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per config, on every rank: a validation batch's training step and its evaluation."""
    from portapipe.data.batches import Batches, replica_of
    from portapipe.training.validation import validation_loss

    from .test_validation_state import runtimes

    out = []
    for config, _, groups, runtime in runtimes(backend, raws):
        data = Batches(config)
        replica, replicas = replica_of(groups)
        batches = data.microbatches(0, replica, replicas, config.schedule.microbatches, 2, config.model.seq_len, split="val")
        with runtime.unchanged():
            full = runtime.step(batches)
            runtime.grads.zero_grad()
        grads_before = [p.grad for p in runtime.parameters()]
        with runtime.unchanged():
            evaluated = runtime.evaluate(batches)
        untouched = all(p.grad is g for p, g in zip(runtime.parameters(), grads_before))
        stepped = []
        runtime.step = lambda *a, **k: stepped.append(1)  # type: ignore[method-assign]  # validation must not run a step
        val, _ = validation_loss(runtime, data, config, groups)
        out.append({"full": full.losses, "full_terms": full.loss_terms, "eval": evaluated.losses, "eval_terms": evaluated.loss_terms,
                    "untouched": untouched, "stepped": len(stepped), "val": val})
    return out


CASES = [
    (4, [_raw(2, 2, 1, "dualpipev", 4, schedule={"pair_forwards": True}, memory={"zero_memory": "level1"}),
         _raw(2, 2, 1, "interleaved", 4, schedule={"chunks": 2}, model={"mtp_layers": 1, "tie_word_embeddings": True},
              train={"seq_aux_loss_weight": 0.01}),
         _raw(2, 2, 1, "dualpipe", 4, memory={"recompute": "moe"}, balancer={"kind": "lplb", "redundant": 1})]),
    (2, [_raw(2, 1, 1, "1f1b", 2, schedule={"overlap": False}, memory={"recompute": "full"}),
         _raw(2, 1, 1, "zb1p", 3, model={"mtp_layers": 2}),
         _raw(1, 1, 2, "1f1b", 2, balancer={"kind": "none"})]),
]


@pytest.mark.multiproc
@pytest.mark.parametrize("world, raws", CASES)
def test_an_evaluation_gives_the_training_steps_losses_bit_for_bit_without_a_backward(world: int, raws: list[dict[str, Any]]) -> None:
    from portapipe.ranks.launch import run_ranks

    per_rank = run_ranks(_evaluate, world, raws, wall_timeout_s=300)
    for rank, runs in enumerate(per_rank):
        for raw, got in zip(raws, runs):
            label = (rank, raw["schedule"]["name"])
            assert got["eval"] == got["full"], label  # every (replica, micro-batch) loss, bit for bit
            assert got["eval_terms"] == got["full_terms"], label
            assert got["untouched"], label  # no gradient written
            assert got["stepped"] == 0 and got["val"] is not None and got["val"] > 0, label
    for runs in zip(*per_rank):  # the same figures on every rank
        assert all(r == runs[0] for r in runs)


def test_an_evaluation_refuses_a_wrong_number_of_microbatches() -> None:
    from portapipe.scheduling.executor import PipelineExecutor

    rt = PipelineExecutor.__new__(PipelineExecutor)
    rt.schedule = build("1f1b", 1, 2)
    with pytest.raises(ValueError, match="evaluate\\(\\) got 1 micro-batches; schedule 1f1b runs 2"):
        rt.evaluate([(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))])
