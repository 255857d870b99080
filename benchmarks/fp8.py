"""FP8 training against bfloat16 (float32 master weights), everything else equal.

A DeepSeek-V3-architecture model whose widths are multiples of 128 (hidden 256, experts and the
dense FFN 128 / 256 wide, latent attention with 128-wide ranks and 64 + 64 query / key heads), on
token data (the Shakespeare corpus through examples/tokenizer), 2 layers (a dense one and an MoE
one: examples/deepseek_v3.yaml's 8 experts in 4 groups, top 2, a shared expert) on 2 gloo ranks
(DualPipeV, ep 2, 2 micro-batches of ``--micro-batch-size`` sequences of ``--seq-len`` tokens), trained ``--steps`` steps
twice from each of ``--seeds`` seeds (``train.seed`` ``--first-seed``, the next, ...; a seed sets the initial weights
and the data order): ``train.fp8: off`` (the peer: bfloat16 compute, float32 master) and ``train.fp8: deepseek``.

Reported per seed, for each side: the validation loss after the last step, the last five training
losses, the median step time (every step after the first), the bytes the expert exchanges sent per
step (``a2a_bytes``: dispatch, combine and their backwards), and which Linears ran in FP8; then FP8
against bfloat16 from the same seed: the relative validation-loss difference (the report: below
0.25% at 16B-230B over ~1T tokens; the goal here: within 0.5%), the dispatch bytes (the whole
exchange and the dispatch's forward alone, computed from the row layout) and the step time (the
CPU runs the emulation: exact float64 block sums, no FP8 hardware). Over the seeds: each figure's
mean, sample standard deviation, min and max, and whether the mean difference meets the goal.
Each seed's figures are also printed to stderr as it ends, so a run stopped early keeps them.

Prints one JSON object.

    python benchmarks/fp8.py [--steps 300] [--seeds 3] [--first-seed 1234] [--micro-batch-size 4] [--seq-len 64]
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
#: the model: every Linear of the recipe 128-aligned, except MLA's kv_a (256 -> 128 + 64, as DeepSeek-V3's 7168 -> 576)
MODEL = {"n_layers": 2, "hidden": 256, "ffn_hidden": 256, "moe_hidden": 128, "n_heads": 2, "q_lora_rank": 128, "kv_lora_rank": 128,
         "qk_nope_head_dim": 64, "qk_rope_head_dim": 64, "v_head_dim": 128, "dtype": "bfloat16"}


#: the goal for the validation loss of FP8 against bfloat16 (relative, either way)
GOAL = 0.005


def config(fp8: str, steps: int, tokens: Path, log: Path, mbs: int = 4, seq: int = 64, seed: int | None = None) -> Config:
    sets = [f"model.{k}={v}" for k, v in MODEL.items()] + [
        "parallel.pp=1", "parallel.ep=2", "schedule.microbatches=2", f"train.micro_batch_size={mbs}", f"model.seq_len={seq}",
        f"train.fp8={fp8}", f"train.steps={steps}", f"train.lr_schedule_steps={steps}", "train.lr=1e-3", "train.min_lr=1e-4",
        f"data.path={tokens}", f"log.dir={log}", "log.progress=false", "checkpoint.at_end=false", "checkpoint.overwrite=true",
    ] + ([f"train.seed={seed}"] if seed is not None else [])
    return load_config(EXAMPLE, sets)


def run(fp8: str, steps: int, tokens: Path, folder: Path, mbs: int, seq: int, seed: int | None = None) -> dict[str, Any]:
    from portapipe.models.fp8_layers import plan
    from portapipe.train import train

    c = config(fp8, steps, tokens, folder, mbs, seq, seed)
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


def compare(bf16: dict[str, Any], fp8: dict[str, Any]) -> dict[str, float]:
    """FP8 against bfloat16 from one seed."""
    from portapipe.fp8.dispatch import row_bytes

    h = MODEL["hidden"]
    return {
        "val_loss_rel_diff": fp8["val_loss"] / bf16["val_loss"] - 1.0,
        "a2a_bytes": fp8["a2a_bytes_per_step"] / bf16["a2a_bytes_per_step"],
        # one dispatched row (router weight included): FP8 values, scales and weight against bfloat16
        "dispatch_row_bytes": row_bytes(h, torch.bfloat16) / (2 * (h + 1)),
        "median_step_s": fp8["median_step_s"] / bf16["median_step_s"],
    }


def spread(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation (None for one value), min and max of a figure over the seeds."""
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else None,
            "min": min(values), "max": max(values), "per_seed": values}


#: per-seed figures that a seed cannot change (the model's Linears)
CONSTANT = ("fp8_linears",)


def summarize(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each numeric figure of the per-seed records (a side's, or FP8 against bfloat16) over the seeds."""
    out: dict[str, Any] = {}
    for part in ("bfloat16", "fp8", "fp8_vs_bfloat16"):
        if part in per_seed[0]:
            keys = [k for k, v in per_seed[0][part].items() if isinstance(v, (int, float)) and k not in CONSTANT]
            out[part] = {k: spread([float(s[part][k]) for s in per_seed]) for k in keys}
    if "fp8_vs_bfloat16" in out:
        diff = out["fp8_vs_bfloat16"]["val_loss_rel_diff"]
        out["goal"] = {"val_loss_rel_diff_within": GOAL, "mean_met": abs(diff["mean"]) <= GOAL,
                       "seeds_met": sum(abs(d) <= GOAL for d in diff["per_seed"]), "seeds": len(per_seed)}
    return out


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} seeds: give 1 or more")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=positive, default=3, help="how many seeds, each trained on both sides [3]")
    ap.add_argument("--first-seed", type=int, default=None, help="the first seed's train.seed [the example's]")
    ap.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch [4]")
    ap.add_argument("--seq-len", type=int, default=64, help="tokens per sequence [64]")
    ap.add_argument("--only", choices=["off", "deepseek"], help="one side only (its figures, no comparison)")
    args = ap.parse_args(argv)
    from portapipe.data.readers import expand
    from portapipe.data.shipped import DEFAULT_CORPUS, shipped_eos
    from portapipe.data.tokenizer import load_tokenizer
    from portapipe.data.writer import Options, write_dataset

    first = load_config(EXAMPLE).train.seed if args.first_seed is None else args.first_seed
    seeds = list(range(first, first + args.seeds))
    load_before = os.getloadavg()
    per_seed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tokens = Path(tmp) / "shakespeare-1k"  # what `portapipe tokenize` writes without an input
        write_dataset(expand([str(DEFAULT_CORPUS)]), tokens, Options(TOKENIZER, eos=shipped_eos(load_tokenizer(TOKENIZER))))
        for seed in seeds:
            sides = {v: run(v, args.steps, tokens, Path(tmp) / str(seed) / v, args.micro_batch_size, args.seq_len, seed)
                     for v in ("off", "deepseek") if args.only in (None, v)}
            record: dict[str, Any] = {"seed": seed, **{("bfloat16" if v == "off" else "fp8"): r for v, r in sides.items()}}
            if args.only is None:
                record["fp8_vs_bfloat16"] = compare(sides["off"], sides["deepseek"])
            record["load_average_after"] = os.getloadavg()
            per_seed.append(record)
            print(f"fp8 benchmark, seed {seed}: {json.dumps(record)}", file=sys.stderr, flush=True)
    out: dict[str, Any] = {
        "benchmark": "fp8",
        "command": "python benchmarks/fp8.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(), "torch": torch.__version__},
        "config": f"{EXAMPLE.relative_to(ROOT)} with model {MODEL}, pp 1 x ep 2, 2 micro-batches of {args.micro_batch_size} x "
                  f"{args.seq_len} tokens, lr 1e-3 with a cosine to 1e-4 over the run",
        "steps": args.steps,
        "seeds": seeds,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "per_seed": per_seed,
        "over_seeds": summarize(per_seed),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
