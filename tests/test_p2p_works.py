"""A batch of point-to-point operations that the process group completes as one work (NCCL's
coalescing: torch's batch_isend_irecv returns a single work for the batch) still gives the executor
one handle per operation, and a pipelined step through it equals the step through per-op works."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from portapipe.backends.p2p_works import SharedWork, per_op


class _Work:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1
        return True

    def is_completed(self) -> bool:
        return self.waited > 0


def test_one_work_for_a_batch_becomes_a_handle_per_operation() -> None:
    each = [_Work(), _Work()]
    assert per_op(each, 2) == each  # one each: as they are
    shared = _Work()
    handles = per_op([shared], 3)
    assert len(handles) == 3 and len({id(h) for h in handles}) == 3 and all(isinstance(h, SharedWork) for h in handles)
    assert not handles[2].is_completed()
    handles[0].wait()  # waiting one waits the batch's work
    assert shared.waited == 1 and all(h.is_completed() for h in handles)
    with pytest.raises(RuntimeError, match="returned 2 works for 3 operations"):
        per_op([_Work(), _Work()], 3)


class _Coalesced:
    """The single work NCCL's coalescing returns: done when every operation of the batch is, and
    waited for as often as anyone asks (a gloo work's second wait would wait for a second message)."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works
        self.done = False

    def wait(self) -> bool:
        if not self.done:
            for w in self.works:
                w.wait()
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done or all(w.is_completed() for w in self.works)


def _both_ways(backend: Any, raws: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]], int]:
    from portapipe.verify.pipelined import rank_step

    each = rank_step(backend, raws)
    batches = []
    real = dist.batch_isend_irecv

    def coalescing(ops: list[Any]) -> list[Any]:
        batches.append(len(ops))
        return [_Coalesced([w for op in ops for w in real([op])])]  # each posted as gloo does; one work for all

    dist.batch_isend_irecv = coalescing  # as NCCL returns it, for every batch the executor posts
    try:
        coalesced = rank_step(backend, raws)
    finally:
        dist.batch_isend_irecv = real
    return each, coalesced, max(batches, default=0)


def _raw(name: str) -> dict[str, Any]:
    return {
        "backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1},
        "schedule": {"name": name, "microbatches": 4 if name.startswith("dualpipe") else 2},
        "model": {"vocab_size": 32, "hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32,
                  "moe_hidden": 16, "n_experts": 4, "top_k": 2, "seq_len": 8, "dtype": "float64"},
        "train": {"micro_batch_size": 2, "seed": 5},
    }


@pytest.mark.multiproc
def test_a_pipelined_step_through_coalesced_batches_equals_the_step_through_per_op_works() -> None:
    from portapipe.ranks.launch import run_ranks

    names = ["1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"]
    for rank, (each, coalesced, widest) in enumerate(run_ranks(_both_ways, 2, [_raw(n) for n in names], wall_timeout_s=300)):
        assert widest >= 2, rank  # batches of several operations were coalesced
        for name, a, b in zip(names, each, coalesced):
            assert a["loss"] == b["loss"], (name, rank)
            assert a["grads"].keys() == b["grads"].keys() and all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"]), (name, rank)
