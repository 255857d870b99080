"""Multi-token prediction: what one module costs and what it buys, on the tiny DeepSeek-V3 example.

examples/deepseek_v3.yaml (4 gloo ranks: DualPipeV pp 2 x ep 2) trained on token data (the
Shakespeare corpus through examples/tokenizer) for ``--steps`` steps twice: without multi-token
prediction (D = 0, the peer) and with one module (D = 1, lambda ``--weight``), everything else
equal, the runs taking turns ``--repeats`` times. Reported for each: the main model's validation
loss (the next-token loss only, so the two compare), the last training losses, the median step
time (every step after the first of each run), and the planner's memory model for the layout
(the peak total; parameters and total of the rank holding the head, where the module and the
embedding's copy go); then D = 1 over D = 0 for each.

Prints one JSON object.

    python benchmarks/mtp.py [--steps 100] [--weight 0.3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from portapipe.config import Config, load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "deepseek_v3.yaml"
TOKENIZER = ROOT / "examples" / "tokenizer"


def config(depth: int, steps: int, weight: float, tokens: Path, log: Path) -> Config:
    sets = [
        f"model.mtp_layers={depth}", f"train.steps={steps}", f"train.lr_schedule_steps={steps}", f"data.path={tokens}",
        f"log.dir={log}", "log.progress=false", "checkpoint.every=0", "checkpoint.overwrite=true",
    ]
    if depth:
        sets.append(f"train.mtp_loss_weight={weight}")
    return load_config(EXAMPLE, sets)


def planned(c: Config) -> dict[str, Any]:
    """The memory model's figures for the config's layout (bytes)."""
    from portapipe.plan.memory_model import MemoryModel
    from portapipe.scheduling.executor import build_schedule
    from portapipe.config.setup import Setup

    sched = build_schedule(c)
    report = MemoryModel(Setup.from_config(c), sched).report()
    head = next(sched.stage_rank[v] for v in range(sched.n_stages) if sched.is_last(v))
    return {
        "peak_total_bytes": report.peak,
        "worst_rank": report.worst_rank,
        "head_rank": head,  # the pipeline rank holding the head (and the modules)
        "head_rank_params_bytes": report.ranks[head].params,
        "head_rank_total_bytes": report.ranks[head].total,
        "params_bytes_per_rank": [r.params for r in report.ranks],
        "saved_peak_bytes_per_rank": [r.saved_peak for r in report.ranks],
    }


def run(depth: int, steps: int, weight: float, tokens: Path, folder: Path) -> dict[str, Any]:
    from portapipe.train import train

    c = config(depth, steps, weight, tokens, folder)
    summary = train(c)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    steps_s = [r["step_s"] for r in rows if r.get("kind") == "train" and r["step"] > 1]
    last = [r for r in rows if r.get("kind") == "train"][-1]
    return {
        "val_loss": summary["val_loss"],
        "final_loss_avg5": summary["final_loss_avg5"],
        "final_mtp_loss_1": last.get("mtp_loss_1"),
        "median_step_s": statistics.median(steps_s),
        "planner": planned(c),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--weight", type=float, default=0.3, help="lambda of the D = 1 run [0.3, DeepSeek-V3's first]")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each, taking turns [1]")
    args = ap.parse_args(argv)
    from portapipe.data.readers import expand
    from portapipe.data.shipped import DEFAULT_CORPUS, shipped_eos
    from portapipe.data.tokenizer import load_tokenizer
    from portapipe.data.writer import Options, write_dataset

    load_before = os.getloadavg()
    runs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "shakespeare-1k"  # what `portapipe tokenize` writes without an input
        write_dataset(expand([str(DEFAULT_CORPUS)]), tokens, Options(TOKENIZER, eos=shipped_eos(load_tokenizer(TOKENIZER))))
        for i in range(args.repeats):
            for depth in (0, 1):
                runs[depth].append(run(depth, args.steps, args.weight, tokens, Path(tmp) / f"d{depth}_{i}"))

    def med(depth: int, key: str) -> float:
        return statistics.median(r[key] for r in runs[depth])

    out: dict[str, Any] = {
        "benchmark": "mtp",
        "command": "python benchmarks/mtp.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "config": str(EXAMPLE.relative_to(ROOT)),
        "steps": args.steps,
        "mtp_loss_weight": args.weight,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "without_mtp": runs[0],
        "with_mtp": runs[1],
        "d1_over_d0": {
            "median_step_s": med(1, "median_step_s") / med(0, "median_step_s"),
            "val_loss": med(1, "val_loss") / med(0, "val_loss"),
            "planner_peak_total": runs[1][0]["planner"]["peak_total_bytes"] / runs[0][0]["planner"]["peak_total_bytes"],
            "planner_head_rank_params": runs[1][0]["planner"]["head_rank_params_bytes"] / runs[0][0]["planner"]["head_rank_params_bytes"],
            "planner_head_rank_total": runs[1][0]["planner"]["head_rank_total_bytes"] / runs[0][0]["planner"]["head_rank_total_bytes"],
        },
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
