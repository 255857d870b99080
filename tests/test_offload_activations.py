"""Activation offload (``memory.offload``): a part's saved tensors wait in host memory and come back
for its backward, with the gradients of no offload bit for bit.

In one process: what a wrapped part sends (what nothing else holds: not its inputs or outputs, not
a weight), the tracker's device and host bytes through forward, prefetch and backward, the same
gradients. On 4 gloo ranks (pp 2 x ep 2): every schedule, ZeRO-1 with zero-memory level0 and the
norms' recompute, EPLB, and DeepSeek-V3's recipe on MLA (FP8-cached activations), each against the same
config without offload, bit for bit, with bytes sent and the device peak no higher."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.config import ConfigError, load_config
from portapipe.memory.accounting import SavedActivations
from portapipe.memory.offload import ActivationOffload
from portapipe.scheduling.observe import PART_TAPE

F64 = torch.float64


class _Tape:  # what the offload files its storages by
    replay = False


def _part(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x @ w)  # tanh saves its output: an intermediate, sent
    return (h * h).sum(-1, keepdim=True) + x  # x: the input, saved by nothing here; the output stays


def _run(offload: ActivationOffload | None, tracker: SavedActivations) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 16, generator=g, dtype=F64, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(16, 16, generator=g, dtype=F64))
    fn = _part if offload is None else offload.part(_part)
    tape = _Tape()
    seen = []
    with tracker.track():
        token = PART_TAPE.set(tape)
        try:
            out = fn(x, w)
        finally:
            PART_TAPE.reset(token)
        seen.append((tracker.live_bytes, tracker.host_live_bytes))
        if offload is not None:
            offload.prefetch([tape])
        seen.append((tracker.live_bytes, tracker.host_live_bytes))
    out.pow(2).sum().backward()
    seen.append((tracker.live_bytes, tracker.host_live_bytes))
    return x.grad, w.grad, seen


def test_an_offloaded_part_sends_its_intermediates_and_gives_the_same_gradients():
    kept, sent = SavedActivations(), SavedActivations()
    off = ActivationOffload(CPUBackend())
    gx, gw, seen_kept = _run(None, kept)
    gx2, gw2, seen = _run(off, sent)
    assert torch.equal(gx, gx2) and torch.equal(gw, gw2)
    # x @ w saves x (the input: stays) and w (a weight: not counted); tanh its output (32 x 16 doubles,
    # sent); h * h saves h twice (one storage, already counted)
    h = 32 * 16 * 8
    assert seen_kept[0] == (32 * 16 * 8 + h, 0)
    assert seen[0] == (32 * 16 * 8, h)  # x on the device, h in host memory
    assert seen[1] == (32 * 16 * 8 + h, h)  # the prefetch brought h back; its host copy goes once read
    assert seen[2] == (0, 0) and sent.host_peak_bytes == h and sent.peak_bytes == seen_kept[0][0]
    assert off.take() == {"offload_sent_bytes": h, "offload_host_peak_bytes": h}


def test_without_a_recording_tape_a_part_runs_as_it_is():
    off = ActivationOffload(CPUBackend())
    x = torch.randn(4, 16, dtype=F64, requires_grad=True)
    off.part(_part)(x, torch.randn(16, 16, dtype=F64)).sum().backward()  # no PART_TAPE: the reference, an evaluation
    assert off.take()["offload_sent_bytes"] == 0


def test_the_rules_refuse_an_offload_that_sends_nothing():
    def refused(*sets: str) -> str:
        with pytest.raises(ConfigError) as err:
            load_config("portapipe/configs/cpu.yaml", list(sets))
        return str(err.value)

    assert "memory.offload: dense has no effect: the model has no dense layers (model.n_dense: 0); remove it" in refused(
        "memory.offload=[dense]", "model.n_dense=0")
    assert "memory.offload: shared, experts have no effect: memory.recompute: moe recomputes every layer of each stage" in refused(
        "memory.offload=[experts,shared]", "memory.recompute=moe")
    assert "memory.offload_layers: 1 is set but memory.offload is empty" in refused("memory.offload_layers=1")
    assert "train.optimizer_offload_fraction: 0.5 has no effect: train.optimizer_offload is off (set swap)" in refused(
        "train.optimizer_offload_fraction=0.5")
    assert "memory.offload: experts has no effect: memory.zero_memory: level1 on every MoE layer keeps the activation's input" in refused(
        "memory.offload=[experts]", "memory.zero_memory=level1")
    ok = load_config("portapipe/configs/cpu.yaml", ["memory.offload=[experts,attention]", "memory.recompute=norms", "memory.zero_memory=level0"])
    assert ok.memory.offload == ["attention", "experts"]  # one order whatever the config's


# ------------------------------------------------------------------- on 4 ranks
BASE = ["model.dtype=float64", "model.n_layers=4", "model.n_dense=1"]
ALL = "memory.offload=[attention,dense,shared,experts]"
CASES = {
    "1f1b": ["schedule.name=1f1b"],
    "zb1p": ["schedule.name=zb1p"],
    "interleaved": ["schedule.name=interleaved"],
    "dualpipe": ["schedule.name=dualpipe"],
    "dualpipev": ["schedule.name=dualpipev"],
    "dualpipev-zero1-level0": ["schedule.name=dualpipev", "train.zero_stage=1", "memory.zero_memory=level0", "memory.recompute=norms"],
    "1f1b-eplb": ["schedule.name=1f1b", "balancer.kind=eplb", "balancer.redundant=1"],
    "mla-recipe": [],
}


# DeepSeek-V3's recipe on MLA (FP8 with FP8-cached activations, the norms' recompute; widths of 128
# as FP8 needs), DualPipeV on pp 2 x ep 2: examples/deepseek_v3.yaml
RECIPE = ["model.dtype=bfloat16", "model.hidden=128", "model.moe_hidden=128", "model.ffn_hidden=256", "model.q_lora_rank=128",
          "model.kv_lora_rank=128", "model.qk_nope_head_dim=32", "model.qk_rope_head_dim=32", "model.v_head_dim=64",
          "train.fp8=deepseek", "memory.fp8_activations=true", "memory.recompute=norms", "data.format=bytes", "data.path=null"]


def _config(name: str, sets: list[str]) -> Any:
    if name == "mla-recipe":
        return load_config("examples/deepseek_v3.yaml", RECIPE + sets)
    return load_config("portapipe/configs/cpu.yaml", BASE + CASES[name] + sets)


@pytest.fixture(scope="module")
def steps() -> dict[str, Any]:
    from portapipe.verify import run_steps

    configs = [_config(name, extra) for name in CASES for extra in ([], [ALL])]
    got = run_steps(configs, wall_timeout_s=600)
    return {name: (got[2 * i], got[2 * i + 1]) for i, name in enumerate(CASES)}


@pytest.mark.multiproc
@pytest.mark.parametrize("case", list(CASES))
def test_every_schedule_gives_the_gradients_of_no_offload_bit_for_bit(steps, case):
    kept, sent = steps[case]
    for a, b in zip(kept, sent):
        assert a["loss"] == b["loss"]
        assert sorted(a["grads"]) == sorted(b["grads"])
        assert all(torch.equal(a["grads"][k], b["grads"][k]) for k in a["grads"]), case
    assert all(b["timings"]["offload_sent_bytes"] > 0 for b in sent), case
    assert all(b["timings"]["offload_host_peak_bytes"] > 0 for b in sent)
