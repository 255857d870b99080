"""data.document_mask: a packed sample's logits are each document's run alone (float64, every
architecture), and `portapipe verify` stays exact with it and data.mask_eos_loss on, for every
schedule (the positions reach every pipeline stage without travelling)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from portapipe.backends.cpu import CPUBackend
from portapipe.compose import build_model
from portapipe.config import load_config
from portapipe.data.samples import IGNORE, make_microbatches, positions
from portapipe.models.expert_parallel import ExpertParallel
from portapipe.scheduling.overlap import Tape, run
from portapipe.verify import verify_many

ARCHS = {
    "portapipe": {},
    "deepseek_v3": {"q_lora_rank": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 4},
    "qwen3_moe": {"n_kv_heads": 2},
}
# the float64 attention of the Hugging Face architectures rounds its softmax to float32, as transformers' does
TOLERANCE = {"portapipe": 1e-12, "deepseek_v3": 1e-6, "qwen3_moe": 1e-6}


def _model(arch: str) -> tuple[Any, Any]:
    cfg = load_config({"model": {"arch": arch, "hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 4, "ffn_hidden": 32, "moe_hidden": 16,
                                 "n_experts": 4, "top_k": 2, "seq_len": 24, "vocab_size": 64, "dtype": "float64", **ARCHS[arch]}})
    return cfg, build_model(cfg, [0], 1, ExpertParallel(CPUBackend()))[0]


def _logits(block: Any, tokens: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
    tape = Tape(record=False)
    x = block.embed_part(tokens)
    for layer in block.main_layers():
        x = run(layer.program(tape, x, pos))
    return block.logits_part(x)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_packed_samples_logits_are_each_documents_alone(arch: str) -> None:
    cfg, block = _model(arch)
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 3, 6]  # 24 tokens: documents of every kind of length, one of a single token
    tokens = torch.randint(0, 64, (1, sum(lengths)), generator=g)
    starts = np.zeros((1, sum(lengths)), dtype=bool)
    starts[0, np.cumsum([0, *lengths[:-1]])] = True
    pos = torch.from_numpy(positions(starts))
    with torch.no_grad():
        packed = _logits(block, tokens, pos)
        at = 0
        for n in lengths:
            alone = _logits(block, tokens[:, at : at + n], None)
            scale = float(alone.abs().max())
            assert float((packed[:, at : at + n] - alone).abs().max()) <= TOLERANCE[arch] * scale, (arch, at, n)
            at += n
        # without the documents the later ones read the earlier: the check above can fail
        whole = _logits(block, tokens, None)
        assert float((whole[:, 5:] - packed[:, 5:]).abs().max()) > 1e-3


def test_positions_restart_at_each_document_and_the_eos_targets_leave_the_loss() -> None:
    starts = np.array([[False, False, True, False, False, True, True, False, False]])
    assert positions(starts).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1, 2]]
    assert positions(np.array([[True, True, False]])).tolist() == [[0, 0, 1]]
    windows = np.arange(9)[None] + 10
    inputs, targets, pos = make_microbatches(windows, starts, 1, document_mask=True, mask_eos_loss=True)[0]
    assert inputs.tolist() == [[10, 11, 12, 13, 14, 15, 16, 17]] and pos.tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    # the targets that start a document (tokens 2, 5, 6) are the predictions made at an EOS
    assert targets.tolist() == [[11, IGNORE, 13, 14, IGNORE, IGNORE, 17, 18]]
    assert len(make_microbatches(windows, starts, 1, mask_eos_loss=True)[0]) == 2  # no positions without the mask
    with pytest.raises(ValueError, match="need the document starts"):
        make_microbatches(windows, None, 1, document_mask=True)


@pytest.mark.multiproc
@pytest.mark.parametrize("mtp", [False, True])
def test_verify_is_exact_with_documents_for_every_schedule(mtp: bool) -> None:
    """Both options on, and with one multi-token prediction module (its rows inside documents too)."""
    configs = []
    for name in ("1f1b", "zb1p", "interleaved", "dualpipe", "dualpipev"):
        mb = 4
        model = {"hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
                 "seq_len": 16, "dtype": "float64", "mtp_layers": int(mtp)}
        if name == "dualpipev":
            model.update(arch="deepseek_v3", q_lora_rank=8, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
        configs.append(load_config({
            "backend": "cpu", "parallel": {"pp": 2, "ep": 1, "dp": 1}, "schedule": {"name": name, "microbatches": mb},
            "model": model, "train": {"micro_batch_size": 2, "mtp_loss_weight": 0.3},
            "data": {"format": "tokens", "path": "unused", "document_mask": True, "mask_eos_loss": True},
        }))
    for report in verify_many(configs):
        assert report.ok and report.loss_diff == 0.0 and report.max_rel_grad_diff < 1e-12, report


def test_rotary_positions_restart_each_documents_rows_as_if_it_ran_alone() -> None:
    """RoPE makes attention scores depend on relative positions only, so the logits above cannot
    tell restarted positions from running ones: each rotation is checked itself."""
    from portapipe.models.rope import Rotary, apply_rope, rope_tables

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64, generator=g)
    starts = np.zeros((2, 10), dtype=bool)
    starts[0, [0, 4]] = starts[1, [0, 1, 7]] = True
    pos = torch.from_numpy(positions(starts))
    cos, sin = rope_tables(10, 8, torch.float64)
    halves, pairs = Rotary(8, 10000.0), Rotary(8, 10000.0, interleaved=True)
    for rotate in (lambda t, p: apply_rope(t, cos, sin, 0, p), lambda t, p: halves(t, 0, p), lambda t, p: pairs(t, 0, p)):
        packed = rotate(x, pos)
        for b, lo, hi in ((0, 0, 4), (0, 4, 10), (1, 1, 7), (1, 7, 10)):
            assert torch.equal(packed[b : b + 1, :, lo:hi], rotate(x[b : b + 1, :, lo:hi], None)), (b, lo, hi)


def _step(block: Any, batch: list[tuple[torch.Tensor, ...]], kept: float | None) -> tuple[float, torch.Tensor]:
    """One step over ``batch``'s micro-batches as the ranks weigh them: (mean loss, the head's gradient)."""
    from portapipe.models.objective import keep_targets

    keep_targets([block], kept)
    block.zero_grad()
    losses = []
    for inputs, targets, pos in batch:
        tape = Tape(record=False, loss_seed=1 / len(batch))
        loss = run(block.program(tape, inputs, targets, positions=pos))
        tape.plain_backward(loss, torch.full_like(loss, 1 / len(batch)))
        losses.append(float(loss.detach()))
    return sum(losses) / len(losses), block.head.weight.grad.clone()


def test_mask_eos_loss_is_the_global_batchs_mean_over_kept_targets_however_it_is_cut() -> None:
    """data.mask_eos_loss: each micro-batch's summed loss over the step's kept targets per
    micro-batch makes the step's loss the mean over every kept target of the global batch, the
    same for one sample per micro-batch as for four; a mean per micro-batch is not."""
    from portapipe.data.samples import kept_targets

    cfg, block = _model("portapipe")
    g = torch.Generator().manual_seed(5)
    windows = torch.randint(0, 64, (4, 25), generator=g).numpy()
    starts = np.zeros((4, 25), dtype=bool)
    starts[0, [0, 3, 4, 5, 9, 10, 17, 20]] = True  # many documents in the first sample, one in the others
    starts[1:, 0] = True
    kept = kept_targets(starts)
    assert kept == 4 * 24 - 7
    with torch.no_grad():  # the mean over kept targets, computed here in one piece
        inputs, targets, pos = make_microbatches(windows, starts, 1, document_mask=True, mask_eos_loss=True)[0]
        x = block.embed_part(inputs)
        for layer in block.main_layers():
            x = run(layer.program(Tape(record=False), x, pos))
        logits = block.logits_part(x)
        flat, wanted = logits.reshape(-1, 64), targets.reshape(-1)
        keep = wanted != IGNORE
        want = float(torch.nn.functional.cross_entropy(flat[keep], wanted[keep]))
    steps = {}
    for n in (1, 2, 4):  # micro-batches of 4, 2 and 1 samples
        batch = make_microbatches(windows, starts, n, document_mask=True, mask_eos_loss=True)
        steps[n] = _step(block, batch, kept / n)
        assert abs(steps[n][0] - want) <= 1e-12 * want, n
    for n in (2, 4):
        assert torch.allclose(steps[n][1], steps[1][1], rtol=1e-10, atol=1e-15), n
    per_microbatch = _step(block, make_microbatches(windows, starts, 4, document_mask=True, mask_eos_loss=True), None)[0]
    assert abs(per_microbatch - want) > 1e-6 * want  # the mean per micro-batch weighs the first sample's targets more


def _mtp_logits(block: Any, tokens: torch.Tensor, targets: torch.Tensor, pos: torch.Tensor | None) -> list[torch.Tensor]:
    """Each multi-token prediction depth's logits, its rows inside documents given ``pos``."""
    from portapipe.models.layer import mtp_positions
    from portapipe.models.linear import linear

    tape = Tape(record=False)
    x = block.embed_part(tokens)
    for layer in block.main_layers():
        x = run(layer.program(tape, x, pos))
    h, out, seq = block.final_norm(x), [], targets.shape[1]
    for mtp in block.mtp_layers():
        k = mtp.depth
        embedded = targets[:, k - 1 : seq - 1].clamp(min=0)  # a left-out target is embedded only by rows that straddle: compared nowhere
        y = mtp.mtp_input_part(h, embedded, block.embed)
        y = run(mtp.program(tape, y, None if pos is None else mtp_positions(pos, k)[0]))
        h = mtp.shared_head["norm"](y)
        out.append(linear(h, block.head_weight()))
    return out


@pytest.mark.parametrize("eos", [False, True])
@pytest.mark.parametrize("arch", ["deepseek_v3", "portapipe"])  # qwen3_moe has no prediction modules
def test_a_packed_samples_multi_token_predictions_are_each_documents_alone(arch: str, eos: bool) -> None:
    """data.document_mask with model.mtp_layers: each depth's rows inside a document are the
    document's rows run alone (float64), and the depth's loss is theirs: the rows whose embedded
    token lies in the next document are left out of it; with data.mask_eos_loss also each row
    whose target starts the next document (the document's own run leaves it out too)."""
    cfg = load_config({"model": {"arch": arch, "hidden": 16, "n_layers": 2, "n_dense": 1, "n_heads": 4, "ffn_hidden": 32, "moe_hidden": 16,
                                 "n_experts": 4, "top_k": 2, "seq_len": 24, "vocab_size": 64, "dtype": "float64", "mtp_layers": 2, **ARCHS[arch]},
                       "train": {"mtp_loss_weight": 0.3}})
    block = build_model(cfg, [0], 1, ExpertParallel(CPUBackend()))[0]
    g = torch.Generator().manual_seed(4)
    lengths = [5, 1, 9, 3, 6]
    window = torch.randint(0, 64, (1, 25), generator=g)
    starts = np.zeros((1, 25), dtype=bool)
    starts[0, np.cumsum([0, *lengths[:-1]])] = True
    tokens, targets, pos = make_microbatches(window.numpy(), starts, 1, document_mask=True, mask_eos_loss=eos)[0]
    assert int((targets == IGNORE).sum()) == (4 if eos else 0)
    with torch.no_grad():
        packed = _mtp_logits(block, tokens, targets, pos)
        tape = Tape(record=False)
        run(block.program(tape, tokens, targets, positions=pos))
        want = {1: 0.0, 2: 0.0}
        at = 0
        for n in lengths:
            if n > 2:  # a document with rows at both depths
                alone = _mtp_logits(block, tokens[:, at : at + n], targets[:, at : at + n], None)
                for k, logits in enumerate(alone, 1):
                    rows = n - k
                    scale = float(logits.abs().max())
                    assert float((packed[k - 1][:, at : at + rows] - logits).abs().max()) <= TOLERANCE[arch] * scale, (arch, at, k)
                    want[k] += float(torch.nn.functional.cross_entropy(logits[0], targets[0, at + k : at + n], reduction="sum"))
            at += n
        for k in (1, 2):  # the report's 1 / T: all the micro-batch's positions
            assert abs(float(tape.terms[f"mtp.{k}"]) - want[k] / 24) <= TOLERANCE[arch] * want[k] / 24, (arch, k)
        # without the documents the later rows read the earlier documents: the checks above can fail
        whole = _mtp_logits(block, tokens, targets, None)
        assert float((whole[0][:, 6:] - packed[0][:, 6:]).abs().max()) > 1e-3
