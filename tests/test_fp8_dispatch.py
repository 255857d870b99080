"""FP8 dispatch, bfloat16 combine, over gloo: the bytes and scales a rank receives are its
peer's local quantization bit for bit, the gradients come back as the recipe says, the exchange
statistics show the bytes; and a step under every memory option, the F&B overlap and EPLB gives
the gradients of the plain step bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from portapipe.fp8.dispatch import CombineWire, DispatchWire, pack, row_bytes, split_received, unpack
from portapipe.fp8.quantize import dequantize_rows, quantize_rows
from portapipe.ranks.launch import run_ranks
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.scheduling.overlap import Tape, run

H = 256


def _rows(sender: int, receiver: int, n: int) -> torch.Tensor:
    """The rows ``[n, H + 1]`` (router weight last) ``sender`` sends ``receiver``, of very different ranges."""
    g = torch.Generator().manual_seed(100 * sender + receiver)
    rows = torch.randn(n, H, generator=g) * torch.logspace(-8, 8, n).unsqueeze(1)
    return torch.cat([rows, torch.rand(n, 1, generator=g)], 1).to(torch.bfloat16)


def _grad(sender: int, n: int) -> torch.Tensor:
    """The gradient ``sender``'s loss gives the rows the combine brings back (small, as gradients are)."""
    g = torch.Generator().manual_seed(7 + sender)
    return (torch.randn(n, H, generator=g) * 1e-6).to(torch.bfloat16)


def _program(pending: Any) -> Any:
    yield pending
    return pending.wait()


def _exchange_rank(backend: Any) -> dict[str, Any]:
    """Rank r sends r + j + 1 rows to each rank j (none to itself) through the dispatch's wire;
    the receiver's "experts" compute rows / 3 + FP8 values x weight, which the combine's wire
    brings back; the sender's loss gradient travels back through both, as a recording tape drives
    an MoE layer's backward."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = ExpertParallel(backend, world, rank, None)
    send_splits = [0 if j == rank else rank + j + 1 for j in range(world)]
    recv_splits = [0 if j == rank else j + rank + 1 for j in range(world)]
    send = torch.cat([_rows(rank, j, n) for j, n in enumerate(send_splits)])
    tape = Tape()
    leaf = tape.watch(send)
    got = run(_program(tape.all_to_all(ep, leaf, recv_splits, send_splits, DispatchWire(H, torch.bfloat16))))
    dispatch_bytes = ep.stats.sent_bytes
    want = torch.cat([_rows(j, rank, n) for j, n in enumerate(recv_splits)])  # what the peers sent, quantized here
    local = quantize_rows(want[:, :H])

    def experts(standin: torch.Tensor, arrived: Any) -> torch.Tensor:
        rows, weights = split_received(standin, arrived)
        return rows / 3 + dequantize_rows(arrived.rows).to(torch.bfloat16) * weights.unsqueeze(1)

    out = tape.part(experts, got.standin, got)
    back = run(_program(tape.all_to_all(ep, out, send_splits, recv_splits, CombineWire(H))))
    loss = tape.part(lambda b: b * 1.0, back)
    grad_send = run(tape.backward(loss, _grad(rank, back.shape[0])))
    return {
        "bytes_equal": torch.equal(got.rows.data.view(torch.uint8), local.data.view(torch.uint8)),
        "scales_equal": torch.equal(got.rows.scale, local.scale),
        "weights_equal": torch.equal(got.weights, want[:, H]),
        "standin": (tuple(got.standin.shape), got.standin.dtype, got.standin.untyped_storage().nbytes()),
        "sent": sum(send_splits),
        "received": sum(recv_splits),
        "dispatch_bytes": dispatch_bytes,
        "all_bytes": ep.stats.sent_bytes,
        "grad_rows": grad_send[:, :H],
        # the combine's backward in FP8, the dispatch's in bfloat16: the FP8 values of this rank's
        # gradient, divided by 3 on the receiver and not rounded again on the way back
        "grad_rows_want": dequantize_rows(quantize_rows(_grad(rank, back.shape[0]))).to(torch.bfloat16) / 3,
    }


@pytest.mark.multiproc
def test_dispatch_bytes_and_scales_are_the_senders_quantization_bit_for_bit() -> None:
    results = run_ranks(_exchange_rank, 3)
    for r in results:
        assert r["bytes_equal"] and r["scales_equal"] and r["weights_equal"]
        shape, dtype, nbytes = r["standin"]
        assert shape == (r["received"], H + 1) and dtype == torch.bfloat16 and nbytes <= 2  # a stand-in holds no rows
        assert torch.equal(r["grad_rows"], r["grad_rows_want"])
        n, m = r["sent"], r["received"]
        # FP8 rows with their scales and weight: 256 + 8 + 2 bytes against bfloat16's 2 x 257 (0.5175x)
        assert r["dispatch_bytes"] == n * row_bytes(H, torch.bfloat16) == n * 266
        # combine forward in bfloat16, its gradient in FP8, the dispatch's gradient in bfloat16
        assert r["all_bytes"] == n * 266 + m * H * 2 + n * (H + 8) + m * (H + 1) * 2


def test_pack_round_trip_and_its_layout() -> None:
    for n in (1, 0):  # one row: its weight a strided vector torch calls contiguous
        rows = _rows(0, 1, n)
        q, w = unpack(pack(rows[:, :H], rows[:, H]), H, torch.bfloat16)
        assert torch.equal(w, rows[:, H]) and q.data.shape == (n, H)
    rows = _rows(0, 1, 5)
    packed = pack(rows[:, :H], rows[:, H])
    assert packed.dtype == torch.uint8 and packed.shape == (5, H + 4 * 2 + 2)
    q, w = unpack(packed.clone(), H, torch.bfloat16)
    local = quantize_rows(rows[:, :H])
    assert torch.equal(q.data.view(torch.uint8), local.data.view(torch.uint8)) and torch.equal(q.scale, local.scale)
    assert torch.equal(w, rows[:, H])
    assert torch.equal(packed[:, :H], local.data.view(torch.uint8))  # values first, then scales, then the weight
    with pytest.raises(ValueError, match="takes 266 bytes, got 265"):
        unpack(packed[:, :-1], H, torch.bfloat16)


def test_combine_gradient_travels_as_fp8_and_arrives_as_its_exact_values() -> None:
    g = torch.Generator().manual_seed(1)
    grad = (torch.randn(9, H, generator=g) * 1e-7).to(torch.bfloat16)
    wire = CombineWire(H)
    got = wire.decode_grad(wire.encode_grad(grad), grad)
    assert got.dtype == torch.bfloat16 and torch.equal(got.float(), dequantize_rows(quantize_rows(grad)))
    assert wire.encode(grad) is grad and not wire.forward and wire.backward


# ------------------------------------------------------------------ a step under every option
FP8_MODEL = {"arch": "deepseek_v3", "hidden": 128, "n_layers": 2, "n_dense": 1, "n_heads": 2, "ffn_hidden": 128, "moe_hidden": 128,
             "n_experts": 4, "top_k": 2, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64, "qk_rope_head_dim": 64,
             "v_head_dim": 64, "dtype": "bfloat16", "seq_len": 16}


def fp8_config(**sections: dict[str, Any]) -> Any:
    from portapipe.config import load_config

    raw = {"backend": "cpu", "parallel": {"ep": 2}, "schedule": {"name": "dualpipev", "microbatches": 2}, "model": dict(FP8_MODEL),
           "train": {"fp8": "deepseek", "micro_batch_size": 2}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return load_config(raw)


@pytest.mark.multiproc
def test_every_memory_option_gives_the_plain_fp8_step_bit_for_bit() -> None:
    """Zero-memory level0 / level1 (the FP8 rows and scales dropped and fetched again through the
    wire), recompute moe (the dispatch replayed in FP8), recompute norms (with moe, with level1): the loss and every gradient of the plain
    FP8 step, bit for bit; the F&B overlap off changes nothing either."""
    from portapipe.verify.pipelined import rank_step

    configs = [fp8_config(), fp8_config(memory={"zero_memory": "level0"}), fp8_config(memory={"zero_memory": "level1"}),
               fp8_config(memory={"recompute": "moe"}), fp8_config(schedule={"overlap": False}),
               fp8_config(memory={"recompute": ["norms", "moe"]}), fp8_config(memory={"recompute": "norms", "zero_memory": "level1"})]
    per_rank = run_ranks(rank_step, 2, [c.to_dict() for c in configs], False)
    for rank in per_rank:
        plain = rank[0]
        assert plain["loss"] == plain["loss"] and any(float(g.abs().sum()) > 0 for g in plain["grads"].values())
        for other in rank[1:]:
            assert other["loss"] == plain["loss"]
            for name, g in plain["grads"].items():
                assert torch.equal(other["grads"][name], g), name


@pytest.mark.multiproc
def test_the_pipelined_fp8_step_is_the_one_process_fp8_step() -> None:
    """The pipelined step under the recipe against the same step in one process (the reference
    builds the FP8 model too): the loss bit for bit, with multi-token prediction and with EPLB's
    redundant experts; the gradients as close as the same comparison without FP8 (the reference
    accumulates micro-batches in bfloat16, the pipeline in float32: that, not FP8, is the
    difference)."""
    from portapipe.verify.compare import compare
    from portapipe.verify.pipelined import rank_step
    from portapipe.verify.tolerance import Tolerance

    loose = Tolerance("bfloat16", 1.0, 1.0, 1.0)
    pairs = [
        {"schedule": {"name": "1f1b", "overlap": False}, "model": {"mtp_layers": 1}},
        {"balancer": {"kind": "eplb", "redundant": 1, "interval": 1000}},
    ]
    configs = [fp8_config(**extra, train={"fp8": fp8}) for extra in pairs for fp8 in ("deepseek", "off")]
    per_rank = run_ranks(rank_step, 2, [c.to_dict() for c in configs], False)
    reports = [compare(c, [rank[i] for rank in per_rank], loose) for i, c in enumerate(configs)]
    for i, (fp8, plain) in enumerate(zip(reports[::2], reports[1::2])):
        assert fp8.loss_diff == 0.0 and plain.loss_diff == 0.0
        a, b = per_rank[0][2 * i]["grads"], per_rank[0][2 * i + 1]["grads"]
        assert not torch.equal(a["layers.1.moe.experts.gate_up"], b["layers.1.moe.experts.gate_up"])  # FP8 ran
        assert fp8.max_rel_grad_diff <= 2 * plain.max_rel_grad_diff + 1e-3, (fp8.max_rel_grad_diff, plain.max_rel_grad_diff)


@pytest.mark.multiproc
def test_verify_says_how_many_linears_ran_in_fp8() -> None:
    """Counted on the ranks, each Linear once: per layer MLA's q_a, q_b, kv_b and wo (kv_a, 128 ->
    128 + 64, stays in bfloat16), the dense FFN's two in layer 0, the shared expert's two and the
    routed experts in layer 1: 13. A layer moved to another rank (pp 2) changes nothing."""
    from portapipe.verify import verify_many

    for report in verify_many([fp8_config(), fp8_config(parallel={"pp": 2, "ep": 1}, schedule={"name": "1f1b", "microbatches": 2})]):
        s = report.summary()
        assert s["ok"] and s["fp8_linears"] == 13, s


@pytest.mark.multiproc
@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True], ids=["fp8", "fp8-activations"])
def test_verify_with_fp8_every_schedule_mtp_eplb_lplb(cached: bool) -> None:
    """``portapipe verify`` of an FP8 config checks the recipe (whatever --precision): the pipelined
    step equals the one-process FP8 step (within the measured noise floor; here bit for bit), every
    schedule on pp 2 x ep 2 with a multi-token prediction module, EPLB's redundant experts and LPLB;
    the distance from the unquantized float64 step is reported beside. The same with FP8-cached
    activations (``memory.fp8_activations``): the one-process step caches them too."""
    from portapipe.verify import verify_many

    model, memory = {"n_layers": 4, "mtp_layers": 1}, {"fp8_activations": cached}
    sched = {"1f1b": {}, "zb1p": {}, "interleaved": {"chunks": 2}, "dualpipe": {"microbatches": 4}, "dualpipev": {"microbatches": 4}}
    configs = [fp8_config(parallel={"pp": 2, "ep": 2}, schedule={"name": name, "microbatches": 2, **extra}, model=model, memory=memory)
               for name, extra in sched.items()]
    configs += [fp8_config(parallel={"pp": 2, "ep": 2}, schedule={"microbatches": 4}, model=model, balancer=b, memory=memory)
                for b in ({"kind": "eplb", "redundant": 1, "interval": 1000}, {"kind": "lplb", "redundant": 1})]
    for report in verify_many(configs):
        s = report.summary()
        assert s["ok"] and s["precision"] == "bfloat16" and s["changed"] == {}, s
        assert s["loss_diff"] <= s["tolerance"]["loss"] and s["max_rel_grad_diff"] <= s["tolerance"]["grad"]
        assert 0 < s["float64"]["max_rel_grad_diff"] < 1 and s["loss_terms"] == ["mtp.1"]
