"""Precision and optimizer sharding: what each costs and what it buys, on the CPU example.

Three parts, each a series of ``portapipe train`` runs (gloo ranks, temporary folders):

- precision: examples/cpu.yaml for ``--steps`` steps at lr 3e-4 (cosine to the end) in float32,
  bfloat16 with float32 master weights, bfloat16 without them (``master_dtype: bfloat16``) and
  float16 with dynamic loss scaling: the loss curves, the final validation losses, the median
  step time, float16's overflows;
- memory: the ``memory`` record (largest per-rank bytes of params, grads, master, optimizer) for
  zero_stage 0 / 1 / 2 at dp 2 (pp 2 x dp 2) and dp 4 (pp 1 x dp 4), the CPU example's model in
  float32, and at dp 2 in bfloat16 (float32 master weights);
- overlap: DualPipeV pp 2 x dp 2, float32, with ``train.overlap_grad_sync`` on and off: the
  median step time and the median gradient synchronisation left exposed after the last action
  (the largest over ranks), over ``--overlap-steps`` steps after the first;
- moments: AdamW's moments in float32 against bfloat16 (``train.moments_dtype``, DeepSeek-V3's
  recipe), same seed and data, ``--moments-steps`` steps at lr 3e-4 (cosine to the end), in
  float32 compute and in bfloat16 compute with float32 master weights: the validation losses and
  their ratio, the optimizer bytes per rank (the memory record), the median step time;
- ema: the host EMA of the weights (``train.ema_decay``) on and off, in ``--ema-rounds`` paired
  rounds (off then on, on then off, ...), ``--ema-steps`` steps each: the median iteration time
  (step, optimizer, the EMA's copy out) of each run, each round's ratio and their min and median,
  the share of the iteration the training thread spends in the EMA's update (``ema_s``), and with
  the background thread's processor time in the fold (``ema_fold_s``) what the EMA takes from the
  cores in all (its cost to the step where the ranks and the fold share the host's cores, measured
  as processor time, which the machine's load barely moves; on a device, the fold runs beside the
  device's work), the host bytes per rank and the validation losses of the weights and the EMA.

Prints one JSON object; ``--png`` draws the loss curves.

    python benchmarks/precision.py [--steps 200] [--overlap-steps 30] [--moments-steps 300] [--png docs/precision.png]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from portapipe.config import load_config

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cpu.yaml"

PRECISIONS: dict[str, list[str]] = {
    "float32": ["model.dtype=float32"],
    "bfloat16+float32 master": ["model.dtype=bfloat16"],
    "bfloat16, no master": ["model.dtype=bfloat16", "train.master_dtype=bfloat16"],
    "float16+loss scaling": ["model.dtype=float16"],
}


def _train(sets: list[str], folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from portapipe.train import train

    sets = [*sets, f"log.dir={folder}", "log.progress=false", "checkpoint.every=0", "checkpoint.overwrite=true"]
    summary = train(load_config(EXAMPLE, sets))
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary, rows


def precision(steps: int, tmp: Path) -> dict[str, Any]:
    out = {}
    for name, sets in PRECISIONS.items():
        common = [f"train.steps={steps}", "train.lr=3e-4", "train.min_lr=3e-5", f"train.lr_schedule_steps={steps}"]
        summary, rows = _train(common + sets, tmp / name.replace(" ", "_").replace(",", "").replace("+", "_"))
        train = [r for r in rows if r["kind"] == "train"]
        out[name] = {
            "val_loss": summary["val_loss"],
            "final_loss_avg5": summary["final_loss_avg5"],
            "median_step_s": summary["median_step_s"],
            "overflows": summary["overflows"],
            "curve": [[r["step"], r["loss"]] for r in train],
        }
        print(f"{name}: val {summary['val_loss']:.4f}, step {summary['median_step_s']:.3f} s", file=sys.stderr)
    ref = out["float32"]["val_loss"]
    for entry in out.values():
        entry["val_loss_vs_float32_pct"] = 100.0 * (entry["val_loss"] / ref - 1.0)
    return out


def memory(tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dp2, dp4 = ["parallel.pp=2", "parallel.ep=1", "parallel.dp=2"], ["parallel.pp=1", "parallel.ep=1", "parallel.dp=4", "schedule.name=1f1b"]
    layouts = {"dp2": dp2, "dp4": dp4, "dp2_bf16": dp2 + ["model.dtype=bfloat16"]}
    for name, layout in layouts.items():
        for zero in (0, 1, 2):
            _, rows = _train(layout + ["train.steps=1", f"train.zero_stage={zero}"], tmp / f"mem-{name}-zero{zero}")
            record = next(r for r in rows if r["kind"] == "memory")
            out[f"{name}_zero{zero}"] = {k: record[k] for k in ("params", "grads", "master", "optimizer")}
    for name in layouts:
        base = out[f"{name}_zero0"]
        for zero in (1, 2):
            e = out[f"{name}_zero{zero}"]
            e["master_plus_optimizer_vs_zero0"] = (e["master"] + e["optimizer"]) / (base["master"] + base["optimizer"])
            e["grads_vs_zero0"] = e["grads"] / base["grads"]
    return out


def overlap(steps: int, tmp: Path) -> dict[str, Any]:
    out = {}
    layout = ["parallel.pp=2", "parallel.ep=1", "parallel.dp=2", f"train.steps={steps}"]
    for on in (True, False):
        _, rows = _train(layout + [f"train.overlap_grad_sync={str(on).lower()}"], tmp / f"overlap-{on}")
        train = [r for r in rows if r["kind"] == "train"][1:]  # the first step pays one-time costs
        out["on" if on else "off"] = {
            "median_step_s": statistics.median(r["step_s"] for r in train),
            "median_grad_sync_exposed_s": statistics.median(r["grad_sync_exposed_s"] for r in train),
        }
    out["exposed_on_vs_off"] = out["on"]["median_grad_sync_exposed_s"] / out["off"]["median_grad_sync_exposed_s"]
    return out


def moments(steps: int, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    common = [f"train.steps={steps}", "train.lr=3e-4", "train.min_lr=3e-5", f"train.lr_schedule_steps={steps}"]
    for compute in ("float32", "bfloat16"):
        entry: dict[str, Any] = {}
        for kept in ("float32", "bfloat16"):
            summary, rows = _train(common + [f"model.dtype={compute}", f"train.moments_dtype={kept}"], tmp / f"moments-{compute}-{kept}")
            record = next(r for r in rows if r["kind"] == "memory")
            entry[kept] = {"val_loss": summary["val_loss"], "final_loss_avg5": summary["final_loss_avg5"],
                           "median_step_s": summary["median_step_s"], "optimizer_bytes_per_rank": record["optimizer"],
                           "master_bytes_per_rank": record["master"]}
            print(f"{compute} compute, {kept} moments: val {summary['val_loss']:.4f}", file=sys.stderr)
        f32, bf16 = entry["float32"], entry["bfloat16"]
        entry["val_loss_bf16_vs_f32_pct"] = 100.0 * (bf16["val_loss"] / f32["val_loss"] - 1.0)
        entry["optimizer_bytes_bf16_vs_f32"] = bf16["optimizer_bytes_per_rank"] / f32["optimizer_bytes_per_rank"]
        out[f"{compute}_compute"] = entry
    return out


def ema(steps: int, rounds: int, tmp: Path) -> dict[str, Any]:
    """Paired rounds: each round trains with the EMA off and on, in alternating order (the load of a
    shared machine drifts; a pair sees the same load), and its ratio is the on run's median
    iteration over the off run's; the rounds' ratios are reported with their min and median."""
    iters: dict[str, list[float]] = {"off": [], "on": []}
    out: dict[str, Any] = {"rounds": []}
    shares: list[float] = []
    cpu_shares: list[float] = []
    for r in range(rounds):
        pair = (("off", []), ("on", ["train.ema_decay=0.99"]))
        medians = {}
        for name, sets in pair if r % 2 == 0 else pair[::-1]:
            summary, rows = _train([f"train.steps={steps}", "train.lr=3e-4", *sets], tmp / f"ema-{name}-{r}")
            run = [row["iter_s"] for row in rows if row["kind"] == "train"][1:]  # the first step pays one-time costs
            iters[name] += run
            medians[name] = statistics.median(run)
            if name == "on":  # the training thread's own time in the EMA's update (the copy out), per step, and
                # with the background thread's processor time in the fold: all the EMA takes from the cores
                trained = [row for row in rows if row["kind"] == "train"][1:]
                shares += [row["ema_s"] / row["iter_s"] for row in trained]
                cpu_shares += [(row["ema_s"] + row["ema_fold_s"]) / row["iter_s"] for row in trained[1:]]
            record = next(row for row in rows if row["kind"] == "memory")
            out[name] = {"val_loss": summary["val_loss"], "val_loss_ema": summary.get("val_loss_ema"), "ema_host_bytes_per_rank": record.get("ema_host", 0)}
        out["rounds"].append({"median_iter_off_s": medians["off"], "median_iter_on_s": medians["on"], "on_vs_off": medians["on"] / medians["off"]})
    for name in iters:
        out[name]["median_iter_s"] = statistics.median(iters[name])
    ratios = [r["on_vs_off"] for r in out["rounds"]]
    out["iter_on_vs_off_min"], out["iter_on_vs_off_median"] = min(ratios), statistics.median(ratios)
    out["iter_on_vs_off"] = out["on"]["median_iter_s"] / out["off"]["median_iter_s"]  # pooled over every round
    out["ema_thread_share_median"], out["ema_thread_share_max"] = statistics.median(shares), max(shares)
    out["ema_cpu_share_median"], out["ema_cpu_share_max"] = statistics.median(cpu_shares), max(cpu_shares)
    print(f"ema: iteration {out['iter_on_vs_off_median']:.3f}x (median of {rounds} paired rounds, min {out['iter_on_vs_off_min']:.3f}x); "
          f"the training thread's EMA update {100 * out['ema_thread_share_median']:.2f}% of the iteration (median), "
          f"with the fold's processor time {100 * out['ema_cpu_share_median']:.2f}%", file=sys.stderr)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, entry in result["precision"].items():
        steps, losses = zip(*entry["curve"])
        ax.plot(steps, losses, label=f"{name} (val {entry['val_loss']:.3f})", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("examples/cpu.yaml, lr 3e-4")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="training steps of each precision run")
    ap.add_argument("--overlap-steps", type=int, default=30)
    ap.add_argument("--moments-steps", type=int, default=300, help="training steps of each moments-dtype run")
    ap.add_argument("--ema-steps", type=int, default=40, help="training steps of each EMA on / off run")
    ap.add_argument("--ema-rounds", type=int, default=3, help="EMA on / off runs taking turns")
    ap.add_argument("--png", type=Path, default=None)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: precision, memory, overlap, moments, ema")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    result: dict[str, Any] = {"machine": {"processor": platform.processor(), "torch": torch.__version__}, "steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        for part, run in (("overlap", lambda: overlap(args.overlap_steps, Path(tmp))), ("memory", lambda: memory(Path(tmp))),
                          ("precision", lambda: precision(args.steps, Path(tmp))), ("moments", lambda: moments(args.moments_steps, Path(tmp))),
                          ("ema", lambda: ema(args.ema_steps, args.ema_rounds, Path(tmp)))):
            if part not in skip:
                result[part] = run()
                print(json.dumps({part: result[part]}), file=sys.stderr, flush=True)  # a long run's parts as they finish
    if args.png is not None and "precision" in result:
        plot(result, args.png)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
