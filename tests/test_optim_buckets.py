"""Gradient buckets in one process: the seam's position, the layout and shards, main_grad accumulation."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portapipe.optim.buckets import GradBuckets, layout
from portapipe.scheduling import schedules
from portapipe.scheduling.executor import last_backward
from portapipe.scheduling.ir import Kind

ONE = SimpleNamespace(rank=0, dp=1, ep=1, dp_group=None, replica_group=None)


def _backward_blocks(action, stage_block):
    part = action.pair[1] if action.kind is Kind.FB else action
    return stage_block[part.stage] if part.kind in (Kind.B, Kind.BW, Kind.W) else None


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipev", "dualpipe"])
def test_a_blocks_gradients_are_final_after_its_last_backward_action_on_the_rank(name):
    s = schedules.build(name, 2, 4, 2)
    for rank, actions in enumerate(s.actions):
        final = last_backward(actions, s.stage_block)
        assert sorted(b for blocks in final.values() for b in blocks) == sorted(s.blocks_of(rank))
        for i, blocks in final.items():
            for b in blocks:
                assert _backward_blocks(actions[i], s.stage_block) == b
                assert all(_backward_blocks(a, s.stage_block) != b for a in actions[i + 1 :])
    if name == "zb1p":  # the weight gradients come last: a W ends every block's backward work
        assert all(s.actions[r][i].kind is Kind.W for r in range(2) for i in last_backward(s.actions[r], s.stage_block))


def test_buckets_split_by_kind_and_size_and_pad_to_equal_shards():
    block = torch.nn.Module()
    block.a = torch.nn.Parameter(torch.zeros(5, 3))
    block.b = torch.nn.Parameter(torch.zeros(7))
    block.e = torch.nn.Parameter(torch.zeros(2, 4))
    block.e.is_expert = True
    block.frozen = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    groups = SimpleNamespace(rank=5, dp=2, ep=3, dp_ranks=[1, 5], dp_group="dp", replica_ranks=[0, 1, 2, 3, 4, 5], replica_group="rep")
    buckets = layout({0: block}, groups, bucket_elems=16)
    assert [(b.expert, [p.shape for p in b.params], b.numel, b.group, b.group_rank) for b in buckets] == [
        (False, [torch.Size([5, 3])], 18, "rep", 5),  # 15 padded to 6 shards of 3
        (False, [torch.Size([7])], 12, "rep", 5),
        (True, [torch.Size([2, 4])], 8, "dp", 1),
    ]
    first = buckets[0]
    assert first.shard == slice(15, 18) and first.segments() == []  # this rank's range is padding only
    assert buckets[2].segments() == [(block.e, 4, 0, 4)]  # the second half of the expert rows


def test_low_precision_gradients_accumulate_in_float32_main_grad_micro_batch_by_micro_batch():
    torch.manual_seed(0)
    block = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16)
    xs = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    each = [torch.autograd.grad(block(x).pow(2).sum(), block.weight)[0] for x in xs]  # bf16, one per micro-batch
    grads = GradBuckets({0: block}, ONE, None, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=0,
                        bucket_mb=1.0, overlap=True, copy_sum=lambda h, t: t)
    grads.start()
    for x in xs:
        block(x).pow(2).sum().backward()
    grads.block_done(0)
    assert all(b.work is not None for b in grads.buckets)  # issued at the seam, not after the last action
    grads.finish()
    assert block.weight.grad is None  # no bf16 gradient kept beside the float32 one
    got = grads.full_grads()[block.weight]
    want = torch.zeros(8, 8)
    for g in each:
        want += g.float()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert grads.memory() == 64 * 4


def test_without_overlap_nothing_is_issued_before_the_last_action():
    block = torch.nn.Linear(4, 4, bias=False)
    grads = GradBuckets({0: block}, ONE, None, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=0,
                        bucket_mb=1.0, overlap=False, copy_sum=lambda h, t: t)
    grads.start()
    assert block.weight.grad is not None and block.weight.grad.data_ptr() == grads.buckets[0].grad.data_ptr()  # the bucket's view
    grads.block_done(0)
    assert all(b.work is None for b in grads.buckets)
    grads.finish()


class _Doubling:
    """A backend whose all-reduce adds an identical second rank (doubles), recording what it was sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int]] = []

    def all_reduce(self, t, group=None, async_op=False):
        self.sent.append((group, t.numel()))
        t.mul_(2)
        return SimpleNamespace(wait=lambda: None)


@pytest.mark.parametrize("idle", [False, True])
def test_a_balancer_with_nothing_to_do_reduces_only_the_rows_that_own_their_expert(idle):
    """dp 2: an expert parameter of 4 slots, the last two replicas (``slot_owned`` False). While
    the balancer is idle (replicas off, no replica sum) its expert bucket goes out at the seam and
    carries the two owned rows only; the replica rows keep their local (out-of-date) values."""
    block = torch.nn.Module()
    block.shared = torch.nn.Parameter(torch.zeros(2))
    block.e = torch.nn.Parameter(torch.zeros(4, 3))
    block.e.is_expert = True
    block.e.slot_owned = torch.tensor([True, True, False, False])
    groups = SimpleNamespace(rank=0, dp=2, ep=1, dp_ranks=[0, 1], dp_group="dp", replica_ranks=[0, 1], replica_group="rep")
    backend, summed = _Doubling(), []
    grads = GradBuckets({0: block}, groups, backend, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=0,
                        bucket_mb=1.0, overlap=True, copy_sum=lambda h, t: t,
                        before_expert_reduce=lambda: summed.append(True), idle=lambda: idle)
    grads.start()
    block.e.grad.copy_(torch.arange(12.0).view(4, 3))
    block.shared.grad.fill_(1.0)
    grads.block_done(0)
    # idle: nothing to wait for, so the expert bucket goes out with the shared one
    assert [b.work is not None for b in grads.buckets] == [True, idle]
    grads.finish()
    assert summed == [True]  # the balancer is still asked (it marks its replicas out of date)
    assert backend.sent == [("rep", 2), ("dp", 6 if idle else 12)]
    want = torch.arange(12.0).view(4, 3) * 2
    if idle:
        want[2:] /= 2
    assert torch.equal(block.e.grad, want) and torch.equal(block.shared.grad, torch.full((2,), 2.0))


def test_the_owned_rows_are_reduced_whole_under_a_zero_stage():
    """zero_stage 1 / 2 shard every row over DP: ``idle`` is not taken there (the balancer never
    skips its sum under ZeRO either)."""
    block = torch.nn.Module()
    block.e = torch.nn.Parameter(torch.zeros(4, 3))
    block.e.is_expert = True
    block.e.slot_owned = torch.tensor([True, False, True, False])
    groups = SimpleNamespace(rank=0, dp=2, ep=1, dp_ranks=[0, 1], dp_group="dp", replica_ranks=[0, 1], replica_group="rep")
    backend = _Doubling()
    grads = GradBuckets({0: block}, groups, backend, master_dtype=torch.float32, reduce_dtype=torch.float32, zero_stage=1,
                        bucket_mb=1.0, overlap=True, copy_sum=lambda h, t: t, idle=lambda: True)
    grads.start()
    grads.finish()
    assert backend.sent == [("dp", 12)]
    assert grads.owned_runs(grads.buckets[0]) == [(0, 3), (6, 9)]
