"""Optimizer states in host memory (``train.optimizer_offload: swap``) in one process: the same
weights and moments as without, bit for bit; the step's trips bucket by bucket through two device
slots; the fraction in whole buckets; the bytes told apart."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.optim.buckets import GradBuckets
from portapipe.optim.offload import HostStates, chosen
from portapipe.optim.sharded import ShardedAdamW

ONE = SimpleNamespace(rank=0, dp=1, ep=1, dp_group=None, replica_group=None)


class Recording(CPUBackend):
    """The CPU backend, noting each host copy as (direction, the host tensor's address)."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, int]] = []
        self.host_ptrs: set[int] = set()

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor):
        to_device = src.data_ptr() in self.host_ptrs
        self.copies.append(("in" if to_device else "out", (src if to_device else dst).data_ptr()))
        return super().copy_async(dst, src)

    def host_buffer(self, numel, dtype, device=None):
        t = super().host_buffer(numel, dtype, device)
        self.host_ptrs.add(t.data_ptr())
        return t


def _block(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 16), torch.nn.Linear(16, 16, bias=False))
    return block.to(dtype)


def _run(offload: float | None, dtype: torch.dtype = torch.bfloat16, moments: torch.dtype | None = None, steps: int = 3,
         backend: CPUBackend | None = None) -> tuple[torch.nn.Module, ShardedAdamW]:
    block = _block(dtype)
    grads = GradBuckets({0: block}, ONE, None, master_dtype=torch.float32 if dtype == torch.bfloat16 else dtype,
                        reduce_dtype=torch.float32, zero_stage=0, bucket_mb=0.001, overlap=False, copy_sum=lambda h, t: t)
    backend = backend or CPUBackend()
    opt = ShardedAdamW(grads, model_dtype=dtype, zero_stage=0, betas=(0.9, 0.95), weight_decay=0.1, backend=backend, moments_dtype=moments)
    if offload is not None:
        opt.host = HostStates(opt, offload, backend)
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        opt.lr = 1e-2 * (step + 1)
        grads.start()
        x = torch.randn(8, 16, generator=g).to(dtype)
        block(x).float().pow(2).sum().backward()
        grads.block_done(0)
        grads.finish()
        opt.step(0.5)
        grads.zero_grad()
    return block, opt


def _states(opt: ShardedAdamW) -> list[torch.Tensor]:
    return [t for st in opt.states for t in (st.master, st.exp_avg, st.exp_avg_sq) if t is not None]


@pytest.mark.parametrize("dtype,moments", [(torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, None)])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_swapped_states_train_bit_for_bit_as_kept_ones(dtype, moments, fraction):
    ref_block, ref = _run(None, dtype, moments)
    block, opt = _run(fraction, dtype, moments)
    assert len(opt.states) >= 4
    for a, b in zip(ref_block.parameters(), block.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(_states(ref), _states(opt)):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert opt.steps == 3


def test_the_fraction_takes_the_fewest_buckets_in_step_order_that_reach_it():
    assert chosen([10, 10, 10, 10], 0.5) == [True, True, False, False]
    assert chosen([10, 10, 10, 10], 0.3) == [True, True, False, False]  # 10 < 12: a second bucket
    assert chosen([10, 10, 10, 10], 0.25) == [True, False, False, False]
    assert chosen([10, 10, 10, 10], 1.0) == [True] * 4
    _, opt = _run(0.5, steps=0)
    m = opt.memory()
    total = m["master"] + m["optimizer"] + m["master_host"] + m["optimizer_host"]
    biggest = max(sum(t.numel() * t.element_size() for t in (st.master, st.exp_avg, st.exp_avg_sq)) for st in opt.states)
    assert opt.host.share == (m["master_host"] + m["optimizer_host"]) / total
    assert 0.5 <= opt.host.share < 0.5 + biggest / total


def test_a_step_brings_each_bucket_while_the_one_before_updates_and_sends_it_back_after(monkeypatch):
    from portapipe.optim import offload

    backend = Recording()
    _, opt = _run(1.0, steps=0, backend=backend)
    host = {ptr: i for i, st in enumerate(opt.states) for ptr in (st.master.data_ptr(), st.exp_avg.data_ptr(), st.exp_avg_sq.data_ptr())}
    backend.copies.clear()
    slots_held: list[int] = []
    close = offload._Trips.close
    monkeypatch.setattr(offload._Trips, "close", lambda self: (slots_held.append(len(self.slots)), close(self)))
    _run_one_step(opt)
    # per bucket: its three states in, then out; bucket i+1 comes in before bucket i goes out
    order = [(d, host[p]) for d, p in backend.copies]
    n = len(opt.states)
    want = [("in", 0)] * 3
    for i in range(n):
        want += [("in", i + 1)] * 3 if i + 1 < n else []
        want += [("out", i)] * 3
    assert order == want
    assert slots_held == [2]  # two device slots, whatever the bucket count


def _run_one_step(opt: ShardedAdamW) -> None:
    grads = opt.grads
    grads.start()
    for b in grads.buckets:
        for p in b.params:
            (p.float().sum() * 0.0 + p.float().pow(2).sum()).backward()
    grads.block_done(0)
    grads.finish()
    opt.lr = 1e-3
    opt.step()
    grads.zero_grad()


def test_the_memory_record_tells_device_from_host_bytes():
    _, kept = _run(None, steps=0)
    _, swapped = _run(1.0, steps=0)
    k, s = kept.memory(), swapped.memory()
    assert (s["master"], s["optimizer"]) == (0, 0)
    assert (s["master_host"], s["optimizer_host"]) == (k["master"], k["optimizer"])
    def aligned(st):  # master, exp_avg, exp_avg_sq one after the other, each at a 16-byte boundary
        at = 0
        for t in (st.master, st.exp_avg, st.exp_avg_sq):
            at = -(-at // 16) * 16 + t.numel() * t.element_size()
        return at

    assert s["optimizer_slots"] == 2 * max(aligned(st) for st in swapped.states)
    _, half = _run(0.5, steps=0)
    h = half.memory()
    assert h["master"] + h["master_host"] == k["master"] and 0 < h["master_host"] < k["master"]


def test_a_fraction_outside_zero_to_one_is_refused():
    _, opt = _run(None, steps=0)
    with pytest.raises(ValueError, match=r"train.optimizer_offload_fraction: 1.5 is not in \(0, 1\]"):
        HostStates(opt, 1.5, CPUBackend())
