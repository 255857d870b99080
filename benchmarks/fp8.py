"""FP8 training against bfloat16 (float32 master weights), everything else equal.

A DeepSeek-V3-architecture model whose widths are multiples of 128 (hidden 256, experts and the
dense FFN 128 / 256 wide, latent attention with 128-wide ranks and 64 + 64 query / key heads), on
token data (the Shakespeare corpus through examples/tokenizer), 2 layers (a dense one and an MoE
one: examples/deepseek_v3.yaml's 8 experts in 4 groups, top 2, a shared expert) on 2 gloo ranks
(DualPipeV, ep 2, 2 micro-batches of ``--micro-batch-size`` sequences of ``--seq-len`` tokens), trained ``--steps`` steps from
the same seed twice:
``train.fp8: off`` (the peer: bfloat16 compute, float32 master) and ``train.fp8: deepseek``.

Reported for each: the validation loss after the last step, the last five training losses, the
median step time (every step after the first), the bytes the expert exchanges sent per step
(``a2a_bytes``: dispatch, combine and their backwards), and which Linears ran in FP8; then FP8
against bfloat16: the relative validation-loss difference (the report: below 0.25% at 16B-230B
over ~1T tokens; the goal here: within 0.5%), the dispatch bytes (the whole exchange and the
dispatch's forward alone, computed from the row layout) and the step time (the CPU runs the
emulation: exact float64 block sums, no FP8 hardware).

Prints one JSON object.

    python benchmarks/fp8.py [--steps 300] [--micro-batch-size 4] [--seq-len 64]
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
CORPUS = ROOT / "portapipe" / "data" / "shakespeare.txt.gz"
TOKENIZER = ROOT / "examples" / "tokenizer"
#: the model: every Linear of the recipe 128-aligned, except MLA's kv_a (256 -> 128 + 64, as DeepSeek-V3's 7168 -> 576)
MODEL = {"n_layers": 2, "hidden": 256, "ffn_hidden": 256, "moe_hidden": 128, "n_heads": 2, "q_lora_rank": 128, "kv_lora_rank": 128,
         "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "bfloat16"}


def config(fp8: str, steps: int, tokens: Path, log: Path, mbs: int = 4, seq: int = 64) -> Config:
    sets = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "parallel.pp=1", "parallel.ep=2", "schedule.microbatches=2", f"train.micro_batch_size={mbs}", f"model.seq_len={seq}",
        f"train.fp8={fp8}", f"train.steps={steps}", f"train.lr_schedule_steps={steps}", "train.lr=1e-3", "train.min_lr=1e-4",
        f"data.path={tokens}", f"log.dir={log}", "log.progress=false", "checkpoint.at_end=false", "checkpoint.overwrite=true",
    ]
    return load_config(EXAMPLE, sets)


def run(fp8: str, steps: int, tokens: Path, folder: Path, mbs: int, seq: int) -> dict[str, Any]:
    from portapipe.models.fp8_layers import plan
    from portapipe.train import train

    c = config(fp8, steps, tokens, folder, mbs, seq)
    summary = train(c)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r.get("kind") == "train"]
    eligible, kept = plan(c.model)
    return {
        "train.fp8": fp8,
        "val_loss": summary["val_loss"],
        "final_loss_avg5": summary["final_loss_avg5"],
        "median_step_s": statistics.median(r["step_s"] for r in train_rows if r["step"] > 1),
        "a2a_bytes_per_step": statistics.median(r["a2a_bytes"] for r in train_rows),
        "fp8_linears": len(eligible) if fp8 != "off" else 0,
        "kept_linears": [lin.name for lin in kept] if fp8 != "off" else [],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch [4]")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence [64]")
    ap.add_argument("--only", choices=["off", "deepseek"], help="one side only (its figures, no comparison)")
    args = ap.parse_args(argv)
    from portapipe.fp8.dispatch import row_bytes
    from portapipe.tokens import tokenize

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "shakespeare-1k.bin"
        tokenize(CORPUS, tokens, TOKENIZER)
        sides = {v: run(v, args.steps, tokens, Path(tmp) / v, args.micro_batch_size, args.seq_len)
                 for v in ("off", "deepseek") if args.only in (None, v)}
    h = MODEL["hidden"]
    out: dict[str, Any] = {
        "benchmark": "fp8",
        "command": "python benchmarks/fp8.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "config": f"{EXAMPLE.relative_to(ROOT)} with model {MODEL}, pp 1 x ep 2, 2 micro-batches of {args.micro_batch_size} x "
                  f"{args.seq_len} tokens, lr 1e-3 with a cosine to 1e-4 over the run",
        "steps": args.steps,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **{("bfloat16" if v == "off" else "fp8"): r for v, r in sides.items()},
    }
    if args.only is None:
        bf16, fp8 = sides["off"], sides["deepseek"]
        out["fp8_vs_bfloat16"] = {
            "val_loss_rel_diff": fp8["val_loss"] / bf16["val_loss"] - 1.0,
            "a2a_bytes": fp8["a2a_bytes_per_step"] / bf16["a2a_bytes_per_step"],
            # one dispatched row (router weight included): FP8 values, scales and weight against bfloat16
            "dispatch_row_bytes": row_bytes(h, torch.bfloat16) / (2 * (h + 1)),
            "median_step_s": fp8["median_step_s"] / bf16["median_step_s"],
        }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
