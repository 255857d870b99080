"""A checkpoint written on one layout resumes on any other with the losses of continuing on the old one.

One launch of 4 gloo ranks runs, in float64:

- A: pp 2, ep 2, DualPipeV, EPLB with one redundant slot per rank (a rebalance at step 3 moves
  experts, so the step-3 checkpoint holds a non-identity placement), 13 steps, checkpoints every 3
  (written in the background while training goes on);
- from A's step-3 checkpoint (``checkpoint.load``, each in a new folder), 10 more steps on
  B1: pp 1, ep 4, 1F1B with LPLB; B2: pp 2, ep 1, dp 2, interleaved, no balancer; B3: pp 4, ep 1,
  DualPipe (both copies of each block write the same keys), no balancer; B4: pp 1, ep 2, dp 2,
  1F1B, EPLB as in A (A's placement applies as it is: same EP size and slots, other pipeline ranks);
- and back: from B2's and B3's step-10 checkpoints (no balancer), steps 11..13 on A's layout
  (EPLB with its redundant slot again).

Every continuation's losses equal A's within 1e-9 (the reductions run in other orders, so not bit
for bit). The global batch (16 sequences) is the same everywhere: 2 replicas x 4 micro-batches x 2
sequences (A), 4 x 2 x 2 (B1, B4), 2 x 2 x 4 (B2), 1 x 8 x 2 (B3).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from portapipe.config import load_config

MODEL = {"hidden": 16, "n_layers": 4, "n_dense": 1, "n_heads": 2, "ffn_hidden": 32, "moe_hidden": 16, "n_experts": 8, "top_k": 2,
         "seq_len": 16, "dtype": "float64"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "A": {"parallel": {"pp": 2, "ep": 2, "dp": 1}, "schedule": {"name": "dualpipev", "microbatches": 4},
          "train": {"micro_batch_size": 2}, "balancer": {"kind": "eplb", "redundant": 1, "interval": 3, "window": 3}},
    "B1": {"parallel": {"pp": 1, "ep": 4, "dp": 1}, "schedule": {"name": "1f1b", "microbatches": 2},
           "train": {"micro_batch_size": 2}, "balancer": {"kind": "lplb", "topology": "ring", "redundant": 1, "interval": 4, "window": 2}},
    "B2": {"parallel": {"pp": 2, "ep": 1, "dp": 2}, "schedule": {"name": "interleaved", "microbatches": 2, "chunks": 2},
           "train": {"micro_batch_size": 4}},
    "B3": {"parallel": {"pp": 4, "ep": 1, "dp": 1}, "schedule": {"name": "dualpipe", "microbatches": 8},
           "train": {"micro_batch_size": 2}},
    "B4": {"parallel": {"pp": 1, "ep": 2, "dp": 2}, "schedule": {"name": "1f1b", "microbatches": 2},
           "train": {"micro_batch_size": 2}, "balancer": {"kind": "eplb", "redundant": 1, "interval": 3, "window": 3}},
}
STEPS = 13


def config(root: Path, name: str, log: str, **extra: Any) -> dict[str, Any]:
    layout = LAYOUTS[name]
    raw = {
        "backend": "cpu",
        "model": MODEL,
        "parallel": layout["parallel"],
        "schedule": layout["schedule"],
        "balancer": layout.get("balancer", {"kind": "none"}),
        "train": {"steps": STEPS, "lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 2, **layout["train"]},
        "data": {"val_fraction": 0.0},
        "log": {"dir": str(root / log), "progress": False},
        "checkpoint": {"keep": 10, **extra},
    }
    return load_config(raw).to_dict()


def _losses(log_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _runs(backend: Any, root: str) -> dict[str, Any]:
    from portapipe.train import train_rank

    base = Path(root)
    out: dict[str, Any] = {}

    def run(name: str, log: str, **extra: Any) -> None:
        fresh = type(backend)(backend.options)  # its own pp x dp x ep groups for this layout
        summary = train_rank(fresh, config(base, name, log, **extra))
        if fresh.parallel_groups(*(LAYOUTS[name]["parallel"][k] for k in ("pp", "dp", "ep"))).rank == 0:
            out[log] = {"summary": summary, "losses": _losses(base / log)}

    run("A", "A", every=3)
    a3 = base / "A" / "checkpoints" / "step_00000003"
    for name in ("B1", "B2", "B3", "B4"):
        run(name, name, every=10, load=str(a3))
    for name in ("B2", "B3"):  # no balancer -> EPLB with a redundant slot, DualPipeV
        run("A", f"back_{name}", load=str(base / name / "checkpoints" / "step_00000010"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from portapipe.ranks.launch import run_ranks

    root = tmp_path_factory.mktemp("reshard")
    out = run_ranks(_runs, 4, str(root), wall_timeout_s=600)[0]
    out["root"] = root
    return out


def _close(got: dict[int, float], want: dict[int, float], steps: range) -> float:
    assert sorted(got) == list(steps), sorted(got)
    return max(abs(got[s] - want[s]) for s in steps)


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["B1", "B2", "B3", "B4"])
def test_a_dualpipev_eplb_checkpoint_continues_on_another_layout_with_the_same_losses(runs, name):
    a = runs["A"]["losses"]
    assert sorted(a) == list(range(1, STEPS + 1))
    b = runs[name]
    assert b["summary"]["loaded_from"].endswith("step_00000003") and b["summary"]["resumed_from"] is None
    assert _close(b["losses"], a, range(4, STEPS + 1)) <= 1e-9


@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["B2", "B3"])
def test_and_back_onto_the_first_layout(runs, name):
    assert _close(runs[f"back_{name}"]["losses"], runs["A"]["losses"], range(11, STEPS + 1)) <= 1e-9


@pytest.mark.multiproc
def test_the_step_3_checkpoint_holds_a_placement_the_rebalance_changed(runs):
    """Else loading it under another balancer could not mis-map an expert, and the moves would prove little."""
    rows = [json.loads(line) for line in (runs["root"] / "A" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "train" and r["step"] == 3]
    assert row["balancer"]["rebalance"]["applied"] and row["balancer"]["rebalance"]["rows_moved"] > 0


@pytest.mark.multiproc
def test_the_checkpoint_holds_the_single_process_models_names_once(runs):
    """Logical names only: no block, rank, slot or copy in them; each expert once; router biases too."""
    from portapipe.checkpoint import load_model_state
    from portapipe.config import config_from_dict
    from portapipe.models.expert_parallel import ExpertParallel
    from portapipe.models.moe import build_blocks
    from portapipe.scheduling.stage import logical_state

    root = runs["root"]
    state, cfg = load_model_state(root / "A" / "checkpoints" / "step_00000003")
    single = config_from_dict(cfg)
    block = build_blocks(single.model, [0], 1, ExpertParallel(None), single.train.seed)[0]
    want = logical_state(block.state_dict(keep_vars=True).items())
    assert sorted(state) == sorted(want)
    assert "layers.3.moe.experts.7.gate_up" in state and "layers.2.moe.router.bias" in state
    assert all(t.device.type == "cpu" and t.dtype == want[k].dtype and t.shape == want[k].shape for k, t in state.items())
    # trained: not the initial weights, and the router biases moved
    assert not torch.equal(state["layers.3.moe.experts.7.gate_up"], want["layers.3.moe.experts.7.gate_up"])
    assert state["layers.2.moe.router.bias"].abs().sum() > 0
