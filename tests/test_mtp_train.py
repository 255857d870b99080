"""Training with multi-token prediction and the balance loss: what is reported, and checkpoints.

One launch of 2 gloo ranks, float64, the balance loss on, D = 1 and a lambda schedule (0.3, then
0.1 from step 3):

- A: pp 2, 1F1B, 4 steps, a checkpoint at step 2;
- B: pp 1, ep 2, DualPipeV (the embedding and its copy on one rank), loaded from A's step-2
  checkpoint, steps 3 and 4;
- single: pp 2, DualPipeV, tied embeddings, 4 steps, a checkpoint at step 2 (the single embedding:
  the first and last stages share rank 0); apart: pp 2, 1F1B, loaded from it, steps 3 and 4.

Each metrics row reports the main loss, the module's loss and the balance loss apart; B's steps
equal A's (every weight, the module's and the embedding's copy included, made the trip through
the checkpoint; the reductions run in other orders, so to 1e-9); the validation loss is the main
next-token loss, the same with and without the module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.config import load_config
from portapipe.training.record import show as _show

MODEL = {"hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 4, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}


def _config(root: Path, log: str, layout: dict[str, Any], depth: int = 1, weight: Any = None, tied: bool = False, **checkpoint: Any) -> dict[str, Any]:
    train = {"steps": 4, "lr": 1e-2, "warmup_steps": 1, "micro_batch_size": layout.pop("mbs"), "seq_aux_loss_weight": 0.01}
    if depth:
        train["mtp_loss_weight"] = {0: 0.3, 2: 0.1} if weight is None else weight
    return load_config({
        "backend": "cpu", "model": {**MODEL, "mtp_layers": depth, "tie_word_embeddings": tied}, **layout, "train": train, "data": {"val_fraction": 0.2},
        "log": {"dir": str(root / log), "progress": False}, "checkpoint": {"keep": 5, **checkpoint},
    }).to_dict()


def _rows(log_dir: Path) -> dict[int, dict[str, Any]]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def _runs(backend: Any, root: str) -> dict[str, Any]:
    from portapipe.train import train_rank

    base, out = Path(root), {}
    a = {"parallel": {"pp": 2}, "schedule": {"name": "1f1b", "microbatches": 2}, "mbs": 2}
    b = {"parallel": {"pp": 1, "ep": 2}, "schedule": {"name": "dualpipev", "microbatches": 2}, "mbs": 1}
    plain = {"parallel": {"pp": 2}, "schedule": {"name": "1f1b", "microbatches": 2}, "mbs": 2}
    # the single embedding: DualPipeV at pp 2 puts the first and last stages on rank 0, so the
    # embedding, the tied head and the module's embedding and head are one tensor there; 1F1B at
    # pp 2 holds them on two ranks. The same micro-batches (one replica, 4 of 1 sequence) in both.
    single = {"parallel": {"pp": 2}, "schedule": {"name": "dualpipev", "microbatches": 4}, "mbs": 1}
    apart = {"parallel": {"pp": 2}, "schedule": {"name": "1f1b", "microbatches": 4}, "mbs": 1}
    for log, layout, depth, weight, tied, extra in (
        ("A", a, 1, None, False, {"every": 2}),
        ("B", b, 1, None, False, {"load": str(base / "A" / "checkpoints" / "step_00000002")}),
        ("plain", plain, 0, None, False, {}),
        ("constant", a, 1, 0.3, False, {}),  # A's layout at A's first weight throughout
        ("single", single, 1, None, True, {"every": 2}),
        ("apart", apart, 1, None, True, {"load": str(base / "single" / "checkpoints" / "step_00000002")}),
    ):
        fresh = type(backend)(backend.options)
        summary = train_rank(fresh, _config(base, log, dict(layout), depth, weight, tied, **extra))
        if torch.distributed.get_rank() == 0:
            out[log] = {"summary": summary, "rows": _rows(base / log)}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    return run_ranks(_runs, 2, str(tmp_path_factory.mktemp("mtp_train")), wall_timeout_s=600)[0]


@pytest.mark.multiproc
def test_each_row_reports_the_main_loss_the_modules_and_the_balance_loss_apart(runs: dict[str, Any]) -> None:
    rows = runs["A"]["rows"]
    assert sorted(rows) == [1, 2, 3, 4]
    for r in rows.values():
        assert {"loss", "mtp_loss_1", "balance_loss"} <= set(r)
        assert r["mtp_loss_1"] > 0 and r["mtp_loss_1"] != r["loss"] and 0.9 < r["balance_loss"] < 2.0
    assert "mtp_loss_1" not in runs["plain"]["rows"][1] and "balance_loss" in runs["plain"]["rows"][1]


@pytest.mark.multiproc
def test_a_checkpoint_carries_the_module_to_another_layout(runs: dict[str, Any]) -> None:
    a, b = runs["A"]["rows"], runs["B"]["rows"]
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "mtp_loss_1", "balance_loss", "grad_norm"):
            assert abs(b[step][key] - a[step][key]) <= 1e-9 * abs(a[step][key]), (step, key)


@pytest.mark.multiproc
def test_a_checkpoint_of_the_single_embedding_resumes_where_the_copies_sit_on_two_ranks(runs: dict[str, Any]) -> None:
    """Written by DualPipeV with the tied head and the module's embedding and head one tensor on
    rank 0, resumed by 1F1B with them on two ranks: the next step's losses are the straight run's
    bit for bit (the same weights through the same arithmetic), the one after to rounding (the
    gradients of the copies are summed in another order than the one tensor's)."""
    straight, resumed = runs["single"]["rows"], runs["apart"]["rows"]
    assert sorted(straight) == [1, 2, 3, 4] and sorted(resumed) == [3, 4]
    for key in ("loss", "mtp_loss_1", "balance_loss"):
        assert resumed[3][key] == straight[3][key], key
        assert abs(resumed[4][key] - straight[4][key]) <= 1e-12 * abs(straight[4][key]), key
    assert straight[3]["loss"] != straight[2]["loss"]


@pytest.mark.multiproc
def test_the_validation_loss_is_the_main_next_token_loss(runs: dict[str, Any]) -> None:
    """The first step's main loss is the same with and without the module (same weights, same
    data), so the validation loss of both runs measures the same thing."""
    assert runs["A"]["rows"][1]["loss"] == pytest.approx(runs["plain"]["rows"][1]["loss"], rel=1e-12)
    assert runs["A"]["summary"]["val_loss"] is not None and runs["plain"]["summary"]["val_loss"] is not None


def test_the_progress_bar_shows_each_term() -> None:
    class Bar:
        def set_postfix(self, shown: dict[str, str], refresh: bool) -> None:
            self.shown = shown

        def update(self, n: int) -> None:
            pass

    bar = Bar()
    row = {"loss": 3.21, "mtp_loss_1": 3.5, "mtp_loss_2": 3.7, "balance_loss": 1.04, "tokens_per_s": 10.0, "bubble_pct": 5.0,
           "a2a_hidden_pct": None, "ep_wait_frac": None, "grad_sync_exposed_s": 0.0}
    _show(bar, row)
    assert list(bar.shown)[:4] == ["loss", "mtp1", "mtp2", "bal"] and bar.shown["mtp2"] == "3.700"


@pytest.mark.multiproc
def test_the_schedule_switches_the_weight_at_its_step_and_each_row_says_the_weight_in_force(runs: dict[str, Any]) -> None:
    """{0: 0.3, 2: 0.1}: steps 1 and 2 (0-based 0 and 1) are the constant 0.3 run's bit for bit,
    step 3's gradient is not (a schedule read one step early or late moves step 2's or step 4's)."""
    a, constant = runs["A"]["rows"], runs["constant"]["rows"]
    assert [a[s]["mtp_loss_weight"] for s in (1, 2, 3, 4)] == [0.3, 0.3, 0.1, 0.1]
    assert all(constant[s]["mtp_loss_weight"] == 0.3 for s in (1, 2, 3, 4))
    assert "mtp_loss_weight" not in runs["plain"]["rows"][1]
    for s in (1, 2):
        assert (a[s]["loss"], a[s]["grad_norm"], a[s]["mtp_loss_1"]) == (constant[s]["loss"], constant[s]["grad_norm"], constant[s]["mtp_loss_1"]), s
    assert a[3]["loss"] == constant[3]["loss"] and a[3]["grad_norm"] != constant[3]["grad_norm"]
